//! Anthropic Messages: `POST {base}/v1/messages` with `x-api-key` and `anthropic-version`,
//! answered with SSE named events and no `[DONE]`.
//!
//! `message_start` carries the input tokens (plus cache creation and cache read tokens) and a
//! first output count. `content_block_delta` / `text_delta` carries text. `message_delta`
//! carries the stop reason and the output count as a RUNNING TOTAL that may repeat.
//! `message_stop` ends the stream. `ping`, block start/stop and unknown events are ignored;
//! `event: error` is a mid-stream failure. A stream without `message_stop` is truncated.

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;
use sluice_schema::TextCompletionRequest;

use crate::{
    provider::{Chunk, ChunkStream, FailureKind, Provider, ProviderError, Usage},
    providers::{Body, HttpTimeouts, SseStep, classify_status, http_client, send, sse_body_chunks},
};

/// Configuration for the Anthropic provider.
#[derive(Debug, Clone)]
pub struct AnthropicConfig {
    /// Base URL, `https://api.anthropic.com` by default.
    pub base_url: String,
    /// Model, e.g. `claude-sonnet-4-5`.
    pub model: String,
    /// The API key, from env or file.
    pub api_key: Option<Secret>,
    /// Where the key comes from, named in auth errors.
    pub api_key_source: String,
    /// Maximum output tokens (required by the API).
    pub max_tokens: u32,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Time limits.
    pub timeouts: HttpTimeouts,
}

impl AnthropicConfig {
    /// Defaults for `model` at `base_url`.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            api_key_source: "ANTHROPIC_API_KEY".into(),
            max_tokens: 1024,
            temperature: None,
            timeouts: HttpTimeouts::default(),
        }
    }
}

/// The Anthropic provider.
pub struct AnthropicProvider {
    config: AnthropicConfig,
    http: reqwest::Client,
    url: String,
}

impl AnthropicProvider {
    /// Builds the provider.
    pub fn new(config: AnthropicConfig) -> Result<Self, ProviderError> {
        let http = http_client(&config.timeouts)?;
        let url = format!("{}/v1/messages", config.base_url.trim_end_matches('/'));
        Ok(Self { config, http, url })
    }

    fn body(&self, request: &TextCompletionRequest) -> Value {
        let messages: Vec<Value> = request
            .turns()
            .into_iter()
            .map(|t| json!({"role": t.role.as_str(), "content": t.content}))
            .collect();
        let mut body = json!({
            "model": crate::providers::model_for(request, &self.config.model),
            "max_tokens": request.max_tokens.unwrap_or(self.config.max_tokens),
            "messages": messages,
            "stream": true,
        });
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

    fn http_error(&self, status: reqwest::StatusCode, body: &str) -> ProviderError {
        let parsed: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        let detail: String = parsed["error"]["message"]
            .as_str()
            .unwrap_or("")
            .chars()
            .take(300)
            .collect();
        let kind = classify_status(status);
        let message = match kind {
            FailureKind::Auth => format!(
                "anthropic rejected the API key (HTTP {status}): check {}",
                self.config.api_key_source
            ),
            _ => format!(
                "anthropic answered HTTP {status} ({}): {detail}",
                parsed["error"]["type"].as_str().unwrap_or("error")
            ),
        };
        ProviderError::new(kind, message)
    }
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
            let input = [
                "input_tokens",
                "cache_creation_input_tokens",
                "cache_read_input_tokens",
            ]
            .iter()
            .filter_map(|k| u[*k].as_u64())
            .sum();
            Event::Chunk(Chunk {
                usage: Some(Usage {
                    input,
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
        "anthropic"
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
        let mut req = self
            .http
            .post(&self.url)
            .header("anthropic-version", "2023-06-01")
            .json(&self.body(request));
        if let Some(key) = &self.config.api_key {
            req = req.header("x-api-key", key.expose());
        }
        let resp = send(req, self.config.timeouts.first_token, |status, body| {
            self.http_error(status, body)
        })
        .await?;
        // message_delta's output-only totals read input 0; the handler's usage merge keeps
        // message_start's input count.
        Ok(decode_stream(
            resp.bytes_stream().boxed(),
            self.config.timeouts,
        ))
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
        let b = p.body(&crate::providers::conversation_request());
        assert_eq!(b["model"], "other-model");
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
}
