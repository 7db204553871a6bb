//! The response sink: publishes one request's records in order, and paces them where the
//! response topic loses what its consumers cannot keep up with.
//!
//! # Pacing (issue #28)
//! On a non-persistent topic (TrustGraph's mapping) the broker drops every message a
//! consumer has no permits for: a consumer that falls behind loses records, it is never
//! slowed down. TrustGraph's own services read all of a service's answers through one
//! Python consumer (receiver queue 1,000), and a sluice processor streaming hundreds of
//! answers a token per record overruns it. So a paced processor does two things:
//!
//! - **Per stream**, it publishes a stream's records at most once per *interval*: text
//!   deltas that arrive sooner are held and merged (see [`ResponseRecord::coalesce`]) into
//!   the next record, which goes out when the interval is over, whether or not another delta
//!   came. The interval is the larger of the configured minimum and `open streams / max
//!   records per second`, so that, spread evenly, the streams' records fit the rate bound.
//! - **Over all its streams**, it publishes at most *max records per second*, first and
//!   terminal records included: a record whose turn has not come waits for it (a generic
//!   cell rate schedule that lets [`RATE_BURST`] worth of records through at once). Without
//!   this, the first and terminal records of many short streams starting and ending together
//!   came on top of the bound, at over twice its rate, and a consumer on a busy host lost
//!   records (CI, 2026-11-27: 172 of 1,024 streams). A stream waiting for its turn holds its
//!   later deltas back meanwhile, which merges them.
//!
//! What pacing never changes: the text and token counts a client adds up are exactly those
//! of the unpaced stream. Under the rate bound's burst (a few streams, or a steady load under
//! the bound) a stream's first record and its terminal record go out at once, so time to
//! first token is untouched; over it they wait their turn, as they would have waited in the
//! consumer's full queue, never longer than [`MAX_PACE_INTERVAL`]. A held delta rides on the
//! terminal record, or goes out just before it where the two cannot merge (an error).
//! Records that are not deltas (objects, actions, observations) are never held by the
//! interval, but they count against the rate bound.
//!
//! # Merging while the broker is behind (issue #27)
//! On a durable response topic nothing is lost, but a record per provider chunk costs the
//! broker a message each: at 64 callers of 20 tokens each, the broker's JVM was the first to
//! run out of CPU and the path gave 0.62x of the provider's rate (0.94x paced by time, which
//! adds up to an interval's wait to every later token). So by default
//! (`--response-pacing merge`; `auto` is a record per delta), a stream on such a topic holds
//! a text delta only while the broker has not yet confirmed the stream's previous record,
//! merging what comes meanwhile, and publishes the merge as soon as that confirmation arrives
//! (a [`Receipt`], not a timer). A broker that keeps up confirms a record
//! before the next token comes and sees every token as its own record, as before; a busy one
//! gets fewer, larger records, as many as it can confirm. The first record, records that are
//! not deltas and terminal records are never held, and the text and token counts a client
//! adds up are the same.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Weak,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::{FutureExt, StreamExt, stream::FuturesUnordered};
use prometheus::{Gauge, IntCounter};
use sluice_schema::{Error, ErrorKind, ResponseRecord, properties, topics::Persistence};
use tokio::{
    sync::{Mutex, oneshot},
    time::Instant,
};

use crate::{
    bus::{BusError, Message, Publisher, Receipt},
    sync::StreamBook,
};

/// When a processor paces its response records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PaceWhen {
    /// On non-persistent response topics (TrustGraph's mapping), where a slow consumer loses
    /// records; never on persistent ones, whose consumers the broker slows down instead: a
    /// record per delta there.
    Auto,
    /// Always.
    On,
    /// Never.
    Off,
    /// As `Auto`, and on a durable topic a delta waits, merged with those after it, while the
    /// broker has not confirmed the stream's previous record (see the module docs). The
    /// default.
    #[default]
    Merge,
}

/// How a paced processor publishes: at most one record per stream per `min_interval`, and
/// about `max_records_per_sec` intermediate records per second over all its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// When pacing applies.
    pub when: PaceWhen,
    /// The least time between two records of one stream.
    pub min_interval: Duration,
    /// The processor's bound on records per second, over all its paced streams and every kind
    /// of record; `None` for no bound.
    pub max_records_per_sec: Option<u32>,
}

