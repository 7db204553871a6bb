//! The OpenAI chat-completions dialect: OpenAI, OpenAI-compatible servers by base URL
//! (vLLM, LM Studio, llamafile, TGI, llama.cpp's llama-server), Azure OpenAI and Mistral.
//! One request builder and one SSE decoder serve them all. The dialects differ in URL, auth
//! header, and whether `stream_options` may be sent.
//!
//! Wire facts: `data:` events ending with `data: [DONE]`.
//! Usage comes once, in a final chunk with `choices: []` or `null`. Azure's first chunk often
//! has empty choices and no usage, and its content-filter chunks may lack `delta`. A
//! mid-stream error arrives as `data: {"error": ...}`. A stream with neither `[DONE]` nor a
//! `finish_reason` is truncated, not complete.

use async_trait::async_trait;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;
use sluice_schema::{ChatRole, TextCompletionRequest, ToolCallDelta, ToolChoice, ToolMode};

use crate::{
    provider::{
        ChunkStream, Completion, FailureKind, Provider, ProviderError, ToolCallNumbering, Usage,
    },
    providers::{
        Body, HttpTimeouts, SseStep, classify_status, endpoint_url, http_client, model_for, send,
        sse_body_chunks, transport_error,
    },
};

/// Which member of the family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// api.openai.com.
    OpenAi,
    /// Any OpenAI-compatible server at a base URL.
    Compatible,
    /// Azure OpenAI: deployment URL, `api-key` header, `api-version` query.
    Azure,
    /// Mistral: usage arrives by itself; `stream_options` is refused with 422.
    Mistral,
}

/// Configuration for an OpenAI-dialect provider.
#[derive(Debug, Clone)]
pub struct OpenAiConfig {
    /// The dialect.
    pub dialect: Dialect,
    /// Base URL: `https://api.openai.com`, `http://127.0.0.1:8080`, `https://{resource}.openai.azure.com`.
    pub base_url: String,
    /// Model (for Azure: the deployment name).
    pub model: String,
    /// The API key, from env or file.
    pub api_key: Option<Secret>,
    /// Where the key comes from (e.g. `OPENAI_API_KEY`), named in auth errors.
    pub api_key_source: String,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Maximum output tokens.
    pub max_tokens: Option<u32>,
    /// Ask for usage in streams (`stream_options.include_usage`). Never sent to Mistral.
    pub include_usage: bool,
    /// Azure `api-version`.
    pub azure_api_version: String,
    /// Time limits.
    pub timeouts: HttpTimeouts,
}

impl OpenAiConfig {
    /// Defaults for `dialect` at `base_url` with `model`.
    pub fn new(dialect: Dialect, base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            dialect,
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            api_key_source: "the provider's API key setting".into(),
            temperature: None,
            max_tokens: None,
            include_usage: dialect != Dialect::Mistral,
            azure_api_version: "2024-10-21".into(),
            timeouts: HttpTimeouts::default(),
        }
    }
}

/// An OpenAI-dialect provider.
pub struct OpenAiProvider {
    config: OpenAiConfig,
    http: reqwest::Client,
    /// Parsed once: parsing it again per request cost a fifth of the instructions of
    /// building the provider call.
    url: reqwest::Url,
}

impl OpenAiProvider {
    /// Builds the provider (and its HTTP client).
    pub fn new(config: OpenAiConfig) -> Result<Self, ProviderError> {
        let http = http_client(&config.timeouts)?;
        let base = config.base_url.trim_end_matches('/');
        // Azure names the model (its deployment) in the path; a request for another of the
        // processor's models gets its own URL (see `url_for`).
        let url = match config.dialect {
            Dialect::Azure => format!(
                "{base}/openai/deployments/{}/chat/completions?api-version={}",
                config.model, config.azure_api_version
            ),
            _ if base.ends_with("/v1") => format!("{base}/chat/completions"),
            _ => format!("{base}/v1/chat/completions"),
        };
        let url = endpoint_url(&url)?;
        Ok(Self { config, http, url })
    }

