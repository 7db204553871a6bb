//! How a processor consumes and answers: its topics, concurrency, drain grace, cancel topic,
//! flow, pacing, ledger and billing key.

use std::sync::Arc;

use tokio::time::Duration;

use super::Pacing;
use crate::{ledger::Ledger, seal::SealKey};

/// Default number of requests handled at once: LLM calls spend their time waiting on
/// the provider, so a processor keeps many in flight.
pub const DEFAULT_CONCURRENCY: usize = 256;

/// How a processor consumes and answers.
#[derive(Debug, Clone)]
pub struct ProcessorConfig {
    /// The processor's name, used in metrics and logs (e.g. `text-completion`).
    pub name: String,
    /// The Pulsar topic URL requests arrive on.
    pub request_topic: String,
    /// The Pulsar topic URL responses are published to.
    pub response_topic: String,
    /// The Shared subscription's name; replicas with the same name share the load.
    pub subscription: String,
    /// Requests handled at once.
    pub concurrency: usize,
    /// How long in-flight requests may run after a shutdown signal.
    pub drain_grace: Duration,
    /// The Pulsar topic URL clients publish cancels on (see [`crate::cancel`]); `None` turns
    /// client cancellation off.
    pub cancel_topic: Option<String>,
    /// The flow this consumer serves (`workspace/flow`), when it is one of several a process
    /// serves (see [`crate::flows`]). Such a consumer shares `/readyz` with the others: it
    /// names itself there, takes its entry away when it stops, and leaves draining the whole
    /// process to the process.
    pub flow: Option<String>,
    /// How the response records are paced (see [`crate::sink`]): by default only on a
    /// non-persistent response topic.
    pub pacing: Pacing,
    /// Where a usage record of every attempt that called a provider goes (see
    /// [`crate::ledger`]); `None` writes none. Only the processor that calls providers
    /// (text-completion) keeps one: the prompt and agent processors' usage is that of the
    /// text-completion requests they make.
    pub ledger: Option<Arc<Ledger>>,
    /// The billing secret's key (see [`crate::billing`]): when set, a request that names an
    /// API key ([`properties::KEY`]) without the gateway's seal of it is refused with a
    /// `no-configuration` error before its handler runs, so nothing is billed to a key on
    /// the publisher's word. Set on the processor that bills (text-completion).
    ///
    /// [`properties::KEY`]: sluice_schema::properties::KEY
    pub billing: Option<SealKey>,
}

impl ProcessorConfig {
    /// A config with the default concurrency (256) and drain grace (30 s).
    pub fn new(
        name: impl Into<String>,
        request_topic: impl Into<String>,
        response_topic: impl Into<String>,
    ) -> Self {
        let name = name.into();
        Self {
            subscription: name.clone(),
            name,
            request_topic: request_topic.into(),
            response_topic: response_topic.into(),
            concurrency: DEFAULT_CONCURRENCY,
            drain_grace: Duration::from_secs(30),
            cancel_topic: None,
            flow: None,
            pacing: Pacing::default(),
            ledger: None,
            billing: None,
        }
    }
}
