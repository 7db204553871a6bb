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
//! This module must never let a credential reach a log, an error, `Debug` output or a
//! metric: credentials are [`Secret`]s, and signing runs with tracing switched off because
//! `aws-sigv4` traces the canonical request, which holds the session token.

use std::time::SystemTime;

use async_trait::async_trait;
use aws_smithy_types::event_stream::Message;
use bytes::{Buf, BytesMut};
use futures::StreamExt;
use reqwest::{
    StatusCode,
    header::{HeaderMap, HeaderValue},
};
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;
use sluice_schema::TextCompletionRequest;

use crate::{
    provider::{Chunk, ChunkStream, Completion, FailureKind, Provider, ProviderError, Usage},
    providers::{
        Body, HttpTimeouts, classify_status, decode_timeouts, http_client, send_with_headers,
        transport_error,
    },
};

/// Where a Bedrock API key is read from (the variable the AWS SDKs read).
pub const API_KEY_VAR: &str = "AWS_BEARER_TOKEN_BEDROCK";
/// Where the SigV4 access key id is read from.
pub const ACCESS_KEY_ID_VAR: &str = "AWS_ACCESS_KEY_ID";
/// Where the SigV4 secret access key is read from.
pub const SECRET_ACCESS_KEY_VAR: &str = "AWS_SECRET_ACCESS_KEY";
/// Where the optional SigV4 session token is read from.
pub const SESSION_TOKEN_VAR: &str = "AWS_SESSION_TOKEN";

/// The SigV4 signing name of Bedrock's runtime endpoints.
const SIGNING_SERVICE: &str = "bedrock";

/// The largest frame accepted. AWS caps an event-stream message at 16 MiB; a larger length
/// field is corruption, and waiting for that many bytes would stall the stream.
const MAX_FRAME: usize = 16 * 1024 * 1024;

/// The prelude: total length, headers length, prelude CRC.
const PRELUDE: usize = 12;

/// How a Bedrock call proves who it is.
#[derive(Debug, Clone, Default)]
pub enum BedrockCredentials {
    /// No credentials (a proxy that signs, or a test server).
    #[default]
    None,
    /// A Bedrock API key, sent as `Authorization: Bearer`.
    ApiKey(Secret),
    /// IAM keys, for SigV4.
    SigV4 {
        /// `AWS_ACCESS_KEY_ID`.
        access_key_id: Secret,
        /// `AWS_SECRET_ACCESS_KEY`.
        secret_access_key: Secret,
        /// `AWS_SESSION_TOKEN`, for temporary credentials.
        session_token: Option<Secret>,
    },
}

impl BedrockCredentials {
    /// Reads credentials as the AWS SDKs do: a Bedrock API key when
    /// `AWS_BEARER_TOKEN_BEDROCK` is set, else the SigV4 keys; each variable may instead
    /// name a file with `*_FILE`. `None` when nothing is set. Errors name variables, never
    /// values.
    pub fn from_env() -> Result<Self, ProviderError> {
        let read = |var: &str| {
            Secret::from_env(var).map_err(|e| ProviderError::new(FailureKind::Auth, e.to_string()))
        };
        if let Some(key) = read(API_KEY_VAR)? {
            return Ok(Self::ApiKey(key));
        }
        match (read(ACCESS_KEY_ID_VAR)?, read(SECRET_ACCESS_KEY_VAR)?) {
            (Some(access_key_id), Some(secret_access_key)) => Ok(Self::SigV4 {
                access_key_id,
                secret_access_key,
                session_token: read(SESSION_TOKEN_VAR)?,
            }),
            (None, None) => Ok(Self::None),
            (Some(_), None) => Err(ProviderError::new(
                FailureKind::Auth,
                format!(
                    "{ACCESS_KEY_ID_VAR} is set but {SECRET_ACCESS_KEY_VAR} (or {SECRET_ACCESS_KEY_VAR}_FILE) is not"
                ),
            )),
            (None, Some(_)) => Err(ProviderError::new(
                FailureKind::Auth,
                format!(
                    "{SECRET_ACCESS_KEY_VAR} is set but {ACCESS_KEY_ID_VAR} (or {ACCESS_KEY_ID_VAR}_FILE) is not"
                ),
            )),
        }
    }

