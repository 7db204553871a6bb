//! The Gemini provider against the fake Gemini server, and through the broker.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use futures::StreamExt;
use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, RunningProcessor, echo_config, fake_gemini::FakeGemini, text_client, unique_topic,
};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{FailureKind, Provider},
    providers::gemini::{GeminiConfig, GeminiEndpoint, GeminiProvider},
    retry::RetryPolicy,
};

const KEY: &str = "AIza-test-secret";

fn provider(fake: &FakeGemini, model: &str) -> GeminiProvider {
    let mut c = GeminiConfig::new(GeminiEndpoint::AiStudio, fake.base_url(), model);
    c.credential = Some(Secret::new(KEY));
    GeminiProvider::new(c).unwrap()
}

fn req(streaming: bool) -> TextCompletionRequest {
    TextCompletionRequest {
        system: "s".into(),
        prompt: "why".into(),
        streaming,
        ..Default::default()
    }
}

async fn first_error(
    p: &GeminiProvider,
) -> (
    String,
    Option<sluice_text_completion::provider::ProviderError>,
) {
    let mut s = match p.generate_stream(&req(true)).await {
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
async fn failures_are_classified_from_status_and_body() {
    let fake = FakeGemini::start().await;
    let (text, err) = first_error(&provider(&fake, "normal")).await;
    assert_eq!((text.as_str(), err), ("The sky is blue.", None));
    assert_eq!(fake.last_key().as_deref(), Some(KEY));
    let (_, err) = first_error(&provider(&fake, "bad_key")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Auth);
    assert!(err.message.contains("GEMINI_API_KEY") && !err.message.contains(KEY));
    let (_, err) = first_error(&provider(&fake, "rate_limited_once")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::RateLimited);
    assert_eq!(err.retry_after, Some(std::time::Duration::from_millis(100)));
    let (_, err) = first_error(&provider(&fake, "blocked")).await;
    assert!(err.unwrap().message.contains("SAFETY"));
    let (text, err) = first_error(&provider(&fake, "no_finish")).await;
    assert_eq!(text, "The");
    assert_eq!(err.unwrap().kind, FailureKind::Truncated);
}

#[tokio::test]
async fn through_the_broker_snapshots_become_deltas_and_the_body_hint_is_honoured() {
    let broker = Broker::from_env().await;
    let fake = FakeGemini::start().await;
    for model in ["normal", "rate_limited_once"] {
        let telemetry = Telemetry::new().unwrap();
        let service = TextCompletionService::new(
            Arc::new(provider(&fake, model)),
            RetryPolicy::default(),
            LlmMetrics::register(&telemetry.registry).unwrap(),
        );
        let (rq, rs) = (unique_topic("gem-req"), unique_topic("gem-resp"));
        let p =
            RunningProcessor::start(broker.bus().await, echo_config(&rq, &rs, 4), service).await;
        let client = text_client(broker.bus().await, &rq, &rs).await;
        let records = client.call(&req(true)).await.unwrap();
        let texts: Vec<_> = records.iter().map(|r| r.response.as_str()).collect();
        assert_eq!(texts, ["The", " sky is blue.", ""], "{model}");
        let input: u64 = records.iter().filter_map(|r| r.in_token).sum();
        let output: u64 = records.iter().filter_map(|r| r.out_token).sum();
        assert_eq!(
            (input, output),
            (9, 31),
            "{model}: thoughts count as output"
        );
        client.close().await;
        p.stop().await;
    }
    assert_eq!(fake.calls("rate_limited_once"), 2);
}

/// Vertex AI's Gemini streams the same way: the project and location in the path, the access
/// token as a bearer token (never an API key header), snapshots read as deltas, through the
/// broker.
#[tokio::test]
async fn vertex_streams_with_a_bearer_token_through_the_broker() {
    let broker = Broker::from_env().await;
    let fake = FakeGemini::start().await;
    let mut c = GeminiConfig::new(
        GeminiEndpoint::Vertex {
            project: "proj-7".into(),
            location: "europe-west4".into(),
        },
        fake.base_url(),
        "normal",
    );
    c.credential = Some(Secret::new("ya29.vertex-test-token"));
    let telemetry = Telemetry::new().unwrap();
    let service = TextCompletionService::new(
        Arc::new(GeminiProvider::new(c).unwrap()),
        RetryPolicy::default(),
        LlmMetrics::register(&telemetry.registry).unwrap(),
    );
    let (rq, rs) = (unique_topic("vtx-req"), unique_topic("vtx-resp"));
    let p = RunningProcessor::start(broker.bus().await, echo_config(&rq, &rs, 4), service).await;
    let client = text_client(broker.bus().await, &rq, &rs).await;
    let records = client.call(&req(true)).await.unwrap();
    let texts: Vec<_> = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(texts, ["The", " sky is blue.", ""]);
    assert!(records.last().unwrap().end_of_stream);
    let (project, location, auth) = fake.last_vertex().expect("a Vertex call");
    assert_eq!(
        (project.as_str(), location.as_str()),
        ("proj-7", "europe-west4")
    );
    assert_eq!(auth.as_deref(), Some("Bearer ya29.vertex-test-token"));
    assert_eq!(fake.last_key(), None, "no API key header was sent");
    client.close().await;
    p.stop().await;
}
