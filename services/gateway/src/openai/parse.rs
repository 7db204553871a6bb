//! The body of `POST /v1/chat/completions`, checked as OpenAI checks it and translated into
//! text-completion's request (see the route's module documentation): what sluice cannot
//! honour is refused by name, with OpenAI's error, its `param` and `code`.

use serde_json::{Map, Value};
use sluice_schema::{
    ChatMessage, ChatRole, TextCompletionRequest, Tool, ToolCall, ToolChoice, ToolMode,
};

use super::ApiError;

/// OpenAI allows at most 4 stop sequences.
const MAX_STOP: usize = 4;

/// Parameters OpenAI defines that sluice accepts and ignores because they do not change the
/// answer: caller ids, storage and routing hints.
const IGNORED: &[&str] = &[
    "user",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
];

/// A chat request, checked and translated.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChatCall {
    /// The record for the text-completion processor.
    pub request: TextCompletionRequest,
    /// The model asked for.
    pub model: String,
    /// `stream: true`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

/// The text of a message's `content`: a string, or an array of `text` parts (joined). Any
/// other part (an image, audio, a file) is refused: the processors take text only.
fn content_text(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => parts_text(parts, at, &["text"]),
        _ => Err(ApiError::invalid(
            format!("Invalid type for '{at}': expected a string or an array of text parts."),
            Some(at),
            Some("invalid_type"),
        )),
    }
}

/// The text of content `parts` at `at`, joined: each part's type one of `kinds` (the dialect's
/// text parts: Chat Completions' `text`, the Responses API's `input_text` and `output_text`),
/// any other refused (an image, a file, audio: the processors take text only), in OpenAI's
/// words and with the part's path as `param`.
pub(crate) fn parts_text(parts: &[Value], at: &str, kinds: &[&str]) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        match part["type"].as_str() {
            Some(kind) if kinds.contains(&kind) => match part["text"].as_str() {
                Some(t) => text.push_str(t),
                None => {
                    return Err(ApiError::invalid(
                        format!("Invalid '{at}[{j}].text': expected a string."),
                        Some(&format!("{at}[{j}].text")),
                        Some("invalid_type"),
                    ));
                }
            },
            Some(other) => {
                let shown: String = other.chars().take(40).collect();
                let send = kinds.first().copied().unwrap_or("text");
                return Err(ApiError::invalid(
                    format!(
                        "content parts of type '{shown}' are not supported by this server; send {send}"
                    ),
                    Some(&format!("{at}[{j}].type")),
                    Some("unsupported_value"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    format!("Missing required parameter: '{at}[{j}].type'."),
                    Some(&format!("{at}[{j}].type")),
                    Some("missing_required_parameter"),
                ));
            }
        }
    }
    Ok(text)
}

pub(crate) fn number(body: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            ApiError::invalid(
                format!("Invalid type for '{name}': expected a number."),
                Some(name),
                Some("invalid_type"),
            )
        }),
    }
}

pub(crate) fn positive_integer(
    body: &Map<String, Value>,
    name: &str,
) -> Result<Option<u32>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(Some(u32::try_from(n).unwrap_or(u32::MAX))),
            _ => Err(ApiError::invalid(
                format!("Invalid '{name}': expected an integer of at least 1."),
                Some(name),
                Some("invalid_value"),
            )),
        },
    }
}

