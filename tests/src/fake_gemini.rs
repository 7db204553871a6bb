//! A fake Gemini server (AI Studio's `/v1beta/models/{model}:streamGenerateContent?alt=sse`
//! with `x-goog-api-key`, and Vertex AI's
//! `/v1/projects/{project}/locations/{location}/publishers/google/models/{model}:...` with a
//! bearer token) over real HTTP, scripted by model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | `The` (snapshot 9 in), ` sky is blue.` with `finishReason: STOP` (6 candidates + 25 thoughts), connection closes |
//! | `rate_limited_once` | 429 `RESOURCE_EXHAUSTED` with `RetryInfo.retryDelay: 0.1s` on the first call, then `normal` |
//! | `bad_key` | 400 `INVALID_ARGUMENT` with reason `API_KEY_INVALID` |
//! | `unauthorized` | 401 `UNAUTHENTICATED` (Vertex's answer to a bad token) |
//! | `invalid_argument` | 400 `INVALID_ARGUMENT` (a request the model refuses) |
//! | `server_error_once` | 500 `INTERNAL` on the first call, then `normal` |
//! | `malformed` | `The`, an event whose data is not JSON, then `normal`'s last event |
//! | `hang` | `The`, then nothing more, ever (a call its client cancels: [`Fake::abandoned_streams`]) |
//! | `blocked` | 200 with `promptFeedback.blockReason: SAFETY` and no candidates |
//! | `no_finish` | `The`, then the connection closes without a `finishReason` |
//! | `tools` | function calling, with Gemini's exact shapes: see [`tools`] |
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

/// The fake Gemini server.
pub type FakeGemini = Fake<GeminiSeen>;

/// What the fake Gemini server recorded.
#[derive(Default)]
pub struct GeminiSeen {
    calls: Calls,
    keys: Vec<Option<String>>,
    bodies: Vec<Value>,
    /// Vertex calls: the project, the location and the `Authorization` header.
    vertex: Vec<(String, String, Option<String>)>,
    abandoned: Arc<std::sync::atomic::AtomicUsize>,
}

impl Fake<GeminiSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| {
            Router::new()
                .route("/v1beta/models/{call}", post(generate))
                .route(
                    "/v1/projects/{project}/locations/{location}/publishers/google/models/{call}",
                    post(generate_vertex),
                )
                .with_state(seen)
        })
        .await
    }

    /// Calls received for `model`.
    pub fn calls(&self, model: &str) -> usize {
        self.seen().calls.get(model)
    }

    /// The body of the last call.
    pub fn last_body(&self) -> Value {
        self.seen().bodies.last().cloned().unwrap_or(Value::Null)
    }

    /// Streams whose client went away before their end (cancelled calls).
    pub fn abandoned_streams(&self) -> usize {
        self.seen()
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The last `x-goog-api-key` header.
    pub fn last_key(&self) -> Option<String> {
        self.seen().keys.last().cloned().flatten()
    }

    /// The last Vertex call's project, location and `Authorization` header.
    pub fn last_vertex(&self) -> Option<(String, String, Option<String>)> {
        self.seen().vertex.last().cloned()
    }
}

fn data(v: Value) -> String {
    format!("data: {v}\n\n")
}

fn first() -> String {
    data(
        json!({"candidates": [{"content": {"parts": [{"text": "The"}], "role": "model"}, "index": 0}],
        "usageMetadata": {"promptTokenCount": 9, "totalTokenCount": 9}}),
    )
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn generate(
    State(seen): State<Arc<Mutex<GeminiSeen>>>,
    Path(call): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    {
        let mut s = seen.lock().unwrap();
        s.keys.push(header(&headers, "x-goog-api-key"));
        s.bodies.push(body.clone());
    }
    answer(&seen, &call, &body)
}

async fn generate_vertex(
    State(seen): State<Arc<Mutex<GeminiSeen>>>,
    Path((project, location, call)): Path<(String, String, String)>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    {
        let mut s = seen.lock().unwrap();
        s.keys.push(header(&headers, "x-goog-api-key"));
        s.bodies.push(body.clone());
        s.vertex
            .push((project, location, header(&headers, "authorization")));
    }
    answer(&seen, &call, &body)
}

/// The scripted answer to `call` (`{model}:streamGenerateContent`).
fn answer(seen: &Mutex<GeminiSeen>, call: &str, body: &Value) -> Response {
    let model = call.split(':').next().unwrap_or("").to_owned();
    let n = seen.lock().unwrap().calls.count(&model);
    let error = |status: StatusCode, body: Value| (status, Json(body)).into_response();
    if tools::is_tools_model(&model) {
        return match tools::streamed(body) {
            Ok(chunks) => scripted_body(
                chunks.into_iter().map(Step::Send).collect(),
                "text/event-stream",
            ),
            Err(refusal) => error(StatusCode::BAD_REQUEST, refusal),
        };
    }
    match (model.as_str(), n) {
        ("bad_key", _) => {
            return error(
                StatusCode::BAD_REQUEST,
                json!({"error": {"code": 400,
            "message": "API key not valid. Please pass a valid API key.", "status": "INVALID_ARGUMENT",
            "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID"}]}}),
            );
        }
        ("unauthorized", _) => {
            return error(
                StatusCode::UNAUTHORIZED,
                json!({"error": {"code": 401,
            "message": "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential.",
            "status": "UNAUTHENTICATED"}}),
            );
        }
        ("invalid_argument", _) => {
            return error(
                StatusCode::BAD_REQUEST,
                json!({"error": {"code": 400,
            "message": "Request contains an invalid argument.", "status": "INVALID_ARGUMENT"}}),
            );
        }
        ("server_error_once", 1) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({"error": {"code": 500,
            "message": "An internal error has occurred.", "status": "INTERNAL"}}),
            );
        }
        ("rate_limited_once", 1) => {
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                json!({"error": {"code": 429,
            "message": "Resource has been exhausted", "status": "RESOURCE_EXHAUSTED",
            "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0.1s"}]}}),
            );
        }
        _ => {}
    }
    let steps = match model.as_str() {
        "blocked" => vec![Step::Send(data(
            json!({"promptFeedback": {"blockReason": "SAFETY"},
            "usageMetadata": {"promptTokenCount": 9, "totalTokenCount": 9}}),
        ))],
        "no_finish" => vec![Step::Send(first())],
        "hang" => vec![Step::Send(first()), Step::Hang],
        "malformed" => vec![
            Step::Send(first()),
            Step::Send("data: {\"candidates\": [{\"content\n\n".to_owned()),
            Step::Send(last()),
        ],
        _ => vec![Step::Send(first()), Step::Send(last())],
    };
    let abandoned = seen.lock().unwrap().abandoned.clone();
    tracked_body(steps, "text/event-stream", abandoned)
}

/// `normal`'s last event: the rest of the text, the finish reason and the totals.
fn last() -> String {
    data(
        json!({"candidates": [{"content": {"parts": [{"text": " sky is blue."}],
    "role": "model"}, "finishReason": "STOP", "index": 0}], "usageMetadata": {"promptTokenCount": 9,
    "candidatesTokenCount": 6, "thoughtsTokenCount": 25, "totalTokenCount": 40}}),
    )
}
