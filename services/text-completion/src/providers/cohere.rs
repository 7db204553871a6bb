//! Cohere v2 chat: `POST {base}/v2/chat` with a bearer key, answered with SSE.
//!
//! Events: `message-start`, `content-start`, `content-delta` (text in
//! `delta.message.content.text`), `content-end`, tool and citation events (ignored), and
//! `message-end`. `message-end` ends the stream and carries `finish_reason` (which may be
//! `ERROR`) and usage: `tokens` (what the model processed, used here) and `billed_units`. A
//! `[DONE]` may follow. A stream without `message-end` is truncated. Errors are
//! `{"message": "..."}`.
//!
//! Structured output: `response_format: {"type": "json_object"}`, with the schema as its
//! `json_schema` when there is one.
//!
//! Tools: a request's tools go as `tools` (OpenAI's function shape), `required` and `none` as
//! `tool_choice` `REQUIRED` and `NONE`; Cohere cannot be made to call one named tool, so that
//! choice is refused rather than ignored, and it has no switch for parallel calls. A streamed
//! call is `tool-call-start` (its `index`, id and name in `delta.message.tool_calls`, an
//! object), `tool-call-delta` argument fragments, `tool-call-end` (`{}` for a call without
//! arguments); the model's `tool-plan-delta` text before its calls is answer text.
//! `finish_reason: TOOL_CALL` is `tool_calls`. Calls go back as the assistant's `tool_calls`
//! with its text as `tool_plan`, results as `tool` messages with their `tool_call_id`.

