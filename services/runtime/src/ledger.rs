//! The usage ledger: one [`UsageRecord`] per attempt that called a provider, published to a
//! durable topic before the request is acked (docs/text-completion.md#usage-ledger).
//!
//! - The handler reports what its provider calls used through the attempt's [`UsageMeter`]
//!   (in [`crate::processor::RequestContext`]); the runtime writes the record when the
//!   attempt ends, however it ends: answered, failed, cancelled by the caller (the handler's
//!   future dropped mid-call), or handed back to the broker. A meter no provider call was
//!   started on (a malformed request, `list-models`) writes nothing.
//! - The record is stored before the request is acked. A processor killed before that
//!   writes none for its attempt, and the request's next attempt (which calls the provider
//!   again) writes its own; a processor killed after it but before the ack leaves one record
//!   for an attempt that really called the provider. A record can reach the topic twice: a
//!   publish whose receipt was lost, or a store given up on (after [`STORE_WAIT`]) that the
//!   broker took all the same while the backlog stored it again. Both copies carry the same
//!   attempt id; every reader in sluice counts it once, and the metrics count it once.
//! - A record the broker does not store within [`STORE_WAIT`] (a broker outage) is kept in
//!   the process's backlog and stored by a background task once the broker is back: the
//!   answer stands and the request is acked meanwhile (calling the provider again to fix the
//!   books would cost more). The backlog holds [`BACKLOG_LIMIT`] records; one that does not
//!   fit, or is still waiting when the processor has drained and [`Ledger::flush`] gives up,
//!   is counted in `sluice_usage_unrecorded_total` and logged whole at error level, with no
//!   prompt or secret in it, so it can be entered by hand. A process killed during an
//!   outage loses its backlog.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use prometheus::{CounterVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use serde::Deserialize;
use sluice_schema::UsageRecord;
use tracing::{debug, error, info, warn};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{
    backoff::Backoff,
    bus::{Bus, BusError, Message, Publisher},
    lock,
};

/// How long the request waits for its usage record to be stored before the record goes to
/// the backlog.
pub const STORE_WAIT: Duration = Duration::from_secs(10);

/// Records the backlog holds while the broker does not store them.
pub const BACKLOG_LIMIT: usize = 100_000;

/// What the provider calls of one attempt used, reported by the handler as they go.
///
/// Cheap to clone: clones share the counts.
#[derive(Debug, Clone, Default)]
pub struct UsageMeter(Arc<Mutex<Metered>>);

#[derive(Debug, Default, Clone)]
struct Metered {
    /// A provider call was started.
    called: bool,
    streaming: bool,
    provider: Option<String>,
    model: Option<String>,
    /// Totals of the calls before the current one.
    input: u64,
    output: u64,
    estimated: bool,
    /// The current call.
    call: Call,
}

#[derive(Debug, Default, Clone)]
struct Call {
    input: u64,
    output: u64,
    /// Text chunks received.
    chunks: u64,
    /// The provider's answer was complete (its usage, if it reports any, is final).
    finished: bool,
}

impl Call {
    /// The call's counts: as reported when it finished; when it stopped early, the output is
    /// at least the chunks received (a provider reports output at the end, and bills what it
    /// generated until the connection closed).
    fn counts(&self) -> (u64, u64, bool) {
        if self.finished || self.chunks <= self.output {
            // Complete, or cut with what the provider reported (a refused call: nothing).
            (self.input, self.output, false)
        } else {
            // Cut after more text than was reported: at least a token per chunk.
            (self.input, self.chunks, true)
        }
    }
}

/// The totals of a meter at the end of an attempt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageTotals {
    /// Input tokens.
    pub input: u64,
    /// Output tokens.
    pub output: u64,
    /// Some output was counted from chunks, not reported.
    pub estimated: bool,
}

impl UsageMeter {
    /// A provider call starts (the first, or a retry or fallback after a failed one).
    pub fn call(&self) {
        let mut m = lock(&self.0);
        if m.called {
            let (input, output, estimated) = m.call.counts();
            m.input = m.input.saturating_add(input);
            m.output = m.output.saturating_add(output);
            m.estimated |= estimated;
        }
        m.call = Call::default();
        m.called = true;
    }

