//! The AWS event-stream framing of a ConverseStream body: frames cut out of the bytes with
//! both CRCs checked, and the Converse events they carry turned into chunks.

use aws_smithy_types::event_stream::Message;
use bytes::{Buf, BytesMut};
use futures::StreamExt;
use serde_json::Value;

use super::usage;
use sluice_schema::ToolCallDelta;

use crate::provider::{Chunk, FailureKind, ProviderError, Usage};

/// The largest frame accepted. AWS caps an event-stream message at 16 MiB; a larger length
/// field is corruption, and waiting for that many bytes would stall the stream.
const MAX_FRAME: usize = 16 * 1024 * 1024;

/// The prelude: total length, headers length, prelude CRC.
const PRELUDE: usize = 12;

/// Cuts event-stream frames out of a byte stream, whatever its chunking.
#[derive(Debug, Default)]
struct FrameReader {
    buf: BytesMut,
}

impl FrameReader {
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received that do not make a whole frame yet.
    fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next whole frame, both CRCs verified; `None` until enough bytes arrived.
    fn next_frame(&mut self) -> Result<Option<Message>, ProviderError> {
        if self.buf.len() < PRELUDE {
            return Ok(None);
        }
        let word = |at: usize| {
            let mut b = &self.buf[at..at + 4];
            b.get_u32()
        };
        let total = usize::try_from(word(0)).unwrap_or(usize::MAX);
        // The prelude has its own CRC so a corrupted length is caught here, before waiting
        // for bytes that will never come.
        if crc32fast::hash(&self.buf[..8]) != word(8) {
            return Err(corrupt("prelude checksum mismatch"));
        }
        if !(PRELUDE + 4..=MAX_FRAME).contains(&total) {
            return Err(corrupt("impossible frame length"));
        }
        if self.buf.len() < total {
            return Ok(None);
        }
        let frame = self.buf.split_to(total).freeze();
        aws_smithy_eventstream::frame::read_message_from(frame)
            .map(Some)
            .map_err(|e| corrupt(&e.to_string()))
    }
}

fn corrupt(what: &str) -> ProviderError {
    ProviderError::new(
        FailureKind::Protocol,
        format!("corrupt bedrock event-stream frame: {what}"),
    )
}

/// What one frame means.
#[derive(Debug, PartialEq)]
enum Event {
    /// A text delta.
    Text(String),
    /// `messageStop`, with the stop reason.
    Stop(String),
    /// `metadata`, with the usage.
    Metadata(Option<Usage>),
    /// `contentBlockStart` of a tool use: the block's index, the call's id and name.
    ToolStart(u64, Option<String>, Option<String>),
    /// `contentBlockDelta` with a fragment of a tool use's input, and its block's index.
    ToolInput(u64, String),
    /// `contentBlockStop`, with the block's index.
    BlockStop(u64),
    /// `messageStart`, block start/stop, non-text deltas, unknown events.
    Ignore,
}

fn header<'a>(message: &'a Message, name: &str) -> Option<&'a str> {
    message
        .headers()
        .iter()
        .find(|h| h.name().as_str() == name)
        .and_then(|h| h.value().as_string().ok())
        .map(|s| s.as_str())
}

/// The failure kind of an in-stream `:exception-type`, and the HTTP status AWS documents for
/// the same exception outside a stream (so a retry policy's statuses apply to both).
fn exception_kind(exception: &str) -> (FailureKind, Option<u16>) {
    match exception {
        "throttlingException" => (FailureKind::RateLimited, Some(429)),
        // AWS documents these as transient ("retry your request").
        "modelStreamErrorException" => (FailureKind::Server, Some(424)),
        "internalServerException" => (FailureKind::Server, Some(500)),
        "serviceUnavailableException" => (FailureKind::Server, Some(503)),
        "modelTimeoutException" => (FailureKind::Server, Some(408)),
        "validationException" => (FailureKind::BadRequest, Some(400)),
        _ => (FailureKind::Stream, None),
    }
}

