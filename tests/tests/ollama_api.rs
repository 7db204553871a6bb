//! The gateway's Ollama API end to end on the real broker: an Ollama client -> gateway ->
//! Pulsar -> text-completion processor -> a fake provider (OpenAI's wire format, or Ollama's
//! own), and back. The NDJSON lines are checked as bytes; seed 001's Ollama body is sent as
//! the seed writes it; and, when `OLLAMA_PY` names a python with Ollama's official client
//! (scripts/ollama-venv.sh makes one), that client drives the same routes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use serde_json::{Value, json};
use sluice_gateway::Auth;
use sluice_runtime::secret::Secret;
use sluice_tests::{GatewayStack, keys::KeysFile};

const TOKEN: &str = "ol-test-token-8c1f";

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

async fn post(url: &str, key: &str, body: &Value) -> reqwest::Response {
    http()
        .post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// An NDJSON body's objects, checking the framing: one JSON object per `\n`-ended line.
fn ndjson(body: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with('\n') && !text.contains('\r'), "{text:?}");
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

fn hello(model: &str) -> Value {
    json!({"model": model, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "say hello"}]})
}

/// Without `stream` the answer streams, as Ollama's does: NDJSON lines, then `done`; with
/// `stream: false`, one object; `/api/generate` the same with `response`.
#[tokio::test]
async fn answers_stream_by_default_as_ndjson_and_whole_on_request() {
    let s = stack("m-ol").await;
    let resp = post(&s.url("/api/chat"), TOKEN, &hello("m-ol")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let lines = ndjson(&resp.bytes().await.unwrap());
    let text: String = lines
        .iter()
        .map(|l| l["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello world!");
    assert!(lines[..lines.len() - 1].iter().all(|l| l["done"] == false));
    let done = lines.last().unwrap();
    assert_eq!(done["done"], true);
    assert_eq!(done["done_reason"], "stop");
    assert_eq!(
        (
            done["prompt_eval_count"].as_u64(),
            done["eval_count"].as_u64()
        ),
        (Some(11), Some(3))
    );
    assert!(done["total_duration"].as_u64().unwrap() > 0);
    assert_eq!(s.fake.last_body()["stream"], true);

    let mut whole = hello("m-ol");
    whole["stream"] = json!(false);
    let v: Value = post(&s.url("/api/chat"), TOKEN, &whole)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        v["message"],
        json!({"role": "assistant", "content": "Hello world!"})
    );
    assert_eq!(
        (v["done"].as_bool(), v["eval_count"].as_u64()),
        (Some(true), Some(3))
    );

    let generate = json!({"model": "m-ol", "prompt": "say hello"});
    let lines = ndjson(
        &post(&s.url("/api/generate"), TOKEN, &generate)
            .await
            .bytes()
            .await
            .unwrap(),
    );
    let text: String = lines
        .iter()
        .map(|l| l["response"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello world!");
    assert_eq!(lines.last().unwrap()["done"], true);
    s.stop().await;
}

/// Seed 001's Ollama request body, as the seed writes it (its placeholders but the model
/// left as they are: `num_ctx` as the quoted placeholder, and as the number a client
/// fills in), streamed as the seed's client reads it: one JSON object per line.
#[tokio::test]
async fn seed_001s_ollama_body_is_answered_as_written() {
    let s = stack("m-seed").await;
    for num_ctx in [json!("{config.llm.num_ctx}"), json!(8192)] {
        let body = json!({
          "model": "m-seed",
          "messages": [
            {
              "role": "system",
              "content": "You are an AI assistant that identifies lasting knowledge in journal entries. Analyze the provided blocks and return ONLY those that contain lasting insights worth preserving (skip temporal events/tasks/activities). Output one JSON object per line (NDJSON format), not a JSON array. Each object must have: block_id (string), confidence (float 0-1), reason (string explaining why this is knowledge worth preserving)."
            },
            {
              "role": "user",
              "content": "Analyze these journal blocks:\n\n{formatted_blocks}"
            }
          ],
          "stream": true,
          "options": {
            "temperature": 0.3,
            "num_ctx": num_ctx
          }
        });
        let resp = post(&s.url("/api/chat"), TOKEN, &body).await;
        assert_eq!(resp.status(), 200);
        let lines = ndjson(&resp.bytes().await.unwrap());
        assert_eq!(lines.last().unwrap()["done"], true, "{lines:?}");
        let sent = s.fake.last_body();
        assert_eq!(sent["temperature"], 0.3);
        assert_eq!(sent["messages"][0]["role"], "system");
        assert_eq!(
            sent["messages"][1]["content"],
            "Analyze these journal blocks:\n\n{formatted_blocks}"
        );
    }
    s.stop().await;
}

/// A client that goes away mid-stream cancels the provider call (the fake sees its connection
/// closed), and the stream is counted as cancelled.
#[tokio::test]
async fn a_client_that_disconnects_mid_stream_cancels_the_provider_call() {
    let s = stack("m-cancel").await;
    let resp = post(&s.url("/api/chat"), TOKEN, &hello("stall")).await;
    s.disconnect_mid_stream(resp, "Hel", "ollama-chat").await;
    s.stop().await;
}

/// API keys and their limits apply as on the other routes, each refusal in Ollama's shape:
/// a wrong key 401, a key without the service 403, a key over its rate 429 with
/// `Retry-After`; the error mid-stream is an `{"error"}` line after the text.
#[tokio::test]
async fn keys_limits_and_errors_answer_in_ollamas_shape() {
    let keys_file = KeysFile::new(&[
        ("one", "sk-one", "requests_per_minute = 1"),
        ("agents", "sk-agents", "services = [\"agent\"]"),
    ]);
    let keys = Arc::new(keys_file.load());
    let s = GatewayStack::start_serving("m-keys", &["error_mid_stream"], move |gc| {
        gc.auth = Auth::new(Some(Secret::new(TOKEN))).with_keys(keys);
    })
    .await;
    let url = s.url("/api/chat");
    let refusal = |resp: reqwest::Response| async move {
        let status = resp.status().as_u16();
        let retry = resp.headers().get("retry-after").is_some();
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v.as_object().unwrap().len(), 1, "{v}");
        (status, retry, v["error"].as_str().unwrap().to_owned())
    };
    let (status, _, e) = refusal(post(&url, "sk-wrong", &hello("m-keys")).await).await;
    assert_eq!((status, e.as_str()), (401, "unauthorized"));
    let (status, _, _) = refusal(post(&url, "sk-agents", &hello("m-keys")).await).await;
    assert_eq!(status, 403);
    let ok = post(&url, "sk-one", &hello("m-keys")).await;
    assert_eq!(ok.status(), 200);
    assert_eq!(
        ndjson(&ok.bytes().await.unwrap()).last().unwrap()["done"],
        true
    );
    let (status, retry, e) = refusal(post(&url, "sk-one", &hello("m-keys")).await).await;
    assert_eq!((status, retry), (429, true), "{e}");
    assert!(
        e.contains("\"one\" has reached its limit of 1 requests per minute"),
        "{e}"
    );

    let resp = post(&url, TOKEN, &hello("error_mid_stream")).await;
    assert_eq!(resp.status(), 200);
    let lines = ndjson(&resp.bytes().await.unwrap());
    assert_eq!(lines[0]["message"]["content"], "Hel");
    let last = lines.last().unwrap();
    assert!(
        last["error"].as_str().unwrap().contains("model overloaded"),
        "{lines:?}"
    );
    assert_eq!(last.as_object().unwrap().len(), 1);
    s.stop().await;
}

/// An Ollama caller answered through the Ollama provider: text and tool calls (whole, their
/// arguments objects), and the results sent back by `tool_name`.
#[tokio::test]
async fn ollama_callers_are_answered_through_the_ollama_provider_with_tools() {
    use sluice_tests::{RoutedService, fake_ollama::FakeOllama, provider_service};
    use sluice_text_completion::providers::ollama::{OllamaConfig, OllamaProvider};
    let fake = FakeOllama::start().await;
    let config = OllamaConfig::new(fake.base_url(), "tools");
    let service = provider_service(Arc::new(OllamaProvider::new(config).unwrap()))
        .with_models(["normal".to_owned()]);
    let s = RoutedService::start(service, |gc| gc.auth = Auth::new(Some(Secret::new(TOKEN)))).await;
    let url = s.url("/api/chat");
    let lines = ndjson(
        &post(&url, TOKEN, &hello("normal"))
            .await
            .bytes()
            .await
            .unwrap(),
    );
    let text: String = lines
        .iter()
        .map(|l| l["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "The sky is blue.");
    assert_eq!(lines.last().unwrap()["prompt_eval_count"], 26);

    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
    let asked = json!([{"role": "user", "content": "Paris?"}]);
    let lines = ndjson(
        &post(
            &url,
            TOKEN,
            &json!({"model": "tools", "messages": asked, "tools": tools}),
        )
        .await
        .bytes()
        .await
        .unwrap(),
    );
    let calls: Vec<&Value> = lines
        .iter()
        .filter_map(|l| l["message"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1, "{lines:?}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], json!({"q": "Paris?"}));
    assert_eq!(lines.last().unwrap()["done_reason"], "stop");
    assert_eq!(fake.last_body()["tools"], tools);

    let back = json!({"model": "tools", "stream": false, "tools": tools, "messages": [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"q": "Paris?"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]});
    let v: Value = post(&url, TOKEN, &back).await.json().await.unwrap();
    assert_eq!(v["message"]["content"], "results: sunny", "{v}");
    let sent = fake.last_body();
    assert_eq!(sent["messages"][2]["tool_name"], "get_weather", "{sent}");
    s.stop().await;
}

/// Ollama's own Python client against the gateway: chat and generate, whole and streamed,
/// structured output, a refused key (whole and streamed), an unknown model, a refused option,
/// an error mid-stream, a stream closed early (which must cancel the provider call), tools
/// whole and streamed with the results sent back, the model list and `show`. Runs when
/// `OLLAMA_PY` is set.
#[tokio::test]
async fn the_official_python_client_works_against_the_gateway() {
    let Some(python) = sluice_tests::outside_tool(
        "OLLAMA_PY",
        "ollama_api: Ollama's Python client against the gateway (scripts/ollama-venv.sh)",
    ) else {
        return;
    };
    let s = stack("m-py").await;
    let settings = json!({"host": s.url(""), "api_key": TOKEN, "model": "m-py",
                          "mid_error": "error_mid_stream", "stall": "stall", "tools_model": "tools"});
    let r = sluice_tests::process::py_client(
        &python,
        "ollama_client.py",
        &settings,
        Duration::from_secs(300),
    )
    .await;

    let w = &r["chat_whole"];
    assert_eq!(
        (w["content"].as_str(), w["role"].as_str()),
        (Some("Hello world!"), Some("assistant")),
        "{r}"
    );
    assert_eq!(
        (w["done"].as_bool(), w["done_reason"].as_str()),
        (Some(true), Some("stop"))
    );
    assert_eq!(
        (w["prompt_eval_count"].as_u64(), w["eval_count"].as_u64()),
        (Some(11), Some(3))
    );
    assert!(w["created_at"].as_str().unwrap().starts_with("20"), "{w}");
    let st = &r["chat_stream"];
    assert_eq!(st["content"], "Hello world!");
    assert!(st["lines"].as_u64().unwrap() >= 2);
    let done = st["done"].as_array().unwrap();
    assert!(done[..done.len() - 1].iter().all(|d| d == false) && done.last() == Some(&json!(true)));
    assert_eq!(
        (st["eval_count"].as_u64(), st["prompt_eval_count"].as_u64()),
        (Some(3), Some(11))
    );
    assert_eq!(r["generate_whole"]["response"], "Hello world!");
    assert_eq!(r["generate_stream"]["response"], "Hello world!");
    assert_eq!(r["generate_stream"]["done"], true);
    assert_eq!(r["structured"]["content"], "Hello world!");
    for refused in ["refused_key", "refused_key_stream"] {
        assert_eq!(r[refused]["raised"], "ResponseError", "{r}");
        assert_eq!(r[refused]["status"], 401);
        assert_eq!(r[refused]["error"], "unauthorized");
    }
    assert_eq!(r["not_found"]["status"], 404, "{r}");
    assert_eq!(r["not_found"]["error"], "model 'no-such-model' not found");
    assert_eq!(r["refused_option"]["status"], 400);
    assert_eq!(r["mid_error"]["raised"], "ResponseError");
    assert_eq!(r["mid_error"]["content"], "Hel");
    assert!(
        r["mid_error"]["error"]
            .as_str()
            .unwrap()
            .contains("model overloaded"),
        "{r}"
    );
    assert_eq!(r["cancel"]["first"], "Hel");
    let called = json!([{"name": "get_weather", "arguments": {"q": "weather in Paris?"}}]);
    assert_eq!(r["tools_whole"], called, "{r}");
    assert_eq!(r["tools_stream"], called);
    assert_eq!(r["tools_results"]["content"], "results: sunny");
    assert_eq!(
        r["list"],
        json!(["error_mid_stream", "m-py", "stall", "tools"])
    );
    assert_eq!(r["show"], json!(["completion"]));

    let bodies = s.fake.bodies();
    // The options and the structured output reached the provider.
    assert!(
        bodies
            .iter()
            .any(|b| b["temperature"] == 0.3 && b["max_tokens"] == 40),
        "{bodies:?}"
    );
    assert!(
        bodies
            .iter()
            .any(|b| b["response_format"]["type"] == "json_schema"),
        "{bodies:?}"
    );
    // Closing the stream early cancelled the provider call.
    s.fake
        .assert_abandoned(
            Duration::from_secs(15),
            "closing the stream did not cancel the provider call",
        )
        .await;
    s.stop().await;
}
