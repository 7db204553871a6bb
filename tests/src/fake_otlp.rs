//! A fake OpenTelemetry collector: OTLP/HTTP with protobuf bodies (`POST /v1/traces`), as
//! the collector's `otlphttp` receiver takes them. It decodes each export with the
//! `opentelemetry-proto` messages and keeps the spans, flattened, for tests to look at.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};

use axum::{Router, extract::State, http::StatusCode, routing::post};
use bytes::Bytes;
use opentelemetry_proto::tonic::{
    collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse},
    common::v1::any_value::Value,
};
use prost::Message;

use crate::fake::Fake;

/// The fake collector.
pub type FakeCollector = Fake<CollectorSeen>;

/// One exported span, flattened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenSpan {
    /// `service.name` of the resource that sent it.
    pub service: String,
    /// Span name.
    pub name: String,
    /// Trace id, hex.
    pub trace_id: String,
    /// Span id, hex.
    pub span_id: String,
    /// Parent span id, hex; empty for a root span.
    pub parent_span_id: String,
    /// OTLP span kind (2 server, 3 client, 5 consumer).
    pub kind: i32,
    /// Status code (0 unset, 1 ok, 2 error).
    pub status: i32,
    /// String, bool and integer attributes, as strings.
    pub attributes: Vec<(String, String)>,
}

impl SeenSpan {
    /// The value of attribute `key`.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// What the collector received.
#[derive(Default)]
pub struct CollectorSeen {
    spans: Vec<SeenSpan>,
    content_types: Vec<String>,
    authorizations: Vec<String>,
}

impl Fake<CollectorSeen> {
    /// Starts a collector on a free loopback port; its base URL is the OTLP endpoint.
    pub async fn start() -> Self {
        Self::serve(|seen| {
            Router::new()
                .route("/v1/traces", post(traces))
                .with_state(seen)
        })
        .await
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<SeenSpan> {
        self.seen().spans.clone()
    }

    /// Content types of the exports received.
    pub fn content_types(&self) -> Vec<String> {
        self.seen().content_types.clone()
    }

    /// The `authorization` header of every export received ("" when absent).
    pub fn authorizations(&self) -> Vec<String> {
        self.seen().authorizations.clone()
    }

    /// Waits (up to 30 s) until `done` holds for the spans received, and returns them.
    pub async fn wait_for(&self, done: impl Fn(&[SeenSpan]) -> bool) -> Vec<SeenSpan> {
        for _ in 0..300 {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        self.spans()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn traces(
    State(seen): State<Arc<Mutex<CollectorSeen>>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> (StatusCode, Vec<u8>) {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, Vec::new());
    };
    let authorization = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut s = seen.lock().unwrap();
    s.content_types.push(content_type);
    s.authorizations.push(authorization);
    for rs in request.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(v) => Some(v.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for span in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
            let attributes = span
                .attributes
                .iter()
                .filter_map(|kv| {
                    let v = match kv.value.as_ref()?.value.as_ref()? {
                        Value::StringValue(v) => v.clone(),
                        Value::BoolValue(v) => v.to_string(),
                        Value::IntValue(v) => v.to_string(),
                        _ => return None,
                    };
                    Some((kv.key.clone(), v))
                })
                .collect();
            s.spans.push(SeenSpan {
                service: service.clone(),
                name: span.name,
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_span_id: hex(&span.parent_span_id),
                kind: span.kind,
                status: span.status.map_or(0, |st| st.code),
                attributes,
            });
        }
    }
    (
        StatusCode::OK,
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}