/// Checks a `POST /v1/chat/completions` body and translates it.
///
/// The checks run in a fixed order, one step per function below, because the first that
/// fails is the error the caller gets, as OpenAI reports one problem at a time: the body's
/// shape and names, the model, what sluice refuses by name, the tools, the stream's options,
/// the sampling parameters, the response format, and last the messages.
pub(crate) fn parse_chat(body: &[u8]) -> Result<ChatCall, ApiError> {
    let body = json_object(body)?;
    refuse_unknown(&body)?;
    let model = model(&body)?;
    refuse_deprecated(&body)?;
    let (tools, tool_choice, parallel_tool_calls) = parse_tools(&body)?;
    refuse_unpassed(&body)?;
    let (stream, include_usage) = stream_options(&body)?;
    let temperature = temperature(&body)?;
    let max_tokens = match positive_integer(&body, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => positive_integer(&body, "max_tokens")?,
    };
    let stop = stop(&body)?;
    let (response_format, schema) = response_format(&body)?;
    let (system, turns) = conversation(&body)?;
    // One user turn is exactly TrustGraph's request; a longer conversation also rides in
    // `messages`, and flattened in `prompt` for processors that do not read `messages`.
    let (prompt, messages) = match turns.as_slice() {
        [only] if only.role == ChatRole::User && only.tool_calls.is_empty() => {
            (only.content.clone(), None)
        }
        _ => (TextCompletionRequest::flatten(&turns), Some(turns)),
    };
    Ok(ChatCall {
        request: TextCompletionRequest {
            operation: None,
            system: system.join("\n\n"),
            prompt,
            streaming: stream,
            response_format,
            schema,
            messages,
            temperature,
            max_tokens,
            stop,
            model: Some(model.clone()),
            retry: None,
            tools,
            tool_choice,
            parallel_tool_calls,
            schema_strict: body
                .get("response_format")
                .filter(|f| f["type"] == "json_schema")
                .and_then(|f| f["json_schema"]["strict"].as_bool()),
            caller_checks: false,
        },
        model,
        stream,
        include_usage,
    })
}

/// The body as a JSON object.
pub(crate) fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|_| {
        ApiError::invalid(
            "We could not parse the JSON body of your request. The body must be a JSON object \
             (see https://platform.openai.com/docs/api-reference/chat/create).",
            None,
            None,
        )
    })?;
    let Value::Object(body) = value else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
            None,
        ));
    };
    Ok(body)
}

/// Every parameter OpenAI's chat route defines (those in [`IGNORED`] aside): a name outside
/// both lists is refused, as OpenAI refuses it.
const KNOWN: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "temperature",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "verbosity",
];

/// Refuses the first parameter that is neither [`KNOWN`] nor [`IGNORED`].
fn refuse_unknown(body: &Map<String, Value>) -> Result<(), ApiError> {
    refuse_unlisted(body, KNOWN, IGNORED)
}

/// Refuses the first parameter of `body` in neither list, as OpenAI refuses a parameter it
/// does not define (one route's parameters are `known` and `ignored`).
pub(crate) fn refuse_unlisted(
    body: &Map<String, Value>,
    known: &[&str],
    ignored: &[&str],
) -> Result<(), ApiError> {
    if let Some(unknown) = body
        .keys()
        .find(|k| !known.contains(&k.as_str()) && !ignored.contains(&k.as_str()))
    {
        let shown: String = unknown.chars().take(60).collect();
        return Err(ApiError::invalid(
            format!("Unrecognized request argument supplied: {shown}"),
            None,
            None,
        ));
    }
    Ok(())
}

/// `model`: required, a non-empty string.
pub(crate) fn model(body: &Map<String, Value>) -> Result<String, ApiError> {
    match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => Ok(m.clone()),
        None | Some(Value::Null) => Err(ApiError::invalid(
            "you must provide a model parameter",
            None,
            None,
        )),
        Some(_) => Err(ApiError::invalid(
            "Invalid 'model': expected a non-empty string.",
            Some("model"),
            Some("invalid_type"),
        )),
    }
}

/// More than one choice, and the deprecated `functions` API, refused by name (`tools` says
/// the same). Defaults that change nothing (`n: 1`, `function_call: "auto"`) pass.
fn refuse_deprecated(body: &Map<String, Value>) -> Result<(), ApiError> {
    if let Some(n) = body.get("n").filter(|v| !v.is_null())
        && n.as_u64() != Some(1)
    {
        return Err(ApiError::invalid(
            "'n' must be 1: this server returns one choice per request.",
            Some("n"),
            Some("unsupported_value"),
        ));
    }
    if body
        .get("functions")
        .is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()) && !v.is_null())
    {
        return Err(ApiError::unsupported(
            "functions",
            "'functions' is deprecated; send 'tools'",
        ));
    }
    if let Some(v) = body.get("function_call").filter(|v| !v.is_null())
        && v.as_str() != Some("none")
        && v.as_str() != Some("auto")
    {
        return Err(ApiError::unsupported(
            "function_call",
            "'function_call' is deprecated; send 'tool_choice'",
        ));
    }
    Ok(())
}

