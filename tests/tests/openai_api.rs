//! The gateway's OpenAI dialect end to end on the real broker: an OpenAI client -> gateway ->
//! Pulsar -> text-completion processor -> fake OpenAI provider, and back. The SSE framing is
//! checked at the byte level against OpenAI's documented format; a second, independent client
//! (async-openai) and, when `OPENAI_PY` names a python with OpenAI's own SDK
//! (scripts/openai-venv.sh makes one), the official Python SDK drive the same routes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use sluice_gateway::Auth;
use sluice_runtime::secret::Secret;
use sluice_tests::{GatewayStack, wait_for_metrics};

const TOKEN: &str = "oa-test-token-5d2e";

/// A stack serving `model`, with the fake's scripted models as extra models, behind a token.
async fn stack(model: &str) -> GatewayStack {
    stack_with(model, |_| {}).await
}

/// [`stack`], with the gateway's config adjusted by `configure`.
async fn stack_with(
    model: &str,
    configure: impl FnOnce(&mut sluice_gateway::GatewayConfig),
) -> GatewayStack {
    GatewayStack::start_serving(
        model,
        &["error_mid_stream", "stall", "gated", "unauthorized"],
        |gc| {
            gc.auth = Auth::new(Some(Secret::new(TOKEN)));
            configure(gc);
        },
    )
    .await
}

fn http() -> reqwest::Client {
    sluice_runtime::install_crypto_provider();
    reqwest::Client::new()
}

async fn post(s: &GatewayStack, body: Value) -> reqwest::Response {
    post_to(&s.url("/v1/chat/completions"), body).await
}

async fn post_to(url: &str, body: Value) -> reqwest::Response {
    http()
        .post(url)
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap()
}

fn hello(model: &str) -> Value {
    json!({"model": model, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "say hello"}]})
}

/// Splits an SSE body into its `data:` payloads, checking OpenAI's framing byte for byte:
/// every event is exactly `data: <payload>\n\n` (no `event:` line, no CR) after its resume id
/// (`id: <token>.<n>\n`, numbered from 1 with no gap: issue #25's resumable streams), apart
/// from `: ...` comment lines, and the body ends with `data: [DONE]\n\n`.
fn sse_data(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).expect("UTF-8");
    assert!(!text.contains('\r'), "LF only: {text:?}");
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "ends with [DONE]: {text:?}"
    );
    let mut out = Vec::new();
    let mut token = None;
    for event in text.split_terminator("\n\n") {
        if event.starts_with(':') {
            assert!(!event.contains('\n'), "one line per comment: {event:?}");
            continue;
        }
        let (id, data) = event
            .split_once('\n')
            .unwrap_or_else(|| panic!("no id line: {event:?}"));
        let (t, n) = id
            .strip_prefix("id: ")
            .and_then(|id| id.rsplit_once('.'))
            .unwrap_or_else(|| panic!("not an id line: {event:?}"));
        assert_eq!(
            n,
            (out.len() + 1).to_string(),
            "numbered in order: {event:?}"
        );
        assert_eq!(token.get_or_insert(t), &t, "one token per stream");
        assert!(!data.contains('\n'), "one data line per event: {event:?}");
        let data = data
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not a data line: {event:?}"));
        out.push(data.to_owned());
    }
    out
}

/// The data of one SSE event (after its id line).
fn event_data(event: &str) -> &str {
    let data = event.split_once('\n').map_or(event, |(_, d)| d);
    data.strip_prefix("data: ")
        .unwrap_or_else(|| panic!("not a data line: {event:?}"))
}

#[tokio::test]
async fn a_whole_answer_is_a_chat_completion_object() {
    let s = stack("m-whole").await;
    let resp = post(&s, hello("m-whole")).await;
    assert_eq!(resp.status(), 200);
    let request_id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["id"], request_id);
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert!(v["created"].as_u64().unwrap() > 1_700_000_000, "{v}");
    assert_eq!(v["model"], "m-whole");
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world!");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14})
    );
    // A single user turn reaches the provider as TrustGraph's system + prompt would.
    let sent = s.fake.last_body();
    assert_eq!(sent["stream"], false);
    assert_eq!(
        sent["messages"],
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello"}])
    );
    s.stop().await;
}

#[tokio::test]
async fn a_stream_is_openai_sse_with_a_role_chunk_a_finish_chunk_usage_and_done() {
    let s = stack("m-stream").await;
    let mut body = hello("m-stream");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = post(&s, body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    assert_eq!(resp.headers()["x-accel-buffering"], "no");
    let bytes = resp.bytes().await.unwrap();
    let data = sse_data(&bytes);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let id = chunks[0]["id"].clone();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert_eq!(c["id"], id, "one id per answer");
        assert_eq!(c["model"], "m-stream");
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"],
        json!({"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14})
    );
    for c in rest {
        assert!(c["usage"].is_null() && c.get("usage").is_some(), "{c}");
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
    }
    let (finish, tokens) = rest.split_last().unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    let text: String = tokens
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello world!");
    assert!(
        tokens.len() >= 4,
        "the answer arrives in pieces: {tokens:?}"
    );
    for c in tokens {
        assert!(c["choices"][0]["finish_reason"].is_null());
    }

    // Without include_usage there is no usage chunk and no usage field.
    let mut body = hello("m-stream");
    body["stream"] = json!(true);
    let bytes = post(&s, body).await.bytes().await.unwrap();
    let data = sse_data(&bytes);
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d).unwrap();
        assert!(c.get("usage").is_none(), "{c}");
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
    }
    s.stop().await;
}

