//! The three services the gateway fronts, as one trait: what their records are, how a
//! record becomes gateway events (docs/protocol.md#gateway-events-ndjson-and-sse), and how it
//! looks in a TrustGraph WebSocket frame.

use serde::{Serialize, de::DeserializeOwned};
use sluice_schema::{
    AgentMessageType, AgentRequest, AgentResponse, PromptRequest, PromptResponse, ResponseRecord,
    TextCompletionRequest, TextCompletionResponse,
};

use crate::events::{Event, Status, UsageTotal};

/// A service the gateway can route to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServiceKind {
    /// `text-completion`.
    TextCompletion,
    /// `prompt`.
    Prompt,
    /// `agent`.
    Agent,
}

impl ServiceKind {
    /// Every service.
    pub const ALL: [ServiceKind; 3] = [
        ServiceKind::TextCompletion,
        ServiceKind::Prompt,
        ServiceKind::Agent,
    ];

    /// The service's name in routes, topics and frames.
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceKind::TextCompletion => "text-completion",
            ServiceKind::Prompt => "prompt",
            ServiceKind::Agent => "agent",
        }
    }

    /// The service a name means.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

/// What a translation accumulates over one stream.
#[derive(Debug, Default)]
pub struct StreamState {
    /// Token usage so far.
    pub usage: UsageTotal,
    /// The model, once a record named it.
    pub model: Option<String>,
    /// The last status event sent.
    pub status: Option<Status>,
    /// `jsonl` prompts: the objects and skipped lines the terminal record counts.
    pub counts: Option<(u64, u64)>,
    /// `jsonl` prompts whose contract names the request's items: expected, answered, pending.
    pub items: Option<(u64, u64, Option<Vec<String>>)>,
    /// Agents: the caller asked for every step as `token` events (`?steps=true`); otherwise only
    /// the answer is, and the steps are `status` events, as the event protocol
    /// (docs/specs.md#the-event-protocol) intends.
    pub steps: bool,
}

impl StreamState {
    /// A fresh state for a stream, keeping what the caller asked for.
    pub fn restart(&mut self) {
        *self = Self {
            steps: self.steps,
            ..Self::default()
        };
    }
}

/// A service's records, as the gateway needs them.
pub trait Kind: Send + Sync + 'static {
    /// The request record.
    type Request: Serialize + DeserializeOwned + Send + Sync + 'static;
    /// The response record.
    type Response: ResponseRecord + Default + Clone;
    /// Which service this is.
    const KIND: ServiceKind;

    /// Asks for a streamed or a whole answer.
    fn set_streaming(request: &mut Self::Request, streaming: bool);

    /// Whether the request asks for a streamed answer (its `streaming` flag).
    fn streaming(request: &Self::Request) -> bool;

    /// The session id a request carries, if any (the agent's `session_id`).
    fn session_id(_request: &Self::Request) -> Option<String> {
        None
    }

    /// Notes what any record, error records included, tells the `done` event (a `jsonl`
    /// prompt's counts).
    fn note(_record: &Self::Response, _state: &mut StreamState) {}

    /// The events a non-error record stands for, pushed onto `out`; updates `state`.
    fn events(record: &Self::Response, state: &mut StreamState, out: &mut Vec<Event>);

    /// Why the event protocol cannot answer `request` (a 400 `invalid-request` before it is
    /// sent), or `None`. Default: it can.
    fn unanswerable(_request: &Self::Request) -> Option<String> {
        None
    }
}

/// The text-completion service.
pub struct TextCompletion;

impl Kind for TextCompletion {
    type Request = TextCompletionRequest;
    type Response = TextCompletionResponse;
    const KIND: ServiceKind = ServiceKind::TextCompletion;

    fn set_streaming(request: &mut Self::Request, streaming: bool) {
        request.streaming = streaming;
    }

    fn streaming(request: &Self::Request) -> bool {
        request.streaming
    }

    fn events(record: &Self::Response, state: &mut StreamState, out: &mut Vec<Event>) {
        state.usage.add(record.in_token, record.out_token);
        if record.model.is_some() {
            state.model.clone_from(&record.model);
        }
        if !record.response.is_empty() {
            out.push(Event::token(record.response.clone()));
        }
    }

    /// The events have no tool call: tools would reach the provider and its calls vanish.
    fn unanswerable(request: &Self::Request) -> Option<String> {
        request.uses_tools().then(|| {
            "invalid request: field `tools`: the event protocol has no tool-call event; \
             send requests with tools to POST /v1/chat/completions"
                .to_owned()
        })
    }
}

/// The prompt service.
pub struct Prompt;

#[cfg(test)]
mod tool_tests {
    use super::*;

    /// The event protocol has no tool-call event: a request with tools is refused there
    /// rather than answered without its calls.
    #[test]
    fn the_event_protocol_refuses_requests_with_tools() {
        let plain = TextCompletionRequest::default();
        assert_eq!(TextCompletion::unanswerable(&plain), None);
        let with_tools = TextCompletionRequest {
            tools: Some(vec![sluice_schema::Tool {
                name: "f".into(),
                description: None,
                parameters: sluice_schema::tools::no_parameters(),
                strict: None,
            }]),
            ..Default::default()
        };
        let why = TextCompletion::unanswerable(&with_tools).unwrap();
        assert!(why.contains("/v1/chat/completions"), "{why}");
    }
}

impl Kind for Prompt {
    type Request = PromptRequest;
    type Response = PromptResponse;
    const KIND: ServiceKind = ServiceKind::Prompt;

    fn note(record: &Self::Response, state: &mut StreamState) {
        if let (Some(objects), Some(skipped)) = (record.objects_emitted, record.lines_skipped) {
            state.counts = Some((objects, skipped));
        }
        if let (Some(expected), Some(answered)) = (record.items_expected, record.items_answered) {
            state.items = Some((expected, answered, record.items_pending.clone()));
        }
    }

