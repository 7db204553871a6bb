//! Options every processor subcommand shares: the bus, the topics, concurrency, telemetry.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use clap::Args;
use sluice_runtime::{
    backoff::Backoff,
    bus::{
        Bus, BusError,
        admin::{NamespacePolicy, PulsarAdmin},
        memory::MemoryBus,
        oauth2::OAuth2Config,
        pulsar::{PulsarBus, PulsarConfig},
        pulsar_security::PulsarAuth,
    },
    client::{ClientConfig, RequestClient},
    flows::{ConfigTopics, FlowsConfig},
    processor::{
        DEFAULT_MAX_RECORDS_PER_SEC, DEFAULT_PACE_INTERVAL, PaceWhen, Pacing, ProcessorConfig,
    },
    secret::Secret,
    telemetry::Telemetry,
};
use sluice_schema::{
    TextCompletionRequest, TextCompletionResponse, TopicMapping, TopicName, topics::defaults,
};

/// A client of the text-completion service (the prompt and agent processors' own).
pub type LlmClient = RequestClient<TextCompletionRequest, TextCompletionResponse>;

/// The `--config` file of a processor subcommand. `config::expand` reads it before clap
/// parses; the field is here for `--help` and for clap to accept the option.
#[derive(Args, Debug, Clone)]
pub struct ConfigFileArgs {
    /// A TOML file of option values, one key per long option of this command (`model =
    /// "..."`, `concurrency = 64`). Flags and environment variables take precedence over it.
    #[arg(long, env = "SLUICE_CONFIG")]
    pub config: Option<PathBuf>,
}

/// How a processor reaches text-completion (shared by `prompt`, `agent` and `serve`).
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

    /// The client's settings, on the topics these options name (a flow's client takes its
    /// own topics and the rest).
    pub fn client_config(&self, mapping: TopicMapping) -> Result<ClientConfig, String> {
        let t = self.topics()?;
        let mut config = ClientConfig::new(
            "text-completion",
            t[0].to_pulsar(mapping),
            t[1].to_pulsar(mapping),
        );
        config.cancel_topic = Some(t[2].to_pulsar(mapping));
        config.inactivity_timeout = Duration::from_secs(self.llm_inactivity_timeout_secs);
        config.total_timeout = Duration::from_secs(self.llm_timeout_secs);
        Ok(config)
    }

    /// A text-completion client on `bus`; readiness watches its response subscription.
    pub async fn client(
        &self,
        bus: Arc<dyn Bus>,
        mapping: TopicMapping,
        telemetry: &Telemetry,
    ) -> Result<Arc<LlmClient>, String> {
        let client = RequestClient::start(
            bus,
            self.client_config(mapping)?,
            Some(telemetry.metrics.clone()),
        )
        .await
        .map_err(|e| format!("cannot reach text-completion's topics: {e}"))?;
        telemetry
            .health
            .watch("text-completion responses", client.link());
        Ok(Arc::new(client))
    }
}

