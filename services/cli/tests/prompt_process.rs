//! `sluice prompt` as a process: the template file is reloaded on SIGHUP (the file-change
//! poll is set to an hour here, so nothing else can reload it), a broken file keeps the
//! templates in use and is counted, and SIGTERM still drains to exit 0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::Sluice;
use sluice_tests::{Broker, eventually_value, free_port, scrape, unique_topic, value};

const ONE: &str = r#"{"templates": {"first": {"prompt": "{{ x }}"}}}"#;
const TWO: &str =
    r#"{"templates": {"first": {"prompt": "{{ x }}"}, "second": {"prompt": "{{ y }}"}}}"#;

async fn metric(port: u16, name: &str, labels: &[(&str, &str)]) -> f64 {
    value(&scrape(port).await, name, labels)
}

/// Waits (up to 30 s) until `name{labels}` reads `want`; panics with the log otherwise.
async fn until(process: &Sluice, port: u16, name: &str, labels: &[(&str, &str)], want: f64) {
    let now = eventually_value(port, name, labels, Duration::from_secs(30), |v| v == want).await;
    assert!(
        now == want,
        "{name}{labels:?} never read {want} (now {now}):\n{}",
        process.stderr()
    );
}

#[tokio::test]
async fn sighup_reloads_the_template_file_and_a_broken_file_keeps_the_old_set() {
    sluice_runtime::install_crypto_provider();
    let broker = Broker::from_env().await;
    let dir = std::env::temp_dir().join(unique_topic("sluice-hup").replace([':', '/'], "-"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("templates.json");
    std::fs::write(&file, ONE).unwrap();
    let port = free_port();
    let topics = [
        ("--request-topic", unique_topic("hup-req")),
        ("--response-topic", unique_topic("hup-resp")),
        ("--cancel-topic", unique_topic("hup-cancel")),
        ("--llm-request-topic", unique_topic("hup-llm-req")),
        ("--llm-response-topic", unique_topic("hup-llm-resp")),
        ("--llm-cancel-topic", unique_topic("hup-llm-cancel")),
    ];
    let (file_arg, metrics_addr) = (file.display().to_string(), format!("127.0.0.1:{port}"));
    let mut args = vec![
        "prompt",
        "--templates",
        file_arg.as_str(),
        "--no-builtin-templates",
        "--template-poll-secs",
        "3600",
        "--metrics-addr",
        metrics_addr.as_str(),
        "--pulsar-url",
        broker.url.as_str(),
        "--pulsar-admin-url",
        broker.admin_url.as_str(),
    ];
    for (flag, topic) in &topics {
        args.extend([*flag, topic.as_str()]);
    }
    let mut prompt = Sluice::spawn(
        &args,
        &[("RUST_LOG", "info")],
        &["SLUICE_CONFIG", "SLUICE_TEMPLATES", "SLUICE_METRICS_ADDR"],
    );
    prompt
        .ready(&format!("http://127.0.0.1:{port}/readyz"))
        .await;
    until(&prompt, port, "sluice_prompt_templates", &[], 1.0).await;

    // A new file: nothing happens until SIGHUP (the poll is an hour away)...
    std::fs::write(&file, TWO).unwrap();
    assert_eq!(metric(port, "sluice_prompt_templates", &[]).await, 1.0);
    // ...which loads it.
    prompt.signal("HUP");
    until(&prompt, port, "sluice_prompt_templates", &[], 2.0).await;
    until(
        &prompt,
        port,
        "sluice_prompt_template_reloads_total",
        &[("outcome", "success")],
        1.0,
    )
    .await;

    // A broken file on SIGHUP: counted as a failure, the two templates stay.
    std::fs::write(&file, "{ not json").unwrap();
    prompt.signal("HUP");
    until(
        &prompt,
        port,
        "sluice_prompt_template_reloads_total",
        &[("outcome", "failure")],
        1.0,
    )
    .await;
    assert_eq!(metric(port, "sluice_prompt_templates", &[]).await, 2.0);

    let out = prompt.stop().await;
    assert!(out.status.success(), "{:?}\n{}", out.status, out.stderr);
    assert!(
        out.stderr.contains("SIGHUP"),
        "the reload says why:\n{}",
        out.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}
