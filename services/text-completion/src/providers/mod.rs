//! The providers, one module each, and what they share: HTTP status classification,
//! transport errors, and the first-token / between-chunks time limits.

pub mod anthropic;
pub mod bedrock;
pub mod cohere;
pub mod gemini;
pub mod ollama;
pub mod openai;

use std::time::Duration;

use futures::StreamExt;
use reqwest::StatusCode;

use crate::provider::{Chunk, ChunkStream, FailureKind, ProviderError};

/// The model a request is for: its own `model` when it names one (the handler has checked that
/// the processor serves it), else the provider's configured model.
pub fn model_for<'a>(
    request: &'a sluice_schema::TextCompletionRequest,
    configured: &'a str,
) -> &'a str {
    request
        .model
        .as_deref()
        .filter(|m| !m.is_empty())
        .unwrap_or(configured)
}

/// A tool call's id as providers with strict ids take it (Anthropic and Bedrock: 1 to 64 of
/// `[a-zA-Z0-9_-]`): an id sluice made for a Gemini call carries that call's thought
/// signature (kilobytes of base64: [`gemini::SIGNATURE_MARK`]), which is cut off; other
/// characters become `_`; a longer id becomes its first 47 characters and a hash of the
/// whole. The same id always maps to the same one, so a call and its result still pair,
/// whichever provider of a fallback list made the call.
pub fn portable_call_id(id: &str) -> String {
    let bare = id
        .split_once(gemini::SIGNATURE_MARK)
        .map_or(id, |(bare, _)| bare);
    let clean: String = bare
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    match clean.len() {
        0 => "call".to_owned(),
        1..=64 => clean,
        _ => {
            // FNV-1a: stable across runs and builds (the std hasher promises neither).
            let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            format!("{}_{hash:016x}", &clean[..47])
        }
    }
}

/// A call's arguments as the JSON object the providers that parse them (Anthropic, Gemini,
/// Bedrock, Ollama) send back: `{}` for none; anything but an object is the caller's to fix,
/// refused naming `provider`.
pub fn call_arguments(
    call: &sluice_schema::ToolCall,
    provider: &str,
) -> Result<serde_json::Value, ProviderError> {
    if call.arguments.trim().is_empty() {
        return Ok(serde_json::json!({}));
    }
    match serde_json::from_str::<serde_json::Value>(&call.arguments) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(v),
        _ => Err(ProviderError::unsendable(format!(
            "the arguments of tool call {:?} are not a JSON object; {provider} takes a call's arguments as one",
            shown_call_id(&call.id)
        ))),
    }
}

/// The latest call with `id` in `turns` (a tool result's call, looked for in the turns
/// before it): ids of calls sluice made are unique within an answer, not a conversation.
pub fn call_answered<'a>(
    turns: &'a [sluice_schema::ChatMessage],
    id: &str,
) -> Option<&'a sluice_schema::ToolCall> {
    turns
        .iter()
        .rev()
        .flat_map(|t| t.tool_calls.iter())
        .find(|c| c.id == id)
}

/// A call's id as an error message shows it: without a signature, at most 64 characters.
pub fn shown_call_id(id: &str) -> String {
    id.split_once(gemini::SIGNATURE_MARK)
        .map_or(id, |(bare, _)| bare)
        .chars()
        .take(64)
        .collect()
}

/// A conversation's tool turns as plain text, for a provider sent no tools: Anthropic and
/// Bedrock refuse tool blocks in a request that declares no tools (and Bedrock, which has no
/// tool choice `none`, is sent none to honour it). A call becomes a line of its turn's text,
/// a result a user turn naming the call.
pub fn tool_turns_as_text(
    turns: Vec<sluice_schema::ChatMessage>,
) -> Vec<sluice_schema::ChatMessage> {
    use sluice_schema::{ChatMessage, ChatRole};
    let mut names = std::collections::HashMap::new();
    turns
        .into_iter()
        .map(|t| match t.role {
            ChatRole::Assistant if !t.tool_calls.is_empty() => {
                let mut text = t.content.clone();
                for call in &t.tool_calls {
                    names.insert(call.id.clone(), call.name.clone());
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("[called {}({})]", call.name, call.arguments));
                }
                ChatMessage::new(ChatRole::Assistant, text)
            }
            ChatRole::Tool => {
                let id = t.tool_call_id.unwrap_or_default();
                let name = names
                    .get(&id)
                    .cloned()
                    .unwrap_or_else(|| "a tool".to_owned());
                ChatMessage::new(ChatRole::User, format!("[result of {name}]\n{}", t.content))
            }
            _ => t,
        })
        .collect()
}

