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

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use pulsar::{
    ConnectionRetryOptions, Consumer, ConsumerOptions, OperationRetryOptions, Producer,
    ProducerOptions, Pulsar, TokioExecutor, consumer::InitialPosition,
    message::proto::MessageIdData, message::proto::command_subscribe::SubType,
};
use tokio::{
    sync::{mpsc, oneshot},
    time::Instant,
};
use tracing::{debug, error, info, warn};

use super::{
    Bus, BusError, Delivery, Link, Message, Origin, Position, Publisher, Receipt, Settle,
    Settlement, StartPosition, SubscribeOptions, Subscription, SubscriptionKind, check_size,
    pulsar_security::{Denial, PulsarAuth, denial},
};
use crate::{backoff::Backoff, lock};

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
    /// Send `auth`'s token or OAuth2 credentials over a plaintext `pulsar://` URL (or to an
    /// `http://` OAuth2 issuer) beyond loopback. Off: [`PulsarBus::connect`] refuses (see
    /// [`super::pulsar_security::plaintext_beyond_loopback`]).
    pub allow_plaintext_credentials: bool,
}

impl PulsarConfig {
    /// Defaults for a broker at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            auth: PulsarAuth::None,
            tls_ca_file: None,
            max_message_bytes: super::memory::DEFAULT_MAX_MESSAGE_BYTES,
            connection_retries: 12,
            connection_max_backoff: Duration::from_secs(5),
            operation_timeout: Duration::from_secs(30),
            publish_retry_budget: Duration::from_secs(60),
            resubscribe_max_backoff: Duration::from_secs(5),
            consumer_check_every: Duration::from_secs(5),
            allow_plaintext_credentials: false,
        }
    }

    /// Refuses credentials that would cross the network in the clear: a token or OAuth2
    /// access token to a `pulsar://` broker, an OAuth2 client secret to an `http://` issuer,
    /// beyond loopback, unless [`PulsarConfig::allow_plaintext_credentials`].
    pub fn check_credentials_transport(&self) -> Result<(), BusError> {
        let allowed = self.allow_plaintext_credentials;
        let refused = |url: &str, role: &str, what: &str| {
            super::pulsar_security::refuse_plaintext_credentials(url, role, what, allowed)
                .map_err(BusError::Config)
        };
        match &self.auth {
            PulsarAuth::None => Ok(()),
            PulsarAuth::OAuth2(oauth2) => {
                refused(
                    &oauth2.issuer_url,
                    "the OAuth2 issuer",
                    &format!("the client secret of OAuth2 client {:?}", oauth2.client_id),
                )?;
                refused(&self.url, "the broker", "the OAuth2 access token")
            }
            auth => refused(&self.url, "the broker", &auth.describe()),
        }
    }
}

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

/// Messages a connection queues for its socket before a send waits (pulsar-rs's default).
/// The queue is allocated whole when the connection opens, and a slot holds a whole
/// `BaseCommand` (a few KB): at 1,000 slots, two connections were 14 MB of an idle
/// processor's 20 MB heap, and a cluster multiplies connections by brokers. A full queue only
/// makes a send wait for the socket, which drains it at memory speed.
const OUTBOUND_QUEUE: usize = 100;

async fn client(config: &PulsarConfig) -> Result<Pulsar<TokioExecutor>, BusError> {
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
async fn explain(config: &PulsarConfig, error: &pulsar::Error, operation: &str) -> Option<Denial> {
    if let Some(d) = denial(error, operation) {
        return Some(d);
    }
    if super::pulsar_probe::is_opaque(error) {
        return super::pulsar_probe::diagnose(config, operation).await;
    }
    None
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
                Arc::new(PulsarPublisher {
                    topic: topic.to_owned(),
                    client: self.producers.clone(),
                    config: self.config.clone(),
                    producer: tokio::sync::Mutex::new(ProducerSlot::default()),
                    lost_receipt: Arc::new(AtomicU64::new(0)),
                })
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
        let spec = ConsumerSpec {
            topic: topic.to_owned(),
            subscription: subscription.to_owned(),
            options,
        };
        // Subscribe once up front so that configuration errors (an exclusive subscription
        // already taken, a missing namespace) reach the caller instead of a retry loop.
        let consumer = spec.build(&self.consumers, &self.config).await?;
        let (deliveries_tx, deliveries_rx) = mpsc::channel(spec.options.prefetch as usize);
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let connected = Link::new(true);
        let supervisor = Supervisor {
            client: self.consumers.clone(),
            config: self.config.clone(),
            spec,
            deliveries: deliveries_tx,
            control_tx: control_tx.clone(),
            control: control_rx,
            connected: connected.clone(),
            redeliveries: RedeliveryTracker::new(100_000),
            producers: ProducerNames::default(),
            topics: ProducerNames::default(),
            max_backoff: self.config.resubscribe_max_backoff,
        };
        tokio::spawn(supervisor.run(consumer));
        Ok(Box::new(PulsarSubscription {
            deliveries: deliveries_rx,
            control: control_tx,
            connected,
            closed: false,
        }))
    }

    fn max_message_bytes(&self) -> usize {
        self.config.max_message_bytes
    }

    fn keeps_messages(&self) -> bool {
        true
    }
}

