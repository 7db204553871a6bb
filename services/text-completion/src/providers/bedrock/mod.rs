//! AWS Bedrock Converse: `POST {base}/model/{modelId}/converse-stream`, answered with the
//! binary `application/vnd.amazon.eventstream` framing, and `POST {base}/model/{modelId}/converse`,
//! answered with one JSON document.
//!
//! Credentials are a Bedrock API key (`AWS_BEARER_TOKEN_BEDROCK`, sent as `Authorization:
//! Bearer`, as the AWS SDKs do) or SigV4 keys (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! optional `AWS_SESSION_TOKEN`), each also from a `*_FILE`. Signing uses `aws-sigv4`, the AWS
//! SDK's own signer, so the canonical request matches what AWS computes.
//!
//! The stream is a sequence of frames (`u32 total | u32 headers | u32 prelude CRC | headers |
//! payload | u32 message CRC`). They are cut out of the HTTP body as bytes arrive, whatever
//! the chunking, and both CRCs are checked (`aws-smithy-eventstream`). Events:
//! `messageStart`; `contentBlockDelta` (text); `messageStop` (the stop reason); `metadata`
//! (usage, which comes AFTER `messageStop`: the stream ends after `metadata`, or at the end of
//! the body once `messageStop` was seen). A body that ends before `messageStop` is truncated.
//! `:message-type` `exception` frames are mid-stream failures classified by `:exception-type`.
//!
//! Tools: a request's tools go as `toolConfig.tools` (`toolSpec` with `inputSchema.json`), its
//! choice as `toolConfig.toolChoice` (`auto`, `any` for required, `tool` for a named one;
//! Converse has no `none`, so for that choice no tools are sent and the conversation's calls
//! and results go as text, as for a request without tools, since Converse refuses tool
//! blocks without them; no switch for parallel calls). Calls go back as `toolUse` blocks of the assistant's message and results
//! as `toolResult` blocks of the user message after it. A streamed call is a content block:
//! `contentBlockStart` with `start.toolUse` (id, name), `contentBlockDelta` with
//! `delta.toolUse.input` fragments; each block one call, numbered in the order blocks began.
//!
//! This module must never let a credential reach a log, an error, `Debug` output or a
//! metric: credentials are [`Secret`]s, and signing runs with tracing switched off because
//! `aws-sigv4` traces the canonical request, which holds the session token.

mod credentials;
mod eventstream;
mod sigv4;

use std::time::SystemTime;

use async_trait::async_trait;
use futures::StreamExt;
use reqwest::{StatusCode, header::HeaderMap};
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;
use sluice_schema::{ChatMessage, ChatRole, TextCompletionRequest, ToolChoice, ToolMode};

pub use self::credentials::{
    ACCESS_KEY_ID_VAR, API_KEY_VAR, BedrockCredentials, SECRET_ACCESS_KEY_VAR, SESSION_TOKEN_VAR,
};
use self::{
    eventstream::event_stream_chunks,
    sigv4::{SigV4Keys, sigv4_headers},
};
use crate::{
    provider::{ChunkStream, Completion, FailureKind, Provider, ProviderError, Usage},
    providers::{
        Body, HttpTimeouts, classify_status, decode_timeouts, http_client, send_with_headers,
        transport_error,
    },
};

/// The SigV4 signing name of Bedrock's runtime endpoints.
const SIGNING_SERVICE: &str = "bedrock";

/// Configuration for Bedrock.
#[derive(Debug, Clone)]
pub struct BedrockConfig {
    /// Base URL, `https://bedrock-runtime.{region}.amazonaws.com` by default.
    pub base_url: String,
    /// The region, signed into every request.
    pub region: String,
    /// Model id or inference-profile id/ARN, e.g. `anthropic.claude-3-5-haiku-20241022-v1:0`.
    pub model: String,
    /// The credentials.
    pub credentials: BedrockCredentials,
    /// Maximum output tokens (`inferenceConfig.maxTokens`).
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Time limits.
    pub timeouts: HttpTimeouts,
}

impl BedrockConfig {
    /// Defaults for `model` in `region`, at the region's public endpoint.
    pub fn new(region: impl Into<String>, model: impl Into<String>) -> Self {
        let region = region.into();
        Self {
            base_url: Self::default_base_url(&region),
            region,
            model: model.into(),
            credentials: BedrockCredentials::None,
            max_tokens: None,
            temperature: None,
            timeouts: HttpTimeouts::default(),
        }
    }

