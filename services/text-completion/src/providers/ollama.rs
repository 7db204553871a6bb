//! Ollama's native API: `POST {base}/api/chat`, answered with NDJSON
//! (docs/protocol.md#streamed-json-lines).
//!
//! Each line is `{"message":{"content":"..."},"done":false}`. The last line has `done:true`
//! with the totals: `prompt_eval_count` (missing when the prompt was cached, which reads as
//! 0) and `eval_count`. Errors are `{"error":"..."}`, both as an HTTP error body and as a line
//! after a 200. A stream that ends without `done:true` is truncated. `options` carries
//! `temperature`, `num_ctx` (the context window) and `num_predict`.
//!
//! Tools: a request's tools go as `tools` (OpenAI's function shape). Ollama has no tool
//! choice: `none` leaves the tools out, `auto` sends them, and `required` or a named tool,
//! which it cannot honour, is refused rather than ignored. A call comes whole in a line's
//! `message.tool_calls` (`function.name`, `function.arguments` as an object, an `id` from
//! newer servers; one is made where none is given); calls are numbered across the stream, and
//! `done_reason: stop` after calls is `tool_calls`. Calls go back as the assistant's
//! `tool_calls` and results as `tool` messages with the called tool's `tool_name` (found by
//! the call's id in the conversation) and its `tool_call_id`.

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_runtime::{
    ndjson::{LineError, LineSplitter},
    secret::Secret,
};
use sluice_schema::{ChatRole, TextCompletionRequest, ToolCallDelta, ToolChoice, ToolMode};
use tracing::warn;

use crate::{
    provider::{Chunk, ChunkStream, Completion, FailureKind, Provider, ProviderError, Usage},
    providers::{
        Body, HttpTimeouts, classify_status, decode_timeouts, http_client, send, transport_error,
    },
};

/// Longest NDJSON line accepted from Ollama (one token's line is ~200 bytes).
const MAX_LINE: usize = 1024 * 1024;

/// Configuration for the Ollama provider.
#[derive(Debug, Clone)]
pub struct OllamaConfig {
    /// Base URL, e.g. `http://127.0.0.1:11434`.
    pub base_url: String,
    /// Model, e.g. `llama3.2`.
    pub model: String,
    /// Optional bearer key, for an Ollama behind an authenticating proxy.
    pub api_key: Option<Secret>,
    /// Where the key comes from, named in auth errors.
    pub api_key_source: String,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Context window (`num_ctx`).
    pub num_ctx: Option<u32>,
    /// Maximum output tokens (`num_predict`).
    pub num_predict: Option<u32>,
    /// Time limits.
    pub timeouts: HttpTimeouts,
}

impl OllamaConfig {
    /// Defaults for `model` at `base_url`.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            api_key_source: "the Ollama API key setting".into(),
            temperature: None,
            num_ctx: None,
            num_predict: None,
            timeouts: HttpTimeouts::default(),
        }
    }
}

/// The Ollama provider.
pub struct OllamaProvider {
    config: OllamaConfig,
    http: reqwest::Client,
    url: String,
}

impl OllamaProvider {
    /// Builds the provider.
    pub fn new(config: OllamaConfig) -> Result<Self, ProviderError> {
        let http = http_client(&config.timeouts)?;
        let url = format!("{}/api/chat", config.base_url.trim_end_matches('/'));
        // Said at start-up, not as a failure of every request.
        super::endpoint_url(&url)?;
        Ok(Self { config, http, url })
    }