/// What a sink does with a stream's text deltas: publish each at once, pace them by time (a
/// non-persistent topic's), or merge them while the broker is behind (a durable topic's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Merging {
    /// Every record at once.
    Never,
    /// Paced by the processor's [`Pacer`].
    Paced,
    /// Held while the stream's previous record is unconfirmed.
    WhileBehind,
}

/// The default least time between two records of one paced stream.
pub const DEFAULT_PACE_INTERVAL: Duration = Duration::from_millis(100);
/// The longest a paced stream's interval grows under the rate bound (reached at 2,500 open
/// streams with the default bound): past it the bound gives way rather than hold a stream's
/// text for so long that its reader's inactivity timeout comes near.
pub const MAX_PACE_INTERVAL: Duration = Duration::from_secs(5);
/// How far ahead of the rate bound's schedule a record may go: records that come together go
/// out at once up to this much of the bound's rate (100 records at 500 per second), so a
/// processor under its bound never delays a first or terminal record.
pub const RATE_BURST: Duration = Duration::from_millis(200);
/// The default bound on a paced processor's intermediate records per second. Half of what
/// TrustGraph's Python consumer holds (a receiver queue of 1,000), so a consumer that stalls
/// for a moment still has room. (When this bound left first and terminal records out, at 1,000
/// that consumer lost a record in 1 of 12 runs of 512 concurrent streams on an idle 2-core
/// machine; at 500, none in 16 idle, but some on a busy one.)
pub const DEFAULT_MAX_RECORDS_PER_SEC: u32 = 500;

impl Default for Pacing {
    fn default() -> Self {
        Self {
            when: PaceWhen::Merge,
            min_interval: DEFAULT_PACE_INTERVAL,
            max_records_per_sec: Some(DEFAULT_MAX_RECORDS_PER_SEC),
        }
    }
}

impl std::str::FromStr for PaceWhen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            "merge" => Ok(Self::Merge),
            other => Err(format!("`{other}` is not one of auto, on, off, merge")),
        }
    }
}

impl std::fmt::Display for PaceWhen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
            Self::Merge => "merge",
        })
    }
}

impl Pacing {
    /// Whether a processor answering on `response_topic` paces.
    pub fn applies_to(&self, response_topic: &str) -> bool {
        self.merging(response_topic) == Merging::Paced
    }

    /// How a processor answering on `response_topic` merges deltas.
    pub(crate) fn merging(&self, response_topic: &str) -> Merging {
        let lossy = Persistence::of(response_topic).is_lossy();
        match self.when {
            PaceWhen::Auto | PaceWhen::Merge if lossy => Merging::Paced,
            PaceWhen::Auto => Merging::Never,
            PaceWhen::Merge => Merging::WhileBehind,
            PaceWhen::On => Merging::Paced,
            PaceWhen::Off => Merging::Never,
        }
    }
}

/// What every paced stream of one processor shares.
pub(crate) struct Pacer {
    pacing: Pacing,
    /// Paced streams open now: the rate bound is shared among them.
    open: AtomicUsize,
    /// The rate bound's schedule: when the next record's turn comes if none goes ahead of
    /// it (`None` before the first record).
    next_turn: std::sync::Mutex<Option<Instant>>,
    coalesced: IntCounter,
    interval_gauge: Gauge,
    /// Records that waited for their turn under the rate bound.
    delayed: IntCounter,
}

impl Pacer {
    pub(crate) fn new(
        pacing: Pacing,
        coalesced: IntCounter,
        interval_gauge: Gauge,
        delayed: IntCounter,
    ) -> Self {
        let pacer = Self {
            pacing,
            open: AtomicUsize::new(0),
            next_turn: std::sync::Mutex::new(None),
            coalesced,
            interval_gauge,
            delayed,
        };
        pacer.interval();
        pacer
    }

    /// The bound on records per second, if there is one (0 is none).
    fn rate(&self) -> Option<u32> {
        self.pacing.max_records_per_sec.filter(|r| *r > 0)
    }

    /// The least time between two records of a stream now (also its gauge's value).
    pub(crate) fn interval(&self) -> Duration {
        let by_rate = self.rate().map_or(Duration::ZERO, |rate| {
            let open = self.open.load(Ordering::Relaxed).max(1);
            Duration::from_secs_f64(open as f64 / f64::from(rate))
        });
        let interval = self.pacing.min_interval.max(by_rate.min(MAX_PACE_INTERVAL));
        self.interval_gauge.set(interval.as_secs_f64());
        interval
    }

