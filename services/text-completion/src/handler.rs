//! The text-completion processor's handler: a [`TextCompletionRequest`] in, records out.
//!
//! - A streaming request to a streaming provider gets one record per text chunk, then a
//!   terminal record (`end_of_stream=true`). Otherwise it gets exactly one record.
//! - Token counts are deltas: the provider's running totals are differenced, usage-only
//!   chunks publish nothing, and what is pending rides on the next record or the terminal
//!   one. The sum over a stream equals the provider's totals.
//! - Retries (with the policy's backoff and the server's hints) happen only before the first
//!   record is published. After that a failure is a terminal error carrying the usage so far.
//! - Logs use the event names of docs/protocol.md#structured-output-contracts
//!   (`llm_request_started`, `llm_response_chunk` at debug,
//!   `llm_request_completed`, `llm_request_failed`, `llm_request_retry`) with the request id,
//!   and `llm_request_unpublished` when the provider answered but the broker did not store
//!   the records (a broker outage, not a provider failure: the request goes back to the
//!   broker). They never contain prompt text or keys.

use std::{borrow::Cow, sync::Arc};

use async_trait::async_trait;
use futures::StreamExt;
use sluice_runtime::{
    ledger::UsageMeter,
    processor::{Handler, RequestContext, ResponseSink, SinkError},
    trace,
};
use sluice_schema::{Error, ErrorKind, TextCompletionRequest, TextCompletionResponse};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::{
    metrics::{CallOutcome, LlmMetrics},
    provider::{AnsweredBy, FailureKind, Provider, ProviderError, Usage},
    retry::{self, RetryPolicy},
};

/// Why a streamed call stopped early: the provider failed, or publishing its records did.
enum Stop {
    Provider(ProviderError),
    Unpublished(SinkError),
}

impl From<ProviderError> for Stop {
    fn from(e: ProviderError) -> Self {
        Self::Provider(e)
    }
}

/// Turns a provider's running totals into deltas.
/// Each delta also goes to the attempt's usage meter (the usage ledger's count).
#[derive(Debug)]
struct UsageDeltas {
    reported: bool,
    last: Usage,
    pending: Usage,
    meter: UsageMeter,
}

impl UsageDeltas {
    /// A provider call starts: counts start again, and the meter counts a new call.
    fn call(meter: &UsageMeter) -> Self {
        meter.call();
        Self {
            reported: false,
            last: Usage::default(),
            pending: Usage::default(),
            meter: meter.clone(),
        }
    }

    fn observe(&mut self, snapshot: Usage) {
        self.reported = true;
        // A repeated snapshot adds nothing.
        let merged = self.last.merge(snapshot);
        let (input, output) = (
            merged.input - self.last.input,
            merged.output - self.last.output,
        );
        self.pending.input += input;
        self.pending.output += output;
        self.meter.usage(input, output);
        self.last = merged;
    }

    /// The pending deltas, as record fields; `None` until the provider reported usage.
    fn take(&mut self) -> (Option<u64>, Option<u64>) {
        if !self.reported {
            return (None, None);
        }
        let p = std::mem::take(&mut self.pending);
        (Some(p.input), Some(p.output))
    }
}

/// The text-completion handler over one provider.
pub struct TextCompletionService {
    provider: Arc<dyn Provider>,
    retry: RetryPolicy,
    metrics: LlmMetrics,
    /// The models a request may name: the provider's own first, then any others allowed.
    served: Vec<String>,
    /// A TrustGraph flow's `model` parameter: the model of requests that name none.
    flow_model: Option<String>,
    /// A TrustGraph flow's `temperature` parameter: for requests that set none.
    flow_temperature: Option<f64>,
    /// The provider's URL as logged: without user-info or query.
    endpoint: Arc<str>,
}

