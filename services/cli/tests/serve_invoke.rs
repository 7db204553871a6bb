//! `sluice serve` and `sluice invoke` run as processes: the embedded default (in-process bus)
//! against the fake OpenAI server, a config file, the gateway token, exit codes and messages
//! on errors, no key in logs or metrics, and SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Sluice, invoke};
use sluice_tests::fake_openai::FakeOpenAi;

const KEY: &str = "sk-serve-provider-key-5521";
const TOKEN: &str = "gateway-token-9930";

struct Serve {
    process: Sluice,
    url: String,
    metrics: String,
}

/// Starts `sluice serve` with `args` and `env`, and reads the addresses it prints.
async fn serve(args: &[&str], env: &[(&str, &str)]) -> Serve {
    let mut all = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(args);
    let mut vars = vec![("SLUICE_LLM_API_KEY", KEY), ("RUST_LOG", "debug")];
    vars.extend_from_slice(env);
    let mut process = Sluice::spawn(&all, &vars, &["SLUICE_CONFIG", "SLUICE_GATEWAY_TOKEN"]);
    // "sluice serve: gateway on http://ADDR, metrics on http://ADDR/metrics"
    let line = process.stdout_line("gateway on ").await;
    let url = line
        .split("gateway on ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap()
        .to_owned();
    let metrics = line.split("metrics on ").nth(1).unwrap().to_owned();
    Serve {
        process,
        url,
        metrics,
    }
}

/// Starts `sluice serve` on the fake OpenAI server's `model`, with `more` options.
async fn serve_model(fake: &FakeOpenAi, model: &str, more: &[&str], env: &[(&str, &str)]) -> Serve {
    let base = fake.base_url();
    let mut args = vec![
        "--provider",
        "openai-compatible",
        "--base-url",
        &base,
        "--model",
        model,
    ];
    args.extend_from_slice(more);
    serve(&args, env).await
}

impl Serve {
    /// SIGTERM, then the exit status and everything it logged.
    async fn stop(self) -> (std::process::ExitStatus, String) {
        let stopped = self.process.stop().await;
        (stopped.status, stopped.stderr)
    }
}

/// A request to the gateway at `url`'s `service` route as NDJSON: the whole body, and its
/// last event.
async fn ndjson_events(
    url: &str,
    service: &str,
    request: serde_json::Value,
) -> (String, serde_json::Value) {
    sluice_runtime::install_crypto_provider();
    let events = reqwest::Client::new()
        .post(format!("{url}/api/v1/{service}"))
        .header("accept", "application/x-ndjson")
        .json(&request)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let last = serde_json::from_str(events.lines().last().unwrap()).unwrap();
    (events, last)
}

#[tokio::test]
async fn serve_streams_to_invoke_and_errors_exit_non_zero_with_a_readable_message() {
    let fake = FakeOpenAi::start().await;
    let dir = std::env::temp_dir().join(format!("sluice-serve-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("serve.toml");
    std::fs::write(
        dir.join("templates.json"),
        r#"{"templates": {"say": {"prompt": "Say: {{ x }}"},
                          "lines": {"prompt": "List: {{ x }}", "response-type": "jsonl"}}}"#,
    )
    .unwrap();
    std::fs::write(
        &config,
        format!(
            "provider = \"openai-compatible\"\nbase-url = \"{}\"\nmodel = \"normal\"\ntemplates = \"{}\"\n",
            fake.base_url(),
            dir.join("templates.json").display()
        ),
    )
    .unwrap();
    let s = serve(&["--config", config.to_str().unwrap()], &[]).await;
    let url = s.url.clone();

    let out = invoke(
        &["-u", &url, "--show-usage", "llm", "be brief", "say hello"],
        &[],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "Hello world!\n");
    assert!(out.stderr.contains("Input tokens: 11"), "{}", out.stderr);
    assert!(out.stderr.contains("Output tokens: 3"), "{}", out.stderr);
    assert_eq!(fake.last_body()["stream"], true);
    assert_eq!(fake.last_auth().unwrap(), format!("Bearer {KEY}"));

    let out = invoke(
        &["-u", &url, "--no-streaming", "llm", "be brief", "say hello"],
        &[],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "Hello world!\n");
    assert_eq!(fake.last_body()["stream"], false);

    // TrustGraph's streaming spec's (docs/specs.md#trustgraphs-streaming-spec) `-f FLOW`: the flow
    // the gateway serves answers, streamed or whole; another flow is a clear error.
    for extra in [&[][..], &["--no-streaming"][..]] {
        let mut args = vec!["-u", url.as_str(), "-f", "default"];
        args.extend_from_slice(extra);
        args.extend(["llm", "be brief", "say hello"]);
        let out = invoke(&args, &[]).await;
        assert_eq!(out.code, 0, "{extra:?}: {}", out.stderr);
        assert_eq!(out.stdout, "Hello world!\n");
        assert_eq!(fake.last_body()["stream"], extra.is_empty());
    }
    let out = invoke(&["-u", &url, "--flow", "other", "llm", "s", "p"], &[]).await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr
            .starts_with("sluice: invalid-request: unknown flow \"other\""),
        "{}",
        out.stderr
    );

    // The prompt service runs too, with the file's templates beside the built-in ones.
    // SLUICE_URL works like -u.
    let out = invoke(&["prompt", "say", "x=1"], &[("SLUICE_URL", &url)]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "Hello world!\n");
    assert!(fake.last_body()["messages"].to_string().contains("Say: 1"));
    // A jsonl template whose answer ("Hello world!") has no JSON line: the `done` event
    // carries the counts, and the CLI says on stderr that every line was skipped and exits 1
    // (stdout stays empty, or `[]` whole).
    let (events, done) = ndjson_events(
        &url,
        "prompt",
        serde_json::json!({"id": "lines", "terms": {"x": "1"}}),
    )
    .await;
    assert_eq!(done["type"], "done", "{events}");
    assert_eq!(done["objects_emitted"], 0, "{events}");
    assert_eq!(done["lines_skipped"], 1, "{events}");
    for streaming in [true, false] {
        let mut args = vec!["prompt", "lines", "x=1"];
        if !streaming {
            args.insert(0, "--no-streaming");
        }
        let out = invoke(&args, &[("SLUICE_URL", &url)]).await;
        assert_eq!(out.code, 1, "streaming {streaming}: {}", out.stderr);
        assert!(
            out.stderr
                .contains("no objects: every line of the model's answer was skipped (1 line"),
            "streaming {streaming}: {}",
            out.stderr
        );
        assert_eq!(out.stdout.trim(), if streaming { "" } else { "[]" });
    }
    // The NDJSON parser contract's (docs/specs.md#the-structured-ndjson-contracts) accounting: a
    // built-in whose every block expects a line, answered with no JSON at all: the done event and
    // the CLI say which blocks are pending.
    let blocks = r#"blocks=[{"block_id":"b1","content":"x"},{"block_id":"b2","content":"y"}]"#;
    let (events, done) = ndjson_events(
        &url,
        "prompt",
        serde_json::json!({"id": "knowledge-classification-seed-002",
            "terms": {"blocks": r#"[{"block_id":"b1","content":"x"},{"block_id":"b2","content":"y"}]"#}}),
    )
    .await;
    assert_eq!(done["items_expected"], 2, "{events}");
    assert_eq!(done["items_answered"], 0, "{events}");
    assert_eq!(
        done["items_pending"],
        serde_json::json!(["b1", "b2"]),
        "{events}"
    );
    let out = invoke(
        &["prompt", "knowledge-classification-seed-002", blocks],
        &[("SLUICE_URL", &url)],
    )
    .await;
    assert!(
        out.stderr
            .contains("sluice: answered 0 of 2 items; 2 pending: b1, b2"),
        "{}",
        out.stderr
    );
    let out = invoke(&["prompt", "some-template", "x=1"], &[("SLUICE_URL", &url)]).await;
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("invalid-request"), "{}", out.stderr);
    assert!(
        out.stderr.contains("unknown template \"some-template\""),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("knowledge-classification"),
        "built-ins are listed: {}",
        out.stderr
    );
    // The agent runs too; this model never answers in the ReAct format, so after its one
    // corrective retry its plain prose is taken as the final answer (`--plain-answer`
    // defaults to `retry-final`).
    let out = invoke(&["agent", "-q", "why?"], &[("SLUICE_URL", &url)]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "Hello world!\n");

    // Nothing listening: a message, not a panic.
    let out = invoke(&["-u", "http://127.0.0.1:9", "llm", "a", "b"], &[]).await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.starts_with("sluice: cannot reach the gateway"),
        "{}",
        out.stderr
    );

    sluice_runtime::install_crypto_provider();
    let metrics = reqwest::get(&s.metrics)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("sluice_gateway_requests_total"));
    assert!(metrics.contains("sluice_llm_requests_total"));
    assert!(!metrics.contains(KEY));
    // One text-completion client in the process: the gateway's calls went through the
    // processors' client (one response subscription, one router per record), not a second one.
    assert!(
        metrics.contains(
            "sluice_client_requests_total{outcome=\"success\",service=\"text-completion\"}"
        ),
        "{metrics}"
    );
    assert!(
        !metrics.contains("service=\"gateway-text-completion\""),
        "{metrics}"
    );
    let (status, log) = s.stop().await;
    assert!(status.success(), "exit after SIGTERM: {status:?}\n{log}");
    assert!(!log.contains(KEY), "the provider key reached the log");
    assert!(!log.contains("say hello"), "a prompt reached the log");
    // The log goes to a pipe here, not a terminal: plain text, no colour escapes.
    assert!(
        !log.contains('\u{1b}'),
        "escape codes in a piped log: {log}"
    );
}

