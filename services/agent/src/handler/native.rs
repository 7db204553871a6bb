//! Native tool calling (`--tool-calling native`): the tools go on the text-completion request
//! as tools, the model's calls come back as tool-call pieces on its records, and no text is
//! parsed. A model turn may call several tools: each is an action with its observation, all
//! run at once, and the turn is one iteration. A call's arguments are checked against the
//! tool's schema before the tool runs; arguments that do not match are the observation
//! (what is wrong, never their values), and the tool is not called.
//!
//! The model's text is held until its turn ends: only then is it known to be a thought
//! (the turn called tools) or the answer (it did not), so a native dialog publishes each
//! thought and the answer whole, not piece by piece.
//!
//! The conversation sent each iteration is the question, then per turn the assistant's text
//! and calls, then each call's result as a `tool` turn: the dialog's history, grouped by
//! `same_turn`, with each step's `call_id` (`step-<n>` for a ReAct step, which had none).

use std::{collections::BTreeMap, convert::Infallible, sync::Arc, time::Duration};

use serde_json::{Map, Value, json};
use sluice_runtime::{
    json_schema,
    processor::RequestContext,
    reader::{Encoder, End, Out, Report, Restartable, Whole},
};
use sluice_schema::{
    AgentMessageType, AgentRequest, AgentStep, ChatMessage, ChatRole, Error, ErrorKind,
    PendingUsage, TextCompletionRequest, TextCompletionResponse, ToolCall,
    tools::{self as calls, Tool as ToolSpec},
};
use tracing::{debug, warn};

use super::{AgentService, Dialog, read_policy};
use crate::{
    metrics::{DialogOutcome, IterationOutcome, ToolOutcome, kind_label},
    tools::{Tokens, Tool},
};

/// The system prompt of a native dialog.
const SYSTEM: &str = "Answer the user's question. Use the tools when they help: call them \
with arguments that match their schemas, several at once when they do not depend on each \
other. When you can answer, answer without calling a tool.";

/// What one model turn produced.
enum Turn {
    /// Its text, and the calls it made.
    Done(String, Vec<ToolCall>),
    Failed(Error),
    Deadline,
}

/// The JSON Schema of `tool`'s arguments: each an argument of its type, all required.
fn schema_of(tool: &Tool) -> Value {
    if tool.config.arguments.is_empty() {
        return calls::no_parameters();
    }
    let properties: Map<String, Value> = tool
        .config
        .arguments
        .iter()
        .map(|a| {
            let kind = match a.kind.as_str() {
                k @ ("string" | "number" | "integer" | "boolean" | "object" | "array") => k,
                _ => "string",
            };
            let mut p = json!({"type": kind});
            if !a.description.is_empty() {
                p["description"] = json!(a.description);
            }
            (a.name.clone(), p)
        })
        .collect();
    let required: Vec<&str> = tool
        .config
        .arguments
        .iter()
        .map(|a| a.name.as_str())
        .collect();
    json!({"type": "object", "properties": properties, "required": required})
}

/// A step's arguments (strings, as TrustGraph keeps them) as the JSON text of a call: a
/// string that reads as another JSON value is that value, as tools take it.
fn arguments_json(arguments: &BTreeMap<String, String>) -> String {
    let object: Map<String, Value> = arguments
        .iter()
        .map(|(k, v)| {
            let value = serde_json::from_str(v)
                .ok()
                .filter(|x: &Value| !x.is_string())
                .unwrap_or_else(|| Value::String(v.clone()));
            (k.clone(), value)
        })
        .collect();
    Value::Object(object).to_string()
}

/// A call's arguments as a step keeps them: strings as they are, other values as JSON text.
fn arguments_strings(arguments: &Map<String, Value>) -> BTreeMap<String, String> {
    arguments
        .iter()
        .map(|(k, v)| {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (k.clone(), text)
        })
        .collect()
}

/// The conversation of `request` so far: the question, then each turn's text and calls and
/// their results.
fn conversation(request: &AgentRequest) -> Vec<ChatMessage> {
    let mut turns = vec![ChatMessage::new(ChatRole::User, request.question.clone())];
    let mut results: Vec<ChatMessage> = Vec::new();
    for (n, step) in request.history.iter().enumerate() {
        let id = step.call_id.clone().unwrap_or_else(|| format!("step-{n}"));
        let call = ToolCall {
            id: id.clone(),
            name: step.action.clone(),
            arguments: step
                .call_arguments
                .clone()
                .unwrap_or_else(|| arguments_json(&step.arguments)),
        };
        match turns.last_mut() {
            Some(last) if step.same_turn && last.role == ChatRole::Assistant => {
                last.tool_calls.push(call);
            }
            _ => {
                turns.append(&mut results);
                let mut said = ChatMessage::new(ChatRole::Assistant, step.thought.clone());
                said.tool_calls.push(call);
                turns.push(said);
            }
        }
        let mut result = ChatMessage::new(ChatRole::Tool, step.observation.clone());
        result.tool_call_id = Some(id);
        results.push(result);
    }
    turns.append(&mut results);
    turns
}

