//! The consume loop: starting a processor (its publisher, cancel listener, request
//! subscription, syncs), taking requests while a slot is free and the broker stores, and
//! running a process until its signal.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use tokio::{
    sync::{Semaphore, oneshot},
    task::{JoinHandle, JoinSet},
    time::Duration,
};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{
    Handler, ProcessorConfig,
    delivery::{Shared, handle_delivery},
    drain::{Background, LEDGER_FLUSH_BOUND, drain},
    syncs::{Taking, send_syncs},
};
use crate::{
    bus::{Bus, BusError, SubscribeOptions, Subscription},
    cancel::{self, CancelRegistry},
    store::StoreGuard,
    telemetry::Telemetry,
};

/// How long a starting processor waits for its cancel subscription before it takes requests
/// anyway (see [`run`]).
const CANCEL_SUBSCRIBE_WAIT: Duration = Duration::from_secs(5);

/// Runs a processor until `shutdown` is cancelled, then drains. Returns an error only when
/// it cannot start (the subscription or publisher cannot be created).
pub async fn run<H: Handler>(
    bus: Arc<dyn Bus>,
    config: ProcessorConfig,
    handler: Arc<H>,
    telemetry: Telemetry,
    shutdown: CancellationToken,
) -> Result<(), BusError> {
    let concurrency = config.concurrency.max(1);
    telemetry.metrics.processor_started(&config.name);
    if config.billing.is_some() {
        telemetry.metrics.billing_enforced(&config.name);
    }
    let publisher = bus.publisher(&config.response_topic).await?;
    // A role that may not produce the answers must not take a single request: refused now,
    // the process stops with the cause and the topic. An outage is not a reason to stop
    // (the producer is made again at the first record).
    match publisher.open().await {
        Err(e @ BusError::Denied(_)) => return Err(e),
        Err(e) => warn!(processor = %config.name, error = %e,
                        "the response topic cannot be opened yet; going on"),
        Ok(()) => {}
    }
    let cancels = CancelRegistry::default();
    let stop_cancels = CancellationToken::new();
    // Stops the cancel listener if the request subscription below fails.
    let cancels_guard = stop_cancels.clone().drop_guard();
    let (cancel_listener, cancels_subscribed) =
        listen_for_cancels(&bus, &config, &cancels, &stop_cancels);
    let mut options = SubscribeOptions::shared(u32::try_from(concurrency).unwrap_or(u32::MAX));
    options.consumer_name = Some(format!("{}-{}", config.name, crate::short_id()));
    let mut subscription = bus
        .subscribe(&config.request_topic, &config.subscription, options)
        .await?;
    // A cancel published before the listener subscribed is never read (the subscription starts
    // at the latest message, and the notify topics keep nothing), so the first requests wait
    // for it, within a bound: found in CI, a client that went away right after its first token
    // on a just-started processor whose cancel subscription was still being created.
    if cancel_listener.is_some()
        && tokio::time::timeout(CANCEL_SUBSCRIBE_WAIT, cancels_subscribed)
            .await
            .is_err()
    {
        warn!(processor = %config.name, wait = ?CANCEL_SUBSCRIBE_WAIT,
              "serving before the cancel subscription exists: a cancel sent meanwhile is not seen");
    }
    let link_name = link_name(&config);
    telemetry
        .health
        .watch(link_name.clone(), subscription.link());
    info!(processor = %config.name, flow = config.flow.as_deref().unwrap_or(""),
          topic = %config.request_topic, concurrency, "processor started");

    let config = Arc::new(config);
    let store = StoreGuard::new(config.name.clone(), telemetry.clone());
    let shared = Arc::new(Shared::new(
        publisher.clone(),
        &telemetry,
        config.clone(),
        cancels.clone(),
        store.clone(),
    ));
    let taking = Taking {
        slots: Arc::new(Semaphore::new(concurrency)),
        waiting: Arc::new(AtomicBool::new(false)),
        store: store.clone(),
        shutdown: shutdown.clone(),
    };
    let stop_syncs = CancellationToken::new();
    let syncs = shared.book.clone().map(|book| {
        tokio::spawn(send_syncs(
            publisher.clone(),
            config.name.clone(),
            book,
            taking.clone(),
            stop_syncs.clone(),
        ))
    });
    // Cancelled if the drain grace runs out: each unfinished request task drops its handler
    // (and with it the provider call) and hands its request back.
    let abandon = CancellationToken::new();
    let mut tasks = JoinSet::new();
    consume(
        &mut subscription,
        &handler,
        &shared,
        &taking,
        &abandon,
        &mut tasks,
    )
    .await;

    drain(
        &mut tasks,
        &abandon,
        &mut *subscription,
        &config,
        &telemetry,
    )
    .await;
    subscription.close().await;
    Background {
        cancels_guard,
        stop_syncs,
        syncs,
        cancel_listener,
    }
    .stop()
    .await;
    if config.flow.is_some() {
        telemetry.health.unwatch(&link_name);
    }
    // Usage records the broker has not stored yet get a last chance (see crate::ledger);
    // one flow of several stopping leaves them to the others (run_flows_until_signalled
    // flushes when all have stopped).
    if let Some(ledger) = config.ledger.as_ref().filter(|_| config.flow.is_none()) {
        ledger.flush(LEDGER_FLUSH_BOUND).await;
    }
    info!(processor = %config.name, flow = config.flow.as_deref().unwrap_or(""), "processor stopped");
    Ok(())
}

/// The name of the request subscription's link in `/readyz`.
fn link_name(config: &ProcessorConfig) -> String {
    match &config.flow {
        // Unique: a changed flow's new consumer starts while the old one drains.
        Some(flow) => format!(
            "{} requests of flow {flow} ({})",
            config.name,
            crate::short_id()
        ),
        None => format!("{} requests", config.name),
    }
}

