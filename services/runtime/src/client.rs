//! The request/response client: what the gateway, the CLI and processors that call other
//! processors use to make a request over the bus and read its stream of records.
//!
//! One client instance owns one Exclusive subscription on the response topic (its name is
//! unique to the instance) and one router task that hands each record to the caller waiting
//! for its `id`. A caller gets a [`ResponseStream`]: records in order, then nothing after the
//! first terminal record (later duplicates, e.g. from a redelivered request, are counted and
//! dropped). A stream ends with an error after an inactivity timeout or a total timeout.
//! When a record arrives under a new attempt id the stream yields [`Received::Restarted`]
//! first, so the caller can discard what the abandoned attempt sent; records of an abandoned
//! attempt that still arrive are skipped.
//!
//! Loss is seen, not waited out. On a non-persistent response topic (TrustGraph's mapping)
//! the broker drops records this client has no flow permits for. Two signals end such a
//! request at once with a [`ClientError::RecordsLost`] or [`ClientError::StreamLost`]:
//! - every record carries its index within its attempt ([`properties::SEQ`]); an index that
//!   skips means a record in between was lost;
//! - every Pulsar message carries its producer's name and sequence id; a jump in a producer's
//!   sequence means the broker dropped something of that producer's. Streams whose last record
//!   came from that producer may have lost their next one, the terminal record included, so
//!   such a stream that then stays quiet for `loss_grace` is ended as lost.
//!
//! A third signal sees what leaves nothing later to compare: the processors' syncs (see
//! [`crate::sync`]) list the streams they answer with the records published so far, so a
//! stream whose every record was dropped, a request no processor took, and a stream whose
//! processor went away each end with [`ClientError::LostInTransit`].
//!
//! A fourth sees the consumer itself go deaf. After topic moves under load, the broker has
//! been seen to drop a response consumer from its non-persistent topic for good while still
//! answering the consumer's stats requests, so the subscription's own checks (see
//! `bus::pulsar`) found nothing wrong and every stream waited out its inactivity timeout.
//! Processors sync every second, so a router that has heard syncs and then hears nothing at
//! all for [`DEAF_AFTER_TICKS`] seconds while streams are open asks its subscription to
//! re-subscribe ([`crate::bus::Subscription::renew`]); the syncs that arrive then end the
//! streams whose records were lost meanwhile.
//!
//! On a durable (`persistent://`) response topic the broker drops nothing, so an index that
//! skips means the processor failed to store a record of that attempt (a broker restart
//! mid-stream). That processor hands the request back to the broker, and another attempt
//! follows: the rest of the broken attempt is skipped and the stream waits for the next one
//! (which starts with [`Received::Restarted`]), bounded by the inactivity timeout, instead of
//! ending a request that will still be answered.
//!
//! It never logs payloads: they carry prompts and answers.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    marker::PhantomData,
    sync::{Arc, Mutex},
    time::Duration,
};

use serde::Serialize;
use sluice_schema::{Error, ErrorKind, ResponseRecord, properties};
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
    time::Instant,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{
    backoff::Backoff,
    bus::{
        Bus, BusError, Delivery, Link, Message, Origin, Position, Publisher, StartPosition,
        SubscribeOptions,
    },
    lock,
    sync::{SILENT_AFTER, SyncState, SyncWatch, UNLISTED_GRACE},
    telemetry::{ClientOutcome, RuntimeMetrics},
};

/// Where a client sends requests and reads responses.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The service's name, for metrics (e.g. `text-completion`).
    pub service: String,
    /// Pulsar topic URL of the service's requests.
    pub request_topic: String,
    /// Pulsar topic URL of the service's responses.
    pub response_topic: String,
    /// This instance's response subscription; unique per instance (a default is generated).
    pub subscription: String,
    /// A stream fails when no record arrives for this long.
    pub inactivity_timeout: Duration,
    /// A stream fails when it has not ended after this long.
    pub total_timeout: Duration,
    /// The service's cancel topic: a stream dropped before its end publishes a cancel there
    /// (see [`crate::cancel`]). `None`: dropped streams are not cancelled.
    pub cancel_topic: Option<String>,
    /// How long a stream that may have lost records (the broker dropped records of the
    /// producer its last record came from) may stay quiet before it ends as lost.
    pub loss_grace: Duration,
    /// How long [`RequestClient::start`] keeps trying while the broker cannot serve its
    /// topics yet (a restart, bookies not ready: `BusError::Unavailable`); a refusal ends
    /// it at once.
    pub start_wait: Duration,
}

impl ClientConfig {
    /// Defaults: a fresh subscription name, 120 s inactivity, 600 s total, 120 s start wait.
    pub fn new(
        service: impl Into<String>,
        request_topic: impl Into<String>,
        response_topic: impl Into<String>,
    ) -> Self {
        let service = service.into();
        Self {
            subscription: format!("sluice-client-{service}-{}", uuid::Uuid::new_v4().simple()),
            service,
            request_topic: request_topic.into(),
            response_topic: response_topic.into(),
            inactivity_timeout: Duration::from_secs(120),
            total_timeout: Duration::from_secs(600),
            cancel_topic: None,
            loss_grace: DEFAULT_LOSS_GRACE,
            start_wait: Duration::from_secs(120),
        }
    }

    /// Whether a client with this configuration reads its service exactly as one with
    /// `other` would: every setting but the metrics label and the subscription's name, which
    /// only say whose client it is. Written field by field, so that a setting added later
    /// is compared (or consciously left out) rather than shared by accident.
    pub fn reads_as(&self, other: &ClientConfig) -> bool {
        let ClientConfig {
            service: _,
            subscription: _,
            request_topic,
            response_topic,
            inactivity_timeout,
            total_timeout,
            cancel_topic,
            loss_grace,
            start_wait,
        } = self;
        *request_topic == other.request_topic
            && *response_topic == other.response_topic
            && *inactivity_timeout == other.inactivity_timeout
            && *total_timeout == other.total_timeout
            && *cancel_topic == other.cancel_topic
            && *loss_grace == other.loss_grace
            && *start_wait == other.start_wait
    }
}

/// `op` until it succeeds, fails otherwise than `BusError::Unavailable`, or `wait` has
/// passed: start-up against a broker that is restarting (found by the soak: a prompt replica
/// started while the bookies recovered exited on "Not enough non-faulty bookies").
async fn while_unavailable<T, F: Future<Output = Result<T, BusError>>>(
    wait: Duration,
    what: &str,
    mut op: impl FnMut() -> F,
) -> Result<T, BusError> {
    let deadline = Instant::now() + wait;
    let mut backoff = Backoff::new(Duration::from_secs(5));
    loop {
        match op().await {
            Err(BusError::Unavailable(e)) if Instant::now() + backoff.peek() < deadline => {
                warn!(error = %e, "{what}: the broker cannot serve it yet; trying again");
                tokio::time::sleep(backoff.next_delay()).await;
            }
            other => return other,
        }
    }
}

/// Default [`ClientConfig::loss_grace`]: longer than the pauses of a streaming answer, far
/// shorter than the inactivity timeout a lost terminal record used to cost.
pub const DEFAULT_LOSS_GRACE: Duration = Duration::from_secs(5);

/// Why a request failed on the client side.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Publishing the request or subscribing failed.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// No record arrived within the inactivity timeout.
    #[error("no response record for {0:?}")]
    InactivityTimeout(Duration),
    /// The stream did not end within the total timeout.
    #[error("the response did not complete within {0:?}")]
    TotalTimeout(Duration),
    /// A response record could not be decoded.
    #[error("a response record could not be decoded: {0}")]
    Decode(String),
    /// The request could not be encoded.
    #[error("the request could not be encoded: {0}")]
    Encode(String),
    /// The client was closed.
    #[error("the client is closed")]
    Closed,
    /// The broker did not store the request (it cannot write, or refused it): it will not be
    /// answered, and sending it again later may succeed.
    #[error("the broker did not store the request: {0}")]
    NotStored(String),
    /// Another request with the same id is in flight on this client.
    #[error("a request with id {0:?} is already in flight")]
    DuplicateId(String),
    /// A record of the stream never arrived: the next one carried a later index.
    #[error(
        "response records were lost in transit: record {expected} of the stream never arrived, record {received} did (the broker drops records on a non-persistent topic when a consumer has no flow permits left)"
    )]
    RecordsLost {
        /// The index that was due.
        expected: u64,
        /// The index that arrived.
        received: u64,
    },
    /// The broker dropped records of the producer this stream was reading from, and the stream
    /// then stayed quiet: its next records, the terminal one included, were lost.
    #[error(
        "the response stopped after the broker dropped records on its topic and nothing more arrived for {0:?}: the rest of the stream was lost in transit (non-persistent topic)"
    )]
    StreamLost(Duration),
    /// A processor's sync showed the stream cannot end any more: its records, or the request
    /// itself, were dropped in transit, or the processor answering it went away (see
    /// [`crate::sync`]).
    #[error(
        "{0} (non-persistent topic: the broker drops what it cannot deliver at once and keeps nothing)"
    )]
    LostInTransit(String),
}

impl ClientError {
    /// True when a time limit ran out ([`ClientError::InactivityTimeout`],
    /// [`ClientError::TotalTimeout`]).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            ClientError::InactivityTimeout(_) | ClientError::TotalTimeout(_)
        )
    }

    /// The error kind a caller reports this failure as: `timeout` for a time limit,
    /// `records-lost` for a loss, `invalid-request` for a request that could not be sent as
    /// it was (not encodable, or its id already in flight), and `unavailable` (the caller's
    /// own kind: `llm-error` for the prompt service, `agent-error` for the agent,
    /// `gateway-error` for the gateway) when the called service could not be reached or
    /// answered in a way that could not be read.
    pub fn kind(&self, unavailable: ErrorKind) -> ErrorKind {
        match self {
            e if e.is_timeout() => ErrorKind::Timeout,
            e if e.is_loss() => ErrorKind::RecordsLost,
            ClientError::Encode(_) | ClientError::DuplicateId(_) => ErrorKind::InvalidRequest,
            _ => unavailable,
        }
    }

    /// This failure as an error record in its own words, under [`ClientError::kind`]: for a
    /// caller that names the service itself (an agent's tool observation).
    pub fn as_error(&self, unavailable: ErrorKind) -> Error {
        Error::new(self.kind(unavailable), self.to_string())
    }

    /// The error record a service that called `service` answers its own client with (see
    /// [`ClientError::kind`]); the message names `service` and what happened.
    pub fn to_error(&self, service: &str, unavailable: ErrorKind) -> Error {
        let kind = self.kind(unavailable.clone());
        let message = match &kind {
            ErrorKind::Timeout => format!("{service} did not answer in time: {self}"),
            ErrorKind::RecordsLost => format!("{service}'s answer was lost in transit: {self}"),
            ErrorKind::InvalidRequest => format!("{service} could not be asked: {self}"),
            _ => format!("{service} could not be reached: {self}"),
        };
        Error::new(kind, message)
    }

    /// True for the losses a non-persistent topic causes ([`ClientError::RecordsLost`],
    /// [`ClientError::StreamLost`], [`ClientError::LostInTransit`]).
    pub fn is_loss(&self) -> bool {
        matches!(
            self,
            ClientError::RecordsLost { .. }
                | ClientError::StreamLost(_)
                | ClientError::LostInTransit(_)
        )
    }
}

