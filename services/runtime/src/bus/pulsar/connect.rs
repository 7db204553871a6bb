//! Connecting to the broker, and what a refusal by it stands for.

use std::time::Duration;

use pulsar::{ConnectionRetryOptions, OperationRetryOptions, Pulsar, TokioExecutor};

use super::config::PulsarConfig;
use crate::bus::{
    BusError,
    pulsar_security::{Denial, denial},
};

/// Messages a connection queues for its socket before a send waits (pulsar-rs's default).
/// The queue is allocated whole when the connection opens, and a slot holds a whole
/// `BaseCommand` (a few KB): at 1,000 slots, two connections were 14 MB of an idle
/// processor's 20 MB heap, and a cluster multiplies connections by brokers. A full queue only
/// makes a send wait for the socket, which drains it at memory speed.
const OUTBOUND_QUEUE: usize = 100;

pub(super) async fn client(config: &PulsarConfig) -> Result<Pulsar<TokioExecutor>, BusError> {
    // pulsar-rs builds its rustls client on the process's default crypto provider.
    crate::install_crypto_provider();
    let mut builder = Pulsar::builder(config.url.clone(), TokioExecutor)
        .with_connection_retry_options(ConnectionRetryOptions {
            min_backoff: Duration::from_millis(10),
            max_backoff: config.connection_max_backoff,
            max_retries: config.connection_retries,
            connection_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(30),
            connection_max_idle: Duration::from_secs(300),
        })
        .with_operation_retry_options(OperationRetryOptions {
            operation_timeout: config.operation_timeout,
            retry_delay: Duration::from_millis(500),
            max_retries: Some(20),
        })
        .with_outbound_channel_size(OUTBOUND_QUEUE);
    if let Some(provider) = config.auth.provider() {
        builder = builder.with_auth_provider(provider);
    }
    if let Some(path) = &config.tls_ca_file {
        builder = builder.with_certificate_chain_file(path).map_err(|e| {
            BusError::Config(format!(
                "cannot read the TLS CA file {}: {e}",
                path.display()
            ))
        })?;
    }
    match builder.build().await {
        Ok(client) => Ok(client),
        Err(e) => {
            let operation = format!(
                "connecting to {} with {}",
                config.url,
                config.auth.describe()
            );
            Err(match explain(config, &e, &operation).await {
                Some(d) => BusError::Denied(d),
                None => BusError::Unavailable(format!("{operation}: {e}")),
            })
        }
    }
}

/// The refusal `error` stands for, if it is one: from the error itself, or, where pulsar-rs
/// reports a connection failure without its cause, from a probe of the broker.
pub(super) async fn explain(
    config: &PulsarConfig,
    error: &pulsar::Error,
    operation: &str,
) -> Option<Denial> {
    if let Some(d) = denial(error, operation) {
        return Some(d);
    }
    if super::probe::is_opaque(error) {
        return super::probe::diagnose(config, operation).await;
    }
    None
}