    /// The provider reported more usage on the current call (deltas over what it reported
    /// before).
    pub fn usage(&self, input: u64, output: u64) {
        let mut m = lock(&self.0);
        m.call.input = m.call.input.saturating_add(input);
        m.call.output = m.call.output.saturating_add(output);
    }

    /// A text chunk of the current call arrived.
    pub fn chunk(&self) {
        let mut m = lock(&self.0);
        m.call.chunks = m.call.chunks.saturating_add(1);
    }

    /// The current call's answer is complete.
    pub fn finished(&self) {
        lock(&self.0).call.finished = true;
    }

    /// Whether the answer is streamed.
    pub fn streaming(&self, streaming: bool) {
        lock(&self.0).streaming = streaming;
    }

    /// The provider and model answering (the latest said wins: a fallback may move on).
    pub fn answered_by(&self, provider: &str, model: &str) {
        let mut m = lock(&self.0);
        if m.provider.as_deref() != Some(provider) {
            m.provider = Some(provider.to_owned());
        }
        if m.model.as_deref() != Some(model) {
            m.model = Some(model.to_owned());
        }
    }

    /// Whether a provider call was started.
    pub fn called(&self) -> bool {
        lock(&self.0).called
    }

    /// The totals so far, the current call included.
    pub fn totals(&self) -> UsageTotals {
        let m = lock(&self.0);
        let (input, output, estimated) = if m.called {
            m.call.counts()
        } else {
            (0, 0, false)
        };
        UsageTotals {
            input: m.input.saturating_add(input),
            output: m.output.saturating_add(output),
            estimated: m.estimated || estimated,
        }
    }

    fn fill(&self, record: &mut UsageRecord) {
        let t = self.totals();
        let m = lock(&self.0);
        record.input_tokens = t.input;
        record.output_tokens = t.output;
        record.estimated = t.estimated;
        record.streaming = m.streaming;
        record.provider.clone_from(&m.provider);
        record.model.clone_from(&m.model);
    }
}

/// One price of the price table, per million tokens in the table's currency.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// The model, as the records name it.
    pub model: String,
    /// The provider (`openai`, ...); any provider when not given.
    #[serde(default)]
    pub provider: Option<String>,
    /// The price of a million input tokens.
    pub input: f64,
    /// The price of a million output tokens.
    pub output: f64,
}

/// The price table: the first price whose model (and provider, when it names one) match.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    /// The prices, in the order they are looked up.
    #[serde(default, rename = "price")]
    pub prices: Vec<Price>,
}

/// A price that is not a finite number of 0 or more.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("price of model `{model}`: `{field}` must be a number of 0 or more")]
pub struct PriceError {
    /// The model the price is for.
    pub model: String,
    /// `input` or `output`.
    pub field: &'static str,
}

