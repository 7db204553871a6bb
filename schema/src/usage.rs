//! The usage ledger's record: one per attempt at a text-completion request, written by the
//! processor that called the provider (docs/text-completion.md#usage-ledger).

use serde::{Deserialize, Serialize};

/// What one attempt at a text-completion request cost: the tokens the provider reported (or
/// counted, when it stopped before reporting), the outcome, and the price.
///
/// A request normally has one attempt. One that was handed back to the broker (its
/// processor shut down, or its records could not be stored) or redelivered after its
/// processor died is attempted again, and every attempt that called the provider was billed
/// by it: the request's total is the sum of its records. Readers tell a record stored twice
/// apart by `attempt`, which no two attempts share.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    /// The request's correlation id (its `id` property). The message key is
    /// `<id>/<attempt>`.
    pub id: String,
    /// The attempt's id (`sluice-attempt` on its response records).
    pub attempt: String,
    /// The API key's name the gateway admitted the request under; `null` for a request that
    /// came onto the bus without one.
    #[serde(default)]
    pub key: Option<String>,
    /// The W3C trace id of the attempt (its processor span's), to find it among traces and
    /// in the provider's logs (the provider call carries it in its `traceparent` header).
    #[serde(default)]
    pub trace_id: Option<String>,
    /// The TrustGraph flow (`workspace/flow`) the processor served the request for.
    #[serde(default)]
    pub flow: Option<String>,
    /// The processor (`text-completion`).
    pub service: String,
    /// The model that answered, or was asked.
    #[serde(default)]
    pub model: Option<String>,
    /// The provider (`openai`, `anthropic`, ...).
    #[serde(default)]
    pub provider: Option<String>,
    /// Whether the answer was streamed.
    #[serde(default)]
    pub streaming: bool,
    /// Input tokens, cache reads and writes included.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// True when the provider stopped (or was stopped) before reporting its usage and
    /// `output_tokens` counts the text chunks received instead (one token each, as
    /// OpenAI-style streams send them); `input_tokens` is then what was reported, often 0.
    #[serde(default)]
    pub estimated: bool,
    /// `answered`, `error`, `cancelled` (by the caller) or `retried` (handed back to the
    /// broker for another attempt).
    pub outcome: String,
    /// The error's kind (`llm-error`, `too-many-requests`, ...), on `outcome = error`.
    #[serde(default)]
    pub error: Option<String>,
    /// How long the attempt took, in milliseconds.
    pub duration_ms: u64,
    /// When the attempt ended, in milliseconds since the Unix epoch.
    pub ended_at_ms: u64,
    /// Deliveries of the request before this one that this processor saw.
    #[serde(default)]
    pub redelivery_count: u32,
    /// The price of the tokens from the processor's price table, in the table's currency;
    /// `null` when the table has no price for the model.
    #[serde(default)]
    pub cost: Option<f64>,
}
