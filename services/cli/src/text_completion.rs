//! `sluice text-completion`: the text-completion processor as a process.

use std::sync::Arc;

use clap::Args;
use sluice_runtime::{
    flows::run_flows_until_signalled, processor::run_until_signalled, telemetry::Telemetry,
};
pub use sluice_text_completion::config::ProviderKind;
use sluice_text_completion::{
    config::ProviderConfig, flows::TextCompletionFlows, handler::TextCompletionService,
    metrics::LlmMetrics, retry::RetryPolicy,
};

use crate::common::{
    BusArgs, ConfigFileArgs, ConfigServiceArgs, ProcessorArgs, connect, processor_config,
};

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
    /// Vertex AI project (vertex, vertex-anthropic).
    #[arg(long, env = "SLUICE_VERTEX_PROJECT")]
    vertex_project: Option<String>,
    /// Vertex AI location: a region, or `global`.
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
    /// How a call that fails before its first chunk is published is retried: a preset
    /// (`default`, `seed-000`, `seed-001`, `seed-002`), settings (`attempts=2,delay=2s,
    /// factor=1,max-delay=8s,jitter=0,on=connect+timeout+503,hints=false`) or a preset then
    /// settings. A request's or template's `retry` applies over this.
    #[arg(long, env = "SLUICE_RETRY", default_value = "default")]
    retry: String,
    /// Retries of a call that fails before its first chunk is published (the same as
    /// `--retry ...,attempts=N+1`; kept for existing deployments).
    #[arg(long)]
    max_retries: Option<u32>,
}

impl LlmArgs {
    /// The provider these options describe.
    pub fn provider_config(&self) -> ProviderConfig {
        ProviderConfig {
            provider: self.provider,
            model: self.model.clone(),
            base_url: self.base_url.clone(),
            temperature: self.temperature,
            max_output_tokens: self.max_output_tokens,
            vertex_project: self.vertex_project.clone(),
            vertex_location: self.vertex_location.clone(),
            region: self.region.clone(),
            num_ctx: self.num_ctx,
            no_stream_usage: self.no_stream_usage,
            connect_timeout_secs: self.connect_timeout_secs,
            first_token_timeout_secs: self.first_token_timeout_secs,
            chunk_timeout_secs: self.chunk_timeout_secs,
        }
    }
}

/// The text-completion handler `args` describe, its metrics registered in `telemetry`.
pub fn service(args: &LlmArgs, telemetry: &Telemetry) -> Result<TextCompletionService, String> {
    let provider = args.provider_config().build()?;
    let metrics = LlmMetrics::register(&telemetry.registry).map_err(|e| e.to_string())?;
    let mut retry = RetryPolicy::parse(&args.retry).map_err(|e| format!("--retry: {e}"))?;
    if let Some(n) = args.max_retries {
        retry = retry
            .with(&format!("attempts={}", n.saturating_add(1)))
            .map_err(|e| format!("--max-retries: {e}"))?;
    }
    Ok(
        TextCompletionService::new(provider, retry, metrics).with_models(
            args.extra_models
                .iter()
                .map(|m| m.trim().to_owned())
                .filter(|m| !m.is_empty()),
        ),
    )
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
        let service = Arc::new(TextCompletionFlows::new(&handler));
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

#[cfg(test)]
mod tests;