    /// Where these credentials come from, for errors that tell the operator what to fix.
    pub fn source(&self) -> String {
        match self {
            Self::None => format!(
                "the credentials: set {API_KEY_VAR}, or {ACCESS_KEY_ID_VAR} and {SECRET_ACCESS_KEY_VAR} (or the files named by their _FILE variables)"
            ),
            Self::ApiKey(_) => {
                format!("{API_KEY_VAR} (or the file named by {API_KEY_VAR}_FILE)")
            }
            Self::SigV4 { .. } => format!(
                "{ACCESS_KEY_ID_VAR}, {SECRET_ACCESS_KEY_VAR} and {SESSION_TOKEN_VAR} (or the files named by their _FILE variables)"
            ),
        }
    }
}

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
        Ok(Self {
            stream_url: format!("{base}/model/{model}/converse-stream"),
            whole_url: format!("{base}/model/{model}/converse"),
            config,
            http,
        })
    }

    fn body(&self, request: &TextCompletionRequest) -> Vec<u8> {
        let messages: Vec<Value> = request
            .turns()
            .into_iter()
            .map(|t| json!({"role": t.role.as_str(), "content": [{"text": t.content}]}))
            .collect();
        let mut body = json!({ "messages": messages });
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
        body.to_string().into_bytes()
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

/// SigV4 keys, borrowed for one signature.
struct SigV4Keys<'a> {
    access_key_id: &'a str,
    secret_access_key: &'a str,
    session_token: Option<&'a str>,
}

/// The headers that sign a request with SigV4: `x-amz-date`, `authorization` and, with a
/// session token, `x-amz-security-token`. `url` must be exactly what is sent (already
/// percent-encoded); `headers` are the other headers to sign, as sent.
#[allow(clippy::too_many_arguments)]
fn sigv4_headers(
    keys: &SigV4Keys<'_>,
    region: &str,
    service: &str,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    time: SystemTime,
) -> Result<Vec<(&'static str, HeaderValue)>, ProviderError> {
    use aws_sigv4::{
        http_request::{SignableBody, SignableRequest, SigningSettings, sign},
        sign::v4,
    };
    // Errors from the signer describe the URL or a header name, never a key; still, only
    // their kind is passed on.
    let failed = |what: &str| {
        ProviderError::new(
            FailureKind::BadRequest,
            format!("cannot sign the bedrock request: {what}"),
        )
    };
    let identity = aws_credential_types::Credentials::new(
        keys.access_key_id,
        keys.secret_access_key,
        keys.session_token.map(str::to_owned),
        None,
        "sluice",
    )
    .into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(service)
        .time(time)
        .settings(SigningSettings::default())
        .build()
        .map_err(|_| failed("incomplete signing parameters"))?
        .into();
    let request = SignableRequest::new(
        method,
        url,
        headers.iter().copied(),
        SignableBody::Bytes(body),
    )
    .map_err(|_| failed("the URL or a header cannot be signed"))?;
    // aws-sigv4 traces the canonical request, session token included: no subscriber may
    // see it, whatever RUST_LOG says.
    let signed =
        tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::new(), || {
            sign(request, &params)
        })
        .map_err(|_| failed("the signer refused the request"))?;
    let (instructions, _signature) = signed.into_parts();
    let (signed_headers, _params) = instructions.into_parts();
    signed_headers
        .into_iter()
        .map(|h| {
            HeaderValue::from_str(h.value())
                .map(|v| (h.name(), v))
                .map_err(|_| failed("a signed header is not a valid header value"))
        })
        .collect()
}

