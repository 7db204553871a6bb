//! The agent handler: one iteration per request, ReAct's below or another pattern's
//! ([`crate::patterns`], dispatched by the request's `pattern`).
//!
//! Each iteration renders the ReAct prompt (question, tools, history), streams the model's output
//! through the ReAct parser and publishes what it finds as it finds it: `thought` pieces
//! (`end_of_message` on the last), then either `answer` pieces and a last record with
//! `end_of_dialog`, or one `action` record (the tool's name; its arguments in `arguments`), the tool's
//! `observation`, and a hand-off: the request, its history one step longer, is re-published on the
//! agent's own request topic with the same id, so any replica takes the next step and a crash costs
//! at most one iteration. A non-streaming request gets one record, the answer (TrustGraph's
//! streaming spec (docs/specs.md#trustgraphs-streaming-spec)), with the whole dialog's usage;
//! [`NonStreaming::Steps`] gives TrustGraph 2.x's multipart reply instead: the same message types
//! as a stream, each whole.
//!
//! Limits: a maximum number of iterations and a total dialog time (a terminal `agent-error`);
//! a tool error or an unknown tool becomes the observation; output that cannot be parsed gets
//! one corrective retry, then a terminal `agent-error`. Output in plain prose (no marker at
//! all) is handled as [`PlainAnswer`] says: by default, prose after the corrective retry is
//! taken as the final answer.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use async_trait::async_trait;
use minijinja::{Environment, UndefinedBehavior};
use serde_json::json;
use sluice_runtime::{
    bus::Publisher,
    client::{RequestClient, RequestOptions},
    processor::{Handler, RequestContext, ResponseSink},
    reader::{Encoder, End, Fail, Out, ReadPolicy, Whole},
    trace,
};
use sluice_schema::{
    AgentMessageType, AgentRequest, AgentResponse, AgentStep, Error, ErrorKind, PendingUsage,
    TextCompletionRequest, TextCompletionResponse,
};
use tracing::{debug, info, warn};

use crate::{
    metrics::{AgentMetrics, DialogOutcome, IterationOutcome, ToolOutcome, kind_label},
    patterns::{Dispatch, Pattern, TEMPLATES, route::Routing},
    react::{Event, Outcome, ReactParser},
    tools::{self, Tokens, Tool, ToolError},
};

/// The default ReAct prompt (minijinja; variables `question`, `tools`, `tool_names`,
/// `history`).
pub const DEFAULT_REACT_TEMPLATE: &str = include_str!("react_prompt.txt");

pub use self::modes::{NonStreaming, PlainAnswer, ToolCalling};

/// The agent's limits.
#[derive(Debug, Clone)]
pub struct AgentLimits {
    /// Iterations (model calls that chose a tool) before the dialog is ended.
    pub max_iterations: usize,
    /// The whole dialog, across iterations.
    pub dialog_timeout: Duration,
    /// One tool call.
    pub tool_timeout: Duration,
    /// What to do with an answer in plain prose.
    pub plain_answer: PlainAnswer,
    /// What a non-streaming request gets.
    pub non_streaming: NonStreaming,
    /// How the model calls tools.
    pub tool_calling: ToolCalling,
    /// The supervisor's most goals (TrustGraph's `MAX_SUBAGENTS`).
    pub max_subagents: usize,
    /// How long a supervisor waits for its subagents (within the dialog's time).
    pub fanin_timeout: Duration,
}

impl Default for AgentLimits {
    fn default() -> Self {
        Self {
            max_iterations: 10,
            dialog_timeout: Duration::from_secs(600),
            tool_timeout: Duration::from_secs(120),
            plain_answer: PlainAnswer::default(),
            non_streaming: NonStreaming::default(),
            tool_calling: ToolCalling::default(),
            max_subagents: crate::patterns::supervisor::DEFAULT_MAX_SUBAGENTS,
            fanin_timeout: crate::fanin::DEFAULT_FANIN_TIMEOUT,
        }
    }
}

