//! The built-in templates: the three NDJSON prompts of a knowledge-base application (it
//! classifies journal blocks, rewords the knowledge, and decides where to integrate it), each
//! with the JSON Schema of one output line and the corrections made to a line before
//! validating it: the classification, rewording and integration contracts of
//! docs/protocol.md#structured-output-contracts.
//!
//! The application wrote three versions of its contracts. Field names, prompts and models are
//! the newest's (with Pydantic models); the one a day older adds the integration action `skip`
//! and its `skip_reason`; the oldest (with other field names: `page`, `target_id`,
//! `target_title`, `refined_text`) contributes its validation and error-handling rules only,
//! translated to the newest names.
//!
//! A normaliser must never quote the model's output in a warning or a skip reason (it is
//! derived from user content): field names and enum values only. It must never drop an object
//! that a rule says to correct, nor keep one that a rule says to drop.

use serde_json::{Map, Value, json};

use crate::ResponseType;

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

/// A template shipped with sluice.
#[derive(Debug, Clone)]
pub struct BuiltinTemplate {
    /// The template id requests name.
    pub id: &'static str,
    /// Its system prompt, if it overrides the global one.
    pub system: Option<&'static str>,
    /// The prompt, minijinja syntax.
    pub prompt: &'static str,
    /// The output mode.
    pub response_type: ResponseType,
    /// The JSON Schema each object (jsonl) or the value (json) must satisfy.
    pub schema: fn() -> Value,
    /// Corrections applied before validation.
    pub normalise: Option<Normaliser>,
}

/// Every built-in template.
pub fn all() -> Vec<BuiltinTemplate> {
    vec![
        BuiltinTemplate {
            id: KNOWLEDGE_CLASSIFICATION,
            system: Some(CLASSIFICATION_SYSTEM),
            prompt: CLASSIFICATION_PROMPT,
            response_type: ResponseType::Jsonl,
            schema: classification_schema,
            normalise: Some(normalise_classification),
        },
        BuiltinTemplate {
            id: CONTENT_REWORDING,
            system: Some(REWORDING_SYSTEM),
            prompt: REWORDING_PROMPT,
            response_type: ResponseType::Jsonl,
            schema: rewording_schema,
            normalise: Some(normalise_rewording),
        },
        BuiltinTemplate {
            id: INTEGRATION_DECISIONS,
            system: Some(INTEGRATION_SYSTEM),
            prompt: INTEGRATION_PROMPT,
            response_type: ResponseType::Jsonl,
            schema: integration_schema,
            normalise: Some(normalise_integration),
        },
    ]
}

/// The built-in template with this id.
pub fn find(id: &str) -> Option<BuiltinTemplate> {
    all().into_iter().find(|t| t.id == id)
}

// The templates. Whitespace: no block tag (`{% %}`) is ever followed by a newline (newlines
// after one are written as `{{ "\n" }}`) nor preceded by indentation, so a template renders
// the same whether or not the environment sets `trim_blocks` / `lstrip_blocks`. Render with
// auto-escaping off (minijinja's default for names without an `.html`-like extension).

/// The classification contract (docs/protocol.md#structured-output-contracts; the older
/// version is the same exchange without `is_knowledge`). Renders "Analyze these journal
/// blocks:" and each block as `Block ID: …` / `Content: …`, blocks separated by a blank line,
/// then the NDJSON instruction.
///
/// Terms:
/// - `blocks`: array of objects, the journal blocks to classify, each with
///   - `block_id`: string, the block's id (its `id::` property or content hash);
///   - `content`: string, the block's text with its children, as in the journal
///     (continuation lines indented by two spaces in the contract's example).
///
/// Answer: one [`classification_schema`] object per line, for knowledge blocks only.
pub const KNOWLEDGE_CLASSIFICATION: &str = "knowledge-classification";

/// The rewording contract (docs/protocol.md#structured-output-contracts; the older version
/// is the same exchange). Renders "Reword these knowledge blocks:" and each block as
/// `Block ID: …` / `Original Content: …`, separated by a blank line, then the NDJSON
/// instruction.
///
/// Terms:
/// - `blocks`: array of objects, the knowledge blocks to reword, each with
///   - `block_id`: string;
///   - `content`: string, the original journal text of the block with its children.
///
/// Answer: one [`rewording_schema`] object per line, one per block.
pub const CONTENT_REWORDING: &str = "content-rewording";

