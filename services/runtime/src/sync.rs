//! What a processor's sync says about the streams it answers, and what a client concludes
//! from it, on non-persistent response topics (TrustGraph's mapping).
//!
//! There the broker drops what it cannot deliver at once, and a client sees a loss only when
//! something later arrives that proves it: a record with a later index, or a later message of
//! the same producer. Three losses leave nothing later to see: every record of a stream
//! dropped before its client read one, the request itself dropped (no processor had a
//! consumer attached, e.g. while its topic moved between brokers), and the processor
//! answering it gone (SIGKILL) with the stream unfinished. Each used to wait out the client's
//! inactivity timeout.
//!
//! So every sync (see [`properties::SYNC`]) carries a [`SyncState`] in
//! [`properties::SYNC_STATE`]: the processor instance, whether it takes requests now, and for
//! each stream it is answering or finished lately, how many records it had published before
//! the sync. The sync goes through the producer of those records, after them, so a client
//! that receives it has received those records or never will. From that a client concludes:
//! - a stream listed with more records than the client received lost the rest
//!   ([`ClientError::LostInTransit`]);
//! - a request stored by the broker that no processor lists, while every processor the client
//!   hears from has been taking requests for [`UNLISTED_GRACE`] since, reached no processor;
//! - a stream listed as open by a processor that then stopped syncing for [`SILENT_AFTER`]
//!   while others sync lost its processor.
//!
//! Timing is read in the client's own clock: a sync's time of sending is estimated from the
//! lowest offset between the processor's clock and the client's seen lately, so neither clock
//! skew nor a client that reads late (its router behind) makes a sync look newer than it is.
//!
//! [`properties::SYNC`]: sluice_schema::properties::SYNC
//! [`properties::SYNC_STATE`]: sluice_schema::properties::SYNC_STATE
//! [`ClientError::LostInTransit`]: crate::client::ClientError::LostInTransit

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// A processor lists a finished stream in its syncs for this long, so that a client stalled
/// while the broker dropped both the stream and the syncs sent meanwhile still learns of it
/// once it reads again. The cost: each sync lists every stream finished in this window (about
/// 60 bytes a stream).
pub const DONE_FOR: Duration = Duration::from_secs(15);

/// A sync lists at most this many streams (open ones first, then the latest finished): bounds
/// its size (about 60 bytes a stream) far below the broker's message limit.
const MAX_LISTED: usize = 20_000;

/// A sync stops listing once its request ids add up to this many bytes (ids are the callers'
/// and may be long). A sync cut short says the processor does not take requests, so that no
/// client concludes anything from a stream missing from it.
const MAX_LISTED_BYTES: usize = 1 << 20;

/// Characters of an attempt id a sync carries: enough to tell a request's attempts apart.
const ATTEMPT_KEY: usize = 8;

/// The part of an attempt id a sync lists; a client matches it as a prefix.
pub fn attempt_key(attempt: &str) -> &str {
    attempt.get(..ATTEMPT_KEY).unwrap_or(attempt)
}

/// A processor instance whose last sync is older than the newest one's by this much no longer
/// counts as live.
/// Longer than a producer's reconnect after a topic moves (its syncs wait meanwhile, while
/// other instances' may already flow), far shorter than a client's inactivity timeout.
pub const SILENT_AFTER: Duration = Duration::from_secs(10);

/// How long every live processor must have been taking requests after a request was stored,
/// without listing it, before the request is taken as lost. Also the margin against a client
/// that reads steadily late: a lag below it cannot make a sync sent before the request
/// arrived count as sent after.
pub const UNLISTED_GRACE: Duration = Duration::from_secs(5);

/// Offsets kept per instance for the clock estimate.
const OFFSET_WINDOW: usize = 30;

/// Instances not heard from for this long are forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(120);

/// A sync's content (JSON in [`properties::SYNC_STATE`]).
///
/// [`properties::SYNC_STATE`]: sluice_schema::properties::SYNC_STATE
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncState {
    /// The processor instance: unique per process and flow.
    pub instance: String,
    /// When the sync was made, milliseconds since the Unix epoch in the processor's clock.
    pub at_ms: u64,
    /// Whether the processor takes requests now (a free slot, not draining, storing fine).
    pub taking: bool,
    /// `(request id, attempt key, records published, open)` of each stream open or finished
    /// within [`DONE_FOR`]; the attempt key is the first characters of the attempt id
    /// ([`attempt_key`]).
    pub streams: Vec<(String, String, u64, bool)>,
}