    /// Waits for a record's turn under the rate bound: records go out at most `rate` per
    /// second, though up to [`RATE_BURST`] of them together go at once; none waits longer than
    /// [`MAX_PACE_INTERVAL`] (past that the bound gives way, as the interval's does).
    async fn turn(&self) {
        let Some(rate) = self.rate() else {
            return;
        };
        let spacing = Duration::from_secs_f64(1.0 / f64::from(rate));
        let at = {
            let mut next = crate::lock(&self.next_turn);
            let now = Instant::now();
            let scheduled = next.map_or(now, |n| n.max(now));
            let at = scheduled
                .checked_sub(RATE_BURST)
                .map_or(now, |early| early.max(now))
                .min(now + MAX_PACE_INTERVAL);
            // Capped, the schedule moves back too: the records after this one wait from here,
            // not from an ever growing backlog.
            *next = Some((scheduled + spacing).min(at + RATE_BURST + spacing));
            at
        };
        if at > Instant::now() {
            self.delayed.inc();
            tokio::time::sleep_until(at).await;
        }
    }

    fn opened(&self) {
        self.open.fetch_add(1, Ordering::Relaxed);
        self.interval();
    }

    fn closed(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.interval();
    }
}

/// Why a record could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The stream already has its terminal record; nothing may follow it.
    #[error("the stream has ended")]
    Ended,
    /// The bus failed; the request will be attempted again.
    #[error(transparent)]
    Bus(#[from] BusError),
}

/// Publishes one request's response records, in order, with the request's properties.
///
/// The publishing state lives behind an async mutex because a paced stream's held delta is
/// also published by a timer when no further record comes; unpaced, the lock is uncontended.
pub struct ResponseSink<R: ResponseRecord> {
    core: Arc<Mutex<Core<R>>>,
    // Copies of the core's state as of the last call, for the synchronous accessors.
    ended: bool,
    ended_with_error: bool,
    error_kind: Option<String>,
    published: u64,
    handed_off: bool,
}

/// Where a paced stream stands.
struct Pace<R> {
    pacer: Arc<Pacer>,
    /// The delta held back (the merge of those that came within the interval).
    held: Option<R>,
    /// When the last record went out; `None` before the first.
    last: Option<Instant>,
    /// A timer will publish the held delta.
    armed: bool,
}

struct Core<R> {
    publisher: Arc<dyn Publisher>,
    properties: BTreeMap<String, String>,
    /// Properties of the request carried onto a hand-off (the next step's request) but not
    /// onto the records: the API key's name.
    carried: BTreeMap<String, String>,
    pending: FuturesUnordered<Receipt>,
    failed: Option<BusError>,
    ended: bool,
    ended_with_error: bool,
    /// The terminal error record's kind.
    error_kind: Option<String>,
    published: u64,
    /// On a non-persistent response topic: the processor's account for its syncs, and this
    /// stream's attempt.
    book: Option<(Arc<StreamBook>, String)>,
    pace: Option<Pace<R>>,
    /// Set when deltas are merged while the broker is behind.
    behind: Option<Behind<R>>,
    /// The processor's count of records published.
    records: IntCounter,
}

/// Where a stream that merges while the broker is behind stands.
struct Behind<R> {
    /// The delta held back (the merge of those that came while a record was unconfirmed).
    held: Option<R>,
    /// A task awaits the receipts taken from `pending` and then publishes the held delta; it
    /// reports a failed receipt here before it takes the stream's lock.
    waiting: Option<oneshot::Receiver<Option<BusError>>>,
    /// The processor's count of merged deltas.
    coalesced: IntCounter,
}

impl<R> Drop for Core<R> {
    fn drop(&mut self) {
        if let Some((book, attempt)) = &self.book {
            book.close(attempt);
        }
        if let Some(pace) = &self.pace {
            pace.pacer.closed();
        }
    }
}

