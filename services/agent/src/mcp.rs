//! A client for tools on MCP servers over the streamable HTTP transport (JSON-RPC 2.0
//! POSTed to one endpoint; the answer comes back as one JSON object or on an SSE stream).
//!
//! It lists a server's tools and calls them; the session (`initialize`, then
//! `notifications/initialized`) is opened on first use and opened again, once, when the
//! server says it forgot it (HTTP 404). It must never print the bearer token: not in
//! `Debug`, not in errors (the server URL in errors loses its userinfo and query, and a
//! body excerpt loses any echo of the token).

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use eventsource_stream::{EventStreamError, Eventsource};
use futures::{Stream, StreamExt};
use reqwest::{
    StatusCode, Url,
    header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue},
};
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_runtime::secret::Secret;

/// The protocol version asked for in `initialize`.
const PROTOCOL_VERSION: &str = "2025-06-18";

/// Versions this client speaks; a server answering `initialize` with another one is refused
/// (the spec says the client should then disconnect). They differ in ways this client does
/// not depend on (batching, structured content, titles).
const SUPPORTED_VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26"];

const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";

/// The most a response may weigh. Tool results go into a model's context, so anything near
/// this is already useless; the cap keeps a broken server from exhausting memory.
const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// How much of an error body an error message quotes.
const BODY_EXCERPT_CHARS: usize = 200;

/// `tools/list` pages followed before giving up on a server whose cursors never end.
const MAX_PAGES: usize = 100;

/// How long the courtesy `notifications/cancelled` after a timed-out call may take.
const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// Time limits of an MCP client.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct McpTimeouts {
    /// Establishing a connection.
    pub connect: Duration,
    /// One JSON-RPC exchange, from sending the request to its response (`initialize`, one
    /// `tools/list` page, one `tools/call`).
    pub call: Duration,
}

impl Default for McpTimeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            call: Duration::from_secs(60),
        }
    }
}

/// A tool an MCP server offers.
#[derive(Debug, Clone, PartialEq)]
pub struct McpTool {
    /// The name to call it by.
    pub name: String,
    /// What it does, for the model (empty when the server gives none).
    pub description: String,
    /// The JSON Schema of its arguments.
    pub input_schema: Value,
}

/// What a tool call returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    /// The text content items joined by newlines; other items are described briefly
    /// (`[image image/png]`); the structured content as JSON when there is no content.
    pub text: String,
    /// The tool reported a failure (`isError`): the text says what went wrong, for the model.
    pub is_error: bool,
}

/// Why an MCP request failed. Every message names the server (without userinfo or query).
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The endpoint URL or the token cannot be used.
    #[error("MCP client misconfigured: {0}")]
    Config(String),
    /// No HTTP answer: connection refused, reset, DNS failure.
    #[error("MCP server {server} unreachable during {method}: {reason}")]
    Transport {
        /// The server URL, redacted.
        server: String,
        /// The JSON-RPC method.
        method: String,
        /// What failed.
        reason: String,
    },
    /// No complete answer within the per-call time limit.
    #[error("MCP server {server} did not answer {method} within {after:?}")]
    Timeout {
        /// The server URL, redacted.
        server: String,
        /// The JSON-RPC method.
        method: String,
        /// The limit.
        after: Duration,
    },
    /// The server answered with an HTTP error status.
    #[error("MCP server {server} answered {method} with HTTP {status}{}: {body}", status_hint(*.status))]
    Status {
        /// The server URL, redacted.
        server: String,
        /// The JSON-RPC method.
        method: String,
        /// The HTTP status.
        status: u16,
        /// The start of the body, with any echo of the token removed.
        body: String,
    },
    /// The server answered with a JSON-RPC error (for tools: unknown tool, invalid arguments).
    #[error("MCP server {server} refused {method}: JSON-RPC error {code}: {message}")]
    Rpc {
        /// The server URL, redacted.
        server: String,
        /// The JSON-RPC method.
        method: String,
        /// The JSON-RPC error code.
        code: i64,
        /// The server's message.
        message: String,
    },
    /// The answer does not follow the protocol.
    #[error("MCP server {server} answered {method} in a way this client cannot read: {detail}")]
    Protocol {
        /// The server URL, redacted.
        server: String,
        /// The JSON-RPC method.
        method: String,
        /// What is wrong with it.
        detail: String,
    },
}

