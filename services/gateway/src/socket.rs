//! TrustGraph's WebSocket protocol on `/api/v1/socket`: a first `auth` frame, then any number
//! of concurrent requests multiplexed by the client's ids, each answered by response frames
//! with a `complete` flag. Closing the socket cancels everything still running on it.
//!
//! Where credentials are required, a socket that has not authenticated within the gateway's
//! `socket_auth_window`, or has failed to [`SOCKET_AUTH_FAILURES`] times, is closed (code
//! 1008, policy violation): an open socket holds a task and a connection, and guessing keys
//! on one must cost a new connection per few guesses. Each socket runs at most
//! `socket_max_requests` requests at once; more are refused, each with an error frame.

use std::{collections::HashMap, sync::Arc, time::Instant};

use axum::{
    extract::{
        State, WebSocketUpgrade,
        ws::{CloseFrame, Message, WebSocket, close_code},
    },
    http::HeaderMap,
    response::Response,
};
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;
use sluice_schema::{Error, ErrorKind};
use tokio::{sync::mpsc, task::JoinSet};
use tracing::debug;

use crate::{
    Inner, SOCKET_AUTH_FAILURES,
    auth::Caller,
    encode::{
        Tally,
        frames::{Frames, error_frame},
    },
    http::Routed,
    kinds::{Agent, Prompt, ServiceKind, TextCompletion},
    preamble::{self, Call, Started, labelled},
    reporting, server_span,
};

/// Frames waiting for the socket; a slow reader slows its requests down rather than
/// growing memory.
const OUTBOUND_FRAMES: usize = 256;
/// The route label of WebSocket traffic in the gateway's metrics.
pub(crate) const ROUTE: &str = "socket";

/// `GET /api/v1/socket`.
pub(crate) async fn upgrade(State(inner): State<Arc<Inner>>, ws: WebSocketUpgrade) -> Response {
    let limit = inner.config.body_limit;
    let resp = ws
        .max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |socket| run(inner, socket));
    labelled(ROUTE, resp)
}

async fn run(inner: Arc<Inner>, mut socket: WebSocket) {
    let (out_tx, mut out_rx) = mpsc::channel::<String>(OUTBOUND_FRAMES);
    let mut tasks: JoinSet<String> = JoinSet::new();
    let mut active: HashMap<String, tokio::task::AbortHandle> = HashMap::new();
    // The credential this socket authenticated with (`Some(None)` when nothing is
    // required). Kept, not the key it named: each request is checked against the keys as
    // they are then, so a key revoked meanwhile stops working on open sockets too.
    let mut authed: Option<Option<Secret>> =
        inner.config.auth.caller(None).is_some().then_some(None);
    let mut auth_failures = 0;
    // Until the socket first authenticates (never, when nothing is required).
    let auth_deadline = tokio::time::sleep(inner.config.socket_auth_window);
    tokio::pin!(auth_deadline);
    let mut awaiting_auth = authed.is_none();
    loop {
        tokio::select! {
            () = &mut auth_deadline, if awaiting_auth => {
                inner.metrics.refusal("socket-auth");
                close(&mut socket, "not authenticated in time").await;
                break;
            }
            msg = socket.recv() => {
                let text = match msg {
                    Some(Ok(Message::Text(t))) => t,
                    Some(Ok(Message::Binary(_))) => {
                        inner.metrics.socket_frame("invalid");
                        let err = Error::new(ErrorKind::InvalidRequest, "binary frames are not supported; send JSON text frames");
                        if socket.send(Message::Text(error_frame(None, &err).into())).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                };
                let reply = frame(&inner, text.as_str(), &mut authed, &mut auth_failures, &mut tasks, &mut active, &out_tx);
                if authed.is_some() {
                    awaiting_auth = false;
                }
                if let Some(reply) = reply
                    && socket.send(Message::Text(reply.into())).await.is_err()
                {
                    break;
                }
                if auth_failures >= SOCKET_AUTH_FAILURES {
                    inner.metrics.refusal("socket-auth");
                    close(&mut socket, "too many failed authentications").await;
                    break;
                }
            }
            Some(out) = out_rx.recv() => {
                if socket.send(Message::Text(out.into())).await.is_err() {
                    break;
                }
            }
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                if let Ok(id) = done {
                    active.remove(&id);
                }
            }
        }
    }
    // Dropping the tasks drops their response streams, which cancels the requests.
    debug!(open = tasks.len(), "socket closed");
    tasks.abort_all();
}

