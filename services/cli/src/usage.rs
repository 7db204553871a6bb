//! `sluice usage`: reads the usage ledger (docs/text-completion.md#usage-ledger) from its
//! start, as NDJSON records or as totals by key and model.

use std::{
    collections::BTreeMap, collections::HashSet, ops::ControlFlow, sync::Arc, time::Duration,
};

use clap::Args;
use serde::Serialize;
use sluice_runtime::{bus::Bus, ledger::read_records};

use crate::{
    common::{BusArgs, connect},
    text_completion::DEFAULT_USAGE_TOPIC,
};

/// `sluice usage` options.
#[derive(Args, Debug)]
pub struct UsageArgs {
    #[command(flatten)]
    bus: BusArgs,
    /// The ledger's topic.
    #[arg(long, env = "SLUICE_USAGE_TOPIC", default_value = DEFAULT_USAGE_TOPIC)]
    topic: String,
    /// Totals by key and model (requests, attempts, tokens, cost) instead of the records.
    #[arg(long)]
    summary: bool,
    /// Only the records of this API key's name.
    #[arg(long)]
    key: Option<String>,
    /// Only the records of attempts that ended at or after this time (milliseconds since
    /// the Unix epoch).
    #[arg(long)]
    since_ms: Option<u64>,
    /// The ledger has been read to its end once no record came for this many milliseconds.
    #[arg(long, default_value_t = 1500)]
    quiet_ms: u64,
}

/// One line of `--summary`.
#[derive(Debug, Default, Serialize)]
struct Total {
    key: Option<String>,
    model: Option<String>,
    requests: u64,
    attempts: u64,
    input_tokens: u64,
    output_tokens: u64,
    /// Attempts whose output was counted from chunks.
    estimated: u64,
    cost: Option<f64>,
}

/// The totals by key and model, with the request ids counted in each.
type Totals = BTreeMap<(Option<String>, Option<String>), (Total, HashSet<String>)>;

/// Reads the ledger to its end and prints it.
pub async fn run(args: UsageArgs) -> Result<(), String> {
    let bus: Arc<dyn Bus> = connect(&args.bus, &[]).await?;
    if !bus.keeps_messages() {
        return Err("the usage ledger is read from Pulsar: give --pulsar-url".into());
    }
    let quiet = Duration::from_millis(args.quiet_ms.max(1));
    let mut seen = HashSet::new();
    let mut totals = Totals::new();
    let mut out = std::io::stdout();
    let mut failed = None;
    // Non-durable, from the first message: reading leaves nothing behind on the broker.
    let skipped = read_records(bus.as_ref(), &args.topic, quiet, |record| {
        // A record stored twice (a publish whose receipt was lost) counts once.
        if !seen.insert(record.attempt.clone())
            || args
                .key
                .as_ref()
                .is_some_and(|k| record.key.as_ref() != Some(k))
            || args.since_ms.is_some_and(|t| record.ended_at_ms < t)
        {
            return ControlFlow::Continue(());
        }
        if args.summary {
            let (total, requests) = totals
                .entry((record.key.clone(), record.model.clone()))
                .or_default();
            total.attempts += 1;
            if requests.insert(record.id.clone()) {
                total.requests += 1;
            }
            total.input_tokens = total.input_tokens.saturating_add(record.input_tokens);
            total.output_tokens = total.output_tokens.saturating_add(record.output_tokens);
            total.estimated += u64::from(record.estimated);
            if let Some(c) = record.cost {
                total.cost = Some(total.cost.unwrap_or(0.0) + c);
            }
        } else if let Err(e) = line(&mut out, &record) {
            // Nobody reads the output any more (`sluice usage | head`): stop reading.
            failed = Some(e);
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    })
    .await
    .map_err(|e| format!("reading {}: {e}", args.topic))?;
    if let Some(e) = failed {
        return Err(e);
    }
    for ((key, model), (mut total, _)) in totals {
        total.key = key;
        total.model = model;
        line(&mut out, &total)?;
    }
    if skipped > 0 {
        eprintln!(
            "sluice: {skipped} message(s) on {} are not usage records",
            args.topic
        );
    }
    Ok(())
}

fn line(out: &mut impl std::io::Write, value: &impl Serialize) -> Result<(), String> {
    let text = serde_json::to_string(value).map_err(|e| e.to_string())?;
    writeln!(out, "{text}").map_err(|e| e.to_string())
}
