//! The processor runtime: one consume loop that any service plugs a [`Handler`] into.
//!
//! For each request: decode it, run the handler with up to `concurrency` requests at once,
//! publish the records it streams in order with the request's `id`, and ack the request
//! only once its terminal record is stored. What this loop guarantees, whatever the handler
//! does:
//! - a record that cannot be decoded gets an error record when it carries an id, and is
//!   acked and counted either way: a bad record never cycles through redelivery;
//! - exactly one terminal record per attempt, and nothing after it: a handler that returns
//!   an error, panics, or forgets to finish gets an error record written for it;
//! - a record too large for the bus ends the stream with a `message-too-large` error;
//! - when publishing fails, the request is handed back to the broker (nack) for another
//!   attempt, which starts its stream again under a new attempt id; and the processor takes
//!   no new request (`/readyz` says why) until the broker stores a probe again, so a broker
//!   that cannot write (a bookie turned read-only by a full disk) costs no provider calls;
//! - a request its client cancels (see [`crate::cancel`]) stops at once: the handler, and
//!   with it the provider call, is dropped, and a `cancelled` error ends the stream;
//! - on SIGTERM/SIGINT it stops taking requests, lets in-flight ones finish within the grace
//!   period, and returns. What did not finish is handed back to the broker for another
//!   replica: its handler is dropped and no error record is published for it (the request is
//!   not failed, it is moved), so its stream restarts there under a new attempt id.
//!
//! It never logs payloads: they carry prompts.

use std::{
    collections::BTreeMap,
    panic::AssertUnwindSafe,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use async_trait::async_trait;
use futures::FutureExt;
use prometheus::IntCounter;
use serde::de::DeserializeOwned;
use sluice_schema::{
    Error, ErrorKind, ResponseRecord, properties, topics::Persistence, usage::UsageRecord,
};
use tokio::{
    sync::Semaphore,
    task::JoinSet,
    time::{Duration, Instant},
};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

pub use crate::sink::{
    DEFAULT_MAX_RECORDS_PER_SEC, DEFAULT_PACE_INTERVAL, PaceWhen, Pacing, ResponseSink, SinkError,
};
use crate::{
    billing,
    bus::{Bus, BusError, Delivery, Message, Publisher, SubscribeOptions},
    cancel::{self, CancelRegistry},
    ledger::{AttemptEnd, Ledger, STORE_WAIT, UsageMeter},
    seal::SealKey,
    sink::{Merging, Pacer},
    store::StoreGuard,
    sync::StreamBook,
    telemetry::{Outcome, Telemetry},
    trace,
};

/// Default number of requests handled at once: LLM calls spend their time waiting on
/// the provider, so a processor keeps many in flight.
pub const DEFAULT_CONCURRENCY: usize = 256;

/// How a processor consumes and answers.
#[derive(Debug, Clone)]
pub struct ProcessorConfig {
    /// The processor's name, used in metrics and logs (e.g. `text-completion`).
    pub name: String,
    /// The Pulsar topic URL requests arrive on.
    pub request_topic: String,
    /// The Pulsar topic URL responses are published to.
    pub response_topic: String,
    /// The Shared subscription's name; replicas with the same name share the load.
    pub subscription: String,
    /// Requests handled at once.
    pub concurrency: usize,
    /// How long in-flight requests may run after a shutdown signal.
    pub drain_grace: Duration,
    /// The Pulsar topic URL clients publish cancels on (see [`crate::cancel`]); `None` turns
    /// client cancellation off.
    pub cancel_topic: Option<String>,
    /// The flow this consumer serves (`workspace/flow`), when it is one of several a process
    /// serves (see [`crate::flows`]). Such a consumer shares `/readyz` with the others: it
    /// names itself there, takes its entry away when it stops, and leaves draining the whole
    /// process to the process.
    pub flow: Option<String>,
    /// How the response records are paced (see [`crate::sink`]): by default only on a
    /// non-persistent response topic.
    pub pacing: Pacing,
    /// Where a usage record of every attempt that called a provider goes (see
    /// [`crate::ledger`]); `None` writes none. Only the processor that calls providers
    /// (text-completion) keeps one: the prompt and agent processors' usage is that of the
    /// text-completion requests they make.
    pub ledger: Option<Arc<Ledger>>,
    /// The billing secret's key (see [`crate::billing`]): when set, a request that names an
    /// API key ([`properties::KEY`]) without the gateway's seal of it is refused with a
    /// `no-configuration` error before its handler runs, so nothing is billed to a key on
    /// the publisher's word. Set on the processor that bills (text-completion).
    pub billing: Option<SealKey>,
}

impl ProcessorConfig {
    /// A config with the default concurrency (256) and drain grace (30 s).
    pub fn new(
        name: impl Into<String>,
        request_topic: impl Into<String>,
        response_topic: impl Into<String>,
    ) -> Self {
        let name = name.into();
        Self {
            subscription: name.clone(),
            name,
            request_topic: request_topic.into(),
            response_topic: response_topic.into(),
            concurrency: DEFAULT_CONCURRENCY,
            drain_grace: Duration::from_secs(30),
            cancel_topic: None,
            flow: None,
            pacing: Pacing::default(),
            ledger: None,
            billing: None,
        }
    }
}

/// What a handler knows about the request it is handling.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// The caller's correlation id.
    pub id: String,
    /// This attempt's id, on every record published for it.
    pub attempt: String,
    /// Earlier deliveries of this request seen by this process (see
    /// [`Delivery::redelivery_count`]).
    pub redelivery_count: u32,
    /// The caller's W3C `traceparent`, if any.
    pub traceparent: Option<String>,
    /// The API key's name the request is billed to ([`properties::KEY`]); a handler that
    /// makes requests of its own passes it on, with [`RequestContext::key_seal`].
    pub key: Option<String>,
    /// The gateway's seal of [`RequestContext::key`] ([`properties::KEY_SEAL`]), as received:
    /// forwarded unchanged with the key (see [`crate::billing`]).
    pub key_seal: Option<String>,
    /// Where the handler reports what its provider calls used, for the usage ledger.
    pub usage: UsageMeter,
}

/// A service's business: turn one request into a stream of response records.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// The request record.
    type Request: DeserializeOwned + Send + 'static;
    /// The response record.
    type Response: ResponseRecord;

    /// Handles one request, sending its records through `sink` in order. The last record
    /// sent must be terminal; returning `Err` instead makes the runtime send the error as
    /// the terminal record.
    async fn handle(
        &self,
        request: Self::Request,
        ctx: RequestContext,
        sink: &mut ResponseSink<Self::Response>,
    ) -> Result<(), Error>;
}

