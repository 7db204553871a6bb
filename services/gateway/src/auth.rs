//! Bearer-token authentication: the gateway's one token, from the environment or a file (see
//! `sluice_runtime::secret`) and compared in constant time, and the API keys of a keys file
//! (see [`crate::keys`]), each with its permissions and limits.

use std::sync::Arc;

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

impl Caller {
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
