//! Reading a response stream the one way every caller of a service needs: a [`Reader`] under a
//! restart policy, driven to its end by [`Reader::drive`] through an [`Encoder`] that says only
//! what a record becomes for its caller.
//!
//! A [`ResponseStream`] hands out what arrived: records, restart markers (the processor
//! answering went away and another started the request over) and client-side failures (a time
//! limit, a loss, the bus). What to do with each is the same question for every caller: may a
//! restart be shown, or must it end the answer; what error record does a failure become; where
//! is the usage of an error record; when is the stream over. The gateway's routes, the prompt
//! service and the agent each answered it in a loop of their own, and every new feature became
//! a branch in every loop. The driver answers it once; a caller is an encoder.
//!
//! # The parts
//!
//! - A [`Reader<R, P>`] is a response stream under a restart policy chosen by its type `P`:
//!   - [`Report`] gives a restart to the encoder and reads on (the gateway's NDJSON and SSE
//!     events and TrustGraph's WebSocket show it to their callers; the agent's native turn and
//!     the tools drop what they had);
//!   - [`StartOver`] gives it to the encoder while the encoder has emitted nothing, and ends
//!     the answer with its error after that: what was passed on cannot be taken back (the
//!     prompt service, OpenAI's routes);
//!   - [`Fail`] ends the answer at a restart (the ReAct agent: its parser already acted on the
//!     abandoned attempt).
//!
//!   Under `Report` and `StartOver` the encoder must also be [`Restartable`]; under `Fail` it
//!   need not be, and nothing can give it a restart: there is no restart branch to write, nor
//!   one left dead ([`Restarts`] says which encoders a policy takes).
//! - An [`Encoder<R>`] is told each record without an error ([`Encoder::record`], the terminal
//!   one included) and then, once, how the answer ended ([`Encoder::end`] with an [`End`]):
//!   [`End::Answered`]; [`End::Failed`] with a [`Failure`] carrying the error in the caller's
//!   words and, when the called service sent one, its error record with the usage counts; or
//!   [`End::Deadline`] when the caller's own total time ran out
//!   ([`crate::client::RequestOptions::total_timeout`]). It writes what its caller is sent
//!   (records to publish, events, frames, bytes) to an [`Out`], and whatever it emitted counts
//!   as passed on (what `StartOver` asks). [`Encoder::begin`] may emit before the first record,
//!   and [`Encoder::handed`] sees each item leave.
//! - A [`Driven`] is a reader and its encoder, used in one of two forms:
//!   - run to the end: [`Driven::send_to`] publishes each item to an [`Emit`] (a processor's
//!     [`crate::processor::ResponseSink`], a channel to a socket) as soon as it is made and
//!     returns what the encoder's `end` returned; [`Driven::run`] does the same for an encoder
//!     that emits nothing (`Item = Infallible`);
//!   - pulled: [`Driven::next`] and [`Driven::into_stream`] hand the items to whoever pulls (an
//!     HTTP body), with [`Driven::keep_alive`] for an item to send on silence, and
//!     [`Driven::start`] to wait for the first item first, so that a failure before anything
//!     was emitted can still be answered otherwise (an HTTP error status). The encoder lives
//!     as long as the stream: when the caller goes away, it is dropped (with whatever it
//!     tallies) and the reader with it, which tells the service to stop.
//! - Helpers over the driver, for callers that want an answer and not a stream:
//!   [`Reader::last`] (the terminal record), [`Reader::text`] and [`Reader::whole`] (a text
//!   completion's text, tool calls and usage, assembled in one place: [`Whole`]).
//! - A client-side failure becomes an error record by one function, the policy's
//!   [`ReadPolicy::client_error`]: [`ClientError::to_error`] for a service calling another
//!   ("text-completion did not answer in time: ..."), [`ClientError::as_error`] for a caller
//!   that names the service itself (a tool's observation), or a front end's own wording for its
//!   clients (the gateway's, as one function).
//!
//! # Guarantees
//!
//! - An encoder's `end` is called exactly once, and nothing is read after it; the terminal
//!   record reaches `record` before `end(Answered)`; a record carrying an error never reaches
//!   `record` (it is the failure's).
//! - A restart reaches an encoder only under `Report`, or under `StartOver` before it emitted.
//! - Every record's token counts reach the reader's [`Meter`], those of abandoned attempts
//!   and of an error record included.
//! - Dropped before its end, a reader tells the service to stop working on the request, as
//!   its stream does.
//!
//! A reader never retries, never reads past the end, and never logs a payload.