fn decode_frame(message: &Message) -> Result<Event, ProviderError> {
    let payload = || -> Result<Value, ProviderError> {
        serde_json::from_slice(message.payload()).map_err(|e| {
            ProviderError::new(
                FailureKind::Protocol,
                format!("unreadable bedrock event payload: {e}"),
            )
        })
    };
    match header(message, ":message-type") {
        Some("event") => {}
        Some("exception") => {
            let exception = header(message, ":exception-type").unwrap_or("exception");
            let detail: String = payload()
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_owned))
                .unwrap_or_default()
                .chars()
                .take(300)
                .collect();
            let (kind, status) = exception_kind(exception);
            return Err(ProviderError::new(
                kind,
                format!("bedrock reported {exception} mid-stream: {detail}"),
            )
            .with_status(status));
        }
        Some("error") => {
            return Err(ProviderError::new(
                FailureKind::Stream,
                format!(
                    "bedrock reported {} mid-stream: {}",
                    header(message, ":error-code").unwrap_or("an error"),
                    header(message, ":error-message").unwrap_or("")
                ),
            ));
        }
        other => {
            return Err(ProviderError::new(
                FailureKind::Protocol,
                format!(
                    "bedrock sent a frame of message type {:?}",
                    other.unwrap_or("(none)")
                ),
            ));
        }
    }
    let block = |v: &Value| v["contentBlockIndex"].as_u64().unwrap_or(0);
    Ok(match header(message, ":event-type").unwrap_or("") {
        "contentBlockStart" => {
            let v = payload()?;
            let tool = &v["start"]["toolUse"];
            if tool.is_object() {
                let field = |k: &str| tool[k].as_str().map(str::to_owned);
                Event::ToolStart(block(&v), field("toolUseId"), field("name"))
            } else {
                Event::Ignore
            }
        }
        "contentBlockDelta" => {
            let v = payload()?;
            match (
                v["delta"]["text"].as_str(),
                v["delta"]["toolUse"]["input"].as_str(),
            ) {
                (Some(text), _) => Event::Text(text.to_owned()),
                (None, Some(input)) => Event::ToolInput(block(&v), input.to_owned()),
                // Reasoning deltas carry no answer text.
                (None, None) => Event::Ignore,
            }
        }
        "contentBlockStop" => Event::BlockStop(block(&payload()?)),
        "messageStop" => Event::Stop(
            payload()?["stopReason"]
                .as_str()
                .unwrap_or("end_turn")
                .to_owned(),
        ),
        "metadata" => Event::Metadata(usage(&payload()?["usage"])),
        _ => Event::Ignore,
    })
}

/// Where a stream decoder is.
struct Decoding<B> {
    body: B,
    frames: FrameReader,
    stopped: bool,
    over: bool,
    /// The tool-use blocks begun: each block's index to its call's number and whether any of
    /// its input came yet.
    calls: std::collections::HashMap<u64, (u32, bool)>,
}

/// A chunk holding one piece of call `index`.
fn piece(index: u32, id: Option<String>, name: Option<String>, arguments: String) -> Chunk {
    Chunk {
        tool_calls: vec![ToolCallDelta {
            index,
            id,
            name,
            arguments,
        }],
        ..Chunk::default()
    }
}