    /// The public runtime endpoint of `region`.
    pub fn default_base_url(region: &str) -> String {
        format!("https://bedrock-runtime.{region}.amazonaws.com")
    }
}

/// The Bedrock provider.
pub struct BedrockProvider {
    config: BedrockConfig,
    http: reqwest::Client,
    stream_url: String,
    whole_url: String,
}

impl BedrockProvider {
    /// Builds the provider.
    pub fn new(config: BedrockConfig) -> Result<Self, ProviderError> {
        let http = http_client(&config.timeouts)?;
        let model = encode_path_segment(&config.model);
        let base = config.base_url.trim_end_matches('/');
        // Said at start-up, not as a failure of every request.
        super::endpoint_url(base)?;
        Ok(Self {
            stream_url: format!("{base}/model/{model}/converse-stream"),
            whole_url: format!("{base}/model/{model}/converse"),
            config,
            http,
        })
    }

    fn body(&self, request: &TextCompletionRequest) -> Result<Vec<u8>, ProviderError> {
        // Converse has no tool choice `none`: such a request is sent no tools, without which
        // no call can be made; and Converse refuses tool blocks in a request without tools, so
        // the conversation's calls and results then go as text.
        let declared = request.tools.as_ref().is_some_and(|t| !t.is_empty())
            && request.tool_choice != Some(ToolChoice::Mode(ToolMode::None));
        let messages: Vec<Value> = if request.uses_tools() {
            if declared {
                tool_messages(request.turns())?
            } else {
                tool_messages(crate::providers::tool_turns_as_text(request.turns()))?
            }
        } else {
            request
                .turns()
                .into_iter()
                .map(|t| json!({"role": t.role.as_str(), "content": [{"text": t.content}]}))
                .collect()
        };
        let mut body = json!({ "messages": messages });
        if let Some(tools) = request.tools.as_ref().filter(|_| declared) {
            let specs: Vec<Value> = tools
                .iter()
                .map(|t| {
                    let mut spec = json!({"name": t.name, "inputSchema": {"json": t.parameters}});
                    if let Some(d) = &t.description {
                        spec["description"] = json!(d);
                    }
                    json!({"toolSpec": spec})
                })
                .collect();
            body["toolConfig"] = json!({"tools": specs});
            match &request.tool_choice {
                None | Some(ToolChoice::Mode(ToolMode::Auto)) => {}
                Some(ToolChoice::Mode(ToolMode::Required)) => {
                    body["toolConfig"]["toolChoice"] = json!({"any": {}});
                }
                Some(ToolChoice::Named { name }) => {
                    body["toolConfig"]["toolChoice"] = json!({"tool": {"name": name}});
                }
                // Not declared: no tools were sent.
                Some(ToolChoice::Mode(ToolMode::None)) => {}
            }
        }
        if !request.system.is_empty() {
            body["system"] = json!([{"text": request.system}]);
        }
        let mut inference = serde_json::Map::new();
        if let Some(m) = request.max_tokens.or(self.config.max_tokens) {
            inference.insert("maxTokens".into(), json!(m));
        }
        if let Some(t) = request
            .temperature
            .or(self.config.temperature.map(f64::from))
        {
            inference.insert("temperature".into(), json!(t));
        }
        if let Some(stop) = request.stop.as_ref().filter(|s| !s.is_empty()) {
            inference.insert("stopSequences".into(), json!(stop));
        }
        if !inference.is_empty() {
            body["inferenceConfig"] = Value::Object(inference);
        }
        Ok(body.to_string().into_bytes())
    }

    /// The URL for a request: `configured` (for the configured model), or the same route for
    /// the other model the request names (Bedrock names the model in the path).
    fn url_for(&self, request: &TextCompletionRequest, configured: &str, route: &str) -> String {
        let model = crate::providers::model_for(request, &self.config.model);
        if model == self.config.model {
            return configured.to_owned();
        }
        let base = self.config.base_url.trim_end_matches('/');
        format!("{base}/model/{}/{route}", encode_path_segment(model))
    }