use sluice_schema::{Error, ErrorKind, ResponseRecord};

use crate::client::{ClientError, Received, RequestClient, RequestOptions, ResponseStream};

mod drive;
mod whole;

pub use drive::{Driven, Emit, Encoder, End, Out, Restartable};
pub use whole::{Collect, Last, ReadWhole, Records, Whole};

/// A restart policy: what a [`Reader`] does when the answer is started over, for encoders of
/// type `E`. Sealed: [`Report`], [`StartOver`] and [`Fail`].
///
/// Which encoders a reader takes is decided by its policy's type. An encoder that knows no
/// restart drives a reader under [`Fail`]:
///
/// ```
/// use std::convert::Infallible;
/// use sluice_runtime::reader::{Encoder, End, Fail, Out, Reader};
/// use sluice_schema::TextCompletionResponse as R;
///
/// struct Strict;
/// impl Encoder<R> for Strict {
///     type Item = Infallible;
///     type Done = ();
///     fn record(&mut self, _: R, _: &mut Out<Infallible>) {}
///     fn end(&mut self, _: End<R>, _: &mut Out<Infallible>) {}
/// }
/// fn drive(reader: Reader<R, Fail>) {
///     let _ = reader.drive(Strict);
/// }
/// ```
///
/// and cannot drive one under [`Report`] (nor [`StartOver`]), which would give it a restart:
///
/// ```compile_fail,E0277
/// use std::convert::Infallible;
/// use sluice_runtime::reader::{Encoder, End, Out, Reader, Report};
/// use sluice_schema::TextCompletionResponse as R;
///
/// struct Strict;
/// impl Encoder<R> for Strict {
///     type Item = Infallible;
///     type Done = ();
///     fn record(&mut self, _: R, _: &mut Out<Infallible>) {}
///     fn end(&mut self, _: End<R>, _: &mut Out<Infallible>) {}
/// }
/// fn drive(reader: Reader<R, Report>) {
///     let _ = reader.drive(Strict);
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "a reader under `{Self}` gives restarts to its encoder: `{E}` must implement `Restartable`",
    label = "this reader's restart policy"
)]
pub trait Restarts<R, E: Encoder<R>>: sealed::Policy {
    /// Decides a restart: gives it to `encoder` (which may emit into `out`) and reads on, or
    /// the error that ends the answer. `emitted`: the encoder has emitted something already.
    fn restart(&self, emitted: bool, encoder: &mut E, out: &mut Out<E::Item>) -> Result<(), Error>;
}

mod sealed {
    /// Only this module's policies are policies.
    pub trait Policy: Send + Sync + 'static {}
    impl Policy for super::Report {}
    impl Policy for super::StartOver {}
    impl Policy for super::Fail {}
}

/// Restart policy: the encoder is told ([`Restartable::restarted`]) and reading goes on.
#[derive(Debug, Clone, Copy, Default)]
pub struct Report;

/// Restart policy: the encoder is told while it has emitted nothing; after that, the answer
/// ends with this error (what was passed on cannot be taken back).
#[derive(Debug, Clone)]
pub struct StartOver(pub Error);

/// Restart policy: the answer ends with this error at its first restart; the encoder is never
/// told of one.
#[derive(Debug, Clone)]
pub struct Fail(pub Error);

impl<R, E: Restartable<R>> Restarts<R, E> for Report {
    fn restart(&self, _: bool, encoder: &mut E, out: &mut Out<E::Item>) -> Result<(), Error> {
        encoder.restarted(out);
        Ok(())
    }
}

