//! The body of `POST /v1/messages`, decoded as typed values (a wrong type is reported by its
//! field's path, never by its value: the body holds prompts) and translated into
//! text-completion's request.
//!
//! As Anthropic's API: `model`, `max_tokens` and `messages` are required, a field it does not
//! define is refused (`Extra inputs are not permitted`), and `temperature` runs from 0 to 1.
//! What sluice cannot honour (images and documents, extended thinking, server tools, MCP
//! servers, sampling settings the processors do not pass) is refused by name with a 400,
//! never silently dropped. Hints that do not change the answer (`metadata`, `service_tier`,
//! `cache_control`, ...) are accepted and ignored.

use std::collections::HashSet;

use serde::Deserialize;
use serde_json::{Map, Value};
use sluice_schema::{
    ChatMessage, ChatRole, TextCompletionRequest, Tool, ToolCall, ToolChoice, ToolMode,
};

use super::AnthropicError;

/// A Messages request, checked and translated.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MessagesCall {
    /// The record for the text-completion processor.
    pub request: TextCompletionRequest,
    /// The model asked for.
    pub model: String,
    /// `stream: true`: the answer as SSE events.
    pub stream: bool,
}

/// Every top-level field of Anthropic's Messages request that sluice reads.
const READ: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "output_format",
];

/// Fields Anthropic defines that do not change the answer (caller ids, routing, caching and
/// latency hints): accepted and ignored.
const IGNORED: &[&str] = &[
    "metadata",
    "service_tier",
    "cache_control",
    "inference_geo",
    "speed",
    "diagnostics",
];

/// Fields Anthropic defines that need what sluice has not (code-execution containers, MCP
/// servers, server-side context editing): refused by name.
const REFUSED: &[&str] = &["container", "mcp_servers", "context_management"];

/// The body's typed fields ([`READ`]); the others were checked by name before.
#[derive(Debug, Deserialize)]
struct MessagesBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    messages: Option<Vec<MessageBody>>,
    /// A string, or an array of text blocks.
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    tools: Option<Vec<ToolBody>>,
    #[serde(default)]
    tool_choice: Option<ToolChoiceBody>,
    #[serde(default)]
    thinking: Option<ThinkingBody>,
    /// `{"format": {"type": "json_schema", "schema": ...}, "effort": ...}`.
    #[serde(default)]
    output_config: Option<OutputConfig>,
    /// The beta's `{"type": "json_schema", "schema": ...}`.
    #[serde(default)]
    output_format: Option<OutputFormat>,
}

#[derive(Debug, Deserialize)]
struct MessageBody {
    role: String,
    /// A string, or an array of content blocks.
    content: Value,
}

