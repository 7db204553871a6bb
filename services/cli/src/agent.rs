//! `sluice agent`: the agent processor as a process. It calls text-completion (and, for
//! prompt tools, the prompt service) over the bus and hands each next step back to its own
//! request topic.

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::Args;
use sluice_agent::{
    fanin::FanIn,
    flows::{AgentFlowSettings, AgentFlows, PromptTopics, assemble},
    handler::{
        AgentLimits, AgentService, DEFAULT_REACT_TEMPLATE, NonStreaming, PlainAnswer, ToolCalling,
    },
    metrics::AgentMetrics,
    patterns::route::Routing,
    tools,
};
use sluice_runtime::{
    bus::Bus, flows::run_flows_until_signalled, processor::run_until_signalled,
    telemetry::Telemetry,
};
use sluice_schema::{TopicMapping, TopicName, topics::defaults};
use tokio_util::sync::CancellationToken;

use crate::common::{
    BusArgs, ConfigFileArgs, ConfigServiceArgs, LlmClient, LlmServiceArgs, ProcessorArgs, connect,
    processor_config,
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
    /// A pattern's prompt template replacing the built-in one, as NAME=FILE (minijinja; NAME one
    /// of task-type-classify, pattern-select, plan-create, plan-step-execute, plan-synthesise;
    /// see docs/agent.md, "Patterns"). Repeat for each template replaced.
    #[arg(long = "pattern-template", value_name = "NAME=FILE")]
    pub pattern_templates: Vec<String>,
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
    /// The supervisor pattern's most goals (subagents) per question.
    #[arg(long, env = "SLUICE_MAX_SUBAGENTS", default_value_t = sluice_agent::patterns::supervisor::DEFAULT_MAX_SUBAGENTS)]
    pub max_subagents: usize,
    /// Seconds a supervisor waits for its subagents before it answers with what came back
    /// (within the dialog's time). The caller sees no record meanwhile: keep it below the
    /// callers' inactivity timeout (120 s by default).
    #[arg(long, env = "SLUICE_FANIN_TIMEOUT_SECS",
          default_value_t = sluice_agent::fanin::DEFAULT_FANIN_TIMEOUT.as_secs())]
    pub fanin_timeout_secs: u64,
    /// The supervisor's fan-in topic (docs/agent.md#the-supervisor-and-its-fan-in): every
    /// replica's joiner asks for it, one holds it. Persistent under either topic mapping.
    #[arg(long, env = "SLUICE_FANIN_TOPIC", default_value = sluice_agent::fanin::DEFAULT_FANIN_TOPIC)]
    pub fanin_topic: String,
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

impl AgentArgs {
    /// The dialog's limits and modes these options describe.
    pub fn limits(&self) -> Result<AgentLimits, String> {
        Ok(AgentLimits {
            max_iterations: self.max_iterations.max(1),
            dialog_timeout: Duration::from_secs(self.dialog_timeout_secs),
            tool_timeout: Duration::from_secs(self.tool_timeout_secs),
            plain_answer: self.plain_answer.parse()?,
            non_streaming: self.non_streaming.parse()?,
            tool_calling: self.tool_calling.parse()?,
            max_subagents: self.max_subagents.max(1),
            fanin_timeout: Duration::from_secs(self.fanin_timeout_secs),
        })
    }

    /// The pattern templates replacing built-in ones: (name, the file's text).
    fn pattern_templates(&self) -> Result<Vec<(String, String)>, String> {
        self.pattern_templates
            .iter()
            .map(|spec| {
                let (name, path) = spec
                    .split_once('=')
                    .ok_or_else(|| format!("--pattern-template {spec:?}: expected NAME=FILE"))?;
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read the {name} template {path}: {e}"))?;
                Ok((name.to_owned(), text))
            })
            .collect()
    }

    /// The ReAct template: the file's, or the built-in one.
    fn react_template(&self) -> Result<String, String> {
        match &self.react_template {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the ReAct template {}: {e}", path.display())),
            None => Ok(DEFAULT_REACT_TEMPLATE.to_owned()),
        }
    }
}

/// The agent handler `args` describe, on `bus`; `request_topic` is its own (for hand-offs),
/// and the supervisor's fan-in joiner to run beside it. Its metrics are registered on
/// `telemetry`'s registry.
pub async fn agent_service(
    args: &AgentArgs,
    llm: Arc<LlmClient>,
    bus: Arc<dyn Bus>,
    mapping: TopicMapping,
    request_topic: &str,
    telemetry: &Telemetry,
) -> Result<(AgentService, FanIn), String> {
    let metrics = AgentMetrics::register(&telemetry.registry).map_err(|e| e.to_string())?;
    let (configs, routing) = match &args.tools {
        Some(path) => (
            tools::load(path).map_err(|e| e.to_string())?,
            tools::load_routing(path).map_err(|e| e.to_string())?,
        ),
        None => (Vec::new(), Routing::default()),
    };
    let topic = |t: &str| -> Result<String, String> {
        t.parse::<TopicName>()
            .map(|n| n.to_pulsar(mapping))
            .map_err(|e| e.to_string())
    };
    let prompt_topics = PromptTopics {
        request: topic(&args.prompt_request_topic)?,
        response: topic(&args.prompt_response_topic)?,
        cancel: topic(&args.prompt_cancel_topic)?,
    };
    let limits = args.limits()?;
    let fanin_timeout = limits.fanin_timeout;
    let (service, _prompt) = assemble(
        limits,
        &args.react_template()?,
        configs,
        llm,
        &bus,
        mapping,
        request_topic,
        &prompt_topics,
        metrics.clone(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut service = service.with_routing(routing);
    for (name, text) in args.pattern_templates()? {
        service = service
            .with_template(&name, &text)
            .map_err(|e| e.to_string())?;
    }
    let fanin_topic = topic(&args.fanin_topic)?;
    let publisher = |t: String| {
        let bus = bus.clone();
        async move {
            bus.publisher(&t)
                .await
                .map_err(|e| format!("cannot publish on {t}: {e}"))
        }
    };
    let service = service.with_fanin(publisher(fanin_topic.clone()).await?);
    let fanin = FanIn {
        bus: bus.clone(),
        topic: fanin_topic,
        next_step: publisher(request_topic.to_owned()).await?,
        metrics,
        timeout: fanin_timeout,
    };
    Ok((service, fanin))
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
        let settings = AgentFlowSettings {
            limits: args.agent.limits()?,
            template: args.agent.react_template()?,
            pattern_templates: args.agent.pattern_templates()?,
            llm: args.llm.client_config(mapping)?,
        };
        let service = Arc::new(
            AgentFlows::new(
                bus.clone(),
                mapping,
                telemetry.clone(),
                settings,
                flows.processor_id.clone(),
            )
            .map_err(|e| e.to_string())?,
        );
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
    let (handler, fanin) = agent_service(
        &args.agent,
        llm.clone(),
        bus.clone(),
        args.bus.topic_mapping,
        &config.request_topic,
        &telemetry,
    )
    .await?;
    // The fan-in joiner runs beside the processor until it has drained: then another
    // replica's takes the fan-in over.
    let fanin_stop = CancellationToken::new();
    let joiner = tokio::spawn(fanin.run(fanin_stop.clone()));
    let result = run_until_signalled(
        bus,
        config,
        Arc::new(handler),
        telemetry,
        args.processor.metrics_addr,
    )
    .await
    .map_err(|e| e.to_string());
    fanin_stop.cancel();
    let _ = joiner.await;
    llm.close().await;
    result.map(|_| ())
}
