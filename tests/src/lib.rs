//! sluice-tests: the harness the integration suites share.
//!
//! - [`Broker`]: the real Pulsar broker the test command started, from `PULSAR_URL` and
//!   `PULSAR_ADMIN_URL`, with a test namespace created once per process;
//! - [`unique_topic`]: a fresh persistent topic per test, so suites run in parallel;
//! - [`EchoHandler`]: a scriptable processor handler (records per request, delay, size),
//!   also run as a separate process by the `echo-processor` binary for crash and drain tests;
//! - [`mcp_server`]: a real MCP server (the official SDK) with scripted tools, for the agent;
//! - [`seed_streams`]: the structured contracts' model outputs for the prompt processor's
//!   built-in templates;
//! - [`cluster`]: the secured multi-broker cluster the test command starts;
//! - [`soak`]: the soak under chaos, every processor as a real process;
//! - [`tg_load`]: TrustGraph's own client against a text-completion process on its mapping
//!   (the pacing test and bench).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod cluster;
pub mod fake;
pub mod fake_anthropic;
pub mod fake_bedrock;
pub mod fake_cohere;
pub mod fake_config;
pub mod fake_gemini;
pub mod fake_oauth2;
pub mod fake_ollama;
pub mod fake_openai;
pub mod fake_otlp;
pub mod keys;
pub mod mcp_server;
pub mod metrics_text;
pub mod process;
pub mod seed_streams;
pub mod soak;
pub mod tg_load;

pub use metrics_text::{eventually_value, metric_value, scrape, value};

use std::{path::Path, sync::Arc, time::Duration};

use async_trait::async_trait;
use sluice_runtime::{
    bus::{
        Bus, BusError,
        admin::{NamespacePolicy, PulsarAdmin},
        pulsar::{PulsarBus, PulsarConfig},
    },
    client::{ClientConfig, RequestClient},
    processor::{self, Handler, ProcessorConfig, RequestContext, ResponseSink},
    telemetry::Telemetry,
};
use sluice_schema::{Error, ErrorKind, TextCompletionRequest, TextCompletionResponse};
use tokio::{sync::OnceCell, task::JoinHandle};
use tokio_util::sync::CancellationToken;

/// A text-completion request/response client.
pub type TextClient = RequestClient<TextCompletionRequest, TextCompletionResponse>;

/// Every record of `stream` to its end, for a test that expects one attempt's answer: an
/// error or a restart panics.
pub async fn records_of_one_attempt<R: sluice_schema::ResponseRecord>(
    mut stream: sluice_runtime::client::ResponseStream<R>,
) -> Vec<R> {
    let mut out = Vec::new();
    while let Some(item) = stream.next().await {
        match item.unwrap() {
            sluice_runtime::client::Received::Record(r) => out.push(r),
            sluice_runtime::client::Received::Restarted => panic!("no restart expected"),
        }
    }
    out
}

/// A text-completion client for the given topics, under the service name `echo`.
pub async fn text_client(
    bus: Arc<dyn Bus>,
    request_topic: &str,
    response_topic: &str,
) -> TextClient {
    TextClient::start(
        bus,
        ClientConfig::new("echo", request_topic, response_topic),
        None,
    )
    .await
    .unwrap()
}

/// A processor config named `echo` (so its Shared subscription is `echo`) with a 5 s drain.
pub fn echo_config(
    request_topic: &str,
    response_topic: &str,
    concurrency: usize,
) -> ProcessorConfig {
    let mut config = ProcessorConfig::new("echo", request_topic, response_topic);
    config.concurrency = concurrency;
    config.drain_grace = Duration::from_secs(5);
    record_per_delta(&mut config);
    config
}

/// A record per delta on durable topics (`--response-pacing auto`) instead of the default's
/// merge while the broker is behind: for suites that check how a stream is cut into records
/// (a decoder's deltas, an agent's message shapes, OpenAI's chunks), which merging makes
/// depend on the broker's timing. `tests/tests/broker_runtime.rs` and the process suites
/// run the default.
pub fn record_per_delta(config: &mut ProcessorConfig) {
    config.pacing.when = sluice_runtime::processor::PaceWhen::Auto;
}

/// A processor running in this process.
pub struct RunningProcessor {
    /// Its metrics and health.
    pub telemetry: Telemetry,
    /// Cancel to drain it.
    pub shutdown: CancellationToken,
    /// The processor's task.
    pub task: JoinHandle<Result<(), BusError>>,
}