impl<R: ResponseRecord> ResponseSink<R> {
    pub(crate) fn new(
        publisher: Arc<dyn Publisher>,
        properties: BTreeMap<String, String>,
        carried: BTreeMap<String, String>,
        book: Option<Arc<StreamBook>>,
        pacer: Option<Arc<Pacer>>,
        behind: Option<IntCounter>,
        records: IntCounter,
    ) -> Self {
        let book = book.and_then(|book| {
            let id = properties.get(properties::ID)?;
            let attempt = properties.get(properties::ATTEMPT)?;
            book.open(id, attempt);
            Some((book, attempt.clone()))
        });
        let pace = pacer.map(|pacer| {
            pacer.opened();
            Pace {
                pacer,
                held: None,
                last: None,
                armed: false,
            }
        });
        Self {
            core: Arc::new(Mutex::new(Core {
                publisher,
                properties,
                carried,
                pending: FuturesUnordered::new(),
                failed: None,
                ended: false,
                ended_with_error: false,
                error_kind: None,
                published: 0,
                book,
                // Pacing by time takes precedence: it merges too.
                behind: behind.filter(|_| pace.is_none()).map(|coalesced| Behind {
                    held: None,
                    waiting: None,
                    coalesced,
                }),
                pace,
                records,
            })),
            ended: false,
            ended_with_error: false,
            error_kind: None,
            published: 0,
            handed_off: false,
        }
    }

    fn mirror(&mut self, core: &Core<R>) {
        self.ended = core.ended || self.handed_off;
        self.ended_with_error = core.ended_with_error;
        if self.error_kind.is_none() && core.error_kind.is_some() {
            self.error_kind.clone_from(&core.error_kind);
        }
        self.published = core.published;
    }

    /// Sends a record. After a terminal record, or after a failure, every send fails.
    ///
    /// A record too large for the bus is not sent: the stream ends with a
    /// `message-too-large` error instead, and this returns [`SinkError::Ended`]. On a paced
    /// stream a delta may be held and merged into the next record (see the module docs);
    /// it is published within the stream's interval all the same.
    pub async fn send(&mut self, record: R) -> Result<(), SinkError> {
        if self.handed_off {
            return Err(SinkError::Ended);
        }
        let core = self.core.clone();
        let mut guard = core.lock().await;
        let result = guard.send(record, &self.core).await;
        self.mirror(&guard);
        result
    }

    /// Ends this attempt without a terminal record by handing the request on: `payload` (the
    /// next request) is published to `publisher` with this request's id and trace context and
    /// a [`properties::CONTINUES`] marker naming this attempt, for any replica to take the next
    /// step. The records sent so far are stored first, so the next step's records follow
    /// them. Once this returns, the request is acked; nothing may be sent after it.
    pub async fn hand_off(
        &mut self,
        publisher: &dyn Publisher,
        payload: Vec<u8>,
    ) -> Result<(), SinkError> {
        if self.ended {
            return Err(SinkError::Ended);
        }
        let core = self.core.clone();
        let mut guard = core.lock().await;
        if guard.ended {
            self.mirror(&guard);
            return Err(SinkError::Ended);
        }
        let flushed = guard.flush().await;
        self.mirror(&guard);
        flushed?;
        if guard.ended {
            // The held delta was too large for the bus: its error record ended the stream,
            // and nothing may continue it.
            return Err(SinkError::Ended);
        }
        let mut props = BTreeMap::new();
        for key in [
            properties::ID,
            properties::TRACEPARENT,
            properties::TRACESTATE,
            properties::REPLY_TO,
        ] {
            if let Some(v) = guard.properties.get(key) {
                props.insert(key.to_owned(), v.clone());
            }
        }
        if let Some(attempt) = guard.properties.get(properties::ATTEMPT) {
            props.insert(properties::CONTINUES.to_owned(), attempt.clone());
        }
        props.extend(guard.carried.clone());
        let stored = match publisher
            .send(Message {
                payload: payload.into(),
                properties: props,
                key: None,
            })
            .await
        {
            Ok(receipt) => receipt.await,
            Err(e) => Err(e),
        };
        if let Err(e) = stored {
            // Like a record that could not be stored: the request goes back to the broker
            // for another attempt (and the processor waits for the broker), never a terminal
            // error for what is the bus's trouble.
            let reported = BusError::Unavailable(e.to_string());
            guard.failed.get_or_insert(e);
            return Err(SinkError::Bus(reported));
        }
        self.handed_off = true;
        self.mirror(&guard);
        Ok(())
    }

    /// The request goes back to the broker: its stream is no longer one to count (a later
    /// attempt answers it, where the broker keeps requests).
    pub(crate) async fn retract(&self) {
        let guard = self.core.lock().await;
        if let Some((book, attempt)) = &guard.book {
            book.retract(attempt);
        }
    }

