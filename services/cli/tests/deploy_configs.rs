//! Every `--config` file under deploy/ (compose, Kubernetes, `sluice serve`) is read by the
//! subcommand it is for: its keys are that subcommand's options and its values parse. A
//! renamed option fails here, not in a cluster.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

mod common;

/// The subcommand that reads `file`: deploy/serve/*.toml is `serve`, the others are named
/// after their processor.
fn subcommand(file: &Path) -> &'static str {
    if file.parent().and_then(Path::file_name) == Some("serve".as_ref()) {
        return "serve";
    }
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    ["text-completion", "prompt", "agent", "gateway"]
        .into_iter()
        .find(|c| *c == stem)
        .unwrap_or_else(|| panic!("{}: which subcommand reads it?", file.display()))
}

fn toml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            toml_files(&path, out);
        } else if path.extension() == Some("toml".as_ref()) {
            out.push(path);
        }
    }
}

#[test]
fn every_deploy_config_file_is_accepted_by_its_subcommand() {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let mut files = Vec::new();
    toml_files(&deploy, &mut files);
    files.sort();
    assert!(files.len() >= 9, "config files found: {files:?}");
    for file in &files {
        let command = subcommand(file);
        // The file is spliced in before clap parses, so unknown keys and bad values fail
        // before --help is reached.
        let path = file.display().to_string();
        let out = common::run_blocking(
            &[command, "--config", &path, "--help"],
            &[],
            &["SLUICE_CONFIG"],
        );
        assert!(out.ok(), "sluice {command} --config {path}: {}", out.stderr);
    }

    // A key of another subcommand is refused.
    let bad = std::env::temp_dir().join(format!("sluice-bad-{}.toml", std::process::id()));
    std::fs::write(&bad, "model = \"m\"\n").unwrap();
    let bad_path = bad.display().to_string();
    let out = common::run_blocking(&["gateway", "--config", &bad_path, "--help"], &[], &[]);
    assert!(!out.ok());
    assert!(
        out.stderr.contains("unknown key \"model\""),
        "{}",
        out.stderr
    );
    std::fs::remove_file(&bad).unwrap();
}
