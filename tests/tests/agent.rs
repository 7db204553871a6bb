//! The agent processor end to end on the real broker: client -> agent -> text-completion ->
//! fake OpenAI server (a scripted ReAct model), with MCP tools on a real MCP server (rmcp),
//! each iteration handed back over the agent's own request topic. The exact sequence of
//! message types and flags is asserted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use sluice_agent::{
    handler::{AgentLimits, AgentService, DEFAULT_REACT_TEMPLATE},
    mcp::{McpClient, McpTimeouts},
    metrics::AgentMetrics,
    tools::{self, Backend, Tool},
};
use sluice_runtime::{
    client::{ClientConfig, Received, RequestClient},
    processor::ProcessorConfig,
    secret::Secret,
    telemetry::Telemetry,
};
use sluice_schema::{AgentMessageType, AgentRequest, AgentResponse};
use sluice_tests::{
    Broker, RunningProcessor, echo_config, fake_openai::FakeOpenAi, init_logging, mcp_server,
    unique_topic,
};
use sluice_text_completion::{
    handler::{LlmMetrics, TextCompletionService},
    providers::openai::{Dialect, OpenAiConfig, OpenAiProvider},
    retry::RetryPolicy,
};

type AgentClient = RequestClient<AgentRequest, AgentResponse>;

struct Setup {
    client: AgentClient,
    agent: RunningProcessor,
    llm: RunningProcessor,
    mcp: mcp_server::McpServer,
    _fake: FakeOpenAi,
}

impl Setup {
    async fn new(model: &str, max_iterations: usize) -> Self {
        let fake = FakeOpenAi::start().await;
        let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), model);
        config.api_key = Some(Secret::new("sk-test"));
        Self::with(config, fake, max_iterations).await
    }

    async fn with(config: OpenAiConfig, fake: FakeOpenAi, max_iterations: usize) -> Self {
        init_logging();
        let broker = Broker::from_env().await;
        let llm_telemetry = Telemetry::new().unwrap();
        let service = TextCompletionService::new(
            Arc::new(OpenAiProvider::new(config).unwrap()),
            RetryPolicy::default(),
            LlmMetrics::register(&llm_telemetry.registry).unwrap(),
        );
        let (tc_req, tc_resp) = (unique_topic("ag-tc-req"), unique_topic("ag-tc-resp"));
        let llm = RunningProcessor::start(
            broker.bus().await,
            echo_config(&tc_req, &tc_resp, 64),
            service,
        )
        .await;
        let llm_client = Arc::new(
            RequestClient::start(
                broker.bus().await,
                ClientConfig::new("text-completion", &tc_req, &tc_resp),
                None,
            )
            .await
            .unwrap(),
        );

        let mcp = mcp_server::start(None).await;
        let configs = tools::parse(&format!(
            r#"{{"tools": [
                {{"name": "add", "description": "Adds two numbers", "type": "mcp", "url": "{url}",
                  "arguments": [{{"name": "a", "type": "number"}}, {{"name": "b", "type": "number"}}]}},
                {{"name": "fail", "description": "Always fails", "type": "mcp", "url": "{url}"}}
            ]}}"#,
            url = mcp.url()
        ))
        .unwrap();
        let tools: Vec<Arc<Tool>> = configs
            .into_iter()
            .map(|config| {
                let client = McpClient::new(&mcp.url(), None, McpTimeouts::default()).unwrap();
                Arc::new(Tool {
                    config,
                    backend: Backend::Mcp(client),
                })
            })
            .collect();

        let (a_req, a_resp) = (unique_topic("agent-req"), unique_topic("agent-resp"));
        let next_step = broker.bus().await.publisher(&a_req).await.unwrap();
        let limits = AgentLimits {
            max_iterations,
            ..AgentLimits::default()
        };
        let metrics = AgentMetrics::register(&Telemetry::new().unwrap().registry).unwrap();
        let handler = AgentService::new(
            llm_client,
            tools,
            next_step,
            DEFAULT_REACT_TEMPLATE,
            limits,
            metrics,
        )
        .unwrap();
        let mut a_config = ProcessorConfig::new("agent", &a_req, &a_resp);
        a_config.drain_grace = Duration::from_secs(5);
        let agent = RunningProcessor::start(broker.bus().await, a_config, handler).await;
        let client = AgentClient::start(
            broker.bus().await,
            ClientConfig::new("agent", &a_req, &a_resp),
            None,
        )
        .await
        .unwrap();
        Self {
            client,
            agent,
            llm,
            mcp,
            _fake: fake,
        }
    }

    async fn ask(&self, streaming: bool) -> Vec<AgentResponse> {
        let request = AgentRequest {
            question: "What is 2 + 3?".into(),
            streaming,
            ..AgentRequest::default()
        };
        let mut s = self.client.request(&request).await.unwrap();
        let mut out = Vec::new();
        while let Some(item) = s.next().await {
            match item.unwrap() {
                Received::Record(r) => out.push(r),
                Received::Restarted => panic!("a continuation must not look like a restart"),
            }
        }
        assert_eq!(
            out.iter().filter(|r| r.end_of_dialog).count(),
            1,
            "{out:#?}"
        );
        assert!(out.last().unwrap().end_of_dialog);
        out
    }

    async fn stop(self) {
        self.client.close().await;
        self.agent.stop().await;
        self.llm.stop().await;
    }
}

