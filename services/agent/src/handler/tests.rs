//! The agent handler's behaviour on the in-process bus, with text-completion played by the
//! test: it reads what the agent sends (model calls, and the calls of a text-completion
//! tool, told apart by the tool's system prompt) and answers them, so each step of a dialog
//! is exact. The hand-off to the next step goes through the agent's own request topic, as
//! on the broker.

use std::time::Duration;

use sluice_runtime::{
    bus::{Bus, memory::MemoryBus},
    client::{ClientConfig, ResponseStream},
    processor::{self, ProcessorConfig},
    telemetry::Telemetry,
    testkit::ServiceStub,
};
use tokio_util::sync::CancellationToken;

use sluice_schema::ResponseRecord;

use super::*;
use crate::{
    metrics::AgentMetrics,
    tools::{Backend, ToolConfig, ToolKind},
};

/// The system prompt of the test's tool, which marks its calls to text-completion.
const TOOL_SYSTEM: &str = "you are the lookup tool";

/// The agent processor on the in-process bus, text-completion's side held by the test.
struct Rig {
    /// The in-process bus, for a test that watches a topic.
    bus: MemoryBus,
    /// Text-completion, as the agent sees it: its model calls and its tool's calls.
    llm: ServiceStub,
    agent: RequestClient<AgentRequest, AgentResponse>,
    telemetry: Telemetry,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), sluice_runtime::bus::BusError>>,
}

impl Rig {
    /// An agent with one tool, `lookup` (a text completion with [`TOOL_SYSTEM`]).
    async fn start(limits: AgentLimits) -> Rig {
        Self::start_routing(limits, Routing::default()).await
    }

    /// [`Rig::start`], meta-routing choosing from `routing`.
    async fn start_routing(limits: AgentLimits, routing: Routing) -> Rig {
        Self::start_with(limits, move |s| s.with_routing(routing)).await
    }

    /// [`Rig::start`], the agent made as `build` makes it from the default one.
    async fn start_with(
        limits: AgentLimits,
        build: impl FnOnce(AgentService) -> AgentService,
    ) -> Rig {
        let bus = MemoryBus::new(1 << 20, 1000);
        let shared: Arc<dyn Bus> = Arc::new(bus.clone());
        let telemetry = Telemetry::new().unwrap();
        let llm_stub = ServiceStub::start(&bus, "tc-req", "tc-resp").await;
        let llm = Arc::new(
            RequestClient::start(
                shared.clone(),
                ClientConfig::new("text-completion", "tc-req", "tc-resp"),
                None,
            )
            .await
            .unwrap(),
        );
        let tool = Tool {
            config: ToolConfig {
                name: "lookup".into(),
                description: "Looks a fact up.".into(),
                arguments: Vec::new(),
                group: vec!["default".into()],
                applicable_states: None,
                next_state: None,
                kind: ToolKind::TextCompletion {
                    system: Some(TOOL_SYSTEM.into()),
                },
            },
            backend: Backend::TextCompletion(llm.clone()),
        };
        let metrics = AgentMetrics::register(&telemetry.registry).unwrap();
        let service = AgentService::new(
            llm,
            vec![Arc::new(tool)],
            shared.publisher("a-req").await.unwrap(),
            DEFAULT_REACT_TEMPLATE,
            limits,
            metrics.clone(),
        )
        .unwrap()
        .with_fanin(shared.publisher("a-fanin").await.unwrap());
        let service = build(service);
        let shutdown = CancellationToken::new();
        // The fan-in's joiner, as `sluice serve` runs it beside the agent.
        let fanin = crate::fanin::FanIn {
            bus: shared.clone(),
            topic: "a-fanin".into(),
            next_step: shared.publisher("a-req").await.unwrap(),
            metrics,
            timeout: Duration::from_secs(300),
        };
        tokio::spawn(fanin.run(shutdown.clone()));
        let task = tokio::spawn(processor::run(
            shared.clone(),
            ProcessorConfig::new("agent", "a-req", "a-resp"),
            Arc::new(service),
            telemetry.clone(),
            shutdown.clone(),
        ));
        tokio::time::timeout(Duration::from_secs(10), telemetry.health.until_watched(1))
            .await
            .expect("the agent processor subscribes");
        let agent =
            RequestClient::start(shared, ClientConfig::new("agent", "a-req", "a-resp"), None)
                .await
                .unwrap();
        Rig {
            bus,
            llm: llm_stub,
            agent,
            telemetry,
            shutdown,
            task,
        }
    }

