//! W3C trace context across the bus, and optional OTLP export of the spans sluice makes.
//!
//! One request is one trace. The gateway opens a server span (continuing the caller's
//! `traceparent` header when it sent one) and publishes its context in the request's
//! `traceparent` property. Every processor opens a consumer span, a child of the property it
//! received, and hands its own context on: to the requests it makes of other services (the
//! prompt processor of text-completion, the agent of its tools) and, in the text-completion
//! processor, to a client span around the provider call whose context goes out as the HTTP
//! `traceparent` header. A request published straight to a topic without the property starts
//! a trace of its own at its first processor.
//!
//! Propagation never depends on export: span ids are made here, so the context is carried
//! (and the provider sees it) whether or not spans are exported. With an OTLP endpoint set
//! ([`init_otlp`]), finished spans are batched on a background task and sent with the
//! `opentelemetry-otlp` exporter (OTLP/HTTP, protobuf). Building the exporter's `SpanData`
//! ourselves instead of going through the SDK's tracer is what lets the ids be ours: the SDK
//! tracer always draws its own span ids, and its batch processor runs on a thread of its own
//! with no Tokio runtime for an async HTTP client.

use std::{
    borrow::Cow,
    fmt,
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use opentelemetry::{
    InstrumentationScope, KeyValue,
    trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_sdk::{
    Resource,
    trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks},
};
use tokio::sync::{mpsc, oneshot};

/// A W3C trace context: the trace, the span that is the parent of whatever receives it, and
/// the sampled flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    trace_id: u128,
    span_id: u64,
    flags: u8,
}

impl TraceContext {
    /// Parses a `traceparent` value (version 00, or a later version read as 00 as the spec
    /// asks). Returns `None` for anything malformed, including all-zero ids.
    pub fn parse(traceparent: &str) -> Option<Self> {
        let tp = traceparent.trim();
        let mut parts = tp.split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        if !hex(version, 2) || version == "ff" || !hex(trace, 32) || !hex(span, 16) {
            return None;
        }
        if !hex(flags, 2) || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let ctx = Self {
            trace_id: u128::from_str_radix(trace, 16).ok()?,
            span_id: u64::from_str_radix(span, 16).ok()?,
            flags: u8::from_str_radix(flags, 16).ok()?,
        };
        (ctx.trace_id != 0 && ctx.span_id != 0).then_some(ctx)
    }

    /// A new trace, sampled.
    pub fn root() -> Self {
        Self {
            trace_id: nonzero_u128(),
            span_id: nonzero_u64(),
            flags: 0x01,
        }
    }

    /// A new span in the same trace, with the same flags.
    pub fn child(&self) -> Self {
        Self {
            span_id: nonzero_u64(),
            ..*self
        }
    }

    /// A child of `traceparent` when it is valid, else a new trace.
    pub fn child_of(traceparent: Option<&str>) -> (Self, Option<Self>) {
        match traceparent.and_then(Self::parse) {
            Some(parent) => (parent.child(), Some(parent)),
            None => (Self::root(), None),
        }
    }

    /// The trace id, 32 lowercase hex digits.
    pub fn trace_id(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The span id, 16 lowercase hex digits.
    pub fn span_id(&self) -> String {
        format!("{:016x}", self.span_id)
    }

    /// Whether the caller asked for this trace to be recorded.
    pub fn sampled(&self) -> bool {
        self.flags & 0x01 == 0x01
    }
}

impl fmt::Display for TraceContext {
    /// The `traceparent` value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

fn nonzero_u128() -> u128 {
    loop {
        let v: u128 = rand::random();
        if v != 0 {
            return v;
        }
    }
}

fn nonzero_u64() -> u64 {
    loop {
        let v: u64 = rand::random();
        if v != 0 {
            return v;
        }
    }
}

/// What a span stands for, as OTLP's span kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The gateway answering an HTTP request.
    Server,
    /// A processor handling a request from the bus.
    Consumer,
    /// A call out: to an LLM provider or a tool.
    Client,
}

/// A span in progress. It is recorded when [`Span::end`] is called or when it is dropped
/// (a cancelled request's span still ends), and only when export is on and the trace is
/// sampled; otherwise it is just the context it carries.
#[derive(Debug)]
pub struct Span {
    ctx: TraceContext,
    parent: Option<TraceContext>,
    kind: Kind,
    name: Cow<'static, str>,
    start: SystemTime,
    attributes: Vec<KeyValue>,
    error: Option<String>,
    ended: bool,
}

impl Span {
    /// Starts a span continuing `traceparent`, or a new trace when it is absent or invalid.
    pub fn start(
        kind: Kind,
        name: impl Into<Cow<'static, str>>,
        traceparent: Option<&str>,
    ) -> Self {
        let (ctx, parent) = TraceContext::child_of(traceparent);
        Self {
            ctx,
            parent,
            kind,
            name: name.into(),
            start: SystemTime::now(),
            attributes: Vec::new(),
            error: None,
            ended: false,
        }
    }

