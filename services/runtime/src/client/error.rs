//! Why a request failed on the client side, and the error record a caller reports it as.

use std::time::Duration;

use sluice_schema::{Error, ErrorKind};

use crate::bus::BusError;

/// Why a request failed on the client side.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Publishing the request or subscribing failed.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// No record arrived within the inactivity timeout.
    #[error("no response record for {0:?}")]
    InactivityTimeout(Duration),
    /// The stream did not end within the total timeout.
    #[error("the response did not complete within {0:?}")]
    TotalTimeout(Duration),
    /// A response record could not be decoded.
    #[error("a response record could not be decoded: {0}")]
    Decode(String),
    /// The request could not be encoded.
    #[error("the request could not be encoded: {0}")]
    Encode(String),
    /// The client was closed.
    #[error("the client is closed")]
    Closed,
    /// The broker did not store the request (it cannot write, or refused it): it will not be
    /// answered, and sending it again later may succeed.
    #[error("the broker did not store the request: {0}")]
    NotStored(String),
    /// Another request with the same id is in flight on this client.
    #[error("a request with id {0:?} is already in flight")]
    DuplicateId(String),
    /// A record of the stream never arrived: the next one carried a later index.
    #[error(
        "response records were lost in transit: record {expected} of the stream never arrived, record {received} did (the broker drops records on a non-persistent topic when a consumer has no flow permits left)"
    )]
    RecordsLost {
        /// The index that was due.
        expected: u64,
        /// The index that arrived.
        received: u64,
    },
    /// The broker dropped records of the producer this stream was reading from, and the stream
    /// then stayed quiet: its next records, the terminal one included, were lost.
    #[error(
        "the response stopped after the broker dropped records on its topic and nothing more arrived for {0:?}: the rest of the stream was lost in transit (non-persistent topic)"
    )]
    StreamLost(Duration),
    /// A processor's sync showed the stream cannot end any more: its records, or the request
    /// itself, were dropped in transit, or the processor answering it went away (see
    /// [`crate::sync`]).
    #[error(
        "{0} (non-persistent topic: the broker drops what it cannot deliver at once and keeps nothing)"
    )]
    LostInTransit(String),
}

impl ClientError {
    /// True when a time limit ran out ([`ClientError::InactivityTimeout`],
    /// [`ClientError::TotalTimeout`]).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            ClientError::InactivityTimeout(_) | ClientError::TotalTimeout(_)
        )
    }

    /// The error kind a caller reports this failure as: `timeout` for a time limit,
    /// `records-lost` for a loss, `invalid-request` for a request that could not be sent as
    /// it was (not encodable, or its id already in flight), and `unavailable` (the caller's
    /// own kind: `llm-error` for the prompt service, `agent-error` for the agent,
    /// `gateway-error` for the gateway) when the called service could not be reached or
    /// answered in a way that could not be read.
    pub fn kind(&self, unavailable: ErrorKind) -> ErrorKind {
        match self {
            e if e.is_timeout() => ErrorKind::Timeout,
            e if e.is_loss() => ErrorKind::RecordsLost,
            ClientError::Encode(_) | ClientError::DuplicateId(_) => ErrorKind::InvalidRequest,
            _ => unavailable,
        }
    }

    /// This failure as an error record in its own words, under [`ClientError::kind`]: for a
    /// caller that names the service itself (an agent's tool observation).
    pub fn as_error(&self, unavailable: ErrorKind) -> Error {
        Error::new(self.kind(unavailable), self.to_string())
    }

    /// The error record a service that called `service` answers its own client with (see
    /// [`ClientError::kind`]); the message names `service` and what happened.
    pub fn to_error(&self, service: &str, unavailable: ErrorKind) -> Error {
        let kind = self.kind(unavailable.clone());
        let message = match &kind {
            ErrorKind::Timeout => format!("{service} did not answer in time: {self}"),
            ErrorKind::RecordsLost => format!("{service}'s answer was lost in transit: {self}"),
            ErrorKind::InvalidRequest => format!("{service} could not be asked: {self}"),
            _ => format!("{service} could not be reached: {self}"),
        };
        Error::new(kind, message)
    }

    /// True for the losses a non-persistent topic causes ([`ClientError::RecordsLost`],
    /// [`ClientError::StreamLost`], [`ClientError::LostInTransit`]).
    pub fn is_loss(&self) -> bool {
        matches!(
            self,
            ClientError::RecordsLost { .. }
                | ClientError::StreamLost(_)
                | ClientError::LostInTransit(_)
        )
    }
}

#[cfg(test)]
mod tests;
