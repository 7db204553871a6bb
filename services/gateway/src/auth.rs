//! Bearer-token authentication: the gateway's one token, from the environment or a file (see
//! `sluice_runtime::secret`) and compared in constant time, and the API keys of a keys file
//! (see [`crate::keys`]), each with its permissions and limits.

use std::{collections::BTreeSet, sync::Arc};

use axum::http::{HeaderMap, header};
use sluice_runtime::secret::Secret;
use subtle::ConstantTimeEq;

use crate::keys::{Key, Keys};

/// The gateway's credential check.
#[derive(Clone, Debug, Default)]
pub struct Auth {
    token: Option<Secret>,
    keys: Option<Arc<Keys>>,
}

/// Who is calling.
#[derive(Debug, Clone)]
pub enum Caller {
    /// Nothing is required: every caller is accepted.
    Anyone,
    /// The gateway's own token: no limits.
    Token,
    /// An API key of the keys file.
    Key(Arc<Key>),
}

/// What a caller may set of the request fields meant for the operator (retries, deadlines,
/// tool state and groups, an agent's earlier steps: docs/security.md#operator-only-fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing<'a> {
    /// The operator: every field as sent.
    Operator,
    /// A tenant: the operator's fields are dropped but for those its key is given, and only
    /// its tool groups may be named.
    Tenant {
        /// The API key's name, for a refusal; `None` for a caller without one.
        key: Option<&'a str>,
        /// The agent's tool groups it may use; `None`: the `default` group alone (what a
        /// request that names no group uses).
        tool_groups: Option<&'a BTreeSet<String>>,
        /// The operator's fields its key may set anyway (`operator_fields` in the keys
        /// file); `None`: none.
        operator_fields: Option<&'a BTreeSet<String>>,
    },
}

/// The tool group a request that names none uses (the agent's, as TrustGraph's).
pub const DEFAULT_TOOL_GROUP: &str = "default";

impl Standing<'_> {
    /// Whether tool group `group` may be named.
    pub fn may_use_group(&self, group: &str) -> bool {
        match self {
            Standing::Operator => true,
            Standing::Tenant {
                tool_groups: Some(groups),
                ..
            } => groups.contains(group),
            Standing::Tenant {
                tool_groups: None, ..
            } => group == DEFAULT_TOOL_GROUP,
        }
    }

    /// Whether `field`, one of the operator's ([`crate::kinds::OPERATOR_FIELDS`]), may be
    /// set.
    pub fn may_set(&self, field: &str) -> bool {
        match self {
            Standing::Operator => true,
            Standing::Tenant {
                operator_fields, ..
            } => operator_fields.is_some_and(|allowed| allowed.contains(field)),
        }
    }
}

impl Caller {
    /// What the caller may set of the operator's fields. The gateway's token is the
    /// operator's; an API key is a tenant's; a caller without credentials is the local user
    /// (the operator of a gateway on loopback: `anonymous_is_operator`) or, on a gateway
    /// opened beyond loopback without credentials, anyone: a tenant without a key.
    pub fn standing(&self, anonymous_is_operator: bool) -> Standing<'_> {
        match self {
            Caller::Token => Standing::Operator,
            Caller::Anyone if anonymous_is_operator => Standing::Operator,
            Caller::Anyone => Standing::Tenant {
                key: None,
                tool_groups: None,
                operator_fields: None,
            },
            Caller::Key(k) => Standing::Tenant {
                key: Some(&k.name),
                tool_groups: k.tool_groups(),
                operator_fields: Some(k.operator_fields()),
            },
        }
    }

    /// The API key, when the caller used one.
    pub fn key(&self) -> Option<&Arc<Key>> {
        match self {
            Caller::Key(k) => Some(k),
            Caller::Anyone | Caller::Token => None,
        }
    }

    /// Who the caller is, as what is given to one caller is sealed for (a resume token): an
    /// API key by its name, distinct from the gateway's token and from anyone.
    pub fn identity(&self) -> String {
        match self {
            Caller::Anyone => "anyone".to_owned(),
            Caller::Token => "token".to_owned(),
            Caller::Key(k) => format!("key:{}", k.name),
        }
    }
}

impl Auth {
    /// Requires `token`; `None` accepts every caller.
    pub fn new(token: Option<Secret>) -> Self {
        Self { token, keys: None }
    }

    /// Also accepts the API keys of `keys`.
    pub fn with_keys(mut self, keys: Arc<Keys>) -> Self {
        self.keys = Some(keys);
        self
    }

