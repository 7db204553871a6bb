//! What the replicas share: this replica's snapshots published to the limits topic, the
//! others' read from it, judged (sealed, of a known key, not ahead of the clock) and taken,
//! and the totals over all of them.

use super::*;

/// A snapshot on the shared topic: its JSON is the message's payload, sealed in the
/// [`SEAL_PROPERTY`] property.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Snapshot {
    pub(super) replica: String,
    pub(super) key: String,
    /// Increases with every snapshot a replica publishes: an older one read late is ignored.
    /// The replica's clock in microseconds (or one more than its last, if that is more), so
    /// that another replica can tell a real one from one far ahead.
    pub(super) seq: u64,
    pub(super) counts: Counts,
    /// When it was published (Unix ms): how late the others read it, for
    /// `sluice_gateway_limit_share_delay_seconds`.
    #[serde(default)]
    pub(super) sent_ms: u64,
}

impl Limiter {
    /// Judges a message read from the shared topic (its payload and its seal property) and
    /// takes the snapshot it holds if it is one to believe: sealed by a replica, of a key of
    /// `sharing`'s keys file, with a sequence number and counts that are not ahead of this
    /// replica's clock, within [`MAX_REPLICAS_PER_KEY`]. What is not believed is counted by
    /// why, and said at debug level only (a flood of forgeries must not flood the log).
    pub(super) fn receive(
        &self,
        payload: &[u8],
        seal: Option<&str>,
        sharing: &Sharing,
        now: &Now,
    ) -> Result<(), Refused> {
        let verdict = self.judge(payload, seal, sharing, now);
        if let Err(reason) = verdict {
            debug!(reason, "a message on the limits topic was not taken");
            self.metrics.limit_snapshot_refused(reason);
        }
        verdict
    }

    pub(super) fn judge(
        &self,
        payload: &[u8],
        seal: Option<&str>,
        sharing: &Sharing,
        now: &Now,
    ) -> Result<(), Refused> {
        let Some(seal) = seal else {
            return Err("unsealed");
        };
        if !sharing.seal.verify_encoded(SNAPSHOT_SEAL, &[payload], seal) {
            return Err("seal");
        }
        let snapshot: Snapshot = serde_json::from_slice(payload).map_err(|_| "malformed")?;
        if snapshot.replica == RETIRED {
            return Err("malformed");
        }
        if snapshot.replica == self.replica {
            return Ok(());
        }
        if !sharing.keys.ring().has_name(&snapshot.key) {
            return Err("unknown-key");
        }
        if snapshot.seq > now.micros().saturating_add(SEQ_AHEAD_MICROS) {
            return Err("seq");
        }
        self.take(snapshot, now)
    }

    /// Takes a snapshot that is a replica's.
    pub(super) fn take(&self, snapshot: Snapshot, now: &Now) -> Result<(), Refused> {
        if snapshot.replica == self.replica {
            return Ok(());
        }
        let now_ms = (now.secs * 1000.0) as u64;
        // Snapshots replayed at start are old by design; a live one tells the sharing's delay.
        if now_ms >= snapshot.sent_ms && now_ms - snapshot.sent_ms < 60_000 {
            self.metrics
                .limit_share_delay((now_ms - snapshot.sent_ms) as f64 / 1000.0);
        }
        // Counts from a clock far ahead would hold a key at its limit for as long: they are
        // not taken.
        if snapshot.counts.minute > now.minute.saturating_add(2)
            || snapshot.counts.month > now.month.saturating_add(1)
        {
            return Err("ahead");
        }
        let mut state = self.lock();
        let key: Arc<str> = match state.peers.get_key_value(snapshot.key.as_str()) {
            Some((k, _)) => k.clone(),
            None => Arc::from(snapshot.key.as_str()),
        };
        let replicas = state.peers.entry(key.clone()).or_default();
        match replicas.get(&snapshot.replica) {
            Some((seq, _)) if *seq >= snapshot.seq => return Ok(()),
            Some(_) => {}
            None => {
                if replicas.len() - usize::from(replicas.contains_key(RETIRED))
                    >= MAX_REPLICAS_PER_KEY
                    && !retire_one(replicas, now)
                {
                    return Err("replicas");
                }
            }
        }
        replicas.insert(snapshot.replica, (snapshot.seq, snapshot.counts));
        self.export(&state, &key, now);
        Ok(())
    }

