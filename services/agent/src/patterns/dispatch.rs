//! Which pattern runs an iteration: a supervisor's fan-in (a subagent's completion), or the
//! request's pattern, routed first when a dialog's first request names none. An unknown
//! pattern ends the dialog with an `agent-error` naming the known ones.

use std::{sync::Arc, time::Duration};

use sluice_runtime::processor::RequestContext;
use sluice_schema::{AgentRequest, Error, ErrorKind};
use tracing::warn;

use super::Pattern;
use crate::{
    handler::{AgentService, Dialog},
    metrics::{DialogOutcome, IterationOutcome},
    tools::Tool,
};

/// What an iteration is, as [`AgentService::dispatch`] finds it.
pub(crate) enum Dispatch {
    /// An iteration of this pattern.
    Pattern(Pattern),
    /// A subagent's answer for its supervisor's fan-in (TrustGraph: a history with a
    /// `subagent-completion` step, and a correlation id).
    SubagentCompletion,
    /// The dialog ended here (its terminal record is out).
    Ended(Result<(), Error>),
}

impl AgentService {
    /// What `request`'s iteration is: a subagent's completion, or an iteration of its pattern;
    /// a dialog's first request with no pattern is routed first (the decision written into
    /// it, so that its later iterations carry it). An unknown pattern ends the dialog.
    pub(crate) async fn dispatch(
        &self,
        request: &mut AgentRequest,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<Dispatch, Error> {
        let completion = request
            .correlation_id
            .as_deref()
            .is_some_and(|c| !c.is_empty())
            && request
                .history
                .iter()
                .any(|s| s.step_type.as_deref() == Some("subagent-completion"));
        if completion {
            return Ok(Dispatch::SubagentCompletion);
        }
        if request.pattern.as_deref().unwrap_or_default().is_empty() && request.history.is_empty() {
            if let Err(e) = self.route(request, dialog, ctx, remaining).await {
                self.metrics.iteration(IterationOutcome::Error);
                self.metrics.dialog(if e.kind == ErrorKind::Timeout {
                    DialogOutcome::Deadline
                } else {
                    DialogOutcome::Error
                });
                return Ok(Dispatch::Ended(dialog.fail(e).await));
            }
        }
        // A dialog handed on by an older agent carries no pattern: ReAct, as before.
        let name = request.pattern.as_deref().unwrap_or_default();
        if name.is_empty() {
            return Ok(Dispatch::Pattern(Pattern::React));
        }
        match name.parse() {
            Ok(p) => Ok(Dispatch::Pattern(p)),
            Err(why) => Ok(Dispatch::Ended(self.refuse(dialog, &why).await)),
        }
    }

    /// Runs an iteration [`AgentService::dispatch`] found not to be ReAct's.
    pub(crate) async fn run_dispatched(
        &self,
        dispatch: Dispatch,
        request: AgentRequest,
        available: &[&Arc<Tool>],
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        match dispatch {
            Dispatch::Pattern(Pattern::React) => {
                // ReAct runs in the handler itself; nothing dispatches it here.
                Err(Error::new(
                    ErrorKind::Internal,
                    "a ReAct iteration was dispatched as another pattern",
                ))
            }
            Dispatch::Pattern(Pattern::PlanThenExecute) => {
                self.plan_iteration(request, available, dialog, ctx, remaining)
                    .await
            }
            Dispatch::Pattern(Pattern::Supervisor) => {
                self.supervisor_iteration(request, available, dialog, ctx, remaining)
                    .await
            }
            // A completion published on the request topic, as TrustGraph's subagents do.
            Dispatch::SubagentCompletion => self.forward_completion(request, dialog).await,
            Dispatch::Ended(ended) => ended,
        }
    }

    /// Ends the dialog with an `agent-error` saying `why`, counted as an error.
    async fn refuse(&self, dialog: &mut Dialog<'_>, why: &str) -> Result<(), Error> {
        warn!(reason = %why, "dialog refused");
        self.end_with(dialog, Error::new(ErrorKind::Agent, why))
            .await
    }

    /// Ends the dialog with `error`, counted as an iteration's error and the dialog's.
    pub(crate) async fn end_with(
        &self,
        dialog: &mut Dialog<'_>,
        error: Error,
    ) -> Result<(), Error> {
        self.metrics.iteration(IterationOutcome::Error);
        self.metrics.dialog(DialogOutcome::Error);
        dialog.fail(error).await
    }
}
