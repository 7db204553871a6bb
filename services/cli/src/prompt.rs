//! `sluice prompt`: the prompt processor as a process. It renders templates and calls the
//! text-completion service over the bus.

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::{
    Args,
    builder::{PossibleValuesParser, TypedValueParser},
};
use sluice_prompt::{
    flows::{PromptFlowSettings, PromptFlows},
    handler::{PromptService, StructuredOutput},
    metrics::PromptMetrics,
    store::TemplateStore,
};
use sluice_runtime::{
    flows::{FlowsConfig, run_flows_until_signalled},
    processor::run_until_signalled,
    telemetry::Telemetry,
};
use sluice_schema::TopicName;
use tokio_util::sync::CancellationToken;

use crate::common::{
    BusArgs, ConfigFileArgs, ConfigServiceArgs, LlmServiceArgs, ProcessorArgs, connect,
    processor_config,
};

/// Where templates come from (shared by `prompt` and `serve`).
#[derive(Args, Debug, Clone)]
pub struct TemplateArgs {
    /// A template file: `{"system": ..., "templates": {"id": {"prompt": ..., "response-type":
    /// "text"|"json"|"jsonl", "schema": {...}, "system": ...}}}`, or TrustGraph's
    /// `template.<id>` config shape. Reloaded on SIGHUP and when it changes.
    #[arg(long, env = "SLUICE_TEMPLATES")]
    pub templates: Option<PathBuf>,
    /// Leave out the built-in templates (knowledge-classification, content-rewording,
    /// integration-decisions).
    #[arg(long)]
    pub no_builtin_templates: bool,
    /// Seconds between checks of the template file for changes.
    #[arg(long, default_value_t = 2)]
    pub template_poll_secs: u64,
    /// Put content in the prompt processor's request log: the prompts sent (`messages`), the
    /// objects received (`data`) and malformed lines (`line`), as the LLM streaming contract
    /// (docs/specs.md#the-structured-ndjson-contracts) logs them. Off by default: without it the
    /// log carries ids, names, counts and positions only.
    #[arg(long, env = "SLUICE_LOG_CONTENT")]
    pub log_content: bool,
    /// How a `json` or `jsonl` template with a schema asks for its answer: `native`, the
    /// provider's JSON mode with the schema (a `jsonl` template's as an array of its
    /// objects, turned back into lines as they complete), the template's own validation
    /// kept as the safety net (on the local model: 0 usable lines without it, most with it);
    /// `off`, the template's instructions only (docs/prompt.md).
    #[arg(long, env = "SLUICE_STRUCTURED_OUTPUT", default_value = "native",
          value_parser = PossibleValuesParser::new(StructuredOutput::NAMES)
              .try_map(|s| s.parse::<StructuredOutput>()))]
    pub structured_output: StructuredOutput,
}

impl TemplateArgs {
    /// Says so at start when content logging is on, so nobody is surprised by prompts in the
    /// logs.
    pub fn announce_content_logging(&self) {
        if self.log_content {
            tracing::warn!(
                "content logging is on (--log-content): prompts, answers and malformed lines are written to the log"
            );
        }
    }
}

/// The template store `args` describe, watched for changes until `stop`.
pub fn template_store(
    args: &TemplateArgs,
    telemetry: &Telemetry,
    stop: CancellationToken,
) -> Result<(Arc<TemplateStore>, PromptMetrics), String> {
    let metrics = PromptMetrics::register(&telemetry.registry).map_err(|e| e.to_string())?;
    let store = TemplateStore::open(
        args.templates.clone(),
        !args.no_builtin_templates,
        Some(metrics.clone()),
    )
    .map_err(|e| e.to_string())?;
    store
        .clone()
        .watch(Duration::from_secs(args.template_poll_secs.max(1)), stop);
    Ok((store, metrics))
}

/// `sluice prompt` options.
#[derive(Args, Debug)]
pub struct PromptCommand {
    #[command(flatten)]
    pub config: ConfigFileArgs,
    #[command(flatten)]
    bus: BusArgs,
    #[command(flatten)]
    processor: ProcessorArgs,
    #[command(flatten)]
    flows: ConfigServiceArgs,
    #[command(flatten)]
    templates: TemplateArgs,
    #[command(flatten)]
    llm: LlmServiceArgs,
}

/// Serves the flows of TrustGraph's config service until SIGTERM/SIGINT.
async fn run_flows(
    args: PromptCommand,
    flows: FlowsConfig,
    mut topics: Vec<TopicName>,
    telemetry: Telemetry,
) -> Result<(), String> {
    let mapping = args.bus.topic_mapping;
    topics.extend(args.flows.topic_names()?);
    let bus = connect(&args.bus, &topics).await?;
    let settings = PromptFlowSettings {
        llm: args.llm.client_config(mapping)?,
        builtins: !args.templates.no_builtin_templates,
        log_content: args.templates.log_content,
        structured_output: args.templates.structured_output,
    };
    let service = Arc::new(
        PromptFlows::new(bus.clone(), mapping, telemetry.clone(), settings)
            .map_err(|e| e.to_string())?,
    );
    run_flows_until_signalled(bus, flows, service, telemetry, args.processor.metrics_addr)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Runs the prompt processor until SIGTERM/SIGINT, then drains.
pub async fn run(args: PromptCommand) -> Result<(), String> {
    let telemetry = Telemetry::new().map_err(|e| e.to_string())?;
    args.templates.announce_content_logging();
    let (config, mut topics) = processor_config("prompt", &args.processor, args.bus.topic_mapping)?;
    if let Some(flows) =
        args.flows
            .flows("prompt", args.bus.topic_mapping, &args.processor, &config)?
    {
        if args.templates.templates.is_some() {
            return Err("--config-service takes templates from the config (type `prompt`); leave out --templates".into());
        }
        return run_flows(args, flows, topics, telemetry).await;
    }
    let stop_watching = CancellationToken::new();
    let (store, metrics) = template_store(&args.templates, &telemetry, stop_watching.clone())?;
    topics.extend(args.llm.topics()?);
    let bus = connect(&args.bus, &topics).await?;
    let llm = args
        .llm
        .client(bus.clone(), args.bus.topic_mapping, &telemetry)
        .await?;
    let handler = Arc::new(
        PromptService::new(store, llm.clone(), metrics)
            .with_content_logging(args.templates.log_content)
            .with_structured_output(args.templates.structured_output),
    );
    let result = run_until_signalled(bus, config, handler, telemetry, args.processor.metrics_addr)
        .await
        .map_err(|e| e.to_string());
    stop_watching.cancel();
    llm.close().await;
    result.map(|_| ())
}
