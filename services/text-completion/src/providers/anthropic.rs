//! Anthropic Messages: `POST {base}/v1/messages` with `x-api-key` and `anthropic-version`,
//! answered with SSE named events and no `[DONE]`.
//!
//! `message_start` carries the input tokens (plus cache creation and cache read tokens) and a
//! first output count. `content_block_delta` / `text_delta` carries text. `message_delta`
//! carries the stop reason and the output count as a RUNNING TOTAL that may repeat.
//! `message_stop` ends the stream. `ping`, block start/stop and unknown events are ignored;
//! `event: error` is a mid-stream failure. A stream without `message_stop` is truncated.
//!
//! The same Messages API is served by Vertex AI for Anthropic's models ([`AnthropicEndpoint::Vertex`]):
//! `POST {base}/v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:streamRawPredict`
//! (`:rawPredict` for a whole answer) with an OAuth bearer token. The body carries no `model`
//! (it is in the path) and `anthropic_version: vertex-2023-10-16` in place of the header; the
//! events and the whole-answer JSON are Anthropic's. Errors come in Anthropic's shape from the
//! model or in Google's (`{"error":{"code","message","status"}}`) from Vertex's front end
//! (token, quota). As for Gemini on Vertex, sluice reads a token the platform keeps fresh; it
//! does not mint one.

use std::borrow::Cow;

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;
use sluice_schema::TextCompletionRequest;

use crate::{
    provider::{Chunk, ChunkStream, Completion, FailureKind, Provider, ProviderError, Usage},
    providers::{
        Body, HttpTimeouts, SseStep, classify_status, http_client, send, sse_body_chunks,
        transport_error,
    },
};

/// The `anthropic_version` Vertex AI wants in the body (Anthropic's API takes a header).
const VERTEX_ANTHROPIC_VERSION: &str = "vertex-2023-10-16";

/// Where the Messages API is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnthropicEndpoint {
    /// Anthropic's API: `{base}/v1/messages`, key in `x-api-key`, `anthropic-version` header.
    Anthropic,
    /// Vertex AI: `{base}/v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:streamRawPredict`
    /// (`:rawPredict` whole), OAuth bearer token, `anthropic_version` in the body.
    Vertex {
        /// GCP project.
        project: String,
        /// Region, e.g. `us-east5`, or `global`.
        location: String,
    },
}

/// Configuration for the Anthropic provider.
#[derive(Debug, Clone)]
pub struct AnthropicConfig {
    /// Anthropic's API or Vertex AI.
    pub endpoint: AnthropicEndpoint,
    /// Base URL: `https://api.anthropic.com` by default; for Vertex, the origin
    /// [`crate::providers::vertex_origin`] gives.
    pub base_url: String,
    /// Model, e.g. `claude-sonnet-4-5` (Vertex: `claude-sonnet-4-5@20250929`).
    pub model: String,
    /// The API key (Anthropic) or OAuth access token (Vertex), from env or file.
    pub credential: Option<Secret>,
    /// Where the credential comes from, named in auth errors.
    pub credential_source: String,
    /// Maximum output tokens (required by the API).
    pub max_tokens: u32,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Time limits.
    pub timeouts: HttpTimeouts,
}

impl AnthropicConfig {
    /// Defaults for `model` at Anthropic's API at `base_url`.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            endpoint: AnthropicEndpoint::Anthropic,
            base_url: base_url.into(),
            model: model.into(),
            credential: None,
            credential_source: "ANTHROPIC_API_KEY".into(),
            max_tokens: 1024,
            temperature: None,
            timeouts: HttpTimeouts::default(),
        }
    }

    /// Defaults for `model` on Vertex AI in `project` and `location`, at `base_url`.
    pub fn vertex(
        project: impl Into<String>,
        location: impl Into<String>,
        base_url: impl Into<String>,
        model: impl Into<String>,
    ) -> Self {
        Self {
            endpoint: AnthropicEndpoint::Vertex {
                project: project.into(),
                location: location.into(),
            },
            credential_source: "VERTEX_ACCESS_TOKEN".into(),
            ..Self::new(base_url, model)
        }
    }
}

