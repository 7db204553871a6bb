//! What the processors' syncs (see [`crate::sync`]) tell a router: the streams that can no
//! longer end on their own, ended as lost in transit.

use std::time::Duration;

use tokio::time::Instant;
use tracing::debug;

use super::route::{Routed, Routes};
use crate::{
    lock,
    sync::{SILENT_AFTER, SyncState, SyncWatch, UNLISTED_GRACE},
};

/// What a client's router learned from processors' syncs (see [`crate::sync`]).
#[derive(Default)]
pub(super) struct Syncs {
    watch: SyncWatch,
    /// A record without an index arrived: TrustGraph's own processors answer on this topic,
    /// and a request no sync lists may be theirs; none is ended for that, from then on.
    pub(super) foreign_records: bool,
    /// When a sync without a state (an older sluice, mid-upgrade) was last seen: that
    /// processor does not say which requests it took either.
    stateless_sync: Option<Instant>,
    /// When the last sync arrived (see [`Deafness`](super::deaf::Deafness)).
    pub(super) last_sync: Option<Instant>,
}

/// How long after a sync without a state a request no sync lists is not ended for it: the
/// older processor is gone once its syncs stop.
const STATELESS_FOR: Duration = Duration::from_secs(60);

impl Syncs {
    pub(super) fn stateless_sync_seen(&mut self) {
        self.stateless_sync = Some(Instant::now());
    }

    /// Ends every stream of `routes` that `state` (or its silence about them) shows can no
    /// longer end on its own.
    pub(super) fn check<R>(&mut self, state: &SyncState, routes: &Routes<R>, service: &str) {
        let now = Instant::now();
        let instance = self.watch.observe(state, now);
        let mut routes = lock(routes);
        let mut gone: Vec<(String, String)> = Vec::new();
        for (id, key, published, open) in &state.streams {
            let Some(route) = routes.get_mut(id) else {
                continue;
            };
            route.listed = true;
            route.last_seen = now;
            // Listed by a key, the first characters of the attempt id. An attempt the stream
            // moved on from (an agent's earlier step, a restart) stays listed for a while
            // after its end: not counted. The attempt it reads counts what arrived; one it
            // has not reached (the next step, published before this sync by the same
            // producer) counts nothing arrived.
            if route.abandoned.iter().any(|a| a.starts_with(key.as_str())) {
                continue;
            }
            let received = match route.attempt.as_deref() {
                Some(current) if current.starts_with(key.as_str()) => route.next_seq,
                _ => 0,
            };
            // Whose silence would mean the stream lost its processor: only an open one's.
            if *open {
                route.listed_by = Some(instance.clone());
            } else if route.listed_by.as_ref() == Some(&instance) {
                route.listed_by = None;
            }
            // The sync left after these records, through the same producer: what has not
            // arrived by now never will.
            if !route.broken && *published > received {
                gone.push((
                    id.clone(),
                    format!(
                        "{published} response records of this stream were published before its processor's sync and {received} arrived: the rest were lost in transit"
                    ),
                ));
            }
        }
        let foreign = self.foreign_records
            || self
                .stateless_sync
                .is_some_and(|at| now.saturating_duration_since(at) < STATELESS_FOR);
        let unlisted_deadline = if foreign {
            None
        } else {
            self.watch.unlisted_deadline()
        };
        for (id, route) in routes.iter() {
            if let Some(by) = &route.listed_by {
                if !self.watch.is_live(by)
                    && now.saturating_duration_since(route.last_seen) >= SILENT_AFTER
                {
                    gone.push((
                        id.clone(),
                        format!(
                            "the processor answering this request ({by}) stopped syncing {} s ago while others sync: it went away before the stream ended",
                            SILENT_AFTER.as_secs()
                        ),
                    ));
                }
            } else if !route.listed
                && !route.received_any
                && let (Some(stored), Some(deadline)) = (route.stored_at, unlisted_deadline)
                && stored <= deadline
            {
                gone.push((
                    id.clone(),
                    format!(
                        "the broker took the request but no processor did: every processor syncing on the response topic has taken requests for {} s since without listing it (dropped on its way to them)",
                        UNLISTED_GRACE.as_secs()
                    ),
                ));
            }
        }
        for (id, why) in gone {
            if let Some(route) = routes.remove(&id) {
                debug!(service, request_id = %id, reason = %why, "stream ended as lost");
                let _ = route.tx.send(Routed::Gone(why));
            }
        }
    }
}

#[cfg(test)]
mod tests;
