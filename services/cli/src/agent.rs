//! `sluice agent`: the agent processor as a process. It calls text-completion (and, for
//! prompt tools, the prompt service) over the bus and hands each next step back to its own
//! request topic.

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use clap::Args;
use serde_json::Value;
use sluice_agent::{
    handler::{
        AgentLimits, AgentService, DEFAULT_REACT_TEMPLATE, NonStreaming, PlainAnswer, ToolCalling,
    },
    mcp::{McpClient, McpTimeouts},
    metrics::AgentMetrics,
    tools::{self, AnyResponse, Backend, Tool, ToolKind},
};
use sluice_prompt::handler::LlmClient;
use sluice_runtime::{
    bus::Bus,
    client::{ClientConfig, RequestClient},
    flows::{FlowKey, FlowService, flow_topic, run_flows_until_signalled},
    processor::run_until_signalled,
    telemetry::Telemetry,
};
use sluice_schema::{
    PromptRequest, PromptResponse, TopicMapping, TopicName, config::FlowDefinition,
    topics::defaults,
};
use tracing::warn;

use crate::{
    common::{
        BusArgs, ConfigFileArgs, ConfigServiceArgs, ProcessorArgs, cancel_topic, connect,
        processor_config,
    },
    prompt::LlmServiceArgs,
};

/// The agent's tools and limits (shared by `agent` and `serve`).
#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// The tools file (JSON, `{"tools": [...]}`; see docs/agent.md, "Tools"). Without one the agent
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
    /// What a non-streaming request (`streaming: false`) gets: `answer`, one record with the answer
    /// and the whole dialog's usage (TrustGraph's streaming spec
    /// (docs/specs.md#trustgraphs-streaming-spec)); `steps`, every thought, action and observation
    /// whole before the answer (TrustGraph 2.x's multipart reply).
    #[arg(long, env = "SLUICE_AGENT_NON_STREAMING", default_value = "answer",
          value_parser = clap::builder::PossibleValuesParser::new(NonStreaming::NAMES))]
    pub non_streaming: String,
    /// How the model calls tools: `react`, the ReAct text format parsed from its text (any
    /// model); `native`, the provider's own tool calling (several calls per turn, arguments
    /// checked against each tool's schema; the text-completion processor's provider must
    /// call tools: docs/agent.md).
    #[arg(long, env = "SLUICE_TOOL_CALLING", default_value = "react",
          value_parser = clap::builder::PossibleValuesParser::new(ToolCalling::NAMES))]
    pub tool_calling: String,
    /// The prompt service's request topic (for prompt tools).
    #[arg(long, default_value = defaults::PROMPT_REQUEST)]
    pub prompt_request_topic: String,
    /// The prompt service's response topic.
    #[arg(long, default_value = defaults::PROMPT_RESPONSE)]
    pub prompt_response_topic: String,
    /// The prompt service's cancel topic.
    #[arg(long, default_value = defaults::PROMPT_CANCEL)]
    pub prompt_cancel_topic: String,
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
    let topic = |t: &str| -> Result<String, String> {
        t.parse::<TopicName>()
            .map(|n| n.to_pulsar(mapping))
            .map_err(|e| e.to_string())
    };
    let prompt_topics = (
        topic(&args.prompt_request_topic)?,
        topic(&args.prompt_response_topic)?,
        topic(&args.prompt_cancel_topic)?,
    );
    let template = react_template(args)?;
    let (service, _prompt) = build_agent(
        args,
        configs,
        llm,
        &bus,
        mapping,
        request_topic,
        prompt_topics,
        &template,
        metrics,
    )
    .await?;
    Ok(service)
}

fn react_template(args: &AgentArgs) -> Result<String, String> {
    match &args.react_template {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the ReAct template {}: {e}", path.display())),
        None => Ok(DEFAULT_REACT_TEMPLATE.to_owned()),
    }
}

type PromptClient = RequestClient<PromptRequest, PromptResponse>;

