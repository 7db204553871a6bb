//! A fake Cohere v2 chat server (`POST /v2/chat`, SSE events) over real HTTP, scripted by
//! model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | message-start, content-start, `Hi`, ` there`, a citation event, content-end, message-end (186 in, 105 out), `[DONE]` |
//! | `unauthorized` | 401 `{"id": ..., "message": "invalid api token"}` |
//! | `error_finish` | `Hi`, then message-end with `finish_reason: ERROR` |
//! | `no_end` | `Hi`, then the body ends without message-end |
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use crate::fake::{Fake, Step, scripted_body};

/// The fake Cohere server.
pub type FakeCohere = Fake<CohereSeen>;

/// What the fake Cohere server recorded: the `authorization` headers.
#[derive(Default)]
pub struct CohereSeen(Vec<Option<String>>);

impl Fake<CohereSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| Router::new().route("/v2/chat", post(chat)).with_state(seen)).await
    }

    /// The last `authorization` header.
    pub fn last_auth(&self) -> Option<String> {
        self.seen().0.last().cloned().flatten()
    }
}

fn ev(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn delta(t: &str) -> String {
    ev(
        "content-delta",
        json!({"type": "content-delta", "index": 0, "delta": {"message": {"content": {"text": t}}}}),
    )
}

async fn chat(
    State(seen): State<Arc<Mutex<CohereSeen>>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    seen.lock().unwrap().0.push(
        headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    );
    let model = body["model"].as_str().unwrap_or("");
    let steps = match model {
        "unauthorized" => {
            return (StatusCode::UNAUTHORIZED, Json(json!({"id": "e1", "message": "invalid api token"}))).into_response();
        }
        "error_finish" => vec![Step::Send(delta("Hi")), Step::Send(ev("message-end", json!({"type": "message-end", "delta": {"finish_reason": "ERROR"}})))],
        "no_end" => vec![Step::Send(delta("Hi"))],
        _ => vec![Step::Send([
            ev("message-start", json!({"type": "message-start", "id": "m1", "delta": {"message": {"role": "assistant"}}})),
            ev("content-start", json!({"type": "content-start", "index": 0, "delta": {"message": {"content": {"type": "text", "text": ""}}}})),
            delta("Hi"),
            delta(" there"),
            ev("citation-start", json!({"type": "citation-start", "index": 0})),
            ev("content-end", json!({"type": "content-end", "index": 0})),
            ev("message-end", json!({"type": "message-end", "delta": {"finish_reason": "COMPLETE", "usage": {
                "billed_units": {"input_tokens": 21, "output_tokens": 105}, "tokens": {"input_tokens": 186, "output_tokens": 105}}}})),
            "data: [DONE]\n\n".to_owned(),
        ].concat())],
    };
    scripted_body(steps, "text/event-stream")
}
