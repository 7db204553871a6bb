//! The fake's tool-calling model, with Gemini's exact shapes for function calling.
//!
//! `tools`: given `functionDeclarations` and no `functionResponse` part in the last user
//! content, calls every function declared (up to three; only `allowedFunctionNames` when the
//! config names some; none for mode `NONE`) with args `{"q": "<the last user text>"}`: each
//! call whole in a `functionCall` part of a chunk of its own, with no id (as Gemini's
//! generateContent sends them) and a `thoughtSignature` (`sig-<i>`, base64), the last chunk
//! with `finishReason: STOP` (Gemini's reason after calls too) and usage 20 in, 10 out.
//! Given the responses, answers `results: <each response's "result" (or its JSON), in
//! order, joined by "; ">`, but refuses, as Gemini 3 does (400 `INVALID_ARGUMENT`), a
//! conversation whose `functionCall` parts lack the signature they were given.

use base64::Engine;
use serde_json::{Value, json};

/// Whether `model` is the tool-calling model.
pub(crate) fn is_tools_model(model: &str) -> bool {
    model == "tools"
}

fn data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

fn signature(i: usize) -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("sig-{i}"))
}

/// The text of a content's text parts.
fn text_of(content: &Value) -> String {
    content["parts"]
        .as_array()
        .map(|parts| parts.iter().filter_map(|p| p["text"].as_str()).collect())
        .unwrap_or_default()
}

/// The answer to `body`: `Ok` with its chunks, or `Err` with Gemini's 400 body.
pub(crate) fn streamed(body: &Value) -> Result<Vec<String>, Value> {
    let contents = body["contents"].as_array().cloned().unwrap_or_default();
    // Every call sent back must carry the signature it came with.
    let mut seen_calls = 0;
    for c in contents.iter().filter(|c| c["role"] == "model") {
        for part in c["parts"].as_array().into_iter().flatten() {
            if part["functionCall"].is_object() {
                if part["thoughtSignature"] != json!(signature(seen_calls)) {
                    return Err(json!({"error": {"code": 400, "status": "INVALID_ARGUMENT",
                        "message": format!("Function call is missing a thought_signature in functionCall parts. This is required for tools to work correctly, and missing thought_signature may lead to degraded model performance. Additional data, function call `default_api:{}` , position {}.", part["functionCall"]["name"].as_str().unwrap_or(""), seen_calls + 1)}}));
                }
                seen_calls += 1;
            }
        }
    }
    let last_user = contents
        .iter()
        .rev()
        .find(|c| c["role"] == "user")
        .cloned()
        .unwrap_or(Value::Null);
    let results: Vec<String> = last_user["parts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("functionResponse"))
        .map(|f| match f["response"]["result"].as_str() {
            Some(r) => r.to_owned(),
            None => f["response"].to_string(),
        })
        .collect();
    let usage = json!({"promptTokenCount": 20, "candidatesTokenCount": 10, "totalTokenCount": 30});
    let text_answer = |text: String| {
        vec![data(&json!({"candidates": [{"content": {"role": "model",
            "parts": [{"text": text}]}, "finishReason": "STOP", "index": 0}],
            "usageMetadata": usage}))]
    };
    if !results.is_empty() {
        return Ok(text_answer(format!("results: {}", results.join("; "))));
    }
    let config = &body["toolConfig"]["functionCallingConfig"];
    let declared: Vec<String> = body["tools"][0]["functionDeclarations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["name"].as_str().map(str::to_owned))
        .collect();
    if declared.is_empty() || config["mode"] == "NONE" {
        return Ok(text_answer("no tools were called".into()));
    }
    let allowed: Option<Vec<&str>> = config["allowedFunctionNames"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect());
    let q = text_of(&last_user);
    let calls: Vec<&String> = declared
        .iter()
        .filter(|n| allowed.as_ref().is_none_or(|a| a.contains(&n.as_str())))
        .take(3)
        .collect();
    let last = calls.len().saturating_sub(1);
    Ok(calls
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut chunk = json!({"candidates": [{"content": {"role": "model", "parts": [
                {"functionCall": {"name": name, "args": {"q": q}},
                 "thoughtSignature": signature(seen_calls + i)}]}, "index": 0}],
                "usageMetadata": {"promptTokenCount": 20, "totalTokenCount": 20}});
            if i == last {
                chunk["candidates"][0]["finishReason"] = json!("STOP");
                chunk["usageMetadata"] = usage.clone();
            }
            data(&chunk)
        })
        .collect())
}
