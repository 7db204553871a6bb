use super::*;

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
