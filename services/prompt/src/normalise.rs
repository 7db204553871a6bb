//! The normalisers: corrections a template's output objects get before they are validated
//! against its schema, one per structured-output contract (the classification, rewording and
//! integration contracts of docs/protocol.md#structured-output-contracts). A template names
//! its normaliser (`normaliser` in a template file; the built-ins name theirs), so a file
//! template that replaces a built-in can keep its rules.
//!
//! A normaliser must never quote the model's output in a warning or a skip reason (it is
//! derived from user content): field names and enum values only. It must never drop an object
//! that a rule says to correct, nor keep one that a rule says to drop.

use serde_json::{Map, Value, json};

/// What normalising one object decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Normalised {
    /// Keep the (possibly corrected) object; each warning says what was corrected.
    Keep {
        /// What was corrected, one sentence each, without quoting user content.
        warnings: Vec<String>,
    },
    /// Drop the object.
    Skip {
        /// Why.
        reason: String,
    },
}

/// Corrects an object in place before schema validation (the rules of
/// docs/protocol.md#structured-output-contracts).
pub type Normaliser = fn(&mut Value) -> Normalised;

/// The normaliser of the classification contract ([`normalise_classification`]).
pub const KNOWLEDGE_CLASSIFICATION: &str = "knowledge-classification";
/// The LLM streaming contract's (seed 000's) own classification lines: knowledge blocks only
/// ([`normalise_classification_seed_000`]).
pub const KNOWLEDGE_CLASSIFICATION_SEED_000: &str = "knowledge-classification-seed-000";
/// The normaliser of the rewording contract ([`normalise_rewording`]).
pub const CONTENT_REWORDING: &str = "content-rewording";
/// The normaliser of the integration contract ([`normalise_integration`]).
pub const INTEGRATION_DECISIONS: &str = "integration-decisions";
/// The LLM streaming contract's (seed 000's) own decision lines: its three actions, no `skip`
/// ([`normalise_integration_seed_000`]).
pub const INTEGRATION_DECISIONS_SEED_000: &str = "integration-decisions-seed-000";
/// The LLM API contracts' (docs/specs.md#the-structured-ndjson-contracts) classification lines: no
/// `is_knowledge` ([`normalise_classification_seed_001`]).
pub const KNOWLEDGE_CLASSIFICATION_SEED_001: &str = "knowledge-classification-seed-001";
/// The NDJSON parser contract's (docs/specs.md#the-structured-ndjson-contracts) classification
/// lines: one per block, `is_knowledge` true or false, no `reason`
/// ([`normalise_classification_seed_002`]).
pub const KNOWLEDGE_CLASSIFICATION_SEED_002: &str = "knowledge-classification-seed-002";
/// The NDJSON parser contract's rewording lines: `refined_text` ([`normalise_rewording_seed_002`]).
pub const CONTENT_REWORDING_SEED_002: &str = "content-rewording-seed-002";
/// The NDJSON parser contract's decision lines: `page`, `target_id`, `target_title`, one knowledge
/// block per request ([`normalise_integration_seed_002`]).
pub const INTEGRATION_DECISIONS_SEED_002: &str = "integration-decisions-seed-002";