impl<R, E: Restartable<R>> Restarts<R, E> for StartOver {
    fn restart(&self, emitted: bool, encoder: &mut E, out: &mut Out<E::Item>) -> Result<(), Error> {
        if emitted {
            return Err(self.0.clone());
        }
        encoder.restarted(out);
        Ok(())
    }
}

impl<R, E: Encoder<R>> Restarts<R, E> for Fail {
    fn restart(&self, _: bool, _: &mut E, _: &mut Out<E::Item>) -> Result<(), Error> {
        Err(self.0.clone())
    }
}

/// How a [`Reader`] reads: its restart policy, and the error record a client-side failure
/// (timeout, loss, bus) becomes in the caller's words.
#[derive(Debug, Clone)]
pub struct ReadPolicy<P> {
    /// What a restart does.
    pub on_restart: P,
    /// The error record a client-side failure becomes: the one mapping of a [`ClientError`]
    /// for this caller ([`ClientError::to_error`] for a service calling another,
    /// [`ClientError::as_error`] for a caller that names the service itself, the gateway's
    /// own wording for its HTTP clients).
    pub client_error: fn(&ClientError) -> Error,
}

impl<P> ReadPolicy<P> {
    /// Reads under `on_restart`, wording client-side failures with `client_error`.
    pub fn new(on_restart: P, client_error: fn(&ClientError) -> Error) -> Self {
        Self {
            on_restart,
            client_error,
        }
    }

    /// The failure a client-side error is.
    pub fn failure<R>(&self, e: ClientError) -> Failure<R> {
        Failure {
            error: (self.client_error)(&e),
            record: None,
            client: Some(e),
        }
    }
}

/// Why a read stream ended without its answer.
#[derive(Debug)]
pub struct Failure<R> {
    /// The error to answer with.
    pub error: Error,
    /// The terminal error record the called service sent, with its usage counts, when the
    /// failure was the service's own.
    pub record: Option<R>,
    /// The client-side failure, when it was one.
    pub client: Option<ClientError>,
}

impl<R> Failure<R> {
    fn new(error: Error) -> Self {
        Self {
            error,
            record: None,
            client: None,
        }
    }

    /// The failure of a stream that ended without its terminal record: a guard, not a path (a
    /// response stream ends with its terminal record or a client-side failure).
    fn unfinished() -> Self {
        Self::new(Error::new(
            ErrorKind::Internal,
            "the answer ended without a final record",
        ))
    }

    /// True when the caller's own total time for the answer ran out
    /// ([`ClientError::TotalTimeout`]).
    pub fn is_deadline(&self) -> bool {
        matches!(self.client, Some(ClientError::TotalTimeout(_)))
    }
}

/// What the stream gave, before the restart policy is applied.
enum Arrived<R> {
    Record(R),
    Restarted,
    Failed(Failure<R>),
}

/// A response stream read under a [`ReadPolicy`] (see the module's documentation). Dropped
/// before its end (after a failure it decided on, or when its caller goes away), it tells the
/// service to stop working on the request, as its stream does.
pub struct Reader<R, P> {
    stream: ResponseStream<R>,
    on_restart: P,
    client_error: fn(&ClientError) -> Error,
    /// Something of the answer was passed on (emitted by the encoder).
    committed: bool,
    done: bool,
    meter: Option<Box<dyn Meter>>,
}

/// Told the token counts of every record a [`Reader`] receives, those of abandoned attempts
/// and of an error record included (a provider bills them all), and dropped with the reader:
/// the gateway settles a caller's reserved tokens with it, whichever way the stream ends.
pub trait Meter: Send {
    /// A record's token deltas (input, output).
    fn tokens(&mut self, input: u64, output: u64);

    /// The answer's terminal record (or its terminal error record) arrived: the counts are
    /// complete. Not called when the stream ends otherwise (a timeout, the caller gone).
    fn ended(&mut self) {}
}