/// An item of a response stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Received<R> {
    /// The next record.
    Record(R),
    /// The request is being attempted again (the processor handling it went away);
    /// records received before this belong to the abandoned attempt.
    Restarted,
}

/// Per-request options.
#[derive(Debug, Clone, Default)]
pub struct RequestOptions {
    /// The correlation id; a fresh UUID when `None`.
    pub id: Option<String>,
    /// W3C trace context to carry to the processor.
    pub traceparent: Option<String>,
    /// The API key's name the request is billed to (see `sluice_schema::properties::KEY`).
    pub key: Option<String>,
    /// The gateway's seal of `key` (see [`crate::billing`]): made by the gateway, forwarded
    /// unchanged by a processor calling on its caller's behalf.
    pub key_seal: Option<String>,
    /// Overrides the client's inactivity timeout.
    pub inactivity_timeout: Option<Duration>,
    /// Overrides the client's total timeout.
    pub total_timeout: Option<Duration>,
}

enum Routed<R> {
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

struct Route<R> {
    tx: mpsc::UnboundedSender<Routed<R>>,
    attempt: Option<String>,
    abandoned: VecDeque<String>,
    /// The [`properties::SEQ`] due next in the current attempt.
    next_seq: u64,
    /// The producer of the last record routed here.
    producer: Option<Arc<str>>,
    /// The current attempt lost a record on a durable topic: its records are skipped until
    /// the next attempt.
    broken: bool,
    /// When the broker confirmed it stored the request.
    stored_at: Option<Instant>,
    /// Some sync listed this stream.
    listed: bool,
    /// Some record of this stream arrived.
    received_any: bool,
    /// The processor instance whose sync listed this stream as open last.
    listed_by: Option<Arc<str>>,
    /// The last record or listing of this stream.
    last_seen: Instant,
}

impl<R> Route<R> {
    fn new(tx: mpsc::UnboundedSender<Routed<R>>) -> Self {
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
    fn describe(&self) -> String {
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

type Routes<R> = Arc<Mutex<HashMap<String, Route<R>>>>;

/// The publisher of cancels: `None` until it exists. Its sender is dropped without a value if
/// it cannot be made.
type CancelPublisher = watch::Receiver<Option<Arc<dyn Publisher>>>;

/// How long a cancel waits for the cancel publisher that is still being made: beyond it, the
/// request it stands for has most likely ended anyway.
const CANCEL_PUBLISHER_WAIT: Duration = Duration::from_secs(30);

/// Publishes a cancel for `id` once the cancel publisher exists, without waiting: a stream
/// dropped while the publisher was still being made (the first seconds after start-up, on a
/// broker slow to look the topic up) is cancelled when it exists, not forgotten.
fn cancel_when_ready(publisher: Option<CancelPublisher>, id: String) {
    let Some(mut publisher) = publisher else {
        return;
    };
    let ready = publisher.borrow().clone();
    if let Some(p) = ready {
        crate::cancel::send_cancel(p, id);
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let ready =
            tokio::time::timeout(CANCEL_PUBLISHER_WAIT, publisher.wait_for(Option::is_some))
                .await
                .ok()
                .and_then(|r| r.ok().and_then(|p| p.clone()));
        match ready {
            Some(p) => crate::cancel::send_cancel(p, id),
            None => warn!(request_id = %id,
                          "a cancel was not published: there is no cancel publisher"),
        }
    });
}

/// A request/response client for one service. Cheap to share behind an `Arc`.
pub struct RequestClient<Req, Resp: ResponseRecord> {
    config: ClientConfig,
    bus: Arc<dyn Bus>,
    publisher: Arc<dyn Publisher>,
    /// The position of the last response record the router read (see
    /// [`ResponseStream::resume_after`]).
    latest: Arc<Mutex<Option<Position>>>,
    /// `None`: no cancel topic.
    cancel: Option<CancelPublisher>,
    routes: Routes<Resp>,
    metrics: Option<RuntimeMetrics>,
    link: Link,
    stop: CancellationToken,
    router: Mutex<Option<JoinHandle<()>>>,
    _request: PhantomData<fn(Req)>,
}

impl<Req: Serialize, Resp: ResponseRecord> RequestClient<Req, Resp> {
    /// Subscribes to the response topic and starts routing.
    pub async fn start(
        bus: Arc<dyn Bus>,
        config: ClientConfig,
        metrics: Option<RuntimeMetrics>,
    ) -> Result<Self, ClientError> {
        let publisher = while_unavailable(config.start_wait, "the request publisher", || {
            bus.publisher(&config.request_topic)
        })
        .await?;
        // The cancel publisher is a convenience: it must not hold up start-up (a missing
        // namespace makes the broker lookup retry for a long time). Wait briefly, then let it
        // finish in the background; until it exists, dropped streams are not cancelled.
        let cancel = if let Some(topic) = config.cancel_topic.clone() {
            let (slot, cancel) = watch::channel(None);
            let (bus, service) = (bus.clone(), config.service.clone());
            let create = tokio::spawn(async move {
                match bus.publisher(&topic).await {
                    Ok(p) => {
                        let _ = slot.send(Some(p));
                    }
                    Err(e) => warn!(service = %service, topic = %topic, error = %e,
                                    "cancels cannot be published: requests abandoned by their caller run to the end"),
                }
            });
            let _ = tokio::time::timeout(Duration::from_secs(2), create).await;
            Some(cancel)
        } else {
            None
        };
        let mut options = SubscribeOptions::exclusive(1000);
        options.consumer_name = Some(config.subscription.clone());
        // The router acks every record as it reads it, in order (see `dispatch`).
        options.acks_in_order = true;
        let subscription =
            while_unavailable(config.start_wait, "the response subscription", || {
                bus.subscribe(
                    &config.response_topic,
                    &config.subscription,
                    options.clone(),
                )
            })
            .await?;
        let link = subscription.link();
        if let Some(m) = &metrics {
            m.client_started(&config.service);
        }
        let routes: Routes<Resp> = Arc::default();
        let stop = CancellationToken::new();
        // Only a topic that is not durable can lose records in transit (see the module doc).
        let lossy = !config.response_topic.starts_with("persistent://");
        let latest = Arc::new(Mutex::new(None));
        let router = tokio::spawn(route(
            subscription,
            routes.clone(),
            stop.clone(),
            Router {
                metrics: metrics.clone(),
                service: config.service.clone(),
                me: Some(config.subscription.clone()),
                lossy,
                latest: Some(latest.clone()),
            },
        ));
        Ok(Self {
            config,
            bus,
            publisher,
            latest,
            cancel,
            routes,
            metrics,
            link,
            stop,
            router: Mutex::new(Some(router)),
            _request: PhantomData,
        })
    }

    /// What this client was started with.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Whether the response subscription is attached (for readiness).
    pub fn link(&self) -> Link {
        self.link.clone()
    }

    /// Sends a request with a fresh id and returns its response stream.
    pub async fn request(&self, request: &Req) -> Result<ResponseStream<Resp>, ClientError> {
        self.request_with(request, RequestOptions::default()).await
    }

    /// Sends a request and returns its response stream.
    pub async fn request_with(
        &self,
        request: &Req,
        options: RequestOptions,
    ) -> Result<ResponseStream<Resp>, ClientError> {
        if self.stop.is_cancelled() {
            return Err(ClientError::Closed);
        }
        let payload =
            serde_json::to_vec(request).map_err(|e| ClientError::Encode(e.to_string()))?;
        let limits = (options.inactivity_timeout, options.total_timeout);
        let id = options
            .id
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let mut properties = BTreeMap::from([
            (properties::ID.to_owned(), id.clone()),
            (
                properties::REPLY_TO.to_owned(),
                self.config.subscription.clone(),
            ),
        ]);
        if let Some(tp) = options.traceparent {
            properties.insert(properties::TRACEPARENT.to_owned(), tp);
        }
        if let Some(key) = options.key {
            properties.insert(properties::KEY.to_owned(), key);
            if let Some(seal) = options.key_seal {
                properties.insert(properties::KEY_SEAL.to_owned(), seal);
            }
        }
        // Every record of this request comes after what the router has read so far.
        let resume_after = *lock(&self.latest);
        // Register before publishing: the first record can arrive before `send` returns.
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut routes = lock(&self.routes);
            if routes.contains_key(&id) {
                return Err(ClientError::DuplicateId(id));
            }
            routes.insert(id.clone(), Route::new(tx));
        }
        let stream = self.stream(
            id.clone(),
            rx,
            self.routes.clone(),
            limits,
            resume_after,
            None,
        );
        // The receipt is not awaited: the first response proves the request was stored, and
        // waiting for the receipt would add a broker round trip to time-to-first-token. A
        // failed store still surfaces, as a timeout.
        let message = Message {
            payload: payload.into(),
            properties,
            key: None,
        };
        match self.publisher.send(message.clone()).await {
            Ok(receipt) => {
                let receipt = match receipt.settled() {
                    // Stored already (the in-process bus): nothing to wait for.
                    Ok(Ok(())) => {
                        if let Some(route) = lock(&self.routes).get_mut(&id) {
                            route.stored_at = Some(Instant::now());
                        }
                        return Ok(stream);
                    }
                    Ok(Err(e)) => crate::bus::Receipt::ready(Err(e)),
                    Err(pending) => pending,
                };
                tokio::spawn(confirm_stored(
                    receipt,
                    message,
                    self.publisher.clone(),
                    self.routes.clone(),
                    id,
                ));
                Ok(stream)
            }
            Err(e) => Err(ClientError::Bus(e)),
        }
    }

    /// Sends a request and waits for its terminal record, ignoring records of an abandoned
    /// attempt (see [`ResponseStream::collect`]). For non-streaming calls.
    pub async fn call(&self, request: &Req) -> Result<Vec<Resp>, ClientError> {
        self.request(request).await?.collect().await
    }

    /// Whether a stream of this client can be read again by [`RequestClient::resume`]: its
    /// response topic is persistent and the bus keeps messages to read again (Pulsar).
    pub fn resumable(&self) -> bool {
        self.bus.keeps_messages() && self.config.response_topic.starts_with("persistent://")
    }

    /// Reads the response stream of request `id` again, from the response topic itself: every
    /// record of it after `after` (a [`ResponseStream::resume_after`], `None` for the oldest
    /// the topic holds), then what follows, as the stream that sent the request would have
    /// (restarts, the terminal record). Any instance of the client can do it, not only the
    /// one that sent the request: what a caller of a gateway replica that died needs.
    ///
    /// The stream reads through a subscription of its own that the broker forgets when it
    /// ends. Dropped before its end (or timed out), it does not tell the service to stop: it
    /// is a reader of an answer that belongs to whoever sent the request, which may still be
    /// reading it. The records must still be on the topic: its retention bounds how late a
    /// resume can be.
    pub async fn resume(
        &self,
        id: &str,
        after: Option<Position>,
        options: RequestOptions,
    ) -> Result<ResponseStream<Resp>, ClientError> {
        if self.stop.is_cancelled() {
            return Err(ClientError::Closed);
        }
        if !self.resumable() {
            return Err(ClientError::Bus(BusError::Config(format!(
                "the responses on {} cannot be read again (a persistent topic on Pulsar can)",
                self.config.response_topic
            ))));
        }
        let mut subscribe = SubscribeOptions::exclusive(1000);
        subscribe.start = after.map_or(StartPosition::Earliest, StartPosition::At);
        let name = format!("{}-resume-{}", self.config.subscription, crate::short_id());
        subscribe.consumer_name = Some(name.clone());
        subscribe.acks_in_order = true;
        let subscription = self
            .bus
            .subscribe(&self.config.response_topic, &name, subscribe)
            .await
            .map_err(ClientError::Bus)?;
        let routes: Routes<Resp> = Arc::default();
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&routes).insert(id.to_owned(), Route::new(tx));
        let stop = self.stop.child_token();
        // Other requests' records, read on the way, are not this client's concern: no metrics,
        // and any instance's answers (the request was sent by another).
        tokio::spawn(route(
            subscription,
            routes.clone(),
            stop.clone(),
            Router {
                metrics: None,
                service: self.config.service.clone(),
                me: None,
                lossy: false,
                latest: None,
            },
        ));
        let mut stream = self.stream(
            id.to_owned(),
            rx,
            routes,
            (options.inactivity_timeout, options.total_timeout),
            after,
            Some(stop.drop_guard()),
        );
        // Never a cancel: a resumed read that is dropped or times out leaves the request to
        // its sender.
        stream.cancel = None;
        Ok(stream)
    }

