//! Consuming: a supervisor task per subscription that re-creates its consumer, settles
//! messages (acks in order held and sent cumulatively, nacks), parks and releases what
//! arrives while draining, and checks that the broker still knows the consumer.

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use pulsar::{
    Consumer, ConsumerOptions, Pulsar, TokioExecutor, consumer::InitialPosition,
    message::proto::MessageIdData, message::proto::command_subscribe::SubType,
};
use tokio::{
    sync::{mpsc, oneshot},
    time::Instant,
};
use tracing::{debug, error, info, warn};

use super::{config::PulsarConfig, connect::explain};
use crate::backoff::Backoff;
use crate::bus::{
    BusError, Delivery, Link, Origin, Position, Settle, Settlement, StartPosition,
    SubscribeOptions, Subscription, SubscriptionKind,
};
use settle::{InOrderAcks, RedeliveryTracker};
use sluice_schema::topics::Persistence;

pub(super) struct ConsumerSpec {
    pub(super) topic: String,
    pub(super) subscription: String,
    pub(super) options: SubscribeOptions,
}

impl ConsumerSpec {
    /// Whether one nack rewinds the whole subscription: on an Exclusive subscription the
    /// broker answers any nack by sending EVERYTHING unacked again, not the one message. So
    /// its nacks are gathered and released as one (see `serve`), none is sent to a new
    /// consumer (it is sent everything unacked anyway), and acks in order stop at a nack.
    fn nack_rewinds_all(&self) -> bool {
        self.options.kind == SubscriptionKind::Exclusive
    }

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

/// Subscribes as `spec` says and starts the subscription's supervisor task.
pub(super) async fn subscribe(
    consumers: &Pulsar<TokioExecutor>,
    config: &Arc<PulsarConfig>,
    spec: ConsumerSpec,
) -> Result<Box<dyn Subscription>, BusError> {
    // Subscribe once up front so that configuration errors (an exclusive subscription
    // already taken, a missing namespace) reach the caller instead of a retry loop.
    let consumer = spec.build(consumers, config).await?;
    let (deliveries_tx, deliveries_rx) = mpsc::channel(spec.options.prefetch as usize);
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let connected = Link::new(true);
    let supervisor = Supervisor {
        client: consumers.clone(),
        config: config.clone(),
        spec,
        deliveries: deliveries_tx,
        control_tx: control_tx.clone(),
        control: control_rx,
        connected: connected.clone(),
        redeliveries: RedeliveryTracker::new(100_000),
        producers: ProducerNames::default(),
        topics: ProducerNames::default(),
        max_backoff: config.resubscribe_max_backoff,
    };
    tokio::spawn(supervisor.run(consumer));
    Ok(Box::new(PulsarSubscription {
        deliveries: deliveries_rx,
        control: control_tx,
        connected,
        closed: false,
    }))
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
    if Persistence::of(topic).is_lossy() {
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
                // A new Exclusive consumer is sent everything unacked anyway: a nack would only
                // rewind it once more (see `serve`).
                if settlement == Settlement::Nack && self.spec.nack_rewinds_all() {
                    continue;
                }
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

    /// A message as the subscriber is handed it: its payload and properties, how often it
    /// came before, who produced it and where it is, and how it is settled.
    fn delivery(&mut self, m: pulsar::consumer::Message<Vec<u8>>) -> Delivery {
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
        let settle = Box::new(PulsarSettle {
            control: self.control_tx.clone(),
            topic: self.topics.intern(&m.topic),
            id,
        });
        Delivery::new(Bytes::from(m.payload.data), properties, count, settle)
            .with_origin(origin)
            .with_position(position)
    }

    /// Hands the consumer's messages to the subscriber until the consumer must be made anew
    /// or the subscription ends.
    ///
    /// Long because it is one `select!` over everything a consumer answers (the control
    /// channel's settles, pauses, renewals and closes; the held acks; the subscriber's slot;
    /// parked messages to release; the broker's messages; the liveness checks), all sharing
    /// this loop's state (what is ready, parked, held, heard): split, each part would take
    /// most of that state as arguments. What stands alone is in its own function
    /// ([`Self::delivery`], [`Self::alive`], [`Self::flush_acks`], [`Self::apply`]).
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
        let mut acks =
            InOrderAcks::new(self.spec.options.acks_in_order && self.spec.nack_rewinds_all());
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
                                // On an Exclusive subscription the broker answers any nack by rewinding
                                // the cursor: EVERYTHING unacked comes again, not the one message. A
                                // subscriber that drops (nacks) what it reads would then be sent its
                                // whole backlog once per dropped message, and each copy dropped again
                                // asks for another rewind: a storm that took a broker's heap (CI,
                                // December). So such nacks are gathered and released as one, once a
                                // second at most, like the parked messages below.
                                if s == Settlement::Nack && self.spec.nack_rewinds_all() {
                                    if to_release.is_empty() {
                                        to_release.push((topic, id));
                                    }
                                    release_at.get_or_insert_with(|| Instant::now() + RELEASE_PARKED_AFTER);
                                } else {
                                    self.apply(consumer, &topic, id, s).await;
                                }
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
                    // One nack rewinds an Exclusive subscription whole (see the Settle arm).
                    if self.spec.nack_rewinds_all() {
                        to_release.truncate(1);
                    }
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
                        ready.push_back(self.delivery(m));
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

mod settle;
#[cfg(test)]
mod tests;
