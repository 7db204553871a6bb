//! The built-in templates of seeds 000/001 (placeholder; filled in by the built-in templates work).

use serde_json::Value;

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

/// Corrects an object in place before schema validation (seed 002 §3's rules).
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
    Vec::new()
}
