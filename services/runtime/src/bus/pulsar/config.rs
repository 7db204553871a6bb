//! How to reach and use a Pulsar cluster: the bus's settings.

use std::{path::PathBuf, time::Duration};

use crate::bus::pulsar_security::PulsarAuth;

/// How to reach and use a Pulsar cluster.
#[derive(Debug, Clone)]
pub struct PulsarConfig {
    /// Broker URL, e.g. `pulsar://127.0.0.1:6650`, or `pulsar+ssl://pulsar.example.com:6651`
    /// for TLS. A host name that resolves to several brokers is tried address by address.
    pub url: String,
    /// How to authenticate, from env or files; never from the command line.
    pub auth: PulsarAuth,
    /// A PEM file of CA certificates to trust for `pulsar+ssl://` besides the system roots.
    pub tls_ca_file: Option<PathBuf>,
    /// Largest message sent; the broker's `maxMessageSize` (5 MiB by default) less headroom
    /// for the frame's metadata.
    pub max_message_bytes: usize,
    /// Client connection retries before pulsar-rs gives up on an operation.
    pub connection_retries: u32,
    /// Longest wait between connection retries.
    pub connection_max_backoff: Duration,
    /// Time limit for one broker operation.
    pub operation_timeout: Duration,
    /// How long a send keeps re-creating a failed producer before reporting the bus unavailable.
    pub publish_retry_budget: Duration,
    /// Longest wait between attempts to re-create a consumer.
    pub resubscribe_max_backoff: Duration,
    /// How often each consumer asks the broker whether it still knows it (see
    /// `Supervisor::alive`); one that is not known, or gets no answer, is re-created.
    pub consumer_check_every: Duration,
}

impl PulsarConfig {
    /// Defaults for a broker at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            auth: PulsarAuth::None,
            tls_ca_file: None,
            max_message_bytes: crate::bus::memory::DEFAULT_MAX_MESSAGE_BYTES,
            connection_retries: 12,
            connection_max_backoff: Duration::from_secs(5),
            operation_timeout: Duration::from_secs(30),
            publish_retry_budget: Duration::from_secs(60),
            resubscribe_max_backoff: Duration::from_secs(5),
            consumer_check_every: Duration::from_secs(5),
        }
    }
}