struct PulsarPublisher {
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

struct ConsumerSpec {
    topic: String,
    subscription: String,
    options: SubscribeOptions,
}

impl ConsumerSpec {
    async fn build(
        &self,
        client: &Pulsar<TokioExecutor>,
        config: &PulsarConfig,
    ) -> Result<Consumer<Vec<u8>, TokioExecutor>, BusError> {
        let sub_type = match self.options.kind {
            SubscriptionKind::Shared => SubType::Shared,
            SubscriptionKind::Exclusive => SubType::Exclusive,
        };
        let (initial_position, start_message_id) = match self.options.start {
            StartPosition::Earliest => (InitialPosition::Earliest, None),
            StartPosition::Latest => (InitialPosition::Latest, None),
            // A non-durable subscription from a message id: the broker keeps no cursor for
            // it, so a re-created consumer starts from the same place again (its reader skips
            // what it already had).
            StartPosition::At(p) => (
                InitialPosition::Earliest,
                Some(MessageIdData {
                    ledger_id: p.ledger,
                    entry_id: p.entry,
                    partition: Some(p.partition),
                    batch_index: Some(p.batch),
                    ..MessageIdData::default()
                }),
            ),
            // Pulsar's "earliest" message id (-1:-1): a non-durable subscription needs an id
            // to start from.
            StartPosition::Replay => (
                InitialPosition::Earliest,
                Some(MessageIdData {
                    ledger_id: u64::MAX,
                    entry_id: u64::MAX,
                    partition: Some(-1),
                    batch_index: Some(-1),
                    ..MessageIdData::default()
                }),
            ),
        };
        let replay = self.options.start == StartPosition::Replay;
        let permits = flow_permits(&self.topic, self.options.prefetch);
        let mut builder = client
            .consumer()
            .with_topic(self.topic.clone())
            .with_subscription(self.subscription.clone())
            .with_subscription_type(sub_type)
            .with_batch_size(permits)
            .with_options(ConsumerOptions {
                durable: Some(start_message_id.is_none()),
                read_compacted: replay.then_some(true),
                start_message_id,
                receiver_queue_size: Some(permits),
                initial_position,
                ..ConsumerOptions::default()
            });
        if let Some(name) = &self.options.consumer_name {
            builder = builder.with_consumer_name(name.clone());
        }
        let e = match builder.build().await {
            Ok(consumer) => return Ok(consumer),
            Err(e) => e,
        };
        let operation = format!("subscribing {:?} to {}", self.subscription, self.topic);
        if let Some(d) = explain(config, &e, &operation).await {
            return Err(BusError::Denied(d));
        }
        let text = e.to_string();
        Err(
            if text.contains("Exclusive consumer is already connected")
                || text.contains("ConsumerBusy")
            {
                BusError::ExclusiveTaken(self.subscription.clone())
            } else {
                BusError::Unavailable(format!("{operation}: {text}"))
            },
        )
    }
}

/// The least number of flow permits a consumer of a non-persistent topic asks for, as
/// TrustGraph's consumers do (their receiver queue is 1,000).
pub const NON_PERSISTENT_MIN_PERMITS: u32 = 1000;

/// How long a draining consumer holds a message that arrived after the drain began before
/// releasing it to the broker for another consumer. Not at once: the broker may send it
/// straight back (always, to a consumer alone on its subscription), and each round costs a
/// redelivery; one second bounds that to one round per message per second.
const RELEASE_PARKED_AFTER: Duration = Duration::from_secs(1);

/// The flow permits (pulsar-rs's batch size, which is also its receiver queue) for a consumer
/// that wants `prefetch` messages ahead.
///
/// On a persistent topic a message the consumer has no permit for waits in the backlog, so
/// permits near the consumer's concurrency keep one replica from hoarding a Shared
/// subscription's backlog. On a non-persistent topic the broker DROPS what arrives for a
/// consumer with no permits left, and pulsar-rs tops permits up only once fewer than half of
/// its batch size remain: with permits equal to the concurrency, two earlier requests left 62
/// permits for a burst of 64, and two requests were lost (issue #13). Twice the prefetch plus
/// one keeps at least `prefetch + 1` permits at the broker whenever the consumer is caught up,
/// so a burst up to the consumer's concurrency, after any history, always has permits.
pub fn flow_permits(topic: &str, prefetch: u32) -> u32 {
    if topic.starts_with("non-persistent://") {
        prefetch
            .saturating_mul(2)
            .saturating_add(1)
            .max(NON_PERSISTENT_MIN_PERMITS)
    } else {
        prefetch.max(1)
    }
}

enum Control {
    /// Settles a message of `topic`: the partition's own topic name for a partitioned topic,
    /// because pulsar-rs keys a partitioned topic's consumers by partition and refuses an
    /// ack addressed to the parent topic ("no consumer for topic"), which left every request
    /// of a partitioned topic unacked and redelivered for ever.
    Settle(Arc<str>, MessageIdData, Settlement),
    Pause,
    /// Re-create the consumer (see [`Subscription::renew`]), for the reason given, as asked
    /// at that instant: a request older than the consumer is not about it.
    Renew(String, Instant),
    Close(oneshot::Sender<()>),
    Unsubscribe(oneshot::Sender<()>),
}

struct PulsarSubscription {
    deliveries: mpsc::Receiver<Delivery>,
    control: mpsc::UnboundedSender<Control>,
    connected: Link,
    closed: bool,
}

impl PulsarSubscription {
    async fn shut(&mut self, make: fn(oneshot::Sender<()>) -> Control) {
        self.closed = true;
        let (tx, rx) = oneshot::channel();
        if self.control.send(make(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

#[async_trait]
impl Subscription for PulsarSubscription {
    async fn next(&mut self) -> Option<Result<Delivery, BusError>> {
        if self.closed {
            return None;
        }
        self.deliveries.recv().await.map(Ok)
    }

    async fn close(mut self: Box<Self>) {
        self.shut(Control::Close).await;
    }

    async fn unsubscribe(mut self: Box<Self>) {
        self.shut(Control::Unsubscribe).await;
    }

    fn link(&self) -> Link {
        self.connected.clone()
    }

    fn renew(&mut self, why: &str) -> bool {
        self.control
            .send(Control::Renew(why.to_owned(), Instant::now()))
            .is_ok()
    }

    fn pause(&mut self) {
        // The consumer stays attached so that the acks of work in flight go out; see the
        // module doc.
        let _ = self.control.send(Control::Pause);
        // Received but never handed out: dropping an unsettled delivery releases it to the
        // broker (a nack), instead of holding it here until the close.
        while let Ok(undelivered) = self.deliveries.try_recv() {
            drop(undelivered);
        }
    }
}

impl Drop for PulsarSubscription {
    fn drop(&mut self) {
        if !self.closed {
            let (tx, _rx) = oneshot::channel();
            let _ = self.control.send(Control::Close(tx));
        }
    }
}

struct PulsarSettle {
    control: mpsc::UnboundedSender<Control>,
    topic: Arc<str>,
    id: MessageIdData,
}

impl Settle for PulsarSettle {
    fn settle(self: Box<Self>, settlement: Settlement) {
        // Fails only once the supervisor has stopped, when the consumer is closed and the
        // broker redelivers the message anyway.
        let _ = self
            .control
            .send(Control::Settle(self.topic, self.id, settlement));
    }
}

/// Counts how often this process has seen each message, because pulsar-rs does not pass on
/// the broker's redelivery count. Bounded: the oldest entries are forgotten first.
struct RedeliveryTracker {
    seen: HashMap<(u64, u64, i32, i32), u32>,
    order: VecDeque<(u64, u64, i32, i32)>,
    capacity: usize,
}

impl RedeliveryTracker {
    fn new(capacity: usize) -> Self {
        Self {
            seen: HashMap::new(),
            order: VecDeque::new(),
            capacity,
        }
    }

    fn key(id: &MessageIdData) -> (u64, u64, i32, i32) {
        (
            id.ledger_id,
            id.entry_id,
            id.partition.unwrap_or(-1),
            id.batch_index.unwrap_or(-1),
        )
    }

    /// Records a delivery and returns how many times the message was seen before.
    fn observe(&mut self, id: &MessageIdData) -> u32 {
        let key = Self::key(id);
        if let Some(count) = self.seen.get_mut(&key) {
            *count += 1;
            return *count;
        }
        if self.order.len() >= self.capacity
            && let Some(old) = self.order.pop_front()
        {
            self.seen.remove(&old);
        }
        self.seen.insert(key, 0);
        self.order.push_back(key);
        0
    }

    fn forget(&mut self, id: &MessageIdData) {
        // The order queue keeps the key until it ages out; removal from the map is what
        // matters, and a stale key in the queue only evicts nothing.
        self.seen.remove(&Self::key(id));
    }
}

/// Where a message id stands in its topic's order.
fn position(id: &MessageIdData) -> (u64, u64, i32) {
    (id.ledger_id, id.entry_id, id.batch_index.unwrap_or(-1))
}

/// The acks of a subscriber that acks every delivery in the order it came
/// ([`SubscribeOptions::acks_in_order`]), on an exclusive subscription: a run of them is
/// settled by one cumulative ack per topic (partition) for the highest of the run, as the
/// broker then handles one command instead of one per message. A nack ends this for the
/// consumer's life: a cumulative ack past a nacked message would ack it too.
struct InOrderAcks {
    enabled: bool,
    /// The highest ack per topic not yet sent.
    last: Vec<(Arc<str>, MessageIdData)>,
    /// How many acks `last` stands for.
    held: usize,
}

impl InOrderAcks {
    /// The most acks held before they go out whatever comes next: what a crash of this
    /// process makes the broker deliver again (and the subscriber skip) stays small.
    const MAX_HELD: usize = 256;

    fn new(enabled: bool) -> Self {
        Self {
            enabled,
            last: Vec::new(),
            held: 0,
        }
    }

    fn full(&self) -> bool {
        self.held >= Self::MAX_HELD
    }

    /// Keeps an ack to send cumulatively; gives back a settlement to apply on its own.
    fn take(
        &mut self,
        topic: Arc<str>,
        id: MessageIdData,
        settlement: Settlement,
    ) -> Option<(Arc<str>, MessageIdData, Settlement)> {
        if !self.enabled {
            return Some((topic, id, settlement));
        }
        if settlement == Settlement::Nack {
            self.enabled = false;
            return Some((topic, id, settlement));
        }
        match self.last.iter_mut().find(|(t, _)| *t == topic) {
            // The highest, not the latest: a consumer that pulsar-rs re-attached, or a reader
            // started again, gets earlier messages again, and everything up to the highest
            // one acked was acked once already.
            Some((_, last)) => {
                if position(&id) > position(last) {
                    *last = id;
                }
            }
            None => self.last.push((topic, id)),
        }
        self.held += 1;
        None
    }

    fn due(&self) -> bool {
        !self.last.is_empty()
    }

    fn drain(&mut self) -> std::vec::Drain<'_, (Arc<str>, MessageIdData)> {
        self.held = 0;
        self.last.drain(..)
    }
}

struct Supervisor {
    client: Pulsar<TokioExecutor>,
    config: Arc<PulsarConfig>,
    spec: ConsumerSpec,
    deliveries: mpsc::Sender<Delivery>,
    control_tx: mpsc::UnboundedSender<Control>,
    control: mpsc::UnboundedReceiver<Control>,
    connected: Link,
    redeliveries: RedeliveryTracker,
    producers: ProducerNames,
    /// The topic of each message, shared: one name per partition.
    topics: ProducerNames,
    max_backoff: Duration,
}

/// Names seen on a subscription (producers, partitions), shared so that each delivery's
/// [`Origin`] and settle handle cost a reference count instead of a string copy. Bounded: a
/// long-lived subscription sees every producer its topic ever had.
#[derive(Default)]
struct ProducerNames(HashMap<String, Arc<str>>);

impl ProducerNames {
    const CAPACITY: usize = 4096;

    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.0.get(name) {
            return known.clone();
        }
        if self.0.len() >= Self::CAPACITY {
            // Forgetting costs only an allocation per name until it is seen again.
            self.0.clear();
        }
        let shared: Arc<str> = Arc::from(name);
        self.0.insert(name.to_owned(), shared.clone());
        shared
    }
}

enum Exit {
    Stop,
    Resubscribe,
}

/// What a consumer's check found (see `Supervisor::alive`).
enum Health {
    /// The broker owning its topic serves it, with enough flow permits.
    Served,
    /// The broker does not know it, or does not answer: re-create it now.
    Dead(String),
    /// The broker knows it, but it cannot be receiving what its topic gets: it holds too few
    /// flow permits, or it is attached to a broker that does not own its topic. Re-created
    /// when two checks in a row find this (the first may see a message or a topic move on
    /// its way).
    Suspect(String),
}

/// The broker's permit count as it means it: a Java `int` that may be negative (more
/// messages sent than granted), sign-extended into the protocol's unsigned field, so a
/// negative count arrives as a number near 2^64; reinterpreting the bits gives it back.
fn signed_permits(raw: u64) -> i64 {
    raw as i64
}

/// How long a consumer's liveness check waits for the broker's answer.
const CONSUMER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a consumer's check waits for the lookup of its topic's owner.
const OWNER_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

impl Supervisor {
    async fn run(mut self, first: Consumer<Vec<u8>, TokioExecutor>) {
        let mut consumer = Some(first);
        let mut settles: Vec<(Arc<str>, MessageIdData, Settlement)> = Vec::new();
        let mut paused = false;
        loop {
            let mut current = match consumer.take() {
                Some(c) => c,
                None => match self.resubscribe(&mut settles, &mut paused).await {
                    Some(c) => c,
                    None => return,
                },
            };
            self.connected.set(true);
            for (topic, id, settlement) in settles.drain(..) {
                self.apply(&mut current, &topic, id, settlement).await;
            }
            let exit = self.serve(&mut current, &mut paused).await;
            self.connected.set(false);
            match exit {
                Exit::Stop => return,
                Exit::Resubscribe => {
                    // Bounded: a consumer whose engine is stuck may never answer the close;
                    // dropping it is all that is left to do then.
                    let _ = tokio::time::timeout(CONSUMER_CHECK_TIMEOUT, current.close()).await;
                    info!(topic = %self.spec.topic, subscription = %self.spec.subscription,
                          "consumer closed; re-subscribing");
                }
            }
        }
    }

    /// Sends the acks `acks` holds: one cumulative ack per topic (partition), for the highest
    /// message acked there.
    async fn flush_acks(
        &mut self,
        consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
        acks: &mut InOrderAcks,
    ) {
        for (topic, id) in acks.drain() {
            if let Err(e) = consumer.cumulative_ack_with_id(&topic, id).await {
                warn!(topic = %topic, error = %e, "acking messages failed");
            }
        }
    }

    async fn apply(
        &mut self,
        consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
        topic: &str,
        id: MessageIdData,
        settlement: Settlement,
    ) {
        let result = match settlement {
            Settlement::Ack => {
                self.redeliveries.forget(&id);
                consumer.ack_with_id(topic, id).await
            }
            Settlement::Nack => consumer.nack_with_id(topic, id).await,
        };
        if let Err(e) = result {
            // The broker redelivers what was not acked once the consumer is re-created.
            warn!(topic = %topic, error = %e, ?settlement, "settling a message failed");
        }
    }

    /// Whether the broker still serves `consumer`: it answers a stats request for it, with
    /// enough flow permits, and it is the broker that owns the consumer's topic. `batch` is
    /// the consumer's flow permits (pulsar-rs's batch size).
    ///
    /// Why the stats request: after a broker's SIGKILL, pulsar-rs 6.9 can be left with a
    /// consumer the broker does not know (measured on the secured cluster: a processor's
    /// request consumer, a processor's cancel consumer, a gateway's response consumer, each
    /// missing from the topic's subscriptions for good) while its message stream neither
    /// yields nor ends, so nothing else would ever re-create it: on a shared subscription
    /// the replica takes no more requests, on a response subscription the client hears
    /// nothing. The broker answers a stats request for a consumer id it does not know with
    /// `ConsumerNotFound`.
    ///
    /// Why the owner: after three namespace unloads in a row under load, a gateway's response
    /// consumer was missing from its topic's subscriptions on the owning broker for good while
    /// the broker its connection led to still answered its stats requests (measured on
    /// TrustGraph's mapping, 2026-11-26: every later request timed out, for minutes, until a
    /// broker's SIGKILL made pulsar-rs reconnect it). A fresh lookup names the owner; a
    /// consumer connected elsewhere receives nothing.
    ///
    /// Why the permits: pulsar-rs tops a consumer's permits up to its batch size whenever
    /// fewer than half are left, so an idle consumer in step with its broker has at least half
    /// the batch granted. Fewer means the two counts drifted apart, and pulsar-rs, believing it
    /// has enough, never asks for more: the broker drops (non-persistent) or withholds
    /// (persistent) what it has no permits for, for good.
    async fn alive(&self, consumer: &mut Consumer<Vec<u8>, TokioExecutor>, batch: u32) -> Health {
        let stats = match tokio::time::timeout(CONSUMER_CHECK_TIMEOUT, consumer.get_stats()).await {
            Err(_) => {
                return Health::Dead(format!(
                    "no answer to a stats request within {CONSUMER_CHECK_TIMEOUT:?}"
                ));
            }
            Ok(Err(e)) => return Health::Dead(format!("a stats request failed: {e}")),
            Ok(Ok(stats)) => stats,
        };
        if let Some(s) = stats.iter().find(|s| s.error_code.is_some()) {
            return Health::Dead(format!(
                "the broker answered a stats request with {:?}: {}",
                s.error_code,
                s.error_message.as_deref().unwrap_or("")
            ));
        }
        let least = stats
            .iter()
            .filter_map(|s| s.available_permits)
            .map(signed_permits)
            .min();
        if let Some(permits) = least
            && permits < i64::from(batch.div_ceil(2))
        {
            return Health::Suspect(format!(
                "the broker holds {permits} flow permits for this idle consumer, which asked \
                 for {batch} and must have at least {} left: the broker drops (non-persistent \
                 topic) or withholds what it has no permits for",
                batch.div_ceil(2)
            ));
        }
        // The consumer's brokers against the topics' owners. A lookup or connection that does
        // not answer says nothing here: the stats request above just went through.
        let Ok(Ok(connected)) =
            tokio::time::timeout(OWNER_LOOKUP_TIMEOUT, consumer.connections()).await
        else {
            return Health::Served;
        };
        for topic in consumer.topics() {
            // Bounded short: the loop reads no message meanwhile, and a lookup that takes
            // longer (no broker owns the topic yet) has nothing to say here. In a task of its
            // own, left to finish when the wait gives up: a lookup connects to the owner, and
            // pulsar-rs's first connector to a broker resolves the callers that queued behind
            // it; dropped mid-connect, it would leave them (the consumer's own reconnect, the
            // next subscribe) waiting for good.
            let client = self.client.clone();
            let lookup = tokio::spawn({
                let topic = topic.clone();
                async move { client.lookup_topic(topic).await }
            });
            if let Ok(Ok(Ok(owner))) = tokio::time::timeout(OWNER_LOOKUP_TIMEOUT, lookup).await
                && !connected.contains(&owner.url)
            {
                let connected: Vec<&str> = connected.iter().map(|u| u.as_str()).collect();
                return Health::Suspect(format!(
                    "{topic} is owned by {}, but this consumer is connected to {}: it \
                     receives nothing",
                    owner.url,
                    connected.join(", ")
                ));
            }
        }
        Health::Served
    }

    /// Re-creates the consumer with backoff. Returns `None` when told to stop meanwhile.
    async fn resubscribe(
        &mut self,
        settles: &mut Vec<(Arc<str>, MessageIdData, Settlement)>,
        paused: &mut bool,
    ) -> Option<Consumer<Vec<u8>, TokioExecutor>> {
        let mut backoff = Backoff::new(self.max_backoff);
        loop {
            match self.spec.build(&self.client, &self.config).await {
                Ok(c) => return Some(c),
                Err(BusError::Denied(d)) => {
                    // Not silent: /readyz names the refusal until it is lifted (a rotated
                    // token file, a new grant), and every attempt is logged as an error.
                    error!(topic = %self.spec.topic, cause = d.cause.as_str(), error = %d,
                           "re-subscribing refused by the broker");
                    self.connected.set_down(d.to_string());
                }
                Err(e) => warn!(topic = %self.spec.topic, error = %e, "re-subscribing failed"),
            }
            let sleep = tokio::time::sleep(backoff.next_delay());
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    () = &mut sleep => break,
                    ctl = self.control.recv() => match ctl {
                        Some(Control::Settle(topic, id, s)) => settles.push((topic, id, s)),
                        Some(Control::Pause) => *paused = true,
                        // Being re-created already.
                        Some(Control::Renew(..)) => {}
                        Some(Control::Close(done) | Control::Unsubscribe(done)) => {
                            let _ = done.send(());
                            return None;
                        }
                        None => return None,
                    },
                }
            }
        }
    }

