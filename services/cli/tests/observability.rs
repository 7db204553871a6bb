//! Observability, checked against the metrics table of docs/metrics.md (read at test time):
//!
//! - the Grafana dashboard and the Prometheus alert rules in `deploy/` parse as PromQL (with
//!   `promql-parser`), use only defined dashboard variables, and name only documented
//!   `sluice_*` metrics;
//! - the four processes (`sluice text-completion`, `prompt`, `agent`, `gateway`) run on the
//!   real broker against the fake OpenAI server and a real MCP server, with a provider key, a
//!   gateway token and an MCP token configured. Traffic goes through every service: streamed
//!   and whole answers, a provider error, a 429 that is retried, jsonl answers with skipped
//!   and corrected lines, an agent dialog with a tool call, a cancelled stream, the WebSocket.
//!   Then every documented metric must be on the /metrics of the process that owns it, and no
//!   metric, no log line (text and JSON logs) and no stdout line may contain a secret.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{collections::BTreeSet, time::Duration};

use common::{DocumentedMetric, Sluice, documented_metrics};
use futures::{SinkExt, StreamExt};
use promql_parser::{
    label::MatchOp,
    parser::{Expr, VectorSelector},
};
use serde_json::{Value, json};
use sluice_tests::{
    Broker, eventually_value, fake_openai::FakeOpenAi, fake_otlp::FakeCollector, free_port,
    mcp_server, metrics_text::samples, scrape, value,
};
use tokio_tungstenite::tungstenite::Message;

const KEY: &str = "sk-obs-provider-key-8841";
const TOKEN: &str = "gateway-token-obs-2209";
const MCP_TOKEN: &str = "mcp-token-obs-7310";
/// The OTLP collector's API key, given as OpenTelemetry specifies (OTEL_EXPORTER_OTLP_HEADERS).
const OTLP_KEY: &str = "otlp-collector-key-5150";
/// An API key of the gateway's keys file: its series are exported from the start.
const API_KEY: &str = "sk-obs-api-key-5521";
/// The billing secret the gateway seals keys with and text-completion checks them by.
const BILLING_SECRET: &str = "obs-billing-secret-0123456789abcdef-7731";
const SECRETS: [&str; 6] = [KEY, TOKEN, MCP_TOKEN, OTLP_KEY, API_KEY, BILLING_SECRET];

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Metrics of other programs that the dashboard and the rules may use.
const FOREIGN_METRICS: [&str; 1] = [
    // The Pulsar broker's topic-level metric (its own /metrics).
    "pulsar_subscription_back_log",
];

/// Whether `name`, as a query names it, is a documented metric: histograms only through
/// their `_bucket`, `_sum` and `_count` series.
fn is_documented(name: &str, documented: &[DocumentedMetric]) -> bool {
    documented
        .iter()
        .any(|d| d.name == name && d.kind != "histogram")
        || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix).is_some_and(|base| {
                documented
                    .iter()
                    .any(|d| d.name == base && d.kind == "histogram")
            })
        })
}

