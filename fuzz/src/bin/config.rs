//! Files an operator writes: the `--config` TOML (through `sluice_cli::parse`, the parser the
//! binary runs, with its real command-line definition), prompt template files (loaded, then
//! each template rendered) and agent tool files.
//! Property: no panic; a file is accepted or refused with a message.

use std::{collections::BTreeMap, ffi::OsString, io::Write};

/// The subcommands that take `--config`; the input's split byte picks one.
const SUBCOMMANDS: [&str; 5] = ["text-completion", "prompt", "agent", "gateway", "serve"];

/// The file as `sluice SUBCOMMAND --config FILE`, parsed by the binary's own parser (its
/// command-line definition, the file spliced in, clap's validation); nothing runs.
fn toml_file(text: &[u8], split: u8) {
    let path = std::env::temp_dir().join(format!("sluice-fuzz-config-{}.toml", std::process::id()));
    let written = std::fs::File::create(&path).and_then(|mut f| f.write_all(text));
    if written.is_err() {
        return;
    }
    let sub = SUBCOMMANDS[usize::from(split) % SUBCOMMANDS.len()];
    let argv: Vec<OsString> = vec!["sluice".into(), sub.into(), "--config".into(), path.into()];
    let _ = sluice_cli::parse(argv);
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
            0 => toml_file(input.body, input.split),
            1 => templates(&String::from_utf8_lossy(input.body)),
            _ => {
                let _ = sluice_agent::tools::parse(&String::from_utf8_lossy(input.body));
            }
        }
    });
}
