//! The Bedrock provider against the fake Bedrock runtime (real HTTP, real event-stream frames,
//! signatures recomputed by the fake): the contract, then Bedrock's own wire details, and the
//! processor through the broker.

use std::{sync::Arc, time::Duration};

use futures::future::BoxFuture;
use serde_json::Value;
use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::{TextCompletionRequest, TextCompletionResponse};
use sluice_tests::{
    Broker, RunningProcessor, echo_config,
    fake_bedrock::{ACCESS_KEY_ID, API_KEY, FakeBedrock, SECRET_ACCESS_KEY, SeenAuth, model_id},
    records_of_one_attempt, text_client, unique_topic,
};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{Chunk, FailureKind, Provider, ProviderError, Usage},
    providers::bedrock::{BedrockConfig, BedrockCredentials, BedrockProvider},
    retry::{self, RetryPolicy},
};

use crate::contract::{self, Malformed, Script, Subject, Wire};

struct BedrockWire(FakeBedrock);

impl Wire for BedrockWire {
    fn base_url(&self) -> String {
        self.0.base_url()
    }
    /// `bad_signature` is `normal` signed with a wrong secret key: AWS refuses credentials
    /// by signature, not by script.
    fn provider_at(&self, base_url: &str, script: &str) -> Arc<dyn Provider> {
        Arc::new(match script {
            "bad_signature" => provider_at(base_url, "normal", sigv4("wrong/secret/key")),
            _ => provider_at(base_url, script, sigv4(SECRET_ACCESS_KEY)),
        })
    }
    fn last_body(&self) -> Value {
        self.0.last_request().body
    }
    fn credential_seen(&self) -> Option<String> {
        match self.0.last_request().auth {
            SeenAuth::SigV4 { .. } => Some("a valid SigV4 signature".into()),
            SeenAuth::Bearer => Some("a valid Bedrock API key".into()),
            SeenAuth::Refused(_) => None,
        }
    }
    fn abandoned(&self) -> usize {
        self.0.abandoned_streams()
    }
}

/// Bedrock Converse: SigV4-signed, event-stream frames, usage in the metadata frame.
fn bedrock() -> Subject {
    Subject {
        start: || {
            Box::pin(async { Box::new(BedrockWire(FakeBedrock::start().await)) as Box<dyn Wire> })
                as BoxFuture<'static, Box<dyn Wire>>
        },
        secret: SECRET_ACCESS_KEY,
        credential: "a valid SigV4 signature",
        key_var: "AWS_SECRET_ACCESS_KEY",
        text: "Hello world!",
        usage: Usage {
            input: 10,
            output: 5,
        },
        whole_usage: Usage {
            input: 10,
            output: 5,
        },
        unauthorized: Script::Run("bad_signature"),
        rejected: Script::Run("validation"),
        rate_limited: Script::Run("rate_limited_once"),
        // AWS's ThrottlingException carries no retry hint.
        retry_after: None,
        server_error: Script::Run("server_error_once"),
        error_event: (Script::Run("exception_mid_stream"), FailureKind::Server),
        truncated: (Script::Run("no_stop"), "Hel"),
        malformed: (
            Script::Run("corrupt"),
            Malformed::Fails("Hel", FailureKind::Protocol),
        ),
        tools: Script::Run("tools"),
        // Converse has no JSON mode: the processor asks for JSON in the system prompt and
        // checks the answer itself (text-completion's `structured`).
        json_mode: None,
        hang: Script::Run("hang"),
    }
}

mod bedrock_contract {
    crate::contract_cases!(super::bedrock);
}

/// Whether sluice's default policy retries `err`.
fn retried(err: &ProviderError) -> bool {
    retry::retries(&RetryPolicy::default(), err)
}

const REGION: &str = "us-west-2";
const SESSION_TOKEN: &str = "FwoGZXIvYXdzEfakesessiontoken";

fn sigv4(secret: &str) -> BedrockCredentials {
    BedrockCredentials::SigV4 {
        access_key_id: Secret::new(ACCESS_KEY_ID),
        secret_access_key: Secret::new(secret),
        session_token: Some(Secret::new(SESSION_TOKEN)),
    }
}

