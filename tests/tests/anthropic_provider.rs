//! The Anthropic provider against the fake Anthropic server, and through the broker.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use futures::StreamExt;
use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, RunningProcessor, echo_config, fake_anthropic::FakeAnthropic, text_client, unique_topic,
};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{Chunk, FailureKind, Provider, ProviderError},
    providers::anthropic::{AnthropicConfig, AnthropicProvider},
    retry::RetryPolicy,
};

const KEY: &str = "sk-ant-test-secret";

fn provider(fake: &FakeAnthropic, model: &str) -> AnthropicProvider {
    let mut c = AnthropicConfig::new(fake.base_url(), model);
    c.credential = Some(Secret::new(KEY));
    AnthropicProvider::new(c).unwrap()
}

fn req(streaming: bool) -> TextCompletionRequest {
    TextCompletionRequest {
        system: "s".into(),
        prompt: "greet".into(),
        streaming,
        ..Default::default()
    }
}

async fn drain(p: &AnthropicProvider) -> (Vec<Chunk>, Option<ProviderError>) {
    let mut s = match p.generate_stream(&req(true)).await {
        Ok(s) => s,
        Err(e) => return (vec![], Some(e)),
    };
    let mut out = Vec::new();
    while let Some(item) = s.next().await {
        match item {
            Ok(c) => out.push(c),
            Err(e) => return (out, Some(e)),
        }
    }
    (out, None)
}

#[tokio::test]
async fn streams_text_and_sends_the_required_headers() {
    let fake = FakeAnthropic::start().await;
    let (chunks, err) = drain(&provider(&fake, "normal")).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(
        chunks.iter().map(|c| c.text.as_str()).collect::<String>(),
        "Hello there"
    );
    assert_eq!(
        fake.last_headers(),
        (Some(KEY.into()), Some("2023-06-01".into()))
    );
}

#[tokio::test]
async fn http_and_mid_stream_failures_are_classified() {
    let fake = FakeAnthropic::start().await;
    let (_, err) = drain(&provider(&fake, "unauthorized")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Auth);
    assert!(err.message.contains("ANTHROPIC_API_KEY") && !err.message.contains(KEY));
    let (_, err) = drain(&provider(&fake, "overloaded_once")).await;
    assert_eq!(err.unwrap().kind, FailureKind::Server, "529 is retryable");
    let (chunks, err) = drain(&provider(&fake, "error_mid_stream")).await;
    assert!(chunks.iter().any(|c| c.text == "Hello"));
    assert_eq!(err.unwrap().kind, FailureKind::Stream);
    let (_, err) = drain(&provider(&fake, "no_stop")).await;
    assert_eq!(err.unwrap().kind, FailureKind::Truncated);
}

#[tokio::test]
async fn through_the_broker_running_totals_become_deltas_and_overload_is_retried() {
    let broker = Broker::from_env().await;
    let fake = FakeAnthropic::start().await;
    for model in ["normal", "overloaded_once", "rate_limited_once"] {
        let telemetry = Telemetry::new().unwrap();
        let service = TextCompletionService::new(
            Arc::new(provider(&fake, model)),
            RetryPolicy::default(),
            LlmMetrics::register(&telemetry.registry).unwrap(),
        );
        let (rq, rs) = (unique_topic("anth-req"), unique_topic("anth-resp"));
        let p =
            RunningProcessor::start(broker.bus().await, echo_config(&rq, &rs, 4), service).await;
        let client = text_client(broker.bus().await, &rq, &rs).await;
        for streaming in [true, false] {
            let records = client.call(&req(streaming)).await.unwrap();
            let last = records.last().unwrap();
            assert!(
                last.end_of_stream && last.error.is_none(),
                "{model}: {last:?}"
            );
            let text: String = records.iter().map(|r| r.response.as_str()).collect();
            assert_eq!(text, "Hello there", "{model}");
            let input: u64 = records.iter().filter_map(|r| r.in_token).sum();
            let output: u64 = records.iter().filter_map(|r| r.out_token).sum();
            assert_eq!(
                (input, output),
                (25, 15),
                "{model} streaming={streaming}: deltas of the running totals"
            );
            if !streaming {
                assert_eq!(records.len(), 1);
            }
        }
        client.close().await;
        p.stop().await;
    }
    assert_eq!(
        fake.calls("overloaded_once"),
        3,
        "one 529, retried, then the second request"
    );
}
