//! The prompt handler's behaviour on the in-process bus, with text-completion played by the
//! test: it reads the requests the prompt service sends and answers them record by record,
//! under attempt ids of its choosing, so restarts, errors and silence are exact.

use std::time::Duration;

use sluice_runtime::{
    bus::{Bus, memory::MemoryBus},
    client::{ClientConfig, Received, ResponseStream},
    processor::{self, ProcessorConfig},
    telemetry::Telemetry,
    testkit::ServiceStub,
};
use sluice_schema::{ErrorKind, PromptRequest, ResponseRecord};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::templates::TemplateSet;

const TEMPLATES: &str = r#"{
    "templates": {
        "say": {"prompt": "Say {{ what }}"},
        "facts": {"prompt": "Facts about {{ topic }}", "response-type": "jsonl",
                  "schema": {"type": "object", "required": ["fact"],
                             "properties": {"fact": {"type": "string"}}}},
        "one": {"prompt": "One object about {{ topic }}", "response-type": "json"},
        "warm": {"prompt": "Warm {{ x }}", "temperature": 0.7, "max-tokens": 64, "retry": "seed-002,attempts=2"}
    }
}"#;

/// The prompt processor on the in-process bus, text-completion's side held by the test.
struct Rig {
    /// Text-completion, as the prompt service sees it.
    llm: ServiceStub,
    prompt: RequestClient<PromptRequest, PromptResponse>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), sluice_runtime::bus::BusError>>,
}

impl Rig {
    /// `inactivity`: how long the prompt service waits for a text-completion record.
    async fn start(inactivity: Duration) -> Rig {
        let bus = MemoryBus::new(1 << 20, 1000);
        let shared: Arc<dyn Bus> = Arc::new(bus.clone());
        let telemetry = Telemetry::new().unwrap();
        let llm_stub = ServiceStub::start(&bus, "tc-req", "tc-resp").await;
        let mut llm = ClientConfig::new("text-completion", "tc-req", "tc-resp");
        llm.inactivity_timeout = inactivity;
        let llm = RequestClient::start(shared.clone(), llm, None)
            .await
            .unwrap();
        let metrics = PromptMetrics::register(&telemetry.registry).unwrap();
        let store = TemplateStore::with_metrics(
            TemplateSet::from_json(TEMPLATES, false).unwrap(),
            metrics.clone(),
        );
        let service = PromptService::new(store, Arc::new(llm), metrics);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(processor::run(
            shared.clone(),
            ProcessorConfig::new("prompt", "p-req", "p-resp"),
            Arc::new(service),
            telemetry.clone(),
            shutdown.clone(),
        ));
        tokio::time::timeout(Duration::from_secs(10), telemetry.health.until_watched(1))
            .await
            .expect("the prompt processor subscribes");
        let prompt =
            RequestClient::start(shared, ClientConfig::new("prompt", "p-req", "p-resp"), None)
                .await
                .unwrap();
        Rig {
            llm: llm_stub,
            prompt,
            shutdown,
            task,
        }
    }

    async fn ask(
        &self,
        template: &str,
        terms: &[(&str, &str)],
        streaming: bool,
    ) -> ResponseStream<PromptResponse> {
        let request = PromptRequest {
            id: template.to_owned(),
            terms: terms
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            streaming,
        };
        self.prompt.request(&request).await.unwrap()
    }

    /// The next request the prompt service sent to text-completion, and its id.
    async fn llm_request(&mut self) -> (String, TextCompletionRequest) {
        self.llm.request().await
    }

    /// Publishes text-completion's record `r` for request `id`, as attempt `attempt`.
    async fn answer(&self, id: &str, attempt: &str, r: TextCompletionResponse) {
        self.llm.answer(id, attempt, &r).await;
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }
}

fn piece(text: &str) -> TextCompletionResponse {
    TextCompletionResponse {
        response: text.to_owned(),
        model: Some("m".into()),
        ..TextCompletionResponse::default()
    }
}

