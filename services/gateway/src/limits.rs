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
    keys::{Key, Keys, Limits},
    metrics::GatewayMetrics,
};

mod clock;
mod counts;
mod share;

pub(crate) use self::clock::{Now, civil_from_days};
use self::counts::Counts;
pub use self::share::SnapshotReader;

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
        let judged = Judged {
            name: &key.name,
            total: state.total(&key.name, &now),
            resuming: state.resuming.get(&key.name).copied().unwrap_or(0),
            resume,
            reserve,
            input,
            now,
        };
        // Every limit is checked: the caller hears of the one that keeps it waiting longest
        // (a Retry-After that would only meet the next limit helps nobody).
        let refusals = judged.refusals(&limits);
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
}

/// One admission as the limits judge it: the key's totals over all replicas now, and what
/// the request asks.
struct Judged<'a> {
    name: &'a str,
    total: Counts,
    /// Streams of the key this gateway is resuming.
    resuming: u64,
    resume: bool,
    /// Tokens reserved: `max_tokens` (or the key's `reserve_tokens`) and the input's estimate.
    reserve: u64,
    input: u64,
    now: Now,
}

impl Judged<'_> {
    /// Every limit of `limits` the request would break.
    fn refusals(&self, limits: &Limits) -> Vec<Limited> {
        let mut refusals = Vec::new();
        self.places(limits, &mut refusals);
        self.rates(limits, &mut refusals);
        self.quotas(limits, &mut refusals);
        refusals
    }

    /// Places: requests in flight, streams being resumed.
    fn places(&self, limits: &Limits, refusals: &mut Vec<Limited>) {
        let Self {
            name,
            total,
            resuming,
            resume,
            ..
        } = *self;
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
    }

    /// Rates: requests and tokens per sliding minute.
    fn rates(&self, limits: &Limits, refusals: &mut Vec<Limited>) {
        let Self {
            name,
            total,
            resume,
            reserve,
            input,
            ref now,
            ..
        } = *self;
        let into = now.minute_fraction();
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
                    now,
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
                        now,
                    )),
                    quota: false,
                    concurrent: false,
                });
            }
        }
    }

    /// Quotas: tokens per UTC day and month.
    fn quotas(&self, limits: &Limits, refusals: &mut Vec<Limited>) {
        let Self {
            name,
            total,
            resume,
            reserve,
            ref now,
            ..
        } = *self;
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