/// The integration contract (docs/protocol.md#structured-output-contracts; the older version
/// also allows `skip`). Renders "Decide integration for these knowledge blocks and candidate
/// pages:" and, per knowledge block, `Knowledge Block ID: …`, `Content: …`,
/// `Original Context: …` (if given), then `Candidate Pages:` numbered from 1, each as
/// `N. Page: …` with its `Existing Structure:` outline indented by three spaces; then the
/// NDJSON instruction.
///
/// Terms:
/// - `knowledge_blocks`: array of objects, each with
///   - `block_id`: string;
///   - `content`: string, the (reworded) knowledge;
///   - `original_context`: string, optional (may be absent or null), the page references of
///     the journal block, e.g. `[[Python]] [[Textual]]`;
///   - `candidate_pages`: array of objects, the pages a search found for this block, each with
///     - `page_name`: string, hierarchical with `/` (e.g. `Python/Concurrency`);
///     - `structure`: string, the page's existing outline as Logseq markdown (`- ` bullets,
///       two-space nesting), with `id:: …` properties naming the blocks an `add_under` or
///       `replace` may target.
///
/// Answer: one [`integration_schema`] object per line, for relevant pages only.
pub const INTEGRATION_DECISIONS: &str = "integration-decisions";

/// The classification contract's system prompt, verbatim
/// (docs/protocol.md#structured-output-contracts).
const CLASSIFICATION_SYSTEM: &str = "You are an AI assistant that identifies lasting knowledge in journal entries. Classify each block as either 'knowledge' (lasting insight worth preserving) or 'activity' (temporal event/task). For each block classified as knowledge, respond with a single-line JSON object containing: block_id (string), is_knowledge (boolean, always true for returned items), confidence (float 0-1), reason (string explaining why this is knowledge). Only return blocks that are knowledge - omit activity blocks from output. Output one JSON object per line (NDJSON format).";

/// The classification contract's user message, from `blocks`.
const CLASSIFICATION_PROMPT: &str = r#"Analyze these journal blocks:

{% for block in blocks %}{% if not loop.first %}{{ "\n\n" }}{% endif %}Block ID: {{ block.block_id }}
Content: {{ block.content }}{% endfor %}{{ "\n\n" }}Output one JSON object per line (NDJSON format), only for the blocks that are knowledge: no JSON array, no code fences, no other text."#;

/// The rewording contract's system prompt, verbatim
/// (docs/protocol.md#structured-output-contracts).
const REWORDING_SYSTEM: &str = "You are an AI assistant that transforms journal-style content into evergreen knowledge. Remove temporal context (dates, 'today', 'yesterday'), convert first-person to third-person or neutral, and make the content timeless. Preserve all technical details and insights. For each block, respond with a single-line JSON object containing: block_id (string), reworded_content (string). Output one JSON object per line (NDJSON format).";

/// The rewording contract's user message, from `blocks`.
const REWORDING_PROMPT: &str = r#"Reword these knowledge blocks:

{% for block in blocks %}{% if not loop.first %}{{ "\n\n" }}{% endif %}Block ID: {{ block.block_id }}
Original Content: {{ block.content }}{% endfor %}{{ "\n\n" }}Output one JSON object per line (NDJSON format), one for each block: no JSON array, no code fences, no other text."#;

/// The integration contract's system prompt, verbatim
/// (docs/protocol.md#structured-output-contracts).
const INTEGRATION_SYSTEM: &str = "You are an AI assistant that decides where to integrate knowledge into a knowledge base. For each (knowledge block, candidate page) pair, decide the best integration action. Actions: 'add_section' (create new top-level section), 'add_under' (add as child under existing block), 'replace' (replace existing block content). Only return decisions for relevant integrations - omit irrelevant candidate pages. Return at most 2 decisions per (knowledge block, target page) pair. For each relevant integration, respond with a single-line JSON object containing: knowledge_block_id (string), target_page (string), action (string: add_section|add_under|replace), target_block_id (string or null), target_block_title (string or null), confidence (float 0-1), reasoning (string). Output one JSON object per line (NDJSON format).";

/// The integration contract's user message, from `knowledge_blocks`.
const INTEGRATION_PROMPT: &str = r#"Decide integration for these knowledge blocks and candidate pages:

