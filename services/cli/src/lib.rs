//! `sluice`, the one binary, as a library: its command-line definition ([`command`]), the
//! parser the binary runs ([`parse`], `--config` included) and the commands themselves
//! ([`Invocation::run`]). The binary adds only its allocator and heap probe; the fuzz target
//! of operators' config files parses through this same definition. The commands:
//!
//! - `sluice serve`: the embedded default, the text-completion, prompt and agent processors
//!   and the gateway in one process on the in-process bus (or Pulsar);
//! - `sluice text-completion`: the text-completion processor;
//! - `sluice prompt`: the prompt processor;
//! - `sluice agent`: the agent processor;
//! - `sluice gateway`: the HTTP gateway (REST, NDJSON, SSE, TrustGraph's WebSocket);
//! - `sluice invoke llm|prompt|agent`: call a gateway and print the answer as it streams;
//! - `sluice topics resolve NAME...`: the Pulsar topic URL of a TrustGraph-style name;
//! - `sluice pulsar ensure-namespaces NAME...`: create the tenants and namespaces of those
//!   topics (Pulsar creates topics on first use, not namespaces), as a deploy-time step.
//!
//! Secrets (the Pulsar token) come from `SLUICE_PULSAR_TOKEN` or the file named by
//! `SLUICE_PULSAR_TOKEN_FILE`, never from the command line.

mod agent;
mod common;
mod config;
mod gateway;
mod invoke;
mod prompt;
mod serve;
mod text_completion;
mod usage;

use std::{ffi::OsString, process::ExitCode};

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use sluice_runtime::{
    bus::admin::NamespacePolicy,
    telemetry::{LogFormat, init_tracing},
    trace::{OtlpConfig, init_otlp},
};
use sluice_schema::{TopicMapping, TopicName};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Streaming LLM microservices on Apache Pulsar"
)]
struct Cli {
    /// Log format: text or json.
    #[arg(long, global = true, default_value = "text", env = "SLUICE_LOG_FORMAT", value_parser = parse_log_format)]
    log_format: LogFormat,
    /// Export spans over OTLP/HTTP (protobuf) to this collector base URL, e.g.
    /// http://otel-collector:4318 (spans go to /v1/traces). Off when unset. Collector
    /// headers, such as an API key, come from OTEL_EXPORTER_OTLP_HEADERS.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// The service.name exported spans carry [default: sluice-<command>].
    #[arg(long, global = true, env = "OTEL_SERVICE_NAME")]
    otlp_service_name: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Everything in one process: the text-completion, prompt and agent processors and the
    /// gateway, on the in-process bus unless --pulsar-url is given.
    Serve(Box<serve::ServeArgs>),
    /// The text-completion processor.
    TextCompletion(Box<text_completion::TextCompletionArgs>),
    /// The agent processor: a streaming ReAct loop with tools.
    Agent(Box<agent::AgentCommand>),
    /// The prompt processor: templates, text/json/jsonl answers.
    Prompt(Box<prompt::PromptCommand>),
    /// The HTTP gateway in front of the processors.
    Gateway(Box<gateway::GatewayCommand>),
    /// Calls a gateway: `invoke llm SYSTEM PROMPT`, `invoke prompt TEMPLATE k=v...`,
    /// `invoke agent -q QUESTION`.
    Invoke(Box<invoke::InvokeArgs>),
    /// Topic names.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// Pulsar administration sluice needs.
    Pulsar {
        #[command(subcommand)]
        command: PulsarCommand,
    },
    /// Reads the usage ledger from its start: the records as NDJSON, or `--summary` totals
    /// by key and model (docs/text-completion.md#usage-ledger).
    Usage(Box<usage::UsageArgs>),
    /// API keys for the gateway's keys file (docs/gateway.md#api-keys).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Makes a new random key: prints the key (give it to the caller; it is not kept
    /// anywhere) and the `sha256 = "..."` line for the keys file.
    New,
    /// Reads a key from standard input (never from the command line, where other users and
    /// the shell's history would see it) and prints its `sha256 = "..."` line.
    Hash,
}

