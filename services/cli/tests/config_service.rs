//! `--config-service`: processors that learn their flows from TrustGraph's config service,
//! run as processes against the real broker and a stand-in config service speaking
//! TrustGraph's records (tests/src/fake_config.rs) on this test's own topics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::Sluice;
use serde_json::json;
use sluice_runtime::client::{Received, RequestClient};
use sluice_schema::{PromptRequest, PromptResponse, TextCompletionRequest};
use sluice_tests::{
    Broker, TextClient, eventually_value, fake_config::FakeConfigService, fake_openai::FakeOpenAi,
    free_port, scrape, text_client, unique_topic, value,
};

/// The whole text of one request's answer; panics on an error record.
async fn complete(client: &TextClient, request: TextCompletionRequest) -> (String, Vec<String>) {
    let mut stream = tokio::time::timeout(Duration::from_secs(60), client.request(&request))
        .await
        .unwrap()
        .unwrap();
    let (mut text, mut models) = (String::new(), Vec::new());
    while let Some(item) = tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("the answer kept coming")
    {
        if let Received::Record(r) = item.unwrap() {
            assert!(r.error.is_none(), "{r:?}");
            text.push_str(&r.response);
            models.extend(r.models.iter().map(|m| m.id.clone()));
            if r.end_of_stream {
                return (text, models);
            }
        }
    }
    panic!("the stream ended without a terminal record");
}

/// Polls `port`'s metrics until `name{labels}` equals `want`.
async fn until(process: &Sluice, port: u16, name: &str, labels: &[(&str, &str)], want: f64) {
    let now = eventually_value(port, name, labels, Duration::from_secs(30), |v| v == want).await;
    assert!(
        now == want,
        "{name}{labels:?} never reached {want}: {now}\n{}",
        process.stderr()
    );
}

fn flow(request: &str, response: &str, parameters: serde_json::Value) -> String {
    json!({"topics": {"request": request, "response": response}, "parameters": parameters})
        .to_string()
}

struct Topics {
    request: String,
    response: String,
    push: String,
}

fn config_topics(name: &str) -> Topics {
    Topics {
        request: unique_topic(&format!("{name}-config-req")),
        response: unique_topic(&format!("{name}-config-resp")),
        push: unique_topic(&format!("{name}-config-push")),
    }
}

fn config_args<'a>(topics: &'a Topics, broker: &'a Broker, metrics: &'a str) -> Vec<&'a str> {
    vec![
        "--config-service",
        "--config-request-topic",
        topics.request.as_str(),
        "--config-response-topic",
        topics.response.as_str(),
        "--config-push-topic",
        topics.push.as_str(),
        "--config-resync-secs",
        "2",
        "--pulsar-url",
        broker.url.as_str(),
        "--metrics-addr",
        metrics,
    ]
}

/// Starts `sluice ARGS --config-service` on this test's config topics; returns it with its
/// metrics port once its /readyz says ready.
async fn start(
    args: &[&str],
    topics: &Topics,
    broker: &Broker,
    env: &[(&str, &str)],
) -> (Sluice, u16) {
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let mut all = args.to_vec();
    all.extend(config_args(topics, broker, &metrics));
    let mut process = Sluice::spawn(
        &all,
        env,
        &[
            "SLUICE_CONFIG",
            "SLUICE_METRICS_ADDR",
            "SLUICE_TEMPLATES",
            "SLUICE_TOOLS",
        ],
    );
    process
        .ready(&format!("http://127.0.0.1:{port}/readyz"))
        .await;
    (process, port)
}

/// `sluice text-completion --config-service` against the fake OpenAI server.
async fn start_text_completion(
    fake: &FakeOpenAi,
    topics: &Topics,
    broker: &Broker,
) -> (Sluice, u16) {
    let base = fake.base_url();
    let args = [
        "text-completion",
        "--provider",
        "openai-compatible",
        "--base-url",
        base.as_str(),
        "--model",
        "normal",
    ];
    start(
        &args,
        topics,
        broker,
        &[("SLUICE_LLM_API_KEY", "k"), ("RUST_LOG", "info")],
    )
    .await
}