    fn body(&self, request: &TextCompletionRequest, stream: bool) -> Result<Value, ProviderError> {
        let mut messages = Vec::new();
        if !request.system.is_empty() {
            messages.push(json!({"role": "system", "content": request.system}));
        }
        let turns = request.turns();
        for (at, turn) in turns.iter().enumerate() {
            let mut m = json!({"role": turn.role.as_str(), "content": turn.content});
            if !turn.tool_calls.is_empty() {
                m["tool_calls"] = turn
                    .tool_calls
                    .iter()
                    .map(|c| {
                        let arguments = crate::providers::call_arguments(c, "ollama")?;
                        Ok(json!({"id": crate::providers::portable_call_id(&c.id),
                            "function": {"name": c.name, "arguments": arguments}}))
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .into();
            }
            if turn.role == ChatRole::Tool {
                let id = turn.tool_call_id.as_deref().unwrap_or("");
                // Ollama matches a result to its call by the tool's name.
                if let Some(call) = crate::providers::call_answered(&turns[..at], id) {
                    m["tool_name"] = json!(call.name);
                }
                m["tool_call_id"] = json!(crate::providers::portable_call_id(id));
            }
            messages.push(m);
        }
        let mut options = serde_json::Map::new();
        if let Some(t) = request
            .temperature
            .or(self.config.temperature.map(f64::from))
        {
            options.insert("temperature".into(), json!(t));
        }
        if let Some(n) = self.config.num_ctx {
            options.insert("num_ctx".into(), json!(n));
        }
        if let Some(n) = request.max_tokens.or(self.config.num_predict) {
            options.insert("num_predict".into(), json!(n));
        }
        if let Some(stop) = request.stop.as_ref().filter(|s| !s.is_empty()) {
            options.insert("stop".into(), json!(stop));
        }
        let model = crate::providers::model_for(request, &self.config.model);
        let mut body = json!({"model": model, "messages": messages, "stream": stream});
        if !options.is_empty() {
            body["options"] = Value::Object(options);
        }
        if request.response_format.as_deref() == Some("json") {
            body["format"] = request.schema.clone().unwrap_or_else(|| json!("json"));
        }
        if let Some(tools) = request.tools.as_ref().filter(|t| !t.is_empty()) {
            match &request.tool_choice {
                None | Some(ToolChoice::Mode(ToolMode::Auto)) => {
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
                }
                // No tools offered: no call can be made, as `none` asks.
                Some(ToolChoice::Mode(ToolMode::None)) => {}
                Some(ToolChoice::Mode(ToolMode::Required) | ToolChoice::Named { .. }) => {
                    return Err(ProviderError::unsendable(
                        "ollama has no tool choice: it cannot be made to call a tool (`required` or a named tool); leave tool_choice out",
                    ));
                }
            }
        }
        Ok(body)
    }

    async fn post(&self, body: &Value) -> Result<reqwest::Response, ProviderError> {
        let mut req = self.http.post(&self.url).json(body);
        if let Some(key) = &self.config.api_key {
            req = req.bearer_auth(key.expose());
        }
        send(req, self.config.timeouts.first_token, |status, body| {
            let detail: String = serde_json::from_str::<Value>(body)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_owned))
                .unwrap_or_else(|| body.to_owned())
                .chars()
                .take(300)
                .collect();
            let kind = classify_status(status);
            let message = match kind {
                FailureKind::Auth => format!(
                    "ollama rejected the credentials (HTTP {status}): check {}",
                    self.config.api_key_source
                ),
                _ => format!("ollama answered HTTP {status}: {detail}"),
            };
            ProviderError::new(kind, message)
        })
        .await
    }
}

type Ready = std::collections::VecDeque<Result<(Chunk, bool), ProviderError>>;

/// Decodes complete lines into the queue. An unreadable line is skipped, as
/// docs/protocol.md#streamed-json-lines says,
/// and the stream goes on; the provider's own error line ends the stream.
fn queue_lines(lines: Vec<Result<sluice_runtime::ndjson::Line, LineError>>, ready: &mut Ready) {
    for line in lines {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                warn!(reason = %e, "skipping an NDJSON line");
                continue;
            }
        };
        match decode_line(&line.text) {
            Ok(item) => ready.push_back(Ok(item)),
            Err(e) if e.kind == FailureKind::Protocol => {
                warn!(line = line.number, error = %e, "skipping an unreadable NDJSON line");
            }
            Err(e) => ready.push_back(Err(e)),
        }
    }
}

/// Ollama ends an answer of tool calls with `stop`: it is `tool_calls`.
fn tool_calls_finish(reason: &mut Option<String>) {
    if reason.as_deref() == Some("stop") {
        *reason = Some("tool_calls".to_owned());
    }
}

