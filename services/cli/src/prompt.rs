//! `sluice prompt`: the prompt processor as a process. It renders templates and calls the
//! text-completion service over the bus.

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use clap::Args;
use sluice_prompt::{
    handler::{LlmClient, PromptService},
    metrics::PromptMetrics,
    store::TemplateStore,
    templates::TemplateSet,
};
use sluice_runtime::{
    bus::Bus,
    client::{ClientConfig, RequestClient},
    flows::{FlowKey, FlowService, FlowsConfig, flow_topic, run_flows_until_signalled},
    processor::run_until_signalled,
    telemetry::Telemetry,
};
use sluice_schema::{TopicMapping, TopicName, config::FlowDefinition, topics::defaults};
use tokio_util::sync::CancellationToken;

use crate::common::{
    BusArgs, ConfigFileArgs, ConfigServiceArgs, ProcessorArgs, cancel_topic, connect,
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
    /// objects received (`data`) and malformed lines (`line_text`), as the LLM streaming contract
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
          value_parser = ["native", "off"])]
    pub structured_output: String,
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

/// How the prompt processor reaches text-completion (shared by `prompt` and `serve`).
#[derive(Args, Debug, Clone)]
pub struct LlmServiceArgs {
    /// text-completion's request topic.
    #[arg(long, default_value = defaults::TEXT_COMPLETION_REQUEST)]
    pub llm_request_topic: String,
    /// text-completion's response topic.
    #[arg(long, default_value = defaults::TEXT_COMPLETION_RESPONSE)]
    pub llm_response_topic: String,
    /// text-completion's cancel topic.
    #[arg(long, default_value = defaults::TEXT_COMPLETION_CANCEL)]
    pub llm_cancel_topic: String,
    /// Seconds text-completion may stay silent.
    #[arg(long, default_value_t = 120)]
    pub llm_inactivity_timeout_secs: u64,
    /// Seconds a completion may take in all.
    #[arg(long, default_value_t = 600)]
    pub llm_timeout_secs: u64,
}

impl LlmServiceArgs {
    /// A text-completion client on the given topics (Pulsar URLs); readiness watches its
    /// response subscription under `link_name`.
    pub async fn client_on(
        &self,
        bus: Arc<dyn Bus>,
        request_topic: String,
        response_topic: String,
        mapping: TopicMapping,
        telemetry: &Telemetry,
        link_name: &str,
    ) -> Result<Arc<LlmClient>, String> {
        let mut config = ClientConfig::new("text-completion", request_topic, response_topic);
        config.cancel_topic =
            Some(cancel_topic("text-completion", Some(&self.llm_cancel_topic))?.to_pulsar(mapping));
        config.inactivity_timeout = Duration::from_secs(self.llm_inactivity_timeout_secs);
        config.total_timeout = Duration::from_secs(self.llm_timeout_secs);
        let client = RequestClient::start(bus, config, Some(telemetry.metrics.clone()))
            .await
            .map_err(|e| format!("cannot reach text-completion's topics: {e}"))?;
        telemetry.health.watch(link_name, client.link());
        Ok(Arc::new(client))
    }

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
    flows: ConfigServiceArgs,
    #[command(flatten)]
    templates: TemplateArgs,
    #[command(flatten)]
    llm: LlmServiceArgs,
}

/// The prompt flows TrustGraph's config service assigns. Templates come from the config's
/// `prompt` entries of the flow's workspace (built-ins too, unless turned off); each flow
/// calls the text-completion service on its own `text-completion-request` and
/// `text-completion-response` topics, one client per pair of topics, shared by the flows
/// that name the same pair and closed when the last of them stops.
struct Flows {
    bus: Arc<dyn Bus>,
    mapping: TopicMapping,
    telemetry: Telemetry,
    llm: LlmServiceArgs,
    metrics: PromptMetrics,
    builtins: bool,
    log_content: bool,
    native_structured_output: bool,
    stores: std::sync::Mutex<BTreeMap<String, Arc<TemplateStore>>>,
    clients: tokio::sync::Mutex<BTreeMap<(String, String), SharedClient>>,
}

