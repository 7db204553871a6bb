//! The gateway scenario: the gateway's routes (its NDJSON events, OpenAI's chat completions,
//! and the other dialects: Ollama's, Anthropic's Messages, OpenAI's Responses) over the broker
//! against calling the fake provider directly.

use std::{
    fmt::Write as _, sync::Arc, sync::atomic::AtomicU64, sync::atomic::Ordering, time::Duration,
    time::Instant,
};

use futures::StreamExt;
use sluice_tests::{Broker, free_port};

use crate::{procs::*, report::*};

/// Sends `request` and hands each frame of its streamed answer (the bytes up to and including
/// `separator`) to `frame`, in order, to the end of the stream. Panics (a bench) unless the
/// answer is a success; `who` names the server in that message.
async fn stream_frames(
    request: reqwest::RequestBuilder,
    who: &str,
    separator: &[u8],
    mut frame: impl FnMut(&[u8]),
) {
    let resp = request.send().await.unwrap();
    assert!(
        resp.status().is_success(),
        "{who} answered {}",
        resp.status()
    );
    let mut body = resp.bytes_stream();
    let mut buf = Vec::new();
    while let Some(bytes) = body.next().await {
        buf.extend_from_slice(&bytes.unwrap());
        while let Some(end) = buf.windows(separator.len()).position(|w| w == separator) {
            let framed: Vec<u8> = buf.drain(..end + separator.len()).collect();
            frame(&framed);
        }
    }
}

/// POSTs one NDJSON request to the gateway and reads its stream to the end. Returns the time
/// to the first `token` line and whether the stream ended with a successful `done`.
pub(crate) async fn gateway_call(http: &reqwest::Client, url: &str) -> (Option<Duration>, bool) {
    let t0 = Instant::now();
    let (mut first, mut ok) = (None, false);
    let request = http
        .post(url)
        .header("accept", "application/x-ndjson")
        .json(&serde_json::json!({"prompt": "bench"}));
    stream_frames(request, "the gateway", b"\n", |line| {
        let event: serde_json::Value = serde_json::from_slice(line).unwrap();
        match event["type"].as_str() {
            Some("token") if first.is_none() => first = Some(t0.elapsed()),
            Some("done") => ok = event["reason"] == "success",
            _ => {}
        }
    })
    .await;
    (first, ok)
}

/// POSTs one streaming chat completion to an OpenAI-compatible server (the gateway's OpenAI
/// route, or the fake provider called directly as a provider SDK would) and reads its SSE to
/// the end. Returns the time to the first event carrying non-empty content (OpenAI's first
/// chunk, which the route sends too, carries only the role and `"content":""`) and whether
/// `[DONE]` arrived. `who` names the server in a failure.
pub(crate) async fn openai_call(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    who: &str,
) -> (Option<Duration>, bool) {
    openai_call_as(http, url, model, who, None).await
}

/// [`openai_call`] with `key` as the bearer token.
pub(crate) async fn openai_call_as(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    who: &str,
    key: Option<&str>,
) -> (Option<Duration>, bool) {
    let t0 = Instant::now();
    let (mut first, mut ok) = (None, false);
    let mut request = http
        .post(url)
        .json(&serde_json::json!({"model": model, "stream": true,
            "messages": [{"role": "user", "content": "bench"}]}));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    stream_frames(request, who, b"\n\n", |event| {
        let event = String::from_utf8_lossy(event);
        if first.is_none() && event.contains("\"content\"") && !event.contains("\"content\":\"\"") {
            first = Some(t0.elapsed());
        }
        ok |= event.contains("[DONE]");
    })
    .await;
    (first, ok)
}

/// A dialect the gateway speaks beside its own events and OpenAI's chat completions: where it
/// is served, a streamed request's body for a model, how its frames are separated, which frame
/// carries the first content, and which one says the answer completed.
pub(crate) struct Dialect {
    /// The row's words in the table.
    pub(crate) label: &'static str,
    /// Its short name, in the ratio's row.
    pub(crate) name: &'static str,
    /// The key of its figures in the JSON file.
    pub(crate) key: &'static str,
    pub(crate) path: &'static str,
    pub(crate) body: fn(&str) -> serde_json::Value,
    pub(crate) separator: &'static [u8],
    pub(crate) first: fn(&str) -> bool,
    pub(crate) done: fn(&str) -> bool,
}

