//! The structured-output scenario (`bash bench/run.sh structured`): how many JSON lines the real
//! local model (llama.cpp's server, SmolLM2-135M) gets wrong for the LLM streaming contract's
//! (docs/specs.md#the-structured-ndjson-contracts) knowledge classification, with and without
//! native structured output. Two `sluice serve` processes (the embedded default,
//! `deploy/serve/local-llm.toml`) in front of the same model: one with `--structured-output native`
//! (the template's schema as llama.cpp's JSON-schema grammar, asked for as an array of the lines'
//! objects), one with `off` (the template's instructions only). Requests alternate between them, so
//! both see the same machine. Each answer's `done` event counts the objects published and the lines
//! skipped (not JSON, or failing the schema).

use std::{fmt::Write as _, process::Stdio, time::Duration};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::procs::terminate;

/// Journal blocks in the LLM streaming contract's shape: some lasting knowledge, some activity.
fn blocks() -> Value {
    json!([
        {"block_id": "b1", "content": "Learned that Rust's borrow checker prevents data races at compile time."},
        {"block_id": "b2", "content": "Bought groceries and picked up the dry cleaning."},
        {"block_id": "b3", "content": "Insight: writing tests first makes the design of an API clearer."},
        {"block_id": "b4", "content": "Meeting with Sam at 3pm about the quarterly report."},
        {"block_id": "b5", "content": "Compound interest grows savings exponentially over long periods."},
        {"block_id": "b6", "content": "Walked the dog in the park."}
    ])
}

/// One `sluice serve` on the local model; its process and gateway URL (`http://host:port`).
async fn serve(mode: &str, max_tokens: u32) -> (tokio::process::Child, String) {
    let exe = std::env::current_exe().unwrap().with_file_name("sluice");
    let url = std::env::var("SLUICE_LLM_URL").unwrap_or_else(|_| "http://127.0.0.1:8766".into());
    let mut child = tokio::process::Command::new(exe)
        .args([
            "serve",
            "--config",
            "deploy/serve/local-llm.toml",
            "--base-url",
            &url,
        ])
        .args(["--listen", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
        .args(["--max-output-tokens", &max_tokens.to_string()])
        .args(["--structured-output", mode])
        .env_remove("SLUICE_CONFIG")
        .env_remove("SLUICE_GATEWAY_TOKEN")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("build the sluice binary first: cargo build --release -p sluice-cli");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let gateway = line
        .split("gateway on ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap()
        .to_owned();
    (child, gateway)
}

/// The blocks of [`blocks`] that are lasting knowledge (the rest are activity).
const KNOWLEDGE: [&str; 3] = ["b1", "b3", "b5"];

/// What one mode's answers came to.
#[derive(Default)]
struct Tally {
    requests: u64,
    answers: u64,
    failed: u64,
    objects: u64,
    skipped: u64,
    /// Objects naming a knowledge block (the classification right).
    right: u64,
    /// Blocks the answers covered (`items_answered`), of those asked (`items_expected`).
    answered: u64,
    expected: u64,
    secs: f64,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// One classification through the gateway at `addr` (its URL), tallied.
async fn classify(http: &reqwest::Client, addr: &str, t: &mut Tally) {
    let started = std::time::Instant::now();
    let body = json!({"id": "knowledge-classification-seed-000", "terms": {"blocks": blocks().to_string()}});
    let resp = http
        .post(format!("{}/api/v1/prompt", addr.trim_end_matches('/')))
        .json(&body)
        .send()
        .await
        .unwrap();
    let text = resp.text().await.unwrap();
    t.secs += started.elapsed().as_secs_f64();
    t.requests += 1;
    // Not streamed: one record, or the terminal error record.
    let mut done = false;
    for line in text.lines() {
        let Ok(record) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if record["error"].is_object() {
            continue;
        }
        if record["end_of_stream"] == true {
            done = true;
            t.objects += record["objects_emitted"].as_u64().unwrap_or(0);
            t.skipped += record["lines_skipped"].as_u64().unwrap_or(0);
            t.answered += record["items_answered"].as_u64().unwrap_or(0);
            t.expected += record["items_expected"].as_u64().unwrap_or(0);
            let objects: Vec<Value> = record["object"]
                .as_str()
                .and_then(|o| serde_json::from_str(o).ok())
                .unwrap_or_default();
            t.right += objects
                .iter()
                .filter(|o| {
                    o["block_id"]
                        .as_str()
                        .is_some_and(|b| KNOWLEDGE.contains(&b))
                })
                .count() as u64;
        }
    }
    // Anything else (an error record, a body that is not a record) is a failed request.
    if !done {
        t.failed += 1;
    }
    if done {
        t.answers += 1;
    }
}

/// Runs `rounds` classifications per mode, alternating; returns the Markdown table and JSON.
pub(crate) async fn bench(rounds: u64, max_tokens: u32) -> (String, Value) {
    let (native_proc, native) = serve("native", max_tokens).await;
    let (off_proc, off) = serve("off", max_tokens).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap();
    let (mut with, mut without) = (Tally::default(), Tally::default());
    for round in 0..rounds {
        // Alternate which goes first, so neither always gets the warmer cache.
        if round % 2 == 0 {
            classify(&http, &native, &mut with).await;
            classify(&http, &off, &mut without).await;
        } else {
            classify(&http, &off, &mut without).await;
            classify(&http, &native, &mut with).await;
        }
        eprintln!(
            "round {}: native {}/{} skipped, off {}/{} skipped",
            round + 1,
            with.skipped,
            with.objects + with.skipped,
            without.skipped,
            without.objects + without.skipped
        );
    }
    terminate(native_proc).await;
    terminate(off_proc).await;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: `sluice serve` twice in front of the local model (llama.cpp's server, SmolLM2-135M, temperature from the template, at most {max_tokens} output tokens), the LLM streaming contract's knowledge classification of 6 journal blocks, {rounds} requests each, alternating.\n",
        crate::report::provenance()
    );
    let _ = writeln!(
        md,
        "| `--structured-output` | answers / requests | objects per answer | of them naming a knowledge block (b1, b3, b5) | blocks covered / asked | lines skipped | s per request |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for (name, t) in [
        ("native (JSON-schema grammar)", &with),
        ("off (instructions only)", &without),
    ] {
        let _ = writeln!(
            md,
            "| {name} | {} / {} | {:.2} | {:.0}% | {:.0}% | {} | {:.2} |",
            t.answers,
            t.requests,
            ratio(t.objects, t.answers),
            100.0 * ratio(t.right, t.objects),
            100.0 * ratio(t.answered, t.expected),
            t.skipped,
            t.secs / t.requests.max(1) as f64
        );
    }
    let _ = writeln!(
        md,
        "\nLines skipped are not comparable between the rows: without a JSON mode they are mostly prose lines; with it, array elements the template's checks refused."
    );
    let tally = |t: &Tally| {
        json!({"requests": t.requests, "answers": t.answers, "failed": t.failed,
            "objects": t.objects, "right": t.right, "answered": t.answered,
            "expected": t.expected, "skipped": t.skipped, "secs": t.secs})
    };
    let json = json!({"rounds": rounds, "native": tally(&with), "off": tally(&without)});
    (md, json)
}
