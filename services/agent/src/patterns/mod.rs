//! TrustGraph 2.11's orchestrator patterns beside ReAct: which pattern runs an iteration
//! ([`Pattern`]), meta-routing ([`route`]: the task type and the pattern chosen by the model
//! from the workspace's `agent-task-type` / `agent-pattern` entries), plan-then-execute
//! ([`plan`]), and the turn they share: one model call whose answer must be JSON of a given
//! shape ([`json_turn`]). The patterns' prompts are built-in minijinja templates named after
//! TrustGraph's prompt ids ([`TEMPLATES`]), each replaceable like the ReAct template.
//!
//! Like ReAct, every iteration is one request: it publishes its messages and hands the dialog
//! on over the agent's own request topic, so a replica's death repeats only its iteration.
//! Nothing here keeps a dialog's state in memory.

use std::time::Duration;

use sluice_runtime::{
    client::RequestOptions,
    processor::RequestContext,
    reader::{Encoder, End, Fail, Out},
};
use sluice_schema::{
    AgentMessageType, AgentResponse, PendingUsage, TextCompletionRequest, TextCompletionResponse,
};

pub(crate) use self::dispatch::Dispatch;
use crate::{
    handler::{AgentService, Dialog, message, read_policy, restarted, unsent},
    metrics::{DialogOutcome, IterationOutcome},
};

mod dispatch;
pub mod json_turn;
pub mod plan;
pub mod route;
pub mod supervisor;

/// How a dialog is run, as the request's `pattern` names it (TrustGraph 2.11's orchestrator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Interleaved reasoning and tool calls (`react`).
    React,
    /// A plan of tool steps made first, then executed one step an iteration, then a synthesis
    /// (`plan-then-execute`).
    PlanThenExecute,
    /// The question decomposed into goals answered by subagents (`supervisor`).
    Supervisor,
}

impl Pattern {
    /// Every pattern's name, as requests and the config service write them.
    pub const NAMES: [&'static str; 3] = ["react", "plan-then-execute", "supervisor"];

    /// The name requests carry.
    pub fn as_str(self) -> &'static str {
        match self {
            Pattern::React => "react",
            Pattern::PlanThenExecute => "plan-then-execute",
            Pattern::Supervisor => "supervisor",
        }
    }
}

impl std::str::FromStr for Pattern {
    type Err = String;

