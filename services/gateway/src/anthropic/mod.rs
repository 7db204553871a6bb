//! Anthropic's Messages API, so Anthropic's SDKs and the tools built on them, given the
//! gateway as their base URL (`http://host:port`), reach the text-completion processors over
//! the bus, whichever provider answers.
//!
//! - `POST /v1/messages`: a `message` object, or with `stream: true` Anthropic's SSE events
//!   (`message_start`, the content blocks' events, `message_delta`, `message_stop`; see
//!   [`crate::encode::messages`]). Text and tool use (`tool_use` blocks, their input streamed
//!   as `input_json_delta`), `stop_reason` and `usage` as Anthropic sends them.
//! - `GET /v1/models` and `GET /v1/models/{id}` asked with `anthropic-version` (as the SDKs
//!   ask): the served models in Anthropic's list shape ([`models`]).
//!
//! A route is decode ([`parse`]) -> [`preamble::start`] (credentials, keys and limits, the
//! request on the bus) -> encode ([`crate::encode::messages::Messages`], driven by the
//! runtime's driver). The caller's key comes as `x-api-key`, where Anthropic's SDKs send it
//! (or as `Authorization: Bearer`); `anthropic-version` and `anthropic-beta` are accepted and
//! change nothing. Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}`:
//! an HTTP error while nothing was sent (the status is sent with the first event), an `event:
//! error` after that, which Anthropic's SDKs raise. A caller that goes away drops the
//! stream, which cancels the provider call. This module never logs a body: bodies carry
//! prompts.

mod errors;
mod parse;

use std::{sync::Arc, time::Duration};

use axum::{
    Json,
    body::Bytes,
    extract::{State, rejection::BytesRejection},
    http::{HeaderMap, HeaderValue, Method, StatusCode},
    response::{IntoResponse, Response},
};
use sluice_runtime::reader::StartOver;
use sluice_schema::TextCompletionResponse;

pub(crate) use self::errors::AnthropicError;
use self::parse::{MessagesCall, parse_messages};
use crate::{
    Inner,
    auth::Caller,
    encode::{
        Tally,
        chunks::Tokens,
        messages::{self as wire, Block, Message, Messages},
    },
    openai,
    preamble::{self, DialectRoute, Refused, Started, labelled},
};

/// The metrics label of `POST /v1/messages`.
pub(crate) const ROUTE: &str = "anthropic-messages";
/// The metrics label of `GET /v1/models` asked by Anthropic's SDKs.
pub(crate) const MODELS_ROUTE: &str = "anthropic-models";

/// Silence on a stream longer than this gets a `ping` event, as Anthropic's API sends them.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Whether `path` is Anthropic's: a refusal in front of it is in Anthropic's shape.
pub(crate) fn serves(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    labelled(ROUTE, serve(inner, headers, body).await)
}

/// Another method on `/v1/messages`, or a path under it sluice does not serve (token
/// counting, batches): Anthropic's shape, so an SDK raises an error it can read.
pub(crate) async fn not_served(method: Method, uri: axum::http::Uri) -> Response {
    let path: String = uri.path().chars().take(200).collect();
    let status = if path == "/v1/messages" {
        StatusCode::METHOD_NOT_ALLOWED
    } else {
        StatusCode::NOT_FOUND
    };
    AnthropicError::new(status, format!("{method} {path} is not served here")).into_response()
}

/// Whether a request is from Anthropic's SDKs, which always send `anthropic-version`: `GET
/// /v1/models`, a path Anthropic's and OpenAI's APIs share, answers them in Anthropic's shape.
pub(crate) fn asks(headers: &HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
}

/// `GET /v1/models` (`id`: `GET /v1/models/{id}`) in Anthropic's shape: the served models as
/// `{"type": "model", "id", "display_name", "created_at"}`, listed in one page.
pub(crate) async fn models(inner: Arc<Inner>, headers: HeaderMap, id: Option<String>) -> Response {
    let resp = async {
        if inner.config.auth.caller_of_api_key(&headers).is_none() {
            return Err(AnthropicError::refused(Refused::Unauthorized, &inner));
        }
        let ids = openai::served_models(&inner)
            .await
            .map_err(AnthropicError::of_api)?;
        let entry = |id: &str| {
            serde_json::json!({"type": "model", "id": id, "display_name": id,
                               "created_at": "1970-01-01T00:00:00Z"})
        };
        Ok(match id {
            Some(id) if ids.contains(&id) => Json(entry(&id)),
            Some(id) => return Err(AnthropicError::model_not_found(&id)),
            None => Json(serde_json::json!({
                "data": ids.iter().map(|id| entry(id)).collect::<Vec<_>>(),
                "has_more": false,
                "first_id": ids.first(),
                "last_id": ids.last(),
            })),
        })
    };
    let resp = match resp.await {
        Ok(v) => v.into_response(),
        Err(e) => e.into_response(),
    };
    labelled(MODELS_ROUTE, resp)
}

