//! API keys with limits that hold across gateway replicas (docs/gateway.md#api-keys): three
//! `sluice gateway` processes on the real broker share one keys file and their counts, under
//! callers of several keys at once; a fourth started afterwards knows the day's usage; a key
//! removed from the file stops working on every replica within seconds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use sluice_gateway::keys::hash_hex;
use sluice_tests::{
    Broker, PATIENCE, eventually_every, fake_openai::FakeOpenAi, free_port, keys::KeysFile,
    metrics_text,
};

mod common;
use common::Sluice;
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message as WsMessage;

async fn next_json(
    ws: &mut tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
) -> serde_json::Value {
    loop {
        let m = tokio::time::timeout(PATIENCE, ws.next())
            .await
            .expect("a frame")
            .unwrap()
            .unwrap();
        if let WsMessage::Text(t) = m {
            return serde_json::from_str(t.as_str()).unwrap();
        }
    }
}

/// Concurrent callers per key per replica.
const CALLERS: usize = 4;
const REPLICAS: usize = 3;
/// The secret the replicas share: their limit state is sealed with it.
const SECRET: &str = "gateway-keys-test-secret-0123456789abcdef";

/// What one key's callers got.
#[derive(Debug, Default)]
struct Outcome {
    admitted: usize,
    limited: usize,
    /// The `usage.total_tokens` the admitted requests were told.
    tokens: u64,
    /// Status, `Retry-After`, error type and code of a 429.
    refusal: Option<(u16, Option<u64>, String, String)>,
}

/// `CALLERS` callers on each replica send `attempts` chat requests each with `key`, one after
/// another (a refused one after 20 ms: the limit's window is a minute, so a caller honouring
/// `Retry-After` would simply stop).
async fn load(
    urls: &[String],
    key: &str,
    model: &str,
    max_tokens: u32,
    attempts: usize,
) -> Outcome {
    let http = reqwest::Client::new();
    let mut callers = tokio::task::JoinSet::new();
    for url in urls {
        for _ in 0..CALLERS {
            let (http, url, key, model) =
                (http.clone(), url.clone(), key.to_owned(), model.to_owned());
            callers.spawn(async move {
                let mut out = Outcome::default();
                for _ in 0..attempts {
                    let resp = http
                        .post(format!("{url}/v1/chat/completions"))
                        .bearer_auth(&key)
                        .json(
                            &serde_json::json!({"model": model, "max_tokens": max_tokens,
                            "stream": true, "stream_options": {"include_usage": true},
                            "messages": [{"role": "user", "content": "hi"}]}),
                        )
                        .send()
                        .await
                        .unwrap();
                    let status = resp.status().as_u16();
                    let retry = resp
                        .headers()
                        .get("retry-after")
                        .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
                    let text = resp.text().await.unwrap();
                    match status {
                        200 => {
                            // The streamed answer: its usage chunk, then [DONE].
                            assert!(text.contains("data: [DONE]"), "{text}");
                            out.admitted += 1;
                            out.tokens += text
                                .lines()
                                .filter_map(|l| l.strip_prefix("data: "))
                                .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
                                .find_map(|c| c["usage"]["total_tokens"].as_u64())
                                .unwrap();
                        }
                        429 => {
                            let body: serde_json::Value = serde_json::from_str(&text).unwrap();
                            out.limited += 1;
                            out.refusal = Some((
                                status,
                                retry,
                                body["error"]["type"].as_str().unwrap().to_owned(),
                                body["error"]["code"].as_str().unwrap().to_owned(),
                            ));
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        other => panic!("{other}: {text}"),
                    }
                }
                out
            });
        }
    }
    let mut all = Outcome::default();
    while let Some(out) = callers.join_next().await {
        let out = out.unwrap();
        all.admitted += out.admitted;
        all.limited += out.limited;
        all.tokens += out.tokens;
        all.refusal = all.refusal.or(out.refusal);
    }
    all
}

/// One whole (not streamed) chat completion to the gateway at `url` with `key`, asking for at
/// most 10 tokens.
async fn chat(http: &reqwest::Client, url: &str, key: &str, model: &str) -> reqwest::Response {
    http.post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&chat_body(model))
        .send()
        .await
        .unwrap()
}

/// One chat for `key`: the tokens it used, or `None` when it was refused for its limits.
async fn chat_tokens(http: &reqwest::Client, url: &str, key: &str, model: &str) -> Option<u64> {
    let r = chat(http, url, key, model).await;
    if r.status() == 429 {
        return None;
    }
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    Some(body["usage"]["total_tokens"].as_u64().unwrap())
}

