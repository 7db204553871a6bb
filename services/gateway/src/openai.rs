//! OpenAI's Chat Completions dialect, so an OpenAI SDK or tool pointed at the gateway's base
//! URL (`http://host:port/v1`) reaches the text-completion processors over the bus.
//!
//! - `POST /v1/chat/completions`: a `chat.completion` object, or with `stream: true` SSE
//!   `chat.completion.chunk` events ending `data: [DONE]`; `stream_options.include_usage`
//!   adds the usage chunk.
//! - `GET /v1/models` and `GET /v1/models/{model}`: what the processors serve (their
//!   `list-models` answer).
//!
//! A conversation becomes sluice's request extension (`messages`, `temperature`,
//! `max_tokens`, `stop`, `model`; see `sluice_schema::TextCompletionRequest`), with the same
//! conversation flattened into `prompt` so a TrustGraph processor on the same topic still
//! answers sensibly. Tools (`tools`, `tool_choice`, `parallel_tool_calls`, assistant
//! `tool_calls` and `tool` messages) ride in the request's tool fields, and the answer's
//! tool calls come back as OpenAI sends them: streamed as `delta.tool_calls` pieces (index,
//! id, type and name on a call's first piece, argument fragments after), whole as
//! `message.tool_calls`, with `finish_reason: tool_calls`. What sluice cannot honour
//! (`n > 1`, images, `top_p`, the deprecated `functions`, ...) is refused with OpenAI's
//! error shape and status, never silently ignored. Unknown parameters are refused as OpenAI
//! refuses them.
//!
//! The event protocol (docs/specs.md#the-event-protocol) shares the path: a body with `prompt` and
//! no `messages` (the protocol's own test sends `{"prompt":"Hello","stream":true}`, which is not an
//! OpenAI chat request), or any body sent with `Accept: application/x-ndjson`, is answered as `POST
//! /api/v1/text-completion` answers it: `status`/`token`/`done` events when it streams, its errors
//! as `error` and `done` events.
//!
//! A streamed call answers its HTTP status only once the first record arrives, so an error
//! before the first token (429, a bad model, a provider refusal) is an HTTP error, as
//! OpenAI's own API does it; an error after that is an SSE `data: {"error": ...}` event and
//! the stream ends without `[DONE]`, which the OpenAI SDKs raise as an exception.

use std::{
    collections::VecDeque,
    convert::Infallible,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use axum::{
    Json,
    body::{Body, Bytes},
    extract::{Path, State, rejection::BytesRejection},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde_json::{Map, Value, json};
use sluice_runtime::{
    client::RequestOptions,
    reader::{Failure, OnRestart, Piece, ReadPolicy, Reader},
    telemetry::ClientOutcome,
};
use sluice_schema::{
    ChatMessage, ChatRole, Error, ErrorKind, LIST_MODELS, ModelInfo, ResponseRecord,
    TextCompletionRequest, TextCompletionResponse, Tool, ToolCall, ToolCallDelta, ToolChoice,
    ToolMode,
};

use crate::{
    Inner, Refusal,
    auth::Caller,
    client_error,
    http::{self, Ask, Mode},
    http_span,
    kinds::TextCompletion,
    preamble::{self, Call, Refused, Started, labelled},
    resume::{self, Numbering, Step},
    trace_outcome,
};

/// The metrics label of `POST /v1/chat/completions`.
pub(crate) const CHAT_ROUTE: &str = "openai-chat";
/// The metrics label of `GET /v1/models`.
pub(crate) const MODELS_ROUTE: &str = "openai-models";

/// How long a `list-models` answer is trusted when checking a request's `model`.
const MODELS_TTL: Duration = Duration::from_secs(10);
/// Silence on a stream longer than this gets an SSE comment, so proxies keep the connection.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
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

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<String>,
}

impl ApiError {
    pub(crate) fn invalid(
        message: impl Into<String>,
        param: Option<&str>,
        code: Option<&str>,
    ) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: code.map(str::to_owned),
        }
    }

    /// A refusal before any work (a check in front of every route): OpenAI's
    /// `invalid_request_error` with the gateway's error type as its code.
    pub(crate) fn refusal(status: StatusCode, message: &str, code: &str) -> Self {
        Self {
            status,
            message: message.to_owned(),
            kind: "invalid_request_error",
            param: None,
            code: Some(code.to_owned()),
        }
    }

    fn unsupported(param: &str, why: &str) -> Self {
        Self::invalid(
            format!("'{param}' is not supported by this server: {why}"),
            Some(param),
            Some("unsupported_parameter"),
        )
    }

    fn model_not_found(model: &str, served: &[String]) -> Self {
        let shown: String = model.chars().take(100).collect();
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model `{shown}` does not exist or you do not have access to it. This server serves: {}",
                served.join(", ")
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found".into()),
        }
    }

    /// The OpenAI error a sluice error record stands for. The code carries sluice's error
    /// type where OpenAI has no word of its own, so a caller can still tell them apart.
    pub(crate) fn from_error(e: &Error) -> Self {
        let (status, kind, code) = match &e.kind {
            ErrorKind::InvalidRequest => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            ErrorKind::MessageTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                Some("request_too_large"),
            ),
            ErrorKind::TooManyRequests => (
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                Some("rate_limit_exceeded"),
            ),
            ErrorKind::Timeout => (StatusCode::GATEWAY_TIMEOUT, "timeout", Some("timeout")),
            ErrorKind::Cancelled => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("cancelled"),
            ),
            ErrorKind::NoConfiguration | ErrorKind::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                Some(e.kind.as_str()),
            ),
            _ => (
                StatusCode::BAD_GATEWAY,
                "server_error",
                Some(e.kind.as_str()),
            ),
        };
        Self {
            status,
            message: e.message.clone(),
            kind,
            param: None,
            code: code.map(str::to_owned),
        }
    }

    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind,
                         "param": self.param, "code": self.code}})
    }
}

