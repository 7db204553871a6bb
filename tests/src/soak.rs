//! A soak under chaos (issue #13.4): every processor kind as real `sluice` processes on a
//! broker of the soak's own, mixed traffic through the gateway and directly on the bus, a
//! replica killed with SIGKILL every ~20 s (a replacement started), the broker restarted
//! every ~5 minutes (gracefully and with SIGKILL in turn), and provider faults (429 with `retry-after`, 500, a connection dropped
//! mid-stream, a stall, a malformed event) from the fake OpenAI server.
//!
//! What it checks, per request, on sluice's durable mapping:
//! - the caller sees exactly one end: an answer, or a clear error (a terminal error record of
//!   a known type, or a request the broker did not store); over HTTP, exactly one `done`
//!   event, last, with at most one `error` event right before it;
//! - nothing is lost (no timeout, no stream that just stops) and nothing duplicated: every
//!   answer is exactly the one expected, its records once each, in order, and it is the
//!   answer to its own request (the agent's answer carries its question, the prompt's objects
//!   their request's tag);
//! - a request that should be answered (no provider fault, or a retried 429 or 500) is
//!   answered: the only error accepted from it is a refusal to store it while the broker
//!   restarts;
//! - after the traffic, every processor's in-flight gauge returns to 0;
//! - the resident memory of the replicas that are never killed (one per kind, and the
//!   gateway) after warm-up, sampled every 5 s.
//!
//! A wire auditor also reads every response topic and counts what the callers never see:
//! terminal records stored twice for one request (a replica killed after storing its answer,
//! before acking the request; clients keep the first) and records stored twice by a retried
//! send.
//!
//! In cluster mode ([`SoakConfig::cluster`], issue #21.5) the same runs on the secured
//! multi-broker cluster the test command starts: in a tenant of its own with least-privilege
//! grants (processors and gateway as their own roles, over TLS), and instead of broker
//! restarts the cluster's faults: namespace bundle unloads, SIGKILL of the broker that owns
//! text-completion's request topic, SIGKILL of a bookie while writing, and graceful broker
//! restarts, each repaired before the next.
//!
//! Used by `services/cli/tests/soak.rs` (2 minutes on a broker of its own, in the test
//! command), the production-Pulsar suite (`services/cli/tests/cluster.rs`: half a minute on
//! the cluster, replica kills and no cluster fault) and `bash bench/run.sh soak` (30 minutes,
//! figures for docs/soak.md; `--cluster` for cluster mode).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt::Write as _,
    path::PathBuf,
    process::Stdio,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::StreamExt;
use rand::Rng;
use serde_json::{Value, json};
use sluice_runtime::{
    bus::{Bus, SubscribeOptions, pulsar::PulsarConfig, pulsar_security::PulsarAuth},
    client::{ClientConfig, ClientError, Received, RequestClient},
};
use sluice_schema::{
    AgentMessageType, AgentRequest, AgentResponse, PromptRequest, PromptResponse, ResponseRecord,
    TextCompletionRequest, TextCompletionResponse, properties,
};
use tokio::process::{Child, Command};

use crate::{
    Broker,
    cluster::{Cluster, role, topics},
    fake_openai::FakeOpenAi,
    seed_streams,
};

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// The `sluice` binary.
    pub sluice: PathBuf,
    /// `deploy/pulsar/pulsar.sh`.
    pub pulsar_script: PathBuf,
    /// How long traffic runs.
    pub duration: Duration,
    /// Traffic before this is warm-up: memory is compared from here on.
    pub warm_up: Duration,
    /// About how often a replica is killed (±20%).
    pub kill_every: Duration,
    /// How often a broker fault comes (each starts this long after the last one was
    /// repaired): on the soak's own broker a restart, graceful and SIGKILL in turn; on the
    /// cluster one of [`ClusterFault`].
    pub fault_every: Duration,
    /// Exactly this many faults: the traffic goes on past `duration` until each has been
    /// done and repaired and [`FAULT_TAIL`] of traffic followed the last (a fault needs
    /// traffic after it to mean anything), up to four times `duration` (a hang guard). How long a repair takes
    /// depends on how busy the machine is (a graceful broker restart took 10 s on a quiet
    /// machine and 36 s on a loaded one): a schedule that fits faults into a fixed window
    /// left the last one out on a busy machine. `None`: as many as fit, none in the last
    /// [`FAULT_TAIL`] of `duration`.
    pub max_faults: Option<usize>,
    /// At least this many replica kills: the traffic goes on past `duration` until they are
    /// made (with `max_faults`, as long as the faults need too). A fault holds the kills back
    /// while it lasts, and how long it lasts depends on how busy the machine is: a 3-minute
    /// soak made 7 kills beside a 36 s broker restart, and would make fewer beside a longer
    /// one. `None`: as many as fit in `duration`.
    pub min_kills: Option<usize>,
    /// Concurrent callers.
    pub callers: usize,
    /// Where the processes' logs and the broker's state go (wiped first).
    pub work_dir: PathBuf,
    /// The soak broker's ports: binary protocol, HTTP admin, bookie.
    pub broker_ports: (u16, u16, u16),
    /// Run on this secured cluster instead of a broker of the soak's own (`pulsar_script` and
    /// `broker_ports` are then not used).
    pub cluster: Option<Cluster>,
}

/// The traffic a soak keeps after its last fault's repair.
pub const FAULT_TAIL: Duration = Duration::from_secs(30);

/// The faults of the cluster mode, each repaired before the soak goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterFault {
    /// `namespaces unload` of the soak's request, response and notify namespaces: every topic
    /// moves (to either broker).
    Unload,
    /// SIGKILL of one bookie while the topics are written, then the bookie started again.
    BookieKill,
    /// SIGKILL of the broker that owns text-completion's request topic (its topics move to
    /// the other), then the broker started again.
    BrokerKill,
    /// A graceful restart of the broker that owns text-completion's request topic.
    BrokerRestart,
}

impl ClusterFault {
    /// The `n`th fault of a run: an unload, a bookie kill and a broker kill first (so that a
    /// short run meets each), then any at random, unloads twice as often as each of the others.
    fn nth(n: usize) -> Self {
        match n {
            0 => Self::Unload,
            1 => Self::BookieKill,
            2 => Self::BrokerKill,
            _ => match rand::random_range(0..5) {
                0 | 1 => Self::Unload,
                2 => Self::BookieKill,
                3 => Self::BrokerKill,
                _ => Self::BrokerRestart,
            },
        }
    }
}

impl SoakConfig {
    /// Defaults for `duration`: callers 12, a kill every 20 s, a broker restart every 5
    /// minutes, a sixth of the run (at most 3 minutes) as warm-up.
    pub fn new(sluice: PathBuf, pulsar_script: PathBuf, duration: Duration) -> Self {
        Self {
            sluice,
            pulsar_script,
            duration,
            warm_up: (duration / 6).min(Duration::from_secs(180)),
            kill_every: Duration::from_secs(20),
            fault_every: Duration::from_secs(300),
            max_faults: None,
            min_kills: None,
            callers: 12,
            work_dir: std::env::temp_dir().join(format!("sluice-soak-{}", std::process::id())),
            broker_ports: (6656, 8086, 3187),
            cluster: None,
        }
    }
}

/// The kinds of request the callers make.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    BusLlmStream,
    BusLlmWhole,
    HttpLlmStream,
    HttpLlmWhole,
    BusPrompt,
    HttpPrompt,
    BusAgent,
    HttpAgent,
}

impl Kind {
    fn pick(rng: &mut impl Rng) -> Self {
        match rng.random_range(0..100) {
            0..20 => Kind::BusLlmStream,
            20..30 => Kind::BusLlmWhole,
            30..50 => Kind::HttpLlmStream,
            50..58 => Kind::HttpLlmWhole,
            58..70 => Kind::BusPrompt,
            70..80 => Kind::HttpPrompt,
            80..90 => Kind::BusAgent,
            _ => Kind::HttpAgent,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::BusLlmStream => "bus text-completion, streaming",
            Kind::BusLlmWhole => "bus text-completion, not streaming",
            Kind::HttpLlmStream => "HTTP text-completion, NDJSON",
            Kind::HttpLlmWhole => "HTTP text-completion, JSON",
            Kind::BusPrompt => "bus prompt jsonl",
            Kind::HttpPrompt => "HTTP prompt jsonl, NDJSON",
            Kind::BusAgent => "bus agent, one tool call",
            Kind::HttpAgent => "HTTP agent, one tool call, NDJSON",
        }
    }
}

/// The provider fault a text-completion request asks the fake for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    RateLimited,
    ServerError,
    Malformed,
    Dropped,
    Stalled,
}

impl Fault {
    fn pick(rng: &mut impl Rng) -> Self {
        match rng.random_range(0..100) {
            0..55 => Fault::None,
            55..67 => Fault::RateLimited,
            67..77 => Fault::ServerError,
            77..87 => Fault::Malformed,
            87..95 => Fault::Dropped,
            _ => Fault::Stalled,
        }
    }

    fn model(self) -> &'static str {
        match self {
            Fault::None => "chaos-ok",
            Fault::RateLimited => "chaos-429",
            Fault::ServerError => "chaos-500",
            Fault::Malformed => "chaos-malformed",
            Fault::Dropped => "chaos-drop",
            Fault::Stalled => "chaos-stall",
        }
    }

    /// Whether the request should still get its whole answer: the 429 and 500 come before
    /// the first record, so the processor retries them; a malformed event, a dropped
    /// connection or a stall come after it, where a retry would repeat what was published.
    fn answerable(self) -> bool {
        matches!(self, Fault::None | Fault::RateLimited | Fault::ServerError)
    }

    /// The error types this fault itself ends a request with: a malformed event or a dropped
    /// connection after the first record is the provider's failure (`llm-error`); a stall
    /// is that, or the caller's deadline when the stalled attempts outlast it (`timeout`).
    /// None for the faults the processor retries: those requests must be answered. Any other
    /// error (`not-stored` included) is explained only by a broker fault or a killed replica.
    fn own_errors(self) -> &'static [&'static str] {
        match self {
            Fault::None | Fault::RateLimited | Fault::ServerError => &[],
            Fault::Malformed | Fault::Dropped => &["llm-error"],
            Fault::Stalled => &["llm-error", "timeout"],
        }
    }
}

/// How one request ended, as its caller saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// The whole answer, exactly as expected.
    Answered,
    /// A terminal error record of this type (and its message, where the caller sees one), or
    /// `not-stored` when the broker did not take the request.
    ClearError(String, String),
    /// An answer that differs from the one expected (a record lost, duplicated or reordered).
    Wrong(String),
    /// No end: a timeout, or a stream that stopped.
    Lost(String),
    /// The protocol was broken (events after `done`, two terminal records...).
    Broken(String),
}