/// The calls' observations published (with steps) and each call, its arguments and its
/// observation, a step of the dialog's history (the turn's text the first one's thought);
/// the last state a tool moved the dialog to is the dialog's.
async fn observed(
    request: &mut AgentRequest,
    dialog: &mut Dialog<'_>,
    text: &str,
    made: &[ToolCall],
    results: Vec<(String, Option<String>, Tokens)>,
    checked: Vec<Result<Map<String, Value>, String>>,
) -> Result<(), Error> {
    for (n, (call, (ran, args))) in made
        .iter()
        .zip(results.into_iter().zip(checked))
        .enumerate()
    {
        let step = AgentStep {
            thought: if n == 0 {
                text.to_owned()
            } else {
                String::new()
            },
            action: call.name.clone(),
            arguments: args.map(|a| arguments_strings(&a)).unwrap_or_default(),
            call_arguments: Some(call.arguments.clone()),
            observation: String::new(),
            step_type: Some("native".into()),
            user: request.user.clone(),
            call_id: Some(call.id.clone()),
            same_turn: n > 0,
            ..AgentStep::default()
        };
        dialog.observe(request, ran, step).await?;
    }
    Ok(())
}

/// The tools as the model is told them, each with its arguments' JSON Schema.
fn specs(available: &[&Arc<Tool>]) -> Vec<(ToolSpec, Value)> {
    available
        .iter()
        .map(|t| {
            let schema = schema_of(t);
            let spec = ToolSpec {
                name: t.config.name.clone(),
                description: (!t.config.description.is_empty())
                    .then(|| t.config.description.clone()),
                parameters: schema.clone(),
                strict: None,
            };
            (spec, schema)
        })
        .collect()
}

impl AgentService {
    /// One iteration of a native dialog: a model turn, then its calls run and the next step
    /// handed on, or its answer published.
    pub(super) async fn native_step(
        &self,
        mut request: AgentRequest,
        available: Vec<&Arc<Tool>>,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        let specs = specs(&available);
        let turns = conversation(&request);
        let asked = TextCompletionRequest {
            system: SYSTEM.to_owned(),
            prompt: TextCompletionRequest::flatten(&turns),
            messages: Some(turns),
            streaming: true,
            tools: (!specs.is_empty()).then(|| specs.iter().map(|(s, _)| s.clone()).collect()),
            ..TextCompletionRequest::default()
        };
        debug!(
            iteration = request.history.len(),
            tools = specs.len(),
            "thinking (native tool calls)"
        );
        let turn =
            match tokio::time::timeout(remaining, self.native_turn(&asked, dialog, ctx, remaining))
                .await
            {
                Ok(turn) => turn?,
                Err(_) => Turn::Deadline,
            };
        let (text, mut made) = match turn {
            Turn::Done(text, made) => (text, made),
            Turn::Failed(e) => {
                self.metrics.iteration(IterationOutcome::Error);
                self.metrics.dialog(DialogOutcome::Error);
                return dialog.fail(e).await;
            }
            Turn::Deadline => {
                self.metrics.iteration(IterationOutcome::Error);
                self.metrics.dialog(DialogOutcome::Deadline);
                return dialog.fail(self.deadline_error()).await;
            }
        };
        let text = text.trim().to_owned();
        if made.is_empty() && text.is_empty() {
            self.metrics.iteration(IterationOutcome::Error);
            self.metrics.dialog(DialogOutcome::Error);
            return dialog
                .fail(Error::new(
                    ErrorKind::Agent,
                    "the model answered nothing: no text and no tool call",
                ))
                .await;
        }
        // Calls a server gave no id (some OpenAI-compatible ones): one of ours, unique in the
        // dialog, so each result answers its own call.
        let turn_number = request.history.iter().filter(|s| !s.same_turn).count();
        for (n, call) in made.iter_mut().enumerate() {
            if call.id.is_empty() {
                call.id = format!("call-{turn_number}-{n}");
            }
        }
        // The tools get what is left of the dialog's time after the model's turn.
        let remaining = request.deadline_ms.map_or(remaining, |d| {
            Duration::from_millis(d.saturating_sub(super::now_ms()))
        });
        if made.is_empty() {
            self.metrics.iteration(IterationOutcome::Answer);
            self.metrics.dialog(DialogOutcome::Answer);
            return dialog
                .send(AgentMessageType::Answer, text, true, true)
                .await;
        }
        self.metrics.iteration(IterationOutcome::Action);
        if dialog.steps && !text.is_empty() {
            dialog
                .send(AgentMessageType::Thought, text.clone(), true, false)
                .await?;
        }
        // Each call's arguments, read and checked against its tool's schema.
        let checked: Vec<Result<Map<String, Value>, String>> = made
            .iter()
            .map(|call| {
                let schema = specs
                    .iter()
                    .find(|(s, _)| s.name == call.name)
                    .map(|(_, schema)| schema);
                check_arguments(call, schema)
            })
            .collect();
        if dialog.steps {
            for (call, args) in made.iter().zip(&checked) {
                // Arguments that are not a JSON object are shown as the model wrote them,
                // under an empty name (the observation that follows says what was wrong).
                let shown = match args {
                    Ok(a) => arguments_strings(a),
                    Err(_) => BTreeMap::from([(String::new(), call.arguments.clone())]),
                };
                dialog.send_action(call.name.clone(), shown).await?;
            }
        }
        // The calls run at once; their observations come in the order they were made.
        let runs = made
            .iter()
            .zip(&checked)
            .map(|(call, args)| self.run_call(&available, call, args, ctx, remaining));
        let results = futures::future::join_all(runs).await;
        observed(&mut request, dialog, &text, &made, results, checked).await?;
        self.hand_off(dialog, &mut request).await
    }

