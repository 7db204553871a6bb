//! The streamed routes on the in-process bus, through the router itself: what a caller sees of
//! a restart (the events' `restarted` status, TrustGraph's SSE `restarted` event, OpenAI's
//! starting over before its first chunk and its error after it), of a silence (OpenAI's
//! keep-alives, on tokio's paused clock), of going away (the cancel), and what each stream
//! counts. Text-completion is played by the test, each record under its attempt, so that a
//! restart is exact.

use std::time::Duration;

use axum::http::StatusCode;
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_schema::{Error, ErrorKind, ResponseRecord, TextCompletionResponse, properties};

use crate::testing::{Rig, body, lines, piece};

fn chat(stream: bool) -> Value {
    json!({"model": "routed", "stream": stream, "stream_options": {"include_usage": true},
           "messages": [{"role": "user", "content": "hi"}]})
}

/// The data of an OpenAI stream's events, as JSON (`[DONE]` as a string).
fn chunks(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| json!(d)))
        .collect()
}

const NDJSON: &[(&str, &str)] = &[("accept", "application/x-ndjson")];

/// A restart is a `restarted` status: the caller drops what it had, the new attempt is read
/// to its end, and the `done` event counts the new attempt's tokens only.
#[tokio::test]
async fn the_events_show_a_restart_and_read_the_new_attempt_to_its_end() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/api/v1/text-completion",
        NDJSON,
        json!({"system": "", "prompt": "hi"}),
    );
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("par", false)).await;
    rig.answer(&id, "a2", piece("full", false)).await;
    rig.answer(&id, "a2", piece(" answer", true)).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let events = lines(&body(resp).await);
    assert_eq!(
        shown(&events),
        [
            "<thinking>",
            "par",
            "<restarted>",
            "full",
            " answer",
            "<done success>"
        ]
    );
    let done = events.last().unwrap();
    assert_eq!(done["usage"], json!({"in_token": 4, "out_token": 2}));
    for e in &events {
        assert_eq!(e["session_id"], json!(id), "{e}");
        assert_eq!(e["trace_id"].as_str().unwrap().len(), 32, "{e}");
    }
    rig.stream_counted("text-completion", "success").await;
}