impl TextCompletionService {
    /// A service calling `provider`.
    pub fn new(provider: Arc<dyn Provider>, retry: RetryPolicy, metrics: LlmMetrics) -> Self {
        // Structured output the provider cannot hold itself is checked here.
        let provider = crate::structured::enforcing(provider);
        metrics.provider_configured(provider.name(), provider.model());
        let served = vec![provider.model().to_owned()];
        let endpoint = shown_endpoint(provider.endpoint()).into();
        Self {
            provider,
            retry,
            metrics,
            served,
            flow_model: None,
            flow_temperature: None,
            endpoint,
        }
    }

    /// The same service for one TrustGraph flow (see `sluice_runtime::flows`), as
    /// TrustGraph's own processors use a flow's parameters: a request that names no model is
    /// answered by `model`, one that sets no temperature uses `temperature`. The flow's model
    /// is served (and listed first by `list-models`) besides the others.
    pub fn for_flow(&self, model: Option<String>, temperature: Option<f64>) -> Self {
        let model = model.filter(|m| !m.is_empty());
        let mut served = Vec::new();
        if let Some(m) = &model {
            self.metrics.provider_configured(self.provider.name(), m);
            served.push(m.clone());
        }
        served.extend(
            self.served
                .iter()
                .filter(|s| model.as_ref() != Some(*s))
                .cloned(),
        );
        Self {
            provider: self.provider.clone(),
            retry: self.retry.clone(),
            metrics: self.metrics.clone(),
            served,
            flow_model: model,
            flow_temperature: temperature,
            endpoint: self.endpoint.clone(),
        }
    }

    /// Also serves `models` (the same provider, another model): a request may name one in its
    /// `model` field, and `list-models` lists them after the configured model.
    pub fn with_models(mut self, models: impl IntoIterator<Item = String>) -> Self {
        for m in models {
            if !m.is_empty() && !self.served.contains(&m) {
                self.metrics.provider_configured(self.provider.name(), &m);
                self.served.push(m);
            }
        }
        self
    }

    /// The models this service answers for, its configured model first.
    pub fn models(&self) -> &[String] {
        &self.served
    }

