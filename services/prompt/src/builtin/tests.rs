#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use minijinja::{Environment, UndefinedBehavior};
use serde_json::json;

use super::*;
use crate::normalise::{ACTIONS, Normalised};

fn template(id: &str) -> BuiltinTemplate {
    find(id).unwrap().unwrap()
}

/// Renders as the engine does (strict undefined), with or without block trimming.
fn render_with(id: &str, terms: &Value, trim: bool) -> Result<String, minijinja::Error> {
    let template = template(id);
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    env.set_trim_blocks(trim);
    env.set_lstrip_blocks(trim);
    env.add_template(template.id, template.prompt)?;
    env.get_template(template.id)?.render(terms)
}

/// Renders, and checks the output does not depend on block trimming.
fn render(id: &str, terms: &Value) -> Result<String, minijinja::Error> {
    let plain = render_with(id, terms, false)?;
    assert_eq!(render_with(id, terms, true)?, plain, "{id}: trim_blocks");
    Ok(plain)
}

fn validator(id: &str) -> jsonschema::Validator {
    jsonschema::validator_for(&template(id).schema).unwrap()
}

fn normalise(id: &str, value: &mut Value) -> Normalised {
    (template(id).normalise.unwrap())(value)
}

fn keep(warnings: &[&str]) -> Normalised {
    Normalised::Keep {
        warnings: warnings.iter().map(|w| (*w).to_owned()).collect(),
    }
}

fn skip(reason: &str) -> Normalised {
    Normalised::Skip {
        reason: reason.to_owned(),
    }
}

/// The LLM streaming contract (docs/specs.md#the-structured-ndjson-contracts) Phase 1's "Formatted
/// Blocks Example" as terms.
fn classification_terms() -> Value {
    json!({"blocks": [
        {"block_id": "abc123", "content": "- Learned that Python's asyncio.Queue is thread-safe\n  This is important for background tasks in Textual"},
        {"block_id": "def456", "content": "- Had lunch with Sarah\n  Discussed project timeline"},
        {"block_id": "ghi789", "content": "- Discovered that ChromaDB requires sentence-transformers\n  It downloads a 90MB model on first run"},
    ]})
}

/// The LLM streaming contract Phase 3's "Formatted Knowledge and Candidates Example" as terms.
fn integration_terms() -> Value {
    json!({"knowledge_blocks": [{
        "block_id": "abc123",
        "content": "Python's asyncio.Queue is thread-safe, making it suitable for communication between background tasks and the main thread in Textual applications.",
        "original_context": "[[Python]] [[Textual]] [[Concurrency]]",
        "candidate_pages": [
            {"page_name": "Python/Concurrency", "structure": "- Threading vs Asyncio\n  - Threading uses locks for shared state\n  - Asyncio uses coroutines\n\n- Common Patterns\n  id:: pattern-section-123"},
            {"page_name": "Textual/Architecture", "structure": "- Widget Lifecycle\n- Message Passing\n  id:: message-section-456\n\n- Worker Threads\n  id:: worker-section-789"},
            {"page_name": "Python/Data Structures", "structure": "- Lists and Tuples\n- Dictionaries\n- Sets"},
        ],
    }]})
}

/// sluice's three and each contract's own.
const SLUICES: [&str; 3] = [
    "knowledge-classification",
    "content-rewording",
    "integration-decisions",
];

#[test]
fn every_builtin_is_jsonl_with_a_valid_schema_a_normaliser_its_phases_temperature_and_its_seeds_retries()
 {
    let ids: Vec<_> = all().unwrap().iter().map(|t| t.id).collect();
    let mut expected: Vec<String> = SLUICES.iter().map(|s| (*s).to_owned()).collect();
    for seed in ["000", "001", "002"] {
        expected.extend(SLUICES.iter().map(|s| format!("{s}-seed-{seed}")));
    }
    assert_eq!(ids, expected);
    for t in all().unwrap() {
        assert_eq!(t.response_type, ResponseType::Jsonl);
        assert!(t.normalise.is_some());
        let schema = t.schema.clone();
        assert_eq!(
            schema["$schema"],
            "https://json-schema.org/draft/2020-12/schema"
        );
        assert!(jsonschema::meta::is_valid(&schema), "{}", t.id);
        assert!(jsonschema::validator_for(&schema).is_ok(), "{}", t.id);
        // The system prompt asks for NDJSON; sluice's user prompts say it again.
        assert!(t.system.contains("one JSON object per line"), "{}", t.id);
        assert_eq!(
            t.prompt
                .contains("Output one JSON object per line (NDJSON format)"),
            SLUICES.contains(&t.id),
            "{}",
            t.id
        );
        // the LLM streaming contract and the LLM API contracts
        // (docs/specs.md#the-structured-ndjson-contracts) set each phase's temperature; the NDJSON
        // parser contract (docs/specs.md#the-structured-ndjson-contracts) sets none.
        let phase = if t.id.starts_with("knowledge-classification") {
            0.3
        } else if t.id.starts_with("content-rewording") {
            0.5
        } else {
            0.4
        };
        let expected = (!t.id.ends_with("-seed-002")).then_some(phase);
        assert_eq!(t.temperature, expected, "{}", t.id);
        // Each contract's template retries as its contract says; sluice's leave the processor's
        // policy.
        let seed = t.id.rsplit_once("-seed-").map(|(_, n)| format!("seed-{n}"));
        assert_eq!(t.retry.map(str::to_owned), seed, "{}", t.id);
        if let Some(preset) = t.retry {
            assert!(
                sluice_schema::RetryPolicy::preset(preset).is_some(),
                "{preset}"
            );
        }
    }
    assert!(find("nope").unwrap().is_none());
}