#[tokio::test]
async fn a_provider_error_and_the_gateway_token_reach_the_cli_user() {
    let fake = FakeOpenAi::start().await;
    let s = serve_model(
        &fake,
        "unauthorized",
        &[],
        &[("SLUICE_GATEWAY_TOKEN", TOKEN)],
    )
    .await;
    let url = s.url.clone();

    // Refused before the stream: the gateway's NDJSON error event, read as such.
    let out = invoke(&["-u", &url, "llm", "s", "p"], &[]).await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr
            .starts_with("sluice: unauthorized: a valid `Authorization: Bearer <token>`"),
        "{}",
        out.stderr
    );

    for extra in [&[][..], &["--no-streaming"][..]] {
        let mut args = vec!["-u", url.as_str()];
        args.extend_from_slice(extra);
        args.extend(["llm", "s", "p"]);
        let out = invoke(&args, &[("SLUICE_TOKEN", TOKEN)]).await;
        assert_eq!(out.code, 1, "{extra:?}");
        assert_eq!(out.stdout, "", "{extra:?}");
        assert!(
            out.stderr.starts_with("sluice: llm-error: "),
            "{extra:?}: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains("SLUICE_LLM_API_KEY"),
            "the message says which key: {}",
            out.stderr
        );
        assert!(!out.stderr.contains(KEY));
    }
    // A token on the command line works, with a warning about its visibility.
    let out = invoke(&["-u", &url, "-t", TOKEN, "llm", "s", "p"], &[]).await;
    assert!(
        out.stderr.contains("warning: a token on the command line"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("llm-error"), "{}", out.stderr);
    let (status, log) = s.stop().await;
    assert!(status.success());
    assert!(!log.contains(TOKEN) && !log.contains(KEY));
}

