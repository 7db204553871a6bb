//! TrustGraph's streaming spec's REST streaming (docs/specs.md#trustgraphs-streaming-spec):
//! each response record as one SSE event's data, an error as the error record that ends the
//! stream, and a restart (another replica starts the answer over) as an event named
//! `restarted`, whose reader discards what arrived so far.

use std::marker::PhantomData;

use axum::response::sse;
use sluice_runtime::{
    reader::{Encoder, End, Out, Restartable},
    telemetry::ClientOutcome,
};
use sluice_schema::{Error, ErrorKind, ResponseRecord};

use super::Tally;
use crate::kinds::Kind;

/// Records of service `K` in, SSE events out; their numbering is the route's, after this.
pub(crate) struct RecordEvents<K: Kind> {
    tally: Tally,
    _kind: PhantomData<K>,
}

impl<K: Kind> RecordEvents<K> {
    /// An answer's records as events, the stream counted by `tally`.
    pub(crate) fn new(tally: Tally) -> Self {
        Self {
            tally,
            _kind: PhantomData,
        }
    }

    /// The event whose data is `record`: a record said something to the caller.
    fn event(&mut self, record: &K::Response) -> sse::Event {
        self.tally.said();
        let data = serde_json::to_string(record).unwrap_or_else(|e| {
            // Serialising a record cannot fail (its maps have string keys); if it ever does,
            // the caller reads an error record in its place.
            serde_json::to_string(&K::Response::from_error(Error::new(
                ErrorKind::Internal,
                e.to_string(),
            )))
            .unwrap_or_default()
        });
        sse::Event::default().data(data)
    }
}

impl<K: Kind> Encoder<K::Response> for RecordEvents<K> {
    type Item = sse::Event;
    type Done = ();

    fn record(&mut self, record: K::Response, out: &mut Out<sse::Event>) {
        if record.is_terminal() {
            self.tally.ended(ClientOutcome::Success);
        }
        let event = self.event(&record);
        out.push(event);
    }

    fn end(&mut self, end: End<K::Response>, out: &mut Out<sse::Event>) {
        let Some(failure) = end.failure() else {
            return;
        };
        self.tally
            .ended(ClientOutcome::of_error(&failure.error.kind));
        // The service's own error record as it sent it; a failure of the gateway's side as
        // the error record it stands for.
        let record = match failure.record {
            Some(r) if r.error().is_some() => r,
            _ => K::Response::from_error(failure.error),
        };
        let event = self.event(&record);
        out.push(event);
    }

    fn handed(&mut self, _: &mut sse::Event, last: bool) {
        if last {
            self.tally.delivered();
        }
    }
}

impl<K: Kind> Restartable<K::Response> for RecordEvents<K> {
    fn restarted(&mut self, out: &mut Out<sse::Event>) {
        out.push(sse::Event::default().event("restarted").data("{}"));
    }
}