    /// This span's context.
    pub fn context(&self) -> TraceContext {
        self.ctx
    }

    /// This span's context as a `traceparent` value, for whatever it calls.
    pub fn traceparent(&self) -> String {
        self.ctx.to_string()
    }

    /// Adds an attribute (never a secret or a prompt: spans leave the process).
    pub fn set(&mut self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        if exporting() {
            self.attributes.push(KeyValue::new(key, value));
        }
    }

    /// Marks the span failed with a short description (an error type, not a message that
    /// may quote a prompt).
    pub fn fail(&mut self, description: impl Into<String>) {
        self.error = Some(description.into());
    }

    /// Ends the span now.
    pub fn end(mut self) {
        self.record();
    }

    fn record(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        let Some(export) = EXPORT.get() else {
            return;
        };
        if !self.ctx.sampled() {
            return;
        }
        let status = match self.error.take() {
            Some(description) => Status::error(description),
            None => Status::Unset,
        };
        let data = SpanData {
            span_context: SpanContext::new(
                TraceId::from_bytes(self.ctx.trace_id.to_be_bytes()),
                SpanId::from_bytes(self.ctx.span_id.to_be_bytes()),
                TraceFlags::new(self.ctx.flags),
                false,
                TraceState::default(),
            ),
            parent_span_id: self.parent.map_or(SpanId::INVALID, |p| {
                SpanId::from_bytes(p.span_id.to_be_bytes())
            }),
            parent_span_is_remote: self.parent.is_some(),
            span_kind: match self.kind {
                Kind::Server => SpanKind::Server,
                Kind::Consumer => SpanKind::Consumer,
                Kind::Client => SpanKind::Client,
            },
            name: std::mem::take(&mut self.name),
            start_time: self.start,
            end_time: SystemTime::now(),
            attributes: std::mem::take(&mut self.attributes),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: export.scope.clone(),
        };
        if export.spans.try_send(data).is_err() {
            // The exporter is behind (or gone): lose the span, never the request.
            export.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        self.record();
    }
}

tokio::task_local! {
    /// The `traceparent` of the outbound call being made on this task (the provider call's
    /// client span), for code that sends HTTP requests without a context parameter.
    pub static OUTBOUND: String;
}

/// The outbound `traceparent` set by [`OUTBOUND`] for the current task, if any.
pub fn outbound_traceparent() -> Option<String> {
    OUTBOUND.try_with(Clone::clone).ok()
}

struct Export {
    spans: mpsc::Sender<SpanData>,
    scope: InstrumentationScope,
    dropped: AtomicU64,
}

static EXPORT: OnceLock<Export> = OnceLock::new();

fn exporting() -> bool {
    EXPORT.get().is_some()
}

/// How many finished spans may wait for export before new ones are dropped.
const QUEUE: usize = 4096;
/// Spans per export request.
const BATCH: usize = 512;
/// The longest a finished span waits before it is sent.
const DELAY: Duration = Duration::from_millis(500);
/// How long shutdown waits for the last spans to be sent.
const FLUSH: Duration = Duration::from_secs(5);

/// OTLP export settings.
#[derive(Debug, Clone)]
pub struct OtlpConfig {
    /// The collector's base URL (`http://collector:4318`); spans go to `<base>/v1/traces`.
    pub endpoint: String,
    /// The `service.name` resource attribute.
    pub service_name: String,
    /// Per-export timeout.
    pub timeout: Duration,
}

/// Stops the export task when told to, after sending what is queued.
#[derive(Debug)]
pub struct OtlpGuard {
    stop: Option<oneshot::Sender<()>>,
    done: Option<oneshot::Receiver<()>>,
}

impl OtlpGuard {
    /// Sends the spans still queued (for at most a few seconds) and stops exporting.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(done) = self.done.take() {
            let _ = tokio::time::timeout(FLUSH, done).await;
        }
    }
}

/// Errors setting up export.
#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    /// The exporter could not be built (a bad endpoint, a bad `OTEL_EXPORTER_OTLP_HEADERS`).
    #[error("OTLP exporter: {0}")]
    Build(String),
    /// Export was set up before in this process.
    #[error("OTLP export is already on in this process")]
    AlreadyOn,
}

