use std::time::Duration;

use sluice_schema::TextCompletionRequest;
use tokio::time::Instant;

use crate::{
    client::{ClientError, RequestOptions, tests::*},
    sync::{SILENT_AFTER, UNLISTED_GRACE},
};

#[tokio::test]
async fn a_stream_whose_every_record_was_dropped_ends_at_the_sync_that_lists_it() {
    let (bus, _requests, client) = setup().await;
    let mut s = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    let id = s.id().to_owned();
    // Listed while nothing is published yet, then done with 3 records: none arrived.
    sync(&bus, "p1", true, &[(&id, "a", 0, true)]).await;
    sync(&bus, "p1", true, &[(&id, "a", 3, false)]).await;
    let (why, _) = lost_in_transit(&mut s).await;
    assert!(
        why.contains("3 response records") && why.contains("0 arrived"),
        "{why}"
    );
    assert!(s.next().await.is_none());
}

#[tokio::test]
async fn a_stream_that_lost_its_tail_ends_at_the_sync_and_a_whole_one_reads_on() {
    let (bus, _requests, client) = setup().await;
    let mut whole = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    let mut cut = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    let (w, c) = (whole.id().to_owned(), cut.id().to_owned());
    numbered(&bus, &w, "a", 0, "w0", false).await;
    numbered(&bus, &c, "b", 0, "c0", false).await;
    numbered(&bus, &c, "b", 1, "c1", false).await;
    // cut's third and last record (index 2) was dropped; whole is still streaming.
    sync(&bus, "p1", true, &[(&w, "a", 1, true), (&c, "b", 3, false)]).await;
    numbered(&bus, &w, "a", 1, "w1", true).await;
    assert_eq!(text(cut.next().await), "c0");
    assert_eq!(text(cut.next().await), "c1");
    let (why, _) = lost_in_transit(&mut cut).await;
    assert!(
        why.contains("3 response records") && why.contains("2 arrived"),
        "{why}"
    );
    assert_eq!(text(whole.next().await), "w0");
    assert_eq!(text(whole.next().await), "w1");
    assert!(whole.next().await.is_none());
}

