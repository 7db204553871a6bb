//! An agent assembled from its tools, and the agent flows TrustGraph's config service
//! assigns (TrustGraph's `agent-manager`, see [`sluice_runtime::flows`]). Each flow calls
//! text-completion and the prompt service on its own topics
//! (`text-completion-request`/`-response`, `prompt-request`/`-response`) and hands its next
//! steps to its own `request` topic; its tools are the workspace's `tool` entries (with the
//! `mcp` entries the MCP tools name), and meta-routing chooses from its `agent-task-type` and
//! `agent-pattern` entries. When those change, the workspace's flows restart with
//! the new tools: dialogs in flight go on at their next step, which the new consumer takes.

use std::{collections::BTreeMap, sync::Arc};

use async_trait::async_trait;
use serde_json::Value;
use sluice_runtime::{
    bus::{Bus, BusError},
    client::{ClientConfig, ClientError, RequestClient},
    flows::{FlowError, FlowKey, FlowService, flow_topic},
    secret::SecretError,
    telemetry::Telemetry,
};
use sluice_schema::{
    PromptRequest, PromptResponse, TextCompletionRequest, TextCompletionResponse, TopicError,
    TopicMapping, TopicName, config::FlowDefinition, topics::defaults,
};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::{
    fanin::FanIn,
    handler::{AgentLimits, AgentService, TemplateError},
    mcp::{McpClient, McpError, McpTimeouts},
    metrics::AgentMetrics,
    patterns::route::Routing,
    tools::{self, AnyResponse, Backend, Tool, ToolConfig, ToolKind},
};

/// The text-completion client an agent calls.
pub type LlmClient = RequestClient<TextCompletionRequest, TextCompletionResponse>;

/// The prompt service's client, for prompt tools.
pub type PromptClient = RequestClient<PromptRequest, PromptResponse>;

/// The prompt service's topics (Pulsar URLs), for prompt tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTopics {
    /// Its request topic.
    pub request: String,
    /// Its response topic.
    pub response: String,
    /// Its cancel topic.
    pub cancel: String,
}