/// The processes of the soak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Role {
    TextCompletion,
    Prompt,
    Agent,
    Gateway,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::TextCompletion => "text-completion",
            Role::Prompt => "prompt",
            Role::Agent => "agent",
            Role::Gateway => "gateway",
        }
    }
}

struct Member {
    role: Role,
    name: String,
    child: Child,
    metrics_port: u16,
    sentinel: bool,
}

impl Member {
    fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }
}

/// One memory sample: seconds since the start, RSS MiB, allocated heap MiB.
pub type MemorySample = (f64, f64, f64);

/// Figures of one soak run.
#[derive(Debug, Default, Clone)]
pub struct SoakReport {
    /// Traffic time.
    pub duration: Duration,
    /// Requests by kind and verdict.
    outcomes: BTreeMap<(Kind, String), u64>,
    /// Requests whose fault asked for an answer and got a clear error instead, by error type.
    unanswered_clean: BTreeMap<String, u64>,
    /// Everything that must not happen, with an example each.
    pub violations: Vec<String>,
    /// Replicas killed with SIGKILL.
    pub kills: u64,
    /// When each replica was killed (seconds since the start) and which.
    pub kill_at: Vec<(f64, String)>,
    /// Broker faults (restarts of the soak's own broker, or the cluster's faults), with how
    /// long each took until it was repaired (the broker served again, the bookie registered).
    pub broker_restarts: Vec<Duration>,
    /// Requests made.
    pub requests: u64,
    /// Answered in full.
    pub answered: u64,
    /// Ended with a clear error.
    pub clear_errors: u64,
    /// Sentinel memory: name, RSS MiB at the end of warm-up, at the end, the highest after
    /// warm-up; then the heap's allocated MiB (the allocator's count of live allocations) at
    /// the end of warm-up and at the end.
    pub rss: Vec<(String, f64, f64, f64, f64, f64)>,
    /// Every sentinel's samples every 5 s: seconds since the start, RSS MiB, allocated heap
    /// MiB (NaN when it could not be read), to see the shape of any growth (steady, or in
    /// steps at the broker restarts) and whether it is held by live allocations.
    pub rss_series: Vec<(String, Vec<MemorySample>)>,
    /// When each broker fault began, in seconds since the start.
    pub broker_restart_at: Vec<f64>,
    /// When each fault disrupted the broker, in seconds since the start (see
    /// [`explained_by_an_outage`]): from its start to the broker serving again, on a cluster
    /// to the end of what the fault itself disrupts (see `FaultDone::disrupted`).
    pub outages: Vec<(f64, f64)>,
    /// What each fault was: on the soak's own broker `graceful` or `SIGKILL` (a restart); on
    /// the cluster `unload`, `bookie N SIGKILL`, `broker N SIGKILL` or `broker N restart`.
    pub faults: Vec<String>,
    /// Processors whose in-flight gauge did not return to 0 after the traffic.
    pub stuck_in_flight: Vec<String>,
    /// How long the in-flight gauges took to return to 0.
    pub drain_time: Duration,
    /// Wire audit: response records read, terminal records, requests with more than one
    /// terminal record stored, records stored twice.
    pub audit: (u64, u64, u64, u64),
    /// The usage ledger against the fake's own count of the `chaos-*` calls, per trace:
    /// traces compared, equal, short where a text-completion replica was killed or the call
    /// was cut by its client, and the tokens those were short by.
    pub ledger: (u64, u64, u64, u64),
}

impl SoakReport {
    /// True when nothing was lost, wrong or broken, and every in-flight gauge returned to 0.
    pub fn clean(&self) -> bool {
        self.violations.is_empty() && self.stuck_in_flight.is_empty()
    }

    /// The report as Markdown (for bench/results and docs/soak.md).
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(
            md,
            "| soak | figure |\n|---|---|\n| traffic | {:.1} min, {} requests |\n| answered in full | {} |\n| ended with a clear error | {} |\n| lost, wrong or broken | {} |\n| replicas killed (SIGKILL) | {} |\n| broker faults | {} ({}) |\n| in-flight gauges back to 0 after traffic | {} |\n| wire: response records / terminal / requests with a 2nd terminal stored / records stored twice | {} / {} / {} / {} |\n| usage ledger against the fake's count, per trace: compared / equal / short after a kill or a cut call (tokens) | {} / {} / {} ({}) |",
            self.duration.as_secs_f64() / 60.0,
            self.requests,
            self.answered,
            self.clear_errors,
            self.violations.len(),
            self.kills,
            self.broker_restarts.len(),
            self.broker_restarts
                .iter()
                .zip(&self.faults)
                .map(|(d, fault)| format!("{fault}: {:.0} s", d.as_secs_f64()))
                .collect::<Vec<_>>()
                .join(", "),
            if self.stuck_in_flight.is_empty() {
                format!("yes, within {:.1} s", self.drain_time.as_secs_f64())
            } else {
                format!("NO: {}", self.stuck_in_flight.join(", "))
            },
            self.audit.0,
            self.audit.1,
            self.audit.2,
            self.audit.3,
            self.ledger.0,
            self.ledger.1,
            self.ledger.2,
            self.ledger.3,
        );
        let _ = writeln!(md, "\n| request kind | outcome | count |\n|---|---|---|");
        for ((kind, verdict), n) in &self.outcomes {
            let _ = writeln!(md, "| {} | {verdict} | {n} |", kind.name());
        }
        if !self.unanswered_clean.is_empty() {
            let _ = writeln!(
                md,
                "\n| fault-free or retryable requests that ended with a clear error, by type | count |\n|---|---|"
            );
            for (t, n) in &self.unanswered_clean {
                let _ = writeln!(md, "| `{t}` | {n} |");
            }
        }
        let _ = writeln!(
            md,
            "\n| replica never killed | RSS after warm-up MiB | at the end MiB | highest after warm-up MiB | heap allocated after warm-up MiB | at the end MiB |\n|---|---|---|---|---|---|"
        );
        for (name, warm, end, max, heap_warm, heap_end) in &self.rss {
            let _ = writeln!(
                md,
                "| {name} | {warm:.1} | {end:.1} | {max:.1} | {heap_warm:.1} | {heap_end:.1} |"
            );
        }
        if !self.violations.is_empty() {
            let _ = writeln!(md, "\nViolations (first 20):\n");
            for v in self.violations.iter().take(20) {
                let _ = writeln!(md, "- {v}");
            }
        }
        md
    }
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The soak's broker, on its own ports. Its state is pulsar.sh's default for those ports
/// (under ~/.cache/sluice/pulsar-state/), so that a broker left behind by an interrupted run
/// is found and stopped by the next one; each run starts from a wiped state.
struct SoakBroker {
    script: PathBuf,
    ports: (u16, u16, u16),
}

impl SoakBroker {
    fn command(&self, command: &str) -> std::process::Command {
        let mut c = std::process::Command::new("bash");
        c.arg(&self.script)
            .arg(command)
            .env("PULSAR_PORT", self.ports.0.to_string())
            .env("PULSAR_HTTP_PORT", self.ports.1.to_string())
            .env("PULSAR_BK_PORT", self.ports.2.to_string())
            .env("PULSAR_HEAP", "384m")
            .stdout(Stdio::null());
        c
    }

    async fn run(&self, command: &str) -> bool {
        Command::from(self.command(command))
            .status()
            .await
            .is_ok_and(|s| s.success())
    }

    /// Stops the broker (`kill`: with SIGKILL, as a crash; else gracefully), checks that it
    /// no longer serves, and starts it again.
    async fn restart(&self, kill: bool) -> Result<(), String> {
        self.run(if kill { "kill" } else { "stop" }).await;
        if self.run("status").await {
            return Err("the broker still served after it was stopped".into());
        }
        if self.run("start").await {
            Ok(())
        } else {
            Err("the broker did not come back after a restart".into())
        }
    }

    fn url(&self) -> String {
        format!("pulsar://127.0.0.1:{}", self.ports.0)
    }

    fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.1)
    }
}

impl Drop for SoakBroker {
    // A soak that panics must not leave its broker behind (the next run would reuse it).
    fn drop(&mut self) {
        let _ = self.command("stop").status();
    }
}

/// Where the soak runs: a broker of its own, or the secured cluster in a tenant of its own.
enum Target {
    Standalone(SoakBroker),
    Cluster { cluster: Cluster, ts: String },
}

impl Target {
    fn url(&self) -> String {
        match self {
            Self::Standalone(b) => b.url(),
            Self::Cluster { cluster, .. } => cluster.url.clone(),
        }
    }

    fn admin_url(&self) -> String {
        match self {
            Self::Standalone(b) => b.admin_url(),
            Self::Cluster { cluster, .. } => cluster.admin_url.clone(),
        }
    }

    /// The topicspace (Pulsar tenant) of the soak's topics.
    fn topicspace(&self) -> &str {
        match self {
            Self::Standalone(_) => "tg",
            Self::Cluster { ts, .. } => ts,
        }
    }

    /// `class:topicspace:name`, as the processors' topic options take it.
    fn topic(&self, class: &str, name: &str) -> String {
        format!("{class}:{}:{name}", self.topicspace())
    }

    /// The environment of a process in `role`: on the cluster its role's token file and the
    /// cluster's CA (each processor kind and the gateway has a role of its own).
    fn env(&self, role: Role) -> Vec<(String, String)> {
        match self {
            Self::Standalone(_) => Vec::new(),
            Self::Cluster { cluster, .. } => {
                let mut env = cluster.env(role.name());
                env.retain(|(k, _)| k != "RUST_LOG");
                env
            }
        }
    }

    /// The callers' and the auditor's bus settings: on the cluster as the gateway's role
    /// (produce requests and cancels, consume answers, nothing else).
    fn bus_config(&self) -> PulsarConfig {
        let mut c = PulsarConfig::new(self.url());
        c.publish_retry_budget = Duration::from_secs(60);
        if let Self::Cluster { cluster, .. } = self {
            c.auth = PulsarAuth::TokenFile(cluster.token("gateway").into());
            c.tls_ca_file = Some(cluster.ca.clone());
        }
        c
    }

