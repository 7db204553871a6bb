//! The soak under chaos (issue #13.4), three minutes of it: every processor kind as `sluice`
//! processes on a broker of the test's own (ports 6656/8086/3187), mixed traffic through the
//! gateway and on the bus, a replica killed with SIGKILL every ~20 s, two broker restarts
//! (one graceful, one SIGKILL), and provider faults. Every request must end exactly once, with its whole answer or a clear
//! error; nothing lost or duplicated; every in-flight gauge back to 0. The 30-minute run is
//! `bash bench/run.sh soak` (figures in the README).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, time::Duration};

use sluice_tests::soak::{SoakConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_minutes_of_mixed_traffic_under_kills_and_broker_restarts_lose_nothing() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut config = SoakConfig::new(
        PathBuf::from(env!("CARGO_BIN_EXE_sluice")),
        root.join("deploy/pulsar/pulsar.sh"),
        Duration::from_secs(180),
    );
    config.warm_up = Duration::from_secs(45);
    // Two restarts in the three minutes: a graceful one at ~60 s, a SIGKILL at ~130 s.
    config.broker_restart_every = Duration::from_secs(60);
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
        report.broker_killed,
        [false, true],
        "the broker was not restarted once gracefully, then once with SIGKILL"
    );
    // The callers' own requests (not retries) that every kind of request answered.
    assert!(report.answered > 100, "only {} answered", report.answered);
}