    /// The API keys, when a keys file was given.
    pub fn keys(&self) -> Option<&Arc<Keys>> {
        self.keys.as_ref()
    }

    /// Whether a token is required.
    pub fn required(&self) -> bool {
        self.token.is_some() || self.keys.is_some()
    }

    /// Who `given` is, if accepted.
    pub fn caller(&self, given: Option<&str>) -> Option<Caller> {
        if !self.required() {
            return Some(Caller::Anyone);
        }
        let given = given?;
        // `ct_eq` on slices of different lengths returns false without comparing, which
        // reveals only the length.
        if let Some(token) = &self.token
            && bool::from(given.as_bytes().ct_eq(token.expose().as_bytes()))
        {
            return Some(Caller::Token);
        }
        self.keys
            .as_ref()
            .and_then(|keys| keys.ring().find(given))
            .map(Caller::Key)
    }

    /// Whether `given` is accepted (always true when nothing is required).
    pub fn accepts(&self, given: Option<&str>) -> bool {
        self.caller(given).is_some()
    }

    /// Who the request's `Authorization: Bearer` header says is calling, if accepted.
    pub fn caller_of(&self, headers: &HeaderMap) -> Option<Caller> {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, rest) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            });
        self.caller(given)
    }

    /// Who the request's `x-api-key` header (where Anthropic's SDKs send their key) or,
    /// without one, its `Authorization: Bearer` header says is calling, if accepted.
    pub fn caller_of_api_key(&self, headers: &HeaderMap) -> Option<Caller> {
        match headers.get("x-api-key") {
            Some(v) => self.caller(v.to_str().ok().map(str::trim)),
            None => self.caller_of(headers),
        }
    }

    /// Whether the request's `Authorization: Bearer` header is accepted.
    pub fn accepts_headers(&self, headers: &HeaderMap) -> bool {
        self.caller_of(headers).is_some()
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn the_token_is_the_operator_a_key_a_tenant_and_anyone_depends_on_the_listener() {
        let ring = crate::keys::KeyRing::parse(&format!(
            "[[keys]]\nname = \"a\"\nsha256 = \"{}\"\n[[keys]]\nname = \"b\"\nsha256 = \"{}\"\ntool_groups = [\"research\"]\noperator_fields = [\"retry\"]\n",
            crate::keys::hash_hex("ka"),
            crate::keys::hash_hex("kb")
        ))
        .unwrap();
        assert_eq!(Caller::Token.standing(false), Standing::Operator);
        assert_eq!(Caller::Anyone.standing(true), Standing::Operator);
        let anyone = Caller::Anyone.standing(false);
        assert!(matches!(anyone, Standing::Tenant { key: None, .. }));
        let a = Caller::Key(ring.find("ka").unwrap());
        let b = Caller::Key(ring.find("kb").unwrap());
        // A key is a tenant however the gateway listens.
        for open in [true, false] {
            assert!(matches!(
                a.standing(open),
                Standing::Tenant { key: Some("a"), .. }
            ));
        }
        // Without `tool_groups`, the default group alone; with it, those named.
        for (standing, default, research) in [
            (Standing::Operator, true, true),
            (anyone, true, false),
            (a.standing(true), true, false),
            (b.standing(true), false, true),
        ] {
            assert_eq!(standing.may_use_group("default"), default, "{standing:?}");
            assert_eq!(standing.may_use_group("research"), research, "{standing:?}");
            assert_eq!(
                standing.may_use_group("admin"),
                standing == Standing::Operator
            );
        }
        // Operator-only fields: the operator's, and those a key's entry gives it.
        for (standing, retry, history) in [
            (Standing::Operator, true, true),
            (anyone, false, false),
            (a.standing(true), false, false),
            (b.standing(true), true, false),
        ] {
            assert_eq!(standing.may_set("retry"), retry, "{standing:?}");
            assert_eq!(standing.may_set("history"), history, "{standing:?}");
        }
    }

    #[test]
    fn only_the_exact_token_passes() {
        let auth = Auth::new(Some(Secret::new("s3cret")));
        assert!(auth.accepts(Some("s3cret")));
        for bad in [
            None,
            Some(""),
            Some("s3cre"),
            Some("s3cret "),
            Some("S3CRET"),
        ] {
            assert!(!auth.accepts(bad), "{bad:?}");
        }
        let mut h = HeaderMap::new();
        assert!(!auth.accepts_headers(&h));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer s3cret"),
        );
        assert!(auth.accepts_headers(&h));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic s3cret"),
        );
        assert!(!auth.accepts_headers(&h));
        assert!(Auth::default().accepts(None));
    }
}
