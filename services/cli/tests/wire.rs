//! The bytes of every gateway route, pinned: one `sluice serve` (in-process bus, the fake
//! OpenAI server behind it) is sent a fixed list of requests covering each route, mode and
//! early refusal, and what it answers (status, the headers a client reads, the body; the
//! WebSocket's frames) must equal `tests/wire/serve.txt` once the values that differ per run
//! (ids, trace ids, times) are replaced by placeholders. It keeps a restructuring of the
//! gateway (its request preamble, its stream encoders) from changing what clients see.
//!
//! `SLUICE_BLESS=1 cargo test -p sluice-cli --test wire` rewrites the file from the current
//! code: do that only for a deliberate change of the wire, and read the diff.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{fmt::Write as _, time::Duration};

use common::Sluice;
use futures::{SinkExt, StreamExt};
use regex::Regex;
use sluice_tests::fake_openai::FakeOpenAi;
use tokio_tungstenite::tungstenite::Message;

const TOKEN: &str = "gateway-token-wire-1234";

/// One HTTP exchange to pin.
struct Case {
    name: &'static str,
    method: &'static str,
    path: &'static str,
    headers: &'static [(&'static str, &'static str)],
    body: String,
    /// Sends the gateway's token.
    authed: bool,
}

fn case(
    name: &'static str,
    method: &'static str,
    path: &'static str,
    headers: &'static [(&'static str, &'static str)],
    body: &str,
) -> Case {
    Case {
        name,
        method,
        path,
        headers,
        body: body.to_owned(),
        authed: true,
    }
}

const JSON: &[(&str, &str)] = &[("content-type", "application/json")];
const NDJSON: &[(&str, &str)] = &[
    ("content-type", "application/json"),
    ("accept", "application/x-ndjson"),
];
const SSE: &[(&str, &str)] = &[
    ("content-type", "application/json"),
    ("accept", "text/event-stream"),
];
const TRACED: &[(&str, &str)] = &[
    ("content-type", "application/json"),
    ("accept", "application/x-ndjson"),
    (
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ),
    ("x-session-id", "session-7"),
];

