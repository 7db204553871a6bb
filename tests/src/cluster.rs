//! The secured multi-broker Pulsar cluster the test command starts (`deploy/pulsar/cluster.sh`,
//! issue #21): its addresses, CA and role tokens from `cluster.sh env`, superuser admin calls
//! (tenants, grants, unloads), and the script's faults. Shared by the production-Pulsar suite
//! (`services/cli/tests/cluster.rs`) and the soak's cluster mode ([`crate::soak`]).

use std::{path::PathBuf, time::Duration};

use serde_json::{Value, json};

/// The secured cluster, from `cluster.sh env`.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// `pulsar+ssl://` of the brokers' shared name.
    pub url: String,
    /// `https://` admin API of the brokers' shared name.
    pub admin_url: String,
    /// The CA that signed the brokers' certificates.
    pub ca: PathBuf,
    /// A CA that signed nothing of the cluster's (for the refused-certificate test).
    pub untrusted_ca: PathBuf,
    /// The role tokens: `<name>.token` (admin, text-completion, prompt, agent, gateway, nobody,
    /// expired, forged).
    pub tokens: PathBuf,
    /// `deploy/pulsar/cluster.sh`.
    pub script: PathBuf,
    /// An HTTP client trusting the cluster's CA, redirects not followed.
    pub admin: reqwest::Client,
    /// The superuser's token.
    pub admin_token: String,
}

impl Cluster {
    /// The cluster, or `None` (after saying so) when the test command did not start one.
    pub fn from_env() -> Option<Cluster> {
        let Ok(url) = std::env::var("SLUICE_CLUSTER_URL") else {
            // Counted like every other skip (the test command's summary line names it); the
            // test's thread carries its name.
            let test = std::thread::current()
                .name()
                .unwrap_or("a secured-cluster test")
                .to_owned();
            crate::skipped(
                &format!(
                    "{test}: skipped, SLUICE_CLUSTER_URL is not set (no secured Pulsar cluster: \
                     deploy/pulsar/cluster.sh start, then eval \"$(deploy/pulsar/cluster.sh env)\")"
                ),
                "scripts/test.sh starts the cluster",
            );
            return None;
        };
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
        let ca = PathBuf::from(var("SLUICE_CLUSTER_CA"));
        let tokens = PathBuf::from(var("SLUICE_CLUSTER_TOKENS"));
        sluice_runtime::install_crypto_provider();
        let admin = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .add_root_certificate(
                reqwest::Certificate::from_pem(&std::fs::read(&ca).unwrap()).unwrap(),
            )
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let admin_token = std::fs::read_to_string(tokens.join("admin.token"))
            .unwrap()
            .trim()
            .to_owned();
        Some(Cluster {
            url,
            admin_url: var("SLUICE_CLUSTER_ADMIN_URL"),
            ca,
            untrusted_ca: PathBuf::from(var("SLUICE_CLUSTER_UNTRUSTED_CA")),
            tokens,
            script: PathBuf::from(var("SLUICE_CLUSTER_SCRIPT")),
            admin,
            admin_token,
        })
    }

    /// The path of role token `name` (`text-completion`, `gateway`, ...).
    pub fn token(&self, name: &str) -> String {
        self.tokens
            .join(format!("{name}.token"))
            .to_string_lossy()
            .into_owned()
    }

