//! sluice-prompt: the prompt processor. It renders a named template with the request's
//! terms, calls text-completion over the bus, and answers with PromptResponse records in one
//! of three output modes: `text`, `json`, `jsonl`.

pub mod builtin;

use serde::{Deserialize, Serialize};

/// What a template's answer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponseType {
    /// Free text, streamed as text deltas.
    #[default]
    Text,
    /// One JSON value, validated against the template's schema.
    Json,
    /// JSON lines: each line one object, validated and published as it completes.
    Jsonl,
}
