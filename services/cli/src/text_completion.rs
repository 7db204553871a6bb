//! `sluice text-completion`: the text-completion processor as a process.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use clap::{Args, ValueEnum};
use sluice_runtime::{
    flows::{FlowKey, FlowService, run_flows_until_signalled},
    processor::run_until_signalled,
    secret::Secret,
    telemetry::Telemetry,
};
use sluice_schema::config::FlowDefinition;
use sluice_text_completion::{
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::Provider,
    providers::{
        HttpTimeouts,
        anthropic::{AnthropicConfig, AnthropicProvider},
        bedrock::{BedrockConfig, BedrockCredentials, BedrockProvider},
        cohere::{CohereConfig, CohereProvider},
        gemini::{GeminiConfig, GeminiEndpoint, GeminiProvider},
        ollama::{OllamaConfig, OllamaProvider},
        openai::{Dialect, OpenAiConfig, OpenAiProvider},
    },
    retry::RetryPolicy,
};

use crate::common::{
    BusArgs, ConfigFileArgs, ConfigServiceArgs, ProcessorArgs, connect, processor_config,
};

/// Which provider serves the completions.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ProviderKind {
    /// OpenAI (key: OPENAI_API_KEY).
    Openai,
    /// Any OpenAI-compatible server by base URL: vLLM, LM Studio, llamafile, TGI, llama.cpp
    /// (key, if the server wants one: SLUICE_LLM_API_KEY).
    OpenaiCompatible,
    /// Azure OpenAI (key: AZURE_OPENAI_API_KEY; --model is the deployment).
    Azure,
    /// Mistral (key: MISTRAL_API_KEY).
    Mistral,
    /// Anthropic Messages (key: ANTHROPIC_API_KEY).
    Anthropic,
    /// Cohere v2 chat (key: COHERE_API_KEY).
    Cohere,
    /// Google AI Studio Gemini (key: GEMINI_API_KEY).
    Gemini,
    /// Vertex AI Gemini (OAuth access token: VERTEX_ACCESS_TOKEN, kept fresh by the platform;
    /// needs --vertex-project and --vertex-location).
    Vertex,
    /// Ollama's native API (`/api/chat`, NDJSON; optional key for a proxy: OLLAMA_API_KEY).
    Ollama,
    /// AWS Bedrock Converse (needs --region; --model is the model or inference-profile id).
    /// Credentials: a Bedrock API key in AWS_BEARER_TOKEN_BEDROCK, or SigV4 keys in
    /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally AWS_SESSION_TOKEN; each may
    /// be a file named by *_FILE.
    Bedrock,
}

/// `sluice text-completion` options.
#[derive(Args, Debug)]
pub struct TextCompletionArgs {
    #[command(flatten)]
    pub config: ConfigFileArgs,
    #[command(flatten)]
    bus: BusArgs,
    #[command(flatten)]
    processor: ProcessorArgs,
    #[command(flatten)]
    flows: ConfigServiceArgs,
    #[command(flatten)]
    llm: LlmArgs,
}

/// The provider and how to call it (shared by `text-completion` and `serve`).
#[derive(Args, Debug, Clone)]
pub struct LlmArgs {
    /// The provider.
    #[arg(long, env = "SLUICE_PROVIDER", value_enum, default_value = "openai")]
    provider: ProviderKind,
    /// The model (Azure: the deployment name).
    #[arg(long, env = "SLUICE_MODEL", default_value = "gpt-4o-mini")]
    model: String,
    /// Other models of the same provider a request may ask for by name (comma-separated);
    /// `list-models` and `GET /v1/models` list them after --model.
    #[arg(long, env = "SLUICE_EXTRA_MODELS", value_delimiter = ',')]
    extra_models: Vec<String>,
    /// The provider's base URL (default: the provider's public endpoint).
    #[arg(long, env = "SLUICE_BASE_URL")]
    base_url: Option<String>,
    /// Sampling temperature.
    #[arg(long, env = "SLUICE_TEMPERATURE")]
    temperature: Option<f32>,
    /// Maximum output tokens.
    #[arg(long, env = "SLUICE_MAX_OUTPUT_TOKENS")]
    max_output_tokens: Option<u32>,
    /// Vertex AI project.
    #[arg(long, env = "SLUICE_VERTEX_PROJECT")]
    vertex_project: Option<String>,
    /// Vertex AI location.
    #[arg(long, env = "SLUICE_VERTEX_LOCATION", default_value = "us-central1")]
    vertex_location: String,
    /// AWS region of Bedrock, e.g. us-east-1.
    #[arg(long, env = "AWS_REGION")]
    region: Option<String>,
    /// Ollama's context window (`num_ctx`).
    #[arg(long, env = "SLUICE_NUM_CTX")]
    num_ctx: Option<u32>,
    /// Do not ask for usage in streams (older servers reject `stream_options`).
    #[arg(long)]
    no_stream_usage: bool,
    /// Seconds to establish a connection.
    #[arg(long, default_value_t = 10)]
    connect_timeout_secs: u64,
    /// Seconds to the first token.
    #[arg(long, default_value_t = 60)]
    first_token_timeout_secs: u64,
    /// Seconds between chunks.
    #[arg(long, default_value_t = 60)]
    chunk_timeout_secs: u64,
    /// Retries of a call that fails before its first chunk is published.
    #[arg(long, default_value_t = 2)]
    max_retries: u32,
}

