//! End to end through the real broker against a real local LLM (llama.cpp's llama-server
//! with SmolLM2-135M), started by the test command (deploy/local-llm/llama-server.sh).
//! A 135M model answers poorly; these tests check the protocol and the usage, not the prose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use sluice_runtime::{client::Received, secret::Secret, telemetry::Telemetry};
use sluice_schema::{TextCompletionRequest, TextCompletionResponse};
use sluice_tests::{Broker, RunningProcessor, TextClient, echo_config, text_client, unique_topic};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    providers::openai::{Dialect, OpenAiConfig, OpenAiProvider},
    retry::RetryPolicy,
};

async fn start(key: Option<&str>) -> (TextClient, RunningProcessor) {
    let broker = Broker::from_env().await;
    let url = std::env::var("SLUICE_LLM_URL").unwrap_or_else(|_| "http://127.0.0.1:8766".into());
    let mut config = OpenAiConfig::new(Dialect::Compatible, url, "smollm2");
    config.api_key = key.map(Secret::new);
    config.api_key_source = "SLUICE_LLM_API_KEY".into();
    config.max_tokens = Some(24);
    config.temperature = Some(0.0);
    config.timeouts.first_token = Duration::from_secs(60);
    let telemetry = Telemetry::new().unwrap();
    let service = TextCompletionService::new(
        Arc::new(OpenAiProvider::new(config).unwrap()),
        RetryPolicy::default(),
        LlmMetrics::register(&telemetry.registry).unwrap(),
    );
    let (req, resp) = (unique_topic("llm-req"), unique_topic("llm-resp"));
    let p = RunningProcessor::start(broker.bus().await, echo_config(&req, &resp, 4), service).await;
    (text_client(broker.bus().await, &req, &resp).await, p)
}

fn server_key() -> String {
    std::env::var("SLUICE_LLM_API_KEY").expect("the test command sets SLUICE_LLM_API_KEY")
}

async fn ask(client: &TextClient, streaming: bool) -> Vec<TextCompletionResponse> {
    let mut s = client
        .request(&TextCompletionRequest {
            system: "You are a helpful assistant.".into(),
            prompt: "Name three colours.".into(),
            streaming,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(item) = s.next().await {
        if let Received::Record(r) = item.unwrap() {
            out.push(r);
        }
    }
    out
}

#[tokio::test]
async fn a_real_model_streams_through_the_broker_with_usage() {
    let (client, p) = start(Some(&server_key())).await;
    let records = ask(&client, true).await;
    let (text, last) = (&records[..records.len() - 1], records.last().unwrap());
    assert!(last.end_of_stream && last.error.is_none(), "{last:?}");
    assert!(
        text.len() > 1,
        "streamed as many records: {}",
        records.len()
    );
    assert!(
        text.iter()
            .all(|r| !r.end_of_stream && !r.response.is_empty())
    );
    assert!(
        records
            .iter()
            .all(|r| r.model.as_deref() == Some("smollm2"))
    );
    let input: u64 = records.iter().filter_map(|r| r.in_token).sum();
    let output: u64 = records.iter().filter_map(|r| r.out_token).sum();
    assert!(input > 5, "prompt tokens reported: {input}");
    assert!(
        output >= text.len() as u64 && output <= 24,
        "completion tokens: {output} for {} records",
        text.len()
    );

    let whole = ask(&client, false).await;
    assert_eq!(whole.len(), 1, "non-streaming: one record");
    assert!(whole[0].end_of_stream && !whole[0].response.is_empty());
    assert_eq!(
        whole[0].in_token,
        Some(input),
        "same prompt, same input tokens"
    );
    assert!(whole[0].out_token.unwrap() > 0);
    client.close().await;
    p.stop().await;
}

#[tokio::test]
async fn a_wrong_key_gets_the_real_servers_401_as_a_clear_error() {
    let (client, p) = start(Some("not-the-key")).await;
    let records = ask(&client, true).await;
    assert_eq!(records.len(), 1);
    let err = records[0].error.as_ref().unwrap();
    assert!(
        err.message.contains("SLUICE_LLM_API_KEY"),
        "{}",
        err.message
    );
    assert!(!err.message.contains("not-the-key"));
    client.close().await;
    p.stop().await;
}
