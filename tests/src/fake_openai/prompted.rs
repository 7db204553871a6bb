//! The fake OpenAI server scripted by the prompt, not the model name: for processes that are
//! configured once and then sent many different prompts (TrustGraph's own
//! `text-completion-openai`, the compose stack, the Kubernetes run), run as the
//! `fake-openai` binary on a fixed address. Any model name is accepted.
//!
//! The reply is a function of the prompt (the text of the last user message):
//! - a prompt containing `Final Answer:` (a ReAct agent prompt) gets
//!   `Thought: I can answer directly.\nFinal Answer: fake answer to <last line>`, the last
//!   line being the prompt's last line that is not blank; except that when that line contains
//!   "use a tool" and the prompt has no `Observation:` yet (the agent's first step), the
//!   reply is a call of the tool `ask-llm` with `{"question": "<that line>"}`;
//! - `[fake:429]` is refused with OpenAI's 429 (`Retry-After: 0`), `[fake:500]` with a 500;
//! - a prompt asking for JSON lines about `Block ID:`s (the built-in knowledge-classification
//!   template) gets one object per block, confidence 1.5 (clamped by sluice: a correction),
//!   then a line that is not JSON (skipped by sluice);
//! - `[fake:echo]` gets `fake reply: <the prompt>`, even with an upstream;
//! - `[fake:slow]` streams a fixed text of 200 chunks, 100 ms apart;
//! - `[fake:hold]` streams a fixed text of 10 chunks, 3 s apart: a long request that costs
//!   the broker little (a backlog of hundreds held at once);
//! - any other prompt gets `fake reply: <the prompt>`, or, with an upstream, is forwarded to
//!   that OpenAI-compatible server (the real model) and its answer relayed as it arrives.
//!
//! Streams split the reply into chunks of at most 8 characters (9 for `[fake:hold]`, 11 for
//! `[fake:slow]`), after a first chunk with the assistant's role, and end with a finish chunk,
//! a usage chunk (whitespace-separated words counted as tokens) and `data: [DONE]`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use axum::{
    Json, Router,
    body::{Body, Bytes},
    extract::State,
    http::{Method, StatusCode, Uri},
    response::{IntoResponse, Response},
};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::fake::{Step, scripted_body};

/// The model `GET /v1/models` lists.
const MODEL: &str = "fake-model";
const SLOW_CHUNKS: usize = 200;
const SLOW_GAP: Duration = Duration::from_millis(100);
const HOLD_CHUNKS: usize = 10;
const HOLD_GAP: Duration = Duration::from_secs(3);

/// Where prompts that are not scripted go.
#[derive(Clone)]
pub struct Upstream {
    /// The OpenAI-compatible server's base URL (`http://host:port`).
    pub url: String,
    /// Its bearer key, if it needs one.
    pub api_key: Option<String>,
}

#[derive(Clone)]
struct Config {
    upstream: Option<Upstream>,
    http: reqwest::Client,
}

/// Serves the prompt-scripted fake on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, upstream: Option<Upstream>) {
    sluice_runtime::install_crypto_provider();
    let config = Config {
        upstream,
        // No overall timeout: the real model's answers stream for as long as they take.
        http: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .unwrap(),
    };
    let app = Router::new().fallback(route).with_state(Arc::new(config));
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await.unwrap();
}

async fn route(
    State(config): State<Arc<Config>>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let path = uri.path().trim_end_matches('/');
    if method == Method::GET && path.ends_with("/models") {
        return Json(json!({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}]}))
        .into_response();
    }
    if method != Method::POST || !path.ends_with("/chat/completions") {
        return error(StatusCode::NOT_FOUND, "not found", "invalid_request_error");
    }
    let request: Value = if body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!("the body is not JSON: {e}"),
                    "invalid_request_error",
                );
            }
        }
    };
    answer(&config, request, body).await
}

fn error(status: StatusCode, message: &str, kind: &str) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "type": kind}})),
    )
        .into_response()
}

/// The text of the last user message (a string, or the text parts of a list).
pub fn prompt_text(request: &Value) -> String {
    let Some(message) = request["messages"]
        .as_array()
        .and_then(|ms| ms.iter().rev().find(|m| m["role"] == "user"))
    else {
        return String::new();
    };
    match &message["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter(|p| p["type"] == "text")
            .filter_map(|p| p["text"].as_str())
            .collect(),
        _ => String::new(),
    }
}

/// The built-in knowledge-classification template's prompt.
fn asks_for_block_lines(prompt: &str) -> bool {
    prompt.contains("JSON object per line") && prompt.contains("Block ID: ")
}

/// The scripted reply to `prompt` (not one of the `[fake:...]` markers).
pub fn reply_for(prompt: &str) -> String {
    if asks_for_block_lines(prompt) {
        let mut lines: Vec<String> = prompt
            .lines()
            .filter_map(|l| l.strip_prefix("Block ID: "))
            .map(|id| {
                json!({"block_id": id.trim(), "is_knowledge": true, "confidence": 1.5,
                       "reason": "fake"})
                .to_string()
            })
            .collect();
        lines.push("this line is not JSON".to_owned());
        return lines.join("\n") + "\n";
    }
    if prompt.contains("Final Answer:") {
        let last = prompt
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .unwrap_or("");
        if last.to_lowercase().contains("use a tool") && !prompt.contains("Observation:") {
            let args = json!({"question": last});
            return format!("Thought: I will ask the tool.\nAction: ask-llm\nArgs: {args}");
        }
        return format!("Thought: I can answer directly.\nFinal Answer: fake answer to {last}");
    }
    format!("fake reply: {prompt}")
}