/// Runs a processor until `shutdown` is cancelled, then drains. Returns an error only when
/// it cannot start (the subscription or publisher cannot be created).
pub async fn run<H: Handler>(
    bus: Arc<dyn Bus>,
    config: ProcessorConfig,
    handler: Arc<H>,
    telemetry: Telemetry,
    shutdown: CancellationToken,
) -> Result<(), BusError> {
    let concurrency = config.concurrency.max(1);
    telemetry.metrics.processor_started(&config.name);
    if config.billing.is_some() {
        telemetry.metrics.billing_enforced(&config.name);
    }
    let publisher = bus.publisher(&config.response_topic).await?;
    // A role that may not produce the answers must not take a single request: refused now,
    // the process stops with the cause and the topic. An outage is not a reason to stop
    // (the producer is made again at the first record).
    match publisher.open().await {
        Err(e @ BusError::Denied(_)) => return Err(e),
        Err(e) => warn!(processor = %config.name, error = %e,
                        "the response topic cannot be opened yet; going on"),
        Ok(()) => {}
    }
    let cancels = CancelRegistry::default();
    let stop_cancels = CancellationToken::new();
    // Stops the cancel listener if the request subscription below fails.
    let cancels_guard = stop_cancels.clone().drop_guard();
    // Cancellation saves provider calls nobody reads; it is not worth refusing to serve over
    // (a missing `notify` namespace makes the broker lookup retry for long), so the cancel
    // subscription is set up beside the request subscription, and waited for only briefly.
    let (cancels_ready, cancels_subscribed) = tokio::sync::oneshot::channel::<()>();
    let cancel_listener = config.cancel_topic.clone().map(|topic| {
        let (bus, cancels, stop) = (bus.clone(), cancels.clone(), stop_cancels.clone());
        let name = format!("{}-cancel-{}", config.name, crate::short_id());
        let processor = config.name.clone();
        tokio::spawn(async move {
            // Every replica reads every cancel: its own exclusive subscription, from now on.
            let mut options = SubscribeOptions::exclusive(1000);
            options.consumer_name = Some(name.clone());
            let subscribed = tokio::select! {
                () = stop.cancelled() => return,
                s = bus.subscribe(&topic, &name, options) => s,
            };
            let _ = cancels_ready.send(());
            match subscribed {
                Ok(subscription) => cancel::listen(subscription, cancels, stop).await,
                Err(e) => warn!(processor = %processor, topic = %topic, error = %e,
                                "client cancellation is off: the cancel topic cannot be read (create its namespace, e.g. with `sluice pulsar ensure-namespaces`)"),
            }
        })
    });
    let mut options = SubscribeOptions::shared(u32::try_from(concurrency).unwrap_or(u32::MAX));
    options.consumer_name = Some(format!("{}-{}", config.name, crate::short_id()));
    let mut subscription = bus
        .subscribe(&config.request_topic, &config.subscription, options)
        .await?;
    // A cancel published before the listener subscribed is never read (the subscription starts
    // at the latest message, and the notify topics keep nothing), so the first requests wait
    // for it, within a bound: found in CI, a client that went away right after its first token
    // on a just-started processor whose cancel subscription was still being created.
    if cancel_listener.is_some()
        && tokio::time::timeout(CANCEL_SUBSCRIBE_WAIT, cancels_subscribed)
            .await
            .is_err()
    {
        warn!(processor = %config.name, wait = ?CANCEL_SUBSCRIBE_WAIT,
              "serving before the cancel subscription exists: a cancel sent meanwhile is not seen");
    }
    let link_name = match &config.flow {
        // Unique: a changed flow's new consumer starts while the old one drains.
        Some(flow) => format!(
            "{} requests of flow {flow} ({})",
            config.name,
            crate::short_id()
        ),
        None => format!("{} requests", config.name),
    };
    telemetry
        .health
        .watch(link_name.clone(), subscription.link());
    info!(processor = %config.name, flow = config.flow.as_deref().unwrap_or(""),
          topic = %config.request_topic, concurrency, "processor started");

    let config = Arc::new(config);
    let store = StoreGuard::new(config.name.clone(), telemetry.clone());
    // Only a non-persistent response topic loses records in transit: there the processor
    // syncs (see crate::sync), from its own account of the streams it answers.
    let book = Persistence::of(&config.response_topic).is_lossy().then(|| {
        Arc::new(StreamBook::new(format!(
            "{}-{}",
            config.name,
            crate::short_id()
        )))
    });
    // One pacer per processor name in the process: the flows a process serves share its rate
    // bound.
    let merging = config.pacing.merging(&config.response_topic);
    let pacer =
        (merging == Merging::Paced).then(|| telemetry.metrics.pacer(&config.name, config.pacing));
    let behind = (merging == Merging::WhileBehind)
        .then(|| telemetry.metrics.coalesced_counter(&config.name));
    let shared = Arc::new(Shared {
        publisher: publisher.clone(),
        telemetry: telemetry.clone(),
        config: config.clone(),
        cancels: cancels.clone(),
        store: store.clone(),
        book: book.clone(),
        pacer: pacer.clone(),
        behind,
    });
    let semaphore = Arc::new(Semaphore::new(concurrency));
    let waiting = Arc::new(AtomicBool::new(false));
    let stop_syncs = CancellationToken::new();
    let syncs = book.map(|book| {
        tokio::spawn(send_syncs(
            publisher.clone(),
            config.name.clone(),
            book,
            Taking {
                slots: semaphore.clone(),
                waiting: waiting.clone(),
                store: store.clone(),
                shutdown: shutdown.clone(),
            },
            stop_syncs.clone(),
        ))
    });
    // Cancelled if the drain grace runs out: each unfinished request task drops its handler
    // (and with it the provider call) and hands its request back.
    let abandon = CancellationToken::new();
    let mut tasks = JoinSet::new();
    loop {
        if store.is_blocked() && !store.wait_until_stored(&*publisher, &shutdown).await {
            break;
        }
        // Take a slot before taking a request, so a busy processor leaves requests with the
        // broker for other replicas.
        let permit = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            p = semaphore.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        waiting.store(true, Ordering::Relaxed);
        let delivery = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            // A request task found the broker unable to store while this loop waited for a
            // request: probe now (at the top of the loop), not when the next request arrives,
            // which may never happen (see `StoreGuard`). `next` is cancel-safe: a request it
            // was about to hand over is taken at the next turn.
            () = store.until_blocked() => {
                waiting.store(false, Ordering::Relaxed);
                drop(permit);
                continue;
            }
            d = subscription.next() => d,
        };
        waiting.store(false, Ordering::Relaxed);
        let delivery = match delivery {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                warn!(processor = %config.name, error = %e, "receiving failed");
                continue;
            }
            None => break,
        };
        // Taken while another request found the broker unable to store: it waits here, with
        // no provider call, until the broker stores again (dropped, it goes back on shutdown).
        if store.is_blocked() && !store.wait_until_stored(&*publisher, &shutdown).await {
            drop(delivery);
            break;
        }
        let (task_handler, task_shared, cancel) =
            (handler.clone(), shared.clone(), abandon.child_token());
        tasks.spawn(async move {
            handle_delivery(&*task_handler, delivery, &task_shared, cancel).await;
            drop(permit);
        });
        while let Some(done) = tasks.try_join_next() {
            if let Err(e) = done {
                error!(processor = %config.name, error = %e, "request task failed");
            }
        }
    }

    // Drain: stop routing new work here, keep settling what is in flight. One flow of many
    // going away leaves the process ready for the others.
    if config.flow.is_none() {
        telemetry.health.set_draining();
    }
    subscription.pause();
    let in_flight = tasks.len();
    info!(processor = %config.name, in_flight, grace = ?config.drain_grace, "draining");
    let drained = tokio::time::timeout(config.drain_grace, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!(processor = %config.name, abandoned = tasks.len(),
              "drain grace expired; handing unfinished requests back to the broker");
        abandon.cancel();
        let handed_back = tokio::time::timeout(HAND_BACK_BOUND, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if handed_back.is_err() {
            // Stuck on the broker: dropped unacked, the broker redelivers them all the same.
            tasks.shutdown().await;
        }
    }
    subscription.close().await;
    drop(cancels_guard);
    stop_syncs.cancel();
    if let Some(syncs) = syncs {
        let _ = syncs.await;
    }
    if let Some(listener) = cancel_listener {
        let _ = listener.await;
    }
    if config.flow.is_some() {
        telemetry.health.unwatch(&link_name);
    }
    // Usage records the broker has not stored yet get a last chance (see crate::ledger);
    // one flow of several stopping leaves them to the others (run_flows_until_signalled
    // flushes when all have stopped).
    if let Some(ledger) = config.ledger.as_ref().filter(|_| config.flow.is_none()) {
        ledger.flush(LEDGER_FLUSH_BOUND).await;
    }
    info!(processor = %config.name, flow = config.flow.as_deref().unwrap_or(""), "processor stopped");
    Ok(())
}

