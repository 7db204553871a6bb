//! API keys (docs/gateway.md#api-keys): many callers, each with a name, what it may call and
//! its limits, from a TOML file that is read again while the gateway runs.
//!
//! The file holds each key's SHA-256, never the key: a caller's bearer token is hashed and
//! looked up. A fast hash is the right one here (GitHub and Stripe do the same): keys are long
//! random strings, not passwords, so there is nothing for a slow hash to protect against,
//! and every request pays for the hash.
//!
//! ```toml
//! [[keys]]
//! name = "team-a"                 # in metrics and logs; the key itself never is
//! sha256 = "9f86d0…"              # `sluice keys hash` prints it
//! services = ["text-completion"]  # optional: text-completion, prompt, agent
//! models = ["gpt-4o-mini"]        # optional: the models a request may name
//! flows = ["default"]             # optional: the flows it may address
//! tool_groups = ["default", "research"]  # the agent's tool groups it may name (default:
//!                                 # the `default` group alone)
//! operator_fields = ["retry"]     # operator-only request fields it may set (default: none;
//!                                 # crate::kinds::OPERATOR_FIELDS names them)
//! requests_per_minute = 60        # each limit is optional
//! tokens_per_minute = 20000
//! tokens_per_day = 1000000
//! tokens_per_month = 20000000
//! reserve_tokens = 1024           # held per request that names no max_tokens (default 1024)
//! concurrent_requests = 8         # requests (and resumed streams) in flight at once
//! ```

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::kinds::ServiceKind;

/// What a request reserves of a key's token limits when it names no `max_tokens`.
pub const DEFAULT_RESERVE_TOKENS: u64 = 1024;

/// How often the keys file is read again. A Kubernetes Secret mounted as a volume is
/// replaced by the kubelet (within its sync period, about a minute by default); a file edited
/// in place is seen within this.
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// A key's limits; `None` is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    /// Requests admitted per minute (a sliding minute).
    pub requests_per_minute: Option<u64>,
    /// Tokens (input and output) per minute (a sliding minute), reserved up front.
    pub tokens_per_minute: Option<u64>,
    /// Tokens per UTC day.
    pub tokens_per_day: Option<u64>,
    /// Tokens per UTC calendar month.
    pub tokens_per_month: Option<u64>,
    /// Reserved per request that names no `max_tokens`.
    pub reserve_tokens: u64,
    /// Requests in flight at once, resumed streams included, on all replicas together.
    pub concurrent_requests: Option<u64>,
}

impl Limits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.requests_per_minute.is_some()
            || self.tokens_per_minute.is_some()
            || self.tokens_per_day.is_some()
            || self.tokens_per_month.is_some()
            || self.concurrent_requests.is_some()
    }
}

/// One API key: who it is, what it may call, its limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// The key's name (metrics, logs, the shared limit state).
    pub name: Arc<str>,
    services: Option<BTreeSet<ServiceKind>>,
    models: Option<BTreeSet<String>>,
    flows: Option<BTreeSet<String>>,
    /// The agent's tool groups its requests may name; `None`: the `default` group alone.
    tool_groups: Option<BTreeSet<String>>,
    /// The operator-only request fields its requests may set (see
    /// [`crate::kinds::OPERATOR_FIELDS`]); empty: none.
    operator_fields: BTreeSet<String>,
    /// Its limits.
    pub limits: Limits,
}

impl Key {
    /// The agent's tool groups this key's requests may name; `None`: the `default` group
    /// alone (see [`crate::auth::Standing`]).
    pub fn tool_groups(&self) -> Option<&BTreeSet<String>> {
        self.tool_groups.as_ref()
    }

    /// The operator-only request fields this key may set (`operator_fields` in the keys
    /// file; see [`crate::auth::Standing`]).
    pub fn operator_fields(&self) -> &BTreeSet<String> {
        &self.operator_fields
    }