    /// Provider and model labels of a (checked) request: the model it names, else the
    /// provider's own.
    fn labels<'a>(&'a self, request: &'a TextCompletionRequest) -> [&'a str; 2] {
        [
            self.provider.name(),
            crate::providers::model_for(request, self.provider.model()),
        ]
    }

    /// Refuses a completion request whose sluice extension fields cannot be honoured,
    /// naming the field and what it takes (never echoing a prompt).
    fn check(&self, request: &TextCompletionRequest) -> Result<(), Error> {
        let invalid = |m: String| Err(Error::new(ErrorKind::InvalidRequest, m));
        if let Some(m) = request.model.as_deref().filter(|m| !m.is_empty())
            && !self.served.iter().any(|s| s == m)
        {
            let shown: String = m.chars().take(100).collect();
            return invalid(format!(
                "invalid request: field `model`: {shown:?} is not served here; this processor serves {}",
                self.served.join(", ")
            ));
        }
        if let Some(t) = request.temperature
            && !(t.is_finite() && (0.0..=2.0).contains(&t))
        {
            return invalid(
                "invalid request: field `temperature`: expected a number from 0 to 2".into(),
            );
        }
        if request.max_tokens == Some(0) {
            return invalid(
                "invalid request: field `max_tokens`: expected a whole number of at least 1".into(),
            );
        }
        if request.messages.as_ref().is_some_and(Vec::is_empty) {
            return invalid("invalid request: field `messages`: expected at least one turn".into());
        }
        if let Some(stop) = &request.stop
            && (stop.len() > 16 || stop.iter().any(String::is_empty))
        {
            return invalid(
                "invalid request: field `stop`: expected at most 16 non-empty strings".into(),
            );
        }
        if request.uses_tools() && !self.provider.supports_tools() {
            return invalid(format!(
                "invalid request: field `tools`: this processor's provider ({}, or one of its \
                 fallback list) does not call tools; send the request to a processor whose \
                 providers do (every built-in provider does)",
                self.provider.name()
            ));
        }
        if request.messages.iter().flatten().any(|t| {
            t.role == sluice_schema::ChatRole::Tool
                && t.tool_call_id.as_deref().is_none_or(str::is_empty)
        }) {
            return invalid(
                "invalid request: field `messages`: a `tool` turn needs the `tool_call_id` of \
                 the call it answers"
                    .to_owned(),
            );
        }
        if matches!(
            request.tool_choice,
            Some(sluice_schema::ToolChoice::Mode(
                sluice_schema::ToolMode::Required
            ))
        ) && request.tools.as_ref().is_none_or(Vec::is_empty)
        {
            return invalid(
                "invalid request: field `tool_choice`: `required` needs `tools`".to_owned(),
            );
        }
        if let Some(tools) = &request.tools {
            if let Some(t) = tools
                .iter()
                .find(|t| !sluice_schema::tools::valid_name(&t.name))
            {
                let shown: String = t.name.chars().take(70).collect();
                return invalid(format!(
                    "invalid request: field `tools`: the name {shown:?} is not 1 to 64 of \
                     a-z, A-Z, 0-9, _ and -"
                ));
            }
        }
        if let Some(sluice_schema::ToolChoice::Named { name }) = &request.tool_choice
            && !request.tools.iter().flatten().any(|t| &t.name == name)
        {
            let shown: String = name.chars().take(70).collect();
            return invalid(format!(
                "invalid request: field `tool_choice`: no tool is named {shown:?}"
            ));
        }
        Ok(())
    }

    fn error_record(
        &self,
        answer: &Answer<'_>,
        e: &ProviderError,
        usage: &mut UsageDeltas,
    ) -> TextCompletionResponse {
        let kind = match e.kind {
            FailureKind::RateLimited => ErrorKind::TooManyRequests,
            _ if e.unsendable => ErrorKind::InvalidRequest,
            _ => ErrorKind::Llm,
        };
        let (in_token, out_token) = usage.take();
        TextCompletionResponse {
            error: Some(Error::new(kind, e.message.clone())),
            in_token,
            out_token,
            model: Some(answer.model().to_owned()),
            provider: answer.provider_field(),
            end_of_stream: true,
            ..Default::default()
        }
    }

    /// The retry policy of `request`: its `retry` line applied over the processor's policy,
    /// else the processor's.
    fn policy(&self, request: &TextCompletionRequest) -> Result<Cow<'_, RetryPolicy>, Error> {
        match request.retry.as_deref() {
            None => Ok(Cow::Borrowed(&self.retry)),
            Some(line) => self.retry.with(line).map(Cow::Owned).map_err(|e| {
                let shown: String = e.to_string().chars().take(300).collect();
                Error::new(
                    ErrorKind::InvalidRequest,
                    format!("invalid request: field `retry`: {shown}"),
                )
            }),
        }
    }

    /// Waits before the next attempt if the policy allows one; counts it.
    async fn backoff(
        &self,
        request: &TextCompletionRequest,
        ctx: &RequestContext,
        policy: &RetryPolicy,
        retry: u32,
        e: &ProviderError,
    ) -> bool {
        let Some(delay) = retry::delay(policy, retry, e) else {
            return false;
        };
        let [provider, model] = self.labels(request);
        self.metrics
            .retries
            .with_label_values(&[provider, model, e.kind.as_str()])
            .inc();
        warn!(event = "llm_request_retry", request_id = %ctx.origin, call_id = %ctx.id, provider, model,
              error_type = e.kind.as_str(), status = e.status, attempt = retry + 2,
              attempts = policy.attempts, delay_ms = delay.as_millis() as u64, "retrying");
        // A client cancel or the end of the drain grace drops this future (see
        // sluice_runtime::processor), so the wait needs no cancellation of its own.
        tokio::time::sleep(delay).await;
        true
    }

    fn finish(
        &self,
        answer: &Answer<'_>,
        started: Instant,
        outcome: CallOutcome,
        usage: &UsageDeltas,
    ) {
        let [provider, model] = answer.labels();
        self.metrics
            .requests
            .with_label_values(&[provider, model, outcome.as_str()])
            .inc();
        self.metrics
            .duration
            .with_label_values(&[provider, model])
            .observe(started.elapsed().as_secs_f64());
        self.metrics
            .tokens
            .with_label_values(&[provider, model, "input"])
            .inc_by(usage.last.input);
        self.metrics
            .tokens
            .with_label_values(&[provider, model, "output"])
            .inc_by(usage.last.output);
    }

    /// What sending a call's terminal record came to: `Ok(true)` published; `Ok(false)`
    /// refused for its size, the sink's error record ending the stream in its place (counted
    /// as an error); `Err` the broker did not store it (see [`Self::unpublished`]).
    fn terminal_sent(
        &self,
        sent: Result<(), SinkError>,
        answer: &Answer<'_>,
        ctx: &RequestContext,
        started: Instant,
        usage: &UsageDeltas,
    ) -> Result<bool, SinkError> {
        match sent {
            Ok(()) => Ok(true),
            Err(SinkError::Ended) => {
                self.finish(answer, started, CallOutcome::Error, usage);
                Ok(false)
            }
            Err(e) => Err(self.unpublished(answer, ctx, started, usage, e)),
        }
    }

    /// The provider answered but the broker did not store the answer's records: not a
    /// provider failure (counted as `outcome="unpublished"`, logged as
    /// `llm_request_unpublished`). The error goes back to the runtime, which hands the
    /// request back to the broker and waits until the broker stores again.
    fn unpublished(
        &self,
        answer: &Answer<'_>,
        ctx: &RequestContext,
        started: Instant,
        usage: &UsageDeltas,
        e: SinkError,
    ) -> SinkError {
        let [provider, model] = answer.labels();
        warn!(event = "llm_request_unpublished", request_id = %ctx.origin, call_id = %ctx.id, provider, model,
              error = %e, "the answer's records could not be published");
        self.finish(answer, started, CallOutcome::Unpublished, usage);
        e
    }

    fn note_failure(&self, request: &TextCompletionRequest, e: &ProviderError) {
        if e.kind == FailureKind::RateLimited {
            let [provider, model] = self.labels(request);
            self.metrics
                .rate_limited
                .with_label_values(&[provider, model])
                .inc();
        }
    }

    async fn stream(
        &self,
        request: &TextCompletionRequest,
        ctx: &RequestContext,
        policy: &RetryPolicy,
        sink: &mut ResponseSink<TextCompletionResponse>,
        started: Instant,
    ) -> Result<(), SinkError> {
        let mut answer = Answer::new(self.labels(request));
        let mut retry = 0;
        loop {
            answer.by = None;
            let mut usage = UsageDeltas::call(&ctx.usage);
            let mut published = 0u64;
            let mut finish_reason = None;
            let mut called_tools = false;
            let outcome: Result<(), Stop> = async {
                let mut chunks = self.provider.generate_stream(request).await?;
                loop {
                    let Some(chunk) = chunks.next().await else { return Ok(()) };
                    let chunk = chunk?;
                    answer.observe(chunk.answered_by, &ctx.usage);
                    if let Some(u) = chunk.usage {
                        usage.observe(u);
                    }
                    if let Some(r) = &chunk.finish_reason {
                        finish_reason = Some(finish_reason_word(r));
                    }
                    if chunk.text.is_empty() && chunk.tool_calls.is_empty() {
                        continue;
                    }
                    called_tools |= !chunk.tool_calls.is_empty();
                    ctx.usage.chunk();
                    if published == 0 {
                        self.metrics
                            .ttft
                            .with_label_values(&answer.labels())
                            .observe(started.elapsed().as_secs_f64());
                    }
                    let (in_token, out_token) = usage.take();
                    sink.send(TextCompletionResponse {
                        response: chunk.text,
                        in_token,
                        out_token,
                        model: Some(answer.model().to_owned()),
                        provider: answer.provider_field(),
                        tool_calls: chunk.tool_calls,
                        ..Default::default()
                    })
                    .await
                    .map_err(Stop::Unpublished)?;
                    published += 1;
                    debug!(event = "llm_response_chunk", request_id = %ctx.origin, call_id = %ctx.id, chunk_num = published);
                }
            }
            .await;
            if sink.is_ended() {
                // The sink ended the stream itself (a record too large for the bus).
                self.finish(&answer, started, CallOutcome::Error, &usage);
                return Ok(());
            }
            let [provider, model] = answer.labels();
            match outcome {
                Ok(()) => {
                    ctx.usage.finished();
                    let (in_token, out_token) = usage.take();
                    let ended = sink
                        .send(TextCompletionResponse {
                            in_token,
                            out_token,
                            model: Some(model.to_owned()),
                            provider: answer.provider_field(),
                            end_of_stream: true,
                            // A server that names no reason for an answer of tool calls.
                            finish_reason: finish_reason
                                .take()
                                .or_else(|| called_tools.then(|| "tool_calls".to_owned())),
                            ..Default::default()
                        })
                        .await;
                    // Refused: a paced stream's held delta was too large for the bus and its
                    // error record ended the stream before this record.
                    if !self.terminal_sent(ended, &answer, ctx, started, &usage)? {
                        return Ok(());
                    }
                    self.finish(&answer, started, CallOutcome::Success, &usage);
                    info!(event = "llm_request_completed", request_id = %ctx.origin, call_id = %ctx.id, provider, model,
                          duration_ms = started.elapsed().as_millis() as u64, total_chunks = published,
                          in_tokens = usage.last.input, out_tokens = usage.last.output);
                    return Ok(());
                }
                Err(Stop::Unpublished(e)) => {
                    return Err(self.unpublished(&answer, ctx, started, &usage, e));
                }
                Err(Stop::Provider(e)) => {
                    self.note_failure(request, &e);
                    if published == 0 && self.backoff(request, ctx, policy, retry, &e).await {
                        retry += 1;
                        continue;
                    }
                    warn!(event = "llm_request_failed", request_id = %ctx.origin, call_id = %ctx.id, provider, model,
                          error_type = e.kind.as_str(), error_message = %e.message, chunks_received = published);
                    // Counted once sent: a call dropped meanwhile counts as cancelled only.
                    let sent = sink.send(self.error_record(&answer, &e, &mut usage)).await;
                    self.finish(&answer, started, CallOutcome::Error, &usage);
                    return sent;
                }
            }
        }
    }

    async fn whole(
        &self,
        request: &TextCompletionRequest,
        ctx: &RequestContext,
        policy: &RetryPolicy,
        sink: &mut ResponseSink<TextCompletionResponse>,
        started: Instant,
    ) -> Result<(), SinkError> {
        let mut answer = Answer::new(self.labels(request));
        let mut retry = 0;
        loop {
            answer.by = None;
            let mut usage = UsageDeltas::call(&ctx.usage);
            let result = self.provider.generate(request).await;
            match result {
                Ok(done) => {
                    answer.observe(done.answered_by, &ctx.usage);
                    ctx.usage.finished();
                    let [provider, model] = answer.labels();
                    if let Some(u) = done.usage {
                        usage.observe(u);
                    }
                    self.metrics
                        .ttft
                        .with_label_values(&[provider, model])
                        .observe(started.elapsed().as_secs_f64());
                    let (in_token, out_token) = usage.take();
                    let sent = sink
                        .send(TextCompletionResponse {
                            response: done.text,
                            in_token,
                            out_token,
                            model: Some(model.to_owned()),
                            provider: answer.provider_field(),
                            end_of_stream: true,
                            finish_reason: done
                                .finish_reason
                                .as_deref()
                                .map(finish_reason_word)
                                .or_else(|| {
                                    (!done.tool_calls.is_empty()).then(|| "tool_calls".to_owned())
                                }),
                            tool_calls: done.tool_calls,
                            ..Default::default()
                        })
                        .await;
                    if !self.terminal_sent(sent, &answer, ctx, started, &usage)? {
                        return Ok(());
                    }
                    self.finish(&answer, started, CallOutcome::Success, &usage);
                    info!(event = "llm_request_completed", request_id = %ctx.origin, call_id = %ctx.id, provider, model,
                          duration_ms = started.elapsed().as_millis() as u64, total_chunks = 1);
                    return Ok(());
                }
                Err(e) => {
                    if let Some(u) = e.spent {
                        usage.observe(u);
                    }
                    self.note_failure(request, &e);
                    if self.backoff(request, ctx, policy, retry, &e).await {
                        retry += 1;
                        continue;
                    }
                    let [provider, model] = answer.labels();
                    warn!(event = "llm_request_failed", request_id = %ctx.origin, call_id = %ctx.id, provider, model,
                          error_type = e.kind.as_str(), error_message = %e.message, chunks_received = 0);
                    let sent = sink.send(self.error_record(&answer, &e, &mut usage)).await;
                    self.finish(&answer, started, CallOutcome::Error, &usage);
                    return sent;
                }
            }
        }
    }
}

