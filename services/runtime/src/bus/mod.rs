//! The message bus: publish records to topics and consume them through subscriptions.
//!
//! Two implementations: [`pulsar::PulsarBus`] (Apache Pulsar, for production and the
//! integration tests) and [`memory::MemoryBus`] (in-process, for `sluice serve` and fast
//! unit tests). Both give at-least-once delivery: a [`Delivery`] that is neither acked nor
//! nacked is nacked when dropped, so a handler that panics or is cancelled never pins a
//! request; it comes back for another attempt.
//!
//! The bus never interprets payloads: it moves bytes and string properties.

pub mod admin;
pub mod memory;
pub mod oauth2;
pub mod pulsar;
pub mod pulsar_security;

use std::{collections::BTreeMap, fmt, pin::Pin, sync::Arc};

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;

/// A message to publish: payload bytes plus string properties.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    /// The record, usually JSON.
    pub payload: Bytes,
    /// Properties such as `id` and `traceparent`.
    pub properties: BTreeMap<String, String>,
    /// The message's key: Pulsar keeps only the latest message of each key when it compacts
    /// a topic. `None` for records, which are told apart by their `id` property.
    pub key: Option<String>,
}

impl Message {
    /// A message with the given payload and no properties.
    pub fn new(payload: impl Into<Bytes>) -> Self {
        Self {
            payload: payload.into(),
            properties: BTreeMap::new(),
            key: None,
        }
    }

    /// Sets the message's key (see [`Message::key`]).
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a property.
    pub fn with_property(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(key.into(), value.into());
        self
    }

    /// Bytes this message occupies on the wire, payload and properties, not counting the
    /// fixed framing. Compared against the bus's size limit before sending.
    pub fn encoded_len(&self) -> usize {
        self.payload.len()
            + self.key.as_ref().map_or(0, String::len)
            + self
                .properties
                .iter()
                .map(|(k, v)| k.len() + v.len() + 8)
                .sum::<usize>()
    }
}

/// How consumers of one subscription share its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscriptionKind {
    /// Competing consumers: each message goes to one of them (request topics).
    Shared,
    /// One consumer only; a second is refused (a client instance's response subscription).
    Exclusive,
}

/// Where a subscription created for the first time starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartPosition {
    /// From the oldest message the topic still holds: requests published before the first
    /// processor subscribed are still served.
    Earliest,
    /// From the next message published.
    Latest,
    /// A reader of what the topic holds from the message at this position on, that message
    /// included (a resumed stream reading its records again): a subscription the broker
    /// forgets when it closes. Only Pulsar's persistent topics hold messages to read again;
    /// the in-process bus refuses it.
    At(Position),
    /// A reader of everything the topic still holds, from its oldest message, through the
    /// broker's compacted view where it has one (the latest message of each key): a
    /// subscription the broker forgets when it closes, for state published as keyed
    /// snapshots. A re-created consumer reads it all again. The in-process bus refuses it.
    Replay,
}

/// A message's place in its topic: Pulsar's message id (ledger, entry, partition, batch
/// index). Ordered as the topic orders its messages, for one non-partitioned topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    /// The ledger holding the message.
    pub ledger: u64,
    /// The entry within the ledger.
    pub entry: u64,
    /// The partition (-1 for a topic without partitions).
    pub partition: i32,
    /// The index within a batched entry (-1 when not batched).
    pub batch: i32,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}:{}",
            self.ledger, self.entry, self.partition, self.batch
        )
    }
}

/// Text that is not what [`Position`]'s `Display` writes (the text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a position (ledger:entry:partition:batch)")]
pub struct NotAPosition(pub String);

impl std::str::FromStr for Position {
    type Err = NotAPosition;

    /// Reads what [`Position`]'s `Display` writes.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || NotAPosition(s.to_owned());
        let mut parts = s.split(':');
        let mut next = || parts.next().ok_or_else(bad);
        let position = Self {
            ledger: next()?.parse().map_err(|_| bad())?,
            entry: next()?.parse().map_err(|_| bad())?,
            partition: next()?.parse().map_err(|_| bad())?,
            batch: next()?.parse().map_err(|_| bad())?,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(position)
    }
}

