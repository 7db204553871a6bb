//! OpenAI's Responses API: the `response` object (whole answers, and in the lifecycle events)
//! and its streamed semantic events, each an SSE event named by its `type`
//! (`event: response.output_text.delta\ndata: {...}`) and numbered by `sequence_number`:
//! `response.created`, `response.in_progress`, then per output item `output_item.added`
//! (a message: `content_part.added`, `output_text.delta`s, `output_text.done`,
//! `content_part.done`; a function call: `function_call_arguments.delta`s and `.done`),
//! `output_item.done`, and last `response.completed` (or `response.incomplete` at the token
//! limit) with the whole response and its usage. A failure after the stream started is an
//! `error` event then `response.failed`.
//!
//! Nothing is emitted until a record says something (text, a tool call, or the end): until
//! then a restart starts the answer over unseen, and a failure is still the route's HTTP error
//! (what [`Encoder::end`] returns, for `Driven::start` to give back).

use serde_json::{Map, Value, json};
use sluice_runtime::{
    reader::{Encoder, End, Out, Restartable},
    telemetry::ClientOutcome,
};
use sluice_schema::{ResponseRecord, TextCompletionResponse, ToolCall};

use super::{Tally, chunks::Tokens};
use crate::openai::ApiError;

/// What names one response and what it repeats of its request.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    /// `resp_...`.
    pub(crate) id: String,
    /// Seconds since the epoch.
    pub(crate) created_at: u64,
    /// The model asked for, until the answer names the one that answers.
    pub(crate) model: String,
    /// The request's fields the object repeats (`instructions`, `tools`, `text`, ...).
    pub(crate) echo: Map<String, Value>,
}

impl Meta {
    /// The id of the response's message item.
    pub(crate) fn message_id(&self) -> String {
        format!("msg_{}", self.suffix())
    }

    /// The id of the response's function-call item `n`.
    pub(crate) fn call_item_id(&self, n: usize) -> String {
        format!("fc_{}_{n}", self.suffix())
    }

    fn suffix(&self) -> &str {
        self.id.strip_prefix("resp_").unwrap_or(&self.id)
    }
}

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    InProgress,
    Completed,
    /// Stopped at `max_output_tokens`.
    Incomplete,
    Failed,
}

impl Status {
    /// The status of an answer that ended with `finish_reason`.
    pub(crate) fn of_finish(finish: Option<&str>) -> Self {
        if finish == Some("length") {
            Status::Incomplete
        } else {
            Status::Completed
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
            Status::Failed => "failed",
        }
    }
}

