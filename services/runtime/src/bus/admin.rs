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
    /// Keep messages this many minutes after every subscription acked them, up to
    /// `retention_mb` per topic (0 = Pulsar's default, kept only while unacked). Set on
    /// response namespaces: a resumed stream reads its records again.
    pub retention_minutes: u32,
    /// The size bound of `retention_minutes`, in MiB per topic.
    pub retention_mb: u32,
}

impl PulsarAdmin {
    /// A client for the admin API at `base` (e.g. `http://127.0.0.1:8080`). With a `token`,
    /// an `http://` base beyond loopback is refused unless `allow_plaintext_credentials`: the
    /// token would cross the network in the clear
    /// ([`super::pulsar_security::plaintext_beyond_loopback`]).
    pub fn new(
        base: impl Into<String>,
        token: Option<Secret>,
        allow_plaintext_credentials: bool,
    ) -> Result<Self, BusError> {
        let base = base.into();
        if token.is_some() {
            super::pulsar_security::refuse_plaintext_credentials(
                &base,
                "the admin API",
                "the Pulsar token",
                allow_plaintext_credentials,
            )
            .map_err(|e| BusError::Config(e.to_string()))?;
        }
        crate::install_crypto_provider();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| BusError::Config(format!("admin HTTP client: {e}")))?;
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
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

    /// Sends `r`; a broker that cannot be reached is unavailable for `what`.
    async fn send(what: &str, r: reqwest::RequestBuilder) -> Result<reqwest::Response, BusError> {
        r.send()
            .await
            .map_err(|e| BusError::Unavailable(format!("{what}: {e}")))
    }

