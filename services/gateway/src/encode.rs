//! The gateway's stream encoders, one file per wire format: each turns the records of one
//! answer into what its caller is sent, driven by the runtime's driver
//! (`sluice_runtime::reader`, docs/architecture.md#one-way-to-read-a-response-stream), which
//! alone decides what a record, a restart and a failure do to the answer. A route is decode,
//! `preamble::start`, then `reader.drive(encoder)`; a new dialect is a new encoder here.
//!
//! - [`events::Events`]: the gateway's events, as NDJSON or SSE (`POST /api/v1/{service}`).
//! - [`records::RecordEvents`]: TrustGraph's streaming REST, each record an SSE event's data.
//! - [`chunks::Chunks`]: OpenAI's `chat.completion.chunk` events.
//! - [`frames::Frames`]: TrustGraph's WebSocket frames.
//! - [`lines::Lines`]: Ollama's NDJSON lines (`/api/chat`, `/api/generate`).
//! - [`messages::Messages`]: Anthropic's Messages stream events (`/v1/messages`).
//! - [`responses::ResponseEvents`]: OpenAI's Responses API semantic events (`/v1/responses`).
//!
//! An encoder never numbers what it emits: a resumable stream's event ids, and the events a
//! resuming caller already had, are the route's, applied to what is handed out. So what an
//! encoder emits is the same whether the caller resumes or not, and so is what the driver
//! counts as passed on (the rule of a restart under `StartOver`). An encoder never awaits and
//! never logs a payload.

pub(crate) mod chunks;
pub(crate) mod events;
pub(crate) mod frames;
pub(crate) mod lines;
pub(crate) mod messages;
pub(crate) mod records;
pub(crate) mod responses;

use std::{sync::Arc, time::Instant};

use axum::http::StatusCode;
use sluice_runtime::{telemetry::ClientOutcome, trace::Span};

use crate::{Inner, trace_outcome};

/// What one streamed answer counts, kept by its encoder and so dropped with it (at the end,
/// or when the caller goes away, a closed socket's aborted request included): the open
/// stream, the time to its first event, how it ended (a stream dropped before its end was
/// given up by its caller), and its span, which ends with it.
pub(crate) struct Tally {
    inner: Arc<Inner>,
    route: &'static str,
    /// When the request arrived: the first event's time is counted from it.
    started: Instant,
    /// Counted as an open stream (and so counted when it ends).
    open: bool,
    first_sent: bool,
    /// How the answer ended, once it did.
    outcome: Option<ClientOutcome>,
    /// Whether the caller was handed everything, the end included.
    delivered: bool,
    span: Span,
}

impl Tally {
    /// The tally of a stream that is not counted yet ([`Tally::open`] counts it): a route
    /// that may still answer an HTTP error instead.
    pub(crate) fn new(
        inner: Arc<Inner>,
        route: &'static str,
        started: Instant,
        span: Span,
    ) -> Self {
        Self {
            inner,
            route,
            started,
            open: false,
            first_sent: false,
            outcome: None,
            delivered: false,
            span,
        }
    }

    /// The tally of a stream counted open from now.
    pub(crate) fn opened(
        inner: Arc<Inner>,
        route: &'static str,
        started: Instant,
        span: Span,
    ) -> Self {
        let mut tally = Self::new(inner, route, started, span);
        tally.open();
        tally
    }

    /// Counts the stream open; it is counted again when it ends.
    pub(crate) fn open(&mut self) {
        if !self.open {
            self.open = true;
            self.inner.metrics.open_streams(self.route, 1);
        }
    }

    /// Something that says something (not a status) goes to the caller: the first counts
    /// the time to the first event.
    pub(crate) fn said(&mut self) {
        if !self.first_sent {
            self.first_sent = true;
            self.inner
                .metrics
                .first_event(self.route, self.started.elapsed().as_secs_f64());
        }
    }

    /// The answer ended so.
    pub(crate) fn ended(&mut self, outcome: ClientOutcome) {
        self.outcome = Some(outcome);
    }

    /// The caller was handed the last of the answer.
    pub(crate) fn delivered(&mut self) {
        self.delivered = true;
    }

    /// The answer is refused with `status` instead of being streamed: its span says so.
    pub(crate) fn refused(&mut self, status: StatusCode) {
        self.span.fail(status.as_str().to_owned());
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        self.inner.metrics.open_streams(self.route, -1);
        // Dropped before its end: the caller went away. The reader's own drop publishes the
        // cancel.
        let outcome = match self.outcome {
            Some(o) if self.delivered => o,
            _ => ClientOutcome::Cancelled,
        };
        self.inner.metrics.stream_ended(self.route, outcome);
        trace_outcome(&mut self.span, outcome);
    }
}

#[cfg(test)]
mod tests;
