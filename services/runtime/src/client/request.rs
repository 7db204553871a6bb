//! The client itself: starting it (its publisher, its response subscription, its router),
//! publishing a request, reading a stream again from the topic, closing.

use std::{
    collections::BTreeMap,
    marker::PhantomData,
    sync::{Arc, Mutex},
    time::Duration,
};

use serde::Serialize;
use sluice_schema::{ResponseRecord, properties};
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
    time::Instant,
};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{
    ClientConfig, ClientError, RequestOptions, ResponseStream,
    cancel::CancelPublisher,
    receipt::confirm_stored,
    route::{Route, Routed, Router, Routes, route},
};
use crate::{
    backoff::Backoff,
    bus::{Bus, BusError, Link, Message, Position, Publisher, StartPosition, SubscribeOptions},
    lock,
    telemetry::RuntimeMetrics,
};

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

/// A request/response client for one service. Cheap to share behind an `Arc`.
pub struct RequestClient<Req, Resp: ResponseRecord> {
    pub(super) config: ClientConfig,
    bus: Arc<dyn Bus>,
    publisher: Arc<dyn Publisher>,
    /// The position of the last response record the router read (see
    /// [`ResponseStream::resume_after`]).
    latest: Arc<Mutex<Option<Position>>>,
    /// `None`: no cancel topic.
    cancel: Option<CancelPublisher>,
    pub(super) routes: Routes<Resp>,
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
        if let Some(origin) = options.origin {
            properties.insert(properties::ORIGIN.to_owned(), origin);
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

impl<Req, Resp: ResponseRecord> Drop for RequestClient<Req, Resp> {
    fn drop(&mut self) {
        // The router unsubscribes when it sees the token.
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests;
