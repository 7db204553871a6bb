//! Plan-then-execute, on the wire as TrustGraph 2.11's `PlanThenExecutePattern`: a planning
//! iteration (`plan-create`: a JSON list of steps), then one iteration per step
//! (`plan-step-execute`: a JSON tool call, the tool run, the step completed with its result),
//! then a synthesis (`plan-synthesise`, streamed as the answer). The plan travels in the
//! history: each step after the planning one carries the plan as it stands, so an iteration
//! needs nothing but its request.
//!
//! Stricter than TrustGraph: a plan that is not a usable list after one corrective retry ends
//! the dialog with an `agent-error` (TrustGraph silently runs a one-step plan), and so does a
//! tool call that is not usable JSON twice.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use serde_json::{Value, json};
use sluice_runtime::processor::RequestContext;
use sluice_schema::{AgentMessageType, AgentRequest, AgentStep, Error, records::PlanStep};
use tracing::{debug, warn};

use super::json_turn::Turn;
use crate::{
    handler::{AgentService, Dialog},
    metrics::{IterationOutcome, ToolOutcome},
    tools::{Tokens, Tool},
};

/// A plan step as `plan-create` answers it (TrustGraph's `PlanStep` before it runs).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Planned {
    goal: String,
    tool_hint: String,
    depends_on: Vec<u32>,
}

/// The plan in `value`, or what is wrong with it (in words for the model).
pub(crate) fn check_plan(value: &Value) -> Result<Vec<Planned>, String> {
    let steps = value
        .as_array()
        .ok_or("the answer must be a JSON list of steps, not an object or a value")?;
    if steps.is_empty() {
        return Err("the plan has no steps; give at least one".to_owned());
    }
    steps
        .iter()
        .enumerate()
        .map(|(i, step)| {
            let goal = step
                .get("goal")
                .and_then(Value::as_str)
                .filter(|g| !g.trim().is_empty())
                .ok_or(format!("step {i} has no \"goal\" string"))?;
            let tool_hint = match step.get("tool_hint") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(_) => return Err(format!("step {i}'s \"tool_hint\" must be a string")),
            };
            let depends_on = match step.get("depends_on") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|d| {
                        d.as_u64()
                            .and_then(|d| u32::try_from(d).ok())
                            .filter(|d| (*d as usize) < i)
                            .ok_or(format!(
                                "step {i}'s \"depends_on\" must list the numbers of earlier steps (0 to {})",
                                i.saturating_sub(1)
                            ))
                    })
                    .collect::<Result<_, _>>()?,
                Some(_) => return Err(format!("step {i}'s \"depends_on\" must be a list")),
            };
            Ok(Planned {
                goal: goal.to_owned(),
                tool_hint,
                depends_on,
            })
        })
        .collect()
}

/// The tool call in `value` (its name and its arguments, each as text), or what is wrong.
pub(crate) fn check_call(value: &Value) -> Result<(String, BTreeMap<String, String>), String> {
    let tool = value
        .get("tool")
        .and_then(Value::as_str)
        .ok_or("the answer must be a JSON object with a \"tool\" string")?;
    let arguments = match value.get("arguments") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, v)| {
                // As TrustGraph passes them on: text as it is, anything else as JSON.
                let v = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), v)
            })
            .collect(),
        Some(_) => return Err("\"arguments\" must be a JSON object".to_owned()),
    };
    Ok((tool.to_owned(), arguments))
}

/// The plan as it stands: the last one in the history.
fn current_plan(history: &[AgentStep]) -> Option<Vec<PlanStep>> {
    history
        .iter()
        .rev()
        .find(|s| !s.plan.is_empty())
        .map(|s| s.plan.clone())
}

