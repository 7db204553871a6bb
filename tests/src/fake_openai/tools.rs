//! The fake's tool-calling models, with OpenAI's exact shapes for tool calls.
//!
//! - `tools`: given tools and no tool result yet, calls every tool offered (up to three) in
//!   one answer, with arguments `{"q":"<the user's message>"}`; streamed, each call's first
//!   piece carries its index, id, type and name with empty arguments, and the arguments
//!   follow in fragments of at most four bytes, as OpenAI splits them; the answer ends with
//!   `finish_reason: tool_calls`. Given the tools' results (the conversation's `tool`
//!   messages after the last assistant turn), answers the text `results: <each result, in
//!   order, joined by "; ">`.
//! - `tools-text`: the same, with the text `Let me look that up.` streamed before the calls
//!   (a tool call after some text).
//! - `tools-interleaved`: the calls' pieces interleaved (call 0's first piece, call 1's
//!   first piece, then their fragments alternating), as some compatible servers stream
//!   parallel calls.
//! - `agent-tools`: an agent's model (tests/tests/agent.rs) that, offered `lookup` and `add`,
//!   says `Let me look these up.` and makes three calls in one turn: `lookup` with
//!   `{"key": "capital-of-france"}`, `add` with `{"a": 2, "b": 3}`, and `add` with
//!   `{"a": "two", "b": 3}` (off the tool's schema); given the results, answers as `tools`
//!   does.

use serde_json::{Value, json};

use crate::fake::Step;

/// Whether `model` is one of the tool-calling models.
pub(crate) fn is_tools_model(model: &str) -> bool {
    matches!(
        model,
        "tools" | "tools-text" | "tools-interleaved" | "agent-tools"
    )
}

/// The usage the tool-calling models report: (input, output).
pub const TOOLS_USAGE: (u64, u64) = (20, 10);

/// What the model does with `body`.
enum Turn {
    /// Calls these tools: (id, name, arguments).
    Call(Vec<(String, String, String)>),
    /// Answers with this text.
    Text(String),
}

fn turn(body: &Value, user_message: &str) -> Turn {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let after_assistant: Vec<&Value> = messages
        .iter()
        .rev()
        .take_while(|m| m["role"] != "assistant")
        .collect();
    let results: Vec<String> = after_assistant
        .iter()
        .rev()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or("").to_owned())
        .collect();
    if !results.is_empty() {
        return Turn::Text(format!("results: {}", results.join("; ")));
    }
    let tools = body["tools"].as_array().cloned().unwrap_or_default();
    if tools.is_empty() || body["tool_choice"] == "none" {
        return Turn::Text("no tools were called".into());
    }
    if body["model"] == "agent-tools" {
        let offered = |name: &str| tools.iter().any(|t| t["function"]["name"] == name);
        return Turn::Call(
            [
                ("call_lookup", "lookup", json!({"key": "capital-of-france"})),
                ("call_add", "add", json!({"a": 2, "b": 3})),
                ("call_add_bad", "add", json!({"a": "two", "b": 3})),
            ]
            .into_iter()
            .filter(|(_, name, _)| offered(name))
            .map(|(id, name, args)| (id.to_owned(), name.to_owned(), args.to_string()))
            .collect(),
        );
    }
    let arguments = json!({"q": user_message}).to_string();
    let named = body["tool_choice"]["function"]["name"].as_str();
    Turn::Call(
        tools
            .iter()
            .filter_map(|t| t["function"]["name"].as_str())
            .filter(|n| named.is_none_or(|only| only == *n))
            .take(3)
            .enumerate()
            .map(|(i, name)| {
                (
                    format!("call_{i}_{name}"),
                    name.to_owned(),
                    arguments.clone(),
                )
            })
            .collect(),
    )
}

fn chunk(delta: Value, finish: Option<&str>) -> String {
    format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-tools", "object": "chat.completion.chunk", "created": 0,
               "model": "tools", "choices": [{"index": 0, "delta": delta, "logprobs": null,
               "finish_reason": finish}]})
    )
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

/// The streamed answer of `model` to `body`.
pub(crate) fn streamed(model: &str, body: &Value, user_message: &str) -> Vec<Step> {
    let (input, output) = TOOLS_USAGE;
    let mut steps = vec![Step::Send(chunk(
        json!({"role": "assistant", "content": null}),
        None,
    ))];
    let finish = match turn(body, user_message) {
        Turn::Text(text) => {
            for piece in fragments(&text, 8) {
                steps.push(Step::Send(chunk(json!({"content": piece}), None)));
            }
            "stop"
        }
        Turn::Call(calls) => {
            if model == "tools-text" {
                steps.push(Step::Send(chunk(
                    json!({"content": "Let me look that up."}),
                    None,
                )));
            }
            if model == "agent-tools" {
                steps.push(Step::Send(chunk(
                    json!({"content": "Let me look these up."}),
                    None,
                )));
            }
            let first = |i: usize, (id, name, _): &(String, String, String)| {
                chunk(
                    json!({"tool_calls": [{"index": i, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                    None,
                )
            };
            let rest = |i: usize, args: &str| -> Vec<String> {
                fragments(args, 4)
                    .into_iter()
                    .map(|f| {
                        chunk(
                            json!({"tool_calls": [{"index": i, "function": {"arguments": f}}]}),
                            None,
                        )
                    })
                    .collect()
            };
            if model == "tools-interleaved" {
                for (i, c) in calls.iter().enumerate() {
                    steps.push(Step::Send(first(i, c)));
                }
                let mut pending: Vec<Vec<String>> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| rest(i, &c.2))
                    .collect();
                while pending.iter().any(|p| !p.is_empty()) {
                    for p in &mut pending {
                        if !p.is_empty() {
                            steps.push(Step::Send(p.remove(0)));
                        }
                    }
                }
            } else {
                for (i, c) in calls.iter().enumerate() {
                    steps.push(Step::Send(first(i, c)));
                    steps.extend(rest(i, &c.2).into_iter().map(Step::Send));
                }
            }
            "tool_calls"
        }
    };
    steps.push(Step::Send(chunk(json!({}), Some(finish))));
    steps.push(Step::Send(format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-tools", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": input, "completion_tokens": output,
                         "total_tokens": input + output}})
    )));
    steps.push(Step::Send("data: [DONE]\n\n".into()));
    steps
}

/// The whole answer of `model` to `body`.
pub(crate) fn whole(model: &str, body: &Value, user_message: &str) -> Value {
    let (input, output) = TOOLS_USAGE;
    let (message, finish) = match turn(body, user_message) {
        Turn::Text(text) => (json!({"role": "assistant", "content": text}), "stop"),
        Turn::Call(calls) => (
            json!({"role": "assistant",
                "content": if model == "tools-text" { json!("Let me look that up.") } else { Value::Null },
                "tool_calls": calls.iter().map(|(id, name, args)| json!({"id": id,
                    "type": "function", "function": {"name": name, "arguments": args}}))
                    .collect::<Vec<_>>()}),
            "tool_calls",
        ),
    };
    json!({"id": "chatcmpl-tools", "object": "chat.completion", "model": model,
           "choices": [{"index": 0, "message": message, "finish_reason": finish}],
           "usage": {"prompt_tokens": input, "completion_tokens": output,
                     "total_tokens": input + output}})
}
