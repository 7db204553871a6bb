//! The agent processor end to end on the real broker: client -> agent -> text-completion ->
//! fake OpenAI server (a scripted ReAct model), each iteration handed back over the agent's
//! own request topic. Its tools are real: MCP tools on a real MCP server (rmcp), a prompt
//! tool on a real prompt processor, a text-completion tool on the text-completion processor
//! the agent itself uses, and a service tool on a small lookup processor with its own record
//! type. The exact sequence of message types and flags is asserted, and the agent's metrics
//! are read from its processor's registry.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sluice_agent::{
    handler::{
        AgentLimits, AgentService, DEFAULT_REACT_TEMPLATE, NonStreaming, PlainAnswer, ToolCalling,
    },
    mcp::{McpClient, McpTimeouts},
    metrics::AgentMetrics,
    patterns::route::Routing,
    tools::{self, AnyResponse, Backend, Tool, ToolKind},
};
use sluice_prompt::{
    handler::{LlmClient, PromptService},
    metrics::PromptMetrics,
    store::TemplateStore,
};
use sluice_runtime::{
    client::{ClientConfig, ClientError, Received, RequestClient, ResponseStream},
    processor::{Handler, ProcessorConfig, RequestContext, ResponseSink},
    secret::Secret,
    telemetry::Telemetry,
};
use sluice_schema::{AgentMessageType, AgentRequest, AgentResponse, Error, ResponseRecord};
use sluice_tests::{
    Broker, RunningProcessor, echo_config, fake_openai::FakeOpenAi, init_logging, mcp_server,
    openai_service, unique_topic, wait_for_metrics,
};
use sluice_text_completion::providers::openai::{Dialect, OpenAiConfig};

type AgentClient = RequestClient<AgentRequest, AgentResponse>;

/// The prompt processor's templates: `facts` renders its `topic` into a prompt the fake
/// model echoes.
const TEMPLATES: &str =
    r#"{"templates": {"facts": {"prompt": "Tell me facts about {{ topic }}."}}}"#;

/// The lookup service's record: not a TrustGraph record, so the `service` tool must find
/// the end by `complete`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct LookupRecord {
    #[serde(default)]
    value: String,
    #[serde(default)]
    complete: bool,
    #[serde(default)]
    error: Option<Error>,
}

impl ResponseRecord for LookupRecord {
    fn is_terminal(&self) -> bool {
        self.complete || self.error.is_some()
    }

    fn from_error(error: Error) -> Self {
        Self {
            error: Some(error),
            ..Self::default()
        }
    }

    fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }
}

/// A service on its own topic pair: looks `key` up, answering with a progress record and
/// then the value.
struct LookupService;

#[async_trait]
impl Handler for LookupService {
    type Request = Value;
    type Response = LookupRecord;

    async fn handle(
        &self,
        request: Value,
        _ctx: RequestContext,
        sink: &mut ResponseSink<LookupRecord>,
    ) -> Result<(), Error> {
        let key = request["key"].as_str().unwrap_or_default().to_owned();
        let value = match key.as_str() {
            "capital-of-france" => "Paris",
            _ => "unknown",
        };
        let failed = |e: sluice_runtime::processor::SinkError| {
            Error::new(sluice_schema::ErrorKind::Internal, e.to_string())
        };
        sink.send(LookupRecord {
            value: format!("looking up {key}"),
            ..LookupRecord::default()
        })
        .await
        .map_err(failed)?;
        sink.send(LookupRecord {
            value: value.into(),
            complete: true,
            error: None,
        })
        .await
        .map_err(failed)
    }
}

/// Topics of the agent and of the services its tools reach.
struct Topics {
    agent: (String, String),
    llm: (String, String),
    prompt: (String, String),
    lookup: (String, String),
}

fn pair(name: &str) -> (String, String) {
    (
        unique_topic(&format!("{name}-req")),
        unique_topic(&format!("{name}-resp")),
    )
}

struct Setup {
    client: AgentClient,
    agent: RunningProcessor,
    llm: RunningProcessor,
    prompt: RunningProcessor,
    lookup: RunningProcessor,
    mcp: mcp_server::McpServer,
    fake: FakeOpenAi,
    broker: Broker,
    topics: Topics,
    limits: AgentLimits,
    routing: Routing,
    templates: PathBuf,
}

impl Setup {
    async fn new(model: &str, max_iterations: usize) -> Self {
        Self::plain(model, max_iterations, PlainAnswer::default()).await
    }

