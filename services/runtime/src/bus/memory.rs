//! The in-process bus, for `sluice serve` and fast unit tests.
//!
//! It keeps Pulsar's semantics where sluice depends on them: a subscription exists from
//! the moment it is first subscribed and receives only what is published after that;
//! Shared subscriptions hand each message to one consumer; Exclusive subscriptions refuse
//! a second consumer; unsettled messages return to the queue when their consumer goes away;
//! a full queue makes publishers wait instead of dropping. It is not a substitute for the
//! broker in integration tests: nothing here survives the process.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::Notify;

use crate::lock;

use super::{
    Bus, BusError, Delivery, Link, Message, Publisher, Receipt, Settle, Settlement,
    SubscribeOptions, Subscription, SubscriptionKind, check_size,
};

/// Default limit per message, matching Pulsar's default `maxMessageSize` of 5 MiB less headroom.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 5 * 1024 * 1024 - 64 * 1024;

/// Default number of queued messages per subscription before publishers wait.
pub const DEFAULT_QUEUE_CAPACITY: usize = 100_000;

/// The in-process bus. Cheap to clone: clones share the same topics.
#[derive(Clone)]
pub struct MemoryBus {
    topics: Arc<Mutex<HashMap<String, Arc<TopicState>>>>,
    max_message_bytes: usize,
    queue_capacity: usize,
}

impl Default for MemoryBus {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_QUEUE_CAPACITY)
    }
}

impl MemoryBus {
    /// A bus with the given message size limit and per-subscription queue capacity.
    pub fn new(max_message_bytes: usize, queue_capacity: usize) -> Self {
        Self {
            topics: Arc::default(),
            max_message_bytes,
            queue_capacity: queue_capacity.max(1),
        }
    }

    fn topic(&self, name: &str) -> Arc<TopicState> {
        lock(&self.topics)
            .entry(name.to_owned())
            .or_insert_with(|| Arc::new(TopicState::default()))
            .clone()
    }
}

#[derive(Default)]
struct TopicState {
    subscriptions: Mutex<HashMap<String, Arc<SubState>>>,
}

struct SubState {
    name: String,
    kind: SubscriptionKind,
    inner: Mutex<SubInner>,
    readable: Notify,
    writable: Notify,
}

#[derive(Default)]
struct SubInner {
    queue: VecDeque<Entry>,
    unsettled: HashMap<u64, (u64, Entry)>,
    consumers: usize,
    exclusive_owner: Option<u64>,
}

/// A message in a subscription's queue. Cheap to clone: the payload and the properties are
/// shared with the other subscriptions' copies and with its deliveries.
#[derive(Clone)]
struct Entry {
    seq: u64,
    payload: Bytes,
    properties: Arc<BTreeMap<String, String>>,
    redelivery_count: u32,
}

static NEXT_SEQ: AtomicU64 = AtomicU64::new(1);
static NEXT_CONSUMER: AtomicU64 = AtomicU64::new(1);

impl SubState {
    fn requeue(&self, inner: &mut SubInner, mut entry: Entry) {
        entry.redelivery_count += 1;
        inner.queue.push_front(entry);
        self.readable.notify_waiters();
    }

    fn detach(&self, consumer: u64) {
        let mut inner = lock(&self.inner);
        let mine: Vec<u64> = inner
            .unsettled
            .iter()
            .filter(|(_, (owner, _))| *owner == consumer)
            .map(|(seq, _)| *seq)
            .collect();
        // Requeue oldest first at the front, so the original order is kept.
        let mut entries: Vec<Entry> = mine
            .into_iter()
            .filter_map(|seq| inner.unsettled.remove(&seq).map(|(_, e)| e))
            .collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.seq));
        for e in entries {
            self.requeue(&mut inner, e);
        }
        inner.consumers = inner.consumers.saturating_sub(1);
        if inner.exclusive_owner == Some(consumer) {
            inner.exclusive_owner = None;
        }
    }
}

struct MemoryPublisher {
    topic_name: String,
    topic: Arc<TopicState>,
    max_message_bytes: usize,
    queue_capacity: usize,
}

#[async_trait]
impl Publisher for MemoryPublisher {
    async fn send(&self, message: Message) -> Result<Receipt, BusError> {
        check_size(&message, self.max_message_bytes)?;
        let seq = NEXT_SEQ.fetch_add(1, Ordering::Relaxed);
        let subs: Vec<Arc<SubState>> = lock(&self.topic.subscriptions).values().cloned().collect();
        let properties = Arc::new(message.properties);
        for sub in subs {
            let entry = Entry {
                seq,
                payload: message.payload.clone(),
                properties: properties.clone(),
                redelivery_count: 0,
            };
            loop {
                let writable = sub.writable.notified();
                tokio::pin!(writable);
                writable.as_mut().enable();
                {
                    let mut inner = lock(&sub.inner);
                    if inner.queue.len() < self.queue_capacity {
                        inner.queue.push_back(entry);
                        sub.readable.notify_waiters();
                        break;
                    }
                }
                // The subscription's queue is full: wait for a consumer to take from it
                // (Pulsar's block_queue_if_full, rather than dropping).
                writable.await;
            }
        }
        Ok(Receipt::ready(Ok(())))
    }

