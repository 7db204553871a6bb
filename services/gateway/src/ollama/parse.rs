//! The bodies of `POST /api/chat` and `POST /api/generate`, decoded as typed values (a wrong
//! type is reported by its field's path, never by its value: the body holds prompts) and
//! translated into text-completion's request.
//!
//! As Ollama's own server: unknown top-level fields and unknown `options` are ignored,
//! `stream` defaults to `true`, and a request with nothing to answer (no messages, an empty
//! prompt) only loads the model. What sluice cannot honour (images, thinking, raw prompts,
//! templates, `context`, sampling options it does not pass to providers) is refused by name
//! with a 400, never silently dropped.

use std::collections::HashSet;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value};
use sluice_schema::{ChatMessage, ChatRole, TextCompletionRequest, Tool, ToolCall};

use super::OllamaError;

/// A chat or generate request, checked and translated.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OllamaCall {
    /// The record for the text-completion processor (its `model` is set once the model is
    /// resolved against those served).
    pub request: TextCompletionRequest,
    /// The model as the caller named it: every answer line names it so.
    pub model: String,
    /// Streamed as NDJSON lines (Ollama's default), or one object.
    pub stream: bool,
    /// Nothing to answer (no messages, an empty prompt): Ollama loads the model and answers
    /// `done_reason: "load"` without generating.
    pub load_only: bool,
    /// `keep_alive` asks to unload the model at once (`0`): with nothing to answer, Ollama
    /// answers `done_reason: "unload"`.
    pub unload: bool,
}

/// `POST /api/chat`'s body.
#[derive(Debug, Deserialize)]
struct ChatBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<MessageBody>>,
    #[serde(default)]
    tools: Option<Vec<ToolBody>>,
    #[serde(default)]
    stream: Option<bool>,
    /// `"json"`, a JSON schema, or nothing (`null`, `""`).
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    options: Option<Options>,
    /// `true`, `false` or a level (`"high"`, ...).
    #[serde(default)]
    think: Option<Value>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<i64>,
    /// How long the model stays loaded: the server's business, read only for `0` (unload).
    #[serde(default)]
    keep_alive: Option<Value>,
}

/// `POST /api/generate`'s body.
#[derive(Debug, Deserialize)]
struct GenerateBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    system: Option<String>,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    context: Option<Vec<i64>>,
    #[serde(default)]
    raw: Option<bool>,
    #[serde(default)]
    images: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    stream: Option<bool>,
    /// `"json"`, a JSON schema, or nothing (`null`, `""`).
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    options: Option<Options>,
    /// `true`, `false` or a level (`"high"`, ...).
    #[serde(default)]
    think: Option<Value>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<i64>,
    /// How long the model stays loaded: the server's business, read only for `0` (unload).
    #[serde(default)]
    keep_alive: Option<Value>,
}

/// The fields both routes share (written out in each body rather than flattened: a
/// flattened field's errors lose their path). `keep_alive`, how long the model stays loaded,
/// is the server's business: read only for an unload ([`unloads`]).
struct Common {
    stream: Option<bool>,
    format: Option<Value>,
    options: Option<Options>,
    think: Option<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
}

/// The [`Common`] fields of a body.
macro_rules! common {
    ($body:expr) => {
        Common {
            stream: $body.stream,
            format: $body.format,
            options: $body.options,
            think: $body.think,
            logprobs: $body.logprobs,
            top_logprobs: $body.top_logprobs,
        }
    };
}

