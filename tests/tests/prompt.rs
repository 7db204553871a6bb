//! The prompt processor end to end on the real broker: client -> prompt processor ->
//! text-completion processor -> fake OpenAI server (model `replay-N` streams the rendered
//! prompt back in N-byte tokens, so each test picks the "model's answer" through its terms).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, sync::Arc, time::Duration};

use serde_json::{Value, json};
use sluice_prompt::{
    handler::{LlmClient, PromptService, StructuredOutput},
    metrics::PromptMetrics,
    store::TemplateStore,
};
use sluice_runtime::{
    client::{ClientConfig, Received, RequestClient},
    processor::ProcessorConfig,
    secret::Secret,
    telemetry::Telemetry,
};
use sluice_schema::{PromptRequest, PromptResponse};
use sluice_tests::{
    Broker, RunningProcessor, echo_config, eventually_every, fake_openai::FakeOpenAi, init_logging,
    openai_service, unique_topic, wait_for_metrics,
};
use sluice_text_completion::providers::openai::{Dialect, OpenAiConfig};
use tokio_util::sync::CancellationToken;

type PromptClient = RequestClient<PromptRequest, PromptResponse>;

const TEMPLATES: &str = r#"{
  "system": "You answer in the requested format.",
  "templates": {
    "say": {"prompt": "{{ out }}"},
    "facts": {"prompt": "{{ out }}", "response-type": "jsonl",
              "schema": {"type": "object", "required": ["fact", "score"],
                         "properties": {"fact": {"type": "string"},
                                        "score": {"type": "number", "minimum": 0, "maximum": 1}}}},
    "one": {"prompt": "{{ out }}", "response-type": "json",
            "schema": {"type": "object", "required": ["answer"],
                       "properties": {"answer": {"type": "integer"}}}},
    "needs": {"prompt": "{{ out }} {{ missing_var }}"},
    "classify": {"prompt": "{{ out }}", "response-type": "jsonl",
                 "normaliser": "knowledge-classification-seed-002"},
    "decide": {"prompt": "{{ out }}", "response-type": "jsonl",
               "normaliser": "integration-decisions"}
  }
}"#;

struct Setup {
    client: PromptClient,
    prompt: RunningProcessor,
    llm: RunningProcessor,
    metrics: Telemetry,
    store: Arc<TemplateStore>,
    file: PathBuf,
    fake: FakeOpenAi,
}

impl Setup {
    async fn new(model: &str, templates: &str) -> Self {
        Self::with(model, templates, false).await
    }

    async fn with(model: &str, templates: &str, builtins: bool) -> Self {
        Self::options(model, templates, builtins, false).await
    }

