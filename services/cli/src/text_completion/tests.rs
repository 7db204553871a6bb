//! The text-completion command's wiring, as the binary builds it from its flags: the provider
//! it calls, the processor's topics and limits (no bus connected, no provider called).

use std::time::Duration;

use clap::Parser;
use sluice_schema::{TopicMapping, TopicName};

use super::*;

#[derive(Parser)]
struct Command {
    #[command(flatten)]
    args: TextCompletionArgs,
}

fn parse(argv: &[&str]) -> TextCompletionArgs {
    Command::try_parse_from(std::iter::once("text-completion").chain(argv.iter().copied()))
        .unwrap()
        .args
}

#[test]
fn the_flags_describe_the_provider() {
    let args = parse(&[
        "--provider",
        "ollama",
        "--model",
        "llama3",
        "--base-url",
        "http://ollama:11434",
        "--temperature",
        "0.3",
        "--max-output-tokens",
        "50",
        "--num-ctx",
        "4096",
        "--connect-timeout-secs",
        "3",
        "--first-token-timeout-secs",
        "4",
        "--chunk-timeout-secs",
        "5",
    ]);
    let config = args.llm.provider_config().unwrap();
    let ProviderConfig::Ollama {
        call,
        endpoint,
        num_ctx,
    } = &config
    else {
        panic!("{config:?}");
    };
    assert_eq!(call.model, "llama3");
    assert_eq!(endpoint.base_url.as_deref(), Some("http://ollama:11434"));
    assert_eq!(call.temperature, Some(0.3));
    assert_eq!(call.max_output_tokens, Some(50));
    assert_eq!(*num_ctx, Some(4096));
    let t = call.timeouts;
    assert_eq!(
        (t.connect, t.first_token, t.between_chunks),
        (
            Duration::from_secs(3),
            Duration::from_secs(4),
            Duration::from_secs(5)
        )
    );
    assert!(config.build().is_ok(), "Ollama needs no key");
}

/// A flag of another provider's setting is refused when the provider is built, naming the
/// setting and the provider, as a file's key is.
#[test]
fn a_flag_of_another_providers_setting_is_refused() {
    for (argv, says) in [
        (
            &["--provider", "openai", "--region", "us-east-1"][..],
            "`region` (--region) does not apply to provider openai",
        ),
        (
            &["--provider", "anthropic", "--num-ctx", "8192"][..],
            "`num-ctx` (--num-ctx, SLUICE_NUM_CTX) does not apply to provider anthropic",
        ),
        (
            &["--provider", "ollama", "--no-stream-usage"][..],
            "`no-stream-usage` (--no-stream-usage) does not apply to provider ollama",
        ),
    ] {
        let args = parse(argv);
        let e = args.llm.provider_config().unwrap_err();
        assert!(e.contains(says), "{argv:?}: {e}");
        let e = service(&args.llm, &Telemetry::new().unwrap())
            .err()
            .unwrap();
        assert!(e.contains(says), "{argv:?}: {e}");
    }
}

#[test]
fn an_unknown_provider_is_refused_by_the_parser() {
    let e = Command::try_parse_from(["text-completion", "--provider", "nope"])
        .err()
        .unwrap();
    assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
}

#[test]
fn by_default_the_processor_serves_text_completions_own_topics() {
    let args = parse(&[]);
    for (mapping, request, response) in [
        (
            TopicMapping::Durable,
            "persistent://tg/request/text-completion",
            "persistent://tg/response/text-completion",
        ),
        (
            TopicMapping::TrustGraph,
            "non-persistent://tg/request/text-completion",
            "non-persistent://tg/response/text-completion",
        ),
    ] {
        let (config, topics) =
            processor_config("text-completion", &args.processor, mapping).unwrap();
        assert_eq!(config.request_topic, request);
        assert_eq!(config.response_topic, response);
        let cancel: TopicName = "notify:tg:text-completion-cancel".parse().unwrap();
        assert_eq!(config.cancel_topic, Some(cancel.to_pulsar(mapping)));
        assert_eq!(config.subscription, "text-completion");
        // The namespaces to create before connecting: the three topics'.
        assert_eq!(topics.len(), 3);
    }
}

