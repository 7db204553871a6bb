//! Anthropic Messages: `POST {base}/v1/messages` with `x-api-key` and `anthropic-version`,
//! answered with SSE named events and no `[DONE]`.
//!
//! `message_start` carries the input tokens (plus cache creation and cache read tokens) and a
//! first output count. `content_block_delta` / `text_delta` carries text. `message_delta`
//! carries the stop reason and the output count as a RUNNING TOTAL that may repeat.
//! `message_stop` ends the stream. `ping`, block start/stop and unknown events are ignored;
//! `event: error` is a mid-stream failure. A stream without `message_stop` is truncated.
//!
//! Tools: a request's tools go as `tools` (`input_schema`), its choice as `tool_choice`
//! (`auto`, `any` for required, `tool` for a named one, `none`; `disable_parallel_tool_use`
//! when parallel calls are off). A conversation's tool calls go as `tool_use` blocks of the
//! assistant's message and its results as `tool_result` blocks of the user message after it
//! (all results of one turn in one message, as Anthropic requires). A streamed call is a
//! `tool_use` content block: `content_block_start` carries its id and name, `input_json_delta`
//! events the fragments of its input, in the block's own order, possibly interleaved with
//! other blocks' events; each block becomes one call, numbered in the order blocks began.
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
use sluice_schema::{
    ChatMessage, ChatRole, TextCompletionRequest, ToolCall, ToolCallDelta, ToolChoice, ToolMode,
};

use crate::{
    provider::{
        Chunk, ChunkStream, Completion, FailureKind, Provider, ProviderError, Usage, whole_calls,
    },
    providers::{
        Body, HttpTimeouts, SseStep, classify_status, http_client, portable_call_id, send,
        sse_body_chunks, transport_error,
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
        // Said at start-up, not as a failure of every request.
        super::endpoint_url(&url)?;
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

    fn body(
        &self,
        request: &TextCompletionRequest,
        streaming: bool,
    ) -> Result<Value, ProviderError> {
        let messages = if request.uses_tools() {
            // Anthropic refuses tool blocks in a request that declares no tools.
            if request.tools.as_ref().is_some_and(|t| !t.is_empty()) {
                tool_messages(request.turns())?
            } else {
                tool_messages(crate::providers::tool_turns_as_text(request.turns()))?
            }
        } else {
            request
                .turns()
                .into_iter()
                .map(|t| json!({"role": t.role.as_str(), "content": t.content}))
                .collect()
        };
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
        if let Some(tools) = request.tools.as_ref().filter(|t| !t.is_empty()) {
            body["tools"] = tools
                .iter()
                .map(|t| {
                    let mut tool = json!({"name": t.name, "input_schema": t.parameters});
                    if let Some(d) = &t.description {
                        tool["description"] = json!(d);
                    }
                    tool
                })
                .collect();
            // Anthropic's choice is an object; parallel calls are switched off inside it, so
            // `parallel_tool_calls: false` alone becomes `auto` without them.
            let mut choice = match &request.tool_choice {
                None | Some(ToolChoice::Mode(ToolMode::Auto)) => json!({"type": "auto"}),
                Some(ToolChoice::Mode(ToolMode::Required)) => json!({"type": "any"}),
                Some(ToolChoice::Mode(ToolMode::None)) => json!({"type": "none"}),
                Some(ToolChoice::Named { name }) => json!({"type": "tool", "name": name}),
            };
            let parallel_off = request.parallel_tool_calls == Some(false);
            // `none` takes no such flag: no call is made at all.
            if parallel_off && choice["type"] != "none" {
                choice["disable_parallel_tool_use"] = json!(true);
            }
            if request.tool_choice.is_some() || parallel_off {
                body["tool_choice"] = choice;
            }
        }
        Ok(body)
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

/// A conversation that uses tools as Messages `messages`, in content blocks: an assistant
/// turn's text then a `tool_use` block per call (its arguments parsed: Anthropic takes the
/// input as an object); a tool turn as a `tool_result` block of a user message. Turns of one
/// role in a row become one message: every result of a turn's calls must be in the single
/// user message after it, before any text of that message.
fn tool_messages(turns: Vec<ChatMessage>) -> Result<Vec<Value>, ProviderError> {
    let mut messages: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for turn in turns {
        let (role, blocks) = match turn.role {
            ChatRole::Tool => (
                "user",
                vec![json!({"type": "tool_result",
                    "tool_use_id": portable_call_id(turn.tool_call_id.as_deref().unwrap_or_default()),
                    "content": turn.content})],
            ),
            ChatRole::User => ("user", text_block(turn.content)),
            ChatRole::Assistant => {
                let mut blocks = text_block(turn.content);
                for call in &turn.tool_calls {
                    blocks.push(tool_use_block(call)?);
                }
                ("assistant", blocks)
            }
        };
        match messages.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => messages.push((role, blocks)),
        }
    }
    Ok(messages
        .into_iter()
        // A turn with nothing to say (no text, no call) is left out: Anthropic refuses
        // empty content.
        .filter(|(_, content)| !content.is_empty())
        .map(|(role, mut content)| {
            // A user message's tool results come before its text, as Anthropic wants.
            content.sort_by_key(|b| b["type"] != "tool_result");
            json!({"role": role, "content": content})
        })
        .collect())
}

/// A text block, or none for empty text (Anthropic refuses empty text blocks).
fn text_block(text: String) -> Vec<Value> {
    if text.is_empty() {
        Vec::new()
    } else {
        vec![json!({"type": "text", "text": text})]
    }
}

/// A call the model made earlier, as the `tool_use` block Anthropic wants back.
fn tool_use_block(call: &ToolCall) -> Result<Value, ProviderError> {
    let input = crate::providers::call_arguments(call, "Anthropic")?;
    Ok(
        json!({"type": "tool_use", "id": portable_call_id(&call.id), "name": call.name,
        "input": input}),
    )
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
        tool_calls: whole_calls(
            &blocks
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .zip(0..)
                .map(|(b, index)| ToolCallDelta {
                    index,
                    id: b["id"].as_str().map(str::to_owned),
                    name: b["name"].as_str().map(str::to_owned),
                    arguments: match &b["input"] {
                        Value::Null => "{}".to_owned(),
                        input => input.to_string(),
                    },
                })
                .collect::<Vec<_>>(),
        ),
        ..Completion::default()
    })
}

