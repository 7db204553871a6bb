//! The text-completion processor's metrics (`sluice_llm_*`): the provider calls, by provider
//! and model. Labels come from configuration (provider, model), an outcome or a failure kind:
//! never a request id, a prompt or a key.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// The labels of one provider in a fallback list: its position (0 the first), provider and
/// model, all from configuration.
pub(crate) const FALLBACK_LABELS: &[&str] = &["position", "provider", "model"];

use crate::provider::FailureKind;

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// How a provider call ended, as `sluice_llm_requests_total` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// The provider answered and the answer was published.
    Success,
    /// The call failed (an error record went to the client).
    Error,
    /// The provider answered but the broker did not store the records: not a provider
    /// failure; the request goes back to the broker.
    Unpublished,
    /// The call was stopped before it ended: its client cancelled the request, or the
    /// processor's drain grace ran out (the request then goes back to the broker).
    Cancelled,
}

impl CallOutcome {
    /// Every outcome, for exporting each at 0.
    pub const ALL: [CallOutcome; 4] = [
        CallOutcome::Success,
        CallOutcome::Error,
        CallOutcome::Unpublished,
        CallOutcome::Cancelled,
    ];

    /// The `outcome` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Success => "success",
            CallOutcome::Error => "error",
            CallOutcome::Unpublished => "unpublished",
            CallOutcome::Cancelled => "cancelled",
        }
    }
}

/// The provider-call metrics. Labels: provider and model (both from configuration, so
/// low-cardinality), outcome or failure kind. Never a request id, a prompt or a key.
#[derive(Clone)]
pub struct LlmMetrics {
    pub(crate) requests: IntCounterVec,
    pub(crate) ttft: HistogramVec,
    pub(crate) duration: HistogramVec,
    pub(crate) tokens: IntCounterVec,
    pub(crate) retries: IntCounterVec,
    pub(crate) rate_limited: IntCounterVec,
    pub(crate) in_flight: IntGaugeVec,
    pub(crate) fallbacks: IntCounterVec,
    pub(crate) answered: IntCounterVec,
    pub(crate) hedges: IntCounterVec,
    pub(crate) breaker_state: IntGaugeVec,
    pub(crate) breaker_transitions: IntCounterVec,
}

impl LlmMetrics {
    /// Registers the metrics in `registry`.
    ///
    /// Long because it is the list of the provider calls' metrics, each defined once with its
    /// name, help and labels: read whole, it is the catalogue docs/observability.md describes.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let labels = &["provider", "model"];
        let requests = IntCounterVec::new(
            Opts::new(
                "sluice_llm_requests_total",
                "Provider calls finished, by outcome.",
            ),
            &["provider", "model", "outcome"],
        )?;
        let ttft = HistogramVec::new(
            HistogramOpts::new(
                "sluice_llm_time_to_first_token_seconds",
                "From the start of a request to its first text chunk from the provider.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            labels,
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_llm_request_duration_seconds",
                "From the start of a request to its end, retries included.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            labels,
        )?;
        let tokens = IntCounterVec::new(
            Opts::new("sluice_llm_tokens_total", "Tokens reported by providers."),
            &["provider", "model", "direction"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "sluice_llm_retries_total",
                "Provider calls retried, by failure kind.",
            ),
            &["provider", "model", "kind"],
        )?;
        let rate_limited = IntCounterVec::new(
            Opts::new(
                "sluice_llm_rate_limited_total",
                "429 rate-limit answers received.",
            ),
            labels,
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "sluice_llm_in_flight_requests",
                "Provider calls in progress.",
            ),
            labels,
        )?;
        let with = |extra: &'static str| {
            let mut labels = FALLBACK_LABELS.to_vec();
            labels.push(extra);
            labels
        };
        let fallbacks = IntCounterVec::new(
            Opts::new(
                "sluice_llm_fallbacks_total",
                "Calls moved from a provider of the fallback list to the next, by the reason.",
            ),
            &with("reason"),
        )?;
        let answered = IntCounterVec::new(
            Opts::new(
                "sluice_llm_answered_total",
                "Calls answered, by the provider of the fallback list that answered.",
            ),
            FALLBACK_LABELS,
        )?;
        let hedges = IntCounterVec::new(
            Opts::new(
                "sluice_llm_hedges_total",
                "Hedged calls (the next provider started beside a slow one), by the hedge's outcome.",
            ),
            &with("outcome"),
        )?;
        let breaker_state = IntGaugeVec::new(
            Opts::new(
                "sluice_llm_breaker_state",
                "A fallback provider's circuit breaker: 0 closed, 1 open (skipped), 2 half-open (probed).",
            ),
            FALLBACK_LABELS,
        )?;
        let breaker_transitions = IntCounterVec::new(
            Opts::new(
                "sluice_llm_breaker_transitions_total",
                "Circuit-breaker transitions, by the state entered.",
            ),
            &with("state"),
        )?;
        for c in [
            &requests,
            &tokens,
            &retries,
            &rate_limited,
            &fallbacks,
            &answered,
            &hedges,
            &breaker_transitions,
        ] {
            registry.register(Box::new(c.clone()))?;
        }
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(breaker_state.clone()))?;
        Ok(Self {
            requests,
            ttft,
            duration,
            tokens,
            retries,
            rate_limited,
            in_flight,
            fallbacks,
            answered,
            hedges,
            breaker_state,
            breaker_transitions,
        })
    }

    /// Exports the series of `provider` and `model` at 0 before the first call: the outcomes,
    /// token directions and the failure kinds that are retried by default. Rate limits and
    /// retries are rare, and an alert on their rate needs the series to exist before them.
    pub fn provider_configured(&self, provider: &str, model: &str) {
        let labels = [provider, model];
        for outcome in CallOutcome::ALL {
            self.requests
                .with_label_values(&[provider, model, outcome.as_str()]);
        }
        for direction in ["input", "output"] {
            self.tokens.with_label_values(&[provider, model, direction]);
        }
        for kind in [
            FailureKind::Connect,
            FailureKind::Timeout,
            FailureKind::RateLimited,
            FailureKind::Server,
        ] {
            self.retries
                .with_label_values(&[provider, model, kind.as_str()]);
        }
        self.ttft.with_label_values(&labels);
        self.duration.with_label_values(&labels);
        self.rate_limited.with_label_values(&labels);
        self.in_flight.with_label_values(&labels);
    }
}