/// The agent's handler.
pub struct AgentService {
    pub(crate) llm: Arc<RequestClient<TextCompletionRequest, TextCompletionResponse>>,
    pub(crate) tools: Vec<Arc<Tool>>,
    pub(crate) next_step: Arc<dyn Publisher>,
    /// The fan-in topic's publisher (the supervisor's registrations, subagents' completions).
    pub(crate) fanin: Option<Arc<dyn Publisher>>,
    pub(crate) env: Environment<'static>,
    pub(crate) limits: AgentLimits,
    pub(crate) metrics: AgentMetrics,
    /// Meta-routing's task types and patterns (the workspace's, or the tools file's).
    pub(crate) routing: Routing,
}

/// Why the agent could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("a prompt template does not compile: {0}")]
pub struct TemplateError(String);

impl AgentService {
    /// An agent completing through `llm`, with `tools`, handing each next step to
    /// `next_step` (a publisher on its own request topic), prompting with `template`,
    /// counting in `metrics`.
    pub fn new(
        llm: Arc<RequestClient<TextCompletionRequest, TextCompletionResponse>>,
        tools: Vec<Arc<Tool>>,
        next_step: Arc<dyn Publisher>,
        template: &str,
        limits: AgentLimits,
        metrics: AgentMetrics,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.add_template_owned("react", template.to_owned())
            .map_err(|e| TemplateError(e.to_string()))?;
        for (name, text) in TEMPLATES {
            env.add_template_owned(name, text.to_owned())
                .map_err(|e| TemplateError(format!("{name}: {e}")))?;
        }
        Ok(Self {
            llm,
            tools,
            next_step,
            env,
            limits,
            metrics,
            routing: Routing::default(),
            fanin: None,
        })
    }

    /// This agent with the pattern template `name` (one of [`TEMPLATES`]) replaced by `text`.
    pub fn with_template(mut self, name: &str, text: &str) -> Result<Self, TemplateError> {
        if !TEMPLATES.iter().any(|(n, _)| *n == name) {
            return Err(TemplateError(format!(
                "no pattern template is called {name:?}; they are {}",
                TEMPLATES.map(|(n, _)| n).join(", ")
            )));
        }
        self.env
            .add_template_owned(name.to_owned(), text.to_owned())
            .map_err(|e| TemplateError(format!("{name}: {e}")))?;
        Ok(self)
    }

    /// This agent with the supervisor pattern: registrations and subagents' completions
    /// published through `fanin` (the fan-in topic's publisher; see [`crate::fanin`]).
    pub fn with_fanin(mut self, fanin: Arc<dyn Publisher>) -> Self {
        self.fanin = Some(fanin);
        self
    }

    /// This agent with meta-routing's task types and patterns.
    pub fn with_routing(mut self, routing: Routing) -> Self {
        self.routing = routing;
        self
    }

    /// The error that ends a dialog whose total time ran out.
    pub(crate) fn deadline_error(&self) -> Error {
        Error::new(
            ErrorKind::Timeout,
            format!(
                "the dialog did not finish within {} s",
                self.limits.dialog_timeout.as_secs()
            ),
        )
    }

    fn render(&self, request: &AgentRequest, tools: &[&Arc<Tool>]) -> Result<String, Error> {
        let tool_list: Vec<_> = tools
            .iter()
            .map(|t| {
                json!({
                    "name": t.config.name,
                    "description": t.config.description,
                    "arguments": t.config.arguments,
                })
            })
            .collect();
        let names: Vec<&str> = tools.iter().map(|t| t.config.name.as_str()).collect();
        let history: Vec<_> = request
            .history
            .iter()
            .map(|s| {
                json!({"thought": s.thought, "action": s.action,
                       "arguments": s.arguments, "observation": s.observation})
            })
            .collect();
        self.env
            .get_template("react")
            .and_then(|t| {
                t.render(json!({
                    "question": request.question,
                    "tools": tool_list,
                    "tool_names": names.join(", "),
                    "history": history,
                }))
            })
            .map_err(|e| {
                Error::new(
                    ErrorKind::Internal,
                    format!("the ReAct prompt cannot be rendered: {e}"),
                )
            })
    }
}