/// The files' final newline (editors add one) is not part of the text: the prompts end with
/// their last sentence, as the contracts' prompts do.
#[test]
fn a_files_final_newline_is_not_text() {
    for (files, t) in FILES.iter().zip(all().unwrap()) {
        assert_eq!(files.id, t.id);
        for (file, text) in [(files.system, t.system), (files.prompt, t.prompt)] {
            assert!(!text.ends_with('\n'), "{}", t.id);
            assert!(file.starts_with(text), "{}", t.id);
            assert!(file.len() - text.len() <= 1, "{}", t.id);
        }
        if SLUICES.contains(&t.id) {
            assert!(t.prompt.ends_with("no other text."), "{}", t.id);
        }
    }
    assert_eq!(text("a\n\n"), "a\n");
    assert_eq!(text("a"), "a");
}

/// The integration schema's actions are the ones the normaliser keeps (it turns any other into
/// `skip`, which the schema must then accept).
#[test]
fn the_integration_schemas_actions_are_the_normalisers() {
    for id in [
        INTEGRATION_DECISIONS,
        "integration-decisions-seed-001",
        INTEGRATION_DECISIONS_SEED_002,
    ] {
        let schema = template(id).schema;
        assert_eq!(
            schema["properties"]["action"]["enum"],
            json!(ACTIONS),
            "{id}"
        );
    }
    assert_eq!(
        template("integration-decisions-seed-000").schema["properties"]["action"]["enum"],
        json!(crate::normalise::ACTIONS_SEED_000)
    );
}

#[test]
fn each_builtin_names_a_registered_normaliser() {
    let names: Vec<_> = crate::normalise::names().collect();
    assert_eq!(names.len(), 9);
    for files in &FILES {
        assert!(names.contains(&files.normaliser), "{}", files.id);
        assert!(crate::normalise::by_name(files.normaliser).is_some());
    }
    assert!(crate::normalise::by_name("nope").is_none());
}

#[test]
fn classification_renders_seed_000_formatted_blocks() {
    let out = render(KNOWLEDGE_CLASSIFICATION, &classification_terms()).unwrap();
    let seed = "Analyze these journal blocks:\n\n\
        Block ID: abc123\n\
        Content: - Learned that Python's asyncio.Queue is thread-safe\n  This is important for background tasks in Textual\n\n\
        Block ID: def456\n\
        Content: - Had lunch with Sarah\n  Discussed project timeline\n\n\
        Block ID: ghi789\n\
        Content: - Discovered that ChromaDB requires sentence-transformers\n  It downloads a 90MB model on first run";
    assert_eq!(
        out,
        format!(
            "{seed}\n\nOutput one JSON object per line (NDJSON format), only for the blocks that are knowledge: no JSON array, no code fences, no other text."
        )
    );
}

#[test]
fn rewording_renders_seed_000_formatted_blocks() {
    let terms = json!({"blocks": [
        {"block_id": "abc123", "content": "- Learned today that Python's asyncio.Queue is thread-safe\n  This is important for background tasks in Textual\n  I should remember this when designing concurrent systems"},
        {"block_id": "ghi789", "content": "- Yesterday discovered that ChromaDB requires sentence-transformers\n  It downloads a 90MB model on first run"},
    ]});
    let out = render(CONTENT_REWORDING, &terms).unwrap();
    let seed = "Reword these knowledge blocks:\n\n\
        Block ID: abc123\n\
        Original Content: - Learned today that Python's asyncio.Queue is thread-safe\n  This is important for background tasks in Textual\n  I should remember this when designing concurrent systems\n\n\
        Block ID: ghi789\n\
        Original Content: - Yesterday discovered that ChromaDB requires sentence-transformers\n  It downloads a 90MB model on first run";
    assert_eq!(
        out,
        format!(
            "{seed}\n\nOutput one JSON object per line (NDJSON format), one for each block: no JSON array, no code fences, no other text."
        )
    );
}

#[test]
fn integration_renders_seed_000_knowledge_and_candidates() {
    let out = render(INTEGRATION_DECISIONS, &integration_terms()).unwrap();
    // The LLM streaming contract's example, byte for byte (up to its closing fence).
    let seed = "Decide integration for these knowledge blocks and candidate pages:

Knowledge Block ID: abc123
Content: Python's asyncio.Queue is thread-safe, making it suitable for communication between background tasks and the main thread in Textual applications.
Original Context: [[Python]] [[Textual]] [[Concurrency]]

Candidate Pages:

1. Page: Python/Concurrency
   Existing Structure:

   - Threading vs Asyncio
     - Threading uses locks for shared state
     - Asyncio uses coroutines

   - Common Patterns
     id:: pattern-section-123

2. Page: Textual/Architecture
   Existing Structure:

   - Widget Lifecycle
   - Message Passing
     id:: message-section-456

   - Worker Threads
     id:: worker-section-789

3. Page: Python/Data Structures
   Existing Structure:

   - Lists and Tuples
   - Dictionaries
   - Sets";
    assert_eq!(
        out,
        format!(
            "{seed}\n\nOutput one JSON object per line (NDJSON format), only for the relevant integrations: no JSON array, no code fences, no other text."
        )
    );
}

