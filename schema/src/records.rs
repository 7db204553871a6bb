//! The request and response records, JSON-compatible with TrustGraph 2.x
//! (docs/protocol.md#records).
//!
//! Rules every record here follows:
//! - every field is written on output, `null` where there is no value;
//! - unknown fields are ignored on input (serde's default), and `null` reads as the
//!   field's default, because TrustGraph writers emit `null` freely;
//! - anything sluice adds is optional, so old readers can ignore it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::de::null_default;

mod agent;
mod error;

pub use self::agent::{AgentMessageType, AgentRequest, AgentResponse, AgentStep, PlanStep};
pub use self::error::{Error, ErrorKind};

/// A response record: it knows whether it ends its request's stream, and every response
/// type can carry an error as its terminal record.
///
/// The runtime relies on this to ack a request only after its terminal record is published
/// and to answer a request it cannot handle with an error of the right type.
pub trait ResponseRecord: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// True for the last record of a request (`end_of_stream`, or `end_of_dialog` for the agent).
    fn is_terminal(&self) -> bool;
    /// The terminal error record of this type.
    fn from_error(error: Error) -> Self;
    /// The error this record carries, if any.
    fn error(&self) -> Option<&Error>;

    /// The token counts this record carries (input, output): deltas, summed over a stream.
    /// Default: none.
    fn tokens(&self) -> (Option<u64>, Option<u64>) {
        (None, None)
    }

    /// Whether later records of the stream may be merged into this one (see
    /// [`ResponseRecord::coalesce`]): a non-terminal piece of streamed text whose meaning is
    /// "append me". A processor that paces its records holds back only such records. Default:
    /// none is.
    fn is_delta(&self) -> bool {
        false
    }

    /// Merges `next`, the record that follows this delta in the same stream, into this one,
    /// when one record says exactly what the two said: the text concatenated, the token
    /// deltas summed, nothing else different. `next` may be the stream's terminal record when
    /// it ends without an error: the merge is then terminal (the delta's text rides on the
    /// last record, as a whole answer's does). Gives `next` back when they cannot be merged.
    /// Default: never.
    fn coalesce(&mut self, next: Self) -> Result<(), Self> {
        Err(next)
    }
}

/// The most text one coalesced record carries: a paced stream's held delta is published
/// rather than grown past this (a record stays far below any broker's message limit).
pub const COALESCE_MAX_BYTES: usize = 16 * 1024;

/// The sum of two token deltas, `None` only when neither says anything.
fn add_tokens(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    }
}

/// The `operation` of a [`TextCompletionRequest`] that asks for the models a processor serves
/// (TrustGraph 2.11): answered by one terminal record carrying `models`.
pub const LIST_MODELS: &str = "list-models";

/// A request to complete text (TrustGraph's `TextCompletionRequest`; docs/protocol.md#records).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextCompletionRequest {
    /// TrustGraph 2.11's operation: `completion` (also when absent or `null`) or
    /// [`LIST_MODELS`].
    #[serde(default)]
    pub operation: Option<String>,
    /// The system prompt.
    #[serde(default, deserialize_with = "null_default")]
    pub system: String,
    /// The user prompt.
    #[serde(default, deserialize_with = "null_default")]
    pub prompt: String,
    /// Stream the answer as many records (`false` on absent, for older callers).
    #[serde(default, deserialize_with = "null_default")]
    pub streaming: bool,
    /// `"json"` asks the provider for JSON output where it supports that.
    #[serde(default)]
    pub response_format: Option<String>,
    /// A JSON Schema the output should follow, where the provider supports that.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,

    // sluice's extension (optional; TrustGraph's processors ignore fields they do not know,
    // so a request that sets them still gets a sensible answer from one of theirs). Written
    // only when set, so a plain TrustGraph request stays byte-for-byte what it was.
    /// A conversation, oldest turn first, for multi-turn calls. When set, providers send these
    /// turns (after `system`) instead of `prompt`; a writer also puts the same conversation,
    /// flattened into text, in `prompt`, for processors that do not read this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<ChatMessage>>,
    /// Sampling temperature for this call (0 to 2), overriding the processor's setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// The most output tokens for this call, overriding the processor's setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Sequences that end the answer where they would appear (not included in it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
    /// The model to use, one of those the processor serves (`list-models`); absent means the
    /// processor's own model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// How the processor retries this call, as a [`crate::RetryPolicy`] line (`seed-002`,
    /// `attempts=2,delay=2s`) applied over the processor's own policy. A line the processor
    /// cannot read is an `invalid-request` error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<String>,
    /// Tools the model may call (docs/protocol.md#tools). A processor whose provider cannot
    /// call tools refuses the request (`invalid-request`) rather than answer without them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<crate::tools::Tool>>,
    /// Whether and which of `tools` the model may call (default: the model decides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<crate::tools::ToolChoice>,
    /// Whether the model may make several tool calls in one answer (default: the provider's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Hold the answer to `schema` exactly (OpenAI's `json_schema.strict`), where the provider
    /// has such a mode; the processor's own check of a provider without one is exact anyway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_strict: Option<bool>,
    /// The caller checks the answer against `schema` itself (the prompt service's templates):
    /// use the provider's JSON mode where it has one, but a provider without one is not held
    /// to the schema by the processor (no buffering, no corrective call).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub caller_checks: bool,
}