pub(crate) fn restarted() -> Error {
    Error::new(
        ErrorKind::Agent,
        "text-completion restarted its answer midway; ask again",
    )
}

/// How the agent reads the model's answers under `on_restart`: a client-side failure is
/// reported with the agent's kind.
pub(crate) fn read_policy<P>(on_restart: P) -> ReadPolicy<P> {
    ReadPolicy::new(on_restart, |e| {
        e.to_error("text-completion", ErrorKind::Agent)
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What one model call produced.
enum Step {
    Decided(Outcome),
    /// Not in the ReAct format: why (a hint for the model), the text, and whether it is
    /// plain prose.
    Unparsable(String, String, bool),
    /// Plain prose taken as the final answer (nothing of it was streamed yet).
    Prose(String),
    Failed(Error),
    /// The dialog's total time ran out while the model was answering.
    Deadline,
}

impl AgentService {
    /// Runs the tool `name` with `arguments` from `available`: its observation (its answer,
    /// its failure, or that no such tool exists), the state after it, and the tokens its
    /// call spent on models (the dialog's caller's: see [`Dialog::spent`]).
    pub(crate) async fn run_tool(
        &self,
        available: &[&Arc<Tool>],
        name: &str,
        arguments: &BTreeMap<String, String>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> (String, Option<String>, Tokens) {
        let tool = available.iter().find(|t| t.config.name == name);
        match tool {
            None => {
                // The model's made-up name is never a label.
                self.metrics
                    .tool_call("", "", ToolOutcome::Unknown, Duration::ZERO);
                let names: Vec<&str> = available.iter().map(|t| t.config.name.as_str()).collect();
                (
                    format!(
                        "There is no tool called {name:?}. The tools are: {}.",
                        if names.is_empty() {
                            "(none)".to_owned()
                        } else {
                            names.join(", ")
                        }
                    ),
                    None,
                    Tokens::default(),
                )
            }
            Some(t) => {
                let timeout = self.limits.tool_timeout.min(remaining);
                let started = Instant::now();
                // The tool call's client span: its context goes to the service the
                // tool calls (as the request's property, or the MCP server's HTTP
                // `traceparent` header).
                let mut span = trace::Span::start(
                    trace::Kind::Client,
                    format!("tool {}", t.config.name),
                    ctx.traceparent.as_deref(),
                );
                span.set("sluice.tool.kind", kind_label(&t.config.kind));
                let (result, tokens) = trace::OUTBOUND
                    .scope(
                        span.traceparent(),
                        t.invoke(
                            arguments,
                            RequestOptions {
                                traceparent: Some(span.traceparent()),
                                ..ctx.on_behalf()
                            },
                            timeout,
                        ),
                    )
                    .await;
                let outcome = match &result {
                    Ok(_) => ToolOutcome::Success,
                    Err(ToolError::Failed(_)) => ToolOutcome::Error,
                    Err(ToolError::TimedOut(_)) => ToolOutcome::Timeout,
                };
                self.metrics.tool_call(
                    &t.config.name,
                    kind_label(&t.config.kind),
                    outcome,
                    started.elapsed(),
                );
                if outcome != ToolOutcome::Success {
                    span.fail(outcome.as_str());
                }
                span.end();
                let observation = match result {
                    Ok(o) => o,
                    Err(e) => {
                        warn!(tool = %name, "tool failed; its error is the observation");
                        format!("The tool failed: {e}")
                    }
                };
                (observation, t.config.next_state.clone(), tokens)
            }
        }
    }

    /// Hands the dialog's next step on over the agent's own request topic, with the usage no
    /// record published yet.
    pub(crate) async fn hand_off(
        &self,
        dialog: &mut Dialog<'_>,
        request: &mut AgentRequest,
    ) -> Result<(), Error> {
        (request.pending_in_token, request.pending_out_token) = dialog.usage.take();
        let payload = serde_json::to_vec(&*request)
            .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        dialog
            .sink
            .hand_off(&*self.next_step, payload)
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Internal,
                    format!("handing the next step on failed: {e}"),
                )
            })
    }

    /// Calls the model once, streaming thought and answer pieces as they are parsed.
    async fn think(
        &self,
        prompt: String,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<Step, Error> {
        let request = TextCompletionRequest {
            prompt,
            streaming: true,
            ..TextCompletionRequest::default()
        };
        let options = RequestOptions {
            total_timeout: Some(remaining),
            ..ctx.on_behalf()
        };
        // A restart ends the step: the ReAct parser has already acted on the abandoned
        // attempt.
        let reader = match self
            .llm
            .read(&request, options, read_policy(Fail(restarted())))
            .await
        {
            Ok(r) => r,
            Err(f) => return Ok(Step::Failed(f.error)),
        };
        let Dialog {
            sink,
            usage,
            streaming,
            ..
        } = dialog;
        let thinking = Thinking {
            usage,
            streaming: *streaming,
            parser: ReactParser::new(),
            whole: Whole::default(),
        };
        reader
            .drive(thinking)
            .send_to(&mut **sink)
            .await
            .map_err(unsent)
    }
}

/// One ReAct model call: the model's output through the parser, thought and answer pieces
/// published as they are found (streaming), and what the call produced.
struct Thinking<'a> {
    usage: &'a mut PendingUsage,
    streaming: bool,
    parser: ReactParser,
    /// The output, for a corrective retry or as prose.
    whole: Whole,
}

impl Encoder<TextCompletionResponse> for Thinking<'_> {
    type Item = AgentResponse;
    type Done = Step;

    fn record(&mut self, r: TextCompletionResponse, out: &mut Out<AgentResponse>) {
        self.usage.add(&r);
        let mut events = self.parser.push(&r.response);
        if r.end_of_stream {
            // The last line may still have been held back as a possible marker.
            events.extend(self.parser.close());
        }
        self.whole.add(r);
        if !self.streaming {
            return;
        }
        for event in events {
            let (kind, content, end_of_message) = match event {
                Event::Thought(t) if !t.is_empty() => (AgentMessageType::Thought, t, false),
                Event::ThoughtEnd => (AgentMessageType::Thought, String::new(), true),
                Event::Answer(a) if !a.is_empty() => (AgentMessageType::Answer, a, false),
                _ => continue,
            };
            out.push(message(self.usage, kind, content, end_of_message, false));
        }
    }

    fn end(&mut self, end: End<TextCompletionResponse>, _: &mut Out<AgentResponse>) -> Step {
        let (failure, deadline) = match end {
            End::Answered => {
                let text = std::mem::take(&mut self.whole.text);
                return match std::mem::take(&mut self.parser).finish() {
                    Ok(outcome) => Step::Decided(outcome),
                    Err(e) => Step::Unparsable(e.to_string(), text, e.is_plain_prose()),
                };
            }
            End::Failed(f) => (f, false),
            End::Deadline(f) => (f, true),
        };
        if let Some(r) = &failure.record {
            self.usage.add(r);
        }
        // The call's total time limit is what is left of the dialog's.
        if deadline {
            Step::Deadline
        } else {
            Step::Failed(failure.error)
        }
    }
}

