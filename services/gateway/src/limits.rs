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
//!
//! What is read from the topic is believed only when it is a replica's: every snapshot is
//! sealed (`sluice_runtime::seal`, an HMAC under the secret the replicas share) and one
//! without a valid seal is dropped, as is one of a key the keys file does not have, one whose
//! sequence number is ahead of the clock (it would make the replica's real snapshots read as
//! old), one from a clock far ahead, and one of a replica beyond [`MAX_REPLICAS_PER_KEY`].
//! Each is counted in `sluice_gateway_limit_snapshots_refused_total` by reason. Without a
//! shared secret nothing is shared: each replica counts alone. A seal does not make a
//! snapshot new: someone who may publish on the topic can publish a replica's older snapshot
//! again, which the replicas that read the newer one ignore, and which the topic's compacted
//! view keeps until that replica publishes again (within [`REPUBLISH_EVERY`] while it runs).
//! The topic's write permission is for the gateways alone.
//!
//! Each key's requests in flight are counted too, for its `concurrent_requests`: a replica's
//! count is believed while its snapshots are fresh (it publishes one every
//! [`IN_FLIGHT_EVERY`] while any are in flight), so a replica that died stops holding its
//! callers' places within two minutes.

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

use sluice_runtime::seal::{Label, SealKey};

use crate::{
    keys::{Key, Keys},
    metrics::GatewayMetrics,
};

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

/// How often a replica publishes the keys it has requests in flight of, so that the others
/// go on counting them (they stop after two minutes without a snapshot).
pub const IN_FLIGHT_EVERY: Duration = Duration::from_secs(20);

/// The other replicas whose counts of one key are kept. Replicas come and go (each process is
/// a new one, and a gone one's usage counts for the day and the month): beyond this, the
/// counts of replicas not heard of for [`GONE_AFTER`] are folded into one sum, and a snapshot
/// of yet another replica is refused while none can be.
pub const MAX_REPLICAS_PER_KEY: usize = 64;

/// A replica whose last snapshot is this old is gone (a running one publishes every
/// [`REPUBLISH_EVERY`] while it holds usage).
const GONE_AFTER: u64 = 2 * REPUBLISH_EVERY.as_secs() / 60;

/// What a snapshot's seal is for (never the same as another seal's).
const SNAPSHOT_SEAL: Label = Label::new("sluice/gateway/limit-snapshot/v1");

/// The message property that carries a snapshot's seal.
pub const SEAL_PROPERTY: &str = "sluice-seal";

/// How far ahead of this replica's clock another's sequence number may be, in microseconds
/// (a snapshot's `seq` is its replica's clock, see [`Limiter::snapshots`]).
const SEQ_AHEAD_MICROS: u64 = 120_000_000;

/// Where the counts of the replicas folded together are kept, among the replicas' (no
/// replica is named so: a snapshot with no replica name is refused).
const RETIRED: &str = "";

/// Why a snapshot read from the topic was not taken
/// (`sluice_gateway_limit_snapshots_refused_total{reason}`).
pub(crate) const SNAPSHOT_REFUSALS: [&str; 7] = [
    "unsealed",
    "seal",
    "malformed",
    "unknown-key",
    "ahead",
    "seq",
    "replicas",
];

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

    /// Microseconds since the Unix epoch.
    fn micros(&self) -> u64 {
        (self.secs.max(0.0) * 1_000_000.0) as u64
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
    /// Requests admitted and not yet ended (resumed streams included).
    #[serde(default)]
    in_flight: u64,
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
            in_flight: self.in_flight,
        }
    }

    /// Whether these counts were published within the last two minutes (by the publisher's
    /// clock): what their requests in flight are believed for.
    fn fresh(&self, now: &Now) -> bool {
        self.minute.saturating_add(1) >= now.minute
    }

    fn add(&mut self, other: &Counts) {
        self.requests = self.requests.saturating_add(other.requests);
        self.tokens = self.tokens.saturating_add(other.tokens);
        self.prev_requests = self.prev_requests.saturating_add(other.prev_requests);
        self.prev_tokens = self.prev_tokens.saturating_add(other.prev_tokens);
        self.day_tokens = self.day_tokens.saturating_add(other.day_tokens);
        self.month_tokens = self.month_tokens.saturating_add(other.month_tokens);
        self.in_flight = self.in_flight.saturating_add(other.in_flight);
    }

    /// Whether a snapshot of these counts is worth keeping on the topic.
    fn holds_usage(&self) -> bool {
        self.day_tokens > 0 || self.month_tokens > 0 || self.requests > 0 || self.in_flight > 0
    }
}