/// What the processors do not pass to providers, refused by name. Defaults that change
/// nothing (`top_p: 1`, penalties of 0, an empty `logit_bias`) pass.
fn refuse_unpassed(body: &Map<String, Value>) -> Result<(), ApiError> {
    let present = |name: &str| body.get(name).is_some_and(|v| !v.is_null());
    for (name, neutral) in [
        ("top_p", 1.0),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
    ] {
        if let Some(v) = number(body, name)?
            && v != neutral
        {
            return Err(ApiError::unsupported(
                name,
                "the processors do not pass it to every provider; use temperature",
            ));
        }
    }
    if body
        .get("logit_bias")
        .is_some_and(|v| v.as_object().is_none_or(|m| !m.is_empty()) && !v.is_null())
    {
        return Err(ApiError::unsupported(
            "logit_bias",
            "token biases are not passed to providers",
        ));
    }
    if body
        .get("logprobs")
        .is_some_and(|v| v.as_bool() == Some(true))
        || present("top_logprobs")
    {
        return Err(ApiError::unsupported(
            "logprobs",
            "log probabilities are not returned",
        ));
    }
    for name in [
        "seed",
        "modalities",
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "verbosity",
    ] {
        if present(name) {
            return Err(ApiError::unsupported(
                name,
                "the processors do not pass it to providers",
            ));
        }
    }
    Ok(())
}

/// `stream` and `stream_options.include_usage` (allowed only with `stream`).
fn stream_options(body: &Map<String, Value>) -> Result<(bool, bool), ApiError> {
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'stream': expected a boolean.",
                Some("stream"),
                Some("invalid_type"),
            ));
        }
    };
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                Some("stream_options"),
                Some("invalid_value"),
            ));
        }
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::invalid(
                    "Invalid type for 'stream_options.include_usage': expected a boolean.",
                    Some("stream_options.include_usage"),
                    Some("invalid_type"),
                ));
            }
        },
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'stream_options': expected an object.",
                Some("stream_options"),
                Some("invalid_type"),
            ));
        }
    };
    Ok((stream, include_usage))
}

/// `temperature`: a number from 0 to 2.
pub(crate) fn temperature(body: &Map<String, Value>) -> Result<Option<f64>, ApiError> {
    let temperature = number(body, "temperature")?;
    if let Some(t) = temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(ApiError::invalid(
            format!("Invalid 'temperature': expected a value from 0 to 2, but got {t} instead."),
            Some("temperature"),
            Some("invalid_value"),
        ));
    }
    Ok(temperature)
}

/// `stop`: a non-empty string or up to [`MAX_STOP`] of them.
fn stop(body: &Map<String, Value>) -> Result<Option<Vec<String>>, ApiError> {
    match body.get("stop") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(vec![s.clone()])),
        Some(Value::Array(a))
            if a.len() <= MAX_STOP
                && a.iter().all(|s| s.as_str().is_some_and(|s| !s.is_empty())) =>
        {
            let stops: Vec<String> = a
                .iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect();
            Ok((!stops.is_empty()).then_some(stops))
        }
        Some(_) => Err(ApiError::invalid(
            format!("Invalid 'stop': expected a non-empty string or up to {MAX_STOP} of them."),
            Some("stop"),
            Some("invalid_value"),
        )),
    }
}

