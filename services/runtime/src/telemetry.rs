//! Telemetry: the Prometheus registry and the runtime's metrics, `/metrics`, `/healthz`
//! and `/readyz`, and tracing setup.
//!
//! Metric names follow one convention: `sluice_<subsystem>_<name>_<unit>`, counters end in
//! `_total`, durations are `_seconds` histograms. Labels are low-cardinality only: never a
//! request id, a prompt, a topic a caller chose, or a secret.
//!
//! Metrics are emitted through the small typed methods below, so a test can check that a
//! code path emitted what it should.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use sluice_schema::ErrorKind;
use tokio_util::sync::CancellationToken;

use crate::{
    bus::Link,
    lock,
    sink::{Pacer, Pacing},
};

mod logging;

pub use self::logging::{LogFormat, init_tracing};

/// Buckets for request durations: LLM requests run from milliseconds to minutes.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// How a processor's request ended, as counted in `sluice_processor_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The terminal record was published without an error.
    Success,
    /// The terminal record carried an error (provider failure, bad template...).
    Error,
    /// The request record could not be decoded; answered with an error when it had an id.
    Malformed,
    /// The request was handed back to the broker for another attempt: publishing failed, or
    /// the drain grace ran out before it was answered.
    Retried,
    /// The client cancelled the request; the handler was stopped.
    Cancelled,
    /// The handler handed the request on for its next step (an agent iteration).
    Continued,
}

impl Outcome {
    /// The `outcome` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Error => "error",
            Outcome::Malformed => "malformed",
            Outcome::Retried => "retried",
            Outcome::Cancelled => "cancelled",
            Outcome::Continued => "continued",
        }
    }
}

/// Every processor outcome, for exporting each at 0 when a processor starts.
const OUTCOMES: [Outcome; 6] = [
    Outcome::Success,
    Outcome::Error,
    Outcome::Malformed,
    Outcome::Retried,
    Outcome::Cancelled,
    Outcome::Continued,
];

/// How a request ended for the one who asked: the request/response client's
/// `sluice_client_requests_total` counts every one, the gateway's `sluice_gateway_streams_total`
/// the first four ([`ClientOutcome::STREAM`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientOutcome {
    /// The terminal record arrived without an error.
    Success,
    /// The terminal record carried an error.
    Error,
    /// A time limit ran out.
    Timeout,
    /// The caller went away or asked to stop.
    Cancelled,
    /// The answer could not be received: the bus closed, a record could not be decoded, the
    /// request could not be stored.
    Failed,
    /// Records of the answer were lost in transit (TrustGraph's non-persistent mapping).
    Lost,
}

impl ClientOutcome {
    /// Every client outcome, for exporting each at 0.
    pub const ALL: [ClientOutcome; 6] = [
        ClientOutcome::Success,
        ClientOutcome::Error,
        ClientOutcome::Timeout,
        ClientOutcome::Failed,
        ClientOutcome::Cancelled,
        ClientOutcome::Lost,
    ];

    /// The outcomes a streamed answer ends with, as the gateway counts them.
    pub const STREAM: [ClientOutcome; 4] = [
        ClientOutcome::Success,
        ClientOutcome::Error,
        ClientOutcome::Timeout,
        ClientOutcome::Cancelled,
    ];

    /// The `outcome` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ClientOutcome::Success => "success",
            ClientOutcome::Error => "error",
            ClientOutcome::Timeout => "timeout",
            ClientOutcome::Failed => "failed",
            ClientOutcome::Cancelled => "cancelled",
            ClientOutcome::Lost => "lost",
        }
    }

    /// How the gateway counts a stream that ended with an error of `kind`: a `timeout` or
    /// `cancelled` record as those, any other as an error.
    pub fn of_error(kind: &ErrorKind) -> Self {
        match kind {
            ErrorKind::Timeout => ClientOutcome::Timeout,
            ErrorKind::Cancelled => ClientOutcome::Cancelled,
            _ => ClientOutcome::Error,
        }
    }
}