    /// Posts `body` to `url` with the configured credentials.
    async fn post(&self, url: &str, body: Vec<u8>) -> Result<reqwest::Response, ProviderError> {
        const CONTENT_TYPE: &str = "application/json";
        let mut req = self
            .http
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, CONTENT_TYPE);
        match &self.config.credentials {
            BedrockCredentials::None => {}
            BedrockCredentials::ApiKey(key) => req = req.bearer_auth(key.expose()),
            BedrockCredentials::SigV4 {
                access_key_id,
                secret_access_key,
                session_token,
            } => {
                let keys = SigV4Keys {
                    access_key_id: access_key_id.expose(),
                    secret_access_key: secret_access_key.expose(),
                    session_token: session_token.as_ref().map(Secret::expose),
                };
                let signed = sigv4_headers(
                    &keys,
                    &self.config.region,
                    SIGNING_SERVICE,
                    "POST",
                    url,
                    &[("content-type", CONTENT_TYPE)],
                    &body,
                    SystemTime::now(),
                )?;
                for (name, mut value) in signed {
                    value.set_sensitive(true);
                    req = req.header(name, value);
                }
            }
        }
        send_with_headers(
            req.body(body),
            self.config.timeouts.first_token,
            |status, headers, body| self.http_error(status, headers, body),
        )
        .await
    }

    fn http_error(&self, status: StatusCode, headers: &HeaderMap, body: &str) -> ProviderError {
        let parsed: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        // `x-amzn-ErrorType: ThrottlingException:http://internal.amazon.com/...`; some
        // answers carry the type in the body's `__type` instead.
        let error_type = headers
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok())
            .or_else(|| parsed["__type"].as_str())
            .map(|t| t.split([':', '#']).next().unwrap_or(t).to_owned())
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| "error".to_owned());
        let detail = parsed["message"]
            .as_str()
            .or_else(|| parsed["Message"].as_str())
            .unwrap_or("");
        // A signature mismatch explains itself with the canonical request, which holds the
        // session token: never pass that part on.
        let detail: String = detail
            .split("The Canonical String")
            .next()
            .unwrap_or("")
            .trim()
            .chars()
            .take(300)
            .collect();
        let kind = match (status.as_u16(), error_type.as_str()) {
            (_, "ThrottlingException") | (429, _) => FailureKind::RateLimited,
            (
                403,
                "UnrecognizedClientException"
                | "InvalidSignatureException"
                | "IncompleteSignatureException"
                | "MissingAuthenticationTokenException"
                | "ExpiredTokenException"
                | "InvalidClientTokenId"
                | "SignatureDoesNotMatch",
            ) => FailureKind::Auth,
            _ => classify_status(status),
        };
        let message = match kind {
            FailureKind::Auth | FailureKind::Permission => format!(
                "bedrock refused the credentials (HTTP {status}, {error_type}: {detail}): check {}",
                self.config.credentials.source()
            ),
            _ => format!("bedrock answered HTTP {status} ({error_type}): {detail}"),
        };
        ProviderError::new(kind, message)
    }
}

