//! One request is one trace: HTTP client -> gateway -> Pulsar -> prompt processor ->
//! Pulsar -> text-completion processor -> fake OpenAI server, on the real broker, with spans
//! exported over OTLP/HTTP to a fake collector. Checks the parent chain span by span, the
//! `traceparent` header the provider receives, a trace started by the gateway when the caller
//! sent none, and that an unsampled trace is carried but not exported.
//!
//! OTLP export is process-wide, so this file holds a single test (its own process).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{net::SocketAddr, sync::Arc, time::Duration};

use sluice_gateway::{GatewayConfig, ServiceKind, ServiceTopics};
use sluice_prompt::{
    handler::{LlmClient, PromptService},
    metrics::PromptMetrics,
    store::TemplateStore,
};
use sluice_runtime::{
    client::{ClientConfig, RequestClient},
    processor::ProcessorConfig,
    secret::Secret,
    telemetry::Telemetry,
    trace::{OtlpConfig, init_otlp},
};
use sluice_tests::{
    Broker, RunningProcessor, ServedGateway,
    fake_openai::FakeOpenAi,
    fake_otlp::{FakeCollector, SeenSpan},
    init_logging, openai_service, unique_topic,
};
use sluice_text_completion::providers::openai::{Dialect, OpenAiConfig};

const TEMPLATES: &str = r#"{"templates": {"say": {"prompt": "{{ out }}"}}}"#;
const KEY: &str = "sk-trace-test-key-3141";
const MODEL: &str = "replay-4";

/// OTLP span kinds.
const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const CONSUMER: i32 = 5;

struct Stack {
    fake: FakeOpenAi,
    addr: SocketAddr,
    _llm: RunningProcessor,
    _prompt: RunningProcessor,
    _gateway: ServedGateway,
}