/// The metrics of the processor runtime and the request/response client.
#[derive(Clone)]
pub struct RuntimeMetrics {
    requests: IntCounterVec,
    duration: HistogramVec,
    in_flight: IntGaugeVec,
    records: IntCounterVec,
    redelivered: IntCounterVec,
    unverified_keys: IntCounterVec,
    client_requests: IntCounterVec,
    client_unroutable: IntCounterVec,
    client_dropped: IntCounterVec,
    client_resubscribed: IntCounterVec,
    store_blocked: IntGaugeVec,
    config_version: IntGaugeVec,
    flows: IntGaugeVec,
    config_failures: IntCounterVec,
    coalesced: IntCounterVec,
    pace_interval: GaugeVec,
    pace_delayed: IntCounterVec,
    /// The process's pacer of each processor name (see [`crate::sink`]).
    pacers: Arc<Mutex<std::collections::HashMap<String, Arc<Pacer>>>>,
}

impl RuntimeMetrics {
    /// Registers the runtime's metrics in `registry`.
    ///
    /// Long because it is the list of every processor's metrics, each defined once with its
    /// name, help and labels: read whole, it is the catalogue docs/observability.md describes.
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "sluice_processor_requests_total",
                "Requests a processor finished, by outcome.",
            ),
            &["processor", "outcome"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_processor_request_duration_seconds",
                "Time from receiving a request to publishing its terminal record.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["processor"],
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "sluice_processor_in_flight_requests",
                "Requests a processor is handling now.",
            ),
            &["processor"],
        )?;
        let records = IntCounterVec::new(
            Opts::new(
                "sluice_processor_records_published_total",
                "Response records a processor published.",
            ),
            &["processor"],
        )?;
        let redelivered = IntCounterVec::new(
            Opts::new(
                "sluice_processor_redelivered_requests_total",
                "Requests received again after an earlier attempt did not finish.",
            ),
            &["processor"],
        )?;
        let unverified_keys = IntCounterVec::new(
            Opts::new(
                "sluice_processor_unverified_keys_total",
                "Requests refused because the API key they name carries no valid billing seal \
                 (a processor given a billing secret), by reason: unsealed, bad-seal.",
            ),
            &["processor", "reason"],
        )?;
        let client_requests = IntCounterVec::new(
            Opts::new(
                "sluice_client_requests_total",
                "Requests a request/response client made, by service and outcome.",
            ),
            &["service", "outcome"],
        )?;
        let client_unroutable = IntCounterVec::new(
            Opts::new(
                "sluice_client_unroutable_records_total",
                "Response records no caller was waiting for (late duplicates, timed-out requests).",
            ),
            &["service"],
        )?;
        let store_blocked = IntGaugeVec::new(
            Opts::new(
                "sluice_processor_store_blocked",
                "1 while the broker refuses to store a processor's records and it takes no new request.",
            ),
            &["processor"],
        )?;
        let client_dropped = IntCounterVec::new(
            Opts::new(
                "sluice_client_dropped_records_total",
                "Records the broker dropped on a client's response subscription, seen as jumps in a producer's sequence (non-persistent topics); they may be any client's.",
            ),
            &["service"],
        )?;
        let client_resubscribed = IntCounterVec::new(
            Opts::new(
                "sluice_client_resubscribed_total",
                "Times a client re-created its response subscription because nothing at all arrived on it, not even processors' syncs, while its requests waited (non-persistent topics).",
            ),
            &["service"],
        )?;
        let config_version = IntGaugeVec::new(
            Opts::new(
                "sluice_config_version",
                "The version of TrustGraph's config a processor last applied (--config-service).",
            ),
            &["processor"],
        )?;
        let flows = IntGaugeVec::new(
            Opts::new(
                "sluice_config_flows",
                "Flows a processor serves now, as TrustGraph's config service assigns them.",
            ),
            &["processor"],
        )?;
        let config_failures = IntCounterVec::new(
            Opts::new(
                "sluice_config_fetch_failures_total",
                "Reads of TrustGraph's config service that failed or whose answer could not be applied.",
            ),
            &["processor"],
        )?;
        let coalesced = IntCounterVec::new(
            Opts::new(
                "sluice_processor_deltas_coalesced_total",
                "Streamed deltas a processor merged into the record before them instead of publishing them as records of their own (paced, or while the broker had not confirmed the stream's previous record).",
            ),
            &["processor"],
        )?;
        let pace_interval = GaugeVec::new(
            Opts::new(
                "sluice_processor_pace_interval_seconds",
                "The least time between two records of one stream of a paced processor now: the larger of --pace-interval-ms and open streams / --max-response-records-per-sec.",
            ),
            &["processor"],
        )?;
        registry.register(Box::new(pace_interval.clone()))?;
        let pace_delayed = IntCounterVec::new(
            Opts::new(
                "sluice_processor_records_delayed_total",
                "Response records a paced processor held back for their turn under --max-response-records-per-sec.",
            ),
            &["processor"],
        )?;
        for c in [
            &coalesced,
            &pace_delayed,
            &requests,
            &records,
            &redelivered,
            &unverified_keys,
            &client_requests,
            &client_unroutable,
            &client_dropped,
            &client_resubscribed,
            &config_failures,
        ] {
            registry.register(Box::new(c.clone()))?;
        }
        for g in [&in_flight, &store_blocked, &config_version, &flows] {
            registry.register(Box::new(g.clone()))?;
        }
        registry.register(Box::new(duration.clone()))?;
        Ok(Self {
            requests,
            duration,
            in_flight,
            records,
            redelivered,
            unverified_keys,
            client_requests,
            client_unroutable,
            client_dropped,
            client_resubscribed,
            store_blocked,
            config_version,
            flows,
            config_failures,
            coalesced,
            pace_interval,
            pace_delayed,
            pacers: Arc::default(),
        })
    }

    /// The pacer of `processor`'s response records in this process, made with `pacing` the
    /// first time (every flow of a processor has the same settings).
    pub(crate) fn pacer(&self, processor: &str, pacing: Pacing) -> Arc<Pacer> {
        lock(&self.pacers)
            .entry(processor.to_owned())
            .or_insert_with(|| {
                Arc::new(Pacer::new(
                    pacing,
                    self.coalesced.with_label_values(&[processor]),
                    self.pace_interval.with_label_values(&[processor]),
                    self.pace_delayed.with_label_values(&[processor]),
                ))
            })
            .clone()
    }

    /// The counter of `processor`'s deltas merged into the record before them.
    pub(crate) fn coalesced_counter(&self, processor: &str) -> IntCounter {
        self.coalesced.with_label_values(&[processor])
    }

    /// The counter of `processor`'s published response records, counted as each is
    /// published (so `rate()` of it is the current record rate).
    pub fn records_counter(&self, processor: &str) -> IntCounter {
        self.records.with_label_values(&[processor])
    }

    /// Records the config version `processor` applied and how many flows it serves.
    pub fn config_applied(&self, processor: &str, version: u64, flows: usize) {
        self.config_version
            .with_label_values(&[processor])
            .set(i64::try_from(version).unwrap_or(i64::MAX));
        self.flows
            .with_label_values(&[processor])
            .set(i64::try_from(flows).unwrap_or(i64::MAX));
    }

    /// Counts a failed read of the config service.
    pub fn config_failed(&self, processor: &str) {
        self.config_failures.with_label_values(&[processor]).inc();
    }

    /// Exports `processor`'s series at 0 before its first request, so that dashboards and
    /// alerts (`rate()`, ratios, "nothing finished") see the processor from the start rather
    /// than from its first error.
    pub fn processor_started(&self, processor: &str) {
        for outcome in OUTCOMES {
            self.requests
                .with_label_values(&[processor, outcome.as_str()]);
        }
        self.duration.with_label_values(&[processor]);
        self.in_flight.with_label_values(&[processor]);
        self.records.with_label_values(&[processor]);
        self.redelivered.with_label_values(&[processor]);
        self.store_blocked.with_label_values(&[processor]);
        // Unpaced, these stay at 0; a pacer made later (see `pacer`) sets the interval.
        self.coalesced.with_label_values(&[processor]);
        self.pace_interval.with_label_values(&[processor]);
        self.pace_delayed.with_label_values(&[processor]);
    }

    /// Whether `processor` is paused because the broker cannot store its records.
    pub fn store_blocked(&self, processor: &str, blocked: bool) {
        self.store_blocked
            .with_label_values(&[processor])
            .set(i64::from(blocked));
    }

    /// Exports a request/response client's series for `service` at 0 (see
    /// [`RuntimeMetrics::processor_started`]).
    pub fn client_started(&self, service: &str) {
        for outcome in ClientOutcome::ALL {
            self.client_requests
                .with_label_values(&[service, outcome.as_str()]);
        }
        self.client_unroutable.with_label_values(&[service]);
        self.client_dropped.with_label_values(&[service]);
        self.client_resubscribed.with_label_values(&[service]);
    }

    /// A request finished.
    pub fn request_finished(&self, processor: &str, outcome: Outcome, seconds: f64) {
        self.requests
            .with_label_values(&[processor, outcome.as_str()])
            .inc();
        if matches!(outcome, Outcome::Success | Outcome::Error) {
            self.duration
                .with_label_values(&[processor])
                .observe(seconds);
        }
    }

    /// A request started (`delta` = 1) or ended (`delta` = -1).
    pub fn in_flight(&self, processor: &str, delta: i64) {
        self.in_flight.with_label_values(&[processor]).add(delta);
    }

    /// A request arrived again after an earlier attempt.
    pub fn redelivered(&self, processor: &str) {
        self.redelivered.with_label_values(&[processor]).inc();
    }

    /// Exports `processor`'s refused-key series at 0: it checks billing seals.
    pub fn billing_enforced(&self, processor: &str) {
        for why in [
            crate::billing::Unverified::Unsealed,
            crate::billing::Unverified::BadSeal,
        ] {
            self.unverified_keys
                .with_label_values(&[processor, why.as_str()]);
        }
    }

    /// A request naming an API key without a valid billing seal was refused.
    pub fn unverified_key(&self, processor: &str, why: crate::billing::Unverified) {
        self.unverified_keys
            .with_label_values(&[processor, why.as_str()])
            .inc();
    }

    /// A client request ended with `outcome`.
    pub fn client_request(&self, service: &str, outcome: ClientOutcome) {
        self.client_requests
            .with_label_values(&[service, outcome.as_str()])
            .inc();
    }

    /// The broker dropped `n` records on a client's response subscription.
    pub fn client_dropped(&self, service: &str, n: u64) {
        self.client_dropped.with_label_values(&[service]).inc_by(n);
    }

    /// A client re-created its response subscription because it heard nothing at all.
    pub fn client_resubscribed(&self, service: &str) {
        self.client_resubscribed.with_label_values(&[service]).inc();
    }

    /// A response record arrived that no caller was waiting for.
    pub fn client_unroutable(&self, service: &str) {
        self.client_unroutable.with_label_values(&[service]).inc();
    }
}

