//! The body of `POST /v1/responses`, checked as OpenAI checks it and translated into
//! text-completion's request: `input` (a string, or message, `function_call` and
//! `function_call_output` items) into turns, `instructions` and system/developer messages into
//! `system`, `text.format` into structured output, function `tools` and `tool_choice` into the
//! request's tool fields. The Chat Completions decoder's checks (model, temperature, token
//! limit, a function tool's name and parameters) and its error shape are shared
//! (`openai::parse`). What sluice cannot honour is refused by name with OpenAI's error, never
//! silently ignored; unknown parameters are refused as OpenAI refuses them.

use serde_json::{Map, Value, json};
use sluice_schema::{
    ChatMessage, ChatRole, TextCompletionRequest, Tool, ToolCall, ToolChoice, ToolMode,
};

use crate::openai::{
    ApiError,
    parse::{
        function_tools, json_object, model, number, parts_text, positive_integer, refuse_unlisted,
        temperature,
    },
};

/// Parameters OpenAI defines that sluice accepts and ignores because they do not change the
/// answer: caller ids, storage and routing hints. (`store` asks OpenAI to keep the response
/// for `previous_response_id`; sluice keeps nothing, the response says `store: false`, and a
/// `previous_response_id` is refused.)
const IGNORED: &[&str] = &[
    "user",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "stream_options",
];

/// Every other parameter of OpenAI's `POST /v1/responses`: a name outside both lists is
/// refused.
const KNOWN: &[&str] = &[
    "model",
    "input",
    "instructions",
    "stream",
    "temperature",
    "top_p",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "previous_response_id",
    "conversation",
    "background",
    "include",
    "reasoning",
    "prompt",
    "truncation",
    "max_tool_calls",
    "top_logprobs",
];

/// A Responses request, checked and translated.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ResponsesCall {
    /// The record for the text-completion processor.
    pub request: TextCompletionRequest,
    /// The model asked for.
    pub model: String,
    /// `stream: true`.
    pub stream: bool,
    /// What the response object echoes of the request (OpenAI's `Response` carries its
    /// `instructions`, `tools`, `tool_choice`, `text`, `metadata`, ...).
    pub echo: Map<String, Value>,
}

/// Checks a `POST /v1/responses` body and translates it. The checks run in a fixed order,
/// the first that fails being the error the caller gets, as OpenAI reports one problem at a
/// time.
pub(crate) fn parse_responses(body: &[u8]) -> Result<ResponsesCall, ApiError> {
    let body = json_object(body)?;
    refuse_unknown(&body)?;
    let model = model(&body)?;
    refuse_unsupported(&body)?;
    let stream = boolean(&body, "stream")?.unwrap_or(false);
    let temperature = temperature(&body)?;
    let max_tokens = positive_integer(&body, "max_output_tokens")?;
    let tools = tool_list(&body)?;
    let tool_choice = tool_choice(&body, &tools)?;
    let parallel = boolean(&body, "parallel_tool_calls")?;
    let (response_format, schema, schema_strict) = text_format(&body)?;
    let instructions = match body.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'instructions': expected a string.",
                Some("instructions"),
                Some("invalid_type"),
            ));
        }
    };
    let (mut system, turns) = conversation(&body)?;
    if let Some(i) = instructions.as_ref().filter(|i| !i.is_empty()) {
        system.insert(0, i.clone());
    }
    // One user turn is exactly TrustGraph's request; a longer conversation also rides in
    // `messages`, and flattened in `prompt` for processors that do not read `messages`.
    let (prompt, messages) = match turns.as_slice() {
        [only] if only.role == ChatRole::User && only.tool_calls.is_empty() => {
            (only.content.clone(), None)
        }
        _ => (TextCompletionRequest::flatten(&turns), Some(turns)),
    };
    let echo = echo(&body, instructions, temperature, max_tokens, parallel);
    Ok(ResponsesCall {
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
            stop: None,
            model: Some(model.clone()),
            retry: None,
            tool_choice: if tools.is_empty() { None } else { tool_choice },
            parallel_tool_calls: if tools.is_empty() { None } else { parallel },
            tools: (!tools.is_empty()).then_some(tools),
            schema_strict,
            caller_checks: false,
        },
        model,
        stream,
        echo,
    })
}

