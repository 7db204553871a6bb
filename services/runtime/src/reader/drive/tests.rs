//! The driver on the in-process bus: each restart policy, each way an answer ends, the pulled
//! form's keep-alives and start, and the helpers. Time is tokio's paused clock wherever a
//! time limit is involved.

use std::time::Duration;

use sluice_schema::{
    Error, ErrorKind, TextCompletionRequest, TextCompletionResponse, ToolCallDelta, properties,
};

use super::*;
use crate::{
    bus::{Bus, Message, memory::MemoryBus},
    client::{RequestOptions, tests::Client, tests::setup},
    reader::{Fail, ReadPolicy, Report, StartOver, Whole},
};

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

fn restarted() -> Error {
    Error::new(ErrorKind::Llm, "restarted after part of it was passed on")
}

fn policy<P>(on_restart: P) -> ReadPolicy<P> {
    ReadPolicy::new(on_restart, |e| {
        e.to_error("text-completion", ErrorKind::Llm)
    })
}

async fn reader<P>(
    client: &Client,
    on_restart: P,
    options: RequestOptions,
) -> Reader<TextCompletionResponse, P> {
    client
        .read(
            &TextCompletionRequest::default(),
            options,
            policy(on_restart),
        )
        .await
        .map_err(|f| f.error)
        .unwrap()
}

/// Writes down what it is told, a word each, and emits a record's text when it starts with
/// `>`; what it handed out, and whether as the last.
#[derive(Default)]
struct Script {
    seen: Vec<String>,
    handed: Vec<(String, bool)>,
    /// Emitted by `begin`.
    preamble: Option<&'static str>,
}

fn ending(end: End<TextCompletionResponse>) -> String {
    match end {
        End::Answered => "<answered>".to_owned(),
        End::Failed(f) => {
            let usage = f.record.and_then(|r| r.in_token).unwrap_or(0);
            format!(
                "<failed {}: {} (usage {usage})>",
                f.error.kind.as_str(),
                f.error.message
            )
        }
        End::Deadline(f) => format!("<deadline {}>", f.error.message),
    }
}

impl Encoder<TextCompletionResponse> for Script {
    type Item = String;
    type Done = Vec<String>;

    fn begin(&mut self, out: &mut Out<String>) {
        if let Some(p) = self.preamble {
            out.push(p.to_owned());
        }
    }

    fn record(&mut self, r: TextCompletionResponse, out: &mut Out<String>) {
        let word = if r.end_of_stream {
            format!("{}.", r.response)
        } else {
            r.response.clone()
        };
        self.seen.push(word);
        if r.response.starts_with('>') {
            out.push(r.response);
        }
    }

    fn end(&mut self, end: End<TextCompletionResponse>, _: &mut Out<String>) -> Vec<String> {
        self.seen.push(ending(end));
        std::mem::take(&mut self.seen)
    }

    fn handed(&mut self, item: &mut String, last: bool) {
        self.handed.push((item.clone(), last));
    }
}

impl Restartable<TextCompletionResponse> for Script {
    fn restarted(&mut self, _: &mut Out<String>) {
        self.seen.push("<restarted>".to_owned());
    }
}

/// [`Script`] without a restart: all a reader under [`Fail`] needs.
#[derive(Default)]
struct Strict(Script);

impl Encoder<TextCompletionResponse> for Strict {
    type Item = String;
    type Done = Vec<String>;

    fn record(&mut self, r: TextCompletionResponse, out: &mut Out<String>) {
        self.0.record(r, out);
    }

    fn end(&mut self, end: End<TextCompletionResponse>, out: &mut Out<String>) -> Vec<String> {
        self.0.end(end, out)
    }
}

/// A sink keeping what it is sent.
#[derive(Default)]
struct Kept(Vec<String>);

impl Emit<String> for Kept {
    type Error = Infallible;

    fn emit(&mut self, item: String) -> impl Future<Output = Result<(), Infallible>> + Send {
        self.0.push(item);
        async { Ok(()) }
    }
}