/// Decodes one NDJSON line: a chunk, or the provider's error.
fn decode_line(line: &str) -> Result<(Chunk, bool), ProviderError> {
    let v: Value = serde_json::from_str(line).map_err(|e| {
        ProviderError::new(
            FailureKind::Protocol,
            format!("unreadable NDJSON line: {e}"),
        )
    })?;
    if let Some(err) = v["error"].as_str() {
        return Err(ProviderError::new(
            FailureKind::Stream,
            format!("ollama reported an error mid-stream: {err}"),
        ));
    }
    let done = v["done"].as_bool().unwrap_or(false);
    let tool_calls: Vec<ToolCallDelta> = v["message"]["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .zip(0..)
        .map(|(c, index)| ToolCallDelta {
            index,
            id: Some(c["id"].as_str().filter(|id| !id.is_empty()).map_or_else(
                || format!("call_{:016x}", rand::random::<u64>()),
                str::to_owned,
            )),
            name: c["function"]["name"].as_str().map(str::to_owned),
            arguments: match &c["function"]["arguments"] {
                Value::Null => "{}".to_owned(),
                // Some servers send the arguments as JSON text, as OpenAI does.
                Value::String(text) => text.clone(),
                args => args.to_string(),
            },
        })
        .collect();
    let chunk = Chunk {
        text: v["message"]["content"].as_str().unwrap_or("").to_owned(),
        tool_calls,
        usage: done.then(|| Usage {
            input: v["prompt_eval_count"].as_u64().unwrap_or(0),
            output: v["eval_count"].as_u64().unwrap_or(0),
        }),
        finish_reason: done.then(|| v["done_reason"].as_str().unwrap_or("stop").to_owned()),
        ..Chunk::default()
    };
    Ok((chunk, done))
}

/// Decodes a streamed `/api/chat` NDJSON body into chunks. Public for the fuzz targets
/// (`fuzz/`); the provider calls it on the HTTP body.
#[doc(hidden)]
pub fn decode_stream(body: Body, timeouts: HttpTimeouts) -> ChunkStream {
    struct State<S> {
        bytes: S,
        lines: LineSplitter,
        ready: Ready,
        over: bool,
        /// Tool calls so far: a line numbers its own from 0.
        calls: u32,
    }
    let state = State {
        bytes: body,
        lines: LineSplitter::new(MAX_LINE),
        ready: Default::default(),
        over: false,
        calls: 0,
    };
    let stream = futures::stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(item) = st.ready.pop_front() {
                return match item {
                    Ok((mut chunk, done)) => {
                        for call in &mut chunk.tool_calls {
                            call.index += st.calls;
                        }
                        st.calls += u32::try_from(chunk.tool_calls.len()).unwrap_or(0);
                        if st.calls > 0 {
                            tool_calls_finish(&mut chunk.finish_reason);
                        }
                        if done {
                            st.over = true;
                            st.ready.clear();
                        }
                        Some((Ok(chunk), st))
                    }
                    Err(e) => {
                        st.over = true;
                        st.ready.clear();
                        Some((Err(e), st))
                    }
                };
            }
            if st.over {
                return None;
            }
            match st.bytes.next().await {
                Some(Ok(bytes)) => {
                    let lines = st.lines.push(&bytes);
                    queue_lines(lines, &mut st.ready);
                }
                Some(Err(e)) => {
                    st.over = true;
                    let e = ProviderError::new(
                        FailureKind::Truncated,
                        format!(
                            "the connection broke mid-stream: {}",
                            crate::providers::without_url(&e)
                        ),
                    );
                    return Some((Err(e), st));
                }
                None => {
                    let last: Vec<_> = st.lines.finish().into_iter().collect();
                    queue_lines(last, &mut st.ready);
                    if st.ready.is_empty() {
                        st.over = true;
                        let e = ProviderError::new(
                            FailureKind::Truncated,
                            "the stream ended without its done:true line: the answer is incomplete",
                        );
                        return Some((Err(e), st));
                    }
                }
            }
        }
    });
    decode_timeouts(stream, timeouts)
}

#[async_trait]
impl Provider for OllamaProvider {
    fn endpoint(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &'static str {
        "ollama"
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
        let resp = self.post(&self.body(request, true)?).await?;
        Ok(decode_stream(
            resp.bytes_stream().boxed(),
            self.config.timeouts,
        ))
    }