impl AgentService {
    /// One iteration of a plan-then-execute dialog: the plan made, its next pending step
    /// executed, or, when none is pending, the answer synthesised.
    pub(crate) async fn plan_iteration(
        &self,
        request: AgentRequest,
        available: &[&Arc<Tool>],
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        match current_plan(&request.history) {
            None => {
                self.make_plan(request, available, dialog, ctx, remaining)
                    .await
            }
            Some(plan) => match plan.iter().position(|s| s.status == "pending") {
                Some(next) => {
                    self.execute_step(request, plan, next, available, dialog, ctx, remaining)
                        .await
                }
                None => self.synthesise(request, plan, dialog, ctx, remaining).await,
            },
        }
    }

    /// The planning iteration: the plan asked for, announced, put in the history; handed on.
    async fn make_plan(
        &self,
        mut request: AgentRequest,
        available: &[&Arc<Tool>],
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        let tools: Vec<_> = available
            .iter()
            .map(|t| json!({"name": t.config.name, "description": t.config.description}))
            .collect();
        let prompt = match self.render_template(
            "plan-create",
            json!({"question": request.question,
                   "framing": request.framing.clone().unwrap_or_default(), "tools": tools}),
        ) {
            Ok(p) => p,
            Err(e) => return self.end_with(dialog, e).await,
        };
        let planned = match self
            .json_turn("plan-create", prompt, check_plan, dialog, ctx, remaining)
            .await?
        {
            Turn::Valid(p) => p,
            Turn::Ended(ended) => return ended,
        };
        self.metrics.iteration(IterationOutcome::Action);
        let thought = format!("Created plan with {} steps", planned.len());
        if dialog.steps {
            dialog
                .send(AgentMessageType::Thought, thought.clone(), true, false)
                .await?;
        }
        let observation = serde_json::to_string(&planned)
            .map_err(|e| Error::new(sluice_schema::ErrorKind::Internal, e.to_string()))?;
        let plan = planned
            .into_iter()
            .map(|p| PlanStep {
                goal: p.goal,
                tool_hint: p.tool_hint,
                depends_on: p.depends_on,
                status: "pending".to_owned(),
                result: String::new(),
            })
            .collect();
        request.history.push(AgentStep {
            thought,
            action: "plan".to_owned(),
            observation,
            step_type: Some("plan".to_owned()),
            user: request.user.clone(),
            plan,
            ..AgentStep::default()
        });
        self.hand_off(dialog, &mut request).await
    }

    /// An execution iteration: step `index` of `plan` run as one tool call, completed with
    /// its result; handed on.
    #[allow(clippy::too_many_arguments)]
    async fn execute_step(
        &self,
        mut request: AgentRequest,
        mut plan: Vec<PlanStep>,
        index: usize,
        available: &[&Arc<Tool>],
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        let started = tokio::time::Instant::now();
        let goal = plan[index].goal.clone();
        let previous_results: Vec<_> = plan[index]
            .depends_on
            .iter()
            .filter_map(|d| plan.get(*d as usize).map(|s| (d, s)))
            .filter(|(_, s)| !s.result.is_empty())
            .map(|(d, s)| json!({"index": d, "result": s.result}))
            .collect();
        let tools: Vec<_> = available
            .iter()
            .map(|t| {
                let arguments: Vec<_> = t
                    .config
                    .arguments
                    .iter()
                    .map(|a| json!({"name": a.name, "type": a.kind, "description": a.description}))
                    .collect();
                json!({"name": t.config.name, "description": t.config.description,
                       "arguments": arguments})
            })
            .collect();
        let prompt = match self.render_template(
            "plan-step-execute",
            json!({"goal": goal, "previous_results": previous_results, "tools": tools}),
        ) {
            Ok(p) => p,
            Err(e) => return self.end_with(dialog, e).await,
        };
        let (tool, arguments) = match self
            .json_turn(
                "plan-step-execute",
                prompt,
                check_call,
                dialog,
                ctx,
                remaining,
            )
            .await?
        {
            Turn::Valid(c) => c,
            Turn::Ended(ended) => return ended,
        };
        self.metrics.iteration(IterationOutcome::Action);
        debug!(step = index, %tool, "executing a plan step");
        if dialog.steps {
            dialog
                .send(
                    AgentMessageType::Thought,
                    format!("Step {index}: {goal} → calling {tool}"),
                    true,
                    false,
                )
                .await?;
        }
        let left = remaining.saturating_sub(started.elapsed());
        let (observation, next_state, tokens) = if available.iter().any(|t| t.config.name == tool) {
            self.run_tool(available, &tool, &arguments, ctx, left).await
        } else {
            // TrustGraph's words; the model's made-up name is never a label.
            warn!(step = index, "the plan step chose an unknown tool");
            self.metrics
                .tool_call("", "", ToolOutcome::Unknown, Duration::ZERO);
            (
                format!("Error: tool '{tool}' not found"),
                None,
                Tokens::default(),
            )
        };
        let result = observation.trim().to_owned();
        plan[index].status = "completed".to_owned();
        plan[index].result.clone_from(&result);
        let step = AgentStep {
            thought: format!("Executing plan step {index}: {goal}"),
            action: tool,
            arguments,
            step_type: Some("execute".to_owned()),
            user: request.user.clone(),
            plan,
            ..AgentStep::default()
        };
        dialog
            .observe(&mut request, (result, next_state, tokens), step)
            .await?;
        self.hand_off(dialog, &mut request).await
    }

