//! Fallback before the first token through the real broker: a text-completion processor
//! given an ordered list of providers (two fake OpenAI servers over real HTTP, or a port
//! nothing listens on), asked as a caller would. The primary answering 5xx, refusing
//! connections, stalling before its first token, failing mid-stream (no fallback: a clear
//! error), a hedge racing it, and a circuit breaker opening and closing: what the records say
//! (which provider and model answered), what the providers saw, and the metrics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::{TextCompletionRequest, TextCompletionResponse};
use sluice_tests::{
    Broker, PATIENCE, RunningProcessor, TextClient, echo_config, eventually, eventually_every,
    fake_openai::FakeOpenAi, free_port, init_logging, metric_value, records_of_one_attempt,
    text_client, unique_topic,
};
use sluice_text_completion::{
    fallback::{Fallback, FallbackSettings},
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::Provider,
    providers::openai::{Dialect, OpenAiConfig, OpenAiProvider},
    retry::RetryPolicy,
};

/// An OpenAI provider at `base_url` serving `model`, with its own key.
fn openai(base_url: &str, model: &str, key: &str) -> Arc<dyn Provider> {
    let mut config = OpenAiConfig::new(Dialect::OpenAi, base_url, model);
    config.api_key = Some(Secret::new(key));
    config.api_key_source = "OPENAI_API_KEY".into();
    config.timeouts.connect = Duration::from_secs(2);
    config.timeouts.between_chunks = Duration::from_secs(5);
    Arc::new(OpenAiProvider::new(config).unwrap())
}

struct Setup {
    primary: FakeOpenAi,
    backup: FakeOpenAi,
    client: TextClient,
    processor: RunningProcessor,
    telemetry: Telemetry,
}

impl Setup {
    /// A processor whose first provider serves `primary_model` (at a port nothing listens on
    /// when `refused`), its backup `normal` at another fake, as `settings` says; no retries,
    /// so what a test sees is the fallback's doing.
    async fn new(primary_model: &str, refused: bool, settings: FallbackSettings) -> Self {
        let primary = FakeOpenAi::start().await;
        let primary_url = if refused {
            format!("http://127.0.0.1:{}", free_port())
        } else {
            primary.base_url()
        };
        let provider = openai(&primary_url, primary_model, "sk-primary");
        Self::with_primary(primary, provider, settings).await
    }

    /// The same with `provider` first (`primary`: a fake it may or may not call).
    async fn with_primary(
        primary: FakeOpenAi,
        provider: Arc<dyn Provider>,
        settings: FallbackSettings,
    ) -> Self {
        init_logging();
        let broker = Broker::from_env().await;
        let backup = FakeOpenAi::start().await;
        let telemetry = Telemetry::new().unwrap();
        let metrics = LlmMetrics::register(&telemetry.registry).unwrap();
        let fallback = Fallback::new(
            provider,
            vec![openai(&backup.base_url(), "normal", "sk-backup")],
            settings,
            metrics.clone(),
        );
        let service = TextCompletionService::new(
            Arc::new(fallback),
            RetryPolicy::parse("attempts=1").unwrap(),
            metrics,
        );
        let (req, resp) = (unique_topic("fb-req"), unique_topic("fb-resp"));
        let processor =
            RunningProcessor::start(broker.bus().await, echo_config(&req, &resp, 16), service)
                .await;
        let client = text_client(broker.bus().await, &req, &resp).await;
        Self {
            primary,
            backup,
            client,
            processor,
            telemetry,
        }
    }

    /// Every record of one request.
    async fn ask(&self, streaming: bool) -> Vec<TextCompletionResponse> {
        let s = self
            .client
            .request(&TextCompletionRequest {
                prompt: "say hello".into(),
                streaming,
                ..Default::default()
            })
            .await
            .unwrap();
        records_of_one_attempt(s).await
    }

    fn metric(&self, prefix: &str) -> u64 {
        metric_value(&self.telemetry.render(), prefix) as u64
    }

    async fn stop(self) {
        self.client.close().await;
        self.processor.stop().await;
    }
}

fn text(records: &[TextCompletionResponse]) -> String {
    records.iter().map(|r| r.response.as_str()).collect()
}

