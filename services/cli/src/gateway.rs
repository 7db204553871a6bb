//! `sluice gateway`: the HTTP gateway as a process, in front of processors on Pulsar.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use clap::Args;
use sluice_gateway::{
    Access, Auth, Gateway, GatewayConfig, ServerLimits, ServiceKind, ServiceTopics, keys::Keys,
    server,
};
use sluice_runtime::{
    billing,
    bus::Bus,
    seal::SealKey,
    secret::Secret,
    telemetry::{Telemetry, shutdown_on_signals},
};
use sluice_schema::{TopicMapping, TopicName, topics::defaults};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::common::{BusArgs, ConfigFileArgs, cancel_topic, connect, pulsar_admin};

/// The limits topic is compacted once this much waits uncompacted (about 3,000 snapshots).
const LIMITS_COMPACTION_BYTES: u64 = 1024 * 1024;
/// The limits topic keeps its snapshots a month and a day; its size is bounded by compaction
/// (a size bound would have to exceed the backlog quota, 10 GiB by default).
const LIMITS_RETENTION_MINUTES: u32 = 32 * 24 * 60;
const LIMITS_RETENTION_MB: i64 = -1;

/// How the gateway serves HTTP (shared by `gateway` and `serve`). The bearer token comes
/// from SLUICE_GATEWAY_TOKEN or the file named by SLUICE_GATEWAY_TOKEN_FILE; without one (and
/// without a keys file), every caller is accepted, which a gateway listening beyond loopback
/// allows only with --allow-unauthenticated (docs/security.md). The secret the replicas share
/// (resume tokens and the limit state are sealed with it) comes from SLUICE_GATEWAY_SECRET or
/// the file named by SLUICE_GATEWAY_SECRET_FILE; without one (or set empty), each process
/// makes its own. The billing secret it shares with text-completion (SLUICE_BILLING_SECRET
/// or SLUICE_BILLING_SECRET_FILE) seals the API key each request is billed to.
#[derive(Args, Debug, Clone)]
pub struct GatewayArgs {
    /// Address the gateway listens on (default: 0.0.0.0:8088 for `gateway`, 127.0.0.1:8088
    /// for `serve`).
    #[arg(long, env = "SLUICE_GATEWAY_ADDR")]
    pub listen: Option<SocketAddr>,
    /// Largest request body or WebSocket frame, in bytes.
    #[arg(long, env = "SLUICE_BODY_LIMIT_BYTES", default_value_t = 1024 * 1024)]
    pub body_limit_bytes: usize,
    /// Seconds a request may take in all.
    #[arg(long, env = "SLUICE_REQUEST_TIMEOUT_SECS", default_value_t = 600)]
    pub request_timeout_secs: u64,
    /// Seconds a stream may stay silent.
    #[arg(long, env = "SLUICE_INACTIVITY_TIMEOUT_SECS", default_value_t = 120)]
    pub inactivity_timeout_secs: u64,
    /// The flow name TrustGraph clients address.
    #[arg(long, env = "SLUICE_FLOW", default_value = "default")]
    pub flow: String,
    /// The TrustGraph workspace served: TrustGraph 2.x's clients name one on every request,
    /// and a request for another is refused (one gateway serves one workspace's flow).
    #[arg(long, env = "SLUICE_WORKSPACE", default_value = "default")]
    pub workspace: String,
    /// Seconds after its start a stream may still be resumed (Last-Event-ID, Sluice-Resume);
    /// keep it within the response namespace's retention (`sluice pulsar ensure-namespaces`
    /// sets 60 minutes). 0 turns resuming off: no event ids, no token.
    #[arg(long, env = "SLUICE_RESUME_WINDOW_SECS", default_value_t = 900)]
    pub resume_window_secs: u64,
    /// A TOML file of API keys (their SHA-256, permissions and limits), read again every
    /// second while the gateway runs (docs/gateway.md#api-keys). Callers may then use any
    /// of its keys as their bearer token, besides SLUICE_GATEWAY_TOKEN when set.
    #[arg(long, env = "SLUICE_GATEWAY_KEYS_FILE")]
    pub keys_file: Option<std::path::PathBuf>,
    /// The topic gateway replicas share the keys' limit state on [default:
    /// persistent://<topicspace>/response/gateway-limits]; `none` counts on each replica
    /// alone. The in-process bus always counts alone.
    #[arg(long, env = "SLUICE_GATEWAY_LIMITS_TOPIC")]
    pub limits_topic: Option<String>,
    /// An origin (`scheme://host[:port]`) whose web pages may call the gateway from a browser
    /// (CORS, WebSocket); repeat, or comma-separate in the variable. None by default: a
    /// request with any other `Origin` is refused. `*` allows every origin, and needs a token
    /// or keys file.
    #[arg(
        long = "allowed-origin",
        env = "SLUICE_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    pub allowed_origins: Vec<String>,
    /// A host name (`NAME` or `NAME:PORT`) callers may reach the gateway by besides loopback
    /// ones, where the `Host` check is on: on a loopback listener, and on any listener
    /// without credentials (DNS rebinding); repeat, or comma-separate. `*` turns the check
    /// off.
    #[arg(
        long = "allowed-host",
        env = "SLUICE_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    pub allowed_hosts: Vec<String>,
    /// Start without a token or keys file on an address beyond loopback: anyone who can
    /// reach it may spend the providers' keys. Refused otherwise.
    #[arg(long, env = "SLUICE_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,
    /// HTTP connections served at once; more wait until one closes. Bounded by the
    /// process's open-file limit.
    #[arg(long, env = "SLUICE_MAX_CONNECTIONS", default_value_t = server::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds a connection has to send its request's headers (from opening, or from its
    /// last answer when kept alive); closed after that.
    #[arg(long, env = "SLUICE_HEADER_READ_TIMEOUT_SECS", default_value_t = server::DEFAULT_HEADER_READ_TIMEOUT.as_secs())]
    pub header_read_timeout_secs: u64,
    /// Seconds a WebSocket has to authenticate, when credentials are required.
    #[arg(long, env = "SLUICE_SOCKET_AUTH_WINDOW_SECS", default_value_t = 5)]
    pub socket_auth_window_secs: u64,
    /// Requests one WebSocket may have running at once.
    #[arg(long, env = "SLUICE_SOCKET_MAX_REQUESTS", default_value_t = 64)]
    pub socket_max_requests: usize,
}