    /// Why this key may not make a call to `service` of `flow` naming `model`, if it may not.
    ///
    /// A request that names no model gets the one the operator configured for the processor,
    /// so a model list restricts only what callers name.
    pub fn refuses(&self, service: ServiceKind, flow: &str, model: Option<&str>) -> Option<String> {
        if let Some(services) = &self.services
            && !services.contains(&service)
        {
            return Some(format!(
                "the API key {:?} may not call the {} service",
                self.name,
                service.as_str()
            ));
        }
        if let Some(flows) = &self.flows
            && !flows.contains(flow)
        {
            return Some(format!(
                "the API key {:?} may not use the flow {flow:?}",
                self.name
            ));
        }
        if let (Some(models), Some(model)) = (&self.models, model)
            && !models.contains(model)
        {
            return Some(format!(
                "the API key {:?} may not use the model {model:?}",
                self.name
            ));
        }
        None
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileKey {
    name: String,
    sha256: String,
    services: Option<Vec<String>>,
    models: Option<Vec<String>>,
    flows: Option<Vec<String>>,
    tool_groups: Option<Vec<String>>,
    operator_fields: Option<Vec<String>>,
    requests_per_minute: Option<u64>,
    tokens_per_minute: Option<u64>,
    tokens_per_day: Option<u64>,
    tokens_per_month: Option<u64>,
    reserve_tokens: Option<u64>,
    concurrent_requests: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    keys: Vec<FileKey>,
}

/// A set of keys, found by the SHA-256 of the bearer token.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeyRing {
    by_hash: HashMap<[u8; 32], Arc<Key>>,
    /// The keys' names (each key has one of its own).
    names: HashSet<Arc<str>>,
}

/// The SHA-256 of `key`, as the keys file holds it (lowercase hex).
pub fn hash_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Why a keys file's text is not a set of keys. The words name the key (its place and name)
/// and the field, never a hash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyRingError {
    /// Not the keys file's TOML (the parser's words: the line, the unknown field).
    #[error("{0}")]
    Toml(String),
    /// A key has an empty name (its place in the file, from 1).
    #[error("key {0}: the name is empty")]
    EmptyName(usize),
    /// A key is not usable.
    #[error("key {place} ({name:?}): {problem}")]
    Key {
        /// Its place in the file, from 1.
        place: usize,
        /// Its name.
        name: String,
        /// What is wrong with it.
        problem: KeyProblem,
    },
}

/// What is wrong with one key of a keys file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyProblem {
    /// Another key has the same name.
    #[error("the name is used twice")]
    NameUsedTwice,
    /// `sha256` is not a SHA-256 in hex.
    #[error("sha256 must be 64 hex digits (`sluice keys hash`)")]
    BadHash,
    /// `services` names a service that does not exist.
    #[error("unknown service {0:?}: expected text-completion, prompt or agent")]
    UnknownService(String),
    /// `tool_groups` has an empty name.
    #[error("tool_groups has an empty name")]
    EmptyToolGroup,
    /// `operator_fields` names a field that is not an operator field (the field, the known
    /// ones).
    #[error("operator_fields: {0:?} is not one of {1}")]
    UnknownOperatorField(String, String),
    /// A limit is 0.
    #[error("{0} is 0: remove the key to stop it, or the field to lift the limit")]
    ZeroLimit(&'static str),
    /// Another key has the same hash.
    #[error("the same key is listed twice")]
    SameKey,
}

/// Why a keys file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeysFileError {
    /// It cannot be read.
    #[error("cannot read the keys file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The read's failure.
        source: std::io::Error,
    },
    /// Its text is not a set of keys.
    #[error("the keys file {path} is invalid: {source}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: KeyRingError,
    },
}

