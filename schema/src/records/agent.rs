//! The agent's records: a dialog's request with its history of steps (TrustGraph 2.11's plan
//! and subagent results included), and the records of its answer.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{COALESCE_MAX_BYTES, Error, ResponseRecord, add_tokens};
use crate::de::null_default;

/// One step of an agent's history (TrustGraph's `AgentStep`; docs/protocol.md#records).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentStep {
    /// The model's reasoning for this step.
    #[serde(default, deserialize_with = "null_default")]
    pub thought: String,
    /// The tool the step invoked.
    #[serde(default, deserialize_with = "null_default")]
    pub action: String,
    /// The tool's arguments.
    #[serde(default, deserialize_with = "null_default")]
    pub arguments: BTreeMap<String, String>,
    /// What the tool returned.
    #[serde(default, deserialize_with = "null_default")]
    pub observation: String,
    /// TrustGraph's step type, when set.
    #[serde(default)]
    pub step_type: Option<String>,
    /// The step's user, as TrustGraph's streaming spec (docs/specs.md#trustgraphs-streaming-spec)
    /// and older TrustGraph write it, passed through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// sluice's, only when set: the id of the native tool call this step made
    /// (`--tool-calling native`), so the conversation sent back pairs the result with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    /// sluice's, only when set: this step's call was made in the same model turn as the
    /// step before (several native calls in one turn count as one iteration).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub same_turn: bool,
    /// sluice's, only when set: the native call's arguments as the model sent them (JSON
    /// text), so the conversation sent back shows them exactly (`arguments` keeps strings,
    /// as TrustGraph does, which cannot tell `"12"` from `12`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_arguments: Option<String>,
    /// TrustGraph 2.11's plan-then-execute: the plan a planning step wrote, each step's status
    /// and result as execution goes on. Written only when it has steps.
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub plan: Vec<PlanStep>,
    /// TrustGraph 2.11's supervisor: the subagents' answers, keyed by goal. Written only when
    /// it has answers.
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub subagent_results: BTreeMap<String, String>,
}

/// One step of a plan (TrustGraph 2.11's `PlanStep`, in an [`AgentStep`]'s `plan`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanStep {
    /// What the step is to achieve.
    #[serde(default, deserialize_with = "null_default")]
    pub goal: String,
    /// The tool the planner suggested for it.
    #[serde(default, deserialize_with = "null_default")]
    pub tool_hint: String,
    /// The indices of the steps it needs done first.
    #[serde(default, deserialize_with = "null_default")]
    pub depends_on: Vec<u32>,
    /// `pending`, `running`, `completed` or `failed`.
    #[serde(default = "pending", deserialize_with = "null_pending")]
    pub status: String,
    /// What executing it gave.
    #[serde(default, deserialize_with = "null_default")]
    pub result: String,
}

/// A plan step's status before it runs, as TrustGraph's default says.
fn pending() -> String {
    "pending".to_owned()
}

/// `null` read as [`pending`].
fn null_pending<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_else(pending))
}