#[derive(Subcommand)]
enum TopicsCommand {
    /// Prints the Pulsar topic URL of each `class:topicspace:topic` name.
    Resolve {
        #[command(flatten)]
        mapping: MappingArgs,
        /// Topic names, e.g. request:tg:text-completion.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Subcommand)]
enum PulsarCommand {
    /// Creates the tenant and namespace of each topic if missing (idempotent).
    EnsureNamespaces {
        /// Pulsar admin URL.
        #[arg(
            long,
            env = "SLUICE_PULSAR_ADMIN_URL",
            default_value = "http://127.0.0.1:8080"
        )]
        pulsar_admin_url: String,
        /// Send the Pulsar token to an `http://` admin URL beyond loopback (refused
        /// otherwise: docs/security.md).
        #[arg(long, env = "SLUICE_ALLOW_PLAINTEXT_CREDENTIALS")]
        allow_plaintext_credentials: bool,
        /// Expire response subscriptions of client instances that went away without
        /// unsubscribing after this many minutes (0 = never).
        #[arg(long, default_value_t = 60)]
        subscription_expiration_minutes: u32,
        /// Keep response records this many minutes after they were read, so that a stream
        /// can be resumed (the gateway's --resume-window-secs must stay within it); set on the
        /// `response` namespaces only (0 = Pulsar's default, nothing kept once read).
        #[arg(long, default_value_t = 60)]
        response_retention_minutes: u32,
        /// The size bound of that retention, in MiB per response topic.
        #[arg(long, default_value_t = 1024)]
        response_retention_mb: u32,
        /// Topic names (logical or URLs) whose namespaces to create.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Args)]
struct MappingArgs {
    /// How topic classes map to persistence: `durable` (every topic persistent; no request
    /// or response is lost) or `trustgraph` (TrustGraph's non-persistent request/response).
    #[arg(long, env = "SLUICE_TOPIC_MAPPING", default_value = "durable")]
    topic_mapping: TopicMapping,
}

fn parse_log_format(s: &str) -> Result<LogFormat, String> {
    match s {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        other => Err(format!(
            "unknown log format {other:?}: expected text or json"
        )),
    }
}

fn parse_names(names: &[String]) -> Result<Vec<TopicName>, String> {
    names
        .iter()
        .map(|n| n.parse::<TopicName>().map_err(|e| e.to_string()))
        .collect()
}

/// A parsed `sluice` command line, ready to run.
pub struct Invocation {
    cli: Cli,
}

/// Why a command line was refused.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// clap's own: an unknown or invalid option, or `--help`/`--version` (clap reports those
    /// as errors too; `clap::Error::exit` prints them and exits with status 0).
    #[error(transparent)]
    Args(#[from] clap::Error),
    /// The `--config` file could not be read or does not fit the command.
    #[error("{0}")]
    Config(String),
}

/// The whole `sluice` command-line definition (every subcommand and option), as the binary
/// parses it.
pub fn command() -> clap::Command {
    // Later occurrences of an option override earlier ones, so that the command line wins
    // over the values `--config` splices in before it.
    empty_env_unset(Cli::command().args_override_self(true), &|var| {
        std::env::var_os(var)
    })
}

/// `command` with every option whose environment variable is set to the empty string reading
/// as if the variable were unset (its default, or the `--config` file's value, applies):
/// Kubernetes and compose set optional variables to `""`, which clap would otherwise take as
/// a value (an empty path, an empty number) and refuse. `lookup` reads a variable.
fn empty_env_unset(
    command: clap::Command,
    lookup: &dyn Fn(&std::ffi::OsStr) -> Option<OsString>,
) -> clap::Command {
    command
        .mut_args(|arg| {
            let empty = arg
                .get_env()
                .is_some_and(|var| lookup(var).is_some_and(|v| v.is_empty()));
            if empty {
                arg.env(None::<&'static str>)
            } else {
                arg
            }
        })
        .mut_subcommands(|sub| empty_env_unset(sub, lookup))
}

/// An environment variable the CLI reads itself (not through an option), `None` when unset
/// or set to the empty string, as for options (see [`command`]).
pub(crate) fn env_path(var: &str) -> Option<std::path::PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
}

/// Parses `args` (the program name first) as the binary does: the `--config` file (or
/// SLUICE_CONFIG) spliced in after the subcommand, then every option validated by clap.
/// Nothing is run and nothing exits.
pub fn parse(args: Vec<OsString>) -> Result<Invocation, ParseError> {
    let command = command();
    let args = config::expand(args, &command).map_err(ParseError::Config)?;
    let matches = command.try_get_matches_from(args)?;
    Ok(Invocation {
        cli: Cli::from_arg_matches(&matches)?,
    })
}

impl Invocation {
    /// Runs the command until it ends: logging (and OTLP export when configured) set up
    /// first, then the service; `invoke` logs nothing unless RUST_LOG asks.
    pub async fn run(self) -> ExitCode {
        let cli = self.cli;
        if let Command::Invoke(args) = cli.command {
            // `invoke` is a client: its output is the answer, so no log lines unless asked for.
            if std::env::var_os("RUST_LOG").is_some() {
                init_tracing(cli.log_format);
            }
            return match invoke::run(*args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("sluice: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        if let Command::Usage(args) = cli.command {
            // Its output is the ledger: no log lines unless asked for.
            if std::env::var_os("RUST_LOG").is_some() {
                init_tracing(cli.log_format);
            }
            return match usage::run(*args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("sluice: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        init_tracing(cli.log_format);
        let otlp = match &cli.otlp_endpoint {
            Some(endpoint) if !endpoint.is_empty() => {
                let config = OtlpConfig {
                    endpoint: endpoint.clone(),
                    service_name: cli
                        .otlp_service_name
                        .clone()
                        .unwrap_or_else(|| format!("sluice-{}", cli.command.name())),
                    timeout: std::time::Duration::from_secs(10),
                };
                match init_otlp(&config) {
                    Ok(guard) => {
                        tracing::info!(service = %config.service_name, "exporting spans over OTLP");
                        Some(guard)
                    }
                    Err(e) => {
                        eprintln!("sluice: {e}");
                        return ExitCode::from(2);
                    }
                }
            }
            _ => None,
        };
        let result = run(cli.command).await;
        if let Some(guard) = otlp {
            // The last requests' spans: sent before exit, for at most a few seconds.
            guard.shutdown().await;
        }
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice: {e}");
                ExitCode::FAILURE
            }
        }
    }
}

impl Command {
    /// The subcommand's name, for the default `service.name`.
    fn name(&self) -> &'static str {
        match self {
            Command::Serve(_) => "serve",
            Command::TextCompletion(_) => "text-completion",
            Command::Agent(_) => "agent",
            Command::Prompt(_) => "prompt",
            Command::Gateway(_) => "gateway",
            Command::Invoke(_) => "invoke",
            Command::Topics { .. } => "topics",
            Command::Pulsar { .. } => "pulsar",
            Command::Keys { .. } => "keys",
            Command::Usage(_) => "usage",
        }
    }
}

fn keys(command: KeysCommand) -> Result<(), String> {
    use sluice_gateway::keys::hash_hex;
    match command {
        KeysCommand::New => {
            // 244 random bits from the system's generator (uuid's v4).
            let key = format!(
                "sk-sluice-{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            );
            println!("{key}");
            println!("sha256 = \"{}\"", hash_hex(&key));
        }
        KeysCommand::Hash => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| format!("cannot read the key from standard input: {e}"))?;
            let key = line.trim_end_matches(['\r', '\n']);
            if key.is_empty() {
                return Err("no key on standard input".into());
            }
            println!("sha256 = \"{}\"", hash_hex(key));
        }
    }
    Ok(())
}

async fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Serve(args) => serve::run(*args).await,
        Command::TextCompletion(args) => text_completion::run(*args).await,
        Command::Gateway(args) => gateway::run(*args).await,
        Command::Prompt(args) => prompt::run(*args).await,
        Command::Agent(args) => agent::run(*args).await,
        Command::Invoke(_) | Command::Usage(_) => Ok(()),
        Command::Keys { command } => keys(command),
        Command::Topics {
            command: TopicsCommand::Resolve { mapping, names },
        } => {
            for name in parse_names(&names)? {
                println!("{}", name.to_pulsar(mapping.topic_mapping));
            }
            Ok(())
        }
        Command::Pulsar {
            command:
                PulsarCommand::EnsureNamespaces {
                    pulsar_admin_url,
                    allow_plaintext_credentials,
                    subscription_expiration_minutes,
                    response_retention_minutes,
                    response_retention_mb,
                    names,
                },
        } => {
            let ca_file = env_path("SLUICE_PULSAR_TLS_CA_FILE");
            let admin = common::pulsar_admin(
                &pulsar_admin_url,
                ca_file.as_deref(),
                allow_plaintext_credentials,
            )?;
            let mut namespaces: Vec<String> = parse_names(&names)?
                .iter()
                .map(|n| {
                    n.namespace()
                        .ok_or_else(|| format!("{n} names no tenant/namespace"))
                })
                .collect::<Result<_, _>>()?;
            namespaces.sort();
            namespaces.dedup();
            for ns in namespaces {
                let responses = ns.ends_with("/response");
                let policy = NamespacePolicy {
                    subscription_expiration_minutes,
                    retention_minutes: if responses {
                        response_retention_minutes
                    } else {
                        0
                    },
                    retention_mb: response_retention_mb,
                };
                admin
                    .ensure_namespace(&ns, policy)
                    .await
                    .map_err(|e| e.to_string())?;
                println!("{ns}");
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::*;

    /// Every environment variable an option of `command` (or of its subcommands) reads.
    fn variables(command: &clap::Command, into: &mut Vec<String>) {
        for arg in command.get_arguments() {
            if let Some(var) = arg.get_env() {
                into.push(var.to_string_lossy().into_owned());
            }
        }
        for sub in command.get_subcommands() {
            variables(sub, into);
        }
    }

    /// Each subcommand's shortest command line that parses.
    const COMMAND_LINES: &[&[&str]] = &[
        &["serve"],
        &["text-completion"],
        &["prompt"],
        &["agent"],
        &["gateway"],
        &["invoke", "llm", "system", "prompt"],
        &["usage"],
        &["topics", "resolve", "request:tg:x"],
        &["pulsar", "ensure-namespaces", "request:tg:x"],
        &["keys", "new"],
    ];

    /// A variable set to "" loses its option's variable; one with a value keeps it.
    #[test]
    fn an_empty_variable_is_dropped_from_its_option() {
        let lookup = |value: &'static str| move |_: &OsStr| Some(OsString::from(value));
        let mut kept = Vec::new();
        variables(&empty_env_unset(Cli::command(), &lookup("x")), &mut kept);
        assert!(kept.len() > 40, "every option's variable: {kept:?}");
        assert!(kept.contains(&"SLUICE_PULSAR_TLS_CA_FILE".to_owned()));
        let mut left = Vec::new();
        variables(&empty_env_unset(Cli::command(), &lookup("")), &mut left);
        assert_eq!(left, Vec::<String>::new());
    }

    /// With every variable of every option set to "" (as Kubernetes and compose set optional
    /// ones), each subcommand parses, at its defaults: run in a child process of this test
    /// binary, since clap reads the environment when the command is defined.
    #[test]
    fn every_option_reads_an_empty_variable_as_unset() {
        let mut vars = Vec::new();
        variables(&Cli::command(), &mut vars);
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child.args([
            "--ignored",
            "--exact",
            "tests::parses_at_defaults_with_every_variable_empty",
        ]);
        for var in &vars {
            child.env(var, "");
        }
        // The config file's variable too, which `--config` expansion reads itself.
        child.env("SLUICE_CONFIG", "");
        let out = child.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The child of [`every_option_reads_an_empty_variable_as_unset`]: its environment has
    /// every option's variable set to "".
    #[test]
    #[ignore = "run by every_option_reads_an_empty_variable_as_unset with every variable empty"]
    fn parses_at_defaults_with_every_variable_empty() {
        assert_eq!(
            std::env::var_os("SLUICE_PULSAR_TLS_CA_FILE").as_deref(),
            Some(OsStr::new("")),
            "run with every option's variable set to \"\""
        );
        for line in COMMAND_LINES {
            let argv = std::iter::once("sluice").chain(line.iter().copied());
            let parsed = parse(argv.map(OsString::from).collect());
            let invocation = parsed.unwrap_or_else(|e| panic!("{line:?}: {e}"));
            if let Command::Serve(serve) = &invocation.cli.command {
                assert_eq!(serve.pulsar_tls_ca_file, None);
                assert_eq!(serve.metrics_addr.to_string(), "127.0.0.1:8000");
            }
        }
    }
}
