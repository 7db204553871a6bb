//! sluice-text-completion: the text-completion processor.
//!
//! - [`config`]: a provider described (a tagged enum, one variant per provider with only its
//!   settings; which key variable is read for which base URL) and built, and the processor's
//!   providers, fallback list and retry policy wired into the handler ([`config::ServiceConfig`]);
//! - [`fallback`]: an ordered list of providers behind one, moving a call before its first
//!   token, with hedging and a circuit breaker per provider;
//! - [`flows`]: the flows TrustGraph's config service assigns;
//! - [`provider`]: the [`provider::Provider`] trait (`supports_streaming`, `generate`,
//!   `generate_stream`) and what a call yields;
//! - [`providers`]: one module per provider family, sharing status classification and time limits;
//! - [`retry`]: the retry policy and the servers' retry hints;
//! - [`handler`]: the processor handler, turning provider chunks into records;
//! - [`metrics`]: its metrics (`sluice_llm_*`).
//!
//! Nothing here logs a prompt, an answer or a key.

pub mod config;
pub mod fallback;
pub mod flows;
pub mod handler;
pub mod metrics;
pub mod provider;
pub mod providers;
pub mod retry;
pub mod structured;
#[cfg(test)]
mod testing;
