//! Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, with the status
//! each error is answered with: the gateway's refusals, a sluice error record's mapping, and
//! what the route's checks refuse. Mid-stream, the same object is an `event: error`.

use axum::{
    Json,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use sluice_schema::{Error, ErrorKind};

use crate::{Inner, Refusal, http::retry_after, openai::ApiError, preamble::Refused};

/// Anthropic's 529, which `http` does not name.
fn overloaded() -> StatusCode {
    StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
}

/// An error in Anthropic's shape.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AnthropicError {
    pub(crate) status: StatusCode,
    /// Anthropic's error type (`invalid_request_error`, ...).
    pub(crate) kind: &'static str,
    pub(crate) message: String,
    /// `Retry-After`, in whole seconds (a limit's refusal).
    retry_after: Option<u64>,
}

/// Anthropic's error type for a status, as its API pairs them.
fn kind_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

impl AnthropicError {
    /// An error of `status`, its type the one Anthropic pairs with it.
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            kind: kind_of(status),
            message: message.into(),
            retry_after: None,
        }
    }

    /// A body Anthropic would not take: 400 `invalid_request_error`.
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A model the processors do not serve: 404 `not_found_error`, worded as Anthropic's.
    pub(crate) fn model_not_found(model: &str) -> Self {
        let shown: String = model.chars().take(100).collect();
        Self::new(StatusCode::NOT_FOUND, format!("model: {shown}"))
    }

    /// A sluice error record's, under the status and type its kind maps to: what waiting may
    /// cure (records lost, a processor that went away) as `overloaded_error`, which the SDKs
    /// retry.
    pub(crate) fn from_error(e: &Error) -> Self {
        let status = match &e.kind {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::MessageTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::Cancelled | ErrorKind::RecordsLost => overloaded(),
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, e.message.clone())
    }

    /// What an OpenAI-shaped error of the shared model lookup says, in Anthropic's shape.
    pub(crate) fn of_api(e: ApiError) -> Self {
        Self::new(e.status, e.message)
    }

    /// A refusal of the preamble, in Anthropic's shape.
    pub(crate) fn refused(refused: Refused, inner: &Inner) -> Self {
        match refused {
            Refused::Unauthorized => Self::new(
                StatusCode::UNAUTHORIZED,
                "invalid x-api-key: send the gateway's token or an API key as `x-api-key` (the Anthropic SDKs send their api_key so)",
            ),
            Refused::Body { status, .. } if status == StatusCode::PAYLOAD_TOO_LARGE => Self::new(
                status,
                format!(
                    "Request exceeds the maximum allowed number of bytes ({}).",
                    inner.config.body_limit
                ),
            ),
            Refused::Body { text, .. } => Self::invalid(text),
            Refused::Invalid(why) => Self::invalid(why),
            Refused::NotEnabled(service) => Self::new(
                StatusCode::NOT_FOUND,
                format!("the {service} service is not enabled on this gateway"),
            ),
            Refused::Resume((status, _, message)) => Self::new(status, message),
            Refused::Key(Refusal::Forbidden(why)) => Self::new(StatusCode::FORBIDDEN, why),
            Refused::Key(Refusal::Limited(l)) => Self {
                retry_after: l.retry_after,
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, l.message)
            },
            Refused::Unsent(e) => Self::new(overloaded(), e.message),
        }
    }

    /// The body, as answered and as a stream's `error` event, its fields in Anthropic's
    /// order.
    fn wire(&self) -> Wire<'_> {
        Wire {
            kind: "error",
            error: Detail {
                kind: self.kind,
                message: &self.message,
            },
        }
    }

    /// The `event: error` of a stream that fails after it started.
    pub(crate) fn event(&self) -> Vec<u8> {
        crate::encode::messages::sse("error", &self.wire())
    }
}

#[derive(serde::Serialize)]
struct Wire<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: Detail<'a>,
}

#[derive(serde::Serialize)]
struct Detail<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.wire())).into_response();
        retry_after(&mut resp, self.retry_after);
        resp
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Each status has Anthropic's type, and sluice's error kinds their status.
    #[test]
    fn statuses_and_kinds_pair_as_anthropics() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (415, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (502, "api_error"),
            (504, "timeout_error"),
            (529, "overloaded_error"),
        ] {
            assert_eq!(kind_of(StatusCode::from_u16(status).unwrap()), kind);
        }
        let of = |k| AnthropicError::from_error(&Error::new(k, "m"));
        assert_eq!(of(ErrorKind::TooManyRequests).status.as_u16(), 429);
        assert_eq!(of(ErrorKind::InvalidRequest).kind, "invalid_request_error");
        assert_eq!(of(ErrorKind::Llm).kind, "api_error");
        assert_eq!(of(ErrorKind::Cancelled).status.as_u16(), 529);
        assert_eq!(of(ErrorKind::Timeout).kind, "timeout_error");
        assert_eq!(
            serde_json::to_value(of(ErrorKind::Llm).wire()).unwrap(),
            json!({"type": "error", "error": {"type": "api_error", "message": "m"}})
        );
        assert_eq!(
            String::from_utf8(of(ErrorKind::Cancelled).event()).unwrap(),
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"m\"}}\n\n"
        );
    }
}
