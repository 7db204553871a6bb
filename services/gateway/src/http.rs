//! The REST routes: a whole answer as JSON, or a stream of gateway events as NDJSON or SSE
//! (docs/protocol.md#gateway-events-ndjson-and-sse).

use std::{collections::VecDeque, convert::Infallible, sync::Arc, time::Instant};

use axum::{
    Json,
    body::{Body, Bytes},
    extract::{Path, State, rejection::BytesRejection},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{
        IntoResponse, Response,
        sse::{self, KeepAlive, Sse},
    },
};
use futures::Stream;
use serde_json::json;
use sluice_runtime::{
    client::{RequestClient, RequestOptions},
    reader::{Piece, Reader},
    telemetry::ClientOutcome,
};
use sluice_schema::{Error, ErrorKind, ResponseRecord};

use crate::{
    Clients, Inner,
    events::{Event, Reason, Status},
    kinds::{Agent, Kind, Prompt, ServiceKind, StreamState, TextCompletion},
    reporting, server_span, trace_outcome,
};

/// A service kind the gateway holds a client for.
pub(crate) trait Routed: Kind {
    fn client(clients: &Clients) -> Option<&RequestClient<Self::Request, Self::Response>>;
}

impl Routed for TextCompletion {
    fn client(clients: &Clients) -> Option<&RequestClient<Self::Request, Self::Response>> {
        clients.text_completion.as_ref()
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

/// How the caller wants the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Json,
    Ndjson,
    Sse,
}

fn mode(headers: &HeaderMap) -> Mode {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if accept.contains("application/x-ndjson") {
        Mode::Ndjson
    } else if accept.contains("text/event-stream") {
        Mode::Sse
    } else {
        Mode::Json
    }
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
    if status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
}

fn counted(inner: &Inner, route: &str, resp: Response) -> Response {
    inner.metrics.request(route, resp.status().as_u16());
    resp
}

/// `POST /api/v1/{service}`.
pub(crate) async fn service(
    State(inner): State<Arc<Inner>>,
    Path(service): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mode = mode(&headers);
    dispatch(inner, &service, headers, body, mode).await
}

/// `POST /api/v1/flow/{flow}/service/{service}`: TrustGraph's REST, always a whole answer.
pub(crate) async fn flow_service(
    State(inner): State<Arc<Inner>>,
    Path((flow, service)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if flow != inner.config.flow {
        let message = format!(
            "unknown flow {flow:?}; this gateway serves flow {:?}",
            inner.config.flow
        );
        return counted(
            &inner,
            "flow",
            error_response(StatusCode::NOT_FOUND, "invalid-request", &message),
        );
    }
    dispatch(inner, &service, headers, body, Mode::Json).await
}

/// `GET /api/v1/models`: the models the text-completion processor serves, as the final
/// record of a `list-models` request (`{"models": [{"id": ...}], ...}`).
pub(crate) async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let body = Bytes::from_static(br#"{"operation":"list-models"}"#);
    dispatch(inner, "text-completion", headers, Ok(body), Mode::Json).await
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
    mode: Mode,
) -> Response {
    let Some(kind) = ServiceKind::from_name(service) else {
        let message =
            format!("unknown service {service:?}: expected text-completion, prompt or agent");
        return counted(
            &inner,
            "unknown",
            error_response(StatusCode::NOT_FOUND, "invalid-request", &message),
        );
    };
    match kind {
        ServiceKind::TextCompletion => handle::<TextCompletion>(inner, headers, body, mode).await,
        ServiceKind::Prompt => handle::<Prompt>(inner, headers, body, mode).await,
        ServiceKind::Agent => handle::<Agent>(inner, headers, body, mode).await,
    }
}

async fn handle<K: Routed>(
    inner: Arc<Inner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    mode: Mode,
) -> Response {
    let route = K::KIND.as_str();
    let started = Instant::now();
    if !inner.config.auth.accepts_headers(&headers) {
        let resp = error_response(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid `Authorization: Bearer <token>` header is required",
        );
        return counted(&inner, route, resp);
    }
    let body = match body {
        Ok(b) => b,
        Err(rejection) => {
            let status = rejection.status();
            let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
                format!(
                    "the request body is larger than the limit of {} bytes",
                    inner.config.body_limit
                )
            } else {
                rejection.body_text()
            };
            let kind = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "message-too-large"
            } else {
                "invalid-request"
            };
            return counted(&inner, route, error_response(status, kind, &message));
        }
    };
    // The field and the expected type, never a value: the body may hold a prompt.
    let mut request: K::Request = match sluice_schema::decode(&body) {
        Ok(r) => r,
        Err(e) => {
            return counted(
                &inner,
                route,
                error_response(StatusCode::BAD_REQUEST, "invalid-request", &e.to_string()),
            );
        }
    };
    let Some(client) = K::client(&inner.clients) else {
        let message = format!("the {route} service is not enabled on this gateway");
        return counted(
            &inner,
            route,
            error_response(StatusCode::NOT_FOUND, "no-configuration", &message),
        );
    };
    K::set_streaming(&mut request, mode != Mode::Json);
    let incoming = headers.get("traceparent").and_then(|v| v.to_str().ok());
    let span = server_span(route, incoming);
    let tp = span.traceparent();
    let trace_id = span.context().trace_id();
    let session_id = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| K::session_id(&request))
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let options = RequestOptions {
        traceparent: Some(tp),
        ..RequestOptions::default()
    };
    let reader = match client.read(&request, options, reporting()).await {
        Ok(r) => r,
        Err(f) => {
            let err = f.error;
            return counted(
                &inner,
                route,
                error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    err.kind.as_str(),
                    &err.message,
                ),
            );
        }
    };
    match mode {
        Mode::Json => {
            let mut span = span;
            let resp = whole::<K>(reader).await;
            if !resp.status().is_success() {
                span.fail(resp.status().as_str().to_owned());
            }
            span.end();
            counted(&inner, route, resp)
        }
        Mode::Ndjson | Mode::Sse => {
            inner.metrics.request(route, 200);
            let events = EventStream::<K> {
                reader: Some(reader),
                state: StreamState::default(),
                pending: VecDeque::from([Event::status(Status::Thinking)]),
                trace_id: Arc::from(trace_id),
                session_id: Arc::from(session_id),
                started,
                first_sent: false,
                outcome: None,
                inner: inner.clone(),
                span,
            };
            inner.metrics.open_streams(route, 1);
            let events = futures::stream::unfold(events, |mut s| async move {
                s.next_event().await.map(|e| (e, s))
            });
            if mode == Mode::Ndjson {
                ndjson_response(events)
            } else {
                sse_response(events)
            }
        }
    }
}