impl McpError {
    /// Whether trying again later may succeed (the server or the network may recover; a
    /// refusal or a malformed answer will not change by itself).
    pub fn is_retryable(&self) -> bool {
        match self {
            McpError::Transport { .. } | McpError::Timeout { .. } => true,
            McpError::Status { status, .. } => matches!(status, 408 | 429 | 500..=599),
            McpError::Config(_) | McpError::Rpc { .. } | McpError::Protocol { .. } => false,
        }
    }
}

/// What an operator should check for statuses with one likely cause.
fn status_hint(status: u16) -> &'static str {
    match status {
        401 => " (unauthorized: check the MCP server's bearer token)",
        403 => " (forbidden: the token lacks access to this server)",
        404 => " (not found: check the endpoint path, usually /mcp)",
        405 | 406 | 415 => " (is this a streamable HTTP MCP endpoint?)",
        300..=399 => {
            " (a redirect, which is not followed so that the token goes nowhere else: set the MCP endpoint to its target)"
        }
        _ => "",
    }
}

/// An open session: what `initialize` settled.
#[derive(Debug)]
struct Session {
    /// `Mcp-Session-Id`, when the server assigns sessions.
    id: Option<HeaderValue>,
    /// The negotiated version, sent as `MCP-Protocol-Version` on every later request.
    version: HeaderValue,
}

/// A client of one MCP server. Cheap to share behind an `Arc`; requests may run concurrently.
pub struct McpClient {
    http: reqwest::Client,
    endpoint: Url,
    /// The endpoint as errors and logs show it.
    server: String,
    token: Option<Secret>,
    timeouts: McpTimeouts,
    next_id: AtomicU64,
    /// A tokio mutex because it is held across `initialize`: concurrent first requests wait
    /// for one session instead of each opening their own.
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
}

impl fmt::Debug for McpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpClient")
            .field("server", &self.server)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

/// Why one exchange failed: the server forgot the session (worth one new session), or
/// anything else.
enum Failure {
    SessionExpired,
    Error(McpError),
}

impl From<McpError> for Failure {
    fn from(e: McpError) -> Self {
        Failure::Error(e)
    }
}

impl McpClient {
    /// A client of the server at `endpoint` (`http(s)://host/mcp`), authenticating with
    /// `token` as a bearer token when given. Nothing is sent until the first request.
    pub fn new(
        endpoint: &str,
        token: Option<Secret>,
        timeouts: McpTimeouts,
    ) -> Result<Self, McpError> {
        let url = Url::parse(endpoint)
            .map_err(|e| McpError::Config(format!("the MCP endpoint is not a URL ({e})")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(McpError::Config(format!(
                "the MCP endpoint {} is not http(s)",
                redact_url(&url)
            )));
        }
        if let Some(token) = &token {
            // Checked here so that a token with a newline fails at startup, not per call.
            HeaderValue::from_str(&format!("Bearer {}", token.expose())).map_err(|_| {
                McpError::Config(
                    "the MCP bearer token contains characters not allowed in an HTTP header".into(),
                )
            })?;
        }
        sluice_runtime::install_crypto_provider();
        // No redirects followed: reqwest would carry the bearer token's header to whatever
        // host a redirect names. A 3xx is an error (`post`).
        let http = reqwest::Client::builder()
            .connect_timeout(timeouts.connect)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| McpError::Config(format!("HTTP client: {}", e.without_url())))?;
        Ok(Self {
            http,
            server: redact_url(&url),
            endpoint: url,
            token,
            timeouts,
            next_id: AtomicU64::new(1),
            session: tokio::sync::Mutex::new(None),
        })
    }

