//! The agent's MCP client against a real MCP server (the official SDK, `mcp_server`):
//! listing and calling tools over both answer shapes (SSE and JSON), the failures an
//! operator meets (wrong token, unknown tool, slow tool, unreachable server), and a
//! session the server forgot.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use serde_json::json;
use sluice_agent::mcp::{McpClient, McpError, McpTimeouts, ToolResult};
use sluice_runtime::secret::Secret;
use sluice_tests::mcp_server;

fn client(url: &str, token: Option<&str>) -> McpClient {
    client_with(url, token, Duration::from_secs(10))
}

fn client_with(url: &str, token: Option<&str>, call: Duration) -> McpClient {
    McpClient::new(
        url,
        token.map(Secret::new),
        McpTimeouts {
            connect: Duration::from_secs(2),
            call,
        },
    )
    .unwrap()
}

fn text(text: &str) -> ToolResult {
    ToolResult {
        text: text.into(),
        is_error: false,
    }
}

#[tokio::test]
async fn tools_are_listed_across_pages_over_sse_and_json() {
    let server = mcp_server::start(None).await;
    for url in [server.url(), server.json_url()] {
        let tools = client(&url, None).tools().await.unwrap();
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        // Two tools per page: all four means the cursor was followed.
        assert_eq!(names, ["add", "echo", "fail", "slow"], "{url}");
        assert_eq!(
            tools[0].description,
            "Adds two numbers and returns their sum."
        );
        assert_eq!(tools[0].input_schema["required"], json!(["a", "b"]));
        assert_eq!(
            tools[0].input_schema["properties"]["a"]["type"],
            json!("number")
        );
        assert_eq!(
            tools[3].input_schema["properties"]["ms"]["type"],
            json!("integer")
        );
    }
    // The stateful endpoint opened one session for the three pages.
    assert_eq!(server.sessions_opened(), 1);
}

#[tokio::test]
async fn every_tool_answers_over_sse_and_json() {
    let server = mcp_server::start(None).await;
    for url in [server.url(), server.json_url()] {
        let mcp = client(&url, None);
        assert_eq!(
            mcp.call("add", json!({ "a": 2, "b": 3 })).await.unwrap(),
            text("5")
        );
        assert_eq!(
            mcp.call("add", json!({ "a": 2.5, "b": -1 })).await.unwrap(),
            text("1.5")
        );
        assert_eq!(
            mcp.call("echo", json!({ "text": "héllo\nworld" }))
                .await
                .unwrap(),
            text("héllo\nworld")
        );
        assert_eq!(
            mcp.call("slow", json!({ "ms": 20 })).await.unwrap(),
            text("slept 20 ms")
        );
        let failed = mcp
            .call("fail", json!({ "message": "disk full" }))
            .await
            .unwrap();
        assert_eq!(
            failed,
            ToolResult {
                text: "disk full".into(),
                is_error: true
            }
        );
    }
    assert_eq!(server.calls(), 10);
}

