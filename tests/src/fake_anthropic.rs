//! A fake Anthropic Messages server over real HTTP: Anthropic's `POST /v1/messages` (SSE named
//! events) and Vertex AI's
//! `POST /v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:{verb}`
//! (`streamRawPredict`: the same events; `rawPredict`: the whole message as JSON), scripted by
//! model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | message_start (25 in, 1 out), ping, a block of `Hello` ` there`, message_delta output 9, a repeated message_delta 15 and 15, message_stop; whole: `Hello there`, 20 in + 5 cache read, 15 out |
//! | `overloaded_once` | 529 `overloaded_error` on the first call, then `normal` |
//! | `rate_limited_once` | 429 on the first call, then `normal`: `rate_limit_error` with `retry-after: 0`; on Vertex, Google's `RESOURCE_EXHAUSTED` quota error (no header) |
//! | `unauthorized` | 401 `authentication_error`; on Vertex, Google's `UNAUTHENTICATED` |
//! | `forbidden` | 403 `permission_error`; on Vertex, Google's `PERMISSION_DENIED` |
//! | `invalid_request` | 400 `invalid_request_error` |
//! | `error_mid_stream` | message_start, `Hello`, then `event: error` overloaded_error |
//! | `malformed` | message_start, `Hello`, an event whose data is not JSON, ` there`, message_delta 15, message_stop |
//! | `hang` | message_start, `Hello`, then nothing more, ever (a call its client cancels: [`Fake::abandoned_streams`]) |
//! | `no_stop` | message_start, `Hello`, then the body ends without message_stop |
//! | `tools`, `tools-text` | tool use, with Anthropic's exact shapes: see [`tools`] |
//! | `json` | structured output as a model without a JSON mode gives it: a first answer fenced and off the schema (`{"label": "azure"}` in a ```json block), then, asked again (an assistant turn in the conversation), `{"label": "blue"}`; each 25 in, 15 out |
//! | `json-never` | prose, `The sky is blue.`, however often asked |
//!
//! Vertex errors that its front end raises (token, permission, quota) come in Google's shape;
//! those from the model (overloaded) in Anthropic's, as Vertex passes them on.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use crate::fake::{Calls, Fake, Step, scripted_body, tracked_body};

pub mod tools;

/// The fake Anthropic server.
pub type FakeAnthropic = Fake<AnthropicSeen>;

/// What the fake Anthropic server recorded.
#[derive(Default)]
pub struct AnthropicSeen {
    calls: Calls,
    headers: Vec<(Option<String>, Option<String>)>,
    bodies: Vec<Value>,
    vertex: Vec<VertexCall>,
    abandoned: Arc<std::sync::atomic::AtomicUsize>,
}

/// One call on Vertex AI's path, as the fake received it.
#[derive(Debug, Clone)]
pub struct VertexCall {
    /// The project in the path.
    pub project: String,
    /// The location in the path.
    pub location: String,
    /// The model in the path.
    pub model: String,
    /// `streamRawPredict` or `rawPredict`.
    pub verb: String,
    /// The `Authorization` header.
    pub authorization: Option<String>,
    /// The `x-api-key` header (Vertex wants none).
    pub api_key: Option<String>,
    /// The `anthropic-version` header (Vertex wants the version in the body).
    pub anthropic_version_header: Option<String>,
    /// The request body.
    pub body: Value,
}

impl Fake<AnthropicSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| {
            Router::new()
                .route("/v1/messages", post(messages))
                .route(
                    "/v1/projects/{project}/locations/{location}/publishers/anthropic/models/{call}",
                    post(vertex),
                )
                .with_state(seen)
        })
        .await
    }

    /// The last call on Vertex AI's path.
    pub fn last_vertex(&self) -> Option<VertexCall> {
        self.seen().vertex.last().cloned()
    }

    /// Calls received for `model`.
    pub fn calls(&self, model: &str) -> usize {
        self.seen().calls.get(model)
    }

    /// The body of the last call on Anthropic's path.
    pub fn last_body(&self) -> Value {
        self.seen().bodies.last().cloned().unwrap_or(Value::Null)
    }

    /// Streams whose client went away before their end (cancelled calls).
    pub fn abandoned_streams(&self) -> usize {
        self.seen()
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The last `(x-api-key, anthropic-version)` headers.
    pub fn last_headers(&self) -> (Option<String>, Option<String>) {
        self.seen().headers.last().cloned().unwrap_or((None, None))
    }
}

fn ev(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn start() -> String {
    ev(
        "message_start",
        json!({"type": "message_start", "message": {"id": "msg_1", "role": "assistant",
        "content": [], "usage": {"input_tokens": 25, "output_tokens": 1}}}),
    )
}

fn text(t: &str) -> String {
    ev(
        "content_block_delta",
        json!({"type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": t}}),
    )
}

fn out(n: u64, stop: Option<&str>) -> String {
    ev(
        "message_delta",
        json!({"type": "message_delta",
        "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": n}}),
    )
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    let mut r = (
        status,
        Json(
            json!({"type": "error", "error": {"type": kind, "message": message},
        "request_id": "req_1"}),
        ),
    )
        .into_response();
    if status == StatusCode::TOO_MANY_REQUESTS {
        r.headers_mut().insert("retry-after", "0".parse().unwrap());
    }
    r
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Google's error shape, which Vertex's front end answers with.
fn google_error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"code": status.as_u16(), "message": message, "status": code}})),
    )
        .into_response()
}

