//! The fake's tool-calling models, with Anthropic's exact shapes for tool use.
//!
//! - `tools`: given tools and no tool result in the last user message, calls every tool
//!   offered (up to three; only the named one for `tool_choice: {"type": "tool"}`; none for
//!   `{"type": "none"}`) in one answer, with input `{"q": "<the last user text>"}`, or no
//!   input for a tool whose schema has no properties. Streamed, each call is a `tool_use`
//!   content block: `content_block_start` with its id (`toolu_<i>_<name>`), name and
//!   `input: {}`, an empty `input_json_delta` first (as Anthropic sends it), then the input in
//!   fragments of at most five bytes, `content_block_stop`; a `ping` between blocks; the
//!   message ends with `stop_reason: tool_use`. Given the tools' results (`tool_result`
//!   blocks in the last user message), answers the text `results: <each result's content,
//!   in order, joined by "; ">`.
//! - `tools-text`: the same, with a text block `Let me look that up.` first, so the calls'
//!   blocks are numbered from 1 (a tool call after some text).
//!
//! Usage: 20 input tokens in `message_start`, 10 output as `message_delta`'s total.
//!
//! Both refuse, as Anthropic's API does (400 `invalid_request_error`), tool blocks in a
//! request without tools, a tool id off `^[a-zA-Z0-9_-]+$`, and a user message whose
//! `tool_result` blocks do not come first.

use serde_json::{Value, json};

/// What Anthropic's API refuses in a conversation with tool blocks, as it words it: tool
/// blocks without tools, a tool id off `^[a-zA-Z0-9_-]+$`, a user message whose
/// `tool_result` blocks do not come first.
pub(crate) fn refusal(body: &Value) -> Option<String> {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let blocks = |m: &Value| m["content"].as_array().cloned().unwrap_or_default();
    let any_tool_block = messages
        .iter()
        .flat_map(blocks)
        .any(|b| b["type"] == "tool_use" || b["type"] == "tool_result");
    if any_tool_block && body["tools"].as_array().is_none_or(Vec::is_empty) {
        return Some(
            "Requests which include `tool_use` or `tool_result` blocks must define tools.".into(),
        );
    }
    for (i, m) in messages.iter().enumerate() {
        let bs = blocks(m);
        for b in &bs {
            if let Some(id) = b["id"].as_str().or(b["tool_use_id"].as_str()) {
                let ok = !id.is_empty()
                    && id
                        .bytes()
                        .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
                if !ok {
                    return Some(format!(
                        "messages.{i}.content: tool id: String should match pattern '^[a-zA-Z0-9_-]+$'"
                    ));
                }
            }
        }
        let first_other = bs.iter().position(|b| b["type"] != "tool_result");
        let last_result = bs.iter().rposition(|b| b["type"] == "tool_result");
        if let (Some(t), Some(r)) = (first_other, last_result)
            && t < r
            && m["role"] == "user"
        {
            return Some(format!(
                "messages.{i}: tool_result blocks must come first in the user message"
            ));
        }
    }
    None
}

/// Whether `model` is one of the tool-calling models.
pub(crate) fn is_tools_model(model: &str) -> bool {
    matches!(model, "tools" | "tools-text")
}

/// A call the model makes: (id, name, input; `None` for a tool without properties).
type Call = (String, String, Option<Value>);

enum Turn {
    Call(Vec<Call>),
    Text(String),
}

/// The text of a message's content: a string, or its text blocks joined.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b["text"].as_str())
            .collect(),
        _ => String::new(),
    }
}