/// What one event means.
enum Event {
    Chunk(Chunk),
    Stop,
    Ignore,
}

/// A stream's decoder: the tool-use blocks begun so far, each block's index to its call's
/// number and whether any of its input came yet.
#[derive(Default)]
struct Decoder {
    calls: std::collections::HashMap<u64, (u32, bool)>,
}

impl Decoder {
    /// What the event `name` with `data` means.
    fn event(&mut self, name: &str, data: &str) -> Result<Event, ProviderError> {
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
        let block = v["index"].as_u64().unwrap_or(0);
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
        match kind {
            "content_block_start" if v["content_block"]["type"] == "tool_use" => {
                let b = &v["content_block"];
                let index = u32::try_from(self.calls.len()).unwrap_or(u32::MAX);
                // Anthropic starts the block with `input: {}` and streams the input after it;
                // a server that puts the whole input here sends no fragments.
                let given = b["input"]
                    .as_object()
                    .filter(|o| !o.is_empty())
                    .map(|o| Value::Object(o.clone()).to_string());
                self.calls.insert(block, (index, given.is_some()));
                Ok(piece(
                    index,
                    b["id"].as_str(),
                    b["name"].as_str(),
                    given.unwrap_or_default(),
                ))
            }
            "content_block_delta" if v["delta"]["type"] == "input_json_delta" => {
                let Some((index, any)) = self.calls.get_mut(&block) else {
                    return Err(ProviderError::new(
                        FailureKind::Protocol,
                        format!(
                            "input_json_delta for content block {block}, which is not a tool_use block"
                        ),
                    ));
                };
                let fragment = v["delta"]["partial_json"].as_str().unwrap_or("");
                if fragment.is_empty() {
                    return Ok(Event::Ignore);
                }
                *any = true;
                let index = *index;
                Ok(piece(index, None, None, fragment.to_owned()))
            }
            // A tool that takes no input ends with nothing streamed: its arguments are `{}`,
            // as OpenAI gives them, never the empty text no JSON reader takes.
            "content_block_stop" => match self.calls.get(&block) {
                Some(&(index, false)) => {
                    self.calls.insert(block, (index, true));
                    Ok(piece(index, None, None, "{}".to_owned()))
                }
                _ => Ok(Event::Ignore),
            },
            _ => decode_value(kind, &v),
        }
    }
}

/// What an event of `kind` other than a tool-use block's means.
fn decode_value(kind: &str, v: &Value) -> Result<Event, ProviderError> {
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
        {
            let mut decoder = Decoder::default();
            move |event| {
                Ok(match decoder.event(&event.event, &event.data)? {
                    Event::Stop => SseStep::End(None),
                    Event::Ignore => SseStep::Skip,
                    Event::Chunk(chunk) => SseStep::Chunk(chunk),
                })
            }
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

    fn supports_tools(&self) -> bool {
        true
    }

    async fn generate_stream(
        &self,
        request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError> {
        let resp = self
            .post(&self.url(request, true), &self.body(request, true)?)
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
            .post(&self.url(request, false), &self.body(request, false)?)
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
mod tests;
