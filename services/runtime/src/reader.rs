//! Reading a response stream the one way every caller of a service needs: an explicit restart
//! policy, every failure as the error record the caller answers with, and the common ends (the
//! final record, the records of the final attempt).
//!
//! A [`ResponseStream`] hands out what arrived: records, restart markers (the processor
//! answering went away and another started the request over) and client-side failures. What a
//! caller does with a restart depends on what it already passed on, and every caller had
//! decided it in its own loop; a [`Reader`] decides it once, by its [`OnRestart`]:
//!
//! - the gateway's NDJSON/SSE route and TrustGraph's WebSocket show a restart to their clients
//!   and read on ([`OnRestart::Report`]);
//! - the prompt service and the OpenAI route start over while nothing of the answer was passed
//!   on, and fail after that ([`OnRestart::StartOver`] with [`Reader::commit`]);
//! - the agent fails on a restart ([`OnRestart::Fail`]): its parser has already acted on the
//!   abandoned attempt.
//!
//! A stream read through a [`Reader`] ends with exactly one terminal piece: a terminal record
//! without an error, or a [`Failure`].

use sluice_schema::{Error, ErrorKind, ResponseRecord};

use crate::client::{ClientError, RequestClient, RequestOptions, ResponseStream};

/// What a [`Reader`] does when the answer is started over.
#[derive(Debug, Clone)]
pub enum OnRestart {
    /// Passes [`Piece::Restarted`] on: the reader's caller shows it (records before it belong
    /// to the abandoned attempt) and reads on.
    Report,
    /// Passes [`Piece::Restarted`] on while nothing of the answer was passed on (the caller
    /// drops what it built and reads the new attempt); once [`Reader::commit`] was called, ends
    /// the stream with this error instead: what was passed on cannot be taken back.
    StartOver(Error),
    /// Ends the stream with this error.
    Fail(Error),
}

/// How a [`Reader`] reads: its restart policy, and the error record a client-side failure
/// (timeout, loss, bus) becomes in the caller's words.
#[derive(Debug, Clone)]
pub struct ReadPolicy {
    /// What a restart does.
    pub on_restart: OnRestart,
    /// The error record a client-side failure becomes; [`ClientError::to_error`] for a service
    /// calling another, the gateway's own wording for its HTTP clients.
    pub client_error: fn(&ClientError) -> Error,
}

impl ReadPolicy {
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
    /// The client-side failure, when it was one (a caller may treat a time limit of its own
    /// apart, as the agent does with its dialog's deadline).
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
}

/// One piece of a read stream.
#[derive(Debug)]
pub enum Piece<R> {
    /// The next record; it carries no error. The stream ends after a terminal one.
    Record(R),
    /// The answer starts over (see [`OnRestart`]): what came before belongs to the abandoned
    /// attempt.
    Restarted,
    /// The stream ends without its answer.
    Failed(Failure<R>),
}

/// A response stream read under a [`ReadPolicy`] (see the module's documentation). Dropped
/// before its end (after a failure it decided on, or when its caller goes away), it tells the
/// service to stop working on the request, as its stream does.
pub struct Reader<R> {
    stream: ResponseStream<R>,
    policy: ReadPolicy,
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

impl<R: ResponseRecord> Reader<R> {
    /// Reads `stream` under `policy`.
    pub fn new(stream: ResponseStream<R>, policy: ReadPolicy) -> Self {
        Self {
            stream,
            policy,
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

    /// Says that something of the answer was passed on: under [`OnRestart::StartOver`], a
    /// restart now ends the stream.
    pub fn commit(&mut self) {
        self.committed = true;
    }

    /// The next piece; `None` once a terminal record or a failure was given.
    ///
    /// Cancel-safe: a piece is lost only if it had arrived, and dropping the future before it
    /// completes loses nothing (callers wrap it in a keep-alive timeout).
    pub async fn next(&mut self) -> Option<Piece<R>> {
        if self.done {
            return None;
        }
        let piece = match self.stream.next().await {
            Some(Ok(crate::client::Received::Record(r))) => {
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
                    Some(e) => Piece::Failed(Failure {
                        error: e.clone(),
                        record: Some(r),
                        client: None,
                    }),
                    None => Piece::Record(r),
                }
            }
            Some(Ok(crate::client::Received::Restarted)) => match &self.policy.on_restart {
                OnRestart::Report => Piece::Restarted,
                OnRestart::StartOver(_) if !self.committed => Piece::Restarted,
                OnRestart::StartOver(e) | OnRestart::Fail(e) => {
                    Piece::Failed(Failure::new(e.clone()))
                }
            },
            Some(Err(e)) => Piece::Failed(self.policy.failure(e)),
            // A response stream gives its terminal record or an error before it ends; this is
            // a guard, not a path.
            None => Piece::Failed(Failure::new(Error::new(
                ErrorKind::Internal,
                "the answer ended without a final record",
            ))),
        };
        self.done = match &piece {
            Piece::Record(r) => r.is_terminal(),
            Piece::Restarted => false,
            Piece::Failed(_) => true,
        };
        Some(piece)
    }

    /// The records of the final attempt, the terminal one last, once the stream has ended: a
    /// restart drops what came before it (nothing was passed on).
    pub async fn collect(mut self) -> Result<Vec<R>, Failure<R>> {
        let mut records = Vec::new();
        while let Some(piece) = self.next().await {
            match piece {
                Piece::Record(r) => {
                    let terminal = r.is_terminal();
                    records.push(r);
                    if terminal {
                        return Ok(records);
                    }
                }
                Piece::Restarted => records.clear(),
                Piece::Failed(f) => return Err(f),
            }
        }
        Err(Failure::new(Error::new(
            ErrorKind::Internal,
            "the answer ended without a final record",
        )))
    }

    /// The answer's terminal record, holding no other record meanwhile.
    pub async fn last(mut self) -> Result<R, Failure<R>> {
        while let Some(piece) = self.next().await {
            match piece {
                Piece::Record(r) if r.is_terminal() => return Ok(r),
                Piece::Record(_) | Piece::Restarted => {}
                Piece::Failed(f) => return Err(f),
            }
        }
        Err(Failure::new(Error::new(
            ErrorKind::Internal,
            "the answer ended without a final record",
        )))
    }
}

impl<Req: serde::Serialize, Resp: ResponseRecord> RequestClient<Req, Resp> {
    /// Sends a request and reads its answer under `policy`; a request that could not be sent
    /// fails as `policy` says.
    pub async fn read(
        &self,
        request: &Req,
        options: RequestOptions,
        policy: ReadPolicy,
    ) -> Result<Reader<Resp>, Failure<Resp>> {
        match self.request_with(request, options).await {
            Ok(stream) => Ok(Reader::new(stream, policy)),
            Err(e) => Err(policy.failure(e)),
        }
    }

    /// Reads the answer to request `id` again from the response topic (see
    /// [`RequestClient::resume`]) under `policy`: the same pieces, in the same order, as the
    /// read that sent the request got. Dropped before its end, it does not cancel the request.
    pub async fn resume_read(
        &self,
        id: &str,
        after: Option<crate::bus::Position>,
        options: RequestOptions,
        policy: ReadPolicy,
    ) -> Result<Reader<Resp>, Failure<Resp>> {
        match self.resume(id, after, options).await {
            Ok(stream) => Ok(Reader::new(stream, policy)),
            Err(e) => Err(policy.failure(e)),
        }
    }
}

#[cfg(test)]
mod tests;
