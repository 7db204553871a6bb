//! The provider contract: what every provider must do, run against every provider's wire-exact
//! fake (`sluice_tests::fake_*`) over real HTTP. A provider module describes its fake in a
//! [`Subject`] and runs every case with [`contract_cases!`]; a case a provider cannot take
//! part in is an [`Script::OptOut`] whose reason is written where the subject is.
//!
//! The cases: a streamed answer (text, finish reason, usage, the credential sent), a whole
//! answer, tool calls, structured output (the provider's JSON mode, or none and the processor
//! holds the answer), the error classes (401, another 4xx, 429 with its retry hint, 5xx, an
//! error event inside the stream, a truncated stream, a malformed event), an unreachable
//! server, a redirect (not followed: the key goes nowhere else) and cancellation (dropping
//! the stream closes the provider's connection).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::{StreamExt, future::BoxFuture};
use serde_json::{Value, json};
use sluice_schema::{ChatMessage, ChatRole, TextCompletionRequest, tools::Tool};
use sluice_tests::{PATIENCE, eventually};
use sluice_text_completion::{
    provider::{Chunk, FailureKind, Provider, ProviderError, Usage, whole_calls},
    retry::{self, RetryPolicy},
};

/// A provider's fake, running, and how to build the provider against it.
pub trait Wire: Send + Sync {
    /// The fake's base URL.
    fn base_url(&self) -> String;
    /// The provider at `base_url`, calling the fake's `script`, with the subject's key.
    fn provider_at(&self, base_url: &str, script: &str) -> Arc<dyn Provider>;
    /// The provider against the fake, calling `script`.
    fn provider(&self, script: &str) -> Arc<dyn Provider> {
        self.provider_at(&self.base_url(), script)
    }
    /// The last request's body.
    fn last_body(&self) -> Value;
    /// The credential the last request carried, as the subject's `credential` spells it.
    fn credential_seen(&self) -> Option<String>;
    /// Streams whose client went away before their end.
    fn abandoned(&self) -> usize;
}