/// Why an agent cannot be assembled from its tools.
#[derive(Debug, thiserror::Error)]
pub enum AssembleError {
    /// A service tool names a topic that is not a topic name.
    #[error(transparent)]
    Topic(#[from] TopicError),
    /// The prompt service's topics (for prompt tools) cannot be used.
    #[error("cannot reach the prompt service: {0}")]
    Prompt(ClientError),
    /// An MCP tool's `token-env` names a secret that cannot be read.
    #[error(transparent)]
    Token(#[from] SecretError),
    /// An MCP tool's client cannot be made (its URL).
    #[error(transparent)]
    Mcp(#[from] McpError),
    /// A service tool's topics cannot be used.
    #[error("tool {tool:?}: cannot reach its topics: {source}")]
    Service {
        /// The tool.
        tool: String,
        /// The client's failure.
        source: ClientError,
    },
    /// The agent's own request topic (its next steps) cannot be published to.
    #[error("cannot publish to the agent's own request topic: {0}")]
    NextStep(BusError),
    /// The flow's fan-in topic (the supervisor's) cannot be published to.
    #[error("cannot publish to the agent flow's fan-in topic: {0}")]
    FanIn(BusError),
    /// A prompt template (ReAct's or a pattern's) does not compile.
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// An agent with `configs` for tools, answering through `llm`, handing its next steps to
/// `request_topic` (its own, a Pulsar URL) on `bus`. Prompt tools call the prompt service on
/// `prompt_topics` through one client, returned for closing; service tools' topics are
/// mapped with `mapping`.
#[allow(clippy::too_many_arguments)]
pub async fn assemble(
    limits: AgentLimits,
    template: &str,
    configs: Vec<ToolConfig>,
    llm: Arc<LlmClient>,
    bus: &Arc<dyn Bus>,
    mapping: TopicMapping,
    request_topic: &str,
    prompt_topics: &PromptTopics,
    metrics: AgentMetrics,
) -> Result<(AgentService, Option<Arc<PromptClient>>), AssembleError> {
    let topic = |t: &str| -> Result<String, TopicError> {
        t.parse::<TopicName>().map(|n| n.to_pulsar(mapping))
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
                            prompt_topics.request.clone(),
                            prompt_topics.response.clone(),
                        );
                        cc.cancel_topic = Some(prompt_topics.cancel.clone());
                        let c = Arc::new(
                            RequestClient::start(bus.clone(), cc, None)
                                .await
                                .map_err(AssembleError::Prompt)?,
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
                let timeouts = McpTimeouts {
                    call: limits.tool_timeout,
                    ..McpTimeouts::default()
                };
                Backend::Mcp(McpClient::new(url, token, timeouts)?)
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
                        .map_err(|source| AssembleError::Service {
                            tool: config.name.clone(),
                            source,
                        })?,
                )
            }
        };
        tools.push(Arc::new(Tool { config, backend }));
    }
    let next_step = bus
        .publisher(request_topic)
        .await
        .map_err(AssembleError::NextStep)?;
    let service = AgentService::new(llm, tools, next_step, template, limits, metrics)?;
    Ok((service, prompt_client))
}

/// What every agent flow shares.
#[derive(Debug, Clone)]
pub struct AgentFlowSettings {
    /// The dialog's limits and modes.
    pub limits: AgentLimits,
    /// The ReAct prompt template.
    pub template: String,
    /// Pattern templates replacing the built-in ones (name, text).
    pub pattern_templates: Vec<(String, String)>,
    /// The text-completion client's settings but its topics, which are each flow's.
    pub llm: ClientConfig,
}

/// The agent flows of one processor.
pub struct AgentFlows {
    bus: Arc<dyn Bus>,
    mapping: TopicMapping,
    telemetry: Telemetry,
    settings: AgentFlowSettings,
    metrics: AgentMetrics,
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

/// One flow instance's clients, the name its text-completion client is watched under, and
/// what stops its fan-in joiner.
type FlowClients = (
    Arc<LlmClient>,
    Option<Arc<PromptClient>>,
    String,
    CancellationToken,
);

/// A flow's fan-in topic (the supervisor's, see [`crate::fanin`]): its request topic's, with
/// `-fanin`, persistent whatever the flow's request topic is (the fan-in's state is its
/// messages).
pub fn flow_fanin_topic(request_topic: &str) -> String {
    let durable = match request_topic.strip_prefix("non-persistent://") {
        Some(rest) => format!("persistent://{rest}"),
        None => request_topic.to_owned(),
    };
    format!("{durable}-fanin")
}

impl AgentFlows {
    /// The flows of processor `processor_id` on `bus`, their metrics in `telemetry`'s
    /// registry (registered here).
    pub fn new(
        bus: Arc<dyn Bus>,
        mapping: TopicMapping,
        telemetry: Telemetry,
        settings: AgentFlowSettings,
        processor_id: impl Into<String>,
    ) -> Result<Self, prometheus::Error> {
        let metrics = AgentMetrics::register(&telemetry.registry)?;
        Ok(Self {
            bus,
            mapping,
            telemetry,
            settings,
            metrics,
            processor_id: processor_id.into(),
            entries: std::sync::Mutex::default(),
            clients: tokio::sync::Mutex::default(),
            instances: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn entries(&self, workspace: &str, kind: &str) -> BTreeMap<String, String> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(workspace.to_owned(), kind.to_owned()))
            .cloned()
            .unwrap_or_default()
    }
}

impl AgentFlows {
    /// `service` with the fan-in of the flow whose request topic is `request_topic`, and its
    /// joiner started (stopped by the token returned).
    async fn fanin(
        &self,
        service: AgentService,
        request_topic: &str,
    ) -> Result<(AgentService, CancellationToken), AssembleError> {
        let topic = flow_fanin_topic(request_topic);
        let publisher = self
            .bus
            .publisher(&topic)
            .await
            .map_err(AssembleError::FanIn)?;
        let next_step = self
            .bus
            .publisher(request_topic)
            .await
            .map_err(AssembleError::NextStep)?;
        let stop = CancellationToken::new();
        let joiner = FanIn {
            bus: self.bus.clone(),
            topic,
            next_step,
            metrics: self.metrics.clone(),
            timeout: self.settings.limits.fanin_timeout,
        };
        tokio::spawn(joiner.run(stop.clone()));
        Ok((service.with_fanin(publisher), stop))
    }
}

/// `template` on `request` and `response`, with a subscription of its own.
fn client_on(template: &ClientConfig, request: String, response: String) -> ClientConfig {
    let fresh = ClientConfig::new(template.service.clone(), request, response);
    ClientConfig {
        service: fresh.service,
        request_topic: fresh.request_topic,
        response_topic: fresh.response_topic,
        subscription: fresh.subscription,
        ..template.clone()
    }
}

#[async_trait]
impl FlowService for AgentFlows {
    type Handler = AgentService;

