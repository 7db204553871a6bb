//! The supervisor pattern and its fan-in on the real broker, across processes: three
//! `sluice agent` processes on one request subscription, a scripted model behind a
//! text-completion processor. A supervisor dialog fans out four subagents; the replica that
//! holds the fan-in (and the supervisor's, if another) is SIGKILLed after the fan-out, with
//! three completions held unacked and the fourth subagent held back by the model. The dialog
//! still ends with one answer synthesised from all four results (the scripted model echoes
//! what it was given), and nothing is answered twice.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, process::Stdio, time::Duration};

use sluice_runtime::{
    client::{ClientConfig, Received, RequestClient},
    secret::Secret,
};
use sluice_schema::{AgentMessageType, AgentRequest, AgentResponse};
use sluice_tests::{
    Broker, RunningProcessor, echo_config, eventually_every, fake_openai::FakeOpenAi, free_port,
    init_logging, metrics_text, openai_service, process, unique_topic,
};
use sluice_text_completion::providers::openai::{Dialect, OpenAiConfig};
use tokio::process::{Child, Command};

/// The topics of one run.
struct Topics {
    agent: (String, String, String),
    llm: (String, String, String),
    fanin: String,
}

/// One `sluice agent` process.
struct Replica {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Replica {
    async fn start(broker: &Broker, t: &Topics, name: &str) -> Replica {
        let port = free_port();
        let log = std::env::temp_dir().join(format!(
            "sluice-supervisor-{name}-{}.log",
            uuid::Uuid::new_v4().simple()
        ));
        let file = std::fs::File::create(&log).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "agent",
                "--pulsar-url",
                &broker.url,
                "--request-topic",
                &t.agent.0,
                "--response-topic",
                &t.agent.1,
                "--cancel-topic",
                &t.agent.2,
                "--llm-request-topic",
                &t.llm.0,
                "--llm-response-topic",
                &t.llm.1,
                "--llm-cancel-topic",
                &t.llm.2,
                "--fanin-topic",
                &t.fanin,
                "--metrics-addr",
                &format!("127.0.0.1:{port}"),
                "--drain-grace-secs",
                "2",
            ])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}/readyz");
        if let Err(e) = process::ready(&mut child, &url, Duration::from_secs(60)).await {
            panic!(
                "agent {name} {e}: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        Replica { child, port, log }
    }

    async fn fanin(&self, event: &str) -> f64 {
        let text = metrics_text::scrape(self.port).await;
        metrics_text::value(&text, "sluice_agent_fanin_total", &[("event", event)])
    }

    fn kill(&mut self) {
        let pid = self.child.id().unwrap();
        assert!(process::signal(pid, "KILL"), "SIGKILL {pid}");
    }
}

fn triple(name: &str) -> (String, String, String) {
    (
        unique_topic(&format!("{name}-req")),
        unique_topic(&format!("{name}-resp")),
        unique_topic(&format!("{name}-cancel")),
    )
}

/// As [`triple`], non-persistent: the request and response topics of TrustGraph's mapping.
fn non_persistent_triple(name: &str) -> (String, String, String) {
    let (request, response, cancel) = triple(name);
    let np = |t: String| t.replacen("persistent://", "non-persistent://", 1);
    (np(request), np(response), np(cancel))
}

/// Reads the dialog's `stream` up to the decomposition's thought (four goals), which the
/// fan-out follows.
async fn until_decomposed(
    stream: &mut sluice_runtime::client::ResponseStream<AgentResponse>,
) -> Vec<Received<AgentResponse>> {
    let mut items = Vec::new();
    loop {
        let item = tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await
            .expect("the dialog goes on")
            .expect("the dialog goes on")
            .unwrap();
        let decomposed = matches!(&item, Received::Record(r)
            if r.message_type == AgentMessageType::Thought && r.content.starts_with("Decomposed into 4 sub-goals"));
        items.push(item);
        if decomposed {
            return items;
        }
    }
}

