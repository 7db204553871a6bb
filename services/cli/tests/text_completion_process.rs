//! `sluice text-completion` run as a process against the real broker and the fake OpenAI
//! server: it serves a streamed request, keeps the key out of its output, and drains on SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{process::Stdio, time::Duration};

use sluice_runtime::client::Received;
use sluice_schema::TextCompletionRequest;
use sluice_tests::{Broker, fake_openai::FakeOpenAi, free_port, text_client, unique_topic};
use tokio::{io::AsyncReadExt, process::Command};

mod common;
use common::Sluice;

const KEY: &str = "sk-from-the-environment-only";

#[tokio::test]
async fn the_processor_process_streams_keeps_its_key_secret_and_drains_on_sigterm() {
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let (req, resp) = (unique_topic("cli-tc-req"), unique_topic("cli-tc-resp"));
    let port = free_port();
    let mut child = Sluice::spawn(
        &[
            "text-completion",
            "--provider",
            "openai-compatible",
            "--base-url",
            &fake.base_url(),
            "--model",
            "normal",
            "--pulsar-url",
            &broker.url,
            "--pulsar-admin-url",
            &broker.admin_url,
            "--request-topic",
            &req,
            "--response-topic",
            &resp,
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ],
        &[("SLUICE_LLM_API_KEY", KEY), ("RUST_LOG", "debug")],
        &[],
    );
    child
        .ready(&format!("http://127.0.0.1:{port}/readyz"))
        .await;

    let client = text_client(broker.bus().await, &req, &resp).await;
    let mut stream = client
        .request(&TextCompletionRequest {
            prompt: "zebra-prompt-7731".into(),
            streaming: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut text = String::new();
    let mut ended = false;
    while let Some(item) = stream.next().await {
        if let Received::Record(r) = item.unwrap() {
            assert!(r.error.is_none(), "{r:?}");
            text.push_str(&r.response);
            ended = r.end_of_stream;
        }
    }
    assert!(ended);
    assert_eq!(text, "Hello world!");
    assert_eq!(fake.last_auth().unwrap(), format!("Bearer {KEY}"));
    let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("sluice_llm_requests_total"));
    assert!(!metrics.contains(KEY));

    let stopped = child.stop().await;
    assert_eq!(stopped.status.code(), Some(0));
    let logs = stopped.stderr;
    assert!(
        logs.contains("llm_request_started") && logs.contains("llm_request_completed"),
        "{logs}"
    );
    assert!(!logs.contains(KEY), "the key never reaches a log line");
    assert!(
        !logs.contains("say hello") && !logs.contains("Hello world"),
        "no prompt or answer text in logs"
    );
    client.close().await;
}

#[test]
fn a_missing_base_url_is_a_clear_error() {
    let out = common::run_blocking(
        &[
            "text-completion",
            "--provider",
            "openai-compatible",
            "--in-process",
        ],
        &[],
        &["SLUICE_BASE_URL"],
    );
    assert!(!out.ok());
    assert!(out.stderr.contains("--base-url"), "{}", out.stderr);
}

/// A retry policy that cannot be read (here from the environment) stops the processor at
/// start, saying what to write.
#[test]
fn a_bad_retry_policy_is_a_clear_error_at_start() {
    let run = |retry: &str| {
        common::run_blocking(
            &[
                "text-completion",
                "--provider",
                "openai-compatible",
                "--base-url",
                "http://127.0.0.1:9",
                "--model",
                "m",
                "--in-process",
                "--metrics-addr",
                "127.0.0.1:0",
            ],
            &[("SLUICE_RETRY", retry)],
            &[],
        )
    };
    for (retry, says) in [
        (
            "seed-003",
            "--retry: unknown retry preset \"seed-003\"; the presets are: default, sluice, seed-000, seed-001, seed-002",
        ),
        ("attempts=0", "--retry: retry attempts must be 1 to 10"),
        ("delay=2", "give a unit: 250ms or 2s"),
    ] {
        let out = run(retry);
        assert_eq!(out.code, 1, "{retry}");
        assert!(out.stderr.contains(says), "{retry}: {}", out.stderr);
    }
}

/// Bedrock with SigV4 keys from a file and the environment, logging at trace for the
/// signing crates: the signature is accepted, and neither the secret key nor the session
/// token reaches a log line or the metrics (aws-sigv4 traces the canonical request).
#[tokio::test]
async fn the_bedrock_processor_signs_with_sigv4_and_never_logs_its_credentials() {
    use sluice_tests::fake_bedrock::{
        ACCESS_KEY_ID, FakeBedrock, SECRET_ACCESS_KEY, SeenAuth, model_id,
    };
    const TOKEN: &str = "session-token-from-a-file-only";
    let broker = Broker::from_env().await;
    let fake = FakeBedrock::start().await;
    let dir = std::env::temp_dir().join(format!("sluice-bedrock-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret_file = dir.join("secret");
    std::fs::write(&secret_file, format!("{SECRET_ACCESS_KEY}\n")).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let (req, resp) = (unique_topic("cli-br-req"), unique_topic("cli-br-resp"));
    let port = free_port();
    let (secret_path, token_path) = (
        secret_file.display().to_string(),
        token_file.display().to_string(),
    );
    let mut child = Sluice::spawn(
        &[
            "text-completion",
            "--provider",
            "bedrock",
            "--region",
            "eu-west-1",
            "--base-url",
            &fake.base_url(),
            "--model",
            &model_id("normal"),
            "--pulsar-url",
            &broker.url,
            "--pulsar-admin-url",
            &broker.admin_url,
            "--request-topic",
            &req,
            "--response-topic",
            &resp,
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ],
        &[
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID),
            ("AWS_SECRET_ACCESS_KEY_FILE", &secret_path),
            ("AWS_SESSION_TOKEN_FILE", &token_path),
            (
                "RUST_LOG",
                "debug,aws_sigv4=trace,aws_credential_types=trace,aws_smithy_types=trace",
            ),
        ],
        &[
            "AWS_BEARER_TOKEN_BEDROCK",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
        ],
    );
    child
        .ready(&format!("http://127.0.0.1:{port}/readyz"))
        .await;
    let client = text_client(broker.bus().await, &req, &resp).await;
    let records = client
        .call(&TextCompletionRequest {
            prompt: "zebra-prompt-7731".into(),
            streaming: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let text: String = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(text, "Hello world!");
    assert!(records.last().unwrap().error.is_none());
    assert!(matches!(
        fake.last_request().auth,
        SeenAuth::SigV4 { ref region, .. } if region == "eu-west-1"
    ));
    let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let stopped = child.stop().await;
    assert_eq!(stopped.status.code(), Some(0));
    let logs = stopped.stderr;
    assert!(logs.contains("llm_request_completed"), "{logs}");
    for secret in [SECRET_ACCESS_KEY, TOKEN] {
        assert!(!logs.contains(secret), "a credential reached the logs");
        assert!(
            !metrics.contains(secret),
            "a credential reached the metrics"
        );
    }
    client.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Listens on `port` from now on and relays each connection to `target` (`host:port`): the
/// broker "comes up" on the address a processor was given, after it started.
fn relay(port: u16, target: String) {
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
}

/// Kubernetes starts pods and the broker in any order, and the shipped startup probe allows
/// for `--connect-wait-secs`: a processor started while nothing answers on its broker's
/// binary or admin address keeps waiting (it neither exits nor reports itself healthy), and
/// once the broker is there it creates its namespaces, connects and answers.
#[tokio::test]
async fn a_processor_started_before_its_broker_waits_for_it_admin_api_included() {
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let (req, resp) = (
        unique_topic("cli-tc-early-req"),
        unique_topic("cli-tc-early-resp"),
    );
    let (binary_port, admin_port, port) = (free_port(), free_port(), free_port());
    let mut processor = Sluice::spawn(
        &[
            "text-completion",
            "--provider",
            "openai-compatible",
            "--base-url",
            &fake.base_url(),
            "--model",
            "normal",
            "--pulsar-url",
            &format!("pulsar://127.0.0.1:{binary_port}"),
            "--pulsar-admin-url",
            &format!("http://127.0.0.1:{admin_port}"),
            "--connect-wait-secs",
            "90",
            "--request-topic",
            &req,
            "--response-topic",
            &resp,
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ],
        &[("SLUICE_LLM_API_KEY", KEY)],
        &[],
    );
    let healthz = format!("http://127.0.0.1:{port}/healthz");
    let healthy = || async {
        reqwest::get(&healthz)
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false)
    };
    // Eight seconds with nothing on either address (the condition under test is a span of
    // time): several retries of both, and the process neither exits nor turns healthy.
    for _ in 0..16 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Some(status) = processor.exited().await {
            panic!(
                "the processor gave up on a broker not up yet ({status}): {}",
                processor.stderr()
            );
        }
        assert!(!healthy().await, "healthy before it reached any broker");
    }
    // The broker comes up on the addresses the processor was given.
    relay(
        binary_port,
        broker.url.trim_start_matches("pulsar://").to_owned(),
    );
    relay(
        admin_port,
        broker.admin_url.trim_start_matches("http://").to_owned(),
    );
    processor
        .ready(&format!("http://127.0.0.1:{port}/readyz"))
        .await;
    assert!(healthy().await);

    let client = text_client(broker.bus().await, &req, &resp).await;
    let mut stream = client
        .request(&TextCompletionRequest {
            prompt: "early-bird-4412".into(),
            streaming: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut text = String::new();
    while let Some(item) = stream.next().await {
        if let Received::Record(r) = item.unwrap() {
            assert!(r.error.is_none(), "{r:?}");
            text.push_str(&r.response);
        }
    }
    assert_eq!(text, "Hello world!");
    client.close().await;
}

/// Reads an SSE body until it ends or breaks, keeping only whole events (a gateway killed
/// mid-event leaves a partial one, which the caller never saw as an event).
/// With `reached`, says once `n` whole events have arrived (and reads on).
async fn whole_events(
    mut resp: reqwest::Response,
    mut reached: Option<(usize, tokio::sync::oneshot::Sender<()>)>,
) -> Vec<String> {
    let mut buf = Vec::new();
    loop {
        let complete = |buf: &[u8]| {
            let text = String::from_utf8_lossy(buf);
            match text.rfind("\n\n") {
                Some(end) => sluice_tests::stream_pieces(&buf[..end + 2], true),
                None => Vec::new(),
            }
        };
        if reached
            .as_ref()
            .is_some_and(|(n, _)| complete(&buf).len() >= *n)
            && let Some((_, tx)) = reached.take()
        {
            let _ = tx.send(());
        }
        match tokio::time::timeout(Duration::from_secs(60), resp.chunk()).await {
            Ok(Ok(Some(chunk))) => buf.extend_from_slice(&chunk),
            // The end, or the connection broken by the gateway's death.
            Ok(Ok(None) | Err(_)) => return complete(&buf),
            Err(_) => panic!("the stream went silent for a minute"),
        }
    }
}

/// Issue #25 §1, the way a user meets it: a gateway replica is SIGKILLed while it streams 16
/// answers; each caller reconnects through another replica with the `Last-Event-ID` of the
/// last whole event it had, as a browser's EventSource does, and gets exactly the rest: what
/// it had plus the rest is, byte for byte, the stream read again whole afterwards; every
/// stream ends with `[DONE]`; the provider was called once per request.
#[tokio::test]
async fn callers_of_a_killed_gateway_resume_through_another_with_nothing_lost_or_repeated() {
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let ts = sluice_tests::unique_topicspace("resume");
    let model = "tokens-40-50";
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
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let metrics = |i: usize| format!("127.0.0.1:{}", ports[i]);
    let readyz = |i: usize| format!("http://127.0.0.1:{}/readyz", ports[i]);
    let base_url = fake.base_url();
    let (req, resp, cancel) = (
        format!("request:{ts}:text-completion"),
        format!("response:{ts}:text-completion"),
        format!("notify:{ts}:text-completion-cancel"),
    );
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
    ];
    args.extend(bus);
    let m0 = metrics(0);
    args.extend(["--metrics-addr", &m0]);
    let mut processor = Sluice::spawn(&args, &[("SLUICE_LLM_API_KEY", KEY)], &clean);
    processor.ready(&readyz(0)).await;
    // The replicas resume each other's streams with the secret they share.
    let gateway = |i: usize| {
        let m = metrics(i);
        let mut args = vec!["gateway", "--topicspace", &ts, "--listen", "127.0.0.1:0"];
        args.extend(bus);
        args.extend(["--metrics-addr", &m]);
        Sluice::spawn(
            &args,
            &[(
                "SLUICE_GATEWAY_SECRET",
                "resume-test-secret-0123456789abcdef",
            )],
            &clean,
        )
    };
    let (mut a, mut b) = (gateway(1), gateway(2));
    a.ready(&readyz(1)).await;
    b.ready(&readyz(2)).await;
    let mut urls = Vec::new();
    for g in [&mut a, &mut b] {
        let line = g.stdout_line("gateway listening on ").await;
        urls.push(format!("http://{}", line.rsplit(' ').next().unwrap()));
    }
    let (url_a, url_b) = (&urls[0], &urls[1]);
    let http = reqwest::Client::new();
    let body = serde_json::json!({"model": model, "stream": true,
                                   "messages": [{"role": "user", "content": "count"}]});
    let streams = 16;
    let mut firsts = Vec::new();
    for _ in 0..streams {
        let resp = http
            .post(format!("{url_a}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        firsts.push(resp);
    }
    // Each caller reads on in the background until the gateway dies under it; the kill comes
    // once every caller has had 3 events.
    let (readers, had_three): (Vec<_>, Vec<_>) = firsts
        .into_iter()
        .map(|resp| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            (tokio::spawn(whole_events(resp, Some((3, tx)))), rx)
        })
        .unzip();
    for rx in had_three {
        rx.await.expect("a caller had 3 events");
    }
    a.signal("KILL");
    let mut had_all = Vec::new();
    for r in readers {
        had_all.push(r.await.unwrap());
    }
    let mut resumed = 0;
    for had in had_all {
        assert!(!had.is_empty(), "a caller had no event before the kill");
        let last = sluice_tests::sse_event_id(had.last().unwrap());
        let rest = http
            .post(format!("{url_b}/v1/chat/completions"))
            .header("last-event-id", &last)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(rest.status(), 200, "{last}");
        let rest = whole_events(rest, None).await;
        if !rest.is_empty() {
            resumed += 1;
        }
        let (token, _) = last.rsplit_once('.').unwrap();
        let again = http
            .post(format!("{url_b}/v1/chat/completions"))
            .header("sluice-resume", format!("{token}.0"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let whole = whole_events(again, None).await;
        assert_eq!(
            [&had[..], &rest[..]].concat(),
            whole,
            "what the caller had and the rest are the stream, byte for byte"
        );
        assert_eq!(
            whole.last().unwrap(),
            &format!("id: {token}.{}\ndata: [DONE]\n\n", whole.len())
        );
    }
    assert!(
        resumed > streams / 2,
        "most streams were cut by the kill and resumed ({resumed} of {streams})"
    );
    // The kill cancelled nothing, and a resume never calls the provider.
    assert_eq!(fake.calls(model), streams);
    let _ = a.exited().await;

    // `sluice invoke` resumes by itself: behind one address (a load balancer, here a relay
    // that sends the first connection to gateway C and the next ones to B), C is SIGKILLed
    // mid-answer, and invoke prints the whole answer, as an uninterrupted one.
    let mut c = gateway(3);
    c.ready(&readyz(3)).await;
    let url_c = c.stdout_line("gateway listening on ").await;
    let url_c = url_c.rsplit(' ').next().unwrap().to_owned();
    let lb = free_port();
    relay_first_then(lb, url_c, url_b.trim_start_matches("http://").to_owned());
    let lb_url = format!("http://127.0.0.1:{lb}");
    let invoke = |url: String| {
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["invoke", "--url", &url, "llm", "", "count"])
            .env_remove("SLUICE_TOKEN")
            .env_remove("SLUICE_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let mut resumed = invoke(lb_url);
    // The kill comes once invoke has printed part of the answer.
    let mut first = [0u8; 1];
    let mut stdout = resumed.stdout.take().unwrap();
    tokio::time::timeout(Duration::from_secs(30), stdout.read_exact(&mut first))
        .await
        .expect("invoke printed nothing")
        .unwrap();
    c.signal("KILL");
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).await.unwrap();
    let resumed = tokio::time::timeout(Duration::from_secs(60), resumed.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let printed = [&first[..], &rest[..]].concat();
    let whole = invoke(url_b.clone()).wait_with_output().await.unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&printed),
        String::from_utf8_lossy(&resumed.stderr),
    );
    assert!(resumed.status.success(), "{out}\n{err}");
    assert!(err.contains("resuming after event"), "{err}");
    assert!(whole.status.success());
    assert_eq!(out, String::from_utf8_lossy(&whole.stdout));
    assert!(out.split_whitespace().count() >= 40, "{out}");
    assert_eq!(fake.calls(model), streams + 2);
    let _ = c.exited().await;
    b.stop().await;
    processor.stop().await;
}

/// Listens on `port` and relays the first connection to `first`, every later one to `rest`
/// (`host:port`): a load balancer in front of two gateway replicas.
fn relay_first_then(port: u16, first: String, rest: String) {
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        let mut target = first;
        while let Ok((mut inbound, _)) = listener.accept().await {
            let to = std::mem::replace(&mut target, rest.clone());
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
}