#[test]
fn integration_original_context_is_optional_and_blocks_are_separated() {
    let mut terms = integration_terms();
    let block = terms["knowledge_blocks"][0].clone();
    let mut second = block.clone();
    second["block_id"] = json!("ghi789");
    second["original_context"] = Value::Null;
    second["candidate_pages"] = json!([{"page_name": "ChromaDB", "structure": "- Setup"}]);
    let mut third = block.clone();
    third.as_object_mut().unwrap().remove("original_context");
    third["block_id"] = json!("jkl012");
    terms["knowledge_blocks"] = json!([block, second, third]);
    let out = render(INTEGRATION_DECISIONS, &terms).unwrap();
    assert_eq!(out.matches("Original Context:").count(), 1);
    assert!(out.contains(
        "\n\nKnowledge Block ID: ghi789\nContent: Python's asyncio.Queue is thread-safe, making it suitable for communication between background tasks and the main thread in Textual applications.\n\nCandidate Pages:\n\n1. Page: ChromaDB\n   Existing Structure:\n\n   - Setup\n\nKnowledge Block ID: jkl012\n"
    ));
}

#[test]
fn a_missing_term_fails_rendering() {
    for (id, terms) in [
        (KNOWLEDGE_CLASSIFICATION, json!({})),
        (
            KNOWLEDGE_CLASSIFICATION,
            json!({"blocks": [{"block_id": "abc123"}]}),
        ),
        (CONTENT_REWORDING, json!({"items": []})),
        (CONTENT_REWORDING, json!({"blocks": [{"content": "x"}]})),
        (INTEGRATION_DECISIONS, json!({"blocks": []})),
        (
            INTEGRATION_DECISIONS,
            json!({"knowledge_blocks": [{"block_id": "a", "content": "x"}]}),
        ),
        (
            INTEGRATION_DECISIONS,
            json!({"knowledge_blocks": [{"block_id": "a", "content": "x",
                "candidate_pages": [{"page_name": "P"}]}]}),
        ),
    ] {
        let err = render_with(id, &terms, false).unwrap_err();
        assert_eq!(
            err.kind(),
            minijinja::ErrorKind::UndefinedError,
            "{id}: {terms}"
        );
    }
}

// The NDJSON parser contract's objects use other field names (`page`, `target_id`, `refined_text`,
// no `reason`): not valid lines of the LLM streaming contract's templates, and exactly the lines of
// the NDJSON parser contract's, kept as written (its section 1 examples: 3, 3 and 2 objects).
#[test]
fn seed_002s_lines_are_its_own_templates_lines() {
    let decisions = [
        json!({"page": "Software Architecture", "action": "add_section", "target_id": null, "target_title": null, "confidence": 0.88, "reasoning": "New root section"}),
        json!({"page": "Microservices", "action": "add_under", "target_id": "block-uuid-123", "target_title": "Benefits", "confidence": 0.91, "reasoning": "Fits under Benefits"}),
        json!({"page": "Docker", "action": "skip", "target_id": null, "target_title": null, "confidence": 0.95, "reasoning": "Already covered"}),
    ];
    let rewordings = [
        json!({"block_id": "abc123", "refined_text": "Bounded contexts matter more than service size.\nEach context should have clear ownership."}),
        json!({"block_id": "def456", "refined_text": "HNSW provides O(log n) nearest neighbor search.\nTrade-off between recall and speed via ef_construction parameter."}),
    ];
    let classifications = [
        json!({"block_id": "abc123", "is_knowledge": true, "confidence": 0.85}),
        json!({"block_id": "def456", "is_knowledge": false, "confidence": 0.92}),
        json!({"block_id": "ghi789", "is_knowledge": true, "confidence": 0.78}),
    ];
    for (lines, ours, theirs) in [
        (
            &decisions[..],
            INTEGRATION_DECISIONS,
            INTEGRATION_DECISIONS_SEED_002,
        ),
        (
            &rewordings[..],
            CONTENT_REWORDING,
            CONTENT_REWORDING_SEED_002,
        ),
        (
            &classifications[..],
            KNOWLEDGE_CLASSIFICATION,
            KNOWLEDGE_CLASSIFICATION_SEED_002,
        ),
    ] {
        for line in lines {
            assert!(!validator(ours).is_valid(line), "{ours}: {line}");
            let (outcome, value) = normalised(theirs, line.clone());
            assert_eq!(outcome, keep(&[]), "{theirs}: {line}");
            assert_eq!(&value, line, "kept as written");
        }
    }
}