/// Vertex AI's public origin for `location`: the regional host
/// `https://{location}-aiplatform.googleapis.com`, or for the `global` location (Google routes
/// the call to a region with capacity) the host without a region, which is the only one that
/// serves it.
pub fn vertex_origin(location: &str) -> String {
    if location == "global" {
        "https://aiplatform.googleapis.com".to_owned()
    } else {
        format!("https://{location}-aiplatform.googleapis.com")
    }
}

/// A request using every field of sluice's extension: a conversation, sampling settings, stop
/// sequences and another model; each provider's tests check it lands on their wire format.
#[cfg(test)]
pub(crate) fn conversation_request() -> sluice_schema::TextCompletionRequest {
    use sluice_schema::{ChatMessage, ChatRole};
    let turn = |role, content: &str| ChatMessage::new(role, content);
    sluice_schema::TextCompletionRequest {
        system: "one word".into(),
        prompt: "flattened, not sent".into(),
        messages: Some(vec![
            turn(ChatRole::User, "France?"),
            turn(ChatRole::Assistant, "Paris"),
            turn(ChatRole::User, "Italy?"),
        ]),
        temperature: Some(0.5),
        max_tokens: Some(9),
        stop: Some(vec!["END".into()]),
        model: Some("other-model".into()),
        ..Default::default()
    }
}

/// Time limits of a provider call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HttpTimeouts {
    /// Establishing the connection.
    pub connect: Duration,
    /// From sending the request to the response headers, and again from those to the first
    /// chunk (or the whole answer, non-streaming).
    pub first_token: Duration,
    /// Between two chunks. The contracts use 60 s (docs/protocol.md#structured-output-contracts),
    /// enough for local models on CPU.
    pub between_chunks: Duration,
}

impl Default for HttpTimeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            first_token: Duration::from_secs(60),
            between_chunks: Duration::from_secs(60),
        }
    }
}

/// A provider's HTTP client: rustls (one TLS stack for the binary), the connect timeout,
/// TCP_NODELAY (reqwest's default), so streamed requests never wait on Nagle, and no
/// redirects followed: reqwest keeps custom headers (`x-api-key`, `api-key`,
/// `x-goog-api-key`) across hosts, so following one could hand the key to whatever host a
/// redirect names. A 3xx answer is an error instead ([`send`]).
pub fn http_client(timeouts: &HttpTimeouts) -> Result<reqwest::Client, ProviderError> {
    sluice_runtime::install_crypto_provider();
    reqwest::Client::builder()
        .connect_timeout(timeouts.connect)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| {
            ProviderError::new(
                FailureKind::Protocol,
                format!("HTTP client: {}", e.without_url()),
            )
        })
}

/// The error of a 3xx answer, which no provider client follows ([`http_client`]): not
/// retried (the same request gets the same redirect), and moved on by a fallback list. It
/// names no URL: the operator finds the redirect's target in the log line written here.
fn redirect_error(status: StatusCode, headers: &reqwest::header::HeaderMap) -> ProviderError {
    let target = headers
        .get(reqwest::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|l| reqwest::Url::parse(l).ok())
        .and_then(|u| u.host_str().map(str::to_owned))
        .unwrap_or_default();
    tracing::warn!(status = status.as_u16(), location_host = %target,
                   "the provider answered with a redirect, which is not followed");
    ProviderError::new(
        FailureKind::Protocol,
        format!(
            "the provider answered HTTP {} (a redirect), which sluice does not follow so that no key goes to another location: set the base URL to the location it names",
            status.as_u16()
        ),
    )
    .with_status(Some(status.as_u16()))
    .with_should_retry(Some(false))
}

/// A provider's endpoint, parsed when the provider is built: a base URL that is not a URL is
/// a setting to fix, said at start-up, and a URL parsed once is not parsed again per request.
/// The message does not repeat the URL (a base URL may carry credentials). A URL that parses
/// but that no HTTP client can call is refused too: `localhost:11434`, the common slip of a
/// missing `http://`, parses as a URL of scheme `localhost` with no host, and would otherwise
/// fail every request instead of the start.
pub fn endpoint_url(url: &str) -> Result<reqwest::Url, ProviderError> {
    let invalid = |why: String| {
        ProviderError::new(
            FailureKind::BadRequest,
            format!("the provider's base URL is not a valid URL: {why}"),
        )
    };
    let parsed = reqwest::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid(format!(
            "its scheme is `{}`, not http or https (is `http://` missing?)",
            parsed.scheme()
        )));
    }
    // http and https URLs always have a host (the url crate refuses `http://` alone).
    Ok(parsed)
}