#[async_trait]
impl Handler for AgentService {
    type Request = AgentRequest;
    type Response = AgentResponse;

    async fn handle(
        &self,
        mut request: AgentRequest,
        ctx: RequestContext,
        sink: &mut ResponseSink<AgentResponse>,
    ) -> Result<(), Error> {
        let deadline = *request.deadline_ms.get_or_insert_with(|| {
            now_ms().saturating_add(
                u64::try_from(self.limits.dialog_timeout.as_millis()).unwrap_or(u64::MAX),
            )
        });
        let remaining = Duration::from_millis(deadline.saturating_sub(now_ms()));
        // The usage of earlier steps that published nothing goes out with this one's records.
        let usage = PendingUsage {
            in_token: request.pending_in_token.take(),
            out_token: request.pending_out_token.take(),
            model: None,
        };
        // A supervisor's subagent publishes nothing on the response topic (its records would
        // restart its supervisor's stream): its end becomes a completion for the fan-in.
        let subagent = crate::patterns::supervisor::is_subagent(&request);
        let mut dialog = Dialog {
            sink,
            usage,
            streaming: request.streaming && !subagent,
            steps: !subagent
                && (request.streaming || self.limits.non_streaming == NonStreaming::Steps),
            capture: subagent.then(Captured::default),
        };
        let asked = subagent.then(|| request.clone());
        let ended = self.iteration(request, &ctx, &mut dialog, remaining).await;
        match asked {
            Some(asked) => self.complete_subagent(&asked, ended, &mut dialog).await,
            None => ended,
        }
    }
}

