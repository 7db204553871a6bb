use serde_json::json;

use super::*;

fn parse(v: Value) -> Result<ResponsesCall, ApiError> {
    parse_responses(v.to_string().as_bytes())
}

fn refused(v: Value) -> ApiError {
    match parse(v) {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e,
    }
}

/// A string input is one user turn, exactly TrustGraph's request; instructions are the
/// system text; the sampling fields and the echo follow.
#[test]
fn a_string_input_is_one_user_turn_with_instructions_as_system() {
    let c = parse(
        json!({"model": "m", "input": "hi", "instructions": "be brief",
                         "max_output_tokens": 20, "temperature": 0.5, "stream": true,
                         "store": true, "metadata": {"k": "v"}}),
    )
    .unwrap();
    assert_eq!(c.model, "m");
    assert!(c.stream && c.request.streaming);
    assert_eq!(c.request.prompt, "hi");
    assert_eq!(c.request.system, "be brief");
    assert_eq!(c.request.messages, None);
    assert_eq!(
        (c.request.max_tokens, c.request.temperature),
        (Some(20), Some(0.5))
    );
    assert_eq!(c.echo["instructions"], "be brief");
    assert_eq!(c.echo["metadata"], json!({"k": "v"}));
    assert_eq!(c.echo["store"], false, "nothing is stored");
    assert_eq!(c.echo["tools"], json!([]));
}

/// Items: system/developer messages become the system text, parts are joined, a function
/// call joins the assistant turn before it, and its output answers it by call id.
#[test]
fn items_become_turns_with_tool_calls_and_results() {
    let c = parse(json!({"model": "m", "input": [
        {"role": "developer", "content": "d"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ], "instructions": "i",
       "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
       "tool_choice": {"type": "function", "name": "f"}}))
    .unwrap();
    assert_eq!(c.request.system, "i\n\nd");
    let turns = c.request.messages.unwrap();
    assert_eq!(turns.len(), 3);
    assert_eq!(turns[0].content, "ab");
    assert_eq!(turns[1].content, "let me see");
    assert_eq!(turns[1].tool_calls[0].id, "call_1");
    assert_eq!(turns[2].role, ChatRole::Tool);
    assert_eq!(turns[2].tool_call_id.as_deref(), Some("call_1"));
    let tools = c.request.tools.unwrap();
    assert_eq!((tools[0].name.as_str(), tools[0].strict), ("f", Some(true)));
    assert_eq!(
        c.request.tool_choice,
        Some(ToolChoice::Named { name: "f".into() })
    );
}

/// `text.format` maps to structured output as the Chat route's `response_format` does.
#[test]
fn text_format_is_structured_output() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
    let c = parse(json!({"model": "m", "input": "x", "text": {"format":
        {"type": "json_schema", "name": "n", "schema": schema, "strict": true}}}))
    .unwrap();
    assert_eq!(c.request.response_format.as_deref(), Some("json"));
    assert_eq!(c.request.schema, Some(schema));
    assert_eq!(c.request.schema_strict, Some(true));
    let c = parse(json!({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}}))
        .unwrap();
    assert_eq!(
        (c.request.response_format.as_deref(), c.request.schema),
        (Some("json"), None)
    );
    let c =
        parse(json!({"model": "m", "input": "x", "text": {"format": {"type": "text"}}})).unwrap();
    assert_eq!(c.request.response_format, None);
}

/// What sluice cannot honour is a 400 naming it, never ignored.
#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let e = refused(json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}));
    assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
    assert_eq!(e.param.as_deref(), Some("previous_response_id"));
    assert_eq!(e.code.as_deref(), Some("previous_response_not_found"));
    for (body, param) in [
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (json!({"model": "m", "input": "x", "top_p": 0.5}), "top_p"),
        (
            json!({"model": "m", "input": "x", "reasoning": {"effort": "low"}}),
            "reasoning",
        ),
        (
            json!({"model": "m", "input": "x", "background": true}),
            "background",
        ),
        (
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"model": "m", "input": [{"type": "reasoning", "summary": []}]}),
            "input[0].type",
        ),
        (
            json!({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}),
            "input[0].call_id",
        ),
        (
            json!({"model": "m", "input": "x", "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}),
            "text.format.schema",
        ),
    ] {
        let e = refused(body.clone());
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
    }
}

/// Bodies that are not Responses requests: a 400 in OpenAI's shape, one problem at a time.
#[test]
fn malformed_bodies_are_400s() {
    for body in [
        "not json",
        "[1]",
        r#"{"input": "x"}"#,
        r#"{"model": "m"}"#,
        r#"{"model": "m", "input": 3}"#,
        r#"{"model": "m", "input": []}"#,
        r#"{"model": "m", "input": [3]}"#,
        r#"{"model": "m", "input": "x", "bogus": 1}"#,
        r#"{"model": "m", "input": "x", "temperature": 9}"#,
        r#"{"model": "m", "input": "x", "max_output_tokens": 0}"#,
        r#"{"model": "m", "input": "x", "stream": "yes"}"#,
        r#"{"model": "m", "input": [{"role": "tool", "content": "x"}]}"#,
        r#"{"model": "m", "input": "x", "tools": [{"type": "function"}]}"#,
    ] {
        let e = parse_responses(body.as_bytes()).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error", "{body}");
    }
}