    /// The request is gone without its answer (see [`StreamBook::abandon`]).
    pub(crate) async fn abandon(&self) {
        let guard = self.core.lock().await;
        if let Some((book, attempt)) = &guard.book {
            book.abandon(attempt);
        }
    }

    /// Whether the terminal record sent was an error.
    pub fn ended_with_error(&self) -> bool {
        self.ended_with_error
    }

    /// The terminal error record's kind (`llm-error`, ...), when the stream ended with one.
    pub fn error_kind(&self) -> Option<&str> {
        self.error_kind.as_deref()
    }

    /// True once the terminal record is sent (or the request was handed off).
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// Whether the request was handed on (see [`ResponseSink::hand_off`]).
    pub(crate) fn handed_off(&self) -> bool {
        self.handed_off
    }

    /// Records published so far (a held delta is not, until it goes out).
    pub fn records_sent(&self) -> u64 {
        self.published
    }

    /// Publishes a held delta and waits until the broker has stored every record sent. A
    /// failure stays: once one record (or a hand-off) was not stored, nothing more goes out
    /// for this attempt, so the runtime hands the request back instead of publishing an
    /// error for it.
    pub(crate) async fn flush(&mut self) -> Result<(), BusError> {
        let core = self.core.clone();
        let mut guard = core.lock().await;
        let result = guard.flush().await;
        self.mirror(&guard);
        result
    }
}

impl<R: ResponseRecord> Core<R> {
    async fn send(&mut self, record: R, me: &Arc<Mutex<Core<R>>>) -> Result<(), SinkError> {
        if self.ended {
            return Err(SinkError::Ended);
        }
        if let Some(e) = &self.failed {
            return Err(SinkError::Bus(BusError::Unavailable(e.to_string())));
        }
        if self.behind.is_some() {
            return self.send_behind(record, me).await;
        }
        if self.pace.as_ref().and_then(|p| p.last).is_none() {
            // Unpaced, or the first record: at once, whatever it is.
            return self.emit(record).await;
        }
        let held = self.pace.as_mut().and_then(|p| p.held.take());
        let candidate = self.merged_with_held(held, record).await?;
        // What is not a delta (a terminal record, the held text merged into a clean one, an
        // object) goes out now: the held text rides on a clean terminal record (one record
        // where synchronised streams would put two on the topic at the same moment), and
        // precedes an error record.

        let now = Instant::now();
        if let Some(pace) = self.pace.as_mut() {
            let due = pace.last.map_or(now, |last| last + pace.pacer.interval());
            if candidate.is_delta() && now < due {
                pace.held = Some(candidate);
                if !pace.armed {
                    pace.armed = true;
                    tokio::spawn(release_at(Arc::downgrade(me), due));
                }
                return Ok(());
            }
        }
        self.emit(candidate).await
    }

    /// [`Core::send`] for a stream that merges while the broker is behind: a delta waits
    /// (merged with what comes after it) while a record published before it is unconfirmed.
    async fn send_behind(&mut self, record: R, me: &Arc<Mutex<Core<R>>>) -> Result<(), SinkError> {
        // First: a receipt that failed meanwhile fails this send, whatever the record is, so
        // nothing (a terminal record least of all) goes out after a record not stored.
        let behind = self.unconfirmed()?;
        let held = self.behind.as_mut().and_then(|b| b.held.take());
        let candidate = self.merged_with_held(held, record).await?;
        if candidate.is_delta() && behind {
            let waiting = self.behind.as_ref().is_some_and(|b| b.waiting.is_some());
            if !waiting {
                // The receipts go to a task that publishes the held delta once they are in;
                // the records after it start a set of their own.
                let receipts = std::mem::take(&mut self.pending);
                let (tx, rx) = oneshot::channel();
                tokio::spawn(release_when_confirmed(Arc::downgrade(me), receipts, tx));
                if let Some(behind) = self.behind.as_mut() {
                    behind.waiting = Some(rx);
                }
            }
            if let Some(behind) = self.behind.as_mut() {
                behind.held = Some(candidate);
            }
            return Ok(());
        }
        self.emit(candidate).await
    }

