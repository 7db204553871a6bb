//! The router: the task that reads the client's response subscription and hands each record
//! to the stream waiting for its id, in order, seeing on the way what was lost (an index
//! that skips, a producer's sequence that jumps) and what the processors' syncs list.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
};

use sluice_schema::{ResponseRecord, properties};
use tokio::{sync::mpsc, time::Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{
    deaf::{DEAF_TICK, Deafness},
    syncs::Syncs,
};
use crate::{
    bus::{Delivery, Origin, Position},
    lock,
    sync::SyncState,
    telemetry::RuntimeMetrics,
};

/// What the router hands a stream.
pub(super) enum Routed<R> {
    Record(R),
    Restarted,
    Undecodable(String),
    /// The broker did not store the request.
    NotStored(String),
    /// Record `expected` was skipped: `received` came instead.
    Lost {
        expected: u64,
        received: u64,
    },
    /// The broker dropped records of the producer this stream's last record came from.
    Suspect,
    /// A sync showed the stream cannot end any more (why).
    Gone(String),
}

/// Attempts a stream has moved on from, whose late records are skipped and whose listings in
/// processors' syncs are not counted. An agent's dialog moves on at every step, and a
/// finished step stays listed for `sync::DONE_FOR`: far more than an agent's steps in that
/// time.
const ABANDONED_ATTEMPTS: usize = 64;

/// A stream's route: where its records go and what the router knows of it.
pub(super) struct Route<R> {
    pub(super) tx: mpsc::UnboundedSender<Routed<R>>,
    pub(super) attempt: Option<String>,
    pub(super) abandoned: VecDeque<String>,
    /// The [`properties::SEQ`] due next in the current attempt.
    pub(super) next_seq: u64,
    /// The producer of the last record routed here.
    pub(super) producer: Option<Arc<str>>,
    /// The current attempt lost a record on a durable topic: its records are skipped until
    /// the next attempt.
    pub(super) broken: bool,
    /// When the broker confirmed it stored the request.
    pub(super) stored_at: Option<Instant>,
    /// Some sync listed this stream.
    pub(super) listed: bool,
    /// Some record of this stream arrived.
    pub(super) received_any: bool,
    /// The processor instance whose sync listed this stream as open last.
    pub(super) listed_by: Option<Arc<str>>,
    /// The last record or listing of this stream.
    pub(super) last_seen: Instant,
}

impl<R> Route<R> {
    pub(super) fn new(tx: mpsc::UnboundedSender<Routed<R>>) -> Self {
        Self {
            tx,
            attempt: None,
            abandoned: VecDeque::new(),
            next_seq: 0,
            producer: None,
            broken: false,
            stored_at: None,
            listed: false,
            received_any: false,
            listed_by: None,
            last_seen: Instant::now(),
        }
    }

    /// What the route knows of its request, for a log line: whether the broker confirmed it
    /// stored it, whether a sync listed it and who answers it, what arrived.
    pub(super) fn describe(&self) -> String {
        let ago = |t: Instant| format!("{:.1} s ago", t.elapsed().as_secs_f64());
        format!(
            "stored: {}, listed: {}, listed as open by: {}, records received: {} (next {}), last record or listing {}",
            self.stored_at.map_or("not confirmed".to_owned(), ago),
            self.listed,
            self.listed_by.as_deref().unwrap_or("none"),
            self.received_any,
            self.next_seq,
            ago(self.last_seen),
        )
    }

    /// Moves on to `attempt`; the current one is abandoned.
    fn switch_to(&mut self, attempt: &str) {
        if let Some(old) = self.attempt.replace(attempt.to_owned()) {
            if self.abandoned.len() == ABANDONED_ATTEMPTS {
                self.abandoned.pop_front();
            }
            self.abandoned.push_back(old);
        }
        self.next_seq = 0;
        self.broken = false;
    }
}

/// The last sequence id seen of each producer on a response subscription, to see the broker
/// drop records (a jump in a producer's sequence). Bounded: producers come and go with
/// processor replicas.
#[derive(Default)]
struct ProducerSequences(HashMap<Arc<str>, u64>);

impl ProducerSequences {
    const CAPACITY: usize = 4096;

    /// Records `origin`; returns how many of its producer's records were skipped since the
    /// last one seen (0 for the first one seen, or a resent one).
    fn observe(&mut self, origin: &Origin) -> u64 {
        if let Some(last) = self.0.get_mut(&origin.producer) {
            let skipped = origin.sequence.saturating_sub(*last).saturating_sub(1);
            *last = (*last).max(origin.sequence);
            return skipped;
        }
        if self.0.len() >= Self::CAPACITY {
            // Forgetting a producer only costs detecting a gap in its next record.
            self.0.clear();
        }
        self.0.insert(origin.producer.clone(), origin.sequence);
        0
    }
}

/// The routes of a router's open streams, by request id.
pub(super) type Routes<R> = Arc<Mutex<HashMap<String, Route<R>>>>;

/// What a router routes for.
pub(super) struct Router {
    pub(super) metrics: Option<RuntimeMetrics>,
    pub(super) service: String,
    /// This instance's response subscription: the answers to its own requests name it;
    /// `None` routes every instance's (a resumed stream's reader).
    pub(super) me: Option<String>,
    pub(super) lossy: bool,
    /// Where to note the position of each record read (the client's own router).
    pub(super) latest: Option<Arc<Mutex<Option<Position>>>>,
}

/// Routes what `subscription` delivers to `routes` until `stop`, then ends every open
/// stream and unsubscribes.
pub(super) async fn route<R: ResponseRecord>(
    mut subscription: Box<dyn crate::bus::Subscription>,
    routes: Routes<R>,
    stop: CancellationToken,
    router: Router,
) {
    let Router {
        metrics,
        service,
        me,
        lossy,
        latest,
    } = router;
    let mut seen = Seen::default();
    let mut deaf = Deafness::default();
    // Counts seconds of silence in ticks, not in elapsed time: a router whose process stalled
    // (its runtime busy) sees one tick for the whole stall, then the deliveries that queued.
    let mut ticks = tokio::time::interval(DEAF_TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        let delivery = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            d = subscription.next() => d,
            // Last: a delivery already there counts first. Only lossy topics have syncs.
            _ = ticks.tick(), if lossy => {
                let open = !lock(&routes).is_empty();
                if let Some(why) = deaf.tick(seen.syncs.last_sync, open)
                    && subscription.renew(&why)
                {
                    warn!(service, reason = %why, "re-subscribing to the response topic");
                    if let Some(m) = &metrics {
                        m.client_resubscribed(&service);
                    }
                }
                continue;
            }
        };
        deaf.heard();
        match delivery {
            Some(Ok(d)) => {
                if let (Some(latest), Some(position)) = (&latest, d.position()) {
                    *lock(latest) = Some(position);
                }
                dispatch(
                    d,
                    &routes,
                    &mut seen,
                    metrics.as_ref(),
                    &service,
                    me.as_deref(),
                    lossy,
                );
            }
            Some(Err(e)) => warn!(service, error = %e, "receiving responses failed"),
            None => {
                // Not asked to stop: the subscription's task is gone (it re-subscribes on its
                // own through broker faults), so nothing will route responses any more.
                if !stop.is_cancelled() {
                    tracing::error!(
                        service,
                        "the response subscription ended; open streams end now"
                    );
                }
                break;
            }
        }
    }
    // Dropping the routes' senders ends every open stream with `Closed`.
    lock(&routes).clear();
    subscription.unsubscribe().await;
}