/// The rules of a contract that need the request or the other lines of the answer: which ids
/// the request names and which object field answers each, and what follows from that. A
/// template gets them with its normaliser (the same name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answers {
    /// The term listing the request's items (a JSON array).
    pub term: &'static str,
    /// The field of each item holding its id.
    pub item_id: &'static str,
    /// The object field naming the item it answers: an id the request does not name drops
    /// the object.
    pub field: &'static str,
    /// Whether every item expects an object (the ones without are reported as pending), or
    /// only some do (classification returns only the knowledge blocks).
    pub every: bool,
    /// At most this many objects per item and value of this field (the LLM streaming contract
    /// (docs/specs.md#the-structured-ndjson-contracts): at most 2 decisions per knowledge block and
    /// target page); later ones are dropped.
    pub per_pair: Option<(&'static str, usize)>,
    /// At most this many objects per item (the NDJSON parser contract's decisions: one per
    /// candidate page); later ones are dropped.
    pub per_item: Option<usize>,
    /// Every object of an item is held until the answer ends, then an item's objects are
    /// published together, items in the order they first came (the LLM streaming contract
    /// Phase 3: all decisions with a block's id before any is shown; a model may come back to a
    /// block, so only the end says it has all of them).
    pub grouped: bool,
    /// The object's text field that must keep the `[[links]]` and `((refs))` of the item's
    /// text fields (rewording), and what a lost one does.
    pub links: Option<(&'static str, &'static [&'static str], LostLinks)>,
}

/// What a rewording that lost a `[[link]]` or `((ref))` of its item's text does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostLinks {
    /// Kept, with a warning: the contract's client does not check links (the LLM streaming
    /// contract's and the LLM API contracts' models).
    Warn,
    /// Dropped, the item left pending: the NDJSON parser contract's §3.3 validation rule
    /// "Preserve `[[Page Links]]` and `((block-refs))`", whose client skips an object that
    /// fails a rule.
    Drop,
}

/// The decision contract's request rules (the LLM streaming contract's Phase 3).
const DECISION_ANSWERS: Answers = Answers {
    term: "knowledge_blocks",
    field: "knowledge_block_id",
    per_pair: Some(("target_page", 2)),
    grouped: true,
    ..CLASSIFICATION_ANSWERS
};

const CLASSIFICATION_ANSWERS: Answers = Answers {
    term: "blocks",
    item_id: "block_id",
    field: "block_id",
    every: false,
    per_pair: None,
    per_item: None,
    grouped: false,
    links: None,
};

/// Every normaliser, by the name a template gives, with the request rules that come with it.
const REGISTRY: [(&str, Normaliser, Answers); 9] = [
    (
        KNOWLEDGE_CLASSIFICATION,
        normalise_classification,
        CLASSIFICATION_ANSWERS,
    ),
    (
        CONTENT_REWORDING,
        normalise_rewording,
        Answers {
            every: true,
            links: Some(("reworded_content", &["content"], LostLinks::Warn)),
            ..CLASSIFICATION_ANSWERS
        },
    ),
    (
        INTEGRATION_DECISIONS,
        normalise_integration,
        DECISION_ANSWERS,
    ),
    (
        KNOWLEDGE_CLASSIFICATION_SEED_000,
        normalise_classification_seed_000,
        CLASSIFICATION_ANSWERS,
    ),
    (
        INTEGRATION_DECISIONS_SEED_000,
        normalise_integration_seed_000,
        DECISION_ANSWERS,
    ),
    (
        KNOWLEDGE_CLASSIFICATION_SEED_001,
        normalise_classification_seed_001,
        CLASSIFICATION_ANSWERS,
    ),
    (
        KNOWLEDGE_CLASSIFICATION_SEED_002,
        normalise_classification_seed_002,
        Answers {
            every: true,
            // §1.1: "One classification result per block".
            per_item: Some(1),
            ..CLASSIFICATION_ANSWERS
        },
    ),
    (
        CONTENT_REWORDING_SEED_002,
        normalise_rewording_seed_002,
        Answers {
            term: "decisions",
            item_id: "knowledge_block_id",
            every: true,
            links: Some((
                "refined_text",
                &["full_text", "hierarchical_text"],
                LostLinks::Drop,
            )),
            // §1.3: "Each knowledge block is reworded only once".
            per_item: Some(1),
            ..CLASSIFICATION_ANSWERS
        },
    ),
    (
        INTEGRATION_DECISIONS_SEED_002,
        normalise_integration_seed_002,
        Answers {
            term: "candidate_pages",
            item_id: "page_name",
            field: "page",
            every: true,
            // §1.2: "One decision per candidate page".
            per_item: Some(1),
            ..CLASSIFICATION_ANSWERS
        },
    ),
];

/// The request rules that come with the normaliser `name`, if any.
pub fn answers(name: &str) -> Option<&'static Answers> {
    REGISTRY
        .iter()
        .find(|(n, ..)| *n == name)
        .map(|(.., answers)| answers)
}

/// The `[[links]]` and `((refs))` in `text`, each with its brackets.
pub fn links(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for (open, close) in [("[[", "]]"), ("((", "))")] {
        let mut rest = text;
        while let Some(start) = rest.find(open) {
            let after = &rest[start + open.len()..];
            let Some(end) = after.find(close) else { break };
            let whole = &rest[start..start + open.len() + end + close.len()];
            if end > 0 {
                out.push(whole);
            }
            rest = &rest[start + whole.len()..];
        }
    }
    out
}

