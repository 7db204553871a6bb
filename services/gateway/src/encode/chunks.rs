//! OpenAI's streamed chat completion: SSE `chat.completion.chunk` events (a role chunk first,
//! then the answer's text and tool-call pieces, a finish chunk, the usage chunk when asked for,
//! and `data: [DONE]`), or, after the stream started, one `data: {"error": ...}` event and the
//! end without `[DONE]`, which the OpenAI SDKs raise as an API error.
//!
//! Nothing is emitted until a record says something (text, a tool call, or the end): until
//! then a restart starts the answer over unseen, and a failure is still the route's HTTP error
//! (what [`Encoder::end`] returns, for `Driven::start` to give back).

use serde_json::{Value, json};
use sluice_runtime::{
    reader::{Encoder, End, Out, Restartable},
    telemetry::ClientOutcome,
};
use sluice_schema::{ResponseRecord, TextCompletionResponse, ToolCallDelta};

use super::Tally;
use crate::openai::ApiError;

/// Usage summed over a stream's records (they carry deltas), as OpenAI's `usage` object.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tokens {
    pub(crate) input: u64,
    pub(crate) output: u64,
}

impl Tokens {
    /// Adds a record's counts (deltas).
    pub(crate) fn add(&mut self, r: &TextCompletionResponse) {
        self.input = self.input.saturating_add(r.in_token.unwrap_or(0));
        self.output = self.output.saturating_add(r.out_token.unwrap_or(0));
    }

    /// OpenAI's `usage` object.
    pub(crate) fn usage(self) -> Value {
        json!({"prompt_tokens": self.input, "completion_tokens": self.output,
               "total_tokens": self.input.saturating_add(self.output)})
    }
}

/// What a chat stream hands out: an SSE event (`data: ...\n\n`), which the route numbers for a
/// resumable stream, or a keep-alive on silence, which it never numbers.
#[derive(Debug)]
pub(crate) enum ChunkItem {
    /// One SSE event, without its `id:` line.
    Event(Vec<u8>),
    /// An SSE comment: clients skip it, proxies see traffic.
    KeepAlive,
}

impl ChunkItem {
    /// A keep-alive's bytes.
    pub(crate) const KEEP_ALIVE: &'static [u8] = b": keep-alive\n\n";
}

/// A `chat.completion.chunk` as the stream sends it, serialized straight from borrowed fields:
/// a chunk per token is on every stream's path, and building a `serde_json::Value` and
/// printing it through `Display` cost five times the instructions. The fields are in the
/// order `json!` printed them before (serde_json's maps are sorted), so the bytes are the same.
#[derive(serde::Serialize)]
struct Chunk<'a> {
    choices: [Choice<'a>; 1],
    created: u64,
    id: &'a str,
    model: &'a str,
    object: &'static str,
    system_fingerprint: Option<&'static str>,
    /// `null` on every chunk of a stream asked for its usage, absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<&'static str>>,
}

#[derive(serde::Serialize)]
struct Choice<'a> {
    delta: Delta<'a>,
    finish_reason: Option<&'a str>,
    index: u32,
    logprobs: Option<&'static str>,
}

/// What a chunk adds to the answer; absent fields are not sent.
#[derive(Default, serde::Serialize)]
struct Delta<'a> {
    /// `Some(None)` is `"content": null` (the first chunk of an answer that starts with a
    /// tool call).
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[Value; 1]>,
}

/// `data: <json>\n\n`, the SSE event of one JSON value.
fn sse_data(v: &impl serde::Serialize) -> Vec<u8> {
    let mut event = Vec::with_capacity(320);
    event.extend_from_slice(b"data: ");
    // Serializing these types cannot fail: no map has keys that are not strings.
    let _ = serde_json::to_writer(&mut event, v);
    event.extend_from_slice(b"\n\n");
    event
}

/// A record's tool-call pieces as OpenAI streams them: the first piece of a call with its
/// `id`, `type` and `name` (and `arguments`, often empty), later ones with an argument
/// fragment only.
fn tool_call_delta(piece: &ToolCallDelta) -> Value {
    let mut function = json!({"arguments": piece.arguments});
    if piece.id.is_some() || piece.name.is_some() {
        function["name"] = json!(piece.name.as_deref().unwrap_or(""));
        json!({"index": piece.index, "id": piece.id.as_deref().unwrap_or(""),
               "type": "function", "function": function})
    } else {
        json!({"index": piece.index, "function": function})
    }
}

/// Text-completion records in, `chat.completion.chunk` events out.
pub(crate) struct Chunks {
    /// The completion's id (`chatcmpl-...`) and creation time, on every chunk.
    id: String,
    created: u64,
    /// The model every chunk names: the one asked for, until the first record that says
    /// something names the one that answers.
    model: String,
    /// `stream_options.include_usage`.
    include_usage: bool,
    tokens: Tokens,
    /// A record said something, and the role chunk went out.
    started: bool,
    tally: Tally,
}

