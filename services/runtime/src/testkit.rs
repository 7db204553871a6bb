//! What the services' unit tests share (the crate feature `testkit`, which only their
//! dev-dependencies enable, and the runtime's own unit tests): a service played by the test
//! on the in-process bus, and a bus whose subscriptions go deaf.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use futures::FutureExt;
use serde::{Serialize, de::DeserializeOwned};
use sluice_schema::properties;

use crate::bus::{
    Bus, BusError, Delivery, Link, Message, Publisher, SubscribeOptions, Subscription,
    memory::MemoryBus,
};

/// How long a test waits for a request before it fails.
const WAIT: Duration = Duration::from_secs(10);

/// A service (text-completion, say) played by a test on the in-process bus: it reads the
/// requests sent to the service's request topic and answers them record by record, under
/// attempt ids of its choosing, so that restarts, errors and silence are exact.
pub struct ServiceStub {
    bus: MemoryBus,
    requests: Box<dyn Subscription>,
    response_topic: String,
}

impl ServiceStub {
    /// Subscribes to `request_topic` (before anything is published there: the in-process bus
    /// keeps nothing for a topic nobody subscribes to); answers go to `response_topic`.
    pub async fn start(bus: &MemoryBus, request_topic: &str, response_topic: &str) -> Self {
        let requests = bus
            .subscribe(request_topic, "stub", SubscribeOptions::shared(16))
            .await
            .unwrap();
        Self {
            bus: bus.clone(),
            requests,
            response_topic: response_topic.to_owned(),
        }
    }

    /// The next request sent to the service, and its id. Panics after 10 s without one.
    pub async fn request<Q: DeserializeOwned>(&mut self) -> (String, Q) {
        let d = tokio::time::timeout(WAIT, self.requests.next())
            .await
            .expect("a request")
            .unwrap()
            .unwrap();
        let id = d.property(properties::ID).unwrap().to_owned();
        let request = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        (id, request)
    }

    /// Whether no request has been sent to the service so far (checked at once: the
    /// in-process bus has queued a request by the time its sender goes on, so a test that
    /// has seen what the sender did after a request needs no wait).
    pub fn no_request_waiting(&mut self) -> bool {
        self.requests.next().now_or_never().is_none()
    }

    /// Publishes the service's record `record` for request `id`, as attempt `attempt`.
    pub async fn answer<R: Serialize>(&self, id: &str, attempt: &str, record: &R) {
        self.bus
            .publisher(&self.response_topic)
            .await
            .unwrap()
            .send(
                Message::new(serde_json::to_vec(record).unwrap())
                    .with_property(properties::ID, id)
                    .with_property(properties::ATTEMPT, attempt),
            )
            .await
            .unwrap();
    }
}

/// The switch of a [`DeafeningBus`]: whether its subscriptions hear, and what re-subscriptions
/// were asked of them.
#[derive(Default)]
pub struct DeafSwitch {
    deaf: AtomicBool,
    reasons: Mutex<Vec<String>>,
}

impl DeafSwitch {
    /// From now on the subscriptions ack and swallow whatever arrives.
    pub fn go_deaf(&self) {
        self.deaf.store(true, Ordering::SeqCst);
    }

    /// How many re-subscriptions were asked for.
    pub fn renewals(&self) -> usize {
        self.reasons.lock().unwrap().len()
    }

    /// The reason given with each re-subscription asked for, in order.
    pub fn reasons(&self) -> Vec<String> {
        self.reasons.lock().unwrap().clone()
    }

    fn is_deaf(&self) -> bool {
        self.deaf.load(Ordering::SeqCst)
    }
}

/// What a [`DeafeningBus`]'s subscription does when asked to re-subscribe, once it counted
/// the request. The in-process bus's own subscriptions cannot re-subscribe, so over it the
/// client's side of a re-subscription is what a test sees.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OnRenew {
    /// Hears again, and answers that it re-subscribed.
    Heal,
    /// Stays deaf, and answers that it re-subscribed (a re-subscription that did not help).
    StayDeaf,
    /// Hears again, and passes the request on to the real subscription (a broker's consumer
    /// is re-created).
    PassOn,
}

/// A bus whose subscriptions the broker stopped serving without a word, as seen on the
/// cluster after namespace unloads: once [`DeafSwitch::go_deaf`], every subscription acks and
/// swallows whatever arrives, until a re-subscription is asked of it
/// ([`Subscription::renew`]). Publishers are the inner bus's own.
pub struct DeafeningBus {
    inner: Arc<dyn Bus>,
    switch: Arc<DeafSwitch>,
    on_renew: OnRenew,
}

impl DeafeningBus {
    /// `inner`, deafened by the returned switch.
    pub fn new(inner: Arc<dyn Bus>, on_renew: OnRenew) -> (Self, Arc<DeafSwitch>) {
        let switch = Arc::new(DeafSwitch::default());
        let bus = Self {
            inner,
            switch: switch.clone(),
            on_renew,
        };
        (bus, switch)
    }
}

#[async_trait]
impl Bus for DeafeningBus {
    async fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, BusError> {
        self.inner.publisher(topic).await
    }

    async fn subscribe(
        &self,
        topic: &str,
        subscription: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BusError> {
        Ok(Box::new(Deafened {
            inner: self.inner.subscribe(topic, subscription, options).await?,
            switch: self.switch.clone(),
            on_renew: self.on_renew,
        }))
    }

    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes()
    }
}

/// A [`DeafeningBus`]'s subscription.
struct Deafened {
    inner: Box<dyn Subscription>,
    switch: Arc<DeafSwitch>,
    on_renew: OnRenew,
}

#[async_trait]
impl Subscription for Deafened {
    async fn next(&mut self) -> Option<Result<Delivery, BusError>> {
        loop {
            match self.inner.next().await? {
                Ok(d) if self.switch.is_deaf() => d.ack(),
                other => return Some(other),
            }
        }
    }

    async fn close(self: Box<Self>) {
        self.inner.close().await;
    }

    async fn unsubscribe(self: Box<Self>) {
        self.inner.unsubscribe().await;
    }

    fn link(&self) -> Link {
        self.inner.link()
    }

    fn renew(&mut self, why: &str) -> bool {
        self.switch.reasons.lock().unwrap().push(why.to_owned());
        if self.on_renew != OnRenew::StayDeaf {
            self.switch.deaf.store(false, Ordering::SeqCst);
        }
        match self.on_renew {
            OnRenew::Heal | OnRenew::StayDeaf => true,
            OnRenew::PassOn => self.inner.renew(why),
        }
    }
}
