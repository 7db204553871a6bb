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
//!   for an attempt that really called the provider. No attempt is ever written twice by
//!   sluice; a publish the broker stored but whose receipt was lost can be, which readers see
//!   by the attempt id (every reader in sluice keeps the first).
//! - A record the broker does not store within [`STORE_WAIT`] is given up on: the answer
//!   stands and the request is acked (calling the provider again to fix the books would
//!   cost more). It is counted in `sluice_usage_unrecorded_total` and logged whole at error
//!   level, with no prompt or secret in it, so it can be entered by hand.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use prometheus::{CounterVec, IntCounter, IntCounterVec, Opts, Registry};
use serde::Deserialize;
use sluice_schema::UsageRecord;
use tracing::{debug, error, warn};

use crate::{
    backoff::Backoff,
    bus::{Bus, BusError, Message, Publisher},
    lock,
};

/// How long a usage record may take to be stored before it is given up on.
pub const STORE_WAIT: Duration = Duration::from_secs(10);

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
            (self.input, self.output, false)
        } else {
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
        let (input, output, estimated) = m.call.counts();
        m.input = m.input.saturating_add(input);
        m.output = m.output.saturating_add(output);
        m.estimated |= estimated;
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
        let (input, output, estimated) = m.call.counts();
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

impl Prices {
    /// Checks every price is a finite number, not negative.
    pub fn validate(&self) -> Result<(), String> {
        for p in &self.prices {
            for (what, v) in [("input", p.input), ("output", p.output)] {
                if !v.is_finite() || v < 0.0 {
                    return Err(format!(
                        "price of model `{}`: `{what}` must be a number of 0 or more",
                        p.model
                    ));
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
        registry.register(Box::new(unrecorded.clone()))?;
        Ok(Self {
            records,
            tokens,
            cost,
            unrecorded,
        })
    }
}

/// Where usage records go, and their prices.
pub struct Ledger {
    publisher: Arc<dyn Publisher>,
    prices: Prices,
    metrics: LedgerMetrics,
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
    /// A ledger publishing to `topic`, its metrics registered in `registry`. The producer is
    /// created now, so a role that may not write the topic is refused at start-up.
    pub async fn open(
        bus: &dyn Bus,
        topic: &str,
        prices: Prices,
        registry: &Registry,
    ) -> Result<Self, String> {
        prices.validate()?;
        let metrics = LedgerMetrics::register(registry).map_err(|e| e.to_string())?;
        let publisher = bus
            .publisher(topic)
            .await
            .map_err(|e| format!("cannot publish to the usage topic {topic}: {e}"))?;
        publisher
            .open()
            .await
            .map_err(|e| format!("cannot publish to the usage topic {topic}: {e}"))?;
        Ok(Self {
            publisher,
            prices,
            metrics,
        })
    }

    /// The record of an attempt that ended; `None` when it called no provider.
    pub fn record_of(&self, end: &AttemptEnd<'_>, meter: &UsageMeter) -> Option<UsageRecord> {
        if !meter.called() {
            return None;
        }
        let mut record = UsageRecord {
            id: end.id.to_owned(),
            attempt: end.attempt.to_owned(),
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
    /// [`STORE_WAIT`]) has passed; then it is logged and counted as unrecorded.
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
        let payload = match serde_json::to_vec(record) {
            Ok(p) => p,
            Err(e) => {
                // Plain data: cannot fail; counted and logged if it ever does.
                self.unrecorded(record, &e.to_string());
                return;
            }
        };
        let message = Message::new(payload)
            // Compaction, if the operator turns it on, then keeps every attempt and drops
            // only a record stored twice.
            .with_key(format!("{}/{}", record.id, record.attempt))
            .with_property(sluice_schema::properties::ID, record.id.clone())
            .with_property(sluice_schema::properties::ATTEMPT, record.attempt.clone());
        let stored = tokio::time::timeout(wait.min(STORE_WAIT), async {
            let mut backoff = Backoff::new(Duration::from_secs(2));
            loop {
                let result = match self.publisher.send(message.clone()).await {
                    Ok(receipt) => receipt.await,
                    Err(e) => Err(e),
                };
                match result {
                    Ok(()) => return Ok(()),
                    // Not something a second try changes.
                    Err(e @ BusError::TooLarge { .. }) => return Err(e.to_string()),
                    Err(e) => {
                        let delay = backoff.next_delay();
                        warn!(error = %e, retry_in_ms = delay.as_millis() as u64,
                              "the usage record was not stored; trying again");
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        })
        .await;
        match stored {
            Ok(Ok(())) => debug!(request_id = %record.id, "usage recorded"),
            Ok(Err(e)) => self.unrecorded(record, &e),
            Err(_) => self.unrecorded(record, "not stored in time"),
        }
    }

    fn unrecorded(&self, record: &UsageRecord, why: &str) {
        self.metrics.unrecorded.inc();
        let line = serde_json::to_string(record).unwrap_or_default();
        error!(event = "usage_unrecorded", why, record = %line,
               "a usage record could not be stored on the usage topic; enter it by hand");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
