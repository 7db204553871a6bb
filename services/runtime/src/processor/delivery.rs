//! One request, from its delivery to its settlement: the request's identity, span and
//! records' properties, the billing check, decoding, running the handler (cancels, panics,
//! the drain grace), then the records flushed, the usage written and the request settled.

use std::{collections::BTreeMap, panic::AssertUnwindSafe, sync::Arc};

use futures::FutureExt;
use prometheus::IntCounter;
use sluice_schema::{Error, ErrorKind, ResponseRecord, properties, topics::Persistence};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info_span, warn};

use super::{
    Handler, ProcessorConfig, RequestContext, ResponseSink,
    settle::{requests_come_back, settle},
    usage::{Unwritten, write_usage},
};
use crate::{
    billing,
    bus::{Delivery, Publisher},
    cancel::{CancelRegistry, InFlight},
    ledger::UsageMeter,
    sink::{Merging, Pacer},
    store::StoreGuard,
    sync::StreamBook,
    telemetry::{Outcome, RuntimeMetrics, Telemetry},
    trace,
};

fn client_cancelled() -> Error {
    Error::new(ErrorKind::Cancelled, "the client cancelled the request")
}

/// What every request task of one processor shares.
pub(super) struct Shared {
    pub(super) publisher: Arc<dyn Publisher>,
    pub(super) telemetry: Telemetry,
    pub(super) config: Arc<ProcessorConfig>,
    pub(super) cancels: CancelRegistry,
    pub(super) store: StoreGuard,
    pub(super) book: Option<Arc<StreamBook>>,
    /// Set when the response records are paced.
    pub(super) pacer: Option<Arc<Pacer>>,
    /// Set when deltas are merged while the broker is behind: the count of merged deltas.
    pub(super) behind: Option<IntCounter>,
}

impl Shared {
    /// What the request tasks of the processor of `config` share, publishing through
    /// `publisher`.
    pub(super) fn new(
        publisher: Arc<dyn Publisher>,
        telemetry: &Telemetry,
        config: Arc<ProcessorConfig>,
        cancels: CancelRegistry,
        store: StoreGuard,
    ) -> Self {
        // Only a non-persistent response topic loses records in transit: there the processor
        // syncs (see crate::sync), from its own account of the streams it answers.
        let book = Persistence::of(&config.response_topic).is_lossy().then(|| {
            Arc::new(StreamBook::new(format!(
                "{}-{}",
                config.name,
                crate::short_id()
            )))
        });
        // One pacer per processor name in the process: the flows a process serves share its
        // rate bound.
        let merging = config.pacing.merging(&config.response_topic);
        let pacer = (merging == Merging::Paced)
            .then(|| telemetry.metrics.pacer(&config.name, config.pacing));
        let behind = (merging == Merging::WhileBehind)
            .then(|| telemetry.metrics.coalesced_counter(&config.name));
        Self {
            publisher,
            telemetry: telemetry.clone(),
            config,
            cancels,
            store,
            book,
            pacer,
            behind,
        }
    }
}

