//! The Gemini provider, on AI Studio and on Vertex AI, against the fake Gemini server: the
//! contract, then Gemini's own failure shapes, and through the broker.

use std::sync::Arc;

use futures::future::BoxFuture;
use serde_json::Value;
use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, RunningProcessor, echo_config, fake_gemini::FakeGemini, text_client, unique_topic,
};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{FailureKind, Provider, Usage},
    providers::gemini::{GeminiConfig, GeminiEndpoint, GeminiProvider},
    retry::RetryPolicy,
};

use crate::contract::{self, Malformed, Script, Subject, Wire};

const KEY: &str = "AIza-test-secret";
const TOKEN: &str = "ya29.vertex-test-token";

fn provider_at(base_url: &str, model: &str) -> GeminiProvider {
    let mut c = GeminiConfig::new(GeminiEndpoint::AiStudio, base_url, model);
    c.credential = Some(Secret::new(KEY));
    GeminiProvider::new(c).unwrap()
}

fn provider(fake: &FakeGemini, model: &str) -> GeminiProvider {
    provider_at(&fake.base_url(), model)
}

/// Gemini on Vertex AI in `proj-7` at `europe-west4`, at `base_url` as Vertex's origin.
fn vertex_at(base_url: &str, model: &str) -> GeminiProvider {
    let mut c = GeminiConfig::new(
        GeminiEndpoint::Vertex {
            project: "proj-7".into(),
            location: "europe-west4".into(),
        },
        base_url,
        model,
    );
    c.credential = Some(Secret::new(TOKEN));
    GeminiProvider::new(c).unwrap()
}

/// The fake, and whether the provider calls it as Vertex AI.
struct GeminiWire {
    fake: FakeGemini,
    on_vertex: bool,
}

impl Wire for GeminiWire {
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
        self.fake.last_body()
    }
    fn credential_seen(&self) -> Option<String> {
        if self.on_vertex {
            self.fake.last_vertex().and_then(|(_, _, auth)| auth)
        } else {
            self.fake.last_key()
        }
    }
    fn abandoned(&self) -> usize {
        self.fake.abandoned_streams()
    }
}

fn start(on_vertex: bool) -> BoxFuture<'static, Box<dyn Wire>> {
    Box::pin(async move {
        Box::new(GeminiWire {
            fake: FakeGemini::start().await,
            on_vertex,
        }) as Box<dyn Wire>
    })
}

/// What AI Studio and Vertex share: snapshots of the answer, thoughts counted as output.
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
            "GEMINI_API_KEY"
        },
        text: "The sky is blue.",
        usage: Usage {
            input: 9,
            output: 31,
        },
        whole_usage: Usage {
            input: 9,
            output: 31,
        },
        // AI Studio refuses a bad key with 400 API_KEY_INVALID; Vertex with 401.
        unauthorized: Script::Run(if on_vertex { "unauthorized" } else { "bad_key" }),
        rejected: Script::Run("invalid_argument"),
        rate_limited: Script::Run("rate_limited_once"),
        // Google's RetryInfo in the body: `retryDelay: 0.1s`.
        retry_after: Some(std::time::Duration::from_millis(100)),
        server_error: Script::Run("server_error_once"),
        error_event: (
            Script::OptOut(
                "Gemini's stream has no error event: a failure mid-stream is a closed connection (the truncated case) or a blocked prompt (gemini::a_blocked_prompt_says_why)",
            ),
            FailureKind::Stream,
        ),
        truncated: (Script::Run("no_finish"), "The"),
        malformed: (
            Script::Run("malformed"),
            Malformed::Skipped("The sky is blue."),
        ),
        tools: Script::Run("tools"),
        json_mode: Some(|body| body["generationConfig"]["responseMimeType"] == "application/json"),
        hang: Script::Run("hang"),
    }
}

fn gemini() -> Subject {
    subject(false)
}

fn vertex() -> Subject {
    subject(true)
}

mod gemini_contract {
    crate::contract_cases!(super::gemini);
}

mod vertex_contract {
    crate::contract_cases!(super::vertex);
}

fn req(streaming: bool) -> TextCompletionRequest {
    TextCompletionRequest {
        system: "s".into(),
        prompt: "why".into(),
        streaming,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_blocked_prompt_says_why() {
    let fake = FakeGemini::start().await;
    let (text, err) = contract::drain(&provider(&fake, "blocked"), &req(true)).await;
    assert!(text.is_empty());
    assert!(err.unwrap().message.contains("SAFETY"));
}

/// The key goes in `x-goog-api-key` on AI Studio.
#[tokio::test]
async fn ai_studio_sends_the_key_in_its_header() {
    let fake = FakeGemini::start().await;
    let (chunks, err) = contract::drain(&provider(&fake, "normal"), &req(true)).await;
    assert_eq!(
        (contract::text(&chunks).as_str(), err),
        ("The sky is blue.", None)
    );
    assert_eq!(fake.last_key().as_deref(), Some(KEY));
    assert_eq!(fake.last_vertex(), None);
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
