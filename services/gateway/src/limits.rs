//! Per-key limits that hold across gateway replicas (docs/gateway.md#limits-across-replicas).
//!
//! Each replica counts what it admitted per key (requests, and tokens reserved up front and
//! settled with the real usage when the stream ends) in a sliding minute, a UTC day and a UTC
//! month. It publishes its counts of a key as one snapshot, keyed `<key>/<replica>`, to a
//! shared topic whenever they change, and reads every other replica's snapshots from it. A
//! request is admitted when the sum over all replicas leaves room for it.
//!
//! Why snapshots and not increments: a snapshot says everything its replica counted, so a
//! reader that missed some, or read them twice, still sums right; a replica that starts reads
//! the topic from its beginning (Pulsar's compacted view: the latest snapshot per key) and
//! knows the day's and month's usage of replicas that are gone. Snapshots are republished
//! every [`REPUBLISH_EVERY`] so the topic's retention never drops the day's counts.
//!
//! The tolerance: a replica sees another's admissions once their snapshot arrived (one
//! publish and one delivery, a few ms on a healthy broker). Requests admitted meanwhile on
//! two replicas can both pass, so a limit can be exceeded by what the other replicas admit
//! within that delay: at most their concurrent callers of the key. While the broker is
//! unreachable each replica goes on with its own exact counts and the others' last known
//! ones (it does not refuse every caller because the broker is down), so the overshoot is
//! then bounded by one full limit per replica; `sluice_gateway_limit_share_failures_total`
//! says when that happens.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};
use sluice_runtime::{
    backoff::Backoff,
    bus::{Bus, Message, StartPosition, SubscribeOptions, SubscriptionKind},
    reader::Meter,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{keys::Key, metrics::GatewayMetrics};

/// How often every snapshot with a day's or month's usage is published again, well within
/// the topic's retention (`ensure-namespaces` gives response namespaces 60 minutes).
pub const REPUBLISH_EVERY: Duration = Duration::from_secs(5 * 60);

/// How long a starting gateway waits to read the snapshots already published (it admits
/// nobody with a limit meanwhile); the replay counts as done once no snapshot arrived for
/// [`REPLAY_QUIET`].
pub const REPLAY_WAIT: Duration = Duration::from_secs(10);
/// See [`REPLAY_WAIT`].
pub const REPLAY_QUIET: Duration = Duration::from_millis(300);

/// The longest wait between two attempts to reach the limits topic.
const SHARE_RETRY_MAX: Duration = Duration::from_secs(30);

/// The wall clock, cut into the windows limits are counted in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Now {
    /// Seconds since the Unix epoch.
    secs: f64,
    minute: u64,
    day: u64,
    /// Months since January 1970.
    month: u64,
}

impl Now {
    fn at(secs: f64) -> Self {
        let whole = secs.max(0.0) as u64;
        let day = whole / 86_400;
        let (y, m) = civil_month(day);
        Self {
            secs,
            minute: whole / 60,
            day,
            month: (y - 1970) * 12 + (m - 1),
        }
    }

    fn wall() -> Self {
        Self::at(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        )
    }

    /// How far into the minute, 0 to 1.
    fn minute_fraction(&self) -> f64 {
        (self.secs / 60.0).fract()
    }

    fn secs_to_next_day(&self) -> f64 {
        ((self.day + 1) * 86_400) as f64 - self.secs
    }

    fn secs_to_next_month(&self) -> f64 {
        let (y, m) = (1970 + self.month / 12, self.month % 12 + 1);
        let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
        (days_from_civil(y, m, 1) * 86_400) as f64 - self.secs
    }
}

/// The year and month (1-12) of a day since the epoch (Howard Hinnant's civil-from-days).
fn civil_month(days: u64) -> (u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m)
}

/// Days since the epoch of a date (the inverse of [`civil_month`]'s computation).
fn days_from_civil(y: u64, m: u64, d: u64) -> u64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// One replica's counts for one key: the current and the previous minute (a sliding minute
/// weighs the previous one by how much of it still falls in the last 60 s), the day, the
/// month. What a snapshot carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Counts {
    minute: u64,
    requests: u64,
    tokens: u64,
    prev_requests: u64,
    prev_tokens: u64,
    day: u64,
    day_tokens: u64,
    month: u64,
    month_tokens: u64,
}

