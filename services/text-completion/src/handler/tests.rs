use super::*;
use crate::testing::Answers;
use prometheus::Registry;

#[test]
fn the_logged_endpoint_never_carries_a_credential() {
    assert_eq!(
        shown_endpoint("http://user:secret@provider.test/v1/chat?key=secret#x"),
        "http://provider.test/v1/chat"
    );
    assert_eq!(
        shown_endpoint(
            "https://r.openai.azure.com/openai/deployments/m/chat/completions?api-version=1"
        ),
        "https://r.openai.azure.com/openai/deployments/m/chat/completions"
    );
    assert_eq!(shown_endpoint("not a url with secret"), "");
}

#[test]
fn running_totals_become_deltas_that_sum_to_the_totals() {
    let mut d = UsageDeltas::call(&UsageMeter::default());
    assert_eq!(d.take(), (None, None), "nothing reported yet");
    // Anthropic: input and 1 output token at message_start, then running output totals,
    // one repeated.
    d.observe(Usage {
        input: 25,
        output: 1,
    });
    assert_eq!(d.take(), (Some(25), Some(1)));
    d.observe(Usage {
        input: 25,
        output: 9,
    });
    d.observe(Usage {
        input: 25,
        output: 15,
    });
    d.observe(Usage {
        input: 25,
        output: 15,
    });
    assert_eq!(d.take(), (Some(0), Some(14)));
    assert_eq!(d.take(), (Some(0), Some(0)));
    assert_eq!(
        d.last,
        Usage {
            input: 25,
            output: 15
        }
    );
}

/// The in-process bus, except that its response topic stores nothing (a broker whose
/// bookie turned read-only).
struct UnstorableResponses {
    inner: sluice_runtime::bus::memory::MemoryBus,
    response: String,
}

struct Unstorable(String);

#[async_trait]
impl sluice_runtime::bus::Publisher for Unstorable {
    async fn send(
        &self,
        _: sluice_runtime::bus::Message,
    ) -> Result<sluice_runtime::bus::Receipt, sluice_runtime::bus::BusError> {
        Err(sluice_runtime::bus::BusError::Unavailable(
            "the bookie is read-only".into(),
        ))
    }
    fn topic(&self) -> &str {
        &self.0
    }
}

#[async_trait]
impl sluice_runtime::bus::Bus for UnstorableResponses {
    async fn publisher(
        &self,
        topic: &str,
    ) -> Result<Arc<dyn sluice_runtime::bus::Publisher>, sluice_runtime::bus::BusError> {
        if topic == self.response {
            return Ok(Arc::new(Unstorable(topic.to_owned())));
        }
        self.inner.publisher(topic).await
    }
    async fn subscribe(
        &self,
        topic: &str,
        subscription: &str,
        options: sluice_runtime::bus::SubscribeOptions,
    ) -> Result<Box<dyn sluice_runtime::bus::Subscription>, sluice_runtime::bus::BusError> {
        self.inner.subscribe(topic, subscription, options).await
    }
    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes()
    }
}

/// A text-completion processor answering with `provider` on `bus` (requests on `request`,
/// records on `response`, cancels on `cancel`), subscribed before this returns.
struct Running {
    telemetry: sluice_runtime::telemetry::Telemetry,
    shutdown: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Result<(), sluice_runtime::bus::BusError>>,
}

async fn run_on(bus: Arc<dyn sluice_runtime::bus::Bus>, provider: Arc<Answers>) -> Running {
    use sluice_runtime::{processor, telemetry::Telemetry};
    let telemetry = Telemetry::new().unwrap();
    let service = TextCompletionService::new(
        provider,
        RetryPolicy::default(),
        LlmMetrics::register(&telemetry.registry).unwrap(),
    );
    let mut config = processor::ProcessorConfig::new("text-completion", "request", "response");
    config.cancel_topic = Some("cancel".into());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(processor::run(
        bus,
        config,
        Arc::new(service),
        telemetry.clone(),
        shutdown.clone(),
    ));
    // The in-process bus keeps nothing for a topic nobody subscribes to yet.
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        telemetry.health.until_watched(1),
    )
    .await
    .expect("the processor subscribes");
    Running {
        telemetry,
        shutdown,
        task,
    }
}

