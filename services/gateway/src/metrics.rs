//! The gateway's Prometheus metrics (`sluice_gateway_*`).

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use sluice_runtime::telemetry::ClientOutcome;

/// Buckets for time to the first streamed event: a few ms through the gateway and the bus,
/// up to a cold local model's first token.
const FIRST_EVENT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The gateway's metrics.
#[derive(Clone)]
pub struct GatewayMetrics {
    requests: IntCounterVec,
    streams: IntCounterVec,
    first_event: HistogramVec,
    open_streams: IntGaugeVec,
    socket_frames: IntCounterVec,
    resumes: IntCounterVec,
}

impl GatewayMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_requests_total",
                "HTTP requests by route and response status",
            ),
            &["route", "status"],
        )?;
        let streams = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_streams_total",
                "Streamed answers (NDJSON, SSE, WebSocket) by route and how they ended: success, error, timeout, cancelled",
            ),
            &["route", "outcome"],
        )?;
        let first_event = HistogramVec::new(
            HistogramOpts::new(
                "sluice_gateway_first_event_seconds",
                "From the request arriving to the first answer event sent (tokens, not the initial status)",
            )
            .buckets(FIRST_EVENT_BUCKETS.to_vec()),
            &["route"],
        )?;
        let open_streams = IntGaugeVec::new(
            Opts::new(
                "sluice_gateway_open_streams",
                "Streams being written to clients now",
            ),
            &["route"],
        )?;
        let socket_frames = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_socket_frames_total",
                "WebSocket frames received, by kind: auth, request, invalid",
            ),
            &["kind"],
        )?;
        let resumes = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_resumes_total",
                "Requests to resume a stream, by route and outcome: resumed, expired (older than the resume window), refused (a bad token, a stream that cannot be read again)",
            ),
            &["route", "outcome"],
        )?;
        // Frame kinds are a fixed set: export them at 0 so a rate exists before the first
        // WebSocket client.
        for kind in ["auth", "request", "invalid"] {
            socket_frames.with_label_values(&[kind]);
        }
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(streams.clone()))?;
        registry.register(Box::new(first_event.clone()))?;
        registry.register(Box::new(open_streams.clone()))?;
        registry.register(Box::new(socket_frames.clone()))?;
        registry.register(Box::new(resumes.clone()))?;
        Ok(Self {
            requests,
            streams,
            first_event,
            open_streams,
            socket_frames,
            resumes,
        })
    }

    /// Exports `route`'s stream series at 0 before its first stream, so that dashboards and
    /// alerts see every route the gateway serves from the start.
    pub fn route_served(&self, route: &str) {
        for outcome in ClientOutcome::STREAM {
            self.streams.with_label_values(&[route, outcome.as_str()]);
        }
        self.first_event.with_label_values(&[route]);
        self.open_streams.with_label_values(&[route]);
        for outcome in ["resumed", "expired", "refused"] {
            self.resumes.with_label_values(&[route, outcome]);
        }
    }

    /// Counts a request to resume a stream.
    pub fn resume(&self, route: &str, outcome: &str) {
        self.resumes.with_label_values(&[route, outcome]).inc();
    }

    /// Counts an HTTP request.
    pub fn request(&self, route: &str, status: u16) {
        self.requests
            .with_label_values(&[route, &status.to_string()])
            .inc();
    }

    /// Counts a finished stream.
    pub fn stream_ended(&self, route: &str, outcome: ClientOutcome) {
        self.streams
            .with_label_values(&[route, outcome.as_str()])
            .inc();
    }

    /// Records the time to a stream's first answer event.
    pub fn first_event(&self, route: &str, seconds: f64) {
        self.first_event
            .with_label_values(&[route])
            .observe(seconds);
    }

    /// Changes the open-stream gauge.
    pub fn open_streams(&self, route: &str, delta: i64) {
        self.open_streams.with_label_values(&[route]).add(delta);
    }

    /// Counts a WebSocket frame.
    pub fn socket_frame(&self, kind: &str) {
        self.socket_frames.with_label_values(&[kind]).inc();
    }
}