    async fn ask(&self, request: AgentRequest) -> ResponseStream<AgentResponse> {
        self.agent.request(&request).await.unwrap()
    }

    /// The next request the agent sent to text-completion, and its id.
    async fn llm_request(&mut self) -> (String, TextCompletionRequest) {
        self.llm.request().await
    }

    /// The next model call (not a tool's), and its id.
    async fn model_call(&mut self) -> (String, TextCompletionRequest) {
        let (id, request) = self.llm_request().await;
        assert_ne!(request.system, TOOL_SYSTEM, "a tool call, not a model call");
        assert!(request.streaming, "the agent streams its model calls");
        (id, request)
    }

    /// Answers request `id` with `pieces`, the last one ending the stream with `tokens` (in,
    /// out).
    async fn answer(&self, id: &str, pieces: &[&str], tokens: (u64, u64)) {
        for (i, piece) in pieces.iter().enumerate() {
            let end = i + 1 == pieces.len();
            let r = TextCompletionResponse {
                response: (*piece).to_owned(),
                end_of_stream: end,
                in_token: end.then_some(tokens.0),
                out_token: end.then_some(tokens.1),
                model: Some("m".into()),
                ..TextCompletionResponse::default()
            };
            self.llm.answer(id, "a1", &r).await;
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }
}

fn question(text: &str, streaming: bool) -> AgentRequest {
    AgentRequest {
        question: text.to_owned(),
        streaming,
        ..AgentRequest::default()
    }
}

/// Every record of a dialog, to its end.
async fn dialog(stream: ResponseStream<AgentResponse>) -> Vec<AgentResponse> {
    let records = tokio::time::timeout(Duration::from_secs(20), stream.collect())
        .await
        .expect("the dialog ends")
        .unwrap();
    assert!(
        records.last().is_some_and(|r| r.end_of_dialog),
        "ends with end_of_dialog: {records:?}"
    );
    assert_eq!(
        records.iter().filter(|r| r.end_of_dialog).count(),
        1,
        "one terminal record: {records:?}"
    );
    records
}

/// Asserts that a dialog ended with an error of `kind` whose message says `says`.
fn assert_ended_with(records: &[AgentResponse], kind: ErrorKind, says: &str) {
    let error = records.last().unwrap().error.clone().expect("an error");
    assert_eq!(error.kind, kind, "{error}");
    assert!(error.message.contains(says), "{error}");
}

/// The concatenated content of the records of one type.
fn content(records: &[AgentResponse], kind: AgentMessageType) -> String {
    records
        .iter()
        .filter(|r| r.message_type == kind)
        .map(|r| r.content.as_str())
        .collect()
}

/// A final answer streams as it is parsed: thought pieces, the thought's end, answer pieces,
/// and a last record ending the dialog, with the model's usage.
#[tokio::test]
async fn a_final_answer_streams_its_thought_and_answer_and_ends_the_dialog() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let stream = rig
        .ask(question("What is the capital of France?", true))
        .await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt
            .contains("Question: What is the capital of France?")
    );
    assert!(
        call.prompt.contains("- lookup: Looks a fact up."),
        "{}",
        call.prompt
    );
    rig.answer(
        &id,
        &["Thought: I know", " it.\nFinal Answer: Pa", "ris\n"],
        (30, 9),
    )
    .await;
    let records = dialog(stream).await;
    assert!(records.iter().all(|r| r.error.is_none()), "{records:?}");
    assert_eq!(
        content(&records, AgentMessageType::Thought).trim(),
        "I know it."
    );
    assert_eq!(content(&records, AgentMessageType::Answer).trim(), "Paris");
    assert!(
        records
            .iter()
            .any(|r| r.message_type == AgentMessageType::Thought && r.end_of_message),
        "the thought's end is marked: {records:?}"
    );
    let last = records.last().unwrap();
    assert_eq!(last.message_type, AgentMessageType::Answer);
    let tokens: (u64, u64) = records.iter().fold((0, 0), |(i, o), r| {
        (i + r.in_token.unwrap_or(0), o + r.out_token.unwrap_or(0))
    });
    assert_eq!(tokens, (30, 9), "the model's usage, counted once");
    rig.stop().await;
}

