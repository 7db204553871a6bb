//! The model outputs of the structured contracts (docs/specs.md#the-structured-ndjson-contracts) (a
//! knowledge-base application's NDJSON contracts) as exact text, for a fake LLM to emit token by
//! token to the prompt processor's built-in `jsonl` templates, with what a correct parser and
//! validator makes of each.
//!
//! Plain data; this module's tests check [`expected`] against the prompt crate's real
//! built-in templates (normalisers and schemas).
//!
//! # How a stream is counted
//!
//! The text is split into lines at `\n`; a final piece without `\n` is a line too (the NDJSON
//! parser contract (docs/specs.md#the-structured-ndjson-contracts) §4.3: parse the final line if it
//! is complete JSON). Each line is trimmed of whitespace (so `\r\n` endings are fine), then:
//! - a blank line is ignored, and so is a Markdown fence line (one starting with three
//!   backticks, e.g. a json fence opener): neither is counted anywhere;
//! - every other line is counted exactly once, in [`Expected::objects`] if it parses as a
//!   JSON object that the template's normaliser keeps and its schema accepts after
//!   normalisation, otherwise in [`Expected::skipped`] (malformed or truncated JSON, a JSON
//!   value that is not an object, an object the normaliser drops, an object the schema
//!   rejects).
//!
//! So `objects + skipped` is the number of non-blank, non-fence lines.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

/// What a correct `jsonl` parser and validator makes of a stream (see the module doc for how
/// lines are counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    /// The built-in template whose normaliser and schema apply.
    pub template: &'static str,
    /// Objects emitted.
    pub objects: usize,
    /// Lines skipped: malformed JSON, non-objects, normaliser drops, schema failures.
    pub skipped: usize,
}

/// One stream: its name, text, expected outcome, and how many of its counted lines are not a
/// JSON object at all (a parse-level count the tests check without the prompt crate).
struct Case {
    name: &'static str,
    text: &'static str,
    expected: Expected,
    not_objects: usize,
}

const CLASSIFICATION: &str = "knowledge-classification";
const REWORDING: &str = "content-rewording";
const INTEGRATION: &str = "integration-decisions";
const CLASSIFICATION_001: &str = "knowledge-classification-seed-001";
const CLASSIFICATION_002: &str = "knowledge-classification-seed-002";
const REWORDING_002: &str = "content-rewording-seed-002";
const INTEGRATION_002: &str = "integration-decisions-seed-002";

const fn expect(template: &'static str, objects: usize, skipped: usize) -> Expected {
    Expected {
        template,
        objects,
        skipped,
    }
}

// The LLM streaming contract's (docs/specs.md#the-structured-ndjson-contracts) example lines (each
// a complete JSON object without newline), as macros so that `concat!` can build the streams from
// them.
macro_rules! classification_abc {
    () => {
        r#"{"block_id":"abc123","is_knowledge":true,"confidence":0.92,"reason":"Contains a reusable insight about Python's asyncio.Queue being thread-safe, which is evergreen knowledge applicable to any async Python development."}"#
    };
}
macro_rules! classification_ghi {
    () => {
        r#"{"block_id":"ghi789","is_knowledge":true,"confidence":0.85,"reason":"Documents an important technical detail about ChromaDB's dependencies that would be valuable for future reference when setting up projects."}"#
    };
}
macro_rules! rewording_abc {
    () => {
        r#"{"block_id":"abc123","reworded_content":"Python's asyncio.Queue is thread-safe, making it suitable for communication between background tasks and the main thread in Textual applications. This property is important when designing concurrent systems."}"#
    };
}
macro_rules! rewording_ghi {
    () => {
        r#"{"block_id":"ghi789","reworded_content":"ChromaDB requires the sentence-transformers library as a dependency. The library downloads a 90MB model on first initialization."}"#
    };
}
macro_rules! integration_python {
    () => {
        r#"{"knowledge_block_id":"abc123","target_page":"Python/Concurrency","action":"add_under","target_block_id":"pattern-section-123","target_block_title":"Common Patterns","confidence":0.92,"reasoning":"This knowledge about asyncio.Queue's thread-safety is a common pattern in Python concurrency. Adding it under the 'Common Patterns' section provides clear context and makes it discoverable."}"#
    };
}
macro_rules! integration_textual {
    () => {
        r#"{"knowledge_block_id":"abc123","target_page":"Textual/Architecture","action":"add_under","target_block_id":"worker-section-789","target_block_title":"Worker Threads","confidence":0.78,"reasoning":"The thread-safety property is relevant for Textual's worker thread architecture. Adding it under 'Worker Threads' section connects it to the framework's design."}"#
    };
}

