//! The gateway's OpenAI Responses API end to end on the real broker: a client -> gateway ->
//! Pulsar -> text-completion processor -> a fake provider (OpenAI's wire format, or
//! Anthropic's for structured output), and back. The SSE events are checked as bytes; and, when
//! `OPENAI_PY` names a python with OpenAI's official SDK (scripts/openai-venv.sh makes one),
//! that SDK's `client.responses.create`, `client.responses.stream` and `client.responses.parse`
//! drive the same route.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use serde_json::{Value, json};
use sluice_gateway::Auth;
use sluice_runtime::secret::Secret;
use sluice_tests::{GatewayStack, PATIENCE, eventually, keys::KeysFile};

const TOKEN: &str = "rs-test-token-51d0";

/// A stack serving `model`, with the fake's scripted models as extra models, behind a token.
async fn stack(model: &str) -> GatewayStack {
    GatewayStack::start_serving(model, &["error_mid_stream", "stall", "tools"], |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)))
    })
    .await
}

async fn post(url: &str, key: &str, body: &Value) -> reqwest::Response {
    sluice_runtime::install_crypto_provider();
    reqwest::Client::new()
        .post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// An SSE body's events as `(event, data)`, checking the framing: each event an `event:`
/// line naming its data's `type`, a `data:` line, a blank line; sequence numbers from 0.
fn sse_events(body: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n") && !text.contains('\r'), "{text:?}");
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.is_empty()) {
        let (name, data) = block.split_once('\n').unwrap();
        let name = name.strip_prefix("event: ").unwrap().to_owned();
        let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["type"], name.as_str(), "{block}");
        assert_eq!(data["sequence_number"], out.len(), "{block}");
        out.push((name, data));
    }
    out
}

/// Whole and streamed on the wire: the `response` object, then the semantic events, their
/// text the provider's, usage the provider's; the request reached the provider as asked.
#[tokio::test]
async fn responses_are_answered_whole_and_as_semantic_events() {
    let s = stack("m-rs").await;
    let url = s.url("/v1/responses");
    let ask = json!({"model": "m-rs", "input": "say hello", "instructions": "be brief",
                     "max_output_tokens": 40, "temperature": 0.3});
    let resp = post(&url, TOKEN, &ask).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["output"][0]["content"][0]["text"], "Hello world!", "{v}");
    assert_eq!(v["usage"]["input_tokens"], 11);
    assert_eq!(v["usage"]["output_tokens"], 3);
    let sent = s.fake.last_body();
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(
        (&sent["temperature"], &sent["max_tokens"]),
        (&json!(0.3), &json!(40))
    );

    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let resp = post(&url, TOKEN, &streamed).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    assert_eq!(resp.headers()["x-accel-buffering"], "no");
    let events = sse_events(&resp.bytes().await.unwrap());
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello world!");
    assert_eq!(events[0].0, "response.created");
    let (last, done) = events.last().unwrap();
    assert_eq!(last, "response.completed");
    assert_eq!(done["response"]["usage"]["total_tokens"], 14);
    assert_eq!(done["response"]["id"], events[0].1["response"]["id"]);
    s.stop().await;
}

/// A client that goes away mid-stream cancels the provider call (the fake sees its
/// connection closed), and the stream is counted as cancelled.
#[tokio::test]
async fn a_client_that_disconnects_mid_stream_cancels_the_provider_call() {
    let s = stack("m-rs-cancel").await;
    let ask = json!({"model": "stall", "input": "hi", "stream": true});
    let resp = post(&s.url("/v1/responses"), TOKEN, &ask).await;
    s.disconnect_mid_stream(resp, "\"delta\":\"Hel\"", "openai-responses")
        .await;
    s.stop().await;
}