impl RunningProcessor {
    /// Starts `handler` and returns once its request subscription is attached, so that
    /// whatever is published next reaches it.
    pub async fn start<H: Handler>(bus: Arc<dyn Bus>, config: ProcessorConfig, handler: H) -> Self {
        Self::start_with(bus, config, handler, Telemetry::new().unwrap()).await
    }

    /// As [`RunningProcessor::start`], reporting to `telemetry`: a handler's own metrics
    /// registered there show on the processor's `/metrics` beside the runtime's.
    pub async fn start_with<H: Handler>(
        bus: Arc<dyn Bus>,
        config: ProcessorConfig,
        handler: H,
        telemetry: Telemetry,
    ) -> Self {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(processor::run(
            bus,
            config,
            Arc::new(handler),
            telemetry.clone(),
            shutdown.clone(),
        ));
        while telemetry.health.watched() == 0 || telemetry.health.readiness().is_err() {
            assert!(!task.is_finished(), "processor failed to start");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Self {
            telemetry,
            shutdown,
            task,
        }
    }

    /// Drains and waits for the processor to return.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }

    /// Stops the processor as a crash would, without draining: its task and the handlers in
    /// flight are dropped where they are, and its subscription goes away with nothing
    /// settled, so the broker hands its unacked requests to another consumer. Returns the
    /// telemetry, which still holds what the processor counted before it died.
    pub async fn kill(self) -> Telemetry {
        self.task.abort();
        let ended = self.task.await;
        assert!(
            ended
                .as_ref()
                .is_err_and(tokio::task::JoinError::is_cancelled),
            "the processor was running until killed: {ended:?}"
        );
        self.telemetry
    }
}

/// The namespace every integration test's topics live in.
pub const TEST_NAMESPACE: &str = "sluice-test/it";

/// The broker under test.
#[derive(Debug, Clone)]
pub struct Broker {
    /// `pulsar://...`
    pub url: String,
    /// `http://...` admin API.
    pub admin_url: String,
}

static NAMESPACE: OnceCell<()> = OnceCell::const_new();

impl Broker {
    /// The broker named by `PULSAR_URL` / `PULSAR_ADMIN_URL` (the test command sets them),
    /// with the test namespace ensured.
    pub async fn from_env() -> Broker {
        let broker = Broker {
            url: std::env::var("PULSAR_URL").unwrap_or_else(|_| "pulsar://127.0.0.1:6650".into()),
            admin_url: std::env::var("PULSAR_ADMIN_URL")
                .unwrap_or_else(|_| "http://127.0.0.1:8080".into()),
        };
        NAMESPACE
            .get_or_init(|| async {
                broker
                    .admin()
                    .ensure_namespace(
                        TEST_NAMESPACE,
                        NamespacePolicy {
                            subscription_expiration_minutes: 30,
                            // Resumed streams read their records again.
                            retention_minutes: 30,
                            retention_mb: 256,
                        },
                    )
                    .await
                    .unwrap_or_else(|e| {
                        panic!(
                            "the Pulsar broker at {} is not usable ({e}); start it with deploy/pulsar/pulsar.sh start",
                            broker.admin_url
                        )
                    });
            })
            .await;
        broker
    }

    /// An admin client.
    pub fn admin(&self) -> PulsarAdmin {
        PulsarAdmin::new(self.admin_url.clone(), None, false).unwrap()
    }

    /// Bus settings for this broker.
    pub fn config(&self) -> PulsarConfig {
        PulsarConfig::new(self.url.clone())
    }

    /// A new bus connection (its own clients, so its own TCP connections).
    pub async fn bus(&self) -> Arc<dyn Bus> {
        Arc::new(self.pulsar_bus(self.config()).await)
    }

    /// A new bus connection with the given settings.
    pub async fn pulsar_bus(&self, config: PulsarConfig) -> PulsarBus {
        PulsarBus::connect(config, Duration::from_secs(30))
            .await
            .unwrap()
    }

