//! sluice-runtime: everything a sluice processor needs that is not its business.
//!
//! - [`bus`]: the `Bus` trait with Pulsar and in-process implementations;
//! - [`processor`]: the consume loop a service plugs its handler into;
//! - [`sink`]: the response sink, which publishes a request's records and paces them;
//! - [`client`]: the request/response client for calling a service over the bus;
//! - [`reader`]: reading a response stream under a restart policy, failures as error records;
//! - [`flows`]: flows assigned by TrustGraph's config service (`--config-service`);
//! - [`cancel`]: client cancellation over the bus;
//! - [`ledger`]: the usage ledger, one record per attempt that called a provider;
//! - [`ndjson`]: the incremental NDJSON line splitter of the structured contracts;
//! - [`telemetry`]: metrics, `/metrics` `/healthz` `/readyz`, tracing, shutdown signals;
//! - [`secret`]: secrets from the environment or files, never printed;
//! - [`seal`]: HMAC tags that let processes sharing a secret trust what another wrote;
//! - [`billing`]: the gateway's seal on the API key a request is billed to.
//!
//! Nothing in this crate logs a payload: payloads carry prompts and answers.

pub mod backoff;
pub mod billing;
pub mod bus;
pub mod cancel;
pub mod client;
pub mod flows;
pub mod json_schema;
pub mod ledger;
pub mod ndjson;
pub mod processor;
pub mod reader;
pub mod seal;
pub mod secret;
pub mod sink;
mod store;
pub mod sync;
pub mod telemetry;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod trace;

/// Locks a std mutex, recovering the data if a panicking thread poisoned it. Every
/// critical section in this crate is a few map or vector operations that leave the data
/// consistent, and none is held across an await, so a std Mutex is the right tool. Public
/// for the other crates' mutexes of the same kind (a fallback list's circuit breakers).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Eight hex digits of a fresh UUID: names unique within a process and its broker
/// (consumer and subscription names).
pub(crate) fn short_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

/// Installs rustls' ring crypto provider for HTTPS clients (reqwest is built without a
/// provider of its own so that one TLS stack serves the whole binary). Idempotent.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