/// The normaliser a template names, if there is one by that name.
pub fn by_name(name: &str) -> Option<Normaliser> {
    REGISTRY
        .iter()
        .find(|(n, ..)| *n == name)
        .map(|(_, normaliser, _)| *normaliser)
}

/// The names of every normaliser, for error messages.
pub fn names() -> impl Iterator<Item = &'static str> {
    REGISTRY.iter().map(|(name, ..)| *name)
}

/// The integration actions: the contract's three, and the older version's `skip` (the
/// integration schema's `action` enum; a test keeps them equal).
pub const ACTIONS: [&str; 4] = ["add_section", "add_under", "replace", "skip"];

/// The LLM streaming contract's (seed 000's) own actions, its model's `Literal`: no `skip`
/// (`integration-decisions-seed-000`'s schema enum; a test keeps them equal).
pub const ACTIONS_SEED_000: [&str; 3] = ["add_section", "add_under", "replace"];

/// The rules for [`KNOWLEDGE_CLASSIFICATION`] lines
/// (docs/protocol.md#structured-output-contracts):
/// - not a JSON object → drop (docs/protocol.md#streamed-json-lines);
/// - a required field missing → drop; a required field of the wrong type (e.g. confidence
///   `"high"`, is_knowledge `"true"`) → drop;
/// - `block_id` empty → drop (it must be a non-empty string);
/// - `confidence` outside [0, 1] → clamp, warn (the decisions' rule; the classification
///   contract states the range);
/// - unknown fields → kept, ignored.
pub fn normalise_classification(value: &mut Value) -> Normalised {
    outcome(classification_rules(
        value,
        &[
            ("block_id", FieldType::String),
            ("is_knowledge", FieldType::Boolean),
            ("confidence", FieldType::Number),
            ("reason", FieldType::String),
        ],
        &[],
        OutOfRange::Clamp,
    ))
}

/// The LLM streaming contract's (seed 000's) own classification lines: the rules of
/// [`normalise_classification`], and a line whose `is_knowledge` is `false` is dropped. That
/// contract returns knowledge blocks only (its model's `is_knowledge` is "always true in
/// output", activity blocks are "NOT included in the output stream"), so its client takes
/// every line it reads for knowledge.
pub fn normalise_classification_seed_000(value: &mut Value) -> Normalised {
    let kept = normalise_classification(value);
    if matches!(kept, Normalised::Keep { .. })
        && value.get("is_knowledge") == Some(&Value::Bool(false))
    {
        return Normalised::Skip {
            reason: "`is_knowledge` is false: the contract returns knowledge blocks only"
                .to_owned(),
        };
    }
    kept
}

/// The LLM API contracts' classification lines, `{"block_id","confidence","reason"}`: the rules of
/// [`normalise_classification`] without `is_knowledge` (the LLM API contracts return only the
/// knowledge blocks and has no such field); one written anyway must be a boolean.
pub fn normalise_classification_seed_001(value: &mut Value) -> Normalised {
    outcome(classification_rules(
        value,
        &[
            ("block_id", FieldType::String),
            ("confidence", FieldType::Number),
            ("reason", FieldType::String),
        ],
        &[("is_knowledge", FieldType::Boolean)],
        OutOfRange::Clamp,
    ))
}

/// The NDJSON parser contract's classification lines, `{"block_id","is_knowledge","confidence"}`
/// (§3.1): one per block, `is_knowledge` false kept (it is the answer for an activity block); the
/// rules of [`normalise_classification`] without `reason`, which must be a string if written,
/// and a `confidence` outside [0, 1] drops the line: §3.1 says it "must be float in range" and
/// has no clamp rule (its decisions, §3.2, do).
pub fn normalise_classification_seed_002(value: &mut Value) -> Normalised {
    outcome(classification_rules(
        value,
        &[
            ("block_id", FieldType::String),
            ("is_knowledge", FieldType::Boolean),
            ("confidence", FieldType::Number),
        ],
        &[("reason", FieldType::String)],
        OutOfRange::Drop,
    ))
}

/// What a contract does with a `confidence` outside [0, 1].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OutOfRange {
    /// Clamp it, with a warning.
    Clamp,
    /// Drop the line.
    Drop,
}