/// Routes one delivery of the response subscription: notes what it shows of losses, then
/// hands a record to the stream waiting for its id.
fn dispatch<R: ResponseRecord>(
    delivery: Delivery,
    routes: &Routes<R>,
    seen: &mut Seen,
    metrics: Option<&RuntimeMetrics>,
    service: &str,
    me: Option<&str>,
    lossy: bool,
) {
    // Every record on the subscription counts here, other clients' too: a drop is a drop
    // whoever's record it was, and this record's own producer may be a stream of ours.
    if let Some(origin) = delivery.origin() {
        note_producer(origin, routes, seen, metrics, service, lossy);
    }
    if delivery.property(properties::SYNC).is_some() {
        // A processor's sync: its sequence has done its work above; what it lists, here.
        note_sync(&delivery, routes, seen, service, lossy);
        delivery.ack();
        return;
    }
    if delivery.property(properties::SEQ).is_none() {
        // A record of a service that does not sync (TrustGraph's own processors): a request
        // no sync lists may be theirs.
        seen.syncs.foreign_records = true;
    }
    if let Some(me) = me
        && delivery
            .property(properties::REPLY_TO)
            .is_some_and(|to| to != me)
    {
        // Another client's answer on the shared response topic: not ours, not a problem.
        delivery.ack();
        return;
    }
    let unroutable = || {
        if let Some(m) = metrics {
            m.client_unroutable(service);
        }
    };
    let Some(id) = delivery.property(properties::ID) else {
        unroutable();
        delivery.ack();
        return;
    };
    let attempt = delivery.property(properties::ATTEMPT);
    let mut routes = lock(routes);
    let Some(route) = routes.get_mut(id) else {
        unroutable();
        drop(routes);
        delivery.ack();
        return;
    };
    if let Some(attempt) = attempt
        && route.abandoned.iter().any(|a| a == attempt)
    {
        // A late record of an attempt the stream moved on from (it was still running when the
        // request was redelivered): not part of the answer.
        drop(routes);
        delivery.ack();
        return;
    }
    let decoded = serde_json::from_slice::<R>(delivery.payload());
    let (terminal, items) = match decoded {
        Ok(record) => match place(route, &delivery, record, service, id, lossy) {
            Some(placed) => placed,
            None => {
                drop(routes);
                delivery.ack();
                return;
            }
        },
        Err(e) => (true, vec![Routed::Undecodable(e.to_string())]),
    };
    let mut gone = false;
    for item in items {
        gone |= route.tx.send(item).is_err();
    }
    if terminal || gone {
        routes.remove(id);
    }
    drop(routes);
    // Acked on receipt: a response is only useful to this instance, now.
    delivery.ack();
}