/// Options for [`Bus::subscribe`].
#[derive(Debug, Clone)]
pub struct SubscribeOptions {
    /// Shared or exclusive.
    pub kind: SubscriptionKind,
    /// Where a new subscription starts.
    pub start: StartPosition,
    /// How many messages the broker may push ahead of processing. Kept near the consumer's
    /// concurrency so one replica does not hoard a Shared subscription's backlog.
    pub prefetch: u32,
    /// A consumer name for the broker's statistics.
    pub consumer_name: Option<String>,
    /// The subscriber settles every delivery in the order it came, with an ack (a nack, or a
    /// delivery dropped unsettled, only on its way out). An exclusive subscription may then
    /// settle a run of acks that queued up with one cumulative ack: the broker handles one
    /// command instead of one per message. A client's response router is such a subscriber;
    /// a processor's request subscription (shared, settled out of order) is not.
    pub acks_in_order: bool,
}

impl SubscribeOptions {
    /// Options for a processor's request subscription.
    pub fn shared(prefetch: u32) -> Self {
        Self {
            kind: SubscriptionKind::Shared,
            start: StartPosition::Earliest,
            prefetch: prefetch.max(1),
            consumer_name: None,
            acks_in_order: false,
        }
    }

    /// Options for a client instance's response subscription.
    pub fn exclusive(prefetch: u32) -> Self {
        Self {
            kind: SubscriptionKind::Exclusive,
            start: StartPosition::Latest,
            prefetch: prefetch.max(1),
            consumer_name: None,
            acks_in_order: false,
        }
    }
}

/// What went wrong on the bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// The message is larger than the bus accepts. Sending it would make Pulsar close the
    /// connection and the client retry forever, so it is refused before sending.
    #[error("message of {size} bytes exceeds the bus limit of {limit} bytes")]
    TooLarge {
        /// The message's encoded size.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The broker could not be reached or refused the operation.
    #[error("bus unavailable: {0}")]
    Unavailable(String),
    /// The subscription or publisher was closed.
    #[error("closed")]
    Closed,
    /// The subscription is exclusive and already has a consumer.
    #[error("subscription {0:?} is exclusive and already has a consumer")]
    ExclusiveTaken(String),
    /// A bad topic or configuration.
    #[error("invalid bus configuration: {0}")]
    Config(String),
    /// The broker refused this client (credentials, certificate, or permission on a topic).
    /// Retrying with the same credentials cannot help.
    #[error("{0}")]
    Denied(pulsar_security::Denial),
}

/// A future resolving when the broker has stored a published message.
pub struct Receipt(BoxFuture<'static, Result<(), BusError>>);

impl Receipt {
    /// Wraps a future.
    pub fn new(fut: impl Future<Output = Result<(), BusError>> + Send + 'static) -> Self {
        Self(Box::pin(fut))
    }

    /// A receipt that is already settled.
    pub fn ready(result: Result<(), BusError>) -> Self {
        Self(Box::pin(std::future::ready(result)))
    }

    /// The outcome if it is known already (the in-process bus settles at once), else the
    /// receipt to wait on: a caller with nothing else to do than wait can skip spawning a task
    /// for it, and with it a wake-up of another worker thread on every request's path.
    pub fn settled(mut self) -> Result<Result<(), BusError>, Receipt> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match self.0.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(outcome) => Ok(outcome),
            std::task::Poll::Pending => Err(self),
        }
    }
}

impl Future for Receipt {
    type Output = Result<(), BusError>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        self.0.as_mut().poll(cx)
    }
}

impl fmt::Debug for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Receipt")
    }
}

/// Publishes to one topic. Messages sent through one publisher are stored in send order.
#[async_trait]
pub trait Publisher: Send + Sync {
    /// Queues a message. Returns once the message is queued (waiting while the queue is
    /// full) with a receipt that resolves when the broker has stored it.
    async fn send(&self, message: Message) -> Result<Receipt, BusError>;

