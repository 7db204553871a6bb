//! The gateway's events (docs/protocol.md#gateway-events-ndjson-and-sse), written as NDJSON
//! lines or SSE events by the route: a `thinking` status first, each record's events as its
//! service's [`Kind`] says, a `restarted` status when the answer starts over, and a `done`
//! (after an `error` when the answer failed; alone, reason `cancelled`, when it was
//! cancelled) last.

use std::{marker::PhantomData, sync::Arc};

use super::Tally;
use crate::{
    events::{Event, EventType, Reason, Status},
    kinds::{Kind, StreamState},
};
use sluice_runtime::{
    reader::{Encoder, End, Out, Restartable},
    telemetry::ClientOutcome,
};

/// Records of service `K` in, gateway events out; their numbering (a resumed caller's skip)
/// is the route's, after this.
pub(crate) struct Events<K: Kind> {
    state: StreamState,
    /// Stamped on every event as it leaves.
    trace_id: Arc<str>,
    session_id: Arc<str>,
    tally: Tally,
    _kind: PhantomData<K>,
}

impl<K: Kind> Events<K> {
    /// An answer's events: an agent's steps as tokens when `steps`, each event stamped with
    /// `trace_id` and `session_id`, the stream counted by `tally`.
    pub(crate) fn new(steps: bool, trace_id: Arc<str>, session_id: Arc<str>, tally: Tally) -> Self {
        Self {
            state: StreamState {
                steps,
                ..StreamState::default()
            },
            trace_id,
            session_id,
            tally,
            _kind: PhantomData,
        }
    }

    /// The `done` event, with what the answer tallied.
    fn done(&mut self, reason: Reason, outcome: ClientOutcome, out: &mut Out<Event>) {
        let state = std::mem::take(&mut self.state);
        let mut done = Event::done(reason, state.usage, state.model);
        if let Some((expected, answered, pending)) = state.items {
            done.items_expected = Some(expected);
            done.items_answered = Some(answered);
            done.items_pending = pending;
        }
        if let Some((objects, skipped)) = state.counts {
            done.objects_emitted = Some(objects);
            done.lines_skipped = Some(skipped);
        }
        out.push(done);
        self.tally.ended(outcome);
    }
}

impl<K: Kind> Encoder<K::Response> for Events<K> {
    type Item = Event;
    type Done = ();

    fn begin(&mut self, out: &mut Out<Event>) {
        out.push(Event::status(Status::Thinking));
        // The opening status is the first phase's announcement: an agent's first thought
        // does not say `thinking` again (a status is sent when the phase changes).
        self.state.status = Some(Status::Thinking);
    }

    fn record(&mut self, record: K::Response, out: &mut Out<Event>) {
        K::note(&record, &mut self.state);
        let mut events = Vec::new();
        K::events(&record, &mut self.state, &mut events);
        for e in events {
            out.push(e);
        }
    }

    fn end(&mut self, end: End<K::Response>, out: &mut Out<Event>) {
        let Some(failure) = end.failure() else {
            self.done(Reason::Success, ClientOutcome::Success, out);
            return;
        };
        // An error record may still carry what the `done` event tells (a `jsonl` prompt's
        // counts).
        if let Some(r) = &failure.record {
            K::note(r, &mut self.state);
        }
        let outcome = ClientOutcome::of_error(&failure.error.kind);
        // A cancel is an end, not a failure: the event protocol ends a cancelled stream with
        // `done` (reason `cancelled`) alone, and its parser stops at the first `error`, which
        // would read the cancel as a failure (docs/protocol.md#gateway-events-ndjson-and-sse).
        if outcome == ClientOutcome::Cancelled {
            self.done(Reason::Cancelled, outcome, out);
            return;
        }
        out.push(Event::error(&failure.error));
        self.done(Reason::Error, outcome, out);
    }

    fn handed(&mut self, event: &mut Event, last: bool) {
        event.trace_id = self.trace_id.clone();
        event.session_id = self.session_id.clone();
        if event.kind != EventType::Status {
            self.tally.said();
        }
        if last {
            self.tally.delivered();
        }
    }
}

impl<K: Kind> Restartable<K::Response> for Events<K> {
    /// Another replica starts the answer over: the caller discards what it has.
    fn restarted(&mut self, out: &mut Out<Event>) {
        self.state.restart();
        out.push(Event::status(Status::Restarted));
    }
}
