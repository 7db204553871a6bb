//! Every provider against its wire-exact fake over real HTTP: the contract every provider
//! keeps ([`contract`], one case per behaviour, run for each provider, with the cases a
//! provider opts out of named there and why), then each provider's own wire details, and
//! each provider's processor through the broker (those need `PULSAR_URL`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod contract;

mod anthropic;
mod bedrock;
mod cohere;
mod gemini;
mod ollama;
mod openai;
