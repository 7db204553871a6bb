//! The Anthropic provider, on Anthropic's API and on Vertex AI, against the fake Anthropic
//! server: the contract, then Anthropic's and Vertex's wire details, and through the broker.

use std::sync::Arc;

use futures::future::BoxFuture;
use serde_json::Value;
use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, RunningProcessor, echo_config,
    fake_anthropic::{FakeAnthropic, VertexCall},
    text_client, unique_topic,
};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{Chunk, FailureKind, Provider, ProviderError, Usage},
    providers::anthropic::{AnthropicConfig, AnthropicProvider},
    retry::RetryPolicy,
};

use crate::contract::{self, Malformed, Script, Subject, Wire};

const KEY: &str = "sk-ant-test-secret";
const TOKEN: &str = "ya29.vertex-test-token";

fn provider_at(base_url: &str, model: &str) -> AnthropicProvider {
    let mut c = AnthropicConfig::new(base_url, model);
    c.credential = Some(Secret::new(KEY));
    AnthropicProvider::new(c).unwrap()
}

fn provider(fake: &FakeAnthropic, model: &str) -> AnthropicProvider {
    provider_at(&fake.base_url(), model)
}

/// Claude on Vertex AI in `proj-7` at `us-east5`, at `base_url` as Vertex's origin.
fn vertex_at(base_url: &str, model: &str) -> AnthropicProvider {
    let mut c = AnthropicConfig::vertex("proj-7", "us-east5", base_url, model);
    c.credential = Some(Secret::new(TOKEN));
    AnthropicProvider::new(c).unwrap()
}

/// Claude on Vertex AI, the fake as Vertex's origin.
fn vertex(fake: &FakeAnthropic, model: &str) -> AnthropicProvider {
    vertex_at(&fake.base_url(), model)
}

/// The fake, and whether the provider calls it as Vertex AI.
struct AnthropicWire {
    fake: FakeAnthropic,
    on_vertex: bool,
}

impl Wire for AnthropicWire {
    fn base_url(&self) -> String {
        self.fake.base_url()
    }
    fn provider_at(&self, base_url: &str, script: &str) -> Arc<dyn Provider> {
        if self.on_vertex {
            Arc::new(vertex_at(base_url, script))
        } else {
            Arc::new(provider_at(base_url, script))
        }
    }
    fn last_body(&self) -> Value {
        match self.fake.last_vertex() {
            Some(call) if self.on_vertex => call.body,
            _ => self.fake.last_body(),
        }
    }
    fn credential_seen(&self) -> Option<String> {
        if self.on_vertex {
            self.fake.last_vertex().and_then(|c| c.authorization)
        } else {
            self.fake.last_headers().0
        }
    }
    fn abandoned(&self) -> usize {
        self.fake.abandoned_streams()
    }
}

fn start(on_vertex: bool) -> BoxFuture<'static, Box<dyn Wire>> {
    Box::pin(async move {
        Box::new(AnthropicWire {
            fake: FakeAnthropic::start().await,
            on_vertex,
        }) as Box<dyn Wire>
    })
}

/// What Anthropic and Vertex share: the Messages events, usage as running totals (25 in,
/// 15 out; a whole answer counts its 5 cache reads as input).
fn subject(on_vertex: bool) -> Subject {
    Subject {
        start: if on_vertex {
            || start(true)
        } else {
            || start(false)
        },
        secret: if on_vertex { TOKEN } else { KEY },
        credential: if on_vertex {
            "Bearer ya29.vertex-test-token"
        } else {
            KEY
        },
        key_var: if on_vertex {
            "VERTEX_ACCESS_TOKEN"
        } else {
            "ANTHROPIC_API_KEY"
        },
        text: "Hello there",
        usage: Usage {
            input: 25,
            output: 15,
        },
        whole_usage: Usage {
            input: 25,
            output: 15,
        },
        unauthorized: Script::Run("unauthorized"),
        rejected: Script::Run("invalid_request"),
        rate_limited: Script::Run("rate_limited_once"),
        // Anthropic's 429 carries `retry-after: 0`; Vertex's front end answers in Google's
        // shape, which carries no hint.
        retry_after: (!on_vertex).then_some(std::time::Duration::ZERO),
        server_error: Script::Run("overloaded_once"),
        error_event: (Script::Run("error_mid_stream"), FailureKind::Stream),
        truncated: (Script::Run("no_stop"), "Hello"),
        malformed: (Script::Run("malformed"), Malformed::Skipped("Hello there")),
        tools: Script::Run("tools"),
        // Anthropic has no JSON mode: the processor asks for JSON in the system prompt and
        // checks the answer itself (text-completion's `structured`).
        json_mode: None,
        hang: Script::Run("hang"),
    }
}

