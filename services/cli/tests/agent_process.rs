//! `sluice agent` as processes, killed for real: the replica handling a dialog gets SIGKILL in
//! the middle of its second iteration (its model call held open by the fake provider), and a
//! second replica on the same subscription finishes the dialog. The in-process test of the
//! same case (tests/tests/agent.rs) stops a task; this one kills an operating-system process,
//! with whatever it held in memory and on its broker connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::Sluice;
use sluice_runtime::client::{ClientConfig, Received, RequestClient, ResponseStream};
use sluice_schema::{AgentMessageType, AgentRequest, AgentResponse};
use sluice_tests::{
    Broker, fake_openai::FakeOpenAi, free_port, mcp_server, scrape, unique_topic, value,
};

struct Topics {
    agent: [String; 3],
    llm: [String; 3],
}

fn bus_args(broker: &Broker, metrics: &str) -> Vec<String> {
    [
        "--pulsar-url",
        broker.url.as_str(),
        "--pulsar-admin-url",
        broker.admin_url.as_str(),
        "--metrics-addr",
        metrics,
        "--drain-grace-secs",
        "5",
    ]
    .map(str::to_owned)
    .to_vec()
}

async fn spawn(args: Vec<String>) -> (Sluice, u16) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let port: u16 = args
        .iter()
        .position(|a| *a == "--metrics-addr")
        .and_then(|i| args[i + 1].rsplit(':').next()?.parse().ok())
        .unwrap();
    let mut process = Sluice::spawn(
        &args,
        &[("SLUICE_LLM_API_KEY", "k"), ("RUST_LOG", "info")],
        &["SLUICE_CONFIG", "SLUICE_METRICS_ADDR", "SLUICE_TOOLS"],
    );
    process
        .ready(&format!("http://127.0.0.1:{port}/readyz"))
        .await;
    (process, port)
}

async fn start_agent(broker: &Broker, t: &Topics, tools: &str) -> (Sluice, u16) {
    start_agent_with(broker, t, tools, &[]).await
}

/// The same, with `extra` options.
async fn start_agent_with(
    broker: &Broker,
    t: &Topics,
    tools: &str,
    extra: &[&str],
) -> (Sluice, u16) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args: Vec<String> = [
        "agent",
        "--request-topic",
        &t.agent[0],
        "--response-topic",
        &t.agent[1],
        "--cancel-topic",
        &t.agent[2],
        "--llm-request-topic",
        &t.llm[0],
        "--llm-response-topic",
        &t.llm[1],
        "--llm-cancel-topic",
        &t.llm[2],
        "--tools",
        tools,
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args.extend(bus_args(broker, &metrics));
    spawn(args).await
}

/// A request, response and cancel topic, unique to this run.
fn three(name: &str) -> [String; 3] {
    [
        unique_topic(&format!("{name}-req")),
        unique_topic(&format!("{name}-resp")),
        unique_topic(&format!("{name}-cancel")),
    ]
}