    /// A topic's stats, as the broker's admin API gives them.
    pub async fn topic_stats(&self, topic: &str) -> serde_json::Value {
        let path = topic.replacen("://", "/", 1);
        reqwest::get(format!("{}/admin/v2/{path}/stats", self.admin_url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// A subscription's backlog and unacked counts from the broker's topic stats. Panics when
    /// the topic has no such subscription (or the broker no such topic): the broker leaves an
    /// unknown name out of its stats, and reading that as 0 made a wait for an empty backlog
    /// pass on a wrong name.
    pub async fn subscription_stats(&self, topic: &str, subscription: &str) -> (u64, u64) {
        let stats = self.topic_stats(topic).await;
        let Some(sub) = stats["subscriptions"].get(subscription) else {
            panic!("{topic} has no subscription {subscription:?}; the broker's stats: {stats}")
        };
        let count = |field: &str| {
            sub[field]
                .as_u64()
                .unwrap_or_else(|| panic!("{topic}, {subscription:?}: no {field} in {sub}"))
        };
        (count("msgBacklog"), count("unackedMessages"))
    }
}

/// The opening of every results header written at run time: `Measured <date> at commit
/// <commit> on this machine (<cores> cores, <profile> build)`, the commit marked `with
/// uncommitted changes` when the repository has any outside `bench/results` (which a run
/// writes itself) and outside `also_ignore` (paths from the repository's root). Used by the
/// benchmarks and by the cluster suite's fault tables.
pub fn measured_here(also_ignore: &[&str]) -> String {
    let run = |program: &str, args: &[&str]| {
        std::process::Command::new(program)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let mut commit =
        run("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    // `:/`: the whole repository, as cargo runs tests from the package's directory.
    let excludes: Vec<String> = std::iter::once("bench/results")
        .chain(also_ignore.iter().copied())
        .map(|p| format!(":(top,exclude){p}"))
        .collect();
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--", ":/"];
    status.extend(excludes.iter().map(String::as_str));
    if run("git", &status).is_some_and(|s| !s.is_empty()) {
        commit.push_str(" with uncommitted changes");
    }
    format!(
        "Measured {} at commit {commit} on this machine ({} cores, {} build)",
        run("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default(),
        std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    )
}

/// A tool a check needs from outside the workspace (OpenAI's Python SDK, TrustGraph's CLI),
/// named by the environment variable `var` that the test command sets when it could install
/// the tool. When it is missing, the check cannot run, and that is never silent:
/// - under CI (`CI=true`) it fails the test: CI must run every check;
/// - elsewhere the skip is printed and appended to the file `SLUICE_SKIP_LOG` names (the test
///   command counts those lines in its summary line), and the caller skips `check`.
pub fn outside_tool(var: &str, check: &str) -> Option<String> {
    if let Ok(value) = std::env::var(var) {
        return Some(value);
    }
    skipped(
        &format!("{check}: skipped, {var} is not set"),
        &format!("scripts/test.sh sets {var}"),
    );
    None
}

/// Says that a check could not run here, never silently: under CI (`CI=true`) it fails the
/// test (`why_ci_has_it` says what CI provides instead); elsewhere `line` is printed and
/// appended to the file `SLUICE_SKIP_LOG` names, which the test command counts in its summary
/// line. For [`outside_tool`] and for suites that need what the test command starts (the
/// secured cluster: [`cluster::Cluster::from_env`]).
pub fn skipped(line: &str, why_ci_has_it: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{line}; CI runs every check ({why_ci_has_it})"
    );
    eprintln!("SKIPPED {line}");
    if let Ok(path) = std::env::var("SLUICE_SKIP_LOG") {
        count_skip(Path::new(&path), line);
    }
}

/// Appends `line` to the skip log at `path`; a skip that cannot be counted fails the test.
fn count_skip(path: &Path, line: &str) {
    use std::io::Write as _;
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| writeln!(f, "{line}"));
    assert!(
        appended.is_ok(),
        "could not count the skip in {}: {appended:?}",
        path.display()
    );
}

/// A fresh persistent topic in the test namespace.
pub fn unique_topic(name: &str) -> String {
    format!(
        "persistent://{TEST_NAMESPACE}/{name}-{}",
        uuid::Uuid::new_v4().simple()
    )
}

/// A fresh topicspace (a Pulsar tenant: the gateway's topics are
/// `request:<topicspace>:<service>`) for one test run, so parallel runs share no topic or
/// subscription. Also a fit name for the run's temporary directory.
pub fn unique_topicspace(name: &str) -> String {
    format!("sluice-{name}-{}", uuid::Uuid::new_v4().simple())
}

/// The bench's result tables. `bench` splices each between `<!-- bench:NAME -->` and
/// `<!-- /bench:NAME -->` in the one page under `docs/` that holds them, and
/// `tests/tests/docs.rs` checks that exactly one page does.
pub const BENCH_TABLES: [&str; 12] = [
    "foundation",
    "text-completion",
    "fallback",
    "gateway",
    "prompt",
    "loss",
    "pacing",
    "soak",
    "soak-restarts",
    "soak-cluster",
    "structured",
    "overhead",
];

/// A fresh non-persistent topic in the test namespace: TrustGraph's mapping of its `request`
/// and `response` classes, where the broker drops what a consumer has no permits for.
pub fn unique_non_persistent_topic(name: &str) -> String {
    unique_topic(name).replacen("persistent://", "non-persistent://", 1)
}

/// How long a test waits for something that must happen (a record from the broker, a metric
/// that trails its event, a process's exit, a stream's end) before it gives up: a hang guard,
/// never a figure. A passing run never waits it out, so its size costs nothing; a busy 2-core
/// machine stretches every step (a broker's failover took 29.8 s under load, a JVM's GC can
/// hold a message for seconds), and a guard of a few seconds failed tests by chance. What a
/// test asserts about time is derived from what it measures (a configured timeout, a
/// measurement in the same run), never from this.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// Reads `read` until what it returns satisfies `done` or `timeout` has passed, and returns
/// the last value read, so the caller's own assertion reports it if it never did: for state
/// that settles a moment after the event a test waited for.
pub async fn eventually<T>(
    timeout: Duration,
    read: impl AsyncFnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    eventually_every(Duration::from_millis(20), timeout, read, done).await
}

/// [`eventually`], reading every `interval`: for reads that cost something (an HTTP scrape,
/// a broker's stats).
pub async fn eventually_every<T>(
    interval: Duration,
    timeout: Duration,
    mut read: impl AsyncFnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let value = read().await;
        if done(&value) || tokio::time::Instant::now() >= deadline {
            return value;
        }
        tokio::time::sleep(interval).await;
    }
}

/// A free loopback port for a process the test starts: bound, then released for that process
/// to bind.
///
/// The port comes from below the kernel's ephemeral range (`ip_local_port_range`, 32768 and
/// up here) and below Kubernetes' NodePorts (30000 and up): a port the kernel handed out for
/// `bind(0)` is also one it hands out as the source port of any outgoing connection, and
/// with a broker, fakes and processes connecting all the time, one of them took a test's
/// metrics port between the check and the process's bind (CI, stop 48: "cannot serve
/// metrics on 127.0.0.1:37739: Address already in use"). Below that range only another
/// listener can take it, and a listener the tests start gets its port from here, each port
/// once per test binary, starting at an offset of the process id so that binaries running
/// at the same time walk different ports.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let high = ephemeral_low().min(30_000);
    if high < LOW + 1_000 {
        // An unusual ephemeral range: the kernel's choice, with the race described above.
        return std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("no free loopback port: {e}"));
    }
    let span = high - LOW;
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let port = LOW + NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = u16::try_from(port).unwrap_or_else(|_| panic!("port {port} out of range"));
        // Bound on every address, so a listener on any of them (the broker's, a fake's) makes
        // the port busy for a process that binds 0.0.0.0 as well as for one on loopback.
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{high}")
}

/// The low end of the kernel's ephemeral port range (Linux's default when it cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// [`eventually`] for a metrics text, up to 10 s.
///
/// Some counters trail the caller by a moment, by design: a processor counts a request once
/// the broker has confirmed its records, which can be after the caller received them, and
/// the gateway counts a stream when hyper drops its body, after the last byte went out.
pub async fn wait_for_metrics(render: impl Fn() -> String, done: impl Fn(&str) -> bool) -> String {
    eventually(
        Duration::from_secs(10),
        async || render(),
        |text| done(text),
    )
    .await
}

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// What [`EchoHandler`] is asked to do, read from the request's `system` field as
/// `key=value` words: `records=N` (default 1), `delay_ms=D` between records (default 0),
/// `size=S` bytes per record (default: the word itself), `hang` (send one record and never
/// finish), `fail` (terminal error).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EchoScript {
    /// Records before the terminal one.
    pub records: usize,
    /// Delay before each record.
    pub delay: Duration,
    /// Bytes per record, if set.
    pub size: Option<usize>,
    /// Send one record, then wait until cancelled.
    pub hang: bool,
    /// End with an error.
    pub fail: bool,
}

impl EchoScript {
    /// Parses the `system` field.
    pub fn parse(system: &str) -> Self {
        let mut s = EchoScript {
            records: 1,
            ..Default::default()
        };
        for word in system.split_whitespace() {
            match word.split_once('=') {
                Some(("records", n)) => s.records = n.parse().unwrap_or(1),
                Some(("delay_ms", n)) => s.delay = Duration::from_millis(n.parse().unwrap_or(0)),
                Some(("size", n)) => s.size = n.parse().ok(),
                None if word == "hang" => s.hang = true,
                None if word == "fail" => s.fail = true,
                _ => {}
            }
        }
        s
    }
}

/// A text-completion handler that echoes the prompt as a scripted stream: record `i` is
/// `"<prompt>#<i>"` (or `size` bytes), and the terminal record carries token counts.
#[derive(Debug, Default)]
pub struct EchoHandler;

#[async_trait]
impl Handler for EchoHandler {
    type Request = TextCompletionRequest;
    type Response = TextCompletionResponse;