#[tokio::test]
async fn unknown_tools_and_bad_arguments_are_json_rpc_errors() {
    let server = mcp_server::start(None).await;
    let mcp = client(&server.url(), None);
    let err = mcp.call("nope", json!({})).await.unwrap_err();
    match &err {
        McpError::Rpc { code, message, .. } => {
            assert_eq!(*code, -32602);
            assert!(message.contains("Unknown tool: nope"), "{message}");
        }
        other => panic!("expected a JSON-RPC error, got {other:?}"),
    }
    let shown = err.to_string();
    assert!(
        shown.contains(&server.url()) && shown.contains("tools/call"),
        "{shown}"
    );
    let err = mcp.call("add", json!({ "a": 1 })).await.unwrap_err();
    assert!(
        matches!(&err, McpError::Rpc { code: -32602, message, .. } if message.contains("argument b")),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    // The session survives errors.
    assert_eq!(
        mcp.call("echo", json!({ "text": "still here" }))
            .await
            .unwrap(),
        text("still here")
    );
}

#[tokio::test]
async fn a_wrong_or_missing_token_is_a_clear_401_that_never_shows_the_token() {
    let server = mcp_server::start(Some("right-token-1234")).await;
    for token in [Some("wrong-token-5678"), None] {
        let err = client(&server.url(), token).tools().await.unwrap_err();
        assert!(
            matches!(&err, McpError::Status { status: 401, .. }),
            "{err:?}"
        );
        let shown = err.to_string();
        assert!(
            shown.contains(&server.url())
                && shown.contains("initialize")
                && shown.contains("bearer token"),
            "{shown}"
        );
        for secret in ["right-token-1234", "wrong-token-5678"] {
            assert!(!shown.contains(secret) && !format!("{err:?}").contains(secret));
        }
    }
    let mcp = client(&server.url(), Some("right-token-1234"));
    assert_eq!(mcp.tools().await.unwrap().len(), 4);
    assert_eq!(
        mcp.call("add", json!({ "a": 1, "b": 1 })).await.unwrap(),
        text("2")
    );
}

#[tokio::test]
async fn a_slow_tool_times_out_per_call_and_is_cancelled_on_the_server() {
    let server = mcp_server::start(None).await;
    let mcp = client_with(&server.url(), None, Duration::from_millis(500));
    // Open the session first, so the limit below times the call alone.
    assert_eq!(mcp.tools().await.unwrap().len(), 4);
    let started = Instant::now();
    let err = mcp.call("slow", json!({ "ms": 10_000 })).await.unwrap_err();
    let waited = started.elapsed();
    assert!(
        matches!(&err, McpError::Timeout { method, after, .. }
            if method == "tools/call" && *after == Duration::from_millis(500)),
        "{err:?}"
    );
    assert!(err.is_retryable());
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
    // The client told the server to stop: the tool saw the cancellation.
    let seen = sluice_tests::eventually(
        Duration::from_secs(5),
        async || server.cancelled(),
        |n| *n > 0,
    )
    .await;
    assert!(seen > 0, "the server never saw the cancellation");
    // And the client goes on working.
    assert_eq!(
        mcp.call("slow", json!({ "ms": 10 })).await.unwrap(),
        text("slept 10 ms")
    );
}

#[tokio::test]
async fn a_forgotten_session_is_reinitialized_once_and_the_call_retried() {
    let server = mcp_server::start(None).await;
    let mcp = client(&server.url(), None);
    assert_eq!(
        mcp.call("echo", json!({ "text": "one" })).await.unwrap(),
        text("one")
    );
    assert_eq!(server.sessions_opened(), 1);
    server.forget_sessions().await;
    assert_eq!(
        mcp.call("echo", json!({ "text": "two" })).await.unwrap(),
        text("two")
    );
    assert_eq!(server.sessions_opened(), 2);
    // The call reached the tool once: the 404 came before it.
    assert_eq!(server.calls(), 2);
    server.forget_sessions().await;
    assert_eq!(mcp.tools().await.unwrap().len(), 4);
    assert_eq!(server.sessions_opened(), 3);
}

#[tokio::test]
async fn concurrent_first_requests_share_one_session() {
    let server = mcp_server::start(None).await;
    let mcp = Arc::new(client(&server.url(), None));
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let mcp = mcp.clone();
            tokio::spawn(async move { mcp.call("echo", json!({ "text": format!("#{i}") })).await })
        })
        .collect();
    for (i, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), text(&format!("#{i}")));
    }
    assert_eq!(server.sessions_opened(), 1);
}

#[tokio::test]
async fn an_unreachable_server_is_a_transport_error_naming_it() {
    // A port that was free a moment ago: nothing listens there.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/mcp?key=query-secret",
        listener.local_addr().unwrap()
    );
    drop(listener);
    let err = client(&url, Some("tok-secret")).tools().await.unwrap_err();
    assert!(matches!(&err, McpError::Transport { .. }), "{err:?}");
    assert!(err.is_retryable());
    let shown = err.to_string();
    assert!(
        shown.contains("/mcp") && shown.contains("cannot connect"),
        "{shown}"
    );
    assert!(
        !shown.contains("query-secret") && !shown.contains("tok-secret"),
        "{shown}"
    );
}
