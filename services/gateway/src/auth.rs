//! Bearer-token authentication. The token comes from the environment or a file (see
//! `sluice_runtime::secret`) and is compared in constant time.

use axum::http::{HeaderMap, header};
use sluice_runtime::secret::Secret;
use subtle::ConstantTimeEq;

/// The gateway's credential check.
#[derive(Clone, Debug, Default)]
pub struct Auth {
    token: Option<Secret>,
}

impl Auth {
    /// Requires `token`; `None` accepts every caller.
    pub fn new(token: Option<Secret>) -> Self {
        Self { token }
    }

    /// Whether a token is required.
    pub fn required(&self) -> bool {
        self.token.is_some()
    }

    /// Whether `given` is the token (always true when none is required).
    pub fn accepts(&self, given: Option<&str>) -> bool {
        match &self.token {
            None => true,
            // `ct_eq` on slices of different lengths returns false without comparing, which
            // reveals only the length.
            Some(token) => {
                given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(token.expose().as_bytes())))
            }
        }
    }

    /// Whether the request's `Authorization: Bearer` header carries the token.
    pub fn accepts_headers(&self, headers: &HeaderMap) -> bool {
        if !self.required() {
            return true;
        }
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, rest) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            });
        self.accepts(given)
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
