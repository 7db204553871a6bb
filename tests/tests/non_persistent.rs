//! TrustGraph's topic mapping on the real broker: non-persistent request and response topics,
//! where the broker drops whatever arrives for a consumer that has no flow permits left.
//! What sluice must still guarantee there: a burst of requests up to a processor's concurrency
//! is never dropped, whatever came before it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{sync::Arc, time::Duration};

use futures::future::join_all;
use sluice_runtime::client::{ClientConfig, Received};
use sluice_schema::TextCompletionRequest;
use sluice_tests::{
    Broker, EchoHandler, RunningProcessor, TextClient, echo_config, init_logging,
    unique_non_persistent_topic,
};

fn slow_request(prompt: &str) -> TextCompletionRequest {
    TextCompletionRequest {
        // One record after 700 ms: about as long as a short provider answer.
        system: "records=1 delay_ms=700".into(),
        prompt: prompt.into(),
        streaming: true,
        ..Default::default()
    }
}

/// Issue #13.1: after two requests one after the other, a burst of exactly `concurrency`
/// requests used to lose two of them: the processor's flow permits equalled its concurrency
/// and pulsar-rs tops them up only once half are used, so the broker had 62 permits for 64
/// requests and dropped the rest.
#[tokio::test]
async fn a_burst_up_to_the_concurrency_after_earlier_requests_is_never_dropped() {
    init_logging();
    const CONCURRENCY: usize = 64;
    let broker = Broker::from_env().await;
    let req = unique_non_persistent_topic("burst-req");
    let resp = unique_non_persistent_topic("burst-resp");
    let processor = RunningProcessor::start(
        broker.bus().await,
        echo_config(&req, &resp, CONCURRENCY),
        EchoHandler,
    )
    .await;
    let mut config = ClientConfig::new("echo", &req, &resp);
    // Far above the 700 ms an answer takes: a dropped request shows as this timeout.
    config.inactivity_timeout = Duration::from_secs(15);
    let client = Arc::new(
        TextClient::start(broker.bus().await, config, None)
            .await
            .unwrap(),
    );
    // History: two requests, one after the other.
    for i in 0..2 {
        let records = client.call(&slow_request(&format!("warm{i}"))).await.unwrap();
        assert_eq!(records.len(), 2, "warm-up {i}");
    }
    // The burst: every request published before any is answered.
    let streams = join_all(
        (0..CONCURRENCY).map(|i| {
            let client = client.clone();
            async move { client.request(&slow_request(&format!("b{i}"))).await.unwrap() }
        }),
    )
    .await;
    let outcomes = join_all(streams.into_iter().enumerate().map(|(i, mut s)| async move {
        let mut texts = Vec::new();
        while let Some(item) = s.next().await {
            match item {
                Ok(Received::Record(r)) => texts.push(r.response),
                Ok(Received::Restarted) => texts.clear(),
                Err(e) => return Err(format!("request b{i}: {e}")),
            }
        }
        Ok((i, texts))
    }))
    .await;
    let failed: Vec<_> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {CONCURRENCY} requests of the burst were lost: {failed:?}",
        failed.len()
    );
    for outcome in outcomes {
        let (i, texts) = outcome.unwrap();
        assert_eq!(texts, [format!("b{i}#0"), String::new()]);
    }
    client.close().await;
    processor.stop().await;
}