/// The Anthropic provider.
pub struct AnthropicProvider {
    config: AnthropicConfig,
    http: reqwest::Client,
    /// The streaming URL of the configured model.
    url: String,
}

impl AnthropicProvider {
    /// Builds the provider.
    pub fn new(config: AnthropicConfig) -> Result<Self, ProviderError> {
        let http = http_client(&config.timeouts)?;
        let url = Self::url_for(&config, &config.model, true);
        Ok(Self { config, http, url })
    }

    /// The URL of a call for `model`: Vertex names the model and whether the answer streams in
    /// the path; Anthropic's API has one URL and reads both from the body.
    fn url_for(config: &AnthropicConfig, model: &str, streaming: bool) -> String {
        let base = config.base_url.trim_end_matches('/');
        match &config.endpoint {
            AnthropicEndpoint::Anthropic => format!("{base}/v1/messages"),
            AnthropicEndpoint::Vertex { project, location } => {
                let verb = if streaming {
                    "streamRawPredict"
                } else {
                    "rawPredict"
                };
                format!(
                    "{base}/v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:{verb}"
                )
            }
        }
    }

    /// The URL for `request`, built only when it differs from the configured model's stream.
    fn url(&self, request: &TextCompletionRequest, streaming: bool) -> Cow<'_, str> {
        let model = crate::providers::model_for(request, &self.config.model);
        if streaming && model == self.config.model {
            Cow::Borrowed(&self.url)
        } else {
            Cow::Owned(Self::url_for(&self.config, model, streaming))
        }
    }

    fn body(&self, request: &TextCompletionRequest, streaming: bool) -> Value {
        let messages: Vec<Value> = request
            .turns()
            .into_iter()
            .map(|t| json!({"role": t.role.as_str(), "content": t.content}))
            .collect();
        let mut body = json!({
            "max_tokens": request.max_tokens.unwrap_or(self.config.max_tokens),
            "messages": messages,
        });
        match self.config.endpoint {
            AnthropicEndpoint::Anthropic => {
                body["model"] = json!(crate::providers::model_for(request, &self.config.model));
            }
            // Vertex names the model in the URL, and takes the version here, not as a header.
            AnthropicEndpoint::Vertex { .. } => {
                body["anthropic_version"] = json!(VERTEX_ANTHROPIC_VERSION);
            }
        }
        if streaming {
            body["stream"] = json!(true);
        }
        if !request.system.is_empty() {
            body["system"] = json!(request.system);
        }
        if let Some(t) = request
            .temperature
            .or(self.config.temperature.map(f64::from))
        {
            body["temperature"] = json!(t);
        }
        if let Some(stop) = request.stop.as_ref().filter(|s| !s.is_empty()) {
            body["stop_sequences"] = json!(stop);
        }
        body
    }

    /// The error for a non-2xx answer. Both error shapes keep the text in `error.message`;
    /// Anthropic names the error in `error.type`, Google (Vertex's front end) in
    /// `error.status`. The kind comes from the HTTP status either way.
    fn http_error(&self, status: reqwest::StatusCode, body: &str) -> ProviderError {
        let parsed: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        let err = &parsed["error"];
        let detail: String = err["message"]
            .as_str()
            .unwrap_or("")
            .chars()
            .take(300)
            .collect();
        let label = err["type"]
            .as_str()
            .or(err["status"].as_str())
            .unwrap_or("error");
        let (who, credential) = match self.config.endpoint {
            AnthropicEndpoint::Anthropic => ("anthropic", "API key"),
            AnthropicEndpoint::Vertex { .. } => ("vertex-anthropic", "access token"),
        };
        let kind = classify_status(status);
        let message = match kind {
            // The provider's text for a bad credential helps nobody; where it comes from does.
            FailureKind::Auth => format!(
                "{who} rejected the {credential} (HTTP {status}): check {}",
                self.config.credential_source
            ),
            // A 403 names what the credential may not do (a permission, a model not enabled
            // in the project), so its text is kept beside where the credential comes from.
            FailureKind::Permission => format!(
                "{who} refused the {credential} (HTTP {status}, {label}): check {}: {detail}",
                self.config.credential_source
            ),
            _ => format!("{who} answered HTTP {status} ({label}): {detail}"),
        };
        ProviderError::new(kind, message)
    }

    /// Sends `body` to `url` with this endpoint's credential and headers.
    async fn post(&self, url: &str, body: &Value) -> Result<reqwest::Response, ProviderError> {
        let mut req = self.http.post(url).json(body);
        if self.config.endpoint == AnthropicEndpoint::Anthropic {
            // Vertex takes the version in the body instead.
            req = req.header("anthropic-version", "2023-06-01");
        }
        if let Some(c) = &self.config.credential {
            req = match self.config.endpoint {
                AnthropicEndpoint::Anthropic => req.header("x-api-key", c.expose()),
                AnthropicEndpoint::Vertex { .. } => req.bearer_auth(c.expose()),
            };
        }
        send(req, self.config.timeouts.first_token, |status, body| {
            self.http_error(status, body)
        })
        .await
    }
}