    fn body(&self, request: &TextCompletionRequest, stream: bool) -> Value {
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
            }
            if !turn.tool_calls.is_empty() {
                if turn.content.is_empty() {
                    m["content"] = Value::Null;
                }
                // A Gemini call's signed id goes without its signature (portable_call_id).
                m["tool_calls"] = turn
                    .tool_calls
                    .iter()
                    .map(|c| {
                        sluice_schema::tools::openai_call(&sluice_schema::ToolCall {
                            id: crate::providers::portable_call_id(&c.id),
                            ..c.clone()
                        })
                    })
                    .collect();
            }
            messages.push(m);
        }
        let mut body = json!({"messages": messages, "stream": stream});
        if let Some(tools) = request.tools.as_ref().filter(|t| !t.is_empty()) {
            body["tools"] = tools
                .iter()
                .map(|t| {
                    let mut f = json!({"name": t.name, "parameters": t.parameters});
                    if let Some(d) = &t.description {
                        f["description"] = json!(d);
                    }
                    if let Some(strict) = t.strict {
                        f["strict"] = json!(strict);
                    }
                    json!({"type": "function", "function": f})
                })
                .collect();
            if let Some(p) = request.parallel_tool_calls {
                body["parallel_tool_calls"] = json!(p);
            }
        }
        // A choice without tools is refused by OpenAI: it means nothing without them.
        if let Some(choice) = request
            .tool_choice
            .as_ref()
            .filter(|_| request.tools.as_ref().is_some_and(|t| !t.is_empty()))
        {
            body["tool_choice"] = match choice {
                ToolChoice::Mode(ToolMode::Auto) => json!("auto"),
                ToolChoice::Mode(ToolMode::None) => json!("none"),
                // Mistral's word for it; OpenAI and compatible servers say `required`.
                ToolChoice::Mode(ToolMode::Required) if self.config.dialect == Dialect::Mistral => {
                    json!("any")
                }
                ToolChoice::Mode(ToolMode::Required) => json!("required"),
                ToolChoice::Named { name } => {
                    json!({"type": "function", "function": {"name": name}})
                }
            };
        }
        if self.config.dialect != Dialect::Azure {
            body["model"] = json!(model_for(request, &self.config.model));
        }
        if stream && self.config.include_usage && self.config.dialect != Dialect::Mistral {
            body["stream_options"] = json!({"include_usage": true});
        }
        if let Some(t) = request
            .temperature
            .or(self.config.temperature.map(f64::from))
        {
            body["temperature"] = json!(t);
        }
        if let Some(m) = request.max_tokens.or(self.config.max_tokens) {
            body["max_tokens"] = json!(m);
        }
        if let Some(stop) = request.stop.as_ref().filter(|s| !s.is_empty()) {
            body["stop"] = json!(stop);
        }
        if request.response_format.as_deref() == Some("json") {
            body["response_format"] = match &request.schema {
                Some(schema) => {
                    let mut f = json!({"name": "response", "schema": schema});
                    if let Some(strict) = request.schema_strict {
                        f["strict"] = json!(strict);
                    }
                    json!({"type": "json_schema", "json_schema": f})
                }
                None => json!({"type": "json_object"}),
            };
        }
        body
    }

    async fn post(
        &self,
        request: &TextCompletionRequest,
        body: &Value,
    ) -> Result<reqwest::Response, ProviderError> {
        let model = model_for(request, &self.config.model);
        let mut req = if self.config.dialect == Dialect::Azure && model != self.config.model {
            let base = self.config.base_url.trim_end_matches('/');
            self.http.post(format!(
                "{base}/openai/deployments/{model}/chat/completions?api-version={}",
                self.config.azure_api_version
            ))
        } else {
            self.http.post(self.url.clone())
        }
        .json(body);
        if let Some(key) = &self.config.api_key {
            req = match self.config.dialect {
                Dialect::Azure => req.header("api-key", key.expose()),
                _ => req.bearer_auth(key.expose()),
            };
        }
        send(req, self.config.timeouts.first_token, |status, body| {
            self.http_error(status, body)
        })
        .await
    }

    fn http_error(&self, status: StatusCode, body: &str) -> ProviderError {
        let parsed: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        let err = &parsed["error"];
        let detail = err["message"]
            .as_str()
            .or_else(|| parsed["message"].as_str())
            .unwrap_or("")
            .chars()
            .take(300)
            .collect::<String>();
        let code = [&err["code"], &err["type"]]
            .iter()
            .filter_map(|v| v.as_str())
            .collect::<Vec<_>>();
        let mut kind = classify_status(status);
        if status == StatusCode::TOO_MANY_REQUESTS && code.contains(&"insufficient_quota") {
            kind = FailureKind::Quota;
        }
        let name = self.name();
        let message = match kind {
            FailureKind::Auth => format!(
                "{name} rejected the API key (HTTP {status}): check {}{}",
                self.config.api_key_source,
                if self.config.api_key.is_none() {
                    " (it is not set)"
                } else {
                    ""
                }
            ),
            FailureKind::Permission => {
                format!("{name} refused the request for this key (HTTP {status}): {detail}")
            }
            FailureKind::Quota => format!(
                "{name} says the account is out of quota (HTTP {status}): {detail}; add credit or raise the limit"
            ),
            FailureKind::RateLimited => {
                format!("{name} rate-limited the request (HTTP {status}): {detail}")
            }
            _ => format!("{name} answered HTTP {status}: {detail}"),
        };
        ProviderError::new(kind, message)
    }
}

