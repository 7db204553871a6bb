//! Issue #28: a `sluice text-completion` process on TrustGraph's mapping, read by TrustGraph's
//! own request/response client (trustgraph-base 2.11.1 in the venv of
//! scripts/tg-flow-venv.sh, driven by tests/py/tg/llm_load.py: one Python consumer, receiver
//! queue 1,000), with the response records unpaced and paced, at each concurrency. The fake
//! model streams 50 tokens 10 ms apart after 200 ms. Per run: requests complete, lost (timed
//! out or wrong text), records per request, the consumer's CPU, time to the first record.

use std::fmt::Write as _;

use serde_json::Value;
use sluice_tests::{
    Broker,
    tg_load::{self, Flow},
};

use crate::procs::wait_ready;
use sluice_tests::free_port;

/// One process and one load: what TrustGraph's client saw.
async fn run(
    broker: &Broker,
    fake: &sluice_tests::fake_openai::FakeOpenAi,
    venv: &str,
    pacing: &str,
    concurrency: u64,
    requests: u64,
) -> Value {
    let flow = Flow::unique("bench-pace");
    let exe = std::env::current_exe().unwrap().with_file_name("sluice");
    let port = free_port();
    let mut child = tokio::process::Command::new(exe)
        .args(tg_load::processor_args(
            &fake.base_url(),
            broker,
            &flow,
            concurrency,
            pacing,
            port,
        ))
        .env("SLUICE_LLM_API_KEY", "bench")
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("build the sluice binary first");
    wait_ready(&mut child, port).await;
    let mut row = tg_load::drive(venv, broker, &flow, requests, concurrency).await;
    let _ = child.kill().await;
    row["pacing"] = pacing.into();
    row
}

/// Runs unpaced and paced at each concurrency; returns the docs table and the rows as JSON.
pub async fn bench(broker: &Broker, levels: &[u64], per_caller: u64) -> (String, Value) {
    let venv = std::env::var("TG_FLOW_VENV")
        .expect("TG_FLOW_VENV: the venv of scripts/tg-flow-venv.sh (bench/run.sh sets it)");
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let mut rows = Vec::new();
    for &c in levels {
        for pacing in ["off", "auto"] {
            eprintln!("pacing {pacing}: {c} concurrent streams …");
            rows.push(run(broker, &fake, &venv, pacing, c, c * per_caller).await);
        }
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: Pulsar standalone on loopback; one `sluice text-completion --topic-mapping trustgraph` process (default pacing settings when paced: 100 ms, 1,000 records/s); the fake model streams 50 tokens 10 ms apart after 200 ms; TrustGraph's own client (trustgraph-base 2.11.1 `RequestResponseClient`, one consumer, receiver queue 1,000; `tests/py/tg/llm_load.py`), callers in a closed loop ({per_caller} requests each), a record gap of 30 s ends a request as timed out.\n",
        crate::report::provenance()
    );
    let _ = writeln!(
        md,
        "| pacing | concurrent streams | requests | complete | timed out | wrong text | records per request (received) | consumer CPU s | consumer CPU ms per request | first record p50 / p99 ms | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in &rows {
        let requests = r["requests"].as_f64().unwrap_or(1.0).max(1.0);
        let cpu = r["consumer_cpu_seconds"].as_f64().unwrap_or(0.0);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {} / {} | {} |",
            if r["pacing"] == "off" { "off" } else { "paced" },
            r["concurrency"],
            r["requests"],
            r["complete"],
            r["timed_out"],
            r["wrong_text"],
            r["records_per_request"],
            cpu,
            1000.0 * cpu / requests,
            r["first_record_p50_ms"],
            r["first_record_p99_ms"],
            r["wall_seconds"],
        );
    }
    (md, serde_json::json!({ "rows": rows }))
}