impl GatewayArgs {
    /// The address to listen on: `--listen`, else `default`.
    pub fn listen_or(&self, default: SocketAddr) -> SocketAddr {
        self.listen.unwrap_or(default)
    }

    /// The gateway config for `services` listening on `listen`, with their topics in
    /// `topicspace` (`tg` for TrustGraph's) under `mapping`. With `flow_topics`, a service's
    /// request and response topics are those TrustGraph 2.x's flow service gives the
    /// workspace's flow (`request:tg:text-completion:<workspace>:<flow>`), as its blueprints
    /// name them; its cancel topic stays the service's own (sluice's processors read one
    /// cancel topic for all their flows).
    pub fn config(
        &self,
        listen: SocketAddr,
        services: &[ServiceKind],
        topicspace: &str,
        mapping: TopicMapping,
        flow_topics: bool,
    ) -> Result<(GatewayConfig, Vec<TopicName>), String> {
        let token = Secret::from_env("SLUICE_GATEWAY_TOKEN").map_err(|e| e.to_string())?;
        let mut config = GatewayConfig::new();
        config.auth = Auth::new(token);
        config.secret = SealKey::from_env("SLUICE_GATEWAY_SECRET").map_err(|e| e.to_string())?;
        config.billing = billing::key_from_env().map_err(|e| e.to_string())?;
        // Without credentials, the caller is the machine's own user on loopback, anyone
        // beyond it.
        config.anonymous_is_operator = listen.ip().is_loopback();
        config.body_limit = self.body_limit_bytes;
        config.request_timeout = Duration::from_secs(self.request_timeout_secs);
        config.inactivity_timeout = Duration::from_secs(self.inactivity_timeout_secs);
        config.resume_window = Duration::from_secs(self.resume_window_secs);
        config.flow.clone_from(&self.flow);
        config.workspace.clone_from(&self.workspace);
        if let Some(path) = &self.keys_file {
            let keys = Keys::load(path).map_err(|e| e.to_string())?;
            info!(keys = keys.ring().len(), path = %path.display(), "API keys loaded");
            config.auth = config.auth.with_keys(Arc::new(keys));
        }
        let required = config.auth.required();
        if !required && !listen.ip().is_loopback() {
            if !self.allow_unauthenticated {
                return Err(format!(
                    "refusing to listen on {listen} without credentials: anyone who can reach it could use the providers' keys. Set SLUICE_GATEWAY_TOKEN (or SLUICE_GATEWAY_TOKEN_FILE) or --keys-file, listen on 127.0.0.1, or pass --allow-unauthenticated to open it deliberately"
                ));
            }
            warn!(%listen, "the gateway accepts every caller (--allow-unauthenticated)");
        }
        config.access = Access::new(listen, required, &self.allowed_hosts, &self.allowed_origins)
            .map_err(|e| e.to_string())?;
        config.server = ServerLimits {
            max_connections: server::connection_cap(self.max_connections),
            header_read_timeout: Duration::from_secs(self.header_read_timeout_secs.max(1)),
        };
        config.socket_auth_window = Duration::from_secs(self.socket_auth_window_secs.max(1));
        config.socket_max_requests = self.socket_max_requests.max(1);
        config.limits_topic = match self.limits_topic.as_deref() {
            Some("none") => None,
            Some(topic) => Some(topic.to_owned()),
            // Persistent whatever the mapping: a replica that starts reads the day's and the
            // month's counts from it.
            None => Some(format!("persistent://{topicspace}/response/gateway-limits")),
        };
        let mut topics = Vec::new();
        for kind in services {
            let name = kind.as_str();
            let parse = |s: String| s.parse::<TopicName>().map_err(|e| e.to_string());
            let flow_name = if flow_topics {
                format!("{name}:{}:{}", self.workspace, self.flow)
            } else {
                name.to_owned()
            };
            let request = parse(defaults::topic_in("request", topicspace, &flow_name))?;
            let response = parse(defaults::topic_in("response", topicspace, &flow_name))?;
            let cancel = cancel_topic(name, Some(&defaults::cancel_topic_in(topicspace, name)))?;
            config.services.insert(
                *kind,
                ServiceTopics {
                    request: request.to_pulsar(mapping),
                    response: response.to_pulsar(mapping),
                    cancel: Some(cancel.to_pulsar(mapping)),
                },
            );
            topics.extend([request, response, cancel]);
        }
        Ok((config, topics))
    }
}