// The paused clock: the syncs' grace periods pass at once (a sync's wall-clock stamp
// and its reading are still real time apart, a few microseconds).
#[tokio::test(start_paused = true)]
async fn a_request_no_processor_lists_ends_once_every_processor_took_requests_for_the_grace() {
    let (bus, _requests, client) = setup().await;
    let mut dropped = patient(&client).await;
    let mut queued = patient(&client).await;
    let queued_id = queued.id().to_owned();
    let started = Instant::now();
    // p1 takes requests all along and lists only `queued`; p2 is full for 1.5 s, then
    // takes requests too.
    let ticker = {
        let bus = bus.clone();
        tokio::spawn(async move {
            for tick in 0..20u32 {
                sync(&bus, "p1", true, &[(&queued_id, "q", 0, true)]).await;
                sync(&bus, "p2", tick >= 3, &[]).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let (why, _) = lost_in_transit(&mut dropped).await;
    assert!(why.contains("no processor did"), "{why}");
    // Not before p2, which may have held it, took requests for the grace.
    let waited = started.elapsed();
    let due = Duration::from_millis(1500) + UNLISTED_GRACE;
    assert!(waited >= due - Duration::from_millis(100), "{waited:?}");
    assert!(waited < due + Duration::from_secs(2), "{waited:?}");
    ticker.await.unwrap();
    // The listed one is waiting for its records, not lost.
    numbered(&bus, queued.id(), "q", 0, "q0", true).await;
    assert_eq!(text(queued.next().await), "q0");
}

/// An attempt the stream moved on from (a restart, an agent's earlier step) stays listed for
/// a while after its end; its count is not the stream's, and a stream whose processor
/// listed it as finished does not depend on that processor any more.
// The paused clock: the syncs' grace periods pass at once (a sync's wall-clock stamp
// and its reading are still real time apart, a few microseconds).
#[tokio::test(start_paused = true)]
async fn only_the_attempt_being_read_is_counted_and_only_an_open_stream_needs_its_processor() {
    let (bus, _requests, client) = setup().await;
    let mut s = patient(&client).await;
    let id = s.id().to_owned();
    numbered(&bus, &id, "a", 0, "a0", false).await;
    numbered(&bus, &id, "b", 0, "b0", false).await;
    // p1 finished attempt a with 5 records (for this stream: it restarted on b).
    sync(&bus, "p1", true, &[(&id, "a", 5, false)]).await;
    sync(&bus, "p2", true, &[(&id, "b", 1, true)]).await;
    assert_eq!(text(s.next().await), "a0");
    assert_eq!(text(s.next().await), "<restarted>");
    assert_eq!(text(s.next().await), "b0");
    // p1 goes away: the stream is p2's.
    for _ in 0..24 {
        sync(&bus, "p2", true, &[(&id, "b", 1, true)]).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    numbered(&bus, &id, "b", 1, "b1", true).await;
    assert_eq!(text(s.next().await), "b1");
    assert!(s.next().await.is_none());
}

/// The next step of a stream (a new attempt, published by another processor before its
/// sync) whose records all were dropped: the stream still reads the step before, and the
/// listing of the one it has not reached shows the loss.
#[tokio::test]
async fn a_step_the_stream_has_not_reached_counts_as_nothing_arrived() {
    let (bus, _requests, client) = setup().await;
    let mut s = patient(&client).await;
    let id = s.id().to_owned();
    numbered(&bus, &id, "a1", 0, "step one", false).await;
    sync(&bus, "p1", true, &[(&id, "a1", 1, false)]).await;
    sync(&bus, "p2", true, &[(&id, "a2", 2, true)]).await;
    assert_eq!(text(s.next().await), "step one");
    let (why, _) = lost_in_transit(&mut s).await;
    assert!(
        why.contains("2 response records") && why.contains("0 arrived"),
        "{why}"
    );
}

// The paused clock: the syncs' grace periods pass at once (a sync's wall-clock stamp
// and its reading are still real time apart, a few microseconds).
#[tokio::test(start_paused = true)]
async fn with_a_processor_that_does_not_sync_on_the_topic_an_unlisted_request_waits() {
    let (bus, _requests, client) = setup().await;
    let mut other = client
        .request(&TextCompletionRequest::default())
        .await
        .unwrap();
    // A TrustGraph processor's record: no index.
    reply(&bus, other.id(), "t", "from trustgraph", true).await;
    assert_eq!(text(other.next().await), "from trustgraph");
    let mut s = client
        .request_with(
            &TextCompletionRequest::default(),
            RequestOptions {
                inactivity_timeout: Some(Duration::from_secs(4)),
                ..RequestOptions::default()
            },
        )
        .await
        .unwrap();
    for _ in 0..8 {
        sync(&bus, "p1", true, &[]).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(matches!(
        s.next().await.unwrap().unwrap_err(),
        ClientError::InactivityTimeout(_)
    ));
}

// The paused clock: the syncs' grace periods pass at once (a sync's wall-clock stamp
// and its reading are still real time apart, a few microseconds).
#[tokio::test(start_paused = true)]
async fn a_stream_whose_processor_stopped_syncing_ends_while_another_syncs() {
    let (bus, _requests, client) = setup().await;
    let mut s = patient(&client).await;
    let id = s.id().to_owned();
    numbered(&bus, &id, "a", 0, "first", false).await;
    sync(&bus, "p1", true, &[(&id, "a", 1, true)]).await;
    sync(&bus, "p2", true, &[]).await;
    assert_eq!(text(s.next().await), "first");
    let started = Instant::now();
    // p1 is gone (SIGKILL); p2 goes on syncing.
    let ticker = {
        let bus = bus.clone();
        tokio::spawn(async move {
            for _ in 0..30 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                sync(&bus, "p2", true, &[]).await;
            }
        })
    };
    let (why, _) = lost_in_transit(&mut s).await;
    assert!(why.contains("stopped syncing"), "{why}");
    let waited = started.elapsed();
    assert!(
        waited >= SILENT_AFTER && waited < SILENT_AFTER + Duration::from_secs(2),
        "{waited:?}"
    );
    ticker.abort();
}