    /// The other replicas with a snapshot from this minute or the last: those sharing now.
    pub(super) fn live_peers(&self, now: &Now) -> usize {
        let state = self.lock();
        let mut live = HashSet::new();
        for replicas in state.peers.values() {
            for (replica, (_, c)) in replicas {
                if replica != RETIRED && c.fresh(now) {
                    live.insert(replica.as_str());
                }
            }
        }
        live.len()
    }

    /// Exports `key`'s totals (requests in flight, tokens used today and this month) as
    /// this replica sees them now: on every change of its own counts or of a peer's, and
    /// every second, as peers' snapshots age.
    pub(super) fn export(&self, state: &State, key: &str, now: &Now) {
        let total = state.total(key, now);
        self.metrics
            .key_totals(key, total.in_flight, total.day_tokens, total.month_tokens);
    }

    /// Exports every key's totals (see [`Self::export`]).
    pub(super) fn export_all(&self, now: &Now) {
        let state = self.lock();
        let keys: HashSet<&Arc<str>> = state.mine.keys().chain(state.peers.keys()).collect();
        for key in keys {
            self.export(&state, key, now);
        }
    }

    /// Drops what can no longer count: other replicas' snapshots from before this month, and
    /// those of keys no longer in the keys file.
    pub(super) fn forget_old(&self, now: &Now, keys: &Keys) {
        let ring = keys.ring();
        let mut state = self.lock();
        state.peers.retain(|k, _| ring.has_name(k));
        for replicas in state.peers.values_mut() {
            replicas.retain(|_, (_, c)| c.month >= now.month);
        }
        state.peers.retain(|_, r| !r.is_empty());
    }

