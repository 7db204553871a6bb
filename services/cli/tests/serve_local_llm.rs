//! The main job as a test: `sluice serve` (in-process bus) against the real local LLM that
//! the test command starts (llama-server + SmolLM2-135M), and `sluice invoke llm` streaming
//! its answer. A 135M model answers poorly: this checks the protocol and usage, not prose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use common::Sluice;

mod common;

/// `sluice serve` with the local-LLM config, answering at most `max_tokens` tokens; returns
/// the process and the gateway's address.
async fn serve(max_tokens: &str) -> (Sluice, String) {
    let url = std::env::var("SLUICE_LLM_URL").unwrap_or_else(|_| "http://127.0.0.1:8766".into());
    let key = std::env::var("SLUICE_LLM_API_KEY")
        .expect("the test command sets SLUICE_LLM_API_KEY and starts the local LLM with it");
    let mut serve = Sluice::spawn(
        &[
            "serve",
            "--config",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../deploy/serve/local-llm.toml"
            ),
            "--base-url",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--max-output-tokens",
            max_tokens,
        ],
        &[("SLUICE_LLM_API_KEY", &key)],
        &["SLUICE_CONFIG", "SLUICE_GATEWAY_TOKEN"],
    );
    let line = serve.stdout_line("gateway on ").await;
    let gateway = line
        .split("gateway on ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap()
        .to_owned();
    (serve, gateway)
}

#[tokio::test]
async fn serve_streams_a_real_local_llm_answer_to_invoke() {
    let (_serve, gateway) = serve("24").await;
    let out = common::run_within(
        Duration::from_secs(180),
        &[
            "invoke",
            "-u",
            &gateway,
            "--show-usage",
            "llm",
            "You are a helpful assistant.",
            "Name a colour.",
        ],
        &[],
        &["SLUICE_TOKEN"],
    )
    .await;
    let (stdout, stderr) = (out.stdout, out.stderr);
    assert!(out.code == 0, "{stderr}");
    assert!(!stdout.trim().is_empty(), "an answer was printed");
    let count = |label: &str| -> u64 {
        stderr
            .lines()
            .find_map(|l| l.strip_prefix(label))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{label} in {stderr:?}"))
    };
    assert!(count("Input tokens:") > 0);
    let out_tokens = count("Output tokens:");
    assert!((1..=24).contains(&out_tokens), "{out_tokens}");
}

/// `sluice serve` is an OpenAI-compatible server in one process: a streamed answer from the
/// local model over `/v1/chat/completions`, read at the SSE level, and, when `OPENAI_PY`
/// names a python with OpenAI's SDK (scripts/openai-venv.sh), that SDK's whole, streamed,
/// multi-turn and model-list calls.
#[tokio::test]
async fn serve_answers_openai_clients_from_the_local_llm() {
    let (_serve, gateway) = serve("16").await;
    sluice_runtime::install_crypto_provider();
    let resp = reqwest::Client::new()
        .post(format!("{gateway}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "smollm2", "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "Name a colour."}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = String::from_utf8(resp.bytes().await.unwrap().to_vec()).unwrap();
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    let chunks: Vec<serde_json::Value> = body
        .split_terminator("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.trim().is_empty(), "{body}");
    let usage = &chunks.last().unwrap()["usage"];
    let out_tokens = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=16).contains(&out_tokens), "{usage}");
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0, "{usage}");

    let Some(python) = sluice_tests::outside_tool(
        "OPENAI_PY",
        "serve_local_llm: OpenAI's Python SDK against `sluice serve` (scripts/openai-venv.sh)",
    ) else {
        return;
    };
    let settings = serde_json::json!({"base_url": format!("{gateway}/v1"), "api_key": "unused",
        "model": "smollm2", "only": ["whole", "stream", "multi_turn", "not_found", "models"]});
    let r = sluice_tests::process::py_client(
        &python,
        "openai_client.py",
        &settings,
        Duration::from_secs(300),
    )
    .await;
    for scenario in ["whole", "stream", "multi_turn"] {
        let content = r[scenario]["content"].as_str().unwrap_or_default();
        assert!(!content.trim().is_empty(), "{scenario}: {r}");
        let finish = r[scenario]["finish_reason"].as_str().unwrap_or_default();
        assert!(["stop", "length"].contains(&finish), "{scenario}: {r}");
    }
    assert!(
        r["whole"]["usage"]["completion_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );
    assert!(
        r["stream"]["usage"]["completion_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );
    assert_eq!(r["not_found"]["status"], 404, "{r}");
    assert_eq!(r["models"], serde_json::json!(["smollm2"]));
}

/// Structured output from the real local model through `sluice serve`'s OpenAI route:
/// `response_format: json_schema` reaches llama.cpp's server as its JSON-schema grammar, so
/// the 135M model, which left to itself writes prose, answers JSON of the schema; then
/// OpenAI's Python SDK's `parse` and stream helper with a Pydantic model get the model back,
/// when `OPENAI_PY` is set.
#[tokio::test]
async fn serve_holds_the_local_llm_to_a_json_schema() {
    let (_serve, gateway) = serve("64").await;
    sluice_runtime::install_crypto_provider();
    let resp = reqwest::Client::new()
        .post(format!("{gateway}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "smollm2",
            "messages": [{"role": "user", "content": "What colour is the sky?"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "sky",
                "schema": {"type": "object", "required": ["label"],
                    "properties": {"label": {"type": "string", "enum": ["blue", "grey"]}}}}}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = resp.json().await.unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let answer: serde_json::Value = serde_json::from_str(content).unwrap();
    assert!(
        ["blue", "grey"].contains(&answer["label"].as_str().unwrap()),
        "{v}"
    );

    let Some(python) = sluice_tests::outside_tool(
        "OPENAI_PY",
        "serve_local_llm: OpenAI's Python SDK parsing the local model's structured output (scripts/openai-venv.sh)",
    ) else {
        return;
    };
    let settings = serde_json::json!({"base_url": format!("{gateway}/v1"), "api_key": "unused",
        "model": "smollm2", "structured_model": "smollm2", "only": ["structured"]});
    let r = sluice_tests::process::py_client(
        &python,
        "openai_client.py",
        &settings,
        Duration::from_secs(300),
    )
    .await;
    for how in ["parsed", "streamed"] {
        let label = r["structured"][how].as_str().unwrap_or_default();
        assert!(["blue", "grey"].contains(&label), "{how}: {r}");
    }
}