/// A question for the agent, or the next iteration of a dialog (TrustGraph's `AgentRequest`;
/// docs/protocol.md#records).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentRequest {
    /// The user's question.
    #[serde(default, deserialize_with = "null_default")]
    pub question: String,
    /// Tool state filter.
    #[serde(default)]
    pub state: Option<String>,
    /// Tool group filter.
    #[serde(default)]
    pub group: Option<Vec<String>>,
    /// The steps taken so far; empty on the first iteration.
    #[serde(default, deserialize_with = "null_default")]
    pub history: Vec<AgentStep>,
    /// TrustGraph collection, passed through.
    #[serde(default)]
    pub collection: Option<String>,
    /// Stream the dialog as many records.
    #[serde(default, deserialize_with = "null_default")]
    pub streaming: bool,
    /// Session id, passed through.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Conversation id, passed through.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Agent pattern, passed through.
    #[serde(default)]
    pub pattern: Option<String>,
    /// Older TrustGraph's user field, passed through.
    #[serde(default)]
    pub user: Option<String>,
    /// When the dialog must be over, in milliseconds since the Unix epoch; set by the agent on
    /// its first iteration and carried through the next ones (sluice's addition).
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// Input tokens of earlier steps not yet published (a non-streaming dialog publishes
    /// only its answer), carried to the next step (sluice's addition).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_in_token: Option<u64>,
    /// Output tokens of earlier steps not yet published, as `pending_in_token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_out_token: Option<u64>,
    /// TrustGraph 2.11's orchestrator: the task type chosen for the question (from the config
    /// service's `agent-task-type` entries). This and the fields below are written only when
    /// set, so a record without them is written as before; TrustGraph writes them all, and a
    /// record read with them is written back with them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_type: Option<String>,
    /// The task type's domain framing, put into the prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framing: Option<String>,
    /// Links a supervisor's subagents to it, for the fan-in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// The session of the supervisor that started this subagent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
    /// The goal a supervisor gave this subagent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subagent_goal: Option<String>,
    /// How many subagents the supervisor started beside this one (itself included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_siblings: Option<u32>,
}

/// What an agent response record carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AgentMessageType {
    /// The model's reasoning.
    #[default]
    Thought,
    /// The tool being invoked, with its arguments.
    Action,
    /// The tool's result.
    Observation,
    /// The final answer.
    Answer,
    /// The terminal error.
    Error,
    /// Provenance of a step (TrustGraph 2.11's explainability: `explain_id`, `explain_graph`,
    /// `explain_triples`).
    Explain,
    /// A type this version does not know (written by a newer peer).
    #[serde(other)]
    Unknown,
}

/// One record of an agent dialog (TrustGraph's `AgentResponse`; docs/protocol.md#agent-messages).
///
/// The type field is written twice, as `message_type` (TrustGraph 2.x) and as `chunk_type`
/// (TrustGraph's streaming spec, older TrustGraph), so a client of either reads it; both names
/// are read, `message_type` first when a record has both.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(from = "AgentResponseIn")]
pub struct AgentResponse {
    /// What `content` is.
    pub message_type: AgentMessageType,
    /// The content: a token run, a tool's name (an `action`, as TrustGraph's streaming spec
    /// shows it), a tool result, an answer.
    pub content: String,
    /// True on the last piece of the current thought, action, observation or answer.
    pub end_of_message: bool,
    /// True on the last record of the dialog.
    pub end_of_dialog: bool,
    /// Identifies the message the piece belongs to.
    pub message_id: Option<String>,
    /// Set on the terminal error record.
    pub error: Option<Error>,
    /// Input tokens, as a delta.
    pub in_token: Option<u64>,
    /// Output tokens, as a delta.
    pub out_token: Option<u64>,
    /// The model used.
    pub model: Option<String>,
    /// sluice's, on an `action` record only: the tool's arguments, as the dialog's `AgentStep`
    /// keeps them. Written only when set, so no other record changes; TrustGraph's readers
    /// ignore it.
    pub arguments: Option<BTreeMap<String, String>>,
    /// TrustGraph 2.11's explainability, on an `explain` record: the step's root URI. This and
    /// the two below are written only when set (as TrustGraph writes them), and passed on as
    /// read.
    pub explain_id: Option<String>,
    /// The named graph the triples are in.
    pub explain_graph: Option<String>,
    /// The step's provenance triples, each as TrustGraph writes a triple.
    pub explain_triples: Vec<serde_json::Value>,
}