fn turn(body: &Value) -> Turn {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let last_user = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .cloned()
        .unwrap_or(Value::Null);
    let results: Vec<String> = last_user["content"]
        .as_array()
        .map(|blocks| {
            blocks
                .iter()
                .filter(|b| b["type"] == "tool_result")
                .map(|b| text_of(&b["content"]))
                .collect()
        })
        .unwrap_or_default();
    if !results.is_empty() {
        return Turn::Text(format!("results: {}", results.join("; ")));
    }
    let tools = body["tools"].as_array().cloned().unwrap_or_default();
    let choice = &body["tool_choice"];
    if tools.is_empty() || choice["type"] == "none" {
        return Turn::Text("no tools were called".into());
    }
    let named = (choice["type"] == "tool").then(|| choice["name"].as_str().unwrap_or(""));
    let q = text_of(&last_user["content"]);
    Turn::Call(
        tools
            .iter()
            .filter(|t| named.is_none_or(|only| t["name"] == only))
            .take(3)
            .enumerate()
            .map(|(i, t)| {
                let name = t["name"].as_str().unwrap_or("").to_owned();
                let takes_input = t["input_schema"]["properties"]
                    .as_object()
                    .is_some_and(|p| !p.is_empty());
                (
                    format!("toolu_{i}_{name}"),
                    name,
                    takes_input.then(|| json!({"q": q})),
                )
            })
            .collect(),
    )
}

fn ev(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// Splits `s` into pieces of at most `n` bytes, on character boundaries.
fn fragments(s: &str, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut piece = String::new();
    for c in s.chars() {
        if piece.len() + c.len_utf8() > n {
            out.push(std::mem::take(&mut piece));
        }
        piece.push(c);
    }
    if !piece.is_empty() {
        out.push(piece);
    }
    out
}

/// The streamed answer of `model` to `body`, one event per element.
pub(crate) fn streamed(model: &str, body: &Value) -> Vec<String> {
    let mut events = vec![ev(
        "message_start",
        json!({"type": "message_start", "message": {"id": "msg_tools", "type": "message",
            "role": "assistant", "model": model, "content": [], "stop_reason": null,
            "stop_sequence": null, "usage": {"input_tokens": 20, "output_tokens": 1}}}),
    )];
    let text_block = |events: &mut Vec<String>, index: u64, text: &str| {
        events.push(ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                "content_block": {"type": "text", "text": ""}}),
        ));
        for piece in fragments(text, 8) {
            events.push(ev(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "text_delta", "text": piece}}),
            ));
        }
        events.push(ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    };
    let stop = match turn(body) {
        Turn::Text(text) => {
            text_block(&mut events, 0, &text);
            "end_turn"
        }
        Turn::Call(calls) => {
            let mut index = 0;
            if model == "tools-text" {
                text_block(&mut events, 0, "Let me look that up.");
                index = 1;
            }
            for (id, name, input) in calls {
                events.push(ev(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": index,
                        "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
                ));
                let json_delta = |partial: &str| {
                    ev(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": partial}}),
                    )
                };
                events.push(json_delta(""));
                if let Some(input) = input {
                    for piece in fragments(&input.to_string(), 5) {
                        events.push(json_delta(&piece));
                    }
                }
                events.push(ev(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": index}),
                ));
                events.push(ev("ping", json!({"type": "ping"})));
                index += 1;
            }
            "tool_use"
        }
    };
    events.push(ev(
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
            "usage": {"output_tokens": 10}}),
    ));
    events.push(ev("message_stop", json!({"type": "message_stop"})));
    events
}

/// The whole answer of `model` to `body`, as one message.
pub(crate) fn whole(model: &str, body: &Value) -> Value {
    let (content, stop) = match turn(body) {
        Turn::Text(text) => (json!([{"type": "text", "text": text}]), "end_turn"),
        Turn::Call(calls) => {
            let mut blocks = Vec::new();
            if model == "tools-text" {
                blocks.push(json!({"type": "text", "text": "Let me look that up."}));
            }
            for (id, name, input) in calls {
                blocks.push(json!({"type": "tool_use", "id": id, "name": name,
                    "input": input.unwrap_or_else(|| json!({}))}));
            }
            (Value::Array(blocks), "tool_use")
        }
    };
    json!({"id": "msg_tools", "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop, "stop_sequence": null,
        "usage": {"input_tokens": 20, "output_tokens": 10}})
}
