use sluice_schema::{Error, ErrorKind, TextCompletionRequest, TextCompletionResponse, properties};

use super::*;
use crate::bus::{Bus, Message, memory::MemoryBus};
use crate::client::tests::{Client, setup};

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

fn policy(on_restart: OnRestart) -> ReadPolicy {
    ReadPolicy {
        on_restart,
        client_error: |e| e.to_error("text-completion", ErrorKind::Llm),
    }
}

fn restarted() -> Error {
    Error::new(ErrorKind::Llm, "restarted after part of it was passed on")
}

/// What a reader gives, one word per piece.
async fn read_all(reader: &mut Reader<TextCompletionResponse>) -> Vec<String> {
    let mut seen = Vec::new();
    while let Some(p) = reader.next().await {
        seen.push(match p {
            Piece::Record(r) if r.end_of_stream => format!("{}.", r.response),
            Piece::Record(r) => r.response,
            Piece::Restarted => "<restarted>".to_owned(),
            Piece::Failed(f) => format!("<failed {}: {}>", f.error.kind.as_str(), f.error.message),
        });
    }
    seen
}

async fn reader(client: &Client, on_restart: OnRestart) -> Reader<TextCompletionResponse> {
    client
        .read(
            &TextCompletionRequest::default(),
            RequestOptions::default(),
            policy(on_restart),
        )
        .await
        .map_err(|f| f.error)
        .unwrap()
}

#[tokio::test]
async fn report_passes_a_restart_on_and_reads_the_new_attempt_to_its_end() {
    let (bus, _requests, client) = setup().await;
    let mut r = reader(&client, OnRestart::Report).await;
    reply(&bus, r.id(), "a", piece("par", false)).await;
    reply(&bus, r.id(), "b", piece("full", false)).await;
    reply(&bus, r.id(), "b", piece(" answer", true)).await;
    r.commit();
    assert_eq!(
        read_all(&mut r).await,
        ["par", "<restarted>", "full", " answer."]
    );
}

#[tokio::test]
async fn start_over_restarts_until_something_was_passed_on_then_fails() {
    let (bus, _requests, client) = setup().await;
    let mut r = reader(&client, OnRestart::StartOver(restarted())).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("par", false)).await;
    reply(&bus, &id, "b", piece("full", false)).await;
    reply(&bus, &id, "c", piece("again", false)).await;
    assert!(matches!(r.next().await, Some(Piece::Record(p)) if p.response == "par"));
    // Nothing passed on yet: the caller starts over.
    assert!(matches!(r.next().await, Some(Piece::Restarted)));
    assert!(matches!(r.next().await, Some(Piece::Record(p)) if p.response == "full"));
    r.commit();
    assert_eq!(
        read_all(&mut r).await,
        ["<failed llm-error: restarted after part of it was passed on>"]
    );
}

#[tokio::test]
async fn fail_ends_the_stream_at_the_first_restart() {
    let (bus, _requests, client) = setup().await;
    let mut r = reader(&client, OnRestart::Fail(restarted())).await;
    reply(&bus, r.id(), "a", piece("par", false)).await;
    reply(&bus, r.id(), "b", piece("full", true)).await;
    assert_eq!(
        read_all(&mut r).await,
        [
            "par",
            "<failed llm-error: restarted after part of it was passed on>"
        ]
    );
}

#[tokio::test]
async fn an_error_record_fails_the_stream_and_keeps_its_usage() {
    let (bus, _requests, client) = setup().await;
    let mut r = reader(&client, OnRestart::Report).await;
    let mut failed =
        TextCompletionResponse::from_error(Error::new(ErrorKind::TooManyRequests, "rate limited"));
    failed.in_token = Some(7);
    reply(&bus, r.id(), "a", failed).await;
    let Some(Piece::Failed(f)) = r.next().await else {
        panic!("not a failure");
    };
    assert_eq!(f.error.kind, ErrorKind::TooManyRequests);
    assert_eq!(f.record.and_then(|r| r.in_token), Some(7));
    assert!(f.client.is_none());
    assert!(
        r.next().await.is_none(),
        "a failure is the stream's last piece"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_side_failure_is_an_error_record_in_the_callers_words() {
    let (bus, _requests, client) = setup().await;
    let mut r = reader(&client, OnRestart::Report).await;
    reply(&bus, r.id(), "a", piece("par", false)).await;
    assert!(matches!(r.next().await, Some(Piece::Record(_))));
    // Silence past the inactivity timeout.
    let Some(Piece::Failed(f)) = r.next().await else {
        panic!("not a failure");
    };
    assert_eq!(f.error.kind, ErrorKind::Timeout);
    assert!(
        f.error
            .message
            .starts_with("text-completion did not answer in time"),
        "{}",
        f.error.message
    );
    assert!(matches!(f.client, Some(ClientError::InactivityTimeout(_))));
    assert!(r.next().await.is_none());
}

#[tokio::test]
async fn collect_keeps_the_final_attempt_and_last_its_terminal_record() {
    let (bus, _requests, client) = setup().await;
    let r = reader(&client, OnRestart::StartOver(restarted())).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("abandoned", false)).await;
    reply(&bus, &id, "b", piece("whole", false)).await;
    reply(&bus, &id, "b", piece(" answer", true)).await;
    let records = r.collect().await.map_err(|f| f.error).unwrap();
    let texts: Vec<&str> = records.iter().map(|r| r.response.as_str()).collect();
    assert_eq!(texts, ["whole", " answer"]);

    let r = reader(&client, OnRestart::Report).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("first", false)).await;
    reply(&bus, &id, "a", piece("end", true)).await;
    let last = r.last().await.map_err(|f| f.error).unwrap();
    assert_eq!(last.response, "end");

    let r = reader(&client, OnRestart::Report).await;
    let id = r.id().to_owned();
    reply(
        &bus,
        &id,
        "a",
        TextCompletionResponse::from_error(Error::new(ErrorKind::Llm, "refused")),
    )
    .await;
    let f = r.last().await.err().unwrap();
    assert_eq!(f.error.message, "refused");
}

#[tokio::test]
async fn a_request_that_cannot_be_sent_fails_in_the_callers_words() {
    let (_bus, _requests, client) = setup().await;
    client.close().await;
    let f = client
        .read(
            &TextCompletionRequest::default(),
            RequestOptions::default(),
            policy(OnRestart::Report),
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