    async fn generate(&self, request: &TextCompletionRequest) -> Result<Completion, ProviderError> {
        let resp = self.post(&self.body(request, false)?).await?;
        let text = tokio::time::timeout(self.config.timeouts.first_token, resp.text())
            .await
            .map_err(|_| ProviderError::new(FailureKind::Timeout, "no answer in time"))?
            .map_err(|e| transport_error(&e))?;
        let (chunk, done) = decode_line(text.trim())?;
        if !done {
            return Err(ProviderError::new(
                FailureKind::Truncated,
                "the answer has no done:true",
            ));
        }
        let mut finish_reason = chunk.finish_reason;
        if !chunk.tool_calls.is_empty() {
            tool_calls_finish(&mut finish_reason);
        }
        Ok(Completion {
            text: chunk.text,
            usage: chunk.usage,
            finish_reason,
            tool_calls: chunk.tool_calls,
            ..Completion::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_decode_with_totals_only_on_done_and_a_cached_prompt_as_zero() {
        let (c, done) = decode_line(
            r#"{"model":"m","message":{"role":"assistant","content":"The"},"done":false}"#,
        )
        .unwrap();
        assert_eq!((c.text.as_str(), done, c.usage), ("The", false, None));
        let (c, done) = decode_line(
            r#"{"message":{"content":""},"done":true,"done_reason":"stop","eval_count":282}"#,
        )
        .unwrap();
        assert!(done);
        assert_eq!(
            c.usage,
            Some(Usage {
                input: 0,
                output: 282
            })
        );
        let e = decode_line(r#"{"error":"model crashed"}"#).unwrap_err();
        assert_eq!(e.kind, FailureKind::Stream);
    }

    #[test]
    fn options_carry_num_ctx() {
        let mut c = OllamaConfig::new("http://h:11434/", "llama3.2");
        c.num_ctx = Some(8192);
        c.temperature = Some(0.3);
        let p = OllamaProvider::new(c).unwrap();
        assert_eq!(p.url, "http://h:11434/api/chat");
        let b = p
            .body(
                &TextCompletionRequest {
                    prompt: "x".into(),
                    ..Default::default()
                },
                true,
            )
            .unwrap();
        assert_eq!(b["options"]["num_ctx"], 8192);
        assert_eq!(b["stream"], true);
    }

    #[test]
    fn a_conversation_and_its_settings_map_onto_chat_options() {
        let p = OllamaProvider::new(OllamaConfig::new("http://127.0.0.1:1", "m")).unwrap();
        let b = p
            .body(&crate::providers::conversation_request(), true)
            .unwrap();
        assert_eq!(b["model"], "other-model");
        assert_eq!(b["messages"].as_array().unwrap().len(), 4);
        assert_eq!(
            b["messages"][2],
            json!({"role": "assistant", "content": "Paris"})
        );
        assert_eq!(b["options"]["temperature"], 0.5);
        assert_eq!(b["options"]["num_predict"], 9);
        assert_eq!(b["options"]["stop"], json!(["END"]));
    }

    /// Tools, each choice, and a conversation with a call and its result, as Ollama wants
    /// them; a choice Ollama cannot honour refused.
    #[test]
    fn tools_choices_and_tool_turns_map_onto_chat() {
        use sluice_schema::{ChatMessage, Tool, ToolCall};
        let p = OllamaProvider::new(OllamaConfig::new("http://127.0.0.1:1", "m")).unwrap();
        let mut call = ChatMessage::new(ChatRole::Assistant, "");
        call.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            name: "weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        }];
        let mut result = ChatMessage::new(ChatRole::Tool, "sunny");
        result.tool_call_id = Some("call_1".into());
        let mut req = TextCompletionRequest {
            messages: Some(vec![
                ChatMessage::new(ChatRole::User, "Paris?"),
                call,
                result,
            ]),
            tools: Some(vec![Tool {
                name: "weather".into(),
                description: None,
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                strict: None,
            }]),
            ..Default::default()
        };
        let b = p.body(&req, true).unwrap();
        assert_eq!(
            b["tools"],
            json!([{"type": "function", "function": {"name": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
        );
        assert_eq!(
            b["messages"][1],
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]})
        );
        assert_eq!(
            b["messages"][2],
            json!({"role": "tool", "content": "sunny", "tool_name": "weather", "tool_call_id": "call_1"})
        );
        req.tool_choice = Some(ToolChoice::Mode(ToolMode::None));
        assert!(p.body(&req, true).unwrap().get("tools").is_none());
        for choice in [
            ToolChoice::Mode(ToolMode::Required),
            ToolChoice::Named {
                name: "weather".into(),
            },
        ] {
            req.tool_choice = Some(choice);
            let e = p.body(&req, true).unwrap_err();
            assert!(e.unsendable, "{}", e.message);
        }
    }

    /// Calls come whole in a line, numbered across the stream; `stop` after them is
    /// `tool_calls`; ids made where the server gives none.
    #[tokio::test]
    async fn tool_call_lines_decode_into_numbered_calls() {
        let lines = [
            r#"{"message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"weather","arguments":{"city":"Paris"}}}]},"done":false}"#,
            r#"{"message":{"role":"assistant","content":"","tool_calls":[{"id":"call_x","function":{"index":0,"name":"time","arguments":{}}}]},"done":false}"#,
            r#"{"message":{"role":"assistant","content":""},"done":true,"done_reason":"stop","prompt_eval_count":3,"eval_count":4}"#,
        ]
        .join("\n")
            + "\n";
        let body = futures::stream::iter(vec![Ok(bytes::Bytes::from(lines))]).boxed();
        let chunks: Vec<Chunk> = decode_stream(body, HttpTimeouts::default())
            .map(Result::unwrap)
            .collect()
            .await;
        let pieces: Vec<ToolCallDelta> = chunks.iter().flat_map(|c| c.tool_calls.clone()).collect();
        assert_eq!(pieces.iter().map(|p| p.index).collect::<Vec<_>>(), [0, 1]);
        assert!(pieces[0].id.as_deref().unwrap().starts_with("call_"));
        assert_eq!(pieces[1].id.as_deref(), Some("call_x"));
        assert_eq!(pieces[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(pieces[1].arguments, "{}");
        assert_eq!(
            chunks.last().unwrap().finish_reason.as_deref(),
            Some("tool_calls")
        );
    }
}
