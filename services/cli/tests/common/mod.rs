//! What the CLI's process tests share: running `sluice` subcommands as child processes with
//! their output captured, `sluice invoke`, and the metrics table of `docs/metrics.md`.
// Each test binary uses its own part of this module.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use sluice_tests::process;
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, BufReader},
    process::{Child, Command},
    task::JoinHandle,
};

/// A `sluice` child process whose stdout and stderr are collected as they are written (so
/// that a chatty debug log never fills a pipe and blocks the process).
pub struct Sluice {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
}

/// What a stopped process left behind.
pub struct Stopped {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

fn collect(
    from: impl AsyncRead + Unpin + Send + 'static,
    into: Arc<Mutex<String>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut lines = BufReader::new(from).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let mut s = into.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    })
}

impl Sluice {
    /// Starts `sluice ARGS` with `env` added and `remove` removed from the environment.
    pub fn spawn(args: &[&str], env: &[(&str, &str)], remove: &[&str]) -> Sluice {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for k in remove {
            cmd.env_remove(k);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let readers = vec![
            collect(child.stdout.take().unwrap(), stdout.clone()),
            collect(child.stderr.take().unwrap(), stderr.clone()),
        ];
        Sluice {
            child,
            stdout,
            stderr,
            readers,
        }
    }

    /// The first stdout line containing `needle`; panics with the log if the process exits
    /// first or says nothing of the kind within two minutes (a hang guard).
    pub async fn stdout_line(&mut self, needle: &str) -> String {
        for _ in 0..1200 {
            if let Some(line) = self
                .stdout
                .lock()
                .unwrap()
                .lines()
                .find(|l| l.contains(needle))
            {
                return line.to_owned();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "exited ({status}) before printing {needle:?}:\n{}",
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "no {needle:?} on stdout within two minutes:\n{}",
            self.stderr()
        );
    }

    /// Waits until `url` (a /readyz) answers 2xx; panics with the log if the process exits
    /// first or is not ready within two minutes (a hang guard: a start-up takes seconds, more
    /// on a busy machine).
    pub async fn ready(&mut self, url: &str) {
        if let Err(e) = self.try_ready(url).await {
            panic!("{e}:\n{}", self.stderr());
        }
    }

    /// The same, with its failure as an error (the log not included).
    pub async fn try_ready(&mut self, url: &str) -> Result<(), String> {
        process::ready(&mut self.child, url, Duration::from_secs(120)).await
    }

    /// The exit status once the process has exited (its output then read to the end), else
    /// `None`.
    pub async fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.try_wait().ok().flatten()?;
        for r in self.readers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), r).await;
        }
        Some(status)
    }

    /// What it logged so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Sends signal `name` (`HUP`, `TERM`, ...) to the process.
    pub fn signal(&self, name: &str) {
        assert!(process::signal(self.child.id().unwrap(), name));
    }

    /// SIGTERM, then the exit status and everything it wrote. Waited for up to the default
    /// drain grace (30 s, for requests in flight) plus [`sluice_tests::PATIENCE`]: a hang guard.
    pub async fn stop(mut self) -> Stopped {
        assert!(process::signal(self.child.id().unwrap(), "TERM"));
        let grace = Duration::from_secs(30) + sluice_tests::PATIENCE;
        let status = tokio::time::timeout(grace, self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .unwrap();
        for r in self.readers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), r).await;
        }
        Stopped {
            status,
            stdout: self.stdout.lock().unwrap().clone(),
            stderr: self.stderr.lock().unwrap().clone(),
        }
    }
}

/// What one `sluice` run to its end left: its exit code (-1 when a signal ended it), stdout
/// and stderr.
pub struct Invoked {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Invoked {
    /// Whether it exited with 0.
    pub fn ok(&self) -> bool {
        self.code == 0
    }
}

/// How long a one-shot `sluice` run (`--help`, a refused start-up, `topics`, `usage`,
/// `invoke` against a fake) may take before the test fails as hung: such a run takes well
/// under a second, seconds on a busy machine.
pub const ONE_SHOT: Duration = Duration::from_secs(120);

/// Runs `sluice ARGS` to its end, with `env` added to and `remove` removed from the test's
/// environment, its output captured; fails the test if it has not exited within `patience`
/// (the process is killed then).
pub async fn run_within(
    patience: Duration,
    args: &[&str],
    env: &[(&str, &str)],
    remove: &[&str],
) -> Invoked {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args(args).stdin(Stdio::null()).kill_on_drop(true);
    for k in remove {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(patience, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("sluice {args:?} did not exit within {patience:?}"))
        .unwrap();
    Invoked {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// [`run_within`] [`ONE_SHOT`].
pub async fn run(args: &[&str], env: &[(&str, &str)], remove: &[&str]) -> Invoked {
    run_within(ONE_SHOT, args, env, remove).await
}

/// [`run`] from a test that is not async.
pub fn run_blocking(args: &[&str], env: &[(&str, &str)], remove: &[&str]) -> Invoked {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(run(args, env, remove))
}

/// The environment `sluice invoke` is run without: the caller's token, URL and log settings.
pub const INVOKE_CLEAN: [&str; 3] = ["SLUICE_TOKEN", "SLUICE_URL", "RUST_LOG"];

/// Runs `sluice invoke ARGS` with `env`, without [`INVOKE_CLEAN`].
pub async fn invoke(args: &[&str], env: &[(&str, &str)]) -> Invoked {
    let args: Vec<&str> = std::iter::once("invoke")
        .chain(args.iter().copied())
        .collect();
    run_within(Duration::from_secs(60), &args, env, &INVOKE_CLEAN).await
}

/// One row of the metrics table (`docs/metrics.md`).
#[derive(Debug, Clone)]
pub struct DocumentedMetric {
    /// The metric name.
    pub name: String,
    /// `counter`, `gauge` or `histogram`.
    pub kind: String,
}

/// The metrics reference (`docs/metrics.md`), read at test time so that the documentation
/// and the code cannot drift apart.
pub fn documented_metrics() -> Vec<DocumentedMetric> {
    let section = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/metrics.md"
    ))
    .expect("docs/metrics.md is the metrics reference");
    let metrics: Vec<DocumentedMetric> = section
        .lines()
        .filter(|l| l.starts_with("| `sluice_"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            DocumentedMetric {
                name: cells[1].trim_matches('`').to_owned(),
                kind: cells[2].to_owned(),
            }
        })
        .collect();
    assert!(metrics.len() >= 20, "the metrics table was not found");
    for m in &metrics {
        assert!(
            ["counter", "gauge", "histogram"].contains(&m.kind.as_str()),
            "{}: unknown type {:?}",
            m.name,
            m.kind
        );
    }
    metrics
}