/// The metric names an expression selects.
fn metric_names(e: &Expr, out: &mut BTreeSet<String>) {
    match e {
        Expr::Aggregate(a) => {
            metric_names(&a.expr, out);
            if let Some(p) = &a.param {
                metric_names(p, out);
            }
        }
        Expr::Unary(u) => metric_names(&u.expr, out),
        Expr::Binary(b) => {
            metric_names(&b.lhs, out);
            metric_names(&b.rhs, out);
        }
        Expr::Paren(p) => metric_names(&p.expr, out),
        Expr::Subquery(s) => metric_names(&s.expr, out),
        Expr::VectorSelector(v) => selected(v, out),
        Expr::MatrixSelector(m) => selected(&m.vs, out),
        Expr::Call(c) => {
            for a in &c.args.args {
                metric_names(a, out);
            }
        }
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

fn selected(v: &VectorSelector, out: &mut BTreeSet<String>) {
    if let Some(name) = &v.name {
        out.insert(name.clone());
    }
    for m in &v.matchers.matchers {
        if m.name == "__name__" && matches!(m.op, MatchOp::Equal) {
            out.insert(m.value.clone());
        }
    }
}

/// Parses `expr` (Grafana's range variables replaced by a duration) and returns the metrics
/// it names, after checking each is documented or a known foreign metric.
fn check_expr(place: &str, expr: &str, documented: &[DocumentedMetric]) -> BTreeSet<String> {
    let promql = expr
        .replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h");
    let ast = promql_parser::parser::parse(&promql)
        .unwrap_or_else(|e| panic!("{place}: not PromQL ({e}):\n{expr}"));
    let mut names = BTreeSet::new();
    metric_names(&ast, &mut names);
    for name in &names {
        assert!(
            is_documented(name, documented) || FOREIGN_METRICS.contains(&name.as_str()),
            "{place}: {name} is not in the metrics table (docs/metrics.md):\n{expr}"
        );
    }
    names
}

/// The `$variables` an expression uses.
fn variables(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find('$') {
        rest = &rest[i + 1..];
        let braced = rest.starts_with('{');
        let body = rest.trim_start_matches('{');
        let name: String = body
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // `$1` in label_replace is a regex group, not a variable.
        if !name.is_empty() && !name.chars().all(|c| c.is_ascii_digit()) {
            out.push(name);
        }
        if braced {
            rest = body;
        }
    }
    out
}

fn collect_targets(panels: &Value, out: &mut Vec<(String, String)>) {
    for p in panels.as_array().into_iter().flatten() {
        let title = p["title"].as_str().unwrap_or("?").to_owned();
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
            out.push((format!("panel {title:?}"), expr.to_owned()));
        }
        collect_targets(&p["panels"], out);
    }
}

#[test]
fn the_dashboard_and_the_alert_rules_parse_and_name_only_documented_metrics() {
    let documented = documented_metrics();

    let dashboard: Value =
        serde_json::from_str(&repo_file("deploy/grafana/dashboards/sluice.json")).unwrap();
    assert_eq!(dashboard["uid"], "sluice");
    let vars = dashboard["templating"]["list"].as_array().unwrap();
    let var_names: Vec<&str> = vars.iter().filter_map(|v| v["name"].as_str()).collect();
    for needed in ["datasource", "job", "processor"] {
        assert!(var_names.contains(&needed), "variable {needed} missing");
    }
    let mut exprs = Vec::new();
    collect_targets(&dashboard["panels"], &mut exprs);
    assert!(exprs.len() >= 20, "only {} queries", exprs.len());
    for v in vars.iter().filter(|v| v["type"] == "query") {
        // `label_values(SELECTOR, label)`: the selector is PromQL.
        let def = v["definition"].as_str().unwrap();
        let selector = def
            .strip_prefix("label_values(")
            .and_then(|s| s.rsplit_once(','))
            .map(|(sel, _)| sel)
            .unwrap_or_else(|| panic!("variable {}: {def}", v["name"]));
        exprs.push((format!("variable {}", v["name"]), selector.to_owned()));
    }
    // Every panel and variable query reads the data source variable.
    let text = dashboard.to_string();
    assert!(!text.contains("\"uid\":\"prometheus\"") || text.contains("${datasource}"));
    let mut on_dashboard = BTreeSet::new();
    for (place, expr) in &exprs {
        for var in variables(expr) {
            assert!(
                var.starts_with("__") || var_names.contains(&var.as_str()),
                "{place}: ${var} is not a dashboard variable:\n{expr}"
            );
        }
        on_dashboard.extend(check_expr(place, expr, &documented));
    }
    for shown in [
        "sluice_processor_requests_total",
        "sluice_gateway_requests_total",
        "sluice_llm_time_to_first_token_seconds_bucket",
        "sluice_gateway_first_event_seconds_bucket",
        "sluice_llm_tokens_total",
        "sluice_processor_in_flight_requests",
        "sluice_llm_rate_limited_total",
        "sluice_llm_retries_total",
        "pulsar_subscription_back_log",
        "sluice_prompt_lines_skipped_total",
        "sluice_agent_iterations_total",
        "sluice_agent_tool_calls_total",
    ] {
        assert!(
            on_dashboard.contains(shown),
            "the dashboard shows no {shown}"
        );
    }

    let docs =
        yaml_rust2::YamlLoader::load_from_str(&repo_file("deploy/prometheus/alerts.yml")).unwrap();
    let groups = docs[0]["groups"].as_vec().expect("groups");
    let mut alerts = BTreeSet::new();
    let mut in_alerts = BTreeSet::new();
    for group in groups {
        let rules = group["rules"].as_vec().expect("rules");
        for rule in rules {
            let name = rule["alert"].as_str().expect("every rule is an alert");
            assert!(alerts.insert(name.to_owned()), "{name} twice");
            let expr = rule["expr"].as_str().expect("expr");
            let place = format!("alert {name}");
            assert!(variables(expr).is_empty(), "{place}: a Grafana variable");
            in_alerts.extend(check_expr(&place, expr, &documented));
            let wait = rule["for"].as_str().expect("for");
            assert!(
                promql_parser::util::duration::parse_duration(wait).is_ok(),
                "{place}: for: {wait}"
            );
            let severity = rule["labels"]["severity"].as_str().expect("severity");
            assert!(["info", "warning", "critical"].contains(&severity));
            for a in ["summary", "description"] {
                assert!(
                    rule["annotations"][a]
                        .as_str()
                        .is_some_and(|s| !s.is_empty()),
                    "{place}: no {a}"
                );
            }
        }
    }
    for watched in [
        "sluice_processor_requests_total",
        "sluice_llm_time_to_first_token_seconds_bucket",
        "sluice_llm_rate_limited_total",
        "pulsar_subscription_back_log",
    ] {
        assert!(in_alerts.contains(watched), "no alert watches {watched}");
    }
}

/// The naming convention of docs/metrics.md: `sluice_<subsystem>_<name>_<unit>`, counters end in
/// `_total`, histograms are durations in `_seconds`, gauges do not end in `_total`.
fn convention_broken(name: &str, kind: &str) -> Option<&'static str> {
    let parts: Vec<&str> = name.split('_').collect();
    if parts.len() < 3 || parts[0] != "sluice" || parts.iter().any(|p| p.is_empty()) {
        return Some("not sluice_<subsystem>_<name>");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Some("not lower snake case");
    }
    match kind {
        "counter" if !name.ends_with("_total") => Some("a counter must end in _total"),
        "histogram" if !name.ends_with("_seconds") => Some("a histogram must be _seconds"),
        "gauge" if name.ends_with("_total") => Some("a gauge must not end in _total"),
        _ => None,
    }
}