fn provider_at(base_url: &str, script: &str, credentials: BedrockCredentials) -> BedrockProvider {
    let mut c = BedrockConfig::new(REGION, model_id(script));
    c.base_url = base_url.to_owned();
    c.credentials = credentials;
    c.max_tokens = Some(256);
    c.temperature = Some(0.3);
    c.timeouts.between_chunks = Duration::from_secs(2);
    BedrockProvider::new(c).unwrap()
}

fn provider_with(
    fake: &FakeBedrock,
    script: &str,
    credentials: BedrockCredentials,
) -> BedrockProvider {
    provider_at(&fake.base_url(), script, credentials)
}

fn provider(fake: &FakeBedrock, script: &str) -> BedrockProvider {
    provider_with(fake, script, sigv4(SECRET_ACCESS_KEY))
}

fn req(streaming: bool) -> TextCompletionRequest {
    TextCompletionRequest {
        system: "be brief".into(),
        prompt: "hello".into(),
        streaming,
        ..Default::default()
    }
}

async fn drain(p: &BedrockProvider) -> (Vec<Chunk>, Option<ProviderError>) {
    contract::drain(p, &req(true)).await
}

fn text(chunks: &[Chunk]) -> String {
    chunks.iter().map(|c| c.text.as_str()).collect()
}

#[tokio::test]
async fn a_sigv4_signed_stream_yields_text_then_the_stop_reason_then_usage() {
    let fake = FakeBedrock::start().await;
    let (chunks, err) = drain(&provider(&fake, "normal")).await;
    assert_eq!(err, None);
    assert_eq!(text(&chunks), "Hello world!");
    let stop = chunks
        .iter()
        .position(|c| c.finish_reason.is_some())
        .unwrap();
    let usage = chunks.iter().position(|c| c.usage.is_some()).unwrap();
    assert_eq!(chunks[stop].finish_reason.as_deref(), Some("end_turn"));
    assert!(usage > stop, "metadata comes after messageStop");
    assert_eq!(
        chunks[usage].usage,
        Some(Usage {
            input: 10,
            output: 5
        })
    );
    let seen = fake.last_request();
    // The fake recomputed the signature from what it received: what was sent was signed.
    assert_eq!(
        seen.auth,
        SeenAuth::SigV4 {
            region: REGION.into(),
            signed_headers: "content-type;host;x-amz-date;x-amz-security-token".into()
        }
    );
    assert_eq!(
        seen.raw_path,
        "/model/us.fake.normal-v1%3A0/converse-stream"
    );
    assert_eq!(seen.model, "us.fake.normal-v1:0");
    assert_eq!(
        seen.body,
        serde_json::json!({
            "messages": [{"role": "user", "content": [{"text": "hello"}]}],
            "system": [{"text": "be brief"}],
            "inferenceConfig": {"maxTokens": 256, "temperature": 0.30000001192092896}
        })
    );
}

#[tokio::test]
async fn a_bedrock_api_key_is_sent_as_a_bearer_token() {
    let fake = FakeBedrock::start().await;
    let p = provider_with(
        &fake,
        "normal",
        BedrockCredentials::ApiKey(Secret::new(API_KEY)),
    );
    let (chunks, err) = drain(&p).await;
    assert_eq!((text(&chunks), err), ("Hello world!".to_owned(), None));
    assert_eq!(fake.last_request().auth, SeenAuth::Bearer);
}

#[tokio::test]
async fn frames_split_across_writes_and_slow_drips_decode() {
    let fake = FakeBedrock::start().await;
    for script in ["drip", "slow", "no_metadata"] {
        let (chunks, err) = drain(&provider(&fake, script)).await;
        assert_eq!(err, None, "{script}");
        assert_eq!(text(&chunks), "Hello world!", "{script}");
        assert_eq!(
            chunks
                .iter()
                .find_map(|c| c.finish_reason.clone())
                .as_deref(),
            Some("end_turn")
        );
    }
}

