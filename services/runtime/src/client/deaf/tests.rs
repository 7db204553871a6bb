use std::{sync::Arc, time::Duration};

use sluice_schema::TextCompletionRequest;
use tokio::{task::JoinHandle, time::Instant};
use tokio_util::sync::CancellationToken;

use crate::{
    bus::{Bus, SubscribeOptions, Subscription, memory::MemoryBus},
    client::{ClientConfig, DEAF_AFTER_TICKS, RequestOptions, tests::*},
    testkit::{DeafSwitch, DeafeningBus, OnRenew},
};

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
async fn a_client_that_hears_nothing_while_streams_wait_re_subscribes_and_the_syncs_end_the_lost() {
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