/// `options`: the three that reach the provider, the context window (accepted, ignored),
/// and everything else by name.
#[derive(Debug, Deserialize)]
struct Options {
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    num_predict: Option<i64>,
    #[serde(default)]
    stop: Option<Vec<String>>,
    /// A number; seed 001's example writes a (templated) string, so a string passes too.
    /// Decoded only so that another type is refused, as Ollama refuses it.
    #[serde(default)]
    #[allow(dead_code)]
    num_ctx: Option<NumCtx>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// `options.num_ctx`: the context window, which is the provider's setting (an Ollama
/// provider's `--num-ctx`), not the caller's. Read only to refuse a value of another type.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
#[allow(dead_code)]
enum NumCtx {
    Number(f64),
    Text(String),
}

/// One chat message.
#[derive(Debug, Deserialize)]
struct MessageBody {
    role: String,
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    images: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallBody>>,
    /// The tool a `tool` message answers (Ollama matches results to calls by name).
    #[serde(default)]
    tool_name: Option<String>,
    /// The call a `tool` message answers, from clients that send ids.
    #[serde(default)]
    tool_call_id: Option<String>,
}

/// A tool call of an assistant message: `{"function": {"name", "arguments": {...}}}`.
#[derive(Debug, Deserialize)]
struct ToolCallBody {
    #[serde(default)]
    id: Option<String>,
    function: CalledFunction,
}

#[derive(Debug, Deserialize)]
struct CalledFunction {
    name: String,
    #[serde(default)]
    arguments: Option<Map<String, Value>>,
}

/// An offered tool: `{"type": "function", "function": {"name", "description", "parameters"}}`.
#[derive(Debug, Deserialize)]
struct ToolBody {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    function: ToolFunction,
}

#[derive(Debug, Deserialize)]
struct ToolFunction {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

/// Options that only size or place the model (memory, threads, GPUs, the context window):
/// the server's settings, not the request's. Accepted and ignored.
const RESOURCE_OPTIONS: &[&str] = &[
    "num_keep",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "numa",
    "embedding_only",
];

/// Sampling options the processors do not pass to providers, with the value that changes
/// nothing (which passes: clients send Ollama's defaults); `None`: refused whenever given.
const SAMPLING_OPTIONS: &[(&str, Option<f64>)] = &[
    ("top_p", Some(1.0)),
    ("min_p", Some(0.0)),
    ("typical_p", Some(1.0)),
    ("tfs_z", Some(1.0)),
    ("presence_penalty", Some(0.0)),
    ("frequency_penalty", Some(0.0)),
    ("repeat_penalty", Some(1.0)),
    ("mirostat", Some(0.0)),
    ("top_k", None),
    ("seed", None),
    ("repeat_last_n", None),
    ("mirostat_tau", None),
    ("mirostat_eta", None),
    ("penalize_newline", None),
];

/// Decodes `body` as `T`, Ollama's way of saying a body is unreadable: 400, with the
/// failing field's path and the type expected there.
fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, OllamaError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(OllamaError::bad_request("missing request body"));
    }
    sluice_schema::decode(body).map_err(|e| OllamaError::bad_request(e.to_string()))
}

/// `model`: required, a non-empty string.
fn model(model: Option<String>) -> Result<String, OllamaError> {
    match model {
        Some(m) if !m.trim().is_empty() => Ok(m),
        _ => Err(OllamaError::bad_request("model is required")),
    }
}

/// Checks a `POST /api/chat` body and translates it.
pub(crate) fn parse_chat(body: &[u8]) -> Result<OllamaCall, OllamaError> {
    let body: ChatBody = decode(body)?;
    let model = model(body.model)?;
    let mut request = TextCompletionRequest::default();
    let stream = common(common!(body), &model, &mut request)?;
    request.tools = tools(body.tools.unwrap_or_default())?;
    let messages = body.messages.unwrap_or_default();
    let load_only = messages.is_empty();
    let (system, turns) = conversation(messages)?;
    request.system = system.join("\n\n");
    if turns.is_empty() && !load_only {
        return Err(OllamaError::bad_request(
            "messages: expected at least one user, assistant or tool message",
        ));
    }
    // One user turn is exactly TrustGraph's request; a longer conversation also rides in
    // `messages`, flattened in `prompt` for processors that do not read `messages`.
    match turns.as_slice() {
        [only] if only.role == ChatRole::User && only.tool_calls.is_empty() => {
            request.prompt.clone_from(&only.content);
        }
        _ => {
            request.prompt = TextCompletionRequest::flatten(&turns);
            request.messages = (!turns.is_empty()).then_some(turns);
        }
    }
    Ok(OllamaCall {
        request,
        model,
        stream,
        load_only,
        unload: unloads(body.keep_alive.as_ref()),
    })
}

/// Whether `keep_alive` asks to unload the model at once, as Ollama reads it: `0` seconds,
/// or a duration of zero (`"0"`, `"0s"`, `"0m"`). A negative one keeps it loaded for ever.
fn unloads(keep_alive: Option<&Value>) -> bool {
    let zero = |f: f64| f.abs() < f64::EPSILON;
    match keep_alive {
        Some(Value::Number(n)) => n.as_f64().is_some_and(zero),
        Some(Value::String(s)) => {
            let amount = s.trim().trim_end_matches(|c: char| c.is_ascii_alphabetic());
            amount.parse::<f64>().is_ok_and(zero)
        }
        _ => false,
    }
}

