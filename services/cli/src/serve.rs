//! `sluice serve`: the embedded default. The text-completion, prompt and agent processors
//! and the gateway in one process, on the in-process bus (or on Pulsar with `--pulsar-url`). Configured by
//! flags, their environment variables, and `--config FILE` (see `config.rs`).

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use clap::Args;
use sluice_gateway::{Gateway, GatewayConfig, ServiceKind};
use sluice_prompt::handler::PromptService;
use sluice_runtime::{
    bus::Bus,
    processor::{self, ProcessorConfig},
    telemetry::{Telemetry, shutdown_on_signals},
};
use sluice_schema::{TopicMapping, TopicName, topics::defaults};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::{
    agent::{AgentArgs, agent_service},
    common::{BusArgs, LlmServiceArgs, cancel_topic, connect, pulsar_admin},
    gateway::{GatewayArgs, serve_until},
    prompt::{TemplateArgs, template_store},
    text_completion::{LlmArgs, service},
};

/// `sluice serve` options.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A TOML file of option values: `model = "..."`, `base-url = "..."`, one key per long
    /// option of this command. Flags and environment variables take precedence over it.
    #[arg(long, env = "SLUICE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Run on this Pulsar broker instead of the in-process bus (the token comes from
    /// SLUICE_PULSAR_TOKEN or SLUICE_PULSAR_TOKEN_FILE).
    #[arg(long)]
    pub pulsar_url: Option<String>,
    /// Pulsar admin URL, to create the topics' namespaces at start-up.
    #[arg(long)]
    pub pulsar_admin_url: Option<String>,
    /// A PEM file of CA certificates to trust for `pulsar+ssl://` and an `https://` admin URL.
    #[arg(long, env = "SLUICE_PULSAR_TLS_CA_FILE")]
    pub pulsar_tls_ca_file: Option<std::path::PathBuf>,
    /// Send the Pulsar token or OAuth2 credentials over plaintext (`pulsar://`, `http://`)
    /// beyond loopback. Refused otherwise (docs/security.md).
    #[arg(long, env = "SLUICE_ALLOW_PLAINTEXT_CREDENTIALS")]
    pub allow_plaintext_credentials: bool,
    /// `durable` or `trustgraph` (with `--pulsar-url`).
    #[arg(long, default_value = "durable")]
    pub topic_mapping: TopicMapping,
    #[command(flatten)]
    pub gateway: GatewayArgs,
    #[command(flatten)]
    pub llm: LlmArgs,
    #[command(flatten)]
    pub templates: TemplateArgs,
    #[command(flatten)]
    pub agent: AgentArgs,
    /// Completions (and prompts) handled at once.
    #[arg(long, env = "SLUICE_CONCURRENCY", default_value_t = processor::DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "SLUICE_METRICS_ADDR", default_value = "127.0.0.1:8000")]
    pub metrics_addr: SocketAddr,
    /// Seconds in-flight work may run after SIGTERM.
    #[arg(long, env = "SLUICE_DRAIN_GRACE_SECS", default_value_t = 30)]
    pub drain_grace_secs: u64,
}