    /// The snapshots to publish now: `which` keys.
    pub(super) fn snapshots(&self, which: Which) -> Vec<(String, Snapshot)> {
        let now = Now::wall();
        let mut state = self.lock();
        let keys: Vec<Arc<str>> = match which {
            Which::Changed => state.dirty.iter().cloned().collect(),
            Which::InFlight | Which::All => state
                .mine
                .iter()
                .filter(|(_, c)| match which {
                    Which::InFlight => c.in_flight > 0,
                    _ => c.at(&now).holds_usage(),
                })
                .map(|(k, _)| k.clone())
                .chain(state.dirty.iter().cloned())
                .collect::<HashSet<_>>()
                .into_iter()
                .collect(),
        };
        state.dirty.clear();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let counts = state.mine.get(&key).copied().unwrap_or_default().at(&now);
            // The clock, so that the others can refuse a number far ahead of theirs; one more
            // than the last if the clock went back.
            state.seq = state.seq.saturating_add(1).max(now.micros());
            out.push((
                format!("{key}/{}", self.replica),
                Snapshot {
                    replica: self.replica.clone(),
                    key: key.to_string(),
                    seq: state.seq,
                    counts,
                    sent_ms: 0,
                },
            ));
        }
        out
    }

    pub(super) fn mark_dirty(&self, key: &str) {
        let mut state = self.lock();
        if let Some((k, _)) = state.mine.get_key_value(key) {
            let k = k.clone();
            state.dirty.insert(k);
        }
    }

    /// Shares this replica's counts through `topic` and reads the others' until `stop`.
    /// `replayed` is told once the snapshots already on the topic were read (or
    /// [`REPLAY_WAIT`] passed).
    pub(crate) async fn share(
        self: Arc<Self>,
        bus: Arc<dyn Bus>,
        topic: String,
        sharing: Sharing,
        stop: CancellationToken,
        replayed: tokio::sync::oneshot::Sender<()>,
    ) {
        let reading = tokio::spawn(self.clone().read(
            bus.clone(),
            topic.clone(),
            sharing.clone(),
            stop.clone(),
            replayed,
        ));
        self.publish(bus, topic, sharing, stop).await;
        reading.abort();
    }

    pub(super) async fn read(
        self: Arc<Self>,
        bus: Arc<dyn Bus>,
        topic: String,
        sharing: Sharing,
        stop: CancellationToken,
        replayed: tokio::sync::oneshot::Sender<()>,
    ) {
        let mut replayed = Some(replayed);
        let started = tokio::time::Instant::now();
        let options = SubscribeOptions {
            kind: SubscriptionKind::Exclusive,
            start: StartPosition::Replay,
            prefetch: 1000,
            consumer_name: None,
            acks_in_order: false,
        };
        let subscription = format!("limits-{}", self.replica);
        // A broker down or a role without the grant: asked again, less and less often, so
        // that the log gets a line every half minute at most.
        let mut backoff = Backoff::new(SHARE_RETRY_MAX);
        loop {
            let mut sub = match bus.subscribe(&topic, &subscription, options.clone()).await {
                Ok(s) => s,
                Err(e) => {
                    warn!(topic, error = %e, "cannot read the other replicas' limit state; retrying");
                    self.metrics.limit_share_failure();
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(backoff.next_delay()) => continue,
                    }
                }
            };
            loop {
                let quiet = tokio::time::sleep(REPLAY_QUIET);
                let next = tokio::select! {
                    () = stop.cancelled() => {
                        sub.close().await;
                        return;
                    }
                    next = sub.next() => next,
                    () = quiet, if replayed.is_some() => {
                        if let Some(tx) = replayed.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                };
                if replayed.is_some() && started.elapsed() > REPLAY_WAIT {
                    warn!(
                        topic,
                        "the limit state was not read within {REPLAY_WAIT:?}; admitting with what was read so far"
                    );
                    if let Some(tx) = replayed.take() {
                        let _ = tx.send(());
                    }
                }
                match next {
                    Some(Ok(delivery)) => {
                        backoff = Backoff::new(SHARE_RETRY_MAX);
                        // Not believed: dropped (counted by `receive`).
                        let _ = self.receive(
                            delivery.payload(),
                            delivery.property(SEAL_PROPERTY),
                            &sharing,
                            &Now::wall(),
                        );
                        delivery.ack();
                    }
                    Some(Err(e)) => {
                        warn!(topic, error = %e, "reading the limit state failed; subscribing again");
                        self.metrics.limit_share_failure();
                        break;
                    }
                    None => break,
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }

    pub(super) async fn publish(
        &self,
        bus: Arc<dyn Bus>,
        topic: String,
        sharing: Sharing,
        stop: CancellationToken,
    ) {
        let mut republish = tokio::time::interval(REPUBLISH_EVERY);
        republish.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut in_flight = tokio::time::interval(IN_FLIGHT_EVERY);
        in_flight.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut gauge = tokio::time::interval(Duration::from_secs(1));
        gauge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut publisher = None;
        let mut backoff = Backoff::new(SHARE_RETRY_MAX);
        loop {
            let which = tokio::select! {
                () = stop.cancelled() => return,
                () = self.changed.notified() => Which::Changed,
                _ = republish.tick() => Which::All,
                _ = in_flight.tick() => Which::InFlight,
                _ = gauge.tick() => {
                    let now = Now::wall();
                    self.metrics.limit_peers(self.live_peers(&now));
                    self.export_all(&now);
                    continue;
                }
            };
            if which == Which::All {
                self.forget_old(&Now::wall(), &sharing.keys);
            }
            let p = match &publisher {
                Some(p) => p,
                None => match bus.publisher(&topic).await {
                    Ok(p) => publisher.insert(p),
                    Err(e) => {
                        warn!(topic, error = %e, "cannot publish this replica's limit state; retrying");
                        self.metrics.limit_share_failure();
                        self.changed.notify_one();
                        tokio::select! {
                            () = stop.cancelled() => return,
                            () = tokio::time::sleep(backoff.next_delay()) => continue,
                        }
                    }
                },
            };
            // One snapshot per key in flight at a time: what changes meanwhile is coalesced
            // into the next one.
            for (message_key, mut snapshot) in self.snapshots(which) {
                snapshot.sent_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                let payload = match serde_json::to_vec(&snapshot) {
                    Ok(p) => p,
                    Err(_) => continue,
                };
                let seal = sharing
                    .seal
                    .seal(SNAPSHOT_SEAL, &[&payload])
                    .encode(SNAPSHOT_SEAL_BYTES);
                let message = Message::new(payload)
                    .with_key(message_key)
                    .with_property(SEAL_PROPERTY, seal);
                let sent = match p.send(message).await {
                    Ok(receipt) => receipt.await,
                    Err(e) => Err(e),
                };
                match sent {
                    Ok(()) => backoff = Backoff::new(SHARE_RETRY_MAX),
                    Err(e) => {
                        warn!(topic, error = %e, "publishing this replica's limit state failed; it is published again");
                        self.metrics.limit_share_failure();
                        self.mark_dirty(&snapshot.key);
                        self.changed.notify_one();
                        tokio::select! {
                            () = stop.cancelled() => return,
                            () = tokio::time::sleep(backoff.next_delay()) => {}
                        }
                    }
                }
            }
        }
    }
}

/// The snapshot seal's length, in bytes: all of it (a snapshot is not a header).
pub(super) const SNAPSHOT_SEAL_BYTES: usize = 32;

/// Which keys' snapshots to publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Which {
    /// Those whose counts changed.
    Changed,
    /// Those with requests in flight (so that the others go on counting them), and those that
    /// changed.
    InFlight,
    /// Every one that holds usage (so that the topic's retention never drops the day's and
    /// the month's counts), and those that changed.
    All,
}

/// Folds the counts of one replica not heard of for [`GONE_AFTER`] minutes (the longest gone)
/// into the [`RETIRED`] sum, making room for another; `false` if there is none. Only its day's
/// and month's tokens still count, and the sum keeps them. A replica folded that turns out to
/// be alive (cut off from the broker for that long) is counted twice once it is back: too
/// much rather than too little.
pub(super) fn retire_one(replicas: &mut HashMap<String, (u64, Counts)>, now: &Now) -> bool {
    let gone = replicas
        .iter()
        .filter(|(r, (_, c))| {
            r.as_str() != RETIRED && c.minute.saturating_add(GONE_AFTER) < now.minute
        })
        .min_by_key(|(_, (_, c))| c.minute)
        .map(|(r, _)| r.clone());
    let Some(gone) = gone else {
        return false;
    };
    let Some((_, counts)) = replicas.remove(&gone) else {
        return false;
    };
    let counts = counts.at(now);
    let retired = replicas
        .entry(RETIRED.to_owned())
        .or_insert((0, Counts::default()));
    let mut sum = retired.1.at(now);
    sum.day_tokens = sum.day_tokens.saturating_add(counts.day_tokens);
    sum.month_tokens = sum.month_tokens.saturating_add(counts.month_tokens);
    // What still counts is the day's and the month's: the minute's has faded, and a gone
    // replica holds no place in flight.
    sum.requests = 0;
    sum.tokens = 0;
    sum.prev_requests = 0;
    sum.prev_tokens = 0;
    sum.in_flight = 0;
    retired.1 = sum;
    true
}

/// A replica reading the shared topic, for the fuzz target (`fuzz/src/bin/shared.rs`): it
/// shares the limits of the keys `k` and `l` (a request and a token limit each) with a secret
/// of its own, and judges any payload as a snapshot sealed with it (the seal made here, so
/// that the fuzzer reaches the JSON and what is done with what it says), then admits a
/// request of `k` against what it believes. The same limiter reads every input, so that
/// snapshots add up as on the topic.
pub struct SnapshotReader {
    pub(super) limiter: Arc<Limiter>,
    pub(super) sharing: Sharing,
    pub(super) key: Key,
}

impl SnapshotReader {
    /// A replica with no snapshots read yet. It fails only if its own fixed keys, metrics or
    /// seal were refused (a bug), so its error is whatever refused them.
    pub fn new() -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let text: String = ["k", "l"]
            .iter()
            .map(|n| {
                format!(
                    "[[keys]]\nname = \"{n}\"\nsha256 = \"{}\"\nrequests_per_minute = 100\n\
                     tokens_per_day = 1000000\n",
                    crate::keys::hash_hex(n)
                )
            })
            .collect();
        let ring = crate::keys::KeyRing::parse(&text)?;
        let key = ring
            .find("k")
            .map(|k| (*k).clone())
            .ok_or("no key k in the reader's keys")?;
        let registry = prometheus::Registry::new();
        let metrics = GatewayMetrics::register(&registry)?;
        let secret = sluice_runtime::secret::Secret::new("the-fuzz-targets-limits-secret-0123");
        Ok(Self {
            limiter: Arc::new(Limiter::new(metrics)),
            sharing: Sharing {
                seal: SealKey::new(&secret, "fuzz")?,
                keys: Arc::new(Keys::fixed(ring)),
            },
            key,
        })
    }

    /// Judges `payload` as a sealed snapshot read at `now_secs` (Unix seconds), then admits a
    /// request of `k` at that time: why the snapshot was refused, if it was, and the most
    /// replicas now held of one key.
    pub fn read(&self, payload: &[u8], now_secs: u32) -> (Option<&'static str>, usize) {
        let now = Now::at(f64::from(now_secs));
        let seal = self
            .sharing
            .seal
            .seal(SNAPSHOT_SEAL, &[payload])
            .encode(SNAPSHOT_SEAL_BYTES);
        let refused = self
            .limiter
            .receive(payload, Some(&seal), &self.sharing, &now)
            .err();
        let ask = Ask::Request {
            max_tokens: Some(100),
            body_bytes: 0,
        };
        drop(self.limiter.admit_at(&self.key, ask, now));
        let most = self
            .limiter
            .lock()
            .peers
            .values()
            .map(HashMap::len)
            .max()
            .unwrap_or(0);
        (refused, most)
    }
}
