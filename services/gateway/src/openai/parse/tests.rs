//! The chat body's checks and translation: what lands on the record, what is refused and
//! how OpenAI names it.

use axum::http::StatusCode;
use serde_json::{Value, json};
use sluice_schema::{ChatRole, ToolChoice};

use super::*;

fn parse(v: Value) -> Result<ChatCall, ApiError> {
    parse_chat(v.to_string().as_bytes())
}

#[test]
fn one_user_turn_is_a_plain_trustgraph_request() {
    let c = parse(json!({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "hi"}]}
    ], "temperature": 0.2, "max_tokens": 7, "stop": "END"}))
    .unwrap();
    assert!(!c.stream && !c.include_usage);
    let r = &c.request;
    assert_eq!(
        (r.system.as_str(), r.prompt.as_str()),
        ("be brief", "say hi")
    );
    assert_eq!(r.messages, None);
    assert_eq!(r.temperature, Some(0.2));
    assert_eq!(r.max_tokens, Some(7));
    assert_eq!(r.stop, Some(vec!["END".to_owned()]));
    assert_eq!(r.model.as_deref(), Some("m"));
    // The record a TrustGraph processor reads has its usual fields, and the extension
    // fields only where set.
    let wire = serde_json::to_value(r).unwrap();
    assert!(wire.get("messages").is_none());
    assert_eq!(wire["prompt"], "say hi");
}