    /// Runs one call the model made with its checked `args`: its observation, the state it
    /// moves the dialog to, the tokens it spent. Arguments that do not match the tool's
    /// schema do not call it: the observation says what is wrong.
    async fn run_call(
        &self,
        available: &[&Arc<Tool>],
        call: &ToolCall,
        args: &Result<Map<String, Value>, String>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> (String, Option<String>, Tokens) {
        let problem = match args {
            Ok(a) => {
                return self
                    .run_tool(available, &call.name, &arguments_strings(a), ctx, remaining)
                    .await;
            }
            Err(problem) => problem,
        };
        let Some(t) = available.iter().find(|t| t.config.name == call.name) else {
            // An unknown name gets run_tool's own observation.
            return self
                .run_tool(available, &call.name, &BTreeMap::new(), ctx, remaining)
                .await;
        };
        warn!(tool = %call.name, %problem, "tool call arguments do not match the tool's schema; not called");
        self.metrics.tool_call(
            &t.config.name,
            kind_label(&t.config.kind),
            ToolOutcome::InvalidArguments,
            Duration::ZERO,
        );
        (
            format!(
                "The arguments for {} do not match its schema: {problem}. The tool was not called; call it again with arguments that match.",
                call.name
            ),
            None,
            Tokens::default(),
        )
    }

    /// Calls the model once for a native turn: its whole text and its calls.
    async fn native_turn(
        &self,
        asked: &TextCompletionRequest,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<Turn, Error> {
        let options = sluice_runtime::client::RequestOptions {
            total_timeout: Some(remaining),
            ..ctx.on_behalf()
        };
        // A restart is passed on and the turn read again: nothing of it was published yet.
        let reader = match self.llm.read(asked, options, read_policy(Report)).await {
            Ok(r) => r,
            Err(f) => return Ok(Turn::Failed(native_refusal(f.error))),
        };
        let turn = NativeTurn {
            usage: &mut dialog.usage,
            whole: Whole::default(),
        };
        Ok(reader.drive(turn).run().await)
    }
}

/// A native model turn: its text and tool calls put together, nothing published until it
/// ends; every attempt's usage goes to the dialog (the provider bills them all).
struct NativeTurn<'a> {
    usage: &'a mut PendingUsage,
    whole: Whole,
}

impl Encoder<TextCompletionResponse> for NativeTurn<'_> {
    type Item = Infallible;
    type Done = Turn;

    fn record(&mut self, r: TextCompletionResponse, _: &mut Out<Infallible>) {
        self.usage.add(&r);
        self.whole.add(r);
    }

    fn end(&mut self, end: End<TextCompletionResponse>, _: &mut Out<Infallible>) -> Turn {
        let (failure, deadline) = match end {
            End::Answered => {
                let calls = self.whole.tool_calls();
                return Turn::Done(std::mem::take(&mut self.whole.text), calls);
            }
            End::Failed(f) => (f, false),
            End::Deadline(f) => (f, true),
        };
        if let Some(r) = &failure.record {
            self.usage.add(r);
        }
        if deadline {
            Turn::Deadline
        } else {
            Turn::Failed(native_refusal(failure.error))
        }
    }
}

impl Restartable<TextCompletionResponse> for NativeTurn<'_> {
    /// Nothing of a native turn is published before it ends: the text-completion processor's
    /// answer starting over costs nothing but the pieces read so far.
    fn restarted(&mut self, _: &mut Out<Infallible>) {
        self.whole = Whole::default();
    }
}