    async fn expect_ok(
        &self,
        what: &str,
        r: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, BusError> {
        let resp = Self::send(what, r).await?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(refusal(what, resp).await)
    }

    /// Creates the tenant or namespace at `path` (PUT) unless it exists. Creators racing on
    /// the same new object (processes starting together) collide in Pulsar's metadata store:
    /// the losers get 409, or a 500 "BadVersionException: Version mismatch" when their writes
    /// meet inside the store. After a server error the object is looked up, and only if it is
    /// still missing is the creation tried again, a few times with a short backoff.
    async fn create(
        &self,
        what: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(), BusError> {
        const ATTEMPTS: u32 = 4;
        let mut attempt = 1;
        loop {
            let mut put = self.request(reqwest::Method::PUT, path);
            if let Some(body) = body {
                put = put.json(body);
            }
            let resp = Self::send(what, put).await?;
            let status = resp.status();
            if status.is_success() || status == StatusCode::CONFLICT {
                return Ok(());
            }
            if !status.is_server_error() || attempt == ATTEMPTS {
                return Err(refusal(what, resp).await);
            }
            if self.exists(path).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            attempt += 1;
        }
    }

    /// Whether GET `path` answers with success.
    async fn exists(&self, path: &str) -> bool {
        matches!(
            self.request(reqwest::Method::GET, path).send().await,
            Ok(r) if r.status().is_success()
        )
    }

    /// The cluster names, once the broker is up.
    pub async fn clusters(&self) -> Result<Vec<String>, BusError> {
        let resp = self
            .expect_ok(
                "listing clusters",
                self.request(reqwest::Method::GET, "/admin/v2/clusters"),
            )
            .await?;
        resp.json()
            .await
            .map_err(|e| BusError::Unavailable(format!("listing clusters: {e}")))
    }

    /// Has the broker compact `topic` (`persistent://tenant/namespace/name`, existing) once
    /// `bytes` wait uncompacted: a topic of keyed state then stays about one message per key
    /// for a reader from its start.
    pub async fn set_compaction_threshold(&self, topic: &str, bytes: u64) -> Result<(), BusError> {
        self.set_topic_policy(topic, "compactionThreshold", "compaction threshold", &bytes)
            .await
    }

    /// Keeps what `topic` (`persistent://tenant/namespace/name`, existing) holds for
    /// `minutes` and up to `mb` MiB (-1: no size bound), whatever its namespace's retention: a
    /// topic-level policy. Pulsar refuses a size bound below the topic's backlog quota (10 GiB
    /// by default).
    pub async fn set_topic_retention(
        &self,
        topic: &str,
        minutes: u32,
        mb: i64,
    ) -> Result<(), BusError> {
        let body = serde_json::json!({
            "retentionTimeInMinutes": minutes,
            "retentionSizeInMB": mb,
        });
        self.set_topic_policy(topic, "retention", "retention", &body)
            .await
    }

    /// The retention that keeps `topic` long enough to leave alone, as minutes and MiB: the
    /// topic's own policy if it has one, else its namespace's (or the broker's) when that keeps
    /// it for ever or at least `at_least_minutes`, with no size bound; `None` when neither
    /// does.
    pub async fn topic_retention_at_least(
        &self,
        topic: &str,
        at_least_minutes: i64,
    ) -> Result<Option<(i64, i64)>, BusError> {
        let Some(path) = topic.strip_prefix("persistent://") else {
            return Ok(None);
        };
        let what = format!("reading the retention of {topic}");
        let read = |applied: bool| {
            let url = format!("/admin/v2/persistent/{path}/retention?applied={applied}");
            let what = what.clone();
            async move {
                let resp = self
                    .expect_ok(&what, self.request(reqwest::Method::GET, &url))
                    .await?;
                // Pulsar answers `null`, an empty body or `{}` when there is no policy.
                let body = resp
                    .text()
                    .await
                    .map_err(|e| BusError::Unavailable(format!("{what}: {e}")))?;
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let field = |name: &str| v.get(name).and_then(serde_json::Value::as_i64);
                Ok::<_, BusError>(
                    field("retentionTimeInMinutes")
                        .map(|m| (m, field("retentionSizeInMB").unwrap_or(0))),
                )
            }
        };
        if let Some(own) = read(false).await? {
            return Ok(Some(own));
        }
        // Long enough, and not trimmed by size (Pulsar's size bound would cut the ledger).
        Ok(read(true)
            .await?
            .filter(|&(minutes, mb)| (minutes < 0 || minutes >= at_least_minutes) && mb < 0))
    }

    /// POSTs `body` to the topic policy `policy` of the persistent `topic`.
    async fn set_topic_policy(
        &self,
        topic: &str,
        policy: &str,
        what: &str,
        body: &impl serde::Serialize,
    ) -> Result<(), BusError> {
        let Some(path) = topic.strip_prefix("persistent://") else {
            return Err(BusError::Config(format!(
                "{topic:?} is not a persistent topic: topic policies are set on those only"
            )));
        };
        self.expect_ok(
            &format!("setting the {what} of {topic}"),
            self.request(
                reqwest::Method::POST,
                &format!("/admin/v2/persistent/{path}/{policy}"),
            )
            .json(body),
        )
        .await
        .map(|_| ())
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
        self.create(
            &format!("creating tenant {tenant}"),
            &format!("/admin/v2/tenants/{tenant}"),
            Some(&tenant_body),
        )
        .await?;
        self.create(
            &format!("creating namespace {namespace}"),
            &format!("/admin/v2/namespaces/{namespace}"),
            None,
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
            )
            .await?;
        }
        if policy.retention_minutes > 0 {
            self.expect_ok(
                &format!("setting retention on {namespace}"),
                self.request(
                    reqwest::Method::POST,
                    &format!("/admin/v2/namespaces/{namespace}/retention"),
                )
                .json(&serde_json::json!({
                    "retentionTimeInMinutes": policy.retention_minutes,
                    "retentionSizeInMB": policy.retention_mb,
                })),
            )
            .await?;
        }
        Ok(())
    }
}

/// The error an admin answer other than success becomes: a denial for 401 and 403 (with
/// the operation, so that the operator knows which permission is missing), otherwise the
/// broker unavailable for it, with the start of the body.
async fn refusal(what: &str, resp: reqwest::Response) -> BusError {
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    let body: String = body.chars().take(300).collect();
    let cause = match status {
        StatusCode::UNAUTHORIZED => Some(DenialCause::Authentication),
        StatusCode::FORBIDDEN => Some(DenialCause::Authorization),
        _ => None,
    };
    match cause {
        Some(cause) => BusError::Denied(Denial {
            cause,
            operation: format!("{what} through the admin API"),
            detail: format!("HTTP {status}: {body}"),
        }),
        None => BusError::Unavailable(format!("{what}: HTTP {status}: {body}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_not_sent_to_a_plaintext_admin_url_beyond_loopback_unless_allowed() {
        let token = || Some(Secret::new("admin-token-77"));
        let e = PulsarAdmin::new("http://pulsar.example:8080", token(), false).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("plaintext http://") && e.contains("--allow-plaintext-credentials"),
            "{e}"
        );
        assert!(
            !e.contains("admin-token-77") && !e.contains("pulsar.example"),
            "{e}"
        );
        assert!(PulsarAdmin::new("http://pulsar.example:8080", token(), true).is_ok());
        assert!(PulsarAdmin::new("http://pulsar.example:8080", None, false).is_ok());
        assert!(PulsarAdmin::new("https://pulsar.example:8443", token(), false).is_ok());
        assert!(PulsarAdmin::new("http://127.0.0.1:8080", token(), false).is_ok());
    }
}