fn chat_body(model: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}]})
}

/// How many more than `limit` per minute may be admitted in `elapsed`: what the other
/// replicas' callers can have in flight while one snapshot travels
/// (docs/gateway.md#limits-across-replicas), and what the sliding minute lets in as the
/// previous minute's weight fades, if the run crossed into a new minute.
fn tolerance(limit: usize, elapsed: Duration) -> usize {
    (REPLICAS - 1) * CALLERS + (limit as f64 * elapsed.as_secs_f64() / 60.0).ceil() as usize
}

#[tokio::test]
async fn limits_hold_across_three_replicas_keys_are_isolated_and_a_revoked_key_stops_everywhere() {
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let ts = sluice_tests::unique_topicspace("keys");
    // Three tokens 300 ms apart: a request lasts far longer than the replicas' share delay
    // (10-15 ms on average here under this test's load, debug build; under 50 ms at most), as
    // the stated tolerance assumes.
    let model = "tokens-3-300";
    let (rpm, day) = (30, 500u64);
    let entries = [
        (
            "alpha",
            "sk-test-alpha",
            format!("requests_per_minute = {rpm}"),
        ),
        (
            "beta",
            "sk-test-beta",
            format!("requests_per_minute = {rpm}"),
        ),
        ("gamma", "sk-test-gamma", format!("tokens_per_day = {day}")),
        ("open", "sk-test-open", String::new()),
        (
            "prompts-only",
            "sk-test-prompts",
            "services = [\"prompt\"]".to_owned(),
        ),
    ];
    let as_refs: Vec<(&str, &str, &str)> = entries
        .iter()
        .map(|(n, k, r)| (*n, *k, r.as_str()))
        .collect();
    let keys_file = KeysFile::new(&as_refs);

    let bus = [
        "--pulsar-url",
        &broker.url,
        "--pulsar-admin-url",
        &broker.admin_url,
    ];
    let clean = [
        "SLUICE_CONFIG",
        "SLUICE_GATEWAY_TOKEN",
        "SLUICE_GATEWAY_SECRET_FILE",
        "SLUICE_TOPICSPACE",
    ];
    let ports: Vec<u16> = (0..=REPLICAS + 1).map(|_| free_port()).collect();
    let readyz = |i: usize| format!("http://127.0.0.1:{}/readyz", ports[i]);
    let base_url = fake.base_url();
    let (req, resp, cancel) = (
        format!("request:{ts}:text-completion"),
        format!("response:{ts}:text-completion"),
        format!("notify:{ts}:text-completion-cancel"),
    );
    let m0 = format!("127.0.0.1:{}", ports[0]);
    let usage_topic = format!("persistent://{ts}/response/usage");
    let mut args = vec![
        "text-completion",
        "--provider",
        "openai-compatible",
        "--base-url",
        &base_url,
        "--model",
        model,
        "--request-topic",
        &req,
        "--response-topic",
        &resp,
        "--cancel-topic",
        &cancel,
        "--usage-topic",
        &usage_topic,
        "--metrics-addr",
        &m0,
    ];
    args.extend(bus);
    let mut processor = Sluice::spawn(&args, &[("SLUICE_LLM_API_KEY", "sk-provider")], &clean);
    processor.ready(&readyz(0)).await;
    let keys_path = keys_file.arg();
    let gateway = |i: usize| {
        let m = format!("127.0.0.1:{}", ports[i]);
        let mut args = vec![
            "gateway",
            "--topicspace",
            &ts,
            "--listen",
            "127.0.0.1:0",
            "--services",
            "text-completion",
            "--keys-file",
            &keys_path,
            "--metrics-addr",
            &m,
        ];
        args.extend(bus);
        Sluice::spawn(&args, &[("SLUICE_GATEWAY_SECRET", SECRET)], &clean)
    };
    let mut replicas: Vec<Sluice> = (1..=REPLICAS).map(gateway).collect();
    let mut urls = Vec::new();
    for (i, g) in replicas.iter_mut().enumerate() {
        g.ready(&readyz(i + 1)).await;
        let line = g.stdout_line("gateway listening on ").await;
        urls.push(format!("http://{}", line.rsplit(' ').next().unwrap()));
    }
    // Every replica has read another's snapshot before the load: each publishes one when its
    // first request is admitted, so one call per replica with the open key... which has no
    // limit and is not shared. Warm up with gamma instead: one request per replica.
    let http = reqwest::Client::new();
    let mut warm_tokens = 0;
    for url in &urls {
        warm_tokens += chat_tokens(&http, url, "sk-test-gamma", model)
            .await
            .expect("a warm-up request is admitted");
    }
    for (i, &port) in ports[1..=REPLICAS].iter().enumerate() {
        let peers = metrics_text::eventually_value(
            port,
            "sluice_gateway_limit_peers",
            &[],
            PATIENCE,
            |v| v == (REPLICAS - 1) as f64,
        )
        .await;
        assert_eq!(
            peers,
            (REPLICAS - 1) as f64,
            "replica {} sees its peers",
            i + 1
        );
    }

    // Two limited keys and an unlimited one at once, on every replica.
    let started = Instant::now();
    let attempts = 12;
    let (alpha, beta, open) = tokio::join!(
        load(&urls, "sk-test-alpha", model, 10, attempts),
        load(&urls, "sk-test-beta", model, 10, attempts),
        load(&urls, "sk-test-open", model, 10, 2),
    );
    let elapsed = started.elapsed();
    let tol = tolerance(rpm, elapsed);
    for (i, &port) in ports[1..=REPLICAS].iter().enumerate() {
        let page = metrics_text::scrape(port).await;
        let n = metrics_text::value(&page, "sluice_gateway_limit_share_delay_seconds_count", &[]);
        let sum = metrics_text::value(&page, "sluice_gateway_limit_share_delay_seconds_sum", &[]);
        let le = |b: &str| {
            metrics_text::value(
                &page,
                "sluice_gateway_limit_share_delay_seconds_bucket",
                &[("le", b)],
            )
        };
        eprintln!(
            "replica {}: {n} snapshots read, mean delay {:.1} ms, <=5ms {} <=10ms {} <=25ms {} <=50ms {} <=100ms {}",
            i + 1,
            sum / n * 1000.0,
            le("0.005"),
            le("0.01"),
            le("0.025"),
            le("0.05"),
            le("0.1")
        );
    }
    for (name, o) in [("alpha", &alpha), ("beta", &beta)] {
        assert!(
            o.admitted >= rpm && o.admitted <= rpm + tol,
            "{name}: {} admitted of {} attempts, limit {rpm}, tolerance {tol} ({elapsed:?})",
            o.admitted,
            o.admitted + o.limited
        );
        let (status, retry, kind, code) = o.refusal.clone().unwrap();
        assert_eq!(
            (status, kind.as_str(), code.as_str()),
            (429, "requests", "rate_limit_exceeded")
        );
        assert!(retry.is_some_and(|s| (1..=120).contains(&s)), "{retry:?}");
    }
    // The unlimited key is untouched by the others' limits.
    assert_eq!((open.admitted, open.limited), (REPLICAS * CALLERS * 2, 0));
    eprintln!(
        "admitted: alpha {}, beta {} (limit {rpm}/min, tolerance {tol}, {elapsed:?})",
        alpha.admitted, beta.admitted
    );

    // A day's tokens: each request reserves its max_tokens (10) and about a token for every
    // 4 bytes of its body, and is settled with what it used. Under the load a replica refuses
    // once the day's usage and its own reservations in flight (its other callers') leave no
    // room for one more, which can be well before the day is used (at 100 a day, CI once saw
    // the first refusal with 62 used); over by at most what the other replicas' callers had
    // in flight. Then one caller alone, until refused: with nothing else in flight, a
    // replica refuses exactly when the day's usage leaves no room for one request's
    // reservation.
    let reserve = 10
        + serde_json::to_vec(&chat_body(model))
            .unwrap()
            .len()
            .div_ceil(4) as u64;
    let mut gamma = load(&urls, "sk-test-gamma", model, 10, 6).await;
    assert!(
        gamma.refusal.is_some(),
        "gamma was never refused under the load"
    );
    // Every replica has read the others' last snapshots, those of the settled requests,
    // before one caller goes on alone: until then a replica still counts what the others'
    // requests reserved, not what they used, and refuses early.
    let settled = warm_tokens + gamma.tokens;
    for &port in &ports[1..=REPLICAS] {
        let seen = metrics_text::eventually_value(
            port,
            "sluice_gateway_key_quota_used_tokens",
            &[("key", "gamma"), ("period", "day")],
            PATIENCE,
            |v| v == settled as f64,
        )
        .await;
        assert_eq!(
            seen, settled as f64,
            "replica on :{port}: gamma's day as heard"
        );
        let in_flight = metrics_text::value(
            &metrics_text::scrape(port).await,
            "sluice_gateway_key_in_flight",
            &[("key", "gamma")],
        );
        assert_eq!(
            in_flight, 0.0,
            "replica on :{port}: gamma's requests in flight"
        );
    }
    let mut alone_refused = false;
    for _ in 0..day {
        let Some(tokens) = chat_tokens(&http, &urls[0], "sk-test-gamma", model).await else {
            alone_refused = true;
            break;
        };
        gamma.admitted += 1;
        gamma.tokens += tokens;
    }
    assert!(alone_refused);
    let used = warm_tokens + gamma.tokens;
    // What refused the lone caller is what the callers were told they used.
    assert_eq!(
        metrics_text::value(
            &metrics_text::scrape(ports[1]).await,
            "sluice_gateway_key_quota_used_tokens",
            &[("key", "gamma"), ("period", "day")],
        ),
        used as f64
    );
    let per_request = used / (gamma.admitted + REPLICAS) as u64;
    assert!(
        used > day - reserve && used <= day + ((REPLICAS - 1) * CALLERS) as u64 * per_request,
        "gamma: {used} tokens used in {} requests, {day} a day",
        gamma.admitted + REPLICAS
    );
    let (status, retry, kind, code) = gamma.refusal.clone().unwrap();
    assert_eq!(
        (status, kind.as_str(), code.as_str()),
        (429, "tokens", "insufficient_quota")
    );
    assert!(
        retry.is_some_and(|s| (1..=86_400).contains(&s)),
        "{retry:?}"
    );

    // The metrics of the three replicas add up to what the callers saw, and the tokens to
    // what the fake reported.
    let mut admitted = [0.0; 3];
    let mut gamma_tokens = 0.0;
    let mut pages = String::new();
    for &port in &ports[1..=REPLICAS] {
        let page = metrics_text::scrape(port).await;
        for (j, key) in ["alpha", "beta", "gamma"].into_iter().enumerate() {
            admitted[j] += metrics_text::value(
                &page,
                "sluice_gateway_key_requests_total",
                &[("key", key), ("outcome", "admitted")],
            );
        }
        gamma_tokens += metrics_text::value(
            &page,
            "sluice_gateway_key_tokens_total",
            &[("key", "gamma")],
        );
        pages.push_str(&page);
    }
    assert_eq!(
        admitted,
        [
            alpha.admitted as f64,
            beta.admitted as f64,
            (gamma.admitted + REPLICAS) as f64
        ]
    );
    assert_eq!(gamma_tokens, used as f64);

    // The usage ledger, read with `sluice usage`: a record per admitted request under its
    // key's name, and the tokens its callers were told. The topic was given a retention.
    let out = common::run(
        &[
            "usage",
            "--summary",
            "--topic",
            &usage_topic,
            "--pulsar-url",
            &broker.url,
        ],
        &[],
        &["SLUICE_CONFIG"],
    )
    .await;
    assert!(out.ok(), "{}", out.stderr);
    let totals: Vec<serde_json::Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let total = |key: &str| -> (u64, u64, u64) {
        let t = totals
            .iter()
            .find(|t| t["key"] == key)
            .unwrap_or_else(|| panic!("no ledger totals for {key}: {totals:?}"));
        let n = |f: &str| t[f].as_u64().unwrap();
        (
            n("requests"),
            n("attempts"),
            n("input_tokens") + n("output_tokens"),
        )
    };
    assert_eq!(total("alpha").0, alpha.admitted as u64);
    assert_eq!(total("beta").0, beta.admitted as u64);
    assert_eq!(total("open").0, open.admitted as u64);
    assert_eq!(
        total("gamma"),
        (
            (gamma.admitted + REPLICAS) as u64,
            (gamma.admitted + REPLICAS) as u64,
            used
        ),
        "gamma's ledger: requests, attempts, tokens"
    );
    assert_eq!(
        total("alpha").2,
        alpha.tokens,
        "alpha's tokens as its callers were told"
    );
    let usage_retention: serde_json::Value = admin_json(
        &http,
        format!(
            "{}/admin/v2/persistent/{ts}/response/usage/retention",
            broker.admin_url
        ),
    )
    .await;
    assert_eq!(usage_retention["retentionTimeInMinutes"], 90 * 24 * 60);

    // The limits topic is compacted (its threshold set by the gateways); compacted now, a
    // replica started afterwards reads the compacted view and still knows the day's usage:
    // gamma is refused at once.
    let topic_admin = format!(
        "{}/admin/v2/persistent/{ts}/response/gateway-limits",
        broker.admin_url
    );
    let threshold: u64 = admin_json(&http, format!("{topic_admin}/compactionThreshold")).await;
    assert_eq!(threshold, 1024 * 1024);
    let retention: serde_json::Value = admin_json(&http, format!("{topic_admin}/retention")).await;
    assert_eq!(
        retention["retentionTimeInMinutes"],
        32 * 24 * 60,
        "{retention}"
    );
    let r = http
        .put(format!("{topic_admin}/compaction"))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let status = eventually_every(
        Duration::from_millis(200),
        PATIENCE,
        async || {
            let v: serde_json::Value = admin_json(&http, format!("{topic_admin}/compaction")).await;
            v["status"].as_str().unwrap_or("").to_owned()
        },
        |s| s == "SUCCESS" || s == "ERROR",
    )
    .await;
    assert_eq!(status, "SUCCESS");
    let mut late = gateway(REPLICAS + 1);
    late.ready(&readyz(REPLICAS + 1)).await;
    let line = late.stdout_line("gateway listening on ").await;
    let late_url = format!("http://{}", line.rsplit(' ').next().unwrap());
    let r = chat(&http, &late_url, "sk-test-gamma", model).await;
    assert_eq!(r.status(), 429, "{}", r.text().await.unwrap());

    // A key may call only what it is given: 403 in OpenAI's shape, before any provider call.
    let calls = fake.calls(model);
    let r = chat(&http, &urls[0], "sk-test-prompts", model).await;
    assert_eq!(r.status(), 403);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "permission_denied", "{body}");
    assert_eq!(fake.calls(model), calls);

    // Revoked: beta is removed from the file; every replica refuses it within seconds, and
    // the others' keys still work.
    // A socket authenticated with beta before it is revoked.
    let ws_url = urls[0].replace("http://", "ws://") + "/api/v1/socket";
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url).await.unwrap();
    ws.send(WsMessage::text(
        serde_json::json!({"type": "auth", "token": "sk-test-beta"}).to_string(),
    ))
    .await
    .unwrap();
    assert_eq!(next_json(&mut ws).await["type"], "auth-ok");
    let revoked_at = Instant::now();
    let kept: Vec<(&str, &str, &str)> = as_refs
        .iter()
        .copied()
        .filter(|(n, _, _)| *n != "beta")
        .collect();
    keys_file.write(&kept);
    let mut all = urls.clone();
    all.push(late_url.clone());
    for url in &all {
        let status = eventually_every(
            Duration::from_millis(100),
            PATIENCE,
            async || {
                chat(&http, url, "sk-test-beta", model)
                    .await
                    .status()
                    .as_u16()
            },
            |s| *s == 401,
        )
        .await;
        assert_eq!(status, 401, "{url} still takes the revoked key");
        let r = chat(&http, url, "sk-test-open", model).await;
        assert_eq!(r.status(), 200);
    }
    eprintln!("revoked on every replica within {:?}", revoked_at.elapsed());
    // The open socket's next request is refused too: the key is looked up per request.
    ws.send(WsMessage::text(
        serde_json::json!({"id": "after", "service": "text-completion", "flow": "default",
            "request": {"system": "", "prompt": "hi", "streaming": false}})
        .to_string(),
    ))
    .await
    .unwrap();
    let reply = next_json(&mut ws).await;
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no longer accepted"),
        "{reply}"
    );
    // A broken file keeps the keys as they were, and says so.
    keys_file.write_text("[[keys]]\nname = 3\n");
    let invalid = metrics_text::eventually_value(
        ports[1],
        "sluice_gateway_keys_reloads_total",
        &[("outcome", "invalid")],
        PATIENCE,
        |v| v >= 1.0,
    )
    .await;
    assert_eq!(invalid, 1.0);
    let r = chat(&http, &urls[0], "sk-test-open", model).await;
    assert_eq!(r.status(), 200);

    // No key and no hash in any metric or log line.
    let mut logs = pages;
    for g in replicas.into_iter().chain([late]) {
        let stopped = g.stop().await;
        logs.push_str(&stopped.stdout);
        logs.push_str(&stopped.stderr);
    }
    for (_, key, _) in &entries {
        assert!(!logs.contains(key), "{key} appears in a log or metric");
        assert!(
            !logs.contains(&hash_hex(key)),
            "{key}'s hash appears in a log or metric"
        );
    }
    processor.stop().await;
}

/// The JSON an admin API GET answers.
async fn admin_json<T: serde::de::DeserializeOwned>(http: &reqwest::Client, url: String) -> T {
    let r = http.get(&url).send().await.unwrap();
    assert!(r.status().is_success(), "GET {url}: {}", r.status());
    r.json().await.unwrap()
}
