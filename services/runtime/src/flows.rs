//! Flows assigned by TrustGraph's config service: the `--config-service` mode of a processor.
//!
//! In a TrustGraph deployment a processor is not told its topics on the command line. It
//! asks TrustGraph's config service (see [`sluice_schema::config`]) for the entries of type
//! `processor:<its id>`, one per flow it is to serve, each naming the flow's topics and
//! parameters, and it hears of changes on the config push topic. This module does that for
//! any sluice processor:
//!
//! - [`ConfigClient`] asks the config service over the bus through the runtime's
//!   [`RequestClient`] (correlated by the `id` property, as TrustGraph's own processors ask);
//! - [`run_flows`] serves every flow the config names, several at once in one process, each
//!   a [`crate::processor::run`] consumer with its own topics; it starts and stops flows as
//!   pushes arrive, restarts a flow whose definition changed, and hands the service other
//!   config types it asked for (the prompt service's templates, the agent's tools).
//!
//! Beyond what TrustGraph's processors do, so that a missed push never leaves a processor
//! behind: the whole config is read again every `resync` (pushes travel on a non-persistent
//! topic and are lost while a processor is disconnected), a failed read is retried every
//! `retry` until it succeeds, and `/readyz` fails until the first read succeeded.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    sync::Arc,
};

use async_trait::async_trait;
use sluice_schema::{
    ErrorKind, TopicError, TopicMapping, TopicName,
    config::{ConfigPush, ConfigRequest, ConfigResponse, FlowDefinition},
};
use tokio::{
    task::{JoinHandle, JoinSet},
    time::{Duration, Instant},
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::{
    bus::{Bus, BusError, SubscribeOptions, Subscription},
    client::{ClientConfig, ClientError, RequestClient, RequestOptions},
    processor::{self, Handler, ProcessorConfig},
    reader::{Failure, ReadPolicy, Report},
    telemetry::Telemetry,
};

/// The `/readyz` condition held until the config service first answered.
const CONFIG_CONDITION: &str = "config-service";

/// The Pulsar topics of TrustGraph's config service (by default `request:tg:config`,
/// `response:tg:config`, `notify:tg:config`; see [`sluice_schema::config`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigTopics {
    /// Where requests go (`request:tg:config`).
    pub request: String,
    /// Where answers come (`response:tg:config`).
    pub response: String,
    /// Where changes are announced (`notify:tg:config`).
    pub push: String,
}

/// Why a config read failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config service answered with an error.
    #[error("the config service refused: {0}")]
    Refused(sluice_schema::Error),
    /// The config service could not be asked, or its answer did not arrive or could not be
    /// read.
    #[error("{}", .error.message)]
    Unanswered {
        /// What happened, in the config client's words ([`ClientError::to_error`]).
        error: sluice_schema::Error,
        /// The client's failure (`None`: the answer ended without its record).
        cause: Option<ClientError>,
    },
}

impl From<Failure<ConfigResponse>> for ConfigError {
    fn from(f: Failure<ConfigResponse>) -> Self {
        match f.record {
            Some(_) => ConfigError::Refused(f.error),
            None => ConfigError::Unanswered {
                error: f.error,
                cause: f.client,
            },
        }
    }
}

/// How the config client reads an answer: the one record it is (a restart changes nothing
/// before it); a client-side failure named as the config service's.
fn read_policy() -> ReadPolicy<Report> {
    ReadPolicy::new(Report, |e| {
        e.to_error("the config service", ErrorKind::NoConfiguration)
    })
}

/// Asks TrustGraph's config service over the bus: the runtime's request client, with a
/// response subscription of its own (exclusive, from now on) removed by
/// [`ConfigClient::close`], and answers correlated by the `id` property as TrustGraph's own
/// processors ask. Every client of the config service reads every answer; the others' are
/// acked and dropped.
pub struct ConfigClient {
    client: RequestClient<ConfigRequest, ConfigResponse>,
}

