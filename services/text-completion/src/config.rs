//! Which provider serves the completions, and how to call it.
//!
//! Two shapes: [`ProviderOptions`], the settings as an operator gives them (the CLI's flags and
//! their variables, a `--config` file, a `[[provider]]` table of a fallback file), one flat
//! set of names for every provider; and [`ProviderConfig`], a tagged enum with one variant
//! per provider holding only that provider's settings. [`ProviderConfig::try_from`] turns the
//! first into the second and refuses a setting the provider does not take (`region` given to
//! `openai`), naming the setting and the provider; [`ProviderConfig::build`] turns the second
//! into a provider. Adding a provider means a variant of [`ProviderKind`] and of
//! [`ProviderConfig`], its module under `providers/`, and its arms here.
//!
//! Secrets are not part of either: each provider's key is read from an environment variable
//! (or the file named by `<VAR>_FILE`) when the provider is built, so a description can be
//! logged, stored in a ConfigMap or shown in an error without leaking one. Which variable:
//! the one `api-key-env` names, else the vendor's own (`OPENAI_API_KEY`...) only when the
//! base URL is the vendor's. A vendor's key is never sent to another host by default: with a
//! base URL of another host, the vendor's variable is not read, and when it is set the build
//! fails saying how to name it (docs/text-completion.md#keys).

use std::{fmt, sync::Arc, time::Duration};

use serde::Deserialize;
use sluice_runtime::secret::{Secret, SecretError};

use crate::{
    fallback::{Fallback, FallbackSettings},
    handler::TextCompletionService,
    metrics::LlmMetrics,
    provider::{Provider, ProviderError},
    providers::{
        HttpTimeouts,
        anthropic::{AnthropicConfig, AnthropicProvider},
        bedrock::{API_KEY_VAR, BedrockConfig, BedrockCredentials, BedrockProvider},
        cohere::{CohereConfig, CohereProvider},
        endpoint_url,
        gemini::{GeminiConfig, GeminiEndpoint, GeminiProvider},
        ollama::{OllamaConfig, OllamaProvider},
        openai::{Dialect, OpenAiConfig, OpenAiProvider},
        vertex_origin,
    },
    retry::RetryPolicy,
};

mod build;
mod keys;

use self::keys::{Vendor, key, source};

/// Which provider serves the completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum ProviderKind {
    /// OpenAI (key: OPENAI_API_KEY, for api.openai.com).
    Openai,
    /// Any OpenAI-compatible server by base URL: vLLM, LM Studio, llamafile, TGI, llama.cpp
    /// (key, if the server wants one: SLUICE_LLM_API_KEY).
    OpenaiCompatible,
    /// Azure OpenAI (key: AZURE_OPENAI_API_KEY, for Azure's hosts; --model is the deployment).
    Azure,
    /// Mistral (key: MISTRAL_API_KEY, for api.mistral.ai).
    Mistral,
    /// Anthropic Messages (key: ANTHROPIC_API_KEY, for api.anthropic.com).
    Anthropic,
    /// Cohere v2 chat (key: COHERE_API_KEY, for api.cohere.com).
    Cohere,
    /// Google AI Studio Gemini (key: GEMINI_API_KEY, for generativelanguage.googleapis.com).
    Gemini,
    /// Vertex AI Gemini (OAuth access token: VERTEX_ACCESS_TOKEN, kept fresh by the platform;
    /// needs --vertex-project and --vertex-location).
    Vertex,
    /// Anthropic's models on Vertex AI (rawPredict / streamRawPredict; OAuth access token:
    /// VERTEX_ACCESS_TOKEN, as for `vertex`; needs --vertex-project and --vertex-location,
    /// which may be `global`; --model is Vertex's id, e.g. claude-sonnet-4-5@20250929).
    VertexAnthropic,
    /// Ollama's native API (`/api/chat`, NDJSON; optional key for a proxy: OLLAMA_API_KEY,
    /// for the default local server or ollama.com).
    Ollama,
    /// AWS Bedrock Converse (needs --region or AWS_REGION; --model is the model or
    /// inference-profile id). Credentials: a Bedrock API key in AWS_BEARER_TOKEN_BEDROCK (for
    /// AWS's hosts), or SigV4 keys in AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally
    /// AWS_SESSION_TOKEN; each may be a file named by *_FILE.
    Bedrock,
}