fn classification_rules(
    value: &mut Value,
    required: &[(&str, FieldType)],
    optional: &[(&str, FieldType)],
    out_of_range: OutOfRange,
) -> Result<Vec<String>, String> {
    let object = as_object(value)?;
    // Rules "missing required field → skip" and "invalid type → skip".
    require(object, required)?;
    for (name, kind) in optional {
        if let Some(v) = object.get(*name)
            && !kind.accepts(v)
        {
            return Err(format!("field `{name}` is not {}", kind.name()));
        }
    }
    // Rule "block_id must be non-empty".
    require_non_empty(object, "block_id")?;
    let mut warnings = Vec::new();
    match out_of_range {
        // Rule "invalid confidence range → clamp".
        OutOfRange::Clamp => clamp_confidence(object, &mut warnings),
        // Rule "confidence must be in range [0.0, 1.0]", without a correction.
        OutOfRange::Drop => {
            if object
                .get("confidence")
                .and_then(Value::as_f64)
                .is_some_and(|c| !(0.0..=1.0).contains(&c))
            {
                return Err("field `confidence` is outside [0.0, 1.0]".to_owned());
            }
        }
    }
    // Rule "unknown fields → ignore": left in place; the schema allows them.
    Ok(warnings)
}

/// The rules for [`CONTENT_REWORDING`] lines (docs/protocol.md#structured-output-contracts;
/// the oldest contract's `refined_text` is `reworded_content`):
/// - not a JSON object → drop (docs/protocol.md#streamed-json-lines);
/// - a required field missing or of the wrong type → drop;
/// - `block_id` empty → drop (block ids are non-empty; an empty id matches no block);
/// - `reworded_content` empty or only whitespace → drop;
/// - `reworded_content` written as a bullet outline → flattened into plain continuation
///   lines, warn (plain block content, no bullet markers or indentation).
///
/// The rules "block_id must match a block from Phase 1" and "preserve `[[links]]` and
/// `((refs))`" need the request, which a per-object normaliser does not see.
pub fn normalise_rewording(value: &mut Value) -> Normalised {
    outcome(rewording_rules(value, "reworded_content"))
}

/// The NDJSON parser contract's rewording lines, `{"block_id","refined_text"}` (§3.3): the rules of
/// [`normalise_rewording`] on `refined_text`.
pub fn normalise_rewording_seed_002(value: &mut Value) -> Normalised {
    outcome(rewording_rules(value, "refined_text"))
}

fn rewording_rules(value: &mut Value, text: &str) -> Result<Vec<String>, String> {
    let object = as_object(value)?;
    // Rules "missing required field → skip" and "invalid type → skip".
    require(
        object,
        &[("block_id", FieldType::String), (text, FieldType::String)],
    )?;
    // Rule "block_id must be non-empty".
    require_non_empty(object, "block_id")?;
    // Rule "empty refined_text → skip".
    require_non_empty(object, text)?;
    let mut warnings = Vec::new();
    // Rule "plain block content (no bullet markers or indentation)".
    if let Some(Value::String(content)) = object.get_mut(text)
        && let Some(plain) = plain_block_content(content)
    {
        *content = plain;
        warnings.push(format!(
            "{text} was a bullet outline; bullet markers and indentation removed"
        ));
    }
    Ok(warnings)
}

/// The rules for [`INTEGRATION_DECISIONS`] lines
/// (docs/protocol.md#structured-output-contracts; the oldest contract's `page`, `target_id`,
/// `target_title` are `target_page`, `target_block_id`, `target_block_title`):
/// - not a JSON object → drop (docs/protocol.md#streamed-json-lines);
/// - a required field missing, or `knowledge_block_id`, `target_page`, `confidence`,
///   `reasoning` of the wrong type → drop (the classification rules, applied to every phase);
/// - `knowledge_block_id` empty → drop (block ids are non-empty);
/// - `confidence` outside [0, 1] → clamp, warn;
/// - `action` not one of `add_section`, `add_under`, `replace`, `skip` (or not a string) →
///   `skip`, warn;
/// - `add_under` / `replace` without a `target_block_id` (absent, null, empty, not a string) →
///   `add_section` with both targets null, warn;
/// - `add_under` / `replace` without a `target_block_title` → kept, warn (the title is for
///   display only, and the contract's model makes it optional);
/// - `skip` / `add_section` with a target → targets set to null, warn (they must be null);
/// - `reasoning` empty → kept, warn ("should be non-empty, but parser won't fail").
///
/// A `skip` decision is kept: it is an answer ("not relevant for this page", in the older
/// version), not a dropped line. The contract's "at most 2 decisions per (knowledge block,
/// target page) pair" spans lines, beyond a per-object normaliser.
pub fn normalise_integration(value: &mut Value) -> Normalised {
    outcome(integration_rules(value, &DECISION_FIELDS))
}

