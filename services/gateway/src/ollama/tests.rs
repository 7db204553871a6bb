//! Ollama's routes through the router on the in-process bus, text-completion played by the
//! test: the lines of a stream (the default), a whole answer, tool calls sent whole, errors
//! before and after the first line, a caller that goes away (the cancel), and bodies that are
//! not Ollama's requests (a 4xx in Ollama's shape, never a 5xx).

use std::{sync::Arc, time::Duration};

use axum::{
    body::Body,
    http::{Request, StatusCode, header},
};
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_runtime::{bus::memory::MemoryBus, telemetry::Telemetry};
use sluice_schema::{
    Error, ErrorKind, ResponseRecord, TextCompletionResponse, ToolCallDelta, properties,
};
use tower::ServiceExt;

use super::*;
use crate::{
    Gateway, GatewayConfig,
    testing::{Rig, body as text, lines, piece},
};

/// Without `stream`, the answer streams (Ollama's default): a line per piece of text, then
/// `done: true` with the reason and the counts; `options` reach the request.
#[tokio::test]
async fn a_chat_streams_by_default_as_ollama_lines_ending_with_done() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/api/chat",
        &[],
        json!({"model": "routed:latest", "messages": [{"role": "user", "content": "hi"}],
               "options": {"temperature": 0.3, "num_ctx": 8192, "num_predict": 9}}),
    );
    rig.serve_models().await;
    let (id, sent) = rig.request().await;
    assert!(sent.streaming);
    assert_eq!(sent.model.as_deref(), Some("routed"), "the tag dropped");
    assert_eq!((sent.temperature, sent.max_tokens), (Some(0.3), Some(9)));
    assert_eq!(sent.prompt, "hi");
    rig.answer(&id, "a1", piece("Hel", false)).await;
    let mut end = piece("lo", true);
    end.finish_reason = Some("length".into());
    rig.answer(&id, "a1", end).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/x-ndjson");
    let lines = lines(&text(resp).await);
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (l, content) in lines.iter().zip(["Hel", "lo", ""]) {
        assert_eq!(l["model"], "routed:latest");
        assert_eq!(
            l["message"],
            json!({"role": "assistant", "content": content})
        );
        let at = l["created_at"].as_str().unwrap();
        assert!(at.ends_with('Z') && at.len() == 30, "{at}");
    }
    assert_eq!(lines[0]["done"], false);
    assert!(lines[0].get("done_reason").is_none());
    let done = &lines[2];
    assert_eq!(done["done"], true);
    assert_eq!(done["done_reason"], "length");
    assert_eq!(
        (
            done["prompt_eval_count"].as_u64(),
            done["eval_count"].as_u64()
        ),
        (Some(4), Some(2))
    );
    for d in ["total_duration", "prompt_eval_duration", "eval_duration"] {
        assert!(done[d].is_u64(), "{d}: {done}");
    }
    assert!(
        rig.shows(r#"sluice_gateway_streams_total{outcome="success",route="ollama-chat"} 1"#)
            .await
    );
}

/// `stream: false`: one object, the whole answer; `/api/generate` says `response`.
#[tokio::test]
async fn whole_answers_are_one_object_and_generate_says_response() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/api/generate",
        &[],
        json!({"model": "routed", "prompt": "hi", "system": "be brief", "stream": false}),
    );
    rig.serve_models().await;
    let (id, sent) = rig.request().await;
    assert!(!sent.streaming);
    assert_eq!(
        (sent.system.as_str(), sent.prompt.as_str()),
        ("be brief", "hi")
    );
    rig.answer(&id, "a1", piece("Hello", true)).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(v["response"], "Hello");
    assert_eq!(v["done"], true);
    assert_eq!(v["done_reason"], "stop");
    assert_eq!(
        (v["prompt_eval_count"].as_u64(), v["eval_count"].as_u64()),
        (Some(2), Some(1))
    );
    assert!(v.get("message").is_none());
}