    /// The caller's side of request `id`'s route in `routes`, with this client's time limits
    /// unless `limits` (inactivity, total: a request's options) set others.
    fn stream(
        &self,
        id: String,
        rx: mpsc::UnboundedReceiver<Routed<Resp>>,
        routes: Routes<Resp>,
        limits: (Option<Duration>, Option<Duration>),
        resume_after: Option<Position>,
        reading: Option<tokio_util::sync::DropGuard>,
    ) -> ResponseStream<Resp> {
        let started = Instant::now();
        ResponseStream {
            id,
            rx,
            routes,
            cancel: self.cancel.clone(),
            metrics: self.metrics.clone(),
            service: self.config.service.clone(),
            inactivity: limits.0.unwrap_or(self.config.inactivity_timeout),
            total: limits.1.unwrap_or(self.config.total_timeout),
            loss_grace: self.config.loss_grace,
            started,
            last: started,
            suspect_since: None,
            done: false,
            resume_after,
            _reading: reading,
        }
    }

    /// Stops routing and deletes this instance's response subscription. Streams still open
    /// end with [`ClientError::Closed`].
    pub async fn close(&self) {
        self.stop.cancel();
        let router = lock(&self.router).take();
        if let Some(router) = router {
            let _ = router.await;
        }
    }
}

/// How many times a request whose receipt failed for an outage is published again.
const RESENDS_ON_LOST_RECEIPT: u32 = 3;

/// Waits for a request's receipt: marks the route stored, or, when the broker did not confirm
/// it, publishes the request again or ends the caller's wait.
///
/// A receipt that fails for an outage (the broker owning the topic died, and the producer's
/// pending message was never acknowledged) does not say whether the message was stored. While
/// no record of the request has arrived, it is published again under the same id, up to
/// [`RESENDS_ON_LOST_RECEIPT`] times: if the first copy was stored after all, the request is
/// attempted twice, which the stream reads as one restart (at-least-once, as a redelivery
/// would). A refusal (`BusError::Denied`) is final: sending it again would be refused too.
async fn confirm_stored<R>(
    mut receipt: crate::bus::Receipt,
    message: Message,
    publisher: Arc<dyn Publisher>,
    routes: Routes<R>,
    id: String,
) {
    let mut resent = 0;
    loop {
        let error = match receipt.await {
            // From here a processor's sync must list it (see crate::sync).
            Ok(()) => {
                if let Some(route) = lock(&routes).get_mut(&id) {
                    route.stored_at = Some(Instant::now());
                }
                return;
            }
            Err(e) => e,
        };
        // A record proves the request was stored; a route that is gone has no caller left.
        let unanswered = lock(&routes)
            .get(&id)
            .is_some_and(|route| !route.received_any && !route.listed);
        let error = if matches!(error, BusError::Unavailable(_))
            && unanswered
            && resent < RESENDS_ON_LOST_RECEIPT
        {
            resent += 1;
            warn!(request_id = %id, error = %error, resent,
                  "the broker did not confirm it stored a request; publishing it again");
            match publisher.send(message.clone()).await {
                Ok(next) => {
                    receipt = next;
                    continue;
                }
                Err(e) => e,
            }
        } else {
            error
        };
        if !unanswered {
            // Answered (or abandoned by its caller): the receipt no longer matters.
            debug!(request_id = %id, error = %error, "a request's receipt failed after it was answered");
            return;
        }
        warn!(request_id = %id, error = %error, "a request was not stored by the broker");
        // End the caller's wait now rather than at its timeout.
        if let Some(route) = lock(&routes).remove(&id) {
            let _ = route.tx.send(Routed::NotStored(error.to_string()));
        }
        return;
    }
}

impl<Req, Resp: ResponseRecord> Drop for RequestClient<Req, Resp> {
    fn drop(&mut self) {
        // The router unsubscribes when it sees the token.
        self.stop.cancel();
    }
}

/// What a router routes for.
struct Router {
    metrics: Option<RuntimeMetrics>,
    service: String,
    /// This instance's response subscription: the answers to its own requests name it;
    /// `None` routes every instance's (a resumed stream's reader).
    me: Option<String>,
    lossy: bool,
    /// Where to note the position of each record read (the client's own router).
    latest: Option<Arc<Mutex<Option<Position>>>>,
}

async fn route<R: ResponseRecord>(
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
    if delivery.property(properties::SYNC).is_some() {
        // A processor's sync: its sequence has done its work above; what it lists, here.
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
        Ok(record) => {
            let mut items = Vec::with_capacity(2);
            if let Some(attempt) = attempt {
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
                drop(routes);
                delivery.ack();
                return;
            }
            match delivery
                .property(properties::SEQ)
                .and_then(|s| s.parse::<u64>().ok())
            {
                // Records from a service that does not number them (TrustGraph's) pass.
                None => {}
                Some(seq) if seq == route.next_seq => route.next_seq += 1,
                Some(seq) if seq < route.next_seq => {
                    // Stored twice (a send retried after the broker had taken it).
                    drop(routes);
                    delivery.ack();
                    return;
                }
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
                    drop(routes);
                    delivery.ack();
                    return;
                }
            }
            let terminal =
                record.is_terminal() || items.iter().any(|i| matches!(i, Routed::Lost { .. }));
            if !items.iter().any(|i| matches!(i, Routed::Lost { .. })) {
                items.push(Routed::Record(record));
            }
            (terminal, items)
        }
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

/// How often a router on a lossy topic counts a second of silence (see [`Deafness`]).
const DEAF_TICK: Duration = Duration::from_secs(1);

/// Ticks of [`DEAF_TICK`] with nothing at all heard (10 to 11 s: the ticks' phase is not
/// reset by what arrives, which would cost a timer per record), while streams are open and
/// syncs were heard just before, after which a router asks its subscription to re-subscribe.
/// Processors sync every [`crate::processor::SYNC_INTERVAL`] (1 s). The same as the time
/// after which a processor that stopped syncing counts as gone ([`SILENT_AFTER`]). A topic
/// move alone does not reach it (pulsar-rs reconnects within seconds after an unload); a
/// broker's SIGKILL does (no broker owns the topic for ~20-30 s), and the re-subscription
/// then retries like pulsar-rs's own reconnect would.
pub const DEAF_AFTER_TICKS: u32 = 10;

/// How recent, before the silence began, the last sync must be for the silence to mean
/// anything: a client that heard sluice's processors long ago and now only TrustGraph's
/// (which do not sync) hears nothing for as long as their answer takes.
const SYNCED_BEFORE: Duration = Duration::from_secs(5);

/// The longest silence, in ticks, between two re-subscriptions that heard nothing in between
/// (every processor gone, or no broker owns the topic): each doubles the wait, up to this.
const DEAF_AFTER_TICKS_MAX: u32 = 80;

/// A router's count of the seconds in which nothing arrived on its subscription.
struct Deafness {
    quiet: u32,
    /// Quiet ticks before the next re-subscription (more than this many).
    due: u32,
    /// When something last arrived: the silence began then.
    last_heard: Instant,
}

impl Default for Deafness {
    fn default() -> Self {
        Self {
            quiet: 0,
            due: DEAF_AFTER_TICKS,
            last_heard: Instant::now(),
        }
    }
}

impl Deafness {
    /// Something arrived.
    fn heard(&mut self) {
        self.quiet = 0;
        self.due = DEAF_AFTER_TICKS;
        self.last_heard = Instant::now();
    }

    /// A tick passed with nothing heard. Returns why to re-subscribe when it is time to:
    /// `last_sync` (when a processor's sync last arrived: the silence means something only if
    /// syncs came just before it began) and `open` (some stream waits: only then does the
    /// silence cost anyone).
    fn tick(&mut self, last_sync: Option<Instant>, open: bool) -> Option<String> {
        self.quiet = self.quiet.saturating_add(1);
        let synced = last_sync
            .is_some_and(|at| self.last_heard.saturating_duration_since(at) <= SYNCED_BEFORE);
        if !synced || !open || self.quiet <= self.due {
            return None;
        }
        let quiet = self.quiet;
        self.quiet = 0;
        self.due = self.due.saturating_mul(2).min(DEAF_AFTER_TICKS_MAX);
        Some(format!(
            "nothing arrived on the response topic for {quiet} s, not even a processor's sync \
             (sent every second and heard before), while requests wait: the broker no longer \
             delivers to this consumer, or every processor is gone"
        ))
    }
}

/// What a client's router learned from the messages on its topic, to see losses.
#[derive(Default)]
struct Seen {
    producers: ProducerSequences,
    syncs: Syncs,
}

/// What a client's router learned from processors' syncs (see [`crate::sync`]).
#[derive(Default)]
struct Syncs {
    watch: SyncWatch,
    /// A record without an index arrived: TrustGraph's own processors answer on this topic,
    /// and a request no sync lists may be theirs; none is ended for that, from then on.
    foreign_records: bool,
    /// When a sync without a state (an older sluice, mid-upgrade) was last seen: that
    /// processor does not say which requests it took either.
    stateless_sync: Option<Instant>,
    /// When the last sync arrived (see [`Deafness`]).
    last_sync: Option<Instant>,
}

/// How long after a sync without a state a request no sync lists is not ended for it: the
/// older processor is gone once its syncs stop.
const STATELESS_FOR: Duration = Duration::from_secs(60);

impl Syncs {
    fn stateless_sync_seen(&mut self) {
        self.stateless_sync = Some(Instant::now());
    }

    /// Ends every stream of `routes` that `state` (or its silence about them) shows can no
    /// longer end on its own.
    fn check<R>(&mut self, state: &SyncState, routes: &Routes<R>, service: &str) {
        let now = Instant::now();
        let instance = self.watch.observe(state, now);
        let mut routes = lock(routes);
        let mut gone: Vec<(String, String)> = Vec::new();
        for (id, key, published, open) in &state.streams {
            let Some(route) = routes.get_mut(id) else {
                continue;
            };
            route.listed = true;
            route.last_seen = now;
            // Listed by a key, the first characters of the attempt id. An attempt the stream
            // moved on from (an agent's earlier step, a restart) stays listed for a while
            // after its end: not counted. The attempt it reads counts what arrived; one it
            // has not reached (the next step, published before this sync by the same
            // producer) counts nothing arrived.
            if route.abandoned.iter().any(|a| a.starts_with(key.as_str())) {
                continue;
            }
            let received = match route.attempt.as_deref() {
                Some(current) if current.starts_with(key.as_str()) => route.next_seq,
                _ => 0,
            };
            // Whose silence would mean the stream lost its processor: only an open one's.
            if *open {
                route.listed_by = Some(instance.clone());
            } else if route.listed_by.as_ref() == Some(&instance) {
                route.listed_by = None;
            }
            // The sync left after these records, through the same producer: what has not
            // arrived by now never will.
            if !route.broken && *published > received {
                gone.push((
                    id.clone(),
                    format!(
                        "{published} response records of this stream were published before its processor's sync and {received} arrived: the rest were lost in transit"
                    ),
                ));
            }
        }
        let foreign = self.foreign_records
            || self
                .stateless_sync
                .is_some_and(|at| now.saturating_duration_since(at) < STATELESS_FOR);
        let unlisted_deadline = if foreign {
            None
        } else {
            self.watch.unlisted_deadline()
        };
        for (id, route) in routes.iter() {
            if let Some(by) = &route.listed_by {
                if !self.watch.is_live(by)
                    && now.saturating_duration_since(route.last_seen) >= SILENT_AFTER
                {
                    gone.push((
                        id.clone(),
                        format!(
                            "the processor answering this request ({by}) stopped syncing {} s ago while others sync: it went away before the stream ended",
                            SILENT_AFTER.as_secs()
                        ),
                    ));
                }
            } else if !route.listed
                && !route.received_any
                && let (Some(stored), Some(deadline)) = (route.stored_at, unlisted_deadline)
                && stored <= deadline
            {
                gone.push((
                    id.clone(),
                    format!(
                        "the broker took the request but no processor did: every processor syncing on the response topic has taken requests for {} s since without listing it (dropped on its way to them)",
                        UNLISTED_GRACE.as_secs()
                    ),
                ));
            }
        }
        for (id, why) in gone {
            if let Some(route) = routes.remove(&id) {
                debug!(service, request_id = %id, reason = %why, "stream ended as lost");
                let _ = route.tx.send(Routed::Gone(why));
            }
        }
    }
}

/// The records of one request, in order, ending after the terminal record.
pub struct ResponseStream<R> {
    id: String,
    rx: mpsc::UnboundedReceiver<Routed<R>>,
    routes: Routes<R>,
    cancel: Option<CancelPublisher>,
    metrics: Option<RuntimeMetrics>,
    service: String,
    inactivity: Duration,
    total: Duration,
    loss_grace: Duration,
    started: Instant,
    last: Instant,
    /// Since when the stream may have lost its next record (see [`Routed::Suspect`]).
    suspect_since: Option<Instant>,
    done: bool,
    /// A position on the response topic before every record of this request.
    resume_after: Option<Position>,
    /// Stops a resumed stream's own reader when the stream is dropped.
    _reading: Option<tokio_util::sync::DropGuard>,
}

impl<R: ResponseRecord> ResponseStream<R> {
    /// The request's correlation id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// A position on the response topic that comes before every record of this request: the
    /// last record the client had read when it sent it (`None`: none yet, the topic's oldest
    /// will do). Where [`RequestClient::resume`] starts reading.
    pub fn resume_after(&self) -> Option<Position> {
        self.resume_after
    }

    /// The next item; `None` after the terminal record or an error.
    pub async fn next(&mut self) -> Option<Result<Received<R>, ClientError>> {
        loop {
            if self.done {
                return None;
            }
            let inactivity_deadline = self.last + self.inactivity;
            let total_deadline = self.started + self.total;
            let loss_deadline = self.suspect_since.map(|since| since + self.loss_grace);
            let deadline = inactivity_deadline
                .min(total_deadline)
                .min(loss_deadline.unwrap_or(total_deadline));
            let item = match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(item)) => item,
                Ok(None) => return self.finish(ClientOutcome::Failed, Err(ClientError::Closed)),
                Err(_) => {
                    // What the client knew of the request when it gave up: which of the
                    // loss rules (crate::sync) could not decide, and why.
                    if let Some(route) = lock(&self.routes).get(&self.id) {
                        warn!(service = %self.service, request_id = %self.id,
                              waited = ?self.started.elapsed(), state = %route.describe(),
                              "a stream ends at its time limit");
                    }
                    // The caller stops waiting: the service should stop working on it too.
                    cancel_when_ready(self.cancel.take(), self.id.clone());
                    let (outcome, error) = if Some(deadline) == loss_deadline {
                        (
                            ClientOutcome::Lost,
                            ClientError::StreamLost(self.loss_grace),
                        )
                    } else if deadline == total_deadline {
                        (
                            ClientOutcome::Timeout,
                            ClientError::TotalTimeout(self.total),
                        )
                    } else {
                        (
                            ClientOutcome::Timeout,
                            ClientError::InactivityTimeout(self.inactivity),
                        )
                    };
                    return self.finish(outcome, Err(error));
                }
            };
            if !matches!(item, Routed::Suspect) {
                self.suspect_since = None;
                self.last = Instant::now();
            }
            return match item {
                Routed::Suspect => {
                    // Only the first mark counts: the grace runs from the first drop noticed.
                    self.suspect_since.get_or_insert_with(Instant::now);
                    continue;
                }
                Routed::Lost { expected, received } => {
                    cancel_when_ready(self.cancel.take(), self.id.clone());
                    self.finish(
                        ClientOutcome::Lost,
                        Err(ClientError::RecordsLost { expected, received }),
                    )
                }
                Routed::Restarted => Some(Ok(Received::Restarted)),
                Routed::Gone(why) => {
                    cancel_when_ready(self.cancel.take(), self.id.clone());
                    self.finish(ClientOutcome::Lost, Err(ClientError::LostInTransit(why)))
                }
                Routed::Undecodable(e) => {
                    self.finish(ClientOutcome::Failed, Err(ClientError::Decode(e)))
                }
                Routed::NotStored(e) => {
                    self.finish(ClientOutcome::Failed, Err(ClientError::NotStored(e)))
                }
                Routed::Record(r) if r.is_terminal() => {
                    let outcome = if r.error().is_some() {
                        ClientOutcome::Error
                    } else {
                        ClientOutcome::Success
                    };
                    self.finish(outcome, Ok(Received::Record(r)))
                }
                Routed::Record(r) => Some(Ok(Received::Record(r))),
            };
        }
    }

