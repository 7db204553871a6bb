//! The driver: a [`Reader`] and an [`Encoder`], run to the end or pulled (see the reader's
//! module documentation). The one place that decides what a record, a restart and a failure
//! do to an answer.

use std::{collections::VecDeque, convert::Infallible, future::Future, time::Duration};

use sluice_schema::ResponseRecord;

use super::{Arrived, Failure, Reader, Restarts};
use crate::sink::{ResponseSink, SinkError};

/// Turns the records of one answer into what its caller is sent (see the reader's module
/// documentation). Its methods are not async: an encoder only computes; the driver sends.
pub trait Encoder<R> {
    /// What the caller is sent: a record to publish, an event, a frame, bytes.
    /// `std::convert::Infallible` for an encoder that only reads the answer.
    type Item;
    /// What [`Encoder::end`] returns: the result of a run to the end.
    type Done;

    /// Called once, when the driver is made: may emit what goes before the first record.
    fn begin(&mut self, _out: &mut Out<Self::Item>) {}

    /// A record of the answer, carrying no error; the terminal one too, after which
    /// [`Encoder::end`] follows with [`End::Answered`].
    fn record(&mut self, record: R, out: &mut Out<Self::Item>);

    /// The answer ended (see [`End`]); called exactly once, nothing is read after it.
    fn end(&mut self, end: End<R>, out: &mut Out<Self::Item>) -> Self::Done;

    /// `item` leaves for the caller: pulled from the stream, or about to be sent to the sink;
    /// `last` when the answer has ended and nothing else is to follow it. Keep-alives are not
    /// items and are not shown here.
    fn handed(&mut self, _item: &mut Self::Item, _last: bool) {}
}

/// An encoder that can be told of a restart: what a reader under [`super::Report`] or
/// [`super::StartOver`] needs. A reader under [`super::Fail`] takes encoders without it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be told of a restart, which this reader's policy gives it",
    note = "implement `Restartable` for it, or read under `Fail`"
)]
pub trait Restartable<R>: Encoder<R> {
    /// The answer starts over: the records given so far belong to an abandoned attempt.
    fn restarted(&mut self, out: &mut Out<Self::Item>);
}

/// How an answer ended, as [`Encoder::end`] is told.
#[derive(Debug)]
pub enum End<R> {
    /// Its terminal record arrived (and was given to [`Encoder::record`]).
    Answered,
    /// It failed: an error record of the service (in [`Failure::record`], with its usage),
    /// a client-side failure, or a restart the policy ends the answer at.
    Failed(Failure<R>),
    /// The caller's own total time for it ran out
    /// ([`crate::client::RequestOptions::total_timeout`]); the failure says so in the caller's
    /// words, for a caller that answers it as any other.
    Deadline(Failure<R>),
}

impl<R> End<R> {
    /// The failure, a deadline's included; `None` when the answer arrived.
    pub fn failure(self) -> Option<Failure<R>> {
        match self {
            End::Answered => None,
            End::Failed(f) | End::Deadline(f) => Some(f),
        }
    }
}

/// Where an encoder puts what its caller is sent, in order.
#[derive(Debug)]
pub struct Out<T>(VecDeque<T>);

impl<T> Out<T> {
    fn new() -> Self {
        Self(VecDeque::new())
    }

    /// Emits `item`, after what was emitted before it.
    pub fn push(&mut self, item: T) {
        self.0.push_back(item);
    }

    /// How many items wait to be handed out.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no item waits to be handed out.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn pop(&mut self) -> Option<T> {
        self.0.pop_front()
    }
}

/// Where [`Driven::send_to`] sends an encoder's items: a processor's response sink, a channel.
pub trait Emit<T> {
    /// Why an item could not be sent; the run stops at the first.
    type Error;

    /// Sends `item`.
    fn emit(&mut self, item: T) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

impl<R: ResponseRecord> Emit<R> for ResponseSink<R> {
    type Error = SinkError;

    fn emit(&mut self, item: R) -> impl Future<Output = Result<(), SinkError>> + Send {
        self.send(item)
    }
}

impl<T: Send> Emit<T> for tokio::sync::mpsc::Sender<T> {
    type Error = tokio::sync::mpsc::error::SendError<T>;

    fn emit(&mut self, item: T) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.send(item)
    }
}

/// The sink of an encoder that emits nothing.
struct Nowhere;

impl Emit<Infallible> for Nowhere {
    type Error = Infallible;

    async fn emit(&mut self, item: Infallible) -> Result<(), Infallible> {
        match item {}
    }
}

/// Where a driven answer is. The reader is not boxed for the size of the ended state: a
/// `Driven` is made once per answer and moved at most once, into the stream that pulls it.
#[allow(clippy::large_enum_variant)]
enum Stage<R, P, D> {
    Reading(Reader<R, P>),
    /// The answer ended: the reader is gone (the stream finished, or was dropped after a
    /// failure), and this is what the encoder's `end` returned.
    Ended(D),
}

/// A [`Reader`] driven through an encoder (see the reader's module documentation): run it to
/// the end with [`Driven::send_to`] or [`Driven::run`], or pull its items with
/// [`Driven::next`] or [`Driven::into_stream`]. Dropped before its end, it drops the encoder
/// and the reader, which tells the service to stop.
pub struct Driven<R, P, E: Encoder<R>> {
    stage: Stage<R, P, E::Done>,
    encoder: E,
    out: Out<E::Item>,
    keep_alive: Option<KeepAlive<E::Item>>,
}

