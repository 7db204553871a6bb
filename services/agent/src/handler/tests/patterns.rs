//! The orchestrator's patterns on the in-process bus: plan-then-execute's iterations and
//! records, its JSON turns' retry and error, unknown patterns, and meta-routing.

use std::collections::BTreeMap;

use super::*;

/// A question to run with `pattern`.
fn with_pattern(text: &str, pattern: &str, streaming: bool) -> AgentRequest {
    AgentRequest {
        pattern: Some(pattern.to_owned()),
        ..question(text, streaming)
    }
}

/// Each record's type and content.
fn shown(records: &[AgentResponse]) -> Vec<(AgentMessageType, &str)> {
    records
        .iter()
        .map(|r| (r.message_type, r.content.as_str()))
        .collect()
}

/// The usage the records carry, summed.
fn usage(records: &[AgentResponse]) -> (u64, u64) {
    records.iter().fold((0, 0), |(i, o), r| {
        (i + r.in_token.unwrap_or(0), o + r.out_token.unwrap_or(0))
    })
}

/// A streamed plan-then-execute dialog of two steps, the second needing the first's result:
/// TrustGraph's records in its order (the plan's thought; per step a thought naming the tool and
/// the tool's observation; the synthesis's thought, the answer streamed, the end with the
/// dialog's usage), each iteration a hand-off carrying the plan as it stands.
#[tokio::test]
async fn plan_then_execute_plans_runs_each_step_and_synthesises_the_answer() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let mut requests = ServiceStub::start(&rig.bus, "a-req", "a-watch").await;
    let stream = rig
        .ask(with_pattern(
            "How many people live in the capital of France?",
            "plan-then-execute",
            true,
        ))
        .await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt.contains("How many people live"),
        "{}",
        call.prompt
    );
    assert!(
        call.prompt.contains("- lookup: Looks a fact up."),
        "{}",
        call.prompt
    );
    rig.answer(
        &id,
        &[
            "Here is the plan:\n```json\n[{\"goal\": \"find the capital\", \"tool_hint\": \"lookup\"},",
            " {\"goal\": \"find its population\", \"tool_hint\": \"lookup\", \"depends_on\": [0]}]\n```",
        ],
        (20, 10),
    )
    .await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt.contains("Goal: find the capital"),
        "{}",
        call.prompt
    );
    rig.answer(
        &id,
        &[r#"{"tool": "lookup", "arguments": {"question": "capital of France"}}"#],
        (10, 5),
    )
    .await;
    let (tool_id, _) = rig.llm_request().await;
    rig.answer(&tool_id, &[" Paris \n"], (3, 1)).await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt.contains("Goal: find its population"),
        "{}",
        call.prompt
    );
    assert!(call.prompt.contains("- step 0: Paris"), "{}", call.prompt);
    rig.answer(
        &id,
        &[r#"{"tool": "lookup", "arguments": {"question": "population of Paris"}}"#],
        (10, 5),
    )
    .await;
    let (tool_id, _) = rig.llm_request().await;
    rig.answer(&tool_id, &["2.1 million"], (3, 1)).await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt
            .contains("Step 1: find its population\nResult: 2.1 million"),
        "{}",
        call.prompt
    );
    rig.answer(&id, &["About 2.1", " million."], (30, 4)).await;
    let records = dialog(stream).await;
    use AgentMessageType::{Answer, Observation, Thought};
    assert_eq!(
        shown(&records),
        [
            (Thought, "Created plan with 2 steps"),
            (Thought, "Step 0: find the capital → calling lookup"),
            (Observation, "Paris"),
            (Thought, "Step 1: find its population → calling lookup"),
            (Observation, "2.1 million"),
            (Thought, "Synthesising final answer from plan results"),
            (Answer, "About 2.1"),
            (Answer, " million."),
            (Answer, ""),
        ]
    );
    assert!(
        records
            .iter()
            .all(|r| r.end_of_message == (r.message_type != Answer || r.end_of_dialog))
    );
    assert_eq!(
        usage(&records),
        (76, 26),
        "every model call's and tool's usage, once"
    );
    let (_, first): (_, AgentRequest) = requests.request().await;
    assert!(first.history.is_empty());
    let (_, planned): (_, AgentRequest) = requests.request().await;
    let step = &planned.history[0];
    assert_eq!(step.step_type.as_deref(), Some("plan"));
    assert_eq!(step.action, "plan");
    assert_eq!(step.thought, "Created plan with 2 steps");
    let observed: serde_json::Value = serde_json::from_str(&step.observation).unwrap();
    assert_eq!(observed[1]["depends_on"], serde_json::json!([0]));
    assert_eq!(step.plan.len(), 2);
    assert!(step.plan.iter().all(|s| s.status == "pending"));
    let (_, executed): (_, AgentRequest) = requests.request().await;
    let step = &executed.history[1];
    assert_eq!(step.step_type.as_deref(), Some("execute"));
    assert_eq!(step.action, "lookup");
    assert_eq!(step.arguments["question"], "capital of France");
    assert_eq!(step.observation, "Paris");
    assert_eq!(
        (step.plan[0].status.as_str(), step.plan[0].result.as_str()),
        ("completed", "Paris")
    );
    assert_eq!(step.plan[1].status, "pending");
    let text = rig.telemetry.render();
    for counted in [
        r#"sluice_agent_iterations_total{outcome="action"} 3"#,
        r#"sluice_agent_iterations_total{outcome="answer"} 1"#,
        r#"sluice_agent_dialogs_total{outcome="answer"} 1"#,
        r#"sluice_agent_tool_calls_total{kind="text-completion",outcome="success",tool="lookup"} 2"#,
    ] {
        assert!(text.contains(counted), "{counted} in {text}");
    }
    rig.stop().await;
}