#[tokio::test]
async fn report_gives_each_restart_to_the_encoder_and_reads_on() {
    let (bus, _requests, client) = setup().await;
    let r = reader(&client, Report, RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece(">par", false)).await;
    reply(&bus, &id, "b", piece(">full", false)).await;
    reply(&bus, &id, "c", piece("again", false)).await;
    reply(&bus, &id, "c", piece(" answer", true)).await;
    let mut sent = Kept::default();
    let done = r.drive(Script::default()).send_to(&mut sent).await;
    let Ok(seen) = done;
    assert_eq!(
        seen,
        [
            ">par",
            "<restarted>",
            ">full",
            "<restarted>",
            "again",
            " answer.",
            "<answered>"
        ]
    );
    assert_eq!(sent.0, [">par", ">full"]);
}

#[tokio::test]
async fn start_over_gives_a_restart_until_the_encoder_emitted_then_ends_with_its_error() {
    let (bus, _requests, client) = setup().await;
    let r = reader(&client, StartOver(restarted()), RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("par", false)).await;
    reply(&bus, &id, "b", piece(">full", false)).await;
    reply(&bus, &id, "c", piece("again", true)).await;
    let mut sent = Kept::default();
    let Ok(seen) = r.drive(Script::default()).send_to(&mut sent).await;
    assert_eq!(
        seen,
        [
            "par",
            // Nothing emitted yet: the encoder starts over.
            "<restarted>",
            ">full",
            "<failed llm-error: restarted after part of it was passed on (usage 0)>"
        ]
    );
    assert_eq!(sent.0, [">full"]);

    // What `begin` emits was passed on as well.
    let r = reader(&client, StartOver(restarted()), RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("par", false)).await;
    reply(&bus, &id, "b", piece("full", true)).await;
    let script = Script {
        preamble: Some("thinking"),
        ..Script::default()
    };
    let mut sent = Kept::default();
    let Ok(seen) = r.drive(script).send_to(&mut sent).await;
    assert_eq!(
        seen,
        [
            "par",
            "<failed llm-error: restarted after part of it was passed on (usage 0)>"
        ]
    );
    assert_eq!(sent.0, ["thinking"]);
}

#[tokio::test]
async fn fail_ends_the_answer_at_the_first_restart_with_an_encoder_that_knows_none() {
    let (bus, _requests, client) = setup().await;
    let r = reader(&client, Fail(restarted()), RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("par", false)).await;
    reply(&bus, &id, "b", piece("full", true)).await;
    let Ok(seen) = r
        .drive(Strict::default())
        .send_to(&mut Kept::default())
        .await;
    assert_eq!(
        seen,
        [
            "par",
            "<failed llm-error: restarted after part of it was passed on (usage 0)>"
        ]
    );
}

/// A meter that counts into a shared cell.
struct Counted(std::sync::Arc<std::sync::Mutex<(u64, bool)>>);

impl super::super::Meter for Counted {
    fn tokens(&mut self, input: u64, _: u64) {
        crate::lock(&self.0).0 += input;
    }

    fn ended(&mut self) {
        crate::lock(&self.0).1 = true;
    }
}

#[tokio::test]
async fn an_error_record_ends_the_answer_with_its_usage_and_is_metered() {
    let (bus, _requests, client) = setup().await;
    let mut r = reader(&client, Report, RequestOptions::default()).await;
    let counts = std::sync::Arc::default();
    r.meter(Box::new(Counted(std::sync::Arc::clone(&counts))));
    let id = r.id().to_owned();
    let mut first = piece("par", false);
    first.in_token = Some(2);
    reply(&bus, &id, "a", first).await;
    let mut failed =
        TextCompletionResponse::from_error(Error::new(ErrorKind::TooManyRequests, "rate limited"));
    failed.in_token = Some(7);
    reply(&bus, &id, "a", failed).await;
    let Ok(seen) = r
        .drive(Script::default())
        .send_to(&mut Kept::default())
        .await;
    assert_eq!(
        seen,
        ["par", "<failed too-many-requests: rate limited (usage 7)>"],
        "the error record is the failure's, never a record"
    );
    assert_eq!(*crate::lock(&counts), (9, true));
}