#[test]
fn given_topics_and_limits_replace_the_defaults() {
    let args = parse(&[
        "--request-topic",
        "persistent://public/default/in",
        "--response-topic",
        "response:tg:elsewhere",
        "--cancel-topic",
        "persistent://public/default/stop",
        "--subscription",
        "tc-blue",
        "--concurrency",
        "7",
        "--drain-grace-secs",
        "3",
    ]);
    let (config, _) =
        processor_config("text-completion", &args.processor, TopicMapping::Durable).unwrap();
    assert_eq!(config.request_topic, "persistent://public/default/in");
    assert_eq!(config.response_topic, "persistent://tg/response/elsewhere");
    assert_eq!(
        config.cancel_topic.as_deref(),
        Some("persistent://public/default/stop")
    );
    assert_eq!(config.subscription, "tc-blue");
    assert_eq!(config.concurrency, 7);
    assert_eq!(config.drain_grace, std::time::Duration::from_secs(3));
}

#[test]
fn a_malformed_topic_name_is_an_error_before_anything_connects() {
    let args = parse(&["--request-topic", "no-class-here"]);
    let e = processor_config("text-completion", &args.processor, TopicMapping::Durable)
        .err()
        .unwrap();
    assert!(e.contains("no-class-here"), "{e}");
}

#[test]
fn the_handler_serves_its_model_and_the_extra_ones() {
    let args = parse(&[
        "--provider",
        "ollama",
        "--model",
        "main",
        "--extra-models",
        "second, ,third",
    ]);
    let telemetry = Telemetry::new().unwrap();
    let service = service(&args.llm, &telemetry).unwrap();
    assert_eq!(service.models(), ["main", "second", "third"]);
}

