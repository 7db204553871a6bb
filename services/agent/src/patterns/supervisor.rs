//! The supervisor, on the wire as TrustGraph 2.11's `SupervisorPattern`: a decomposing
//! iteration (`supervisor-decompose`: a JSON list of at most N goals) fans out one subagent
//! request per goal on the agent's request topic, any replica runs each as a dialog of its
//! own, the fan-in ([`crate::fanin`]) joins their ends on the bus, and a synthesising
//! iteration (`supervisor-synthesise`, streamed as the answer) answers from their results.
//!
//! The fan-out, in this order: the subagents' requests (their receipts awaited), then the
//! registration on the fan-in topic as the iteration's hand-off (the dialog's id, client,
//! trace, key, and the attempt it continues), which ends the attempt. Registering last is what
//! a hand-off allows (once handed on, the runtime acks the request whatever follows), and it
//! costs nothing: a completion that comes before its registration is held until the
//! registration or its deadline. A replica that dies before the registration leaves the
//! request unacked: its redelivery decomposes again under the same correlation id (the
//! dialog's id and its history's length), so the fan-in joins one fan-out, first completion
//! per goal winning.
//!
//! A subagent (a request with a correlation id) runs as any dialog but publishes no record
//! on the response topic: its answer, or its failure, becomes a completion (TrustGraph's
//! `subagent-completion` request, its usage pending) published straight to the fan-in topic.
//! A completion that arrives on the request topic (TrustGraph's way) is forwarded there.

use std::{sync::Arc, time::Duration};

use serde_json::{Value, json};
use sluice_runtime::{bus::Message, processor::RequestContext};
use sluice_schema::{AgentMessageType, AgentRequest, AgentStep, Error, ErrorKind, properties};
use tracing::{info, warn};

use super::json_turn::Turn;
use crate::{
    fanin::{self, COMPLETION_STEP, Completion, DECOMPOSE_STEP, Registration, SYNTHESISE_STEP},
    handler::{AgentService, Dialog},
    metrics::{DialogOutcome, IterationOutcome},
    tools::Tool,
};

/// The supervisor's most goals by default (TrustGraph's `MAX_SUBAGENTS`).
pub const DEFAULT_MAX_SUBAGENTS: usize = 5;

/// Whether `request` is a supervisor's subagent at work (a correlation id, and not its
/// completion).
pub fn is_subagent(request: &AgentRequest) -> bool {
    request
        .correlation_id
        .as_deref()
        .is_some_and(|c| !c.is_empty())
        && !request
            .history
            .iter()
            .any(|s| s.step_type.as_deref() == Some(COMPLETION_STEP))
}

/// The goals in `value`: a list of strings, at most `max` of them (TrustGraph keeps the
/// first `MAX_SUBAGENTS` too). Stricter than TrustGraph, which answers the question itself
/// as its one goal when the list is unusable: an empty list is refused.
pub(crate) fn check_goals(value: &Value, max: usize) -> Result<Vec<String>, String> {
    let items = value
        .as_array()
        .ok_or("the answer must be a JSON list of goals (strings)")?;
    let goals: Vec<String> = items
        .iter()
        .filter_map(Value::as_str)
        .map(str::trim)
        .filter(|g| !g.is_empty())
        .map(str::to_owned)
        .take(max.max(1))
        .collect();
    if goals.is_empty() {
        return Err("the list has no goal; give at least one goal as a string".to_owned());
    }
    Ok(goals)
}

