//! OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, with the status
//! each error is answered with: the gateway's refusals, a sluice error record's mapping, and
//! what the chat route's checks refuse.

use axum::{
    Json,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde_json::{Value, json};
use sluice_schema::{Error, ErrorKind};

use crate::{Inner, Refusal, http};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) kind: &'static str,
    pub(crate) param: Option<String>,
    pub(crate) code: Option<String>,
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

    /// A parameter sluice cannot honour, refused by name.
    pub(crate) fn unsupported(param: &str, why: &str) -> Self {
        Self::invalid(
            format!("'{param}' is not supported by this server: {why}"),
            Some(param),
            Some("unsupported_parameter"),
        )
    }

    /// A model that is not served, naming those that are.
    pub(crate) fn model_not_found(model: &str, served: &[String]) -> Self {
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

    /// The JSON body, as answered and as a stream's error event.
    pub(crate) fn body(&self) -> Value {
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

#[cfg(test)]
mod tests {
    use super::*;

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