/// The LLM API contracts' classification lines have no `is_knowledge`: its own template keeps
/// them (the LLM streaming contract's drops them), and one that writes `is_knowledge` anyway
/// must write a boolean.
#[test]
fn seed_001s_classification_lines_are_its_own_templates_lines() {
    let lines = [
        json!({"block_id": "abc123", "confidence": 0.85, "reason": "This block contains a technical insight about Python's asyncio.Queue that is evergreen and worth preserving for future reference."}),
        json!({"block_id": "ghi789", "confidence": 0.92, "reason": "Documents a specific ChromaDB requirement that is useful for future project setup."}),
    ];
    for line in &lines {
        let (outcome, _) = normalised(KNOWLEDGE_CLASSIFICATION, line.clone());
        assert_eq!(outcome, skip("missing required field `is_knowledge`"));
        let (outcome, value) = normalised(KNOWLEDGE_CLASSIFICATION_SEED_001, line.clone());
        assert_eq!(outcome, keep(&[]));
        assert_eq!(&value, line);
    }
    let mut stringly = lines[0].clone();
    stringly["is_knowledge"] = json!("true");
    let (outcome, _) = normalised(KNOWLEDGE_CLASSIFICATION_SEED_001, stringly);
    assert_eq!(outcome, skip("field `is_knowledge` is not a boolean"));
    let mut no_reason = lines[0].clone();
    no_reason.as_object_mut().unwrap().remove("reason");
    let (outcome, _) = normalised(KNOWLEDGE_CLASSIFICATION_SEED_001, no_reason);
    assert_eq!(outcome, skip("missing required field `reason`"));
}

/// The NDJSON parser contract's decision rules under its names: a missing `target_id` for
/// `add_under` makes it `add_section`, an unknown action `skip`, confidence is clamped.
#[test]
fn seed_002s_decision_rules_apply_to_its_names() {
    let (outcome, value) = normalised(
        INTEGRATION_DECISIONS_SEED_002,
        json!({"page": "Microservices", "action": "add_under", "target_id": null, "target_title": "Benefits", "confidence": 1.3, "reasoning": "Fits."}),
    );
    assert_eq!(
        outcome,
        keep(&[
            "confidence above 1 clamped to 1",
            "`add_under` without target_id changed to `add_section`"
        ])
    );
    assert_eq!(value["action"], "add_section");
    assert_eq!(value["target_title"], Value::Null);
    let (outcome, value) = normalised(
        INTEGRATION_DECISIONS_SEED_002,
        json!({"page": "Docker", "action": "merge", "confidence": 0.5, "reasoning": "?"}),
    );
    assert_eq!(outcome, keep(&["unknown action replaced by `skip`"]));
    assert_eq!(value["action"], "skip");
    let (outcome, _) = normalised(
        INTEGRATION_DECISIONS_SEED_002,
        json!({"action": "skip", "confidence": 0.5, "reasoning": "no page"}),
    );
    assert_eq!(outcome, skip("missing required field `page`"));
    let (outcome, _) = normalised(
        CONTENT_REWORDING_SEED_002,
        json!({"block_id": "abc123", "refined_text": "  "}),
    );
    assert_eq!(outcome, skip("field `refined_text` is empty"));
}

/// The LLM streaming contract's and the LLM API contracts' prompts verbatim: the user message is
/// exactly the contract's (sluice's own adds one sentence), the system prompts are the
/// contracts'.
#[test]
fn the_seeds_own_templates_send_the_seeds_text() {
    let sluice = render(KNOWLEDGE_CLASSIFICATION, &classification_terms()).unwrap();
    for id in [
        "knowledge-classification-seed-000",
        "knowledge-classification-seed-001",
    ] {
        let verbatim = render(id, &classification_terms()).unwrap();
        assert!(verbatim.starts_with("Analyze these journal blocks:\n\nBlock ID: abc123\n"));
        assert!(
            verbatim.ends_with("It downloads a 90MB model on first run"),
            "{id}"
        );
        assert!(sluice.starts_with(&verbatim), "{id}");
    }
    assert_eq!(
        template("knowledge-classification-seed-000").system,
        template(KNOWLEDGE_CLASSIFICATION).system
    );
    let seed_001 = template("knowledge-classification-seed-001").system;
    assert!(seed_001.starts_with("You are an AI assistant that identifies lasting knowledge in journal entries. Analyze the provided blocks and return ONLY those"));
    assert!(
        seed_001.ends_with("reason (string explaining why this is knowledge worth preserving).")
    );
    assert!(
        template("integration-decisions-seed-001")
            .system
            .contains("or 'skip' (not relevant for this page)")
    );
    assert!(
        template("content-rewording-seed-001")
            .system
            .ends_with("Each object must have: block_id (string), reworded_content (string).")
    );
}

