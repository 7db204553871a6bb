//! The syncs a processor publishing to a non-persistent response topic sends every second
//! (see [`crate::sync`]): the streams it answers, and whether it takes requests now.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use sluice_schema::properties;
use tokio::{sync::Semaphore, time::Duration};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::{
    bus::{Message, Publisher},
    store::StoreGuard,
    sync::StreamBook,
};

/// How often a processor publishing to a non-persistent response topic sends a sync (see
/// [`properties::SYNC`]).
pub const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// What a sync says about whether the processor takes requests now.
#[derive(Clone)]
pub(super) struct Taking {
    pub(super) slots: Arc<Semaphore>,
    /// The consume loop holds a slot and waits for the next request.
    pub(super) waiting: Arc<AtomicBool>,
    pub(super) store: StoreGuard,
    pub(super) shutdown: CancellationToken,
}

impl Taking {
    fn now(&self) -> bool {
        (self.waiting.load(Ordering::Relaxed) || self.slots.available_permits() > 0)
            && !self.store.is_blocked()
            && !self.shutdown.is_cancelled()
    }
}

/// Sends a sync through the response publisher every [`SYNC_INTERVAL`], idle or not.
///
/// Why: a client can see that the broker dropped records only when a later message of the
/// same producer arrives, and a request dropped on its way to the processors, or a stream
/// whose every record was dropped, leaves nothing later at all. The sync is that later
/// message, and what it lists (see [`crate::sync`]) tells a client which of its streams
/// cannot end any more. It goes through the same publisher, hence the same producer and
/// after every record counted in it. Idle processors sync too: a request dropped while they
/// were idle is seen only because they say they took nothing.
pub(super) async fn send_syncs(
    publisher: Arc<dyn Publisher>,
    processor: String,
    book: Arc<StreamBook>,
    taking: Taking,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(SYNC_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let state = book.snapshot(taking.now());
        let state = match serde_json::to_string(&state) {
            Ok(s) => s,
            Err(e) => {
                debug!(processor, error = %e, "a sync could not be encoded");
                continue;
            }
        };
        let sync = Message::new(&b"{}"[..])
            .with_property(properties::ID, properties::SYNC)
            .with_property(properties::SYNC, processor.as_str())
            .with_property(properties::SYNC_STATE, state);
        if let Err(e) = publisher.send(sync).await {
            debug!(processor, error = %e, "a sync could not be published");
        }
    }
}

#[cfg(test)]
mod tests;