/// Closes `socket` for a policy violation, saying why.
async fn close(socket: &mut WebSocket, reason: &'static str) {
    let frame = CloseFrame {
        code: close_code::POLICY,
        reason: reason.into(),
    };
    let _ = socket.send(Message::Close(Some(frame))).await;
}

/// What a text frame of the WebSocket asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum SocketFrame {
    /// `{"type": "auth", "token": ...}`.
    Auth {
        /// The token, if the frame has a string one.
        token: Option<String>,
    },
    /// A request to one of the services, under the client's id.
    Request {
        /// The client's id for the request (its response frames carry it).
        id: String,
        /// The service.
        kind: ServiceKind,
        /// The request record, decoded later as the service's request type.
        request: Value,
    },
}

/// Why a frame was refused, with the frame's id when it had one.
#[derive(Debug, Clone, PartialEq)]
pub struct FrameRefusal {
    /// The frame's `id`, when it had a string one.
    pub id: Option<String>,
    /// What was wrong, for the client.
    pub message: String,
}

/// Reads one text frame of a socket of the gateway serving `flow` of `workspace`. Pure: the
/// caller checks what depends on the socket's state (authentication, ids in flight).
pub fn read_frame(text: &str, flow: &str, workspace: &str) -> Result<SocketFrame, FrameRefusal> {
    let refuse = |id: Option<&str>, message: String| FrameRefusal {
        id: id.map(str::to_owned),
        message,
    };
    let Ok(Value::Object(mut frame)) = serde_json::from_str::<Value>(text) else {
        return Err(refuse(None, "the frame is not a JSON object".into()));
    };
    if frame.get("type").and_then(Value::as_str) == Some("auth") {
        let token = frame
            .get("token")
            .and_then(Value::as_str)
            .map(str::to_owned);
        return Ok(SocketFrame::Auth { token });
    }
    let Some(id) = frame.get("id").and_then(Value::as_str).map(str::to_owned) else {
        return Err(refuse(None, "a request frame needs a string `id`".into()));
    };
    if let Some(other) = frame.get("flow").and_then(Value::as_str)
        && other != flow
    {
        return Err(refuse(
            Some(&id),
            format!("unknown flow {other:?}; this gateway serves flow {flow:?}"),
        ));
    }
    // TrustGraph 2.x's clients name their workspace on every frame; a gateway serves one
    // (its flows' topics are that workspace's), so a frame for another is refused rather
    // than answered from the wrong workspace's flow.
    if let Some(other) = frame.get("workspace").and_then(Value::as_str)
        && other != workspace
    {
        return Err(refuse(
            Some(&id),
            format!("unknown workspace {other:?}; this gateway serves workspace {workspace:?}"),
        ));
    }
    let service = frame.get("service").and_then(Value::as_str).unwrap_or("");
    let Some(kind) = ServiceKind::from_name(service) else {
        return Err(refuse(
            Some(&id),
            format!("unknown service {service:?}: expected text-completion, prompt or agent"),
        ));
    };
    let Some(request) = frame.remove("request") else {
        return Err(refuse(
            Some(&id),
            "a request frame needs a `request` object".into(),
        ));
    };
    Ok(SocketFrame::Request { id, kind, request })
}

