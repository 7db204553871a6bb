//! The OpenAI dialects (OpenAI, Azure, Mistral, OpenAI-compatible servers) against the fake
//! OpenAI server: the contract, then each dialect's wire details and every failure shape of
//! ../shared/reference/providers.md for the family.

use std::{sync::Arc, time::Duration};

use futures::future::BoxFuture;
use serde_json::Value;
use sluice_runtime::secret::Secret;
use sluice_tests::fake_openai::FakeOpenAi;
use sluice_text_completion::{
    provider::{FailureKind, Provider, Usage},
    providers::openai::{Dialect, OpenAiConfig, OpenAiProvider},
};

use crate::contract::{Malformed, Script, Subject, Wire, drain, request};

const KEY: &str = "sk-test-very-secret-key";

/// The fake, and the dialect the provider speaks to it.
struct OpenAiWire {
    fake: FakeOpenAi,
    dialect: Dialect,
}

impl Wire for OpenAiWire {
    fn base_url(&self) -> String {
        self.fake.base_url()
    }
    fn provider_at(&self, base_url: &str, script: &str) -> Arc<dyn Provider> {
        Arc::new(provider_at(base_url, self.dialect, script))
    }
    fn last_body(&self) -> Value {
        self.fake.last_body()
    }
    fn credential_seen(&self) -> Option<String> {
        self.fake.last_auth()
    }
    fn abandoned(&self) -> usize {
        self.fake.abandoned_streams()
    }
}

fn provider_at(base_url: &str, dialect: Dialect, model: &str) -> OpenAiProvider {
    let mut c = OpenAiConfig::new(dialect, base_url, model);
    c.api_key = Some(Secret::new(KEY));
    c.api_key_source = "OPENAI_API_KEY".into();
    c.timeouts.between_chunks = Duration::from_millis(500);
    OpenAiProvider::new(c).unwrap()
}

fn provider(fake: &FakeOpenAi, dialect: Dialect, model: &str) -> OpenAiProvider {
    provider_at(&fake.base_url(), dialect, model)
}

/// The fake started for `dialect`.
fn start(dialect: Dialect) -> BoxFuture<'static, Box<dyn Wire>> {
    Box::pin(async move {
        Box::new(OpenAiWire {
            fake: FakeOpenAi::start().await,
            dialect,
        }) as Box<dyn Wire>
    })
}

/// The family's subject; each dialect differs in how the key is sent.
fn subject(start: fn() -> BoxFuture<'static, Box<dyn Wire>>, credential: &'static str) -> Subject {
    Subject {
        start,
        secret: KEY,
        credential,
        key_var: "OPENAI_API_KEY",
        text: "Hello world!",
        usage: Usage {
            input: 11,
            output: 3,
        },
        whole_usage: Usage {
            input: 11,
            output: 3,
        },
        unauthorized: Script::Run("unauthorized"),
        rejected: Script::Run("status-400-9"),
        rate_limited: Script::Run("rate_limited_once"),
        retry_after: Some(Duration::from_millis(100)),
        server_error: Script::Run("server_error_once"),
        error_event: (Script::Run("error_mid_stream"), FailureKind::Stream),
        truncated: (Script::Run("drop_mid_stream"), "Hel"),
        malformed: (Script::Run("malformed"), Malformed::Skipped("Hel lo")),
        tools: Script::Run("tools"),
        json_mode: Some(|body| {
            body["response_format"]["type"]
                .as_str()
                .is_some_and(|t| t.starts_with("json"))
        }),
        hang: Script::Run("stall"),
    }
}

const BEARER: &str = "Bearer sk-test-very-secret-key";

fn openai() -> Subject {
    subject(|| start(Dialect::OpenAi), BEARER)
}

fn compatible() -> Subject {
    subject(|| start(Dialect::Compatible), BEARER)
}

fn mistral() -> Subject {
    subject(|| start(Dialect::Mistral), BEARER)
}

/// Azure: the key in `api-key`, the deployment (the script) in the path.
fn azure() -> Subject {
    subject(|| start(Dialect::Azure), KEY)
}

mod openai_contract {
    crate::contract_cases!(super::openai);
}

mod compatible_contract {
    crate::contract_cases!(super::compatible);
}

mod mistral_contract {
    crate::contract_cases!(super::mistral);
}

