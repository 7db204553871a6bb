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

/// Waits up to 30 s for the processor's `/readyz` on `port`; fails if it exits first.
async fn ready(child: &mut tokio::process::Child, port: u16) {
    sluice_tests::process::ready(
        child,
        &format!("http://127.0.0.1:{port}/readyz"),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("the processor {e}"));
}

#[tokio::test]
async fn the_processor_process_streams_keeps_its_key_secret_and_drains_on_sigterm() {
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let (req, resp) = (unique_topic("cli-tc-req"), unique_topic("cli-tc-resp"));
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
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
        ])
        .env("SLUICE_LLM_API_KEY", KEY)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    ready(&mut child, port).await;

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

    assert!(sluice_tests::process::signal(child.id().unwrap(), "TERM"));
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let mut logs = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut logs)
        .await
        .unwrap();
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
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "text-completion",
            "--provider",
            "openai-compatible",
            "--in-process",
        ])
        .env_remove("SLUICE_BASE_URL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("--base-url"), "{err}");
}

/// A retry policy that cannot be read (here from the environment) stops the processor at
/// start, saying what to write.
#[test]
fn a_bad_retry_policy_is_a_clear_error_at_start() {
    let run = |retry: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
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
            ])
            .env("SLUICE_RETRY", retry)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
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
        assert_eq!(out.status.code(), Some(1), "{retry}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(says), "{retry}: {err}");
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
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
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
        ])
        .env_remove("AWS_BEARER_TOKEN_BEDROCK")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_SESSION_TOKEN")
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
        .env("AWS_SECRET_ACCESS_KEY_FILE", &secret_file)
        .env("AWS_SESSION_TOKEN_FILE", &token_file)
        .env(
            "RUST_LOG",
            "debug,aws_sigv4=trace,aws_credential_types=trace,aws_smithy_types=trace",
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    ready(&mut child, port).await;
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
    assert!(sluice_tests::process::signal(child.id().unwrap(), "TERM"));
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let mut logs = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut logs)
        .await
        .unwrap();
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
