//! What a client is started with ([`ClientConfig`]) and what a request may set for itself
//! ([`RequestOptions`]).

use std::time::Duration;

/// Where a client sends requests and reads responses.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The service's name, for metrics (e.g. `text-completion`).
    pub service: String,
    /// Pulsar topic URL of the service's requests.
    pub request_topic: String,
    /// Pulsar topic URL of the service's responses.
    pub response_topic: String,
    /// This instance's response subscription; unique per instance (a default is generated).
    pub subscription: String,
    /// A stream fails when no record arrives for this long.
    pub inactivity_timeout: Duration,
    /// A stream fails when it has not ended after this long.
    pub total_timeout: Duration,
    /// The service's cancel topic: a stream dropped before its end publishes a cancel there
    /// (see [`crate::cancel`]). `None`: dropped streams are not cancelled.
    pub cancel_topic: Option<String>,
    /// How long a stream that may have lost records (the broker dropped records of the
    /// producer its last record came from) may stay quiet before it ends as lost.
    pub loss_grace: Duration,
    /// How long [`RequestClient::start`] keeps trying while the broker cannot serve its
    /// topics yet (a restart, bookies not ready: `BusError::Unavailable`); a refusal ends
    /// it at once.
    ///
    /// [`RequestClient::start`]: super::RequestClient::start
    pub start_wait: Duration,
}

impl ClientConfig {
    /// Defaults: a fresh subscription name, 120 s inactivity, 600 s total, 120 s start wait.
    pub fn new(
        service: impl Into<String>,
        request_topic: impl Into<String>,
        response_topic: impl Into<String>,
    ) -> Self {
        let service = service.into();
        Self {
            subscription: format!("sluice-client-{service}-{}", uuid::Uuid::new_v4().simple()),
            service,
            request_topic: request_topic.into(),
            response_topic: response_topic.into(),
            inactivity_timeout: Duration::from_secs(120),
            total_timeout: Duration::from_secs(600),
            cancel_topic: None,
            loss_grace: DEFAULT_LOSS_GRACE,
            start_wait: Duration::from_secs(120),
        }
    }

    /// Whether a client with this configuration reads its service exactly as one with
    /// `other` would: every setting but the metrics label and the subscription's name, which
    /// only say whose client it is. Written field by field, so that a setting added later
    /// is compared (or consciously left out) rather than shared by accident.
    pub fn reads_as(&self, other: &ClientConfig) -> bool {
        let ClientConfig {
            service: _,
            subscription: _,
            request_topic,
            response_topic,
            inactivity_timeout,
            total_timeout,
            cancel_topic,
            loss_grace,
            start_wait,
        } = self;
        *request_topic == other.request_topic
            && *response_topic == other.response_topic
            && *inactivity_timeout == other.inactivity_timeout
            && *total_timeout == other.total_timeout
            && *cancel_topic == other.cancel_topic
            && *loss_grace == other.loss_grace
            && *start_wait == other.start_wait
    }
}

/// Default [`ClientConfig::loss_grace`]: longer than the pauses of a streaming answer, far
/// shorter than the inactivity timeout a lost terminal record used to cost.
pub const DEFAULT_LOSS_GRACE: Duration = Duration::from_secs(5);

/// Per-request options.
#[derive(Debug, Clone, Default)]
pub struct RequestOptions {
    /// The correlation id; a fresh UUID when `None`.
    pub id: Option<String>,
    /// W3C trace context to carry to the processor.
    pub traceparent: Option<String>,
    /// The id of the request this one is made for (see `sluice_schema::properties::ORIGIN`):
    /// a processor's [`crate::processor::RequestContext::origin`].
    pub origin: Option<String>,
    /// The API key's name the request is billed to (see `sluice_schema::properties::KEY`).
    pub key: Option<String>,
    /// The gateway's seal of `key` (see [`crate::billing`]): made by the gateway, forwarded
    /// unchanged by a processor calling on its caller's behalf.
    pub key_seal: Option<String>,
    /// Overrides the client's inactivity timeout.
    pub inactivity_timeout: Option<Duration>,
    /// Overrides the client's total timeout.
    pub total_timeout: Option<Duration>,
}
