//! The prompt handler: render, call text-completion over the bus, answer in the template's
//! output mode.
//!
//! - `text`: a streaming request gets the text deltas as `text` records with their token
//!   deltas; a non-streaming one gets one record with the whole text.
//! - `json`: the answer is read whole (a ```` ```json ```` fence stripped, prose around the
//!   value tolerated), normalised, validated against the template's schema, and sent as
//!   `object` on ONE terminal record, streaming or not: a half-written JSON value is of no
//!   use to anyone, and a single terminal record means nothing can ever follow it.
//! - `jsonl`: the completion is streamed and parsed line by line as tokens arrive; each
//!   line that is a JSON object, survives normalisation and satisfies the schema is
//!   published at once as its own `object` record. Other lines are skipped, logged with
//!   their line number and counted, and the stream goes on. The terminal record carries
//!   `objects_emitted` and `lines_skipped`. A non-streaming request gets one record whose
//!   `object` is the JSON array of the objects.
//!
//! Failures end the stream with one error record that carries the usage so far: an unknown template
//! or a missing variable (`invalid-request`), a text-completion error (its own type and message),
//! an answer that is not the JSON the template asks for (`llm-error`). Each request's model call is
//! logged as the LLM streaming contract (docs/specs.md#the-structured-ndjson-contracts) asks
//! ([`crate::requestlog`]); nothing of the prompt or the answer is logged unless the operator opts
//! in to content logging.

use std::{collections::BTreeMap, sync::Arc};

use async_trait::async_trait;
use serde_json::Value;
use sluice_runtime::{
    client::RequestClient,
    processor::{Handler, RequestContext, ResponseSink},
    reader::{Encoder, End, Failure, Out, ReadPolicy, Restartable, StartOver, Whole},
};
use sluice_schema::{
    Error, ErrorKind, PendingUsage, PromptRequest, PromptResponse, TextCompletionRequest,
    TextCompletionResponse,
};
use tracing::{debug, warn};

use crate::{
    ResponseType,
    coverage::{Coverage, Verdict},
    metrics::PromptMetrics,
    normalise::{Answers, Normalised},
    output::{ArrayLines, JsonlParser, LineItem, extract_json},
    requestlog::RequestLog,
    store::TemplateStore,
    templates::{RenderError, Template},
};

/// The text-completion client the prompt processor calls.
pub type LlmClient = RequestClient<TextCompletionRequest, TextCompletionResponse>;

/// How a `json` or `jsonl` template with a schema asks for its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StructuredOutput {
    /// The provider's JSON mode with the schema (a `jsonl` template's as an array of its
    /// objects, turned back into lines as they complete), the template's own validation kept
    /// as the safety net.
    #[default]
    Native,
    /// The template's instructions only.
    Off,
}

impl StructuredOutput {
    /// The names, as options spell them.
    pub const NAMES: [&'static str; 2] = ["native", "off"];
}

impl std::str::FromStr for StructuredOutput {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "native" => Ok(Self::Native),
            "off" => Ok(Self::Off),
            other => Err(format!(
                "unknown structured output {other:?}: expected native or off"
            )),
        }
    }
}

/// The prompt processor's handler.
pub struct PromptService {
    store: Arc<TemplateStore>,
    llm: Arc<LlmClient>,
    metrics: PromptMetrics,
    /// Whether the request log carries content (prompts, objects, malformed lines).
    log_content: bool,
    /// How a template with a schema asks for its answer.
    structured_output: StructuredOutput,
}

impl PromptService {
    /// A handler rendering from `store` and completing through `llm`.
    pub fn new(store: Arc<TemplateStore>, llm: Arc<LlmClient>, metrics: PromptMetrics) -> Self {
        Self {
            store,
            llm,
            metrics,
            log_content: false,
            structured_output: StructuredOutput::Off,
        }
    }

    /// With content in the request log (`--log-content`): the prompts sent, the objects received
    /// and the malformed lines, as the LLM streaming contract logs them. Off by default: logs are
    /// often kept longer and read by more people than the data.
    pub fn with_content_logging(mut self, on: bool) -> Self {
        self.log_content = on;
        self
    }