#[tokio::test]
async fn a_conversation_and_sampling_settings_reach_the_provider() {
    let s = stack("m-multi").await;
    let resp = post(
        &s,
        json!({"model": "m-multi", "temperature": 0.25, "max_completion_tokens": 12,
               "stop": ["\n\n", "END"], "messages": [
            {"role": "system", "content": "answer in one word"},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}]}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let sent = s.fake.last_body();
    assert_eq!(
        sent["messages"],
        json!([
            {"role": "system", "content": "answer in one word"},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And of Italy?"}])
    );
    assert_eq!(sent["temperature"], 0.25);
    assert_eq!(sent["max_tokens"], 12);
    assert_eq!(sent["stop"], json!(["\n\n", "END"]));
    assert_eq!(sent["model"], "m-multi");

    // Another model the processor serves is called by its name.
    let resp = post(&s, hello("gated")).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["model"], "gated");
    assert_eq!(s.fake.last_body()["model"], "gated");
    s.stop().await;
}

#[tokio::test]
async fn refusals_are_openai_errors_with_openai_statuses() {
    let s = stack("m-err").await;
    let c = http();
    let check = |v: &Value| {
        for key in ["message", "type", "param", "code"] {
            assert!(v["error"].get(key).is_some(), "{v}");
        }
    };
    // No token, a wrong token.
    for auth in [None, Some("wrong")] {
        let mut req = c.post(s.url("/v1/chat/completions")).json(&hello("m-err"));
        if let Some(a) = auth {
            req = req.bearer_auth(a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401);
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        let v: Value = resp.json().await.unwrap();
        check(&v);
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert!(
            !v.to_string().contains("wrong"),
            "the token is never echoed"
        );
    }
    // A model nobody serves: 404 model_not_found naming what is served, no provider call.
    let resp = post(&s, hello("gpt-7")).await;
    assert_eq!(resp.status(), 404);
    let v: Value = resp.json().await.unwrap();
    check(&v);
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["param"], "model");
    assert!(v["error"]["message"].as_str().unwrap().contains("m-err"));
    // What cannot be honoured, and a body that is not JSON.
    let mut body = hello("m-err");
    body["n"] = json!(2);
    let resp = post(&s, body).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["param"], "n");
    let resp = c
        .post(s.url("/v1/chat/completions"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    check(&resp.json().await.unwrap());
    assert_eq!(s.fake.calls("m-err"), 0, "nothing reached the provider");

    // The provider refuses the key before the first token: an HTTP error even when
    // streaming, never a 200 with an empty stream.
    let mut body = hello("unauthorized");
    body["stream"] = json!(true);
    let resp = post(&s, body).await;
    assert_eq!(resp.status(), 502);
    let v: Value = resp.json().await.unwrap();
    check(&v);
    assert_eq!(v["error"]["code"], "llm-error");
    assert!(
        !v.to_string().contains(GatewayStack::PROVIDER_KEY),
        "the provider key never leaks: {v}"
    );

    // The provider fails after the first token: an SSE error event, then the end, no [DONE].
    let mut body = hello("error_mid_stream");
    body["stream"] = json!(true);
    let resp = post(&s, body).await;
    assert_eq!(resp.status(), 200);
    let text = String::from_utf8(resp.bytes().await.unwrap().to_vec()).unwrap();
    assert!(!text.contains("[DONE]"), "{text}");
    let last = event_data(text.split_terminator("\n\n").last().unwrap());
    let v: Value = serde_json::from_str(last).unwrap();
    check(&v);
    assert_eq!(v["error"]["type"], "server_error");
    assert!(text.contains("\"content\":\"Hel\""), "{text}");

    // Routes OpenAI has and sluice does not, and a wrong method: OpenAI's own answers.
    for (method, path, status) in [
        (reqwest::Method::POST, "/v1/embeddings", 404),
        (reqwest::Method::GET, "/v1/chat/completions", 405),
    ] {
        let resp = c
            .request(method, s.url(path))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), status, "{path}");
        let v: Value = resp.json().await.unwrap();
        check(&v);
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("Invalid URL ("),
            "{v}"
        );
    }

    // The route's requests are counted under its own label.
    let m = s.telemetry.render();
    assert!(
        m.contains(r#"sluice_gateway_requests_total{route="openai-chat",status="404"} 1"#),
        "{m}"
    );
    s.stop().await;
}

/// A client that drops a stream cancels the provider call (the fake sees its connection
/// closed), and the stream is counted as cancelled.
#[tokio::test]
async fn a_client_that_drops_a_stream_cancels_the_provider_call() {
    let s = stack("m-cancel").await;
    let mut body = hello("stall");
    body["stream"] = json!(true);
    let resp = post(&s, body).await;
    s.disconnect_mid_stream(resp, "Hel", "openai-chat").await;
    s.stop().await;
}

#[tokio::test]
async fn time_limits_and_trace_context_apply_as_on_the_other_routes() {
    let s = stack_with("m-limits", |gc| {
        // Long enough for the first token on a loaded machine; the stalled stream then ends
        // by it.
        gc.inactivity_timeout = Duration::from_secs(5);
    })
    .await;
    // The caller's trace goes on to the provider call.
    let resp = http()
        .post(s.url("/v1/chat/completions"))
        .bearer_auth(TOKEN)
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .json(&hello("m-limits"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let sent = s.fake.traceparents();
    let tp = sent.last().unwrap().as_deref().unwrap();
    assert!(
        tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
        "the provider call continues the caller's trace: {tp}"
    );
    // A stream that goes quiet past the inactivity limit ends with a timeout error event,
    // and the provider call is cancelled.
    let mut body = hello("stall");
    body["stream"] = json!(true);
    let resp = post(&s, body).await;
    assert_eq!(resp.status(), 200);
    let text = String::from_utf8(resp.bytes().await.unwrap().to_vec()).unwrap();
    assert!(text.contains("\"content\":\"Hel\""), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    let last = text.split_terminator("\n\n").last().unwrap();
    let v: Value = serde_json::from_str(event_data(last)).unwrap();
    assert_eq!(v["error"]["code"], "timeout", "{v}");
    s.fake
        .assert_abandoned(Duration::from_secs(15), "not cancelled")
        .await;
    let timeout = r#"sluice_gateway_streams_total{outcome="timeout",route="openai-chat"} 1"#;
    let m = wait_for_metrics(|| s.telemetry.render(), |m| m.contains(timeout)).await;
    assert!(m.contains(timeout), "{m}");
    s.stop().await;
}

#[tokio::test]
async fn models_lists_what_the_processor_serves() {
    let s = stack("m-models").await;
    let resp = http()
        .get(s.url("/v1/models"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["object"], "model");
            m["id"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        ids,
        [
            "m-models",
            "error_mid_stream",
            "stall",
            "gated",
            "unauthorized"
        ]
    );
    let one: Value = http()
        .get(s.url("/v1/models/m-models"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one["id"], "m-models");
    let missing = http()
        .get(s.url("/v1/models/nope"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let unauthorized = http().get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(unauthorized.status(), 401);
    s.stop().await;
}

/// async-openai, a client written independently of OpenAI's, reads both kinds of answer.
#[tokio::test]
async fn async_openai_reads_whole_and_streamed_answers() {
    use async_openai::{Client, config::OpenAIConfig, types::chat::CreateChatCompletionRequest};
    sluice_runtime::install_crypto_provider();
    let s = stack("m-rust").await;
    let client = Client::with_config(
        OpenAIConfig::new()
            .with_api_base(s.url("/v1"))
            .with_api_key(TOKEN),
    );
    let request: CreateChatCompletionRequest = serde_json::from_value(hello("m-rust")).unwrap();
    let whole = client.chat().create(request.clone()).await.unwrap();
    assert_eq!(
        whole.choices[0].message.content.as_deref(),
        Some("Hello world!")
    );
    assert_eq!(whole.usage.as_ref().unwrap().total_tokens, 14);

    let mut streamed: CreateChatCompletionRequest = request;
    streamed.stream_options = serde_json::from_value(json!({"include_usage": true})).unwrap();
    let mut stream = client.chat().create_stream(streamed).await.unwrap();
    let (mut text, mut usage, mut finish) = (String::new(), None, None);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        for c in &chunk.choices {
            text.push_str(c.delta.content.as_deref().unwrap_or(""));
            if c.finish_reason.is_some() {
                finish = c.finish_reason;
            }
        }
        if chunk.usage.is_some() {
            usage = chunk.usage;
        }
    }
    assert_eq!(text, "Hello world!");
    assert!(finish.is_some());
    assert_eq!(usage.unwrap().completion_tokens, 3);

    let models = client.models().list().await.unwrap();
    assert_eq!(models.data[0].id, "m-rust");

    let err = client
        .chat()
        .create(serde_json::from_value(hello("gpt-7")).unwrap())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("model_not_found") || err.to_string().contains("gpt-7"));
    s.stop().await;
}

/// async-openai (Rust) calling tools: its typed request with tools, its typed whole answer's
/// `tool_calls` and its typed stream chunks' pieces (interleaved calls, put together by
/// index), then the results sent back as its typed assistant and tool messages.
#[tokio::test]
async fn async_openai_calls_tools_whole_and_streamed() {
    use async_openai::{Client, config::OpenAIConfig, types::chat::CreateChatCompletionRequest};
    sluice_runtime::install_crypto_provider();
    let s = GatewayStack::start_serving("tools", &["tools-interleaved"], |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let client = Client::with_config(
        OpenAIConfig::new()
            .with_api_base(s.url("/v1"))
            .with_api_key(TOKEN),
    );
    let request: CreateChatCompletionRequest =
        serde_json::from_value(ask_tools("tools", false)).unwrap();
    let whole = client.chat().create(request).await.unwrap();
    // Read back through async-openai's own types (they deserialized the answer).
    let whole = serde_json::to_value(&whole).unwrap();
    let calls: Vec<(String, String, String)> = whole["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap().to_owned(),
                c["function"]["name"].as_str().unwrap().to_owned(),
                c["function"]["arguments"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        calls
            .iter()
            .map(|(_, n, a)| (n.clone(), a.clone()))
            .collect::<Vec<_>>(),
        both_called(),
        "{whole}"
    );
    assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");

    let mut streamed: CreateChatCompletionRequest =
        serde_json::from_value(ask_tools("tools-interleaved", true)).unwrap();
    streamed.stream_options = serde_json::from_value(json!({"include_usage": true})).unwrap();
    let mut stream = client.chat().create_stream(streamed).await.unwrap();
    let mut chunks = Vec::new();
    while let Some(chunk) = stream.next().await {
        chunks.push(serde_json::to_value(chunk.unwrap()).unwrap());
    }
    let got = assemble_streamed(&chunks);
    assert_eq!(
        got.iter()
            .map(|(_, n, a)| (n.clone(), a.clone()))
            .collect::<Vec<_>>(),
        both_called()
    );

    let back: CreateChatCompletionRequest = serde_json::from_value({
        let mut b = results_sent_back([&calls[0].0, &calls[1].0]);
        b["stream"] = json!(false);
        b
    })
    .unwrap();
    let answer = client.chat().create(back).await.unwrap();
    assert_eq!(
        answer.choices[0].message.content.as_deref(),
        Some("results: sunny; noon")
    );
    s.stop().await;
}

/// OpenAI's own Python SDK against the gateway: whole, streamed with usage, a conversation,
/// a refused model, a refused parameter, an error mid-stream, a stream closed early (which
/// must cancel the provider call) and the model list. Runs when `OPENAI_PY` is set.
#[tokio::test]
async fn the_official_python_sdk_works_against_the_gateway() {
    let Some(python) = sluice_tests::outside_tool(
        "OPENAI_PY",
        "openai_api: OpenAI's Python SDK against the gateway (scripts/openai-venv.sh)",
    ) else {
        return;
    };
    let s = stack("m-py").await;
    let settings = json!({"base_url": s.url("/v1"), "api_key": TOKEN, "model": "m-py",
                          "mid_error": "error_mid_stream", "gated": "stall"});
    let r = run_python_sdk(&python, &settings).await;
    assert_eq!(r["whole"]["content"], "Hello world!", "{r}");
    assert_eq!(r["whole"]["object"], "chat.completion");
    assert_eq!(r["whole"]["finish_reason"], "stop");
    assert_eq!(r["whole"]["usage"]["total_tokens"], 14);
    assert_eq!(r["stream"]["content"], "Hello world!", "{r}");
    assert_eq!(r["stream"]["first_role"], "assistant");
    assert_eq!(r["stream"]["finish_reason"], "stop");
    assert_eq!(r["stream"]["usage"]["prompt_tokens"], 11);
    assert_eq!(r["stream"]["ids"].as_array().unwrap().len(), 1);
    assert_eq!(r["multi_turn"]["content"], "Hello world!");
    assert_eq!(r["not_found"]["raised"], "NotFoundError", "{r}");
    assert_eq!(r["not_found"]["code"], "model_not_found");
    assert_eq!(r["refused"]["raised"], "BadRequestError");
    assert_eq!(r["refused"]["param"], "n");
    assert_eq!(r["mid_error"]["raised"], "APIError", "{r}");
    assert_eq!(r["mid_error"]["content"], "Hel");
    assert_eq!(r["cancel"]["first"], "Hel");
    assert_eq!(
        r["models"],
        json!(["error_mid_stream", "gated", "m-py", "stall", "unauthorized"])
    );
    // The conversation reached the provider as turns.
    let sent = s.fake.bodies();
    assert!(
        sent.iter()
            .any(|b| b["messages"].as_array().is_some_and(|m| m.len() == 4
                && m[2] == json!({"role": "assistant", "content": "Paris"})
                && b["temperature"] == 0.3
                && b["max_tokens"] == 40)),
        "{sent:?}"
    );
    // Closing the stream early cancelled the provider call.
    s.fake
        .assert_abandoned(
            Duration::from_secs(15),
            "stream.close() did not cancel the provider call",
        )
        .await;
    s.stop().await;
}

/// The tools the tool-calling tests offer, as OpenAI takes them.
fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    ])
}

/// Tool calls put together from OpenAI's streamed `delta.tool_calls` pieces, as its SDKs do:
/// by index, the id, type and name from a call's first piece, the arguments appended. Checks
/// that a piece with an id is a call's first and that later pieces carry no id or name.
fn assemble_streamed(chunks: &[Value]) -> Vec<(String, String, String)> {
    let mut calls: std::collections::BTreeMap<u64, (String, String, String)> = Default::default();
    for c in chunks {
        for piece in c["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let index = piece["index"].as_u64().expect("every piece has an index");
            match piece["id"].as_str() {
                Some(id) => {
                    assert!(!calls.contains_key(&index), "a second first piece: {piece}");
                    assert_eq!(piece["type"], "function", "{piece}");
                    let name = piece["function"]["name"].as_str().unwrap();
                    calls.insert(
                        index,
                        (
                            id.to_owned(),
                            name.to_owned(),
                            piece["function"]["arguments"].as_str().unwrap().to_owned(),
                        ),
                    );
                }
                None => {
                    assert!(piece["function"].get("name").is_none(), "{piece}");
                    let call = calls
                        .get_mut(&index)
                        .unwrap_or_else(|| panic!("a fragment before its call: {piece}"));
                    call.2
                        .push_str(piece["function"]["arguments"].as_str().unwrap());
                }
            }
        }
    }
    calls.into_values().collect()
}

/// Tools through the gateway, the broker and the processor to the provider and back, in
/// OpenAI's shapes: streamed as `delta.tool_calls` pieces (id, type and name first, then
/// argument fragments; text before the calls; two calls' pieces interleaved), whole as
/// `message.tool_calls` with `content: null`, `finish_reason: tool_calls` both ways, the same
/// usage both ways; then the tools' results sent back reach the provider as `tool` messages
/// and the model answers from them.
#[tokio::test]
async fn tool_calls_stream_and_return_as_openai_sends_them() {
    let s = GatewayStack::start_serving("tools", &["tools-text", "tools-interleaved"], |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let ask = |model: &str, stream: bool| {
        let mut body = json!({"model": model, "tools": weather_tools(),
            "messages": [{"role": "user", "content": "Paris"}]});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    };
    let expected = |names: &[&str]| -> Vec<(String, String)> {
        names
            .iter()
            .map(|n| ((*n).to_owned(), r#"{"q":"Paris"}"#.to_owned()))
            .collect()
    };
    for model in ["tools", "tools-text", "tools-interleaved"] {
        let resp = post(&s, ask(model, true)).await;
        assert_eq!(resp.status(), 200, "{model}");
        let body = resp.bytes().await.unwrap();
        let data = sse_data(&body);
        let chunks: Vec<Value> = data
            .iter()
            .filter(|d| d.as_str() != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let calls = assemble_streamed(&chunks);
        assert_eq!(
            calls
                .iter()
                .map(|(_, n, a)| (n.clone(), a.clone()))
                .collect::<Vec<_>>(),
            expected(&["get_weather", "get_time"]),
            "{model}: {data:?}"
        );
        assert!(calls.iter().all(|(id, _, _)| id.starts_with("call_")));
        // The arguments came in fragments, not in one piece.
        let pieces = chunks
            .iter()
            .filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
            .count();
        assert!(pieces > 6, "{model}: {pieces} pieces");
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        let want = if model == "tools-text" {
            "Let me look that up."
        } else {
            ""
        };
        assert_eq!(text, want, "{model}");
        let finish: Vec<&Value> = chunks
            .iter()
            .map(|c| &c["choices"][0]["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finish, [&json!("tool_calls")], "{model}");
        let usage = &chunks.last().unwrap()["usage"];
        assert_eq!(usage["prompt_tokens"], 20, "{model}: {usage}");
        assert_eq!(usage["completion_tokens"], 10, "{model}: {usage}");
    }

    // Whole: `message.tool_calls`, content null (or the text before the calls).
    for model in ["tools", "tools-text"] {
        let resp = post(&s, ask(model, false)).await;
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        let message = &v["choices"][0]["message"];
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
        let calls: Vec<(String, String)> = message["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                assert_eq!(c["type"], "function");
                assert!(c["id"].as_str().unwrap().starts_with("call_"));
                (
                    c["function"]["name"].as_str().unwrap().to_owned(),
                    c["function"]["arguments"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert_eq!(calls, expected(&["get_weather", "get_time"]), "{v}");
        if model == "tools" {
            assert_eq!(message["content"], Value::Null, "{v}");
        } else {
            assert_eq!(message["content"], "Let me look that up.", "{v}");
        }
        assert_eq!(v["usage"]["total_tokens"], 30);
        // The provider got the tools as offered, with no choice the caller did not make.
        let sent = s.fake.last_body();
        assert_eq!(sent["tools"], weather_tools(), "{sent}");
        assert!(sent.get("tool_choice").is_none(), "{sent}");
    }

    // The results sent back: the provider gets the assistant's calls and the `tool` messages
    // answering them, in order, and the model answers from them.
    let next = json!({"model": "tools", "tools": weather_tools(), "stream": true,
        "tool_choice": "auto", "parallel_tool_calls": true,
        "messages": [
            {"role": "user", "content": "Paris"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_0_get_weather", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"q\":\"Paris\"}"}},
                {"id": "call_1_get_time", "type": "function",
                    "function": {"name": "get_time", "arguments": "{\"q\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_0_get_weather", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_1_get_time", "content": "noon"}]});
    let resp = post(&s, next.clone()).await;
    assert_eq!(resp.status(), 200);
    let body = resp.bytes().await.unwrap();
    let text: String = sse_data(&body)
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .filter_map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, "results: sunny; noon");
    let sent = s.fake.last_body();
    assert_eq!(sent["messages"][1], next["messages"][1], "{sent}");
    assert_eq!(
        sent["messages"][2],
        json!({"role": "tool", "tool_call_id": "call_0_get_weather", "content": "sunny"})
    );
    assert_eq!(sent["messages"][3]["tool_call_id"], "call_1_get_time");
    assert_eq!(sent["tool_choice"], "auto");
    assert_eq!(sent["parallel_tool_calls"], true);

    // A named choice reaches the provider, which calls only that tool.
    let mut named = ask("tools", false);
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    let v: Value = post(&s, named).await.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_time",
        "{v}"
    );
    assert_eq!(
        s.fake.last_body()["tool_choice"],
        json!({"type": "function", "function": {"name": "get_time"}})
    );
    s.stop().await;
}

/// OpenAI's Python SDK calling tools: a whole answer's `tool_calls` and the results sent
/// back with the SDK's own message objects; its streaming helper accumulating the pieces
/// into calls; the raw stream's first pieces; and `chat.completions.parse` turning a
/// Pydantic tool's arguments into the model. Runs when `OPENAI_PY` is set.
#[tokio::test]
async fn the_official_python_sdk_calls_tools_through_the_gateway() {
    let Some(python) = sluice_tests::outside_tool(
        "OPENAI_PY",
        "openai_api: OpenAI's Python SDK calling tools (scripts/openai-venv.sh)",
    ) else {
        return;
    };
    let s = GatewayStack::start_serving("tools", &["tools-interleaved"], |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let settings = json!({"base_url": s.url("/v1"), "api_key": TOKEN, "model": "tools",
                          "tools_model": "tools-interleaved", "only": ["tools"]});
    let r = run_python_sdk(&python, &settings).await;
    check_python_sdk_tools(&r, true);
    s.stop().await;
}

/// What OpenAI's Python SDK must have seen in `tests/py/openai_client.py`'s tool scenarios,
/// whichever provider answered: both calls whole and streamed, the results answered, each
/// call's first raw piece, and the parsed Pydantic arguments.
fn check_python_sdk_tools(r: &Value, fragmented: bool) {
    let both = json!([
        ["get_weather", "{\"q\":\"Paris\"}"],
        ["get_time", "{\"q\":\"Paris\"}"]
    ]);
    assert_eq!(r["tools_whole"]["calls"], both, "{r}");
    assert_eq!(r["tools_whole"]["finish_reason"], "tool_calls");
    assert_eq!(r["tools_whole"]["content"], Value::Null);
    assert_eq!(
        r["tools_whole"]["answer"],
        "results: get_weather ok; get_time ok"
    );
    assert_eq!(r["tools_stream"]["calls"], both, "{r}");
    assert_eq!(r["tools_stream"]["finish_reason"], "tool_calls");
    // A provider that streams arguments in fragments gives more deltas than calls; one that
    // sends each call whole (Gemini), one per call.
    let deltas = r["tools_stream"]["argument_deltas"].as_u64().unwrap();
    if fragmented {
        assert!(deltas > 2, "{r}");
    } else {
        assert_eq!(deltas, 2, "{r}");
    }
    assert_eq!(
        r["tools_raw"]["first_pieces"],
        json!([[0, "function", "get_weather"], [1, "function", "get_time"]]),
        "{r}"
    );
    assert_eq!(r["tools_parse"]["parsed"], "Paris", "{r}");
}

/// A tool-calling request for `model` with [`weather_tools`], streamed (with usage) or whole.
fn ask_tools(model: &str, stream: bool) -> Value {
    let mut body = json!({"model": model, "tools": weather_tools(),
        "messages": [{"role": "user", "content": "Paris"}]});
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// Both weather tools called with the user's text, as (name, arguments).
fn both_called() -> Vec<(String, String)> {
    vec![
        ("get_weather".to_owned(), r#"{"q":"Paris"}"#.to_owned()),
        ("get_time".to_owned(), r#"{"q":"Paris"}"#.to_owned()),
    ]
}

/// A streamed answer's tool calls as an OpenAI client puts them together, checked as OpenAI
/// sends them: (id, name, arguments) in order, numbered from 0; with the text, the chunks
/// holding pieces, the one finish reason and the usage.
struct StreamedTools {
    calls: Vec<(String, String, String)>,
    text: String,
    pieces: usize,
    finish: Value,
    usage: Value,
}

async fn streamed_tools(url: &str, body: Value) -> StreamedTools {
    let resp = post_to(url, body).await;
    assert_eq!(resp.status(), 200);
    let body = resp.bytes().await.unwrap();
    let data = sse_data(&body);
    let chunks: Vec<Value> = data
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let calls = assemble_streamed(&chunks);
    let firsts: Vec<u64> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .filter(|p| p["id"].is_string())
        .map(|p| p["index"].as_u64().unwrap())
        .collect();
    assert_eq!(
        firsts,
        (0..calls.len() as u64).collect::<Vec<_>>(),
        "{data:?}"
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish.len(), 1, "{data:?}");
    StreamedTools {
        text: chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect(),
        pieces: chunks
            .iter()
            .filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
            .count(),
        finish: finish[0].clone(),
        usage: chunks.last().unwrap()["usage"].clone(),
        calls,
    }
}

/// A whole answer's tool calls as (name, arguments), checking each is a function, with the
/// answer.
async fn whole_tools(url: &str, body: Value) -> (Vec<(String, String)>, Value) {
    let v: Value = post_to(url, body).await.json().await.unwrap();
    let calls = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool_calls: {v}"))
        .iter()
        .map(|c| {
            assert_eq!(c["type"], "function", "{v}");
            (
                c["function"]["name"].as_str().unwrap().to_owned(),
                c["function"]["arguments"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    (calls, v)
}

/// The conversation after both weather tools were called with the ids `ids`: the calls and
/// their results, `sunny` and `noon`.
fn results_sent_back(ids: [&str; 2]) -> Value {
    results_sent_back_to("tools", ids)
}

/// [`results_sent_back`] for `model`.
fn results_sent_back_to(model: &str, ids: [&str; 2]) -> Value {
    json!({"model": model, "tools": weather_tools(), "stream": true,
        "messages": [
            {"role": "user", "content": "Paris"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": ids[0], "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"q\":\"Paris\"}"}},
                {"id": ids[1], "type": "function",
                    "function": {"name": "get_time", "arguments": "{\"q\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": ids[0], "content": "sunny"},
            {"role": "tool", "tool_call_id": ids[1], "content": "noon"}]})
}

/// OpenAI's Python SDK's tool scenarios against the gateway at `base` (for `model`), when
/// `OPENAI_PY` is set; `fragmented` when the provider streams arguments in fragments.
async fn python_sdk_tools_against(base: &str, provider: &str, model: &str, fragmented: bool) {
    if let Some(python) = sluice_tests::outside_tool(
        "OPENAI_PY",
        &format!(
            "openai_api: OpenAI's Python SDK calling tools on {provider} (scripts/openai-venv.sh)"
        ),
    ) {
        let settings = json!({"base_url": base, "api_key": TOKEN, "model": model,
                              "tools_model": model, "only": ["tools"]});
        check_python_sdk_tools(&run_python_sdk(&python, &settings).await, fragmented);
    }
}

/// A processor calling Anthropic (the fake, with Anthropic's exact tool-use events) behind
/// the OpenAI route: Claude's `tool_use` blocks reach an OpenAI caller as OpenAI's
/// `tool_calls`, streamed (numbered from 0 although a text block came first, arguments in
/// fragments, the empty first `input_json_delta` dropped) and whole; `stop_reason: tool_use`
/// is `finish_reason: tool_calls`; the tools go to Anthropic as `input_schema`, a named
/// choice and `parallel_tool_calls: false` as its `tool_choice`; the results sent back go as
/// `tool_use` blocks and one user message of `tool_result` blocks, and the model answers
/// from them. Then OpenAI's Python SDK runs its tool scenarios against it, when `OPENAI_PY`
/// is set.
#[tokio::test]
async fn anthropic_tool_use_reaches_openai_callers_as_openai_tool_calls() {
    use sluice_tests::{RoutedService, fake_anthropic::FakeAnthropic, provider_service};
    use sluice_text_completion::providers::anthropic::{AnthropicConfig, AnthropicProvider};
    let fake = FakeAnthropic::start().await;
    let mut config = AnthropicConfig::new(fake.base_url(), "tools");
    config.credential = Some(Secret::new("sk-ant-test"));
    let service = provider_service(std::sync::Arc::new(AnthropicProvider::new(config).unwrap()))
        .with_models(["tools-text".to_owned()]);
    let s = RoutedService::start(service, |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let url = s.url("/v1/chat/completions");
    for model in ["tools", "tools-text"] {
        let got = streamed_tools(&url, ask_tools(model, true)).await;
        assert_eq!(
            got.calls,
            both_called()
                .into_iter()
                .zip(["toolu_0_get_weather", "toolu_1_get_time"])
                .map(|((n, a), id)| (id.to_owned(), n, a))
                .collect::<Vec<_>>(),
            "{model}"
        );
        assert!(got.pieces > 6, "{model}: {} pieces", got.pieces);
        let want = if model == "tools-text" {
            "Let me look that up."
        } else {
            ""
        };
        assert_eq!(got.text, want, "{model}");
        assert_eq!(got.finish, "tool_calls", "{model}");
        assert_eq!(
            (&got.usage["prompt_tokens"], &got.usage["completion_tokens"]),
            (&json!(20), &json!(10)),
            "{model}: {}",
            got.usage
        );
        let sent = fake.last_body();
        assert_eq!(
            sent["tools"],
            json!([{"name": "get_weather", "description": "the weather in a city",
                    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
                   {"name": "get_time",
                    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]),
            "{sent}"
        );
        assert!(sent.get("tool_choice").is_none(), "{sent}");
    }

    // Whole: `message.tool_calls`, content null (or the text before the calls).
    for model in ["tools", "tools-text"] {
        let (calls, v) = whole_tools(&url, ask_tools(model, false)).await;
        assert_eq!(calls, both_called(), "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
        let want = if model == "tools-text" {
            json!("Let me look that up.")
        } else {
            Value::Null
        };
        assert_eq!(v["choices"][0]["message"]["content"], want, "{v}");
        assert_eq!(v["usage"]["total_tokens"], 30, "{v}");
    }

    // The results sent back: Anthropic gets the calls as `tool_use` blocks and both results
    // in one user message, and the model answers from them.
    let ids = ["toolu_0_get_weather", "toolu_1_get_time"];
    let got = streamed_tools(&url, results_sent_back(ids)).await;
    assert_eq!(got.text, "results: sunny; noon");
    let sent = fake.last_body();
    assert_eq!(
        sent["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "Paris"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": ids[0], "name": "get_weather", "input": {"q": "Paris"}},
                {"type": "tool_use", "id": ids[1], "name": "get_time", "input": {"q": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": ids[0], "content": "sunny"},
                {"type": "tool_result", "tool_use_id": ids[1], "content": "noon"}]}
        ]),
        "{sent}"
    );

    // A named choice with parallel calls off: Anthropic's own choice object.
    let mut named = ask_tools("tools", false);
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    named["parallel_tool_calls"] = json!(false);
    let (calls, v) = whole_tools(&url, named).await;
    assert_eq!(calls, both_called()[1..], "{v}");
    assert_eq!(
        fake.last_body()["tool_choice"],
        json!({"type": "tool", "name": "get_time", "disable_parallel_tool_use": true})
    );

    // Calls a Gemini processor made (ids carrying thought signatures, kilobytes of base64 that
    // Anthropic's id pattern refuses) sent back to Anthropic, as a fallback list would: their
    // ids made portable, call and result still paired.
    let signed = |bare: &str| format!("{bare}::sig::{}", "c2ln+/=".repeat(400));
    let (a, b) = (signed("sluice_00aa"), signed("sluice_00bb"));
    let got = streamed_tools(&url, results_sent_back([&a, &b])).await;
    assert_eq!(got.text, "results: sunny; noon");
    let sent = fake.last_body();
    assert_eq!(
        sent["messages"][1]["content"][0]["id"], "sluice_00aa",
        "{sent}"
    );
    assert_eq!(
        sent["messages"][2]["content"][1]["tool_use_id"], "sluice_00bb",
        "{sent}"
    );

    // A call sent back whose arguments are no JSON object cannot be put in Anthropic's terms:
    // the caller's 400, nothing sent.
    let calls_before = fake.calls("tools");
    let mut broken = results_sent_back(ids);
    broken["messages"][1]["tool_calls"][0]["function"]["arguments"] = json!("[1");
    let resp = post_to(&url, broken).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("toolu_0_get_weather"),
        "{v}"
    );
    assert_eq!(fake.calls("tools"), calls_before, "nothing sent");

    python_sdk_tools_against(&s.url("/v1"), "Anthropic", "tools", true).await;
    s.stop().await;
}

/// A processor calling Gemini (the fake, with Gemini's exact function-calling chunks) behind
/// the OpenAI route: Gemini's whole `functionCall` parts reach an OpenAI caller as OpenAI's
/// `tool_calls` numbered from 0, with ids sluice made (Gemini gives none) that carry each
/// call's `thoughtSignature`; Gemini's `STOP` after calls is `finish_reason: tool_calls`;
/// the tools go as `functionDeclarations` and a named choice as `ANY` with
/// `allowedFunctionNames`; the calls sent back get their signatures again (the fake refuses
/// them without, as Gemini 3 does) and the results go as `functionResponse` parts naming
/// the tools, in one user content. Then OpenAI's Python SDK runs its tool scenarios against
/// it, sending back the SDK's own message objects, when `OPENAI_PY` is set.
#[tokio::test]
async fn gemini_function_calls_reach_openai_callers_as_openai_tool_calls() {
    use sluice_tests::{RoutedService, fake_gemini::FakeGemini, provider_service};
    use sluice_text_completion::providers::gemini::{GeminiConfig, GeminiEndpoint, GeminiProvider};
    let fake = FakeGemini::start().await;
    let mut config = GeminiConfig::new(GeminiEndpoint::AiStudio, fake.base_url(), "tools");
    config.credential = Some(Secret::new("gemini-test-key"));
    let service = provider_service(std::sync::Arc::new(GeminiProvider::new(config).unwrap()));
    let s = RoutedService::start(service, |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let url = s.url("/v1/chat/completions");

    let got = streamed_tools(&url, ask_tools("tools", true)).await;
    let named: Vec<(String, String)> = got
        .calls
        .iter()
        .map(|(_, n, a)| (n.clone(), a.clone()))
        .collect();
    assert_eq!(named, both_called());
    let ids: Vec<String> = got.calls.iter().map(|(id, _, _)| id.clone()).collect();
    assert_ne!(ids[0], ids[1]);
    assert!(ids[0].ends_with("::sig::c2lnLTA="), "{ids:?}");
    assert!(ids[1].ends_with("::sig::c2lnLTE="), "{ids:?}");
    assert_eq!(got.text, "");
    assert_eq!(got.finish, "tool_calls");
    assert_eq!(got.usage["total_tokens"], 30, "{}", got.usage);
    let sent = fake.last_body();
    assert_eq!(
        sent["tools"],
        json!([{"functionDeclarations": [
            {"name": "get_weather", "description": "the weather in a city",
             "parametersJsonSchema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
            {"name": "get_time",
             "parametersJsonSchema": {"type": "object", "properties": {"q": {"type": "string"}}}}]}]),
        "{sent}"
    );
    assert!(sent.get("toolConfig").is_none(), "{sent}");

    let (calls, v) = whole_tools(&url, ask_tools("tools", false)).await;
    assert_eq!(calls, both_called(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], Value::Null, "{v}");

    // The calls sent back with the ids they came with: their signatures restored, the
    // results named by their tools in one content.
    let got = streamed_tools(&url, results_sent_back([&ids[0], &ids[1]])).await;
    assert_eq!(got.text, "results: sunny; noon");
    assert_eq!(got.finish, "stop");
    let sent = fake.last_body();
    assert_eq!(
        sent["contents"],
        json!([
            {"role": "user", "parts": [{"text": "Paris"}]},
            {"role": "model", "parts": [
                {"functionCall": {"name": "get_weather", "args": {"q": "Paris"}}, "thoughtSignature": "c2lnLTA="},
                {"functionCall": {"name": "get_time", "args": {"q": "Paris"}}, "thoughtSignature": "c2lnLTE="}]},
            {"role": "user", "parts": [
                {"functionResponse": {"name": "get_weather", "response": {"result": "sunny"}}},
                {"functionResponse": {"name": "get_time", "response": {"result": "noon"}}}]}
        ]),
        "{sent}"
    );
    // Without the signatures (ids a caller made up), Gemini's refusal reaches the caller, as
    // every provider's 400 does: 502, its words.
    let resp = post_to(&url, results_sent_back(["call_a", "call_b"])).await;
    assert_eq!(resp.status(), 502);
    let v: Value = resp.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("thought_signature"),
        "{v}"
    );

    // A named choice: ANY, allowed only that function.
    let mut named = ask_tools("tools", false);
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    let (calls, v) = whole_tools(&url, named).await;
    assert_eq!(calls, both_called()[1..], "{v}");
    assert_eq!(
        fake.last_body()["toolConfig"],
        json!({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_time"]}})
    );

    python_sdk_tools_against(&s.url("/v1"), "Gemini", "tools", false).await;
    s.stop().await;
}

/// A processor calling Bedrock's Converse (the fake, with Converse's exact event-stream
/// frames, signed with SigV4) behind the OpenAI route: `toolUse` blocks reach an OpenAI
/// caller as OpenAI's `tool_calls`, streamed (arguments in fragments) and whole (Converse's
/// own whole answer); `stop_reason: tool_use` is `finish_reason: tool_calls`; the tools go as
/// `toolConfig` and a named choice as its `toolChoice`; the results sent back go as `toolUse`
/// and `toolResult` blocks and the model answers from them; `tool_choice: none`, which
/// Converse lacks, sends no tools and the turns as text. Then OpenAI's Python SDK runs its
/// tool scenarios against it, when `OPENAI_PY` is set.
#[tokio::test]
async fn bedrock_tool_use_reaches_openai_callers_as_openai_tool_calls() {
    use sluice_tests::{
        RoutedService,
        fake_bedrock::{ACCESS_KEY_ID, FakeBedrock, SECRET_ACCESS_KEY, model_id},
        provider_service,
    };
    use sluice_text_completion::providers::bedrock::{
        BedrockConfig, BedrockCredentials, BedrockProvider,
    };
    let fake = FakeBedrock::start().await;
    let model = model_id("tools");
    let mut config = BedrockConfig::new("us-east-1", &model);
    config.base_url = fake.base_url();
    config.credentials = BedrockCredentials::SigV4 {
        access_key_id: Secret::new(ACCESS_KEY_ID),
        secret_access_key: Secret::new(SECRET_ACCESS_KEY),
        session_token: None,
    };
    let service = provider_service(std::sync::Arc::new(BedrockProvider::new(config).unwrap()));
    let s = RoutedService::start(service, |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let url = s.url("/v1/chat/completions");
    let ids = ["tooluse_0_get_weather", "tooluse_1_get_time"];

    let got = streamed_tools(&url, ask_tools(&model, true)).await;
    assert_eq!(
        got.calls,
        both_called()
            .into_iter()
            .zip(ids)
            .map(|((n, a), id)| (id.to_owned(), n, a))
            .collect::<Vec<_>>()
    );
    assert!(got.pieces > 4, "{} pieces", got.pieces);
    assert_eq!(got.finish, "tool_calls");
    assert_eq!(got.usage["total_tokens"], 30, "{}", got.usage);
    let sent = fake.last_request().body;
    assert_eq!(
        sent["toolConfig"],
        json!({"tools": [
            {"toolSpec": {"name": "get_weather", "description": "the weather in a city",
                "inputSchema": {"json": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}},
            {"toolSpec": {"name": "get_time",
                "inputSchema": {"json": {"type": "object", "properties": {"q": {"type": "string"}}}}}}]}),
        "{sent}"
    );

    let (calls, v) = whole_tools(&url, ask_tools(&model, false)).await;
    assert_eq!(calls, both_called(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], Value::Null, "{v}");
    assert!(
        fake.last_request().raw_path.ends_with("/converse"),
        "the whole answer's own call"
    );

    let got = streamed_tools(&url, results_sent_back_to(&model, ids)).await;
    assert_eq!(got.text, "results: sunny; noon");
    assert_eq!(
        fake.last_request().body["messages"],
        json!([
            {"role": "user", "content": [{"text": "Paris"}]},
            {"role": "assistant", "content": [
                {"toolUse": {"toolUseId": ids[0], "name": "get_weather", "input": {"q": "Paris"}}},
                {"toolUse": {"toolUseId": ids[1], "name": "get_time", "input": {"q": "Paris"}}}]},
            {"role": "user", "content": [
                {"toolResult": {"toolUseId": ids[0], "content": [{"text": "sunny"}]}},
                {"toolResult": {"toolUseId": ids[1], "content": [{"text": "noon"}]}}]}
        ])
    );

    let mut named = ask_tools(&model, false);
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    let (calls, v) = whole_tools(&url, named).await;
    assert_eq!(calls, both_called()[1..], "{v}");
    assert_eq!(
        fake.last_request().body["toolConfig"]["toolChoice"],
        json!({"tool": {"name": "get_time"}})
    );

    // `none`, which Converse lacks, after the results: no tools sent, so none can be called,
    // and the calls and results as text (the fake refuses tool blocks without a toolConfig,
    // as Converse does).
    let mut none = results_sent_back_to(&model, ids);
    none["tool_choice"] = json!("none");
    let got = streamed_tools(&url, none).await;
    assert_eq!(got.text, "no tools were called");
    assert!(got.calls.is_empty());
    let sent = fake.last_request().body;
    assert!(sent.get("toolConfig").is_none(), "{sent}");
    assert_eq!(
        sent["messages"][2],
        json!({"role": "user", "content": [{"text": "[result of get_weather]\nsunny"},
            {"text": "[result of get_time]\nnoon"}]}),
        "{sent}"
    );

    python_sdk_tools_against(&s.url("/v1"), "Bedrock", &model, true).await;
    s.stop().await;
}

/// A processor calling Ollama's native `/api/chat` (the fake, with its NDJSON tool-call lines
/// and no call ids) behind the OpenAI route: the calls reach an OpenAI caller as OpenAI's
/// `tool_calls` with ids sluice made, streamed and whole; Ollama's `stop` after calls is
/// `finish_reason: tool_calls`; the results sent back go as `tool` messages naming the
/// called tool (`tool_name`, found by the call id), and the model answers from them;
/// `required`, which Ollama cannot honour, is the caller's 400 and nothing is sent. Then
/// OpenAI's Python SDK runs its tool scenarios against it, when `OPENAI_PY` is set.
#[tokio::test]
async fn ollama_tool_calls_reach_openai_callers_as_openai_tool_calls() {
    use sluice_tests::{RoutedService, fake_ollama::FakeOllama, provider_service};
    use sluice_text_completion::providers::ollama::{OllamaConfig, OllamaProvider};
    let fake = FakeOllama::start().await;
    let config = OllamaConfig::new(fake.base_url(), "tools");
    let service = provider_service(std::sync::Arc::new(OllamaProvider::new(config).unwrap()));
    let s = RoutedService::start(service, |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let url = s.url("/v1/chat/completions");

    let got = streamed_tools(&url, ask_tools("tools", true)).await;
    let named: Vec<(String, String)> = got
        .calls
        .iter()
        .map(|(_, n, a)| (n.clone(), a.clone()))
        .collect();
    assert_eq!(named, both_called());
    let ids: Vec<String> = got.calls.iter().map(|(id, _, _)| id.clone()).collect();
    assert!(ids[0].starts_with("call_") && ids[0] != ids[1], "{ids:?}");
    assert_eq!(got.finish, "tool_calls");
    assert_eq!(got.usage["total_tokens"], 30, "{}", got.usage);
    assert_eq!(fake.last_body()["tools"], weather_tools());

    let (calls, v) = whole_tools(&url, ask_tools("tools", false)).await;
    assert_eq!(calls, both_called(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], Value::Null, "{v}");

    let got = streamed_tools(&url, results_sent_back([&ids[0], &ids[1]])).await;
    assert_eq!(got.text, "results: sunny; noon");
    assert_eq!(got.finish, "stop");
    let sent = fake.last_body()["messages"].clone();
    assert_eq!(
        sent[1]["tool_calls"],
        json!([{"id": ids[0], "function": {"name": "get_weather", "arguments": {"q": "Paris"}}},
               {"id": ids[1], "function": {"name": "get_time", "arguments": {"q": "Paris"}}}]),
        "{sent}"
    );
    assert_eq!(
        sent[2],
        json!({"role": "tool", "content": "sunny", "tool_name": "get_weather", "tool_call_id": ids[0]})
    );
    assert_eq!(sent[3]["tool_name"], "get_time", "{sent}");

    let before = fake.calls("tools");
    let mut required = ask_tools("tools", false);
    required["tool_choice"] = json!("required");
    let resp = post_to(&url, required).await;
    assert_eq!(resp.status(), 400);
    assert_eq!(fake.calls("tools"), before, "nothing sent");

    python_sdk_tools_against(&s.url("/v1"), "Ollama", "tools", false).await;
    s.stop().await;
}

/// A processor calling Cohere's v2 chat (the fake, with Cohere's tool-plan and tool-call
/// events) behind the OpenAI route: the plan reaches the caller as text before the calls,
/// the calls as OpenAI's `tool_calls` (arguments in fragments), `TOOL_CALL` as
/// `finish_reason: tool_calls`; the calls go back with the text as `tool_plan` and the
/// results as `tool` messages, and the model answers from them; a named choice, which Cohere
/// lacks, is the caller's 400. Then OpenAI's Python SDK's tool scenarios, when `OPENAI_PY` is
/// set (the plan is the whole answer's `content`, so that scenario is checked here instead).
#[tokio::test]
async fn cohere_tool_calls_reach_openai_callers_as_openai_tool_calls() {
    use sluice_tests::{RoutedService, fake_cohere::FakeCohere, provider_service};
    use sluice_text_completion::providers::cohere::{CohereConfig, CohereProvider};
    let fake = FakeCohere::start().await;
    let mut config = CohereConfig::new(fake.base_url(), "tools");
    config.api_key = Some(Secret::new("co-test-key"));
    let service = provider_service(std::sync::Arc::new(CohereProvider::new(config).unwrap()));
    let s = RoutedService::start(service, |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let url = s.url("/v1/chat/completions");
    let ids = ["get_weather_0", "get_time_1"];

    let got = streamed_tools(&url, ask_tools("tools", true)).await;
    assert_eq!(
        got.calls,
        both_called()
            .into_iter()
            .zip(ids)
            .map(|((n, a), id)| (id.to_owned(), n, a))
            .collect::<Vec<_>>()
    );
    assert_eq!(got.text, "I will look that up.");
    assert!(got.pieces > 4, "{} pieces", got.pieces);
    assert_eq!(got.finish, "tool_calls");
    assert_eq!(got.usage["total_tokens"], 30, "{}", got.usage);
    assert_eq!(fake.last_body()["tools"], weather_tools());

    let (calls, v) = whole_tools(&url, ask_tools("tools", false)).await;
    assert_eq!(calls, both_called(), "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"], "I will look that up.",
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");

    let mut back = results_sent_back(ids);
    back["messages"][1]["content"] = json!("I will look that up.");
    let got = streamed_tools(&url, back).await;
    assert_eq!(got.text, "results: sunny; noon");
    let sent = fake.last_body()["messages"].clone();
    assert_eq!(sent[1]["tool_plan"], "I will look that up.", "{sent}");
    assert!(sent[1].get("content").is_none(), "{sent}");
    assert_eq!(sent[1]["tool_calls"][1]["id"], ids[1], "{sent}");
    assert_eq!(
        sent[2],
        json!({"role": "tool", "content": "sunny", "tool_call_id": ids[0]})
    );

    let mut required = ask_tools("tools", false);
    required["tool_choice"] = json!("required");
    let (calls, _) = whole_tools(&url, required).await;
    assert_eq!(calls.len(), 2);
    assert_eq!(fake.last_body()["tool_choice"], "REQUIRED");
    let mut named = ask_tools("tools", false);
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    assert_eq!(post_to(&url, named).await.status(), 400);
    s.stop().await;
}

/// Structured output from a provider with no JSON mode (Anthropic; the fake's `json` model
/// fences its first answer and strays from the schema): the processor asks for the schema in
/// the system prompt, checks the answer, makes one corrective call, and the caller gets only
/// the valid JSON, streamed (in one piece: nothing is published before the check) and
/// whole, with both calls' usage; a model that never complies ends with a clear 502 naming
/// what was wrong, never the answer. Then OpenAI's Python SDK's `parse` and stream helper
/// with a Pydantic `response_format` get the model back, when `OPENAI_PY` is set.
#[tokio::test]
async fn structured_output_is_held_to_the_schema_where_the_provider_cannot() {
    use sluice_tests::{RoutedService, fake_anthropic::FakeAnthropic, provider_service};
    use sluice_text_completion::providers::anthropic::{AnthropicConfig, AnthropicProvider};
    let fake = FakeAnthropic::start().await;
    let mut config = AnthropicConfig::new(fake.base_url(), "json");
    config.credential = Some(Secret::new("sk-ant-test"));
    let service = provider_service(std::sync::Arc::new(AnthropicProvider::new(config).unwrap()))
        .with_models(["json-never".to_owned()]);
    let s = RoutedService::start(service, |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let url = s.url("/v1/chat/completions");
    let ask = |model: &str, stream: bool| {
        let mut body = json!({"model": model,
            "messages": [{"role": "user", "content": "the sky"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "sky", "strict": true,
                "schema": {"type": "object", "required": ["label"], "additionalProperties": false,
                    "properties": {"label": {"type": "string", "enum": ["blue", "grey"]}}}}}});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    };

    let v: Value = post_to(&url, ask("json", false))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"], r#"{"label": "blue"}"#,
        "{v}"
    );
    assert_eq!(
        (
            &v["usage"]["prompt_tokens"],
            &v["usage"]["completion_tokens"]
        ),
        (&json!(50), &json!(30)),
        "both calls: {v}"
    );
    let sent = fake.last_body();
    assert!(
        sent["system"]
            .as_str()
            .unwrap()
            .contains(r#""enum":["blue","grey"]"#),
        "{sent}"
    );
    let correction = sent["messages"][2]["content"].as_str().unwrap();
    assert!(
        correction.starts_with("the answer does not match the schema: /label is not one of"),
        "{correction}"
    );

    let resp = post_to(&url, ask("json", true)).await;
    assert_eq!(resp.status(), 200);
    let body = resp.bytes().await.unwrap();
    let chunks: Vec<Value> = sse_data(&body)
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let content: Vec<&str> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(content, [r#"{"label": "blue"}"#], "one checked piece");
    assert_eq!(chunks.last().unwrap()["usage"]["total_tokens"], 80);

    let resp = post_to(&url, ask("json-never", false)).await;
    assert_eq!(resp.status(), 502);
    let v: Value = resp.json().await.unwrap();
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("also after one corrective call: the answer is not JSON"),
        "{v}"
    );
    assert!(
        !message.contains("sky is blue"),
        "the answer is never quoted: {v}"
    );

    if let Some(python) = sluice_tests::outside_tool(
        "OPENAI_PY",
        "openai_api: OpenAI's Python SDK parsing structured output (scripts/openai-venv.sh)",
    ) {
        let settings = json!({"base_url": s.url("/v1"), "api_key": TOKEN, "model": "json",
                              "structured_model": "json", "only": ["structured"]});
        let r = run_python_sdk(&python, &settings).await;
        assert_eq!(
            r["structured"],
            json!({"parsed": "blue", "streamed": "blue", "usage": 80}),
            "{r}"
        );
    }
    s.stop().await;
}

/// Runs `tests/py/openai_client.py` (OpenAI's Python SDK) with `settings` under `python`;
/// its findings, once it exited successfully.
async fn run_python_sdk(python: &str, settings: &Value) -> Value {
    sluice_tests::process::py_client(python, "openai_client.py", settings, CLIENT_PATIENCE).await
}

/// How long a client script may take: its scenarios run one after another, each a few
/// streams against a fake that answers at once.
const CLIENT_PATIENCE: Duration = Duration::from_secs(300);