/// The NDJSON parser contract's inputs: blocks with `hierarchy`; one `knowledge_block` with
/// `candidate_pages` and their `chunks`; the accepted `decisions`, each knowledge block reworded
/// once.
#[test]
fn seed_002s_inputs_render() {
    let out = render(
        KNOWLEDGE_CLASSIFICATION_SEED_002,
        &json!({"blocks": [
            {"block_id": "abc123", "content": "Read paper on vector databases", "hierarchy": "- Reading"},
            {"block_id": "def456", "content": "Dentist appointment at 3pm", "hierarchy": ""},
        ]}),
    )
    .unwrap();
    assert_eq!(
        out,
        "Classify these journal blocks:\n\nBlock ID: abc123\nContent: Read paper on vector databases\nContext: - Reading\n\nBlock ID: def456\nContent: Dentist appointment at 3pm"
    );
    let out = render(
        INTEGRATION_DECISIONS_SEED_002,
        &json!({
            "knowledge_block": {"block_id": "abc123", "content": "Bounded contexts matter",
                                "hierarchical_text": "- Bounded contexts matter\n  - more than size"},
            "candidate_pages": [
                {"page_name": "Microservices", "similarity_score": 0.9, "chunks": [
                    {"target_id": "block-uuid-123", "content": "Benefits of services", "title": "Benefits"}]},
                {"page_name": "Docker", "similarity_score": 0.4, "chunks": []},
            ]}),
    )
    .unwrap();
    assert_eq!(
        out,
        "Decide where this knowledge goes:\n\nKnowledge Block ID: abc123\nContent: - Bounded contexts matter\n  - more than size\n\nCandidate Pages:\n\n1. Page: Microservices\n   - Block ID: block-uuid-123\n     Title: Benefits\n     Content: Benefits of services\n\n2. Page: Docker"
    );
    let out = render(
        CONTENT_REWORDING_SEED_002,
        &json!({"decisions": [
            {"knowledge_block_id": "abc123", "page": "A", "action": "add_section", "full_text": "Today I learned X", "hierarchical_text": ""},
            {"knowledge_block_id": "def456", "page": "A", "action": "add_under", "full_text": "Y [[Link]]", "hierarchical_text": "- Y [[Link]]"},
            {"knowledge_block_id": "abc123", "page": "B", "action": "replace", "full_text": "Today I learned X", "hierarchical_text": ""},
        ]}),
    )
    .unwrap();
    assert_eq!(
        out,
        "Reword these knowledge blocks:\n\nBlock ID: abc123\nContent: Today I learned X\n\nBlock ID: def456\nContent: - Y [[Link]]"
    );
}

#[test]
fn schemas_reject_what_the_models_reject() {
    let c = validator(KNOWLEDGE_CLASSIFICATION);
    let ok = json!({"block_id": "a", "is_knowledge": true, "confidence": 0.5, "reason": "r", "extra": 1});
    assert!(c.is_valid(&ok));
    for (field, bad) in [
        ("confidence", json!(1.5)),
        ("confidence", json!("high")),
        ("is_knowledge", json!("true")),
        ("block_id", json!(7)),
        ("reason", Value::Null),
    ] {
        let mut v = ok.clone();
        v[field] = bad;
        assert!(!c.is_valid(&v), "{field}");
    }
    let r = validator(CONTENT_REWORDING);
    assert!(!r.is_valid(&json!({"block_id": "a", "reworded_content": ""})));
    let i = validator(INTEGRATION_DECISIONS);
    let ok = json!({"knowledge_block_id": "a", "target_page": "P", "action": "skip", "confidence": 0.1, "reasoning": "r"});
    assert!(i.is_valid(&ok));
    let mut v = ok.clone();
    v["action"] = json!("merge");
    assert!(!i.is_valid(&v));
    let mut v = ok.clone();
    v["target_block_title"] = json!(3);
    assert!(!i.is_valid(&v));
}

fn classification_line() -> Value {
    json!({"block_id": "abc123", "is_knowledge": true, "confidence": 0.9, "reason": "Lasting insight."})
}

fn decision(action: &str) -> Value {
    json!({"knowledge_block_id": "abc123", "target_page": "Python/Concurrency", "action": action,
        "target_block_id": "pattern-section-123", "target_block_title": "Common Patterns",
        "confidence": 0.9, "reasoning": "Fits."})
}

/// Normalises, and checks that a kept object then passes the schema.
fn normalised(id: &str, mut value: Value) -> (Normalised, Value) {
    let outcome = normalise(id, &mut value);
    if matches!(outcome, Normalised::Keep { .. }) {
        assert!(validator(id).is_valid(&value), "{id}: {value}");
    }
    (outcome, value)
}

#[test]
fn rule_not_an_object_is_dropped() {
    for id in [
        KNOWLEDGE_CLASSIFICATION,
        CONTENT_REWORDING,
        INTEGRATION_DECISIONS,
    ] {
        for value in [json!([classification_line()]), json!("text"), json!(3)] {
            assert_eq!(normalised(id, value).0, skip("not a JSON object"));
        }
    }
}

#[test]
fn rule_missing_required_field_is_dropped() {
    for field in ["block_id", "is_knowledge", "confidence", "reason"] {
        let mut v = classification_line();
        v.as_object_mut().unwrap().remove(field);
        assert_eq!(
            normalised(KNOWLEDGE_CLASSIFICATION, v).0,
            skip(&format!("missing required field `{field}`"))
        );
    }
    assert_eq!(
        normalised(CONTENT_REWORDING, json!({"block_id": "a"})).0,
        skip("missing required field `reworded_content`")
    );
    assert_eq!(
        normalised(CONTENT_REWORDING, json!({"reworded_content": "x"})).0,
        skip("missing required field `block_id`")
    );
    for field in [
        "knowledge_block_id",
        "target_page",
        "action",
        "confidence",
        "reasoning",
    ] {
        let mut v = decision("add_section");
        v.as_object_mut().unwrap().remove(field);
        assert_eq!(
            normalised(INTEGRATION_DECISIONS, v).0,
            skip(&format!("missing required field `{field}`"))
        );
    }
}