/// A snapshot on the shared topic: its JSON is the message's payload, sealed in the
/// [`SEAL_PROPERTY`] property.
#[derive(Debug, Serialize, Deserialize)]
struct Snapshot {
    replica: String,
    key: String,
    /// Increases with every snapshot a replica publishes: an older one read late is ignored.
    /// The replica's clock in microseconds (or one more than its last, if that is more), so
    /// that another replica can tell a real one from one far ahead.
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
    /// The key's requests in flight (`concurrent_requests`), not a rate.
    pub(crate) concurrent: bool,
}

/// What a request asks of its key's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    /// A new request, reserving its `max_tokens` (else the key's `reserve_tokens`) and an
    /// estimate of its input from its body's size.
    Request {
        max_tokens: Option<u64>,
        body_bytes: usize,
    },
    /// A resumed stream: a request and a place in flight, no tokens (the stream's were
    /// counted when it started), within [`RESUMES_PER_KEY`].
    Resume,
}

/// The resumed streams one key may read at once through one replica. A resume reads the
/// response topic through a subscription of its own: a broker's work, not a provider's.
pub const RESUMES_PER_KEY: u64 = 8;

/// About how many bytes of a request body make a token of input (English text runs at about
/// four characters a token). An estimate held until the request's real usage replaces it.
const BYTES_PER_TOKEN: usize = 4;

/// The tokens reserved for a request's input, estimated from its body's size.
pub(crate) fn input_estimate(body_bytes: usize) -> u64 {
    body_bytes.div_ceil(BYTES_PER_TOKEN) as u64
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
    /// Resumed streams being read, per key.
    resuming: HashMap<Arc<str>, u64>,
}

impl State {
    /// A key's counts on all replicas at `now`, as this one last heard: what its limits are
    /// checked against.
    fn total(&self, key: &str, now: &Now) -> Counts {
        let mut total = self.mine.get(key).copied().unwrap_or_default().at(now);
        if let Some(peers) = self.peers.get(key) {
            for (_, c) in peers.values() {
                let mut counted = c.at(now);
                // A replica not heard of for two minutes holds no place in flight: it may
                // have died with them.
                if !c.fresh(now) {
                    counted.in_flight = 0;
                }
                total.add(&counted);
            }
        }
        total
    }
}

/// The limits of every key on this replica, and the state shared with the others.
pub(crate) struct Limiter {
    replica: String,
    state: Mutex<State>,
    changed: Notify,
    metrics: GatewayMetrics,
}

/// What a replica shares its counts with: the seal of the replicas' shared secret, and the
/// keys whose counts are taken.
#[derive(Clone)]
pub(crate) struct Sharing {
    pub(crate) seal: SealKey,
    pub(crate) keys: Arc<Keys>,
}

