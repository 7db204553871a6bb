use std::{sync::Arc, time::Duration};

use crate::{
    bus::{Bus, BusError, Publisher, SubscribeOptions, Subscription, memory::MemoryBus},
    client::{ClientConfig, ClientError, tests::*},
};

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
