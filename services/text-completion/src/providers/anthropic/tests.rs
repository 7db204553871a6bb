use super::*;

fn chunk(name: &str, data: &str) -> Chunk {
    match Decoder::default().event(name, data).unwrap() {
        Event::Chunk(c) => c,
        _ => panic!("not a chunk"),
    }
}

#[test]
fn events_decode_with_cache_tokens_counted_as_input() {
    let c = chunk(
        "message_start",
        r#"{"type":"message_start","message":{"usage":{"input_tokens":25,"cache_read_input_tokens":5,"output_tokens":1}}}"#,
    );
    assert_eq!(
        c.usage,
        Some(Usage {
            input: 30,
            output: 1
        })
    );
    let c = chunk(
        "content_block_delta",
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
    );
    assert_eq!(c.text, "Hello");
    let c = chunk(
        "message_delta",
        r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}"#,
    );
    assert_eq!(c.finish_reason.as_deref(), Some("end_turn"));
    assert!(matches!(
        Decoder::default()
            .event("ping", r#"{"type":"ping"}"#)
            .unwrap(),
        Event::Ignore
    ));
    assert!(matches!(
        Decoder::default()
            .event("message_stop", r#"{"type":"message_stop"}"#)
            .unwrap(),
        Event::Stop
    ));
    let e = Decoder::default()
        .event(
            "error",
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        )
        .err()
        .unwrap();
    assert_eq!(e.kind, FailureKind::Stream);
    assert!(e.message.contains("overloaded_error"));
}

#[test]
fn a_conversation_and_its_settings_map_onto_messages() {
    let p = AnthropicProvider::new(AnthropicConfig::new("http://127.0.0.1:1", "m")).unwrap();
    let b = p
        .body(&crate::providers::conversation_request(), true)
        .unwrap();
    assert_eq!(b["model"], "other-model");
    assert_eq!(b["stream"], true);
    assert!(b.get("anthropic_version").is_none());
    assert_eq!(b["system"], "one word");
    assert_eq!(
        b["messages"],
        json!([{"role": "user", "content": "France?"},
                   {"role": "assistant", "content": "Paris"},
                   {"role": "user", "content": "Italy?"}])
    );
    assert_eq!(b["max_tokens"], 9);
    assert_eq!(b["temperature"], 0.5);
    assert_eq!(b["stop_sequences"], json!(["END"]));
}

fn vertex(location: &str, model: &str) -> AnthropicProvider {
    let origin = crate::providers::vertex_origin(location);
    AnthropicProvider::new(AnthropicConfig::vertex("p", location, origin, model)).unwrap()
}

#[test]
fn vertex_urls_name_the_project_location_model_and_verb() {
    let p = vertex("us-east5", "claude-sonnet-4-5@20250929");
    let path = "/v1/projects/p/locations/us-east5/publishers/anthropic/models";
    assert_eq!(
        p.url,
        format!(
            "https://us-east5-aiplatform.googleapis.com{path}/claude-sonnet-4-5@20250929:streamRawPredict"
        )
    );
    let other = crate::providers::conversation_request();
    assert_eq!(
        p.url(&other, false),
        format!("https://us-east5-aiplatform.googleapis.com{path}/other-model:rawPredict")
    );
    assert_eq!(
        p.url(&other, true),
        format!("https://us-east5-aiplatform.googleapis.com{path}/other-model:streamRawPredict")
    );
    let g = vertex("global", "claude-sonnet-4-5@20250929");
    assert_eq!(
        g.url,
        "https://aiplatform.googleapis.com/v1/projects/p/locations/global/publishers/anthropic/models/claude-sonnet-4-5@20250929:streamRawPredict"
    );
    assert_eq!(g.name(), "vertex-anthropic");
}

#[test]
fn a_vertex_body_names_the_version_and_not_the_model() {
    let p = vertex("us-east5", "m");
    let request = crate::providers::conversation_request();
    let b = p.body(&request, true).unwrap();
    assert!(b.get("model").is_none(), "{b}");
    assert_eq!(b["anthropic_version"], "vertex-2023-10-16");
    assert_eq!(b["stream"], true);
    assert_eq!(b["system"], "one word");
    assert_eq!(b["messages"].as_array().map(Vec::len), Some(3));
    assert_eq!(b["max_tokens"], 9);
    assert_eq!(b["stop_sequences"], json!(["END"]));
    let b = p.body(&request, false).unwrap();
    assert!(b.get("stream").is_none() && b.get("model").is_none(), "{b}");
    assert_eq!(b["anthropic_version"], "vertex-2023-10-16");
}

#[test]
fn errors_in_either_shape_are_described_and_auth_names_the_token_source() {
    let p = vertex("us-east5", "m");
    let e = p.http_error(
        reqwest::StatusCode::TOO_MANY_REQUESTS,
        r#"{"error":{"code":429,"message":"Quota exceeded","status":"RESOURCE_EXHAUSTED"}}"#,
    );
    assert_eq!(e.kind, FailureKind::RateLimited);
    assert!(
        e.message.contains("RESOURCE_EXHAUSTED") && e.message.contains("Quota exceeded"),
        "{}",
        e.message
    );
    let e = p.http_error(
        reqwest::StatusCode::from_u16(529).unwrap(),
        r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
    );
    assert_eq!(e.kind, FailureKind::Server);
    assert!(
        e.message.contains("(overloaded_error): Overloaded"),
        "{}",
        e.message
    );
    for status in [401, 403] {
        let e = p.http_error(
                reqwest::StatusCode::from_u16(status).unwrap(),
                r#"{"error":{"code":401,"message":"Request had invalid authentication credentials.","status":"UNAUTHENTICATED"}}"#,
            );
        assert!(e.message.contains("VERTEX_ACCESS_TOKEN"), "{}", e.message);
    }
}

#[test]
fn a_whole_answer_decodes_its_text_blocks_usage_and_stop_reason() {
    let done = decode_message(
        &json!({"id": "msg_1", "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "Hello"}, {"type": "thinking", "thinking": "hm"},
                        {"type": "text", "text": " there"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 20, "cache_read_input_tokens": 5, "output_tokens": 15}}),
    )
    .unwrap();
    assert_eq!(done.text, "Hello there");
    assert_eq!(
        done.usage,
        Some(Usage {
            input: 25,
            output: 15
        })
    );
    assert_eq!(done.finish_reason.as_deref(), Some("end_turn"));
    let e = decode_message(&json!({"type": "message"})).unwrap_err();
    assert_eq!(e.kind, FailureKind::Protocol);
}

/// Tools, each choice, parallel calls off, and a conversation with two calls and their
/// results, as Anthropic wants them.
#[test]
fn tools_choices_and_tool_turns_map_onto_messages() {
    use sluice_schema::Tool;
    let p = AnthropicProvider::new(AnthropicConfig::new("http://127.0.0.1:1", "m")).unwrap();
    let mut call = ChatMessage::new(ChatRole::Assistant, "Looking.");
    call.tool_calls = vec![
        ToolCall {
            id: "toolu_1".into(),
            name: "weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        },
        ToolCall {
            id: "toolu_2".into(),
            name: "time".into(),
            arguments: String::new(),
        },
    ];
    let result = |id: &str, content: &str| {
        let mut m = ChatMessage::new(ChatRole::Tool, content);
        m.tool_call_id = Some(id.into());
        m
    };
    let mut req = TextCompletionRequest {
        messages: Some(vec![
            ChatMessage::new(ChatRole::User, "Paris?"),
            call,
            result("toolu_1", "sunny"),
            result("toolu_2", "noon"),
            ChatMessage::new(ChatRole::User, "And so?"),
        ]),
        tools: Some(vec![
            Tool {
                name: "weather".into(),
                description: Some("The weather".into()),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                strict: None,
            },
            Tool {
                name: "time".into(),
                description: None,
                parameters: sluice_schema::tools::no_parameters(),
                strict: None,
            },
        ]),
        ..Default::default()
    };
    let b = p.body(&req, true).unwrap();
    assert_eq!(
        b["tools"],
        json!([{"name": "weather", "description": "The weather",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
                   {"name": "time", "input_schema": {"type": "object", "properties": {}}}])
    );
    assert!(b.get("tool_choice").is_none(), "{b}");
    assert_eq!(
        b["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "time", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "noon"},
                {"type": "text", "text": "And so?"}]}
        ])
    );
    let choice = |req: &TextCompletionRequest| p.body(req, true).unwrap()["tool_choice"].clone();
    req.tool_choice = Some(ToolChoice::Mode(ToolMode::Required));
    assert_eq!(choice(&req), json!({"type": "any"}));
    req.tool_choice = Some(ToolChoice::Mode(ToolMode::None));
    req.parallel_tool_calls = Some(false);
    assert_eq!(choice(&req), json!({"type": "none"}));
    req.tool_choice = Some(ToolChoice::Named {
        name: "time".into(),
    });
    assert_eq!(
        choice(&req),
        json!({"type": "tool", "name": "time", "disable_parallel_tool_use": true})
    );
    req.tool_choice = None;
    assert_eq!(
        choice(&req),
        json!({"type": "auto", "disable_parallel_tool_use": true})
    );
    // A call whose arguments are not an object cannot be sent back: a clear refusal.
    let mut bad = ChatMessage::new(ChatRole::Assistant, "");
    bad.tool_calls = vec![ToolCall {
        id: "toolu_9".into(),
        name: "time".into(),
        arguments: "[1".into(),
    }];
    req.messages = Some(vec![bad]);
    let e = p.body(&req, true).unwrap_err();
    assert_eq!(e.kind, FailureKind::BadRequest);
    assert!(e.message.contains("toolu_9"), "{}", e.message);
}