/// Cuts event-stream frames out of a byte stream, whatever its chunking.
#[derive(Debug, Default)]
struct FrameReader {
    buf: BytesMut,
}

impl FrameReader {
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received that do not make a whole frame yet.
    fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next whole frame, both CRCs verified; `None` until enough bytes arrived.
    fn next_frame(&mut self) -> Result<Option<Message>, ProviderError> {
        if self.buf.len() < PRELUDE {
            return Ok(None);
        }
        let word = |at: usize| {
            let mut b = &self.buf[at..at + 4];
            b.get_u32()
        };
        let total = usize::try_from(word(0)).unwrap_or(usize::MAX);
        // The prelude has its own CRC so a corrupted length is caught here, before waiting
        // for bytes that will never come.
        if crc32fast::hash(&self.buf[..8]) != word(8) {
            return Err(corrupt("prelude checksum mismatch"));
        }
        if !(PRELUDE + 4..=MAX_FRAME).contains(&total) {
            return Err(corrupt("impossible frame length"));
        }
        if self.buf.len() < total {
            return Ok(None);
        }
        let frame = self.buf.split_to(total).freeze();
        aws_smithy_eventstream::frame::read_message_from(frame)
            .map(Some)
            .map_err(|e| corrupt(&e.to_string()))
    }
}

fn corrupt(what: &str) -> ProviderError {
    ProviderError::new(
        FailureKind::Protocol,
        format!("corrupt bedrock event-stream frame: {what}"),
    )
}

/// What one frame means.
#[derive(Debug, PartialEq)]
enum Event {
    /// A text delta.
    Text(String),
    /// `messageStop`, with the stop reason.
    Stop(String),
    /// `metadata`, with the usage.
    Metadata(Option<Usage>),
    /// `messageStart`, block start/stop, non-text deltas, unknown events.
    Ignore,
}

fn header<'a>(message: &'a Message, name: &str) -> Option<&'a str> {
    message
        .headers()
        .iter()
        .find(|h| h.name().as_str() == name)
        .and_then(|h| h.value().as_string().ok())
        .map(|s| s.as_str())
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

/// The failure kind of an in-stream `:exception-type`.
fn exception_kind(exception: &str) -> FailureKind {
    match exception {
        "throttlingException" => FailureKind::RateLimited,
        // AWS documents these as transient ("retry your request").
        "modelStreamErrorException"
        | "internalServerException"
        | "serviceUnavailableException"
        | "modelTimeoutException" => FailureKind::Server,
        "validationException" => FailureKind::BadRequest,
        _ => FailureKind::Stream,
    }
}

fn decode_frame(message: &Message) -> Result<Event, ProviderError> {
    let payload = || -> Result<Value, ProviderError> {
        serde_json::from_slice(message.payload()).map_err(|e| {
            ProviderError::new(
                FailureKind::Protocol,
                format!("unreadable bedrock event payload: {e}"),
            )
        })
    };
    match header(message, ":message-type") {
        Some("event") => {}
        Some("exception") => {
            let exception = header(message, ":exception-type").unwrap_or("exception");
            let detail: String = payload()
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_owned))
                .unwrap_or_default()
                .chars()
                .take(300)
                .collect();
            return Err(ProviderError::new(
                exception_kind(exception),
                format!("bedrock reported {exception} mid-stream: {detail}"),
            ));
        }
        Some("error") => {
            return Err(ProviderError::new(
                FailureKind::Stream,
                format!(
                    "bedrock reported {} mid-stream: {}",
                    header(message, ":error-code").unwrap_or("an error"),
                    header(message, ":error-message").unwrap_or("")
                ),
            ));
        }
        other => {
            return Err(ProviderError::new(
                FailureKind::Protocol,
                format!(
                    "bedrock sent a frame of message type {:?}",
                    other.unwrap_or("(none)")
                ),
            ));
        }
    }
    Ok(match header(message, ":event-type").unwrap_or("") {
        "contentBlockDelta" => match payload()?["delta"]["text"].as_str() {
            Some(text) => Event::Text(text.to_owned()),
            // Reasoning and tool-use deltas carry no answer text.
            None => Event::Ignore,
        },
        "messageStop" => Event::Stop(
            payload()?["stopReason"]
                .as_str()
                .unwrap_or("end_turn")
                .to_owned(),
        ),
        "metadata" => Event::Metadata(usage(&payload()?["usage"])),
        _ => Event::Ignore,
    })
}