/// A processor's account of the streams it answers, for its syncs.
#[derive(Debug)]
pub struct StreamBook {
    instance: String,
    inner: Mutex<BookInner>,
}

#[derive(Debug, Default)]
struct BookInner {
    /// attempt -> (request id, records published).
    open: HashMap<String, (String, u64)>,
    /// (when it finished, request id, attempt key, records published), oldest first.
    done: VecDeque<(Instant, String, String, u64)>,
}

impl StreamBook {
    /// A book for one processor instance.
    pub fn new(instance: impl Into<String>) -> Self {
        Self {
            instance: instance.into(),
            inner: Mutex::default(),
        }
    }

    /// A stream begins.
    pub fn open(&self, id: &str, attempt: &str) {
        crate::lock(&self.inner)
            .open
            .insert(attempt.to_owned(), (id.to_owned(), 0));
    }

    /// `records` of `attempt` are now handed to the producer, ahead of any later sync.
    pub fn published(&self, attempt: &str, records: u64) {
        if let Some(entry) = crate::lock(&self.inner).open.get_mut(attempt) {
            entry.1 = records;
        }
    }

    /// The stream's request goes back to the broker for another attempt: it is not listed
    /// any more (its records so far do not make a stream a client must count).
    pub fn retract(&self, attempt: &str) {
        crate::lock(&self.inner).open.remove(attempt);
    }

    /// The stream's request is gone without its answer (handed back on a non-persistent
    /// request topic, where a nack brings nothing back): listed as finished, for
    /// [`DONE_FOR`], with one record more than were handed to the producer, the terminal
    /// record that never comes. Its client, which may have every record that was sent, then
    /// ends it as lost at the sync instead of waiting out its inactivity timeout (seen on the
    /// secured cluster after a broker's SIGKILL: a record that could not be handed to the
    /// producer, a stream listed as finished with the one record its client had, and the
    /// client waiting 120 s).
    pub fn abandon(&self, attempt: &str) {
        if let Some(entry) = crate::lock(&self.inner).open.get_mut(attempt) {
            entry.1 += 1;
        }
        self.close(attempt);
    }

    /// The stream ends (answered or handed on): listed for [`DONE_FOR`] more.
    pub fn close(&self, attempt: &str) {
        let mut inner = crate::lock(&self.inner);
        if let Some((id, records)) = inner.open.remove(attempt) {
            let key = attempt_key(attempt).to_owned();
            inner.done.push_back((Instant::now(), id, key, records));
            if inner.done.len() > MAX_LISTED {
                inner.done.pop_front();
            }
        }
    }

    /// The next sync's content.
    pub fn snapshot(&self, taking: bool) -> SyncState {
        self.snapshot_at(taking, Instant::now())
    }