/// A broker that takes requests but stores no answer is a broker outage, not a provider
/// failure: the call counts as `unpublished`, never as `error` (which alerts on the
/// provider), and the provider is not called again for it.
#[tokio::test]
async fn an_answer_the_broker_does_not_store_is_not_a_provider_failure() {
    use sluice_runtime::bus::Bus;
    let provider = Arc::new(Answers::default());
    let bus = Arc::new(UnstorableResponses {
        inner: sluice_runtime::bus::memory::MemoryBus::new(1 << 20, 64),
        response: "response".into(),
    });
    let Running {
        telemetry,
        shutdown,
        task,
    } = run_on(bus.clone(), provider.clone()).await;
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    let request = serde_json::to_vec(&TextCompletionRequest {
        prompt: "hi".into(),
        streaming: true,
        ..TextCompletionRequest::default()
    })
    .unwrap();
    let requests = bus.publisher("request").await.unwrap();
    requests
        .send(sluice_runtime::bus::Message::new(request).with_property("id", "r1"))
        .await
        .unwrap()
        .await
        .unwrap();
    let outcome = |o: &str| {
        let text = telemetry.render();
        sample(
            &text,
            "sluice_llm_requests_total",
            &[&format!("outcome=\"{o}\"")],
        )
        .unwrap_or(0.0)
    };
    while outcome("unpublished") < 1.0 {
        assert!(Instant::now() < deadline, "{}", telemetry.render());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(outcome("error"), 0.0, "{}", telemetry.render());
    assert_eq!(outcome("success"), 0.0);
    // The request goes back to the bus, and the processor waits for the broker to store
    // again (its store guard, blocked before the request is handed back) instead of
    // calling the provider in a loop.
    while !telemetry
        .render()
        .contains("sluice_processor_store_blocked{processor=\"text-completion\"} 1")
    {
        assert!(Instant::now() < deadline, "{}", telemetry.render());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        provider.calls(),
        1,
        "the provider was called again for an answer it had given"
    );
    shutdown.cancel();
    let _ = task.await;
}

/// The value of the first sample of `name` whose labels contain each of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A call its client cancels is dropped mid-stream by the runtime: it leaves the
/// in-flight gauge and counts as `cancelled`, not as a provider error (which alerts).
#[tokio::test]
async fn a_cancelled_call_leaves_the_gauge_and_counts_as_cancelled() {
    use sluice_runtime::{
        bus::{Bus, SubscribeOptions, memory::MemoryBus},
        cancel,
    };
    let bus = MemoryBus::new(1 << 20, 64);
    let mut responses = bus
        .subscribe("response", "test", SubscribeOptions::exclusive(16))
        .await
        .unwrap();
    let Running {
        telemetry,
        shutdown,
        task,
    } = run_on(Arc::new(bus.clone()), Arc::new(Answers::default())).await;
    let request = serde_json::to_vec(&TextCompletionRequest {
        prompt: "hang".into(),
        streaming: true,
        ..TextCompletionRequest::default()
    })
    .unwrap();
    bus.publisher("request")
        .await
        .unwrap()
        .send(sluice_runtime::bus::Message::new(request).with_property("id", "c1"))
        .await
        .unwrap();
    let mut next = async || {
        let d = tokio::time::timeout(std::time::Duration::from_secs(10), responses.next())
            .await
            .expect("a record")
            .unwrap()
            .unwrap();
        let r = serde_json::from_slice::<TextCompletionResponse>(d.payload()).unwrap();
        d.ack();
        r
    };
    assert_eq!(next().await.response, "a");
    let gauge = || sample(&telemetry.render(), "sluice_llm_in_flight_requests", &[]);
    assert_eq!(gauge(), Some(1.0), "the call is in flight");
    // The processor's cancel listener subscribes beside its consume loop; a cancel sent
    // before it has is not seen, so send again until the answer ends.
    let cancels = bus.publisher("cancel").await.unwrap();
    let mut last = None;
    for _ in 0..50 {
        cancels.send(cancel::cancel_message("c1")).await.unwrap();
        let wait = std::time::Duration::from_millis(200);
        if let Ok(d) = tokio::time::timeout(wait, responses.next()).await {
            let d = d.unwrap().unwrap();
            last = Some(serde_json::from_slice::<TextCompletionResponse>(d.payload()).unwrap());
            d.ack();
            break;
        }
    }
    let last = last.expect("the cancelled record");
    assert!(last.end_of_stream);
    assert_eq!(last.error.unwrap().kind, ErrorKind::Cancelled);
    // The runtime drops the handler before it publishes the cancelled record.
    let text = telemetry.render();
    assert_eq!(gauge(), Some(0.0), "{text}");
    let requests = |outcome: &str| {
        sample(
            &text,
            "sluice_llm_requests_total",
            &[&format!("outcome=\"{outcome}\"")],
        )
    };
    assert_eq!(requests("cancelled"), Some(1.0), "{text}");
    assert_eq!(requests("error"), Some(0.0), "{text}");
    shutdown.cancel();
    let _ = task.await;
}

#[test]
fn requests_name_only_served_models_and_sane_settings() {
    let registry = Registry::new();
    let s = TextCompletionService::new(
        Arc::new(Answers::default()),
        RetryPolicy::default(),
        LlmMetrics::register(&registry).unwrap(),
    )
    .with_models(["second".to_owned(), "main".to_owned(), String::new()]);
    assert_eq!(s.models(), ["main", "second"]);
    let ok = |r: TextCompletionRequest| s.check(&r).is_ok();
    let base = TextCompletionRequest::default;
    assert!(ok(base()));
    for model in ["main", "second"] {
        let r = TextCompletionRequest {
            model: Some(model.into()),
            ..base()
        };
        assert!(ok(r.clone()));
        assert_eq!(s.labels(&r)[1], model);
    }
    let e = s
        .check(&TextCompletionRequest {
            model: Some("gpt-9".into()),
            ..base()
        })
        .unwrap_err();
    assert_eq!(e.kind, "invalid-request");
    assert!(e.message.contains("main, second"), "{}", e.message);
    for bad in [
        TextCompletionRequest {
            temperature: Some(2.5),
            ..base()
        },
        TextCompletionRequest {
            temperature: Some(f64::NAN),
            ..base()
        },
        TextCompletionRequest {
            max_tokens: Some(0),
            ..base()
        },
        TextCompletionRequest {
            messages: Some(vec![]),
            ..base()
        },
        TextCompletionRequest {
            stop: Some(vec![String::new()]),
            ..base()
        },
    ] {
        assert!(!ok(bad.clone()), "{bad:?}");
    }
}

/// A provider that does not call tools refuses a request that uses them, naming the
/// field and the provider, rather than answer as if there were none; and a request's
/// tool names and named choice are checked before any provider is called.
#[test]
fn tools_are_refused_where_the_provider_cannot_call_them() {
    use sluice_schema::{ChatMessage, ChatRole, Tool, ToolChoice};
    let s = TextCompletionService::new(
        Arc::new(Answers::default()),
        RetryPolicy::default(),
        LlmMetrics::register(&Registry::new()).unwrap(),
    );
    let tool = |name: &str| Tool {
        name: name.into(),
        description: None,
        parameters: sluice_schema::tools::no_parameters(),
        strict: None,
    };
    let with_tools = TextCompletionRequest {
        tools: Some(vec![tool("f")]),
        ..Default::default()
    };
    let e = s.check(&with_tools).unwrap_err();
    assert_eq!(e.kind, "invalid-request");
    assert!(
        e.message.contains("`tools`") && e.message.contains("(test,"),
        "{}",
        e.message
    );
    let mut result = ChatMessage::new(ChatRole::Tool, "42");
    result.tool_call_id = Some("c".into());
    let tool_turn = TextCompletionRequest {
        messages: Some(vec![result]),
        ..Default::default()
    };
    assert!(
        s.check(&tool_turn).is_err(),
        "a tool result needs tools too"
    );

    // A provider that calls tools: names and the named choice are checked.
    struct Tools(Answers);
    #[async_trait]
    impl Provider for Tools {
        fn name(&self) -> &'static str {
            "tools"
        }
        fn model(&self) -> &str {
            "main"
        }
        fn endpoint(&self) -> &str {
            "http://provider.test"
        }
        fn supports_streaming(&self) -> bool {
            true
        }
        fn supports_tools(&self) -> bool {
            true
        }
        async fn generate_stream(
            &self,
            request: &TextCompletionRequest,
        ) -> Result<crate::provider::ChunkStream, ProviderError> {
            self.0.generate_stream(request).await
        }
    }
    let s = TextCompletionService::new(
        Arc::new(Tools(Answers::default())),
        RetryPolicy::default(),
        LlmMetrics::register(&Registry::new()).unwrap(),
    );
    assert!(s.check(&with_tools).is_ok());
    assert!(s.check(&tool_turn).is_ok());
    for bad in [
        TextCompletionRequest {
            tools: Some(vec![tool("a b")]),
            ..Default::default()
        },
        TextCompletionRequest {
            tools: Some(vec![tool("f")]),
            tool_choice: Some(ToolChoice::Named { name: "g".into() }),
            ..Default::default()
        },
        TextCompletionRequest {
            tool_choice: Some(ToolChoice::Mode(sluice_schema::ToolMode::Required)),
            ..Default::default()
        },
        TextCompletionRequest {
            messages: Some(vec![ChatMessage::new(ChatRole::Tool, "no id")]),
            ..Default::default()
        },
    ] {
        assert!(s.check(&bad).is_err(), "{bad:?}");
    }
}

#[test]
fn finish_reasons_speak_one_vocabulary() {
    for (raw, word) in [
        ("stop", "stop"),
        ("end_turn", "stop"),
        ("STOP", "stop"),
        ("COMPLETE", "stop"),
        ("max_tokens", "length"),
        ("MAX_TOKENS", "length"),
        ("length", "length"),
        ("SAFETY", "content_filter"),
        ("tool_use", "tool_calls"),
        ("Weird", "weird"),
    ] {
        assert_eq!(finish_reason_word(raw), word, "{raw}");
    }
}
