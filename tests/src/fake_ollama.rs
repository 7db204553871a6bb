//! A fake Ollama server (`POST /api/chat`, NDJSON) over real HTTP, scripted by model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | `The`, ` sky`, ` is blue.`, then `done:true` (26 in, 3 out) |
//! | `cached` | as `normal`, but `done:true` has no `prompt_eval_count` (a cached prompt) |
//! | `tiny_writes` | as `normal`, the body written 7 bytes at a time (lines split across reads) |
//! | `missing` | 404 `model "missing" not found, try pulling it first` |
//! | `server_error_once` | 500 on the first call, then `normal` |
//! | `unauthorized` | 401 `{"error": "unauthorized"}` (an authenticating proxy, or ollama.com) |
//! | `rate_limited_once` | 429 with `retry-after: 2` on the first call, then `normal` |
//! | `hang` | `The`, then nothing more, ever (a call its client cancels: [`Fake::abandoned_streams`]) |
//! | `error_mid_stream` | `The`, then `{"error": ...}` |
//! | `drop_mid_stream` | `The`, then the connection breaks |
//! | `no_done` | `The`, then the body ends without `done:true` |
//! | `malformed` | `The`, an unparseable line, ` sky`, `done:true` |
//! | `tools` | given `tools` and no `tool` message after the last assistant message: one line whose `message.tool_calls` calls every tool (up to three) with `arguments` `{"q": "<the last user text>"}` as an object and no id (as Ollama before ids), then `done:true` with `done_reason: stop` (Ollama's reason after calls too), 20 in, 10 out; given the results, answers `results: <each tool message's content, joined by "; ">`; `stream: false` the same in one object |
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use crate::fake::{Calls, Fake, Step, scripted_body, tracked_body};

/// The fake Ollama server.
pub type FakeOllama = Fake<OllamaSeen>;

/// What the fake Ollama server recorded.
#[derive(Default)]
pub struct OllamaSeen {
    calls: Calls,
    bodies: Vec<Value>,
    auth: Vec<Option<String>>,
    abandoned: Arc<std::sync::atomic::AtomicUsize>,
}