/// `error`, with what to do when the text-completion processor's provider cannot call tools.
fn native_refusal(error: Error) -> Error {
    if error.kind == ErrorKind::InvalidRequest && error.message.contains("tools") {
        Error::new(
            error.kind.clone(),
            format!(
                "{} (the agent calls tools natively, --tool-calling native: give it a text-completion processor whose provider calls tools, or use --tool-calling react)",
                error.message
            ),
        )
    } else {
        error
    }
}

/// A call's arguments as an object, checked against its tool's `schema` (none: an unknown
/// tool, whose arguments are not checked here); what is wrong, never the values, otherwise.
fn check_arguments(call: &ToolCall, schema: Option<&Value>) -> Result<Map<String, Value>, String> {
    let text = call.arguments.trim();
    let value: Value = if text.is_empty() {
        json!({})
    } else {
        serde_json::from_str(text).map_err(|e| {
            format!(
                "they are not JSON (line {} column {})",
                e.line(),
                e.column()
            )
        })?
    };
    let Value::Object(object) = value else {
        return Err("they are not a JSON object".to_owned());
    };
    if let Some(schema) = schema {
        let validator = json_schema::compile(schema).map_err(|e| e.to_string())?;
        json_schema::check(&validator, &Value::Object(object.clone()))
            .map_err(|e| e.to_string())?;
    }
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(action: &str, id: Option<&str>, same_turn: bool, observation: &str) -> AgentStep {
        AgentStep {
            thought: if same_turn {
                String::new()
            } else {
                "thinking".into()
            },
            action: action.into(),
            arguments: BTreeMap::from([
                ("n".to_owned(), "2".to_owned()),
                ("s".to_owned(), "x".to_owned()),
            ]),
            observation: observation.into(),
            step_type: Some("native".into()),
            user: None,
            call_id: id.map(str::to_owned),
            same_turn,
            call_arguments: None,
            ..AgentStep::default()
        }
    }

    /// A ReAct step, then a turn of two calls: the assistant's calls grouped, each result a
    /// tool turn answering its id, after the turn's calls.
    #[test]
    fn history_becomes_a_conversation_of_turns() {
        let request = AgentRequest {
            question: "q?".into(),
            history: vec![
                step("a", None, false, "one"),
                step("b", Some("c1"), false, "two"),
                step("c", Some("c2"), true, "three"),
            ],
            ..AgentRequest::default()
        };
        let turns = conversation(&request);
        let roles: Vec<ChatRole> = turns.iter().map(|t| t.role).collect();
        assert_eq!(
            roles,
            [
                ChatRole::User,
                ChatRole::Assistant,
                ChatRole::Tool,
                ChatRole::Assistant,
                ChatRole::Tool,
                ChatRole::Tool
            ]
        );
        assert_eq!(turns[1].tool_calls[0].id, "step-0");
        assert_eq!(turns[1].tool_calls[0].arguments, r#"{"n":2,"s":"x"}"#);
        assert_eq!(turns[2].tool_call_id.as_deref(), Some("step-0"));
        assert_eq!(
            turns[3]
                .tool_calls
                .iter()
                .map(|c| c.id.as_str())
                .collect::<Vec<_>>(),
            ["c1", "c2"]
        );
        assert_eq!(turns[3].content, "thinking");
        assert_eq!(turns[4].content, "two");
        assert_eq!(turns[5].tool_call_id.as_deref(), Some("c2"));

        // A native step's own arguments go back exactly: the string "12" stays a string.
        let mut exact = step("d", Some("c3"), false, "four");
        exact.call_arguments = Some(r#"{"n":"12"}"#.into());
        let turns = conversation(&AgentRequest {
            question: "q?".into(),
            history: vec![exact],
            ..AgentRequest::default()
        });
        assert_eq!(turns[1].tool_calls[0].arguments, r#"{"n":"12"}"#);
    }

    #[test]
    fn arguments_are_checked_against_the_schema_without_quoting_them() {
        let schema =
            json!({"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]});
        let call = |args: &str| ToolCall {
            id: "c".into(),
            name: "add".into(),
            arguments: args.into(),
        };
        assert_eq!(
            check_arguments(&call(r#"{"a": 2}"#), Some(&schema)).unwrap()["a"],
            2
        );
        let e = check_arguments(&call(r#"{"a": "secret"}"#), Some(&schema)).unwrap_err();
        assert_eq!(e, "/a is not of type number");
        assert!(
            check_arguments(&call("[1]"), Some(&schema))
                .unwrap_err()
                .contains("not a JSON object")
        );
        assert!(
            check_arguments(&call("{"), None)
                .unwrap_err()
                .starts_with("they are not JSON")
        );
        assert_eq!(
            arguments_strings(&check_arguments(&call(r#"{"a": 2, "b": "x"}"#), None).unwrap()),
            BTreeMap::from([
                ("a".to_owned(), "2".to_owned()),
                ("b".to_owned(), "x".to_owned())
            ])
        );
    }
}