impl ApiError {
    /// An API key's refusal as OpenAI answers one: 429 `rate_limit_exceeded` with its type
    /// (`requests` or `tokens`) and `Retry-After`, or 403 `permission_denied`.
    pub(crate) fn refused(refusal: Refusal) -> Response {
        match refusal {
            Refusal::Forbidden(message) => ApiError {
                status: StatusCode::FORBIDDEN,
                message,
                kind: "invalid_request_error",
                param: None,
                code: Some("permission_denied".into()),
            }
            .into_response(),
            Refusal::Limited(l) => {
                let code = if l.quota {
                    "insufficient_quota"
                } else {
                    "rate_limit_exceeded"
                };
                let mut resp = ApiError {
                    status: StatusCode::TOO_MANY_REQUESTS,
                    message: l.message,
                    kind: l.what,
                    param: None,
                    code: Some(code.into()),
                }
                .into_response();
                http::retry_after(&mut resp, l.retry_after);
                resp
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status;
        let mut resp = (status, Json(self.body())).into_response();
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

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
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match part["type"].as_str() {
                    Some("text") => match part["text"].as_str() {
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
                        return Err(ApiError::invalid(
                            format!(
                                "content parts of type '{shown}' are not supported by this server; send text"
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
        _ => Err(ApiError::invalid(
            format!("Invalid type for '{at}': expected a string or an array of text parts."),
            Some(at),
            Some("invalid_type"),
        )),
    }
}

fn number(body: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
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

fn positive_integer(body: &Map<String, Value>, name: &str) -> Result<Option<u32>, ApiError> {
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
pub(crate) fn parse_chat(body: &[u8]) -> Result<ChatCall, ApiError> {
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
    if let Some(unknown) = body
        .keys()
        .find(|k| !KNOWN.contains(&k.as_str()) && !IGNORED.contains(&k.as_str()))
    {
        let shown: String = unknown.chars().take(60).collect();
        return Err(ApiError::invalid(
            format!("Unrecognized request argument supplied: {shown}"),
            None,
            None,
        ));
    }

    let model = match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "you must provide a model parameter",
                None,
                None,
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid 'model': expected a non-empty string.",
                Some("model"),
                Some("invalid_type"),
            ));
        }
    };

    // What sluice's processors cannot honour, refused by name. Defaults that change nothing
    // (`n: 1`, `top_p: 1`, penalties of 0, empty tool lists) pass.
    let present = |name: &str| body.get(name).is_some_and(|v| !v.is_null());
    if let Some(n) = body.get("n").filter(|v| !v.is_null())
        && n.as_u64() != Some(1)
    {
        return Err(ApiError::invalid(
            "'n' must be 1: this server returns one choice per request.",
            Some("n"),
            Some("unsupported_value"),
        ));
    }
    // The deprecated `functions` API: refused by name, `tools` says the same.
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
    let (tools, tool_choice, parallel_tool_calls) = parse_tools(&body)?;
    for (name, neutral) in [
        ("top_p", 1.0),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
    ] {
        if let Some(v) = number(&body, name)?
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

    let temperature = number(&body, "temperature")?;
    if let Some(t) = temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(ApiError::invalid(
            format!("Invalid 'temperature': expected a value from 0 to 2, but got {t} instead."),
            Some("temperature"),
            Some("invalid_value"),
        ));
    }
    let max_tokens = match positive_integer(&body, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => positive_integer(&body, "max_tokens")?,
    };
    let stop = match body.get("stop") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(vec![s.clone()]),
        Some(Value::Array(a))
            if a.len() <= MAX_STOP
                && a.iter().all(|s| s.as_str().is_some_and(|s| !s.is_empty())) =>
        {
            let stops: Vec<String> = a
                .iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect();
            (!stops.is_empty()).then_some(stops)
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("Invalid 'stop': expected a non-empty string or up to {MAX_STOP} of them."),
                Some("stop"),
                Some("invalid_value"),
            ));
        }
    };
    let (response_format, schema) = match body.get("response_format") {
        None | Some(Value::Null) => (None, None),
        Some(f) => match f["type"].as_str() {
            Some("text") => (None, None),
            Some("json_object") => (Some("json".to_owned()), None),
            Some("json_schema") => match f["json_schema"]["schema"].clone() {
                Value::Object(s) => (Some("json".to_owned()), Some(Value::Object(s))),
                _ => {
                    return Err(ApiError::invalid(
                        "Missing required parameter: 'response_format.json_schema.schema'.",
                        Some("response_format.json_schema.schema"),
                        Some("missing_required_parameter"),
                    ));
                }
            },
            _ => {
                return Err(ApiError::invalid(
                    "Invalid 'response_format.type': expected 'text', 'json_object' or 'json_schema'.",
                    Some("response_format.type"),
                    Some("invalid_value"),
                ));
            }
        },
    };

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
            "tool" => {
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
                turns.push(turn);
            }
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

/// The most tools one request may offer (OpenAI's limit).
const MAX_TOOLS: usize = 128;

/// `tools`, `tool_choice` and `parallel_tool_calls`, checked as OpenAI checks them: function
/// tools only, names of its pattern and unique, a choice naming one of them, and no
/// `required` or named choice without tools (`auto`, `none` and `parallel_tool_calls` with
/// no tools change nothing and pass, as clients send them by default).
#[allow(clippy::type_complexity)]
fn parse_tools(
    body: &Map<String, Value>,
) -> Result<(Option<Vec<Tool>>, Option<ToolChoice>, Option<bool>), ApiError> {
    let mut tools = Vec::new();
    match body.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
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
            for (i, t) in list.iter().enumerate() {
                let at = format!("tools[{i}]");
                match t["type"].as_str() {
                    Some("function") => {}
                    Some(_) => {
                        return Err(ApiError::unsupported(
                            &format!("{at}.type"),
                            "only function tools are supported",
                        ));
                    }
                    None => {
                        return Err(ApiError::invalid(
                            format!("Missing required parameter: '{at}.type'."),
                            Some(&format!("{at}.type")),
                            Some("missing_required_parameter"),
                        ));
                    }
                }
                let f = &t["function"];
                let Some(name) = f["name"].as_str() else {
                    return Err(ApiError::invalid(
                        format!("Missing required parameter: '{at}.function.name'."),
                        Some(&format!("{at}.function.name")),
                        Some("missing_required_parameter"),
                    ));
                };
                if !sluice_schema::tools::valid_name(name) {
                    return Err(ApiError::invalid(
                        format!(
                            "Invalid '{at}.function.name': string does not match pattern. Expected a string that matches the pattern '^[a-zA-Z0-9_-]{{1,64}}$'."
                        ),
                        Some(&format!("{at}.function.name")),
                        Some("invalid_value"),
                    ));
                }
                if tools.iter().any(|t: &Tool| t.name == name) {
                    return Err(ApiError::invalid(
                        format!("Invalid 'tools': the name '{name}' is given twice."),
                        Some(&format!("{at}.function.name")),
                        Some("invalid_value"),
                    ));
                }
                let parameters = match &f["parameters"] {
                    Value::Null => sluice_schema::tools::no_parameters(),
                    Value::Object(p) => Value::Object(p.clone()),
                    _ => {
                        return Err(ApiError::invalid(
                            format!(
                                "Invalid type for '{at}.function.parameters': expected an object."
                            ),
                            Some(&format!("{at}.function.parameters")),
                            Some("invalid_type"),
                        ));
                    }
                };
                tools.push(Tool {
                    name: name.to_owned(),
                    description: f["description"].as_str().map(str::to_owned),
                    parameters,
                    strict: f["strict"].as_bool(),
                });
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'tools': expected an array of tools.",
                Some("tools"),
                Some("invalid_type"),
            ));
        }
    }
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

/// A record's tool-call pieces as OpenAI streams them: the first piece of a call with its
/// `id`, `type` and `name` (and `arguments`, often empty), later ones with an argument
/// fragment only.
fn tool_call_delta(piece: &ToolCallDelta) -> Value {
    let mut function = json!({"arguments": piece.arguments});
    if piece.id.is_some() || piece.name.is_some() {
        function["name"] = json!(piece.name.as_deref().unwrap_or(""));
        json!({"index": piece.index, "id": piece.id.as_deref().unwrap_or(""),
               "type": "function", "function": function})
    } else {
        json!({"index": piece.index, "function": function})
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl ApiError {
    /// No accepted credential, as OpenAI says it.
    pub(crate) fn unauthorized() -> Self {
        ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: "Incorrect API key provided. Send the gateway's token as `Authorization: Bearer <token>` (the OpenAI SDKs send their api_key so).".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key".into()),
        }
    }

    /// A body the server could not read (`status` 413: over the limit), with the reader's
    /// text.
    pub(crate) fn body_rejected(inner: &Inner, status: StatusCode, text: String) -> Self {
        if status != StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::invalid(text, None, None);
        }
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "The request body is larger than this server's limit of {} bytes.",
                inner.config.body_limit
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large".into()),
        }
    }
}