/// Checks a `POST /api/generate` body and translates it.
pub(crate) fn parse_generate(body: &[u8]) -> Result<OllamaCall, OllamaError> {
    let body: GenerateBody = decode(body)?;
    let model = model(body.model)?;
    let mut request = TextCompletionRequest::default();
    let stream = common(common!(body), &model, &mut request)?;
    if body.images.is_some_and(|i| !i.is_empty()) {
        return Err(unsupported("images", "the processors take text only"));
    }
    if body.suffix.is_some_and(|s| !s.is_empty()) {
        return Err(OllamaError::bad_request(format!(
            "{} does not support insert",
            quoted(&model)
        )));
    }
    if body.template.is_some_and(|t| !t.is_empty()) {
        return Err(unsupported(
            "template",
            "the provider applies its own prompt template",
        ));
    }
    if body.raw == Some(true) {
        return Err(unsupported(
            "raw",
            "the provider applies its own prompt template",
        ));
    }
    if body.context.is_some_and(|c| !c.is_empty()) {
        return Err(unsupported(
            "context",
            "no token context is kept between calls; send the conversation to /api/chat",
        ));
    }
    request.system = body.system.unwrap_or_default();
    request.prompt = body.prompt.unwrap_or_default();
    let load_only = request.prompt.is_empty();
    Ok(OllamaCall {
        request,
        model,
        stream,
        load_only,
        unload: unloads(body.keep_alive.as_ref()),
    })
}

/// A model name as Ollama quotes it in errors.
fn quoted(model: &str) -> String {
    let shown: String = model.chars().take(100).collect();
    format!("\"{shown}\"")
}

/// A field sluice cannot honour, refused by name.
fn unsupported(field: &str, why: &str) -> OllamaError {
    OllamaError::bad_request(format!("{field} is not supported by this server: {why}"))
}

/// The fields both routes share, onto `request`; whether the answer streams.
fn common(
    c: Common,
    model: &str,
    request: &mut TextCompletionRequest,
) -> Result<bool, OllamaError> {
    // Ollama streams unless told not to.
    let stream = c.stream.unwrap_or(true);
    request.streaming = stream;
    match c.think {
        None | Some(Value::Null | Value::Bool(false)) => {}
        Some(_) => {
            return Err(OllamaError::bad_request(format!(
                "{} does not support thinking",
                quoted(model)
            )));
        }
    }
    if c.logprobs == Some(true) || c.top_logprobs.is_some_and(|n| n > 0) {
        return Err(unsupported(
            "logprobs",
            "log probabilities are not returned",
        ));
    }
    match c.format {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) if s == "json" => request.response_format = Some("json".into()),
        Some(schema @ Value::Object(_)) => {
            request.response_format = Some("json".into());
            request.schema = Some(schema);
        }
        Some(_) => {
            return Err(OllamaError::bad_request(
                "invalid format: expected \"json\" or a JSON schema object",
            ));
        }
    }
    if let Some(o) = c.options {
        options(o, request)?;
    }
    Ok(stream)
}

/// `options`: `temperature`, `num_predict` (a positive limit; `-1`, `-2` and `0` set none)
/// and `stop` onto the request; resource options and unknown ones ignored, as Ollama ignores
/// those it does not know; sampling options sluice does not pass refused unless neutral.
fn options(o: Options, request: &mut TextCompletionRequest) -> Result<(), OllamaError> {
    request.temperature = o.temperature;
    request.max_tokens = o
        .num_predict
        .filter(|n| *n > 0)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    request.stop = o
        .stop
        .map(|s| s.into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>())
        .filter(|s| !s.is_empty());
    for (name, value) in &o.rest {
        if value.is_null() || RESOURCE_OPTIONS.contains(&name.as_str()) {
            continue;
        }
        let Some((_, neutral)) = SAMPLING_OPTIONS.iter().find(|(n, _)| n == name) else {
            continue;
        };
        let is_neutral = match (neutral, value) {
            (Some(n), Value::Number(v)) => v.as_f64() == Some(*n),
            (Some(n), Value::Bool(b)) => *n == 0.0 && !b,
            _ => false,
        };
        if !is_neutral {
            return Err(unsupported(
                &format!("option \"{name}\""),
                "the processors do not pass it to providers; use temperature",
            ));
        }
    }
    Ok(())
}

