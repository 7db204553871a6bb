//! sluice benchmarks. Figures are written to `bench/results/` and spliced into the docs
//! between `<!-- bench:NAME -->` markers; nothing here asserts on time.
//!
//! Every figure is reported beside a baseline measured in the same run, because these
//! machines are noisy: absolute numbers move from run to run, ratios much less.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod loss;
mod pacing;
mod prompt;

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::{Parser, Subcommand};
use futures::StreamExt;
use hdrhistogram::Histogram;
use pulsar::{Pulsar, TokioExecutor, message::proto::command_subscribe::SubType};
use sluice_runtime::client::Received;
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, EchoHandler, RunningProcessor, TextClient, echo_config, free_port, text_client,
    unique_topic,
};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(about = "sluice benchmarks (results to bench/results and the docs' tables)")]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
    /// Where result files go.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// The documentation directory whose Markdown pages hold the results tables between
    /// `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` markers (skipped if missing).
    #[arg(long, default_value = "docs")]
    docs: PathBuf,
}

#[derive(Subcommand)]
enum Scenario {
    /// Text completion: time-to-first-token overhead, concurrent slow streams and RSS of a
    /// `sluice text-completion` process, tokens/s forwarded; against the fake OpenAI server.
    TextCompletion {
        /// Requests for the time-to-first-token comparison.
        #[arg(long, default_value_t = 500)]
        requests: u64,
        /// Concurrent slow-stream levels to try.
        #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
        streams: Vec<u64>,
    },
    /// The prompt jsonl path: a line's last token to its object record, objects/s; against
    /// text-completion called directly.
    Prompt {
        /// Answers (of 20 lines each) for the latency comparison.
        #[arg(long, default_value_t = 50)]
        requests: u64,
        /// Lines per answer for the throughput measure.
        #[arg(long, default_value_t = 200)]
        objects: u64,
    },
    /// The gateway: time to first token over HTTP through `sluice gateway`, the broker and a
    /// `sluice text-completion` process vs the fake provider called directly; requests/s at
    /// several concurrent HTTP streams.
    Gateway {
        /// Requests for the time-to-first-token comparison.
        #[arg(long, default_value_t = 500)]
        requests: u64,
        /// Concurrent HTTP stream levels for requests/s.
        #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
        concurrency: Vec<u64>,
        /// Requests per throughput level (a tenth of it at concurrency 1).
        #[arg(long, default_value_t = 5000)]
        throughput_requests: u64,
    },
    /// The loss model of TrustGraph's topic mapping: 51-record streams from a `sluice
    /// text-completion` process at several loads and with a stalled client, on non-persistent
    /// and on durable topics; what is lost, and how soon the client ends a request that lost
    /// records.
    Loss {
        /// Concurrent callers (and the processor's concurrency) per level.
        #[arg(long, value_delimiter = ',', default_value = "64,256,512")]
        concurrency: Vec<u64>,
        /// Requests per caller at each level.
        #[arg(long, default_value_t = 4)]
        per_caller: u64,
        /// How long the stalled client's process stops (seconds).
        #[arg(long, default_value_t = 3)]
        stall_secs: u64,
    },
    /// Pacing on TrustGraph's mapping (issue #28): a `sluice text-completion` process read by
    /// TrustGraph's own Python client, unpaced and paced, at each concurrency. Needs
    /// TG_FLOW_VENV (bench/run.sh sets it).
    Pacing {
        /// Concurrent callers (and the processor's concurrency) per level.
        #[arg(long, value_delimiter = ',', default_value = "64,512")]
        concurrency: Vec<u64>,
        /// Requests per caller at each level.
        #[arg(long, default_value_t = 2)]
        per_caller: u64,
    },
    /// The soak under chaos (issue #13.4): every processor kind as `sluice` processes on a
    /// broker of its own, mixed traffic, a replica killed every ~20 s, the broker restarted every
    /// 5 minutes, provider faults. Needs `target/release/sluice` next to this binary.
    Soak {
        /// How long traffic runs (minutes).
        #[arg(long, default_value_t = 30)]
        minutes: u64,
        /// Concurrent callers.
        #[arg(long, default_value_t = 12)]
        callers: usize,
        /// Seconds between broker restarts (on the cluster: between faults, each counted
        /// from the repair of the last; default 120 there). Other than 300 on the soak's own
        /// broker, the figures go to soak-restarts.md / soak-restarts-rss.csv and the docs'
        /// `soak-restarts` block, leaving the standard run's alone.
        #[arg(long, alias = "fault-every-secs")]
        restart_every_secs: Option<u64>,
        /// Run on the secured cluster (`deploy/pulsar/cluster.sh`, its `env` exported; run.sh
        /// starts it) with its faults: namespace unloads, broker and bookie SIGKILLs, broker
        /// restarts. Figures in soak-cluster.md / soak-cluster-rss.csv and the docs'
        /// `soak-cluster` block.
        #[arg(long)]
        cluster: bool,
    },
    /// The foundation: raw pulsar-rs round trip vs sluice runtime + client, throughput.
    Foundation {
        /// Sequential round trips per latency measurement.
        #[arg(long, default_value_t = 2000)]
        round_trips: u64,
        /// Requests per throughput measurement.
        #[arg(long, default_value_t = 20_000)]
        requests: u64,
    },
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).unwrap()
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// A table row: `label`, then the p50 and p99 of `h` (microseconds) in milliseconds.
fn quantile_row(md: &mut String, label: &str, h: &Histogram<u64>) {
    let _ = writeln!(md, "| {label} | {:.2} | {:.2} |", ms(h, 0.5), ms(h, 0.99));
}

