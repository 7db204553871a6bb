use std::time::Duration;

use futures::FutureExt;
use sluice_schema::{ErrorKind, TextCompletionResponse, properties};

use crate::{
    bus::{Bus, Message, SubscribeOptions},
    processor::{ProcessorConfig, tests::*},
};

/// When the drain grace runs out, an unfinished request is not failed but moved: its
/// handler is dropped, no record is published for it, and the broker has it again, for
/// another replica (which starts its stream over under a new attempt id).
#[tokio::test]
async fn a_request_unfinished_when_the_drain_grace_runs_out_is_handed_back_without_an_error() {
    let mut f = start().await;
    f.bus
        .publisher("req")
        .await
        .unwrap()
        .send(Message::new(r#"{"prompt":"linger"}"#).with_property(properties::ID, "l1"))
        .await
        .unwrap();
    let d = f.responses.next().await.unwrap().unwrap();
    let first: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
    d.ack();
    assert_eq!(first.response, "started");
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();
    assert_eq!(LINGERS_DROPPED.load(std::sync::atomic::Ordering::SeqCst), 1);
    // The processor has stopped: anything it published is already on the topic.
    assert!(
        f.responses.next().now_or_never().is_none(),
        "no error record ends the stream"
    );
    let text = f.telemetry.render();
    for line in [
        r#"sluice_processor_requests_total{outcome="retried",processor="echo"} 1"#,
        r#"sluice_processor_requests_total{outcome="error",processor="echo"} 0"#,
        r#"sluice_processor_requests_total{outcome="cancelled",processor="echo"} 0"#,
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
    let mut again = f
        .bus
        .subscribe("req", "echo", SubscribeOptions::shared(1))
        .await
        .unwrap();
    let d = tokio::time::timeout(Duration::from_secs(5), again.next())
        .await
        .expect("the request is back on the broker")
        .unwrap()
        .unwrap();
    assert_eq!(d.property(properties::ID), Some("l1"));
    assert_eq!(d.redelivery_count(), 1);
}

/// On a non-persistent request topic a nack would lose the request, so one still running
/// when the drain grace runs out is answered instead: a `cancelled` error saying to send
/// it again.
#[tokio::test]
async fn on_a_non_persistent_request_topic_an_unfinished_request_is_answered_at_the_grace() {
    let req = "non-persistent://t/ns/req";
    let mut config = ProcessorConfig::new("echo", req, "resp");
    config.drain_grace = Duration::from_millis(100);
    let Fixture {
        bus,
        mut responses,
        shutdown,
        task,
        ..
    } = start_with(config).await;
    bus.publisher(req)
        .await
        .unwrap()
        .send(Message::new(r#"{"prompt":"stall"}"#).with_property(properties::ID, "s1"))
        .await
        .unwrap();
    let mut next = async || {
        let d = tokio::time::timeout(Duration::from_secs(5), responses.next())
            .await
            .expect("a record")
            .unwrap()
            .unwrap();
        let r: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        r
    };
    assert_eq!(next().await.response, "started");
    shutdown.cancel();
    task.await.unwrap().unwrap();
    let last = next().await;
    assert!(last.end_of_stream);
    let error = last.error.unwrap();
    assert_eq!(error.kind, ErrorKind::Cancelled);
    assert!(error.message.contains("send the request again"), "{error}");
}