impl ConfigClient {
    /// Opens the request topic and subscribes to the response topic. `name` names the
    /// subscription (suffixed to be unique). An answer must arrive within `timeout`.
    pub async fn connect(
        bus: &Arc<dyn Bus>,
        topics: &ConfigTopics,
        name: &str,
        timeout: Duration,
    ) -> Result<Self, BusError> {
        let mut config = ClientConfig::new("config", &topics.request, &topics.response);
        config.subscription = format!("{name}-config-{}", crate::short_id());
        config.inactivity_timeout = timeout;
        config.total_timeout = timeout;
        let client = RequestClient::start(bus.clone(), config, None)
            .await
            .map_err(|e| match e {
                ClientError::Bus(e) => e,
                e => BusError::Config(e.to_string()),
            })?;
        Ok(Self { client })
    }

    /// Sends `request` and waits for its answer; an answer carrying an error is an error.
    pub async fn request(&self, request: &ConfigRequest) -> Result<ConfigResponse, ConfigError> {
        let options = RequestOptions::default();
        let reader = self.client.read(request, options, read_policy()).await?;
        Ok(reader.last().await?)
    }

    /// The entries of `kind` in `workspace`, key -> value, and the config version.
    pub async fn values(
        &self,
        workspace: &str,
        kind: &str,
    ) -> Result<(u64, BTreeMap<String, String>), ConfigError> {
        let response = self
            .request(&ConfigRequest::getvalues(workspace, kind))
            .await?;
        let entries = response
            .values
            .into_iter()
            .map(|v| (v.key, v.value))
            .collect();
        Ok((response.version, entries))
    }

    /// The entries of `kind` in every workspace that has some: workspace -> key -> value,
    /// and the config version. As TrustGraph's processors read it: the keys across
    /// workspaces first, then each workspace's values.
    pub async fn all_workspaces(
        &self,
        kind: &str,
    ) -> Result<(u64, BTreeMap<String, BTreeMap<String, String>>), ConfigError> {
        let keys = self.request(&ConfigRequest::getkeys_all_ws(kind)).await?;
        let workspaces: BTreeSet<String> = keys.values.into_iter().map(|v| v.workspace).collect();
        let mut version = keys.version;
        let mut all = BTreeMap::new();
        for workspace in workspaces {
            let (v, entries) = self.values(&workspace, kind).await?;
            version = version.max(v);
            if !entries.is_empty() {
                all.insert(workspace, entries);
            }
        }
        Ok((version, all))
    }

    /// Stops reading answers and removes the response subscription.
    pub async fn close(self) {
        self.client.close().await;
    }
}

/// One flow: a workspace and the flow's name in it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FlowKey {
    /// The TrustGraph workspace.
    pub workspace: String,
    /// The flow (TrustGraph's variant key of the `processor:<id>` entry).
    pub flow: String,
}

impl fmt::Display for FlowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.workspace, self.flow)
    }
}

/// Why a service cannot apply a config entry or serve a flow: the service's own error, kept
/// whole (with its source chain) for the warning the supervisor logs. A trait object rather
/// than one enum because each service fails in its own terms (a template that does not parse,
/// a tool whose MCP server is unknown, a flow parameter out of range).
pub type FlowError = Box<dyn std::error::Error + Send + Sync>;

/// A flow topic the processor needs that its definition does not give in a usable form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlowTopicError {
    /// The definition names no topic for this name.
    #[error("the flow names no `{0}` topic")]
    Missing(String),
    /// The topic it names is not a topic name.
    #[error("the flow's `{name}` topic: {source}")]
    Invalid {
        /// The processor's name for the topic (`request`, `prompt-request`, ...).
        name: String,
        /// What is wrong with it.
        source: TopicError,
    },
}