/// The input count of a Messages `usage` object: cache writes and reads are input too.
fn input_tokens(usage: &Value) -> u64 {
    [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ]
    .iter()
    .filter_map(|k| usage[*k].as_u64())
    .sum()
}

/// Decodes a whole (non-streamed) Messages answer: its text blocks, usage and stop reason.
fn decode_message(v: &Value) -> Result<Completion, ProviderError> {
    let blocks = v["content"].as_array().ok_or_else(|| {
        ProviderError::new(FailureKind::Protocol, "the answer has no content blocks")
    })?;
    let u = &v["usage"];
    Ok(Completion {
        text: blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b["text"].as_str())
            .collect(),
        usage: u.is_object().then(|| Usage {
            input: input_tokens(u),
            output: u["output_tokens"].as_u64().unwrap_or(0),
        }),
        finish_reason: v["stop_reason"].as_str().map(str::to_owned),
        ..Completion::default()
    })
}

/// What one event means.
enum Event {
    Chunk(Chunk),
    Stop,
    Ignore,
}

fn decode_event(name: &str, data: &str) -> Result<Event, ProviderError> {
    let v: Value = serde_json::from_str(data).map_err(|e| {
        ProviderError::new(
            FailureKind::Protocol,
            format!("unreadable stream event: {e}"),
        )
    })?;
    let kind = if name.is_empty() || name == "message" {
        v["type"].as_str().unwrap_or("")
    } else {
        name
    };
    Ok(match kind {
        "message_start" => {
            let u = &v["message"]["usage"];
            Event::Chunk(Chunk {
                usage: Some(Usage {
                    input: input_tokens(u),
                    output: u["output_tokens"].as_u64().unwrap_or(0),
                }),
                ..Chunk::default()
            })
        }
        "content_block_delta" if v["delta"]["type"] == "text_delta" => Event::Chunk(Chunk {
            text: v["delta"]["text"].as_str().unwrap_or("").to_owned(),
            ..Chunk::default()
        }),
        "message_delta" => Event::Chunk(Chunk {
            // A running total; the input count is not repeated here, so only output moves.
            usage: v["usage"]["output_tokens"]
                .as_u64()
                .map(|output| Usage { input: 0, output }),
            finish_reason: v["delta"]["stop_reason"].as_str().map(str::to_owned),
            ..Chunk::default()
        }),
        "message_stop" => Event::Stop,
        "error" => {
            return Err(ProviderError::new(
                FailureKind::Stream,
                format!(
                    "anthropic reported {} mid-stream: {}",
                    v["error"]["type"].as_str().unwrap_or("an error"),
                    v["error"]["message"].as_str().unwrap_or("")
                ),
            ));
        }
        _ => Event::Ignore,
    })
}

