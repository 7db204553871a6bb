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
//! Tools: a request's tools go as one `functionDeclarations` tool (each schema as
//! `parametersJsonSchema`, full JSON Schema), its choice as `toolConfig.functionCallingConfig`
//! (`AUTO`, `ANY`, `NONE`; a named tool as `ANY` with `allowedFunctionNames`). Gemini has no
//! switch for parallel calls. A call comes whole in one `functionCall` part (`name`, `args`);
//! each gets an id (Gemini's own when it gives one) and the number of its order in the
//! answer. Gemini ends an answer of calls with `STOP`: it is reported as `tool_calls`. A
//! call's `thoughtSignature` (thinking models) must go back with the call in the next turn,
//! or Gemini 3 refuses it: it rides in the call's id after [`SIGNATURE_MARK`], so a caller
//! that sends the call back as it got it (every OpenAI client does) sends the signature too.
//! Results go back as `functionResponse` parts (the called tool's name, found by the call's
//! id in the conversation; the result as `response`: a JSON object as it is, anything else
//! as `{"result": text}`), all results of one turn in one `user` content.
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
use sluice_schema::{
    ChatMessage, ChatRole, TextCompletionRequest, ToolCallDelta, ToolChoice, ToolMode,
};

use crate::{
    provider::{Chunk, ChunkStream, FailureKind, Provider, ProviderError, Usage},
    providers::{Body, HttpTimeouts, SseStep, classify_status, http_client, send, sse_body_chunks},
};

