//! The gateway's safe defaults (docs/security.md), tried the way an attacker would: raw HTTP
//! with forged `Host`, `Origin` and content types, WebSocket openings from foreign pages, a
//! listener opened beyond loopback without credentials, idle and slow connections by the
//! thousand, sockets that never authenticate, a real headless Chromium loading a page of
//! another origin, and Pulsar credentials given with plaintext URLs. Every process is real:
//! `sluice serve` (in-process bus) in front of the fake OpenAI server, which counts what
//! reached the provider.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::Sluice;
use futures::{SinkExt, StreamExt};
use sluice_tests::{PATIENCE, eventually_value, fake_openai::FakeOpenAi, free_port};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tokio_tungstenite::tungstenite::{
    Message, client::IntoClientRequest, http::HeaderValue, protocol::frame::coding::CloseCode,
};

const KEY: &str = "sk-security-provider-key-4410";
const TOKEN: &str = "gateway-token-security-7781";

struct Serve {
    process: Sluice,
    /// `127.0.0.1:PORT`.
    addr: String,
    metrics: String,
}

/// Starts `sluice serve` in front of `fake` (model `routed`: each request names its
/// behaviour) with `args` and `env`.
async fn serve(fake: &FakeOpenAi, args: &[&str], env: &[(&str, &str)]) -> Serve {
    let base = fake.base_url();
    let mut all = vec![
        "serve",
        "--metrics-addr",
        "127.0.0.1:0",
        "--provider",
        "openai-compatible",
        "--base-url",
        &base,
        "--model",
        "routed",
    ];
    if !args.contains(&"--listen") {
        all.extend(["--listen", "127.0.0.1:0"]);
    }
    all.extend_from_slice(args);
    let mut vars = vec![("SLUICE_LLM_API_KEY", KEY)];
    vars.extend_from_slice(env);
    let mut process = Sluice::spawn(&all, &vars, &["SLUICE_CONFIG", "SLUICE_GATEWAY_TOKEN"]);
    // "sluice serve: gateway on http://ADDR, metrics on http://ADDR/metrics"
    let line = process.stdout_line("gateway on ").await;
    let addr = line
        .split("gateway on http://")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap()
        .to_owned();
    let metrics = line.split("metrics on ").nth(1).unwrap().to_owned();
    Serve {
        process,
        addr,
        metrics,
    }
}

/// The gateway at `addr` as the address a client connects to (`0.0.0.0:P` is reached on
/// `127.0.0.1:P`).
fn reachable(addr: &str) -> String {
    addr.replace("0.0.0.0", "127.0.0.1")
}