/// Handles one delivered request to its settlement (see the module documentation).
pub(super) async fn handle_delivery<H: Handler>(
    handler: &H,
    delivery: Delivery,
    shared: &Shared,
    abandon: CancellationToken,
) {
    let Shared {
        publisher,
        telemetry,
        config,
        cancels,
        store,
        book,
        pacer,
        behind,
    } = shared;
    let started = Instant::now();
    let metrics = &telemetry.metrics;
    let processor = config.name.as_str();
    let Some(id) = delivery.property(properties::ID).map(str::to_owned) else {
        return drop_without_id(delivery, metrics, processor);
    };
    let attempt = uuid::Uuid::new_v4().simple().to_string();
    let trace_span = request_span(processor, &delivery, &id, &attempt);
    let trace_id = trace_span.context().trace_id();
    let traceparent = Some(trace_span.traceparent());
    let props = record_properties(&delivery, &id, &attempt);
    if delivery.redelivery_count() > 0 {
        metrics.redelivered(processor);
    }
    let span = info_span!("request", processor, request_id = %id, attempt = %attempt);
    metrics.in_flight(processor, 1);
    let key = delivery.property(properties::KEY).map(str::to_owned);
    let key_seal = delivery.property(properties::KEY_SEAL).map(str::to_owned);
    // A processor that bills believes a key only with the gateway's seal of it.
    let unverified = match (&config.billing, &key) {
        (Some(secret), Some(name)) => billing::verify(secret, name, key_seal.as_deref()).err(),
        _ => None,
    };
    let mut sink = ResponseSink::<H::Response>::new(
        publisher.clone(),
        props,
        carried(key.as_ref(), key_seal.as_ref()),
        book.clone(),
        pacer.clone(),
        behind.clone(),
        metrics.records_counter(processor),
    );
    let in_flight = cancels.begin(&id);
    let meter = UsageMeter::default();
    // A task dropped before its usage record was written (its processor stopping while the
    // broker is stuck) still leaves the record in the ledger's backlog.
    let mut unwritten = config.ledger.clone().map(|ledger| Unwritten {
        ledger,
        id: id.clone(),
        attempt: attempt.clone(),
        trace_id: trace_id.clone(),
        key: key.clone(),
        flow: config.flow.clone(),
        service: config.name.clone(),
        started,
        redelivery_count: delivery.redelivery_count(),
        meter: meter.clone(),
    });
    let outcome = async {
        let Some(in_flight) = in_flight else {
            debug!("cancelled by its client before it was taken");
            let _ = sink.send(H::Response::from_error(client_cancelled())).await;
            return Outcome::Cancelled;
        };
        if let (Some(why), Some(name)) = (unverified, &key) {
            return refuse_unverified(&mut sink, name, why, metrics, processor).await;
        }
        // The message names the field and the type expected, never a value (see
        // sluice_schema::decode): the payload may carry a prompt or a secret.
        match sluice_schema::decode::<H::Request>(delivery.payload()) {
            Err(e) => refuse_malformed(&mut sink, e.to_string()).await,
            Ok(request) => {
                let ctx = RequestContext {
                    origin: origin(&delivery).unwrap_or_else(|| id.clone()),
                    id: id.clone(),
                    attempt: attempt.clone(),
                    redelivery_count: delivery.redelivery_count(),
                    traceparent,
                    key,
                    key_seal,
                    usage: meter.clone(),
                };
                run_handler(
                    handler, request, ctx, &mut sink, in_flight, &abandon, config,
                )
                .await
            }
        }
    }
    .instrument(span.clone())
    .await;
    let flushed = sink.flush().await;
    end_trace(trace_span, outcome, flushed.is_err());
    if let Err(e) = &flushed {
        // Blocked at once (before the usage record, and the nack below): the consume loop
        // must wait for the broker rather than call the provider for answers it cannot store.
        store.block(e);
    }
    if let Some(u) = unwritten.as_mut() {
        write_usage(u, outcome, flushed.is_ok(), &sink, &abandon, &span).await;
    }
    // Out of flight once its usage is written too: a caller that sees the gauge at 0 finds
    // every record in the ledger (or its backlog).
    metrics.in_flight(processor, -1);
    let _enter = span.enter();
    settle(delivery, &mut sink, flushed, outcome, started, shared).await;
}

/// A request without an id: nobody to answer. Counted, logged and acked so that it never
/// comes back.
fn drop_without_id(delivery: Delivery, metrics: &RuntimeMetrics, processor: &str) {
    warn!(
        processor,
        bytes = delivery.payload().len(),
        "request without an `id` property dropped"
    );
    metrics.request_finished(processor, Outcome::Malformed, 0.0);
    delivery.ack();
}

/// The request's span: a child of the caller's context, whose own context goes to whatever
/// the handler calls (see crate::trace).
fn request_span(processor: &str, delivery: &Delivery, id: &str, attempt: &str) -> trace::Span {
    let mut trace_span = trace::Span::start(
        trace::Kind::Consumer,
        format!("{processor} process"),
        delivery.property(properties::TRACEPARENT),
    );
    trace_span.set("messaging.system", "pulsar");
    trace_span.set("sluice.processor", processor.to_owned());
    trace_span.set("sluice.request_id", id.to_owned());
    trace_span.set("sluice.attempt", attempt.to_owned());
    trace_span
}

/// The properties every record of this attempt carries: the request's id, the attempt's,
/// and the request's trace context, continuation and reply-to as they came.
fn record_properties(delivery: &Delivery, id: &str, attempt: &str) -> BTreeMap<String, String> {
    let mut props = BTreeMap::from([
        (properties::ID.to_owned(), id.to_owned()),
        (properties::ATTEMPT.to_owned(), attempt.to_owned()),
    ]);
    for key in [
        properties::TRACEPARENT,
        properties::TRACESTATE,
        properties::CONTINUES,
        properties::REPLY_TO,
    ] {
        if let Some(v) = delivery.property(key) {
            props.insert(key.to_owned(), v.to_owned());
        }
    }
    props
}

/// What goes on to the agent's next step but not onto the records: the API key's name and
/// its seal.
fn carried(key: Option<&String>, key_seal: Option<&String>) -> BTreeMap<String, String> {
    [(properties::KEY, key), (properties::KEY_SEAL, key_seal)]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_owned(), v?.clone())))
        .collect()
}