fn parse_service(s: &str) -> Result<ServiceKind, String> {
    ServiceKind::from_name(s)
        .ok_or_else(|| format!("unknown service {s:?}: expected text-completion, prompt or agent"))
}

/// `sluice gateway` options.
#[derive(Args, Debug)]
pub struct GatewayCommand {
    #[command(flatten)]
    pub config: ConfigFileArgs,
    #[command(flatten)]
    bus: BusArgs,
    #[command(flatten)]
    gateway: GatewayArgs,
    /// In front of a TrustGraph 2.x deployment, for TrustGraph's own clients with their
    /// defaults: TrustGraph's topic mapping, its API's port (8888) unless --listen says
    /// otherwise, and each service's topics those of the flow (--flow) of the workspace
    /// (--workspace) that TrustGraph's flow service started (docs/trustgraph.md).
    #[arg(long, env = "SLUICE_TRUSTGRAPH")]
    trustgraph: bool,
    /// Services to route to (the others answer 404).
    #[arg(long, env = "SLUICE_SERVICES", value_delimiter = ',', value_parser = parse_service,
          default_value = "text-completion,prompt,agent")]
    services: Vec<ServiceKind>,
    /// The topicspace of the services' topics: requests go to `request:<topicspace>:<service>`,
    /// answers come from `response:<topicspace>:<service>`, cancels go to
    /// `notify:<topicspace>:<service>-cancel`. Processors started with matching topics can
    /// then share a broker with other deployments (each topicspace is a Pulsar tenant).
    #[arg(long, env = "SLUICE_TOPICSPACE", default_value = defaults::TOPICSPACE)]
    topicspace: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "SLUICE_METRICS_ADDR", default_value = "0.0.0.0:8000")]
    metrics_addr: SocketAddr,
    /// Seconds open streams may run after SIGTERM.
    #[arg(long, env = "SLUICE_DRAIN_GRACE_SECS", default_value_t = 30)]
    drain_grace_secs: u64,
}