    async fn serve(
        &mut self,
        consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
        paused: &mut bool,
    ) -> Exit {
        let made = Instant::now();
        let limit = self.spec.options.prefetch as usize;
        // Parked messages (arrived while draining) are never handed out: they are released
        // to the broker RELEASE_PARKED_AFTER after the first of a batch arrived, or with the
        // consumer on close. The bound keeps a draining replica from pulling in the backlog.
        let park_limit = limit * 4 + 1024;
        let mut ready: VecDeque<Delivery> = VecDeque::new();
        let mut to_release: Vec<(Arc<str>, MessageIdData)> = Vec::new();
        let mut release_at: Option<Instant> = None;
        let mut slot: Option<mpsc::OwnedPermit<Delivery>> = None;
        let mut checks = tokio::time::interval(self.config.consumer_check_every);
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is immediate: the consumer was just made.
        checks.tick().await;
        // The topics (partitions) a message came from since the last check: proof that the
        // broker serves their consumers.
        let mut heard: HashSet<Arc<str>> = HashSet::new();
        // The permits pulsar-rs asked for (see `Supervisor::alive`); whether the last check
        // found the consumer suspect.
        let batch = flow_permits(&self.spec.topic, self.spec.options.prefetch);
        let mut suspect = false;
        let mut acks = InOrderAcks::new(
            self.spec.options.acks_in_order
                && self.spec.options.kind == SubscriptionKind::Exclusive,
        );
        loop {
            if !*paused && let Some(permit) = slot.take() {
                match ready.pop_front() {
                    Some(d) => {
                        permit.send(d);
                    }
                    None => slot = Some(permit),
                }
            }
            let want_message = if *paused {
                to_release.len() < park_limit
            } else {
                ready.len() < limit
            };
            tokio::select! {
                biased;
                ctl = self.control.recv() => match ctl {
                    Some(Control::Settle(topic, id, s)) => {
                        if s == Settlement::Ack {
                            self.redeliveries.forget(&id);
                        }
                        match acks.take(topic, id, s) {
                            Some((topic, id, s)) => {
                                // Not held (a nack, or acks one by one): what was held goes out
                                // first, as it came.
                                self.flush_acks(consumer, &mut acks).await;
                                self.apply(consumer, &topic, id, s).await;
                            }
                            None if acks.full() => self.flush_acks(consumer, &mut acks).await,
                            None => {}
                        }
                    }
                    Some(Control::Pause) => {
                        *paused = true;
                        // Dropped unsettled, each is released to the broker (a nack).
                        ready.clear();
                    }
                    // Asked before this consumer was made (while a check or a close waited):
                    // about the one it replaced. Or messages wait here for the subscriber: it
                    // is not deaf, only behind.
                    Some(Control::Renew(_, asked)) if asked < made || !ready.is_empty() => {}
                    Some(Control::Renew(why, _)) => {
                        warn!(topic = %self.spec.topic, subscription = %self.spec.subscription,
                              reason = %why, "re-subscribing at the subscriber's request");
                        // What the broker still takes; the rest it redelivers (durable topics)
                        // to the new consumer, and the subscriber skips what it already had.
                        self.flush_acks(consumer, &mut acks).await;
                        return Exit::Resubscribe;
                    }
                    // Bounded: a consumer's engine that waits to hand over a message nobody reads
                    // cannot answer; dropping the consumer then is all that is left.
                    Some(Control::Close(done)) => {
                        self.flush_acks(consumer, &mut acks).await;
                        let _ = tokio::time::timeout(CONSUMER_CHECK_TIMEOUT, consumer.close()).await;
                        let _ = done.send(());
                        return Exit::Stop;
                    }
                    Some(Control::Unsubscribe(done)) => {
                        self.flush_acks(consumer, &mut acks).await;
                        match tokio::time::timeout(CONSUMER_CHECK_TIMEOUT, consumer.unsubscribe()).await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => warn!(subscription = %self.spec.subscription, error = %e, "unsubscribe failed"),
                            Err(_) => warn!(subscription = %self.spec.subscription, "unsubscribe got no answer"),
                        }
                        let _ = tokio::time::timeout(CONSUMER_CHECK_TIMEOUT, consumer.close()).await;
                        let _ = done.send(());
                        return Exit::Stop;
                    }
                    // Unreachable while `self.control_tx` lives; kept for completeness.
                    None => return Exit::Stop,
                },
                // Second in this biased select: the acks that queued up while the control
                // channel had more for this loop go out once it has none (one command for a
                // run of them under load, one per message when idle).
                () = std::future::ready(()), if acks.due() => self.flush_acks(consumer, &mut acks).await,
                permit = self.deliveries.clone().reserve_owned(), if slot.is_none() && !*paused => match permit {
                    Ok(p) => slot = Some(p),
                    // The subscription handle is gone without a close: stop.
                    Err(_) => {
                        let _ = tokio::time::timeout(CONSUMER_CHECK_TIMEOUT, consumer.close()).await;
                        return Exit::Stop;
                    }
                },
                () = tokio::time::sleep_until(release_at.unwrap_or_else(Instant::now)), if release_at.is_some() => {
                    release_at = None;
                    for (topic, id) in to_release.drain(..) {
                        if let Err(e) = consumer.nack_with_id(&topic, id).await {
                            // Released with the consumer on close instead.
                            warn!(topic = %topic, error = %e, "releasing a parked message failed");
                        }
                    }
                },
                msg = consumer.next(), if want_message => match msg {
                    Some(Ok(m)) => {
                        if !heard.contains(m.topic.as_str()) {
                            heard.insert(self.topics.intern(&m.topic));
                        }
                        if *paused {
                            to_release.push((self.topics.intern(&m.topic), m.message_id.id.clone()));
                            release_at.get_or_insert_with(|| Instant::now() + RELEASE_PARKED_AFTER);
                            continue;
                        }
                        let id = m.message_id.id.clone();
                        let count = self.redeliveries.observe(&id);
                        let properties: BTreeMap<String, String> = m
                            .payload
                            .metadata
                            .properties
                            .iter()
                            .map(|kv| (kv.key.clone(), kv.value.clone()))
                            .collect();
                        let origin = Origin {
                            producer: self.producers.intern(&m.payload.metadata.producer_name),
                            sequence: m.payload.metadata.sequence_id,
                        };
                        let position = Position {
                            ledger: id.ledger_id,
                            entry: id.entry_id,
                            partition: id.partition.unwrap_or(-1),
                            batch: id.batch_index.unwrap_or(-1),
                        };
                        let payload = Bytes::from(m.payload.data);
                        let settle = Box::new(PulsarSettle {
                            control: self.control_tx.clone(),
                            topic: self.topics.intern(&m.topic),
                            id,
                        });
                        ready.push_back(
                            Delivery::new(payload, properties, count, settle)
                                .with_origin(origin)
                                .with_position(position),
                        );
                    }
                    Some(Err(e)) => {
                        // A message pulsar-rs could not decode (e.g. compressed with a codec
                        // not built in). It stays unacked on the broker (on a subscription that
                        // acks in order, the next cumulative ack settles it: a response nobody
                        // here can read would otherwise hold the subscription's backlog for
                        // ever); log and go on.
                        warn!(topic = %self.spec.topic, error = %e, "consumer error");
                    }
                    None => {
                        // Whatever the broker still takes; what it does not, it redelivers to the
                        // new consumer, and the subscriber skips what it already had.
                        self.flush_acks(consumer, &mut acks).await;
                        return Exit::Resubscribe;
                    }
                },
                // Last in this biased select, so a message already there is read first. Only a
                // consumer this loop reads is asked (nothing queued, not paused): pulsar-rs
                // answers the stats request from the consumer's engine, which cannot answer
                // while it waits to hand over a message nobody reads. A partition that sent
                // something since the last check needs none; one that did not is asked.
                _ = checks.tick() => {
                    let all_heard = consumer
                        .topics()
                        .iter()
                        .all(|t| heard.contains(t.as_str()));
                    let none_heard = heard.is_empty();
                    heard.clear();
                    if all_heard || !ready.is_empty() || *paused {
                        suspect = false;
                        continue;
                    }
                    match self.alive(consumer, batch).await {
                        Health::Served => suspect = false,
                        Health::Dead(why) => {
                            warn!(topic = %self.spec.topic, subscription = %self.spec.subscription,
                                  reason = %why, "the broker no longer serves this consumer; re-subscribing");
                            return Exit::Resubscribe;
                        }
                        // Only when every partition was silent: the answer has no partition
                        // names to match against the ones heard from. Twice in a row: a
                        // message on its way when the broker answered was counted against the
                        // permits but not yet here, a topic may be moving; by the next check
                        // the message has arrived (the consumer was not idle) or pulsar-rs
                        // has followed the topic, else the fault is real.
                        Health::Suspect(why) if none_heard => {
                            if suspect {
                                warn!(topic = %self.spec.topic, subscription = %self.spec.subscription,
                                      reason = %why, "this consumer cannot be receiving its topic's messages; re-subscribing");
                                return Exit::Resubscribe;
                            }
                            suspect = true;
                        }
                        Health::Suspect(_) => suspect = false,
                    }
                },
            }
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        debug!(topic = %self.spec.topic, subscription = %self.spec.subscription, "subscription supervisor stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{bus::oauth2::OAuth2Config, secret::Secret};

    #[test]
    fn credentials_over_plaintext_beyond_loopback_are_refused_unless_allowed() {
        const TOKEN: &str = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJyIn0.secret-signature";
        let config = |url: &str, auth: PulsarAuth| {
            let mut c = PulsarConfig::new(url);
            c.auth = auth;
            c
        };
        let token = || PulsarAuth::Token(Secret::new(TOKEN));
        let oauth2 = |issuer: &str| {
            PulsarAuth::OAuth2(OAuth2Config {
                issuer_url: issuer.into(),
                client_id: "sluice".into(),
                client_secret: Secret::new("client-secret-9"),
                audience: None,
                scope: None,
                ca_file: None,
            })
        };
        let refused = [
            config("pulsar://broker.example:6650", token()),
            config(
                "pulsar://broker.example:6650",
                PulsarAuth::TokenFile("/run/token".into()),
            ),
            config(
                "pulsar+ssl://broker.example:6651",
                oauth2("http://issuer.example"),
            ),
            config(
                "pulsar://broker.example:6650",
                oauth2("https://issuer.example"),
            ),
        ];
        for c in refused {
            let e = c.check_credentials_transport().unwrap_err().to_string();
            assert!(e.contains("--allow-plaintext-credentials"), "{e}");
            assert!(e.contains("plaintext"), "{e}");
            assert!(!e.contains(TOKEN) && !e.contains("client-secret-9"), "{e}");
            let mut allowed = c.clone();
            allowed.allow_plaintext_credentials = true;
            assert!(allowed.check_credentials_transport().is_ok());
        }
        for c in [
            config("pulsar://broker.example:6650", PulsarAuth::None),
            config("pulsar+ssl://broker.example:6651", token()),
            config("pulsar://127.0.0.1:6650", token()),
            config("pulsar://localhost:6650", oauth2("http://127.0.0.1:9000")),
            config(
                "pulsar+ssl://broker.example:6651",
                oauth2("https://issuer.example"),
            ),
        ] {
            assert!(c.check_credentials_transport().is_ok(), "{c:?}");
        }
    }

    fn id(ledger: u64, entry: u64) -> MessageIdData {
        MessageIdData {
            ledger_id: ledger,
            entry_id: entry,
            ..MessageIdData::default()
        }
    }

    #[test]
    fn acks_in_order_are_held_as_the_last_per_topic_until_a_nack_ends_it() {
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("t-partition-0"), Arc::from("t-partition-1"));
        let mut acks = InOrderAcks::new(true);
        assert!(!acks.due());
        for e in 0..3 {
            assert!(acks.take(a.clone(), id(1, e), Settlement::Ack).is_none());
        }
        assert!(acks.take(b.clone(), id(2, 7), Settlement::Ack).is_none());
        assert!(acks.due());
        let held: Vec<_> = acks.drain().map(|(t, i)| (t, i.entry_id)).collect();
        assert_eq!(held, vec![(a.clone(), 2), (b.clone(), 7)]);
        assert!(!acks.due());
        // A nack goes out on its own, and so does every ack after it: a cumulative ack past
        // the nacked message would ack it.
        assert!(acks.take(a.clone(), id(1, 3), Settlement::Ack).is_none());
        let nack = acks.take(a.clone(), id(1, 4), Settlement::Nack);
        assert!(matches!(nack, Some((_, _, Settlement::Nack))));
        assert!(acks.take(a.clone(), id(1, 5), Settlement::Ack).is_some());
        // The ack held before the nack is still there, to go out before it.
        assert_eq!(
            acks.drain().map(|(_, i)| i.entry_id).collect::<Vec<_>>(),
            vec![3]
        );
    }

    #[test]
    fn the_highest_ack_of_a_run_is_kept_when_earlier_messages_come_again() {
        let t: Arc<str> = Arc::from("t");
        let mut acks = InOrderAcks::new(true);
        assert!(acks.take(t.clone(), id(1, 10), Settlement::Ack).is_none());
        // Replayed after pulsar-rs re-attached the consumer: acked again, lower.
        assert!(acks.take(t.clone(), id(1, 3), Settlement::Ack).is_none());
        assert_eq!(
            acks.drain().map(|(_, i)| i.entry_id).collect::<Vec<_>>(),
            vec![10]
        );
        // A later ledger is later whatever its entry.
        assert!(acks.take(t.clone(), id(1, 10), Settlement::Ack).is_none());
        assert!(acks.take(t.clone(), id(2, 0), Settlement::Ack).is_none());
        assert_eq!(
            acks.drain().map(|(_, i)| i.ledger_id).collect::<Vec<_>>(),
            vec![2]
        );
    }

    #[test]
    fn acks_one_by_one_unless_in_order() {
        let mut acks = InOrderAcks::new(false);
        assert!(
            acks.take(Arc::from("t"), id(1, 1), Settlement::Ack)
                .is_some()
        );
        assert!(!acks.due());
    }

    #[test]
    fn a_long_run_of_acks_goes_out_before_it_grows_past_its_bound() {
        let t: Arc<str> = Arc::from("t");
        let mut acks = InOrderAcks::new(true);
        for e in 0..InOrderAcks::MAX_HELD as u64 {
            assert!(!acks.full());
            assert!(acks.take(t.clone(), id(1, e), Settlement::Ack).is_none());
        }
        assert!(acks.full());
        assert_eq!(acks.drain().count(), 1);
        assert!(!acks.full());
    }

    #[test]
    fn the_tracker_counts_repeat_deliveries_and_forgets_acked_ones() {
        let mut t = RedeliveryTracker::new(2);
        assert_eq!(t.observe(&id(1, 1)), 0);
        assert_eq!(t.observe(&id(1, 1)), 1);
        assert_eq!(t.observe(&id(1, 1)), 2);
        t.forget(&id(1, 1));
        assert_eq!(t.observe(&id(1, 1)), 0);
        assert_eq!(t.observe(&id(1, 2)), 0);
        assert_eq!(t.observe(&id(1, 3)), 0, "capacity evicts the oldest");
        assert_eq!(t.seen.len(), 2);
    }

    #[test]
    fn a_negative_permit_count_from_the_broker_reads_as_negative() {
        assert_eq!(signed_permits(1_000), 1_000);
        assert_eq!(signed_permits(0), 0);
        // Java's `int` -3, sign-extended into the protocol's uint64.
        assert_eq!(signed_permits(u64::MAX - 2), -3);
    }

    #[test]
    fn non_persistent_consumers_keep_permits_for_a_burst_of_their_concurrency() {
        assert_eq!(flow_permits("persistent://t/n/x", 64), 64);
        assert_eq!(flow_permits("persistent://t/n/x", 0), 1);
        assert_eq!(flow_permits("non-persistent://t/n/x", 64), 1000);
        assert_eq!(flow_permits("non-persistent://t/n/x", 512), 1025);
        // pulsar-rs re-flows only below half its batch: what is left must cover a burst.
        for prefetch in [1, 64, 256, 512, 4096] {
            let permits = flow_permits("non-persistent://t/n/x", prefetch);
            assert!(permits.div_ceil(2) > prefetch, "{prefetch}: {permits}");
        }
    }
}