/// What the response object repeats of the request, as OpenAI's does (the defaults it
/// answers with when the request left them out).
fn echo(
    body: &Map<String, Value>,
    instructions: Option<String>,
    temperature: Option<f64>,
    max_tokens: Option<u32>,
    parallel: Option<bool>,
) -> Map<String, Value> {
    let or = |name: &str, default: Value| {
        body.get(name)
            .filter(|v| !v.is_null())
            .cloned()
            .unwrap_or(default)
    };
    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(instructions));
    echo.insert("max_output_tokens".into(), json!(max_tokens));
    echo.insert("metadata".into(), or("metadata", json!({})));
    echo.insert(
        "parallel_tool_calls".into(),
        json!(parallel.unwrap_or(true)),
    );
    echo.insert("previous_response_id".into(), Value::Null);
    echo.insert("store".into(), json!(false));
    echo.insert("temperature".into(), json!(temperature.unwrap_or(1.0)));
    echo.insert(
        "text".into(),
        or("text", json!({"format": {"type": "text"}})),
    );
    echo.insert("tool_choice".into(), or("tool_choice", json!("auto")));
    echo.insert("tools".into(), or("tools", json!([])));
    echo.insert("top_p".into(), or("top_p", json!(1.0)));
    echo.insert("truncation".into(), json!("disabled"));
    echo.insert("user".into(), or("user", Value::Null));
    echo
}

/// Refuses the first parameter that is neither [`KNOWN`] nor [`IGNORED`].
fn refuse_unknown(body: &Map<String, Value>) -> Result<(), ApiError> {
    refuse_unlisted(body, KNOWN, IGNORED)
}

/// What sluice cannot honour, refused by name; defaults that change nothing pass.
fn refuse_unsupported(body: &Map<String, Value>) -> Result<(), ApiError> {
    let present = |name: &str| body.get(name).is_some_and(|v| !v.is_null());
    if let Some(Value::String(id)) = body.get("previous_response_id") {
        let shown: String = id.chars().take(100).collect();
        return Err(ApiError::invalid(
            format!(
                "Previous response with id '{shown}' not found: this server stores no responses; \
                 send the whole conversation in 'input'."
            ),
            Some("previous_response_id"),
            Some("previous_response_not_found"),
        ));
    }
    if present("previous_response_id") || present("conversation") {
        let name = if present("conversation") {
            "conversation"
        } else {
            "previous_response_id"
        };
        return Err(ApiError::unsupported(
            name,
            "this server stores no responses or conversations; send the whole conversation in 'input'",
        ));
    }
    if body.get("background").is_some_and(|v| v == &json!(true)) {
        return Err(ApiError::unsupported(
            "background",
            "responses are answered while the request is open",
        ));
    }
    if body
        .get("include")
        .is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()) && !v.is_null())
    {
        return Err(ApiError::unsupported(
            "include",
            "no extra output (logprobs, reasoning, sources) is returned",
        ));
    }
    if let Some(v) = number(body, "top_p")?
        && v != 1.0
    {
        return Err(ApiError::unsupported(
            "top_p",
            "the processors do not pass it to every provider; use temperature",
        ));
    }
    if body
        .get("truncation")
        .is_some_and(|v| !v.is_null() && v != "disabled")
    {
        return Err(ApiError::unsupported(
            "truncation",
            "the input is never truncated here ('disabled' only)",
        ));
    }
    if body
        .get("top_logprobs")
        .is_some_and(|v| !v.is_null() && v != &json!(0))
    {
        return Err(ApiError::unsupported(
            "top_logprobs",
            "log probabilities are not returned",
        ));
    }
    for name in ["reasoning", "prompt", "max_tool_calls"] {
        if present(name) {
            return Err(ApiError::unsupported(
                name,
                "the processors do not pass it to providers",
            ));
        }
    }
    Ok(())
}

fn boolean(body: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(
            format!("Invalid type for '{name}': expected a boolean."),
            Some(name),
            Some("invalid_type"),
        )),
    }
}

