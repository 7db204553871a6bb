//! Ollama's streamed answer: NDJSON objects, one per line. `/api/chat` sends
//! `{"model","created_at","message":{"role":"assistant","content":...},"done":false}` per
//! piece of text (and one with `message.tool_calls`, each call whole, when the model calls
//! tools); `/api/generate` the same with `response` for `message`. The last line has
//! `done: true`, `done_reason` and the totals (`total_duration`, `prompt_eval_count`,
//! `prompt_eval_duration`, `eval_count`, `eval_duration`; durations in nanoseconds, measured
//! here: from the request's arrival to the first text, and from there to the end). A failure
//! after the first line is one `{"error": "..."}` line and the end, which Ollama's clients
//! raise.
//!
//! Nothing is emitted until a record says something (text, a tool call, or the end): until
//! then a restart starts the answer over unseen, and a failure is still the route's HTTP error
//! (what [`Encoder::end`] returns, for `Driven::start` to give back).

use std::time::{Instant, SystemTime};

use serde_json::Value;
use sluice_runtime::{
    reader::{Encoder, End, Out, Restartable},
    telemetry::ClientOutcome,
};
use sluice_schema::{ResponseRecord, TextCompletionResponse, ToolCallDelta};

use super::{Tally, chunks::Tokens};
use crate::ollama::{OllamaError, created_at, done_reason, tool_call};

/// Which route's objects: `/api/chat`'s `message` or `/api/generate`'s `response`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// `POST /api/chat`.
    Chat,
    /// `POST /api/generate`.
    Generate,
}

/// Text-completion records in, Ollama's NDJSON lines out.
pub(crate) struct Lines {
    shape: Shape,
    /// The model as the caller named it: Ollama echoes it on every line.
    model: String,
    /// When the request arrived: `total_duration` counts from it.
    arrived: Instant,
    /// When the first text went out: `prompt_eval_duration` ends and `eval_duration` starts.
    first_text: Option<Instant>,
    tokens: Tokens,
    /// Tool-call pieces, put together and sent whole at the end: Ollama sends whole calls.
    pieces: Vec<ToolCallDelta>,
    /// A line went out.
    started: bool,
    tally: Tally,
}

impl Lines {
    /// The lines of a `shape` answer asked of `model`, the request having arrived at
    /// `arrived`; the stream counted by `tally`, which the route opens once the stream starts
    /// ([`Lines::opened`]).
    pub(crate) fn new(shape: Shape, model: String, arrived: Instant, tally: Tally) -> Self {
        Self {
            shape,
            model,
            arrived,
            first_text: None,
            tokens: Tokens::default(),
            pieces: Vec::new(),
            started: false,
            tally,
        }
    }

    /// The stream started (its status is sent): counts it open, its first event now.
    pub(crate) fn opened(&mut self) {
        self.tally.open();
        self.tally.said();
    }

    /// One object: a piece of `text`, the whole `calls` (`/api/chat`), or the end.
    fn line(&self, text: &str, calls: Option<Value>, end: Option<(&str, Totals)>) -> Vec<u8> {
        let (message, response) = match self.shape {
            Shape::Chat => (
                Some(Message {
                    role: "assistant",
                    content: text,
                    tool_calls: calls,
                }),
                None,
            ),
            Shape::Generate => (None, Some(text)),
        };
        let (done_reason, totals) = match end {
            Some((reason, totals)) => (Some(reason), Some(totals)),
            None => (None, None),
        };
        let mut line = Vec::with_capacity(160);
        // Serializing these types cannot fail: no map has keys that are not strings.
        let _ = serde_json::to_writer(
            &mut line,
            &Line {
                model: &self.model,
                created_at: created_at(SystemTime::now()),
                message,
                response,
                done_reason,
                done: done_reason.is_some(),
                totals,
            },
        );
        line.push(b'\n');
        line
    }

    /// The totals of the `done` line.
    fn totals(&self) -> Totals {
        let now = Instant::now();
        let first = self.first_text.unwrap_or(now);
        Totals {
            total_duration: nanos_between(self.arrived, now),
            prompt_eval_count: self.tokens.input,
            prompt_eval_duration: nanos_between(self.arrived, first),
            eval_count: self.tokens.output,
            eval_duration: nanos_between(first, now),
        }
    }
}

/// Nanoseconds from `from` to `to`, as Ollama's durations are.
fn nanos_between(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_nanos()).unwrap_or(u64::MAX)
}

/// One line, its fields in Ollama's order, serialized straight from borrowed fields (a line
/// per token is on every stream's path).
#[derive(serde::Serialize)]
struct Line<'a> {
    model: &'a str,
    created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    done_reason: Option<&'a str>,
    done: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    totals: Option<Totals>,
}

#[derive(serde::Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Value>,
}

/// The `done` line's counts and durations (nanoseconds).
#[derive(serde::Serialize)]
struct Totals {
    total_duration: u64,
    prompt_eval_count: u64,
    prompt_eval_duration: u64,
    eval_count: u64,
    eval_duration: u64,
}

impl Encoder<TextCompletionResponse> for Lines {
    type Item = Vec<u8>;
    /// A failure before anything was emitted, as the HTTP error the route answers instead.
    type Done = Option<OllamaError>;

    fn record(&mut self, mut r: TextCompletionResponse, out: &mut Out<Vec<u8>>) {
        self.tokens.input = self.tokens.input.saturating_add(r.in_token.unwrap_or(0));
        self.tokens.output = self.tokens.output.saturating_add(r.out_token.unwrap_or(0));
        sluice_schema::tools::append_deltas(&mut self.pieces, std::mem::take(&mut r.tool_calls));
        if !r.response.is_empty() {
            self.first_text.get_or_insert_with(Instant::now);
            out.push(self.line(&r.response, None, None));
            self.started = true;
        }
        if !r.is_terminal() {
            return;
        }
        let calls = sluice_schema::tools::assemble(&self.pieces);
        if !calls.is_empty() {
            let calls: Value = calls.iter().enumerate().map(tool_call).collect();
            match self.shape {
                Shape::Chat => out.push(self.line("", Some(calls), None)),
                // `/api/generate` offers no tools, so no call can come back on it.
                Shape::Generate => {}
            }
        }
        let end = (done_reason(r.finish_reason.as_deref()), self.totals());
        out.push(self.line("", None, Some(end)));
        self.started = true;
        self.tally.ended(ClientOutcome::Success);
    }

    fn end(&mut self, end: End<TextCompletionResponse>, out: &mut Out<Vec<u8>>) -> Self::Done {
        let failure = end.failure()?;
        let err = OllamaError::from_error(&failure.error);
        if !self.started {
            self.tally.refused(err.status);
            return Some(err);
        }
        out.push(err.line());
        self.tally
            .ended(ClientOutcome::of_error(&failure.error.kind));
        None
    }

    fn handed(&mut self, _: &mut Vec<u8>, last: bool) {
        if last {
            self.tally.delivered();
        }
    }
}

impl Restartable<TextCompletionResponse> for Lines {
    /// Given only while nothing was emitted (the route reads under `StartOver`): the new
    /// attempt simply starts the answer, its usage and calls its own.
    fn restarted(&mut self, _: &mut Out<Vec<u8>>) {
        self.tokens = Tokens::default();
        self.pieces.clear();
        self.first_text = None;
    }
}