/// The Responses API's `usage`.
pub(crate) fn usage(t: Tokens) -> Value {
    json!({"input_tokens": t.input, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
           "output_tokens": t.output, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": t.input.saturating_add(t.output)})
}

/// The `response` object: its output items, and usage once known; `error` when it failed.
pub(crate) fn response_object(
    meta: &Meta,
    status: Status,
    output: Vec<Value>,
    tokens: Option<Tokens>,
    error: Option<&ApiError>,
) -> Value {
    let mut v = Value::Object(meta.echo.clone());
    v["id"] = json!(meta.id);
    v["object"] = json!("response");
    v["created_at"] = json!(meta.created_at);
    v["status"] = json!(status.as_str());
    v["background"] = json!(false);
    v["error"] = match error {
        // The `response.failed` error's code is one of OpenAI's few; what sluice's error
        // type was is in the `error` event before it.
        Some(e) => json!({"code": "server_error", "message": e.message}),
        None => Value::Null,
    };
    v["incomplete_details"] = if status == Status::Incomplete {
        json!({"reason": "max_output_tokens"})
    } else {
        Value::Null
    };
    v["model"] = json!(meta.model);
    v["output"] = Value::Array(output);
    v["usage"] = tokens.map_or(Value::Null, usage);
    v
}

/// A message item with `text`.
pub(crate) fn message_item(id: &str, text: &str, status: Status) -> Value {
    let content = if status == Status::InProgress {
        json!([])
    } else {
        json!([output_text(text)])
    };
    json!({"id": id, "type": "message", "status": status.as_str(), "role": "assistant",
           "content": content})
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// A function-call item.
pub(crate) fn function_call_item(id: &str, call: &ToolCall, status: Status) -> Value {
    json!({"id": id, "type": "function_call", "status": status.as_str(),
           "call_id": call.id, "name": call.name, "arguments": call.arguments})
}

/// The output items of a whole answer: its text as a message (also when empty, unless the
/// answer is only tool calls), then its calls.
pub(crate) fn whole_output(
    meta: &Meta,
    text: &str,
    calls: &[ToolCall],
    status: Status,
) -> Vec<Value> {
    let mut output = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        output.push(message_item(&meta.message_id(), text, status));
    }
    for (n, call) in calls.iter().enumerate() {
        output.push(function_call_item(
            &meta.call_item_id(n),
            call,
            Status::Completed,
        ));
    }
    output
}

/// One function call being streamed.
struct CallItem {
    /// The record's index of the call.
    index: u32,
    output_index: usize,
    item_id: String,
    call: ToolCall,
}

/// Text-completion records in, Responses SSE events out.
pub(crate) struct ResponseEvents {
    meta: Meta,
    /// The next event's `sequence_number`.
    sequence: u64,
    tokens: Tokens,
    /// The lifecycle events went out.
    started: bool,
    /// The message item's output index, once text came, and its text so far.
    message: Option<usize>,
    text: String,
    calls: Vec<CallItem>,
    /// The next output item's index.
    next_index: usize,
    tally: Tally,
}

impl ResponseEvents {
    /// The events of the response `meta` names; the stream counted by `tally`, which the route
    /// opens once the stream starts ([`ResponseEvents::opened`]).
    pub(crate) fn new(meta: Meta, tally: Tally) -> Self {
        Self {
            meta,
            sequence: 0,
            tokens: Tokens::default(),
            started: false,
            message: None,
            text: String::new(),
            calls: Vec::new(),
            next_index: 0,
            tally,
        }
    }

    /// The stream started (its status is sent): counts it open, its first event now.
    pub(crate) fn opened(&mut self) {
        self.tally.open();
        self.tally.said();
    }

    /// `event: <kind>\ndata: <data with type and sequence_number>\n\n`.
    fn emit(&mut self, kind: &str, mut data: Value, out: &mut Out<Vec<u8>>) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let mut event = Vec::with_capacity(256);
        event.extend_from_slice(b"event: ");
        event.extend_from_slice(kind.as_bytes());
        event.extend_from_slice(b"\ndata: ");
        // Serializing a `Value` cannot fail.
        let _ = serde_json::to_writer(&mut event, &data);
        event.extend_from_slice(b"\n\n");
        out.push(event);
    }

    /// The output items so far, in order, as the response ending with `status` lists them
    /// (a failed response's items are incomplete).
    fn output(&self, status: Status) -> Vec<Value> {
        let status = match status {
            Status::Failed => Status::Incomplete,
            s => s,
        };
        let mut items: Vec<(usize, Value)> = self
            .calls
            .iter()
            .map(|c| {
                (
                    c.output_index,
                    function_call_item(&c.item_id, &c.call, status),
                )
            })
            .collect();
        if let Some(index) = self.message {
            items.push((
                index,
                message_item(&self.meta.message_id(), &self.text, status),
            ));
        }
        items.sort_by_key(|(i, _)| *i);
        items.into_iter().map(|(_, v)| v).collect()
    }

    /// The first record that says something: the answering model, and the lifecycle events.
    fn start(&mut self, first: &TextCompletionResponse, out: &mut Out<Vec<u8>>) {
        self.started = true;
        if let Some(model) = &first.model {
            self.meta.model.clone_from(model);
        }
        let response = response_object(&self.meta, Status::InProgress, Vec::new(), None, None);
        self.emit("response.created", json!({"response": response}), out);
        let response = response_object(&self.meta, Status::InProgress, Vec::new(), None, None);
        self.emit("response.in_progress", json!({"response": response}), out);
    }

    /// The message item and its text part, opened on the first text: its output index.
    fn open_message(&mut self, out: &mut Out<Vec<u8>>) -> usize {
        if let Some(i) = self.message {
            return i;
        }
        let id = self.meta.message_id();
        let i = self.next_index;
        self.next_index += 1;
        self.message = Some(i);
        let item = message_item(&id, "", Status::InProgress);
        self.emit(
            "response.output_item.added",
            json!({"output_index": i, "item": item}),
            out,
        );
        self.emit(
            "response.content_part.added",
            json!({"item_id": id, "output_index": i, "content_index": 0,
                   "part": output_text("")}),
            out,
        );
        i
    }

    /// A piece of text.
    fn text(&mut self, delta: &str, out: &mut Out<Vec<u8>>) {
        let index = self.open_message(out);
        self.text.push_str(delta);
        self.emit(
            "response.output_text.delta",
            json!({"item_id": self.meta.message_id(), "output_index": index, "content_index": 0,
                   "delta": delta, "logprobs": []}),
            out,
        );
    }

    /// A piece of a tool call: a new call's item opened on its first piece.
    fn call_piece(&mut self, piece: &sluice_schema::ToolCallDelta, out: &mut Out<Vec<u8>>) {
        let known = self.calls.iter().position(|c| c.index == piece.index);
        let at = match known {
            Some(at) if piece.id.is_none() && piece.name.is_none() => at,
            Some(at) => {
                // A call's id or name arriving later completes what its first piece lacked.
                let c = &mut self.calls[at];
                if let Some(id) = &piece.id {
                    c.call.id.clone_from(id);
                }
                if let Some(name) = &piece.name {
                    c.call.name.clone_from(name);
                }
                at
            }
            None => {
                let output_index = self.next_index;
                self.next_index += 1;
                let item_id = self.meta.call_item_id(self.calls.len());
                let call = ToolCall {
                    id: piece
                        .id
                        .clone()
                        .unwrap_or_else(|| format!("call_{item_id}")),
                    name: piece.name.clone().unwrap_or_default(),
                    arguments: String::new(),
                };
                let item = function_call_item(&item_id, &call, Status::InProgress);
                self.calls.push(CallItem {
                    index: piece.index,
                    output_index,
                    item_id,
                    call,
                });
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": output_index, "item": item}),
                    out,
                );
                self.calls.len() - 1
            }
        };
        if piece.arguments.is_empty() {
            return;
        }
        let c = &mut self.calls[at];
        c.call.arguments.push_str(&piece.arguments);
        let data = json!({"item_id": c.item_id, "output_index": c.output_index,
                          "delta": piece.arguments});
        self.emit("response.function_call_arguments.delta", data, out);
    }

    /// The end: every item done, then the whole response.
    fn finish(&mut self, status: Status, out: &mut Out<Vec<u8>>) {
        // An answer with nothing in it is an empty message, as a whole answer's.
        if self.calls.is_empty() {
            self.open_message(out);
        }
        if let Some(index) = self.message {
            let id = self.meta.message_id();
            let text = self.text.clone();
            self.emit(
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text,
                       "logprobs": []}),
                out,
            );
            self.emit(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                       "part": output_text(&text)}),
                out,
            );
            let item = message_item(&id, &text, status);
            self.emit(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
                out,
            );
        }
        let calls: Vec<(String, usize, ToolCall)> = self
            .calls
            .iter()
            .map(|c| (c.item_id.clone(), c.output_index, c.call.clone()))
            .collect();
        for (item_id, index, call) in calls {
            self.emit(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": index, "arguments": call.arguments}),
                out,
            );
            let item = function_call_item(&item_id, &call, Status::Completed);
            self.emit(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
                out,
            );
        }
        let mut output = self.output(status);
        for item in &mut output {
            if item["type"] == "function_call" {
                item["status"] = json!("completed");
            }
        }
        let response = response_object(&self.meta, status, output, Some(self.tokens), None);
        let kind = if status == Status::Incomplete {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(kind, json!({"response": response}), out);
    }
}

