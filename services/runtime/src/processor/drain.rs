//! Draining on shutdown: no new request, the ones in flight finish within the drain grace,
//! and what did not finish is handed back to the broker for another replica.

use tokio::{
    task::{JoinHandle, JoinSet},
    time::Duration,
};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{info, warn};

use super::ProcessorConfig;
use crate::{bus::Subscription, telemetry::Telemetry};

/// How long unfinished requests get, once the drain grace has run out, to be handed back
/// (their held records flushed, their streams retracted, a nack sent) before their tasks are
/// dropped. Short: the handler is already gone, only the broker is waited for.
const HAND_BACK_BOUND: Duration = Duration::from_secs(5);

/// How long a stopping processor waits for its ledger's backlog to be stored.
pub(crate) const LEDGER_FLUSH_BOUND: Duration = Duration::from_secs(5);

/// Drains the request tasks in `tasks`: stops routing new work here and keeps settling what
/// is in flight for the drain grace; then `abandon` makes each unfinished task drop its
/// handler and hand its request back, within [`HAND_BACK_BOUND`].
pub(super) async fn drain(
    tasks: &mut JoinSet<()>,
    abandon: &CancellationToken,
    subscription: &mut dyn Subscription,
    config: &ProcessorConfig,
    telemetry: &Telemetry,
) {
    // Drain: stop routing new work here, keep settling what is in flight. One flow of many
    // going away leaves the process ready for the others.
    if config.flow.is_none() {
        telemetry.health.set_draining();
    }
    subscription.pause();
    let in_flight = tasks.len();
    info!(processor = %config.name, in_flight, grace = ?config.drain_grace, "draining");
    let drained = tokio::time::timeout(config.drain_grace, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!(processor = %config.name, abandoned = tasks.len(),
              "drain grace expired; handing unfinished requests back to the broker");
        abandon.cancel();
        let handed_back = tokio::time::timeout(HAND_BACK_BOUND, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if handed_back.is_err() {
            // Stuck on the broker: dropped unacked, the broker redelivers them all the same.
            tasks.shutdown().await;
        }
    }
}

/// The tasks beside the consume loop, stopped once the request subscription is closed.
pub(super) struct Background {
    /// Stops the cancel listener when dropped.
    pub(super) cancels_guard: DropGuard,
    pub(super) stop_syncs: CancellationToken,
    /// The syncs' task (a non-persistent response topic only).
    pub(super) syncs: Option<JoinHandle<()>>,
    /// The cancel listener (a cancel topic only).
    pub(super) cancel_listener: Option<JoinHandle<()>>,
}

impl Background {
    /// Stops the cancel listener and the syncs, and waits for both to end.
    pub(super) async fn stop(self) {
        let Self {
            cancels_guard,
            stop_syncs,
            syncs,
            cancel_listener,
        } = self;
        drop(cancels_guard);
        stop_syncs.cancel();
        if let Some(syncs) = syncs {
            let _ = syncs.await;
        }
        if let Some(listener) = cancel_listener {
            let _ = listener.await;
        }
    }
}

#[cfg(test)]
mod tests;