    async fn plain(model: &str, max_iterations: usize, plain_answer: PlainAnswer) -> Self {
        let fake = FakeOpenAi::start().await;
        let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), model);
        config.api_key = Some(Secret::new("sk-test"));
        let limits = AgentLimits {
            max_iterations,
            plain_answer,
            ..AgentLimits::default()
        };
        Self::with_limits(config, fake, limits).await
    }

    async fn with(config: OpenAiConfig, fake: FakeOpenAi, max_iterations: usize) -> Self {
        let limits = AgentLimits {
            max_iterations,
            ..AgentLimits::default()
        };
        Self::with_limits(config, fake, limits).await
    }

    async fn with_limits(config: OpenAiConfig, fake: FakeOpenAi, limits: AgentLimits) -> Self {
        Self::routed(config, fake, limits, Routing::default()).await
    }

    /// An agent whose meta-routing chooses from `routing`, its model the fake's `model`.
    async fn routing(model: &str, routing: Routing) -> Self {
        let fake = FakeOpenAi::start().await;
        let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), model);
        config.api_key = Some(Secret::new("sk-test"));
        Self::routed(config, fake, AgentLimits::default(), routing).await
    }

    async fn routed(
        config: OpenAiConfig,
        fake: FakeOpenAi,
        limits: AgentLimits,
        routing: Routing,
    ) -> Self {
        init_logging();
        let broker = Broker::from_env().await;
        let topics = Topics {
            agent: pair("agent"),
            llm: pair("ag-tc"),
            prompt: pair("ag-prompt"),
            lookup: pair("ag-lookup"),
        };
        let service = openai_service(config);
        let llm = RunningProcessor::start(
            broker.bus().await,
            echo_config(&topics.llm.0, &topics.llm.1, 64),
            service,
        )
        .await;

        // The prompt processor, calling the same text-completion processor.
        let templates = std::env::temp_dir().join(format!(
            "sluice-agent-{}.json",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::write(&templates, TEMPLATES).unwrap();
        let prompt_telemetry = Telemetry::new().unwrap();
        let prompt_metrics = PromptMetrics::register(&prompt_telemetry.registry).unwrap();
        let store =
            TemplateStore::open(Some(templates.clone()), false, Some(prompt_metrics.clone()))
                .unwrap();
        let prompt_llm: Arc<LlmClient> = Arc::new(
            RequestClient::start(
                broker.bus().await,
                ClientConfig::new("text-completion", &topics.llm.0, &topics.llm.1),
                None,
            )
            .await
            .unwrap(),
        );
        let mut p_config = ProcessorConfig::new("prompt", &topics.prompt.0, &topics.prompt.1);
        sluice_tests::record_per_delta(&mut p_config);
        p_config.drain_grace = Duration::from_secs(5);
        let prompt = RunningProcessor::start(
            broker.bus().await,
            p_config,
            PromptService::new(store, prompt_llm, prompt_metrics),
        )
        .await;

        let mut l_config = ProcessorConfig::new("lookup", &topics.lookup.0, &topics.lookup.1);
        sluice_tests::record_per_delta(&mut l_config);
        l_config.drain_grace = Duration::from_secs(5);
        let lookup = RunningProcessor::start(broker.bus().await, l_config, LookupService).await;

        let mcp = mcp_server::start(None).await;
        let agent = start_agent(
            &broker,
            &topics,
            &mcp.url(),
            limits.clone(),
            routing.clone(),
        )
        .await;
        let client = AgentClient::start(
            broker.bus().await,
            ClientConfig::new("agent", &topics.agent.0, &topics.agent.1),
            None,
        )
        .await
        .unwrap();
        Self {
            client,
            agent,
            llm,
            prompt,
            lookup,
            mcp,
            fake,
            broker,
            topics,
            limits,
            routing,
            templates,
        }
    }

    /// Another agent replica on the same subscription.
    async fn start_agent(&self) -> RunningProcessor {
        start_agent(
            &self.broker,
            &self.topics,
            &self.mcp.url(),
            self.limits.clone(),
            self.routing.clone(),
        )
        .await
    }
}

/// The tools file: every kind of tool, each on a real backend.
fn tools_file(t: &Topics, mcp_url: &str) -> String {
    format!(
        r#"{{"tools": [
                {{"name": "add", "description": "Adds two numbers", "type": "mcp", "url": "{url}",
                  "arguments": [{{"name": "a", "type": "number"}}, {{"name": "b", "type": "number"}}]}},
                {{"name": "fail", "description": "Always fails", "type": "mcp", "url": "{url}"}},
                {{"name": "ask", "description": "Asks a language model", "type": "text-completion",
                  "arguments": [{{"name": "question", "type": "string"}}]}},
                {{"name": "facts", "description": "Facts about a topic", "type": "prompt", "template": "facts",
                  "arguments": [{{"name": "topic", "type": "string"}}]}},
                {{"name": "lookup", "description": "Looks a key up", "type": "service",
                  "request-topic": "{lreq}", "response-topic": "{lresp}",
                  "arguments": [{{"name": "key", "type": "string"}}]}}
            ]}}"#,
        url = mcp_url,
        lreq = t.lookup.0,
        lresp = t.lookup.1,
    )
}

/// One agent replica, as a process would build it: its own bus connection, clients and tool
/// backends, and its metrics on its processor's registry. Replicas share the Shared
/// subscription `agent`.
async fn start_agent(
    broker: &Broker,
    t: &Topics,
    mcp_url: &str,
    limits: AgentLimits,
    routing: Routing,
) -> RunningProcessor {
    let bus = broker.bus().await;
    let llm: Arc<LlmClient> = Arc::new(
        RequestClient::start(
            bus.clone(),
            ClientConfig::new("text-completion", &t.llm.0, &t.llm.1),
            None,
        )
        .await
        .unwrap(),
    );
    let prompt = Arc::new(
        RequestClient::start(
            bus.clone(),
            ClientConfig::new("prompt", &t.prompt.0, &t.prompt.1),
            None,
        )
        .await
        .unwrap(),
    );
    let mut tools = Vec::new();
    for config in tools::parse(&tools_file(t, mcp_url)).unwrap() {
        let backend = match &config.kind {
            ToolKind::Mcp { url, .. } => {
                Backend::Mcp(McpClient::new(url, None, McpTimeouts::default()).unwrap())
            }
            ToolKind::TextCompletion { .. } => Backend::TextCompletion(llm.clone()),
            ToolKind::Prompt { .. } => Backend::Prompt(prompt.clone()),
            ToolKind::Service {
                request_topic,
                response_topic,
            } => Backend::Service(
                RequestClient::<Value, AnyResponse>::start(
                    bus.clone(),
                    ClientConfig::new("tool-lookup", request_topic, response_topic),
                    None,
                )
                .await
                .unwrap(),
            ),
        };
        tools.push(Arc::new(Tool { config, backend }));
    }
    let next_step = bus.publisher(&t.agent.0).await.unwrap();
    let telemetry = Telemetry::new().unwrap();
    let metrics = AgentMetrics::register(&telemetry.registry).unwrap();
    let handler = AgentService::new(
        llm,
        tools,
        next_step,
        DEFAULT_REACT_TEMPLATE,
        limits,
        metrics,
    )
    .unwrap()
    .with_routing(routing);
    let mut config = ProcessorConfig::new("agent", &t.agent.0, &t.agent.1);
    sluice_tests::record_per_delta(&mut config);
    config.drain_grace = Duration::from_secs(5);
    RunningProcessor::start_with(bus, config, handler, telemetry).await
}