/// An agent with `configs` for tools; prompt tools call the prompt service on
/// `prompt_topics` (Pulsar URLs), through a client returned for closing.
#[allow(clippy::too_many_arguments)]
async fn build_agent(
    args: &AgentArgs,
    configs: Vec<tools::ToolConfig>,
    llm: Arc<LlmClient>,
    bus: &Arc<dyn Bus>,
    mapping: TopicMapping,
    request_topic: &str,
    prompt_topics: (String, String, String),
    template: &str,
    metrics: AgentMetrics,
) -> Result<(AgentService, Option<Arc<PromptClient>>), String> {
    let topic = |t: &str| -> Result<String, String> {
        t.parse::<TopicName>()
            .map(|n| n.to_pulsar(mapping))
            .map_err(|e| e.to_string())
    };
    let mut prompt_client: Option<Arc<PromptClient>> = None;
    let mut tools = Vec::new();
    for config in configs {
        let backend = match &config.kind {
            ToolKind::Prompt { .. } => {
                let client = match &prompt_client {
                    Some(c) => c.clone(),
                    None => {
                        let mut cc = ClientConfig::new(
                            "prompt",
                            prompt_topics.0.clone(),
                            prompt_topics.1.clone(),
                        );
                        cc.cancel_topic = Some(prompt_topics.2.clone());
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
            ToolKind::Mcp {
                url,
                token_env,
                token,
                ..
            } => {
                let token = match token {
                    Some(t) => Some(t.clone()),
                    None => tools::token(token_env.as_deref())?,
                };
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
        non_streaming: args.non_streaming.parse()?,
        tool_calling: args.tool_calling.parse()?,
    };
    let service = AgentService::new(llm, tools, next_step, template, limits, metrics)
        .map_err(|e| e.to_string())?;
    Ok((service, prompt_client))
}

/// The agent flows TrustGraph's config service assigns (TrustGraph's `agent-manager`). Each
/// flow calls text-completion and the prompt service on its own topics
/// (`text-completion-request`/`-response`, `prompt-request`/`-response`) and hands its next
/// steps to its own `request` topic; its tools are the workspace's `tool` entries (with the
/// `mcp` entries the MCP tools name). When those change, the workspace's flows restart with
/// the new tools: dialogs in flight go on at their next step, which the new consumer takes.
struct Flows {
    bus: Arc<dyn Bus>,
    mapping: TopicMapping,
    telemetry: Telemetry,
    args: AgentArgs,
    llm: LlmServiceArgs,
    metrics: AgentMetrics,
    template: String,
    processor_id: String,
    /// (workspace, `tool` or `mcp`) -> entries.
    entries: std::sync::Mutex<BTreeMap<(String, String), BTreeMap<String, String>>>,
    /// Each flow's clients, oldest first: a restarted flow's new instance starts before the
    /// old one has drained, and instances stop in the order they started.
    clients: tokio::sync::Mutex<BTreeMap<FlowKey, Vec<FlowClients>>>,
    /// Numbers each flow instance's readiness entry, so that one instance's going away
    /// leaves the other's.
    instances: std::sync::atomic::AtomicU64,
}

/// One flow instance's clients, and the name its text-completion client is watched under.
type FlowClients = (Arc<LlmClient>, Option<Arc<PromptClient>>, String);

impl Flows {
    fn entries(&self, workspace: &str, kind: &str) -> BTreeMap<String, String> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(workspace.to_owned(), kind.to_owned()))
            .cloned()
            .unwrap_or_default()
    }
}

#[async_trait]
impl FlowService for Flows {
    type Handler = AgentService;

    fn config_types(&self) -> Vec<String> {
        vec!["mcp".to_owned(), "tool".to_owned()]
    }

    fn restarts_flows(&self, _kind: &str) -> bool {
        true
    }

    async fn configure(
        &self,
        workspace: &str,
        kind: &str,
        entries: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert((workspace.to_owned(), kind.to_owned()), entries.clone());
        Ok(())
    }

    async fn flow(
        &self,
        key: &FlowKey,
        definition: &FlowDefinition,
    ) -> Result<Arc<AgentService>, String> {
        let request_topic = flow_topic(definition, "request", self.mapping)?;
        let (configs, problems) = tools::from_trustgraph_config(
            &self.entries(&key.workspace, "tool"),
            &self.entries(&key.workspace, "mcp"),
        );
        for problem in &problems {
            self.telemetry.metrics.config_failed(&self.processor_id);
            warn!(flow = %key, "{problem}; the tool is left out");
        }
        let needs_prompt = configs
            .iter()
            .any(|c| matches!(c.kind, ToolKind::Prompt { .. }));
        let prompt_topics = if needs_prompt {
            (
                flow_topic(definition, "prompt-request", self.mapping)?,
                flow_topic(definition, "prompt-response", self.mapping)?,
                // TrustGraph's flows have no cancel topics: sluice's default.
                cancel_topic("prompt", None)?.to_pulsar(self.mapping),
            )
        } else {
            (String::new(), String::new(), String::new())
        };
        let instance = self
            .instances
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let link_name = format!("text-completion responses of agent flow {key} ({instance})");
        let llm = self
            .llm
            .client_on(
                self.bus.clone(),
                flow_topic(definition, "text-completion-request", self.mapping)?,
                flow_topic(definition, "text-completion-response", self.mapping)?,
                self.mapping,
                &self.telemetry,
                &link_name,
            )
            .await?;
        let built = build_agent(
            &self.args,
            configs,
            llm.clone(),
            &self.bus,
            self.mapping,
            &request_topic,
            prompt_topics,
            &self.template,
            self.metrics.clone(),
        )
        .await;
        let (service, prompt) = match built {
            Ok(b) => b,
            Err(e) => {
                self.telemetry.health.unwatch(&link_name);
                llm.close().await;
                return Err(e);
            }
        };
        self.clients
            .lock()
            .await
            .entry(key.clone())
            .or_default()
            .push((llm, prompt, link_name));
        Ok(Arc::new(service))
    }

    async fn flow_stopped(&self, key: &FlowKey, _definition: &FlowDefinition) {
        let oldest = {
            let mut clients = self.clients.lock().await;
            let oldest = clients
                .get_mut(key)
                .filter(|v| !v.is_empty())
                .map(|v| v.remove(0));
            if clients.get(key).is_some_and(Vec::is_empty) {
                clients.remove(key);
            }
            oldest
        };
        if let Some((llm, prompt, link_name)) = oldest {
            self.telemetry.health.unwatch(&link_name);
            llm.close().await;
            if let Some(p) = prompt {
                p.close().await;
            }
        }
    }
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
    flows: ConfigServiceArgs,
    #[command(flatten)]
    agent: AgentArgs,
    #[command(flatten)]
    llm: LlmServiceArgs,
}

/// Runs the agent processor until SIGTERM/SIGINT, then drains.
pub async fn run(args: AgentCommand) -> Result<(), String> {
    let telemetry = Telemetry::new().map_err(|e| e.to_string())?;
    let mapping = args.bus.topic_mapping;
    let (config, mut topics) = processor_config("agent", &args.processor, mapping)?;
    if let Some(flows) = args
        .flows
        .flows("agent-manager", mapping, &args.processor, &config)?
    {
        if args.agent.tools.is_some() {
            return Err("--config-service takes tools from the config (types `tool` and `mcp`); leave out --tools".into());
        }
        topics.extend(args.flows.topic_names()?);
        let bus = connect(&args.bus, &topics).await?;
        let service = Arc::new(Flows {
            bus: bus.clone(),
            mapping,
            telemetry: telemetry.clone(),
            metrics: AgentMetrics::register(&telemetry.registry).map_err(|e| e.to_string())?,
            template: react_template(&args.agent)?,
            args: args.agent.clone(),
            llm: args.llm.clone(),
            processor_id: flows.processor_id.clone(),
            entries: std::sync::Mutex::default(),
            clients: tokio::sync::Mutex::default(),
            instances: std::sync::atomic::AtomicU64::new(0),
        });
        run_flows_until_signalled(bus, flows, service, telemetry, args.processor.metrics_addr)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
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