/// Tool calls go out whole, in one line before `done`, their arguments objects.
#[tokio::test]
async fn tool_calls_are_sent_whole_with_object_arguments() {
    let mut rig = Rig::start().await;
    let call = rig.post("/api/chat", &[],
        json!({"model": "routed", "messages": [{"role": "user", "content": "weather?"}],
               "tools": [{"type": "function", "function": {"name": "get_weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}),
    );
    rig.serve_models().await;
    let (id, sent) = rig.request().await;
    assert_eq!(
        sent.tools.as_ref().map(|t| t[0].name.as_str()),
        Some("get_weather")
    );
    let first = TextCompletionResponse {
        tool_calls: vec![ToolCallDelta {
            index: 0,
            id: Some("call_1".into()),
            name: Some("get_weather".into()),
            arguments: "{\"city\":".into(),
        }],
        ..TextCompletionResponse::default()
    };
    rig.answer(&id, "a1", first).await;
    let mut last = piece("", true);
    last.tool_calls = vec![ToolCallDelta {
        index: 0,
        arguments: "\"Paris\"}".into(),
        ..ToolCallDelta::default()
    }];
    last.finish_reason = Some("tool_calls".into());
    rig.answer(&id, "a1", last).await;
    let lines = lines(&text(call.await.unwrap()).await);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(
        lines[0]["message"]["tool_calls"],
        json!([{"id": "call_1", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}])
    );
    assert_eq!(lines[0]["done"], false);
    assert_eq!(
        lines[1]["done_reason"], "stop",
        "Ollama says stop after calls"
    );
}

/// An error before the first line is an HTTP error with its status; after it, one
/// `{"error": ...}` line ends the stream.
#[tokio::test]
async fn errors_are_a_status_before_the_first_line_and_an_error_line_after() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/api/chat",
        &[],
        json!({"model": "routed", "messages": [{"role": "user", "content": "hi"}]}),
    );
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    let refused = Error::new(ErrorKind::TooManyRequests, "the provider is rate limited");
    rig.answer(&id, "a1", TextCompletionResponse::from_error(refused))
        .await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(v, json!({"error": "the provider is rate limited"}));

    let call = rig.post(
        "/api/generate",
        &[],
        json!({"model": "routed", "prompt": "hi"}),
    );
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("Hel", false)).await;
    let broke = Error::new(ErrorKind::Llm, "model overloaded");
    rig.answer(&id, "a1", TextCompletionResponse::from_error(broke))
        .await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let lines = lines(&text(resp).await);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["response"], "Hel");
    assert_eq!(lines[1], json!({"error": "model overloaded"}));
    assert!(
        rig.shows(r#"sluice_gateway_streams_total{outcome="error",route="ollama-generate"} 1"#)
            .await
    );
}

/// A restart before the first line starts the answer over unseen (its counts the new
/// attempt's); after it, Ollama's lines cannot take text back: an error line ends the stream.
#[tokio::test]
async fn a_restart_starts_over_before_the_first_line_and_ends_the_stream_after_it() {
    let mut rig = Rig::start().await;
    let ask = json!({"model": "routed", "messages": [{"role": "user", "content": "hi"}]});
    let call = rig.post("/api/chat", &[], ask.clone());
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    let mut silent = piece("", false);
    silent.in_token = Some(50);
    rig.answer(&id, "a1", silent).await;
    rig.answer(&id, "a2", piece("full", true)).await;
    let got = lines(&text(call.await.unwrap()).await);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0]["message"]["content"], "full");
    assert_eq!(got[1]["prompt_eval_count"], 2, "the new attempt's alone");

    let call = rig.post("/api/chat", &[], ask);
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("par", false)).await;
    rig.answer(&id, "a2", piece("full", true)).await;
    let got = lines(&text(call.await.unwrap()).await);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0]["message"]["content"], "par");
    let error = got[1]["error"].as_str().unwrap();
    assert!(error.contains("went away mid-answer"), "{error}");
}