impl Chunks {
    /// The chunks of completion `id`, created at `created`, asked of `model`; the stream
    /// counted by `tally`, which the route opens once the stream starts ([`Chunks::opened`]).
    pub(crate) fn new(
        id: String,
        created: u64,
        model: String,
        include_usage: bool,
        tally: Tally,
    ) -> Self {
        Self {
            id,
            created,
            model,
            include_usage,
            tokens: Tokens::default(),
            started: false,
            tally,
        }
    }

    /// The stream started (its status is sent): counts it open, its first event now.
    pub(crate) fn opened(&mut self) {
        self.tally.open();
        self.tally.said();
    }

    /// A chunk with one choice carrying `delta`. With `include_usage`, every chunk but the
    /// last carries `"usage": null`, as OpenAI's do.
    fn push_chunk(&self, delta: Delta<'_>, finish: Option<&str>, out: &mut Out<ChunkItem>) {
        out.push(ChunkItem::Event(sse_data(&Chunk {
            choices: [Choice {
                delta,
                finish_reason: finish,
                index: 0,
                logprobs: None,
            }],
            created: self.created,
            id: &self.id,
            model: &self.model,
            object: "chat.completion.chunk",
            system_fingerprint: None,
            usage: self.include_usage.then_some(None),
        })));
    }

    /// The first record that says something: the answering model, and the role chunk. As
    /// OpenAI: `content` null on the first chunk of an answer that starts with a tool call.
    fn start(&mut self, first: &TextCompletionResponse, out: &mut Out<ChunkItem>) {
        self.started = true;
        if let Some(model) = &first.model {
            self.model.clone_from(model);
        }
        let content = if first.response.is_empty() && !first.tool_calls.is_empty() {
            None
        } else {
            Some("")
        };
        let role = Delta {
            content: Some(content),
            role: Some("assistant"),
            ..Delta::default()
        };
        self.push_chunk(role, None, out);
    }
}

impl Encoder<TextCompletionResponse> for Chunks {
    type Item = ChunkItem;
    /// A failure before anything was emitted, as the HTTP error the route answers instead.
    type Done = Option<ApiError>;

    fn record(&mut self, r: TextCompletionResponse, out: &mut Out<ChunkItem>) {
        self.tokens.add(&r);
        if !self.started {
            if r.response.is_empty() && r.tool_calls.is_empty() && !r.is_terminal() {
                return;
            }
            self.start(&r, out);
        }
        if !r.response.is_empty() {
            let delta = Delta {
                content: Some(Some(&r.response)),
                ..Delta::default()
            };
            self.push_chunk(delta, None, out);
        }
        // One piece per chunk, as OpenAI sends them.
        for piece in &r.tool_calls {
            let delta = Delta {
                tool_calls: Some([tool_call_delta(piece)]),
                ..Delta::default()
            };
            self.push_chunk(delta, None, out);
        }
        if r.is_terminal() {
            let finish = r.finish_reason.as_deref().unwrap_or("stop");
            self.push_chunk(Delta::default(), Some(finish), out);
            if self.include_usage {
                let usage = json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "system_fingerprint": null,
                    "choices": [], "usage": self.tokens.usage(),
                });
                out.push(ChunkItem::Event(sse_data(&usage)));
            }
            out.push(ChunkItem::Event(b"data: [DONE]\n\n".to_vec()));
            self.tally.ended(ClientOutcome::Success);
        }
    }

    fn end(&mut self, end: End<TextCompletionResponse>, out: &mut Out<ChunkItem>) -> Self::Done {
        let failure = end.failure()?;
        let err = ApiError::from_error(&failure.error);
        if !self.started {
            self.tally.refused(err.status);
            return Some(err);
        }
        out.push(ChunkItem::Event(sse_data(&err.body())));
        self.tally
            .ended(ClientOutcome::of_error(&failure.error.kind));
        None
    }

    fn handed(&mut self, _: &mut ChunkItem, last: bool) {
        if last {
            self.tally.delivered();
        }
    }
}

impl Restartable<TextCompletionResponse> for Chunks {
    /// Given only while nothing was emitted (the route reads under `StartOver`): the new
    /// attempt simply starts the answer, its usage its own.
    fn restarted(&mut self, _: &mut Out<ChunkItem>) {
        self.tokens = Tokens::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streamed pieces become OpenAI's `delta.tool_calls`: the first of a call with its id,
    /// type and name, the rest with argument fragments only.
    #[test]
    fn tool_call_pieces_are_written_as_openai_streams_them() {
        let first = tool_call_delta(&ToolCallDelta {
            index: 1,
            id: Some("call_9".into()),
            name: Some("f".into()),
            arguments: String::new(),
        });
        assert_eq!(
            first,
            json!({"index": 1, "id": "call_9", "type": "function",
                   "function": {"name": "f", "arguments": ""}})
        );
        let more = tool_call_delta(&ToolCallDelta {
            index: 1,
            arguments: "{\"a\"".into(),
            ..Default::default()
        });
        assert_eq!(
            more,
            json!({"index": 1, "function": {"arguments": "{\"a\""}})
        );
    }
}
