//! The gateway end to end on the real broker: HTTP client -> gateway -> Pulsar ->
//! text-completion processor -> fake OpenAI server, and back. NDJSON checked at the byte
//! level, SSE read by an SSE parser, TrustGraph's WebSocket with concurrent requests and bad
//! frames, auth, limits, and a disconnect that must close the provider's connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use sluice_gateway::{Auth, ServiceKind, ServiceTopics};
use sluice_runtime::{
    processor::ProcessorConfig,
    seal::{Label, SealKey},
    secret::Secret,
    telemetry::Telemetry,
};
use sluice_tests::{
    Broker, GatewayStack as Stack, PATIENCE, RunningProcessor, keys::KeysFile, sse_event_id,
    stream_pieces, unique_topic, wait_for_metrics,
};
use tokio_tungstenite::tungstenite::Message as WsMessage;

const TOKEN: &str = "gw-test-token-8f1c";

/// The secret the gateway replicas of a test share (SLUICE_GATEWAY_SECRET).
const SECRET: &str = "test-gateway-secret-0123456789abcdef";

fn shared_secret() -> SealKey {
    SealKey::new(&Secret::new(SECRET), "SLUICE_GATEWAY_SECRET").unwrap()
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A resume token as the gateway writes one (docs/gateway.md#resuming-a-stream), sealed with
/// `secret` for `caller` (`anyone`, `token` or `key:<name>`): written here independently of
/// the gateway's code, so that its format is pinned.
fn sealed_token(
    secret: &SealKey,
    route: &str,
    after: &str,
    created: u64,
    id: &str,
    caller: &str,
) -> String {
    let created = created.to_string();
    let seal = secret
        .seal(
            Label::new("sluice/gateway/resume-token/v2"),
            &[
                route.as_bytes(),
                after.as_bytes(),
                created.as_bytes(),
                b"",
                id.as_bytes(),
                caller.as_bytes(),
            ],
        )
        .encode(16);
    format!("v2.{route}.{after}.{created}.-.{seal}.{id}")
}

fn http() -> reqwest::Client {
    sluice_runtime::install_crypto_provider();
    reqwest::Client::new()
}

fn request() -> Value {
    json!({"system": "be brief", "prompt": "say hello"})
}

/// Reads an NDJSON body to its end, checking the bytes: every line one JSON object ending in
/// a single `\n`, no blank lines, no partial objects.
fn ndjson_lines(body: &[u8]) -> Vec<Value> {
    assert!(body.ends_with(b"\n"), "the body ends with a newline");
    let text = std::str::from_utf8(body).expect("UTF-8");
    assert!(!text.contains("\r"), "LF only");
    text.split_terminator('\n')
        .map(|line| {
            assert!(!line.is_empty(), "no blank lines");
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
            assert!(v.is_object());
            v
        })
        .collect()
}

#[tokio::test]
async fn ndjson_streams_seed_004_events_and_the_first_token_arrives_before_the_last_is_sent() {
    let s = Stack::start("gated", |_| {}).await;
    let resp = http()
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .header("x-session-id", "session-7")
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    assert_eq!(resp.headers()["x-accel-buffering"], "no");
    assert!(
        resp.headers()["cache-control"]
            .to_str()
            .unwrap()
            .contains("no-cache")
    );
    let mut body = resp.bytes_stream();
    let mut bytes = Vec::new();
    // Read until the first token event: the fake is holding its last tokens behind a gate
    // only this test opens, so seeing it proves the token was not buffered behind them.
    while !String::from_utf8_lossy(&bytes).contains(r#""type":"token""#) {
        let chunk = tokio::time::timeout(PATIENCE, body.next())
            .await
            .expect("the first token arrives while the provider is still streaming")
            .unwrap()
            .unwrap();
        bytes.extend_from_slice(&chunk);
    }
    s.fake.open_gate();
    while let Some(chunk) = body.next().await {
        bytes.extend_from_slice(&chunk.unwrap());
    }
    let events = ndjson_lines(&bytes);
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["status", "token", "token", "done"], "{events:#?}");
    assert_eq!(events[0]["status"], "thinking");
    assert_eq!(events[0]["content"], Value::Null);
    assert_eq!(events[1]["content"], "Hel");
    assert_eq!(events[2]["content"], " lo");
    let done = &events[3];
    assert_eq!(done["reason"], "success");
    assert_eq!(done["content"], Value::Null);
    assert_eq!(done["usage"], json!({"in_token": 5, "out_token": 2}));
    assert_eq!(done["model"], "gated");
    for e in &events {
        assert_eq!(
            e["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736",
            "the caller's trace goes on"
        );
        assert_eq!(e["session_id"], "session-7");
    }
    // The stream is counted when hyper drops its body, just after the last byte went out.
    let success = r#"sluice_gateway_streams_total{outcome="success",route="text-completion"} 1"#;
    let metrics = wait_for_metrics(|| s.telemetry.render(), |m| m.contains(success)).await;
    assert!(metrics.contains(success), "{metrics}");
    assert!(
        metrics.contains(r#"sluice_gateway_first_event_seconds_count{route="text-completion"} 1"#)
    );
    assert!(metrics.contains(r#"sluice_gateway_open_streams{route="text-completion"} 0"#));
    s.stop().await;
}

#[tokio::test]
async fn sse_carries_the_same_events() {
    use eventsource_stream::Eventsource;
    let s = Stack::start("normal", |_| {}).await;
    let resp = http()
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "text/event-stream")
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut events = resp.bytes_stream().eventsource();
    let mut seen = Vec::new();
    while let Some(e) = events.next().await {
        let e = e.unwrap();
        let data: Value = serde_json::from_str(&e.data).unwrap();
        assert_eq!(
            data["type"],
            e.event.as_str(),
            "the SSE event name is the type"
        );
        let done = e.event == "done";
        seen.push(data);
        if done {
            break;
        }
    }
    let text: String = seen
        .iter()
        .filter(|e| e["type"] == "token")
        .map(|e| e["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello world!");
    assert_eq!(
        seen.last().unwrap()["usage"],
        json!({"in_token": 11, "out_token": 3})
    );
    s.stop().await;
}

#[tokio::test]
async fn json_answers_whole_and_errors_map_to_statuses() {
    let s = Stack::start("normal", |_| {}).await;
    let c = http();
    let mut body = request();
    body["streaming"] = json!(false);
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let r: Value = resp.json().await.unwrap();
    assert_eq!(r["response"], "Hello world!");
    assert_eq!(r["end_of_stream"], true);
    assert_eq!(r["in_token"], 11);

    // TrustGraph's REST form; TrustGraph 2.x's client names its workspace in the body.
    let mut scoped = request();
    scoped["workspace"] = json!("default");
    let resp = c
        .post(s.url("/api/v1/flow/default/service/text-completion"))
        .json(&scoped)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["response"],
        "Hello world!"
    );
    let resp = c
        .post(s.url("/api/v1/flow/other/service/text-completion"))
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    scoped["workspace"] = json!("other");
    let resp = c
        .post(s.url("/api/v1/flow/default/service/text-completion"))
        .json(&scoped)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let refused: Value = resp.json().await.unwrap();
    assert!(
        refused.to_string().contains("unknown workspace"),
        "{refused}"
    );

    // Bad input: a clear JSON error, nothing echoed back.
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .header("content-type", "application/json")
        .body(r#"{"prompt": 42, "secret-looking": "do-not-echo"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let e: Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid-request");
    assert!(!e.to_string().contains("do-not-echo"));
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .header("content-type", "application/json")
        .body(r#"{"prompt": "hi", "streaming": "sk-do-not-echo"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let e: Value = resp.json().await.unwrap();
    assert_eq!(
        e["error"]["message"],
        "invalid request: field `streaming`: expected a boolean"
    );
    let resp = c
        .post(s.url("/api/v1/nonsense"))
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let resp = c
        .post(s.url("/api/v1/prompt"))
        .json(&json!({"id": "t"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404, "the prompt service is not enabled here");
    assert_eq!(
        resp.json::<Value>().await.unwrap()["error"]["type"],
        "no-configuration"
    );
    let huge = json!({"system": "", "prompt": "x".repeat(2 * 1024 * 1024)});
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .json(&huge)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["error"]["type"],
        "message-too-large"
    );
    s.stop().await;

    // A provider failure: the error record's type picks the status.
    let s = Stack::start("unauthorized", |_| {}).await;
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    let e: Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["type"], "llm-error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("OPENAI_API_KEY"),
        "{e}"
    );
    // And streamed: an error event, then done with reason error.
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .json(&request())
        .send()
        .await
        .unwrap();
    let events = ndjson_lines(&resp.bytes().await.unwrap());
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["status", "error", "done"]);
    assert_eq!(events[1]["error_type"], "llm-error");
    assert_eq!(events[2]["reason"], "error");
    s.stop().await;
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_the_provider_call() {
    let s = Stack::start("stall", |_| {}).await;
    let resp = http()
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .json(&request())
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut bytes = Vec::new();
    while !String::from_utf8_lossy(&bytes).contains("Hel") {
        bytes.extend_from_slice(&body.next().await.unwrap().unwrap());
    }
    assert_eq!(s.fake.abandoned_streams(), 0);
    drop(body);
    // The gateway publishes a cancel; the processor drops the provider call, which closes
    // the connection to the fake provider.
    s.fake
        .assert_abandoned(
            PATIENCE,
            "the provider's connection was not closed after the client went away",
        )
        .await;
    let cancelled =
        r#"sluice_processor_requests_total{outcome="cancelled",processor="text-completion"} 1"#;
    let m = sluice_tests::eventually(
        PATIENCE,
        async || s.processor.telemetry.render(),
        |m| m.contains(cancelled),
    )
    .await;
    assert!(m.contains(cancelled), "{m}");
    assert!(s.telemetry.render().contains(
        r#"sluice_gateway_streams_total{outcome="cancelled",route="text-completion"} 1"#
    ));
    s.stop().await;
}

/// TrustGraph's WebSocket: a client whose socket closes mid-stream (a browser tab closed, a
/// `tg-invoke-llm` interrupted) cancels its requests too, down to the provider's connection.
#[tokio::test]
async fn a_socket_that_closes_mid_stream_cancels_the_provider_call() {
    let s = Stack::start("stall", |_| {}).await;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/api/v1/socket", s.addr))
        .await
        .unwrap();
    let frame = json!({"id": "gone-1", "service": "text-completion", "flow": "default",
                       "request": {"system": "", "prompt": "hi", "streaming": true}});
    ws.send(WsMessage::text(frame.to_string())).await.unwrap();
    let mut text = String::new();
    while !text.contains("Hel") {
        let f = next_json(&mut ws).await;
        assert_eq!(f["id"], "gone-1", "{f}");
        assert!(f.get("error").is_none_or(Value::is_null), "{f}");
        text.push_str(f["response"]["response"].as_str().unwrap_or(""));
    }
    assert_eq!(s.fake.abandoned_streams(), 0);
    // Mid-stream: the provider is holding the rest back. The client goes away.
    ws.close(None).await.unwrap();
    drop(ws);
    s.fake
        .assert_abandoned(
            PATIENCE,
            "the provider's connection was not closed after the socket closed",
        )
        .await;
    let m = sluice_tests::eventually(
        PATIENCE,
        async || s.processor.telemetry.render(),
        |m| {
            m.contains(
                r#"sluice_processor_requests_total{outcome="cancelled",processor="text-completion"} 1"#,
            )
        },
    )
    .await;
    assert!(
        m.contains(
            r#"sluice_processor_requests_total{outcome="cancelled",processor="text-completion"} 1"#
        ),
        "{m}"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_request_past_its_time_limit_ends_with_a_timeout_and_is_cancelled() {
    let s = Stack::start("stall", |c| c.request_timeout = Duration::from_secs(1)).await;
    let resp = http()
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .json(&request())
        .send()
        .await
        .unwrap();
    let events = ndjson_lines(&resp.bytes().await.unwrap());
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    // The token arrives unless the machine is slow enough to spend the whole second before it.
    assert!(
        types == ["status", "token", "error", "done"] || types == ["status", "error", "done"],
        "{events:#?}"
    );
    assert_eq!(events[types.len() - 2]["error_type"], "timeout");
    assert_eq!(events[types.len() - 1]["reason"], "error");
    s.fake
        .assert_abandoned(PATIENCE, "the provider call was not cancelled")
        .await;
    s.stop().await;
}

#[tokio::test]
async fn bearer_auth_guards_http_and_the_socket() {
    let s = Stack::start("normal", |c| c.auth = Auth::new(Some(Secret::new(TOKEN)))).await;
    let c = http();
    for auth in [None, Some("Bearer wrong"), Some("Basic gw-test-token-8f1c")] {
        let mut r = c.post(s.url("/api/v1/text-completion")).json(&request());
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let resp = r.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{auth:?}");
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        assert_eq!(
            resp.json::<Value>().await.unwrap()["error"]["type"],
            "unauthorized"
        );
    }
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .bearer_auth(TOKEN)
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/api/v1/socket", s.addr))
        .await
        .unwrap();
    let frame = json!({"id": "req-1", "service": "text-completion", "flow": "default",
                       "request": {"system": "", "prompt": "hi", "streaming": true}});
    ws.send(WsMessage::text(frame.to_string())).await.unwrap();
    let reply = next_json(&mut ws).await;
    assert_eq!(reply["id"], "req-1");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not authenticated")
    );
    ws.send(WsMessage::text(
        json!({"type": "auth", "token": "nope"}).to_string(),
    ))
    .await
    .unwrap();
    assert_eq!(
        next_json(&mut ws).await,
        json!({"type": "auth-failed", "error": "auth failure"})
    );
    ws.send(WsMessage::text(
        json!({"type": "auth", "token": TOKEN}).to_string(),
    ))
    .await
    .unwrap();
    assert_eq!(next_json(&mut ws).await["type"], "auth-ok");
    ws.send(WsMessage::text(frame.to_string())).await.unwrap();
    let mut text = String::new();
    loop {
        let f = next_json(&mut ws).await;
        text.push_str(f["response"]["response"].as_str().unwrap_or(""));
        if f["complete"] == true {
            break;
        }
    }
    assert_eq!(text, "Hello world!");
    s.stop().await;
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn next_json(ws: &mut Ws) -> Value {
    loop {
        let m = tokio::time::timeout(PATIENCE, ws.next())
            .await
            .expect("a frame")
            .unwrap()
            .unwrap();
        if let WsMessage::Text(t) = m {
            return serde_json::from_str(t.as_str()).unwrap();
        }
    }
}

#[tokio::test]
async fn the_socket_multiplexes_concurrent_requests_and_survives_bad_frames() {
    let s = Stack::start("slow", |_| {}).await;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/api/v1/socket", s.addr))
        .await
        .unwrap();
    // Without a configured token, any auth frame is accepted (TrustGraph clients always send one).
    ws.send(WsMessage::text(
        json!({"type": "auth", "token": ""}).to_string(),
    ))
    .await
    .unwrap();
    assert_eq!(next_json(&mut ws).await["type"], "auth-ok");
    let n = 6;
    for i in 0..n {
        let frame = json!({"id": format!("req-{i}"), "service": "text-completion", "flow": "default",
                           "request": {"system": "", "prompt": "hi", "streaming": true}});
        ws.send(WsMessage::text(frame.to_string())).await.unwrap();
    }
    // Bad frames while those stream: each gets an error frame, the socket stays open.
    ws.send(WsMessage::text("not json")).await.unwrap();
    ws.send(WsMessage::text(
        json!({"service": "text-completion"}).to_string(),
    ))
    .await
    .unwrap();
    ws.send(WsMessage::text(
        json!({"id": "bad-svc", "service": "nope", "request": {}}).to_string(),
    ))
    .await
    .unwrap();
    ws.send(WsMessage::text(
        json!({"id": "req-0", "service": "text-completion", "request": {"prompt": "dup"}})
            .to_string(),
    ))
    .await
    .unwrap();
    ws.send(WsMessage::text(
        json!({"id": "bad-rec", "service": "text-completion", "request": {"prompt": 42}})
            .to_string(),
    ))
    .await
    .unwrap();
    ws.send(WsMessage::binary(vec![1u8, 2, 3])).await.unwrap();

    let mut text: BTreeMap<String, String> = BTreeMap::new();
    let mut complete = 0;
    let mut errors = Vec::new();
    let mut interleaved = false;
    let mut last_id = String::new();
    while complete < n || errors.len() < 6 {
        let f = next_json(&mut ws).await;
        if f.get("error").is_some() {
            errors.push(f);
            continue;
        }
        let id = f["id"].as_str().unwrap().to_owned();
        if !last_id.is_empty() && id != last_id && text.get(&id).is_some_and(|t| !t.is_empty()) {
            interleaved = true;
        }
        last_id.clone_from(&id);
        assert!(
            f["response"].get("error").is_none(),
            "no error field on success: {f}"
        );
        text.entry(id)
            .or_default()
            .push_str(f["response"]["response"].as_str().unwrap_or(""));
        if f["complete"] == true {
            assert_eq!(f["response"]["end_of_stream"], true);
            complete += 1;
        }
    }
    assert_eq!(text.len(), n);
    assert!(text.values().all(|t| t == "Hello world!"), "{text:?}");
    assert!(interleaved, "the requests streamed concurrently");
    let ids: Vec<Option<&str>> = errors.iter().map(|e| e["id"].as_str()).collect();
    assert_eq!(ids.iter().filter(|i| i.is_none()).count(), 3, "{errors:#?}");
    for id in ["bad-svc", "req-0", "bad-rec"] {
        assert!(ids.contains(&Some(id)), "{id}: {errors:#?}");
    }
    let bad = errors.iter().find(|e| e["id"] == "bad-rec").unwrap();
    assert_eq!(
        bad["error"]["message"],
        "invalid request: field `prompt`: expected a string"
    );
    assert!(
        errors
            .iter()
            .all(|e| e["complete"] == true && e["error"]["type"].is_string())
    );
    s.stop().await;
}

/// The agent route: HTTP -> gateway -> agent processor -> text-completion processor -> the
/// scripted ReAct model, with an MCP tool. Tokens carry their `message_type`, the status
/// follows the phases, and `done` carries the dialog's usage over both model calls.
#[tokio::test]
async fn the_agent_route_streams_typed_tokens_and_the_dialogs_usage() {
    use sluice_agent::{
        handler::{AgentLimits, AgentService, DEFAULT_REACT_TEMPLATE},
        mcp::{McpClient, McpTimeouts},
        metrics::AgentMetrics,
        tools::{self, Backend, Tool},
    };
    use sluice_runtime::client::{ClientConfig, RequestClient};

    let agent_topics = ServiceTopics {
        request: unique_topic("gw-agent-req"),
        response: unique_topic("gw-agent-resp"),
        cancel: Some(unique_topic("gw-agent-cancel")),
    };
    let mut llm_topics = None;
    let s = Stack::start("react-tool", |gc| {
        llm_topics = gc.services.get(&ServiceKind::TextCompletion).cloned();
        gc.services.insert(ServiceKind::Agent, agent_topics.clone());
    })
    .await;
    let llm_topics = llm_topics.unwrap();
    let broker = Broker::from_env().await;
    let llm = Arc::new(
        RequestClient::start(
            broker.bus().await,
            ClientConfig::new("text-completion", &llm_topics.request, &llm_topics.response),
            None,
        )
        .await
        .unwrap(),
    );
    let mcp = sluice_tests::mcp_server::start(None).await;
    let tools: Vec<Arc<Tool>> = tools::parse(&format!(
        r#"{{"tools": [{{"name": "add", "description": "Adds two numbers", "type": "mcp", "url": "{}"}}]}}"#,
        mcp.url()
    ))
    .unwrap()
    .into_iter()
    .map(|config| {
        let client = McpClient::new(&mcp.url(), None, McpTimeouts::default()).unwrap();
        Arc::new(Tool {
            config,
            backend: Backend::Mcp(client),
        })
    })
    .collect();
    let bus = broker.bus().await;
    let telemetry = Telemetry::new().unwrap();
    let handler = AgentService::new(
        llm,
        tools,
        bus.publisher(&agent_topics.request).await.unwrap(),
        DEFAULT_REACT_TEMPLATE,
        AgentLimits::default(),
        AgentMetrics::register(&telemetry.registry).unwrap(),
    )
    .unwrap();
    let mut config = ProcessorConfig::new("agent", &agent_topics.request, &agent_topics.response);
    sluice_tests::record_per_delta(&mut config);
    config.cancel_topic.clone_from(&agent_topics.cancel);
    config.drain_grace = Duration::from_secs(5);
    let agent = RunningProcessor::start_with(bus, config, handler, telemetry).await;

    // Asked for the steps (`?steps=true`, as `sluice invoke agent` asks): every record is a
    // token with its type.
    let resp = http()
        .post(s.url("/api/v1/agent?steps=true"))
        .header("accept", "application/x-ndjson")
        .json(&json!({"question": "What is 2 + 3?", "session_id": "dialog-9"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let events = ndjson_lines(&resp.bytes().await.unwrap());

    // The phases as the client sees them: statuses, and each token's type and end flag.
    let mut phases: Vec<String> = Vec::new();
    for e in &events {
        let p = match e["type"].as_str().unwrap() {
            "status" => format!("status:{}", e["status"].as_str().unwrap()),
            "token" => {
                let mut t = format!("token:{}", e["message_type"].as_str().unwrap());
                if e["end_of_message"] == true {
                    t.push('.');
                }
                t
            }
            other => other.to_owned(),
        };
        if phases.last() != Some(&p) {
            phases.push(p);
        }
    }
    assert_eq!(
        phases,
        [
            "status:thinking",
            "token:thought",
            "token:thought.",
            "status:using_tool",
            "token:action.",
            "token:observation.",
            "status:thinking",
            "token:thought",
            "token:thought.",
            "status:writing",
            "token:answer",
            "token:answer.",
            "done"
        ],
        "{events:#?}"
    );
    let tokens = |t: &str| -> String {
        events
            .iter()
            .filter(|e| e["type"] == "token" && e["message_type"] == t)
            .map(|e| e["content"].as_str().unwrap())
            .collect()
    };
    assert_eq!(tokens("observation"), "5", "the MCP tool's answer");
    assert_eq!(tokens("answer"), "The sum is 5.");
    // TrustGraph's streaming spec's action: the tool's name; its arguments beside it.
    assert_eq!(tokens("action"), "add");
    let action = events
        .iter()
        .find(|e| e["message_type"] == "action")
        .unwrap();
    assert_eq!(action["arguments"], json!({"a": "2", "b": "3"}), "{action}");
    let done = events.last().unwrap();
    assert_eq!(done["reason"], "success");
    // Two model calls of 9 input tokens; one output token per word of the two answers.
    assert_eq!(done["usage"], json!({"in_token": 18, "out_token": 27}));
    assert_eq!(done["model"], "react-tool");
    for e in &events {
        assert_eq!(e["session_id"], "dialog-9", "the agent's session id");
    }
    assert_eq!(mcp.calls(), 1);

    // The event protocol's (docs/specs.md#the-event-protocol) client, which shows every token as
    // the answer: the same dialog's steps are status events only, and the tokens are the answer's.
    let resp = http()
        .post(s.url("/api/v1/agent"))
        .header("accept", "application/x-ndjson")
        .json(&json!({"question": "What is 2 + 3?", "session_id": "dialog-10"}))
        .send()
        .await
        .unwrap();
    let events = ndjson_lines(&resp.bytes().await.unwrap());
    let shown: Vec<String> = events
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "status" => format!("status:{}", e["status"].as_str().unwrap()),
            "token" => format!("token:{}", e["message_type"].as_str().unwrap()),
            other => other.to_owned(),
        })
        .fold(Vec::new(), |mut v, p| {
            if v.last() != Some(&p) {
                v.push(p);
            }
            v
        });
    assert_eq!(
        shown,
        [
            "status:thinking",
            "status:using_tool",
            "status:thinking",
            "status:writing",
            "token:answer",
            "done"
        ],
        "{events:#?}"
    );
    let answer: String = events
        .iter()
        .filter(|e| e["type"] == "token")
        .map(|e| e["content"].as_str().unwrap())
        .collect();
    assert_eq!(answer, "The sum is 5.", "the answer only");
    assert_eq!(
        events.last().unwrap()["usage"],
        json!({"in_token": 18, "out_token": 27})
    );
    assert_eq!(mcp.calls(), 2);
    assert!(
        agent
            .telemetry
            .render()
            .contains(r#"sluice_agent_dialogs_total{outcome="answer"} 2"#)
    );
    let success = r#"sluice_gateway_streams_total{outcome="success",route="agent"} 2"#;
    let m = wait_for_metrics(|| s.telemetry.render(), |m| m.contains(success)).await;
    assert!(m.contains(success), "{m}");
    agent.stop().await;
    s.stop().await;
}

/// TrustGraph 2.11's `list-models`: the text-completion processor answers with the model it
/// serves, on the WebSocket (as `tg-list-models` asks), over TrustGraph's REST route and on
/// `GET /api/v1/models`. When `TG_LIST_MODELS` names trustgraph-cli's `tg-list-models`
/// (scripts/tg-cli-venv.sh makes one), the real client is run against the gateway too.
#[tokio::test]
async fn list_models_answers_on_the_socket_rest_and_get() {
    let s = Stack::start("smollm2-test", |_| {}).await;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/api/v1/socket", s.addr))
        .await
        .unwrap();
    let frame = json!({"id": "req-1", "service": "text-completion", "flow": "default",
                       "workspace": "default", "request": {"operation": "list-models"}});
    ws.send(WsMessage::text(frame.to_string())).await.unwrap();
    let f = next_json(&mut ws).await;
    assert_eq!(f["id"], "req-1", "{f}");
    assert_eq!(f["complete"], true, "{f}");
    assert_eq!(
        f["response"]["models"],
        json!([{"id": "smollm2-test"}]),
        "{f}"
    );

    let c = http();
    let r: Value = c
        .post(s.url("/api/v1/flow/default/service/text-completion"))
        .json(&json!({"operation": "list-models"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["models"], json!([{"id": "smollm2-test"}]), "{r}");
    let resp = c.get(s.url("/api/v1/models")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let r: Value = resp.json().await.unwrap();
    assert_eq!(r["models"][0]["id"], "smollm2-test", "{r}");
    // An operation sluice does not know is refused by name.
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .json(&json!({"operation": "embed"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(s.fake.calls("smollm2-test"), 0, "no provider call");

    if let Some(tg) = sluice_tests::outside_tool(
        "TG_LIST_MODELS",
        "gateway: TrustGraph's tg-list-models against the gateway (scripts/tg-cli-venv.sh)",
    ) {
        let url = format!("http://{}/", s.addr);
        let out = tokio::process::Command::new(&tg)
            .args(["-u", &url])
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        assert_eq!(stdout.trim(), "smollm2-test", "{stdout}");
        let out = tokio::process::Command::new(&tg)
            .args(["-u", &url, "--json"])
            .output()
            .await
            .unwrap();
        let models: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(models, json!([{"id": "smollm2-test"}]));
    }
    s.stop().await;
}

/// Reads an SSE body to its end: each event's name and data.
async fn sse_events(resp: reqwest::Response) -> Vec<(String, String)> {
    use eventsource_stream::Eventsource;
    let mut events = resp.bytes_stream().eventsource();
    let mut out = Vec::new();
    while let Some(e) = events.next().await {
        let e = e.unwrap();
        out.push((e.event, e.data));
    }
    out
}

/// TrustGraph's streaming spec's (docs/specs.md#trustgraphs-streaming-spec) REST streaming: the
/// body's `streaming: true`, with no `Accept` that names a stream or with `Accept:
/// text/event-stream` (what an SSE client library sends by default), gets SSE whose events' data are
/// the response records themselves, the last with `end_of_stream` and the usage; a failure is the
/// error record ending the stream. On TrustGraph's REST form, which never streams unasked, the SSE
/// `Accept` asks for the same records. `Accept: application/x-ndjson` still picks the events, and
/// TrustGraph's REST form without an `Accept` still answers whole.
#[tokio::test]
async fn the_bodys_streaming_flag_streams_the_records_as_sse() {
    let s = Stack::start("normal", |_| {}).await;
    let c = http();
    let mut body = request();
    body["streaming"] = json!(true);
    for (path, accept) in [
        ("/api/v1/text-completion", None),
        ("/api/v1/text-completion", Some("text/event-stream")),
        (
            "/api/v1/flow/default/service/text-completion",
            Some("text/event-stream"),
        ),
    ] {
        let mut post = c.post(s.url(path));
        if let Some(accept) = accept {
            post = post.header("accept", accept);
        }
        let resp = post.json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        assert!(
            resp.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        let events = sse_events(resp).await;
        let records: Vec<Value> = events
            .iter()
            .map(|(name, data)| {
                assert_eq!(
                    name, "message",
                    "{path} {accept:?}: unnamed events: {events:?}"
                );
                serde_json::from_str(data).unwrap()
            })
            .collect();
        let text: String = records
            .iter()
            .map(|r| r["response"].as_str().unwrap())
            .collect();
        assert_eq!(text, "Hello world!", "{records:#?}");
        assert!(records.len() > 1, "streamed in pieces: {records:#?}");
        let last = records.last().unwrap();
        assert_eq!(last["end_of_stream"], true);
        assert!(
            records[..records.len() - 1]
                .iter()
                .all(|r| r["end_of_stream"] == false)
        );
        let tokens: (u64, u64) = records.iter().fold((0, 0), |(i, o), r| {
            (
                i + r["in_token"].as_u64().unwrap_or(0),
                o + r["out_token"].as_u64().unwrap_or(0),
            )
        });
        assert_eq!(tokens, (11, 3));
        assert_eq!(last["model"], "normal");
    }
    let resp = c
        .post(s.url("/api/v1/flow/default/service/text-completion"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let whole: Value = resp.json().await.unwrap();
    assert_eq!(whole["response"], "Hello world!");
    assert_eq!(whole["end_of_stream"], true);
    // An Accept header still decides: the events.
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .json(&body)
        .send()
        .await
        .unwrap();
    let events = ndjson_lines(&resp.bytes().await.unwrap());
    assert_eq!(events.last().unwrap()["type"], "done");
    s.stop().await;

    let s = Stack::start("unauthorized", |_| {}).await;
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "the stream had started");
    let events = sse_events(resp).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let record: Value = serde_json::from_str(&events[0].1).unwrap();
    assert_eq!(record["error"]["type"], "llm-error");
    assert_eq!(record["end_of_stream"], true);
    s.stop().await;
}

/// The event protocol's own test, exactly as written: `curl .../v1/chat/completions -H
/// 'Content-Type: application/json' -d '{"prompt":"Hello","stream":true}'`, no `Accept` header,
/// answers with NDJSON `status`/`token`/`done` events. An OpenAI conversation sent with `Accept:
/// application/x-ndjson` gets the events too, and OpenAI's dialect on the same path is untouched.
#[tokio::test]
async fn seed_004s_curl_on_the_chat_path_gets_ndjson_events() {
    let s = Stack::start("normal", |_| {}).await;
    let c = http();
    let resp = c
        .post(s.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(r#"{"prompt":"Hello","stream":true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let events = ndjson_lines(&resp.bytes().await.unwrap());
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        ["status", "token", "token", "token", "done"],
        "{events:#?}"
    );
    assert_eq!(events[0]["status"], "thinking");
    let text: String = events[1..4]
        .iter()
        .map(|e| e["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello world!");
    assert_eq!(events[4]["reason"], "success");
    assert_eq!(events[4]["content"], Value::Null);
    for e in &events {
        assert_eq!(e["trace_id"].as_str().unwrap().len(), 32);
    }
    // Not streamed: the whole record.
    let resp = c
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"prompt": "Hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["response"],
        "Hello world!"
    );
    // An OpenAI body asking for NDJSON.
    let resp = c
        .post(s.url("/v1/chat/completions"))
        .header("accept", "application/x-ndjson")
        .json(&json!({"model": "normal", "stream": true,
                      "messages": [{"role": "user", "content": "Hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let events = ndjson_lines(&resp.bytes().await.unwrap());
    assert_eq!(events.first().unwrap()["type"], "status");
    assert_eq!(events.last().unwrap()["reason"], "success");
    // OpenAI's dialect, unchanged.
    let resp = c
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"model": "normal",
                      "messages": [{"role": "user", "content": "Hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world!");
    s.stop().await;
}

/// Errors before the stream (400, 401, 404, 413) reach a caller that asked for NDJSON as
/// NDJSON: an `error` event and a `done` with reason `error`, under the HTTP status the error
/// maps to. A JSON caller still gets the JSON error.
#[tokio::test]
async fn errors_before_the_stream_are_ndjson_events_for_an_ndjson_caller() {
    let s = Stack::start("normal", |c| c.auth = Auth::new(Some(Secret::new(TOKEN)))).await;
    let c = http();
    let refused = |status: u16, error_type: &'static str| {
        move |resp: reqwest::Response| async move {
            assert_eq!(resp.status(), status);
            assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
            let events = ndjson_lines(&resp.bytes().await.unwrap());
            assert_eq!(events.len(), 2, "{events:#?}");
            assert_eq!(events[0]["type"], "error");
            assert_eq!(events[0]["error_type"], error_type);
            assert!(events[0]["content"].as_str().is_some_and(|m| !m.is_empty()));
            assert_eq!(events[1]["type"], "done");
            assert_eq!(events[1]["reason"], "error");
            assert_eq!(events[1]["session_id"], events[0]["session_id"]);
            events
        }
    };
    // 401, on the REST route and on the event protocol's request on the chat path.
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .header("x-session-id", "s-401")
        .json(&request())
        .send()
        .await
        .unwrap();
    let events = refused(401, "unauthorized")(resp).await;
    assert_eq!(events[0]["session_id"], "s-401");
    let resp = c
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"prompt": "Hello", "stream": true}))
        .send()
        .await
        .unwrap();
    refused(401, "unauthorized")(resp).await;
    // 400: a body that is not a request (nothing of it echoed).
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(r#"{"prompt": 42, "x": "do-not-echo"}"#)
        .send()
        .await
        .unwrap();
    let events = refused(400, "invalid-request")(resp).await;
    assert!(!events[0].to_string().contains("do-not-echo"));
    // 404: a service this gateway does not route, and one it does not serve.
    for path in ["/api/v1/nonsense", "/api/v1/prompt"] {
        let resp = c
            .post(s.url(path))
            .header("accept", "application/x-ndjson")
            .bearer_auth(TOKEN)
            .json(&json!({"id": "t"}))
            .send()
            .await
            .unwrap();
        let kind = if path.ends_with("prompt") {
            "no-configuration"
        } else {
            "invalid-request"
        };
        refused(404, kind)(resp).await;
    }
    // 413.
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .bearer_auth(TOKEN)
        .json(&json!({"prompt": "x".repeat(2 * 1024 * 1024)}))
        .send()
        .await
        .unwrap();
    refused(413, "message-too-large")(resp).await;
    // A JSON caller: the JSON error.
    let resp = c
        .post(s.url("/api/v1/text-completion"))
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["error"]["type"],
        "unauthorized"
    );
    s.stop().await;
}

/// A request cancelled by someone else (a cancel on the service's cancel topic, as `sluice`
/// or another client of the same request sends it) while its caller is still reading: the
/// stream ends as the event protocol (seed 004) says a cancelled one does, with a `done`
/// whose reason is `cancelled` and no `error` before it (the seed's parser stops at the
/// first `error` or `done`, so an `error` first would read as a failure), and the
/// provider's connection is closed.
#[tokio::test]
async fn a_cancel_reaches_a_caller_still_connected_as_done_cancelled() {
    use sluice_runtime::bus::{Message, SubscribeOptions};
    use sluice_schema::properties;
    let s = Stack::start("gated", |_| {}).await;
    let broker = sluice_tests::Broker::from_env().await;
    let bus = broker.bus().await;
    let mut requests = bus
        .subscribe(&s.topics.request, "watch", SubscribeOptions::shared(10))
        .await
        .unwrap();
    let resp = http()
        .post(s.url("/api/v1/text-completion"))
        .header("accept", "application/x-ndjson")
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut bytes = Vec::new();
    while !String::from_utf8_lossy(&bytes).contains(r#""type":"token""#) {
        let chunk = tokio::time::timeout(PATIENCE, body.next())
            .await
            .expect("the first token")
            .unwrap()
            .unwrap();
        bytes.extend_from_slice(&chunk);
    }
    let request = tokio::time::timeout(PATIENCE, requests.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let id = request.property(properties::ID).unwrap().to_owned();
    let cancel = s.topics.cancel.clone().unwrap();
    bus.publisher(&cancel)
        .await
        .unwrap()
        .send(Message::new(Vec::new()).with_property(properties::ID, id.as_str()))
        .await
        .unwrap()
        .await
        .unwrap();
    while let Some(chunk) = tokio::time::timeout(PATIENCE, body.next())
        .await
        .expect("the stream ends after the cancel")
    {
        bytes.extend_from_slice(&chunk.unwrap());
    }
    let events = ndjson_lines(&bytes);
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["status", "token", "done"], "{events:#?}");
    assert_eq!(events[2]["reason"], "cancelled");
    assert_eq!(events[2]["content"], Value::Null);
    s.fake
        .assert_abandoned(
            PATIENCE,
            "the provider's connection was not closed after the cancel",
        )
        .await;
    let cancelled =
        r#"sluice_gateway_streams_total{outcome="cancelled",route="text-completion"} 1"#;
    let metrics = wait_for_metrics(|| s.telemetry.render(), |m| m.contains(cancelled)).await;
    assert!(metrics.contains(cancelled), "{metrics}");
    s.stop().await;
}

/// Reads `resp` until `n` whole pieces have arrived (the connection stays open).
async fn first_pieces(
    resp: &mut reqwest::Response,
    buf: &mut Vec<u8>,
    n: usize,
    sse: bool,
) -> Vec<String> {
    loop {
        let text = std::str::from_utf8(buf).unwrap();
        // Only complete pieces: up to the last separator.
        let sep = if sse { "\n\n" } else { "\n" };
        if let Some(end) = text.rfind(sep) {
            let got = stream_pieces(&buf[..end + sep.len()], sse);
            if got.len() >= n {
                return got[..n].to_vec();
            }
        }
        let chunk = tokio::time::timeout(PATIENCE, resp.chunk())
            .await
            .expect("the stream went silent")
            .unwrap()
            .expect("the stream ended early");
        buf.extend_from_slice(&chunk);
    }
}

/// A stream read partly through one gateway replica is resumed through another: the rest, byte for
/// byte what the first replica goes on to send, nothing repeated; and a resume from nothing, after
/// the end, gives the whole stream again. For the OpenAI route's SSE (resumed by `Last-Event-ID`,
/// as a browser does), the event protocol's events as SSE and as NDJSON (resumed by `Sluice-Resume`
/// with the number of lines received), and TrustGraph's streaming spec's records as SSE.
#[tokio::test]
async fn a_stream_resumes_through_another_replica_with_nothing_lost_or_repeated() {
    let model = "tokens-24-40";
    // Replicas resume each other's streams with the secret they share.
    let s = Stack::start(model, |c| c.secret = Some(shared_secret())).await;
    let broker = Broker::from_env().await;
    let mut config = sluice_gateway::GatewayConfig::new();
    config
        .services
        .insert(ServiceKind::TextCompletion, s.topics.clone());
    config.secret = Some(shared_secret());
    let b = sluice_tests::ServedGateway::start(broker.bus().await, config).await;
    let chat = json!({"model": model, "stream": true,
                      "messages": [{"role": "user", "content": "count"}]});
    let records = json!({"prompt": "count", "streaming": true});
    let cases = [
        ("openai sse", "/v1/chat/completions", None, &chat, true),
        (
            "the event protocol sse",
            "/api/v1/text-completion",
            Some("text/event-stream"),
            &request(),
            true,
        ),
        (
            "the event protocol ndjson",
            "/api/v1/text-completion",
            Some("application/x-ndjson"),
            &request(),
            false,
        ),
        (
            "TrustGraph's streaming spec records",
            "/api/v1/text-completion",
            None,
            &records,
            true,
        ),
    ];
    for (case, path, accept, body, sse) in cases {
        let post = |url: String| {
            let mut r = http().post(url).json(body);
            if let Some(a) = accept {
                r = r.header("accept", a);
            }
            r
        };
        let mut a = post(s.url(path)).send().await.unwrap();
        assert_eq!(a.status(), 200, "{case}");
        let token = a.headers()["sluice-resume-token"]
            .to_str()
            .unwrap()
            .to_owned();
        let mut buf = Vec::new();
        let had = first_pieces(&mut a, &mut buf, 3, sse).await;
        // Resumed through the other replica while the first one still streams.
        let resume = post(format!("http://{}{path}", b.addr));
        let resume = if sse {
            let last = sse_event_id(&had[2]);
            assert_eq!(last, format!("{token}.3"), "{case}: the third event's id");
            resume.header("last-event-id", last)
        } else {
            resume.header("sluice-resume", format!("{token}.3"))
        };
        let rest = resume.send().await.unwrap();
        assert_eq!(rest.status(), 200, "{case}");
        let rest = stream_pieces(&rest.bytes().await.unwrap(), sse);
        buf.extend_from_slice(&a.bytes().await.unwrap());
        let whole = stream_pieces(&buf, sse);
        assert!(whole.len() > 10, "{case}: {whole:?}");
        assert_eq!(
            [&had[..], &rest[..]].concat(),
            whole,
            "{case}: what the caller had and the rest are the stream, byte for byte"
        );
        // After the end, from nothing: the whole stream again.
        let again = post(format!("http://{}{path}", b.addr))
            .header("sluice-resume", format!("{token}.0"))
            .send()
            .await
            .unwrap();
        let again = stream_pieces(&again.bytes().await.unwrap(), sse);
        assert_eq!(again, whole, "{case}: the whole stream again");
    }
    // One provider call per request: resuming never asks the provider again.
    assert_eq!(s.fake.calls(model), cases.len());
    let m = b.telemetry.render();
    assert!(
        m.contains(r#"sluice_gateway_resumes_total{outcome="resumed",route="openai-chat"} 2"#),
        "{m}"
    );
    b.stop.cancel();
    b.gateway.close().await;
    s.stop().await;
}

/// A resume that cannot be served says why, and no provider is called: a token that is not
/// one, a token of another route, a stream older than the resume window.
#[tokio::test]
async fn a_resume_that_cannot_be_served_is_refused_saying_why() {
    let s = Stack::start("normal", |c| {
        c.resume_window = Duration::from_secs(60);
        c.secret = Some(shared_secret());
    })
    .await;
    let ask = |header: &'static str, value: String, path: &'static str| {
        let body = if path.starts_with("/v1") {
            json!({"model": "normal", "stream": true,
                   "messages": [{"role": "user", "content": "x"}]})
        } else {
            request()
        };
        http()
            .post(s.url(path))
            .header("accept", "application/x-ndjson")
            .header(header, value)
            .json(&body)
            .send()
    };
    let now = now_secs();
    let token = |route: &str, created: u64| {
        sealed_token(&shared_secret(), route, "-", created, "abc", "anyone")
    };
    for (header, value, path, status, says) in [
        (
            "last-event-id",
            "chatcmpl-42".to_owned(),
            "/api/v1/text-completion",
            400,
            "not a resume token",
        ),
        (
            "sluice-resume",
            format!("{}.2", token("openai-chat", now)),
            "/api/v1/text-completion",
            400,
            "of the openai-chat route",
        ),
        (
            "sluice-resume",
            format!("{}.2", token("text-completion", now - 3600)),
            "/api/v1/text-completion",
            410,
            "up to 60 s old",
        ),
        (
            "sluice-resume",
            format!("v1.text-completion.-.{now}.-.abc.2"),
            "/api/v1/text-completion",
            400,
            "earlier version",
        ),
    ] {
        let resp = ask(header, value.clone(), path).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{value}");
        let body = resp.text().await.unwrap();
        assert!(body.contains(says), "{value}: {body}");
    }
    // On the OpenAI route, OpenAI's error shape.
    let resp = http()
        .post(s.url("/v1/chat/completions"))
        .header(
            "last-event-id",
            format!("{}.2", token("text-completion", now)),
        )
        .json(&json!({"model": "normal", "stream": true,
                      "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("text-completion route"),
        "{body}"
    );
    assert_eq!(s.fake.calls("normal"), 0);
    // A gateway with resuming off: no ids, no token, exactly OpenAI's framing; a resume 409.
    let broker = Broker::from_env().await;
    let mut config = sluice_gateway::GatewayConfig::new();
    config
        .services
        .insert(ServiceKind::TextCompletion, s.topics.clone());
    config.resume_window = Duration::ZERO;
    let off = sluice_tests::ServedGateway::start(broker.bus().await, config).await;
    let chat = json!({"model": "normal", "stream": true,
                      "messages": [{"role": "user", "content": "x"}]});
    let resp = http()
        .post(format!("http://{}/v1/chat/completions", off.addr))
        .json(&chat)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("sluice-resume-token").is_none());
    let body = String::from_utf8(resp.bytes().await.unwrap().to_vec()).unwrap();
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(
        body.split_terminator("\n\n")
            .all(|e| e.starts_with("data: ") || e.starts_with(':')),
        "{body}"
    );
    let resp = http()
        .post(format!("http://{}/v1/chat/completions", off.addr))
        .header("last-event-id", format!("{}.2", token("openai-chat", now)))
        .json(&chat)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 409);
    assert!(
        resp.text()
            .await
            .unwrap()
            .contains("resuming streams is off")
    );
    off.stop.cancel();
    off.gateway.close().await;
    s.stop().await;
}

/// On the in-process bus (`sluice serve`) nothing is kept to be read again: a stream carries
/// no resume token and no event ids, and a resume is refused as such (409 not-resumable)
/// without a provider call.
#[tokio::test]
async fn on_the_in_process_bus_streams_carry_no_resume_token_and_a_resume_is_refused() {
    use sluice_text_completion::providers::openai::{Dialect, OpenAiConfig};
    let bus: Arc<dyn sluice_runtime::bus::Bus> =
        Arc::new(sluice_runtime::bus::memory::MemoryBus::default());
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let topics = ServiceTopics {
        request: "tc-req".into(),
        response: "tc-resp".into(),
        cancel: None,
    };
    let service = sluice_tests::openai_service(OpenAiConfig::new(
        Dialect::OpenAi,
        fake.base_url(),
        "normal",
    ));
    let processor = RunningProcessor::start(
        bus.clone(),
        ProcessorConfig::new("text-completion", &topics.request, &topics.response),
        service,
    )
    .await;
    let mut config = sluice_gateway::GatewayConfig::new();
    config.services.insert(ServiceKind::TextCompletion, topics);
    let gw = sluice_tests::ServedGateway::start(bus, config).await;
    let url = format!("http://{}/api/v1/text-completion", gw.addr);
    let resp = http()
        .post(&url)
        .header("accept", "text/event-stream")
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("sluice-resume-token").is_none());
    let body = resp.bytes().await.unwrap();
    let events = stream_pieces(&body, true);
    assert!(events.len() > 2, "{events:?}");
    assert!(
        events
            .iter()
            .all(|e| !e.lines().any(|l| l.starts_with("id:"))),
        "{events:?}"
    );
    let token = sealed_token(
        &shared_secret(),
        "text-completion",
        "-",
        now_secs(),
        "abc",
        "anyone",
    );
    let resp = http()
        .post(&url)
        .header("accept", "application/x-ndjson")
        .header("sluice-resume", format!("{token}.2"))
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 409);
    let body = resp.text().await.unwrap();
    assert!(
        body.contains("not-resumable") && body.contains("not kept to be read again"),
        "{body}"
    );
    assert_eq!(fake.calls("normal"), 1);
    gw.stop.cancel();
    gw.gateway.close().await;
    processor.stop().await;
}

#[tokio::test]
async fn api_keys_are_limited_on_every_route_in_its_own_error_shape() {
    // The fake answers with 11 input and 3 output tokens, 14 in all. A request reserves 1
    // (reserve_tokens) and about a token for every 4 bytes of its body: 12 with this body. A
    // minute of 2 * 14 + 12 - 1 tokens leaves room for 2 requests settled with what they used,
    // not for a third; counting only the reservations would leave room for it.
    let reserve = 1 + serde_json::to_vec(&request()).unwrap().len().div_ceil(4);
    let tpm = 2 * 14 + reserve - 1;
    assert!(3 * reserve <= tpm, "{reserve}");
    let tokens = format!("tokens_per_minute = {tpm}\nreserve_tokens = 1");
    let keys_file = KeysFile::new(&[
        ("two", "sk-two", "requests_per_minute = 2"),
        ("one", "sk-one", "requests_per_minute = 1"),
        ("tokens", "sk-tokens", &tokens),
        ("agents", "sk-agents", "services = [\"agent\"]"),
    ]);
    let keys = Arc::new(keys_file.load());
    let s = Stack::start("normal", move |c| {
        c.auth = Auth::new(Some(Secret::new(TOKEN))).with_keys(keys.clone());
    })
    .await;
    let c = http();
    let call = |key: &'static str, accept: &'static str| {
        c.post(s.url("/api/v1/text-completion"))
            .bearer_auth(key)
            .header("accept", accept)
            .json(&request())
            .send()
    };
    // REST, whole answers: two, then 429 with Retry-After in the gateway's error shape.
    for _ in 0..2 {
        assert_eq!(
            call("sk-two", "application/json").await.unwrap().status(),
            200
        );
    }
    let resp = call("sk-two", "application/json").await.unwrap();
    assert_eq!(resp.status(), 429);
    let retry: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // Up to the rest of this minute and the next one's fading.
    assert!((1..=120).contains(&retry), "{retry}");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "too-many-requests");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("\"two\" has reached its limit of 2 requests per minute"),
        "{body}"
    );
    // NDJSON: the error event and a done event, with the status.
    let resp = call("sk-two", "application/x-ndjson").await.unwrap();
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let lines = ndjson_lines(&resp.bytes().await.unwrap());
    assert_eq!(lines[0]["error_type"], "too-many-requests", "{lines:?}");
    assert_eq!(lines[1]["type"], "done");
    // The gateway's own token has no limits.
    assert_eq!(
        c.post(s.url("/api/v1/text-completion"))
            .bearer_auth(TOKEN)
            .json(&request())
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // A service the key may not call: 403.
    let resp = call("sk-agents", "application/json").await.unwrap();
    assert_eq!(resp.status(), 403);
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("may not call the text-completion service"),
        "{body}"
    );
    // Tokens are settled with what was used: 14 each, so a reservation fits after one and
    // two, not after three.
    for expect in [200, 200, 429] {
        let resp = call("sk-tokens", "application/json").await.unwrap();
        assert_eq!(resp.status(), expect);
    }
    // The socket: authenticated with a key, its second request is over the limit.
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/api/v1/socket", s.addr))
        .await
        .unwrap();
    ws.send(WsMessage::text(
        json!({"type": "auth", "token": "sk-one"}).to_string(),
    ))
    .await
    .unwrap();
    assert_eq!(next_json(&mut ws).await["type"], "auth-ok");
    for (id, limited) in [("a", false), ("b", true)] {
        let frame = json!({"id": id, "service": "text-completion", "flow": "default",
                           "request": {"system": "", "prompt": "hi", "streaming": false}});
        ws.send(WsMessage::text(frame.to_string())).await.unwrap();
        let reply = next_json(&mut ws).await;
        assert_eq!(reply["id"], id);
        if limited {
            assert_eq!(reply["error"]["type"], "too-many-requests", "{reply}");
            assert!(
                reply["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("retry after"),
                "{reply}"
            );
        } else {
            assert!(reply.get("error").is_none(), "{reply}");
        }
    }
    let page = s.telemetry.render();
    for (key, outcome, n) in [
        ("two", "admitted", 2.0),
        ("two", "rate-limited", 2.0),
        ("agents", "forbidden", 1.0),
        ("tokens", "admitted", 2.0),
        ("one", "rate-limited", 1.0),
    ] {
        assert_eq!(
            sluice_tests::metrics_text::value(
                &page,
                "sluice_gateway_key_requests_total",
                &[("key", key), ("outcome", outcome)]
            ),
            n,
            "{key} {outcome}"
        );
    }
    s.stop().await;
}

/// Issue #53 §3: a resume token is sealed for the caller it was given to. Another API key's
/// resume with it is refused, and so is the token edited (an earlier start time, a position
/// moved back to the topic's start, another request id) or unsealed; the caller's own resume
/// is served, and counts against its key's requests per minute.
#[tokio::test]
async fn a_resume_token_is_its_callers_alone_cannot_be_edited_and_counts_against_its_limits() {
    let keys_file = KeysFile::new(&[("a", "sk-a", "requests_per_minute = 3"), ("b", "sk-b", "")]);
    let keys = Arc::new(keys_file.load());
    let s = Stack::start("normal", move |c| {
        c.auth = Auth::new(None).with_keys(keys);
        c.secret = Some(shared_secret());
    })
    .await;
    let c = http();
    let post = |key: &str| {
        c.post(s.url("/api/v1/text-completion"))
            .bearer_auth(key)
            .header("accept", "application/x-ndjson")
            .json(&request())
    };
    // Two requests of a: the second's token holds a position on the response topic (after
    // the first's records).
    let mut tokens = Vec::new();
    let mut bodies = Vec::new();
    for _ in 0..2 {
        let resp = post("sk-a").send().await.unwrap();
        assert_eq!(resp.status(), 200);
        tokens.push(
            resp.headers()["sluice-resume-token"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
        bodies.push(resp.bytes().await.unwrap());
    }
    let token = tokens[1].clone();
    let parts: Vec<&str> = token.splitn(7, '.').collect();
    assert_eq!(parts[0], "v2", "{token}");
    assert_ne!(
        parts[2], "-",
        "the second request's token holds a position: {token}"
    );
    let refused = |resp: reqwest::Response| async move {
        let status = resp.status();
        let lines = ndjson_lines(&resp.bytes().await.unwrap());
        (
            status,
            lines[0]["error_type"].clone(),
            lines[0]["content"].clone(),
        )
    };
    // Another key's resume.
    let (status, kind, message) = refused(
        post("sk-b")
            .header("sluice-resume", format!("{token}.0"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status.as_u16(), kind.as_str()),
        (403, Some("resume-refused"))
    );
    assert!(
        message
            .as_str()
            .unwrap()
            .contains("not given to this caller"),
        "{message}"
    );
    // The token edited, each part at a time, and unsealed (an older gateway's form).
    let edit = |i: usize, value: &str| {
        let mut p = parts.clone();
        p[i] = value;
        p.join(".")
    };
    let created: u64 = parts[3].parse().unwrap();
    let earlier = (created - 1).to_string();
    let unsealed = format!(
        "v1.{}.{}.{}.{}.{}",
        parts[1], parts[2], parts[3], parts[4], parts[6]
    );
    for (edited, status) in [
        (edit(3, &earlier), 403),
        (edit(2, "-"), 403),
        (edit(6, "another-request"), 403),
        (unsealed, 400),
    ] {
        let resp = post("sk-a")
            .header("sluice-resume", format!("{edited}.0"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), status, "{edited}");
    }
    // The caller's own: the whole stream again, and a request of its key's three a minute.
    let resp = post("sk-a")
        .header("sluice-resume", format!("{token}.0"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        stream_pieces(&resp.bytes().await.unwrap(), false),
        stream_pieces(&bodies[1], false)
    );
    let resp = post("sk-a")
        .header("sluice-resume", format!("{token}.0"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let (_, kind, message) = refused(resp).await;
    assert_eq!(kind, "too-many-requests");
    assert!(
        message.as_str().unwrap().contains("3 requests per minute"),
        "{message}"
    );
    // No resume called the provider.
    assert_eq!(s.fake.calls("normal"), 2);
    let page = s.telemetry.render();
    assert_eq!(
        sluice_tests::metrics_text::value(
            &page,
            "sluice_gateway_resume_refusals_total",
            &[("reason", "seal")]
        ),
        4.0,
        "{page}"
    );
    assert_eq!(
        sluice_tests::metrics_text::value(
            &page,
            "sluice_gateway_key_requests_total",
            &[("key", "a"), ("outcome", "admitted")]
        ),
        3.0
    );
    s.stop().await;
}

/// Issue #53 §3: a resumed stream belongs to a reader, not to the request: its caller going
/// away cancels nothing, and the original caller gets its whole answer.
#[tokio::test]
async fn a_resumed_stream_dropped_does_not_cancel_the_original_request() {
    let s = Stack::start_serving("gated", &["stall"], |_| {}).await;
    let post = || {
        http()
            .post(s.url("/api/v1/text-completion"))
            .header("accept", "application/x-ndjson")
    };
    let gated = json!({"system": "", "prompt": "hello", "model": "gated"});
    let original = post().json(&gated).send().await.unwrap();
    assert_eq!(original.status(), 200);
    let token = original.headers()["sluice-resume-token"]
        .to_str()
        .unwrap()
        .to_owned();
    let mut original = original.bytes_stream();
    let mut had = Vec::new();
    while !String::from_utf8_lossy(&had).contains("Hel") {
        had.extend_from_slice(&original.next().await.unwrap().unwrap());
    }
    // The same stream resumed from its start; its caller goes away once it has `Hel` too.
    let resumed = post()
        .header("sluice-resume", format!("{token}.0"))
        .json(&gated)
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 200);
    let mut resumed = resumed.bytes_stream();
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("Hel") {
        got.extend_from_slice(&resumed.next().await.unwrap().unwrap());
    }
    drop(resumed);
    let cancelled =
        r#"sluice_gateway_streams_total{outcome="cancelled",route="text-completion"} 1"#;
    wait_for_metrics(|| s.telemetry.render(), |m| m.contains(cancelled)).await;
    // Whatever a cancel the resumed stream's end published would reach the processor before
    // this later one: once this one has stopped its request, that one would have too.
    let stalled = post()
        .json(&json!({"system": "", "prompt": "hello", "model": "stall"}))
        .send()
        .await
        .unwrap();
    let mut stalled = stalled.bytes_stream();
    let mut bytes = Vec::new();
    while !String::from_utf8_lossy(&bytes).contains("Hel") {
        bytes.extend_from_slice(&stalled.next().await.unwrap().unwrap());
    }
    drop(stalled);
    let processor_cancelled =
        r#"sluice_processor_requests_total{outcome="cancelled",processor="text-completion"} 1"#;
    wait_for_metrics(
        || s.processor.telemetry.render(),
        |m| m.contains(processor_cancelled),
    )
    .await;
    // The original goes on to its end.
    s.fake.open_gate();
    while let Some(chunk) = original.next().await {
        had.extend_from_slice(&chunk.unwrap());
    }
    let lines = ndjson_lines(&had);
    let text: String = lines
        .iter()
        .filter(|l| l["type"] == "token")
        .filter_map(|l| l["content"].as_str())
        .collect();
    assert_eq!(text, "Hel lo", "{lines:?}");
    assert_eq!(lines.last().unwrap()["reason"], "success", "{lines:?}");
    // Only the stalled request's provider call was cut.
    assert_eq!(s.fake.abandoned_streams(), 1);
    assert!(
        s.processor.telemetry.render().contains(processor_cancelled),
        "one request cancelled, the stalled one"
    );
    s.stop().await;
}

/// The next sealed snapshot on `sub` (the limits topic, read as anyone may) for which `pred`
/// holds.
async fn next_snapshot(
    sub: &mut Box<dyn sluice_runtime::bus::Subscription>,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    loop {
        let d = tokio::time::timeout(Duration::from_secs(10), sub.next())
            .await
            .expect("a snapshot within 10 s")
            .unwrap()
            .unwrap();
        let sealed = d.property("sluice-seal").is_some();
        let read = serde_json::from_slice::<Value>(d.payload());
        // Acked, not dropped: a dropped message is a nack, which on this Exclusive
        // subscription rewinds it and sends everything again.
        d.ack();
        if let Ok(v) = read
            && sealed
            && pred(&v)
        {
            return v;
        }
    }
}

/// Issue #53 §4: what is published on the limits topic is believed only when a replica sealed
/// it. Forged snapshots of every kind, published on the real topic, change nothing: many
/// replicas (the peers map would grow without bound), a replica's usage erased, a key locked
/// out, a sequence number that would make a replica's real snapshots read as old, a key that
/// is not in the keys file (yet). B is asked only once it has read past the forgeries (and
/// past replica A's snapshots that matter): a marker published after them, which it counts,
/// says so. Day quotas, so that no minute slides meanwhile.
#[tokio::test]
async fn forged_limit_snapshots_on_the_topic_change_nothing() {
    use sluice_runtime::bus::{Message, StartPosition, SubscribeOptions};
    use sluice_tests::metrics_text::value;
    // Each request uses 14 tokens (the fake's 11 in and 3 out) and reserves 1 and a token
    // for every 4 bytes of its body: a day of 2 * 14 + reserve - 1 admits two, not a third.
    let reserve = 1 + serde_json::to_vec(&request()).unwrap().len().div_ceil(4);
    let day = format!(
        "tokens_per_day = {}\nreserve_tokens = 1",
        2 * 14 + reserve - 1
    );
    let entries = [("k", "sk-k", day.as_str()), ("j", "sk-j", day.as_str())];
    let keys_file = KeysFile::new(&entries);
    let topic = sluice_tests::unique_topic("gateway-limits");
    // Each replica loads the keys file itself, as each process does: with one `Keys` shared,
    // whichever replica saw the file change first took the new keys for both, and the other
    // never counted the reload it waits for below (a failure seen once in a full run).
    let configure = |c: &mut sluice_gateway::GatewayConfig| {
        c.auth = Auth::new(None).with_keys(Arc::new(keys_file.load()));
        c.secret = Some(shared_secret());
        c.limits_topic = Some(topic.clone());
    };
    let broker = Broker::from_env().await;
    let bus = broker.bus().await;
    // The topic as anyone who may read it sees it, from its start.
    let mut sub = bus
        .subscribe(
            &topic,
            "onlooker",
            SubscribeOptions {
                start: StartPosition::Earliest,
                ..SubscribeOptions::exclusive(1000)
            },
        )
        .await
        .unwrap();
    let a = Stack::start("normal", configure).await;
    let mut config = sluice_gateway::GatewayConfig::new();
    config
        .services
        .insert(ServiceKind::TextCompletion, a.topics.clone());
    configure(&mut config);
    let b = sluice_tests::ServedGateway::start(broker.bus().await, config).await;
    let c = http();
    let call =
        |url: String, key: &'static str| c.post(url).bearer_auth(key).json(&request()).send();
    let on_a = |key| call(a.url("/api/v1/text-completion"), key);
    let on_b = |key| call(format!("http://{}/api/v1/text-completion", b.addr), key);
    let forger = bus.publisher(&topic).await.unwrap();
    let publish = async |payload: &Value, seal: Option<String>| {
        let mut m = Message::new(serde_json::to_vec(payload).unwrap()).with_key(format!(
            "{}/{}",
            payload["key"].as_str().unwrap_or("-"),
            payload["replica"].as_str().unwrap_or("-")
        ));
        if let Some(seal) = seal {
            m = m.with_property("sluice-seal", seal);
        }
        forger.send(m).await.unwrap().await.unwrap();
    };
    let seal_with = |secret: &SealKey, payload: &Value| {
        let bytes = serde_json::to_vec(payload).unwrap();
        secret
            .seal(Label::new("sluice/gateway/limit-snapshot/v1"), &[&bytes])
            .encode(32)
    };
    let stranger =
        SealKey::new(&Secret::new("another-secret-0123456789abcdef-xyz"), "test").unwrap();
    // A marker after everything published so far: sealed bytes that are no snapshot, which
    // B counts as it reads them (as a refused snapshot; before #53, as a share failure).
    let markers = std::cell::Cell::new(0.0);
    let b_read_all = async || {
        let marker = json!({"marker": markers.get()});
        publish(&marker, Some(seal_with(&shared_secret(), &marker))).await;
        markers.set(markers.get() + 1.0);
        wait_for_metrics(
            || b.telemetry.render(),
            |m| {
                value(
                    m,
                    "sluice_gateway_limit_snapshots_refused_total",
                    &[("reason", "malformed")],
                ) + value(m, "sluice_gateway_limit_share_failures_total", &[])
                    >= markers.get()
            },
        )
        .await;
    };
    let minute = now_secs() / 60;
    let snapshot = |replica: &str, key: &str, seq: u64, day: &Value, month: &Value, n: u64| {
        json!({"replica": replica, "key": key, "seq": seq, "sent_ms": 0, "counts": {
            "minute": minute, "requests": n, "tokens": n, "prev_requests": 0,
            "prev_tokens": 0, "day": day, "day_tokens": n, "month": month, "month_tokens": n}})
    };

    // Many replicas, unsealed, before any real one: B counts one peer, A, once it hears of
    // it (the peers gauge is refreshed every second).
    for i in 0..300 {
        let forged = snapshot(&format!("forged-{i}"), "k", 1, &json!(0), &json!(0), 0);
        publish(&forged, None).await;
    }
    // A has 2 of k's day; B reads A's snapshot once both are settled.
    for _ in 0..2 {
        assert_eq!(on_a("sk-k").await.unwrap().status(), 200);
    }
    let real = next_snapshot(&mut sub, |v| {
        v["key"] == "k" && v["counts"]["day_tokens"] == 28 && v["counts"]["in_flight"] == 0
    })
    .await;
    let replica = real["replica"].as_str().unwrap().to_owned();
    let (today, month) = (
        real["counts"]["day"].clone(),
        real["counts"]["month"].clone(),
    );
    b_read_all().await;
    let peers = sluice_tests::eventually(
        Duration::from_secs(10),
        async || value(&b.telemetry.render(), "sluice_gateway_limit_peers", &[]),
        |n| *n > 0.0,
    )
    .await;
    assert_eq!(peers, 1.0, "the forged replicas are not peers");
    assert_eq!(on_b("sk-k").await.unwrap().status(), 429, "B counts A's");

    // Erased: A's usage of k said to be nothing, with a later number; unsealed, sealed with
    // another secret, and with a seal of A's own on other bytes.
    let real_bytes = serde_json::to_vec(&real).unwrap();
    let real_seal = shared_secret()
        .seal(
            Label::new("sluice/gateway/limit-snapshot/v1"),
            &[&real_bytes],
        )
        .encode(32);
    let erase = snapshot(
        &replica,
        "k",
        real["seq"].as_u64().unwrap() + 1_000_000,
        &today,
        &month,
        0,
    );
    publish(&erase, None).await;
    publish(&erase, Some(seal_with(&stranger, &erase))).await;
    publish(&erase, Some(real_seal)).await;
    b_read_all().await;
    assert_eq!(
        on_b("sk-k").await.unwrap().status(),
        429,
        "A's usage still counts"
    );

    // Locked out: j said to have used a billion tokens today.
    let lockout = snapshot("forger", "j", 1, &today, &month, 1_000_000_000);
    publish(&lockout, None).await;
    publish(&lockout, Some(seal_with(&stranger, &lockout))).await;
    b_read_all().await;
    assert_eq!(
        on_b("sk-j").await.unwrap().status(),
        200,
        "j is not locked out"
    );

    // A sequence number at its end, sealed even (by a replica's bug, say): A's real snapshots
    // that follow still count. B has used 14 of j's day, A 14 more: no room for a third.
    let jump = snapshot(&replica, "j", u64::MAX, &today, &month, 0);
    publish(&jump, Some(seal_with(&shared_secret(), &jump))).await;
    assert_eq!(on_a("sk-j").await.unwrap().status(), 200);
    next_snapshot(&mut sub, |v| {
        v["key"] == "j"
            && v["replica"] == replica.as_str()
            && v["counts"]["day_tokens"] == 14
            && v["counts"]["in_flight"] == 0
    })
    .await;
    b_read_all().await;
    assert_eq!(on_b("sk-j").await.unwrap().status(), 429, "A's j counts");

    // A key not in the keys file, sealed: nothing is kept for it, so that it is not locked
    // out once it is added.
    let unknown = snapshot("forger", "later", 1, &today, &month, 1_000_000_000);
    publish(&unknown, Some(seal_with(&shared_secret(), &unknown))).await;
    b_read_all().await;
    let mut more = entries.to_vec();
    more.push(("later", "sk-later", "tokens_per_day = 100000"));
    keys_file.write(&more);
    wait_for_metrics(
        || b.telemetry.render(),
        |m| value(m, "sluice_gateway_keys", &[]) == 3.0,
    )
    .await;
    assert_eq!(
        on_b("sk-later").await.unwrap().status(),
        200,
        "later is new"
    );

    let page = b.telemetry.render();
    for (reason, n) in [
        ("unsealed", 302.0),
        ("seal", 3.0),
        ("seq", 1.0),
        ("unknown-key", 1.0),
        ("malformed", markers.get()),
    ] {
        assert_eq!(
            value(
                &page,
                "sluice_gateway_limit_snapshots_refused_total",
                &[("reason", reason)]
            ),
            n,
            "{reason}"
        );
    }
    assert_eq!(value(&page, "sluice_gateway_limit_peers", &[]), 1.0);
    b.stop.cancel();
    b.gateway.close().await;
    a.stop().await;
}