/// A `--fallback` file in a temporary directory.
fn fallback_file(text: &str) -> (std::path::PathBuf, impl Drop) {
    struct Gone(std::path::PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let path = std::env::temp_dir().join(format!(
        "sluice-fallback-{}-{}.toml",
        std::process::id(),
        uuid::Uuid::new_v4()
    ));
    std::fs::write(&path, text).unwrap();
    (path.clone(), Gone(path))
}

/// The file's `[[provider]]` tables, in order, with the provider options' names and
/// `key-env`.
#[test]
fn a_fallback_file_lists_its_providers_in_order() {
    let (path, _gone) = fallback_file(
        r#"
        [[provider]]
        provider = "anthropic"
        model = "claude-sonnet-4-5"
        key-env = "ANTHROPIC_BACKUP_KEY"

        [[provider]]
        provider = "openai-compatible"
        model = "smollm2"
        base-url = "http://127.0.0.1:8766"
        first-token-timeout-secs = 5
        "#,
    );
    let list = fallback_list(&path).unwrap();
    assert_eq!(list.len(), 2);
    let ProviderConfig::Anthropic { call, endpoint } = &list[0] else {
        panic!("{:?}", list[0]);
    };
    assert_eq!(call.model, "claude-sonnet-4-5");
    assert_eq!(
        endpoint.api_key_env.as_deref(),
        Some("ANTHROPIC_BACKUP_KEY")
    );
    let ProviderConfig::OpenaiCompatible { call, base_url, .. } = &list[1] else {
        panic!("{:?}", list[1]);
    };
    assert_eq!(base_url, "http://127.0.0.1:8766");
    assert_eq!(call.timeouts.first_token, Duration::from_secs(5));
}

/// What cannot be used is refused with the file's path and what is wrong, before anything
/// runs: a missing file, a misspelt setting, no table, a provider that cannot be built.
#[test]
fn a_bad_fallback_file_is_refused_saying_what_is_wrong() {
    let missing = std::path::Path::new("/nonexistent/fallback.toml");
    let e = fallback_list(missing).unwrap_err();
    assert!(
        e.contains("/nonexistent/fallback.toml") && e.contains("cannot read"),
        "{e}"
    );
    for (text, says) in [
        (
            "[[provider]]\nprovider = \"openai\"\nmodel = \"m\"\nbase_url = \"http://x\"\n",
            "unknown field `base_url`",
        ),
        ("# nothing\n", "no [[provider]] table"),
        (
            "[[provider]]\nprovider = \"gpt\"\nmodel = \"m\"\n",
            "unknown variant `gpt`",
        ),
        (
            "[[provider]]\nprovider = \"azure\"\nmodel = \"m\"\n",
            "`base-url` (--base-url, SLUICE_BASE_URL) is required for provider azure",
        ),
        (
            "[[provider]]\nprovider = \"openai\"\nmodel = \"m\"\nkey-env = \"A KEY\"\n",
            "is not an environment variable's name",
        ),
        (
            "[[provider]]\nprovider = \"openai\"\nmodel = \"m\"\nregion = \"us-east-1\"\n",
            "`region` (--region) does not apply to provider openai",
        ),
    ] {
        let (path, _gone) = fallback_file(text);
        let e = fallback_list(&path).unwrap_err();
        assert!(e.contains(says), "{text}: {e}");
    }
    // A provider that is described but cannot be built: named by its place and model.
    let (path, _gone) = fallback_file(
        "[[provider]]\nprovider = \"ollama\"\nmodel = \"m\"\nbase-url = \"localhost:11434\"\n",
    );
    let path = path.to_str().unwrap().to_owned();
    let args = parse(&["--provider", "ollama", "--fallback", &path]);
    let e = service(&args.llm, &Telemetry::new().unwrap())
        .err()
        .unwrap();
    assert!(
        e.contains("provider 1 (m)") && e.contains("not a valid URL"),
        "{e}"
    );
}

/// The deadline and the hedge need a list to move to; zero is not a duration.
#[test]
fn fallback_timings_need_a_fallback_list_and_a_duration() {
    let telemetry = Telemetry::new().unwrap();
    let args = parse(&[
        "--provider",
        "openai-compatible",
        "--base-url",
        "http://127.0.0.1:9",
        "--hedge-after-ms",
        "200",
    ]);
    let e = service(&args.llm, &telemetry).err().unwrap();
    assert!(e.contains("need --fallback"), "{e}");
    let (path, _gone) = fallback_file("[[provider]]\nprovider = \"openai\"\nmodel = \"m\"\n");
    let path = path.to_str().unwrap().to_owned();
    let args = parse(&[
        "--provider",
        "openai-compatible",
        "--base-url",
        "http://127.0.0.1:9",
        "--fallback",
        &path,
        "--first-token-deadline-ms",
        "0",
    ]);
    let e = service(&args.llm, &Telemetry::new().unwrap())
        .err()
        .unwrap();
    assert!(
        e.contains("--first-token-deadline-ms: expected at least 1 ms"),
        "{e}"
    );
    // A good list: the processor still serves (and is labelled by) its own provider first.
    let args = parse(&[
        "--model",
        "primary",
        "--fallback",
        &path,
        "--hedge-after-ms",
        "200",
    ]);
    let s = service(&args.llm, &Telemetry::new().unwrap()).unwrap();
    assert_eq!(s.models(), ["primary"]);
}

/// Every shipped config file of a command with provider settings (compose, Kubernetes, `sluice
/// serve`) describes a provider its settings apply to: parsed as the binary parses it, then
/// checked per provider.
#[test]
fn every_shipped_provider_config_describes_its_provider() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    for (command, file) in [
        ("text-completion", "compose/text-completion.toml"),
        ("text-completion", "k8s/base/config/text-completion.toml"),
        (
            "text-completion",
            "k8s/overlays/example/config/text-completion.toml",
        ),
        ("serve", "serve/local-llm.toml"),
    ] {
        let path = root.join(file);
        let argv = ["sluice", command, "--config", path.to_str().unwrap()]
            .map(std::ffi::OsString::from)
            .to_vec();
        let invocation = crate::parse(argv).unwrap_or_else(|e| panic!("{file}: {e}"));
        let llm = match &invocation.cli.command {
            crate::Command::TextCompletion(args) => &args.llm,
            crate::Command::Serve(args) => &args.llm,
            _ => unreachable!(),
        };
        let config = llm
            .provider_config()
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(!config.call().model.is_empty(), "{file}");
    }
}