impl Counts {
    /// These counts as they stand at `now`: windows that have passed are emptied.
    fn at(self, now: &Now) -> Self {
        let (requests, tokens, prev_requests, prev_tokens) = if self.minute == now.minute {
            (
                self.requests,
                self.tokens,
                self.prev_requests,
                self.prev_tokens,
            )
        } else if self.minute.saturating_add(1) == now.minute {
            (0, 0, self.requests, self.tokens)
        } else if self.minute == now.minute.saturating_add(1) {
            // A replica whose clock runs ahead into the next minute: all it counted is recent.
            (
                self.requests.saturating_add(self.prev_requests),
                self.tokens.saturating_add(self.prev_tokens),
                0,
                0,
            )
        } else {
            (0, 0, 0, 0)
        };
        Self {
            minute: now.minute,
            requests,
            tokens,
            prev_requests,
            prev_tokens,
            day: now.day,
            day_tokens: if self.day == now.day {
                self.day_tokens
            } else {
                0
            },
            month: now.month,
            month_tokens: if self.month == now.month {
                self.month_tokens
            } else {
                0
            },
        }
    }

    fn add(&mut self, other: &Counts) {
        self.requests = self.requests.saturating_add(other.requests);
        self.tokens = self.tokens.saturating_add(other.tokens);
        self.prev_requests = self.prev_requests.saturating_add(other.prev_requests);
        self.prev_tokens = self.prev_tokens.saturating_add(other.prev_tokens);
        self.day_tokens = self.day_tokens.saturating_add(other.day_tokens);
        self.month_tokens = self.month_tokens.saturating_add(other.month_tokens);
    }

    /// Whether a snapshot of these counts is worth keeping on the topic.
    fn holds_usage(&self) -> bool {
        self.day_tokens > 0 || self.month_tokens > 0 || self.requests > 0
    }
}

