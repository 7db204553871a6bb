//! `sluice text-completion`: the text-completion processor as a process.

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::Args;
use serde::Deserialize;
use sluice_runtime::{
    bus::{Bus, admin::PulsarAdmin},
    flows::run_flows_until_signalled,
    ledger::{Ledger, Prices},
    processor::run_until_signalled,
    telemetry::Telemetry,
};
use sluice_text_completion::{
    config::{ConfigError, ProviderConfig, ProviderOptions, ServiceConfig},
    fallback::FallbackSettings,
    flows::TextCompletionFlows,
    handler::TextCompletionService,
    retry::RetryPolicy,
};
use tracing::{info, warn};

use crate::common::{
    BusArgs, ConfigFileArgs, ConfigServiceArgs, ProcessorArgs, connect, processor_config,
    pulsar_admin,
};

/// `sluice text-completion` options.
#[derive(Args, Debug)]
pub struct TextCompletionArgs {
    #[command(flatten)]
    pub config: ConfigFileArgs,
    #[command(flatten)]
    bus: BusArgs,
    #[command(flatten)]
    processor: ProcessorArgs,
    #[command(flatten)]
    flows: ConfigServiceArgs,
    #[command(flatten)]
    llm: LlmArgs,
}

/// The provider and how to call it (shared by `text-completion` and `serve`).
#[derive(Args, Debug, Clone)]
pub struct LlmArgs {
    /// The provider and how to call it; which settings apply depends on the provider
    /// (docs/text-completion.md).
    #[command(flatten)]
    provider: ProviderOptions,
    /// Other models of the same provider a request may ask for by name (comma-separated);
    /// `list-models` and `GET /v1/models` list them after --model.
    #[arg(long, env = "SLUICE_EXTRA_MODELS", value_delimiter = ',')]
    extra_models: Vec<String>,
    /// How a call that fails before its first chunk is published is retried: a preset
    /// (`default`, `seed-000`, `seed-001`, `seed-002`), settings (`attempts=2,delay=2s,
    /// factor=1,max-delay=8s,jitter=0,on=connect+timeout+503,hints=false`) or a preset then
    /// settings. A request's or template's `retry` applies over this.
    #[arg(long, env = "SLUICE_RETRY", default_value = "default")]
    retry: String,
    /// Retries of a call that fails before its first chunk is published (the same as
    /// `--retry ...,attempts=N+1`; kept for existing deployments).
    #[arg(long)]
    max_retries: Option<u32>,
    /// A TOML file of providers to fall back on, tried in order after this one: `[[provider]]`
    /// tables with the provider options' names (`provider`, `model`, `base-url`, ...) and
    /// `key-env`, the variable holding that provider's key. A call moves to the next before
    /// its first token is published; see docs/text-completion.md.
    #[arg(long, env = "SLUICE_FALLBACK")]
    fallback: Option<PathBuf>,
    /// With --fallback: a streamed call whose provider gave no text this many milliseconds
    /// after it started moves to the next provider.
    #[arg(long, env = "SLUICE_FIRST_TOKEN_DEADLINE_MS")]
    first_token_deadline_ms: Option<u64>,
    /// With --fallback: a streamed call whose provider gave no text this many milliseconds
    /// after it started gets the next provider started beside it; the first to answer is
    /// kept and the other cancelled.
    #[arg(long, env = "SLUICE_HEDGE_AFTER_MS")]
    hedge_after_ms: Option<u64>,
    /// With --fallback: failures in a row that open a provider's circuit breaker (it is then
    /// skipped until --breaker-cooldown-secs have passed and a probe succeeds); 0 for none.
    #[arg(long, env = "SLUICE_BREAKER_FAILURES", default_value_t = 5)]
    breaker_failures: u32,
    /// With --fallback: seconds an open circuit breaker skips its provider before a probe.
    #[arg(long, env = "SLUICE_BREAKER_COOLDOWN_SECS", default_value_t = 30)]
    breaker_cooldown_secs: u64,
    #[command(flatten)]
    pub usage: UsageArgs,
}