const CASES: &[Case] = &[
    // The LLM streaming contract Phase 1, "Example NDJSON Stream", exactly: 2 knowledge blocks of 3
    // (the activity block def456 is omitted by the model).
    Case {
        name: "classification",
        text: concat!(classification_abc!(), "\n", classification_ghi!(), "\n",),
        expected: expect(CLASSIFICATION, 2, 0),
        not_objects: 0,
    },
    // The LLM API contracts (docs/specs.md#the-structured-ndjson-contracts) Phase 1's expected
    // output, exactly: its prompt asks for no `is_knowledge`, and the LLM API contracts' own
    // template keeps both lines as written (the LLM streaming contract's would drop them).
    Case {
        name: "classification-without-is-knowledge",
        text: concat!(
            r#"{"block_id": "abc123", "confidence": 0.85, "reason": "This block contains a technical insight about Python's asyncio.Queue that is evergreen and worth preserving for future reference."}"#,
            "\n",
            r#"{"block_id": "ghi789", "confidence": 0.92, "reason": "Documents a specific ChromaDB requirement that is useful for future project setup."}"#,
            "\n",
        ),
        expected: expect(CLASSIFICATION_001, 2, 0),
        not_objects: 0,
    },
    // The NDJSON parser contract §4.1's three malformed lines (verbatim: unquoted key, trailing
    // comma, unquoted key) between the LLM streaming contract's two valid lines.
    Case {
        name: "classification-malformed",
        text: concat!(
            classification_abc!(),
            "\n",
            r#"{"block_id": "abc123", is_knowledge: true}"#,
            "\n",
            r#"{"block_id": "def456", "is_knowledge": true,}"#,
            "\n",
            r#"{block_id: "ghi789"}"#,
            "\n",
            classification_ghi!(),
            "\n",
        ),
        expected: expect(CLASSIFICATION, 2, 3),
        not_objects: 3,
    },
    // The NDJSON parser contract §5.3's partial stream: three valid lines, a malformed fourth
    // (unquoted key), then the stream ends (timeout; block-5 never arrives). Adapted to the LLM
    // streaming contract's model: each line gains a `reason` (the NDJSON parser contract's objects
    // have none, so the schema, not the parser, would have rejected them all).
    Case {
        name: "classification-error-recovery",
        text: concat!(
            r#"{"block_id": "block-1", "is_knowledge": true, "confidence": 0.85, "reason": "A lasting technical insight."}"#,
            "\n",
            r#"{"block_id": "block-2", "is_knowledge": false, "confidence": 0.92, "reason": "A one-off activity, not lasting knowledge."}"#,
            "\n",
            r#"{"block_id": "block-3", "is_knowledge": true, "confidence": 0.78, "reason": "A reusable design principle."}"#,
            "\n",
            r#"{"block_id": "block-4", is_knowledge: true, "confidence": 0.88, "reason": "A lasting technical insight."}"#,
            "\n",
        ),
        expected: expect(CLASSIFICATION, 3, 1),
        not_objects: 1,
    },
    // A valid line, then the LLM streaming contract's truncated line (its "Malformed JSON Line"
    // example), cut where the stream ends, without a newline.
    Case {
        name: "classification-truncated",
        text: concat!(
            classification_ghi!(),
            "\n",
            r#"{"block_id":"abc123","is_knowledge":tru"#,
        ),
        expected: expect(CLASSIFICATION, 1, 1),
        not_objects: 1,
    },
    // The LLM streaming contract's two lines with blank lines around and between them, a
    // whitespace-only line, and a `\r\n` ending (the LLM streaming contract: "Empty lines ignored
    // during parsing").
    Case {
        name: "classification-blank-lines",
        text: concat!(
            "\n",
            classification_abc!(),
            "\r\n",
            "\n",
            "   \n",
            classification_ghi!(),
            "\n\n",
        ),
        expected: expect(CLASSIFICATION, 2, 0),
        not_objects: 0,
    },
    // Values normalisation fixes (the NDJSON parser contract §3): confidence above 1 and below 0
    // are clamped; an unknown extra field is kept and ignored. All three are emitted.
    Case {
        name: "classification-normalised",
        text: concat!(
            r#"{"block_id":"abc123","is_knowledge":true,"confidence":1.2,"reason":"Reusable insight about asyncio.Queue."}"#,
            "\n",
            r#"{"block_id":"ghi789","is_knowledge":true,"confidence":-0.1,"reason":"Documents a ChromaDB dependency."}"#,
            "\n",
            r#"{"block_id":"jkl012","is_knowledge":true,"confidence":0.7,"reason":"A lasting configuration detail.","extra_field":["tag"]}"#,
            "\n",
        ),
        expected: expect(CLASSIFICATION, 3, 0),
        not_objects: 0,
    },
    // The model wraps its answer in a JSON array on one line (the LLM API contracts: "No JSON array
    // wrapping"): the line parses, but as an array, not an object, so it is skipped.
    Case {
        name: "classification-array",
        text: concat!(
            "[",
            r#"{"block_id":"abc123","is_knowledge":true,"confidence":0.92,"reason":"Reusable insight about asyncio.Queue."}"#,
            ",",
            r#"{"block_id":"ghi789","is_knowledge":true,"confidence":0.85,"reason":"Documents a ChromaDB dependency."}"#,
            "]\n",
        ),
        expected: expect(CLASSIFICATION, 0, 1),
        not_objects: 1,
    },
    // The NDJSON parser contract §2.2's Ollama chunks joined: one object pretty-printed over five
    // lines. A line-based parser sees five malformed lines and emits nothing (the object also lacks
    // the LLM streaming contract's `reason`).
    Case {
        name: "classification-pretty-printed",
        text: concat!(
            "{\n",
            "\"block_id\": \"abc123\",\n",
            "\"is_knowledge\": true,\n",
            "\"confidence\": 0.85\n",
            "}\n",
        ),
        expected: expect(CLASSIFICATION, 0, 5),
        not_objects: 5,
    },
    // The LLM streaming contract Phase 2, "Example NDJSON Stream", exactly.
    Case {
        name: "rewording",
        text: concat!(rewording_abc!(), "\n", rewording_ghi!(), "\n",),
        expected: expect(REWORDING, 2, 0),
        not_objects: 0,
    },
    // The LLM API contracts Phase 2's expected output, exactly (spaces after the separators).
    Case {
        name: "rewording-spaced",
        text: concat!(
            r#"{"block_id": "abc123", "reworded_content": "Python's asyncio.Queue is thread-safe, making it suitable for communication between background tasks and the main thread in Textual applications. This property is important when designing concurrent systems."}"#,
            "\n",
            r#"{"block_id": "ghi789", "reworded_content": "ChromaDB requires the sentence-transformers library, which downloads a 90MB model on first run."}"#,
            "\n",
        ),
        expected: expect(REWORDING, 2, 0),
        not_objects: 0,
    },
    // The LLM streaming contract Phase 2's stream with no newline after the last line (the
    // connection closes right after it; the NDJSON parser contract §4.3 parses such a final line).
    Case {
        name: "rewording-no-final-newline",
        text: concat!(rewording_abc!(), "\n", rewording_ghi!(),),
        expected: expect(REWORDING, 2, 0),
        not_objects: 0,
    },
    // Reworded content that is an indented bullet outline; normalisation flattens it into
    // plain continuation lines (the NDJSON parser contract §3.3) and keeps the object.
    Case {
        name: "rewording-normalised",
        text: concat!(
            r#"{"block_id":"abc123","reworded_content":"- Bounded contexts matter more than service size.\n  - Each context should have clear ownership."}"#,
            "\n",
        ),
        expected: expect(REWORDING, 1, 0),
        not_objects: 0,
    },
    // Values normalisation cannot fix (the NDJSON parser contract §3.3): empty and whitespace-only
    // `reworded_content`, a missing `reworded_content`, after one valid line.
    Case {
        name: "rewording-rejected",
        text: concat!(
            r#"{"block_id":"abc123","reworded_content":"Python's asyncio.Queue is thread-safe."}"#,
            "\n",
            r#"{"block_id":"ghi789","reworded_content":""}"#,
            "\n",
            r#"{"block_id":"ghi789","reworded_content":"   "}"#,
            "\n",
            r#"{"block_id":"ghi789"}"#,
            "\n",
        ),
        expected: expect(REWORDING, 1, 3),
        not_objects: 0,
    },
    // The LLM streaming contract Phase 3, "Example NDJSON Stream", exactly: 2 relevant pages of 3.
    Case {
        name: "integration",
        text: concat!(integration_python!(), "\n", integration_textual!(), "\n",),
        expected: expect(INTEGRATION, 2, 0),
        not_objects: 0,
    },
    // The LLM API contracts Phase 3's expected output, exactly: an `add_under` and a `skip`
    // decision, each with `skip_reason`.
    Case {
        name: "integration-with-skip",
        text: concat!(
            r#"{"knowledge_block_id": "abc123", "target_page": "Python/Concurrency", "action": "add_under", "target_block_id": "pattern-section-123", "target_block_title": "Common Patterns", "confidence": 0.92, "reasoning": "This knowledge about asyncio.Queue's thread-safety is a common pattern in Python concurrency. Adding it under the 'Common Patterns' section provides clear context and makes it discoverable.", "skip_reason": null}"#,
            "\n",
            r#"{"knowledge_block_id": "abc123", "target_page": "Textual/Architecture", "action": "skip", "target_block_id": null, "target_block_title": null, "confidence": 0.35, "reasoning": "While this knowledge mentions Textual, it's primarily about Python's asyncio.Queue, not Textual's architecture. Better suited for Python/Concurrency page.", "skip_reason": "Content is more Python-specific than Textual-specific"}"#,
            "\n",
        ),
        expected: expect(INTEGRATION, 2, 0),
        not_objects: 0,
    },
    // The LLM streaming contract Phase 3's stream inside a json code fence; the fence lines are
    // ignored.
    Case {
        name: "integration-fenced",
        text: concat!(
            "```json\n",
            integration_python!(),
            "\n",
            integration_textual!(),
            "\n",
            "```\n",
        ),
        expected: expect(INTEGRATION, 2, 0),
        not_objects: 0,
    },
    // The LLM streaming contract Phase 3's first line, then its second cut mid-`reasoning` where
    // the connection drops (no newline).
    Case {
        name: "integration-truncated",
        text: concat!(
            integration_python!(),
            "\n",
            r#"{"knowledge_block_id":"abc123","target_page":"Textual/Architecture","action":"add_under","target_block_id":"worker-section-789","target_block_title":"Worker Threads","confidence":0.78,"reasoning":"The thread-safety property is rel"#,
        ),
        expected: expect(INTEGRATION, 1, 1),
        not_objects: 1,
    },
    // Values normalisation fixes (the NDJSON parser contract §3.2), all five emitted: `add_under`
    // with a null target and `replace` with an empty one become `add_section`; an unknown action
    // becomes `skip`; `add_section` with a target gets its target cleared; confidence 1.4 is
    // clamped.
    Case {
        name: "integration-normalised",
        text: concat!(
            r#"{"knowledge_block_id":"abc123","target_page":"Python/Concurrency","action":"add_under","target_block_id":null,"target_block_title":"Common Patterns","confidence":0.8,"reasoning":"Fits the patterns section."}"#,
            "\n",
            r#"{"knowledge_block_id":"abc123","target_page":"Textual/Architecture","action":"replace","target_block_id":"","target_block_title":null,"confidence":0.6,"reasoning":"Supersedes the worker notes."}"#,
            "\n",
            r#"{"knowledge_block_id":"abc123","target_page":"Python/Data Structures","action":"merge","target_block_id":null,"target_block_title":null,"confidence":0.3,"reasoning":"Only loosely related."}"#,
            "\n",
            r#"{"knowledge_block_id":"abc123","target_page":"Python/Asyncio","action":"add_section","target_block_id":"queue-456","target_block_title":"Queues","confidence":0.7,"reasoning":"Deserves its own section."}"#,
            "\n",
            r#"{"knowledge_block_id":"abc123","target_page":"Python/Concurrency","action":"add_under","target_block_id":"pattern-section-123","target_block_title":"Common Patterns","confidence":1.4,"reasoning":"A common concurrency pattern."}"#,
            "\n",
        ),
        expected: expect(INTEGRATION, 5, 0),
        not_objects: 0,
    },
    // Values normalisation cannot fix, after one valid line, each dropped: confidence "high"
    // (invalid type, the NDJSON parser contract §3.1), no `target_page` and no `action` (missing
    // required fields), an empty `knowledge_block_id`, `reasoning` a number (the schema rejects
    // it).
    Case {
        name: "integration-rejected",
        text: concat!(
            r#"{"knowledge_block_id":"abc123","target_page":"Python/Concurrency","action":"add_section","target_block_id":null,"target_block_title":null,"confidence":0.9,"reasoning":"A new section on queues."}"#,
            "\n",
            r#"{"knowledge_block_id":"abc123","target_page":"Python/Concurrency","action":"add_section","confidence":"high","reasoning":"A new section on queues."}"#,
            "\n",
            r#"{"knowledge_block_id":"abc123","action":"add_section","confidence":0.9,"reasoning":"No page named."}"#,
            "\n",
            r#"{"knowledge_block_id":"abc123","target_page":"Python/Concurrency","confidence":0.9,"reasoning":"No action named."}"#,
            "\n",
            r#"{"knowledge_block_id":"","target_page":"Python/Concurrency","action":"add_section","confidence":0.9,"reasoning":"No block named."}"#,
            "\n",
            r#"{"knowledge_block_id":"abc123","target_page":"Python/Concurrency","action":"add_section","confidence":0.9,"reasoning":42}"#,
            "\n",
        ),
        expected: expect(INTEGRATION, 1, 5),
        not_objects: 0,
    },
    // The NDJSON parser contract §5.1, verbatim: three blocks classified, one of them activity
    // (`is_knowledge: false` is an answer, kept): "Classified 3/3 blocks".
    Case {
        name: "seed-002-extraction",
        text: concat!(
            r#"{"block_id": "abc123", "is_knowledge": true, "confidence": 0.92}"#,
            "\n",
            r#"{"block_id": "def456", "is_knowledge": false, "confidence": 0.95}"#,
            "\n",
            r#"{"block_id": "ghi789", "is_knowledge": true, "confidence": 0.88}"#,
            "\n",
        ),
        expected: expect(CLASSIFICATION_002, 3, 0),
        not_objects: 0,
    },
    // The NDJSON parser contract §5.3, verbatim: three valid lines, the fourth malformed (unquoted
    // key), then the stream ends: 3 objects, 1 line skipped.
    Case {
        name: "seed-002-error-recovery",
        text: concat!(
            r#"{"block_id": "block-1", "is_knowledge": true, "confidence": 0.85}"#,
            "\n",
            r#"{"block_id": "block-2", "is_knowledge": false, "confidence": 0.92}"#,
            "\n",
            r#"{"block_id": "block-3", "is_knowledge": true, "confidence": 0.78}"#,
            "\n",
            r#"{"block_id": "block-4", is_knowledge: true, "confidence": 0.88}"#,
            "\n",
        ),
        expected: expect(CLASSIFICATION_002, 3, 1),
        not_objects: 1,
    },
    // The NDJSON parser contract §1.1's expected output, §2.3's Phase 1 lines and §3.1's example,
    // as one answer: one classification result per block (§1.1), so the first for each of its
    // three blocks is published and the three that repeat a block are dropped.
    Case {
        name: "seed-002-classification-examples",
        text: concat!(
            r#"{"block_id": "abc123", "is_knowledge": true, "confidence": 0.85}"#,
            "\n",
            r#"{"block_id": "def456", "is_knowledge": false, "confidence": 0.92}"#,
            "\n",
            r#"{"block_id": "ghi789", "is_knowledge": true, "confidence": 0.78}"#,
            "\n",
            r#"{"block_id": "abc123", "is_knowledge": true, "confidence": 0.85}"#,
            "\n",
            r#"{"block_id": "def456", "is_knowledge": false, "confidence": 0.92}"#,
            "\n",
            r#"{"block_id": "abc123", "is_knowledge": true, "confidence": 0.85}"#,
            "\n",
        ),
        expected: expect(CLASSIFICATION_002, 3, 3),
        not_objects: 0,
    },
    // The NDJSON parser contract §5.2, verbatim: add_section to Software Architecture, skip
    // Microservices.
    Case {
        name: "seed-002-decisions",
        text: concat!(
            r#"{"page": "Software Architecture", "action": "add_section", "target_id": null, "target_title": null, "confidence": 0.88, "reasoning": "Core architectural principle that deserves its own section"}"#,
            "\n",
            r#"{"page": "Microservices", "action": "skip", "target_id": null, "target_title": null, "confidence": 0.93, "reasoning": "Already covered under 'Common Misconceptions' section"}"#,
            "\n",
        ),
        expected: expect(INTEGRATION_002, 2, 0),
        not_objects: 0,
    },
    // The NDJSON parser contract §1.2's expected output, §2.3's Phase 3.1 lines, and §3.2's two
    // examples (one line each), as one answer: one decision per candidate page (§1.2), so the
    // first for each of its three pages is published and the four that repeat a page are
    // dropped.
    Case {
        name: "seed-002-decision-examples",
        text: concat!(
            r#"{"page": "Software Architecture", "action": "add_section", "target_id": null, "target_title": null, "confidence": 0.88, "reasoning": "New root section"}"#,
            "\n",
            r#"{"page": "Microservices", "action": "add_under", "target_id": "block-uuid-123", "target_title": "Benefits", "confidence": 0.91, "reasoning": "Fits under Benefits"}"#,
            "\n",
            r#"{"page": "Docker", "action": "skip", "target_id": null, "target_title": null, "confidence": 0.95, "reasoning": "Already covered"}"#,
            "\n",
            r#"{"page": "Software Architecture", "action": "add_section", "target_id": null, "target_title": null, "confidence": 0.88, "reasoning": "..."}"#,
            "\n",
            r#"{"page": "Microservices", "action": "skip", "target_id": null, "target_title": null, "confidence": 0.95, "reasoning": "..."}"#,
            "\n",
            r#"{"page": "Software Architecture", "action": "add_section", "target_id": null, "target_title": null, "confidence": 0.88, "reasoning": "This knowledge belongs as a new root-level section on the page"}"#,
            "\n",
            r#"{"page": "Microservices", "action": "add_under", "target_id": "block-uuid-123", "target_title": "Benefits and Tradeoffs", "confidence": 0.91, "reasoning": "This insight fits naturally under the existing 'Benefits' section"}"#,
            "\n",
        ),
        expected: expect(INTEGRATION_002, 3, 4),
        not_objects: 0,
    },
    // The NDJSON parser contract §1.3's expected output and §3.3's example (one line; its `\n` are
    // continuation lines inside the string), as one answer: each block is reworded only once
    // (§1.3), so §3.3's second rewording of abc123 is dropped. §2.3's rewording line (`"- Bounded contexts..."`) is a
    // bullet outline: kept, flattened.
    Case {
        name: "seed-002-rewording-examples",
        text: concat!(
            r#"{"block_id": "abc123", "refined_text": "Bounded contexts matter more than service size.\nEach context should have clear ownership."}"#,
            "\n",
            r#"{"block_id": "def456", "refined_text": "HNSW provides O(log n) nearest neighbor search.\nTrade-off between recall and speed via ef_construction parameter."}"#,
            "\n",
            r#"{"block_id": "abc123", "refined_text": "Bounded contexts matter more than service size.\nEach context should have clear ownership.\nAvoid sharing databases across contexts."}"#,
            "\n",
        ),
        expected: expect(REWORDING_002, 2, 1),
        not_objects: 0,
    },
    Case {
        name: "seed-002-rewording-normalised",
        text: concat!(
            r#"{"block_id": "abc123", "refined_text": "- Bounded contexts..."}"#,
            "\n",
        ),
        expected: expect(REWORDING_002, 1, 0),
        not_objects: 0,
    },
];