impl ProviderKind {
    /// The name as the options spell it (`openai-compatible`).
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Openai => "openai",
            ProviderKind::OpenaiCompatible => "openai-compatible",
            ProviderKind::Azure => "azure",
            ProviderKind::Mistral => "mistral",
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::Cohere => "cohere",
            ProviderKind::Gemini => "gemini",
            ProviderKind::Vertex => "vertex",
            ProviderKind::VertexAnthropic => "vertex-anthropic",
            ProviderKind::Ollama => "ollama",
            ProviderKind::Bedrock => "bedrock",
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A provider's settings as an operator gives them: the same names as command-line options
/// (`--base-url`), environment variables (`SLUICE_BASE_URL`) and keys of a TOML table
/// (`base-url`). Every provider's settings are here; which apply to which provider is
/// checked by [`ProviderConfig::try_from`]. Unknown keys are refused, so a misspelt setting
/// is an error, not a silent default.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct ProviderOptions {
    /// The provider.
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "SLUICE_PROVIDER", value_enum, default_value = "openai")
    )]
    pub provider: ProviderKind,
    /// The model (Azure: the deployment name; Bedrock: the model or inference-profile id).
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "SLUICE_MODEL", default_value = "gpt-4o-mini")
    )]
    pub model: String,
    /// The provider's base URL (default: the provider's public endpoint; required for
    /// openai-compatible and azure). With a base URL that is not the vendor's, the vendor's
    /// key variable is not read: name the key's variable with --api-key-env.
    #[cfg_attr(feature = "clap", arg(long, env = "SLUICE_BASE_URL"))]
    #[serde(default)]
    pub base_url: Option<String>,
    /// The environment variable holding the provider's key (`<VAR>_FILE` works too), in place
    /// of the vendor's own (OPENAI_API_KEY...): for a base URL that is not the vendor's, or
    /// two providers of one kind with different keys. Bedrock: the variable of a Bedrock API
    /// key.
    #[cfg_attr(feature = "clap", arg(long, env = "SLUICE_API_KEY_ENV"))]
    #[serde(default, alias = "key-env")]
    pub api_key_env: Option<String>,
    /// Sampling temperature.
    #[cfg_attr(feature = "clap", arg(long, env = "SLUICE_TEMPERATURE"))]
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Maximum output tokens.
    #[cfg_attr(feature = "clap", arg(long, env = "SLUICE_MAX_OUTPUT_TOKENS"))]
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// Vertex AI project (vertex, vertex-anthropic).
    #[cfg_attr(feature = "clap", arg(long, env = "SLUICE_VERTEX_PROJECT"))]
    #[serde(default)]
    pub vertex_project: Option<String>,
    /// Vertex AI location: a region, or `global` (vertex, vertex-anthropic) [default:
    /// us-central1].
    #[cfg_attr(feature = "clap", arg(long, env = "SLUICE_VERTEX_LOCATION"))]
    #[serde(default)]
    pub vertex_location: Option<String>,
    /// AWS region of Bedrock, e.g. us-east-1 (bedrock) [default: AWS_REGION].
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(default)]
    pub region: Option<String>,
    /// Ollama's context window, `num_ctx` (ollama).
    #[cfg_attr(feature = "clap", arg(long, env = "SLUICE_NUM_CTX"))]
    #[serde(default)]
    pub num_ctx: Option<u32>,
    /// Do not ask for usage in streams; older servers reject `stream_options` (openai,
    /// openai-compatible, azure).
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(default)]
    pub no_stream_usage: bool,
    /// Seconds to establish a connection [default: 10].
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(default)]
    pub connect_timeout_secs: Option<u64>,
    /// Seconds to the first token [default: 60].
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(default)]
    pub first_token_timeout_secs: Option<u64>,
    /// Seconds between chunks [default: 60].
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(default)]
    pub chunk_timeout_secs: Option<u64>,
}

impl ProviderOptions {
    /// `model` at `provider`, nothing else set.
    pub fn new(provider: ProviderKind, model: impl Into<String>) -> Self {
        Self {
            provider,
            model: model.into(),
            base_url: None,
            api_key_env: None,
            temperature: None,
            max_output_tokens: None,
            vertex_project: None,
            vertex_location: None,
            region: None,
            num_ctx: None,
            no_stream_usage: false,
            connect_timeout_secs: None,
            first_token_timeout_secs: None,
            chunk_timeout_secs: None,
        }
    }
}

