//! A processor process running [`sluice_tests::EchoHandler`], for tests that need a real
//! process to kill (SIGKILL mid-request) or to drain (SIGTERM with requests in flight).
//!
//! Configured by env: PULSAR_URL, REQUEST_TOPIC, RESPONSE_TOPIC, SUBSCRIPTION,
//! CONCURRENCY, DRAIN_GRACE_MS, METRICS_ADDR. Prints `ready` on stdout once subscribed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use sluice_runtime::{
    bus::pulsar::{PulsarBus, PulsarConfig},
    processor::{ProcessorConfig, run},
    telemetry::{LogFormat, Telemetry, init_tracing, shutdown_on_signals},
};

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key} is required"))
}

#[tokio::main]
async fn main() {
    init_tracing(LogFormat::Text);
    let shutdown = shutdown_on_signals();
    let bus = PulsarBus::connect(
        PulsarConfig::new(env("PULSAR_URL")),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut config = ProcessorConfig::new("echo", env("REQUEST_TOPIC"), env("RESPONSE_TOPIC"));
    sluice_tests::record_per_delta(&mut config);
    config.subscription = env("SUBSCRIPTION");
    if let Ok(c) = std::env::var("CONCURRENCY") {
        config.concurrency = c.parse().unwrap();
    }
    if let Ok(ms) = std::env::var("DRAIN_GRACE_MS") {
        config.drain_grace = Duration::from_millis(ms.parse().unwrap());
    }
    let telemetry = Telemetry::new().unwrap();
    let addr = std::env::var("METRICS_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into());
    // The telemetry server outlives the drain: /readyz must answer 503 while draining.
    let telemetry_stop = tokio_util::sync::CancellationToken::new();
    let bound = telemetry
        .serve(addr.parse().unwrap(), telemetry_stop.clone())
        .await
        .unwrap();
    let health = telemetry.health.clone();
    tokio::spawn(async move {
        while health.watched() == 0 || health.readiness().is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!("ready {bound}");
    });
    run(
        Arc::new(bus),
        config,
        Arc::new(sluice_tests::EchoHandler),
        telemetry,
        shutdown,
    )
    .await
    .unwrap();
    telemetry_stop.cancel();
    eprintln!("drained");
}
