//! A real MCP server for the agent's tests: the official Rust SDK (`rmcp`) serving four
//! tools over streamable HTTP on a loopback port, behind an optional bearer-token check.
//!
//! Two endpoints share the tools: [`McpServer::url`] is stateful (sessions, every answer on
//! an SSE stream opened by a priming event), [`McpServer::json_url`] is stateless and answers
//! with plain `application/json`; together they exercise both ways a client must read.
//!
//! Tools (`tools/list` pages hold two tools each, so listing them follows a cursor):
//! - `add {a, b}`: the sum, as text;
//! - `echo {text}`: the text;
//! - `fail {message?}`: a result with `isError: true` and the message;
//! - `slow {ms}`: sleeps `ms` milliseconds, then answers; counts the calls the client
//!   cancelled (`notifications/cancelled`) before the sleep ended.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::Request,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::any,
};
use rmcp::{
    ErrorData, RoleServer, ServerHandler,
    model::{
        CallToolRequestParams, CallToolResult, ContentBlock, JsonObject, ListToolsResult,
        PaginatedRequestParams, ServerCapabilities, ServerInfo, Tool,
    },
    service::RequestContext,
    transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
        session::{SessionManager, local::LocalSessionManager},
    },
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Tools per `tools/list` page.
const PAGE_SIZE: usize = 2;

/// What the server counts, shared by every session's handler.
#[derive(Debug, Default)]
struct Counters {
    calls: AtomicUsize,
    cancelled: AtomicUsize,
    sessions: AtomicUsize,
    /// The `traceparent` header of every HTTP request that carried one.
    traceparents: std::sync::Mutex<Vec<String>>,
}

/// The tools, one instance per session (rmcp builds one per `initialize`).
#[derive(Debug, Clone)]
struct Tools {
    counters: Arc<Counters>,
}

fn schema(value: Value) -> Arc<JsonObject> {
    match value {
        Value::Object(map) => Arc::new(map),
        other => panic!("a schema must be an object, not {other}"),
    }
}

fn all_tools() -> Vec<Tool> {
    vec![
        Tool::new(
            "add",
            "Adds two numbers and returns their sum.",
            schema(json!({
                "type": "object",
                "properties": {
                    "a": { "type": "number", "description": "The first addend" },
                    "b": { "type": "number", "description": "The second addend" },
                },
                "required": ["a", "b"],
            })),
        ),
        Tool::new(
            "echo",
            "Returns its text argument unchanged.",
            schema(json!({
                "type": "object",
                "properties": { "text": { "type": "string" } },
                "required": ["text"],
            })),
        ),
        Tool::new(
            "fail",
            "Always fails, reporting the failure as a tool error.",
            schema(json!({
                "type": "object",
                "properties": { "message": { "type": "string" } },
            })),
        ),
        Tool::new(
            "slow",
            "Sleeps for ms milliseconds, then answers.",
            schema(json!({
                "type": "object",
                "properties": { "ms": { "type": "integer", "minimum": 0 } },
                "required": ["ms"],
            })),
        ),
    ]
}

fn number(args: &JsonObject, name: &str) -> Result<f64, ErrorData> {
    args.get(name)
        .and_then(Value::as_f64)
        .ok_or_else(|| ErrorData::invalid_params(format!("argument {name} must be a number"), None))
}

impl ServerHandler for Tools {
    fn get_info(&self) -> ServerInfo {
        ServerInfo::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let start: usize = match request.and_then(|r| r.cursor) {
            Some(cursor) => cursor
                .parse()
                .map_err(|_| ErrorData::invalid_params("unknown cursor", None))?,
            None => 0,
        };
        let tools = all_tools();
        let end = (start + PAGE_SIZE).min(tools.len());
        let mut page = ListToolsResult::with_all_items(tools[start.min(end)..end].to_vec());
        if end < tools.len() {
            page.next_cursor = Some(end.to_string());
        }
        Ok(page)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.counters.calls.fetch_add(1, Ordering::SeqCst);
        let args = request.arguments.unwrap_or_default();
        match request.name.as_ref() {
            "add" => {
                let sum = number(&args, "a")? + number(&args, "b")?;
                Ok(CallToolResult::success(vec![ContentBlock::text(
                    sum.to_string(),
                )]))
            }
            "echo" => {
                let text = args.get("text").and_then(Value::as_str).ok_or_else(|| {
                    ErrorData::invalid_params("argument text must be a string", None)
                })?;
                Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
            }
            "fail" => {
                let message = args
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("the tool failed, as asked");
                Ok(CallToolResult::error(vec![ContentBlock::text(message)]))
            }
            "slow" => {
                let ms = args.get("ms").and_then(Value::as_u64).ok_or_else(|| {
                    ErrorData::invalid_params("argument ms must be a non-negative integer", None)
                })?;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ms)) => {
                        Ok(CallToolResult::success(vec![ContentBlock::text(format!("slept {ms} ms"))]))
                    }
                    _ = context.ct.cancelled() => {
                        self.counters.cancelled.fetch_add(1, Ordering::SeqCst);
                        Err(ErrorData::internal_error("cancelled", None))
                    }
                }
            }
            other => Err(ErrorData::invalid_params(
                format!("Unknown tool: {other}"),
                None,
            )),
        }
    }
}