    async fn handle(
        &self,
        request: TextCompletionRequest,
        _ctx: RequestContext,
        sink: &mut ResponseSink<TextCompletionResponse>,
    ) -> Result<(), Error> {
        let script = EchoScript::parse(&request.system);
        let send_err = |e: sluice_runtime::processor::SinkError| {
            Error::new(ErrorKind::Internal, e.to_string())
        };
        if script.hang {
            sink.send(TextCompletionResponse {
                response: "started".into(),
                ..Default::default()
            })
            .await
            .map_err(send_err)?;
            // Until the runtime drops this future: a client cancel, or the drain grace.
            return std::future::pending().await;
        }
        if script.fail {
            return Err(Error::new(ErrorKind::Llm, "scripted failure"));
        }
        let text = |i: usize| match script.size {
            Some(n) => "x".repeat(n),
            None => format!("{}#{i}", request.prompt),
        };
        let in_token = Some(request.prompt.split_whitespace().count() as u64);
        if !request.streaming {
            // Non-streaming: exactly one record, terminal, carrying the whole answer.
            sink.send(TextCompletionResponse {
                response: text(0),
                in_token,
                out_token: Some(1),
                model: Some("echo".into()),
                end_of_stream: true,
                ..Default::default()
            })
            .await
            .map_err(send_err)?;
            return Ok(());
        }
        let records = script.records;
        for i in 0..records {
            if !script.delay.is_zero() {
                tokio::time::sleep(script.delay).await;
            }
            sink.send(TextCompletionResponse {
                response: text(i),
                model: Some("echo".into()),
                ..Default::default()
            })
            .await
            .map_err(send_err)?;
        }
        sink.send(TextCompletionResponse {
            in_token,
            out_token: Some(records as u64),
            model: Some("echo".into()),
            end_of_stream: true,
            ..Default::default()
        })
        .await
        .map_err(send_err)?;
        Ok(())
    }
}

/// A text-completion handler for `config` (an OpenAI-dialect provider, usually pointed at a
/// fake), with the default retry policy and its metrics on a registry of its own.
pub fn openai_service(
    config: sluice_text_completion::providers::openai::OpenAiConfig,
) -> sluice_text_completion::handler::TextCompletionService {
    use sluice_text_completion::providers::openai::OpenAiProvider;
    provider_service(Arc::new(OpenAiProvider::new(config).unwrap()))
}

/// A text-completion handler for `provider`, with the default retry policy and its metrics on
/// a registry of its own.
pub fn provider_service(
    provider: Arc<dyn sluice_text_completion::provider::Provider>,
) -> sluice_text_completion::handler::TextCompletionService {
    use sluice_text_completion::{
        handler::TextCompletionService, metrics::LlmMetrics, retry::RetryPolicy,
    };
    let telemetry = Telemetry::new().unwrap();
    TextCompletionService::new(
        provider,
        RetryPolicy::default(),
        LlmMetrics::register(&telemetry.registry).unwrap(),
    )
}

/// A text-completion processor running `service` on the real broker over unique topics, and a
/// gateway routing `text-completion` to it.
pub struct RoutedService {
    /// The text-completion processor.
    pub processor: RunningProcessor,
    /// The gateway, served.
    pub served: ServedGateway,
    /// The processor's topics.
    pub topics: sluice_gateway::ServiceTopics,
}

impl RoutedService {
    /// Starts the processor for `service` and a gateway for it, configured by `configure`.
    pub async fn start(
        service: sluice_text_completion::handler::TextCompletionService,
        configure: impl FnOnce(&mut sluice_gateway::GatewayConfig),
    ) -> Self {
        init_logging();
        let broker = Broker::from_env().await;
        let topics = sluice_gateway::ServiceTopics {
            request: unique_topic("gw-req"),
            response: unique_topic("gw-resp"),
            cancel: Some(unique_topic("gw-cancel")),
        };
        let mut pc = ProcessorConfig::new("text-completion", &topics.request, &topics.response);
        record_per_delta(&mut pc);
        pc.cancel_topic.clone_from(&topics.cancel);
        pc.drain_grace = Duration::from_secs(5);
        let processor = RunningProcessor::start(broker.bus().await, pc, service).await;
        let mut gc = sluice_gateway::GatewayConfig::new();
        gc.services
            .insert(sluice_gateway::ServiceKind::TextCompletion, topics.clone());
        configure(&mut gc);
        let served = ServedGateway::start(broker.bus().await, gc).await;
        Self {
            processor,
            served,
            topics,
        }
    }

