#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;

use super::{
    reply::{BodyKind, RpcError},
    *,
};

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

/// A loopback HTTP/1.1 server answering every request with `response`, recording each
/// request's head (request line and headers, lower-cased).
async fn recording_server(
    response: String,
) -> (std::net::SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // The head, then as much body as it announces, so that closing sends no reset.
            let head_end = loop {
                let n = socket.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break None;
                }
                buf.extend_from_slice(&chunk[..n]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break Some(i + 4);
                }
            };
            let Some(head_end) = head_end else { continue };
            let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < head_end + length {
                let n = socket.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            record.lock().unwrap().push(head);
            let _ = socket.write_all(response.as_bytes()).await;
            let _ = socket.shutdown().await;
        }
    });
    (addr, seen)
}

/// A redirect is not followed: the token never reaches the host it names, and the 307 is a
/// clear, final error.
#[tokio::test]
async fn a_redirect_is_an_error_and_the_token_goes_nowhere_else() {
    let (elsewhere, seen_elsewhere) = recording_server(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
            .to_owned(),
    )
    .await;
    let (redirecting, seen_redirecting) = recording_server(format!(
        "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://{elsewhere}/mcp\r\ncontent-length: 0\r\n\r\n"
    ))
    .await;
    let client = McpClient::new(
        &format!("http://{redirecting}/mcp"),
        Some(Secret::new("tok-redirect-secret")),
        McpTimeouts::default(),
    )
    .unwrap();
    let err = client.tools().await.unwrap_err();
    assert!(
        matches!(err, McpError::Status { status: 307, .. }),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    let text = err.to_string();
    assert!(text.contains("307") && text.contains("redirect"), "{text}");
    assert!(!text.contains("tok-redirect-secret"), "{text}");
    assert_eq!(seen_redirecting.lock().unwrap().len(), 1);
    assert!(
        seen_redirecting.lock().unwrap()[0].contains("authorization: bearer"),
        "the token went to the configured server"
    );
    assert_eq!(
        *seen_elsewhere.lock().unwrap(),
        Vec::<String>::new(),
        "nothing was sent where the redirect pointed"
    );
}