/// One endpoint: the SDK's service behind the token check.
struct Endpoint {
    service: StreamableHttpService<Tools, LocalSessionManager>,
    token: Option<String>,
    counters: Arc<Counters>,
}

impl Endpoint {
    async fn serve(&self, request: Request) -> Response {
        if let Some(tp) = request
            .headers()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
        {
            self.counters
                .traceparents
                .lock()
                .unwrap()
                .push(tp.to_owned());
        }
        if let Some(token) = &self.token {
            let expected = format!("Bearer {token}");
            let given = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            if given != Some(expected.as_str()) {
                return (
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Bearer")],
                    r#"{"error":"invalid_token","error_description":"missing or wrong bearer token"}"#,
                )
                    .into_response();
            }
        }
        self.service.handle(request).await.map(Body::new)
    }
}

/// A running MCP server. Stops when dropped.
pub struct McpServer {
    /// Where it listens.
    pub addr: SocketAddr,
    counters: Arc<Counters>,
    sessions: Arc<LocalSessionManager>,
    stop: CancellationToken,
}

/// Starts the server on a free loopback port; with `token`, every request must carry
/// `Authorization: Bearer <token>` or gets HTTP 401.
pub async fn start(token: Option<&str>) -> McpServer {
    let counters = Arc::new(Counters::default());
    let sessions = Arc::new(LocalSessionManager::default());
    let stop = CancellationToken::new();
    let factory = |counters: Arc<Counters>, count_sessions: bool| {
        move || {
            // Stateful: one handler per session, so this counts sessions opened.
            if count_sessions {
                counters.sessions.fetch_add(1, Ordering::SeqCst);
            }
            Ok(Tools {
                counters: counters.clone(),
            })
        }
    };
    let config = StreamableHttpServerConfig::default()
        .with_sse_keep_alive(None)
        .with_cancellation_token(stop.child_token());
    let stateful = Arc::new(Endpoint {
        service: StreamableHttpService::new(
            factory(counters.clone(), true),
            sessions.clone(),
            config.clone(),
        ),
        token: token.map(str::to_owned),
        counters: counters.clone(),
    });
    let stateless = Arc::new(Endpoint {
        service: StreamableHttpService::new(
            factory(counters.clone(), false),
            Arc::new(LocalSessionManager::default()),
            config.with_stateful_mode(false).with_json_response(true),
        ),
        token: token.map(str::to_owned),
        counters: counters.clone(),
    });
    let app = Router::new()
        .route(
            "/mcp",
            any(move |request: Request| async move { stateful.serve(request).await }),
        )
        .route(
            "/mcp-json",
            any(move |request: Request| async move { stateless.serve(request).await }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let until = stop.clone();
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { until.cancelled().await })
            .await
            .unwrap();
    });
    McpServer {
        addr,
        counters,
        sessions,
        stop,
    }
}

impl McpServer {
    /// The stateful endpoint: sessions, answers on SSE streams.
    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// The stateless endpoint: no sessions, answers as `application/json`.
    pub fn json_url(&self) -> String {
        format!("http://{}/mcp-json", self.addr)
    }

    /// `tools/call` requests that reached the tools (both endpoints).
    pub fn calls(&self) -> usize {
        self.counters.calls.load(Ordering::SeqCst)
    }

    /// The `traceparent` headers received, in order.
    pub fn traceparents(&self) -> Vec<String> {
        self.counters.traceparents.lock().unwrap().clone()
    }

    /// `slow` calls cancelled by the client before they finished.
    pub fn cancelled(&self) -> usize {
        self.counters.cancelled.load(Ordering::SeqCst)
    }

    /// Sessions opened on the stateful endpoint.
    pub fn sessions_opened(&self) -> usize {
        self.counters.sessions.load(Ordering::SeqCst)
    }

    /// Ends every session, as a server restart or an idle timeout would: requests that
    /// name one get HTTP 404 from then on.
    pub async fn forget_sessions(&self) {
        let ids: Vec<_> = self
            .sessions
            .sessions
            .read()
            .await
            .keys()
            .cloned()
            .collect();
        for id in ids {
            self.sessions.close_session(&id).await.unwrap();
        }
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