/// Runs everything until SIGTERM/SIGINT, then drains.
pub async fn run(args: ServeArgs) -> Result<(), String> {
    let mapping = args.topic_mapping;
    let addr = args
        .gateway
        .listen_or(SocketAddr::from(([127, 0, 0, 1], 8088)));
    let grace = Duration::from_secs(args.drain_grace_secs);
    let Plan {
        gateway_config,
        topics,
        mut tc_config,
        prompt_config,
        agent_config,
        llm_service,
    } = args.plan(addr, grace)?;

    let telemetry = Telemetry::new().map_err(|e| e.to_string())?;
    let handler = Arc::new(service(&args.llm, &telemetry)?);
    let stop_watching = CancellationToken::new();
    let (store, prompt_metrics) =
        template_store(&args.templates, &telemetry, stop_watching.clone())?;
    let bus_args = args.bus_args();
    let bus: Arc<dyn Bus> = connect(&bus_args, &topics).await?;
    info!(
        bus = if bus_args.in_process {
            "in-process"
        } else {
            "pulsar"
        },
        "sluice serve starting"
    );
    let admin = args.admin()?;
    // On the in-process bus nobody can read the ledger's topic: its metrics are what counts.
    tc_config.ledger = args
        .llm
        .usage
        .ledger(&*bus, &telemetry, admin.as_ref())
        .await?;
    tc_config.billing = crate::text_completion::billing_key()?;
    let llm_client = llm_service.client(bus.clone(), mapping, &telemetry).await?;
    args.templates.announce_content_logging();
    let prompt_handler = Arc::new(
        PromptService::new(store, llm_client.clone(), prompt_metrics)
            .with_content_logging(args.templates.log_content)
            .with_structured_output(args.templates.structured_output),
    );
    let (agent_handler, fanin) = agent_service(
        &args.agent,
        llm_client.clone(),
        bus.clone(),
        mapping,
        &agent_config.request_topic,
        &telemetry,
    )
    .await?;
    let agent_handler = Arc::new(agent_handler);

    let shutdown = shutdown_on_signals();
    let processor_stop = CancellationToken::new();
    // What readiness watches already (the LLM client's response subscription); each
    // processor adds its request subscription once it has it.
    let watched_before = telemetry.health.watched();
    let mut processors = tokio::task::JoinSet::new();
    let (t, stop) = (&telemetry, &processor_stop);
    spawn(&mut processors, &bus, tc_config, handler, t, stop);
    spawn(
        &mut processors,
        &bus,
        prompt_config,
        prompt_handler,
        t,
        stop,
    );
    spawn(&mut processors, &bus, agent_config, agent_handler, t, stop);
    // The supervisor's fan-in joiner (on the in-process bus the only one: it holds the fan-in
    // from the start).
    tokio::spawn(fanin.run(processor_stop.clone()));
    // The in-process bus delivers only what is published after a subscription exists: the
    // gateway opens once every processor started above has subscribed.
    let subscribed = watched_before + processors.len();
    until_subscribed(&telemetry, &mut processors, subscribed).await?;
    // The gateway reads text-completion's answers through the processors' client: one
    // response subscription in the process (see Gateway::start_sharing).
    let gateway = Gateway::start_sharing(bus, gateway_config, &telemetry, Some(llm_client.clone()))
        .await
        .map_err(|e| e.to_string())?;
    let telemetry_stop = CancellationToken::new();
    let (metrics, metrics_task) = metrics_server(
        args.metrics_addr,
        &gateway,
        &telemetry,
        shutdown.clone(),
        telemetry_stop.clone(),
    )
    .await?;
    let on_signal = tokio::spawn(drain_on(
        shutdown.clone(),
        telemetry.health.clone(),
        processor_stop.clone(),
    ));
    let served = serve_until(&gateway, addr, shutdown, grace, |local| {
        println!("sluice serve: gateway on http://{local}, metrics on http://{metrics}/metrics");
    })
    .await;
    let failed = drained(processors).await;
    stop_watching.cancel();
    llm_client.close().await;
    on_signal.abort();
    telemetry_stop.cancel();
    if let Some(task) = metrics_task {
        // Its API answers ended with the gateway's clients; what is left is idle connections.
        let abort = task.abort_handle();
        if tokio::time::timeout(grace, task).await.is_err() {
            abort.abort();
        }
    }
    served?;
    failed.map_or(Ok(()), Err)
}

/// What `sluice serve` runs, before anything is connected.
struct Plan {
    /// The gateway's, with the three services' topics.
    gateway_config: GatewayConfig,
    /// Every topic the process uses (the in-process bus is told them up front).
    topics: Vec<TopicName>,
    tc_config: ProcessorConfig,
    prompt_config: ProcessorConfig,
    agent_config: ProcessorConfig,
    /// How the prompt and agent processors reach text-completion.
    llm_service: LlmServiceArgs,
}