#[test]
fn every_documented_metric_follows_the_naming_convention() {
    let mut seen = BTreeSet::new();
    for m in documented_metrics() {
        assert!(
            seen.insert(m.name.clone()),
            "{} is documented twice",
            m.name
        );
        if let Some(why) = convention_broken(&m.name, &m.kind) {
            panic!("{} ({}): {why}", m.name, m.kind);
        }
        // Every subsystem has a process that owns it.
        let _ = owners(&m.name);
    }
    assert_eq!(
        convention_broken("sluice_llm_in_flight_total", "gauge"),
        Some("a gauge must not end in _total")
    );
    assert!(convention_broken("sluice_llm_requests", "counter").is_some());
    assert!(convention_broken("sluice_llm_latency_ms", "histogram").is_some());
}

#[test]
fn the_checks_catch_undocumented_metrics_and_bad_queries() {
    let documented = documented_metrics();
    let bad = std::panic::catch_unwind(|| {
        check_expr("t", "rate(sluice_made_up_total[5m])", &documented);
    });
    assert!(bad.is_err(), "an undocumented metric passes");
    let bare_histogram = std::panic::catch_unwind(|| {
        check_expr("t", "sluice_llm_time_to_first_token_seconds", &documented);
    });
    assert!(
        bare_histogram.is_err(),
        "a histogram without _bucket passes"
    );
    let syntax = std::panic::catch_unwind(|| {
        check_expr(
            "t",
            "sum by (job (rate(sluice_llm_tokens_total[5m]))",
            &documented,
        );
    });
    assert!(syntax.is_err(), "broken PromQL passes");
    assert_eq!(
        variables(r#"rate(x{job=~"$job", p=~"${processor}"}[$__rate_interval]) "$1""#),
        ["job", "processor", "__rate_interval"]
    );
}

// ---- the scrape test ----

/// Label pairs to match.
type Labels<'a> = Vec<(&'a str, &'a str)>;

/// The processes that export a metric, by its subsystem.
fn owners(metric: &str) -> &'static [&'static str] {
    // Exported only by a text-completion processor given --fallback; tests/fallback.rs
    // reads them there.
    if [
        "sluice_llm_fallbacks_total",
        "sluice_llm_answered_total",
        "sluice_llm_hedges_total",
        "sluice_llm_breaker_state",
        "sluice_llm_breaker_transitions_total",
    ]
    .contains(&metric)
    {
        return &[];
    }
    // Exported by a processor that checks billing seals: text-completion, given the secret.
    if metric == "sluice_processor_unverified_keys_total" {
        return &["text-completion"];
    }
    match metric
        .strip_prefix("sluice_")
        .and_then(|r| r.split('_').next())
    {
        Some("processor") => &["text-completion", "prompt", "agent"],
        // The allocator's counters, on every process of the `sluice` binary.
        Some("process") => &["text-completion", "prompt", "agent", "gateway"],
        // The gateway's, the prompt processor's and the agent's text-completion clients.
        Some("client") => &["prompt", "agent", "gateway"],
        Some("llm") => &["text-completion"],
        // The usage ledger's, written by text-completion.
        Some("usage") => &["text-completion"],
        Some("prompt") => &["prompt"],
        Some("gateway") => &["gateway"],
        Some("agent") => &["agent"],
        // Exported only with --config-service; tests/config_service.rs reads them there.
        Some("config") => &[],
        _ => panic!("{metric}: which process exports it? Add its subsystem to owners()"),
    }
}