fn cases() -> Vec<Case> {
    let tc = r#"{"system":"s","prompt":"[model:normal] hello"}"#;
    let tc_stream = r#"{"system":"s","prompt":"[model:normal] hello","streaming":true}"#;
    let mid_error = r#"{"system":"s","prompt":"[model:error_mid_stream] hello"}"#;
    let refused = r#"{"system":"s","prompt":"[model:unauthorized] hello"}"#;
    let chat = |model_marker: &str, extra: &str| {
        format!(
            r#"{{"model":"routed","messages":[{{"role":"user","content":"[model:{model_marker}] hi"}}]{extra}}}"#
        )
    };
    let mut v = vec![
        case("rest whole", "POST", "/api/v1/text-completion", JSON, tc),
        case("rest ndjson", "POST", "/api/v1/text-completion", NDJSON, tc),
        case(
            "rest ndjson traced",
            "POST",
            "/api/v1/text-completion",
            TRACED,
            tc,
        ),
        case(
            "rest sse events",
            "POST",
            "/api/v1/text-completion",
            SSE,
            tc,
        ),
        case(
            "rest sse records",
            "POST",
            "/api/v1/text-completion",
            JSON,
            tc_stream,
        ),
        case(
            "rest sse records asked by accept",
            "POST",
            "/api/v1/text-completion",
            SSE,
            tc_stream,
        ),
        case(
            "flow sse records asked by accept",
            "POST",
            "/api/v1/flow/default/service/text-completion",
            SSE,
            tc_stream,
        ),
        case(
            "rest ndjson error mid-stream",
            "POST",
            "/api/v1/text-completion",
            NDJSON,
            mid_error,
        ),
        case(
            "rest whole provider refusal",
            "POST",
            "/api/v1/text-completion",
            JSON,
            refused,
        ),
        case(
            "rest ndjson provider refusal",
            "POST",
            "/api/v1/text-completion",
            NDJSON,
            refused,
        ),
        case(
            "rest sse records error",
            "POST",
            "/api/v1/text-completion",
            JSON,
            &mid_error.replace('}', r#","streaming":true}"#),
        ),
        case(
            "flow whole",
            "POST",
            "/api/v1/flow/default/service/text-completion",
            JSON,
            tc_stream,
        ),
        case(
            "flow unknown",
            "POST",
            "/api/v1/flow/other/service/text-completion",
            JSON,
            tc,
        ),
        case(
            "flow unknown ndjson",
            "POST",
            "/api/v1/flow/other/service/text-completion",
            NDJSON,
            tc,
        ),
        case("service unknown", "POST", "/api/v1/nothing", JSON, tc),
        case(
            "body not json",
            "POST",
            "/api/v1/text-completion",
            JSON,
            "{not json",
        ),
        case(
            "body wrong field type",
            "POST",
            "/api/v1/text-completion",
            NDJSON,
            r#"{"prompt": 5}"#,
        ),
        case(
            "body too large",
            "POST",
            "/api/v1/text-completion",
            JSON,
            &format!(r#"{{"prompt":"{}"}}"#, "x".repeat(5000)),
        ),
        case("models", "GET", "/api/v1/models", &[], ""),
        case(
            "prompt ndjson",
            "POST",
            "/api/v1/prompt",
            NDJSON,
            r#"{"id":"say","variables":{"x":"[model:normal] hi"}}"#,
        ),
        case(
            "prompt whole",
            "POST",
            "/api/v1/prompt",
            JSON,
            r#"{"id":"say","variables":{"x":"[model:normal] hi"}}"#,
        ),
        case(
            "prompt unknown template",
            "POST",
            "/api/v1/prompt",
            NDJSON,
            r#"{"id":"nope","variables":{}}"#,
        ),
        case(
            "agent ndjson",
            "POST",
            "/api/v1/agent",
            NDJSON,
            r#"{"question":"[model:react-answer] capital?"}"#,
        ),
        case(
            "agent ndjson steps",
            "POST",
            "/api/v1/agent?steps=true",
            NDJSON,
            r#"{"question":"[model:react-answer] capital?"}"#,
        ),
        case(
            "agent whole",
            "POST",
            "/api/v1/agent",
            JSON,
            r#"{"question":"[model:react-answer] capital?"}"#,
        ),
        case(
            "openai whole",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat("normal", ""),
        ),
        case(
            "openai stream",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat("normal", r#","stream":true"#),
        ),
        case(
            "openai stream usage",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat(
                "normal",
                r#","stream":true,"stream_options":{"include_usage":true}"#,
            ),
        ),
        case(
            "openai stream error mid-stream",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat("error_mid_stream", r#","stream":true"#),
        ),
        case(
            "openai stream provider refusal",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat("unauthorized", r#","stream":true"#),
        ),
        case(
            "openai tools stream",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat(
                "tools",
                r#","stream":true,"tools":[{"type":"function","function":{"name":"search","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}}]"#,
            ),
        ),
        case(
            "openai tools whole",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat(
                "tools",
                r#","tools":[{"type":"function","function":{"name":"search","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}}]"#,
            ),
        ),
        case(
            "openai model unknown",
            "POST",
            "/v1/chat/completions",
            JSON,
            r#"{"model":"nope","messages":[{"role":"user","content":"hi"}]}"#,
        ),
        case(
            "openai unsupported n",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat("normal", r#","n":2"#),
        ),
        case(
            "openai bad message",
            "POST",
            "/v1/chat/completions",
            JSON,
            r#"{"model":"routed","messages":[{"role":"wizard","content":"hi"}]}"#,
        ),
        case(
            "openai body not json",
            "POST",
            "/v1/chat/completions",
            JSON,
            "{",
        ),
        case(
            "openai too large",
            "POST",
            "/v1/chat/completions",
            JSON,
            &chat(&"x".repeat(5000), ""),
        ),
        case(
            "openai seed-004 prompt",
            "POST",
            "/v1/chat/completions",
            JSON,
            r#"{"prompt":"[model:normal] Hello","stream":true}"#,
        ),
        case(
            "openai ndjson accept",
            "POST",
            "/v1/chat/completions",
            NDJSON,
            &chat("normal", r#","stream":true"#),
        ),
        case("openai models", "GET", "/v1/models", &[], ""),
        case("openai model", "GET", "/v1/models/routed", &[], ""),
        case("openai model missing", "GET", "/v1/models/nope", &[], ""),
        case("openai other route", "POST", "/v1/embeddings", &[], ""),
        case(
            "openai wrong method",
            "GET",
            "/v1/chat/completions",
            &[],
            "",
        ),
        case("unknown path", "GET", "/nothing/here", &[], ""),
    ];
    for (name, path, headers, body) in [
        (
            "rest unauthorized",
            "/api/v1/text-completion",
            JSON,
            tc.to_owned(),
        ),
        (
            "rest unauthorized ndjson",
            "/api/v1/text-completion",
            NDJSON,
            tc.to_owned(),
        ),
        (
            "openai unauthorized",
            "/v1/chat/completions",
            JSON,
            chat("normal", ""),
        ),
        (
            "openai seed-004 unauthorized",
            "/v1/chat/completions",
            JSON,
            r#"{"prompt":"hi","stream":true}"#.to_owned(),
        ),
        (
            "openai models unauthorized",
            "/v1/models",
            &[][..],
            String::new(),
        ),
    ] {
        v.push(Case {
            name,
            method: if body.is_empty() { "GET" } else { "POST" },
            path,
            headers,
            body,
            authed: false,
        });
    }
    v
}

/// The response headers a client reads (others, like `date`, differ per run).
const KEPT_HEADERS: [&str; 9] = [
    "content-type",
    "cache-control",
    "x-accel-buffering",
    "www-authenticate",
    "retry-after",
    "x-request-id",
    "sluice-resume-token",
    "content-length",
    "transfer-encoding",
];

/// Replaces what differs per run by placeholders.
fn normalise(text: &str) -> String {
    let rules = [
        // chatcmpl ids and the request-id header built from them.
        (r"chatcmpl-[0-9a-f]{32}", "chatcmpl-<id>"),
        (
            r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            "<uuid>",
        ),
        (r"\b[0-9a-f]{32}\b", "<trace-id>"),
        (r#""created":\s?\d+"#, r#""created":<time>"#),
        (r#""timestamp":\s?"[^"]*""#, r#""timestamp":"<time>""#),
        (r#""duration_ms":\s?\d+"#, r#""duration_ms":<ms>"#),
    ];
    let mut out = text.to_owned();
    for (pattern, with) in rules {
        out = Regex::new(pattern)
            .unwrap()
            .replace_all(&out, with)
            .into_owned();
    }
    out
}

async fn exchange(client: &reqwest::Client, base: &str, c: &Case) -> String {
    let mut req = client.request(c.method.parse().unwrap(), format!("{base}{}", c.path));
    for (k, v) in c.headers {
        req = req.header(*k, *v);
    }
    if c.authed {
        req = req.bearer_auth(TOKEN);
    }
    if !c.body.is_empty() {
        req = req.body(c.body.clone());
    }
    let resp = tokio::time::timeout(Duration::from_secs(30), req.send())
        .await
        .unwrap_or_else(|_| panic!("{}: no answer", c.name))
        .unwrap();
    let mut out = format!("{}\n", resp.status().as_u16());
    for h in KEPT_HEADERS {
        if let Some(v) = resp.headers().get(h) {
            writeln!(out, "{h}: {}", v.to_str().unwrap()).unwrap();
        }
    }
    let body = tokio::time::timeout(Duration::from_secs(30), resp.bytes())
        .await
        .unwrap_or_else(|_| panic!("{}: the body did not end", c.name))
        .unwrap();
    out.push('\n');
    out.push_str(&String::from_utf8_lossy(&body));
    normalise(&out)
}

/// TrustGraph's WebSocket: frames sent, every frame received until each request completed.
async fn socket(addr: &str) -> String {
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/api/v1/socket"))
        .await
        .unwrap();
    let mut out = String::new();
    let mut send_and_read = async |frame: &str, replies: usize| {
        ws.send(Message::Text(frame.to_owned().into()))
            .await
            .unwrap();
        writeln!(out, "> {frame}").unwrap();
        for _ in 0..replies {
            let got = tokio::time::timeout(Duration::from_secs(30), ws.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            writeln!(out, "< {}", got.to_text().unwrap()).unwrap();
        }
    };
    send_and_read(
        r#"{"id":"early","service":"text-completion","request":{"prompt":"x"}}"#,
        1,
    )
    .await;
    send_and_read(&format!(r#"{{"type":"auth","token":"{TOKEN}"}}"#), 1).await;
    send_and_read(r#"{"id":"w","service":"text-completion","request":{"system":"s","prompt":"[model:normal] hi"}}"#, 1).await;
    // "Hello world!" as the fake streams it: Hel, lo, " world!", then the end.
    send_and_read(r#"{"id":"s","service":"text-completion","request":{"system":"s","prompt":"[model:normal] hi","streaming":true}}"#, 4).await;
    send_and_read(r#"{"id":"e","service":"nothing","request":{}}"#, 1).await;
    send_and_read(
        r#"{"id":"f","flow":"other","service":"text-completion","request":{}}"#,
        1,
    )
    .await;
    send_and_read(
        r#"{"id":"b","service":"text-completion","request":{"prompt":5}}"#,
        1,
    )
    .await;
    send_and_read("[1]", 1).await;
    normalise(&out)
}

#[tokio::test]
async fn every_route_answers_the_bytes_it_answered() {
    let fake = FakeOpenAi::start().await;
    let dir = std::env::temp_dir().join(format!("sluice-wire-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let templates = dir.join("templates.json");
    std::fs::write(
        &templates,
        r#"{"templates": {"say": {"prompt": "Say: {{ x }}"}}}"#,
    )
    .unwrap();
    let base = fake.base_url();
    let mut process = Sluice::spawn(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--provider",
            "openai-compatible",
            "--base-url",
            &base,
            "--model",
            "routed",
            "--templates",
            templates.to_str().unwrap(),
            "--body-limit-bytes",
            "4096",
        ],
        &[
            ("SLUICE_LLM_API_KEY", "sk-wire"),
            ("SLUICE_GATEWAY_TOKEN", TOKEN),
        ],
        &["SLUICE_CONFIG"],
    );
    let line = process.stdout_line("gateway on ").await;
    let addr = line
        .split("gateway on http://")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap()
        .to_owned();
    sluice_runtime::install_crypto_provider();
    let client = reqwest::Client::new();
    let mut got = String::new();
    for c in cases() {
        let answer = exchange(&client, &format!("http://{addr}"), &c).await;
        writeln!(got, "=== {}: {} {}\n{answer}\n", c.name, c.method, c.path).unwrap();
    }
    writeln!(got, "=== socket\n{}", socket(&addr).await).unwrap();
    process.stop().await;

    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/wire/serve.txt");
    if std::env::var("SLUICE_BLESS").as_deref() == Ok("1") {
        std::fs::create_dir_all(golden.parent().unwrap()).unwrap();
        std::fs::write(&golden, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&golden)
        .unwrap_or_else(|e| panic!("{}: {e} (SLUICE_BLESS=1 writes it)", golden.display()));
    if got != want {
        // The first case that differs, whole, then the file for a diff.
        let (g, w): (Vec<_>, Vec<_>) = (got.split("=== ").collect(), want.split("=== ").collect());
        let first = g
            .iter()
            .zip(&w)
            .find(|(a, b)| a != b)
            .map(|(a, b)| format!("got:\n{a}\nwant:\n{b}"))
            .unwrap_or_else(|| "the cases differ in number".into());
        let out = dir.join("serve.txt");
        std::fs::write(&out, &got).unwrap();
        panic!(
            "the gateway's bytes changed; diff {} {}\n{first}",
            golden.display(),
            out.display()
        );
    }
}