/// What a pulled answer hands out on silence, and after how long.
struct KeepAlive<T> {
    every: Duration,
    item: fn() -> T,
}

impl<R, P, E> Driven<R, P, E>
where
    R: ResponseRecord,
    E: Encoder<R>,
    P: Restarts<R, E>,
{
    pub(super) fn new(mut reader: Reader<R, P>, mut encoder: E) -> Self {
        let mut out = Out::new();
        encoder.begin(&mut out);
        reader.committed |= !out.is_empty();
        Self {
            stage: Stage::Reading(reader),
            encoder,
            out,
            keep_alive: None,
        }
    }

    /// The encoder, e.g. to give it what it tallies once the answer is known to start.
    pub fn encoder_mut(&mut self) -> &mut E {
        &mut self.encoder
    }

    /// With `item()` handed out by [`Driven::next`] whenever nothing arrived for `every` (an
    /// SSE comment, so that proxies see traffic). Not for the run to the end.
    pub fn keep_alive(mut self, every: Duration, item: fn() -> E::Item) -> Self {
        self.keep_alive = Some(KeepAlive { every, item });
        self
    }

    /// What arrived, through the policy, to the encoder: the one place deciding what a
    /// record, a restart and a failure do.
    fn take(&mut self, arrived: Option<Arrived<R>>) {
        let Stage::Reading(reader) = &mut self.stage else {
            return;
        };
        let end = match arrived {
            Some(Arrived::Record(r)) => {
                let terminal = r.is_terminal();
                self.encoder.record(r, &mut self.out);
                reader.committed |= !self.out.is_empty();
                if !terminal {
                    return;
                }
                End::Answered
            }
            Some(Arrived::Restarted) => {
                let decided =
                    reader
                        .on_restart
                        .restart(reader.committed, &mut self.encoder, &mut self.out);
                match decided {
                    Ok(()) => {
                        reader.committed |= !self.out.is_empty();
                        return;
                    }
                    Err(e) => End::Failed(Failure::new(e)),
                }
            }
            Some(Arrived::Failed(f)) if f.is_deadline() => End::Deadline(f),
            Some(Arrived::Failed(f)) => End::Failed(f),
            None => End::Failed(Failure::unfinished()),
        };
        let done = self.encoder.end(end, &mut self.out);
        // The reader goes: a stream that ended is finished; one that failed on a policy's
        // decision tells the service to stop.
        self.stage = Stage::Ended(done);
    }

    /// The next item waiting, handed out.
    fn hand(&mut self) -> Option<E::Item> {
        let mut item = self.out.pop()?;
        let last = matches!(self.stage, Stage::Ended(_)) && self.out.is_empty();
        self.encoder.handed(&mut item, last);
        Some(item)
    }

    /// The next item for the caller (or the keep-alive, after a silence); `None` once the
    /// answer ended and everything was handed out.
    ///
    /// Cancel-safe: dropping the future loses nothing (the record being waited for stays in
    /// the stream).
    pub async fn next(&mut self) -> Option<E::Item> {
        loop {
            if let Some(item) = self.hand() {
                return Some(item);
            }
            let Stage::Reading(reader) = &mut self.stage else {
                return None;
            };
            let arrived = match &self.keep_alive {
                Some(k) => match tokio::time::timeout(k.every, reader.arrived()).await {
                    Ok(arrived) => arrived,
                    Err(_) => return Some((k.item)()),
                },
                None => reader.arrived().await,
            };
            self.take(arrived);
        }
    }

    /// The items as a stream (an HTTP body's): see [`Driven::next`].
    pub fn into_stream(self) -> impl futures::Stream<Item = E::Item> {
        futures::stream::unfold(self, |mut driven| async move {
            driven.next().await.map(|item| (item, driven))
        })
    }

    /// Reads until the encoder emitted something: then this, its items still to be handed
    /// out; or, when the answer ended before anything was emitted, what the encoder's `end`
    /// returned (a route answers an error status instead of starting a stream).
    pub async fn start(mut self) -> Result<Self, E::Done> {
        loop {
            if !self.out.is_empty() {
                return Ok(self);
            }
            match self.stage {
                Stage::Ended(done) => return Err(done),
                Stage::Reading(ref mut reader) => {
                    let arrived = reader.arrived().await;
                    self.take(arrived);
                }
            }
        }
    }

    /// Runs the answer to its end, sending each item to `sink` as soon as it is made; what the
    /// encoder's `end` returned, or the first error of the sink (the answer is then dropped,
    /// which tells the service to stop).
    pub async fn send_to<S: Emit<E::Item>>(mut self, sink: &mut S) -> Result<E::Done, S::Error> {
        loop {
            while let Some(item) = self.hand() {
                sink.emit(item).await?;
            }
            match self.stage {
                Stage::Ended(done) => return Ok(done),
                Stage::Reading(ref mut reader) => {
                    let arrived = reader.arrived().await;
                    self.take(arrived);
                }
            }
        }
    }

    /// Runs the answer to its end through an encoder that emits nothing: what its `end`
    /// returned.
    pub async fn run(self) -> E::Done
    where
        E: Encoder<R, Item = Infallible>,
    {
        let Ok(done) = self.send_to(&mut Nowhere).await;
        done
    }
}

#[cfg(test)]
mod tests;
