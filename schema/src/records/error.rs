//! The error a record carries, as TrustGraph writes it, and its kinds.

use serde::{Deserialize, Serialize};

use crate::de::null_default;

/// What went wrong, as TrustGraph carries it: `{"type": "...", "message": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Error {
    /// The error's type, written as its wire string (e.g. `llm-error`).
    #[serde(rename = "type", default, deserialize_with = "null_default")]
    pub kind: ErrorKind,
    /// A message for the operator or the user. Never contains secrets or prompt text.
    #[serde(default, deserialize_with = "null_default")]
    pub message: String,
}

impl Error {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {}

/// An error's type (docs/protocol.md#error-kinds).
///
/// The wire carries a free string, so a type written by another implementation (or a later
/// sluice) reads as [`ErrorKind::Other`] and is written back unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The LLM provider failed or refused (TrustGraph: `llm-error`).
    Llm,
    /// The agent could not complete the dialog (TrustGraph: `agent-error`).
    Agent,
    /// A required configuration is missing (TrustGraph: `no-configuration`).
    NoConfiguration,
    /// The gateway could not serve the request (TrustGraph: `gateway-error`).
    Gateway,
    /// The provider rate-limited the request and retries ran out (sluice's addition).
    TooManyRequests,
    /// The request record could not be decoded or is invalid (sluice's addition).
    InvalidRequest,
    /// A record exceeded the bus's message size limit (sluice's addition).
    MessageTooLarge,
    /// A time limit was reached (sluice's addition).
    Timeout,
    /// A bug or an unexpected condition inside sluice (sluice's addition).
    Internal,
    /// The client went away or asked to stop before the answer was complete, or the processor
    /// shut down before it was and could not hand the request back (sluice's addition).
    Cancelled,
    /// Records of the answer were lost in transit: the broker dropped them on a non-persistent
    /// topic (TrustGraph's mapping). Sending the request again may succeed (sluice's addition).
    RecordsLost,
    /// A type sluice does not know, kept as it was read so that it survives a round trip
    /// (empty when the record had none).
    Other(String),
}

impl ErrorKind {
    /// Every kind sluice writes, for tables and tests.
    pub const ALL: [ErrorKind; 11] = [
        ErrorKind::Llm,
        ErrorKind::Agent,
        ErrorKind::NoConfiguration,
        ErrorKind::Gateway,
        ErrorKind::TooManyRequests,
        ErrorKind::InvalidRequest,
        ErrorKind::MessageTooLarge,
        ErrorKind::Timeout,
        ErrorKind::Internal,
        ErrorKind::Cancelled,
        ErrorKind::RecordsLost,
    ];

    /// The string written on the wire.
    pub fn as_str(&self) -> &str {
        match self {
            ErrorKind::Llm => "llm-error",
            ErrorKind::Agent => "agent-error",
            ErrorKind::NoConfiguration => "no-configuration",
            ErrorKind::Gateway => "gateway-error",
            ErrorKind::TooManyRequests => "too-many-requests",
            ErrorKind::InvalidRequest => "invalid-request",
            ErrorKind::MessageTooLarge => "message-too-large",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Internal => "internal-error",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::RecordsLost => "records-lost",
            ErrorKind::Other(s) => s,
        }
    }

    /// The kind a wire string names: a known one, else [`ErrorKind::Other`].
    pub fn from_wire(s: &str) -> Self {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .unwrap_or_else(|| ErrorKind::Other(s.to_owned()))
    }
}

/// A record without a type reads as an empty [`ErrorKind::Other`], written back as it was.
impl Default for ErrorKind {
    fn default() -> Self {
        ErrorKind::Other(String::new())
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(Self::from_wire(&s))
    }
}

impl From<&str> for ErrorKind {
    fn from(s: &str) -> Self {
        Self::from_wire(s)
    }
}

/// Compares with a wire string, so a test or a log filter can say `kind == "timeout"`.
impl PartialEq<str> for ErrorKind {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for ErrorKind {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}