    /// With [`StructuredOutput::Native`], a `json` template with a schema asks for the
    /// provider's JSON mode with that schema, and a `jsonl` template for an array of its
    /// objects, which is turned back into lines as its elements complete
    /// ([`crate::output::ArrayLines`]); the template's own validation stays. Providers without
    /// a JSON mode are held to it by the text-completion processor
    /// (docs/protocol.md#structured-output). Off until set.
    pub fn with_structured_output(mut self, mode: StructuredOutput) -> Self {
        self.structured_output = mode;
        self
    }
}

/// A record carrying the pending usage, which is then no longer pending.
fn with_usage(pending: &mut PendingUsage) -> PromptResponse {
    let (in_token, out_token) = pending.take();
    PromptResponse {
        in_token,
        out_token,
        model: pending.model.clone(),
        ..PromptResponse::default()
    }
}

/// How the prompt service reads text-completion's answers: a restart starts the answer over
/// while nothing of it was published, and ends it after that (a published record cannot be
/// taken back); a client-side failure is reported with the prompt service's kind.
fn read_policy() -> ReadPolicy<StartOver> {
    ReadPolicy::new(
        StartOver(Error::new(
            ErrorKind::Llm,
            "text-completion restarted its answer after part of it was published; send the request again",
        )),
        |e| e.to_error("text-completion", ErrorKind::Llm),
    )
}

/// The state of one answer, whatever its output mode.
struct Answer<'a> {
    pending: PendingUsage,
    template: Arc<Template>,
    metrics: &'a PromptMetrics,
    log: RequestLog,
}

impl Answer<'_> {
    /// Ends the stream with `last`, the answer's terminal record.
    fn end(&mut self, last: PromptResponse, out: &mut Out<PromptResponse>) {
        self.log.completed();
        out.push(last);
    }

    /// Ends the stream with `error`, the usage so far, and (jsonl) the counts and coverage.
    fn fail(&mut self, error: Error, lines: Option<&Lines>, out: &mut Out<PromptResponse>) {
        self.log.failed(&error);
        let mut r = with_usage(&mut self.pending);
        r.error = Some(error);
        r.end_of_stream = true;
        if let Some(lines) = lines {
            lines.finish(&mut r);
        }
        out.push(r);
    }

    /// Ends the stream as text-completion's answer failed: its error, with the usage its
    /// error record carried.
    fn failed(
        &mut self,
        f: Failure<TextCompletionResponse>,
        lines: Option<&Lines>,
        out: &mut Out<PromptResponse>,
    ) {
        if let Some(r) = &f.record {
            self.pending.add(r);
        }
        self.fail(f.error, lines, out);
    }

    /// Corrects and validates `value`; `Err` is why it is dropped (and the metric's reason).
    fn check(&self, value: &mut Value, line: usize) -> Result<(), (&'static str, String)> {
        let t = &self.template;
        if let Some(normalise) = t.normalise {
            match normalise(value) {
                Normalised::Keep { warnings } => {
                    for w in &warnings {
                        warn!(template = %t.id, line, correction = %w, "jsonl object corrected");
                    }
                    if !warnings.is_empty() {
                        self.metrics.corrected(&t.id, warnings.len());
                    }
                }
                Normalised::Skip { reason } => return Err(("rejected", reason)),
            }
        }
        if let Some(v) = t.validator() {
            let v = v.map_err(|e| {
                (
                    "invalid",
                    format!("the template's schema does not compile: {e}"),
                )
            })?;
            let problems: Vec<String> = v
                .iter_errors(value)
                .take(3)
                .map(|e| {
                    let mut m = sluice_runtime::json_schema::problem(&e);
                    if m.len() > 200 {
                        let mut cut = 200;
                        while !m.is_char_boundary(cut) {
                            cut -= 1;
                        }
                        m.truncate(cut);
                        m.push('…');
                    }
                    m
                })
                .collect();
            if !problems.is_empty() {
                return Err(("invalid", problems.join("; ")));
            }
        }
        Ok(())
    }
}

#[async_trait]
impl Handler for PromptService {
    type Request = PromptRequest;
    type Response = PromptResponse;