    /// The topic this publisher writes to.
    fn topic(&self) -> &str;

    /// Makes sure the broker accepts this publisher now (Pulsar: creates the producer), so
    /// that a role without permission on the topic is refused at start-up rather than at the
    /// first record. Buses with nothing to open answer at once.
    async fn open(&self) -> Result<(), BusError> {
        Ok(())
    }
}

/// Consumes one subscription.
#[async_trait]
pub trait Subscription: Send {
    /// The next delivery; `None` once the subscription is closed for good. Cancel-safe: a
    /// caller may drop the future (e.g. in a `select!`) without losing a delivery.
    async fn next(&mut self) -> Option<Result<Delivery, BusError>>;

    /// Closes the subscription. Deliveries not yet settled go back to the broker for
    /// redelivery (to another consumer of a Shared subscription).
    async fn close(self: Box<Self>);

    /// Closes and deletes the subscription (a client instance's private response
    /// subscription, so no backlog accumulates after it is gone).
    async fn unsubscribe(self: Box<Self>);

    /// A handle that tells, at any time, whether the subscription is attached to the
    /// broker (for `/readyz`).
    fn link(&self) -> Link;

    /// Stops handing out new deliveries but keeps settling the ones already handed out;
    /// called when draining, before [`Subscription::close`]. Undelivered messages go back
    /// to the broker on close.
    fn pause(&mut self) {}

    /// Re-creates the subscription's consumer at the broker, because its owner saw that it
    /// receives nothing it should (`why`, for the log). Returns whether this bus can: the
    /// in-process bus cannot lose a consumer and returns `false`.
    ///
    /// Why the owner decides: on a non-persistent topic, after topic moves under load, the
    /// broker has been seen to drop a consumer from its topic while still answering the
    /// consumer's stats requests, so the subscription's own checks find nothing wrong (see
    /// `crate::client`, which hears the processors' syncs stop).
    fn renew(&mut self, why: &str) -> bool {
        let _ = why;
        false
    }
}

/// A bus: publishers and subscriptions by topic.
#[async_trait]
pub trait Bus: Send + Sync + 'static {
    /// A publisher for `topic` (a Pulsar topic URL). Publishers are cached per topic.
    async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError>;

    /// Subscribes to `topic` under the subscription name `subscription`.
    async fn subscribe(
        &self,
        topic: &str,
        subscription: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BusError>;

    /// The largest message [`Publisher::send`] accepts.
    fn max_message_bytes(&self) -> usize;

    /// Whether the bus keeps messages to read again from a position
    /// ([`StartPosition::At`]): Pulsar's persistent topics do; the in-process bus does not.
    fn keeps_messages(&self) -> bool {
        false
    }
}

/// Whether a subscription is attached to its broker, and if not, why; cheap to clone and to
/// read.
#[derive(Debug, Clone)]
pub struct Link {
    up: Arc<std::sync::atomic::AtomicBool>,
    why: Arc<std::sync::Mutex<Option<String>>>,
}

impl Link {
    /// A link in the given state.
    pub fn new(up: bool) -> Self {
        Self {
            up: Arc::new(std::sync::atomic::AtomicBool::new(up)),
            why: Arc::default(),
        }
    }

