//! Google Gemini: AI Studio (`x-goog-api-key`) and Vertex AI (OAuth bearer token), one
//! decoder.
//!
//! `streamGenerateContent?alt=sse` sends `data:` lines only, with no `[DONE]`; the stream
//! ends when the connection closes and the last chunk has `finishReason`. `usageMetadata` is
//! a running snapshot: input is `promptTokenCount`, output is `candidatesTokenCount +
//! thoughtsTokenCount`. Errors put the retry hint in the body (`RetryInfo.retryDelay`). A bad
//! key is reported as 400 `API_KEY_INVALID`. A blocked prompt is a 200 with
//! `promptFeedback.blockReason` and no candidates.
//!
//! Vertex wants a short-lived OAuth access token. sluice reads it from the environment or a
//! file (refreshed by the platform, e.g. a metadata-server sidecar). It does not mint tokens
//! from service-account keys itself.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;
use sluice_schema::TextCompletionRequest;

use crate::{
    provider::{Chunk, ChunkStream, FailureKind, Provider, ProviderError, Usage},
    providers::{Body, HttpTimeouts, SseStep, classify_status, http_client, send, sse_body_chunks},
};

/// Where the model is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GeminiEndpoint {
    /// Google AI Studio: `{base}/v1beta/models/{model}`, key in `x-goog-api-key`.
    AiStudio,
    /// Vertex AI: `{base}/v1/projects/{project}/locations/{location}/publishers/google/models/{model}`,
    /// OAuth bearer token.
    Vertex {
        /// GCP project.
        project: String,
        /// Region, e.g. `us-central1`.
        location: String,
    },
}

/// Configuration for Gemini.
#[derive(Debug, Clone)]
pub struct GeminiConfig {
    /// AI Studio or Vertex.
    pub endpoint: GeminiEndpoint,
    /// Base URL (`https://generativelanguage.googleapis.com`, `https://{loc}-aiplatform.googleapis.com`).
    pub base_url: String,
    /// Model, e.g. `gemini-2.5-flash`.
    pub model: String,
    /// API key (AI Studio) or access token (Vertex).
    pub credential: Option<Secret>,
    /// Where the credential comes from, named in auth errors.
    pub credential_source: String,
    /// Maximum output tokens.
    pub max_output_tokens: Option<u32>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Time limits.
    pub timeouts: HttpTimeouts,
}

impl GeminiConfig {
    /// Defaults for `model` at `base_url`.
    pub fn new(
        endpoint: GeminiEndpoint,
        base_url: impl Into<String>,
        model: impl Into<String>,
    ) -> Self {
        Self {
            endpoint,
            base_url: base_url.into(),
            model: model.into(),
            credential: None,
            credential_source: "GEMINI_API_KEY".into(),
            max_output_tokens: None,
            temperature: None,
            timeouts: HttpTimeouts::default(),
        }
    }
}

/// The Gemini provider.
pub struct GeminiProvider {
    config: GeminiConfig,
    http: reqwest::Client,
    url: String,
}

impl GeminiProvider {
    /// Builds the provider.
    pub fn new(config: GeminiConfig) -> Result<Self, ProviderError> {
        let http = http_client(&config.timeouts)?;
        let url = Self::url_for(&config, &config.model);
        Ok(Self { config, http, url })
    }

    /// The streaming URL for `model`: Gemini names the model in the path.
    fn url_for(config: &GeminiConfig, model: &str) -> String {
        let base = config.base_url.trim_end_matches('/');
        match &config.endpoint {
            GeminiEndpoint::AiStudio => {
                format!("{base}/v1beta/models/{model}:streamGenerateContent?alt=sse")
            }
            GeminiEndpoint::Vertex { project, location } => format!(
                "{base}/v1/projects/{project}/locations/{location}/publishers/google/models/{model}:streamGenerateContent?alt=sse"
            ),
        }
    }