impl AgentService {
    /// One iteration of a dialog, after its limits are read: its pattern's step.
    async fn iteration(
        &self,
        mut request: AgentRequest,
        ctx: &RequestContext,
        dialog: &mut Dialog<'_>,
        remaining: Duration,
    ) -> Result<(), Error> {
        if remaining.is_zero() {
            self.metrics.dialog(DialogOutcome::Deadline);
            return dialog.fail(self.deadline_error()).await;
        }
        // An iteration is a model turn: native calls made in one turn are one.
        let iterations = request.history.iter().filter(|s| !s.same_turn).count();
        if iterations >= self.limits.max_iterations {
            self.metrics.dialog(DialogOutcome::MaxIterations);
            return dialog
                .fail(Error::new(
                    ErrorKind::Agent,
                    format!(
                        "no final answer after {} iterations (the maximum); the question may need other tools or a simpler form",
                        self.limits.max_iterations
                    ),
                ))
                .await;
        }
        let available = tools::available(
            &self.tools,
            request.group.as_deref(),
            request.state.as_deref(),
        );
        // The pattern this iteration runs (docs/agent.md#patterns); ReAct's goes on here.
        match self.dispatch(&mut request, dialog, ctx, remaining).await? {
            Dispatch::Pattern(Pattern::React) => {}
            other => {
                return self
                    .run_dispatched(other, request, &available, dialog, ctx, remaining)
                    .await;
            }
        }
        if self.limits.tool_calling == ToolCalling::Native {
            return self
                .native_step(request, available, dialog, ctx, remaining)
                .await;
        }
        let prompt = match self.render(&request, &available) {
            Ok(p) => p,
            Err(e) => {
                self.metrics.iteration(IterationOutcome::Error);
                self.metrics.dialog(DialogOutcome::Error);
                return dialog.fail(e).await;
            }
        };
        debug!(
            iteration = request.history.len(),
            tools = available.len(),
            "thinking"
        );
        let step = self.react_turn(prompt, dialog, ctx, remaining).await?;
        let outcome = match self.decided(step, dialog, request.history.len()).await {
            Ok(outcome) => outcome,
            Err(ended) => return ended,
        };
        match outcome {
            Outcome::Answer { thought, answer } => {
                self.metrics.iteration(IterationOutcome::Answer);
                self.metrics.dialog(DialogOutcome::Answer);
                if !dialog.streaming {
                    if dialog.steps && !thought.is_empty() {
                        dialog
                            .send(AgentMessageType::Thought, thought, true, false)
                            .await?;
                    }
                    return dialog
                        .send(AgentMessageType::Answer, answer, true, true)
                        .await;
                }
                info!(iterations = request.history.len() + 1, "dialog answered");
                dialog
                    .send(AgentMessageType::Answer, String::new(), true, true)
                    .await
            }
            Outcome::Action {
                thought,
                name,
                arguments,
            } => {
                let action = Action {
                    thought,
                    name,
                    arguments,
                };
                self.act(action, request, &available, dialog, ctx, remaining)
                    .await
            }
        }
    }
}

/// A tool call the model asked for in the ReAct format.
struct Action {
    thought: String,
    name: String,
    arguments: BTreeMap<String, String>,
}

