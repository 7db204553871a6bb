//! OpenAI's Responses API, `POST /v1/responses`, so OpenAI's SDKs (`client.responses.create`,
//! `client.responses.stream`) and the agent tools built on them reach the text-completion
//! processors over the bus, whichever provider answers.
//!
//! A route is decode ([`parse`]) -> [`preamble::start`] (credentials, keys and limits, the
//! request on the bus) -> encode ([`crate::encode::responses::ResponseEvents`], driven by the
//! runtime's driver). Whole, the answer is one `response` object; with `stream: true`, the
//! Responses API's semantic SSE events ending with `response.completed`. Errors are the Chat
//! route's OpenAI shape (`openai::ApiError`): an HTTP error while nothing was sent, an `error`
//! event and `response.failed` after that. A caller that goes away drops the stream, which
//! cancels the provider call. Nothing is stored: `previous_response_id` is refused (400) and
//! the response says `store: false`. This module never logs a body: bodies carry prompts.

mod parse;

use std::{sync::Arc, time::Instant};

use axum::{
    Json,
    body::Bytes,
    extract::{State, rejection::BytesRejection},
    http::{HeaderMap, HeaderValue},
    response::{IntoResponse, Response},
};
use sluice_runtime::reader::StartOver;
use sluice_schema::TextCompletionResponse;

use self::parse::ResponsesCall;
pub(crate) use self::parse::parse_responses;
use crate::{
    Inner,
    auth::Caller,
    encode::{
        Tally,
        chunks::{ChunkItem, Tokens},
        responses::{Meta, ResponseEvents, Status, response_object, whole_output},
    },
    openai::{self, ApiError},
    preamble::{self, DialectRoute, Refused, Started, labelled},
};

/// The metrics label of `POST /v1/responses`.
pub(crate) const ROUTE: &str = "openai-responses";

/// Silence on a stream longer than this gets an SSE comment, so proxies keep the connection.
const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    labelled(ROUTE, serve(inner, headers, body).await)
}

/// Decode, the model checked against those served, [`preamble::start`], then the answer
/// streamed or whole. Every refusal is an [`ApiError`].
async fn serve(
    inner: Arc<Inner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let Some(caller) = inner.config.auth.caller_of(&headers) else {
        return Refused::Unauthorized.openai(&inner);
    };
    let body = match body {
        Ok(b) => b,
        Err(rejection) => return Refused::body(&rejection).openai(&inner),
    };
    let call = match parse_responses(&body) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    match openai::served_models(&inner).await {
        Ok(ids) if ids.contains(&call.model) => {}
        Ok(ids) => return ApiError::model_not_found(&call.model, &ids).into_response(),
        Err(e) => return e.into_response(),
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
    call: ResponsesCall,
    body_bytes: usize,
    started: Instant,
) -> Result<Response, Response> {
    // OpenAI resumes a response by its stored id (`GET /v1/responses/{id}`), which this
    // server does not keep.
    let start = DialectRoute {
        label: ROUTE,
        path: "/v1/responses",
    }
    .call(
        inner,
        headers,
        caller,
        &call.request,
        body_bytes,
        &call.model,
    );
    let started_call = preamble::start(start).await.map_err(|r| r.openai(inner))?;
    // The request's id names the response (`resp_<id>`).
    let id = format!("resp_{}", preamble::short_id(&started_call.request_id));
    let meta = Meta {
        id,
        created_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: call.model,
        echo: call.echo,
    };
    if call.stream {
        stream(inner, meta, started_call, started).await
    } else {
        Ok(whole(meta, started_call).await)
    }
}

/// The response's events once a record says something, so that an early failure is an HTTP
/// error with its status, as OpenAI answers one.
async fn stream(
    inner: &Arc<Inner>,
    meta: Meta,
    started_call: Started<TextCompletionResponse, StartOver>,
    started: Instant,
) -> Result<Response, Response> {
    let Started { reader, span, .. } = started_call;
    let tally = Tally::new(inner.clone(), ROUTE, started, span);
    let id = meta.id.clone();
    let events = ResponseEvents::new(meta, tally);
    let mut driven = reader.drive(events).start().await.map_err(|refused| {
        refused
            .unwrap_or_else(|| ApiError::from_error(&preamble::no_final_record()))
            .into_response()
    })?;
    // From here the answer is on its way to the caller.
    driven.encoder_mut().opened();
    let stream = driven
        .keep_alive(KEEP_ALIVE, || ChunkItem::KEEP_ALIVE.to_vec())
        .into_stream();
    let mut resp = crate::http::streamed(stream, crate::http::SSE);
    request_id_header(&mut resp, &id);
    Ok(resp)
}

/// The whole `response` object, or its error.
async fn whole(meta: Meta, started_call: Started<TextCompletionResponse, StartOver>) -> Response {
    let Started {
        reader, mut span, ..
    } = started_call;
    let mut resp = match reader.whole().await {
        Ok(answer) => {
            let tokens = Tokens {
                input: answer.usage.in_token.unwrap_or(0),
                output: answer.usage.out_token.unwrap_or(0),
            };
            let meta = Meta {
                model: answer
                    .usage
                    .model
                    .clone()
                    .unwrap_or_else(|| meta.model.clone()),
                ..meta.clone()
            };
            let status = Status::of_finish(answer.finish_reason.as_deref());
            let output = whole_output(&meta, &answer.text, &answer.tool_calls(), status);
            Json(response_object(&meta, status, output, Some(tokens), None)).into_response()
        }
        Err(f) => ApiError::from_error(&f.error).into_response(),
    };
    if !resp.status().is_success() {
        span.fail(resp.status().as_str().to_owned());
    }
    span.end();
    request_id_header(&mut resp, &meta.id);
    resp
}

fn request_id_header(resp: &mut Response, id: &str) {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert("x-request-id", v);
    }
}

#[cfg(test)]
mod tests;