/// The fake's script for a case, or why the provider takes no part in it.
#[derive(Debug, Clone, Copy)]
pub enum Script {
    /// The model name (script) that makes the fake behave as the case needs.
    Run(&'static str),
    /// The provider has nothing to check here, and this is why.
    OptOut(&'static str),
}

/// What a malformed event does to a provider's stream.
#[derive(Debug, Clone, Copy)]
pub enum Malformed {
    /// The event is skipped and the stream goes on to this text.
    Skipped(&'static str),
    /// The stream ends with this kind of error after this text: a binary framing whose
    /// checksum fails cannot resynchronise.
    Fails(&'static str, FailureKind),
}

/// A provider as the contract sees it.
pub struct Subject {
    /// Starts the fake.
    pub start: fn() -> BoxFuture<'static, Box<dyn Wire>>,
    /// The secret the provider is built with, which no error may contain.
    pub secret: &'static str,
    /// What the fake sees as the credential ([`Wire::credential_seen`]).
    pub credential: &'static str,
    /// The variable an auth error names.
    pub key_var: &'static str,
    /// The `normal` script's text.
    pub text: &'static str,
    /// The `normal` script's totals, streamed.
    pub usage: Usage,
    /// The totals of a whole answer.
    pub whole_usage: Usage,
    /// A rejected credential.
    pub unauthorized: Script,
    /// A request the API refuses (a 4xx that is not 401, 403 or 429).
    pub rejected: Script,
    /// A 429 on the first call.
    pub rate_limited: Script,
    /// The retry hint the fake's 429 carries (`None`: the vendor sends none).
    pub retry_after: Option<Duration>,
    /// A 5xx on the first call.
    pub server_error: Script,
    /// An error reported inside a stream that had started, and its kind.
    pub error_event: (Script, FailureKind),
    /// A stream that ends without its terminator, after this text.
    pub truncated: (Script, &'static str),
    /// A malformed event.
    pub malformed: (Script, Malformed),
    /// Tool calling: the fake calls every tool offered with `{"q": <the last user text>}`.
    pub tools: Script,
    /// The provider's JSON mode as its request body shows it (`None`: it has none, and the
    /// processor holds the answer to the schema itself, see `structured.rs`).
    pub json_mode: Option<fn(&Value) -> bool>,
    /// A stream that sends a first chunk, then nothing more.
    pub hang: Script,
}

/// Runs every case for a subject: `contract_cases!(subject_fn)` inside the provider's module.
#[macro_export]
macro_rules! contract_cases {
    ($subject:path) => {
        use $crate::contract as c;
        #[tokio::test]
        async fn streams_text_with_a_finish_reason_and_usage() {
            c::streams(&$subject()).await
        }
        #[tokio::test]
        async fn answers_whole() {
            c::whole(&$subject()).await
        }
        #[tokio::test]
        async fn calls_tools() {
            c::tool_calls(&$subject()).await
        }
        #[tokio::test]
        async fn structured_output_uses_the_json_mode_or_leaves_it_to_the_processor() {
            c::structured_output(&$subject()).await
        }
        #[tokio::test]
        async fn a_rejected_credential_names_its_variable_never_the_key() {
            c::unauthorized(&$subject()).await
        }
        #[tokio::test]
        async fn a_refused_request_is_a_final_bad_request() {
            c::rejected(&$subject()).await
        }
        #[tokio::test]
        async fn a_rate_limit_is_retryable_with_the_servers_hint() {
            c::rate_limited(&$subject()).await
        }
        #[tokio::test]
        async fn a_server_error_is_retryable() {
            c::server_error(&$subject()).await
        }
        #[tokio::test]
        async fn an_error_event_ends_the_stream() {
            c::error_event(&$subject()).await
        }
        #[tokio::test]
        async fn a_truncated_stream_is_an_error() {
            c::truncated(&$subject()).await
        }
        #[tokio::test]
        async fn a_malformed_event_is_skipped_or_ends_the_stream() {
            c::malformed(&$subject()).await
        }
        #[tokio::test]
        async fn an_unreachable_server_is_a_retryable_connect_error() {
            c::unreachable(&$subject()).await
        }
        #[tokio::test]
        async fn a_redirect_is_an_error_and_the_key_goes_nowhere_else() {
            c::redirect(&$subject()).await
        }
        #[tokio::test]
        async fn dropping_the_stream_closes_the_providers_connection() {
            c::cancellation(&$subject()).await
        }
    };
}

/// A streamed request: a system prompt and one user turn.
pub fn request(streaming: bool) -> TextCompletionRequest {
    TextCompletionRequest {
        system: "be brief".into(),
        prompt: "Paris?".into(),
        streaming,
        ..Default::default()
    }
}

/// The chunks of a streamed call and the error that ended it; nothing may follow an error.
pub async fn drain(
    provider: &dyn Provider,
    request: &TextCompletionRequest,
) -> (Vec<Chunk>, Option<ProviderError>) {
    let mut stream = match provider.generate_stream(request).await {
        Ok(s) => s,
        Err(e) => return (Vec::new(), Some(e)),
    };
    let mut chunks = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(c) => chunks.push(c),
            Err(e) => {
                assert!(stream.next().await.is_none(), "nothing follows an error");
                return (chunks, Some(e));
            }
        }
    }
    (chunks, None)
}

/// The text of `chunks`.
pub fn text(chunks: &[Chunk]) -> String {
    chunks.iter().map(|c| c.text.as_str()).collect()
}

/// The totals of `chunks` (running totals merged).
pub fn usage(chunks: &[Chunk]) -> Option<Usage> {
    chunks.iter().filter_map(|c| c.usage).reduce(Usage::merge)
}

/// The script of a case, or `None` after saying why the provider opts out.
fn script(case: &str, s: Script) -> Option<&'static str> {
    match s {
        Script::Run(name) => Some(name),
        Script::OptOut(why) => {
            eprintln!("{case}: not run for this provider: {why}");
            None
        }
    }
}

/// The error of a streamed call of `script`, which must fail.
async fn failure(wire: &dyn Wire, script: &str) -> (Vec<Chunk>, ProviderError) {
    let (chunks, err) = drain(&*wire.provider(script), &request(true)).await;
    let err = err.unwrap_or_else(|| panic!("{script} must fail; got {:?}", text(&chunks)));
    (chunks, err)
}

/// Whether sluice's default policy retries `err`.
fn retried(err: &ProviderError) -> bool {
    retry::retries(&RetryPolicy::default(), err)
}

/// Streams `normal`: its text, a finish reason, the totals, the credential sent.
pub async fn streams(s: &Subject) {
    let wire = (s.start)().await;
    let (chunks, err) = drain(&*wire.provider("normal"), &request(true)).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(text(&chunks), s.text);
    assert!(
        chunks.iter().any(|c| c.finish_reason.is_some()),
        "{chunks:?}"
    );
    assert_eq!(usage(&chunks), Some(s.usage));
    assert_eq!(wire.credential_seen().as_deref(), Some(s.credential));
}

/// A whole answer to `normal`: its text and totals.
pub async fn whole(s: &Subject) {
    let wire = (s.start)().await;
    let done = wire.provider("normal").generate(&request(false)).await;
    let done = done.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(done.text, s.text);
    assert_eq!(done.usage, Some(s.whole_usage));
    assert!(done.finish_reason.is_some(), "{done:?}");
}

/// A tool offered is called, its arguments a JSON object, streamed and whole.
pub async fn tool_calls(s: &Subject) {
    let Some(name) = script("calls_tools", s.tools) else {
        return;
    };
    let wire = (s.start)().await;
    let provider = wire.provider(name);
    assert!(provider.supports_tools());
    let mut req = request(true);
    req.messages = Some(vec![ChatMessage::new(ChatRole::User, "Paris?")]);
    req.tools = Some(vec![Tool {
        name: "lookup".into(),
        description: Some("Looks a city up.".into()),
        parameters: json!({"type": "object", "properties": {"q": {"type": "string"}}}),
        strict: None,
    }]);
    let (chunks, err) = drain(&*provider, &req).await;
    assert!(err.is_none(), "{err:?}");
    let pieces: Vec<_> = chunks.iter().flat_map(|c| c.tool_calls.clone()).collect();
    let streamed = whole_calls(&pieces);
    let done = provider
        .generate(&TextCompletionRequest {
            streaming: false,
            ..req
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for calls in [streamed, done.tool_calls] {
        assert_eq!(calls.len(), 1, "{calls:?}");
        let call = &calls[0];
        assert_eq!(call.name.as_deref(), Some("lookup"));
        assert!(
            call.id.as_deref().is_some_and(|id| !id.is_empty()),
            "{call:?}"
        );
        let args: Value = serde_json::from_str(&call.arguments).unwrap();
        assert_eq!(args, json!({"q": "Paris?"}));
    }
}

/// A request for JSON with a schema: a provider with a JSON mode holds the answer itself and
/// says so on the wire; one without leaves it to the processor.
pub async fn structured_output(s: &Subject) {
    let wire = (s.start)().await;
    let provider = wire.provider("normal");
    let mut req = request(true);
    req.response_format = Some("json".into());
    req.schema = Some(json!({"type": "object", "properties": {"label": {"type": "string"}}}));
    assert_eq!(
        provider.holds_structured_output(&req),
        s.json_mode.is_some(),
        "whether the provider holds the answer itself"
    );
    let Some(json_mode) = s.json_mode else {
        return;
    };
    let (_, err) = drain(&*provider, &req).await;
    assert!(err.is_none(), "{err:?}");
    let body = wire.last_body();
    assert!(json_mode(&body), "no JSON mode in {body}");
}

/// A rejected credential: an auth error, not retried, naming the variable and never the key.
pub async fn unauthorized(s: &Subject) {
    let Some(name) = script("unauthorized", s.unauthorized) else {
        return;
    };
    let wire = (s.start)().await;
    let (_, err) = failure(&*wire, name).await;
    assert_eq!(err.kind, FailureKind::Auth, "{err}");
    assert!(!retried(&err));
    assert!(err.message.contains(s.key_var), "{}", err.message);
    assert!(!err.message.contains(s.secret), "{}", err.message);
    assert!(!format!("{err:?}").contains(s.secret));
}

/// A refused request: a bad request, never retried.
pub async fn rejected(s: &Subject) {
    let Some(name) = script("rejected", s.rejected) else {
        return;
    };
    let wire = (s.start)().await;
    let (_, err) = failure(&*wire, name).await;
    assert_eq!(err.kind, FailureKind::BadRequest, "{err}");
    assert!(
        err.status.is_some_and(|st| (400..500).contains(&st)),
        "{err:?}"
    );
    assert!(!retried(&err));
}

/// A 429: rate limited, retried, with the server's hint.
pub async fn rate_limited(s: &Subject) {
    let Some(name) = script("rate_limited", s.rate_limited) else {
        return;
    };
    let wire = (s.start)().await;
    let (_, err) = failure(&*wire, name).await;
    assert_eq!(err.kind, FailureKind::RateLimited, "{err}");
    assert!(retried(&err));
    assert_eq!(err.retry_after, s.retry_after);
    // The first call only: the next one answers.
    let (chunks, err) = drain(&*wire.provider(name), &request(true)).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(text(&chunks), s.text);
}

/// A 5xx: a server error, retried.
pub async fn server_error(s: &Subject) {
    let Some(name) = script("server_error", s.server_error) else {
        return;
    };
    let wire = (s.start)().await;
    let (_, err) = failure(&*wire, name).await;
    assert_eq!(err.kind, FailureKind::Server, "{err}");
    assert!(err.status.is_some_and(|st| st >= 500), "{err:?}");
    assert!(retried(&err));
}

/// An error event after the first text ends the stream with the provider's error.
pub async fn error_event(s: &Subject) {
    let (case, kind) = s.error_event;
    let Some(name) = script("error_event", case) else {
        return;
    };
    let wire = (s.start)().await;
    let (chunks, err) = failure(&*wire, name).await;
    assert!(!text(&chunks).is_empty(), "the text before the error came");
    assert_eq!(err.kind, kind, "{err}");
}

/// A stream that ends without its terminator is truncated, not complete.
pub async fn truncated(s: &Subject) {
    let (case, partial) = s.truncated;
    let Some(name) = script("truncated", case) else {
        return;
    };
    let wire = (s.start)().await;
    let (chunks, err) = failure(&*wire, name).await;
    assert_eq!(text(&chunks), partial);
    assert_eq!(err.kind, FailureKind::Truncated, "{err}");
}

/// A malformed event is skipped (a text protocol resynchronises at the next event) or ends
/// the stream with a protocol error (a binary framing cannot).
pub async fn malformed(s: &Subject) {
    let (case, outcome) = s.malformed;
    let Some(name) = script("malformed", case) else {
        return;
    };
    let wire = (s.start)().await;
    let (chunks, err) = drain(&*wire.provider(name), &request(true)).await;
    match outcome {
        Malformed::Skipped(want) => {
            assert!(err.is_none(), "{err:?}");
            assert_eq!(text(&chunks), want);
        }
        Malformed::Fails(before, kind) => {
            assert_eq!(text(&chunks), before);
            assert_eq!(err.map(|e| e.kind), Some(kind));
        }
    }
}

/// Nothing listening: a connect error, retried, naming no URL.
pub async fn unreachable(s: &Subject) {
    let wire = (s.start)().await;
    let (_, err) = drain(
        &*wire.provider_at("http://127.0.0.1:1", "normal"),
        &request(true),
    )
    .await;
    let err = err.unwrap_or_else(|| panic!("nothing listens on port 1"));
    assert_eq!(err.kind, FailureKind::Connect, "{err}");
    assert!(retried(&err));
    assert!(!err.message.contains("127.0.0.1"), "{}", err.message);
}

/// A server that answers every request with a 307 to a second server, which records what it
/// receives: the provider does not follow, says so without naming a URL, and the second
/// server never sees the key.
pub async fn redirect(s: &Subject) {
    let wire = (s.start)().await;
    let (elsewhere, seen_elsewhere) =
        recording_server("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_owned()).await;
    let (redirecting, seen_redirecting) = recording_server(format!(
        "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://{elsewhere}/v1/elsewhere\r\ncontent-length: 0\r\n\r\n"
    ))
    .await;
    let provider = wire.provider_at(&format!("http://{redirecting}"), "normal");
    let (_, err) = drain(&*provider, &request(true)).await;
    let err = err.unwrap_or_else(|| panic!("a redirect must fail"));
    assert_eq!(err.status, Some(307), "{err:?}");
    assert!(!retried(&err), "the same request gets the same redirect");
    assert!(err.message.contains("redirect"), "{}", err.message);
    for url in [redirecting.to_string(), elsewhere.to_string()] {
        assert!(!err.message.contains(&url), "{}", err.message);
    }
    assert_eq!(seen_redirecting.lock().unwrap().len(), 1);
    assert_eq!(
        *seen_elsewhere.lock().unwrap(),
        Vec::<String>::new(),
        "nothing went where the redirect pointed"
    );
}

/// Dropping a stream after its first chunk closes the connection: the provider stops
/// generating (and billing) what nobody reads.
pub async fn cancellation(s: &Subject) {
    let Some(name) = script("cancellation", s.hang) else {
        return;
    };
    let wire = (s.start)().await;
    let mut stream = wire
        .provider(name)
        .generate_stream(&request(true))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let first = stream.next().await;
    assert!(matches!(first, Some(Ok(_))), "{first:?}");
    assert_eq!(wire.abandoned(), 0);
    drop(stream);
    let abandoned = eventually(PATIENCE, async || wire.abandoned(), |n| *n == 1).await;
    assert_eq!(abandoned, 1, "the fake saw its client go away");
}

/// A loopback HTTP/1.1 server answering every request with `response`, recording each
/// request's head (request line and headers, lower-cased).
pub async fn recording_server(response: String) -> (std::net::SocketAddr, Arc<Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // The head, then as much body as it announces, so that closing sends no reset.
            let head_end = loop {
                let n = socket.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break None;
                }
                buf.extend_from_slice(&chunk[..n]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break Some(i + 4);
                }
            };
            let Some(head_end) = head_end else { continue };
            let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < head_end + length {
                let n = socket.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            record.lock().unwrap().push(head);
            let _ = socket.write_all(response.as_bytes()).await;
            let _ = socket.shutdown().await;
        }
    });
    (addr, seen)
}