#[test]
fn a_conversation_rides_in_messages_and_flattened_in_prompt() {
    let c = parse(json!({"model": "m", "stream": true,
        "stream_options": {"include_usage": true},
        "max_completion_tokens": 5, "max_tokens": 99, "messages": [
        {"role": "developer", "content": "rule one"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "system", "content": "rule two"},
        {"role": "user", "content": "and 3+3?"}
    ]}))
    .unwrap();
    assert!(c.stream && c.include_usage && c.request.streaming);
    assert_eq!(c.request.system, "rule one\n\nrule two");
    assert_eq!(c.request.max_tokens, Some(5), "max_completion_tokens wins");
    let turns = c.request.messages.clone().unwrap();
    assert_eq!(turns.len(), 3);
    assert_eq!(turns[1].role, ChatRole::Assistant);
    assert_eq!(
        c.request.prompt,
        "User: 2+2?\n\nAssistant: 4\n\nUser: and 3+3?\n\nAssistant:"
    );
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name_with_openai_codes() {
    let base = || json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let cases: Vec<(Value, Option<&str>, Option<&str>)> = vec![
        (json!({"n": 2}), Some("n"), Some("unsupported_value")),
        (
            json!({"tools": [{"type": "function"}]}),
            Some("tools[0].function.name"),
            Some("missing_required_parameter"),
        ),
        (
            json!({"tools": [{"type": "web_search"}]}),
            Some("tools[0].type"),
            Some("unsupported_parameter"),
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            Some("tools[0].function.name"),
            Some("invalid_value"),
        ),
        (
            json!({"tool_choice": "required"}),
            Some("tool_choice"),
            Some("invalid_value"),
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            Some("tool_choice.function.name"),
            Some("invalid_value"),
        ),
        (
            json!({"functions": [{"name": "f"}]}),
            Some("functions"),
            Some("unsupported_parameter"),
        ),
        (
            json!({"top_p": 0.5}),
            Some("top_p"),
            Some("unsupported_parameter"),
        ),
        (
            json!({"logprobs": true}),
            Some("logprobs"),
            Some("unsupported_parameter"),
        ),
        (
            json!({"seed": 4}),
            Some("seed"),
            Some("unsupported_parameter"),
        ),
        (
            json!({"stream_options": {"include_usage": true}}),
            Some("stream_options"),
            Some("invalid_value"),
        ),
        (
            json!({"temperature": 2.5}),
            Some("temperature"),
            Some("invalid_value"),
        ),
        (
            json!({"temperature": "hot"}),
            Some("temperature"),
            Some("invalid_type"),
        ),
        (
            json!({"max_tokens": 0}),
            Some("max_tokens"),
            Some("invalid_value"),
        ),
        (
            json!({"stop": ["a", "b", "c", "d", "e"]}),
            Some("stop"),
            Some("invalid_value"),
        ),
        (
            json!({"response_format": {"type": "grammar"}}),
            Some("response_format.type"),
            Some("invalid_value"),
        ),
        (json!({"frobnicate": 1}), None, None),
        (json!({"model": null}), None, None),
        (
            json!({"messages": []}),
            Some("messages"),
            Some("empty_array"),
        ),
        (
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            Some("messages[0].tool_call_id"),
            Some("missing_required_parameter"),
        ),
        (
            json!({"messages": [{"role": "tool", "content": "x", "tool_call_id": "nope"}]}),
            Some("messages[0].tool_call_id"),
            Some("invalid_value"),
        ),
        (
            json!({"messages": [{"role": "function", "content": "x", "name": "f"}]}),
            Some("messages[0].role"),
            Some("unsupported_parameter"),
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            Some("messages[0].content[0].type"),
            Some("unsupported_value"),
        ),
        (
            json!({"messages": [{"role": "system", "content": "only rules"}]}),
            Some("messages"),
            Some("invalid_value"),
        ),
    ];
    for (patch, param, code) in cases {
        let mut body = base();
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        let e = parse(body.clone()).expect_err(&body.to_string());
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(e.param.as_deref(), param, "{body}: {e:?}");
        assert_eq!(e.code.as_deref(), code, "{body}: {e:?}");
        let shape = e.body();
        for key in ["message", "type", "param", "code"] {
            assert!(shape["error"].get(key).is_some(), "{shape}");
        }
    }
    // Neutral values of what is refused otherwise pass, as do ignored caller ids.
    let mut body = base();
    for (k, v) in [
        ("n", json!(1)),
        ("top_p", json!(1)),
        ("presence_penalty", json!(0)),
        ("tools", json!([])),
        ("tool_choice", json!("none")),
        ("parallel_tool_calls", json!(false)),
        ("user", json!("u-1")),
        ("logprobs", json!(false)),
        ("response_format", json!({"type": "text"})),
    ] {
        body[k] = v;
    }
    parse(body).unwrap();
    assert_eq!(
        parse_chat(b"{not json").unwrap_err().status,
        StatusCode::BAD_REQUEST
    );
}

/// Tools, a named choice, and a conversation with a tool call and its result land on the
/// record's tool fields; a request without tools writes none of them.
#[test]
fn tools_and_tool_turns_map_onto_the_record() {
    let c = parse(json!({"model": "m",
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "description": "the weather", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "now"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": false,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "get_weather",
                "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}))
    .unwrap();
    let r = &c.request;
    let tools = r.tools.as_ref().unwrap();
    assert_eq!(tools.len(), 2);
    assert_eq!(tools[0].name, "get_weather");
    assert_eq!(tools[0].strict, Some(true));
    assert_eq!(tools[0].parameters["properties"]["city"]["type"], "string");
    assert_eq!(tools[1].parameters, sluice_schema::tools::no_parameters());
    assert_eq!(
        r.tool_choice,
        Some(ToolChoice::Named {
            name: "get_weather".into()
        })
    );
    assert_eq!(r.parallel_tool_calls, Some(false));
    let turns = r.messages.as_ref().unwrap();
    assert_eq!(turns[1].tool_calls[0].arguments, "{\"city\":\"Paris\"}");
    assert_eq!(turns[2].role, ChatRole::Tool);
    assert_eq!(turns[2].tool_call_id.as_deref(), Some("call_1"));
    assert!(r.uses_tools());
    assert!(r.prompt.contains("Tool result: sunny"), "{}", r.prompt);
    let plain = parse(json!({"model": "m", "tool_choice": "auto",
        "messages": [{"role": "user", "content": "x"}]}))
    .unwrap();
    assert!(!plain.request.uses_tools());
    let wire = serde_json::to_value(&plain.request).unwrap();
    for field in ["tools", "tool_choice", "parallel_tool_calls", "messages"] {
        assert!(wire.get(field).is_none(), "{field} written: {wire}");
    }
}

#[test]
fn json_modes_map_onto_the_record() {
    let c = parse(
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema",
            "json_schema": {"name": "r", "schema": {"type": "object"}}}}),
    )
    .unwrap();
    assert_eq!(c.request.response_format.as_deref(), Some("json"));
    assert_eq!(c.request.schema, Some(json!({"type": "object"})));
    assert_eq!(c.request.schema_strict, None);
    let c = parse(
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema",
            "json_schema": {"name": "r", "strict": true, "schema": {"type": "object"}}}}),
    )
    .unwrap();
    assert_eq!(c.request.schema_strict, Some(true));
}