fn anthropic() -> Subject {
    subject(false)
}

fn vertex_anthropic() -> Subject {
    subject(true)
}

mod anthropic_contract {
    crate::contract_cases!(super::anthropic);
}

mod vertex_anthropic_contract {
    crate::contract_cases!(super::vertex_anthropic);
}

/// What every call on Vertex's path must look like: the project and location in the path, the
/// token as a bearer, no Anthropic headers, the version in the body and no model there.
fn assert_vertex_call(call: &VertexCall, model: &str, verb: &str) {
    assert_eq!(
        (call.project.as_str(), call.location.as_str()),
        ("proj-7", "us-east5")
    );
    assert_eq!((call.model.as_str(), call.verb.as_str()), (model, verb));
    assert_eq!(
        call.authorization.as_deref(),
        Some(format!("Bearer {TOKEN}").as_str())
    );
    assert_eq!(call.api_key, None, "no x-api-key header");
    assert_eq!(
        call.anthropic_version_header, None,
        "no anthropic-version header"
    );
    assert_eq!(call.body["anthropic_version"], "vertex-2023-10-16");
    assert!(call.body.get("model").is_none(), "{}", call.body);
    assert_eq!(call.body["max_tokens"], 1024);
    assert_eq!(call.body["system"], "s");
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
    drain_request(p, &req(true)).await
}

