//! OpenAI's Chat Completions dialect, so an OpenAI SDK or tool pointed at the gateway's base
//! URL (`http://host:port/v1`) reaches the text-completion processors over the bus.
//!
//! - `POST /v1/chat/completions`: a `chat.completion` object, or with `stream: true` SSE
//!   `chat.completion.chunk` events ending `data: [DONE]`; `stream_options.include_usage`
//!   adds the usage chunk.
//! - `GET /v1/models` and `GET /v1/models/{model}`: what the processors serve (their
//!   `list-models` answer); in Anthropic's shape when Anthropic's SDKs ask (`anthropic`).
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

mod errors;
pub(crate) mod parse;

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use axum::{
    Json,
    body::Bytes,
    extract::{Path, State, rejection::BytesRejection},
    http::{HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_runtime::{
    client::RequestOptions,
    reader::{Failure, ReadPolicy, StartOver},
};
use sluice_schema::{
    Error, ErrorKind, LIST_MODELS, ModelInfo, TextCompletionRequest, TextCompletionResponse,
};

pub(crate) use self::errors::ApiError;
use self::parse::{ChatCall, parse_chat};
use crate::{
    Inner,
    auth::Caller,
    client_error,
    encode::{
        Tally,
        chunks::{ChunkItem, Chunks, Tokens},
    },
    http::{self, Ask, Mode},
    http_span,
    kinds::TextCompletion,
    preamble::{self, Call, Refused, Started, labelled},
    resume::{self, Step},
};

/// The metrics label of `POST /v1/chat/completions`.
pub(crate) const CHAT_ROUTE: &str = "openai-chat";
/// The metrics label of `GET /v1/models`.
pub(crate) const MODELS_ROUTE: &str = "openai-models";

/// How long a `list-models` answer is trusted when checking a request's `model`.
const MODELS_TTL: Duration = Duration::from_secs(10);
/// Silence on a stream longer than this gets an SSE comment, so proxies keep the connection.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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
pub(crate) async fn served_models(inner: &Inner) -> Result<Vec<String>, ApiError> {
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

fn model_object(m: &ModelInfo) -> Value {
    json!({"id": m.id, "object": "model", "created": 0,
           "owned_by": m.owned_by.as_deref().unwrap_or("sluice")})
}

/// `GET /v1/models`.
pub(crate) async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    if crate::anthropic::asks(&headers) {
        return crate::anthropic::models(inner, headers, None).await;
    }
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
    if crate::anthropic::asks(&headers) {
        return crate::anthropic::models(inner, headers, Some(id)).await;
    }
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
    let status = if matches!(
        path.as_str(),
        "/v1/chat/completions" | "/v1/models" | "/v1/responses"
    ) {
        StatusCode::METHOD_NOT_ALLOWED
    } else {
        StatusCode::NOT_FOUND
    };
    let mut e = ApiError::invalid(format!("Invalid URL ({method} {path})"), None, None);
    e.status = status;
    e.into_response()
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
        // The event protocol's route: SSE carries its events.
        records_on_sse: false,
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
    let start = Call::<TextCompletion, _> {
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
    let started_call = match preamble::start(start).await {
        Ok(s) => s,
        Err(refused) => return refused.openai(&inner),
    };
    // The request's id names the completion (`chatcmpl-<id>`): the same again when resumed.
    let id = format!("chatcmpl-{}", preamble::short_id(&started_call.request_id));
    let created = match &started_call.resume {
        Some(r) => r.token.created,
        None => now_secs(),
    };
    let completion = Completion {
        id,
        created,
        started,
    };
    if call.stream {
        stream(&inner, call, started_call, completion).await
    } else {
        whole(call, started_call, completion).await
    }
}

/// What names one completion: its id (`chatcmpl-...`) and creation time; and when its
/// request arrived.
struct Completion {
    id: String,
    created: u64,
    started: Instant,
}

/// A whole `chat.completion`: the final attempt's text, tool calls and usage, or the error
/// (both naming the completion in `x-request-id`).
async fn whole(
    call: ChatCall,
    started: Started<TextCompletionResponse, StartOver>,
    completion: Completion,
) -> Response {
    let Started {
        reader, mut span, ..
    } = started;
    let resp = match reader.whole().await {
        Ok(answer) => {
            let tool_calls = answer.tool_calls();
            // As OpenAI: `content` null when the answer is only tool calls, and `tool_calls`
            // only when there are some.
            let mut message = json!({"role": "assistant", "content": answer.text, "refusal": null});
            if !tool_calls.is_empty() {
                if answer.text.is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = tool_calls
                    .iter()
                    .map(sluice_schema::tools::openai_call)
                    .collect();
            }
            let tokens = Tokens {
                input: answer.usage.in_token.unwrap_or(0),
                output: answer.usage.out_token.unwrap_or(0),
            };
            Json(json!({
                "id": completion.id,
                "object": "chat.completion",
                "created": completion.created,
                "model": answer.usage.model.unwrap_or(call.model),
                "choices": [{
                    "index": 0,
                    "message": message,
                    "logprobs": null,
                    "finish_reason": answer.finish_reason.unwrap_or_else(|| "stop".into()),
                }],
                "usage": tokens.usage(),
                "system_fingerprint": null,
            }))
            .into_response()
        }
        Err(f) => ApiError::from_error(&f.error).into_response(),
    };
    if !resp.status().is_success() {
        span.fail(resp.status().as_str().to_owned());
    }
    span.end();
    let mut resp = resp;
    request_id_header(&mut resp, &completion.id);
    resp
}

/// A streamed completion: its chunks once a record says something, so that an early failure
/// is an HTTP error with its proper status; keep-alives on silence; each event numbered when
/// the stream can be resumed (keep-alives never are). A stream, not an early error, names the
/// completion in `x-request-id`.
async fn stream(
    inner: &Arc<Inner>,
    call: ChatCall,
    started: Started<TextCompletionResponse, StartOver>,
    completion: Completion,
) -> Response {
    let Started {
        reader,
        span,
        numbering,
        ..
    } = started;
    let tally = Tally::new(inner.clone(), CHAT_ROUTE, completion.started, span);
    let chunks = Chunks::new(
        completion.id.clone(),
        completion.created,
        call.model,
        call.include_usage,
        tally,
    );
    let mut driven = match reader.drive(chunks).start().await {
        Ok(d) => d,
        Err(refused) => return refused.unwrap_or_else(unfinished).into_response(),
    };
    // From here the answer is on its way to the caller.
    driven.encoder_mut().opened();
    let token = numbering.token().map(str::to_owned);
    let items = driven
        .keep_alive(KEEP_ALIVE, || ChunkItem::KeepAlive)
        .into_stream();
    let mut numbering = numbering;
    let body = items.filter_map(move |item| {
        let bytes = match item {
            ChunkItem::KeepAlive => Some(Bytes::from_static(ChunkItem::KEEP_ALIVE)),
            ChunkItem::Event(event) => match numbering.step() {
                Step::Skip => None,
                Step::Send(None) => Some(Bytes::from(event)),
                Step::Send(Some(id)) => {
                    let mut numbered = format!("id: {id}\n").into_bytes();
                    numbered.extend_from_slice(&event);
                    Some(Bytes::from(numbered))
                }
            },
        };
        std::future::ready(bytes)
    });
    let mut resp = crate::http::streamed(body, crate::http::SSE);
    request_id_header(&mut resp, &completion.id);
    resume::token_header(&mut resp, token.as_deref());
    resp
}

/// The error of an answer that ended before anything was sent without saying why: a guard (a
/// chat stream's encoder says why whenever it ends so).
fn unfinished() -> ApiError {
    ApiError::from_error(&preamble::no_final_record())
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

/// How the OpenAI and Ollama routes read text-completion's answers: a restart starts the
/// answer over until its first chunk went out (the encoder emitted it), and ends it after that.
pub(crate) fn chat_policy() -> ReadPolicy<StartOver> {
    ReadPolicy::new(StartOver(mid_answer_restart()), client_error)
}