/// One content block; which fields it has depends on its type, checked per type.
#[derive(Debug, Deserialize)]
struct BlockBody {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    tool_use_id: Option<String>,
    /// A tool result's: a string, or an array of text blocks.
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    is_error: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ToolBody {
    /// `custom` (or absent) for a client tool; a server tool's versioned type otherwise.
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
    #[serde(default)]
    strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ToolChoiceBody {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    disable_parallel_tool_use: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ThinkingBody {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Debug, Deserialize)]
struct OutputConfig {
    #[serde(default)]
    format: Option<OutputFormat>,
}

#[derive(Debug, Deserialize)]
struct OutputFormat {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    schema: Option<Value>,
}

/// Checks a `POST /v1/messages` body and translates it. The checks run in a fixed order, as
/// Anthropic reports one problem at a time: the body's shape and field names, the types, the
/// required fields, the settings, the tools, the output format, and last the conversation.
pub(crate) fn parse_messages(body: &[u8]) -> Result<MessagesCall, AnthropicError> {
    let fields = json_object(body)?;
    for name in fields.keys() {
        let shown: String = name.chars().take(60).collect();
        if REFUSED.contains(&name.as_str()) {
            return Err(unsupported(&shown, "the processors have no such tools"));
        }
        if !READ.contains(&name.as_str()) && !IGNORED.contains(&name.as_str()) {
            return Err(AnthropicError::invalid(format!(
                "{shown}: Extra inputs are not permitted"
            )));
        }
    }
    let body: MessagesBody = sluice_schema::decode_value(Value::Object(fields))
        .map_err(|e| AnthropicError::invalid(dotted(e.detail())))?;
    let model = match body.model {
        Some(m) if !m.trim().is_empty() => m,
        Some(_) => return Err(AnthropicError::invalid("model: String should not be empty")),
        None => return Err(AnthropicError::invalid("model: Field required")),
    };
    let max_tokens = match body.max_tokens {
        Some(n) if n >= 1 => u32::try_from(n).unwrap_or(u32::MAX),
        Some(_) => {
            return Err(AnthropicError::invalid(
                "max_tokens: Input should be greater than or equal to 1",
            ));
        }
        None => return Err(AnthropicError::invalid("max_tokens: Field required")),
    };
    let Some(messages) = body.messages else {
        return Err(AnthropicError::invalid("messages: Field required"));
    };
    let mut request = TextCompletionRequest {
        model: Some(model.clone()),
        max_tokens: Some(max_tokens),
        streaming: body.stream.unwrap_or(false),
        ..TextCompletionRequest::default()
    };
    sampling(body.temperature, body.top_p, body.top_k, &mut request)?;
    request.stop = body
        .stop_sequences
        .map(|s| s.into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>())
        .filter(|s| !s.is_empty());
    if let Some(t) = body.thinking
        && t.kind != "disabled"
    {
        return Err(unsupported(
            "thinking",
            "extended thinking is not passed to providers; send {\"type\": \"disabled\"} or nothing",
        ));
    }
    request.tools = tools(body.tools.unwrap_or_default())?;
    (request.tool_choice, request.parallel_tool_calls) =
        tool_choice(body.tool_choice, request.tools.as_deref())?;
    let format = match body.output_config {
        Some(c) => c.format.map(|f| ("output_config.format", f)),
        None => None,
    };
    if let Some((at, f)) = format.or(body.output_format.map(|f| ("output_format", f))) {
        request.schema = Some(output_schema(at, f)?);
        request.response_format = Some("json".into());
    }
    request.system = system(body.system)?;
    let turns = conversation(messages)?;
    // One user turn is exactly TrustGraph's request; a longer conversation also rides in
    // `messages`, flattened in `prompt` for processors that do not read `messages`.
    match turns.as_slice() {
        [only] if only.role == ChatRole::User => request.prompt.clone_from(&only.content),
        _ => {
            request.prompt = TextCompletionRequest::flatten(&turns);
            request.messages = Some(turns);
        }
    }
    Ok(MessagesCall {
        request,
        model,
        stream: body.stream.unwrap_or(false),
    })
}

/// The body as a JSON object.
fn json_object(body: &[u8]) -> Result<Map<String, Value>, AnthropicError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(fields)) => Ok(fields),
        Ok(_) => Err(AnthropicError::invalid(
            "The request body must be a JSON object.",
        )),
        Err(e) => Err(AnthropicError::invalid(format!(
            "There was an error parsing the body of your request: not valid JSON (line {}, column {}).",
            e.line(),
            e.column()
        ))),
    }
}

/// A decoding error's ``field `messages[0].content`: expected ...`` as Anthropic words its
/// errors: `messages.0.content: expected ...`.
fn dotted(detail: &str) -> String {
    let Some(rest) = detail.strip_prefix("field `") else {
        return detail.to_owned();
    };
    let Some((path, why)) = rest.split_once("`: ") else {
        return detail.to_owned();
    };
    let path = path.replace('[', ".").replace(']', "");
    format!("{path}: {why}")
}

/// A field or value sluice cannot honour, refused by name.
fn unsupported(field: &str, why: &str) -> AnthropicError {
    AnthropicError::invalid(format!("{field}: not supported by this server: {why}"))
}

/// `temperature` (0 to 1, as Anthropic's range) onto the request; `top_p` passes only as 1
/// (no change) and `top_k` never: the processors do not pass them to every provider.
fn sampling(
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    request: &mut TextCompletionRequest,
) -> Result<(), AnthropicError> {
    if let Some(t) = temperature
        && !(0.0..=1.0).contains(&t)
    {
        return Err(AnthropicError::invalid(
            "temperature: Input should be between 0 and 1",
        ));
    }
    request.temperature = temperature;
    if top_p.is_some_and(|p| p != 1.0) {
        return Err(unsupported(
            "top_p",
            "the processors do not pass it to every provider; use temperature",
        ));
    }
    if top_k.is_some() {
        return Err(unsupported(
            "top_k",
            "the processors do not pass it to every provider; use temperature",
        ));
    }
    Ok(())
}