/// The models the text-completion processors serve, from a fresh `list-models` request
/// (which also refreshes the cache the chat route checks `model` against).
async fn fetch_models(inner: &Inner) -> Result<Vec<ModelInfo>, ApiError> {
    let Some(client) = inner.clients.text_completion.as_ref() else {
        return Err(ApiError::not_enabled());
    };
    let request = TextCompletionRequest {
        operation: Some(LIST_MODELS.into()),
        ..TextCompletionRequest::default()
    };
    let unanswered = |f: Failure<TextCompletionResponse>| ApiError::from_error(&f.error);
    let record = client
        .read(&request, RequestOptions::default(), chat_policy())
        .await
        .map_err(unanswered)?
        .last()
        .await
        .map_err(unanswered)?;
    let ids: Vec<String> = record.models.iter().map(|m| m.id.clone()).collect();
    *inner.models.lock().await = Some((Instant::now(), ids));
    Ok(record.models)
}

/// The served model ids, from the cache when it is younger than [`MODELS_TTL`].
async fn served_models(inner: &Inner) -> Result<Vec<String>, ApiError> {
    if let Some((at, ids)) = inner.models.lock().await.as_ref()
        && at.elapsed() < MODELS_TTL
    {
        return Ok(ids.clone());
    }
    Ok(fetch_models(inner)
        .await?
        .into_iter()
        .map(|m| m.id)
        .collect())
}