/// A conversation that uses tools as Converse `messages`: an assistant turn's text then a
/// `toolUse` block per call (its input parsed: Converse takes an object); a tool turn as a
/// `toolResult` block of a user message. Turns of one role in a row become one message, as
/// Converse wants a turn's results together in the user message after it.
fn tool_messages(turns: Vec<ChatMessage>) -> Result<Vec<Value>, ProviderError> {
    let mut messages: Vec<(&'static str, Vec<Value>)> = Vec::new();
    let text = |t: String| {
        if t.is_empty() {
            Vec::new()
        } else {
            vec![json!({"text": t})]
        }
    };
    for turn in turns {
        let (role, blocks) = match turn.role {
            ChatRole::Tool => (
                "user",
                vec![json!({"toolResult": {
                    "toolUseId": crate::providers::portable_call_id(
                        turn.tool_call_id.as_deref().unwrap_or_default()),
                    "content": [{"text": turn.content}]}})],
            ),
            ChatRole::User => ("user", text(turn.content)),
            ChatRole::Assistant => {
                let mut blocks = text(turn.content);
                for call in &turn.tool_calls {
                    let input = crate::providers::call_arguments(call, "bedrock")?;
                    blocks.push(json!({"toolUse": {
                        "toolUseId": crate::providers::portable_call_id(&call.id),
                        "name": call.name, "input": input}}));
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
        // A turn with nothing to say is left out: Converse refuses empty content.
        .filter(|(_, content)| !content.is_empty())
        .map(|(role, mut content)| {
            content.sort_by_key(|b| b.get("toolResult").is_none());
            json!({"role": role, "content": content})
        })
        .collect())
}

/// Percent-encodes one URI path segment as the AWS SDKs encode a label: everything but the
/// unreserved characters, so the `:` of `...-v1:0` is sent as `%3A`, and the `/` of an
/// inference-profile ARN as `%2F`. The signer encodes the path once more for the canonical
/// request (SigV4's double encoding), which is what Bedrock verifies.
fn encode_path_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The usage of a Converse `usage` object; cache reads and writes count as input, as for
/// Anthropic.
fn usage(u: &Value) -> Option<Usage> {
    u.is_object().then(|| Usage {
        input: [
            "inputTokens",
            "cacheReadInputTokens",
            "cacheWriteInputTokens",
        ]
        .iter()
        .filter_map(|k| u[*k].as_u64())
        .sum(),
        output: u["outputTokens"].as_u64().unwrap_or(0),
    })
}

/// Decodes a ConverseStream event-stream body into chunks. Public for the fuzz targets
/// (`fuzz/`); the provider calls it on the HTTP body.
#[doc(hidden)]
pub fn decode_stream(body: Body, timeouts: HttpTimeouts) -> ChunkStream {
    decode_timeouts(event_stream_chunks(body), timeouts)
}

#[async_trait]
impl Provider for BedrockProvider {
    fn endpoint(&self) -> &str {
        &self.stream_url
    }

    fn name(&self) -> &'static str {
        "bedrock"
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
            .post(
                &self.url_for(request, &self.stream_url, "converse-stream"),
                self.body(request)?,
            )
            .await?;
        Ok(decode_stream(
            resp.bytes_stream().boxed(),
            self.config.timeouts,
        ))
    }

    async fn generate(&self, request: &TextCompletionRequest) -> Result<Completion, ProviderError> {
        let resp = self
            .post(
                &self.url_for(request, &self.whole_url, "converse"),
                self.body(request)?,
            )
            .await?;
        let v: Value = tokio::time::timeout(self.config.timeouts.first_token, resp.json())
            .await
            .map_err(|_| {
                ProviderError::new(
                    FailureKind::Timeout,
                    format!("no answer within {:?}", self.config.timeouts.first_token),
                )
            })?
            .map_err(|e| transport_error(&e))?;
        let content = v["output"]["message"]["content"]
            .as_array()
            .ok_or_else(|| {
                ProviderError::new(
                    FailureKind::Protocol,
                    "the answer has no output.message.content",
                )
            })?;
        Ok(Completion {
            text: content.iter().filter_map(|c| c["text"].as_str()).collect(),
            usage: usage(&v["usage"]),
            finish_reason: v["stopReason"].as_str().map(str::to_owned),
            tool_calls: crate::provider::whole_calls(
                &content
                    .iter()
                    .filter_map(|c| c.get("toolUse"))
                    .zip(0..)
                    .map(|(t, index)| sluice_schema::ToolCallDelta {
                        index,
                        id: t["toolUseId"].as_str().map(str::to_owned),
                        name: t["name"].as_str().map(str::to_owned),
                        arguments: match &t["input"] {
                            Value::Null => "{}".to_owned(),
                            input => input.to_string(),
                        },
                    })
                    .collect::<Vec<_>>(),
            ),
            ..Completion::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_are_encoded_as_the_aws_sdks_encode_a_label() {
        assert_eq!(
            encode_path_segment("anthropic.claude-3-5-haiku-20241022-v1:0"),
            "anthropic.claude-3-5-haiku-20241022-v1%3A0"
        );
        assert_eq!(
            encode_path_segment("arn:aws:bedrock:us-east-1:123:inference-profile/us.x"),
            "arn%3Aaws%3Abedrock%3Aus-east-1%3A123%3Ainference-profile%2Fus.x"
        );
    }

    #[test]
    fn a_conversation_and_its_settings_map_onto_converse() {
        let mut config = BedrockConfig::new("us-east-1", "m");
        config.base_url = "http://127.0.0.1:1".into();
        let p = BedrockProvider::new(config).unwrap();
        let request = crate::providers::conversation_request();
        let b: Value = serde_json::from_slice(&p.body(&request).unwrap()).unwrap();
        assert_eq!(
            b["messages"][1],
            json!({"role": "assistant", "content": [{"text": "Paris"}]})
        );
        assert_eq!(b["system"], json!([{"text": "one word"}]));
        assert_eq!(b["inferenceConfig"]["maxTokens"], 9);
        assert_eq!(b["inferenceConfig"]["temperature"], 0.5);
        assert_eq!(b["inferenceConfig"]["stopSequences"], json!(["END"]));
        assert_eq!(
            p.url_for(&request, &p.stream_url, "converse-stream"),
            "http://127.0.0.1:1/model/other-model/converse-stream"
        );
    }

    /// Tools, each choice, and a conversation with two calls and their results, as Converse
    /// wants them; `none`, which Converse lacks, as no tools and the turns as text.
    #[test]
    fn tools_choices_and_tool_turns_map_onto_converse() {
        use sluice_schema::{Tool, ToolCall};
        let mut config = BedrockConfig::new("us-east-1", "m");
        config.base_url = "http://127.0.0.1:1".into();
        let p = BedrockProvider::new(config).unwrap();
        let mut call = ChatMessage::new(ChatRole::Assistant, "");
        call.tool_calls = vec![
            ToolCall {
                id: "tooluse_a".into(),
                name: "weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            },
            ToolCall {
                id: "tooluse_b".into(),
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
                result("tooluse_a", "sunny"),
                result("tooluse_b", "noon"),
            ]),
            tools: Some(vec![Tool {
                name: "weather".into(),
                description: Some("The weather".into()),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                strict: None,
            }]),
            ..Default::default()
        };
        let body = |req: &TextCompletionRequest| -> Value {
            serde_json::from_slice(&p.body(req).unwrap()).unwrap()
        };
        let b = body(&req);
        assert_eq!(
            b["toolConfig"],
            json!({"tools": [{"toolSpec": {"name": "weather", "description": "The weather",
                "inputSchema": {"json": {"type": "object", "properties": {"city": {"type": "string"}}}}}}]})
        );
        assert_eq!(
            b["messages"],
            json!([
                {"role": "user", "content": [{"text": "Paris?"}]},
                {"role": "assistant", "content": [
                    {"toolUse": {"toolUseId": "tooluse_a", "name": "weather", "input": {"city": "Paris"}}},
                    {"toolUse": {"toolUseId": "tooluse_b", "name": "time", "input": {}}}]},
                {"role": "user", "content": [
                    {"toolResult": {"toolUseId": "tooluse_a", "content": [{"text": "sunny"}]}},
                    {"toolResult": {"toolUseId": "tooluse_b", "content": [{"text": "noon"}]}}]}
            ])
        );
        req.tool_choice = Some(ToolChoice::Mode(ToolMode::Required));
        assert_eq!(body(&req)["toolConfig"]["toolChoice"], json!({"any": {}}));
        req.tool_choice = Some(ToolChoice::Named {
            name: "weather".into(),
        });
        assert_eq!(
            body(&req)["toolConfig"]["toolChoice"],
            json!({"tool": {"name": "weather"}})
        );
        // `none`: no tools sent, the calls and results as text, one user message after the
        // assistant's (Converse wants the roles to alternate).
        req.tool_choice = Some(ToolChoice::Mode(ToolMode::None));
        let b = body(&req);
        assert!(b.get("toolConfig").is_none(), "{b}");
        assert_eq!(
            b["messages"][1],
            json!({"role": "assistant", "content": [{"text":
                "[called weather({\"city\":\"Paris\"})]\n[called time()]"}]})
        );
        assert_eq!(
            b["messages"][2],
            json!({"role": "user", "content": [{"text": "[result of weather]\nsunny"},
                {"text": "[result of time]\nnoon"}]})
        );
        assert_eq!(b["messages"].as_array().unwrap().len(), 3);
        // A Gemini call's signed id, made portable for Converse.
        let mut call = ChatMessage::new(ChatRole::Assistant, "");
        call.tool_calls = vec![ToolCall {
            id: format!(
                "sluice_00ff{}c2ln",
                crate::providers::gemini::SIGNATURE_MARK
            ),
            name: "weather".into(),
            arguments: "{}".into(),
        }];
        req.tool_choice = None;
        req.messages = Some(vec![ChatMessage::new(ChatRole::User, "Paris?"), call]);
        assert_eq!(
            body(&req)["messages"][1]["content"][0]["toolUse"]["toolUseId"],
            "sluice_00ff"
        );
    }
}