    fn snapshot_at(&self, taking: bool, now: Instant) -> SyncState {
        let mut inner = crate::lock(&self.inner);
        while inner
            .done
            .front()
            .is_some_and(|(at, ..)| now.saturating_duration_since(*at) >= DONE_FOR)
        {
            inner.done.pop_front();
        }
        let mut streams: Vec<(String, String, u64, bool)> = Vec::with_capacity(inner.open.len());
        let mut bytes = 0;
        let mut whole = true;
        let open = inner
            .open
            .iter()
            .map(|(attempt, (id, n))| (id, attempt_key(attempt), *n, true));
        // Newest first, so a cap drops the ones listed longest already.
        let done = inner
            .done
            .iter()
            .rev()
            .map(|(_, id, key, n)| (id, key.as_str(), *n, false));
        for (id, key, n, is_open) in open.chain(done) {
            // As encoded: an id of quotes or control characters takes up to 6 bytes a byte.
            bytes += serde_json::to_string(id).map_or(id.len() * 6, |e| e.len()) + key.len() + 24;
            if streams.len() >= MAX_LISTED || bytes > MAX_LISTED_BYTES {
                whole = false;
                break;
            }
            streams.push((id.clone(), key.to_owned(), n, is_open));
        }
        SyncState {
            instance: self.instance.clone(),
            at_ms: unix_ms(),
            taking: taking && whole,
            streams,
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What a client knows of the processor instances syncing on its response topic.
#[derive(Debug, Default)]
pub struct SyncWatch {
    instances: HashMap<Arc<str>, Instance>,
    /// The newest sync's estimated time of sending, over all instances.
    newest: Option<Instant>,
}

#[derive(Debug)]
struct Instance {
    offsets: VecDeque<i64>,
    /// Estimated time of sending of its last sync, in the client's clock.
    last: Instant,
    /// Since when (estimated) every one of its syncs said it takes requests.
    taking_since: Option<Instant>,
}

impl SyncWatch {
    /// Takes in a sync received at `now`; returns its instance's interned name.
    pub fn observe(&mut self, state: &SyncState, now: Instant) -> Arc<str> {
        self.observe_at(state, now, unix_ms())
    }

    fn observe_at(&mut self, state: &SyncState, now: Instant, now_ms: u64) -> Arc<str> {
        let offset = i64::try_from(now_ms)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(state.at_ms).unwrap_or(i64::MAX));
        let key: Arc<str> = match self.instances.get_key_value(state.instance.as_str()) {
            Some((k, _)) => k.clone(),
            None => Arc::from(state.instance.as_str()),
        };
        let instance = self.instances.entry(key.clone()).or_insert(Instance {
            offsets: VecDeque::with_capacity(OFFSET_WINDOW),
            last: now,
            taking_since: None,
        });
        if instance.offsets.len() == OFFSET_WINDOW {
            instance.offsets.pop_front();
        }
        instance.offsets.push_back(offset);
        // The lowest offset seen lately is transit with no backlog; anything above it is how
        // late this sync is read.
        let floor = instance.offsets.iter().copied().min().unwrap_or(offset);
        let late = Duration::from_millis(u64::try_from(offset - floor).unwrap_or(0));
        // Read too late to place in this process's clock (only right after it started): it
        // says nothing about now.
        let Some(sent) = now.checked_sub(late) else {
            return key;
        };
        instance.last = instance.last.max(sent);
        if state.taking {
            instance.taking_since.get_or_insert(sent);
        } else {
            instance.taking_since = None;
        }
        let newest = self.newest.map_or(sent, |n| n.max(sent));
        self.newest = Some(newest);
        self.instances
            .retain(|_, i| newest.saturating_duration_since(i.last) < FORGET_AFTER);
        key
    }

    /// Whether `instance` still syncs (its last sync is recent next to the newest one).
    pub fn is_live(&self, instance: &str) -> bool {
        match (self.instances.get(instance), self.newest) {
            (Some(i), Some(newest)) => newest.saturating_duration_since(i.last) < SILENT_AFTER,
            _ => false,
        }
    }

    /// The latest store time a request no sync listed may have to count as lost: at least one
    /// live instance, and every live instance has been taking requests for
    /// [`UNLISTED_GRACE`] since. A request stored at or before it reached no processor.
    pub fn unlisted_deadline(&self) -> Option<Instant> {
        let newest = self.newest?;
        let mut deadline: Option<Instant> = None;
        for i in self
            .instances
            .values()
            .filter(|i| newest.saturating_duration_since(i.last) < SILENT_AFTER)
        {
            // Taking since `since` and heard at `last`: a request stored at `t` has been
            // waiting for it while it took requests for `last - max(since, t)`.
            let latest = i.last.checked_sub(UNLISTED_GRACE)?;
            if i.taking_since? > latest {
                return None;
            }
            deadline = Some(deadline.map_or(latest, |d| d.min(latest)));
        }
        deadline
    }

    /// Whether a request the broker stored at `stored` and no sync listed must have been
    /// lost (see [`SyncWatch::unlisted_deadline`]).
    pub fn unlisted_is_lost(&self, stored: Instant) -> bool {
        self.unlisted_deadline().is_some_and(|d| stored <= d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(instance: &str, at_ms: u64, taking: bool) -> SyncState {
        SyncState {
            instance: instance.to_owned(),
            at_ms,
            taking,
            streams: Vec::new(),
        }
    }

    fn entry(id: &str, key: &str, n: u64, open: bool) -> (String, String, u64, bool) {
        (id.to_owned(), key.to_owned(), n, open)
    }

    #[test]
    fn a_book_lists_open_streams_and_finished_ones_for_a_while() {
        let book = StreamBook::new("p1");
        book.open("r1", "a1");
        book.open("r2", "0123456789abcdef");
        book.open("r3", "a3");
        book.published("a1", 3);
        book.published("a3", 2);
        book.close("0123456789abcdef");
        // Handed back for another attempt: no longer a stream to count.
        book.retract("a3");
        let mut first = book.snapshot(true).streams;
        first.sort();
        assert_eq!(
            first,
            vec![
                entry("r1", "a1", 3, true),
                entry("r2", "01234567", 0, false)
            ]
        );
        let now = Instant::now();
        assert_eq!(book.snapshot_at(true, now + DONE_FOR / 2).streams.len(), 2);
        // Publishing after the end changes nothing.
        book.published("0123456789abcdef", 9);
        assert_eq!(
            book.snapshot_at(false, now + DONE_FOR).streams,
            vec![entry("r1", "a1", 3, true)]
        );
    }

    #[test]
    fn a_sync_cut_short_says_it_takes_no_requests() {
        let book = StreamBook::new("p1");
        let long = "x".repeat(100_000);
        for i in 0..20 {
            book.open(&format!("{long}{i}"), &format!("attempt{i}"));
        }
        let s = book.snapshot(true);
        assert!(
            s.streams.len() < 20 && !s.taking,
            "{} listed",
            s.streams.len()
        );
    }

    /// Syncs of `instance` sent every second from `from` s to `to` s (processor clock = client
    /// clock + 5 s: only differences matter), each read at once.
    fn syncs(
        watch: &mut SyncWatch,
        t0: Instant,
        instance: &str,
        secs: std::ops::Range<u64>,
        taking: bool,
    ) {
        for sec in secs {
            watch.observe_at(
                &state(instance, 100_000 + sec * 1000, taking),
                t0 + Duration::from_secs(sec),
                105_000 + sec * 1000,
            );
        }
    }

    #[test]
    fn a_request_is_lost_only_once_every_live_instance_took_requests_long_enough() {
        let t0 = Instant::now();
        let grace = UNLISTED_GRACE.as_secs();
        let mut watch = SyncWatch::default();
        syncs(&mut watch, t0, "p1", 0..1, true);
        syncs(&mut watch, t0, "p2", 0..1, false);
        let stored = t0 + Duration::from_millis(100);
        // p2 takes requests from 1 s on.
        for sec in 1..=grace {
            syncs(&mut watch, t0, "p1", sec..sec + 1, true);
            syncs(&mut watch, t0, "p2", sec..sec + 1, true);
            assert!(!watch.unlisted_is_lost(stored), "at {sec} s");
        }
        syncs(&mut watch, t0, "p1", grace + 1..grace + 2, true);
        syncs(&mut watch, t0, "p2", grace + 1..grace + 2, true);
        assert!(watch.unlisted_is_lost(stored));
        // A request stored later is not lost yet.
        assert!(!watch.unlisted_is_lost(t0 + Duration::from_secs(2)));
        // An instance that stops taking holds the verdict back while it is live...
        syncs(&mut watch, t0, "p2", grace + 2..grace + 3, false);
        syncs(&mut watch, t0, "p1", grace + 2..grace + 3, true);
        assert!(!watch.unlisted_is_lost(stored));
        // ...and releases it once it has been silent long enough.
        let silent = SILENT_AFTER.as_secs();
        syncs(&mut watch, t0, "p1", grace + 3..grace + 3 + silent, true);
        assert!(!watch.is_live("p2"));
        assert!(watch.is_live("p1"));
        assert!(watch.unlisted_is_lost(stored));
    }

    #[test]
    fn syncs_read_late_count_from_when_they_were_sent() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut watch = SyncWatch::default();
        // Clocks equal: wall ms = 1,000 + client ms.
        watch.observe_at(&state("p1", 1_000, true), at(0), 1_000);
        let stored = at(500);
        let grace = u64::try_from(UNLISTED_GRACE.as_millis()).unwrap();
        // The client then reads 8 s late: syncs sent up to 8 s after the first arrive after
        // the request was stored, but most were sent before its grace was up.
        for k in 1..=8u64 {
            let sent = k * 1000;
            watch.observe_at(&state("p1", 1_000 + sent, true), at(8_000 + k), 9_000 + k);
            assert_eq!(
                watch.unlisted_is_lost(stored),
                sent >= 500 + grace,
                "sync sent at {sent} ms"
            );
        }
    }

    #[test]
    fn no_sync_no_verdict() {
        assert!(!SyncWatch::default().unlisted_is_lost(Instant::now()));
    }

    #[test]
    fn the_state_round_trips_as_json() {
        let s = SyncState {
            instance: "text-completion-1a2b".to_owned(),
            at_ms: 1,
            taking: true,
            streams: vec![entry("id with \"quotes\"", "a", 4, true)],
        };
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<SyncState>(&json).unwrap(), s);
    }
}