/// An [`AgentResponse`] as read: either name of the type field.
#[derive(Deserialize)]
struct AgentResponseIn {
    #[serde(default)]
    message_type: Option<AgentMessageType>,
    #[serde(default)]
    chunk_type: Option<AgentMessageType>,
    #[serde(default, deserialize_with = "null_default")]
    content: String,
    #[serde(default, deserialize_with = "null_default")]
    end_of_message: bool,
    #[serde(default, deserialize_with = "null_default")]
    end_of_dialog: bool,
    #[serde(default)]
    message_id: Option<String>,
    #[serde(default)]
    error: Option<Error>,
    #[serde(default)]
    in_token: Option<u64>,
    #[serde(default)]
    out_token: Option<u64>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    arguments: Option<BTreeMap<String, String>>,
    #[serde(default)]
    explain_id: Option<String>,
    #[serde(default)]
    explain_graph: Option<String>,
    #[serde(default, deserialize_with = "null_default")]
    explain_triples: Vec<serde_json::Value>,
}

impl From<AgentResponseIn> for AgentResponse {
    fn from(r: AgentResponseIn) -> Self {
        Self {
            message_type: r.message_type.or(r.chunk_type).unwrap_or_default(),
            content: r.content,
            end_of_message: r.end_of_message,
            end_of_dialog: r.end_of_dialog,
            message_id: r.message_id,
            error: r.error,
            in_token: r.in_token,
            out_token: r.out_token,
            model: r.model,
            arguments: r.arguments,
            explain_id: r.explain_id,
            explain_graph: r.explain_graph,
            explain_triples: r.explain_triples,
        }
    }
}

/// An [`AgentResponse`] as written: borrowed, so writing a record copies nothing.
#[derive(Serialize)]
struct AgentResponseOut<'a> {
    message_type: AgentMessageType,
    chunk_type: AgentMessageType,
    content: &'a str,
    end_of_message: bool,
    end_of_dialog: bool,
    message_id: &'a Option<String>,
    error: &'a Option<Error>,
    in_token: Option<u64>,
    out_token: Option<u64>,
    model: &'a Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: &'a Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    explain_id: &'a Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    explain_graph: &'a Option<String>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    explain_triples: &'a [serde_json::Value],
}

impl Serialize for AgentResponse {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        AgentResponseOut {
            message_type: self.message_type,
            chunk_type: self.message_type,
            content: &self.content,
            end_of_message: self.end_of_message,
            end_of_dialog: self.end_of_dialog,
            message_id: &self.message_id,
            error: &self.error,
            in_token: self.in_token,
            out_token: self.out_token,
            model: &self.model,
            arguments: &self.arguments,
            explain_id: &self.explain_id,
            explain_graph: &self.explain_graph,
            explain_triples: &self.explain_triples,
        }
        .serialize(serializer)
    }
}

impl ResponseRecord for AgentResponse {
    fn is_terminal(&self) -> bool {
        self.end_of_dialog
    }

    fn tokens(&self) -> (Option<u64>, Option<u64>) {
        (self.in_token, self.out_token)
    }

    fn from_error(error: Error) -> Self {
        Self {
            message_type: AgentMessageType::Error,
            content: error.message.clone(),
            end_of_message: true,
            end_of_dialog: true,
            error: Some(error),
            ..Self::default()
        }
    }

    fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }

    /// A piece of a thought or an answer still being written (the content a run of the
    /// model's tokens); actions and observations are whole messages and never merged.
    fn is_delta(&self) -> bool {
        matches!(
            self.message_type,
            AgentMessageType::Thought | AgentMessageType::Answer
        ) && !self.end_of_message
            && !self.end_of_dialog
            && self.error.is_none()
    }

    /// The next piece of the same message merges, its `end_of_message` and `end_of_dialog`
    /// included.
    fn coalesce(&mut self, next: Self) -> Result<(), Self> {
        if !self.is_delta()
            || next.error.is_some()
            || next.message_type != self.message_type
            || next.message_id != self.message_id
            || next.model != self.model
            || self.content.len() + next.content.len() > COALESCE_MAX_BYTES
        {
            return Err(next);
        }
        self.content.push_str(&next.content);
        self.end_of_message = next.end_of_message;
        self.end_of_dialog = next.end_of_dialog;
        self.in_token = add_tokens(self.in_token, next.in_token);
        self.out_token = add_tokens(self.out_token, next.out_token);
        Ok(())
    }
}