/// Why a ledger cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The usage topic is not a persistent topic URL.
    #[error(
        "the usage topic must be a persistent:// topic URL (the ledger is what the broker keeps), not {0:?}"
    )]
    NotPersistent(String),
    /// The bus would not create a publisher for the topic.
    #[error("cannot publish to the usage topic {topic}: {source}")]
    Publisher {
        /// The usage topic.
        topic: String,
        /// The bus's refusal.
        source: BusError,
    },
    /// A price is unusable.
    #[error(transparent)]
    Price(#[from] PriceError),
    /// The ledger's metrics could not be registered (a name already taken).
    #[error("the ledger's metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

impl Prices {
    /// Checks every price is a finite number, not negative.
    pub fn validate(&self) -> Result<(), PriceError> {
        for p in &self.prices {
            for (field, v) in [("input", p.input), ("output", p.output)] {
                if !v.is_finite() || v < 0.0 {
                    return Err(PriceError {
                        model: p.model.clone(),
                        field,
                    });
                }
            }
        }
        Ok(())
    }

    /// What `input` and `output` tokens of `model` from `provider` cost; `None` without a
    /// price for it.
    pub fn cost(
        &self,
        provider: Option<&str>,
        model: &str,
        input: u64,
        output: u64,
    ) -> Option<f64> {
        let p = self.prices.iter().find(|p| {
            p.model == model
                && p.provider
                    .as_deref()
                    .is_none_or(|want| Some(want) == provider)
        })?;
        // u64 to f64 loses precision only above 2^53 tokens.
        Some((input as f64 * p.input + output as f64 * p.output) / 1_000_000.0)
    }
}

/// The ledger's metrics.
#[derive(Clone)]
struct LedgerMetrics {
    records: IntCounterVec,
    tokens: IntCounterVec,
    cost: CounterVec,
    unrecorded: IntCounter,
    backlog: IntGauge,
}

impl LedgerMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let records = IntCounterVec::new(
            Opts::new(
                "sluice_usage_records_total",
                "Usage records written to the ledger, by outcome of the attempt.",
            ),
            &["outcome"],
        )?;
        let tokens = IntCounterVec::new(
            Opts::new(
                "sluice_usage_tokens_total",
                "Tokens in the usage ledger, by API key (empty: none), model and kind (input, output).",
            ),
            &["key", "model", "kind"],
        )?;
        let cost = CounterVec::new(
            Opts::new(
                "sluice_usage_cost_total",
                "Cost in the usage ledger from the price table, in its currency, by API key and model.",
            ),
            &["key", "model"],
        )?;
        let unrecorded = IntCounter::new(
            "sluice_usage_unrecorded_total",
            "Usage records the broker did not store in time (each is logged whole at error level).",
        )?;
        registry.register(Box::new(records.clone()))?;
        registry.register(Box::new(tokens.clone()))?;
        registry.register(Box::new(cost.clone()))?;
        let backlog = IntGauge::new(
            "sluice_usage_backlog",
            "Usage records waiting for the broker to store them (kept while it does not).",
        )?;
        registry.register(Box::new(unrecorded.clone()))?;
        registry.register(Box::new(backlog.clone()))?;
        Ok(Self {
            records,
            tokens,
            cost,
            unrecorded,
            backlog,
        })
    }
}

/// Where usage records go, and their prices.
pub struct Ledger {
    publisher: Arc<dyn Publisher>,
    prices: Prices,
    metrics: LedgerMetrics,
    /// Records not stored yet, oldest first, and the wake-up of the task storing them.
    backlog: Arc<Mutex<VecDeque<UsageRecord>>>,
    wake: Arc<Notify>,
    /// Set while the broker is known not to store (a store timed out, or the producer could
    /// not be opened); cleared when the backlog has been stored.
    down: Arc<AtomicBool>,
    stop: CancellationToken,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("topic", &self.publisher.topic())
            .field("prices", &self.prices.prices.len())
            .finish()
    }
}

/// What the runtime knows of an attempt when it ends, besides its meter.
#[derive(Debug, Clone)]
pub struct AttemptEnd<'a> {
    /// The request's id.
    pub id: &'a str,
    /// The attempt's id.
    pub attempt: &'a str,
    /// The attempt's trace id.
    pub trace_id: Option<&'a str>,
    /// The API key's name the request carried.
    pub key: Option<&'a str>,
    /// The flow the processor serves.
    pub flow: Option<&'a str>,
    /// The processor's name.
    pub service: &'a str,
    /// `answered`, `error`, `cancelled` or `retried`.
    pub outcome: &'a str,
    /// The terminal error's kind.
    pub error: Option<&'a str>,
    /// How long the attempt took.
    pub duration: Duration,
    /// Deliveries before this one.
    pub redelivery_count: u32,
}

