//! Telling the service to stop working on a request its caller gave up on (see
//! [`crate::cancel`]), also when the cancel publisher does not exist yet.

use std::{sync::Arc, time::Duration};

use tokio::sync::watch;
use tracing::warn;

use crate::bus::Publisher;

/// The publisher of cancels: `None` until it exists. Its sender is dropped without a value if
/// it cannot be made.
pub(super) type CancelPublisher = watch::Receiver<Option<Arc<dyn Publisher>>>;

/// How long a cancel waits for the cancel publisher that is still being made: beyond it, the
/// request it stands for has most likely ended anyway.
const CANCEL_PUBLISHER_WAIT: Duration = Duration::from_secs(30);

/// Publishes a cancel for `id` once the cancel publisher exists, without waiting: a stream
/// dropped while the publisher was still being made (the first seconds after start-up, on a
/// broker slow to look the topic up) is cancelled when it exists, not forgotten.
pub(super) fn cancel_when_ready(publisher: Option<CancelPublisher>, id: String) {
    let Some(mut publisher) = publisher else {
        return;
    };
    let ready = publisher.borrow().clone();
    if let Some(p) = ready {
        crate::cancel::send_cancel(p, id);
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let ready =
            tokio::time::timeout(CANCEL_PUBLISHER_WAIT, publisher.wait_for(Option::is_some))
                .await
                .ok()
                .and_then(|r| r.ok().and_then(|p| p.clone()));
        match ready {
            Some(p) => crate::cancel::send_cancel(p, id),
            None => warn!(request_id = %id,
                          "a cancel was not published: there is no cancel publisher"),
        }
    });
}

#[cfg(test)]
mod tests;
