use std::time::Duration;

use sluice_schema::{Error, ErrorKind};

use super::*;
use crate::bus::BusError;

/// A service that calls another reports the client's failure with the kind it stands
/// for, and its own kind where the other service could not be reached.
#[test]
fn client_errors_know_the_kind_they_are_reported_as() {
    let second = Duration::from_secs(1);
    for (e, kind) in [
        (ClientError::InactivityTimeout(second), ErrorKind::Timeout),
        (ClientError::TotalTimeout(second), ErrorKind::Timeout),
        (ClientError::StreamLost(second), ErrorKind::RecordsLost),
        (
            ClientError::RecordsLost {
                expected: 1,
                received: 2,
            },
            ErrorKind::RecordsLost,
        ),
        (
            ClientError::LostInTransit("x".into()),
            ErrorKind::RecordsLost,
        ),
        (ClientError::Encode("x".into()), ErrorKind::InvalidRequest),
        (
            ClientError::DuplicateId("x".into()),
            ErrorKind::InvalidRequest,
        ),
        (ClientError::Closed, ErrorKind::Agent),
        (ClientError::Decode("x".into()), ErrorKind::Agent),
        (ClientError::NotStored("x".into()), ErrorKind::Agent),
        (
            ClientError::Bus(BusError::Unavailable("x".into())),
            ErrorKind::Agent,
        ),
    ] {
        assert_eq!(e.kind(ErrorKind::Agent), kind, "{e}");
        let record = e.to_error("text-completion", ErrorKind::Agent);
        assert_eq!(record.kind, kind, "{e}");
        assert!(
            record.message.starts_with("text-completion")
                && record.message.ends_with(&e.to_string()),
            "{}",
            record.message
        );
        // In its own words: the same kind, the client's message as it is.
        assert_eq!(
            e.as_error(ErrorKind::Agent),
            Error::new(kind, e.to_string()),
            "{e}"
        );
    }
}
