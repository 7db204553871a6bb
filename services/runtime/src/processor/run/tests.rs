use std::{sync::Arc, time::Duration};

use sluice_schema::{TextCompletionResponse, properties};
use tokio_util::sync::CancellationToken;

use super::CANCEL_SUBSCRIBE_WAIT;
use crate::{
    bus::{Bus, Message, SubscribeOptions, memory::MemoryBus},
    cancel,
    processor::{ProcessorConfig, run, tests::*},
    telemetry::Telemetry,
};

/// Starts the echo processor on a bus whose cancel subscription waits for `gate`, and
/// publishes one stalling request to it once its request subscription exists.
async fn start_behind_a_slow_cancel_subscription(
    gate: tokio::sync::watch::Receiver<bool>,
) -> Fixture {
    let bus = MemoryBus::new(2048, 1000);
    let responses = bus
        .subscribe("resp", "test", SubscribeOptions::exclusive(100))
        .await
        .unwrap();
    let mut config = ProcessorConfig::new("echo", "req", "resp");
    config.cancel_topic = Some("cancel".into());
    config.drain_grace = Duration::from_millis(200);
    let telemetry = Telemetry::new().unwrap();
    let shutdown = CancellationToken::new();
    let slow = crate::bus::memory::SlowCancelTopic {
        inner: bus.clone(),
        publishers: false,
        gate,
    };
    let task = tokio::spawn(run(
        Arc::new(slow),
        config,
        Arc::new(Echo),
        telemetry.clone(),
        shutdown.clone(),
    ));
    // On paused time: every task runs until idle first, so the in-process request
    // subscription exists after this.
    tokio::time::sleep(Duration::from_millis(100)).await;
    bus.publisher("req")
        .await
        .unwrap()
        .send(Message::new(r#"{"prompt":"stall"}"#).with_property(properties::ID, "s1"))
        .await
        .unwrap();
    Fixture {
        bus,
        responses,
        telemetry,
        shutdown,
        task,
    }
}

/// A processor takes no request before it reads cancels: a cancel sent meanwhile would be
/// lost, and the provider call it should stop would run to its end (found in CI: a client
/// that went away right after its first token on a just-started processor).
#[tokio::test(start_paused = true)]
async fn no_request_is_taken_before_the_cancel_subscription_exists() {
    let (open, gate) = tokio::sync::watch::channel(false);
    let mut f = start_behind_a_slow_cancel_subscription(gate).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(1), f.responses.next())
            .await
            .is_err(),
        "the request was taken before cancels could be read"
    );
    open.send(true).unwrap();
    let d = f.responses.next().await.unwrap().unwrap();
    let first: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
    d.ack();
    assert_eq!(first.response, "started");
    f.bus
        .publisher("cancel")
        .await
        .unwrap()
        .send(cancel::cancel_message("s1"))
        .await
        .unwrap();
    let d = tokio::time::timeout(Duration::from_secs(5), f.responses.next())
        .await
        .expect("the cancelled record")
        .unwrap()
        .unwrap();
    let last: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
    d.ack();
    assert_eq!(last.error.unwrap().kind, "cancelled");
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();
}

/// ...but a cancel topic that cannot be subscribed (a missing namespace: the broker's
/// lookup retries for long) delays serving by [`CANCEL_SUBSCRIBE_WAIT`] only.
#[tokio::test(start_paused = true)]
async fn a_cancel_subscription_that_does_not_come_delays_serving_briefly() {
    let (_never, gate) = tokio::sync::watch::channel(false);
    let started = tokio::time::Instant::now();
    let mut f = start_behind_a_slow_cancel_subscription(gate).await;
    let d = tokio::time::timeout(Duration::from_secs(30), f.responses.next())
        .await
        .expect("served without cancels")
        .unwrap()
        .unwrap();
    d.ack();
    let waited = started.elapsed();
    assert!(
        waited >= CANCEL_SUBSCRIBE_WAIT && waited < CANCEL_SUBSCRIBE_WAIT * 2,
        "{waited:?}"
    );
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();
}