impl ApiError {
    /// The text-completion service is not enabled on this gateway.
    pub(crate) fn not_enabled() -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: "the text-completion service is not enabled on this gateway".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("no-configuration".into()),
        }
    }
}

fn model_object(m: &ModelInfo) -> Value {
    json!({"id": m.id, "object": "model", "created": 0,
           "owned_by": m.owned_by.as_deref().unwrap_or("sluice")})
}

/// `GET /v1/models`.
pub(crate) async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    if !inner.config.auth.accepts_headers(&headers) {
        return labelled(MODELS_ROUTE, Refused::Unauthorized.openai(&inner));
    }
    let resp = match fetch_models(&inner).await {
        Ok(models) => Json(json!({
            "object": "list",
            "data": models.iter().map(model_object).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    };
    labelled(MODELS_ROUTE, resp)
}

/// `GET /v1/models/{model}`.
pub(crate) async fn model(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !inner.config.auth.accepts_headers(&headers) {
        return labelled(MODELS_ROUTE, Refused::Unauthorized.openai(&inner));
    }
    let resp = match fetch_models(&inner).await {
        Ok(models) => match models.iter().find(|m| m.id == id) {
            Some(m) => Json(model_object(m)).into_response(),
            None => {
                let ids: Vec<String> = models.into_iter().map(|m| m.id).collect();
                ApiError::model_not_found(&id, &ids).into_response()
            }
        },
        Err(e) => e.into_response(),
    };
    labelled(MODELS_ROUTE, resp)
}

/// Any other method or path under `/v1`: OpenAI's own answer to a URL it does not serve, so
/// an SDK calling, say, embeddings gets an error it can read.
pub(crate) async fn invalid_url(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let path: String = uri.path().chars().take(200).collect();
    let status = if matches!(path.as_str(), "/v1/chat/completions" | "/v1/models") {
        StatusCode::METHOD_NOT_ALLOWED
    } else {
        StatusCode::NOT_FOUND
    };
    let mut e = ApiError::invalid(format!("Invalid URL ({method} {path})"), None, None);
    e.status = status;
    e.into_response()
}

/// Usage summed over a stream's records (they carry deltas), as OpenAI's `usage` object.
#[derive(Debug, Default, Clone, Copy)]
struct Tokens {
    input: u64,
    output: u64,
}

impl Tokens {
    fn add(&mut self, r: &TextCompletionResponse) {
        self.input = self.input.saturating_add(r.in_token.unwrap_or(0));
        self.output = self.output.saturating_add(r.out_token.unwrap_or(0));
    }

    fn usage(self) -> Value {
        json!({"prompt_tokens": self.input, "completion_tokens": self.output,
               "total_tokens": self.input.saturating_add(self.output)})
    }
}

/// The top-level fields of a chat body that tell the event protocol's requests from OpenAI's.
#[derive(Clone, Copy, Default, serde::Deserialize)]
struct EventProtocolFields {
    #[serde(default)]
    prompt: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    messages: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    streaming: Option<bool>,
}

impl EventProtocolFields {
    fn of(body: &[u8]) -> Self {
        serde_json::from_slice(body).unwrap_or_default()
    }

    /// Not an OpenAI chat request: a `prompt` and no `messages` (the event protocol's own body).
    fn prompt_only(body: &[u8]) -> bool {
        let fields = Self::of(body);
        fields.prompt.is_some() && fields.messages.is_none()
    }
}

/// Answers a `/v1/chat/completions` call in the event protocol's events, as `POST
/// /api/v1/text-completion` answers it. The body's fields are read once, here: whether it
/// streams (known before it is decoded, so a refusal comes as the events asked for) and how
/// it is decoded.
async fn seed_004(
    inner: Arc<Inner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    accept: Option<Mode>,
) -> Response {
    let fields = body
        .as_ref()
        .map(|b| EventProtocolFields::of(b))
        .unwrap_or_default();
    let streams = fields.stream.or(fields.streaming).unwrap_or(false);
    let ask = Ask {
        accept: accept.or(streams.then_some(Mode::Ndjson)),
        streamed: Mode::Ndjson,
        steps: false,
    };
    http::handle::<TextCompletion>(inner, headers, body, ask, |b| {
        event_protocol_request(b, fields)
    })
    .await
}

/// An event-protocol body as a text-completion request: `prompt` (and `system`) as the REST route
/// reads them, `stream` as `streaming`; an OpenAI conversation (`messages`) as the OpenAI
/// route reads it.
fn event_protocol_request(
    body: &Bytes,
    fields: EventProtocolFields,
) -> Result<TextCompletionRequest, String> {
    if fields.messages.is_some() {
        let call = parse_chat(body).map_err(|e| e.message)?;
        let mut request = call.request;
        request.streaming = call.stream;
        return Ok(request);
    }
    let mut request: TextCompletionRequest = http::record(body)?;
    if fields.stream == Some(true) {
        request.streaming = true;
    }
    Ok(request)
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    // The event protocol's requests: asked for by the header, or a body the OpenAI dialect refuses
    // (no `messages`) that is the event protocol's. Its fields are read only then, so an OpenAI
    // request pays for no second reading of its body.
    let accept = http::accepted(&headers);
    if accept == Some(Mode::Ndjson) {
        return seed_004(inner, headers, body, accept).await;
    }
    let Some(caller) = inner.config.auth.caller_of(&headers) else {
        if body
            .as_ref()
            .is_ok_and(|b| EventProtocolFields::prompt_only(b))
        {
            return seed_004(inner, headers, body, accept).await;
        }
        return labelled(CHAT_ROUTE, Refused::Unauthorized.openai(&inner));
    };
    let body = match body {
        Ok(b) => b,
        Err(rejection) => return labelled(CHAT_ROUTE, Refused::body(&rejection).openai(&inner)),
    };
    let call = match parse_chat(&body) {
        Ok(c) => c,
        Err(_) if EventProtocolFields::prompt_only(&body) => {
            return seed_004(inner, headers, Ok(body), accept).await;
        }
        Err(e) => return labelled(CHAT_ROUTE, e.into_response()),
    };
    let body_bytes = body.len();
    labelled(
        CHAT_ROUTE,
        complete(inner, headers, caller, call, body_bytes).await,
    )
}

/// Answers a chat call as OpenAI does: the model checked against those served, then
/// [`preamble::start`], then a whole `chat.completion` or its stream of chunks.
async fn complete(
    inner: Arc<Inner>,
    headers: HeaderMap,
    caller: Caller,
    call: ChatCall,
    body_bytes: usize,
) -> Response {
    let started = Instant::now();
    match served_models(&inner).await {
        Ok(ids) if ids.contains(&call.model) => {}
        Ok(ids) => return ApiError::model_not_found(&call.model, &ids).into_response(),
        Err(e) => return e.into_response(),
    }
    let incoming = headers.get("traceparent").and_then(|v| v.to_str().ok());
    let mut span = http_span("POST", "/v1/chat/completions", incoming);
    span.set("gen_ai.request.model", call.model.clone());
    let start = Call::<TextCompletion> {
        inner: &inner,
        headers: &headers,
        caller: &caller,
        request: &call.request,
        body_bytes,
        route: CHAT_ROUTE,
        span,
        token_trace: None,
        policy: chat_policy(),
        resumable_route: true,
    };
    let Started {
        mut reader,
        mut span,
        request_id,
        resume,
        numbering,
    } = match preamble::start::<TextCompletion>(start).await {
        Ok(s) => s,
        Err(refused) => return refused.openai(&inner),
    };
    // The request's id names the completion (`chatcmpl-<id>`): the same again when resumed.
    let id = match uuid::Uuid::parse_str(&request_id) {
        Ok(u) => format!("chatcmpl-{}", u.simple()),
        Err(_) => format!("chatcmpl-{request_id}"),
    };
    let created = match &resume {
        Some(r) => r.token.created,
        None => now_secs(),
    };
    if !call.stream {
        let resp = match whole(reader).await {
            Ok(answer) => {
                // As OpenAI: `content` null when the answer is only tool calls, and
                // `tool_calls` only when there are some.
                let mut message =
                    json!({"role": "assistant", "content": answer.text, "refusal": null});
                if !answer.tool_calls.is_empty() {
                    if answer.text.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = answer
                        .tool_calls
                        .iter()
                        .map(sluice_schema::tools::openai_call)
                        .collect();
                }
                Json(json!({
                    "id": id,
                    "object": "chat.completion",
                    "created": created,
                    "model": answer.model.unwrap_or(call.model),
                    "choices": [{
                        "index": 0,
                        "message": message,
                        "logprobs": null,
                        "finish_reason": answer.finish_reason.unwrap_or_else(|| "stop".into()),
                    }],
                    "usage": answer.tokens.usage(),
                    "system_fingerprint": null,
                }))
                .into_response()
            }
            Err(e) => e.into_response(),
        };
        if !resp.status().is_success() {
            span.fail(resp.status().as_str().to_owned());
        }
        span.end();
        let mut resp = resp;
        request_id_header(&mut resp, &id);
        return resp;
    }

    // Streaming: wait for the first record that says something, so an early failure is an
    // HTTP error with its proper status.
    let mut tokens = Tokens::default();
    let first = loop {
        match reader.next().await {
            Some(Piece::Record(r)) => {
                tokens.add(&r);
                if !r.response.is_empty() || !r.tool_calls.is_empty() || r.is_terminal() {
                    break r;
                }
            }
            // Nothing was sent yet, so the new attempt simply starts the answer.
            Some(Piece::Restarted) => tokens = Tokens::default(),
            Some(Piece::Failed(f)) => {
                let err = ApiError::from_error(&f.error);
                span.fail(err.status.as_str().to_owned());
                return err.into_response();
            }
            None => {
                let err = ApiError::from_error(&Error::new(
                    ErrorKind::Gateway,
                    "the answer ended without a final record",
                ));
                span.fail("502");
                return err.into_response();
            }
        }
    };
    inner
        .metrics
        .first_event(CHAT_ROUTE, started.elapsed().as_secs_f64());
    inner.metrics.open_streams(CHAT_ROUTE, 1);
    // From here the answer is on its way to the caller: a restart ends it (see chat_policy).
    reader.commit();
    let mut chunks = ChunkStream {
        reader: Some(reader),
        pending: VecDeque::new(),
        model: first.model.clone().unwrap_or_else(|| call.model.clone()),
        id: id.clone(),
        created,
        include_usage: call.include_usage,
        tokens,
        outcome: None,
        inner: inner.clone(),
        span,
        numbering,
    };
    let token = chunks.numbering.token().map(str::to_owned);
    // As OpenAI: `content` null on the first chunk of an answer that starts with a tool call.
    let content = if first.response.is_empty() && !first.tool_calls.is_empty() {
        None
    } else {
        Some("")
    };
    let role = Delta {
        content: Some(content),
        role: Some("assistant"),
        ..Delta::default()
    };
    chunks.push_chunk(role, None);
    chunks.take(first);
    let body = futures::stream::unfold(chunks, |mut s| async move {
        s.next_bytes().await.map(|b| (Ok::<_, Infallible>(b), s))
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, no-transform"),
    );
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    request_id_header(&mut resp, &id);
    resume::token_header(&mut resp, token.as_deref());
    resp
}

fn request_id_header(resp: &mut Response, id: &str) {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert("x-request-id", v);
    }
}

/// A restart after the answer's first chunk went out: OpenAI's stream has no way to take back
/// the text already sent, so the caller learns the answer broke and may send it again.
fn mid_answer_restart() -> Error {
    Error::new(
        ErrorKind::Gateway,
        "the processor answering this request went away mid-answer and another started it \
         over; the text so far is incomplete, send the request again",
    )
}

/// How the OpenAI routes read text-completion's answers: a restart starts the answer over
/// until its first chunk went out (`Reader::commit`), and ends it after that.
fn chat_policy() -> ReadPolicy {
    ReadPolicy {
        on_restart: OnRestart::StartOver(mid_answer_restart()),
        client_error,
    }
}

/// A whole answer as the route returns it.
struct WholeAnswer {
    text: String,
    tool_calls: Vec<ToolCall>,
    tokens: Tokens,
    finish_reason: Option<String>,
    model: Option<String>,
}

/// Reads a whole answer: its text, tool calls, usage, finish reason and model, or the error.
async fn whole(reader: Reader<TextCompletionResponse>) -> Result<WholeAnswer, ApiError> {
    // The records of the final attempt: a restart before the end costs nothing here.
    let records = reader
        .collect()
        .await
        .map_err(|f| ApiError::from_error(&f.error))?;
    let mut text = String::new();
    let mut pieces = Vec::new();
    let mut tokens = Tokens::default();
    let mut model = None;
    for r in records {
        tokens.add(&r);
        text.push_str(&r.response);
        pieces.extend(r.tool_calls.iter().cloned());
        if r.model.is_some() {
            model.clone_from(&r.model);
        }
        if r.is_terminal() {
            return Ok(WholeAnswer {
                text,
                tool_calls: sluice_schema::tools::assemble(&pieces),
                tokens,
                finish_reason: r.finish_reason,
                model,
            });
        }
    }
    Err(ApiError::from_error(&Error::new(
        ErrorKind::Gateway,
        "the answer ended without a final record",
    )))
}

/// One streamed answer: records in, SSE `chat.completion.chunk` events out.
struct ChunkStream {
    reader: Option<Reader<TextCompletionResponse>>,
    pending: VecDeque<Bytes>,
    model: String,
    id: String,
    created: u64,
    include_usage: bool,
    tokens: Tokens,
    outcome: Option<ClientOutcome>,
    inner: Arc<Inner>,
    span: sluice_runtime::trace::Span,
    /// Each event's id, and what a resuming caller had (see [`crate::resume`]).
    numbering: Numbering,
}

/// A `chat.completion.chunk` as the stream sends it, serialized straight from borrowed fields:
/// a chunk per token is on every stream's path, and building a `serde_json::Value` and
/// printing it through `Display` cost five times the instructions. The fields are in the
/// order `json!` printed them before (serde_json's maps are sorted), so the bytes are the same.
#[derive(serde::Serialize)]
struct Chunk<'a> {
    choices: [Choice<'a>; 1],
    created: u64,
    id: &'a str,
    model: &'a str,
    object: &'static str,
    system_fingerprint: Option<&'static str>,
    /// `null` on every chunk of a stream asked for its usage, absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<&'static str>>,
}

#[derive(serde::Serialize)]
struct Choice<'a> {
    delta: Delta<'a>,
    finish_reason: Option<&'a str>,
    index: u32,
    logprobs: Option<&'static str>,
}

/// What a chunk adds to the answer; absent fields are not sent.
#[derive(Default, serde::Serialize)]
struct Delta<'a> {
    /// `Some(None)` is `"content": null` (the first chunk of an answer that starts with a
    /// tool call).
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[Value; 1]>,
}