/// The LLM streaming contract's (seed 000's) own decision lines, as its client's model
/// `IntegrationDecisionChunk` reads them: the rules of [`normalise_integration`] with the
/// contract's three actions only. That model refuses any other `action`, so a line with
/// `skip` or an unknown action is dropped (counted as skipped), not rewritten to `skip`.
pub fn normalise_integration_seed_000(value: &mut Value) -> Normalised {
    outcome(integration_rules(value, &DECISION_FIELDS_SEED_000))
}

/// The NDJSON parser contract's decision lines,
/// `{"page","action","target_id","target_title","confidence", "reasoning"}` (§3.2, one knowledge
/// block per request, so no block id): the rules of [`normalise_integration`] under those names.
pub fn normalise_integration_seed_002(value: &mut Value) -> Normalised {
    outcome(integration_rules(value, &DECISION_FIELDS_SEED_002))
}

/// The field names of one version of the decision contract.
struct DecisionFields {
    /// The knowledge block's id, when the lines carry it.
    block: Option<&'static str>,
    page: &'static str,
    target_id: &'static str,
    target_title: &'static str,
    /// The actions a line may name; `skip` among them is also what an unknown one becomes.
    /// Without `skip`, a line naming another action is dropped.
    actions: &'static [&'static str],
}

const DECISION_FIELDS: DecisionFields = DecisionFields {
    block: Some("knowledge_block_id"),
    page: "target_page",
    target_id: "target_block_id",
    target_title: "target_block_title",
    actions: &ACTIONS,
};

const DECISION_FIELDS_SEED_000: DecisionFields = DecisionFields {
    actions: &ACTIONS_SEED_000,
    ..DECISION_FIELDS
};

const DECISION_FIELDS_SEED_002: DecisionFields = DecisionFields {
    block: None,
    page: "page",
    target_id: "target_id",
    target_title: "target_title",
    actions: &ACTIONS,
};

fn integration_rules(value: &mut Value, names: &DecisionFields) -> Result<Vec<String>, String> {
    let object = as_object(value)?;
    // Rules "missing required field → skip" and "invalid type → skip" (an action of
    // any type is corrected below rather than dropped).
    let mut required = vec![
        (names.page, FieldType::String),
        ("action", FieldType::Any),
        ("confidence", FieldType::Number),
        ("reasoning", FieldType::String),
    ];
    if let Some(block) = names.block {
        required.insert(0, (block, FieldType::String));
    }
    require(object, &required)?;
    // Rule "block ids must be non-empty".
    if let Some(block) = names.block {
        require_non_empty(object, block)?;
    }
    let mut warnings = Vec::new();
    // Rule "invalid confidence range → clamp".
    clamp_confidence(object, &mut warnings);
    // Rule "invalid action value → default to skip", where the contract has `skip`.
    let known = object
        .get("action")
        .and_then(Value::as_str)
        .and_then(|action| names.actions.iter().find(|a| **a == action).copied());
    let action = match known {
        Some(action) => action,
        None if names.actions.contains(&"skip") => {
            object.insert("action".to_owned(), json!("skip"));
            warnings.push("unknown action replaced by `skip`".to_owned());
            "skip"
        }
        // A contract without `skip` has no answer to put there: its client refuses the line.
        None => {
            return Err(format!(
                "field `action` is not one of {}",
                names.actions.join(", ")
            ));
        }
    };
    if action == "add_under" || action == "replace" {
        let has_target = non_blank_str(object.get(names.target_id));
        if !has_target {
            // Rule "missing target_id when required → add_section".
            object.insert("action".to_owned(), json!("add_section"));
            clear_targets(object, names);
            warnings.push(format!(
                "`{action}` without {} changed to `add_section`",
                names.target_id
            ));
        } else if !non_blank_str(object.get(names.target_title)) {
            // Rule "add_under/replace need a non-null target_title": warn only.
            warnings.push(format!("`{action}` has no {}", names.target_title));
        }
    } else if clear_targets(object, names) {
        // Rule "skip/add_section: target_id and target_title must be null".
        warnings.push(format!("targets cleared: `{action}` takes no target block"));
    }
    // Rule "reasoning should be non-empty (but parser won't fail if empty)".
    if !non_blank_str(object.get("reasoning")) {
        warnings.push("reasoning is empty".to_owned());
    }
    Ok(warnings)
}