/// Who is answering a call: the provider and model the request asked for, until a fallback
/// list says another of its providers answered ([`AnsweredBy`]). Records, metrics and logs
/// name whoever answered.
struct Answer<'a> {
    requested: [&'a str; 2],
    by: Option<AnsweredBy>,
}

impl<'a> Answer<'a> {
    fn new(requested: [&'a str; 2]) -> Self {
        Self {
            requested,
            by: None,
        }
    }

    /// Takes note of who answered, also on the attempt's usage meter.
    fn observe(&mut self, by: Option<AnsweredBy>, meter: &UsageMeter) {
        if by.is_some() {
            self.by = by;
            let [provider, model] = self.labels();
            meter.answered_by(provider, model);
        }
    }

    /// Provider and model labels.
    fn labels(&self) -> [&str; 2] {
        match &self.by {
            Some(b) => [b.provider, &b.model],
            None => self.requested,
        }
    }

    fn model(&self) -> &str {
        self.labels()[1]
    }

    /// The records' `provider` field: written only when a fallback list answered.
    fn provider_field(&self) -> Option<String> {
        self.by.as_ref().map(|b| b.provider.to_owned())
    }
}

/// A provider's word for why an answer ended, in the vocabulary the records use (OpenAI's,
/// which most callers know): `stop`, `length`, `content_filter`, `tool_calls`; any other word
/// passes through in lower case.
pub fn finish_reason_word(raw: &str) -> String {
    let lower = raw.to_ascii_lowercase();
    let word = match lower.as_str() {
        // OpenAI, Ollama; Anthropic and Bedrock end_turn / stop_sequence; Gemini STOP;
        // Cohere COMPLETE / STOP_SEQUENCE.
        "stop" | "end_turn" | "stop_sequence" | "complete" => "stop",
        // Anthropic and Bedrock max_tokens; Gemini and Cohere MAX_TOKENS; OpenAI length.
        "length" | "max_tokens" | "model_length" => "length",
        "content_filter"
        | "content_filtered"
        | "safety"
        | "recitation"
        | "blocklist"
        | "prohibited_content"
        | "spii"
        | "guardrail_intervened" => "content_filter",
        "tool_calls" | "tool_use" | "tool_call" => "tool_calls",
        _ => return lower,
    };
    word.to_owned()
}

#[async_trait]
impl Handler for TextCompletionService {
    type Request = TextCompletionRequest;
    type Response = TextCompletionResponse;

