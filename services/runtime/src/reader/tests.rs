//! The reader outside the driver's own tests (reader/drive/tests.rs): a request that cannot be
//! sent, and the records of the final attempt read whole.

use sluice_schema::{Error, ErrorKind, TextCompletionRequest, TextCompletionResponse, properties};

use super::*;
use crate::bus::{Bus, Message, memory::MemoryBus};
use crate::client::tests::setup;

/// Publishes a record of attempt `attempt` of request `id`.
async fn reply(bus: &MemoryBus, id: &str, attempt: &str, r: TextCompletionResponse) {
    bus.publisher("resp")
        .await
        .unwrap()
        .send(
            Message::new(serde_json::to_vec(&r).unwrap())
                .with_property(properties::ID, id)
                .with_property(properties::ATTEMPT, attempt),
        )
        .await
        .unwrap();
}

fn piece(text: &str, end: bool) -> TextCompletionResponse {
    TextCompletionResponse {
        response: text.to_owned(),
        end_of_stream: end,
        out_token: Some(1),
        ..Default::default()
    }
}

fn policy<P>(on_restart: P) -> ReadPolicy<P> {
    ReadPolicy::new(on_restart, |e| {
        e.to_error("text-completion", ErrorKind::Llm)
    })
}

fn restarted() -> Error {
    Error::new(ErrorKind::Llm, "restarted after part of it was passed on")
}

#[tokio::test]
async fn collect_keeps_the_records_of_the_final_attempt() {
    let (bus, _requests, client) = setup().await;
    let r = client
        .read(
            &TextCompletionRequest::default(),
            RequestOptions::default(),
            policy(StartOver(restarted())),
        )
        .await
        .map_err(|f| f.error)
        .unwrap();
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("abandoned", false)).await;
    reply(&bus, &id, "b", piece("whole", false)).await;
    reply(&bus, &id, "b", piece(" answer", true)).await;
    let records = r
        .drive(Collect::default())
        .run()
        .await
        .map_err(|f| f.error)
        .unwrap();
    let texts: Vec<&str> = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(texts, ["whole", " answer"]);
}

#[tokio::test]
async fn a_request_that_cannot_be_sent_fails_in_the_callers_words() {
    let (_bus, _requests, client) = setup().await;
    client.close().await;
    let f = client
        .read(
            &TextCompletionRequest::default(),
            RequestOptions::default(),
            policy(Report),
        )
        .await
        .err()
        .unwrap();
    assert!(matches!(f.client, Some(ClientError::Closed)));
    assert_eq!(f.error.kind, ErrorKind::Llm);
    assert!(
        f.error
            .message
            .starts_with("text-completion could not be reached"),
        "{}",
        f.error.message
    );
}
