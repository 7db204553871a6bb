//! The provider trait every LLM provider implements, and what a provider call can yield.
//!
//! Providers report usage as running totals ([`Usage`] snapshots): some send them once at the
//! end (OpenAI), some as they go (Anthropic, Gemini). The handler turns snapshots into the
//! deltas the records carry. A provider never logs prompts, answers or keys.

use std::time::Duration;

use async_trait::async_trait;
use futures::{StreamExt, stream::BoxStream};
use sluice_schema::{TextCompletionRequest, ToolCallDelta};

/// Token counts so far in a call (running totals, not deltas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Input (prompt) tokens.
    pub input: u64,
    /// Output (completion) tokens.
    pub output: u64,
}

impl Usage {
    /// Combines two snapshots of one call's running totals. Totals never go down, and a
    /// provider may report one count without the other (Anthropic's `message_delta` carries
    /// output only), so each count is the larger of the two.
    pub fn merge(self, later: Usage) -> Usage {
        Usage {
            input: self.input.max(later.input),
            output: self.output.max(later.output),
        }
    }
}

/// Which provider and model gave an answer, when it was not the one the handler called: a
/// [`crate::fallback::Fallback`] says which of its providers answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnsweredBy {
    /// The provider's name ([`Provider::name`]).
    pub provider: &'static str,
    /// The model that answered.
    pub model: String,
}

/// One piece of a streamed answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// Text delta; may be empty (a usage-only or finish-only chunk).
    pub text: String,
    /// The provider's running totals, when this chunk reports them.
    pub usage: Option<Usage>,
    /// Why generation stopped, on the chunk that says so.
    pub finish_reason: Option<String>,
    /// Who answered, on the first chunk of a stream a fallback moved (`None`: the provider
    /// called, at the request's model).
    pub answered_by: Option<AnsweredBy>,
    /// Pieces of tool calls (see [`ToolCallDelta`]): a call's first piece carries its id and
    /// name, later pieces argument fragments.
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A whole answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Completion {
    /// The text.
    pub text: String,
    /// The totals, when the provider reports them.
    pub usage: Option<Usage>,
    /// Why generation stopped.
    pub finish_reason: Option<String>,
    /// Who answered, as in [`Chunk::answered_by`].
    pub answered_by: Option<AnsweredBy>,
    /// The tool calls the model made, each whole in one piece (index 0, 1, ...).
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A stream of chunks; ends after the last one or with an error.
pub type ChunkStream = BoxStream<'static, Result<Chunk, ProviderError>>;

/// What kind of failure a provider call met; with its HTTP status, decides retrying (see
/// `crate::retry`) and the error record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// Could not connect.
    Connect,
    /// A time limit passed (connect, first token, between chunks).
    Timeout,
    /// 429 rate limit (not a quota).
    RateLimited,
    /// 5xx, 529 overloaded, 408, 409: the provider's trouble, worth another try.
    Server,
    /// 401: the key is wrong or missing.
    Auth,
    /// 403: the key may not do this.
    Permission,
    /// 400, 404, 413, 422: the request itself is wrong.
    BadRequest,
    /// Out of quota or credit: retrying will not help.
    Quota,
    /// The stream ended without its terminator.
    Truncated,
    /// The provider reported an error inside a stream that had started.
    Stream,
    /// The provider sent something this client cannot read.
    Protocol,
}

impl FailureKind {
    /// The label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Connect => "connect",
            FailureKind::Timeout => "timeout",
            FailureKind::RateLimited => "rate_limited",
            FailureKind::Server => "server",
            FailureKind::Auth => "auth",
            FailureKind::Permission => "permission",
            FailureKind::BadRequest => "bad_request",
            FailureKind::Quota => "quota",
            FailureKind::Truncated => "truncated",
            FailureKind::Stream => "stream",
            FailureKind::Protocol => "protocol",
        }
    }
}

/// A failed provider call. `message` is for the operator: it names what to fix and never
/// contains a key or prompt text.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ProviderError {
    /// The kind.
    pub kind: FailureKind,
    /// What happened and what to do.
    pub message: String,
    /// The HTTP status the provider answered with, when the failure came with one (or, for
    /// an error inside a stream, the status its provider documents for the same error).
    pub status: Option<u16>,
    /// The provider's hint of when to retry.
    pub retry_after: Option<Duration>,
    /// The server's own verdict on retrying (`x-should-retry: true|false`), which overrides
    /// what the kind says, as the official OpenAI and Anthropic SDKs let it.
    pub should_retry: Option<bool>,
    /// The request cannot be put in this provider's terms (nothing was sent): the caller's to
    /// fix, so its error record is `invalid-request`, not `llm-error`.
    pub unsendable: bool,
    /// What the failed call spent, when the provider reports it (a whole answer that failed
    /// its check: [`crate::structured`]), so the ledger counts it.
    pub spent: Option<Usage>,
}

impl ProviderError {
    /// An error of `kind`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            status: None,
            retry_after: None,
            should_retry: None,
            unsendable: false,
            spent: None,
        }
    }

    /// A request this provider cannot be sent, for the caller to fix (a [`FailureKind::BadRequest`]
    /// found before sending).
    pub fn unsendable(message: impl Into<String>) -> Self {
        Self {
            unsendable: true,
            ..Self::new(FailureKind::BadRequest, message)
        }
    }

    /// With the HTTP status it came with.
    pub fn with_status(mut self, status: Option<u16>) -> Self {
        self.status = status;
        self
    }

    /// With the server's retry verdict.
    pub fn with_should_retry(mut self, verdict: Option<bool>) -> Self {
        self.should_retry = verdict;
        self
    }

    /// With a retry hint.
    pub fn with_retry_after(mut self, after: Option<Duration>) -> Self {
        self.retry_after = after;
        self
    }
}

