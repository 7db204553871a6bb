#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;

use super::*;

fn chunks(parts: &[&str]) -> impl Stream<Item = Result<Vec<u8>, Infallible>> + Unpin {
    futures::stream::iter(
        parts
            .iter()
            .map(|p| Ok(p.as_bytes().to_vec()))
            .collect::<Vec<_>>(),
    )
}

async fn read(
    kind: BodyKind,
    parts: &[&str],
    id: u64,
) -> Result<Result<Value, RpcError>, ReadError> {
    read_reply(kind, chunks(parts), id).await
}

#[tokio::test]
async fn a_json_answer_is_read_whole_even_when_split() {
    let answer = read(
        BodyKind::Json,
        &[r#"{"jsonrpc":"2.0","id":7,"res"#, r#"ult":{"ok":true}}"#],
        7,
    )
    .await
    .unwrap();
    assert_eq!(answer, Ok(json!({ "ok": true })));
}

#[tokio::test]
async fn a_json_error_is_a_json_rpc_error() {
    let answer = read(
        BodyKind::Json,
        &[r#"{"jsonrpc":"2.0","id":3,"error":{"code":-32602,"message":"Unknown tool: x"}}"#],
        3,
    )
    .await
    .unwrap();
    assert_eq!(
        answer,
        Err(RpcError {
            code: -32602,
            message: "Unknown tool: x".into()
        })
    );
}

#[tokio::test]
async fn a_json_batch_yields_the_element_with_our_id() {
    let answer = read(
        BodyKind::Json,
        &[
            r#"[{"jsonrpc":"2.0","method":"notifications/progress","params":{}},
                 {"jsonrpc":"2.0","id":4,"result":{"n":1}},
                 {"jsonrpc":"2.0","id":5,"result":{"n":2}}]"#,
        ],
        5,
    )
    .await
    .unwrap();
    assert_eq!(answer, Ok(json!({ "n": 2 })));
}

#[tokio::test]
async fn json_without_our_response_is_malformed() {
    for body in [
        r#"{"jsonrpc":"2.0","id":99,"result":{}}"#,
        "not json",
        r#"{"jsonrpc":"2.0","id":1,"result":"#,
    ] {
        let err = read(BodyKind::Json, &[body], 1).await.unwrap_err();
        assert!(matches!(err, ReadError::Malformed(_)), "{body}: {err:?}");
    }
}

#[tokio::test]
async fn sse_skips_priming_notifications_requests_and_other_ids() {
    let stream = [
        // A priming event: id and retry, empty data.
        "id: 0\nretry: 3000\ndata:\n\n",
        ": keep-alive comment\n\n",
        "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",",
        "\"params\":{\"progressToken\":1,\"progress\":0.5}}\n\n",
        "data: {\"jsonrpc\":\"2.0\",\"id\":\"srv-1\",\"method\":\"ping\"}\n\n",
        "data: {\"jsonrpc\":\"2.0\",\"id\":41,\"result\":{\"stale\":true}}\n\n",
        "id: 5\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\n",
        "data: \"id\":42,\"result\":{\"content\":[]}}\r\n\r\n",
        "data: {\"jsonrpc\":\"2.0\",\"id\":43,\"result\":{}}\n\n",
    ];
    let answer = read(BodyKind::EventStream, &stream, 42).await.unwrap();
    assert_eq!(answer, Ok(json!({ "content": [] })));
}

#[tokio::test]
async fn an_sse_stream_that_ends_before_the_response_is_malformed() {
    let err = read(
        BodyKind::EventStream,
        &["data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{}}\n\n"],
        1,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, ReadError::Malformed(m) if m.contains("ended before the response")),
        "{err:?}"
    );
    let err = read(BodyKind::EventStream, &["data: {oops\n\n"], 1)
        .await
        .unwrap_err();
    assert!(matches!(err, ReadError::Malformed(_)), "{err:?}");
}

