//! The chat and generate bodies' translation: what lands on the record, what is ignored as
//! Ollama ignores it, and what is refused.

use axum::http::StatusCode;
use serde_json::{Value, json};
use sluice_schema::ChatRole;

use super::*;

fn chat(v: Value) -> Result<OllamaCall, OllamaError> {
    parse_chat(v.to_string().as_bytes())
}

fn generate(v: Value) -> Result<OllamaCall, OllamaError> {
    parse_generate(v.to_string().as_bytes())
}

fn refused(r: Result<OllamaCall, OllamaError>) -> String {
    let e = r.unwrap_err();
    assert_eq!(e.status, StatusCode::BAD_REQUEST, "{e:?}");
    e.message
}

/// Seed 001's Ollama body, as its client sends it: two messages, `stream`, `options` with
/// `temperature` and `num_ctx` (a number, or the seed's own quoted placeholder).
#[test]
fn seed_001s_body_is_accepted_as_written() {
    for num_ctx in [json!(8192), json!("{config.llm.num_ctx}")] {
        let c = chat(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are an AI assistant that identifies lasting knowledge."},
                {"role": "user", "content": "Analyze these journal blocks:\n\n{formatted_blocks}"}
            ],
            "stream": true,
            "options": {"temperature": 0.3, "num_ctx": num_ctx}
        }))
        .unwrap();
        assert!(c.stream && c.request.streaming && !c.load_only);
        let r = &c.request;
        assert_eq!(
            r.system,
            "You are an AI assistant that identifies lasting knowledge."
        );
        assert_eq!(
            r.prompt,
            "Analyze these journal blocks:\n\n{formatted_blocks}"
        );
        assert_eq!(r.messages, None, "one user turn: TrustGraph's own request");
        assert_eq!(r.temperature, Some(0.3));
        assert_eq!(r.max_tokens, None);
    }
}

#[test]
fn stream_is_the_default_and_false_asks_for_one_object() {
    let c = chat(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})).unwrap();
    assert!(c.stream && c.request.streaming);
    let c = generate(json!({"model": "m", "prompt": "hi", "stream": false})).unwrap();
    assert!(!c.stream && !c.request.streaming);
    let c = generate(json!({"model": "m", "prompt": "hi", "stream": null})).unwrap();
    assert!(c.stream);
}

#[test]
fn options_map_onto_the_request_and_resource_options_are_ignored() {
    let c = generate(json!({"model": "m", "prompt": "p", "keep_alive": "5m", "unknown": 1,
        "options": {"num_predict": 64, "stop": ["END", ""], "num_gpu": 1, "num_thread": 4,
                    "top_p": 1.0, "repeat_penalty": 1, "penalize_newline": null, "some_new_option": 3}}))
    .unwrap();
    assert_eq!(c.request.max_tokens, Some(64));
    assert_eq!(c.request.stop, Some(vec!["END".to_owned()]));
    for unlimited in [-1, -2, 0] {
        let c =
            generate(json!({"model": "m", "prompt": "p", "options": {"num_predict": unlimited}}))
                .unwrap();
        assert_eq!(c.request.max_tokens, None, "{unlimited}");
    }
    for (option, value) in [
        ("top_p", json!(0.9)),
        ("top_k", json!(40)),
        ("seed", json!(1)),
        ("mirostat", json!(2)),
        ("penalize_newline", json!(true)),
    ] {
        let m = refused(generate(
            json!({"model": "m", "prompt": "p", "options": {option: value}}),
        ));
        assert!(m.contains(&format!("option \"{option}\"")), "{m}");
    }
}

#[test]
fn format_json_or_a_schema_asks_for_structured_output() {
    let c = chat(
        json!({"model": "m", "format": "json", "messages": [{"role": "user", "content": "x"}]}),
    )
    .unwrap();
    assert_eq!(
        (c.request.response_format.as_deref(), c.request.schema),
        (Some("json"), None)
    );
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let c = generate(json!({"model": "m", "prompt": "x", "format": schema})).unwrap();
    assert_eq!(c.request.response_format.as_deref(), Some("json"));
    assert_eq!(c.request.schema, Some(schema));
    for none in [json!(""), Value::Null] {
        let c = generate(json!({"model": "m", "prompt": "x", "format": none})).unwrap();
        assert_eq!(c.request.response_format, None);
    }
    assert!(
        refused(generate(
            json!({"model": "m", "prompt": "x", "format": "yaml"})
        ))
        .contains("invalid format")
    );
}