#[tokio::test]
async fn bad_credentials_are_auth_errors_naming_the_variables_never_the_values() {
    let fake = FakeBedrock::start().await;
    let wrong_secret = "wrong/secret/key";
    let (_, err) = drain(&provider_with(&fake, "normal", sigv4(wrong_secret))).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Auth);
    assert!(!retried(&err));
    assert_eq!(
        fake.last_request().auth,
        SeenAuth::Refused("InvalidSignatureException".into())
    );
    assert!(
        err.message.contains("AWS_SECRET_ACCESS_KEY"),
        "{}",
        err.message
    );
    // AWS's answer quoted the canonical request with the session token: none of it is kept.
    for secret in [wrong_secret, SESSION_TOKEN, SECRET_ACCESS_KEY] {
        assert!(!err.message.contains(secret), "{}", err.message);
    }
    let (_, err) = drain(&provider_with(
        &fake,
        "normal",
        BedrockCredentials::ApiKey(Secret::new("ABSKwrongkey")),
    ))
    .await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Auth);
    assert!(
        err.message.contains("AWS_BEARER_TOKEN_BEDROCK") && !err.message.contains("ABSKwrongkey")
    );
    let (_, err) = drain(&provider_with(&fake, "normal", BedrockCredentials::None)).await;
    assert_eq!(err.unwrap().kind, FailureKind::Auth);
    // Valid credentials that may not use the model.
    let (_, err) = drain(&provider(&fake, "access_denied")).await;
    let err = err.unwrap();
    assert_eq!(err.kind, FailureKind::Permission);
    assert!(
        err.message.contains("AWS_ACCESS_KEY_ID") && err.message.contains("AccessDeniedException")
    );
}

#[tokio::test]
async fn http_errors_are_classified_as_the_aws_sdks_do() {
    let fake = FakeBedrock::start().await;
    for (script, kind) in [
        ("rate_limited_once", FailureKind::RateLimited),
        ("server_error_once", FailureKind::Server),
        ("unavailable", FailureKind::Server),
        ("model_timeout", FailureKind::Server),
        ("validation", FailureKind::BadRequest),
    ] {
        let (_, err) = drain(&provider(&fake, script)).await;
        let err = err.unwrap();
        assert_eq!(err.kind, kind, "{script}");
        assert_eq!(retried(&err), kind != FailureKind::BadRequest, "{script}");
    }
    let (_, err) = drain(&provider(&fake, "validation")).await;
    let message = err.unwrap().message;
    assert!(
        message.contains("ValidationException") && message.contains("model identifier"),
        "{message}"
    );
}

#[tokio::test]
async fn mid_stream_failures_end_the_stream_with_the_right_error() {
    let fake = FakeBedrock::start().await;
    for (script, kind, says) in [
        (
            "exception_mid_stream",
            FailureKind::Server,
            "modelStreamErrorException",
        ),
        (
            "drop_mid_stream",
            FailureKind::Truncated,
            "connection broke",
        ),
        ("no_stop", FailureKind::Truncated, "messageStop"),
        ("corrupt", FailureKind::Protocol, "corrupt"),
    ] {
        let (chunks, err) = drain(&provider(&fake, script)).await;
        assert_eq!(text(&chunks), "Hel", "{script}");
        let err = err.unwrap_or_else(|| panic!("{script} must fail"));
        assert_eq!(err.kind, kind, "{script}: {}", err.message);
        assert!(err.message.contains(says), "{script}: {}", err.message);
    }
    let (chunks, err) = drain(&provider(&fake, "throttled_in_stream_once")).await;
    assert!(chunks.iter().all(|c| c.text.is_empty()));
    assert_eq!(err.unwrap().kind, FailureKind::RateLimited);
}