/// Turns an event-stream body into chunks; see the `bedrock` module documentation for what
/// ends it.
pub(super) fn event_stream_chunks(
    body: impl futures::Stream<Item = Result<bytes::Bytes, reqwest::Error>> + Send + Unpin + 'static,
) -> impl futures::Stream<Item = Result<Chunk, ProviderError>> + Send + 'static {
    let state = Decoding {
        body,
        frames: FrameReader::default(),
        stopped: false,
        over: false,
        calls: std::collections::HashMap::new(),
    };
    futures::stream::unfold(state, |mut s| async move {
        if s.over {
            return None;
        }
        loop {
            let failure = match s.frames.next_frame() {
                Err(e) => e,
                Ok(Some(frame)) => match decode_frame(&frame) {
                    Err(e) => e,
                    Ok(Event::Ignore) => continue,
                    Ok(Event::ToolStart(block, id, name)) => {
                        let index = u32::try_from(s.calls.len()).unwrap_or(u32::MAX);
                        s.calls.insert(block, (index, false));
                        return Some((Ok(piece(index, id, name, String::new())), s));
                    }
                    Ok(Event::ToolInput(block, input)) => match s.calls.get_mut(&block) {
                        None => ProviderError::new(
                            FailureKind::Protocol,
                            format!(
                                "tool-use input for content block {block}, which began no tool use"
                            ),
                        ),
                        Some(_) if input.is_empty() => continue,
                        Some((index, any)) => {
                            *any = true;
                            let index = *index;
                            return Some((Ok(piece(index, None, None, input)), s));
                        }
                    },
                    // A tool called without input: `{}`, never empty arguments.
                    Ok(Event::BlockStop(block)) => match s.calls.get(&block).copied() {
                        Some((index, false)) => {
                            s.calls.insert(block, (index, true));
                            return Some((Ok(piece(index, None, None, "{}".into())), s));
                        }
                        _ => continue,
                    },
                    Ok(Event::Text(text)) if text.is_empty() => continue,
                    Ok(Event::Text(text)) => {
                        let chunk = Chunk {
                            text,
                            ..Chunk::default()
                        };
                        return Some((Ok(chunk), s));
                    }
                    Ok(Event::Stop(reason)) => {
                        s.stopped = true;
                        let chunk = Chunk {
                            finish_reason: Some(reason),
                            ..Chunk::default()
                        };
                        return Some((Ok(chunk), s));
                    }
                    Ok(Event::Metadata(usage)) => {
                        // Metadata is the last event; should one come early, keep reading.
                        s.over = s.stopped;
                        let chunk = Chunk {
                            usage,
                            ..Chunk::default()
                        };
                        return Some((Ok(chunk), s));
                    }
                },
                Ok(None) => match s.body.next().await {
                    Some(Ok(bytes)) => {
                        s.frames.push(&bytes);
                        continue;
                    }
                    Some(Err(e)) => ProviderError::new(
                        FailureKind::Truncated,
                        format!(
                            "the connection broke mid-stream: {}",
                            crate::providers::without_url(&e)
                        ),
                    ),
                    None if s.stopped => {
                        if s.frames.pending() > 0 {
                            tracing::warn!(
                                bytes = s.frames.pending(),
                                "bedrock stream ended inside a frame after messageStop"
                            );
                        }
                        return None;
                    }
                    None => ProviderError::new(
                        FailureKind::Truncated,
                        "the stream ended without messageStop: the answer is incomplete",
                    ),
                },
            };
            s.over = true;
            return Some((Err(failure), s));
        }
    })
}

#[cfg(test)]
mod tests {
    use aws_smithy_types::event_stream::{Header, HeaderValue as FrameValue};
    use serde_json::json;

    use super::*;

    fn frame(headers: &[(&'static str, &'static str)], payload: Value) -> Vec<u8> {
        let mut m = Message::new(payload.to_string().into_bytes());
        for (name, value) in headers {
            m = m.add_header(Header::new(*name, FrameValue::String((*value).into())));
        }
        let mut out = Vec::new();
        aws_smithy_eventstream::frame::write_message_to(&m, &mut out).unwrap();
        out
    }

    fn event(kind: &'static str, payload: Value) -> Vec<u8> {
        frame(
            &[
                (":message-type", "event"),
                (":event-type", kind),
                (":content-type", "application/json"),
            ],
            payload,
        )
    }

