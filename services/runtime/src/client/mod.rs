//! The request/response client: what the gateway, the CLI and processors that call other
//! processors use to make a request over the bus and read its stream of records.
//!
//! One client instance owns one Exclusive subscription on the response topic (its name is
//! unique to the instance) and one router task that hands each record to the caller waiting
//! for its `id`. A caller gets a [`ResponseStream`]: records in order, then nothing after the
//! first terminal record (later duplicates, e.g. from a redelivered request, are counted and
//! dropped). A stream ends with an error after an inactivity timeout or a total timeout.
//! When a record arrives under a new attempt id the stream yields [`Received::Restarted`]
//! first, so the caller can discard what the abandoned attempt sent; records of an abandoned
//! attempt that still arrive are skipped.
//!
//! Loss is seen, not waited out. On a non-persistent response topic (TrustGraph's mapping)
//! the broker drops records this client has no flow permits for. Two signals end such a
//! request at once with a [`ClientError::RecordsLost`] or [`ClientError::StreamLost`]:
//! - every record carries its index within its attempt ([`properties::SEQ`]); an index that
//!   skips means a record in between was lost;
//! - every Pulsar message carries its producer's name and sequence id; a jump in a producer's
//!   sequence means the broker dropped something of that producer's. Streams whose last record
//!   came from that producer may have lost their next one, the terminal record included, so
//!   such a stream that then stays quiet for `loss_grace` is ended as lost.
//!
//! A third signal sees what leaves nothing later to compare: the processors' syncs (see
//! [`crate::sync`]) list the streams they answer with the records published so far, so a
//! stream whose every record was dropped, a request no processor took, and a stream whose
//! processor went away each end with [`ClientError::LostInTransit`].
//!
//! A fourth sees the consumer itself go deaf. After topic moves under load, the broker has
//! been seen to drop a response consumer from its non-persistent topic for good while still
//! answering the consumer's stats requests, so the subscription's own checks (see
//! `bus::pulsar`) found nothing wrong and every stream waited out its inactivity timeout.
//! Processors sync every second, so a router that has heard syncs and then hears nothing at
//! all for [`DEAF_AFTER_TICKS`] seconds while streams are open asks its subscription to
//! re-subscribe ([`crate::bus::Subscription::renew`]); the syncs that arrive then end the
//! streams whose records were lost meanwhile.
//!
//! On a durable (`persistent://`) response topic the broker drops nothing, so an index that
//! skips means the processor failed to store a record of that attempt (a broker restart
//! mid-stream). That processor hands the request back to the broker, and another attempt
//! follows: the rest of the broken attempt is skipped and the stream waits for the next one
//! (which starts with [`Received::Restarted`]), bounded by the inactivity timeout, instead of
//! ending a request that will still be answered.
//!
//! It never logs payloads: they carry prompts and answers.
//!
//! [`properties::SEQ`]: sluice_schema::properties::SEQ

mod cancel;
mod config;
mod deaf;
mod error;
mod receipt;
mod request;
mod route;
mod stream;
mod syncs;
#[cfg(test)]
pub(crate) mod tests;

pub use config::{ClientConfig, DEFAULT_LOSS_GRACE, RequestOptions};
pub use deaf::DEAF_AFTER_TICKS;
pub use error::ClientError;
pub use request::RequestClient;
pub use stream::{Received, ResponseStream};
