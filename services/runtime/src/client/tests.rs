//! The client's test helpers (the reader's tests use them too) and the tests of a request's
//! whole path: routing by id, restarts, time limits, closing.

use std::{sync::Arc, time::Duration};

use sluice_schema::{TextCompletionRequest, TextCompletionResponse, properties};
use tokio::time::Instant;

use super::*;
use crate::{
    bus::{Bus, Message, SubscribeOptions, Subscription, memory::MemoryBus},
    sync::SyncState,
};

pub(crate) type Client = RequestClient<TextCompletionRequest, TextCompletionResponse>;

/// A client of service `svc` on the in-process bus (requests on `req`, answers on `resp`,
/// 300 ms inactivity timeout) and the service's request subscription; the reader's tests
/// use it too.
pub(crate) async fn setup() -> (MemoryBus, Box<dyn Subscription>, Client) {
    let bus = MemoryBus::default();
    let requests = bus
        .subscribe("req", "svc", SubscribeOptions::shared(10))
        .await
        .unwrap();
    let mut config = ClientConfig::new("test", "req", "resp");
    config.inactivity_timeout = Duration::from_millis(300);
    let client = Client::start(Arc::new(bus.clone()), config, None)
        .await
        .unwrap();
    (bus, requests, client)
}

pub(crate) async fn reply(bus: &MemoryBus, id: &str, attempt: &str, text: &str, end: bool) {
    let r = TextCompletionResponse {
        response: text.to_owned(),
        end_of_stream: end,
        ..Default::default()
    };
    bus.publisher("resp")
        .await
        .unwrap()
        .send(
            Message::new(serde_json::to_vec(&r).unwrap())
                .with_property(properties::ID, id)
                .with_property(properties::ATTEMPT, attempt),
        )
        .await
        .unwrap();
}

pub(crate) fn text(item: Option<Result<Received<TextCompletionResponse>, ClientError>>) -> String {
    match item.unwrap().unwrap() {
        Received::Record(r) => r.response,
        Received::Restarted => "<restarted>".to_owned(),
    }
}

pub(crate) async fn numbered(
    bus: &MemoryBus,
    id: &str,
    attempt: &str,
    seq: u64,
    text: &str,
    end: bool,
) {
    let r = TextCompletionResponse {
        response: text.to_owned(),
        end_of_stream: end,
        ..Default::default()
    };
    bus.publisher("resp")
        .await
        .unwrap()
        .send(
            Message::new(serde_json::to_vec(&r).unwrap())
                .with_property(properties::ID, id)
                .with_property(properties::ATTEMPT, attempt)
                .with_property(properties::SEQ, seq.to_string()),
        )
        .await
        .unwrap();
}

/// A stream that waits 30 s for its next record: long enough for the syncs' verdicts,
/// which the tests below time, to come first.
pub(crate) async fn patient(client: &Client) -> ResponseStream<TextCompletionResponse> {
    client
        .request_with(
            &TextCompletionRequest::default(),
            RequestOptions {
                inactivity_timeout: Some(Duration::from_secs(30)),
                ..RequestOptions::default()
            },
        )
        .await
        .unwrap()
}

/// A processor instance's sync, as `processor::send_syncs` makes it.
/// `streams`: (request id, attempt key, records published, open).
pub(crate) async fn sync(
    bus: &MemoryBus,
    instance: &str,
    taking: bool,
    streams: &[(&str, &str, u64, bool)],
) {
    let state = SyncState {
        instance: instance.to_owned(),
        at_ms: u64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap(),
        taking,
        streams: streams
            .iter()
            .map(|(id, attempt, n, open)| ((*id).to_owned(), (*attempt).to_owned(), *n, *open))
            .collect(),
    };
    bus.publisher("resp")
        .await
        .unwrap()
        .send(
            Message::new(&b"{}"[..])
                .with_property(properties::ID, properties::SYNC)
                .with_property(properties::SYNC, "text-completion")
                .with_property(
                    properties::SYNC_STATE,
                    serde_json::to_string(&state).unwrap(),
                ),
        )
        .await
        .unwrap();
}

pub(crate) async fn lost_in_transit(
    s: &mut ResponseStream<TextCompletionResponse>,
) -> (String, Duration) {
    let started = Instant::now();
    match s.next().await.unwrap() {
        Err(ClientError::LostInTransit(why)) => (why, started.elapsed()),
        other => panic!("expected LostInTransit, got {other:?}"),
    }
}

#[tokio::test]
async fn routes_by_id_and_ignores_duplicates_after_the_terminal_record() {
    let (bus, mut requests, client) = setup().await;
    let mut a = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    let mut b = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    let ra = requests.next().await.unwrap().unwrap();
    let rb = requests.next().await.unwrap().unwrap();
    assert_eq!(ra.property(properties::ID), Some(a.id()));
    reply(&bus, b.id(), "1", "for b", false).await;
    reply(&bus, a.id(), "1", "for a", true).await;
    reply(&bus, a.id(), "1", "late duplicate", true).await;
    reply(&bus, b.id(), "1", "b ends", true).await;
    assert_eq!(text(a.next().await), "for a");
    assert!(a.next().await.is_none());
    assert_eq!(text(b.next().await), "for b");
    assert_eq!(text(b.next().await), "b ends");
    assert!(b.next().await.is_none());
    ra.ack();
    rb.ack();
}