/// A conversation with calls and results: each call gets an id where the client sent none, and
/// each result answers a call, by `tool_call_id`, else by `tool_name`, else in order.
#[test]
fn tool_calls_and_results_become_the_records_turns() {
    let c = chat(json!({"model": "m",
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "w",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
              {"type": "function", "function": {"name": "get_time"}}],
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_name": "get_time", "content": "noon"},
        {"role": "tool", "content": "sunny"}
    ]}))
    .unwrap();
    let tools = c.request.tools.clone().unwrap();
    assert_eq!(tools[0].name, "get_weather");
    assert_eq!(tools[0].description.as_deref(), Some("w"));
    assert_eq!(tools[1].parameters, sluice_schema::tools::no_parameters());
    let turns = c.request.messages.clone().unwrap();
    assert_eq!(turns.len(), 4);
    assert_eq!(turns[1].role, ChatRole::Assistant);
    let calls = &turns[1].tool_calls;
    assert_eq!(
        (calls[0].id.as_str(), calls[0].name.as_str()),
        ("call_2_0", "get_weather")
    );
    assert_eq!(
        serde_json::from_str::<Value>(&calls[0].arguments).unwrap(),
        json!({"city": "Paris"})
    );
    assert_eq!(calls[1].arguments, "{}");
    assert_eq!(
        turns[2].tool_call_id.as_deref(),
        Some("call_2_1"),
        "by name"
    );
    assert_eq!(
        turns[3].tool_call_id.as_deref(),
        Some("call_2_0"),
        "the one left"
    );
    assert_eq!(c.request.system, "s");

    let by_id = chat(json!({"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}},
                                             {"id": "b", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "2"}]}))
    .unwrap();
    assert_eq!(
        by_id.request.messages.unwrap()[2].tool_call_id.as_deref(),
        Some("b")
    );
    let m = refused(chat(json!({"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"role": "tool", "tool_name": "f", "content": "nobody asked"}]})));
    assert!(m.contains("must answer a tool call"), "{m}");
}

#[test]
fn what_sluice_cannot_honour_is_refused_by_name() {
    let user = json!([{"role": "user", "content": "x"}]);
    for (body, says) in [
        (
            json!({"model": "m", "messages": user, "think": true}),
            "does not support thinking",
        ),
        (
            json!({"model": "m", "messages": user, "think": "high"}),
            "does not support thinking",
        ),
        (
            json!({"model": "m", "messages": user, "logprobs": true}),
            "logprobs",
        ),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
            "images",
        ),
        (
            json!({"model": "m", "messages": user, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "only function tools",
        ),
        (
            json!({"model": "m", "messages": user, "tools": [{"function": {"name": "f"}}, {"function": {"name": "f"}}]}),
            "given twice",
        ),
        (
            json!({"model": "m", "messages": [{"role": "system", "content": "only a system message"}]}),
            "at least one",
        ),
    ] {
        let m = refused(chat(body.clone()));
        assert!(m.contains(says), "{body}: {m}");
    }
    for (body, says) in [
        (
            json!({"model": "m", "prompt": "x", "suffix": "y"}),
            "does not support insert",
        ),
        (json!({"model": "m", "prompt": "x", "raw": true}), "raw"),
        (
            json!({"model": "m", "prompt": "x", "template": "t"}),
            "template",
        ),
        (
            json!({"model": "m", "prompt": "x", "context": [1]}),
            "context",
        ),
        (
            json!({"model": "m", "prompt": "x", "images": ["aGk="]}),
            "images",
        ),
    ] {
        let m = refused(generate(body.clone()));
        assert!(m.contains(says), "{body}: {m}");
    }
    // Their empty or default forms change nothing and pass.
    generate(
        json!({"model": "m", "prompt": "x", "suffix": "", "raw": false, "context": [],
                    "images": [], "think": false, "logprobs": false, "top_logprobs": 0}),
    )
    .unwrap();
}

#[test]
fn a_body_that_is_not_a_request_names_the_field_and_never_the_value() {
    assert_eq!(refused(chat(json!({"messages": []}))), "model is required");
    assert_eq!(
        refused(generate(json!({"model": " "}))),
        "model is required"
    );
    assert_eq!(refused(parse_chat(b"")), "missing request body");
    let m = refused(chat(json!({"model": "m", "stream": "sk-secret"})));
    assert_eq!(m, "invalid request: field `stream`: expected a boolean");
    let m = refused(chat(
        json!({"model": "m", "messages": [{"role": "user", "content": ["sk-secret"]}]}),
    ));
    assert_eq!(
        m,
        "invalid request: field `messages[0].content`: expected a string"
    );
    let m = refused(generate(
        json!({"model": "m", "options": {"temperature": "sk-secret"}}),
    ));
    assert_eq!(
        m,
        "invalid request: field `options.temperature`: expected a number"
    );
    let m = refused(parse_generate(b"{\"model\": \"sk-secret"));
    assert!(m.starts_with("invalid request: the JSON ends early"), "{m}");
}

#[test]
fn nothing_to_answer_only_loads_the_model() {
    assert!(chat(json!({"model": "m"})).unwrap().load_only);
    assert!(
        chat(json!({"model": "m", "messages": []}))
            .unwrap()
            .load_only
    );
    assert!(
        generate(json!({"model": "m", "prompt": ""}))
            .unwrap()
            .load_only
    );
    assert!(
        !generate(json!({"model": "m", "prompt": "x"}))
            .unwrap()
            .load_only
    );
}