/// Decodes one `data:` payload of the dialect into a chunk; `Ok(None)` for chunks that carry
/// nothing (role announcements, Azure's prompt-filter chunk).
fn decode_event(data: &str) -> Result<Option<crate::provider::Chunk>, ProviderError> {
    let v: Value = serde_json::from_str(data).map_err(|e| {
        ProviderError::new(
            FailureKind::Protocol,
            format!("unreadable stream event: {e}"),
        )
    })?;
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        let message = err["message"].as_str().unwrap_or("unknown error");
        return Err(ProviderError::new(
            FailureKind::Stream,
            format!("the provider reported an error mid-stream: {message}"),
        ));
    }
    let choice = v["choices"].as_array().and_then(|c| c.first());
    let text = choice
        .and_then(|c| c["delta"]["content"].as_str())
        .unwrap_or("")
        .to_owned();
    let finish_reason = choice
        .and_then(|c| c["finish_reason"].as_str())
        .map(str::to_owned);
    let usage = v.get("usage").filter(|u| u.is_object()).map(|u| Usage {
        input: u["prompt_tokens"].as_u64().unwrap_or(0),
        output: u["completion_tokens"].as_u64().unwrap_or(0),
    });
    let tool_calls = choice
        .and_then(|c| c["delta"]["tool_calls"].as_array())
        .map(|calls| tool_call_pieces(calls))
        .unwrap_or_default();
    if text.is_empty() && usage.is_none() && finish_reason.is_none() && tool_calls.is_empty() {
        return Ok(None);
    }
    Ok(Some(crate::provider::Chunk {
        text,
        usage,
        finish_reason,
        answered_by: None,
        tool_calls,
    }))
}

/// The `tool_calls` of a delta (or of a whole message) as pieces. A piece without an `index`
/// (some compatible servers send each call whole, unnumbered) takes its place in the array.
fn tool_call_pieces(calls: &[Value]) -> Vec<ToolCallDelta> {
    calls
        .iter()
        .zip(0u32..)
        .map(|(c, position)| ToolCallDelta {
            index: c["index"]
                .as_u64()
                .and_then(|i| u32::try_from(i).ok())
                .unwrap_or(position),
            id: c["id"]
                .as_str()
                .filter(|i| !i.is_empty())
                .map(str::to_owned),
            name: c["function"]["name"]
                .as_str()
                .filter(|n| !n.is_empty())
                .map(str::to_owned),
            // Arguments are JSON text; a server that sends them as an object gets them
            // written out.
            arguments: match &c["function"]["arguments"] {
                Value::String(a) => a.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            },
        })
        .collect()
}

/// Decodes a streamed response body of the dialect into chunks. Public for the fuzz targets
/// (`fuzz/`); the provider calls it on the HTTP body.
#[doc(hidden)]
pub fn decode_stream(body: Body, timeouts: HttpTimeouts) -> ChunkStream {
    let mut numbering = ToolCallNumbering::default();
    let chunks = sse_body_chunks(
        body,
        timeouts,
        true,
        "the stream ended without [DONE] or a finish_reason: the answer is incomplete",
        |event| {
            let data = event.data.trim();
            if data == "[DONE]" {
                return Ok(SseStep::End(None));
            }
            if data.is_empty() {
                return Ok(SseStep::Skip);
            }
            Ok(decode_event(data)?.map_or(SseStep::Skip, SseStep::Chunk))
        },
    );
    chunks
        .map(move |item| {
            item.map(|mut chunk| {
                if !chunk.tool_calls.is_empty() {
                    chunk.tool_calls = numbering.number(std::mem::take(&mut chunk.tool_calls));
                }
                chunk
            })
        })
        .boxed()
}

