//! Files an operator writes: the `--config` TOML (through the CLI's own `config.rs`, compiled
//! in here), prompt template files (loaded, then each template rendered) and agent tool files.
//! Property: no panic; a file is accepted or refused with a message.

#[allow(dead_code, missing_docs)]
#[path = "../../../services/cli/src/config.rs"]
mod config;

use std::{collections::BTreeMap, io::Write};

use clap::{Arg, ArgAction, Command};

/// A root command shaped like `sluice`'s: a global option, and a subcommand with value,
/// repeated and flag options.
fn commands() -> (Command, Command) {
    let sub = Command::new("text-completion")
        .arg(Arg::new("config").long("config"))
        .arg(Arg::new("model").long("model"))
        .arg(Arg::new("base-url").long("base-url"))
        .arg(
            Arg::new("max-tokens")
                .long("max-tokens")
                .value_parser(clap::value_parser!(u32)),
        )
        .arg(
            Arg::new("temperature")
                .long("temperature")
                .value_parser(clap::value_parser!(f32)),
        )
        .arg(Arg::new("topic").long("topic").action(ArgAction::Append))
        .arg(
            Arg::new("no-stream-usage")
                .long("no-stream-usage")
                .action(ArgAction::SetTrue),
        );
    let root = Command::new("sluice")
        .arg(Arg::new("log-format").long("log-format").global(true))
        .subcommand(sub.clone());
    (sub, root)
}

fn toml_file(text: &[u8]) {
    let path = std::env::temp_dir().join(format!("sluice-fuzz-config-{}.toml", std::process::id()));
    let written = std::fs::File::create(&path).and_then(|mut f| f.write_all(text));
    if written.is_err() {
        return;
    }
    let (sub, root) = commands();
    if let Ok(args) = config::file_args(&sub, &root, &path) {
        let mut argv = vec![std::ffi::OsString::from("text-completion")];
        argv.extend(args);
        let _ = sub.try_get_matches_from(argv);
    }
}

fn templates(text: &str) {
    let Ok(set) = sluice_prompt::templates::TemplateSet::from_json(text, false) else {
        return;
    };
    let ids: Vec<String> = set.ids().map(str::to_owned).collect();
    let terms: BTreeMap<String, String> = [("text", "\"hello\""), ("question", "\"why?\"")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    for id in ids {
        let _ = set.render(&id, &terms);
    }
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        match input.selector % 3 {
            0 => toml_file(input.body),
            1 => templates(&String::from_utf8_lossy(input.body)),
            _ => {
                let _ = sluice_agent::tools::parse(&String::from_utf8_lossy(input.body));
            }
        }
    });
}
