//! The REST routes: a whole answer as JSON, a stream of gateway events as NDJSON or SSE
//! (docs/protocol.md#gateway-events-ndjson-and-sse), or TrustGraph's streaming spec's
//! (docs/specs.md#trustgraphs-streaming-spec) stream of the records themselves as SSE.
//!
//! What is sent: the `Accept` header decides when it names a stream (`application/x-ndjson`: the
//! gateway's events; `text/event-stream`: the gateway's events as SSE, unless the body's
//! `streaming` is true, which gets TrustGraph's streaming spec's REST streaming: SSE, each event's
//! data one response record); without one, the body's `streaming: true` gets TrustGraph's SSE
//! records on `/api/v1/{service}`, and anything else one JSON answer. A request refused before its stream starts, by a caller that
//! asked for NDJSON, gets its error as NDJSON events too (`error`, then `done`), with the HTTP
//! status the error maps to.

use std::{convert::Infallible, sync::Arc, time::Instant};

use axum::{
    Json,
    body::{Body, Bytes},
    extract::{Path, RawQuery, State, rejection::BytesRejection},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{
        IntoResponse, Response,
        sse::{self, KeepAlive, Sse},
    },
};
use futures::{Stream, StreamExt};
use serde_json::json;
use sluice_runtime::{
    client::RequestClient,
    reader::{Reader, Report},
};
use sluice_schema::{Error, ErrorKind};

use crate::{
    Clients, Inner, Refusal,
    auth::Caller,
    encode::{Tally, events::Events, records::RecordEvents},
    events::{Event, Reason},
    kinds::{Agent, Kind, Prompt, ServiceKind, TextCompletion},
    preamble::{self, Call, Refused, Started, labelled},
    reporting,
    resume::{self, Numbering, Step},
    server_span,
};

/// A service kind the gateway holds a client for.
pub(crate) trait Routed: Kind {
    fn client(clients: &Clients) -> Option<&RequestClient<Self::Request, Self::Response>>;

    /// The model a request names, for an API key's permissions.
    fn model(_request: &Self::Request) -> Option<&str> {
        None
    }

    /// The most tokens a request may produce, reserved against an API key's token limits.
    fn max_tokens(_request: &Self::Request) -> Option<u64> {
        None
    }

    /// Whether a request calls a model, and so counts against an API key's limits (asking
    /// which models are served does not).
    fn calls_a_model(_request: &Self::Request) -> bool {
        true
    }
}

impl Routed for TextCompletion {
    fn client(clients: &Clients) -> Option<&RequestClient<Self::Request, Self::Response>> {
        clients.text_completion.as_deref()
    }

    fn model(request: &Self::Request) -> Option<&str> {
        request.model.as_deref()
    }

    fn max_tokens(request: &Self::Request) -> Option<u64> {
        request.max_tokens.map(u64::from)
    }

    fn calls_a_model(request: &Self::Request) -> bool {
        request.operation.as_deref() != Some(sluice_schema::LIST_MODELS)
    }
}

impl Routed for Prompt {
    fn client(clients: &Clients) -> Option<&RequestClient<Self::Request, Self::Response>> {
        clients.prompt.as_ref()
    }
}

impl Routed for Agent {
    fn client(clients: &Clients) -> Option<&RequestClient<Self::Request, Self::Response>> {
        clients.agent.as_ref()
    }
}

/// How the caller gets the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// One JSON answer: the final record, or an error.
    Json,
    /// The gateway's events, one JSON object per line.
    Ndjson,
    /// The gateway's events as SSE, each named by its type.
    Sse,
    /// TrustGraph's streaming spec's REST streaming: SSE whose events' data are the response
    /// records.
    Records,
}

/// The stream the `Accept` header names, if it names one.
pub(crate) fn accepted(headers: &HeaderMap) -> Option<Mode> {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if accept.contains("application/x-ndjson") {
        Some(Mode::Ndjson)
    } else if accept.contains("text/event-stream") {
        Some(Mode::Sse)
    } else {
        None
    }
}

