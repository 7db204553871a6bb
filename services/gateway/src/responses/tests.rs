//! The Responses route through the router on the in-process bus, text-completion played by
//! the test: a whole `response` object, the streamed semantic events in order, function
//! calls, the token limit (`incomplete`), errors before and after the first event, a caller
//! that goes away (the cancel), and bodies that are not Responses requests (a 400 in OpenAI's
//! shape, never a 5xx).

use std::time::Duration;

use axum::{
    body::Body,
    http::{Request, StatusCode, header},
};
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_schema::{
    Error, ErrorKind, ResponseRecord, TextCompletionResponse, ToolCallDelta, properties,
};
use tower::ServiceExt;

use crate::testing::{Rig, body as text, piece};

/// The SSE events of a body: `(event name, data)`, checking that each `event:` names its
/// data's `type` and that the sequence numbers count from 0.
fn events(body: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for block in body.split("\n\n").filter(|b| !b.is_empty()) {
        let mut lines = block.lines();
        let name = lines
            .next()
            .unwrap()
            .strip_prefix("event: ")
            .unwrap()
            .to_owned();
        let data: Value =
            serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["type"], name.as_str(), "{block}");
        assert_eq!(data["sequence_number"], out.len(), "{block}");
        out.push((name, data));
    }
    out
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

