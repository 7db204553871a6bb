//! Which provider serves the completions, and how to call it: one typed description that
//! every front end fills (the CLI's options and its config file, `sluice serve`, a program
//! embedding this crate) and [`ProviderConfig::build`] turns into a provider. Adding a
//! provider means a variant of [`ProviderKind`], its module under `providers/`, and its arm
//! in `build`.
//!
//! Secrets are not part of it: each provider's key is read from its environment variable
//! (or the file named by `<VAR>_FILE`) when the provider is built, so a description can be
//! logged, stored in a ConfigMap or shown in an error without leaking one.

use std::{sync::Arc, time::Duration};

use serde::Deserialize;
use sluice_runtime::secret::Secret;

use crate::{
    provider::Provider,
    providers::{
        HttpTimeouts,
        anthropic::{AnthropicConfig, AnthropicProvider},
        bedrock::{BedrockConfig, BedrockCredentials, BedrockProvider},
        cohere::{CohereConfig, CohereProvider},
        gemini::{GeminiConfig, GeminiEndpoint, GeminiProvider},
        ollama::{OllamaConfig, OllamaProvider},
        openai::{Dialect, OpenAiConfig, OpenAiProvider},
        vertex_origin,
    },
};

/// Which provider serves the completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
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
    /// Anthropic's models on Vertex AI (rawPredict / streamRawPredict; OAuth access token:
    /// VERTEX_ACCESS_TOKEN, as for `vertex`; needs --vertex-project and --vertex-location,
    /// which may be `global`; --model is Vertex's id, e.g. claude-sonnet-4-5@20250929).
    VertexAnthropic,
    /// Ollama's native API (`/api/chat`, NDJSON; optional key for a proxy: OLLAMA_API_KEY).
    Ollama,
    /// AWS Bedrock Converse (needs --region; --model is the model or inference-profile id).
    /// Credentials: a Bedrock API key in AWS_BEARER_TOKEN_BEDROCK, or SigV4 keys in
    /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally AWS_SESSION_TOKEN; each may
    /// be a file named by *_FILE.
    Bedrock,
}

/// A provider, described: everything it is built from except its secret. Field names are
/// the CLI's option names (`base-url`, `max-output-tokens`...); unknown fields are refused,
/// so a misspelt setting is an error, not a silent default.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ProviderConfig {
    /// The provider.
    pub provider: ProviderKind,
    /// The model (Azure: the deployment name; Bedrock: the model or inference-profile id).
    pub model: String,
    /// The provider's base URL; `None` for its public endpoint (required for
    /// `openai-compatible` and `azure`, which have none).
    #[serde(default)]
    pub base_url: Option<String>,
    /// Sampling temperature; `None` for the provider's default.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Maximum output tokens; `None` for the provider's default.
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// Vertex AI project (required for `vertex` and `vertex-anthropic`).
    #[serde(default)]
    pub vertex_project: Option<String>,
    /// Vertex AI location: a region, or `global`.
    #[serde(default = "default_vertex_location")]
    pub vertex_location: String,
    /// AWS region of Bedrock (required for `bedrock`).
    #[serde(default)]
    pub region: Option<String>,
    /// Ollama's context window (`num_ctx`).
    #[serde(default)]
    pub num_ctx: Option<u32>,
    /// Do not ask for usage in streams (older OpenAI-compatible servers reject
    /// `stream_options`).
    #[serde(default)]
    pub no_stream_usage: bool,
    /// Seconds to establish a connection.
    #[serde(default = "default_connect_timeout_secs")]
    pub connect_timeout_secs: u64,
    /// Seconds to the first token.
    #[serde(default = "default_stream_timeout_secs")]
    pub first_token_timeout_secs: u64,
    /// Seconds between chunks.
    #[serde(default = "default_stream_timeout_secs")]
    pub chunk_timeout_secs: u64,
    /// The environment variable holding the key, in place of the provider's own
    /// (`OPENAI_API_KEY`...): two providers of one kind with different keys, as a fallback
    /// list may have. `<VAR>_FILE` works as for the provider's own. Not for `bedrock`, whose
    /// credentials are AWS's variables.
    #[serde(default)]
    pub key_env: Option<String>,
}