/// `response_format`: text (nothing asked), a JSON object, or JSON of a schema; as the
/// request's `response_format` and `schema`.
fn response_format(body: &Map<String, Value>) -> Result<(Option<String>, Option<Value>), ApiError> {
    let Some(f) = body.get("response_format").filter(|f| !f.is_null()) else {
        return Ok((None, None));
    };
    match f["type"].as_str() {
        Some("text") => Ok((None, None)),
        Some("json_object") => Ok((Some("json".to_owned()), None)),
        Some("json_schema") => match f["json_schema"]["schema"].clone() {
            Value::Object(s) => Ok((Some("json".to_owned()), Some(Value::Object(s)))),
            _ => Err(ApiError::invalid(
                "Missing required parameter: 'response_format.json_schema.schema'.",
                Some("response_format.json_schema.schema"),
                Some("missing_required_parameter"),
            )),
        },
        _ => Err(ApiError::invalid(
            "Invalid 'response_format.type': expected 'text', 'json_object' or 'json_schema'.",
            Some("response_format.type"),
            Some("invalid_value"),
        )),
    }
}

/// `messages`: the system texts (`system` and `developer` turns, in order) and the
/// conversation's turns, at least one. A tool result must answer a tool call made before it.
fn conversation(body: &Map<String, Value>) -> Result<(Vec<String>, Vec<ChatMessage>), ApiError> {
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Err(ApiError::invalid(
            "Missing required parameter: 'messages'.",
            Some("messages"),
            Some("missing_required_parameter"),
        ));
    };
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            Some("messages"),
            Some("empty_array"),
        ));
    }
    let mut system = Vec::new();
    let mut turns = Vec::new();
    // Ids of the tool calls made so far: a tool result must answer one of them.
    let mut calls_made = std::collections::HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m["role"].as_str().ok_or_else(|| {
            ApiError::invalid(
                format!("Missing required parameter: '{at}.role'."),
                Some(&format!("{at}.role")),
                Some("missing_required_parameter"),
            )
        })?;
        let content = content_text(&m["content"], &format!("{at}.content"))?;
        match role {
            "system" | "developer" => system.push(content),
            "user" => turns.push(ChatMessage::new(ChatRole::User, content)),
            "assistant" => {
                if m.get("function_call").is_some_and(|t| !t.is_null()) {
                    return Err(ApiError::unsupported(
                        &format!("{at}.function_call"),
                        "'function_call' is deprecated; send 'tool_calls'",
                    ));
                }
                let mut turn = ChatMessage::new(ChatRole::Assistant, content);
                turn.tool_calls = assistant_tool_calls(m, &at)?;
                calls_made.extend(turn.tool_calls.iter().map(|c| c.id.clone()));
                turns.push(turn);
            }
            "tool" => turns.push(tool_result(m, &at, content, &calls_made)?),
            "function" => {
                return Err(ApiError::unsupported(
                    &format!("{at}.role"),
                    "the 'function' role is deprecated; send 'tool' messages",
                ));
            }
            other => {
                let shown: String = other.chars().take(40).collect();
                return Err(ApiError::invalid(
                    format!(
                        "Invalid value: '{shown}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'."
                    ),
                    Some(&format!("{at}.role")),
                    Some("invalid_value"),
                ));
            }
        }
    }
    if turns.is_empty() {
        return Err(ApiError::invalid(
            "Invalid 'messages': expected at least one user, assistant or tool message.",
            Some("messages"),
            Some("invalid_value"),
        ));
    }
    Ok((system, turns))
}

/// A `tool` message at `at`: the result of one of `calls_made`.
fn tool_result(
    m: &Value,
    at: &str,
    content: String,
    calls_made: &std::collections::HashSet<String>,
) -> Result<ChatMessage, ApiError> {
    let Some(call) = m["tool_call_id"].as_str().filter(|c| !c.is_empty()) else {
        return Err(ApiError::invalid(
            format!("Missing required parameter: '{at}.tool_call_id'."),
            Some(&format!("{at}.tool_call_id")),
            Some("missing_required_parameter"),
        ));
    };
    if !calls_made.contains(call) {
        return Err(ApiError::invalid(
            format!(
                "Invalid parameter: messages with role 'tool' must be a response to a preceding message with 'tool_calls'. No tool call has the id in '{at}.tool_call_id'."
            ),
            Some(&format!("{at}.tool_call_id")),
            Some("invalid_value"),
        ));
    }
    let mut turn = ChatMessage::new(ChatRole::Tool, content);
    turn.tool_call_id = Some(call.to_owned());
    Ok(turn)
}