fn no_buffering(resp: &mut Response) {
    let h = resp.headers_mut();
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, no-transform"),
    );
    // nginx and compatible proxies: pass each write through.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
}

fn ndjson_response(events: impl Stream<Item = Event> + Send + 'static) -> Response {
    use futures::StreamExt;
    let body = Body::from_stream(events.map(|e| Ok::<_, Infallible>(e.to_line())));
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    no_buffering(&mut resp);
    resp
}

fn sse_response(events: impl Stream<Item = Event> + Send + 'static) -> Response {
    use futures::StreamExt;
    let events = events.map(|e| {
        let name = match e.kind {
            crate::events::EventType::Status => "status",
            crate::events::EventType::Token => "token",
            crate::events::EventType::Done => "done",
            crate::events::EventType::Error => "error",
        };
        let line = e.to_line();
        let data = String::from_utf8_lossy(&line[..line.len().saturating_sub(1)]).into_owned();
        Ok::<_, Infallible>(sse::Event::default().event(name).data(data))
    });
    let mut resp = Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response();
    no_buffering(&mut resp);
    resp
}

/// Reads a non-streaming answer to its end: the final record, or an error.
async fn whole<K: Kind>(reader: Reader<K::Response>) -> Response {
    match reader.last().await {
        Ok(r) => Json(r).into_response(),
        Err(f) => error_response(
            status_for(&f.error.kind),
            f.error.kind.as_str(),
            &f.error.message,
        ),
    }
}