    /// The endpoint as errors show it: no userinfo, no query.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The server's tools, all pages of `tools/list`.
    pub async fn tools(&self) -> Result<Vec<McpTool>, McpError> {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let params = match &cursor {
                Some(c) => json!({ "cursor": c }),
                None => json!({}),
            };
            let result = self.request("tools/list", params).await?;
            let page: ToolsPage = serde_json::from_value(result)
                .map_err(|e| self.protocol("tools/list", format!("unexpected result: {e}")))?;
            tools.extend(page.tools.into_iter().map(|t| McpTool {
                name: t.name,
                description: t.description.unwrap_or_default(),
                input_schema: t.input_schema,
            }));
            match page.next_cursor {
                Some(next) if Some(&next) == cursor.as_ref() => {
                    return Err(self.protocol("tools/list", "the same cursor came back twice"));
                }
                Some(next) => cursor = Some(next),
                None => return Ok(tools),
            }
        }
        Err(self.protocol(
            "tools/list",
            format!("more than {MAX_PAGES} pages of tools"),
        ))
    }

    /// Calls the tool `name` with `arguments` (a JSON object; `null` for none).
    ///
    /// A tool that fails in its own terms comes back as `Ok` with `is_error`; `Err` means
    /// the call itself failed (unknown tool, bad arguments, server unreachable).
    pub async fn call(&self, name: &str, arguments: Value) -> Result<ToolResult, McpError> {
        let params = if arguments.is_null() {
            json!({ "name": name })
        } else {
            json!({ "name": name, "arguments": arguments })
        };
        let result = self.request("tools/call", params).await?;
        let result: CallResult = serde_json::from_value(result)
            .map_err(|e| self.protocol("tools/call", format!("unexpected result: {e}")))?;
        Ok(result.into_tool_result())
    }

    /// One request in the current session; a forgotten session is replaced once.
    async fn request(&self, method: &str, params: Value) -> Result<Value, McpError> {
        let session = self.session().await?;
        match self.exchange(Some(&session), method, &params).await {
            Ok((result, _)) => Ok(result),
            Err(Failure::Error(e)) => Err(e),
            Err(Failure::SessionExpired) => {
                tracing::info!(server = %self.server, "MCP session expired; initializing a new one");
                let session = self.renew(&session).await?;
                match self.exchange(Some(&session), method, &params).await {
                    Ok((result, _)) => Ok(result),
                    Err(Failure::Error(e)) => Err(e),
                    Err(Failure::SessionExpired) => Err(McpError::Status {
                        server: self.server.clone(),
                        method: method.into(),
                        status: 404,
                        body: "a new session was forgotten at once".into(),
                    }),
                }
            }
        }
    }

    /// The open session, opening one if there is none.
    async fn session(&self) -> Result<Arc<Session>, McpError> {
        let mut slot = self.session.lock().await;
        if let Some(session) = slot.as_ref() {
            return Ok(session.clone());
        }
        let session = Arc::new(self.initialize().await?);
        *slot = Some(session.clone());
        Ok(session)
    }

    /// Replaces `expired` with a new session, unless a concurrent request already did.
    async fn renew(&self, expired: &Arc<Session>) -> Result<Arc<Session>, McpError> {
        let mut slot = self.session.lock().await;
        if let Some(current) = slot.as_ref() {
            if !Arc::ptr_eq(current, expired) {
                return Ok(current.clone());
            }
        }
        *slot = None;
        let session = Arc::new(self.initialize().await?);
        *slot = Some(session.clone());
        Ok(session)
    }

    /// `initialize`, then `notifications/initialized`.
    async fn initialize(&self) -> Result<Session, McpError> {
        let params = json!({
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": { "name": "sluice-agent", "version": env!("CARGO_PKG_VERSION") },
        });
        let (result, id) = match self.exchange(None, "initialize", &params).await {
            Ok(answer) => answer,
            Err(Failure::Error(e)) => return Err(e),
            // Without a session header the server cannot mean an expired session.
            Err(Failure::SessionExpired) => return Err(self.protocol("initialize", "HTTP 404")),
        };
        let offered = result
            .get("protocolVersion")
            .and_then(Value::as_str)
            .ok_or_else(|| self.protocol("initialize", "no protocolVersion in the result"))?;
        let Some(version) = SUPPORTED_VERSIONS.iter().find(|v| **v == offered) else {
            return Err(self.protocol(
                "initialize",
                format!(
                    "protocol version {offered:?} is not one this client speaks ({})",
                    SUPPORTED_VERSIONS.join(", ")
                ),
            ));
        };
        let session = Session {
            id,
            version: HeaderValue::from_static(version),
        };
        self.notify(&session, "notifications/initialized", json!({}))
            .await?;
        tracing::debug!(server = %self.server, version = *version, session = session.id.is_some(), "MCP session open");
        Ok(session)
    }

    /// Sends a notification; the server answers 202 with no body.
    async fn notify(&self, session: &Session, method: &str, params: Value) -> Result<(), McpError> {
        let body = json!({ "jsonrpc": "2.0", "method": method, "params": params });
        let send = async {
            let response = self.post(Some(session), &body, method).await;
            match response {
                Ok(_) => Ok(()),
                Err(Failure::Error(e)) => Err(e),
                Err(Failure::SessionExpired) => Err(McpError::Status {
                    server: self.server.clone(),
                    method: method.into(),
                    status: 404,
                    body: "the session was forgotten right after initialize".into(),
                }),
            }
        };
        tokio::time::timeout(self.timeouts.call, send)
            .await
            .unwrap_or_else(|_| Err(self.timeout(method)))
    }

    /// One JSON-RPC request and its response, within the per-call time limit. Returns the
    /// result and the session id the server assigned (`initialize`).
    async fn exchange(
        &self,
        session: Option<&Session>,
        method: &str,
        params: &Value,
    ) -> Result<(Value, Option<HeaderValue>), Failure> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let body = json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params });
        let answer = async {
            let response = self.post(session, &body, method).await?;
            let session_id = response.headers().get(SESSION_HEADER).cloned();
            let kind =
                body_kind(response.headers()).map_err(|detail| self.protocol(method, detail))?;
            let reply = read_reply(kind, response.bytes_stream(), id)
                .await
                .map_err(|e| self.read_error(method, e))?;
            match reply {
                Ok(result) => Ok((result, session_id)),
                Err(e) => Err(Failure::Error(McpError::Rpc {
                    server: self.server.clone(),
                    method: method.into(),
                    code: e.code,
                    message: e.message,
                })),
            }
        };
        match tokio::time::timeout(self.timeouts.call, answer).await {
            Ok(answer) => answer,
            Err(_) => {
                // The spec forbids cancelling `initialize`; any other request is cancelled so
                // the server can stop work nobody waits for.
                if let (Some(session), false) = (session, method == "initialize") {
                    self.cancel_in_background(session, id);
                }
                Err(Failure::Error(self.timeout(method)))
            }
        }
    }

    /// POSTs one JSON-RPC message; a 2xx answer is returned for its body to be read.
    async fn post(
        &self,
        session: Option<&Session>,
        body: &Value,
        method: &str,
    ) -> Result<reqwest::Response, Failure> {
        let mut request = self
            .http
            .post(self.endpoint.clone())
            .headers(self.headers(session));
        // Inside a tool call's span (see the handler), carry its W3C trace context.
        if let Some(tp) = sluice_runtime::trace::outbound_traceparent() {
            request = request.header("traceparent", tp);
        }
        let response = request
            .json(body)
            .send()
            .await
            .map_err(|e| self.transport(method, e))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        if status == StatusCode::NOT_FOUND && session.is_some_and(|s| s.id.is_some()) {
            return Err(Failure::SessionExpired);
        }
        let body = read_excerpt(response).await;
        Err(Failure::Error(McpError::Status {
            server: self.server.clone(),
            method: method.into(),
            status: status.as_u16(),
            body: self.scrub(body),
        }))
    }

    /// The headers of every POST.
    fn headers(&self, session: Option<&Session>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(token) = &self.token {
            // Validated in `new`; a failure here cannot happen, and sending without the
            // header would only earn a clear 401.
            if let Ok(mut value) = HeaderValue::from_str(&format!("Bearer {}", token.expose())) {
                value.set_sensitive(true);
                headers.insert(AUTHORIZATION, value);
            }
        }
        if let Some(session) = session {
            if let Some(id) = &session.id {
                headers.insert(SESSION_HEADER, id.clone());
            }
            headers.insert(VERSION_HEADER, session.version.clone());
        }
        headers
    }

    /// Tells the server to stop working on request `id`, without making the caller wait.
    fn cancel_in_background(&self, session: &Session, id: u64) {
        let request = self
            .http
            .post(self.endpoint.clone())
            .headers(self.headers(Some(session)))
            .json(&json!({
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": { "requestId": id, "reason": "timed out" },
            }));
        // Detached but bounded by CANCEL_GRACE, so it never outlives shutdown by much; its
        // outcome does not matter (the server may have finished already).
        tokio::spawn(async move {
            let _ = tokio::time::timeout(CANCEL_GRACE, request.send()).await;
        });
    }

    fn timeout(&self, method: &str) -> McpError {
        McpError::Timeout {
            server: self.server.clone(),
            method: method.into(),
            after: self.timeouts.call,
        }
    }

    fn protocol(&self, method: &str, detail: impl Into<String>) -> McpError {
        McpError::Protocol {
            server: self.server.clone(),
            method: method.into(),
            detail: detail.into(),
        }
    }

    fn transport(&self, method: &str, e: reqwest::Error) -> McpError {
        let what = if e.is_connect() {
            "cannot connect"
        } else if e.is_timeout() {
            "connect timed out"
        } else {
            "request failed"
        };
        // `without_url`: the URL may carry secrets in its query; the server is named already.
        McpError::Transport {
            server: self.server.clone(),
            method: method.into(),
            reason: format!("{what}: {}", error_chain(&e.without_url())),
        }
    }

    fn read_error(&self, method: &str, e: ReadError) -> McpError {
        match e {
            ReadError::Body(reason) => McpError::Transport {
                server: self.server.clone(),
                method: method.into(),
                reason: format!("the answer broke off: {reason}"),
            },
            ReadError::Malformed(detail) => self.protocol(method, detail),
        }
    }

    /// Removes any echo of the token from text quoted in an error.
    fn scrub(&self, text: String) -> String {
        match &self.token {
            Some(token) if !token.expose().is_empty() => text.replace(token.expose(), "<redacted>"),
            _ => text,
        }
    }
}

