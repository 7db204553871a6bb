//! A fake Cohere v2 chat server (`POST /v2/chat`, SSE events) over real HTTP, scripted by
//! model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | message-start, content-start, `Hi`, ` there`, a citation event, content-end, message-end (186 in, 105 out), `[DONE]` |
//! | `unauthorized` | 401 `{"id": ..., "message": "invalid api token"}` |
//! | `bad_request` | 400 `{"id": ..., "message": ...}` (a request the API refuses) |
//! | `rate_limited_once` | 429 with `retry-after: 2` on the first call, then `normal` |
//! | `server_error_once` | 500 on the first call, then `normal` |
//! | `malformed` | `Hi`, an event whose data is not JSON, ` there`, message-end, `[DONE]` |
//! | `hang` | `Hi`, then nothing more, ever (a call its client cancels: [`Fake::abandoned_streams`]) |
//! | `error_finish` | `Hi`, then message-end with `finish_reason: ERROR` |
//! | `no_end` | `Hi`, then the body ends without message-end |
//! | `tools` | given `tools` and no `tool` message after the last assistant message: `tool-plan-delta` `I will look that up.`, then per tool (up to three; none for `tool_choice: NONE`) `tool-call-start` (id `<name>_<i>`, name, arguments `""`), its arguments `{"q": "<the last user text>"}` in `tool-call-delta` fragments of at most five bytes, `tool-call-end`; message-end `TOOL_CALL` (20 in, 10 out). Given results, answers `results: <each tool message's content, joined by "; ">` |
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

use crate::fake::{Calls, Fake, Step, tracked_body};

/// The fake Cohere server.
pub type FakeCohere = Fake<CohereSeen>;

/// What the fake Cohere server recorded: the `authorization` headers and the bodies.
#[derive(Default)]
pub struct CohereSeen {
    auth: Vec<Option<String>>,
    bodies: Vec<Value>,
    calls: Calls,
    abandoned: Arc<std::sync::atomic::AtomicUsize>,
}

impl Fake<CohereSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| Router::new().route("/v2/chat", post(chat)).with_state(seen)).await
    }

    /// The last request's body.
    pub fn last_body(&self) -> Value {
        self.seen().bodies.last().cloned().unwrap_or(Value::Null)
    }

    /// The last `authorization` header.
    pub fn last_auth(&self) -> Option<String> {
        self.seen().auth.last().cloned().flatten()
    }

    /// Calls received for `model`.
    pub fn calls(&self, model: &str) -> usize {
        self.seen().calls.get(model)
    }

    /// Streams whose client went away before their end (cancelled calls).
    pub fn abandoned_streams(&self) -> usize {
        self.seen()
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
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
    let model = body["model"].as_str().unwrap_or("");
    let (call, abandoned) = {
        let mut s = seen.lock().unwrap();
        s.auth.push(
            headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        );
        s.bodies.push(body.clone());
        (s.calls.count(model), s.abandoned.clone())
    };
    let refusal = |status: StatusCode, message: &str| {
        (status, Json(json!({"id": "e1", "message": message}))).into_response()
    };
    match (model, call) {
        ("bad_request", _) => {
            return refusal(
                StatusCode::BAD_REQUEST,
                "invalid request: message must be at least 1 token long",
            );
        }
        ("rate_limited_once", 1) => {
            let mut r = refusal(
                StatusCode::TOO_MANY_REQUESTS,
                "You are using a Trial key, which is limited to 10 API calls / minute.",
            );
            r.headers_mut().insert("retry-after", "2".parse().unwrap());
            return r;
        }
        ("server_error_once", 1) => {
            return refusal(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal server error, this has been reported to our developers",
            );
        }
        _ => {}
    }
    let steps = match model {
        "tools" => vec![Step::Send(tools_events(&body).concat())],
        "unauthorized" => {
            return (StatusCode::UNAUTHORIZED, Json(json!({"id": "e1", "message": "invalid api token"}))).into_response();
        }
        "error_finish" => vec![Step::Send(delta("Hi")), Step::Send(ev("message-end", json!({"type": "message-end", "delta": {"finish_reason": "ERROR"}})))],
        "no_end" => vec![Step::Send(delta("Hi"))],
        "hang" => vec![Step::Send(delta("Hi")), Step::Hang],
        "malformed" => vec![Step::Send([
            delta("Hi"),
            "event: content-delta\ndata: {\"type\": \"content-del\n\n".to_owned(),
            delta(" there"),
            ev("message-end", json!({"type": "message-end", "delta": {"finish_reason": "COMPLETE", "usage": {
                "billed_units": {"input_tokens": 21, "output_tokens": 105}, "tokens": {"input_tokens": 186, "output_tokens": 105}}}})),
            "data: [DONE]\n\n".to_owned(),
        ].concat())],
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
    tracked_body(steps, "text/event-stream", abandoned)
}

/// The `tools` model's events for `body`.
fn tools_events(body: &Value) -> Vec<String> {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let results: Vec<&str> = messages
        .iter()
        .rev()
        .take_while(|m| m["role"] != "assistant")
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str())
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let end = |reason: &str| {
        ev(
            "message-end",
            json!({"type": "message-end", "delta": {"finish_reason": reason,
            "usage": {"billed_units": {"input_tokens": 20, "output_tokens": 10},
                      "tokens": {"input_tokens": 20, "output_tokens": 10}}}}),
        )
    };
    let mut out = vec![ev(
        "message-start",
        json!({"type": "message-start", "id": "m-tools",
        "delta": {"message": {"role": "assistant"}}}),
    )];
    let tools = body["tools"].as_array().cloned().unwrap_or_default();
    if !results.is_empty() || tools.is_empty() || body["tool_choice"] == "NONE" {
        let text = if results.is_empty() {
            "no tools were called".to_owned()
        } else {
            format!("results: {}", results.join("; "))
        };
        out.push(delta(&text));
        out.push(end("COMPLETE"));
        return out;
    }
    let q = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or("");
    out.push(ev(
        "tool-plan-delta",
        json!({"type": "tool-plan-delta",
        "delta": {"message": {"tool_plan": "I will look that up."}}}),
    ));
    for (i, t) in tools.iter().take(3).enumerate() {
        let name = t["function"]["name"].as_str().unwrap_or("");
        out.push(ev(
            "tool-call-start",
            json!({"type": "tool-call-start", "index": i,
            "delta": {"message": {"tool_calls": {"id": format!("{name}_{i}"), "type": "function",
                "function": {"name": name, "arguments": ""}}}}}),
        ));
        let args = json!({"q": q}).to_string();
        let chars: Vec<char> = args.chars().collect();
        for piece in chars.chunks(5) {
            let piece: String = piece.iter().collect();
            out.push(ev(
                "tool-call-delta",
                json!({"type": "tool-call-delta", "index": i,
                "delta": {"message": {"tool_calls": {"function": {"arguments": piece}}}}}),
            ));
        }
        out.push(ev(
            "tool-call-end",
            json!({"type": "tool-call-end", "index": i}),
        ));
    }
    out.push(end("TOOL_CALL"));
    out
}