/// Serves `gateway` on `addr` until `shutdown`, then lets open responses finish within
/// `grace` and closes the bus clients.
pub async fn serve_until(
    gateway: &Gateway,
    addr: SocketAddr,
    shutdown: CancellationToken,
    grace: Duration,
    bound: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    let stop_accepting = CancellationToken::new();
    let (local, task) = gateway
        .serve(addr, stop_accepting.clone())
        .await
        .map_err(|e| e.to_string())?;
    bound(local);
    shutdown.cancelled().await;
    stop_accepting.cancel();
    let abort = task.abort_handle();
    if tokio::time::timeout(grace, task).await.is_err() {
        warn!(grace = ?grace, "open responses did not finish within the drain grace; closing them");
        abort.abort();
    }
    gateway.close().await;
    Ok(())
}

/// Runs the gateway until SIGTERM/SIGINT.
pub async fn run(mut args: GatewayCommand) -> Result<(), String> {
    // TrustGraph's clients (tg-invoke-*, its Python API) default to port 8888.
    let port = if args.trustgraph { 8888 } else { 8088 };
    if args.trustgraph {
        args.bus.topic_mapping = TopicMapping::TrustGraph;
    }
    let addr = args
        .gateway
        .listen_or(SocketAddr::from(([0, 0, 0, 0], port)));
    let (config, topics) = args.gateway.config(
        addr,
        &args.services,
        &args.topicspace,
        args.bus.topic_mapping,
        args.trustgraph,
    )?;
    let bus: Arc<dyn Bus> = connect(&args.bus, &topics).await?;
    let telemetry = Telemetry::new().map_err(|e| e.to_string())?;
    // The limits topic is used only when the replicas share their keys' limits: a keys file
    // and a secret they share. Without the secret each replica counts alone, the topic is
    // never created, and there is no policy to set on it.
    let limits_topic = config
        .limits_topic
        .clone()
        .filter(|_| config.auth.keys().is_some() && config.secret.is_some());
    let gateway = Gateway::start(bus, config, &telemetry)
        .await
        .map_err(|e| e.to_string())?;
    // The shared limit state is one snapshot per key and replica. It is kept for a month
    // and a day (a gone replica's snapshots count for the month's quota, and nobody publishes
    // them again), and compaction keeps what a starting replica reads about one snapshot per
    // key and replica. Best effort: on a secured cluster the operator may set both instead.
    if let (Some(topic), Some(admin_url)) = (limits_topic, &args.bus.pulsar_admin_url) {
        let admin = pulsar_admin(
            admin_url,
            args.bus.pulsar_tls_ca_file.as_deref(),
            args.bus.allow_plaintext_credentials,
        )?;
        if let Err(e) = admin
            .set_topic_retention(&topic, LIMITS_RETENTION_MINUTES, LIMITS_RETENTION_MB)
            .await
        {
            warn!(topic, error = %e, "cannot set the limits topic's retention; set it with pulsar-admin topics set-retention --time 32d --size -1");
        }
        if let Err(e) = admin
            .set_compaction_threshold(&topic, LIMITS_COMPACTION_BYTES)
            .await
        {
            warn!(topic, error = %e, "cannot set the limits topic's compaction threshold; set it with pulsar-admin topics set-compaction-threshold --threshold 1M");
        }
    }
    let telemetry_stop = CancellationToken::new();
    let metrics = telemetry
        .serve(args.metrics_addr, telemetry_stop.clone())
        .await
        .map_err(|e| format!("cannot serve metrics on {}: {e}", args.metrics_addr))?;
    info!(%metrics, "serving /metrics /healthz /readyz");
    let shutdown = shutdown_on_signals();
    let draining = {
        let shutdown = shutdown.clone();
        let health = telemetry.health.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            health.set_draining();
        })
    };
    let result = serve_until(
        &gateway,
        addr,
        shutdown,
        Duration::from_secs(args.drain_grace_secs),
        |local| println!("gateway listening on {local}"),
    )
    .await;
    draining.abort();
    telemetry_stop.cancel();
    result
}
