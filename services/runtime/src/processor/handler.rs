//! What a service plugs into the consume loop: its [`Handler`], and what it is told of the
//! request it handles ([`RequestContext`]).

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use sluice_schema::{Error, ResponseRecord};

use super::ResponseSink;
use crate::{client::RequestOptions, ledger::UsageMeter};

/// What a handler knows about the request it is handling.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// The caller's correlation id.
    pub id: String,
    /// The id of the request this one is made for, through every hop (its
    /// [`properties::ORIGIN`], else [`RequestContext::id`]): what request logs name as
    /// `request_id`, and what a handler passes on to the requests it makes.
    ///
    /// [`properties::ORIGIN`]: sluice_schema::properties::ORIGIN
    pub origin: String,
    /// This attempt's id, on every record published for it.
    pub attempt: String,
    /// Earlier deliveries of this request seen by this process (see
    /// [`Delivery::redelivery_count`]).
    ///
    /// [`Delivery::redelivery_count`]: crate::bus::Delivery::redelivery_count
    pub redelivery_count: u32,
    /// The caller's W3C `traceparent`, if any.
    pub traceparent: Option<String>,
    /// The API key's name the request is billed to ([`properties::KEY`]); a handler that
    /// makes requests of its own passes it on, with [`RequestContext::key_seal`].
    ///
    /// [`properties::KEY`]: sluice_schema::properties::KEY
    pub key: Option<String>,
    /// The gateway's seal of [`RequestContext::key`] ([`properties::KEY_SEAL`]), as received:
    /// forwarded unchanged with the key (see [`crate::billing`]).
    ///
    /// [`properties::KEY_SEAL`]: sluice_schema::properties::KEY_SEAL
    pub key_seal: Option<String>,
    /// Where the handler reports what its provider calls used, for the usage ledger.
    pub usage: UsageMeter,
}

impl RequestContext {
    /// The options of a request a handler makes on this one's behalf: its trace context, its
    /// origin (one `request_id` in every hop's request log), and the API key it is billed to
    /// with the gateway's seal of it.
    pub fn on_behalf(&self) -> RequestOptions {
        RequestOptions {
            traceparent: self.traceparent.clone(),
            origin: Some(self.origin.clone()),
            key: self.key.clone(),
            key_seal: self.key_seal.clone(),
            ..RequestOptions::default()
        }
    }
}

/// A service's business: turn one request into a stream of response records.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// The request record.
    type Request: DeserializeOwned + Send + 'static;
    /// The response record.
    type Response: ResponseRecord;

    /// Handles one request, sending its records through `sink` in order. The last record
    /// sent must be terminal; returning `Err` instead makes the runtime send the error as
    /// the terminal record.
    async fn handle(
        &self,
        request: Self::Request,
        ctx: RequestContext,
        sink: &mut ResponseSink<Self::Response>,
    ) -> Result<(), Error>;
}
