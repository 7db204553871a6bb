//! `sluice agent`: the agent processor as a process. It calls text-completion (and, for
//! prompt tools, the prompt service) over the bus and hands each next step back to its own
//! request topic.

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::Args;
use serde_json::Value;
use sluice_agent::{
    handler::{AgentLimits, AgentService, DEFAULT_REACT_TEMPLATE, PlainAnswer},
    mcp::{McpClient, McpTimeouts},
    metrics::AgentMetrics,
    tools::{self, AnyResponse, Backend, Tool, ToolKind},
};
use sluice_prompt::handler::LlmClient;
use sluice_runtime::{
    bus::Bus,
    client::{ClientConfig, RequestClient},
    processor::run_until_signalled,
    telemetry::Telemetry,
};
use sluice_schema::{PromptRequest, PromptResponse, TopicMapping, TopicName};

use crate::{
    common::{BusArgs, ConfigFileArgs, ProcessorArgs, cancel_topic, connect, processor_config},
    prompt::LlmServiceArgs,
};

/// The agent's tools and limits (shared by `agent` and `serve`).
#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// The tools file (JSON, `{"tools": [...]}`; see the README). Without one the agent
    /// answers from the model alone.
    #[arg(long, env = "SLUICE_TOOLS")]
    pub tools: Option<PathBuf>,
    /// A ReAct prompt template (minijinja; `question`, `tools`, `tool_names`, `history`)
    /// replacing the built-in one.
    #[arg(long, env = "SLUICE_REACT_TEMPLATE")]
    pub react_template: Option<PathBuf>,
    /// Tool calls before the dialog ends without an answer.
    #[arg(long, env = "SLUICE_MAX_ITERATIONS", default_value_t = 10)]
    pub max_iterations: usize,
    /// Seconds the whole dialog may take.
    #[arg(long, env = "SLUICE_DIALOG_TIMEOUT_SECS", default_value_t = 600)]
    pub dialog_timeout_secs: u64,
    /// Seconds one tool call may take.
    #[arg(long, env = "SLUICE_TOOL_TIMEOUT_SECS", default_value_t = 120)]
    pub tool_timeout_secs: u64,
    /// What to do when the model answers in plain prose, without `Thought:`/`Final Answer:`
    /// markers: `final` takes the prose as the final answer at once; `retry-final` asks
    /// once more in the format and, if the answer is prose again, takes the first prose;
    /// `error` asks once more, then ends the dialog with an agent-error.
    #[arg(long, env = "SLUICE_PLAIN_ANSWER", default_value = "retry-final",
          value_parser = clap::builder::PossibleValuesParser::new(PlainAnswer::NAMES))]
    pub plain_answer: String,
    /// The prompt service's request topic (for prompt tools).
    #[arg(long, default_value = "request:tg:prompt")]
    pub prompt_request_topic: String,
    /// The prompt service's response topic.
    #[arg(long, default_value = "response:tg:prompt")]
    pub prompt_response_topic: String,
}