/// TrustGraph's streaming SSE: each record as an event's data, a restart as an event named
/// `restarted`, an error as the error record that ends the stream.
#[tokio::test]
async fn trustgraph_sse_shows_a_restart_as_its_own_event_and_ends_with_the_error_record() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/api/v1/text-completion",
        &[],
        json!({"system": "", "prompt": "hi", "streaming": true}),
    );
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("par", false)).await;
    rig.answer(&id, "a2", piece("full", false)).await;
    rig.answer(
        &id,
        "a2",
        TextCompletionResponse::from_error(Error::new(ErrorKind::Llm, "the provider broke")),
    )
    .await;
    let text = body(call.await.unwrap()).await;
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 4, "{text}");
    assert!(events[0].starts_with("data: {") && events[0].contains(r#""response":"par""#));
    assert_eq!(events[1], "event: restarted\ndata: {}");
    assert!(events[2].contains(r#""response":"full""#), "{text}");
    let last: Value = serde_json::from_str(events[3].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(
        last["error"],
        json!({"type": "llm-error", "message": "the provider broke"})
    );
    rig.stream_counted("text-completion", "error").await;
}

/// Nothing was sent when the first attempt is abandoned: OpenAI's stream starts over as if it
/// had not been, its usage the new attempt's.
#[tokio::test]
async fn openai_starts_over_a_restart_before_its_first_chunk() {
    let mut rig = Rig::start().await;
    let call = rig.post("/v1/chat/completions", &[], chat(true));
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    // A record that says nothing (usage only), then the new attempt.
    let mut silent = piece("", false);
    silent.in_token = Some(50);
    rig.answer(&id, "a1", silent).await;
    rig.answer(&id, "a2", piece("full", false)).await;
    rig.answer(&id, "a2", piece("", true)).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let chunks = chunks(&body(resp).await);
    assert_eq!(chunks.len(), 5, "{chunks:#?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[1]["choices"][0]["delta"]["content"], "full");
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        chunks[3]["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6})
    );
    assert_eq!(chunks[4], "[DONE]");
    rig.stream_counted("openai-chat", "success").await;
}

/// Once a chunk went out, a restart cannot be shown in OpenAI's stream: it ends with an error
/// event saying so, and no `[DONE]`.
#[tokio::test]
async fn openai_ends_an_answer_restarted_after_its_first_chunk_with_an_error_event() {
    let mut rig = Rig::start().await;
    let call = rig.post("/v1/chat/completions", &[], chat(true));
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("par", false)).await;
    rig.answer(&id, "a2", piece("full", true)).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let chunks = chunks(&body(resp).await);
    assert_eq!(chunks.len(), 3, "{chunks:#?}");
    assert_eq!(chunks[1]["choices"][0]["delta"]["content"], "par");
    assert_eq!(
        chunks[2],
        json!({"error": {
            "message": "the processor answering this request went away mid-answer and another \
                        started it over; the text so far is incomplete, send the request again",
            "type": "server_error", "param": null, "code": "gateway-error"}})
    );
    rig.stream_counted("openai-chat", "error").await;
}

/// An error before OpenAI's first chunk is an HTTP error with its status, and no stream is
/// counted; a whole answer reads the final attempt only.
#[tokio::test]
async fn openai_answers_an_early_error_with_its_status_and_a_whole_answer_with_the_final_attempt() {
    let mut rig = Rig::start().await;
    let call = rig.post("/v1/chat/completions", &[], chat(true));
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("", false)).await;
    rig.answer(
        &id,
        "a1",
        TextCompletionResponse::from_error(Error::new(ErrorKind::TooManyRequests, "slow down")),
    )
    .await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let error: Value = serde_json::from_str(&body(resp).await).unwrap();
    assert_eq!(error["error"]["message"], "slow down");
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");
    assert!(
        rig.shows(r#"sluice_gateway_open_streams{route="openai-chat"} 0"#)
            .await
    );

    let mut whole = chat(false);
    whole.as_object_mut().unwrap().remove("stream_options");
    let call = rig.post("/v1/chat/completions", &[], whole);
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("abandoned", false)).await;
    rig.answer(&id, "a2", piece("whole", false)).await;
    rig.answer(&id, "a2", piece(" answer", true)).await;
    let resp = call.await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let answer: Value = serde_json::from_str(&body(resp).await).unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], "whole answer");
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6})
    );
}

/// The next piece of a streamed body, as text (a piece is what one write of the gateway sent).
async fn next_piece(
    stream: &mut (impl futures::Stream<Item = Result<bytes::Bytes, axum::Error>> + Unpin),
) -> String {
    let piece = stream.next().await.expect("more body").unwrap();
    String::from_utf8(piece.to_vec()).unwrap()
}

/// On silence OpenAI's stream sends an SSE comment every 15 s, so proxies see traffic; the
/// answer then goes on where it was.
#[tokio::test(start_paused = true)]
async fn openai_sends_keep_alives_on_silence() {
    let mut rig = Rig::start().await;
    let call = rig.post("/v1/chat/completions", &[], chat(true));
    rig.serve_models().await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("par", false)).await;
    let resp = call.await.unwrap();
    let mut stream = resp.into_body().into_data_stream();
    let mut sent = String::new();
    while !sent.contains("par") {
        sent.push_str(&next_piece(&mut stream).await);
    }
    let before = tokio::time::Instant::now();
    assert_eq!(next_piece(&mut stream).await, ": keep-alive\n\n");
    assert_eq!(before.elapsed(), Duration::from_secs(15));
    assert_eq!(next_piece(&mut stream).await, ": keep-alive\n\n");
    rig.answer(&id, "a1", piece("", true)).await;
    let mut rest = String::new();
    while let Some(piece) = stream.next().await {
        rest.push_str(std::str::from_utf8(&piece.unwrap()).unwrap());
    }
    let rest = chunks(&rest);
    assert_eq!(rest[0]["choices"][0]["finish_reason"], "stop");
    assert_eq!(rest.last().unwrap(), "[DONE]");
}