fn last(text: &str, in_token: u64, out_token: u64) -> TextCompletionResponse {
    TextCompletionResponse {
        response: text.to_owned(),
        in_token: Some(in_token),
        out_token: Some(out_token),
        model: Some("m".into()),
        end_of_stream: true,
        ..TextCompletionResponse::default()
    }
}

/// Every record of a stream, restarts marked as `None`.
async fn records(mut stream: ResponseStream<PromptResponse>) -> Vec<Option<PromptResponse>> {
    let mut out = Vec::new();
    while let Some(item) = stream.next().await {
        match item.unwrap() {
            Received::Record(r) => out.push(Some(r)),
            Received::Restarted => out.push(None),
        }
    }
    out
}

/// A text template streams the model's pieces as they come, rendered with the request's
/// terms, and ends with the usage the model reported.
#[tokio::test]
async fn a_text_answer_streams_its_pieces_and_ends_with_the_usage() {
    let mut rig = Rig::start(Duration::from_secs(30)).await;
    let stream = rig.ask("say", &[("what", "hello")], true).await;
    let (id, request) = rig.llm_request().await;
    assert_eq!(request.prompt, "Say hello");
    assert!(request.streaming);
    rig.answer(&id, "a1", piece("Hel")).await;
    rig.answer(&id, "a1", piece("lo")).await;
    rig.answer(&id, "a1", last("", 3, 2)).await;
    let got: Vec<PromptResponse> = records(stream).await.into_iter().flatten().collect();
    let texts: Vec<_> = got.iter().map(|r| r.text.as_deref()).collect();
    assert_eq!(texts, [Some("Hel"), Some("lo"), Some("")]);
    let end = got.last().unwrap();
    assert!(end.end_of_stream && end.error.is_none());
    let in_total: u64 = got.iter().filter_map(|r| r.in_token).sum();
    let out_total: u64 = got.iter().filter_map(|r| r.out_token).sum();
    assert_eq!((in_total, out_total), (3, 2));
    rig.stop().await;
}

