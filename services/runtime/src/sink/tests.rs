use std::sync::Mutex as StdMutex;

use async_trait::async_trait;
use sluice_schema::{PromptResponse, TextCompletionResponse};

use super::*;

/// Keeps what is published, with the (paused) clock's time of publishing.
#[derive(Default)]
struct Recorder {
    sent: StdMutex<Vec<(Duration, Message)>>,
    start: StdMutex<Option<Instant>>,
    refuse_larger_than: Option<usize>,
    /// When set, a receipt settles only when the test confirms it (see `confirm`).
    confirm_later: bool,
    unconfirmed: StdMutex<Vec<oneshot::Sender<Result<(), BusError>>>>,
}

#[async_trait]
impl Publisher for Recorder {
    async fn send(&self, message: Message) -> Result<Receipt, BusError> {
        if let Some(limit) = self.refuse_larger_than
            && message.payload.len() > limit
        {
            return Err(BusError::TooLarge {
                size: message.payload.len(),
                limit,
            });
        }
        let start = *self.start.lock().unwrap().get_or_insert_with(Instant::now);
        self.sent
            .lock()
            .unwrap()
            .push((Instant::now() - start, message));
        if !self.confirm_later {
            return Ok(Receipt::ready(Ok(())));
        }
        let (tx, rx) = oneshot::channel();
        self.unconfirmed.lock().unwrap().push(tx);
        Ok(Receipt::new(async move {
            rx.await
                .unwrap_or_else(|_| Err(BusError::Unavailable("dropped".into())))
        }))
    }

    fn topic(&self) -> &str {
        "non-persistent://t/response/x"
    }
}

impl Recorder {
    fn confirming_later() -> Self {
        Self {
            confirm_later: true,
            ..Self::default()
        }
    }

    /// Settles every receipt handed out so far with `result`, and lets the tasks waiting
    /// for them run.
    async fn confirm(&self, result: Result<(), &str>) {
        for tx in self.unconfirmed.lock().unwrap().drain(..) {
            let _ = tx.send(result.map_err(|e| BusError::Unavailable(e.into())));
        }
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    fn texts(&self) -> Vec<String> {
        self.records::<TextCompletionResponse>()
            .into_iter()
            .map(|(_, r)| r.response)
            .collect()
    }

    fn records<R: ResponseRecord>(&self) -> Vec<(Duration, R)> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .map(|(at, m)| (*at, serde_json::from_slice(&m.payload).unwrap()))
            .collect()
    }

    fn seqs(&self) -> Vec<String> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .map(|(_, m)| m.properties[properties::SEQ].clone())
            .collect()
    }
}

fn pacer(min_ms: u64, rate: Option<u32>) -> Arc<Pacer> {
    let counter = IntCounter::new("coalesced", "test").unwrap();
    let gauge = Gauge::new("interval", "test").unwrap();
    let delayed = IntCounter::new("delayed", "test").unwrap();
    Arc::new(Pacer::new(
        Pacing {
            when: PaceWhen::On,
            min_interval: Duration::from_millis(min_ms),
            max_records_per_sec: rate,
        },
        counter,
        gauge,
        delayed,
    ))
}

fn sink<R: ResponseRecord>(
    publisher: &Arc<Recorder>,
    pacer: Option<Arc<Pacer>>,
) -> ResponseSink<R> {
    // Times are from the stream's start, not from its first record.
    publisher
        .start
        .lock()
        .unwrap()
        .get_or_insert_with(Instant::now);
    let props = BTreeMap::from([
        (properties::ID.to_owned(), "r1".to_owned()),
        (properties::ATTEMPT.to_owned(), "a1".to_owned()),
    ]);
    ResponseSink::new(
        publisher.clone(),
        props,
        BTreeMap::from([(properties::KEY.to_owned(), "team-a".to_owned())]),
        None,
        pacer,
        None,
        IntCounter::new("records", "test").unwrap(),
    )
}

fn delta(text: &str) -> TextCompletionResponse {
    TextCompletionResponse {
        response: text.into(),
        out_token: Some(1),
        ..Default::default()
    }
}

