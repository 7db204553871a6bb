//! The prompt scenario (`bash bench/run.sh prompt`): the jsonl path through a `sluice prompt`
//! process and a `sluice text-completion` process against the fake OpenAI server, whose
//! `stamped-N-D` model writes the send time into each line's last token.
//!
//! - Latency: from a line's last token leaving the provider to its object record reaching a
//!   client, beside the same measure for the text-completion record carrying that token
//!   (the client calling text-completion directly), interleaved in one run.
//! - Throughput: objects/s through the prompt path, beside text-completion records/s for the
//!   same streams.

use std::fmt::Write as _;

use crate::procs::{terminate, wait_ready};
use hdrhistogram::Histogram;
use sluice_runtime::client::{ClientConfig, Received, RequestClient};
use sluice_schema::{PromptRequest, PromptResponse, TextCompletionRequest};
use sluice_tests::free_port;
use sluice_tests::{Broker, TextClient, fake_openai::FakeOpenAi, text_client, unique_topic};

type PromptClient = RequestClient<PromptRequest, PromptResponse>;

fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

struct Pair {
    processes: Vec<tokio::process::Child>,
    prompt: PromptClient,
    llm: TextClient,
}

/// A `sluice text-completion` process for `model` and a `sluice prompt` process in front of it.
async fn spawn_pair(
    broker: &Broker,
    fake: &FakeOpenAi,
    model: &str,
    templates: &std::path::Path,
) -> Pair {
    let exe = std::env::current_exe().unwrap().with_file_name("sluice");
    let (tc_req, tc_resp, tc_cancel) = (
        unique_topic("pb-tc-req"),
        unique_topic("pb-tc-resp"),
        unique_topic("pb-tc-cancel"),
    );
    let (p_req, p_resp) = (unique_topic("pb-p-req"), unique_topic("pb-p-resp"));
    let (tc_port, p_port) = (free_port(), free_port());
    let mut tc = tokio::process::Command::new(&exe)
        .args([
            "text-completion",
            "--provider",
            "openai-compatible",
            "--base-url",
            &fake.base_url(),
            "--model",
            model,
        ])
        .args([
            "--pulsar-url",
            &broker.url,
            "--request-topic",
            &tc_req,
            "--response-topic",
            &tc_resp,
        ])
        .args([
            "--cancel-topic",
            &tc_cancel,
            "--metrics-addr",
            &format!("127.0.0.1:{tc_port}"),
        ])
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("build the sluice binary first: cargo build --release -p sluice-cli");
    let mut prompt = tokio::process::Command::new(&exe)
        .args([
            "prompt",
            "--templates",
            templates.to_str().unwrap(),
            "--no-builtin-templates",
        ])
        .args([
            "--pulsar-url",
            &broker.url,
            "--request-topic",
            &p_req,
            "--response-topic",
            &p_resp,
        ])
        .args([
            "--llm-request-topic",
            &tc_req,
            "--llm-response-topic",
            &tc_resp,
            "--llm-cancel-topic",
            &tc_cancel,
        ])
        .args(["--metrics-addr", &format!("127.0.0.1:{p_port}")])
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_ready(&mut tc, tc_port).await;
    wait_ready(&mut prompt, p_port).await;
    let prompt_client = PromptClient::start(
        broker.bus().await,
        ClientConfig::new("prompt", &p_req, &p_resp),
        None,
    )
    .await
    .unwrap();
    Pair {
        processes: vec![tc, prompt],
        prompt: prompt_client,
        llm: text_client(broker.bus().await, &tc_req, &tc_resp).await,
    }
}

impl Pair {
    async fn stop(mut self) {
        self.prompt.close().await;
        self.llm.close().await;
        for p in self.processes.drain(..) {
            terminate(p).await;
        }
    }
}

fn request() -> PromptRequest {
    PromptRequest {
        id: "lines".into(),
        terms: [("x".to_owned(), "\"bench\"".to_owned())].into(),
        streaming: true,
    }
}

/// One prompt request: records each object's latency; returns the objects received.
async fn prompt_once(c: &PromptClient, h: &mut Histogram<u64>) -> u64 {
    let mut s = c.request(&request()).await.unwrap();
    let mut n = 0;
    while let Some(item) = s.next().await {
        if let Received::Record(r) = item.unwrap() {
            assert!(r.error.is_none(), "{r:?}");
            if let Some(o) = r.object {
                let now = now_ns();
                let v: serde_json::Value = serde_json::from_str(&o).unwrap();
                let sent = v["sent_ns"].as_u64().unwrap_or(0);
                h.record(
                    u64::try_from(now.saturating_sub(u128::from(sent)) / 1000).unwrap_or(u64::MAX),
                )
                .unwrap();
                n += 1;
            }
        }
    }
    n
}

