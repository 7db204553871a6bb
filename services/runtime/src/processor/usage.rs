//! The usage record of an attempt: written to the ledger before the request is settled, and
//! left in the ledger's backlog by a task dropped before it could write it.

use std::sync::Arc;

use sluice_schema::{ResponseRecord, usage::UsageRecord};
use tokio::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::ResponseSink;
use crate::{
    ledger::{AttemptEnd, Ledger, STORE_WAIT, UsageMeter},
    telemetry::Outcome,
};

/// What the usage record of an attempt needs when its task is dropped before writing it
/// (see [`handle_delivery`](super::delivery::handle_delivery)): on drop, unless disarmed, the record goes to the ledger's
/// backlog as `retried` (the request was not acked and comes back).
pub(super) struct Unwritten {
    pub(super) ledger: Arc<Ledger>,
    pub(super) id: String,
    pub(super) attempt: String,
    pub(super) trace_id: String,
    pub(super) key: Option<String>,
    pub(super) flow: Option<String>,
    pub(super) service: String,
    pub(super) started: Instant,
    pub(super) redelivery_count: u32,
    pub(super) meter: UsageMeter,
}

impl Unwritten {
    /// The attempt's usage record ending with `outcome` (and the terminal error's kind), or
    /// `None` when no provider call started on its meter (or the guard is disarmed).
    fn record(&self, outcome: &str, error: Option<&str>) -> Option<UsageRecord> {
        let end = AttemptEnd {
            id: &self.id,
            attempt: &self.attempt,
            trace_id: Some(&self.trace_id),
            key: self.key.as_deref(),
            flow: self.flow.as_deref(),
            service: &self.service,
            outcome,
            error,
            duration: self.started.elapsed(),
            redelivery_count: self.redelivery_count,
        };
        self.ledger.record_of(&end, &self.meter)
    }

    /// The record was written: nothing to do on drop.
    fn disarm(&mut self) {
        self.meter = UsageMeter::default();
    }
}

impl Drop for Unwritten {
    fn drop(&mut self) {
        if let Some(record) = self.record("retried", None) {
            self.ledger.enqueue(record);
        }
    }
}

/// Writes the attempt's usage record to the ledger, ending with what `outcome` was for the
/// usage (`retried` when the request is handed back: its records not stored (`flushed` is
/// false) or its stream not ended), then disarms `unwritten`.
pub(super) async fn write_usage<R: ResponseRecord>(
    unwritten: &mut Unwritten,
    outcome: Outcome,
    flushed: bool,
    sink: &ResponseSink<R>,
    abandon: &CancellationToken,
    span: &tracing::Span,
) {
    let handed_back = !(flushed && sink.is_ended());
    let usage = match outcome {
        _ if handed_back => "retried",
        Outcome::Error | Outcome::Malformed => "error",
        Outcome::Cancelled => "cancelled",
        Outcome::Retried => "retried",
        Outcome::Success | Outcome::Continued => "answered",
    };
    if let Some(record) = unwritten.record(usage, sink.error_kind()) {
        // Stored before the ack (see crate::ledger). Not waited for when the broker just
        // failed to store the records, nor once the drain grace has run out: the record
        // goes to the backlog at once and the request is settled.
        let wait = if !flushed || abandon.is_cancelled() {
            Duration::ZERO
        } else {
            STORE_WAIT
        };
        unwritten
            .ledger
            .write(&record, wait)
            .instrument(span.clone())
            .await;
    }
    unwritten.disarm();
}