/// The most tools one request may offer (OpenAI's limit).
pub(crate) const MAX_TOOLS: usize = 128;

/// `tools`, `tool_choice` and `parallel_tool_calls`, checked as OpenAI checks them: function
/// tools only, names of its pattern and unique, a choice naming one of them, and no
/// `required` or named choice without tools (`auto`, `none` and `parallel_tool_calls` with
/// no tools change nothing and pass, as clients send them by default).
#[allow(clippy::type_complexity)]
fn parse_tools(
    body: &Map<String, Value>,
) -> Result<(Option<Vec<Tool>>, Option<ToolChoice>, Option<bool>), ApiError> {
    let tools = tool_list(body)?;
    let choice = tool_choice(body, &tools)?;
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => None,
        // Without tools it changes nothing: passed, as before tools were supported.
        Some(Value::Bool(_)) if tools.is_empty() => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'parallel_tool_calls': expected a boolean.",
                Some("parallel_tool_calls"),
                Some("invalid_type"),
            ));
        }
    };
    Ok(((!tools.is_empty()).then_some(tools), choice, parallel))
}

/// `tools`: at most [`MAX_TOOLS`] function tools, each named by OpenAI's pattern, no name
/// twice.
fn tool_list(body: &Map<String, Value>) -> Result<Vec<Tool>, ApiError> {
    match body.get("tools") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => {
            function_tools(list, Some("function"), "only function tools are supported")
        }
        Some(_) => Err(ApiError::invalid(
            "Invalid type for 'tools': expected an array of tools.",
            Some("tools"),
            Some("invalid_type"),
        )),
    }
}

/// The tools of a `tools` array: at most [`MAX_TOOLS`], each `type: "function"` (any other
/// refused, `refused` saying why) and read by [`function_tool`] from the tool itself (the
/// Responses API) or from its `nested` member (Chat Completions' `function`).
pub(crate) fn function_tools(
    list: &[Value],
    nested: Option<&str>,
    refused: &str,
) -> Result<Vec<Tool>, ApiError> {
    if list.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            format!(
                "Invalid 'tools': array too long. Expected an array with maximum length {MAX_TOOLS}, but got an array with length {} instead.",
                list.len()
            ),
            Some("tools"),
            Some("array_above_max_length"),
        ));
    }
    let mut tools = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        match t["type"].as_str() {
            Some("function") => {}
            Some(_) => return Err(ApiError::unsupported(&format!("{at}.type"), refused)),
            None => {
                return Err(ApiError::invalid(
                    format!("Missing required parameter: '{at}.type'."),
                    Some(&format!("{at}.type")),
                    Some("missing_required_parameter"),
                ));
            }
        }
        let tool = match nested {
            Some(member) => function_tool(&t[member], &format!("{at}.{member}"), &tools)?,
            None => function_tool(t, &at, &tools)?,
        };
        tools.push(tool);
    }
    Ok(tools)
}

/// One function tool's `name`, `description`, `parameters` and `strict`, read from `f` (Chat's
/// `tools[i].function`, the Responses API's `tools[i]` itself; `at` names it in errors): a
/// name of OpenAI's pattern that `tools` does not have yet, parameters an object.
pub(crate) fn function_tool(f: &Value, at: &str, tools: &[Tool]) -> Result<Tool, ApiError> {
    let Some(name) = f["name"].as_str() else {
        return Err(ApiError::invalid(
            format!("Missing required parameter: '{at}.name'."),
            Some(&format!("{at}.name")),
            Some("missing_required_parameter"),
        ));
    };
    if !sluice_schema::tools::valid_name(name) {
        return Err(ApiError::invalid(
            format!(
                "Invalid '{at}.name': string does not match pattern. Expected a string that matches the pattern '^[a-zA-Z0-9_-]{{1,64}}$'."
            ),
            Some(&format!("{at}.name")),
            Some("invalid_value"),
        ));
    }
    if tools.iter().any(|t| t.name == name) {
        return Err(ApiError::invalid(
            format!("Invalid 'tools': the name '{name}' is given twice."),
            Some(&format!("{at}.name")),
            Some("invalid_value"),
        ));
    }
    let parameters = match &f["parameters"] {
        Value::Null => sluice_schema::tools::no_parameters(),
        Value::Object(p) => Value::Object(p.clone()),
        _ => {
            return Err(ApiError::invalid(
                format!("Invalid type for '{at}.parameters': expected an object."),
                Some(&format!("{at}.parameters")),
                Some("invalid_type"),
            ));
        }
    };
    Ok(Tool {
        name: name.to_owned(),
        description: f["description"].as_str().map(str::to_owned),
        parameters,
        strict: f["strict"].as_bool(),
    })
}