fn timeouts(args: &LlmArgs) -> HttpTimeouts {
    HttpTimeouts {
        connect: Duration::from_secs(args.connect_timeout_secs),
        first_token: Duration::from_secs(args.first_token_timeout_secs),
        between_chunks: Duration::from_secs(args.chunk_timeout_secs),
    }
}

/// The OpenAI-family dialect, its key variable and default base URL; `None` for the others.
fn openai_dialect(kind: ProviderKind) -> Option<(Dialect, &'static str, Option<&'static str>)> {
    match kind {
        ProviderKind::Openai => Some((
            Dialect::OpenAi,
            "OPENAI_API_KEY",
            Some("https://api.openai.com"),
        )),
        ProviderKind::OpenaiCompatible => Some((Dialect::Compatible, "SLUICE_LLM_API_KEY", None)),
        ProviderKind::Azure => Some((Dialect::Azure, "AZURE_OPENAI_API_KEY", None)),
        ProviderKind::Mistral => Some((
            Dialect::Mistral,
            "MISTRAL_API_KEY",
            Some("https://api.mistral.ai"),
        )),
        ProviderKind::Ollama
        | ProviderKind::Bedrock
        | ProviderKind::Anthropic
        | ProviderKind::Cohere
        | ProviderKind::Gemini
        | ProviderKind::Vertex => None,
    }
}

fn provider(args: &LlmArgs) -> Result<Arc<dyn Provider>, String> {
    if let ProviderKind::Gemini | ProviderKind::Vertex = args.provider {
        let (endpoint, var, base) = if let ProviderKind::Vertex = args.provider {
            let project = args
                .vertex_project
                .clone()
                .ok_or("--vertex-project (or SLUICE_VERTEX_PROJECT) is required for vertex")?;
            let location = args.vertex_location.clone();
            let base = format!("https://{location}-aiplatform.googleapis.com");
            (
                GeminiEndpoint::Vertex { project, location },
                "VERTEX_ACCESS_TOKEN",
                base,
            )
        } else {
            let base = "https://generativelanguage.googleapis.com".to_owned();
            (GeminiEndpoint::AiStudio, "GEMINI_API_KEY", base)
        };
        let mut config = GeminiConfig::new(
            endpoint,
            args.base_url.clone().unwrap_or(base),
            args.model.clone(),
        );
        config.credential = Secret::from_env(var).map_err(|e| e.to_string())?;
        config.credential_source = format!("{var} (or the file named by {var}_FILE)");
        config.temperature = args.temperature;
        config.max_output_tokens = args.max_output_tokens;
        config.timeouts = timeouts(args);
        return Ok(Arc::new(
            GeminiProvider::new(config).map_err(|e| e.to_string())?,
        ));
    }
    if let ProviderKind::Bedrock = args.provider {
        return bedrock(args);
    }
    if let ProviderKind::Cohere = args.provider {
        let base = args
            .base_url
            .clone()
            .unwrap_or_else(|| "https://api.cohere.com".into());
        let mut config = CohereConfig::new(base, args.model.clone());
        config.api_key = Secret::from_env("COHERE_API_KEY").map_err(|e| e.to_string())?;
        config.api_key_source = "COHERE_API_KEY (or the file named by COHERE_API_KEY_FILE)".into();
        config.temperature = args.temperature;
        config.max_tokens = args.max_output_tokens;
        config.timeouts = timeouts(args);
        return Ok(Arc::new(
            CohereProvider::new(config).map_err(|e| e.to_string())?,
        ));
    }
    if let ProviderKind::Anthropic = args.provider {
        let base = args
            .base_url
            .clone()
            .unwrap_or_else(|| "https://api.anthropic.com".into());
        let mut config = AnthropicConfig::new(base, args.model.clone());
        config.api_key = Secret::from_env("ANTHROPIC_API_KEY").map_err(|e| e.to_string())?;
        config.api_key_source =
            "ANTHROPIC_API_KEY (or the file named by ANTHROPIC_API_KEY_FILE)".into();
        config.temperature = args.temperature;
        if let Some(m) = args.max_output_tokens {
            config.max_tokens = m;
        }
        config.timeouts = timeouts(args);
        return Ok(Arc::new(
            AnthropicProvider::new(config).map_err(|e| e.to_string())?,
        ));
    }
    let Some((dialect, key_var, default_base)) = openai_dialect(args.provider) else {
        let base = args
            .base_url
            .clone()
            .unwrap_or_else(|| "http://127.0.0.1:11434".into());
        let mut config = OllamaConfig::new(base, args.model.clone());
        config.api_key = Secret::from_env("OLLAMA_API_KEY").map_err(|e| e.to_string())?;
        config.api_key_source = "OLLAMA_API_KEY (or the file named by OLLAMA_API_KEY_FILE)".into();
        config.temperature = args.temperature;
        config.num_ctx = args.num_ctx;
        config.num_predict = args.max_output_tokens;
        config.timeouts = timeouts(args);
        return Ok(Arc::new(
            OllamaProvider::new(config).map_err(|e| e.to_string())?,
        ));
    };
    let base = args
        .base_url
        .clone()
        .or(default_base.map(str::to_owned))
        .ok_or_else(|| {
            format!(
                "--base-url (or SLUICE_BASE_URL) is required for {:?}",
                args.provider
            )
        })?;
    let mut config = OpenAiConfig::new(dialect, base, args.model.clone());
    config.api_key = Secret::from_env(key_var).map_err(|e| e.to_string())?;
    config.api_key_source = format!("{key_var} (or the file named by {key_var}_FILE)");
    config.temperature = args.temperature;
    config.max_tokens = args.max_output_tokens;
    config.include_usage = !args.no_stream_usage && dialect != Dialect::Mistral;
    config.timeouts = HttpTimeouts {
        connect: Duration::from_secs(args.connect_timeout_secs),
        first_token: Duration::from_secs(args.first_token_timeout_secs),
        between_chunks: Duration::from_secs(args.chunk_timeout_secs),
    };
    Ok(Arc::new(
        OpenAiProvider::new(config).map_err(|e| e.to_string())?,
    ))
}