async fn drain_request(
    p: &AnthropicProvider,
    request: &TextCompletionRequest,
) -> (Vec<Chunk>, Option<ProviderError>) {
    contract::drain(p, request).await
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

/// 401, 529, the error event and a stream without message_stop are the contract's cases
/// (`unauthorized`, `overloaded_once`, `error_mid_stream`, `no_stop`); Anthropic's 403 is its
/// own: a key that may not use the model.
#[tokio::test]
async fn a_forbidden_key_is_a_permission_error_naming_the_variable() {
    let fake = FakeAnthropic::start().await;
    let (_, err) = drain(&provider(&fake, "forbidden")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Permission);
    assert!(err.message.contains("ANTHROPIC_API_KEY") && !err.message.contains(KEY));
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

#[tokio::test]
async fn vertex_streams_from_stream_raw_predict_with_a_bearer_token() {
    let fake = FakeAnthropic::start().await;
    let p = vertex(&fake, "normal");
    let (chunks, err) = drain(&p).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(
        chunks.iter().map(|c| c.text.as_str()).collect::<String>(),
        "Hello there"
    );
    let usage = chunks
        .iter()
        .filter_map(|c| c.usage)
        .fold(Usage::default(), Usage::merge);
    assert_eq!((usage.input, usage.output), (25, 15));
    let call = fake.last_vertex().expect("a Vertex call");
    assert_vertex_call(&call, "normal", "streamRawPredict");
    assert_eq!(call.body["stream"], true);
    assert_eq!(fake.last_headers(), (None, None), "nothing on /v1/messages");
    // A request naming another model goes to that model's path.
    let other = TextCompletionRequest {
        model: Some("claude-other@20250101".into()),
        ..req(true)
    };
    let (_, err) = drain_request(&p, &other).await;
    assert!(err.is_none(), "{err:?}");
    let call = fake.last_vertex().unwrap();
    assert_vertex_call(&call, "claude-other@20250101", "streamRawPredict");
}

#[tokio::test]
async fn vertex_answers_a_whole_request_from_raw_predict() {
    let fake = FakeAnthropic::start().await;
    let done = vertex(&fake, "normal").generate(&req(false)).await.unwrap();
    assert_eq!(done.text, "Hello there");
    assert_eq!(
        done.usage,
        Some(Usage {
            input: 25,
            output: 15
        }),
        "cache reads count as input"
    );
    assert_eq!(done.finish_reason.as_deref(), Some("end_turn"));
    let call = fake.last_vertex().expect("a Vertex call");
    assert_vertex_call(&call, "normal", "rawPredict");
    assert!(call.body.get("stream").is_none(), "{}", call.body);
    assert_eq!(fake.calls("normal"), 1, "one call, not a stream collected");
}

#[tokio::test]
async fn vertex_errors_in_googles_shape_are_classified_and_described() {
    let fake = FakeAnthropic::start().await;
    let (_, err) = drain(&vertex(&fake, "rate_limited_once")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::RateLimited, "{}", err.message);
    assert!(
        err.message.contains("RESOURCE_EXHAUSTED")
            && err
                .message
                .contains("Quota exceeded for aiplatform.googleapis.com"),
        "{}",
        err.message
    );
    let (_, err) = drain(&vertex(&fake, "overloaded_once")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Server, "Anthropic's shape passed on");
    assert!(err.message.contains("overloaded_error"), "{}", err.message);
    let err = vertex(&fake, "forbidden")
        .generate(&req(false))
        .await
        .unwrap_err();
    assert_eq!(err.kind, FailureKind::Permission);
    assert!(
        err.message.contains("VERTEX_ACCESS_TOKEN")
            && err.message.contains("PERMISSION_DENIED")
            && !err.message.contains(TOKEN),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn a_rejected_vertex_token_names_its_source_and_never_itself() {
    let fake = FakeAnthropic::start().await;
    let (_, err) = drain(&vertex(&fake, "unauthorized")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Auth);
    assert!(
        err.message.contains("VERTEX_ACCESS_TOKEN") && !err.message.contains(TOKEN),
        "{}",
        err.message
    );
    assert!(
        !err.message.contains("ANTHROPIC_API_KEY"),
        "{}",
        err.message
    );
    assert!(!format!("{err:?}").contains(TOKEN));
}

#[tokio::test]
async fn vertex_streams_and_answers_whole_through_the_broker() {
    let broker = Broker::from_env().await;
    let fake = FakeAnthropic::start().await;
    // rate_limited_once: Google's 429 before the first chunk is retried like Anthropic's.
    for model in ["normal", "rate_limited_once"] {
        let telemetry = Telemetry::new().unwrap();
        let service = TextCompletionService::new(
            Arc::new(vertex(&fake, model)),
            RetryPolicy::default(),
            LlmMetrics::register(&telemetry.registry).unwrap(),
        );
        let (rq, rs) = (unique_topic("vtxa-req"), unique_topic("vtxa-resp"));
        let p =
            RunningProcessor::start(broker.bus().await, echo_config(&rq, &rs, 4), service).await;
        let client = text_client(broker.bus().await, &rq, &rs).await;
        for (streaming, verb) in [(true, "streamRawPredict"), (false, "rawPredict")] {
            let records = client.call(&req(streaming)).await.unwrap();
            let last = records.last().unwrap();
            assert!(
                last.end_of_stream && last.error.is_none(),
                "{model}: {last:?}"
            );
            let texts: Vec<_> = records
                .iter()
                .map(|r| r.response.as_str())
                .filter(|t| !t.is_empty())
                .collect();
            if streaming {
                assert_eq!(texts, ["Hello", " there"], "{model}: one record per chunk");
            } else {
                assert_eq!(records.len(), 1, "{model}: one record");
                assert_eq!(texts, ["Hello there"], "{model}");
            }
            let input: u64 = records.iter().filter_map(|r| r.in_token).sum();
            let output: u64 = records.iter().filter_map(|r| r.out_token).sum();
            assert_eq!((input, output), (25, 15), "{model} streaming={streaming}");
            assert_vertex_call(&fake.last_vertex().unwrap(), model, verb);
        }
        client.close().await;
        p.stop().await;
    }
    assert_eq!(
        fake.calls("rate_limited_once"),
        3,
        "one 429, retried, then the whole request"
    );
}