#[test]
fn rule_invalid_type_is_dropped() {
    for (field, bad, kind) in [
        ("confidence", json!("high"), "a number"),
        ("is_knowledge", json!("true"), "a boolean"),
        ("block_id", json!(123), "a string"),
        ("reason", Value::Null, "a string"),
    ] {
        let mut v = classification_line();
        v[field] = bad;
        assert_eq!(
            normalised(KNOWLEDGE_CLASSIFICATION, v).0,
            skip(&format!("field `{field}` is not {kind}"))
        );
    }
    assert_eq!(
        normalised(
            CONTENT_REWORDING,
            json!({"block_id": "a", "reworded_content": ["x"]})
        )
        .0,
        skip("field `reworded_content` is not a string")
    );
    for (field, bad, kind) in [
        ("confidence", json!("high"), "a number"),
        ("reasoning", json!(42), "a string"),
        ("target_page", json!(null), "a string"),
    ] {
        let mut v = decision("add_section");
        v[field] = bad;
        assert_eq!(
            normalised(INTEGRATION_DECISIONS, v).0,
            skip(&format!("field `{field}` is not {kind}"))
        );
    }
}

#[test]
fn rule_empty_block_id_is_dropped() {
    let mut v = classification_line();
    v["block_id"] = json!("");
    assert_eq!(
        normalised(KNOWLEDGE_CLASSIFICATION, v).0,
        skip("field `block_id` is empty")
    );
    assert_eq!(
        normalised(
            CONTENT_REWORDING,
            json!({"block_id": "  ", "reworded_content": "x"})
        )
        .0,
        skip("field `block_id` is empty")
    );
    let mut v = decision("add_section");
    v["knowledge_block_id"] = json!("");
    assert_eq!(
        normalised(INTEGRATION_DECISIONS, v).0,
        skip("field `knowledge_block_id` is empty")
    );
}

#[test]
fn rule_confidence_is_clamped() {
    for (id, line) in [
        (KNOWLEDGE_CLASSIFICATION, classification_line()),
        (INTEGRATION_DECISIONS, decision("add_under")),
    ] {
        for (raw, clamped, warning) in [
            (json!(1.3), 1.0, "confidence above 1 clamped to 1"),
            (json!(2), 1.0, "confidence above 1 clamped to 1"),
            (json!(-0.2), 0.0, "confidence below 0 clamped to 0"),
        ] {
            let mut v = line.clone();
            v["confidence"] = raw;
            let (outcome, v) = normalised(id, v);
            assert_eq!(outcome, keep(&[warning]), "{id}");
            assert_eq!(v["confidence"].as_f64(), Some(clamped));
        }
        for edge in [json!(0), json!(1.0), json!(0.5)] {
            let mut v = line.clone();
            v["confidence"] = edge.clone();
            let (outcome, v) = normalised(id, v);
            assert_eq!(outcome, keep(&[]));
            assert_eq!(v["confidence"], edge);
        }
    }
}

#[test]
fn rule_unknown_fields_are_kept() {
    let mut v = classification_line();
    v["extra_field"] = json!(["tag"]);
    let (outcome, after) = normalised(KNOWLEDGE_CLASSIFICATION, v.clone());
    assert_eq!(outcome, keep(&[]));
    assert_eq!(after, v);
    // is_knowledge false (the NDJSON parser contract's activity lines) is a valid answer, kept as
    // is.
    let mut v = classification_line();
    v["is_knowledge"] = json!(false);
    assert_eq!(normalised(KNOWLEDGE_CLASSIFICATION, v).0, keep(&[]));
}

#[test]
fn rule_empty_reworded_content_is_dropped() {
    for content in ["", "   ", "\n\t"] {
        assert_eq!(
            normalised(
                CONTENT_REWORDING,
                json!({"block_id": "a", "reworded_content": content})
            )
            .0,
            skip("field `reworded_content` is empty")
        );
    }
}

#[test]
fn rule_reworded_content_is_plain_block_content() {
    let warning = "reworded_content was a bullet outline; bullet markers and indentation removed";
    for (raw, plain) in [
        (
            "- Bounded contexts matter more than service size.\n  - Each context should have clear ownership.\n  - Avoid sharing databases across contexts.",
            "Bounded contexts matter more than service size.\nEach context should have clear ownership.\nAvoid sharing databases across contexts.",
        ),
        (
            "* Main point.\n  continuation [[Link]] ((ref))",
            "Main point.\ncontinuation [[Link]] ((ref))",
        ),
        ("- Single bullet", "Single bullet"),
    ] {
        let (outcome, v) = normalised(
            CONTENT_REWORDING,
            json!({"block_id": "a", "reworded_content": raw}),
        );
        assert_eq!(outcome, keep(&[warning]));
        assert_eq!(v["reworded_content"], plain);
    }
    // No bullet line: untouched, indentation included.
    for raw in [
        "Main point.\nSupporting detail.",
        "Use:\n    let x = -1;\n-5 degrees is cold; --- is a rule; **bold**",
    ] {
        let (outcome, v) = normalised(
            CONTENT_REWORDING,
            json!({"block_id": "a", "reworded_content": raw}),
        );
        assert_eq!(outcome, keep(&[]));
        assert_eq!(v["reworded_content"], raw);
    }
}

#[test]
fn rule_unknown_action_becomes_skip() {
    for bad in [json!("merge"), json!("ADD_UNDER"), json!(3), Value::Null] {
        let mut v = decision("x");
        v["action"] = bad;
        let (outcome, v) = normalised(INTEGRATION_DECISIONS, v);
        assert_eq!(
            outcome,
            keep(&[
                "unknown action replaced by `skip`",
                "targets cleared: `skip` takes no target block"
            ])
        );
        assert_eq!(v["action"], "skip");
        assert!(v["target_block_id"].is_null() && v["target_block_title"].is_null());
    }
}

