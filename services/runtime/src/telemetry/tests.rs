use super::{logging::embed_json_fields, *};

#[test]
fn the_request_logs_json_fields_are_written_as_json_and_other_lines_untouched() {
    let line =
        br#"{"event":"llm_request_started","messages":"[{\"role\":\"system\"}]","request_id":"r"}
"#;
    let out: serde_json::Value = serde_json::from_slice(&embed_json_fields(line)).unwrap();
    assert_eq!(out["messages"][0]["role"], "system");
    assert_eq!(out["request_id"], "r");
    let chunk = br#"{"event":"llm_response_chunk","data":"{\"block_id\":\"b1\"}"}
"#;
    let out: serde_json::Value = serde_json::from_slice(&embed_json_fields(chunk)).unwrap();
    assert_eq!(out["data"]["block_id"], "b1");
    // Not JSON, or not the request log's: as it was.
    for same in [
        &br#"{"event":"llm_response_chunk","data":"plain text"}
"#[..],
        br#"{"event":"other","data":"{\"a\":1}"}
"#,
        b"not json at all\n",
    ] {
        assert_eq!(&*embed_json_fields(same), same);
    }
}
use std::time::Duration;

/// GETs `path` from `addr` over plain HTTP/1.1: the status line and the body.
async fn get(addr: SocketAddr, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).await.unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

/// An API path sent to the metrics port (the event protocol's own test calls port 8000)
/// gets a 404 whose one line says where the API is, not an empty body.
#[tokio::test]
async fn the_metrics_port_points_an_api_path_at_the_gateway() {
    let t = Telemetry::new().unwrap();
    let stop = CancellationToken::new();
    let addr = t
        .serve(SocketAddr::from(([127, 0, 0, 1], 0)), stop.clone())
        .await
        .unwrap();
    for path in ["/v1/chat/completions", "/api/v1/text-completion", "/"] {
        let (status, body) = get(addr, path).await;
        assert!(status.contains(" 404 "), "{path}: {status}");
        assert_eq!(body.lines().count(), 1, "{path}: {body:?}");
        assert!(body.contains("/metrics"), "{body}");
        assert!(body.contains("gateway"), "{body}");
        assert!(body.contains("8088"), "{body}");
    }
    stop.cancel();
}

#[test]
fn readiness_follows_links_and_draining() {
    let h = Health::default();
    assert!(h.readiness().is_ok());
    let link = Link::new(false);
    h.watch("requests", link.clone());
    assert_eq!(
        h.readiness().unwrap_err().to_string(),
        "not connected: requests"
    );
    link.set(true);
    assert!(h.readiness().is_ok());
    h.fail("store", "the broker cannot store records: disk full");
    assert_eq!(
        h.readiness().unwrap_err().to_string(),
        "the broker cannot store records: disk full"
    );
    h.clear("store");
    assert!(h.readiness().is_ok());
    h.set_draining();
    assert_eq!(h.readiness().unwrap_err(), NotReady::Draining);
}

#[tokio::test(start_paused = true)]
async fn until_watched_returns_once_enough_links_are_watched() {
    let h = Health::default();
    h.watch("first", Link::new(true));
    let waiting = tokio::spawn({
        let h = h.clone();
        async move { h.until_watched(2).await }
    });
    // One link of the two: still waiting, however long.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!waiting.is_finished());
    h.watch("second", Link::new(true));
    tokio::time::timeout(Duration::from_secs(1), waiting)
        .await
        .expect("the second link ends the wait")
        .unwrap();
    // Already enough: at once.
    tokio::time::timeout(Duration::from_millis(1), h.until_watched(2))
        .await
        .unwrap();
}

#[test]
fn metrics_render_with_their_documented_names() {
    let t = Telemetry::new().unwrap();
    t.metrics.request_finished("echo", Outcome::Success, 0.01);
    t.metrics.in_flight("echo", 1);
    let text = t.render();
    assert!(
        text.contains("sluice_processor_requests_total{outcome=\"success\",processor=\"echo\"} 1")
    );
    assert!(text.contains("sluice_processor_in_flight_requests{processor=\"echo\"} 1"));
    assert!(text.contains("sluice_processor_request_duration_seconds_bucket"));
}

#[test]
fn started_processors_and_clients_export_every_outcome_at_zero() {
    let t = Telemetry::new().unwrap();
    assert!(!t.render().contains("sluice_processor_requests_total{"));
    t.metrics.processor_started("echo");
    t.metrics.client_started("text-completion");
    let text = t.render();
    for outcome in [
        "success",
        "error",
        "malformed",
        "retried",
        "cancelled",
        "continued",
    ] {
        let line = format!(
            "sluice_processor_requests_total{{outcome=\"{outcome}\",processor=\"echo\"}} 0"
        );
        assert!(text.contains(&line), "{line} missing:\n{text}");
    }
    for outcome in ["success", "error", "timeout", "failed", "cancelled", "lost"] {
        let line = format!(
            "sluice_client_requests_total{{outcome=\"{outcome}\",service=\"text-completion\"}} 0"
        );
        assert!(text.contains(&line), "{line} missing:\n{text}");
    }
    for line in [
        "sluice_processor_in_flight_requests{processor=\"echo\"} 0",
        "sluice_processor_records_published_total{processor=\"echo\"} 0",
        "sluice_processor_redelivered_requests_total{processor=\"echo\"} 0",
        "sluice_processor_store_blocked{processor=\"echo\"} 0",
        "sluice_processor_request_duration_seconds_count{processor=\"echo\"} 0",
        "sluice_client_unroutable_records_total{service=\"text-completion\"} 0",
        "sluice_client_dropped_records_total{service=\"text-completion\"} 0",
        "sluice_client_resubscribed_total{service=\"text-completion\"} 0",
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
}
