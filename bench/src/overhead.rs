//! The overhead scenario (issue #27): what each gateway adds to the time to first token over
//! calling the provider directly, at several numbers of concurrent callers, with the same
//! fake provider and the same load driver, every target in the same run:
//!
//! - the fake provider called directly (the baseline every other row is measured against);
//! - `sluice serve` (the embedded default: gateway, processor and the in-process bus in one
//!   process);
//! - `sluice gateway` and `sluice text-completion` as processes over the broker (the durable
//!   mapping), beside a raw pulsar-rs round trip (the broker's own two hops) in the same run;
//! - LiteLLM's proxy (PyPI, the version `scripts/bench-venv.sh` pins) when `BENCH_VENV` names
//!   a venv that has it, and TensorZero's gateway when `TENSORZERO_GATEWAY` names its binary.
//!
//! Every target is driven by the same closed loop of reqwest callers in this process, which
//! also runs the fake; the targets' CPU time per request and memory are read from /proc.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::Path,
    sync::Arc,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use futures::StreamExt;
use hdrhistogram::Histogram;
use sluice_tests::{Broker, free_port};

use crate::{foundation::RawPair, procs::*, report::*};

/// The fake's behaviour: 20 one-word tokens, the first 50 ms after the request (a model's
/// time to first token), the rest `gap_ms` apart (1 ms by default: a provider far faster than
/// a person reads, which makes every token a record's worth of work).
fn fake_model(gap_ms: u64) -> String {
    format!("tokens-20-{gap_ms}-{FIRST_TOKEN_MS}")
}

/// The fake's time to first token, ms.
const FIRST_TOKEN_MS: u64 = 50;

/// Kills a process group when dropped: LiteLLM's supervisor spawns its workers, and killing
/// only the supervisor (what `kill_on_drop` does, on a panic or a stop that timed out) would
/// leave them serving.
struct GroupGuard(u32);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0)])
            .status();
    }
}

/// The scratch directories of the gateways this run configured.
fn temp_dirs() -> [std::path::PathBuf; 2] {
    let pid = std::process::id();
    [
        std::env::temp_dir().join(format!("sluice-bench-litellm-{pid}")),
        std::env::temp_dir().join(format!("sluice-bench-tensorzero-{pid}")),
    ]
}

/// One gateway under test: where callers send `POST /v1/chat/completions` and the processes
/// whose CPU time and memory are its cost.
struct Target {
    name: &'static str,
    url: String,
    /// The `model` callers name (LiteLLM and TensorZero map it onto the fake's).
    model: String,
    /// Root processes; their descendants are counted too (LiteLLM's workers).
    pids: Vec<u32>,
    children: Vec<tokio::process::Child>,
    /// Process groups killed when the target is dropped.
    groups: Vec<GroupGuard>,
    /// Idle resident memory per process (MiB) after start-up, before any request.
    idle: Vec<(String, f64)>,
    /// The broker's process, for a target that works through it (its CPU while this target
    /// is driven is counted as this target's).
    broker: Option<u32>,
}

/// What one target did at one level.
#[derive(Default)]
struct Level {
    ttft: Option<Histogram<u64>>,
    requests: u64,
    ok: u64,
    secs: f64,
    /// The target's processes' CPU time over the whole level (set after it).
    cpu_secs: f64,
    /// The bench's own process (driver and fake) while it drove this target.
    own_cpu_secs: f64,
    /// The broker's CPU time while this target was driven (only targets over the broker).
    broker_cpu_secs: f64,
}

impl Level {
    fn hist(&mut self) -> &mut Histogram<u64> {
        self.ttft.get_or_insert_with(hist)
    }
    fn q(&self, q: f64) -> f64 {
        self.ttft.as_ref().map_or(f64::NAN, |h| ms(h, q))
    }
    fn rps(&self) -> f64 {
        self.requests as f64 / self.secs
    }
}