impl KeyRing {
    /// Reads a keys file's text. Errors name the key and the field, never a hash.
    pub fn parse(text: &str) -> Result<Self, KeyRingError> {
        let file: File =
            toml::from_str(text).map_err(|e| KeyRingError::Toml(e.message().to_owned()))?;
        let mut by_hash = HashMap::new();
        let mut names = BTreeSet::new();
        for (i, k) in file.keys.into_iter().enumerate() {
            let place = i + 1;
            let bad = |problem| KeyRingError::Key {
                place,
                name: k.name.clone(),
                problem,
            };
            if k.name.is_empty() {
                return Err(KeyRingError::EmptyName(place));
            }
            if !names.insert(k.name.clone()) {
                return Err(bad(KeyProblem::NameUsedTwice));
            }
            let mut hash = [0u8; 32];
            hex::decode_to_slice(k.sha256.trim(), &mut hash)
                .map_err(|_| bad(KeyProblem::BadHash))?;
            let services = match &k.services {
                None => None,
                Some(list) => Some(
                    list.iter()
                        .map(|s| {
                            ServiceKind::from_name(s)
                                .ok_or_else(|| bad(KeyProblem::UnknownService(s.clone())))
                        })
                        .collect::<Result<BTreeSet<_>, _>>()?,
                ),
            };
            if let Some(groups) = &k.tool_groups
                && groups.iter().any(|g| g.trim().is_empty())
            {
                return Err(bad(KeyProblem::EmptyToolGroup));
            }
            let operator_fields: BTreeSet<String> = k
                .operator_fields
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect();
            if let Some(unknown) = operator_fields.iter().find(|f| {
                !crate::kinds::OPERATOR_FIELDS
                    .iter()
                    .any(|(_, known)| known == f)
            }) {
                let known: BTreeSet<&str> = crate::kinds::OPERATOR_FIELDS
                    .iter()
                    .map(|(_, f)| *f)
                    .collect();
                return Err(bad(KeyProblem::UnknownOperatorField(
                    unknown.clone(),
                    known.into_iter().collect::<Vec<_>>().join(", "),
                )));
            }
            for (field, value) in [
                ("requests_per_minute", k.requests_per_minute),
                ("tokens_per_minute", k.tokens_per_minute),
                ("tokens_per_day", k.tokens_per_day),
                ("tokens_per_month", k.tokens_per_month),
                ("concurrent_requests", k.concurrent_requests),
            ] {
                if value == Some(0) {
                    return Err(bad(KeyProblem::ZeroLimit(field)));
                }
            }
            let key = Key {
                name: Arc::from(k.name.as_str()),
                services,
                models: k.models.map(|m| m.into_iter().collect()),
                flows: k.flows.map(|f| f.into_iter().collect()),
                tool_groups: k.tool_groups.map(|g| g.into_iter().collect()),
                operator_fields,
                limits: Limits {
                    requests_per_minute: k.requests_per_minute,
                    tokens_per_minute: k.tokens_per_minute,
                    tokens_per_day: k.tokens_per_day,
                    tokens_per_month: k.tokens_per_month,
                    reserve_tokens: k.reserve_tokens.unwrap_or(DEFAULT_RESERVE_TOKENS),
                    concurrent_requests: k.concurrent_requests,
                },
            };
            if by_hash.insert(hash, Arc::new(key)).is_some() {
                return Err(bad(KeyProblem::SameKey));
            }
        }
        let names = by_hash.values().map(|k| k.name.clone()).collect();
        Ok(Self { by_hash, names })
    }

    /// The key whose hash `token` has.
    pub fn find(&self, token: &str) -> Option<Arc<Key>> {
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_hash.get(&hash).cloned()
    }

