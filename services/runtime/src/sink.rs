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
mod tests {
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

    fn behind_sink(
        publisher: &Arc<Recorder>,
    ) -> (ResponseSink<TextCompletionResponse>, IntCounter) {
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
}
