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
//! - a stream listed with more records than the client received lost the rest ([`Verdict`]);
//! - a request stored by the broker that no processor lists, while every processor the client
//!   hears from has been taking requests for [`UNLISTED_GRACE`] since, reached no processor;
//! - a stream whose processor stopped syncing for [`SILENT_AFTER`] while others sync lost
//!   its processor.
//!
//! Timing is read in the client's own clock: a sync's time of sending is estimated from the
//! lowest offset between the processor's clock and the client's seen lately, so neither clock
//! skew nor a client that reads late (its router behind) makes a sync look newer than it is.

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

/// Characters of an attempt id a sync carries: enough to tell a request's attempts apart.
const ATTEMPT_KEY: usize = 8;

/// The part of an attempt id a sync lists; a client matches it as a prefix.
pub fn attempt_key(attempt: &str) -> &str {
    attempt.get(..ATTEMPT_KEY).unwrap_or(attempt)
}

/// A processor instance whose last sync is older than the newest one's by this much no longer
/// counts as live.
pub const SILENT_AFTER: Duration = Duration::from_secs(3);

/// How long every live processor must have been taking requests after a request was stored,
/// without listing it, before the request is taken as lost.
pub const UNLISTED_GRACE: Duration = Duration::from_secs(2);

/// Offsets kept per instance for the clock estimate.
const OFFSET_WINDOW: usize = 30;

/// Instances not heard from for this long are forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(120);

/// A sync's content (JSON in [`properties::SYNC_STATE`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncState {
    /// The processor instance: unique per process and flow.
    pub instance: String,
    /// When the sync was made, milliseconds since the Unix epoch in the processor's clock.
    pub at_ms: u64,
    /// Whether the processor takes requests now (a free slot, not draining, storing fine).
    pub taking: bool,
    /// `(request id, attempt key, records published)` of each stream open or finished within
    /// [`DONE_FOR`]; the attempt key is the first characters of the attempt id
    /// ([`attempt_key`]).
    pub streams: Vec<(String, String, u64)>,
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

    /// The stream ends (answered, handed back or handed on): listed for [`DONE_FOR`] more.
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
        let mut streams: Vec<(String, String, u64)> = inner
            .open
            .iter()
            .take(MAX_LISTED)
            .map(|(attempt, (id, n))| (id.clone(), attempt_key(attempt).to_owned(), *n))
            .collect();
        // Newest first, so a cap drops the ones listed longest already.
        for (_, id, attempt, n) in inner.done.iter().rev() {
            if streams.len() >= MAX_LISTED {
                break;
            }
            streams.push((id.clone(), attempt.clone(), *n));
        }
        SyncState {
            instance: self.instance.clone(),
            at_ms: unix_ms(),
            taking,
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
        let sent = now.checked_sub(late).unwrap_or(now);
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

    /// Whether a request the broker stored at `stored` and no sync listed must have been
    /// lost: at least one live instance, and every live instance has been taking requests
    /// for [`UNLISTED_GRACE`] after it was stored.
    pub fn unlisted_is_lost(&self, stored: Instant) -> bool {
        let Some(newest) = self.newest else {
            return false;
        };
        let mut live = self
            .instances
            .values()
            .filter(|i| newest.saturating_duration_since(i.last) < SILENT_AFTER)
            .peekable();
        live.peek().is_some()
            && live.all(|i| {
                i.taking_since
                    .is_some_and(|since| i.last >= since.max(stored) + UNLISTED_GRACE)
            })
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

    #[test]
    fn a_book_lists_open_streams_and_finished_ones_for_a_while() {
        let book = StreamBook::new("p1");
        book.open("r1", "a1");
        book.open("r2", "0123456789abcdef");
        book.published("a1", 3);
        book.close("0123456789abcdef");
        let mut first = book.snapshot(true).streams;
        first.sort();
        assert_eq!(
            first,
            vec![
                ("r1".to_owned(), "a1".to_owned(), 3),
                ("r2".to_owned(), "01234567".to_owned(), 0)
            ]
        );
        let now = Instant::now();
        assert_eq!(book.snapshot_at(true, now + DONE_FOR / 2).streams.len(), 2);
        // Publishing after the end changes nothing.
        book.published("0123456789abcdef", 9);
        assert_eq!(
            book.snapshot_at(false, now + DONE_FOR).streams,
            vec![("r1".to_owned(), "a1".to_owned(), 3)]
        );
    }

    #[test]
    fn a_request_is_lost_only_once_every_live_instance_took_requests_long_enough() {
        let t0 = Instant::now();
        let mut watch = SyncWatch::default();
        let at = |d: u64| t0 + Duration::from_millis(d);
        // Clocks 5 s apart: only differences matter.
        watch.observe_at(&state("p1", 100_000, true), at(0), 105_000);
        watch.observe_at(&state("p2", 100_000, false), at(0), 105_000);
        let stored = at(100);
        watch.observe_at(&state("p1", 101_000, true), at(1000), 106_000);
        watch.observe_at(&state("p2", 101_000, true), at(1000), 106_000);
        watch.observe_at(&state("p1", 102_100, true), at(2100), 107_100);
        watch.observe_at(&state("p2", 102_100, true), at(2100), 107_100);
        // p2 took requests only from 1 s on: 2.1 s is not 2 s after that.
        assert!(!watch.unlisted_is_lost(stored));
        watch.observe_at(&state("p1", 103_000, true), at(3000), 108_000);
        watch.observe_at(&state("p2", 103_000, true), at(3000), 108_000);
        assert!(watch.unlisted_is_lost(stored));
        // An instance that stopped taking holds the verdict back while it is live...
        watch.observe_at(&state("p2", 104_000, false), at(4000), 109_000);
        watch.observe_at(&state("p1", 104_000, true), at(4000), 109_000);
        assert!(!watch.unlisted_is_lost(stored));
        // ...and releases it once it has been silent long enough.
        for s in 5..9 {
            watch.observe_at(
                &state("p1", 100_000 + s * 1000, true),
                at(s * 1000),
                105_000 + s * 1000,
            );
        }
        assert!(!watch.is_live("p2"));
        assert!(watch.is_live("p1"));
        assert!(watch.unlisted_is_lost(stored));
    }

    #[test]
    fn syncs_read_late_count_from_when_they_were_sent() {
        let t0 = Instant::now();
        let mut watch = SyncWatch::default();
        let at = |d: u64| t0 + Duration::from_millis(d);
        watch.observe_at(&state("p1", 1_000, true), at(0), 1_000);
        let stored = at(500);
        // The client reads 4 s late: the syncs sent 1 s and 2 s after the first arrive after
        // the request was stored, but were sent before or just after it.
        watch.observe_at(&state("p1", 2_000, true), at(4000), 5_000);
        watch.observe_at(&state("p1", 3_000, true), at(4010), 5_010);
        assert!(!watch.unlisted_is_lost(stored));
        // The one sent at 3 s is 2.5 s after the request was stored.
        watch.observe_at(&state("p1", 4_000, true), at(4020), 5_020);
        assert!(watch.unlisted_is_lost(stored));
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
            streams: vec![("id with \"quotes\"".to_owned(), "a".to_owned(), 4)],
        };
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<SyncState>(&json).unwrap(), s);
    }
}
