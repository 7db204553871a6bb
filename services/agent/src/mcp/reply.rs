//! A JSON-RPC reply read from an MCP server's answer: a JSON body or an event stream, bounded
//! in size, matched to the request's id.

use super::*;

/// How a response body carries the JSON-RPC answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyKind {
    /// One JSON object (or a batch array holding it).
    Json,
    /// An SSE stream whose events carry JSON-RPC messages.
    EventStream,
}

pub(super) fn body_kind(headers: &HeaderMap) -> Result<BodyKind, String> {
    let content_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.as_str() {
        "application/json" => Ok(BodyKind::Json),
        "text/event-stream" => Ok(BodyKind::EventStream),
        "" => Err("the answer has no Content-Type".into()),
        other => Err(format!(
            "the answer is {other}, not application/json or text/event-stream"
        )),
    }
}

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(super) struct RpcError {
    pub(super) code: i64,
    #[serde(default)]
    pub(super) message: String,
}

/// Why the answer could not be read.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ReadError {
    /// The body broke off.
    Body(String),
    /// The body is not a JSON-RPC answer to the request.
    Malformed(String),
}

/// One JSON-RPC message from the server: a response (`id` and `result` or `error`), or a
/// request or notification of its own (`method`).
#[derive(Debug, Deserialize)]
pub(super) struct Incoming {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    result: Option<Value>,
    #[serde(default)]
    error: Option<RpcError>,
}

impl Incoming {
    /// The answer to request `id`, if this message is it. An error without an id is the
    /// server failing to read the request, so it is the answer too.
    fn answer_to(self, id: u64) -> Option<Result<Value, RpcError>> {
        if self.method.is_some() {
            return None;
        }
        let matches = match &self.id {
            Some(Value::Number(n)) => n.as_u64() == Some(id),
            Some(Value::String(s)) => s.parse::<u64>().ok() == Some(id),
            Some(Value::Null) | None => self.error.is_some(),
            Some(_) => false,
        };
        if !matches {
            return None;
        }
        match (self.result, self.error) {
            (_, Some(error)) => Some(Err(error)),
            (Some(result), None) => Some(Ok(result)),
            // A response with neither: read as an empty result rather than rejected, the
            // lenient reading of a server that serialised `null`.
            (None, None) => Some(Ok(Value::Null)),
        }
    }
}

/// Reads the answer to request `id` from a body of the given kind. On an SSE stream the
/// server's own notifications and requests before the answer are skipped.
pub(super) async fn read_reply<S, B, E>(
    kind: BodyKind,
    body: S,
    id: u64,
) -> Result<Result<Value, RpcError>, ReadError>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: fmt::Display,
{
    let mut seen = 0usize;
    let body = body.map(move |chunk| match chunk {
        Ok(bytes) => {
            seen += bytes.as_ref().len();
            if seen > MAX_RESPONSE_BYTES {
                Err(ReadError::Malformed(format!(
                    "the answer exceeds {MAX_RESPONSE_BYTES} bytes"
                )))
            } else {
                Ok(bytes)
            }
        }
        Err(e) => Err(ReadError::Body(e.to_string())),
    });
    match kind {
        BodyKind::Json => read_json(body, id).await,
        BodyKind::EventStream => read_event_stream(body, id).await,
    }
}

/// Reads a reply body as the client does: the answer to request `id` from a JSON
/// (`event_stream` false) or SSE body, then that answer read as a `tools/list` page and as a
/// `tools/call` result; all of it described as text. Public for the fuzz targets (`fuzz/`),
/// which feed it bytes in arbitrary chunks.
#[doc(hidden)]
pub async fn describe_reply<S, B, E>(event_stream: bool, body: S, id: u64) -> String
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: fmt::Display,
{
    let kind = if event_stream {
        BodyKind::EventStream
    } else {
        BodyKind::Json
    };
    let reply = read_reply(kind, body, id).await;
    let mut out = format!("{reply:?}");
    if let Ok(Ok(result)) = reply {
        if let Ok(page) = serde_json::from_value::<ToolsPage>(result.clone()) {
            out.push_str(&format!("\n{page:?}"));
        }
        if let Ok(call) = serde_json::from_value::<CallResult>(result) {
            out.push('\n');
            out.push_str(&call.into_tool_result().text);
        }
    }
    out
}

pub(super) async fn read_json<S, B>(
    mut body: S,
    id: u64,
) -> Result<Result<Value, RpcError>, ReadError>
where
    S: Stream<Item = Result<B, ReadError>> + Unpin,
    B: AsRef<[u8]>,
{
    let mut bytes = Vec::new();
    while let Some(chunk) = body.next().await {
        bytes.extend_from_slice(chunk?.as_ref());
    }
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ReadError::Malformed(format!("the JSON answer does not parse: {e}")))?;
    // Protocol 2025-03-26 allowed batches; the answer is the element with our id.
    let messages = match value {
        Value::Array(items) => items,
        single => vec![single],
    };
    for message in messages {
        let message: Incoming = serde_json::from_value(message)
            .map_err(|e| ReadError::Malformed(format!("not a JSON-RPC message: {e}")))?;
        if let Some(answer) = message.answer_to(id) {
            return Ok(answer);
        }
    }
    Err(ReadError::Malformed(format!(
        "the JSON answer holds no response to request {id}"
    )))
}

pub(super) async fn read_event_stream<S, B>(
    body: S,
    id: u64,
) -> Result<Result<Value, RpcError>, ReadError>
where
    S: Stream<Item = Result<B, ReadError>> + Unpin,
    B: AsRef<[u8]>,
{
    let mut events = body.eventsource();
    while let Some(event) = events.next().await {
        let event = event.map_err(|e| match e {
            EventStreamError::Transport(e) => e,
            EventStreamError::Utf8(e) => ReadError::Malformed(format!("SSE not UTF-8: {e}")),
            EventStreamError::Parser(e) => ReadError::Malformed(format!("SSE does not parse: {e}")),
        })?;
        // Priming events (an id and a retry hint, no data) and keep-alives carry nothing.
        if event.data.trim().is_empty() {
            continue;
        }
        let message: Incoming = serde_json::from_str(&event.data).map_err(|e| {
            ReadError::Malformed(format!("an SSE event is not a JSON-RPC message: {e}"))
        })?;
        if let Some(method) = &message.method {
            // Progress, logging, or a request of the server's own: this client declared no
            // capabilities, so it has nothing to answer with.
            tracing::debug!(method, "MCP server message before the response, skipped");
            continue;
        }
        if let Some(answer) = message.answer_to(id) {
            return Ok(answer);
        }
    }
    Err(ReadError::Malformed(format!(
        "the SSE stream ended before the response to request {id}"
    )))
}
