//! The Ollama provider against the fake Ollama server over real HTTP (NDJSON).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures::StreamExt;
use sluice_schema::TextCompletionRequest;
use sluice_tests::fake_ollama::FakeOllama;
use sluice_text_completion::{
    provider::{Chunk, FailureKind, Provider, ProviderError, Usage},
    providers::ollama::{OllamaConfig, OllamaProvider},
};

fn provider(fake: &FakeOllama, model: &str) -> OllamaProvider {
    let mut c = OllamaConfig::new(fake.base_url(), model);
    c.num_ctx = Some(8192);
    c.temperature = Some(0.3);
    OllamaProvider::new(c).unwrap()
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
    let mut s = match p.generate_stream(&req()).await {
        Ok(s) => s,
        Err(e) => return (vec![], Some(e)),
    };
    let mut out = Vec::new();
    while let Some(item) = s.next().await {
        match item {
            Ok(c) => out.push(c),
            Err(e) => {
                assert!(s.next().await.is_none());
                return (out, Some(e));
            }
        }
    }
    (out, None)
}

fn text(chunks: &[Chunk]) -> String {
    chunks.iter().map(|c| c.text.as_str()).collect()
}

#[tokio::test]
async fn streams_text_with_totals_on_done_and_sends_num_ctx() {
    let fake = FakeOllama::start().await;
    for model in ["normal", "tiny_writes"] {
        let (chunks, err) = drain(&provider(&fake, model)).await;
        assert!(err.is_none(), "{model}: {err:?}");
        assert_eq!(text(&chunks), "The sky is blue.", "{model}");
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
    let (_, err) = drain(&provider(&fake, "server_error_once")).await;
    assert_eq!(err.unwrap().kind, FailureKind::Server);
}

#[tokio::test]
async fn mid_stream_failures_and_malformed_lines() {
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
        assert_eq!(text(&chunks), "The", "{model}");
        let err = err.unwrap();
        assert_eq!(err.kind, kind, "{model}: {err}");
        assert!(err.message.contains(says), "{model}: {}", err.message);
    }
    let (chunks, err) = drain(&provider(&fake, "malformed")).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(text(&chunks), "The sky");
}

#[tokio::test]
async fn non_streaming_returns_the_whole_answer() {
    let fake = FakeOllama::start().await;
    let done = provider(&fake, "normal").generate(&req()).await.unwrap();
    assert_eq!(done.text, "The sky is blue.");
    assert_eq!(
        done.usage,
        Some(Usage {
            input: 26,
            output: 3
        })
    );
    assert_eq!(fake.last_body()["stream"], false);
}