    /// The gateway's URL for `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.served.addr)
    }

    /// Stops the gateway and the processor.
    pub async fn stop(self) {
        self.served.stop.cancel();
        self.served.gateway.close().await;
        self.processor.stop().await;
    }
}

/// The gateway end to end on the real broker: a fake OpenAI provider, a text-completion
/// processor calling it (with the default retry policy), and a gateway routing
/// `text-completion` to that processor over unique topics.
pub struct GatewayStack {
    /// The fake provider.
    pub fake: fake_openai::FakeOpenAi,
    /// The text-completion processor.
    pub processor: RunningProcessor,
    /// The gateway's metrics.
    pub telemetry: Telemetry,
    /// Where the gateway listens.
    pub addr: std::net::SocketAddr,
    /// The gateway.
    pub gateway: sluice_gateway::Gateway,
    /// Cancel to stop the gateway's listener.
    pub stop: CancellationToken,
    /// The text-completion processor's topics.
    pub topics: sluice_gateway::ServiceTopics,
}

impl GatewayStack {
    /// The provider key the processor sends to the fake.
    pub const PROVIDER_KEY: &'static str = "sk-provider-key";

    /// A stack whose processor serves `model`.
    pub async fn start(
        model: &str,
        configure: impl FnOnce(&mut sluice_gateway::GatewayConfig),
    ) -> Self {
        Self::start_serving(model, &[], configure).await
    }