/// A snapshot on the shared topic.
#[derive(Debug, Serialize, Deserialize)]
struct Snapshot {
    replica: String,
    key: String,
    /// Increases with every snapshot a replica publishes: an older one read late is ignored.
    seq: u64,
    counts: Counts,
    /// When it was published (Unix ms): how late the others read it, for
    /// `sluice_gateway_limit_share_delay_seconds`.
    #[serde(default)]
    sent_ms: u64,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Limited {
    /// `requests` or `tokens`: which limit (OpenAI's `type` for rate limits).
    pub(crate) what: &'static str,
    /// For the caller; names the key and the limit, never the key itself.
    pub(crate) message: String,
    /// Whole seconds until it can succeed; `None` when waiting cannot help (a request that
    /// reserves more than the limit allows at all).
    pub(crate) retry_after: Option<u64>,
    /// The daily or monthly quota, not a per-minute rate.
    pub(crate) quota: bool,
}

#[derive(Default)]
struct State {
    /// This replica's counts.
    mine: HashMap<Arc<str>, Counts>,
    /// The last snapshot of every other replica, per key: (seq, counts).
    peers: HashMap<Arc<str>, HashMap<String, (u64, Counts)>>,
    seq: u64,
    /// Keys whose counts changed since they were last published.
    dirty: HashSet<Arc<str>>,
}

/// The limits of every key on this replica, and the state shared with the others.
pub(crate) struct Limiter {
    replica: String,
    state: Mutex<State>,
    changed: Notify,
    metrics: GatewayMetrics,
}

/// The sliding-minute estimate of a count: the previous minute weighed by how much of it is
/// still within the last 60 s.
fn sliding(current: u64, previous: u64, into: f64) -> f64 {
    previous as f64 * (1.0 - into) + current as f64
}

/// Seconds until `sliding(current, previous) + need <= limit`, when it is not now.
fn minute_wait(current: u64, previous: u64, need: u64, limit: u64, now: &Now) -> u64 {
    let into = now.minute_fraction();
    let secs = if current.saturating_add(need) > limit || previous == 0 {
        // Not this minute. In the next, this minute's count is the weighed one, and it fades
        // until it leaves room for `need`.
        let fade = if current == 0 {
            0.0
        } else {
            (1.0 - limit.saturating_sub(need) as f64 / current as f64).max(0.0)
        };
        (1.0 - into) * 60.0 + fade * 60.0
    } else {
        let room = (limit - current - need) as f64;
        let into_needed = 1.0 - room / previous as f64;
        (into_needed - into) * 60.0
    };
    // Less a rounding error's worth, so that 5.000000001 s reads as 5.
    ((secs - 1e-6).ceil() as u64).max(1)
}

impl Limiter {
    pub(crate) fn new(metrics: GatewayMetrics) -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "gateway".into());
        Self {
            // Unique per process: a restarted replica does not take over the snapshots of its
            // former self, which keep counting for the day and the month.
            replica: format!("{host}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Admits a request of `key` reserving `reserve` tokens (its `max_tokens`, else the key's
    /// default), or says why not. The admission settles the reservation when dropped.
    pub(crate) fn admit(
        self: &Arc<Self>,
        key: &Key,
        reserve: Option<u64>,
    ) -> Result<Admission, Limited> {
        self.admit_at(key, reserve, Now::wall())
    }

    fn admit_at(
        self: &Arc<Self>,
        key: &Key,
        reserve: Option<u64>,
        now: Now,
    ) -> Result<Admission, Limited> {
        let limits = key.limits;
        let reserve = reserve.unwrap_or(limits.reserve_tokens);
        let mut state = self.lock();
        let mine = state
            .mine
            .get(&key.name)
            .copied()
            .unwrap_or_default()
            .at(&now);
        let mut total = mine;
        if let Some(peers) = state.peers.get(&key.name) {
            for (_, c) in peers.values() {
                total.add(&c.at(&now));
            }
        }
        let into = now.minute_fraction();
        let name = &key.name;
        // Every limit is checked: the caller hears of the one that keeps it waiting longest
        // (a Retry-After that would only meet the next limit helps nobody).
        let mut refusals = Vec::new();
        if let Some(rpm) = limits.requests_per_minute
            && sliding(total.requests, total.prev_requests, into) + 1.0 > rpm as f64
        {
            refusals.push(Limited {
                what: "requests",
                message: format!(
                    "the API key {name:?} has reached its limit of {rpm} requests per minute"
                ),
                retry_after: Some(minute_wait(
                    total.requests,
                    total.prev_requests,
                    1,
                    rpm,
                    &now,
                )),
                quota: false,
            });
        }
        if let Some(tpm) = limits.tokens_per_minute {
            if reserve > tpm {
                refusals.push(Limited {
                    what: "tokens",
                    message: format!(
                        "the request reserves {reserve} tokens (its max_tokens, or the key's reserve_tokens), more than the API key {name:?}'s limit of {tpm} tokens per minute"
                    ),
                    retry_after: None,
                    quota: false,
                });
            } else if sliding(total.tokens, total.prev_tokens, into) + reserve as f64 > tpm as f64 {
                refusals.push(Limited {
                    what: "tokens",
                    message: format!(
                        "the API key {name:?} has reached its limit of {tpm} tokens per minute (this request reserves {reserve})"
                    ),
                    retry_after: Some(minute_wait(
                        total.tokens,
                        total.prev_tokens,
                        reserve,
                        tpm,
                        &now,
                    )),
                    quota: false,
                });
            }
        }
        for (limit, used, period, wait) in [
            (
                limits.tokens_per_day,
                total.day_tokens,
                "day",
                now.secs_to_next_day(),
            ),
            (
                limits.tokens_per_month,
                total.month_tokens,
                "month",
                now.secs_to_next_month(),
            ),
        ] {
            if let Some(limit) = limit
                && used.saturating_add(reserve) > limit
            {
                refusals.push(Limited {
                    what: "tokens",
                    message: format!(
                        "the API key {name:?} has used {used} of its {limit} tokens this {period} (UTC); this request reserves {reserve}"
                    ),
                    // A reservation larger than the whole quota never fits.
                    retry_after: (reserve <= limit).then(|| ((wait - 1e-6).ceil() as u64).max(1)),
                    quota: true,
                });
            }
        }
        if let Some(longest) = refusals
            .into_iter()
            .max_by_key(|l| l.retry_after.unwrap_or(u64::MAX))
        {
            return Err(longest);
        }
        let mut counts = mine;
        counts.requests = counts.requests.saturating_add(1);
        counts.tokens = counts.tokens.saturating_add(reserve);
        counts.day_tokens = counts.day_tokens.saturating_add(reserve);
        counts.month_tokens = counts.month_tokens.saturating_add(reserve);
        state.mine.insert(key.name.clone(), counts);
        if limits.any() {
            state.dirty.insert(key.name.clone());
            drop(state);
            self.changed.notify_one();
        }
        Ok(Admission {
            limiter: self.clone(),
            key: key.name.clone(),
            shared: limits.any(),
            reserved: reserve,
            at: now,
            input: 0,
            output: 0,
            ended: false,
        })
    }

    /// Replaces a reservation made at `at` with what the request used.
    fn settle(&self, a: &Admission, now: Now) {
        // Usage comes on the last records: an answer cut short before them (the caller gone,
        // a timeout) is charged at least its reservation, as the provider may well have
        // billed it.
        let reported = a.input.saturating_add(a.output);
        let used = if a.ended {
            reported
        } else {
            reported.max(a.reserved)
        };
        let mut state = self.lock();
        if let Some(c) = state.mine.get_mut(&a.key) {
            let mut rolled = c.at(&now);
            let fix = |n: u64| n.saturating_sub(a.reserved).saturating_add(used);
            if a.at.minute == now.minute {
                rolled.tokens = fix(rolled.tokens);
            } else if a.at.minute.saturating_add(1) == now.minute {
                rolled.prev_tokens = fix(rolled.prev_tokens);
            } else {
                // A stream longer than the sliding minute: its reservation has faded out, and
                // what it used counts now.
                rolled.tokens = rolled.tokens.saturating_add(used);
            }
            if a.at.day == now.day {
                rolled.day_tokens = fix(rolled.day_tokens);
            } else {
                // The reservation went with yesterday; today's usage is what it used.
                rolled.day_tokens = rolled.day_tokens.saturating_add(used);
            }
            if a.at.month == now.month {
                rolled.month_tokens = fix(rolled.month_tokens);
            } else {
                rolled.month_tokens = rolled.month_tokens.saturating_add(used);
            }
            *c = rolled;
        }
        if a.shared {
            state.dirty.insert(a.key.clone());
            drop(state);
            self.changed.notify_one();
        }
    }

    /// Takes a snapshot read from the shared topic.
    fn take(&self, snapshot: Snapshot) {
        if snapshot.replica == self.replica {
            return;
        }
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        // Snapshots replayed at start are old by design; a live one tells the sharing's delay.
        if now_ms >= snapshot.sent_ms && now_ms - snapshot.sent_ms < 60_000 {
            self.metrics
                .limit_share_delay((now_ms - snapshot.sent_ms) as f64 / 1000.0);
        }
        // Counts from a clock far ahead (or a message that is not a real snapshot) would
        // hold a key at its limit for as long: they are not taken.
        let now = Now::wall();
        if snapshot.counts.minute > now.minute.saturating_add(2)
            || snapshot.counts.month > now.month.saturating_add(1)
        {
            self.metrics.limit_share_failure();
            return;
        }
        let mut state = self.lock();
        let key: Arc<str> = match state.peers.get_key_value(snapshot.key.as_str()) {
            Some((k, _)) => k.clone(),
            None => Arc::from(snapshot.key.as_str()),
        };
        let replicas = state.peers.entry(key).or_default();
        match replicas.get(&snapshot.replica) {
            Some((seq, _)) if *seq >= snapshot.seq => {}
            _ => {
                replicas.insert(snapshot.replica, (snapshot.seq, snapshot.counts));
            }
        }
    }

    /// The other replicas with a snapshot from this minute or the last: those sharing now.
    fn live_peers(&self, now: &Now) -> usize {
        let state = self.lock();
        let mut live = HashSet::new();
        for replicas in state.peers.values() {
            for (replica, (_, c)) in replicas {
                if c.minute.saturating_add(1) >= now.minute {
                    live.insert(replica.as_str());
                }
            }
        }
        live.len()
    }

    /// Drops what can no longer count: other replicas' snapshots from before this month.
    fn forget_old(&self, now: &Now) {
        let mut state = self.lock();
        for replicas in state.peers.values_mut() {
            replicas.retain(|_, (_, c)| c.month >= now.month);
        }
        state.peers.retain(|_, r| !r.is_empty());
    }

    /// The snapshots to publish now: `all` republishes every key that holds usage.
    fn snapshots(&self, all: bool) -> Vec<(String, Snapshot)> {
        let now = Now::wall();
        let mut state = self.lock();
        let keys: Vec<Arc<str>> = if all {
            state
                .mine
                .iter()
                .filter(|(_, c)| c.at(&now).holds_usage())
                .map(|(k, _)| k.clone())
                .chain(state.dirty.iter().cloned())
                .collect::<HashSet<_>>()
                .into_iter()
                .collect()
        } else {
            state.dirty.iter().cloned().collect()
        };
        state.dirty.clear();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let counts = state.mine.get(&key).copied().unwrap_or_default().at(&now);
            state.seq += 1;
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

    fn mark_dirty(&self, key: &str) {
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
        stop: CancellationToken,
        replayed: tokio::sync::oneshot::Sender<()>,
    ) {
        let reading =
            tokio::spawn(
                self.clone()
                    .read(bus.clone(), topic.clone(), stop.clone(), replayed),
            );
        self.publish(bus, topic, stop).await;
        reading.abort();
    }

    async fn read(
        self: Arc<Self>,
        bus: Arc<dyn Bus>,
        topic: String,
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
                        match serde_json::from_slice::<Snapshot>(delivery.payload()) {
                            Ok(s) => self.take(s),
                            // Not ours to judge: another writer's message is skipped, counted.
                            Err(e) => {
                                debug!(error = %e, "a message on the limits topic is not a snapshot");
                                self.metrics.limit_share_failure();
                            }
                        }
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

    async fn publish(&self, bus: Arc<dyn Bus>, topic: String, stop: CancellationToken) {
        let mut republish = tokio::time::interval(REPUBLISH_EVERY);
        republish.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut gauge = tokio::time::interval(Duration::from_secs(1));
        gauge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut publisher = None;
        let mut backoff = Backoff::new(SHARE_RETRY_MAX);
        loop {
            let all = tokio::select! {
                () = stop.cancelled() => return,
                () = self.changed.notified() => false,
                _ = republish.tick() => true,
                _ = gauge.tick() => {
                    self.metrics.limit_peers(self.live_peers(&Now::wall()));
                    continue;
                }
            };
            if all {
                self.forget_old(&Now::wall());
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
            for (message_key, mut snapshot) in self.snapshots(all) {
                snapshot.sent_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                let payload = match serde_json::to_vec(&snapshot) {
                    Ok(p) => p,
                    Err(_) => continue,
                };
                let sent = match p.send(Message::new(payload).with_key(message_key)).await {
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

/// An admitted request's reservation: told its token usage as its records arrive (see
/// [`Meter`]) and settled when dropped, however the stream ended.
pub(crate) struct Admission {
    limiter: Arc<Limiter>,
    key: Arc<str>,
    shared: bool,
    reserved: u64,
    at: Now,
    input: u64,
    output: u64,
    /// The answer's terminal record arrived: the usage reported is complete.
    ended: bool,
}

impl Meter for Admission {
    fn tokens(&mut self, input: u64, output: u64) {
        self.input = self.input.saturating_add(input);
        self.output = self.output.saturating_add(output);
    }

    fn ended(&mut self) {
        self.ended = true;
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.limiter
            .metrics
            .key_tokens(&self.key, self.input, self.output);
        self.limiter.settle(self, Now::wall());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{KeyRing, hash_hex};

    fn key(limits: &str) -> Key {
        let text = format!(
            "[[keys]]\nname = \"k\"\nsha256 = \"{}\"\n{limits}\n",
            hash_hex("x")
        );
        (*KeyRing::parse(&text).unwrap().find("x").unwrap()).clone()
    }

    fn limiter() -> Arc<Limiter> {
        let registry = prometheus::Registry::new();
        Arc::new(Limiter::new(GatewayMetrics::register(&registry).unwrap()))
    }

    /// 2026-11-28 10:00:30 UTC.
    const T: f64 = 1_795_860_030.0;

    #[test]
    fn months_and_days_are_utc_calendar_ones() {
        assert_eq!(civil_month(0), (1970, 1));
        assert_eq!(days_from_civil(2026, 11, 28), 20_785);
        assert_eq!(civil_month(20_785), (2026, 11));
        assert_eq!(civil_month(days_from_civil(2024, 2, 29)), (2024, 2));
        assert_eq!(civil_month(days_from_civil(2024, 3, 1)), (2024, 3));
        let now = Now::at(T);
        assert_eq!(now.day, 20_785);
        assert_eq!(now.secs_to_next_day(), 13.0 * 3600.0 + 59.0 * 60.0 + 30.0);
        // December 1st, 00:00.
        assert_eq!(
            now.secs_to_next_month(),
            2.0 * 86_400.0 + 13.0 * 3600.0 + 59.0 * 60.0 + 30.0
        );
    }

    #[test]
    fn requests_per_minute_slide_and_say_when_to_retry() {
        let l = limiter();
        let k = key("requests_per_minute = 3");
        let now = Now::at(T);
        let held: Vec<_> = (0..3).map(|_| l.admit_at(&k, None, now).unwrap()).collect();
        let refused = l.admit_at(&k, None, now).err().unwrap();
        assert_eq!(refused.what, "requests");
        // 30 s into the minute, 3 used of 3: in the next minute these 3 weigh until a third
        // of it has passed, 30 + 20 s.
        assert_eq!(refused.retry_after, Some(50));
        for a in held {
            l.settle(&a, now);
            std::mem::forget(a);
        }
        // 15 s into the next minute the previous one still weighs 3 * 0.75: 2.25 + 1 > 3.
        let later = Now::at(T + 45.0);
        let refused = l.admit_at(&k, None, later).err().unwrap();
        // Room for one at 1/3 into the minute, 20 s; 15 s are gone.
        assert_eq!(refused.retry_after, Some(5));
        assert!(l.admit_at(&k, None, Now::at(T + 51.0)).is_ok());
    }

    #[test]
    fn tokens_are_reserved_then_settled_with_what_was_used() {
        let l = limiter();
        let k = key("tokens_per_minute = 1000\ntokens_per_day = 1500");
        let now = Now::at(T);
        let mut a = l.admit_at(&k, Some(800), now).unwrap();
        let refused = l.admit_at(&k, Some(300), now).err().unwrap();
        assert_eq!(refused.what, "tokens");
        assert!(!refused.quota);
        a.tokens(20, 30);
        a.ended();
        l.settle(&a, now);
        std::mem::forget(a);
        // 50 used; 950 left this minute, 1450 today.
        let mut b = l.admit_at(&k, Some(900), now).unwrap();
        b.ended();
        l.settle(&b, now);
        std::mem::forget(b);
        // The reservation settled to nothing: 50 used today. An hour later 1000 are used.
        let next_hour = Now::at(T + 3600.0);
        let mut big = l.admit_at(&k, Some(1000), next_hour).unwrap();
        big.tokens(400, 600);
        big.ended();
        l.settle(&big, next_hour);
        std::mem::forget(big);
        let later = Now::at(T + 3720.0);
        let refused = l.admit_at(&k, Some(500), later).err().unwrap();
        assert!(refused.quota);
        assert!(
            refused
                .message
                .contains("used 1050 of its 1500 tokens this day"),
            "{}",
            refused.message
        );
        // 11:02:30 to midnight.
        assert_eq!(refused.retry_after, Some(12 * 3600 + 57 * 60 + 30));
        let too_big = l.admit_at(&k, Some(1001), later).err().unwrap();
        assert_eq!(too_big.retry_after, None);
    }

    #[test]
    fn an_answer_cut_short_costs_its_reservation_and_a_long_one_counts_when_it_ends() {
        let l = limiter();
        let k = key("tokens_per_minute = 1000\ntokens_per_day = 100000");
        let now = Now::at(T);
        // Cut short before its usage arrived: charged the reservation, not the 5 reported.
        let mut cut = l.admit_at(&k, Some(600), now).unwrap();
        cut.tokens(5, 0);
        l.settle(&cut, now);
        std::mem::forget(cut);
        assert!(l.admit_at(&k, Some(500), now).is_err(), "600 held of 1000");
        // Admitted at T, ended three minutes later with 5000 used: those count now.
        let mut long = l.admit_at(&k, Some(100), now).unwrap();
        long.tokens(1000, 4000);
        long.ended();
        let later = Now::at(T + 180.0);
        l.settle(&long, later);
        std::mem::forget(long);
        let refused = l.admit_at(&k, Some(10), later).err().unwrap();
        assert!(
            refused.message.contains("1000 tokens per minute"),
            "{}",
            refused.message
        );
    }

    #[test]
    fn the_longest_wait_is_the_one_told_and_a_reservation_over_a_quota_gets_none() {
        let l = limiter();
        let k = key("requests_per_minute = 1\ntokens_per_day = 100");
        let now = Now::at(T);
        let mut a = l.admit_at(&k, Some(90), now).unwrap();
        a.tokens(90, 0);
        a.ended();
        l.settle(&a, now);
        std::mem::forget(a);
        // Over both the minute's requests and the day's tokens: the day's wait is told.
        let refused = l.admit_at(&k, Some(20), now).err().unwrap();
        assert!(refused.quota);
        assert_eq!(refused.retry_after, Some(13 * 3600 + 59 * 60 + 30));
        let never = l
            .admit_at(&k, Some(101), Now::at(T + 86_400.0))
            .err()
            .unwrap();
        assert_eq!(never.retry_after, None);
    }

    #[test]
    fn a_snapshot_from_far_ahead_is_not_taken() {
        let l = limiter();
        let k = key("requests_per_minute = 1");
        let now = Now::wall();
        l.take(Snapshot {
            replica: "elsewhere".into(),
            key: "k".into(),
            seq: 1,
            counts: Counts {
                minute: u64::MAX,
                requests: u64::MAX,
                day: now.day,
                month: u64::MAX,
                ..Counts::default()
            },
            sent_ms: 0,
        });
        assert!(l.admit(&k, None).is_ok());
    }

    #[test]
    fn other_replicas_snapshots_count_and_an_older_one_is_ignored() {
        let a = limiter();
        let b = limiter();
        let k = key("requests_per_minute = 4");
        let now = Now::wall();
        let _held: Vec<_> = (0..3).map(|_| b.admit(&k, None).unwrap()).collect();
        let snaps = b.snapshots(false);
        assert_eq!(snaps.len(), 1);
        let (message_key, snap) = &snaps[0];
        assert_eq!(message_key, &format!("k/{}", b.replica));
        let older = Snapshot {
            replica: snap.replica.clone(),
            key: "k".into(),
            seq: snap.seq - 1,
            counts: Counts::default(),
            sent_ms: 0,
        };
        let json = serde_json::to_vec(snap).unwrap();
        a.take(serde_json::from_slice(&json).unwrap());
        a.take(older);
        assert_eq!(a.live_peers(&now), 1);
        let _one = a.admit(&k, None).unwrap();
        assert!(a.admit(&k, None).is_err(), "3 on b and 1 on a make 4");
        // A replica ignores its own snapshots read back from the topic.
        let before = b.snapshots(false).len();
        b.take(serde_json::from_slice(&json).unwrap());
        assert_eq!(before, 0);
        assert_eq!(b.live_peers(&now), 0);
    }

    #[test]
    fn a_key_without_limits_is_counted_but_not_shared() {
        let l = limiter();
        let k = key("");
        for _ in 0..100 {
            drop(l.admit(&k, None).unwrap());
        }
        assert!(l.snapshots(false).is_empty());
    }

    #[test]
    fn counts_roll_into_the_previous_minute_and_out_of_the_day() {
        let now = Now::at(T);
        let c = Counts {
            minute: now.minute,
            requests: 5,
            tokens: 50,
            prev_requests: 1,
            prev_tokens: 10,
            day: now.day,
            day_tokens: 500,
            month: now.month,
            month_tokens: 5000,
        };
        let next = c.at(&Now::at(T + 60.0));
        assert_eq!((next.requests, next.prev_requests), (0, 5));
        assert_eq!(next.day_tokens, 500);
        let gone = c.at(&Now::at(T + 120.0));
        assert_eq!((gone.requests, gone.prev_requests), (0, 0));
        let tomorrow = c.at(&Now::at(T + 86_400.0));
        assert_eq!((tomorrow.day_tokens, tomorrow.month_tokens), (0, 5000));
    }
}