/// A caller that stops reading and goes away cancels the request on the bus.
#[tokio::test]
async fn a_caller_that_goes_away_cancels_the_request() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/api/chat",
        &[],
        json!({"model": "routed", "messages": [{"role": "user", "content": "hi"}]}),
    );
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("Hel", false)).await;
    let resp = call.await.unwrap();
    let mut body = resp.into_body().into_data_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("Hel"));
    drop(body);
    let cancel = tokio::time::timeout(Duration::from_secs(10), rig.cancels.next())
        .await
        .expect("a cancel")
        .unwrap()
        .unwrap();
    assert_eq!(cancel.property(properties::ID), Some(id.as_str()));
    cancel.ack();
    assert!(
        rig.shows(r#"sluice_gateway_streams_total{outcome="cancelled",route="ollama-chat"} 1"#)
            .await
    );
}

/// A model the processors do not serve is Ollama's 404; a request with nothing to answer only
/// "loads" the model, as Ollama answers it, and sends nothing.
#[tokio::test]
async fn an_unknown_model_is_a_404_and_an_empty_request_a_load() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/api/chat",
        &[],
        json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    );
    rig.serve_models().await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(v, json!({"error": "model 'nope' not found"}));
    // `keep_alive: 0` (a number of seconds, or a duration) with nothing to answer is
    // Ollama's way to unload the model: it answers `unload`.
    for (path, body, reason) in [
        (
            "/api/chat",
            json!({"model": "routed", "messages": []}),
            "load",
        ),
        ("/api/generate", json!({"model": "routed"}), "load"),
        (
            "/api/chat",
            json!({"model": "routed", "messages": [], "keep_alive": "5m"}),
            "load",
        ),
        (
            "/api/chat",
            json!({"model": "routed", "messages": [], "keep_alive": 0}),
            "unload",
        ),
        (
            "/api/generate",
            json!({"model": "routed", "keep_alive": "0s"}),
            "unload",
        ),
        (
            "/api/generate",
            json!({"model": "routed", "keep_alive": "0"}),
            "unload",
        ),
    ] {
        let v: Value =
            serde_json::from_str(&text(rig.post(path, &[], body).await.unwrap()).await).unwrap();
        assert_eq!(
            (v["done"].as_bool(), v["done_reason"].as_str()),
            (Some(true), Some(reason)),
            "{v}"
        );
    }
}

