//! The text-completion processor end to end on the real broker, against the fake OpenAI
//! server: records on the wire, token deltas, retries before the first chunk only, and
//! terminal errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use sluice_runtime::{secret::Secret, telemetry::Telemetry};
use sluice_schema::{TextCompletionRequest, TextCompletionResponse, UsageRecord};
use sluice_tests::{
    Broker, RunningProcessor, TextClient, echo_config, fake_openai::FakeOpenAi, init_logging,
    metric_value, records_of_one_attempt, text_client, unique_topic,
};
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{ChunkStream, Completion, Provider, ProviderError},
    providers::openai::{Dialect, OpenAiConfig, OpenAiProvider},
    retry::RetryPolicy,
};

const KEY: &str = "sk-processor-secret";

struct Setup {
    fake: FakeOpenAi,
    client: TextClient,
    processor: RunningProcessor,
    telemetry: Telemetry,
}

impl Setup {
    async fn new(model: &str) -> Self {
        Self::wrapped(model, |p| Arc::new(p)).await
    }

    /// A processor whose provider is the fake's OpenAI provider as `wrap` makes it.
    async fn wrapped(model: &str, wrap: impl FnOnce(OpenAiProvider) -> Arc<dyn Provider>) -> Self {
        Self::configured(model, RetryPolicy::default(), wrap).await
    }

    /// A processor retrying as `policy` says.
    async fn retrying(model: &str, policy: &str) -> Self {
        Self::configured(model, RetryPolicy::parse(policy).unwrap(), |p| Arc::new(p)).await
    }

