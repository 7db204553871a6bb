//! A fake AWS Bedrock runtime over real HTTP: `POST /model/{modelId}/converse-stream`
//! answered with real `application/vnd.amazon.eventstream` frames (written by
//! `aws-smithy-eventstream`, CRCs and all), and `POST /model/{modelId}/converse` answered with
//! JSON.
//!
//! It checks credentials as AWS does: a Bedrock API key (`Authorization: Bearer`), or a SigV4
//! `Authorization` header whose shape is checked and whose signature is recomputed from the
//! request as received (method, raw path, signed headers, body) with [`SECRET_ACCESS_KEY`].
//! So a path encoded differently from what was signed fails here as it would at AWS. A bad
//! key or signature gets AWS's 403, whose message quotes the canonical request (session token
//! included), as AWS's does.
//!
//! Model ids are `us.fake.{script}-v1:0` ([`model_id`]), so every call exercises the `.` and
//! `:` of real ids. Scripts:
//!
//! | script | behaviour |
//! |---|---|
//! | `normal` (or unknown) | messageStart, `Hello`, ` world`, `!`, contentBlockStop, messageStop `end_turn`, then metadata (10 in, 5 out); all frames in one write |
//! | `drip` | as `normal`, written 7 bytes at a time, 2 ms apart (frames split across writes) |
//! | `slow` | as `normal`, one frame per write, 100 ms apart |
//! | `rate_limited_once` | 429 `ThrottlingException` on the first call, then `normal` |
//! | `server_error_once` | 500 `InternalServerException` on the first call, then `normal` |
//! | `unavailable` | 503 `ServiceUnavailableException` |
//! | `model_timeout` | 408 `ModelTimeoutException` |
//! | `validation` | 400 `ValidationException` |
//! | `access_denied` | 403 `AccessDeniedException` (the credentials may not use the model) |
//! | `throttled_in_stream_once` | first call: 200 and a `throttlingException` frame before any text; then `normal` |
//! | `exception_mid_stream` | `Hel`, then a `modelStreamErrorException` frame |
//! | `drop_mid_stream` | `Hel`, then the connection breaks |
//! | `no_stop` | `Hel`, then the body ends without messageStop |
//! | `corrupt` | `Hel`, then a frame whose message CRC is wrong |
//! | `hang` | `Hel`, then nothing more, ever (a call its client cancels: [`Fake::abandoned_streams`]) |
//! | `no_metadata` | as `normal` without the metadata frame |
//! | `tools` | tool use with Converse's exact frames: given `toolConfig.tools` and no `toolResult` in the last user message, calls every tool (up to three; only the named one for `toolChoice.tool`) with input `{"q": "<the last user text>"}`: per call a `contentBlockStart` with `start.toolUse` (`tooluse_<i>_<name>`), the input in `contentBlockDelta` `delta.toolUse.input` fragments of at most six bytes, `contentBlockStop`; `messageStop` `tool_use`, metadata 20 in, 10 out. Given results, answers `results: <each toolResult's text, joined by "; ">` (`end_turn`). `converse` answers the same, whole |
//!
//! The non-streaming `converse` answers `Hello world!` (10 in, 5 out) for every script that
//! does not fail before streaming.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
use axum::{
    Json, Router,
    body::Bytes,
    extract::{Path, State},
    http::{HeaderMap, StatusCode, Uri},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use crate::fake::{Calls, Fake, Step, tracked_body};

/// The access key id the fake accepts.
pub const ACCESS_KEY_ID: &str = "AKIDFAKEBEDROCK";
/// The secret access key the fake verifies signatures with.
pub const SECRET_ACCESS_KEY: &str = "fake/Bedrock+Secret/Key";
/// The Bedrock API key the fake accepts.
pub const API_KEY: &str = "ABSKfakebedrockapikey";

/// The model id that selects `script`.
pub fn model_id(script: &str) -> String {
    format!("us.fake.{script}-v1:0")
}

/// The fake Bedrock server.
pub type FakeBedrock = Fake<BedrockSeen>;

/// How a request authenticated.
#[derive(Debug, Clone, PartialEq)]
pub enum SeenAuth {
    /// A valid Bedrock API key.
    Bearer,
    /// A valid SigV4 signature.
    SigV4 {
        /// The region of the credential scope.
        region: String,
        /// The `SignedHeaders` list.
        signed_headers: String,
    },
    /// Refused, with AWS's error type.
    Refused(String),
}

/// One request as received.
#[derive(Debug, Clone)]
pub struct SeenRequest {
    /// The path as sent, not decoded.
    pub raw_path: String,
    /// The model id, decoded.
    pub model: String,
    /// How it authenticated.
    pub auth: SeenAuth,
    /// The JSON body.
    pub body: Value,
}

/// What the fake recorded.
#[derive(Default)]
pub struct BedrockSeen {
    calls: Calls,
    requests: Vec<SeenRequest>,
    abandoned: Arc<std::sync::atomic::AtomicUsize>,
}

impl Fake<BedrockSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| {
            Router::new()
                .route("/model/{model}/converse-stream", post(converse_stream))
                .route("/model/{model}/converse", post(converse))
                .with_state(seen)
        })
        .await
    }

    /// Calls received for `script`.
    pub fn calls(&self, script: &str) -> usize {
        self.seen().calls.get(&model_id(script))
    }

    /// The last request received.
    pub fn last_request(&self) -> SeenRequest {
        self.seen().requests.last().cloned().unwrap()
    }

    /// Streams whose client went away before their end (cancelled calls).
    pub fn abandoned_streams(&self) -> usize {
        self.seen()
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn frame(headers: &[(&'static str, String)], payload: Value) -> Vec<u8> {
    let mut m = Message::new(payload.to_string().into_bytes());
    for (name, value) in headers {
        m = m.add_header(Header::new(
            *name,
            HeaderValue::String(value.clone().into()),
        ));
    }
    let mut out = Vec::new();
    aws_smithy_eventstream::frame::write_message_to(&m, &mut out).unwrap();
    out
}

fn event(kind: &str, payload: Value) -> Vec<u8> {
    frame(
        &[
            (":message-type", "event".into()),
            (":event-type", kind.into()),
            (":content-type", "application/json".into()),
        ],
        payload,
    )
}

fn exception(kind: &str, message: &str) -> Vec<u8> {
    frame(
        &[
            (":message-type", "exception".into()),
            (":exception-type", kind.into()),
            (":content-type", "application/json".into()),
        ],
        json!({"message": message}),
    )
}

fn delta(text: &str) -> Vec<u8> {
    event(
        "contentBlockDelta",
        json!({"contentBlockIndex": 0, "delta": {"text": text}, "p": "abcd"}),
    )
}

fn start() -> Vec<u8> {
    event("messageStart", json!({"role": "assistant", "p": "ab"}))
}

fn stop() -> Vec<u8> {
    event("messageStop", json!({"stopReason": "end_turn"}))
}

fn metadata() -> Vec<u8> {
    event(
        "metadata",
        json!({"usage": {"inputTokens": 10, "outputTokens": 5, "totalTokens": 15},
               "metrics": {"latencyMs": 412}}),
    )
}

/// The frames of the `normal` answer, metadata after messageStop.
fn normal_frames() -> Vec<Vec<u8>> {
    vec![
        start(),
        delta("Hello"),
        delta(" world"),
        delta("!"),
        event("contentBlockStop", json!({"contentBlockIndex": 0})),
        stop(),
        metadata(),
    ]
}

fn aws_error(status: StatusCode, error_type: &str, message: &str) -> Response {
    let mut resp = (status, Json(json!({"message": message}))).into_response();
    resp.headers_mut().insert(
        "x-amzn-ErrorType",
        format!("{error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/")
            .parse()
            .unwrap(),
    );
    resp
}

/// `20250101T120000Z` as a time.
fn amz_date(text: &str) -> Option<SystemTime> {
    let b = text.as_bytes();
    if b.len() != 16 || b[8] != b'T' || b[15] != b'Z' {
        return None;
    }
    let rfc3339 = format!(
        "{}-{}-{}T{}:{}:{}Z",
        &text[0..4],
        &text[4..6],
        &text[6..8],
        &text[9..11],
        &text[11..13],
        &text[13..15]
    );
    let t = aws_smithy_types::DateTime::from_str(
        &rfc3339,
        aws_smithy_types::date_time::Format::DateTime,
    )
    .ok()?;
    SystemTime::try_from(t).ok()
}

/// Checks the credentials as AWS does; `Err` is AWS's 403.
fn authenticate(
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<SeenAuth, (SeenAuth, Box<Response>)> {
    let refuse = |error_type: &str, message: &str| {
        (
            SeenAuth::Refused(error_type.to_owned()),
            Box::new(aws_error(StatusCode::FORBIDDEN, error_type, message)),
        )
    };
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let Some(auth) = header("authorization") else {
        return Err(refuse(
            "MissingAuthenticationTokenException",
            "Missing Authentication Token",
        ));
    };
    if let Some(key) = auth.strip_prefix("Bearer ") {
        return if key == API_KEY {
            Ok(SeenAuth::Bearer)
        } else {
            Err(refuse(
                "UnrecognizedClientException",
                "The security token included in the request is invalid.",
            ))
        };
    }
    // AWS4-HMAC-SHA256 Credential=AKID/20250101/us-west-2/bedrock/aws4_request, SignedHeaders=a;b, Signature=hex
    let malformed = || {
        refuse(
            "IncompleteSignatureException",
            "Authorization header requires 'Credential', 'SignedHeaders' and 'Signature'.",
        )
    };
    let fields = auth
        .strip_prefix("AWS4-HMAC-SHA256 ")
        .ok_or_else(malformed)?;
    let mut parts = fields.split(", ");
    let (Some(credential), Some(signed_headers), Some(signature), None) = (
        parts.next().and_then(|p| p.strip_prefix("Credential=")),
        parts.next().and_then(|p| p.strip_prefix("SignedHeaders=")),
        parts.next().and_then(|p| p.strip_prefix("Signature=")),
        parts.next(),
    ) else {
        return Err(malformed());
    };
    let scope: Vec<&str> = credential.split('/').collect();
    let amz_date_text = header("x-amz-date").unwrap_or("");
    let time = amz_date(amz_date_text);
    let shape_ok = scope.len() == 5
        && scope[1].len() == 8
        && amz_date_text.starts_with(scope[1])
        && scope[3] == "bedrock"
        && scope[4] == "aws4_request"
        && signature.len() == 64
        && signature.bytes().all(|b| b.is_ascii_hexdigit())
        && signed_headers.split(';').any(|h| h == "host")
        && signed_headers.split(';').any(|h| h == "x-amz-date")
        && time.is_some();
    if !shape_ok {
        return Err(malformed());
    }
    if scope[0] != ACCESS_KEY_ID {
        return Err(refuse(
            "UnrecognizedClientException",
            "The security token included in the request is invalid.",
        ));
    }
    // Recompute the signature from the request as received.
    let host = header("host").unwrap_or("");
    let url = format!("http://{host}{}", uri.path_and_query().unwrap().as_str());
    let token = header("x-amz-security-token");
    let others: Vec<(&str, &str)> = signed_headers
        .split(';')
        .filter(|h| !["host", "x-amz-date", "x-amz-security-token"].contains(h))
        .map(|h| (h, header(h).unwrap_or("")))
        .collect();
    let identity = aws_credential_types::Credentials::new(
        ACCESS_KEY_ID,
        SECRET_ACCESS_KEY,
        token.map(str::to_owned),
        None,
        "fake",
    )
    .into();
    let params = aws_sigv4::sign::v4::SigningParams::builder()
        .identity(&identity)
        .region(scope[2])
        .name("bedrock")
        .time(time.unwrap())
        .settings(aws_sigv4::http_request::SigningSettings::default())
        .build()
        .unwrap()
        .into();
    let request = aws_sigv4::http_request::SignableRequest::new(
        "POST",
        url.as_str(),
        others.into_iter(),
        aws_sigv4::http_request::SignableBody::Bytes(body),
    )
    .unwrap();
    let (instructions, _) = aws_sigv4::http_request::sign(request, &params)
        .unwrap()
        .into_parts();
    let expected = instructions
        .headers()
        .find(|(k, _)| *k == "authorization")
        .map(|(_, v)| v.to_owned())
        .unwrap();
    if expected != auth {
        // AWS's answer quotes the canonical request, session token included.
        return Err(refuse(
            "InvalidSignatureException",
            &format!(
                "The request signature we calculated does not match the signature you provided. \
                 Check your AWS Secret Access Key and signing method. Consult the service \
                 documentation for details.\n\nThe Canonical String for this request should have \
                 been\n'POST\n{}\n\nhost:{host}\nx-amz-date:{amz_date_text}\nx-amz-security-token:{}\n'",
                uri.path(),
                token.unwrap_or("")
            ),
        ));
    }
    Ok(SeenAuth::SigV4 {
        region: scope[2].to_owned(),
        signed_headers: signed_headers.to_owned(),
    })
}

/// Records the request and checks it; `Err` is the answer to send instead of the script's.
fn receive(
    seen: &Mutex<BedrockSeen>,
    model: &str,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<(String, usize), Box<Response>> {
    let (auth, refusal) = match authenticate(uri, headers, body) {
        Ok(auth) => (auth, None),
        Err((auth, resp)) => (auth, Some(resp)),
    };
    let mut s = seen.lock().unwrap();
    let call = s.calls.count(model);
    s.requests.push(SeenRequest {
        raw_path: uri.path().to_owned(),
        model: model.to_owned(),
        auth,
        body: serde_json::from_slice(body).unwrap_or(Value::Null),
    });
    if let Some(resp) = refusal {
        return Err(resp);
    }
    let script = model
        .strip_prefix("us.fake.")
        .and_then(|m| m.strip_suffix("-v1:0"))
        .unwrap_or("normal")
        .to_owned();
    Ok((script, call))
}

/// The scripts that fail before any body is streamed.
fn http_failure(script: &str, call: usize) -> Option<Response> {
    Some(match (script, call) {
        ("rate_limited_once", 1) => aws_error(
            StatusCode::TOO_MANY_REQUESTS,
            "ThrottlingException",
            "Too many requests, please wait before trying again.",
        ),
        ("server_error_once", 1) => aws_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerException",
            "The server encountered an internal error.",
        ),
        ("unavailable", _) => aws_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableException",
            "Bedrock is unable to process your request.",
        ),
        ("model_timeout", _) => aws_error(
            StatusCode::REQUEST_TIMEOUT,
            "ModelTimeoutException",
            "Model has timed out in processing the request.",
        ),
        ("validation", _) => aws_error(
            StatusCode::BAD_REQUEST,
            "ValidationException",
            "The provided model identifier is invalid.",
        ),
        ("access_denied", _) => aws_error(
            StatusCode::FORBIDDEN,
            "AccessDeniedException",
            "You don't have access to the model with the specified model ID.",
        ),
        _ => return None,
    })
}

/// What the `tools` script does with `body`: the calls it makes (id, name, input), or the
/// text it answers.
fn tools_turn(body: &Value) -> Result<Vec<(String, String, Value)>, String> {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let last_user = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .cloned()
        .unwrap_or(Value::Null);
    let blocks = last_user["content"].as_array().cloned().unwrap_or_default();
    let results: Vec<String> = blocks
        .iter()
        .filter_map(|b| b.get("toolResult"))
        .map(|r| {
            r["content"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["text"].as_str())
                .collect()
        })
        .collect();
    if !results.is_empty() {
        return Err(format!("results: {}", results.join("; ")));
    }
    let tools = body["toolConfig"]["tools"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if tools.is_empty() {
        return Err("no tools were called".into());
    }
    let named = body["toolConfig"]["toolChoice"]["tool"]["name"].as_str();
    let q: String = blocks.iter().filter_map(|b| b["text"].as_str()).collect();
    Ok(tools
        .iter()
        .filter_map(|t| t["toolSpec"]["name"].as_str())
        .filter(|n| named.is_none_or(|only| only == *n))
        .take(3)
        .enumerate()
        .map(|(i, name)| {
            (
                format!("tooluse_{i}_{name}"),
                name.to_owned(),
                json!({"q": q}),
            )
        })
        .collect())
}

/// What Converse refuses in a conversation with tool blocks, as it words it: tool blocks
/// without a toolConfig, a toolUseId off `^[a-zA-Z0-9_-]{1,64}$`, empty content.
fn tools_refusal(body: &Value) -> Option<String> {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let mut tool_blocks = false;
    for m in &messages {
        let blocks = m["content"].as_array().cloned().unwrap_or_default();
        if blocks.is_empty() {
            return Some("The content field in the Message object is empty. Add a ContentBlock object to the content field and try again.".into());
        }
        for b in blocks {
            let id = b["toolUse"]["toolUseId"]
                .as_str()
                .or(b["toolResult"]["toolUseId"].as_str());
            if let Some(id) = id {
                tool_blocks = true;
                let ok = (1..=64).contains(&id.len())
                    && id
                        .bytes()
                        .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
                if !ok {
                    return Some("1 validation error detected: Value at 'messages.n.member.content.n.member.toolUse.toolUseId' failed to satisfy constraint: Member must satisfy regular expression pattern: [a-zA-Z0-9_-]+".into());
                }
            }
        }
    }
    (tool_blocks && body.get("toolConfig").is_none()).then(|| {
        "The toolConfig field must be defined when using toolUse and toolResult content blocks."
            .into()
    })
}

/// The `tools` script's frames for `body`.
fn tools_frames(body: &Value) -> Vec<u8> {
    let mut frames = vec![start()];
    let stop_reason = match tools_turn(body) {
        Err(text) => {
            frames.push(delta(&text));
            frames.push(event("contentBlockStop", json!({"contentBlockIndex": 0})));
            "end_turn"
        }
        Ok(calls) => {
            for (block, (id, name, input)) in calls.into_iter().enumerate() {
                frames.push(event(
                    "contentBlockStart",
                    json!({"contentBlockIndex": block, "p": "abc",
                        "start": {"toolUse": {"toolUseId": id, "name": name}}}),
                ));
                let text = input.to_string();
                let chars: Vec<char> = text.chars().collect();
                for piece in chars.chunks(6) {
                    let piece: String = piece.iter().collect();
                    frames.push(event(
                        "contentBlockDelta",
                        json!({"contentBlockIndex": block, "p": "abcd",
                            "delta": {"toolUse": {"input": piece}}}),
                    ));
                }
                frames.push(event(
                    "contentBlockStop",
                    json!({"contentBlockIndex": block}),
                ));
            }
            "tool_use"
        }
    };
    frames.push(event("messageStop", json!({"stopReason": stop_reason})));
    frames.push(event(
        "metadata",
        json!({"usage": {"inputTokens": 20, "outputTokens": 10, "totalTokens": 30},
               "metrics": {"latencyMs": 212}}),
    ));
    frames.concat()
}

async fn converse_stream(
    State(seen): State<Arc<Mutex<BedrockSeen>>>,
    Path(model): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (script, call) = match receive(&seen, &model, &uri, &headers, &body) {
        Ok(x) => x,
        Err(resp) => return *resp,
    };
    if let Some(resp) = http_failure(&script, call) {
        return resp;
    }
    let hel = || vec![start(), delta("Hel")];
    let frames: Vec<Step> = match (script.as_str(), call) {
        ("drip", _) => {
            let all = normal_frames().concat();
            all.chunks(7)
                .flat_map(|c| {
                    [
                        Step::Bytes(c.to_vec()),
                        Step::Wait(Duration::from_millis(2)),
                    ]
                })
                .collect()
        }
        ("slow", _) => normal_frames()
            .into_iter()
            .flat_map(|f| [Step::Wait(Duration::from_millis(100)), Step::Bytes(f)])
            .collect(),
        ("throttled_in_stream_once", 1) => vec![Step::Bytes(
            [
                start(),
                exception("throttlingException", "Too many tokens, please wait."),
            ]
            .concat(),
        )],
        ("exception_mid_stream", _) => vec![
            Step::Bytes(hel().concat()),
            Step::Wait(Duration::from_millis(10)),
            Step::Bytes(exception(
                "modelStreamErrorException",
                "The model stream failed. Retry your request.",
            )),
        ],
        ("drop_mid_stream", _) => vec![
            Step::Bytes(hel().concat()),
            Step::Wait(Duration::from_millis(20)),
            Step::Break,
        ],
        ("no_stop", _) => vec![Step::Bytes(hel().concat())],
        ("hang", _) => vec![Step::Bytes(hel().concat()), Step::Hang],
        ("corrupt", _) => {
            let mut bad = delta("lo");
            let at = bad.len() - 1;
            bad[at] ^= 0xff;
            vec![
                Step::Bytes(hel().concat()),
                Step::Wait(Duration::from_millis(10)),
                Step::Bytes(bad),
            ]
        }
        ("tools", _) => {
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if let Some(message) = tools_refusal(&body) {
                return aws_error(StatusCode::BAD_REQUEST, "ValidationException", &message);
            }
            vec![Step::Bytes(tools_frames(&body))]
        }
        ("no_metadata", _) => {
            let mut f = normal_frames();
            f.pop();
            vec![Step::Bytes(f.concat())]
        }
        _ => vec![Step::Bytes(normal_frames().concat())],
    };
    let abandoned = seen.lock().unwrap().abandoned.clone();
    tracked_body(frames, "application/vnd.amazon.eventstream", abandoned)
}

async fn converse(
    State(seen): State<Arc<Mutex<BedrockSeen>>>,
    Path(model): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (script, call) = match receive(&seen, &model, &uri, &headers, &body) {
        Ok(x) => x,
        Err(resp) => return *resp,
    };
    if let Some(resp) = http_failure(&script, call) {
        return resp;
    }
    if script == "tools" {
        if let Some(message) = tools_refusal(&serde_json::from_slice(&body).unwrap_or(Value::Null))
        {
            return aws_error(StatusCode::BAD_REQUEST, "ValidationException", &message);
        }
        let (content, stop) =
            match tools_turn(&serde_json::from_slice(&body).unwrap_or(Value::Null)) {
                Err(text) => (json!([{"text": text}]), "end_turn"),
                Ok(calls) => (
                    calls
                        .into_iter()
                        .map(|(id, name, input)| {
                            json!({"toolUse": {"toolUseId": id, "name": name, "input": input}})
                        })
                        .collect(),
                    "tool_use",
                ),
            };
        return Json(json!({
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": stop,
            "usage": {"inputTokens": 20, "outputTokens": 10, "totalTokens": 30},
            "metrics": {"latencyMs": 300}
        }))
        .into_response();
    }
    Json(json!({
        "output": {"message": {"role": "assistant", "content": [{"text": "Hello"}, {"text": " world!"}]}},
        "stopReason": "end_turn",
        "usage": {"inputTokens": 10, "outputTokens": 5, "totalTokens": 15},
        "metrics": {"latencyMs": 300}
    }))
    .into_response()
}
