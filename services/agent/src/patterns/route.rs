//! Meta-routing, as TrustGraph 2.11's `MetaRouter` does it: a first request with no pattern
//! and no history gets a task type, then a pattern, each chosen by the model from the
//! workspace's `agent-task-type` and `agent-pattern` entries (config service), or the tools
//! file's for a standalone agent. One choice or none is no model call. An answer that is not
//! one of the choices falls back as TrustGraph's does (the task type `general`, the task
//! type's first valid pattern), with a warning and a count; so does a failed model call.
//! The decision is written into the request before its first hand-off, so the dialog's later
//! iterations never route again.

use std::{collections::BTreeMap, time::Duration};

use serde_json::{Value, json};
use sluice_runtime::processor::RequestContext;
use sluice_schema::{AgentRequest, Error};
use tracing::{info, warn};

use super::Generated;
use crate::handler::{AgentService, Dialog};

/// TrustGraph's fallbacks.
const DEFAULT_PATTERN: &str = "react";
const DEFAULT_TASK_TYPE: &str = "general";

/// A task type: what kind of question, the patterns that suit it, and the framing its
/// prompts start with (an `agent-task-type` entry).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskType {
    /// What questions of this type are, for the model.
    pub description: Option<String>,
    /// The patterns a question of this type may run with; all configured ones when absent.
    pub valid_patterns: Option<Vec<String>>,
    /// Put at the head of the patterns' prompts.
    pub framing: String,
}

/// Meta-routing's choices: task types and patterns by id, as TrustGraph's config service has
/// them (`agent-task-type`, `agent-pattern`). With none configured, TrustGraph's defaults:
/// the task type `general` and the pattern `react`.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    task_types: BTreeMap<String, TaskType>,
    /// Pattern id -> its description.
    patterns: BTreeMap<String, Option<String>>,
}

impl Default for Routing {
    fn default() -> Self {
        Self::from_entries(&BTreeMap::new(), &BTreeMap::new())
    }
}

/// A string field of a config entry.
fn text(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_owned)
}

impl Routing {
    /// The choices of a workspace's `agent-task-type` and `agent-pattern` entries (id -> the
    /// entry's JSON text). An entry that is not a JSON object counts by its id alone, as
    /// TrustGraph reads it.
    pub fn from_entries(
        task_types: &BTreeMap<String, String>,
        patterns: &BTreeMap<String, String>,
    ) -> Self {
        let parse = |t: &String| serde_json::from_str::<Value>(t).unwrap_or(Value::Null);
        let mut routing = Routing {
            task_types: task_types
                .iter()
                .map(|(id, entry)| {
                    let v = parse(entry);
                    let valid = v.get("valid_patterns").and_then(Value::as_array).map(|a| {
                        a.iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect()
                    });
                    let task = TaskType {
                        description: text(&v, "description"),
                        valid_patterns: valid,
                        framing: text(&v, "framing").unwrap_or_default(),
                    };
                    (id.clone(), task)
                })
                .collect(),
            patterns: patterns
                .iter()
                .map(|(id, entry)| (id.clone(), text(&parse(entry), "description")))
                .collect(),
        };
        if routing.patterns.is_empty() {
            routing.patterns.insert(
                DEFAULT_PATTERN.to_owned(),
                Some("Interleaved reasoning and action".to_owned()),
            );
        }
        if routing.task_types.is_empty() {
            routing.task_types.insert(
                DEFAULT_TASK_TYPE.to_owned(),
                TaskType {
                    description: Some("General queries".to_owned()),
                    valid_patterns: Some(vec![DEFAULT_PATTERN.to_owned()]),
                    framing: String::new(),
                },
            );
        }
        routing
    }

    /// The choices of a tools file's `agent-task-type` and `agent-pattern` objects (id -> the
    /// entry, a JSON object as the config service's entry holds it).
    pub fn from_file_entries(
        task_types: &BTreeMap<String, Value>,
        patterns: &BTreeMap<String, Value>,
    ) -> Self {
        let texts = |m: &BTreeMap<String, Value>| -> BTreeMap<String, String> {
            m.iter().map(|(k, v)| (k.clone(), v.to_string())).collect()
        };
        Self::from_entries(&texts(task_types), &texts(patterns))
    }

    /// The framing of task type `id`, if it is configured.
    fn framing(&self, id: &str) -> String {
        self.task_types
            .get(id)
            .map(|t| t.framing.clone())
            .unwrap_or_default()
    }
}

/// The model's answer to a routing question as TrustGraph reads it: trimmed, lower case, with
/// no quotes.
fn choice(text: &str) -> String {
    text.trim().to_lowercase().replace(['"', '\''], "")
}

/// What a routing call gave.
enum Answer {
    /// The model's choice, read as [`choice`] reads it.
    Chose(String),
    /// The call failed: fall back.
    Failed,
}