    async fn configured(
        model: &str,
        policy: RetryPolicy,
        wrap: impl FnOnce(OpenAiProvider) -> Arc<dyn Provider>,
    ) -> Self {
        init_logging();
        let broker = Broker::from_env().await;
        let fake = FakeOpenAi::start().await;
        let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), model);
        config.api_key = Some(Secret::new(KEY));
        config.api_key_source = "OPENAI_API_KEY".into();
        config.timeouts.between_chunks = Duration::from_secs(2);
        let provider = wrap(OpenAiProvider::new(config).unwrap());
        let telemetry = Telemetry::new().unwrap();
        let metrics = LlmMetrics::register(&telemetry.registry).unwrap();
        let service = TextCompletionService::new(provider, policy, metrics);
        let (req, resp) = (unique_topic("tc-req"), unique_topic("tc-resp"));
        let processor =
            RunningProcessor::start(broker.bus().await, echo_config(&req, &resp, 16), service)
                .await;
        let client = text_client(broker.bus().await, &req, &resp).await;
        Self {
            fake,
            client,
            processor,
            telemetry,
        }
    }

    /// Every record of one request, asserting the stream never restarted.
    async fn ask(&self, streaming: bool) -> Vec<TextCompletionResponse> {
        self.ask_retrying(streaming, None).await
    }

    /// Every record of one request with the `retry` line given.
    async fn ask_retrying(
        &self,
        streaming: bool,
        retry: Option<&str>,
    ) -> Vec<TextCompletionResponse> {
        let s = self
            .client
            .request(&TextCompletionRequest {
                system: "be brief".into(),
                prompt: "say hello".into(),
                streaming,
                retry: retry.map(str::to_owned),
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

fn sums(records: &[TextCompletionResponse]) -> (u64, u64) {
    records.iter().fold((0, 0), |(i, o), r| {
        (i + r.in_token.unwrap_or(0), o + r.out_token.unwrap_or(0))
    })
}

#[tokio::test]
async fn a_streaming_request_gets_one_record_per_chunk_and_deltas_that_sum_to_the_totals() {
    let s = Setup::new("normal").await;
    let records = s.ask(true).await;
    let texts: Vec<_> = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(texts, ["Hello", " world", "!", ""]);
    assert!(
        records[..3]
            .iter()
            .all(|r| !r.end_of_stream && r.error.is_none())
    );
    let last = records.last().unwrap();
    assert!(last.end_of_stream && last.error.is_none());
    assert!(records.iter().all(|r| r.model.as_deref() == Some("normal")));
    assert_eq!(
        sums(&records),
        (11, 3),
        "deltas sum to the provider's totals"
    );
    assert_eq!(
        s.metric(
            r#"sluice_llm_requests_total{model="normal",outcome="success",provider="openai"}"#
        ),
        1
    );
    assert_eq!(
        s.metric(r#"sluice_llm_tokens_total{direction="output",model="normal",provider="openai"}"#),
        3
    );
    assert_eq!(
        s.metric(
            r#"sluice_llm_time_to_first_token_seconds_count{model="normal",provider="openai"}"#
        ),
        1
    );
    s.stop().await;
}

#[tokio::test]
async fn a_non_streaming_request_gets_exactly_one_record() {
    let s = Setup::new("normal").await;
    let records = s.ask(false).await;
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(r.response, "Hello world!");
    assert!(r.end_of_stream);
    assert_eq!((r.in_token, r.out_token), (Some(11), Some(3)));
    assert_eq!(s.fake.last_body()["stream"], false);
    s.stop().await;
}

/// A provider that cannot stream (TrustGraph's streaming spec
/// (docs/specs.md#trustgraphs-streaming-spec): `supports_streaming` false, the processor falls
/// back): a streaming request still gets its answer, as one whole record ending the stream, from
/// one non-streaming provider call, with the usage.
#[tokio::test]
async fn a_provider_that_cannot_stream_answers_a_streaming_request_with_one_record() {
    struct Whole(OpenAiProvider);
    #[async_trait::async_trait]
    impl Provider for Whole {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn model(&self) -> &str {
            self.0.model()
        }
        fn endpoint(&self) -> &str {
            self.0.endpoint()
        }
        fn supports_streaming(&self) -> bool {
            false
        }
        async fn generate_stream(
            &self,
            request: &TextCompletionRequest,
        ) -> Result<ChunkStream, ProviderError> {
            self.0.generate_stream(request).await
        }
        async fn generate(
            &self,
            request: &TextCompletionRequest,
        ) -> Result<Completion, ProviderError> {
            self.0.generate(request).await
        }
    }
    let s = Setup::wrapped("normal", |p| Arc::new(Whole(p))).await;
    let records = s.ask(true).await;
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    assert_eq!(r.response, "Hello world!");
    assert!(r.end_of_stream && r.error.is_none());
    assert_eq!((r.in_token, r.out_token), (Some(11), Some(3)));
    assert_eq!(
        s.fake.last_body()["stream"],
        false,
        "one non-streaming call"
    );
    assert_eq!(s.fake.calls("normal"), 1);
    s.stop().await;
}

#[tokio::test]
async fn a_rate_limit_before_the_first_chunk_is_retried_after_the_servers_hint() {
    let s = Setup::new("rate_limited_once").await;
    let records = s.ask(true).await;
    assert_eq!(
        records
            .iter()
            .map(|r| r.response.as_str())
            .collect::<String>(),
        "Hello world!"
    );
    assert!(records.last().unwrap().error.is_none());
    assert_eq!(s.fake.calls("rate_limited_once"), 2);
    assert_eq!(s.metric(r#"sluice_llm_retries_total{kind="rate_limited",model="rate_limited_once",provider="openai"}"#), 1);
    assert_eq!(
        s.metric(r#"sluice_llm_rate_limited_total{model="rate_limited_once",provider="openai"}"#),
        1
    );
    s.stop().await;
}

#[tokio::test]
async fn a_server_error_before_the_first_chunk_is_retried() {
    let s = Setup::new("server_error_once").await;
    let records = s.ask(true).await;
    assert!(records.last().unwrap().error.is_none());
    assert_eq!(s.fake.calls("server_error_once"), 2);
    s.stop().await;
}

#[tokio::test]
async fn the_servers_x_should_retry_header_overrides_the_status() {
    // `false` makes a 500 final: one call, one terminal error.
    let s = Setup::new("server_error_final").await;
    let records = s.ask(true).await;
    assert_eq!(records.len(), 1);
    assert!(records[0].error.is_some() && records[0].end_of_stream);
    assert_eq!(
        s.fake.calls("server_error_final"),
        1,
        "x-should-retry: false"
    );
    s.stop().await;
    // `true` makes a 400 retryable: the second call streams the answer.
    let s = Setup::new("bad_request_retry_once").await;
    let records = s.ask(true).await;
    assert!(records.last().unwrap().error.is_none());
    let text: String = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(text, "Hello world!");
    assert_eq!(
        s.fake.calls("bad_request_retry_once"),
        2,
        "x-should-retry: true"
    );
    s.stop().await;
}

fn text(records: &[TextCompletionResponse]) -> String {
    records.iter().map(|r| r.response.as_str()).collect()
}

fn error_of(records: &[TextCompletionResponse]) -> &sluice_schema::Error {
    let last = records.last().unwrap();
    assert!(last.end_of_stream);
    last.error.as_ref().unwrap()
}

/// A request's `retry` line, applied over the processor's policy, decides which failures are
/// retried and how often: the NDJSON parser contract's
/// (docs/specs.md#the-structured-ndjson-contracts) policy retries 502 but not 500, sluice's retries
/// both.
#[tokio::test]
async fn a_requests_retry_line_decides_which_failures_are_retried_and_how_often() {
    let s = Setup::new("status-502-2").await;
    let records = s.ask_retrying(true, Some("seed-002,delay=20ms")).await;
    assert_eq!(text(&records), "Hello world!");
    assert_eq!(s.fake.calls("status-502-2"), 3, "two retries");
    assert_eq!(
        s.metric(
            r#"sluice_llm_retries_total{kind="server",model="status-502-2",provider="openai"}"#
        ),
        2
    );
    s.stop().await;

    let s = Setup::new("status-500-2").await;
    let records = s.ask_retrying(true, Some("seed-002")).await;
    assert_eq!(records.len(), 1, "{records:?}");
    let err = error_of(&records);
    assert_eq!(err.kind, "llm-error");
    assert!(err.message.contains("500"), "{}", err.message);
    assert_eq!(
        s.fake.calls("status-500-2"),
        1,
        "the NDJSON parser contract does not retry 500"
    );
    // The processor's own policy (sluice's default) retries it: the second call fails too,
    // the third answers.
    let records = s.ask(false).await;
    assert_eq!(text(&records), "Hello world!");
    assert_eq!(s.fake.calls("status-500-2"), 3);
    s.stop().await;

    // Fewer attempts than failures: the last failure is the answer.
    let s = Setup::new("status-503-2").await;
    let records = s
        .ask_retrying(true, Some("attempts=2,delay=10ms,jitter=0"))
        .await;
    assert!(error_of(&records).message.contains("503"));
    assert_eq!(s.fake.calls("status-503-2"), 2);
    s.stop().await;
}

/// The processor's `--retry` policy applies to requests that name none; a request's line is
/// applied over it, and a line that cannot be read is refused before any provider call.
#[tokio::test]
async fn the_processors_policy_applies_and_a_bad_retry_line_is_an_invalid_request() {
    // the LLM streaming contract (docs/specs.md#the-structured-ndjson-contracts) and the LLM API
    // contracts (docs/specs.md#the-structured-ndjson-contracts) treat every HTTP error as final.
    let s = Setup::retrying("status-503-1", "seed-000").await;
    let records = s.ask(true).await;
    assert!(error_of(&records).message.contains("503"));
    assert_eq!(s.fake.calls("status-503-1"), 1);
    s.stop().await;

    let s = Setup::retrying("status-503-1", "seed-000").await;
    let records = s
        .ask_retrying(true, Some("on=connect+timeout+503,delay=10ms"))
        .await;
    assert_eq!(text(&records), "Hello world!");
    assert_eq!(
        s.fake.calls("status-503-1"),
        2,
        "the request's failures, the contract's attempts"
    );
    for (line, says) in [
        ("seed-009", "unknown retry preset \"seed-009\""),
        ("attempts=50", "retry attempts must be 1 to 10"),
        ("on=teapot", "unknown failure"),
    ] {
        let records = s.ask_retrying(true, Some(line)).await;
        assert_eq!(records.len(), 1);
        let err = error_of(&records);
        assert_eq!(err.kind, "invalid-request", "{line}");
        assert!(
            err.message.contains("field `retry`") && err.message.contains(says),
            "{line}: {}",
            err.message
        );
    }
    assert_eq!(s.fake.calls("status-503-1"), 2, "no call for a bad line");
    s.stop().await;
}

#[tokio::test]
async fn a_bad_key_is_one_terminal_error_naming_the_variable_without_retrying() {
    let s = Setup::new("unauthorized").await;
    let records = s.ask(true).await;
    assert_eq!(records.len(), 1);
    let err = records[0].error.as_ref().unwrap();
    assert_eq!(err.kind, "llm-error");
    assert!(err.message.contains("OPENAI_API_KEY"), "{}", err.message);
    assert!(!err.message.contains(KEY));
    assert!(records[0].end_of_stream);
    assert_eq!(s.fake.calls("unauthorized"), 1, "401 is not retried");
    assert!(!s.telemetry.render().contains(KEY), "no key in metrics");
    s.stop().await;
}

#[tokio::test]
async fn failures_after_the_first_chunk_are_terminal_errors_and_never_retried() {
    for (model, says) in [
        ("error_mid_stream", "model overloaded"),
        ("drop_mid_stream", "connection broke"),
        ("no_terminator", "incomplete"),
        ("stall", "next chunk"),
    ] {
        let s = Setup::new(model).await;
        let records = s.ask(true).await;
        assert_eq!(records.len(), 2, "{model}: {records:?}");
        assert_eq!(records[0].response, "Hel");
        let last = &records[1];
        assert!(last.end_of_stream, "{model}");
        let err = last.error.as_ref().unwrap();
        assert_eq!(err.kind, "llm-error");
        assert!(err.message.contains(says), "{model}: {}", err.message);
        assert_eq!(
            s.fake.calls(model),
            1,
            "{model}: not retried after a published chunk"
        );
        s.stop().await;
    }
}

#[tokio::test]
async fn the_processor_over_ollama_streams_ndjson_and_reports_its_totals_as_deltas() {
    use sluice_tests::fake_ollama::FakeOllama;
    use sluice_text_completion::providers::ollama::{OllamaConfig, OllamaProvider};
    init_logging();
    let broker = Broker::from_env().await;
    let fake = FakeOllama::start().await;
    let mut config = OllamaConfig::new(fake.base_url(), "tiny_writes");
    config.num_ctx = Some(4096);
    let telemetry = Telemetry::new().unwrap();
    let service = TextCompletionService::new(
        Arc::new(OllamaProvider::new(config).unwrap()),
        RetryPolicy::default(),
        LlmMetrics::register(&telemetry.registry).unwrap(),
    );
    let (req, resp) = (unique_topic("tco-req"), unique_topic("tco-resp"));
    let processor =
        RunningProcessor::start(broker.bus().await, echo_config(&req, &resp, 4), service).await;
    let client = text_client(broker.bus().await, &req, &resp).await;
    let records = client
        .call(&TextCompletionRequest {
            prompt: "why is the sky blue".into(),
            streaming: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let texts: Vec<_> = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(texts, ["The", " sky", " is blue.", ""]);
    assert!(records.last().unwrap().end_of_stream);
    assert_eq!(sums(&records), (26, 3));
    assert!(
        records
            .iter()
            .all(|r| r.model.as_deref() == Some("tiny_writes"))
    );
    assert_eq!(fake.last_body()["options"]["num_ctx"], 4096);
    client.close().await;
    processor.stop().await;
}

/// Every usage record on `topic`, read from its start until nothing came for a second.
async fn ledger_records(bus: Arc<dyn sluice_runtime::bus::Bus>, topic: &str) -> Vec<UsageRecord> {
    let mut out = Vec::new();
    let skipped =
        sluice_runtime::ledger::read_records(bus.as_ref(), topic, Duration::from_secs(1), |r| {
            out.push(r);
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap();
    assert_eq!(
        skipped, 0,
        "messages on the ledger that are not usage records"
    );
    out
}

/// One usage record per attempt that called the provider, whatever its end: the provider's
/// own count when it reported one (a retried 429 not counted twice, a streamed and a whole
/// answer billed the same), the chunks received when it stopped before reporting, and a
/// cancelled call too; none for a request that called no provider. Priced from the table,
/// counted in the metrics, and the key the request carried.
#[tokio::test]
async fn the_usage_ledger_has_one_record_per_attempt_with_what_the_provider_reported() {
    use sluice_runtime::{
        client::{Received, RequestOptions},
        ledger::{Ledger, Price, Prices},
    };
    init_logging();
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), "routed");
    config.api_key = Some(Secret::new(KEY));
    config.api_key_source = "OPENAI_API_KEY".into();
    config.timeouts.between_chunks = Duration::from_millis(700);
    let provider = Arc::new(OpenAiProvider::new(config).unwrap());
    let telemetry = Telemetry::new().unwrap();
    let metrics = LlmMetrics::register(&telemetry.registry).unwrap();
    let service = TextCompletionService::new(provider, RetryPolicy::default(), metrics);
    let bus = broker.bus().await;
    let usage_topic = unique_topic("usage");
    let prices = Prices {
        prices: vec![Price {
            model: "routed".into(),
            provider: Some("openai".into()),
            input: 1.0,
            output: 2.0,
        }],
    };
    let ledger = Ledger::open(&*bus, &usage_topic, prices, &telemetry.registry)
        .await
        .unwrap();
    let (req, resp, cancel) = (
        unique_topic("tc-req"),
        unique_topic("tc-resp"),
        unique_topic("tc-cancel"),
    );
    let mut pc = echo_config(&req, &resp, 16);
    pc.ledger = Some(Arc::new(ledger));
    pc.cancel_topic = Some(cancel.clone());
    let processor = RunningProcessor::start_with(bus.clone(), pc, service, telemetry.clone()).await;
    let mut cc = sluice_runtime::client::ClientConfig::new("echo", &req, &resp);
    cc.cancel_topic = Some(cancel);
    let client = TextClient::start(bus.clone(), cc, None).await.unwrap();

    let ask = |model: &str, streaming: bool| TextCompletionRequest {
        system: "be brief".into(),
        prompt: format!("[model:{model}] say hello"),
        streaming,
        ..Default::default()
    };
    let keyed = |key: &str| RequestOptions {
        key: Some(key.to_owned()),
        ..RequestOptions::default()
    };
    // (model, streaming, key) -> the request's id and its last record.
    let mut ids = std::collections::BTreeMap::new();
    for (name, model, streaming) in [
        ("streamed", "normal", true),
        ("whole", "normal", false),
        ("retried-429", "rate_limited_once", true),
        ("error-mid-stream", "error_mid_stream", true),
        ("dropped", "drop_mid_stream", true),
        ("stalled", "stall", true),
    ] {
        let mut s = client
            .request_with(&ask(model, streaming), keyed("team-a"))
            .await
            .unwrap();
        let id = s.id().to_owned();
        let mut last = None;
        while let Some(item) = s.next().await {
            if let Received::Record(r) = item.unwrap() {
                last = Some(r);
            }
        }
        ids.insert(name, (id, last.unwrap()));
    }
    // Cancelled after its first chunk: the stream is dropped, the processor told.
    let mut s = client
        .request_with(&ask("gated", true), keyed("team-b"))
        .await
        .unwrap();
    let cancelled_id = s.id().to_owned();
    let first = s.next().await.unwrap().unwrap();
    assert!(matches!(first, Received::Record(ref r) if r.response == "Hel"));
    drop(s);
    // No provider call: nothing to bill.
    let listed = client
        .request(&TextCompletionRequest {
            operation: Some(sluice_schema::LIST_MODELS.into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let listed_id = listed.id().to_owned();
    records_of_one_attempt(listed).await;

    // The cancelled attempt's record is written when the processor has stopped it.
    let mut records = Vec::new();
    for _ in 0..20 {
        records = ledger_records(bus.clone(), &usage_topic).await;
        if records.iter().any(|r| r.id == cancelled_id) {
            break;
        }
    }
    let by_id = |id: &str| -> Vec<&UsageRecord> { records.iter().filter(|r| r.id == id).collect() };
    assert!(
        by_id(&listed_id).is_empty(),
        "list-models calls no provider"
    );
    assert_eq!(records.len(), 7, "one record per request: {records:#?}");
    let one = |name: &str| -> UsageRecord {
        let found = by_id(&ids[name].0);
        assert_eq!(found.len(), 1, "{name}: {found:#?}");
        found[0].clone()
    };
    for name in ["streamed", "whole", "retried-429"] {
        let r = one(name);
        assert_eq!(
            (
                r.input_tokens,
                r.output_tokens,
                r.estimated,
                r.outcome.as_str()
            ),
            (11, 3, false, "answered"),
            "{name}: the provider's own count, once"
        );
        assert_eq!(r.key.as_deref(), Some("team-a"));
        assert_eq!(
            (r.model.as_deref(), r.provider.as_deref()),
            (Some("routed"), Some("openai"))
        );
        assert_eq!(r.service, "echo");
        assert_eq!(r.streaming, name != "whole");
        let cost = r.cost.unwrap();
        assert!((cost - 17e-6).abs() < 1e-12, "{name}: {cost}");
        // What the ledger says is what the caller was told.
        assert_eq!(r.id, ids[name].0);
    }
    for name in ["error-mid-stream", "dropped", "stalled"] {
        let r = one(name);
        assert_eq!(r.outcome, "error", "{name}");
        assert_eq!(
            r.error.as_deref(),
            Some(ids[name].1.error.as_ref().unwrap().kind.as_str())
        );
        // `Hel` arrived, the usage never did: one chunk counted.
        assert_eq!(
            (r.input_tokens, r.output_tokens, r.estimated),
            (0, 1, true),
            "{name}"
        );
    }
    let c = by_id(&cancelled_id);
    assert_eq!(c.len(), 1, "{c:#?}");
    assert_eq!(
        (
            c[0].outcome.as_str(),
            c[0].output_tokens,
            c[0].estimated,
            c[0].key.as_deref()
        ),
        ("cancelled", 1, true, Some("team-b"))
    );
    // The metrics count the same tokens and cost.
    let text = telemetry.render();
    let sum = |prefix: &str| metric_value(&text, prefix);
    assert_eq!(
        sum("sluice_usage_tokens_total{key=\"team-a\",kind=\"input\""),
        33.0
    );
    assert_eq!(
        sum("sluice_usage_tokens_total{key=\"team-a\",kind=\"output\""),
        12.0
    );
    assert_eq!(sum("sluice_usage_records_total{outcome=\"error\"}"), 3.0);
    assert_eq!(sum("sluice_usage_unrecorded_total"), 0.0);
    client.close().await;
    processor.stop().await;
}
