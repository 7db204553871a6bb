use std::{collections::BTreeMap, sync::Arc, time::Duration};

use sluice_schema::{TextCompletionRequest, TextCompletionResponse, properties};

use super::*;
use crate::{
    bus::{Bus, Delivery, Message, Origin, memory::MemoryBus},
    client::{ClientConfig, ClientError, DEFAULT_LOSS_GRACE, Received, RequestOptions, tests::*},
};

#[tokio::test]
async fn a_skipped_record_index_ends_the_stream_as_lost_at_once() {
    let (bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    numbered(&bus, s.id(), "a", 0, "zero", false).await;
    numbered(&bus, s.id(), "a", 2, "two", false).await;
    assert_eq!(text(s.next().await), "zero");
    match s.next().await.unwrap() {
        Err(ClientError::RecordsLost { expected, received }) => {
            assert_eq!((expected, received), (1, 2));
        }
        other => panic!("expected RecordsLost, got {other:?}"),
    }
    assert!(s.next().await.is_none());
}

#[tokio::test]
async fn on_a_durable_topic_a_skipped_index_waits_for_the_next_attempt() {
    let bus = MemoryBus::default();
    let resp = "persistent://t/n/resp";
    let config = ClientConfig::new("test", "req", resp);
    let client: Client = Client::start(Arc::new(bus.clone()), config, None)
        .await
        .unwrap();
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    let send = |attempt: &str, seq: u64, text: &str, end: bool| {
        let r = TextCompletionResponse {
            response: text.to_owned(),
            end_of_stream: end,
            ..Default::default()
        };
        Message::new(serde_json::to_vec(&r).unwrap())
            .with_property(properties::ID, s.id())
            .with_property(properties::ATTEMPT, attempt)
            .with_property(properties::SEQ, seq.to_string())
    };
    let publisher = bus.publisher(resp).await.unwrap();
    // Record 1 of attempt a was never stored (the broker restarted); its 2 and terminal 3
    // were. The processor handed the request back and attempt b answers it whole.
    for m in [
        send("a", 0, "zero", false),
        send("a", 2, "two", false),
        send("a", 3, "", true),
        send("b", 0, "whole", false),
        send("b", 1, "", true),
    ] {
        publisher.send(m).await.unwrap().await.unwrap();
    }
    assert_eq!(text(s.next().await), "zero");
    assert!(matches!(s.next().await, Some(Ok(Received::Restarted))));
    assert_eq!(text(s.next().await), "whole");
    match s.next().await.unwrap().unwrap() {
        Received::Record(r) => assert!(r.is_terminal()),
        Received::Restarted => panic!("one restart only"),
    }
    assert!(s.next().await.is_none());
}

#[tokio::test]
async fn a_record_stored_twice_is_passed_on_once() {
    let (bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    numbered(&bus, s.id(), "a", 0, "zero", false).await;
    numbered(&bus, s.id(), "a", 0, "zero", false).await;
    numbered(&bus, s.id(), "a", 1, "end", true).await;
    assert_eq!(text(s.next().await), "zero");
    assert_eq!(text(s.next().await), "end");
    assert!(s.next().await.is_none());
}

#[tokio::test]
async fn a_new_attempt_numbers_from_zero_and_the_abandoned_attempts_records_are_skipped() {
    let (bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    numbered(&bus, s.id(), "a", 0, "a0", false).await;
    numbered(&bus, s.id(), "a", 1, "a1", false).await;
    numbered(&bus, s.id(), "b", 0, "b0", false).await;
    // Attempt a was still running when the request was redelivered.
    numbered(&bus, s.id(), "a", 2, "a2", false).await;
    numbered(&bus, s.id(), "b", 1, "b1", true).await;
    let mut seen = Vec::new();
    while let Some(item) = s.next().await {
        seen.push(match item.unwrap() {
            Received::Record(r) => r.response,
            Received::Restarted => "<restarted>".to_owned(),
        });
    }
    assert_eq!(seen, ["a0", "a1", "<restarted>", "b0", "b1"]);
}

struct Noop;

impl crate::bus::Settle for Noop {
    fn settle(self: Box<Self>, _: crate::bus::Settlement) {}
}

/// A delivery as the Pulsar bus makes it: numbered by the service, stamped by the broker
/// with its producer and that producer's sequence id.
fn from_producer(id: &str, seq: u64, producer: &Arc<str>, sequence: u64, end: bool) -> Delivery {
    let r = TextCompletionResponse {
        response: format!("{id}#{seq}"),
        end_of_stream: end,
        ..Default::default()
    };
    let properties = BTreeMap::from([
        (properties::ID.to_owned(), id.to_owned()),
        (properties::ATTEMPT.to_owned(), "a".to_owned()),
        (properties::SEQ.to_owned(), seq.to_string()),
    ]);
    Delivery::new(
        serde_json::to_vec(&r).unwrap().into(),
        properties,
        0,
        Box::new(Noop),
    )
    .with_origin(Origin {
        producer: producer.clone(),
        sequence,
    })
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_goes_quiet_after_its_producer_dropped_records_ends_as_lost() {
    let (_bus, _requests, client) = setup().await;
    let telemetry = crate::telemetry::Telemetry::new().unwrap();
    let metrics = Some(&telemetry.metrics);
    let (p, q): (Arc<str>, Arc<str>) = (Arc::from("p-1"), Arc::from("q-1"));
    let request = TextCompletionRequest::default();
    let new_stream = || {
        client.request_with(
            &request,
            RequestOptions {
                inactivity_timeout: Some(Duration::from_secs(60)),
                ..RequestOptions::default()
            },
        )
    };
    let (mut quiet, mut busy, mut elsewhere) = (
        new_stream().await.unwrap(),
        new_stream().await.unwrap(),
        new_stream().await.unwrap(),
    );
    let mut seen = Seen::default();
    let me = client.config.subscription.clone();
    let mut route = |d: Delivery| {
        dispatch(
            d,
            &client.routes,
            &mut seen,
            metrics,
            "test",
            Some(&me),
            true,
        );
    };
    route(from_producer(quiet.id(), 0, &p, 10, false));
    route(from_producer(busy.id(), 0, &p, 11, false));
    route(from_producer(elsewhere.id(), 0, &q, 3, false));
    // Producer p's 12 and 13 never arrive: one of them was quiet's terminal record.
    route(from_producer(busy.id(), 1, &p, 14, false));
    route(from_producer(busy.id(), 2, &p, 15, true));
    assert_eq!(text(quiet.next().await), format!("{}#0", quiet.id()));
    let started = Instant::now();
    match quiet.next().await.unwrap() {
        Err(ClientError::StreamLost(grace)) => assert_eq!(grace, DEFAULT_LOSS_GRACE),
        other => panic!("expected StreamLost, got {other:?}"),
    }
    assert_eq!(started.elapsed(), DEFAULT_LOSS_GRACE);
    // busy's next record arrived after the drop: it reads on to its end.
    for seq in 0..3 {
        assert_eq!(text(busy.next().await), format!("{}#{seq}", busy.id()));
    }
    assert!(busy.next().await.is_none());
    // elsewhere's producer dropped nothing: only its inactivity timeout applies.
    assert_eq!(
        text(elsewhere.next().await),
        format!("{}#0", elsewhere.id())
    );
    assert!(matches!(
        elsewhere.next().await.unwrap().unwrap_err(),
        ClientError::InactivityTimeout(_)
    ));
    assert!(
        telemetry
            .render()
            .contains("sluice_client_dropped_records_total{service=\"test\"} 2")
    );
}

#[test]
fn producer_sequences_count_what_was_skipped() {
    let mut seqs = ProducerSequences::default();
    let at = |sequence| Origin {
        producer: Arc::from("p"),
        sequence,
    };
    assert_eq!(
        seqs.observe(&at(5)),
        0,
        "the first one seen sets the baseline"
    );
    assert_eq!(seqs.observe(&at(6)), 0);
    assert_eq!(seqs.observe(&at(9)), 2);
    assert_eq!(seqs.observe(&at(8)), 0, "a resent message skips nothing");
    assert_eq!(seqs.observe(&at(10)), 0);
}