    async fn handle(
        &self,
        request: PromptRequest,
        ctx: RequestContext,
        sink: &mut ResponseSink<PromptResponse>,
    ) -> Result<(), Error> {
        let set = self.store.current();
        let rendered = set.render(&request.id, &request.terms).map_err(|e| {
            let kind = match &e {
                RenderError::Unknown { .. } => "unknown",
                RenderError::Render { .. } => "render",
            };
            self.metrics.template_error(kind);
            Error::new(ErrorKind::InvalidRequest, e.to_string())
        })?;
        drop(set);
        let mode = rendered.template.response_type;
        let native = self.structured_output == StructuredOutput::Native;
        let (response_format, schema) = match (&rendered.template.schema, mode) {
            (Some(s), ResponseType::Json) if native => (Some("json".to_owned()), Some(s.clone())),
            (Some(s), ResponseType::Jsonl) if native => (
                Some("json".to_owned()),
                Some(crate::output::lines_schema(s)),
            ),
            _ => (None, None),
        };
        let array_lines = mode == ResponseType::Jsonl && response_format.is_some();
        let caller_checks = response_format.is_some();
        let completion = TextCompletionRequest {
            operation: None,
            system: rendered.system,
            prompt: rendered.prompt,
            // jsonl is always streamed, so objects go out as their lines complete.
            streaming: match mode {
                ResponseType::Text => request.streaming,
                ResponseType::Json => false,
                ResponseType::Jsonl => true,
            },
            response_format,
            schema,
            // The template's own normalisation and validation hold the answer: a provider
            // without a JSON mode is not to buffer or correct it.
            caller_checks,
            temperature: rendered.template.call.temperature,
            max_tokens: rendered.template.call.max_tokens,
            retry: rendered.template.call.retry.clone(),
            ..TextCompletionRequest::default()
        };
        let options = ctx.on_behalf();
        debug!(template = %request.id, ?mode, "rendered; calling text-completion");
        let template = rendered.template;
        let lines =
            (mode == ResponseType::Jsonl).then(|| Lines::new(template.answers, &request.terms));
        let num_blocks = lines
            .as_ref()
            .and_then(|l| l.coverage.as_ref())
            .map(Coverage::expected);
        let log = RequestLog::start(
            &ctx.origin,
            &template.id,
            num_blocks,
            self.log_content,
            &completion,
        );
        let reader = match self.llm.read(&completion, options, read_policy()).await {
            Ok(reader) => reader,
            Err(f) => {
                log.failed(&f.error);
                return Err(f.error);
            }
        };
        let answer = Answer {
            pending: PendingUsage::default(),
            template,
            metrics: &self.metrics,
            log,
        };
        let sent = match lines {
            Some(lines) => {
                let jsonl = JsonlAnswer::new(
                    answer,
                    lines,
                    request.streaming,
                    &request.terms,
                    array_lines,
                );
                reader.drive(jsonl).send_to(sink).await
            }
            None if mode == ResponseType::Json => {
                let json = JsonAnswer {
                    a: answer,
                    whole: Whole::default(),
                    streaming: request.streaming,
                };
                reader.drive(json).send_to(sink).await
            }
            None => reader.drive(TextAnswer(answer)).send_to(sink).await,
        };
        sent.map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))
    }
}

/// `text`: each text delta a record as it arrives, the last one on the terminal record.
struct TextAnswer<'a>(Answer<'a>);

impl Encoder<TextCompletionResponse> for TextAnswer<'_> {
    type Item = PromptResponse;
    type Done = ();

    fn record(&mut self, r: TextCompletionResponse, out: &mut Out<PromptResponse>) {
        let a = &mut self.0;
        a.pending.add(&r);
        if !r.response.is_empty() {
            a.log.chunk(&r.response);
        }
        if r.end_of_stream {
            let mut last = with_usage(&mut a.pending);
            last.text = Some(r.response);
            last.end_of_stream = true;
            a.end(last, out);
        } else if !r.response.is_empty() {
            let mut rec = with_usage(&mut a.pending);
            rec.text = Some(r.response);
            out.push(rec);
        }
    }

    fn end(&mut self, end: End<TextCompletionResponse>, out: &mut Out<PromptResponse>) {
        if let Some(f) = end.failure() {
            self.0.failed(f, None, out);
        }
    }
}

impl Restartable<TextCompletionResponse> for TextAnswer<'_> {
    fn restarted(&mut self, _: &mut Out<PromptResponse>) {
        self.0.pending = PendingUsage::default();
        self.0.log.restarted();
    }
}