/// A setting, by its key; shown with its option and its variable, so an error says where
/// it may have come from (a file's key, a flag, the environment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting(pub &'static str);

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The variables of `ProviderOptions`' clap attributes.
        let var = match self.0 {
            "base-url" => Some("SLUICE_BASE_URL"),
            "api-key-env" => Some("SLUICE_API_KEY_ENV"),
            "vertex-project" => Some("SLUICE_VERTEX_PROJECT"),
            "vertex-location" => Some("SLUICE_VERTEX_LOCATION"),
            "num-ctx" => Some("SLUICE_NUM_CTX"),
            // `region` has none: AWS_REGION is the AWS SDKs' variable, read by Bedrock alone.
            _ => None,
        };
        match var {
            Some(var) => write!(f, "`{}` (--{}, {var})", self.0, self.0),
            None => write!(f, "`{}` (--{})", self.0, self.0),
        }
    }
}

/// Why a provider cannot be described or built. Never contains a secret; a host is named
/// without its path, query or user-info.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A setting that the provider does not take.
    #[error("{setting} does not apply to provider {provider}; it is a setting of {owners}")]
    NotApplicable {
        /// The setting.
        setting: Setting,
        /// The provider it was given to.
        provider: ProviderKind,
        /// The providers that take it.
        owners: &'static str,
    },
    /// A setting the provider cannot be built without.
    #[error("{setting} is required for provider {provider}")]
    Missing {
        /// The setting.
        setting: Setting,
        /// The provider.
        provider: ProviderKind,
    },
    /// Bedrock without a region.
    #[error("{} or AWS_REGION is required for provider bedrock", Setting("region"))]
    NoRegion,
    /// `api-key-env` names no variable.
    #[error(
        "{}: {value:?} is not an environment variable's name (letters, digits and _)",
        Setting("api-key-env")
    )]
    KeyVariableName {
        /// The first characters of the value.
        value: String,
    },
    /// The vendor's key variable is set but the base URL is another host's: it would be sent
    /// there.
    #[error(
        "{var} is set, but the base URL's host {host} is not {provider}'s, and {var} is sent only to {provider}: to send it to this host, name it with --api-key-env {var} (`api-key-env` in a file); to send no key, unset {var}"
    )]
    VendorKeyElsewhere {
        /// The vendor's variable.
        var: &'static str,
        /// The provider.
        provider: ProviderKind,
        /// The base URL's host.
        host: String,
    },
    /// A key could not be read (an unreadable `_FILE`, an empty value).
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The provider refused its settings (a base URL that is not an http(s) URL, credentials
    /// set halfway).
    #[error(transparent)]
    Provider(#[from] ProviderError),
    /// A provider of the fallback list cannot be built.
    #[error("provider {position} ({model}): {source}")]
    Fallback {
        /// Its place in the list, from 1.
        position: usize,
        /// Its model.
        model: String,
        /// Why.
        source: Box<ConfigError>,
    },
    /// The metrics cannot be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A text-completion processor's providers and how it calls them: what a front end (the
/// CLI's options, a program embedding this crate) describes, and [`ServiceConfig::service`]
/// wires into the handler.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The provider called first, whose models the processor serves.
    pub provider: ProviderConfig,
    /// Providers to fall back on, in order (empty: none).
    pub fallback: Vec<ProviderConfig>,
    /// How the fallback list behaves.
    pub fallback_settings: FallbackSettings,
    /// How a call that fails before its first chunk is retried.
    pub retry: RetryPolicy,
    /// Other models of the provider a request may ask for by name.
    pub extra_models: Vec<String>,
}

impl ServiceConfig {
    /// `provider` alone, with the default retry policy.
    pub fn new(provider: ProviderConfig) -> Self {
        Self {
            provider,
            fallback: Vec::new(),
            fallback_settings: FallbackSettings::default(),
            retry: RetryPolicy::default(),
            extra_models: Vec::new(),
        }
    }

    /// The handler: every provider built (secrets read from the environment), behind a
    /// [`Fallback`] when there is a list, its metrics registered in `registry`.
    pub fn service(
        &self,
        registry: &prometheus::Registry,
    ) -> Result<TextCompletionService, ConfigError> {
        let mut provider = self.provider.build()?;
        let metrics = LlmMetrics::register(registry)?;
        if !self.fallback.is_empty() {
            let mut backups = Vec::new();
            for (i, config) in self.fallback.iter().enumerate() {
                backups.push(config.build().map_err(|e| ConfigError::Fallback {
                    position: i + 1,
                    model: config.call().model.clone(),
                    source: Box::new(e),
                })?);
            }
            let fallback = Fallback::new(
                provider,
                backups,
                self.fallback_settings.clone(),
                metrics.clone(),
            );
            let list: Vec<String> = fallback
                .providers()
                .iter()
                .map(|(name, model)| format!("{name}/{model}"))
                .collect();
            tracing::info!(providers = %list.join(", "), "fallback list");
            provider = Arc::new(fallback) as Arc<dyn Provider>;
        }
        let extra = self
            .extra_models
            .iter()
            .map(|m| m.trim().to_owned())
            .filter(|m| !m.is_empty());
        Ok(TextCompletionService::new(provider, self.retry.clone(), metrics).with_models(extra))
    }
}

/// What every provider takes: the model, its sampling and the call's time limits.
#[derive(Debug, Clone, PartialEq)]
pub struct CallSettings {
    /// The model (Azure: the deployment name; Bedrock: the model or inference-profile id).
    pub model: String,
    /// Sampling temperature; `None` for the provider's default.
    pub temperature: Option<f32>,
    /// Maximum output tokens; `None` for the provider's default.
    pub max_output_tokens: Option<u32>,
    /// The call's time limits.
    pub timeouts: HttpTimeouts,
}

impl CallSettings {
    /// `model`, every other setting at its default.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            temperature: None,
            max_output_tokens: None,
            timeouts: HttpTimeouts::default(),
        }
    }
}