/// Who said a turn of a [`TextCompletionRequest::messages`] conversation. The system prompt is
/// not a turn: it is the request's `system`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    /// The caller.
    User,
    /// The model, in an earlier answer.
    Assistant,
    /// A tool's result, answering one of the model's tool calls (`tool_call_id`).
    Tool,
}

impl ChatRole {
    /// The role's wire name (`user`, `assistant`, `tool`).
    pub fn as_str(self) -> &'static str {
        match self {
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
            ChatRole::Tool => "tool",
        }
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who said it.
    pub role: ChatRole,
    /// What was said (a tool's result, for a `tool` turn).
    #[serde(default, deserialize_with = "null_default")]
    pub content: String,
    /// The tool calls the model made in this (assistant) turn.
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tool_calls: Vec<crate::tools::ToolCall>,
    /// The call a `tool` turn answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A plain turn: `role` said `content`.
    pub fn new(role: ChatRole, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

impl TextCompletionRequest {
    /// The conversation a provider sends after the system prompt: `messages` when set, else
    /// one user turn holding `prompt`.
    pub fn turns(&self) -> Vec<ChatMessage> {
        match &self.messages {
            Some(m) => m.clone(),
            None => vec![ChatMessage::new(ChatRole::User, self.prompt.clone())],
        }
    }

    /// Whether the request needs a provider that can call tools: it offers tools, chooses
    /// among them, or its conversation holds tool calls or their results.
    pub fn uses_tools(&self) -> bool {
        self.tools.as_ref().is_some_and(|t| !t.is_empty())
            || self.tool_choice.is_some()
            || self.messages.as_ref().is_some_and(|m| {
                m.iter()
                    .any(|t| t.role == ChatRole::Tool || !t.tool_calls.is_empty())
            })
    }

    /// The text of a conversation for a reader that knows only `prompt`: each turn after its
    /// speaker's name, ending with `Assistant:` so the model answers as the next turn.
    pub fn flatten(messages: &[ChatMessage]) -> String {
        let mut out = String::new();
        for m in messages {
            let who = match m.role {
                ChatRole::User => "User",
                ChatRole::Assistant => "Assistant",
                ChatRole::Tool => "Tool result",
            };
            out.push_str(who);
            out.push_str(": ");
            out.push_str(&m.content);
            for call in &m.tool_calls {
                out.push_str(&format!("\n[calls {}({})]", call.name, call.arguments));
            }
            out.push_str("\n\n");
        }
        out.push_str("Assistant:");
        out
    }
}

/// One record of a text completion answer (TrustGraph's `TextCompletionResponse`;
/// docs/protocol.md#records).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextCompletionResponse {
    /// Set on the terminal error record; nothing follows it.
    #[serde(default)]
    pub error: Option<Error>,
    /// The text of this record: a delta when streaming, the whole answer otherwise.
    #[serde(default, deserialize_with = "null_default")]
    pub response: String,
    /// Input tokens, as a delta: the sum over a stream is the request's total.
    #[serde(default)]
    pub in_token: Option<u64>,
    /// Output tokens, as a delta: the sum over a stream is the request's total.
    #[serde(default)]
    pub out_token: Option<u64>,
    /// The model that produced the text.
    #[serde(default)]
    pub model: Option<String>,
    /// True on the last record of the request.
    #[serde(default, deserialize_with = "null_default")]
    pub end_of_stream: bool,
    /// The answer to a `list-models` request: the models the processor serves. Written only
    /// when there are some (as TrustGraph's gateway does), so token records stay as they were;
    /// readers take a missing field as empty.
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub models: Vec<ModelInfo>,
    /// Why the answer ended, on the terminal record of a completed answer: `stop` (the model
    /// finished, or a stop sequence), `length` (the token limit), `content_filter`, or the
    /// provider's own word for anything else. sluice's extension; written only when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// The provider that produced the text (`openai`, `anthropic`, ...), written only by a
    /// processor given fallback providers: with `model`, it says which of them answered.
    /// sluice's extension; readers take a missing field as unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Pieces of the tool calls the model is making (docs/protocol.md#tools): streamed, as
    /// they come; in a whole answer, each call whole. The answer then ends with
    /// `finish_reason: tool_calls`. sluice's extension; written only when there are some.
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tool_calls: Vec<crate::tools::ToolCallDelta>,
}

impl TextCompletionResponse {
    /// The bytes of text this record carries (its answer and its tool calls' pieces), for
    /// the coalescing bound.
    fn len(&self) -> usize {
        self.response.len()
            + self
                .tool_calls
                .iter()
                .map(|t| {
                    t.arguments.len()
                        + t.id.as_ref().map_or(0, String::len)
                        + t.name.as_ref().map_or(0, String::len)
                })
                .sum::<usize>()
    }
}

/// One model a text-completion processor serves (TrustGraph 2.11 `ModelInfo`). Fields other
/// than `id` are written only when known, as TrustGraph's gateway writes them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The model's id, as requests name it.
    #[serde(default, deserialize_with = "null_default")]
    pub id: String,
    /// A display name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Who provides the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owned_by: Option<String>,
    /// The context window, in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u64>,
    /// The most output tokens per answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_length: Option<u64>,
    /// The model family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family: Option<String>,
}