#[tokio::test]
async fn non_streaming_calls_converse() {
    let fake = FakeBedrock::start().await;
    let done = provider(&fake, "normal")
        .generate(&req(false))
        .await
        .unwrap();
    assert_eq!(done.text, "Hello world!");
    assert_eq!(done.finish_reason.as_deref(), Some("end_turn"));
    assert_eq!(
        done.usage,
        Some(Usage {
            input: 10,
            output: 5
        })
    );
    let seen = fake.last_request();
    assert_eq!(seen.raw_path, "/model/us.fake.normal-v1%3A0/converse");
    assert!(matches!(seen.auth, SeenAuth::SigV4 { .. }));
}

struct Through {
    fake: FakeBedrock,
    processor: RunningProcessor,
    client: sluice_tests::TextClient,
    telemetry: Telemetry,
}

impl Through {
    async fn start(script: &str) -> Self {
        let broker = Broker::from_env().await;
        let fake = FakeBedrock::start().await;
        let telemetry = Telemetry::new().unwrap();
        let service = TextCompletionService::new(
            Arc::new(provider(&fake, script)),
            RetryPolicy::default(),
            LlmMetrics::register(&telemetry.registry).unwrap(),
        );
        let (rq, rs) = (unique_topic("br-req"), unique_topic("br-resp"));
        let processor =
            RunningProcessor::start(broker.bus().await, echo_config(&rq, &rs, 4), service).await;
        let client = text_client(broker.bus().await, &rq, &rs).await;
        Self {
            fake,
            processor,
            client,
            telemetry,
        }
    }

    async fn ask(&self, streaming: bool) -> Vec<TextCompletionResponse> {
        let s = self.client.request(&req(streaming)).await.unwrap();
        records_of_one_attempt(s).await
    }

    async fn stop(self) {
        let rendered = self.telemetry.render();
        for secret in [SECRET_ACCESS_KEY, SESSION_TOKEN] {
            assert!(!rendered.contains(secret), "no secret in metrics");
        }
        self.client.close().await;
        self.processor.stop().await;
    }
}

fn sums(records: &[TextCompletionResponse]) -> (u64, u64) {
    (
        records.iter().filter_map(|r| r.in_token).sum(),
        records.iter().filter_map(|r| r.out_token).sum(),
    )
}

#[tokio::test]
async fn through_the_broker_token_deltas_sum_to_the_metadata_totals() {
    let t = Through::start("drip").await;
    let records = t.ask(true).await;
    let texts: Vec<_> = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(texts, ["Hello", " world", "!", ""]);
    assert_eq!(sums(&records), (10, 5));
    let model = model_id("drip");
    assert!(
        records
            .iter()
            .all(|r| r.model.as_deref() == Some(model.as_str()))
    );
    let last = records.last().unwrap();
    assert!(last.end_of_stream && last.error.is_none());
    // Non-streaming: one record with the totals.
    let records = t.ask(false).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].response, "Hello world!");
    assert_eq!(
        (records[0].in_token, records[0].out_token),
        (Some(10), Some(5))
    );
    t.stop().await;
}

#[tokio::test]
async fn through_the_broker_throttling_before_the_first_chunk_is_retried() {
    for script in ["rate_limited_once", "throttled_in_stream_once"] {
        let t = Through::start(script).await;
        let records = t.ask(true).await;
        let text: String = records.iter().map(|r| r.response.as_str()).collect();
        assert_eq!(text, "Hello world!", "{script}");
        assert!(records.last().unwrap().error.is_none());
        assert_eq!(sums(&records), (10, 5));
        assert_eq!(t.fake.calls(script), 2, "{script}");
        t.stop().await;
    }
}

#[tokio::test]
async fn through_the_broker_an_exception_after_the_first_chunk_is_a_terminal_error() {
    let t = Through::start("exception_mid_stream").await;
    let records = t.ask(true).await;
    let texts: Vec<_> = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(texts, ["Hel", ""]);
    let last = records.last().unwrap();
    assert!(last.end_of_stream);
    let err = last.error.as_ref().unwrap();
    assert!(
        err.message.contains("modelStreamErrorException"),
        "{}",
        err.message
    );
    assert_eq!(
        t.fake.calls("exception_mid_stream"),
        1,
        "never retried after a chunk"
    );
    t.stop().await;
}
