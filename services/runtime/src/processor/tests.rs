//! The processor's test fixture (an echo handler on the in-process bus) and the tests of a
//! request's whole path: records in order, one terminal error per failure, a request
//! without an id.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sluice_schema::{Error, ErrorKind, TextCompletionRequest, TextCompletionResponse, properties};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::{
    bus::{Bus, BusError, Message, Publisher, SubscribeOptions, Subscription, memory::MemoryBus},
    telemetry::Telemetry,
};

pub(super) struct Echo;

/// Counts handler futures of "hang" requests that were dropped.
pub(super) static HANGS_DROPPED: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Counts handler futures of "linger" requests that were dropped (a counter of its own:
/// tests run in parallel).
pub(super) static LINGERS_DROPPED: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

struct OnDrop(&'static std::sync::atomic::AtomicUsize);
impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait]
impl Handler for Echo {
    type Request = TextCompletionRequest;
    type Response = TextCompletionResponse;

    async fn handle(
        &self,
        request: TextCompletionRequest,
        ctx: RequestContext,
        sink: &mut ResponseSink<TextCompletionResponse>,
    ) -> Result<(), Error> {
        match request.prompt.as_str() {
            "panic" => panic!("boom"),
            "whose-key" => {
                // What a handler is told to bill, and forwards.
                let said = format!("{:?} {:?}", ctx.key, ctx.key_seal);
                let _ = sink
                    .send(TextCompletionResponse {
                        response: said,
                        end_of_stream: true,
                        ..Default::default()
                    })
                    .await;
                return Ok(());
            }
            "forget" => return Ok(()),
            "hang" | "linger" | "stall" => {
                // Each test that counts drops has a prompt of its own.
                let _guard = match request.prompt.as_str() {
                    "hang" => Some(OnDrop(&HANGS_DROPPED)),
                    "linger" => Some(OnDrop(&LINGERS_DROPPED)),
                    _ => None,
                };
                let _ = sink
                    .send(TextCompletionResponse {
                        response: "started".into(),
                        ..Default::default()
                    })
                    .await;
                std::future::pending::<()>().await;
            }
            "fail" => return Err(Error::new(ErrorKind::Llm, "provider said no")),
            "handoff-fails" => {
                let _ = sink
                    .send(TextCompletionResponse {
                        response: "step one".into(),
                        ..Default::default()
                    })
                    .await;
                // As the agent does: the hand-off failing becomes the handler's error.
                return sink
                    .hand_off(&Unstorable, b"{}".to_vec())
                    .await
                    .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()));
            }
            "huge" => {
                let big = TextCompletionResponse {
                    response: "x".repeat(4096),
                    ..Default::default()
                };
                let ended = sink.send(big).await;
                assert!(matches!(ended, Err(SinkError::Ended)));
                return Ok(());
            }
            _ => {}
        }
        for word in request.prompt.split(' ') {
            let _ = sink
                .send(TextCompletionResponse {
                    response: word.to_owned(),
                    ..Default::default()
                })
                .await;
        }
        sink.send(TextCompletionResponse {
            end_of_stream: true,
            ..Default::default()
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        // Nothing may follow the terminal record.
        assert!(matches!(
            sink.send(TextCompletionResponse::default()).await,
            Err(SinkError::Ended)
        ));
        Ok(())
    }
}

/// A publisher whose broker never stores anything.
struct Unstorable;

#[async_trait]
impl Publisher for Unstorable {
    async fn send(&self, _: Message) -> Result<crate::bus::Receipt, BusError> {
        Err(BusError::Unavailable("the bookie is read-only".into()))
    }
    fn topic(&self) -> &str {
        "next-step"
    }
}

pub(super) struct Fixture {
    pub(super) bus: MemoryBus,
    pub(super) responses: Box<dyn Subscription>,
    pub(super) telemetry: Telemetry,
    pub(super) shutdown: CancellationToken,
    pub(super) task: tokio::task::JoinHandle<Result<(), BusError>>,
}

pub(super) async fn start() -> Fixture {
    let mut config = ProcessorConfig::new("echo", "req", "resp");
    config.drain_grace = Duration::from_millis(200);
    config.cancel_topic = Some("cancel".into());
    start_with(config).await
}

/// A processor of `config` answering with [`Echo`] on an in-process bus, subscribed to
/// before anything is published, with a subscription to its response topic.
pub(super) async fn start_with(config: ProcessorConfig) -> Fixture {
    let bus = MemoryBus::new(2048, 1000);
    let responses = bus
        .subscribe(
            &config.response_topic,
            "test",
            SubscribeOptions::exclusive(100),
        )
        .await
        .unwrap();
    let telemetry = Telemetry::new().unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(run(
        Arc::new(bus.clone()),
        config,
        Arc::new(Echo),
        telemetry.clone(),
        shutdown.clone(),
    ));
    // Let the processor subscribe before anything is published.
    tokio::time::timeout(Duration::from_secs(5), telemetry.health.until_watched(1))
        .await
        .expect("the processor subscribes");
    Fixture {
        bus,
        responses,
        telemetry,
        shutdown,
        task,
    }
}

pub(super) async fn ask(
    f: &mut Fixture,
    id: Option<&str>,
    payload: &str,
) -> Vec<TextCompletionResponse> {
    ask_with(f, id, payload, &[]).await
}

/// [`ask`], the request carrying `props` too.
pub(super) async fn ask_with(
    f: &mut Fixture,
    id: Option<&str>,
    payload: &str,
    props: &[(&str, &str)],
) -> Vec<TextCompletionResponse> {
    let mut m = Message::new(payload.to_owned());
    if let Some(id) = id {
        m = m.with_property(properties::ID, id);
    }
    for (k, v) in props {
        m = m.with_property(*k, *v);
    }
    f.bus.publisher("req").await.unwrap().send(m).await.unwrap();
    let mut out = Vec::new();
    loop {
        let d = tokio::time::timeout(Duration::from_secs(5), f.responses.next())
            .await
            .expect("a response")
            .unwrap()
            .unwrap();
        assert_eq!(d.property(properties::ID), id);
        assert!(d.property(properties::ATTEMPT).is_some());
        let r: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        let end = r.end_of_stream;
        out.push(r);
        if end {
            return out;
        }
    }
}

#[tokio::test]
async fn streams_in_order_and_ends_with_one_terminal_record() {
    let mut f = start().await;
    let out = ask(&mut f, Some("r1"), r#"{"prompt":"a b c","streaming":true}"#).await;
    let words: Vec<_> = out.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(words, ["a", "b", "c", ""]);
    assert!(out.iter().filter(|r| r.end_of_stream).count() == 1);
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn every_failure_becomes_one_terminal_error_record() {
    let mut f = start().await;
    for (prompt, kind) in [
        ("panic", "internal-error"),
        ("forget", "internal-error"),
        ("fail", "llm-error"),
        ("huge", "message-too-large"),
    ] {
        let out = ask(&mut f, Some(prompt), &format!(r#"{{"prompt":"{prompt}"}}"#)).await;
        assert_eq!(out.len(), 1, "{prompt}: {out:?}");
        assert_eq!(out[0].error.as_ref().unwrap().kind, kind, "{prompt}");
    }
    let out = ask(&mut f, Some("bad"), r#"{"prompt": 42}"#).await;
    let err = out[0].error.as_ref().unwrap();
    assert_eq!(err.kind, "invalid-request");
    assert!(
        !err.message.contains("42"),
        "the payload is not quoted back"
    );
    let text = f.telemetry.render();
    assert!(
        text.contains(r#"sluice_processor_requests_total{outcome="malformed",processor="echo"} 1"#)
    );
    assert!(
        text.contains(r#"sluice_processor_requests_total{outcome="error",processor="echo"} 4"#)
    );
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_request_without_id_is_counted_and_not_redelivered() {
    let mut f = start().await;
    f.bus
        .publisher("req")
        .await
        .unwrap()
        .send(Message::new("{}"))
        .await
        .unwrap();
    // The next request still flows: the id-less one did not block anything.
    let out = ask(&mut f, Some("after"), r#"{"prompt":"ok"}"#).await;
    assert_eq!(out[0].response, "ok");
    let text = f.telemetry.render();
    assert!(
        text.contains(r#"sluice_processor_requests_total{outcome="malformed",processor="echo"} 1"#)
    );
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();
}