/// text-completion on `t.llm`, answering with the fake's `model`.
async fn start_text_completion(
    broker: &Broker,
    fake: &FakeOpenAi,
    t: &Topics,
    model: &str,
) -> Sluice {
    let base = fake.base_url();
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args: Vec<String> = [
        "text-completion",
        "--provider",
        "openai-compatible",
        "--base-url",
        base.as_str(),
        "--model",
        model,
        "--request-topic",
        &t.llm[0],
        "--response-topic",
        &t.llm[1],
        "--cancel-topic",
        &t.llm[2],
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(bus_args(broker, &metrics));
    spawn(args).await.0
}

async fn next(stream: &mut ResponseStream<AgentResponse>) -> Option<Received<AgentResponse>> {
    tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("the dialog goes on")
        .map(|item| item.unwrap())
}

fn is(item: &Received<AgentResponse>, kind: AgentMessageType) -> bool {
    matches!(item, Received::Record(r) if r.message_type == kind)
}

#[tokio::test]
async fn an_agent_process_killed_mid_dialog_loses_nothing_and_repeats_only_its_iteration() {
    sluice_runtime::install_crypto_provider();
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let mcp = mcp_server::start(None).await;
    let t = Topics {
        agent: three("agent-kill"),
        llm: three("agent-kill-tc"),
    };
    let dir = std::env::temp_dir().join(unique_topic("agent-kill").replace([':', '/'], "-"));
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    std::fs::write(
        &tools,
        format!(
            r#"{{"tools": [{{"name": "add", "description": "Adds two numbers", "type": "mcp",
                "url": "{}", "arguments": [{{"name": "a", "type": "number"}},
                {{"name": "b", "type": "number"}}]}}]}}"#,
            mcp.url()
        ),
    )
    .unwrap();
    let tools = tools.display().to_string();

    // The model: one tool call (add 2 and 3), then, in the second iteration, a thought and
    // the final answer held behind the fake's gate.
    let text_completion = start_text_completion(&broker, &fake, &t, "react-gated").await;
    let (doomed, doomed_port) = start_agent(&broker, &t, &tools).await;

    let client: RequestClient<AgentRequest, AgentResponse> = RequestClient::start(
        broker.bus().await,
        ClientConfig::new("agent", &t.agent[0], &t.agent[1]),
        None,
    )
    .await
    .unwrap();
    let request = AgentRequest {
        question: "What is 2 + 3?".into(),
        streaming: true,
        ..AgentRequest::default()
    };
    let mut stream = client.request(&request).await.unwrap();
    let mut items = Vec::new();
    // Up to the second iteration's first thought: its model call is now held open.
    loop {
        let item = next(&mut stream).await.expect("the dialog ended early");
        let second_thought = items.iter().any(|i| is(i, AgentMessageType::Observation))
            && is(&item, AgentMessageType::Thought);
        items.push(item);
        if second_thought {
            break;
        }
    }
    assert_eq!(mcp.calls(), 1, "the first iteration called the tool once");
    let (survivor, survivor_port) = start_agent(&broker, &t, &tools).await;
    doomed.signal("KILL");

    // The broker hands the second iteration to the survivor: the client sees the restart,
    // then the iteration again up to the gate.
    loop {
        let item = next(&mut stream).await.expect("the dialog ended early");
        let restarted = items.iter().any(|i| matches!(i, Received::Restarted));
        let thought = is(&item, AgentMessageType::Thought);
        items.push(item);
        if restarted && thought {
            break;
        }
    }
    // The abandoned model call of the killed replica and the survivor's repeat.
    fake.open_gate();
    fake.open_gate();
    while let Some(item) = next(&mut stream).await {
        items.push(item);
    }
    let after: Vec<AgentResponse> = items
        .iter()
        .skip_while(|i| !matches!(i, Received::Restarted))
        .filter_map(|i| match i {
            Received::Record(r) => Some(r.clone()),
            Received::Restarted => None,
        })
        .collect();
    let answer: String = after
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Answer)
        .map(|r| r.content.as_str())
        .collect();
    assert_eq!(answer, "The sum is 5.", "{items:#?}");
    assert_eq!(
        after.iter().filter(|r| r.end_of_dialog).count(),
        1,
        "one end of the dialog: {after:#?}"
    );
    assert!(
        after
            .last()
            .is_some_and(|r| r.end_of_dialog && r.error.is_none())
    );
    // Only the iteration in flight ran again: no second tool call.
    assert_eq!(mcp.calls(), 1, "the first iteration was not redone");
    let survived = scrape(survivor_port).await;
    assert_eq!(
        value(
            &survived,
            "sluice_agent_dialogs_total",
            &[("outcome", "answer")]
        ),
        1.0,
        "{survived}"
    );
    assert_eq!(
        value(&survived, "sluice_agent_tool_calls_total", &[]),
        0.0,
        "the survivor called no tool"
    );
    // The killed process is gone, and did not answer.
    assert!(
        reqwest::get(format!("http://127.0.0.1:{doomed_port}/metrics"))
            .await
            .is_err(),
        "the killed replica still serves metrics"
    );

    client.close().await;
    let stopped = survivor.stop().await;
    assert!(stopped.status.success(), "{}", stopped.stderr);
    text_completion.stop().await;
}

