//! The gateway's Anthropic Messages API end to end on the real broker: a Messages client ->
//! gateway -> Pulsar -> text-completion processor -> a fake provider (OpenAI's wire format, or
//! Anthropic's own through sluice's Anthropic provider), and back. The events are checked as
//! bytes; and, when `ANTHROPIC_PY` names a python with Anthropic's official SDK
//! (scripts/anthropic-venv.sh makes one), that SDK drives the same route.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use serde_json::{Value, json};
use sluice_gateway::Auth;
use sluice_runtime::secret::Secret;
use sluice_tests::{GatewayStack, PATIENCE, eventually, keys::KeysFile};

const TOKEN: &str = "sk-ant-test-token-5e2d";

/// A stack serving `model`, with the fake's scripted models as extra models, behind a token.
async fn stack(model: &str) -> GatewayStack {
    GatewayStack::start_serving(model, &["error_mid_stream", "stall", "tools"], |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)))
    })
    .await
}

fn http() -> reqwest::Client {
    sluice_runtime::install_crypto_provider();
    reqwest::Client::new()
}

/// Posts `body` as Anthropic's SDKs do: the key as `x-api-key`, `anthropic-version`.
async fn post(url: &str, key: &str, body: &Value) -> reqwest::Response {
    http()
        .post(url)
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .unwrap()
}

fn hello(model: &str, stream: bool) -> Value {
    json!({"model": model, "max_tokens": 64, "stream": stream,
           "messages": [{"role": "user", "content": "say hello"}]})
}

/// An SSE body's events: (name, data), checking the framing.
fn events(body: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.split_terminator("\n\n")
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap().to_owned();
            let data = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            (name, data)
        })
        .collect()
}

/// A streamed answer through the broker: Anthropic's events in their order, the text in
/// order, the usage totals on `message_delta`; a whole answer is one `message`.
#[tokio::test]
async fn answers_stream_as_anthropics_events_and_whole_as_one_message() {
    let s = stack("m-an").await;
    let resp = post(&s.url("/v1/messages"), TOKEN, &hello("m-an", true)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let got = events(&resp.bytes().await.unwrap());
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let text: String = got
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello world!");
    let delta = &got[got.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(
        delta["usage"],
        json!({"input_tokens": 11, "output_tokens": 3})
    );
    assert_eq!(s.fake.last_body()["stream"], true);
    assert_eq!(s.fake.last_body()["max_tokens"], 64);

    let v: Value = post(&s.url("/v1/messages"), TOKEN, &hello("m-an", false))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "Hello world!"}])
    );
    assert_eq!(
        (v["type"].as_str(), v["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(v["usage"], json!({"input_tokens": 11, "output_tokens": 3}));
    s.stop().await;
}

/// A client that goes away mid-stream cancels the provider call (the fake sees its connection
/// closed), and the stream is counted as cancelled.
#[tokio::test]
async fn a_client_that_disconnects_mid_stream_cancels_the_provider_call() {
    let s = stack("m-cancel").await;
    let resp = post(&s.url("/v1/messages"), TOKEN, &hello("stall", true)).await;
    s.disconnect_mid_stream(resp, "Hel", "anthropic-messages")
        .await;
    s.stop().await;
}

/// API keys and their limits apply as on the other routes, each refusal in Anthropic's
/// shape: a wrong key 401 `authentication_error`, a key without the service 403
/// `permission_error`, a key over its rate 429 `rate_limit_error` with `Retry-After`; an
/// error mid-stream is an `event: error` after the text.
#[tokio::test]
async fn keys_limits_and_errors_answer_in_anthropics_shape() {
    let keys_file = KeysFile::new(&[
        ("one", "sk-one", "requests_per_minute = 1"),
        ("agents", "sk-agents", "services = [\"agent\"]"),
    ]);
    let keys = Arc::new(keys_file.load());
    let s = GatewayStack::start_serving("m-keys", &["error_mid_stream"], move |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN))).with_keys(keys);
    })
    .await;
    let url = s.url("/v1/messages");
    let refusal = |resp: reqwest::Response| async move {
        let status = resp.status().as_u16();
        let retry = resp.headers().get("retry-after").is_some();
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["type"], "error", "{v}");
        let kind = v["error"]["type"].as_str().unwrap().to_owned();
        (
            status,
            retry,
            kind,
            v["error"]["message"].as_str().unwrap().to_owned(),
        )
    };
    let (status, _, kind, _) = refusal(post(&url, "sk-wrong", &hello("m-keys", false)).await).await;
    assert_eq!((status, kind.as_str()), (401, "authentication_error"));
    let (status, _, kind, _) =
        refusal(post(&url, "sk-agents", &hello("m-keys", false)).await).await;
    assert_eq!((status, kind.as_str()), (403, "permission_error"));
    let ok = post(&url, "sk-one", &hello("m-keys", false)).await;
    assert_eq!(ok.status(), 200);
    let (status, retry, kind, message) =
        refusal(post(&url, "sk-one", &hello("m-keys", false)).await).await;
    assert_eq!(
        (status, retry, kind.as_str()),
        (429, true, "rate_limit_error")
    );
    assert!(
        message.contains("\"one\" has reached its limit of 1 requests per minute"),
        "{message}"
    );

    let resp = post(&url, TOKEN, &hello("error_mid_stream", true)).await;
    assert_eq!(resp.status(), 200);
    let got = events(&resp.bytes().await.unwrap());
    let (name, data) = got.last().unwrap();
    assert_eq!(name, "error", "{got:?}");
    assert_eq!(data["type"], "error");
    assert!(
        data["error"]["message"]
            .as_str()
            .unwrap()
            .contains("model overloaded"),
        "{data}"
    );
    assert!(
        got.iter().any(|(_, d)| d["delta"]["text"] == "Hel"),
        "{got:?}"
    );
    s.stop().await;
}