/// Liveness and readiness: ready while every registered link is up, no condition is failing
/// and the process is not draining.
#[derive(Clone, Default)]
pub struct Health {
    links: Arc<Mutex<Vec<(String, Link)>>>,
    /// Woken whenever a link is watched ([`Health::until_watched`]).
    watched_more: Arc<tokio::sync::Notify>,
    conditions: Arc<Mutex<std::collections::BTreeMap<String, String>>>,
    draining: Arc<AtomicBool>,
}

impl Health {
    /// Readiness depends on `link` from now on.
    pub fn watch(&self, name: impl Into<String>, link: Link) {
        lock(&self.links).push((name.into(), link));
        self.watched_more.notify_waiters();
    }

    /// Returns once at least `n` links are watched: a processor watches its request
    /// subscription as soon as it has it, so this is "the process's processors have
    /// subscribed" (`sluice serve` opens its gateway then: the in-process bus delivers only
    /// what is published after a subscription exists).
    pub async fn until_watched(&self, n: usize) {
        loop {
            // Registered before the count is read, so a watch in between is not missed.
            let more = self.watched_more.notified();
            tokio::pin!(more);
            more.as_mut().enable();
            if self.watched() >= n {
                return;
            }
            more.await;
        }
    }

    /// Readiness no longer depends on the links watched under `name` (a flow that stopped).
    pub fn unwatch(&self, name: &str) {
        lock(&self.links).retain(|(n, _)| n != name);
    }

