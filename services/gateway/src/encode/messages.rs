//! Anthropic's Messages stream: SSE with named events, as Anthropic's API sends them and its
//! SDKs read them. `message_start` (the message with empty content and the input tokens known
//! so far), then per content block `content_block_start`, its `content_block_delta`s
//! (`text_delta`, or `input_json_delta` fragments of a `tool_use` block's input) and
//! `content_block_stop`; a `ping` after the first block starts (and on silence, from the
//! route); then `message_delta` (`stop_reason`, the usage totals) and `message_stop`. A
//! failure after the first event is `event: error` with `{"type":"error","error":{...}}`,
//! which the SDKs raise.
//!
//! Anthropic's blocks follow one another: a block is never added to once the next started.
//! sluice's records may interleave tool-call pieces (some providers stream parallel calls so),
//! so the first call streams live and the pieces of the others, with any text after the
//! first call, are held and sent as their own blocks at the end: every block whole and in
//! order, whatever the provider sent.
//!
//! Nothing is emitted until a record says something (text, a tool call, or the end): until
//! then a restart starts the answer over unseen, and a failure is still the route's HTTP error
//! (what [`Encoder::end`] returns, for `Driven::start` to give back).

use serde::Serialize;
use serde_json::Value;
use sluice_runtime::{
    reader::{Encoder, End, Out, Restartable},
    telemetry::ClientOutcome,
};
use sluice_schema::{ResponseRecord, TextCompletionResponse, ToolCallDelta};

use super::{Tally, chunks::Tokens};
use crate::anthropic::AnthropicError;

/// The message as `message_start` and a whole answer carry it, its fields in Anthropic's
/// order.
#[derive(Serialize)]
pub(crate) struct Message<'a, C: Serialize> {
    pub(crate) id: &'a str,
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) role: &'static str,
    pub(crate) model: &'a str,
    pub(crate) content: C,
    pub(crate) stop_reason: Option<&'static str>,
    pub(crate) stop_sequence: Option<&'static str>,
    pub(crate) usage: Usage,
}

impl<'a, C: Serialize> Message<'a, C> {
    /// Message `id` answered by `model`.
    pub(crate) fn new(id: &'a str, model: &'a str, content: C, usage: Usage) -> Self {
        Self {
            id,
            kind: "message",
            role: "assistant",
            model,
            content,
            stop_reason: None,
            stop_sequence: None,
            usage,
        }
    }
}

/// Anthropic's `usage`.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Usage {
    pub(crate) input_tokens: u64,
    pub(crate) output_tokens: u64,
}

impl From<Tokens> for Usage {
    fn from(t: Tokens) -> Self {
        Self {
            input_tokens: t.input,
            output_tokens: t.output,
        }
    }
}

/// A content block, whole (a whole answer's) or as `content_block_start` opens it.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum Block<'a> {
    Text {
        text: &'a str,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: Value,
    },
}

/// What a `content_block_delta` adds.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Delta<'a> {
    TextDelta { text: &'a str },
    InputJsonDelta { partial_json: &'a str },
}

#[derive(Serialize)]
struct Stop {
    stop_reason: &'static str,
    stop_sequence: Option<&'static str>,
}

/// One event; its `type` is also the SSE event's name.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Event<'a> {
    MessageStart {
        message: Message<'a, [(); 0]>,
    },
    ContentBlockStart {
        index: u32,
        content_block: Block<'a>,
    },
    ContentBlockDelta {
        index: u32,
        delta: Delta<'a>,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: Stop,
        usage: Usage,
    },
    MessageStop,
}

impl Event<'_> {
    fn name(&self) -> &'static str {
        match self {
            Event::MessageStart { .. } => "message_start",
            Event::ContentBlockStart { .. } => "content_block_start",
            Event::ContentBlockDelta { .. } => "content_block_delta",
            Event::ContentBlockStop { .. } => "content_block_stop",
            Event::MessageDelta { .. } => "message_delta",
            Event::MessageStop => "message_stop",
        }
    }

    /// `event: <name>\ndata: <json>\n\n`.
    fn sse(&self) -> Vec<u8> {
        sse(self.name(), self)
    }
}

/// The SSE event `name` with `data` as its JSON.
pub(crate) fn sse(name: &str, data: &impl Serialize) -> Vec<u8> {
    let mut event = Vec::with_capacity(200);
    event.extend_from_slice(b"event: ");
    event.extend_from_slice(name.as_bytes());
    event.extend_from_slice(b"\ndata: ");
    // Serializing these types cannot fail: no map has keys that are not strings.
    let _ = serde_json::to_writer(&mut event, data);
    event.extend_from_slice(b"\n\n");
    event
}

/// Anthropic's ping, byte for byte as its API sends it.
pub(crate) const PING: &[u8] = b"event: ping\ndata: {\"type\": \"ping\"}\n\n";

/// The ping, as the route's keep-alive.
pub(crate) fn ping() -> Vec<u8> {
    PING.to_vec()
}

