//! What every request of a service does between its decoded body and its first answer
//! piece, written once for the REST routes, OpenAI's dialect and TrustGraph's WebSocket:
//! the service's client, the resume it asks for, its key's permission and limits, its id and
//! trace context, and the request sent. A route is then decode -> [`start`] -> encode.
//!
//! A request refused on the way is a [`Refused`], which each front end turns into its own
//! error shape once ([`Refused::rest`], [`Refused::openai`], [`Refused::into_error`] for a
//! WebSocket frame), so an early exit is `?` or one `map_err`, never a response built at the
//! exit. The request metric is counted by one layer on the router from the route label a
//! handler puts on its response ([`labelled`], [`count_requests`]), not at every exit.

use std::sync::Arc;

use axum::{
    extract::{Request, State},
    http::{HeaderMap, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use sluice_runtime::{
    bus::Position,
    client::RequestOptions,
    reader::{ReadPolicy, Reader},
    trace,
};
use sluice_schema::{Error, ErrorKind};

use crate::{
    Inner, Refusal,
    auth::Caller,
    http::{self, Mode, Routed},
    openai::ApiError,
    resume::{self, Numbering, Resume, Token},
};

/// The route a response answered, for `sluice_gateway_requests_total{route}`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RouteLabel(pub &'static str);

/// Puts `route`'s label on `resp`: the request layer counts it under that route.
pub(crate) fn labelled(route: &'static str, mut resp: Response) -> Response {
    resp.extensions_mut().insert(RouteLabel(route));
    resp
}

/// The layer that counts every labelled response by its route and status, when the response
/// starts (a stream's status is its 200, sent before its first event).
pub(crate) async fn count_requests(
    State(inner): State<Arc<Inner>>,
    req: Request,
    next: Next,
) -> Response {
    let resp = next.run(req).await;
    if let Some(RouteLabel(route)) = resp.extensions().get::<RouteLabel>() {
        inner.metrics.request(route, resp.status().as_u16());
    }
    resp
}

/// Why a request is refused before its answer starts.
pub(crate) enum Refused {
    /// No accepted credential: 401.
    Unauthorized,
    /// The body could not be read (`status` 413: over the limit), with the reader's text.
    Body { status: StatusCode, text: String },
    /// The body is not the service's request: 400, with what is wrong (never a value).
    Invalid(String),
    /// The service is not enabled on this gateway: 404.
    NotEnabled(&'static str),
    /// The resume asked for cannot be served: its status, error type and message.
    Resume(resume::Refusal),
    /// The caller's key may not make it (403), or is over a limit (429).
    Key(Refusal),
    /// The request could not be sent: 503, with the error.
    Unsent(Error),
}

impl Refused {
    /// The refusal of a body the server could not read.
    pub(crate) fn body(rejection: &axum::extract::rejection::BytesRejection) -> Self {
        Refused::Body {
            status: rejection.status(),
            text: rejection.body_text(),
        }
    }

    /// The gateway's own shape: JSON `{"error": ...}`, or `error` and `done` events for a
    /// caller that asked for NDJSON (`mode`), with `Retry-After` when waiting helps.
    pub(crate) fn rest(self, inner: &Inner, mode: Option<Mode>, headers: &HeaderMap) -> Response {
        let (status, kind, message): (StatusCode, String, String) = match self {
            Refused::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized".into(),
                "a valid `Authorization: Bearer <token>` header is required".into(),
            ),
            Refused::Body { status, .. } if status == StatusCode::PAYLOAD_TOO_LARGE => (
                status,
                "message-too-large".into(),
                format!(
                    "the request body is larger than the limit of {} bytes",
                    inner.config.body_limit
                ),
            ),
            Refused::Body { status, text } => (status, "invalid-request".into(), text),
            Refused::Invalid(why) => (StatusCode::BAD_REQUEST, "invalid-request".into(), why),
            Refused::NotEnabled(route) => (
                StatusCode::NOT_FOUND,
                "no-configuration".into(),
                format!("the {route} service is not enabled on this gateway"),
            ),
            Refused::Resume((status, kind, message)) => (status, kind.into(), message),
            Refused::Key(refusal) => return http::refused(mode, headers, refusal),
            Refused::Unsent(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                e.kind.as_str().to_owned(),
                e.message,
            ),
        };
        http::refuse(mode, headers, status, &kind, &message)
    }

    /// OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`).
    pub(crate) fn openai(self, inner: &Inner) -> Response {
        match self {
            Refused::Unauthorized => ApiError::unauthorized().into_response(),
            Refused::Body { status, text } => {
                ApiError::body_rejected(inner, status, text).into_response()
            }
            Refused::Invalid(why) => ApiError::invalid(why, None, None).into_response(),
            Refused::NotEnabled(_) => ApiError::not_enabled().into_response(),
            Refused::Resume((status, code, message)) => {
                ApiError::refusal(status, &message, code).into_response()
            }
            Refused::Key(refusal) => ApiError::refused(refusal),
            Refused::Unsent(e) => {
                let mut err = ApiError::from_error(&e);
                err.status = StatusCode::SERVICE_UNAVAILABLE;
                err.into_response()
            }
        }
    }

    /// The error record a WebSocket frame carries.
    pub(crate) fn into_error(self) -> Error {
        match self {
            Refused::Unauthorized => {
                Error::new(ErrorKind::from_wire("unauthorized"), "not authenticated")
            }
            Refused::Body { text, .. } | Refused::Invalid(text) => {
                Error::new(ErrorKind::InvalidRequest, text)
            }
            Refused::NotEnabled(route) => Error::new(
                ErrorKind::NoConfiguration,
                format!("the {route} service is not enabled on this gateway"),
            ),
            Refused::Resume((_, kind, message)) => Error::new(ErrorKind::from_wire(kind), message),
            Refused::Key(Refusal::Forbidden(why)) => Error::new(ErrorKind::InvalidRequest, why),
            Refused::Key(Refusal::Limited(l)) => {
                let mut message = l.message;
                if let Some(secs) = l.retry_after {
                    message.push_str(&format!("; retry after {secs} s"));
                }
                Error::new(ErrorKind::TooManyRequests, message)
            }
            Refused::Unsent(e) => e,
        }
    }
}

/// What a route hands [`start`]: the decoded request and how to send and read it.
pub(crate) struct Call<'a, K: Routed, P> {
    pub inner: &'a Arc<Inner>,
    /// The request's headers (its resume, its `traceparent`, ...); empty for a WebSocket
    /// frame.
    pub headers: &'a HeaderMap,
    pub caller: &'a Caller,
    /// The request record, its `streaming` flag set as the caller will be answered.
    pub request: &'a K::Request,
    /// The size of the body it was read from: its input's estimate against token limits.
    pub body_bytes: usize,
    /// The route's label: its resume tokens and resume metrics.
    pub route: &'static str,
    /// The route's server span (its context goes on the bus).
    pub span: trace::Span,
    /// The trace id a resume token carries for the events it rebuilds (the event protocol's
    /// `trace_id`), or `None` for a route whose answers carry none (OpenAI's chunks).
    pub token_trace: Option<String>,
    /// How the answer is read: its restart policy, by the type its encoder needs.
    pub policy: ReadPolicy<P>,
    /// Whether a stream of this route can be resumed at all (the WebSocket's cannot).
    pub resumable_route: bool,
}

/// A request admitted and sent: its answer's reader and what the encoders need.
pub(crate) struct Started<R, P> {
    pub reader: Reader<R, P>,
    pub span: trace::Span,
    /// The request's correlation id (a resumed stream's original one).
    pub request_id: String,
    /// The resume served, if the request was one.
    pub resume: Option<Resume>,
    /// Each event's id and what a resuming caller already had.
    pub numbering: Numbering,
}

/// Sends `call`'s request once it may be: the service's client, the resume it asks for,
/// its key's permission and limits (a resume is checked for permission only: it was
/// admitted when it started), then the request on the bus. The admission's reservation is
/// settled by the reader's meter, whichever way the answer ends.
pub(crate) async fn start<K: Routed, P>(
    call: Call<'_, K, P>,
) -> Result<Started<K::Response, P>, Refused> {
    let Call {
        inner,
        headers,
        caller,
        request,
        body_bytes,
        route,
        mut span,
        token_trace,
        policy,
        resumable_route,
    } = call;
    let Some(client) = K::client(&inner.clients) else {
        return Err(Refused::NotEnabled(K::KIND.as_str()));
    };
    let resumable = resumable_route && client.resumable();
    let resume = if resumable_route {
        resume::checked(inner, headers, route, client.resumable(), caller)
            .map_err(Refused::Resume)?
    } else {
        None
    };
    // A resumed stream's key must still be allowed to read it, and it counts against the
    // key's limits (no tokens: they were counted when it started). Asking which models are
    // served is not limited.
    let admission = if resume.is_some() {
        inner.admit_resume(caller, K::KIND, K::model(request))
    } else if !K::calls_a_model(request) {
        inner
            .permitted(caller, K::KIND, K::model(request))
            .map(|()| None)
    } else {
        inner.admit(
            caller,
            K::KIND,
            K::model(request),
            K::max_tokens(request),
            body_bytes,
        )
    }
    .map_err(Refused::Key)?;
    let request_id = match &resume {
        Some(r) => r.token.id.clone(),
        None => uuid::Uuid::new_v4().to_string(),
    };
    let options = RequestOptions {
        id: Some(request_id.clone()),
        traceparent: Some(span.traceparent()),
        key: caller.key().map(|k| k.name.to_string()),
        ..RequestOptions::default()
    };
    let read = match &resume {
        Some(r) => {
            client
                .resume_read(&r.token.id, r.token.after, options, policy)
                .await
        }
        None => client.read(request, options, policy).await,
    };
    let mut reader = match read {
        Ok(r) => r,
        Err(f) => {
            span.fail("503");
            return Err(Refused::Unsent(f.error));
        }
    };
    if let Some(a) = admission {
        reader.meter(Box::new(a));
    }
    let numbering = match &resume {
        Some(r) => Numbering::resumed(r),
        None if resumable && resume::offered(inner, true) => {
            let after: Option<Position> = reader.resume_after();
            let trace = token_trace.unwrap_or_default();
            Numbering::new(
                inner,
                caller,
                &Token::new(route, reader.id(), after, &trace),
            )
        }
        None => Numbering::none(),
    };
    Ok(Started {
        reader,
        span,
        request_id,
        resume,
        numbering,
    })
}
