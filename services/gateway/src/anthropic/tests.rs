//! The Messages route through the router on the in-process bus, text-completion played by the
//! test: a stream's events byte for byte, a whole message, tool use streamed and whole,
//! errors before and after the first event, a caller that goes away (the cancel), the key as
//! `x-api-key`, and bodies that are not Messages requests (a 4xx in Anthropic's shape, never
//! a 5xx).

use std::{sync::Arc, time::Duration};

use axum::{
    body::Body,
    http::{Request, Response, StatusCode, header},
};
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_runtime::{bus::memory::MemoryBus, secret::Secret, telemetry::Telemetry};
use sluice_schema::{
    Error, ErrorKind, ResponseRecord, TextCompletionRequest, TextCompletionResponse, ToolCallDelta,
    properties,
};
use tower::ServiceExt;

use crate::{
    Auth, Gateway, GatewayConfig,
    testing::{Rig, body as text, piece},
};

const KEY: &str = "sk-ant-gateway-test";

/// Starts the rig with the gateway behind [`KEY`].
async fn rig() -> Rig {
    Rig::start_with(|c| c.auth = Auth::new(Some(Secret::new(KEY)))).await
}

/// Posts `body` as Anthropic's SDKs do: the key as `x-api-key`, `anthropic-version`.
fn post(rig: &Rig, body: Value) -> tokio::task::JoinHandle<Response<Body>> {
    rig.post(
        "/v1/messages",
        &[("x-api-key", KEY), ("anthropic-version", "2023-06-01")],
        body,
    )
}

fn call_piece(index: u32, head: Option<(&str, &str)>, arguments: &str) -> ToolCallDelta {
    ToolCallDelta {
        index,
        id: head.map(|(id, _)| id.to_owned()),
        name: head.map(|(_, name)| name.to_owned()),
        arguments: arguments.to_owned(),
    }
}

/// The SSE events of a body: (name, data).
fn events(body: &str) -> Vec<(String, Value)> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    body.split_terminator("\n\n")
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap().to_owned();
            let data = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            (name, data)
        })
        .collect()
}

fn hello(stream: bool) -> Value {
    json!({"model": "routed", "max_tokens": 32, "stream": stream,
           "messages": [{"role": "user", "content": "hi"}]})
}

/// A streamed answer is Anthropic's events, byte for byte: the message with empty content and
/// the input tokens so far, the text block with a ping after its start, its deltas, its stop,
/// the stop reason with the usage totals, the end; the request carries the settings.
#[tokio::test]
async fn a_stream_is_anthropics_events_byte_for_byte() {
    let mut rig = rig().await;
    let mut ask = hello(true);
    ask["temperature"] = json!(0.2);
    let call = post(&rig, ask);
    rig.serve_models().await;
    let (id, sent): (String, TextCompletionRequest) = rig.llm.request().await;
    assert!(sent.streaming);
    assert_eq!(
        (sent.prompt.as_str(), sent.max_tokens, sent.temperature),
        ("hi", Some(32), Some(0.2))
    );
    rig.answer(&id, "a1", piece("Hel", false)).await;
    let mut end = piece("lo", true);
    end.finish_reason = Some("length".into());
    rig.answer(&id, "a1", end).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()[header::CONTENT_TYPE],
        "text/event-stream; charset=utf-8"
    );
    assert_eq!(resp.headers()["x-accel-buffering"], "no");
    let request_id = resp.headers()["request-id"].to_str().unwrap().to_owned();
    let simple = id.replace('-', "");
    assert_eq!(request_id, format!("req_{simple}"));
    let body = text(resp).await;
    let want = [
        format!(
            r#"event: message_start
data: {{"type":"message_start","message":{{"id":"msg_{simple}","type":"message","role":"assistant","model":"routed","content":[],"stop_reason":null,"stop_sequence":null,"usage":{{"input_tokens":2,"output_tokens":1}}}}}}"#
        ),
        r#"event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#
            .into(),
        r#"event: ping
data: {"type": "ping"}"#
            .into(),
        r#"event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hel"}}"#
            .into(),
        r#"event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"lo"}}"#
            .into(),
        r#"event: content_block_stop
data: {"type":"content_block_stop","index":0}"#
            .into(),
        r#"event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"input_tokens":4,"output_tokens":2}}"#
            .into(),
        r#"event: message_stop
data: {"type":"message_stop"}"#
            .into(),
    ];
    let got: Vec<&str> = body.split_terminator("\n\n").collect();
    assert_eq!(got, want, "{body}");
    assert!(
        rig.shows(
            r#"sluice_gateway_streams_total{outcome="success",route="anthropic-messages"} 1"#
        )
        .await
    );
}