{% for block in knowledge_blocks %}{% if not loop.first %}{{ "\n\n" }}{% endif %}Knowledge Block ID: {{ block.block_id }}
Content: {{ block.content }}{% if block.original_context is defined and block.original_context %}{{ "\n" }}Original Context: {{ block.original_context }}{% endif %}{{ "\n\n" }}Candidate Pages:{% for page in block.candidate_pages %}{{ "\n\n" }}{{ loop.index }}. Page: {{ page.page_name }}
   Existing Structure:

   {{ page.structure | indent(3) }}{% endfor %}{% endfor %}{{ "\n\n" }}Output one JSON object per line (NDJSON format), only for the relevant integrations: no JSON array, no code fences, no other text."#;

const SCHEMA_DRAFT: &str = "https://json-schema.org/draft/2020-12/schema";

/// One line of [`KNOWLEDGE_CLASSIFICATION`]: the contract's `KnowledgeClassificationChunk`
/// (docs/protocol.md#structured-output-contracts). Extra fields are allowed (Pydantic ignores
/// them; the oldest contract's rule: "Unknown fields → Ignore").
pub fn classification_schema() -> Value {
    json!({
        "$schema": SCHEMA_DRAFT,
        "title": "KnowledgeClassificationChunk",
        "description": "Single classification result from NDJSON stream.",
        "type": "object",
        "required": ["block_id", "is_knowledge", "confidence", "reason"],
        "properties": {
            "block_id": {"type": "string", "description": "Block identifier from input"},
            "is_knowledge": {
                "type": "boolean",
                "description": "Whether block contains knowledge (always true in output)"
            },
            "confidence": {
                "type": "number", "minimum": 0.0, "maximum": 1.0,
                "description": "Confidence score (0.0-1.0)"
            },
            "reason": {"type": "string", "description": "Explanation for why this is knowledge"}
        },
        "additionalProperties": true
    })
}

/// One line of [`CONTENT_REWORDING`]: the contract's `ContentRewordingChunk`
/// (docs/protocol.md#structured-output-contracts). Extra fields are allowed.
pub fn rewording_schema() -> Value {
    json!({
        "$schema": SCHEMA_DRAFT,
        "title": "ContentRewordingChunk",
        "description": "Single rewording result from NDJSON stream.",
        "type": "object",
        "required": ["block_id", "reworded_content"],
        "properties": {
            "block_id": {"type": "string", "description": "Block identifier from input"},
            "reworded_content": {
                "type": "string", "minLength": 1,
                "description": "Reworded content with temporal context removed"
            }
        },
        "additionalProperties": true
    })
}

/// One line of [`INTEGRATION_DECISIONS`]: the contract's `IntegrationDecisionChunk`, with the
/// older version's `skip` action and optional `skip_reason` (the oldest's rules also make
/// `skip` the default for an unknown action; docs/protocol.md#structured-output-contracts).
/// Extra fields are allowed.
pub fn integration_schema() -> Value {
    json!({
        "$schema": SCHEMA_DRAFT,
        "title": "IntegrationDecisionChunk",
        "description": "Single integration decision from NDJSON stream.",
        "type": "object",
        "required": ["knowledge_block_id", "target_page", "action", "confidence", "reasoning"],
        "properties": {
            "knowledge_block_id": {
                "type": "string",
                "description": "Block ID of the knowledge being integrated"
            },
            "target_page": {
                "type": "string",
                "description": "Target page name (hierarchical pages use '/' separator)"
            },
            "action": {
                "type": "string",
                "enum": ACTIONS,
                "description": "Type of integration action"
            },
            "target_block_id": {
                "type": ["string", "null"],
                "description": "Target block ID for 'add_under' or 'replace' actions"
            },
            "target_block_title": {
                "type": ["string", "null"],
                "description": "Human-readable title of target block (for display)"
            },
            "confidence": {
                "type": "number", "minimum": 0.0, "maximum": 1.0,
                "description": "LLM's confidence score for this integration (0.0-1.0)"
            },
            "reasoning": {
                "type": "string",
                "description": "LLM's explanation for this integration decision"
            },
            "skip_reason": {
                "type": ["string", "null"],
                "description": "Why the page was skipped (action 'skip')"
            }
        },
        "additionalProperties": true
    })
}

/// The integration actions: the contract's three, and the older version's `skip`.
const ACTIONS: [&str; 4] = ["add_section", "add_under", "replace", "skip"];

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
    outcome(classification_rules(value))
}

