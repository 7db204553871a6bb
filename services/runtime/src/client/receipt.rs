//! A request's receipt: waited for after the request was handed back to its caller, to mark
//! it stored, publish it again after an outage, or end the caller's wait.

use std::sync::Arc;

use tokio::time::Instant;
use tracing::{debug, warn};

use super::route::{Routed, Routes};
use crate::{
    bus::{BusError, Message, Publisher},
    lock,
};

/// How many times a request whose receipt failed for an outage is published again.
const RESENDS_ON_LOST_RECEIPT: u32 = 3;

/// Waits for a request's receipt: marks the route stored, or, when the broker did not confirm
/// it, publishes the request again or ends the caller's wait.
///
/// A receipt that fails for an outage (the broker owning the topic died, and the producer's
/// pending message was never acknowledged) does not say whether the message was stored. While
/// no record of the request has arrived, it is published again under the same id, up to
/// [`RESENDS_ON_LOST_RECEIPT`] times: if the first copy was stored after all, the request is
/// attempted twice, which the stream reads as one restart (at-least-once, as a redelivery
/// would). A refusal (`BusError::Denied`) is final: sending it again would be refused too.
pub(super) async fn confirm_stored<R>(
    mut receipt: crate::bus::Receipt,
    message: Message,
    publisher: Arc<dyn Publisher>,
    routes: Routes<R>,
    id: String,
) {
    let mut resent = 0;
    loop {
        let error = match receipt.await {
            // From here a processor's sync must list it (see crate::sync).
            Ok(()) => {
                if let Some(route) = lock(&routes).get_mut(&id) {
                    route.stored_at = Some(Instant::now());
                }
                return;
            }
            Err(e) => e,
        };
        // A record proves the request was stored; a route that is gone has no caller left.
        let unanswered = lock(&routes)
            .get(&id)
            .is_some_and(|route| !route.received_any && !route.listed);
        let error = if matches!(error, BusError::Unavailable(_))
            && unanswered
            && resent < RESENDS_ON_LOST_RECEIPT
        {
            resent += 1;
            warn!(request_id = %id, error = %error, resent,
                  "the broker did not confirm it stored a request; publishing it again");
            match publisher.send(message.clone()).await {
                Ok(next) => {
                    receipt = next;
                    continue;
                }
                Err(e) => e,
            }
        } else {
            error
        };
        if !unanswered {
            // Answered (or abandoned by its caller): the receipt no longer matters.
            debug!(request_id = %id, error = %error, "a request's receipt failed after it was answered");
            return;
        }
        warn!(request_id = %id, error = %error, "a request was not stored by the broker");
        // End the caller's wait now rather than at its timeout.
        if let Some(route) = lock(&routes).remove(&id) {
            let _ = route.tx.send(Routed::NotStored(error.to_string()));
        }
        return;
    }
}

#[cfg(test)]
mod tests;
