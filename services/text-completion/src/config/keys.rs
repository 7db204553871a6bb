//! Which variable a provider's key is read from, and the hosts a vendor's own variable may be
//! sent to (a vendor's key never goes to another host by default).

use super::*;

/// A vendor's key variable and the hosts it is sent to.
pub(super) struct Vendor {
    /// The variable read by default.
    pub(super) var: &'static str,
    /// Whether `host` is the vendor's.
    pub(super) owns: fn(&str) -> bool,
}

impl Vendor {
    pub(super) const OPENAI: Vendor = Vendor {
        var: "OPENAI_API_KEY",
        owns: |h| h == "api.openai.com",
    };
    pub(super) const AZURE: Vendor = Vendor {
        var: "AZURE_OPENAI_API_KEY",
        owns: |h| {
            [
                ".openai.azure.com",
                ".cognitiveservices.azure.com",
                ".services.ai.azure.com",
            ]
            .iter()
            .any(|s| h.ends_with(s))
        },
    };
    pub(super) const MISTRAL: Vendor = Vendor {
        var: "MISTRAL_API_KEY",
        owns: |h| h == "api.mistral.ai",
    };
    pub(super) const ANTHROPIC: Vendor = Vendor {
        var: "ANTHROPIC_API_KEY",
        owns: |h| h == "api.anthropic.com",
    };
    pub(super) const COHERE: Vendor = Vendor {
        var: "COHERE_API_KEY",
        owns: |h| h == "api.cohere.com" || h == "api.cohere.ai",
    };
    pub(super) const GEMINI: Vendor = Vendor {
        var: "GEMINI_API_KEY",
        owns: |h| h == "generativelanguage.googleapis.com",
    };
    pub(super) const VERTEX: Vendor = Vendor {
        var: "VERTEX_ACCESS_TOKEN",
        owns: |h| h == "aiplatform.googleapis.com" || h.ends_with("-aiplatform.googleapis.com"),
    };
    pub(super) const OLLAMA: Vendor = Vendor {
        var: "OLLAMA_API_KEY",
        owns: |h| h == "ollama.com",
    };
    pub(super) const BEDROCK: Vendor = Vendor {
        var: API_KEY_VAR,
        owns: |h| h.ends_with(".amazonaws.com") || h.ends_with(".amazonaws.com.cn"),
    };
}

/// The key a provider sends and where it comes from (for its auth errors). `api_key_env`'s
/// variable when named; else the vendor's own when `base_url` is `None` (the vendor's
/// public endpoint, or a local default) or an https URL of one of the vendor's hosts; else
/// none, and an error when the vendor's variable is set (it would have been sent to another
/// host before).
pub(super) fn key(
    provider: ProviderKind,
    vendor: &Vendor,
    base_url: Option<&str>,
    api_key_env: Option<&str>,
) -> Result<(Option<Secret>, String), ConfigError> {
    if let Some(var) = api_key_env {
        return Ok((Secret::from_env(var)?, source(var)));
    }
    let Some(base) = base_url else {
        return Ok((Secret::from_env(vendor.var)?, source(vendor.var)));
    };
    let url = endpoint_url(base)?;
    let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
    if url.scheme() == "https" && (vendor.owns)(&host) {
        return Ok((Secret::from_env(vendor.var)?, source(vendor.var)));
    }
    let file = format!("{}_FILE", vendor.var);
    if [vendor.var, file.as_str()]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()))
    {
        return Err(ConfigError::VendorKeyElsewhere {
            var: vendor.var,
            provider,
            host,
        });
    }
    Ok((
        None,
        format!(
            "no key: the base URL is not {provider}'s, so {} is not read; name the key's variable with --api-key-env (`api-key-env` in a file)",
            vendor.var
        ),
    ))
}

/// Where the secret in `var` comes from, for error messages.
pub(super) fn source(var: &str) -> String {
    format!("{var} (or the file named by {var}_FILE)")
}