/// The JSON log lines of `target` (a module path prefix) whose `event` is `event`.
fn events<'a>(
    logs: &'a [serde_json::Value],
    target: &str,
    event: &str,
) -> Vec<&'a serde_json::Value> {
    logs.iter()
        .filter(|l| {
            l["event"] == event && l["target"].as_str().is_some_and(|t| t.starts_with(target))
        })
        .collect()
}

/// The LLM streaming contract's (docs/specs.md#the-structured-ndjson-contracts) request log, read
/// from `sluice serve`'s JSON log as an operator would: the prompt processor logs
/// `llm_request_started` (phase, number of blocks), one `llm_response_chunk` per object,
/// `malformed_json_line` per bad line, and `llm_request_completed` or `llm_request_failed`;
/// text-completion's start names the endpoint. Content (the prompt, objects, the bad lines' text)
/// is in them only with `--log-content`, and then exactly in the contract's fields.
#[tokio::test]
async fn the_request_log_has_seed_000s_events_with_content_only_when_asked() {
    let fake = FakeOpenAi::start().await;
    let base = fake.base_url();
    let blocks = serde_json::json!([
        {"block_id": "abc123", "content": "zebra-content-5521 [model:seed-classification-malformed]"},
        {"block_id": "ghi789", "content": "quiet"},
    ])
    .to_string();
    for content in [false, true] {
        let mut args = vec!["--log-format", "json"];
        if content {
            args.push("--log-content");
        }
        let s = serve_model(&fake, "routed", &args, &[]).await;
        let (body, done) = ndjson_events(
            &s.url,
            "prompt",
            serde_json::json!({"id": "knowledge-classification-seed-000", "terms": {"blocks": blocks}}),
        )
        .await;
        assert_eq!(done["objects_emitted"], 2, "{body}");
        assert_eq!(done["lines_skipped"], 3, "{body}");
        let (failed_body, failed) = ndjson_events(
            &s.url,
            "prompt",
            serde_json::json!({"id": "knowledge-classification-seed-000",
                "terms": {"blocks": r#"[{"block_id": "b1", "content": "[model:unauthorized]"}]"#}}),
        )
        .await;
        assert_eq!(failed["type"], "done", "{failed_body}");
        let (status, stderr) = s.stop().await;
        assert!(status.success(), "{stderr}");
        let logs: Vec<serde_json::Value> = stderr
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let prompt = "sluice_prompt";

        let started = events(&logs, prompt, "llm_request_started");
        assert_eq!(started.len(), 2, "{stderr}");
        let first = started[0];
        assert_eq!(first["phase"], "knowledge-classification-seed-000");
        assert_eq!(first["num_blocks"], 2);
        let id = first["request_id"].as_str().unwrap();
        let tc = events(&logs, "sluice_text_completion", "llm_request_started");
        assert_eq!(tc[0]["endpoint"], format!("{base}/v1/chat/completions"));
        // One id across the hops: text-completion's log names the prompt request's id, and
        // its own call's id beside it.
        assert_eq!(tc[0]["request_id"], id, "{stderr}");
        assert!(
            tc[0]["call_id"].as_str().is_some_and(|c| c != id),
            "{stderr}"
        );
        let tc_completed = events(&logs, "sluice_text_completion", "llm_request_completed");
        assert_eq!(tc_completed[0]["request_id"], id, "{stderr}");

        let chunks: Vec<_> = events(&logs, prompt, "llm_response_chunk")
            .into_iter()
            .filter(|e| e["request_id"] == id)
            .collect();
        assert_eq!(
            chunks
                .iter()
                .map(|c| c["chunk_num"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            [1, 2],
            "{stderr}"
        );
        let malformed = events(&logs, prompt, "malformed_json_line");
        assert_eq!(
            malformed
                .iter()
                .map(|m| m["line_number"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            [2, 3, 4],
            "{stderr}"
        );
        assert!(
            malformed
                .iter()
                .all(|m| m["request_id"] == id && m["error"].is_string())
        );
        let completed = events(&logs, prompt, "llm_request_completed");
        assert_eq!(completed.len(), 1, "{stderr}");
        assert_eq!(
            (
                completed[0]["request_id"].as_str(),
                completed[0]["total_chunks"].as_u64()
            ),
            (Some(id), Some(2))
        );
        assert!(completed[0]["duration_ms"].is_u64());
        let failed = events(&logs, prompt, "llm_request_failed");
        assert_eq!(failed.len(), 1, "{stderr}");
        assert_eq!(failed[0]["request_id"], started[1]["request_id"]);
        assert_eq!(failed[0]["error_type"], "llm-error");
        assert_eq!(failed[0]["chunks_received"], 0);
        assert!(
            failed[0]["error_message"].as_str().unwrap().contains("401"),
            "{stderr}"
        );

        if content {
            // The contract's types: `messages` an array, `data` an object, `line` the text.
            let messages = &first["messages"];
            assert!(messages.is_array(), "{stderr}");
            assert_eq!(messages[0]["role"], "system");
            assert!(
                messages[1]["content"]
                    .as_str()
                    .unwrap()
                    .contains("zebra-content-5521")
            );
            let data = &chunks[0]["data"];
            assert!(data.is_object(), "{stderr}");
            assert_eq!(data["block_id"], "abc123");
            assert_eq!(
                malformed[1]["line"],
                r#"{"block_id": "def456", "is_knowledge": true,}"#
            );
            assert!(stderr.contains("content logging is on"), "{stderr}");
        } else {
            for e in started.iter().chain(&chunks).chain(&malformed) {
                for field in ["messages", "data", "line"] {
                    assert!(e.get(field).is_none(), "{field} in {e}");
                }
            }
            for text in ["zebra-content-5521", "is_knowledge", "def456"] {
                assert!(!stderr.contains(text), "{text} reached the log: {stderr}");
            }
        }
    }
}

/// The agent through `sluice invoke`: the answer on stdout and the thoughts on stderr (the CLI
/// asks the gateway for the steps), while an event-protocol client that does not ask gets the
/// steps as `status` events and only the answer as tokens.
#[tokio::test]
async fn invoke_shows_the_agents_thoughts_and_a_seed_004_client_gets_only_the_answer() {
    let fake = FakeOpenAi::start().await;
    let s = serve_model(&fake, "react-answer", &[], &[]).await;
    let out = invoke(
        &["agent", "-q", "capital of France?"],
        &[("SLUICE_URL", &s.url)],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "Paris is the capital of France.\n");
    assert!(
        out.stderr.contains("[thought] I know the answer now."),
        "{}",
        out.stderr
    );

    let (events, _) = ndjson_events(
        &s.url,
        "agent",
        serde_json::json!({"question": "capital of France?", "streaming": true}),
    )
    .await;
    let tokens: String = events
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["type"] == "token")
        .map(|e| e["content"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(tokens, "Paris is the capital of France.", "{events}");
    assert!(events.contains(r#""status":"thinking""#) && events.contains(r#""status":"writing""#));
    let (status, _) = s.stop().await;
    assert!(status.success());
}

/// `sluice serve --fallback FILE`: the configured provider answers 503, so every call moves
/// to the file's provider, called with the key from the variable its `key-env` names. The
/// CLI user gets the answer; an OpenAI client's `model` and the NDJSON records name the
/// backup's model; the metrics count the move; no key reaches the log.
#[tokio::test]
async fn a_fallback_file_moves_calls_to_the_backup_with_its_own_key() {
    const BACKUP_KEY: &str = "sk-backup-key-7781";
    sluice_runtime::install_crypto_provider();
    let primary = FakeOpenAi::start().await;
    let backup = FakeOpenAi::start().await;
    let dir = std::env::temp_dir().join(format!("sluice-fallback-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("fallback.toml");
    std::fs::write(
        &file,
        format!(
            "[[provider]]\nprovider = \"openai-compatible\"\nmodel = \"normal\"\nbase-url = \"{}\"\nkey-env = \"SLUICE_BACKUP_KEY\"\n",
            backup.base_url()
        ),
    )
    .unwrap();
    let s = serve_model(
        &primary,
        "status-503-1000",
        &["--fallback", file.to_str().unwrap()],
        &[("SLUICE_BACKUP_KEY", BACKUP_KEY)],
    )
    .await;
    let url = s.url.clone();

    let out = invoke(&["-u", &url, "llm", "s", "p"], &[]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout.trim_end(), "Hello world!");
    assert_eq!(
        primary.last_auth().as_deref(),
        Some(format!("Bearer {KEY}").as_str())
    );
    assert_eq!(
        backup.last_auth().as_deref(),
        Some(format!("Bearer {BACKUP_KEY}").as_str())
    );

    // An OpenAI client asks for the configured model and is told which one answered.
    let answer: serde_json::Value = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": "status-503-1000",
            "messages": [{"role": "user", "content": "hi"}],
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["model"], "normal", "{answer}");
    assert_eq!(answer["choices"][0]["message"]["content"], "Hello world!");

    // TrustGraph's REST answer (one record) names the provider and model that answered, and
    // an event-protocol client's done event the model.
    let record: serde_json::Value = reqwest::Client::new()
        .post(format!("{url}/api/v1/text-completion"))
        .json(&serde_json::json!({"system": "s", "prompt": "p", "streaming": false}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(record["response"], "Hello world!", "{record}");
    assert_eq!(record["model"], "normal", "{record}");
    assert_eq!(record["provider"], "openai-compatible", "{record}");
    let (events, done) = ndjson_events(
        &url,
        "text-completion",
        serde_json::json!({"system": "s", "prompt": "p", "streaming": true}),
    )
    .await;
    assert_eq!(done["type"], "done", "{events}");
    assert_eq!(done["model"], "normal", "{events}");
    assert_eq!(backup.calls("normal"), 4);

    let metrics = reqwest::get(&s.metrics)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let moved = sluice_tests::metric_value(
        &metrics,
        r#"sluice_llm_fallbacks_total{model="status-503-1000",position="0",provider="openai-compatible",reason="server"}"#,
    );
    assert_eq!(moved, 4.0, "{metrics}");
    let (status, log) = s.stop().await;
    assert!(status.success());
    assert!(!log.contains(BACKUP_KEY) && !log.contains(KEY));
    assert!(log.contains("llm_fallback"), "the move is logged");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The event protocol's own test command (seed 004's "Test 1: Stream tokens"), exactly as the
/// spec writes it, line continuations and `| head -20` included.
const SEED_004_TEST_1: &str = r#"curl http://localhost:8000/v1/chat/completions \
  -H "Content-Type: application/json" \
  -d '{"prompt":"Hello","stream":true}' \
  | head -20"#;

/// `sluice serve` with its default addresses (no `--listen`, no `--metrics-addr`), and the
/// event protocol's test command run verbatim by a real `curl` in a shell: it prints the
/// protocol's events, one JSON object per line (`status` `thinking`, the tokens, `done` with
/// reason `success`, each with its `trace_id`). Port 8000 is the metrics port; on loopback it
/// serves the gateway's routes too. The test binds the defaults, 8000 and 8088: it fails,
/// saying so, when something else holds them.
#[tokio::test]
async fn the_event_protocols_own_curl_command_works_verbatim_against_the_defaults() {
    let fake = FakeOpenAi::start().await;
    let base = fake.base_url();
    let mut process = Sluice::spawn(
        &[
            "serve",
            "--provider",
            "openai-compatible",
            "--base-url",
            &base,
            "--model",
            "normal",
        ],
        &[("SLUICE_LLM_API_KEY", KEY)],
        &[
            "SLUICE_CONFIG",
            "SLUICE_GATEWAY_TOKEN",
            "SLUICE_GATEWAY_ADDR",
            "SLUICE_METRICS_ADDR",
        ],
    );
    let line = process.stdout_line("gateway on ").await;
    assert!(
        line.contains("http://127.0.0.1:8088") && line.contains("http://127.0.0.1:8000"),
        "{line}"
    );
    process.ready("http://127.0.0.1:8000/readyz").await;
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(SEED_004_TEST_1)
        .output()
        .await
        .expect("sh and curl");
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events: Vec<serde_json::Value> = printed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect();
    let shown: Vec<String> = events
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "status" => format!("<{}>", e["status"].as_str().unwrap()),
            "token" => e["content"].as_str().unwrap().to_owned(),
            other => format!("<{other} {}>", e["reason"].as_str().unwrap_or("")),
        })
        .collect();
    assert_eq!(
        shown,
        ["<thinking>", "Hello", " world", "!", "<done success>"],
        "{printed}"
    );
    for e in &events {
        assert_eq!(e["trace_id"].as_str().unwrap().len(), 32, "{e}");
        assert!(e.get("content").is_some(), "{e}");
    }
    assert!(printed.ends_with("}\n"), "newline-terminated: {printed:?}");
    let (status, log) = {
        let stopped = process.stop().await;
        (stopped.status, stopped.stderr)
    };
    assert!(status.success(), "{log}");
}

/// A metrics port beyond loopback does not serve the gateway's routes (the gateway's
/// credential check is on `--listen` only): an API path there gets a 404 whose one line says
/// where the API is.
#[tokio::test]
async fn a_metrics_port_beyond_loopback_points_at_the_gateway_instead_of_serving_it() {
    let fake = FakeOpenAi::start().await;
    let base = fake.base_url();
    let mut process = Sluice::spawn(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-addr",
            "0.0.0.0:0",
            "--provider",
            "openai-compatible",
            "--base-url",
            &base,
            "--model",
            "normal",
        ],
        &[("SLUICE_LLM_API_KEY", KEY)],
        &["SLUICE_CONFIG", "SLUICE_GATEWAY_TOKEN"],
    );
    let line = process.stdout_line("gateway on ").await;
    let port = line
        .split("metrics on http://0.0.0.0:")
        .nth(1)
        .and_then(|s| s.split('/').next())
        .unwrap_or_else(|| panic!("{line}"))
        .to_owned();
    let metrics = format!("http://127.0.0.1:{port}");
    process.ready(&format!("{metrics}/readyz")).await;
    sluice_runtime::install_crypto_provider();
    let resp = reqwest::Client::new()
        .post(format!("{metrics}/v1/chat/completions"))
        .json(&serde_json::json!({"prompt": "Hello", "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body = resp.text().await.unwrap();
    assert_eq!(body, sluice_runtime::telemetry::NOT_THE_API);
    assert_eq!(body.lines().count(), 1);
    let stopped = process.stop().await;
    assert!(stopped.status.success(), "{}", stopped.stderr);
}

/// TrustGraph's own prompt client, `tg-invoke-prompt` (trustgraph-cli 2.11.1, which streams by
/// default and prints each record's `text`), against `sluice serve`'s gateway (TrustGraph's
/// WebSocket): a `json` template's answer and a `jsonl` template's objects are printed, as it
/// prints TrustGraph's own prompt service's streamed text
/// (docs/protocol.md#prompt-streaming-trustgraph-and-sluice). Before, sluice sent them in
/// `object` alone and it printed an empty line.
#[tokio::test]
async fn trustgraphs_own_prompt_client_prints_a_streamed_json_answer() {
    let Some(venv) = sluice_tests::outside_tool(
        "TG_FLOW_VENV",
        "serve: TrustGraph's tg-invoke-prompt against sluice serve (scripts/tg-flow-venv.sh)",
    ) else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let dir = std::env::temp_dir().join(format!("sluice-tg-prompt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let templates = dir.join("templates.json");
    // The replay model answers with the rendered prompt: the template writes the JSON.
    std::fs::write(
        &templates,
        r#"{"templates": {
            "one": {"prompt": "{\"fact\": \"{{ x }}\"}", "response-type": "json"},
            "lines": {"prompt": "{\"n\": 1}\nnot json\n{\"n\": \"{{ x }}\"}", "response-type": "jsonl"}}}"#,
    )
    .unwrap();
    let s = serve_model(
        &fake,
        "replay-4",
        &["--templates", templates.to_str().unwrap()],
        &[],
    )
    .await;
    let url = format!("{}/", s.url);
    for (template, printed) in [
        ("one", r#"{"fact":"tea"}"#),
        ("lines", "{\"n\":1}\n{\"n\":\"tea\"}"),
    ] {
        let out = tokio::process::Command::new(format!("{venv}/bin/tg-invoke-prompt"))
            .args(["-u", &url, template, "x=tea"])
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{template}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(stdout.trim(), printed, "{template}");
    }
    let (status, _) = s.stop().await;
    assert!(status.success());
    std::fs::remove_dir_all(&dir).unwrap();
}