/// The agent handler `args` describe, on `bus`; `request_topic` is its own (for hand-offs).
/// Its metrics are registered on `telemetry`'s registry.
pub async fn agent_service(
    args: &AgentArgs,
    llm: Arc<LlmClient>,
    bus: Arc<dyn Bus>,
    mapping: TopicMapping,
    request_topic: &str,
    telemetry: &Telemetry,
) -> Result<AgentService, String> {
    let metrics = AgentMetrics::register(&telemetry.registry).map_err(|e| e.to_string())?;
    let configs = match &args.tools {
        Some(path) => tools::load(path).map_err(|e| e.to_string())?,
        None => Vec::new(),
    };
    let template = match &args.react_template {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the ReAct template {}: {e}", path.display()))?,
        None => DEFAULT_REACT_TEMPLATE.to_owned(),
    };
    let topic = |t: &str| -> Result<String, String> {
        t.parse::<TopicName>()
            .map(|n| n.to_pulsar(mapping))
            .map_err(|e| e.to_string())
    };
    let mut prompt_client: Option<Arc<RequestClient<PromptRequest, PromptResponse>>> = None;
    let mut tools = Vec::new();
    for config in configs {
        let backend = match &config.kind {
            ToolKind::Prompt { .. } => {
                let client = match &prompt_client {
                    Some(c) => c.clone(),
                    None => {
                        let mut cc = ClientConfig::new(
                            "prompt",
                            topic(&args.prompt_request_topic)?,
                            topic(&args.prompt_response_topic)?,
                        );
                        cc.cancel_topic = Some(cancel_topic("prompt", None)?.to_pulsar(mapping));
                        let c = Arc::new(
                            RequestClient::start(bus.clone(), cc, None)
                                .await
                                .map_err(|e| format!("cannot reach the prompt service: {e}"))?,
                        );
                        prompt_client = Some(c.clone());
                        c
                    }
                };
                Backend::Prompt(client)
            }
            ToolKind::TextCompletion { .. } => Backend::TextCompletion(llm.clone()),
            ToolKind::Mcp { url, token_env, .. } => {
                let token = tools::token(token_env.as_deref())?;
                Backend::Mcp(mcp_client(
                    url,
                    token,
                    Duration::from_secs(args.tool_timeout_secs),
                )?)
            }
            ToolKind::Service {
                request_topic,
                response_topic,
            } => {
                let cc = ClientConfig::new(
                    format!("tool-{}", config.name),
                    topic(request_topic)?,
                    topic(response_topic)?,
                );
                Backend::Service(
                    RequestClient::<Value, AnyResponse>::start(bus.clone(), cc, None)
                        .await
                        .map_err(|e| {
                            format!("tool {:?}: cannot reach its topics: {e}", config.name)
                        })?,
                )
            }
        };
        tools.push(Arc::new(Tool { config, backend }));
    }
    let next_step = bus
        .publisher(request_topic)
        .await
        .map_err(|e| format!("cannot publish to the agent's own request topic: {e}"))?;
    let limits = AgentLimits {
        max_iterations: args.max_iterations.max(1),
        dialog_timeout: Duration::from_secs(args.dialog_timeout_secs),
        tool_timeout: Duration::from_secs(args.tool_timeout_secs),
        plain_answer: args.plain_answer.parse()?,
    };
    AgentService::new(llm, tools, next_step, &template, limits, metrics).map_err(|e| e.to_string())
}

fn mcp_client(
    url: &str,
    token: Option<sluice_runtime::secret::Secret>,
    call_timeout: Duration,
) -> Result<McpClient, String> {
    let timeouts = McpTimeouts {
        call: call_timeout,
        ..McpTimeouts::default()
    };
    McpClient::new(url, token, timeouts).map_err(|e| e.to_string())
}

/// `sluice agent` options.
#[derive(Args, Debug)]
pub struct AgentCommand {
    #[command(flatten)]
    pub config: ConfigFileArgs,
    #[command(flatten)]
    bus: BusArgs,
    #[command(flatten)]
    processor: ProcessorArgs,
    #[command(flatten)]
    agent: AgentArgs,
    #[command(flatten)]
    llm: LlmServiceArgs,
}

/// Runs the agent processor until SIGTERM/SIGINT, then drains.
pub async fn run(args: AgentCommand) -> Result<(), String> {
    let telemetry = Telemetry::new().map_err(|e| e.to_string())?;
    let (config, mut topics) = processor_config("agent", &args.processor, args.bus.topic_mapping)?;
    topics.extend(args.llm.topics()?);
    let bus = connect(&args.bus, &topics).await?;
    let llm = args
        .llm
        .client(bus.clone(), args.bus.topic_mapping, &telemetry)
        .await?;
    let handler = Arc::new(
        agent_service(
            &args.agent,
            llm.clone(),
            bus.clone(),
            args.bus.topic_mapping,
            &config.request_topic,
            &telemetry,
        )
        .await?,
    );
    let result = run_until_signalled(bus, config, handler, telemetry, args.processor.metrics_addr)
        .await
        .map_err(|e| e.to_string());
    llm.close().await;
    result.map(|_| ())
}