impl AgentService {
    /// Routes `request` when it is a dialog's first (no pattern, no history): its task type,
    /// pattern and framing written into it. `Err` ends the dialog (its time ran out).
    pub(crate) async fn route(
        &self,
        request: &mut AgentRequest,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        let started = tokio::time::Instant::now();
        let routing = &self.routing;
        let (task_type, framing) = if routing.task_types.len() <= 1 {
            let id = routing
                .task_types
                .keys()
                .next()
                .map_or(DEFAULT_TASK_TYPE, String::as_str);
            (id.to_owned(), routing.framing(id))
        } else {
            let task_types: Vec<_> = routing
                .task_types
                .iter()
                .map(|(id, t)| json!({"name": id, "description": t.description.as_deref().unwrap_or(id)}))
                .collect();
            let prompt = self.render_template(
                "task-type-classify",
                json!({"question": request.question, "task_types": task_types}),
            )?;
            match self.ask(prompt, dialog, ctx, remaining).await? {
                Answer::Chose(id) if routing.task_types.contains_key(&id) => {
                    let framing = routing.framing(&id);
                    (id, framing)
                }
                answer => {
                    if let Answer::Chose(id) = answer {
                        warn!(answer = %id, "the model chose an unknown task type; falling back to {DEFAULT_TASK_TYPE}");
                    }
                    self.metrics.route_fallback("task-type");
                    (
                        DEFAULT_TASK_TYPE.to_owned(),
                        routing.framing(DEFAULT_TASK_TYPE),
                    )
                }
            }
        };
        let task = routing.task_types.get(&task_type);
        let valid: Vec<String> = task
            .and_then(|t| t.valid_patterns.clone())
            .unwrap_or_else(|| routing.patterns.keys().cloned().collect());
        let pattern = if valid.len() <= 1 {
            valid
                .first()
                .cloned()
                .unwrap_or_else(|| DEFAULT_PATTERN.to_owned())
        } else {
            let patterns: Vec<_> = valid
                .iter()
                .filter_map(|id| routing.patterns.get(id).map(|d| (id, d)))
                .map(|(id, d)| json!({"name": id, "description": d.as_deref().unwrap_or(id)}))
                .collect();
            let description = task
                .and_then(|t| t.description.clone())
                .unwrap_or_else(|| task_type.clone());
            let prompt = self.render_template(
                "pattern-select",
                json!({"question": request.question, "task_type": task_type,
                       "task_type_description": description, "patterns": patterns}),
            )?;
            let left = remaining.saturating_sub(started.elapsed());
            match self.ask(prompt, dialog, ctx, left).await? {
                Answer::Chose(p) if valid.contains(&p) => p,
                answer => {
                    if let Answer::Chose(p) = answer {
                        warn!(answer = %p, "the model chose a pattern not valid for the task type; falling back to {}", valid[0]);
                    }
                    self.metrics.route_fallback("pattern");
                    valid[0].clone()
                }
            }
        };
        info!(%pattern, %task_type, "routed");
        request.pattern = Some(pattern);
        request.task_type = Some(task_type);
        request.framing = Some(framing);
        Ok(())
    }

    /// One routing question to the model; its failure is a fallback, as TrustGraph's is, but
    /// the dialog's time running out ends the dialog.
    async fn ask(
        &self,
        prompt: String,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<Answer, Error> {
        match self.generate(prompt, false, dialog, ctx, remaining).await? {
            Generated::Text(t) => Ok(Answer::Chose(choice(&t))),
            Generated::Failed(e) => {
                warn!(error = %e, "a routing call failed; falling back");
                Ok(Answer::Failed)
            }
            Generated::Deadline => Err(self.deadline_error()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_nothing_configured_routing_is_react_for_general_questions() {
        let r = Routing::default();
        assert_eq!(r.task_types.keys().collect::<Vec<_>>(), ["general"]);
        assert_eq!(r.patterns.keys().collect::<Vec<_>>(), ["react"]);
    }

    #[test]
    fn entries_are_read_as_trustgraph_reads_them() {
        let task_types = BTreeMap::from([
            (
                "research".to_owned(),
                r#"{"description": "Multi-step research", "valid_patterns": ["plan-then-execute", "react"], "framing": "You are a researcher."}"#.to_owned(),
            ),
            ("chat".to_owned(), "not json".to_owned()),
        ]);
        let r = Routing::from_entries(&task_types, &BTreeMap::new());
        let research = &r.task_types["research"];
        assert_eq!(research.framing, "You are a researcher.");
        assert_eq!(
            research.valid_patterns.as_deref(),
            Some(&["plan-then-execute".to_owned(), "react".to_owned()][..])
        );
        assert_eq!(r.task_types["chat"], TaskType::default());
        assert_eq!(choice(" \"Research\"\n"), "research");
    }
}
