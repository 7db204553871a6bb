//! Bedrock credentials: a Bedrock API key or SigV4 keys, read from the environment as the AWS
//! SDKs read them.

use sluice_runtime::secret::Secret;

use crate::provider::{FailureKind, ProviderError};

/// Where a Bedrock API key is read from (the variable the AWS SDKs read).
pub const API_KEY_VAR: &str = "AWS_BEARER_TOKEN_BEDROCK";
/// Where the SigV4 access key id is read from.
pub const ACCESS_KEY_ID_VAR: &str = "AWS_ACCESS_KEY_ID";
/// Where the SigV4 secret access key is read from.
pub const SECRET_ACCESS_KEY_VAR: &str = "AWS_SECRET_ACCESS_KEY";
/// Where the optional SigV4 session token is read from.
pub const SESSION_TOKEN_VAR: &str = "AWS_SESSION_TOKEN";

/// How a Bedrock call proves who it is.
#[derive(Debug, Clone, Default)]
pub enum BedrockCredentials {
    /// No credentials (a proxy that signs, or a test server).
    #[default]
    None,
    /// A Bedrock API key, sent as `Authorization: Bearer`.
    ApiKey(Secret),
    /// IAM keys, for SigV4.
    SigV4 {
        /// `AWS_ACCESS_KEY_ID`.
        access_key_id: Secret,
        /// `AWS_SECRET_ACCESS_KEY`.
        secret_access_key: Secret,
        /// `AWS_SESSION_TOKEN`, for temporary credentials.
        session_token: Option<Secret>,
    },
}

impl BedrockCredentials {
    /// Reads credentials as the AWS SDKs do: a Bedrock API key when
    /// `AWS_BEARER_TOKEN_BEDROCK` is set, else the SigV4 keys; each variable may instead
    /// name a file with `*_FILE`. `None` when nothing is set. Errors name variables, never
    /// values.
    pub fn from_env() -> Result<Self, ProviderError> {
        let read = |var: &str| {
            Secret::from_env(var).map_err(|e| ProviderError::new(FailureKind::Auth, e.to_string()))
        };
        if let Some(key) = read(API_KEY_VAR)? {
            return Ok(Self::ApiKey(key));
        }
        Self::sigv4_from_env()
    }

    /// The SigV4 keys alone, as [`BedrockCredentials::from_env`] reads them; `None` when
    /// neither is set. For an endpoint that a Bedrock API key is not sent to by default
    /// (SigV4 keys never leave the process: only each request's signature does).
    pub fn sigv4_from_env() -> Result<Self, ProviderError> {
        let read = |var: &str| {
            Secret::from_env(var).map_err(|e| ProviderError::new(FailureKind::Auth, e.to_string()))
        };
        match (read(ACCESS_KEY_ID_VAR)?, read(SECRET_ACCESS_KEY_VAR)?) {
            (Some(access_key_id), Some(secret_access_key)) => Ok(Self::SigV4 {
                access_key_id,
                secret_access_key,
                session_token: read(SESSION_TOKEN_VAR)?,
            }),
            (None, None) => Ok(Self::None),
            (Some(_), None) => Err(ProviderError::new(
                FailureKind::Auth,
                format!(
                    "{ACCESS_KEY_ID_VAR} is set but {SECRET_ACCESS_KEY_VAR} (or {SECRET_ACCESS_KEY_VAR}_FILE) is not"
                ),
            )),
            (None, Some(_)) => Err(ProviderError::new(
                FailureKind::Auth,
                format!(
                    "{SECRET_ACCESS_KEY_VAR} is set but {ACCESS_KEY_ID_VAR} (or {ACCESS_KEY_ID_VAR}_FILE) is not"
                ),
            )),
        }
    }

    /// Where these credentials come from, for errors that tell the operator what to fix.
    pub fn source(&self) -> String {
        match self {
            Self::None => format!(
                "the credentials: set {API_KEY_VAR}, or {ACCESS_KEY_ID_VAR} and {SECRET_ACCESS_KEY_VAR} (or the files named by their _FILE variables)"
            ),
            Self::ApiKey(_) => {
                format!("{API_KEY_VAR} (or the file named by {API_KEY_VAR}_FILE)")
            }
            Self::SigV4 { .. } => format!(
                "{ACCESS_KEY_ID_VAR}, {SECRET_ACCESS_KEY_VAR} and {SESSION_TOKEN_VAR} (or the files named by their _FILE variables)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::bedrock::BedrockConfig;

    #[test]
    fn credentials_never_print() {
        let c = BedrockCredentials::SigV4 {
            access_key_id: Secret::new("AKIDSECRETID"),
            secret_access_key: Secret::new("very-secret-key"),
            session_token: Some(Secret::new("very-secret-token")),
        };
        let mut config = BedrockConfig::new("us-east-1", "m");
        config.credentials = c.clone();
        let printed = format!("{c:?} {config:?} {}", c.source());
        for s in ["AKIDSECRETID", "very-secret-key", "very-secret-token"] {
            assert!(!printed.contains(s), "{printed}");
        }
        assert!(c.source().contains(SECRET_ACCESS_KEY_VAR));
    }
}