/// A text-completion client and how many flows use it.
type SharedClient = (Arc<LlmClient>, usize);

impl Flows {
    fn store(&self, workspace: &str) -> Result<Arc<TemplateStore>, String> {
        let mut stores = self
            .stores
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(store) = stores.get(workspace) {
            return Ok(store.clone());
        }
        let set = TemplateSet::from_trustgraph_config(&BTreeMap::new(), self.builtins)
            .map_err(|e| e.to_string())?;
        let store = TemplateStore::with_metrics(set, self.metrics.clone());
        stores.insert(workspace.to_owned(), store.clone());
        Ok(store)
    }

    fn llm_topics(&self, definition: &FlowDefinition) -> Result<(String, String), String> {
        Ok((
            flow_topic(definition, "text-completion-request", self.mapping)?,
            flow_topic(definition, "text-completion-response", self.mapping)?,
        ))
    }
}

#[async_trait]
impl FlowService for Flows {
    type Handler = PromptService;

    fn config_types(&self) -> Vec<String> {
        vec!["prompt".to_owned()]
    }

    async fn configure(
        &self,
        workspace: &str,
        _kind: &str,
        entries: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        let store = self.store(workspace)?;
        match TemplateSet::from_trustgraph_config(entries, self.builtins) {
            Ok(set) => {
                store.replace(set);
                Ok(())
            }
            Err(e) => {
                store.load_failed();
                Err(e.to_string())
            }
        }
    }

    async fn flow(
        &self,
        key: &FlowKey,
        definition: &FlowDefinition,
    ) -> Result<Arc<PromptService>, String> {
        let topics = self.llm_topics(definition)?;
        let store = self.store(&key.workspace)?;
        let mut clients = self.clients.lock().await;
        let llm = match clients.get_mut(&topics) {
            Some((client, users)) => {
                *users += 1;
                client.clone()
            }
            None => {
                let client = self
                    .llm
                    .client_on(
                        self.bus.clone(),
                        topics.0.clone(),
                        topics.1.clone(),
                        self.mapping,
                        &self.telemetry,
                        &format!("text-completion responses on {}", topics.1),
                    )
                    .await?;
                clients.insert(topics, (client.clone(), 1));
                client
            }
        };
        Ok(Arc::new(
            PromptService::new(store, llm, self.metrics.clone())
                .with_content_logging(self.log_content)
                .with_native_structured_output(self.native_structured_output),
        ))
    }

    async fn flow_stopped(&self, _key: &FlowKey, definition: &FlowDefinition) {
        let Ok(topics) = self.llm_topics(definition) else {
            return;
        };
        let mut clients = self.clients.lock().await;
        let last = match clients.get_mut(&topics) {
            Some((_, users)) => {
                *users = users.saturating_sub(1);
                *users == 0
            }
            None => false,
        };
        if last && let Some((client, _)) = clients.remove(&topics) {
            self.telemetry
                .health
                .unwatch(&format!("text-completion responses on {}", topics.1));
            client.close().await;
        }
    }
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
    let metrics = PromptMetrics::register(&telemetry.registry).map_err(|e| e.to_string())?;
    let service = Arc::new(Flows {
        bus: bus.clone(),
        mapping,
        telemetry: telemetry.clone(),
        llm: args.llm.clone(),
        metrics,
        builtins: !args.templates.no_builtin_templates,
        log_content: args.templates.log_content,
        native_structured_output: args.templates.structured_output == "native",
        stores: std::sync::Mutex::default(),
        clients: tokio::sync::Mutex::default(),
    });
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
            .with_native_structured_output(args.templates.structured_output == "native"),
    );
    let result = run_until_signalled(bus, config, handler, telemetry, args.processor.metrics_addr)
        .await
        .map_err(|e| e.to_string());
    stop_watching.cancel();
    llm.close().await;
    result.map(|_| ())
}