impl Setup {
    fn request(streaming: bool) -> AgentRequest {
        AgentRequest {
            question: "What is 2 + 3?".into(),
            streaming,
            ..AgentRequest::default()
        }
    }

    async fn ask(&self, streaming: bool) -> Vec<AgentResponse> {
        let mut s = self
            .client
            .request(&Self::request(streaming))
            .await
            .unwrap();
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

    /// The agent processor's `/metrics` text.
    fn metrics(&self) -> String {
        self.agent.telemetry.render()
    }

    async fn stop(self) {
        self.client.close().await;
        self.agent.stop().await;
        self.prompt.stop().await;
        self.lookup.stop().await;
        self.llm.stop().await;
        let _ = std::fs::remove_file(&self.templates);
    }
}

/// The message types in order, with runs of thought or answer pieces collapsed: `.` marks
/// `end_of_message`, `!` `end_of_dialog`.
fn shape(out: &[AgentResponse]) -> Vec<String> {
    let items: Vec<Received<AgentResponse>> = out.iter().cloned().map(Received::Record).collect();
    shape_of(&items)
}

/// As [`shape`], for a stream that may restart (`<restarted>`).
fn shape_of(items: &[Received<AgentResponse>]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for item in items {
        let t = match item {
            Received::Restarted => "<restarted>".to_owned(),
            Received::Record(r) => {
                let mut t = format!("{:?}", r.message_type).to_lowercase();
                if r.end_of_message {
                    t.push('.');
                }
                if r.end_of_dialog {
                    t.push('!');
                }
                t
            }
        };
        if v.last() != Some(&t) {
            v.push(t);
        }
    }
    v
}

/// One tool call, then the answer, streamed.
const TOOL_CALL: [&str; 8] = [
    "thought",
    "thought.",
    "action.",
    "observation.",
    "thought",
    "thought.",
    "answer",
    "answer.!",
];

/// Asserts that each line is in the metrics text.
fn assert_metrics(metrics: &str, lines: &[&str]) {
    for line in lines {
        assert!(
            metrics.lines().any(|l| l == *line),
            "{line} is not in\n{}",
            metrics
                .lines()
                .filter(|l| l.starts_with("sluice_agent_"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Asserts that each line is in the metrics text `render` returns, waiting up to 10 s for the
/// lines a processor writes only once the broker confirmed its answer's records (its request
/// outcome and published records), which can be just after the caller received them.
async fn assert_metrics_soon(render: impl Fn() -> String, lines: &[&str]) {
    let text = wait_for_metrics(render, |m| {
        lines.iter().all(|line| m.lines().any(|l| l == *line))
    })
    .await;
    assert_metrics(&text, lines);
}

/// The action record's tool name (its `content`, as TrustGraph's streaming spec shows it) and
/// arguments (sluice's `arguments` field).
fn action(out: &[AgentResponse]) -> Value {
    let record = out
        .iter()
        .find(|r| r.message_type == AgentMessageType::Action)
        .expect("an action record");
    action_of(record)
}

fn action_of(record: &AgentResponse) -> Value {
    serde_json::json!({"name": record.content, "arguments": record.arguments})
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
    assert_eq!(shape(&out), TOOL_CALL, "{out:#?}");
    let action = action(&out);
    assert_eq!(action["name"], "add");
    assert_eq!(action["arguments"]["a"], "2");
    assert_eq!(text(&out, AgentMessageType::Observation), "5");
    assert_eq!(text(&out, AgentMessageType::Answer), "The sum is 5.");
    assert!(text(&out, AgentMessageType::Thought).contains("I should add the numbers."));
    // Usage over both model calls: 9 input tokens each.
    assert_eq!(out.iter().filter_map(|r| r.in_token).sum::<u64>(), 18);
    assert_eq!(s.mcp.calls(), 1);

    // Not streaming: TrustGraph's streaming spec's (docs/specs.md#trustgraphs-streaming-spec)
    // single response, with both model calls' usage.
    let out = s.ask(false).await;
    assert_eq!(shape(&out), ["answer.!"], "{out:#?}");
    assert_eq!(out[0].content, "The sum is 5.");
    assert_eq!(out[0].in_token, Some(18));
    // Both dialogs, counted on the agent processor's own /metrics.
    assert_metrics_soon(
        || s.metrics(),
        &[
            r#"sluice_agent_iterations_total{outcome="action"} 2"#,
            r#"sluice_agent_iterations_total{outcome="answer"} 2"#,
            r#"sluice_agent_tool_calls_total{kind="mcp",outcome="success",tool="add"} 2"#,
            r#"sluice_agent_tool_duration_seconds_count{kind="mcp"} 2"#,
            r#"sluice_agent_dialogs_total{outcome="answer"} 2"#,
            r#"sluice_processor_requests_total{outcome="continued",processor="agent"} 2"#,
            r#"sluice_processor_requests_total{outcome="success",processor="agent"} 2"#,
        ],
    )
    .await;
    s.stop().await;

    // Not streaming, with `--non-streaming steps`: TrustGraph 2.x's multipart reply, the
    // same types as the stream, each whole.
    let fake = FakeOpenAi::start().await;
    let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), "react-tool");
    config.api_key = Some(Secret::new("sk-test"));
    let limits = AgentLimits {
        non_streaming: NonStreaming::Steps,
        ..AgentLimits::default()
    };
    let s = Setup::with_limits(config, fake, limits).await;
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
    assert_eq!(out.iter().filter_map(|r| r.in_token).sum::<u64>(), 18);
    s.stop().await;
}

/// `--tool-calling native`: the model (the fake's `agent-tools`, with OpenAI's tool calls)
/// calls three tools in one turn; the two whose arguments match the tools' schemas run (the
/// lookup service and the MCP adder), the third's arguments (`"two"` for a number) are
/// refused without calling the tool, and the model, given all three results in the next
/// turn, answers from them. The turn is one iteration; no text is parsed.
#[tokio::test]
async fn native_tool_calls_of_one_turn_all_run_and_the_model_gets_every_result() {
    let fake = FakeOpenAi::start().await;
    let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), "agent-tools");
    config.api_key = Some(Secret::new("sk-test"));
    let limits = AgentLimits {
        tool_calling: ToolCalling::Native,
        max_iterations: 2,
        ..AgentLimits::default()
    };
    let s = Setup::with_limits(config, fake, limits).await;
    let out = s.ask(true).await;
    // Every record, runs not collapsed: each thought and the answer whole, one action and one
    // observation per call.
    use AgentMessageType::{Action, Answer, Observation, Thought};
    let types: Vec<(AgentMessageType, bool, bool)> = out
        .iter()
        .map(|r| (r.message_type, r.end_of_message, r.end_of_dialog))
        .collect();
    assert_eq!(
        types,
        [
            (Thought, true, false),
            (Action, true, false),
            (Action, true, false),
            (Action, true, false),
            (Observation, true, false),
            (Observation, true, false),
            (Observation, true, false),
            (Answer, true, true)
        ],
        "{out:#?}"
    );
    assert_eq!(
        text(&out, AgentMessageType::Thought),
        "Let me look these up."
    );
    let actions: Vec<Value> = out
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Action)
        .map(action_of)
        .collect();
    assert_eq!(
        actions[0],
        serde_json::json!({"name": "lookup", "arguments": {"key": "capital-of-france"}})
    );
    assert_eq!(
        actions[1],
        serde_json::json!({"name": "add", "arguments": {"a": "2", "b": "3"}}),
        "as the dialog's history keeps them: strings"
    );
    let observations: Vec<&str> = out
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Observation)
        .map(|r| r.content.as_str())
        .collect();
    // A service tool's observation is its terminal record.
    assert!(
        observations[0].contains(r#""value":"Paris""#),
        "{observations:?}"
    );
    assert_eq!(observations[1], "5");
    assert!(
        observations[2].starts_with(
            "The arguments for add do not match its schema: /a is not of type number."
        ),
        "{observations:?}"
    );
    assert!(!observations[2].contains("two"), "values are never quoted");
    assert_eq!(s.mcp.calls(), 1, "the refused call never reached the tool");
    assert_eq!(
        text(&out, AgentMessageType::Answer),
        format!("results: {}; 5; {}", observations[0], observations[2])
    );
    // The second turn got the calls and every result, paired by id.
    let sent = s.fake.last_body();
    let messages = sent["messages"].as_array().unwrap();
    let ids: Vec<&str> = messages[2]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["call_lookup", "call_add", "call_add_bad"], "{sent}");
    // Each call goes back with the arguments the model sent, the refused one too.
    assert_eq!(
        messages[2]["tool_calls"][2]["function"]["arguments"], r#"{"a":"two","b":3}"#,
        "{sent}"
    );
    assert_eq!(messages[2]["content"], "Let me look these up.");
    assert_eq!(messages[3]["tool_call_id"], "call_lookup");
    assert_eq!(messages[5]["tool_call_id"], "call_add_bad");
    assert!(
        sent["tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["function"]["name"] == "add"
                && t["function"]["parameters"]["properties"]["a"]["type"] == "number"),
        "{sent}"
    );
    assert_metrics_soon(
        || s.metrics(),
        &[
            r#"sluice_agent_iterations_total{outcome="action"} 1"#,
            r#"sluice_agent_iterations_total{outcome="answer"} 1"#,
            r#"sluice_agent_tool_calls_total{kind="mcp",outcome="invalid_arguments",tool="add"} 1"#,
            r#"sluice_agent_tool_calls_total{kind="mcp",outcome="success",tool="add"} 1"#,
            r#"sluice_agent_tool_calls_total{kind="service",outcome="success",tool="lookup"} 1"#,
        ],
    )
    .await;
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
    // The made-up name is not a label.
    assert_metrics(
        &s.metrics(),
        &[r#"sluice_agent_tool_calls_total{kind="",outcome="unknown",tool=""} 1"#],
    );
    assert!(!s.metrics().contains("teleport"));
    s.stop().await;

    let s = Setup::new("react-fail", 5).await;
    let out = s.ask(true).await;
    let obs = text(&out, AgentMessageType::Observation);
    assert!(
        obs.starts_with("The tool failed: ") && obs.contains("boom"),
        "{obs}"
    );
    assert_eq!(text(&out, AgentMessageType::Answer), "Done.");
    assert_metrics(
        &s.metrics(),
        &[
            r#"sluice_agent_tool_calls_total{kind="mcp",outcome="error",tool="fail"} 1"#,
            r#"sluice_agent_dialogs_total{outcome="answer"} 1"#,
        ],
    );
    s.stop().await;
}

#[tokio::test]
async fn unreadable_output_gets_one_corrective_retry_then_an_error() {
    let s = Setup::new("react-garbage-once", 5).await;
    let out = s.ask(true).await;
    assert_eq!(text(&out, AgentMessageType::Answer), "Recovered.");
    assert_metrics(
        &s.metrics(),
        &[
            r#"sluice_agent_iterations_total{outcome="retry"} 1"#,
            r#"sluice_agent_iterations_total{outcome="answer"} 1"#,
        ],
    );
    s.stop().await;

    // Strict ReAct: prose twice is an error.
    let s = Setup::plain("react-garbage", 5, PlainAnswer::Error).await;
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
    assert_metrics(
        &s.metrics(),
        &[
            r#"sluice_agent_iterations_total{outcome="retry"} 1"#,
            r#"sluice_agent_iterations_total{outcome="error"} 1"#,
            r#"sluice_agent_dialogs_total{outcome="error"} 1"#,
        ],
    );
    s.stop().await;
}

/// A model that only ever answers in plain prose (no markers): by default the prose is the
/// answer after one corrective retry; with `final` at once, without the retry.
#[tokio::test]
async fn plain_prose_is_taken_as_the_final_answer() {
    for streaming in [true, false] {
        let s = Setup::new("react-garbage", 5).await;
        let out = s.ask(streaming).await;
        let last = out.last().unwrap();
        assert!(last.error.is_none(), "streaming {streaming}: {out:#?}");
        assert!(last.end_of_dialog);
        assert_eq!(
            text(&out, AgentMessageType::Answer),
            "I refuse to follow formats."
        );
        assert_eq!(s.fake.calls("react-garbage"), 2, "one corrective retry");
        assert_metrics(
            &s.metrics(),
            &[
                r#"sluice_agent_iterations_total{outcome="retry"} 1"#,
                r#"sluice_agent_iterations_total{outcome="answer"} 1"#,
                r#"sluice_agent_dialogs_total{outcome="answer"} 1"#,
            ],
        );
        s.stop().await;
    }

    let s = Setup::plain("react-garbage", 5, PlainAnswer::Final).await;
    let out = s.ask(true).await;
    assert!(out.last().unwrap().error.is_none(), "{out:#?}");
    assert_eq!(
        text(&out, AgentMessageType::Answer),
        "I refuse to follow formats."
    );
    assert_eq!(s.fake.calls("react-garbage"), 1, "no retry");
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
    assert_metrics(
        &s.metrics(),
        &[
            r#"sluice_agent_iterations_total{outcome="action"} 3"#,
            r#"sluice_agent_dialogs_total{outcome="max-iterations"} 1"#,
        ],
    );
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

#[tokio::test]
async fn a_text_completion_tool_gets_its_answer_from_the_text_completion_processor() {
    let s = Setup::new("react-ask", 5).await;
    let out = s.ask(true).await;
    assert_eq!(shape(&out), TOOL_CALL, "{out:#?}");
    let action = action(&out);
    assert_eq!(action["name"], "ask");
    assert_eq!(action["arguments"]["question"], "Name a colour.");
    // The model behind the processor answered the tool's question, not the ReAct prompt.
    assert_eq!(
        text(&out, AgentMessageType::Observation),
        "Echo: Name a colour."
    );
    assert_eq!(
        text(&out, AgentMessageType::Answer),
        "The tool said: Echo: Name a colour."
    );
    assert_eq!(s.fake.calls("react-ask"), 3, "two ReAct steps and the tool");
    assert_metrics(
        &s.metrics(),
        &[
            r#"sluice_agent_tool_calls_total{kind="text-completion",outcome="success",tool="ask"} 1"#,
            r#"sluice_agent_tool_duration_seconds_count{kind="text-completion"} 1"#,
            r#"sluice_agent_dialogs_total{outcome="answer"} 1"#,
        ],
    );
    s.stop().await;
}

#[tokio::test]
async fn a_prompt_tool_renders_its_template_on_the_prompt_processor() {
    let s = Setup::new("react-facts", 5).await;
    let out = s.ask(true).await;
    assert_eq!(shape(&out), TOOL_CALL, "{out:#?}");
    let action = action(&out);
    assert_eq!(action["name"], "facts");
    assert_eq!(action["arguments"]["topic"], "otters");
    // The template `facts` rendered with the argument, answered by the model.
    assert_eq!(
        text(&out, AgentMessageType::Observation),
        "Echo: Tell me facts about otters."
    );
    assert_eq!(
        text(&out, AgentMessageType::Answer),
        "The tool said: Echo: Tell me facts about otters."
    );
    assert_metrics_soon(
        || s.prompt.telemetry.render(),
        &[r#"sluice_processor_requests_total{outcome="success",processor="prompt"} 1"#],
    )
    .await;
    assert_metrics(
        &s.metrics(),
        &[r#"sluice_agent_tool_calls_total{kind="prompt",outcome="success",tool="facts"} 1"#],
    );
    s.stop().await;
}

#[tokio::test]
async fn a_service_tool_reads_any_topic_pair_to_its_terminal_record() {
    let s = Setup::new("react-lookup", 5).await;
    let out = s.ask(true).await;
    assert_eq!(shape(&out), TOOL_CALL, "{out:#?}");
    let action = action(&out);
    assert_eq!(action["name"], "lookup");
    assert_eq!(action["arguments"]["key"], "capital-of-france");
    // The observation is the service's terminal record (`complete`), not its progress one.
    let observation: Value =
        serde_json::from_str(&text(&out, AgentMessageType::Observation)).unwrap();
    assert_eq!(observation["value"], "Paris");
    assert_eq!(observation["complete"], true);
    assert!(text(&out, AgentMessageType::Answer).starts_with("The tool said: {"));
    assert_metrics_soon(
        || s.lookup.telemetry.render(),
        &[r#"sluice_processor_records_published_total{processor="lookup"} 2"#],
    )
    .await;
    assert_metrics(
        &s.metrics(),
        &[
            r#"sluice_agent_tool_calls_total{kind="service",outcome="success",tool="lookup"} 1"#,
            r#"sluice_agent_tool_duration_seconds_count{kind="service"} 1"#,
        ],
    );
    s.stop().await;
}

/// The next item of a dialog that must go on.
async fn next(
    stream: &mut ResponseStream<AgentResponse>,
) -> Option<Result<Received<AgentResponse>, ClientError>> {
    tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("the dialog goes on")
}

/// The agent processor dies while the second iteration's model call is in flight (the fake
/// holds the answer behind its gate). Another replica on the same subscription gets the
/// request again from the broker: the client sees the restart, only that iteration runs
/// again, and the first one (with its tool call) is not redone.
#[tokio::test]
async fn a_killed_agent_costs_at_most_the_iteration_in_flight() {
    let mut s = Setup::new("react-gated", 5).await;
    let mut stream = s.client.request(&Setup::request(true)).await.unwrap();
    let mut items: Vec<Received<AgentResponse>> = Vec::new();
    // Up to the second iteration's first thought piece, sent before the gate.
    loop {
        let item = next(&mut stream).await.unwrap().unwrap();
        let observed = items.iter().any(
            |i| matches!(i, Received::Record(o) if o.message_type == AgentMessageType::Observation),
        );
        let second_thought = observed
            && matches!(&item, Received::Record(r) if r.message_type == AgentMessageType::Thought);
        items.push(item);
        if second_thought {
            break;
        }
    }
    let survivor = s.start_agent().await;
    let doomed = std::mem::replace(&mut s.agent, survivor);
    let doomed = doomed.kill().await;
    // The survivor repeats the second iteration up to the gate: the restart, then thought.
    loop {
        let item = next(&mut stream).await.unwrap().unwrap();
        let thought =
            matches!(&item, Received::Record(r) if r.message_type == AgentMessageType::Thought);
        let restarted = items.iter().any(|i| matches!(i, Received::Restarted));
        items.push(item);
        if restarted && thought {
            break;
        }
    }
    // Both model calls of the second iteration (the abandoned one and the repeat) go on.
    s.fake.open_gate();
    s.fake.open_gate();
    while let Some(item) = next(&mut stream).await {
        items.push(item.unwrap());
    }
    assert_eq!(
        shape_of(&items),
        [
            "thought",
            "thought.",
            "action.",
            "observation.",
            "thought",
            "<restarted>",
            "thought",
            "thought.",
            "answer",
            "answer.!"
        ],
        "{items:#?}"
    );
    let after: Vec<AgentResponse> = items
        .iter()
        .skip_while(|i| !matches!(i, Received::Restarted))
        .filter_map(|i| match i {
            Received::Record(r) => Some(r.clone()),
            Received::Restarted => None,
        })
        .collect();
    assert_eq!(text(&after, AgentMessageType::Answer), "The sum is 5.");
    // The first iteration ran once: one tool call; the second twice: three model calls.
    assert_eq!(s.mcp.calls(), 1);
    assert_eq!(s.fake.calls("react-gated"), 3);
    assert_metrics(
        &doomed.render(),
        &[
            r#"sluice_agent_iterations_total{outcome="action"} 1"#,
            r#"sluice_agent_tool_calls_total{kind="mcp",outcome="success",tool="add"} 1"#,
        ],
    );
    let survived = s.metrics();
    assert_metrics(
        &survived,
        &[
            r#"sluice_agent_iterations_total{outcome="answer"} 1"#,
            r#"sluice_agent_dialogs_total{outcome="answer"} 1"#,
        ],
    );
    assert!(
        !survived.contains("sluice_agent_tool_calls_total"),
        "the survivor called no tool"
    );
    s.stop().await;
}

/// The dialog's deadline, carried in the request, ends it with `timeout` while the model of
/// its second iteration is still answering.
#[tokio::test]
async fn the_dialog_deadline_ends_the_dialog_with_a_timeout() {
    let s = Setup::new("react-gated", 5).await;
    let mut request = Setup::request(true);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    request.deadline_ms = Some(u64::try_from(now.as_millis()).unwrap() + 3000);
    let records = s.client.call(&request).await.unwrap();
    let last = records.last().unwrap();
    assert!(last.end_of_dialog);
    assert_eq!(last.message_type, AgentMessageType::Error);
    let e = last.error.as_ref().unwrap();
    assert_eq!(e.kind, "timeout", "{e:?}");
    assert!(e.message.contains("did not finish"), "{}", e.message);
    assert_metrics(
        &s.metrics(),
        &[r#"sluice_agent_dialogs_total{outcome="deadline"} 1"#],
    );
    // Let the held-back model call finish, so the text-completion processor drains at once.
    s.fake.open_gate();
    s.stop().await;
}

/// A question for the orchestrator's patterns: `pattern`, or none (meta-routing).
fn plan_request(pattern: Option<&str>, streaming: bool) -> AgentRequest {
    AgentRequest {
        pattern: pattern.map(str::to_owned),
        ..Setup::request(streaming)
    }
}

/// Every record of a dialog, asserting it ends once and never restarts.
async fn whole_dialog(s: &Setup, request: &AgentRequest) -> Vec<AgentResponse> {
    let records = s.client.call(request).await.unwrap();
    assert_eq!(
        records.iter().filter(|r| r.end_of_dialog).count(),
        1,
        "{records:#?}"
    );
    assert!(records.last().unwrap().end_of_dialog);
    records
}

/// The thoughts of a dialog, each whole.
fn thoughts(out: &[AgentResponse]) -> Vec<&str> {
    out.iter()
        .filter(|r| r.message_type == AgentMessageType::Thought)
        .map(|r| r.content.as_str())
        .collect()
}

/// The records of the fake `plan` model's two-step plan, streamed, in TrustGraph's order:
/// the plan's thought; per step its thought and the tool's observation; the synthesis's
/// thought; the answer's pieces; the end of the dialog.
const PLAN_TWO_STEPS: [&str; 7] = [
    "thought.",
    "observation.",
    "thought.",
    "observation.",
    "thought.",
    "answer",
    "answer.!",
];

/// What the fake `plan` model's dialog thinks.
const PLAN_THOUGHTS: [&str; 4] = [
    "Created plan with 2 steps",
    "Step 0: add 2 and 3 → calling add",
    "Step 1: look up the capital of France → calling lookup",
    "Synthesising final answer from plan results",
];

/// Plan-then-execute over the broker: a plan of two steps, each step an iteration handed on
/// over the agent's request topic running one real tool (the MCP adder, then the lookup
/// service), then the synthesis streamed; TrustGraph's records in its order, and one answer
/// record when not streaming.
#[tokio::test]
async fn plan_then_execute_runs_a_two_step_plan_with_tools() {
    let s = Setup::new("plan", 5).await;
    let out = whole_dialog(&s, &plan_request(Some("plan-then-execute"), true)).await;
    assert_eq!(shape(&out), PLAN_TWO_STEPS, "{out:#?}");
    assert_eq!(thoughts(&out), PLAN_THOUGHTS, "{out:#?}");
    let observations: Vec<_> = out
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Observation)
        .map(|r| r.content.as_str())
        .collect();
    // The service tool's observation is its terminal record.
    assert_eq!(observations.len(), 2, "{out:#?}");
    assert_eq!(observations[0], "5");
    assert!(observations[1].contains(r#""value":"Paris""#), "{out:#?}");
    assert_eq!(
        text(&out, AgentMessageType::Answer),
        "The sum is 5 and the capital is Paris."
    );
    // Four model calls of 9 input tokens each, counted once.
    assert_eq!(out.iter().filter_map(|r| r.in_token).sum::<u64>(), 36);
    assert_eq!(s.mcp.calls(), 1);

    let out = whole_dialog(&s, &plan_request(Some("plan-then-execute"), false)).await;
    assert_eq!(shape(&out), ["answer.!"], "{out:#?}");
    assert_eq!(out[0].content, "The sum is 5 and the capital is Paris.");
    assert_eq!(out[0].in_token, Some(36));
    assert_metrics_soon(
        || s.metrics(),
        &[
            r#"sluice_agent_iterations_total{outcome="action"} 6"#,
            r#"sluice_agent_iterations_total{outcome="answer"} 2"#,
            r#"sluice_agent_tool_calls_total{kind="mcp",outcome="success",tool="add"} 2"#,
            r#"sluice_agent_tool_calls_total{kind="service",outcome="success",tool="lookup"} 2"#,
            r#"sluice_agent_dialogs_total{outcome="answer"} 2"#,
            r#"sluice_processor_requests_total{outcome="continued",processor="agent"} 6"#,
        ],
    )
    .await;
    s.stop().await;
}

/// With no pattern, meta-routing picks the task type (two are configured) and then the
/// pattern with the model, and the dialog runs as plan-then-execute.
#[tokio::test]
async fn meta_routing_chooses_plan_then_execute_from_two_task_types() {
    let task_types = std::collections::BTreeMap::from([
        (
            "research".to_owned(),
            r#"{"description": "Questions needing several facts", "valid_patterns": ["react", "plan-then-execute"]}"#.to_owned(),
        ),
        (
            "chat".to_owned(),
            r#"{"description": "Small talk", "valid_patterns": ["react"]}"#.to_owned(),
        ),
    ]);
    let patterns = std::collections::BTreeMap::from([
        (
            "react".to_owned(),
            r#"{"description": "Reason and act"}"#.to_owned(),
        ),
        (
            "plan-then-execute".to_owned(),
            r#"{"description": "Plan, then run each step"}"#.to_owned(),
        ),
    ]);
    let s = Setup::routing("plan", Routing::from_entries(&task_types, &patterns)).await;
    let out = whole_dialog(&s, &plan_request(None, true)).await;
    assert_eq!(shape(&out), PLAN_TWO_STEPS, "{out:#?}");
    assert_eq!(thoughts(&out), PLAN_THOUGHTS, "{out:#?}");
    // Two routing calls, the plan, two steps, the synthesis.
    assert_eq!(s.fake.calls("plan"), 6);
    assert_eq!(out.iter().filter_map(|r| r.in_token).sum::<u64>(), 54);
    s.stop().await;
}

/// An unknown pattern is one `agent-error` record naming the known patterns; no model call.
#[tokio::test]
async fn an_unknown_pattern_is_one_error_record() {
    let s = Setup::new("plan", 5).await;
    let out = whole_dialog(&s, &plan_request(Some("tree-of-thought"), true)).await;
    assert_eq!(shape(&out), ["error.!"], "{out:#?}");
    let e = out[0].error.as_ref().unwrap();
    assert_eq!(e.kind, "agent-error", "{e:?}");
    assert!(
        e.message
            .contains("the known patterns are react, plan-then-execute, supervisor"),
        "{}",
        e.message
    );
    assert_eq!(s.fake.calls("plan"), 0);
    assert_metrics_soon(
        || s.metrics(),
        &[r#"sluice_agent_dialogs_total{outcome="error"} 1"#],
    )
    .await;
    s.stop().await;
}

/// A model that never answers the planning prompt with a plan: one corrective retry, then one
/// `agent-error` record saying what was wrong; the dialog does not hang.
#[tokio::test]
async fn a_plan_malformed_twice_is_one_error_record() {
    let s = Setup::new("plan-malformed", 5).await;
    let out = whole_dialog(&s, &plan_request(Some("plan-then-execute"), true)).await;
    assert_eq!(shape(&out), ["error.!"], "{out:#?}");
    let e = out[0].error.as_ref().unwrap();
    assert_eq!(e.kind, "agent-error", "{e:?}");
    assert!(
        e.message.contains(
            "plan-create answer was not usable twice: the answer has no JSON object or list"
        ),
        "{}",
        e.message
    );
    assert_eq!(s.fake.calls("plan-malformed"), 2);
    assert_eq!(out[0].in_token, Some(18), "both calls' usage on the error");
    assert_metrics_soon(
        || s.metrics(),
        &[
            r#"sluice_agent_iterations_total{outcome="retry"} 1"#,
            r#"sluice_agent_dialogs_total{outcome="error"} 1"#,
        ],
    )
    .await;
    s.stop().await;
}

/// The agent dies while a plan's synthesis is in flight (the fake holds it behind its gate):
/// another replica repeats only the synthesis; the plan and its steps' tools are not redone.
#[tokio::test]
async fn a_killed_agent_mid_plan_repeats_only_its_iteration() {
    let mut s = Setup::new("plan-gated", 5).await;
    let mut stream = s
        .client
        .request(&plan_request(Some("plan-then-execute"), true))
        .await
        .unwrap();
    let mut items: Vec<Received<AgentResponse>> = Vec::new();
    // Up to the synthesis's first piece, sent before the gate.
    loop {
        let item = next(&mut stream).await.unwrap().unwrap();
        let answer =
            matches!(&item, Received::Record(r) if r.message_type == AgentMessageType::Answer);
        items.push(item);
        if answer {
            break;
        }
    }
    let survivor = s.start_agent().await;
    let doomed = std::mem::replace(&mut s.agent, survivor);
    let doomed = doomed.kill().await;
    loop {
        let item = next(&mut stream).await.unwrap().unwrap();
        let answer =
            matches!(&item, Received::Record(r) if r.message_type == AgentMessageType::Answer);
        let restarted = items.iter().any(|i| matches!(i, Received::Restarted));
        items.push(item);
        if restarted && answer {
            break;
        }
    }
    s.fake.open_gate();
    s.fake.open_gate();
    while let Some(item) = next(&mut stream).await {
        items.push(item.unwrap());
    }
    assert_eq!(
        shape_of(&items),
        [
            "thought.",
            "observation.",
            "thought.",
            "observation.",
            "thought.",
            "answer",
            "<restarted>",
            "thought.",
            "answer",
            "answer.!"
        ],
        "{items:#?}"
    );
    // The plan and both steps ran once (one adder call); the synthesis twice.
    assert_eq!(s.mcp.calls(), 1);
    assert_eq!(s.fake.calls("plan-gated"), 5);
    assert_metrics(
        &doomed.render(),
        &[r#"sluice_agent_iterations_total{outcome="action"} 3"#],
    );
    let survived = s.metrics();
    assert_metrics(
        &survived,
        &[r#"sluice_agent_dialogs_total{outcome="answer"} 1"#],
    );
    assert!(
        !survived.contains("sluice_agent_tool_calls_total"),
        "the survivor called no tool"
    );
    s.stop().await;
}