/// Where the bus is.
#[derive(Args, Debug, Clone)]
pub struct BusArgs {
    /// Pulsar broker URL: `pulsar://host:6650`, or `pulsar+ssl://host:6651` for TLS (the
    /// broker's certificate must name the host). Credentials come from the environment: a
    /// token in SLUICE_PULSAR_TOKEN, or in the file named by SLUICE_PULSAR_TOKEN_FILE (read
    /// again at every connection, so a rotated Secret is picked up), or OAuth2 client
    /// credentials (SLUICE_PULSAR_OAUTH2_ISSUER_URL, _CLIENT_ID, _CLIENT_SECRET or
    /// _CLIENT_SECRET_FILE, and optionally _AUDIENCE and _SCOPE).
    #[arg(
        long,
        env = "SLUICE_PULSAR_URL",
        default_value = "pulsar://127.0.0.1:6650"
    )]
    pub pulsar_url: String,
    /// A PEM file of CA certificates to trust for `pulsar+ssl://` and an `https://` admin URL,
    /// besides the system roots.
    #[arg(long, env = "SLUICE_PULSAR_TLS_CA_FILE")]
    pub pulsar_tls_ca_file: Option<PathBuf>,
    /// Pulsar admin URL; when set, the topics' tenants and namespaces are created at start-up.
    #[arg(long, env = "SLUICE_PULSAR_ADMIN_URL")]
    pub pulsar_admin_url: Option<String>,
    /// `durable` (every topic persistent) or `trustgraph` (TrustGraph's non-persistent
    /// request/response topics).
    #[arg(long, env = "SLUICE_TOPIC_MAPPING", default_value = "durable")]
    pub topic_mapping: TopicMapping,
    /// How long to wait for the broker (its admin API included) at start-up, in seconds.
    #[arg(long, default_value_t = 120)]
    pub connect_wait_secs: u64,
    /// Use the in-process bus instead of Pulsar (single-process use only).
    #[arg(long, hide = true)]
    pub in_process: bool,
    /// Send the Pulsar token or OAuth2 credentials over a plaintext `pulsar://` broker URL,
    /// `http://` admin URL or `http://` OAuth2 issuer beyond loopback. Refused otherwise:
    /// anyone on the network path could read them (docs/security.md).
    #[arg(long, env = "SLUICE_ALLOW_PLAINTEXT_CREDENTIALS")]
    pub allow_plaintext_credentials: bool,
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
    /// When to pace response records: `auto` on non-persistent response topics (TrustGraph's
    /// mapping, where the broker drops what a slow consumer has no room for), `on`, `off`.
    /// A paced stream publishes at most one record per interval, merging the text deltas
    /// between; under the rate bound its first and last records are never delayed
    /// (docs/operations.md, "TrustGraph's mapping"). `merge` (the default): as `auto`, and
    /// on a durable topic a stream merges a delta into the next while the broker has not
    /// confirmed its previous record (fewer records when the broker is busy).
    #[arg(long, env = "SLUICE_RESPONSE_PACING", default_value_t = PaceWhen::Merge)]
    pub response_pacing: PaceWhen,
    /// The least time between two records of one paced stream, in milliseconds.
    #[arg(long, env = "SLUICE_PACE_INTERVAL_MS", default_value_t = DEFAULT_PACE_INTERVAL.as_millis() as u64)]
    pub pace_interval_ms: u64,
    /// A paced processor's records per second over all its streams, at most, first and
    /// terminal records included (a stream's interval grows with the streams open, and a
    /// record over the bound waits its turn, 5 s at most); 0 for no bound.
    #[arg(long, env = "SLUICE_MAX_RESPONSE_RECORDS_PER_SEC", default_value_t = DEFAULT_MAX_RECORDS_PER_SEC)]
    pub max_response_records_per_sec: u32,
}

impl ProcessorArgs {
    /// The pacing these options ask for.
    pub fn pacing(&self) -> Pacing {
        Pacing {
            when: self.response_pacing,
            min_interval: Duration::from_millis(self.pace_interval_ms),
            max_records_per_sec: (self.max_response_records_per_sec > 0)
                .then_some(self.max_response_records_per_sec),
        }
    }
}

/// TrustGraph's config service as the source of a processor's flows.
#[derive(Args, Debug, Clone)]
pub struct ConfigServiceArgs {
    /// Serve the flows TrustGraph's config service assigns to this processor (its entries
    /// of type `processor:<id>`), several at once, started and stopped as the config
    /// changes; the request and response topic options are then not used. Each flow's
    /// topics follow --topic-mapping; TrustGraph's own deployments need `trustgraph`.
    #[arg(long)]
    pub config_service: bool,
    /// This processor's id in TrustGraph's config (TrustGraph's `--id`).
    #[arg(long = "id", env = "SLUICE_PROCESSOR_ID")]
    pub processor_id: Option<String>,
    /// Seconds between full reads of the config, besides the change pushes (which travel on
    /// a non-persistent topic and can be missed).
    #[arg(long, default_value_t = 60)]
    pub config_resync_secs: u64,
    /// Seconds one request to the config service may take.
    #[arg(long, default_value_t = 30)]
    pub config_timeout_secs: u64,
    /// The config service's request topic (TrustGraph's `request:tg:config`).
    #[arg(long, default_value = sluice_schema::config::CONFIG_REQUEST_TOPIC)]
    pub config_request_topic: String,
    /// The config service's response topic.
    #[arg(long, default_value = sluice_schema::config::CONFIG_RESPONSE_TOPIC)]
    pub config_response_topic: String,
    /// The config service's change announcements (TrustGraph's `--config-push-queue`).
    #[arg(long, default_value = sluice_schema::config::CONFIG_PUSH_TOPIC)]
    pub config_push_topic: String,
}