/// Not streamed, by default: TrustGraph's streaming spec's
/// (docs/specs.md#trustgraphs-streaming-spec) single response, the answer, carrying the usage of
/// every step (the first step's counts ride in the handed-off request), and the steps the agent
/// adds keep the request's `user`. The next iteration's request keeps what TrustGraph 2.11's
/// orchestrator put in the first (a subagent's goal and fan-in among it).
#[tokio::test]
async fn a_request_that_does_not_stream_gets_one_answer_with_the_whole_usage() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let mut requests = ServiceStub::start(&rig.bus, "a-req", "a-watch").await;
    let mut request = question("What is the capital of France?", false);
    request.user = Some("alice".into());
    // As TrustGraph's supervisor sends a subagent: with a pattern, so it is not routed.
    request.pattern = Some("react".into());
    request.task_type = Some("research".into());
    request.framing = Some("You are a geographer.".into());
    request.parent_session_id = Some("supervisor-1".into());
    request.subagent_goal = Some("the capital".into());
    request.expected_siblings = Some(2);
    let stream = rig.ask(request).await;
    let (id, _) = rig.model_call().await;
    rig.answer(
        &id,
        &["Thought: look it up\nAction: lookup\nArgs: {\"question\": \"capital\"}\n"],
        (30, 12),
    )
    .await;
    let (tool_id, _) = rig.llm_request().await;
    rig.answer(&tool_id, &["Paris"], (4, 1)).await;
    let (next_id, _) = rig.model_call().await;
    rig.answer(&next_id, &["Thought: done\nFinal Answer: Paris"], (50, 6))
        .await;
    let records = dialog(stream).await;
    assert_eq!(records.len(), 1, "one record: {records:?}");
    let answer = &records[0];
    assert_eq!(answer.message_type, AgentMessageType::Answer);
    assert_eq!(answer.content, "Paris");
    assert!(answer.end_of_message && answer.end_of_dialog && answer.error.is_none());
    assert_eq!(
        (answer.in_token, answer.out_token),
        (Some(84), Some(19)),
        "both model calls' usage and the tool's (billed to the caller too: #53 §6)"
    );
    let (_, first): (_, AgentRequest) = requests.request().await;
    assert!(first.history.is_empty());
    let (_, handed): (_, AgentRequest) = requests.request().await;
    assert_eq!(handed.history.len(), 1);
    assert_eq!(handed.history[0].user.as_deref(), Some("alice"));
    assert_eq!(handed.user.as_deref(), Some("alice"));
    assert_eq!(
        (handed.pending_in_token, handed.pending_out_token),
        (Some(34), Some(13)),
        "the first model call's usage and the tool's"
    );
    assert_eq!(
        (
            handed.task_type.as_deref(),
            handed.framing.as_deref(),
            handed.correlation_id.as_deref(),
            handed.parent_session_id.as_deref(),
            handed.subagent_goal.as_deref(),
            handed.expected_siblings
        ),
        (
            Some("research"),
            Some("You are a geographer."),
            None,
            Some("supervisor-1"),
            Some("the capital"),
            Some(2)
        )
    );
    rig.stop().await;
}

/// Not streamed, with `NonStreaming::Steps`: TrustGraph 2.x's multipart reply, the same
/// message types as a stream, each whole.
#[tokio::test]
async fn a_request_that_does_not_stream_gets_each_message_whole_when_asked() {
    let mut rig = Rig::start(AgentLimits {
        non_streaming: NonStreaming::Steps,
        ..AgentLimits::default()
    })
    .await;
    let stream = rig.ask(question("Capital?", false)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["Thought: easy\nFinal Answer: ", "Paris"], (5, 2))
        .await;
    let records = dialog(stream).await;
    let kinds: Vec<_> = records.iter().map(|r| r.message_type).collect();
    assert_eq!(
        kinds,
        [AgentMessageType::Thought, AgentMessageType::Answer],
        "{records:?}"
    );
    assert_eq!(records[0].content, "easy");
    assert_eq!(records[1].content, "Paris");
    rig.stop().await;
}