/// `text.format`: `text` (nothing asked), `json_object`, or `json_schema` with its `schema`
/// (and `strict`), as the request's `response_format`, `schema` and `schema_strict`.
#[allow(clippy::type_complexity)]
fn text_format(
    body: &Map<String, Value>,
) -> Result<(Option<String>, Option<Value>, Option<bool>), ApiError> {
    let Some(text) = body.get("text").filter(|t| !t.is_null()) else {
        return Ok((None, None, None));
    };
    let Value::Object(text) = text else {
        return Err(ApiError::invalid(
            "Invalid type for 'text': expected an object.",
            Some("text"),
            Some("invalid_type"),
        ));
    };
    if text
        .get("verbosity")
        .is_some_and(|v| !v.is_null() && v != "medium")
    {
        return Err(ApiError::unsupported(
            "text.verbosity",
            "the processors do not pass it to providers",
        ));
    }
    let Some(f) = text.get("format").filter(|f| !f.is_null()) else {
        return Ok((None, None, None));
    };
    match f["type"].as_str() {
        Some("text") => Ok((None, None, None)),
        Some("json_object") => Ok((Some("json".to_owned()), None, None)),
        Some("json_schema") => match &f["schema"] {
            Value::Object(s) => Ok((
                Some("json".to_owned()),
                Some(Value::Object(s.clone())),
                f["strict"].as_bool(),
            )),
            _ => Err(ApiError::invalid(
                "Missing required parameter: 'text.format.schema'.",
                Some("text.format.schema"),
                Some("missing_required_parameter"),
            )),
        },
        _ => Err(ApiError::invalid(
            "Invalid 'text.format.type': expected 'text', 'json_object' or 'json_schema'.",
            Some("text.format.type"),
            Some("invalid_value"),
        )),
    }
}

/// `tools`: function tools only (`{type: "function", name, description, parameters,
/// strict}`), at most [`MAX_TOOLS`], checked as the Chat route checks its own.
fn tool_list(body: &Map<String, Value>) -> Result<Vec<Tool>, ApiError> {
    let list = match body.get("tools") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'tools': expected an array of tools.",
                Some("tools"),
                Some("invalid_type"),
            ));
        }
    };
    function_tools(
        list,
        None,
        "only function tools are supported (no hosted tools)",
    )
}

/// `tool_choice`: `none`, `auto`, `required` or `{type: "function", name}` naming one of
/// `tools`; `required` or a name only with tools.
fn tool_choice(body: &Map<String, Value>, tools: &[Tool]) -> Result<Option<ToolChoice>, ApiError> {
    let no_tools = || {
        ApiError::invalid(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
            Some("tool_choice"),
            Some("invalid_value"),
        )
    };
    match body.get("tool_choice") {
        None | Some(Value::Null) => Ok(None),
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
                ToolMode::Required if tools.is_empty() => Err(no_tools()),
                _ => Ok(Some(ToolChoice::Mode(mode))),
            }
        }
        Some(v @ Value::Object(_)) => {
            if v["type"] != "function" {
                return Err(ApiError::unsupported(
                    "tool_choice.type",
                    "only 'none', 'auto', 'required' or a function tool can be chosen",
                ));
            }
            if tools.is_empty() {
                return Err(no_tools());
            }
            let Some(name) = v["name"].as_str() else {
                return Err(ApiError::invalid(
                    "Missing required parameter: 'tool_choice.name'.",
                    Some("tool_choice.name"),
                    Some("missing_required_parameter"),
                ));
            };
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    format!(
                        "Invalid 'tool_choice': no tool is named '{}'.",
                        name.chars().take(64).collect::<String>()
                    ),
                    Some("tool_choice.name"),
                    Some("invalid_value"),
                ));
            }
            Ok(Some(ToolChoice::Named {
                name: name.to_owned(),
            }))
        }
        Some(_) => Err(ApiError::invalid(
            "Invalid type for 'tool_choice': expected a string or an object.",
            Some("tool_choice"),
            Some("invalid_type"),
        )),
    }
}

/// `input`: the system texts (system and developer messages, in order) and the turns, at
/// least one. A string is one user message.
fn conversation(body: &Map<String, Value>) -> Result<(Vec<String>, Vec<ChatMessage>), ApiError> {
    let items = match body.get("input") {
        Some(Value::String(s)) => {
            return Ok((
                Vec::new(),
                vec![ChatMessage::new(ChatRole::User, s.clone())],
            ));
        }
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "Invalid 'input': empty array. Expected an array with minimum length 1.",
                Some("input"),
                Some("empty_array"),
            ));
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "Missing required parameter: 'input'.",
                Some("input"),
                Some("missing_required_parameter"),
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'input': expected a string or an array of input items.",
                Some("input"),
                Some("invalid_type"),
            ));
        }
    };
    let mut turns = Conversation::default();
    for (i, item) in items.iter().enumerate() {
        turns.item(item, &format!("input[{i}]"))?;
    }
    if turns.turns.is_empty() {
        return Err(ApiError::invalid(
            "Invalid 'input': expected at least one user, assistant or function_call_output item.",
            Some("input"),
            Some("invalid_value"),
        ));
    }
    Ok((turns.system, turns.turns))
}