/// An LLM provider.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    /// Short provider name for metrics (`openai`, `azure`, ...).
    fn name(&self) -> &'static str;

    /// The configured model.
    fn model(&self) -> &str;

    /// The URL calls for the configured model go to, for the request log (the LLM streaming
    /// contract's (docs/specs.md#the-structured-ndjson-contracts) `endpoint`). The handler logs it
    /// without user-info or query, so a URL that carries a credential never reaches a log.
    fn endpoint(&self) -> &str;

    /// Whether [`Provider::generate_stream`] streams; when false the processor answers every
    /// request with one record.
    fn supports_streaming(&self) -> bool;

    /// Whether the provider maps tools, tool choices, tool calls and tool results onto its
    /// wire format. A request that uses tools ([`TextCompletionRequest::uses_tools`]) is
    /// refused before a provider that does not is called: an answer that silently ignored
    /// the tools would be wrong. Default: no.
    fn supports_tools(&self) -> bool {
        false
    }

    /// Whether the provider itself holds its answer to a request's structured output
    /// (`response_format: "json"`, with or without a `schema`): JSON mode, a JSON Schema
    /// grammar or response schema. For one that does not, the processor asks for JSON in the
    /// system prompt and checks the answer itself, with one corrective call
    /// ([`crate::structured`]). Default: no.
    fn supports_structured_output(&self) -> bool {
        false
    }

    /// Whether the provider holds THIS request's answer to its structured output itself:
    /// [`Provider::supports_structured_output`], unless the request asks for something the
    /// provider's JSON mode cannot go with (Gemini 2 and Cohere refuse a JSON mode together
    /// with tools); the processor checks the answer then.
    fn holds_structured_output(&self, request: &TextCompletionRequest) -> bool {
        let _ = request;
        self.supports_structured_output()
    }

    /// Starts a streamed call. Errors before the stream opens (HTTP status errors) are
    /// returned here; errors after, as stream items.
    async fn generate_stream(
        &self,
        request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError>;

    /// A whole answer. The default collects the stream.
    async fn generate(&self, request: &TextCompletionRequest) -> Result<Completion, ProviderError> {
        collect(self.generate_stream(request).await?).await
    }
}

/// Numbers a stream's tool-call pieces as the records promise (a call's first piece carries
/// its id and name, later pieces only continue it) whatever the server's own numbering:
/// some OpenAI-compatible servers give every parallel call `index: 0`, or repeat the id and
/// name on every piece. A piece whose id differs from the call at its server index starts a
/// new call; a later piece of the same call loses its repeated id and name.
#[derive(Debug, Default)]
pub struct ToolCallNumbering {
    /// Each call's id so far, by our index.
    ids: Vec<Option<String>>,
    /// The server's index -> ours, for the call it is continuing.
    current: std::collections::HashMap<u32, u32>,
}

impl ToolCallNumbering {
    /// `pieces`, renumbered.
    pub fn number(&mut self, pieces: Vec<ToolCallDelta>) -> Vec<ToolCallDelta> {
        pieces
            .into_iter()
            .map(|mut p| {
                let continuing = self.current.get(&p.index).copied().filter(|&ours| {
                    match (&p.id, self.ids.get(ours as usize)) {
                        (None, _) => true,
                        (Some(id), Some(Some(known))) => id == known,
                        // The call's id comes late: it is still that call.
                        (Some(_), Some(None)) => true,
                        (Some(_), None) => false,
                    }
                });
                match continuing {
                    Some(ours) => {
                        p.id = None;
                        p.name = None;
                        p.index = ours;
                    }
                    None => {
                        let ours = u32::try_from(self.ids.len()).unwrap_or(u32::MAX);
                        self.ids.push(p.id.clone());
                        self.current.insert(p.index, ours);
                        p.index = ours;
                    }
                }
                p
            })
            .collect()
    }
}

/// Streamed pieces put together, each call whole in one piece at its index.
pub fn whole_calls(pieces: &[ToolCallDelta]) -> Vec<ToolCallDelta> {
    sluice_schema::tools::assemble(pieces)
        .into_iter()
        .zip(0..)
        .map(|(call, i)| ToolCallDelta::whole(i, call))
        .collect()
}

/// A stream collected into one answer: the default [`Provider::generate`], and what a provider
/// uses for an endpoint that has no non-streaming call of its own.
pub async fn collect(mut stream: ChunkStream) -> Result<Completion, ProviderError> {
    let mut done = Completion::default();
    let mut pieces = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        done.text.push_str(&chunk.text);
        pieces.extend(chunk.tool_calls);
        if let Some(u) = chunk.usage {
            done.usage = Some(done.usage.map_or(u, |d| d.merge(u)));
        }
        if chunk.finish_reason.is_some() {
            done.finish_reason = chunk.finish_reason;
        }
        if chunk.answered_by.is_some() {
            done.answered_by = chunk.answered_by;
        }
    }
    done.tool_calls = whole_calls(&pieces);
    Ok(done)
}