impl Fake<OllamaSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| {
            Router::new()
                .route("/api/chat", post(chat))
                .with_state(seen)
        })
        .await
    }

    /// Calls received for `model`.
    pub fn calls(&self, model: &str) -> usize {
        self.seen().calls.get(model)
    }

    /// The last request body.
    pub fn last_body(&self) -> Value {
        self.seen().bodies.last().cloned().unwrap_or(Value::Null)
    }

    /// The last `authorization` header.
    pub fn last_auth(&self) -> Option<String> {
        self.seen().auth.last().cloned().flatten()
    }

    /// Streams whose client went away before their end (cancelled calls).
    pub fn abandoned_streams(&self) -> usize {
        self.seen()
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn line(text: &str) -> String {
    format!(
        "{}\n",
        json!({"model": "m", "created_at": "2025-01-01T00:00:00Z",
        "message": {"role": "assistant", "content": text}, "done": false})
    )
}

fn done(prompt: Option<u64>, eval: u64) -> String {
    let mut v = json!({"model": "m", "created_at": "2025-01-01T00:00:00Z",
        "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": "stop",
        "eval_count": eval, "total_duration": 4_883_583_458u64});
    if let Some(p) = prompt {
        v["prompt_eval_count"] = json!(p);
    }
    format!("{v}\n")
}

fn normal() -> String {
    [
        line("The"),
        line(" sky"),
        line(" is blue."),
        done(Some(26), 3),
    ]
    .concat()
}

async fn chat(
    State(seen): State<Arc<Mutex<OllamaSeen>>>,
    headers: axum::http::HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let model = body["model"].as_str().unwrap_or("").to_owned();
    let (call, abandoned) = {
        let mut s = seen.lock().unwrap();
        s.bodies.push(body.clone());
        s.auth.push(
            headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        );
        (s.calls.count(&model), s.abandoned.clone())
    };
    let error = |status: StatusCode, message: String| {
        (status, Json(json!({"error": message}))).into_response()
    };
    match (model.as_str(), call) {
        ("missing", _) => {
            return error(
                StatusCode::NOT_FOUND,
                format!("model \"{model}\" not found, try pulling it first"),
            );
        }
        ("unauthorized", _) => {
            return error(StatusCode::UNAUTHORIZED, "unauthorized".into());
        }
        ("rate_limited_once", 1) => {
            let mut r = error(
                StatusCode::TOO_MANY_REQUESTS,
                "too many concurrent requests".into(),
            );
            r.headers_mut().insert("retry-after", "2".parse().unwrap());
            return r;
        }
        ("server_error_once", 1) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "llama runner process has terminated".into(),
            );
        }
        _ => {}
    }
    if model == "tools" {
        return tools_answer(&body);
    }
    if body["stream"] == json!(false) {
        let v: Value = serde_json::from_str(done(Some(26), 3).trim()).unwrap();
        let mut v = v;
        v["message"]["content"] = json!("The sky is blue.");
        return Json(v).into_response();
    }
    let steps = match model.as_str() {
        "cached" => vec![Step::Send(
            [line("The"), line(" sky"), line(" is blue."), done(None, 3)].concat(),
        )],
        "tiny_writes" => normal()
            .as_bytes()
            .chunks(7)
            .flat_map(|c| {
                [
                    Step::Send(String::from_utf8_lossy(c).into_owned()),
                    Step::Wait(Duration::from_millis(1)),
                ]
            })
            .collect(),
        "error_mid_stream" => vec![
            Step::Send(line("The")),
            Step::Send(format!("{}\n", json!({"error": "model runner crashed"}))),
        ],
        "drop_mid_stream" => vec![
            Step::Send(line("The")),
            Step::Wait(Duration::from_millis(20)),
            Step::Break,
        ],
        "no_done" => vec![Step::Send(line("The"))],
        "hang" => vec![Step::Send(line("The")), Step::Hang],
        "malformed" => vec![
            Step::Send(line("The")),
            Step::Send("{\"message\": {\"content\": \n".into()),
            Step::Send(line(" sky")),
            Step::Send(done(Some(4), 2)),
        ],
        _ => vec![Step::Send(normal())],
    };
    tracked_body(steps, "application/x-ndjson", abandoned)
}

/// The `tools` model's answer to `body`.
fn tools_answer(body: &Value) -> Response {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let after_assistant: Vec<&Value> = messages
        .iter()
        .rev()
        .take_while(|m| m["role"] != "assistant")
        .collect();
    let results: Vec<&str> = after_assistant
        .iter()
        .rev()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str())
        .collect();
    let q = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or("");
    let tools = body["tools"].as_array().cloned().unwrap_or_default();
    let message = if !results.is_empty() {
        json!({"role": "assistant", "content": format!("results: {}", results.join("; "))})
    } else if tools.is_empty() {
        json!({"role": "assistant", "content": "no tools were called"})
    } else {
        json!({"role": "assistant", "content": "", "tool_calls": tools.iter().take(3)
            .map(|t| json!({"function": {"name": t["function"]["name"], "arguments": {"q": q}}}))
            .collect::<Vec<_>>()})
    };
    let mut last = json!({"model": "tools", "created_at": "2025-01-01T00:00:00Z",
        "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": "stop",
        "prompt_eval_count": 20, "eval_count": 10});
    if body["stream"] == json!(false) {
        last["message"] = message;
        return Json(last).into_response();
    }
    let first = json!({"model": "tools", "created_at": "2025-01-01T00:00:00Z",
        "message": message, "done": false});
    scripted_body(
        vec![Step::Send(format!("{first}\n{last}\n"))],
        "application/x-ndjson",
    )
}
