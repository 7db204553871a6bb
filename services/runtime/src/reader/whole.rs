//! Answers read whole, over the driver: the terminal record ([`Last`]), the records of the
//! final attempt ([`Collect`], and [`Records`] for the client's own `collect`), a text
//! completion put together ([`Whole`], [`ReadWhole`]).

use std::convert::Infallible;

use sluice_schema::{
    PendingUsage, ResponseRecord, TextCompletionResponse, ToolCall, ToolCallDelta, tools,
};

use super::{Encoder, End, Failure, Out, Reader, Restartable, Restarts};
use crate::client::ClientError;

/// Encoder of [`Reader::last`]: the answer's terminal record, holding no other record.
#[derive(Debug)]
pub struct Last<R>(Option<R>);

impl<R> Default for Last<R> {
    fn default() -> Self {
        Self(None)
    }
}

impl<R: ResponseRecord> Encoder<R> for Last<R> {
    type Item = Infallible;
    type Done = Result<R, Failure<R>>;

    fn record(&mut self, record: R, _: &mut Out<Infallible>) {
        if record.is_terminal() {
            self.0 = Some(record);
        }
    }

    fn end(&mut self, end: End<R>, _: &mut Out<Infallible>) -> Self::Done {
        match end.failure() {
            None => self.0.take().ok_or_else(Failure::unfinished),
            Some(f) => Err(f),
        }
    }
}

impl<R: ResponseRecord> Restartable<R> for Last<R> {
    /// Nothing is held before the terminal record: nothing to drop.
    fn restarted(&mut self, _: &mut Out<Infallible>) {}
}

/// The records of the final attempt, the terminal one last (`reader.drive(Collect::default())
/// .run()`).
#[derive(Debug)]
pub struct Collect<R>(Vec<R>);

impl<R> Default for Collect<R> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<R: ResponseRecord> Encoder<R> for Collect<R> {
    type Item = Infallible;
    type Done = Result<Vec<R>, Failure<R>>;

    fn record(&mut self, record: R, _: &mut Out<Infallible>) {
        self.0.push(record);
    }

    fn end(&mut self, end: End<R>, _: &mut Out<Infallible>) -> Self::Done {
        match end.failure() {
            None => Ok(std::mem::take(&mut self.0)),
            Some(f) => Err(f),
        }
    }
}

impl<R: ResponseRecord> Restartable<R> for Collect<R> {
    fn restarted(&mut self, _: &mut Out<Infallible>) {
        self.0.clear();
    }
}

/// Encoder of [`crate::client::ResponseStream::collect`]: the records of the final attempt, an
/// error record last among them; a client-side failure as the client gave it.
#[derive(Debug)]
pub struct Records<R>(Vec<R>);

impl<R> Default for Records<R> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<R: ResponseRecord> Encoder<R> for Records<R> {
    type Item = Infallible;
    type Done = Result<Vec<R>, ClientError>;

    fn record(&mut self, record: R, _: &mut Out<Infallible>) {
        self.0.push(record);
    }

    fn end(&mut self, end: End<R>, _: &mut Out<Infallible>) -> Self::Done {
        if let Some(f) = end.failure() {
            match (f.record, f.client) {
                (Some(r), _) => self.0.push(r),
                (None, Some(e)) => return Err(e),
                // A stream ends with a record or a client-side failure; this is a guard.
                (None, None) => {}
            }
        }
        Ok(std::mem::take(&mut self.0))
    }
}

impl<R: ResponseRecord> Restartable<R> for Records<R> {
    fn restarted(&mut self, _: &mut Out<Infallible>) {
        self.0.clear();
    }
}

/// A text-completion answer put together from its records: its text, its tool calls, its
/// usage. The one place an answer's text is assembled; an encoder that reads a text
/// completion whole (and more: the agent's turns, the prompt's `json` mode) keeps one.
#[derive(Debug, Clone, Default)]
pub struct Whole {
    /// Every record's `response`, in order.
    pub text: String,
    /// The tool-call pieces, as streamed ([`Whole::tool_calls`] puts them together).
    pub pieces: Vec<ToolCallDelta>,
    /// The token counts summed over the records, and the last model named.
    pub usage: PendingUsage,
    /// Why the model stopped, from the terminal record.
    pub finish_reason: Option<String>,
}

impl Whole {
    /// Adds a record of the answer.
    pub fn add(&mut self, r: TextCompletionResponse) {
        self.usage.add(&r);
        self.text.push_str(&r.response);
        tools::append_deltas(&mut self.pieces, r.tool_calls);
        if r.end_of_stream {
            self.finish_reason = r.finish_reason;
        }
    }

    /// The tool calls, each whole, in the order of their index.
    pub fn tool_calls(&self) -> Vec<ToolCall> {
        tools::assemble(&self.pieces)
    }
}

/// Encoder of [`Reader::whole`]: a text completion's final attempt, put together.
#[derive(Debug, Default)]
pub struct ReadWhole(Whole);

impl Encoder<TextCompletionResponse> for ReadWhole {
    type Item = Infallible;
    type Done = Result<Whole, Failure<TextCompletionResponse>>;

    fn record(&mut self, record: TextCompletionResponse, _: &mut Out<Infallible>) {
        self.0.add(record);
    }

    fn end(&mut self, end: End<TextCompletionResponse>, _: &mut Out<Infallible>) -> Self::Done {
        match end.failure() {
            None => Ok(std::mem::take(&mut self.0)),
            Some(f) => Err(f),
        }
    }
}

impl Restartable<TextCompletionResponse> for ReadWhole {
    fn restarted(&mut self, _: &mut Out<Infallible>) {
        self.0 = Whole::default();
    }
}

impl<R: ResponseRecord, P: Restarts<R, Last<R>>> Reader<R, P> {
    /// The answer's terminal record, or its failure. A restart (under any policy but
    /// [`super::Fail`]) costs nothing: no other record is held.
    pub async fn last(self) -> Result<R, Failure<R>> {
        self.drive(Last::default()).run().await
    }
}

impl<P: Restarts<TextCompletionResponse, ReadWhole>> Reader<TextCompletionResponse, P> {
    /// The final attempt's text, tool calls and usage (see [`Whole`]), or the failure.
    pub async fn whole(self) -> Result<Whole, Failure<TextCompletionResponse>> {
        self.drive(ReadWhole::default()).run().await
    }

    /// The final attempt's text, or the failure.
    pub async fn text(self) -> Result<String, Failure<TextCompletionResponse>> {
        self.whole().await.map(|w| w.text)
    }
}