/// Text-completion starting its answer over before anything was published is absorbed:
/// the caller sees one clean answer. After something was published it cannot be taken
/// back, so the answer ends with an error saying to send the request again.
#[tokio::test]
async fn a_restart_is_absorbed_before_the_first_record_and_an_error_after() {
    let mut rig = Rig::start(Duration::from_secs(30)).await;
    // json: nothing is published before the whole answer, so a restart is absorbed.
    let stream = rig.ask("one", &[("topic", "x")], false).await;
    let (id, _) = rig.llm_request().await;
    rig.answer(&id, "a1", piece(r#"{"half":"#)).await;
    rig.answer(&id, "a2", piece(r#"{"whole": true}"#)).await;
    rig.answer(&id, "a2", last("", 1, 1)).await;
    let got = records(stream).await;
    assert_eq!(got.len(), 1, "{got:?}");
    let end = got[0].as_ref().unwrap();
    assert_eq!(end.object.as_deref(), Some(r#"{"whole":true}"#), "{end:?}");

    // text, streamed: the first piece went out, then the restart.
    let stream = rig.ask("say", &[("what", "x")], true).await;
    let (id, _) = rig.llm_request().await;
    rig.answer(&id, "b1", piece("first")).await;
    rig.answer(&id, "b2", piece("again")).await;
    let got: Vec<PromptResponse> = records(stream).await.into_iter().flatten().collect();
    assert_eq!(got[0].text.as_deref(), Some("first"));
    let end = got.last().unwrap();
    let error = end.error.as_ref().expect("an error ends the stream");
    assert_eq!(error.kind, ErrorKind::Llm);
    assert!(error.message.contains("send the request again"), "{error}");
    rig.stop().await;
}

/// jsonl: objects go out as their lines complete, a line that is not JSON or breaks the
/// schema is skipped and counted, and the terminal record carries both counts.
#[tokio::test]
async fn jsonl_objects_stream_as_lines_complete_and_bad_lines_are_counted() {
    let mut rig = Rig::start(Duration::from_secs(30)).await;
    let stream = rig.ask("facts", &[("topic", "tea")], true).await;
    let (id, request) = rig.llm_request().await;
    assert!(request.streaming, "jsonl is always streamed from the model");
    rig.answer(&id, "a1", piece("{\"fact\": \"gr")).await;
    rig.answer(&id, "a1", piece("een\"}\nnot json\n{\"other\": 1}\n"))
        .await;
    rig.answer(&id, "a1", last("{\"fact\": \"black\"}", 5, 9))
        .await;
    let got: Vec<PromptResponse> = records(stream).await.into_iter().flatten().collect();
    let objects: Vec<_> = got.iter().filter_map(|r| r.object.as_deref()).collect();
    assert_eq!(objects, [r#"{"fact":"green"}"#, r#"{"fact":"black"}"#]);
    let end = got.last().unwrap();
    assert!(end.end_of_stream && end.error.is_none(), "{end:?}");
    assert_eq!((end.objects_emitted, end.lines_skipped), (Some(2), Some(2)));
    // TrustGraph 2.11's readers of a streamed prompt (tg-invoke-prompt) read `text` alone:
    // each object's record carries its line there too, so they print the JSON lines.
    let text: String = got.iter().filter_map(|r| r.text.as_deref()).collect();
    assert_eq!(text, "{\"fact\":\"green\"}\n{\"fact\":\"black\"}\n");
    assert!(
        got.iter()
            .all(|r| r.object.is_some() == r.text.as_deref().is_some_and(|t| !t.is_empty())),
        "text on the object records only: {got:#?}"
    );
    rig.stop().await;
}

/// A streamed `json` answer is one record, as TrustGraph's streaming spec's design decision 4
/// allows ("the complete JSON in a single response with `end_of_stream=true`"); it carries the
/// JSON in `text` too, the field TrustGraph 2.11 streams a `json` template's answer in and the
/// only one its streaming readers read. Not streamed: `object` alone, as TrustGraph answers.
#[tokio::test]
async fn a_streamed_json_answer_is_one_record_with_its_json_in_text_too() {
    let mut rig = Rig::start(Duration::from_secs(30)).await;
    for streaming in [true, false] {
        let stream = rig.ask("one", &[("topic", "tea")], streaming).await;
        let (id, _) = rig.llm_request().await;
        rig.answer(&id, "a1", piece("```json\n{\"fact\": ")).await;
        rig.answer(&id, "a1", last("\"green\"}\n```", 5, 9)).await;
        let got: Vec<PromptResponse> = records(stream).await.into_iter().flatten().collect();
        assert_eq!(got.len(), 1, "one record: {got:#?}");
        let r = &got[0];
        assert!(r.end_of_stream && r.error.is_none(), "{r:?}");
        assert_eq!(r.object.as_deref(), Some(r#"{"fact":"green"}"#));
        let text = streaming.then_some(r#"{"fact":"green"}"#);
        assert_eq!(r.text.as_deref(), text, "streaming {streaming}");
    }
    rig.stop().await;
}

/// An unknown template is the caller's mistake, said at once, and text-completion is never
/// called; a text-completion error is passed on with its kind.
#[tokio::test]
async fn an_unknown_template_and_a_model_error_end_the_stream_with_their_kind() {
    let mut rig = Rig::start(Duration::from_secs(30)).await;
    let got = records(rig.ask("nope", &[], true).await).await;
    let error = got[0].as_ref().unwrap().error.clone().unwrap();
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert!(
        error.message.contains("unknown template \"nope\""),
        "{error}"
    );

    let stream = rig.ask("say", &[("what", "x")], true).await;
    let (id, _) = rig.llm_request().await;
    rig.answer(
        &id,
        "a1",
        TextCompletionResponse::from_error(Error::new(ErrorKind::TooManyRequests, "slow down")),
    )
    .await;
    let got = records(stream).await;
    let error = got[0].as_ref().unwrap().error.clone().unwrap();
    assert_eq!(
        (error.kind, error.message.as_str()),
        (ErrorKind::TooManyRequests, "slow down")
    );
    assert!(
        rig.llm.no_request_waiting(),
        "text-completion was asked once only"
    );
    rig.stop().await;
}

/// Text-completion saying nothing for the inactivity timeout ends the answer with a
/// `timeout` error naming it (the clock is tokio's, paused: no real wait).
#[tokio::test(start_paused = true)]
async fn text_completion_saying_nothing_ends_the_answer_with_a_timeout() {
    let mut rig = Rig::start(Duration::from_secs(45)).await;
    let stream = rig.ask("say", &[("what", "x")], true).await;
    let _ = rig.llm_request().await;
    let got = records(stream).await;
    let error = got[0].as_ref().unwrap().error.clone().unwrap();
    assert_eq!(error.kind, ErrorKind::Timeout);
    assert!(
        error
            .message
            .starts_with("text-completion did not answer in time"),
        "{error}"
    );
    rig.stop().await;
}

/// A schema failure is described by where and which rule, never by the model's value: the
/// same words go to the log and to the error record, and logs never carry content.
#[test]
fn a_schema_problem_never_quotes_the_value() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "confidence": {"type": "number", "maximum": 5},
            "label": {"type": "string"},
            "kind": {"enum": ["a", "b"]},
            "text": {"type": "string", "minLength": 1, "pattern": "^[a-z]+$"}
        },
        "required": ["confidence", "needed"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&schema).unwrap();
    let value = serde_json::json!({
        "confidence": 7.25, "label": 12345, "kind": "zzz-secret-kind",
        "text": "SECRET", "leaked-key-name": "s3cr3t"
    });
    let problems: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| sluice_runtime::json_schema::problem(&e))
        .collect();
    assert!(problems.len() >= 5, "{problems:?}");
    for p in &problems {
        for content in [
            "7.25",
            "12345",
            "zzz-secret-kind",
            "SECRET",
            "s3cr3t",
            "leaked-key-name",
        ] {
            assert!(!p.contains(content), "{p:?} quotes {content:?}");
        }
    }
    let all = problems.join("; ");
    for says in [
        "/confidence is greater than the maximum of 5",
        "/label is not of type string",
        r#"/kind is not one of ["a","b"]"#,
        r#"/text does not match the pattern "^[a-z]+$""#,
        r#"/ lacks the required property "needed""#,
        "/ has 1 property the schema does not allow",
    ] {
        assert!(all.contains(says), "{says:?} in {all}");
    }
}

/// A template's call settings (sampling, retries) go with each of its calls; a template
/// without them leaves the processor's own.
#[tokio::test]
async fn a_templates_temperature_max_tokens_and_retry_go_with_its_calls() {
    let mut rig = Rig::start(Duration::from_secs(30)).await;
    let stream = rig.ask("warm", &[("x", "up")], false).await;
    let (id, request) = rig.llm_request().await;
    assert_eq!(request.prompt, "Warm up");
    assert_eq!(request.temperature, Some(0.7));
    assert_eq!(request.max_tokens, Some(64));
    assert_eq!(request.retry.as_deref(), Some("seed-002,attempts=2"));
    rig.answer(&id, "a1", last("ok", 1, 1)).await;
    records(stream).await;
    let stream = rig.ask("say", &[("what", "hi")], false).await;
    let (id, request) = rig.llm_request().await;
    assert_eq!((request.temperature, request.max_tokens), (None, None));
    assert_eq!(request.retry, None);
    rig.answer(&id, "a1", last("ok", 1, 1)).await;
    records(stream).await;
    rig.stop().await;
}