impl Ledger {
    /// A ledger publishing to `topic` (a persistent one), its metrics registered in
    /// `registry`. The producer is created now: a role that may not write the topic is told
    /// at start-up, in the log at error level, and the processor runs on, its records waiting
    /// in the backlog (`sluice_usage_backlog`) until the grant is given; answering callers
    /// matters more than the books, and the backlog says they are behind.
    pub async fn open(
        bus: &dyn Bus,
        topic: &str,
        prices: Prices,
        registry: &Registry,
    ) -> Result<Self, LedgerError> {
        if !topic.starts_with("persistent://") {
            return Err(LedgerError::NotPersistent(topic.to_owned()));
        }
        let publisher = bus
            .publisher(topic)
            .await
            .map_err(|source| LedgerError::Publisher {
                topic: topic.to_owned(),
                source,
            })?;
        let opened = publisher.open().await;
        let ledger = Self::with_publisher(publisher, prices, registry)?;
        if let Err(e) = opened {
            error!(topic, error = %e,
                   "cannot publish to the usage topic: usage records wait in the backlog until the processor's role may produce there (pulsar-admin topics grant-permission ... --actions produce), or turn the ledger off with --usage-topic none");
            ledger.down.store(true, Ordering::SeqCst);
        }
        Ok(ledger)
    }

    /// A ledger publishing through `publisher`.
    fn with_publisher(
        publisher: Arc<dyn Publisher>,
        prices: Prices,
        registry: &Registry,
    ) -> Result<Self, LedgerError> {
        prices.validate()?;
        let metrics = LedgerMetrics::register(registry)?;
        let ledger = Self {
            publisher,
            prices,
            metrics,
            backlog: Arc::default(),
            wake: Arc::default(),
            down: Arc::default(),
            stop: CancellationToken::new(),
            task: Mutex::new(None),
        };
        let task = tokio::spawn(drain_backlog(
            ledger.publisher.clone(),
            ledger.backlog.clone(),
            ledger.wake.clone(),
            ledger.down.clone(),
            ledger.metrics.clone(),
            ledger.stop.clone(),
        ));
        *lock(&ledger.task) = Some(task);
        Ok(ledger)
    }

    /// The record of an attempt that ended; `None` when it called no provider.
    pub fn record_of(&self, end: &AttemptEnd<'_>, meter: &UsageMeter) -> Option<UsageRecord> {
        if !meter.called() {
            return None;
        }
        let mut record = UsageRecord {
            id: end.id.to_owned(),
            attempt: end.attempt.to_owned(),
            trace_id: end.trace_id.map(str::to_owned),
            key: end.key.map(str::to_owned),
            flow: end.flow.map(str::to_owned),
            service: end.service.to_owned(),
            outcome: end.outcome.to_owned(),
            error: end.error.map(str::to_owned),
            duration_ms: u64::try_from(end.duration.as_millis()).unwrap_or(u64::MAX),
            ended_at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            redelivery_count: end.redelivery_count,
            ..UsageRecord::default()
        };
        meter.fill(&mut record);
        record.cost = record.model.as_deref().and_then(|model| {
            self.prices.cost(
                record.provider.as_deref(),
                model,
                record.input_tokens,
                record.output_tokens,
            )
        });
        Some(record)
    }

    /// Counts `record` and stores it on the usage topic, trying again until `wait` (at most
    /// [`STORE_WAIT`]) has passed; then it goes to the backlog (see the module docs).
    pub async fn write(&self, record: &UsageRecord, wait: Duration) {
        let key = record.key.as_deref().unwrap_or("");
        let model = record.model.as_deref().unwrap_or("");
        self.metrics
            .records
            .with_label_values(&[record.outcome.as_str()])
            .inc();
        let tokens = |kind: &str| self.metrics.tokens.with_label_values(&[key, model, kind]);
        tokens("input").inc_by(record.input_tokens);
        tokens("output").inc_by(record.output_tokens);
        if let Some(cost) = record.cost {
            self.metrics
                .cost
                .with_label_values(&[key, model])
                .inc_by(cost);
        }
        // Behind others waiting, or while the broker is known not to store: no wait.
        let behind =
            wait.is_zero() || self.down.load(Ordering::SeqCst) || !lock(&self.backlog).is_empty();
        let stored = if behind {
            Err("the broker does not store usage records now".to_owned())
        } else {
            match tokio::time::timeout(wait.min(STORE_WAIT), store(&*self.publisher, record)).await
            {
                Ok(r) => r,
                Err(_) => {
                    // The next records go straight to the backlog until it is stored.
                    self.down.store(true, Ordering::SeqCst);
                    Err("not stored in time".to_owned())
                }
            }
        };
        match stored {
            Ok(()) => debug!(request_id = %record.id, "usage recorded"),
            Err(why) => self.enqueue_because(record.clone(), &why),
        }
    }