fn end() -> TextCompletionResponse {
    TextCompletionResponse {
        in_token: Some(7),
        end_of_stream: true,
        ..Default::default()
    }
}

/// Tokens 10 ms apart through a sink paced at 100 ms: the first at once, the rest merged
/// into one record per interval, the terminal record at once after the held text; the
/// text and token counts exactly the unpaced stream's. Under the default rate bound,
/// which one stream stays far below.
#[tokio::test(start_paused = true)]
async fn a_paced_stream_merges_deltas_and_never_delays_its_first_or_last_record() {
    let publisher = Arc::new(Recorder::default());
    let pacer = pacer(100, Some(DEFAULT_MAX_RECORDS_PER_SEC));
    let mut sink = sink(&publisher, Some(pacer.clone()));
    for i in 0..50 {
        sink.send(delta(&format!("t{i} "))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sink.send(end()).await.unwrap();
    sink.flush().await.unwrap();
    let records = publisher.records::<TextCompletionResponse>();
    let text: String = records.iter().map(|(_, r)| r.response.as_str()).collect();
    let expected: String = (0..50).map(|i| format!("t{i} ")).collect();
    assert_eq!(text, expected);
    let out: u64 = records.iter().filter_map(|(_, r)| r.out_token).sum();
    assert_eq!(out, 50, "every token counted once");
    assert_eq!(records[0].0, Duration::ZERO, "the first record at once");
    assert_eq!(records[0].1.response, "t0 ");
    let (at_end, last) = records.last().unwrap();
    assert!(last.end_of_stream);
    assert_eq!(
        *at_end,
        Duration::from_millis(500),
        "the last record at once"
    );
    assert_eq!(
        last.response, "t41 t42 t43 t44 t45 t46 t47 t48 t49 ",
        "the held text rides on the terminal record"
    );
    assert_eq!(last.in_token, Some(7));
    assert!(
        records.len() <= 8,
        "one record per 100 ms and the ends, not 51: {}",
        records.len()
    );
    for pair in records[..records.len() - 1].windows(2) {
        assert!(
            pair[1].0 - pair[0].0 >= Duration::from_millis(100),
            "records of a stream 100 ms apart at least: {:?}",
            records.iter().map(|(at, _)| *at).collect::<Vec<_>>()
        );
    }
    let seqs = publisher.seqs();
    let expected: Vec<String> = (0..records.len()).map(|i| i.to_string()).collect();
    assert_eq!(seqs, expected, "numbered without gaps");
    assert_eq!(sink.records_sent(), records.len() as u64);
    assert_eq!(
        pacer.coalesced.get() + records.len() as u64,
        51,
        "each record either published or merged"
    );
    assert_eq!(
        pacer.delayed.get(),
        0,
        "no record waited for the rate bound"
    );
}

/// Streams that start and end together: `n` sinks each send a first delta at once and
/// their terminal record 50 ms later. Returns every record's time of publishing, sorted,
/// and checks that each stream's text arrived whole.
async fn streams_together(pacer: &Arc<Pacer>, n: usize) -> Vec<Duration> {
    let publisher = Arc::new(Recorder::default());
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let mut sink = sink::<TextCompletionResponse>(&publisher, Some(pacer.clone()));
            tokio::spawn(async move {
                sink.send(delta(&format!("s{i} "))).await.unwrap();
                tokio::time::sleep(Duration::from_millis(50)).await;
                sink.send(end()).await.unwrap();
                sink.flush().await.unwrap();
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(
        records.len(),
        2 * n,
        "a first and a terminal record per stream"
    );
    for i in 0..n {
        assert_eq!(
            records
                .iter()
                .filter(|(_, r)| r.response == format!("s{i} "))
                .count(),
            1
        );
    }
    let mut times: Vec<Duration> = records.iter().map(|(at, _)| *at).collect();
    times.sort();
    times
}

/// The rate bound covers first and terminal records too: 60 streams starting and ending
/// together at 100 records/s go out at most 100 per second, after a burst of 200 ms'
/// worth (21 records) at once. Before, all 120 went out within 50 ms.
#[tokio::test(start_paused = true)]
async fn the_rate_bound_holds_over_first_and_terminal_records() {
    let pacer = pacer(100, Some(100));
    let times = streams_together(&pacer, 60).await;
    let burst = 21;
    assert_eq!(
        times.iter().filter(|at| at.is_zero()).count(),
        burst,
        "the burst at once: {times:?}"
    );
    for (i, at) in times.iter().enumerate().skip(burst) {
        let turn = Duration::from_millis(10 * (i - burst + 1) as u64);
        assert!(
            *at >= turn,
            "record {i} at {at:?}, before its turn {turn:?}"
        );
    }
    let last = *times.last().unwrap();
    assert!(
        last <= Duration::from_millis(10 * (120 - burst as u64) + 20),
        "no record waited longer than its turn: the last at {last:?}"
    );
    assert_eq!(pacer.delayed.get(), (120 - burst) as u64);
}

/// However many records are waiting, none waits longer than MAX_PACE_INTERVAL: past it
/// the bound gives way.
#[tokio::test(start_paused = true)]
async fn no_record_waits_longer_than_the_cap() {
    let pacer = pacer(100, Some(1));
    let times = streams_together(&pacer, 20).await;
    let last = *times.last().unwrap();
    assert!(
        last <= MAX_PACE_INTERVAL + Duration::from_millis(50) + MAX_PACE_INTERVAL,
        "a first record waits at most the cap, and its terminal record the cap again: {last:?}"
    );
    assert!(
        times.iter().any(|at| *at >= MAX_PACE_INTERVAL),
        "the bound did hold records back: {times:?}"
    );
}

/// A delta held when the provider goes quiet goes out when the interval is over, not
/// with the next record.
#[tokio::test(start_paused = true)]
async fn a_held_delta_goes_out_at_the_interval_when_nothing_follows() {
    let publisher = Arc::new(Recorder::default());
    let mut sink = sink(&publisher, Some(pacer(100, None)));
    sink.send(delta("a")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    sink.send(delta("b")).await.unwrap();
    assert_eq!(publisher.records::<TextCompletionResponse>().len(), 1);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(records.len(), 2);
    assert_eq!(records[1].1.response, "b");
    assert_eq!(records[1].0, Duration::from_millis(100));
    sink.send(end()).await.unwrap();
    assert_eq!(publisher.records::<TextCompletionResponse>().len(), 3);
}

/// An error ends a stream as its own record, after the held delta.
#[tokio::test(start_paused = true)]
async fn an_error_never_absorbs_the_held_delta() {
    let publisher = Arc::new(Recorder::default());
    let mut sink = sink(&publisher, Some(pacer(100, None)));
    sink.send(delta("a")).await.unwrap();
    sink.send(delta("b")).await.unwrap();
    sink.send(TextCompletionResponse::from_error(Error::new(
        ErrorKind::Timeout,
        "late",
    )))
    .await
    .unwrap();
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(records.len(), 3);
    assert_eq!(records[1].1.response, "b");
    assert!(records[2].1.error.is_some() && records[2].1.end_of_stream);
    assert!(sink.ended_with_error());
}

fn behind_sink(publisher: &Arc<Recorder>) -> (ResponseSink<TextCompletionResponse>, IntCounter) {
    let coalesced = IntCounter::new("coalesced", "test").unwrap();
    let sink = ResponseSink::new(
        publisher.clone(),
        BTreeMap::from([
            (properties::ID.to_owned(), "r1".to_owned()),
            (properties::ATTEMPT.to_owned(), "a1".to_owned()),
        ]),
        BTreeMap::new(),
        None,
        None,
        Some(coalesced.clone()),
        IntCounter::new("records", "test").unwrap(),
    );
    (sink, coalesced)
}

/// While the broker has not confirmed a stream's record, its next deltas are held and
/// merged; the merge goes out as soon as the confirmation comes, with no record of the
/// handler's to carry it, and the text and token counts are the unmerged stream's.
#[tokio::test]
async fn deltas_merge_while_the_previous_record_is_unconfirmed() {
    let publisher = Arc::new(Recorder::confirming_later());
    let (mut sink, coalesced) = behind_sink(&publisher);
    sink.send(delta("a")).await.unwrap();
    for text in ["b", "c", "d"] {
        sink.send(delta(text)).await.unwrap();
    }
    assert_eq!(
        publisher.texts(),
        ["a"],
        "the first record goes at once, alone"
    );
    publisher.confirm(Ok(())).await;
    assert_eq!(publisher.texts(), ["a", "bcd"], "released by the receipt");
    assert_eq!(coalesced.get(), 2);
    sink.send(delta("e")).await.unwrap();
    sink.send(end()).await.unwrap();
    publisher.confirm(Ok(())).await;
    sink.flush().await.unwrap();
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(publisher.texts(), ["a", "bcd", "e"]);
    assert!(
        records[2].1.end_of_stream,
        "the held delta rides on the terminal record"
    );
    let out: u64 = records.iter().filter_map(|(_, r)| r.out_token).sum();
    assert_eq!(out, 5, "token deltas add up");
    assert_eq!(records[2].1.in_token, Some(7));
    assert_eq!(publisher.seqs(), ["0", "1", "2"]);
}

/// A broker that confirms each record before the next delta comes sees every delta as a
/// record of its own.
#[tokio::test]
async fn a_broker_that_keeps_up_gets_every_delta_as_a_record() {
    let publisher = Arc::new(Recorder::default());
    let (mut sink, coalesced) = behind_sink(&publisher);
    for i in 0..20 {
        sink.send(delta(&i.to_string())).await.unwrap();
    }
    sink.send(end()).await.unwrap();
    assert_eq!(publisher.records::<TextCompletionResponse>().len(), 21);
    assert_eq!(coalesced.get(), 0);
}

/// The runtime's flush first waits for the receipts the releasing task holds, then
/// publishes the held delta and waits for its receipt too.
#[tokio::test]
async fn flush_waits_for_the_receipts_held_behind_then_publishes_the_held_delta() {
    let publisher = Arc::new(Recorder::confirming_later());
    let (mut sink, _) = behind_sink(&publisher);
    sink.send(delta("a")).await.unwrap();
    sink.send(delta("b")).await.unwrap();
    let flushing = tokio::spawn(async move {
        let result = sink.flush().await;
        (sink, result)
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(publisher.texts(), ["a"], "b waits for a's receipt");
    assert!(!flushing.is_finished(), "it waits for a's receipt");
    publisher.confirm(Ok(())).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        publisher.texts(),
        ["a", "b"],
        "the flush published the held delta"
    );
    assert!(!flushing.is_finished(), "it waits for b's receipt");
    publisher.confirm(Ok(())).await;
    let (sink, result) = flushing.await.unwrap();
    result.unwrap();
    assert_eq!(sink.records_sent(), 2);
    assert_eq!(publisher.texts(), ["a", "b"], "nothing twice");
}

/// After a record the broker did not store, nothing more goes out for the attempt: not
/// the held delta at the runtime's flush, not a terminal record, not an error record.
#[tokio::test]
async fn nothing_goes_out_after_a_failed_receipt() {
    let ends: [fn() -> TextCompletionResponse; 3] = [
        || delta("c"),
        end,
        || TextCompletionResponse::from_error(Error::new(ErrorKind::Timeout, "late")),
    ];
    for (i, next) in ends.iter().enumerate() {
        let publisher = Arc::new(Recorder::confirming_later());
        let (mut sink, _) = behind_sink(&publisher);
        sink.send(delta("a")).await.unwrap();
        sink.send(delta("b")).await.unwrap();
        publisher.confirm(Err("bookie gone")).await;
        let err = sink.send(next()).await.unwrap_err();
        assert!(err.to_string().contains("bookie gone"), "{i}: {err}");
        assert!(!sink.is_ended(), "{i}");
        assert!(sink.flush().await.is_err(), "{i}");
        assert_eq!(publisher.texts(), ["a"], "{i}");
    }
    // And the flush alone, with no send after the failure.
    let publisher = Arc::new(Recorder::confirming_later());
    let (mut sink, _) = behind_sink(&publisher);
    sink.send(delta("a")).await.unwrap();
    sink.send(delta("b")).await.unwrap();
    publisher.confirm(Err("bookie gone")).await;
    let err = sink.flush().await.unwrap_err();
    assert!(err.to_string().contains("bookie gone"), "{err}");
    assert_eq!(publisher.texts(), ["a"]);
}

/// Which topics merge how under each `--response-pacing`.
#[test]
fn merging_while_behind_is_for_durable_topics_under_merge_only() {
    let with = |when| Pacing {
        when,
        ..Pacing::default()
    };
    let (durable, lossy) = ("persistent://t/n/x", "non-persistent://t/n/x");
    assert_eq!(with(PaceWhen::Merge).merging(durable), Merging::WhileBehind);
    assert_eq!(with(PaceWhen::Merge).merging(lossy), Merging::Paced);
    assert_eq!(with(PaceWhen::Auto).merging(durable), Merging::Never);
    assert_eq!(with(PaceWhen::Auto).merging(lossy), Merging::Paced);
    assert_eq!(with(PaceWhen::On).merging(durable), Merging::Paced);
    assert_eq!(with(PaceWhen::Off).merging(lossy), Merging::Never);
    assert_eq!("merge".parse::<PaceWhen>(), Ok(PaceWhen::Merge));
    assert_eq!(PaceWhen::Merge.to_string(), "merge");
}

/// An error record never absorbs the held text: the text goes out first.
#[tokio::test]
async fn an_error_goes_out_after_the_delta_held_behind() {
    let publisher = Arc::new(Recorder::confirming_later());
    let (mut sink, _) = behind_sink(&publisher);
    sink.send(delta("a")).await.unwrap();
    sink.send(delta("b")).await.unwrap();
    sink.send(TextCompletionResponse::from_error(Error::new(
        ErrorKind::Timeout,
        "late",
    )))
    .await
    .unwrap();
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(publisher.texts(), ["a", "b", ""]);
    assert!(records[2].1.error.is_some() && records[2].1.end_of_stream);
    assert!(sink.ended_with_error());
    publisher.confirm(Ok(())).await;
    sink.flush().await.unwrap();
    assert_eq!(publisher.records::<TextCompletionResponse>().len(), 3);
}

/// The rate bound: with 10 streams open at 20 records/s, a stream's interval is 500 ms.
#[tokio::test(start_paused = true)]
async fn the_interval_grows_with_the_streams_open_under_a_rate_bound() {
    let pacer = pacer(100, Some(20));
    let publisher = Arc::new(Recorder::default());
    let sinks: Vec<ResponseSink<TextCompletionResponse>> = (0..10)
        .map(|_| sink(&publisher, Some(pacer.clone())))
        .collect();
    assert_eq!(pacer.interval(), Duration::from_millis(500));
    assert_eq!(pacer.interval_gauge.get(), 0.5);
    drop(sinks);
    assert_eq!(
        pacer.interval_gauge.get(),
        0.1,
        "the gauge follows the streams closed"
    );
    assert_eq!(pacer.interval(), Duration::from_millis(100));
}

/// Objects are never held or merged: each goes out as it comes.
#[tokio::test(start_paused = true)]
async fn records_that_are_not_deltas_are_never_held() {
    let publisher = Arc::new(Recorder::default());
    let mut sink = sink(&publisher, Some(pacer(100, None)));
    for i in 0..5 {
        sink.send(PromptResponse {
            object: Some(format!("{{\"i\":{i}}}")),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let records = publisher.records::<PromptResponse>();
    assert_eq!(records.len(), 5);
    assert!(records.iter().all(|(at, _)| *at == Duration::ZERO));
}

/// Unpaced, every delta is a record.
#[tokio::test(start_paused = true)]
async fn an_unpaced_sink_publishes_every_record() {
    let publisher = Arc::new(Recorder::default());
    let mut sink = sink(&publisher, None);
    for i in 0..20 {
        sink.send(delta(&i.to_string())).await.unwrap();
    }
    sink.send(end()).await.unwrap();
    assert_eq!(publisher.records::<TextCompletionResponse>().len(), 21);
}

/// A held delta is still published when the stream ends without a terminal record of
/// the handler's (the runtime's flush).
#[tokio::test(start_paused = true)]
async fn flush_publishes_the_held_delta() {
    let publisher = Arc::new(Recorder::default());
    let mut sink = sink(&publisher, Some(pacer(100, None)));
    sink.send(delta("a")).await.unwrap();
    sink.send(delta("b")).await.unwrap();
    sink.flush().await.unwrap();
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(records.len(), 2);
    assert_eq!(records[1].1.response, "b");
}

/// A merged delta the bus refuses for its size ends the stream with the size error, also
/// when its timer publishes it.
#[tokio::test(start_paused = true)]
async fn a_held_delta_too_large_for_the_bus_ends_the_stream_with_the_size_error() {
    let publisher = Arc::new(Recorder {
        refuse_larger_than: Some(300),
        ..Default::default()
    });
    let mut sink = sink(&publisher, Some(pacer(100, None)));
    sink.send(delta("a")).await.unwrap();
    sink.send(delta(&"x".repeat(200))).await.unwrap();
    sink.send(delta(&"y".repeat(200))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(records.len(), 2, "{records:?}");
    let error = records[1].1.error.as_ref().unwrap();
    assert_eq!(error.kind, ErrorKind::MessageTooLarge.as_str());
    assert!(matches!(sink.send(delta("z")).await, Err(SinkError::Ended)));
    assert!(sink.is_ended() && sink.ended_with_error());
}

/// A hand-off publishes the held delta first: the next step's records follow all of this
/// one's.
#[tokio::test(start_paused = true)]
async fn a_hand_off_publishes_the_held_delta_before_the_next_step() {
    let publisher = Arc::new(Recorder::default());
    let next = Arc::new(Recorder::default());
    let mut sink = sink(&publisher, Some(pacer(100, None)));
    sink.send(delta("a")).await.unwrap();
    sink.send(delta("b")).await.unwrap();
    sink.hand_off(&*next, b"{}".to_vec()).await.unwrap();
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(
        records.len(),
        2,
        "the held delta went out before the hand-off"
    );
    assert_eq!(records[1].1.response, "b");
    assert_eq!(next.sent.lock().unwrap().len(), 1);
    // The key's name goes on with the next step, and not onto the records.
    let handed = next.sent.lock().unwrap()[0].1.clone();
    assert_eq!(
        handed.properties.get(properties::KEY).map(String::as_str),
        Some("team-a")
    );
    assert!(
        publisher
            .sent
            .lock()
            .unwrap()
            .iter()
            .all(|(_, m)| !m.properties.contains_key(properties::KEY))
    );
    assert!(sink.is_ended());
    assert!(matches!(sink.send(delta("c")).await, Err(SinkError::Ended)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(publisher.records::<TextCompletionResponse>().len(), 2);
}

/// A held delta too large for the bus ends the stream at the hand-off: nothing continues
/// a stream that ended with an error.
#[tokio::test(start_paused = true)]
async fn a_hand_off_after_a_held_delta_too_large_is_refused() {
    let publisher = Arc::new(Recorder {
        refuse_larger_than: Some(300),
        ..Default::default()
    });
    let next = Arc::new(Recorder::default());
    let mut sink = sink(&publisher, Some(pacer(100, None)));
    sink.send(delta("a")).await.unwrap();
    sink.send(delta(&"x".repeat(400))).await.unwrap();
    assert!(matches!(
        sink.hand_off(&*next, b"{}".to_vec()).await,
        Err(SinkError::Ended)
    ));
    assert!(next.sent.lock().unwrap().is_empty(), "no next step");
    let records = publisher.records::<TextCompletionResponse>();
    assert_eq!(records.len(), 2);
    assert!(records[1].1.error.is_some() && records[1].1.end_of_stream);
    assert!(sink.is_ended() && sink.ended_with_error());
}

/// The rate bound stops growing a stream's interval at MAX_PACE_INTERVAL.
#[tokio::test(start_paused = true)]
async fn the_interval_is_capped() {
    let pacer = pacer(100, Some(1));
    let publisher = Arc::new(Recorder::default());
    let _sinks: Vec<ResponseSink<TextCompletionResponse>> = (0..100)
        .map(|_| sink(&publisher, Some(pacer.clone())))
        .collect();
    assert_eq!(pacer.interval(), MAX_PACE_INTERVAL);
}
