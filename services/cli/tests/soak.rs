//! The soak under chaos (issue #13.4), three minutes of it: every processor kind as `sluice`
//! processes on a broker of the test's own (ports 6656/8086/3187), mixed traffic through the
//! gateway and on the bus, a replica killed with SIGKILL every ~20 s, two broker restarts
//! (one graceful, one SIGKILL), and provider faults. Every request must end exactly once, with
//! its whole answer or a clear error; nothing lost or duplicated; every in-flight gauge back to
//! 0. The 30-minute run is `bash bench/run.sh soak` (figures in docs/soak.md).
//!
//! Then the same on the secured multi-broker cluster the test command starts (issue #21.5):
//! three and a half minutes with a namespace unload, a bookie SIGKILLed while written and the
//! SIGKILL of the broker that owns text-completion's request topic, over TLS with
//! least-privilege roles. `bash bench/run.sh soak --cluster` runs it for 30 minutes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, time::Duration};

use sluice_tests::{
    cluster::Cluster,
    soak::{SoakConfig, run},
};

/// One soak at a time: each alone keeps both cores busy, and side by side their faults and
/// kills would explain each other's errors.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config(duration: Duration) -> SoakConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    SoakConfig::new(
        PathBuf::from(env!("CARGO_BIN_EXE_sluice")),
        root.join("deploy/pulsar/pulsar.sh"),
        duration,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_minutes_of_mixed_traffic_under_kills_and_broker_restarts_lose_nothing() {
    let _serial = SERIAL.lock().await;
    let mut config = config(Duration::from_secs(180));
    config.warm_up = Duration::from_secs(45);
    // Two restarts, a graceful one at ~60 s, a SIGKILL a minute after its repair (~130 s on
    // a quiet machine); the traffic goes on until the second is repaired and 30 s more, however
    // long the restarts take on a busy one.
    config.fault_every = Duration::from_secs(60);
    config.max_faults = Some(2);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_secured_cluster_unloads_a_bookie_kill_and_a_broker_kill_lose_nothing() {
    let Some(cluster) = Cluster::from_env() else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let mut config = config(Duration::from_secs(210));
    config.warm_up = Duration::from_secs(45);
    // An unload at ~25 s, a bookie kill at ~50 s (repaired after its ZooKeeper session
    // expires, ~40 s), the owner broker's SIGKILL at ~115 s (repaired in ~30-60 s); the
    // traffic goes on until the third is repaired and 30 s more.
    config.fault_every = Duration::from_secs(25);
    config.max_faults = Some(3);
    config.callers = 8;
    config.cluster = Some(cluster);
    // Its own logs, beside the other soak's.
    config.work_dir =
        std::env::temp_dir().join(format!("sluice-soak-cluster-{}", std::process::id()));
    let report = run(config).await.expect("the soak could not set up");
    println!("{}", report.markdown());
    assert!(
        report.clean(),
        "the cluster soak found problems:\n{}",
        report.markdown()
    );
    assert!(
        report.faults.len() == 3
            && report.faults[0] == "unload"
            && report.faults[1].starts_with("bookie ")
            && report.faults[2].starts_with("broker ")
            && report.faults[2].ends_with(" SIGKILL"),
        "the cluster soak did not meet an unload, a bookie kill and a broker kill: {:?}",
        report.faults
    );
    assert!(
        report.kills >= 3,
        "only {} replicas were killed",
        report.kills
    );
    assert!(report.answered > 100, "only {} answered", report.answered);
}
