//! sluice-schema: the records sluice's processors exchange, in JSON that TrustGraph 2.x
//! readers and writers accept, plus topic names and message property keys.
//!
//! Pure data: this crate never does I/O and never logs. Every field is written on output
//! (`null` for none) and unknown fields are ignored on input, so old and new readers keep
//! working as records grow.

mod de;
pub mod properties;
pub mod records;
pub mod topics;

pub use records::{
    AgentMessageType, AgentRequest, AgentResponse, AgentStep, Error, ErrorKind, PromptRequest,
    PromptResponse, ResponseRecord, TextCompletionRequest, TextCompletionResponse,
};
pub use topics::{Persistence, TopicError, TopicMapping, TopicName};

/// Adds two token counts as records carry them: `None` means "not reported", so the sum is
/// `None` only when neither reported anything. Records carry deltas; callers that add them
/// up (the gateway's `done` usage, the prompt and agent processors) all count the same way.
pub fn add_tokens(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    }
}
