//! A broker that cannot write (issue #13.5): its bookie turns read-only when its disk is over
//! 95% full. The broker here runs with its bookie's directory on a small tmpfs that the test
//! fills and empties. Processors must stay up, say why on `/readyz`, ack nothing they could
//! not answer, call no provider in a loop meanwhile, and answer everything once the disk
//! recovers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use sluice_runtime::{
    bus::{Bus, Message},
    client::{ClientConfig, ClientError, Received},
    processor::{Handler, RequestContext, ResponseSink},
    telemetry::Telemetry,
};
use sluice_schema::{Error, ErrorKind, TextCompletionRequest, TextCompletionResponse};
use sluice_tests::{
    Broker, PATIENCE, RunningProcessor, TextClient, echo_config, init_logging, unique_topic,
};
use tokio::{process::Command, sync::Notify};

/// A broker on its own ports whose bookie writes to a tmpfs of `SIZE_MB`.
struct SmallDiskBroker {
    state: PathBuf,
    script: PathBuf,
}

const SIZE_MB: u64 = 256;
const ENVS: [(&str, &str); 5] = [
    ("PULSAR_PORT", "6654"),
    ("PULSAR_HTTP_PORT", "8084"),
    ("PULSAR_BK_PORT", "3185"),
    ("PULSAR_HEAP", "384m"),
    // A bookie's defaults (the standalone's own conf allows 99%): read-only over 95%,
    // writable again under 90%; and a disk check every second (default 10 s), so the test does
    // not wait on it.
    (
        "PULSAR_EXTRA_CONF",
        "diskUsageThreshold=0.95\ndiskUsageWarnThreshold=0.90\ndiskUsageLwmThreshold=0.90\ndiskCheckInterval=1000",
    ),
];

impl SmallDiskBroker {
    async fn start() -> Self {
        let state = std::env::temp_dir().join(format!("sluice-full-disk-{}", std::process::id()));
        let bookie = state.join("bookkeeper");
        std::fs::create_dir_all(&bookie).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={SIZE_MB}m"), "tmpfs"])
            .arg(&bookie)
            .status()
            .await
            .unwrap();
        assert!(
            mounted.success(),
            "this test mounts a small tmpfs for the bookie's disk and needs root (as the test command runs)"
        );
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/pulsar/pulsar.sh");
        let broker = Self { state, script };
        broker.run("start").await;
        broker
    }

    fn bookie_dir(&self) -> PathBuf {
        self.state.join("bookkeeper")
    }

    fn filler(&self) -> PathBuf {
        self.bookie_dir().join("filler")
    }

    async fn run(&self, command: &str) {
        let status = Command::new("bash")
            .arg(&self.script)
            .arg(command)
            .envs(ENVS)
            .env("PULSAR_STATE_DIR", &self.state)
            .status()
            .await
            .unwrap();
        assert!(status.success(), "pulsar.sh {command} failed");
    }

    /// Fills the bookie's disk to 98%.
    async fn fill(&self) {
        let free = free_bytes(&self.bookie_dir()).await;
        let leave = SIZE_MB * 1024 * 1024 / 50;
        let status = Command::new("fallocate")
            .arg("-l")
            .arg((free - leave).to_string())
            .arg(self.filler())
            .status()
            .await
            .unwrap();
        assert!(status.success());
    }

    fn empty(&self) {
        std::fs::remove_file(self.filler()).unwrap();
    }
}

