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
    start_on(config, |bus| Arc::new(bus)).await
}

/// [`start_with`], the processor reading the in-process bus through `wrap` (the fixture
/// publishes and reads on the bus itself).
async fn start_on(
    config: ProcessorConfig,
    wrap: impl FnOnce(MemoryBus) -> Arc<dyn Bus>,
) -> Fixture {
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
        wrap(bus.clone()),
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

/// A bus whose request subscriptions lose what is handed back, as a non-persistent topic
/// does: a nack settles the message for good (the memory bus would redeliver it).
struct DropsNacks(MemoryBus);

#[async_trait]
impl Bus for DropsNacks {
    async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError> {
        self.0.publisher(topic).await
    }

    async fn subscribe(
        &self,
        topic: &str,
        subscription: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BusError> {
        Ok(Box::new(NacksDropped(
            self.0.subscribe(topic, subscription, options).await?,
        )))
    }

    fn max_message_bytes(&self) -> usize {
        self.0.max_message_bytes()
    }
}

struct NacksDropped(Box<dyn Subscription>);

/// Settles the real delivery with an ack, whatever was asked.
struct AckAlways(crate::bus::Delivery);

impl crate::bus::Settle for AckAlways {
    fn settle(self: Box<Self>, _: crate::bus::Settlement) {
        self.0.ack();
    }
}

#[async_trait]
impl Subscription for NacksDropped {
    async fn next(&mut self) -> Option<Result<crate::bus::Delivery, BusError>> {
        let d = match self.0.next().await? {
            Ok(d) => d,
            Err(e) => return Some(Err(e)),
        };
        let (payload, properties, count) = (
            d.payload().clone(),
            d.properties().clone(),
            d.redelivery_count(),
        );
        Some(Ok(crate::bus::Delivery::new(
            payload,
            properties,
            count,
            Box::new(AckAlways(d)),
        )))
    }

    async fn close(self: Box<Self>) {
        self.0.close().await;
    }

    async fn unsubscribe(self: Box<Self>) {
        self.0.unsubscribe().await;
    }

    fn link(&self) -> crate::bus::Link {
        self.0.link()
    }
}

/// A processor on a non-persistent request topic whose hand-backs are lost (as there), sent
/// one request, `h1`, whose hand-off cannot be stored.
async fn handoff_fails_on_a_non_persistent_topic() -> Fixture {
    let (req, resp) = ("non-persistent://t/ns/req", "non-persistent://t/ns/resp");
    let mut config = ProcessorConfig::new("echo", req, resp);
    config.drain_grace = Duration::from_millis(100);
    let f = start_on(config, |bus| Arc::new(DropsNacks(bus))).await;
    f.bus
        .publisher(req)
        .await
        .unwrap()
        .send(Message::new(r#"{"prompt":"handoff-fails"}"#).with_property(properties::ID, "h1"))
        .await
        .unwrap();
    f
}

/// A processor waiting for its next request when a request task finds the broker unable
/// to store probes the broker at once, and its syncs say it takes requests again as soon
/// as the broker stores, with no request arriving. Before, only the next request made it
/// probe; on a non-persistent request topic, where the requests sent during a broker's
/// failover can all be lost, its syncs said "not taking" for minutes, and its clients,
/// which end a request no processor lists only while every processor takes requests,
/// waited out their inactivity timeouts (the secured cluster, 2026-12-07).
#[tokio::test]
async fn an_idle_processor_probes_a_blocked_store_at_once_and_takes_requests_again() {
    // Its hand-off cannot be stored: the store is blocked and the request handed back,
    // which loses it here. No other request comes.
    let Fixture {
        mut responses,
        telemetry,
        shutdown,
        task,
        ..
    } = handoff_fails_on_a_non_persistent_topic().await;
    // The syncs: "taking" once h1 has been handed back. A hang guard, not a measure: a
    // processor that never probes never says it takes requests again.
    let mut handed_back = false;
    let taking_again = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let d = responses.next().await.unwrap().unwrap();
            let state = d
                .property(properties::SYNC_STATE)
                .map(|state| serde_json::from_str::<crate::sync::SyncState>(state).unwrap());
            d.ack();
            let Some(state) = state else { continue };
            let h1 = state.streams.iter().find(|e| e.0 == "h1");
            handed_back |= h1.is_some_and(|e| !e.3);
            if handed_back && state.taking {
                return;
            }
        }
    })
    .await;
    assert!(
        taking_again.is_ok(),
        "handed back: {handed_back}; the processor never said it takes requests again: {}",
        telemetry.render()
    );
    assert!(
        telemetry
            .render()
            .contains(r#"sluice_processor_store_blocked{processor="echo"} 0"#)
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// On a non-persistent request topic a request handed back is gone (a nack brings nothing
/// back), so its stream is listed as finished with one record more than the processor
/// handed to the producer: its client, which has every record that was sent, ends it as
/// lost at the sync instead of waiting out its inactivity timeout (the secured cluster,
/// 2026-12-07: 11 streams listed finished with the one record their client had, each
/// ended at the gateway's 120 s timeout).
#[tokio::test]
async fn on_a_non_persistent_request_topic_a_request_handed_back_is_listed_as_lost() {
    let Fixture {
        mut responses,
        shutdown,
        task,
        ..
    } = handoff_fails_on_a_non_persistent_topic().await;
    let mut received = 0;
    let listed = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let d = responses.next().await.unwrap().unwrap();
            if d.property(properties::ID) == Some("h1") {
                received += 1;
                d.ack();
                continue;
            }
            let state = d
                .property(properties::SYNC_STATE)
                .map(|state| serde_json::from_str::<crate::sync::SyncState>(state).unwrap());
            d.ack();
            if let Some(state) = state
                && let Some(entry) = state.streams.iter().find(|e| e.0 == "h1" && !e.3)
            {
                return entry.clone();
            }
        }
    })
    .await
    .expect("h1 listed as finished");
    // "step one" arrived; the hand-off after it failed, and no terminal record came.
    assert_eq!(received, 1);
    assert!(
        listed.2 > received,
        "listed as finished with {} records, {received} arrived: {listed:?}",
        listed.2
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