/// `system`: a string, or text blocks (joined by blank lines).
fn system(system: Option<Value>) -> Result<String, AnthropicError> {
    match system {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.into_iter().enumerate() {
                let b = block(b, &format!("system.{i}"))?;
                match (b.kind.as_str(), b.text) {
                    ("text", Some(t)) => texts.push(t),
                    ("text", None) => {
                        return Err(AnthropicError::invalid(format!(
                            "system.{i}.text: Field required"
                        )));
                    }
                    _ => {
                        return Err(AnthropicError::invalid(format!(
                            "system.{i}.type: Input should be 'text'"
                        )));
                    }
                }
            }
            Ok(texts.join("\n\n"))
        }
        Some(_) => Err(AnthropicError::invalid(
            "system: Input should be a valid string or a list of text blocks",
        )),
    }
}

/// One content block at `at`, decoded.
fn block(value: Value, at: &str) -> Result<BlockBody, AnthropicError> {
    sluice_schema::decode_value::<BlockBody>(value).map_err(|e| {
        let detail = dotted(e.detail());
        AnthropicError::invalid(match detail.strip_prefix("the record: ") {
            Some(why) => format!("{at}: {why}"),
            None => format!("{at}.{detail}"),
        })
    })
}

/// The most tools one request may offer.
const MAX_TOOLS: usize = 128;

/// `tools`: client tools (`custom`, or no type), named as every provider accepts them, no
/// name twice, each with an object `input_schema`. Anthropic's server tools (web search,
/// code execution, ...) are refused: no processor runs them.
fn tools(list: Vec<ToolBody>) -> Result<Option<Vec<Tool>>, AnthropicError> {
    if list.len() > MAX_TOOLS {
        return Err(AnthropicError::invalid(format!(
            "tools: List should have at most {MAX_TOOLS} items"
        )));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        if t.kind.as_deref().is_some_and(|k| k != "custom") {
            return Err(unsupported(
                &format!("tools.{i}.type"),
                "server tools are not run here; send client tools (name, description, input_schema)",
            ));
        }
        let Some(name) = t.name else {
            return Err(AnthropicError::invalid(format!(
                "tools.{i}.name: Field required"
            )));
        };
        if !sluice_schema::tools::valid_name(&name) {
            return Err(AnthropicError::invalid(format!(
                "tools.{i}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"
            )));
        }
        if tools.iter().any(|t| t.name == name) {
            return Err(AnthropicError::invalid(format!(
                "tools: Tool names must be unique (tools.{i}.name)"
            )));
        }
        let parameters = match t.input_schema {
            Some(p @ Value::Object(_)) => p,
            None | Some(Value::Null) => {
                return Err(AnthropicError::invalid(format!(
                    "tools.{i}.input_schema: Field required"
                )));
            }
            Some(_) => {
                return Err(AnthropicError::invalid(format!(
                    "tools.{i}.input_schema: Input should be a valid dictionary"
                )));
            }
        };
        tools.push(Tool {
            name,
            description: t.description,
            parameters,
            strict: t.strict,
        });
    }
    Ok((!tools.is_empty()).then_some(tools))
}