/// What a service provides to be run by [`run_flows`].
#[async_trait]
pub trait FlowService: Send + Sync + 'static {
    /// The handler of one flow.
    type Handler: Handler;

    /// Config types the service reads besides `processor:<id>` (e.g. `prompt`).
    fn config_types(&self) -> Vec<String> {
        Vec::new()
    }

    /// The entries of `kind` (one of [`FlowService::config_types`]) in `workspace` are now
    /// `entries` (empty when there are none). Called before the workspace's flows start, and
    /// again on every change. An error keeps what was in use; the read is tried again.
    async fn configure(
        &self,
        workspace: &str,
        kind: &str,
        entries: &BTreeMap<String, String>,
    ) -> Result<(), FlowError> {
        let _ = (workspace, kind, entries);
        Ok(())
    }

    /// Whether the workspace's flows restart (their handlers built anew by
    /// [`FlowService::flow`]) after entries of `kind` changed: for services that build a
    /// flow's handler from them (the agent's tools).
    fn restarts_flows(&self, kind: &str) -> bool {
        let _ = kind;
        false
    }

    /// The handler of a flow (its consumer is [`flow_consumer`]'s).
    async fn flow(
        &self,
        key: &FlowKey,
        definition: &FlowDefinition,
    ) -> Result<Arc<Self::Handler>, FlowError>;

    /// A flow stopped (removed or changed) and its requests in flight have finished.
    async fn flow_stopped(&self, key: &FlowKey, definition: &FlowDefinition) {
        let _ = (key, definition);
    }
}

/// How [`run_flows`] reads the config.
#[derive(Debug, Clone)]
pub struct FlowsConfig {
    /// The processor's id in TrustGraph's config: it serves the entries of type
    /// `processor:<id>`.
    pub processor_id: String,
    /// The config service's topics.
    pub topics: ConfigTopics,
    /// How long one config request may take.
    pub request_timeout: Duration,
    /// How often the whole config is read again, whatever the pushes said.
    pub resync: Duration,
    /// How soon a failed read is tried again.
    pub retry: Duration,
    /// Each flow's consumer settings but its topics and subscription (concurrency, drain
    /// grace, cancel topic, the processor's name in metrics).
    pub consumer: ProcessorConfig,
    /// How the flows' logical topic names map to Pulsar.
    pub mapping: TopicMapping,
}

impl FlowsConfig {
    /// Defaults: 30 s per request, a full read every 60 s, retries every 2 s (TrustGraph's
    /// own retry interval).
    pub fn new(
        processor_id: impl Into<String>,
        topics: ConfigTopics,
        consumer: ProcessorConfig,
        mapping: TopicMapping,
    ) -> Self {
        Self {
            processor_id: processor_id.into(),
            topics,
            request_timeout: Duration::from_secs(30),
            resync: Duration::from_secs(60),
            retry: Duration::from_secs(2),
            consumer,
            mapping,
        }
    }
}

/// A flow's consumer config as TrustGraph wires it: requests from the definition's
/// `request` topic, answers to its `response` topic, and TrustGraph's subscription name
/// (`<id>--<workspace>--<flow>--request`), so sluice and TrustGraph replicas of the same
/// processor id share a flow's requests. Concurrency, drain grace and the cancel topic
/// come from `template`.
pub fn flow_consumer(
    template: &ProcessorConfig,
    processor_id: &str,
    key: &FlowKey,
    definition: &FlowDefinition,
    mapping: TopicMapping,
) -> Result<ProcessorConfig, FlowTopicError> {
    let request = flow_topic(definition, "request", mapping)?;
    let response = flow_topic(definition, "response", mapping)?;
    let mut config = template.clone();
    config.request_topic = request;
    config.response_topic = response;
    config.subscription = format!("{processor_id}--{}--{}--request", key.workspace, key.flow);
    config.flow = Some(key.to_string());
    Ok(config)
}

/// The Pulsar URL of the flow topic the processor calls `name`.
pub fn flow_topic(
    definition: &FlowDefinition,
    name: &str,
    mapping: TopicMapping,
) -> Result<String, FlowTopicError> {
    let topic = definition
        .topic(name)
        .ok_or_else(|| FlowTopicError::Missing(name.to_owned()))?;
    let parsed: TopicName = topic.parse().map_err(|source| FlowTopicError::Invalid {
        name: name.to_owned(),
        source,
    })?;
    Ok(parsed.to_pulsar(mapping))
}