/// `data: <json>\n\n`, the SSE event of one JSON value.
fn sse_data(v: &impl serde::Serialize) -> Vec<u8> {
    let mut event = Vec::with_capacity(320);
    event.extend_from_slice(b"data: ");
    // Serializing these types cannot fail: no map has keys that are not strings.
    let _ = serde_json::to_writer(&mut event, v);
    event.extend_from_slice(b"\n\n");
    event
}

impl ChunkStream {
    fn push_data(&mut self, v: &impl serde::Serialize) {
        self.push_event(sse_data(v));
    }

    /// Queues one SSE event (`data: ...\n\n`) under its id, unless the caller had it.
    fn push_event(&mut self, event: Vec<u8>) {
        match self.numbering.step() {
            Step::Skip => {}
            Step::Send(None) => self.pending.push_back(Bytes::from(event)),
            Step::Send(Some(id)) => {
                let mut numbered = format!("id: {id}\n").into_bytes();
                numbered.extend_from_slice(&event);
                self.pending.push_back(Bytes::from(numbered));
            }
        }
    }

    /// A chunk with one choice carrying `delta`. With `include_usage`, every chunk but the
    /// last carries `"usage": null`, as OpenAI's do.
    fn push_chunk(&mut self, delta: Delta<'_>, finish: Option<&str>) {
        let event = sse_data(&Chunk {
            choices: [Choice {
                delta,
                finish_reason: finish,
                index: 0,
                logprobs: None,
            }],
            created: self.created,
            id: &self.id,
            model: &self.model,
            object: "chat.completion.chunk",
            system_fingerprint: None,
            usage: self.include_usage.then_some(None),
        });
        self.push_event(event);
    }