/// Without `stream`, one `message` object, its fields in Anthropic's order.
#[tokio::test]
async fn a_whole_answer_is_one_message_object() {
    let mut rig = rig().await;
    let call = post(&rig, hello(false));
    rig.serve_models().await;
    let (id, sent): (String, TextCompletionRequest) = rig.llm.request().await;
    assert!(!sent.streaming);
    rig.answer(&id, "a1", piece("Hello", false)).await;
    rig.answer(&id, "a1", piece(" there", true)).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = text(resp).await;
    let simple = id.replace('-', "");
    assert_eq!(
        body,
        format!(
            r#"{{"id":"msg_{simple}","type":"message","role":"assistant","model":"routed","content":[{{"type":"text","text":"Hello there"}}],"stop_reason":"end_turn","stop_sequence":null,"usage":{{"input_tokens":4,"output_tokens":2}}}}"#
        )
    );
}

/// Tool use, streamed: the text block, then the first call's `tool_use` block with its input
/// as `input_json_delta` fragments as they come; a second call whose pieces interleave with
/// the first is held and sent whole after it (Anthropic's blocks never interleave); the
/// answer ends `tool_use`. Whole: the text block and the calls' blocks with parsed input.
#[tokio::test]
async fn tool_use_streams_as_blocks_in_order_and_whole_with_parsed_input() {
    let mut rig = rig().await;
    let mut ask = hello(true);
    ask["tools"] = json!([
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}},
        {"name": "get_time", "input_schema": {"type": "object"}}]);
    let call = post(&rig, ask.clone());
    rig.serve_models().await;
    let (id, sent): (String, TextCompletionRequest) = rig.llm.request().await;
    assert_eq!(sent.tools.as_ref().map(Vec::len), Some(2));
    rig.answer(&id, "a1", piece("Looking.", false)).await;
    let mut r = piece("", false);
    r.tool_calls = vec![
        call_piece(0, Some(("toolu_a", "get_weather")), ""),
        call_piece(1, Some(("toolu_b", "get_time")), "{}"),
        call_piece(0, None, "{\"q\":"),
    ];
    rig.answer(&id, "a1", r).await;
    let mut end = piece("", true);
    end.tool_calls = vec![call_piece(0, None, "\"Paris\"}")];
    end.finish_reason = Some("tool_calls".into());
    rig.answer(&id, "a1", end).await;
    let got = events(&text(call.await.unwrap()).await);
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(
        got[5].1["content_block"],
        json!({"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}})
    );
    assert_eq!(got[5].1["index"], 1);
    let fragments: Vec<&str> = got[6..8]
        .iter()
        .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap())
        .collect();
    assert_eq!(fragments, ["{\"q\":", "\"Paris\"}"]);
    assert_eq!(got[9].1["content_block"]["id"], "toolu_b");
    assert_eq!(got[9].1["index"], 2);
    assert_eq!(got[10].1["index"], 2);
    assert_eq!(got[12].1["delta"]["stop_reason"], "tool_use");

    ask["stream"] = json!(false);
    let call = post(&rig, ask);
    let (id, _): (String, TextCompletionRequest) = rig.llm.request().await;
    let mut end = piece("Looking.", true);
    end.tool_calls = vec![
        call_piece(0, Some(("toolu_a", "get_weather")), "{\"q\":\"Paris\"}"),
        call_piece(1, Some(("toolu_b", "get_time")), ""),
    ];
    end.finish_reason = Some("stop".into());
    rig.answer(&id, "a1", end).await;
    let v: Value = serde_json::from_str(&text(call.await.unwrap()).await).unwrap();
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "Looking."},
               {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"q": "Paris"}},
               {"type": "tool_use", "id": "toolu_b", "name": "get_time", "input": {}}])
    );
    assert_eq!(v["stop_reason"], "tool_use", "calls end tool_use");
}

