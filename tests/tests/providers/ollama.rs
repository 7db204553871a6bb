//! The Ollama provider against the fake Ollama server over real HTTP (NDJSON): the contract,
//! then Ollama's own wire details.

use std::sync::Arc;

use futures::future::BoxFuture;
use serde_json::Value;
use sluice_runtime::secret::Secret;
use sluice_schema::TextCompletionRequest;
use sluice_tests::fake_ollama::FakeOllama;
use sluice_text_completion::{
    provider::{Chunk, FailureKind, Provider, ProviderError, Usage},
    providers::ollama::{OllamaConfig, OllamaProvider},
};

use crate::contract::{self, Malformed, Script, Subject, Wire};

/// The key of an Ollama behind an authenticating proxy (or ollama.com).
const KEY: &str = "ollama-proxy-secret";

fn provider_at(base_url: &str, model: &str) -> OllamaProvider {
    let mut c = OllamaConfig::new(base_url, model);
    c.num_ctx = Some(8192);
    c.temperature = Some(0.3);
    c.api_key = Some(Secret::new(KEY));
    c.api_key_source = "OLLAMA_API_KEY".into();
    OllamaProvider::new(c).unwrap()
}

fn provider(fake: &FakeOllama, model: &str) -> OllamaProvider {
    provider_at(&fake.base_url(), model)
}

struct OllamaWire(FakeOllama);

impl Wire for OllamaWire {
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

/// Ollama's native API: NDJSON, the totals on `done: true`.
fn ollama() -> Subject {
    Subject {
        start: || {
            Box::pin(async { Box::new(OllamaWire(FakeOllama::start().await)) as Box<dyn Wire> })
                as BoxFuture<'static, Box<dyn Wire>>
        },
        secret: KEY,
        credential: "Bearer ollama-proxy-secret",
        key_var: "OLLAMA_API_KEY",
        text: "The sky is blue.",
        usage: Usage {
            input: 26,
            output: 3,
        },
        whole_usage: Usage {
            input: 26,
            output: 3,
        },
        unauthorized: Script::Run("unauthorized"),
        // An unknown model: 404.
        rejected: Script::Run("missing"),
        rate_limited: Script::Run("rate_limited_once"),
        retry_after: Some(std::time::Duration::from_secs(2)),
        server_error: Script::Run("server_error_once"),
        error_event: (Script::Run("error_mid_stream"), FailureKind::Stream),
        truncated: (Script::Run("no_done"), "The"),
        malformed: (Script::Run("malformed"), Malformed::Skipped("The sky")),
        tools: Script::Run("tools"),
        json_mode: Some(|body| body["format"].is_object() || body["format"] == "json"),
        hang: Script::Run("hang"),
    }
}

mod ollama_contract {
    crate::contract_cases!(super::ollama);
}

fn req() -> TextCompletionRequest {
    TextCompletionRequest {
        system: "s".into(),
        prompt: "why is the sky blue".into(),
        streaming: true,
        ..Default::default()
    }
}

async fn drain(p: &OllamaProvider) -> (Vec<Chunk>, Option<ProviderError>) {
    contract::drain(p, &req()).await
}

#[tokio::test]
async fn streams_lines_split_across_reads_and_sends_num_ctx() {
    let fake = FakeOllama::start().await;
    for model in ["normal", "tiny_writes"] {
        let (chunks, err) = drain(&provider(&fake, model)).await;
        assert!(err.is_none(), "{model}: {err:?}");
        assert_eq!(contract::text(&chunks), "The sky is blue.", "{model}");
        assert_eq!(
            chunks.last().unwrap().usage,
            Some(Usage {
                input: 26,
                output: 3
            })
        );
    }
    let body = fake.last_body();
    assert_eq!(body["options"]["num_ctx"], 8192);
    assert_eq!(body["stream"], true);
}

#[tokio::test]
async fn a_cached_prompt_counts_zero_input_tokens() {
    let fake = FakeOllama::start().await;
    let (chunks, _) = drain(&provider(&fake, "cached")).await;
    assert_eq!(
        chunks.last().unwrap().usage,
        Some(Usage {
            input: 0,
            output: 3
        })
    );
}

#[tokio::test]
async fn an_unknown_model_is_a_final_error_with_ollamas_message() {
    let fake = FakeOllama::start().await;
    let (_, err) = drain(&provider(&fake, "missing")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::BadRequest);
    assert!(
        err.message.contains("try pulling it first"),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn mid_stream_failures_end_the_stream_with_the_right_error() {
    let fake = FakeOllama::start().await;
    for (model, kind, says) in [
        (
            "error_mid_stream",
            FailureKind::Stream,
            "model runner crashed",
        ),
        (
            "drop_mid_stream",
            FailureKind::Truncated,
            "connection broke",
        ),
        ("no_done", FailureKind::Truncated, "done:true"),
    ] {
        let (chunks, err) = drain(&provider(&fake, model)).await;
        assert_eq!(contract::text(&chunks), "The", "{model}");
        let err = err.unwrap();
        assert_eq!(err.kind, kind, "{model}: {err}");
        assert!(err.message.contains(says), "{model}: {}", err.message);
        assert!(
            !err.message.contains("127.0.0.1"),
            "{model}: {}",
            err.message
        );
    }
}

#[tokio::test]
async fn non_streaming_asks_for_the_whole_answer() {
    let fake = FakeOllama::start().await;
    let done = provider(&fake, "normal").generate(&req()).await.unwrap();
    assert_eq!(done.text, "The sky is blue.");
    assert_eq!(fake.last_body()["stream"], false);
}