    /// The keys' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_hash.values().map(|k| &*k.name)
    }

    /// Whether a key is named `name`.
    pub fn has_name(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// The keys of a file, read again every [`RELOAD_EVERY`] while [`Keys::watch`] runs. A file
/// that became unreadable or invalid leaves the keys as they were, and says so in the log and
/// in `sluice_gateway_keys_reloads_total{outcome="invalid"}`.
#[derive(Debug)]
pub struct Keys {
    path: PathBuf,
    ring: RwLock<Arc<KeyRing>>,
    /// The SHA-256 of the text last read, so an unchanged file is not parsed again.
    seen: RwLock<[u8; 32]>,
}

impl Keys {
    /// Reads `path`; the gateway does not start with a file it cannot read.
    pub fn load(path: &Path) -> Result<Self, KeysFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeysFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        let ring = KeyRing::parse(&text).map_err(|source| KeysFileError::Invalid {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            path: path.to_owned(),
            ring: RwLock::new(Arc::new(ring)),
            seen: RwLock::new(Sha256::digest(text.as_bytes()).into()),
        })
    }

    /// Keys that are `ring` and no file's (this crate's tests and its fuzz entry points).
    pub(crate) fn fixed(ring: KeyRing) -> Self {
        Self {
            path: PathBuf::new(),
            ring: RwLock::new(Arc::new(ring)),
            seen: RwLock::new([0; 32]),
        }
    }

    /// The keys now.
    pub fn ring(&self) -> Arc<KeyRing> {
        match self.ring.read() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Reads the file again if its text changed: `Some(Ok(n))` with the new number of keys,
    /// `Some(Err(why))` when it cannot be used, `None` when unchanged.
    pub fn reload(&self) -> Option<Result<usize, KeysFileError>> {
        // An unreadable file is remembered by its error, so that it too is reported once.
        let (text, digest) = match std::fs::read_to_string(&self.path) {
            Ok(t) => {
                let d: [u8; 32] = Sha256::digest(t.as_bytes()).into();
                (Ok(t), d)
            }
            Err(e) => {
                let d: [u8; 32] = Sha256::digest(format!("\0{e}").as_bytes()).into();
                (Err(e), d)
            }
        };
        if self.seen.read().is_ok_and(|s| *s == digest) {
            return None;
        }
        // Remembered even when invalid: the error is reported once per change, not per second.
        if let Ok(mut s) = self.seen.write() {
            *s = digest;
        }
        let text = match text {
            Ok(t) => t,
            Err(source) => {
                return Some(Err(KeysFileError::Read {
                    path: self.path.clone(),
                    source,
                }));
            }
        };
        let ring = match KeyRing::parse(&text) {
            Ok(r) => r,
            Err(source) => {
                return Some(Err(KeysFileError::Invalid {
                    path: self.path.clone(),
                    source,
                }));
            }
        };
        let n = ring.len();
        match self.ring.write() {
            Ok(mut r) => *r = Arc::new(ring),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(ring),
        }
        Some(Ok(n))
    }

    /// Reads the file again every [`RELOAD_EVERY`] until `stop`, telling `reloaded` each
    /// outcome (`true`: taken).
    pub async fn watch(self: Arc<Self>, stop: CancellationToken, reloaded: impl Fn(bool, usize)) {
        let mut tick = tokio::time::interval(RELOAD_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.reload() {
                None => {}
                Some(Ok(n)) => {
                    info!(keys = n, path = %self.path.display(), "API keys reloaded");
                    reloaded(true, n);
                }
                Some(Err(e)) => {
                    warn!(path = %self.path.display(), error = %e, "the keys file was not reloaded; the keys stay as they were");
                    reloaded(false, self.ring().len());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(entries: &str) -> String {
        format!("{entries}\n")
    }

    #[test]
    fn a_key_is_found_by_its_hash_and_nothing_else() {
        let text = file(&format!(
            "[[keys]]\nname = \"a\"\nsha256 = \"{}\"\nrequests_per_minute = 5\n",
            hash_hex("sk-alpha")
        ));
        let ring = KeyRing::parse(&text).unwrap();
        let key = ring.find("sk-alpha").unwrap();
        assert_eq!(&*key.name, "a");
        assert_eq!(key.limits.requests_per_minute, Some(5));
        assert_eq!(key.limits.reserve_tokens, DEFAULT_RESERVE_TOKENS);
        for other in [
            "",
            "sk-alph",
            "sk-alpha ",
            "SK-ALPHA",
            &hash_hex("sk-alpha"),
        ] {
            assert!(ring.find(other).is_none(), "{other:?}");
        }
    }

    #[test]
    fn permissions_restrict_services_flows_and_named_models() {
        let text = format!(
            "[[keys]]\nname = \"b\"\nsha256 = \"{}\"\nservices = [\"text-completion\"]\nmodels = [\"m1\"]\nflows = [\"default\"]\n",
            hash_hex("k")
        );
        let key = KeyRing::parse(&text).unwrap().find("k").unwrap();
        assert!(
            key.refuses(ServiceKind::TextCompletion, "default", Some("m1"))
                .is_none()
        );
        assert!(
            key.refuses(ServiceKind::TextCompletion, "default", None)
                .is_none()
        );
        let why = key
            .refuses(ServiceKind::TextCompletion, "default", Some("m2"))
            .unwrap();
        assert!(why.contains("model \"m2\""), "{why}");
        assert!(key.refuses(ServiceKind::Agent, "default", None).is_some());
        assert!(
            key.refuses(ServiceKind::TextCompletion, "other", None)
                .is_some()
        );
    }

    #[test]
    fn a_bad_file_is_refused_with_where_and_why_but_no_hash() {
        let good = hash_hex("k");
        for (text, expect) in [
            (
                "[[keys]]\nname = \"a\"\nsha256 = \"zz\"\n".to_owned(),
                "64 hex digits",
            ),
            (
                format!("[[keys]]\nname = \"a\"\nsha256 = \"{good}\"\nservices = [\"chat\"]\n"),
                "unknown service \"chat\"",
            ),
            (
                format!(
                    "[[keys]]\nname = \"a\"\nsha256 = \"{good}\"\n[[keys]]\nname = \"a\"\nsha256 = \"{}\"\n",
                    hash_hex("j")
                ),
                "used twice",
            ),
            (
                format!(
                    "[[keys]]\nname = \"a\"\nsha256 = \"{good}\"\n[[keys]]\nname = \"b\"\nsha256 = \"{good}\"\n"
                ),
                "listed twice",
            ),
            (
                format!("[[keys]]\nname = \"a\"\nsha256 = \"{good}\"\ntokens_per_day = 0\n"),
                "tokens_per_day is 0",
            ),
            (
                format!("[[keys]]\nname = \"a\"\nsha256 = \"{good}\"\nrpm = 3\n"),
                "unknown field",
            ),
            (
                format!(
                    "[[keys]]\nname = \"a\"\nsha256 = \"{good}\"\ntool_groups = [\"x\", \" \"]\n"
                ),
                "tool_groups has an empty name",
            ),
            (
                format!(
                    "[[keys]]\nname = \"a\"\nsha256 = \"{good}\"\noperator_fields = [\"retry\", \"prompt\"]\n"
                ),
                "operator_fields: \"prompt\" is not one",
            ),
        ] {
            let e = KeyRing::parse(&text).unwrap_err().to_string();
            assert!(e.contains(expect), "{e}");
            assert!(!e.contains(&good), "{e}");
        }
    }

    #[test]
    fn reload_takes_a_changed_file_and_keeps_the_keys_when_it_is_broken() {
        let dir = std::env::temp_dir().join(format!("sluice-keys-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keys.toml");
        let entry = |name: &str, key: &str| {
            format!(
                "[[keys]]\nname = \"{name}\"\nsha256 = \"{}\"\n",
                hash_hex(key)
            )
        };
        std::fs::write(&path, entry("a", "ka")).unwrap();
        let keys = Keys::load(&path).unwrap();
        assert!(keys.reload().is_none());
        std::fs::write(&path, entry("a", "ka") + &entry("b", "kb")).unwrap();
        assert!(matches!(keys.reload(), Some(Ok(2))));
        assert!(keys.ring().find("kb").is_some());
        std::fs::write(&path, "[[keys]]\nname = 3\n").unwrap();
        assert!(matches!(keys.reload(), Some(Err(_))));
        assert!(
            keys.reload().is_none(),
            "an unchanged broken file is reported once"
        );
        assert_eq!(keys.ring().len(), 2);
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(keys.reload(), Some(Err(_))));
        assert!(keys.reload().is_none(), "a missing file is reported once");
        assert_eq!(keys.ring().len(), 2);
        // Revoking: the key is gone from the file.
        std::fs::write(&path, entry("b", "kb")).unwrap();
        assert!(matches!(keys.reload(), Some(Ok(1))));
        assert!(keys.ring().find("ka").is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