fn bedrock(args: &LlmArgs) -> Result<Arc<dyn Provider>, String> {
    let region = args
        .region
        .clone()
        .ok_or("--region (or AWS_REGION) is required for bedrock")?;
    let mut config = BedrockConfig::new(region, args.model.clone());
    config.credentials = BedrockCredentials::from_env().map_err(|e| e.to_string())?;
    match (&config.credentials, &args.base_url) {
        // A custom endpoint may be a proxy that signs for us; AWS itself never accepts an
        // unsigned call, so say so now rather than on every request.
        (BedrockCredentials::None, None) => {
            return Err(format!("bedrock needs {}", config.credentials.source()));
        }
        (_, Some(base)) => config.base_url = base.clone(),
        (_, None) => {}
    }
    config.temperature = args.temperature;
    config.max_tokens = args.max_output_tokens;
    config.timeouts = timeouts(args);
    Ok(Arc::new(
        BedrockProvider::new(config).map_err(|e| e.to_string())?,
    ))
}

/// The text-completion handler `args` describe, its metrics registered in `telemetry`.
pub fn service(args: &LlmArgs, telemetry: &Telemetry) -> Result<TextCompletionService, String> {
    let provider = provider(args)?;
    let metrics = LlmMetrics::register(&telemetry.registry).map_err(|e| e.to_string())?;
    let retry = RetryPolicy {
        max_retries: args.max_retries,
        ..RetryPolicy::default()
    };
    Ok(
        TextCompletionService::new(provider, retry, metrics).with_models(
            args.extra_models
                .iter()
                .map(|m| m.trim().to_owned())
                .filter(|m| !m.is_empty()),
        ),
    )
}

/// The text-completion flows TrustGraph's config service assigns: each flow's topics, and
/// its `model` and `temperature` parameters as defaults for the requests that set neither.
struct Flows {
    service: TextCompletionService,
}

#[async_trait]
impl FlowService for Flows {
    type Handler = TextCompletionService;

    async fn flow(
        &self,
        _key: &FlowKey,
        definition: &FlowDefinition,
    ) -> Result<Arc<TextCompletionService>, String> {
        let temperature = match definition.parameter("temperature") {
            Some(t) => Some(
                t.parse::<f64>()
                    .ok()
                    .filter(|t| (0.0..=2.0).contains(t))
                    .ok_or_else(|| {
                        "the flow's `temperature` parameter: expected a number from 0 to 2"
                            .to_owned()
                    })?,
            ),
            None => None,
        };
        let handler = self
            .service
            .for_flow(definition.parameter("model"), temperature);
        Ok(Arc::new(handler))
    }
}

/// Runs the processor until SIGTERM/SIGINT, then drains.
pub async fn run(args: TextCompletionArgs) -> Result<(), String> {
    let telemetry = Telemetry::new().map_err(|e| e.to_string())?;
    let handler = Arc::new(service(&args.llm, &telemetry)?);
    let mapping = args.bus.topic_mapping;
    let (config, mut topics) = processor_config("text-completion", &args.processor, mapping)?;
    if let Some(flows) = args
        .flows
        .flows("text-completion", mapping, &args.processor, &config)?
    {
        topics.extend(args.flows.topic_names()?);
        let bus = connect(&args.bus, &topics).await?;
        let service = Arc::new(Flows {
            service: handler.for_flow(None, None),
        });
        run_flows_until_signalled(bus, flows, service, telemetry, args.processor.metrics_addr)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    let bus = connect(&args.bus, &topics).await?;
    run_until_signalled(bus, config, handler, telemetry, args.processor.metrics_addr)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}