/// One raw HTTP/1.1 exchange: `head` (request line and headers, without the blank line)
/// and `body`, on a connection closed after it. Returns the status and the response.
async fn raw(addr: &str, head: &str, body: &str) -> (u16, String) {
    let mut tcp = TcpStream::connect(reachable(addr)).await.unwrap();
    let request = format!(
        "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), tcp.read_to_end(&mut response))
        .await
        .expect("the gateway answers")
        .unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    (status, response)
}

const COMPLETION: &str = r#"{"system":"s","prompt":"[model:normal] hello"}"#;

/// Asserts that `sluice_gateway_refusals_total{reason}` reaches `want`.
async fn refused(s: &Serve, reason: &str, want: f64) {
    sluice_runtime::install_crypto_provider();
    let port: u16 = s
        .metrics
        .trim_start_matches("http://")
        .split(['/', ':'])
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {}", s.metrics));
    let got = eventually_value(
        port,
        "sluice_gateway_refusals_total",
        &[("reason", reason)],
        PATIENCE,
        |v| v >= want,
    )
    .await;
    assert_eq!(got, want, "refusals for {reason}");
}

#[tokio::test]
async fn foreign_hosts_origins_and_content_types_are_refused_before_any_work() {
    let fake = FakeOpenAi::start().await;
    let s = serve(&fake, &[], &[]).await;
    let host = format!("Host: {}", s.addr);

    // The attack of the issue: a page of another origin, rebound to this machine, posts a
    // "simple" text/plain request. The Host check answers first.
    let (status, body) = raw(
        &s.addr,
        &format!(
            "POST /api/v1/text-completion HTTP/1.1\r\nHost: evil.example:{}\r\nOrigin: http://evil.example\r\nContent-Type: text/plain",
            s.addr.rsplit(':').next().unwrap()
        ),
        COMPLETION,
    )
    .await;
    assert_eq!(status, 421, "{body}");
    assert!(body.contains("--allowed-host"), "{body}");
    // A rebound page's own GET carries no Origin, only its Host.
    let (status, body) = raw(
        &s.addr,
        "GET /v1/models HTTP/1.1\r\nHost: rebind.example",
        "",
    )
    .await;
    assert_eq!(status, 421, "{body}");
    assert!(
        body.contains("invalid_request_error"),
        "OpenAI's shape under /v1: {body}"
    );

    // A page of another origin, reaching 127.0.0.1 itself: refused by its Origin.
    for (ctype, what) in [
        ("text/plain", "simple request"),
        ("application/json", "preflighted"),
    ] {
        let (status, body) = raw(
            &s.addr,
            &format!("POST /api/v1/text-completion HTTP/1.1\r\n{host}\r\nOrigin: http://evil.example\r\nContent-Type: {ctype}"),
            COMPLETION,
        )
        .await;
        assert_eq!(status, 403, "{what}: {body}");
    }
    let (status, _) = raw(
        &s.addr,
        &format!("OPTIONS /api/v1/text-completion HTTP/1.1\r\n{host}\r\nOrigin: http://evil.example\r\nAccess-Control-Request-Method: POST"),
        "",
    )
    .await;
    assert_eq!(
        status, 403,
        "a preflight from a foreign origin learns nothing"
    );

    // Bodies a browser may send cross-origin unasked: refused whoever sends them.
    for ctype in [
        Some("text/plain;charset=UTF-8"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        None,
    ] {
        let head = match ctype {
            Some(t) => {
                format!("POST /api/v1/text-completion HTTP/1.1\r\n{host}\r\nContent-Type: {t}")
            }
            None => format!("POST /api/v1/text-completion HTTP/1.1\r\n{host}"),
        };
        let (status, body) = raw(&s.addr, &head, COMPLETION).await;
        assert_eq!(status, 415, "{ctype:?}: {body}");
        assert!(body.contains("application/json"), "{body}");
    }
    // An NDJSON caller gets its refusal as events (the event protocol's error, then done).
    let (status, body) = raw(
        &s.addr,
        &format!("POST /api/v1/text-completion HTTP/1.1\r\n{host}\r\nAccept: application/x-ndjson\r\nContent-Type: text/plain"),
        COMPLETION,
    )
    .await;
    assert_eq!(status, 415);
    assert!(
        body.contains(r#""type":"error""#) && body.contains(r#""type":"done""#),
        "{body}"
    );

    // None of that reached the provider.
    assert_eq!(fake.calls("normal"), 0);

    // What a non-browser client sends is answered: JSON, no Origin, a loopback Host.
    for host in [
        host.clone(),
        "Host: localhost".to_owned(),
        "Host: [::1]:1".to_owned(),
    ] {
        let (status, body) = raw(
            &s.addr,
            &format!("POST /api/v1/text-completion HTTP/1.1\r\n{host}\r\nContent-Type: application/json; charset=utf-8"),
            COMPLETION,
        )
        .await;
        assert_eq!(status, 200, "{host}: {body}");
        assert!(body.contains("Hello world!"), "{body}");
    }
    assert_eq!(fake.calls("normal"), 3);
    refused(&s, "host", 2.0).await;
    refused(&s, "origin", 3.0).await;
    refused(&s, "content-type", 5.0).await;
    s.process.stop().await;
}

#[tokio::test]
async fn websockets_from_foreign_pages_are_refused_and_listed_origins_get_cors() {
    let fake = FakeOpenAi::start().await;
    let s = serve(
        &fake,
        &["--allowed-origin", "http://app.localhost:3000"],
        &[],
    )
    .await;
    let url = format!("ws://{}/api/v1/socket", reachable(&s.addr));
    let opening = |origin: Option<&'static str>| {
        let mut req = url.clone().into_client_request().unwrap();
        if let Some(o) = origin {
            req.headers_mut()
                .insert("origin", HeaderValue::from_static(o));
        }
        req
    };
    let refused_ws = tokio_tungstenite::connect_async(opening(Some("http://evil.example"))).await;
    match refused_ws {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), 403);
        }
        other => panic!("a foreign page's socket was not refused: {other:?}"),
    }
    for origin in [None, Some("http://app.localhost:3000")] {
        let (mut ws, _) = tokio_tungstenite::connect_async(opening(origin))
            .await
            .unwrap_or_else(|e| panic!("{origin:?}: {e}"));
        ws.send(Message::Text(
            r#"{"id":"1","service":"text-completion","request":{"system":"s","prompt":"[model:normal] hi","streaming":false}}"#.into(),
        ))
        .await
        .unwrap();
        let frame = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(
            frame.to_text().unwrap().contains("Hello world!"),
            "{origin:?}: {frame:?}"
        );
    }

    // CORS: the listed origin's preflight is answered with its own origin, nobody else's.
    let (status, resp) = raw(
        &s.addr,
        &format!("OPTIONS /api/v1/text-completion HTTP/1.1\r\nHost: {}\r\nOrigin: http://app.localhost:3000\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type, authorization", s.addr),
        "",
    )
    .await;
    assert_eq!(status, 200, "{resp}");
    let lower = resp.to_ascii_lowercase();
    assert!(
        lower.contains("access-control-allow-origin: http://app.localhost:3000"),
        "{resp}"
    );
    assert!(lower.contains("authorization"), "{resp}");
    let (status, resp) = raw(
        &s.addr,
        &format!("POST /api/v1/text-completion HTTP/1.1\r\nHost: {}\r\nOrigin: http://app.localhost:3000\r\nContent-Type: application/json", s.addr),
        COMPLETION,
    )
    .await;
    assert_eq!(status, 200, "{resp}");
    assert!(
        resp.to_ascii_lowercase()
            .contains("access-control-allow-origin: http://app.localhost:3000"),
        "{resp}"
    );
    s.process.stop().await;
}