/// Runs a processor as a whole process: serves `/metrics`, `/healthz`, `/readyz` on
/// `metrics_addr` until the processor has drained (so probes see 503 while draining, and
/// the last scrape sees the final counts), and drains on SIGTERM or SIGINT.
pub async fn run_until_signalled<H: Handler>(
    bus: Arc<dyn Bus>,
    config: ProcessorConfig,
    handler: Arc<H>,
    telemetry: Telemetry,
    metrics_addr: std::net::SocketAddr,
) -> Result<std::net::SocketAddr, RunError> {
    let shutdown = crate::telemetry::shutdown_on_signals();
    let telemetry_stop = CancellationToken::new();
    let bound = telemetry
        .serve(metrics_addr, telemetry_stop.clone())
        .await
        .map_err(|e| RunError::Telemetry(metrics_addr, e))?;
    info!(%bound, "serving /metrics /healthz /readyz");
    let result = run(bus, config, handler, telemetry, shutdown).await;
    telemetry_stop.cancel();
    result.map_err(RunError::Bus)?;
    Ok(bound)
}

/// Why a processor process could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The telemetry port could not be bound.
    #[error("cannot serve metrics on {0}: {1}")]
    Telemetry(std::net::SocketAddr, std::io::Error),
    /// The bus failed at start-up.
    #[error(transparent)]
    Bus(#[from] BusError),
}

/// How often a processor publishing to a non-persistent response topic sends a sync (see
/// [`properties::SYNC`]).
pub const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// What a sync says about whether the processor takes requests now.
struct Taking {
    slots: Arc<Semaphore>,
    /// The consume loop holds a slot and waits for the next request.
    waiting: Arc<AtomicBool>,
    store: StoreGuard,
    shutdown: CancellationToken,
}

impl Taking {
    fn now(&self) -> bool {
        (self.waiting.load(Ordering::Relaxed) || self.slots.available_permits() > 0)
            && !self.store.is_blocked()
            && !self.shutdown.is_cancelled()
    }
}

/// Sends a sync through the response publisher every [`SYNC_INTERVAL`], idle or not.
///
/// Why: a client can see that the broker dropped records only when a later message of the
/// same producer arrives, and a request dropped on its way to the processors, or a stream
/// whose every record was dropped, leaves nothing later at all. The sync is that later
/// message, and what it lists (see [`crate::sync`]) tells a client which of its streams
/// cannot end any more. It goes through the same publisher, hence the same producer and
/// after every record counted in it. Idle processors sync too: a request dropped while they
/// were idle is seen only because they say they took nothing.
async fn send_syncs(
    publisher: Arc<dyn Publisher>,
    processor: String,
    book: Arc<StreamBook>,
    taking: Taking,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(SYNC_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let state = book.snapshot(taking.now());
        let state = match serde_json::to_string(&state) {
            Ok(s) => s,
            Err(e) => {
                debug!(processor, error = %e, "a sync could not be encoded");
                continue;
            }
        };
        let sync = Message::new(&b"{}"[..])
            .with_property(properties::ID, properties::SYNC)
            .with_property(properties::SYNC, processor.as_str())
            .with_property(properties::SYNC_STATE, state);
        if let Err(e) = publisher.send(sync).await {
            debug!(processor, error = %e, "a sync could not be published");
        }
    }
}

fn client_cancelled() -> Error {
    Error::new(ErrorKind::Cancelled, "the client cancelled the request")
}

/// How long unfinished requests get, once the drain grace has run out, to be handed back
/// (their held records flushed, their streams retracted, a nack sent) before their tasks are
/// dropped. Short: the handler is already gone, only the broker is waited for.
const HAND_BACK_BOUND: Duration = Duration::from_secs(5);

/// What the usage record of an attempt needs when its task is dropped before writing it
/// (see [`handle_delivery`]): on drop, unless disarmed, the record goes to the ledger's
/// backlog as `retried` (the request was not acked and comes back).
struct Unwritten {
    ledger: Arc<Ledger>,
    id: String,
    attempt: String,
    trace_id: String,
    key: Option<String>,
    flow: Option<String>,
    service: String,
    started: Instant,
    redelivery_count: u32,
    meter: UsageMeter,
}

impl Unwritten {
    /// The attempt's usage record ending with `outcome` (and the terminal error's kind), or
    /// `None` when no provider call started on its meter (or the guard is disarmed).
    fn record(&self, outcome: &str, error: Option<&str>) -> Option<UsageRecord> {
        let end = AttemptEnd {
            id: &self.id,
            attempt: &self.attempt,
            trace_id: Some(&self.trace_id),
            key: self.key.as_deref(),
            flow: self.flow.as_deref(),
            service: &self.service,
            outcome,
            error,
            duration: self.started.elapsed(),
            redelivery_count: self.redelivery_count,
        };
        self.ledger.record_of(&end, &self.meter)
    }

    /// The record was written: nothing to do on drop.
    fn disarm(&mut self) {
        self.meter = UsageMeter::default();
    }
}

impl Drop for Unwritten {
    fn drop(&mut self) {
        if let Some(record) = self.record("retried", None) {
            self.ledger.enqueue(record);
        }
    }
}

/// How long a stopping processor waits for its ledger's backlog to be stored.
pub(crate) const LEDGER_FLUSH_BOUND: Duration = Duration::from_secs(5);

/// How long a starting processor waits for its cancel subscription before it takes requests
/// anyway (see [`run`]).
const CANCEL_SUBSCRIBE_WAIT: Duration = Duration::from_secs(5);

/// Whether a nacked request comes back. Where the broker keeps requests, a nack brings the
/// request back for another attempt; on a non-persistent request topic it is gone, and its
/// stream stays listed (finished, with what was published) so that its client sees the loss
/// at once.
fn requests_come_back(config: &ProcessorConfig) -> bool {
    !Persistence::of(&config.request_topic).is_lossy()
}

/// What every request task of one processor shares.
struct Shared {
    publisher: Arc<dyn Publisher>,
    telemetry: Telemetry,
    config: Arc<ProcessorConfig>,
    cancels: CancelRegistry,
    store: StoreGuard,
    book: Option<Arc<StreamBook>>,
    /// Set when the response records are paced.
    pacer: Option<Arc<Pacer>>,
    /// Set when deltas are merged while the broker is behind: the count of merged deltas.
    behind: Option<IntCounter>,
}