/// What a caller asked for, as far as it is known before the body is read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask {
    /// The stream asked for before the body is read (the `Accept` header), which also says
    /// how a request refused before that is answered.
    pub(crate) accept: Option<Mode>,
    /// The stream a body that asks to stream gets when `accept` names none.
    pub(crate) streamed: Mode,
    /// TrustGraph's routes: a body that asks to stream, sent with an SSE `Accept`, gets
    /// TrustGraph's records ([`Mode::Records`]), not the gateway's events: an SSE client
    /// library sends that `Accept` whatever it reads.
    pub(crate) records_on_sse: bool,
    /// Agents: every step as a `token` event (`?steps=true`), not only the answer.
    pub(crate) steps: bool,
}

impl Ask {
    /// The REST routes' rule: the `Accept` header, else the body's flag (TrustGraph's streaming
    /// spec's SSE).
    fn rest(headers: &HeaderMap, query: Option<&str>) -> Self {
        Self {
            accept: accepted(headers),
            streamed: Mode::Records,
            records_on_sse: true,
            steps: steps_asked(query),
        }
    }

    /// TrustGraph's REST form's rule: a whole answer whatever the body's flag, unless the
    /// `Accept` header names a stream.
    fn flow(headers: &HeaderMap, query: Option<&str>) -> Self {
        Self {
            streamed: Mode::Json,
            ..Self::rest(headers, query)
        }
    }

    /// The mode, once the body said whether it streams.
    fn mode(self, body_streams: bool) -> Mode {
        match self.accept {
            Some(Mode::Sse) if body_streams && self.records_on_sse => Mode::Records,
            Some(m) => m,
            None if body_streams => self.streamed,
            None => Mode::Json,
        }
    }
}

/// Whether a query string asks for an agent's steps as tokens: `steps=true` (or `steps=1`).
fn steps_asked(query: Option<&str>) -> bool {
    query.is_some_and(|q| {
        q.split('&')
            .any(|pair| matches!(pair, "steps=true" | "steps=1"))
    })
}

/// The HTTP status an error record's type maps to.
pub(crate) fn status_for(kind: &ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
        ErrorKind::MessageTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorKind::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
        ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
        ErrorKind::NoConfiguration | ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        ErrorKind::Cancelled => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::Llm
        | ErrorKind::Agent
        | ErrorKind::Gateway
        | ErrorKind::RecordsLost
        | ErrorKind::Other(_) => StatusCode::BAD_GATEWAY,
    }
}

fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    let mut resp = (
        status,
        Json(json!({ "error": { "type": kind, "message": message } })),
    )
        .into_response();
    challenge(&mut resp);
    resp
}

/// A 401 names the scheme the caller must use.
fn challenge(resp: &mut Response) {
    if resp.status() == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
}

