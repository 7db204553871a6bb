//! Settling a request once its records are flushed: acked when its terminal record is
//! stored, handed back to the broker (nack) otherwise, its stream retracted from the syncs
//! where the request comes back.

use sluice_schema::{ResponseRecord, topics::Persistence};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::{ProcessorConfig, ResponseSink, delivery::Shared};
use crate::{
    bus::{BusError, Delivery},
    telemetry::Outcome,
};

/// Whether a nacked request comes back. Where the broker keeps requests, a nack brings the
/// request back for another attempt; on a non-persistent request topic it is gone, and its
/// stream stays listed (finished, with what was published) so that its client sees the loss
/// at once.
pub(super) fn requests_come_back(config: &ProcessorConfig) -> bool {
    !Persistence::of(&config.request_topic).is_lossy()
}

/// Acks `delivery` when `sink` ended and its records were stored (`flushed`), and hands it
/// back otherwise; counts the request as finished with `outcome` (as retried when handed
/// back).
pub(super) async fn settle<R: ResponseRecord>(
    delivery: Delivery,
    sink: &mut ResponseSink<R>,
    flushed: Result<(), BusError>,
    outcome: Outcome,
    started: Instant,
    shared: &Shared,
) {
    let (config, metrics) = (&shared.config, &shared.telemetry.metrics);
    let processor = config.name.as_str();
    let requests_come_back = requests_come_back(config);
    match flushed {
        Ok(()) if sink.is_ended() => {
            delivery.ack();
            metrics.request_finished(processor, outcome, started.elapsed().as_secs_f64());
            debug!(records = sink.records_sent(), "request done");
        }
        Ok(()) if outcome == Outcome::Retried => {
            warn!("unfinished when the drain grace ran out; handing the request back");
            hand_back(delivery, sink, requests_come_back).await;
            metrics.request_finished(processor, Outcome::Retried, 0.0);
        }
        Ok(()) => {
            warn!("no terminal record could be published; handing the request back");
            hand_back(delivery, sink, requests_come_back).await;
            metrics.request_finished(processor, Outcome::Retried, 0.0);
        }
        Err(e) => {
            warn!(error = %e, "publishing failed; handing the request back for another attempt");
            // Blocked above, before the nack: the redelivered request must find the consume
            // loop already waiting for the broker, not calling the provider again.
            hand_back(delivery, sink, requests_come_back).await;
            metrics.request_finished(processor, Outcome::Retried, 0.0);
        }
    }
}

/// Hands the request back to the broker. Where it comes back (a durable request topic), its
/// records so far are retracted for the next attempt; where it does not (non-persistent), a
/// stream not ended is listed as abandoned, so its client ends it as lost.
async fn hand_back<R: ResponseRecord>(
    delivery: Delivery,
    sink: &mut ResponseSink<R>,
    requests_come_back: bool,
) {
    if requests_come_back {
        sink.retract().await;
    } else if !sink.is_ended() {
        sink.abandon().await;
    }
    delivery.nack();
}
