//! The rule that sees a client's response consumer go deaf (nothing at all heard, not even
//! the processors' syncs, while streams wait) and when to re-subscribe.

use std::time::Duration;

use tokio::time::Instant;

/// How often a router on a lossy topic counts a second of silence (see [`Deafness`]).
pub(super) const DEAF_TICK: Duration = Duration::from_secs(1);

/// Ticks of a second (`DEAF_TICK`) with nothing at all heard (10 to 11 s: the ticks' phase is
/// not reset by what arrives, which would cost a timer per record), while streams are open and
/// syncs were heard just before, after which a router asks its subscription to re-subscribe.
/// Processors sync every [`crate::processor::SYNC_INTERVAL`] (1 s). The same as the time
/// after which a processor that stopped syncing counts as gone ([`SILENT_AFTER`]). A topic
/// move alone does not reach it (pulsar-rs reconnects within seconds after an unload); a
/// broker's SIGKILL does (no broker owns the topic for ~20-30 s), and the re-subscription
/// then retries like pulsar-rs's own reconnect would.
///
/// [`SILENT_AFTER`]: crate::sync::SILENT_AFTER
pub const DEAF_AFTER_TICKS: u32 = 10;

/// How recent, before the silence began, the last sync must be for the silence to mean
/// anything: a client that heard sluice's processors long ago and now only TrustGraph's
/// (which do not sync) hears nothing for as long as their answer takes.
const SYNCED_BEFORE: Duration = Duration::from_secs(5);

/// The longest silence, in ticks, between two re-subscriptions that heard nothing in between
/// (every processor gone, or no broker owns the topic): each doubles the wait, up to this.
const DEAF_AFTER_TICKS_MAX: u32 = 80;

/// A router's count of the seconds in which nothing arrived on its subscription.
pub(super) struct Deafness {
    quiet: u32,
    /// Quiet ticks before the next re-subscription (more than this many).
    due: u32,
    /// When something last arrived: the silence began then.
    last_heard: Instant,
}

impl Default for Deafness {
    fn default() -> Self {
        Self {
            quiet: 0,
            due: DEAF_AFTER_TICKS,
            last_heard: Instant::now(),
        }
    }
}

impl Deafness {
    /// Something arrived.
    pub(super) fn heard(&mut self) {
        self.quiet = 0;
        self.due = DEAF_AFTER_TICKS;
        self.last_heard = Instant::now();
    }

    /// A tick passed with nothing heard. Returns why to re-subscribe when it is time to:
    /// `last_sync` (when a processor's sync last arrived: the silence means something only if
    /// syncs came just before it began) and `open` (some stream waits: only then does the
    /// silence cost anyone).
    pub(super) fn tick(&mut self, last_sync: Option<Instant>, open: bool) -> Option<String> {
        self.quiet = self.quiet.saturating_add(1);
        let synced = last_sync
            .is_some_and(|at| self.last_heard.saturating_duration_since(at) <= SYNCED_BEFORE);
        if !synced || !open || self.quiet <= self.due {
            return None;
        }
        let quiet = self.quiet;
        self.quiet = 0;
        self.due = self.due.saturating_mul(2).min(DEAF_AFTER_TICKS_MAX);
        Some(format!(
            "nothing arrived on the response topic for {quiet} s, not even a processor's sync \
             (sent every second and heard before), while requests wait: the broker no longer \
             delivers to this consumer, or every processor is gone"
        ))
    }
}

#[cfg(test)]
mod tests;