async fn messages(
    State(seen): State<Arc<Mutex<AnthropicSeen>>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let model = body["model"].as_str().unwrap_or("").to_owned();
    let call = {
        let mut s = seen.lock().unwrap();
        s.headers.push((
            header(&headers, "x-api-key"),
            header(&headers, "anthropic-version"),
        ));
        s.bodies.push(body.clone());
        s.calls.count(&model)
    };
    match (model.as_str(), call) {
        ("unauthorized", _) => {
            return error(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "invalid x-api-key",
            );
        }
        ("forbidden", _) => {
            return error(
                StatusCode::FORBIDDEN,
                "permission_error",
                "Your API key does not have permission to use the specified resource.",
            );
        }
        ("rate_limited_once", 1) => {
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "Number of requests has exceeded your rate limit",
            );
        }
        _ => {}
    }
    if tools::is_tools_model(&model) {
        return tools_answer(&model, &body, body["stream"] == true);
    }
    if model == "json" || model == "json-never" {
        let asked_again = body["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|t| t["role"] == "assistant"));
        let said = match (model.as_str(), asked_again) {
            ("json", false) => "```json\n{\"label\": \"azure\"}\n```",
            ("json", true) => "{\"label\": \"blue\"}",
            _ => "The sky is blue.",
        };
        return scripted_body(
            vec![Step::Send(
                [
                    start(),
                    text(said),
                    out(15, Some("end_turn")),
                    ev("message_stop", json!({"type": "message_stop"})),
                ]
                .concat(),
            )],
            "text/event-stream",
        );
    }
    let abandoned = seen.lock().unwrap().abandoned.clone();
    answer(&model, call, true, abandoned)
}

/// A tool-calling model's answer to `body`, streamed or whole.
fn tools_answer(model: &str, body: &Value, streaming: bool) -> Response {
    if let Some(message) = tools::refusal(body) {
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", &message);
    }
    if streaming {
        let steps = tools::streamed(model, body)
            .into_iter()
            .map(Step::Send)
            .collect();
        scripted_body(steps, "text/event-stream")
    } else {
        Json(tools::whole(model, body)).into_response()
    }
}

async fn vertex(
    State(seen): State<Arc<Mutex<AnthropicSeen>>>,
    Path((project, location, call)): Path<(String, String, String)>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    // axum cannot split one segment, so `{model}:{verb}` is split here.
    let (model, verb) = call.split_once(':').unwrap_or((&call, ""));
    let (model, verb) = (model.to_owned(), verb.to_owned());
    let n = {
        let mut s = seen.lock().unwrap();
        s.vertex.push(VertexCall {
            project,
            location,
            model: model.clone(),
            verb: verb.clone(),
            authorization: header(&headers, "authorization"),
            api_key: header(&headers, "x-api-key"),
            anthropic_version_header: header(&headers, "anthropic-version"),
            body: body.clone(),
        });
        s.calls.count(&model)
    };
    if tools::is_tools_model(&model) {
        return tools_answer(&model, &body, verb == "streamRawPredict");
    }
    let streaming = match verb.as_str() {
        "streamRawPredict" => true,
        "rawPredict" => false,
        _ => {
            return google_error(
                StatusCode::NOT_FOUND,
                "NOT_FOUND",
                "The requested URL was not found on this server.",
            );
        }
    };
    match (model.as_str(), n) {
        ("unauthorized", _) => {
            return google_error(
                StatusCode::UNAUTHORIZED,
                "UNAUTHENTICATED",
                "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential.",
            );
        }
        ("forbidden", _) => {
            return google_error(
                StatusCode::FORBIDDEN,
                "PERMISSION_DENIED",
                "Permission 'aiplatform.endpoints.predict' denied on resource (or it may not exist).",
            );
        }
        ("rate_limited_once", 1) => {
            return google_error(
                StatusCode::TOO_MANY_REQUESTS,
                "RESOURCE_EXHAUSTED",
                "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model with base model: anthropic-claude. Please submit a quota increase request.",
            );
        }
        _ => {}
    }
    let abandoned = seen.lock().unwrap().abandoned.clone();
    answer(&model, n, streaming, abandoned)
}

/// The scripted answer for call number `call` of `model`, as events or as one message.
fn answer(
    model: &str,
    call: usize,
    streaming: bool,
    abandoned: Arc<std::sync::atomic::AtomicUsize>,
) -> Response {
    if model == "invalid_request" {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "max_tokens: Field required",
        );
    }
    if (model, call) == ("overloaded_once", 1) {
        return error(
            StatusCode::from_u16(529).unwrap(),
            "overloaded_error",
            "Overloaded",
        );
    }
    if !streaming {
        return Json(
            json!({"id": "msg_1", "type": "message", "role": "assistant",
            "model": model, "content": [{"type": "text", "text": "Hello there"}],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 20, "cache_read_input_tokens": 5, "output_tokens": 15}}),
        )
        .into_response();
    }
    let steps = match model {
        "error_mid_stream" => vec![Step::Send(start()), Step::Send(text("Hello")),
            Step::Send(ev("error", json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})))],
        "no_stop" => vec![Step::Send(start()), Step::Send(text("Hello"))],
        "malformed" => vec![Step::Send([
            start(),
            text("Hello"),
            "event: content_block_delta\ndata: {\"type\": \"content_block_del\n\n".to_owned(),
            text(" there"),
            out(15, Some("end_turn")),
            ev("message_stop", json!({"type": "message_stop"})),
        ].concat())],
        "hang" => vec![Step::Send(start()), Step::Send(text("Hello")), Step::Hang],
        _ => vec![Step::Send([
            start(),
            ev("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
            ev("ping", json!({"type": "ping"})),
            text("Hello"),
            out(9, None),
            text(" there"),
            ev("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
            out(15, Some("end_turn")),
            out(15, Some("end_turn")),
            ev("message_stop", json!({"type": "message_stop"})),
        ].concat())],
    };
    tracked_body(steps, "text/event-stream", abandoned)
}