    fn exception(kind: &'static str) -> Vec<u8> {
        frame(
            &[(":message-type", "exception"), (":exception-type", kind)],
            json!({"message": "it went wrong"}),
        )
    }

    fn conversation() -> Vec<u8> {
        [
            event("messageStart", json!({"role": "assistant"})),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": "Hello"}}),
            ),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": " world"}}),
            ),
            event("contentBlockStop", json!({"contentBlockIndex": 0})),
            event("messageStop", json!({"stopReason": "end_turn"})),
            event(
                "metadata",
                json!({"usage": {"inputTokens": 10, "outputTokens": 5, "totalTokens": 15}, "metrics": {"latencyMs": 412}}),
            ),
        ]
        .concat()
    }

    fn drain(frames: &mut FrameReader, out: &mut Vec<Event>) -> Result<(), ProviderError> {
        while let Some(m) = frames.next_frame()? {
            out.push(decode_frame(&m)?);
        }
        Ok(())
    }

    fn expected() -> Vec<Event> {
        vec![
            Event::Ignore,
            Event::Text("Hello".into()),
            Event::Text(" world".into()),
            Event::BlockStop(0),
            Event::Stop("end_turn".into()),
            Event::Metadata(Some(Usage {
                input: 10,
                output: 5,
            })),
        ]
    }

    #[test]
    fn frames_decode_however_the_bytes_are_split() {
        let bytes = conversation();
        // Every split point into two writes, and all frames in one write.
        for at in 0..=bytes.len() {
            let mut frames = FrameReader::default();
            let mut out = Vec::new();
            frames.push(&bytes[..at]);
            drain(&mut frames, &mut out).unwrap();
            frames.push(&bytes[at..]);
            drain(&mut frames, &mut out).unwrap();
            assert_eq!(out, expected(), "split at {at}");
            assert_eq!(frames.pending(), 0);
        }
        // One byte at a time.
        let mut frames = FrameReader::default();
        let mut out = Vec::new();
        for b in &bytes {
            frames.push(std::slice::from_ref(b));
            drain(&mut frames, &mut out).unwrap();
        }
        assert_eq!(out, expected());
    }

    #[test]
    fn a_bad_crc_is_a_protocol_error() {
        let good = event("contentBlockDelta", json!({"delta": {"text": "Hi"}}));
        // A flipped payload byte fails the message CRC.
        let mut bad = good.clone();
        let at = bad.len() - 6;
        bad[at] ^= 0x20;
        let mut frames = FrameReader::default();
        frames.push(&bad);
        let e = frames.next_frame().unwrap_err();
        assert_eq!(e.kind, FailureKind::Protocol);
        assert!(e.message.contains("corrupt"), "{}", e.message);
        // A flipped length byte fails the prelude CRC at once, without waiting for the
        // (now huge) frame.
        let mut bad = good;
        bad[1] ^= 0x40;
        let mut frames = FrameReader::default();
        frames.push(&bad[..PRELUDE]);
        let e = frames.next_frame().unwrap_err();
        assert!(e.message.contains("prelude"), "{}", e.message);
    }

    #[test]
    fn exception_frames_become_the_right_failure_kind() {
        for (name, kind, status) in [
            ("throttlingException", FailureKind::RateLimited, Some(429)),
            ("modelStreamErrorException", FailureKind::Server, Some(424)),
            ("internalServerException", FailureKind::Server, Some(500)),
            (
                "serviceUnavailableException",
                FailureKind::Server,
                Some(503),
            ),
            ("modelTimeoutException", FailureKind::Server, Some(408)),
            ("validationException", FailureKind::BadRequest, Some(400)),
            ("somethingNewException", FailureKind::Stream, None),
        ] {
            let mut frames = FrameReader::default();
            frames.push(&exception(name));
            let e = decode_frame(&frames.next_frame().unwrap().unwrap()).unwrap_err();
            assert_eq!(e.kind, kind, "{name}");
            assert_eq!(e.status, status, "{name}");
            assert!(
                e.message.contains(name) && e.message.contains("it went wrong"),
                "{}",
                e.message
            );
        }
    }

    #[tokio::test]
    async fn the_stream_ends_after_metadata_and_is_truncated_without_message_stop() {
        let collect = |bytes: Vec<u8>| async move {
            let body = futures::stream::iter(
                bytes
                    .chunks(5)
                    .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
                    .collect::<Vec<_>>(),
            );
            event_stream_chunks(body).collect::<Vec<_>>().await
        };
        let items = collect(conversation()).await;
        let chunks: Vec<Chunk> = items.into_iter().map(Result::unwrap).collect();
        let text: String = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(text, "Hello world");
        assert_eq!(
            chunks.last().unwrap().usage,
            Some(Usage {
                input: 10,
                output: 5
            })
        );
        let mut cut = conversation();
        let stop = event("messageStop", json!({"stopReason": "end_turn"}));
        let metadata_len = cut.len() - cut.windows(stop.len()).position(|w| w == stop).unwrap();
        cut.truncate(cut.len() - metadata_len);
        let items = collect(cut).await;
        assert_eq!(
            items.last().unwrap().as_ref().unwrap_err().kind,
            FailureKind::Truncated
        );
    }

    /// Text, then two tool-use blocks whose frames interleave, one without input: each block
    /// one call numbered as they began (block 0 is text), fragments appended, `{}` for the one
    /// without input; input for a block that began no tool use is a protocol error.
    #[tokio::test]
    async fn tool_use_blocks_become_numbered_pieces() {
        let tool_start = |block: u64, id: &str, name: &str| {
            event(
                "contentBlockStart",
                json!({"contentBlockIndex": block, "start": {"toolUse": {"toolUseId": id, "name": name}}}),
            )
        };
        let input = |block: u64, fragment: &str| {
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": block, "delta": {"toolUse": {"input": fragment}}}),
            )
        };
        let stop_block =
            |block: u64| event("contentBlockStop", json!({"contentBlockIndex": block}));
        let bytes = [
            event("messageStart", json!({"role": "assistant"})),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": "Checking."}}),
            ),
            stop_block(0),
            tool_start(1, "tooluse_a", "weather"),
            tool_start(2, "tooluse_b", "time"),
            input(1, "{\"city\":"),
            stop_block(2),
            input(1, "\"Paris\"}"),
            stop_block(1),
            event("messageStop", json!({"stopReason": "tool_use"})),
        ]
        .concat();
        let body = futures::stream::iter(vec![Ok(bytes::Bytes::from(bytes))]);
        let chunks: Vec<Chunk> = event_stream_chunks(body)
            .map(Result::unwrap)
            .collect()
            .await;
        let pieces: Vec<ToolCallDelta> = chunks.iter().flat_map(|c| c.tool_calls.clone()).collect();
        assert_eq!(
            sluice_schema::tools::assemble(&pieces),
            vec![
                sluice_schema::ToolCall {
                    id: "tooluse_a".into(),
                    name: "weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into()
                },
                sluice_schema::ToolCall {
                    id: "tooluse_b".into(),
                    name: "time".into(),
                    arguments: "{}".into()
                },
            ]
        );
        let firsts: Vec<u32> = pieces
            .iter()
            .filter(|p| p.id.is_some())
            .map(|p| p.index)
            .collect();
        assert_eq!(firsts, [0, 1], "numbered as they began, not by block");
        assert_eq!(
            chunks.last().unwrap().finish_reason.as_deref(),
            Some("tool_use")
        );
        let stray = futures::stream::iter(vec![Ok(bytes::Bytes::from(input(4, "{")))]);
        let items: Vec<_> = event_stream_chunks(stray).collect().await;
        assert_eq!(items[0].as_ref().unwrap_err().kind, FailureKind::Protocol);
    }
}