async fn answer(config: &Config, request: Value, raw: Bytes) -> Response {
    let model = request["model"].as_str().unwrap_or(MODEL).to_owned();
    let prompt = prompt_text(&request);
    if prompt.contains("[fake:429]") {
        let mut resp = (
            StatusCode::TOO_MANY_REQUESTS,
            Json(json!({"error": {"message": "Rate limit reached (fake)",
                                  "type": "requests", "code": "rate_limit_exceeded"}})),
        )
            .into_response();
        resp.headers_mut()
            .insert("retry-after", "0".parse().unwrap());
        return resp;
    }
    if prompt.contains("[fake:500]") {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The server had an error (fake)",
            "server_error",
        );
    }
    let slow = prompt.contains("[fake:slow]");
    let hold = prompt.contains("[fake:hold]");
    let scripted = slow
        || hold
        || prompt.contains("[fake:echo]")
        || prompt.contains("Final Answer:")
        || asks_for_block_lines(&prompt);
    if let (Some(upstream), false) = (&config.upstream, scripted) {
        return relay(&config.http, upstream, raw).await;
    }
    let text = if slow {
        (0..SLOW_CHUNKS)
            .map(|i| format!("chunk {i:03}. "))
            .collect()
    } else if hold {
        (0..HOLD_CHUNKS).map(|i| format!("held {i:02}. ")).collect()
    } else {
        reply_for(&prompt)
    };
    let (input, output) = (
        prompt.split_whitespace().count(),
        text.split_whitespace().count(),
    );
    let usage = json!({"prompt_tokens": input, "completion_tokens": output,
                       "total_tokens": input + output});
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if !request["stream"].as_bool().unwrap_or(false) {
        return Json(json!({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": created,
            "model": model, "usage": usage,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}]}))
        .into_response();
    }
    let chunk = |choices: Value, usage: Option<&Value>| {
        let mut event = json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                               "created": created, "model": model, "choices": choices});
        if let Some(u) = usage {
            event["usage"] = u.clone();
        }
        Step::Send(format!("data: {event}\n\n"))
    };
    let (size, gap) = if slow {
        (11, Some(SLOW_GAP))
    } else if hold {
        (9, Some(HOLD_GAP))
    } else {
        (8, None)
    };
    let mut steps = vec![chunk(
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                "finish_reason": null}]),
        None,
    )];
    let chars: Vec<char> = text.chars().collect();
    for piece in chars.chunks(size) {
        if let Some(gap) = gap {
            steps.push(Step::Wait(gap));
        }
        let piece: String = piece.iter().collect();
        steps.push(chunk(
            json!([{"index": 0, "delta": {"content": piece}, "finish_reason": null}]),
            None,
        ));
    }
    steps.push(chunk(
        json!([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
        None,
    ));
    steps.push(chunk(json!([]), Some(&usage)));
    steps.push(Step::Send("data: [DONE]\n\n".into()));
    let mut resp = scripted_body(steps, "text/event-stream");
    resp.headers_mut()
        .insert("cache-control", "no-cache".parse().unwrap());
    resp
}

/// Forwards the request to the upstream server and relays its answer as it comes: status,
/// content type and body, unchanged.
async fn relay(http: &reqwest::Client, upstream: &Upstream, raw: Bytes) -> Response {
    let url = format!("{}/v1/chat/completions", upstream.url.trim_end_matches('/'));
    let mut request = http
        .post(url)
        .header("content-type", "application/json")
        .body(raw);
    if let Some(key) = &upstream.api_key {
        request = request.bearer_auth(key);
    }
    let answer = match request.send().await {
        Ok(a) => a,
        Err(e) => {
            return error(
                StatusCode::BAD_GATEWAY,
                &format!("the upstream model could not be reached: {e}"),
                "server_error",
            );
        }
    };
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = answer
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_owned();
    let body = answer
        .bytes_stream()
        .map(|chunk| chunk.map_err(std::io::Error::other));
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Body::from_stream(body))
        .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_react_prompt_is_answered_from_its_last_line() {
        let prompt = "Answer as follows.\nFinal Answer: the answer\n\nQuestion: What is 3+3?\n\n";
        assert_eq!(
            reply_for(prompt),
            "Thought: I can answer directly.\nFinal Answer: fake answer to Question: What is 3+3?"
        );
        let tool = "Final Answer: ...\nPlease use a tool: what is two plus two?";
        assert_eq!(
            reply_for(tool),
            "Thought: I will ask the tool.\nAction: ask-llm\nArgs: {\"question\":\"Please use a tool: what is two plus two?\"}"
        );
        let observed = format!("{tool}\nObservation: 4\nPlease use a tool: go on");
        assert!(
            reply_for(&observed).contains("Final Answer: fake answer to Please use a tool: go on")
        );
    }

    #[test]
    fn a_classification_prompt_gets_a_line_per_block_then_one_that_is_not_json() {
        let prompt = "Reply with one JSON object per line.\nBlock ID: b1\ntext\nBlock ID: b2\n";
        let reply = reply_for(prompt);
        let lines: Vec<&str> = reply.lines().collect();
        assert_eq!(lines.len(), 3, "{reply}");
        let first: Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(first["block_id"], "b1");
        assert_eq!(first["confidence"], 1.5);
        assert!(serde_json::from_str::<Value>(lines[2]).is_err());
    }

    #[test]
    fn the_prompt_is_the_last_user_messages_text() {
        let request = json!({"messages": [
            {"role": "user", "content": "first"},
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "image_url", "image_url": {}},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "no"}]});
        assert_eq!(prompt_text(&request), "ab");
    }
}