/// The dialog ended once, never restarted (nothing of it was in flight on a killed replica),
/// without an error, and its answer holds every subagent's result (the scripted model echoes
/// what the synthesis was given).
fn assert_one_answer_from_every_subagent(items: &[Received<AgentResponse>]) {
    assert!(
        !items.iter().any(|i| matches!(i, Received::Restarted)),
        "the dialog never restarted: {items:#?}"
    );
    let records: Vec<&AgentResponse> = items
        .iter()
        .filter_map(|i| match i {
            Received::Record(r) => Some(r),
            Received::Restarted => None,
        })
        .collect();
    assert!(records.iter().all(|r| r.error.is_none()), "{records:#?}");
    assert_eq!(
        records.iter().filter(|r| r.end_of_dialog).count(),
        1,
        "one end: {records:#?}"
    );
    let answer: String = records
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Answer)
        .map(|r| r.content.as_str())
        .collect();
    for goal in ["alpha", "beta", "gamma", "delta"] {
        assert!(
            answer.contains(&format!("result-{goal}")),
            "every subagent's result in the synthesis: {answer}"
        );
    }
}

/// See the module's documentation.
#[tokio::test]
async fn a_supervisor_dialog_survives_the_sigkill_of_its_fan_in_holder() {
    init_logging();
    let broker = Broker::from_env().await;
    let topics = Topics {
        agent: triple("sup-agent"),
        llm: triple("sup-tc"),
        fanin: unique_topic("sup-fanin"),
    };
    let fake = FakeOpenAi::start().await;
    let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), "supervisor-held");
    config.api_key = Some(Secret::new("sk-test"));
    let llm = RunningProcessor::start(
        broker.bus().await,
        echo_config(&topics.llm.0, &topics.llm.1, 64),
        openai_service(config),
    )
    .await;
    let mut replicas = Vec::new();
    for name in ["a", "b", "c"] {
        replicas.push(Replica::start(&broker, &topics, name).await);
    }
    let logs: Vec<String> = replicas
        .iter()
        .map(|r| r.log.display().to_string())
        .collect();
    eprintln!("agent logs: {logs:?}");
    let client: RequestClient<AgentRequest, AgentResponse> = RequestClient::start(
        broker.bus().await,
        ClientConfig::new("agent", &topics.agent.0, &topics.agent.1),
        None,
    )
    .await
    .unwrap();
    let request = AgentRequest {
        question: "Tell me about four things.".into(),
        pattern: Some("supervisor".into()),
        streaming: true,
        ..AgentRequest::default()
    };
    let mut stream = client.request(&request).await.unwrap();
    // Up to the decomposition's thought: the fan-out follows it.
    let mut items = until_decomposed(&mut stream).await;
    // The holder has three completions held (the fourth subagent's model is held back).
    let mut holder = None;
    for (i, r) in replicas.iter().enumerate() {
        if r.fanin("takeover").await >= 1.0 {
            holder = Some(i);
        }
    }
    let holder = holder.expect("a replica holds the fan-in");
    let held = eventually_every(
        Duration::from_millis(100),
        Duration::from_secs(60),
        async || replicas[holder].fanin("completion").await,
        |n| *n >= 3.0,
    )
    .await;
    assert_eq!(held, 3.0, "three completions held, the fourth not back");
    let mut doomed = vec![holder];
    for (i, r) in replicas.iter().enumerate() {
        if i != holder && r.fanin("fanout").await >= 1.0 {
            doomed.push(i);
        }
    }
    for &i in &doomed {
        replicas[i].kill();
        let _ = replicas[i].child.wait().await;
    }
    eprintln!("killed replicas {doomed:?} (the fan-in's holder first)");
    fake.release_held();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("the dialog goes on")
    {
        items.push(item.unwrap());
    }
    assert_one_answer_from_every_subagent(&items);
    // A survivor took the fan-in over and joined it once; nobody else joined.
    let survivors: Vec<usize> = (0..replicas.len())
        .filter(|i| !doomed.contains(i))
        .collect();
    let mut joins = 0.0;
    let mut takeovers = 0.0;
    for &i in &survivors {
        joins += replicas[i].fanin("join-complete").await;
        joins += replicas[i].fanin("join-deadline").await;
        takeovers += replicas[i].fanin("takeover").await;
    }
    assert_eq!(joins, 1.0, "one join");
    assert_eq!(takeovers, 1.0, "one survivor took the fan-in over");
    for &i in &survivors {
        process::terminate(&mut replicas[i].child, Duration::from_secs(20)).await;
    }
    client.close().await;
    llm.stop().await;
}

