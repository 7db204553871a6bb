//! Pulsar message property keys sluice reads and writes.
//!
//! Properties travel beside the JSON payload, so adding one never changes what a
//! TrustGraph reader sees in the record itself.

/// The caller's correlation id. A caller puts a unique id here; a service copies it onto
/// every response record of that request (TrustGraph's convention).
pub const ID: &str = "id";

/// W3C trace context (`traceparent`), carried from the gateway through every processor.
pub const TRACEPARENT: &str = "traceparent";

/// W3C trace state, carried beside [`TRACEPARENT`] when present.
pub const TRACESTATE: &str = "tracestate";

/// Identifies one attempt at handling a request. A request redelivered after a crash is
/// handled again under a new attempt id, so a client that sees the id change on a stream
/// knows the stream restarted and can drop what it received from the earlier attempt.
pub const ATTEMPT: &str = "sluice-attempt";

/// On a continuation request (an agent re-publishing its request for the next step) and on
/// the records of the attempt that handles it: the attempt id it continues. A client seeing a
/// new attempt that continues its current one reads on instead of restarting the stream.
pub const CONTINUES: &str = "sluice-continues";

/// On a request: the client instance waiting for its answer (the name of that instance's
/// response subscription). A service copies it onto every response record, so clients that
/// share a response topic (gateway replicas, prompt and agent processors) skip each other's
/// answers without counting them, and only their own late records count as unroutable.
/// Records without it (from a TrustGraph service) are routed by [`ID`] alone, as before.
pub const REPLY_TO: &str = "sluice-reply-to";
