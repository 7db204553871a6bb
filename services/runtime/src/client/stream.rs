//! The caller's side of a request: its records in order, the time limits and losses that end
//! it, and the cancel its drop sends.

use std::time::Duration;

use sluice_schema::{ErrorKind, ResponseRecord};
use tokio::{sync::mpsc, time::Instant};
use tracing::warn;

use super::{
    ClientError,
    cancel::{CancelPublisher, cancel_when_ready},
    route::{Routed, Routes},
};
use crate::{
    bus::Position,
    lock,
    telemetry::{ClientOutcome, RuntimeMetrics},
};

/// An item of a response stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Received<R> {
    /// The next record.
    Record(R),
    /// The request is being attempted again (the processor handling it went away);
    /// records received before this belong to the abandoned attempt.
    Restarted,
}

/// The records of one request, in order, ending after the terminal record.
pub struct ResponseStream<R> {
    pub(super) id: String,
    pub(super) rx: mpsc::UnboundedReceiver<Routed<R>>,
    pub(super) routes: Routes<R>,
    pub(super) cancel: Option<CancelPublisher>,
    pub(super) metrics: Option<RuntimeMetrics>,
    pub(super) service: String,
    pub(super) inactivity: Duration,
    pub(super) total: Duration,
    pub(super) loss_grace: Duration,
    pub(super) started: Instant,
    pub(super) last: Instant,
    /// Since when the stream may have lost its next record (see [`Routed::Suspect`]).
    pub(super) suspect_since: Option<Instant>,
    pub(super) done: bool,
    /// A position on the response topic before every record of this request.
    pub(super) resume_after: Option<Position>,
    /// Stops a resumed stream's own reader when the stream is dropped.
    pub(super) _reading: Option<tokio_util::sync::DropGuard>,
}

impl<R: ResponseRecord> ResponseStream<R> {
    /// The request's correlation id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// A position on the response topic that comes before every record of this request: the
    /// last record the client had read when it sent it (`None`: none yet, the topic's oldest
    /// will do). Where [`RequestClient::resume`] starts reading.
    ///
    /// [`RequestClient::resume`]: super::RequestClient::resume
    pub fn resume_after(&self) -> Option<Position> {
        self.resume_after
    }

    /// The next item; `None` after the terminal record or an error.
    pub async fn next(&mut self) -> Option<Result<Received<R>, ClientError>> {
        loop {
            if self.done {
                return None;
            }
            let inactivity_deadline = self.last + self.inactivity;
            let total_deadline = self.started + self.total;
            let loss_deadline = self.suspect_since.map(|since| since + self.loss_grace);
            let deadline = inactivity_deadline
                .min(total_deadline)
                .min(loss_deadline.unwrap_or(total_deadline));
            let item = match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(item)) => item,
                Ok(None) => return self.finish(ClientOutcome::Failed, Err(ClientError::Closed)),
                Err(_) => {
                    // What the client knew of the request when it gave up: which of the
                    // loss rules (crate::sync) could not decide, and why.
                    if let Some(route) = lock(&self.routes).get(&self.id) {
                        warn!(service = %self.service, request_id = %self.id,
                              waited = ?self.started.elapsed(), state = %route.describe(),
                              "a stream ends at its time limit");
                    }
                    // The caller stops waiting: the service should stop working on it too.
                    cancel_when_ready(self.cancel.take(), self.id.clone());
                    let (outcome, error) = if Some(deadline) == loss_deadline {
                        (
                            ClientOutcome::Lost,
                            ClientError::StreamLost(self.loss_grace),
                        )
                    } else if deadline == total_deadline {
                        (
                            ClientOutcome::Timeout,
                            ClientError::TotalTimeout(self.total),
                        )
                    } else {
                        (
                            ClientOutcome::Timeout,
                            ClientError::InactivityTimeout(self.inactivity),
                        )
                    };
                    return self.finish(outcome, Err(error));
                }
            };
            if !matches!(item, Routed::Suspect) {
                self.suspect_since = None;
                self.last = Instant::now();
            }
            return match item {
                Routed::Suspect => {
                    // Only the first mark counts: the grace runs from the first drop noticed.
                    self.suspect_since.get_or_insert_with(Instant::now);
                    continue;
                }
                Routed::Lost { expected, received } => {
                    cancel_when_ready(self.cancel.take(), self.id.clone());
                    self.finish(
                        ClientOutcome::Lost,
                        Err(ClientError::RecordsLost { expected, received }),
                    )
                }
                Routed::Restarted => Some(Ok(Received::Restarted)),
                Routed::Gone(why) => {
                    cancel_when_ready(self.cancel.take(), self.id.clone());
                    self.finish(ClientOutcome::Lost, Err(ClientError::LostInTransit(why)))
                }
                Routed::Undecodable(e) => {
                    self.finish(ClientOutcome::Failed, Err(ClientError::Decode(e)))
                }
                Routed::NotStored(e) => {
                    self.finish(ClientOutcome::Failed, Err(ClientError::NotStored(e)))
                }
                Routed::Record(r) if r.is_terminal() => {
                    let outcome = if r.error().is_some() {
                        ClientOutcome::Error
                    } else {
                        ClientOutcome::Success
                    };
                    self.finish(outcome, Ok(Received::Record(r)))
                }
                Routed::Record(r) => Some(Ok(Received::Record(r))),
            };
        }
    }

    fn finish(
        &mut self,
        outcome: ClientOutcome,
        item: Result<Received<R>, ClientError>,
    ) -> Option<Result<Received<R>, ClientError>> {
        self.done = true;
        lock(&self.routes).remove(&self.id);
        if let Some(m) = &self.metrics {
            m.client_request(&self.service, outcome);
        }
        Some(item)
    }

    /// The records of the answer's final attempt, once the stream has ended, read by the
    /// reader's driver (see [`crate::reader::Records`]): those of an attempt that was started
    /// over are dropped at its restart; an error record is the last of them, where a
    /// [`crate::reader::Reader`] fails with it. For tests and benchmarks of the client itself;
    /// a service reads through a `Reader`.
    pub async fn collect(self) -> Result<Vec<R>, ClientError> {
        let policy = crate::reader::ReadPolicy::new(crate::reader::Report, |e| {
            e.as_error(ErrorKind::Internal)
        });
        crate::reader::Reader::new(self, policy)
            .drive(crate::reader::Records::default())
            .run()
            .await
    }

    /// Adapts this into a `futures::Stream`.
    pub fn into_stream(self) -> impl futures::Stream<Item = Result<Received<R>, ClientError>> {
        futures::stream::unfold(self, |mut s| async move { s.next().await.map(|i| (i, s)) })
    }
}

impl<R> Drop for ResponseStream<R> {
    fn drop(&mut self) {
        // A caller that stops listening (client disconnected) frees its route at once and
        // tells the service to stop working on it.
        if !self.done {
            lock(&self.routes).remove(&self.id);
            if let Some(m) = &self.metrics {
                m.client_request(&self.service, ClientOutcome::Cancelled);
            }
            cancel_when_ready(self.cancel.take(), self.id.clone());
        }
    }
}
