//! `sluice text-completion` run as a process against the real broker and the fake OpenAI
//! server: it serves a streamed request, keeps the key out of its output, and drains on SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{process::Stdio, time::Duration};

use sluice_runtime::client::Received;
use sluice_schema::TextCompletionRequest;
use sluice_tests::{Broker, fake_openai::FakeOpenAi, text_client, unique_topic};
use tokio::{io::AsyncReadExt, process::Command};

const KEY: &str = "sk-from-the-environment-only";

#[tokio::test]
async fn the_processor_process_streams_keeps_its_key_secret_and_drains_on_sigterm() {
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let (req, resp) = (unique_topic("cli-tc-req"), unique_topic("cli-tc-resp"));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
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
    let ready = format!("http://127.0.0.1:{port}/readyz");
    let mut up = false;
    for _ in 0..300 {
        if reqwest::get(&ready)
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false)
        {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(up, "the processor became ready");

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

    let pid = child.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
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