/// Ends the request's span with its outcome; failed for an error, a malformed request, or
/// records the broker did not store (`unstored`).
fn end_trace(mut trace_span: trace::Span, outcome: Outcome, unstored: bool) {
    trace_span.set("sluice.outcome", outcome.as_str());
    if matches!(outcome, Outcome::Error | Outcome::Malformed) || unstored {
        trace_span.fail(outcome.as_str());
    }
    trace_span.end();
}

/// Answers a request that could not be decoded with an `invalid-request` error; `message`
/// names the field and the type expected, never a value.
async fn refuse_malformed<R: ResponseRecord>(
    sink: &mut ResponseSink<R>,
    message: String,
) -> Outcome {
    warn!(error = %message, "malformed request");
    let _ = sink
        .send(R::from_error(Error::new(
            ErrorKind::InvalidRequest,
            message,
        )))
        .await;
    Outcome::Malformed
}

/// Refuses a request that names the API key `name` without a valid billing seal (`why`),
/// before its handler runs: nothing is billed to a key on the publisher's word.
async fn refuse_unverified<R: ResponseRecord>(
    sink: &mut ResponseSink<R>,
    name: &str,
    why: billing::Unverified,
    metrics: &RuntimeMetrics,
    processor: &str,
) -> Outcome {
    // The name is the publisher's claim, so it is logged but never a metric label.
    warn!(key = %name, reason = why.as_str(),
          "a request names an API key without a valid billing seal; refused");
    metrics.unverified_key(processor, why);
    let _ = sink
        .send(R::from_error(Error::new(
            ErrorKind::NoConfiguration,
            format!(
                "the request names the API key {name:?} without the gateway's billing \
                 seal of it ({}): it is not billed to that key, nor answered. The \
                 gateway and text-completion need the same {}",
                why.as_str(),
                billing::SECRET_VAR
            ),
        )))
        .await;
    Outcome::Error
}

/// Runs the handler on a decoded request until it ends, its client cancels (`in_flight`), or
/// the drain grace runs out (`abandon`), and writes the terminal error it did not: a failure,
/// a panic, a handler that forgot to finish.
async fn run_handler<H: Handler>(
    handler: &H,
    request: H::Request,
    ctx: RequestContext,
    sink: &mut ResponseSink<H::Response>,
    in_flight: InFlight,
    abandon: &CancellationToken,
    config: &ProcessorConfig,
) -> Outcome {
    // Dropping the handler's future on a client cancel, or when the drain grace
    // runs out, drops its provider call (and closes that connection) wherever it
    // is waiting.
    let result = tokio::select! {
        r = AssertUnwindSafe(handler.handle(request, ctx, sink)).catch_unwind() => Some(r),
        () = in_flight.token().cancelled() => {
            debug!("cancelled by its client");
            if !sink.is_ended() {
                let _ = sink.send(H::Response::from_error(client_cancelled())).await;
            }
            return Outcome::Cancelled;
        }
        () = abandon.cancelled() => None,
    };
    let failure = match result {
        // The drain grace ran out after the answer was complete: it stands.
        None if sink.is_ended() => None,
        // Not failed but moved: handed back below, with no error record.
        None if requests_come_back(config) => return Outcome::Retried,
        // A nack would lose the request (non-persistent topic): answer it.
        None => Some(Error::new(
            ErrorKind::Cancelled,
            "the processor shut down before the answer was complete (its drain \
             grace ran out); send the request again",
        )),
        Some(Ok(Ok(()))) if sink.is_ended() => None,
        Some(Ok(Ok(()))) => Some(Error::new(
            ErrorKind::Internal,
            "the handler finished without a terminal record",
        )),
        Some(Ok(Err(e))) => Some(e),
        Some(Err(_)) => {
            // A panic must not become a redelivery loop: answer and ack.
            error!("handler panicked");
            Some(Error::new(
                ErrorKind::Internal,
                "the processor failed while handling this request",
            ))
        }
    };
    if let Some(err) = failure
        && !sink.is_ended()
    {
        let _ = sink.send(H::Response::from_error(err)).await;
    }
    if sink.ended_with_error() {
        Outcome::Error
    } else if sink.handed_off() {
        Outcome::Continued
    } else {
        Outcome::Success
    }
}

/// The request's [`properties::ORIGIN`], when it is one to believe: printable ASCII of at most
/// [`properties::MAX_ORIGIN_BYTES`] (it goes into logs).
fn origin(delivery: &Delivery) -> Option<String> {
    delivery
        .property(properties::ORIGIN)
        .filter(|o| {
            !o.is_empty()
                && o.len() <= properties::MAX_ORIGIN_BYTES
                && o.bytes().all(|b| b.is_ascii_graphic())
        })
        .map(str::to_owned)
}

#[cfg(test)]
mod tests;
