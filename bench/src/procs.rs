//! Process control: `sluice` processes of the bench's build started, waited for and
//! stopped, and their memory.

use std::{path::Path, time::Duration};

use sluice_tests::{
    Broker, TextClient, free_port, text_client, unique_non_persistent_topic, unique_topic,
};

/// Peak and current resident memory of a process, in MiB, from /proc.
pub(crate) fn rss_mib(pid: u32) -> (f64, f64) {
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
pub(crate) enum Durability {
    Persistent,
    NonPersistent,
}

/// A `sluice text-completion` process against the fake provider, with `concurrency`, and a
/// client of it.
pub(crate) async fn spawn_text_completion(
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
pub(crate) async fn spawn_text_completion_process(
    broker: &Broker,
    fake: &sluice_tests::fake_openai::FakeOpenAi,
    model: &str,
    concurrency: u64,
    durability: Durability,
) -> (tokio::process::Child, String, String) {
    let topic = |name: &str| match durability {
        Durability::Persistent => unique_topic(name),
        Durability::NonPersistent => unique_non_persistent_topic(name),
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
pub(crate) async fn wait_ready(child: &mut tokio::process::Child, port: u16) {
    let ready = format!("http://127.0.0.1:{port}/readyz");
    if let Err(e) = sluice_tests::process::ready(child, &ready, Duration::from_secs(120)).await {
        panic!("the sluice process {e}; see its error above");
    }
}

/// A `sluice` subcommand as a child process: its stderr passes through, its stdout is piped
/// (the gateway prints its address there).
pub(crate) fn sluice_process(args: &[&str]) -> tokio::process::Child {
    let exe = std::env::current_exe().unwrap().with_file_name("sluice");
    sluice_binary_process(&exe, args)
}

/// [`sluice_process`] of another `sluice` binary (an earlier build, for a before/after run).
pub(crate) fn sluice_binary_process(exe: &Path, args: &[&str]) -> tokio::process::Child {
    tokio::process::Command::new(exe)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("build the sluice binary first: cargo build --release -p sluice-cli")
}

/// Reads `child`'s stdout (piped, as [`sluice_process`] pipes it) up to the first line that
/// holds `marker` and returns what follows the marker on that line, trimmed: the address a
/// gateway or `sluice serve` prints once it listens. Fails if the child exits first.
pub(crate) async fn announced(child: &mut tokio::process::Child, marker: &str) -> String {
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(child.stdout.take().unwrap()));
    loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the sluice process exited before it listened; see its error above");
        if let Some((_, rest)) = line.split_once(marker) {
            return rest.trim().to_owned();
        }
    }
}

/// Stops a child with SIGTERM so that it drains and deletes its response subscription, as
/// a deployment would; SIGKILL if it has not exited after 10 s.
pub(crate) async fn terminate(mut child: tokio::process::Child) {
    sluice_tests::process::terminate(&mut child, Duration::from_secs(10)).await;
}

/// `sluice text-completion` on its default topics (the ones `sluice gateway` routes to),
/// answering with the fake's `model`.
pub(crate) async fn gateway_processor(
    broker: &Broker,
    fake_url: &str,
    model: &str,
) -> tokio::process::Child {
    gateway_processor_with(broker, fake_url, model, &[]).await
}

/// [`gateway_processor_with`] on topicspace `ts`'s text-completion topics (where a gateway
/// started with `--topicspace ts` sends), with `extra` flags.
pub(crate) async fn topicspace_processor(
    broker: &Broker,
    fake_url: &str,
    model: &str,
    ts: &str,
    extra: &[&str],
) -> tokio::process::Child {
    let (req, resp, cancel) = (
        format!("request:{ts}:text-completion"),
        format!("response:{ts}:text-completion"),
        format!("notify:{ts}:text-completion-cancel"),
    );
    let mut args = vec![
        "--request-topic",
        &req,
        "--response-topic",
        &resp,
        "--cancel-topic",
        &cancel,
    ];
    args.extend_from_slice(extra);
    gateway_processor_with(broker, fake_url, model, &args).await
}

/// [`gateway_processor`] with `extra` flags (other topics, the ledger off).
pub(crate) async fn gateway_processor_with(
    broker: &Broker,
    fake_url: &str,
    model: &str,
    extra: &[&str],
) -> tokio::process::Child {
    let port = free_port();
    let metrics_addr = format!("127.0.0.1:{port}");
    let mut args = vec![
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
        &metrics_addr,
    ];
    args.extend_from_slice(extra);
    let mut child = sluice_process(&args);
    wait_ready(&mut child, port).await;
    child
}