/// The usage ledger (docs/text-completion.md#usage-ledger).
#[derive(Args, Debug, Clone)]
pub struct UsageArgs {
    /// The topic the usage ledger is written to, one record per attempt that called the
    /// provider [default: persistent://tg/response/usage]; `none` writes no ledger (and
    /// exports no usage metrics).
    #[arg(long, env = "SLUICE_USAGE_TOPIC")]
    usage_topic: Option<String>,
    /// A TOML price table for the ledger's `cost`: `[[price]]` tables of `model`, optional
    /// `provider`, and the `input` and `output` price of a million tokens.
    #[arg(long, env = "SLUICE_PRICES_FILE")]
    prices_file: Option<PathBuf>,
}

/// How long a usage topic keeps the ledger (90 days) when neither it nor its namespace keeps
/// it that long: set when the processor starts with an admin URL, never over a retention of
/// the topic's own.
const USAGE_RETENTION_MINUTES: u32 = 90 * 24 * 60;

impl UsageArgs {
    /// The ledger's topic; `None` when turned off.
    pub fn topic(&self) -> Option<String> {
        match self.usage_topic.as_deref() {
            Some("none") => None,
            Some(t) => Some(t.to_owned()),
            None => Some(DEFAULT_USAGE_TOPIC.to_owned()),
        }
    }

    /// The price table (empty without a file).
    pub fn prices(&self) -> Result<Prices, String> {
        let Some(path) = &self.prices_file else {
            return Ok(Prices::default());
        };
        let shown = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--prices-file {shown}: cannot read it: {e}"))?;
        let prices: Prices = toml::from_str(&text)
            .map_err(|e: toml::de::Error| format!("--prices-file {shown}: {}", e.message()))?;
        prices
            .validate()
            .map_err(|e| format!("--prices-file {shown}: {e}"))?;
        Ok(prices)
    }

    /// The ledger on `bus`, its metrics in `telemetry`'s registry. With an admin URL, a persistent topic
    /// without a retention of its own is given one (a topic without retention drops what no
    /// subscription holds: the ledger would be gone before anyone read it).
    pub async fn ledger(
        &self,
        bus: &dyn Bus,
        telemetry: &Telemetry,
        admin: Option<&PulsarAdmin>,
    ) -> Result<Option<Arc<Ledger>>, String> {
        let prices = self.prices()?;
        let Some(topic) = self.topic() else {
            return Ok(None);
        };
        let ledger = Ledger::open(bus, &topic, prices, &telemetry.registry)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(admin) = admin {
            match admin
                .topic_retention_at_least(&topic, i64::from(USAGE_RETENTION_MINUTES))
                .await
            {
                // The topic's own, or its namespace's when that keeps it as long (or for ever).
                Ok(Some(_)) => {}
                Ok(None) => {
                    if let Err(e) = admin
                        .set_topic_retention(&topic, USAGE_RETENTION_MINUTES, -1)
                        .await
                    {
                        warn!(topic, error = %e, "cannot set the usage topic's retention; set it with pulsar-admin topics set-retention --time 90d --size -1");
                    }
                }
                Err(e) => {
                    warn!(topic, error = %e, "cannot read the usage topic's retention; make sure it has one (pulsar-admin topics set-retention --time 90d --size -1)");
                }
            }
        }
        info!(topic, "usage ledger on");
        Ok(Some(Arc::new(ledger)))
    }
}

/// The ledger's default topic.
pub const DEFAULT_USAGE_TOPIC: &str = "persistent://tg/response/usage";

/// A `--fallback` file: `[[provider]]` tables.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FallbackFile {
    #[serde(default)]
    provider: Vec<ProviderConfig>,
}

/// The providers of a `--fallback` file, in order, described (not built).
pub fn fallback_list(path: &std::path::Path) -> Result<Vec<ProviderConfig>, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--fallback {shown}: cannot read it: {e}"))?;
    let file: FallbackFile =
        toml::from_str(&text).map_err(|e| format!("--fallback {shown}: {e}"))?;
    if file.provider.is_empty() {
        return Err(format!(
            "--fallback {shown}: no [[provider]] table: list the providers to fall back on, in order"
        ));
    }
    Ok(file.provider)
}

impl LlmArgs {
    /// The provider these options describe; a setting the provider does not take is refused.
    pub fn provider_config(&self) -> Result<ProviderConfig, String> {
        ProviderConfig::try_from(self.provider.clone()).map_err(|e| e.to_string())
    }