/// The caller's session: its `x-session-id` header, if any.
fn session_header(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// A request an API key may not make (403) or that is over its limits (429, with
/// `Retry-After` when waiting helps), in the caller's form.
pub(crate) fn refused(mode: Option<Mode>, headers: &HeaderMap, refusal: Refusal) -> Response {
    match refusal {
        Refusal::Forbidden(why) => refuse(
            mode,
            headers,
            StatusCode::FORBIDDEN,
            "invalid-request",
            &why,
        ),
        Refusal::Limited(l) => {
            let mut resp = refuse(
                mode,
                headers,
                StatusCode::TOO_MANY_REQUESTS,
                "too-many-requests",
                &l.message,
            );
            retry_after(&mut resp, l.retry_after);
            resp
        }
    }
}

/// Sets `Retry-After` (whole seconds).
pub(crate) fn retry_after(resp: &mut Response, secs: Option<u64>) {
    if let Some(secs) = secs {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
}

/// A refusal before the stream started: NDJSON `error` and `done` events when the caller
/// asked for NDJSON (an event-protocol client reads the body's lines whatever the status), else the
/// JSON error; the HTTP status is the error's either way.
pub(crate) fn refuse(
    mode: Option<Mode>,
    headers: &HeaderMap,
    status: StatusCode,
    kind: &str,
    message: &str,
) -> Response {
    if mode != Some(Mode::Ndjson) {
        return error_response(status, kind, message);
    }
    let trace_id = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(sluice_runtime::trace::TraceContext::parse)
        .unwrap_or_else(sluice_runtime::trace::TraceContext::root)
        .trace_id();
    let session_id = session_header(headers).unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let (trace_id, session_id): (Arc<str>, Arc<str>) = (Arc::from(trace_id), Arc::from(session_id));
    let mut error = Event::error(&Error::new(ErrorKind::from_wire(kind), message));
    let mut done = Event::done(Reason::Error, Default::default(), None);
    for e in [&mut error, &mut done] {
        e.trace_id = trace_id.clone();
        e.session_id = session_id.clone();
    }
    let mut body = error.to_line().to_vec();
    body.extend_from_slice(&done.to_line());
    let mut resp = (status, body).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    challenge(&mut resp);
    resp
}

/// `POST /api/v1/{service}`.
pub(crate) async fn service(
    State(inner): State<Arc<Inner>>,
    Path(service): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let ask = Ask::rest(&headers, query.as_deref());
    dispatch(inner, &service, headers, body, ask).await
}

/// `POST /api/v1/flow/{flow}/service/{service}`: TrustGraph's REST, a whole answer whatever
/// the body's `streaming` says (TrustGraph's REST never streams), unless the `Accept` header
/// names a stream (no TrustGraph client sends one; `sluice invoke -f` does).
pub(crate) async fn flow_service(
    State(inner): State<Arc<Inner>>,
    Path((flow, service)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    // A flow or a workspace (TrustGraph 2.x's REST client names its workspace in the body)
    // other than the one this gateway serves is refused, never answered from this one's.
    let workspace;
    let elsewhere = if flow == inner.config.flow {
        workspace = body.as_ref().ok().and_then(|b| body_workspace(b));
        workspace
            .as_deref()
            .filter(|w| *w != inner.config.workspace)
            .map(|w| ("workspace", w, inner.config.workspace.as_str()))
    } else {
        Some(("flow", flow.as_str(), inner.config.flow.as_str()))
    };
    if let Some((what, asked, served)) = elsewhere {
        let message = format!("unknown {what} {asked:?}; this gateway serves {what} {served:?}");
        let resp = refuse(
            accepted(&headers),
            &headers,
            StatusCode::NOT_FOUND,
            "invalid-request",
            &message,
        );
        return labelled("flow", resp);
    }
    let ask = Ask::flow(&headers, query.as_deref());
    dispatch(inner, &service, headers, body, ask).await
}

/// The `workspace` a TrustGraph REST body names, when it is a JSON object naming one (a body
/// that does not decode is refused later, by its service's decoder).
fn body_workspace(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Scope {
        workspace: Option<String>,
    }
    serde_json::from_slice::<Scope>(body).ok()?.workspace
}

/// `GET /api/v1/models`: the models the text-completion processor serves, as the final
/// record of a `list-models` request (`{"models": [{"id": ...}], ...}`).
pub(crate) async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let body = Bytes::from_static(br#"{"operation":"list-models"}"#);
    let ask = Ask {
        accept: None,
        streamed: Mode::Json,
        records_on_sse: false,
        steps: false,
    };
    dispatch(inner, "text-completion", headers, Ok(body), ask).await
}

/// Unknown paths get a JSON 404 like every other error.
pub(crate) async fn not_found() -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "invalid-request",
        "no such route; see POST /api/v1/{text-completion|prompt|agent}, GET /api/v1/socket, POST /v1/chat/completions and GET /v1/models",
    )
}

async fn dispatch(
    inner: Arc<Inner>,
    service: &str,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    ask: Ask,
) -> Response {
    let Some(kind) = ServiceKind::from_name(service) else {
        let message =
            format!("unknown service {service:?}: expected text-completion, prompt or agent");
        let resp = refuse(
            ask.accept,
            &headers,
            StatusCode::NOT_FOUND,
            "invalid-request",
            &message,
        );
        return labelled("unknown", resp);
    };
    match kind {
        ServiceKind::TextCompletion => {
            handle::<TextCompletion>(inner, headers, body, ask, record).await
        }
        ServiceKind::Prompt => handle::<Prompt>(inner, headers, body, ask, record).await,
        ServiceKind::Agent => handle::<Agent>(inner, headers, body, ask, record).await,
    }
}

/// A request body read as the service's request record.
pub(crate) fn record<R: serde::de::DeserializeOwned>(body: &Bytes) -> Result<R, String> {
    sluice_schema::decode(body).map_err(|e| e.to_string())
}

/// Serves one request of service `K`: `decode` reads the body (its error names the field and
/// the expected type, never a value: the body may hold a prompt).
pub(crate) async fn handle<K: Routed>(
    inner: Arc<Inner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    ask: Ask,
    decode: impl FnOnce(&Bytes) -> Result<K::Request, String>,
) -> Response {
    labelled(
        K::KIND.as_str(),
        answer::<K>(inner, headers, body, ask, decode).await,
    )
}

/// [`handle`]'s work: decode, [`preamble::start`], then the answer in the mode asked for.
async fn answer<K: Routed>(
    inner: Arc<Inner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    ask: Ask,
    decode: impl FnOnce(&Bytes) -> Result<K::Request, String>,
) -> Response {
    let started = Instant::now();
    let read = read_request::<K>(&inner, &headers, body, decode);
    let (caller, mut request, body_bytes) = match read {
        Ok(r) => r,
        Err(refused) => return refused.rest(&inner, ask.accept, &headers),
    };
    let mode = ask.mode(K::streaming(&request));
    K::set_streaming(&mut request, mode != Mode::Json);
    let route = K::KIND.as_str();
    let incoming = headers.get("traceparent").and_then(|v| v.to_str().ok());
    let span = server_span(route, incoming);
    let trace_id = span.context().trace_id();
    let call = Call::<K, _> {
        inner: &inner,
        headers: &headers,
        caller: &caller,
        request: &request,
        body_bytes,
        route,
        span,
        token_trace: Some(trace_id.clone()),
        policy: reporting(),
        resumable_route: true,
    };
    let Started {
        reader,
        mut span,
        request_id,
        resume,
        numbering,
    } = match preamble::start(call).await {
        Ok(s) => s,
        Err(refused) => return refused.rest(&inner, Some(mode), &headers),
    };
    // A resumed stream's events carry the trace id the stream started with.
    let trace_id = match &resume {
        Some(r) => r.token.trace_id.clone(),
        None => trace_id,
    };
    // Without a session of its own, the request's id: the same again when it is resumed.
    let session_id = session_header(&headers)
        .or_else(|| K::session_id(&request))
        .unwrap_or(request_id);
    match mode {
        Mode::Json => {
            let resp = whole::<K>(reader).await;
            if !resp.status().is_success() {
                span.fail(resp.status().as_str().to_owned());
            }
            span.end();
            resp
        }
        Mode::Records => {
            let tally = Tally::opened(inner.clone(), route, started, span);
            let token = numbering.token().map(str::to_owned);
            let records = reader.drive(RecordEvents::<K>::new(tally)).into_stream();
            let events = numbered(records, numbering, |e, id| match id {
                Some(id) => e.id(id),
                None => e,
            })
            .map(Ok::<_, Infallible>);
            let mut resp = Sse::new(events)
                .keep_alive(KeepAlive::default())
                .into_response();
            no_buffering(&mut resp);
            resume::token_header(&mut resp, token.as_deref());
            resp
        }
        Mode::Ndjson | Mode::Sse => {
            let tally = Tally::opened(inner.clone(), route, started, span);
            let encoder =
                Events::<K>::new(ask.steps, Arc::from(trace_id), Arc::from(session_id), tally);
            let token = numbering.token().map(str::to_owned);
            let events = numbered(reader.drive(encoder).into_stream(), numbering, |e, id| {
                (e, id)
            });
            let mut resp = if mode == Mode::Ndjson {
                ndjson_response(events)
            } else {
                sse_response(events)
            };
            resume::token_header(&mut resp, token.as_deref());
            resp
        }
    }
}

/// The items of a stream as its caller is sent them: each numbered (`with` gives it its id,
/// `None` when the stream cannot be resumed), those a resuming caller had left out. Applied
/// after the encoder, so that what it emits, and so what counts as passed on, is the same
/// whether the caller resumes or not.
fn numbered<T, U>(
    items: impl Stream<Item = T>,
    mut numbering: Numbering,
    with: impl Fn(T, Option<String>) -> U,
) -> impl Stream<Item = U> {
    items.filter_map(move |item| {
        let sent = match numbering.step() {
            Step::Skip => None,
            Step::Send(id) => Some(with(item, id)),
        };
        std::future::ready(sent)
    })
}

/// Who is calling and what they ask: the caller's credential, the record in the body (and
/// whether the event protocol can answer it), and the body's size.
fn read_request<K: Routed>(
    inner: &Inner,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    decode: impl FnOnce(&Bytes) -> Result<K::Request, String>,
) -> Result<(Caller, K::Request, usize), Refused> {
    let caller = inner
        .config
        .auth
        .caller_of(headers)
        .ok_or(Refused::Unauthorized)?;
    let body = body.map_err(|r| Refused::body(&r))?;
    let request = decode(&body).map_err(Refused::Invalid)?;
    if let Some(why) = K::unanswerable(&request) {
        return Err(Refused::Invalid(why));
    }
    Ok((caller, request, body.len()))
}

/// A started stream's response: `items` as the body, sent as they come, of `content_type`,
/// with the headers that keep a proxy from holding them ([`no_buffering`]). Every dialect's
/// stream is answered by this once its first item is ready.
pub(crate) fn streamed<I: Into<Bytes> + 'static>(
    items: impl Stream<Item = I> + Send + 'static,
    content_type: &'static str,
) -> Response {
    let body = items.map(|item| Ok::<_, Infallible>(item.into()));
    let mut resp = Response::new(Body::from_stream(body));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    no_buffering(&mut resp);
    resp
}