struct Running {
    definition: FlowDefinition,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

struct Supervisor<S: FlowService> {
    bus: Arc<dyn Bus>,
    service: Arc<S>,
    telemetry: Telemetry,
    config: FlowsConfig,
    /// `processor:<id>`.
    flows_kind: String,
    /// The service's other types, applied before the flows.
    extra_kinds: Vec<String>,
    running: BTreeMap<FlowKey, Running>,
    /// What each (workspace, type) of the extra kinds was last configured with.
    applied: BTreeMap<(String, String), BTreeMap<String, String>>,
    version: u64,
    stopping: JoinSet<()>,
}

impl<S: FlowService> Supervisor<S> {
    fn publish_state(&self) {
        self.telemetry.metrics.config_applied(
            &self.config.processor_id,
            self.version,
            self.running.len(),
        );
    }

    fn failed(&self, what: &str, error: &dyn fmt::Display) {
        self.telemetry
            .metrics
            .config_failed(&self.config.processor_id);
        warn!(processor = %self.config.processor_id, error = %error, "{what}");
    }

    /// Every type read, in the order applied: the service's own types before the flows, so a
    /// flow never starts without its templates or tools.
    fn kinds(&self) -> Vec<String> {
        self.extra_kinds
            .iter()
            .chain(std::iter::once(&self.flows_kind))
            .cloned()
            .collect()
    }

    /// Reads every type in every workspace and applies it.
    async fn full_sync(&mut self, client: &ConfigClient) -> Result<(), ConfigError> {
        let kinds = self.kinds();
        let mut version = 0;
        let mut fetched = Vec::new();
        for kind in kinds {
            let (v, per_workspace) = client.all_workspaces(&kind).await?;
            version = version.max(v);
            fetched.push((kind, per_workspace));
        }
        for (kind, per_workspace) in fetched {
            // Workspaces that had entries before and have none now are applied empty.
            let mut workspaces: BTreeSet<String> = per_workspace.keys().cloned().collect();
            if kind == self.flows_kind {
                workspaces.extend(self.running.keys().map(|k| k.workspace.clone()));
            } else {
                workspaces.extend(
                    self.applied
                        .keys()
                        .filter(|(_, k)| *k == kind)
                        .map(|(ws, _)| ws.clone()),
                );
            }
            let empty = BTreeMap::new();
            for ws in workspaces {
                let entries = per_workspace.get(&ws).unwrap_or(&empty);
                self.apply(&ws, &kind, entries).await;
            }
        }
        self.version = version;
        self.publish_state();
        Ok(())
    }

    /// Applies a push: reads again the (type, workspace) pairs it names.
    async fn on_push(
        &mut self,
        client: &ConfigClient,
        push: ConfigPush,
    ) -> Result<(), ConfigError> {
        if push.version <= self.version {
            debug!(
                version = push.version,
                applied = self.version,
                "config push already applied"
            );
            return Ok(());
        }
        if let Some(changes) = &push.workspace_changes {
            for ws in &changes.deleted {
                info!(processor = %self.config.processor_id, workspace = %ws, "workspace deleted");
                let empty = BTreeMap::new();
                for kind in self.extra_kinds.clone() {
                    self.apply(ws, &kind, &empty).await;
                }
                let flows_kind = self.flows_kind.clone();
                self.apply(ws, &flows_kind, &empty).await;
            }
        }
        for kind in self.kinds() {
            let Some(workspaces) = push.changes.get(&kind) else {
                continue;
            };
            for ws in workspaces {
                let (_, entries) = client.values(ws, &kind).await?;
                self.apply(ws, &kind, &entries).await;
            }
        }
        self.version = push.version;
        self.publish_state();
        Ok(())
    }