    /// How many links readiness depends on.
    pub fn watched(&self) -> usize {
        lock(&self.links).len()
    }

    /// Marks the process as draining: `/readyz` fails so that no new traffic is routed here.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Marks the condition `name` as failing for `reason`: `/readyz` answers 503 with the
    /// reason until [`Health::clear`] is called for it.
    pub fn fail(&self, name: impl Into<String>, reason: impl Into<String>) {
        lock(&self.conditions).insert(name.into(), reason.into());
    }

    /// The condition `name` holds again.
    pub fn clear(&self, name: &str) {
        lock(&self.conditions).remove(name);
    }

    /// `Ok` when ready, else what is not.
    pub fn readiness(&self) -> Result<(), NotReady> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(NotReady::Draining);
        }
        {
            let conditions = lock(&self.conditions);
            if !conditions.is_empty() {
                return Err(NotReady::Failing(conditions.values().cloned().collect()));
            }
        }
        let links = lock(&self.links);
        let down: Vec<String> = links
            .iter()
            .filter(|(_, l)| !l.is_up())
            .map(|(n, l)| match l.why() {
                Some(why) => format!("{n} ({why})"),
                None => n.clone(),
            })
            .collect();
        if down.is_empty() {
            Ok(())
        } else {
            Err(NotReady::NotConnected(down))
        }
    }
}