/// Sends a request. A non-2xx answer becomes the provider's error, built by `describe` from
/// the status and body, with the server's `retry-after(-ms)` hint and `x-should-retry`
/// verdict attached when it sent them. A server that sends no response headers (or no error
/// body) within `limit` (the first-token limit) fails the call with a retryable timeout:
/// reqwest's client has no such limit of its own, because a whole-request timeout would cut
/// long streams.
pub async fn send(
    request: reqwest::RequestBuilder,
    limit: Duration,
    describe: impl FnOnce(StatusCode, &str) -> ProviderError,
) -> Result<reqwest::Response, ProviderError> {
    send_with_headers(request, limit, |status, _, body| describe(status, body)).await
}

/// [`send`] for providers whose errors are described by a header too (Bedrock's
/// `x-amzn-ErrorType`).
pub async fn send_with_headers(
    request: reqwest::RequestBuilder,
    limit: Duration,
    describe: impl FnOnce(StatusCode, &reqwest::header::HeaderMap, &str) -> ProviderError,
) -> Result<reqwest::Response, ProviderError> {
    // Inside a provider call's span (see the handler), carry its W3C trace context.
    let request = match sluice_runtime::trace::outbound_traceparent() {
        Some(tp) => request.header("traceparent", tp),
        None => request,
    };
    let no_response = || {
        ProviderError::new(
            FailureKind::Timeout,
            format!("no response from the provider within {limit:?}"),
        )
    };
    let resp = tokio::time::timeout(limit, request.send())
        .await
        .map_err(|_| no_response())?
        .map_err(|e| transport_error(&e))?;
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    if status.is_redirection() {
        return Err(redirect_error(status, resp.headers()));
    }
    let headers = resp.headers().clone();
    let hint = crate::retry::retry_after(&headers);
    // An error body that does not come is no reason to lose the status.
    let body = tokio::time::timeout(limit, resp.text())
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let error = describe(status, &headers, &body).with_status(Some(status.as_u16()));
    // A header hint wins; otherwise keep one `describe` found in the body (Gemini's RetryInfo).
    let error = match hint {
        Some(_) => error.with_retry_after(hint),
        None => error,
    };
    // The server knows best whether this request can succeed again: `x-should-retry`
    // overrides the status, as in the official SDKs.
    Err(match crate::retry::should_retry(&headers) {
        Some(verdict) => error.with_should_retry(Some(verdict)),
        None => error,
    })
}

/// The failure kind of an HTTP status, as the providers' SDKs treat it.
pub fn classify_status(status: StatusCode) -> FailureKind {
    match status.as_u16() {
        401 => FailureKind::Auth,
        403 => FailureKind::Permission,
        429 => FailureKind::RateLimited,
        408 | 409 | 500..=599 => FailureKind::Server,
        _ => FailureKind::BadRequest,
    }
}

/// A transport failure (no HTTP status): connect errors and timeouts are retryable.
pub fn transport_error(e: &reqwest::Error) -> ProviderError {
    let kind = if e.is_connect() {
        FailureKind::Connect
    } else if e.is_timeout() {
        FailureKind::Timeout
    } else if e.is_decode() {
        FailureKind::Protocol
    } else {
        FailureKind::Connect
    };
    // reqwest's Display names the URL (never headers): the message goes to callers, so it
    // names no URL; the request log has the endpoint with the request id.
    ProviderError::new(kind, format!("provider unreachable: {}", without_url(e)))
}