/// Streams one chat completion and returns the time to the first chunk whose
/// `choices[0].delta.content` is a non-empty string (OpenAI's first chunk carries only the
/// role), and whether the stream ended with `[DONE]`. The JSON is parsed: servers differ in
/// spacing (LiteLLM writes `"content": ""`).
async fn sse_call(http: &reqwest::Client, url: &str, model: &str) -> (Option<Duration>, bool) {
    let t0 = Instant::now();
    let body = serde_json::json!({"model": model, "stream": true,
        "messages": [{"role": "user", "content": "bench"}]});
    let Ok(resp) = http
        .post(url)
        .bearer_auth("sk-bench")
        .json(&body)
        .send()
        .await
    else {
        return (None, false);
    };
    if !resp.status().is_success() {
        return (None, false);
    }
    let (mut first, mut done) = (None, false);
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    while let Some(Ok(bytes)) = stream.next().await {
        buf.extend_from_slice(&bytes);
        while let Some(end) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            let Some(data) = line.strip_prefix(b"data:") else {
                continue;
            };
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                done = true;
            } else if first.is_none()
                && let Ok(v) = serde_json::from_slice::<serde_json::Value>(data)
                && v["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|c| !c.is_empty())
            {
                first = Some(t0.elapsed());
            }
        }
    }
    (first, done && first.is_some())
}

/// `callers` closed-loop callers send `n` requests to `target` between them.
async fn drive(http: &reqwest::Client, target: &Target, callers: u64, n: u64, level: &mut Level) {
    let own0 = own_cpu_secs();
    let broker0 = target.broker.map(|b| cpu_secs(&[b]));
    let remaining = Arc::new(AtomicU64::new(n));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..callers)
        .map(|_| {
            let (http, url, model, remaining) = (
                http.clone(),
                target.url.clone(),
                target.model.clone(),
                remaining.clone(),
            );
            tokio::spawn(async move {
                let mut got = Vec::new();
                while remaining
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                    .is_ok()
                {
                    got.push(sse_call(&http, &url, &model).await);
                }
                got
            })
        })
        .collect();
    for w in workers {
        for (first, ok) in w.await.unwrap() {
            level.requests += 1;
            if ok {
                level.ok += 1;
            }
            if let Some(first) = first {
                level.hist().saturating_record(first.as_micros() as u64);
            }
        }
    }
    level.secs += t0.elapsed().as_secs_f64();
    level.own_cpu_secs += own_cpu_secs() - own0;
    if let (Some(b), Some(b0)) = (target.broker, broker0) {
        level.broker_cpu_secs += cpu_secs(&[b]) - b0;
    }
}

