use std::time::Duration;

use sluice_schema::properties;

use crate::{
    bus::{Bus, Message},
    processor::{ProcessorConfig, tests::*},
};

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
