//! A fake Anthropic Messages server (`POST /v1/messages`, SSE named events) over real HTTP,
//! scripted by model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | message_start (25 in, 1 out), ping, a block of `Hello` ` there`, message_delta output 9, a repeated message_delta 15 and 15, message_stop |
//! | `overloaded_once` | 529 `overloaded_error` on the first call, then `normal` |
//! | `rate_limited_once` | 429 `rate_limit_error` with `retry-after: 0` on the first call, then `normal` |
//! | `unauthorized` | 401 `authentication_error` |
//! | `error_mid_stream` | message_start, `Hello`, then `event: error` overloaded_error |
//! | `no_stop` | message_start, `Hello`, then the body ends without message_stop |
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

use crate::fake::{Calls, Fake, Step, scripted_body};

/// The fake Anthropic server.
pub type FakeAnthropic = Fake<AnthropicSeen>;

/// What the fake Anthropic server recorded.
#[derive(Default)]
pub struct AnthropicSeen {
    calls: Calls,
    headers: Vec<(Option<String>, Option<String>)>,
}

impl Fake<AnthropicSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| {
            Router::new()
                .route("/v1/messages", post(messages))
                .with_state(seen)
        })
        .await
    }

    /// Calls received for `model`.
    pub fn calls(&self, model: &str) -> usize {
        self.seen().calls.get(model)
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

async fn messages(
    State(seen): State<Arc<Mutex<AnthropicSeen>>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let model = body["model"].as_str().unwrap_or("").to_owned();
    let call = {
        let mut s = seen.lock().unwrap();
        let h = |n: &str| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        s.headers.push((h("x-api-key"), h("anthropic-version")));
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
        ("overloaded_once", 1) => {
            return error(
                StatusCode::from_u16(529).unwrap(),
                "overloaded_error",
                "Overloaded",
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
    let steps = match model.as_str() {
        "error_mid_stream" => vec![Step::Send(start()), Step::Send(text("Hello")),
            Step::Send(ev("error", json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})))],
        "no_stop" => vec![Step::Send(start()), Step::Send(text("Hello"))],
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
    scripted_body(steps, "text/event-stream")
}