    fn finish(
        &mut self,
        outcome: ClientOutcome,
        item: Result<Received<R>, ClientError>,
    ) -> Option<Result<Received<R>, ClientError>> {
        self.done = true;
        lock(&self.routes).remove(&self.id);
        if let Some(m) = &self.metrics {
            m.client_request(&self.service, outcome);
        }
        Some(item)
    }

    /// The records of the answer's final attempt, once the stream has ended, read by the
    /// reader's driver (see [`crate::reader::Records`]): those of an attempt that was started
    /// over are dropped at its restart; an error record is the last of them, where a
    /// [`crate::reader::Reader`] fails with it. For tests and benchmarks of the client itself;
    /// a service reads through a `Reader`.
    pub async fn collect(self) -> Result<Vec<R>, ClientError> {
        let policy = crate::reader::ReadPolicy::new(crate::reader::Report, |e| {
            e.as_error(ErrorKind::Internal)
        });
        crate::reader::Reader::new(self, policy)
            .drive(crate::reader::Records::default())
            .run()
            .await
    }

    /// Adapts this into a `futures::Stream`.
    pub fn into_stream(self) -> impl futures::Stream<Item = Result<Received<R>, ClientError>> {
        futures::stream::unfold(self, |mut s| async move { s.next().await.map(|i| (i, s)) })
    }
}