/// Every record names the backup: provider `openai`, model `normal`; the answer is whole.
fn answered_by_backup(records: &[TextCompletionResponse]) {
    assert_eq!(text(records), "Hello world!", "{records:?}");
    let last = records.last().unwrap();
    assert!(last.end_of_stream && last.error.is_none(), "{last:?}");
    for r in records {
        assert_eq!(r.model.as_deref(), Some("normal"), "{r:?}");
        assert_eq!(r.provider.as_deref(), Some("openai"), "{r:?}");
    }
}

fn settings() -> FallbackSettings {
    FallbackSettings {
        first_token_deadline: None,
        hedge_after: None,
        breaker_failures: 5,
        breaker_cooldown: Duration::from_secs(30),
    }
}

/// The primary answers 503 every time: each call, streamed or whole, moves to the backup,
/// which answers with its own key; the moves and the answers are counted per position.
#[tokio::test]
async fn a_primary_answering_5xx_moves_each_call_to_the_backup() {
    let s = Setup::new("status-503-100", false, settings()).await;
    answered_by_backup(&s.ask(true).await);
    answered_by_backup(&s.ask(false).await);
    assert_eq!(s.primary.calls("status-503-100"), 2);
    assert_eq!(s.backup.calls("normal"), 2);
    assert_eq!(s.backup.last_auth().as_deref(), Some("Bearer sk-backup"));
    assert_eq!(s.primary.last_auth().as_deref(), Some("Bearer sk-primary"));
    assert_eq!(
        s.metric(r#"sluice_llm_fallbacks_total{model="status-503-100",position="0",provider="openai",reason="server"}"#),
        2
    );
    assert_eq!(
        s.metric(r#"sluice_llm_answered_total{model="normal",position="1",provider="openai"}"#),
        2
    );
    // The calls are counted under the model that answered.
    assert_eq!(
        s.metric(
            r#"sluice_llm_requests_total{model="normal",outcome="success",provider="openai"}"#
        ),
        2
    );
    s.stop().await;
}

/// A request the primary cannot be sent in its terms (Cohere cannot be made to call one
/// named tool) goes to the backup, which takes it: nothing was sent to the primary (the move
/// is counted as `unsendable`, not as a refused connection to the port nothing listens on).
#[tokio::test]
async fn a_request_the_primary_cannot_be_sent_is_answered_by_the_backup() {
    use sluice_schema::tools::{Tool, ToolChoice};
    use sluice_text_completion::providers::cohere::{CohereConfig, CohereProvider};
    let mut config = CohereConfig::new(format!("http://127.0.0.1:{}", free_port()), "command-r");
    config.api_key = Some(Secret::new("co-primary"));
    let cohere: Arc<dyn Provider> = Arc::new(CohereProvider::new(config).unwrap());
    let s = Setup::with_primary(FakeOpenAi::start().await, cohere, settings()).await;
    let stream = s
        .client
        .request(&TextCompletionRequest {
            prompt: "say hello".into(),
            streaming: true,
            tools: Some(vec![Tool {
                name: "get_weather".into(),
                description: None,
                parameters: sluice_schema::tools::no_parameters(),
                strict: None,
            }]),
            tool_choice: Some(ToolChoice::Named {
                name: "get_weather".into(),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    answered_by_backup(&records_of_one_attempt(stream).await);
    assert_eq!(
        s.backup.bodies().last().unwrap()["tool_choice"]["function"]["name"],
        "get_weather"
    );
    let moved = |reason: &str| {
        s.metric(&format!(
            r#"sluice_llm_fallbacks_total{{model="command-r",position="0",provider="cohere",reason="{reason}"}}"#
        ))
    };
    assert_eq!(moved("unsendable"), 1);
    assert_eq!(moved("connect"), 0);
    s.stop().await;
}

/// A primary nothing listens on: the refused connection moves the call.
#[tokio::test]
async fn a_primary_refusing_connections_moves_the_call() {
    let s = Setup::new("normal", true, settings()).await;
    answered_by_backup(&s.ask(true).await);
    assert_eq!(
        s.metric(r#"sluice_llm_fallbacks_total{model="normal",position="0",provider="openai",reason="connect"}"#),
        1
    );
    s.stop().await;
}

/// A primary whose first token would come after 30 s: at the 1.5 s deadline the call moves,
/// and the primary's request is abandoned (its connection closed), not left running. (The
/// deadline holds for the backup too: it is long enough for a loaded machine's fake.)
#[tokio::test]
async fn a_primary_stalling_before_its_first_token_is_left_at_the_deadline() {
    let mut settings = settings();
    settings.first_token_deadline = Some(Duration::from_millis(1500));
    let s = Setup::new("tokens-3-10-30000", false, settings).await;
    answered_by_backup(&s.ask(true).await);
    assert_eq!(
        s.metric(r#"sluice_llm_fallbacks_total{model="tokens-3-10-30000",position="0",provider="openai",reason="first_token_deadline"}"#),
        1
    );
    let abandoned = eventually(
        PATIENCE,
        async || s.primary.abandoned_streams(),
        |n| *n == 1,
    )
    .await;
    assert_eq!(
        abandoned, 1,
        "the stalled primary's stream was not abandoned"
    );
    s.stop().await;
}

/// A primary that fails after its first token keeps the call: the caller gets what came and
/// a clear terminal error, and the backup is never called.
#[tokio::test]
async fn a_primary_failing_mid_stream_is_not_moved_and_the_error_is_clear() {
    let s = Setup::new("drop_mid_stream", false, settings()).await;
    let records = s.ask(true).await;
    assert_eq!(records[0].response, "Hel");
    let last = records.last().unwrap();
    assert!(last.end_of_stream, "{last:?}");
    let error = last.error.as_ref().expect("a terminal error");
    assert_eq!(error.kind, "llm-error");
    assert!(!error.message.is_empty());
    // The record names the provider that failed.
    assert_eq!(last.model.as_deref(), Some("drop_mid_stream"));
    assert_eq!(last.provider.as_deref(), Some("openai"));
    assert_eq!(s.backup.calls("normal"), 0);
    s.stop().await;
}

/// Hedging: the primary's first token would come after 5 s; after 200 ms the backup is
/// started beside it, answers first, and the primary's request is cancelled.
#[tokio::test]
async fn a_hedge_answers_first_and_the_slow_primary_is_cancelled() {
    let mut settings = settings();
    settings.hedge_after = Some(Duration::from_millis(200));
    let s = Setup::new("tokens-3-10-5000", false, settings).await;
    answered_by_backup(&s.ask(true).await);
    assert_eq!(
        s.metric(r#"sluice_llm_hedges_total{model="normal",outcome="won",position="1",provider="openai"}"#),
        1
    );
    let abandoned = eventually(
        PATIENCE,
        async || s.primary.abandoned_streams(),
        |n| *n == 1,
    )
    .await;
    assert_eq!(abandoned, 1, "the slow primary's stream was not cancelled");
    s.stop().await;
}

/// The circuit breaker: two 500s in a row open the primary's; calls then skip it (the
/// primary sees no call) until the 1 s cool-down has passed; a probe then finds it healthy
/// and closes it, and the primary answers again. State and transitions are exported.
#[tokio::test]
async fn a_breaker_opens_skips_the_primary_then_probes_and_closes() {
    let mut settings = settings();
    settings.breaker_failures = 2;
    settings.breaker_cooldown = Duration::from_secs(1);
    let s = Setup::new("status-500-2", false, settings).await;
    let state = r#"sluice_llm_breaker_state{model="status-500-2",position="0",provider="openai"}"#;
    answered_by_backup(&s.ask(true).await);
    answered_by_backup(&s.ask(true).await);
    assert_eq!(s.metric(state), 1, "open after two failures in a row");
    // Open: skipped, the primary not called.
    answered_by_backup(&s.ask(true).await);
    assert_eq!(s.primary.calls("status-500-2"), 2);
    assert_eq!(
        s.metric(r#"sluice_llm_fallbacks_total{model="status-500-2",position="0",provider="openai",reason="breaker_open"}"#),
        1
    );
    // Past the cool-down a call probes the primary, which now answers: closed.
    let by_primary = |r: &Vec<TextCompletionResponse>| {
        r.last().and_then(|l| l.model.as_deref()) == Some("status-500-2")
    };
    let records = eventually_every(
        Duration::from_millis(100),
        PATIENCE,
        async || s.ask(true).await,
        by_primary,
    )
    .await;
    assert!(
        by_primary(&records),
        "the primary was never probed again: {records:?}"
    );
    assert_eq!(text(&records), "Hello world!");
    assert_eq!(s.metric(state), 0, "closed after a good probe");
    for (to, n) in [("open", 1), ("half-open", 1), ("closed", 1)] {
        assert_eq!(
            s.metric(&format!(r#"sluice_llm_breaker_transitions_total{{model="status-500-2",position="0",provider="openai",state="{to}"}}"#)),
            n,
            "{to}"
        );
    }
    s.stop().await;
}