/// A stream with text, then two tool-use blocks whose events interleave, one of them a
/// tool without input: each block one call, numbered as they began, the empty first
/// fragment skipped, `{}` for the call without input.
#[test]
fn streamed_tool_use_blocks_decode_into_numbered_pieces() {
    let mut d = Decoder::default();
    let mut pieces = Vec::new();
    let mut event = |d: &mut Decoder, name: &str, data: Value| match d
        .event(name, &data.to_string())
        .unwrap()
    {
        Event::Chunk(c) => pieces.extend(c.tool_calls),
        Event::Ignore | Event::Stop => {}
    };
    event(
        &mut d,
        "content_block_start",
        json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
    );
    event(
        &mut d,
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    );
    event(
        &mut d,
        "content_block_start",
        json!({"type": "content_block_start", "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {}}}),
    );
    event(
        &mut d,
        "content_block_delta",
        json!({"type": "content_block_delta", "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": ""}}),
    );
    event(
        &mut d,
        "content_block_start",
        json!({"type": "content_block_start", "index": 2,
            "content_block": {"type": "tool_use", "id": "toolu_b", "name": "time", "input": {}}}),
    );
    event(
        &mut d,
        "content_block_delta",
        json!({"type": "content_block_delta", "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": "{\"city\": "}}),
    );
    event(
        &mut d,
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 2}),
    );
    event(
        &mut d,
        "content_block_delta",
        json!({"type": "content_block_delta", "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": "\"Paris\"}"}}),
    );
    event(
        &mut d,
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 1}),
    );
    let calls = sluice_schema::tools::assemble(&pieces);
    assert_eq!(
        calls,
        vec![
            ToolCall {
                id: "toolu_a".into(),
                name: "weather".into(),
                arguments: r#"{"city": "Paris"}"#.into()
            },
            ToolCall {
                id: "toolu_b".into(),
                name: "time".into(),
                arguments: "{}".into()
            },
        ]
    );
    assert_eq!(
        pieces[0].arguments, "",
        "the first piece names the call only"
    );
    let e = Decoder::default()
            .event(
                "content_block_delta",
                r#"{"type":"content_block_delta","index":3,"delta":{"type":"input_json_delta","partial_json":"{"}}"#,
            )
            .err()
            .unwrap();
    assert_eq!(e.kind, FailureKind::Protocol);
}

#[test]
fn a_whole_answer_decodes_its_tool_use_blocks() {
    let done = decode_message(&json!({"type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {"city": "Paris"}},
                        {"type": "tool_use", "id": "toolu_b", "name": "time", "input": {}}],
            "stop_reason": "tool_use", "usage": {"input_tokens": 3, "output_tokens": 4}}))
        .unwrap();
    assert_eq!(done.text, "Checking.");
    assert_eq!(done.finish_reason.as_deref(), Some("tool_use"));
    assert_eq!(
        sluice_schema::tools::assemble(&done.tool_calls),
        vec![
            ToolCall {
                id: "toolu_a".into(),
                name: "weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            },
            ToolCall {
                id: "toolu_b".into(),
                name: "time".into(),
                arguments: "{}".into()
            },
        ]
    );
}
