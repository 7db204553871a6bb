use std::{sync::Arc, time::Duration};

use sluice_schema::{TextCompletionRequest, properties};
use tokio::sync::watch;

use super::*;
use crate::{
    bus::{Bus, BusError, Message, Publisher, SubscribeOptions, Subscription, memory::MemoryBus},
    client::{ClientConfig, ClientError, tests::*},
};

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