    fn config_types(&self) -> Vec<String> {
        // Meta-routing's task types and patterns too (TrustGraph 2.11's orchestrator).
        vec![
            "mcp".to_owned(),
            "tool".to_owned(),
            "agent-task-type".to_owned(),
            "agent-pattern".to_owned(),
        ]
    }

    fn restarts_flows(&self, _kind: &str) -> bool {
        true
    }

    async fn configure(
        &self,
        workspace: &str,
        kind: &str,
        entries: &BTreeMap<String, String>,
    ) -> Result<(), FlowError> {
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
    ) -> Result<Arc<AgentService>, FlowError> {
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
            PromptTopics {
                request: flow_topic(definition, "prompt-request", self.mapping)?,
                response: flow_topic(definition, "prompt-response", self.mapping)?,
                // TrustGraph's flows have no cancel topics: sluice's default.
                cancel: defaults::cancel_topic("prompt")
                    .parse::<TopicName>()
                    .map_err(|e| e.to_string())?
                    .to_pulsar(self.mapping),
            }
        } else {
            PromptTopics {
                request: String::new(),
                response: String::new(),
                cancel: String::new(),
            }
        };
        let instance = self
            .instances
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let link_name = format!("text-completion responses of agent flow {key} ({instance})");
        let config = client_on(
            &self.settings.llm,
            flow_topic(definition, "text-completion-request", self.mapping)?,
            flow_topic(definition, "text-completion-response", self.mapping)?,
        );
        let llm = Arc::new(
            RequestClient::start(
                self.bus.clone(),
                config,
                Some(self.telemetry.metrics.clone()),
            )
            .await
            .map_err(|e| format!("cannot reach text-completion's topics: {e}"))?,
        );
        self.telemetry.health.watch(link_name.clone(), llm.link());
        let built = assemble(
            self.settings.limits.clone(),
            &self.settings.template,
            configs,
            llm.clone(),
            &self.bus,
            self.mapping,
            &request_topic,
            &prompt_topics,
            self.metrics.clone(),
        )
        .await;
        let routing = Routing::from_entries(
            &self.entries(&key.workspace, "agent-task-type"),
            &self.entries(&key.workspace, "agent-pattern"),
        );
        let built = built.and_then(|(service, prompt)| {
            let mut service = service.with_routing(routing);
            for (name, text) in &self.settings.pattern_templates {
                service = service.with_template(name, text)?;
            }
            Ok((service, prompt))
        });
        let built = match built {
            Ok((service, prompt)) => self
                .fanin(service, &request_topic)
                .await
                .map(|(service, joiner)| (service, prompt, joiner)),
            Err(e) => Err(e),
        };
        let (service, prompt, joiner) = match built {
            Ok(b) => b,
            Err(e) => {
                self.telemetry.health.unwatch(&link_name);
                llm.close().await;
                return Err(e.into());
            }
        };
        self.clients
            .lock()
            .await
            .entry(key.clone())
            .or_default()
            .push((llm, prompt, link_name, joiner));
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
        if let Some((llm, prompt, link_name, joiner)) = oldest {
            joiner.cancel();
            self.telemetry.health.unwatch(&link_name);
            llm.close().await;
            if let Some(p) = prompt {
                p.close().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flows_fan_in_topic_is_its_request_topics_and_persistent() {
        assert_eq!(
            flow_fanin_topic("non-persistent://tg/request/agent:default"),
            "persistent://tg/request/agent:default-fanin"
        );
        assert_eq!(
            flow_fanin_topic("persistent://t/n/agent"),
            "persistent://t/n/agent-fanin"
        );
    }
}
