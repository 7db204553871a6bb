//! The gateway's Prometheus metrics (`sluice_gateway_*`).

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};
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
    resume_refusals: IntCounterVec,
    key_requests: IntCounterVec,
    key_tokens: IntCounterVec,
    keys: IntGauge,
    key_reloads: IntCounterVec,
    limit_peers: IntGauge,
    key_in_flight: IntGaugeVec,
    key_quota_used: IntGaugeVec,
    limit_share_failures: IntCounter,
    limit_share_delay: prometheus::Histogram,
    refusals: IntCounterVec,
    open_connections: IntGauge,
    limit_snapshots_refused: IntCounterVec,
    operator_fields_dropped: IntCounterVec,
}

/// Why a request or connection was refused before any route saw it
/// (`sluice_gateway_refusals_total{reason}`).
pub const REFUSAL_REASONS: [&str; 4] = ["host", "origin", "content-type", "socket-auth"];

/// What happened to an API key's request (`sluice_gateway_key_requests_total{outcome}`).
pub const KEY_OUTCOMES: [&str; 5] = [
    "admitted",
    "rate-limited",
    "quota-exceeded",
    "concurrency-limited",
    "forbidden",
];

impl GatewayMetrics {
    /// Registers the metrics in `registry`.
    ///
    /// Long because it is the list of the gateway's metrics, each defined once with its name,
    /// help and labels: read whole, it is the catalogue docs/observability.md describes.
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
        let resume_refusals = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_resume_refusals_total",
                "Requests to resume a stream that were refused, by reason: malformed (not a token), route (another route's), off (resuming is off), not-resumable (answers not kept), seal (not given to this caller by these gateways, or altered), expired (older than the resume window), future (a start time ahead of this gateway's clock)",
            ),
            &["reason"],
        )?;
        let key_requests = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_key_requests_total",
                "Requests made with an API key, resumed streams included, by key name and outcome: admitted, rate-limited (a per-minute limit), quota-exceeded (a day's or month's tokens), concurrency-limited (requests in flight, or resumed streams read at once), forbidden (a service, model or flow the key may not use)",
            ),
            &["key", "outcome"],
        )?;
        let key_tokens = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_key_tokens_total",
                "Tokens used by requests made with an API key, by key name and kind (input, output), counted when each request ends",
            ),
            &["key", "kind"],
        )?;
        let keys = IntGauge::new(
            "sluice_gateway_keys",
            "API keys the gateway accepts now (from its keys file)",
        )?;
        let key_reloads = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_keys_reloads_total",
                "Changes of the keys file seen, by outcome: taken, invalid (the keys stay as they were)",
            ),
            &["outcome"],
        )?;
        let limit_peers = IntGauge::new(
            "sluice_gateway_limit_peers",
            "Other gateway replicas whose limit state this one read within the last two minutes",
        )?;
        let key_in_flight = IntGaugeVec::new(
            Opts::new(
                "sluice_gateway_key_in_flight",
                "Requests of an API key in flight on all replicas, as this replica last heard (its own, and the others' limit state of the last two minutes), by key name",
            ),
            &["key"],
        )?;
        let key_quota_used = IntGaugeVec::new(
            Opts::new(
                "sluice_gateway_key_quota_used_tokens",
                "Tokens of an API key counted against its quotas on all replicas, as this replica last heard (what requests in flight reserved included), by key name and period: day, month (UTC)",
            ),
            &["key", "period"],
        )?;
        let limit_share_failures = IntCounter::new(
            "sluice_gateway_limit_share_failures_total",
            "Failures to publish or read the limit state shared by the replicas (while they last, each replica counts alone)",
        )?;
        let refusals = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_refusals_total",
                "Requests refused before any route saw them, by reason: host (a Host name not served: DNS rebinding), origin (a web page of an origin not allowed), content-type (a POST body not declared JSON), socket-auth (a WebSocket that did not authenticate in time or failed too often)",
            ),
            &["reason"],
        )?;
        let open_connections = IntGauge::new(
            "sluice_gateway_open_connections",
            "HTTP connections open now (at most --max-connections; more wait in the listen backlog)",
        )?;
        let limit_share_delay = prometheus::Histogram::with_opts(
            HistogramOpts::new(
                "sluice_gateway_limit_share_delay_seconds",
                "From another replica publishing its limit state to this one reading it (wall clocks of two hosts: as exact as their sync); what a limit can be exceeded by grows with it",
            )
            .buckets(FIRST_EVENT_BUCKETS.to_vec()),
        )?;
        let limit_snapshots_refused = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_limit_snapshots_refused_total",
                "Messages on the limits topic not believed, by reason: unsealed (no seal), seal (a seal not of the replicas' secret), malformed, unknown-key (a key not in the keys file), ahead (counts from a clock far ahead), seq (a sequence number ahead of the clock), replicas (more replicas of one key than are kept)",
            ),
            &["reason"],
        )?;
        let operator_fields_dropped = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_operator_fields_dropped_total",
                "Request fields only the operator may set, dropped from a tenant's request before it was sent, by service and field",
            ),
            &["service", "field"],
        )?;
        for (service, field) in crate::kinds::OPERATOR_FIELDS {
            operator_fields_dropped.with_label_values(&[service.as_str(), field]);
        }
        for reason in crate::resume::REFUSAL_REASONS {
            resume_refusals.with_label_values(&[reason]);
        }
        for reason in crate::limits::SNAPSHOT_REFUSALS {
            limit_snapshots_refused.with_label_values(&[reason]);
        }
        for outcome in ["taken", "invalid"] {
            key_reloads.with_label_values(&[outcome]);
        }
        // Frame kinds are a fixed set: export them at 0 so a rate exists before the first
        // WebSocket client.
        for kind in ["auth", "request", "invalid"] {
            socket_frames.with_label_values(&[kind]);
        }
        for reason in REFUSAL_REASONS {
            refusals.with_label_values(&[reason]);
        }
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(streams.clone()))?;
        registry.register(Box::new(first_event.clone()))?;
        registry.register(Box::new(open_streams.clone()))?;
        registry.register(Box::new(socket_frames.clone()))?;
        registry.register(Box::new(resumes.clone()))?;
        registry.register(Box::new(resume_refusals.clone()))?;
        registry.register(Box::new(key_requests.clone()))?;
        registry.register(Box::new(key_tokens.clone()))?;
        registry.register(Box::new(keys.clone()))?;
        registry.register(Box::new(key_reloads.clone()))?;
        registry.register(Box::new(limit_peers.clone()))?;
        registry.register(Box::new(key_in_flight.clone()))?;
        registry.register(Box::new(key_quota_used.clone()))?;
        registry.register(Box::new(limit_share_failures.clone()))?;
        registry.register(Box::new(limit_share_delay.clone()))?;
        registry.register(Box::new(refusals.clone()))?;
        registry.register(Box::new(open_connections.clone()))?;
        registry.register(Box::new(limit_snapshots_refused.clone()))?;
        registry.register(Box::new(operator_fields_dropped.clone()))?;
        Ok(Self {
            requests,
            streams,
            first_event,
            open_streams,
            socket_frames,
            resumes,
            resume_refusals,
            key_requests,
            key_tokens,
            keys,
            key_reloads,
            limit_peers,
            key_in_flight,
            key_quota_used,
            limit_share_failures,
            limit_share_delay,
            refusals,
            open_connections,
            limit_snapshots_refused,
            operator_fields_dropped,
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

    /// Counts a refused resume by its reason (one of `resume::REFUSAL_REASONS`).
    pub(crate) fn resume_refused(&self, reason: &str) {
        self.resume_refusals.with_label_values(&[reason]).inc();
    }

    /// Counts a message on the limits topic that was not believed (`reason`: one of
    /// `limits::SNAPSHOT_REFUSALS`).
    pub(crate) fn limit_snapshot_refused(&self, reason: &str) {
        self.limit_snapshots_refused
            .with_label_values(&[reason])
            .inc();
    }

    /// How many resumes were refused for `reason` (tests).
    #[cfg(test)]
    pub(crate) fn resume_refusals(&self, reason: &str) -> u64 {
        self.resume_refusals.with_label_values(&[reason]).get()
    }

    /// How many messages on the limits topic were not believed for `reason` (tests).
    #[cfg(test)]
    pub(crate) fn snapshot_refusals(&self, reason: &str) -> u64 {
        self.limit_snapshots_refused
            .with_label_values(&[reason])
            .get()
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

    /// Counts a request refused before any route saw it (`reason`: one of
    /// [`REFUSAL_REASONS`]).
    pub fn refusal(&self, reason: &str) {
        self.refusals.with_label_values(&[reason]).inc();
    }

    /// Changes the open-connection gauge.
    pub fn open_connections(&self, delta: i64) {
        self.open_connections.add(delta);
    }

    /// Counts a WebSocket frame.
    pub fn socket_frame(&self, kind: &str) {
        self.socket_frames.with_label_values(&[kind]).inc();
    }

    /// Counts a request made with an API key (`outcome`: one of [`KEY_OUTCOMES`]).
    pub fn key_request(&self, key: &str, outcome: &str) {
        self.key_requests.with_label_values(&[key, outcome]).inc();
    }

    /// A tenant's request to `service` had `field`, which only the operator may set: dropped.
    pub fn operator_field_dropped(&self, service: &str, field: &str) {
        self.operator_fields_dropped
            .with_label_values(&[service, field])
            .inc();
    }

    /// Exports a key's series at 0, so a rate exists before its first request.
    pub fn key_known(&self, key: &str) {
        for outcome in KEY_OUTCOMES {
            self.key_requests.with_label_values(&[key, outcome]);
        }
        for kind in ["input", "output"] {
            self.key_tokens.with_label_values(&[key, kind]);
        }
        self.key_in_flight.with_label_values(&[key]);
        for period in ["day", "month"] {
            self.key_quota_used.with_label_values(&[key, period]);
        }
    }

    /// Adds a finished request's tokens to its key's.
    pub fn key_tokens(&self, key: &str, input: u64, output: u64) {
        self.key_tokens
            .with_label_values(&[key, "input"])
            .inc_by(input);
        self.key_tokens
            .with_label_values(&[key, "output"])
            .inc_by(output);
    }

    /// Records a look at the keys file that found it changed (`taken`: its keys are in use).
    pub fn keys_reloaded(&self, taken: bool, keys: usize) {
        self.key_reloads
            .with_label_values(&[if taken { "taken" } else { "invalid" }])
            .inc();
        self.keys.set(i64::try_from(keys).unwrap_or(i64::MAX));
    }

    /// Sets the number of keys accepted.
    pub fn keys(&self, keys: usize) {
        self.keys.set(i64::try_from(keys).unwrap_or(i64::MAX));
    }

    /// Sets the number of other replicas sharing limit state.
    pub fn limit_peers(&self, peers: usize) {
        self.limit_peers
            .set(i64::try_from(peers).unwrap_or(i64::MAX));
    }

    /// Sets what `key` has in flight and has used of its quotas on all replicas, as this
    /// replica last heard.
    pub fn key_totals(&self, key: &str, in_flight: u64, day_tokens: u64, month_tokens: u64) {
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.key_in_flight
            .with_label_values(&[key])
            .set(gauge(in_flight));
        self.key_quota_used
            .with_label_values(&[key, "day"])
            .set(gauge(day_tokens));
        self.key_quota_used
            .with_label_values(&[key, "month"])
            .set(gauge(month_tokens));
    }

    /// Records how late another replica's limit state was read.
    pub fn limit_share_delay(&self, seconds: f64) {
        self.limit_share_delay.observe(seconds);
    }

    /// Counts a failure to share limit state.
    pub fn limit_share_failure(&self) {
        self.limit_share_failures.inc();
    }
}