    /// True while attached.
    pub fn is_up(&self) -> bool {
        self.up.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records the state; attached clears the reason.
    pub fn set(&self, up: bool) {
        if up {
            *crate::lock(&self.why) = None;
        }
        self.up.store(up, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records that the link is down for `reason` (shown by `/readyz`).
    pub fn set_down(&self, reason: impl Into<String>) {
        *crate::lock(&self.why) = Some(reason.into());
        self.up.store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Why the link is down, when known.
    pub fn why(&self) -> Option<String> {
        crate::lock(&self.why).clone()
    }
}

/// How a delivery was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Done with: never deliver again.
    Ack,
    /// Not done: deliver again (at once; the bus has no redelivery delay).
    Nack,
}

/// Settles one delivery. Implemented by each bus; called exactly once.
pub trait Settle: Send + Sync {
    /// Acks or nacks. Must not block: implementations hand the command to a task.
    fn settle(self: Box<Self>, settlement: Settlement);
}

/// Which producer published a delivery, and its place in that producer's sequence.
///
/// Pulsar stamps every message with its producer's name and a sequence id that grows by one
/// per message, and a subscription receives one producer's messages in that order. A
/// consumer that sees a producer's sequence jump knows the broker dropped what lies between
/// (non-persistent topics drop what a consumer has no permits for), even when it cannot read
/// what was dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The producer's name, unique per producer on the broker.
    pub producer: Arc<str>,
    /// The message's sequence id within that producer.
    pub sequence: u64,
}

/// A message received from a subscription, to be acked or nacked exactly once.
pub struct Delivery {
    payload: Bytes,
    /// Shared: the in-process bus hands the same message to every subscription of its topic
    /// (a response topic has one per client), and a deep copy per delivery was most of the
    /// bus's cost.
    properties: Arc<BTreeMap<String, String>>,
    redelivery_count: u32,
    origin: Option<Origin>,
    position: Option<Position>,
    settle: Option<Box<dyn Settle>>,
}

impl Delivery {
    /// Builds a delivery; for bus implementations.
    pub fn new(
        payload: Bytes,
        properties: impl Into<Arc<BTreeMap<String, String>>>,
        redelivery_count: u32,
        settle: Box<dyn Settle>,
    ) -> Self {
        Self {
            payload,
            properties: properties.into(),
            redelivery_count,
            origin: None,
            position: None,
            settle: Some(settle),
        }
    }

    /// Records the message's place in its topic (for bus implementations that know).
    pub fn with_position(mut self, position: Position) -> Self {
        self.position = Some(position);
        self
    }

    /// The message's place in its topic, where the bus knows it (Pulsar does; the in-process
    /// bus keeps nothing to read again and does not say).
    pub fn position(&self) -> Option<Position> {
        self.position
    }

    /// Records which producer published this message (for bus implementations that know).
    pub fn with_origin(mut self, origin: Origin) -> Self {
        self.origin = Some(origin);
        self
    }

    /// The producer and sequence id, where the bus knows them (Pulsar does; the in-process
    /// bus never drops a message and does not say).
    pub fn origin(&self) -> Option<&Origin> {
        self.origin.as_ref()
    }

    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// One property.
    pub fn property(&self, key: &str) -> Option<&str> {
        self.properties.get(key).map(String::as_str)
    }

    /// All properties.
    pub fn properties(&self) -> &BTreeMap<String, String> {
        &self.properties
    }

    /// How many times this message was delivered before, as far as this bus can tell.
    ///
    /// Exact on the in-process bus. On Pulsar it counts redeliveries this process has
    /// seen: pulsar-rs does not expose the broker's count, and the broker reports 0 after
    /// a consumer disconnects anyway (apache/pulsar#8722). The attempt id on response
    /// records is what tells clients a stream restarted.
    pub fn redelivery_count(&self) -> u32 {
        self.redelivery_count
    }

    /// Acknowledges: the message will not be delivered again.
    pub fn ack(mut self) {
        if let Some(s) = self.settle.take() {
            s.settle(Settlement::Ack);
        }
    }

    /// Negatively acknowledges: the message will be delivered again.
    pub fn nack(mut self) {
        if let Some(s) = self.settle.take() {
            s.settle(Settlement::Nack);
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        // Unsettled on drop means the work was abandoned (panic, cancellation):
        // hand the message back rather than leaving it pinned to this consumer.
        if let Some(s) = self.settle.take() {
            s.settle(Settlement::Nack);
        }
    }
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("bytes", &self.payload.len())
            .field("properties", &self.properties)
            .field("redelivery_count", &self.redelivery_count)
            .finish()
    }
}

/// Checks a message against a size limit.
pub(crate) fn check_size(message: &Message, limit: usize) -> Result<(), BusError> {
    let size = message.encoded_len();
    if size > limit {
        return Err(BusError::TooLarge { size, limit });
    }
    Ok(())
}