/// Why a process is not ready, as `/readyz` says it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// The process is draining for shutdown.
    #[error("draining")]
    Draining,
    /// Conditions set with [`Health::fail`] (each its description).
    #[error("{}", .0.join("; "))]
    Failing(Vec<String>),
    /// Watched links that are down (each `name` or `name (why)`).
    #[error("not connected: {}", .0.join(", "))]
    NotConnected(Vec<String>),
}

/// Reads the allocator's counters: bytes the process's allocations hold, and bytes of
/// memory the allocator holds resident. `None` when they cannot be read.
pub type HeapProbe = fn() -> Option<(u64, u64)>;

static HEAP_PROBE: std::sync::OnceLock<HeapProbe> = std::sync::OnceLock::new();

/// Sets the allocator probe (once, by the binary that chose the allocator, before any
/// [`Telemetry`] is made): from then on `/metrics` carries `sluice_process_heap_*`.
pub fn set_heap_probe(probe: HeapProbe) {
    let _ = HEAP_PROBE.set(probe);
}

/// `sluice_process_heap_allocated_bytes` and `sluice_process_heap_resident_bytes`, read from
/// the allocator at each scrape.
#[derive(Clone)]
struct HeapGauges {
    allocated: prometheus::IntGauge,
    resident: prometheus::IntGauge,
    probe: HeapProbe,
}