    /// The record merged into the delta held back (by pacing or while the broker is behind),
    /// counted as a merge. Where the two are not one record's worth (an error record), the
    /// held delta goes out first, in order, and the record is returned as it came.
    async fn merged_with_held(&mut self, held: Option<R>, record: R) -> Result<R, SinkError> {
        let Some(mut held) = held else {
            return Ok(record);
        };
        match held.coalesce(record) {
            Ok(()) => {
                // Pacing and merging count in the same series; a stream does one or the other.
                if let Some(pace) = &self.pace {
                    pace.pacer.coalesced.inc();
                } else if let Some(behind) = &self.behind {
                    behind.coalesced.inc();
                }
                Ok(held)
            }
            Err(record) => {
                self.emit(held).await?;
                Ok(record)
            }
        }
    }

    /// Whether a record this stream published is not yet confirmed by the broker. A failed
    /// receipt that came in meanwhile fails the send.
    fn unconfirmed(&mut self) -> Result<bool, SinkError> {
        let mut waiting = false;
        if let Some(behind) = self.behind.as_mut()
            && let Some(rx) = behind.waiting.as_mut()
        {
            match rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => waiting = true,
                Ok(failure) => {
                    behind.waiting = None;
                    if let Some(e) = failure {
                        self.failed.get_or_insert(e);
                    }
                }
                Err(oneshot::error::TryRecvError::Closed) => {
                    behind.waiting = None;
                    self.failed.get_or_insert(BusError::Unavailable(
                        "the task awaiting the broker's receipts ended without them".into(),
                    ));
                }
            }
        }
        self.settle_ready();
        if let Some(e) = &self.failed {
            return Err(SinkError::Bus(BusError::Unavailable(e.to_string())));
        }
        Ok(waiting || !self.pending.is_empty())
    }

    /// Takes in the receipts that are already settled, so memory stays flat on long streams
    /// and a failure is noticed early.
    fn settle_ready(&mut self) {
        while let Some(Some(result)) = self.pending.next().now_or_never() {
            if let Err(e) = result {
                self.failed.get_or_insert(e);
            }
        }
    }

    /// Publishes the held delta, if any.
    async fn release(&mut self) -> Result<(), SinkError> {
        let held = match (self.pace.as_mut(), self.behind.as_mut()) {
            (Some(pace), _) => pace.held.take(),
            (None, Some(behind)) => behind.held.take(),
            (None, None) => None,
        };
        match held {
            Some(held) => self.emit(held).await,
            None => Ok(()),
        }
    }

    async fn flush(&mut self) -> Result<(), BusError> {
        if let Some(rx) = self.behind.as_mut().and_then(|b| b.waiting.take()) {
            // First the receipts a merging stream's task awaits (it sends before it takes the
            // lock this holds: no deadlock), so that a delta held behind a record that was
            // not stored is not published after it.
            match rx.await {
                Ok(None) => {}
                Ok(Some(e)) => {
                    self.failed.get_or_insert(e);
                }
                Err(_) => {
                    self.failed.get_or_insert(BusError::Unavailable(
                        "the task awaiting the broker's receipts ended without them".into(),
                    ));
                }
            }
        }
        if !self.ended && self.failed.is_none() {
            // A stream handed back or ended by the runtime still gets what it was sent.
            match self.release().await {
                Err(SinkError::Bus(e)) => {
                    self.failed.get_or_insert(e);
                }
                Err(SinkError::Ended) | Ok(()) => {}
            }
        }
        while let Some(result) = self.pending.next().await {
            if let Err(e) = result {
                self.failed.get_or_insert(e);
            }
        }
        match &self.failed {
            Some(e) => Err(BusError::Unavailable(e.to_string())),
            None => Ok(()),
        }
    }

    /// Publishes `record` now, ending the stream when it is terminal, and in its place a
    /// `message-too-large` error when the bus refuses it for its size.
    async fn emit(&mut self, record: R) -> Result<(), SinkError> {
        match self.publish(&record).await {
            Ok(()) => {
                if record.is_terminal() {
                    self.ended = true;
                    self.ended_with_error = record.error().is_some();
                    self.error_kind = record.error().map(|e| e.kind.as_str().to_owned());
                }
                Ok(())
            }
            Err(BusError::TooLarge { size, limit }) => {
                let error = R::from_error(Error::new(
                    ErrorKind::MessageTooLarge,
                    format!(
                        "a response record of {size} bytes exceeds the bus limit of {limit} bytes; the stream ends here"
                    ),
                ));
                self.publish(&error).await?;
                self.ended = true;
                self.ended_with_error = true;
                self.error_kind = Some(ErrorKind::MessageTooLarge.as_str().to_owned());
                Err(SinkError::Ended)
            }
            Err(e) => Err(SinkError::Bus(e)),
        }
    }

    async fn publish(&mut self, record: &R) -> Result<(), BusError> {
        let payload = serde_json::to_vec(record)
            .map_err(|e| BusError::Config(format!("encoding a response record: {e}")))?;
        if let Some(pace) = &self.pace {
            // The stream's lock is held meanwhile: its handler's next send waits, and what it
            // sends after is merged into fewer records.
            pace.pacer.turn().await;
        }
        let mut numbered = self.properties.clone();
        // Numbered per attempt so that a client sees a record lost in transit (see
        // `properties::SEQ`). A record refused as too large is not published and its number
        // goes to the error record that replaces it.
        numbered.insert(properties::SEQ.to_owned(), self.published.to_string());
        let message = Message {
            payload: payload.into(),
            properties: numbered,
            key: None,
        };
        match self.publisher.send(message).await {
            Ok(receipt) => {
                self.pending.push(receipt);
                self.published += 1;
                self.records.inc();
                if let Some(pace) = self.pace.as_mut() {
                    pace.last = Some(Instant::now());
                }
                // Handed to the producer: any sync from now on goes out after this record.
                if let Some((book, attempt)) = &self.book {
                    book.published(attempt, self.published);
                }
                self.settle_ready();
                match &self.failed {
                    Some(e) => Err(BusError::Unavailable(e.to_string())),
                    None => Ok(()),
                }
            }
            Err(e @ BusError::TooLarge { .. }) => Err(e),
            Err(e) => {
                let reported = BusError::Unavailable(e.to_string());
                self.failed.get_or_insert(e);
                Err(reported)
            }
        }
    }
}