/// Every stream name, in a stable order.
pub fn names() -> Vec<&'static str> {
    CASES.iter().map(|c| c.name).collect()
}

/// The exact text of the named stream.
///
/// Streams for `knowledge-classification`: `classification` (the LLM streaming contract, 2
/// objects), `classification-without-is-knowledge` (the LLM API contracts' older form, all
/// dropped), `classification-malformed` (the NDJSON parser contract §4.1),
/// `classification-error-recovery` (the NDJSON parser contract §5.3), `classification-truncated`
/// (final line cut, no newline), `classification-blank-lines`, `classification-normalised`
/// (confidence clamped), `classification-array` (a one-line JSON array),
/// `classification-pretty-printed` (one object over five lines). For `content-rewording`:
/// `rewording` (the LLM streaming contract), `rewording-spaced` (the LLM API contracts),
/// `rewording-no-final-newline`, `rewording-normalised` (bullets flattened), `rewording-rejected`
/// (empty content). For `integration-decisions`: `integration` (the LLM streaming contract),
/// `integration-with-skip` (the LLM API contracts), `integration-fenced` (a json code fence),
/// `integration-truncated`, `integration-normalised` (actions and targets corrected),
/// `integration-rejected` (invalid types, missing fields). For the LLM API contracts' and the
/// NDJSON parser contract's own templates (`...-seed-001`, `...-seed-002`):
/// `classification-without-is-knowledge` (the LLM API contracts, 2 objects), `seed-002-extraction` (§5.1, 3),
/// `seed-002-error-recovery` (§5.3, 3 and 1 skipped), `seed-002-classification-examples` (§1.1,
/// §2.3, §3.1), `seed-002-decisions` (§5.2, 2), `seed-002-decision-examples` (§1.2, §2.3, §3.2),
/// `seed-002-rewording-examples` (§1.3, §3.3), `seed-002-rewording-normalised` (§2.3's bullet line,
/// flattened). See [`expected`] for the counts.
pub fn stream(name: &str) -> Option<&'static str> {
    CASES.iter().find(|c| c.name == name).map(|c| c.text)
}

