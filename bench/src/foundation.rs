//! The foundation scenario: round trips through a sluice processor and client against raw
//! pulsar-rs round trips measured in the same run, and echo throughput.

use std::{
    fmt::Write as _, path::Path, sync::Arc, sync::atomic::AtomicU64, sync::atomic::Ordering,
    time::Instant,
};

use futures::StreamExt;
use hdrhistogram::Histogram;
use pulsar::{Pulsar, TokioExecutor, message::proto::command_subscribe::SubType};
use sluice_runtime::client::Received;
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, EchoHandler, RunningProcessor, TextClient, echo_config, text_client, unique_topic,
};
use tokio_util::sync::CancellationToken;

use crate::report::{hist, ms, provenance, splice};

/// Raw pulsar-rs: publish on A; a responder consumes A and republishes on B; receive on B.
/// `split` gives consuming and producing their own clients (own TCP connections).
pub(crate) struct RawPair {
    pub(crate) produce_a: pulsar::Producer<TokioExecutor>,
    pub(crate) consume_b: pulsar::Consumer<Vec<u8>, TokioExecutor>,
    pub(crate) stop: CancellationToken,
    pub(crate) responder: tokio::task::JoinHandle<()>,
    /// How long the responder waits before it answers (see [`RawPair::paced`]), and when it
    /// last received and answered.
    pace: Arc<Pace>,
}

/// The responder's delay and its last message's times, shared with the caller's side.
#[derive(Default)]
struct Pace {
    delay_us: AtomicU64,
    times: std::sync::Mutex<Option<(Instant, Instant)>>,
}

impl RawPair {
    pub(crate) async fn start(url: &str, split: bool) -> Self {
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
        let pace = Arc::new(Pace::default());
        let responder_pace = pace.clone();
        let responder = tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    () = responder_stop.cancelled() => break,
                    m = consume_a.next() => m,
                };
                let Some(Ok(m)) = msg else { break };
                let received = Instant::now();
                consume_a.ack(&m).await.unwrap();
                let delay = responder_pace.delay_us.load(Ordering::Relaxed);
                if delay > 0 {
                    tokio::time::sleep(std::time::Duration::from_micros(delay)).await;
                }
                *responder_pace.times.lock().unwrap() = Some((received, Instant::now()));
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
            pace,
        }
    }

    /// Round trips shaped as a request through a gateway meets the broker: each after `delay`
    /// of silence, the responder answering `delay` after it received the request (a
    /// provider's time to first token), so both hops come after an idle broker, as a
    /// request's and its first token's do. Records each hop on its own (the responder runs
    /// in this process: one clock) and the two together, `delay` not counted.
    pub(crate) async fn paced(
        &mut self,
        n: u64,
        delay: std::time::Duration,
        request: &mut Histogram<u64>,
        response: &mut Histogram<u64>,
        both: &mut Histogram<u64>,
    ) {
        self.pace
            .delay_us
            .store(delay.as_micros() as u64, Ordering::Relaxed);
        for _ in 0..n {
            tokio::time::sleep(delay).await;
            let (t0, t3) = self.round_trip().await;
            let (t1, t2) = self.pace.times.lock().unwrap().take().unwrap();
            let (hop1, hop2) = (t1 - t0, t3 - t2);
            request.record(hop1.as_micros() as u64).unwrap();
            response.record(hop2.as_micros() as u64).unwrap();
            both.record((hop1 + hop2).as_micros() as u64).unwrap();
        }
        self.pace.delay_us.store(0, Ordering::Relaxed);
    }

    pub(crate) async fn batch(&mut self, n: u64, h: &mut Histogram<u64>) {
        for _ in 0..n {
            // Until the answer is acked, as this scenario has always counted it.
            let (t0, _) = self.round_trip().await;
            h.record(t0.elapsed().as_micros() as u64).unwrap();
        }
    }

    /// Publishes a request on A and reads (and acks) the responder's answer on B: when it was
    /// sent and when the answer arrived.
    async fn round_trip(&mut self) -> (Instant, Instant) {
        let payload = br#"{"system":"","prompt":"ping","streaming":false}"#.to_vec();
        let t0 = Instant::now();
        let _receipt = self.produce_a.send_non_blocking(payload).await.unwrap();
        let m = self.consume_b.next().await.unwrap().unwrap();
        let received = Instant::now();
        self.consume_b.ack(&m).await.unwrap();
        (t0, received)
    }

    pub(crate) async fn stop(self) {
        self.stop.cancel();
        let _ = self.responder.await;
    }
}

pub(crate) struct Sluice {
    pub(crate) client: Arc<TextClient>,
    pub(crate) processor: RunningProcessor,
}

pub(crate) async fn start_sluice(broker: &Broker, concurrency: usize) -> Sluice {
    let (req, resp) = (unique_topic("bench-req"), unique_topic("bench-resp"));
    let config = echo_config(&req, &resp, concurrency);
    let processor = RunningProcessor::start(broker.bus().await, config, EchoHandler).await;
    let client = Arc::new(text_client(broker.bus().await, &req, &resp).await);
    Sluice { client, processor }
}

impl Sluice {
    pub(crate) async fn stop(self) {
        self.client.close().await;
        self.processor.stop().await;
    }
}

pub(crate) fn ping(streaming: bool, system: &str) -> TextCompletionRequest {
    TextCompletionRequest {
        system: system.into(),
        prompt: "ping".into(),
        streaming,
        ..Default::default()
    }
}

/// Sequential sluice round trips on an already running processor + client.
pub(crate) async fn sluice_batch(s: &Sluice, n: u64, h: &mut Histogram<u64>) {
    let req = ping(false, "");
    for _ in 0..n {
        let t0 = Instant::now();
        let records = s.client.call(&req).await.unwrap();
        assert_eq!(records.len(), 1);
        h.record(t0.elapsed().as_micros() as u64).unwrap();
    }
}

/// Requests per second with `callers` concurrent callers, and records per second.
pub(crate) async fn throughput(
    broker: &Broker,
    callers: u64,
    total: u64,
    system: &str,
) -> (f64, f64) {
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

/// Runs the scenario and writes `foundation.md`/`.json` to `out` and its table to `docs`.
pub(crate) async fn run(broker: &Broker, out: &Path, docs: &Path, round_trips: u64, requests: u64) {
    // The broker's JIT needs traffic before it settles; figures taken cold vary by
    // 2-3x from run to run. Warm it up first, unrecorded.
    eprintln!("warming up the broker …");
    let _ = throughput(broker, 64, requests / 2, "").await;
    // The three set-ups run side by side and take turns in batches of 50, so that a
    // noisy moment on the machine hits each of them alike.
    eprintln!("round trips: raw pulsar-rs (stock and split) and sluice, interleaved …");
    let mut stock_pair = RawPair::start(&broker.url, false).await;
    let mut floor_pair = RawPair::start(&broker.url, true).await;
    let sluice_pair = start_sluice(broker, 64).await;
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
        rps.push((callers, throughput(broker, callers, n, "").await.0));
    }
    eprintln!("streaming 100 records per request …");
    let (stream_rps, records_per_s) = throughput(broker, 16, requests / 20, "records=100").await;

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
    std::fs::write(out.join("foundation.md"), &md).unwrap();
    std::fs::write(
        out.join("foundation.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    splice(docs, "foundation", &md);
    println!("{md}");
}