impl ResponseRecord for TextCompletionResponse {
    fn is_terminal(&self) -> bool {
        self.end_of_stream
    }

    fn tokens(&self) -> (Option<u64>, Option<u64>) {
        (self.in_token, self.out_token)
    }

    fn from_error(error: Error) -> Self {
        Self {
            error: Some(error),
            end_of_stream: true,
            ..Self::default()
        }
    }

    fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }

    fn is_delta(&self) -> bool {
        !self.end_of_stream
            && self.error.is_none()
            && self.models.is_empty()
            && self.finish_reason.is_none()
    }

    fn coalesce(&mut self, next: Self) -> Result<(), Self> {
        let clean_end = next.end_of_stream && next.error.is_none() && next.models.is_empty();
        if !self.is_delta()
            || !(next.is_delta() || clean_end)
            || self.model != next.model
            // Text after a tool call would read as coming before it.
            || (!self.tool_calls.is_empty() && !next.response.is_empty())
            || self.len() + next.len() > COALESCE_MAX_BYTES
        {
            return Err(next);
        }
        self.response.push_str(&next.response);
        crate::tools::append_deltas(&mut self.tool_calls, next.tool_calls);
        self.in_token = add_tokens(self.in_token, next.in_token);
        self.out_token = add_tokens(self.out_token, next.out_token);
        self.end_of_stream = next.end_of_stream;
        self.finish_reason = next.finish_reason;
        Ok(())
    }
}

/// A request to render a prompt template and complete it (TrustGraph's `PromptRequest`;
/// docs/protocol.md#records).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "PromptRequestIn")]
pub struct PromptRequest {
    /// The template id.
    pub id: String,
    /// The template's variables; each value is itself JSON-encoded, as TrustGraph sends it
    /// (a plain JSON value is accepted too, and encoded on reading).
    pub terms: BTreeMap<String, String>,
    /// Stream the answer as many records.
    pub streaming: bool,
}