/// Bodies that are not Ollama's requests get a 4xx in Ollama's shape (`{"error": "..."}`,
/// nothing else), never a 5xx, whatever they hold; on a gateway with no service, a body that
/// reads well is a 404 (the service), not a 5xx either.
#[tokio::test]
async fn malformed_bodies_get_ollamas_error_shape_never_a_500() {
    let telemetry = Telemetry::new().unwrap();
    let bus = Arc::new(MemoryBus::new(1 << 20, 16));
    let gateway = Gateway::start(bus, GatewayConfig::new(), &telemetry)
        .await
        .unwrap();
    let router = gateway.router();
    let bodies: &[&str] = &[
        "",
        "   ",
        "{",
        "[]",
        "\"a prompt\"",
        "null",
        r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
        r#"{"model": ""}"#,
        r#"{"model": 7}"#,
        r#"{"model": "m", "stream": "yes"}"#,
        r#"{"model": "m", "messages": "hi"}"#,
        r#"{"model": "m", "messages": [{"content": "no role"}]}"#,
        r#"{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": 5}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}"#,
        r#"{"model": "m", "messages": [{"role": "tool", "content": "orphan"}]}"#,
        r#"{"model": "m", "prompt": "x", "options": {"temperature": "hot"}}"#,
        r#"{"model": "m", "prompt": "x", "options": {"num_ctx": [1]}}"#,
        r#"{"model": "m", "prompt": "x", "options": {"stop": "END"}}"#,
        r#"{"model": "m", "prompt": "x", "options": {"top_k": 40}}"#,
        r#"{"model": "m", "prompt": "x", "options": 3}"#,
        r#"{"model": "m", "prompt": "x", "format": "yaml"}"#,
        r#"{"model": "m", "prompt": "x", "format": 1}"#,
        r#"{"model": "m", "prompt": "x", "think": true}"#,
        r#"{"model": "m", "prompt": "x", "logprobs": true}"#,
        r#"{"model": "m", "prompt": "x", "tools": [{"function": {"name": "bad name!"}}]}"#,
        r#"{"model": "m", "prompt": "x", "tools": [{"type": "function"}]}"#,
        r#"{"model": "m", "prompt": "x", "suffix": "end"}"#,
        r#"{"model": "m", "prompt": "x", "raw": true}"#,
        r#"{"model": "m", "prompt": "x", "context": [1, 2]}"#,
        r#"{"model": "m", "prompt": "x", "images": ["aGk="]}"#,
        r#"{"model": "m", "prompt": "x", "template": "{{ .Prompt }}"}"#,
        r#"{"model": "m", "prompt": "x"}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "x"}]}"#,
    ];
    for path in ["/api/chat", "/api/generate"] {
        for body in bodies {
            let req = Request::post(path)
                .header("host", "localhost")
                .header("content-type", "application/json")
                .body(Body::from(*body))
                .unwrap();
            let resp = router.clone().oneshot(req).await.unwrap();
            let status = resp.status();
            assert!(status.is_client_error(), "{path} {body}: {status}");
            let v: Value = serde_json::from_str(&text(resp).await).unwrap();
            let fields: Vec<&String> = v.as_object().unwrap().keys().collect();
            assert_eq!(fields, ["error"], "{path} {body}: {v}");
            assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
            if status == StatusCode::BAD_REQUEST {
                // A value is never echoed: the body holds prompts.
                for secret in ["hot", "yes", "wizard", "orphan", "aGk="] {
                    assert!(
                        !v["error"].as_str().unwrap().contains(secret),
                        "{body}: {v}"
                    );
                }
            }
        }
    }
}

/// The checks in front of every route refuse in Ollama's shape on its paths: a body not
/// declared JSON (a plain `curl -d`) 415, a web page of another origin 403.
#[tokio::test]
async fn the_checks_in_front_refuse_in_ollamas_shape() {
    let rig = Rig::start().await;
    for (path, header, value, status) in [
        (
            "/api/chat",
            "content-type",
            "application/x-www-form-urlencoded",
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        (
            "/api/generate",
            "origin",
            "https://evil.example",
            StatusCode::FORBIDDEN,
        ),
    ] {
        let mut req = Request::post(path)
            .header("host", "localhost")
            .header(header, value);
        if header != "content-type" {
            req = req.header("content-type", "application/json");
        }
        // As a real client sends it: the body's length declared, which the check looks at.
        let body = r#"{"model": "routed", "prompt": "hi"}"#;
        let req = req
            .header("content-length", body.len())
            .body(Body::from(body))
            .unwrap();
        let resp = rig.router.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), status, "{path}");
        let v: Value = serde_json::from_str(&text(resp).await).unwrap();
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 1, "{v}");
    }
}

#[test]
fn created_at_is_rfc_3339_in_utc_with_nanoseconds() {
    let at = |secs: u64, nanos: u32| {
        created_at(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_nanos(u64::from(nanos)))
    };
    assert_eq!(at(0, 0), "1970-01-01T00:00:00.000000000Z");
    // Ollama's own example line.
    assert_eq!(
        at(1_691_176_965, 499_127_000),
        "2023-08-04T19:22:45.499127000Z"
    );
    assert_eq!(at(951_782_400, 1), "2000-02-29T00:00:00.000000001Z");
    assert_eq!(at(4_102_444_799, 0), "2099-12-31T23:59:59.000000000Z");
}