    fn body(&self, request: &TextCompletionRequest) -> Value {
        // Gemini calls the assistant `model`.
        let contents: Vec<Value> = request
            .turns()
            .into_iter()
            .map(|t| {
                let role = match t.role {
                    // A tool turn never gets here: the handler refuses requests with tools
                    // for a provider that does not call them (`supports_tools`).
                    sluice_schema::ChatRole::User | sluice_schema::ChatRole::Tool => "user",
                    sluice_schema::ChatRole::Assistant => "model",
                };
                json!({"role": role, "parts": [{"text": t.content}]})
            })
            .collect();
        let mut body = json!({ "contents": contents });
        if !request.system.is_empty() {
            body["systemInstruction"] = json!({"parts": [{"text": request.system}]});
        }
        let mut generation = serde_json::Map::new();
        if let Some(m) = request.max_tokens.or(self.config.max_output_tokens) {
            generation.insert("maxOutputTokens".into(), json!(m));
        }
        if let Some(t) = request
            .temperature
            .or(self.config.temperature.map(f64::from))
        {
            generation.insert("temperature".into(), json!(t));
        }
        if let Some(stop) = request.stop.as_ref().filter(|s| !s.is_empty()) {
            generation.insert("stopSequences".into(), json!(stop));
        }
        if request.response_format.as_deref() == Some("json") {
            generation.insert("responseMimeType".into(), json!("application/json"));
        }
        if !generation.is_empty() {
            body["generationConfig"] = Value::Object(generation);
        }
        body
    }

    fn http_error(&self, status: StatusCode, body: &str) -> ProviderError {
        let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        let err = &v["error"];
        let details = err["details"].as_array().cloned().unwrap_or_default();
        let key_invalid = details.iter().any(|d| d["reason"] == "API_KEY_INVALID")
            || err["message"]
                .as_str()
                .is_some_and(|m| m.contains("API key not valid"));
        let kind = if key_invalid {
            FailureKind::Auth
        } else {
            classify_status(status)
        };
        let detail: String = err["message"]
            .as_str()
            .unwrap_or("")
            .chars()
            .take(300)
            .collect();
        let message = match kind {
            FailureKind::Auth => format!(
                "gemini rejected the credential (HTTP {status}): check {}",
                self.config.credential_source
            ),
            _ => format!(
                "gemini answered HTTP {status} ({}): {detail}",
                err["status"].as_str().unwrap_or("error")
            ),
        };
        // The retry hint lives in the body: RetryInfo { retryDelay: "17s" }.
        let hint = details
            .iter()
            .find(|d| {
                d["@type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with("RetryInfo"))
            })
            .and_then(|d| d["retryDelay"].as_str())
            .and_then(|s| s.strip_suffix('s'))
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s >= 0.0)
            .map(Duration::from_secs_f64);
        ProviderError::new(kind, message).with_retry_after(hint)
    }
}

/// Decodes one `data:` payload; the last chunk carries `finish_reason`.
fn decode_event(data: &str) -> Result<Chunk, ProviderError> {
    let v: Value = serde_json::from_str(data).map_err(|e| {
        ProviderError::new(
            FailureKind::Protocol,
            format!("unreadable stream event: {e}"),
        )
    })?;
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        return Err(ProviderError::new(
            FailureKind::Stream,
            format!(
                "gemini reported an error mid-stream: {}",
                err["message"].as_str().unwrap_or("")
            ),
        ));
    }
    let candidate = &v["candidates"][0];
    if candidate.is_null()
        && let Some(reason) = v["promptFeedback"]["blockReason"].as_str()
    {
        return Err(ProviderError::new(
            FailureKind::BadRequest,
            format!("gemini blocked the prompt ({reason})"),
        ));
    }
    let text = candidate["content"]["parts"]
        .as_array()
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<String>()
        })
        .unwrap_or_default();
    let finish = candidate["finishReason"].as_str().map(str::to_owned);
    let u = &v["usageMetadata"];
    let usage = u.is_object().then(|| Usage {
        input: u["promptTokenCount"].as_u64().unwrap_or(0),
        output: u["candidatesTokenCount"].as_u64().unwrap_or(0)
            + u["thoughtsTokenCount"].as_u64().unwrap_or(0),
    });
    Ok(Chunk {
        text,
        usage,
        finish_reason: finish,
        ..Chunk::default()
    })
}

/// Decodes a streamed `streamGenerateContent?alt=sse` body into chunks. Public for the fuzz
/// targets (`fuzz/`); the provider calls it on the HTTP body.
#[doc(hidden)]
pub fn decode_stream(body: Body, timeouts: HttpTimeouts) -> ChunkStream {
    sse_body_chunks(
        body,
        timeouts,
        true,
        "the stream ended without a finishReason: the answer is incomplete",
        |event| {
            if event.data.trim().is_empty() {
                return Ok(SseStep::Skip);
            }
            Ok(SseStep::Chunk(decode_event(&event.data)?))
        },
    )
}

#[async_trait]
impl Provider for GeminiProvider {
    fn endpoint(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &'static str {
        match self.config.endpoint {
            GeminiEndpoint::AiStudio => "gemini",
            GeminiEndpoint::Vertex { .. } => "vertex",
        }
    }