/// `tool_choice`: `auto`, `any` (some tool), `tool` (the one named) or `none`, and
/// `disable_parallel_tool_use`. Without tools, `auto` and `none` change nothing and pass.
fn tool_choice(
    choice: Option<ToolChoiceBody>,
    tools: Option<&[Tool]>,
) -> Result<(Option<ToolChoice>, Option<bool>), AnthropicError> {
    let Some(c) = choice else {
        return Ok((None, None));
    };
    let tools = tools.unwrap_or_default();
    let parallel = c
        .disable_parallel_tool_use
        .filter(|_| !tools.is_empty())
        .map(|disabled| !disabled);
    let choice = match c.kind.as_str() {
        "auto" | "none" if tools.is_empty() => None,
        "auto" => Some(ToolChoice::Mode(ToolMode::Auto)),
        "none" => Some(ToolChoice::Mode(ToolMode::None)),
        "any" | "tool" if tools.is_empty() => {
            return Err(AnthropicError::invalid(
                "tool_choice: may only be specified while providing tools",
            ));
        }
        "any" => Some(ToolChoice::Mode(ToolMode::Required)),
        "tool" => {
            let Some(name) = c.name.filter(|n| tools.iter().any(|t| &t.name == n)) else {
                return Err(AnthropicError::invalid(
                    "tool_choice.name: expected the name of one of the tools",
                ));
            };
            Some(ToolChoice::Named { name })
        }
        _ => {
            return Err(AnthropicError::invalid(
                "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'",
            ));
        }
    };
    Ok((choice, parallel))
}

/// A structured output's schema: `{"type": "json_schema", "schema": {...}}`.
fn output_schema(at: &str, f: OutputFormat) -> Result<Value, AnthropicError> {
    if f.kind != "json_schema" {
        return Err(AnthropicError::invalid(format!(
            "{at}.type: Input should be 'json_schema'"
        )));
    }
    match f.schema {
        Some(s @ Value::Object(_)) => Ok(s),
        _ => Err(AnthropicError::invalid(format!(
            "{at}.schema: Input should be a valid dictionary"
        ))),
    }
}

/// `messages`: the conversation's turns, at least one. An assistant message's text and
/// `tool_use` blocks are one assistant turn; a user message's `tool_result` blocks are tool
/// turns answering calls made before them, its text one user turn after them. Earlier
/// answers' thinking blocks are dropped, as Anthropic drops them from earlier turns.
fn conversation(messages: Vec<MessageBody>) -> Result<Vec<ChatMessage>, AnthropicError> {
    if messages.is_empty() {
        return Err(AnthropicError::invalid(
            "messages: List should have at least 1 item",
        ));
    }
    let mut turns = Vec::with_capacity(messages.len());
    // The ids of the tool calls made so far: a result must answer one of them.
    let mut calls_made = HashSet::new();
    for (i, m) in messages.into_iter().enumerate() {
        let at = format!("messages.{i}");
        let blocks = content(m.content, &at)?;
        match m.role.as_str() {
            "user" => user(blocks, &at, &calls_made, &mut turns)?,
            "assistant" => {
                let turn = assistant(blocks, &at)?;
                for call in &turn.tool_calls {
                    if !calls_made.insert(call.id.clone()) {
                        return Err(AnthropicError::invalid(format!(
                            "{at}: `tool_use` ids must be unique"
                        )));
                    }
                }
                turns.push(turn);
            }
            _ => {
                return Err(AnthropicError::invalid(format!(
                    "{at}.role: Input should be 'user' or 'assistant'"
                )));
            }
        }
    }
    Ok(turns)
}

/// A message's content as blocks: a string is one text block.
fn content(content: Value, at: &str) -> Result<Vec<BlockBody>, AnthropicError> {
    match content {
        Value::String(text) => Ok(vec![BlockBody {
            kind: "text".into(),
            text: Some(text),
            id: None,
            name: None,
            input: None,
            tool_use_id: None,
            content: None,
            is_error: None,
        }]),
        Value::Array(blocks) => blocks
            .into_iter()
            .enumerate()
            .map(|(j, b)| block(b, &format!("{at}.content.{j}")))
            .collect(),
        _ => Err(AnthropicError::invalid(format!(
            "{at}.content: Input should be a valid string or a list of content blocks"
        ))),
    }
}

/// A block type that is Anthropic's but that sluice does not take, refused by name.
fn refuse_block(kind: &str, at: &str) -> AnthropicError {
    let shown: String = kind.chars().take(40).collect();
    match kind {
        "image" | "document" | "search_result" | "container_upload" => unsupported(
            &format!("{at}.type"),
            &format!("`{shown}` blocks are not taken: the processors take text only"),
        ),
        _ => AnthropicError::invalid(format!(
            "{at}.type: `{shown}` blocks are not supported here; send text, tool_use and tool_result blocks"
        )),
    }
}