    /// As [`Setup::with`], with `--structured-output native` when `native`.
    async fn options(model: &str, templates: &str, builtins: bool, native: bool) -> Self {
        init_logging();
        let broker = Broker::from_env().await;
        let fake = FakeOpenAi::start().await;
        let mut config = OpenAiConfig::new(Dialect::OpenAi, fake.base_url(), model);
        config.api_key = Some(Secret::new("sk-test"));
        let service = openai_service(config);
        let (tc_req, tc_resp, tc_cancel) = (
            unique_topic("tc-req"),
            unique_topic("tc-resp"),
            unique_topic("tc-cancel"),
        );
        let mut tc_config = echo_config(&tc_req, &tc_resp, 64);
        tc_config.cancel_topic = Some(tc_cancel.clone());
        let llm = RunningProcessor::start(broker.bus().await, tc_config, service).await;

        let dir =
            std::env::temp_dir().join(format!("sluice-prompt-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("templates.json");
        std::fs::write(&file, templates).unwrap();
        let metrics = Telemetry::new().unwrap();
        let prompt_metrics = PromptMetrics::register(&metrics.registry).unwrap();
        let store = TemplateStore::open(Some(file.clone()), builtins, Some(prompt_metrics.clone()))
            .unwrap();
        let mut cc = ClientConfig::new("text-completion", &tc_req, &tc_resp);
        cc.cancel_topic = Some(tc_cancel);
        let llm_client: Arc<LlmClient> = Arc::new(
            RequestClient::start(broker.bus().await, cc, None)
                .await
                .unwrap(),
        );
        let handler = PromptService::new(store.clone(), llm_client, prompt_metrics)
            .with_structured_output(if native {
                StructuredOutput::Native
            } else {
                StructuredOutput::Off
            });
        let (p_req, p_resp, p_cancel) = (
            unique_topic("prompt-req"),
            unique_topic("prompt-resp"),
            unique_topic("prompt-cancel"),
        );
        let mut p_config = ProcessorConfig::new("prompt", &p_req, &p_resp);
        sluice_tests::record_per_delta(&mut p_config);
        p_config.drain_grace = Duration::from_secs(5);
        p_config.cancel_topic = Some(p_cancel.clone());
        let prompt = RunningProcessor::start(broker.bus().await, p_config, handler).await;
        let mut pc = ClientConfig::new("prompt", &p_req, &p_resp);
        pc.cancel_topic = Some(p_cancel);
        let client = PromptClient::start(broker.bus().await, pc, None)
            .await
            .unwrap();
        Self {
            client,
            prompt,
            llm,
            metrics,
            store,
            file,
            fake,
        }
    }

    async fn ask(&self, id: &str, out: &str, streaming: bool) -> Vec<PromptResponse> {
        self.ask_with(id, out, streaming, &[]).await
    }

    /// As [`Setup::ask`], with more terms (JSON values).
    async fn ask_with(
        &self,
        id: &str,
        out: &str,
        streaming: bool,
        more: &[(&str, Value)],
    ) -> Vec<PromptResponse> {
        let mut terms: std::collections::BTreeMap<String, String> =
            [("out".to_owned(), serde_json::to_string(out).unwrap())].into();
        for (k, v) in more {
            terms.insert((*k).to_owned(), v.to_string());
        }
        let request = PromptRequest {
            id: id.into(),
            terms,
            streaming,
        };
        let mut s = self.client.request(&request).await.unwrap();
        let mut out = Vec::new();
        while let Some(item) = s.next().await {
            match item.unwrap() {
                Received::Record(r) => out.push(r),
                Received::Restarted => panic!("unexpected restart"),
            }
        }
        assert_eq!(
            out.iter().filter(|r| r.end_of_stream).count(),
            1,
            "{out:#?}"
        );
        assert!(
            out.last().unwrap().end_of_stream,
            "nothing after the terminal record"
        );
        out
    }

    async fn stop(self) {
        self.client.close().await;
        self.prompt.stop().await;
        self.llm.stop().await;
    }
}

fn objects(records: &[PromptResponse]) -> Vec<Value> {
    records
        .iter()
        .filter_map(|r| r.object.as_deref())
        .map(|o| serde_json::from_str(o).unwrap())
        .collect()
}

fn sum(records: &[PromptResponse], f: fn(&PromptResponse) -> Option<u64>) -> u64 {
    records.iter().filter_map(f).sum()
}

#[tokio::test]
async fn text_streams_deltas_with_token_counts() {
    let s = Setup::new("replay-3", TEMPLATES).await;
    let out = s.ask("say", "Hello there, world", true).await;
    assert!(out.len() > 3, "streamed in pieces: {out:#?}");
    let text: String = out.iter().filter_map(|r| r.text.as_deref()).collect();
    assert_eq!(text, "Hello there, world");
    assert_eq!(sum(&out, |r| r.in_token), 9);
    assert_eq!(sum(&out, |r| r.out_token), 3);
    assert!(out.iter().all(|r| r.model.as_deref() == Some("replay-3")));
    assert!(out.iter().all(|r| r.error.is_none()));

    let out = s.ask("say", "Hello there, world", false).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].text.as_deref(), Some("Hello there, world"));
    assert_eq!(out[0].out_token, Some(3));
    s.stop().await;
}

const JSONL: &str = "Here you go:\n```json\n{\"fact\": \"water is wet\", \"score\": 0.9}\n\n{\"fact\": \"broken\", \"score\": \n{\"fact\": \"fire is hot\", \"score\": 0.8}\n{\"fact\": \"too sure\", \"score\": 7}\n[1, 2]\n```\n{\"fact\": \"last line, no newline\", \"score\": 0.1}";