/// Turns on OTLP/HTTP export of finished spans. Must be called inside a Tokio runtime.
/// Headers for the collector (an API key, say) come from `OTEL_EXPORTER_OTLP_HEADERS`, as
/// OpenTelemetry specifies, never from the command line.
pub fn init_otlp(config: &OtlpConfig) -> Result<OtlpGuard, OtlpError> {
    use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
    let url = format!("{}/v1/traces", config.endpoint.trim_end_matches('/'));
    crate::install_crypto_provider();
    let http = reqwest::Client::builder()
        .timeout(config.timeout)
        .build()
        .map_err(|e| OtlpError::Build(e.to_string()))?;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .with_timeout(config.timeout)
        .with_http_client(ReqwestHttp(http))
        .build()
        .map_err(|e| OtlpError::Build(e.to_string()))?;
    exporter.set_resource(
        &Resource::builder_empty()
            .with_attributes([
                KeyValue::new("service.name", config.service_name.clone()),
                KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            ])
            .build(),
    );
    let (tx, rx) = mpsc::channel(QUEUE);
    EXPORT
        .set(Export {
            spans: tx,
            scope: InstrumentationScope::builder("sluice")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            dropped: AtomicU64::new(0),
        })
        .map_err(|_| OtlpError::AlreadyOn)?;
    let (stop_tx, stop_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel();
    tokio::spawn(async move {
        run_export(exporter, rx, stop_rx).await;
        let _ = done_tx.send(());
    });
    Ok(OtlpGuard {
        stop: Some(stop_tx),
        done: Some(done_rx),
    })
}

async fn run_export(
    exporter: opentelemetry_otlp::SpanExporter,
    mut rx: mpsc::Receiver<SpanData>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut failing = false;
    loop {
        let stopping = tokio::select! {
            n = rx.recv_many(&mut batch, BATCH) => n == 0,
            _ = &mut stop => true,
        };
        if !stopping && batch.len() < BATCH {
            // Let a burst's spans share one request.
            let _ = tokio::time::timeout(DELAY, async {
                while batch.len() < BATCH {
                    let room = BATCH - batch.len();
                    if rx.recv_many(&mut batch, room).await == 0 {
                        break;
                    }
                }
            })
            .await;
        }
        if stopping {
            while let Ok(span) = rx.try_recv() {
                batch.push(span);
            }
        }
        if !batch.is_empty() {
            let n = batch.len();
            match exporter.export(std::mem::take(&mut batch)).await {
                Ok(()) => failing = false,
                // Say so once per run of failures, not once per batch.
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, spans = n, "OTLP export failed; spans lost until it recovers");
                }
                Err(_) => {}
            }
        }
        if stopping {
            if let Some(export) = EXPORT.get() {
                let dropped = export.dropped.load(Ordering::Relaxed);
                if dropped > 0 {
                    tracing::warn!(
                        dropped,
                        "spans dropped because the OTLP export queue was full"
                    );
                }
            }
            return;
        }
    }
}

/// The exporter's HTTP client: the reqwest client the rest of sluice uses (async, rustls),
/// instead of the exporter's own choice of a blocking reqwest of another major version.
#[derive(Debug)]
struct ReqwestHttp(reqwest::Client);

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for ReqwestHttp {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<bytes::Bytes>,
    ) -> Result<opentelemetry_http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let mut req = self
            .0
            .request(parts.method, parts.uri.to_string())
            .body(body);
        for (name, value) in &parts.headers {
            req = req.header(name, value);
        }
        let resp = req.send().await?;
        let mut builder = opentelemetry_http::Response::builder().status(resp.status());
        for (name, value) in resp.headers() {
            builder = builder.header(name, value);
        }
        let body = resp.bytes().await?;
        Ok(builder.body(body)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_formats_and_rejects_bad_traceparents() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let ctx = TraceContext::parse(tp).unwrap();
        assert_eq!(ctx.to_string(), tp);
        assert_eq!(ctx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(ctx.sampled());
        let child = ctx.child();
        assert_eq!(child.trace_id(), ctx.trace_id());
        assert_ne!(child.span_id(), ctx.span_id());
        assert!(
            !TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
                .unwrap()
                .sampled()
        );
        // A later version may add fields; version 00 may not.
        assert!(
            TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz")
                .is_some()
        );
        for bad in [
            "",
            "garbage",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_span_continues_a_valid_parent_and_starts_a_trace_otherwise() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let s = Span::start(Kind::Consumer, "x", Some(tp));
        assert_eq!(s.context().trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(s.context().span_id(), "00f067aa0ba902b7");
        let t = Span::start(Kind::Consumer, "x", Some("nonsense"));
        assert_ne!(t.context().trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(TraceContext::parse(&t.traceparent()).is_some());
    }

    #[tokio::test]
    async fn outbound_traceparent_is_scoped_to_the_task() {
        assert_eq!(outbound_traceparent(), None);
        let got = OUTBOUND
            .scope("00-a".to_owned(), async { outbound_traceparent() })
            .await;
        assert_eq!(got.as_deref(), Some("00-a"));
    }
}