/// The dialects measured beside the OpenAI route, each streamed as its clients stream it.
pub(crate) const DIALECTS: [Dialect; 3] = [
    Dialect {
        label: "Ollama's API (`POST /api/chat`, NDJSON lines)",
        name: "Ollama",
        key: "ollama_chat",
        path: "/api/chat",
        body: |model| {
            serde_json::json!({"model": model, "stream": true,
                "messages": [{"role": "user", "content": "bench"}]})
        },
        separator: b"\n",
        first: |line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["message"]["content"].as_str().map(|c| !c.is_empty()))
                .unwrap_or(false)
        },
        done: |line| {
            serde_json::from_str::<serde_json::Value>(line)
                .is_ok_and(|v| v["done"] == true && v["done_reason"] == "stop")
        },
    },
    Dialect {
        label: "Anthropic's Messages API (`POST /v1/messages`, SSE events)",
        name: "Messages API",
        key: "anthropic_messages",
        path: "/v1/messages",
        body: |model| {
            serde_json::json!({"model": model, "stream": true, "max_tokens": 64,
                "messages": [{"role": "user", "content": "bench"}]})
        },
        separator: b"\n\n",
        first: |event| event.contains("\"text_delta\""),
        done: |event| event.starts_with("event: message_stop"),
    },
    Dialect {
        label: "OpenAI's Responses API (`POST /v1/responses`, SSE events)",
        name: "Responses API",
        key: "openai_responses",
        path: "/v1/responses",
        body: |model| serde_json::json!({"model": model, "stream": true, "input": "bench"}),
        separator: b"\n\n",
        first: |event| event.contains("\"response.output_text.delta\""),
        done: |event| event.contains("\"response.completed\""),
    },
];

/// Streams one request of `dialect` from the gateway at `base` ("http://host:port") and reads
/// it to the end. Returns the time to the first frame with content and whether the answer
/// completed.
pub(crate) async fn dialect_call(
    http: &reqwest::Client,
    base: &str,
    dialect: &Dialect,
    model: &str,
) -> (Option<Duration>, bool) {
    let t0 = Instant::now();
    let (mut first, mut ok) = (None, false);
    let request = http
        .post(format!("{base}{}", dialect.path))
        .json(&(dialect.body)(model));
    stream_frames(request, dialect.label, dialect.separator, |frame| {
        let frame = String::from_utf8_lossy(frame);
        if first.is_none() && (dialect.first)(&frame) {
            first = Some(t0.elapsed());
        }
        ok |= (dialect.done)(&frame);
    })
    .await;
    (first, ok)
}

