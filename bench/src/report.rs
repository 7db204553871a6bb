//! What every scenario reports with: latency histograms and their quantiles, the
//! provenance line, and the splicing of tables into the docs.

use std::{fmt::Write as _, path::Path};

use hdrhistogram::Histogram;

pub(crate) fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).unwrap()
}

pub(crate) fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// A table row: `label`, then the p50 and p99 of `h` (microseconds) in milliseconds.
pub(crate) fn quantile_row(md: &mut String, label: &str, h: &Histogram<u64>) {
    let _ = writeln!(md, "| {label} | {:.2} | {:.2} |", ms(h, 0.5), ms(h, 0.99));
}

/// Replaces the table between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in the one
/// Markdown page under `docs` (at any depth) that has them.
pub(crate) fn splice(docs: &Path, name: &str, table: &str) {
    // The docs test checks the pages against this list: a table missing from it would go
    // unchecked.
    assert!(
        sluice_tests::BENCH_TABLES.contains(&name),
        "bench table {name:?} is not in sluice_tests::BENCH_TABLES"
    );
    let (start, end) = (
        format!("<!-- bench:{name} -->"),
        format!("<!-- /bench:{name} -->"),
    );
    let mut dirs = vec![docs.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for page in entries.filter_map(Result::ok).map(|e| e.path()) {
            if page.is_dir() {
                dirs.push(page);
                continue;
            }
            if page.extension().is_none_or(|x| x != "md") {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&page) else {
                continue;
            };
            if let (Some(a), Some(b)) = (text.find(&start), text.find(&end)) {
                let spliced = format!("{}{start}\n{table}{}", &text[..a], &text[b..]);
                std::fs::write(&page, spliced).unwrap();
                eprintln!("results table spliced into {}", page.display());
                return;
            }
        }
    }
    eprintln!(
        "no page under {} has {start} … {end} markers; not spliced",
        docs.display()
    );
}

/// How a results file was made, measured when it is written: the date, the commit (marked when
/// the work tree had changes), the cores this process may use, the build profile, and the
/// command line that reproduces it (`bench/run.sh` with this run's arguments). Every results
/// header starts with it, so a file says how it was made even when the next run is different.
pub(crate) fn provenance() -> String {
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    format!(
        "{} by `{}`",
        sluice_tests::measured_here(&["docs"]),
        command_line(std::env::args().skip(1), profile)
    )
}

/// `bash bench/run.sh` with the scenario's arguments (not `--out` and `--docs`, which
/// run.sh sets), prefixed with `BENCH_PROFILE=debug` for a debug build.
pub(crate) fn command_line(args: impl Iterator<Item = String>, profile: &str) -> String {
    let mut kept = Vec::new();
    let mut args = args.peekable();
    while let Some(a) = args.next() {
        if a == "--out" || a == "--docs" {
            args.next();
        } else if !(a.starts_with("--out=") || a.starts_with("--docs=")) {
            kept.push(a);
        }
    }
    let prefix = if profile == "debug" {
        "BENCH_PROFILE=debug "
    } else {
        ""
    };
    format!("{prefix}bash bench/run.sh {}", kept.join(" "))
        .trim_end()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::command_line;

    #[test]
    fn the_command_line_is_the_run_sh_call_that_reproduces_a_result() {
        let args = |a: &[&str]| {
            a.iter()
                .map(|s| (*s).to_owned())
                .collect::<Vec<_>>()
                .into_iter()
        };
        assert_eq!(
            command_line(
                args(&["--out", "bench/results", "--docs", "docs", "loss"]),
                "debug"
            ),
            "BENCH_PROFILE=debug bash bench/run.sh loss"
        );
        assert_eq!(
            command_line(
                args(&["--out=x", "foundation", "--round-trips", "500"]),
                "release"
            ),
            "bash bench/run.sh foundation --round-trips 500"
        );
    }
}