/// What `e` says without the URL its Display names: its kind and its causes (connection
/// refused, a DNS failure, a TLS error), which name no URL. What callers may see.
pub fn without_url(e: &reqwest::Error) -> String {
    let mut text = if e.is_connect() {
        "cannot connect".to_owned()
    } else if e.is_timeout() {
        "timed out".to_owned()
    } else if e.is_decode() {
        "cannot decode the response body".to_owned()
    } else if e.is_body() {
        "the body broke off".to_owned()
    } else {
        "the request failed".to_owned()
    };
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// A provider response body as reqwest hands it over, for the providers' `decode_stream`.
pub type Body = futures::stream::BoxStream<'static, Result<bytes::Bytes, reqwest::Error>>;

/// What one SSE event means to a provider's decoder.
pub enum SseStep {
    /// Nothing to hand on (pings, role announcements, unknown event types).
    Skip,
    /// A chunk; the stream goes on.
    Chunk(Chunk),
    /// The provider's end-of-stream event, with a last chunk when it carries one.
    End(Option<Chunk>),
}

/// Turns an SSE response into chunks with `decode`, which sees each event. Shared by every
/// SSE provider, so they agree on what ends a stream:
/// - `decode` returning [`SseStep::End`] ends it normally;
/// - the connection closing ends it normally only when `complete_on_close` and a chunk with a
///   `finish_reason` has been seen (Gemini has no end event; OpenAI-compatible servers may
///   omit `[DONE]`), otherwise it is a [`FailureKind::Truncated`] error saying `truncated`;
/// - an unreadable event is skipped with a warning and the stream goes on
///   (docs/protocol.md#streamed-json-lines); any
///   other error from `decode` ends the stream with that error.
pub fn sse_chunks(
    response: reqwest::Response,
    timeouts: HttpTimeouts,
    complete_on_close: bool,
    truncated: &'static str,
    decode: impl FnMut(&eventsource_stream::Event) -> Result<SseStep, ProviderError> + Send + 'static,
) -> ChunkStream {
    sse_body_chunks(
        response.bytes_stream(),
        timeouts,
        complete_on_close,
        truncated,
        decode,
    )
}

/// [`sse_chunks`] over any response body: what the providers' `decode_stream` functions (and
/// the fuzz targets, through them) run on.
pub fn sse_body_chunks(
    body: impl futures::Stream<Item = Result<bytes::Bytes, reqwest::Error>> + Send + 'static,
    timeouts: HttpTimeouts,
    complete_on_close: bool,
    truncated: &'static str,
    decode: impl FnMut(&eventsource_stream::Event) -> Result<SseStep, ProviderError> + Send + 'static,
) -> ChunkStream {
    use eventsource_stream::Eventsource;
    let state = (Box::pin(body.eventsource()), decode, false, false);
    let stream = futures::stream::unfold(
        state,
        move |(mut events, mut decode, finished, over)| async move {
            if over {
                return None;
            }
            loop {
                let failure = match events.next().await {
                    None if complete_on_close && finished => return None,
                    None => ProviderError::new(FailureKind::Truncated, truncated),
                    Some(Err(e)) => sse_failure(e),
                    Some(Ok(event)) => match decode(&event) {
                        Ok(SseStep::Skip) => continue,
                        Ok(SseStep::Chunk(chunk)) => {
                            let finished = finished || chunk.finish_reason.is_some();
                            return Some((Ok(chunk), (events, decode, finished, false)));
                        }
                        Ok(SseStep::End(Some(chunk))) => {
                            return Some((Ok(chunk), (events, decode, finished, true)));
                        }
                        Ok(SseStep::End(None)) => return None,
                        Err(e) if e.kind == FailureKind::Protocol => {
                            tracing::warn!(error = %e, "skipping an unreadable stream event");
                            continue;
                        }
                        Err(e) => e,
                    },
                };
                return Some((Err(failure), (events, decode, finished, true)));
            }
        },
    );
    decode_timeouts(stream, timeouts)
}

/// The error for a failed read of an SSE body: a broken connection is a truncated answer,
/// anything else an unreadable stream.
fn sse_failure(e: eventsource_stream::EventStreamError<reqwest::Error>) -> ProviderError {
    match e {
        eventsource_stream::EventStreamError::Transport(e) => ProviderError::new(
            FailureKind::Truncated,
            format!("the connection broke mid-stream: {}", without_url(&e)),
        ),
        other => ProviderError::new(
            FailureKind::Protocol,
            format!("unreadable event stream: {other}"),
        ),
    }
}

/// Ends `stream` with a timeout error when its first item takes longer than
/// `first_token`, or a later one longer than `between_chunks`.
pub fn decode_timeouts(
    stream: impl futures::Stream<Item = Result<crate::provider::Chunk, ProviderError>> + Send + 'static,
    timeouts: HttpTimeouts,
) -> ChunkStream {
    let state = (Box::pin(stream), true, false);
    futures::stream::unfold(state, move |(mut inner, first, over)| async move {
        if over {
            return None;
        }
        let limit = if first {
            timeouts.first_token
        } else {
            timeouts.between_chunks
        };
        match tokio::time::timeout(limit, inner.next()).await {
            Ok(Some(item)) => Some((item, (inner, false, false))),
            Ok(None) => None,
            Err(_) => {
                let what = if first {
                    "the first token"
                } else {
                    "the next chunk"
                };
                let e =
                    ProviderError::new(FailureKind::Timeout, format!("no {what} within {limit:?}"));
                Some((Err(e), (inner, false, true)))
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_global_vertex_location_has_no_region_in_its_host() {
        assert_eq!(
            vertex_origin("us-east5"),
            "https://us-east5-aiplatform.googleapis.com"
        );
        assert_eq!(vertex_origin("global"), "https://aiplatform.googleapis.com");
    }

    #[test]
    fn statuses_classify_as_the_sdks_do() {
        let k = |s: u16| classify_status(StatusCode::from_u16(s).unwrap());
        assert_eq!(k(401), FailureKind::Auth);
        assert_eq!(k(403), FailureKind::Permission);
        assert_eq!(k(429), FailureKind::RateLimited);
        for s in [408, 409, 500, 502, 503, 529] {
            assert_eq!(k(s), FailureKind::Server, "{s}");
        }
        for s in [400, 404, 413, 422] {
            assert_eq!(k(s), FailureKind::BadRequest, "{s}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_stream_times_out_between_chunks() {
        let timeouts = HttpTimeouts {
            between_chunks: Duration::from_secs(5),
            ..Default::default()
        };
        let inner = futures::stream::iter([Ok(Chunk {
            text: "a".into(),
            ..Default::default()
        })])
        .chain(futures::stream::pending());
        let mut s = decode_timeouts(inner, timeouts);
        assert_eq!(s.next().await.unwrap().unwrap().text, "a");
        let e = s.next().await.unwrap().unwrap_err();
        assert_eq!(e.kind, FailureKind::Timeout);
        assert!(e.message.contains("next chunk"));
        assert!(s.next().await.is_none());
    }

    /// A server that takes the request and never sends response headers (the soak found a
    /// non-streaming call that waited forever on one): the call ends with a timeout.
    #[tokio::test]
    async fn a_server_that_never_answers_the_headers_times_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let client = http_client(&HttpTimeouts::default()).unwrap();
        let started = std::time::Instant::now();
        let e = tokio::time::timeout(
            Duration::from_secs(30),
            send(
                client.post(&url).body("{}"),
                Duration::from_millis(300),
                |_, _| unreachable!("no status"),
            ),
        )
        .await
        .expect("send waited for headers without a limit")
        .unwrap_err();
        assert_eq!(e.kind, FailureKind::Timeout);
        assert!(e.message.contains("no response"), "{}", e.message);
        assert!(started.elapsed() < Duration::from_secs(30));
        hold.abort();
    }

    #[test]
    fn call_ids_become_portable_and_stay_paired() {
        assert_eq!(portable_call_id("toolu_01A-b"), "toolu_01A-b");
        assert_eq!(portable_call_id("call.1:x"), "call_1_x");
        let signed = format!(
            "sluice_00ff{}{}",
            gemini::SIGNATURE_MARK,
            "c2ln+/=".repeat(500)
        );
        assert_eq!(portable_call_id(&signed), "sluice_00ff");
        assert_eq!(shown_call_id(&signed), "sluice_00ff");
        let long = "x".repeat(100);
        let p = portable_call_id(&long);
        assert_eq!(p.len(), 64);
        assert_eq!(p, portable_call_id(&long), "stable");
        assert_ne!(p, portable_call_id(&"x".repeat(101)));
        assert_eq!(portable_call_id(""), "call");
    }

    #[test]
    fn tool_turns_become_text_for_a_provider_sent_no_tools() {
        use sluice_schema::{ChatMessage, ChatRole, ToolCall};
        let mut call = ChatMessage::new(ChatRole::Assistant, "Checking.");
        call.tool_calls = vec![ToolCall {
            id: "c1".into(),
            name: "weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        }];
        let mut result = ChatMessage::new(ChatRole::Tool, "sunny");
        result.tool_call_id = Some("c1".into());
        let turns = tool_turns_as_text(vec![
            ChatMessage::new(ChatRole::User, "Paris?"),
            call,
            result,
        ]);
        assert_eq!(
            turns[1].content,
            "Checking.\n[called weather({\"city\":\"Paris\"})]"
        );
        assert!(turns[1].tool_calls.is_empty());
        assert_eq!(turns[2].role, ChatRole::User);
        assert_eq!(turns[2].content, "[result of weather]\nsunny");
    }
}