/// Where a provider with a public endpoint is called, and which variable holds its key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoint {
    /// The base URL; `None` for the vendor's public endpoint.
    pub base_url: Option<String>,
    /// The variable holding the key; `None` for the vendor's own, read only when the base
    /// URL is the vendor's.
    pub api_key_env: Option<String>,
}

/// A Vertex AI project and location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VertexSite {
    /// The project.
    pub project: String,
    /// A region, or `global`.
    pub location: String,
}

/// A provider, described: everything it is built from except its secret, one variant per
/// provider with only the settings it takes. Read from a table with [`ProviderOptions`]'
/// names (`provider = "ollama"`, `num-ctx = 8192`); a setting of another provider is refused.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "ProviderOptions")]
pub enum ProviderConfig {
    /// OpenAI.
    Openai {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL and key variable.
        endpoint: Endpoint,
        /// Ask for usage in streams (`stream_options.include_usage`).
        stream_usage: bool,
    },
    /// An OpenAI-compatible server; its key, if any, is SLUICE_LLM_API_KEY's.
    OpenaiCompatible {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// The server's base URL.
        base_url: String,
        /// The variable holding the key, in place of SLUICE_LLM_API_KEY.
        api_key_env: Option<String>,
        /// Ask for usage in streams.
        stream_usage: bool,
    },
    /// Azure OpenAI.
    Azure {
        /// Model (the deployment), sampling, time limits.
        call: CallSettings,
        /// The resource's base URL.
        base_url: String,
        /// The variable holding the key, in place of AZURE_OPENAI_API_KEY.
        api_key_env: Option<String>,
        /// Ask for usage in streams.
        stream_usage: bool,
    },
    /// Mistral.
    Mistral {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL and key variable.
        endpoint: Endpoint,
    },
    /// Anthropic Messages.
    Anthropic {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL and key variable.
        endpoint: Endpoint,
    },
    /// Cohere v2 chat.
    Cohere {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL and key variable.
        endpoint: Endpoint,
    },
    /// Gemini on Google AI Studio.
    Gemini {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL and key variable.
        endpoint: Endpoint,
    },
    /// Gemini on Vertex AI.
    Vertex {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL (in place of Vertex's origin) and token variable.
        endpoint: Endpoint,
        /// Project and location.
        site: VertexSite,
    },
    /// Anthropic's models on Vertex AI.
    VertexAnthropic {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL (in place of Vertex's origin) and token variable.
        endpoint: Endpoint,
        /// Project and location.
        site: VertexSite,
    },
    /// Ollama's native API.
    Ollama {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL (default: the local server) and key variable.
        endpoint: Endpoint,
        /// The context window (`num_ctx`).
        num_ctx: Option<u32>,
    },
    /// AWS Bedrock Converse.
    Bedrock {
        /// Model, sampling, time limits.
        call: CallSettings,
        /// Base URL (default: the region's runtime endpoint) and the Bedrock API key's variable.
        endpoint: Endpoint,
        /// The region; `None` for AWS_REGION's.
        region: Option<String>,
    },
}

/// Which providers take each setting that not all of them take.
const OWNERS: &[(&str, &str, &[ProviderKind])] = &[
    (
        "vertex-project",
        "vertex and vertex-anthropic",
        &[ProviderKind::Vertex, ProviderKind::VertexAnthropic],
    ),
    (
        "vertex-location",
        "vertex and vertex-anthropic",
        &[ProviderKind::Vertex, ProviderKind::VertexAnthropic],
    ),
    ("region", "bedrock", &[ProviderKind::Bedrock]),
    ("num-ctx", "ollama", &[ProviderKind::Ollama]),
    (
        "no-stream-usage",
        "openai, openai-compatible and azure",
        &[
            ProviderKind::Openai,
            ProviderKind::OpenaiCompatible,
            ProviderKind::Azure,
        ],
    ),
];

impl TryFrom<ProviderOptions> for ProviderConfig {
    type Error = ConfigError;

    fn try_from(o: ProviderOptions) -> Result<Self, ConfigError> {
        let kind = o.provider;
        let given = [
            ("vertex-project", o.vertex_project.is_some()),
            ("vertex-location", o.vertex_location.is_some()),
            ("region", o.region.is_some()),
            ("num-ctx", o.num_ctx.is_some()),
            ("no-stream-usage", o.no_stream_usage),
        ];
        for (key, is_given) in given {
            if let Some((key, owners, takers)) = OWNERS.iter().find(|(k, ..)| *k == key)
                && is_given
                && !takers.contains(&kind)
            {
                return Err(ConfigError::NotApplicable {
                    setting: Setting(key),
                    provider: kind,
                    owners,
                });
            }
        }
        if let Some(var) = &o.api_key_env
            && (var.is_empty() || !var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            return Err(ConfigError::KeyVariableName {
                value: var.chars().take(64).collect(),
            });
        }
        let defaults = HttpTimeouts::default();
        let secs =
            |given: Option<u64>, default: Duration| given.map_or(default, Duration::from_secs);
        let call = CallSettings {
            model: o.model,
            temperature: o.temperature,
            max_output_tokens: o.max_output_tokens,
            timeouts: HttpTimeouts {
                connect: secs(o.connect_timeout_secs, defaults.connect),
                first_token: secs(o.first_token_timeout_secs, defaults.first_token),
                between_chunks: secs(o.chunk_timeout_secs, defaults.between_chunks),
            },
        };
        let endpoint = Endpoint {
            base_url: o.base_url,
            api_key_env: o.api_key_env,
        };
        let required_base = |endpoint: Endpoint| {
            endpoint.base_url.ok_or(ConfigError::Missing {
                setting: Setting("base-url"),
                provider: kind,
            })
        };
        let site = |project: Option<String>, location: Option<String>| {
            Ok::<_, ConfigError>(VertexSite {
                project: project.ok_or(ConfigError::Missing {
                    setting: Setting("vertex-project"),
                    provider: kind,
                })?,
                location: location.unwrap_or_else(|| "us-central1".to_owned()),
            })
        };
        let stream_usage = !o.no_stream_usage;
        Ok(match kind {
            ProviderKind::Openai => ProviderConfig::Openai {
                call,
                endpoint,
                stream_usage,
            },
            ProviderKind::OpenaiCompatible => {
                let api_key_env = endpoint.api_key_env.clone();
                ProviderConfig::OpenaiCompatible {
                    call,
                    base_url: required_base(endpoint)?,
                    api_key_env,
                    stream_usage,
                }
            }
            ProviderKind::Azure => {
                let api_key_env = endpoint.api_key_env.clone();
                ProviderConfig::Azure {
                    call,
                    base_url: required_base(endpoint)?,
                    api_key_env,
                    stream_usage,
                }
            }
            ProviderKind::Mistral => ProviderConfig::Mistral { call, endpoint },
            ProviderKind::Anthropic => ProviderConfig::Anthropic { call, endpoint },
            ProviderKind::Cohere => ProviderConfig::Cohere { call, endpoint },
            ProviderKind::Gemini => ProviderConfig::Gemini { call, endpoint },
            ProviderKind::Vertex => ProviderConfig::Vertex {
                call,
                endpoint,
                site: site(o.vertex_project, o.vertex_location)?,
            },
            ProviderKind::VertexAnthropic => ProviderConfig::VertexAnthropic {
                call,
                endpoint,
                site: site(o.vertex_project, o.vertex_location)?,
            },
            ProviderKind::Ollama => ProviderConfig::Ollama {
                call,
                endpoint,
                num_ctx: o.num_ctx,
            },
            ProviderKind::Bedrock => ProviderConfig::Bedrock {
                call,
                endpoint,
                region: o.region,
            },
        })
    }
}

#[cfg(test)]
mod tests;
