//! The `sluice` binary run as a process.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

mod common;

/// `sluice ARGS` as a process (no Pulsar token in its environment): exit code, stdout, stderr.
fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let out = common::run_blocking(
        args,
        &[],
        &["SLUICE_PULSAR_TOKEN", "SLUICE_PULSAR_TOKEN_FILE"],
    );
    ((out.code >= 0).then_some(out.code), out.stdout, out.stderr)
}

/// [`run`] with success instead of the exit code.
fn sluice(args: &[&str]) -> (bool, String, String) {
    let (code, out, err) = run(args);
    (code == Some(0), out, err)
}

#[test]
fn topics_resolve_maps_trustgraph_names_both_ways() {
    let (ok, out, _) = sluice(&[
        "topics",
        "resolve",
        "request:tg:text-completion:default:default",
    ]);
    assert!(ok);
    assert_eq!(
        out.trim(),
        "persistent://tg/request/text-completion:default:default"
    );
    let (ok, out, _) = sluice(&[
        "topics",
        "resolve",
        "--topic-mapping",
        "trustgraph",
        "request:tg:text-completion:default:default",
        "flow:tg:x",
    ]);
    assert!(ok);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "non-persistent://tg/request/text-completion:default:default",
            "persistent://tg/flow/x"
        ]
    );
}

#[test]
fn a_bad_topic_name_is_a_clear_error_and_a_failing_exit() {
    let (ok, _, err) = sluice(&["topics", "resolve", "nonsense"]);
    assert!(!ok);
    assert!(err.contains("class:topicspace:topic"), "{err}");
}

#[test]
fn ensure_namespaces_creates_them_on_the_real_broker_idempotently() {
    let admin =
        std::env::var("PULSAR_ADMIN_URL").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let tenant = format!("sluice-cli-{}", std::process::id());
    let names = [
        format!("request:{tenant}:a"),
        format!("response:{tenant}:a"),
    ];
    for _ in 0..2 {
        let (ok, out, err) = sluice(&[
            "pulsar",
            "ensure-namespaces",
            "--pulsar-admin-url",
            &admin,
            &names[0],
            &names[1],
        ]);
        assert!(ok, "{err}");
        assert_eq!(
            out.lines().collect::<Vec<_>>(),
            [format!("{tenant}/request"), format!("{tenant}/response")]
        );
    }
    let listed = Command::new("curl")
        .args(["-sf", &format!("{admin}/admin/v2/namespaces/{tenant}")])
        .output()
        .unwrap();
    let listed = String::from_utf8(listed.stdout).unwrap();
    assert!(listed.contains(&format!("{tenant}/request")), "{listed}");
}

#[test]
fn an_unreachable_admin_url_fails_with_a_message_not_a_panic() {
    let (ok, _, err) = sluice(&[
        "pulsar",
        "ensure-namespaces",
        "--pulsar-admin-url",
        "http://127.0.0.1:1",
        "request:tg:x",
    ]);
    assert!(!ok);
    assert!(err.starts_with("sluice: "), "{err}");
    assert!(err.contains("listing clusters"), "{err}");
}

/// The binary's answers to its command line, now that parsing is the library's and exiting
/// the binary's: help and version on stdout with status 0, a bad option and a bad `--config`
/// file on stderr with status 2, before anything starts.
#[test]
fn help_version_and_refused_command_lines_exit_as_documented() {
    let (code, out, _) = run(&["--help"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("text-completion"), "{out}");
    let (code, out, _) = run(&["--version"]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with("sluice "), "{out}");
    let (code, _, err) = run(&["text-completion", "--no-such-option"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--no-such-option"), "{err}");
    let missing = std::env::temp_dir().join(format!("sluice-missing-{}.toml", std::process::id()));
    let (code, _, err) = run(&["prompt", "--config", missing.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(
        err.starts_with("sluice: cannot read the config file"),
        "{err}"
    );
}

/// `sluice ARGS` with `vars` set, as a process that must stop by itself: exit success and
/// stderr.
fn run_with(args: &[&str], vars: &[(&str, &str)]) -> (bool, String) {
    let out = common::run_blocking(
        args,
        vars,
        &["SLUICE_CONFIG", "OPENAI_API_KEY", "OPENAI_API_KEY_FILE"],
    );
    (out.ok(), out.stderr)
}

/// A vendor's key is sent only to the vendor: OPENAI_API_KEY set and a base URL of another
/// host stop the processor at start-up, saying how to name the key, never showing it (the
/// provider is built before the bus is connected, so nothing else is needed).
#[test]
fn a_vendors_key_is_not_sent_to_another_host() {
    let (ok, err) = run_with(
        &[
            "text-completion",
            "--provider",
            "openai",
            "--base-url",
            "http://127.0.0.1:9/v1?token=url-secret",
        ],
        &[("OPENAI_API_KEY", "sk-vendor-secret")],
    );
    assert!(!ok);
    assert!(
        err.contains("OPENAI_API_KEY is set")
            && err.contains("127.0.0.1")
            && err.contains("--api-key-env OPENAI_API_KEY"),
        "{err}"
    );
    for hidden in ["sk-vendor-secret", "url-secret"] {
        assert!(!err.contains(hidden), "{err}");
    }
}

/// A setting of another provider is refused wherever it comes from: a flag, its variable, the
/// `--config` file; the message names the setting and the provider.
#[test]
fn a_setting_of_another_provider_is_refused_from_a_flag_a_variable_or_the_file() {
    let says = "`num-ctx` (--num-ctx, SLUICE_NUM_CTX) does not apply to provider anthropic";
    let base = ["text-completion", "--provider", "anthropic"];
    let (ok, err) = run_with(&[&base[..], &["--num-ctx", "8192"]].concat(), &[]);
    assert!(!ok && err.contains(says), "{err}");
    let (ok, err) = run_with(&base, &[("SLUICE_NUM_CTX", "8192")]);
    assert!(!ok && err.contains(says), "{err}");
    let file = std::env::temp_dir().join(format!("sluice-tc-{}.toml", std::process::id()));
    std::fs::write(&file, "provider = \"anthropic\"\nnum-ctx = 8192\n").unwrap();
    let (ok, err) = run_with(
        &["text-completion", "--config", file.to_str().unwrap()],
        &[],
    );
    std::fs::remove_file(&file).unwrap();
    assert!(!ok && err.contains(says), "{err}");
}

/// An option's variable set to "" reads as unset, as Kubernetes and compose set optional
/// ones: `SLUICE_PULSAR_TLS_CA_FILE=` once stopped every command with a usage error.
#[test]
fn an_empty_variable_reads_as_unset() {
    let (ok, err) = run_with(
        &["topics", "resolve", "request:tg:text-completion"],
        &[
            ("SLUICE_PULSAR_TLS_CA_FILE", ""),
            ("SLUICE_TOPIC_MAPPING", ""),
        ],
    );
    assert!(ok, "{err}");
}
