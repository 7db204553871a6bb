//! What every fake provider server shares: a loopback HTTP server that stops when its
//! handle is dropped, a record of the requests it received, and scripted response bodies
//! (bytes, pauses, a broken connection, a hang) for the failure shapes real providers show.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Body, response::Response};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

/// A running fake server; `S` is what it records. Stops when dropped.
pub struct Fake<S> {
    /// Where it listens.
    pub addr: SocketAddr,
    seen: Arc<Mutex<S>>,
    stop: CancellationToken,
}

impl<S: Default + Send + 'static> Fake<S> {
    /// Serves the router `app` builds around the shared record, on a free loopback port.
    /// Accepted sockets get TCP_NODELAY, as real providers' servers do; without it every
    /// stream would stall ~40 ms on Nagle + delayed ACK between the headers and the first event.
    pub(crate) async fn serve(app: impl FnOnce(Arc<Mutex<S>>) -> Router) -> Self {
        let seen: Arc<Mutex<S>> = Arc::default();
        let app = app(seen.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let stop = CancellationToken::new();
        let until = stop.clone();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { until.cancelled().await })
                .await
                .unwrap();
        });
        Self { addr, seen, stop }
    }

    /// The base URL to configure a provider with.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What the server recorded so far.
    pub(crate) fn seen(&self) -> MutexGuard<'_, S> {
        self.seen.lock().unwrap()
    }
}

impl<S> Drop for Fake<S> {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Calls received, per model name: fakes script "fail the first call, then succeed" with it.
#[derive(Debug, Default)]
pub struct Calls(HashMap<String, usize>);

impl Calls {
    /// Counts a call for `model`; returns its number, from 1.
    pub(crate) fn count(&mut self, model: &str) -> usize {
        let n = self.0.entry(model.to_owned()).or_default();
        *n += 1;
        *n
    }

    /// Calls so far for `model`.
    pub(crate) fn get(&self, model: &str) -> usize {
        self.0.get(model).copied().unwrap_or(0)
    }
}

/// One step of a scripted response body.
pub(crate) enum Step {
    /// Send these bytes.
    Send(String),
    /// Send these binary bytes (Bedrock's event-stream frames).
    Bytes(Vec<u8>),
    /// Pause.
    Wait(Duration),
    /// Break the connection (the client sees a truncated chunked body).
    Break,
    /// Send nothing more, ever.
    Hang,
    /// Send these bytes with `@NOW@` replaced by the wall clock in nanoseconds since the
    /// Unix epoch, taken as the step is sent (benchmarks time a token from here).
    Stamped(String),
    /// Wait until the test opens the gate (`Notify::notify_one`).
    Gate(Arc<tokio::sync::Notify>),
    /// Wait until the test releases what is held ([`Held::release`]), for good: every call
    /// held then, and every one after.
    Hold(Arc<Held>),
}

/// Calls held until the test releases them all (unlike a gate, which lets one through).
#[derive(Debug, Default)]
pub struct Held {
    released: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
}

impl Held {
    /// Lets every held call, and every later one, go on.
    pub fn release(&self) {
        self.released
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.released.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }
}

/// A response whose body follows `steps`.
pub(crate) fn scripted_body(steps: Vec<Step>, content_type: &str) -> Response {
    tracked_body(steps, content_type, Arc::default())
}

/// Counts bodies dropped before their last step; dropped means the client closed the
/// connection, which is how a cancelled provider call looks from the provider's side.
struct Unfinished {
    abandoned: Arc<AtomicUsize>,
    finished: bool,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.finished {
            self.abandoned.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A response whose body follows `steps`, counting in `abandoned` if the client goes away
/// before the end.
pub(crate) fn tracked_body(
    steps: Vec<Step>,
    content_type: &str,
    abandoned: Arc<AtomicUsize>,
) -> Response {
    let guard = Unfinished {
        abandoned,
        finished: false,
    };
    let body = futures::stream::unfold(
        (steps.into_iter(), guard),
        |(mut steps, mut guard)| async move {
            let Some(step) = steps.next() else {
                guard.finished = true;
                drop(guard);
                return None;
            };
            let item = match step {
                Step::Send(s) => Ok::<_, std::io::Error>(Bytes::from(s)),
                Step::Bytes(b) => Ok(Bytes::from(b)),
                Step::Stamped(s) => {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos());
                    Ok(Bytes::from(s.replace("@NOW@", &now.to_string())))
                }
                Step::Wait(d) => {
                    tokio::time::sleep(d).await;
                    Ok(Bytes::new())
                }
                Step::Gate(gate) => {
                    gate.notified().await;
                    Ok(Bytes::new())
                }
                Step::Hold(held) => {
                    held.wait().await;
                    Ok(Bytes::new())
                }
                Step::Break => {
                    guard.finished = true;
                    Err(std::io::Error::other("connection dropped by the fake"))
                }
                Step::Hang => match futures::future::pending::<Infallible>().await {},
            };
            Some((item, (steps, guard)))
        },
    );
    Response::builder()
        .header("content-type", content_type)
        .body(Body::from_stream(body))
        .unwrap()
}
