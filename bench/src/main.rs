//! sluice benchmarks. Figures are written to `bench/results/` and spliced into the docs
//! between `<!-- bench:NAME -->` markers; nothing here asserts on time.
//!
//! Every figure is reported beside a baseline measured in the same run, because these
//! machines are noisy: absolute numbers move from run to run, ratios much less.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod foundation;
mod gateway;
mod loss;
mod overhead;
mod pacing;
mod passthrough;
mod procs;
mod prompt;
mod report;
mod soak;
mod structured;
mod text_completion;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use sluice_tests::Broker;

use crate::{gateway::gateway_bench, report::splice, text_completion::text_completion_bench};

#[derive(Parser)]
#[command(about = "sluice benchmarks (results to bench/results and the docs' tables)")]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
    /// Where result files go.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// The documentation directory whose Markdown pages hold the results tables between
    /// `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` markers (skipped if missing).
    #[arg(long, default_value = "docs")]
    docs: PathBuf,
}

#[derive(Subcommand)]
enum Scenario {
    /// Text completion: time-to-first-token overhead, concurrent slow streams and RSS of a
    /// `sluice text-completion` process, tokens/s forwarded; against the fake OpenAI server.
    TextCompletion {
        /// Requests for the time-to-first-token comparison.
        #[arg(long, default_value_t = 500)]
        requests: u64,
        /// Concurrent slow-stream levels to try.
        #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
        streams: Vec<u64>,
    },
    /// The fallback layer (`--fallback`): time to first token through a fallback list
    /// against the provider called directly, and what a move to the backup adds.
    Fallback {
        /// Calls per row.
        #[arg(long, default_value_t = 500)]
        requests: u64,
    },
    /// Structured output on the local model: the JSON lines the LLM streaming contract's
    /// (docs/specs.md#the-structured-ndjson-contracts) classification gets wrong with and without
    /// `--structured-output native` (two `sluice serve`).
    Structured {
        /// Requests per mode.
        #[arg(long, default_value_t = 20)]
        rounds: u64,
        /// Most output tokens per answer.
        #[arg(long, default_value_t = 400)]
        max_tokens: u32,
    },
    /// The prompt jsonl path: a line's last token to its object record, objects/s; against
    /// text-completion called directly.
    Prompt {
        /// Answers (of 20 lines each) for the latency comparison.
        #[arg(long, default_value_t = 50)]
        requests: u64,
        /// Lines per answer for the throughput measure.
        #[arg(long, default_value_t = 200)]
        objects: u64,
    },
    /// The gateway: time to first token over HTTP through `sluice gateway`, the broker and a
    /// `sluice text-completion` process vs the fake provider called directly; requests/s at
    /// several concurrent HTTP streams.
    Gateway {
        /// Requests for the time-to-first-token comparison.
        #[arg(long, default_value_t = 500)]
        requests: u64,
        /// Concurrent HTTP stream levels for requests/s.
        #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
        concurrency: Vec<u64>,
        /// Requests per throughput level (a tenth of it at concurrency 1).
        #[arg(long, default_value_t = 5000)]
        throughput_requests: u64,
    },
    /// The loss model of TrustGraph's topic mapping: 51-record streams from a `sluice
    /// text-completion` process at several loads and with a stalled client, on non-persistent
    /// and on durable topics; what is lost, and how soon the client ends a request that lost
    /// records.
    Loss {
        /// Concurrent callers (and the processor's concurrency) per level.
        #[arg(long, value_delimiter = ',', default_value = "64,256,512")]
        concurrency: Vec<u64>,
        /// Requests per caller at each level.
        #[arg(long, default_value_t = 4)]
        per_caller: u64,
        /// How long the stalled client's process stops (seconds).
        #[arg(long, default_value_t = 3)]
        stall_secs: u64,
    },
    /// Pacing on TrustGraph's mapping (issue #28): a `sluice text-completion` process read by
    /// TrustGraph's own Python client, unpaced and paced, at each concurrency. Needs
    /// TG_FLOW_VENV (bench/run.sh sets it).
    Pacing {
        /// Concurrent callers (and the processor's concurrency) per level.
        #[arg(long, value_delimiter = ',', default_value = "64,512")]
        concurrency: Vec<u64>,
        /// Requests per caller at each level.
        #[arg(long, default_value_t = 2)]
        per_caller: u64,
    },
    /// The soak under chaos (issue #13.4): every processor kind as `sluice` processes on a
    /// broker of its own, mixed traffic, a replica killed every ~20 s, the broker restarted every
    /// 5 minutes, provider faults. Needs `target/release/sluice` next to this binary.
    Soak {
        /// How long traffic runs (minutes).
        #[arg(long, default_value_t = 30)]
        minutes: u64,
        /// Concurrent callers.
        #[arg(long, default_value_t = 12)]
        callers: usize,
        /// Seconds between broker restarts (on the cluster: between faults, each counted
        /// from the repair of the last; default 120 there). Other than 300 on the soak's own
        /// broker, the figures go to soak-restarts.md / soak-restarts-rss.csv and the docs'
        /// `soak-restarts` block, leaving the standard run's alone.
        #[arg(long, alias = "fault-every-secs")]
        restart_every_secs: Option<u64>,
        /// Run on the secured cluster (`deploy/pulsar/cluster.sh`, its `env` exported; run.sh
        /// starts it) with its faults: namespace unloads, broker and bookie SIGKILLs, broker
        /// restarts. Figures in soak-cluster.md / soak-cluster-rss.csv and the docs'
        /// `soak-cluster` block.
        #[arg(long)]
        cluster: bool,
    },
    /// What each gateway adds to the time to first token over calling the provider directly
    /// (issue #27): `sluice serve`, the gateway over the broker, LiteLLM's proxy (when
    /// BENCH_VENV has it) and TensorZero (when TENSORZERO_GATEWAY names it), one fake
    /// provider and one load driver, at each number of concurrent callers. BENCH_SERVE_BEFORE
    /// names another build's `sluice` binary to run beside this one's `sluice serve` (a
    /// change's before and after in one run; written as overhead-partial.*).
    Overhead {
        /// Concurrent caller levels.
        #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
        callers: Vec<u64>,
        /// Requests per target at one caller (interleaved request by request).
        #[arg(long, default_value_t = 400)]
        serial_requests: u64,
        /// Requests per target at each higher level.
        #[arg(long, default_value_t = 4000)]
        requests: u64,
        /// Only these targets besides the direct baseline (`pass-through`, `serve`, `broker`, `broker-per-delta`,
        /// `broker-paced`, `litellm`, `tensorzero`), e.g. to profile one of them under load.
        #[arg(long, value_delimiter = ',',
              value_parser = ["pass-through", "serve", "broker", "broker-per-delta", "broker-paced", "litellm", "tensorzero"])]
        only: Vec<String>,
        /// Milliseconds between the fake provider's tokens after the first (1 in the
        /// published figures; a model streaming 50 tokens/s is 20). Any other value writes
        /// overhead-partial.* as `--only` does.
        #[arg(long, default_value_t = 1)]
        token_gap_ms: u64,
    },
    /// The overhead scenario's floor, run as a process of its own by the scenario: a bare
    /// HTTP pass-through to `upstream` (see `passthrough.rs`).
    #[command(hide = true)]
    PassThrough {
        /// The provider's base URL.
        #[arg(long)]
        upstream: String,
    },
    /// The foundation: raw pulsar-rs round trip vs sluice runtime + client, throughput.
    Foundation {
        /// Sequential round trips per latency measurement.
        #[arg(long, default_value_t = 2000)]
        round_trips: u64,
        /// Requests per throughput measurement.
        #[arg(long, default_value_t = 20_000)]
        requests: u64,
    },
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if let Scenario::PassThrough { upstream } = cli.scenario {
        // A process of the overhead scenario's: no broker, no results.
        passthrough::serve(upstream).await;
        return;
    }
    let broker = Broker::from_env().await;
    std::fs::create_dir_all(&cli.out).unwrap();
    match cli.scenario {
        Scenario::TextCompletion { requests, streams } => {
            let md = text_completion_bench(&broker, requests, &streams).await;
            std::fs::write(cli.out.join("text-completion.md"), &md).unwrap();
            splice(&cli.docs, "text-completion", &md);
            println!("{md}");
        }
        Scenario::Fallback { requests } => {
            let md = text_completion::fallback_bench(requests).await;
            std::fs::write(cli.out.join("fallback.md"), &md).unwrap();
            splice(&cli.docs, "fallback", &md);
            println!("{md}");
        }
        Scenario::Structured { rounds, max_tokens } => {
            let (md, json) = structured::bench(rounds, max_tokens).await;
            std::fs::write(cli.out.join("structured.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("structured.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "structured", &md);
            println!("{md}");
        }
        Scenario::Prompt { requests, objects } => {
            let (md, json) = prompt::bench(&broker, requests, objects).await;
            std::fs::write(cli.out.join("prompt.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("prompt.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "prompt", &md);
            println!("{md}");
        }
        Scenario::Gateway {
            requests,
            concurrency,
            throughput_requests,
        } => {
            let (md, json) =
                gateway_bench(&broker, requests, &concurrency, throughput_requests).await;
            std::fs::write(cli.out.join("gateway.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("gateway.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "gateway", &md);
            println!("{md}");
        }
        Scenario::Loss {
            concurrency,
            per_caller,
            stall_secs,
        } => {
            let (md, json) = loss::bench(&broker, &concurrency, per_caller, stall_secs).await;
            std::fs::write(cli.out.join("loss.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("loss.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "loss", &md);
            println!("{md}");
        }
        Scenario::Pacing {
            concurrency,
            per_caller,
        } => {
            let (md, json) = pacing::bench(&broker, &concurrency, per_caller).await;
            std::fs::write(cli.out.join("pacing.md"), &md).unwrap();
            std::fs::write(
                cli.out.join("pacing.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            splice(&cli.docs, "pacing", &md);
            println!("{md}");
        }
        Scenario::Soak {
            minutes,
            callers,
            restart_every_secs,
            cluster,
        } => {
            soak::run(
                &cli.out,
                &cli.docs,
                minutes,
                callers,
                restart_every_secs,
                cluster,
            )
            .await
        }
        Scenario::Overhead {
            callers,
            serial_requests,
            requests,
            only,
            token_gap_ms,
        } => {
            overhead::bench(
                &broker,
                &cli.out,
                &cli.docs,
                overhead::Options {
                    levels: &callers,
                    serial_requests,
                    requests,
                    only: &only,
                    token_gap_ms,
                },
            )
            .await
        }
        // Served above, before the broker.
        Scenario::PassThrough { .. } => {}
        Scenario::Foundation {
            round_trips,
            requests,
        } => foundation::run(&broker, &cli.out, &cli.docs, round_trips, requests).await,
    }
}
