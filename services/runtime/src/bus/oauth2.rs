//! OAuth2 client credentials for Pulsar, as Pulsar's own clients do it
//! (`AuthenticationOAuth2`): discover the issuer's token endpoint, exchange the client id and
//! secret for an access token, and present it to the broker with the `token` method.
//!
//! Written here rather than taken from pulsar-rs's `auth-oauth2` feature because that feature
//! brings a second HTTP and TLS stack (openidconnect, oauth2) into a build that already has
//! reqwest, and fetches the token only when a connection is made: this one renews the token
//! before it expires, so the broker's authentication challenge on a long-lived connection is
//! answered with a fresh token.
//!
//! Never logs, or puts into an error, the client secret or a token.

use std::{path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use pulsar::{authentication::Authentication, error::AuthenticationError};
use serde::Deserialize;
use tokio::time::Instant;

use crate::secret::Secret;

/// Where and as whom to get access tokens.
#[derive(Debug, Clone)]
pub struct OAuth2Config {
    /// The issuer, e.g. `https://auth.example.com/`; its token endpoint is read from
    /// `<issuer>/.well-known/openid-configuration`.
    pub issuer_url: String,
    /// The client id.
    pub client_id: String,
    /// The client secret, from env or a file.
    pub client_secret: Secret,
    /// The audience the token is for (Pulsar's `audience` parameter), if the issuer wants one.
    pub audience: Option<String>,
    /// Scopes, space separated, if the issuer wants them.
    pub scope: Option<String>,
    /// A CA file to trust for the issuer's HTTPS besides the system roots.
    pub ca_file: Option<PathBuf>,
}

/// Renew a token once less than this share of its lifetime is left.
const RENEW_AT_REMAINING: f64 = 0.2;

/// How long one call to the issuer may take.
const ISSUER_TIMEOUT: Duration = Duration::from_secs(15);

pub(crate) struct OAuth2Auth {
    config: Arc<OAuth2Config>,
    http: Option<reqwest::Client>,
    token_endpoint: Option<String>,
    current: Option<(Secret, Instant)>,
}

#[derive(Deserialize)]
struct Discovery {
    token_endpoint: String,
}

#[derive(Deserialize)]
struct TokenResponse {
    access_token: String,
    #[serde(default)]
    expires_in: Option<u64>,
}

#[derive(Deserialize, Default)]
struct IssuerError {
    #[serde(default)]
    error: String,
    #[serde(default)]
    error_description: String,
}

impl OAuth2Auth {
    pub(crate) fn new(config: Arc<OAuth2Config>) -> Self {
        Self {
            config,
            http: None,
            token_endpoint: None,
            current: None,
        }
    }

    fn http(&mut self) -> Result<reqwest::Client, AuthenticationError> {
        if let Some(http) = &self.http {
            return Ok(http.clone());
        }
        crate::install_crypto_provider();
        let mut builder = reqwest::Client::builder().timeout(ISSUER_TIMEOUT);
        if let Some(path) = &self.config.ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                AuthenticationError::Custom(format!(
                    "cannot read the OAuth2 CA file {}: {e}",
                    path.display()
                ))
            })?;
            let cert = reqwest::Certificate::from_pem(&pem).map_err(|e| {
                AuthenticationError::Custom(format!(
                    "the OAuth2 CA file {} is not PEM: {e}",
                    path.display()
                ))
            })?;
            builder = builder.add_root_certificate(cert);
        }
        let http = builder
            .build()
            .map_err(|e| AuthenticationError::Custom(format!("OAuth2 HTTP client: {e}")))?;
        self.http = Some(http.clone());
        Ok(http)
    }

    async fn endpoint(&mut self) -> Result<String, AuthenticationError> {
        if let Some(e) = &self.token_endpoint {
            return Ok(e.clone());
        }
        let http = self.http()?;
        let url = format!(
            "{}/.well-known/openid-configuration",
            self.config.issuer_url.trim_end_matches('/')
        );
        let response = http.get(&url).send().await.map_err(|e| {
            // The issuer may be restarting: pulsar-rs retries a retriable failure.
            AuthenticationError::Retriable(format!("OAuth2 discovery at {url}: {e}"))
        })?;
        if !response.status().is_success() {
            return Err(AuthenticationError::Custom(format!(
                "OAuth2 discovery at {url} answered HTTP {}",
                response.status()
            )));
        }
        let discovery: Discovery = response
            .json()
            .await
            .map_err(|e| AuthenticationError::Custom(format!("OAuth2 discovery at {url}: {e}")))?;
        // The client secret goes to the endpoint the issuer names: it must be as safe as the
        // issuer itself. An issuer that was let through over plaintext beyond loopback was
        // allowed deliberately (`PulsarConfig::check_credentials_transport`); any other may
        // not send the secret there.
        let issuer_in_clear =
            super::pulsar_security::plaintext_beyond_loopback(&self.config.issuer_url).is_some();
        super::pulsar_security::refuse_plaintext_credentials(
            &discovery.token_endpoint,
            "the OAuth2 token endpoint the issuer names",
            &format!(
                "the client secret of OAuth2 client {:?}",
                self.config.client_id
            ),
            issuer_in_clear,
        )
        .map_err(|e| AuthenticationError::Custom(e.to_string()))?;
        self.token_endpoint = Some(discovery.token_endpoint.clone());
        Ok(discovery.token_endpoint)
    }

    async fn fetch(&mut self) -> Result<(Secret, Instant), AuthenticationError> {
        let endpoint = self.endpoint().await?;
        let http = self.http()?;
        let mut form = vec![
            ("grant_type", "client_credentials".to_owned()),
            ("client_id", self.config.client_id.clone()),
            (
                "client_secret",
                self.config.client_secret.expose().to_owned(),
            ),
        ];
        if let Some(a) = &self.config.audience {
            form.push(("audience", a.clone()));
        }
        if let Some(s) = &self.config.scope {
            form.push(("scope", s.clone()));
        }
        let asked = Instant::now();
        let response = http.post(&endpoint).form(&form).send().await.map_err(|e| {
            AuthenticationError::Retriable(format!("OAuth2 token request to {endpoint}: {e}"))
        })?;
        let status = response.status();
        if !status.is_success() {
            let body: IssuerError = response.json().await.unwrap_or_default();
            let failure = format!(
                "the OAuth2 issuer at {endpoint} refused client {:?}: HTTP {status} {} {}",
                self.config.client_id, body.error, body.error_description
            );
            return Err(if status.is_server_error() {
                AuthenticationError::Retriable(failure)
            } else {
                AuthenticationError::Custom(failure)
            });
        }
        let token: TokenResponse = response.json().await.map_err(|e| {
            AuthenticationError::Custom(format!("the OAuth2 token from {endpoint}: {e}"))
        })?;
        // Without expires_in, renew every minute: cheap, and safe for any lifetime.
        let lifetime = Duration::from_secs(token.expires_in.unwrap_or(60).max(1));
        let renew_at = asked + lifetime.mul_f64(1.0 - RENEW_AT_REMAINING);
        Ok((Secret::new(token.access_token), renew_at))
    }
}

#[async_trait]
impl Authentication for OAuth2Auth {
    fn auth_method_name(&self) -> String {
        // Pulsar's brokers validate an OAuth2 access token with the token provider.
        "token".into()
    }

    async fn initialize(&mut self) -> Result<(), AuthenticationError> {
        self.auth_data().await.map(|_| ())
    }

    async fn auth_data(&mut self) -> Result<Vec<u8>, AuthenticationError> {
        if let Some((token, renew_at)) = &self.current
            && Instant::now() < *renew_at
        {
            return Ok(token.expose().as_bytes().to_vec());
        }
        let (token, renew_at) = self.fetch().await?;
        let data = token.expose().as_bytes().to_vec();
        self.current = Some((token, renew_at));
        Ok(data)
    }
}