/// Decode, the model checked against those served, [`preamble::start`], then the answer
/// streamed or whole. Every refusal is an [`AnthropicError`].
async fn serve(
    inner: Arc<Inner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = std::time::Instant::now();
    let Some(caller) = inner.config.auth.caller_of_api_key(&headers) else {
        return AnthropicError::refused(Refused::Unauthorized, &inner).into_response();
    };
    let body = match body {
        Ok(b) => b,
        Err(rejection) => {
            return AnthropicError::refused(Refused::body(&rejection), &inner).into_response();
        }
    };
    let call = match parse_messages(&body) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    match openai::served_models(&inner).await {
        Ok(ids) if ids.contains(&call.model) => {}
        Ok(_) => return AnthropicError::model_not_found(&call.model).into_response(),
        Err(e) => return AnthropicError::of_api(e).into_response(),
    }
    match answer(&inner, &headers, &caller, call, body.len(), started).await {
        Ok(resp) | Err(resp) => resp,
    }
}

/// Sends the request through [`preamble::start`] and answers it; a refusal as `Err`.
async fn answer(
    inner: &Arc<Inner>,
    headers: &HeaderMap,
    caller: &Caller,
    call: MessagesCall,
    body_bytes: usize,
    started: std::time::Instant,
) -> Result<Response, Response> {
    // Anthropic's stream has no way to resume: its events carry no ids.
    let start = DialectRoute {
        label: ROUTE,
        path: "/v1/messages",
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
        .map_err(|r| AnthropicError::refused(r, inner).into_response())?;
    // The request's id names the message (`msg_<id>`) and the request (`req_<id>`).
    let simple = preamble::short_id(&started_call.request_id);
    let ids = Ids {
        message: format!("msg_{simple}"),
        request: format!("req_{simple}"),
    };
    let mut resp = if call.stream {
        stream(inner, call, started_call, &ids, started).await?
    } else {
        whole(call, started_call, &ids).await
    };
    if let Ok(v) = HeaderValue::from_str(&ids.request) {
        resp.headers_mut().insert("request-id", v);
    }
    Ok(resp)
}

/// What names one answer: its message id and its request id.
struct Ids {
    message: String,
    request: String,
}

/// The answer as SSE events once a record says something, so that an early failure is an
/// HTTP error with its status, as Anthropic answers one; a `ping` on silence.
async fn stream(
    inner: &Arc<Inner>,
    call: MessagesCall,
    started_call: Started<TextCompletionResponse, StartOver>,
    ids: &Ids,
    started: std::time::Instant,
) -> Result<Response, Response> {
    let Started { reader, span, .. } = started_call;
    let tally = Tally::new(inner.clone(), ROUTE, started, span);
    let messages = Messages::new(ids.message.clone(), call.model, tally);
    let mut driven = reader.drive(messages).start().await.map_err(|refused| {
        refused
            .unwrap_or_else(|| AnthropicError::from_error(&preamble::no_final_record()))
            .into_response()
    })?;
    // From here the answer is on its way to the caller.
    driven.encoder_mut().opened();
    Ok(crate::http::streamed(
        driven.keep_alive(KEEP_ALIVE, wire::ping).into_stream(),
        crate::http::SSE,
    ))
}

/// The whole answer as one `message` object, or its error.
async fn whole(
    call: MessagesCall,
    started_call: Started<TextCompletionResponse, StartOver>,
    ids: &Ids,
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
            let mut content = Vec::with_capacity(calls.len() + 1);
            if !answer.text.is_empty() {
                content.push(Block::Text { text: &answer.text });
            }
            content.extend(calls.iter().map(|c| Block::ToolUse {
                id: &c.id,
                name: &c.name,
                input: wire::input(&c.arguments),
            }));
            let model = answer.usage.model.as_deref().unwrap_or(&call.model);
            let mut message = Message::new(&ids.message, model, content, tokens.into());
            message.stop_reason = Some(wire::stop_reason(
                answer.finish_reason.as_deref(),
                !calls.is_empty(),
            ));
            Json(message).into_response()
        }
        Err(f) => AnthropicError::from_error(&f.error).into_response(),
    };
    if !resp.status().is_success() {
        span.fail(resp.status().as_str().to_owned());
    }
    span.end();
    resp
}

#[cfg(test)]
mod tests;