    /// Turns a non-error record into chunks; the terminal one ends the stream.
    fn take(&mut self, r: TextCompletionResponse) {
        if !r.response.is_empty() {
            let delta = Delta {
                content: Some(Some(&r.response)),
                ..Delta::default()
            };
            self.push_chunk(delta, None);
        }
        // One piece per chunk, as OpenAI sends them.
        for piece in &r.tool_calls {
            let delta = Delta {
                tool_calls: Some([tool_call_delta(piece)]),
                ..Delta::default()
            };
            self.push_chunk(delta, None);
        }
        if r.is_terminal() {
            let finish = r.finish_reason.as_deref().unwrap_or("stop");
            self.push_chunk(Delta::default(), Some(finish));
            if self.include_usage {
                let usage = json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "system_fingerprint": null,
                    "choices": [], "usage": self.tokens.usage(),
                });
                self.push_data(&usage);
            }
            self.push_event(b"data: [DONE]\n\n".to_vec());
            self.outcome = Some(ClientOutcome::Success);
            self.reader = None;
        }
    }

    /// An error after the stream started: one `data: {"error": ...}` event, then the end
    /// (no `[DONE]`), which the OpenAI SDKs raise as an API error.
    fn fail(&mut self, e: &Error) {
        let err = ApiError::from_error(e);
        self.push_data(&err.body());
        self.outcome = Some(ClientOutcome::of_error(&e.kind));
        self.reader = None;
    }

    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return Some(b);
            }
            let reader = self.reader.as_mut()?;
            let piece = match tokio::time::timeout(KEEP_ALIVE, reader.next()).await {
                Ok(item) => item,
                // An SSE comment: clients skip it, proxies see traffic.
                Err(_) => return Some(Bytes::from_static(b": keep-alive\n\n")),
            };
            match piece {
                Some(Piece::Record(r)) => {
                    self.tokens.add(&r);
                    self.take(r);
                }
                Some(Piece::Failed(f)) => self.fail(&f.error),
                // Not given once committed (see chat_policy).
                Some(Piece::Restarted) => self.fail(&mid_answer_restart()),
                None => self.fail(&Error::new(
                    ErrorKind::Gateway,
                    "the answer ended without a final record",
                )),
            }
        }
    }
}