mod azure_contract {
    crate::contract_cases!(super::azure);
}

fn texts(chunks: &[sluice_text_completion::provider::Chunk]) -> Vec<&str> {
    chunks
        .iter()
        .filter(|c| !c.text.is_empty())
        .map(|c| c.text.as_str())
        .collect()
}

#[tokio::test]
async fn a_normal_stream_yields_text_then_finish_then_usage() {
    let fake = FakeOpenAi::start().await;
    let p = provider(&fake, Dialect::OpenAi, "normal");
    let (chunks, err) = drain(&p, &request(true)).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(texts(&chunks), ["Hello", " world", "!"]);
    assert!(
        chunks
            .iter()
            .any(|c| c.finish_reason.as_deref() == Some("stop"))
    );
    assert_eq!(
        chunks.last().unwrap().usage,
        Some(Usage {
            input: 11,
            output: 3
        })
    );
    let body = fake.last_body();
    assert_eq!(body["model"], "normal");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(
        body["messages"][0],
        serde_json::json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(fake.last_auth().unwrap(), format!("Bearer {KEY}"));
}

#[tokio::test]
async fn azure_sends_api_key_and_survives_its_filter_chunks() {
    let fake = FakeOpenAi::start().await;
    let p = provider(&fake, Dialect::Azure, "azure");
    let (chunks, err) = drain(&p, &request(true)).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(texts(&chunks), ["Hello", " world", "!"]);
    assert_eq!(fake.last_auth().unwrap(), KEY, "api-key header, not Bearer");
    assert!(fake.last_body().get("model").is_none());
}

#[tokio::test]
async fn mistral_is_never_sent_stream_options() {
    let fake = FakeOpenAi::start().await;
    let (chunks, _) = drain(&provider(&fake, Dialect::Mistral, "normal"), &request(true)).await;
    assert_eq!(texts(&chunks).len(), 3);
    assert!(fake.last_body().get("stream_options").is_none());
}

#[tokio::test]
async fn quota_is_final() {
    let fake = FakeOpenAi::start().await;
    let (_, err) = drain(&provider(&fake, Dialect::OpenAi, "quota"), &request(true)).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Quota);
    assert!(!sluice_text_completion::retry::retries(
        &sluice_text_completion::retry::RetryPolicy::default(),
        &err
    ));
}

#[tokio::test]
async fn mid_stream_failures_end_the_stream_with_the_right_error() {
    let fake = FakeOpenAi::start().await;
    for (model, kind, says) in [
        ("error_mid_stream", FailureKind::Stream, "model overloaded"),
        (
            "drop_mid_stream",
            FailureKind::Truncated,
            "connection broke",
        ),
        ("no_terminator", FailureKind::Truncated, "without [DONE]"),
        ("stall", FailureKind::Timeout, "next chunk"),
    ] {
        let (chunks, err) = drain(&provider(&fake, Dialect::OpenAi, model), &request(true)).await;
        assert_eq!(texts(&chunks), ["Hel"], "{model}");
        let err = err.unwrap_or_else(|| panic!("{model} must fail"));
        assert_eq!(err.kind, kind, "{model}: {err}");
        assert!(err.message.contains(says), "{model}: {}", err.message);
        // A broken connection names no URL: callers see this message.
        assert!(
            !err.message.contains("127.0.0.1"),
            "{model}: {}",
            err.message
        );
    }
}

#[tokio::test]
async fn an_unreadable_event_is_skipped_and_the_usage_still_counts() {
    let fake = FakeOpenAi::start().await;
    let (chunks, err) = drain(
        &provider(&fake, Dialect::OpenAi, "malformed"),
        &request(true),
    )
    .await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(texts(&chunks), ["Hel", " lo"]);
    assert_eq!(
        chunks.last().unwrap().usage,
        Some(Usage {
            input: 5,
            output: 2
        })
    );
}

#[tokio::test]
async fn non_streaming_asks_for_the_whole_answer() {
    let fake = FakeOpenAi::start().await;
    let p = provider(&fake, Dialect::Compatible, "normal");
    let done = p.generate(&request(false)).await.unwrap();
    assert_eq!(done.text, "Hello world!");
    assert_eq!(fake.last_body()["stream"], false);
}
