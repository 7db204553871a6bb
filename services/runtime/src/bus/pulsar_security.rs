//! How sluice proves itself to a secured Pulsar cluster, and how it tells a refusal from an
//! outage.
//!
//! - TLS: `pulsar+ssl://` URLs. The broker's certificate is checked against the system's
//!   public roots plus an optional CA file, and against the host name (pulsar-rs's rustls
//!   transport always verifies the name; there is deliberately no switch to turn that off).
//!   pulsar-rs 6.9 builds its TLS client with no client certificate, so mutual TLS is not
//!   available: authenticate with a token or OAuth2 instead.
//! - Authentication: a JWT given as a value (read once) or as a file (read again at every
//!   connection and every authentication challenge of the broker, so a rotated Kubernetes
//!   Secret is picked up without a restart), or OAuth2 client credentials (see
//!   [`super::oauth2`]).
//! - Refusals: a broker that refuses the credentials, a certificate that is not trusted, and a
//!   role without permission on a topic are [`Denial`]s. Retrying with the same credentials
//!   cannot help, so they are reported at once with their cause and the topic, instead of
//!   joining the retry loops meant for outages.
//!
//! This file must never log or put into an error a token, a client secret, or a payload.

use std::{fmt, path::PathBuf, sync::Arc};

use async_trait::async_trait;
use pulsar::{authentication::Authentication, error::AuthenticationError};

use super::oauth2::OAuth2Config;
use crate::secret::Secret;

/// How the client authenticates to the broker.
#[derive(Debug, Clone, Default)]
pub enum PulsarAuth {
    /// No authentication (a broker without `authenticationEnabled`).
    #[default]
    None,
    /// A JWT, read once (from `SLUICE_PULSAR_TOKEN`).
    Token(Secret),
    /// A JWT in a file, read again at every connection and authentication challenge (from
    /// `SLUICE_PULSAR_TOKEN_FILE`, e.g. a mounted Kubernetes Secret that is rotated).
    TokenFile(PathBuf),
    /// OAuth2 client credentials: an access token from the issuer, renewed before it expires.
    OAuth2(OAuth2Config),
}

impl PulsarAuth {
    /// The pulsar-rs authentication provider, `None` for no authentication.
    pub(crate) fn provider(&self) -> Option<Box<dyn Authentication>> {
        match self {
            PulsarAuth::None => None,
            PulsarAuth::Token(secret) => Some(Box::new(TokenAuth {
                source: TokenSource::Value(secret.clone()),
            })),
            PulsarAuth::TokenFile(path) => Some(Box::new(TokenAuth {
                source: TokenSource::File(path.clone()),
            })),
            PulsarAuth::OAuth2(config) => Some(Box::new(super::oauth2::OAuth2Auth::new(Arc::new(
                config.clone(),
            )))),
        }
    }

    /// What the token itself says about a refusal, read without verifying it: that it has
    /// expired, and when. The broker only answers "Failed to authenticate"; an operator
    /// wants to know which of expired, forged or wrong it is. Never returns the token.
    pub(crate) async fn expiry_hint(&self) -> Option<String> {
        let token = match self {
            PulsarAuth::Token(secret) => secret.expose().to_owned(),
            PulsarAuth::TokenFile(path) => tokio::fs::read_to_string(path).await.ok()?,
            PulsarAuth::None | PulsarAuth::OAuth2(_) => return None,
        };
        let exp = jwt_expiry(token.trim())?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?
            .as_secs();
        (exp <= now).then(|| format!("the token expired {} s ago (exp {exp})", now - exp))
    }

    /// Where the credentials come from, for error messages (never the credentials).
    pub fn describe(&self) -> String {
        match self {
            PulsarAuth::None => "no credentials".into(),
            PulsarAuth::Token(_) => "the token in SLUICE_PULSAR_TOKEN".into(),
            PulsarAuth::TokenFile(path) => format!("the token in {}", path.display()),
            PulsarAuth::OAuth2(c) => {
                format!("OAuth2 client {:?} of issuer {}", c.client_id, c.issuer_url)
            }
        }
    }
}

enum TokenSource {
    Value(Secret),
    File(PathBuf),
}

/// Pulsar's `token` authentication with a token that may change while the process runs.
struct TokenAuth {
    source: TokenSource,
}

#[async_trait]
impl Authentication for TokenAuth {
    fn auth_method_name(&self) -> String {
        "token".into()
    }

    async fn initialize(&mut self) -> Result<(), AuthenticationError> {
        // Read once up front so that an unreadable file fails the start, not the first
        // reconnect hours later.
        self.auth_data().await.map(|_| ())
    }

