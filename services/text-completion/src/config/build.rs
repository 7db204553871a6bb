//! A provider description built into a provider: each variant's settings, its call
//! settings and its key.

use super::*;

impl ProviderConfig {
    /// A description of `model` at `provider`, every other setting at its default (a provider
    /// that cannot go without one, such as `azure` without a base URL, is refused).
    pub fn new(provider: ProviderKind, model: impl Into<String>) -> Result<Self, ConfigError> {
        Self::try_from(ProviderOptions::new(provider, model))
    }

    /// The provider.
    pub fn kind(&self) -> ProviderKind {
        match self {
            ProviderConfig::Openai { .. } => ProviderKind::Openai,
            ProviderConfig::OpenaiCompatible { .. } => ProviderKind::OpenaiCompatible,
            ProviderConfig::Azure { .. } => ProviderKind::Azure,
            ProviderConfig::Mistral { .. } => ProviderKind::Mistral,
            ProviderConfig::Anthropic { .. } => ProviderKind::Anthropic,
            ProviderConfig::Cohere { .. } => ProviderKind::Cohere,
            ProviderConfig::Gemini { .. } => ProviderKind::Gemini,
            ProviderConfig::Vertex { .. } => ProviderKind::Vertex,
            ProviderConfig::VertexAnthropic { .. } => ProviderKind::VertexAnthropic,
            ProviderConfig::Ollama { .. } => ProviderKind::Ollama,
            ProviderConfig::Bedrock { .. } => ProviderKind::Bedrock,
        }
    }

    /// Model, sampling and time limits, which every provider takes.
    pub fn call(&self) -> &CallSettings {
        match self {
            ProviderConfig::Openai { call, .. }
            | ProviderConfig::OpenaiCompatible { call, .. }
            | ProviderConfig::Azure { call, .. }
            | ProviderConfig::Mistral { call, .. }
            | ProviderConfig::Anthropic { call, .. }
            | ProviderConfig::Cohere { call, .. }
            | ProviderConfig::Gemini { call, .. }
            | ProviderConfig::Vertex { call, .. }
            | ProviderConfig::VertexAnthropic { call, .. }
            | ProviderConfig::Ollama { call, .. }
            | ProviderConfig::Bedrock { call, .. } => call,
        }
    }

    /// The provider, its secret read from the environment. The error says what is missing
    /// and where to put it; it never contains a secret.
    ///
    /// Long because it is one arm per provider (ten), each a few lines that name its key
    /// variable and its call settings: one `match` shows that every provider is built the
    /// same way, and a new provider is one more arm.
    pub fn build(&self) -> Result<Arc<dyn Provider>, ConfigError> {
        let kind = self.kind();
        let call = self.call();
        let model = call.model.clone();
        let base = |endpoint: &Endpoint, public: &str| {
            endpoint
                .base_url
                .clone()
                .unwrap_or_else(|| public.to_owned())
        };
        let vendor_key = |vendor: &Vendor, endpoint: &Endpoint| {
            key(
                kind,
                vendor,
                endpoint.base_url.as_deref(),
                endpoint.api_key_env.as_deref(),
            )
        };
        let provider: Arc<dyn Provider> = match self {
            ProviderConfig::Openai {
                endpoint,
                stream_usage,
                ..
            } => {
                let mut config = OpenAiConfig::new(
                    Dialect::OpenAi,
                    base(endpoint, "https://api.openai.com"),
                    model,
                );
                (config.api_key, config.api_key_source) = vendor_key(&Vendor::OPENAI, endpoint)?;
                config.include_usage = *stream_usage;
                Arc::new(OpenAiProvider::new(openai_call(config, call))?)
            }
            ProviderConfig::OpenaiCompatible {
                base_url,
                api_key_env,
                stream_usage,
                ..
            } => {
                // SLUICE_LLM_API_KEY is sluice's own, for whatever server is configured.
                let var = api_key_env.as_deref().unwrap_or("SLUICE_LLM_API_KEY");
                let mut config = OpenAiConfig::new(Dialect::Compatible, base_url.clone(), model);
                (config.api_key, config.api_key_source) = (Secret::from_env(var)?, source(var));
                config.include_usage = *stream_usage;
                Arc::new(OpenAiProvider::new(openai_call(config, call))?)
            }
            ProviderConfig::Azure {
                base_url,
                api_key_env,
                stream_usage,
                ..
            } => {
                let mut config = OpenAiConfig::new(Dialect::Azure, base_url.clone(), model);
                (config.api_key, config.api_key_source) =
                    key(kind, &Vendor::AZURE, Some(base_url), api_key_env.as_deref())?;
                config.include_usage = *stream_usage;
                Arc::new(OpenAiProvider::new(openai_call(config, call))?)
            }
            ProviderConfig::Mistral { endpoint, .. } => {
                let mut config = OpenAiConfig::new(
                    Dialect::Mistral,
                    base(endpoint, "https://api.mistral.ai"),
                    model,
                );
                (config.api_key, config.api_key_source) = vendor_key(&Vendor::MISTRAL, endpoint)?;
                // Mistral rejects `stream_options`.
                config.include_usage = false;
                Arc::new(OpenAiProvider::new(openai_call(config, call))?)
            }
            ProviderConfig::Anthropic { endpoint, .. } => {
                let mut config =
                    AnthropicConfig::new(base(endpoint, "https://api.anthropic.com"), model);
                (config.credential, config.credential_source) =
                    vendor_key(&Vendor::ANTHROPIC, endpoint)?;
                Arc::new(AnthropicProvider::new(anthropic_call(config, call))?)
            }
            ProviderConfig::VertexAnthropic { endpoint, site, .. } => {
                let mut config = AnthropicConfig::vertex(
                    site.project.clone(),
                    site.location.clone(),
                    base(endpoint, &vertex_origin(&site.location)),
                    model,
                );
                // The same token as Gemini on Vertex: one credential per project.
                (config.credential, config.credential_source) =
                    vendor_key(&Vendor::VERTEX, endpoint)?;
                Arc::new(AnthropicProvider::new(anthropic_call(config, call))?)
            }
            ProviderConfig::Cohere { endpoint, .. } => {
                let mut config = CohereConfig::new(base(endpoint, "https://api.cohere.com"), model);
                (config.api_key, config.api_key_source) = vendor_key(&Vendor::COHERE, endpoint)?;
                config.temperature = call.temperature;
                config.max_tokens = call.max_output_tokens;
                config.timeouts = call.timeouts;
                Arc::new(CohereProvider::new(config)?)
            }
            ProviderConfig::Gemini { endpoint, .. } => {
                let public = "https://generativelanguage.googleapis.com";
                let config =
                    GeminiConfig::new(GeminiEndpoint::AiStudio, base(endpoint, public), model);
                let credential = vendor_key(&Vendor::GEMINI, endpoint)?;
                Arc::new(GeminiProvider::new(gemini_call(config, credential, call))?)
            }
            ProviderConfig::Vertex { endpoint, site, .. } => {
                let public = vertex_origin(&site.location);
                let place = GeminiEndpoint::Vertex {
                    project: site.project.clone(),
                    location: site.location.clone(),
                };
                let config = GeminiConfig::new(place, base(endpoint, &public), model);
                let credential = vendor_key(&Vendor::VERTEX, endpoint)?;
                Arc::new(GeminiProvider::new(gemini_call(config, credential, call))?)
            }
            ProviderConfig::Ollama {
                endpoint, num_ctx, ..
            } => {
                let mut config = OllamaConfig::new(base(endpoint, "http://127.0.0.1:11434"), model);
                (config.api_key, config.api_key_source) = vendor_key(&Vendor::OLLAMA, endpoint)?;
                config.temperature = call.temperature;
                config.num_ctx = *num_ctx;
                config.num_predict = call.max_output_tokens;
                config.timeouts = call.timeouts;
                Arc::new(OllamaProvider::new(config)?)
            }
            ProviderConfig::Bedrock {
                endpoint, region, ..
            } => Arc::new(bedrock(kind, endpoint, region.as_deref(), call)?),
        };
        Ok(provider)
    }
}