    /// Fault number `n` (see [`SoakConfig::fault_every`]), repaired before it returns.
    async fn fault(&self, n: usize) -> FaultDone {
        let t0 = Instant::now();
        match self {
            Self::Standalone(broker) => {
                // Every other restart is a crash: SIGKILL, no clean shutdown (the first is
                // graceful, the second a kill, and so on).
                let kill = n % 2 == 1;
                let name = if kill { "SIGKILL" } else { "graceful" };
                let result = broker.restart(kill).await;
                FaultDone {
                    name: name.to_owned(),
                    result,
                    // Nothing is served while the broker restarts.
                    disrupted: t0.elapsed(),
                }
            }
            Self::Cluster { cluster, ts } => {
                let fault = ClusterFault::nth(n);
                let script = |args: Vec<String>| async move {
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    cluster.try_script(&args).await.map(|_| ())
                };
                // The fault, then its repair, which runs even when the fault's command failed
                // (it may have done its harm before failing); the first error is kept.
                let (name, mut result, disrupted) = match fault {
                    ClusterFault::Unload => {
                        let mut result = Ok(());
                        for ns in ["request", "response", "notify"] {
                            let r = script(vec!["unload".into(), format!("{ts}/{ns}")]).await;
                            result = result.and(r);
                        }
                        ("unload".to_owned(), result, t0.elapsed())
                    }
                    ClusterFault::BookieKill => {
                        let bookie = rand::random_range(1..=3).to_string();
                        let killed = script(vec!["kill-bookie".into(), bookie.clone()]).await;
                        // Ledgers re-form on the other two bookies at the next write: writers
                        // notice within a moment, not while the dead bookie's registration
                        // waits out its ZooKeeper session (part of the repair below).
                        let disrupted = t0.elapsed();
                        // Written to with one bookie down for a while, as a crash would be.
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        let started = script(vec!["start-bookie".into(), bookie.clone()]).await;
                        (
                            format!("bookie {bookie} SIGKILL"),
                            killed.and(started),
                            disrupted,
                        )
                    }
                    ClusterFault::BrokerKill | ClusterFault::BrokerRestart => {
                        let [req, _, _] = topics(ts, "text-completion");
                        match cluster.try_owner(&req).await {
                            Ok(broker) => {
                                let (stop, how) = if fault == ClusterFault::BrokerKill {
                                    ("kill-broker", "SIGKILL")
                                } else {
                                    ("stop-broker", "restart")
                                };
                                let stopped = script(vec![stop.into(), broker.into()]).await;
                                let started =
                                    script(vec!["start-broker".into(), broker.into()]).await;
                                // Topics move off the stopped broker and may be shed back to it
                                // once it serves again: disrupted until then.
                                (
                                    format!("broker {broker} {how}"),
                                    stopped.and(started),
                                    t0.elapsed(),
                                )
                            }
                            Err(e) => ("broker (owner unknown)".to_owned(), Err(e), t0.elapsed()),
                        }
                    }
                };
                // Whatever happened, the cluster must be whole again before the soak goes on:
                // every broker ready and every bookie registered (`cluster.sh status`), else
                // each is started (the starts do nothing to a running one).
                if cluster.try_script(&["status"]).await.is_err() {
                    let mut repaired = Ok(());
                    for (what, n) in [
                        ("start-broker", "1"),
                        ("start-broker", "2"),
                        ("start-bookie", "1"),
                        ("start-bookie", "2"),
                        ("start-bookie", "3"),
                    ] {
                        repaired = repaired.and(script(vec![what.into(), n.into()]).await);
                    }
                    let whole = cluster.try_script(&["status"]).await.map(|_| ());
                    result = result.and(Err(format!(
                        "the cluster was not whole after the fault ({})",
                        match repaired.and(whole) {
                            Ok(()) => "repaired by starting every broker and bookie".to_owned(),
                            Err(e) => format!("and could not be repaired: {e}"),
                        }
                    )));
                }
                FaultDone {
                    name,
                    result,
                    disrupted,
                }
            }
        }
    }

    /// After the run: the soak's tenant and its topics deleted from the cluster (the bench
    /// reuses a running cluster; nothing else reads them). The brokers refuse a forced delete
    /// of a namespace or tenant, so each topic goes first. Best effort: said, not failed.
    async fn clean_up(&self) {
        let Self::Cluster { cluster, ts } = self else {
            return;
        };
        let mut paths = Vec::new();
        for ns in ["request", "response", "notify"] {
            let (status, body) = cluster
                .admin_get(&format!("/admin/v2/namespaces/{ts}/{ns}/topics"))
                .await;
            let topics: Vec<String> = serde_json::from_str(&body).unwrap_or_default();
            if status != 200 {
                eprintln!(
                    "soak: cleaning up the cluster: the topics of {ts}/{ns}: {status} {body}"
                );
            }
            paths.extend(
                topics
                    .iter()
                    .map(|t| format!("/admin/v2/{}?force=true", t.replacen("://", "/", 1))),
            );
            paths.push(format!("/admin/v2/namespaces/{ts}/{ns}"));
        }
        paths.push(format!("/admin/v2/tenants/{ts}"));
        for path in paths {
            if let Err(e) = cluster
                .try_admin_call(reqwest::Method::DELETE, &path, None)
                .await
            {
                eprintln!("soak: cleaning up the cluster: {e}");
            }
        }
    }
}

/// A fault done and repaired.
struct FaultDone {
    /// What it was (see [`SoakReport::faults`]).
    name: String,
    /// An error when it could not be done or repaired.
    result: Result<(), String>,
    /// How long after its start requests could fairly fail to be stored: the whole restart
    /// of the soak's own broker, an unload's calls, a bookie's kill (not its slow repair), a
    /// broker's stop until it serves again.
    disrupted: Duration,
}

/// The soak's usage ledger topic in topicspace `ts`.
fn usage_topic(ts: &str) -> String {
    format!("persistent://{ts}/response/usage")
}

/// The soak's least-privilege grants on the cluster: each role's, as `cluster.sh grant-roles`
/// gives them (each processor kind its own role: docs/production-pulsar.md#roles-and-grants),
/// and the usage ledger's read for the soak's auditor, which runs as the gateway's role.
async fn grant_soak(cluster: &Cluster, ts: &str) -> Result<(), String> {
    cluster.try_grant_roles(ts).await?;
    cluster
        .try_grant(&usage_topic(ts), &role("gateway"), &["consume"])
        .await?;
    // The ledger's retention, set as the operator does on a secured cluster (the processors'
    // role may not: docs/production-pulsar.md). Without it the broker drops what no
    // subscription holds, and the soak's read from the start finds records missing.
    let usage = usage_topic(ts).replacen("://", "/", 1);
    cluster
        .try_admin_call(
            reqwest::Method::POST,
            &format!("/admin/v2/{usage}/retention"),
            Some(json!({"retentionTimeInMinutes": 90 * 24 * 60, "retentionSizeInMB": -1})),
        )
        .await?;
    Ok(())
}

struct Fleet {
    config: SoakConfig,
    target: Arc<Target>,
    fake_url: String,
    gateway_port: u16,
    tools: PathBuf,
    members: Vec<Member>,
    counter: u64,
}

impl Fleet {
    async fn spawn(&mut self, role: Role, sentinel: bool) -> Result<(), String> {
        self.counter += 1;
        let name = format!("{}-{}", role.name(), self.counter);
        let metrics_port = crate::free_port();
        let metrics = format!("127.0.0.1:{metrics_port}");
        let mut args: Vec<String> = vec![role.name().into()];
        let (url, admin_url) = (self.target.url(), self.target.admin_url());
        let common = [
            "--pulsar-url",
            &url,
            "--pulsar-admin-url",
            &admin_url,
            "--metrics-addr",
            &metrics,
            "--drain-grace-secs",
            "5",
        ];
        args.extend(common.iter().map(|s| (*s).to_owned()));
        // Every topic named, in the target's topicspace (on the soak's own broker `tg`, the
        // defaults).
        let t = |class: &str, name: &str| self.target.topic(class, name);
        let own = |name: &str| {
            [
                "--request-topic".to_owned(),
                t("request", name),
                "--response-topic".to_owned(),
                t("response", name),
                "--cancel-topic".to_owned(),
                t("notify", &format!("{name}-cancel")),
            ]
        };
        let llm = [
            "--llm-request-topic".to_owned(),
            t("request", "text-completion"),
            "--llm-response-topic".to_owned(),
            t("response", "text-completion"),
            "--llm-cancel-topic".to_owned(),
            t("notify", "text-completion-cancel"),
        ];
        match role {
            Role::TextCompletion => args.extend(own("text-completion")),
            Role::Prompt => {
                args.extend(own("prompt"));
                args.extend(llm);
            }
            Role::Agent => {
                args.extend(own("agent"));
                args.extend(llm);
                args.extend([
                    "--prompt-request-topic".to_owned(),
                    t("request", "prompt"),
                    "--prompt-response-topic".to_owned(),
                    t("response", "prompt"),
                    "--prompt-cancel-topic".to_owned(),
                    t("notify", "prompt-cancel"),
                ]);
            }
            Role::Gateway => args.extend([
                "--topicspace".to_owned(),
                self.target.topicspace().to_owned(),
            ]),
        }
        match role {
            Role::TextCompletion => args.extend(
                [
                    "--provider",
                    "openai-compatible",
                    "--base-url",
                    &self.fake_url,
                    "--model",
                    "routed",
                    "--max-retries",
                    "3",
                    // A stalled provider (the fake's `chaos-stall` hangs for good) is told
                    // from a slow one by these: 10 s each, far above the fake's gaps of
                    // milliseconds, so a busy machine's pause is not taken for a stall (at 3 s
                    // it could be).
                    "--chunk-timeout-secs",
                    "10",
                    "--first-token-timeout-secs",
                    "10",
                    "--concurrency",
                    "64",
                    "--usage-topic",
                    &usage_topic(self.target.topicspace()),
                ]
                .iter()
                .map(|s| (*s).to_owned()),
            ),
            Role::Prompt => args.extend(["--concurrency", "32"].iter().map(|s| (*s).to_owned())),
            Role::Agent => args.extend(
                [
                    "--tools",
                    &self.tools.to_string_lossy(),
                    "--concurrency",
                    "32",
                ]
                .iter()
                .map(|s| (*s).to_owned()),
            ),
            Role::Gateway => {
                args.extend([
                    "--listen".to_owned(),
                    format!("127.0.0.1:{}", self.gateway_port),
                ]);
            }
        }
        let log = std::fs::File::create(self.config.work_dir.join(format!("{name}.log")))
            .map_err(|e| e.to_string())?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let mut child = Command::new(&self.config.sluice)
            .args(&args)
            .envs(self.target.env(role))
            .env("RUST_LOG", "warn")
            .stdout(log)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("starting {name}: {e}"))?;
        let ready = format!("http://127.0.0.1:{metrics_port}/readyz");
        crate::process::ready(&mut child, &ready, Duration::from_secs(120))
            .await
            .map_err(|e| format!("{name}: {e}; see its log"))?;
        self.members.push(Member {
            role,
            name,
            child,
            metrics_port,
            sentinel,
        });
        Ok(())
    }

    /// Kills a random replica that is not a sentinel with SIGKILL and starts another of its
    /// kind.
    async fn kill_one(&mut self) -> Result<String, String> {
        let victims: Vec<usize> = self
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| !m.sentinel && m.role != Role::Gateway)
            .map(|(i, _)| i)
            .collect();
        if victims.is_empty() {
            return Err("no replica to kill".into());
        }
        let i = victims[rand::random_range(0..victims.len())];
        let mut victim = self.members.swap_remove(i);
        let _ = victim.child.start_kill();
        let _ = victim.child.wait().await;
        self.spawn(victim.role, false).await?;
        Ok(victim.name)
    }
}