/// Anthropic's `stop_reason` for a record's `finish_reason` (sluice's words: `stop`,
/// `length`, `tool_calls`, `content_filter`, or a provider's own); `called`: the answer has
/// tool calls, which Anthropic always ends with `tool_use`. A stop sequence is `end_turn`:
/// the records do not say which ended the answer.
pub(crate) fn stop_reason(finish: Option<&str>, called: bool) -> &'static str {
    match finish {
        _ if called => "tool_use",
        Some("length" | "max_tokens") => "max_tokens",
        Some("tool_calls" | "tool_use") => "tool_use",
        Some("content_filter" | "refusal") => "refusal",
        _ => "end_turn",
    }
}

/// A tool call's input as a block carries it: its arguments as JSON (an object from the
/// model; no arguments are `{}`; arguments that are not JSON go as the string they are, so
/// nothing is lost).
pub(crate) fn input(arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return Value::Object(serde_json::Map::new());
    }
    serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_owned()))
}

/// The block being streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Text,
    /// The tool call of this record index.
    Call(u32),
}

/// Text-completion records in, Anthropic's stream events out.
pub(crate) struct Messages {
    /// The message's id (`msg_...`).
    id: String,
    /// The model `message_start` names: the one asked for, until the first record that says
    /// something names the one that answers.
    model: String,
    tokens: Tokens,
    /// `message_start` went out.
    started: bool,
    /// The block open now, and the index the next block gets.
    open: Option<Open>,
    next_index: u32,
    pinged: bool,
    /// The tool call streamed live (the first); the others' pieces, and text after it, held.
    live: Option<u32>,
    held: Vec<ToolCallDelta>,
    held_text: String,
    /// A tool call went out (the answer ends `tool_use`).
    called: bool,
    tally: Tally,
}

impl Messages {
    /// The events of message `id`, asked of `model`; the stream counted by `tally`, which
    /// the route opens once the stream starts ([`Messages::opened`]).
    pub(crate) fn new(id: String, model: String, tally: Tally) -> Self {
        Self {
            id,
            model,
            tokens: Tokens::default(),
            started: false,
            open: None,
            next_index: 0,
            pinged: false,
            live: None,
            held: Vec::new(),
            held_text: String::new(),
            called: false,
            tally,
        }
    }

    /// The stream started (its status is sent): counts it open, its first event now.
    pub(crate) fn opened(&mut self) {
        self.tally.open();
        self.tally.said();
    }

    /// `message_start`: the message, no content yet, the usage so far.
    fn start(&mut self, first: &TextCompletionResponse, out: &mut Out<Vec<u8>>) {
        self.started = true;
        if let Some(model) = &first.model {
            self.model.clone_from(model);
        }
        let message = Message::new(&self.id, &self.model, [], self.tokens.into());
        out.push(Event::MessageStart { message }.sse());
    }

    /// Closes the open block, if any.
    fn close(&mut self, out: &mut Out<Vec<u8>>) {
        if self.open.take().is_some() {
            let index = self.next_index - 1;
            out.push(Event::ContentBlockStop { index }.sse());
        }
    }

    /// Opens the next block (closing the open one), and pings after the first.
    fn open(&mut self, open: Open, block: Block<'_>, out: &mut Out<Vec<u8>>) {
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        out.push(
            Event::ContentBlockStart {
                index,
                content_block: block,
            }
            .sse(),
        );
        self.open = Some(open);
        if !self.pinged {
            self.pinged = true;
            out.push(PING.to_vec());
        }
    }

    /// A delta to the open block.
    fn delta(&self, delta: Delta<'_>, out: &mut Out<Vec<u8>>) {
        let index = self.next_index - 1;
        out.push(Event::ContentBlockDelta { index, delta }.sse());
    }

    fn text(&mut self, text: &str, out: &mut Out<Vec<u8>>) {
        if self.live.is_some() {
            self.held_text.push_str(text);
            return;
        }
        if self.open != Some(Open::Text) {
            self.open(Open::Text, Block::Text { text: "" }, out);
        }
        self.delta(Delta::TextDelta { text }, out);
    }

    /// A tool-call piece: the first call streams live, the others are held.
    fn piece(&mut self, piece: ToolCallDelta, out: &mut Out<Vec<u8>>) {
        match self.live {
            None => {
                self.live = Some(piece.index);
                self.start_call(&piece, out);
            }
            Some(live) if live == piece.index && self.open == Some(Open::Call(live)) => {
                if !piece.arguments.is_empty() {
                    self.delta(
                        Delta::InputJsonDelta {
                            partial_json: &piece.arguments,
                        },
                        out,
                    );
                }
            }
            Some(_) => self.held.push(piece),
        }
    }

    /// Opens the block of the call `first` begins, with its first fragment.
    fn start_call(&mut self, first: &ToolCallDelta, out: &mut Out<Vec<u8>>) {
        self.called = true;
        let fallback = format!("toolu_{}", first.index);
        let block = Block::ToolUse {
            id: first.id.as_deref().unwrap_or(&fallback),
            name: first.name.as_deref().unwrap_or(""),
            input: Value::Object(serde_json::Map::new()),
        };
        self.open(Open::Call(first.index), block, out);
        if !first.arguments.is_empty() {
            self.delta(
                Delta::InputJsonDelta {
                    partial_json: &first.arguments,
                },
                out,
            );
        }
    }