fn exported(text: &str, m: &DocumentedMetric) -> bool {
    let series = if m.kind == "histogram" {
        format!("{}_bucket", m.name)
    } else {
        m.name.clone()
    };
    samples(text).iter().any(|(n, _, _)| *n == series)
}

/// Polls `port`'s metrics until `name{labels}` reaches `at_least`.
async fn wait_for(port: u16, name: &str, labels: &[(&str, &str)], at_least: f64) {
    let now = eventually_value(port, name, labels, Duration::from_secs(30), |v| {
        v >= at_least
    })
    .await;
    assert!(
        now >= at_least,
        "{name}{labels:?} stayed below {at_least}:\n{}",
        scrape(port).await
    );
}

struct Gateway {
    http: reqwest::Client,
    url: String,
}

impl Gateway {
    /// POSTs `body` to `path` with the token; NDJSON events when `stream`.
    async fn post(&self, path: &str, body: Value, stream: bool) -> (u16, String) {
        let mut req = self
            .http
            .post(format!("{}{path}", self.url))
            .bearer_auth(TOKEN)
            .json(&body);
        if stream {
            req = req.header("accept", "application/x-ndjson");
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.text().await.unwrap())
    }
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The next text frame, as JSON.
async fn next_text(socket: &mut Socket) -> Value {
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(30), socket.next())
            .await
            .expect("a frame arrives")
            .unwrap()
            .unwrap();
        if let Message::Text(t) = msg {
            return serde_json::from_str::<Value>(t.as_str()).unwrap();
        }
    }
}

/// The text of an NDJSON answer's token events, joined.
fn tokens(body: &str) -> String {
    body.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["type"] == "token")
        .filter_map(|e| e["content"].as_str().map(str::to_owned))
        .collect()
}