/// What the wire auditor counted.
#[derive(Default)]
struct Audit {
    records: u64,
    terminals: u64,
    /// Terminal records per request id.
    terminal_ids: HashMap<String, u32>,
    /// (id, attempt, seq) seen.
    seen: HashSet<(String, String, String)>,
    twice: u64,
}

async fn audit<R: ResponseRecord>(
    bus: Arc<dyn Bus>,
    topic: String,
    audit: Arc<Mutex<Audit>>,
    stop: Arc<AtomicBool>,
) {
    let mut options = SubscribeOptions::exclusive(1000);
    options.consumer_name = Some(format!("soak-audit-{}", uuid::Uuid::new_v4().simple()));
    let Ok(mut sub) = bus.subscribe(&topic, "soak-audit", options).await else {
        return;
    };
    while !stop.load(Ordering::Relaxed) {
        let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_millis(500), sub.next()).await
        else {
            continue;
        };
        if d.property(properties::SYNC).is_some() {
            d.ack();
            continue;
        }
        let id = d.property(properties::ID).unwrap_or_default().to_owned();
        let attempt = d
            .property(properties::ATTEMPT)
            .unwrap_or_default()
            .to_owned();
        let seq = d.property(properties::SEQ).unwrap_or_default().to_owned();
        let terminal = serde_json::from_slice::<R>(d.payload()).is_ok_and(|r| r.is_terminal());
        {
            let mut a = audit
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            a.records += 1;
            if !a.seen.insert((id.clone(), attempt, seq)) {
                a.twice += 1;
            }
            if terminal {
                a.terminals += 1;
                *a.terminal_ids.entry(id).or_default() += 1;
            }
        }
        d.ack();
    }
    sub.close().await;
}

struct Clients {
    llm: RequestClient<TextCompletionRequest, TextCompletionResponse>,
    prompt: RequestClient<PromptRequest, PromptResponse>,
    agent: RequestClient<AgentRequest, AgentResponse>,
    http: reqwest::Client,
    gateway: String,
}

/// A prompt request whose answer is the LLM streaming contract's classification example with every
/// block id prefixed by `soak{n}-` (the fake's `seed-tagged-` model): each object names its
/// request.
fn seed_prompt(n: u64) -> (PromptRequest, usize) {
    // The request names the blocks the tagged answer classifies (the contract's abc123 and
    // ghi789): an object for a block the request does not name would be dropped.
    let blocks = json!([
        {"block_id": format!("soak{n}-abc123"),
         "content": format!("[model:seed-tagged-classification] [tag:soak{n}] soak {n}")},
        {"block_id": format!("soak{n}-ghi789"), "content": "x"}]);
    let mut terms = BTreeMap::new();
    terms.insert("blocks".to_owned(), blocks.to_string());
    let request = PromptRequest {
        id: "knowledge-classification".into(),
        terms: terms.into_iter().collect(),
        streaming: true,
    };
    let objects = seed_streams::expected("classification").map_or(0, |e| e.objects);
    (request, objects)
}

/// The agent's question for request `n`: the fake's `react-relay` model hands the question to
/// the tool, whose answer comes back in the final answer, so each answer names its request.
fn agent_question(n: u64) -> String {
    format!("[model:react-relay] soak {n}")
}

fn agent_answer(n: u64) -> String {
    format!("The tool said: Echo: {}", agent_question(n))
}

/// The `block_id` of a JSON object (given as its text or as JSON), if it has one.
fn block_id(object: &Value) -> Option<String> {
    let parsed;
    let object = match object {
        Value::String(text) => {
            parsed = serde_json::from_str::<Value>(text).ok()?;
            &parsed
        }
        other => other,
    };
    object["block_id"].as_str().map(str::to_owned)
}

/// Whether every object answers request `n`: the prompt's objects carry its tag.
fn foreign_objects(ids: &[Option<String>], n: u64) -> Option<String> {
    let prefix = format!("soak{n}-");
    ids.iter()
        .find(|id| !id.as_deref().is_some_and(|i| i.starts_with(&prefix)))
        .map(|id| {
            format!("an object of another request (block_id {id:?}) in the answer to soak {n}")
        })
}

/// Judges a terminal error: a known, non-empty type is a clear error.
fn clear(kind: &str, message: &str) -> Verdict {
    if kind.is_empty() {
        Verdict::Broken("an error record without a type".into())
    } else {
        Verdict::ClearError(kind.to_owned(), message.to_owned())
    }
}

fn client_failure(e: &ClientError) -> Verdict {
    match e {
        // A refusal (credentials, certificate, a missing grant) is not an outage: no fault
        // window may excuse it.
        ClientError::Bus(sluice_runtime::bus::BusError::Denied(d)) => {
            Verdict::Broken(format!("the broker refused the caller: {d}"))
        }
        ClientError::NotStored(_) | ClientError::Bus(_) => {
            Verdict::ClearError("not-stored".into(), e.to_string())
        }
        // The caller's own deadline (the gateway reports it as `timeout`): clear to the
        // caller, but a loss looks the same, so `one_request` accepts it only from a stalled
        // provider.
        ClientError::InactivityTimeout(_) | ClientError::TotalTimeout(_) => {
            Verdict::ClearError("timeout".into(), e.to_string())
        }
        other => Verdict::Lost(other.to_string()),
    }
}

async fn bus_llm(clients: &Clients, text: &str, streaming: bool) -> Verdict {
    let request = TextCompletionRequest {
        system: "soak".into(),
        prompt: text.into(),
        streaming,
        ..Default::default()
    };
    let mut stream = match clients.llm.request(&request).await {
        Ok(s) => s,
        Err(e) => return client_failure(&e),
    };
    let mut answer = String::new();
    let mut terminals = 0;
    loop {
        match stream.next().await {
            None => break,
            Some(Ok(Received::Restarted)) => answer.clear(),
            Some(Ok(Received::Record(r))) => {
                if let Some(e) = &r.error {
                    return clear(e.kind.as_str(), &e.message);
                }
                answer.push_str(&r.response);
                if r.end_of_stream {
                    terminals += 1;
                }
            }
            Some(Err(e)) => return client_failure(&e),
        }
    }
    if terminals != 1 {
        return Verdict::Broken(format!("{terminals} terminal records"));
    }
    if answer == text {
        Verdict::Answered
    } else {
        Verdict::Wrong(format!("answer {answer:?} for {text:?}"))
    }
}

async fn bus_prompt(clients: &Clients, n: u64) -> Verdict {
    let (request, expected) = seed_prompt(n);
    let mut stream = match clients.prompt.request(&request).await {
        Ok(s) => s,
        Err(e) => return client_failure(&e),
    };
    let mut ids = Vec::new();
    loop {
        match stream.next().await {
            None => return Verdict::Lost("the stream ended without a terminal record".into()),
            Some(Ok(Received::Restarted)) => ids.clear(),
            Some(Ok(Received::Record(r))) => {
                if let Some(e) = &r.error {
                    return clear(e.kind.as_str(), &e.message);
                }
                if let Some(o) = r.object.as_ref().filter(|o| !o.is_empty()) {
                    ids.push(block_id(&Value::String(o.clone())));
                }
                if r.end_of_stream {
                    let objects = ids.len();
                    if let Some(wrong) = foreign_objects(&ids, n) {
                        return Verdict::Wrong(wrong);
                    }
                    return if objects == expected && r.objects_emitted == Some(expected as u64) {
                        Verdict::Answered
                    } else {
                        Verdict::Wrong(format!(
                            "{objects} objects, objects_emitted {:?}, expected {expected}",
                            r.objects_emitted
                        ))
                    };
                }
            }
            Some(Err(e)) => return client_failure(&e),
        }
    }
}

async fn bus_agent(clients: &Clients, n: u64) -> Verdict {
    let request = AgentRequest {
        question: agent_question(n),
        streaming: true,
        ..Default::default()
    };
    let mut stream = match clients.agent.request(&request).await {
        Ok(s) => s,
        Err(e) => return client_failure(&e),
    };
    let mut answer = String::new();
    loop {
        match stream.next().await {
            None => return Verdict::Lost("the dialog ended without end_of_dialog".into()),
            Some(Ok(Received::Restarted)) => answer.clear(),
            Some(Ok(Received::Record(r))) => {
                if let Some(e) = &r.error {
                    return clear(e.kind.as_str(), &e.message);
                }
                if r.message_type == AgentMessageType::Answer {
                    answer.push_str(&r.content);
                }
                if r.end_of_dialog {
                    return if answer == agent_answer(n) {
                        Verdict::Answered
                    } else {
                        Verdict::Wrong(format!("answer {answer:?}"))
                    };
                }
            }
            Some(Err(e)) => return client_failure(&e),
        }
    }
}

/// What an NDJSON answer held: the tokens after the last `restarted` (agent: answer tokens
/// only), the error type if any, the done events, and protocol problems.
struct Events {
    text: String,
    objects: usize,
    /// The `block_id` of each object since the last restart.
    object_ids: Vec<Option<String>>,
    /// The error event's type and its content (the message).
    error: Option<(String, String)>,
    done: u32,
    broken: Option<String>,
}