impl AgentService {
    /// One ReAct turn within `remaining`: the model's output read, and when it is not in the
    /// format, one corrective retry telling the model what was wrong (or, as
    /// `plain_answer` says, plain prose taken as the answer).
    async fn react_turn(
        &self,
        prompt: String,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<Step, Error> {
        let step = tokio::time::timeout(remaining, async {
            let plain = self.limits.plain_answer;
            match self.think(prompt.clone(), dialog, ctx, remaining).await? {
                Step::Unparsable(_, text, true) if plain == PlainAnswer::Final => {
                    Ok(Step::Prose(text))
                }
                Step::Unparsable(why, text, prose) => {
                    warn!(reason = %why, "model output not in the ReAct format; retrying once");
                    self.metrics.iteration(IterationOutcome::Retry);
                    let mut shown: String = text.chars().take(2000).collect();
                    if shown.len() < text.len() {
                        shown.push('…');
                    }
                    let corrective = format!(
                        "{prompt}\n{shown}\n\nThat answer could not be read: {why}\nAnswer again, exactly in the format above.\n"
                    );
                    match self.think(corrective, dialog, ctx, remaining).await? {
                        Step::Unparsable(_, again, true) if plain == PlainAnswer::RetryFinal => {
                            Ok(Step::Prose(if prose { text } else { again }))
                        }
                        other => Ok(other),
                    }
                }
                other => Ok(other),
            }
        })
        .await;
        match step {
            Ok(step) => step,
            Err(_) => Ok(Step::Deadline),
        }
    }

    /// What the model decided in a turn of a dialog with `history` steps; `Err` with how the
    /// dialog ended when it decided nothing to act on (a failure, the deadline, an output
    /// unreadable twice) or answered in plain prose.
    async fn decided(
        &self,
        step: Step,
        dialog: &mut Dialog<'_>,
        history: usize,
    ) -> Result<Outcome, Result<(), Error>> {
        match step {
            Step::Decided(o) => Ok(o),
            Step::Failed(e) => {
                self.metrics.iteration(IterationOutcome::Error);
                self.metrics.dialog(DialogOutcome::Error);
                Err(dialog.fail(e).await)
            }
            Step::Deadline => {
                self.metrics.iteration(IterationOutcome::Error);
                self.metrics.dialog(DialogOutcome::Deadline);
                Err(dialog.fail(self.deadline_error()).await)
            }
            Step::Prose(text) => {
                self.metrics.iteration(IterationOutcome::Answer);
                self.metrics.dialog(DialogOutcome::Answer);
                info!(
                    iterations = history + 1,
                    "dialog answered in plain prose, taken as the final answer"
                );
                Err(dialog
                    .send(AgentMessageType::Answer, text.trim().to_owned(), true, true)
                    .await)
            }
            Step::Unparsable(why, _, _) => {
                self.metrics.iteration(IterationOutcome::Error);
                self.metrics.dialog(DialogOutcome::Error);
                Err(dialog
                    .fail(Error::new(
                        ErrorKind::Agent,
                        format!("the model's output could not be read twice: {why}"),
                    ))
                    .await)
            }
        }
    }

    /// Calls the tool `action` names (its thought, action and observation published as the
    /// dialog's steps), then hands the dialog, the step in its history, to the next
    /// iteration.
    async fn act(
        &self,
        action: Action,
        mut request: AgentRequest,
        available: &[&Arc<Tool>],
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<(), Error> {
        let Action {
            thought,
            name,
            arguments,
        } = action;
        self.metrics.iteration(IterationOutcome::Action);
        if !dialog.streaming && dialog.steps && !thought.is_empty() {
            dialog
                .send(AgentMessageType::Thought, thought.clone(), true, false)
                .await?;
        }
        if dialog.steps {
            dialog.send_action(name.clone(), arguments.clone()).await?;
        }
        let ran = self
            .run_tool(available, &name, &arguments, ctx, remaining)
            .await;
        let step = AgentStep {
            thought,
            action: name,
            arguments: arguments.into_iter().collect::<BTreeMap<_, _>>(),
            observation: String::new(),
            step_type: Some("react".into()),
            user: request.user.clone(),
            call_id: None,
            same_turn: false,
            call_arguments: None,
            ..AgentStep::default()
        };
        dialog.observe(&mut request, ran, step).await?;
        self.hand_off(dialog, &mut request).await
    }
}

mod dialog;
mod modes;
mod native;

pub(crate) use self::dialog::{Captured, Dialog, message, unsent};

#[cfg(test)]
mod tests;