/// Handles one text frame; returns a frame to send at once, if any.
fn frame(
    inner: &Arc<Inner>,
    text: &str,
    authed: &mut Option<Option<Secret>>,
    auth_failures: &mut u32,
    tasks: &mut JoinSet<String>,
    active: &mut HashMap<String, tokio::task::AbortHandle>,
    out: &mpsc::Sender<String>,
) -> Option<String> {
    let reject = |id: Option<&str>, message: &str| {
        inner.metrics.socket_frame("invalid");
        Some(error_frame(
            id,
            &Error::new(ErrorKind::InvalidRequest, message.to_owned()),
        ))
    };
    const NOT_AUTHENTICATED: &str =
        "not authenticated: send {\"type\":\"auth\",\"token\":...} first";
    let (id, kind, request) = match read_frame(text, &inner.config.flow, &inner.config.workspace) {
        Ok(SocketFrame::Auth { token }) => {
            inner.metrics.socket_frame("auth");
            // The socket stays open after a failure: the client may try again.
            let accepted = inner.config.auth.caller(token.as_deref()).is_some();
            *authed = accepted.then(|| token.map(Secret::new));
            if !accepted {
                *auth_failures += 1;
            }
            return Some(if accepted {
                json!({ "type": "auth-ok", "default_workspace": inner.config.workspace })
                    .to_string()
            } else {
                json!({ "type": "auth-failed", "error": "auth failure" }).to_string()
            });
        }
        // Before authentication, a frame with an id learns only that: nothing about flows
        // or services.
        Ok(SocketFrame::Request { id, .. }) | Err(FrameRefusal { id: Some(id), .. })
            if authed.is_none() =>
        {
            return reject(Some(&id), NOT_AUTHENTICATED);
        }
        Err(refusal) => return reject(refusal.id.as_deref(), &refusal.message),
        Ok(SocketFrame::Request { id, kind, request }) => (id, kind, request),
    };
    let token = authed.as_ref().and_then(|t| t.as_ref().map(Secret::expose));
    let Some(caller) = inner.config.auth.caller(token) else {
        *authed = None;
        return reject(
            Some(&id),
            "the credential this socket authenticated with is no longer accepted (a revoked API key): authenticate again",
        );
    };
    if active.contains_key(&id) {
        return reject(
            Some(&id),
            &format!("request id {id:?} is already in flight on this socket"),
        );
    }
    if active.len() >= inner.config.socket_max_requests {
        inner.metrics.socket_frame("invalid");
        let err = Error::new(
            ErrorKind::TooManyRequests,
            format!(
                "{} requests are already running on this socket, its limit; wait for one to complete",
                active.len()
            ),
        );
        return Some(error_frame(Some(&id), &err));
    }
    inner.metrics.socket_frame("request");
    let handle = match kind {
        ServiceKind::TextCompletion => tasks.spawn(serve::<TextCompletion>(
            inner.clone(),
            id.clone(),
            request,
            caller,
            out.clone(),
        )),
        ServiceKind::Prompt => tasks.spawn(serve::<Prompt>(
            inner.clone(),
            id.clone(),
            request,
            caller,
            out.clone(),
        )),
        ServiceKind::Agent => tasks.spawn(serve::<Agent>(
            inner.clone(),
            id.clone(),
            request,
            caller,
            out.clone(),
        )),
    };
    active.insert(id, handle);
    None
}

/// Runs one request of a socket; returns its id when done.
async fn serve<K: Routed>(
    inner: Arc<Inner>,
    id: String,
    request: Value,
    caller: Caller,
    mut out: mpsc::Sender<String>,
) -> String {
    let started = Instant::now();
    // The request's size as JSON: what its input's tokens are estimated from.
    let body_bytes = request.to_string().len();
    let request: K::Request = match sluice_schema::decode_value(request) {
        Ok(r) => r,
        Err(e) => {
            let err = Error::new(ErrorKind::InvalidRequest, e.to_string());
            let _ = out.send(error_frame(Some(&id), &err)).await;
            return id;
        }
    };
    let call = Call::<K, _> {
        inner: &inner,
        headers: &HeaderMap::new(),
        caller: &caller,
        request: &request,
        body_bytes,
        route: ROUTE,
        span: server_span(K::KIND.as_str(), None),
        token_trace: None,
        policy: reporting(),
        resumable_route: false,
    };
    let Started { reader, span, .. } = match preamble::start(call).await {
        Ok(s) => s,
        Err(refused) => {
            let _ = out
                .send(error_frame(Some(&id), &refused.into_error()))
                .await;
            return id;
        }
    };
    let tally = Tally::opened(inner.clone(), ROUTE, started, span);
    // The frames go to the socket's queue until the answer ends; a queue gone (the socket
    // closed) ends the run, and the dropped reader sends the cancel.
    let _ = reader
        .drive(Frames::<K>::new(id.clone(), tally))
        .send_to(&mut out)
        .await;
    id
}

#[cfg(test)]
mod tests;