#[tokio::test]
async fn a_broken_body_is_a_transport_failure() {
    let body = futures::stream::iter(vec![
        Ok(b"data: {\"jsonrpc\"".to_vec()),
        Err("connection reset"),
    ]);
    let err = read_reply(BodyKind::EventStream, body, 1)
        .await
        .unwrap_err();
    assert_eq!(err, ReadError::Body("connection reset".into()));
}

#[tokio::test]
async fn an_oversized_answer_is_refused() {
    let big = vec![b' '; MAX_RESPONSE_BYTES / 2 + 1];
    let body = futures::stream::iter(vec![Ok::<_, Infallible>(big.clone()), Ok(big)]);
    let err = read_reply(BodyKind::Json, body, 1).await.unwrap_err();
    assert!(
        matches!(&err, ReadError::Malformed(m) if m.contains("exceeds")),
        "{err:?}"
    );
}

#[test]
fn content_items_become_text() {
    let result: CallResult = serde_json::from_value(json!({
        "content": [
            { "type": "text", "text": "first" },
            { "type": "image", "data": "AAAA", "mimeType": "image/png" },
            { "type": "audio", "data": "AAAA" },
            { "type": "resource_link", "uri": "file:///a.txt", "name": "a" },
            { "type": "resource", "resource": { "uri": "file:///b.txt", "text": "inline" } },
            { "type": "resource", "resource": { "uri": "file:///c.bin", "blob": "AA==" } },
            { "type": "text", "text": "last" },
        ],
        "isError": true,
    }))
    .unwrap();
    assert_eq!(
        result.into_tool_result(),
        ToolResult {
            text: "first\n[image image/png]\n[audio]\n[resource link file:///a.txt]\ninline\n[resource file:///c.bin]\nlast".into(),
            is_error: true,
        }
    );
    let structured: CallResult =
        serde_json::from_value(json!({ "content": [], "structuredContent": { "sum": 3 } }))
            .unwrap();
    assert_eq!(
        structured.into_tool_result(),
        ToolResult {
            text: r#"{"sum":3}"#.into(),
            is_error: false
        }
    );
}

#[test]
fn debug_and_errors_never_show_the_token_or_url_secrets() {
    let client = McpClient::new(
        "https://user:pw-secret@mcp.example.com:8443/mcp?api_key=query-secret#frag",
        Some(Secret::new("tok-very-secret")),
        McpTimeouts::default(),
    )
    .unwrap();
    let debug = format!("{client:?}");
    assert!(debug.contains("<redacted>"), "{debug}");
    for secret in ["tok-very-secret", "pw-secret", "query-secret", "user"] {
        assert!(!debug.contains(secret), "{secret} in {debug}");
    }
    assert_eq!(client.server(), "https://mcp.example.com:8443/mcp");
    assert_eq!(
        client.scrub("bad token tok-very-secret".into()),
        "bad token <redacted>"
    );
}

#[test]
fn bad_endpoints_and_tokens_fail_at_construction() {
    let err = McpClient::new("not a url", None, McpTimeouts::default()).unwrap_err();
    assert!(err.to_string().contains("not a URL"), "{err}");
    let err = McpClient::new("ftp://h/mcp", None, McpTimeouts::default()).unwrap_err();
    assert!(err.to_string().contains("not http(s)"), "{err}");
    let err = McpClient::new(
        "http://127.0.0.1/mcp",
        Some(Secret::new("line\nbreak-secret")),
        McpTimeouts::default(),
    )
    .unwrap_err();
    assert!(!err.to_string().contains("break-secret"), "{err}");
}

#[test]
fn error_messages_guide_the_operator() {
    let unauthorized = McpError::Status {
        server: "http://h/mcp".into(),
        method: "initialize".into(),
        status: 401,
        body: "missing token".into(),
    };
    let text = unauthorized.to_string();
    assert!(
        text.contains("http://h/mcp") && text.contains("401") && text.contains("bearer token"),
        "{text}"
    );
    assert!(!unauthorized.is_retryable());
    assert!(
        McpError::Timeout {
            server: "s".into(),
            method: "tools/call".into(),
            after: Duration::from_secs(1)
        }
        .is_retryable()
    );
}
