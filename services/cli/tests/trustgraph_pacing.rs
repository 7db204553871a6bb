//! Issue #28: on TrustGraph's topic mapping the response topics are non-persistent, and the
//! broker drops what a consumer has no permits for. TrustGraph's own request/response client
//! (trustgraph-base 2.11.1, unmodified: pulsar-client's asyncio consumer, receiver queue
//! 1,000, one response subscription for all of a service's calls) must get every record of
//! 512 concurrent streams from a `sluice text-completion` process: the processor paces and
//! coalesces what it publishes there.
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

#[tokio::test]
async fn trustgraphs_own_client_gets_every_record_of_512_concurrent_streams() {
    let Some(venv) = sluice_tests::outside_tool(
        "TG_FLOW_VENV",
        "TrustGraph's request/response client against a paced text-completion",
    ) else {
        return;
    };
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let flow = Flow::unique("tc-pace");
    let port = free_port();
    let pacing = std::env::var("SLUICE_TEST_PACING").unwrap_or_else(|_| "auto".into());
    let args = tg_load::processor_args(&fake.base_url(), &broker, &flow, 512, &pacing, port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut processor = Sluice::spawn(
        &args,
        &[("SLUICE_LLM_API_KEY", "sk-test"), ("RUST_LOG", "warn")],
        &[],
    );
    processor
        .ready(&format!("http://127.0.0.1:{port}/readyz"))
        .await;

    let report = tg_load::drive(&venv, &broker, &flow, 1024, 512).await;
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
    assert_eq!(report["complete"], 1024, "{report}");
    // Every request reached the provider once: nothing was answered twice or twice asked.
    assert_eq!(fake.calls(MODEL), 1024);
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
