//! The store guard: whether the broker stores what a processor publishes, and the probe that
//! waits until it does again.

use std::{sync::Arc, time::Duration};

use sluice_schema::properties;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    backoff::Backoff,
    bus::{BusError, Message, Publisher},
    telemetry::Telemetry,
};

/// Whether the broker stores what this processor publishes.
///
/// After a publish fails (a bookie turned read-only by a full disk, a quota, a topic that
/// refuses writes), every request taken would be answered by the provider and then handed
/// back unanswered, again and again: provider calls paid for nothing. So the processor takes
/// no new request, says why on `/readyz` and in `sluice_processor_store_blocked`, and probes
/// the broker with backoff until it stores again. Requests stay unacked on the broker
/// meanwhile; nothing is lost.
///
/// A block is probed as soon as it is set, whatever the consume loop is doing (see
/// [`StoreGuard::until_blocked`]): a loop that waited for the next request when a request
/// task's publish failed used to probe only once another request arrived. On a non-persistent
/// request topic the requests sent meanwhile may all have been dropped by the broker, so none
/// came, and the processor's syncs said for minutes that it took no request although the
/// broker stored again: its clients, which end a request no processor lists only while every
/// processor says it takes requests, waited out their inactivity timeouts (the secured
/// cluster, a broker's SIGKILL under load, 2026-12-07).
#[derive(Clone)]
pub(crate) struct StoreGuard {
    processor: String,
    telemetry: Telemetry,
    /// Whether the store is blocked; a watch so that the consume loop can wait for a block.
    blocked: Arc<tokio::sync::watch::Sender<bool>>,
}

/// The [`crate::telemetry::Health`] condition a blocked store sets.
const STORE_CONDITION: &str = "store";

/// Longest wait between probes of a broker that cannot store.
const STORE_PROBE_MAX_BACKOFF: Duration = Duration::from_secs(15);

/// How long a probe waits for the broker's receipt.
const STORE_PROBE_TIMEOUT: Duration = Duration::from_secs(30);

impl StoreGuard {
    pub(crate) fn new(processor: String, telemetry: Telemetry) -> Self {
        Self {
            processor,
            telemetry,
            blocked: Arc::new(tokio::sync::watch::Sender::new(false)),
        }
    }

    pub(crate) fn is_blocked(&self) -> bool {
        *self.blocked.borrow()
    }

    /// Resolves once the store is blocked (at once if it is). Cancel-safe: for a `select!`
    /// beside the wait for the next request.
    pub(crate) async fn until_blocked(&self) {
        let mut blocked = self.blocked.subscribe();
        // Never an error: `self` holds the sender.
        let _ = blocked.wait_for(|b| *b).await;
    }

    pub(crate) fn block(&self, error: &BusError) {
        // The gauge first: whoever sees /readyz change can count on the metric saying so too.
        self.telemetry.metrics.store_blocked(&self.processor, true);
        self.telemetry.health.fail(
            STORE_CONDITION,
            format!("the broker cannot store this processor's records: {error}"),
        );
        if !self.blocked.send_replace(true) {
            warn!(processor = %self.processor, error = %error,
                  "the broker cannot store records: taking no new request until it can");
        }
    }

    fn unblock(&self) {
        self.telemetry.metrics.store_blocked(&self.processor, false);
        self.telemetry.health.clear(STORE_CONDITION);
        if self.blocked.send_replace(false) {
            info!(processor = %self.processor, "the broker stores records again: taking requests");
        }
    }

    /// Probes until the broker stores a sync message on the response topic (which every
    /// client skips). Returns false when `shutdown` comes first.
    pub(crate) async fn wait_until_stored(
        &self,
        publisher: &dyn Publisher,
        shutdown: &CancellationToken,
    ) -> bool {
        let mut backoff = Backoff::new(STORE_PROBE_MAX_BACKOFF);
        loop {
            let probe = Message::new(&b"{}"[..])
                .with_property(properties::ID, properties::SYNC)
                .with_property(properties::SYNC, self.processor.as_str());
            let stored = tokio::select! {
                () = shutdown.cancelled() => return false,
                r = tokio::time::timeout(STORE_PROBE_TIMEOUT, async {
                    publisher.send(probe).await?.await
                }) => r.unwrap_or_else(|_| Err(BusError::Unavailable(format!(
                    "no receipt within {STORE_PROBE_TIMEOUT:?}"
                )))),
            };
            match stored {
                Ok(()) => {
                    self.unblock();
                    return true;
                }
                Err(e) => {
                    self.block(&e);
                    debug!(processor = %self.processor, error = %e, "store probe failed");
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }
}