/// Polls `port`'s metrics until `name` (summed over its labels) reaches `least`.
async fn until_at_least(process: &Sluice, port: u16, name: &str, least: f64) {
    let now = eventually_value(port, name, &[], Duration::from_secs(10), |v| v >= least).await;
    assert!(
        now >= least,
        "{name} never reached {least}: {now}\n{}",
        process.stderr()
    );
}

#[tokio::test]
async fn text_completion_serves_the_flows_of_the_config_and_follows_its_changes() {
    sluice_runtime::install_crypto_provider();
    let broker = Broker::from_env().await;
    let bus = broker.bus().await;
    let fake = FakeOpenAi::start().await;
    let topics = config_topics("tc");
    let config =
        FakeConfigService::start(bus.clone(), &topics.request, &topics.response, &topics.push)
            .await;
    let (f1_req, f1_resp) = (unique_topic("tc-f1-req"), unique_topic("tc-f1-resp"));
    let (f2_req, f2_resp) = (unique_topic("tc-f2-req"), unique_topic("tc-f2-resp"));
    // A flow before the processor starts, one in TrustGraph's own bookkeeping workspace
    // (never served), and a flow of another processor.
    config
        .put(
            "ws1",
            "processor:text-completion",
            &[("f1", &flow(&f1_req, &f1_resp, json!({"model": "replay-3"})))],
        )
        .await;
    config
        .put(
            "__template__",
            "processor:text-completion",
            &[("t", &flow(&f1_req, &f1_resp, json!({})))],
        )
        .await;
    config
        .put(
            "ws1",
            "processor:prompt",
            &[("p", &flow(&f1_req, &f1_resp, json!({})))],
        )
        .await;

    let (process, port) = start_text_completion(&fake, &topics, &broker).await;
    until(
        &process,
        port,
        "sluice_config_flows",
        &[("processor", "text-completion")],
        1.0,
    )
    .await;

    // The flow's model answers requests that name none; list-models lists it first.
    let f1 = text_client(bus.clone(), &f1_req, &f1_resp).await;
    let (text, _) = complete(
        &f1,
        TextCompletionRequest {
            prompt: "flow one".into(),
            streaming: true,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(text, "flow one");
    assert_eq!(fake.calls("replay-3"), 1);
    let (_, models) = complete(
        &f1,
        TextCompletionRequest {
            operation: Some("list-models".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(models, ["replay-3", "normal"]);

    // A flow added later, in another workspace, with a temperature: served after the push.
    config
        .put(
            "ws2",
            "processor:text-completion",
            &[(
                "f2",
                &flow(
                    &f2_req,
                    &f2_resp,
                    json!({"model": "normal", "temperature": "0.5"}),
                ),
            )],
        )
        .await;
    let f2 = text_client(bus.clone(), &f2_req, &f2_resp).await;
    let (text, _) = complete(
        &f2,
        TextCompletionRequest {
            prompt: "flow two".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(text, "Hello world!");
    assert_eq!(fake.last_body()["temperature"], json!(0.5));
    until(
        &process,
        port,
        "sluice_config_flows",
        &[("processor", "text-completion")],
        2.0,
    )
    .await;

    // A removed flow stops; an unreadable definition is counted and served by nobody; a
    // change whose push was lost is picked up by the periodic read.
    config
        .delete("ws1", "processor:text-completion", "f1")
        .await;
    until(
        &process,
        port,
        "sluice_config_flows",
        &[("processor", "text-completion")],
        1.0,
    )
    .await;
    config
        .put(
            "ws2",
            "processor:text-completion",
            &[("broken", "{not json")],
        )
        .await;
    until_at_least(&process, port, "sluice_config_fetch_failures_total", 1.0).await;
    config.put_silently(
        "ws1",
        "processor:text-completion",
        "f1",
        &flow(&f1_req, &f1_resp, json!({"model": "replay-3"})),
    );
    until(
        &process,
        port,
        "sluice_config_flows",
        &[("processor", "text-completion")],
        2.0,
    )
    .await;
    let (text, _) = complete(
        &f1,
        TextCompletionRequest {
            prompt: "flow one again".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(text, "flow one again");
    // A changed definition (another model) takes effect: the flow restarts.
    config
        .put(
            "ws1",
            "processor:text-completion",
            &[("f1", &flow(&f1_req, &f1_resp, json!({"model": "normal"})))],
        )
        .await;
    let mut text = String::new();
    for _ in 0..100 {
        (text, _) = complete(
            &f1,
            TextCompletionRequest {
                prompt: "flow one changed".into(),
                ..Default::default()
            },
        )
        .await;
        if text == "Hello world!" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(text, "Hello world!", "the changed model answers");
    assert!(
        value(&scrape(port).await, "sluice_config_version", &[]) >= 5.0,
        "the applied version is exported"
    );

    f1.close().await;
    f2.close().await;
    let stopped = process.stop().await;
    assert!(stopped.status.success(), "{}", stopped.stderr);
    let log = format!("{}{}", stopped.stdout, stopped.stderr);
    assert!(
        !log.contains("{not json"),
        "an entry's value is never logged"
    );
}

#[tokio::test]
async fn prompt_takes_templates_and_text_completion_topics_from_the_config() {
    sluice_runtime::install_crypto_provider();
    let broker = Broker::from_env().await;
    let bus = broker.bus().await;
    let fake = FakeOpenAi::start().await;
    let topics = config_topics("pr");
    let config =
        FakeConfigService::start(bus.clone(), &topics.request, &topics.response, &topics.push)
            .await;
    // The text-completion flow and the prompt flow of one TrustGraph flow, both from config.
    let (tc_req, tc_resp) = (unique_topic("pr-tc-req"), unique_topic("pr-tc-resp"));
    let (p_req, p_resp) = (unique_topic("pr-p-req"), unique_topic("pr-p-resp"));
    config
        .put(
            "ws",
            "processor:text-completion",
            &[(
                "flow",
                &flow(&tc_req, &tc_resp, json!({"model": "replay-4"})),
            )],
        )
        .await;
    config
        .put(
            "ws",
            "prompt",
            &[
                ("system", "\"Be brief.\""),
                (
                    "template.greet",
                    r#"{"prompt": "Say hello to {{name}}.", "response-type": "text"}"#,
                ),
            ],
        )
        .await;
    let prompt_flow = json!({"topics": {"request": p_req, "response": p_resp,
        "text-completion-request": tc_req, "text-completion-response": tc_resp},
        "parameters": {}})
    .to_string();
    config
        .put("ws", "processor:prompt", &[("flow", &prompt_flow)])
        .await;

    let (tc, _) = start_text_completion(&fake, &topics, &broker).await;
    let (prompt, p_port) = start(
        &["prompt", "--no-builtin-templates"],
        &topics,
        &broker,
        &[("RUST_LOG", "info")],
    )
    .await;
    until(
        &prompt,
        p_port,
        "sluice_config_flows",
        &[("processor", "prompt")],
        1.0,
    )
    .await;

    let client: RequestClient<PromptRequest, PromptResponse> = RequestClient::start(
        bus.clone(),
        sluice_runtime::client::ClientConfig::new("prompt", &p_req, &p_resp),
        None,
    )
    .await
    .unwrap();
    let ask = |name: &str| PromptRequest {
        id: "greet".into(),
        terms: [("name".to_owned(), json!(name).to_string())].into(),
        streaming: true,
    };
    let answer = |request: PromptRequest| {
        let client = &client;
        async move {
            let mut stream = client.request(&request).await.unwrap();
            let mut text = String::new();
            while let Some(item) = stream.next().await {
                if let Received::Record(r) = item.unwrap() {
                    assert!(r.error.is_none(), "{r:?}");
                    text.push_str(r.text.as_deref().unwrap_or_default());
                    if r.end_of_stream {
                        return text;
                    }
                }
            }
            panic!("no terminal record");
        }
    };
    assert_eq!(answer(ask("Ada")).await, "Say hello to Ada.");
    assert_eq!(fake.last_body()["messages"][0]["content"], "Be brief.");

    // A changed template is used by the next request, live.
    config
        .put(
            "ws",
            "prompt",
            &[(
                "template.greet",
                r#"{"prompt": "Greet {{name}} warmly.", "response-type": "text"}"#,
            )],
        )
        .await;
    let mut changed = String::new();
    for _ in 0..100 {
        changed = answer(ask("Bo")).await;
        if changed == "Greet Bo warmly." {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(changed, "Greet Bo warmly.");
    // A template that does not compile keeps the previous set and is counted.
    config
        .put(
            "ws",
            "prompt",
            &[("template.greet", r#"{"prompt": "Broken {% if %}"}"#)],
        )
        .await;
    until_at_least(&prompt, p_port, "sluice_config_fetch_failures_total", 1.0).await;
    assert_eq!(answer(ask("Cy")).await, "Greet Cy warmly.");

    client.close().await;
    for process in [prompt, tc] {
        let stopped = process.stop().await;
        assert!(stopped.status.success(), "{}", stopped.stderr);
    }
}

#[tokio::test]
async fn agent_takes_tools_from_the_config_and_restarts_its_flows_when_they_change() {
    use sluice_schema::{AgentMessageType, AgentRequest, AgentResponse};
    sluice_runtime::install_crypto_provider();
    let broker = Broker::from_env().await;
    let bus = broker.bus().await;
    let fake = FakeOpenAi::start().await;
    let topics = config_topics("ag");
    let config =
        FakeConfigService::start(bus.clone(), &topics.request, &topics.response, &topics.push)
            .await;
    let (tc_req, tc_resp) = (unique_topic("ag-tc-req"), unique_topic("ag-tc-resp"));
    let (a_req, a_resp) = (unique_topic("ag-a-req"), unique_topic("ag-a-resp"));
    config
        .put(
            "ws",
            "processor:text-completion",
            &[(
                "flow",
                &flow(&tc_req, &tc_resp, json!({"model": "react-ask"})),
            )],
        )
        .await;
    // TrustGraph's tool shape; a type sluice does not serve is left out and counted.
    config
        .put(
            "ws",
            "tool",
            &[
                (
                    "ask",
                    r#"{"type": "text-completion", "name": "ask", "description": "Asks a model.",
                        "arguments": [{"name": "question", "type": "string",
                                       "description": "The question."}]}"#,
                ),
                (
                    "kq",
                    r#"{"type": "knowledge-query", "name": "kq", "description": "Graph RAG."}"#,
                ),
            ],
        )
        .await;
    let agent_flow = json!({"topics": {"request": a_req, "response": a_resp,
        "text-completion-request": tc_req, "text-completion-response": tc_resp,
        "prompt-request": "request:tg:prompt", "prompt-response": "response:tg:prompt"},
        "parameters": {}})
    .to_string();
    config
        .put("ws", "processor:agent-manager", &[("flow", &agent_flow)])
        .await;

    let (tc, _) = start_text_completion(&fake, &topics, &broker).await;
    let (agent, a_port) = start(&["agent"], &topics, &broker, &[("RUST_LOG", "info")]).await;
    until(
        &agent,
        a_port,
        "sluice_config_flows",
        &[("processor", "agent-manager")],
        1.0,
    )
    .await;
    assert!(
        value(
            &scrape(a_port).await,
            "sluice_config_fetch_failures_total",
            &[]
        ) >= 1.0
    );

    let client: RequestClient<AgentRequest, AgentResponse> = RequestClient::start(
        bus.clone(),
        sluice_runtime::client::ClientConfig::new("agent", &a_req, &a_resp),
        None,
    )
    .await
    .unwrap();
    let dialog = || async {
        let request = AgentRequest {
            question: "What colour?".into(),
            streaming: true,
            ..Default::default()
        };
        let mut stream = client.request(&request).await.unwrap();
        let mut answer = String::new();
        while let Some(item) = stream.next().await {
            if let Received::Record(r) = item.unwrap() {
                if r.message_type == AgentMessageType::Answer {
                    answer.push_str(&r.content);
                }
                if r.end_of_dialog {
                    return answer;
                }
            }
        }
        panic!("no end of dialog");
    };
    assert_eq!(dialog().await, "The tool said: Echo: Name a colour.");

    // The tool goes away: the flow restarts with no tool, and the model's call of `ask`
    // now gets the agent's "no such tool" observation instead of the tool's answer.
    config.delete("ws", "tool", "ask").await;
    let mut answer = String::new();
    for _ in 0..50 {
        answer = dialog().await;
        if !answer.contains("Echo:") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        answer.starts_with("The tool said:") && !answer.contains("Echo:"),
        "{answer}"
    );

    client.close().await;
    for process in [agent, tc] {
        let stopped = process.stop().await;
        assert!(stopped.status.success(), "{}", stopped.stderr);
    }
}

/// Meta-routing's choices are the workspace's `agent-task-type` and `agent-pattern` entries:
/// with two task types configured, a question with no pattern is routed by the model (the
/// fake's `plan` model chooses `research`, then `plan-then-execute`) and runs as a plan.
#[tokio::test]
async fn agent_routes_by_the_workspaces_task_types_and_patterns() {
    use sluice_schema::{AgentMessageType, AgentRequest, AgentResponse};
    sluice_runtime::install_crypto_provider();
    let broker = Broker::from_env().await;
    let bus = broker.bus().await;
    let fake = FakeOpenAi::start().await;
    let topics = config_topics("rt");
    let config =
        FakeConfigService::start(bus.clone(), &topics.request, &topics.response, &topics.push)
            .await;
    let (tc_req, tc_resp) = (unique_topic("rt-tc-req"), unique_topic("rt-tc-resp"));
    let (a_req, a_resp) = (unique_topic("rt-a-req"), unique_topic("rt-a-resp"));
    config
        .put(
            "ws",
            "processor:text-completion",
            &[("flow", &flow(&tc_req, &tc_resp, json!({"model": "plan"})))],
        )
        .await;
    config
        .put(
            "ws",
            "agent-task-type",
            &[
                (
                    "research",
                    r#"{"name": "research", "description": "Several facts",
                        "valid_patterns": ["react", "plan-then-execute"]}"#,
                ),
                (
                    "chat",
                    r#"{"name": "chat", "description": "Small talk", "valid_patterns": ["react"]}"#,
                ),
            ],
        )
        .await;
    config
        .put(
            "ws",
            "agent-pattern",
            &[
                (
                    "react",
                    r#"{"name": "react", "description": "Reason and act"}"#,
                ),
                (
                    "plan-then-execute",
                    r#"{"name": "plan-then-execute", "description": "Plan, then run each step"}"#,
                ),
            ],
        )
        .await;
    let agent_flow = json!({"topics": {"request": a_req, "response": a_resp,
        "text-completion-request": tc_req, "text-completion-response": tc_resp,
        "prompt-request": "request:tg:prompt", "prompt-response": "response:tg:prompt"},
        "parameters": {}})
    .to_string();
    config
        .put("ws", "processor:agent-manager", &[("flow", &agent_flow)])
        .await;

    let (tc, _) = start_text_completion(&fake, &topics, &broker).await;
    let (agent, a_port) = start(&["agent"], &topics, &broker, &[]).await;
    until(
        &agent,
        a_port,
        "sluice_config_flows",
        &[("processor", "agent-manager")],
        1.0,
    )
    .await;
    let client: RequestClient<AgentRequest, AgentResponse> = RequestClient::start(
        bus.clone(),
        sluice_runtime::client::ClientConfig::new("agent", &a_req, &a_resp),
        None,
    )
    .await
    .unwrap();
    let request = AgentRequest {
        question: "What is 2 + 3, and the capital of France?".into(),
        streaming: true,
        ..Default::default()
    };
    let records = client.call(&request).await.unwrap();
    let thoughts: Vec<_> = records
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Thought)
        .map(|r| r.content.as_str())
        .collect();
    assert_eq!(
        thoughts.first().copied(),
        Some("Created plan with 2 steps"),
        "{records:#?}"
    );
    // The workspace has no tools: each step observes that its tool is not there.
    let observations: Vec<_> = records
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Observation)
        .map(|r| r.content.as_str())
        .collect();
    assert_eq!(
        observations,
        [
            "Error: tool 'add' not found",
            "Error: tool 'lookup' not found"
        ]
    );
    let last = records.last().unwrap();
    assert!(last.end_of_dialog && last.error.is_none(), "{last:?}");
    // Two routing calls, the plan, two steps, the synthesis.
    assert_eq!(fake.calls("plan"), 6);

    client.close().await;
    for process in [agent, tc] {
        let stopped = process.stop().await;
        assert!(stopped.status.success(), "{}", stopped.stderr);
    }
}

/// A supervisor dialog in an agent flow of the config service: the flow's agent runs the
/// fan-in of its own request topic (`<request topic>-fanin`), and the dialog ends with one
/// answer from its four subagents' results.
#[tokio::test]
async fn an_agent_flow_runs_the_supervisor_and_its_fan_in() {
    use sluice_schema::{AgentMessageType, AgentRequest, AgentResponse};
    sluice_runtime::install_crypto_provider();
    let broker = Broker::from_env().await;
    let bus = broker.bus().await;
    let fake = FakeOpenAi::start().await;
    let topics = config_topics("sv");
    let config =
        FakeConfigService::start(bus.clone(), &topics.request, &topics.response, &topics.push)
            .await;
    let (tc_req, tc_resp) = (unique_topic("sv-tc-req"), unique_topic("sv-tc-resp"));
    let (a_req, a_resp) = (unique_topic("sv-a-req"), unique_topic("sv-a-resp"));
    config
        .put(
            "ws",
            "processor:text-completion",
            &[(
                "flow",
                &flow(&tc_req, &tc_resp, json!({"model": "supervisor"})),
            )],
        )
        .await;
    let agent_flow = json!({"topics": {"request": a_req, "response": a_resp,
        "text-completion-request": tc_req, "text-completion-response": tc_resp,
        "prompt-request": "request:tg:prompt", "prompt-response": "response:tg:prompt"},
        "parameters": {}})
    .to_string();
    config
        .put("ws", "processor:agent-manager", &[("flow", &agent_flow)])
        .await;
    let (tc, _) = start_text_completion(&fake, &topics, &broker).await;
    let (agent, a_port) = start(&["agent"], &topics, &broker, &[]).await;
    until(
        &agent,
        a_port,
        "sluice_config_flows",
        &[("processor", "agent-manager")],
        1.0,
    )
    .await;
    let client: RequestClient<AgentRequest, AgentResponse> = RequestClient::start(
        bus.clone(),
        sluice_runtime::client::ClientConfig::new("agent", &a_req, &a_resp),
        None,
    )
    .await
    .unwrap();
    let request = AgentRequest {
        question: "Tell me about four things.".into(),
        pattern: Some("supervisor".into()),
        streaming: true,
        ..Default::default()
    };
    let records = client.call(&request).await.unwrap();
    assert!(records.iter().all(|r| r.error.is_none()), "{records:#?}");
    let answer: String = records
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Answer)
        .map(|r| r.content.as_str())
        .collect();
    for goal in ["alpha", "beta", "gamma", "delta"] {
        assert!(answer.contains(&format!("result-{goal}")), "{answer}");
    }
    assert_eq!(records.iter().filter(|r| r.end_of_dialog).count(), 1);
    client.close().await;
    for process in [agent, tc] {
        let stopped = process.stop().await;
        assert!(stopped.status.success(), "{}", stopped.stderr);
    }
}
