//! The Apache Pulsar bus (crate `pulsar`, pulsar-rs).
//!
//! What this file copes with, each measured or read in pulsar-rs 6.9:
//! - pulsar-rs never sets TCP_NODELAY, and a connection that writes small frames back to
//!   back while its peer sends nothing back stalls on Nagle plus delayed ACK (~40 ms). So
//!   consumers and producers use two separate clients, hence two connections: the consumer
//!   connection writes acks and flow permits, the producer connection writes sends that the
//!   broker answers with receipts.
//! - After an outage longer than the client's retry budget a consumer's stream ends and a
//!   producer's sends fail for good. A supervisor task re-creates consumers; publishers drop
//!   a failed producer and create a new one, retrying within a budget.
//! - Producers use `block_queue_if_full`, so a burst waits instead of failing with SlowDown.
//! - A message over the broker's frame limit makes the connection close and the client retry
//!   forever, so sizes are checked before sending.
//! - The consumer engine handles acks and incoming messages in one loop: when its delivery
//!   channel is full, acks wait behind it. The supervisor keeps reading into a bounded
//!   buffer, and while draining keeps reading, so that the acks of in-flight requests still
//!   go out. A Shared subscription's broker keeps sending a draining consumer messages (its
//!   permits stand): those it did not hand out are released to the other consumers, the
//!   ones received before the drain at once, later ones in batches a short delay apart
//!   (a consumer alone on its subscription would otherwise get each one straight back, in a
//!   loop, for its whole drain).
//! - pulsar-rs hides the broker's redelivery count, so redeliveries are counted per process.
//! - A refusal by the broker (credentials, certificate, permission on a topic) is a
//!   [`Denial`], reported at once with its cause and topic; the retry loops above are for
//!   outages only. See [`super::pulsar_security`].
//!
//! This file must never log payloads or properties' values: they carry prompts.
//!
//! [`Denial`]: super::pulsar_security::Denial

mod config;
mod connect;
mod consume;
mod probe;
mod publish;

pub use config::PulsarConfig;
pub use consume::{NON_PERSISTENT_MIN_PERMITS, flow_permits};

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use pulsar::{Pulsar, TokioExecutor};
use tokio::time::Instant;
use tracing::warn;

use crate::bus::{Bus, BusError, Publisher, SubscribeOptions, Subscription};
use crate::{backoff::Backoff, lock};
use connect::client;
use consume::ConsumerSpec;
use publish::PulsarPublisher;

/// The Pulsar bus. Cheap to clone.
#[derive(Clone)]
pub struct PulsarBus {
    config: Arc<PulsarConfig>,
    consumers: Pulsar<TokioExecutor>,
    producers: Pulsar<TokioExecutor>,
    publishers: Arc<Mutex<HashMap<String, Arc<PulsarPublisher>>>>,
}

impl std::fmt::Debug for PulsarBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarBus")
            .field("url", &self.config.url)
            .finish()
    }
}

impl PulsarBus {
    /// Connects, retrying until the broker answers or `wait` has passed: a processor may
    /// start before its broker in Kubernetes or docker-compose. Credentials that would go
    /// over plaintext beyond loopback are refused first
    /// ([`PulsarConfig::check_credentials_transport`]).
    pub async fn connect(config: PulsarConfig, wait: Duration) -> Result<Self, BusError> {
        config.check_credentials_transport()?;
        let deadline = Instant::now() + wait;
        let mut backoff = Backoff::new(config.resubscribe_max_backoff);
        loop {
            match Self::try_connect(&config).await {
                Ok(bus) => return Ok(bus),
                // Refused credentials or an untrusted certificate: waiting will not help,
                // and an operator wants to hear it now, not after the connect wait.
                Err(e @ (BusError::Denied(_) | BusError::Config(_))) => return Err(e),
                Err(e) if Instant::now() + backoff.peek() < deadline => {
                    warn!(error = %e, "pulsar not reachable yet; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn try_connect(config: &PulsarConfig) -> Result<Self, BusError> {
        // Two clients, so consuming and producing never share a connection (see module doc).
        let consumers = client(config).await?;
        let producers = client(config).await?;
        Ok(Self {
            config: Arc::new(config.clone()),
            consumers,
            producers,
            publishers: Arc::default(),
        })
    }
}

#[async_trait]
impl Bus for PulsarBus {
    async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError> {
        let mut map = lock(&self.publishers);
        let publisher = map
            .entry(topic.to_owned())
            .or_insert_with(|| {
                Arc::new(PulsarPublisher::new(
                    topic,
                    self.producers.clone(),
                    self.config.clone(),
                ))
            })
            .clone();
        Ok(publisher)
    }

    async fn subscribe(
        &self,
        topic: &str,
        subscription: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BusError> {
        consume::subscribe(
            &self.consumers,
            &self.config,
            ConsumerSpec {
                topic: topic.to_owned(),
                subscription: subscription.to_owned(),
                options,
            },
        )
        .await
    }

    fn max_message_bytes(&self) -> usize {
        self.config.max_message_bytes
    }

    fn keeps_messages(&self) -> bool {
        true
    }
}
