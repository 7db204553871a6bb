//! The OpenAI-dialect provider against the fake server over real HTTP: every wire shape and
//! failure shape of ../shared/reference/providers.md for the family.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use futures::StreamExt;
use sluice_runtime::secret::Secret;
use sluice_schema::TextCompletionRequest;
use sluice_tests::fake_openai::FakeOpenAi;
use sluice_text_completion::{
    provider::{Chunk, FailureKind, Provider, ProviderError, Usage},
    providers::openai::{Dialect, OpenAiConfig, OpenAiProvider},
    retry::{self, RetryPolicy},
};

/// Whether sluice's default policy retries `err`.
fn retried(err: &ProviderError) -> bool {
    retry::retries(&RetryPolicy::default(), err)
}

const KEY: &str = "sk-test-very-secret-key";

fn provider(fake: &FakeOpenAi, dialect: Dialect, model: &str) -> OpenAiProvider {
    let mut c = OpenAiConfig::new(dialect, fake.base_url(), model);
    c.api_key = Some(Secret::new(KEY));
    c.api_key_source = "OPENAI_API_KEY".into();
    c.timeouts.between_chunks = Duration::from_millis(500);
    OpenAiProvider::new(c).unwrap()
}

fn req() -> TextCompletionRequest {
    TextCompletionRequest {
        system: "be brief".into(),
        prompt: "say hello".into(),
        streaming: true,
        ..Default::default()
    }
}

async fn drain(p: &OpenAiProvider) -> (Vec<Chunk>, Option<ProviderError>) {
    let mut s = match p.generate_stream(&req()).await {
        Ok(s) => s,
        Err(e) => return (vec![], Some(e)),
    };
    let mut chunks = Vec::new();
    while let Some(item) = s.next().await {
        match item {
            Ok(c) => chunks.push(c),
            Err(e) => {
                assert!(s.next().await.is_none(), "nothing follows an error");
                return (chunks, Some(e));
            }
        }
    }
    (chunks, None)
}

fn texts(chunks: &[Chunk]) -> Vec<&str> {
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
    let (chunks, err) = drain(&p).await;
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
    let p = provider(&fake, Dialect::Azure, "my-deployment");
    let (chunks, err) = drain(&p).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(texts(&chunks), ["Hello", " world", "!"]);
    assert_eq!(fake.last_auth().unwrap(), KEY, "api-key header, not Bearer");
    assert!(fake.last_body().get("model").is_none());
}

#[tokio::test]
async fn mistral_is_never_sent_stream_options() {
    let fake = FakeOpenAi::start().await;
    let (chunks, _) = drain(&provider(&fake, Dialect::Mistral, "normal")).await;
    assert_eq!(texts(&chunks).len(), 3);
    assert!(fake.last_body().get("stream_options").is_none());
}

#[tokio::test]
async fn a_bad_key_names_the_variable_and_never_the_key() {
    let fake = FakeOpenAi::start().await;
    let (_, err) = drain(&provider(&fake, Dialect::OpenAi, "unauthorized")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Auth);
    assert!(!retried(&err));
    assert!(err.message.contains("OPENAI_API_KEY"), "{}", err.message);
    assert!(!err.message.contains(KEY));
}

#[tokio::test]
async fn quota_is_final_and_rate_limits_carry_the_servers_hint() {
    let fake = FakeOpenAi::start().await;
    let (_, err) = drain(&provider(&fake, Dialect::OpenAi, "quota")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Quota);
    assert!(!retried(&err));
    let (_, err) = drain(&provider(&fake, Dialect::OpenAi, "rate_limited_once")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::RateLimited);
    assert_eq!(err.retry_after, Some(Duration::from_millis(100)));
    let (_, err) = drain(&provider(&fake, Dialect::OpenAi, "server_error_once")).await;
    assert_eq!(err.unwrap().kind, FailureKind::Server);
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
        let (chunks, err) = drain(&provider(&fake, Dialect::OpenAi, model)).await;
        assert_eq!(texts(&chunks), ["Hel"], "{model}");
        let err = err.unwrap_or_else(|| panic!("{model} must fail"));
        assert_eq!(err.kind, kind, "{model}: {err}");
        assert!(err.message.contains(says), "{model}: {}", err.message);
    }
}

#[tokio::test]
async fn an_unreadable_event_is_skipped_and_the_stream_goes_on() {
    let fake = FakeOpenAi::start().await;
    let (chunks, err) = drain(&provider(&fake, Dialect::OpenAi, "malformed")).await;
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
async fn non_streaming_returns_the_whole_answer_with_usage() {
    let fake = FakeOpenAi::start().await;
    let p = provider(&fake, Dialect::Compatible, "normal");
    let done = p.generate(&req()).await.unwrap();
    assert_eq!(done.text, "Hello world!");
    assert_eq!(
        done.usage,
        Some(Usage {
            input: 11,
            output: 3
        })
    );
    assert_eq!(fake.last_body()["stream"], false);
}

#[tokio::test]
async fn an_unreachable_provider_is_a_retryable_connect_error() {
    let mut c = OpenAiConfig::new(Dialect::Compatible, "http://127.0.0.1:1", "m");
    c.timeouts.connect = Duration::from_secs(2);
    let err = OpenAiProvider::new(c)
        .unwrap()
        .generate_stream(&req())
        .await
        .err()
        .unwrap();
    assert_eq!(err.kind, FailureKind::Connect);
    assert!(retried(&err));
}