    async fn apply(&mut self, workspace: &str, kind: &str, entries: &BTreeMap<String, String>) {
        // TrustGraph keeps its own bookkeeping in workspaces named `_...`.
        if workspace.starts_with('_') {
            return;
        }
        if kind == self.flows_kind {
            self.reconcile(workspace, entries).await;
            return;
        }
        let slot = (workspace.to_owned(), kind.to_owned());
        if self.applied.get(&slot) == Some(entries) {
            return;
        }
        match self.service.configure(workspace, kind, entries).await {
            Ok(()) => {
                info!(processor = %self.config.processor_id, workspace, kind,
                      entries = entries.len(), "config applied");
                if entries.is_empty() {
                    self.applied.remove(&slot);
                } else {
                    self.applied.insert(slot, entries.clone());
                }
                if self.service.restarts_flows(kind) {
                    let flows: Vec<(FlowKey, FlowDefinition)> = self
                        .running
                        .iter()
                        .filter(|(k, _)| k.workspace == workspace)
                        .map(|(k, r)| (k.clone(), r.definition.clone()))
                        .collect();
                    for (key, definition) in flows {
                        info!(flow = %key, kind, "restarting the flow with the changed config");
                        self.stop(&key);
                        self.start(key, definition).await;
                    }
                }
            }
            Err(e) => self.failed(
                &format!("config of type {kind:?} in workspace {workspace:?} not applied; what was in use stays"),
                &e,
            ),
        }
    }

    /// Starts, stops and restarts the flows of `workspace` to match `entries`.
    async fn reconcile(&mut self, workspace: &str, entries: &BTreeMap<String, String>) {
        let mut wanted = BTreeMap::new();
        for (flow, value) in entries {
            let key = FlowKey {
                workspace: workspace.to_owned(),
                flow: flow.clone(),
            };
            match serde_json::from_str::<FlowDefinition>(value) {
                Ok(definition) => {
                    wanted.insert(key, definition);
                }
                // The value is not logged: it is the operator's, and may be large.
                Err(e) => self.failed(
                    &format!("flow {key} has an unreadable definition; it is not served"),
                    &e,
                ),
            }
        }
        let current: Vec<FlowKey> = self
            .running
            .keys()
            .filter(|k| k.workspace == workspace)
            .cloned()
            .collect();
        for key in current {
            let keep = wanted
                .get(&key)
                .is_some_and(|d| self.running.get(&key).is_some_and(|r| &r.definition == d));
            if !keep {
                self.stop(&key);
            }
        }
        for (key, definition) in wanted {
            if !self.running.contains_key(&key) {
                self.start(key, definition).await;
            }
        }
        self.publish_state();
    }

    async fn start(&mut self, key: FlowKey, definition: FlowDefinition) {
        let built = match flow_consumer(
            &self.config.consumer,
            &self.config.processor_id,
            &key,
            &definition,
            self.config.mapping,
        ) {
            Ok(config) => self
                .service
                .flow(&key, &definition)
                .await
                .map(|handler| (config, handler)),
            Err(e) => Err(FlowError::from(e)),
        };
        let (config, handler) = match built {
            Ok(built) => built,
            Err(e) => {
                self.failed(&format!("flow {key} cannot be served"), &e);
                return;
            }
        };
        info!(processor = %self.config.processor_id, flow = %key,
              request_topic = %config.request_topic, "flow started");
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve_flow(
            self.bus.clone(),
            config,
            handler,
            self.telemetry.clone(),
            stop.clone(),
            self.service.clone(),
            key.clone(),
            definition.clone(),
            self.config.retry,
        ));
        self.running.insert(
            key,
            Running {
                definition,
                stop,
                task,
            },
        );
    }

    /// Stops taking the flow's requests; those in flight finish in the background.
    fn stop(&mut self, key: &FlowKey) {
        if let Some(running) = self.running.remove(key) {
            info!(processor = %self.config.processor_id, flow = %key, "flow stopping");
            running.stop.cancel();
            let task = running.task;
            self.stopping.spawn(async move {
                let _ = task.await;
            });
        }
    }