    async fn auth_data(&mut self) -> Result<Vec<u8>, AuthenticationError> {
        match &self.source {
            TokenSource::Value(secret) => Ok(secret.expose().as_bytes().to_vec()),
            TokenSource::File(path) => {
                let text = tokio::fs::read_to_string(path).await.map_err(|e| {
                    AuthenticationError::Custom(format!(
                        "cannot read the Pulsar token file {}: {e}",
                        path.display()
                    ))
                })?;
                let token = text.trim();
                if token.is_empty() {
                    return Err(AuthenticationError::Custom(format!(
                        "the Pulsar token file {} is empty",
                        path.display()
                    )));
                }
                Ok(token.as_bytes().to_vec())
            }
        }
    }
}

/// The command-line flag (and its variable, `SLUICE_ALLOW_PLAINTEXT_CREDENTIALS`) that lets a
/// credential go over a plaintext URL beyond loopback: named in the refusal.
pub const ALLOW_PLAINTEXT_FLAG: &str = "--allow-plaintext-credentials";

/// The scheme of `url` when what is sent to it could be read on the network: a plaintext
/// scheme (`pulsar://`, `http://`) to a host that is not loopback. `None` for TLS
/// (`pulsar+ssl://`, `https://`), for a loopback host (`127.0.0.0/8`, `[::1]`, `localhost`:
/// what goes there never leaves the machine, and whoever can read this machine's loopback
/// traffic can read the credential's file too) and for a scheme that is neither, which the
/// client refuses on its own. A service URL may list several hosts (`pulsar://a:6650,b:6650`):
/// all must be loopback. A name is never resolved: a name that resolves to loopback today
/// may not tomorrow, so only `localhost` is taken as one.
pub fn plaintext_beyond_loopback(url: &str) -> Option<String> {
    let (scheme, rest) = url.trim().split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    if scheme != "pulsar" && scheme != "http" {
        return None;
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    // Credentials in the URL itself (`user:pass@host`) are not a host.
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let loopback = |host: &str| {
        let name = match host.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or(""),
            None => host.split(':').next().unwrap_or(""),
        };
        name.eq_ignore_ascii_case("localhost")
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    };
    let all_loopback = !hosts.is_empty() && hosts.split(',').all(loopback);
    (!all_loopback).then_some(scheme)
}

/// Refuses to send `credential` (what it is and where it comes from: never the credential
/// itself, e.g. [`PulsarAuth::describe`]) to `url` (what `url` is for: `role`, e.g. "the
/// broker") when the URL is plaintext beyond loopback, unless `allowed` (the operator passed
/// [`ALLOW_PLAINTEXT_FLAG`]). The error names the scheme, the role and the flag; not the URL,
/// which may carry a secret of its own in its query or user part.
pub fn refuse_plaintext_credentials(
    url: &str,
    role: &str,
    credential: &str,
    allowed: bool,
) -> Result<(), PlaintextRefused> {
    match plaintext_beyond_loopback(url) {
        Some(scheme) if !allowed => Err(PlaintextRefused {
            credential: credential.to_owned(),
            role: role.to_owned(),
            scheme,
        }),
        _ => Ok(()),
    }
}

/// [`refuse_plaintext_credentials`]'s refusal. Its words name the scheme, the role and the
/// flag that allows it; never the URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "refusing to send {credential} to {role} over plaintext {scheme}://: anyone on the network path could read it and use it. Use {tls}, or pass {flag} (SLUICE_ALLOW_PLAINTEXT_CREDENTIALS=true) to send it in the clear deliberately",
    tls = self.tls_scheme(),
    flag = ALLOW_PLAINTEXT_FLAG
)]
pub struct PlaintextRefused {
    /// What would have been sent and where it comes from (never the credential itself).
    pub credential: String,
    /// What the URL is for ("the broker").
    pub role: String,
    /// The plaintext scheme (`pulsar` or `http`).
    pub scheme: String,
}

impl PlaintextRefused {
    /// The scheme that would carry the credential safely.
    fn tls_scheme(&self) -> &'static str {
        if self.scheme == "pulsar" {
            "pulsar+ssl://"
        } else {
            "https://"
        }
    }
}

/// The `exp` claim of a JWT, read without verifying the signature (only to explain a
/// refusal the broker already made).
fn jwt_expiry(token: &str) -> Option<u64> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice::<serde_json::Value>(&bytes).ok()?["exp"].as_u64()
}

