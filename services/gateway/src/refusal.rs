//! A request refused before its answer started, in the error shape of the route's dialect:
//! Anthropic's `{"type": "error", "error": {"type", "message"}}` on `/v1/messages`, OpenAI's
//! `{"error": {"message", "type", "param", "code"}}` elsewhere under `/v1/`, Ollama's
//! `{"error": "..."}` on Ollama's routes (`/api/chat`, ...), the gateway's
//! NDJSON `error` and `done` events for a caller that asked for NDJSON, and the gateway's
//! `{"error": {"type", "message"}}` otherwise. Written once, for the checks in front of
//! every route (see `guard`) and the routes' own early refusals.

use axum::{
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
};

use crate::{
    anthropic::{self, AnthropicError},
    http::{self, Mode},
    ollama::{self, OllamaError},
    openai::ApiError,
};

/// Renders a refusal of a request to `path` with these headers: `kind` is the gateway's
/// error type (`invalid-request`, ...), which OpenAI's shape carries as its `code`.
pub(crate) fn render(
    path: &str,
    headers: &HeaderMap,
    status: StatusCode,
    kind: &str,
    message: &str,
) -> Response {
    let accept = http::accepted(headers);
    if anthropic::serves(path) {
        return AnthropicError::new(status, message).into_response();
    }
    if path.starts_with("/v1/") && accept != Some(Mode::Ndjson) {
        return ApiError::refusal(status, message, kind).into_response();
    }
    if ollama::serves(path) {
        return OllamaError::new(status, message).into_response();
    }
    http::refuse(accept, headers, status, kind, message)
}