impl ServeArgs {
    /// The gateway on `addr` and the three processors on the default topics, draining for
    /// `grace`.
    fn plan(&self, addr: SocketAddr, grace: Duration) -> Result<Plan, String> {
        let mapping = self.topic_mapping;
        let services = [
            ServiceKind::TextCompletion,
            ServiceKind::Prompt,
            ServiceKind::Agent,
        ];
        let (gateway_config, mut topics) =
            self.gateway
                .config(addr, &services, defaults::TOPICSPACE, mapping, false)?;
        let processor_config = |kind: ServiceKind| -> Result<ProcessorConfig, String> {
            let name = kind.as_str();
            let t = &gateway_config.services[&kind];
            let mut c = ProcessorConfig::new(name, t.request.clone(), t.response.clone());
            c.cancel_topic = Some(cancel_topic(name, None)?.to_pulsar(mapping));
            // The in-process bus drops nothing: pacing (for non-persistent Pulsar topics)
            // would only merge what the gateway's callers could have had token by token.
            if self.pulsar_url.is_none() {
                c.pacing.when = sluice_runtime::processor::PaceWhen::Off;
            }
            c.concurrency = self.concurrency;
            c.drain_grace = grace;
            Ok(c)
        };
        let tc_config = processor_config(ServiceKind::TextCompletion)?;
        let prompt_config = processor_config(ServiceKind::Prompt)?;
        let agent_config = processor_config(ServiceKind::Agent)?;
        // The prompt processor reaches text-completion by the same default topics.
        let llm_service = LlmServiceArgs {
            llm_request_topic: defaults::TEXT_COMPLETION_REQUEST.into(),
            llm_response_topic: defaults::TEXT_COMPLETION_RESPONSE.into(),
            llm_cancel_topic: defaults::TEXT_COMPLETION_CANCEL.into(),
            llm_inactivity_timeout_secs: self.gateway.inactivity_timeout_secs,
            llm_timeout_secs: self.gateway.request_timeout_secs,
        };
        topics.extend(llm_service.topics()?);
        topics.sort_by_key(ToString::to_string);
        topics.dedup_by_key(|t| t.to_string());
        Ok(Plan {
            gateway_config,
            topics,
            tc_config,
            prompt_config,
            agent_config,
            llm_service,
        })
    }
    /// The admin API's client, with `--pulsar-admin-url`.
    fn admin(&self) -> Result<Option<sluice_runtime::bus::admin::PulsarAdmin>, String> {
        self.pulsar_admin_url
            .as_deref()
            .map(|url| {
                pulsar_admin(
                    url,
                    self.pulsar_tls_ca_file.as_deref(),
                    self.allow_plaintext_credentials,
                )
            })
            .transpose()
    }

    /// The bus: the in-process one without `--pulsar-url`.
    fn bus_args(&self) -> BusArgs {
        BusArgs {
            pulsar_url: self.pulsar_url.clone().unwrap_or_default(),
            pulsar_admin_url: self.pulsar_admin_url.clone(),
            pulsar_tls_ca_file: self.pulsar_tls_ca_file.clone(),
            topic_mapping: self.topic_mapping,
            connect_wait_secs: 120,
            in_process: self.pulsar_url.is_none(),
            allow_plaintext_credentials: self.allow_plaintext_credentials,
        }
    }
}

/// Serves /metrics, /healthz and /readyz on `addr` until `stop`: its address, and the task
/// when it serves the gateway's routes too (to be waited for while they drain).
async fn metrics_server(
    addr: SocketAddr,
    gateway: &Gateway,
    telemetry: &Telemetry,
    shutdown: CancellationToken,
    stop: CancellationToken,
) -> Result<(SocketAddr, Option<tokio::task::JoinHandle<()>>), String> {
    if !addr.ip().is_loopback() {
        let local = telemetry
            .serve(addr, stop)
            .await
            .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
        info!(metrics = %local, "serving /metrics /healthz /readyz");
        return Ok((local, None));
    }
    // The event protocol's own test command (docs/specs.md#the-event-protocol) calls
    // localhost:8000, this port by default: on loopback it serves the gateway's routes too,
    // so that command works as written. Not beyond loopback: `--listen`'s check (no open
    // listener without credentials) never looked at this address.
    let app = gateway
        .router()
        .layer(axum::middleware::from_fn_with_state(
            shutdown,
            refuse_when_stopping,
        ))
        .merge(telemetry.routes());
    let (local, task) = gateway
        .serve_app(addr, app, stop)
        .await
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    info!(metrics = %local, "serving /metrics /healthz /readyz and the gateway's routes");
    Ok((local, Some(task)))
}

