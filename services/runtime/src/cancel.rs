//! Client cancellation: a client that stops listening (an HTTP caller hung up, a prompt
//! processor's own request was cancelled) tells the processor, which stops the handler and
//! with it the provider call, instead of paying for tokens nobody reads.
//!
//! The wire: a message with an empty payload and the request's `id` property on the
//! service's cancel topic (by default `notify:tg:<service>-cancel`). Every replica of the
//! service reads that topic on its own exclusive subscription, because any of them may be
//! holding the request. A cancel that arrives before its request (the request is still in the
//! backlog) is remembered for a while, so the request is answered `cancelled` without
//! calling the provider when it does arrive.
//!
//! TrustGraph processors do not read cancel topics; against them a cancel costs nothing and
//! changes nothing.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use sluice_schema::properties;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{
    bus::{Message, Publisher, Subscription},
    lock,
};

/// How long a cancel for a request not (yet) in flight is remembered.
const REMEMBER_FOR: Duration = Duration::from_secs(600);
/// At most this many early cancels are remembered; the oldest are forgotten first.
const REMEMBER_AT_MOST: usize = 100_000;

/// The cancel message for request `id`.
pub fn cancel_message(id: &str) -> Message {
    Message::new(Bytes::new()).with_property(properties::ID, id)
}

/// Publishes a cancel for `id` without waiting; failures are logged, not returned, because
/// the caller is usually a destructor and the worst outcome is a completion nobody reads.
pub fn send_cancel(publisher: Arc<dyn Publisher>, id: String) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let result = match publisher.send(cancel_message(&id)).await {
            Ok(receipt) => receipt.await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            warn!(request_id = %id, error = %e, "a cancel could not be published");
        }
    });
}

#[derive(Default)]
struct Inner {
    /// Requests in flight here: their cancel token and how many attempts share it.
    in_flight: HashMap<String, (CancellationToken, usize)>,
    /// Cancels that arrived for requests not in flight here, and when.
    early: HashMap<String, Instant>,
    early_order: VecDeque<(String, Instant)>,
}

impl Inner {
    fn forget_old(&mut self, now: Instant) {
        while let Some((id, at)) = self.early_order.front() {
            let too_many = self.early_order.len() > REMEMBER_AT_MOST;
            if !too_many && now.duration_since(*at) < REMEMBER_FOR {
                break;
            }
            if self.early.get(id) == Some(at) {
                self.early.remove(id);
            }
            self.early_order.pop_front();
        }
    }
}

/// Which requests are in flight in this process and which were cancelled early.
#[derive(Default, Clone)]
pub struct CancelRegistry {
    inner: Arc<Mutex<Inner>>,
}

impl CancelRegistry {
    /// Marks request `id` as in flight. `None` when its client already cancelled it.
    pub fn begin(&self, id: &str) -> Option<InFlight> {
        let mut inner = lock(&self.inner);
        inner.forget_old(Instant::now());
        if inner.early.remove(id).is_some() {
            return None;
        }
        let entry = inner
            .in_flight
            .entry(id.to_owned())
            .or_insert_with(|| (CancellationToken::new(), 0));
        entry.1 += 1;
        Some(InFlight {
            registry: self.clone(),
            id: id.to_owned(),
            token: entry.0.clone(),
        })
    }

    /// Cancels request `id`: stops it if in flight here, else remembers the cancel.
    pub fn cancel(&self, id: &str) {
        let mut inner = lock(&self.inner);
        if let Some((token, _)) = inner.in_flight.get(id) {
            token.cancel();
            return;
        }
        let now = Instant::now();
        inner.early.insert(id.to_owned(), now);
        inner.early_order.push_back((id.to_owned(), now));
        inner.forget_old(now);
    }

    /// Requests in flight (for tests).
    pub fn in_flight(&self) -> usize {
        lock(&self.inner).in_flight.len()
    }
}

/// A request in flight; unregisters on drop.
pub struct InFlight {
    registry: CancelRegistry,
    id: String,
    token: CancellationToken,
}

impl InFlight {
    /// Fires when the client cancels.
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut inner = lock(&self.registry.inner);
        if let Some(entry) = inner.in_flight.get_mut(&self.id) {
            entry.1 -= 1;
            if entry.1 == 0 {
                inner.in_flight.remove(&self.id);
            }
        }
    }
}

/// Reads cancels from `subscription` into `registry` until `stop`, then unsubscribes.
pub async fn listen(
    mut subscription: Box<dyn Subscription>,
    registry: CancelRegistry,
    stop: CancellationToken,
) {
    loop {
        let delivery = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            d = subscription.next() => d,
        };
        match delivery {
            Some(Ok(d)) => {
                if let Some(id) = d.property(properties::ID) {
                    debug!(request_id = %id, "cancel received");
                    registry.cancel(id);
                }
                d.ack();
            }
            Some(Err(e)) => warn!(error = %e, "receiving cancels failed"),
            None => break,
        }
    }
    subscription.unsubscribe().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_stops_every_attempt_in_flight_and_unregisters_on_drop() {
        let r = CancelRegistry::default();
        let a = r.begin("x").unwrap();
        let b = r.begin("x").unwrap();
        r.cancel("x");
        assert!(a.token().is_cancelled() && b.token().is_cancelled());
        drop(a);
        assert_eq!(r.in_flight(), 1);
        drop(b);
        assert_eq!(r.in_flight(), 0);
    }

    #[test]
    fn an_early_cancel_refuses_the_request_once() {
        let r = CancelRegistry::default();
        r.cancel("y");
        assert!(r.begin("y").is_none());
        // Remembered once: a later, new request with the same id runs.
        assert!(r.begin("y").is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn early_cancels_are_forgotten_after_a_while() {
        let r = CancelRegistry::default();
        r.cancel("z");
        tokio::time::advance(REMEMBER_FOR + Duration::from_secs(1)).await;
        r.cancel("other");
        assert!(r.begin("z").is_some());
        assert!(r.begin("other").is_none());
    }
}