/// Requests per second through the gateway with `streams` concurrent HTTP streams, and how
/// many of the `total` requests ended with a successful `done`.
pub(crate) async fn gateway_throughput(url: &str, streams: u64, total: u64) -> (f64, u64) {
    let http = reqwest::Client::new();
    let remaining = Arc::new(AtomicU64::new(total));
    let succeeded = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..streams)
        .map(|_| {
            let (http, url, remaining, succeeded) = (
                http.clone(),
                url.to_owned(),
                remaining.clone(),
                succeeded.clone(),
            );
            tokio::spawn(async move {
                while remaining
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                    .is_ok()
                {
                    if gateway_call(&http, &url).await.1 {
                        succeeded.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    (
        total as f64 / t0.elapsed().as_secs_f64(),
        succeeded.load(Ordering::Relaxed),
    )
}

/// The bench's API key (a key of its own keys file, on loopback).
const BENCH_KEY: &str = "sk-sluice-bench-key";

pub(crate) async fn gateway_bench(
    broker: &Broker,
    requests: u64,
    levels: &[u64],
    throughput_requests: u64,
) -> (String, serde_json::Value) {
    sluice_runtime::install_crypto_provider();
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let fake_url = format!("{}/v1/chat/completions", fake.base_url());
    // The gateway as deployed: its own process on the default topics, where the processor
    // process answers; and a second one with resumable streams off (no event ids, no position
    // kept per record), for what resuming costs.
    let (gateway, addr) = start_gateway(broker, &[]).await;
    let (gateway_off, addr_off) = start_gateway(broker, &["--resume-window-secs", "0"]).await;
    // A third with an API key whose limits are never reached: what the key's lookup, its
    // admission and the limit state shared through the broker cost.
    let keys_file =
        std::env::temp_dir().join(format!("sluice-bench-keys-{}.toml", std::process::id()));
    std::fs::write(
        &keys_file,
        sluice_tests::keys::keys_toml(&[(
            "bench",
            BENCH_KEY,
            "requests_per_minute = 100000000\ntokens_per_minute = 100000000000\ntokens_per_day = 100000000000",
        )]),
    )
    .unwrap();
    let keys_path = keys_file.display().to_string();
    let (gateway_keys, addr_keys) = start_gateway(broker, &["--keys-file", &keys_path]).await;
    let openai_keys_url = format!("http://{addr_keys}/v1/chat/completions");
    // A fourth on a topicspace of its own, where a processor with the usage ledger off
    // answers: what writing one usage record per request (before its ack) costs.
    let (gateway_nol, addr_nol) =
        start_gateway(broker, &["--topicspace", NO_LEDGER_TOPICSPACE]).await;
    let openai_nol_url = format!("http://{addr_nol}/v1/chat/completions");
    let url = format!("http://{addr}/api/v1/text-completion");
    let openai_url = format!("http://{addr}/v1/chat/completions");
    let openai_off_url = format!("http://{addr_off}/v1/chat/completions");

    // (1) Time to first token, interleaved: the fake called directly vs through the gateway.
    // The fake's first token comes 2 ms after the request, as in the text-completion scenario.
    let model = "tokens-5-2";
    let processor = gateway_processor(broker, &fake.base_url(), model).await;
    let processor_nol = no_ledger_processor(broker, &fake.base_url(), model).await;
    let http = reqwest::Client::new();
    let (mut h_direct, mut h_gateway, mut h_openai, mut h_off, mut h_keys, mut h_nol) =
        (hist(), hist(), hist(), hist(), hist(), hist());
    let mut h_dialects: Vec<_> = DIALECTS.iter().map(|_| hist()).collect();
    let base = format!("http://{addr}");
    for i in 0..requests + 50 {
        let (d, d_ok) = openai_call(&http, &fake_url, model, "the fake provider").await;
        let (g, g_ok) = gateway_call(&http, &url).await;
        let (o, o_ok) = openai_call(&http, &openai_url, model, "the OpenAI route").await;
        let (f, f_ok) = openai_call(&http, &openai_off_url, model, "resuming off").await;
        let (k, k_ok) =
            openai_call_as(&http, &openai_keys_url, model, "API keys", Some(BENCH_KEY)).await;
        let (n, n_ok) = openai_call(&http, &openai_nol_url, model, "the ledger off").await;
        assert!(
            d_ok && g_ok && o_ok && f_ok && k_ok && n_ok,
            "a stream did not complete"
        );
        if i >= 50 {
            h_direct.record(d.unwrap().as_micros() as u64).unwrap();
            h_gateway.record(g.unwrap().as_micros() as u64).unwrap();
            h_openai.record(o.unwrap().as_micros() as u64).unwrap();
            h_off.record(f.unwrap().as_micros() as u64).unwrap();
            h_keys.record(k.unwrap().as_micros() as u64).unwrap();
            h_nol.record(n.unwrap().as_micros() as u64).unwrap();
        }
        // Each dialect right after the OpenAI route on the same gateway, so its ratio to
        // that route compares requests made moments apart.
        for (dialect, h) in DIALECTS.iter().zip(&mut h_dialects) {
            let (t, ok) = dialect_call(&http, &base, dialect, model).await;
            assert!(ok, "a stream of {} did not complete", dialect.label);
            if i >= 50 {
                h.record(t.unwrap().as_micros() as u64).unwrap();
            }
        }
    }
    terminate(gateway_off).await;
    terminate(gateway_keys).await;
    let _ = std::fs::remove_file(&keys_file);
    terminate(processor).await;
    terminate(processor_nol).await;

    // (2) Requests/s with short streams (5 tokens, no delay) at each concurrency.
    let processor = gateway_processor(broker, &fake.base_url(), "tokens-5-0").await;
    // Warm-up, unrecorded: the broker's JIT and the connection pools.
    let _ = gateway_throughput(&url, 64, throughput_requests / 5).await;
    let mut rps = Vec::new();
    for &streams in levels {
        let n = if streams == 1 {
            throughput_requests / 10
        } else {
            throughput_requests
        };
        eprintln!("gateway throughput with {streams} concurrent streams …");
        let (r, ok) = gateway_throughput(&url, streams, n).await;
        rps.push((streams, r, ok, n));
    }
    // The same at 64 streams with the ledger off, right after the run with it on.
    let processor_nol = no_ledger_processor(broker, &fake.base_url(), "tokens-5-0").await;
    let url_nol = format!("http://{addr_nol}/api/v1/text-completion");
    let _ = gateway_throughput(&url_nol, 64, throughput_requests / 5).await;
    eprintln!("gateway throughput with 64 concurrent streams, the ledger off …");
    let (r_nol, ok_nol) = gateway_throughput(&url_nol, 64, throughput_requests).await;
    let (r_on, ok_on) = gateway_throughput(&url, 64, throughput_requests).await;
    terminate(processor_nol).await;
    terminate(gateway_nol).await;
    terminate(processor).await;
    terminate(gateway).await;

    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: Pulsar standalone on loopback, fake OpenAI server over HTTP; `sluice gateway` and `sluice text-completion` as processes.\n",
        provenance()
    );
    let (d50, d99, g50, g99) = (
        ms(&h_direct, 0.5),
        ms(&h_direct, 0.99),
        ms(&h_gateway, 0.5),
        ms(&h_gateway, 0.99),
    );
    let _ = writeln!(
        md,
        "| time to first token (NDJSON `token` line vs first SSE content event) | p50 ms | p99 ms |\n|---|---|---|"
    );
    let _ = writeln!(
        md,
        "| fake provider called directly (reqwest, streaming) | {d50:.2} | {d99:.2} |"
    );
    let _ = writeln!(
        md,
        "| HTTP → `sluice gateway` → broker → `sluice text-completion` → provider → broker → gateway → HTTP | {g50:.2} | {g99:.2} |"
    );
    let (o50, o99) = (ms(&h_openai, 0.5), ms(&h_openai, 0.99));
    let _ = writeln!(
        md,
        "| the same through the OpenAI route (`POST /v1/chat/completions`, SSE chunks) | {o50:.2} | {o99:.2} |"
    );
    let _ = writeln!(
        md,
        "| ratio (gateway / direct) | {:.2}x | {:.2}x |",
        g50 / d50,
        g99 / d99
    );
    let _ = writeln!(
        md,
        "| ratio (OpenAI route / direct) | {:.2}x | {:.2}x |",
        o50 / d50,
        o99 / d99
    );
    let _ = writeln!(
        md,
        "| ratio (OpenAI route / NDJSON events route) | {:.2}x | {:.2}x |",
        o50 / g50,
        o99 / g99
    );
    let mut dialect_json = serde_json::Map::new();
    for (dialect, h) in DIALECTS.iter().zip(&h_dialects) {
        let (p50, p99) = (ms(h, 0.5), ms(h, 0.99));
        let _ = writeln!(
            md,
            "| the same through {} | {p50:.2} | {p99:.2} |",
            dialect.label
        );
        let _ = writeln!(
            md,
            "| ratio ({} / OpenAI route) | {:.2}x | {:.2}x |",
            dialect.name,
            p50 / o50,
            p99 / o99
        );
        dialect_json.insert(
            dialect.key.to_owned(),
            serde_json::json!({"p50": p50, "p99": p99,
                "vs_openai_route": {"p50": p50 / o50, "p99": p99 / o99}}),
        );
    }
    let (f50, f99) = (ms(&h_off, 0.5), ms(&h_off, 0.99));
    let _ = writeln!(
        md,
        "| the OpenAI route on a gateway with resumable streams off (`--resume-window-secs 0`) | {f50:.2} | {f99:.2} |"
    );
    let _ = writeln!(
        md,
        "| ratio (resumable streams on / off, OpenAI route) | {:.2}x | {:.2}x |",
        o50 / f50,
        o99 / f99
    );
    let (k50, k99) = (ms(&h_keys, 0.5), ms(&h_keys, 0.99));
    let _ = writeln!(
        md,
        "| the OpenAI route with an API key and its limits (`--keys-file`, shared through the broker) | {k50:.2} | {k99:.2} |"
    );
    let _ = writeln!(
        md,
        "| ratio (API key with limits / the gateway's token-free route, OpenAI route) | {:.2}x | {:.2}x |",
        k50 / o50,
        k99 / o99
    );
    let (n50, n99) = (ms(&h_nol, 0.5), ms(&h_nol, 0.99));
    let _ = writeln!(
        md,
        "| the OpenAI route to a processor with the usage ledger off (`--usage-topic none`) | {n50:.2} | {n99:.2} |"
    );
    let _ = writeln!(
        md,
        "| ratio (usage ledger on / off, OpenAI route) | {:.2}x | {:.2}x |",
        o50 / n50,
        o99 / n99
    );
    let _ = writeln!(
        md,
        "| overhead (difference) | {:.2} | {:.2} |\n",
        g50 - d50,
        g99 - d99
    );
    let _ = writeln!(
        md,
        "| concurrent HTTP streams (5 tokens each, no delay) | requests/s | completed |\n|---|---|---|"
    );
    for (streams, r, ok, n) in &rps {
        let _ = writeln!(md, "| {streams} | {r:.0} | {ok}/{n} |");
    }
    let n = throughput_requests;
    let _ = writeln!(
        md,
        "| 64, the usage ledger off, then on again (same run) | {r_nol:.0}, then {r_on:.0} ({:.2}x) | {ok_nol}/{n}, {ok_on}/{n} |",
        r_on / r_nol
    );
    let json = serde_json::json!({
        "ttft_ms": {
            "direct": {"p50": d50, "p99": d99},
            "gateway": {"p50": g50, "p99": g99},
            "openai_route": {"p50": o50, "p99": o99},
            "openai_route_vs_gateway": {"p50": o50 / g50, "p99": o99 / g99},
            "dialects": dialect_json,
            "openai_route_resume_off": {"p50": f50, "p99": f99},
            "resume_on_vs_off": {"p50": o50 / f50, "p99": o99 / f99},
            "openai_route_api_key": {"p50": k50, "p99": k99},
            "api_key_vs_none": {"p50": k50 / o50, "p99": k99 / o99},
            "openai_route_ledger_off": {"p50": n50, "p99": n99},
            "ledger_on_vs_off": {"p50": o50 / n50, "p99": o99 / n99},
            "ratio": {"p50": g50 / d50, "p99": g99 / d99},
            "overhead": {"p50": g50 - d50, "p99": g99 - d99},
        },
        "requests_per_s": rps.iter().map(|(c, r, ok, n)| (c.to_string(),
            serde_json::json!({"requests_per_s": r, "completed": ok, "requests": n})))
            .collect::<std::collections::BTreeMap<_, _>>(),
        "requests_per_s_64_ledger": {"off": r_nol, "on": r_on, "on_vs_off": r_on / r_nol},
    });
    (md, json)
}

/// The topicspace where the processor with the usage ledger off answers.
const NO_LEDGER_TOPICSPACE: &str = "benchnoledger";

/// `sluice text-completion` in [`NO_LEDGER_TOPICSPACE`] with the usage ledger off.
async fn no_ledger_processor(
    broker: &Broker,
    fake_url: &str,
    model: &str,
) -> tokio::process::Child {
    topicspace_processor(
        broker,
        fake_url,
        model,
        NO_LEDGER_TOPICSPACE,
        &["--usage-topic", "none"],
    )
    .await
}

/// Starts a `sluice gateway` process for text-completion on the default topics with `extra`
/// flags, once ready; returns it and the address it listens on.
pub(crate) async fn start_gateway(
    broker: &Broker,
    extra: &[&str],
) -> (tokio::process::Child, String) {
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let mut args = vec![
        "gateway",
        "--services",
        "text-completion",
        "--listen",
        "127.0.0.1:0",
        "--metrics-addr",
        &metrics_addr,
        "--pulsar-url",
        &broker.url,
        "--pulsar-admin-url",
        &broker.admin_url,
    ];
    args.extend_from_slice(extra);
    let mut gateway = sluice_process(&args);
    let addr = announced(&mut gateway, "gateway listening on ").await;
    wait_ready(&mut gateway, metrics_port).await;
    (gateway, addr)
}