async fn handle_delivery<H: Handler>(
    handler: &H,
    delivery: Delivery,
    shared: &Shared,
    abandon: CancellationToken,
) {
    let Shared {
        publisher,
        telemetry,
        config,
        cancels,
        store,
        book,
        pacer,
        behind,
    } = shared;
    let started = Instant::now();
    let metrics = &telemetry.metrics;
    let processor = config.name.as_str();
    let Some(id) = delivery.property(properties::ID).map(str::to_owned) else {
        // Nobody to answer: count it, say so, and ack so it never comes back.
        warn!(
            processor,
            bytes = delivery.payload().len(),
            "request without an `id` property dropped"
        );
        metrics.request_finished(processor, Outcome::Malformed, 0.0);
        delivery.ack();
        return;
    };
    let attempt = uuid::Uuid::new_v4().simple().to_string();
    // This request's span: a child of the caller's context, whose own context goes to
    // whatever the handler calls (see crate::trace).
    let mut trace_span = trace::Span::start(
        trace::Kind::Consumer,
        format!("{processor} process"),
        delivery.property(properties::TRACEPARENT),
    );
    let trace_id = trace_span.context().trace_id();
    trace_span.set("messaging.system", "pulsar");
    trace_span.set("sluice.processor", processor.to_owned());
    trace_span.set("sluice.request_id", id.clone());
    trace_span.set("sluice.attempt", attempt.clone());
    let traceparent = Some(trace_span.traceparent());
    let mut props = BTreeMap::from([
        (properties::ID.to_owned(), id.clone()),
        (properties::ATTEMPT.to_owned(), attempt.clone()),
    ]);
    for key in [
        properties::TRACEPARENT,
        properties::TRACESTATE,
        properties::CONTINUES,
        properties::REPLY_TO,
    ] {
        if let Some(v) = delivery.property(key) {
            props.insert(key.to_owned(), v.to_owned());
        }
    }
    if delivery.redelivery_count() > 0 {
        metrics.redelivered(processor);
    }
    let span = info_span!("request", processor, request_id = %id, attempt = %attempt);
    metrics.in_flight(processor, 1);
    let key = delivery.property(properties::KEY).map(str::to_owned);
    let key_seal = delivery.property(properties::KEY_SEAL).map(str::to_owned);
    // A processor that bills believes a key only with the gateway's seal of it.
    let unverified = match (&config.billing, &key) {
        (Some(secret), Some(name)) => billing::verify(secret, name, key_seal.as_deref()).err(),
        _ => None,
    };
    // The key's name and its seal go on to the agent's next step, not onto the records.
    let carried: BTreeMap<String, String> = [
        (properties::KEY, key.as_ref()),
        (properties::KEY_SEAL, key_seal.as_ref()),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k.to_owned(), v?.clone())))
    .collect();
    let mut sink = ResponseSink::<H::Response>::new(
        publisher.clone(),
        props,
        carried,
        book.clone(),
        pacer.clone(),
        behind.clone(),
        metrics.records_counter(processor),
    );
    let in_flight = cancels.begin(&id);
    let meter = UsageMeter::default();
    // A task dropped before its usage record was written (its processor stopping while the
    // broker is stuck) still leaves the record in the ledger's backlog.
    let mut unwritten = config.ledger.clone().map(|ledger| Unwritten {
        ledger,
        id: id.clone(),
        attempt: attempt.clone(),
        trace_id: trace_id.clone(),
        key: key.clone(),
        flow: config.flow.clone(),
        service: config.name.clone(),
        started,
        redelivery_count: delivery.redelivery_count(),
        meter: meter.clone(),
    });
    let outcome = async {
        let Some(in_flight) = in_flight else {
            debug!("cancelled by its client before it was taken");
            let _ = sink.send(H::Response::from_error(client_cancelled())).await;
            return Outcome::Cancelled;
        };
        if let (Some(why), Some(name)) = (unverified, &key) {
            // The name is the publisher's claim, so it is logged but never a metric label.
            warn!(key = %name, reason = why.as_str(),
                  "a request names an API key without a valid billing seal; refused");
            metrics.unverified_key(processor, why);
            let _ = sink
                .send(H::Response::from_error(Error::new(
                    ErrorKind::NoConfiguration,
                    format!(
                        "the request names the API key {name:?} without the gateway's billing \
                         seal of it ({}): it is not billed to that key, nor answered. The \
                         gateway and text-completion need the same {}",
                        why.as_str(),
                        billing::SECRET_VAR
                    ),
                )))
                .await;
            return Outcome::Error;
        }
        // The message names the field and the type expected, never a value (see
        // sluice_schema::decode): the payload may carry a prompt or a secret.
        match sluice_schema::decode::<H::Request>(delivery.payload()) {
            Err(e) => {
                let message = e.to_string();
                warn!(error = %message, "malformed request");
                let _ = sink
                    .send(H::Response::from_error(Error::new(
                        ErrorKind::InvalidRequest,
                        message,
                    )))
                    .await;
                Outcome::Malformed
            }
            Ok(request) => {
                let ctx = RequestContext {
                    id: id.clone(),
                    attempt: attempt.clone(),
                    redelivery_count: delivery.redelivery_count(),
                    traceparent,
                    key,
                    key_seal,
                    usage: meter.clone(),
                };
                // Dropping the handler's future on a client cancel, or when the drain grace
                // runs out, drops its provider call (and closes that connection) wherever it
                // is waiting.
                let result = tokio::select! {
                    r = AssertUnwindSafe(handler.handle(request, ctx, &mut sink)).catch_unwind() => Some(r),
                    () = in_flight.token().cancelled() => {
                        debug!("cancelled by its client");
                        if !sink.is_ended() {
                            let _ = sink.send(H::Response::from_error(client_cancelled())).await;
                        }
                        return Outcome::Cancelled;
                    }
                    () = abandon.cancelled() => None,
                };
                let failure = match result {
                    // The drain grace ran out after the answer was complete: it stands.
                    None if sink.is_ended() => None,
                    // Not failed but moved: handed back below, with no error record.
                    None if requests_come_back(config) => return Outcome::Retried,
                    // A nack would lose the request (non-persistent topic): answer it.
                    None => Some(Error::new(
                        ErrorKind::Cancelled,
                        "the processor shut down before the answer was complete (its drain \
                         grace ran out); send the request again",
                    )),
                    Some(Ok(Ok(()))) if sink.is_ended() => None,
                    Some(Ok(Ok(()))) => Some(Error::new(
                        ErrorKind::Internal,
                        "the handler finished without a terminal record",
                    )),
                    Some(Ok(Err(e))) => Some(e),
                    Some(Err(_)) => {
                        // A panic must not become a redelivery loop: answer and ack.
                        error!("handler panicked");
                        Some(Error::new(
                            ErrorKind::Internal,
                            "the processor failed while handling this request",
                        ))
                    }
                };
                if let Some(err) = failure
                    && !sink.is_ended()
                {
                    let _ = sink.send(H::Response::from_error(err)).await;
                }
                if sink.ended_with_error() {
                    Outcome::Error
                } else if sink.handed_off() {
                    Outcome::Continued
                } else {
                    Outcome::Success
                }
            }
        }
    }
    .instrument(span.clone())
    .await;
    let flushed = sink.flush().await;
    trace_span.set("sluice.outcome", outcome.as_str());
    if matches!(outcome, Outcome::Error | Outcome::Malformed) || flushed.is_err() {
        trace_span.fail(outcome.as_str());
    }
    trace_span.end();
    if let Err(e) = &flushed {
        // Blocked at once (before the usage record, and the nack below): the consume loop
        // must wait for the broker rather than call the provider for answers it cannot store.
        store.block(e);
    }
    if let Some(u) = unwritten.as_mut() {
        let handed_back = !(flushed.is_ok() && sink.is_ended());
        let usage = match outcome {
            _ if handed_back => "retried",
            Outcome::Error | Outcome::Malformed => "error",
            Outcome::Cancelled => "cancelled",
            Outcome::Retried => "retried",
            Outcome::Success | Outcome::Continued => "answered",
        };
        if let Some(record) = u.record(usage, sink.error_kind()) {
            // Stored before the ack (see crate::ledger). Not waited for when the broker just
            // failed to store the records, nor once the drain grace has run out: the record
            // goes to the backlog at once and the request is settled.
            let wait = if flushed.is_err() || abandon.is_cancelled() {
                Duration::ZERO
            } else {
                STORE_WAIT
            };
            u.ledger.write(&record, wait).instrument(span.clone()).await;
        }
        u.disarm();
    }
    // Out of flight once its usage is written too: a caller that sees the gauge at 0 finds
    // every record in the ledger (or its backlog).
    metrics.in_flight(processor, -1);
    let _enter = span.enter();
    let requests_come_back = requests_come_back(config);
    match flushed {
        Ok(()) if sink.is_ended() => {
            delivery.ack();
            metrics.request_finished(processor, outcome, started.elapsed().as_secs_f64());
            debug!(records = sink.records_sent(), "request done");
        }
        Ok(()) if outcome == Outcome::Retried => {
            warn!("unfinished when the drain grace ran out; handing the request back");
            if requests_come_back {
                sink.retract().await;
            } else if !sink.is_ended() {
                sink.abandon().await;
            }
            delivery.nack();
            metrics.request_finished(processor, Outcome::Retried, 0.0);
        }
        Ok(()) => {
            warn!("no terminal record could be published; handing the request back");
            if requests_come_back {
                sink.retract().await;
            } else if !sink.is_ended() {
                sink.abandon().await;
            }
            delivery.nack();
            metrics.request_finished(processor, Outcome::Retried, 0.0);
        }
        Err(e) => {
            warn!(error = %e, "publishing failed; handing the request back for another attempt");
            // Blocked above, before the nack: the redelivered request must find the consume
            // loop already waiting for the broker, not calling the provider again.
            if requests_come_back {
                sink.retract().await;
            } else if !sink.is_ended() {
                sink.abandon().await;
            }
            delivery.nack();
            metrics.request_finished(processor, Outcome::Retried, 0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sluice_schema::{TextCompletionRequest, TextCompletionResponse};

    use super::*;
    use crate::bus::{Subscription, memory::MemoryBus};

    struct Echo;

    /// Counts handler futures of "hang" requests that were dropped.
    static HANGS_DROPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// Counts handler futures of "linger" requests that were dropped (a counter of its own:
    /// tests run in parallel).
    static LINGERS_DROPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    struct OnDrop(&'static std::sync::atomic::AtomicUsize);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[async_trait]
    impl Handler for Echo {
        type Request = TextCompletionRequest;
        type Response = TextCompletionResponse;

        async fn handle(
            &self,
            request: TextCompletionRequest,
            ctx: RequestContext,
            sink: &mut ResponseSink<TextCompletionResponse>,
        ) -> Result<(), Error> {
            match request.prompt.as_str() {
                "panic" => panic!("boom"),
                "whose-key" => {
                    // What a handler is told to bill, and forwards.
                    let said = format!("{:?} {:?}", ctx.key, ctx.key_seal);
                    let _ = sink
                        .send(TextCompletionResponse {
                            response: said,
                            end_of_stream: true,
                            ..Default::default()
                        })
                        .await;
                    return Ok(());
                }
                "forget" => return Ok(()),
                "hang" | "linger" | "stall" => {
                    // Each test that counts drops has a prompt of its own.
                    let _guard = match request.prompt.as_str() {
                        "hang" => Some(OnDrop(&HANGS_DROPPED)),
                        "linger" => Some(OnDrop(&LINGERS_DROPPED)),
                        _ => None,
                    };
                    let _ = sink
                        .send(TextCompletionResponse {
                            response: "started".into(),
                            ..Default::default()
                        })
                        .await;
                    std::future::pending::<()>().await;
                }
                "fail" => return Err(Error::new(ErrorKind::Llm, "provider said no")),
                "handoff-fails" => {
                    let _ = sink
                        .send(TextCompletionResponse {
                            response: "step one".into(),
                            ..Default::default()
                        })
                        .await;
                    // As the agent does: the hand-off failing becomes the handler's error.
                    return sink
                        .hand_off(&Unstorable, b"{}".to_vec())
                        .await
                        .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()));
                }
                "huge" => {
                    let big = TextCompletionResponse {
                        response: "x".repeat(4096),
                        ..Default::default()
                    };
                    let ended = sink.send(big).await;
                    assert!(matches!(ended, Err(SinkError::Ended)));
                    return Ok(());
                }
                _ => {}
            }
            for word in request.prompt.split(' ') {
                let _ = sink
                    .send(TextCompletionResponse {
                        response: word.to_owned(),
                        ..Default::default()
                    })
                    .await;
            }
            sink.send(TextCompletionResponse {
                end_of_stream: true,
                ..Default::default()
            })
            .await
            .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
            // Nothing may follow the terminal record.
            assert!(matches!(
                sink.send(TextCompletionResponse::default()).await,
                Err(SinkError::Ended)
            ));
            Ok(())
        }
    }

    /// A publisher whose broker never stores anything.
    struct Unstorable;

    #[async_trait]
    impl Publisher for Unstorable {
        async fn send(&self, _: Message) -> Result<crate::bus::Receipt, BusError> {
            Err(BusError::Unavailable("the bookie is read-only".into()))
        }
        fn topic(&self) -> &str {
            "next-step"
        }
    }

    #[tokio::test]
    async fn a_hand_off_the_broker_did_not_store_goes_back_to_the_broker_not_to_the_client() {
        let mut f = start().await;
        let mut m = Message::new(r#"{"prompt":"handoff-fails"}"#.to_owned());
        m = m.with_property(properties::ID, "h1");
        f.bus.publisher("req").await.unwrap().send(m).await.unwrap();
        // The record sent before the hand-off arrives (once per attempt); no terminal error
        // ever does, and the request is handed back for another attempt.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while let Ok(Some(Ok(d))) = tokio::time::timeout_at(deadline, f.responses.next()).await {
            if d.property(properties::ID) != Some("h1") {
                // The processor's probes of the broker while it waits to store again.
                d.ack();
                continue;
            }
            let r: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
            d.ack();
            assert!(r.error.is_none(), "{r:?}");
            assert_eq!(r.response, "step one");
        }
        let text = f.telemetry.render();
        assert!(
            !text.contains(
                r#"sluice_processor_requests_total{outcome="retried",processor="echo"} 0"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"sluice_processor_requests_total{outcome="error",processor="echo"} 0"#),
            "{text}"
        );
        f.shutdown.cancel();
        let _ = f.task.await;
    }

    struct Fixture {
        bus: MemoryBus,
        responses: Box<dyn Subscription>,
        telemetry: Telemetry,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<Result<(), BusError>>,
    }

    async fn start() -> Fixture {
        let mut config = ProcessorConfig::new("echo", "req", "resp");
        config.drain_grace = Duration::from_millis(200);
        config.cancel_topic = Some("cancel".into());
        start_with(config).await
    }

    /// A processor of `config` answering with [`Echo`] on an in-process bus, subscribed to
    /// before anything is published, with a subscription to its response topic.
    async fn start_with(config: ProcessorConfig) -> Fixture {
        let bus = MemoryBus::new(2048, 1000);
        let responses = bus
            .subscribe(
                &config.response_topic,
                "test",
                SubscribeOptions::exclusive(100),
            )
            .await
            .unwrap();
        let telemetry = Telemetry::new().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            Arc::new(bus.clone()),
            config,
            Arc::new(Echo),
            telemetry.clone(),
            shutdown.clone(),
        ));
        // Let the processor subscribe before anything is published.
        tokio::time::timeout(Duration::from_secs(5), telemetry.health.until_watched(1))
            .await
            .expect("the processor subscribes");
        Fixture {
            bus,
            responses,
            telemetry,
            shutdown,
            task,
        }
    }

    /// On a non-persistent response topic the processor syncs every second, idle or not, and
    /// its syncs list each stream with the records published before them and say whether it
    /// takes requests (with one slot: yes while idle, no while that slot is busy).
    #[tokio::test]
    async fn on_a_non_persistent_topic_syncs_list_the_streams_and_whether_requests_are_taken() {
        let mut config = ProcessorConfig::new("echo", "req", "non-persistent://t/ns/resp");
        config.concurrency = 1;
        config.drain_grace = Duration::from_millis(100);
        let Fixture {
            bus,
            mut responses,
            shutdown,
            task,
            ..
        } = start_with(config).await;
        let mut next_sync = async || loop {
            let d = tokio::time::timeout(Duration::from_secs(5), responses.next())
                .await
                .expect("a message")
                .unwrap()
                .unwrap();
            let state = d.property(properties::SYNC_STATE).map(|state| {
                assert_eq!(d.property(properties::SYNC), Some("echo"));
                assert_eq!(&d.payload()[..], b"{}");
                serde_json::from_str::<crate::sync::SyncState>(state).unwrap()
            });
            d.ack();
            if let Some(state) = state {
                return state;
            }
        };
        let idle = next_sync().await;
        assert!(idle.taking && idle.streams.is_empty(), "{idle:?}");
        assert!(idle.instance.starts_with("echo-"));
        bus.publisher("req")
            .await
            .unwrap()
            .send(Message::new(r#"{"prompt":"stall"}"#).with_property(properties::ID, "r1"))
            .await
            .unwrap();
        let busy = loop {
            let s = next_sync().await;
            if !s.streams.is_empty() {
                break s;
            }
        };
        assert!(!busy.taking, "its one slot is busy: {busy:?}");
        assert_eq!(busy.instance, idle.instance);
        let (id, attempt, published, open) = &busy.streams[0];
        assert_eq!(
            (id.as_str(), *published, attempt.len(), *open),
            ("r1", 1, 8, true)
        );
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    async fn ask(f: &mut Fixture, id: Option<&str>, payload: &str) -> Vec<TextCompletionResponse> {
        ask_with(f, id, payload, &[]).await
    }

    /// [`ask`], the request carrying `props` too.
    async fn ask_with(
        f: &mut Fixture,
        id: Option<&str>,
        payload: &str,
        props: &[(&str, &str)],
    ) -> Vec<TextCompletionResponse> {
        let mut m = Message::new(payload.to_owned());
        if let Some(id) = id {
            m = m.with_property(properties::ID, id);
        }
        for (k, v) in props {
            m = m.with_property(*k, *v);
        }
        f.bus.publisher("req").await.unwrap().send(m).await.unwrap();
        let mut out = Vec::new();
        loop {
            let d = tokio::time::timeout(Duration::from_secs(5), f.responses.next())
                .await
                .expect("a response")
                .unwrap()
                .unwrap();
            assert_eq!(d.property(properties::ID), id);
            assert!(d.property(properties::ATTEMPT).is_some());
            let r: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
            d.ack();
            let end = r.end_of_stream;
            out.push(r);
            if end {
                return out;
            }
        }
    }

    /// A processor given the billing secret hands its handler a key only with the gateway's
    /// seal of it; any other key is refused before the handler runs (nothing is called, so
    /// nothing is billed), and counted. Without the secret a key is taken as it comes.
    #[tokio::test]
    async fn with_a_billing_secret_a_key_is_believed_only_with_the_gateways_seal() {
        use crate::{billing, secret::Secret};
        let secret = |s: &str| SealKey::new(&Secret::new(s), "test").unwrap();
        let ours = secret("billing-secret-of-this-test-0123456789");
        let theirs = secret("another-billing-secret-0123456789abcd");
        let mut config = ProcessorConfig::new("echo", "req", "resp");
        config.billing = Some(ours.clone());
        let mut f = start_with(config).await;
        let whose = r#"{"prompt":"whose-key"}"#;
        let team_a = billing::seal(&ours, "team-a", "gw-1");
        let out = ask_with(
            &mut f,
            Some("k1"),
            whose,
            &[
                (properties::KEY, "team-a"),
                (properties::KEY_SEAL, team_a.as_str()),
            ],
        )
        .await;
        assert_eq!(
            out[0].response,
            format!("Some(\"team-a\") Some({team_a:?})"),
            "sealed: believed, and the seal handed on as it came"
        );
        // A request that names no key bills none: taken as before.
        let out = ask_with(&mut f, Some("k2"), whose, &[]).await;
        assert_eq!(out[0].response, "None None");
        let forged = [
            ("unsealed", vec![(properties::KEY, "team-a".to_owned())]),
            (
                "another key's seal",
                vec![
                    (properties::KEY, "team-b".to_owned()),
                    (properties::KEY_SEAL, team_a.clone()),
                ],
            ),
            (
                "another secret's seal",
                vec![
                    (properties::KEY, "team-a".to_owned()),
                    (
                        properties::KEY_SEAL,
                        billing::seal(&theirs, "team-a", "gw-1"),
                    ),
                ],
            ),
            (
                "a seal claimed for another request",
                vec![
                    (properties::KEY, "team-a".to_owned()),
                    (properties::KEY_SEAL, team_a.replace(":gw-1", ":gw-2")),
                ],
            ),
        ];
        for (i, (case, props)) in forged.iter().enumerate() {
            let props: Vec<(&str, &str)> = props.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let out = ask_with(&mut f, Some(&format!("f{i}")), whose, &props).await;
            assert_eq!(out.len(), 1, "{case}: {out:?}");
            let err = out[0]
                .error
                .as_ref()
                .unwrap_or_else(|| panic!("{case}: {out:?}"));
            assert_eq!(err.kind, "no-configuration", "{case}");
            assert!(
                err.message.contains("SLUICE_BILLING_SECRET")
                    && !err.message.contains("billing-secret-of"),
                "{case}: {}",
                err.message
            );
        }
        let text = f.telemetry.render();
        for (reason, n) in [("unsealed", 1), ("bad-seal", 3)] {
            let line = format!(
                "sluice_processor_unverified_keys_total{{processor=\"echo\",reason=\"{reason}\"}} {n}"
            );
            assert!(text.contains(&line), "{line} in:\n{text}");
        }
        // No key's name becomes a label.
        assert!(!text.contains("team-a") && !text.contains("team-b"));
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();

        // Without the secret, a key is taken on the publisher's word (as before).
        let mut f = start().await;
        let out = ask_with(&mut f, Some("n1"), whose, &[(properties::KEY, "team-a")]).await;
        assert_eq!(out[0].response, "Some(\"team-a\") None");
        assert!(
            !f.telemetry
                .render()
                .contains("sluice_processor_unverified_keys_total")
        );
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn streams_in_order_and_ends_with_one_terminal_record() {
        let mut f = start().await;
        let out = ask(&mut f, Some("r1"), r#"{"prompt":"a b c","streaming":true}"#).await;
        let words: Vec<_> = out.iter().map(|r| r.response.as_str()).collect();
        assert_eq!(words, ["a", "b", "c", ""]);
        assert!(out.iter().filter(|r| r.end_of_stream).count() == 1);
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn every_failure_becomes_one_terminal_error_record() {
        let mut f = start().await;
        for (prompt, kind) in [
            ("panic", "internal-error"),
            ("forget", "internal-error"),
            ("fail", "llm-error"),
            ("huge", "message-too-large"),
        ] {
            let out = ask(&mut f, Some(prompt), &format!(r#"{{"prompt":"{prompt}"}}"#)).await;
            assert_eq!(out.len(), 1, "{prompt}: {out:?}");
            assert_eq!(out[0].error.as_ref().unwrap().kind, kind, "{prompt}");
        }
        let out = ask(&mut f, Some("bad"), r#"{"prompt": 42}"#).await;
        let err = out[0].error.as_ref().unwrap();
        assert_eq!(err.kind, "invalid-request");
        assert!(
            !err.message.contains("42"),
            "the payload is not quoted back"
        );
        let text = f.telemetry.render();
        assert!(text.contains(
            r#"sluice_processor_requests_total{outcome="malformed",processor="echo"} 1"#
        ));
        assert!(
            text.contains(r#"sluice_processor_requests_total{outcome="error",processor="echo"} 4"#)
        );
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();
    }

    // The clock is paused so that the wait for the early cancel to be read is exact: a
    // sleep then ends only once every other task (the cancel listener too) is idle.
    #[tokio::test(start_paused = true)]
    async fn a_cancel_drops_the_handler_and_ends_the_stream_with_cancelled() {
        let mut f = start().await;
        let cancels = f.bus.publisher("cancel").await.unwrap();
        f.bus
            .publisher("req")
            .await
            .unwrap()
            .send(Message::new(r#"{"prompt":"hang"}"#).with_property(properties::ID, "h1"))
            .await
            .unwrap();
        let d = f.responses.next().await.unwrap().unwrap();
        let first: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        assert_eq!(first.response, "started");
        cancels.send(cancel::cancel_message("h1")).await.unwrap();
        let d = tokio::time::timeout(Duration::from_secs(5), f.responses.next())
            .await
            .expect("the cancelled record")
            .unwrap()
            .unwrap();
        let last: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        assert!(last.end_of_stream);
        assert_eq!(last.error.unwrap().kind, "cancelled");
        assert_eq!(HANGS_DROPPED.load(std::sync::atomic::Ordering::SeqCst), 1);

        // A cancel that arrives before its request: the request is answered, not handled.
        cancels.send(cancel::cancel_message("early")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        let out = ask(&mut f, Some("early"), r#"{"prompt":"hang"}"#).await;
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].error.as_ref().unwrap().kind, "cancelled");
        let text = f.telemetry.render();
        assert!(text.contains(
            r#"sluice_processor_requests_total{outcome="cancelled",processor="echo"} 2"#
        ));
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();
    }

    /// Starts the echo processor on a bus whose cancel subscription waits for `gate`, and
    /// publishes one stalling request to it once its request subscription exists.
    async fn start_behind_a_slow_cancel_subscription(
        gate: tokio::sync::watch::Receiver<bool>,
    ) -> Fixture {
        let bus = MemoryBus::new(2048, 1000);
        let responses = bus
            .subscribe("resp", "test", SubscribeOptions::exclusive(100))
            .await
            .unwrap();
        let mut config = ProcessorConfig::new("echo", "req", "resp");
        config.cancel_topic = Some("cancel".into());
        config.drain_grace = Duration::from_millis(200);
        let telemetry = Telemetry::new().unwrap();
        let shutdown = CancellationToken::new();
        let slow = crate::bus::memory::SlowCancelTopic {
            inner: bus.clone(),
            publishers: false,
            gate,
        };
        let task = tokio::spawn(run(
            Arc::new(slow),
            config,
            Arc::new(Echo),
            telemetry.clone(),
            shutdown.clone(),
        ));
        // On paused time: every task runs until idle first, so the in-process request
        // subscription exists after this.
        tokio::time::sleep(Duration::from_millis(100)).await;
        bus.publisher("req")
            .await
            .unwrap()
            .send(Message::new(r#"{"prompt":"stall"}"#).with_property(properties::ID, "s1"))
            .await
            .unwrap();
        Fixture {
            bus,
            responses,
            telemetry,
            shutdown,
            task,
        }
    }

    /// A processor takes no request before it reads cancels: a cancel sent meanwhile would be
    /// lost, and the provider call it should stop would run to its end (found in CI: a client
    /// that went away right after its first token on a just-started processor).
    #[tokio::test(start_paused = true)]
    async fn no_request_is_taken_before_the_cancel_subscription_exists() {
        let (open, gate) = tokio::sync::watch::channel(false);
        let mut f = start_behind_a_slow_cancel_subscription(gate).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            tokio::time::timeout(Duration::from_millis(1), f.responses.next())
                .await
                .is_err(),
            "the request was taken before cancels could be read"
        );
        open.send(true).unwrap();
        let d = f.responses.next().await.unwrap().unwrap();
        let first: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        assert_eq!(first.response, "started");
        f.bus
            .publisher("cancel")
            .await
            .unwrap()
            .send(cancel::cancel_message("s1"))
            .await
            .unwrap();
        let d = tokio::time::timeout(Duration::from_secs(5), f.responses.next())
            .await
            .expect("the cancelled record")
            .unwrap()
            .unwrap();
        let last: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        assert_eq!(last.error.unwrap().kind, "cancelled");
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();
    }

    /// ...but a cancel topic that cannot be subscribed (a missing namespace: the broker's
    /// lookup retries for long) delays serving by [`CANCEL_SUBSCRIBE_WAIT`] only.
    #[tokio::test(start_paused = true)]
    async fn a_cancel_subscription_that_does_not_come_delays_serving_briefly() {
        let (_never, gate) = tokio::sync::watch::channel(false);
        let started = tokio::time::Instant::now();
        let mut f = start_behind_a_slow_cancel_subscription(gate).await;
        let d = tokio::time::timeout(Duration::from_secs(30), f.responses.next())
            .await
            .expect("served without cancels")
            .unwrap()
            .unwrap();
        d.ack();
        let waited = started.elapsed();
        assert!(
            waited >= CANCEL_SUBSCRIBE_WAIT && waited < CANCEL_SUBSCRIBE_WAIT * 2,
            "{waited:?}"
        );
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();
    }

    /// When the drain grace runs out, an unfinished request is not failed but moved: its
    /// handler is dropped, no record is published for it, and the broker has it again, for
    /// another replica (which starts its stream over under a new attempt id).
    #[tokio::test]
    async fn a_request_unfinished_when_the_drain_grace_runs_out_is_handed_back_without_an_error() {
        let mut f = start().await;
        f.bus
            .publisher("req")
            .await
            .unwrap()
            .send(Message::new(r#"{"prompt":"linger"}"#).with_property(properties::ID, "l1"))
            .await
            .unwrap();
        let d = f.responses.next().await.unwrap().unwrap();
        let first: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        assert_eq!(first.response, "started");
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();
        assert_eq!(LINGERS_DROPPED.load(std::sync::atomic::Ordering::SeqCst), 1);
        // The processor has stopped: anything it published is already on the topic.
        assert!(
            f.responses.next().now_or_never().is_none(),
            "no error record ends the stream"
        );
        let text = f.telemetry.render();
        for line in [
            r#"sluice_processor_requests_total{outcome="retried",processor="echo"} 1"#,
            r#"sluice_processor_requests_total{outcome="error",processor="echo"} 0"#,
            r#"sluice_processor_requests_total{outcome="cancelled",processor="echo"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        let mut again = f
            .bus
            .subscribe("req", "echo", SubscribeOptions::shared(1))
            .await
            .unwrap();
        let d = tokio::time::timeout(Duration::from_secs(5), again.next())
            .await
            .expect("the request is back on the broker")
            .unwrap()
            .unwrap();
        assert_eq!(d.property(properties::ID), Some("l1"));
        assert_eq!(d.redelivery_count(), 1);
    }

    /// On a non-persistent request topic a nack would lose the request, so one still running
    /// when the drain grace runs out is answered instead: a `cancelled` error saying to send
    /// it again.
    #[tokio::test]
    async fn on_a_non_persistent_request_topic_an_unfinished_request_is_answered_at_the_grace() {
        let req = "non-persistent://t/ns/req";
        let mut config = ProcessorConfig::new("echo", req, "resp");
        config.drain_grace = Duration::from_millis(100);
        let Fixture {
            bus,
            mut responses,
            shutdown,
            task,
            ..
        } = start_with(config).await;
        bus.publisher(req)
            .await
            .unwrap()
            .send(Message::new(r#"{"prompt":"stall"}"#).with_property(properties::ID, "s1"))
            .await
            .unwrap();
        let mut next = async || {
            let d = tokio::time::timeout(Duration::from_secs(5), responses.next())
                .await
                .expect("a record")
                .unwrap()
                .unwrap();
            let r: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
            d.ack();
            r
        };
        assert_eq!(next().await.response, "started");
        shutdown.cancel();
        task.await.unwrap().unwrap();
        let last = next().await;
        assert!(last.end_of_stream);
        let error = last.error.unwrap();
        assert_eq!(error.kind, ErrorKind::Cancelled);
        assert!(error.message.contains("send the request again"), "{error}");
    }

    /// A bus whose request subscriptions lose what is handed back, as a non-persistent topic
    /// does: a nack settles the message for good (the memory bus would redeliver it).
    struct DropsNacks(MemoryBus);

    #[async_trait]
    impl Bus for DropsNacks {
        async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError> {
            self.0.publisher(topic).await
        }

        async fn subscribe(
            &self,
            topic: &str,
            subscription: &str,
            options: SubscribeOptions,
        ) -> Result<Box<dyn Subscription>, BusError> {
            Ok(Box::new(NacksDropped(
                self.0.subscribe(topic, subscription, options).await?,
            )))
        }

        fn max_message_bytes(&self) -> usize {
            self.0.max_message_bytes()
        }
    }

    struct NacksDropped(Box<dyn Subscription>);

    /// Settles the real delivery with an ack, whatever was asked.
    struct AckAlways(crate::bus::Delivery);

    impl crate::bus::Settle for AckAlways {
        fn settle(self: Box<Self>, _: crate::bus::Settlement) {
            self.0.ack();
        }
    }

    #[async_trait]
    impl Subscription for NacksDropped {
        async fn next(&mut self) -> Option<Result<crate::bus::Delivery, BusError>> {
            let d = match self.0.next().await? {
                Ok(d) => d,
                Err(e) => return Some(Err(e)),
            };
            let (payload, properties, count) = (
                d.payload().clone(),
                d.properties().clone(),
                d.redelivery_count(),
            );
            Some(Ok(crate::bus::Delivery::new(
                payload,
                properties,
                count,
                Box::new(AckAlways(d)),
            )))
        }

        async fn close(self: Box<Self>) {
            self.0.close().await;
        }

        async fn unsubscribe(self: Box<Self>) {
            self.0.unsubscribe().await;
        }

        fn link(&self) -> crate::bus::Link {
            self.0.link()
        }
    }

    /// A processor waiting for its next request when a request task finds the broker unable
    /// to store probes the broker at once, and its syncs say it takes requests again as soon
    /// as the broker stores, with no request arriving. Before, only the next request made it
    /// probe; on a non-persistent request topic, where the requests sent during a broker's
    /// failover can all be lost, its syncs said "not taking" for minutes, and its clients,
    /// which end a request no processor lists only while every processor takes requests,
    /// waited out their inactivity timeouts (the secured cluster, 2026-12-07).
    #[tokio::test]
    async fn an_idle_processor_probes_a_blocked_store_at_once_and_takes_requests_again() {
        let (req, resp) = ("non-persistent://t/ns/req", "non-persistent://t/ns/resp");
        let mut config = ProcessorConfig::new("echo", req, resp);
        config.drain_grace = Duration::from_millis(100);
        let bus = MemoryBus::new(2048, 1000);
        let mut responses = bus
            .subscribe(resp, "test", SubscribeOptions::exclusive(100))
            .await
            .unwrap();
        let telemetry = Telemetry::new().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            Arc::new(DropsNacks(bus.clone())),
            config,
            Arc::new(Echo),
            telemetry.clone(),
            shutdown.clone(),
        ));
        tokio::time::timeout(Duration::from_secs(5), telemetry.health.until_watched(1))
            .await
            .expect("the processor subscribes");
        // Its hand-off cannot be stored: the store is blocked and the request handed back,
        // which loses it here. No other request comes.
        bus.publisher(req)
            .await
            .unwrap()
            .send(Message::new(r#"{"prompt":"handoff-fails"}"#).with_property(properties::ID, "h1"))
            .await
            .unwrap();
        // The syncs: "taking" once h1 has been handed back. A hang guard, not a measure: a
        // processor that never probes never says it takes requests again.
        let mut handed_back = false;
        let taking_again = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let d = responses.next().await.unwrap().unwrap();
                let state = d
                    .property(properties::SYNC_STATE)
                    .map(|state| serde_json::from_str::<crate::sync::SyncState>(state).unwrap());
                d.ack();
                let Some(state) = state else { continue };
                let h1 = state.streams.iter().find(|e| e.0 == "h1");
                handed_back |= h1.is_some_and(|e| !e.3);
                if handed_back && state.taking {
                    return;
                }
            }
        })
        .await;
        assert!(
            taking_again.is_ok(),
            "handed back: {handed_back}; the processor never said it takes requests again: {}",
            telemetry.render()
        );
        assert!(
            telemetry
                .render()
                .contains(r#"sluice_processor_store_blocked{processor="echo"} 0"#)
        );
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    /// On a non-persistent request topic a request handed back is gone (a nack brings nothing
    /// back), so its stream is listed as finished with one record more than the processor
    /// handed to the producer: its client, which has every record that was sent, ends it as
    /// lost at the sync instead of waiting out its inactivity timeout (the secured cluster,
    /// 2026-12-07: 11 streams listed finished with the one record their client had, each
    /// ended at the gateway's 120 s timeout).
    #[tokio::test]
    async fn on_a_non_persistent_request_topic_a_request_handed_back_is_listed_as_lost() {
        let (req, resp) = ("non-persistent://t/ns/req", "non-persistent://t/ns/resp");
        let mut config = ProcessorConfig::new("echo", req, resp);
        config.drain_grace = Duration::from_millis(100);
        let bus = MemoryBus::new(2048, 1000);
        let mut responses = bus
            .subscribe(resp, "test", SubscribeOptions::exclusive(100))
            .await
            .unwrap();
        let telemetry = Telemetry::new().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            Arc::new(DropsNacks(bus.clone())),
            config,
            Arc::new(Echo),
            telemetry.clone(),
            shutdown.clone(),
        ));
        tokio::time::timeout(Duration::from_secs(5), telemetry.health.until_watched(1))
            .await
            .expect("the processor subscribes");
        bus.publisher(req)
            .await
            .unwrap()
            .send(Message::new(r#"{"prompt":"handoff-fails"}"#).with_property(properties::ID, "h1"))
            .await
            .unwrap();
        let mut received = 0;
        let listed = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let d = responses.next().await.unwrap().unwrap();
                if d.property(properties::ID) == Some("h1") {
                    received += 1;
                    d.ack();
                    continue;
                }
                let state = d
                    .property(properties::SYNC_STATE)
                    .map(|state| serde_json::from_str::<crate::sync::SyncState>(state).unwrap());
                d.ack();
                if let Some(state) = state
                    && let Some(entry) = state.streams.iter().find(|e| e.0 == "h1" && !e.3)
                {
                    return entry.clone();
                }
            }
        })
        .await
        .expect("h1 listed as finished");
        // "step one" arrived; the hand-off after it failed, and no terminal record came.
        assert_eq!(received, 1);
        assert!(
            listed.2 > received,
            "listed as finished with {} records, {received} arrived: {listed:?}",
            listed.2
        );
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_request_without_id_is_counted_and_not_redelivered() {
        let mut f = start().await;
        f.bus
            .publisher("req")
            .await
            .unwrap()
            .send(Message::new("{}"))
            .await
            .unwrap();
        // The next request still flows: the id-less one did not block anything.
        let out = ask(&mut f, Some("after"), r#"{"prompt":"ok"}"#).await;
        assert_eq!(out[0].response, "ok");
        let text = f.telemetry.render();
        assert!(text.contains(
            r#"sluice_processor_requests_total{outcome="malformed",processor="echo"} 1"#
        ));
        f.shutdown.cancel();
        f.task.await.unwrap().unwrap();
    }
}
