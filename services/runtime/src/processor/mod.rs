//! The processor runtime: one consume loop that any service plugs a [`Handler`] into.
//!
//! For each request: decode it, run the handler with up to `concurrency` requests at once,
//! publish the records it streams in order with the request's `id`, and ack the request
//! only once its terminal record is stored. What this loop guarantees, whatever the handler
//! does:
//! - a record that cannot be decoded gets an error record when it carries an id, and is
//!   acked and counted either way: a bad record never cycles through redelivery;
//! - exactly one terminal record per attempt, and nothing after it: a handler that returns
//!   an error, panics, or forgets to finish gets an error record written for it;
//! - a record too large for the bus ends the stream with a `message-too-large` error;
//! - when publishing fails, the request is handed back to the broker (nack) for another
//!   attempt, which starts its stream again under a new attempt id; and the processor takes
//!   no new request (`/readyz` says why) until the broker stores a probe again, so a broker
//!   that cannot write (a bookie turned read-only by a full disk) costs no provider calls;
//! - a request its client cancels (see [`crate::cancel`]) stops at once: the handler, and
//!   with it the provider call, is dropped, and a `cancelled` error ends the stream;
//! - on SIGTERM/SIGINT it stops taking requests, lets in-flight ones finish within the grace
//!   period, and returns. What did not finish is handed back to the broker for another
//!   replica: its handler is dropped and no error record is published for it (the request is
//!   not failed, it is moved), so its stream restarts there under a new attempt id.
//!
//! It never logs payloads: they carry prompts.

mod config;
mod delivery;
mod drain;
mod handler;
mod run;
mod settle;
mod syncs;
#[cfg(test)]
mod tests;
mod usage;

pub use config::{DEFAULT_CONCURRENCY, ProcessorConfig};
pub(crate) use drain::LEDGER_FLUSH_BOUND;
pub use handler::{Handler, RequestContext};
pub use run::{RunError, run, run_until_signalled};
pub use syncs::SYNC_INTERVAL;

pub use crate::sink::{
    DEFAULT_MAX_RECORDS_PER_SEC, DEFAULT_PACE_INTERVAL, PaceWhen, Pacing, ResponseSink, SinkError,
};
