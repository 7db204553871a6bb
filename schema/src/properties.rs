//! Pulsar message property keys sluice reads and writes.
//!
//! Properties travel beside the JSON payload, so adding one never changes what a
//! TrustGraph reader sees in the record itself.

/// The caller's correlation id. A caller puts a unique id here; a service copies it onto
/// every response record of that request (TrustGraph's convention).
pub const ID: &str = "id";

/// On a request a processor makes on behalf of the one it handles (the prompt's call to
/// text-completion, the agent's to prompt and text-completion): the id of the request that
/// started it all, the first hop's [`ID`], so that every processor's request log names one
/// `request_id` for it. A request without it is its own origin. Read for logs only: at most
/// [`MAX_ORIGIN_BYTES`] of printable ASCII is believed, anything else is ignored.
pub const ORIGIN: &str = "sluice-origin";

/// The longest [`ORIGIN`] believed.
pub const MAX_ORIGIN_BYTES: usize = 128;

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

/// On a response record: its index within its attempt, from 0 (a decimal string). Records
/// of one attempt are published in order by one producer, so a client that receives index
/// `n + 2` after `n` knows record `n + 1` was lost in transit: on a non-persistent topic the
/// broker drops what arrives for a consumer with no flow permits left. A client ends such a
/// request at once with a `records-lost` error instead of waiting out a timeout. A new
/// attempt (a restart or an agent's next step) starts again at 0.
pub const SEQ: &str = "sluice-seq";

/// On a sync message (value: the processor's name; its `id` property is this key's name too,
/// which no request uses, so a TrustGraph client finds nobody waiting for it and skips it).
/// A processor whose response topic is non-persistent publishes one every second, through
/// the producer that publishes its records. A client that sees the producer's sequence jump
/// at the sync learns that records were dropped even when the dropped one was the last the
/// processor sent. The payload is `{}`; what the sync says is in [`SYNC_STATE`].
pub const SYNC: &str = "sluice-sync";

/// On a sync message: JSON naming the processor instance, whether it takes requests now, and
/// for each stream it answers or finished lately the request id, the attempt and how many
/// records it had published before the sync (`sluice_runtime::sync::SyncState`). A client
/// compares that with what it received: a stream that lost every record, a request no
/// processor took, and a stream whose processor went away end at once instead of at a
/// timeout. Kept out of the payload so a TrustGraph reader of the topic sees `{}` as before.
pub const SYNC_STATE: &str = "sluice-sync-state";

/// On a request: the name of the API key the gateway admitted it under (never the key
/// itself). The text-completion processor writes it into the request's usage record (see
/// [`crate::usage::UsageRecord`]); the prompt and agent processors carry it on to the
/// text-completion requests they make. A request without it (published straight onto the
/// bus) is billed to no key. Producers that may publish requests can set any name here, so
/// a text-completion processor given a billing secret bills a key only with its
/// [`KEY_SEAL`].
pub const KEY: &str = "sluice-key";

/// On a request that carries [`KEY`]: the gateway's seal of the key's name and the id of the
/// request it admitted (`<tag>:<request id>`), made with the billing secret it shares with
/// text-completion (`sluice_runtime::billing`). The prompt and agent processors forward it
/// unchanged with the key on the requests they make for that request.
pub const KEY_SEAL: &str = "sluice-key-seal";
