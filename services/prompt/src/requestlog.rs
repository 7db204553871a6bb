//! The request log of the LLM streaming contract (docs/specs.md#the-structured-ndjson-contracts;
//! docs/prompt.md#request-log): one event when a prompt
//! request's model call starts, one per object its answer yields, one per line that is not
//! JSON, and one when it completes or fails, each with the request id.
//!
//! Content stays out of logs unless the operator opts in (`--log-content`): by default the
//! events carry counts, names and positions only. With content logging on, they also carry
//! exactly the contract's content fields: the call's `messages` (an array in the JSON log),
//! each object's `data` (an object), and a malformed line's text (`line`, at most
//! [`MAX_LINE_TEXT`] bytes). A malformed line's number is `line_number`, with or without.
//!
//! `request_id` is the request's origin (`RequestContext::origin`): the id its first hop was
//! given, so the prompt's log and text-completion's (which adds its own `call_id`) name one id.

use std::time::Instant;

use serde_json::{Value, json};
use sluice_schema::{Error, TextCompletionRequest};
use tracing::{Level, debug, enabled, info, warn};

/// The most of a malformed line a content log carries.
pub const MAX_LINE_TEXT: usize = 1024;

/// One prompt request's log.
#[derive(Debug)]
pub struct RequestLog {
    request_id: String,
    phase: String,
    content: bool,
    started: Instant,
    chunks: u64,
}

impl RequestLog {
    /// Logs `llm_request_started` for the call `completion`, made for request `request_id`
    /// with template `phase`; `num_blocks` is how many items of the request the answer should
    /// cover, when the template knows (see `crate::coverage`).
    pub fn start(
        request_id: &str,
        phase: &str,
        num_blocks: Option<u64>,
        content: bool,
        completion: &TextCompletionRequest,
    ) -> Self {
        if content {
            info!(event = "llm_request_started", request_id, phase, num_blocks,
                  messages = %messages(completion));
        } else {
            info!(event = "llm_request_started", request_id, phase, num_blocks);
        }
        Self {
            request_id: request_id.to_owned(),
            phase: phase.to_owned(),
            content,
            started: Instant::now(),
            chunks: 0,
        }
    }

    /// Logs `llm_response_chunk` for a piece of the answer: an object (json, jsonl) or a text
    /// delta (text). At debug level, unless content logging is on: someone who asked for the
    /// content wants it without turning on every module's debug output.
    pub fn chunk(&mut self, data: &dyn std::fmt::Display) {
        self.chunks += 1;
        let (request_id, chunk_num) = (self.request_id.as_str(), self.chunks);
        if self.content {
            info!(event = "llm_response_chunk", request_id, chunk_num, data = %data);
        } else if enabled!(Level::DEBUG) {
            debug!(event = "llm_response_chunk", request_id, chunk_num);
        }
    }

    /// The answer starts over (text-completion restarted it before anything was published):
    /// the chunks are counted again.
    pub fn restarted(&mut self) {
        self.chunks = 0;
    }

    /// Logs `malformed_json_line`: line `line_number` of the answer (1-based) is not a JSON
    /// object, for `reason` (which never quotes the line). `text` is the line, logged as the
    /// contract's `line` only with content logging on.
    pub fn malformed(&self, line_number: usize, text: &str, reason: &str) {
        let request_id = self.request_id.as_str();
        if self.content {
            warn!(event = "malformed_json_line", request_id, phase = %self.phase, line_number,
                  line = %clipped(text), error = reason);
        } else {
            warn!(event = "malformed_json_line", request_id, phase = %self.phase, line_number,
                  error = reason);
        }
    }

    /// Logs `llm_request_completed`.
    pub fn completed(&self) {
        info!(event = "llm_request_completed", request_id = %self.request_id,
              total_chunks = self.chunks, duration_ms = self.duration_ms());
    }

    /// Logs `llm_request_failed` with `error` (whose message never carries content).
    pub fn failed(&self, error: &Error) {
        warn!(event = "llm_request_failed", request_id = %self.request_id,
              error_type = %error.kind, error_message = %error.message,
              chunks_received = self.chunks, duration_ms = self.duration_ms());
    }

    fn duration_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// The call's messages in the chat shape the contract logs: the system prompt, then the turns.
fn messages(completion: &TextCompletionRequest) -> Value {
    let mut all = Vec::new();
    if !completion.system.is_empty() {
        all.push(json!({"role": "system", "content": completion.system}));
    }
    all.extend(
        completion
            .turns()
            .into_iter()
            .map(|t| json!({"role": t.role.as_str(), "content": t.content})),
    );
    Value::Array(all)
}

/// At most [`MAX_LINE_TEXT`] bytes of `text`, cut at a character boundary, `…` marking a cut.
fn clipped(text: &str) -> String {
    if text.len() <= MAX_LINE_TEXT {
        return text.to_owned();
    }
    let mut cut = MAX_LINE_TEXT;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn messages_are_the_system_prompt_then_the_turns() {
        let call = TextCompletionRequest {
            system: "be brief".into(),
            prompt: "hi".into(),
            ..Default::default()
        };
        assert_eq!(
            messages(&call),
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        );
    }

    #[test]
    fn a_long_line_is_clipped_at_a_character_boundary() {
        let long = "é".repeat(MAX_LINE_TEXT);
        let c = clipped(&long);
        assert!(c.len() <= MAX_LINE_TEXT + "…".len() && c.ends_with('…'));
        assert_eq!(clipped("short"), "short");
    }
}