/// Why the broker will not serve this client, whatever the number of retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenialCause {
    /// The broker refused the credentials: no token, an expired one, one signed with another
    /// key, or an OAuth2 issuer that refused the client.
    Authentication,
    /// The TLS handshake failed: the broker's certificate is not signed by a trusted CA, or
    /// does not name the host connected to.
    Tls,
    /// The credentials are good but the role may not do this on this topic.
    Authorization,
}

impl DenialCause {
    /// A short name for metrics labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            DenialCause::Authentication => "authentication",
            DenialCause::Tls => "tls",
            DenialCause::Authorization => "authorization",
        }
    }
}

/// The broker refused this client. Carries the cause, what was being done and where, and the
/// broker's or TLS library's own words (which never contain the credentials).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// Why.
    pub cause: DenialCause,
    /// What was being done, naming the topic or URL: `producing to persistent://tg/response/x`.
    pub operation: String,
    /// The refusal as the broker or the TLS library put it.
    pub detail: String,
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let advice = match self.cause {
            DenialCause::Authentication => {
                "the broker refused the credentials (check SLUICE_PULSAR_TOKEN / SLUICE_PULSAR_TOKEN_FILE or the OAuth2 settings: the token may be expired or signed with another key)"
            }
            DenialCause::Tls => {
                "the TLS handshake failed (the broker's certificate is not signed by a CA in SLUICE_PULSAR_TLS_CA_FILE or the system roots, or does not name the host)"
            }
            DenialCause::Authorization => {
                "this role is not authorized (grant it with `pulsar-admin topics grant-permission`, see docs/production-pulsar.md, \"Roles and grants\")"
            }
        };
        write!(f, "{}: {advice}: {}", self.operation, self.detail)
    }
}

/// The denial `error` stands for, if it is one; `operation` names what was being done.
///
/// pulsar-rs nests the broker's error code several enums deep (a connection error inside a
/// consumer, producer or lookup error), and TLS failures arrive as an I/O error wrapping
/// rustls's. Its `Debug` form names each of them the same way at every depth, so that form is
/// what is read here; the unit tests pin the shapes this relies on.
pub fn denial(error: &pulsar::Error, operation: impl Into<String>) -> Option<Denial> {
    let debug = format!("{error:?}");
    let cause = denial_cause(&debug)?;
    Some(Denial {
        cause,
        operation: operation.into(),
        detail: error.to_string(),
    })
}

/// What a broker's error message says when the broker's own connection failed: Java's
/// connect exceptions and their errno texts, and its timeouts.
const BROKER_SIDE_OUTAGE: [&str; 5] = [
    "ConnectException",
    "Connection refused",
    "Connection reset",
    "TimeoutException",
    "No route to host",
];