/// An error and its causes on one line: reqwest's own message ("error sending request")
/// says little; the cause ("Connection refused") is what an operator acts on.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let shown = cause.to_string();
        if !text.contains(&shown) {
            text.push_str(": ");
            text.push_str(&shown);
        }
        source = cause.source();
    }
    text
}

/// The URL as errors show it: scheme, host, port and path only.
fn redact_url(url: &Url) -> String {
    let mut shown = url.clone();
    // Both setters fail only for URLs that cannot have userinfo; nothing to remove then.
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.set_query(None);
    shown.set_fragment(None);
    shown.to_string()
}

/// The first characters of an error body, on one line.
async fn read_excerpt(response: reqwest::Response) -> String {
    let mut body = response.bytes_stream();
    let mut bytes = Vec::new();
    // An error body is quoted, not parsed: a few KiB are plenty.
    while let Some(Ok(chunk)) = body.next().await {
        bytes.extend_from_slice(&chunk);
        if bytes.len() >= 4 * BODY_EXCERPT_CHARS {
            break;
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut excerpt: String = line.chars().take(BODY_EXCERPT_CHARS).collect();
    if line.chars().count() > BODY_EXCERPT_CHARS {
        excerpt.push('…');
    }
    if excerpt.is_empty() {
        excerpt.push_str("(empty body)");
    }
    excerpt
}

/// One page of `tools/list`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ToolsPage {
    #[serde(default)]
    tools: Vec<ToolEntry>,
    #[serde(default)]
    next_cursor: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ToolEntry {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default = "empty_object_schema")]
    input_schema: Value,
}

