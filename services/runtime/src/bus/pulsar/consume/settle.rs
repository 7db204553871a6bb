//! What the consumer's loop keeps about settling: how often each message came, and the
//! acks of an in-order subscriber held to go out as one cumulative ack.

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use pulsar::message::proto::MessageIdData;

use crate::bus::Settlement;

/// Counts how often this process has seen each message, because pulsar-rs does not pass on
/// the broker's redelivery count. Bounded: the oldest entries are forgotten first.
pub(super) struct RedeliveryTracker {
    seen: HashMap<(u64, u64, i32, i32), u32>,
    order: VecDeque<(u64, u64, i32, i32)>,
    capacity: usize,
}

impl RedeliveryTracker {
    pub(super) fn new(capacity: usize) -> Self {
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
    pub(super) fn observe(&mut self, id: &MessageIdData) -> u32 {
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

    pub(super) fn forget(&mut self, id: &MessageIdData) {
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
pub(super) struct InOrderAcks {
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

    pub(super) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            last: Vec::new(),
            held: 0,
        }
    }

    pub(super) fn full(&self) -> bool {
        self.held >= Self::MAX_HELD
    }

    /// Keeps an ack to send cumulatively; gives back a settlement to apply on its own.
    pub(super) fn take(
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

    pub(super) fn due(&self) -> bool {
        !self.last.is_empty()
    }

    pub(super) fn drain(&mut self) -> std::vec::Drain<'_, (Arc<str>, MessageIdData)> {
        self.held = 0;
        self.last.drain(..)
    }
}

#[cfg(test)]
mod tests;
