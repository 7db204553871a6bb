//! Ollama's native API, so Ollama's clients (its Python and JavaScript libraries, and tools
//! given `http://host:port` as their Ollama host) reach the text-completion processors over
//! the bus, whichever provider answers.
//!
//! - `POST /api/chat` and `POST /api/generate`: streamed unless the body says `"stream":
//!   false`, as Ollama does: NDJSON objects (`message` or `response` pieces, `done: false`),
//!   then one `done: true` object with `done_reason` and the token counts. Whole, one such
//!   object with the whole answer.
//! - `GET /api/tags`, `POST /api/show`: the models the processors serve (`list-models`).
//! - `GET /api/version`: the Ollama API version this route follows.
//!
//! A route is decode ([`parse`]) -> [`preamble::start`] (credentials, keys and limits, the
//! request on the bus) -> encode ([`crate::encode::lines::Lines`], driven by the runtime's
//! driver). Errors are Ollama's `{"error": "..."}`: an HTTP error while nothing was sent (the
//! status is sent with the first line), one `{"error": ...}` line after that, which Ollama's
//! clients raise. A caller that goes away drops the stream, which cancels the provider call.
//! This module never logs a body: bodies carry prompts.

mod parse;

use std::{
    sync::Arc,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use axum::{
    Json,
    body::Bytes,
    extract::{State, rejection::BytesRejection},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sluice_runtime::reader::StartOver;
use sluice_schema::{Error, TextCompletionResponse};

pub(crate) use self::parse::OllamaCall;
use self::parse::{parse_chat, parse_generate};
use crate::{
    Inner, Refusal,
    auth::Caller,
    encode::{
        Tally,
        chunks::Tokens,
        lines::{Lines, Shape},
    },
    http::{retry_after, status_for},
    openai::{self, ApiError},
    preamble::{self, DialectRoute, Refused, Started, labelled},
};

/// The metrics label of `POST /api/chat`.
pub(crate) const CHAT_ROUTE: &str = "ollama-chat";
/// The metrics label of `POST /api/generate`.
pub(crate) const GENERATE_ROUTE: &str = "ollama-generate";
/// The metrics label of `GET /api/tags`, `POST /api/show` and `GET /api/version`.
pub(crate) const MODELS_ROUTE: &str = "ollama-models";

/// The paths of Ollama's API that the gateway serves.
const PATHS: [&str; 5] = [
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/version",
];

/// Whether `path` is one of Ollama's routes: a refusal in front of it is in Ollama's shape.
pub(crate) fn serves(path: &str) -> bool {
    PATHS.contains(&path)
}

/// The Ollama release whose API these routes follow (the one the tested `ollama` Python
/// client, 0.6, was released against), for tools that check it before calling.
const OLLAMA_API_VERSION: &str = "0.12.0";

/// An error in Ollama's shape, `{"error": "..."}`, with its status.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OllamaError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    /// `Retry-After`, in whole seconds (a limit's refusal).
    retry_after: Option<u64>,
}

impl OllamaError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    /// A body Ollama would not read: 400.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A model the processors do not serve: 404, as Ollama answers a model it has not pulled.
    fn model_not_found(model: &str) -> Self {
        let shown: String = model.chars().take(100).collect();
        Self::new(StatusCode::NOT_FOUND, format!("model '{shown}' not found"))
    }

    /// A sluice error record's: its message, under the status its type maps to (the
    /// gateway's own mapping, as on its REST routes).
    pub(crate) fn from_error(e: &Error) -> Self {
        Self::new(status_for(&e.kind), e.message.clone())
    }

    /// The NDJSON line of a stream that fails after it started.
    pub(crate) fn line(&self) -> Vec<u8> {
        let mut line = json!({"error": self.message}).to_string().into_bytes();
        line.push(b'\n');
        line
    }

    /// What an OpenAI-shaped error of the shared model lookup says, in Ollama's shape.
    fn of_api(e: ApiError) -> Self {
        Self::new(e.status, e.message)
    }

    /// A refusal of the preamble, in Ollama's shape (Ollama itself has no keys: its hosted
    /// API answers `{"error": "unauthorized"}` with 401, and so does this route).
    fn refused(refused: Refused, inner: &Inner) -> Self {
        match refused {
            Refused::Unauthorized => Self::new(StatusCode::UNAUTHORIZED, "unauthorized"),
            Refused::Body { status, .. } if status == StatusCode::PAYLOAD_TOO_LARGE => Self::new(
                status,
                format!(
                    "the request body is larger than the limit of {} bytes",
                    inner.config.body_limit
                ),
            ),
            Refused::Body { text, .. } => Self::bad_request(text),
            Refused::Invalid(why) => Self::bad_request(why),
            Refused::NotEnabled(service) => Self::new(
                StatusCode::NOT_FOUND,
                format!("the {service} service is not enabled on this gateway"),
            ),
            Refused::Resume((status, _, message)) => Self::new(status, message),
            Refused::Key(Refusal::Forbidden(why)) => Self::new(StatusCode::FORBIDDEN, why),
            Refused::Key(Refusal::Limited(l)) => Self {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: l.message,
                retry_after: l.retry_after,
            },
            Refused::Unsent(e) => Self::new(StatusCode::SERVICE_UNAVAILABLE, e.message),
        }
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(json!({"error": self.message}))).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        retry_after(&mut resp, self.retry_after);
        resp
    }
}

