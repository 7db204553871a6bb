//! `sluice prompt`: the prompt processor as a process. It renders templates and calls the
//! text-completion service over the bus.

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::Args;
use sluice_prompt::{
    handler::{LlmClient, PromptService},
    metrics::PromptMetrics,
    store::TemplateStore,
};
use sluice_runtime::{
    bus::Bus,
    client::{ClientConfig, RequestClient},
    processor::run_until_signalled,
    telemetry::Telemetry,
};
use sluice_schema::{TopicMapping, TopicName};
use tokio_util::sync::CancellationToken;

use crate::common::{
    BusArgs, ConfigFileArgs, ProcessorArgs, cancel_topic, connect, processor_config,
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
}

/// How the prompt processor reaches text-completion (shared by `prompt` and `serve`).
#[derive(Args, Debug, Clone)]
pub struct LlmServiceArgs {
    /// text-completion's request topic.
    #[arg(long, default_value = "request:tg:text-completion")]
    pub llm_request_topic: String,
    /// text-completion's response topic.
    #[arg(long, default_value = "response:tg:text-completion")]
    pub llm_response_topic: String,
    /// text-completion's cancel topic.
    #[arg(long, default_value = "notify:tg:text-completion-cancel")]
    pub llm_cancel_topic: String,
    /// Seconds text-completion may stay silent.
    #[arg(long, default_value_t = 120)]
    pub llm_inactivity_timeout_secs: u64,
    /// Seconds a completion may take in all.
    #[arg(long, default_value_t = 600)]
    pub llm_timeout_secs: u64,
}

impl LlmServiceArgs {
    /// The topics, for namespace creation.
    pub fn topics(&self) -> Result<Vec<TopicName>, String> {
        [&self.llm_request_topic, &self.llm_response_topic]
            .into_iter()
            .map(|t| t.parse::<TopicName>().map_err(|e| e.to_string()))
            .chain(std::iter::once(cancel_topic(
                "text-completion",
                Some(&self.llm_cancel_topic),
            )))
            .collect()
    }

    /// A text-completion client on `bus`.
    pub async fn client(
        &self,
        bus: Arc<dyn Bus>,
        mapping: TopicMapping,
        telemetry: &Telemetry,
    ) -> Result<Arc<LlmClient>, String> {
        let t = self.topics()?;
        let mut config = ClientConfig::new(
            "text-completion",
            t[0].to_pulsar(mapping),
            t[1].to_pulsar(mapping),
        );
        config.cancel_topic = Some(t[2].to_pulsar(mapping));
        config.inactivity_timeout = Duration::from_secs(self.llm_inactivity_timeout_secs);
        config.total_timeout = Duration::from_secs(self.llm_timeout_secs);
        let client = RequestClient::start(bus, config, Some(telemetry.metrics.clone()))
            .await
            .map_err(|e| format!("cannot reach text-completion's topics: {e}"))?;
        telemetry
            .health
            .watch("text-completion responses", client.link());
        Ok(Arc::new(client))
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
    templates: TemplateArgs,
    #[command(flatten)]
    llm: LlmServiceArgs,
}

/// Runs the prompt processor until SIGTERM/SIGINT, then drains.
pub async fn run(args: PromptCommand) -> Result<(), String> {
    let telemetry = Telemetry::new().map_err(|e| e.to_string())?;
    let stop_watching = CancellationToken::new();
    let (store, metrics) = template_store(&args.templates, &telemetry, stop_watching.clone())?;
    let (config, mut topics) = processor_config("prompt", &args.processor, args.bus.topic_mapping)?;
    topics.extend(args.llm.topics()?);
    let bus = connect(&args.bus, &topics).await?;
    let llm = args
        .llm
        .client(bus.clone(), args.bus.topic_mapping, &telemetry)
        .await?;
    let handler = Arc::new(PromptService::new(store, llm.clone(), metrics));
    let result = run_until_signalled(bus, config, handler, telemetry, args.processor.metrics_addr)
        .await
        .map_err(|e| e.to_string());
    stop_watching.cancel();
    llm.close().await;
    result.map(|_| ())
}