/// Whole: one `response` object, completed, its message's text, usage and ids.
#[tokio::test]
async fn a_whole_answer_is_one_response_object() {
    let mut rig = Rig::start().await;
    let call = rig.post("/v1/responses", &[],
        json!({"model": "routed", "input": "hi", "instructions": "be brief", "max_output_tokens": 30}),
    );
    rig.serve_models().await;
    let (id, sent) = rig.request().await;
    assert!(!sent.streaming);
    assert_eq!(
        (sent.system.as_str(), sent.prompt.as_str()),
        ("be brief", "hi")
    );
    assert_eq!(sent.max_tokens, Some(30));
    rig.answer(&id, "a1", piece("Hello", true)).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(v["object"], "response");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["incomplete_details"], Value::Null);
    assert_eq!(v["instructions"], "be brief");
    assert_eq!(v["max_output_tokens"], 30);
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{v}");
    assert_eq!(output[0]["type"], "message");
    assert!(output[0]["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(output[0]["status"], "completed");
    assert_eq!(
        output[0]["content"],
        json!([{"type": "output_text", "text": "Hello", "annotations": []}])
    );
    assert_eq!(
        v["usage"],
        json!({"input_tokens": 2, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
               "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": 3})
    );
}

/// Streamed: the lifecycle events, the message item, its text in deltas, the dones and
/// `response.completed` with the whole response and the usage summed over the records.
#[tokio::test]
async fn a_stream_is_the_semantic_events_in_order() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/v1/responses",
        &[],
        json!({"model": "routed", "input": [{"role": "user", "content": "hi"}], "stream": true}),
    );
    rig.serve_models().await;
    let (id, sent) = rig.request().await;
    assert!(sent.streaming);
    rig.answer(&id, "a1", piece("Hel", false)).await;
    rig.answer(&id, "a1", piece("lo", true)).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()[header::CONTENT_TYPE],
        "text/event-stream; charset=utf-8"
    );
    assert_eq!(resp.headers()["x-accel-buffering"], "no");
    let got = events(&text(resp).await);
    assert_eq!(
        names(&got),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    let created = &got[0].1["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    let deltas: Vec<&str> = got
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, ["Hel", "lo"]);
    assert_eq!(got[6].1["text"], "Hello");
    let done = &got[9].1["response"];
    assert_eq!(done["id"], created["id"]);
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
    assert_eq!(done["output"][0]["id"], got[2].1["item"]["id"]);
    assert_eq!(done["usage"]["input_tokens"], 4);
    assert_eq!(done["usage"]["total_tokens"], 6);
    assert!(
        rig.shows(r#"sluice_gateway_streams_total{outcome="success",route="openai-responses"} 1"#)
            .await
    );
}

/// Function calls: an item per call, its arguments streamed in deltas and done; whole, a
/// `function_call` item with `call_id`, `name` and `arguments`. At the token limit the
/// response is `incomplete` (`response.incomplete`).
#[tokio::test]
async fn function_calls_are_items_and_the_token_limit_is_incomplete() {
    let mut rig = Rig::start().await;
    let ask = json!({"model": "routed", "input": "weather?", "stream": true,
        "tools": [{"type": "function", "name": "get_weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]});
    let call = rig.post("/v1/responses", &[], ask.clone());
    rig.serve_models().await;
    let (id, sent) = rig.request().await;
    assert_eq!(
        sent.tools.as_ref().map(|t| t[0].name.as_str()),
        Some("get_weather")
    );
    let calls = |end: bool| {
        let mut first = piece("", end);
        first.tool_calls = vec![ToolCallDelta {
            index: 0,
            id: Some("call_1".into()),
            name: Some("get_weather".into()),
            arguments: "{\"city\":".into(),
        }];
        first
    };
    rig.answer(&id, "a1", calls(false)).await;
    let mut last = piece("", true);
    last.tool_calls = vec![ToolCallDelta {
        index: 0,
        arguments: "\"Paris\"}".into(),
        ..ToolCallDelta::default()
    }];
    last.finish_reason = Some("tool_calls".into());
    rig.answer(&id, "a1", last).await;
    let got = events(&text(call.await.unwrap()).await);
    assert_eq!(
        names(&got),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    assert_eq!(got[2].1["item"]["call_id"], "call_1");
    assert_eq!(got[5].1["arguments"], "{\"city\":\"Paris\"}");
    let item = &got[7].1["response"]["output"][0];
    assert_eq!(
        (
            &item["type"],
            &item["call_id"],
            &item["name"],
            &item["arguments"],
            &item["status"]
        ),
        (
            &json!("function_call"),
            &json!("call_1"),
            &json!("get_weather"),
            &json!("{\"city\":\"Paris\"}"),
            &json!("completed")
        )
    );

    let mut whole = ask.clone();
    whole["stream"] = json!(false);
    let call = rig.post("/v1/responses", &[], whole);
    let (id, _) = rig.request().await;
    let mut only = calls(true);
    only.tool_calls[0].arguments = "{}".into();
    rig.answer(&id, "a1", only).await;
    let v: Value = serde_json::from_str(&text(call.await.unwrap()).await).unwrap();
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "only the call: {v}");
    assert_eq!(output[0]["type"], "function_call");
    assert!(output[0]["id"].as_str().unwrap().starts_with("fc_"));
    assert_eq!(output[0]["arguments"], "{}");

    let call = rig.post(
        "/v1/responses",
        &[],
        json!({"model": "routed", "input": "x", "stream": true}),
    );
    let (id, _) = rig.request().await;
    let mut cut = piece("long", true);
    cut.finish_reason = Some("length".into());
    rig.answer(&id, "a1", cut).await;
    let got = events(&text(call.await.unwrap()).await);
    let (name, last) = got.last().unwrap();
    assert_eq!(name, "response.incomplete");
    assert_eq!(last["response"]["status"], "incomplete");
    assert_eq!(
        last["response"]["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
}

/// An error before the first event is an HTTP error in OpenAI's shape with its status;
/// after it, an `error` event and `response.failed` end the stream.
#[tokio::test]
async fn errors_are_a_status_before_the_first_event_and_failed_after() {
    let mut rig = Rig::start().await;
    let ask = json!({"model": "routed", "input": "hi", "stream": true});
    let call = rig.post("/v1/responses", &[], ask.clone());
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    let refused = Error::new(ErrorKind::TooManyRequests, "the provider is rate limited");
    rig.answer(&id, "a1", TextCompletionResponse::from_error(refused))
        .await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(v["error"]["message"], "the provider is rate limited");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");

    let call = rig.post("/v1/responses", &[], ask);
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("Hel", false)).await;
    let broke = Error::new(ErrorKind::Llm, "model overloaded");
    rig.answer(&id, "a1", TextCompletionResponse::from_error(broke))
        .await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let got = events(&text(resp).await);
    let n = got.len();
    assert_eq!(names(&got)[n - 2..], ["error", "response.failed"]);
    assert_eq!(got[n - 2].1["message"], "model overloaded");
    assert_eq!(got[n - 2].1["code"], "llm-error");
    let failed = &got[n - 1].1["response"];
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["error"]["message"], "model overloaded");
    assert_eq!(failed["output"][0]["content"][0]["text"], "Hel");
    assert!(
        rig.shows(r#"sluice_gateway_streams_total{outcome="error",route="openai-responses"} 1"#)
            .await
    );
}

/// A caller that stops reading and goes away cancels the request on the bus.
#[tokio::test]
async fn a_caller_that_goes_away_cancels_the_request() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/v1/responses",
        &[],
        json!({"model": "routed", "input": "hi", "stream": true}),
    );
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("Hel", false)).await;
    let resp = call.await.unwrap();
    let mut body = resp.into_body().into_data_stream();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"Hel\"") {
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
            r#"sluice_gateway_streams_total{outcome="cancelled",route="openai-responses"} 1"#
        )
        .await
    );
}

/// Bodies that are not Responses requests, a wrong key and an unknown model: OpenAI's error
/// shape and status, never a 5xx; nothing reaches the bus.
#[tokio::test]
async fn refusals_are_openais_shape() {
    let mut rig = Rig::start().await;
    for body in [
        "{",
        r#"{"model": "routed"}"#,
        r#"{"model": "routed", "input": "x", "n": 2}"#,
    ] {
        let req = Request::post("/v1/responses")
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let resp = rig.router.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{body}");
        let v: Value = serde_json::from_str(&text(resp).await).unwrap();
        let e = v["error"].as_object().unwrap();
        assert_eq!(e.len(), 4, "{v}");
        assert_eq!(e["type"], "invalid_request_error");
    }
    let call = rig.post("/v1/responses", &[], json!({"model": "nope", "input": "x"}));
    rig.serve_models().await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    let req = Request::get("/v1/responses")
        .header("host", "localhost")
        .body(Body::empty())
        .unwrap();
    let resp = rig.router.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
}

/// Text, then a tool call: the message is output 0 and the call output 1, both in the
/// completed response in that order; an answer with nothing in it is an empty message, as
/// whole.
#[tokio::test]
async fn text_before_a_call_and_an_empty_answer_keep_openais_items() {
    let mut rig = Rig::start().await;
    let ask = json!({"model": "routed", "input": "weather?", "stream": true,
        "tools": [{"type": "function", "name": "get_weather"}]});
    let call = rig.post("/v1/responses", &[], ask);
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("Let me look.", false)).await;
    let mut last = piece("", true);
    last.tool_calls = vec![ToolCallDelta {
        index: 0,
        id: Some("call_7".into()),
        name: Some("get_weather".into()),
        arguments: "{}".into(),
    }];
    rig.answer(&id, "a1", last).await;
    let got = events(&text(call.await.unwrap()).await);
    let added: Vec<(u64, &str)> = got
        .iter()
        .filter(|(n, _)| n == "response.output_item.added")
        .map(|(_, d)| {
            (
                d["output_index"].as_u64().unwrap(),
                d["item"]["type"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(added, [(0, "message"), (1, "function_call")]);
    let output = &got.last().unwrap().1["response"]["output"];
    assert_eq!(output[0]["content"][0]["text"], "Let me look.");
    assert_eq!(output[1]["call_id"], "call_7");
    assert_eq!(output[1]["status"], "completed");

    let call = rig.post(
        "/v1/responses",
        &[],
        json!({"model": "routed", "input": "x", "stream": true}),
    );
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("", true)).await;
    let got = events(&text(call.await.unwrap()).await);
    let output = &got.last().unwrap().1["response"]["output"];
    assert_eq!(
        output[0]["content"],
        json!([{"type": "output_text", "text": "", "annotations": []}]),
        "{output}"
    );
}