/// A paced stream's timer: publishes its held delta at `due`, unless a record sent since took
/// it along; waits longer when more streams opened meanwhile (the interval grew). Ends when
/// the stream is gone.
async fn release_at<R: ResponseRecord>(core: Weak<Mutex<Core<R>>>, mut due: Instant) {
    loop {
        tokio::time::sleep_until(due).await;
        let Some(core) = core.upgrade() else { return };
        let mut guard = core.lock().await;
        let over = guard.ended || guard.failed.is_some();
        let Some(pace) = guard.pace.as_mut() else {
            return;
        };
        if over || pace.held.is_none() {
            pace.armed = false;
            return;
        }
        if let Some(later) = pace
            .last
            .map(|last| last + pace.pacer.interval())
            .filter(|later| *later > Instant::now())
        {
            due = later;
            continue;
        }
        pace.armed = false;
        // A failure is kept in the core: the handler's next send, or the runtime's flush,
        // reports it.
        let _ = guard.release().await;
        return;
    }
}

/// A stream's task while the broker is behind: awaits the receipts of the records published
/// so far, reports a failure, and publishes the delta held meanwhile (unless a record sent
/// since took it along). Its record's receipt is then outstanding in turn, so the next delta
/// is held again until the broker confirms it.
async fn release_when_confirmed<R: ResponseRecord>(
    core: Weak<Mutex<Core<R>>>,
    mut receipts: FuturesUnordered<Receipt>,
    done: oneshot::Sender<Option<BusError>>,
) {
    let mut failure = None;
    while let Some(result) = receipts.next().await {
        if let Err(e) = result {
            failure.get_or_insert(e);
        }
    }
    let failed = failure.is_some();
    // Sent before the lock is taken: a flush holding the lock waits for this, not for us.
    if done.send(failure).is_err() || failed {
        // Flushed meanwhile (it took the held delta), or a failure: the handler's next send,
        // or the runtime's flush, reports it.
        return;
    }
    let Some(core) = core.upgrade() else { return };
    let mut guard = core.lock().await;
    if guard.ended {
        return;
    }
    // Takes in what this task sent (it was received by nobody yet, or by a send that found
    // the stream caught up and took the held delta along). Another task awaiting newer
    // receipts releases the held delta when they are in.
    match guard.unconfirmed() {
        Err(_) => return,
        Ok(_) if guard.behind.as_ref().is_some_and(|b| b.waiting.is_some()) => return,
        Ok(_) => {}
    }
    // A failure is kept in the core: the handler's next send, or the runtime's flush, reports
    // it.
    let _ = guard.release().await;
}

#[cfg(test)]
mod tests;
