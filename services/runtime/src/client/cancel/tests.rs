use std::{sync::Arc, time::Duration};

use sluice_schema::{TextCompletionRequest, properties};
use tokio::sync::watch;

use crate::{
    bus::{Bus, SubscribeOptions, memory::MemoryBus},
    client::{ClientConfig, tests::*},
};

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
