//! Publishing: a producer per topic, re-created after an outage within a budget.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use pulsar::{Producer, ProducerOptions, Pulsar, TokioExecutor};
use tokio::time::Instant;
use tracing::warn;

use super::{config::PulsarConfig, connect::explain};
use crate::backoff::Backoff;
use crate::bus::{
    BusError, Message, Publisher, Receipt, check_size,
    pulsar_security::{Denial, denial},
};

pub(super) struct PulsarPublisher {
    topic: String,
    client: Pulsar<TokioExecutor>,
    config: Arc<PulsarConfig>,
    // A tokio Mutex: it is held across the awaits that queue a message, which is what keeps
    // concurrent sends on one topic in a single order and makes a full queue back-pressure
    // every sender.
    producer: tokio::sync::Mutex<ProducerSlot>,
    /// The generation of the latest producer a receipt failed on for an outage (0: none).
    /// pulsar-rs resends a pending message itself while it re-creates the producer; a receipt
    /// that still fails (not acknowledged within the operation timeout) means that producer
    /// did not recover in time, and it can stay so: seen after a broker's SIGKILL, a partition
    /// producer whose later messages were never acknowledged either, so every request routed
    /// to that partition waited out the timeout. The next send replaces such a producer (a
    /// fresh lookup of every partition's owner).
    lost_receipt: Arc<AtomicU64>,
}

/// A publisher's producer and which one it is.
#[derive(Default)]
struct ProducerSlot {
    producer: Option<Producer<TokioExecutor>>,
    /// Counts the producers created; the current one's number.
    generation: u64,
}

impl PulsarPublisher {
    /// A publisher of `topic` whose producer is made at its first send.
    pub(super) fn new(
        topic: &str,
        client: Pulsar<TokioExecutor>,
        config: Arc<PulsarConfig>,
    ) -> Self {
        Self {
            topic: topic.to_owned(),
            client,
            config,
            producer: tokio::sync::Mutex::new(ProducerSlot::default()),
            lost_receipt: Arc::new(AtomicU64::new(0)),
        }
    }

    async fn denied(&self, e: &pulsar::Error) -> Option<Denial> {
        explain(&self.config, e, &format!("producing to {}", self.topic)).await
    }

    async fn create(&self) -> Result<Producer<TokioExecutor>, pulsar::Error> {
        self.client
            .producer()
            .with_topic(self.topic.clone())
            .with_options(ProducerOptions {
                block_queue_if_full: true,
                ..ProducerOptions::default()
            })
            .build()
            .await
    }
}

#[async_trait]
impl Publisher for PulsarPublisher {
    async fn send(&self, message: Message) -> Result<Receipt, BusError> {
        check_size(&message, self.config.max_message_bytes)?;
        let deadline = Instant::now() + self.config.publish_retry_budget;
        let mut backoff = Backoff::new(Duration::from_secs(2));
        let mut slot = self.producer.lock().await;
        if slot.producer.is_some() && self.lost_receipt.load(Ordering::Acquire) == slot.generation {
            warn!(topic = %self.topic,
                  "re-creating the producer: the broker did not acknowledge a message it sent");
            slot.producer = None;
        }
        loop {
            let failure = match slot.producer.as_mut() {
                None => match self.create().await {
                    Ok(p) => {
                        slot.producer = Some(p);
                        slot.generation += 1;
                        continue;
                    }
                    // A refusal is not an outage: no retry budget, the caller hears it now
                    // (a processor hands the request back and says why on /readyz).
                    Err(e) => match self.denied(&e).await {
                        Some(d) => return Err(BusError::Denied(d)),
                        None => format!("creating producer: {e}"),
                    },
                },
                // Built per attempt from the cheaply cloned `Bytes`: one payload copy per
                // send, and the original is still at hand for a retry.
                Some(producer) => match producer
                    .send_non_blocking(pulsar::producer::Message {
                        payload: message.payload.to_vec(),
                        properties: message
                            .properties
                            .iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect(),
                        partition_key: message.key.clone(),
                        ..Default::default()
                    })
                    .await
                {
                    Ok(receipt) => {
                        let topic = self.topic.clone();
                        let (lost_receipt, generation) =
                            (self.lost_receipt.clone(), slot.generation);
                        return Ok(Receipt::new(async move {
                            receipt.await.map(|_| ()).map_err(|e| {
                                match denial(&e, format!("producing to {topic}")) {
                                    Some(d) => BusError::Denied(d),
                                    None => {
                                        lost_receipt.fetch_max(generation, Ordering::AcqRel);
                                        BusError::Unavailable(format!("send receipt: {e}"))
                                    }
                                }
                            })
                        }));
                    }
                    Err(e) => {
                        // The producer may be beyond repair (its reconnect budget ran out):
                        // drop it and build a fresh one on the next attempt.
                        slot.producer = None;
                        if let Some(d) = self.denied(&e).await {
                            return Err(BusError::Denied(d));
                        }
                        format!("sending: {e}")
                    }
                },
            };
            if Instant::now() + backoff.peek() >= deadline {
                return Err(BusError::Unavailable(format!(
                    "publishing to {} failed for {:?}: {failure}",
                    self.topic, self.config.publish_retry_budget
                )));
            }
            warn!(topic = %self.topic, error = %failure, "publish failed; retrying");
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    fn topic(&self) -> &str {
        &self.topic
    }

    async fn open(&self) -> Result<(), BusError> {
        let mut slot = self.producer.lock().await;
        if slot.producer.is_none() {
            match self.create().await {
                Ok(p) => {
                    slot.producer = Some(p);
                    slot.generation += 1;
                }
                Err(e) => {
                    return Err(match self.denied(&e).await {
                        Some(d) => BusError::Denied(d),
                        None => BusError::Unavailable(format!(
                            "creating a producer for {}: {e}",
                            self.topic
                        )),
                    });
                }
            }
        }
        Ok(())
    }
}
