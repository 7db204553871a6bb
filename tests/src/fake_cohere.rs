//! A fake Cohere v2 chat server (`POST /v2/chat`, SSE events) over real HTTP, scripted by
//! model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | message-start, content-start, `Hi`, ` there`, a citation event, content-end, message-end (186 in, 105 out), `[DONE]` |
//! | `unauthorized` | 401 `{"id": ..., "message": "invalid api token"}` |
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

use crate::fake::{Fake, Step, scripted_body};

/// The fake Cohere server.
pub type FakeCohere = Fake<CohereSeen>;

/// What the fake Cohere server recorded: the `authorization` headers and the bodies.
#[derive(Default)]
pub struct CohereSeen(Vec<Option<String>>, Vec<Value>);

impl Fake<CohereSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| Router::new().route("/v2/chat", post(chat)).with_state(seen)).await
    }

    /// The last request's body.
    pub fn last_body(&self) -> Value {
        self.seen().1.last().cloned().unwrap_or(Value::Null)
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
    seen.lock().unwrap().1.push(body.clone());
    let model = body["model"].as_str().unwrap_or("");
    let steps = match model {
        "tools" => vec![Step::Send(tools_events(&body).concat())],
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