impl<R: ResponseRecord, P> Reader<R, P> {
    /// Reads `stream` under `policy`.
    pub fn new(stream: ResponseStream<R>, policy: ReadPolicy<P>) -> Self {
        Self {
            stream,
            on_restart: policy.on_restart,
            client_error: policy.client_error,
            committed: false,
            done: false,
            meter: None,
        }
    }

    /// Tells `meter` the token counts of the records read from now on (see [`Meter`]).
    pub fn meter(&mut self, meter: Box<dyn Meter>) {
        self.meter = Some(meter);
    }

    /// The request's correlation id.
    pub fn id(&self) -> &str {
        self.stream.id()
    }

    /// Where a resumed read of this answer starts (see [`ResponseStream::resume_after`]).
    pub fn resume_after(&self) -> Option<crate::bus::Position> {
        self.stream.resume_after()
    }

    /// Drives the stream through `encoder` (see the module's documentation): nothing is read
    /// until the [`Driven`] is run or pulled. [`Encoder::begin`] is called now.
    pub fn drive<E>(self, encoder: E) -> Driven<R, P, E>
    where
        E: Encoder<R>,
        P: Restarts<R, E>,
    {
        Driven::new(self, encoder)
    }

    /// What the stream gives next, before the restart policy; `None` once it ended. Owns the
    /// metering, the error record as a failure, the client-side failure in the caller's words.
    /// Cancel-safe, as [`ResponseStream::next`] is.
    async fn arrived(&mut self) -> Option<Arrived<R>> {
        if self.done {
            return None;
        }
        let arrived = match self.stream.next().await {
            Some(Ok(Received::Record(r))) => {
                if let Some(meter) = &mut self.meter {
                    let (input, output) = r.tokens();
                    if input.is_some() || output.is_some() {
                        meter.tokens(input.unwrap_or(0), output.unwrap_or(0));
                    }
                    if r.is_terminal() || r.error().is_some() {
                        meter.ended();
                    }
                }
                match r.error() {
                    Some(e) => Arrived::Failed(Failure {
                        error: e.clone(),
                        record: Some(r),
                        client: None,
                    }),
                    None => Arrived::Record(r),
                }
            }
            Some(Ok(Received::Restarted)) => Arrived::Restarted,
            Some(Err(e)) => Arrived::Failed(Failure {
                error: (self.client_error)(&e),
                record: None,
                client: Some(e),
            }),
            None => Arrived::Failed(Failure::unfinished()),
        };
        self.done = match &arrived {
            Arrived::Record(r) => r.is_terminal(),
            Arrived::Restarted => false,
            Arrived::Failed(_) => true,
        };
        Some(arrived)
    }
}

impl<Req: serde::Serialize, Resp: ResponseRecord> RequestClient<Req, Resp> {
    /// Sends a request and reads its answer under `policy`; a request that could not be sent
    /// fails as `policy` says.
    pub async fn read<P>(
        &self,
        request: &Req,
        options: RequestOptions,
        policy: ReadPolicy<P>,
    ) -> Result<Reader<Resp, P>, Failure<Resp>> {
        match self.request_with(request, options).await {
            Ok(stream) => Ok(Reader::new(stream, policy)),
            Err(e) => Err(policy.failure(e)),
        }
    }

    /// Reads the answer to request `id` again from the response topic (see
    /// [`RequestClient::resume`]) under `policy`: the same pieces, in the same order, as the
    /// read that sent the request got. Dropped before its end, it does not cancel the request.
    pub async fn resume_read<P>(
        &self,
        id: &str,
        after: Option<crate::bus::Position>,
        options: RequestOptions,
        policy: ReadPolicy<P>,
    ) -> Result<Reader<Resp, P>, Failure<Resp>> {
        match self.resume(id, after, options).await {
            Ok(stream) => Ok(Reader::new(stream, policy)),
            Err(e) => Err(policy.failure(e)),
        }
    }
}

#[cfg(test)]
mod tests;