/// An action calls the tool with the model's arguments, publishes the action and the tool's
/// observation, and hands the next step on through the agent's request topic: the next
/// model call sees the observation in its history, and the same dialog goes on to its answer.
#[tokio::test]
async fn an_action_calls_the_tool_and_the_next_step_sees_its_observation() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let stream = rig
        .ask(question("What is the capital of France?", true))
        .await;
    let (id, _) = rig.model_call().await;
    rig.answer(
        &id,
        &["Thought: look it up\nAction: lookup\nArgs: {\"question\": \"capital of France\"}\n"],
        (30, 12),
    )
    .await;
    let (tool_id, tool_call) = rig.llm_request().await;
    assert_eq!(tool_call.system, TOOL_SYSTEM);
    assert_eq!(
        tool_call.prompt, "capital of France",
        "the model's argument"
    );
    rig.answer(&tool_id, &["Paris"], (4, 1)).await;
    let (next_id, next) = rig.model_call().await;
    assert_ne!(next_id, id, "the next step is a call of its own");
    assert!(
        next.prompt.contains("Action: lookup") && next.prompt.contains("Observation: Paris"),
        "the history carries the step: {}",
        next.prompt
    );
    rig.answer(&next_id, &["Thought: done\nFinal Answer: Paris"], (50, 6))
        .await;
    let records = dialog(stream).await;
    let action = records
        .iter()
        .find(|r| r.message_type == AgentMessageType::Action)
        .expect("an action record");
    // TrustGraph's streaming spec's action chunk, `{chunk_type: "action", content: "search",
    // end_of_message: true}`: the tool's name as the content, which TrustGraph 2.11's readers
    // show as text (trustgraph/api/socket_client.py reads an `action` as a thought); the
    // arguments in sluice's own field beside it.
    let wire: serde_json::Value = serde_json::to_value(action).unwrap();
    assert_eq!(wire["chunk_type"], "action");
    assert_eq!(wire["message_type"], "action");
    assert_eq!(wire["content"], "lookup");
    assert_eq!(wire["end_of_message"], true);
    assert_eq!(wire["end_of_dialog"], false);
    assert_eq!(
        wire["arguments"],
        serde_json::json!({"question": "capital of France"})
    );
    // No other record carries the field.
    for r in records
        .iter()
        .filter(|r| r.message_type != AgentMessageType::Action)
    {
        assert!(
            serde_json::to_value(r).unwrap().get("arguments").is_none(),
            "{r:?}"
        );
    }
    assert_eq!(content(&records, AgentMessageType::Observation), "Paris");
    assert_eq!(content(&records, AgentMessageType::Answer).trim(), "Paris");
    let order: Vec<_> = records
        .iter()
        .map(|r| r.message_type)
        .filter(|t| *t != AgentMessageType::Thought)
        .collect();
    let first_answer = order
        .iter()
        .position(|t| *t == AgentMessageType::Answer)
        .unwrap();
    assert!(
        order[..first_answer].ends_with(&[AgentMessageType::Action, AgentMessageType::Observation]),
        "action, observation, then the answer: {order:?}"
    );
    let tokens: (u64, u64) = records.iter().fold((0, 0), |(i, o), r| {
        (i + r.in_token.unwrap_or(0), o + r.out_token.unwrap_or(0))
    });
    assert_eq!(
        tokens,
        (84, 19),
        "both model calls' usage and the tool's, each counted once"
    );
    let text = rig.telemetry.render();
    for counted in [
        r#"sluice_agent_tool_calls_total{kind="text-completion",outcome="success",tool="lookup"} 1"#,
        r#"sluice_agent_iterations_total{outcome="action"} 1"#,
        r#"sluice_agent_iterations_total{outcome="answer"} 1"#,
        r#"sluice_agent_dialogs_total{outcome="answer"} 1"#,
    ] {
        assert!(text.contains(counted), "{counted} in {text}");
    }
    rig.stop().await;
}

/// A tool the model makes up is not called: the observation says which tools there are,
/// and the dialog goes on.
#[tokio::test]
async fn an_unknown_tool_becomes_an_observation_naming_the_tools() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let stream = rig.ask(question("Capital?", true)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(
        &id,
        &["Thought: x\nAction: search\nArgs: {\"q\": \"a\"}\n"],
        (1, 1),
    )
    .await;
    let (next_id, next) = rig.model_call().await;
    assert!(
        next.prompt
            .contains("There is no tool called \"search\". The tools are: lookup."),
        "{}",
        next.prompt
    );
    rig.answer(&next_id, &["Thought: ok\nFinal Answer: Paris"], (1, 1))
        .await;
    let records = dialog(stream).await;
    assert!(
        content(&records, AgentMessageType::Observation).starts_with("There is no tool"),
        "{records:?}"
    );
    rig.stop().await;
}