impl Drop for SmallDiskBroker {
    /// Stops the broker and removes its tmpfs even when the test fails half-way, so a failed
    /// run leaves no broker or mount behind.
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(&self.script)
            .arg("stop")
            .envs(ENVS)
            .env("PULSAR_STATE_DIR", &self.state)
            .status();
        let _ = std::process::Command::new("umount")
            .arg(self.bookie_dir())
            .status();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

async fn free_bytes(dir: &Path) -> u64 {
    let out = Command::new("df")
        .args(["-B1", "--output=avail"])
        .arg(dir)
        .output()
        .await
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .nth(1)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Answers `<prompt>#0` once its gate opens, and counts every call: a request handed back
/// must not be handled again while the broker cannot store its answer.
struct Gated {
    calls: Arc<AtomicUsize>,
    gate: Arc<Notify>,
    open: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait]
impl Handler for Gated {
    type Request = TextCompletionRequest;
    type Response = TextCompletionResponse;

    async fn handle(
        &self,
        request: TextCompletionRequest,
        _ctx: RequestContext,
        sink: &mut ResponseSink<TextCompletionResponse>,
    ) -> Result<(), Error> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let opened = self.gate.notified();
        if !self.open.load(Ordering::SeqCst) {
            opened.await;
        }
        let send = |e: sluice_runtime::processor::SinkError| {
            Error::new(ErrorKind::Internal, e.to_string())
        };
        sink.send(TextCompletionResponse {
            response: format!("{}#0", request.prompt),
            ..Default::default()
        })
        .await
        .map_err(send)?;
        sink.send(TextCompletionResponse {
            end_of_stream: true,
            ..Default::default()
        })
        .await
        .map_err(send)
    }
}

/// Waits until `check` holds, reading it every 200 ms; fails the test with `what` after
/// `timeout`.
async fn eventually(what: &str, timeout: Duration, check: impl AsyncFnMut() -> bool) {
    let held =
        sluice_tests::eventually_every(Duration::from_millis(200), timeout, check, |ok| *ok).await;
    assert!(held, "not within {timeout:?}: {what}");
}

fn metric(telemetry: &Telemetry, series: &str) -> Option<i64> {
    telemetry
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_cannot_write_blocks_the_processor_and_loses_nothing() {
    init_logging();
    let disk = SmallDiskBroker::start().await;
    let broker = Broker {
        url: "pulsar://127.0.0.1:6654".into(),
        admin_url: "http://127.0.0.1:8084".into(),
    };
    broker
        .admin()
        .ensure_namespace("sluice-test/it", Default::default())
        .await
        .unwrap();
    let (req, resp) = (unique_topic("fd-req"), unique_topic("fd-resp"));
    let (calls, gate, open) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(Notify::new()),
        Arc::new(std::sync::atomic::AtomicBool::new(true)),
    );
    let telemetry = Telemetry::new().unwrap();
    // A broker that cannot write does not refuse a send: the send times out. A short
    // operation timeout keeps the test short; production's is 30 s.
    let mut bus_config = broker.config();
    bus_config.operation_timeout = Duration::from_secs(5);
    let bus = || async { Arc::new(broker.pulsar_bus(bus_config.clone()).await) as Arc<dyn Bus> };
    let processor = RunningProcessor::start_with(
        bus().await,
        echo_config(&req, &resp, 8),
        Gated {
            calls: calls.clone(),
            gate: gate.clone(),
            open: open.clone(),
        },
        telemetry.clone(),
    )
    .await;
    let mut config = ClientConfig::new("echo", &req, &resp);
    config.inactivity_timeout = Duration::from_secs(180);
    let client = Arc::new(TextClient::start(bus().await, config, None).await.unwrap());
    let request = |prompt: &str| TextCompletionRequest {
        prompt: prompt.into(),
        streaming: true,
        ..Default::default()
    };
    assert_eq!(client.call(&request("before")).await.unwrap().len(), 2);

    // Four requests stored while the disk has room, taken, held at the gate.
    open.store(false, Ordering::SeqCst);
    let mut streams = Vec::new();
    for i in 0..4 {
        streams.push(client.request(&request(&format!("held{i}"))).await.unwrap());
    }
    eventually("the four requests are in flight", PATIENCE, async || {
        calls.load(Ordering::SeqCst) == 5
    })
    .await;

    // The disk fills; the bookie turns read-only: a probe publish fails.
    disk.fill().await;
    let probe = bus()
        .await
        .publisher(&unique_topic("fd-probe"))
        .await
        .unwrap();
    eventually(
        "the broker refuses to store",
        Duration::from_secs(90),
        async || {
            let sent = tokio::time::timeout(Duration::from_secs(10), async {
                probe.send(Message::new("p")).await?.await
            })
            .await;
            !matches!(sent, Ok(Ok(())))
        },
    )
    .await;

    // A request sent now is refused with a clear error, not accepted and lost.
    let refused: Result<(), ClientError> = tokio::time::timeout(Duration::from_secs(90), async {
        let mut s = client.request(&request("refused")).await?;
        match s.next().await {
            Some(Err(e)) => Err(e),
            other => panic!("a request sent to a broker that cannot write: {other:?}"),
        }
    })
    .await
    .expect("the refusal is reported, not waited out");
    assert!(
        matches!(refused, Err(ClientError::NotStored(_))),
        "{refused:?}"
    );

    // The handlers try to answer: the broker cannot store their records.
    open.store(true, Ordering::SeqCst);
    gate.notify_waiters();
    eventually("/readyz says why", Duration::from_secs(90), async || {
        processor
            .telemetry
            .health
            .readiness()
            .is_err_and(|why| why.to_string().contains("cannot store"))
    })
    .await;
    assert_eq!(
        metric(
            &telemetry,
            "sluice_processor_store_blocked{processor=\"echo\"}"
        ),
        Some(1)
    );
    // Handed back, not acked; and not handled again while the broker cannot store.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        5,
        "requests were handled again while the broker could not store their answers"
    );
    let (backlog, _) = broker.subscription_stats(&req, "echo").await;
    assert_eq!(backlog, 4, "the unanswered requests stay on the broker");
    assert!(!processor.task.is_finished(), "the processor stays up");

    // The disk recovers: every held request is answered.
    disk.empty();
    for (i, mut s) in streams.into_iter().enumerate() {
        let mut texts = Vec::new();
        while let Some(item) = s.next().await {
            match item.unwrap_or_else(|e| panic!("held{i}: {e}")) {
                Received::Record(r) => texts.push(r.response),
                Received::Restarted => texts.clear(),
            }
        }
        assert_eq!(texts, [format!("held{i}#0"), String::new()]);
    }
    eventually("ready again", Duration::from_secs(30), async || {
        processor.telemetry.health.readiness().is_ok()
    })
    .await;
    assert_eq!(
        metric(
            &telemetry,
            "sluice_processor_store_blocked{processor=\"echo\"}"
        ),
        Some(0)
    );
    // Every request acked once answered (the broker's stats follow the acks shortly).
    eventually("nothing left on the broker", PATIENCE, async || {
        broker.subscription_stats(&req, "echo").await == (0, 0)
    })
    .await;
    assert_eq!(client.call(&request("after")).await.unwrap().len(), 2);

    client.close().await;
    processor.stop().await;
    drop(disk);
}