fn default_vertex_location() -> String {
    "us-central1".to_owned()
}

fn default_connect_timeout_secs() -> u64 {
    HttpTimeouts::default().connect.as_secs()
}

fn default_stream_timeout_secs() -> u64 {
    HttpTimeouts::default().first_token.as_secs()
}

impl ProviderConfig {
    /// A description of `model` at `provider`, every other setting at its default.
    pub fn new(provider: ProviderKind, model: impl Into<String>) -> Self {
        Self {
            provider,
            model: model.into(),
            base_url: None,
            temperature: None,
            max_output_tokens: None,
            vertex_project: None,
            vertex_location: default_vertex_location(),
            region: None,
            num_ctx: None,
            no_stream_usage: false,
            connect_timeout_secs: default_connect_timeout_secs(),
            first_token_timeout_secs: default_stream_timeout_secs(),
            chunk_timeout_secs: default_stream_timeout_secs(),
            key_env: None,
        }
    }

    /// The call's time limits.
    pub fn timeouts(&self) -> HttpTimeouts {
        HttpTimeouts {
            connect: Duration::from_secs(self.connect_timeout_secs),
            first_token: Duration::from_secs(self.first_token_timeout_secs),
            between_chunks: Duration::from_secs(self.chunk_timeout_secs),
        }
    }

