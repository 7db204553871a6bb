//! The loss model of TrustGraph's topic mapping (issue #13.2), measured.
//!
//! A `sluice text-completion` process streams 51-record answers (50 tokens and the terminal
//! record, from the fake OpenAI server) to one client, with as many callers in a closed loop
//! as the processor's concurrency. The client runs on a runtime of its own, as a gateway
//! process would. Each load runs on non-persistent topics (`--topic-mapping trustgraph`) and
//! on durable ones (sluice's default), and once more with the client's process stalled for a
//! few seconds mid-traffic, as an overloaded or paused (GC, SIGSTOP, CPU-starved) client is.
//!
//! For every request: complete (all 51 records, in order), ended `records-lost` by the
//! client's loss detection, timed out, or another error; and for the lost ones, how long after
//! the last record received the client ended the request.

use std::{
    fmt::Write as _,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use sluice_runtime::{
    client::{ClientConfig, ClientError, Received},
    telemetry::Telemetry,
};
use sluice_tests::{Broker, TextClient};

use crate::{
    procs::{Durability, spawn_text_completion_process},
    report::hist,
    text_completion::stream_req,
};

/// Records per answer: 50 tokens and the terminal record.
const RECORDS: usize = 51;

/// How one load ended.
#[derive(Debug, Default, Clone, serde::Serialize)]
struct Row {
    mapping: &'static str,
    load: String,
    requests: u64,
    complete: u64,
    lost: u64,
    timed_out: u64,
    other: u64,
    /// The client's count of records the broker dropped on its subscription.
    dropped: u64,
    detect_p50_ms: f64,
    detect_max_ms: f64,
    seconds: f64,
}

enum Ending {
    Complete,
    Lost(Duration),
    TimedOut,
    Other,
}

async fn one_request(client: &TextClient) -> Ending {
    let mut stream = match client.request(&stream_req()).await {
        Ok(s) => s,
        Err(_) => return Ending::Other,
    };
    let mut records = 0;
    let mut last = Instant::now();
    loop {
        match stream.next().await {
            None => {
                return if records == RECORDS {
                    Ending::Complete
                } else {
                    Ending::Other
                };
            }
            Some(Ok(Received::Record(_))) => {
                records += 1;
                last = Instant::now();
            }
            Some(Ok(Received::Restarted)) => records = 0,
            Some(Err(e)) if e.is_loss() => return Ending::Lost(last.elapsed()),
            Some(Err(ClientError::InactivityTimeout(_) | ClientError::TotalTimeout(_))) => {
                return Ending::TimedOut;
            }
            Some(Err(_)) => return Ending::Other,
        }
    }
}

/// Runs `callers` callers of `per_caller` requests each against a processor on fresh topics,
/// the client on a runtime of its own; `stall` stops that runtime's thread for the given time
/// once a third of the requests are done.
async fn load(
    broker: &Broker,
    fake: &sluice_tests::fake_openai::FakeOpenAi,
    durability: Durability,
    callers: u64,
    per_caller: u64,
    stall: Option<Duration>,
) -> Row {
    let (mut child, req, resp) =
        spawn_text_completion_process(broker, fake, "tokens-50-0", callers, durability).await;
    let broker = broker.clone();
    let total = callers * per_caller;
    let run = move || {
        let runtime = if stall.is_some() {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
        }
        .unwrap();
        runtime.block_on(async move {
            let telemetry = Telemetry::new().unwrap();
            let mut config = ClientConfig::new("bench", &req, &resp);
            // Well above any answer's time here: a timeout is a request the detection missed.
            config.inactivity_timeout = Duration::from_secs(60);
            let client = Arc::new(
                TextClient::start(broker.bus().await, config, Some(telemetry.metrics.clone()))
                    .await
                    .unwrap(),
            );
            let endings = Arc::new(Mutex::new(Vec::new()));
            let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let t0 = Instant::now();
            let stall_task = stall.map(|pause| {
                let done = done.clone();
                tokio::spawn(async move {
                    while done.load(std::sync::atomic::Ordering::Relaxed) < total / 3 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    // Blocks the whole client runtime, its broker connection included.
                    std::thread::sleep(pause);
                })
            });
            let tasks: Vec<_> = (0..callers)
                .map(|_| {
                    let (client, endings, done) = (client.clone(), endings.clone(), done.clone());
                    tokio::spawn(async move {
                        for _ in 0..per_caller {
                            let ending = one_request(&client).await;
                            endings.lock().unwrap().push(ending);
                            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            if let Some(t) = stall_task {
                let _ = t.await;
            }
            let seconds = t0.elapsed().as_secs_f64();
            client.close().await;
            let dropped = telemetry
                .render()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("sluice_client_dropped_records_total{service=\"bench\"} ")?
                        .parse()
                        .ok()
                })
                .unwrap_or(0);
            let endings = std::mem::take(&mut *endings.lock().unwrap());
            (endings, dropped, seconds)
        })
    };
    let (endings, dropped, seconds) = tokio::task::spawn_blocking(run).await.unwrap();
    let _ = child.kill().await;
    let mut row = Row {
        mapping: match durability {
            Durability::Persistent => "durable",
            Durability::NonPersistent => "trustgraph",
        },
        load: match stall {
            None => format!("{callers} concurrent streams"),
            Some(p) => format!(
                "{callers} concurrent streams, client stalled {} s",
                p.as_secs()
            ),
        },
        requests: endings.len() as u64,
        dropped,
        seconds,
        ..Row::default()
    };
    let mut detect = hist();
    for e in endings {
        match e {
            Ending::Complete => row.complete += 1,
            Ending::Lost(after) => {
                row.lost += 1;
                detect.record(after.as_micros() as u64).unwrap();
            }
            Ending::TimedOut => row.timed_out += 1,
            Ending::Other => row.other += 1,
        }
    }
    if row.lost > 0 {
        row.detect_p50_ms = crate::report::ms(&detect, 0.5);
        row.detect_max_ms = detect.max() as f64 / 1000.0;
    }
    row
}

/// Runs every load on both mappings; returns the docs table and the figures as JSON.
pub async fn bench(
    broker: &Broker,
    levels: &[u64],
    per_caller: u64,
    stall_secs: u64,
) -> (String, serde_json::Value) {
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let mut rows = Vec::new();
    let stall_level = levels.iter().copied().max().unwrap_or(64).min(256);
    for durability in [Durability::NonPersistent, Durability::Persistent] {
        for &c in levels {
            eprintln!("loss: {c} streams …");
            rows.push(load(broker, &fake, durability, c, per_caller, None).await);
        }
        eprintln!("loss: {stall_level} streams, client stalled …");
        rows.push(
            load(
                broker,
                &fake,
                durability,
                stall_level,
                per_caller,
                Some(Duration::from_secs(stall_secs)),
            )
            .await,
        );
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: Pulsar standalone on loopback; one `sluice text-completion` process, 51-record answers from the fake OpenAI server, one client on its own runtime, callers in a closed loop ({per_caller} requests each).\n",
        crate::report::provenance()
    );
    let _ = writeln!(
        md,
        "| mapping | load | requests | complete | ended `records-lost` | timed out | other errors | records dropped (client's count) | loss seen after last record, p50 / max ms | wall s |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in &rows {
        let detect = if r.lost > 0 {
            format!("{:.0} / {:.0}", r.detect_p50_ms, r.detect_max_ms)
        } else {
            "–".to_owned()
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} |",
            r.mapping,
            r.load,
            r.requests,
            r.complete,
            r.lost,
            r.timed_out,
            r.other,
            r.dropped,
            detect,
            r.seconds
        );
    }
    (md, serde_json::json!({ "rows": rows }))
}
