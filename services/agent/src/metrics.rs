//! The agent processor's metrics (`sluice_agent_*`), registered on the processor's registry
//! so they show on its `/metrics` beside the runtime's.
//!
//! Labels stay low-cardinality: a `tool` label only ever carries the name of a configured
//! tool, never a name the model made up (an unknown tool is counted with empty `tool` and
//! `kind`), and never arguments, questions or answers.

use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use crate::tools::ToolKind;

/// Buckets for tool calls: from a local MCP call (milliseconds) to a model behind a tool
/// (minutes).
const TOOL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// How one iteration (one request of the dialog) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IterationOutcome {
    /// The model chose a tool; the next step was handed on.
    Action,
    /// The model gave the final answer.
    Answer,
    /// The iteration ended the dialog with an error (model failure, output unreadable twice,
    /// the dialog's deadline).
    Error,
    /// The model's output could not be read and it was asked once more; the iteration is
    /// counted again with how it finally ended.
    Retry,
}

impl IterationOutcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Action => "action",
            Self::Answer => "answer",
            Self::Error => "error",
            Self::Retry => "retry",
        }
    }
}

/// How one tool call ended. Every outcome becomes the observation the model sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolOutcome {
    /// The tool answered.
    Success,
    /// The tool failed.
    Error,
    /// The tool did not answer within its time limit.
    Timeout,
    /// The model named a tool that does not exist (or is not available to the request).
    Unknown,
    /// The model's arguments did not match the tool's schema (native tool calling): the tool
    /// was not called.
    InvalidArguments,
}

impl ToolOutcome {
    /// The `outcome` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Unknown => "unknown",
            Self::InvalidArguments => "invalid_arguments",
        }
    }
}

/// How a dialog ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialogOutcome {
    /// A final answer.
    Answer,
    /// A terminal error other than the limits below.
    Error,
    /// The iteration limit was reached.
    MaxIterations,
    /// The dialog's total time ran out.
    Deadline,
}

impl DialogOutcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Answer => "answer",
            Self::Error => "error",
            Self::MaxIterations => "max-iterations",
            Self::Deadline => "deadline",
        }
    }
}

/// The `kind` label of a tool.
pub fn kind_label(kind: &ToolKind) -> &'static str {
    match kind {
        ToolKind::Prompt { .. } => "prompt",
        ToolKind::TextCompletion { .. } => "text-completion",
        ToolKind::Mcp { .. } => "mcp",
        ToolKind::Service { .. } => "service",
    }
}

/// The agent processor's metrics.
#[derive(Clone)]
pub struct AgentMetrics {
    iterations: IntCounterVec,
    tool_calls: IntCounterVec,
    tool_duration: HistogramVec,
    dialogs: IntCounterVec,
    fanin: IntCounterVec,
    route_fallbacks: IntCounterVec,
}

impl AgentMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let iterations = IntCounterVec::new(
            Opts::new(
                "sluice_agent_iterations_total",
                "Agent iterations (one model decision each) by outcome: action, answer, error; retry counts corrective retries",
            ),
            &["outcome"],
        )?;
        let tool_calls = IntCounterVec::new(
            Opts::new(
                "sluice_agent_tool_calls_total",
                "Tool calls by tool, kind and outcome (success, error, timeout, unknown); unknown tools have empty tool and kind",
            ),
            &["tool", "kind", "outcome"],
        )?;
        let tool_duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_agent_tool_duration_seconds",
                "Time a tool call took, failures and timeouts included",
            )
            .buckets(TOOL_BUCKETS.to_vec()),
            &["kind"],
        )?;
        let dialogs = IntCounterVec::new(
            Opts::new(
                "sluice_agent_dialogs_total",
                "Dialogs ended, by outcome: answer, error, max-iterations, deadline",
            ),
            &["outcome"],
        )?;
        let fanin = IntCounterVec::new(
            Opts::new(
                "sluice_agent_fanin_total",
                "The supervisor's fan-out and fan-in, by event: fanout, completion, join-complete, join-deadline, dropped-duplicate, dropped-finished, dropped-orphan, takeover",
            ),
            &["event"],
        )?;
        for event in crate::fanin::Event::ALL {
            // Each at 0 from the start: a replica that never held the fan-in shows so.
            fanin.with_label_values(&[event.as_str()]);
        }
        registry.register(Box::new(fanin.clone()))?;
        registry.register(Box::new(iterations.clone()))?;
        registry.register(Box::new(tool_calls.clone()))?;
        registry.register(Box::new(tool_duration.clone()))?;
        let route_fallbacks = IntCounterVec::new(
            Opts::new(
                "sluice_agent_route_fallbacks_total",
                "Meta-routing decisions that fell back to TrustGraph's default (the model's answer was not one of the choices, or its call failed), by decision: task-type, pattern",
            ),
            &["decision"],
        )?;
        registry.register(Box::new(dialogs.clone()))?;
        for decision in ["task-type", "pattern"] {
            // At 0 from the start, as the docs list it (docs/metrics.md).
            route_fallbacks.with_label_values(&[decision]);
        }
        registry.register(Box::new(route_fallbacks.clone()))?;
        Ok(Self {
            iterations,
            tool_calls,
            tool_duration,
            dialogs,
            fanin,
            route_fallbacks,
        })
    }

    /// Counts one fan-out or fan-in event (see [`crate::fanin::Event`]).
    pub fn fanin(&self, event: crate::fanin::Event) {
        self.fanin.with_label_values(&[event.as_str()]).inc();
    }

    /// A meta-routing `decision` (`task-type` or `pattern`) fell back to the default.
    pub(crate) fn route_fallback(&self, decision: &'static str) {
        self.route_fallbacks.with_label_values(&[decision]).inc();
    }

    pub(crate) fn iteration(&self, outcome: IterationOutcome) {
        self.iterations.with_label_values(&[outcome.as_str()]).inc();
    }

    pub(crate) fn tool_call(&self, tool: &str, kind: &str, outcome: ToolOutcome, took: Duration) {
        self.tool_calls
            .with_label_values(&[tool, kind, outcome.as_str()])
            .inc();
        if outcome != ToolOutcome::Unknown {
            self.tool_duration
                .with_label_values(&[kind])
                .observe(took.as_secs_f64());
        }
    }

    pub(crate) fn dialog(&self, outcome: DialogOutcome) {
        self.dialogs.with_label_values(&[outcome.as_str()]).inc();
    }
}

#[cfg(test)]
mod tests {
    use prometheus::{Encoder, TextEncoder};

    use super::*;

    #[test]
    fn names_and_labels_are_the_documented_ones() {
        let registry = Registry::new();
        let m = AgentMetrics::register(&registry).unwrap();
        m.iteration(IterationOutcome::Retry);
        m.tool_call("add", "mcp", ToolOutcome::Timeout, Duration::from_millis(5));
        m.tool_call("", "", ToolOutcome::Unknown, Duration::ZERO);
        m.dialog(DialogOutcome::MaxIterations);
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&registry.gather(), &mut out)
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        for line in [
            r#"sluice_agent_iterations_total{outcome="retry"} 1"#,
            r#"sluice_agent_tool_calls_total{kind="mcp",outcome="timeout",tool="add"} 1"#,
            r#"sluice_agent_tool_calls_total{kind="",outcome="unknown",tool=""} 1"#,
            r#"sluice_agent_tool_duration_seconds_count{kind="mcp"} 1"#,
            r#"sluice_agent_dialogs_total{outcome="max-iterations"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(
            !text.contains(r#"sluice_agent_tool_duration_seconds_count{kind=""}"#),
            "a tool that does not exist takes no time"
        );
    }
}
