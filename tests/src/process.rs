//! Child processes in tests, benches and the soak: signals, readiness, a graceful stop. One
//! version of each, so every suite waits and stops the same way.

use std::{process::ExitStatus, time::Duration};

use tokio::process::Child;

/// Sends the signal `name` (as `kill` spells it: `TERM`, `KILL`, `HUP`, `STOP`, `CONT`) to
/// `pid`; whether it was delivered.
pub fn signal(pid: u32, name: &str) -> bool {
    std::process::Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// Waits until `url` (a `/readyz`) answers 2xx, asking every 100 ms. Fails, saying which, if
/// the child exits first or `timeout` passes: a process that cannot start has said why on
/// its stderr, and waiting on would only hide it.
pub async fn ready(child: &mut Child, url: &str, timeout: Duration) -> Result<(), String> {
    sluice_runtime::install_crypto_provider();
    // Each ask bounded too: a process that takes the connection and never answers must not
    // hold the wait past its deadline.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| format!("no HTTP client: {e}"))?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("exited before it was ready ({status})"));
        }
        if http
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("not ready within {timeout:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Stops a child as a deployment would: SIGTERM (it drains, and deletes its response
/// subscription), then SIGKILL if it has not exited within `grace`. The exit status, or
/// `None` when it had to be killed.
pub async fn terminate(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    if let Some(pid) = child.id() {
        signal(pid, "TERM");
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(status) => status.ok(),
        Err(_) => {
            let _ = child.kill().await;
            None
        }
    }
}

/// Runs the client script `tests/py/{script}` (a program written against another project's
/// official client: OpenAI's SDK, Ollama's) under `python` (that client's venv, from the
/// `scripts/*-venv.sh` the test command runs) with `settings` as its one argument, and returns
/// the JSON it printed: what the client saw. Fails the test with the script's stderr if it
/// exits unsuccessfully or has not finished within `timeout` (a client hung on a stream that
/// never ends must fail the test, not hold it).
pub async fn py_client(
    python: &str,
    script: &str,
    settings: &serde_json::Value,
    timeout: Duration,
) -> serde_json::Value {
    let path = format!("{}/py/{script}", env!("CARGO_MANIFEST_DIR"));
    let run = tokio::process::Command::new(python)
        .arg(&path)
        .arg(settings.to_string())
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(timeout, run).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("{python} {path}: {e}"),
        Err(_) => panic!("{path} did not finish within {timeout:?}"),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{path}: {}\n{stderr}", out.status);
    match serde_json::from_slice(&out.stdout) {
        Ok(found) => found,
        Err(e) => panic!(
            "{path} printed no JSON ({e}): {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        ),
    }
}
