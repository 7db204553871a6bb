//! Issue #28's load: a `sluice text-completion` process on TrustGraph's topic mapping, read
//! by TrustGraph's own request/response client (trustgraph-base 2.11.1 in the venv of
//! `scripts/tg-flow-venv.sh`, driven by `tests/py/tg/llm_load.py`: one Python consumer,
//! receiver queue 1,000, as TrustGraph's services use it). The pacing test
//! (`services/cli/tests/trustgraph_pacing.rs`) and the pacing bench (`bench/src/pacing.rs`)
//! run the same processor and the same driver through this module.

use serde_json::Value;

use crate::Broker;

/// The fake model the load asks for: 50 one-word tokens 10 ms apart, the first after 200 ms
/// (the load of issue #28's report).
pub const MODEL: &str = "tokens-50-10-200";

/// How many tokens [`MODEL`] streams.
pub const TOKENS: u64 = 50;

/// A flow's request and response topics on TrustGraph's mapping, unique to one run.
pub struct Flow {
    /// The request topic, in TrustGraph's `request:tg:NAME` form.
    pub request: String,
    /// The response topic, in TrustGraph's `response:tg:NAME` form.
    pub response: String,
}

impl Flow {
    /// Fresh topics named `{prefix}-{uuid}`.
    pub fn unique(prefix: &str) -> Self {
        let name = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
        Self {
            request: format!("request:tg:{name}"),
            response: format!("response:tg:{name}"),
        }
    }

    /// Fresh persistent topics named `{prefix}-{uuid}`, as Pulsar URLs (which TrustGraph's
    /// client and sluice both take as given): a broker holds back what a consumer has no
    /// permits for instead of dropping it, so a load there measures what the consumer takes
    /// without losing anything ([`processor_args_mapped`] with `durable`).
    pub fn durable(prefix: &str) -> Self {
        let name = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
        Self {
            request: format!("persistent://tg/request/{name}"),
            response: format!("persistent://tg/response/{name}"),
        }
    }
}

/// The `sluice` arguments of a text-completion process serving `flow` on `broker` with the
/// fake provider at `base_url`: `concurrency` streams at once, `--response-pacing pacing`,
/// metrics on `metrics_port`. Its environment needs `SLUICE_LLM_API_KEY`.
pub fn processor_args(
    base_url: &str,
    broker: &Broker,
    flow: &Flow,
    concurrency: u64,
    pacing: &str,
    metrics_port: u16,
) -> Vec<String> {
    processor_args_mapped(
        "trustgraph",
        base_url,
        broker,
        flow,
        concurrency,
        pacing,
        metrics_port,
    )
}

/// The same under topic mapping `mapping` (`trustgraph` or `durable`).
pub fn processor_args_mapped(
    mapping: &str,
    base_url: &str,
    broker: &Broker,
    flow: &Flow,
    concurrency: u64,
    pacing: &str,
    metrics_port: u16,
) -> Vec<String> {
    [
        "text-completion",
        "--provider",
        "openai-compatible",
        "--base-url",
        base_url,
        "--model",
        MODEL,
        "--topic-mapping",
        mapping,
        "--pulsar-url",
        &broker.url,
        "--pulsar-admin-url",
        &broker.admin_url,
        "--request-topic",
        &flow.request,
        "--response-topic",
        &flow.response,
        "--concurrency",
        &concurrency.to_string(),
        "--response-pacing",
        pacing,
        "--metrics-addr",
        &format!("127.0.0.1:{metrics_port}"),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// Sends `requests` requests, `concurrency` at a time, through TrustGraph's client (the
/// Python of `venv`) and returns the driver's report: requests complete, timed out (a record
/// gap of 30 s), with wrong text or token counts, records per request, the records per second
/// the consumer took between its first and last record, the consumer's CPU, time to the first
/// record. Panics with the driver's output when it fails.
pub async fn drive(
    venv: &str,
    broker: &Broker,
    flow: &Flow,
    requests: u64,
    concurrency: u64,
) -> Value {
    let driver = concat!(env!("CARGO_MANIFEST_DIR"), "/py/tg/llm_load.py");
    let out = tokio::process::Command::new(format!("{venv}/bin/python"))
        .args([
            driver,
            "--pulsar-url",
            &broker.url,
            "--request-topic",
            &flow.request,
            "--response-topic",
            &flow.response,
            "--requests",
            &requests.to_string(),
            "--concurrency",
            &concurrency.to_string(),
            "--tokens",
            &TOKENS.to_string(),
            "--idle-timeout",
            "30",
        ])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the load driver failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap()
}