    fn model(&self) -> &str {
        &self.config.model
    }

    fn supports_streaming(&self) -> bool {
        true
    }

    async fn generate_stream(
        &self,
        request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError> {
        let model = crate::providers::model_for(request, &self.config.model);
        let url = if model == self.config.model {
            std::borrow::Cow::Borrowed(self.url.as_str())
        } else {
            std::borrow::Cow::Owned(Self::url_for(&self.config, model))
        };
        let mut req = self.http.post(url.as_ref()).json(&self.body(request));
        if let Some(c) = &self.config.credential {
            req = match self.config.endpoint {
                GeminiEndpoint::AiStudio => req.header("x-goog-api-key", c.expose()),
                GeminiEndpoint::Vertex { .. } => req.bearer_auth(c.expose()),
            };
        }
        let resp = send(req, self.config.timeouts.first_token, |status, body| {
            self.http_error(status, body)
        })
        .await?;
        // No end event: the connection closing ends the answer, after a finishReason.
        Ok(decode_stream(
            resp.bytes_stream().boxed(),
            self.config.timeouts,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_decode_with_thoughts_counted_as_output() {
        let c = decode_event(r#"{"candidates":[{"content":{"parts":[{"text":"The"}],"role":"model"},"index":0}],"usageMetadata":{"promptTokenCount":9,"totalTokenCount":9}}"#).unwrap();
        assert_eq!((c.text.as_str(), c.finish_reason), ("The", None));
        assert_eq!(
            c.usage,
            Some(Usage {
                input: 9,
                output: 0
            })
        );
        let c = decode_event(r#"{"candidates":[{"content":{"parts":[{"text":" sky is blue."}],"role":"model"},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":6,"thoughtsTokenCount":25,"totalTokenCount":40}}"#).unwrap();
        assert_eq!(c.finish_reason.as_deref(), Some("STOP"));
        assert_eq!(
            c.usage,
            Some(Usage {
                input: 9,
                output: 31
            })
        );
        let e = decode_event(r#"{"promptFeedback":{"blockReason":"SAFETY"}}"#).unwrap_err();
        assert_eq!(e.kind, FailureKind::BadRequest);
        assert!(e.message.contains("SAFETY"));
    }

    #[test]
    fn errors_carry_the_body_retry_hint_and_a_bad_key_is_auth() {
        let p = GeminiProvider::new(GeminiConfig::new(GeminiEndpoint::AiStudio, "http://x", "m"))
            .unwrap();
        let e = p.http_error(StatusCode::TOO_MANY_REQUESTS, r#"{"error":{"code":429,"message":"quota","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"17s"}]}}"#);
        assert_eq!(
            (e.kind, e.retry_after),
            (FailureKind::RateLimited, Some(Duration::from_secs(17)))
        );
        let e = p.http_error(StatusCode::BAD_REQUEST, r#"{"error":{"code":400,"message":"API key not valid. Please pass a valid API key.","status":"INVALID_ARGUMENT","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID"}]}}"#);
        assert_eq!(e.kind, FailureKind::Auth);
        assert!(e.message.contains("GEMINI_API_KEY"));
        let v = GeminiProvider::new(GeminiConfig::new(
            GeminiEndpoint::Vertex {
                project: "p".into(),
                location: "us-central1".into(),
            },
            "https://us-central1-aiplatform.googleapis.com",
            "gemini-2.5-flash",
        ))
        .unwrap();
        assert_eq!(
            v.url,
            "https://us-central1-aiplatform.googleapis.com/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
        );
    }

    #[test]
    fn a_conversation_and_its_settings_map_onto_contents_and_the_model_path() {
        let config = GeminiConfig::new(GeminiEndpoint::AiStudio, "http://127.0.0.1:1", "m");
        let p = GeminiProvider::new(config.clone()).unwrap();
        let b = p.body(&crate::providers::conversation_request());
        assert_eq!(
            b["contents"][1],
            json!({"role": "model", "parts": [{"text": "Paris"}]})
        );
        assert_eq!(b["contents"].as_array().unwrap().len(), 3);
        assert_eq!(b["generationConfig"]["maxOutputTokens"], 9);
        assert_eq!(b["generationConfig"]["temperature"], 0.5);
        assert_eq!(b["generationConfig"]["stopSequences"], json!(["END"]));
        assert!(GeminiProvider::url_for(&config, "other-model").contains("/models/other-model:"));
    }
}
