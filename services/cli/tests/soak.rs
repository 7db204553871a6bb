//! The soak under chaos (issue #13.4), two minutes of it: every processor kind as `sluice`
//! processes on a broker of the test's own (ports 6656/8086/3187), mixed traffic through the
//! gateway and on the bus, a replica killed with SIGKILL every ~15 s, two broker restarts
//! (one graceful, one SIGKILL), and provider faults. Every request must end exactly once, with
//! its whole answer or a clear error; nothing lost or duplicated; every in-flight gauge back to
//! 0. The 30-minute run is `bash bench/run.sh soak` (figures in docs/soak.md).
//!
//! On the secured multi-broker cluster, the same processes as their least-privilege roles are
//! run by the production-Pulsar suite (`cluster.rs`), and the cluster's faults under load by
//! its fault series; `bash bench/run.sh soak --cluster` runs the soak there for 30 minutes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, time::Duration};

use sluice_tests::soak::{SoakConfig, run};

fn config(duration: Duration) -> SoakConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    SoakConfig::new(
        PathBuf::from(env!("CARGO_BIN_EXE_sluice")),
        root.join("deploy/pulsar/pulsar.sh"),
        duration,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_minutes_of_mixed_traffic_under_kills_and_broker_restarts_lose_nothing() {
    let mut config = config(Duration::from_secs(120));
    config.warm_up = Duration::from_secs(30);
    // Two restarts, a graceful one at ~30 s, a SIGKILL 30 s after its repair; the traffic goes
    // on until the second is repaired and 30 s more, and until six replicas were killed,
    // however long the restarts take on a busy machine (a kill waits while a restart lasts).
    config.fault_every = Duration::from_secs(30);
    config.max_faults = Some(2);
    config.kill_every = Duration::from_secs(15);
    config.min_kills = Some(6);
    config.callers = 8;
    let report = run(config).await.expect("the soak could not set up");
    println!("{}", report.markdown());
    assert!(
        report.clean(),
        "the soak found problems:\n{}",
        report.markdown()
    );
    assert!(
        report.kills >= 6,
        "only {} replicas were killed",
        report.kills
    );
    assert_eq!(
        report.faults,
        ["graceful", "SIGKILL"],
        "the broker was not restarted once gracefully, then once with SIGKILL"
    );
    // The callers' own requests (not retries) that every kind of request answered.
    assert!(report.answered > 100, "only {} answered", report.answered);
}