#[tokio::test(start_paused = true)]
async fn the_callers_own_deadline_is_an_end_of_its_own_and_silence_a_failure() {
    let (bus, _requests, client) = setup().await;
    let options = RequestOptions {
        total_timeout: Some(Duration::from_secs(2)),
        inactivity_timeout: Some(Duration::from_secs(60)),
        ..RequestOptions::default()
    };
    let r = reader(&client, Fail(restarted()), options).await;
    reply(&bus, r.id(), "a", piece("par", false)).await;
    let Ok(seen) = r
        .drive(Strict::default())
        .send_to(&mut Kept::default())
        .await;
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0], "par");
    assert!(
        seen[1].starts_with("<deadline text-completion did not answer in time: "),
        "{}",
        seen[1]
    );

    // The client's inactivity limit is a failure like any other, in the caller's words.
    let r = reader(&client, Fail(restarted()), RequestOptions::default()).await;
    let Ok(seen) = r
        .drive(Strict::default())
        .send_to(&mut Kept::default())
        .await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        seen[0].starts_with("<failed timeout: text-completion did not answer in time: "),
        "{}",
        seen[0]
    );
}

#[tokio::test]
async fn a_stream_ending_without_its_terminal_record_fails_in_the_callers_words() {
    let (_bus, _requests, client) = setup().await;
    let r = reader(&client, Report, RequestOptions::default()).await;
    client.close().await;
    let Ok(seen) = r
        .drive(Script::default())
        .send_to(&mut Kept::default())
        .await;
    assert_eq!(
        seen,
        [
            "<failed llm-error: text-completion could not be reached: the client is closed (usage 0)>"
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn pulled_items_come_in_order_with_keep_alives_on_silence_and_the_last_marked() {
    let (bus, _requests, client) = setup().await;
    let options = RequestOptions {
        inactivity_timeout: Some(Duration::from_secs(60)),
        ..RequestOptions::default()
    };
    let r = reader(&client, Report, options).await;
    let id = r.id().to_owned();
    let script = Script {
        preamble: Some("thinking"),
        ..Script::default()
    };
    let mut driven = r
        .drive(script)
        .keep_alive(Duration::from_secs(15), || ": keep-alive".to_owned());
    assert_eq!(driven.next().await.as_deref(), Some("thinking"));
    // Nothing arrives: the paused clock runs to the keep-alive.
    assert_eq!(driven.next().await.as_deref(), Some(": keep-alive"));
    reply(&bus, &id, "a", piece(">one", false)).await;
    reply(&bus, &id, "a", piece("quiet", false)).await;
    reply(&bus, &id, "a", piece(">two", true)).await;
    assert_eq!(driven.next().await.as_deref(), Some(">one"));
    assert_eq!(driven.next().await.as_deref(), Some(">two"));
    assert_eq!(driven.next().await, None);
    assert_eq!(driven.next().await, None, "an ended stream stays ended");
    assert_eq!(
        driven.encoder_mut().handed,
        [
            ("thinking".to_owned(), false),
            (">one".to_owned(), false),
            (">two".to_owned(), true)
        ],
        "keep-alives are not the encoder's; only the answer's last item is the last"
    );
}

#[tokio::test]
async fn start_waits_for_the_first_item_or_gives_the_end_of_an_answer_that_emitted_none() {
    let (bus, _requests, client) = setup().await;
    let r = reader(&client, StartOver(restarted()), RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("quiet", false)).await;
    reply(&bus, &id, "a", piece(">first", false)).await;
    reply(&bus, &id, "a", piece(">last", true)).await;
    let Ok(driven) = r.drive(Script::default()).start().await else {
        panic!("the answer started");
    };
    let items: Vec<String> = futures::StreamExt::collect(driven.into_stream()).await;
    assert_eq!(items, [">first", ">last"]);

    let r = reader(&client, StartOver(restarted()), RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("quiet", false)).await;
    reply(
        &bus,
        &id,
        "a",
        TextCompletionResponse::from_error(Error::new(ErrorKind::Llm, "refused")),
    )
    .await;
    let Err(seen) = r.drive(Script::default()).start().await else {
        panic!("nothing was emitted");
    };
    assert_eq!(seen, ["quiet", "<failed llm-error: refused (usage 0)>"]);
}

#[tokio::test]
async fn a_sink_that_fails_stops_the_run_at_once() {
    let (bus, _requests, client) = setup().await;
    let r = reader(&client, Report, RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece(">one", false)).await;
    reply(&bus, &id, "a", piece(">two", true)).await;
    let (mut tx, rx) = tokio::sync::mpsc::channel::<String>(4);
    drop(rx);
    let failed = r.drive(Script::default()).send_to(&mut tx).await;
    let Err(unsent) = failed else {
        panic!("the caller went away");
    };
    assert_eq!(
        unsent.0, ">one",
        "nothing is read past the first item not sent"
    );
}

#[tokio::test]
async fn the_helpers_read_the_final_attempt_whole() {
    let (bus, _requests, client) = setup().await;
    let r = reader(&client, Report, RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("abandoned", false)).await;
    let call = |id: Option<&str>, name: Option<&str>, arguments: &str| ToolCallDelta {
        index: 0,
        id: id.map(str::to_owned),
        name: name.map(str::to_owned),
        arguments: arguments.to_owned(),
    };
    let mut calling = piece("Let me", false);
    calling.tool_calls = vec![call(Some("c1"), Some("add"), "{\"a\":")];
    calling.in_token = Some(5);
    calling.model = Some("m1".into());
    reply(&bus, &id, "b", calling).await;
    let mut last = piece(" add.", true);
    last.tool_calls = vec![call(None, None, "2}")];
    last.finish_reason = Some("tool_calls".into());
    reply(&bus, &id, "b", last).await;
    let Whole {
        text,
        usage,
        finish_reason,
        ..
    } = r.whole().await.map_err(|f| f.error).unwrap();
    assert_eq!(text, "Let me add.");
    assert_eq!(
        (usage.in_token, usage.out_token, usage.model.as_deref()),
        (Some(5), Some(2), Some("m1")),
        "the final attempt's usage"
    );
    assert_eq!(finish_reason.as_deref(), Some("tool_calls"));

    let r = reader(&client, Report, RequestOptions::default()).await;
    let id = r.id().to_owned();
    let mut calling = piece("", false);
    calling.tool_calls = vec![call(Some("c1"), Some("add"), "{\"a\":")];
    reply(&bus, &id, "a", calling).await;
    let mut last = piece("", true);
    last.tool_calls = vec![call(None, None, "2}")];
    reply(&bus, &id, "a", last).await;
    let whole = r.whole().await.map_err(|f| f.error).unwrap();
    let calls = whole.tool_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (
            calls[0].id.as_str(),
            calls[0].name.as_str(),
            calls[0].arguments.as_str()
        ),
        ("c1", "add", "{\"a\":2}")
    );

    let r = reader(&client, Fail(restarted()), RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("one", false)).await;
    reply(&bus, &id, "a", piece(" two", true)).await;
    assert_eq!(r.text().await.map_err(|f| f.error).unwrap(), "one two");

    let r = reader(&client, Fail(restarted()), RequestOptions::default()).await;
    let id = r.id().to_owned();
    reply(&bus, &id, "a", piece("one", false)).await;
    reply(&bus, &id, "b", piece("two", true)).await;
    let f = r.last().await.err().unwrap();
    assert_eq!(f.error, restarted());
    assert!(f.record.is_none() && f.client.is_none());
}
