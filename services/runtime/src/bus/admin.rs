//! Pulsar's admin REST API, for what a processor needs before it can subscribe: the
//! tenant and namespace of its topics (Pulsar creates topics on first use, but not
//! tenants or namespaces), and a namespace policy that expires the response
//! subscriptions of client instances that died without unsubscribing.

use std::time::Duration;

use reqwest::StatusCode;

use super::{
    BusError,
    pulsar_security::{Denial, DenialCause},
};
use crate::secret::Secret;

/// An admin client for one Pulsar cluster.
#[derive(Clone)]
pub struct PulsarAdmin {
    base: String,
    http: reqwest::Client,
    token: Option<Secret>,
}

impl std::fmt::Debug for PulsarAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarAdmin")
            .field("base", &self.base)
            .finish()
    }
}

/// Policies applied to a namespace sluice creates or finds.
#[derive(Debug, Clone, Copy, Default)]
pub struct NamespacePolicy {
    /// Delete subscriptions with no consumer for this many minutes (0 = never). Set on
    /// response namespaces: each client instance has its own durable subscription there.
    pub subscription_expiration_minutes: u32,
}

impl PulsarAdmin {
    /// A client for the admin API at `base` (e.g. `http://127.0.0.1:8080`).
    pub fn new(base: impl Into<String>, token: Option<Secret>) -> Result<Self, BusError> {
        crate::install_crypto_provider();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| BusError::Config(format!("admin HTTP client: {e}")))?;
        Ok(Self {
            base: base.into().trim_end_matches('/').to_owned(),
            http,
            token,
        })
    }

    /// Trusts the CA certificates in the PEM file at `path` for an `https://` admin URL,
    /// besides the system roots.
    pub fn with_tls_ca_file(mut self, path: &std::path::Path) -> Result<Self, BusError> {
        let pem = std::fs::read(path).map_err(|e| {
            BusError::Config(format!(
                "cannot read the TLS CA file {}: {e}",
                path.display()
            ))
        })?;
        let mut builder = reqwest::Client::builder().timeout(Duration::from_secs(30));
        for cert in reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
            BusError::Config(format!(
                "the TLS CA file {} is not PEM: {e}",
                path.display()
            ))
        })? {
            builder = builder.add_root_certificate(cert);
        }
        self.http = builder
            .build()
            .map_err(|e| BusError::Config(format!("admin HTTP client: {e}")))?;
        Ok(self)
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut r = self.http.request(method, format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            r = r.bearer_auth(t.expose());
        }
        r
    }

    async fn expect_ok(
        &self,
        what: &str,
        r: reqwest::RequestBuilder,
        also_ok: &[StatusCode],
    ) -> Result<reqwest::Response, BusError> {
        let resp = r
            .send()
            .await
            .map_err(|e| BusError::Unavailable(format!("{what}: {e}")))?;
        let status = resp.status();
        if status.is_success() || also_ok.contains(&status) {
            return Ok(resp);
        }
        let body = resp.text().await.unwrap_or_default();
        let body: String = body.chars().take(300).collect();
        let cause = match status {
            StatusCode::UNAUTHORIZED => Some(DenialCause::Authentication),
            StatusCode::FORBIDDEN => Some(DenialCause::Authorization),
            _ => None,
        };
        Err(match cause {
            Some(cause) => BusError::Denied(Denial {
                cause,
                operation: format!("{what} through the admin API"),
                detail: format!("HTTP {status}: {body}"),
            }),
            None => BusError::Unavailable(format!("{what}: HTTP {status}: {body}")),
        })
    }

    /// The cluster names, once the broker is up.
    pub async fn clusters(&self) -> Result<Vec<String>, BusError> {
        let resp = self
            .expect_ok(
                "listing clusters",
                self.request(reqwest::Method::GET, "/admin/v2/clusters"),
                &[],
            )
            .await?;
        resp.json()
            .await
            .map_err(|e| BusError::Unavailable(format!("listing clusters: {e}")))
    }

    /// Creates `tenant/namespace` if missing and applies `policy`. Idempotent.
    pub async fn ensure_namespace(
        &self,
        namespace: &str,
        policy: NamespacePolicy,
    ) -> Result<(), BusError> {
        let Some((tenant, _)) = namespace.split_once('/') else {
            return Err(BusError::Config(format!(
                "namespace {namespace:?} is not tenant/namespace"
            )));
        };
        let clusters = self.clusters().await?;
        let tenant_body = serde_json::json!({"adminRoles": [], "allowedClusters": clusters});
        self.expect_ok(
            &format!("creating tenant {tenant}"),
            self.request(reqwest::Method::PUT, &format!("/admin/v2/tenants/{tenant}"))
                .json(&tenant_body),
            &[StatusCode::CONFLICT],
        )
        .await?;
        self.expect_ok(
            &format!("creating namespace {namespace}"),
            self.request(
                reqwest::Method::PUT,
                &format!("/admin/v2/namespaces/{namespace}"),
            ),
            &[StatusCode::CONFLICT],
        )
        .await?;
        if policy.subscription_expiration_minutes > 0 {
            self.expect_ok(
                &format!("setting subscription expiration on {namespace}"),
                self.request(
                    reqwest::Method::POST,
                    &format!("/admin/v2/namespaces/{namespace}/subscriptionExpirationTime"),
                )
                .json(&policy.subscription_expiration_minutes),
                &[],
            )
            .await?;
        }
        Ok(())
    }
}