#[tokio::test]
async fn a_listener_beyond_loopback_needs_credentials_or_a_deliberate_flag() {
    let fake = FakeOpenAi::start().await;
    // `sluice serve` and `sluice gateway` share the rule; it stops them before anything else
    // (the gateway's broker is never reached).
    for args in [
        vec![
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--model",
            "m",
            "--base-url",
            "http://127.0.0.1:1",
        ],
        vec!["gateway", "--pulsar-url", "pulsar://127.0.0.1:1"],
    ] {
        let mut p = Sluice::spawn(
            &args,
            &[],
            &[
                "SLUICE_CONFIG",
                "SLUICE_GATEWAY_TOKEN",
                "SLUICE_GATEWAY_KEYS_FILE",
                "SLUICE_GATEWAY_ADDR",
            ],
        );
        let status = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if let Some(status) = p.exited().await {
                    return status;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{args:?} started without credentials:\n{}", p.stderr()));
        assert!(!status.success());
        let err = p.stderr();
        assert!(err.contains("refusing to listen on 0.0.0.0"), "{err}");
        assert!(err.contains("--allow-unauthenticated"), "{err}");
    }

    // Opened deliberately: it starts, says so, and still refuses a rebound page's Host.
    let open = serve(
        &fake,
        &["--listen", "0.0.0.0:0", "--allow-unauthenticated"],
        &[("RUST_LOG", "info")],
    )
    .await;
    assert!(
        open.process.stderr().contains("accepts every caller"),
        "{}",
        open.process.stderr()
    );
    let (status, _) = raw(
        &open.addr,
        "GET /v1/models HTTP/1.1\r\nHost: evil.example",
        "",
    )
    .await;
    assert_eq!(status, 421);
    open.process.stop().await;

    // With a token it starts too, and serves whatever name it is reached by.
    let authed = serve(
        &fake,
        &["--listen", "0.0.0.0:0"],
        &[("SLUICE_GATEWAY_TOKEN", TOKEN)],
    )
    .await;
    let (status, body) = raw(
        &authed.addr,
        &format!("GET /v1/models HTTP/1.1\r\nHost: gw.example\r\nAuthorization: Bearer {TOKEN}"),
        "",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = raw(
        &authed.addr,
        "GET /v1/models HTTP/1.1\r\nHost: gw.example",
        "",
    )
    .await;
    assert_eq!(status, 401);
    authed.process.stop().await;
}

/// Runs `sluice ARGS` with `env` (the Pulsar credential variables of the caller's environment
/// removed) until it exits; its status and stderr. A start that is not refused at once runs
/// into its 1 s connect wait against a broker that is not there.
async fn start_up(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut p = Sluice::spawn(
        args,
        env,
        &[
            "SLUICE_CONFIG",
            "SLUICE_PULSAR_TOKEN",
            "SLUICE_PULSAR_TOKEN_FILE",
            "SLUICE_PULSAR_OAUTH2_ISSUER_URL",
            "SLUICE_PULSAR_ADMIN_URL",
            "SLUICE_ALLOW_PLAINTEXT_CREDENTIALS",
        ],
    );
    let status = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(status) = p.exited().await {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{args:?} still running after 60 s:\n{}", p.stderr()));
    (status.success(), p.stderr())
}

#[tokio::test]
async fn pulsar_credentials_are_not_sent_in_plaintext_beyond_loopback_unless_allowed() {
    const PULSAR_TOKEN: &str = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.plaintext-test-signature";
    let dir = std::env::temp_dir().join(format!("sluice-plaintext-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, PULSAR_TOKEN).unwrap();
    let token_file = token_file.to_str().unwrap().to_owned();
    // `.invalid` never resolves (RFC 2606): nothing is sent anywhere, whatever the outcome.
    let text_completion = |url: &'static str| {
        vec![
            "text-completion",
            "--pulsar-url",
            url,
            "--model",
            "m",
            "--base-url",
            "http://127.0.0.1:1",
            "--connect-wait-secs",
            "1",
            "--metrics-addr",
            "127.0.0.1:0",
        ]
    };
    let plain = text_completion("pulsar://broker.invalid:6650");
    // (what, arguments, environment, what the refusal says)
    type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "a token to a plaintext broker",
            plain.clone(),
            vec![("SLUICE_PULSAR_TOKEN", PULSAR_TOKEN)],
            "plaintext pulsar://",
        ),
        (
            "a token file to a plaintext broker",
            plain.clone(),
            vec![("SLUICE_PULSAR_TOKEN_FILE", &token_file)],
            "plaintext pulsar://",
        ),
        (
            "a token to a plaintext admin API",
            [
                text_completion("pulsar+ssl://broker.invalid:6651"),
                vec!["--pulsar-admin-url", "http://admin.invalid:8080"],
            ]
            .concat(),
            vec![("SLUICE_PULSAR_TOKEN", PULSAR_TOKEN)],
            "plaintext http://",
        ),
        (
            "an OAuth2 client secret to a plaintext issuer",
            text_completion("pulsar+ssl://broker.invalid:6651"),
            vec![
                ("SLUICE_PULSAR_OAUTH2_ISSUER_URL", "http://issuer.invalid"),
                ("SLUICE_PULSAR_OAUTH2_CLIENT_ID", "sluice"),
                (
                    "SLUICE_PULSAR_OAUTH2_CLIENT_SECRET",
                    "oauth2-client-secret-31",
                ),
            ],
            "plaintext http://",
        ),
        (
            "the gateway's token to a plaintext broker",
            vec![
                "gateway",
                "--pulsar-url",
                "pulsar://broker.invalid:6650",
                "--listen",
                "127.0.0.1:0",
                "--connect-wait-secs",
                "1",
            ],
            vec![("SLUICE_PULSAR_TOKEN", PULSAR_TOKEN)],
            "plaintext pulsar://",
        ),
    ];
    for (case, args, env, says) in &cases {
        let (ok, err) = start_up(args, env).await;
        assert!(!ok, "{case}: started:\n{err}");
        assert!(err.contains(says), "{case}: no {says:?} in:\n{err}");
        assert!(
            err.contains("--allow-plaintext-credentials"),
            "{case}:\n{err}"
        );
        assert!(
            !err.contains(PULSAR_TOKEN)
                && !err.contains("plaintext-test-signature")
                && !err.contains("oauth2-client-secret-31"),
            "{case}: a credential in the log:\n{err}"
        );
        // Opted in (the flag, or its variable): not refused for that; it goes on to the broker,
        // which is not there.
        let mut allowed = env.clone();
        allowed.push(("SLUICE_ALLOW_PLAINTEXT_CREDENTIALS", "true"));
        let (ok, err) = start_up(args, &allowed).await;
        assert!(!ok, "{case}: a broker that is not there");
        assert!(!err.contains("refusing to send"), "{case} allowed:\n{err}");
    }
    // Loopback is exempt: the test command's brokers are plain, on 127.0.0.1.
    let (_, err) = start_up(
        &text_completion("pulsar://127.0.0.1:1"),
        &[("SLUICE_PULSAR_TOKEN", PULSAR_TOKEN)],
    )
    .await;
    assert!(!err.contains("refusing to send"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Opens up to `n` connections to `addr` that send nothing; returns them (kept open).
///
/// Each connect is bounded by the kernel alone: a listener that refuses fails it at once,
/// and one whose backlog is full drops the SYN until the kernel's retries run out (about two
/// minutes at `tcp_syn_retries` 6). No timeout of the test's own: a busy machine can take
/// seconds to complete a loopback handshake, and a cut-off here (2 s, once) made the count
/// depend on the machine's load instead of on the gateway.
async fn idle_connections(addr: &str, n: usize) -> Vec<TcpStream> {
    let mut open = Vec::with_capacity(n);
    for _ in 0..n {
        match TcpStream::connect(addr).await {
            Ok(tcp) => open.push(tcp),
            Err(e) => {
                eprintln!("connection {} of {n} failed: {e}", open.len() + 1);
                break;
            }
        }
    }
    open
}

/// This process's soft limit of open files.
fn open_files() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(1024)
}

#[tokio::test]
async fn idle_and_slow_connections_do_not_stop_a_caller_from_being_answered() {
    let fake = FakeOpenAi::start().await;
    // Both processes share this machine's open-file limit: 10,000 idle connections need
    // 10,000 descriptors on each side.
    let want = 10_000.min(open_files().saturating_sub(1_024));
    assert!(
        want >= 5_000,
        "this machine allows {} open files: too few for the idle-connection flood",
        open_files()
    );
    let s = serve(&fake, &["--header-read-timeout-secs", "2"], &[]).await;
    let addr = reachable(&s.addr);

    // A client that sends its headers a byte at a time: closed at the header deadline.
    let mut slow = TcpStream::connect(&addr).await.unwrap();
    let drip = async {
        for b in b"POST /api/v1/text-completion HTTP/1.1\r\nHost: localhost\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".iter().cycle() {
            if slow.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), drip)
        .await
        .expect("the slow client's connection is closed at the header deadline");

    let idle = idle_connections(&addr, want).await;
    assert_eq!(idle.len(), want, "the gateway took every connection");
    // A normal caller, with all of them open.
    let (status, body) = raw(
        &addr,
        "POST /api/v1/text-completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json",
        COMPLETION,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Hello world!"), "{body}");
    // The idle ones are closed at their header deadline: each reads the end of its stream.
    let mut closed = 0;
    for mut tcp in idle {
        let mut buf = [0u8; 64];
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(30), tcp.read(&mut buf)).await {
            closed += 1;
        }
    }
    assert_eq!(
        closed, want,
        "every idle connection is closed by the gateway"
    );
    s.process.stop().await;

    // Over a small cap, callers wait for a place instead of being refused, and get one when
    // the idle connections ahead of them are closed.
    let s = serve(
        &fake,
        &["--header-read-timeout-secs", "1", "--max-connections", "16"],
        &[],
    )
    .await;
    let addr = reachable(&s.addr);
    let idle = idle_connections(&addr, 200).await;
    assert_eq!(idle.len(), 200, "the rest wait in the listen backlog");
    let (status, body) = raw(
        &addr,
        "POST /api/v1/text-completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json",
        COMPLETION,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    drop(idle);
    s.process.stop().await;
}

#[tokio::test]
async fn a_socket_must_authenticate_in_time_and_is_closed_after_failed_attempts() {
    let fake = FakeOpenAi::start().await;
    let s = serve(
        &fake,
        &[
            "--socket-auth-window-secs",
            "1",
            "--socket-max-requests",
            "2",
        ],
        &[("SLUICE_GATEWAY_TOKEN", TOKEN)],
    )
    .await;
    let url = format!("ws://{}/api/v1/socket", reachable(&s.addr));
    async fn close_code(
        ws: &mut tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>,
    ) -> Option<CloseCode> {
        loop {
            match tokio::time::timeout(Duration::from_secs(30), ws.next()).await {
                Ok(Some(Ok(Message::Close(frame)))) => return frame.map(|f| f.code),
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(_)) | None) => return None,
                Err(_) => panic!("the socket stays open"),
            }
        }
    }

    // Silent: closed once the window passes.
    let (mut ws, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Policy));

    // Guessing: three failures, then closed.
    let (mut ws, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
    for guess in ["a", "b", "c"] {
        ws.send(Message::Text(
            format!(r#"{{"type":"auth","token":"{guess}"}}"#).into(),
        ))
        .await
        .unwrap();
    }
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Policy));

    // Authenticated: at most two requests at once (each streaming, held open by the model),
    // the third refused with its id.
    let (mut ws, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
    ws.send(Message::Text(
        format!(r#"{{"type":"auth","token":"{TOKEN}"}}"#).into(),
    ))
    .await
    .unwrap();
    let ok = ws.next().await.unwrap().unwrap();
    assert!(ok.to_text().unwrap().contains("auth-ok"), "{ok:?}");
    for id in ["1", "2", "3"] {
        ws.send(Message::Text(
            format!(r#"{{"id":"{id}","service":"text-completion","request":{{"system":"s","prompt":"[model:gated] hi","streaming":true}}}}"#).into(),
        ))
        .await
        .unwrap();
    }
    let refusal = loop {
        let frame = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .unwrap_or_else(|_| panic!("no refusal:\n{}", s.process.stderr()))
            .unwrap()
            .unwrap();
        let text = frame.to_text().unwrap().to_owned();
        if text.contains("\"error\"") {
            break text;
        }
    };
    assert!(refusal.contains(r#""id":"3""#), "{refusal}");
    assert!(refusal.contains("too-many-requests"), "{refusal}");
    // Closing the socket cancels the two held requests.
    drop(ws);
    refused(&s, "socket-auth", 2.0).await;
    s.process.stop().await;
}

/// Debian's Chromium, when installed (scripts/test.sh installs it).
fn chromium() -> Option<String> {
    if let Ok(path) = std::env::var("SLUICE_CHROMIUM") {
        return Some(path);
    }
    sluice_tests::outside_tool(
        "SLUICE_CHROMIUM",
        "the browser test of the gateway's origin checks",
    )
}

/// A page server on `port` that serves `page` at `/` and collects what the page reports to
/// `POST /report`.
async fn page_server(
    port: u16,
    page: String,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::mpsc::Receiver<String>,
) {
    use axum::{Router, routing::get, routing::post};
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let app = Router::new()
        .route(
            "/",
            get(move || {
                let page = page.clone();
                async move { axum::response::Html(page) }
            }),
        )
        .route(
            "/report",
            post(move |body: String| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(body).await;
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (task, rx)
}

/// The page: tries a preflighted `fetch`, a simple (`text/plain`, no-cors) `fetch` and a
/// WebSocket against the gateway at `gateway`, and reports what each got.
fn attack_page(gateway: &str) -> String {
    format!(
        r#"<!doctype html><html><body><script>
const gw = "{gateway}";
const report = {{}};
async function run() {{
  try {{
    const r = await fetch("http://" + gw + "/api/v1/text-completion", {{
      method: "POST", headers: {{"Content-Type": "application/json"}},
      body: JSON.stringify({{system: "s", prompt: "[model:normal] from a page"}})}});
    report.fetch = "status " + r.status + ": " + (await r.text());
  }} catch (e) {{ report.fetch = "refused: " + e; }}
  try {{
    await fetch("http://" + gw + "/api/v1/text-completion", {{
      method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}},
      body: JSON.stringify({{system: "s", prompt: "[model:normal] simple"}})}});
    report.simple = "sent";
  }} catch (e) {{ report.simple = "refused: " + e; }}
  report.socket = await new Promise((done) => {{
    let ws;
    try {{ ws = new WebSocket("ws://" + gw + "/api/v1/socket"); }} catch (e) {{ return done("refused: " + e); }}
    ws.onopen = () => ws.send(JSON.stringify({{id: "1", service: "text-completion",
      request: {{system: "s", prompt: "[model:normal] over a socket", streaming: false}}}}));
    ws.onmessage = (m) => {{ done("answered: " + m.data); ws.close(); }};
    ws.onerror = () => done("refused");
    ws.onclose = () => done("refused (closed)");
  }});
  await fetch("/report", {{method: "POST", body: JSON.stringify(report)}});
}}
run();
</script></body></html>"#
    )
}

/// Loads `url` in headless Chromium (its own profile, no network but loopback) and waits for
/// the page's report.
async fn browse(
    chromium: &str,
    url: &str,
    reports: &mut tokio::sync::mpsc::Receiver<String>,
) -> serde_json::Value {
    let profile = std::env::temp_dir().join(format!(
        "sluice-chromium-{}-{}",
        std::process::id(),
        free_port()
    ));
    let mut browser = tokio::process::Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-features=PrivateNetworkAccessRespectPreflightResults",
            &format!("--user-data-dir={}", profile.display()),
            "--remote-debugging-port=0",
            url,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("chromium starts");
    let report = tokio::time::timeout(Duration::from_secs(90), reports.recv())
        .await
        .expect("the page reports within 90 s")
        .expect("a report");
    let _ = browser.kill().await;
    let _ = std::fs::remove_dir_all(&profile);
    serde_json::from_str(&report).unwrap()
}

#[tokio::test]
async fn a_page_of_another_origin_in_a_real_browser_cannot_use_the_gateway() {
    let Some(chromium) = chromium() else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let page_port = free_port();
    let origin = format!("http://127.0.0.1:{page_port}");

    // Defaults: the page (another port, so another origin) is refused on every path.
    let s = serve(&fake, &[], &[]).await;
    let (server, mut reports) = page_server(page_port, attack_page(&reachable(&s.addr))).await;
    let report = browse(&chromium, &format!("{origin}/"), &mut reports).await;
    assert!(
        report["fetch"].as_str().unwrap().starts_with("refused"),
        "{report}"
    );
    assert!(
        report["socket"].as_str().unwrap().starts_with("refused"),
        "{report}"
    );
    // The no-cors request was sent by the browser and refused by the gateway before any
    // work: the provider saw nothing.
    assert_eq!(report["simple"], "sent", "{report}");
    refused(&s, "origin", 3.0).await;
    assert_eq!(fake.calls("normal"), 0);
    s.process.stop().await;
    server.abort();

    // The same page from an allowed origin works, over fetch and the socket.
    let s = serve(&fake, &["--allowed-origin", &origin], &[]).await;
    let (server, mut reports) = page_server(page_port, attack_page(&reachable(&s.addr))).await;
    let report = browse(&chromium, &format!("{origin}/"), &mut reports).await;
    let fetched = report["fetch"].as_str().unwrap();
    assert!(
        fetched.starts_with("status 200") && fetched.contains("Hello world!"),
        "{report}"
    );
    let socket = report["socket"].as_str().unwrap();
    assert!(
        socket.starts_with("answered") && socket.contains("Hello world!"),
        "{report}"
    );
    // The simple request's body is not JSON-typed: refused (415) even from an allowed page.
    refused(&s, "content-type", 1.0).await;
    s.process.stop().await;
    server.abort();

    // DNS rebinding, as the browser meets it: a name of the attacker's resolving to this
    // machine, loaded at the gateway's own port (Chromium's resolver rules stand in for the
    // attacker's DNS server).
    let s = serve(&fake, &[], &[]).await;
    let port = s.addr.rsplit(':').next().unwrap().to_owned();
    let dump = tokio::process::Command::new(&chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--host-resolver-rules=MAP rebind.example 127.0.0.1",
            &format!(
                "--user-data-dir={}",
                std::env::temp_dir()
                    .join(format!("sluice-chromium-dump-{}", std::process::id()))
                    .display()
            ),
            "--dump-dom",
            &format!("http://rebind.example:{port}/v1/models"),
        ])
        .output()
        .await
        .unwrap();
    let dom = String::from_utf8_lossy(&dump.stdout);
    assert!(
        dom.contains("--allowed-host"),
        "the rebound page read: {dom}"
    );
    assert!(!dom.contains("routed"), "the model list leaked: {dom}");
    s.process.stop().await;
}
