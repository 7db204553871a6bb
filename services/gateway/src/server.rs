//! The gateway's HTTP/1.1 server: accepts connections up to a cap, gives each a deadline to
//! send its request's headers, and serves the router on them until shutdown.
//!
//! axum's own `serve` offers neither a connection cap nor a header-read deadline, so a client
//! that opens connections and sends nothing (or its headers a byte at a time) could hold
//! them, and the tasks behind them, for as long as it liked. Here:
//!
//! - at most [`ServerLimits::max_connections`] connections are served at once; more wait in
//!   the listener's backlog until one closes (no caller is refused, none is served late by
//!   more than the header deadline of the connections ahead of it);
//! - a connection must send a request's whole headers within
//!   [`ServerLimits::header_read_timeout`] of opening, and again of each answer when it is
//!   kept alive; a connection idle past that is closed. Streams are not touched: the deadline
//!   is on the headers only;
//! - accepted sockets get TCP_NODELAY: each streamed event is a small write that must leave
//!   at once.
//!
//! Shutdown stops accepting, lets every open connection finish its current answer (hyper's
//! graceful shutdown), and returns once all are closed: the caller bounds that wait.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::Router;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::{net::TcpListener, sync::Semaphore};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{debug, warn};

use crate::metrics::GatewayMetrics;

/// The connection cap when the process may open as many files as it likes.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;
/// File descriptors kept for everything but callers' connections: the bus, providers, logs.
const RESERVED_FDS: usize = 256;
/// How long a connection has to send a request's headers.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The server's limits on connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// From a connection's opening (or its last answer) to its request's headers read.
    pub header_read_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
        }
    }
}

/// The connection cap `wanted` as this process can honour it: within its open-file limit
/// (`RLIMIT_NOFILE`'s soft value, read from `/proc/self/limits` where there is one), less
/// what the rest of the process needs. Accepting past the limit would fail with EMFILE in a
/// loop instead of leaving callers in the backlog.
pub fn connection_cap(wanted: usize) -> usize {
    let soft = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| open_files_limit(&limits));
    match soft {
        Some(soft) => wanted.min(soft.saturating_sub(RESERVED_FDS).max(1)),
        None => wanted,
    }
}

/// The soft "Max open files" of a `/proc/PID/limits` text (`None`: unlimited or unreadable).
fn open_files_limit(limits: &str) -> Option<usize> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Serves `app` on `listener` under `limits` until `shutdown`, then waits for the open
/// connections to finish their answers.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    metrics: GatewayMetrics,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let connections = TaskTracker::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    // Logged once per time the cap is reached, not per connection that waits.
    let full = AtomicBool::new(false);
    loop {
        let permit = if let Ok(p) = permits.clone().try_acquire_owned() {
            full.store(false, Ordering::Relaxed);
            p
        } else {
            if !full.swap(true, Ordering::Relaxed) {
                warn!(
                    max = limits.max_connections,
                    "the gateway serves as many connections as its cap allows; new ones wait (--max-connections)"
                );
            }
            tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
                () = shutdown.cancelled() => break,
            }
        };
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    accept_failed(&e).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(tcp), service);
        let (shutdown, metrics) = (shutdown.clone(), metrics.clone());
        connections.spawn(async move {
            let _permit = permit;
            metrics.open_connections(1);
            let conn = conn.with_upgrades();
            tokio::pin!(conn);
            let served = tokio::select! {
                served = conn.as_mut() => served,
                () = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            metrics.open_connections(-1);
            if let Err(e) = served {
                log_connection_end(peer, &e);
            }
        });
    }
    connections.close();
    connections.wait().await;
}

/// A failed accept: the connection's own failure (the peer went away before it was
/// accepted) is nothing; running out of file descriptors or memory is waited out, as
/// accepting again at once would fail again at once.
async fn accept_failed(e: &std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused
    ) {
        return;
    }
    warn!(error = %e, "cannot accept a connection; trying again in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// A connection that ended in an error: a header deadline passed, a client that went away,
/// a malformed request. Debug level: clients cause all of these, and a flood of them must not
/// flood the logs.
fn log_connection_end(peer: SocketAddr, e: &hyper::Error) {
    if e.is_timeout() {
        debug!(%peer, "closed a connection that did not send its request's headers in time");
    } else {
        debug!(%peer, error = %e, "a connection ended in an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_stays_within_the_open_files_limit() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max cpu time              unlimited            unlimited            seconds   \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(open_files_limit(limits), Some(1024));
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(open_files_limit(unlimited), None);
        assert_eq!(open_files_limit(""), None);
        // This process's own limit bounds the cap, less what the process keeps for itself.
        let own = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| open_files_limit(&l));
        if let Some(soft) = own {
            assert_eq!(
                connection_cap(usize::MAX),
                soft.saturating_sub(RESERVED_FDS).max(1)
            );
        }
        assert_eq!(connection_cap(3), 3);
    }
}