#[async_trait]
impl Provider for OpenAiProvider {
    fn endpoint(&self) -> &str {
        self.url.as_str()
    }

    fn name(&self) -> &'static str {
        match self.config.dialect {
            Dialect::OpenAi => "openai",
            Dialect::Compatible => "openai-compatible",
            Dialect::Azure => "azure",
            Dialect::Mistral => "mistral",
        }
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

    async fn generate_stream(
        &self,
        request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError> {
        let resp = self.post(request, &self.body(request, true)).await?;
        Ok(decode_stream(
            resp.bytes_stream().boxed(),
            self.config.timeouts,
        ))
    }

    async fn generate(&self, request: &TextCompletionRequest) -> Result<Completion, ProviderError> {
        let resp = self.post(request, &self.body(request, false)).await?;
        let v: Value = tokio::time::timeout(self.config.timeouts.first_token, resp.json())
            .await
            .map_err(|_| {
                ProviderError::new(
                    FailureKind::Timeout,
                    format!("no answer within {:?}", self.config.timeouts.first_token),
                )
            })?
            .map_err(|e| transport_error(&e))?;
        let choice = &v["choices"][0];
        // A whole message lists each call once: its place in the list is its index,
        // whatever `index` a server wrote on it.
        let tool_calls = choice["message"]["tool_calls"]
            .as_array()
            .map(|calls| {
                let mut pieces = tool_call_pieces(calls);
                for (p, position) in pieces.iter_mut().zip(0u32..) {
                    p.index = position;
                }
                crate::provider::whole_calls(&pieces)
            })
            .unwrap_or_default();
        // `content` is null on an answer that is only tool calls.
        let text = match choice["message"]["content"].as_str() {
            Some(t) => t,
            None if !tool_calls.is_empty() => "",
            None => {
                return Err(ProviderError::new(
                    FailureKind::Protocol,
                    "the answer has no choices[0].message.content",
                ));
            }
        };
        Ok(Completion {
            tool_calls,
            text: text.to_owned(),
            usage: v.get("usage").filter(|u| u.is_object()).map(|u| Usage {
                input: u["prompt_tokens"].as_u64().unwrap_or(0),
                output: u["completion_tokens"].as_u64().unwrap_or(0),
            }),
            finish_reason: choice["finish_reason"].as_str().map(str::to_owned),
            answered_by: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_text_usage_finish_and_skips_empty_chunks() {
        let c = decode_event(
            r#"{"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.text, "Hel");
        let u =
            decode_event(r#"{"choices":[],"usage":{"prompt_tokens":37,"completion_tokens":12}}"#)
                .unwrap()
                .unwrap();
        assert_eq!(
            u.usage,
            Some(Usage {
                input: 37,
                output: 12
            })
        );
        let n =
            decode_event(r#"{"choices":null,"usage":{"prompt_tokens":1,"completion_tokens":2}}"#)
                .unwrap()
                .unwrap();
        assert_eq!(
            n.usage,
            Some(Usage {
                input: 1,
                output: 2
            })
        );
        // Azure's prompt-filter chunk: empty choices, no usage.
        assert_eq!(
            decode_event(r#"{"id":"","choices":[],"prompt_filter_results":[{}]}"#).unwrap(),
            None
        );
        // Azure content-filter chunk without delta.
        assert_eq!(
            decode_event(r#"{"choices":[{"index":0,"content_filter_results":{}}]}"#).unwrap(),
            None
        );
        let f = decode_event(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#)
            .unwrap()
            .unwrap();
        assert_eq!(f.finish_reason.as_deref(), Some("stop"));
    }

    /// JSON mode, a schema, and a strict schema, as OpenAI takes them.
    #[test]
    fn structured_output_maps_onto_response_format() {
        let p = OpenAiProvider::new(OpenAiConfig::new(
            Dialect::OpenAi,
            "http://127.0.0.1:1",
            "m",
        ))
        .unwrap();
        let mut req = TextCompletionRequest {
            prompt: "x".into(),
            response_format: Some("json".into()),
            ..Default::default()
        };
        assert_eq!(
            p.body(&req, true)["response_format"],
            json!({"type": "json_object"})
        );
        req.schema = Some(json!({"type": "object"}));
        assert_eq!(
            p.body(&req, true)["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "response", "schema": {"type": "object"}}})
        );
        req.schema_strict = Some(true);
        assert_eq!(
            p.body(&req, true)["response_format"]["json_schema"]["strict"],
            true
        );
    }

    /// Tools, a named choice and a conversation with a tool call and its result, as OpenAI
    /// takes them; Mistral's word for `required`.
    #[test]
    fn tools_and_tool_turns_map_onto_chat_completions() {
        use sluice_schema::{ChatMessage, Tool, ToolCall};
        let p = |d| OpenAiProvider::new(OpenAiConfig::new(d, "http://127.0.0.1:1", "m")).unwrap();
        let mut call = ChatMessage::new(ChatRole::Assistant, "");
        call.tool_calls = vec![ToolCall {
            id: "c1".into(),
            name: "f".into(),
            arguments: "{\"x\":1}".into(),
        }];
        let mut result = ChatMessage::new(ChatRole::Tool, "42");
        result.tool_call_id = Some("c1".into());
        let mut req = TextCompletionRequest {
            messages: Some(vec![ChatMessage::new(ChatRole::User, "go"), call, result]),
            tools: Some(vec![Tool {
                name: "f".into(),
                description: Some("does f".into()),
                parameters: json!({"type": "object"}),
                strict: Some(true),
            }]),
            tool_choice: Some(ToolChoice::Named { name: "f".into() }),
            parallel_tool_calls: Some(false),
            ..Default::default()
        };
        let b = p(Dialect::OpenAi).body(&req, true);
        assert_eq!(
            b["tools"],
            json!([{"type": "function", "function": {"name": "f", "description": "does f",
                "parameters": {"type": "object"}, "strict": true}}])
        );
        assert_eq!(
            b["tool_choice"],
            json!({"type": "function", "function": {"name": "f"}})
        );
        assert_eq!(b["parallel_tool_calls"], false);
        assert_eq!(
            b["messages"][1],
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]})
        );
        assert_eq!(
            b["messages"][2],
            json!({"role": "tool", "content": "42", "tool_call_id": "c1"})
        );
        req.tool_choice = Some(ToolChoice::Mode(ToolMode::Required));
        assert_eq!(p(Dialect::Mistral).body(&req, true)["tool_choice"], "any");
        assert_eq!(
            p(Dialect::OpenAi).body(&req, true)["tool_choice"],
            "required"
        );
    }

    /// Streamed tool calls: the first piece with id and name, fragments after; a piece with
    /// no index takes its place; arguments sent as an object are written out.
    #[test]
    fn streamed_tool_call_pieces_decode() {
        let first = decode_event(
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]},"finish_reason":null}]}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            first.tool_calls,
            [ToolCallDelta {
                index: 0,
                id: Some("call_1".into()),
                name: Some("f".into()),
                arguments: String::new()
            }]
        );
        let more = decode_event(
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"{\"a\""}}]}}]}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(more.tool_calls[0].index, 1);
        assert_eq!(more.tool_calls[0].arguments, "{\"a\"");
        assert_eq!(more.tool_calls[0].id, None);
        let unnumbered = tool_call_pieces(&[
            json!({"id": "a", "function": {"name": "f", "arguments": {"x": 1}}}),
            json!({"id": "b", "function": {"name": "g", "arguments": "{}"}}),
        ]);
        assert_eq!(unnumbered[1].index, 1);
        assert_eq!(unnumbered[0].arguments, "{\"x\":1}");
    }

    /// Servers that number every parallel call 0, or repeat a call's id and name on each
    /// piece, still give the records one call per id, its first piece alone naming it.
    #[test]
    fn tool_calls_are_renumbered_by_their_ids() {
        let piece = |index, id: Option<&str>, name: Option<&str>, args: &str| ToolCallDelta {
            index,
            id: id.map(str::to_owned),
            name: name.map(str::to_owned),
            arguments: args.into(),
        };
        let mut n = ToolCallNumbering::default();
        let got: Vec<ToolCallDelta> = [
            piece(0, Some("a"), Some("f"), "{"),
            piece(0, Some("a"), Some("f"), "}"),
            piece(0, Some("b"), Some("g"), "{"),
            piece(0, None, None, "}"),
        ]
        .into_iter()
        .flat_map(|p| n.number(vec![p]))
        .collect();
        assert_eq!(
            got,
            [
                piece(0, Some("a"), Some("f"), "{"),
                piece(0, None, None, "}"),
                piece(1, Some("b"), Some("g"), "{"),
                piece(1, None, None, "}"),
            ]
        );
        let calls = sluice_schema::tools::assemble(&got);
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[1].id.as_str(), calls[1].arguments.as_str()),
            ("b", "{}")
        );
    }

    #[test]
    fn a_mid_stream_error_event_is_a_stream_error() {
        let e = decode_event(r#"{"error":{"message":"overloaded","type":"server_error"}}"#)
            .unwrap_err();
        assert_eq!(e.kind, FailureKind::Stream);
        assert!(e.message.contains("overloaded"));
    }

    #[test]
    fn urls_and_bodies_follow_the_dialect() {
        let p = |d, base: &str| OpenAiProvider::new(OpenAiConfig::new(d, base, "m")).unwrap();
        assert_eq!(
            p(Dialect::OpenAi, "https://api.openai.com").url.as_str(),
            "https://api.openai.com/v1/chat/completions"
        );
        assert_eq!(
            p(Dialect::Compatible, "http://127.0.0.1:8080/v1/")
                .url
                .as_str(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            p(Dialect::Azure, "https://r.openai.azure.com").url.as_str(),
            "https://r.openai.azure.com/openai/deployments/m/chat/completions?api-version=2024-10-21"
        );
        // A base URL that is not one is said when the provider is built, without repeating it.
        let e = OpenAiProvider::new(OpenAiConfig::new(
            Dialect::Compatible,
            "127.0.0.1:8080",
            "m",
        ))
        .err()
        .unwrap();
        assert!(e.message.contains("not a valid URL"), "{e:?}");
        assert!(!e.message.contains("127.0.0.1"), "{e:?}");
        // One that parses but that no HTTP client can call: `http://` left out, another scheme.
        for (url, why) in [
            (
                "localhost:11434/v1",
                "scheme is `localhost`, not http or https",
            ),
            ("ftp://files.example/v1", "scheme is `ftp`"),
        ] {
            let e = OpenAiProvider::new(OpenAiConfig::new(Dialect::Compatible, url, "m"))
                .err()
                .unwrap();
            assert!(e.message.contains(why), "{url}: {e:?}");
            assert!(
                !e.message.contains("11434") && !e.message.contains("files.example"),
                "{e:?}"
            );
        }
        let req = TextCompletionRequest {
            system: "s".into(),
            prompt: "p".into(),
            ..Default::default()
        };
        let mistral = p(Dialect::Mistral, "https://api.mistral.ai").body(&req, true);
        assert!(
            mistral.get("stream_options").is_none(),
            "Mistral refuses stream_options"
        );
        let openai = p(Dialect::OpenAi, "https://api.openai.com").body(&req, true);
        assert_eq!(openai["stream_options"]["include_usage"], true);
        assert_eq!(openai["messages"][0]["role"], "system");
        assert!(
            p(Dialect::Azure, "https://r")
                .body(&req, true)
                .get("model")
                .is_none()
        );
    }

    #[test]
    fn a_conversation_and_its_settings_map_onto_chat_completions() {
        let p = OpenAiProvider::new(OpenAiConfig::new(
            Dialect::OpenAi,
            "http://127.0.0.1:1",
            "m",
        ))
        .unwrap();
        let b = p.body(&crate::providers::conversation_request(), true);
        assert_eq!(b["model"], "other-model");
        assert_eq!(
            b["messages"][0],
            json!({"role": "system", "content": "one word"})
        );
        assert_eq!(
            b["messages"][2],
            json!({"role": "assistant", "content": "Paris"})
        );
        assert_eq!(
            b["messages"][3],
            json!({"role": "user", "content": "Italy?"})
        );
        assert_eq!(b["temperature"], 0.5);
        assert_eq!(b["max_tokens"], 9);
        assert_eq!(b["stop"], json!(["END"]));
    }
}