/// Server-sent events' content type, as every SSE dialect answers it.
pub(crate) const SSE: &str = "text/event-stream; charset=utf-8";

/// Headers that keep a streamed answer from being held by a cache or a proxy.
pub(crate) fn no_buffering(resp: &mut Response) {
    let h = resp.headers_mut();
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, no-transform"),
    );
    // nginx and compatible proxies: pass each write through.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
}

/// Events, each with its id when the stream can be resumed (see [`crate::resume`]).
fn ndjson_response(
    events: impl Stream<Item = (Event, Option<String>)> + Send + 'static,
) -> Response {
    // NDJSON lines carry no id: a caller counts the lines it has.
    let body = Body::from_stream(events.map(|(e, _)| Ok::<_, Infallible>(e.to_line())));
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    no_buffering(&mut resp);
    resp
}

fn sse_response(events: impl Stream<Item = (Event, Option<String>)> + Send + 'static) -> Response {
    let events = events.map(|(e, id)| {
        let name = match e.kind {
            crate::events::EventType::Status => "status",
            crate::events::EventType::Token => "token",
            crate::events::EventType::Done => "done",
            crate::events::EventType::Error => "error",
        };
        let line = e.to_line();
        let data = String::from_utf8_lossy(&line[..line.len().saturating_sub(1)]).into_owned();
        let event = sse::Event::default().event(name).data(data);
        Ok::<_, Infallible>(match id {
            Some(id) => event.id(id),
            None => event,
        })
    });
    let mut resp = Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response();
    no_buffering(&mut resp);
    resp
}