    async fn handle(
        &self,
        mut request: TextCompletionRequest,
        ctx: RequestContext,
        sink: &mut ResponseSink<TextCompletionResponse>,
    ) -> Result<(), Error> {
        if request.model.as_deref().is_none_or(str::is_empty) {
            request.model.clone_from(&self.flow_model);
        }
        if request.temperature.is_none() {
            request.temperature = self.flow_temperature;
        }
        match request.operation.as_deref() {
            None | Some("" | "completion") => {}
            Some(sluice_schema::LIST_MODELS) => {
                // The model this processor serves; no provider call, so no usage and no
                // provider metrics.
                let model = self
                    .flow_model
                    .clone()
                    .unwrap_or_else(|| self.provider.model().to_owned());
                let models = self
                    .served
                    .iter()
                    .map(|id| sluice_schema::ModelInfo {
                        id: id.clone(),
                        ..sluice_schema::ModelInfo::default()
                    })
                    .collect();
                return sink
                    .send(TextCompletionResponse {
                        model: Some(model),
                        models,
                        end_of_stream: true,
                        ..TextCompletionResponse::default()
                    })
                    .await
                    .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()));
            }
            Some(_) => {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    "invalid request: field `operation`: expected `completion` or `list-models`",
                ));
            }
        }
        self.check(&request)?;
        let policy = self.policy(&request)?;
        let started = Instant::now();
        let [provider, model] = self.labels(&request);
        let streaming = request.streaming && self.provider.supports_streaming();
        ctx.usage.streaming(streaming);
        ctx.usage.answered_by(provider, model);
        info!(event = "llm_request_started", request_id = %ctx.origin, call_id = %ctx.id, provider, model,
              endpoint = %self.endpoint, streaming, attempt = %ctx.attempt);
        let mut in_flight = InFlight::new(&self.metrics, provider, model);
        // The provider call's client span; its context goes out as the HTTP `traceparent`
        // header (providers::send reads it from the task), so a provider that traces sees
        // itself inside this request's trace.
        let mut call = trace::Span::start(
            trace::Kind::Client,
            format!("chat {model}"),
            ctx.traceparent.as_deref(),
        );
        call.set("gen_ai.system", provider.to_owned());
        call.set("gen_ai.request.model", model.to_owned());
        call.set("sluice.streaming", streaming);
        let result = trace::OUTBOUND
            .scope(call.traceparent(), async {
                if streaming {
                    self.stream(&request, &ctx, &policy, sink, started).await
                } else {
                    self.whole(&request, &ctx, &policy, sink, started).await
                }
            })
            .await;
        if result.is_err() || sink.ended_with_error() {
            call.fail("error");
        }
        call.end();
        in_flight.ended();
        match result {
            Ok(()) | Err(SinkError::Ended) => Ok(()),
            Err(e) => Err(Error::new(
                ErrorKind::Internal,
                format!("publishing failed: {e}"),
            )),
        }
    }
}