/// Where a stream decoder is.
struct Decoding<B> {
    body: B,
    frames: FrameReader,
    stopped: bool,
    over: bool,
}

/// Turns an event-stream body into chunks; see the module documentation for what ends it.
fn event_stream_chunks(
    body: impl futures::Stream<Item = Result<bytes::Bytes, reqwest::Error>> + Send + Unpin + 'static,
) -> impl futures::Stream<Item = Result<Chunk, ProviderError>> + Send + 'static {
    let state = Decoding {
        body,
        frames: FrameReader::default(),
        stopped: false,
        over: false,
    };
    futures::stream::unfold(state, |mut s| async move {
        if s.over {
            return None;
        }
        loop {
            let failure = match s.frames.next_frame() {
                Err(e) => e,
                Ok(Some(frame)) => match decode_frame(&frame) {
                    Err(e) => e,
                    Ok(Event::Ignore) => continue,
                    Ok(Event::Text(text)) if text.is_empty() => continue,
                    Ok(Event::Text(text)) => {
                        let chunk = Chunk {
                            text,
                            ..Chunk::default()
                        };
                        return Some((Ok(chunk), s));
                    }
                    Ok(Event::Stop(reason)) => {
                        s.stopped = true;
                        let chunk = Chunk {
                            finish_reason: Some(reason),
                            ..Chunk::default()
                        };
                        return Some((Ok(chunk), s));
                    }
                    Ok(Event::Metadata(usage)) => {
                        // Metadata is the last event; should one come early, keep reading.
                        s.over = s.stopped;
                        let chunk = Chunk {
                            usage,
                            ..Chunk::default()
                        };
                        return Some((Ok(chunk), s));
                    }
                },
                Ok(None) => match s.body.next().await {
                    Some(Ok(bytes)) => {
                        s.frames.push(&bytes);
                        continue;
                    }
                    Some(Err(e)) => ProviderError::new(
                        FailureKind::Truncated,
                        format!("the connection broke mid-stream: {e}"),
                    ),
                    None if s.stopped => {
                        if s.frames.pending() > 0 {
                            tracing::warn!(
                                bytes = s.frames.pending(),
                                "bedrock stream ended inside a frame after messageStop"
                            );
                        }
                        return None;
                    }
                    None => ProviderError::new(
                        FailureKind::Truncated,
                        "the stream ended without messageStop: the answer is incomplete",
                    ),
                },
            };
            s.over = true;
            return Some((Err(failure), s));
        }
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
    fn name(&self) -> &'static str {
        "bedrock"
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
            .post(
                &self.url_for(request, &self.stream_url, "converse-stream"),
                self.body(request),
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
                self.body(request),
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
        })
    }
}

#[cfg(test)]
mod tests {
    use aws_smithy_types::event_stream::{Header, HeaderValue as FrameValue};

    use super::*;

    fn frame(headers: &[(&'static str, &'static str)], payload: Value) -> Vec<u8> {
        let mut m = Message::new(payload.to_string().into_bytes());
        for (name, value) in headers {
            m = m.add_header(Header::new(*name, FrameValue::String((*value).into())));
        }
        let mut out = Vec::new();
        aws_smithy_eventstream::frame::write_message_to(&m, &mut out).unwrap();
        out
    }