    async fn shutdown(mut self) {
        self.telemetry.health.set_draining();
        let keys: Vec<FlowKey> = self.running.keys().cloned().collect();
        for key in &keys {
            self.stop(key);
        }
        while self.stopping.join_next().await.is_some() {}
        self.publish_state();
    }
}

/// One flow's consumer, started again (every `retry`) if it cannot start, until `stop`.
#[allow(clippy::too_many_arguments)]
async fn serve_flow<S: FlowService>(
    bus: Arc<dyn Bus>,
    config: ProcessorConfig,
    handler: Arc<S::Handler>,
    telemetry: Telemetry,
    stop: CancellationToken,
    service: Arc<S>,
    key: FlowKey,
    definition: FlowDefinition,
    retry: Duration,
) {
    let condition = format!("flow {key}");
    loop {
        match processor::run(
            bus.clone(),
            config.clone(),
            handler.clone(),
            telemetry.clone(),
            stop.clone(),
        )
        .await
        {
            Ok(()) if stop.is_cancelled() => break,
            // The consumer ended by itself (its subscription closed for good): the flow is
            // still assigned, so it is served again.
            Ok(()) => {
                warn!(flow = %key, "the flow's consumer ended; starting it again");
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(retry) => {}
                }
            }
            Err(e) => {
                telemetry
                    .health
                    .fail(condition.clone(), format!("cannot consume: {e}"));
                warn!(flow = %key, error = %e, "the flow's consumer cannot start; trying again");
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(retry) => {}
                }
            }
        }
    }
    telemetry.health.clear(&condition);
    service.flow_stopped(&key, &definition).await;
    info!(flow = %key, "flow stopped");
}

/// Serves the flows TrustGraph's config service assigns to `config.processor_id` until
/// `shutdown`, then drains every flow. Returns early only if `shutdown` fires first.
pub async fn run_flows<S: FlowService>(
    bus: Arc<dyn Bus>,
    config: FlowsConfig,
    service: Arc<S>,
    telemetry: Telemetry,
    shutdown: CancellationToken,
) {
    let id = config.processor_id.clone();
    telemetry.health.fail(
        CONFIG_CONDITION,
        format!(
            "waiting for TrustGraph's config service on {}",
            config.topics.request
        ),
    );
    let mut supervisor = Supervisor {
        bus: bus.clone(),
        flows_kind: format!("processor:{id}"),
        extra_kinds: service.config_types(),
        service,
        telemetry: telemetry.clone(),
        config,
        running: BTreeMap::new(),
        applied: BTreeMap::new(),
        version: 0,
        stopping: JoinSet::new(),
    };
    supervisor.publish_state();
    // Pushes first, as TrustGraph's processors do: a change made while the config is being
    // read is then heard of rather than lost.
    let Some(mut pushes) = subscribe_pushes(&bus, &supervisor.config, &shutdown).await else {
        return;
    };
    let client = loop {
        let connected = tokio::select! {
            () = shutdown.cancelled() => {
                pushes.unsubscribe().await;
                return;
            }
            c = ConfigClient::connect(&bus, &supervisor.config.topics, &id, supervisor.config.request_timeout) => c,
        };
        match connected {
            Ok(c) => break c,
            Err(e) => {
                supervisor.failed("cannot reach the config service's topics; trying again", &e);
                tokio::time::sleep(supervisor.config.retry).await;
            }
        }
    };
    info!(processor = %id, topic = %supervisor.config.topics.request, "reading flows from TrustGraph's config service");
    let mut synced = false;
    let next_sync = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(next_sync);
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            delivery = pushes.next() => match delivery {
                Some(Ok(d)) => {
                    let push = serde_json::from_slice::<ConfigPush>(d.payload());
                    d.ack();
                    match push {
                        // Before the first full read, that read covers the push.
                        Ok(_) if !synced => {}
                        Ok(push) => {
                            if let Err(e) = supervisor.on_push(&client, push).await {
                                supervisor.failed("a config change could not be read; reading the whole config again soon", &e);
                                next_sync.as_mut().reset(Instant::now() + supervisor.config.retry);
                            }
                        }
                        Err(e) => supervisor.failed("a config push could not be read", &e),
                    }
                }
                Some(Err(e)) => warn!(error = %e, "reading config pushes failed"),
                None => {
                    // Closed for good: subscribe again; the periodic read covers the gap.
                    let Some(again) = subscribe_pushes(&bus, &supervisor.config, &shutdown).await else {
                        break;
                    };
                    pushes = again;
                }
            },
            () = &mut next_sync => {
                match supervisor.full_sync(&client).await {
                    Ok(()) => {
                        if !synced {
                            info!(processor = %id, version = supervisor.version,
                                  flows = supervisor.running.len(), "config applied");
                        }
                        synced = true;
                        telemetry.health.clear(CONFIG_CONDITION);
                        next_sync.as_mut().reset(Instant::now() + supervisor.config.resync);
                    }
                    Err(e) => {
                        if !synced {
                            telemetry.health.fail(CONFIG_CONDITION, format!("the config service cannot be read: {e}"));
                        }
                        supervisor.failed("the config could not be read; trying again", &e);
                        next_sync.as_mut().reset(Instant::now() + supervisor.config.retry);
                    }
                }
            },
            Some(_) = supervisor.stopping.join_next(), if !supervisor.stopping.is_empty() => {}
        }
    }
    supervisor.shutdown().await;
    client.close().await;
    pushes.unsubscribe().await;
    info!(processor = %id, "flows stopped");
}