/// `url` as the request log shows it: a URL may carry a credential in its user-info
/// (`https://user:key@host`) or query (`?key=`), so both are left out; a URL that does not
/// parse is not shown at all.
fn shown_endpoint(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        Err(_) => String::new(),
    }
}

/// A provider call on `sluice_llm_in_flight_requests` while it lives. The runtime drops the
/// handler's future when the client cancels or the drain grace runs out, so the call may end
/// at any await: dropped before [`InFlight::ended`], it is counted as `cancelled` (every
/// other end is counted where it happens).
struct InFlight {
    gauge: prometheus::IntGauge,
    cancelled: Option<prometheus::IntCounter>,
}

impl InFlight {
    fn new(metrics: &LlmMetrics, provider: &str, model: &str) -> Self {
        let gauge = metrics.in_flight.with_label_values(&[provider, model]);
        gauge.inc();
        let cancelled =
            metrics
                .requests
                .with_label_values(&[provider, model, CallOutcome::Cancelled.as_str()]);
        Self {
            gauge,
            cancelled: Some(cancelled),
        }
    }

    /// The call ended (and was counted) without being dropped.
    fn ended(&mut self) {
        self.cancelled = None;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
        if let Some(cancelled) = self.cancelled.take() {
            cancelled.inc();
        }
    }
}

#[cfg(test)]
mod tests;