/// The iteration limit ends a dialog that keeps calling tools with an `agent` error, at the
/// step that would pass it, without another model call.
#[tokio::test]
async fn the_iteration_limit_ends_the_dialog_with_an_agent_error() {
    let mut rig = Rig::start(AgentLimits {
        max_iterations: 1,
        ..AgentLimits::default()
    })
    .await;
    let stream = rig.ask(question("Capital?", true)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(
        &id,
        &["Thought: x\nAction: lookup\nArgs: {\"question\": \"q\"}\n"],
        (1, 1),
    )
    .await;
    let (tool_id, _) = rig.llm_request().await;
    rig.answer(&tool_id, &["an observation"], (1, 1)).await;
    let records = dialog(stream).await;
    assert_ended_with(
        &records,
        ErrorKind::Agent,
        "no final answer after 1 iterations",
    );
    assert!(
        // Any model call would have been sent before the terminal record.
        rig.llm.no_request_waiting(),
        "no model call after the limit"
    );
    rig.stop().await;
}

/// Output that cannot be read gets one corrective retry that says what was wrong; read
/// wrong again (strict ReAct), the dialog ends with an `agent` error.
#[tokio::test]
async fn output_that_cannot_be_read_twice_ends_with_an_agent_error() {
    let mut rig = Rig::start(AgentLimits {
        plain_answer: PlainAnswer::Error,
        ..AgentLimits::default()
    })
    .await;
    let stream = rig.ask(question("Capital?", true)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["Paris, I think."], (1, 1)).await;
    let (retry_id, retry) = rig.model_call().await;
    assert!(
        retry.prompt.contains("Paris, I think.")
            && retry.prompt.contains("That answer could not be read"),
        "the correction shows the answer and why: {}",
        retry.prompt
    );
    rig.answer(&retry_id, &["Still Paris."], (1, 1)).await;
    let records = dialog(stream).await;
    assert_ended_with(&records, ErrorKind::Agent, "could not be read twice");
    rig.stop().await;
}

/// By default, prose that stays prose after the correction is the answer: the first prose,
/// which answered the question.
#[tokio::test]
async fn prose_after_the_correction_is_taken_as_the_answer() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let stream = rig.ask(question("Capital?", true)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["Paris is the capital."], (1, 1)).await;
    let (retry_id, _) = rig.model_call().await;
    rig.answer(&retry_id, &["As I said."], (1, 1)).await;
    let records = dialog(stream).await;
    let last = records.last().unwrap();
    assert!(last.error.is_none(), "{records:?}");
    assert_eq!(last.message_type, AgentMessageType::Answer);
    assert_eq!(last.content, "Paris is the capital.");
    rig.stop().await;
}

/// A dialog whose deadline has passed (a step handed on late) ends with a `timeout` at
/// once, without a model call.
#[tokio::test]
async fn a_dialog_past_its_deadline_ends_with_a_timeout_without_a_model_call() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let mut late = question("Capital?", true);
    late.deadline_ms = Some(now_ms().saturating_sub(1_000));
    let records = dialog(rig.ask(late).await).await;
    assert_ended_with(&records, ErrorKind::Timeout, "did not finish within");
    assert!(
        // Any model call would have been sent before the terminal record.
        rig.llm.no_request_waiting(),
        "no model call"
    );
    rig.stop().await;
}

/// A model that fails ends the dialog with the model's error, and its usage so far.
#[tokio::test]
async fn a_model_error_ends_the_dialog_with_that_error() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let stream = rig.ask(question("Capital?", true)).await;
    let (id, _) = rig.model_call().await;
    let failed = TextCompletionResponse::from_error(Error::new(
        ErrorKind::TooManyRequests,
        "the provider is busy",
    ));
    rig.llm.answer(&id, "a1", &failed).await;
    let records = dialog(stream).await;
    assert_ended_with(&records, ErrorKind::TooManyRequests, "the provider is busy");
    rig.stop().await;
}

/// The rig's metrics, as `/metrics` shows them.
fn metrics_text(telemetry: &Telemetry) -> String {
    use prometheus::Encoder as _;
    let mut out = Vec::new();
    prometheus::TextEncoder::new()
        .encode(&telemetry.registry.gather(), &mut out)
        .unwrap();
    String::from_utf8(out).unwrap()
}