/// Waits until readiness watches `subscribed` links (every processor has its request
/// subscription); an error if a processor ends first.
async fn until_subscribed(
    telemetry: &Telemetry,
    processors: &mut tokio::task::JoinSet<Result<(), sluice_runtime::bus::BusError>>,
    subscribed: usize,
) -> Result<(), String> {
    tokio::select! {
        () = telemetry.health.until_watched(subscribed) => Ok(()),
        done = processors.join_next() => match done {
            Some(Ok(Err(e))) => Err(format!("a processor could not start: {e}")),
            _ => Err("a processor stopped at start-up".into()),
        },
    }
}

/// Runs a processor in `set`.
fn spawn<H: processor::Handler>(
    set: &mut tokio::task::JoinSet<Result<(), sluice_runtime::bus::BusError>>,
    bus: &Arc<dyn Bus>,
    config: ProcessorConfig,
    handler: Arc<H>,
    telemetry: &Telemetry,
    stop: &CancellationToken,
) {
    set.spawn(processor::run(
        bus.clone(),
        config,
        handler,
        telemetry.clone(),
        stop.clone(),
    ));
}

/// On the signal: readiness says draining and the processors stop taking work.
async fn drain_on(
    shutdown: CancellationToken,
    health: sluice_runtime::telemetry::Health,
    processor_stop: CancellationToken,
) {
    shutdown.cancelled().await;
    health.set_draining();
    processor_stop.cancel();
}

/// Waits for every processor to end: the last failure, if any.
async fn drained(
    mut processors: tokio::task::JoinSet<Result<(), sluice_runtime::bus::BusError>>,
) -> Option<String> {
    let mut failed = None;
    while let Some(done) = processors.join_next().await {
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed = Some(e.to_string()),
            Err(e) => failed = Some(format!("a processor failed: {e}")),
        }
    }
    failed
}

/// The gateway's routes on the metrics port once SIGTERM came: the gateway's own port stops
/// accepting then, and the processors take no new work, so a new request is refused at once
/// (the port itself stays open for `/readyz`, which says `draining`).
async fn refuse_when_stopping(
    axum::extract::State(stopping): axum::extract::State<CancellationToken>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if stopping.is_cancelled() {
        let body = serde_json::json!({"error": {
            "type": "gateway-error",
            "message": "sluice serve is shutting down",
        }});
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(body),
        )
            .into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use axum::{Router, middleware, routing::post};

    use super::*;

    /// Once SIGTERM came, a new request to the gateway's routes on the metrics port is
    /// refused at once with the gateway's JSON error, instead of waiting on processors that
    /// take no more work.
    #[tokio::test]
    async fn the_routes_on_the_metrics_port_refuse_new_requests_once_stopping() {
        let stopping = CancellationToken::new();
        let app = Router::new()
            .route("/v1/chat/completions", post(|| async { "answered" }))
            .layer(middleware::from_fn_with_state(
                stopping.clone(),
                refuse_when_stopping,
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/v1/chat/completions",
            listener.local_addr().unwrap()
        );
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        sluice_runtime::install_crypto_provider();
        let client = reqwest::Client::new();
        let resp = client.post(&url).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.text().await.unwrap(), "answered");
        stopping.cancel();
        let resp = client.post(&url).send().await.unwrap();
        assert_eq!(resp.status(), 503);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["type"], "gateway-error");
        server.abort();
    }
}
