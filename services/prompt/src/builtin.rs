//! The built-in templates: the three NDJSON prompts of a knowledge-base application (it
//! classifies journal blocks, rewords the knowledge, and decides where to integrate it), each
//! with the JSON Schema of one output line and the normaliser its lines get before they are
//! validated: the classification, rewording and integration contracts of
//! docs/protocol.md#structured-output-contracts. Their terms are in docs/prompt.md.
//!
//! The templates are data: `services/prompt/builtin/<id>/` holds `system.txt` (the system
//! prompt), `prompt.jinja` (the user message, minijinja) and `schema.json` (one output line),
//! compiled into the binary. A file's final newline is not part of its text, so editors may
//! add one. This module only says which files make a template, its output mode and which
//! normaliser ([`crate::normalise`]) it names.
//!
//! The application wrote three versions of its contracts. Field names, prompts and models are
//! the newest's (with Pydantic models; its own integration template keeps to its model's three
//! actions, without `skip`); the one a day older adds the integration action `skip` and its
//! `skip_reason`; the oldest (with other field names: `page`, `target_id`,
//! `target_title`, `refined_text`) contributes its validation and error-handling rules only,
//! translated to the newest names.
//!
//! Whitespace in the prompts: no block tag (`{% %}`) is ever followed by a newline (newlines
//! after one are written as `{{ "\n" }}`) nor preceded by indentation, so a template renders
//! the same whether or not the environment sets `trim_blocks` / `lstrip_blocks`. Render with
//! auto-escaping off (minijinja's default for names without an `.html`-like extension).

use serde_json::Value;

use crate::{
    ResponseType,
    normalise::{self, Normaliser},
};

pub use crate::normalise::{
    CONTENT_REWORDING, CONTENT_REWORDING_SEED_002, INTEGRATION_DECISIONS,
    INTEGRATION_DECISIONS_SEED_000, INTEGRATION_DECISIONS_SEED_002, KNOWLEDGE_CLASSIFICATION,
    KNOWLEDGE_CLASSIFICATION_SEED_000, KNOWLEDGE_CLASSIFICATION_SEED_001,
    KNOWLEDGE_CLASSIFICATION_SEED_002,
};

/// A template shipped with sluice.
#[derive(Debug, Clone)]
pub struct BuiltinTemplate {
    /// The template id requests name.
    pub id: &'static str,
    /// Its system prompt, overriding the global one.
    pub system: &'static str,
    /// The prompt, minijinja syntax.
    pub prompt: &'static str,
    /// The output mode.
    pub response_type: ResponseType,
    /// The JSON Schema each object (jsonl) or the value (json) must satisfy.
    pub schema: Value,
    /// Corrections applied before validation.
    pub normalise: Option<Normaliser>,
    /// The rules that need the request, which come with the normaliser.
    pub answers: Option<&'static normalise::Answers>,
    /// The sampling temperature its calls ask for (the phase's, as the structured contracts set
    /// it).
    pub temperature: Option<f64>,
    /// The retry policy its calls ask for: a structured contract's template asks for its
    /// contract's policy (the preset of the same name, `seed-000`...); sluice's own leave the
    /// processor's.
    pub retry: Option<&'static str>,
}

/// Why a built-in template's files do not make a template: only a broken build (the files are
/// compiled in, and the tests load every one).
#[derive(Debug, thiserror::Error)]
#[error("the built-in template {id:?} is broken: {message}")]
pub struct BuiltinError {
    /// The template.
    pub id: &'static str,
    /// What is wrong.
    pub message: String,
}

/// One built-in template's files and settings, as compiled in.
struct Files {
    id: &'static str,
    system: &'static str,
    prompt: &'static str,
    schema: &'static str,
    response_type: ResponseType,
    normaliser: &'static str,
    temperature: Option<f64>,
}

/// A built-in template: its id, the directories under `services/prompt/builtin/` its
/// `system.txt`, `prompt.jinja` and `schema.json` come from (versions of a contract share
/// the files they have in common), its normaliser and its temperature. Every built-in is a
/// `jsonl` template.
macro_rules! files {
    ($id:literal, system: $system:literal, prompt: $prompt:literal, schema: $schema:literal,
     $normaliser:expr, $temperature:expr) => {
        Files {
            id: $id,
            system: include_str!(concat!("../builtin/", $system, "/system.txt")),
            prompt: include_str!(concat!("../builtin/", $prompt, "/prompt.jinja")),
            schema: include_str!(concat!("../builtin/", $schema, "/schema.json")),
            response_type: ResponseType::Jsonl,
            normaliser: $normaliser,
            temperature: $temperature,
        }
    };
}

