use serde_json::{Value, json};

use super::*;

#[test]
fn every_field_is_written_with_null_for_none() {
    let v = serde_json::to_value(TextCompletionResponse::default()).unwrap();
    assert_eq!(
        v,
        json!({"error": null, "response": "", "in_token": null, "out_token": null,
                   "model": null, "end_of_stream": false})
    );
    let v = serde_json::to_value(PromptResponse::default()).unwrap();
    for key in [
        "error",
        "text",
        "object",
        "end_of_stream",
        "in_token",
        "out_token",
        "model",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    let v = serde_json::to_value(AgentResponse::default()).unwrap();
    assert_eq!(v["message_type"], "thought");
    assert_eq!(v["message_id"], Value::Null);
}

#[test]
fn unknown_fields_are_ignored_and_null_reads_as_default() {
    let r: TextCompletionRequest = serde_json::from_value(json!({
        "system": null, "prompt": "hi", "streaming": null, "future_field": [1, 2],
    }))
    .unwrap();
    assert_eq!(r.prompt, "hi");
    assert_eq!(r.system, "");
    assert!(!r.streaming);

    let r: TextCompletionRequest = serde_json::from_value(json!({"prompt": "x"})).unwrap();
    assert!(
        !r.streaming,
        "streaming defaults to false for older callers"
    );
}

#[test]
fn list_models_reads_and_models_are_written_only_when_there_are_some() {
    let r: TextCompletionRequest =
        serde_json::from_value(json!({"operation": "list-models"})).unwrap();
    assert_eq!(r.operation.as_deref(), Some(LIST_MODELS));
    let answer = TextCompletionResponse {
        models: vec![ModelInfo {
            id: "m".into(),
            ..ModelInfo::default()
        }],
        end_of_stream: true,
        ..TextCompletionResponse::default()
    };
    let v = serde_json::to_value(&answer).unwrap();
    assert_eq!(v["models"], json!([{"id": "m"}]));
    let v = serde_json::to_value(TextCompletionResponse::default()).unwrap();
    assert!(v.get("models").is_none());
    // TrustGraph writes every ModelInfo field, nulls and empty lists included.
    let r: TextCompletionResponse = serde_json::from_value(json!({
            "models": [{"id": "m", "name": null, "input_modalities": [], "created": null}],
            "end_of_stream": true}))
    .unwrap();
    assert_eq!(r.models[0].id, "m");
}

#[test]
fn chunk_type_is_read_as_message_type() {
    let r: AgentResponse = serde_json::from_value(json!({
        "chunk_type": "observation", "content": "42", "end_of_message": true,
        "end_of_dialog": false,
    }))
    .unwrap();
    assert_eq!(r.message_type, AgentMessageType::Observation);
    // Written under both names: TrustGraph's streaming spec's clients read `chunk_type`,
    // TrustGraph 2.x's `message_type`; and a record with both reads back the same.
    let out = serde_json::to_value(&r).unwrap();
    assert_eq!(out["message_type"], "observation");
    assert_eq!(out["chunk_type"], "observation");
    assert_eq!(serde_json::from_value::<AgentResponse>(out).unwrap(), r);
    let both: AgentResponse =
        serde_json::from_value(json!({"message_type": "answer", "chunk_type": "thought"})).unwrap();
    assert_eq!(both.message_type, AgentMessageType::Answer);
    let null: AgentResponse =
        serde_json::from_value(json!({"message_type": null, "chunk_type": "action"})).unwrap();
    assert_eq!(null.message_type, AgentMessageType::Action);
}

#[test]
fn unknown_agent_message_type_survives() {
    let r: AgentResponse = serde_json::from_value(json!({"message_type": "reflection"})).unwrap();
    assert_eq!(r.message_type, AgentMessageType::Unknown);
}

#[test]
fn trustgraph_agent_request_reads() {
    let r: AgentRequest = serde_json::from_value(json!({
        "question": "What is 2+2?", "state": null, "group": null,
        "history": [{"thought": "t", "action": "calc", "arguments": {"expr": "2+2"},
                     "observation": "4", "user": "legacy"}],
        "user": "trustgraph", "collection": "default", "streaming": true,
        "session_id": "s1", "pattern": "react", "tool_hints": {"x": 1}
    }))
    .unwrap();
    assert_eq!(r.history.len(), 1);
    assert_eq!(r.history[0].arguments["expr"], "2+2");
    assert!(r.streaming);
}

#[test]
fn error_records_are_terminal_for_every_type() {
    let e = Error::new(ErrorKind::Llm, "provider said no");
    let t = TextCompletionResponse::from_error(e.clone());
    assert!(t.is_terminal() && t.error().is_some());
    let p = PromptResponse::from_error(e.clone());
    assert!(p.is_terminal() && p.error().is_some());
    let a = AgentResponse::from_error(e);
    assert!(a.is_terminal() && a.end_of_message);
    assert_eq!(a.message_type, AgentMessageType::Error);
    let v = serde_json::to_value(&t).unwrap();
    assert_eq!(
        v["error"],
        json!({"type": "llm-error", "message": "provider said no"})
    );
}

#[test]
fn error_kinds_round_trip_through_their_wire_strings() {
    for k in ErrorKind::ALL {
        assert_eq!(ErrorKind::from_wire(k.as_str()), k);
    }
    let other = ErrorKind::from_wire("something-else");
    assert_eq!(other, ErrorKind::Other("something-else".into()));
    // Another implementation's type survives a read and a write unchanged; a missing or
    // null type reads as an empty Other and is written back as the empty string.
    for (wire, kind) in [
        (r#"{"type":"something-else","message":"m"}"#, other),
        (r#"{"type":"timeout","message":"m"}"#, ErrorKind::Timeout),
        (r#"{"type":null,"message":"m"}"#, ErrorKind::default()),
    ] {
        let e: Error = serde_json::from_str(wire).unwrap();
        assert_eq!(e.kind, kind, "{wire}");
        let back = serde_json::to_value(&e).unwrap();
        assert_eq!(back["type"], kind.as_str(), "{wire}");
    }
    let e: Error = serde_json::from_str(r#"{"message":"m"}"#).unwrap();
    assert_eq!(
        (e.kind, e.message.as_str()),
        (ErrorKind::Other(String::new()), "m")
    );
}

#[test]
fn prompt_terms_take_encoded_strings_and_plain_values() {
    let r: PromptRequest =
        serde_json::from_str(r#"{"id":"t","terms":{"a":"\"x\"","b":[1,2],"c":{"k":true}}}"#)
            .unwrap();
    assert_eq!(r.terms["a"], "\"x\"");
    assert_eq!(r.terms["b"], "[1,2]");
    assert_eq!(r.terms["c"], r#"{"k":true}"#);
    let r: PromptRequest = serde_json::from_str(r#"{"id":"t","terms":null}"#).unwrap();
    assert!(r.terms.is_empty());
}

/// TrustGraph's prompt client (`tg-invoke-prompt`, trustgraph-base's `socket_client.py`) sends
/// `variables` with plain values, which TrustGraph's gateway JSON-encodes into the terms
/// (`trustgraph/messaging/translators/prompt.py`); so does sluice's reading of a request.
#[test]
fn trustgraphs_variables_are_terms_json_encoded() {
    let r: PromptRequest = serde_json::from_str(
        r#"{"id":"t","variables":{"x":"tea","n":2},"terms":{"y":"\"z\""},"streaming":true}"#,
    )
    .unwrap();
    assert_eq!(r.terms["x"], "\"tea\"");
    assert_eq!(r.terms["n"], "2");
    assert_eq!(r.terms["y"], "\"z\"");
    assert!(r.streaming);
    let written = serde_json::to_value(&r).unwrap();
    assert!(
        written.get("variables").is_none(),
        "written as terms: {written}"
    );
}

fn text(response: &str, out: Option<u64>) -> TextCompletionResponse {
    TextCompletionResponse {
        response: response.into(),
        out_token: out,
        model: Some("m".into()),
        ..Default::default()
    }
}

#[test]
fn text_deltas_coalesce_into_what_they_say_together() {
    let mut held = text("Hel", Some(1));
    assert!(held.coalesce(text("lo", None)).is_ok());
    assert!(held.coalesce(text(" you", Some(2))).is_ok());
    assert_eq!(held.response, "Hello you");
    assert_eq!(held.out_token, Some(3));
    assert_eq!(
        held.in_token, None,
        "no count is made up where none was given"
    );
    // An error, another model, a finish reason on a delta: never merged.
    let failed = TextCompletionResponse::from_error(Error::new(ErrorKind::Timeout, "t"));
    assert_eq!(held.coalesce(failed.clone()), Err(failed));
    let other = TextCompletionResponse {
        model: Some("n".into()),
        ..text("x", None)
    };
    assert_eq!(held.coalesce(other.clone()), Err(other));
    let finished = TextCompletionResponse {
        finish_reason: Some("stop".into()),
        ..text("x", None)
    };
    assert_eq!(held.coalesce(finished.clone()), Err(finished));
    let big = text(&"x".repeat(COALESCE_MAX_BYTES), None);
    assert_eq!(
        held.coalesce(big.clone()),
        Err(big),
        "held text stays bounded"
    );
    assert_eq!(held.response, "Hello you");
    // A clean end takes the held text along and stays the end.
    let end = TextCompletionResponse {
        end_of_stream: true,
        finish_reason: Some("stop".into()),
        ..text("", Some(1))
    };
    assert!(held.coalesce(end).is_ok());
    assert!(held.end_of_stream && !held.is_delta());
    assert_eq!(held.response, "Hello you");
    assert_eq!(held.out_token, Some(4));
    assert_eq!(held.finish_reason.as_deref(), Some("stop"));
    assert_eq!(held.clone().coalesce(text("x", None)), Err(text("x", None)));
}

#[test]
fn prompt_objects_are_never_merged_and_text_is() {
    let piece = |t: &str| PromptResponse {
        text: Some(t.into()),
        in_token: Some(1),
        ..Default::default()
    };
    let mut held = piece("a");
    assert!(held.coalesce(piece("b")).is_ok());
    assert_eq!(held.text.as_deref(), Some("ab"));
    assert_eq!(held.in_token, Some(2));
    let object = PromptResponse {
        object: Some("{}".into()),
        ..Default::default()
    };
    assert!(!object.is_delta());
    assert_eq!(held.coalesce(object.clone()), Err(object));
    // A text template's end takes the held text along; a jsonl end (an object) does not.
    let mut ended = held.clone();
    ended
        .coalesce(PromptResponse {
            end_of_stream: true,
            out_token: Some(3),
            ..Default::default()
        })
        .unwrap();
    assert!(ended.end_of_stream);
    assert_eq!(ended.text.as_deref(), Some("ab"));
    assert_eq!(ended.out_token, Some(3));
    let object_end = PromptResponse {
        end_of_stream: true,
        object: Some("{}".into()),
        ..Default::default()
    };
    assert_eq!(held.coalesce(object_end.clone()), Err(object_end));
}

#[test]
fn agent_pieces_merge_within_one_message_only() {
    let piece = |t: AgentMessageType, c: &str, eom: bool| AgentResponse {
        message_type: t,
        content: c.into(),
        end_of_message: eom,
        message_id: Some("m1".into()),
        ..Default::default()
    };
    let mut held = piece(AgentMessageType::Thought, "I ", false);
    assert!(
        held.coalesce(piece(AgentMessageType::Thought, "think", true))
            .is_ok()
    );
    assert_eq!(held.content, "I think");
    assert!(
        held.end_of_message,
        "the message's end travels with its last piece"
    );
    assert!(!held.is_delta(), "nothing merges into a finished message");
    let mut held = piece(AgentMessageType::Thought, "I ", false);
    let answer = piece(AgentMessageType::Answer, "42", false);
    assert_eq!(held.coalesce(answer.clone()), Err(answer));
    assert!(!piece(AgentMessageType::Action, "tool", false).is_delta());
    assert!(!piece(AgentMessageType::Observation, "seen", false).is_delta());
    // The dialog's last record takes the held answer piece along, and ends the dialog.
    let mut held = piece(AgentMessageType::Answer, "4", false);
    let last = AgentResponse {
        end_of_dialog: true,
        ..piece(AgentMessageType::Answer, "2", true)
    };
    assert!(held.coalesce(last).is_ok());
    assert_eq!(held.content, "42");
    assert!(held.end_of_message && held.end_of_dialog && held.is_terminal());
    // A thought never rides on the final answer.
    let mut held = piece(AgentMessageType::Thought, "so", false);
    let last = AgentResponse {
        end_of_dialog: true,
        ..piece(AgentMessageType::Answer, "", true)
    };
    assert_eq!(held.coalesce(last.clone()), Err(last));
}

/// The fields TrustGraph 2.11's orchestrator adds to its agent records.
const ORCHESTRATION_FIELDS: [&str; 6] = [
    "task_type",
    "framing",
    "correlation_id",
    "parent_session_id",
    "subagent_goal",
    "expected_siblings",
];

/// TrustGraph 2.11's orchestration fields, as it writes a supervisor's subagent request with
/// a plan and the subagents' results in its history, are read and written back as they were;
/// a request without them is written without them, as before they existed.
#[test]
fn trustgraph_2_11_orchestration_fields_survive_and_are_absent_when_unset() {
    let request = json!({
        "question": "q", "state": "", "group": null, "collection": "default",
        "streaming": true, "session_id": "s2", "conversation_id": "c1",
        "pattern": "supervisor", "task_type": "research", "framing": "You are a librarian.",
        "correlation_id": "corr-1", "parent_session_id": "s1", "subagent_goal": "find X",
        "expected_siblings": 3,
        "history": [{"thought": "", "action": "", "arguments": {}, "observation": "",
            "step_type": "plan",
            "plan": [
                {"goal": "g1", "tool_hint": "search", "depends_on": [], "status": "completed",
                 "result": "r1"},
                {"goal": "g2", "tool_hint": "", "depends_on": [0], "status": "pending",
                 "result": ""}],
            "subagent_results": {"find X": "X is 4"}}]
    });
    let r: AgentRequest = serde_json::from_value(request.clone()).unwrap();
    assert_eq!(
        (r.expected_siblings, r.subagent_goal.as_deref()),
        (Some(3), Some("find X"))
    );
    assert_eq!(r.history[0].plan[1].depends_on, [0]);
    assert_eq!(r.history[0].subagent_results["find X"], "X is 4");
    let out = serde_json::to_value(&r).unwrap();
    for key in ORCHESTRATION_FIELDS {
        assert_eq!(out[key], request[key], "{key}");
    }
    for key in ["plan", "subagent_results"] {
        assert_eq!(out["history"][0][key], request["history"][0][key], "{key}");
    }

    let plain = serde_json::to_value(AgentRequest {
        question: "q".into(),
        history: vec![AgentStep::default()],
        ..AgentRequest::default()
    })
    .unwrap();
    for key in ORCHESTRATION_FIELDS {
        assert!(plain.get(key).is_none(), "{key} written unset: {plain}");
    }
    for key in ["plan", "subagent_results"] {
        assert!(plain["history"][0].get(key).is_none(), "{key}: {plain}");
    }
    // A plan step without a status is pending, as TrustGraph's default says.
    let step: PlanStep = serde_json::from_value(json!({"goal": "g", "status": null})).unwrap();
    assert_eq!(step.status, "pending");
}

/// An `explain` record (TrustGraph 2.11's explainability) keeps its type and its provenance
/// through sluice; a record without them is written without them.
#[test]
fn explain_records_pass_through_and_other_records_do_not_grow() {
    let explain = json!({
        "message_type": "explain", "content": "", "end_of_message": true,
        "end_of_dialog": false, "message_id": "m1",
        "explain_id": "urn:trustgraph:agent:s1/i1", "explain_graph": "urn:graph:retrieval",
        "explain_triples": [{"s": {"t": "i", "i": "urn:a"}, "p": {"t": "i", "i": "urn:b"},
                             "o": {"t": "l", "v": "c"}}]
    });
    let r: AgentResponse = serde_json::from_value(explain.clone()).unwrap();
    assert_eq!(r.message_type, AgentMessageType::Explain);
    let out = serde_json::to_value(&r).unwrap();
    assert_eq!(
        (&out["message_type"], &out["chunk_type"]),
        (&json!("explain"), &json!("explain"))
    );
    for key in ["explain_id", "explain_graph", "explain_triples"] {
        assert_eq!(out[key], explain[key], "{key}");
    }
    let plain = serde_json::to_value(AgentResponse::default()).unwrap();
    for key in ["explain_id", "explain_graph", "explain_triples"] {
        assert!(plain.get(key).is_none(), "{key} written unset: {plain}");
    }
}