/// Why a snapshot read from the topic is not taken: one of [`SNAPSHOT_REFUSALS`].
type Refused = &'static str;

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

    /// Admits what `ask` asks of `key`, or says why not. The admission settles the
    /// reservation and frees the place in flight when dropped.
    pub(crate) fn admit(self: &Arc<Self>, key: &Key, ask: Ask) -> Result<Admission, Limited> {
        self.admit_at(key, ask, Now::wall())
    }

    fn admit_at(self: &Arc<Self>, key: &Key, ask: Ask, now: Now) -> Result<Admission, Limited> {
        let limits = key.limits;
        let (reserve, input) = match ask {
            Ask::Request {
                max_tokens,
                body_bytes,
            } => {
                let input = input_estimate(body_bytes);
                (
                    max_tokens
                        .unwrap_or(limits.reserve_tokens)
                        .saturating_add(input),
                    input,
                )
            }
            Ask::Resume => (0, 0),
        };
        let resume = ask == Ask::Resume;
        let mut state = self.lock();
        let mine = state
            .mine
            .get(&key.name)
            .copied()
            .unwrap_or_default()
            .at(&now);
        let total = state.total(&key.name, &now);
        let into = now.minute_fraction();
        let name = &key.name;
        // Every limit is checked: the caller hears of the one that keeps it waiting longest
        // (a Retry-After that would only meet the next limit helps nobody).
        let mut refusals = Vec::new();
        if let Some(max) = limits.concurrent_requests
            && total.in_flight.saturating_add(1) > max
        {
            refusals.push(Limited {
                what: "requests",
                message: format!(
                    "the API key {name:?} has {} requests in flight, its limit of concurrent requests",
                    total.in_flight
                ),
                // A place frees when a request ends: soon, or not; asking again in a second
                // costs little.
                retry_after: Some(1),
                quota: false,
                concurrent: true,
            });
        }
        let resuming = state.resuming.get(&key.name).copied().unwrap_or(0);
        if resume && resuming >= RESUMES_PER_KEY {
            refusals.push(Limited {
                what: "requests",
                message: format!(
                    "the API key {name:?} is resuming {resuming} streams through this gateway, its limit of resumed streams at once"
                ),
                retry_after: Some(1),
                quota: false,
                concurrent: true,
            });
        }
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
                concurrent: false,
            });
        }
        // A resumed stream's tokens were counted when it started: the token limits are not
        // its to meet.
        let tpm = limits.tokens_per_minute.filter(|_| !resume);
        if let Some(tpm) = tpm {
            if reserve > tpm {
                refusals.push(Limited {
                    what: "tokens",
                    message: format!(
                        "the request reserves {reserve} tokens (its max_tokens, or the key's reserve_tokens, and about {input} for its input), more than the API key {name:?}'s limit of {tpm} tokens per minute"
                    ),
                    retry_after: None,
                    quota: false,
                    concurrent: false,
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
                    concurrent: false,
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
            if let Some(limit) = limit.filter(|_| !resume)
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
                    concurrent: false,
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
        counts.in_flight = counts.in_flight.saturating_add(1);
        state.mine.insert(key.name.clone(), counts);
        self.export(&state, &key.name, &now);
        if resume {
            *state.resuming.entry(key.name.clone()).or_default() += 1;
        }
        if limits.any() {
            state.dirty.insert(key.name.clone());
            drop(state);
            self.changed.notify_one();
        }
        Ok(Admission {
            limiter: self.clone(),
            key: key.name.clone(),
            shared: limits.any(),
            resume,
            reserved: reserve,
            at: now,
            input: 0,
            output: 0,
            reported: false,
            ended: false,
        })
    }

    /// Replaces a reservation made at `at` with what the request used, and frees its place
    /// in flight.
    fn settle(&self, a: &Admission, now: Now) {
        // Usage comes on the last records: an answer cut short before them (the caller gone,
        // a timeout), or one whose records carried none (a provider that does not report it),
        // is charged at least its reservation, as the provider may well have billed it.
        let reported = a.input.saturating_add(a.output);
        let used = if a.ended && a.reported {
            reported
        } else {
            reported.max(a.reserved)
        };
        let mut state = self.lock();
        if a.resume
            && let Some(n) = state.resuming.get_mut(&a.key)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                state.resuming.remove(&a.key);
            }
        }
        if let Some(c) = state.mine.get_mut(&a.key) {
            c.in_flight = c.in_flight.saturating_sub(1);
            if a.resume {
                // Nothing reserved, nothing to settle: the stream's tokens were its sender's.
                self.export(&state, &a.key, &now);
                if a.shared {
                    state.dirty.insert(a.key.clone());
                    drop(state);
                    self.changed.notify_one();
                }
                return;
            }
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
        self.export(&state, &a.key, &now);
        if a.shared {
            state.dirty.insert(a.key.clone());
            drop(state);
            self.changed.notify_one();
        }
    }

    /// Judges a message read from the shared topic (its payload and its seal property) and
    /// takes the snapshot it holds if it is one to believe: sealed by a replica, of a key of
    /// `sharing`'s keys file, with a sequence number and counts that are not ahead of this
    /// replica's clock, within [`MAX_REPLICAS_PER_KEY`]. What is not believed is counted by
    /// why, and said at debug level only (a flood of forgeries must not flood the log).
    fn receive(
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

    fn judge(
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
    fn take(&self, snapshot: Snapshot, now: &Now) -> Result<(), Refused> {
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
    fn live_peers(&self, now: &Now) -> usize {
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
    fn export(&self, state: &State, key: &str, now: &Now) {
        let total = state.total(key, now);
        self.metrics
            .key_totals(key, total.in_flight, total.day_tokens, total.month_tokens);
    }

    /// Exports every key's totals (see [`Self::export`]).
    fn export_all(&self, now: &Now) {
        let state = self.lock();
        let keys: HashSet<&Arc<str>> = state.mine.keys().chain(state.peers.keys()).collect();
        for key in keys {
            self.export(&state, key, now);
        }
    }

    /// Drops what can no longer count: other replicas' snapshots from before this month, and
    /// those of keys no longer in the keys file.
    fn forget_old(&self, now: &Now, keys: &Keys) {
        let ring = keys.ring();
        let mut state = self.lock();
        state.peers.retain(|k, _| ring.has_name(k));
        for replicas in state.peers.values_mut() {
            replicas.retain(|_, (_, c)| c.month >= now.month);
        }
        state.peers.retain(|_, r| !r.is_empty());
    }

    /// The snapshots to publish now: `which` keys.
    fn snapshots(&self, which: Which) -> Vec<(String, Snapshot)> {
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

    async fn read(
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

    async fn publish(
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
const SNAPSHOT_SEAL_BYTES: usize = 32;

/// Which keys' snapshots to publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
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
fn retire_one(replicas: &mut HashMap<String, (u64, Counts)>, now: &Now) -> bool {
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
    limiter: Arc<Limiter>,
    sharing: Sharing,
    key: Key,
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

/// An admitted request's reservation and its place in flight: told its token usage as its
/// records arrive (see [`Meter`]) and settled when dropped, however the stream ended.
pub(crate) struct Admission {
    limiter: Arc<Limiter>,
    key: Arc<str>,
    shared: bool,
    /// A resumed stream's: no tokens of its own.
    resume: bool,
    reserved: u64,
    at: Now,
    input: u64,
    output: u64,
    /// Some record carried token counts.
    reported: bool,
    /// The answer's terminal record arrived: the usage reported is complete.
    ended: bool,
}

impl Meter for Admission {
    fn tokens(&mut self, input: u64, output: u64) {
        // A resumed stream reads records whose tokens were counted when they were first read.
        if self.resume {
            return;
        }
        self.reported = true;
        self.input = self.input.saturating_add(input);
        self.output = self.output.saturating_add(output);
    }

    fn ended(&mut self) {
        self.ended = true;
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // Settled before it is counted on /metrics: whoever sees the count sees the limits
        // that include it.
        self.limiter.settle(self, Now::wall());
        self.limiter
            .metrics
            .key_tokens(&self.key, self.input, self.output);
    }
}

#[cfg(test)]
mod tests;