/// Decodes a streamed Messages response body into chunks. Public for the fuzz targets
/// (`fuzz/`); the provider calls it on the HTTP body.
#[doc(hidden)]
pub fn decode_stream(body: Body, timeouts: HttpTimeouts) -> ChunkStream {
    sse_body_chunks(
        body,
        timeouts,
        false,
        "the stream ended without message_stop: the answer is incomplete",
        |event| {
            Ok(match decode_event(&event.event, &event.data)? {
                Event::Stop => SseStep::End(None),
                Event::Ignore => SseStep::Skip,
                Event::Chunk(chunk) => SseStep::Chunk(chunk),
            })
        },
    )
}

#[async_trait]
impl Provider for AnthropicProvider {
    fn endpoint(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &'static str {
        match self.config.endpoint {
            AnthropicEndpoint::Anthropic => "anthropic",
            AnthropicEndpoint::Vertex { .. } => "vertex-anthropic",
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
        let resp = self
            .post(&self.url(request, true), &self.body(request, true))
            .await?;
        // message_delta's output-only totals read input 0; the handler's usage merge keeps
        // message_start's input count.
        Ok(decode_stream(
            resp.bytes_stream().boxed(),
            self.config.timeouts,
        ))
    }

    async fn generate(&self, request: &TextCompletionRequest) -> Result<Completion, ProviderError> {
        // Vertex has a non-streaming verb of its own (`rawPredict`); Anthropic's API is called
        // as before, its stream collected.
        if self.config.endpoint == AnthropicEndpoint::Anthropic {
            return crate::provider::collect(self.generate_stream(request).await?).await;
        }
        let resp = self
            .post(&self.url(request, false), &self.body(request, false))
            .await?;
        let limit = self.config.timeouts.first_token;
        let v: Value = tokio::time::timeout(limit, resp.json())
            .await
            .map_err(|_| {
                ProviderError::new(FailureKind::Timeout, format!("no answer within {limit:?}"))
            })?
            .map_err(|e| transport_error(&e))?;
        decode_message(&v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(name: &str, data: &str) -> Chunk {
        match decode_event(name, data).unwrap() {
            Event::Chunk(c) => c,
            _ => panic!("not a chunk"),
        }
    }

    #[test]
    fn events_decode_with_cache_tokens_counted_as_input() {
        let c = chunk(
            "message_start",
            r#"{"type":"message_start","message":{"usage":{"input_tokens":25,"cache_read_input_tokens":5,"output_tokens":1}}}"#,
        );
        assert_eq!(
            c.usage,
            Some(Usage {
                input: 30,
                output: 1
            })
        );
        let c = chunk(
            "content_block_delta",
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
        );
        assert_eq!(c.text, "Hello");
        let c = chunk(
            "message_delta",
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}"#,
        );
        assert_eq!(c.finish_reason.as_deref(), Some("end_turn"));
        assert!(matches!(
            decode_event("ping", r#"{"type":"ping"}"#).unwrap(),
            Event::Ignore
        ));
        assert!(matches!(
            decode_event("message_stop", r#"{"type":"message_stop"}"#).unwrap(),
            Event::Stop
        ));
        let e = decode_event(
            "error",
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        )
        .err()
        .unwrap();
        assert_eq!(e.kind, FailureKind::Stream);
        assert!(e.message.contains("overloaded_error"));
    }

    #[test]
    fn a_conversation_and_its_settings_map_onto_messages() {
        let p = AnthropicProvider::new(AnthropicConfig::new("http://127.0.0.1:1", "m")).unwrap();
        let b = p.body(&crate::providers::conversation_request(), true);
        assert_eq!(b["model"], "other-model");
        assert_eq!(b["stream"], true);
        assert!(b.get("anthropic_version").is_none());
        assert_eq!(b["system"], "one word");
        assert_eq!(
            b["messages"],
            json!([{"role": "user", "content": "France?"},
                   {"role": "assistant", "content": "Paris"},
                   {"role": "user", "content": "Italy?"}])
        );
        assert_eq!(b["max_tokens"], 9);
        assert_eq!(b["temperature"], 0.5);
        assert_eq!(b["stop_sequences"], json!(["END"]));
    }

    fn vertex(location: &str, model: &str) -> AnthropicProvider {
        let origin = crate::providers::vertex_origin(location);
        AnthropicProvider::new(AnthropicConfig::vertex("p", location, origin, model)).unwrap()
    }

    #[test]
    fn vertex_urls_name_the_project_location_model_and_verb() {
        let p = vertex("us-east5", "claude-sonnet-4-5@20250929");
        let path = "/v1/projects/p/locations/us-east5/publishers/anthropic/models";
        assert_eq!(
            p.url,
            format!(
                "https://us-east5-aiplatform.googleapis.com{path}/claude-sonnet-4-5@20250929:streamRawPredict"
            )
        );
        let other = crate::providers::conversation_request();
        assert_eq!(
            p.url(&other, false),
            format!("https://us-east5-aiplatform.googleapis.com{path}/other-model:rawPredict")
        );
        assert_eq!(
            p.url(&other, true),
            format!(
                "https://us-east5-aiplatform.googleapis.com{path}/other-model:streamRawPredict"
            )
        );
        let g = vertex("global", "claude-sonnet-4-5@20250929");
        assert_eq!(
            g.url,
            "https://aiplatform.googleapis.com/v1/projects/p/locations/global/publishers/anthropic/models/claude-sonnet-4-5@20250929:streamRawPredict"
        );
        assert_eq!(g.name(), "vertex-anthropic");
    }

    #[test]
    fn a_vertex_body_names_the_version_and_not_the_model() {
        let p = vertex("us-east5", "m");
        let request = crate::providers::conversation_request();
        let b = p.body(&request, true);
        assert!(b.get("model").is_none(), "{b}");
        assert_eq!(b["anthropic_version"], "vertex-2023-10-16");
        assert_eq!(b["stream"], true);
        assert_eq!(b["system"], "one word");
        assert_eq!(b["messages"].as_array().map(Vec::len), Some(3));
        assert_eq!(b["max_tokens"], 9);
        assert_eq!(b["stop_sequences"], json!(["END"]));
        let b = p.body(&request, false);
        assert!(b.get("stream").is_none() && b.get("model").is_none(), "{b}");
        assert_eq!(b["anthropic_version"], "vertex-2023-10-16");
    }

    #[test]
    fn errors_in_either_shape_are_described_and_auth_names_the_token_source() {
        let p = vertex("us-east5", "m");
        let e = p.http_error(
            reqwest::StatusCode::TOO_MANY_REQUESTS,
            r#"{"error":{"code":429,"message":"Quota exceeded","status":"RESOURCE_EXHAUSTED"}}"#,
        );
        assert_eq!(e.kind, FailureKind::RateLimited);
        assert!(
            e.message.contains("RESOURCE_EXHAUSTED") && e.message.contains("Quota exceeded"),
            "{}",
            e.message
        );
        let e = p.http_error(
            reqwest::StatusCode::from_u16(529).unwrap(),
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        assert_eq!(e.kind, FailureKind::Server);
        assert!(
            e.message.contains("(overloaded_error): Overloaded"),
            "{}",
            e.message
        );
        for status in [401, 403] {
            let e = p.http_error(
                reqwest::StatusCode::from_u16(status).unwrap(),
                r#"{"error":{"code":401,"message":"Request had invalid authentication credentials.","status":"UNAUTHENTICATED"}}"#,
            );
            assert!(e.message.contains("VERTEX_ACCESS_TOKEN"), "{}", e.message);
        }
    }

    #[test]
    fn a_whole_answer_decodes_its_text_blocks_usage_and_stop_reason() {
        let done = decode_message(
            &json!({"id": "msg_1", "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "Hello"}, {"type": "thinking", "thinking": "hm"},
                        {"type": "text", "text": " there"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 20, "cache_read_input_tokens": 5, "output_tokens": 15}}),
        )
        .unwrap();
        assert_eq!(done.text, "Hello there");
        assert_eq!(
            done.usage,
            Some(Usage {
                input: 25,
                output: 15
            })
        );
        assert_eq!(done.finish_reason.as_deref(), Some("end_turn"));
        let e = decode_message(&json!({"type": "message"})).unwrap_err();
        assert_eq!(e.kind, FailureKind::Protocol);
    }
}