async fn http_events(
    clients: &Clients,
    service: &str,
    body: Value,
    only_answers: bool,
) -> Result<Events, Verdict> {
    let response = clients
        .http
        .post(format!("{}/api/v1/{service}", clients.gateway))
        .header("accept", "application/x-ndjson")
        .json(&body)
        .send()
        .await
        .map_err(|e| Verdict::Lost(format!("HTTP: {e}")))?;
    let status = response.status();
    if !status.is_success() {
        let v: Value = response.json().await.unwrap_or_default();
        let kind = v["error"]["type"].as_str().unwrap_or_default().to_owned();
        return Err(if kind.is_empty() {
            Verdict::Broken(format!("HTTP {status} without an error type"))
        } else {
            clear(&kind, v["error"]["message"].as_str().unwrap_or_default())
        });
    }
    let mut events = Events {
        text: String::new(),
        objects: 0,
        object_ids: Vec::new(),
        error: None,
        done: 0,
        broken: None,
    };
    let mut body = response.bytes_stream();
    let mut buf = Vec::new();
    loop {
        let chunk = match tokio::time::timeout(Duration::from_secs(180), body.next()).await {
            Err(_) => return Err(Verdict::Lost("no event for 180 s".into())),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(Verdict::Lost(format!("body: {e}"))),
            Ok(Some(Ok(c))) => c,
        };
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let Ok(event) = serde_json::from_slice::<Value>(&line) else {
                events.broken = Some("a line that is not JSON".into());
                continue;
            };
            if events.done > 0 {
                events.broken = Some(format!("an event after done: {event}"));
            }
            match event["type"].as_str() {
                Some("status") if event["status"] == "restarted" => {
                    events.text.clear();
                    events.objects = 0;
                    events.object_ids.clear();
                }
                Some("token") => {
                    if let Some(o) = event.get("object").filter(|o| !o.is_null()) {
                        events.objects += 1;
                        events.object_ids.push(block_id(o));
                    }
                    if !only_answers || event["message_type"] == "answer" {
                        events
                            .text
                            .push_str(event["content"].as_str().unwrap_or_default());
                    }
                }
                Some("error") => {
                    if events.error.is_some() {
                        events.broken = Some("two error events".into());
                    }
                    events.error = Some((
                        event["error_type"].as_str().unwrap_or_default().to_owned(),
                        event["content"].as_str().unwrap_or_default().to_owned(),
                    ));
                }
                Some("done") => events.done += 1,
                _ => {}
            }
        }
    }
    if !buf.is_empty() {
        events.broken = Some("a partial last line".into());
    }
    Ok(events)
}

fn judge_events(events: Events, expected: impl FnOnce(&Events) -> Option<String>) -> Verdict {
    if let Some(b) = events.broken {
        return Verdict::Broken(b);
    }
    if events.done != 1 {
        return if events.done == 0 {
            Verdict::Lost("the body ended without a done event".into())
        } else {
            Verdict::Broken(format!("{} done events", events.done))
        };
    }
    if let Some((kind, message)) = &events.error {
        return clear(kind, message);
    }
    match expected(&events) {
        None => Verdict::Answered,
        Some(wrong) => Verdict::Wrong(wrong),
    }
}

async fn http_llm(clients: &Clients, text: &str, streaming: bool) -> Verdict {
    let body = json!({"system": "soak", "prompt": text});
    if !streaming {
        let response = match clients
            .http
            .post(format!("{}/api/v1/text-completion", clients.gateway))
            .json(&body)
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => return Verdict::Lost(format!("HTTP: {e}")),
        };
        let status = response.status();
        let v: Value = match response.json().await {
            Ok(v) => v,
            Err(e) => return Verdict::Lost(format!("HTTP body: {e}")),
        };
        if let Some(kind) = v["error"]["type"].as_str() {
            return clear(kind, v["error"]["message"].as_str().unwrap_or_default());
        }
        if !status.is_success() {
            return Verdict::Broken(format!("HTTP {status} without an error"));
        }
        return if v["response"] == text {
            Verdict::Answered
        } else {
            Verdict::Wrong(format!("answer {} for {text:?}", v["response"]))
        };
    }
    match http_events(clients, "text-completion", body, false).await {
        Err(v) => v,
        Ok(events) => judge_events(events, |e| {
            (e.text != text).then(|| format!("answer {:?} for {text:?}", e.text))
        }),
    }
}

async fn http_prompt(clients: &Clients, n: u64) -> Verdict {
    let (request, expected) = seed_prompt(n);
    let body = serde_json::to_value(&request).unwrap_or_default();
    match http_events(clients, "prompt", body, false).await {
        Err(v) => v,
        Ok(events) => judge_events(events, |e| {
            foreign_objects(&e.object_ids, n).or_else(|| {
                (e.objects != expected)
                    .then(|| format!("{} objects, expected {expected}", e.objects))
            })
        }),
    }
}

async fn http_agent(clients: &Clients, n: u64) -> Verdict {
    let body = json!({"question": agent_question(n)});
    let expected = agent_answer(n);
    match http_events(clients, "agent", body, true).await {
        Err(v) => v,
        Ok(events) => judge_events(events, |e| {
            (e.text != expected).then(|| format!("answer {:?}, expected {expected:?}", e.text))
        }),
    }
}

async fn one_request(clients: &Clients, n: u64, kind: Kind, fault: Fault) -> Verdict {
    let text = format!(
        "[model:{}] soak {n} {}",
        fault.model(),
        uuid::Uuid::new_v4().simple()
    );
    let verdict = match kind {
        Kind::BusLlmStream => bus_llm(clients, &text, true).await,
        Kind::BusLlmWhole => bus_llm(clients, &text, false).await,
        Kind::HttpLlmStream => http_llm(clients, &text, true).await,
        Kind::HttpLlmWhole => http_llm(clients, &text, false).await,
        Kind::BusPrompt => bus_prompt(clients, n).await,
        Kind::HttpPrompt => http_prompt(clients, n).await,
        Kind::BusAgent => bus_agent(clients, n).await,
        Kind::HttpAgent => http_agent(clients, n).await,
    };
    // A stalled provider is retried (10 s first-token limit, 4 attempts) and its request
    // redelivered when a replica is killed, so it may outlast the caller's deadline. Any
    // other request that runs into the deadline was lost.
    match verdict {
        Verdict::ClearError(t, _) if t == "timeout" && fault != Fault::Stalled => {
            Verdict::Lost("the caller's deadline passed without a terminal record".into())
        }
        other => other,
    }
}

/// The allocator's count of live allocations on `port`'s /metrics, in MiB; NaN if unread.
async fn scrape_heap_mib(http: &reqwest::Client, port: u16) -> f64 {
    let text = async {
        http.get(format!("http://127.0.0.1:{port}/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()
    }
    .await
    .unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("sluice_process_heap_allocated_bytes "))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map_or(f64::NAN, |b| b / 1_048_576.0)
}

/// The processors' in-flight requests on `port`'s /metrics; `None` when the page cannot be
/// read or has no in-flight series.
async fn scrape_in_flight(http: &reqwest::Client, port: u16) -> Option<i64> {
    let text = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    in_flight_in(&text)
}

/// The sum of every `sluice_processor_in_flight_requests` series in a metrics page. A page
/// without one is `None`, not 0: a processor registers its series at 0 when it starts, so a
/// missing gauge means a renamed or unregistered one, and the drain check must not pass on it.
fn in_flight_in(text: &str) -> Option<i64> {
    let values: Vec<i64> = text
        .lines()
        .filter(|l| l.starts_with("sluice_processor_in_flight_requests{"))
        .map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<i64>().ok()))
        .collect::<Option<_>>()?;
    if values.is_empty() {
        None
    } else {
        Some(values.iter().sum())
    }
}

/// Runs the soak. Returns an error only when it cannot set up (the broker or a process does
/// not start); everything that goes wrong during the run is in the report.
pub async fn run(config: SoakConfig) -> Result<SoakReport, String> {
    // reqwest is built without a default rustls provider (sluice installs one at start-up).
    sluice_runtime::install_crypto_provider();
    let _ = std::fs::remove_dir_all(&config.work_dir);
    std::fs::create_dir_all(&config.work_dir).map_err(|e| e.to_string())?;
    if let Some(cluster) = &config.cluster {
        let ts = cluster.topicspace().await;
        grant_soak(cluster, &ts).await?;
        let target = Arc::new(Target::Cluster {
            cluster: cluster.clone(),
            ts,
        });
        return soak(&config, target).await;
    }
    let broker = SoakBroker {
        script: config.pulsar_script.clone(),
        ports: config.broker_ports,
    };
    broker.run("wipe").await;
    if !broker.run("start").await {
        return Err("the soak's broker did not start".into());
    }
    // The broker stops when the last reference to the target goes (SoakBroker's drop).
    soak(&config, Arc::new(Target::Standalone(broker))).await
}

