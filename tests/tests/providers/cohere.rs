//! The Cohere provider against the fake Cohere server: the contract, and through the broker.

use std::sync::Arc;

use futures::future::BoxFuture;
use serde_json::Value;
use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, RunningProcessor, echo_config, fake_cohere::FakeCohere, text_client, unique_topic,
};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{FailureKind, Provider, Usage},
    providers::cohere::{CohereConfig, CohereProvider},
    retry::RetryPolicy,
};

use crate::contract::{Malformed, Script, Subject, Wire};

const KEY: &str = "co-test-secret";

fn provider_at(base_url: &str, model: &str) -> CohereProvider {
    let mut c = CohereConfig::new(base_url, model);
    c.api_key = Some(Secret::new(KEY));
    CohereProvider::new(c).unwrap()
}

fn provider(fake: &FakeCohere, model: &str) -> CohereProvider {
    provider_at(&fake.base_url(), model)
}

struct CohereWire(FakeCohere);

impl Wire for CohereWire {
    fn base_url(&self) -> String {
        self.0.base_url()
    }
    fn provider_at(&self, base_url: &str, script: &str) -> Arc<dyn Provider> {
        Arc::new(provider_at(base_url, script))
    }
    fn last_body(&self) -> Value {
        self.0.last_body()
    }
    fn credential_seen(&self) -> Option<String> {
        self.0.last_auth()
    }
    fn abandoned(&self) -> usize {
        self.0.abandoned_streams()
    }
}

/// Cohere v2: usage on message-end (the tokens counted, not the billed units).
fn cohere() -> Subject {
    Subject {
        start: || {
            Box::pin(async { Box::new(CohereWire(FakeCohere::start().await)) as Box<dyn Wire> })
                as BoxFuture<'static, Box<dyn Wire>>
        },
        secret: KEY,
        credential: "Bearer co-test-secret",
        key_var: "COHERE_API_KEY",
        text: "Hi there",
        usage: Usage {
            input: 186,
            output: 105,
        },
        whole_usage: Usage {
            input: 186,
            output: 105,
        },
        unauthorized: Script::Run("unauthorized"),
        rejected: Script::Run("bad_request"),
        rate_limited: Script::Run("rate_limited_once"),
        retry_after: Some(std::time::Duration::from_secs(2)),
        server_error: Script::Run("server_error_once"),
        // Cohere reports a failed generation as message-end's `finish_reason: ERROR`.
        error_event: (Script::Run("error_finish"), FailureKind::Stream),
        truncated: (Script::Run("no_end"), "Hi"),
        malformed: (Script::Run("malformed"), Malformed::Skipped("Hi there")),
        tools: Script::Run("tools"),
        json_mode: Some(|body| body["response_format"]["type"] == "json_object"),
        hang: Script::Run("hang"),
    }
}

mod cohere_contract {
    crate::contract_cases!(super::cohere);
}

fn req() -> TextCompletionRequest {
    TextCompletionRequest {
        prompt: "hello".into(),
        streaming: true,
        ..Default::default()
    }
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