    /// A pattern's name; anything else is refused with the names there are (TrustGraph runs
    /// ReAct for a name it does not know; sluice says so instead of guessing).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "react" => Ok(Pattern::React),
            "plan-then-execute" => Ok(Pattern::PlanThenExecute),
            "supervisor" => Ok(Pattern::Supervisor),
            other => Err(format!(
                "unknown agent pattern {other:?}; the known patterns are {}",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// The patterns' built-in prompt templates (minijinja), by TrustGraph's prompt ids.
pub const TEMPLATES: [(&str, &str); 7] = [
    (
        "task-type-classify",
        include_str!("templates/task-type-classify.txt"),
    ),
    (
        "pattern-select",
        include_str!("templates/pattern-select.txt"),
    ),
    ("plan-create", include_str!("templates/plan-create.txt")),
    (
        "plan-step-execute",
        include_str!("templates/plan-step-execute.txt"),
    ),
    (
        "plan-synthesise",
        include_str!("templates/plan-synthesise.txt"),
    ),
    (
        "supervisor-decompose",
        include_str!("templates/supervisor-decompose.txt"),
    ),
    (
        "supervisor-synthesise",
        include_str!("templates/supervisor-synthesise.txt"),
    ),
];

/// What one model call of a pattern gave.
pub(crate) enum Generated {
    /// The whole answer.
    Text(String),
    /// The call failed (its usage is counted).
    Failed(sluice_schema::Error),
    /// The dialog's time ran out while the model answered.
    Deadline,
}

/// A pattern's model call read to its end: the usage counted into the dialog's, and, when
/// `answer` is set, each piece published as an `answer` record as it arrives.
struct Generating<'a> {
    usage: &'a mut PendingUsage,
    answer: bool,
    text: String,
}

impl Encoder<TextCompletionResponse> for Generating<'_> {
    type Item = AgentResponse;
    type Done = Generated;

    fn record(&mut self, r: TextCompletionResponse, out: &mut Out<AgentResponse>) {
        self.usage.add(&r);
        if self.answer && !r.response.is_empty() {
            out.push(message(
                self.usage,
                AgentMessageType::Answer,
                r.response.clone(),
                false,
                false,
            ));
        }
        self.text.push_str(&r.response);
    }

    fn end(&mut self, end: End<TextCompletionResponse>, _: &mut Out<AgentResponse>) -> Generated {
        let (failure, deadline) = match end {
            End::Answered => return Generated::Text(std::mem::take(&mut self.text)),
            End::Failed(f) => (f, false),
            End::Deadline(f) => (f, true),
        };
        if let Some(r) = &failure.record {
            self.usage.add(r);
        }
        if deadline {
            Generated::Deadline
        } else {
            Generated::Failed(failure.error)
        }
    }
}

impl AgentService {
    /// Calls the model once with `prompt` within `remaining` (streaming, its usage the
    /// dialog's); with `answer`, its pieces are published as the dialog's answer as they come.
    pub(crate) async fn generate(
        &self,
        prompt: String,
        answer: bool,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<Generated, sluice_schema::Error> {
        let request = TextCompletionRequest {
            prompt,
            streaming: true,
            ..TextCompletionRequest::default()
        };
        let options = RequestOptions {
            total_timeout: Some(remaining),
            ..ctx.on_behalf()
        };
        let call = async {
            // A restart ends the call: answer pieces of the abandoned attempt may be out.
            let reader = match self
                .llm
                .read(&request, options, read_policy(Fail(restarted())))
                .await
            {
                Ok(r) => r,
                Err(f) => return Ok(Generated::Failed(f.error)),
            };
            let generating = Generating {
                usage: &mut dialog.usage,
                answer,
                text: String::new(),
            };
            reader
                .drive(generating)
                .send_to(&mut *dialog.sink)
                .await
                .map_err(unsent)
        };
        // The reader's total timeout bounds the call; this bounds its start too.
        match tokio::time::timeout(remaining, call).await {
            Ok(generated) => generated,
            Err(_) => Ok(Generated::Deadline),
        }
    }

    /// A pattern's last step (plan-then-execute's and the supervisor's synthesis): the
    /// model's answer to `prompt` streamed as the dialog's answer (sent whole when the
    /// dialog does not stream), then the dialog's end; a failed call or the dialog's deadline
    /// ends it with that error. Counted as the iteration's and the dialog's outcome. A
    /// subagent's dialog captures its end for the fan-in instead of publishing it.
    pub(crate) async fn final_answer(
        &self,
        prompt: String,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), sluice_schema::Error> {
        let streaming = dialog.streaming;
        let (iteration, outcome, error) = match self
            .generate(prompt, streaming, dialog, ctx, remaining)
            .await?
        {
            Generated::Text(answer) => {
                self.metrics.iteration(IterationOutcome::Answer);
                self.metrics.dialog(DialogOutcome::Answer);
                let whole = if streaming { String::new() } else { answer };
                return dialog
                    .send(AgentMessageType::Answer, whole, true, true)
                    .await;
            }
            Generated::Failed(e) => (IterationOutcome::Error, DialogOutcome::Error, e),
            Generated::Deadline => (
                IterationOutcome::Error,
                DialogOutcome::Deadline,
                self.deadline_error(),
            ),
        };
        self.metrics.iteration(iteration);
        self.metrics.dialog(outcome);
        dialog.fail(error).await
    }

    /// Renders the pattern template `name` with `context`.
    pub(crate) fn render_template(
        &self,
        name: &str,
        context: serde_json::Value,
    ) -> Result<String, sluice_schema::Error> {
        self.env
            .get_template(name)
            .and_then(|t| t.render(context))
            .map_err(|e| {
                sluice_schema::Error::new(
                    sluice_schema::ErrorKind::Internal,
                    format!("the {name} prompt cannot be rendered: {e}"),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_parse_by_their_names_and_an_unknown_one_names_the_known_ones() {
        for name in Pattern::NAMES {
            assert_eq!(name.parse::<Pattern>().unwrap().as_str(), name);
        }
        let e = "reflexion".parse::<Pattern>().unwrap_err();
        assert!(e.contains("\"reflexion\""), "{e}");
        assert!(e.contains("react, plan-then-execute, supervisor"), "{e}");
    }
}