async fn soak(config: &SoakConfig, target: Arc<Target>) -> Result<SoakReport, String> {
    let fake = FakeOpenAi::start().await;
    let tools = config.work_dir.join("tools.json");
    std::fs::write(
        &tools,
        r#"{"tools": [{"name": "ask", "description": "Ask a language model", "type": "text-completion"}]}"#,
    )
    .map_err(|e| e.to_string())?;
    let mut fleet = Fleet {
        config: config.clone(),
        target: target.clone(),
        fake_url: fake.base_url(),
        gateway_port: crate::free_port(),
        tools,
        members: Vec::new(),
        counter: 0,
    };
    // One sentinel per kind (never killed: its memory is the leak check) and chaos replicas.
    for (role, sentinel) in [
        (Role::TextCompletion, true),
        (Role::TextCompletion, false),
        (Role::TextCompletion, false),
        (Role::Prompt, true),
        (Role::Prompt, false),
        (Role::Agent, true),
        (Role::Agent, false),
        (Role::Gateway, true),
    ] {
        fleet.spawn(role, sentinel).await?;
    }
    let test_broker = Broker {
        url: target.url(),
        admin_url: target.admin_url(),
    };
    let bus: Arc<dyn Bus> = Arc::new(test_broker.pulsar_bus(target.bus_config()).await);
    let ts = target.topicspace().to_owned();
    let client_config = |service: &str| {
        let [request, response, cancel] = topics(&ts, service);
        let mut c = ClientConfig::new(format!("soak-{service}"), request, response);
        c.cancel_topic = Some(cancel);
        c
    };
    let clients = Arc::new(Clients {
        llm: RequestClient::start(bus.clone(), client_config("text-completion"), None)
            .await
            .map_err(|e| e.to_string())?,
        prompt: RequestClient::start(bus.clone(), client_config("prompt"), None)
            .await
            .map_err(|e| e.to_string())?,
        agent: RequestClient::start(bus.clone(), client_config("agent"), None)
            .await
            .map_err(|e| e.to_string())?,
        http: reqwest::Client::new(),
        gateway: format!("http://127.0.0.1:{}", fleet.gateway_port),
    });

    let stop_audit = Arc::new(AtomicBool::new(false));
    let audit_state = Arc::new(Mutex::new(Audit::default()));
    let audits = vec![
        tokio::spawn(audit::<TextCompletionResponse>(
            bus.clone(),
            topics(&ts, "text-completion")[1].clone(),
            audit_state.clone(),
            stop_audit.clone(),
        )),
        tokio::spawn(audit::<PromptResponse>(
            bus.clone(),
            topics(&ts, "prompt")[1].clone(),
            audit_state.clone(),
            stop_audit.clone(),
        )),
        tokio::spawn(audit::<AgentResponse>(
            bus.clone(),
            topics(&ts, "agent")[1].clone(),
            audit_state.clone(),
            stop_audit.clone(),
        )),
    ];

    // Traffic, until the chaos loop below says it is over.
    let started = Instant::now();
    let planned_end = started + config.duration;
    let traffic = tokio_util::sync::CancellationToken::new();
    let counter = Arc::new(AtomicU64::new(0));
    // Each request's kind, fault, verdict, and when it ran (seconds since the start).
    type Judged = (Kind, Fault, Verdict, (f64, f64));
    let results: Arc<Mutex<Vec<Judged>>> = Arc::default();
    let callers: Vec<_> = (0..config.callers)
        .map(|_| {
            let (clients, counter, results) = (clients.clone(), counter.clone(), results.clone());
            let traffic = traffic.clone();
            tokio::spawn(async move {
                while !traffic.is_cancelled() {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    let (kind, fault) = {
                        let mut rng = rand::rng();
                        let kind = Kind::pick(&mut rng);
                        let fault = match kind {
                            Kind::BusLlmStream
                            | Kind::BusLlmWhole
                            | Kind::HttpLlmStream
                            | Kind::HttpLlmWhole => Fault::pick(&mut rng),
                            _ => Fault::None,
                        };
                        (kind, fault)
                    };
                    let began = started.elapsed().as_secs_f64();
                    let verdict = one_request(&clients, n, kind, fault).await;
                    let ran = (began, started.elapsed().as_secs_f64());
                    results
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((kind, fault, verdict, ran));
                }
            })
        })
        .collect();

    // Chaos, memory samples.
    let mut report = SoakReport::default();
    let http = reqwest::Client::new();
    let mut next_kill = started + jitter(config.kill_every);
    let mut next_fault = started + config.fault_every;
    // After a fault that could not be done or repaired, no more: the soak reports it, and a
    // further fault on a broken cluster could take down what is left.
    let mut faults_stopped = false;
    let mut rss: HashMap<String, Vec<(Duration, f64, f64)>> = HashMap::new();
    let mut next_sample = started;
    // When the last fault was repaired, if any was.
    let mut last_repair: Option<Instant> = None;
    loop {
        let now = Instant::now();
        let faults_done = faults_stopped
            || config
                .max_faults
                .is_some_and(|max| report.faults.len() >= max);
        let kills_done = config.min_kills.is_none_or(|n| report.kills >= n as u64);
        let over = kills_done
            && match config.max_faults {
                None => now >= planned_end,
                Some(_) => {
                    now >= planned_end
                        && faults_done
                        && last_repair.is_none_or(|t| now >= t + FAULT_TAIL)
                }
            };
        // Four times the planned traffic: a hang guard for a soak that cannot make its faults
        // or kills (each failure is a violation already), not a schedule.
        if over || now >= started + config.duration * 4 {
            break;
        }
        if now >= next_sample {
            for m in fleet.members.iter().filter(|m| m.sentinel) {
                let heap = scrape_heap_mib(&http, m.metrics_port).await;
                rss.entry(m.name.clone()).or_default().push((
                    now - started,
                    rss_mib(m.pid()),
                    heap,
                ));
            }
            next_sample = now + Duration::from_secs(5);
        }
        // A fault needs traffic after it to mean anything: without a number of faults to
        // make, none in the last FAULT_TAIL of the planned traffic (with one, the traffic
        // waits for it instead).
        let may_fault = !faults_stopped
            && !faults_done
            && (config.max_faults.is_some()
                || planned_end.saturating_duration_since(now) > FAULT_TAIL);
        if now >= next_fault && may_fault {
            let at = (now - started).as_secs_f64();
            report.broker_restart_at.push(at);
            let done = target.fault(report.faults.len()).await;
            // Recorded either way, so each fault keeps its (began, took) pair.
            report.broker_restarts.push(now.elapsed());
            report.outages.push((at, at + done.disrupted.as_secs_f64()));
            report.faults.push(done.name.clone());
            if let Err(e) = done.result {
                report.violations.push(format!("fault {}: {e}", done.name));
                faults_stopped = true;
            }
            last_repair = Some(Instant::now());
            next_fault = Instant::now() + config.fault_every;
        }
        // A fault takes a while: the time now, for the kill below.
        let now = Instant::now();
        if now >= next_kill {
            match fleet.kill_one().await {
                Ok(name) => {
                    report.kills += 1;
                    report.kill_at.push(((now - started).as_secs_f64(), name));
                }
                Err(e) => report.violations.push(format!("chaos: {e}")),
            }
            next_kill = Instant::now() + jitter(config.kill_every);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    traffic.cancel();
    for c in callers {
        let _ = c.await;
    }
    report.duration = started.elapsed();

    // Every in-flight gauge back to 0.
    let drain_started = Instant::now();
    loop {
        let mut stuck = Vec::new();
        for m in fleet.members.iter().filter(|m| m.role != Role::Gateway) {
            match scrape_in_flight(&http, m.metrics_port).await {
                Some(0) => {}
                Some(n) => stuck.push(format!("{} ({n} in flight)", m.name)),
                None => stuck.push(format!("{} (no metrics)", m.name)),
            }
        }
        if stuck.is_empty() || drain_started.elapsed() > Duration::from_secs(120) {
            report.stuck_in_flight = stuck;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    report.drain_time = drain_started.elapsed();
    for m in fleet.members.iter().filter(|m| m.sentinel) {
        let heap = scrape_heap_mib(&http, m.metrics_port).await;
        let series = rss.entry(m.name.clone()).or_default();
        series.push((report.duration, rss_mib(m.pid()), heap));
        let after: Vec<(f64, f64)> = series
            .iter()
            .filter(|(t, _, _)| *t >= config.warm_up)
            .map(|(_, r, h)| (*r, *h))
            .collect();
        if let (Some(first), Some(last)) = (after.first(), after.last()) {
            let max = after.iter().map(|(r, _)| *r).fold(0.0, f64::max);
            report
                .rss
                .push((m.name.clone(), first.0, last.0, max, first.1, last.1));
        }
        let heap: Vec<(f64, f64)> = series
            .iter()
            .map(|(t, _, h)| (t.as_secs_f64(), *h))
            .collect();
        report.violations.extend(heap_findings(
            &m.name,
            &heap,
            config.warm_up.as_secs_f64(),
            &report.broker_restart_at,
        ));
        report.rss_series.push((
            m.name.clone(),
            series
                .iter()
                .map(|(t, r, h)| (t.as_secs_f64(), *r, *h))
                .collect(),
        ));
    }

    stop_audit.store(true, Ordering::Relaxed);
    for a in audits {
        let _ = a.await;
    }
    {
        let a = audit_state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let second_terminals = a.terminal_ids.values().filter(|n| **n > 1).count() as u64;
        report.audit = (a.records, a.terminals, second_terminals, a.twice);
    }
    if report.audit.0 == 0 {
        // Its subscriptions failed (it says nothing then) or it read nothing: its counts
        // would pass anything.
        report
            .violations
            .push("the wire auditor read no response record".into());
    }

    // The usage ledger against the fake's own count (issue #25.4). The in-flight gauges
    // are at 0, so every record is on the topic or in a backlog: the backlogs first.
    let backlog_started = Instant::now();
    loop {
        let mut waiting = 0;
        for m in fleet
            .members
            .iter()
            .filter(|m| m.role == Role::TextCompletion)
        {
            if let Ok(r) = http
                .get(format!("http://127.0.0.1:{}/metrics", m.metrics_port))
                .send()
                .await
                && let Ok(text) = r.text().await
            {
                waiting += crate::metrics_text::value(&text, "sluice_usage_backlog", &[]) as u64;
            }
        }
        if waiting == 0 || backlog_started.elapsed() > Duration::from_secs(90) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    match compare_ledger(
        &bus,
        &usage_topic(&ts),
        &fake.chaos_calls(),
        started,
        &report.kill_at,
        &report.outages,
    )
    .await
    {
        Ok((figures, findings)) => {
            report.ledger = figures;
            report.violations.extend(findings);
        }
        Err(e) => report.violations.push(format!("usage ledger: {e}")),
    }

    let results = std::mem::take(
        &mut *results
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    report.requests = results.len() as u64;
    // The broker restarts, as (began, served again) in seconds since the start.
    let outages = report.outages.clone();
    for (kind, fault, verdict, ran) in results {
        let label = match &verdict {
            Verdict::Answered => {
                report.answered += 1;
                "answered".to_owned()
            }
            Verdict::ClearError(t, message) => {
                report.clear_errors += 1;
                if fault.answerable() {
                    *report.unanswered_clean.entry(t.clone()).or_default() += 1;
                }
                if let Some(finding) =
                    unexplained_error(kind, fault, t, message, ran, &outages, &report.kill_at)
                {
                    report.violations.push(finding);
                }
                format!("error `{t}`")
            }
            Verdict::Wrong(why) => {
                report
                    .violations
                    .push(format!("{} ({fault:?}): wrong answer: {why}", kind.name()));
                "WRONG".to_owned()
            }
            Verdict::Lost(why) => {
                report
                    .violations
                    .push(format!("{} ({fault:?}): lost: {why}", kind.name()));
                "LOST".to_owned()
            }
            Verdict::Broken(why) => {
                report
                    .violations
                    .push(format!("{} ({fault:?}): broken: {why}", kind.name()));
                "BROKEN".to_owned()
            }
        };
        *report.outcomes.entry((kind, label)).or_default() += 1;
    }
    if report.answered == 0 {
        report.violations.push("nothing was answered".into());
    }

    clients.llm.close().await;
    clients.prompt.close().await;
    clients.agent.close().await;
    for m in &mut fleet.members {
        let _ = m.child.start_kill();
        let _ = m.child.wait().await;
    }
    target.clean_up().await;
    Ok(report)
}

/// Reads the usage ledger and compares it, per trace, with what the fake billed for its
/// `chaos-*` calls (every soak text-completion request's, each trace its own request, or for a
/// request over HTTP all its attempts). A trace must never be billed more than the fake
/// counted (nothing counted twice, across retries, restarts and redeliveries), and must be
/// billed exactly that unless one of its calls was cut by its client or a text-completion
/// replica was killed while it ran (that attempt's record died with it). Traces of other
/// calls (prompt, agent) are not compared.
async fn compare_ledger(
    bus: &Arc<dyn Bus>,
    topic: &str,
    calls: &[crate::fake_openai::ChaosCall],
    started: Instant,
    kills: &[(f64, String)],
    outages: &[(f64, f64)],
) -> Result<((u64, u64, u64, u64), Vec<String>), String> {
    // Records are written after the in-flight gauge drops, and a backlog after a broker
    // restart is stored a moment later: read until nothing came for 3 s.
    let mut billed: HashMap<String, u64> = HashMap::new();
    let mut attempts = HashSet::new();
    let mut records = 0u64;
    let skipped =
        sluice_runtime::ledger::read_records(bus.as_ref(), topic, Duration::from_secs(3), |r| {
            records += 1;
            // A record stored twice (a publish whose receipt was lost) counts once, as
            // readers do.
            if attempts.insert(r.attempt.clone())
                && let Some(t) = r.trace_id
            {
                *billed.entry(t).or_default() += r.input_tokens + r.output_tokens;
            }
            std::ops::ControlFlow::Continue(())
        })
        .await
        .map_err(|e| e.to_string())?;
    if skipped > 0 {
        return Err(format!(
            "{skipped} message(s) on {topic} are not usage records"
        ));
    }
    if records == 0 {
        return Err("no usage record was read".into());
    }
    struct Trace {
        counted: u64,
        cut: bool,
        at: Vec<f64>,
    }
    let mut traces: HashMap<String, Trace> = HashMap::new();
    for c in calls {
        let Some(t) = &c.trace_id else { continue };
        let e = traces.entry(t.clone()).or_insert(Trace {
            counted: 0,
            cut: false,
            at: Vec::new(),
        });
        e.counted += c.billed;
        e.cut |= c.abandoned.load(Ordering::SeqCst) > 0;
        e.at.push(c.at.saturating_duration_since(started).as_secs_f64());
    }
    let tc_kills: Vec<f64> = kills
        .iter()
        .filter(|(_, name)| name.starts_with("text-completion"))
        .map(|(at, _)| *at)
        .collect();
    let (mut equal, mut short, mut short_by) = (0u64, 0u64, 0u64);
    let mut findings = Vec::new();
    for (t, trace) in &traces {
        let ledger = billed.get(t).copied().unwrap_or(0);
        // An attempt runs for seconds (a stall ends at the chunk timeout, 10 s), unless a
        // broker outage holds its records, and with them its usage record, until it ends.
        let killed = trace.at.iter().any(|at| {
            let until = outages
                .iter()
                .filter(|(from, to)| *from <= at + 15.0 && *to >= *at)
                .map(|(_, to)| *to)
                .fold(at + 15.0, f64::max)
                + 15.0;
            tc_kills.iter().any(|k| *k >= at - 1.0 && *k <= until)
        });
        if ledger == trace.counted {
            equal += 1;
        } else if ledger > trace.counted {
            findings.push(format!(
                "usage ledger: trace {t} billed {ledger} tokens, the provider counted {}",
                trace.counted
            ));
        } else if trace.cut || killed {
            short += 1;
            short_by += trace.counted - ledger;
        } else {
            findings.push(format!(
                "usage ledger: trace {t} billed {ledger} tokens, the provider counted {}, and \
                 no call of it was cut nor a text-completion replica killed while it ran",
                trace.counted
            ));
        }
    }
    Ok(((traces.len() as u64, equal, short, short_by), findings))
}

/// Whether a clear error of a request that should have been answered (no provider fault, or
/// one the processor retries) is what a broker restart explains, while the request ran:
/// - a request the broker did not store (`not-stored`);
/// - a caller of text-completion whose model answer restarted (see [`documented_restart`]):
///   the broker went away before text-completion's acknowledgement of the model request was
///   stored, so the request was delivered again and answered again from the start, which is
///   at-least-once delivery doing its job (measured: a 60-164 s agent request across an 89 s
///   graceful restart, on a machine busy with the production-Pulsar suite).
///
/// Every other such error is a finding.
fn explained_by_an_outage(
    kind: Kind,
    error: &str,
    message: &str,
    (began, ended): (f64, f64),
    outages: &[(f64, f64)],
) -> bool {
    // A publish may fail a moment before the broker is seen down, and the producer may need a
    // few seconds to reconnect after it serves again.
    const BEFORE: f64 = 2.0;
    const AFTER: f64 = 10.0;
    (error == "not-stored" || documented_restart(kind, error, message))
        && outages
            .iter()
            .any(|(down, up)| began <= up + AFTER && ended >= down - BEFORE)
}

/// What is wrong with a request under `fault` ending with the clear error `error` (`message`)
/// while it ran (`ran`, seconds since the start), if anything: an error that is not the
/// fault's own ([`Fault::own_errors`]; a request without a fault, or with one the processor
/// retries, has none) must be explained by a broker fault ([`explained_by_an_outage`]) or a
/// killed replica ([`explained_by_a_kill`]).
fn unexplained_error(
    kind: Kind,
    fault: Fault,
    error: &str,
    message: &str,
    ran: (f64, f64),
    outages: &[(f64, f64)],
    kills: &[(f64, String)],
) -> Option<String> {
    if fault.own_errors().contains(&error)
        || explained_by_an_outage(kind, error, message, ran, outages)
        || explained_by_a_kill(kind, error, message, ran, kills)
    {
        return None;
    }
    let expected = if fault.answerable() {
        "a request that should have been answered".to_owned()
    } else {
        format!(
            "a request whose fault ends it with {}",
            fault
                .own_errors()
                .iter()
                .map(|e| format!("`{e}`"))
                .collect::<Vec<_>>()
                .join(" or ")
        )
    };
    Some(format!(
        "{} ({fault:?}): {expected} ended with `{error}` ({message:?}) at {:.1}-{:.1} s, not \
         explained by a broker fault or a killed replica",
        kind.name(),
        ran.0,
        ran.1
    ))
}

/// Whether a clear error is the documented end of a caller of text-completion whose model
/// answer restarted on a second delivery after it had streamed part of the first, which it
/// cannot take back:
/// - the agent ends the dialog with `agent-error` "text-completion restarted its answer
///   midway; ask again" (it had streamed that call's thought);
/// - the prompt service ends the stream with `llm-error` "text-completion restarted its answer
///   after part of it was published; send the request again" (it had published objects).
fn documented_restart(kind: Kind, error: &str, message: &str) -> bool {
    match kind {
        Kind::BusAgent | Kind::HttpAgent => {
            error == "agent-error" && message.contains("restarted its answer midway")
        }
        Kind::BusPrompt | Kind::HttpPrompt => {
            error == "llm-error"
                && message.contains("restarted its answer after part of it was published")
        }
        _ => false,
    }
}

/// Whether a clear error is what a killed text-completion replica explains: the model call was
/// answered by that replica, the answer restarted on another after the kill
/// ([`documented_restart`]). Only with a text-completion kill while the request ran; any other
/// clear error stays a finding.
fn explained_by_a_kill(
    kind: Kind,
    error: &str,
    message: &str,
    (began, ended): (f64, f64),
    kills: &[(f64, String)],
) -> bool {
    documented_restart(kind, error, message)
        && kills.iter().any(|(at, name)| {
            name.starts_with(Role::TextCompletion.name()) && *at >= began - 0.5 && *at <= ended
        })
}

/// The bound on a never-killed replica's heap: at the end, idle after the drain, at most this
/// many times its heap right after warm-up. Measured: the gateway's grows from 26.7 to 45.4
/// MiB (1.7x) over the first 10 of 30 minutes as its pools and buffers fill, then stays there;
/// a leak of one allocation per request would pass any fixed bound given time, which is what
/// the trend check is for.
pub const HEAP_END_BOUND: f64 = 2.0;
/// Heap checkpoints (the last sample before each broker restart after warm-up, and the end)
/// needed to judge a trend; a short soak has fewer and is judged on the bound alone.
pub const HEAP_TREND_MIN_CHECKPOINTS: usize = 4;
/// An upward trend: the later half of the checkpoints averages this much above the earlier.
pub const HEAP_TREND_RATIO: f64 = 1.25;

/// The memory findings of one never-killed replica, from its heap samples (seconds since the
/// start, allocated MiB; the last one taken at the end, idle): the end above
/// [`HEAP_END_BOUND`] times the first sample after warm-up, or an upward trend across the
/// samples taken just before each broker restart (where each cycle leaves the process in the
/// same state) and the end. A sample that could not be read is a finding too: a check that
/// reads nothing passes nothing.
fn heap_findings(
    name: &str,
    samples: &[(f64, f64)],
    warm_up: f64,
    restarts: &[f64],
) -> Vec<String> {
    let mut findings = Vec::new();
    let after: Vec<(f64, f64)> = samples
        .iter()
        .copied()
        .filter(|(t, _)| *t >= warm_up)
        .collect();
    let (Some(&(_, first)), Some(&(_, end))) = (after.first(), after.last()) else {
        return vec![format!("{name}: no heap sample after warm-up")];
    };
    if let Some((t, _)) = after.iter().find(|(_, h)| !h.is_finite()) {
        findings.push(format!("{name}: the heap could not be read at {t:.0} s"));
        return findings;
    }
    if end > first * HEAP_END_BOUND {
        findings.push(format!(
            "{name}: heap {end:.1} MiB at the end, idle, over {HEAP_END_BOUND}x the {first:.1} MiB after warm-up"
        ));
    }
    let mut checkpoints: Vec<f64> = restarts
        .iter()
        .filter(|r| **r >= warm_up)
        .filter_map(|r| after.iter().rev().find(|(t, _)| t < r).map(|(_, h)| *h))
        .collect();
    checkpoints.push(end);
    if checkpoints.len() >= HEAP_TREND_MIN_CHECKPOINTS {
        let half = checkpoints.len() / 2;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (early, late) = (
            mean(&checkpoints[..half]),
            mean(&checkpoints[checkpoints.len() - half..]),
        );
        if late > early * HEAP_TREND_RATIO {
            findings.push(format!(
                "{name}: the heap trends upward across broker restarts: {} MiB",
                checkpoints
                    .iter()
                    .map(|h| format!("{h:.1}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    findings
}

fn jitter(every: Duration) -> Duration {
    every.mul_f64(rand::random_range(0.8..1.2))
}

#[cfg(test)]
mod tests {
    use super::{
        Fault, Kind, block_id, explained_by_a_kill, explained_by_an_outage, foreign_objects,
        heap_findings, in_flight_in, unexplained_error,
    };
    use serde_json::json;

    #[test]
    fn an_object_of_another_request_is_found() {
        let ids = |v: &[&str]| v.iter().map(|i| Some((*i).to_owned())).collect::<Vec<_>>();
        assert_eq!(
            foreign_objects(&ids(&["soak7-abc123", "soak7-ghi789"]), 7),
            None
        );
        // Request 17's objects in the answer to request 7 (a prefix is not enough).
        assert!(foreign_objects(&ids(&["soak7-abc123", "soak17-ghi789"]), 7).is_some());
        assert!(foreign_objects(&ids(&["soak71-abc123"]), 7).is_some());
        assert!(
            foreign_objects(&[None], 7).is_some(),
            "an object without a block id"
        );
        assert_eq!(
            block_id(&json!("{\"block_id\": \"soak7-abc123\"}")).as_deref(),
            Some("soak7-abc123")
        );
        assert_eq!(block_id(&json!({"block_id": "x"})).as_deref(), Some("x"));
    }

    #[test]
    fn the_heap_check_fails_on_growth_past_the_bound_and_on_a_trend_across_restarts() {
        // The 30-minute run's gateway (bench/results/soak.md): fills up, then stays.
        let plateau = [
            (0.0, 18.0),
            (122.0, 26.7),
            (299.0, 38.0),
            (599.0, 50.3),
            (899.0, 39.7),
            (1199.0, 44.9),
            (1499.0, 40.0),
            (1836.0, 45.4),
        ];
        let restarts = [300.0, 600.0, 900.0, 1200.0, 1500.0];
        assert_eq!(
            heap_findings("gw", &plateau, 120.0, &restarts),
            Vec::<String>::new()
        );
        // A leak: a step up at every restart.
        let leak = [
            (122.0, 26.7),
            (299.0, 30.0),
            (599.0, 34.0),
            (899.0, 38.0),
            (1199.0, 42.0),
            (1499.0, 46.0),
            (1836.0, 50.0),
        ];
        let found = heap_findings("gw", &leak, 120.0, &restarts);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("trends upward"), "{found:?}");
        // Past the bound at the end, even without restarts to see a trend.
        let grown = [(50.0, 20.0), (120.0, 30.0), (180.0, 41.0)];
        let found = heap_findings("gw", &grown, 45.0, &[]);
        assert!(
            found.len() == 1 && found[0].contains("over 2x"),
            "{found:?}"
        );
        // Unread samples are findings, not passes.
        let unread = [(50.0, f64::NAN), (180.0, f64::NAN)];
        assert!(heap_findings("gw", &unread, 45.0, &[])[0].contains("could not be read"));
        assert!(heap_findings("gw", &[], 45.0, &[])[0].contains("no heap sample"));
    }

    #[test]
    fn an_injected_fault_explains_only_its_own_errors() {
        let outages = [(90.0, 98.0)];
        let kills = [(50.0, "text-completion-3".to_owned())];
        let judge = |kind, fault, error, ran| {
            unexplained_error(kind, fault, error, "m", ran, &outages, &kills)
        };
        let quiet = (10.0, 12.0);
        // Each fault's own error, at any time.
        assert_eq!(
            judge(Kind::HttpLlmStream, Fault::Malformed, "llm-error", quiet),
            None
        );
        assert_eq!(
            judge(Kind::BusLlmWhole, Fault::Dropped, "llm-error", quiet),
            None
        );
        assert_eq!(
            judge(Kind::BusLlmStream, Fault::Stalled, "timeout", quiet),
            None
        );
        assert_eq!(
            judge(Kind::BusLlmStream, Fault::Stalled, "llm-error", quiet),
            None
        );
        // Another fault's error, or one no fault makes, is a finding.
        for (fault, error) in [
            (Fault::Malformed, "timeout"),
            (Fault::Dropped, "internal-error"),
            (Fault::Stalled, "records-lost"),
            (Fault::Malformed, "not-stored"),
        ] {
            let found = judge(Kind::BusLlmStream, fault, error, quiet);
            assert!(
                found.as_deref().is_some_and(|f| f.contains(error)),
                "{fault:?} ending with {error}: {found:?}"
            );
        }
        // `not-stored` is explained by a broker restart while the request ran, and only then.
        assert_eq!(
            judge(
                Kind::BusLlmStream,
                Fault::Dropped,
                "not-stored",
                (95.0, 96.0)
            ),
            None
        );
        // A request that should be answered has no error of its own.
        assert!(judge(Kind::HttpLlmWhole, Fault::RateLimited, "llm-error", quiet).is_some());
        assert!(judge(Kind::HttpLlmWhole, Fault::None, "too-many-requests", quiet).is_some());
    }

    #[test]
    fn only_a_refusal_or_a_restarted_answer_during_a_broker_restart_is_explained() {
        let outages = [(90.0, 98.0)];
        let outage =
            |kind, error, message, ran| explained_by_an_outage(kind, error, message, ran, &outages);
        let tc = Kind::BusLlmStream;
        assert!(outage(tc, "not-stored", "", (89.0, 95.0)));
        assert!(outage(tc, "not-stored", "", (97.0, 105.0)));
        // Long after the broker was back, or with another error: a finding.
        assert!(!outage(tc, "not-stored", "", (120.0, 121.0)));
        assert!(!outage(tc, "llm-error", "", (91.0, 95.0)));
        assert!(!outage(tc, "timeout", "", (91.0, 95.0)));
        assert!(!explained_by_an_outage(
            tc,
            "not-stored",
            "",
            (91.0, 95.0),
            &[]
        ));
        // A model answer that restarted after the broker came back: the agent's and the prompt
        // service's documented errors, across the outage, and nothing else.
        let midway = "text-completion restarted its answer midway; ask again";
        let published = "text-completion restarted its answer after part of it was published; send the request again";
        assert!(outage(
            Kind::HttpAgent,
            "agent-error",
            midway,
            (60.0, 164.0)
        ));
        assert!(outage(
            Kind::BusPrompt,
            "llm-error",
            published,
            (85.0, 99.0)
        ));
        assert!(!outage(
            Kind::HttpAgent,
            "agent-error",
            midway,
            (120.0, 130.0)
        ));
        assert!(!outage(
            Kind::HttpAgent,
            "agent-error",
            "the tool failed",
            (60.0, 164.0)
        ));
        assert!(!outage(Kind::BusPrompt, "llm-error", midway, (85.0, 99.0)));
        assert!(!outage(tc, "agent-error", midway, (85.0, 99.0)));
    }

    #[test]
    fn only_a_text_completion_kill_explains_an_agent_whose_model_answer_restarted() {
        let midway = "text-completion restarted its answer midway; ask again";
        let kills = [
            (16.0, "text-completion-5".to_owned()),
            (40.0, "prompt-3".to_owned()),
        ];
        assert!(explained_by_a_kill(
            Kind::BusAgent,
            "agent-error",
            midway,
            (15.9, 16.8),
            &kills
        ));
        assert!(explained_by_a_kill(
            Kind::HttpAgent,
            "agent-error",
            midway,
            (14.0, 17.0),
            &kills
        ));
        // No text-completion kill while it ran (only a prompt one), another error, another kind.
        assert!(!explained_by_a_kill(
            Kind::BusAgent,
            "agent-error",
            midway,
            (39.0, 41.0),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::BusAgent,
            "agent-error",
            midway,
            (20.0, 21.0),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::BusAgent,
            "agent-error",
            "tool failed",
            (15.9, 16.8),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::BusAgent,
            "llm-error",
            midway,
            (15.9, 16.8),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::BusLlmStream,
            "agent-error",
            midway,
            (15.9, 16.8),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::BusAgent,
            "agent-error",
            midway,
            (15.9, 16.8),
            &[]
        ));
    }

    #[test]
    fn only_a_text_completion_kill_explains_a_prompt_whose_model_answer_restarted() {
        // Found in CI: a bus prompt jsonl request at 97.4-98.2 s while text-completion was killed.
        let published = "text-completion restarted its answer after part of it was published; \
                         send the request again";
        let kills = [
            (97.6, "text-completion-3".to_owned()),
            (40.0, "agent-2".to_owned()),
        ];
        assert!(explained_by_a_kill(
            Kind::BusPrompt,
            "llm-error",
            published,
            (97.4, 98.2),
            &kills
        ));
        assert!(explained_by_a_kill(
            Kind::HttpPrompt,
            "llm-error",
            published,
            (97.0, 99.0),
            &kills
        ));
        // Only an agent kill while it ran; the agent's message on a prompt; another error type;
        // the prompt's message on a text-completion request.
        assert!(!explained_by_a_kill(
            Kind::BusPrompt,
            "llm-error",
            published,
            (39.5, 41.0),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::BusPrompt,
            "llm-error",
            "text-completion restarted its answer midway; ask again",
            (97.4, 98.2),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::BusPrompt,
            "timeout",
            published,
            (97.4, 98.2),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::HttpLlmStream,
            "llm-error",
            published,
            (97.4, 98.2),
            &kills
        ));
        assert!(!explained_by_a_kill(
            Kind::HttpPrompt,
            "llm-error",
            "text-completion could not be reached: boom",
            (97.4, 98.2),
            &kills
        ));
    }

    #[test]
    fn the_drain_check_reads_in_flight_and_fails_on_a_missing_gauge() {
        let page = "# TYPE sluice_processor_in_flight_requests gauge\n\
                    sluice_processor_in_flight_requests{processor=\"a\"} 2\n\
                    sluice_processor_in_flight_requests{processor=\"b\"} 1\n";
        assert_eq!(in_flight_in(page), Some(3));
        let drained = "sluice_processor_in_flight_requests{processor=\"a\"} 0\n";
        assert_eq!(in_flight_in(drained), Some(0));
        // A renamed gauge (or a page from something else) is not a drained processor.
        let renamed = "sluice_processor_requests_in_flight{processor=\"a\"} 0\n";
        assert_eq!(in_flight_in(renamed), None);
        assert_eq!(in_flight_in(""), None);
        // An unreadable value is not 0 either.
        let garbled = "sluice_processor_in_flight_requests{processor=\"a\"} many\n";
        assert_eq!(in_flight_in(garbled), None);
    }
}