    /// What was held, as blocks of their own: each held call (in the order its first piece
    /// came) with its fragments, then the held text.
    fn flush(&mut self, out: &mut Out<Vec<u8>>) {
        let held = std::mem::take(&mut self.held);
        let mut order: Vec<u32> = Vec::new();
        for p in &held {
            if !order.contains(&p.index) {
                order.push(p.index);
            }
        }
        for index in order {
            let mut pieces = held.iter().filter(|p| p.index == index);
            let Some(first) = pieces.next() else {
                continue;
            };
            // A call's id and name may come on any of its pieces (the first, usually).
            let mut head = first.clone();
            for p in held.iter().filter(|p| p.index == index) {
                if head.id.is_none() {
                    head.id.clone_from(&p.id);
                }
                if head.name.is_none() {
                    head.name.clone_from(&p.name);
                }
            }
            self.start_call(&head, out);
            for p in pieces.filter(|p| !p.arguments.is_empty()) {
                self.delta(
                    Delta::InputJsonDelta {
                        partial_json: &p.arguments,
                    },
                    out,
                );
            }
        }
        let text = std::mem::take(&mut self.held_text);
        if !text.is_empty() {
            self.open(Open::Text, Block::Text { text: "" }, out);
            self.delta(Delta::TextDelta { text: &text }, out);
        }
        self.close(out);
    }
}

impl Encoder<TextCompletionResponse> for Messages {
    type Item = Vec<u8>;
    /// A failure before anything was emitted, as the HTTP error the route answers instead.
    type Done = Option<AnthropicError>;

    fn record(&mut self, mut r: TextCompletionResponse, out: &mut Out<Vec<u8>>) {
        self.tokens.add(&r);
        if !self.started {
            if r.response.is_empty() && r.tool_calls.is_empty() && !r.is_terminal() {
                return;
            }
            self.start(&r, out);
        }
        if !r.response.is_empty() {
            let text = std::mem::take(&mut r.response);
            self.text(&text, out);
        }
        for piece in std::mem::take(&mut r.tool_calls) {
            self.piece(piece, out);
        }
        if !r.is_terminal() {
            return;
        }
        self.flush(out);
        let stop = Stop {
            stop_reason: stop_reason(r.finish_reason.as_deref(), self.called),
            stop_sequence: None,
        };
        out.push(
            Event::MessageDelta {
                delta: stop,
                usage: self.tokens.into(),
            }
            .sse(),
        );
        out.push(Event::MessageStop.sse());
        self.tally.ended(ClientOutcome::Success);
    }

    fn end(&mut self, end: End<TextCompletionResponse>, out: &mut Out<Vec<u8>>) -> Self::Done {
        let failure = end.failure()?;
        let err = AnthropicError::from_error(&failure.error);
        if !self.started {
            self.tally.refused(err.status);
            return Some(err);
        }
        out.push(err.event());
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

impl Restartable<TextCompletionResponse> for Messages {
    /// Given only while nothing was emitted (the route reads under `StartOver`): the new
    /// attempt simply starts the answer, its usage and calls its own.
    fn restarted(&mut self, _: &mut Out<Vec<u8>>) {
        self.tokens = Tokens::default();
        self.open = None;
        self.next_index = 0;
        self.pinged = false;
        self.live = None;
        self.held.clear();
        self.held_text.clear();
        self.called = false;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// sluice's finish reasons in Anthropic's words; calls always end `tool_use`.
    #[test]
    fn finish_reasons_are_anthropics_stop_reasons() {
        for (finish, called, want) in [
            (None, false, "end_turn"),
            (Some("stop"), false, "end_turn"),
            (Some("length"), false, "max_tokens"),
            (Some("tool_calls"), false, "tool_use"),
            (Some("stop"), true, "tool_use"),
            (Some("content_filter"), false, "refusal"),
            (Some("recitation"), false, "end_turn"),
        ] {
            assert_eq!(stop_reason(finish, called), want, "{finish:?} {called}");
        }
    }

    /// A call's input is its arguments parsed; none is `{}`; arguments that are not JSON go
    /// as the string they are.
    #[test]
    fn a_calls_input_is_its_arguments_parsed() {
        assert_eq!(input("{\"q\":\"Paris\"}"), json!({"q": "Paris"}));
        assert_eq!(input(" "), json!({}));
        assert_eq!(input("{\"q\":"), json!("{\"q\":"));
    }

    /// The events' bytes: `event: <type>` then the data with `type` first, as Anthropic's.
    #[test]
    fn events_are_named_by_their_type() {
        let e = Event::ContentBlockDelta {
            index: 2,
            delta: Delta::InputJsonDelta {
                partial_json: "{\"a\"",
            },
        };
        assert_eq!(
            String::from_utf8(e.sse()).unwrap(),
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":2,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\"\"}}\n\n"
        );
        assert_eq!(
            String::from_utf8(Event::MessageStop.sse()).unwrap(),
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
        );
        assert_eq!(ping(), PING);
    }
}