/// An OpenAI-dialect config with `call`'s sampling and limits.
pub(super) fn openai_call(mut config: OpenAiConfig, call: &CallSettings) -> OpenAiConfig {
    config.temperature = call.temperature;
    config.max_tokens = call.max_output_tokens;
    config.timeouts = call.timeouts;
    config
}

/// An Anthropic config with `call`'s sampling and limits.
pub(super) fn anthropic_call(mut config: AnthropicConfig, call: &CallSettings) -> AnthropicConfig {
    config.temperature = call.temperature;
    if let Some(m) = call.max_output_tokens {
        config.max_tokens = m;
    }
    config.timeouts = call.timeouts;
    config
}

/// A Gemini config with its credential and `call`'s sampling and limits.
pub(super) fn gemini_call(
    mut config: GeminiConfig,
    (credential, source): (Option<Secret>, String),
    call: &CallSettings,
) -> GeminiConfig {
    (config.credential, config.credential_source) = (credential, source);
    config.temperature = call.temperature;
    config.max_output_tokens = call.max_output_tokens;
    config.timeouts = call.timeouts;
    config
}

/// The Bedrock provider. The region is the setting's, else AWS_REGION's (as the AWS SDKs
/// read it). A Bedrock API key is a bearer secret, so it follows the key rule of every
/// provider; SigV4 keys never leave the process (only per-request signatures do), so they
/// are read for any endpoint.
pub(super) fn bedrock(
    kind: ProviderKind,
    endpoint: &Endpoint,
    region: Option<&str>,
    call: &CallSettings,
) -> Result<BedrockProvider, ConfigError> {
    let region = match region {
        Some(r) => r.to_owned(),
        None => std::env::var("AWS_REGION")
            .ok()
            .filter(|r| !r.is_empty())
            .ok_or(ConfigError::NoRegion)?,
    };
    let mut config = BedrockConfig::new(region, call.model.clone());
    let (api_key, _) = key(
        kind,
        &Vendor::BEDROCK,
        endpoint.base_url.as_deref(),
        endpoint.api_key_env.as_deref(),
    )?;
    config.credentials = match api_key {
        Some(key) => BedrockCredentials::ApiKey(key),
        None => BedrockCredentials::sigv4_from_env()?,
    };
    match (&config.credentials, &endpoint.base_url) {
        // A custom endpoint may be a proxy that signs for us; AWS itself never accepts an
        // unsigned call, so say so now rather than on every request.
        (BedrockCredentials::None, None) => {
            return Err(ConfigError::Provider(ProviderError::new(
                crate::provider::FailureKind::Auth,
                format!("bedrock needs {}", config.credentials.source()),
            )));
        }
        (_, Some(base)) => config.base_url = base.clone(),
        (_, None) => {}
    }
    config.temperature = call.temperature;
    config.max_tokens = call.max_output_tokens;
    config.timeouts = call.timeouts;
    Ok(BedrockProvider::new(config)?)
}
