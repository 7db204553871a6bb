//! Why a broker refused a connection, when pulsar-rs will not say.
//!
//! pulsar-rs 6.9 collapses every connection failure it deems fatal (an expired or forged
//! token, an untrusted certificate, a name the certificate does not carry) into one
//! `io::Error("fatal error when connecting to the Pulsar server")` and logs the causes
//! through the `log` crate only. Without the cause, an operator would see "retrying" forever.
//! So when that error comes back, this probe repeats the handshake itself, with pulsar-rs's
//! own frame codec and protocol types and the same TLS roots and credentials, and reads the
//! broker's answer: the TLS library's refusal, the authentication provider's failure, or the
//! broker's `Error` command with its code and message.
//!
//! It sends nothing but `CONNECT` and never logs credentials.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use pulsar::message::{Codec, Message as Frame, proto};
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::codec::Framed;

use super::config::PulsarConfig;
use crate::bus::pulsar_security::{Denial, DenialCause};

/// How long each step of the probe may take.
const STEP: Duration = Duration::from_secs(10);

/// The text pulsar-rs gives every fatal connection failure.
const OPAQUE_FATAL: &str = "fatal error when connecting to the Pulsar server";

/// Whether `error` is pulsar-rs's causeless fatal connection failure.
pub(crate) fn is_opaque(error: &pulsar::Error) -> bool {
    error.to_string().contains(OPAQUE_FATAL)
}

/// Connects to the broker of `config` as the client would and returns the refusal, if the
/// broker or the TLS handshake refuses; `None` when the connection is accepted or the probe
/// itself cannot reach the broker (an outage, not a refusal).
pub(crate) async fn diagnose(config: &PulsarConfig, operation: &str) -> Option<Denial> {
    let refusal = |cause, detail: String| Denial {
        cause,
        operation: operation.to_owned(),
        detail,
    };
    let url = reqwest::Url::parse(&config.url).ok()?;
    let tls = url.scheme() == "pulsar+ssl";
    let host = url.host_str()?.to_owned();
    let port = url.port().unwrap_or(if tls { 6651 } else { 6650 });
    let tcp = connect_any(&host, port).await?;
    // The credentials first: a provider that cannot produce them (an OAuth2 issuer that
    // refuses the client, an unreadable token file) is the answer by itself.
    let (method, data) = match config.auth.provider() {
        None => (None, None),
        Some(mut provider) => {
            let data = match provider.initialize().await {
                Ok(()) => provider.auth_data().await,
                Err(e) => Err(e),
            };
            match data {
                Ok(d) => (Some(provider.auth_method_name()), Some(d)),
                Err(e) if e.to_string().contains("(retriable)") => return None,
                Err(e) => return Some(refusal(DenialCause::Authentication, e.to_string())),
            }
        }
    };
    let answer = if tls {
        let connector = match tls_connector(config) {
            Ok(c) => c,
            Err(e) => return Some(refusal(DenialCause::Tls, e)),
        };
        let name = ServerName::try_from(host.clone()).ok()?;
        let stream = match tokio::time::timeout(STEP, connector.connect(name, tcp)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return Some(refusal(
                    DenialCause::Tls,
                    format!("TLS with {host}:{port}: {e}"),
                ));
            }
            Err(_) => return None,
        };
        handshake(stream, method, data).await
    } else {
        handshake(tcp, method, data).await
    }?;
    let error = answer.error?;
    let cause = match proto::ServerError::try_from(error.error).ok()? {
        proto::ServerError::AuthenticationError => DenialCause::Authentication,
        proto::ServerError::AuthorizationError => DenialCause::Authorization,
        _ => return None,
    };
    let mut detail = format!("the broker at {host}:{port} answered: {}", error.message);
    if cause == DenialCause::Authentication
        && let Some(hint) = config.auth.expiry_hint().await
    {
        detail.push_str(&format!("; {hint}"));
    }
    Some(refusal(cause, detail))
}

async fn connect_any(host: &str, port: u16) -> Option<tokio::net::TcpStream> {
    let addresses = tokio::time::timeout(STEP, tokio::net::lookup_host((host, port)))
        .await
        .ok()?
        .ok()?;
    for address in addresses {
        if let Ok(Ok(tcp)) =
            tokio::time::timeout(STEP, tokio::net::TcpStream::connect(address)).await
        {
            return Some(tcp);
        }
    }
    None
}

/// The roots pulsar-rs trusts: the public web roots plus the configured CA file.
fn tls_connector(config: &PulsarConfig) -> Result<tokio_rustls::TlsConnector, String> {
    crate::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &config.tls_ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("cannot read the TLS CA file {}: {e}", path.display()))?;
        for cert in certs {
            let cert = cert.map_err(|e| format!("the TLS CA file {}: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("the TLS CA file {}: {e}", path.display()))?;
        }
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls)))
}

/// Sends `CONNECT` and returns the broker's first answer.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    auth_method_name: Option<String>,
    auth_data: Option<Vec<u8>>,
) -> Option<proto::BaseCommand> {
    let mut framed = Framed::new(stream, Codec);
    let connect = Frame {
        command: proto::BaseCommand {
            r#type: proto::base_command::Type::Connect as i32,
            connect: Some(proto::CommandConnect {
                auth_method_name,
                auth_data,
                client_version: format!("sluice-probe/{}", env!("CARGO_PKG_VERSION")),
                protocol_version: Some(12),
                ..Default::default()
            }),
            ..Default::default()
        },
        payload: None,
    };
    tokio::time::timeout(STEP, framed.send(connect))
        .await
        .ok()?
        .ok()?;
    // The connection is dropped after the answer: the broker closes its side.
    let answer = tokio::time::timeout(STEP, framed.next())
        .await
        .ok()??
        .ok()?;
    Some(answer.command)
}
