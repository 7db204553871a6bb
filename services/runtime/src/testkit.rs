//! What the services' unit tests share (the crate feature `testkit`, which only their
//! dev-dependencies enable): a service played by the test on the in-process bus.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use futures::FutureExt;
use serde::{Serialize, de::DeserializeOwned};
use sluice_schema::properties;

use crate::bus::{Bus, Message, SubscribeOptions, Subscription, memory::MemoryBus};

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