    /// A GET on the admin API as the superuser (following the owner's redirect): the status
    /// and the body.
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        let mut url = format!("{}{path}", self.admin_url);
        for _ in 0..4 {
            let resp = self
                .admin
                .get(&url)
                .bearer_auth(&self.admin_token)
                .send()
                .await
                .unwrap();
            if resp.status().is_redirection() {
                url = resp.headers()["location"].to_str().unwrap().to_owned();
                continue;
            }
            let status = resp.status().as_u16();
            return (status, resp.text().await.unwrap_or_default());
        }
        (0, format!("GET {path}: too many redirects"))
    }

    /// An admin API call as the superuser, which must succeed (or find the thing exists). A
    /// broker that does not own the topic redirects (307) to the one that does; the redirect
    /// is followed here with the token, which reqwest rightly drops when a redirect changes
    /// host.
    pub async fn admin_call(&self, method: reqwest::Method, path: &str, body: Option<Value>) {
        if let Err(e) = self.try_admin_call(method, path, body).await {
            panic!("{e}");
        }
    }

    /// The same, with its failure as an error.
    pub async fn try_admin_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(), String> {
        let mut url = format!("{}{path}", self.admin_url);
        for _ in 0..4 {
            let mut r = self
                .admin
                .request(method.clone(), &url)
                .bearer_auth(&self.admin_token);
            if let Some(b) = &body {
                r = r.json(b);
            }
            let resp = r
                .send()
                .await
                .map_err(|e| format!("{method} {path}: {e}"))?;
            let status = resp.status();
            if status.is_redirection() {
                url = resp
                    .headers()
                    .get("location")
                    .and_then(|l| l.to_str().ok())
                    .ok_or_else(|| format!("{method} {path}: a redirect without a location"))?
                    .to_owned();
                continue;
            }
            if status.is_success() || status == reqwest::StatusCode::CONFLICT {
                return Ok(());
            }
            return Err(format!(
                "{method} {path}: {status} {}",
                resp.text().await.unwrap_or_default()
            ));
        }
        Err(format!("{method} {path}: too many redirects"))
    }

    /// A fresh tenant (sluice's topicspace) with the request, response and notify
    /// namespaces, administered by the superuser only.
    pub async fn topicspace(&self) -> String {
        let ts = format!("c{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        self.admin_call(
            reqwest::Method::PUT,
            &format!("/admin/v2/tenants/{ts}"),
            Some(json!({"adminRoles": [], "allowedClusters": ["sluice"]})),
        )
        .await;
        for ns in ["request", "response", "notify"] {
            self.admin_call(
                reqwest::Method::PUT,
                &format!("/admin/v2/namespaces/{ts}/{ns}"),
                None,
            )
            .await;
        }
        ts
    }

    /// Grants `actions` on `topic` to `role`, creating the topic first: Pulsar 4.0 refuses a
    /// grant on a topic that does not exist yet (an operator runs `topics create` first).
    pub async fn grant(&self, topic: &str, role: &str, actions: &[&str]) {
        if let Err(e) = self.try_grant(topic, role, actions).await {
            panic!("{e}");
        }
    }

    /// The same, with its failure as an error.
    pub async fn try_grant(&self, topic: &str, role: &str, actions: &[&str]) -> Result<(), String> {
        let path = topic.replacen("://", "/", 1);
        self.try_admin_call(reqwest::Method::PUT, &format!("/admin/v2/{path}"), None)
            .await?;
        // Right after the topic is made, the broker that does not own it may not know it yet
        // and answer 404 (as cluster.sh's grant allows for): asked again for a few seconds.
        let mut tries = 0;
        loop {
            let result = self
                .try_admin_call(
                    reqwest::Method::POST,
                    &format!("/admin/v2/{path}/permissions/{role}"),
                    Some(json!(actions)),
                )
                .await;
            match result {
                Err(e) if e.contains("404") && tries < 5 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                other => return other,
            }
        }
    }

    /// Takes back every action `role` was granted on `topic`.
    pub async fn revoke(&self, topic: &str, role: &str) {
        let path = topic.replacen("://", "/", 1);
        self.admin_call(
            reqwest::Method::DELETE,
            &format!("/admin/v2/{path}/permissions/{role}"),
            None,
        )
        .await;
    }

    /// The least-privilege grants of one service's topics (docs/production-pulsar.md, "Roles and grants"): the
    /// service's own role ([`role`]) consumes requests and cancels and produces answers; the
    /// gateway the opposite.
    pub async fn grant_service(&self, ts: &str, service: &str) {
        self.grant_mapped(ts, service, DURABLE).await;
    }

    /// [`Cluster::grant_service`] for the topics of `mapping`.
    pub async fn grant_mapped(&self, ts: &str, service: &str, mapping: &str) {
        let [req, resp, cancel] = mapped_topics(ts, service, mapping);
        let own = role(service);
        self.grant(&req, &own, &["consume"]).await;
        self.grant(&cancel, &own, &["consume"]).await;
        self.grant(&resp, &own, &["produce"]).await;
        self.grant(&req, "sluice-gateway", &["produce"]).await;
        self.grant(&cancel, "sluice-gateway", &["produce"]).await;
        self.grant(&resp, "sluice-gateway", &["consume"]).await;
    }

    /// Unloads every bundle of `namespace` (`tenant/namespace`): its topics move.
    pub async fn unload(&self, namespace: &str) {
        self.admin_call(
            reqwest::Method::PUT,
            &format!("/admin/v2/namespaces/{namespace}/unload"),
            None,
        )
        .await;
    }

    /// Runs `cluster.sh ARGS` (a fault, or a repair) and waits for it; it must succeed.
    pub async fn script(&self, args: &[&str]) -> String {
        self.try_script(args)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The same, with its failure as an error.
    pub async fn try_script(&self, args: &[&str]) -> Result<String, String> {
        let out = tokio::process::Command::new("bash")
            .arg(&self.script)
            .args(args)
            .output()
            .await
            .map_err(|e| format!("cluster.sh {args:?}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "cluster.sh {args:?} failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Every role's least-privilege grants on the default topics of topicspace `ts`, as
    /// `cluster.sh grant-roles` gives them (docs/production-pulsar.md#roles-and-grants): the
    /// script's table is the one tested.
    pub async fn try_grant_roles(&self, ts: &str) -> Result<(), String> {
        self.try_script(&["grant-roles", ts]).await.map(drop)
    }

    /// The number (1 or 2) of the broker that owns `topic` now.
    pub async fn owner(&self, topic: &str) -> &'static str {
        self.try_owner(topic)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The same, with its failure as an error.
    pub async fn try_owner(&self, topic: &str) -> Result<&'static str, String> {
        let url = self.try_script(&["owner", topic]).await?;
        if url.contains("127.0.0.2") {
            Ok("1")
        } else if url.contains("127.0.0.3") {
            Ok("2")
        } else {
            Err(format!("owner of {topic}: {url}"))
        }
    }

    /// Where the brokers' logs are read from now: each log file's length
    /// ([`Cluster::broker_log_since`] reads what they write after it).
    pub fn broker_log_mark(&self) -> BrokerLogMark {
        BrokerLogMark(
            self.broker_log_files()
                .into_iter()
                .map(|f| {
                    let len = std::fs::metadata(&f).map_or(0, |m| m.len());
                    (f, len)
                })
                .collect(),
        )
    }

    /// What the brokers logged since `mark` (a file that is new or shorter than at the mark, as
    /// a rotated log is, is read whole).
    pub fn broker_log_since(&self, mark: &BrokerLogMark) -> String {
        use std::io::{Read, Seek, SeekFrom};
        let mut text = String::new();
        for f in self.broker_log_files() {
            let Ok(mut file) = std::fs::File::open(&f) else {
                continue;
            };
            let len = file.metadata().map_or(0, |m| m.len());
            let from = mark.0.get(&f).copied().filter(|m| *m <= len).unwrap_or(0);
            if file.seek(SeekFrom::Start(from)).is_ok() {
                let mut bytes = Vec::new();
                let _ = file.read_to_end(&mut bytes);
                text.push_str(&String::from_utf8_lossy(&bytes));
            }
        }
        text
    }

    /// The brokers' log files: `cluster.sh` keeps its state (the CA under `pki/`, each
    /// process's logs under `logs/NAME/`) in one directory; a broker logs to its `stdout.log`
    /// there (or `pulsar-broker*.log`, with Pulsar's file appender), beside its GC logs.
    fn broker_log_files(&self) -> Vec<PathBuf> {
        let Some(state) = self.ca.parent().and_then(std::path::Path::parent) else {
            return Vec::new();
        };
        let mut files = Vec::new();
        for n in 1..=2 {
            let dir = state.join(format!("logs/broker-{n}"));
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".log") && !name.starts_with("pulsar_gc") {
                    files.push(e.path());
                }
            }
        }
        files
    }

    /// Environment of a sluice process authenticated as `role_token`.
    pub fn env(&self, token: &str) -> Vec<(String, String)> {
        vec![
            ("SLUICE_PULSAR_TOKEN_FILE".into(), self.token(token)),
            (
                "SLUICE_PULSAR_TLS_CA_FILE".into(),
                self.ca.to_string_lossy().into_owned(),
            ),
            // SLUICE_CLUSTER_RUST_LOG asks the processes for more (e.g.
            // `info,sluice_runtime=debug`) when a fault is investigated.
            (
                "RUST_LOG".into(),
                std::env::var("SLUICE_CLUSTER_RUST_LOG").unwrap_or_else(|_| "warn".into()),
            ),
        ]
    }
}

