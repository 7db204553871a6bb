//! `--config FILE` for `sluice serve` and the processor subcommands (`text-completion`,
//! `prompt`, `agent`, `gateway`): a TOML file whose keys are that command's long option
//! names (`model = "smollm2"`, `base-url = "http://..."`, `no-stream-usage = true`). A
//! container mounts one such file per processor (a Kubernetes ConfigMap, a compose volume).
//!
//! The file is turned into option arguments placed before the ones on the command line, so
//! clap parses everything once, with one set of validations and error messages. Precedence:
//! command line, then environment variables, then the file (a key whose option has an
//! environment variable that is set is skipped), then defaults. Secrets have no options, so
//! they cannot be put in the file: they come from the environment or their `_FILE`.

use std::{ffi::OsString, path::Path};

use clap::Command;

/// The option arguments the file at `path` stands for, for subcommand `command` of `root`.
/// Keys may also be `root`'s global options (`log-format`, `otlp-endpoint`).
pub fn file_args(command: &Command, root: &Command, path: &Path) -> Result<Vec<OsString>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the config file {}: {e}", path.display()))?;
    // The parser's message and position only: its full display quotes the offending line.
    let table: toml::Table = toml::from_str(&text).map_err(|e: toml::de::Error| {
        let at = e
            .span()
            .map(|s| format!(" at line {}", text[..s.start].matches('\n').count() + 1))
            .unwrap_or_default();
        format!(
            "the config file {} is not valid TOML{at}: {}",
            path.display(),
            e.message()
        )
    })?;
    let mut out = Vec::new();
    for (key, value) in table {
        let arg = command
            .get_arguments()
            .chain(root.get_arguments().filter(|a| a.is_global_set()))
            .find(|a| a.get_long() == Some(key.as_str()) && key != "config")
            .ok_or_else(|| {
                format!(
                    "the config file {} has an unknown key {key:?}; keys are the long options of `sluice {}` (see --help)",
                    path.display(),
                    command.get_name()
                )
            })?;
        // A variable set to "" reads as unset (see `crate::command`): the file's value applies.
        if arg
            .get_env()
            .is_some_and(|var| std::env::var_os(var).is_some_and(|v| !v.is_empty()))
        {
            continue;
        }
        let values = match value {
            toml::Value::Array(items) => items,
            other => vec![other],
        };
        let takes_value = arg.get_action().takes_values();
        for v in values {
            let text = match v {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) if !takes_value => {
                    if b {
                        out.push(OsString::from(format!("--{key}")));
                    }
                    continue;
                }
                toml::Value::Boolean(b) => b.to_string(),
                other => {
                    return Err(format!(
                        "the config file {}: {key} must be a string, number or boolean, not {}",
                        path.display(),
                        other.type_str()
                    ));
                }
            };
            out.push(OsString::from(format!("--{key}={text}")));
        }
    }
    Ok(out)
}

/// `args` with the config file of a command line whose subcommand takes `--config` (from
/// `--config` or SLUICE_CONFIG) spliced in after the subcommand name.
pub fn expand(args: Vec<OsString>, root: &Command) -> Result<Vec<OsString>, String> {
    let Some(pos) = subcommand_position(&args, root) else {
        return Ok(args);
    };
    let Some(sub) = args[pos]
        .to_str()
        .and_then(|name| root.find_subcommand(name))
        .filter(|sub| sub.get_arguments().any(|a| a.get_long() == Some("config")))
    else {
        return Ok(args);
    };
    let mut path = crate::env_path("SLUICE_CONFIG");
    let mut iter = args[pos + 1..].iter();
    while let Some(a) = iter.next() {
        let a = a.to_string_lossy();
        if a == "--config" {
            path = iter.next().map(std::path::PathBuf::from);
        } else if let Some(p) = a.strip_prefix("--config=") {
            path = Some(p.into());
        }
    }
    let Some(path) = path else {
        return Ok(args);
    };
    let extra = file_args(sub, root, &path)?;
    let mut out = args[..=pos].to_vec();
    out.extend(extra);
    out.extend_from_slice(&args[pos + 1..]);
    Ok(out)
}