fn outcome(result: Result<Vec<String>, String>) -> Normalised {
    match result {
        Ok(warnings) => Normalised::Keep { warnings },
        Err(reason) => Normalised::Skip { reason },
    }
}

/// A line that parses to anything but an object is skipped
/// (docs/protocol.md#streamed-json-lines).
fn as_object(value: &mut Value) -> Result<&mut Map<String, Value>, String> {
    value
        .as_object_mut()
        .ok_or_else(|| "not a JSON object".to_owned())
}

/// The JSON type a required field must have.
#[derive(Debug, Clone, Copy)]
enum FieldType {
    String,
    Boolean,
    Number,
    /// Present, of any type (a later rule corrects it).
    Any,
}

impl FieldType {
    fn accepts(self, value: &Value) -> bool {
        match self {
            FieldType::String => value.is_string(),
            FieldType::Boolean => value.is_boolean(),
            FieldType::Number => value.is_number(),
            FieldType::Any => true,
        }
    }

    fn name(self) -> &'static str {
        match self {
            FieldType::String => "a string",
            FieldType::Boolean => "a boolean",
            FieldType::Number => "a number",
            FieldType::Any => "a value",
        }
    }
}

/// A missing required field, or one of the wrong type, drops the object
/// (docs/protocol.md#structured-output-contracts).
fn require(object: &Map<String, Value>, fields: &[(&str, FieldType)]) -> Result<(), String> {
    for (name, kind) in fields {
        match object.get(*name) {
            None => return Err(format!("missing required field `{name}`")),
            Some(value) if !kind.accepts(value) => {
                return Err(format!("field `{name}` is not {}", kind.name()));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Drops the object if the (string) field is empty or only whitespace.
fn require_non_empty(object: &Map<String, Value>, field: &str) -> Result<(), String> {
    if non_blank_str(object.get(field)) {
        Ok(())
    } else {
        Err(format!("field `{field}` is empty"))
    }
}

fn non_blank_str(value: Option<&Value>) -> bool {
    value
        .and_then(Value::as_str)
        .is_some_and(|s| !s.trim().is_empty())
}

/// A confidence outside [0, 1] is clamped, with a warning
/// (docs/protocol.md#structured-output-contracts).
fn clamp_confidence(object: &mut Map<String, Value>, warnings: &mut Vec<String>) {
    let Some(confidence) = object.get("confidence").and_then(Value::as_f64) else {
        return;
    };
    let (clamped, warning) = if confidence < 0.0 {
        (0.0, "confidence below 0 clamped to 0")
    } else if confidence > 1.0 {
        (1.0, "confidence above 1 clamped to 1")
    } else {
        return;
    };
    object.insert("confidence".to_owned(), json!(clamped));
    warnings.push(warning.to_owned());
}

/// Sets the target id and title (`names`' fields) to null where they are present and not
/// null; says whether it changed anything.
fn clear_targets(object: &mut Map<String, Value>, names: &DecisionFields) -> bool {
    let mut cleared = false;
    for field in [names.target_id, names.target_title] {
        if let Some(value) = object.get_mut(field)
            && !value.is_null()
        {
            *value = Value::Null;
            cleared = true;
        }
    }
    cleared
}

/// Content written as a bullet outline (any line, after its indentation, starting with a `- `
/// or `* ` marker) becomes plain block content (docs/protocol.md#structured-output-contracts):
/// each line without its indentation and bullet marker, children flattened into continuation
/// lines. `None` if the content has no bullet line (its indentation is then left alone: it
/// may be code).
fn plain_block_content(content: &str) -> Option<String> {
    fn bullet_text(line: &str) -> Option<&str> {
        let line = line.trim_start();
        if line == "-" || line == "*" {
            return Some("");
        }
        line.strip_prefix("- ")
            .or_else(|| line.strip_prefix("* "))
            .map(str::trim_start)
    }
    if !content.lines().any(|line| bullet_text(line).is_some()) {
        return None;
    }
    let plain: Vec<&str> = content
        .lines()
        .map(|line| bullet_text(line).unwrap_or_else(|| line.trim_start()))
        .collect();
    Some(plain.join("\n"))
}