/// The state of one streamed answer: records in, gateway events out
/// (docs/protocol.md#gateway-events-ndjson-and-sse).
struct EventStream<K: Kind> {
    reader: Option<Reader<K::Response>>,
    state: StreamState,
    pending: VecDeque<Event>,
    trace_id: Arc<str>,
    session_id: Arc<str>,
    started: Instant,
    first_sent: bool,
    outcome: Option<ClientOutcome>,
    inner: Arc<Inner>,
    /// Ends when the stream is dropped: at its end, or when the caller goes away.
    span: sluice_runtime::trace::Span,
}

impl<K: Kind> EventStream<K> {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(mut e) = self.pending.pop_front() {
                e.trace_id = self.trace_id.clone();
                e.session_id = self.session_id.clone();
                if !self.first_sent && e.kind != crate::events::EventType::Status {
                    self.first_sent = true;
                    self.inner
                        .metrics
                        .first_event(K::KIND.as_str(), self.started.elapsed().as_secs_f64());
                }
                return Some(e);
            }
            let reader = self.reader.as_mut()?;
            match reader.next().await {
                Some(Piece::Record(r)) => {
                    K::note(&r, &mut self.state);
                    let mut out = Vec::new();
                    K::events(&r, &mut self.state, &mut out);
                    self.pending.extend(out);
                    if r.is_terminal() {
                        self.end(Reason::Success, ClientOutcome::Success);
                    }
                }
                Some(Piece::Failed(f)) => {
                    if let Some(r) = &f.record {
                        K::note(r, &mut self.state);
                    }
                    self.fail(f.error);
                }
                Some(Piece::Restarted) => {
                    // Another replica starts the answer over; the caller discards what it has.
                    self.state = StreamState::default();
                    self.pending.push_back(Event::status(Status::Restarted));
                }
                None => {
                    if self.outcome.is_none() {
                        self.fail(Error::new(
                            ErrorKind::Gateway,
                            "the answer ended without a final record",
                        ));
                    }
                    self.reader = None;
                }
            }
        }
    }

    fn fail(&mut self, err: Error) {
        let outcome = ClientOutcome::of_error(&err.kind);
        let reason = match outcome {
            ClientOutcome::Cancelled => Reason::Cancelled,
            _ => Reason::Error,
        };
        self.pending.push_back(Event::error(&err));
        self.end(reason, outcome);
    }

    fn end(&mut self, reason: Reason, outcome: ClientOutcome) {
        let state = std::mem::take(&mut self.state);
        let mut done = Event::done(reason, state.usage, state.model);
        if let Some((objects, skipped)) = state.counts {
            done.objects_emitted = Some(objects);
            done.lines_skipped = Some(skipped);
        }
        self.pending.push_back(done);
        self.outcome = Some(outcome);
        self.reader = None;
    }
}

impl<K: Kind> Drop for EventStream<K> {
    fn drop(&mut self) {
        let route = K::KIND.as_str();
        self.inner.metrics.open_streams(route, -1);
        // Dropped before its end: the caller went away. The response stream's own drop
        // publishes the cancel.
        let outcome = match self.outcome {
            Some(o) if self.pending.is_empty() => o,
            _ => ClientOutcome::Cancelled,
        };
        self.inner.metrics.stream_ended(route, outcome);
        trace_outcome(&mut self.span, outcome);
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
    fn accept_picks_the_mode() {
        let mut h = HeaderMap::new();
        assert_eq!(mode(&h), Mode::Json);
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/x-ndjson"),
        );
        assert_eq!(mode(&h), Mode::Ndjson);
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("text/event-stream"),
        );
        assert_eq!(mode(&h), Mode::Sse);
    }
}