impl Encoder<TextCompletionResponse> for ResponseEvents {
    type Item = Vec<u8>;
    /// A failure before anything was emitted, as the HTTP error the route answers instead.
    type Done = Option<ApiError>;

    fn record(&mut self, r: TextCompletionResponse, out: &mut Out<Vec<u8>>) {
        self.tokens.input = self.tokens.input.saturating_add(r.in_token.unwrap_or(0));
        self.tokens.output = self.tokens.output.saturating_add(r.out_token.unwrap_or(0));
        if !self.started {
            if r.response.is_empty() && r.tool_calls.is_empty() && !r.is_terminal() {
                return;
            }
            self.start(&r, out);
        }
        if !r.response.is_empty() {
            self.text(&r.response, out);
        }
        for piece in &r.tool_calls {
            self.call_piece(piece, out);
        }
        if r.is_terminal() {
            self.finish(Status::of_finish(r.finish_reason.as_deref()), out);
            self.tally.ended(ClientOutcome::Success);
        }
    }

    fn end(&mut self, end: End<TextCompletionResponse>, out: &mut Out<Vec<u8>>) -> Self::Done {
        let failure = end.failure()?;
        let err = ApiError::from_error(&failure.error);
        if !self.started {
            self.tally.refused(err.status);
            return Some(err);
        }
        self.emit(
            "error",
            json!({"code": err.code, "message": err.message, "param": err.param}),
            out,
        );
        let output = self.output(Status::Failed);
        let response = response_object(
            &self.meta,
            Status::Failed,
            output,
            Some(self.tokens),
            Some(&err),
        );
        self.emit("response.failed", json!({"response": response}), out);
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

impl Restartable<TextCompletionResponse> for ResponseEvents {
    /// Given only while nothing was emitted (the route reads under `StartOver`): the new
    /// attempt simply starts the answer, its usage its own.
    fn restarted(&mut self, _: &mut Out<Vec<u8>>) {
        self.tokens = Tokens::default();
    }
}