/// Raw pulsar-rs: publish on A; a responder consumes A and republishes on B; receive on B.
/// `split` gives consuming and producing their own clients (own TCP connections).
struct RawPair {
    produce_a: pulsar::Producer<TokioExecutor>,
    consume_b: pulsar::Consumer<Vec<u8>, TokioExecutor>,
    stop: CancellationToken,
    responder: tokio::task::JoinHandle<()>,
}

impl RawPair {
    async fn start(url: &str, split: bool) -> Self {
        let client = || async { Pulsar::builder(url, TokioExecutor).build().await.unwrap() };
        let (a, b) = (unique_topic("raw-a"), unique_topic("raw-b"));
        let responder_consume = client().await;
        let responder_produce = if split {
            client().await
        } else {
            responder_consume.clone()
        };
        let mut consume_a = responder_consume
            .consumer()
            .with_topic(&a)
            .with_subscription("responder")
            .with_subscription_type(SubType::Shared)
            .build::<Vec<u8>>()
            .await
            .unwrap();
        let mut produce_b = responder_produce
            .producer()
            .with_topic(&b)
            .build()
            .await
            .unwrap();
        let stop = CancellationToken::new();
        let responder_stop = stop.clone();
        let responder = tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    () = responder_stop.cancelled() => break,
                    m = consume_a.next() => m,
                };
                let Some(Ok(m)) = msg else { break };
                consume_a.ack(&m).await.unwrap();
                let receipt = produce_b
                    .send_non_blocking(m.payload.data.clone())
                    .await
                    .unwrap();
                // Await the receipt, as sluice does before acking a request's stream.
                receipt.await.unwrap();
            }
        });
        let caller_consume = client().await;
        let caller_produce = if split {
            client().await
        } else {
            caller_consume.clone()
        };
        let consume_b = caller_consume
            .consumer()
            .with_topic(&b)
            .with_subscription("caller")
            .with_subscription_type(SubType::Exclusive)
            .build::<Vec<u8>>()
            .await
            .unwrap();
        let produce_a = caller_produce
            .producer()
            .with_topic(&a)
            .build()
            .await
            .unwrap();
        Self {
            produce_a,
            consume_b,
            stop,
            responder,
        }
    }

    async fn batch(&mut self, n: u64, h: &mut Histogram<u64>) {
        let payload = br#"{"system":"","prompt":"ping","streaming":false}"#.to_vec();
        for _ in 0..n {
            let t0 = Instant::now();
            let _receipt = self
                .produce_a
                .send_non_blocking(payload.clone())
                .await
                .unwrap();
            let m = self.consume_b.next().await.unwrap().unwrap();
            self.consume_b.ack(&m).await.unwrap();
            h.record(t0.elapsed().as_micros() as u64).unwrap();
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        let _ = self.responder.await;
    }
}

struct Sluice {
    client: Arc<TextClient>,
    processor: RunningProcessor,
}

async fn start_sluice(broker: &Broker, concurrency: usize) -> Sluice {
    let (req, resp) = (unique_topic("bench-req"), unique_topic("bench-resp"));
    let config = echo_config(&req, &resp, concurrency);
    let processor = RunningProcessor::start(broker.bus().await, config, EchoHandler).await;
    let client = Arc::new(text_client(broker.bus().await, &req, &resp).await);
    Sluice { client, processor }
}

impl Sluice {
    async fn stop(self) {
        self.client.close().await;
        self.processor.stop().await;
    }
}

fn ping(streaming: bool, system: &str) -> TextCompletionRequest {
    TextCompletionRequest {
        system: system.into(),
        prompt: "ping".into(),
        streaming,
        ..Default::default()
    }
}

/// Sequential sluice round trips on an already running processor + client.
async fn sluice_batch(s: &Sluice, n: u64, h: &mut Histogram<u64>) {
    let req = ping(false, "");
    for _ in 0..n {
        let t0 = Instant::now();
        let records = s.client.call(&req).await.unwrap();
        assert_eq!(records.len(), 1);
        h.record(t0.elapsed().as_micros() as u64).unwrap();
    }
}