/// `json`: the answer read whole (nothing is passed on before its end, so a restart starts it
/// over), then one terminal record with the object.
struct JsonAnswer<'a> {
    a: Answer<'a>,
    whole: Whole,
    /// The caller streams: the record carries the JSON in `text` too.
    streaming: bool,
}

impl Encoder<TextCompletionResponse> for JsonAnswer<'_> {
    type Item = PromptResponse;
    type Done = ();

    fn record(&mut self, r: TextCompletionResponse, _: &mut Out<PromptResponse>) {
        self.whole.add(r);
    }

    fn end(&mut self, end: End<TextCompletionResponse>, out: &mut Out<PromptResponse>) {
        let a = &mut self.a;
        a.pending = std::mem::take(&mut self.whole.usage);
        if let Some(f) = end.failure() {
            return a.failed(f, None, out);
        }
        let id = a.template.id.clone();
        let mut value = match extract_json(&self.whole.text) {
            Ok(v) => v,
            Err(why) => {
                warn!(template = %id, reason = %why, "json answer unusable");
                let e = Error::new(ErrorKind::Llm, format!("template {id:?}: {why}"));
                return a.fail(e, None, out);
            }
        };
        if let Err((_, why)) = a.check(&mut value, 1) {
            warn!(template = %id, "json answer does not match the template's schema");
            let e = Error::new(
                ErrorKind::Llm,
                format!("template {id:?}: the model's answer does not match the schema: {why}"),
            );
            return a.fail(e, None, out);
        }
        a.metrics.object(&id);
        a.log.chunk(&value);
        let mut last = with_usage(&mut a.pending);
        let json = value.to_string();
        // TrustGraph 2.11 streams a `json` template's answer as `text`, and its streaming
        // readers read nothing else (docs/protocol.md#prompt-streaming-trustgraph-and-sluice).
        if self.streaming {
            last.text = Some(json.clone());
        }
        last.object = Some(json);
        last.end_of_stream = true;
        a.end(last, out);
    }
}

impl Restartable<TextCompletionResponse> for JsonAnswer<'_> {
    fn restarted(&mut self, _: &mut Out<PromptResponse>) {
        self.whole = Whole::default();
        self.a.log.restarted();
    }
}

/// A `jsonl` answer's counts: what was published and skipped, the objects collected for a
/// non-streaming caller, and the request rules' tracker.
struct Lines {
    emitted: u64,
    skipped: u64,
    collected: Vec<Value>,
    coverage: Option<Coverage>,
}

impl Lines {
    fn new(rules: Option<&'static Answers>, terms: &BTreeMap<String, String>) -> Self {
        Self {
            emitted: 0,
            skipped: 0,
            collected: Vec::new(),
            coverage: Coverage::new(rules, terms),
        }
    }

    /// Puts the counts and the coverage on the terminal record.
    fn finish(&self, last: &mut PromptResponse) {
        last.objects_emitted = Some(self.emitted);
        last.lines_skipped = Some(self.skipped);
        if let Some(c) = &self.coverage {
            let (expected, answered, pending) = c.tally();
            last.items_expected = Some(expected);
            last.items_answered = Some(answered);
            last.items_pending = pending;
        }
    }
}

/// `jsonl`: the completion parsed line by line as it arrives, each good object published at
/// once (streaming) or collected for the terminal record.
struct JsonlAnswer<'a> {
    a: Answer<'a>,
    lines: Lines,
    parser: JsonlParser,
    /// The answer to a native JSON mode: an array whose elements become the lines.
    array: Option<ArrayLines>,
    array_lines: bool,
    streaming: bool,
    /// The request's terms, for the request rules of an answer started over.
    terms: &'a BTreeMap<String, String>,
}

impl<'a> JsonlAnswer<'a> {
    fn new(
        a: Answer<'a>,
        lines: Lines,
        streaming: bool,
        terms: &'a BTreeMap<String, String>,
        array_lines: bool,
    ) -> Self {
        Self {
            a,
            lines,
            parser: JsonlParser::default(),
            array: array_lines.then(ArrayLines::default),
            array_lines,
            streaming,
            terms,
        }
    }