    fn set_streaming(request: &mut Self::Request, streaming: bool) {
        request.streaming = streaming;
    }

    fn streaming(request: &Self::Request) -> bool {
        request.streaming
    }

    fn events(record: &Self::Response, state: &mut StreamState, out: &mut Vec<Event>) {
        state.usage.add(record.in_token, record.out_token);
        if record.model.is_some() {
            state.model.clone_from(&record.model);
        }
        if let Some(text) = record.text.as_ref().filter(|t| !t.is_empty()) {
            out.push(Event::token(text.clone()));
        }
        if let Some(object) = &record.object {
            // The record carries the object JSON-encoded; the event carries it both ways, so
            // a client reading only `content` still gets it
            // (docs/protocol.md#gateway-events-ndjson-and-sse).
            let mut event = Event::token(object.clone());
            event.object = serde_json::from_str(object).ok();
            out.push(event);
        }
    }
}

/// The agent service.
pub struct Agent;

impl Kind for Agent {
    type Request = AgentRequest;
    type Response = AgentResponse;
    const KIND: ServiceKind = ServiceKind::Agent;

    fn set_streaming(request: &mut Self::Request, streaming: bool) {
        request.streaming = streaming;
    }

    fn streaming(request: &Self::Request) -> bool {
        request.streaming
    }

    fn session_id(request: &Self::Request) -> Option<String> {
        request.session_id.clone()
    }

    fn events(record: &Self::Response, state: &mut StreamState, out: &mut Vec<Event>) {
        state.usage.add(record.in_token, record.out_token);
        if record.model.is_some() {
            state.model.clone_from(&record.model);
        }
        let status = match record.message_type {
            AgentMessageType::Thought => Some(Status::Thinking),
            AgentMessageType::Action | AgentMessageType::Observation => Some(Status::UsingTool),
            AgentMessageType::Answer => Some(Status::Writing),
            AgentMessageType::Error | AgentMessageType::Unknown => None,
        };
        if let Some(status) = status
            && state.status != Some(status)
        {
            state.status = Some(status);
            out.push(Event::status(status));
        }
        // An event-protocol client shows every token as the answer: the agent's thoughts, actions
        // and observations would read as if they were. They are `status` events (above)
        // unless the caller asked for the steps.
        let shown = state.steps || record.message_type == AgentMessageType::Answer;
        if shown && (!record.content.is_empty() || record.end_of_message) {
            let mut event = Event::token(record.content.clone());
            event.message_type = Some(record.message_type);
            event.end_of_message = Some(record.end_of_message);
            out.push(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_sums_deltas_and_stays_null_when_never_reported() {
        let mut u = UsageTotal::default();
        u.add(None, Some(2));
        u.add(Some(5), Some(3));
        assert_eq!(u.in_token, Some(5));
        assert_eq!(u.out_token, Some(5));
        let mut none = UsageTotal::default();
        none.add(None, None);
        assert_eq!(none, UsageTotal::default());
    }

    fn agent_events(steps: bool) -> Vec<String> {
        let mut state = StreamState {
            steps,
            ..StreamState::default()
        };
        let mut out = Vec::new();
        for (t, c) in [
            (AgentMessageType::Thought, "I should"),
            (AgentMessageType::Thought, " look"),
            (AgentMessageType::Action, "search"),
            (AgentMessageType::Observation, "found"),
            (AgentMessageType::Answer, "42"),
        ] {
            let r = AgentResponse {
                message_type: t,
                content: c.into(),
                ..Default::default()
            };
            Agent::events(&r, &mut state, &mut out);
        }
        out.iter()
            .map(|e| serde_json::to_string(e).unwrap())
            .collect()
    }

    #[test]
    fn agent_steps_are_status_events_and_only_the_answer_is_tokens() {
        let lines = agent_events(false);
        assert_eq!(
            lines,
            [
                r#"{"type":"status","content":null,"status":"thinking","trace_id":"","session_id":""}"#,
                r#"{"type":"status","content":null,"status":"using_tool","trace_id":"","session_id":""}"#,
                r#"{"type":"status","content":null,"status":"writing","trace_id":"","session_id":""}"#,
                r#"{"type":"token","content":"42","message_type":"answer","end_of_message":false,"trace_id":"","session_id":""}"#,
            ],
            "{lines:#?}"
        );
    }

    #[test]
    fn asked_for_the_steps_every_record_is_a_token_with_its_type() {
        let lines = agent_events(true);
        let statuses = lines
            .iter()
            .filter(|l| l.contains(r#""type":"status""#))
            .count();
        assert_eq!(statuses, 3, "{lines:#?}");
        assert!(lines[1].contains(r#""message_type":"thought""#));
        assert!(lines.iter().any(|l| l.contains(r#""content":"found""#)));
        assert!(lines.last().unwrap().contains(r#""content":"42""#));
        let mut state = StreamState {
            steps: true,
            status: Some(Status::Writing),
            ..StreamState::default()
        };
        state.restart();
        assert!(
            state.steps && state.status.is_none(),
            "a restart keeps what was asked"
        );
    }

    #[test]
    fn prompt_objects_arrive_as_content_and_as_parsed_json() {
        let mut state = StreamState::default();
        let mut out = Vec::new();
        let r = PromptResponse {
            object: Some(r#"{"a":1}"#.into()),
            ..Default::default()
        };
        Prompt::events(&r, &mut state, &mut out);
        let line = serde_json::to_string(&out[0]).unwrap();
        assert!(line.contains(r#""content":"{\"a\":1}""#), "{line}");
        assert!(line.contains(r#""object":{"a":1}"#), "{line}");
    }
}