/// Where the subcommand name is: the first argument after the program name that is not a
/// global option or its value (`sluice --log-format json prompt ...`).
fn subcommand_position(args: &[OsString], root: &Command) -> Option<usize> {
    let mut i = 1;
    while i < args.len() {
        let a = args[i].to_string_lossy();
        if let Some(long) = a.strip_prefix("--") {
            let takes_value = root
                .get_arguments()
                .find(|arg| arg.get_long() == Some(long))
                .is_some_and(|arg| arg.get_action().takes_values());
            i += if takes_value { 2 } else { 1 };
        } else if a.starts_with('-') {
            i += 1;
        } else {
            return Some(i);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use clap::{Arg, ArgAction};

    use super::*;

    fn command() -> Command {
        Command::new("sluice").subcommand(
            Command::new("serve")
                .args_override_self(true)
                .arg(Arg::new("config").long("config"))
                .arg(Arg::new("model").long("model"))
                .arg(Arg::new("temperature").long("temperature"))
                .arg(
                    Arg::new("flag")
                        .long("no-stream-usage")
                        .action(ArgAction::SetTrue),
                )
                .arg(
                    Arg::new("flow")
                        .long("flow")
                        .env("SLUICE_TEST_CONFIG_FLOW_UNSET_A1B2"),
                ),
        )
    }

    #[test]
    fn the_file_becomes_arguments_the_command_line_overrides() {
        let dir = std::env::temp_dir().join(format!("sluice-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("serve.toml");
        std::fs::write(
            &file,
            "model = \"from-file\"\ntemperature = 0.5\nno-stream-usage = true\nflow = \"f\"\n",
        )
        .unwrap();
        let args: Vec<OsString> = [
            "sluice",
            "serve",
            "--config",
            file.to_str().unwrap(),
            "--model",
            "from-argv",
        ]
        .into_iter()
        .map(OsString::from)
        .collect();
        let root = command()
            .arg(Arg::new("x").long("x"))
            .arg(Arg::new("log-format").long("log-format").global(true));
        std::fs::write(
            &file,
            "model = \"from-file\"\ntemperature = 0.5\nno-stream-usage = true\nflow = \"f\"\nlog-format = \"json\"\n",
        )
        .unwrap();
        let expanded = expand(args, &root).unwrap();
        let m = root.try_get_matches_from(expanded).unwrap();
        let m = m.subcommand_matches("serve").unwrap();
        assert_eq!(m.get_one::<String>("model").unwrap(), "from-argv");
        assert_eq!(m.get_one::<String>("temperature").unwrap(), "0.5");
        assert!(m.get_flag("flag"));
        assert_eq!(m.get_one::<String>("flow").unwrap(), "f");
        // A global option in the file applies too.
        assert_eq!(m.get_one::<String>("log-format").unwrap(), "json");

        std::fs::write(&file, "api-key = \"nope\"\n").unwrap();
        let root = command();
        let serve = root.find_subcommand("serve").unwrap();
        let err = file_args(serve, &root, &file).unwrap_err();
        assert!(err.contains("unknown key \"api-key\""), "{err}");
        assert!(!err.contains("nope"), "values are not echoed: {err}");
        std::fs::write(&file, "model = [").unwrap();
        assert!(file_args(serve, &root, &file).is_err());
    }

    #[test]
    fn only_a_subcommand_with_a_config_option_reads_the_file() {
        let dir = std::env::temp_dir().join(format!("sluice-config-sub-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("prompt.toml");
        std::fs::write(&file, "model = \"from-file\"\n").unwrap();
        let path = file.to_str().unwrap();
        let with_config = |name: &'static str| {
            Command::new(name)
                .arg(Arg::new("config").long("config"))
                .arg(Arg::new("model").long("model"))
        };
        let root = Command::new("sluice")
            .arg(Arg::new("log-format").long("log-format").global(true))
            .subcommand(with_config("prompt"))
            .subcommand(
                Command::new("invoke")
                    .subcommand(Command::new("prompt").arg(Arg::new("rest").num_args(0..))),
            );
        let argv = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();

        // The subcommand is found after a global option and its value.
        let args = argv(&["sluice", "--log-format", "json", "prompt", "--config", path]);
        let expanded = expand(args, &root).unwrap();
        assert_eq!(
            expanded[4..],
            argv(&["--model=from-file", "--config", path])[..]
        );
        // `invoke prompt` names a template, not the prompt processor: nothing is spliced.
        let args = argv(&["sluice", "invoke", "prompt", "--config", path]);
        assert_eq!(expand(args.clone(), &root).unwrap(), args);
    }
}