impl ConfigServiceArgs {
    /// The supervisor's settings, `default_id` being TrustGraph's default id for the
    /// processor and `consumer` each flow's consumer settings but its topics (see
    /// [`processor_config`]); `None` unless --config-service was given.
    pub fn flows(
        &self,
        default_id: &str,
        mapping: TopicMapping,
        processor: &ProcessorArgs,
        consumer: &ProcessorConfig,
    ) -> Result<Option<FlowsConfig>, String> {
        if !self.config_service {
            return Ok(None);
        }
        if processor.request_topic.is_some() || processor.response_topic.is_some() {
            return Err("--config-service takes each flow's topics from the config; leave out --request-topic and --response-topic".into());
        }
        let id = self
            .processor_id
            .clone()
            .unwrap_or_else(|| default_id.to_owned());
        let [request, response, push] = self.topic_names()?;
        let topics = ConfigTopics {
            request: request.to_pulsar(mapping),
            response: response.to_pulsar(mapping),
            push: push.to_pulsar(mapping),
        };
        let mut config = FlowsConfig::new(id, topics, consumer.clone(), mapping);
        config.resync = Duration::from_secs(self.config_resync_secs.max(1));
        config.request_timeout = Duration::from_secs(self.config_timeout_secs.max(1));
        Ok(Some(config))
    }

    /// The config service's request, response and push topics, for namespace creation.
    pub fn topic_names(&self) -> Result<[TopicName; 3], String> {
        let parse = |t: &str| t.parse::<TopicName>().map_err(|e| e.to_string());
        Ok([
            parse(&self.config_request_topic)?,
            parse(&self.config_response_topic)?,
            parse(&self.config_push_topic)?,
        ])
    }
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
            .unwrap_or_else(|| defaults::service_topic(class, name))
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
    config.pacing = args.pacing();
    Ok((config, vec![request, response, cancel]))
}

/// The cancel topic of service `name`: `given`, or `notify:tg:<name>-cancel`.
pub fn cancel_topic(name: &str, given: Option<&str>) -> Result<TopicName, String> {
    given
        .map_or_else(|| defaults::cancel_topic(name), str::to_owned)
        .parse::<TopicName>()
        .map_err(|e| e.to_string())
}

