//! sluice-prompt: the prompt processor. It renders a named template with the request's
//! terms, calls text-completion over the bus, and answers with PromptResponse records in one
//! of three output modes: `text`, `json`, `jsonl` (see [`handler`]).
//!
//! - [`templates`]: loading (sluice's file shape and TrustGraph's `template.<id>` shape),
//!   strict rendering;
//! - [`store`]: the live set, reloaded on SIGHUP or file change;
//! - [`output`]: the incremental JSON-lines parser and JSON extraction;
//! - [`builtin`]: the built-in templates (data files under `services/prompt/builtin/`) with
//!   their schemas (docs/protocol.md#structured-output-contracts);
//! - [`normalise`]: the normalisers a template names, which correct its output objects before
//!   validation;
//! - [`requestlog`]: the LLM streaming contract's (docs/specs.md#the-structured-ndjson-contracts)
//!   request log, content only when the operator opts in;
//! - [`flows`]: the flows TrustGraph's config service assigns, templates from its config.

pub mod builtin;
pub mod coverage;
pub mod flows;
pub mod handler;
pub mod metrics;
pub mod normalise;
pub mod output;
pub mod requestlog;
pub mod store;
pub mod templates;

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