    /// The provider, its secret read from the environment. The error says what is missing
    /// and where to put it; it never contains a secret.
    pub fn build(&self) -> Result<Arc<dyn Provider>, String> {
        let timeouts = self.timeouts();
        // The key and where it comes from: `key-env`'s variable when given, else `own`.
        let key = |own: &str| -> Result<(Option<Secret>, String), String> {
            let var = self.key_env.as_deref().unwrap_or(own);
            Ok((secret(var)?, source(var)))
        };
        if let Some(var) = &self.key_env {
            if self.provider == ProviderKind::Bedrock {
                return Err("key-env does not apply to bedrock: its credentials are AWS's variables (AWS_BEARER_TOKEN_BEDROCK, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)".into());
            }
            if var.is_empty() || !var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!(
                    "key-env: {:?} is not an environment variable's name (letters, digits and _)",
                    var.chars().take(64).collect::<String>()
                ));
            }
        }
        let base = |public: &str| self.base_url.clone().unwrap_or_else(|| public.to_owned());
        let provider: Arc<dyn Provider> = match self.provider {
            ProviderKind::Gemini | ProviderKind::Vertex => {
                let (endpoint, var, public) = if self.provider == ProviderKind::Vertex {
                    let project = self.vertex_project()?;
                    let location = self.vertex_location.clone();
                    let public = vertex_origin(&location);
                    (
                        GeminiEndpoint::Vertex { project, location },
                        "VERTEX_ACCESS_TOKEN",
                        public,
                    )
                } else {
                    let public = "https://generativelanguage.googleapis.com".to_owned();
                    (GeminiEndpoint::AiStudio, "GEMINI_API_KEY", public)
                };
                let mut config = GeminiConfig::new(endpoint, base(&public), self.model.clone());
                (config.credential, config.credential_source) = key(var)?;
                config.temperature = self.temperature;
                config.max_output_tokens = self.max_output_tokens;
                config.timeouts = timeouts;
                Arc::new(GeminiProvider::new(config).map_err(|e| e.to_string())?)
            }
            ProviderKind::Bedrock => {
                let region = self
                    .region
                    .clone()
                    .ok_or("--region (or AWS_REGION) is required for bedrock")?;
                let mut config = BedrockConfig::new(region, self.model.clone());
                config.credentials = BedrockCredentials::from_env().map_err(|e| e.to_string())?;
                match (&config.credentials, &self.base_url) {
                    // A custom endpoint may be a proxy that signs for us; AWS itself never
                    // accepts an unsigned call, so say so now rather than on every request.
                    (BedrockCredentials::None, None) => {
                        return Err(format!("bedrock needs {}", config.credentials.source()));
                    }
                    (_, Some(base)) => config.base_url = base.clone(),
                    (_, None) => {}
                }
                config.temperature = self.temperature;
                config.max_tokens = self.max_output_tokens;
                config.timeouts = timeouts;
                Arc::new(BedrockProvider::new(config).map_err(|e| e.to_string())?)
            }
            ProviderKind::Cohere => {
                let mut config =
                    CohereConfig::new(base("https://api.cohere.com"), self.model.clone());
                (config.api_key, config.api_key_source) = key("COHERE_API_KEY")?;
                config.temperature = self.temperature;
                config.max_tokens = self.max_output_tokens;
                config.timeouts = timeouts;
                Arc::new(CohereProvider::new(config).map_err(|e| e.to_string())?)
            }
            ProviderKind::Anthropic | ProviderKind::VertexAnthropic => {
                let (mut config, var) = if self.provider == ProviderKind::VertexAnthropic {
                    let location = &self.vertex_location;
                    let config = AnthropicConfig::vertex(
                        self.vertex_project()?,
                        location.clone(),
                        base(&vertex_origin(location)),
                        self.model.clone(),
                    );
                    // The same token as Gemini on Vertex: one credential per project.
                    (config, "VERTEX_ACCESS_TOKEN")
                } else {
                    let public = "https://api.anthropic.com";
                    let config = AnthropicConfig::new(base(public), self.model.clone());
                    (config, "ANTHROPIC_API_KEY")
                };
                (config.credential, config.credential_source) = key(var)?;
                config.temperature = self.temperature;
                if let Some(m) = self.max_output_tokens {
                    config.max_tokens = m;
                }
                config.timeouts = timeouts;
                Arc::new(AnthropicProvider::new(config).map_err(|e| e.to_string())?)
            }
            ProviderKind::Ollama => {
                let mut config =
                    OllamaConfig::new(base("http://127.0.0.1:11434"), self.model.clone());
                (config.api_key, config.api_key_source) = key("OLLAMA_API_KEY")?;
                config.temperature = self.temperature;
                config.num_ctx = self.num_ctx;
                config.num_predict = self.max_output_tokens;
                config.timeouts = timeouts;
                Arc::new(OllamaProvider::new(config).map_err(|e| e.to_string())?)
            }
            ProviderKind::Openai
            | ProviderKind::OpenaiCompatible
            | ProviderKind::Azure
            | ProviderKind::Mistral => {
                let (dialect, key_var, public) = match self.provider {
                    ProviderKind::Openai => (
                        Dialect::OpenAi,
                        "OPENAI_API_KEY",
                        Some("https://api.openai.com"),
                    ),
                    ProviderKind::Mistral => (
                        Dialect::Mistral,
                        "MISTRAL_API_KEY",
                        Some("https://api.mistral.ai"),
                    ),
                    ProviderKind::Azure => (Dialect::Azure, "AZURE_OPENAI_API_KEY", None),
                    _ => (Dialect::Compatible, "SLUICE_LLM_API_KEY", None),
                };
                let base_url = self
                    .base_url
                    .clone()
                    .or(public.map(str::to_owned))
                    .ok_or_else(|| {
                        format!(
                            "--base-url (or SLUICE_BASE_URL) is required for {:?}",
                            self.provider
                        )
                    })?;
                let mut config = OpenAiConfig::new(dialect, base_url, self.model.clone());
                (config.api_key, config.api_key_source) = key(key_var)?;
                config.temperature = self.temperature;
                config.max_tokens = self.max_output_tokens;
                // Mistral rejects `stream_options`.
                config.include_usage = !self.no_stream_usage && dialect != Dialect::Mistral;
                config.timeouts = timeouts;
                Arc::new(OpenAiProvider::new(config).map_err(|e| e.to_string())?)
            }
        };
        Ok(provider)
    }

    /// The Vertex AI project, which both Vertex providers need.
    fn vertex_project(&self) -> Result<String, String> {
        self.vertex_project.clone().ok_or_else(|| {
            format!(
                "--vertex-project (or SLUICE_VERTEX_PROJECT) is required for {}",
                match self.provider {
                    ProviderKind::VertexAnthropic => "vertex-anthropic",
                    _ => "vertex",
                }
            )
        })
    }
}