/// The text of a `text` block at `at`.
fn text_of(b: BlockBody, at: &str) -> Result<String, AnthropicError> {
    b.text
        .ok_or_else(|| AnthropicError::invalid(format!("{at}.text: Field required")))
}

/// A user message's blocks onto `turns`: its tool results (each answering a call made
/// before), then its text as one user turn.
fn user(
    blocks: Vec<BlockBody>,
    at: &str,
    calls_made: &HashSet<String>,
    turns: &mut Vec<ChatMessage>,
) -> Result<(), AnthropicError> {
    let mut text = Vec::new();
    let mut results = 0;
    for (j, b) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content.{j}");
        match b.kind.as_str() {
            "text" => text.push(text_of(b, &at)?),
            "tool_result" => {
                let Some(id) = b.tool_use_id.filter(|id| !id.is_empty()) else {
                    return Err(AnthropicError::invalid(format!(
                        "{at}.tool_use_id: Field required"
                    )));
                };
                if !calls_made.contains(&id) {
                    return Err(AnthropicError::invalid(format!(
                        "{at}: unexpected `tool_use_id` found in `tool_result` blocks. Each `tool_result` block must have a corresponding `tool_use` block in an earlier message."
                    )));
                }
                let mut result = tool_result_text(b.content, &at)?;
                if b.is_error == Some(true) {
                    result.insert_str(0, "Error: ");
                }
                let mut turn = ChatMessage::new(ChatRole::Tool, result);
                turn.tool_call_id = Some(id);
                turns.push(turn);
                results += 1;
            }
            "tool_use" | "thinking" | "redacted_thinking" => {
                return Err(AnthropicError::invalid(format!(
                    "{at}.type: `{}` blocks may only be in assistant messages",
                    b.kind
                )));
            }
            other => return Err(refuse_block(other, &at)),
        }
    }
    if !text.is_empty() || results == 0 {
        turns.push(ChatMessage::new(ChatRole::User, text.concat()));
    }
    Ok(())
}

/// A tool result's content: a string, or text blocks (joined).
fn tool_result_text(content: Option<Value>, at: &str) -> Result<String, AnthropicError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (k, b) in blocks.into_iter().enumerate() {
                let at = format!("{at}.content.{k}");
                let b = block(b, &at)?;
                match b.kind.as_str() {
                    "text" => text.push_str(&text_of(b, &at)?),
                    other => return Err(refuse_block(other, &at)),
                }
            }
            Ok(text)
        }
        Some(_) => Err(AnthropicError::invalid(format!(
            "{at}.content: Input should be a valid string or a list of text blocks"
        ))),
    }
}

/// An assistant message's blocks as one turn: its text, and its `tool_use` blocks as calls
/// (their input as JSON text).
fn assistant(blocks: Vec<BlockBody>, at: &str) -> Result<ChatMessage, AnthropicError> {
    let mut turn = ChatMessage::new(ChatRole::Assistant, String::new());
    for (j, b) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content.{j}");
        match b.kind.as_str() {
            "text" => turn.content.push_str(&text_of(b, &at)?),
            "tool_use" => {
                let (Some(id), Some(name)) = (b.id.filter(|i| !i.is_empty()), b.name) else {
                    return Err(AnthropicError::invalid(format!(
                        "{at}: a `tool_use` block needs its id and name"
                    )));
                };
                let arguments = match b.input {
                    None | Some(Value::Null) => "{}".to_owned(),
                    Some(input @ Value::Object(_)) => input.to_string(),
                    Some(_) => {
                        return Err(AnthropicError::invalid(format!(
                            "{at}.input: Input should be a valid dictionary"
                        )));
                    }
                };
                turn.tool_calls.push(ToolCall {
                    id,
                    name,
                    arguments,
                });
            }
            // Earlier answers' reasoning: the provider answering now has no use for it.
            "thinking" | "redacted_thinking" => {}
            "tool_result" => {
                return Err(AnthropicError::invalid(format!(
                    "{at}.type: `tool_result` blocks may only be in user messages"
                )));
            }
            other => return Err(refuse_block(other, &at)),
        }
    }
    Ok(turn)
}

#[cfg(test)]
mod tests;