/// An error before the first event is an HTTP error in Anthropic's shape with its status;
/// after it, an `event: error` ends the stream.
#[tokio::test]
async fn errors_are_a_status_before_the_first_event_and_an_error_event_after() {
    let mut rig = rig().await;
    let call = post(&rig, hello(true));
    rig.serve_models().await;
    let (id, _): (String, TextCompletionRequest) = rig.llm.request().await;
    let refused = Error::new(ErrorKind::TooManyRequests, "the provider is rate limited");
    rig.answer(&id, "a1", TextCompletionResponse::from_error(refused))
        .await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(
        v,
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": "the provider is rate limited"}})
    );

    let call = post(&rig, hello(true));
    let (id, _): (String, TextCompletionRequest) = rig.llm.request().await;
    rig.answer(&id, "a1", piece("Hel", false)).await;
    let broke = Error::new(ErrorKind::Llm, "model overloaded");
    rig.answer(&id, "a1", TextCompletionResponse::from_error(broke))
        .await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let got = events(&text(resp).await);
    let (name, data) = got.last().unwrap();
    assert_eq!(name, "error");
    assert_eq!(
        data,
        &json!({"type": "error", "error": {"type": "api_error", "message": "model overloaded"}})
    );
    assert!(
        rig.shows(r#"sluice_gateway_streams_total{outcome="error",route="anthropic-messages"} 1"#)
            .await
    );
}

/// A caller that stops reading and goes away cancels the request on the bus.
#[tokio::test]
async fn a_caller_that_goes_away_cancels_the_request() {
    let mut rig = rig().await;
    let call = post(&rig, hello(true));
    rig.serve_models().await;
    let (id, _): (String, TextCompletionRequest) = rig.llm.request().await;
    rig.answer(&id, "a1", piece("Hel", false)).await;
    let resp = call.await.unwrap();
    let mut body = resp.into_body().into_data_stream();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("Hel") {
        seen.extend_from_slice(&body.next().await.unwrap().unwrap());
    }
    drop(body);
    let cancel = tokio::time::timeout(Duration::from_secs(10), rig.cancels.next())
        .await
        .expect("a cancel")
        .unwrap()
        .unwrap();
    assert_eq!(cancel.property(properties::ID), Some(id.as_str()));
    cancel.ack();
    assert!(
        rig.shows(
            r#"sluice_gateway_streams_total{outcome="cancelled",route="anthropic-messages"} 1"#
        )
        .await
    );
}

/// The key as `x-api-key` (or `Authorization: Bearer`); a wrong or missing one is
/// `authentication_error`; a model not served `not_found_error`, both before anything is sent.
#[tokio::test]
async fn keys_and_models_are_refused_in_anthropics_shape() {
    let mut rig = rig().await;
    for (name, value) in [
        ("x-api-key", "sk-wrong"),
        ("authorization", "Bearer sk-wrong"),
    ] {
        let req = Request::post("/v1/messages")
            .header("content-type", "application/json")
            .header(name, value)
            .body(Body::from(hello(false).to_string()))
            .unwrap();
        let resp = rig.router.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        let v: Value = serde_json::from_str(&text(resp).await).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    }
    let mut ask = hello(false);
    ask["model"] = json!("nope");
    let call = post(&rig, ask);
    rig.serve_models().await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(
        v,
        json!({"type": "error", "error": {"type": "not_found_error", "message": "model: nope"}})
    );
    // The bearer form passes too.
    let req = Request::post("/v1/messages")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {KEY}"))
        .body(Body::from(hello(false).to_string()))
        .unwrap();
    let router = rig.router.clone();
    let call = tokio::spawn(async move { router.oneshot(req).await.unwrap() });
    let (id, _): (String, TextCompletionRequest) = rig.llm.request().await;
    rig.answer(&id, "a1", piece("ok", true)).await;
    assert_eq!(call.await.unwrap().status(), StatusCode::OK);
}

/// Bodies that are not Messages requests get a 4xx in Anthropic's shape, never a 5xx,
/// whatever they hold; so do the checks in front of every route, and paths under
/// `/v1/messages` sluice does not serve.
#[tokio::test]
async fn malformed_bodies_get_anthropics_error_shape_never_a_500() {
    let telemetry = Telemetry::new().unwrap();
    let bus = Arc::new(MemoryBus::new(1 << 20, 16));
    let gateway = Gateway::start(bus, GatewayConfig::new(), &telemetry)
        .await
        .unwrap();
    let router = gateway.router();
    let bodies: &[&str] = &[
        "",
        "{",
        "[]",
        "\"a prompt\"",
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#,
        r#"{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}"#,
        r#"{"model": "m", "max_tokens": "many", "messages": []}"#,
        r#"{"model": "m", "max_tokens": 1, "messages": "hi"}"#,
        r#"{"model": "m", "max_tokens": 1, "messages": [{"content": "no role"}]}"#,
        r#"{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]}"#,
        r#"{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [7]}]}"#,
        r#"{"model": "m", "max_tokens": 1, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]}"#,
        r#"{"model": "m", "max_tokens": 1, "extra": 1, "messages": [{"role": "user", "content": "x"}]}"#,
        // Reads well: the service is not enabled here, a 404.
        r#"{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}"#,
    ];
    for body in bodies {
        let req = Request::post("/v1/messages")
            .header("content-type", "application/json")
            .body(Body::from(*body))
            .unwrap();
        let resp = router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        assert!(status.is_client_error(), "{body}: {status}");
        let v: Value = serde_json::from_str(&text(resp).await).unwrap();
        assert_eq!(v["type"], "error", "{body}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
        assert!(
            v["error"]["type"].as_str().unwrap().ends_with("error"),
            "{v}"
        );
    }
    for (method, path, content_type, status) in [
        (
            "POST",
            "/v1/messages",
            "text/plain",
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        (
            "GET",
            "/v1/messages",
            "application/json",
            StatusCode::METHOD_NOT_ALLOWED,
        ),
        (
            "POST",
            "/v1/messages/count_tokens",
            "application/json",
            StatusCode::NOT_FOUND,
        ),
    ] {
        let body = hello(false).to_string();
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost")
            .header("content-type", content_type)
            .header("content-length", body.len())
            .body(Body::from(body))
            .unwrap();
        let resp = router.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), status, "{method} {path}");
        let v: Value = serde_json::from_str(&text(resp).await).unwrap();
        assert_eq!(v["type"], "error", "{v}");
        assert!(v["error"]["type"].is_string(), "{v}");
    }
}

/// `GET /v1/models` asked as Anthropic's SDKs ask (`anthropic-version`, the key as
/// `x-api-key`) lists the served models in Anthropic's shape, and one by id; without the
/// header, the path stays OpenAI's.
#[tokio::test]
async fn models_are_listed_in_anthropics_shape_when_its_sdk_asks() {
    let mut rig = rig().await;
    let routes = rig.router.clone();
    let get = |path: &str, anthropic: bool| {
        let mut req = Request::get(path).header("host", "localhost");
        req = if anthropic {
            req.header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01")
        } else {
            req.header("authorization", format!("Bearer {KEY}"))
        };
        let router = routes.clone();
        let req = req.body(Body::empty()).unwrap();
        tokio::spawn(async move { router.oneshot(req).await.unwrap() })
    };
    let call = get("/v1/models", true);
    rig.serve_models().await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    let model = json!({"type": "model", "id": "routed", "display_name": "routed",
                       "created_at": "1970-01-01T00:00:00Z"});
    assert_eq!(
        v,
        json!({"data": [model], "has_more": false, "first_id": "routed", "last_id": "routed"})
    );
    // Cached: no second list-models request.
    let v: Value =
        serde_json::from_str(&text(get("/v1/models/routed", true).await.unwrap()).await).unwrap();
    assert_eq!(v, model);
    let resp = get("/v1/models/nope", true).await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(v["error"]["type"], "not_found_error");
    let call = get("/v1/models", false);
    rig.serve_models().await;
    let v: Value = serde_json::from_str(&text(call.await.unwrap()).await).unwrap();
    assert_eq!(v["object"], "list", "OpenAI's: {v}");
}