impl HeapGauges {
    fn register(registry: &Registry, probe: HeapProbe) -> Result<Self, prometheus::Error> {
        let allocated = prometheus::IntGauge::new(
            "sluice_process_heap_allocated_bytes",
            "Bytes the process's live allocations hold (the allocator's count).",
        )?;
        let resident = prometheus::IntGauge::new(
            "sluice_process_heap_resident_bytes",
            "Bytes of memory the allocator holds resident, in use or cached.",
        )?;
        registry.register(Box::new(allocated.clone()))?;
        registry.register(Box::new(resident.clone()))?;
        let gauges = Self {
            allocated,
            resident,
            probe,
        };
        gauges.update();
        Ok(gauges)
    }

    fn update(&self) {
        if let Some((allocated, resident)) = (self.probe)() {
            self.allocated
                .set(i64::try_from(allocated).unwrap_or(i64::MAX));
            self.resident
                .set(i64::try_from(resident).unwrap_or(i64::MAX));
        }
    }
}

/// The process's telemetry: one registry, the runtime metrics, health.
#[derive(Clone)]
pub struct Telemetry {
    /// Every metric of the process registers here.
    pub registry: Registry,
    /// The runtime's metrics.
    pub metrics: RuntimeMetrics,
    /// Liveness and readiness.
    pub health: Health,
    /// The allocator's counters, when the binary set a probe.
    heap: Option<HeapGauges>,
}

impl Telemetry {
    /// A fresh registry with the runtime metrics registered.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let metrics = RuntimeMetrics::register(&registry)?;
        let heap = match HEAP_PROBE.get() {
            Some(probe) => Some(HeapGauges::register(&registry, *probe)?),
            None => None,
        };
        Ok(Self {
            registry,
            metrics,
            health: Health::default(),
            heap,
        })
    }

    /// The registry's metrics in Prometheus text format.
    pub fn render(&self) -> String {
        if let Some(heap) = &self.heap {
            heap.update();
        }
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// `/metrics`, `/healthz` and `/readyz`, to serve beside other routes (`sluice serve`
    /// puts the gateway's beside them on a loopback metrics port).
    pub fn routes(&self) -> Router {
        Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(readyz))
            .with_state(self.clone())
    }

    /// Serves [`Telemetry::routes`] on `addr` until `shutdown`; any other path gets a 404
    /// saying where the API is. Returns the bound address (useful with port 0).
    pub async fn serve(
        &self,
        addr: SocketAddr,
        shutdown: CancellationToken,
    ) -> std::io::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let app = self.routes().fallback(not_the_api);
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { shutdown.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "telemetry server stopped");
            }
        });
        Ok(local)
    }
}

async fn metrics(State(t): State<Telemetry>) -> impl IntoResponse {
    ([("content-type", "text/plain; version=0.0.4")], t.render())
}

/// What the metrics port answers a path it does not serve: a caller who sent an API request
/// here (port 8000 is where many LLM servers, and the event protocol's own test, expect the
/// API) learns where it is instead of reading an empty 404.
pub const NOT_THE_API: &str = "404: this is sluice's metrics port (/metrics, /healthz, /readyz); the HTTP API is the gateway's, on its --listen address (127.0.0.1:8088 under sluice serve, 0.0.0.0:8088 under sluice gateway)\n";

async fn not_the_api() -> impl IntoResponse {
    (
        StatusCode::NOT_FOUND,
        [("content-type", "text/plain; charset=utf-8")],
        NOT_THE_API,
    )
}

async fn readyz(State(t): State<Telemetry>) -> impl IntoResponse {
    match t.health.readiness() {
        Ok(()) => (StatusCode::OK, "ready".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why.to_string()),
    }
}

/// A token cancelled on SIGTERM or SIGINT: the signal to drain.
pub fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = ctrl_c => tracing::info!("SIGINT: draining"),
                        _ = term.recv() => tracing::info!("SIGTERM: draining"),
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM; only SIGINT drains");
                    let _ = ctrl_c.await;
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
        trigger.cancel();
    });
    token
}

#[cfg(test)]
mod tests;