fn classification_rules(value: &mut Value) -> Result<Vec<String>, String> {
    let object = as_object(value)?;
    // Rules "missing required field → skip" and "invalid type → skip".
    require(
        object,
        &[
            ("block_id", FieldType::String),
            ("is_knowledge", FieldType::Boolean),
            ("confidence", FieldType::Number),
            ("reason", FieldType::String),
        ],
    )?;
    // Rule "block_id must be non-empty".
    require_non_empty(object, "block_id")?;
    let mut warnings = Vec::new();
    // Rule "invalid confidence range → clamp".
    clamp_confidence(object, &mut warnings);
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
    outcome(rewording_rules(value))
}

fn rewording_rules(value: &mut Value) -> Result<Vec<String>, String> {
    let object = as_object(value)?;
    // Rules "missing required field → skip" and "invalid type → skip".
    require(
        object,
        &[
            ("block_id", FieldType::String),
            ("reworded_content", FieldType::String),
        ],
    )?;
    // Rule "block_id must be non-empty".
    require_non_empty(object, "block_id")?;
    // Rule "empty refined_text → skip".
    require_non_empty(object, "reworded_content")?;
    let mut warnings = Vec::new();
    // Rule "plain block content (no bullet markers or indentation)".
    if let Some(Value::String(content)) = object.get_mut("reworded_content")
        && let Some(plain) = plain_block_content(content)
    {
        *content = plain;
        warnings.push(
            "reworded_content was a bullet outline; bullet markers and indentation removed"
                .to_owned(),
        );
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
    outcome(integration_rules(value))
}

fn integration_rules(value: &mut Value) -> Result<Vec<String>, String> {
    let object = as_object(value)?;
    // Rules "missing required field → skip" and "invalid type → skip" (an action of
    // any type is corrected below rather than dropped).
    require(
        object,
        &[
            ("knowledge_block_id", FieldType::String),
            ("target_page", FieldType::String),
            ("action", FieldType::Any),
            ("confidence", FieldType::Number),
            ("reasoning", FieldType::String),
        ],
    )?;
    // Rule "block ids must be non-empty".
    require_non_empty(object, "knowledge_block_id")?;
    let mut warnings = Vec::new();
    // Rule "invalid confidence range → clamp".
    clamp_confidence(object, &mut warnings);
    // Rule "invalid action value → default to skip".
    let known = object
        .get("action")
        .and_then(Value::as_str)
        .and_then(|action| ACTIONS.iter().find(|a| **a == action).copied());
    let action = match known {
        Some(action) => action,
        None => {
            object.insert("action".to_owned(), json!("skip"));
            warnings.push("unknown action replaced by `skip`".to_owned());
            "skip"
        }
    };
    if action == "add_under" || action == "replace" {
        let has_target = non_blank_str(object.get("target_block_id"));
        if !has_target {
            // Rule "missing target_id when required → add_section".
            object.insert("action".to_owned(), json!("add_section"));
            clear_targets(object);
            warnings.push(format!(
                "`{action}` without target_block_id changed to `add_section`"
            ));
        } else if !non_blank_str(object.get("target_block_title")) {
            // Rule "add_under/replace need a non-null target_title": warn only.
            warnings.push(format!("`{action}` has no target_block_title"));
        }
    } else if clear_targets(object) {
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

/// Sets `target_block_id` and `target_block_title` to null where they are present and not
/// null; says whether it changed anything.
fn clear_targets(object: &mut Map<String, Value>) -> bool {
    let mut cleared = false;
    for field in ["target_block_id", "target_block_title"] {
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

/// The seeds' streams (plain data in the tests crate), included by path so these tests can
/// run every stream through the real normalisers and schemas without a crate dependency.
#[cfg(test)]
#[path = "../../../tests/src/seed_streams.rs"]
#[allow(dead_code)]
mod seed_streams;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use minijinja::{Environment, UndefinedBehavior};

    use super::*;

    fn template(id: &str) -> BuiltinTemplate {
        find(id).unwrap()
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
        jsonschema::validator_for(&(template(id).schema)()).unwrap()
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

    /// Seed 000 Phase 1's "Formatted Blocks Example" as terms.
    fn classification_terms() -> Value {
        json!({"blocks": [
            {"block_id": "abc123", "content": "- Learned that Python's asyncio.Queue is thread-safe\n  This is important for background tasks in Textual"},
            {"block_id": "def456", "content": "- Had lunch with Sarah\n  Discussed project timeline"},
            {"block_id": "ghi789", "content": "- Discovered that ChromaDB requires sentence-transformers\n  It downloads a 90MB model on first run"},
        ]})
    }

    /// Seed 000 Phase 3's "Formatted Knowledge and Candidates Example" as terms.
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

    #[test]
    fn all_three_are_jsonl_with_valid_schemas_and_normalisers() {
        let ids: Vec<_> = all().iter().map(|t| t.id).collect();
        assert_eq!(
            ids,
            [
                "knowledge-classification",
                "content-rewording",
                "integration-decisions"
            ]
        );
        for t in all() {
            assert_eq!(t.response_type, ResponseType::Jsonl);
            assert!(t.normalise.is_some());
            let schema = (t.schema)();
            assert_eq!(schema["$schema"], SCHEMA_DRAFT);
            assert!(jsonschema::meta::is_valid(&schema), "{}", t.id);
            assert!(jsonschema::validator_for(&schema).is_ok(), "{}", t.id);
            // Both the system prompt and the user prompt ask for NDJSON.
            assert!(t.system.unwrap().contains("one JSON object per line"));
            assert!(
                t.prompt
                    .contains("Output one JSON object per line (NDJSON format)")
            );
        }
        assert!(find("nope").is_none());
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
        // Seed 000's example, byte for byte (up to its closing fence).
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

    // Every object of the seeds' clean streams (seed 000 and seed 001) validates as it is,
    // and the normaliser keeps it without a warning.
    #[test]
    fn seed_example_objects_validate_unchanged() {
        for (stream, id) in [
            ("classification", KNOWLEDGE_CLASSIFICATION),
            ("rewording", CONTENT_REWORDING),
            ("rewording-spaced", CONTENT_REWORDING),
            ("integration", INTEGRATION_DECISIONS),
            ("integration-with-skip", INTEGRATION_DECISIONS),
        ] {
            let validator = validator(id);
            let text = seed_streams::stream(stream).unwrap();
            for line in text.lines() {
                let mut value: Value = serde_json::from_str(line).unwrap();
                let before = value.clone();
                assert!(validator.is_valid(&value), "{stream}: {line}");
                assert_eq!(normalise(id, &mut value), keep(&[]), "{stream}");
                assert_eq!(value, before);
            }
        }
    }

    // Seed 002's objects use older field names (`page`, `target_id`, `refined_text`, no
    // `reason`); they are not valid lines of these templates.
    #[test]
    fn seed_002_field_names_are_not_this_contract() {
        let decision = json!({"page": "Microservices", "action": "add_under", "target_id": "block-uuid-123", "target_title": "Benefits", "confidence": 0.91, "reasoning": "Fits under Benefits"});
        assert!(!validator(INTEGRATION_DECISIONS).is_valid(&decision));
        let rewording = json!({"block_id": "abc123", "refined_text": "Bounded contexts matter more than service size."});
        assert!(!validator(CONTENT_REWORDING).is_valid(&rewording));
        let classification =
            json!({"block_id": "abc123", "is_knowledge": true, "confidence": 0.85});
        assert!(!validator(KNOWLEDGE_CLASSIFICATION).is_valid(&classification));
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
        // is_knowledge false (seed 002's activity lines) is a valid answer, kept as is.
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
        let warning =
            "reworded_content was a bullet outline; bullet markers and indentation removed";
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

    /// A reference jsonl consumer, counting as `seed_streams` documents: split at `\n`, trim,
    /// ignore blank and fence lines, parse, normalise, validate.
    fn consume(id: &str, text: &str) -> (Vec<Value>, usize, usize) {
        let validator = validator(id);
        let (mut objects, mut skipped, mut warned) = (Vec::new(), 0, 0);
        for line in text.split('\n').map(str::trim) {
            if line.is_empty() || line.starts_with("```") {
                continue;
            }
            let Ok(mut value) = serde_json::from_str::<Value>(line) else {
                skipped += 1;
                continue;
            };
            match normalise(id, &mut value) {
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
        for name in seed_streams::names() {
            let expected = seed_streams::expected(name).unwrap();
            assert!(find(expected.template).is_some(), "{name}");
            let (objects, skipped, warned) =
                consume(expected.template, seed_streams::stream(name).unwrap());
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
            INTEGRATION_DECISIONS,
            seed_streams::stream("integration-normalised").unwrap(),
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