/// One text-completion request for the same stream: records the latency of each record that
/// carries a line's stamped last token; returns the records received.
async fn llm_once(c: &TextClient, h: &mut Histogram<u64>) -> u64 {
    let req = TextCompletionRequest {
        prompt: "bench".into(),
        streaming: true,
        ..Default::default()
    };
    let mut s = c.request(&req).await.unwrap();
    let mut n = 0;
    while let Some(item) = s.next().await {
        if let Received::Record(r) = item.unwrap() {
            assert!(r.error.is_none(), "{r:?}");
            n += 1;
            if let Some(stamp) = r.response.strip_suffix("}\n") {
                let now = now_ns();
                let sent: u128 = stamp.trim().parse().unwrap_or(0);
                h.record(u64::try_from(now.saturating_sub(sent) / 1000).unwrap_or(u64::MAX))
                    .unwrap();
            }
        }
    }
    n
}

/// Runs the scenario and returns the docs table.
pub async fn bench(broker: &Broker, requests: u64, objects: u64) -> (String, serde_json::Value) {
    let fake = FakeOpenAi::start().await;
    let dir = std::env::temp_dir().join(format!("sluice-bench-prompt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let templates = dir.join("templates.json");
    std::fs::write(
        &templates,
        r#"{"templates": {"lines": {"prompt": "{{ x }}", "response-type": "jsonl",
            "schema": {"type": "object", "required": ["seq", "sent_ns"],
                       "properties": {"seq": {"type": "integer"}, "sent_ns": {"type": "integer"}}}}}}"#,
    )
    .unwrap();

    // (1) Latency: 20 lines 5 ms apart per answer, prompt and direct interleaved.
    eprintln!("prompt: latency of a line's last token to its record …");
    let pair = spawn_pair(broker, &fake, "stamped-20-5", &templates).await;
    let (mut via_prompt, mut direct) = (
        Histogram::<u64>::new(3).unwrap(),
        Histogram::<u64>::new(3).unwrap(),
    );
    prompt_once(&pair.prompt, &mut Histogram::new(3).unwrap()).await;
    llm_once(&pair.llm, &mut Histogram::new(3).unwrap()).await;
    for _ in 0..requests {
        prompt_once(&pair.prompt, &mut via_prompt).await;
        llm_once(&pair.llm, &mut direct).await;
    }
    pair.stop().await;

    // (2) Throughput: answers of `objects` lines, no pauses, 8 at a time.
    eprintln!("prompt: objects/s …");
    let pair = spawn_pair(broker, &fake, &format!("stamped-{objects}-0"), &templates).await;
    let rounds = 6u64;
    let concurrent = 8u64;
    let started = std::time::Instant::now();
    let mut total_objects = 0;
    for _ in 0..rounds {
        let got = futures::future::join_all((0..concurrent).map(|_| {
            let c = &pair.prompt;
            async move { prompt_once(c, &mut Histogram::new(3).unwrap()).await }
        }))
        .await;
        total_objects += got.iter().sum::<u64>();
    }
    let objects_per_s = total_objects as f64 / started.elapsed().as_secs_f64();
    let started = std::time::Instant::now();
    let mut total_records = 0;
    for _ in 0..rounds {
        let got = futures::future::join_all((0..concurrent).map(|_| {
            let c = &pair.llm;
            async move { llm_once(c, &mut Histogram::new(3).unwrap()).await }
        }))
        .await;
        total_records += got.iter().sum::<u64>();
    }
    let records_per_s = total_records as f64 / started.elapsed().as_secs_f64();
    pair.stop().await;

    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: Pulsar standalone on loopback, `sluice prompt` and `sluice text-completion` as processes, fake OpenAI server.\n",
        crate::report::provenance()
    );
    let _ = writeln!(
        md,
        "| a line's last token leaving the provider → its record at a client | p50 ms | p99 ms |"
    );
    let _ = writeln!(md, "|---|---|---|");
    crate::report::quantile_row(
        &mut md,
        "text-completion record carrying the token (client → text-completion directly)",
        &direct,
    );
    crate::report::quantile_row(
        &mut md,
        "prompt `object` record (client → prompt → text-completion)",
        &via_prompt,
    );
    let _ = writeln!(
        md,
        "| what the prompt hop adds (p50 difference) | {:.2} | |",
        crate::report::ms(&via_prompt, 0.5) - crate::report::ms(&direct, 0.5)
    );
    let _ = writeln!(
        md,
        "\n| throughput ({concurrent} concurrent answers of {objects} lines) | per second |"
    );
    let _ = writeln!(md, "|---|---|");
    let _ = writeln!(
        md,
        "| text-completion records (2 per line), client → text-completion | {records_per_s:.0} |"
    );
    let _ = writeln!(
        md,
        "| validated objects through the prompt jsonl path | {objects_per_s:.0} |"
    );
    let json = serde_json::json!({
        "line_to_record_ms": {
            "direct": {"p50": crate::report::ms(&direct, 0.5), "p99": crate::report::ms(&direct, 0.99)},
            "prompt": {"p50": crate::report::ms(&via_prompt, 0.5), "p99": crate::report::ms(&via_prompt, 0.99)},
        },
        "objects_per_s": objects_per_s,
        "text_completion_records_per_s": records_per_s,
    });
    (md, json)
}