/// A caller that goes away mid-answer stops the work: text-completion is sent a cancel, and
/// the stream is counted as cancelled.
#[tokio::test]
async fn a_caller_going_away_cancels_the_request_and_counts_the_stream_cancelled() {
    let mut rig = Rig::start().await;
    let call = rig.post(
        "/api/v1/text-completion",
        NDJSON,
        json!({"system": "", "prompt": "hi"}),
    );
    let (id, _) = rig.request().await;
    rig.answer(&id, "a1", piece("par", false)).await;
    let resp = call.await.unwrap();
    let mut stream = resp.into_body().into_data_stream();
    let mut sent = String::new();
    while !sent.contains("par") {
        sent.push_str(&next_piece(&mut stream).await);
    }
    drop(stream);
    let cancel = tokio::time::timeout(Duration::from_secs(10), rig.cancels.next())
        .await
        .expect("a cancel")
        .unwrap()
        .unwrap();
    assert_eq!(cancel.property(properties::ID), Some(id.as_str()));
    cancel.ack();
    rig.stream_counted("text-completion", "cancelled").await;
}

/// What the event protocol's own parser (seed 004's `pump()`) makes of a stream: it stops at
/// the first `done` (`onDone`) or `error` (`onError`), so the first of them is how the
/// stream reads to that client.
/// The events as a caller reads them: a status as `<status>`, a token as its text, any other
/// event as `<type reason>`.
fn shown(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "status" => format!("<{}>", e["status"].as_str().unwrap()),
            "token" => e["content"].as_str().unwrap().to_owned(),
            other => format!("<{other} {}>", e["reason"].as_str().unwrap_or("")),
        })
        .collect()
}

fn seed_004_reading(events: &[Value]) -> &str {
    events
        .iter()
        .find_map(|e| match e["type"].as_str() {
            Some("done") => Some("done"),
            Some("error") => Some("error"),
            _ => None,
        })
        .unwrap_or("nothing")
}

/// An answer cancelled while its caller still reads (another client of the request sent the
/// cancel) ends as the event protocol says a cancelled stream does: a `done` with reason
/// `cancelled`, no `error` before it, so the seed's parser reads it as an end and not as a
/// failure. A failure still reads as one: `error`, then `done` with reason `error`.
#[tokio::test]
async fn a_cancelled_answer_ends_with_done_cancelled_and_no_error_event() {
    let mut rig = Rig::start().await;
    for (kind, expected, reading) in [
        (
            ErrorKind::Cancelled,
            vec!["<thinking>", "par", "<done cancelled>"],
            "done",
        ),
        (
            ErrorKind::Llm,
            vec!["<thinking>", "par", "<error >", "<done error>"],
            "error",
        ),
    ] {
        let call = rig.post(
            "/api/v1/text-completion",
            NDJSON,
            json!({"system": "", "prompt": "hi"}),
        );
        let (id, _) = rig.request().await;
        rig.answer(&id, "a1", piece("par", false)).await;
        let end = TextCompletionResponse::from_error(Error::new(kind.clone(), "stopped"));
        rig.answer(&id, "a1", end).await;
        let events = lines(&body(call.await.unwrap()).await);
        assert_eq!(shown(&events), expected, "{kind:?}: {events:#?}");
        assert_eq!(seed_004_reading(&events), reading, "{kind:?}");
        let done = events.last().unwrap();
        assert_eq!(done["content"], Value::Null);
    }
    rig.stream_counted("text-completion", "cancelled").await;
}