#[test]
fn rule_targeted_action_without_target_becomes_add_section() {
    for action in ["add_under", "replace"] {
        for target in [
            Some(Value::Null),
            Some(json!("")),
            Some(json!(" ")),
            Some(json!(7)),
            None,
        ] {
            let mut v = decision(action);
            match &target {
                Some(t) => v["target_block_id"] = t.clone(),
                None => {
                    v.as_object_mut().unwrap().remove("target_block_id");
                }
            }
            let (outcome, v) = normalised(INTEGRATION_DECISIONS, v);
            assert_eq!(
                outcome,
                keep(&[&format!(
                    "`{action}` without target_block_id changed to `add_section`"
                )]),
                "{action} {target:?}"
            );
            assert_eq!(v["action"], "add_section");
            assert!(v["target_block_title"].is_null());
            assert!(v.get("target_block_id").is_none_or(Value::is_null));
        }
    }
}

#[test]
fn rule_targeted_action_without_title_is_kept_with_a_warning() {
    for action in ["add_under", "replace"] {
        let mut v = decision(action);
        v["target_block_title"] = Value::Null;
        let (outcome, after) = normalised(INTEGRATION_DECISIONS, v.clone());
        assert_eq!(
            outcome,
            keep(&[&format!("`{action}` has no target_block_title")])
        );
        assert_eq!(after, v);
    }
}

#[test]
fn rule_untargeted_action_has_null_targets() {
    for action in ["add_section", "skip"] {
        let (outcome, v) = normalised(INTEGRATION_DECISIONS, decision(action));
        assert_eq!(
            outcome,
            keep(&[&format!(
                "targets cleared: `{action}` takes no target block"
            )])
        );
        assert_eq!(v["action"], action);
        assert!(v["target_block_id"].is_null() && v["target_block_title"].is_null());
        // Already null or absent: nothing to say.
        let mut v = decision(action);
        v["target_block_id"] = Value::Null;
        v.as_object_mut().unwrap().remove("target_block_title");
        assert_eq!(normalised(INTEGRATION_DECISIONS, v).0, keep(&[]));
    }
}

#[test]
fn rule_empty_reasoning_is_kept_with_a_warning() {
    let mut v = decision("add_under");
    v["reasoning"] = json!("");
    assert_eq!(
        normalised(INTEGRATION_DECISIONS, v).0,
        keep(&["reasoning is empty"])
    );
}

#[test]
fn warnings_and_reasons_do_not_quote_content() {
    let secret = "SECRET-USER-TEXT";
    let mut lines = vec![
        json!({"block_id": secret, "is_knowledge": secret, "confidence": 0.5, "reason": secret}),
        json!({"block_id": secret, "reworded_content": format!("- {secret}")}),
    ];
    let mut d = decision(secret);
    d["target_block_id"] = json!(secret);
    d["confidence"] = json!(9);
    lines.push(d);
    for (id, mut v) in [
        KNOWLEDGE_CLASSIFICATION,
        CONTENT_REWORDING,
        INTEGRATION_DECISIONS,
    ]
    .into_iter()
    .zip(lines)
    {
        let text = format!("{:?}", normalise(id, &mut v));
        assert!(!text.contains(secret), "{id}: {text}");
    }
}

/// The LLM streaming contract's (seed 000's) client reads a decision line with its Pydantic
/// model `IntegrationDecisionChunk`: `knowledge_block_id` and `target_page` strings, `action`
/// one of `Literal["add_section", "add_under", "replace"]`, `target_block_id` and
/// `target_block_title` optional strings, `confidence` a float with `ge=0.0, le=1.0`,
/// `reasoning` a string (other fields ignored, Pydantic's default). `Err` says what it
/// refuses.
fn seed_000_decision_model(line: &Value) -> Result<(), String> {
    let o = line.as_object().ok_or("not an object")?;
    for field in ["knowledge_block_id", "target_page", "reasoning"] {
        if !o.get(field).is_some_and(Value::is_string) {
            return Err(format!("{field}: not a string"));
        }
    }
    match o.get("action").and_then(Value::as_str) {
        Some("add_section" | "add_under" | "replace") => {}
        other => return Err(format!("action: {other:?} is not a permitted literal")),
    }
    for field in ["target_block_id", "target_block_title"] {
        if o.get(field).is_some_and(|v| !v.is_null() && !v.is_string()) {
            return Err(format!("{field}: not a string or null"));
        }
    }
    match o.get("confidence").and_then(Value::as_f64) {
        Some(c) if (0.0..=1.0).contains(&c) => Ok(()),
        other => Err(format!("confidence: {other:?} not a float in [0, 1]")),
    }
}

