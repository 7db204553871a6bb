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
//! the newest's (with Pydantic models); the one a day older adds the integration action `skip`
//! and its `skip_reason`; the oldest (with other field names: `page`, `target_id`,
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

pub use crate::normalise::{CONTENT_REWORDING, INTEGRATION_DECISIONS, KNOWLEDGE_CLASSIFICATION};

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
}

/// The files of the built-in template `$id` (the directory `services/prompt/builtin/$id`).
macro_rules! files {
    ($id:literal, $response_type:expr, $normaliser:expr) => {
        Files {
            id: $id,
            system: include_str!(concat!("../builtin/", $id, "/system.txt")),
            prompt: include_str!(concat!("../builtin/", $id, "/prompt.jinja")),
            schema: include_str!(concat!("../builtin/", $id, "/schema.json")),
            response_type: $response_type,
            normaliser: $normaliser,
        }
    };
}

/// Every built-in template, in the order the docs list them.
const FILES: [Files; 3] = [
    files!(
        "knowledge-classification",
        ResponseType::Jsonl,
        KNOWLEDGE_CLASSIFICATION
    ),
    files!("content-rewording", ResponseType::Jsonl, CONTENT_REWORDING),
    files!(
        "integration-decisions",
        ResponseType::Jsonl,
        INTEGRATION_DECISIONS
    ),
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