/// `tools`: function tools named as every provider accepts them, no name twice.
fn tools(list: Vec<ToolBody>) -> Result<Option<Vec<Tool>>, OllamaError> {
    let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        if t.kind.as_deref().is_some_and(|k| k != "function") {
            return Err(unsupported(
                &format!("tools[{i}].type"),
                "only function tools are supported",
            ));
        }
        let f = t.function;
        if !sluice_schema::tools::valid_name(&f.name) {
            return Err(OllamaError::bad_request(format!(
                "tools[{i}].function.name: expected 1 to 64 of a-z, A-Z, 0-9, _ and -"
            )));
        }
        if tools.iter().any(|t| t.name == f.name) {
            return Err(OllamaError::bad_request(format!(
                "tools[{i}].function.name: the name is given twice"
            )));
        }
        let parameters = match f.parameters {
            None | Some(Value::Null) => sluice_schema::tools::no_parameters(),
            Some(p @ Value::Object(_)) => p,
            Some(_) => {
                return Err(OllamaError::bad_request(format!(
                    "tools[{i}].function.parameters: expected an object"
                )));
            }
        };
        tools.push(Tool {
            name: f.name,
            description: f.description,
            parameters,
            strict: None,
        });
    }
    Ok((!tools.is_empty()).then_some(tools))
}

/// `messages`: the system texts (in order) and the conversation's turns. Calls of assistant
/// messages get an id where the caller sent none; a `tool` message answers the call its
/// `tool_call_id` names, else the earliest unanswered call of its `tool_name`, else the
/// earliest unanswered call.
fn conversation(
    messages: Vec<MessageBody>,
) -> Result<(Vec<String>, Vec<ChatMessage>), OllamaError> {
    let mut system = Vec::new();
    let mut turns: Vec<ChatMessage> = Vec::new();
    // Calls made and not yet answered, in order: (id, tool name).
    let mut open: Vec<(String, String)> = Vec::new();
    let mut ids = HashSet::new();
    for (i, m) in messages.into_iter().enumerate() {
        if m.images.is_some_and(|im| !im.is_empty()) {
            return Err(unsupported(
                &format!("messages[{i}].images"),
                "the processors take text only",
            ));
        }
        let content = m.content.unwrap_or_default();
        match m.role.as_str() {
            "system" => system.push(content),
            "user" => turns.push(ChatMessage::new(ChatRole::User, content)),
            "assistant" => {
                let mut turn = ChatMessage::new(ChatRole::Assistant, content);
                for (j, call) in m.tool_calls.unwrap_or_default().into_iter().enumerate() {
                    let id = call
                        .id
                        .filter(|id| !id.is_empty())
                        .unwrap_or_else(|| format!("call_{i}_{j}"));
                    if !ids.insert(id.clone()) {
                        return Err(OllamaError::bad_request(format!(
                            "messages[{i}].tool_calls[{j}].id: the id is given twice"
                        )));
                    }
                    let arguments = Value::Object(call.function.arguments.unwrap_or_default());
                    open.push((id.clone(), call.function.name.clone()));
                    turn.tool_calls.push(ToolCall {
                        id,
                        name: call.function.name,
                        arguments: arguments.to_string(),
                    });
                }
                turns.push(turn);
            }
            "tool" => {
                let at = match (&m.tool_call_id, &m.tool_name) {
                    (Some(id), _) => open.iter().position(|(c, _)| c == id),
                    (None, Some(name)) => open
                        .iter()
                        .position(|(_, n)| n == name)
                        .or((!open.is_empty()).then_some(0)),
                    (None, None) => (!open.is_empty()).then_some(0),
                };
                let Some(at) = at else {
                    return Err(OllamaError::bad_request(format!(
                        "messages[{i}]: a tool message must answer a tool call of an earlier assistant message"
                    )));
                };
                let (id, _) = open.remove(at);
                let mut turn = ChatMessage::new(ChatRole::Tool, content);
                turn.tool_call_id = Some(id);
                turns.push(turn);
            }
            _ => {
                return Err(OllamaError::bad_request(format!(
                    "messages[{i}].role: expected system, user, assistant or tool"
                )));
            }
        }
    }
    Ok((system, turns))
}

#[cfg(test)]
mod tests;
