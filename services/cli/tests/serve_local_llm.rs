//! The main job as a test: `sluice serve` (in-process bus) against the real local LLM that
//! the test command starts (llama-server + SmolLM2-135M), and `sluice invoke llm` streaming
//! its answer. A 135M model answers poorly: this checks the protocol and usage, not prose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{process::Stdio, time::Duration};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::Command,
};

#[tokio::test]
async fn serve_streams_a_real_local_llm_answer_to_invoke() {
    let url = std::env::var("SLUICE_LLM_URL").unwrap_or_else(|_| "http://127.0.0.1:8766".into());
    let key = std::env::var("SLUICE_LLM_API_KEY")
        .expect("the test command sets SLUICE_LLM_API_KEY and starts the local LLM with it");
    let mut serve = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "serve",
            "--config",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../deploy/serve/local-llm.toml"
            ),
            "--base-url",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--max-output-tokens",
            "24",
        ])
        .env("SLUICE_LLM_API_KEY", &key)
        .env_remove("SLUICE_CONFIG")
        .env_remove("SLUICE_GATEWAY_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines();
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
    let out = tokio::time::timeout(
        Duration::from_secs(180),
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "invoke",
                "-u",
                &gateway,
                "--show-usage",
                "llm",
                "You are a helpful assistant.",
                "Name a colour.",
            ])
            .env_remove("SLUICE_TOKEN")
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "{stderr}");
    assert!(!stdout.trim().is_empty(), "an answer was printed");
    let count = |label: &str| -> u64 {
        stderr
            .lines()
            .find_map(|l| l.strip_prefix(label))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{label} in {stderr:?}"))
    };
    assert!(count("Input tokens:") > 0);
    let out_tokens = count("Output tokens:");
    assert!((1..=24).contains(&out_tokens), "{out_tokens}");
}
