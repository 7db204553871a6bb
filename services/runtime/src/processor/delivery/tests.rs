use std::time::Duration;

use sluice_schema::{TextCompletionResponse, properties};

use crate::{
    bus::{Bus, Message},
    cancel,
    processor::{ProcessorConfig, tests::*},
    seal::SealKey,
};

#[tokio::test]
async fn a_hand_off_the_broker_did_not_store_goes_back_to_the_broker_not_to_the_client() {
    let mut f = start().await;
    let mut m = Message::new(r#"{"prompt":"handoff-fails"}"#.to_owned());
    m = m.with_property(properties::ID, "h1");
    f.bus.publisher("req").await.unwrap().send(m).await.unwrap();
    // The record sent before the hand-off arrives (once per attempt); no terminal error
    // ever does, and the request is handed back for another attempt.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(Some(Ok(d))) = tokio::time::timeout_at(deadline, f.responses.next()).await {
        if d.property(properties::ID) != Some("h1") {
            // The processor's probes of the broker while it waits to store again.
            d.ack();
            continue;
        }
        let r: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
        d.ack();
        assert!(r.error.is_none(), "{r:?}");
        assert_eq!(r.response, "step one");
    }
    let text = f.telemetry.render();
    assert!(
        !text.contains(r#"sluice_processor_requests_total{outcome="retried",processor="echo"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"sluice_processor_requests_total{outcome="error",processor="echo"} 0"#),
        "{text}"
    );
    f.shutdown.cancel();
    let _ = f.task.await;
}

/// A processor given the billing secret hands its handler a key only with the gateway's
/// seal of it; any other key is refused before the handler runs (nothing is called, so
/// nothing is billed), and counted. Without the secret a key is taken as it comes.
#[tokio::test]
async fn with_a_billing_secret_a_key_is_believed_only_with_the_gateways_seal() {
    use crate::{billing, secret::Secret};
    let secret = |s: &str| SealKey::new(&Secret::new(s), "test").unwrap();
    let ours = secret("billing-secret-of-this-test-0123456789");
    let theirs = secret("another-billing-secret-0123456789abcd");
    let mut config = ProcessorConfig::new("echo", "req", "resp");
    config.billing = Some(ours.clone());
    let mut f = start_with(config).await;
    let whose = r#"{"prompt":"whose-key"}"#;
    let team_a = billing::seal(&ours, "team-a", "gw-1");
    let out = ask_with(
        &mut f,
        Some("k1"),
        whose,
        &[
            (properties::KEY, "team-a"),
            (properties::KEY_SEAL, team_a.as_str()),
        ],
    )
    .await;
    assert_eq!(
        out[0].response,
        format!("Some(\"team-a\") Some({team_a:?})"),
        "sealed: believed, and the seal handed on as it came"
    );
    // A request that names no key bills none: taken as before.
    let out = ask_with(&mut f, Some("k2"), whose, &[]).await;
    assert_eq!(out[0].response, "None None");
    let forged = [
        ("unsealed", vec![(properties::KEY, "team-a".to_owned())]),
        (
            "another key's seal",
            vec![
                (properties::KEY, "team-b".to_owned()),
                (properties::KEY_SEAL, team_a.clone()),
            ],
        ),
        (
            "another secret's seal",
            vec![
                (properties::KEY, "team-a".to_owned()),
                (
                    properties::KEY_SEAL,
                    billing::seal(&theirs, "team-a", "gw-1"),
                ),
            ],
        ),
        (
            "a seal claimed for another request",
            vec![
                (properties::KEY, "team-a".to_owned()),
                (properties::KEY_SEAL, team_a.replace(":gw-1", ":gw-2")),
            ],
        ),
    ];
    for (i, (case, props)) in forged.iter().enumerate() {
        let props: Vec<(&str, &str)> = props.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let out = ask_with(&mut f, Some(&format!("f{i}")), whose, &props).await;
        assert_eq!(out.len(), 1, "{case}: {out:?}");
        let err = out[0]
            .error
            .as_ref()
            .unwrap_or_else(|| panic!("{case}: {out:?}"));
        assert_eq!(err.kind, "no-configuration", "{case}");
        assert!(
            err.message.contains("SLUICE_BILLING_SECRET")
                && !err.message.contains("billing-secret-of"),
            "{case}: {}",
            err.message
        );
    }
    let text = f.telemetry.render();
    for (reason, n) in [("unsealed", 1), ("bad-seal", 3)] {
        let line = format!(
            "sluice_processor_unverified_keys_total{{processor=\"echo\",reason=\"{reason}\"}} {n}"
        );
        assert!(text.contains(&line), "{line} in:\n{text}");
    }
    // No key's name becomes a label.
    assert!(!text.contains("team-a") && !text.contains("team-b"));
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();

    // Without the secret, a key is taken on the publisher's word (as before).
    let mut f = start().await;
    let out = ask_with(&mut f, Some("n1"), whose, &[(properties::KEY, "team-a")]).await;
    assert_eq!(out[0].response, "Some(\"team-a\") None");
    assert!(
        !f.telemetry
            .render()
            .contains("sluice_processor_unverified_keys_total")
    );
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();
}

// The clock is paused so that the wait for the early cancel to be read is exact: a
// sleep then ends only once every other task (the cancel listener too) is idle.
#[tokio::test(start_paused = true)]
async fn a_cancel_drops_the_handler_and_ends_the_stream_with_cancelled() {
    let mut f = start().await;
    let cancels = f.bus.publisher("cancel").await.unwrap();
    f.bus
        .publisher("req")
        .await
        .unwrap()
        .send(Message::new(r#"{"prompt":"hang"}"#).with_property(properties::ID, "h1"))
        .await
        .unwrap();
    let d = f.responses.next().await.unwrap().unwrap();
    let first: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
    d.ack();
    assert_eq!(first.response, "started");
    cancels.send(cancel::cancel_message("h1")).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(5), f.responses.next())
        .await
        .expect("the cancelled record")
        .unwrap()
        .unwrap();
    let last: TextCompletionResponse = serde_json::from_slice(d.payload()).unwrap();
    d.ack();
    assert!(last.end_of_stream);
    assert_eq!(last.error.unwrap().kind, "cancelled");
    assert_eq!(HANGS_DROPPED.load(std::sync::atomic::Ordering::SeqCst), 1);

    // A cancel that arrives before its request: the request is answered, not handled.
    cancels.send(cancel::cancel_message("early")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    let out = ask(&mut f, Some("early"), r#"{"prompt":"hang"}"#).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].error.as_ref().unwrap().kind, "cancelled");
    let text = f.telemetry.render();
    assert!(
        text.contains(r#"sluice_processor_requests_total{outcome="cancelled",processor="echo"} 2"#)
    );
    f.shutdown.cancel();
    f.task.await.unwrap().unwrap();
}