/// The message types in order, with runs of thought or answer pieces collapsed.
fn shape(out: &[AgentResponse]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for r in out {
        let mut t = format!("{:?}", r.message_type).to_lowercase();
        if r.end_of_message {
            t.push('.');
        }
        if r.end_of_dialog {
            t.push('!');
        }
        if v.last() != Some(&t) {
            v.push(t);
        }
    }
    v
}

fn text(out: &[AgentResponse], t: AgentMessageType) -> String {
    out.iter()
        .filter(|r| r.message_type == t)
        .map(|r| r.content.as_str())
        .collect()
}

#[tokio::test]
async fn a_tool_call_streams_thought_action_observation_then_the_answer() {
    let s = Setup::new("react-tool", 5).await;
    let out = s.ask(true).await;
    assert_eq!(
        shape(&out),
        [
            "thought",
            "thought.",
            "action.",
            "observation.",
            "thought",
            "thought.",
            "answer",
            "answer.!"
        ],
        "{out:#?}"
    );
    let action: serde_json::Value = serde_json::from_str(
        &out.iter()
            .find(|r| r.message_type == AgentMessageType::Action)
            .unwrap()
            .content,
    )
    .unwrap();
    assert_eq!(action["name"], "add");
    assert_eq!(action["arguments"]["a"], "2");
    assert_eq!(text(&out, AgentMessageType::Observation), "5");
    assert_eq!(text(&out, AgentMessageType::Answer), "The sum is 5.");
    assert!(text(&out, AgentMessageType::Thought).contains("I should add the numbers."));
    // Usage over both model calls: 9 input tokens each.
    assert_eq!(out.iter().filter_map(|r| r.in_token).sum::<u64>(), 18);
    assert_eq!(s.mcp.calls(), 1);

    // Not streaming: the same types, each whole.
    let out = s.ask(false).await;
    assert_eq!(
        shape(&out),
        [
            "thought.",
            "action.",
            "observation.",
            "thought.",
            "answer.!"
        ],
        "{out:#?}"
    );
    assert_eq!(
        out.iter()
            .filter(|r| r.message_type == AgentMessageType::Thought)
            .count(),
        2
    );
    s.stop().await;
}