/// The processes `roots` and all their descendants, from /proc.
fn tree(roots: &[u32]) -> Vec<u32> {
    let mut parent: Vec<(u32, u32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Some(ppid) = stat_fields(pid).and_then(|f| f.get(1).and_then(|p| p.parse().ok())) {
            parent.push((pid, ppid));
        }
    }
    let mut all = roots.to_vec();
    let mut i = 0;
    while i < all.len() {
        let p = all[i];
        all.extend(parent.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    all
}

/// The fields of /proc/PID/stat after the command name (state, ppid, …).
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// CPU time (user + system, seconds) of `roots` and their descendants.
fn cpu_secs(roots: &[u32]) -> f64 {
    // The kernel's USER_HZ, which /proc reports in: 100 on every Linux this runs on.
    const TICKS: f64 = 100.0;
    tree(roots)
        .into_iter()
        .filter_map(stat_fields)
        .map(|f| {
            let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            // utime and stime are the 14th and 15th fields of stat, 12th and 13th here.
            (t(11) + t(12)) / TICKS
        })
        .sum()
}

/// CPU time (user + system, seconds) of this process alone (the driver and the fake), not of
/// the targets it started.
fn own_cpu_secs() -> f64 {
    const TICKS: f64 = 100.0;
    stat_fields(std::process::id()).map_or(0.0, |f| {
        let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (t(11) + t(12)) / TICKS
    })
}

/// Resident memory (MiB) of `roots` and their descendants, summed.
fn tree_rss(roots: &[u32]) -> f64 {
    tree(roots).into_iter().map(|p| rss_mib(p).1).sum()
}

/// The floor: a bare HTTP pass-through to the fake, a process of its own (this binary's
/// hidden `pass-through` command), what any gateway's added time includes.
async fn pass_through_target(fake_url: &str, model: &str) -> Target {
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["pass-through", "--upstream", fake_url])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let addr = announced(&mut child, "pass-through listening on ").await;
    Target {
        name: "a bare HTTP pass-through (no parsing, no bus: the floor of any gateway)",
        url: format!("http://{addr}/v1/chat/completions"),
        model: model.into(),
        pids: vec![child.id().unwrap()],
        children: vec![child],
        groups: Vec::new(),
        idle: Vec::new(),
        broker: None,
    }
}

/// `sluice serve` of this build, or of `before` (another build's binary, for a before/after
/// comparison in one run: `BENCH_SERVE_BEFORE`).
async fn serve_target(fake_url: &str, model: &str, before: Option<&Path>) -> Target {
    let args = [
        "serve",
        "--provider",
        "openai-compatible",
        "--base-url",
        fake_url,
        "--model",
        model,
        "--listen",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
    ];
    let mut child = match before {
        Some(exe) => sluice_binary_process(exe, &args),
        None => sluice_process(&args),
    };
    // `sluice serve: gateway on http://ADDR, metrics on ...`
    let announcement = announced(&mut child, "gateway on ").await;
    let gateway = announcement.split(',').next().unwrap().to_owned();
    let pid = child.id().unwrap();
    Target {
        name: if before.is_some() {
            "`sluice serve` before (BENCH_SERVE_BEFORE's build)"
        } else {
            "`sluice serve` (in-process bus)"
        },
        url: format!("{gateway}/v1/chat/completions"),
        model: model.into(),
        pids: vec![pid],
        children: vec![child],
        groups: Vec::new(),
        idle: Vec::new(),
        broker: None,
    }
}

/// How the broker targets' text-completion publishes a stream's deltas.
#[derive(Clone, Copy)]
enum Records {
    /// The default (`--response-pacing merge`): a delta merged into the next while the broker
    /// has not confirmed the stream's previous record.
    MergedWhileBehind,
    /// `--response-pacing auto`: every delta a record of its own (the default before #27).
    EveryDelta,
    /// `--response-pacing on`, 10 ms, no rate bound: at most one record per 10 ms per stream.
    Paced,
}

/// `sluice gateway` and `sluice text-completion` over the broker, on the default topics
/// (`Records::MergedWhileBehind`) or a topicspace of their own. The first record is never
/// held, so time to first token is not paced in any of them.
async fn broker_target(broker: &Broker, fake_url: &str, model: &str, records: Records) -> Target {
    let (processor, (gateway, addr), name) = match records {
        Records::MergedWhileBehind => (
            gateway_processor_with(broker, fake_url, model, &[]).await,
            crate::gateway::start_gateway(broker, &[]).await,
            "`sluice gateway` + `sluice text-completion` over the broker (deltas merged while the broker is behind, the default)",
        ),
        Records::EveryDelta => (
            topicspace_processor(
                broker,
                fake_url,
                model,
                "benchperdelta",
                &["--response-pacing", "auto"],
            )
            .await,
            crate::gateway::start_gateway(broker, &["--topicspace", "benchperdelta"]).await,
            "the same, a record per delta (`--response-pacing auto`)",
        ),
        Records::Paced => {
            let pacing = [
                "--response-pacing",
                "on",
                "--pace-interval-ms",
                "10",
                "--max-response-records-per-sec",
                "0",
            ];
            (
                topicspace_processor(broker, fake_url, model, "benchpaced", &pacing).await,
                crate::gateway::start_gateway(broker, &["--topicspace", "benchpaced"]).await,
                "the same, records paced (`--response-pacing on --pace-interval-ms 10`)",
            )
        }
    };
    Target {
        name,
        url: format!("http://{addr}/v1/chat/completions"),
        model: model.into(),
        pids: vec![gateway.id().unwrap(), processor.id().unwrap()],
        children: vec![gateway, processor],
        groups: Vec::new(),
        idle: Vec::new(),
        // bench/run.sh names the broker it started.
        broker: std::env::var("BENCH_BROKER_PID")
            .ok()
            .and_then(|p| p.parse().ok()),
    }
}

/// Waits until `child` answers `url` with 2xx (`sluice_tests::process::ready`: fails at once
/// if it exits), within 180 s; `who` names it in the failure and the start-up time.
async fn started(child: &mut tokio::process::Child, url: &str, who: &str) {
    let t0 = Instant::now();
    if let Err(e) = sluice_tests::process::ready(child, url, Duration::from_secs(180)).await {
        panic!("{who} {e}; see its log");
    }
    eprintln!("{who} ready in {:.1} s", t0.elapsed().as_secs_f64());
}

/// LiteLLM's proxy from `venv`, run as bench/litellm.md says: every model forwarded to the
/// fake as an OpenAI-compatible provider, no database, no network at start-up, no retries,
/// `workers` uvicorn workers (its production guide: one per CPU).
async fn litellm_target(venv: &str, fake_base: &str, model: &str, workers: u32) -> Target {
    let [dir, _] = temp_dirs();
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("litellm.yaml");
    std::fs::write(
        &config,
        format!(
            "model_list:\n  - model_name: \"*\"\n    litellm_params:\n      model: \"openai/*\"\n      api_base: \"{fake_base}/v1\"\n      api_key: \"fake-key\"\nlitellm_settings:\n  set_verbose: false\n  drop_params: true\n  num_retries: 0\n  request_timeout: 600\n  telemetry: false\n",
        ),
    )
    .unwrap();
    let log_config = dir.join("log_config.yaml");
    std::fs::write(
        &log_config,
        "version: 1\ndisable_existing_loggers: false\nformatters:\n  plain: {format: \"%(levelname)s: %(message)s\"}\nhandlers:\n  stderr: {class: logging.StreamHandler, formatter: plain, stream: ext://sys.stderr}\nloggers:\n  uvicorn: {handlers: [stderr], level: INFO, propagate: false}\n  uvicorn.access: {handlers: [stderr], level: WARNING, propagate: false}\n",
    )
    .unwrap();
    let log = dir.join("litellm.log");
    let port = free_port();
    let mut child = tokio::process::Command::new(format!("{venv}/bin/litellm"))
        .current_dir(&dir)
        .args(["--config", &config.display().to_string()])
        .args(["--log_config", &log_config.display().to_string()])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--num_workers", &workers.to_string()])
        .args(["--telemetry", "False"])
        .process_group(0)
        .env_remove("DATABASE_URL")
        .env_remove("DIRECT_URL")
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_MODE", "PRODUCTION")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let group = GroupGuard(child.id().unwrap());
    started(
        &mut child,
        &format!("http://127.0.0.1:{port}/health/liveliness"),
        "LiteLLM's proxy",
    )
    .await;
    // The liveliness route answers once one worker is up: wait for every worker.
    let t0 = Instant::now();
    while std::fs::read_to_string(&log)
        .unwrap_or_default()
        .matches("Application startup complete")
        .count()
        < workers as usize
    {
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "LiteLLM's workers did not all start; see {}",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Target {
        name: "LiteLLM proxy",
        url: format!("http://127.0.0.1:{port}/v1/chat/completions"),
        model: model.into(),
        pids: vec![child.id().unwrap()],
        children: vec![child],
        groups: vec![group],
        idle: Vec::new(),
        broker: None,
    }
}

/// TensorZero's gateway (`binary`, built from its published source), observability off,
/// the fake as an `openai` provider of a model of the same name. Its OpenAI-compatible route
/// names models `tensorzero::model_name::NAME`.
async fn tensorzero_target(binary: &str, fake_base: &str, model: &str) -> Target {
    let [_, dir] = temp_dirs();
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("tensorzero.toml");
    std::fs::write(
        &config,
        format!(
            "[gateway]\nobservability.enabled = false\ndisable_pseudonymous_usage_analytics = true\n\n[models.\"{model}\"]\nrouting = [\"fake\"]\n\n[models.\"{model}\".providers.fake]\ntype = \"openai\"\nmodel_name = \"{model}\"\napi_base = \"{fake_base}/v1\"\napi_key_location = \"none\"\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let mut child = tokio::process::Command::new(binary)
        .args(["--config-file", &config.display().to_string()])
        .args(["--bind-address", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "warn")
        .env("TENSORZERO_DISABLE_PSEUDONYMOUS_USAGE_ANALYTICS", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("gateway.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    started(
        &mut child,
        &format!("http://127.0.0.1:{port}/health"),
        "TensorZero's gateway",
    )
    .await;
    Target {
        name: "TensorZero gateway",
        url: format!("http://127.0.0.1:{port}/openai/v1/chat/completions"),
        model: format!("tensorzero::model_name::{model}"),
        pids: vec![child.id().unwrap()],
        children: vec![child],
        groups: Vec::new(),
        idle: Vec::new(),
        broker: None,
    }
}

/// The processes' idle memory, read after `settle`.
async fn record_idle(target: &mut Target, settle: Duration) {
    tokio::time::sleep(settle).await;
    target.idle = tree(&target.pids)
        .into_iter()
        .map(|p| {
            let name = std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                .unwrap_or_default()
                .split('\0')
                .take(2)
                .map(|a| a.rsplit('/').next().unwrap_or(a).to_owned())
                .collect::<Vec<_>>()
                .join(" ");
            (name, rss_mib(p).1)
        })
        .collect();
}

/// What one run of the scenario does (the command line's options).
pub(crate) struct Options<'a> {
    /// Concurrent caller levels.
    pub levels: &'a [u64],
    /// Requests per target at one caller.
    pub serial_requests: u64,
    /// Requests per target at each higher level.
    pub requests: u64,
    /// Only these targets besides the direct baseline (all when empty).
    pub only: &'a [String],
    /// Milliseconds between the fake's tokens after the first.
    pub token_gap_ms: u64,
}

pub(crate) async fn bench(broker: &Broker, out: &Path, docs: &Path, options: Options<'_>) {
    let Options {
        levels,
        serial_requests,
        requests,
        only,
        token_gap_ms,
    } = options;
    let wanted = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let model = fake_model(token_gap_ms);
    // Some targets only (`--only`, to profile one), or another provider than the published
    // one: the published figures stay as they are.
    let partial =
        !only.is_empty() || token_gap_ms != 1 || std::env::var_os("BENCH_SERVE_BEFORE").is_some();
    sluice_runtime::install_crypto_provider();
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let fake_base = fake.base_url();
    let mut targets = vec![Target {
        name: "the provider called directly",
        url: format!("{fake_base}/v1/chat/completions"),
        model: model.clone(),
        pids: Vec::new(),
        children: Vec::new(),
        groups: Vec::new(),
        idle: Vec::new(),
        broker: None,
    }];
    if wanted("pass-through") {
        targets.push(pass_through_target(&fake_base, &model).await);
    }
    if wanted("serve") {
        targets.push(serve_target(&fake_base, &model, None).await);
    }
    // An earlier build beside this one, in the same run: a change's before and after.
    let before = std::env::var_os("BENCH_SERVE_BEFORE").map(std::path::PathBuf::from);
    if let Some(exe) = &before {
        targets.push(serve_target(&fake_base, &model, Some(exe)).await);
    }
    if wanted("broker") {
        targets.push(broker_target(broker, &fake_base, &model, Records::MergedWhileBehind).await);
    }
    if wanted("broker-per-delta") {
        targets.push(broker_target(broker, &fake_base, &model, Records::EveryDelta).await);
    }
    if wanted("broker-paced") {
        targets.push(broker_target(broker, &fake_base, &model, Records::Paced).await);
    }
    let litellm_workers = std::env::var("LITELLM_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(2);
    let litellm = std::env::var("BENCH_VENV")
        .ok()
        .filter(|v| wanted("litellm") && Path::new(&format!("{v}/bin/litellm")).exists());
    if let Some(venv) = &litellm {
        targets.push(litellm_target(venv, &fake_base, &model, litellm_workers).await);
    }
    let tensorzero = std::env::var("TENSORZERO_GATEWAY")
        .ok()
        .filter(|b| wanted("tensorzero") && Path::new(b).exists());
    if let Some(binary) = &tensorzero {
        targets.push(tensorzero_target(binary, &fake_base, &model).await);
    }
    for t in targets.iter_mut().skip(1) {
        record_idle(t, Duration::from_secs(5)).await;
    }

    // The broker's own two hops in this run: publish → responder → receive, raw pulsar-rs
    // with separate clients per side (the floor the foundation scenario measures).
    let mut raw = RawPair::start(&broker.url, true).await;
    let mut raw_hist = hist();
    raw.batch(100, &mut hist()).await;
    raw.batch(serial_requests.max(500), &mut raw_hist).await;
    // The same two hops as a request through a gateway over the broker meets them at one
    // caller: each after the broker was idle (the other targets' turns), the answer 50 ms
    // after the request (the fake's time to first token). Back to back, the broker's code and
    // threads stay hot, and the hops take about half as long as they do for such a request.
    let over_broker = ["broker", "broker-per-delta", "broker-paced"]
        .into_iter()
        .any(wanted);
    let (mut paced_request, mut paced_response, mut paced_both) = (hist(), hist(), hist());

    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(1024)
        // A hung target fails its requests instead of hanging the run.
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap();
    // Warm every target (connections, caches, the JIT-less Python's imports).
    for t in &targets {
        drive(&http, t, 8, 64, &mut Level::default()).await;
    }
    let mut results: BTreeMap<u64, Vec<Level>> = BTreeMap::new();
    for &callers in levels {
        eprintln!("{callers} concurrent callers …");
        let mut row: Vec<Level> = targets.iter().map(|_| Level::default()).collect();
        // Each target's CPU over the whole level: what it spends after a stream's last byte
        // (acks, ledger records, a proxy's callbacks) and while idle counts too.
        let cpu0: Vec<f64> = targets.iter().map(|t| cpu_secs(&t.pids)).collect();
        if callers == 1 {
            // One caller: request by request, interleaved, so drift hits every target alike.
            for _ in 0..serial_requests {
                for (t, l) in targets.iter().zip(row.iter_mut()) {
                    drive(&http, t, 1, 1, l).await;
                }
                if over_broker {
                    raw.paced(
                        1,
                        Duration::from_millis(FIRST_TOKEN_MS),
                        &mut paced_request,
                        &mut paced_response,
                        &mut paced_both,
                    )
                    .await;
                }
            }
        } else {
            // Blocks rotated four times, so drift hits every target alike.
            let block = (requests / 4).max(callers);
            for _ in 0..4 {
                for (t, l) in targets.iter().zip(row.iter_mut()) {
                    drive(&http, t, callers, block, l).await;
                }
            }
        }
        for ((l, t), c0) in row.iter_mut().zip(&targets).zip(cpu0) {
            l.cpu_secs = cpu_secs(&t.pids) - c0;
        }
        results.insert(callers, row);
    }
    raw.stop().await;
    let peaks: Vec<f64> = targets
        .iter()
        .map(|t| tree(&t.pids).into_iter().map(|p| rss_mib(p).0).sum())
        .collect();
    let after: Vec<f64> = targets.iter().map(|t| tree_rss(&t.pids)).collect();
    for t in &mut targets {
        for c in t.children.drain(..) {
            terminate(c).await;
        }
        // Whatever a supervisor left of its group goes too.
        t.groups.clear();
    }

    let raw_p50 = ms(&raw_hist, 0.5);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: release build; the fake OpenAI server ({model}: 20 tokens, the first 50 ms after the request, then {token_gap_ms} ms apart) and the load driver (reqwest, closed loop) in the bench's process; Pulsar standalone on loopback; LiteLLM {}; TensorZero {}.\n",
        provenance(),
        match &litellm {
            Some(_) => format!(
                "{} with {litellm_workers} worker(s)",
                std::env::var("LITELLM_VERSION").unwrap_or_else(|_| "(version unknown)".into())
            ),
            None => "not run (BENCH_VENV has no litellm; run through bench/run.sh)".into(),
        },
        match &tensorzero {
            Some(_) =>
                std::env::var("TENSORZERO_VERSION").unwrap_or_else(|_| "(version unknown)".into()),
            None => "not run (TENSORZERO_GATEWAY names no binary; bench/tensorzero.sh builds one)"
                .into(),
        }
    );
    let _ = writeln!(
        md,
        "Raw pulsar-rs round trip in the same run (publish → responder → receive, the broker's two hops): back to back p50 {raw_p50:.2} ms, p99 {:.2} ms{}.\n",
        ms(&raw_hist, 0.99),
        if paced_both.is_empty() {
            String::new()
        } else {
            format!(
                "; as a request over the broker meets them at one caller (each hop after the broker was idle, the answer {FIRST_TOKEN_MS} ms after the request): the request's hop p50 {:.2} ms, the first token's p50 {:.2} ms, both p50 {:.2} ms (p99 {:.2} ms)",
                ms(&paced_request, 0.5),
                ms(&paced_response, 0.5),
                ms(&paced_both, 0.5),
                ms(&paced_both, 0.99),
            )
        }
    );
    let _ = writeln!(
        md,
        "| callers | target | TTFT p50 ms | added p50 ms | added p99 ms | requests/s (vs direct) | CPU ms/request | broker CPU ms/request | driver + fake, cores | completed |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    let mut plot_targets: Vec<serde_json::Value> = Vec::new();
    let mut provider_ttft = serde_json::Map::new();
    for (i, t) in targets.iter().enumerate() {
        let mut plot_levels = Vec::new();
        for (&callers, row) in &results {
            let (l, d) = (&row[i], &row[0]);
            let (a50, a99) = (l.q(0.5) - d.q(0.5), l.q(0.99) - d.q(0.99));
            if i == 0 {
                provider_ttft.insert(callers.to_string(), d.q(0.5).into());
            }
            let cpu = if t.pids.is_empty() {
                "–".to_owned()
            } else {
                format!("{:.3}", l.cpu_secs * 1000.0 / l.requests as f64)
            };
            let broker_cpu = if t.broker.is_some() {
                format!("{:.3}", l.broker_cpu_secs * 1000.0 / l.requests as f64)
            } else {
                "–".to_owned()
            };
            let _ = writeln!(
                md,
                "| {callers} | {} | {:.2} | {} | {} | {:.0} ({:.2}x) | {cpu} | {broker_cpu} | {:.2} | {}/{} |",
                t.name,
                l.q(0.5),
                if i == 0 {
                    "–".into()
                } else {
                    format!("{a50:+.2}")
                },
                if i == 0 {
                    "–".into()
                } else {
                    format!("{a99:+.2}")
                },
                l.rps(),
                l.rps() / d.rps(),
                l.own_cpu_secs / l.secs,
                l.ok,
                l.requests
            );
            plot_levels.push(serde_json::json!({"concurrency": callers,
                "added_p50_ms": a50, "added_p99_ms": a99, "rps": l.rps(),
                "rps_ratio": l.rps() / d.rps(),
                "cpu_ms_per_request": l.cpu_secs * 1000.0 / l.requests as f64,
                "broker_cpu_ms_per_request": t.broker.map(|_| l.broker_cpu_secs * 1000.0 / l.requests as f64),
                "driver_cores": l.own_cpu_secs / l.secs,
                "completed": l.ok, "requests": l.requests}));
        }
        if i > 0 {
            plot_targets.push(serde_json::json!({"name": t.name.replace('`', ""), "levels": plot_levels,
                "idle_rss_mib": t.idle.iter().map(|(n, r)| serde_json::json!({"process": n, "mib": r})).collect::<Vec<_>>(),
                "peak_rss_mib": peaks[i], "rss_after_mib": after[i]}));
        }
    }
    let _ = writeln!(
        md,
        "\n| target | idle RSS per process (MiB) | peak RSS, all processes (MiB) |"
    );
    let _ = writeln!(md, "|---|---|---|");
    for (i, t) in targets.iter().enumerate().skip(1) {
        let idle: Vec<String> = t.idle.iter().map(|(n, r)| format!("{n}: {r:.1}")).collect();
        let _ = writeln!(md, "| {} | {} | {:.1} |", t.name, idle.join("; "), peaks[i]);
    }
    let _ = writeln!(
        md,
        "\nCPU ms/request: the target's processes (and their children) over the whole level, per request it served. Broker CPU ms/request: the Pulsar standalone's JVM while that target was driven, per request. Driver + fake: the bench's own process while it drove that target, in cores (of 2)."
    );
    let json = serde_json::json!({
        "title": "Time to first token added over calling the provider directly",
        "raw_pulsar_round_trip_p50_ms": raw_p50,
        "raw_pulsar_paced_round_trip_p50_ms": (!paced_both.is_empty()).then(|| ms(&paced_both, 0.5)),
        "provider_ttft_ms": provider_ttft,
        "targets": plot_targets,
    });
    let name = if !partial {
        "overhead"
    } else {
        "overhead-partial"
    };
    std::fs::write(out.join(format!("{name}.md")), &md).unwrap();
    std::fs::write(
        out.join(format!("{name}.json")),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    if !partial {
        splice(docs, "overhead", &md);
    }
    for dir in temp_dirs() {
        let _ = std::fs::remove_dir_all(dir);
    }
    println!("{md}");
}
