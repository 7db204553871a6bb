use serde_json::{Value, json};
use sluice_schema::{ChatRole, ToolChoice, ToolMode};

use super::*;

fn parse(v: Value) -> Result<MessagesCall, AnthropicError> {
    parse_messages(v.to_string().as_bytes())
}

fn refused(v: Value) -> String {
    let e = parse(v.clone()).expect_err(&v.to_string());
    assert_eq!(e.status.as_u16(), 400, "{v}: {e:?}");
    assert_eq!(e.kind, "invalid_request_error");
    e.message
}

/// One user message is TrustGraph's request: the prompt, the system text, the settings.
#[test]
fn a_single_user_message_is_the_prompt_with_its_settings() {
    let call = parse(json!({
        "model": "m", "max_tokens": 64, "system": "be brief",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.5, "stop_sequences": ["END", ""], "stream": true,
        "metadata": {"user_id": "u-1"}, "service_tier": "auto", "top_p": 1.0
    }))
    .unwrap();
    assert_eq!((call.model.as_str(), call.stream), ("m", true));
    let r = call.request;
    assert_eq!((r.system.as_str(), r.prompt.as_str()), ("be brief", "hi"));
    assert_eq!(r.messages, None);
    assert_eq!((r.max_tokens, r.temperature), (Some(64), Some(0.5)));
    assert_eq!(r.stop, Some(vec!["END".to_owned()]));
    assert_eq!(r.model.as_deref(), Some("m"));
    assert!(r.streaming);
}