    /// How the fallback list behaves.
    fn fallback_settings(&self) -> Result<FallbackSettings, String> {
        let ms = |name: &str, v: Option<u64>| match v {
            Some(0) => Err(format!("--{name}: expected at least 1 ms")),
            v => Ok(v.map(Duration::from_millis)),
        };
        if self.breaker_cooldown_secs == 0 && self.breaker_failures > 0 {
            return Err("--breaker-cooldown-secs: expected at least 1 (or --breaker-failures 0 for no breaker)".into());
        }
        Ok(FallbackSettings {
            first_token_deadline: ms("first-token-deadline-ms", self.first_token_deadline_ms)?,
            hedge_after: ms("hedge-after-ms", self.hedge_after_ms)?,
            breaker_failures: self.breaker_failures,
            breaker_cooldown: Duration::from_secs(self.breaker_cooldown_secs),
        })
    }
}

impl LlmArgs {
    /// The processor's providers and how it calls them, as these options (and the
    /// `--fallback` file) describe them; checked, nothing built.
    pub fn service_config(&self) -> Result<ServiceConfig, String> {
        let mut config = ServiceConfig::new(self.provider_config()?);
        if let Some(path) = &self.fallback {
            config.fallback = fallback_list(path)?;
            config.fallback_settings = self.fallback_settings()?;
        } else if self.first_token_deadline_ms.is_some() || self.hedge_after_ms.is_some() {
            return Err("--first-token-deadline-ms and --hedge-after-ms need --fallback: a list of providers to move to".into());
        }
        config.retry = RetryPolicy::parse(&self.retry).map_err(|e| format!("--retry: {e}"))?;
        if let Some(n) = self.max_retries {
            config.retry = config
                .retry
                .with(&format!("attempts={}", n.saturating_add(1)))
                .map_err(|e| format!("--max-retries: {e}"))?;
        }
        config.extra_models = self.extra_models.clone();
        Ok(config)
    }
}

/// The text-completion handler `args` describe, its metrics registered in `telemetry`.
pub fn service(args: &LlmArgs, telemetry: &Telemetry) -> Result<TextCompletionService, String> {
    let config = args.service_config()?;
    config
        .service(&telemetry.registry)
        .map_err(|e| match (&e, &args.fallback) {
            (ConfigError::Fallback { .. }, Some(path)) => {
                format!("--fallback {}: {e}", path.display())
            }
            _ => e.to_string(),
        })
}

/// The billing secret's key (SLUICE_BILLING_SECRET or SLUICE_BILLING_SECRET_FILE), shared
/// with the gateway: with one, a request naming an API key without the gateway's seal of it
/// is refused, not billed (docs/security.md#the-key-that-bills-usage).
pub fn billing_key() -> Result<Option<sluice_runtime::seal::SealKey>, String> {
    let key = sluice_runtime::billing::key_from_env().map_err(|e| e.to_string())?;
    if key.is_some() {
        info!(
            "billing seals required: a request's API key is billed only with the gateway's seal of it"
        );
    }
    Ok(key)
}

/// Runs the processor until SIGTERM/SIGINT, then drains.
pub async fn run(args: TextCompletionArgs) -> Result<(), String> {
    let telemetry = Telemetry::new().map_err(|e| e.to_string())?;
    let handler = Arc::new(service(&args.llm, &telemetry)?);
    let mapping = args.bus.topic_mapping;
    let (mut config, mut topics) = processor_config("text-completion", &args.processor, mapping)?;
    if args.flows.config_service {
        topics.extend(args.flows.topic_names()?);
    }
    let bus = connect(&args.bus, &topics).await?;
    let admin = args
        .bus
        .pulsar_admin_url
        .as_deref()
        .map(|url| {
            pulsar_admin(
                url,
                args.bus.pulsar_tls_ca_file.as_deref(),
                args.bus.allow_plaintext_credentials,
            )
        })
        .transpose()?;
    config.ledger = args
        .llm
        .usage
        .ledger(&*bus, &telemetry, admin.as_ref())
        .await?;
    config.billing = billing_key()?;
    if let Some(flows) = args
        .flows
        .flows("text-completion", mapping, &args.processor, &config)?
    {
        let service = Arc::new(TextCompletionFlows::new(&handler));
        run_flows_until_signalled(bus, flows, service, telemetry, args.processor.metrics_addr)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    run_until_signalled(bus, config, handler, telemetry, args.processor.metrics_addr)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests;