/// The supervisor on the in-process bus (as `sluice serve` runs it): the question decomposed
/// into four goals, four subagents run as dialogs of their own publishing nothing to the
/// caller, their ends joined by the fan-in, and one synthesis streamed from all four results,
/// the usage of every model call on the dialog's records.
#[tokio::test]
async fn a_supervisor_answers_from_every_subagents_result() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let mut request = question("Compare four cities.", true);
    request.pattern = Some("supervisor".into());
    let stream = rig.ask(request).await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt.contains("at most 5 independent goals"),
        "{}",
        call.prompt
    );
    rig.answer(&id, &["[\"g1\", \"g2\", ", "\"g3\", \"g4\"]"], (10, 4))
        .await;
    // The subagents' model calls, in whatever order the agent takes them.
    for _ in 0..4 {
        let (id, call) = rig.model_call().await;
        let goal = ["g1", "g2", "g3", "g4"]
            .into_iter()
            .find(|g| call.prompt.contains(&format!("Question: {g}\n")))
            .unwrap_or_else(|| panic!("a subagent's ReAct prompt: {}", call.prompt));
        rig.answer(
            &id,
            &[&format!("Thought: known\nFinal Answer: result-{goal}")],
            (100, 10),
        )
        .await;
    }
    let (id, call) = rig.model_call().await;
    for g in ["g1", "g2", "g3", "g4"] {
        assert!(
            call.prompt
                .contains(&format!("Goal: {g}\nResult: result-{g}")),
            "every result in the synthesis: {}",
            call.prompt
        );
    }
    assert!(!call.prompt.contains("got no answer"), "{}", call.prompt);
    rig.answer(&id, &["All four: ", "done."], (1000, 100)).await;
    let records = dialog(stream).await;
    let thoughts: Vec<&str> = records
        .iter()
        .filter(|r| r.message_type == AgentMessageType::Thought && !r.content.is_empty())
        .map(|r| r.content.as_str())
        .collect();
    assert_eq!(
        thoughts,
        [
            "Decomposed into 4 sub-goals: ['g1', 'g2', 'g3', 'g4']",
            "Synthesising final answer from sub-agent results"
        ],
        "{records:?}"
    );
    assert_eq!(
        content(&records, AgentMessageType::Answer),
        "All four: done."
    );
    assert!(records.iter().all(|r| r.error.is_none()), "{records:?}");
    let tokens: (u64, u64) = records.iter().fold((0, 0), |(i, o), r| {
        (i + r.in_token.unwrap_or(0), o + r.out_token.unwrap_or(0))
    });
    assert_eq!(
        tokens,
        (1410, 144),
        "the decomposition, four subagents, the synthesis"
    );
    let metrics = metrics_text(&rig.telemetry);
    for line in [
        r#"sluice_agent_fanin_total{event="fanout"} 1"#,
        r#"sluice_agent_fanin_total{event="completion"} 4"#,
        r#"sluice_agent_fanin_total{event="join-complete"} 1"#,
        r#"sluice_agent_fanin_total{event="takeover"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    rig.stop().await;
}

/// A subagent whose model fails ends as a failed completion, never a hang: the fan-in joins
/// at once and the synthesis names the goal that got no answer.
#[tokio::test]
async fn a_failed_subagent_is_named_in_the_synthesis() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let mut request = question("Two things.", false);
    request.pattern = Some("supervisor".into());
    let stream = rig.ask(request).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["[\"good\", \"bad\"]"], (1, 1)).await;
    for _ in 0..2 {
        let (id, call) = rig.model_call().await;
        if call.prompt.contains("Question: bad\n") {
            let failed = TextCompletionResponse {
                error: Some(Error::new(ErrorKind::Llm, "the provider is down")),
                end_of_stream: true,
                ..TextCompletionResponse::default()
            };
            rig.llm.answer(&id, "a1", &failed).await;
        } else {
            rig.answer(&id, &["Final Answer: fine"], (1, 1)).await;
        }
    }
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt.contains("Goal: good\nResult: fine"),
        "{}",
        call.prompt
    );
    assert!(
        call.prompt.contains("These goals got no answer: bad."),
        "{}",
        call.prompt
    );
    rig.answer(&id, &["Only half."], (1, 1)).await;
    let records = dialog(stream).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].content, "Only half.");
    rig.stop().await;
}

mod patterns;
