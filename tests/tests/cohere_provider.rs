//! The Cohere provider against the fake Cohere server, and through the broker.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use futures::StreamExt;
use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, RunningProcessor, echo_config, fake_cohere::FakeCohere, text_client, unique_topic,
};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{FailureKind, Provider, ProviderError},
    providers::cohere::{CohereConfig, CohereProvider},
    retry::RetryPolicy,
};

const KEY: &str = "co-test-secret";

fn provider(fake: &FakeCohere, model: &str) -> CohereProvider {
    let mut c = CohereConfig::new(fake.base_url(), model);
    c.api_key = Some(Secret::new(KEY));
    CohereProvider::new(c).unwrap()
}

fn req() -> TextCompletionRequest {
    TextCompletionRequest {
        prompt: "hello".into(),
        streaming: true,
        ..Default::default()
    }
}

async fn run(p: &CohereProvider) -> (String, Option<ProviderError>) {
    let mut s = match p.generate_stream(&req()).await {
        Ok(s) => s,
        Err(e) => return (String::new(), Some(e)),
    };
    let mut text = String::new();
    while let Some(item) = s.next().await {
        match item {
            Ok(c) => text.push_str(&c.text),
            Err(e) => return (text, Some(e)),
        }
    }
    (text, None)
}

#[tokio::test]
async fn streams_and_classifies_failures() {
    let fake = FakeCohere::start().await;
    assert_eq!(
        run(&provider(&fake, "normal")).await,
        ("Hi there".to_owned(), None)
    );
    assert_eq!(fake.last_auth(), Some(format!("Bearer {KEY}")));
    let (_, e) = run(&provider(&fake, "unauthorized")).await;
    let e = e.unwrap();
    assert_eq!(e.kind, FailureKind::Auth);
    assert!(e.message.contains("COHERE_API_KEY") && !e.message.contains(KEY));
    let (text, e) = run(&provider(&fake, "error_finish")).await;
    assert_eq!(
        (text.as_str(), e.unwrap().kind),
        ("Hi", FailureKind::Stream)
    );
    let (text, e) = run(&provider(&fake, "no_end")).await;
    assert_eq!(
        (text.as_str(), e.unwrap().kind),
        ("Hi", FailureKind::Truncated)
    );
}

#[tokio::test]
async fn through_the_broker_with_usage_from_message_end() {
    let broker = Broker::from_env().await;
    let fake = FakeCohere::start().await;
    let telemetry = Telemetry::new().unwrap();
    let service = TextCompletionService::new(
        Arc::new(provider(&fake, "normal")),
        RetryPolicy::default(),
        LlmMetrics::register(&telemetry.registry).unwrap(),
    );
    let (rq, rs) = (unique_topic("co-req"), unique_topic("co-resp"));
    let p = RunningProcessor::start(broker.bus().await, echo_config(&rq, &rs, 4), service).await;
    let client = text_client(broker.bus().await, &rq, &rs).await;
    let records = client.call(&req()).await.unwrap();
    let texts: Vec<_> = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(texts, ["Hi", " there", ""]);
    let last = records.last().unwrap();
    assert_eq!((last.in_token, last.out_token), (Some(186), Some(105)));
    client.close().await;
    p.stop().await;
}