/// The secret in `var` (or the file `var_FILE` names); `None` when neither is set.
fn secret(var: &str) -> Result<Option<Secret>, String> {
    Secret::from_env(var).map_err(|e| e.to_string())
}

/// Where the secret in `var` comes from, for error messages.
fn source(var: &str) -> String {
    format!("{var} (or the file named by {var}_FILE)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A description reads from the CLI's option names, unknown fields refused.
    #[test]
    fn a_description_reads_its_fields_and_refuses_unknown_ones() {
        let c: ProviderConfig = serde_json::from_str(
            r#"{"provider": "openai-compatible", "model": "smollm2",
                "base-url": "http://127.0.0.1:8080", "no-stream-usage": true}"#,
        )
        .unwrap();
        let mut want = ProviderConfig::new(ProviderKind::OpenaiCompatible, "smollm2");
        want.base_url = Some("http://127.0.0.1:8080".into());
        want.no_stream_usage = true;
        assert_eq!(c, want);
        assert_eq!(c.timeouts(), HttpTimeouts::default());
        let e = serde_json::from_str::<ProviderConfig>(
            r#"{"provider": "openai", "model": "m", "base_url": "http://x"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("unknown field `base_url`"), "{e}");
        let e = serde_json::from_str::<ProviderConfig>(r#"{"provider": "gpt", "model": "m"}"#)
            .unwrap_err();
        assert!(e.to_string().contains("unknown variant `gpt`"), "{e}");
    }

    /// Claude on Vertex is described by its kebab-case name, at a region or `global`.
    #[test]
    fn anthropic_on_vertex_reads_its_name_and_location() {
        let c: ProviderConfig = serde_json::from_str(
            r#"{"provider": "vertex-anthropic", "model": "claude-sonnet-4-5@20250929",
                "vertex-project": "p", "vertex-location": "global"}"#,
        )
        .unwrap();
        assert_eq!(c.provider, ProviderKind::VertexAnthropic);
        assert_eq!(c.vertex_location, "global");
        assert_eq!(c.build().unwrap().name(), "vertex-anthropic");
    }

    /// What a provider cannot be built without is named, with where to put it.
    #[test]
    fn a_missing_setting_is_named() {
        let err = |c: ProviderConfig| c.build().err().unwrap_or_default();
        assert!(
            err(ProviderConfig::new(
                ProviderKind::Vertex,
                "gemini-2.0-flash"
            ))
            .contains("--vertex-project")
        );
        let e = err(ProviderConfig::new(
            ProviderKind::VertexAnthropic,
            "claude-sonnet-4-5@20250929",
        ));
        assert!(
            e.contains("--vertex-project") && e.contains("vertex-anthropic"),
            "{e}"
        );
        assert!(err(ProviderConfig::new(ProviderKind::Bedrock, "m")).contains("--region"));
        for kind in [ProviderKind::OpenaiCompatible, ProviderKind::Azure] {
            assert!(
                err(ProviderConfig::new(kind, "m")).contains("--base-url"),
                "{kind:?}"
            );
        }
    }

    /// Every provider with what it needs builds, at the model described; the key's absence
    /// is the provider's own business (a keyless local server, or an error per request).
    #[test]
    fn every_provider_builds_with_what_it_needs() {
        for kind in [
            ProviderKind::Openai,
            ProviderKind::OpenaiCompatible,
            ProviderKind::Azure,
            ProviderKind::Mistral,
            ProviderKind::Anthropic,
            ProviderKind::Cohere,
            ProviderKind::Gemini,
            ProviderKind::Vertex,
            ProviderKind::VertexAnthropic,
            ProviderKind::Ollama,
        ] {
            let mut c = ProviderConfig::new(kind, "m");
            c.base_url = Some("http://127.0.0.1:9".into());
            c.vertex_project = Some("p".into());
            let built = c.build().unwrap_or_else(|e| panic!("{kind:?}: {e}"));
            assert_eq!(built.model(), "m", "{kind:?}");
        }
    }
}