/// The input items read so far.
#[derive(Default)]
struct Conversation {
    system: Vec<String>,
    turns: Vec<ChatMessage>,
    /// The call ids of the function calls so far: an output must answer one of them.
    calls_made: std::collections::HashSet<String>,
}

impl Conversation {
    /// One input item at `at`: a message (`type` "message" or none), a `function_call` or a
    /// `function_call_output`.
    fn item(&mut self, item: &Value, at: &str) -> Result<(), ApiError> {
        if !item.is_object() {
            return Err(ApiError::invalid(
                format!("Invalid type for '{at}': expected an object."),
                Some(at),
                Some("invalid_type"),
            ));
        }
        match item["type"].as_str() {
            None | Some("message") => self.message(item, at),
            Some("function_call") => {
                let call = ToolCall {
                    id: required(item, at, "call_id")?,
                    name: required(item, at, "name")?,
                    arguments: required(item, at, "arguments")?,
                };
                self.calls_made.insert(call.id.clone());
                // Calls after an assistant message (or other calls) are that turn's.
                match self.turns.last_mut() {
                    Some(last) if last.role == ChatRole::Assistant => last.tool_calls.push(call),
                    _ => {
                        let mut turn = ChatMessage::new(ChatRole::Assistant, String::new());
                        turn.tool_calls.push(call);
                        self.turns.push(turn);
                    }
                }
                Ok(())
            }
            Some("function_call_output") => {
                let call = required(item, at, "call_id")?;
                if !self.calls_made.contains(&call) {
                    return Err(ApiError::invalid(
                        format!(
                            "No tool call found for function call output with call_id '{}'.",
                            call.chars().take(64).collect::<String>()
                        ),
                        Some(&format!("{at}.call_id")),
                        Some("invalid_value"),
                    ));
                }
                let output = content_text(&item["output"], &format!("{at}.output"))?;
                let mut turn = ChatMessage::new(ChatRole::Tool, output);
                turn.tool_call_id = Some(call);
                self.turns.push(turn);
                Ok(())
            }
            Some(other) => Err(ApiError::unsupported(
                &format!("{at}.type"),
                &format!(
                    "input items of type '{}' are not supported; send messages, function_call and function_call_output items",
                    other.chars().take(40).collect::<String>()
                ),
            )),
        }
    }

    /// A message item: its role and its content's text.
    fn message(&mut self, m: &Value, at: &str) -> Result<(), ApiError> {
        let Some(role) = m["role"].as_str() else {
            return Err(ApiError::invalid(
                format!("Missing required parameter: '{at}.role'."),
                Some(&format!("{at}.role")),
                Some("missing_required_parameter"),
            ));
        };
        let content = content_text(&m["content"], &format!("{at}.content"))?;
        match role {
            "system" | "developer" => self.system.push(content),
            "user" => self.turns.push(ChatMessage::new(ChatRole::User, content)),
            "assistant" => self
                .turns
                .push(ChatMessage::new(ChatRole::Assistant, content)),
            other => {
                let shown: String = other.chars().take(40).collect();
                return Err(ApiError::invalid(
                    format!(
                        "Invalid value: '{shown}'. Supported values are: 'assistant', 'system', 'developer', and 'user'."
                    ),
                    Some(&format!("{at}.role")),
                    Some("invalid_value"),
                ));
            }
        }
        Ok(())
    }
}

/// A string field of an item, required.
fn required(item: &Value, at: &str, name: &str) -> Result<String, ApiError> {
    item[name].as_str().map(str::to_owned).ok_or_else(|| {
        ApiError::invalid(
            format!("Missing required parameter: '{at}.{name}'."),
            Some(&format!("{at}.{name}")),
            Some("missing_required_parameter"),
        )
    })
}

/// The text of a message's `content` (or an output's `output`): a string, or text parts
/// (`input_text`, `output_text`) joined. Any other part (an image, a file, audio) is refused:
/// the processors take text only.
fn content_text(content: &Value, at: &str) -> Result<String, ApiError> {
    let parts = match content {
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        Value::Null => {
            return Err(ApiError::invalid(
                format!("Missing required parameter: '{at}'."),
                Some(at),
                Some("missing_required_parameter"),
            ));
        }
        _ => {
            return Err(ApiError::invalid(
                format!("Invalid type for '{at}': expected a string or an array of text parts."),
                Some(at),
                Some("invalid_type"),
            ));
        }
    };
    parts_text(parts, at, &["input_text", "output_text"])
}

#[cfg(test)]
mod tests;