/// The phases' temperatures, as the LLM streaming contract and the LLM API contracts set them
/// (the NDJSON parser contract sets none; docs/specs.md#the-structured-ndjson-contracts).
const CLASSIFICATION_TEMPERATURE: Option<f64> = Some(0.3);
const REWORDING_TEMPERATURE: Option<f64> = Some(0.5);
const INTEGRATION_TEMPERATURE: Option<f64> = Some(0.4);

/// Every built-in template, in the order the docs list them: sluice's three (the LLM
/// streaming contract's prompts with one sentence added, which small local models need to keep
/// to the format), then each structured contract's own, its prompt text verbatim (the NDJSON
/// parser contract has none: its templates ask for its shapes in words of ours) and its line
/// shape.
const FILES: [Files; 12] = [
    files!("knowledge-classification", system: "knowledge-classification",
           prompt: "knowledge-classification", schema: "knowledge-classification",
           KNOWLEDGE_CLASSIFICATION, CLASSIFICATION_TEMPERATURE),
    files!("content-rewording", system: "content-rewording", prompt: "content-rewording",
           schema: "content-rewording", CONTENT_REWORDING, REWORDING_TEMPERATURE),
    files!("integration-decisions", system: "integration-decisions",
           prompt: "integration-decisions", schema: "integration-decisions",
           INTEGRATION_DECISIONS, INTEGRATION_TEMPERATURE),
    files!("knowledge-classification-seed-000", system: "knowledge-classification",
           prompt: "knowledge-classification-seed-000", schema: "knowledge-classification",
           KNOWLEDGE_CLASSIFICATION_SEED_000, CLASSIFICATION_TEMPERATURE),
    files!("content-rewording-seed-000", system: "content-rewording",
           prompt: "content-rewording-seed-000", schema: "content-rewording",
           CONTENT_REWORDING, REWORDING_TEMPERATURE),
    files!("integration-decisions-seed-000", system: "integration-decisions",
           prompt: "integration-decisions-seed-000", schema: "integration-decisions-seed-000",
           INTEGRATION_DECISIONS_SEED_000, INTEGRATION_TEMPERATURE),
    files!("knowledge-classification-seed-001", system: "knowledge-classification-seed-001",
           prompt: "knowledge-classification-seed-000",
           schema: "knowledge-classification-seed-001",
           KNOWLEDGE_CLASSIFICATION_SEED_001, CLASSIFICATION_TEMPERATURE),
    files!("content-rewording-seed-001", system: "content-rewording-seed-001",
           prompt: "content-rewording-seed-000", schema: "content-rewording",
           CONTENT_REWORDING, REWORDING_TEMPERATURE),
    files!("integration-decisions-seed-001", system: "integration-decisions-seed-001",
           prompt: "integration-decisions-seed-000", schema: "integration-decisions",
           INTEGRATION_DECISIONS, INTEGRATION_TEMPERATURE),
    files!("knowledge-classification-seed-002", system: "knowledge-classification-seed-002",
           prompt: "knowledge-classification-seed-002",
           schema: "knowledge-classification-seed-002",
           KNOWLEDGE_CLASSIFICATION_SEED_002, None),
    files!("content-rewording-seed-002", system: "content-rewording-seed-002",
           prompt: "content-rewording-seed-002", schema: "content-rewording-seed-002",
           CONTENT_REWORDING_SEED_002, None),
    files!("integration-decisions-seed-002", system: "integration-decisions-seed-002",
           prompt: "integration-decisions-seed-002", schema: "integration-decisions-seed-002",
           INTEGRATION_DECISIONS_SEED_002, None),
];

/// A file's text without its final newline.
fn text(file: &'static str) -> &'static str {
    file.strip_suffix('\n').unwrap_or(file)
}

impl Files {
    fn template(&self) -> Result<BuiltinTemplate, BuiltinError> {
        let broken = |message: String| BuiltinError {
            id: self.id,
            message,
        };
        let schema = serde_json::from_str(self.schema)
            .map_err(|e| broken(format!("schema.json is not JSON: {e}")))?;
        let normalise = normalise::by_name(self.normaliser)
            .ok_or_else(|| broken(format!("no normaliser {:?}", self.normaliser)))?;
        Ok(BuiltinTemplate {
            id: self.id,
            system: text(self.system),
            prompt: text(self.prompt),
            response_type: self.response_type,
            schema,
            normalise: Some(normalise),
            answers: normalise::answers(self.normaliser),
            temperature: self.temperature,
            retry: self.id.find("-seed-").map(|at| &self.id[at + 1..]),
        })
    }
}

/// Every built-in template.
pub fn all() -> Result<Vec<BuiltinTemplate>, BuiltinError> {
    FILES.iter().map(Files::template).collect()
}

/// The built-in template with this id.
pub fn find(id: &str) -> Result<Option<BuiltinTemplate>, BuiltinError> {
    FILES
        .iter()
        .find(|f| f.id == id)
        .map(Files::template)
        .transpose()
}

#[cfg(test)]
mod tests;