fn args(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

fn topics(flag: &str, topicspace: &str, service: &str) -> Vec<String> {
    let prefix = if flag.is_empty() {
        String::new()
    } else {
        format!("{flag}-")
    };
    vec![
        format!("--{prefix}request-topic"),
        format!("request:{topicspace}:{service}"),
        format!("--{prefix}response-topic"),
        format!("response:{topicspace}:{service}"),
    ]
}

/// Removes the test's tenant (topics, namespaces, tenant) from the broker, as far as the
/// broker allows; failures only leave litter.
async fn remove_tenant(admin_url: &str, tenant: &str) {
    let http = reqwest::Client::new();
    for ns in ["request", "response", "notify"] {
        let listed: Vec<String> = match http
            .get(format!(
                "{admin_url}/admin/v2/namespaces/{tenant}/{ns}/topics"
            ))
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        for topic in listed {
            let path = topic.replacen("://", "/", 1);
            let _ = http
                .delete(format!("{admin_url}/admin/v2/{path}?force=true"))
                .send()
                .await;
        }
        let _ = http
            .delete(format!("{admin_url}/admin/v2/namespaces/{tenant}/{ns}"))
            .send()
            .await;
    }
    let _ = http
        .delete(format!("{admin_url}/admin/v2/tenants/{tenant}"))
        .send()
        .await;
}

#[tokio::test]
async fn every_service_exports_its_documented_metrics_and_no_secret() {
    sluice_runtime::install_crypto_provider();
    let documented = documented_metrics();
    let broker = Broker::from_env().await;
    let fake = FakeOpenAi::start().await;
    let mcp = mcp_server::start(Some(MCP_TOKEN)).await;
    // Every process exports its spans here, so the traces can be followed across processes.
    let collector = FakeCollector::start().await;
    let otlp_endpoint = collector.base_url();
    let otlp_headers = format!("authorization=Bearer {OTLP_KEY}");
    // One topicspace (a Pulsar tenant) per run: the gateway's topics are
    // `request:<topicspace>:<service>`, so parallel runs never share a subscription.
    let ts = sluice_tests::unique_topicspace("obs");
    let dir = std::env::temp_dir().join(&ts);
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    std::fs::write(
        &tools,
        json!({"tools": [{
            "name": "add", "description": "Adds two numbers", "type": "mcp",
            "url": mcp.url(), "token-env": "OBS_MCP_TOKEN",
            "arguments": [{"name": "a", "type": "number"}, {"name": "b", "type": "number"}]
        }]})
        .to_string(),
    )
    .unwrap();

    let bus = args(&[
        "--pulsar-url",
        &broker.url,
        "--pulsar-admin-url",
        &broker.admin_url,
    ]);
    let cancel =
        |service: &str| args(&["--cancel-topic", &format!("notify:{ts}:{service}-cancel")]);
    let llm_topics = {
        let mut v = topics("llm", &ts, "text-completion");
        v.extend(args(&[
            "--llm-cancel-topic",
            &format!("notify:{ts}:text-completion-cancel"),
        ]));
        v
    };
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let metrics_addr = |i: usize| args(&["--metrics-addr", &format!("127.0.0.1:{}", ports[i])]);
    // Secrets only where they belong, and nothing inherited that changes the set-up.
    let clean = [
        "SLUICE_CONFIG",
        "SLUICE_GATEWAY_TOKEN",
        "SLUICE_GATEWAY_TOKEN_FILE",
        "SLUICE_LLM_API_KEY",
        "SLUICE_TOPICSPACE",
        "SLUICE_TEMPLATES",
        "SLUICE_TOOLS",
        "SLUICE_METRICS_ADDR",
        "SLUICE_LOG_FORMAT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SERVICE_NAME",
    ];
    let start = |argv: Vec<String>, env: &[(&str, &str)]| {
        let mut argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        argv.splice(0..0, ["--otlp-endpoint", otlp_endpoint.as_str()]);
        let mut vars = vec![
            ("RUST_LOG", "debug"),
            ("OTEL_EXPORTER_OTLP_HEADERS", otlp_headers.as_str()),
        ];
        vars.extend_from_slice(env);
        Sluice::spawn(&argv, &vars, &clean)
    };
    let ready = |i: usize| format!("http://127.0.0.1:{}/readyz", ports[i]);

    // Half the processes log JSON, half text: both formats must keep the secrets out.
    let base_url = fake.base_url();
    // A price for the model, so that the ledger's cost is exported too.
    let prices = std::env::temp_dir().join(format!("{ts}-prices.toml"));
    std::fs::write(
        &prices,
        "[[price]]\nmodel = \"routed\"\ninput = 0.5\noutput = 1.5\n",
    )
    .unwrap();
    let prices_path = prices.display().to_string();
    let usage_topic = format!("persistent://{ts}/response/usage");
    let mut tc_args = args(&[
        "--log-format",
        "json",
        "text-completion",
        "--provider",
        "openai-compatible",
        "--base-url",
        &base_url,
        "--model",
        "routed",
        "--prices-file",
        &prices_path,
        "--usage-topic",
        &usage_topic,
    ]);
    tc_args.extend(bus.clone());
    tc_args.extend(topics("", &ts, "text-completion"));
    tc_args.extend(cancel("text-completion"));
    tc_args.extend(metrics_addr(0));
    // Billing seals checked, so that their refusal counter is exported too.
    let mut tc = start(
        tc_args,
        &[
            ("SLUICE_LLM_API_KEY", KEY),
            ("SLUICE_BILLING_SECRET", BILLING_SECRET),
        ],
    );
    // The first process creates the tenant and namespaces; the others then find them.
    tc.ready(&ready(0)).await;

    let mut prompt_args = args(&["prompt"]);
    prompt_args.extend(bus.clone());
    prompt_args.extend(topics("", &ts, "prompt"));
    prompt_args.extend(cancel("prompt"));
    prompt_args.extend(llm_topics.clone());
    prompt_args.extend(metrics_addr(1));
    let mut prompt = start(prompt_args, &[]);

    let mut agent_args = args(&["--log-format", "json", "agent", "--tools"]);
    agent_args.push(tools.display().to_string());
    agent_args.extend(bus.clone());
    agent_args.extend(topics("", &ts, "agent"));
    agent_args.extend(cancel("agent"));
    agent_args.extend(llm_topics.clone());
    agent_args.extend(topics("prompt", &ts, "prompt"));
    agent_args.extend(metrics_addr(2));
    let mut agent = start(agent_args, &[("OBS_MCP_TOKEN", MCP_TOKEN)]);

    let keys_file = std::env::temp_dir().join(format!("{ts}-keys.toml"));
    std::fs::write(
        &keys_file,
        sluice_tests::keys::keys_toml(&[("obs", API_KEY, "requests_per_minute = 1000")]),
    )
    .unwrap();
    let keys_path = keys_file.display().to_string();
    let mut gw_args = args(&[
        "gateway",
        "--topicspace",
        &ts,
        "--listen",
        "127.0.0.1:0",
        "--keys-file",
        &keys_path,
    ]);
    gw_args.extend(bus.clone());
    gw_args.extend(metrics_addr(3));
    let mut gateway = start(
        gw_args,
        &[
            ("SLUICE_GATEWAY_TOKEN", TOKEN),
            ("SLUICE_BILLING_SECRET", BILLING_SECRET),
        ],
    );

    prompt.ready(&ready(1)).await;
    agent.ready(&ready(2)).await;
    gateway.ready(&ready(3)).await;
    let addr = gateway
        .stdout_line("gateway listening on ")
        .await
        .rsplit(' ')
        .next()
        .unwrap()
        .to_owned();
    let gw = Gateway {
        http: reqwest::Client::new(),
        url: format!("http://{addr}"),
    };

    // text-completion: streamed, whole, a provider error, a 429 that is retried.
    let (status, body) = gw
        .post(
            "/api/v1/text-completion",
            json!({"system": "be brief", "prompt": "[model:normal] say hello", "streaming": true}),
            true,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""reason":"success""#), "{body}");
    let (status, body) = gw
        .post(
            "/api/v1/text-completion",
            json!({"system": "", "prompt": "[model:normal] whole"}),
            false,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Hello world!"), "{body}");
    let (status, body) = gw
        .post(
            "/api/v1/text-completion",
            json!({"system": "", "prompt": "[model:unauthorized] x"}),
            false,
        )
        .await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("llm-error"), "{body}");
    let (status, body) = gw
        .post(
            "/api/v1/text-completion",
            json!({"system": "", "prompt": "[model:rate_limited_once] x", "streaming": true}),
            true,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""reason":"success""#), "{body}");
    assert_eq!(fake.calls("rate_limited_once"), 2, "one 429, one retry");
    // No token: refused.
    let unauthorised = gw
        .http
        .post(format!("{}/api/v1/text-completion", gw.url))
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorised.status().as_u16(), 401);

    // prompt: jsonl answers with malformed lines, and with corrected values; an unknown
    // template.
    for seed in ["classification-malformed", "classification-normalised"] {
        let (status, body) = gw
            .post(
                "/api/v1/prompt",
                // The blocks the seed streams answer (an object for a block the request does
                // not name is dropped).
                json!({"id": "knowledge-classification", "streaming": true, "terms": {
                    "blocks": [{"block_id": "abc123", "content": format!("[model:seed-{seed}]")},
                               {"block_id": "def456", "content": "x"},
                               {"block_id": "ghi789", "content": "y"},
                               {"block_id": "jkl012", "content": "z"}]}}),
                true,
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(r#""reason":"success""#), "{seed}: {body}");
    }
    let (status, _) = gw
        .post(
            "/api/v1/prompt",
            json!({"id": "no-such-template", "terms": {}}),
            false,
        )
        .await;
    assert_eq!(status, 400);

    // agent: a dialog that calls the MCP tool (with its token), then answers.
    let (status, body) = gw
        .post(
            "/api/v1/agent",
            json!({"question": "[model:react-tool] What is 2 + 3?", "streaming": true}),
            true,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(tokens(&body).contains("The sum is 5."), "{body}");
    assert!(mcp.calls() >= 1, "the tool was called");

    // A stream whose caller goes away after its first token: cancelled everywhere.
    {
        let http = reqwest::Client::new();
        let mut resp = http
            .post(format!("{}/api/v1/text-completion", gw.url))
            .bearer_auth(TOKEN)
            .header("accept", "application/x-ndjson")
            .json(&json!({"system": "", "prompt": "[model:stall] x", "streaming": true}))
            .send()
            .await
            .unwrap();
        let mut seen = String::new();
        while !seen.contains("Hel") {
            let chunk = tokio::time::timeout(Duration::from_secs(30), resp.chunk())
                .await
                .expect("the first token arrives")
                .unwrap()
                .expect("the stream stalls after its first token");
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
    wait_for(
        ports[3],
        "sluice_gateway_streams_total",
        &[("route", "text-completion"), ("outcome", "cancelled")],
        1.0,
    )
    .await;
    wait_for(
        ports[0],
        "sluice_processor_requests_total",
        &[("processor", "text-completion"), ("outcome", "cancelled")],
        1.0,
    )
    .await;

    // TrustGraph's WebSocket: auth with the token, a request, a frame that is not JSON.
    let (mut socket, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/api/v1/socket"))
        .await
        .unwrap();
    socket
        .send(Message::Text(
            json!({"type": "auth", "token": TOKEN}).to_string().into(),
        ))
        .await
        .unwrap();
    assert_eq!(next_text(&mut socket).await["type"], "auth-ok");
    socket
        .send(Message::Text(
            json!({"id": "w1", "service": "text-completion", "flow": "default",
                   "request": {"system": "", "prompt": "[model:normal] hi", "streaming": true}})
            .to_string()
            .into(),
        ))
        .await
        .unwrap();
    loop {
        let frame = next_text(&mut socket).await;
        assert!(frame.get("error").is_none(), "{frame}");
        if frame["complete"] == true {
            break;
        }
    }
    socket
        .send(Message::Text("not json".to_owned().into()))
        .await
        .unwrap();
    assert!(next_text(&mut socket).await.get("error").is_some());
    socket.close(None).await.unwrap();

    // Every documented metric on the process that owns it, touched by the traffic where it
    // counts events.
    let names = ["text-completion", "prompt", "agent", "gateway"];
    let mut scraped = Vec::new();
    for port in &ports {
        scraped.push(scrape(*port).await);
    }
    let mut missing = Vec::new();
    for m in &documented {
        for owner in owners(&m.name) {
            let i = names.iter().position(|n| n == owner).unwrap();
            if !exported(&scraped[i], m) {
                missing.push(format!("{} on {owner}", m.name));
            }
        }
    }
    // And the other way round: every sluice metric a process exports is documented, with
    // its type.
    for (i, text) in scraped.iter().enumerate() {
        for line in text.lines().filter(|l| l.starts_with("# TYPE sluice_")) {
            let mut words = line.split(' ').skip(2);
            let (name, kind) = (words.next().unwrap(), words.next().unwrap());
            assert!(
                documented.iter().any(|d| d.name == name && d.kind == kind),
                "{}: {name} ({kind}) is exported but not in the metrics table (docs/metrics.md)",
                names[i]
            );
        }
    }
    for (i, text) in scraped.iter().enumerate() {
        for s in SECRETS {
            assert!(!text.contains(s), "a secret is on {}'s /metrics", names[i]);
        }
    }
    let (tc_m, prompt_m, agent_m, gw_m) = (0, 1, 2, 3);
    let routed = [("provider", "openai-compatible"), ("model", "routed")];
    let touched: Vec<(usize, &str, Labels)> = vec![
        (tc_m, "sluice_llm_rate_limited_total", routed.to_vec()),
        (
            tc_m,
            "sluice_llm_retries_total",
            vec![("kind", "rate_limited")],
        ),
        (
            tc_m,
            "sluice_llm_requests_total",
            vec![("outcome", "error")],
        ),
        (
            tc_m,
            "sluice_llm_tokens_total",
            vec![("direction", "output")],
        ),
        (
            tc_m,
            "sluice_llm_time_to_first_token_seconds_count",
            routed.to_vec(),
        ),
        (tc_m, "sluice_processor_records_published_total", vec![]),
        (
            prompt_m,
            "sluice_prompt_lines_skipped_total",
            vec![("reason", "malformed")],
        ),
        (
            prompt_m,
            "sluice_prompt_objects_total",
            vec![("template", "knowledge-classification")],
        ),
        (prompt_m, "sluice_prompt_corrections_total", vec![]),
        (
            prompt_m,
            "sluice_prompt_template_errors_total",
            vec![("kind", "unknown")],
        ),
        (
            prompt_m,
            "sluice_client_requests_total",
            vec![("service", "text-completion"), ("outcome", "success")],
        ),
        (
            agent_m,
            "sluice_processor_requests_total",
            vec![("processor", "agent"), ("outcome", "continued")],
        ),
        (
            gw_m,
            "sluice_gateway_requests_total",
            vec![("status", "401")],
        ),
        (
            gw_m,
            "sluice_gateway_socket_frames_total",
            vec![("kind", "invalid")],
        ),
        (
            gw_m,
            "sluice_gateway_first_event_seconds_count",
            vec![("route", "prompt")],
        ),
    ];
    for (i, name, labels) in &touched {
        assert!(
            value(&scraped[*i], name, labels) >= 1.0,
            "{}: {name}{labels:?} was not counted:\n{}",
            names[*i],
            scraped[*i]
        );
    }
    // Stop everything; nothing it wrote may hold a secret; JSON logs are JSON.
    let mut outputs = Vec::new();
    for (name, process) in [
        ("gateway", gateway),
        ("agent", agent),
        ("prompt", prompt),
        ("text-completion", tc),
    ] {
        outputs.push((name, process.stop().await));
    }
    remove_tenant(&broker.admin_url, &ts).await;
    let _ = std::fs::remove_dir_all(&dir);
    check_traces(&collector, &mcp.traceparents());
    for (name, out) in &outputs {
        assert!(
            out.status.success(),
            "{name}: {:?}\n{}",
            out.status,
            out.stderr
        );
        assert!(
            out.stderr.contains("DEBUG") || out.stderr.contains(r#""level":"DEBUG""#),
            "{name} logged at debug: {}",
            out.stderr
        );
        // A gateway counting its keys' limits alone (no secret shared with other replicas)
        // never uses the limits topic, so it has no policy to set on it.
        assert!(
            !out.stderr.contains("cannot set the limits topic"),
            "{name}: {}",
            out.stderr
        );
        for s in SECRETS {
            assert!(!out.stderr.contains(s), "{name}: a secret reached the log");
            assert!(!out.stdout.contains(s), "{name}: a secret reached stdout");
        }
        if ["agent", "text-completion"].contains(name) {
            for line in out.stderr.lines().filter(|l| !l.trim().is_empty()) {
                assert!(
                    serde_json::from_str::<Value>(line).is_ok_and(|v| v.is_object()),
                    "{name}: not a JSON log line: {line}"
                );
            }
        }
    }
    assert!(
        missing.is_empty(),
        "documented metrics missing from /metrics: {missing:#?}"
    );
    if documented
        .iter()
        .any(|m| m.name == "sluice_agent_tool_calls_total")
    {
        // Documented (so required): the dialog above called the MCP tool.
        assert!(
            value(
                &scraped[agent_m],
                "sluice_agent_tool_calls_total",
                &[("kind", "mcp")]
            ) >= 1.0,
            "{}",
            scraped[agent_m]
        );
    }
}

/// The spans the four processes exported (each flushes its queue on SIGTERM): a prompt
/// request is one trace across three processes, gateway -> prompt -> text-completion ->
/// provider call, each span the parent of the next; every export carried the collector key
/// from OTEL_EXPORTER_OTLP_HEADERS; no attribute holds a secret.
fn check_traces(collector: &FakeCollector, mcp_traceparents: &[String]) {
    let spans = collector.spans();
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    for service in [
        "sluice-gateway",
        "sluice-prompt",
        "sluice-agent",
        "sluice-text-completion",
    ] {
        assert!(
            services.contains(service),
            "no spans from {service}: {services:?}"
        );
    }
    let by_id = |id: &str| spans.iter().find(|s| s.span_id == id);
    let chained = spans
        .iter()
        .filter(|s| s.service == "sluice-text-completion" && s.name.starts_with("chat "))
        .any(|call| {
            let Some(tc) = by_id(&call.parent_span_id) else {
                return false;
            };
            let Some(prompt) = by_id(&tc.parent_span_id) else {
                return false;
            };
            let Some(gw) = by_id(&prompt.parent_span_id) else {
                return false;
            };
            tc.service == "sluice-text-completion"
                && tc.name == "text-completion process"
                && prompt.service == "sluice-prompt"
                && prompt.name == "prompt process"
                && gw.service == "sluice-gateway"
                && gw.name == "POST /api/v1/prompt"
                && [tc, prompt, gw].iter().all(|s| s.trace_id == call.trace_id)
        });
    assert!(
        chained,
        "no gateway -> prompt -> text-completion -> provider chain in {spans:#?}"
    );
    // The agent's tool call: a client span, child of an agent step, whose context reached the
    // MCP server as its HTTP `traceparent` header.
    let tool = spans
        .iter()
        .find(|s| s.service == "sluice-agent" && s.name == "tool add")
        .unwrap_or_else(|| panic!("no tool span in {spans:#?}"));
    assert_eq!(tool.kind, 3, "a client span");
    let step = by_id(&tool.parent_span_id).expect("the tool span's parent was exported");
    assert_eq!(
        (step.name.as_str(), step.trace_id.as_str()),
        ("agent process", tool.trace_id.as_str())
    );
    let header = format!("00-{}-{}-01", tool.trace_id, tool.span_id);
    assert!(
        mcp_traceparents.contains(&header),
        "the MCP server never saw {header}: {mcp_traceparents:?}"
    );
    let auth = collector.authorizations();
    assert!(!auth.is_empty());
    assert!(
        auth.iter().all(|a| *a == format!("Bearer {OTLP_KEY}")),
        "{auth:?}"
    );
    for span in &spans {
        for (k, v) in &span.attributes {
            for s in SECRETS {
                assert!(
                    !v.contains(s),
                    "a secret in span attribute {k} of {}",
                    span.name
                );
            }
        }
    }
}