    /// A stack whose processor serves `model` and also `extra` (fake models a request may
    /// name to get the fake's scripted behaviour).
    pub async fn start_serving(
        model: &str,
        extra: &[&str],
        configure: impl FnOnce(&mut sluice_gateway::GatewayConfig),
    ) -> Self {
        use sluice_text_completion::providers::openai::{Dialect, OpenAiConfig};
        let fake = fake_openai::FakeOpenAi::start().await;
        let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), model);
        config.api_key = Some(sluice_runtime::secret::Secret::new(Self::PROVIDER_KEY));
        config.api_key_source = "OPENAI_API_KEY".into();
        let service = openai_service(config).with_models(extra.iter().map(|m| (*m).to_owned()));
        let RoutedService {
            processor,
            served:
                ServedGateway {
                    gateway,
                    addr,
                    stop,
                    telemetry,
                },
            topics,
        } = RoutedService::start(service, configure).await;
        Self {
            fake,
            processor,
            telemetry,
            addr,
            gateway,
            stop,
            topics,
        }
    }

    /// The gateway's URL for `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Stops the gateway and the processor.
    pub async fn stop(self) {
        self.stop.cancel();
        self.gateway.close().await;
        self.processor.stop().await;
    }

    /// Reads the streamed answer `resp` until its bytes contain `seen`, then goes away as a
    /// client that disconnects mid-stream: the provider call must end (the fake sees its
    /// connection closed) and the stream be counted `cancelled` under `route`. What every
    /// route that streams must do, whatever its dialect.
    pub async fn disconnect_mid_stream(&self, resp: reqwest::Response, seen: &str, route: &str) {
        use futures::StreamExt;
        assert_eq!(resp.status(), 200, "{route}: the stream was not answered");
        let mut stream = resp.bytes_stream();
        let mut bytes = Vec::new();
        while !String::from_utf8_lossy(&bytes).contains(seen) {
            let piece = stream.next().await;
            let piece =
                piece.unwrap_or_else(|| panic!("{route}: the stream ended before {seen:?}"));
            bytes.extend_from_slice(&piece.unwrap());
        }
        assert_eq!(
            self.fake.abandoned_streams(),
            0,
            "{route}: abandoned too early"
        );
        drop(stream);
        self.fake
            .assert_abandoned(
                PATIENCE,
                "the provider's connection was not closed after the client went away",
            )
            .await;
        let cancelled =
            format!(r#"sluice_gateway_streams_total{{outcome="cancelled",route="{route}"}} 1"#);
        let m = eventually(
            PATIENCE,
            async || self.telemetry.render(),
            |m| m.contains(&cancelled),
        )
        .await;
        assert!(m.contains(&cancelled), "{m}");
    }
}

