//! The prompt flows TrustGraph's config service assigns (see [`sluice_runtime::flows`]).
//! Templates come from the config's `prompt` entries of the flow's workspace (built-ins
//! too, unless turned off); each flow calls the text-completion service on its own
//! `text-completion-request` and `text-completion-response` topics, one client per pair of
//! topics, shared by the flows that name the same pair and closed when the last of them
//! stops. It never reads a template file: a flow's templates are the config's.

use std::{collections::BTreeMap, sync::Arc};

use async_trait::async_trait;
use sluice_runtime::{
    bus::Bus,
    client::{ClientConfig, RequestClient},
    flows::{FlowError, FlowKey, FlowService, FlowTopicError, flow_topic},
    telemetry::Telemetry,
};
use sluice_schema::{TopicMapping, config::FlowDefinition};

use crate::{
    handler::{LlmClient, PromptService, StructuredOutput},
    metrics::PromptMetrics,
    store::TemplateStore,
    templates::TemplateSet,
};

/// How the flows' handlers behave: what every flow shares.
#[derive(Debug, Clone)]
pub struct PromptFlowSettings {
    /// The text-completion client's settings but its topics, which are each flow's (its
    /// cancel topic and time limits; the service name labels its metrics).
    pub llm: ClientConfig,
    /// Whether the built-in templates are served besides the config's.
    pub builtins: bool,
    /// Content in the request log (`--log-content`).
    pub log_content: bool,
    /// How a template with a schema asks for its answer.
    pub structured_output: StructuredOutput,
}

/// The prompt flows of one processor.
pub struct PromptFlows {
    bus: Arc<dyn Bus>,
    mapping: TopicMapping,
    telemetry: Telemetry,
    settings: PromptFlowSettings,
    metrics: PromptMetrics,
    stores: std::sync::Mutex<BTreeMap<String, Arc<TemplateStore>>>,
    clients: tokio::sync::Mutex<BTreeMap<(String, String), SharedClient>>,
}

/// A text-completion client and how many flows use it.
type SharedClient = (Arc<LlmClient>, usize);

impl PromptFlows {
    /// The flows on `bus`, their metrics in `telemetry`'s registry (registered here).
    pub fn new(
        bus: Arc<dyn Bus>,
        mapping: TopicMapping,
        telemetry: Telemetry,
        settings: PromptFlowSettings,
    ) -> Result<Self, prometheus::Error> {
        let metrics = PromptMetrics::register(&telemetry.registry)?;
        Ok(Self {
            bus,
            mapping,
            telemetry,
            settings,
            metrics,
            stores: std::sync::Mutex::default(),
            clients: tokio::sync::Mutex::default(),
        })
    }

    fn store(&self, workspace: &str) -> Result<Arc<TemplateStore>, String> {
        let mut stores = self
            .stores
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(store) = stores.get(workspace) {
            return Ok(store.clone());
        }
        let set = TemplateSet::from_trustgraph_config(&BTreeMap::new(), self.settings.builtins)
            .map_err(|e| e.to_string())?;
        let store = TemplateStore::with_metrics(set, self.metrics.clone());
        stores.insert(workspace.to_owned(), store.clone());
        Ok(store)
    }

    fn llm_topics(&self, definition: &FlowDefinition) -> Result<(String, String), FlowTopicError> {
        Ok((
            flow_topic(definition, "text-completion-request", self.mapping)?,
            flow_topic(definition, "text-completion-response", self.mapping)?,
        ))
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
impl FlowService for PromptFlows {
    type Handler = PromptService;

    fn config_types(&self) -> Vec<String> {
        vec!["prompt".to_owned()]
    }

    async fn configure(
        &self,
        workspace: &str,
        _kind: &str,
        entries: &BTreeMap<String, String>,
    ) -> Result<(), FlowError> {
        let store = self.store(workspace)?;
        match TemplateSet::from_trustgraph_config(entries, self.settings.builtins) {
            Ok(set) => {
                store.replace(set);
                Ok(())
            }
            Err(e) => {
                store.load_failed();
                Err(e.into())
            }
        }
    }

    async fn flow(
        &self,
        key: &FlowKey,
        definition: &FlowDefinition,
    ) -> Result<Arc<PromptService>, FlowError> {
        let topics = self.llm_topics(definition)?;
        let store = self.store(&key.workspace)?;
        let mut clients = self.clients.lock().await;
        let llm = match clients.get_mut(&topics) {
            Some((client, users)) => {
                *users += 1;
                client.clone()
            }
            None => {
                let config = client_on(&self.settings.llm, topics.0.clone(), topics.1.clone());
                let client = RequestClient::start(
                    self.bus.clone(),
                    config,
                    Some(self.telemetry.metrics.clone()),
                )
                .await
                .map_err(|e| format!("cannot reach text-completion's topics: {e}"))?;
                self.telemetry.health.watch(
                    format!("text-completion responses on {}", topics.1),
                    client.link(),
                );
                let client = Arc::new(client);
                clients.insert(topics, (client.clone(), 1));
                client
            }
        };
        Ok(Arc::new(
            PromptService::new(store, llm, self.metrics.clone())
                .with_content_logging(self.settings.log_content)
                .with_structured_output(self.settings.structured_output),
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