/// What a correct parser and validator emits and skips for the named stream, counted as
/// the module doc says.
pub fn expected(name: &str) -> Option<Expected> {
    CASES.iter().find(|c| c.name == name).map(|c| c.expected)
}

/// How many of the named stream's skipped lines are not a JSON object at all (malformed or
/// truncated JSON, or a value such as an array): the rest of [`Expected::skipped`] are
/// objects the normaliser drops or the schema rejects.
pub fn not_objects(name: &str) -> Option<usize> {
    CASES.iter().find(|c| c.name == name).map(|c| c.not_objects)
}

/// Splits `text` into pieces of about `n` bytes (at least one character each, never
/// splitting a character), for a fake LLM to emit token by token. `n == 0` is taken as 1.
pub fn tokens(text: &str, n: usize) -> Vec<String> {
    let n = n.max(1);
    let mut pieces = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + n).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        pieces.push(text[start..end].to_owned());
        start = end;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::Value;
    use sluice_prompt::{
        normalise::Normalised,
        templates::{Template, TemplateSet},
    };

    use super::*;

    /// A built-in template of the prompt crate, as the prompt processor loads it.
    fn builtin(id: &str) -> Arc<Template> {
        TemplateSet::from_json("{}", true)
            .unwrap()
            .get(id)
            .unwrap()
            .clone()
    }

    /// The lines a counter looks at: trimmed, neither blank nor a fence.
    fn counted_lines(text: &str) -> Vec<&str> {
        text.split('\n')
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with("```"))
            .collect()
    }

    fn is_object(line: &str) -> bool {
        matches!(
            serde_json::from_str::<serde_json::Value>(line),
            Ok(serde_json::Value::Object(_))
        )
    }

    // Parse level only; `seed_streams_meet_their_expected_counts` runs every stream through
    // the real normalisers and schemas.
    #[test]
    fn line_counts_match_expected() {
        for case in CASES {
            let lines = counted_lines(case.text);
            let e = expected(case.name).unwrap();
            assert_eq!(
                lines.len(),
                e.objects + e.skipped,
                "{}: counted lines",
                case.name
            );
            let not_objects = lines.iter().filter(|l| !is_object(l)).count();
            assert_eq!(
                Some(not_objects),
                super::not_objects(case.name),
                "{}: non-objects",
                case.name
            );
            assert!(not_objects <= e.skipped, "{}", case.name);
            assert!(
                lines.len() - not_objects >= e.objects,
                "{}: more objects expected than lines parse",
                case.name
            );
        }
    }

    #[test]
    fn names_are_unique_and_templates_known() {
        let names = names();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        let templates = TemplateSet::from_json("{}", true).unwrap();
        for name in names {
            let e = expected(name).unwrap();
            assert!(templates.get(e.template).is_some(), "{name}");
            let phase = e
                .template
                .trim_end_matches("-seed-001")
                .trim_end_matches("-seed-002");
            assert!(
                name.contains(match phase {
                    CLASSIFICATION => "classification",
                    REWORDING => "rewording",
                    INTEGRATION => "decision",
                    other => panic!("{other}"),
                }) || (phase == INTEGRATION && name.starts_with("integration"))
                    || name == "seed-002-extraction"
                    || name == "seed-002-error-recovery",
                "{name}"
            );
            assert!(stream(name).is_some());
        }
        assert!(stream("nope").is_none() && expected("nope").is_none());
    }

    #[test]
    fn edge_shapes_are_present() {
        assert!(!stream("classification-truncated").unwrap().ends_with('\n'));
        assert!(
            !stream("rewording-no-final-newline")
                .unwrap()
                .ends_with('\n')
        );
        assert!(
            stream("integration-fenced")
                .unwrap()
                .starts_with("```json\n")
        );
        assert!(
            stream("classification-blank-lines")
                .unwrap()
                .contains("\n\n")
        );
    }

    #[test]
    fn tokens_split_on_char_boundaries_and_rejoin() {
        let text = "héllo — wörld ✓ {\"a\":1}\n";
        for n in [0, 1, 2, 3, 5, 64] {
            let pieces = tokens(text, n);
            assert_eq!(pieces.concat(), text);
            assert!(pieces.iter().all(|p| !p.is_empty()));
            // Each piece is at most n bytes plus the rest of one character.
            assert!(pieces.iter().all(|p| p.len() < n.max(1) + 4));
        }
        assert_eq!(tokens("abcdef", 4), ["abcd", "ef"]);
        assert_eq!(tokens("é", 1), ["é"]);
        assert!(tokens("", 3).is_empty());
        for name in names() {
            let text = stream(name).unwrap();
            assert_eq!(tokens(text, 7).concat(), text);
        }
    }

    // Every object of the structured contracts' clean streams (the LLM streaming contract and the
    // LLM API contracts) validates as it is, and the normaliser keeps it without a warning.
    #[test]
    fn seed_example_objects_validate_unchanged() {
        for (stream, id) in [
            ("classification", CLASSIFICATION),
            ("classification-without-is-knowledge", CLASSIFICATION_001),
            ("seed-002-extraction", CLASSIFICATION_002),
            ("seed-002-classification-examples", CLASSIFICATION_002),
            ("seed-002-decisions", INTEGRATION_002),
            ("seed-002-decision-examples", INTEGRATION_002),
            ("seed-002-rewording-examples", REWORDING_002),
            ("rewording", REWORDING),
            ("rewording-spaced", REWORDING),
            ("integration", INTEGRATION),
            ("integration-with-skip", INTEGRATION),
        ] {
            let template = builtin(id);
            let validator = template.validator().unwrap().unwrap();
            let normalise = template.normalise.unwrap();
            let text = super::stream(stream).unwrap();
            for line in text.lines() {
                let mut value: Value = serde_json::from_str(line).unwrap();
                let before = value.clone();
                assert!(validator.is_valid(&value), "{stream}: {line}");
                assert_eq!(
                    normalise(&mut value),
                    Normalised::Keep { warnings: vec![] },
                    "{stream}"
                );
                assert_eq!(value, before);
            }
        }
    }

    /// A reference jsonl consumer, counting as `seed_streams` documents: split at `\n`, trim,
    /// ignore blank and fence lines, parse, normalise, validate; the NDJSON parser contract's
    /// templates keep one object per block (classification, rewording) or page (decisions).
    fn consume(id: &str, text: &str) -> (Vec<Value>, usize, usize) {
        let template = builtin(id);
        let validator = template.validator().unwrap().unwrap();
        let once_per = match id {
            CLASSIFICATION_002 | REWORDING_002 => Some("block_id"),
            INTEGRATION_002 => Some("page"),
            _ => None,
        };
        let mut seen = std::collections::BTreeSet::new();
        let (mut objects, mut skipped, mut warned) = (Vec::new(), 0, 0);
        for line in text.split('\n').map(str::trim) {
            if line.is_empty() || line.starts_with("```") {
                continue;
            }
            let Ok(mut value) = serde_json::from_str::<Value>(line) else {
                skipped += 1;
                continue;
            };
            match (template.normalise.unwrap())(&mut value) {
                Normalised::Keep { .. }
                    if once_per.is_some_and(|f| !seen.insert(value[f].to_string())) =>
                {
                    skipped += 1;
                }
                Normalised::Keep { warnings } if validator.is_valid(&value) => {
                    warned += usize::from(!warnings.is_empty());
                    objects.push(value);
                }
                _ => skipped += 1,
            }
        }
        (objects, skipped, warned)
    }

    #[test]
    fn seed_streams_meet_their_expected_counts() {
        for name in super::names() {
            let expected = super::expected(name).unwrap();
            let (objects, skipped, warned) =
                consume(expected.template, super::stream(name).unwrap());
            assert_eq!(
                (objects.len(), skipped),
                (expected.objects, expected.skipped),
                "{name}"
            );
            // Objects are corrected (with a warning) exactly in the `-normalised` streams,
            // apart from the extra field of `classification-normalised`, which is no error.
            let corrected = match name {
                "classification-normalised" => 2,
                n if n.ends_with("-normalised") => objects.len(),
                _ => 0,
            };
            assert_eq!(warned, corrected, "{name}");
        }
        // The corrected values, not just the counts.
        let (objects, _, _) = consume(
            INTEGRATION,
            super::stream("integration-normalised").unwrap(),
        );
        let actions: Vec<_> = objects.iter().map(|o| o["action"].clone()).collect();
        assert_eq!(
            actions,
            [
                "add_section",
                "add_section",
                "skip",
                "add_section",
                "add_under"
            ]
        );
        assert_eq!(objects[3]["target_block_id"], Value::Null);
        assert_eq!(objects[4]["confidence"], 1.0);
    }
}