/// Connects the bus, creating the topics' namespaces first when an admin URL is given.
///
/// The wait for the broker (`--connect-wait-secs`) covers both steps: in Kubernetes the pods
/// and the broker start in any order, and the shipped startup probe allows for the wait. An
/// admin API that does not answer yet is asked again until the deadline; a refusal of the
/// credentials or the configuration ends the wait at once.
pub async fn connect(args: &BusArgs, topics: &[TopicName]) -> Result<Arc<dyn Bus>, String> {
    if args.in_process {
        return Ok(Arc::new(MemoryBus::default()));
    }
    let deadline = Instant::now() + Duration::from_secs(args.connect_wait_secs);
    let auth = pulsar_auth(args.pulsar_tls_ca_file.as_deref())?;
    if let Some(admin_url) = &args.pulsar_admin_url {
        let admin = pulsar_admin(
            admin_url,
            args.pulsar_tls_ca_file.as_deref(),
            args.allow_plaintext_credentials,
        )?;
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
                // A resumed stream reads its records again (the gateway's
                // --resume-window-secs, 15 minutes by default, stays within this).
                retention_minutes: if ns.ends_with("/response") { 60 } else { 0 },
                retention_mb: 1024,
            };
            let mut backoff = Backoff::new(Duration::from_secs(5));
            loop {
                match admin.ensure_namespace(&ns, policy).await {
                    Ok(()) => break,
                    // On a secured cluster tenants and namespaces are the operator's, and a
                    // processor's role may not even read them: go on and let the broker say
                    // whether the topics themselves can be used.
                    Err(BusError::Denied(d)) => {
                        tracing::warn!(namespace = %ns, error = %d,
                            "this role cannot check the namespace; assuming the operator created it");
                        break;
                    }
                    Err(e @ BusError::Unavailable(_))
                        if Instant::now() + backoff.peek() < deadline =>
                    {
                        tracing::warn!(namespace = %ns, error = %e,
                            "pulsar's admin API not reachable yet; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
        }
    }
    let mut config = PulsarConfig::new(args.pulsar_url.clone());
    config.auth = auth;
    config.tls_ca_file = args.pulsar_tls_ca_file.clone();
    config.allow_plaintext_credentials = args.allow_plaintext_credentials;
    let bus = PulsarBus::connect(config, deadline.saturating_duration_since(Instant::now()))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Arc::new(bus))
}

/// The admin client for `url`, with the token (SLUICE_PULSAR_TOKEN or _FILE) and the CA file;
/// a token is not sent over plaintext beyond loopback unless `allow_plaintext_credentials`.
pub fn pulsar_admin(
    url: &str,
    ca_file: Option<&Path>,
    allow_plaintext_credentials: bool,
) -> Result<PulsarAdmin, String> {
    let token = Secret::from_env("SLUICE_PULSAR_TOKEN").map_err(|e| e.to_string())?;
    let admin = PulsarAdmin::new(url.to_owned(), token, allow_plaintext_credentials)
        .map_err(|e| e.to_string())?;
    match ca_file {
        Some(path) => admin.with_tls_ca_file(path).map_err(|e| e.to_string()),
        None => Ok(admin),
    }
}

/// How to authenticate to Pulsar, from the environment (never from the command line): a token
/// file (re-read at every connection), a token, or OAuth2 client credentials; at most one.
pub fn pulsar_auth(ca_file: Option<&Path>) -> Result<PulsarAuth, String> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let oauth2_issuer = var("SLUICE_PULSAR_OAUTH2_ISSUER_URL");
    let token_file = crate::env_path("SLUICE_PULSAR_TOKEN_FILE");
    let token_value = var("SLUICE_PULSAR_TOKEN");
    let given = [
        oauth2_issuer.is_some(),
        token_file.is_some(),
        token_value.is_some(),
    ];
    if given.iter().filter(|g| **g).count() > 1 {
        return Err("give one of SLUICE_PULSAR_TOKEN, SLUICE_PULSAR_TOKEN_FILE and SLUICE_PULSAR_OAUTH2_ISSUER_URL".into());
    }
    if let Some(issuer_url) = oauth2_issuer {
        let client_id = var("SLUICE_PULSAR_OAUTH2_CLIENT_ID")
            .ok_or("SLUICE_PULSAR_OAUTH2_ISSUER_URL needs SLUICE_PULSAR_OAUTH2_CLIENT_ID")?;
        let client_secret = Secret::from_env("SLUICE_PULSAR_OAUTH2_CLIENT_SECRET")
            .map_err(|e| e.to_string())?
            .ok_or("SLUICE_PULSAR_OAUTH2_ISSUER_URL needs SLUICE_PULSAR_OAUTH2_CLIENT_SECRET or SLUICE_PULSAR_OAUTH2_CLIENT_SECRET_FILE")?;
        return Ok(PulsarAuth::OAuth2(OAuth2Config {
            issuer_url,
            client_id,
            client_secret,
            audience: var("SLUICE_PULSAR_OAUTH2_AUDIENCE"),
            scope: var("SLUICE_PULSAR_OAUTH2_SCOPE"),
            ca_file: ca_file.map(Path::to_path_buf),
        }));
    }
    if let Some(path) = token_file {
        return Ok(PulsarAuth::TokenFile(path));
    }
    Ok(Secret::from_env("SLUICE_PULSAR_TOKEN")
        .map_err(|e| e.to_string())?
        .map_or(PulsarAuth::None, PulsarAuth::Token))
}