/// `goals` as Python writes a list of strings (TrustGraph's thought shows `str(goals)`).
pub(crate) fn python_list(goals: &[String]) -> String {
    let items: Vec<String> = goals
        .iter()
        .map(|g| {
            let quote = if g.contains('\'') && !g.contains('"') {
                '"'
            } else {
                '\''
            };
            let mut s = String::from(quote);
            for c in g.chars() {
                match c {
                    '\\' => s.push_str("\\\\"),
                    '\n' => s.push_str("\\n"),
                    '\r' => s.push_str("\\r"),
                    '\t' => s.push_str("\\t"),
                    c if c == quote => {
                        s.push('\\');
                        s.push(c);
                    }
                    c => s.push(c),
                }
            }
            s.push(quote);
            s
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// The fan-out's correlation id: the dialog's id and the length of its history at the
/// fan-out, so that the same iteration delivered again fans out under the same one.
pub(crate) fn correlation_id(dialog_id: &str, history: usize) -> String {
    format!("{dialog_id}:{history}")
}

/// The goals a dialog's decomposition gave (from its history).
fn decomposed_goals(history: &[AgentStep]) -> Vec<String> {
    history
        .iter()
        .rev()
        .find(|s| s.step_type.as_deref() == Some(DECOMPOSE_STEP))
        .and_then(|s| s.arguments.get("goals"))
        .and_then(|g| serde_json::from_str(g).ok())
        .unwrap_or_default()
}

fn internal(e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Internal, e.to_string())
}

impl AgentService {
    /// One iteration of a supervisor dialog: the decomposition and fan-out, or (the fan-in
    /// having joined) the synthesis.
    pub(crate) async fn supervisor_iteration(
        &self,
        request: AgentRequest,
        available: &[&Arc<Tool>],
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        let synthesis = request
            .history
            .iter()
            .any(|s| s.step_type.as_deref() == Some(SYNTHESISE_STEP));
        if synthesis {
            self.synthesise_results(request, dialog, ctx, remaining)
                .await
        } else {
            self.decompose(request, available, dialog, ctx, remaining)
                .await
        }
    }

    async fn decompose(
        &self,
        mut request: AgentRequest,
        available: &[&Arc<Tool>],
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        let Some(fanin) = self.fanin.clone() else {
            self.metrics.iteration(IterationOutcome::Error);
            self.metrics.dialog(DialogOutcome::Error);
            return dialog
                .fail(Error::new(
                    ErrorKind::Agent,
                    "the supervisor pattern needs the agent's fan-in topic, which this agent was started without",
                ))
                .await;
        };
        let max = self.limits.max_subagents.max(1);
        let tools: Vec<_> = available
            .iter()
            .map(|t| json!({"name": t.config.name, "description": t.config.description}))
            .collect();
        let prompt = match self.render_template(
            "supervisor-decompose",
            json!({"question": request.question, "framing": request.framing.clone().unwrap_or_default(),
                   "max_subagents": max, "tools": tools}),
        ) {
            Ok(p) => p,
            Err(e) => return self.end_with(dialog, e).await,
        };
        let goals = match self
            .json_turn(
                "supervisor-decompose",
                prompt,
                |v| check_goals(v, max),
                dialog,
                ctx,
                remaining,
            )
            .await?
        {
            Turn::Valid(g) => g,
            Turn::Ended(ended) => return ended,
        };
        self.metrics.iteration(IterationOutcome::Action);
        let thought = format!(
            "Decomposed into {} sub-goals: {}",
            goals.len(),
            python_list(&goals)
        );
        if dialog.steps {
            dialog
                .send(AgentMessageType::Thought, thought.clone(), true, false)
                .await?;
        }
        let correlation = correlation_id(&ctx.id, request.history.len());
        let session = request
            .session_id
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        request.session_id = Some(session.clone());
        let timeout = u64::try_from(self.limits.fanin_timeout.as_millis()).unwrap_or(u64::MAX);
        let deadline = fanin::now_ms()
            .saturating_add(timeout)
            .min(request.deadline_ms.unwrap_or(u64::MAX));
        let goals_json = serde_json::to_string(&goals).map_err(internal)?;
        request.history.push(AgentStep {
            thought,
            action: DECOMPOSE_STEP.to_owned(),
            arguments: [("goals".to_owned(), goals_json.clone())].into(),
            observation: goals_json,
            step_type: Some(DECOMPOSE_STEP.to_owned()),
            user: request.user.clone(),
            ..AgentStep::default()
        });
        self.fan_out(&request, &goals, &correlation, &session, deadline, ctx)
            .await?;
        (request.pending_in_token, request.pending_out_token) = dialog.usage.take();
        let registration = Registration {
            correlation_id: correlation.clone(),
            goals,
            request,
            deadline_ms: deadline,
        };
        let payload = registration.encode().map_err(internal)?;
        dialog
            .sink
            .hand_off(&*fanin, payload)
            .await
            .map_err(|e| internal(format!("registering the fan-out failed: {e}")))?;
        self.metrics.fanin(fanin::Event::Fanout);
        info!(correlation = %correlation, subagents = registration.goals.len(), "supervisor fanned out");
        Ok(())
    }

    /// Publishes one subagent request per goal on the agent's request topic (TrustGraph's
    /// shape: pattern react, not streaming, a session of its own), each with the dialog's
    /// trace and key but not its client, under an id of its own: a subagent's records, were
    /// any published, reach nobody.
    async fn fan_out(
        &self,
        request: &AgentRequest,
        goals: &[String],
        correlation: &str,
        session: &str,
        deadline: u64,
        ctx: &RequestContext,
    ) -> Result<(), Error> {
        let mut receipts = Vec::with_capacity(goals.len());
        for (i, goal) in goals.iter().enumerate() {
            let sub = AgentRequest {
                question: goal.clone(),
                state: None,
                group: request.group.clone(),
                history: Vec::new(),
                collection: request.collection.clone(),
                streaming: false,
                session_id: Some(uuid::Uuid::new_v4().to_string()),
                conversation_id: request.conversation_id.clone(),
                pattern: Some("react".to_owned()),
                user: request.user.clone(),
                deadline_ms: Some(deadline),
                task_type: request.task_type.clone(),
                framing: request.framing.clone(),
                correlation_id: Some(correlation.to_owned()),
                parent_session_id: Some(session.to_owned()),
                subagent_goal: Some(goal.clone()),
                expected_siblings: u32::try_from(goals.len()).ok(),
                ..AgentRequest::default()
            };
            let mut message = Message::new(serde_json::to_vec(&sub).map_err(internal)?)
                .with_property(properties::ID, format!("{correlation}:{i}"))
                .with_property(properties::ORIGIN, ctx.origin.clone());
            for (key, value) in [
                (properties::TRACEPARENT, &ctx.traceparent),
                (properties::KEY, &ctx.key),
                (properties::KEY_SEAL, &ctx.key_seal),
            ] {
                if let Some(v) = value {
                    message = message.with_property(key, v.clone());
                }
            }
            let receipt = self
                .next_step
                .send(message)
                .await
                .map_err(|e| internal(format!("fanning out failed: {e}")))?;
            receipts.push(receipt);
        }
        for receipt in receipts {
            receipt
                .await
                .map_err(|e| internal(format!("fanning out failed: {e}")))?;
        }
        Ok(())
    }

    /// The synthesis: TrustGraph's thought, then `supervisor-synthesise` streamed as the
    /// answer, naming the goals that did not answer.
    async fn synthesise_results(
        &self,
        request: AgentRequest,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        if dialog.steps {
            dialog
                .send(
                    AgentMessageType::Thought,
                    "Synthesising final answer from sub-agent results".to_owned(),
                    true,
                    false,
                )
                .await?;
        }
        let step = request
            .history
            .iter()
            .rev()
            .find(|s| s.step_type.as_deref() == Some(SYNTHESISE_STEP));
        let answered = step.map(|s| s.subagent_results.clone()).unwrap_or_default();
        let goals = decomposed_goals(&request.history);
        let mut results: Vec<Value> = goals
            .iter()
            .filter_map(|g| answered.get(g).map(|r| json!({"goal": g, "result": r})))
            .collect();
        // Answers to goals the decomposition does not list (an older history) are kept too.
        results.extend(
            answered
                .iter()
                .filter(|(g, _)| !goals.contains(g))
                .map(|(g, r)| json!({"goal": g, "result": r})),
        );
        let missing: Vec<&String> = goals
            .iter()
            .filter(|g| !answered.contains_key(*g))
            .collect();
        let prompt = match self.render_template(
            "supervisor-synthesise",
            json!({"question": request.question, "framing": request.framing.clone().unwrap_or_default(),
                   "results": results, "missing": missing}),
        ) {
            Ok(p) => p,
            Err(e) => return self.end_with(dialog, e).await,
        };
        self.final_answer(prompt, dialog, ctx, remaining).await
    }

    /// A subagent's iteration is over (`ended`, its end captured in `dialog`): when it ended
    /// the subagent (not handed on to its next step), its completion goes to the fan-in
    /// topic as this attempt's hand-off. A failure is a completion too, never a hang of the
    /// fan-in; only the bus's failure hands the request back.
    pub(crate) async fn complete_subagent(
        &self,
        asked: &AgentRequest,
        ended: Result<(), Error>,
        dialog: &mut Dialog<'_>,
    ) -> Result<(), Error> {
        if dialog.sink.is_ended() {
            // Handed on to its next iteration.
            return ended;
        }
        let captured = dialog.capture.as_mut().and_then(|c| c.end.take());
        let result = match (captured, ended) {
            (Some(end), _) => end,
            (None, Err(e)) => Err(e.message),
            (None, Ok(())) => Err("the subagent ended without an answer".to_owned()),
        };
        if let Err(why) = &result {
            warn!(reason = %why, "subagent failed; its failure goes to the fan-in");
        }
        let completion = Completion::request(asked, result, dialog.usage.take());
        self.hand_completion(completion, dialog).await
    }

    /// A completion published on the agent's request topic: forwarded to the fan-in topic.
    pub(crate) async fn forward_completion(
        &self,
        mut request: AgentRequest,
        dialog: &mut Dialog<'_>,
    ) -> Result<(), Error> {
        // The dialog took its pending counts; they are the completion's.
        (request.pending_in_token, request.pending_out_token) = dialog.usage.take();
        self.hand_completion(request, dialog).await
    }

    async fn hand_completion(
        &self,
        completion: AgentRequest,
        dialog: &mut Dialog<'_>,
    ) -> Result<(), Error> {
        let Some(fanin) = self.fanin.clone() else {
            // No fan-in here: TrustGraph's way, on the request topic, for a replica that
            // has one (never the case for a request this replica forwards: refused).
            if dialog.capture.is_none() {
                return dialog
                    .fail(Error::new(
                        ErrorKind::Agent,
                        "a subagent completion came, but this agent runs no fan-in",
                    ))
                    .await;
            }
            let payload = serde_json::to_vec(&completion).map_err(internal)?;
            return dialog
                .sink
                .hand_off(&*self.next_step, payload)
                .await
                .map_err(|e| internal(format!("handing the completion on failed: {e}")));
        };
        let payload = serde_json::to_vec(&completion).map_err(internal)?;
        dialog
            .sink
            .hand_off(&*fanin, payload)
            .await
            .map_err(|e| internal(format!("handing the completion to the fan-in failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goals_are_a_list_of_strings_at_most_n() {
        assert_eq!(
            check_goals(&json!(["a", "b", "c"]), 2).unwrap(),
            ["a".to_owned(), "b".to_owned()]
        );
        assert!(check_goals(&json!({"goals": []}), 5).is_err());
        assert!(check_goals(&json!([]), 5).unwrap_err().contains("no goal"));
        assert!(check_goals(&json!([1, ""]), 5).is_err());
    }

    #[test]
    fn the_thought_writes_the_goals_as_python_does() {
        let goals = ["a b".to_owned(), "it's".to_owned(), "x\\y".to_owned()];
        assert_eq!(python_list(&goals), r#"['a b', "it's", 'x\\y']"#);
    }

    #[test]
    fn a_redelivered_fan_out_has_the_same_correlation() {
        assert_eq!(correlation_id("req-1", 0), correlation_id("req-1", 0));
        assert_ne!(correlation_id("req-1", 0), correlation_id("req-1", 2));
    }
}
