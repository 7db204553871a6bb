//! sluice-schema: the records sluice's processors exchange, in JSON that TrustGraph 2.x
//! readers and writers accept, plus topic names and message property keys.
//!
//! Pure data: this crate never does I/O and never logs. Every field is written on output
//! (`null` for none) and unknown fields are ignored on input, so old and new readers keep
//! working as records grow.

pub mod config;
mod de;
pub mod decode;
pub mod properties;
pub mod records;
pub mod retry;
pub mod tools;
pub mod topics;
pub mod usage;

pub use decode::{DecodeError, decode, decode_value};
pub use records::{
    AgentMessageType, AgentRequest, AgentResponse, AgentStep, ChatMessage, ChatRole, Error,
    ErrorKind, LIST_MODELS, ModelInfo, PromptRequest, PromptResponse, ResponseRecord,
    TextCompletionRequest, TextCompletionResponse,
};
pub use retry::{RetryOn, RetryPolicy, RetrySpecError, ValueProblem};
pub use tools::{Tool, ToolCall, ToolCallDelta, ToolChoice, ToolMode};
pub use topics::{Persistence, TopicError, TopicMapping, TopicName};
pub use usage::UsageRecord;

/// Adds two token counts as records carry them: `None` means "not reported", so the sum is
/// `None` only when neither reported anything. Records carry deltas; callers that add them
/// up (the gateway's `done` usage, the prompt and agent processors) all count the same way.
pub fn add_tokens(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    }
}

/// Token deltas and the model received from a service and not yet passed on. A processor that
/// calls another (prompt, agent) adds each record it receives and hands the counts on with
/// its next published record, so the deltas it publishes still add up to the totals.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingUsage {
    /// Input tokens not yet passed on.
    pub in_token: Option<u64>,
    /// Output tokens not yet passed on.
    pub out_token: Option<u64>,
    /// The last model named.
    pub model: Option<String>,
}

impl PendingUsage {
    /// Adds a text-completion record's counts and model.
    pub fn add(&mut self, r: &TextCompletionResponse) {
        self.in_token = add_tokens(self.in_token, r.in_token);
        self.out_token = add_tokens(self.out_token, r.out_token);
        if r.model.is_some() {
            self.model.clone_from(&r.model);
        }
    }

    /// The pending input and output counts, which are then no longer pending.
    pub fn take(&mut self) -> (Option<u64>, Option<u64>) {
        (self.in_token.take(), self.out_token.take())
    }
}
