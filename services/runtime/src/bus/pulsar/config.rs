//! How to reach and use a Pulsar cluster: the bus's settings.

use std::{path::PathBuf, time::Duration};

use crate::bus::{BusError, pulsar_security::PulsarAuth};

/// How to reach and use a Pulsar cluster.
#[derive(Debug, Clone)]
pub struct PulsarConfig {
    /// Broker URL, e.g. `pulsar://127.0.0.1:6650`, or `pulsar+ssl://pulsar.example.com:6651`
    /// for TLS. A host name that resolves to several brokers is tried address by address.
    pub url: String,
    /// How to authenticate, from env or files; never from the command line.
    pub auth: PulsarAuth,
    /// A PEM file of CA certificates to trust for `pulsar+ssl://` besides the system roots.
    pub tls_ca_file: Option<PathBuf>,
    /// Largest message sent; the broker's `maxMessageSize` (5 MiB by default) less headroom
    /// for the frame's metadata.
    pub max_message_bytes: usize,
    /// Client connection retries before pulsar-rs gives up on an operation.
    pub connection_retries: u32,
    /// Longest wait between connection retries.
    pub connection_max_backoff: Duration,
    /// Time limit for one broker operation.
    pub operation_timeout: Duration,
    /// How long a send keeps re-creating a failed producer before reporting the bus unavailable.
    pub publish_retry_budget: Duration,
    /// Longest wait between attempts to re-create a consumer.
    pub resubscribe_max_backoff: Duration,
    /// How often each consumer asks the broker whether it still knows it (see
    /// `Supervisor::alive`); one that is not known, or gets no answer, is re-created.
    pub consumer_check_every: Duration,
    /// Send `auth`'s token or OAuth2 credentials over a plaintext `pulsar://` URL (or to an
    /// `http://` OAuth2 issuer) beyond loopback. Off: [`super::PulsarBus::connect`] refuses (see
    /// [`crate::bus::pulsar_security::plaintext_beyond_loopback`]).
    pub allow_plaintext_credentials: bool,
}

impl PulsarConfig {
    /// Defaults for a broker at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            auth: PulsarAuth::None,
            tls_ca_file: None,
            max_message_bytes: crate::bus::memory::DEFAULT_MAX_MESSAGE_BYTES,
            connection_retries: 12,
            connection_max_backoff: Duration::from_secs(5),
            operation_timeout: Duration::from_secs(30),
            publish_retry_budget: Duration::from_secs(60),
            resubscribe_max_backoff: Duration::from_secs(5),
            consumer_check_every: Duration::from_secs(5),
            allow_plaintext_credentials: false,
        }
    }

    /// Refuses credentials that would cross the network in the clear: a token or OAuth2
    /// access token to a `pulsar://` broker, an OAuth2 client secret to an `http://` issuer,
    /// beyond loopback, unless [`PulsarConfig::allow_plaintext_credentials`].
    pub fn check_credentials_transport(&self) -> Result<(), BusError> {
        let allowed = self.allow_plaintext_credentials;
        let refused = |url: &str, role: &str, what: &str| {
            crate::bus::pulsar_security::refuse_plaintext_credentials(url, role, what, allowed)
                .map_err(|e| BusError::Config(e.to_string()))
        };
        match &self.auth {
            PulsarAuth::None => Ok(()),
            PulsarAuth::OAuth2(oauth2) => {
                refused(
                    &oauth2.issuer_url,
                    "the OAuth2 issuer",
                    &format!("the client secret of OAuth2 client {:?}", oauth2.client_id),
                )?;
                refused(&self.url, "the broker", "the OAuth2 access token")
            }
            auth => refused(&self.url, "the broker", &auth.describe()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{bus::oauth2::OAuth2Config, secret::Secret};

    #[test]
    fn credentials_over_plaintext_beyond_loopback_are_refused_unless_allowed() {
        const TOKEN: &str = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJyIn0.secret-signature";
        let config = |url: &str, auth: PulsarAuth| {
            let mut c = PulsarConfig::new(url);
            c.auth = auth;
            c
        };
        let token = || PulsarAuth::Token(Secret::new(TOKEN));
        let oauth2 = |issuer: &str| {
            PulsarAuth::OAuth2(OAuth2Config {
                issuer_url: issuer.into(),
                client_id: "sluice".into(),
                client_secret: Secret::new("client-secret-9"),
                audience: None,
                scope: None,
                ca_file: None,
            })
        };
        let refused = [
            config("pulsar://broker.example:6650", token()),
            config(
                "pulsar://broker.example:6650",
                PulsarAuth::TokenFile("/run/token".into()),
            ),
            config(
                "pulsar+ssl://broker.example:6651",
                oauth2("http://issuer.example"),
            ),
            config(
                "pulsar://broker.example:6650",
                oauth2("https://issuer.example"),
            ),
        ];
        for c in refused {
            let e = c.check_credentials_transport().unwrap_err().to_string();
            assert!(e.contains("--allow-plaintext-credentials"), "{e}");
            assert!(e.contains("plaintext"), "{e}");
            assert!(!e.contains(TOKEN) && !e.contains("client-secret-9"), "{e}");
            let mut allowed = c.clone();
            allowed.allow_plaintext_credentials = true;
            assert!(allowed.check_credentials_transport().is_ok());
        }
        for c in [
            config("pulsar://broker.example:6650", PulsarAuth::None),
            config("pulsar+ssl://broker.example:6651", token()),
            config("pulsar://127.0.0.1:6650", token()),
            config("pulsar://localhost:6650", oauth2("http://127.0.0.1:9000")),
            config(
                "pulsar+ssl://broker.example:6651",
                oauth2("https://issuer.example"),
            ),
        ] {
            assert!(c.check_credentials_transport().is_ok(), "{c:?}");
        }
    }
}