impl Drop for ChunkStream {
    fn drop(&mut self) {
        self.inner.metrics.open_streams(CHAT_ROUTE, -1);
        // Dropped before its end: the caller went away; the response stream's own drop
        // publishes the cancel.
        let outcome = match self.outcome {
            Some(o) if self.pending.is_empty() => o,
            _ => ClientOutcome::Cancelled,
        };
        self.inner.metrics.stream_ended(CHAT_ROUTE, outcome);
        trace_outcome(&mut self.span, outcome);
    }
}

#[cfg(test)]
mod tests {
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

    /// Streamed pieces become OpenAI's `delta.tool_calls`: the first of a call with its id,
    /// type and name, the rest with argument fragments only.
    #[test]
    fn tool_call_pieces_are_written_as_openai_streams_them() {
        let first = tool_call_delta(&ToolCallDelta {
            index: 1,
            id: Some("call_9".into()),
            name: Some("f".into()),
            arguments: String::new(),
        });
        assert_eq!(
            first,
            json!({"index": 1, "id": "call_9", "type": "function",
                   "function": {"name": "f", "arguments": ""}})
        );
        let more = tool_call_delta(&ToolCallDelta {
            index: 1,
            arguments: "{\"a\"".into(),
            ..Default::default()
        });
        assert_eq!(
            more,
            json!({"index": 1, "function": {"arguments": "{\"a\""}})
        );
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

    #[test]
    fn sluice_errors_map_to_openai_statuses() {
        let s = |k| ApiError::from_error(&Error::new(k, "m")).status;
        assert_eq!(s(ErrorKind::TooManyRequests), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(s(ErrorKind::InvalidRequest), StatusCode::BAD_REQUEST);
        assert_eq!(s(ErrorKind::Timeout), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(s(ErrorKind::Llm), StatusCode::BAD_GATEWAY);
        let e = ApiError::from_error(&Error::new(ErrorKind::Llm, "m"));
        assert_eq!(e.code.as_deref(), Some("llm-error"));
    }
}