/// Reads a non-streaming answer to its end: the final record, or an error.
async fn whole<K: Kind>(reader: Reader<K::Response, Report>) -> Response {
    match reader.last().await {
        Ok(r) => Json(r).into_response(),
        Err(f) => error_response(
            status_for(&f.error.kind),
            f.error.kind.as_str(),
            &f.error.message,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_type_has_a_fitting_status() {
        let status = |wire: &str| status_for(&ErrorKind::from_wire(wire));
        assert_eq!(status("invalid-request"), StatusCode::BAD_REQUEST);
        assert_eq!(status("too-many-requests"), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(status("timeout"), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(status("llm-error"), StatusCode::BAD_GATEWAY);
        assert_eq!(status("message-too-large"), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(status("from-the-future"), StatusCode::BAD_GATEWAY);
        assert_eq!(status(""), StatusCode::BAD_GATEWAY);
    }

    #[test]
    fn accept_picks_the_mode_and_else_the_bodys_flag() {
        let mut h = HeaderMap::new();
        assert_eq!(Ask::rest(&h, None).mode(false), Mode::Json);
        assert_eq!(
            Ask::rest(&h, None).mode(true),
            Mode::Records,
            "TrustGraph's streaming spec's SSE"
        );
        h.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        assert_eq!(Ask::rest(&h, None).mode(true), Mode::Records);
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/x-ndjson"),
        );
        assert_eq!(Ask::rest(&h, None).mode(false), Mode::Ndjson, "Accept wins");
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("text/event-stream"),
        );
        assert_eq!(
            Ask::rest(&h, None).mode(false),
            Mode::Sse,
            "SSE without the body's flag: the events"
        );
    }

    /// TrustGraph's streaming spec answers `streaming: true` with SSE records; an SSE client
    /// library sends `Accept: text/event-stream` by default, and must get the records too, on
    /// both of TrustGraph's routes. The event protocol's own route keeps its events.
    #[test]
    fn an_sse_accept_with_the_bodys_streaming_flag_gets_trustgraphs_records() {
        let mut h = HeaderMap::new();
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("text/event-stream"),
        );
        assert_eq!(Ask::rest(&h, None).mode(true), Mode::Records);
        assert_eq!(Ask::flow(&h, None).mode(true), Mode::Records);
        assert_eq!(Ask::flow(&h, None).mode(false), Mode::Sse);
        assert_eq!(
            Ask::flow(&HeaderMap::new(), None).mode(true),
            Mode::Json,
            "TrustGraph's REST form answers whole"
        );
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/x-ndjson"),
        );
        assert_eq!(Ask::rest(&h, None).mode(true), Mode::Ndjson);
        assert_eq!(Ask::flow(&h, None).mode(true), Mode::Ndjson);
    }

    #[tokio::test]
    async fn a_refusal_to_an_ndjson_caller_is_an_error_and_a_done_event() {
        let mut h = HeaderMap::new();
        h.insert(
            "traceparent",
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        let resp = refuse(
            Some(Mode::Ndjson),
            &h,
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "no token",
        );
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/x-ndjson");
        assert_eq!(resp.headers()[header::WWW_AUTHENTICATE], "Bearer");
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let lines: Vec<serde_json::Value> = std::str::from_utf8(&body)
            .unwrap()
            .split_terminator('\n')
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["type"], "error");
        assert_eq!(lines[0]["content"], "no token");
        assert_eq!(lines[0]["error_type"], "unauthorized");
        assert_eq!(lines[1]["type"], "done");
        assert_eq!(lines[1]["reason"], "error");
        for l in &lines {
            assert_eq!(l["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        }
        let json = refuse(None, &h, StatusCode::NOT_FOUND, "invalid-request", "no");
        assert_eq!(json.headers()[header::CONTENT_TYPE], "application/json");
    }
}