    fn topic(&self) -> &str {
        &self.topic_name
    }
}

struct MemorySubscription {
    sub: Arc<SubState>,
    topic: Arc<TopicState>,
    consumer: u64,
    attached: bool,
}

struct MemorySettle {
    sub: Arc<SubState>,
    seq: u64,
}

impl Settle for MemorySettle {
    fn settle(self: Box<Self>, settlement: Settlement) {
        let mut inner = lock(&self.sub.inner);
        // Absent when the consumer detached first: the entry is already back in the queue.
        if let Some((_, entry)) = inner.unsettled.remove(&self.seq) {
            match settlement {
                Settlement::Ack => {}
                Settlement::Nack => self.sub.requeue(&mut inner, entry),
            }
        }
    }
}

#[async_trait]
impl Subscription for MemorySubscription {
    async fn next(&mut self) -> Option<Result<Delivery, BusError>> {
        if !self.attached {
            return None;
        }
        loop {
            let readable = self.sub.readable.notified();
            tokio::pin!(readable);
            readable.as_mut().enable();
            {
                let mut inner = lock(&self.sub.inner);
                if let Some(entry) = inner.queue.pop_front() {
                    inner
                        .unsettled
                        .insert(entry.seq, (self.consumer, entry.clone()));
                    self.sub.writable.notify_waiters();
                    let settle = Box::new(MemorySettle {
                        sub: self.sub.clone(),
                        seq: entry.seq,
                    });
                    return Some(Ok(Delivery::new(
                        entry.payload,
                        entry.properties,
                        entry.redelivery_count,
                        settle,
                    )));
                }
            }
            readable.await;
        }
    }

    async fn close(mut self: Box<Self>) {
        self.detach();
    }

    async fn unsubscribe(mut self: Box<Self>) {
        self.detach();
        lock(&self.topic.subscriptions).remove(&self.sub.name);
    }

    fn link(&self) -> Link {
        // Nothing to lose touch with in-process.
        Link::new(true)
    }
}

impl MemorySubscription {
    fn detach(&mut self) {
        if std::mem::take(&mut self.attached) {
            self.sub.detach(self.consumer);
        }
    }
}

impl Drop for MemorySubscription {
    fn drop(&mut self) {
        self.detach();
    }
}

#[async_trait]
impl Bus for MemoryBus {
    async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError> {
        Ok(Arc::new(MemoryPublisher {
            topic_name: topic.to_owned(),
            topic: self.topic(topic),
            max_message_bytes: self.max_message_bytes,
            queue_capacity: self.queue_capacity,
        }))
    }

    async fn subscribe(
        &self,
        topic: &str,
        subscription: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BusError> {
        if let super::StartPosition::At(_) | super::StartPosition::Replay = options.start {
            return Err(BusError::Config(
                "the in-process bus keeps no message to read again: reading a topic from a \
                 position needs Pulsar"
                    .into(),
            ));
        }
        let topic_state = self.topic(topic);
        let sub = lock(&topic_state.subscriptions)
            .entry(subscription.to_owned())
            .or_insert_with(|| {
                Arc::new(SubState {
                    name: subscription.to_owned(),
                    kind: options.kind,
                    inner: Mutex::default(),
                    readable: Notify::new(),
                    writable: Notify::new(),
                })
            })
            .clone();
        if sub.kind != options.kind {
            return Err(BusError::Config(format!(
                "subscription {subscription:?} on {topic} exists with kind {:?}, not {:?}",
                sub.kind, options.kind
            )));
        }
        let consumer = NEXT_CONSUMER.fetch_add(1, Ordering::Relaxed);
        {
            let mut inner = lock(&sub.inner);
            if sub.kind == SubscriptionKind::Exclusive {
                if inner.exclusive_owner.is_some() {
                    return Err(BusError::ExclusiveTaken(subscription.to_owned()));
                }
                inner.exclusive_owner = Some(consumer);
            }
            inner.consumers += 1;
        }
        Ok(Box::new(MemorySubscription {
            sub,
            topic: topic_state,
            consumer,
            attached: true,
        }))
    }

    fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }
}

/// A bus over an in-process one whose publishers or subscriptions of topic "cancel" come only
/// once the test opens its gate: a broker slow to look the cancel topic up, or to create its
/// subscription, at start-up.
#[cfg(test)]
pub(crate) struct SlowCancelTopic {
    pub inner: MemoryBus,
    /// Whether the publishers (else the subscriptions) wait.
    pub publishers: bool,
    pub gate: tokio::sync::watch::Receiver<bool>,
}