/// Subscribes to the push topic (exclusive, from now on), retrying until `shutdown`.
async fn subscribe_pushes(
    bus: &Arc<dyn Bus>,
    config: &FlowsConfig,
    shutdown: &CancellationToken,
) -> Option<Box<dyn Subscription>> {
    loop {
        let name = format!("{}-config-push-{}", config.processor_id, crate::short_id());
        let mut options = SubscribeOptions::exclusive(1000);
        options.consumer_name = Some(name.clone());
        let subscribed = tokio::select! {
            () = shutdown.cancelled() => return None,
            s = bus.subscribe(&config.topics.push, &name, options) => s,
        };
        match subscribed {
            Ok(s) => return Some(s),
            Err(e) => {
                error!(processor = %config.processor_id, topic = %config.topics.push, error = %e,
                       "cannot subscribe to config pushes; trying again");
                tokio::select! {
                    () = shutdown.cancelled() => return None,
                    () = tokio::time::sleep(config.retry) => {}
                }
            }
        }
    }
}

/// Runs [`run_flows`] as a whole process: serves `/metrics`, `/healthz`, `/readyz` on
/// `metrics_addr`, and drains every flow on SIGTERM or SIGINT.
pub async fn run_flows_until_signalled<S: FlowService>(
    bus: Arc<dyn Bus>,
    config: FlowsConfig,
    service: Arc<S>,
    telemetry: Telemetry,
    metrics_addr: std::net::SocketAddr,
) -> Result<std::net::SocketAddr, processor::RunError> {
    let shutdown = crate::telemetry::shutdown_on_signals();
    let telemetry_stop = CancellationToken::new();
    let bound = telemetry
        .serve(metrics_addr, telemetry_stop.clone())
        .await
        .map_err(|e| processor::RunError::Telemetry(metrics_addr, e))?;
    info!(%bound, "serving /metrics /healthz /readyz");
    let ledger = config.consumer.ledger.clone();
    run_flows(bus, config, service, telemetry, shutdown).await;
    if let Some(ledger) = ledger {
        // Every flow has stopped: usage records the broker has not stored yet get a last
        // chance (see crate::ledger).
        ledger.flush(processor::LEDGER_FLUSH_BOUND).await;
    }
    telemetry_stop.cancel();
    Ok(bound)
}

#[cfg(test)]
mod tests;