fn denial_cause(debug: &str) -> Option<DenialCause> {
    if debug.contains("Retriable(") {
        // Our own providers' word for "the issuer is unreachable right now": an outage.
        None
    } else if debug.contains("AuthorizationError") {
        // A broker that could not reach another broker (or its metadata store) while checking
        // a permission answers AuthorizationError with its own connection failure as the
        // message: an outage (a broker's SIGKILL in the cluster suite, 2026-12-07: 1,636 of
        // them, each turned into "this role is not authorized" for the callers), not a refusal.
        (!BROKER_SIDE_OUTAGE.iter().any(|m| debug.contains(m)))
            .then_some(DenialCause::Authorization)
    } else if debug.contains("AuthenticationError") || debug.contains("Authentication(") {
        Some(DenialCause::Authentication)
    } else if debug.contains("InvalidCertificate")
        || debug.contains("InvalidDnsName")
        || debug.contains("DnsName(")
        || debug.contains("UnknownIssuer")
        || debug.contains("NotValidForName")
    {
        Some(DenialCause::Tls)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use pulsar::{
        error::{ConnectionError, ConsumerError, ProducerError},
        message::proto::ServerError,
    };

    use super::*;

    fn broker_refusal(code: ServerError, message: &str) -> ConnectionError {
        ConnectionError::PulsarError(Some(code), Some(message.into()))
    }

    #[test]
    fn the_brokers_refusals_are_denials_at_any_depth() {
        let e = pulsar::Error::Connection(broker_refusal(
            ServerError::AuthenticationError,
            "Failed to authentication token: JWT expired",
        ));
        let d = denial(&e, "connecting to pulsar+ssl://h:6651").unwrap();
        assert_eq!(d.cause, DenialCause::Authentication);
        assert!(d.to_string().contains("JWT expired"), "{d}");
        assert!(
            d.to_string()
                .starts_with("connecting to pulsar+ssl://h:6651: ")
        );

        let e = pulsar::Error::Producer(ProducerError::Connection(broker_refusal(
            ServerError::AuthorizationError,
            "Client is not authorized to Publish",
        )));
        let d = denial(&e, "producing to persistent://t/n/x").unwrap();
        assert_eq!(d.cause, DenialCause::Authorization);
        assert!(d.to_string().contains("persistent://t/n/x"));

        let e = pulsar::Error::Consumer(ConsumerError::Connection(broker_refusal(
            ServerError::AuthorizationError,
            "not authorized",
        )));
        assert_eq!(
            denial(&e, "x").map(|d| d.cause),
            Some(DenialCause::Authorization)
        );
    }

    #[test]
    fn plaintext_urls_beyond_loopback_are_found_and_tls_and_loopback_are_not() {
        for url in [
            "pulsar://broker.example:6650",
            "PULSAR://broker.example:6650",
            "http://admin.example:8080/admin",
            "http://10.0.0.7:8080",
            "pulsar://127.0.0.1:6650,broker.example:6650",
            "http://user:pw@issuer.example/realms/x",
            // A name that looks loopback but is not one.
            "pulsar://localhost.example.com:6650",
            "http://127.0.0.1.nip.io:8080",
            "pulsar://[2001:db8::1]:6650",
            "pulsar://",
        ] {
            assert!(plaintext_beyond_loopback(url).is_some(), "{url}");
        }
        for url in [
            "pulsar+ssl://broker.example:6651",
            "https://issuer.example",
            "pulsar://127.0.0.1:6650",
            "pulsar://127.1.2.3:6650,localhost:6651",
            "http://localhost:8080/admin",
            "http://LOCALHOST",
            "http://[::1]:8080/x",
            "http://user@127.0.0.1:9/x?q=1",
            "ftp://example.com",
            "not a url",
        ] {
            assert_eq!(plaintext_beyond_loopback(url), None, "{url}");
        }
    }

    #[test]
    fn a_refusal_names_the_scheme_and_the_flag_and_never_the_url() {
        let e = refuse_plaintext_credentials(
            "pulsar://broker.example:6650?token=abc",
            "the broker",
            "the token in SLUICE_PULSAR_TOKEN",
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("plaintext pulsar://"), "{e}");
        assert!(e.contains("pulsar+ssl://"), "{e}");
        assert!(e.contains(ALLOW_PLAINTEXT_FLAG), "{e}");
        assert!(!e.contains("abc") && !e.contains("broker.example"), "{e}");
        let e = refuse_plaintext_credentials("http://a.example", "x", "y", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("plaintext http://") && e.contains("https://"),
            "{e}"
        );
        assert!(refuse_plaintext_credentials("http://a.example", "x", "y", true).is_ok());
        assert!(refuse_plaintext_credentials("pulsar://127.0.0.1:6650", "x", "y", false).is_ok());
    }

    #[test]
    fn a_tokens_expiry_is_read_without_its_signature() {
        // {"alg":"HS256"} . {"sub":"r","exp":1000} . (any signature)
        let token = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJyIiwiZXhwIjoxMDAwfQ.c2ln";
        assert_eq!(jwt_expiry(token), Some(1000));
        assert_eq!(
            jwt_expiry("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJyIn0.c2ln"),
            None
        );
        assert_eq!(jwt_expiry("not a token"), None);
    }

    #[test]
    fn an_untrusted_certificate_is_a_tls_denial() {
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        let e = pulsar::Error::Connection(ConnectionError::Io(io));
        assert_eq!(denial(&e, "x").map(|d| d.cause), Some(DenialCause::Tls));
    }

    #[test]
    fn outages_are_not_denials() {
        for e in [
            pulsar::Error::Connection(ConnectionError::Authentication(
                AuthenticationError::Retriable("issuer unreachable".into()),
            )),
            pulsar::Error::Connection(ConnectionError::Io(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused,
            ))),
            pulsar::Error::Connection(ConnectionError::Disconnected),
            pulsar::Error::Connection(broker_refusal(
                ServerError::ServiceNotReady,
                "Namespace bundle is being unloaded",
            )),
            // The surviving broker's words while another was SIGKILLed (the cluster suite).
            pulsar::Error::Producer(ProducerError::Connection(broker_refusal(
                ServerError::AuthorizationError,
                "java.util.concurrent.CompletionException: io.netty.channel.AbstractChannel$AnnotatedConnectException: finishConnect(..) failed with error(-111): Connection refused: pulsar.sluice.test/127.0.0.3:6651",
            ))),
        ] {
            assert_eq!(denial(&e, "x"), None, "{e:?}");
        }
    }
}