fn empty_object_schema() -> Value {
    json!({ "type": "object" })
}

/// The result of `tools/call`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CallResult {
    #[serde(default)]
    content: Vec<Value>,
    #[serde(default)]
    structured_content: Option<Value>,
    #[serde(default)]
    is_error: Option<bool>,
}

impl CallResult {
    fn into_tool_result(self) -> ToolResult {
        let mut parts: Vec<String> = self.content.iter().map(describe_content).collect();
        if parts.is_empty() {
            if let Some(structured) = &self.structured_content {
                parts.push(structured.to_string());
            }
        }
        ToolResult {
            text: parts.join("\n"),
            is_error: self.is_error.unwrap_or(false),
        }
    }
}

/// A content item as text: text as is, embedded text resources by their text, anything
/// else named briefly, since the model reading it cannot see images or hear audio.
fn describe_content(item: &Value) -> String {
    let field = |v: &Value, name: &str| v.get(name).and_then(Value::as_str).map(str::to_owned);
    let kind = field(item, "type").unwrap_or_default();
    match kind.as_str() {
        "text" => field(item, "text").unwrap_or_default(),
        "image" | "audio" => match field(item, "mimeType") {
            Some(mime) => format!("[{kind} {mime}]"),
            None => format!("[{kind}]"),
        },
        "resource_link" => format!("[resource link {}]", field(item, "uri").unwrap_or_default()),
        "resource" => {
            let resource = item.get("resource").cloned().unwrap_or(Value::Null);
            match field(&resource, "text") {
                Some(text) => text,
                None => format!("[resource {}]", field(&resource, "uri").unwrap_or_default()),
            }
        }
        "" => "[content]".into(),
        other => format!("[{other}]"),
    }
}

mod reply;

pub use self::reply::describe_reply;
use self::reply::{ReadError, body_kind, read_reply};

#[cfg(test)]
mod tests;
