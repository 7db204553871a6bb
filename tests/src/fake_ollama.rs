//! A fake Ollama server (`POST /api/chat`, NDJSON) over real HTTP, scripted by model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | `The`, ` sky`, ` is blue.`, then `done:true` (26 in, 3 out) |
//! | `cached` | as `normal`, but `done:true` has no `prompt_eval_count` (a cached prompt) |
//! | `tiny_writes` | as `normal`, the body written 7 bytes at a time (lines split across reads) |
//! | `missing` | 404 `model "missing" not found, try pulling it first` |
//! | `server_error_once` | 500 on the first call, then `normal` |
//! | `error_mid_stream` | `The`, then `{"error": ...}` |
//! | `drop_mid_stream` | `The`, then the connection breaks |
//! | `no_done` | `The`, then the body ends without `done:true` |
//! | `malformed` | `The`, an unparseable line, ` sky`, `done:true` |
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

use crate::fake::{Calls, Fake, Step, scripted_body};

/// The fake Ollama server.
pub type FakeOllama = Fake<OllamaSeen>;

/// What the fake Ollama server recorded.
#[derive(Default)]
pub struct OllamaSeen {
    calls: Calls,
    bodies: Vec<Value>,
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

async fn chat(State(seen): State<Arc<Mutex<OllamaSeen>>>, Json(body): Json<Value>) -> Response {
    let model = body["model"].as_str().unwrap_or("").to_owned();
    let call = {
        let mut s = seen.lock().unwrap();
        s.bodies.push(body.clone());
        s.calls.count(&model)
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
        ("server_error_once", 1) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "llama runner process has terminated".into(),
            );
        }
        _ => {}
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
        "malformed" => vec![
            Step::Send(line("The")),
            Step::Send("{\"message\": {\"content\": \n".into()),
            Step::Send(line(" sky")),
            Step::Send(done(Some(4), 2)),
        ],
        _ => vec![Step::Send(normal())],
    };
    scripted_body(steps, "application/x-ndjson")
}