    /// Publishes `objects` (streaming: one record each; else collected for the last record).
    fn publish(&mut self, objects: Vec<Value>, out: &mut Out<PromptResponse>) {
        for value in objects {
            self.a.metrics.object(&self.a.template.id);
            self.a.log.chunk(&value);
            self.lines.emitted += 1;
            if self.streaming {
                let mut rec = with_usage(&mut self.a.pending);
                let json = value.to_string();
                // The line in `text` too, for TrustGraph 2.11's streaming readers, which read
                // nothing else (docs/protocol.md#prompt-streaming-trustgraph-and-sluice).
                rec.text = Some(format!("{json}\n"));
                rec.object = Some(json);
                out.push(rec);
            } else {
                self.lines.collected.push(value);
            }
        }
    }

    /// Publishes what the request rules held back ([`Coverage::release`]).
    fn publish_held(&mut self, out: &mut Out<PromptResponse>) {
        let held = self
            .lines
            .coverage
            .as_mut()
            .map(Coverage::release)
            .unwrap_or_default();
        self.publish(held, out);
    }

    /// The objects of one parsed line that may be published: checked, then admitted by the
    /// request rules; `None` when the line is skipped (logged and counted).
    fn admit(&mut self, item: LineItem) -> Option<Vec<Value>> {
        let id = &self.a.template.id;
        let (line, mut value) = match item {
            LineItem::Object { line, value } => (line, value),
            LineItem::Malformed { line, text, reason } => {
                self.a.log.malformed(line, &text, &reason);
                self.a.metrics.skipped(id, "malformed");
                self.lines.skipped += 1;
                return None;
            }
        };
        if let Err((kind, why)) = self.a.check(&mut value, line) {
            warn!(template = %id, line, reason = %why, "jsonl line skipped: {kind}");
            self.a.metrics.skipped(id, kind);
            self.lines.skipped += 1;
            return None;
        }
        let Some(c) = self.lines.coverage.as_mut() else {
            return Some(vec![value]);
        };
        let mut lost = 0;
        match c.admit(value, &mut lost) {
            Verdict::Publish(objects) => {
                if lost > 0 {
                    warn!(template = %id, line, lost, "object kept, but it lost links of its item");
                }
                Some(objects)
            }
            Verdict::Drop(kind, why) => {
                warn!(template = %id, line, reason = %why, "jsonl line skipped: {kind}");
                self.a.metrics.skipped(id, kind);
                self.lines.skipped += 1;
                None
            }
        }
    }
}

impl Encoder<TextCompletionResponse> for JsonlAnswer<'_> {
    type Item = PromptResponse;
    type Done = ();

    fn record(&mut self, r: TextCompletionResponse, out: &mut Out<PromptResponse>) {
        self.a.pending.add(&r);
        let mut items = match self.array.as_mut() {
            Some(array) => self.parser.push(&array.push(&r.response)),
            None => self.parser.push(&r.response),
        };
        if r.end_of_stream {
            if let Some(array) = self.array.as_mut() {
                items.extend(self.parser.push(&array.finish()));
            }
            items.extend(self.parser.finish());
        }
        for item in items {
            if let Some(objects) = self.admit(item) {
                self.publish(objects, out);
            }
        }
        if r.end_of_stream {
            self.publish_held(out);
            let mut last = with_usage(&mut self.a.pending);
            last.end_of_stream = true;
            self.lines.finish(&mut last);
            if !self.streaming {
                let collected = std::mem::take(&mut self.lines.collected);
                last.object = Some(Value::Array(collected).to_string());
            }
            debug!(
                template = %self.a.template.id,
                emitted = self.lines.emitted,
                skipped = self.lines.skipped,
                "jsonl answer complete"
            );
            self.a.end(last, out);
        }
    }

    fn end(&mut self, end: End<TextCompletionResponse>, out: &mut Out<PromptResponse>) {
        if let Some(f) = end.failure() {
            // What was held back is an answer all the same: published before the error.
            self.publish_held(out);
            self.a.failed(f, Some(&self.lines), out);
        }
    }
}

impl Restartable<TextCompletionResponse> for JsonlAnswer<'_> {
    fn restarted(&mut self, _: &mut Out<PromptResponse>) {
        self.parser = JsonlParser::default();
        self.array = self.array_lines.then(ArrayLines::default);
        self.lines = Lines::new(self.a.template.answers, self.terms);
        self.a.pending = PendingUsage::default();
        self.a.log.restarted();
    }
}

#[cfg(test)]
mod tests;
