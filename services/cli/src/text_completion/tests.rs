//! The text-completion command's wiring, as the binary builds it from its flags: the provider
//! it calls, the processor's topics and limits (no bus connected, no provider called).

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
        "--no-stream-usage",
        "--connect-timeout-secs",
        "3",
        "--first-token-timeout-secs",
        "4",
        "--chunk-timeout-secs",
        "5",
    ]);
    let config = args.llm.provider_config();
    assert_eq!(config.provider, ProviderKind::Ollama);
    assert_eq!(config.model, "llama3");
    assert_eq!(config.base_url.as_deref(), Some("http://ollama:11434"));
    assert_eq!(config.temperature, Some(0.3));
    assert_eq!(config.max_output_tokens, Some(50));
    assert_eq!(config.num_ctx, Some(4096));
    assert!(config.no_stream_usage);
    assert_eq!(
        (
            config.connect_timeout_secs,
            config.first_token_timeout_secs,
            config.chunk_timeout_secs
        ),
        (3, 4, 5)
    );
    assert!(config.build().is_ok(), "Ollama needs no key");
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