use async_trait::async_trait;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;
use sluice_schema::{ChatRole, TextCompletionRequest, ToolCallDelta, ToolChoice, ToolMode};

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
        // Said at start-up, not as a failure of every request.
        super::endpoint_url(&url)?;
        Ok(Self { config, http, url })
    }

    fn body(&self, request: &TextCompletionRequest) -> Result<Value, ProviderError> {
        let mut messages = Vec::new();

        if !request.system.is_empty() {
            messages.push(json!({"role": "system", "content": request.system}));
        }
        for turn in request.turns() {
            let mut m = json!({"role": turn.role.as_str(), "content": turn.content});
            if turn.role == ChatRole::Tool {
                m["tool_call_id"] = json!(crate::providers::portable_call_id(
                    turn.tool_call_id.as_deref().unwrap_or_default()
                ));
            } else if !turn.tool_calls.is_empty() {
                // Cohere takes what the model said before its calls as the plan, not content;
                // a call without arguments as `{}`, as the others do.
                let calls: Vec<Value> = turn
                    .tool_calls
                    .iter()
                    .map(|c| {
                        sluice_schema::tools::openai_call(&sluice_schema::ToolCall {
                            id: crate::providers::portable_call_id(&c.id),
                            name: c.name.clone(),
                            arguments: if c.arguments.trim().is_empty() {
                                "{}".to_owned()
                            } else {
                                c.arguments.clone()
                            },
                        })
                    })
                    .collect();
                m = json!({"role": "assistant", "tool_calls": calls});
                if !turn.content.is_empty() {
                    m["tool_plan"] = json!(turn.content);
                }
            }
            messages.push(m);
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
        // Cohere takes no `response_format` together with tools: the processor checks the
        // answer then (`holds_structured_output`).
        if request.response_format.as_deref() == Some("json")
            && self.holds_structured_output(request)
        {
            body["response_format"] = match &request.schema {
                Some(schema) => json!({"type": "json_object", "json_schema": schema}),
                None => json!({"type": "json_object"}),
            };
        }
        if let Some(tools) = request.tools.as_ref().filter(|t| !t.is_empty()) {
            body["tools"] = tools
                .iter()
                .map(|t| {
                    let mut f = json!({"name": t.name, "parameters": t.parameters});
                    if let Some(d) = &t.description {
                        f["description"] = json!(d);
                    }
                    json!({"type": "function", "function": f})
                })
                .collect();
            match &request.tool_choice {
                None | Some(ToolChoice::Mode(ToolMode::Auto)) => {}
                Some(ToolChoice::Mode(ToolMode::Required)) => {
                    body["tool_choice"] = json!("REQUIRED")
                }
                Some(ToolChoice::Mode(ToolMode::None)) => body["tool_choice"] = json!("NONE"),
                Some(ToolChoice::Named { .. }) => {
                    return Err(ProviderError::unsendable(
                        "cohere cannot be made to call one named tool: use `required`, or offer only that tool",
                    ));
                }
            }
        }
        Ok(body)
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

/// A stream's decoder: the calls begun, Cohere's index to ours and whether any arguments came.
#[derive(Default)]
struct Decoder {
    calls: std::collections::HashMap<u64, (u32, bool)>,
}

impl Decoder {
    fn event(&mut self, name: &str, data: &str) -> Result<Event, ProviderError> {
        // Events named only by their `type` (no `event:` line) are read the same way.
        let typed: Option<Value> = (name.is_empty() || name == "message")
            .then(|| serde_json::from_str(data).ok())
            .flatten();
        let kind = typed
            .as_ref()
            .and_then(|v| v["type"].as_str())
            .unwrap_or(name);
        let tool_event = matches!(
            kind,
            "tool-call-start" | "tool-call-delta" | "tool-call-end" | "tool-plan-delta"
        );
        if !tool_event {
            return decode_event(name, data);
        }
        let v: Value = serde_json::from_str(data).map_err(|e| {
            ProviderError::new(
                FailureKind::Protocol,
                format!("unreadable stream event: {e}"),
            )
        })?;
        let at = v["index"].as_u64().unwrap_or(0);
        let call = &v["delta"]["message"]["tool_calls"];
        let piece = |index, id: Option<&str>, name: Option<&str>, arguments: String| {
            Event::Chunk(Chunk {
                tool_calls: vec![ToolCallDelta {
                    index,
                    id: id.map(str::to_owned),
                    name: name.map(str::to_owned),
                    arguments,
                }],
                ..Chunk::default()
            })
        };
        Ok(match kind {
            "tool-plan-delta" => Event::Chunk(Chunk {
                text: v["delta"]["message"]["tool_plan"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned(),
                ..Chunk::default()
            }),
            "tool-call-start" => {
                let index = u32::try_from(self.calls.len()).unwrap_or(u32::MAX);
                let arguments = call["function"]["arguments"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned();
                self.calls.insert(at, (index, !arguments.is_empty()));
                piece(
                    index,
                    call["id"].as_str(),
                    call["function"]["name"].as_str(),
                    arguments,
                )
            }
            "tool-call-delta" => {
                let Some((index, any)) = self.calls.get_mut(&at) else {
                    return Err(ProviderError::new(
                        FailureKind::Protocol,
                        format!("tool-call-delta for call {at}, which never started"),
                    ));
                };
                let fragment = call["function"]["arguments"].as_str().unwrap_or("");
                if fragment.is_empty() {
                    return Ok(Event::Ignore);
                }
                *any = true;
                piece(*index, None, None, fragment.to_owned())
            }
            // A call without arguments: `{}`, never empty arguments.
            _ => match self.calls.get(&at).copied() {
                Some((index, false)) => {
                    self.calls.insert(at, (index, true));
                    piece(index, None, None, "{}".to_owned())
                }
                _ => Event::Ignore,
            },
        })
    }
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
        {
            let mut decoder = Decoder::default();
            move |event| {
                Ok(match decoder.event(&event.event, &event.data)? {
                    Event::Ignore => SseStep::Skip,
                    Event::Chunk(chunk) => SseStep::Chunk(chunk),
                    // message-end: its usage, then nothing (a trailing [DONE] is not read).
                    Event::End(chunk) => SseStep::End(Some(chunk)),
                })
            }
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

    fn supports_tools(&self) -> bool {
        true
    }

    fn supports_structured_output(&self) -> bool {
        true
    }

    fn holds_structured_output(&self, request: &TextCompletionRequest) -> bool {
        request.tools.as_ref().is_none_or(Vec::is_empty)
    }

    async fn generate_stream(
        &self,
        request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError> {
        let body = self.body(request)?;
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
        let b = p.body(&crate::providers::conversation_request()).unwrap();
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

    /// Tools, each choice, and a conversation with a call (after some text) and its result,
    /// as Cohere wants them; a named choice refused.
    #[test]
    fn tools_choices_and_tool_turns_map_onto_v2_chat() {
        use sluice_schema::{ChatMessage, Tool, ToolCall};
        let p = CohereProvider::new(CohereConfig::new("http://127.0.0.1:1", "m")).unwrap();
        let mut call = ChatMessage::new(ChatRole::Assistant, "I will check.");
        call.tool_calls = vec![ToolCall {
            id: "c1".into(),
            name: "weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        }];
        let mut result = ChatMessage::new(ChatRole::Tool, "sunny");
        result.tool_call_id = Some("c1".into());
        let mut req = TextCompletionRequest {
            messages: Some(vec![
                ChatMessage::new(ChatRole::User, "Paris?"),
                call,
                result,
            ]),
            tools: Some(vec![Tool {
                name: "weather".into(),
                description: None,
                parameters: json!({"type": "object"}),
                strict: None,
            }]),
            ..Default::default()
        };
        let b = p.body(&req).unwrap();
        assert_eq!(
            b["tools"],
            json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}])
        );
        assert!(b.get("tool_choice").is_none());
        assert_eq!(
            b["messages"][1],
            json!({"role": "assistant", "tool_plan": "I will check.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]})
        );
        assert_eq!(
            b["messages"][2],
            json!({"role": "tool", "content": "sunny", "tool_call_id": "c1"})
        );
        req.tool_choice = Some(ToolChoice::Mode(ToolMode::Required));
        assert_eq!(p.body(&req).unwrap()["tool_choice"], "REQUIRED");
        req.tool_choice = Some(ToolChoice::Mode(ToolMode::None));
        assert_eq!(p.body(&req).unwrap()["tool_choice"], "NONE");
        req.tool_choice = Some(ToolChoice::Named {
            name: "weather".into(),
        });
        assert!(p.body(&req).unwrap_err().unsendable);
    }

    /// A plan, then two calls: start with id and name, argument fragments, `{}` for the call
    /// without arguments; named or typed events alike.
    #[test]
    fn tool_call_events_decode_into_pieces() {
        let mut d = Decoder::default();
        let mut text = String::new();
        let mut pieces = Vec::new();
        let mut feed =
            |d: &mut Decoder, name: &str, v: Value| match d.event(name, &v.to_string()).unwrap() {
                Event::Chunk(c) => {
                    text.push_str(&c.text);
                    pieces.extend(c.tool_calls);
                }
                Event::End(_) | Event::Ignore => {}
            };
        feed(
            &mut d,
            "tool-plan-delta",
            json!({"type": "tool-plan-delta", "delta": {"message": {"tool_plan": "I will check."}}}),
        );
        feed(
            &mut d,
            "tool-call-start",
            json!({"type": "tool-call-start", "index": 0, "delta": {"message": {"tool_calls": {"id": "weather_1", "type": "function", "function": {"name": "weather", "arguments": ""}}}}}),
        );
        feed(
            &mut d,
            "tool-call-delta",
            json!({"type": "tool-call-delta", "index": 0, "delta": {"message": {"tool_calls": {"function": {"arguments": "{\"city\":"}}}}}),
        );
        feed(
            &mut d,
            "",
            json!({"type": "tool-call-delta", "index": 0, "delta": {"message": {"tool_calls": {"function": {"arguments": "\"Paris\"}"}}}}}),
        );
        feed(
            &mut d,
            "tool-call-end",
            json!({"type": "tool-call-end", "index": 0}),
        );
        feed(
            &mut d,
            "tool-call-start",
            json!({"type": "tool-call-start", "index": 1, "delta": {"message": {"tool_calls": {"id": "time_2", "type": "function", "function": {"name": "time", "arguments": ""}}}}}),
        );
        feed(
            &mut d,
            "tool-call-end",
            json!({"type": "tool-call-end", "index": 1}),
        );
        assert_eq!(text, "I will check.");
        assert_eq!(
            sluice_schema::tools::assemble(&pieces),
            vec![
                sluice_schema::ToolCall {
                    id: "weather_1".into(),
                    name: "weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into()
                },
                sluice_schema::ToolCall {
                    id: "time_2".into(),
                    name: "time".into(),
                    arguments: "{}".into()
                },
            ]
        );
        let e = Decoder::default()
            .event("tool-call-delta", r#"{"type":"tool-call-delta","index":5,"delta":{"message":{"tool_calls":{"function":{"arguments":"{"}}}}}"#)
            .err()
            .unwrap();
        assert_eq!(e.kind, FailureKind::Protocol);
    }
}