/// `tool_choice`: `none`, `auto`, `required` or one of `tools` by name; `required` or a name
/// only with tools.
fn tool_choice(body: &Map<String, Value>, tools: &[Tool]) -> Result<Option<ToolChoice>, ApiError> {
    let no_tools = |name: &str| {
        ApiError::invalid(
            format!(
                "Invalid value for '{name}': '{name}' is only allowed when 'tools' are specified."
            ),
            Some(name),
            Some("invalid_value"),
        )
    };
    let choice = match body.get("tool_choice") {
        None | Some(Value::Null) => None,
        Some(Value::String(mode)) => {
            let mode = match mode.as_str() {
                "auto" => ToolMode::Auto,
                "none" => ToolMode::None,
                "required" => ToolMode::Required,
                _ => {
                    return Err(ApiError::invalid(
                        "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or a named function.",
                        Some("tool_choice"),
                        Some("invalid_value"),
                    ));
                }
            };
            match mode {
                ToolMode::Auto | ToolMode::None if tools.is_empty() => None,
                ToolMode::Required if tools.is_empty() => return Err(no_tools("tool_choice")),
                _ => Some(ToolChoice::Mode(mode)),
            }
        }
        Some(v @ Value::Object(_)) => {
            if tools.is_empty() {
                return Err(no_tools("tool_choice"));
            }
            let Some(name) = v["function"]["name"]
                .as_str()
                .filter(|_| v["type"] == "function")
            else {
                return Err(ApiError::invalid(
                    "Invalid 'tool_choice': expected {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                    Some("tool_choice"),
                    Some("invalid_value"),
                ));
            };
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    format!(
                        "Invalid 'tool_choice': no tool is named '{}'.",
                        name.chars().take(64).collect::<String>()
                    ),
                    Some("tool_choice.function.name"),
                    Some("invalid_value"),
                ));
            }
            Some(ToolChoice::Named {
                name: name.to_owned(),
            })
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'tool_choice': expected a string or an object.",
                Some("tool_choice"),
                Some("invalid_type"),
            ));
        }
    };
    Ok(choice)
}

/// The `tool_calls` of an assistant message: `[{id, type: "function", function: {name,
/// arguments}}]`.
fn assistant_tool_calls(m: &Value, at: &str) -> Result<Vec<ToolCall>, ApiError> {
    let list = match m.get("tool_calls") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => {
            return Err(ApiError::invalid(
                format!("Invalid type for '{at}.tool_calls': expected an array."),
                Some(&format!("{at}.tool_calls")),
                Some("invalid_type"),
            ));
        }
    };
    list.iter()
        .enumerate()
        .map(|(j, c)| {
            let field = |path: &str| -> Result<String, ApiError> {
                let v = path.split('.').fold(c, |v, k| &v[k]);
                v.as_str().map(str::to_owned).ok_or_else(|| {
                    ApiError::invalid(
                        format!("Missing required parameter: '{at}.tool_calls[{j}].{path}'."),
                        Some(&format!("{at}.tool_calls[{j}].{path}")),
                        Some("missing_required_parameter"),
                    )
                })
            };
            Ok(ToolCall {
                id: field("id")?,
                name: field("function.name")?,
                arguments: field("function.arguments")?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