/// A [`PromptRequest`] as read: `terms`, or TrustGraph's gateway's `variables` (what its
/// client, `tg-invoke-prompt`, sends), whose plain values are JSON-encoded into the terms as
/// TrustGraph's gateway does (`trustgraph/messaging/translators/prompt.py`); a term of both
/// names takes the variable's.
#[derive(Deserialize)]
struct PromptRequestIn {
    #[serde(default, deserialize_with = "null_default")]
    id: String,
    #[serde(default, deserialize_with = "crate::de::terms")]
    terms: BTreeMap<String, String>,
    #[serde(default)]
    variables: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default, deserialize_with = "null_default")]
    streaming: bool,
}

impl From<PromptRequestIn> for PromptRequest {
    fn from(r: PromptRequestIn) -> Self {
        let mut terms = r.terms;
        for (k, v) in r.variables.unwrap_or_default() {
            terms.insert(k, v.to_string());
        }
        Self {
            id: r.id,
            terms,
            streaming: r.streaming,
        }
    }
}

/// One record of a prompt answer (TrustGraph's `PromptResponse`; docs/protocol.md#records).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptResponse {
    /// Set on the terminal error record; nothing follows it.
    #[serde(default)]
    pub error: Option<Error>,
    /// Text output (a delta when streaming), for `text` templates.
    #[serde(default)]
    pub text: Option<String>,
    /// JSON-encoded object output, for `json` and `jsonl` templates.
    #[serde(default)]
    pub object: Option<String>,
    /// True on the last record of the request.
    #[serde(default, deserialize_with = "null_default")]
    pub end_of_stream: bool,
    /// Input tokens, as a delta.
    #[serde(default)]
    pub in_token: Option<u64>,
    /// Output tokens, as a delta.
    #[serde(default)]
    pub out_token: Option<u64>,
    /// The model that produced the output.
    #[serde(default)]
    pub model: Option<String>,
    /// `jsonl` templates, on the terminal record: objects published (sluice's addition).
    #[serde(default)]
    pub objects_emitted: Option<u64>,
    /// `jsonl` templates, on the terminal record: lines skipped as malformed or invalid
    /// (sluice's addition).
    #[serde(default)]
    pub lines_skipped: Option<u64>,
    /// `jsonl` templates whose contract names the request's items (the built-ins), on the
    /// terminal record: how many distinct items the request named (sluice's addition, written
    /// only when set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items_expected: Option<u64>,
    /// As `items_expected`: how many of them the answer's objects cover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items_answered: Option<u64>,
    /// As `items_expected`, where every item expects an object (rewording, the NDJSON parser
    /// contract's (docs/specs.md#the-structured-ndjson-contracts) classification): the ids of the
    /// items without one, for the caller to retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items_pending: Option<Vec<String>>,
}

impl ResponseRecord for PromptResponse {
    fn is_terminal(&self) -> bool {
        self.end_of_stream
    }

    fn tokens(&self) -> (Option<u64>, Option<u64>) {
        (self.in_token, self.out_token)
    }

    fn from_error(error: Error) -> Self {
        Self {
            error: Some(error),
            end_of_stream: true,
            ..Self::default()
        }
    }

    fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }

    /// A piece of a `text` template's streamed answer; `json`/`jsonl` objects are each their
    /// own record and are never merged.
    fn is_delta(&self) -> bool {
        !self.end_of_stream
            && self.error.is_none()
            && self.text.is_some()
            && self.object.is_none()
            && self.objects_emitted.is_none()
            && self.lines_skipped.is_none()
    }

    fn coalesce(&mut self, next: Self) -> Result<(), Self> {
        let fits = |a: &Self, b: &Self| {
            a.text.as_ref().map_or(0, String::len) + b.text.as_ref().map_or(0, String::len)
                <= COALESCE_MAX_BYTES
        };
        let clean_end = next.end_of_stream && next.error.is_none() && next.object.is_none();
        if !self.is_delta()
            || !(next.is_delta() || clean_end)
            || self.model != next.model
            || !fits(self, &next)
        {
            return Err(next);
        }
        if let (Some(text), Some(more)) = (self.text.as_mut(), next.text.as_deref()) {
            text.push_str(more);
        }
        self.in_token = add_tokens(self.in_token, next.in_token);
        self.out_token = add_tokens(self.out_token, next.out_token);
        self.end_of_stream = next.end_of_stream;
        self.objects_emitted = next.objects_emitted;
        self.lines_skipped = next.lines_skipped;
        self.items_expected = next.items_expected;
        self.items_answered = next.items_answered;
        self.items_pending = next.items_pending;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
