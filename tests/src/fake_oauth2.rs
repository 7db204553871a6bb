//! A small OAuth2 issuer over real HTTP, for Pulsar's OAuth2 client-credentials flow: OpenID
//! discovery (`/.well-known/openid-configuration`) and a token endpoint that exchanges a
//! client id and secret for an HS256 JWT whose subject is the client's Pulsar role, signed
//! with the broker's token secret key (so the broker's token provider accepts it), valid for
//! a chosen number of seconds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    Form, Json, Router,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
};
use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use hmac::{Hmac, Mac};
use serde_json::json;
use sha2::Sha256;

use crate::fake::Fake;

/// The fake issuer.
pub type FakeOAuth2 = Fake<OAuth2Seen>;

/// The issuer's clients and what it was asked.
#[derive(Default)]
pub struct OAuth2Seen {
    /// client id -> (secret, role)
    clients: HashMap<String, (String, String)>,
    key: Vec<u8>,
    lifetime: Duration,
    base: String,
    issued: usize,
    refused: usize,
}

/// Signs `claims` as an HS256 JWT with `key`.
pub fn hs256(key: &[u8], claims: &serde_json::Value) -> String {
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
    let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
    mac.update(format!("{header}.{payload}").as_bytes());
    let signature = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{header}.{payload}.{signature}")
}

impl Fake<OAuth2Seen> {
    /// An issuer signing with `key`, tokens valid for `lifetime`.
    pub async fn start_issuer(key: Vec<u8>, lifetime: Duration) -> Self {
        let fake = Self::serve(|seen| {
            Router::new()
                .route("/.well-known/openid-configuration", get(discovery))
                .route("/oauth/token", post(token))
                .with_state(seen)
        })
        .await;
        {
            let mut seen = fake.seen();
            seen.key = key;
            seen.lifetime = lifetime;
            seen.base = fake.base_url();
        }
        fake
    }

    /// Registers a client whose tokens carry `role` as their subject.
    pub fn client(&self, id: &str, secret: &str, role: &str) {
        self.seen()
            .clients
            .insert(id.into(), (secret.into(), role.into()));
    }

    /// Tokens issued so far.
    pub fn issued(&self) -> usize {
        self.seen().issued
    }

    /// Token requests refused so far.
    pub fn refused(&self) -> usize {
        self.seen().refused
    }
}

type Seen = State<Arc<std::sync::Mutex<OAuth2Seen>>>;

async fn discovery(State(seen): Seen) -> Json<serde_json::Value> {
    let base = seen.lock().unwrap().base.clone();
    Json(json!({"issuer": base, "token_endpoint": format!("{base}/oauth/token")}))
}

async fn token(State(seen): Seen, Form(form): Form<HashMap<String, String>>) -> Response {
    let mut seen = seen.lock().unwrap();
    let field = |k: &str| form.get(k).cloned().unwrap_or_default();
    let known = seen.clients.get(&field("client_id")).cloned();
    match known {
        Some((secret, role))
            if field("grant_type") == "client_credentials" && field("client_secret") == secret =>
        {
            seen.issued += 1;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let lifetime = seen.lifetime.as_secs();
            let jwt = hs256(&seen.key, &json!({"sub": role, "exp": now + lifetime}));
            Json(json!({"access_token": jwt, "token_type": "Bearer", "expires_in": lifetime}))
                .into_response()
        }
        _ => {
            seen.refused += 1;
            (
                StatusCode::UNAUTHORIZED,
                Json(json!({"error": "invalid_client", "error_description": "unknown client or wrong secret"})),
            )
                .into_response()
        }
    }
}