/// Requests per second with `callers` concurrent callers, and records per second.
async fn throughput(broker: &Broker, callers: u64, total: u64, system: &str) -> (f64, f64) {
    let s = start_sluice(broker, 512).await;
    let streaming = !system.is_empty();
    let remaining = Arc::new(AtomicU64::new(total));
    let records = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..callers)
        .map(|_| {
            let (client, remaining, records) =
                (s.client.clone(), remaining.clone(), records.clone());
            let req = ping(streaming, system);
            tokio::spawn(async move {
                while remaining
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                    .is_ok()
                {
                    let mut stream = client.request(&req).await.unwrap();
                    while let Some(item) = stream.next().await {
                        if let Received::Record(r) = item.unwrap() {
                            assert!(r.error.is_none());
                            records.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    s.stop().await;
    (
        total as f64 / secs,
        records.load(Ordering::Relaxed) as f64 / secs,
    )
}

/// Replaces the table between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in the one
/// Markdown page under `docs` (at any depth) that has them.
fn splice(docs: &Path, name: &str, table: &str) {
    // The docs test checks the pages against this list: a table missing from it would go
    // unchecked.
    assert!(
        sluice_tests::BENCH_TABLES.contains(&name),
        "bench table {name:?} is not in sluice_tests::BENCH_TABLES"
    );
    let (start, end) = (
        format!("<!-- bench:{name} -->"),
        format!("<!-- /bench:{name} -->"),
    );
    let mut dirs = vec![docs.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for page in entries.filter_map(Result::ok).map(|e| e.path()) {
            if page.is_dir() {
                dirs.push(page);
                continue;
            }
            if page.extension().is_none_or(|x| x != "md") {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&page) else {
                continue;
            };
            if let (Some(a), Some(b)) = (text.find(&start), text.find(&end)) {
                let spliced = format!("{}{start}\n{table}{}", &text[..a], &text[b..]);
                std::fs::write(&page, spliced).unwrap();
                eprintln!("results table spliced into {}", page.display());
                return;
            }
        }
    }
    eprintln!(
        "no page under {} has {start} … {end} markers; not spliced",
        docs.display()
    );
}

/// Peak and current resident memory of a process, in MiB, from /proc.
fn rss_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Whether a scenario's topics are stored by the broker (sluice's default) or not
/// (`--topic-mapping trustgraph` for requests and responses).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Durability {
    Persistent,
    NonPersistent,
}

/// A `sluice text-completion` process against the fake provider, with `concurrency`, and a
/// client of it.
async fn spawn_text_completion(
    broker: &Broker,
    fake: &sluice_tests::fake_openai::FakeOpenAi,
    model: &str,
    concurrency: u64,
    durability: Durability,
) -> (tokio::process::Child, TextClient) {
    let (child, req, resp) =
        spawn_text_completion_process(broker, fake, model, concurrency, durability).await;
    (child, text_client(broker.bus().await, &req, &resp).await)
}

/// A `sluice text-completion` process against the fake provider, with `concurrency`, on fresh
/// topics; returns it with its request and response topics.
async fn spawn_text_completion_process(
    broker: &Broker,
    fake: &sluice_tests::fake_openai::FakeOpenAi,
    model: &str,
    concurrency: u64,
    durability: Durability,
) -> (tokio::process::Child, String, String) {
    let topic = |name: &str| match durability {
        Durability::Persistent => unique_topic(name),
        Durability::NonPersistent => {
            unique_topic(name).replacen("persistent://", "non-persistent://", 1)
        }
    };
    let (req, resp) = (topic("tcb-req"), topic("tcb-resp"));
    // Its own cancel topic too: the default one lives in a namespace (`tg/notify`) that this
    // broker may not have, and the processor subscribes to it at start-up.
    let cancel = topic("tcb-cancel");
    let exe = std::env::current_exe().unwrap().with_file_name("sluice");
    let port = free_port();
    let mut child = tokio::process::Command::new(exe)
        .args([
            "text-completion",
            "--provider",
            "openai-compatible",
            "--base-url",
            &fake.base_url(),
            "--model",
            model,
            "--pulsar-url",
            &broker.url,
            "--request-topic",
            &req,
            "--response-topic",
            &resp,
            "--cancel-topic",
            &cancel,
            // Unpaced on non-persistent topics too: these figures are of every record on the
            // wire (the loss bench needs the drops pacing avoids); pacing is measured by
            // services/cli/tests/trustgraph_pacing.rs.
            "--response-pacing",
            "off",
            "--concurrency",
            &concurrency.to_string(),
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
            "--chunk-timeout-secs",
            "120",
        ])
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("build the sluice binary first: cargo build --release -p sluice-cli");
    wait_ready(&mut child, port).await;
    (child, req, resp)
}

/// Waits until a `sluice` process answers `/readyz` on `port`; fails if it exits first
/// (its own error is on stderr), instead of waiting forever.
async fn wait_ready(child: &mut tokio::process::Child, port: u16) {
    let ready = format!("http://127.0.0.1:{port}/readyz");
    if let Err(e) = sluice_tests::process::ready(child, &ready, Duration::from_secs(120)).await {
        panic!("the sluice process {e}; see its error above");
    }
}

fn stream_req() -> TextCompletionRequest {
    TextCompletionRequest {
        prompt: "bench".into(),
        streaming: true,
        ..Default::default()
    }
}

async fn text_completion_bench(broker: &Broker, requests: u64, levels: &[u64]) -> String {
    use sluice_text_completion::provider::Provider;
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: Pulsar standalone on loopback, fake OpenAI server over HTTP.\n",
        provenance()
    );

    // (1) Time to first token: the provider called directly vs through client, broker and
    // processor (a separate `sluice text-completion` process), interleaved.
    let model = "tokens-5-2";
    let direct = sluice_text_completion::providers::openai::OpenAiProvider::new(
        sluice_text_completion::providers::openai::OpenAiConfig::new(
            sluice_text_completion::providers::openai::Dialect::Compatible,
            fake.base_url(),
            model,
        ),
    )
    .unwrap();
    // SLUICE_BENCH_IN_PROCESS=1 runs the processor inside this process instead (a diagnostic:
    // it separates the processor's own cost from the cost of a second process).
    let in_process = std::env::var("SLUICE_BENCH_IN_PROCESS").is_ok();
    let mut local = None;
    let (mut child, client) = if in_process {
        let (req, resp) = (unique_topic("tcb-req"), unique_topic("tcb-resp"));
        let provider = Arc::new(
            sluice_text_completion::providers::openai::OpenAiProvider::new(
                sluice_text_completion::providers::openai::OpenAiConfig::new(
                    sluice_text_completion::providers::openai::Dialect::Compatible,
                    fake.base_url(),
                    model,
                ),
            )
            .unwrap(),
        );
        let telemetry = sluice_runtime::telemetry::Telemetry::new().unwrap();
        let service = sluice_text_completion::handler::TextCompletionService::new(
            provider,
            Default::default(),
            sluice_text_completion::metrics::LlmMetrics::register(&telemetry.registry).unwrap(),
        );
        local = Some(
            RunningProcessor::start(broker.bus().await, echo_config(&req, &resp, 64), service)
                .await,
        );
        let child = tokio::process::Command::new("true").spawn().unwrap();
        (child, text_client(broker.bus().await, &req, &resp).await)
    } else {
        spawn_text_completion(broker, &fake, model, 64, Durability::Persistent).await
    };
    // The same path on non-persistent topics: what the broker's storage adds to each hop.
    let (mut np_child, np_client) =
        spawn_text_completion(broker, &fake, model, 64, Durability::NonPersistent).await;
    // Two raw pulsar-rs hops (no sluice code), each after the broker sat idle as it does in
    // the sluice path while the provider thinks: the floor under the sluice figure.
    let mut floor_pair = RawPair::start(&broker.url, true).await;
    let (mut h_direct, mut h_sluice, mut h_np, mut h_floor) = (hist(), hist(), hist(), hist());
    for i in 0..requests + 50 {
        let t0 = Instant::now();
        let mut s = direct.generate_stream(&stream_req()).await.unwrap();
        let _ = s.next().await;
        let d = t0.elapsed();
        while s.next().await.is_some() {}
        let t0 = Instant::now();
        let mut st = client.request(&stream_req()).await.unwrap();
        let _ = st.next().await;
        let v = t0.elapsed();
        while st.next().await.is_some() {}
        let t0 = Instant::now();
        let mut st = np_client.request(&stream_req()).await.unwrap();
        let _ = st.next().await;
        let np = t0.elapsed();
        while st.next().await.is_some() {}
        // The provider's first token comes ~3 ms after the request reaches the processor.
        tokio::time::sleep(Duration::from_millis(3)).await;
        let mut floor = hist();
        floor_pair.batch(1, &mut floor).await;
        if i >= 50 {
            h_direct.record(d.as_micros() as u64).unwrap();
            h_sluice.record(v.as_micros() as u64).unwrap();
            h_np.record(np.as_micros() as u64).unwrap();
            h_floor.add(&floor).unwrap();
        }
    }
    client.close().await;
    np_client.close().await;
    floor_pair.stop().await;
    let _ = child.kill().await;
    let _ = np_child.kill().await;
    if let Some(p) = local {
        p.stop().await;
    }
    let _ = writeln!(
        md,
        "| time to first token | p50 ms | p99 ms |\n|---|---|---|"
    );
    quantile_row(&mut md, "fake provider called directly", &h_direct);
    quantile_row(
        &mut md,
        "client → broker → `sluice text-completion` → provider → broker → client",
        &h_sluice,
    );
    let _ = writeln!(
        md,
        "| overhead sluice adds (difference) | {:.2} | {:.2} |",
        ms(&h_sluice, 0.5) - ms(&h_direct, 0.5),
        ms(&h_sluice, 0.99) - ms(&h_direct, 0.99)
    );
    quantile_row(
        &mut md,
        "of which two broker hops: raw pulsar-rs round trip after 3 ms idle, no sluice code",
        &h_floor,
    );
    quantile_row(&mut md, "same sluice path on non-persistent topics", &h_np);
    let _ = writeln!(
        md,
        "| overhead on non-persistent topics (difference) | {:.2} | {:.2} |\n",
        ms(&h_np, 0.5) - ms(&h_direct, 0.5),
        ms(&h_np, 0.99) - ms(&h_direct, 0.99)
    );

    // (2) Concurrent slow streams held by one processor process.
    let _ = writeln!(
        md,
        "| concurrent slow streams (one `sluice text-completion` process) | completed | wall s | processor peak RSS MiB |\n|---|---|---|---|"
    );
    for &n in levels {
        // Each stream: 5 tokens, 2 s apart (10 s), so the broker carries n/2 records/s.
        let model = "tokens-5-2000";
        let (mut child, client) =
            spawn_text_completion(broker, &fake, model, n, Durability::Persistent).await;
        let client = Arc::new(client);
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move {
                    let mut s = client.request(&stream_req()).await.ok()?;
                    let mut last = None;
                    while let Some(item) = s.next().await {
                        match item {
                            Ok(Received::Record(r)) => last = Some(r),
                            Ok(_) => {}
                            Err(_) => return None,
                        }
                    }
                    last.filter(|r| r.end_of_stream && r.error.is_none())
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            if let Ok(Some(_)) = t.await {
                ok += 1;
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let (peak, _) = rss_mib(child.id().unwrap_or(0));
        client.close().await;
        let _ = child.kill().await;
        let _ = writeln!(md, "| {n} | {ok} | {secs:.1} | {peak:.0} |");
    }

    // (3) Tokens forwarded per second: 100-token streams, no delay, 32 at a time.
    let (mut child, client) =
        spawn_text_completion(broker, &fake, "tokens-100-0", 64, Durability::Persistent).await;
    let client = Arc::new(client);
    let tokens = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (client, tokens) = (client.clone(), tokens.clone());
            tokio::spawn(async move {
                for _ in 0..20 {
                    let mut s = client.request(&stream_req()).await.unwrap();
                    while let Some(item) = s.next().await {
                        if let Ok(Received::Record(r)) = item
                            && !r.response.is_empty()
                        {
                            tokens.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let rate = tokens.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64();
    client.close().await;
    let _ = child.kill().await;
    let _ = writeln!(
        md,
        "\n| tokens forwarded (32 concurrent 100-token streams) | {rate:.0} tokens/s |\n|---|---|"
    );
    md
}

/// A `sluice` subcommand as a child process: its stderr passes through, its stdout is piped
/// (the gateway prints its address there).
fn sluice_process(args: &[&str]) -> tokio::process::Child {
    let exe = std::env::current_exe().unwrap().with_file_name("sluice");
    tokio::process::Command::new(exe)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("build the sluice binary first: cargo build --release -p sluice-cli")
}

/// Stops a child with SIGTERM so that it drains and deletes its response subscription, as
/// a deployment would; SIGKILL if it has not exited after 10 s.
async fn terminate(mut child: tokio::process::Child) {
    sluice_tests::process::terminate(&mut child, Duration::from_secs(10)).await;
}

/// `sluice text-completion` on its default topics (the ones `sluice gateway` routes to),
/// answering with the fake's `model`.
async fn gateway_processor(broker: &Broker, fake_url: &str, model: &str) -> tokio::process::Child {
    let port = free_port();
    let mut child = sluice_process(&[
        "text-completion",
        "--provider",
        "openai-compatible",
        "--base-url",
        fake_url,
        "--model",
        model,
        "--pulsar-url",
        &broker.url,
        "--pulsar-admin-url",
        &broker.admin_url,
        "--concurrency",
        "512",
        "--metrics-addr",
        &format!("127.0.0.1:{port}"),
    ]);
    wait_ready(&mut child, port).await;
    child
}

/// POSTs one NDJSON request to the gateway and reads its stream to the end. Returns the time
/// to the first `token` line and whether the stream ended with a successful `done`.
async fn gateway_call(http: &reqwest::Client, url: &str) -> (Option<Duration>, bool) {
    let t0 = Instant::now();
    let resp = http
        .post(url)
        .header("accept", "application/x-ndjson")
        .json(&serde_json::json!({"prompt": "bench"}))
        .send()
        .await
        .unwrap();
    assert!(
        resp.status().is_success(),
        "gateway answered {}",
        resp.status()
    );
    let mut body = resp.bytes_stream();
    let (mut buf, mut first, mut ok) = (Vec::new(), None, false);
    while let Some(bytes) = body.next().await {
        buf.extend_from_slice(&bytes.unwrap());
        while let Some(end) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            let event: serde_json::Value = serde_json::from_slice(&line).unwrap();
            match event["type"].as_str() {
                Some("token") if first.is_none() => first = Some(t0.elapsed()),
                Some("done") => ok = event["reason"] == "success",
                _ => {}
            }
        }
    }
    (first, ok)
}

/// POSTs one streaming request to the gateway's OpenAI route and reads its SSE to the end.
/// Returns the time to the first chunk carrying content and whether `[DONE]` arrived.
async fn openai_route_call(
    http: &reqwest::Client,
    url: &str,
    model: &str,
) -> (Option<Duration>, bool) {
    let t0 = Instant::now();
    let resp = http
        .post(url)
        .json(&serde_json::json!({"model": model, "stream": true,
            "messages": [{"role": "user", "content": "bench"}]}))
        .send()
        .await
        .unwrap();
    assert!(
        resp.status().is_success(),
        "the OpenAI route answered {}",
        resp.status()
    );
    let mut body = resp.bytes_stream();
    let (mut buf, mut first, mut ok) = (Vec::new(), None, false);
    while let Some(bytes) = body.next().await {
        buf.extend_from_slice(&bytes.unwrap());
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            // The role chunk carries `"content":""`; the first token is the first non-empty one.
            if first.is_none()
                && event.contains("\"content\"")
                && !event.contains("\"content\":\"\"")
            {
                first = Some(t0.elapsed());
            }
            ok |= event.contains("[DONE]");
        }
    }
    (first, ok)
}

/// Calls the fake OpenAI server directly, streaming, as a provider SDK would. Returns the time
/// to the first SSE event carrying content and whether `[DONE]` arrived.
async fn direct_call(http: &reqwest::Client, url: &str, model: &str) -> (Option<Duration>, bool) {
    let t0 = Instant::now();
    let resp = http
        .post(url)
        .json(&serde_json::json!({"model": model, "stream": true,
            "messages": [{"role": "user", "content": "bench"}]}))
        .send()
        .await
        .unwrap();
    assert!(
        resp.status().is_success(),
        "fake answered {}",
        resp.status()
    );
    let mut body = resp.bytes_stream();
    let (mut buf, mut first, mut ok) = (Vec::new(), None, false);
    while let Some(bytes) = body.next().await {
        buf.extend_from_slice(&bytes.unwrap());
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            if first.is_none() && event.contains("\"content\"") {
                first = Some(t0.elapsed());
            }
            ok |= event.contains("[DONE]");
        }
    }
    (first, ok)
}

/// Requests per second through the gateway with `streams` concurrent HTTP streams, and how
/// many of the `total` requests ended with a successful `done`.
async fn gateway_throughput(url: &str, streams: u64, total: u64) -> (f64, u64) {
    let http = reqwest::Client::new();
    let remaining = Arc::new(AtomicU64::new(total));
    let succeeded = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..streams)
        .map(|_| {
            let (http, url, remaining, succeeded) = (
                http.clone(),
                url.to_owned(),
                remaining.clone(),
                succeeded.clone(),
            );
            tokio::spawn(async move {
                while remaining
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                    .is_ok()
                {
                    if gateway_call(&http, &url).await.1 {
                        succeeded.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    (
        total as f64 / t0.elapsed().as_secs_f64(),
        succeeded.load(Ordering::Relaxed),
    )
}

async fn gateway_bench(
    broker: &Broker,
    requests: u64,
    levels: &[u64],
    throughput_requests: u64,
) -> (String, serde_json::Value) {
    sluice_runtime::install_crypto_provider();
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let fake_url = format!("{}/v1/chat/completions", fake.base_url());
    // The gateway as deployed: its own process on the default topics, where the processor
    // process answers.
    let metrics_port = free_port();
    let mut gateway = sluice_process(&[
        "gateway",
        "--services",
        "text-completion",
        "--listen",
        "127.0.0.1:0",
        "--metrics-addr",
        &format!("127.0.0.1:{metrics_port}"),
        "--pulsar-url",
        &broker.url,
        "--pulsar-admin-url",
        &broker.admin_url,
    ]);
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        gateway.stdout.take().unwrap(),
    ));
    let addr = loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the gateway exited before it listened; see its error above");
        if let Some(addr) = line.strip_prefix("gateway listening on ") {
            break addr.trim().to_owned();
        }
    };
    wait_ready(&mut gateway, metrics_port).await;
    let url = format!("http://{addr}/api/v1/text-completion");
    let openai_url = format!("http://{addr}/v1/chat/completions");

    // (1) Time to first token, interleaved: the fake called directly vs through the gateway.
    // The fake's first token comes 2 ms after the request, as in the text-completion scenario.
    let model = "tokens-5-2";
    let processor = gateway_processor(broker, &fake.base_url(), model).await;
    let http = reqwest::Client::new();
    let (mut h_direct, mut h_gateway, mut h_openai) = (hist(), hist(), hist());
    for i in 0..requests + 50 {
        let (d, d_ok) = direct_call(&http, &fake_url, model).await;
        let (g, g_ok) = gateway_call(&http, &url).await;
        let (o, o_ok) = openai_route_call(&http, &openai_url, model).await;
        assert!(d_ok && g_ok && o_ok, "a stream did not complete");
        if i >= 50 {
            h_direct.record(d.unwrap().as_micros() as u64).unwrap();
            h_gateway.record(g.unwrap().as_micros() as u64).unwrap();
            h_openai.record(o.unwrap().as_micros() as u64).unwrap();
        }
    }
    terminate(processor).await;

    // (2) Requests/s with short streams (5 tokens, no delay) at each concurrency.
    let processor = gateway_processor(broker, &fake.base_url(), "tokens-5-0").await;
    // Warm-up, unrecorded: the broker's JIT and the connection pools.
    let _ = gateway_throughput(&url, 64, throughput_requests / 5).await;
    let mut rps = Vec::new();
    for &streams in levels {
        let n = if streams == 1 {
            throughput_requests / 10
        } else {
            throughput_requests
        };
        eprintln!("gateway throughput with {streams} concurrent streams …");
        let (r, ok) = gateway_throughput(&url, streams, n).await;
        rps.push((streams, r, ok, n));
    }
    terminate(processor).await;
    terminate(gateway).await;

    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: Pulsar standalone on loopback, fake OpenAI server over HTTP; `sluice gateway` and `sluice text-completion` as processes.\n",
        provenance()
    );
    let (d50, d99, g50, g99) = (
        ms(&h_direct, 0.5),
        ms(&h_direct, 0.99),
        ms(&h_gateway, 0.5),
        ms(&h_gateway, 0.99),
    );
    let _ = writeln!(
        md,
        "| time to first token (NDJSON `token` line vs first SSE content event) | p50 ms | p99 ms |\n|---|---|---|"
    );
    let _ = writeln!(
        md,
        "| fake provider called directly (reqwest, streaming) | {d50:.2} | {d99:.2} |"
    );
    let _ = writeln!(
        md,
        "| HTTP → `sluice gateway` → broker → `sluice text-completion` → provider → broker → gateway → HTTP | {g50:.2} | {g99:.2} |"
    );
    let (o50, o99) = (ms(&h_openai, 0.5), ms(&h_openai, 0.99));
    let _ = writeln!(
        md,
        "| the same through the OpenAI route (`POST /v1/chat/completions`, SSE chunks) | {o50:.2} | {o99:.2} |"
    );
    let _ = writeln!(
        md,
        "| ratio (gateway / direct) | {:.2}x | {:.2}x |",
        g50 / d50,
        g99 / d99
    );
    let _ = writeln!(
        md,
        "| ratio (OpenAI route / direct) | {:.2}x | {:.2}x |",
        o50 / d50,
        o99 / d99
    );
    let _ = writeln!(
        md,
        "| ratio (OpenAI route / NDJSON events route) | {:.2}x | {:.2}x |",
        o50 / g50,
        o99 / g99
    );
    let _ = writeln!(
        md,
        "| overhead (difference) | {:.2} | {:.2} |\n",
        g50 - d50,
        g99 - d99
    );
    let _ = writeln!(
        md,
        "| concurrent HTTP streams (5 tokens each, no delay) | requests/s | completed |\n|---|---|---|"
    );
    for (streams, r, ok, n) in &rps {
        let _ = writeln!(md, "| {streams} | {r:.0} | {ok}/{n} |");
    }
    let json = serde_json::json!({
        "ttft_ms": {
            "direct": {"p50": d50, "p99": d99},
            "gateway": {"p50": g50, "p99": g99},
            "openai_route": {"p50": o50, "p99": o99},
            "openai_route_vs_gateway": {"p50": o50 / g50, "p99": o99 / g99},
            "ratio": {"p50": g50 / d50, "p99": g99 / d99},
            "overhead": {"p50": g50 - d50, "p99": g99 - d99},
        },
        "requests_per_s": rps.iter().map(|(c, r, ok, n)| (c.to_string(),
            serde_json::json!({"requests_per_s": r, "completed": ok, "requests": n})))
            .collect::<std::collections::BTreeMap<_, _>>(),
    });
    (md, json)
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let broker = Broker::from_env().await;
    std::fs::create_dir_all(&cli.out).unwrap();
    match cli.scenario {
        Scenario::TextCompletion { requests, streams } => {
            let md = text_completion_bench(&broker, requests, &streams).await;
            std::fs::write(cli.out.join("text-completion.md"), &md).unwrap();
            splice(&cli.docs, "text-completion", &md);
            println!("{md}");
        }
        Scenario::Prompt { requests, objects } => {
            let (md, json) = prompt::bench(&broker, requests, objects).await;
            std::fs::write(cli.out.join("prompt.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("prompt.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "prompt", &md);
            println!("{md}");
        }
        Scenario::Gateway {
            requests,
            concurrency,
            throughput_requests,
        } => {
            let (md, json) =
                gateway_bench(&broker, requests, &concurrency, throughput_requests).await;
            std::fs::write(cli.out.join("gateway.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("gateway.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "gateway", &md);
            println!("{md}");
        }
        Scenario::Loss {
            concurrency,
            per_caller,
            stall_secs,
        } => {
            let (md, json) = loss::bench(&broker, &concurrency, per_caller, stall_secs).await;
            std::fs::write(cli.out.join("loss.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("loss.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "loss", &md);
            println!("{md}");
        }
        Scenario::Pacing {
            concurrency,
            per_caller,
        } => {
            let (md, json) = pacing::bench(&broker, &concurrency, per_caller).await;
            std::fs::write(cli.out.join("pacing.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("pacing.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "pacing", &md);
            println!("{md}");
        }
        Scenario::Soak {
            minutes,
            callers,
            restart_every_secs,
            cluster,
        } => {
            let exe = std::env::current_exe().unwrap();
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let mut config = sluice_tests::soak::SoakConfig::new(
                exe.with_file_name("sluice"),
                root.join("deploy/pulsar/pulsar.sh"),
                Duration::from_secs(minutes * 60),
            );
            config.callers = callers;
            let every = restart_every_secs.unwrap_or(if cluster { 120 } else { 300 });
            config.fault_every = Duration::from_secs(every.max(30));
            let name = if cluster {
                config.cluster = Some(sluice_tests::cluster::Cluster::from_env().expect(
                    "no cluster: start it with deploy/pulsar/cluster.sh start and export its env",
                ));
                "soak-cluster"
            } else if every == 300 {
                "soak"
            } else {
                "soak-restarts"
            };
            // Not the test command's soak ports (6656), so both can run at once.
            config.broker_ports = (6657, 8087, 3188);
            let started = Instant::now();
            let report = sluice_tests::soak::run(config).await.unwrap();
            let md = format!(
                "{} ({:.0} min with set-up and drain).\n\n{}",
                provenance(),
                started.elapsed().as_secs_f64() / 60.0,
                report.markdown()
            );
            std::fs::write(cli.out.join(format!("{name}.md")), &md).unwrap();
            // The memory samples behind the RSS table, and the broker restarts, as CSV.
            let mut csv = String::from("process,seconds,rss_mib,heap_allocated_mib\n");
            for (name, series) in &report.rss_series {
                for (t, r, h) in series {
                    let _ = writeln!(csv, "{name},{t:.0},{r:.1},{h:.1}");
                }
            }
            for (t, fault) in report.broker_restart_at.iter().zip(&report.faults) {
                let _ = writeln!(csv, "fault {fault},{t:.0},,");
            }
            std::fs::write(cli.out.join(format!("{name}-rss.csv")), csv).unwrap();
            splice(&cli.docs, name, &md);
            println!("{md}");
            assert!(report.clean(), "the soak found problems");
        }
        Scenario::Foundation {
            round_trips,
            requests,
        } => {
            // The broker's JIT needs traffic before it settles; figures taken cold vary by
            // 2-3x from run to run. Warm it up first, unrecorded.
            eprintln!("warming up the broker …");
            let _ = throughput(&broker, 64, requests / 2, "").await;
            // The three set-ups run side by side and take turns in batches of 50, so that a
            // noisy moment on the machine hits each of them alike.
            eprintln!("round trips: raw pulsar-rs (stock and split) and sluice, interleaved …");
            let mut stock_pair = RawPair::start(&broker.url, false).await;
            let mut floor_pair = RawPair::start(&broker.url, true).await;
            let sluice_pair = start_sluice(&broker, 64).await;
            let (mut stock, mut floor, mut sluice) = (hist(), hist(), hist());
            // Warm-up, not recorded.
            floor_pair.batch(100, &mut hist()).await;
            sluice_batch(&sluice_pair, 100, &mut hist()).await;
            stock_pair.batch(20, &mut hist()).await;
            for round in 0..round_trips / 50 {
                floor_pair.batch(50, &mut floor).await;
                sluice_batch(&sluice_pair, 50, &mut sluice).await;
                // The stock client stalls ~40 ms per round trip; a tenth of the samples suffice.
                if round % 10 == 0 {
                    stock_pair.batch(50, &mut stock).await;
                }
            }
            stock_pair.stop().await;
            floor_pair.stop().await;
            sluice_pair.stop().await;
            let mut rps = Vec::new();
            for callers in [1u64, 64, 512] {
                let n = if callers == 1 {
                    requests / 10
                } else {
                    requests
                };
                eprintln!("throughput with {callers} callers …");
                rps.push((callers, throughput(&broker, callers, n, "").await.0));
            }
            eprintln!("streaming 100 records per request …");
            let (stream_rps, records_per_s) =
                throughput(&broker, 16, requests / 20, "records=100").await;

            let mut md = String::new();
            let _ = writeln!(
                md,
                "{}: Pulsar {} standalone on loopback.\n",
                provenance(),
                std::env::var("SLUICE_PULSAR_VERSION").unwrap_or_else(|_| "4.0.8".into())
            );
            let _ = writeln!(
                md,
                "| round trip (publish → responder → receive) | p50 ms | p99 ms | p50 vs floor |"
            );
            let _ = writeln!(md, "|---|---|---|---|");
            let floor_p50 = ms(&floor, 0.5);
            for (name, h) in [
                ("raw pulsar-rs, stock (one client per side)", &stock),
                (
                    "raw pulsar-rs, floor (separate consume/produce clients)",
                    &floor,
                ),
                ("sluice processor + client (echo handler)", &sluice),
            ] {
                let _ = writeln!(
                    md,
                    "| {name} | {:.2} | {:.2} | {:.2}x |",
                    ms(h, 0.5),
                    ms(h, 0.99),
                    ms(h, 0.5) / floor_p50
                );
            }
            let _ = writeln!(md, "\n| echo throughput | requests/s |");
            let _ = writeln!(md, "|---|---|");
            for (callers, r) in &rps {
                let _ = writeln!(md, "| {callers} concurrent callers | {r:.0} |");
            }
            let _ = writeln!(
                md,
                "| 16 callers, 100 streamed records per request | {stream_rps:.0} requests/s = {records_per_s:.0} records/s |"
            );
            let json = serde_json::json!({
                "round_trip_ms": {
                    "raw_stock": {"p50": ms(&stock, 0.5), "p99": ms(&stock, 0.99)},
                    "raw_floor": {"p50": floor_p50, "p99": ms(&floor, 0.99)},
                    "sluice": {"p50": ms(&sluice, 0.5), "p99": ms(&sluice, 0.99)},
                    "sluice_vs_floor_p50": ms(&sluice, 0.5) / floor_p50,
                },
                "requests_per_s": rps.iter().map(|(c, r)| (c.to_string(), *r)).collect::<std::collections::BTreeMap<_, _>>(),
                "streaming_100": {"requests_per_s": stream_rps, "records_per_s": records_per_s},
            });
            std::fs::write(cli.out.join("foundation.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("foundation.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "foundation", &md);
            println!("{md}");
        }
    }
}

/// How a results file was made, measured when it is written: the date, the commit (marked when
/// the work tree had changes), the cores this process may use, the build profile, and the
/// command line that reproduces it (`bench/run.sh` with this run's arguments). Every results
/// header starts with it, so a file says how it was made even when the next run is different.
pub(crate) fn provenance() -> String {
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    format!(
        "{} by `{}`",
        sluice_tests::measured_here(&["docs"]),
        command_line(std::env::args().skip(1), profile)
    )
}

/// `bash bench/run.sh` with the scenario's arguments (not `--out` and `--docs`, which
/// run.sh sets), prefixed with `BENCH_PROFILE=debug` for a debug build.
fn command_line(args: impl Iterator<Item = String>, profile: &str) -> String {
    let mut kept = Vec::new();
    let mut args = args.peekable();
    while let Some(a) = args.next() {
        if a == "--out" || a == "--docs" {
            args.next();
        } else if !(a.starts_with("--out=") || a.starts_with("--docs=")) {
            kept.push(a);
        }
    }
    let prefix = if profile == "debug" {
        "BENCH_PROFILE=debug "
    } else {
        ""
    };
    format!("{prefix}bash bench/run.sh {}", kept.join(" "))
        .trim_end()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::command_line;

    #[test]
    fn the_command_line_is_the_run_sh_call_that_reproduces_a_result() {
        let args = |a: &[&str]| {
            a.iter()
                .map(|s| (*s).to_owned())
                .collect::<Vec<_>>()
                .into_iter()
        };
        assert_eq!(
            command_line(
                args(&["--out", "bench/results", "--docs", "docs", "loss"]),
                "debug"
            ),
            "BENCH_PROFILE=debug bash bench/run.sh loss"
        );
        assert_eq!(
            command_line(
                args(&["--out=x", "foundation", "--round-trips", "500"]),
                "release"
            ),
            "bash bench/run.sh foundation --round-trips 500"
        );
    }
}
