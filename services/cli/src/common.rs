//! Options every processor subcommand shares: the bus, the topics, concurrency, telemetry.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use clap::Args;
use sluice_runtime::{
    bus::{
        Bus,
        admin::{NamespacePolicy, PulsarAdmin},
        memory::MemoryBus,
        pulsar::{PulsarBus, PulsarConfig},
    },
    processor::ProcessorConfig,
    secret::Secret,
};
use sluice_schema::{TopicMapping, TopicName};

/// The `--config` file of a processor subcommand. `config::expand` reads it before clap
/// parses; the field is here for `--help` and for clap to accept the option.
#[derive(Args, Debug, Clone)]
pub struct ConfigFileArgs {
    /// A TOML file of option values, one key per long option of this command (`model =
    /// "..."`, `concurrency = 64`). Flags and environment variables take precedence over it.
    #[arg(long, env = "SLUICE_CONFIG")]
    pub config: Option<PathBuf>,
}

/// Where the bus is.
#[derive(Args, Debug, Clone)]
pub struct BusArgs {
    /// Pulsar broker URL. The token comes from SLUICE_PULSAR_TOKEN or SLUICE_PULSAR_TOKEN_FILE.
    #[arg(
        long,
        env = "SLUICE_PULSAR_URL",
        default_value = "pulsar://127.0.0.1:6650"
    )]
    pub pulsar_url: String,
    /// Pulsar admin URL; when set, the topics' tenants and namespaces are created at start-up.
    #[arg(long, env = "SLUICE_PULSAR_ADMIN_URL")]
    pub pulsar_admin_url: Option<String>,
    /// `durable` (every topic persistent) or `trustgraph` (TrustGraph's non-persistent
    /// request/response topics).
    #[arg(long, env = "SLUICE_TOPIC_MAPPING", default_value = "durable")]
    pub topic_mapping: TopicMapping,
    /// How long to wait for the broker at start-up, in seconds.
    #[arg(long, default_value_t = 120)]
    pub connect_wait_secs: u64,
    /// Use the in-process bus instead of Pulsar (single-process use only).
    #[arg(long, hide = true)]
    pub in_process: bool,
}

/// How a processor consumes.
#[derive(Args, Debug, Clone)]
pub struct ProcessorArgs {
    /// Request topic, `class:topicspace:topic` or a Pulsar URL.
    #[arg(long)]
    pub request_topic: Option<String>,
    /// Response topic.
    #[arg(long)]
    pub response_topic: Option<String>,
    /// Topic clients publish cancels on (default `notify:tg:<processor>-cancel`).
    #[arg(long)]
    pub cancel_topic: Option<String>,
    /// Shared subscription name; replicas with the same name share the requests.
    #[arg(long)]
    pub subscription: Option<String>,
    /// Requests handled at once.
    #[arg(long, env = "SLUICE_CONCURRENCY", default_value_t = sluice_runtime::processor::DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
    /// Seconds in-flight requests may run after SIGTERM.
    #[arg(long, env = "SLUICE_DRAIN_GRACE_SECS", default_value_t = 30)]
    pub drain_grace_secs: u64,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "SLUICE_METRICS_ADDR", default_value = "0.0.0.0:8000")]
    pub metrics_addr: SocketAddr,
}

/// The processor config for `name`, with TrustGraph's default topics for it.
pub fn processor_config(
    name: &str,
    args: &ProcessorArgs,
    mapping: TopicMapping,
) -> Result<(ProcessorConfig, Vec<TopicName>), String> {
    let parse = |given: &Option<String>, class: &str| -> Result<TopicName, String> {
        given
            .clone()
            .unwrap_or_else(|| format!("{class}:tg:{name}"))
            .parse::<TopicName>()
            .map_err(|e| e.to_string())
    };
    let request = parse(&args.request_topic, "request")?;
    let response = parse(&args.response_topic, "response")?;
    let cancel = cancel_topic(name, args.cancel_topic.as_deref())?;
    let mut config = ProcessorConfig::new(
        name,
        request.to_pulsar(mapping),
        response.to_pulsar(mapping),
    );
    config.subscription = args.subscription.clone().unwrap_or_else(|| name.to_owned());
    config.concurrency = args.concurrency;
    config.drain_grace = Duration::from_secs(args.drain_grace_secs);
    config.cancel_topic = Some(cancel.to_pulsar(mapping));
    Ok((config, vec![request, response, cancel]))
}

/// The cancel topic of service `name`: `given`, or `notify:tg:<name>-cancel`.
pub fn cancel_topic(name: &str, given: Option<&str>) -> Result<TopicName, String> {
    given
        .map_or_else(|| format!("notify:tg:{name}-cancel"), str::to_owned)
        .parse::<TopicName>()
        .map_err(|e| e.to_string())
}

/// Connects the bus, creating the topics' namespaces first when an admin URL is given.
pub async fn connect(args: &BusArgs, topics: &[TopicName]) -> Result<Arc<dyn Bus>, String> {
    if args.in_process {
        return Ok(Arc::new(MemoryBus::default()));
    }
    let token = Secret::from_env("SLUICE_PULSAR_TOKEN").map_err(|e| e.to_string())?;
    if let Some(admin_url) = &args.pulsar_admin_url {
        let admin =
            PulsarAdmin::new(admin_url.clone(), token.clone()).map_err(|e| e.to_string())?;
        for ns in topics.iter().filter_map(TopicName::namespace) {
            let policy = NamespacePolicy {
                // Response and cancel subscriptions belong to one instance each; expire the
                // ones whose instance died without unsubscribing.
                subscription_expiration_minutes: if ns.ends_with("/response")
                    || ns.ends_with("/notify")
                {
                    60
                } else {
                    0
                },
            };
            admin
                .ensure_namespace(&ns, policy)
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    let mut config = PulsarConfig::new(args.pulsar_url.clone());
    config.token = token;
    let bus = PulsarBus::connect(config, Duration::from_secs(args.connect_wait_secs))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Arc::new(bus))
}