/// The lengths of the brokers' log files at a moment ([`Cluster::broker_log_mark`]).
#[derive(Debug, Clone, Default)]
pub struct BrokerLogMark(std::collections::HashMap<PathBuf, u64>);

/// The Pulsar role of sluice's `service` (`text-completion`, `prompt`, `agent`, `gateway`):
/// `sluice-<service>`, whose token is `<service>.token` ([`Cluster::token`]).
pub fn role(service: &str) -> String {
    format!("sluice-{service}")
}

/// The request, response and cancel topics of `service` in topicspace `ts` under the durable
/// mapping.
pub fn topics(ts: &str, service: &str) -> [String; 3] {
    mapped_topics(ts, service, DURABLE)
}

/// sluice's durable topic mapping.
pub const DURABLE: &str = "durable";
/// TrustGraph's topic mapping.
pub const TRUSTGRAPH: &str = "trustgraph";

/// The same under `mapping` (TrustGraph's makes requests, answers and cancels
/// non-persistent).
pub fn mapped_topics(ts: &str, service: &str, mapping: &str) -> [String; 3] {
    let scheme = if mapping == TRUSTGRAPH {
        "non-persistent"
    } else {
        "persistent"
    };
    [
        format!("{scheme}://{ts}/request/{service}"),
        format!("{scheme}://{ts}/response/{service}"),
        format!("{scheme}://{ts}/notify/{service}-cancel"),
    ]
}
