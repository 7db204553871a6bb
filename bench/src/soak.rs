//! The long soak (`bash bench/run.sh soak`): the test command's soak run for minutes, its
//! report and memory series written out.

use std::{fmt::Write as _, path::Path, path::PathBuf, time::Duration, time::Instant};

use crate::report::{provenance, splice};

/// Runs the soak and writes its report, memory series and docs table.
pub(crate) async fn run(
    out: &Path,
    docs: &Path,
    minutes: u64,
    callers: usize,
    restart_every_secs: Option<u64>,
    cluster: bool,
) {
    let exe = std::env::current_exe().unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut config = sluice_tests::soak::SoakConfig::new(
        exe.with_file_name("sluice"),
        root.join("deploy/pulsar/pulsar.sh"),
        Duration::from_secs(minutes * 60),
    );
    config.callers = callers;
    let every = restart_every_secs.unwrap_or(if cluster { 120 } else { 300 });
    config.fault_every = Duration::from_secs(every.max(30));
    let name = if cluster {
        config.cluster =
            Some(sluice_tests::cluster::Cluster::from_env().expect(
                "no cluster: start it with deploy/pulsar/cluster.sh start and export its env",
            ));
        "soak-cluster"
    } else if every == 300 {
        "soak"
    } else {
        "soak-restarts"
    };
    // Not the test command's soak ports (6656), so both can run at once.
    config.broker_ports = (6657, 8087, 3188);
    let started = Instant::now();
    let report = sluice_tests::soak::run(config).await.unwrap();
    let md = format!(
        "{} ({:.0} min with set-up and drain).\n\n{}",
        provenance(),
        started.elapsed().as_secs_f64() / 60.0,
        report.markdown()
    );
    std::fs::write(out.join(format!("{name}.md")), &md).unwrap();
    // The memory samples behind the RSS table, and the broker restarts, as CSV.
    let mut csv = String::from("process,seconds,rss_mib,heap_allocated_mib\n");
    for (name, series) in &report.rss_series {
        for (t, r, h) in series {
            let _ = writeln!(csv, "{name},{t:.0},{r:.1},{h:.1}");
        }
    }
    for (t, fault) in report.broker_restart_at.iter().zip(&report.faults) {
        let _ = writeln!(csv, "fault {fault},{t:.0},,");
    }
    std::fs::write(out.join(format!("{name}-rss.csv")), csv).unwrap();
    splice(docs, name, &md);
    println!("{md}");
    assert!(report.clean(), "the soak found problems");
}