/// Sets up the cancel listener of `config`'s cancel topic, if it has one: a task that
/// subscribes (every replica reads every cancel) and feeds `cancels` until `stop`. The
/// receiver hears once the subscription was tried.
///
/// Cancellation saves provider calls nobody reads; it is not worth refusing to serve over
/// (a missing `notify` namespace makes the broker lookup retry for long), so the cancel
/// subscription is set up beside the request subscription, and waited for only briefly.
fn listen_for_cancels(
    bus: &Arc<dyn Bus>,
    config: &ProcessorConfig,
    cancels: &CancelRegistry,
    stop: &CancellationToken,
) -> (Option<JoinHandle<()>>, oneshot::Receiver<()>) {
    let (cancels_ready, cancels_subscribed) = oneshot::channel::<()>();
    let cancel_listener = config.cancel_topic.clone().map(|topic| {
        let (bus, cancels, stop) = (bus.clone(), cancels.clone(), stop.clone());
        let name = format!("{}-cancel-{}", config.name, crate::short_id());
        let processor = config.name.clone();
        tokio::spawn(async move {
            // Every replica reads every cancel: its own exclusive subscription, from now on.
            let mut options = SubscribeOptions::exclusive(1000);
            options.consumer_name = Some(name.clone());
            let subscribed = tokio::select! {
                () = stop.cancelled() => return,
                s = bus.subscribe(&topic, &name, options) => s,
            };
            let _ = cancels_ready.send(());
            match subscribed {
                Ok(subscription) => cancel::listen(subscription, cancels, stop).await,
                Err(e) => warn!(processor = %processor, topic = %topic, error = %e,
                                "client cancellation is off: the cancel topic cannot be read (create its namespace, e.g. with `sluice pulsar ensure-namespaces`)"),
            }
        })
    });
    (cancel_listener, cancels_subscribed)
}

/// Takes requests from `subscription` and runs each in a task of `tasks`, while a slot of
/// `taking` is free and the broker stores, until `taking.shutdown` or the subscription ends.
async fn consume<H: Handler>(
    subscription: &mut Box<dyn Subscription>,
    handler: &Arc<H>,
    shared: &Arc<Shared>,
    taking: &Taking,
    abandon: &CancellationToken,
    tasks: &mut JoinSet<()>,
) {
    let (store, publisher, shutdown) = (&shared.store, &shared.publisher, &taking.shutdown);
    let (semaphore, waiting) = (&taking.slots, &taking.waiting);
    let config = &shared.config;
    loop {
        if store.is_blocked() && !store.wait_until_stored(&**publisher, shutdown).await {
            break;
        }
        // Take a slot before taking a request, so a busy processor leaves requests with the
        // broker for other replicas.
        let permit = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            p = semaphore.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        waiting.store(true, Ordering::Relaxed);
        let delivery = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            // A request task found the broker unable to store while this loop waited for a
            // request: probe now (at the top of the loop), not when the next request arrives,
            // which may never happen (see `StoreGuard`). `next` is cancel-safe: a request it
            // was about to hand over is taken at the next turn.
            () = store.until_blocked() => {
                waiting.store(false, Ordering::Relaxed);
                drop(permit);
                continue;
            }
            d = subscription.next() => d,
        };
        waiting.store(false, Ordering::Relaxed);
        let delivery = match delivery {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                warn!(processor = %config.name, error = %e, "receiving failed");
                continue;
            }
            None => break,
        };
        // Taken while another request found the broker unable to store: it waits here, with
        // no provider call, until the broker stores again (dropped, it goes back on shutdown).
        if store.is_blocked() && !store.wait_until_stored(&**publisher, shutdown).await {
            drop(delivery);
            break;
        }
        let (task_handler, task_shared, cancel) =
            (handler.clone(), shared.clone(), abandon.child_token());
        tasks.spawn(async move {
            handle_delivery(&*task_handler, delivery, &task_shared, cancel).await;
            drop(permit);
        });
        while let Some(done) = tasks.try_join_next() {
            if let Err(e) = done {
                error!(processor = %config.name, error = %e, "request task failed");
            }
        }
    }
}

/// Runs a processor as a whole process: serves `/metrics`, `/healthz`, `/readyz` on
/// `metrics_addr` until the processor has drained (so probes see 503 while draining, and
/// the last scrape sees the final counts), and drains on SIGTERM or SIGINT.
pub async fn run_until_signalled<H: Handler>(
    bus: Arc<dyn Bus>,
    config: ProcessorConfig,
    handler: Arc<H>,
    telemetry: Telemetry,
    metrics_addr: std::net::SocketAddr,
) -> Result<std::net::SocketAddr, RunError> {
    let shutdown = crate::telemetry::shutdown_on_signals();
    let telemetry_stop = CancellationToken::new();
    let bound = telemetry
        .serve(metrics_addr, telemetry_stop.clone())
        .await
        .map_err(|e| RunError::Telemetry(metrics_addr, e))?;
    info!(%bound, "serving /metrics /healthz /readyz");
    let result = run(bus, config, handler, telemetry, shutdown).await;
    telemetry_stop.cancel();
    result.map_err(RunError::Bus)?;
    Ok(bound)
}

/// Why a processor process could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The telemetry port could not be bound.
    #[error("cannot serve metrics on {0}: {1}")]
    Telemetry(std::net::SocketAddr, std::io::Error),
    /// The bus failed at start-up.
    #[error(transparent)]
    Bus(#[from] BusError),
}

#[cfg(test)]
mod tests;