async fn stack() -> Stack {
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), MODEL);
    config.api_key = Some(Secret::new(KEY));
    let service = openai_service(config);
    let (tc_req, tc_resp, tc_cancel) = (
        unique_topic("trace-tc-req"),
        unique_topic("trace-tc-resp"),
        unique_topic("trace-tc-cancel"),
    );
    let mut tc_config = ProcessorConfig::new("text-completion", &tc_req, &tc_resp);
    tc_config.cancel_topic = Some(tc_cancel.clone());
    tc_config.drain_grace = Duration::from_secs(5);
    let llm = RunningProcessor::start(broker.bus().await, tc_config, service).await;

    let dir = std::env::temp_dir().join(format!("sluice-trace-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("templates.json");
    std::fs::write(&file, TEMPLATES).unwrap();
    let metrics = Telemetry::new().unwrap();
    let prompt_metrics = PromptMetrics::register(&metrics.registry).unwrap();
    let store = TemplateStore::open(Some(file), false, Some(prompt_metrics.clone())).unwrap();
    let mut cc = ClientConfig::new("text-completion", &tc_req, &tc_resp);
    cc.cancel_topic = Some(tc_cancel);
    let llm_client: Arc<LlmClient> = Arc::new(
        RequestClient::start(broker.bus().await, cc, None)
            .await
            .unwrap(),
    );
    let handler = PromptService::new(store, llm_client, prompt_metrics);
    let topics = ServiceTopics {
        request: unique_topic("trace-prompt-req"),
        response: unique_topic("trace-prompt-resp"),
        cancel: Some(unique_topic("trace-prompt-cancel")),
    };
    let mut p_config = ProcessorConfig::new("prompt", &topics.request, &topics.response);
    p_config.drain_grace = Duration::from_secs(5);
    p_config.cancel_topic.clone_from(&topics.cancel);
    let prompt = RunningProcessor::start(broker.bus().await, p_config, handler).await;

    let mut gc = GatewayConfig::new();
    gc.services.insert(ServiceKind::Prompt, topics);
    let gateway = ServedGateway::start(broker.bus().await, gc).await;
    Stack {
        fake,
        addr: gateway.addr,
        _llm: llm,
        _prompt: prompt,
        _gateway: gateway,
    }
}

/// Asks the gateway for a streamed prompt answer, with `traceparent` if given; returns the
/// NDJSON body, which must end with a `done` event.
async fn ask(addr: SocketAddr, traceparent: Option<&str>, out: &str) -> String {
    let mut req = reqwest::Client::new()
        .post(format!("http://{addr}/api/v1/prompt"))
        .header("accept", "application/x-ndjson")
        .json(&serde_json::json!({"id": "say", "terms": {"out": out}, "streaming": true}));
    if let Some(tp) = traceparent {
        req = req.header("traceparent", tp);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    let last = body.lines().last().unwrap();
    assert!(last.contains(r#""type":"done""#), "{body}");
    body
}

/// The four spans of one request, checked for kind, name and parent: gateway server span
/// (child of `caller`, or a root), prompt consumer, text-completion consumer, provider call.
fn chain<'a>(spans: &'a [SeenSpan], trace: &str, caller: &str) -> [&'a SeenSpan; 4] {
    let of_trace: Vec<&SeenSpan> = spans.iter().filter(|s| s.trace_id == trace).collect();
    assert_eq!(of_trace.len(), 4, "one span per hop: {of_trace:#?}");
    let find = |kind: i32, name: &str| {
        *of_trace
            .iter()
            .find(|s| s.kind == kind && s.name == name)
            .unwrap_or_else(|| panic!("no {name} span (kind {kind}) in {of_trace:#?}"))
    };
    let gateway = find(SERVER, "POST /api/v1/prompt");
    let prompt = find(CONSUMER, "prompt process");
    let llm = find(CONSUMER, "text-completion process");
    let call = find(CLIENT, &format!("chat {MODEL}"));
    assert_eq!(gateway.parent_span_id, caller);
    assert_eq!(prompt.parent_span_id, gateway.span_id);
    assert_eq!(llm.parent_span_id, prompt.span_id);
    assert_eq!(call.parent_span_id, llm.span_id);
    for s in [gateway, prompt, llm, call] {
        assert_eq!(s.service, "sluice-trace-test");
        assert_eq!(s.status, 0, "no error: {s:?}");
        for (k, v) in &s.attributes {
            assert!(!v.contains(KEY), "the provider key in attribute {k}");
        }
    }
    assert_eq!(prompt.attribute("sluice.outcome"), Some("success"));
    assert_eq!(llm.attribute("sluice.processor"), Some("text-completion"));
    assert_eq!(call.attribute("gen_ai.system"), Some("openai"));
    assert_eq!(call.attribute("gen_ai.request.model"), Some(MODEL));
    [gateway, prompt, llm, call]
}

fn parts(tp: &str) -> Vec<String> {
    tp.split('-').map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_from_the_gateway_to_the_provider_call() {
    init_logging();
    sluice_runtime::install_crypto_provider();
    let collector = FakeCollector::start().await;
    let _export = init_otlp(&OtlpConfig {
        endpoint: collector.base_url(),
        service_name: "sluice-trace-test".into(),
        // An export to the fake collector on loopback takes milliseconds; its time limit is a
        // hang guard, long enough that a busy machine does not lose the test's spans.
        timeout: sluice_tests::PATIENCE,
    })
    .unwrap();
    let s = stack().await;

    // 1. The caller's trace, sampled: continued hop by hop.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller = "00f067aa0ba902b7";
    let body = ask(
        s.addr,
        Some(&format!("00-{trace}-{caller}-01")),
        "traced one",
    )
    .await;
    assert!(body.contains(&format!(r#""trace_id":"{trace}""#)), "{body}");
    let spans = collector
        .wait_for(|sp| sp.iter().filter(|x| x.trace_id == trace).count() >= 4)
        .await;
    let [.., call] = chain(&spans, trace, caller);
    let sent = s.fake.traceparents();
    assert_eq!(sent.len(), 1);
    let header = parts(sent[0].as_deref().expect("the provider got a traceparent"));
    assert_eq!(header, ["00", trace, call.span_id.as_str(), "01"]);
    assert!(
        collector
            .content_types()
            .iter()
            .all(|c| c == "application/x-protobuf")
    );

    // 2. Not sampled by the caller: carried to the provider with its flag, never exported.
    let unsampled = "0af7651916cd43dd8448eb211c80319c";
    ask(
        s.addr,
        Some(&format!("00-{unsampled}-b7ad6b7169203331-00")),
        "quiet",
    )
    .await;
    let sent = s.fake.traceparents();
    let header = parts(sent[1].as_deref().unwrap());
    assert_eq!((header[1].as_str(), header[3].as_str()), (unsampled, "00"));

    // 3. No traceparent: the gateway starts the trace (a root span) and the rest follows.
    let body = ask(s.addr, None, "fresh").await;
    let sent = s.fake.traceparents();
    let header = parts(sent[2].as_deref().unwrap());
    let fresh = header[1].clone();
    assert!(body.contains(&format!(r#""trace_id":"{fresh}""#)), "{body}");
    let spans = collector
        .wait_for(|sp| sp.iter().filter(|x| x.trace_id == fresh).count() >= 4)
        .await;
    let [.., call] = chain(&spans, &fresh, "");
    assert_eq!(header[2], call.span_id);
    // Spans are exported in the order they end, so the unsampled request's would be here.
    assert!(
        spans.iter().all(|x| x.trace_id != unsampled),
        "an unsampled trace was exported"
    );
}