    /// Puts `record` in the backlog at once, without counting it in the metrics: for an
    /// attempt whose task was dropped before it could write (the processor's guard).
    pub fn enqueue(&self, record: UsageRecord) {
        self.enqueue_because(record, "its request was dropped before it was written");
    }

    fn enqueue_because(&self, record: UsageRecord, why: &str) {
        let mut backlog = lock(&self.backlog);
        if backlog.len() >= BACKLOG_LIMIT {
            drop(backlog);
            self.unrecorded(&record, "the backlog is full");
            return;
        }
        // Said once per outage, not once per request.
        if backlog.is_empty() {
            warn!(request_id = %record.id, why, "usage records wait in the backlog until the broker stores them");
        } else {
            debug!(request_id = %record.id, why, "the usage record waits in the backlog");
        }
        backlog.push_back(record);
        self.metrics
            .backlog
            .set(i64::try_from(backlog.len()).unwrap_or(i64::MAX));
        drop(backlog);
        self.wake.notify_one();
    }

    /// Waits up to `wait` for the backlog to be stored; what is still in it then (the record
    /// being stored included) is logged and counted as unrecorded, and the ledger stores
    /// nothing more. Called once, when the process has stopped taking requests.
    pub async fn flush(&self, wait: Duration) {
        let deadline = tokio::time::Instant::now() + wait;
        while !lock(&self.backlog).is_empty() && tokio::time::Instant::now() < deadline {
            self.wake.notify_one();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The task stops first, so that a record it was storing is either stored or left in
        // the backlog, never both stored and logged.
        self.stop.cancel();
        let task = lock(&self.task).take();
        if let Some(task) = task {
            let _ = task.await;
        }
        let left: Vec<UsageRecord> = lock(&self.backlog).drain(..).collect();
        self.metrics.backlog.set(0);
        for record in &left {
            // The first may have been on its way when the task stopped.
            self.unrecorded(
                record,
                "not stored before the processor stopped (the broker may have taken the first \
                 of these as it stopped: look for its attempt id before entering it by hand)",
            );
        }
    }

    fn unrecorded(&self, record: &UsageRecord, why: &str) {
        self.metrics.unrecorded.inc();
        let line = serde_json::to_string(record).unwrap_or_default();
        error!(event = "usage_unrecorded", why, record = %line,
               "a usage record could not be stored on the usage topic; enter it by hand");
    }
}

/// Publishes `record` until the broker stores it (a record too large fails at once).
async fn store(publisher: &dyn Publisher, record: &UsageRecord) -> Result<(), String> {
    let payload = serde_json::to_vec(record).map_err(|e| e.to_string())?;
    let message = Message::new(payload)
        // Compaction, if the operator turns it on, then keeps every attempt and drops only a
        // record stored twice.
        .with_key(format!("{}/{}", record.id, record.attempt))
        .with_property(sluice_schema::properties::ID, record.id.clone())
        .with_property(sluice_schema::properties::ATTEMPT, record.attempt.clone());
    let mut backoff = Backoff::new(Duration::from_secs(2));
    loop {
        let result = match publisher.send(message.clone()).await {
            Ok(receipt) => receipt.await,
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => return Ok(()),
            // Not something a second try changes.
            Err(e @ BusError::TooLarge { .. }) => return Err(e.to_string()),
            Err(e) => {
                let delay = backoff.next_delay();
                debug!(error = %e, retry_in_ms = delay.as_millis() as u64,
                       "the usage record was not stored; trying again");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Stores the backlog, oldest first, whenever it has records, until `stop`. The record being
/// stored stays at the front until it is stored, so that a stop leaves it in the backlog.
async fn drain_backlog(
    publisher: Arc<dyn Publisher>,
    backlog: Arc<Mutex<VecDeque<UsageRecord>>>,
    wake: Arc<Notify>,
    down: Arc<AtomicBool>,
    metrics: LedgerMetrics,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = wake.notified() => {}
        }
        loop {
            let Some(next) = lock(&backlog).front().cloned() else {
                down.store(false, Ordering::SeqCst);
                break;
            };
            let stored = tokio::select! {
                () = stop.cancelled() => return,
                r = store(&*publisher, &next) => r,
            };
            let mut b = lock(&backlog);
            b.pop_front();
            metrics
                .backlog
                .set(i64::try_from(b.len()).unwrap_or(i64::MAX));
            drop(b);
            match stored {
                Ok(()) => {
                    info!(request_id = %next.id, "a usage record from the backlog was stored")
                }
                Err(e) => {
                    metrics.unrecorded.inc();
                    error!(event = "usage_unrecorded", why = %e,
                           record = %serde_json::to_string(&next).unwrap_or_default(),
                           "a usage record could not be stored on the usage topic; enter it by hand");
                }
            }
        }
    }
}

/// Reads the usage records on `topic` from its first message until none came for `quiet`,
/// handing each to `each` in order (which may stop the reading with
/// [`std::ops::ControlFlow::Break`]), and leaves no subscription behind (a non-durable
/// replay). Returns how many messages were not usage records (skipped). Every copy is
/// handed over: a record stored twice has the attempt id of its first copy, and a reader
/// that sums counts it once (see the module's doc).
pub async fn read_records(
    bus: &dyn Bus,
    topic: &str,
    quiet: Duration,
    mut each: impl FnMut(UsageRecord) -> std::ops::ControlFlow<()>,
) -> Result<u64, BusError> {
    use crate::bus::{StartPosition, SubscribeOptions, SubscriptionKind};
    let options = SubscribeOptions {
        kind: SubscriptionKind::Exclusive,
        start: StartPosition::Replay,
        prefetch: 1000,
        consumer_name: None,
        acks_in_order: false,
    };
    let subscription = format!("sluice-usage-{}", uuid::Uuid::new_v4().simple());
    let mut sub = bus.subscribe(topic, &subscription, options).await?;
    let mut skipped = 0;
    let result = loop {
        let delivery = match tokio::time::timeout(quiet, sub.next()).await {
            Err(_) | Ok(None) => break Ok(skipped),
            Ok(Some(Err(e))) => break Err(e),
            Ok(Some(Ok(d))) => d,
        };
        let decoded = serde_json::from_slice::<UsageRecord>(delivery.payload());
        delivery.ack();
        match decoded {
            Ok(record) => {
                if each(record).is_break() {
                    break Ok(skipped);
                }
            }
            Err(_) => skipped += 1,
        }
    };
    sub.close().await;
    result
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;

    use super::*;
    use crate::bus::Receipt;

    /// A publisher whose broker is down while `down` is set, keeping what it stored.
    #[derive(Default)]
    struct Flaky {
        down: AtomicBool,
        stored: Mutex<Vec<String>>,
    }

    #[async_trait]
    impl Publisher for Flaky {
        async fn send(&self, message: Message) -> Result<Receipt, BusError> {
            if self.down.load(Ordering::SeqCst) {
                return Err(BusError::Unavailable("down".into()));
            }
            lock(&self.stored).push(message.key.unwrap_or_default());
            Ok(Receipt::ready(Ok(())))
        }

        fn topic(&self) -> &str {
            "usage"
        }
    }

    fn record(attempt: &str) -> UsageRecord {
        UsageRecord {
            id: "r".into(),
            attempt: attempt.into(),
            outcome: "answered".into(),
            ..UsageRecord::default()
        }
    }

    /// While the broker does not store, records wait in the backlog (the first after its
    /// wait, the next at once, behind it) and are stored in order once it is back; what is
    /// still waiting when the processor stops is counted as unrecorded.
    #[tokio::test]
    async fn records_wait_for_the_broker_in_order_and_are_counted_when_given_up() {
        let flaky = Arc::new(Flaky::default());
        let registry = Registry::new();
        let ledger = Ledger::with_publisher(flaky.clone(), Prices::default(), &registry).unwrap();
        ledger.write(&record("1"), Duration::from_millis(10)).await;
        assert_eq!(lock(&flaky.stored).clone(), ["r/1"]);
        flaky.down.store(true, Ordering::SeqCst);
        ledger.write(&record("2"), Duration::from_millis(100)).await;
        let started = tokio::time::Instant::now();
        ledger.write(&record("3"), Duration::from_secs(10)).await;
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "behind the backlog: no wait"
        );
        assert_eq!(ledger.metrics.backlog.get(), 2);
        flaky.down.store(false, Ordering::SeqCst);
        ledger.flush(Duration::from_secs(10)).await;
        assert_eq!(lock(&flaky.stored).clone(), ["r/1", "r/2", "r/3"]);
        assert_eq!(ledger.metrics.unrecorded.get(), 0);
        assert_eq!(
            ledger
                .metrics
                .records
                .with_label_values(&["answered"])
                .get(),
            3
        );
    }

    /// What the broker has not stored when the process stops is logged and counted, once:
    /// the record being stored at that moment is not also stored afterwards. On a paused
    /// clock, so that "afterwards" is a minute of the backlog's retries, not a guess at how
    /// long a task takes to be scheduled.
    #[tokio::test(start_paused = true)]
    async fn a_flush_that_gives_up_counts_what_is_left_once() {
        let flaky = Arc::new(Flaky::default());
        let ledger =
            Ledger::with_publisher(flaky.clone(), Prices::default(), &Registry::new()).unwrap();
        flaky.down.store(true, Ordering::SeqCst);
        ledger.write(&record("1"), Duration::from_millis(10)).await;
        ledger.write(&record("2"), Duration::from_millis(10)).await;
        ledger.flush(Duration::from_millis(200)).await;
        assert_eq!(ledger.metrics.unrecorded.get(), 2);
        assert_eq!(ledger.metrics.backlog.get(), 0);
        flaky.down.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(
            lock(&flaky.stored).is_empty(),
            "nothing stored after it was given up"
        );
    }

    #[test]
    fn a_finished_call_counts_what_it_reported_and_a_cut_one_its_chunks() {
        let m = UsageMeter::default();
        assert!(!m.called());
        m.call();
        m.usage(9, 0);
        m.chunk();
        m.chunk();
        // Cut after two chunks with only the input reported: output counted from chunks.
        assert_eq!(
            m.totals(),
            UsageTotals {
                input: 9,
                output: 2,
                estimated: true
            }
        );
        // A retry that finishes: its own report counts, the first call's stays.
        m.call();
        for _ in 0..3 {
            m.chunk();
        }
        m.usage(9, 4);
        m.finished();
        assert_eq!(
            m.totals(),
            UsageTotals {
                input: 18,
                output: 6,
                estimated: true
            }
        );
    }

    #[test]
    fn a_finished_call_with_fewer_tokens_than_chunks_is_taken_at_its_word() {
        let m = UsageMeter::default();
        m.call();
        for _ in 0..5 {
            m.chunk();
        }
        m.usage(3, 2);
        m.finished();
        assert_eq!(
            m.totals(),
            UsageTotals {
                input: 3,
                output: 2,
                estimated: false
            }
        );
    }

    #[test]
    fn prices_match_model_then_provider_in_order() {
        let prices: Prices = serde_json::from_value(serde_json::json!({"price": [
            {"model": "m", "provider": "anthropic", "input": 3.0, "output": 15.0},
            {"model": "m", "input": 1.0, "output": 2.0},
        ]}))
        .unwrap();
        assert_eq!(prices.cost(Some("anthropic"), "m", 1_000_000, 0), Some(3.0));
        assert_eq!(
            prices.cost(Some("openai"), "m", 500_000, 1_000_000),
            Some(2.5)
        );
        assert_eq!(prices.cost(None, "other", 1, 1), None);
        let bad = Prices {
            prices: vec![Price {
                model: "m".into(),
                provider: None,
                input: -1.0,
                output: f64::NAN,
            }],
        };
        assert!(bad.validate().is_err());
    }
}