/// A Messages caller answered through sluice's own Anthropic provider (the fake speaks
/// Anthropic's wire): the stream the gateway sends is the fake's, event for event (ids
/// aside), tool use included, and the tools and results reach Anthropic as sent.
#[tokio::test]
async fn messages_through_the_anthropic_provider_come_back_as_anthropic_sent_them() {
    use sluice_tests::{RoutedService, fake_anthropic::FakeAnthropic, provider_service};
    use sluice_text_completion::providers::anthropic::{AnthropicConfig, AnthropicProvider};
    let fake = FakeAnthropic::start().await;
    let mut config = AnthropicConfig::new(fake.base_url(), "tools");
    config.credential = Some(Secret::new("sk-ant-provider"));
    let service = provider_service(Arc::new(AnthropicProvider::new(config).unwrap()))
        .with_models(["tools-text".to_owned()]);
    let s = RoutedService::start(service, |gc| gc.auth = Auth::new(Some(Secret::new(TOKEN)))).await;
    let url = s.url("/v1/messages");
    let tools = json!([{"name": "get_weather", "description": "the weather in a city",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}]);
    let ask = json!({"model": "tools-text", "max_tokens": 100, "stream": true, "tools": tools,
                     "messages": [{"role": "user", "content": "Paris"}]});
    let got = events(&post(&url, TOKEN, &ask).await.bytes().await.unwrap());
    let blocks: Vec<Value> = got
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, d)| d["content_block"].clone())
        .collect();
    assert_eq!(
        blocks,
        [
            json!({"type": "text", "text": ""}),
            json!({"type": "tool_use", "id": "toolu_0_get_weather", "name": "get_weather", "input": {}})
        ]
    );
    let input: String = got
        .iter()
        .filter_map(|(_, d)| d["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&input).unwrap(),
        json!({"q": "Paris"})
    );
    let delta = &got[got.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(
        delta["usage"],
        json!({"input_tokens": 20, "output_tokens": 10})
    );
    assert_eq!(fake.last_body()["tools"], tools);

    let back = json!({"model": "tools-text", "max_tokens": 100, "tools": tools, "messages": [
        {"role": "user", "content": "Paris"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look that up."},
            {"type": "tool_use", "id": "toolu_0_get_weather", "name": "get_weather", "input": {"q": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0_get_weather", "content": "sunny"}]}]});
    let v: Value = post(&url, TOKEN, &back).await.json().await.unwrap();
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "results: sunny"}]),
        "{v}"
    );
    assert_eq!(v["stop_reason"], "end_turn");
    let sent = fake.last_body();
    assert_eq!(
        sent["messages"][1]["content"][1]["type"], "tool_use",
        "{sent}"
    );
    assert_eq!(
        sent["messages"][2]["content"][0]["tool_use_id"],
        "toolu_0_get_weather"
    );
    s.stop().await;
}

/// Anthropic's own Python SDK against the gateway: `messages.create` whole and streamed,
/// `messages.stream` (text in order, the final message and usage), tools whole and streamed
/// (tool_use blocks with parsed input) with the SDK's blocks and the results sent back, a
/// refused key (whole and streamed), an unknown model, malformed bodies (400
/// `invalid_request_error`), an error mid-stream, a stream closed early (which must cancel the
/// provider call), and the model list. Runs when `ANTHROPIC_PY` is set.
#[tokio::test]
async fn the_official_python_sdk_works_against_the_gateway() {
    let Some(python) = sluice_tests::outside_tool(
        "ANTHROPIC_PY",
        "anthropic_api: Anthropic's Python SDK against the gateway (scripts/anthropic-venv.sh)",
    ) else {
        return;
    };
    let s = stack("m-py").await;
    let settings = json!({"base_url": s.url(""), "api_key": TOKEN, "model": "m-py",
                          "mid_error": "error_mid_stream", "stall": "stall", "tools_model": "tools"});
    let r = sluice_tests::process::py_client(
        &python,
        "anthropic_client.py",
        &settings,
        Duration::from_secs(300),
    )
    .await;

    let w = &r["whole"];
    assert_eq!(
        w["content"],
        json!([{"type": "text", "text": "Hello world!"}]),
        "{r}"
    );
    assert_eq!(
        (w["type"].as_str(), w["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert_eq!(
        (w["stop_reason"].as_str(), w["model"].as_str()),
        (Some("end_turn"), Some("m-py"))
    );
    assert_eq!(w["usage"], json!({"input_tokens": 11, "output_tokens": 3}));
    assert!(w["id"].as_str().unwrap().starts_with("msg_"), "{w}");
    assert!(w["request_id"].as_str().unwrap().starts_with("req_"), "{w}");
    let st = &r["stream"];
    assert_eq!(
        st["texts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect::<String>(),
        "Hello world!"
    );
    assert!(st["texts"].as_array().unwrap().len() >= 2, "{st}");
    assert_eq!(st["final"]["content"], w["content"]);
    assert_eq!(st["final"]["usage"], w["usage"]);
    assert_eq!(st["final"]["stop_reason"], "end_turn");
    let ev: Vec<&str> = r["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(ev.first(), Some(&"message_start"));
    assert_eq!(ev[ev.len() - 2..], ["message_delta", "message_stop"]);

    let called = json!([
        {"type": "tool_use", "name": "get_weather", "input": {"q": "weather in Paris?"}},
        {"type": "tool_use", "name": "get_time", "input": {"q": "weather in Paris?"}}]);
    let without_ids = |m: &Value| -> Value {
        m["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                let mut b = b.clone();
                assert!(b["id"].as_str().is_some_and(|i| !i.is_empty()), "{b}");
                b.as_object_mut().unwrap().remove("id");
                b
            })
            .collect()
    };
    assert_eq!(without_ids(&r["tools_whole"]), called, "{r}");
    assert_eq!(r["tools_whole"]["stop_reason"], "tool_use");
    assert_eq!(without_ids(&r["tools_stream"]["final"]), called);
    assert_eq!(r["tools_stream"]["final"]["stop_reason"], "tool_use");
    assert!(
        r["tools_stream"]["partials"].as_array().unwrap().len() > 2,
        "{r}"
    );
    assert_eq!(
        r["tools_stream"]["final"]["usage"],
        json!({"input_tokens": 20, "output_tokens": 10})
    );
    assert_eq!(
        r["tools_results"]["content"],
        json!([{"type": "text", "text": "results: sunny; noon"}])
    );

    for refused in ["refused_key", "refused_key_stream"] {
        assert_eq!(r[refused]["raised"], "AuthenticationError", "{r}");
        assert_eq!(r[refused]["status"], 401);
        assert_eq!(r[refused]["body"]["error"]["type"], "authentication_error");
    }
    assert_eq!(r["not_found"]["raised"], "NotFoundError", "{r}");
    assert_eq!(
        r["not_found"]["body"],
        json!({"type": "error", "error": {"type": "not_found_error", "message": "model: no-such-model"}})
    );
    for bad in ["no_max_tokens", "bad_role", "refused_field", "not_object"] {
        assert_eq!(r[bad]["raised"], "BadRequestError", "{bad}: {r}");
        assert_eq!(r[bad]["status"], 400);
        assert_eq!(r[bad]["body"]["type"], "error", "{bad}: {r}");
        assert_eq!(r[bad]["body"]["error"]["type"], "invalid_request_error");
    }
    assert_eq!(
        r["no_max_tokens"]["body"]["error"]["message"],
        "max_tokens: Field required"
    );
    assert_eq!(r["mid_error"]["raised"], "APIStatusError", "{r}");
    assert_eq!(r["mid_error"]["texts"], json!(["Hel"]));
    assert!(
        r["mid_error"]["message"]
            .as_str()
            .unwrap()
            .contains("model overloaded"),
        "{r}"
    );
    assert_eq!(r["cancel"]["first"], "Hel");
    assert_eq!(
        r["models"],
        json!(["error_mid_stream", "m-py", "stall", "tools"])
    );
    assert_eq!(r["model"], "m-py");

    let bodies = s.fake.bodies();
    // The settings reached the provider.
    assert!(
        bodies.iter().any(|b| b["temperature"] == 0.3
            && b["max_tokens"] == 40
            && b["stop"] == json!(["END"])),
        "{bodies:?}"
    );
    // Closing the stream early cancelled the provider call.
    let abandoned = eventually(PATIENCE, async || s.fake.abandoned_streams(), |n| *n > 0).await;
    assert!(
        abandoned > 0,
        "closing the stream did not cancel the provider call"
    );
    s.stop().await;
}
