//! `sluice`: the one binary (its commands are in the library, `sluice_cli`). This file adds
//! what belongs to a process only: the allocator and its heap probe.

use std::process::ExitCode;

use sluice_cli::ParseError;

/// jemalloc: it gives memory back after a burst, where glibc's malloc kept every broker
/// outage's peak (see docs/soak.md), and it counts what is allocated.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Bytes allocated and bytes resident, from jemalloc's statistics (refreshed by advancing
/// its epoch).
fn heap_stats() -> Option<(u64, u64)> {
    tikv_jemalloc_ctl::epoch::advance().ok()?;
    let allocated = tikv_jemalloc_ctl::stats::allocated::read().ok()?;
    let resident = tikv_jemalloc_ctl::stats::resident::read().ok()?;
    Some((
        u64::try_from(allocated).ok()?,
        u64::try_from(resident).ok()?,
    ))
}

#[tokio::main]
async fn main() -> ExitCode {
    sluice_runtime::telemetry::set_heap_probe(heap_stats);
    match sluice_cli::parse(std::env::args_os().collect()) {
        Ok(invocation) => invocation.run().await,
        // clap prints its message (or the help or version text) and exits with its status.
        Err(ParseError::Args(e)) => e.exit(),
        Err(ParseError::Config(e)) => {
            eprintln!("sluice: {e}");
            ExitCode::from(2)
        }
    }
}