/// System text blocks are joined; text blocks of a message are its text; a conversation with
/// tool use becomes turns: the assistant's calls (input as JSON text), each result a tool
/// turn answering its call, the user's text after them.
#[test]
fn blocks_and_tool_use_become_turns() {
    let call = parse(json!({
        "model": "m", "max_tokens": 10,
        "system": [{"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "two"}],
        "tools": [{"name": "get_weather", "description": "weather",
                   "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Paris"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"q": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sun"}, {"type": "text", "text": "ny"}]},
                {"type": "text", "text": "thanks"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": true}]}
        ]
    }))
    .unwrap();
    let r = call.request;
    assert_eq!(r.system, "one\n\ntwo");
    let turns = r.messages.unwrap();
    let roles: Vec<ChatRole> = turns.iter().map(|t| t.role).collect();
    use ChatRole::{Assistant, Tool, User};
    assert_eq!(roles, [User, Assistant, Tool, User, Assistant, Tool]);
    assert_eq!(turns[0].content, "Paris?");
    assert_eq!(turns[1].content, "Looking.");
    assert_eq!(turns[1].tool_calls[0].id, "toolu_1");
    assert_eq!(turns[1].tool_calls[0].arguments, r#"{"q":"Paris"}"#);
    assert_eq!(
        (turns[2].content.as_str(), turns[2].tool_call_id.as_deref()),
        ("sunny", Some("toolu_1"))
    );
    assert_eq!(turns[3].content, "thanks");
    assert_eq!(turns[5].content, "Error: down");
    assert!(
        !r.prompt.is_empty(),
        "flattened for processors without messages"
    );
    assert_eq!(r.tools.unwrap()[0].name, "get_weather");
    assert_eq!(r.tool_choice, Some(ToolChoice::Mode(ToolMode::Required)));
    assert_eq!(r.parallel_tool_calls, Some(false));
}

/// A named choice, and structured output as `output_config.format` (and the beta's
/// `output_format`).
#[test]
fn a_named_tool_choice_and_structured_output() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
    let call = parse(json!({
        "model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
        "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    }))
    .unwrap();
    let r = call.request;
    assert_eq!(r.tool_choice, Some(ToolChoice::Named { name: "f".into() }));
    assert_eq!(
        (r.response_format.as_deref(), r.schema),
        (Some("json"), Some(schema.clone()))
    );
    let call = parse(json!({
        "model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
        "output_format": {"type": "json_schema", "schema": schema}, "thinking": {"type": "disabled"}
    }))
    .unwrap();
    assert_eq!(call.request.schema, Some(schema));
    // Without tools, auto and none change nothing.
    let call = parse(
        json!({"model": "m", "max_tokens": 1, "tool_choice": {"type": "auto"},
                             "messages": [{"role": "user", "content": "x"}]}),
    )
    .unwrap();
    assert_eq!(call.request.tool_choice, None);
}

/// What Anthropic refuses, refused as it words it; what sluice cannot honour, by name; a value
/// is never echoed (the body holds prompts).
#[test]
fn refusals_name_the_field_never_the_value() {
    let base =
        || json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
    let with = |k: &str, v: Value| {
        let mut b = base();
        b[k] = v;
        b
    };
    let without = |k: &str| {
        let mut b = base();
        b.as_object_mut().unwrap().remove(k);
        b
    };
    assert_eq!(refused(without("max_tokens")), "max_tokens: Field required");
    assert_eq!(refused(without("model")), "model: Field required");
    assert_eq!(refused(without("messages")), "messages: Field required");
    assert_eq!(
        refused(with("frobnicate", json!(1))),
        "frobnicate: Extra inputs are not permitted"
    );
    assert!(refused(with("max_tokens", json!(0))).starts_with("max_tokens:"));
    assert!(refused(with("temperature", json!(1.5))).starts_with("temperature:"));
    assert!(refused(with("top_k", json!(5))).starts_with("top_k: not supported"));
    assert!(refused(with("top_p", json!(0.9))).starts_with("top_p: not supported"));
    assert!(
        refused(with(
            "thinking",
            json!({"type": "enabled", "budget_tokens": 1024})
        ))
        .starts_with("thinking:")
    );
    assert!(refused(with("mcp_servers", json!([]))).starts_with("mcp_servers: not supported"));
    assert!(refused(with("messages", json!([]))).starts_with("messages:"));
    assert_eq!(
        refused(with("stream", json!("secret-yes"))),
        "stream: expected a boolean"
    );
    let secret = "a secret prompt";
    for body in [
        with("messages", json!([{"role": "system", "content": secret}])),
        with("messages", json!([{"role": "user", "content": 5}])),
        with(
            "messages",
            json!([{"role": "user", "content": [{"type": "image", "source": {"data": secret}}]}]),
        ),
        with(
            "messages",
            json!([{"role": "user", "content": [{"type": "text"}]}]),
        ),
        with(
            "messages",
            json!([{"role": "user", "content": [{"text": secret}]}]),
        ),
        with(
            "messages",
            json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": secret}]}]),
        ),
        with(
            "messages",
            json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": secret}]}]),
        ),
        with("system", json!([{"type": "image"}])),
        with("system", json!(7)),
        with("tools", json!([{"name": "bad name!", "input_schema": {}}])),
        with("tools", json!([{"name": "f"}])),
        with(
            "tools",
            json!([{"type": "web_search_20250305", "name": "web_search"}]),
        ),
        with(
            "tools",
            json!([{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]),
        ),
        with("tool_choice", json!({"type": "any"})),
        with("tool_choice", json!({"type": "sometimes"})),
        with("output_config", json!({"format": {"type": "xml"}})),
        with(
            "output_format",
            json!({"type": "json_schema", "schema": secret}),
        ),
    ] {
        let m = refused(body.clone());
        assert!(!m.contains(secret), "{body}: {m}");
    }
    for (bytes, starts) in [
        (&b""[..], "There was an error parsing"),
        (b"{", "There was an error parsing"),
        (b"[]", "The request body must be a JSON object"),
        (b"null", "The request body must be a JSON object"),
    ] {
        let e = parse_messages(bytes).unwrap_err();
        assert!(e.message.starts_with(starts), "{e:?}");
    }
}

#[test]
fn decoding_paths_are_dotted_as_anthropics() {
    assert_eq!(
        dotted("field `messages[0].content[2].text`: expected a string"),
        "messages.0.content.2.text: expected a string"
    );
    assert_eq!(
        dotted("the record: expected an object"),
        "the record: expected an object"
    );
}