/// A prompt tool's call that the agent abandons (here: past `--tool-timeout-secs`, no prompt
/// processor answering) is cancelled on the prompt service's cancel topic as configured
/// (`--prompt-cancel-topic`). It went to `notify:tg:prompt-cancel` whatever the topics were
/// (found in review of the cluster soak): a prompt processor in another topicspace, or on
/// a cluster whose roles may not publish there, never heard of it and ran to the end.
#[tokio::test]
async fn an_abandoned_prompt_tool_call_is_cancelled_on_the_configured_prompt_cancel_topic() {
    sluice_runtime::install_crypto_provider();
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let t = Topics {
        agent: three("agent-pcancel"),
        llm: three("agent-pcancel-tc"),
    };
    let prompt = three("agent-pcancel-prompt");
    let dir = std::env::temp_dir().join(unique_topic("agent-pcancel").replace([':', '/'], "-"));
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    std::fs::write(
        &tools,
        r#"{"tools": [{"name": "facts", "description": "Facts about a topic", "type": "prompt",
            "template": "facts", "arguments": [{"name": "topic", "type": "string"}]}]}"#,
    )
    .unwrap();

    // What reaches the prompt service's topics: its request (nobody answers it) and the
    // cancel.
    let bus = broker.bus().await;
    let mut requests = bus
        .subscribe(
            &prompt[0],
            "test-requests",
            sluice_runtime::bus::SubscribeOptions::exclusive(16),
        )
        .await
        .unwrap();
    let mut cancels = bus
        .subscribe(
            &prompt[2],
            "test-cancels",
            sluice_runtime::bus::SubscribeOptions::exclusive(16),
        )
        .await
        .unwrap();

    let text_completion = start_text_completion(&broker, &fake, &t, "react-facts").await;
    let tools = tools.display().to_string();
    let (agent, _) = start_agent_with(
        &broker,
        &t,
        &tools,
        &[
            "--prompt-request-topic",
            &prompt[0],
            "--prompt-response-topic",
            &prompt[1],
            "--prompt-cancel-topic",
            &prompt[2],
            "--tool-timeout-secs",
            "2",
        ],
    )
    .await;

    let client: RequestClient<AgentRequest, AgentResponse> = RequestClient::start(
        broker.bus().await,
        ClientConfig::new("agent", &t.agent[0], &t.agent[1]),
        None,
    )
    .await
    .unwrap();
    let request = AgentRequest {
        question: "Tell me about otters.".into(),
        streaming: true,
        ..AgentRequest::default()
    };
    let mut stream = client.request(&request).await.unwrap();

    let asked = tokio::time::timeout(Duration::from_secs(60), requests.next())
        .await
        .expect("the agent did not call the prompt tool")
        .expect("the request subscription ended")
        .unwrap();
    let id = asked
        .property(sluice_schema::properties::ID)
        .expect("a prompt request without an id")
        .to_owned();
    asked.ack();
    let cancel = tokio::time::timeout(Duration::from_secs(30), cancels.next())
        .await
        .expect("no cancel on the configured prompt cancel topic after the tool timed out")
        .expect("the cancel subscription ended")
        .unwrap();
    assert_eq!(
        cancel.property(sluice_schema::properties::ID),
        Some(id.as_str()),
        "the cancel names the abandoned prompt request"
    );
    cancel.ack();
    // The dialog itself goes on: the timeout is the tool's observation, and it ends.
    while let Some(item) = next(&mut stream).await {
        if matches!(&item, Received::Record(r) if r.end_of_dialog) {
            break;
        }
    }

    client.close().await;
    requests.close().await;
    cancels.close().await;
    agent.stop().await;
    text_completion.stop().await;
}