/// Notes `origin`'s place in its producer's sequence. On a lossy topic a jump (the broker
/// dropped records of that producer) marks every stream whose last record came from it as
/// suspect.
fn note_producer<R>(
    origin: &Origin,
    routes: &Routes<R>,
    seen: &mut Seen,
    metrics: Option<&RuntimeMetrics>,
    service: &str,
    lossy: bool,
) {
    let skipped = seen.producers.observe(origin);
    if skipped > 0 && lossy {
        debug!(service, producer = %origin.producer, skipped, "the broker dropped response records");
        if let Some(m) = metrics {
            m.client_dropped(service, skipped);
        }
        for route in lock(routes).values() {
            if route.producer.as_ref() == Some(&origin.producer) {
                let _ = route.tx.send(Routed::Suspect);
            }
        }
    }
}

/// Notes a processor's sync: when it arrived and, on a lossy topic, the streams its state
/// shows can no longer end.
fn note_sync<R>(
    delivery: &Delivery,
    routes: &Routes<R>,
    seen: &mut Seen,
    service: &str,
    lossy: bool,
) {
    seen.syncs.last_sync = Some(Instant::now());
    if lossy {
        match delivery
            .property(properties::SYNC_STATE)
            .map(serde_json::from_str::<SyncState>)
        {
            Some(Ok(state)) => seen.syncs.check(&state, routes, service),
            Some(Err(e)) => {
                debug!(service, error = %e, "a sync's state could not be read");
                seen.syncs.stateless_sync_seen();
            }
            // An older sluice: it does not say which requests it took.
            None => seen.syncs.stateless_sync_seen(),
        }
    }
}

/// Places a decoded `record` of request `id` in its stream `route`: the items to hand the
/// stream (a restart first when a new attempt starts it over; a loss instead of the record
/// when its index skipped on a lossy topic) and whether the stream ends with them. `None`
/// when the record is not passed on: the rest of an attempt that lost a record on a durable
/// topic, a record stored twice, or the skipped index that breaks such an attempt.
fn place<R: ResponseRecord>(
    route: &mut Route<R>,
    delivery: &Delivery,
    record: R,
    service: &str,
    id: &str,
    lossy: bool,
) -> Option<(bool, Vec<Routed<R>>)> {
    let mut items = Vec::with_capacity(2);
    if let Some(attempt) = delivery.property(properties::ATTEMPT) {
        match route.attempt.as_deref() {
            None => route.attempt = Some(attempt.to_owned()),
            Some(current) if current == attempt => {}
            // A new attempt that continues the current one (an agent's next step)
            // reads on; any other new attempt starts the stream over.
            Some(current) => {
                if delivery.property(properties::CONTINUES) != Some(current) {
                    items.push(Routed::Restarted);
                }
                route.switch_to(attempt);
            }
        }
    }
    route.producer = delivery.origin().map(|o| o.producer.clone());
    route.last_seen = Instant::now();
    route.received_any = true;
    if route.broken {
        // The rest of an attempt that lost a record on a durable topic.
        return None;
    }
    match delivery
        .property(properties::SEQ)
        .and_then(|s| s.parse::<u64>().ok())
    {
        // Records from a service that does not number them (TrustGraph's) pass.
        None => {}
        Some(seq) if seq == route.next_seq => route.next_seq += 1,
        // Stored twice (a send retried after the broker had taken it).
        Some(seq) if seq < route.next_seq => return None,
        Some(seq) if lossy => {
            items.push(Routed::Lost {
                expected: route.next_seq,
                received: seq,
            });
        }
        Some(seq) => {
            warn!(service, request_id = %id, expected = route.next_seq, received = seq,
                  "a record of this attempt was not stored; waiting for the next attempt");
            route.broken = true;
            return None;
        }
    }
    let terminal = record.is_terminal() || items.iter().any(|i| matches!(i, Routed::Lost { .. }));
    if !items.iter().any(|i| matches!(i, Routed::Lost { .. })) {
        items.push(Routed::Record(record));
    }
    Some((terminal, items))
}

/// What a client's router learned from the messages on its topic, to see losses.
#[derive(Default)]
struct Seen {
    producers: ProducerSequences,
    syncs: Syncs,
}

#[cfg(test)]
mod tests;