impl<R> Drop for ResponseStream<R> {
    fn drop(&mut self) {
        // A caller that stops listening (client disconnected) frees its route at once and
        // tells the service to stop working on it.
        if !self.done {
            lock(&self.routes).remove(&self.id);
            if let Some(m) = &self.metrics {
                m.client_request(&self.service, ClientOutcome::Cancelled);
            }
            cancel_when_ready(self.cancel.take(), self.id.clone());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use sluice_schema::{TextCompletionRequest, TextCompletionResponse};

    use super::*;
    use crate::{
        bus::{Subscription, memory::MemoryBus},
        testkit::{DeafSwitch, DeafeningBus, OnRenew},
    };

    pub(crate) type Client = RequestClient<TextCompletionRequest, TextCompletionResponse>;

    /// A service that calls another reports the client's failure with the kind it stands
    /// for, and its own kind where the other service could not be reached.
    #[test]
    fn client_errors_know_the_kind_they_are_reported_as() {
        let second = Duration::from_secs(1);
        for (e, kind) in [
            (ClientError::InactivityTimeout(second), ErrorKind::Timeout),
            (ClientError::TotalTimeout(second), ErrorKind::Timeout),
            (ClientError::StreamLost(second), ErrorKind::RecordsLost),
            (
                ClientError::RecordsLost {
                    expected: 1,
                    received: 2,
                },
                ErrorKind::RecordsLost,
            ),
            (
                ClientError::LostInTransit("x".into()),
                ErrorKind::RecordsLost,
            ),
            (ClientError::Encode("x".into()), ErrorKind::InvalidRequest),
            (
                ClientError::DuplicateId("x".into()),
                ErrorKind::InvalidRequest,
            ),
            (ClientError::Closed, ErrorKind::Agent),
            (ClientError::Decode("x".into()), ErrorKind::Agent),
            (ClientError::NotStored("x".into()), ErrorKind::Agent),
            (
                ClientError::Bus(BusError::Unavailable("x".into())),
                ErrorKind::Agent,
            ),
        ] {
            assert_eq!(e.kind(ErrorKind::Agent), kind, "{e}");
            let record = e.to_error("text-completion", ErrorKind::Agent);
            assert_eq!(record.kind, kind, "{e}");
            assert!(
                record.message.starts_with("text-completion")
                    && record.message.ends_with(&e.to_string()),
                "{}",
                record.message
            );
            // In its own words: the same kind, the client's message as it is.
            assert_eq!(
                e.as_error(ErrorKind::Agent),
                Error::new(kind, e.to_string()),
                "{e}"
            );
        }
    }

    /// A client of service `svc` on the in-process bus (requests on `req`, answers on `resp`,
    /// 300 ms inactivity timeout) and the service's request subscription; the reader's tests
    /// use it too.
    pub(crate) async fn setup() -> (MemoryBus, Box<dyn Subscription>, Client) {
        let bus = MemoryBus::default();
        let requests = bus
            .subscribe("req", "svc", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let mut config = ClientConfig::new("test", "req", "resp");
        config.inactivity_timeout = Duration::from_millis(300);
        let client = Client::start(Arc::new(bus.clone()), config, None)
            .await
            .unwrap();
        (bus, requests, client)
    }

    async fn reply(bus: &MemoryBus, id: &str, attempt: &str, text: &str, end: bool) {
        let r = TextCompletionResponse {
            response: text.to_owned(),
            end_of_stream: end,
            ..Default::default()
        };
        bus.publisher("resp")
            .await
            .unwrap()
            .send(
                Message::new(serde_json::to_vec(&r).unwrap())
                    .with_property(properties::ID, id)
                    .with_property(properties::ATTEMPT, attempt),
            )
            .await
            .unwrap();
    }

    fn text(item: Option<Result<Received<TextCompletionResponse>, ClientError>>) -> String {
        match item.unwrap().unwrap() {
            Received::Record(r) => r.response,
            Received::Restarted => "<restarted>".to_owned(),
        }
    }

    #[tokio::test]
    async fn routes_by_id_and_ignores_duplicates_after_the_terminal_record() {
        let (bus, mut requests, client) = setup().await;
        let mut a = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let mut b = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let ra = requests.next().await.unwrap().unwrap();
        let rb = requests.next().await.unwrap().unwrap();
        assert_eq!(ra.property(properties::ID), Some(a.id()));
        reply(&bus, b.id(), "1", "for b", false).await;
        reply(&bus, a.id(), "1", "for a", true).await;
        reply(&bus, a.id(), "1", "late duplicate", true).await;
        reply(&bus, b.id(), "1", "b ends", true).await;
        assert_eq!(text(a.next().await), "for a");
        assert!(a.next().await.is_none());
        assert_eq!(text(b.next().await), "for b");
        assert_eq!(text(b.next().await), "b ends");
        assert!(b.next().await.is_none());
        ra.ack();
        rb.ack();
    }

    #[tokio::test]
    async fn clients_sharing_a_response_topic_skip_each_others_answers_without_counting_them() {
        let bus = MemoryBus::default();
        let mut requests = bus
            .subscribe("req", "svc", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let telemetry = crate::telemetry::Telemetry::new().unwrap();
        let start = |service: &str| {
            Client::start(
                Arc::new(bus.clone()),
                ClientConfig::new(service, "req", "resp"),
                Some(telemetry.metrics.clone()),
            )
        };
        let (a, b) = (start("a").await.unwrap(), start("b").await.unwrap());
        let mut stream = a.request(&TextCompletionRequest::default()).await.unwrap();
        let req = requests.next().await.unwrap().unwrap();
        let reply_to = req.property(properties::REPLY_TO).unwrap().to_owned();
        assert_eq!(reply_to, a.config.subscription);
        let id = req.property(properties::ID).unwrap().to_owned();
        req.ack();
        // What a processor does: copy the id and the reply-to onto every record.
        let answer = |text: &str| {
            let r = TextCompletionResponse {
                response: text.to_owned(),
                end_of_stream: true,
                ..Default::default()
            };
            Message::new(serde_json::to_vec(&r).unwrap())
                .with_property(properties::ID, id.as_str())
                .with_property(properties::REPLY_TO, reply_to.as_str())
        };
        let publisher = bus.publisher("resp").await.unwrap();
        publisher.send(answer("hi")).await.unwrap().await.unwrap();
        assert_eq!(text(stream.next().await), "hi");
        // A late duplicate is a's own unroutable record; b never counts a's answers.
        publisher
            .send(answer("again"))
            .await
            .unwrap()
            .await
            .unwrap();
        let unroutable = |service: &str| {
            let series =
                format!("sluice_client_unroutable_records_total{{service=\"{service}\"}} ");
            telemetry
                .render()
                .lines()
                .find_map(|l| l.strip_prefix(series.as_str()).map(str::to_owned))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        for _ in 0..100 {
            if unroutable("a") == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(unroutable("a"), 1);
        // A record without the property (a TrustGraph service's) still counts everywhere.
        let legacy = TextCompletionResponse::default();
        publisher
            .send(
                Message::new(serde_json::to_vec(&legacy).unwrap())
                    .with_property(properties::ID, "nobody"),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        // Both routers see it: wait for both rather than count on their order of wake-up.
        for _ in 0..100 {
            if unroutable("b") == 1 && unroutable("a") == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(unroutable("b"), 1, "only the record without a reply-to");
        assert_eq!(unroutable("a"), 2);
        drop(b);
    }

    #[tokio::test]
    async fn a_new_attempt_is_announced_before_its_records() {
        let (bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        reply(&bus, s.id(), "first", "par", false).await;
        reply(&bus, s.id(), "second", "full", false).await;
        reply(&bus, s.id(), "second", " answer", true).await;
        assert_eq!(text(s.next().await), "par");
        assert_eq!(text(s.next().await), "<restarted>");
        assert_eq!(text(s.next().await), "full");
        assert_eq!(text(s.next().await), " answer");
        assert!(s.next().await.is_none());
    }

    #[tokio::test]
    async fn a_continuation_reads_on_and_a_redelivered_step_restarts() {
        let (bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let send = |attempt: &'static str,
                    continues: Option<&'static str>,
                    text: &'static str,
                    end: bool| {
            let (bus, id) = (bus.clone(), s.id().to_owned());
            async move {
                let r = TextCompletionResponse {
                    response: text.to_owned(),
                    end_of_stream: end,
                    ..Default::default()
                };
                let mut m = Message::new(serde_json::to_vec(&r).unwrap())
                    .with_property(properties::ID, id)
                    .with_property(properties::ATTEMPT, attempt);
                if let Some(c) = continues {
                    m = m.with_property(properties::CONTINUES, c);
                }
                bus.publisher("resp").await.unwrap().send(m).await.unwrap();
            }
        };
        send("step1", None, "thought", false).await;
        send("step2", Some("step1"), "observation", false).await;
        // step2 crashed; its redelivery continues step1 again, not the current step2.
        send("step2b", Some("step1"), "observation again", false).await;
        send("step3", Some("step2b"), "answer", true).await;
        assert_eq!(text(s.next().await), "thought");
        assert_eq!(text(s.next().await), "observation");
        assert_eq!(text(s.next().await), "<restarted>");
        assert_eq!(text(s.next().await), "observation again");
        assert_eq!(text(s.next().await), "answer");
        assert!(s.next().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn silence_ends_the_stream_with_an_inactivity_timeout() {
        let (_bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let err = s.next().await.unwrap().unwrap_err();
        assert!(matches!(err, ClientError::InactivityTimeout(_)));
        assert!(s.next().await.is_none());
    }

    #[tokio::test]
    async fn an_undecodable_record_ends_the_stream_with_an_error() {
        let (bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        bus.publisher("resp")
            .await
            .unwrap()
            .send(Message::new("not json").with_property(properties::ID, s.id()))
            .await
            .unwrap();
        assert!(matches!(
            s.next().await.unwrap().unwrap_err(),
            ClientError::Decode(_)
        ));
    }

    async fn numbered(bus: &MemoryBus, id: &str, attempt: &str, seq: u64, text: &str, end: bool) {
        let r = TextCompletionResponse {
            response: text.to_owned(),
            end_of_stream: end,
            ..Default::default()
        };
        bus.publisher("resp")
            .await
            .unwrap()
            .send(
                Message::new(serde_json::to_vec(&r).unwrap())
                    .with_property(properties::ID, id)
                    .with_property(properties::ATTEMPT, attempt)
                    .with_property(properties::SEQ, seq.to_string()),
            )
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_skipped_record_index_ends_the_stream_as_lost_at_once() {
        let (bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        numbered(&bus, s.id(), "a", 0, "zero", false).await;
        numbered(&bus, s.id(), "a", 2, "two", false).await;
        assert_eq!(text(s.next().await), "zero");
        match s.next().await.unwrap() {
            Err(ClientError::RecordsLost { expected, received }) => {
                assert_eq!((expected, received), (1, 2));
            }
            other => panic!("expected RecordsLost, got {other:?}"),
        }
        assert!(s.next().await.is_none());
    }

    #[tokio::test]
    async fn on_a_durable_topic_a_skipped_index_waits_for_the_next_attempt() {
        let bus = MemoryBus::default();
        let resp = "persistent://t/n/resp";
        let config = ClientConfig::new("test", "req", resp);
        let client: Client = Client::start(Arc::new(bus.clone()), config, None)
            .await
            .unwrap();
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let send = |attempt: &str, seq: u64, text: &str, end: bool| {
            let r = TextCompletionResponse {
                response: text.to_owned(),
                end_of_stream: end,
                ..Default::default()
            };
            Message::new(serde_json::to_vec(&r).unwrap())
                .with_property(properties::ID, s.id())
                .with_property(properties::ATTEMPT, attempt)
                .with_property(properties::SEQ, seq.to_string())
        };
        let publisher = bus.publisher(resp).await.unwrap();
        // Record 1 of attempt a was never stored (the broker restarted); its 2 and terminal 3
        // were. The processor handed the request back and attempt b answers it whole.
        for m in [
            send("a", 0, "zero", false),
            send("a", 2, "two", false),
            send("a", 3, "", true),
            send("b", 0, "whole", false),
            send("b", 1, "", true),
        ] {
            publisher.send(m).await.unwrap().await.unwrap();
        }
        assert_eq!(text(s.next().await), "zero");
        assert!(matches!(s.next().await, Some(Ok(Received::Restarted))));
        assert_eq!(text(s.next().await), "whole");
        match s.next().await.unwrap().unwrap() {
            Received::Record(r) => assert!(r.is_terminal()),
            Received::Restarted => panic!("one restart only"),
        }
        assert!(s.next().await.is_none());
    }

    #[tokio::test]
    async fn a_record_stored_twice_is_passed_on_once() {
        let (bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        numbered(&bus, s.id(), "a", 0, "zero", false).await;
        numbered(&bus, s.id(), "a", 0, "zero", false).await;
        numbered(&bus, s.id(), "a", 1, "end", true).await;
        assert_eq!(text(s.next().await), "zero");
        assert_eq!(text(s.next().await), "end");
        assert!(s.next().await.is_none());
    }

    #[tokio::test]
    async fn a_new_attempt_numbers_from_zero_and_the_abandoned_attempts_records_are_skipped() {
        let (bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        numbered(&bus, s.id(), "a", 0, "a0", false).await;
        numbered(&bus, s.id(), "a", 1, "a1", false).await;
        numbered(&bus, s.id(), "b", 0, "b0", false).await;
        // Attempt a was still running when the request was redelivered.
        numbered(&bus, s.id(), "a", 2, "a2", false).await;
        numbered(&bus, s.id(), "b", 1, "b1", true).await;
        let mut seen = Vec::new();
        while let Some(item) = s.next().await {
            seen.push(match item.unwrap() {
                Received::Record(r) => r.response,
                Received::Restarted => "<restarted>".to_owned(),
            });
        }
        assert_eq!(seen, ["a0", "a1", "<restarted>", "b0", "b1"]);
    }

    struct Noop;

    impl crate::bus::Settle for Noop {
        fn settle(self: Box<Self>, _: crate::bus::Settlement) {}
    }

    /// A delivery as the Pulsar bus makes it: numbered by the service, stamped by the broker
    /// with its producer and that producer's sequence id.
    fn from_producer(
        id: &str,
        seq: u64,
        producer: &Arc<str>,
        sequence: u64,
        end: bool,
    ) -> Delivery {
        let r = TextCompletionResponse {
            response: format!("{id}#{seq}"),
            end_of_stream: end,
            ..Default::default()
        };
        let properties = BTreeMap::from([
            (properties::ID.to_owned(), id.to_owned()),
            (properties::ATTEMPT.to_owned(), "a".to_owned()),
            (properties::SEQ.to_owned(), seq.to_string()),
        ]);
        Delivery::new(
            serde_json::to_vec(&r).unwrap().into(),
            properties,
            0,
            Box::new(Noop),
        )
        .with_origin(Origin {
            producer: producer.clone(),
            sequence,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_goes_quiet_after_its_producer_dropped_records_ends_as_lost() {
        let (_bus, _requests, client) = setup().await;
        let telemetry = crate::telemetry::Telemetry::new().unwrap();
        let metrics = Some(&telemetry.metrics);
        let (p, q): (Arc<str>, Arc<str>) = (Arc::from("p-1"), Arc::from("q-1"));
        let request = TextCompletionRequest::default();
        let new_stream = || {
            client.request_with(
                &request,
                RequestOptions {
                    inactivity_timeout: Some(Duration::from_secs(60)),
                    ..RequestOptions::default()
                },
            )
        };
        let (mut quiet, mut busy, mut elsewhere) = (
            new_stream().await.unwrap(),
            new_stream().await.unwrap(),
            new_stream().await.unwrap(),
        );
        let mut seen = Seen::default();
        let me = client.config.subscription.clone();
        let mut route = |d: Delivery| {
            dispatch(
                d,
                &client.routes,
                &mut seen,
                metrics,
                "test",
                Some(&me),
                true,
            );
        };
        route(from_producer(quiet.id(), 0, &p, 10, false));
        route(from_producer(busy.id(), 0, &p, 11, false));
        route(from_producer(elsewhere.id(), 0, &q, 3, false));
        // Producer p's 12 and 13 never arrive: one of them was quiet's terminal record.
        route(from_producer(busy.id(), 1, &p, 14, false));
        route(from_producer(busy.id(), 2, &p, 15, true));
        assert_eq!(text(quiet.next().await), format!("{}#0", quiet.id()));
        let started = Instant::now();
        match quiet.next().await.unwrap() {
            Err(ClientError::StreamLost(grace)) => assert_eq!(grace, DEFAULT_LOSS_GRACE),
            other => panic!("expected StreamLost, got {other:?}"),
        }
        assert_eq!(started.elapsed(), DEFAULT_LOSS_GRACE);
        // busy's next record arrived after the drop: it reads on to its end.
        for seq in 0..3 {
            assert_eq!(text(busy.next().await), format!("{}#{seq}", busy.id()));
        }
        assert!(busy.next().await.is_none());
        // elsewhere's producer dropped nothing: only its inactivity timeout applies.
        assert_eq!(
            text(elsewhere.next().await),
            format!("{}#0", elsewhere.id())
        );
        assert!(matches!(
            elsewhere.next().await.unwrap().unwrap_err(),
            ClientError::InactivityTimeout(_)
        ));
        assert!(
            telemetry
                .render()
                .contains("sluice_client_dropped_records_total{service=\"test\"} 2")
        );
    }

    /// A stream that waits 30 s for its next record: long enough for the syncs' verdicts,
    /// which the tests below time, to come first.
    async fn patient(client: &Client) -> ResponseStream<TextCompletionResponse> {
        client
            .request_with(
                &TextCompletionRequest::default(),
                RequestOptions {
                    inactivity_timeout: Some(Duration::from_secs(30)),
                    ..RequestOptions::default()
                },
            )
            .await
            .unwrap()
    }

    /// A processor instance's sync, as `processor::send_syncs` makes it.
    /// `streams`: (request id, attempt key, records published, open).
    async fn sync(
        bus: &MemoryBus,
        instance: &str,
        taking: bool,
        streams: &[(&str, &str, u64, bool)],
    ) {
        let state = SyncState {
            instance: instance.to_owned(),
            at_ms: u64::try_from(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis(),
            )
            .unwrap(),
            taking,
            streams: streams
                .iter()
                .map(|(id, attempt, n, open)| ((*id).to_owned(), (*attempt).to_owned(), *n, *open))
                .collect(),
        };
        bus.publisher("resp")
            .await
            .unwrap()
            .send(
                Message::new(&b"{}"[..])
                    .with_property(properties::ID, properties::SYNC)
                    .with_property(properties::SYNC, "text-completion")
                    .with_property(
                        properties::SYNC_STATE,
                        serde_json::to_string(&state).unwrap(),
                    ),
            )
            .await
            .unwrap();
    }

    async fn lost_in_transit(s: &mut ResponseStream<TextCompletionResponse>) -> (String, Duration) {
        let started = Instant::now();
        match s.next().await.unwrap() {
            Err(ClientError::LostInTransit(why)) => (why, started.elapsed()),
            other => panic!("expected LostInTransit, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_stream_whose_every_record_was_dropped_ends_at_the_sync_that_lists_it() {
        let (bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let id = s.id().to_owned();
        // Listed while nothing is published yet, then done with 3 records: none arrived.
        sync(&bus, "p1", true, &[(&id, "a", 0, true)]).await;
        sync(&bus, "p1", true, &[(&id, "a", 3, false)]).await;
        let (why, _) = lost_in_transit(&mut s).await;
        assert!(
            why.contains("3 response records") && why.contains("0 arrived"),
            "{why}"
        );
        assert!(s.next().await.is_none());
    }

    #[tokio::test]
    async fn a_stream_that_lost_its_tail_ends_at_the_sync_and_a_whole_one_reads_on() {
        let (bus, _requests, client) = setup().await;
        let mut whole = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let mut cut = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let (w, c) = (whole.id().to_owned(), cut.id().to_owned());
        numbered(&bus, &w, "a", 0, "w0", false).await;
        numbered(&bus, &c, "b", 0, "c0", false).await;
        numbered(&bus, &c, "b", 1, "c1", false).await;
        // cut's third and last record (index 2) was dropped; whole is still streaming.
        sync(&bus, "p1", true, &[(&w, "a", 1, true), (&c, "b", 3, false)]).await;
        numbered(&bus, &w, "a", 1, "w1", true).await;
        assert_eq!(text(cut.next().await), "c0");
        assert_eq!(text(cut.next().await), "c1");
        let (why, _) = lost_in_transit(&mut cut).await;
        assert!(
            why.contains("3 response records") && why.contains("2 arrived"),
            "{why}"
        );
        assert_eq!(text(whole.next().await), "w0");
        assert_eq!(text(whole.next().await), "w1");
        assert!(whole.next().await.is_none());
    }

    // The paused clock: the syncs' grace periods pass at once (a sync's wall-clock stamp
    // and its reading are still real time apart, a few microseconds).
    #[tokio::test(start_paused = true)]
    async fn a_request_no_processor_lists_ends_once_every_processor_took_requests_for_the_grace() {
        let (bus, _requests, client) = setup().await;
        let mut dropped = patient(&client).await;
        let mut queued = patient(&client).await;
        let queued_id = queued.id().to_owned();
        let started = Instant::now();
        // p1 takes requests all along and lists only `queued`; p2 is full for 1.5 s, then
        // takes requests too.
        let ticker = {
            let bus = bus.clone();
            tokio::spawn(async move {
                for tick in 0..20u32 {
                    sync(&bus, "p1", true, &[(&queued_id, "q", 0, true)]).await;
                    sync(&bus, "p2", tick >= 3, &[]).await;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
        };
        let (why, _) = lost_in_transit(&mut dropped).await;
        assert!(why.contains("no processor did"), "{why}");
        // Not before p2, which may have held it, took requests for the grace.
        let waited = started.elapsed();
        let due = Duration::from_millis(1500) + UNLISTED_GRACE;
        assert!(waited >= due - Duration::from_millis(100), "{waited:?}");
        assert!(waited < due + Duration::from_secs(2), "{waited:?}");
        ticker.await.unwrap();
        // The listed one is waiting for its records, not lost.
        numbered(&bus, queued.id(), "q", 0, "q0", true).await;
        assert_eq!(text(queued.next().await), "q0");
    }

    /// An attempt the stream moved on from (a restart, an agent's earlier step) stays listed for
    /// a while after its end; its count is not the stream's, and a stream whose processor
    /// listed it as finished does not depend on that processor any more.
    // The paused clock: the syncs' grace periods pass at once (a sync's wall-clock stamp
    // and its reading are still real time apart, a few microseconds).
    #[tokio::test(start_paused = true)]
    async fn only_the_attempt_being_read_is_counted_and_only_an_open_stream_needs_its_processor() {
        let (bus, _requests, client) = setup().await;
        let mut s = patient(&client).await;
        let id = s.id().to_owned();
        numbered(&bus, &id, "a", 0, "a0", false).await;
        numbered(&bus, &id, "b", 0, "b0", false).await;
        // p1 finished attempt a with 5 records (for this stream: it restarted on b).
        sync(&bus, "p1", true, &[(&id, "a", 5, false)]).await;
        sync(&bus, "p2", true, &[(&id, "b", 1, true)]).await;
        assert_eq!(text(s.next().await), "a0");
        assert_eq!(text(s.next().await), "<restarted>");
        assert_eq!(text(s.next().await), "b0");
        // p1 goes away: the stream is p2's.
        for _ in 0..24 {
            sync(&bus, "p2", true, &[(&id, "b", 1, true)]).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        numbered(&bus, &id, "b", 1, "b1", true).await;
        assert_eq!(text(s.next().await), "b1");
        assert!(s.next().await.is_none());
    }

    /// The next step of a stream (a new attempt, published by another processor before its
    /// sync) whose records all were dropped: the stream still reads the step before, and the
    /// listing of the one it has not reached shows the loss.
    #[tokio::test]
    async fn a_step_the_stream_has_not_reached_counts_as_nothing_arrived() {
        let (bus, _requests, client) = setup().await;
        let mut s = patient(&client).await;
        let id = s.id().to_owned();
        numbered(&bus, &id, "a1", 0, "step one", false).await;
        sync(&bus, "p1", true, &[(&id, "a1", 1, false)]).await;
        sync(&bus, "p2", true, &[(&id, "a2", 2, true)]).await;
        assert_eq!(text(s.next().await), "step one");
        let (why, _) = lost_in_transit(&mut s).await;
        assert!(
            why.contains("2 response records") && why.contains("0 arrived"),
            "{why}"
        );
    }

    // The paused clock: the syncs' grace periods pass at once (a sync's wall-clock stamp
    // and its reading are still real time apart, a few microseconds).
    #[tokio::test(start_paused = true)]
    async fn with_a_processor_that_does_not_sync_on_the_topic_an_unlisted_request_waits() {
        let (bus, _requests, client) = setup().await;
        let mut other = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        // A TrustGraph processor's record: no index.
        reply(&bus, other.id(), "t", "from trustgraph", true).await;
        assert_eq!(text(other.next().await), "from trustgraph");
        let mut s = client
            .request_with(
                &TextCompletionRequest::default(),
                RequestOptions {
                    inactivity_timeout: Some(Duration::from_secs(4)),
                    ..RequestOptions::default()
                },
            )
            .await
            .unwrap();
        for _ in 0..8 {
            sync(&bus, "p1", true, &[]).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(matches!(
            s.next().await.unwrap().unwrap_err(),
            ClientError::InactivityTimeout(_)
        ));
    }

    // The paused clock: the syncs' grace periods pass at once (a sync's wall-clock stamp
    // and its reading are still real time apart, a few microseconds).
    #[tokio::test(start_paused = true)]
    async fn a_stream_whose_processor_stopped_syncing_ends_while_another_syncs() {
        let (bus, _requests, client) = setup().await;
        let mut s = patient(&client).await;
        let id = s.id().to_owned();
        numbered(&bus, &id, "a", 0, "first", false).await;
        sync(&bus, "p1", true, &[(&id, "a", 1, true)]).await;
        sync(&bus, "p2", true, &[]).await;
        assert_eq!(text(s.next().await), "first");
        let started = Instant::now();
        // p1 is gone (SIGKILL); p2 goes on syncing.
        let ticker = {
            let bus = bus.clone();
            tokio::spawn(async move {
                for _ in 0..30 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    sync(&bus, "p2", true, &[]).await;
                }
            })
        };
        let (why, _) = lost_in_transit(&mut s).await;
        assert!(why.contains("stopped syncing"), "{why}");
        let waited = started.elapsed();
        assert!(
            waited >= SILENT_AFTER && waited < SILENT_AFTER + Duration::from_secs(2),
            "{waited:?}"
        );
        ticker.abort();
    }

    #[test]
    fn producer_sequences_count_what_was_skipped() {
        let mut seqs = ProducerSequences::default();
        let at = |sequence| Origin {
            producer: Arc::from("p"),
            sequence,
        };
        assert_eq!(
            seqs.observe(&at(5)),
            0,
            "the first one seen sets the baseline"
        );
        assert_eq!(seqs.observe(&at(6)), 0);
        assert_eq!(seqs.observe(&at(9)), 2);
        assert_eq!(seqs.observe(&at(8)), 0, "a resent message skips nothing");
        assert_eq!(seqs.observe(&at(10)), 0);
    }

    #[tokio::test]
    async fn close_ends_open_streams() {
        let (_bus, _requests, client) = setup().await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        client.close().await;
        assert!(matches!(
            s.next().await.unwrap().unwrap_err(),
            ClientError::Closed
        ));
        assert!(matches!(
            client
                .request(&TextCompletionRequest::default())
                .await
                .err()
                .unwrap(),
            ClientError::Closed
        ));
    }

    /// A bus whose publisher for the topic "req" loses the receipts of its first `lose`
    /// sends: each is stored first when `store` is set (the broker wrote it, its
    /// acknowledgement was lost), dropped otherwise; the receipt fails once `fail_at` opens
    /// (at once when it starts open), with `Unavailable` or, when `deny` is set, `Denied`.
    #[derive(Clone)]
    struct LostReceipts {
        inner: MemoryBus,
        lose: Arc<std::sync::atomic::AtomicUsize>,
        store: bool,
        deny: bool,
        fail_at: watch::Receiver<bool>,
        /// Set by a lost receipt as it fails.
        failed: Arc<watch::Sender<bool>>,
    }

    impl LostReceipts {
        /// Receipts that fail at once.
        fn new(lose: usize, store: bool) -> (Self, watch::Sender<bool>) {
            Self::failing_when(lose, store, true)
        }

        /// Receipts that fail once the returned sender says `true`.
        fn failing_when(lose: usize, store: bool, now: bool) -> (Self, watch::Sender<bool>) {
            let (open, fail_at) = watch::channel(now);
            let bus = Self {
                inner: MemoryBus::default(),
                lose: Arc::new(lose.into()),
                store,
                deny: false,
                fail_at,
                failed: Arc::new(watch::channel(false).0),
            };
            (bus, open)
        }
    }

    struct LostReceiptPublisher {
        bus: LostReceipts,
        inner: Arc<dyn Publisher>,
    }

    #[async_trait::async_trait]
    impl Publisher for LostReceiptPublisher {
        async fn send(&self, message: Message) -> Result<crate::bus::Receipt, BusError> {
            use std::sync::atomic::Ordering;
            let lost = self
                .bus
                .lose
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if !lost {
                return self.inner.send(message).await;
            }
            if self.bus.store {
                // Stored; its own receipt is the one lost.
                drop(self.inner.send(message).await?);
            }
            let (mut fail_at, deny) = (self.bus.fail_at.clone(), self.bus.deny);
            let failed = self.bus.failed.clone();
            Ok(crate::bus::Receipt::new(async move {
                let _ = fail_at.wait_for(|open| *open).await;
                failed.send_replace(true);
                Err(if deny {
                    BusError::Denied(crate::bus::pulsar_security::Denial {
                        cause: crate::bus::pulsar_security::DenialCause::Authorization,
                        operation: "producing to req".into(),
                        detail: "not authorized".into(),
                    })
                } else {
                    BusError::Unavailable(
                        "send receipt: the message was not acknowledged within the operation timeout"
                            .into(),
                    )
                })
            }))
        }

        fn topic(&self) -> &str {
            self.inner.topic()
        }
    }

    #[async_trait::async_trait]
    impl Bus for LostReceipts {
        async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError> {
            let inner = self.inner.publisher(topic).await?;
            if topic != "req" {
                return Ok(inner);
            }
            Ok(Arc::new(LostReceiptPublisher {
                bus: self.clone(),
                inner,
            }))
        }

        async fn subscribe(
            &self,
            topic: &str,
            subscription: &str,
            options: SubscribeOptions,
        ) -> Result<Box<dyn Subscription>, BusError> {
            self.inner.subscribe(topic, subscription, options).await
        }

        fn max_message_bytes(&self) -> usize {
            self.inner.max_message_bytes()
        }
    }

    /// The client and the service's request subscription on a bus that loses receipts.
    async fn lost_receipts_setup(bus: &LostReceipts) -> (Box<dyn Subscription>, Client) {
        let requests = bus
            .inner
            .subscribe("req", "svc", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let mut config = ClientConfig::new("test", "req", "resp");
        config.inactivity_timeout = Duration::from_secs(5);
        let client = Client::start(Arc::new(bus.clone()), config, None)
            .await
            .unwrap();
        (requests, client)
    }

    /// No more request arrives within a short wait.
    async fn no_more(requests: &mut Box<dyn Subscription>) {
        assert!(
            tokio::time::timeout(Duration::from_millis(300), requests.next())
                .await
                .is_err(),
            "an extra copy of the request was published"
        );
    }

    /// The owning broker died before it acknowledged the request (seen in the cluster suite:
    /// "not acknowledged within the operation timeout"): the request was not stored, so it is
    /// published again under its id and answered, where the caller used to get `NotStored`.
    #[tokio::test]
    async fn a_request_whose_receipt_failed_in_an_outage_is_published_again_and_answered() {
        let (bus, _open) = LostReceipts::new(2, false);
        let (mut requests, client) = lost_receipts_setup(&bus).await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let delivered = requests.next().await.unwrap().unwrap();
        assert_eq!(delivered.property(properties::ID), Some(s.id()));
        delivered.ack();
        reply(&bus.inner, s.id(), "a", "answered", true).await;
        assert_eq!(text(s.next().await), "answered");
        assert!(s.next().await.is_none());
        no_more(&mut requests).await;
    }

    /// The broker stored it but its acknowledgement was lost: the second copy is a second
    /// attempt, which the stream reads as a restart; the caller gets one whole answer.
    #[tokio::test]
    async fn a_stored_request_whose_receipt_was_lost_is_answered_once_as_a_restart() {
        let (bus, _open) = LostReceipts::new(1, true);
        let (mut requests, client) = lost_receipts_setup(&bus).await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let first = requests.next().await.unwrap().unwrap();
        let second = requests.next().await.unwrap().unwrap();
        assert_eq!(first.property(properties::ID), Some(s.id()));
        assert_eq!(second.property(properties::ID), Some(s.id()));
        reply(&bus.inner, s.id(), "a", "from a ", false).await;
        reply(&bus.inner, s.id(), "b", "from b", true).await;
        reply(&bus.inner, s.id(), "a", "a ends", true).await;
        assert_eq!(text(s.next().await), "from a ");
        assert_eq!(text(s.next().await), "<restarted>");
        assert_eq!(text(s.next().await), "from b");
        assert!(s.next().await.is_none());
    }

    /// A receipt that fails after a record arrived changes nothing: the record proved the
    /// request was stored. (The stream used to end with `NotStored` mid-answer.)
    #[tokio::test]
    async fn a_receipt_that_fails_after_the_first_record_publishes_nothing_and_ends_nothing() {
        let (bus, fail) = LostReceipts::failing_when(1, true, false);
        let (mut requests, client) = lost_receipts_setup(&bus).await;
        let mut s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let delivered = requests.next().await.unwrap().unwrap();
        delivered.ack();
        reply(&bus.inner, s.id(), "a", "first", false).await;
        assert_eq!(text(s.next().await), "first");
        let mut failed = bus.failed.subscribe();
        fail.send(true).unwrap();
        // The receipt fails and its task handles the failure in the same poll (no await
        // between them), and this test runs on one thread: once the failure is seen here, the
        // task has done what it does with it.
        failed.wait_for(|f| *f).await.unwrap();
        reply(&bus.inner, s.id(), "a", "last", true).await;
        assert_eq!(text(s.next().await), "last");
        assert!(s.next().await.is_none());
        no_more(&mut requests).await;
    }

    /// A receipt that keeps failing is given up on after the resends, and a refusal at once:
    /// the caller hears `NotStored` instead of waiting for its timeout.
    #[tokio::test]
    async fn receipts_that_keep_failing_or_a_refusal_end_the_wait_with_not_stored() {
        for deny in [false, true] {
            let (mut bus, _open) = LostReceipts::new(usize::MAX, false);
            bus.deny = deny;
            let (mut requests, client) = lost_receipts_setup(&bus).await;
            let mut s = client
                .request(&TextCompletionRequest::default())
                .await
                .unwrap();
            let e = tokio::time::timeout(Duration::from_secs(2), s.next())
                .await
                .expect("the caller waited for its timeout")
                .unwrap()
                .unwrap_err();
            assert!(matches!(e, ClientError::NotStored(_)), "deny {deny}: {e}");
            no_more(&mut requests).await;
            let sends = usize::MAX - bus.lose.load(std::sync::atomic::Ordering::SeqCst);
            let expected = if deny {
                1
            } else {
                1 + RESENDS_ON_LOST_RECEIPT as usize
            };
            assert_eq!(sends, expected, "deny {deny}");
        }
    }

    /// A bus whose subscriptions fail with `error` the first `fail` times: a broker
    /// restarting (its bookies not ready) at the client's start.
    struct FailingSubscribe {
        inner: MemoryBus,
        fail: std::sync::atomic::AtomicUsize,
        deny: bool,
    }

    #[async_trait::async_trait]
    impl Bus for FailingSubscribe {
        async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError> {
            self.inner.publisher(topic).await
        }

        async fn subscribe(
            &self,
            topic: &str,
            subscription: &str,
            options: SubscribeOptions,
        ) -> Result<Box<dyn Subscription>, BusError> {
            use std::sync::atomic::Ordering;
            if self
                .fail
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(if self.deny {
                    BusError::Denied(crate::bus::pulsar_security::Denial {
                        cause: crate::bus::pulsar_security::DenialCause::Authorization,
                        operation: format!("subscribing to {topic}"),
                        detail: "not authorized".into(),
                    })
                } else {
                    BusError::Unavailable(
                        "Server error (Some(PersistenceError)): Not enough non-faulty bookies available"
                            .into(),
                    )
                });
            }
            self.inner.subscribe(topic, subscription, options).await
        }

        fn max_message_bytes(&self) -> usize {
            self.inner.max_message_bytes()
        }
    }

    /// A client started while the broker restarts waits for it (the soak's prompt replica
    /// exited on "Not enough non-faulty bookies"); past `start_wait`, or on a refusal at once,
    /// it fails.
    #[tokio::test(start_paused = true)]
    async fn a_client_started_while_the_broker_restarts_waits_for_it_and_a_refusal_does_not() {
        let bus = |fail: usize, deny: bool| {
            Arc::new(FailingSubscribe {
                inner: MemoryBus::default(),
                fail: fail.into(),
                deny,
            })
        };
        let config = ClientConfig::new("test", "req", "resp");
        let flaky = bus(3, false);
        let client = Client::start(flaky.clone(), config.clone(), None)
            .await
            .unwrap();
        assert_eq!(flaky.fail.load(std::sync::atomic::Ordering::SeqCst), 0);
        client.close().await;
        let mut short = config.clone();
        short.start_wait = Duration::from_secs(2);
        let e = Client::start(bus(usize::MAX, false), short, None)
            .await
            .err()
            .unwrap();
        assert!(
            matches!(e, ClientError::Bus(BusError::Unavailable(_))),
            "{e}"
        );
        let refused = bus(1, true);
        let started = tokio::time::Instant::now();
        let e = Client::start(refused, config, None).await.err().unwrap();
        assert!(matches!(e, ClientError::Bus(BusError::Denied(_))), "{e}");
        assert_eq!(
            started.elapsed(),
            Duration::ZERO,
            "a refusal is not waited on"
        );
    }

    /// A caller that goes away in the client's first seconds, before the cancel publisher
    /// exists, still stops the service's work: the cancel goes out once the publisher does.
    #[tokio::test(start_paused = true)]
    async fn a_stream_dropped_before_the_cancel_publisher_exists_is_cancelled_once_it_does() {
        let bus = MemoryBus::default();
        let mut cancels = bus
            .subscribe("cancel", "watch", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let _requests = bus
            .subscribe("req", "svc", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let (open, gate) = watch::channel(false);
        let slow = crate::bus::memory::SlowCancelTopic {
            inner: bus.clone(),
            publishers: true,
            gate,
        };
        let mut config = ClientConfig::new("test", "req", "resp");
        config.cancel_topic = Some("cancel".into());
        // Start-up waits 2 s for the cancel publisher, then goes on without it.
        let client = Client::start(Arc::new(slow), config, None).await.unwrap();
        let s = client
            .request(&TextCompletionRequest::default())
            .await
            .unwrap();
        let id = s.id().to_owned();
        drop(s);
        tokio::time::sleep(Duration::from_secs(5)).await;
        open.send(true).unwrap();
        let cancel = tokio::time::timeout(Duration::from_secs(10), cancels.next())
            .await
            .expect("no cancel was published")
            .unwrap()
            .unwrap();
        assert_eq!(cancel.property(properties::ID), Some(id.as_str()));
    }

    /// What [`deaf_setup`] returns: the bus, the client and its subscriptions' switch.
    struct DeafClient {
        bus: MemoryBus,
        client: Client,
        switch: Arc<DeafSwitch>,
        _requests: Box<dyn Subscription>,
    }

    impl DeafClient {
        /// The re-subscriptions asked for, each checked to give the reason the client's rule
        /// gives.
        fn renewals(&self) -> usize {
            for why in self.switch.reasons() {
                assert!(why.contains("not even a processor's sync"), "{why}");
            }
            self.switch.renewals()
        }
        fn go_deaf(&self) {
            self.switch.go_deaf();
        }
    }

    /// A client on the in-process bus whose response subscription goes deaf on its switch; a
    /// re-subscription asked of it heals it when `heals`, and leaves it deaf otherwise.
    async fn deaf_setup(heals: bool) -> DeafClient {
        let bus = MemoryBus::default();
        let requests = bus
            .subscribe("req", "svc", SubscribeOptions::shared(10))
            .await
            .unwrap();
        let on_renew = if heals {
            OnRenew::Heal
        } else {
            OnRenew::StayDeaf
        };
        let (wrapped, switch) = DeafeningBus::new(Arc::new(bus.clone()), on_renew);
        let client = Client::start(
            Arc::new(wrapped),
            ClientConfig::new("test", "req", "resp"),
            None,
        )
        .await
        .unwrap();
        DeafClient {
            bus,
            client,
            switch,
            _requests: requests,
        }
    }

    /// A processor that syncs every second until `stop`, listing `id` (attempt "a") with the
    /// records `published` holds.
    fn syncing(
        bus: &MemoryBus,
        id: Option<String>,
        published: Arc<std::sync::atomic::AtomicU64>,
        stop: CancellationToken,
    ) -> JoinHandle<()> {
        let bus = bus.clone();
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let n = published.load(std::sync::atomic::Ordering::SeqCst);
                match &id {
                    Some(id) => sync(&bus, "p1", true, &[(id, "a", n, true)]).await,
                    None => sync(&bus, "p1", true, &[]).await,
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    }

    /// The unload stall seen on the cluster (TrustGraph's mapping, three namespace unloads
    /// under load): the broker dropped the client's response consumer while answering its
    /// stats, and every stream waited out its inactivity timeout. Heard nothing at all, not
    /// even the syncs, the client re-subscribes; the syncs then end what was lost meanwhile,
    /// long before the timeout.
    // The paused clock: the ten quiet seconds pass at once.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_hears_nothing_while_streams_wait_re_subscribes_and_the_syncs_end_the_lost()
     {
        let c = deaf_setup(true).await;
        let mut s = patient(&c.client).await;
        let published = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stop = CancellationToken::new();
        let ticker = syncing(
            &c.bus,
            Some(s.id().to_owned()),
            published.clone(),
            stop.clone(),
        );
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(c.renewals(), 0, "the syncs were heard");
        c.go_deaf();
        let deaf_since = Instant::now();
        numbered(&c.bus, s.id(), "a", 0, "a0", false).await;
        numbered(&c.bus, s.id(), "a", 1, "a1", false).await;
        published.store(2, std::sync::atomic::Ordering::SeqCst);
        let (why, _) = lost_in_transit(&mut s).await;
        assert!(why.contains("lost in transit"), "{why}");
        let waited = deaf_since.elapsed();
        assert_eq!(c.renewals(), 1);
        let due = Duration::from_secs(u64::from(DEAF_AFTER_TICKS));
        assert!(waited >= due - Duration::from_secs(1), "{waited:?}");
        assert!(waited < due + Duration::from_secs(3), "{waited:?}");
        stop.cancel();
        ticker.await.unwrap();
    }

    /// Silence alone is not deafness: with no stream waiting, or with no sync ever heard
    /// (TrustGraph's own processors do not sync), the client does not re-subscribe. A client
    /// that went deaf while idle re-subscribes as soon as a stream waits.
    #[tokio::test(start_paused = true)]
    async fn silence_without_a_waiting_stream_or_without_syncs_heard_is_not_deafness() {
        // No sync ever heard: a stream waits 25 s in silence.
        let c = deaf_setup(true).await;
        let s = patient(&c.client).await;
        c.go_deaf();
        tokio::time::sleep(Duration::from_secs(25)).await;
        assert_eq!(c.renewals(), 0);
        drop(s);

        // Syncs heard, then, 6 s later, records without syncs (TrustGraph's processors
        // answer now), then silence while a stream waits.
        let c = deaf_setup(true).await;
        let stop = CancellationToken::new();
        let ticker = syncing(&c.bus, None, Arc::default(), stop.clone());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.cancel();
        ticker.await.unwrap();
        let s = patient(&c.client).await;
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            reply(&c.bus, "someone-else", "t", "x", false).await;
        }
        c.go_deaf();
        tokio::time::sleep(Duration::from_secs(25)).await;
        assert_eq!(c.renewals(), 0);
        drop(s);

        // Syncs heard, then silence with nothing waiting.
        let c = deaf_setup(true).await;
        let stop = CancellationToken::new();
        let ticker = syncing(&c.bus, None, Arc::default(), stop.clone());
        tokio::time::sleep(Duration::from_millis(2500)).await;
        c.go_deaf();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(c.renewals(), 0);
        // A stream waits: the silence has been long enough already.
        let _s = patient(&c.client).await;
        tokio::time::sleep(Duration::from_millis(2100)).await;
        assert_eq!(c.renewals(), 1);
        stop.cancel();
        ticker.await.unwrap();
    }

    /// Re-subscribing that cures nothing (every processor gone, or no broker owns the topic)
    /// is not repeated every ten seconds: each silence after one doubles the wait.
    #[tokio::test(start_paused = true)]
    async fn re_subscriptions_that_hear_nothing_back_off() {
        let c = deaf_setup(false).await;
        let stop = CancellationToken::new();
        let ticker = syncing(&c.bus, None, Arc::default(), stop.clone());
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let _s = c
            .client
            .request_with(
                &TextCompletionRequest::default(),
                RequestOptions {
                    inactivity_timeout: Some(Duration::from_secs(600)),
                    ..RequestOptions::default()
                },
            )
            .await
            .unwrap();
        c.go_deaf();
        // Re-subscriptions after 11, 21 and 41 quiet ticks (at 11, 32 and 73 s of silence),
        // then after 81 (at 154), and no longer apart than that (235).
        tokio::time::sleep(Duration::from_secs(75)).await;
        assert_eq!(c.renewals(), 3);
        tokio::time::sleep(Duration::from_secs(70)).await;
        assert_eq!(c.renewals(), 3);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(c.renewals(), 4);
        tokio::time::sleep(Duration::from_secs(80)).await;
        assert_eq!(c.renewals(), 5);
        stop.cancel();
        ticker.await.unwrap();
    }
}