/// Not streamed: one record, the answer with the whole dialog's usage. A plan that is not
/// JSON gets one corrective retry saying what was wrong; a step naming a tool that does not
/// exist observes TrustGraph's "Error: tool 'x' not found" and the dialog goes on.
#[tokio::test]
async fn a_plan_retried_once_with_an_unknown_tool_still_answers_once_when_not_streamed() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let mut requests = ServiceStub::start(&rig.bus, "a-req", "a-watch").await;
    let stream = rig
        .ask(with_pattern(
            "Capital of France?",
            "plan-then-execute",
            false,
        ))
        .await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["I would look it up."], (5, 5)).await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt
            .contains("That answer could not be used: the answer has no JSON object or list in it"),
        "{}",
        call.prompt
    );
    rig.answer(&id, &[r#"[{"goal": "find the capital"}]"#], (5, 5))
        .await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &[r#"{"tool": "search", "arguments": {}}"#], (5, 5))
        .await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt
            .contains("Result: Error: tool 'search' not found"),
        "{}",
        call.prompt
    );
    rig.answer(&id, &["I could not find out."], (5, 5)).await;
    let records = dialog(stream).await;
    assert_eq!(
        shown(&records),
        [(AgentMessageType::Answer, "I could not find out.")]
    );
    assert_eq!(usage(&records), (20, 20));
    let _first: (String, AgentRequest) = requests.request().await;
    let _planned: (String, AgentRequest) = requests.request().await;
    let (_, executed): (_, AgentRequest) = requests.request().await;
    assert_eq!(executed.history[1].action, "search");
    let text = rig.telemetry.render();
    for counted in [
        r#"sluice_agent_iterations_total{outcome="retry"} 1"#,
        r#"sluice_agent_tool_calls_total{kind="",outcome="unknown",tool=""} 1"#,
    ] {
        assert!(text.contains(counted), "{counted} in {text}");
    }
    rig.stop().await;
}

/// A plan unusable twice ends the dialog with one `agent-error` naming what was wrong.
#[tokio::test]
async fn a_plan_unusable_twice_ends_the_dialog_with_one_error() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let stream = rig
        .ask(with_pattern("Capital?", "plan-then-execute", true))
        .await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["no plan"], (5, 1)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &[r#"{"goal": "find it"}"#], (6, 1)).await;
    let records = dialog(stream).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_ended_with(
        &records,
        ErrorKind::Agent,
        "the model's plan-create answer was not usable twice: the answer must be a JSON list",
    );
    assert_eq!(usage(&records), (11, 2), "the error carries the usage");
    let text = rig.telemetry.render();
    assert!(
        text.contains(r#"sluice_agent_dialogs_total{outcome="error"} 1"#),
        "{text}"
    );
    rig.stop().await;
}

/// An unknown pattern is one `agent-error` naming the known ones, counted; no model call.
#[tokio::test]
async fn an_unknown_pattern_is_one_error_naming_the_known_ones() {
    let rig = Rig::start(AgentLimits::default()).await;
    let stream = rig.ask(with_pattern("Capital?", "reflexion", true)).await;
    let records = dialog(stream).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_ended_with(
        &records,
        ErrorKind::Agent,
        "unknown agent pattern \"reflexion\"; the known patterns are react, plan-then-execute, supervisor",
    );
    let text = rig.telemetry.render();
    assert!(
        text.contains(r#"sluice_agent_dialogs_total{outcome="error"} 1"#),
        "{text}"
    );
    rig.stop().await;
}

/// Two task types and two patterns, as a TrustGraph workspace configures them.
fn research_or_chat() -> Routing {
    let task_types = BTreeMap::from([
        (
            "research".to_owned(),
            r#"{"name": "research", "description": "Questions needing several facts", "valid_patterns": ["react", "plan-then-execute"], "framing": "You are a careful researcher."}"#.to_owned(),
        ),
        (
            "chat".to_owned(),
            r#"{"name": "chat", "description": "Small talk", "valid_patterns": ["react"]}"#
                .to_owned(),
        ),
    ]);
    let patterns = BTreeMap::from([
        (
            "react".to_owned(),
            r#"{"name": "react", "description": "Interleaved reasoning and action"}"#.to_owned(),
        ),
        (
            "plan-then-execute".to_owned(),
            r#"{"name": "plan-then-execute", "description": "Plan first, then run each step"}"#
                .to_owned(),
        ),
    ]);
    Routing::from_entries(&task_types, &patterns)
}

/// With no pattern, the model picks the task type, then the pattern; the decision (and the
/// task type's framing) is written into the request, so the next iterations carry it.
#[tokio::test]
async fn meta_routing_chooses_the_task_type_then_the_pattern_and_writes_them_in() {
    let mut rig = Rig::start_routing(AgentLimits::default(), research_or_chat()).await;
    let mut requests = ServiceStub::start(&rig.bus, "a-req", "a-watch").await;
    let stream = rig
        .ask(question(
            "How many people live in Paris and Rome together?",
            true,
        ))
        .await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt.contains("- chat: Small talk"),
        "{}",
        call.prompt
    );
    assert!(
        call.prompt
            .contains("- research: Questions needing several facts"),
        "{}",
        call.prompt
    );
    rig.answer(&id, &[" \"Research\"\n"], (7, 1)).await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt
            .contains("- plan-then-execute: Plan first, then run each step"),
        "{}",
        call.prompt
    );
    rig.answer(&id, &["plan-then-execute"], (8, 1)).await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt.starts_with("You are a careful researcher."),
        "{}",
        call.prompt
    );
    rig.answer(&id, &[r#"[{"goal": "add them up"}]"#], (9, 1))
        .await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &[r#"{"tool": "lookup", "arguments": {}}"#], (1, 1))
        .await;
    let (tool_id, _) = rig.llm_request().await;
    rig.answer(&tool_id, &["5 million"], (1, 1)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["5 million"], (1, 1)).await;
    let records = dialog(stream).await;
    assert_eq!(records[0].content, "Created plan with 1 steps");
    assert_eq!(
        (records[0].in_token, records[0].out_token),
        (Some(24), Some(3)),
        "the routing calls' usage goes out with the first record"
    );
    let _first: (String, AgentRequest) = requests.request().await;
    let (_, handed): (_, AgentRequest) = requests.request().await;
    assert_eq!(
        (
            handed.pattern.as_deref(),
            handed.task_type.as_deref(),
            handed.framing.as_deref()
        ),
        (
            Some("plan-then-execute"),
            Some("research"),
            Some("You are a careful researcher.")
        )
    );
    rig.stop().await;
}

/// A task type the model made up falls back as TrustGraph's does: `general`, with every
/// configured pattern valid (here only ReAct, so no second call); warned and counted.
#[tokio::test]
async fn meta_routing_falls_back_on_an_unknown_answer_and_counts_it() {
    let task_types = BTreeMap::from([
        ("research".to_owned(), "{}".to_owned()),
        ("chat".to_owned(), "{}".to_owned()),
    ]);
    let routing = Routing::from_entries(&task_types, &BTreeMap::new());
    let mut rig = Rig::start_routing(AgentLimits::default(), routing).await;
    let stream = rig.ask(question("Capital?", true)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["banana"], (1, 1)).await;
    let (id, call) = rig.model_call().await;
    assert!(
        call.prompt.contains("Question: Capital?"),
        "the ReAct prompt: {}",
        call.prompt
    );
    rig.answer(&id, &["Thought: easy\nFinal Answer: Paris"], (1, 1))
        .await;
    let records = dialog(stream).await;
    assert_eq!(content(&records, AgentMessageType::Answer).trim(), "Paris");
    let text = rig.telemetry.render();
    assert!(
        text.contains(r#"sluice_agent_route_fallbacks_total{decision="task-type"} 1"#),
        "{text}"
    );
    rig.stop().await;
}

/// A pattern's template replaced by the operator's is the one the model gets; a name that is
/// not a pattern template is refused.
#[tokio::test]
async fn a_replaced_pattern_template_is_the_prompt() {
    let mut rig = Rig::start_with(AgentLimits::default(), |s| {
        s.with_template(
            "plan-create",
            "PLAN FOR: {{ question }} ({{ tools | length }} tools)",
        )
        .unwrap()
    })
    .await;
    let stream = rig
        .ask(with_pattern("Capital?", "plan-then-execute", true))
        .await;
    let (id, call) = rig.model_call().await;
    assert_eq!(call.prompt, "PLAN FOR: Capital? (1 tools)");
    rig.answer(&id, &["no"], (1, 1)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["no"], (1, 1)).await;
    let records = dialog(stream).await;
    assert_ended_with(&records, ErrorKind::Agent, "not usable twice");
    rig.stop().await;
    let e = AgentService::new(
        rig_llm().await,
        Vec::new(),
        Arc::new(MemoryBus::new(1024, 10))
            .publisher("x")
            .await
            .unwrap(),
        DEFAULT_REACT_TEMPLATE,
        AgentLimits::default(),
        AgentMetrics::register(&Telemetry::new().unwrap().registry).unwrap(),
    )
    .unwrap()
    .with_template("plan-make", "x")
    .err()
    .expect("an unknown template name is refused");
    assert!(e.to_string().contains("plan-create"), "{e}");
}

/// A text-completion client on a bus of its own, for an agent that is never asked.
async fn rig_llm() -> Arc<RequestClient<TextCompletionRequest, TextCompletionResponse>> {
    let bus: Arc<dyn Bus> = Arc::new(MemoryBus::new(1024, 10));
    Arc::new(
        RequestClient::start(bus, ClientConfig::new("text-completion", "r", "s"), None)
            .await
            .unwrap(),
    )
}

/// `max_iterations` counts the planning and each step: a plan longer than the limit ends with
/// the limit's error, not a hang.
#[tokio::test]
async fn a_plan_longer_than_the_iteration_limit_ends_with_its_error() {
    let mut rig = Rig::start(AgentLimits {
        max_iterations: 2,
        ..AgentLimits::default()
    })
    .await;
    let stream = rig
        .ask(with_pattern("Capital?", "plan-then-execute", true))
        .await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &[r#"[{"goal": "a"}, {"goal": "b"}]"#], (1, 1))
        .await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &[r#"{"tool": "nothing"}"#], (1, 1)).await;
    let records = dialog(stream).await;
    assert_ended_with(
        &records,
        ErrorKind::Agent,
        "no final answer after 2 iterations",
    );
    let text = rig.telemetry.render();
    assert!(
        text.contains(r#"sluice_agent_dialogs_total{outcome="max-iterations"} 1"#),
        "{text}"
    );
    rig.stop().await;
}

/// The dialog's deadline bounds a JSON turn: a model that never answers the planning prompt
/// ends the dialog with `timeout`.
#[tokio::test]
async fn the_dialog_deadline_ends_a_plan_whose_model_never_answers() {
    let mut rig = Rig::start(AgentLimits::default()).await;
    let mut request = with_pattern("Capital?", "plan-then-execute", true);
    request.deadline_ms = Some(now_ms() + 300);
    let stream = rig.ask(request).await;
    let _unanswered = rig.model_call().await;
    let records = dialog(stream).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_ended_with(&records, ErrorKind::Timeout, "did not finish");
    let text = rig.telemetry.render();
    assert!(
        text.contains(r#"sluice_agent_dialogs_total{outcome="deadline"} 1"#),
        "{text}"
    );
    rig.stop().await;
}

/// Not streamed, with `NonStreaming::Steps`: each thought and observation whole, then the
/// synthesised answer whole with the dialog's end.
#[tokio::test]
async fn a_plan_not_streamed_sends_each_message_whole_when_asked() {
    let mut rig = Rig::start(AgentLimits {
        non_streaming: NonStreaming::Steps,
        ..AgentLimits::default()
    })
    .await;
    let stream = rig
        .ask(with_pattern("Capital?", "plan-then-execute", false))
        .await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &[r#"[{"goal": "find it"}]"#], (1, 1)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &[r#"{"tool": "lookup"}"#], (1, 1)).await;
    let (tool_id, _) = rig.llm_request().await;
    rig.answer(&tool_id, &["Paris"], (1, 1)).await;
    let (id, _) = rig.model_call().await;
    rig.answer(&id, &["It is ", "Paris."], (1, 1)).await;
    let records = dialog(stream).await;
    use AgentMessageType::{Answer, Observation, Thought};
    assert_eq!(
        shown(&records),
        [
            (Thought, "Created plan with 1 steps"),
            (Thought, "Step 0: find it → calling lookup"),
            (Observation, "Paris"),
            (Thought, "Synthesising final answer from plan results"),
            (Answer, "It is Paris."),
        ]
    );
    assert!(records.iter().all(|r| r.end_of_message));
    assert_eq!(usage(&records), (4, 4));
    rig.stop().await;
}
