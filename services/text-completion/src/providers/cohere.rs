//! Cohere v2 chat: `POST {base}/v2/chat` with a bearer key, answered with SSE.
//!
//! Events: `message-start`, `content-start`, `content-delta` (text in
//! `delta.message.content.text`), `content-end`, tool and citation events (ignored), and
//! `message-end`. `message-end` ends the stream and carries `finish_reason` (which may be
//! `ERROR`) and usage: `tokens` (what the model processed, used here) and `billed_units`. A
//! `[DONE]` may follow. A stream without `message-end` is truncated. Errors are
//! `{"message": "..."}`.

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

/// Configuration for Cohere.
#[derive(Debug, Clone)]
pub struct CohereConfig {
    /// Base URL, `https://api.cohere.com` by default.
    pub base_url: String,
    /// Model, e.g. `command-a-03-2025`.
    pub model: String,
    /// The API key.
    pub api_key: Option<Secret>,
    /// Where the key comes from, named in auth errors.
    pub api_key_source: String,
    /// Maximum output tokens.
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Time limits.
    pub timeouts: HttpTimeouts,
}

impl CohereConfig {
    /// Defaults for `model` at `base_url`.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            api_key_source: "COHERE_API_KEY".into(),
            max_tokens: None,
            temperature: None,
            timeouts: HttpTimeouts::default(),
        }
    }
}

/// The Cohere provider.
pub struct CohereProvider {
    config: CohereConfig,
    http: reqwest::Client,
    url: String,
}

impl CohereProvider {
    /// Builds the provider.
    pub fn new(config: CohereConfig) -> Result<Self, ProviderError> {
        let http = http_client(&config.timeouts)?;
        let url = format!("{}/v2/chat", config.base_url.trim_end_matches('/'));
        Ok(Self { config, http, url })
    }

    fn body(&self, request: &TextCompletionRequest) -> Value {
        let mut messages = Vec::new();

        if !request.system.is_empty() {
            messages.push(json!({"role": "system", "content": request.system}));
        }
        for turn in request.turns() {
            messages.push(json!({"role": turn.role.as_str(), "content": turn.content}));
        }
        let model = crate::providers::model_for(request, &self.config.model);
        let mut body = json!({"model": model, "messages": messages, "stream": true});
        if let Some(m) = request.max_tokens.or(self.config.max_tokens) {
            body["max_tokens"] = json!(m);
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

    fn http_error(&self, status: StatusCode, body: &str) -> ProviderError {
        let detail: String = serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or_default()
            .chars()
            .take(300)
            .collect();
        let kind = classify_status(status);
        let message = match kind {
            FailureKind::Auth => format!(
                "cohere rejected the API key (HTTP {status}): check {}",
                self.config.api_key_source
            ),
            _ => format!("cohere answered HTTP {status}: {detail}"),
        };
        ProviderError::new(kind, message)
    }
}

enum Event {
    Chunk(Chunk),
    End(Chunk),
    Ignore,
}

fn decode_event(name: &str, data: &str) -> Result<Event, ProviderError> {
    if data.trim() == "[DONE]" {
        return Ok(Event::Ignore);
    }
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
        "content-delta" => Event::Chunk(Chunk {
            text: v["delta"]["message"]["content"]["text"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
            ..Chunk::default()
        }),
        "message-end" => {
            let delta = &v["delta"];
            let finish = delta["finish_reason"].as_str().unwrap_or("COMPLETE");
            if finish == "ERROR" {
                return Err(ProviderError::new(
                    FailureKind::Stream,
                    "cohere ended the message with finish_reason ERROR",
                ));
            }
            let usage = &delta["usage"];
            let counts = if usage["tokens"].is_object() {
                &usage["tokens"]
            } else {
                &usage["billed_units"]
            };
            Event::End(Chunk {
                usage: counts.is_object().then(|| Usage {
                    input: counts["input_tokens"].as_u64().unwrap_or(0),
                    output: counts["output_tokens"].as_u64().unwrap_or(0),
                }),
                finish_reason: Some(finish.to_owned()),
                ..Chunk::default()
            })
        }
        _ => Event::Ignore,
    })
}

/// Decodes a streamed v2 chat response body into chunks. Public for the fuzz targets
/// (`fuzz/`); the provider calls it on the HTTP body.
#[doc(hidden)]
pub fn decode_stream(body: Body, timeouts: HttpTimeouts) -> ChunkStream {
    sse_body_chunks(
        body,
        timeouts,
        false,
        "the stream ended without message-end: the answer is incomplete",
        |event| {
            Ok(match decode_event(&event.event, &event.data)? {
                Event::Ignore => SseStep::Skip,
                Event::Chunk(chunk) => SseStep::Chunk(chunk),
                // message-end: its usage, then nothing (a trailing [DONE] is not read).
                Event::End(chunk) => SseStep::End(Some(chunk)),
            })
        },
    )
}

#[async_trait]
impl Provider for CohereProvider {
    fn endpoint(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &'static str {
        "cohere"
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
        let body = self.body(request);
        let mut req = self.http.post(&self.url).json(&body);
        if let Some(key) = &self.config.api_key {
            req = req.bearer_auth(key.expose());
        }
        let resp = send(req, self.config.timeouts.first_token, |status, body| {
            self.http_error(status, body)
        })
        .await?;
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
    fn deltas_and_the_end_decode_and_an_error_finish_fails() {
        let Event::Chunk(c) = decode_event(
            "content-delta",
            r#"{"type":"content-delta","index":0,"delta":{"message":{"content":{"text":"Hi"}}}}"#,
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(c.text, "Hi");
        let Event::End(c) = decode_event("message-end", r#"{"type":"message-end","delta":{"finish_reason":"COMPLETE","usage":{"billed_units":{"input_tokens":21,"output_tokens":105},"tokens":{"input_tokens":186,"output_tokens":105}}}}"#).unwrap() else { panic!() };
        assert_eq!(
            c.usage,
            Some(Usage {
                input: 186,
                output: 105
            })
        );
        let e = decode_event(
            "message-end",
            r#"{"type":"message-end","delta":{"finish_reason":"ERROR"}}"#,
        )
        .err()
        .unwrap();
        assert_eq!(e.kind, FailureKind::Stream);
        assert!(matches!(
            decode_event("citation-start", "{}").unwrap(),
            Event::Ignore
        ));
    }

    #[test]
    fn a_conversation_and_its_settings_map_onto_cohere_v2() {
        let p = CohereProvider::new(CohereConfig::new("http://127.0.0.1:1", "m")).unwrap();
        let b = p.body(&crate::providers::conversation_request());
        assert_eq!(b["model"], "other-model");
        assert_eq!(
            b["messages"][0],
            json!({"role": "system", "content": "one word"})
        );
        assert_eq!(
            b["messages"][2],
            json!({"role": "assistant", "content": "Paris"})
        );
        assert_eq!(b["messages"].as_array().unwrap().len(), 4);
        assert_eq!(b["temperature"], 0.5);
        assert_eq!(b["max_tokens"], 9);
        assert_eq!(b["stop_sequences"], json!(["END"]));
    }
}