/// `--structured-output native`: a `jsonl` template asks for `{"items": [...]}` of its
/// schema's objects, and the array the model answers (pretty-printed, streamed in 5-byte pieces, a
/// comma and a bracket inside a string) is published object by object as each element
/// completes, with the template's validation kept (a score off the schema and an element that
/// is not JSON are skipped); a `json` template asks for its schema itself.
#[tokio::test]
async fn native_structured_output_asks_for_the_schema_and_reads_an_array_as_lines() {
    let s = Setup::options("replay-5", TEMPLATES, false, true).await;
    let array = "[\n  {\"fact\": \"water is wet\", \"score\": 0.9},\n  {\"fact\": \"fire is hot\", \"score\": 1.5},\n  nope,\n  {\"fact\": \"ice, [cold]\", \"score\": 0.2}\n]";
    let out = s.ask("facts", array, true).await;
    let facts: Vec<String> = objects(&out)
        .iter()
        .map(|o| o["fact"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(facts, ["water is wet", "ice, [cold]"]);
    assert_eq!(
        out.len(),
        3,
        "each object its own record, then the terminal one"
    );
    let last = out.last().unwrap();
    assert_eq!(last.objects_emitted, Some(2));
    assert_eq!(last.lines_skipped, Some(2));
    let sent = s.fake.last_body();
    assert_eq!(sent["response_format"]["type"], "json_schema", "{sent}");
    let schema = &sent["response_format"]["json_schema"]["schema"];
    assert_eq!(schema["type"], "object", "{sent}");
    let lines = &schema["properties"]["items"];
    assert_eq!(lines["type"], "array", "{sent}");
    assert_eq!(
        lines["items"]["required"],
        serde_json::json!(["fact", "score"])
    );
    // The object the schema asks for, `{"items": [...]}`, read the same way.
    let wrapped = format!("{{\"items\": {array}}}");
    let out = s.ask("facts", &wrapped, true).await;
    assert_eq!(out.last().unwrap().objects_emitted, Some(2));
    // A model that answers lines anyway is read as lines.
    let out = s.ask("facts", JSONL, true).await;
    assert_eq!(out.last().unwrap().objects_emitted, Some(3));
    // A `json` template asks for its own schema.
    let out = s.ask("one", "{\"answer\": 42}", false).await;
    assert_eq!(
        out.last().unwrap().object.as_deref(),
        Some("{\"answer\":42}")
    );
    let sent = s.fake.last_body();
    assert_eq!(
        sent["response_format"]["json_schema"]["schema"]["required"],
        serde_json::json!(["answer"]),
        "{sent}"
    );
    s.stop().await;

    // Off (the default): nothing asked of the provider.
    let s = Setup::new("replay-5", TEMPLATES).await;
    s.ask("facts", JSONL, true).await;
    assert!(s.fake.last_body().get("response_format").is_none());
    s.stop().await;
}

#[tokio::test]
async fn jsonl_publishes_each_valid_line_and_skips_the_rest() {
    let s = Setup::new("replay-5", TEMPLATES).await;
    let out = s.ask("facts", JSONL, true).await;
    let got = objects(&out);
    let facts: Vec<&str> = got.iter().map(|o| o["fact"].as_str().unwrap()).collect();
    assert_eq!(
        facts,
        ["water is wet", "fire is hot", "last line, no newline"]
    );
    // Each object is its own record, before the terminal one, which carries the counts.
    let last = out.last().unwrap();
    assert!(last.object.is_none());
    assert_eq!(last.objects_emitted, Some(3));
    // "Here you go:" (prose), the broken line, score 7 (schema), [1, 2] (not an object).
    assert_eq!(last.lines_skipped, Some(4));
    assert_eq!(out.len(), 4);
    assert_eq!(sum(&out, |r| r.in_token), 9);
    let m = s.metrics.render();
    assert!(
        m.contains(r#"sluice_prompt_objects_total{template="facts"} 3"#),
        "{m}"
    );
    assert!(
        m.contains(r#"sluice_prompt_lines_skipped_total{reason="malformed",template="facts"} 3"#),
        "{m}"
    );
    assert!(
        m.contains(r#"sluice_prompt_lines_skipped_total{reason="invalid",template="facts"} 1"#),
        "{m}"
    );

    // Not streaming: one record, the objects as an array.
    let out = s.ask("facts", JSONL, false).await;
    assert_eq!(out.len(), 1);
    let all: Value = serde_json::from_str(out[0].object.as_deref().unwrap()).unwrap();
    assert_eq!(all.as_array().unwrap().len(), 3);
    assert_eq!(out[0].objects_emitted, Some(3));
    s.stop().await;
}

#[tokio::test]
async fn a_truncated_jsonl_answer_keeps_what_was_published_and_ends_with_an_error() {
    let s = Setup::new("replay-4-break", TEMPLATES).await;
    let answer = "{\"fact\": \"a\", \"score\": 0.5}\n{\"fact\": \"b\", \"score\": 0.6}\n{\"fact\": \"c\", \"sco";
    let out = s.ask("facts", answer, true).await;
    assert_eq!(objects(&out).len(), 2);
    let last = out.last().unwrap();
    let err = last.error.as_ref().expect("a terminal error");
    assert_eq!(err.kind, "llm-error");
    assert_eq!(last.objects_emitted, Some(2));
    assert_eq!(last.lines_skipped, Some(0));
    s.stop().await;
}

#[tokio::test]
async fn json_is_one_validated_object_even_when_streaming() {
    let s = Setup::new("replay-6", TEMPLATES).await;
    for streaming in [true, false] {
        let out = s
            .ask(
                "one",
                "Sure! The result:\n```json\n{\"answer\": 42}\n```\nHope that helps.",
                streaming,
            )
            .await;
        assert_eq!(out.len(), 1, "one record, streaming={streaming}");
        assert_eq!(objects(&out), [json!({"answer": 42})]);
        assert!(out[0].error.is_none());
    }
    let out = s.ask("one", "{\"answer\": \"forty-two\"}", true).await;
    let err = out[0].error.as_ref().unwrap();
    assert_eq!(err.kind, "llm-error");
    assert!(
        err.message.contains("does not match the schema"),
        "{}",
        err.message
    );
    assert!(
        err.message.contains("/answer is not of type integer"),
        "names the field and the rule: {}",
        err.message
    );
    assert!(
        !err.message.contains("forty-two"),
        "never quotes the model's value: {}",
        err.message
    );
    let out = s.ask("one", "I cannot answer that.", true).await;
    assert!(out[0].error.as_ref().unwrap().message.contains("no JSON"));
    s.stop().await;
}

#[tokio::test]
async fn unknown_templates_and_missing_variables_are_clear_errors() {
    let s = Setup::new("replay-4", TEMPLATES).await;
    let out = s.ask("nope", "x", true).await;
    let e = out[0].error.as_ref().unwrap();
    assert_eq!(e.kind, "invalid-request");
    assert!(
        e.message.contains("unknown template \"nope\""),
        "{}",
        e.message
    );
    assert!(
        e.message.contains("facts, needs, one, say"),
        "{}",
        e.message
    );
    let out = s.ask("needs", "x", true).await;
    let e = out[0].error.as_ref().unwrap();
    assert_eq!(e.kind, "invalid-request");
    assert!(e.message.contains("undefined"), "{}", e.message);
    let m = s.metrics.render();
    assert!(m.contains(r#"sluice_prompt_template_errors_total{kind="unknown"} 1"#));
    assert!(m.contains(r#"sluice_prompt_template_errors_total{kind="render"} 1"#));
    s.stop().await;
}

#[tokio::test]
async fn templates_reload_on_file_change_without_disturbing_requests_in_flight() {
    let s = Setup::new("replay-2", TEMPLATES).await;
    let stop = CancellationToken::new();
    let watcher = s
        .store
        .clone()
        .watch(Duration::from_millis(50), stop.clone());
    // Slow answers (2-byte tokens) in flight while the file changes under them.
    let long = "0123456789".repeat(20);
    let client = &s.client;
    let in_flight = futures::future::join_all((0..16).map(|_| {
        let long = long.clone();
        async move {
            let request = PromptRequest {
                id: "say".into(),
                terms: [("out".to_owned(), serde_json::to_string(&long).unwrap())].into(),
                streaming: true,
            };
            let mut st = client.request(&request).await.unwrap();
            let mut text = String::new();
            while let Some(item) = st.next().await {
                if let Received::Record(r) = item.unwrap() {
                    assert!(r.error.is_none(), "{r:?}");
                    text.push_str(r.text.as_deref().unwrap_or(""));
                }
            }
            text
        }
    }));
    let changed = TEMPLATES.replace(
        r#""say": {"prompt": "{{ out }}"}"#,
        r#""say": {"prompt": "v2: {{ out }}"}"#,
    );
    let rewrite = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        // Written whole and renamed into place, as editors and ConfigMaps do.
        let tmp = s.file.with_extension("tmp");
        std::fs::write(&tmp, &changed).unwrap();
        std::fs::rename(&tmp, &s.file).unwrap();
    };
    let (texts, ()) = tokio::join!(in_flight, rewrite);
    for t in texts {
        assert!(
            t == long || t == format!("v2: {long}"),
            "each answer is whole: {t}"
        );
    }
    let picked = eventually_every(
        Duration::from_millis(50),
        Duration::from_secs(10),
        async || s.ask("say", "x", false).await[0].text.clone(),
        |t| t.as_deref() == Some("v2: x"),
    )
    .await;
    assert_eq!(
        picked.as_deref(),
        Some("v2: x"),
        "the change was not picked up"
    );
    // A broken file is refused; the last good templates stay in use.
    std::fs::write(&s.file, "{ not json").unwrap();
    let refused = r#"sluice_prompt_template_reloads_total{outcome="failure"} 1"#;
    let m = wait_for_metrics(|| s.metrics.render(), |m| m.contains(refused)).await;
    assert!(m.contains(refused), "{m}");
    assert_eq!(
        s.ask("say", "y", false).await[0].text.as_deref(),
        Some("v2: y")
    );
    stop.cancel();
    watcher.await.unwrap();
    s.stop().await;
}

/// Terms that render each built-in template (the fake ignores the prompt and answers with
/// the structured contract's example stream).
/// The ids (`block_id`, `knowledge_block_id`, `page`) a stream's lines that are JSON objects
/// name, so the request can name them as its items (the other lines are skipped whatever
/// they name).
fn ids_in(text: &str, name: &str) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for line in text.lines() {
        let Ok(value) = serde_json::from_str::<Value>(line.trim()) else {
            continue;
        };
        if let Some(id) = value.get(name).and_then(Value::as_str)
            && !ids.iter().any(|i| i == id)
        {
            ids.push(id.to_owned());
        }
    }
    ids
}

/// Terms for a built-in template whose items are the ids `stream` answers (so no object is
/// dropped as answering an item the request does not name).
fn builtin_terms_for(template: &str, stream: &str) -> std::collections::BTreeMap<String, String> {
    let items = |name: &str, id_field: &str| {
        let list: Vec<Value> = ids_in(stream, name)
            .into_iter()
            .map(|id| json!({id_field: id, "content": "x", "full_text": "x", "page_name": id, "chunks": []}))
            .collect();
        Value::Array(list).to_string()
    };
    match template {
        "integration-decisions-seed-002" => [
            (
                "knowledge_block".to_owned(),
                json!({"block_id": "b1", "content": "x"}).to_string(),
            ),
            ("candidate_pages".to_owned(), items("page", "page_name")),
        ]
        .into(),
        t if t.starts_with("integration-decisions") => {
            let blocks: Vec<Value> = ids_in(stream, "knowledge_block_id")
                .into_iter()
                .map(|id| json!({"block_id": id, "content": "x", "candidate_pages": []}))
                .collect();
            [(
                "knowledge_blocks".to_owned(),
                Value::Array(blocks).to_string(),
            )]
            .into()
        }
        "content-rewording-seed-002" => [(
            "decisions".to_owned(),
            items("block_id", "knowledge_block_id"),
        )]
        .into(),
        _ => [("blocks".to_owned(), items("block_id", "block_id"))].into(),
    }
}

/// Every example stream of the structured contracts
/// (docs/specs.md#the-structured-ndjson-contracts), token by token through the broker, against the
/// built-in templates: the objects a correct parser, normaliser and validator emits, and the lines
/// it skips, as `seed_streams::expected` counts them.
#[tokio::test]
async fn the_seed_streams_through_the_builtin_templates() {
    use sluice_tests::seed_streams;
    let mut checked = 0;
    for name in seed_streams::names() {
        let expected = seed_streams::expected(name).unwrap();
        let s = Setup::with(&format!("seed-{name}"), r#"{"templates": {}}"#, true).await;
        let request = PromptRequest {
            id: expected.template.into(),
            terms: builtin_terms_for(expected.template, seed_streams::stream(name).unwrap()),
            streaming: true,
        };
        let mut st = s.client.request(&request).await.unwrap();
        let mut out = Vec::new();
        while let Some(item) = st.next().await {
            if let Received::Record(r) = item.unwrap() {
                out.push(r);
            }
        }
        let last = out.last().unwrap();
        assert!(last.error.is_none(), "{name}: {last:?}");
        assert_eq!(objects(&out).len(), expected.objects, "{name}: objects");
        assert_eq!(
            last.objects_emitted,
            Some(expected.objects as u64),
            "{name}"
        );
        assert_eq!(
            last.lines_skipped,
            Some(expected.skipped as u64),
            "{name}: skipped"
        );
        checked += 1;
        s.stop().await;
    }
    assert!(checked >= 10, "{checked} streams");
}

/// A caller that stops listening cancels the prompt, and the prompt processor's own
/// text-completion request with it: the provider's connection is closed.
#[tokio::test]
async fn a_cancel_passes_through_the_prompt_processor_to_the_provider_call() {
    let s = Setup::new("stall", TEMPLATES).await;
    let request = PromptRequest {
        id: "say".into(),
        terms: [("out".to_owned(), "\"x\"".to_owned())].into(),
        streaming: true,
    };
    let mut st = s.client.request(&request).await.unwrap();
    match st.next().await.unwrap().unwrap() {
        Received::Record(r) => assert_eq!(r.text.as_deref(), Some("Hel")),
        Received::Restarted => panic!("restart"),
    }
    assert_eq!(s.fake.abandoned_streams(), 0);
    drop(st);
    s.fake
        .assert_abandoned(
            Duration::from_secs(15),
            "the provider call was not cancelled",
        )
        .await;
    s.stop().await;
}

/// The rules that need the request, through the real processor: an object for a block the request
/// does not name is dropped; the terminal record says how many of the request's items the answer
/// covered and (where every item expects one) which are pending, the NDJSON parser contract's
/// (docs/specs.md#the-structured-ndjson-contracts) "Classified 2/3 blocks, 1 pending"; decisions
/// are held per knowledge block to the end of the answer and at most two per block and page are
/// kept, streamed or whole.
#[tokio::test]
async fn request_rules_drop_strangers_and_count_the_pending_items() {
    let s = Setup::new("replay-8", TEMPLATES).await;
    let blocks = json!([{"block_id": "a", "content": "x"}, {"block_id": "b", "content": "y"},
                        {"block_id": "c", "content": "z"}]);
    let answer = concat!(
        r#"{"block_id": "a", "is_knowledge": true, "confidence": 0.9}"#,
        "\n",
        r#"{"block_id": "invented", "is_knowledge": true, "confidence": 0.9}"#,
        "\n",
        r#"{"block_id": "b", "is_knowledge": false, "confidence": 0.8}"#,
        "\n",
    );
    for streaming in [true, false] {
        let out = s
            .ask_with("classify", answer, streaming, &[("blocks", blocks.clone())])
            .await;
        let last = out.last().unwrap();
        assert!(last.error.is_none(), "{last:?}");
        assert_eq!(last.objects_emitted, Some(2), "streaming {streaming}");
        assert_eq!(last.lines_skipped, Some(1));
        assert_eq!(last.items_expected, Some(3));
        assert_eq!(last.items_answered, Some(2));
        assert_eq!(last.items_pending, Some(vec!["c".to_owned()]));
    }
    let knowledge = json!([{"block_id": "k1", "content": "x", "candidate_pages": []},
                           {"block_id": "k2", "content": "y", "candidate_pages": []}]);
    let d = |k: &str, page: &str| {
        format!(
            r#"{{"knowledge_block_id": "{k}", "target_page": "{page}", "action": "add_section", "confidence": 0.5, "reasoning": "r"}}"#
        )
    };
    let answer = [
        d("k1", "P"),
        d("k1", "P"),
        d("k1", "P"),
        d("k1", "Q"),
        d("k2", "P"),
    ]
    .join("\n");
    let out = s
        .ask_with("decide", &answer, true, &[("knowledge_blocks", knowledge)])
        .await;
    assert_eq!(
        objects(&out).len(),
        4,
        "the third (k1, P) dropped: {out:#?}"
    );
    let last = out.last().unwrap();
    assert_eq!(last.lines_skipped, Some(1));
    assert_eq!(
        (last.items_expected, last.items_answered),
        (Some(2), Some(2))
    );
    assert_eq!(
        last.items_pending, None,
        "not every block expects a decision"
    );
    // A model that comes back to a block: that block's decisions still go out together, at
    // the end of the answer (the LLM streaming contract Phase 3: all with a block's id first).
    let answer = [d("k1", "P"), d("k2", "P"), d("k1", "Q")].join("\n");
    let knowledge = json!([{"block_id": "k1", "content": "x", "candidate_pages": []},
                           {"block_id": "k2", "content": "y", "candidate_pages": []}]);
    let out = s
        .ask_with("decide", &answer, true, &[("knowledge_blocks", knowledge)])
        .await;
    let order: Vec<(String, String)> = objects(&out)
        .iter()
        .map(|o| {
            (
                o["knowledge_block_id"].as_str().unwrap().to_owned(),
                o["target_page"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let pair = |k: &str, p: &str| (k.to_owned(), p.to_owned());
    assert_eq!(
        order,
        [pair("k1", "P"), pair("k1", "Q"), pair("k2", "P")],
        "{out:#?}"
    );
    let m = s.metrics.render();
    for line in [
        r#"sluice_prompt_lines_skipped_total{reason="unmatched",template="classify"} 2"#,
        r#"sluice_prompt_lines_skipped_total{reason="over-limit",template="decide"} 1"#,
    ] {
        assert!(m.contains(line), "{line} in {m}");
    }
    s.stop().await;
}

/// A template's retry policy goes with its calls and the text-completion processor follows it: the
/// LLM streaming contract's (docs/specs.md#the-structured-ndjson-contracts) template treats a 503
/// as final (it retries timeouts and connection errors only), the NDJSON parser contract's retries
/// a 502, and sluice's own template keeps the processor's policy, which retries a 500.
#[tokio::test]
async fn each_seeds_template_retries_as_its_seed_says() {
    let s = Setup::with("routed", r#"{"templates": {}}"#, true).await;
    let ask = |template: &'static str, model: &'static str| {
        let blocks = json!([
            {"block_id": "abc123", "content": format!("[model:{model}]")},
            {"block_id": "ghi789", "content": "y"},
        ]);
        let request = PromptRequest {
            id: template.into(),
            terms: [("blocks".to_owned(), blocks.to_string())].into(),
            streaming: true,
        };
        let client = &s.client;
        async move {
            let mut st = client.request(&request).await.unwrap();
            let mut out = Vec::new();
            while let Some(item) = st.next().await {
                if let Received::Record(r) = item.unwrap() {
                    out.push(r);
                }
            }
            out
        }
    };
    let final_503 = "status-503-1-seed-classification";
    let out = ask("knowledge-classification-seed-000", final_503).await;
    let last = out.last().unwrap();
    let error = last
        .error
        .as_ref()
        .expect("a 503 is final for the LLM streaming contract");
    assert_eq!(error.kind, "llm-error");
    assert!(error.message.contains("503"), "{}", error.message);
    assert_eq!(s.fake.calls(final_503), 1);

    let retried_502 = "status-502-1-seed-classification";
    let out = ask("knowledge-classification-seed-002", retried_502).await;
    assert!(out.last().unwrap().error.is_none(), "{out:?}");
    assert_eq!(objects(&out).len(), 2);
    assert_eq!(
        s.fake.calls(retried_502),
        2,
        "the NDJSON parser contract retries a 502"
    );

    let retried_500 = "status-500-1-seed-classification";
    let out = ask("knowledge-classification", retried_500).await;
    assert!(out.last().unwrap().error.is_none(), "{out:?}");
    assert_eq!(
        s.fake.calls(retried_500),
        2,
        "the processor's policy retries a 500"
    );
    let sent = s.fake.last_body();
    assert!(
        sent.get("retry").is_none(),
        "the policy is sluice's, not the provider's"
    );
    s.stop().await;
}