/// On TrustGraph's mapping (non-persistent request and response topics; the fan-in topic stays
/// persistent): the caller reads no record while the subagents run, and its client's loss
/// detection, which on such topics ends a stream no processor lists, must not end the dialog
/// during a fan-out that outlasts its windows (a request unlisted for `UNLISTED_GRACE`, a
/// listing processor silent for `SILENT_AFTER`). The fourth subagent is held that long; the
/// dialog then ends with one answer from all four results, no loss, no restart.
#[tokio::test]
async fn a_supervisor_dialog_on_trustgraphs_mapping_outlasts_the_clients_loss_windows() {
    use sluice_runtime::sync::{SILENT_AFTER, UNLISTED_GRACE};
    init_logging();
    let broker = Broker::from_env().await;
    let topics = Topics {
        agent: non_persistent_triple("sup-np-agent"),
        llm: non_persistent_triple("sup-np-tc"),
        fanin: unique_topic("sup-np-fanin"),
    };
    let fake = FakeOpenAi::start().await;
    let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), "supervisor-held");
    config.api_key = Some(Secret::new("sk-test"));
    let llm = RunningProcessor::start(
        broker.bus().await,
        echo_config(&topics.llm.0, &topics.llm.1, 64),
        openai_service(config),
    )
    .await;
    let mut replicas = Vec::new();
    for name in ["np-a", "np-b"] {
        replicas.push(Replica::start(&broker, &topics, name).await);
    }
    let client: RequestClient<AgentRequest, AgentResponse> = RequestClient::start(
        broker.bus().await,
        ClientConfig::new("agent", &topics.agent.0, &topics.agent.1),
        None,
    )
    .await
    .unwrap();
    let request = AgentRequest {
        question: "Tell me about four things.".into(),
        pattern: Some("supervisor".into()),
        streaming: true,
        ..AgentRequest::default()
    };
    let mut stream = client.request(&request).await.unwrap();
    // Up to the decomposition's thought: the fan-out follows it.
    let mut items = until_decomposed(&mut stream).await;
    let completions = async || {
        let mut n = 0.0;
        for r in &replicas {
            n += r.fanin("completion").await;
        }
        n
    };
    let held = eventually_every(
        Duration::from_millis(100),
        Duration::from_secs(60),
        completions,
        |n| *n >= 3.0,
    )
    .await;
    assert_eq!(held, 3.0, "three completions held, the fourth not back");
    // The length of the scenario, not a synchronisation: the fan-out outlasts both of the
    // client's loss windows while the caller receives nothing.
    tokio::time::sleep(UNLISTED_GRACE + SILENT_AFTER + Duration::from_secs(2)).await;
    fake.release_held();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("the dialog goes on")
    {
        items.push(item.unwrap());
    }
    assert_one_answer_from_every_subagent(&items);
    for r in &mut replicas {
        process::terminate(&mut r.child, Duration::from_secs(20)).await;
    }
    client.close().await;
    llm.stop().await;
}

/// The same dialog on `sluice serve`'s in-process bus (one process: the agent, its fan-in
/// joiner, text-completion and the gateway), through the gateway's agent route: one answer
/// from all four results, one `done`.
#[tokio::test]
async fn a_supervisor_dialog_on_sluice_serve_answers_from_every_subagent() {
    init_logging();
    let fake = FakeOpenAi::start().await;
    let (listen, metrics) = (free_port(), free_port());
    let log = std::env::temp_dir().join(format!(
        "sluice-supervisor-serve-{}.log",
        uuid::Uuid::new_v4().simple()
    ));
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "serve",
            "--provider",
            "openai-compatible",
            "--base-url",
            &fake.base_url(),
            "--model",
            "supervisor",
            "--listen",
            &format!("127.0.0.1:{listen}"),
            "--metrics-addr",
            &format!("127.0.0.1:{metrics}"),
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let ready = format!("http://127.0.0.1:{metrics}/readyz");
    if let Err(e) = process::ready(&mut child, &ready, Duration::from_secs(60)).await {
        panic!(
            "sluice serve {e}: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    let body = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{listen}/api/v1/agent"))
        .header("accept", "application/x-ndjson")
        .json(&serde_json::json!({
            "question": "Tell me about four things.",
            "pattern": "supervisor",
            "streaming": true,
        }))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<serde_json::Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let answer: String = events
        .iter()
        .filter(|e| e["type"] == "token")
        .filter_map(|e| e["content"].as_str())
        .collect();
    for goal in ["alpha", "beta", "gamma", "delta"] {
        assert!(
            answer.contains(&format!("result-{goal}")),
            "every subagent's result in the synthesis: {body}"
        );
    }
    let done: Vec<_> = events.iter().filter(|e| e["type"] == "done").collect();
    assert_eq!(done.len(), 1, "{body}");
    assert_eq!(done[0]["reason"], "success", "{body}");
    process::terminate(&mut child, Duration::from_secs(20)).await;
}