    fn event(kind: &'static str, payload: Value) -> Vec<u8> {
        frame(
            &[
                (":message-type", "event"),
                (":event-type", kind),
                (":content-type", "application/json"),
            ],
            payload,
        )
    }

    fn exception(kind: &'static str) -> Vec<u8> {
        frame(
            &[(":message-type", "exception"), (":exception-type", kind)],
            json!({"message": "it went wrong"}),
        )
    }

    fn conversation() -> Vec<u8> {
        [
            event("messageStart", json!({"role": "assistant"})),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": "Hello"}}),
            ),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": " world"}}),
            ),
            event("contentBlockStop", json!({"contentBlockIndex": 0})),
            event("messageStop", json!({"stopReason": "end_turn"})),
            event(
                "metadata",
                json!({"usage": {"inputTokens": 10, "outputTokens": 5, "totalTokens": 15}, "metrics": {"latencyMs": 412}}),
            ),
        ]
        .concat()
    }

    fn drain(frames: &mut FrameReader, out: &mut Vec<Event>) -> Result<(), ProviderError> {
        while let Some(m) = frames.next_frame()? {
            out.push(decode_frame(&m)?);
        }
        Ok(())
    }

    fn expected() -> Vec<Event> {
        vec![
            Event::Ignore,
            Event::Text("Hello".into()),
            Event::Text(" world".into()),
            Event::Ignore,
            Event::Stop("end_turn".into()),
            Event::Metadata(Some(Usage {
                input: 10,
                output: 5,
            })),
        ]
    }

    #[test]
    fn frames_decode_however_the_bytes_are_split() {
        let bytes = conversation();
        // Every split point into two writes, and all frames in one write.
        for at in 0..=bytes.len() {
            let mut frames = FrameReader::default();
            let mut out = Vec::new();
            frames.push(&bytes[..at]);
            drain(&mut frames, &mut out).unwrap();
            frames.push(&bytes[at..]);
            drain(&mut frames, &mut out).unwrap();
            assert_eq!(out, expected(), "split at {at}");
            assert_eq!(frames.pending(), 0);
        }
        // One byte at a time.
        let mut frames = FrameReader::default();
        let mut out = Vec::new();
        for b in &bytes {
            frames.push(std::slice::from_ref(b));
            drain(&mut frames, &mut out).unwrap();
        }
        assert_eq!(out, expected());
    }

    #[test]
    fn a_bad_crc_is_a_protocol_error() {
        let good = event("contentBlockDelta", json!({"delta": {"text": "Hi"}}));
        // A flipped payload byte fails the message CRC.
        let mut bad = good.clone();
        let at = bad.len() - 6;
        bad[at] ^= 0x20;
        let mut frames = FrameReader::default();
        frames.push(&bad);
        let e = frames.next_frame().unwrap_err();
        assert_eq!(e.kind, FailureKind::Protocol);
        assert!(e.message.contains("corrupt"), "{}", e.message);
        // A flipped length byte fails the prelude CRC at once, without waiting for the
        // (now huge) frame.
        let mut bad = good;
        bad[1] ^= 0x40;
        let mut frames = FrameReader::default();
        frames.push(&bad[..PRELUDE]);
        let e = frames.next_frame().unwrap_err();
        assert!(e.message.contains("prelude"), "{}", e.message);
    }

    #[test]
    fn exception_frames_become_the_right_failure_kind() {
        for (name, kind) in [
            ("throttlingException", FailureKind::RateLimited),
            ("modelStreamErrorException", FailureKind::Server),
            ("internalServerException", FailureKind::Server),
            ("serviceUnavailableException", FailureKind::Server),
            ("validationException", FailureKind::BadRequest),
            ("somethingNewException", FailureKind::Stream),
        ] {
            let mut frames = FrameReader::default();
            frames.push(&exception(name));
            let e = decode_frame(&frames.next_frame().unwrap().unwrap()).unwrap_err();
            assert_eq!(e.kind, kind, "{name}");
            assert!(
                e.message.contains(name) && e.message.contains("it went wrong"),
                "{}",
                e.message
            );
        }
    }

    #[tokio::test]
    async fn the_stream_ends_after_metadata_and_is_truncated_without_message_stop() {
        let collect = |bytes: Vec<u8>| async move {
            let body = futures::stream::iter(
                bytes
                    .chunks(5)
                    .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
                    .collect::<Vec<_>>(),
            );
            event_stream_chunks(body).collect::<Vec<_>>().await
        };
        let items = collect(conversation()).await;
        let chunks: Vec<Chunk> = items.into_iter().map(Result::unwrap).collect();
        let text: String = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(text, "Hello world");
        assert_eq!(
            chunks.last().unwrap().usage,
            Some(Usage {
                input: 10,
                output: 5
            })
        );
        let mut cut = conversation();
        let stop = event("messageStop", json!({"stopReason": "end_turn"}));
        let metadata_len = cut.len() - cut.windows(stop.len()).position(|w| w == stop).unwrap();
        cut.truncate(cut.len() - metadata_len);
        let items = collect(cut).await;
        assert_eq!(
            items.last().unwrap().as_ref().unwrap_err().kind,
            FailureKind::Truncated
        );
    }

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

    /// AWS's SigV4 test suite, `post-vanilla` and `get-vanilla-with-session-token`
    /// (credentials AKIDEXAMPLE, 2015-08-30T12:36:00Z, us-east-1, service `service`).
    #[test]
    fn signatures_match_the_aws_sigv4_test_suite() {
        let time = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_440_938_160);
        let mut keys = SigV4Keys {
            access_key_id: "AKIDEXAMPLE",
            secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            session_token: None,
        };
        let auth = |keys: &SigV4Keys<'_>, method| {
            let h = sigv4_headers(
                keys,
                "us-east-1",
                "service",
                method,
                "https://example.amazonaws.com/",
                &[],
                b"",
                time,
            )
            .unwrap();
            let get = |n: &str| {
                h.iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_str().unwrap().to_owned())
            };
            assert_eq!(get("x-amz-date").as_deref(), Some("20150830T123600Z"));
            (get("authorization").unwrap(), get("x-amz-security-token"))
        };
        assert_eq!(
            auth(&keys, "POST").0,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"
        );
        let token = "6e86291e8372ff2a2260956d9b8aae1d763fbf315fa00fa31553b73ebf194267";
        keys.session_token = Some(token);
        let (authorization, sent_token) = auth(&keys, "GET");
        assert_eq!(
            authorization,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date;x-amz-security-token, \
             Signature=07ec1639c89043aa0e3e2de82b96708f198cceab042d4a97044c66dd9f74e7f8"
        );
        assert_eq!(sent_token.as_deref(), Some(token));
    }

    #[test]
    fn credentials_never_print() {
        let c = BedrockCredentials::SigV4 {
            access_key_id: Secret::new("AKIDSECRETID"),
            secret_access_key: Secret::new("very-secret-key"),
            session_token: Some(Secret::new("very-secret-token")),
        };
        let mut config = BedrockConfig::new("us-east-1", "m");
        config.credentials = c.clone();
        let printed = format!("{c:?} {config:?} {}", c.source());
        for s in ["AKIDSECRETID", "very-secret-key", "very-secret-token"] {
            assert!(!printed.contains(s), "{printed}");
        }
        assert!(c.source().contains(SECRET_ACCESS_KEY_VAR));
    }

    #[test]
    fn a_conversation_and_its_settings_map_onto_converse() {
        let mut config = BedrockConfig::new("us-east-1", "m");
        config.base_url = "http://127.0.0.1:1".into();
        let p = BedrockProvider::new(config).unwrap();
        let request = crate::providers::conversation_request();
        let b: Value = serde_json::from_slice(&p.body(&request)).unwrap();
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
}