#[tokio::test]
async fn clients_sharing_a_response_topic_skip_each_others_answers_without_counting_them() {
    let bus = MemoryBus::default();
    let mut requests = bus
        .subscribe("req", "svc", SubscribeOptions::shared(10))
        .await
        .unwrap();
    let telemetry = crate::telemetry::Telemetry::new().unwrap();
    let start = |service: &str| {
        Client::start(
            Arc::new(bus.clone()),
            ClientConfig::new(service, "req", "resp"),
            Some(telemetry.metrics.clone()),
        )
    };
    let (a, b) = (start("a").await.unwrap(), start("b").await.unwrap());
    let mut stream = a.request(&TextCompletionRequest::default()).await.unwrap();
    let req = requests.next().await.unwrap().unwrap();
    let reply_to = req.property(properties::REPLY_TO).unwrap().to_owned();
    assert_eq!(reply_to, a.config.subscription);
    let id = req.property(properties::ID).unwrap().to_owned();
    req.ack();
    // What a processor does: copy the id and the reply-to onto every record.
    let answer = |text: &str| {
        let r = TextCompletionResponse {
            response: text.to_owned(),
            end_of_stream: true,
            ..Default::default()
        };
        Message::new(serde_json::to_vec(&r).unwrap())
            .with_property(properties::ID, id.as_str())
            .with_property(properties::REPLY_TO, reply_to.as_str())
    };
    let publisher = bus.publisher("resp").await.unwrap();
    publisher.send(answer("hi")).await.unwrap().await.unwrap();
    assert_eq!(text(stream.next().await), "hi");
    // A late duplicate is a's own unroutable record; b never counts a's answers.
    publisher
        .send(answer("again"))
        .await
        .unwrap()
        .await
        .unwrap();
    let unroutable = |service: &str| {
        let series = format!("sluice_client_unroutable_records_total{{service=\"{service}\"}} ");
        telemetry
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()).map(str::to_owned))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    for _ in 0..100 {
        if unroutable("a") == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(unroutable("a"), 1);
    // A record without the property (a TrustGraph service's) still counts everywhere.
    let legacy = TextCompletionResponse::default();
    publisher
        .send(
            Message::new(serde_json::to_vec(&legacy).unwrap())
                .with_property(properties::ID, "nobody"),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    // Both routers see it: wait for both rather than count on their order of wake-up.
    for _ in 0..100 {
        if unroutable("b") == 1 && unroutable("a") == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(unroutable("b"), 1, "only the record without a reply-to");
    assert_eq!(unroutable("a"), 2);
    drop(b);
}

#[tokio::test]
async fn a_new_attempt_is_announced_before_its_records() {
    let (bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    reply(&bus, s.id(), "first", "par", false).await;
    reply(&bus, s.id(), "second", "full", false).await;
    reply(&bus, s.id(), "second", " answer", true).await;
    assert_eq!(text(s.next().await), "par");
    assert_eq!(text(s.next().await), "<restarted>");
    assert_eq!(text(s.next().await), "full");
    assert_eq!(text(s.next().await), " answer");
    assert!(s.next().await.is_none());
}

#[tokio::test]
async fn a_continuation_reads_on_and_a_redelivered_step_restarts() {
    let (bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    let send =
        |attempt: &'static str, continues: Option<&'static str>, text: &'static str, end: bool| {
            let (bus, id) = (bus.clone(), s.id().to_owned());
            async move {
                let r = TextCompletionResponse {
                    response: text.to_owned(),
                    end_of_stream: end,
                    ..Default::default()
                };
                let mut m = Message::new(serde_json::to_vec(&r).unwrap())
                    .with_property(properties::ID, id)
                    .with_property(properties::ATTEMPT, attempt);
                if let Some(c) = continues {
                    m = m.with_property(properties::CONTINUES, c);
                }
                bus.publisher("resp").await.unwrap().send(m).await.unwrap();
            }
        };
    send("step1", None, "thought", false).await;
    send("step2", Some("step1"), "observation", false).await;
    // step2 crashed; its redelivery continues step1 again, not the current step2.
    send("step2b", Some("step1"), "observation again", false).await;
    send("step3", Some("step2b"), "answer", true).await;
    assert_eq!(text(s.next().await), "thought");
    assert_eq!(text(s.next().await), "observation");
    assert_eq!(text(s.next().await), "<restarted>");
    assert_eq!(text(s.next().await), "observation again");
    assert_eq!(text(s.next().await), "answer");
    assert!(s.next().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn silence_ends_the_stream_with_an_inactivity_timeout() {
    let (_bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    let err = s.next().await.unwrap().unwrap_err();
    assert!(matches!(err, ClientError::InactivityTimeout(_)));
    assert!(s.next().await.is_none());
}

#[tokio::test]
async fn an_undecodable_record_ends_the_stream_with_an_error() {
    let (bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    bus.publisher("resp")
        .await
        .unwrap()
        .send(Message::new("not json").with_property(properties::ID, s.id()))
        .await
        .unwrap();
    assert!(matches!(
        s.next().await.unwrap().unwrap_err(),
        ClientError::Decode(_)
    ));
}

#[tokio::test]
async fn close_ends_open_streams() {
    let (_bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    client.close().await;
    assert!(matches!(
        s.next().await.unwrap().unwrap_err(),
        ClientError::Closed
    ));
    assert!(matches!(
        client
            .request(&TextCompletionRequest::default())
            .await
            .err()
            .unwrap(),
        ClientError::Closed
    ));
}