#[cfg(test)]
#[async_trait]
impl Bus for SlowCancelTopic {
    async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError> {
        if self.publishers && topic == "cancel" {
            let _ = self.gate.clone().wait_for(|open| *open).await;
        }
        self.inner.publisher(topic).await
    }

    async fn subscribe(
        &self,
        topic: &str,
        subscription: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BusError> {
        if !self.publishers && topic == "cancel" {
            let _ = self.gate.clone().wait_for(|open| *open).await;
        }
        self.inner.subscribe(topic, subscription, options).await
    }

    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn text(d: &Delivery) -> String {
        String::from_utf8(d.payload().to_vec()).unwrap()
    }

    #[tokio::test]
    async fn shared_consumers_each_get_distinct_messages() {
        let bus = MemoryBus::default();
        let mut a = bus
            .subscribe("t", "s", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let mut b = bus
            .subscribe("t", "s", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let p = bus.publisher("t").await.unwrap();
        p.send(Message::new("1")).await.unwrap();
        p.send(Message::new("2")).await.unwrap();
        let d1 = a.next().await.unwrap().unwrap();
        let d2 = b.next().await.unwrap().unwrap();
        assert_ne!(text(&d1), text(&d2));
        d1.ack();
        d2.ack();
    }

    #[tokio::test]
    async fn nack_and_drop_redeliver_with_a_count() {
        let bus = MemoryBus::default();
        let mut s = bus
            .subscribe("t", "s", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let p = bus.publisher("t").await.unwrap();
        p.send(Message::new("x").with_property("id", "r1"))
            .await
            .unwrap();
        let d = s.next().await.unwrap().unwrap();
        assert_eq!(d.redelivery_count(), 0);
        d.nack();
        let d = s.next().await.unwrap().unwrap();
        assert_eq!(d.redelivery_count(), 1);
        drop(d);
        let d = s.next().await.unwrap().unwrap();
        assert_eq!(d.redelivery_count(), 2);
        assert_eq!(d.property("id"), Some("r1"));
        d.ack();
        let nothing = tokio::time::timeout(Duration::from_millis(50), s.next()).await;
        assert!(nothing.is_err(), "an acked message is not delivered again");
    }

    #[tokio::test]
    async fn a_closed_consumer_hands_its_unsettled_messages_to_another() {
        let bus = MemoryBus::default();
        let mut a = bus
            .subscribe("t", "s", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let p = bus.publisher("t").await.unwrap();
        p.send(Message::new("held")).await.unwrap();
        let held = a.next().await.unwrap().unwrap();
        let mut b = bus
            .subscribe("t", "s", SubscribeOptions::shared(10))
            .await
            .unwrap();
        a.close().await;
        let again = b.next().await.unwrap().unwrap();
        assert_eq!(text(&again), "held");
        assert_eq!(again.redelivery_count(), 1);
        held.ack(); // too late: already handed on, and harmless
        again.ack();
    }

    #[tokio::test]
    async fn exclusive_refuses_a_second_consumer_until_the_first_leaves() {
        let bus = MemoryBus::default();
        let a = bus
            .subscribe("t", "mine", SubscribeOptions::exclusive(10))
            .await
            .unwrap();
        let err = bus
            .subscribe("t", "mine", SubscribeOptions::exclusive(10))
            .await
            .err()
            .unwrap();
        assert!(matches!(err, BusError::ExclusiveTaken(_)));
        a.unsubscribe().await;
        assert!(
            bus.subscribe("t", "mine", SubscribeOptions::exclusive(10))
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn oversized_messages_are_refused_before_sending() {
        let bus = MemoryBus::new(1024, 10);
        let p = bus.publisher("t").await.unwrap();
        let err = p.send(Message::new(vec![0u8; 2048])).await.unwrap_err();
        assert!(matches!(
            err,
            BusError::TooLarge {
                size: 2048,
                limit: 1024
            }
        ));
    }

    #[tokio::test]
    async fn a_full_queue_makes_the_publisher_wait_not_drop() {
        let bus = MemoryBus::new(1024, 2);
        let mut s = bus
            .subscribe("t", "s", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let p = bus.publisher("t").await.unwrap();
        p.send(Message::new("1")).await.unwrap();
        p.send(Message::new("2")).await.unwrap();
        let third = tokio::spawn({
            let p = p.clone();
            async move { p.send(Message::new("3")).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!third.is_finished(), "third send waits for room");
        let mut got = Vec::new();
        for _ in 0..3 {
            let d = s.next().await.unwrap().unwrap();
            got.push(text(&d));
            d.ack();
        }
        third.await.unwrap().unwrap();
        assert_eq!(got, ["1", "2", "3"]);
    }
}