/// The pieces of a streamed body as the caller sees them: SSE events (the blocks between blank
/// lines, keep-alive comments left out) or NDJSON lines, each with its bytes.
pub fn stream_pieces(body: &[u8], sse: bool) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    if sse {
        text.split("\n\n")
            .filter(|b| !b.is_empty() && !b.lines().all(|l| l.starts_with(':')))
            .map(|b| format!("{b}\n\n"))
            .collect()
    } else {
        text.split_terminator('\n')
            .map(|l| format!("{l}\n"))
            .collect()
    }
}

/// The id an SSE event carries.
pub fn sse_event_id(piece: &str) -> String {
    piece
        .lines()
        .find_map(|l| l.strip_prefix("id:"))
        .map(|id| id.trim().to_owned())
        .unwrap_or_else(|| panic!("no id in {piece:?}"))
}

/// A gateway on the bus, serving on a free loopback port.
pub struct ServedGateway {
    /// The gateway (close it to end its bus clients).
    pub gateway: sluice_gateway::Gateway,
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    /// Cancel to stop accepting connections.
    pub stop: CancellationToken,
    /// Its metrics.
    pub telemetry: Telemetry,
}

impl ServedGateway {
    /// Starts a gateway for `config` and serves it.
    pub async fn start(bus: Arc<dyn Bus>, config: sluice_gateway::GatewayConfig) -> Self {
        let telemetry = Telemetry::new().unwrap();
        let gateway = sluice_gateway::Gateway::start(bus, config, &telemetry)
            .await
            .unwrap();
        let stop = CancellationToken::new();
        let (addr, _task) = gateway
            .serve("127.0.0.1:0".parse().unwrap(), stop.clone())
            .await
            .unwrap();
        Self {
            gateway,
            addr,
            stop,
            telemetry,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_parse() {
        let s = EchoScript::parse("records=5 delay_ms=10 hang");
        assert_eq!(s.records, 5);
        assert_eq!(s.delay, Duration::from_millis(10));
        assert!(s.hang && !s.fail);
        assert_eq!(EchoScript::parse("").records, 1);
    }

    #[test]
    fn free_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let low = ephemeral_low();
        // Each one free, and none handed out twice: all of them bind at once.
        let _bound: Vec<_> = ports
            .iter()
            .map(|port| {
                assert!(
                    u32::from(*port) < low.min(30_000),
                    "{port} is not below {low}"
                );
                std::net::TcpListener::bind(("127.0.0.1", *port)).unwrap()
            })
            .collect();
    }

    #[test]
    fn each_skip_is_a_line_of_the_skip_log() {
        let path = std::env::temp_dir().join(format!("sluice-skips-{}", uuid::Uuid::new_v4()));
        count_skip(&path, "one: skipped, A is not set");
        count_skip(&path, "two: skipped, no secured Pulsar cluster");
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            text,
            "one: skipped, A is not set\ntwo: skipped, no secured Pulsar cluster\n"
        );
    }
}

#[cfg(test)]
mod provenance_tests {
    #[test]
    fn a_results_header_names_the_date_commit_cores_and_build() {
        let m = super::measured_here(&["docs"]);
        assert!(m.starts_with("Measured 20"), "{m}");
        assert!(m.contains(" at commit "), "{m}");
        assert!(m.ends_with(" cores, debug build)"), "{m}");
    }
}
