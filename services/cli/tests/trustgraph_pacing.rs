//! Issue #28: on TrustGraph's topic mapping the response topics are non-persistent, and the
//! broker drops what a consumer has no permits for. TrustGraph's own request/response client
//! (trustgraph-base 2.11.1, unmodified: pulsar-client's asyncio consumer, receiver queue
//! 1,000, one response subscription for all of a service's calls) must get every record of up
//! to 512 concurrent streams from a `sluice text-completion` process: the processor paces and
//! coalesces what it publishes there.
//!
//! The load is sized to what that consumer takes on this machine now, measured first in the
//! same run: the test proves that the processor keeps to its record rate bound and that a
//! consumer given a bound it can take loses nothing, never how fast this machine is. A consumer
//! short of CPU (the test once ran beside the cluster suite's JVMs and lost 43 answers' last
//! records, 2026-11-26) gets a lower bound and fewer streams, not a failure.
//!
//! Shown failing without the pacing: `SLUICE_TEST_PACING=off cargo test --test
//! trustgraph_pacing` runs the same load with `--response-pacing off`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use sluice_tests::{
    Broker,
    fake_openai::FakeOpenAi,
    free_port, scrape,
    tg_load::{self, Flow, MODEL, TOKENS},
    value,
};

mod common;
use common::Sluice;

/// The processor's default `--max-response-records-per-sec` (half TrustGraph's receiver queue
/// per second), and the 512 streams of issue #28's report: the load when the consumer takes
/// twice the default or more.
const DEFAULT_BOUND: u64 = 500;
const STREAMS: u64 = 512;

/// The streams of the calibration: enough that the processor, unpaced, offers several times
/// what a Python consumer takes (128 streams of 50 tokens within 0.7 s), so that the consumer
/// is the bottleneck; one request each.
const CALIBRATION_STREAMS: u64 = 128;

/// A `sluice text-completion` process for `flow` under `mapping`, with `extra` arguments; its
/// metrics port.
async fn processor(
    fake: &FakeOpenAi,
    broker: &Broker,
    flow: &Flow,
    mapping: &str,
    concurrency: u64,
    pacing: &str,
    extra: &[String],
) -> (Sluice, u16) {
    let port = free_port();
    let mut args = tg_load::processor_args_mapped(
        mapping,
        &fake.base_url(),
        broker,
        flow,
        concurrency,
        pacing,
        port,
    );
    args.extend(extra.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut p = Sluice::spawn(
        &args,
        &[("SLUICE_LLM_API_KEY", "sk-test"), ("RUST_LOG", "warn")],
        &[],
    );
    p.ready(&format!("http://127.0.0.1:{port}/readyz")).await;
    (p, port)
}

/// The load the consumer can take: the record rate bound and the concurrent streams. The bound
/// is half the rate the consumer took in the calibration (the other half is headroom for the
/// consumer's own requests and for a CPU share that changes during the run), at most the
/// default; the streams are 512 at the default bound and fewer in proportion below it (at
/// least 16), so that a wave of streams (a first and a last record each, about) goes out in
/// about two seconds whatever the bound, well inside the 5 s after which a waiting record is
/// let through unpaced. On a consumer that takes 1,000 records/s or more this is issue #28's load, the
/// default bound and 512 streams.
fn sized_to(consumer_records_per_sec: f64) -> (u64, u64) {
    let bound = ((consumer_records_per_sec / 2.0) as u64).clamp(1, DEFAULT_BOUND);
    let streams = (bound * STREAMS / DEFAULT_BOUND).clamp(16, STREAMS);
    (bound, streams)
}

#[test]
fn the_load_is_sized_to_the_consumer() {
    assert_eq!(sized_to(5000.0), (500, 512));
    assert_eq!(sized_to(1000.0), (500, 512));
    assert_eq!(sized_to(600.0), (300, 307));
    assert_eq!(sized_to(20.0), (10, 16));
    assert_eq!(sized_to(0.0), (1, 16));
}

#[tokio::test]
async fn trustgraphs_own_client_gets_every_record_of_concurrent_streams_at_the_bound_it_takes() {
    let Some(venv) = sluice_tests::outside_tool(
        "TG_FLOW_VENV",
        "TrustGraph's request/response client against a paced text-completion",
    ) else {
        return;
    };
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let pacing = std::env::var("SLUICE_TEST_PACING").unwrap_or_else(|_| "auto".into());

    // What the consumer takes now: the same client and driver on persistent topics, where the
    // broker holds back what the consumer has no permits for (nothing is lost), with a record
    // per token offered far faster than it can read.
    let calibration = Flow::durable("tc-pace-rate");
    let (p, _) = processor(
        &fake,
        &broker,
        &calibration,
        "durable",
        CALIBRATION_STREAMS,
        "off",
        &[],
    )
    .await;
    let measured = tg_load::drive(
        &venv,
        &broker,
        &calibration,
        CALIBRATION_STREAMS,
        CALIBRATION_STREAMS,
    )
    .await;
    p.stop().await;
    assert_eq!(measured["complete"], CALIBRATION_STREAMS, "{measured}");
    let rate = measured["records_per_second"].as_f64().unwrap();
    let (bound, streams) = sized_to(rate);
    eprintln!(
        "the consumer took {rate} records/s: bound {bound} records/s, {streams} concurrent streams"
    );

    let flow = Flow::unique("tc-pace");
    let (processor, port) = processor(
        &fake,
        &broker,
        &flow,
        "trustgraph",
        streams,
        &pacing,
        &[
            "--max-response-records-per-sec".to_owned(),
            bound.to_string(),
        ],
    )
    .await;
    let requests = 2 * streams;
    let report = tg_load::drive(&venv, &broker, &flow, requests, streams).await;
    eprintln!("pacing {pacing}: {report}");
    let metrics = scrape(port).await;
    let stopped = processor.stop().await;
    for key in ["timed_out", "errors", "wrong_text", "wrong_tokens"] {
        assert_eq!(
            report[key], 0,
            "{key}: every stream must arrive whole: {report}\n{}",
            stopped.stderr
        );
    }
    assert_eq!(report["complete"], requests, "{report}");
    // Every request reached the provider once: nothing was answered twice or twice asked
    // (the calibration's requests included).
    assert_eq!(fake.calls(MODEL) as u64, CALIBRATION_STREAMS + requests);
    if pacing == "auto" {
        // The pacing did the work: deltas were merged, so far fewer records than tokens.
        let coalesced = value(
            &metrics,
            "sluice_processor_deltas_coalesced_total",
            &[("processor", "text-completion")],
        );
        assert!(coalesced > 0.0, "no delta was coalesced:\n{metrics}");
        let per_request = report["records_per_request"].as_f64().unwrap();
        assert!(
            per_request < (TOKENS + 2) as f64,
            "{per_request} records per request: nothing was coalesced"
        );
    }
}