/// Keys, limits and malformed bodies answer in OpenAI's error shape with OpenAI's statuses:
/// a wrong key 401, a key over its rate 429 with `Retry-After`, bodies that are not
/// Responses requests 400 (never a 5xx), an unknown model 404; an error mid-stream is an
/// `error` event then `response.failed`.
#[tokio::test]
async fn keys_limits_bad_bodies_and_errors_answer_in_openais_shape() {
    let keys_file = KeysFile::new(&[("one", "sk-one", "requests_per_minute = 1")]);
    let keys = Arc::new(keys_file.load());
    let s = GatewayStack::start_serving("m-rs-keys", &["error_mid_stream"], move |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN))).with_keys(keys);
    })
    .await;
    let url = s.url("/v1/responses");
    let error = |resp: reqwest::Response| async move {
        let status = resp.status().as_u16();
        let retry = resp.headers().get("retry-after").is_some();
        let v: Value = resp.json().await.unwrap();
        let e = v["error"].as_object().unwrap().clone();
        for field in ["message", "type", "param", "code"] {
            assert!(e.contains_key(field), "{v}");
        }
        (status, retry, Value::Object(e))
    };
    let hello = json!({"model": "m-rs-keys", "input": "hi"});
    let (status, _, e) = error(post(&url, "sk-wrong", &hello).await).await;
    assert_eq!((status, &e["code"]), (401, &json!("invalid_api_key")));
    assert_eq!(post(&url, "sk-one", &hello).await.status(), 200);
    let (status, retry, e) = error(post(&url, "sk-one", &hello).await).await;
    assert_eq!((status, retry), (429, true), "{e}");
    assert_eq!(e["code"], "rate_limit_exceeded");

    for (body, param) in [
        (json!({"input": "hi"}), Value::Null),
        (json!({"model": "m-rs-keys"}), json!("input")),
        (json!({"model": "m-rs-keys", "input": 7}), json!("input")),
        (
            json!({"model": "m-rs-keys", "input": "hi", "bogus": true}),
            Value::Null,
        ),
        (
            json!({"model": "m-rs-keys", "input": "hi", "previous_response_id": "resp_1"}),
            json!("previous_response_id"),
        ),
        (
            json!({"model": "m-rs-keys", "input": "hi", "tools": [{"type": "file_search"}]}),
            json!("tools[0].type"),
        ),
        (
            json!({"model": "m-rs-keys", "input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]}),
            json!("input[0].call_id"),
        ),
    ] {
        let (status, _, e) = error(post(&url, TOKEN, &body).await).await;
        assert_eq!((status, &e["param"]), (400, &param), "{body}: {e}");
        assert_eq!(e["type"], "invalid_request_error");
    }
    let not_json = reqwest::Client::new()
        .post(&url)
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(error(not_json).await.0, 400);
    let (status, _, e) =
        error(post(&url, TOKEN, &json!({"model": "nope", "input": "hi"})).await).await;
    assert_eq!((status, &e["code"]), (404, &json!("model_not_found")));

    let ask = json!({"model": "error_mid_stream", "input": "hi", "stream": true});
    let resp = post(&url, TOKEN, &ask).await;
    assert_eq!(resp.status(), 200);
    let events = sse_events(&resp.bytes().await.unwrap());
    let n = events.len();
    assert_eq!(events[n - 2].0, "error", "{events:?}");
    assert!(
        events[n - 2].1["message"]
            .as_str()
            .unwrap()
            .contains("model overloaded")
    );
    assert_eq!(events[n - 1].0, "response.failed");
    assert_eq!(events[n - 1].1["response"]["status"], "failed");
    s.stop().await;
}

/// OpenAI's own Python SDK against the route: `responses.create` whole and streamed, the
/// `responses.stream` helper (text in order, the final response and its usage), a function
/// tool called and its output sent back, streamed calls, the errors (refused key, unknown
/// model, `previous_response_id`, a hosted tool), every body and event validated against the
/// SDK's own pydantic types, an error mid-stream, and a stream closed early, which cancels
/// the provider call. Runs when `OPENAI_PY` is set.
#[tokio::test]
async fn the_official_python_sdk_drives_the_responses_route() {
    let Some(python) = sluice_tests::outside_tool(
        "OPENAI_PY",
        "responses_api: OpenAI's Python SDK against /v1/responses (scripts/openai-venv.sh)",
    ) else {
        return;
    };
    let s = stack("m-rs-py").await;
    let settings = json!({"base_url": s.url("/v1"), "api_key": TOKEN, "model": "m-rs-py",
                          "mid_error": "error_mid_stream", "stall": "stall", "tools_model": "tools",
                          "only": ["whole", "stream", "helper", "tools", "errors", "validated", "mid_error", "cancel"]});
    let r = run_python_sdk(&python, &settings).await;
    let whole = &r["whole"];
    assert_eq!(whole["output_text"], "Hello world!", "{r}");
    assert_eq!(
        (&whole["object"], &whole["status"]),
        (&json!("response"), &json!("completed"))
    );
    assert!(whole["id"].as_str().unwrap().starts_with("resp_"), "{r}");
    assert_eq!(whole["output_types"], json!(["message"]));
    assert_eq!(whole["usage"]["total_tokens"], 14, "{r}");
    assert_eq!(whole["usage"]["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(whole["instructions"], "be brief");

    let stream = &r["stream"];
    assert_eq!(stream["text"], "Hello world!", "{r}");
    assert_eq!(stream["done_text"], "Hello world!");
    assert_eq!(stream["final"], "Hello world!");
    let types = stream["types"].as_array().unwrap();
    assert_eq!(types[0], "response.created");
    assert_eq!(types[1], "response.in_progress");
    assert_eq!(types.last().unwrap(), "response.completed");
    let sequence: Vec<u64> = stream["sequence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    assert_eq!(sequence, (0..sequence.len() as u64).collect::<Vec<_>>());
    assert_eq!(stream["usage"]["output_tokens"], 3);

    let helper = &r["helper"];
    assert_eq!(helper["text"], "Hello world!", "{r}");
    assert_eq!(
        helper["deltas"].as_array().unwrap().concat_str(),
        "Hello world!"
    );
    assert_eq!(helper["status"], "completed");
    assert_eq!(helper["usage"]["input_tokens"], 11);
    // The helper's conversation reached the provider as turns.
    assert!(
        s.fake
            .bodies()
            .iter()
            .any(|b| b["messages"].as_array().is_some_and(
                |m| m.len() == 3 && m[1] == json!({"role": "assistant", "content": "Paris"})
            )),
        "{:?}",
        s.fake.bodies()
    );

    let tools = &r["tools"];
    assert_eq!(
        tools["calls"],
        json!([{"name": "get_weather", "call_id": "call_0_get_weather",
                "arguments": {"q": "weather in Paris?"}, "id": tools["calls"][0]["id"]}]),
        "{r}"
    );
    assert!(tools["calls"][0]["id"].as_str().unwrap().starts_with("fc_"));
    assert_eq!(tools["answer"], "results: sunny");
    assert_eq!(tools["streamed"]["names"], json!(["get_weather"]));
    assert_eq!(
        tools["streamed"]["arguments"],
        json!([{"q": "weather in Rome?"}])
    );
    assert!(tools["streamed"]["deltas"].as_u64().unwrap() > 1, "{r}");

    for key in ["refused_key", "refused_key_stream"] {
        assert_eq!(r[key]["raised"], "AuthenticationError", "{r}");
        assert_eq!(r[key]["status"], 401);
    }
    assert_eq!(r["not_found"]["raised"], "NotFoundError");
    assert_eq!(r["not_found"]["code"], "model_not_found");
    assert_eq!(r["previous"]["raised"], "BadRequestError");
    assert_eq!(r["previous"]["param"], "previous_response_id");
    assert_eq!(r["hosted_tool"]["raised"], "BadRequestError");
    assert_eq!(r["hosted_tool"]["param"], "tools[0].type");

    // Every body and event validated against the SDK's own types (the SDK itself builds
    // them unchecked).
    let validated = &r["validated"];
    assert_eq!(validated["whole"], 1, "{r}");
    assert_eq!(
        validated["text"].as_array().unwrap().last().unwrap(),
        "response.completed"
    );
    assert!(
        validated["tools"]
            .as_array()
            .unwrap()
            .contains(&json!("response.function_call_arguments.done")),
        "{r}"
    );
    let failed = validated["failed"].as_array().unwrap();
    assert_eq!(
        failed[failed.len() - 2..],
        [json!("error"), json!("response.failed")]
    );

    let mid = &r["mid_error"];
    assert_eq!(mid["text"], "Hel", "{r}");
    assert!(mid["error"].as_str().unwrap().contains("model overloaded"));
    assert!(mid["failed"].as_str().unwrap().contains("model overloaded"));
    assert_eq!(
        mid["types"].as_array().unwrap().last().unwrap(),
        "response.failed"
    );

    assert_eq!(r["cancel"]["first"], "Hel");
    let abandoned = eventually(PATIENCE, async || s.fake.abandoned_streams(), |n| *n > 0).await;
    assert!(
        abandoned > 0,
        "stream.close() did not cancel the provider call"
    );
    s.stop().await;
}

/// Structured output through `text.format` from a provider with no JSON mode (Anthropic;
/// the fake's `json` model strays from the schema first): the processor holds the answer to
/// the schema, and the caller's `output_text` parses; OpenAI's SDK's `responses.create` with
/// a `json_schema` format and `responses.parse` with a Pydantic model get it, when
/// `OPENAI_PY` is set.
#[tokio::test]
async fn text_format_json_schema_is_structured_output() {
    use sluice_tests::{RoutedService, fake_anthropic::FakeAnthropic, provider_service};
    use sluice_text_completion::providers::anthropic::{AnthropicConfig, AnthropicProvider};
    let fake = FakeAnthropic::start().await;
    let mut config = AnthropicConfig::new(fake.base_url(), "json");
    config.credential = Some(Secret::new("sk-ant-test"));
    let service = provider_service(Arc::new(AnthropicProvider::new(config).unwrap()));
    let s = RoutedService::start(service, |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN)));
    })
    .await;
    let schema = json!({"type": "object", "required": ["label"], "additionalProperties": false,
                        "properties": {"label": {"type": "string", "enum": ["blue", "grey"]}}});
    let ask = json!({"model": "json", "input": "the sky", "text": {"format":
        {"type": "json_schema", "name": "sky", "schema": schema, "strict": true}}});
    let v: Value = post(&s.url("/v1/responses"), TOKEN, &ask)
        .await
        .json()
        .await
        .unwrap();
    let text = v["output"][0]["content"][0]["text"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(text).unwrap();
    assert_eq!(parsed, json!({"label": "blue"}), "{v}");
    assert!(
        fake.last_body()["system"]
            .as_str()
            .unwrap()
            .contains(r#""enum":["blue","grey"]"#)
    );
    if let Some(python) = sluice_tests::outside_tool(
        "OPENAI_PY",
        "responses_api: OpenAI's Python SDK with text.format (scripts/openai-venv.sh)",
    ) {
        let settings = json!({"base_url": s.url("/v1"), "api_key": TOKEN,
                              "structured_model": "json", "only": ["structured"]});
        let r = run_python_sdk(&python, &settings).await;
        assert_eq!(r["structured"]["label"], "blue", "{r}");
        assert_eq!(r["structured"]["parsed"], "blue", "{r}");
        assert_eq!(r["structured"]["usage"], 80, "both calls' usage: {r}");
    }
    s.stop().await;
}

/// The strings of a JSON array, joined.
trait ConcatStr {
    fn concat_str(&self) -> String;
}

impl ConcatStr for Vec<Value> {
    fn concat_str(&self) -> String {
        self.iter().filter_map(Value::as_str).collect()
    }
}

/// Runs `tests/py/responses_client.py` (OpenAI's Python SDK) with `settings` under `python`;
/// its findings, once it exited successfully.
async fn run_python_sdk(python: &str, settings: &Value) -> Value {
    sluice_tests::process::py_client(
        python,
        "responses_client.py",
        settings,
        std::time::Duration::from_secs(300),
    )
    .await
}