/// `integration-decisions-seed-000` publishes only lines seed 000's own client accepts: the
/// seed's example stream as written, the corrections that still give one of its actions
/// (a targeted action without a target becomes `add_section`, a confidence is clamped into
/// range), and no `skip`, nor an unknown action made `skip` (seed 000 has no `skip`: its
/// model refuses it, so the line is dropped, not rewritten). Its schema is the model's.
#[test]
fn seed_000s_decisions_are_what_seed_000s_own_client_accepts() {
    let id = "integration-decisions-seed-000";
    // Seed 000's "Example NDJSON Stream" of Phase 3, as written.
    let example = [
        json!({"knowledge_block_id":"abc123","target_page":"Python/Concurrency","action":"add_under","target_block_id":"pattern-section-123","target_block_title":"Common Patterns","confidence":0.92,"reasoning":"This knowledge about asyncio.Queue's thread-safety is a common pattern in Python concurrency. Adding it under the 'Common Patterns' section provides clear context and makes it discoverable."}),
        json!({"knowledge_block_id":"abc123","target_page":"Textual/Architecture","action":"add_under","target_block_id":"worker-section-789","target_block_title":"Worker Threads","confidence":0.78,"reasoning":"The thread-safety property is relevant for Textual's worker thread architecture. Adding it under 'Worker Threads' section connects it to the framework's design."}),
    ];
    for line in &example {
        let (outcome, value) = normalised(id, line.clone());
        assert_eq!(outcome, keep(&[]), "{line}");
        assert_eq!(&value, line, "kept as written");
        assert_eq!(seed_000_decision_model(&value), Ok(()));
    }
    for action in [
        json!("skip"),
        json!("merge"),
        json!("ADD_UNDER"),
        json!(3),
        Value::Null,
    ] {
        let mut line = decision("x");
        line["action"] = action.clone();
        assert!(seed_000_decision_model(&line).is_err());
        let (outcome, _) = normalised(id, line.clone());
        assert!(
            matches!(outcome, Normalised::Skip { .. }),
            "{action}: {outcome:?}"
        );
        assert!(
            !validator(id).is_valid(&line),
            "the schema refuses {action}"
        );
    }
    let mut untargeted = decision("replace");
    untargeted["target_block_id"] = Value::Null;
    let mut confident = decision("add_section");
    confident["target_block_id"] = Value::Null;
    confident["target_block_title"] = Value::Null;
    confident["confidence"] = json!(1.4);
    for line in [untargeted, confident] {
        let (outcome, value) = normalised(id, line.clone());
        assert!(matches!(outcome, Normalised::Keep { .. }), "{line}");
        assert_eq!(seed_000_decision_model(&value), Ok(()), "{value}");
    }
    // The schema says what the model says about actions.
    assert_eq!(
        template(id).schema["properties"]["action"]["enum"],
        json!(["add_section", "add_under", "replace"])
    );
}

/// The LLM streaming contract's (seed 000's) classification returns knowledge blocks only:
/// its model's `is_knowledge` is "always true in output", and activity blocks "are NOT
/// included in the output stream". Its own template drops a line that says `false` (sluice's
/// `knowledge-classification` keeps it, as an answer); a `true` line is kept as written.
#[test]
fn seed_000s_classification_publishes_knowledge_only() {
    let id = "knowledge-classification-seed-000";
    let example = json!({"block_id":"abc123","is_knowledge":true,"confidence":0.92,"reason":"Contains a reusable insight about Python's asyncio.Queue being thread-safe, which is evergreen knowledge applicable to any async Python development."});
    let (outcome, value) = normalised(id, example.clone());
    assert_eq!(outcome, keep(&[]));
    assert_eq!(value, example);
    let mut activity = example.clone();
    activity["block_id"] = json!("def456");
    activity["is_knowledge"] = json!(false);
    let (outcome, _) = normalised(id, activity.clone());
    assert_eq!(
        outcome,
        skip("`is_knowledge` is false: the contract returns knowledge blocks only")
    );
    let (outcome, _) = normalised(KNOWLEDGE_CLASSIFICATION, activity);
    assert_eq!(outcome, keep(&[]), "sluice's own template keeps it");
}

/// The NDJSON parser contract's (seed 002's) classification lines (§3.1): "`confidence` must
/// be float in range [0.0, 1.0]", and its error handling has no clamp (only the decisions of
/// §3.2 clamp): a line outside the range is refused, the edges are kept.
#[test]
fn seed_002s_classification_refuses_a_confidence_out_of_range() {
    let line = json!({"block_id": "abc123", "is_knowledge": true, "confidence": 0.85});
    for bad in [json!(1.3), json!(2), json!(-0.2)] {
        let mut v = line.clone();
        v["confidence"] = bad.clone();
        let (outcome, _) = normalised(KNOWLEDGE_CLASSIFICATION_SEED_002, v);
        assert_eq!(
            outcome,
            skip("field `confidence` is outside [0.0, 1.0]"),
            "{bad}"
        );
    }
    for edge in [json!(0), json!(1.0), json!(0.5)] {
        let mut v = line.clone();
        v["confidence"] = edge.clone();
        let (outcome, v) = normalised(KNOWLEDGE_CLASSIFICATION_SEED_002, v);
        assert_eq!(outcome, keep(&[]));
        assert_eq!(v["confidence"], edge);
    }
    // Its decisions (§3.2) still clamp, as that section says.
    let (outcome, _) = normalised(
        INTEGRATION_DECISIONS_SEED_002,
        json!({"page": "P", "action": "add_section", "confidence": 1.3, "reasoning": "r"}),
    );
    assert_eq!(outcome, keep(&["confidence above 1 clamped to 1"]));
}