#[tokio::test]
async fn unknown_tools_and_tool_errors_become_observations() {
    let s = Setup::new("react-unknown", 5).await;
    let out = s.ask(true).await;
    let obs = text(&out, AgentMessageType::Observation);
    assert!(
        obs.contains("no tool called \"teleport\"") && obs.contains("add, fail"),
        "{obs}"
    );
    assert_eq!(text(&out, AgentMessageType::Answer), "Done.");
    s.stop().await;

    let s = Setup::new("react-fail", 5).await;
    let out = s.ask(true).await;
    let obs = text(&out, AgentMessageType::Observation);
    assert!(
        obs.starts_with("The tool failed: ") && obs.contains("boom"),
        "{obs}"
    );
    assert_eq!(text(&out, AgentMessageType::Answer), "Done.");
    s.stop().await;
}

#[tokio::test]
async fn unreadable_output_gets_one_corrective_retry_then_an_error() {
    let s = Setup::new("react-garbage-once", 5).await;
    let out = s.ask(true).await;
    assert_eq!(text(&out, AgentMessageType::Answer), "Recovered.");
    s.stop().await;

    let s = Setup::new("react-garbage", 5).await;
    let out = s.ask(true).await;
    let last = out.last().unwrap();
    assert_eq!(last.message_type, AgentMessageType::Error);
    assert_eq!(last.error.as_ref().unwrap().kind, "agent-error");
    assert!(
        last.error
            .as_ref()
            .unwrap()
            .message
            .contains("could not be read twice")
    );
    s.stop().await;
}

#[tokio::test]
async fn the_iteration_limit_ends_the_dialog_with_a_clear_error() {
    let s = Setup::new("react-loop", 3).await;
    let out = s.ask(true).await;
    assert_eq!(
        out.iter()
            .filter(|r| r.message_type == AgentMessageType::Observation)
            .count(),
        3
    );
    let last = out.last().unwrap();
    assert_eq!(last.message_type, AgentMessageType::Error);
    let e = last.error.as_ref().unwrap();
    assert_eq!(e.kind, "agent-error");
    assert!(e.message.contains("after 3 iterations"), "{}", e.message);
    s.stop().await;
}

#[tokio::test]
async fn a_direct_answer_is_one_model_call() {
    let s = Setup::new("react-answer", 5).await;
    let out = s.ask(true).await;
    assert_eq!(
        shape(&out),
        ["thought", "thought.", "answer", "answer.!"],
        "{out:#?}"
    );
    assert_eq!(
        text(&out, AgentMessageType::Answer),
        "Paris is the capital of France."
    );
    s.stop().await;
}

/// Against the real local LLM (started by the test command): a 135M model rarely follows the
/// ReAct format, so only the protocol is asserted: thoughts and answers or an agent error,
/// one `end_of_dialog` record last, nothing after it, and usage reported.
#[tokio::test]
async fn the_real_local_llm_keeps_the_protocol() {
    let url = std::env::var("SLUICE_LLM_URL").unwrap_or_else(|_| "http://127.0.0.1:8766".into());
    let key =
        std::env::var("SLUICE_LLM_API_KEY").expect("the test command sets SLUICE_LLM_API_KEY");
    let mut config = OpenAiConfig::new(Dialect::Compatible, url, "smollm2");
    config.api_key = Some(Secret::new(key));
    config.max_tokens = Some(48);
    config.temperature = Some(0.0);
    config.timeouts.first_token = Duration::from_secs(120);
    let s = Setup::with(config, FakeOpenAi::start().await, 2).await;
    let out = s.ask(true).await;
    let last = out.last().unwrap();
    match last.message_type {
        AgentMessageType::Answer => assert!(last.error.is_none()),
        AgentMessageType::Error => {
            let kind = &last.error.as_ref().unwrap().kind;
            assert!(kind == "agent-error" || kind == "timeout", "{last:?}");
        }
        other => panic!("the dialog ended with a {other:?} record"),
    }
    assert!(
        out.iter().filter_map(|r| r.out_token).sum::<u64>() > 0,
        "usage is reported"
    );
    s.stop().await;
}