/// What separates a Gemini call's id from its `thoughtSignature` in the id sluice gives the
/// call (signatures are base64, so the mark never occurs in one).
pub const SIGNATURE_MARK: &str = "::sig::";

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
    /// Defaults for `model` at `base_url`; the credential's source is the endpoint's own
    /// variable (Vertex's token is not a Gemini API key).
    pub fn new(
        endpoint: GeminiEndpoint,
        base_url: impl Into<String>,
        model: impl Into<String>,
    ) -> Self {
        let credential_source = match endpoint {
            GeminiEndpoint::AiStudio => "GEMINI_API_KEY",
            GeminiEndpoint::Vertex { .. } => "VERTEX_ACCESS_TOKEN",
        };
        Self {
            endpoint,
            base_url: base_url.into(),
            model: model.into(),
            credential: None,
            credential_source: credential_source.into(),
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
        // Said at start-up, not as a failure of every request.
        super::endpoint_url(&url)?;
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

    fn body(&self, request: &TextCompletionRequest) -> Result<Value, ProviderError> {
        let contents = if request.uses_tools() {
            if request.tools.as_ref().is_some_and(|t| !t.is_empty()) {
                tool_contents(&request.turns())?
            } else {
                // No tools declared: the conversation's calls and results go as text.
                tool_contents(&crate::providers::tool_turns_as_text(request.turns()))?
            }
        } else {
            request
                .turns()
                .into_iter()
                .map(|t| {
                    // Gemini calls the assistant `model`.
                    let role = match t.role {
                        ChatRole::User | ChatRole::Tool => "user",
                        ChatRole::Assistant => "model",
                    };
                    json!({"role": role, "parts": [{"text": t.content}]})
                })
                .collect()
        };
        let mut body = json!({ "contents": contents });
        if let Some(tools) = request.tools.as_ref().filter(|t| !t.is_empty()) {
            let declarations: Vec<Value> = tools
                .iter()
                .map(|t| {
                    let mut f = json!({"name": t.name, "parametersJsonSchema": t.parameters});
                    if let Some(d) = &t.description {
                        f["description"] = json!(d);
                    }
                    f
                })
                .collect();
            body["tools"] = json!([{"functionDeclarations": declarations}]);
            if let Some(choice) = &request.tool_choice {
                body["toolConfig"] = json!({"functionCallingConfig": match choice {
                    ToolChoice::Mode(ToolMode::Auto) => json!({"mode": "AUTO"}),
                    ToolChoice::Mode(ToolMode::Required) => json!({"mode": "ANY"}),
                    ToolChoice::Mode(ToolMode::None) => json!({"mode": "NONE"}),
                    ToolChoice::Named { name } => {
                        json!({"mode": "ANY", "allowedFunctionNames": [name]})
                    }
                }});
            }
        }
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
        // Gemini 2 refuses a JSON response type together with function calling: with tools,
        // the processor checks the answer instead (`holds_structured_output`).
        if request.response_format.as_deref() == Some("json")
            && self.holds_structured_output(request)
        {
            generation.insert("responseMimeType".into(), json!("application/json"));
            // Full JSON Schema (`responseSchema` takes only an OpenAPI subset).
            if let Some(schema) = &request.schema {
                generation.insert("responseJsonSchema".into(), schema.clone());
            }
        }
        if !generation.is_empty() {
            body["generationConfig"] = Value::Object(generation);
        }
        Ok(body)
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

/// A conversation that uses tools as Gemini `contents`: an assistant turn's text and a
/// `functionCall` part per call (its signature, if its id carries one, restored); a tool turn
/// as a `functionResponse` part naming the tool its call id belongs to. Turns of one role in a
/// row become one content: Gemini wants every response to a turn's calls together.
fn tool_contents(turns: &[ChatMessage]) -> Result<Vec<Value>, ProviderError> {
    let mut contents: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for (at, turn) in turns.iter().enumerate() {
        let (role, parts) = match turn.role {
            ChatRole::User => ("user", text_part(&turn.content)),
            ChatRole::Assistant => {
                let mut parts = text_part(&turn.content);
                for call in &turn.tool_calls {
                    parts.push(function_call_part(call)?);
                }
                ("model", parts)
            }
            ChatRole::Tool => {
                let id = turn.tool_call_id.as_deref().unwrap_or("");
                // The latest call with this id before the result: ids of calls Gemini gave
                // none are ours, unique within an answer, not across a conversation.
                let name = crate::providers::call_answered(&turns[..at], id)
                    .map(|c| c.name.clone())
                    .ok_or_else(|| {
                        ProviderError::unsendable(
                            format!(
                                "the tool result for call {:?} answers no call of the conversation; Gemini needs the called tool's name",
                                crate::providers::shown_call_id(id)
                            ),
                        )
                    })?;
                let response = match serde_json::from_str::<Value>(&turn.content) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => json!({"result": turn.content}),
                };
                let mut f = json!({"name": name, "response": response});
                if let Some(gemini_id) = gemini_call_id(id) {
                    f["id"] = json!(gemini_id);
                }
                ("user", vec![json!({"functionResponse": f})])
            }
        };
        match contents.last_mut() {
            Some((last, p)) if *last == role => p.extend(parts),
            _ => contents.push((role, parts)),
        }
    }
    Ok(contents
        .into_iter()
        .map(|(role, parts)| json!({"role": role, "parts": parts}))
        .collect())
}

/// A text part, or none for empty text.
fn text_part(text: &str) -> Vec<Value> {
    if text.is_empty() {
        Vec::new()
    } else {
        vec![json!({"text": text})]
    }
}

/// Gemini's own id of a call, when the id sluice gave it came from Gemini (ids sluice made
/// begin with `sluice_`), without its signature.
fn gemini_call_id(id: &str) -> Option<&str> {
    let bare = id.split_once(SIGNATURE_MARK).map_or(id, |(bare, _)| bare);
    (!bare.starts_with("sluice_") && !bare.is_empty()).then_some(bare)
}

/// A call the model made earlier, as the `functionCall` part Gemini wants back, with the
/// `thoughtSignature` its id carries.
fn function_call_part(call: &sluice_schema::ToolCall) -> Result<Value, ProviderError> {
    let args = crate::providers::call_arguments(call, "Gemini")?;
    let mut f = json!({"name": call.name, "args": args});
    if let Some(id) = gemini_call_id(&call.id) {
        f["id"] = json!(id);
    }
    let mut part = json!({"functionCall": f});
    if let Some((_, signature)) = call.id.split_once(SIGNATURE_MARK) {
        part["thoughtSignature"] = json!(signature);
    }
    Ok(part)
}

/// A stream's decoder: how many calls came so far.
#[derive(Default)]
struct Decoder {
    calls: u32,
}

impl Decoder {
    /// One `data:` payload: [`decode_event`], with its `functionCall` parts as whole calls
    /// numbered across the stream, and `STOP` after calls reported as `tool_calls`.
    fn event(&mut self, data: &str) -> Result<Chunk, ProviderError> {
        let mut chunk = decode_event(data)?;
        let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        if let Some(parts) = v["candidates"][0]["content"]["parts"].as_array() {
            for part in parts {
                let f = &part["functionCall"];
                if !f.is_object() {
                    continue;
                }
                let name = f["name"].as_str().unwrap_or("").to_owned();
                let mut id = match f["id"].as_str().filter(|id| !id.is_empty()) {
                    Some(id) => id.to_owned(),
                    // Unique enough to tell a conversation's calls apart where Gemini
                    // gives no id of its own.
                    None => format!("sluice_{:016x}", rand::random::<u64>()),
                };
                if let Some(signature) = part["thoughtSignature"].as_str() {
                    id = format!("{id}{SIGNATURE_MARK}{signature}");
                }
                let arguments = match &f["args"] {
                    Value::Null => "{}".to_owned(),
                    args => args.to_string(),
                };
                chunk.tool_calls.push(ToolCallDelta {
                    index: self.calls,
                    id: Some(id),
                    name: Some(name),
                    arguments,
                });
                self.calls += 1;
            }
        }
        if self.calls > 0 && chunk.finish_reason.as_deref() == Some("STOP") {
            chunk.finish_reason = Some("tool_calls".to_owned());
        }
        Ok(chunk)
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
        {
            let mut decoder = Decoder::default();
            move |event| {
                if event.data.trim().is_empty() {
                    return Ok(SseStep::Skip);
                }
                Ok(SseStep::Chunk(decoder.event(&event.data)?))
            }
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
        let model = crate::providers::model_for(request, &self.config.model);
        let url = if model == self.config.model {
            std::borrow::Cow::Borrowed(self.url.as_str())
        } else {
            std::borrow::Cow::Owned(Self::url_for(&self.config, model))
        };
        let mut req = self.http.post(url.as_ref()).json(&self.body(request)?);
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
        let b = p.body(&crate::providers::conversation_request()).unwrap();
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

    /// Tools, each choice, and a conversation with two calls (one of Gemini's own id with a
    /// signature, one of ours) and their results, as Gemini wants them.
    #[test]
    fn tools_choices_and_tool_turns_map_onto_contents() {
        use sluice_schema::{Tool, ToolCall};
        let config = GeminiConfig::new(GeminiEndpoint::AiStudio, "http://127.0.0.1:1", "m");
        let p = GeminiProvider::new(config).unwrap();
        let mut call = ChatMessage::new(ChatRole::Assistant, "");
        call.tool_calls = vec![
            ToolCall {
                id: format!("g-1{SIGNATURE_MARK}c2lnbmF0dXJl"),
                name: "weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            },
            ToolCall {
                id: "sluice_00ff".into(),
                name: "time".into(),
                arguments: String::new(),
            },
        ];
        let result = |id: &str, content: &str| {
            let mut m = ChatMessage::new(ChatRole::Tool, content);
            m.tool_call_id = Some(id.into());
            m
        };
        let mut req = TextCompletionRequest {
            messages: Some(vec![
                ChatMessage::new(ChatRole::User, "Paris?"),
                call,
                result(
                    &format!("g-1{SIGNATURE_MARK}c2lnbmF0dXJl"),
                    r#"{"sky":"clear"}"#,
                ),
                result("sluice_00ff", "noon"),
            ]),
            tools: Some(vec![Tool {
                name: "weather".into(),
                description: Some("The weather".into()),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                strict: None,
            }]),
            ..Default::default()
        };
        let b = p.body(&req).unwrap();
        assert_eq!(
            b["tools"],
            json!([{"functionDeclarations": [{"name": "weather", "description": "The weather",
                "parametersJsonSchema": {"type": "object", "properties": {"city": {"type": "string"}}}}]}])
        );
        assert!(b.get("toolConfig").is_none(), "{b}");
        // A JSON mode with tools is not sent (Gemini 2 refuses both together): the processor
        // checks that answer.
        let mut json_too = req.clone();
        json_too.response_format = Some("json".into());
        json_too.schema = Some(json!({"type": "object"}));
        assert!(p.body(&json_too).unwrap().get("generationConfig").is_none());
        assert!(!p.holds_structured_output(&json_too));
        json_too.tools = None;
        assert!(p.holds_structured_output(&json_too));
        assert_eq!(
            p.body(&json_too).unwrap()["generationConfig"]["responseJsonSchema"],
            json!({"type": "object"})
        );
        assert_eq!(
            b["contents"],
            json!([
                {"role": "user", "parts": [{"text": "Paris?"}]},
                {"role": "model", "parts": [
                    {"functionCall": {"name": "weather", "args": {"city": "Paris"}, "id": "g-1"},
                     "thoughtSignature": "c2lnbmF0dXJl"},
                    {"functionCall": {"name": "time", "args": {}}}]},
                {"role": "user", "parts": [
                    {"functionResponse": {"name": "weather", "response": {"sky": "clear"}, "id": "g-1"}},
                    {"functionResponse": {"name": "time", "response": {"result": "noon"}}}]}
            ])
        );
        let choice = |req: &TextCompletionRequest| p.body(req).unwrap()["toolConfig"].clone();
        req.tool_choice = Some(ToolChoice::Mode(ToolMode::Required));
        assert_eq!(
            choice(&req),
            json!({"functionCallingConfig": {"mode": "ANY"}})
        );
        req.tool_choice = Some(ToolChoice::Named {
            name: "weather".into(),
        });
        assert_eq!(
            choice(&req),
            json!({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["weather"]}})
        );
        req.tool_choice = Some(ToolChoice::Mode(ToolMode::None));
        assert_eq!(
            choice(&req),
            json!({"functionCallingConfig": {"mode": "NONE"}})
        );
        // A result for a call the conversation never made: Gemini needs a name.
        req.messages = Some(vec![result("nope", "x")]);
        let e = p.body(&req).unwrap_err();
        assert_eq!(e.kind, FailureKind::BadRequest);
        assert!(e.message.contains("\"nope\""), "{}", e.message);
    }

    /// `functionCall` parts, whole, numbered across the stream's chunks; Gemini's own id kept,
    /// ours made where it gives none; a signature carried in the id; `STOP` after calls is
    /// `tool_calls`, and stays `STOP` after text only.
    #[test]
    fn function_call_parts_decode_into_whole_numbered_calls() {
        let mut d = Decoder::default();
        let c = d
            .event(r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"Checking."},{"functionCall":{"name":"weather","args":{"city":"Paris"}},"thoughtSignature":"c2ln"}]},"index":0}]}"#)
            .unwrap();
        assert_eq!(c.text, "Checking.");
        assert_eq!(c.tool_calls.len(), 1);
        let first = &c.tool_calls[0];
        assert_eq!(first.index, 0);
        assert_eq!(first.name.as_deref(), Some("weather"));
        assert_eq!(first.arguments, r#"{"city":"Paris"}"#);
        let id = first.id.clone().unwrap();
        assert!(
            id.starts_with("sluice_") && id.ends_with("::sig::c2ln"),
            "{id}"
        );
        let c = d
            .event(r#"{"candidates":[{"content":{"role":"model","parts":[{"functionCall":{"id":"g-7","name":"time"}}]},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":6,"totalTokenCount":15}}"#)
            .unwrap();
        assert_eq!(c.tool_calls[0].index, 1);
        assert_eq!(c.tool_calls[0].id.as_deref(), Some("g-7"));
        assert_eq!(c.tool_calls[0].arguments, "{}");
        assert_eq!(c.finish_reason.as_deref(), Some("tool_calls"));
        let c = Decoder::default()
            .event(r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"Hi"}]},"finishReason":"STOP","index":0}]}"#)
            .unwrap();
        assert_eq!(c.finish_reason.as_deref(), Some("STOP"));
    }
}
