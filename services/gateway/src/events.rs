//! The gateway's NDJSON event protocol (docs/protocol.md#gateway-events-ndjson-and-sse):
//! `status`, `token`, `done` and `error` events, one JSON object per line, each carrying
//! `trace_id` and `session_id`.
//!
//! What sluice adds, as optional fields a client of the plain protocol ignores: `message_type`
//! and `end_of_message` on agent tokens, `object` (the parsed JSON) on prompt objects, `usage`
//! and `model` on `done` (and a `jsonl` prompt's `objects_emitted` and `lines_skipped`), and a `restarted` status when the processor handling the request
//! went away and another one started the answer again (discard the tokens received so far).

use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;
use sluice_schema::{AgentMessageType, Error, ErrorKind};

/// Usage summed over a stream's records (they carry deltas).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct UsageTotal {
    /// Input tokens.
    pub in_token: Option<u64>,
    /// Output tokens.
    pub out_token: Option<u64>,
}

impl UsageTotal {
    pub(crate) fn add(&mut self, in_token: Option<u64>, out_token: Option<u64>) {
        self.in_token = sluice_schema::add_tokens(self.in_token, in_token);
        self.out_token = sluice_schema::add_tokens(self.out_token, out_token);
    }
}

/// The event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventType {
    /// A status change.
    Status,
    /// A piece of the answer.
    Token,
    /// The end of the stream.
    Done,
    /// A failure; a `done` with reason `error` follows.
    Error,
}

/// The statuses a `status` event announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Waiting for the model.
    Thinking,
    /// An agent is calling a tool.
    UsingTool,
    /// An agent is writing its answer.
    Writing,
    /// The answer is being produced again from the start (sluice's addition).
    Restarted,
}

/// Why a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// The answer is complete.
    Success,
    /// An `error` event preceded this.
    Error,
    /// The request was cancelled.
    Cancelled,
}

/// One event. `trace_id` and `session_id` are filled in when it is written.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    /// The event type.
    #[serde(rename = "type")]
    pub kind: EventType,
    /// The token text or the error message; `null` for status and done.
    pub content: Option<String>,
    /// `status` events: the new status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
    /// `done` events: why the stream ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// `error` events: the error's type (the record's `error.type`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_type: Option<String>,
    /// Agent tokens: what the content is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_type: Option<AgentMessageType>,
    /// Agent tokens: whether this ends its message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end_of_message: Option<bool>,
    /// Agent `action` tokens: the tool's arguments (the record's `arguments`; the content is
    /// the tool's name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<std::collections::BTreeMap<String, String>>,
    /// Prompt objects: the object itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub object: Option<serde_json::Value>,
    /// `done` events: the tokens used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageTotal>,
    /// `done` events: the model that answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// `done` events of `jsonl` prompts: the objects the answer produced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objects_emitted: Option<u64>,
    /// `done` events of `jsonl` prompts: the answer's lines skipped as malformed or invalid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lines_skipped: Option<u64>,
    /// `done` events of `jsonl` prompts whose contract names the request's items: how many.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub items_expected: Option<u64>,
    /// As `items_expected`: how many the answer covered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub items_answered: Option<u64>,
    /// As `items_expected`, where every item expects an object: the ids without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub items_pending: Option<Vec<String>>,
    /// The request's W3C trace id.
    pub trace_id: Arc<str>,
    /// The caller's session.
    pub session_id: Arc<str>,
}

impl Event {
    fn new(kind: EventType, content: Option<String>) -> Self {
        Self {
            kind,
            content,
            status: None,
            reason: None,
            error_type: None,
            message_type: None,
            end_of_message: None,
            arguments: None,
            object: None,
            usage: None,
            model: None,
            objects_emitted: None,
            lines_skipped: None,
            items_expected: None,
            items_answered: None,
            items_pending: None,
            trace_id: Arc::from(""),
            session_id: Arc::from(""),
        }
    }

    /// A `status` event.
    pub fn status(status: Status) -> Self {
        let mut e = Self::new(EventType::Status, None);
        e.status = Some(status);
        e
    }

    /// A `token` event.
    pub fn token(content: String) -> Self {
        Self::new(EventType::Token, Some(content))
    }

    /// An `error` event.
    pub fn error(error: &Error) -> Self {
        let mut e = Self::new(EventType::Error, Some(error.message.clone()));
        e.error_type = Some(error.kind.to_string());
        e
    }

    /// A `done` event.
    pub fn done(reason: Reason, usage: UsageTotal, model: Option<String>) -> Self {
        let mut e = Self::new(EventType::Done, None);
        e.reason = Some(reason);
        e.usage = Some(usage);
        e.model = model;
        e
    }

    /// The NDJSON line: the object and a single `\n`.
    pub fn to_line(&self) -> Bytes {
        let mut line = serde_json::to_vec(self).unwrap_or_else(|e| {
            // Serialising these plain fields cannot fail; if it ever does, say so in-protocol.
            let fallback = Event::error(&Error::new(ErrorKind::Internal, e.to_string()));
            serde_json::to_vec(&fallback).unwrap_or_default()
        });
        line.push(b'\n');
        Bytes::from(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_match_the_event_protocol() {
        let mut e = Event::status(Status::Thinking);
        e.trace_id = Arc::from("t");
        e.session_id = Arc::from("s");
        assert_eq!(
            &e.to_line()[..],
            br#"{"type":"status","content":null,"status":"thinking","trace_id":"t","session_id":"s"}
"#
        );
        let mut e = Event::token("Hello".into());
        e.trace_id = Arc::from("t");
        e.session_id = Arc::from("s");
        assert_eq!(
            &e.to_line()[..],
            br#"{"type":"token","content":"Hello","trace_id":"t","session_id":"s"}
"#
        );
        let e = Event::done(Reason::Success, UsageTotal::default(), None);
        let line = String::from_utf8(e.to_line().to_vec()).unwrap();
        assert!(line.starts_with(r#"{"type":"done","content":null,"reason":"success","#));
        let e = Event::error(&Error::new(ErrorKind::Llm, "no"));
        let line = String::from_utf8(e.to_line().to_vec()).unwrap();
        assert!(line.contains(r#""type":"error","content":"no","error_type":"llm-error""#));
        assert_eq!(line.matches('\n').count(), 1);
    }
}