    /// The last iteration: the answer synthesised from the steps' results, streamed as it
    /// comes, and the dialog's end with its usage.
    async fn synthesise(
        &self,
        request: AgentRequest,
        plan: Vec<PlanStep>,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        if dialog.steps {
            dialog
                .send(
                    AgentMessageType::Thought,
                    "Synthesising final answer from plan results".to_owned(),
                    true,
                    false,
                )
                .await?;
        }
        let steps: Vec<_> = plan
            .iter()
            .enumerate()
            .map(|(i, s)| json!({"index": i, "goal": s.goal, "result": s.result}))
            .collect();
        let prompt = match self.render_template(
            "plan-synthesise",
            json!({"question": request.question,
                   "framing": request.framing.clone().unwrap_or_default(), "steps": steps}),
        ) {
            Ok(p) => p,
            Err(e) => return self.end_with(dialog, e).await,
        };
        self.final_answer(prompt, dialog, ctx, remaining).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_is_a_list_of_goals_depending_only_on_earlier_steps() {
        let plan = check_plan(&json!([
            {"goal": "find the capital", "tool_hint": "lookup"},
            {"goal": "find its population", "depends_on": [0]}
        ]))
        .unwrap();
        assert_eq!(plan.len(), 2);
        assert_eq!(plan[1].depends_on, [0]);
        assert!(
            check_plan(&json!({"goal": "x"}))
                .unwrap_err()
                .contains("list")
        );
        assert!(check_plan(&json!([])).unwrap_err().contains("no steps"));
        assert!(
            check_plan(&json!([{"tool_hint": "x"}]))
                .unwrap_err()
                .contains("step 0")
        );
        assert!(
            check_plan(&json!([{"goal": "a", "depends_on": [0]}]))
                .unwrap_err()
                .contains("earlier steps")
        );
    }

    #[test]
    fn a_tool_call_is_a_name_and_arguments_as_text() {
        let (tool, args) =
            check_call(&json!({"tool": "lookup", "arguments": {"q": "x", "n": 3}})).unwrap();
        assert_eq!(tool, "lookup");
        assert_eq!(args["q"], "x");
        assert_eq!(args["n"], "3");
        assert!(
            check_call(&json!({"arguments": {}}))
                .unwrap_err()
                .contains("\"tool\"")
        );
        assert!(
            check_call(&json!({"tool": "x", "arguments": [1]}))
                .unwrap_err()
                .contains("object")
        );
    }
}