/// `created_at` as Ollama writes it: RFC 3339 in UTC with nanoseconds.
pub(crate) fn created_at(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (year, month, day) = crate::limits::civil_from_days(secs / 86_400);
    let rem = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_nanos()
    )
}

/// `POST /api/chat`.
pub(crate) async fn chat(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let route = Route {
        label: CHAT_ROUTE,
        path: "/api/chat",
        shape: Shape::Chat,
    };
    labelled(CHAT_ROUTE, serve(inner, headers, body, route).await)
}

/// `POST /api/generate`.
pub(crate) async fn generate(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let route = Route {
        label: GENERATE_ROUTE,
        path: "/api/generate",
        shape: Shape::Generate,
    };
    labelled(GENERATE_ROUTE, serve(inner, headers, body, route).await)
}

/// Which of the two generating routes is served.
#[derive(Clone, Copy)]
struct Route {
    label: &'static str,
    path: &'static str,
    shape: Shape,
}

/// Decode, the model checked against those served, [`preamble::start`], then the answer
/// streamed or whole. Every refusal is an [`OllamaError`].
async fn serve(
    inner: Arc<Inner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    route: Route,
) -> Response {
    let started = Instant::now();
    let Some(caller) = inner.config.auth.caller_of(&headers) else {
        return OllamaError::refused(Refused::Unauthorized, &inner).into_response();
    };
    let body = match body {
        Ok(b) => b,
        Err(rejection) => {
            return OllamaError::refused(Refused::body(&rejection), &inner).into_response();
        }
    };
    let parsed = match route.shape {
        Shape::Chat => parse_chat(&body),
        Shape::Generate => parse_generate(&body),
    };
    let mut call = match parsed {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let served = match served_model(&inner, &call.model).await {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    if call.load_only {
        return loaded(&call, route.shape);
    }
    call.request.model = Some(served);
    match answer(&inner, &headers, &caller, call, body.len(), route, started).await {
        Ok(resp) | Err(resp) => resp,
    }
}

/// The model the processors serve under `asked`: the name itself, or the name without
/// Ollama's default `:latest` tag (Ollama's clients often add it).
async fn served_model(inner: &Inner, asked: &str) -> Result<String, OllamaError> {
    let ids = openai::served_models(inner)
        .await
        .map_err(OllamaError::of_api)?;
    let untagged = asked.strip_suffix(":latest").unwrap_or(asked);
    [asked, untagged]
        .into_iter()
        .find(|m| ids.iter().any(|id| id == m))
        .map(str::to_owned)
        .ok_or_else(|| OllamaError::model_not_found(asked))
}

/// Ollama's answer to a request with nothing to generate: the model is loaded (or, asked with
/// `keep_alive: 0`, unloaded), `done`. The processors' models are theirs to keep: nothing is
/// sent.
fn loaded(call: &OllamaCall, shape: Shape) -> Response {
    let mut v = json!({"model": call.model, "created_at": created_at(SystemTime::now())});
    match shape {
        Shape::Chat => v["message"] = json!({"role": "assistant", "content": ""}),
        Shape::Generate => v["response"] = json!(""),
    }
    v["done_reason"] = json!(if call.unload { "unload" } else { "load" });
    v["done"] = json!(true);
    Json(v).into_response()
}

/// Sends the request through [`preamble::start`] and answers it; a refusal as `Err`.
async fn answer(
    inner: &Arc<Inner>,
    headers: &HeaderMap,
    caller: &Caller,
    call: OllamaCall,
    body_bytes: usize,
    route: Route,
    started: Instant,
) -> Result<Response, Response> {
    // NDJSON lines carry no ids to resume from.
    let start = DialectRoute {
        label: route.label,
        path: route.path,
    }
    .call(
        inner,
        headers,
        caller,
        &call.request,
        body_bytes,
        &call.model,
    );
    let started_call = preamble::start(start)
        .await
        .map_err(|r| OllamaError::refused(r, inner).into_response())?;
    if call.stream {
        stream(inner, call, started_call, route, started).await
    } else {
        Ok(whole(call, started_call, route.shape, started).await)
    }
}

/// The answer as NDJSON lines once a record says something, so that an early failure is an
/// HTTP error with its status, as Ollama answers one.
async fn stream(
    inner: &Arc<Inner>,
    call: OllamaCall,
    started_call: Started<TextCompletionResponse, StartOver>,
    route: Route,
    started: Instant,
) -> Result<Response, Response> {
    let Started { reader, span, .. } = started_call;
    let tally = Tally::new(inner.clone(), route.label, started, span);
    let lines = Lines::new(route.shape, call.model, started, tally);
    let mut driven = reader.drive(lines).start().await.map_err(|refused| {
        refused
            .unwrap_or_else(|| OllamaError::from_error(&preamble::no_final_record()))
            .into_response()
    })?;
    // From here the answer is on its way to the caller.
    driven.encoder_mut().opened();
    Ok(crate::http::streamed(
        driven.into_stream(),
        "application/x-ndjson",
    ))
}

/// The whole answer as one object, or its error.
async fn whole(
    call: OllamaCall,
    started_call: Started<TextCompletionResponse, StartOver>,
    shape: Shape,
    started: Instant,
) -> Response {
    let Started {
        reader, mut span, ..
    } = started_call;
    let resp = match reader.whole().await {
        Ok(answer) => {
            let tokens = Tokens {
                input: answer.usage.in_token.unwrap_or(0),
                output: answer.usage.out_token.unwrap_or(0),
            };
            let calls = answer.tool_calls();
            let mut v = json!({"model": call.model, "created_at": created_at(SystemTime::now())});
            match shape {
                Shape::Chat => {
                    v["message"] = json!({"role": "assistant", "content": answer.text});
                    if !calls.is_empty() {
                        v["message"]["tool_calls"] =
                            calls.iter().enumerate().map(tool_call).collect();
                    }
                }
                Shape::Generate => v["response"] = json!(answer.text),
            }
            v["done_reason"] = json!(done_reason(answer.finish_reason.as_deref()));
            v["done"] = json!(true);
            v["total_duration"] = json!(nanos(started));
            v["prompt_eval_count"] = json!(tokens.input);
            v["eval_count"] = json!(tokens.output);
            Json(v).into_response()
        }
        Err(f) => OllamaError::from_error(&f.error).into_response(),
    };
    if !resp.status().is_success() {
        span.fail(resp.status().as_str().to_owned());
    }
    span.end();
    resp
}

/// Nanoseconds since `since`, as Ollama's durations are.
pub(crate) fn nanos(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Ollama's `done_reason` for a sluice `finish_reason`: Ollama says `stop` after tool calls
/// too, and `length` at the token limit.
pub(crate) fn done_reason(finish: Option<&str>) -> &str {
    match finish {
        None | Some("tool_calls") => "stop",
        Some(other) => other,
    }
}

/// A whole tool call as Ollama sends it: its arguments an object (a model's arguments that
/// are not JSON go as the string they are, so nothing is lost).
pub(crate) fn tool_call((index, call): (usize, &sluice_schema::ToolCall)) -> Value {
    let arguments = serde_json::from_str::<Value>(&call.arguments)
        .unwrap_or_else(|_| Value::String(call.arguments.clone()));
    json!({"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}})
}

/// `GET /api/tags`: the served models, as Ollama lists its local ones.
pub(crate) async fn tags(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    if !inner.config.auth.accepts_headers(&headers) {
        let e = OllamaError::refused(Refused::Unauthorized, &inner);
        return labelled(MODELS_ROUTE, e.into_response());
    }
    let resp = match openai::served_models(&inner).await {
        Ok(ids) => {
            Json(json!({"models": ids.iter().map(|id| model_entry(id)).collect::<Vec<_>>()}))
                .into_response()
        }
        Err(e) => OllamaError::of_api(e).into_response(),
    };
    labelled(MODELS_ROUTE, resp)
}

/// A model as `/api/tags` lists it. sluice holds no weights: the size is 0 and the digest
/// the SHA-256 of the name (stable, so tools that key on it still can).
fn model_entry(id: &str) -> Value {
    json!({
        "name": id,
        "model": id,
        "modified_at": "1970-01-01T00:00:00Z",
        "size": 0,
        "digest": hex::encode(Sha256::digest(id.as_bytes())),
        "details": details(),
    })
}

fn details() -> Value {
    json!({"parent_model": "", "format": "", "family": "", "families": null,
           "parameter_size": "", "quantization_level": ""})
}

/// `POST /api/show` `{"model": ...}` (older clients: `name`): what is known of a served model.
pub(crate) async fn show(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    #[derive(serde::Deserialize)]
    struct ShowBody {
        #[serde(default)]
        model: Option<String>,
        #[serde(default)]
        name: Option<String>,
    }
    let shown = async {
        if !inner.config.auth.accepts_headers(&headers) {
            return Err(OllamaError::refused(Refused::Unauthorized, &inner));
        }
        let body = body.map_err(|r| OllamaError::refused(Refused::body(&r), &inner))?;
        let asked: ShowBody =
            sluice_schema::decode(&body).map_err(|e| OllamaError::bad_request(e.to_string()))?;
        let Some(model) = asked.model.or(asked.name).filter(|m| !m.is_empty()) else {
            return Err(OllamaError::bad_request("model is required"));
        };
        served_model(&inner, &model).await?;
        Ok(Json(json!({
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": details(),
            "model_info": {},
            "capabilities": ["completion"],
            "modified_at": "1970-01-01T00:00:00Z",
        })))
    };
    let resp = match shown.await {
        Ok(v) => v.into_response(),
        Err(e) => e.into_response(),
    };
    labelled(MODELS_ROUTE, resp)
}

/// `GET /api/version`.
pub(crate) async fn version(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let resp = if inner.config.auth.accepts_headers(&headers) {
        Json(json!({"version": OLLAMA_API_VERSION})).into_response()
    } else {
        OllamaError::refused(Refused::Unauthorized, &inner).into_response()
    };
    labelled(MODELS_ROUTE, resp)
}

#[cfg(test)]
mod tests;
