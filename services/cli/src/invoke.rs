//! `sluice invoke llm|prompt|agent`: call a running gateway and print the answer as it
//! arrives (NDJSON, docs/protocol.md#gateway-events-ndjson-and-sse), or whole with
//! `--no-streaming`.
//!
//! Answers go to stdout; agent thoughts, actions and observations, usage and errors go to
//! stderr, so `sluice invoke ... > answer.txt` captures only the answer. An error event or
//! error response exits 1 with a readable message, and so does a `jsonl` prompt whose every
//! line was skipped.
//!
//! A streamed answer whose connection breaks (the gateway replica serving it died) is resumed
//! where it broke, through the same URL (another replica behind it), up to
//! [`RESUMES`] times: `Sluice-Resume: <token>.<lines received>` (docs/gateway.md#resuming-a-stream).

use std::{
    collections::BTreeMap,
    io::{IsTerminal, Write},
    time::Duration,
};

use clap::{Args, Subcommand};
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_runtime::{ndjson::LineSplitter, secret::Secret};

/// Where the gateway is and how to call it.
#[derive(Args, Debug)]
pub struct InvokeArgs {
    /// The gateway's URL.
    #[arg(
        short = 'u',
        long,
        env = "SLUICE_URL",
        default_value = "http://127.0.0.1:8088",
        global = true
    )]
    url: String,
    /// Bearer token. Prefer SLUICE_TOKEN or SLUICE_TOKEN_FILE: a token on the command line
    /// is visible to other users of the machine (`ps`).
    #[arg(short = 't', long, global = true, hide_env_values = true)]
    token: Option<String>,
    /// The flow to call (TrustGraph's `-f`): the gateway's route for that flow, which
    /// answers `unknown flow` when the gateway serves another. Without it, the flow the
    /// gateway serves.
    #[arg(short = 'f', long, env = "SLUICE_FLOW", global = true)]
    flow: Option<String>,
    /// Wait for the whole answer instead of streaming it.
    #[arg(long, global = true)]
    no_streaming: bool,
    /// Print the input and output token counts after the answer.
    #[arg(long, global = true)]
    show_usage: bool,
    #[command(subcommand)]
    what: Invoke,
}

#[derive(Subcommand, Debug)]
enum Invoke {
    /// A text completion.
    Llm {
        /// The system prompt.
        system: String,
        /// The prompt.
        prompt: String,
    },
    /// A prompt template, with `name=value` terms (values that parse as JSON are sent as
    /// that JSON, others as strings).
    Prompt {
        /// The template id.
        template: String,
        /// Terms, `name=value`.
        terms: Vec<String>,
    },
    /// A question to the agent.
    Agent {
        /// The question.
        #[arg(short = 'q', long)]
        question: String,
        /// The agent state.
        #[arg(short = 's', long)]
        state: Option<String>,
        /// Tool groups.
        #[arg(short = 'g', long)]
        group: Vec<String>,
    },
}

/// Why an invocation failed; printed as `sluice: <message>`.
#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    /// The answer was an error.
    #[error("{kind}: {message}")]
    Answer {
        /// The error's type.
        kind: String,
        /// What went wrong.
        message: String,
    },
    /// Anything else (connection, usage).
    #[error("{0}")]
    Other(String),
}

fn prompt_terms(terms: &[String]) -> Result<BTreeMap<String, String>, InvokeError> {
    terms
        .iter()
        .map(|t| {
            let (k, v) = t.split_once('=').ok_or_else(|| {
                InvokeError::Other(format!("a term must be name=value, got {t:?}"))
            })?;
            // TrustGraph sends every term JSON-encoded.
            let value =
                serde_json::from_str::<Value>(v).unwrap_or_else(|_| Value::String(v.to_owned()));
            Ok((k.to_owned(), value.to_string()))
        })
        .collect()
}

struct Printer {
    show_usage: bool,
    color: bool,
    /// The message type being printed to stderr (agent), to label each new message once.
    current: Option<String>,
    wrote_answer: bool,
    /// Whether the answer printed so far ends with a newline.
    at_line_start: bool,
}

impl Printer {
    fn side(&mut self, message_type: &str, content: &str, end: bool) {
        let mut err = std::io::stderr().lock();
        if self.current.as_deref() != Some(message_type) {
            if self.current.is_some() {
                let _ = writeln!(err);
            }
            let label = format!("[{message_type}] ");
            let _ = if self.color {
                write!(err, "\x1b[2m{label}")
            } else {
                write!(err, "{label}")
            };
            self.current = Some(message_type.to_owned());
        }
        let _ = write!(err, "{content}");
        if end {
            let _ = if self.color {
                writeln!(err, "\x1b[0m")
            } else {
                writeln!(err)
            };
            self.current = None;
        }
        let _ = err.flush();
    }

    fn answer(&mut self, content: &str) {
        if let Some(_previous) = self.current.take() {
            let mut err = std::io::stderr().lock();
            let _ = if self.color {
                writeln!(err, "\x1b[0m")
            } else {
                writeln!(err)
            };
        }
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{content}");
        let _ = out.flush();
        if !content.is_empty() {
            self.wrote_answer = true;
            self.at_line_start = content.ends_with('\n');
        }
    }

    fn usage(&self, usage: Option<&Value>) {
        if !self.show_usage {
            return;
        }
        let n = |k: &str| {
            usage
                .and_then(|u| u.get(k))
                .and_then(Value::as_u64)
                .map_or_else(|| "unknown".to_owned(), |n| n.to_string())
        };
        eprintln!(
            "Input tokens: {}\nOutput tokens: {}",
            n("in_token"),
            n("out_token")
        );
    }

    /// Handles one gateway event (docs/protocol.md#gateway-events-ndjson-and-sse); `Some` when
    /// the stream is over.
    fn event(&mut self, e: &Value) -> Option<Result<(), InvokeError>> {
        let content = e.get("content").and_then(Value::as_str).unwrap_or("");
        match e.get("type").and_then(Value::as_str) {
            Some("token") => {
                match e.get("message_type").and_then(Value::as_str) {
                    Some(t @ ("thought" | "action" | "observation")) => {
                        let end = e
                            .get("end_of_message")
                            .and_then(Value::as_bool)
                            .unwrap_or(false);
                        // An action's content is the tool's name; its arguments ride beside it.
                        match e.get("arguments").filter(|a| a.is_object()) {
                            Some(args) => self.side(t, &format!("{content} {args}"), end),
                            None => self.side(t, content, end),
                        }
                    }
                    // A prompt's JSON objects: one per line.
                    _ if e.get("object").is_some() => self.answer(&format!("{content}\n")),
                    _ => self.answer(content),
                }
                None
            }
            Some("status") => {
                if e.get("status").and_then(Value::as_str) == Some("restarted") {
                    eprintln!(
                        "\n[the answer restarted on another processor; what follows replaces the text above]"
                    );
                }
                None
            }
            Some("error") => Some(Err(InvokeError::Answer {
                kind: e
                    .get("error_type")
                    .and_then(Value::as_str)
                    .unwrap_or("error")
                    .to_owned(),
                message: content.to_owned(),
            })),
            Some("done") => {
                if self.wrote_answer && !self.at_line_start {
                    println!();
                }
                self.usage(e.get("usage"));
                Some(counts(e))
            }
            _ => None,
        }
    }
}

/// The gateway's URL for `service`, on `flow`'s route when one is named (each segment
/// percent-encoded: a flow id is the user's text).
fn route(base: &str, flow: Option<&str>, service: &str) -> Result<String, InvokeError> {
    let mut url = reqwest::Url::parse(base)
        .map_err(|e| InvokeError::Other(format!("the gateway URL {base:?}: {e}")))?;
    {
        let mut path = url
            .path_segments_mut()
            .map_err(|()| InvokeError::Other(format!("the gateway URL {base:?} has no path")))?;
        path.pop_if_empty().extend(["api", "v1"]);
        match flow {
            Some(flow) => path.extend(["flow", flow, "service", service]),
            None => path.push(service),
        };
    }
    // The agent's thoughts, actions and observations are shown on stderr, so they are asked for:
    // the gateway sends only the answer as tokens otherwise (the event protocol
    // (docs/specs.md#the-event-protocol)).
    if service == "agent" {
        url.set_query(Some("steps=true"));
    }
    Ok(url.into())
}

/// Runs an invocation.
pub async fn run(args: InvokeArgs) -> Result<(), InvokeError> {
    if args.token.is_some() {
        eprintln!(
            "sluice: warning: a token on the command line is visible to other users; prefer SLUICE_TOKEN or SLUICE_TOKEN_FILE"
        );
    }
    let token = match args.token.clone() {
        Some(t) => Some(Secret::new(t)),
        None => Secret::from_env("SLUICE_TOKEN").map_err(|e| InvokeError::Other(e.to_string()))?,
    };
    let (service, body) = args.body()?;
    sluice_runtime::install_crypto_provider();
    let client = reqwest::Client::builder()
        .build()
        .map_err(|e| InvokeError::Other(format!("HTTP client: {e}")))?;
    let url = route(&args.url, args.flow.as_deref(), service)?;
    let request = || {
        let mut request = client.post(&url).json(&body);
        if let Some(t) = &token {
            request = request.bearer_auth(t.expose());
        }
        request.header(
            reqwest::header::ACCEPT,
            if args.no_streaming {
                "application/json"
            } else {
                "application/x-ndjson"
            },
        )
    };
    let resp = request().send().await.map_err(|e| {
        InvokeError::Other(format!(
            "cannot reach the gateway at {url}: {}",
            without_url(&e)
        ))
    })?;
    let status = resp.status();
    let mut printer = Printer {
        show_usage: args.show_usage,
        color: std::io::stderr().is_terminal(),
        current: None,
        wrote_answer: false,
        at_line_start: true,
    };
    if !status.is_success() || args.no_streaming {
        return unstreamed(resp, &mut printer).await;
    }
    // The stream's resume token (a gateway on the durable mapping gives one), and the events
    // (lines) received so far: where a broken stream is resumed.
    let resume_token = resp
        .headers()
        .get("sluice-resume-token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut received: u64 = 0;
    let mut resumes = 0;
    let mut resp = resp;
    loop {
        let broke = match read_events(resp, &mut printer, &mut received).await {
            Ok(()) => return Ok(()),
            Err(ReadEnd::Answer(e)) => return Err(e),
            Err(ReadEnd::Broke(why)) => why,
        };
        let Some(token) = &resume_token else {
            return Err(InvokeError::Other(broke));
        };
        // Another replica may take a moment to be reachable (the dead one's connections are
        // refused until the load balancer notices): each attempt counts.
        resp = loop {
            if resumes == RESUMES {
                return Err(InvokeError::Other(format!(
                    "{broke}; resumed {RESUMES} times, giving up"
                )));
            }
            resumes += 1;
            eprintln!("sluice: {broke}; resuming after event {received} ({resumes} of {RESUMES})");
            tokio::time::sleep(Duration::from_millis(500) * resumes).await;
            match request()
                .header("sluice-resume", format!("{token}.{received}"))
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => break r,
                Ok(r) => {
                    let status = r.status();
                    let text = r.text().await.unwrap_or_default();
                    return Err(InvokeError::Other(format!(
                        "resuming the answer failed: the gateway answered {status}: {}",
                        text.trim()
                    )));
                }
                Err(e) => {
                    eprintln!("sluice: cannot reach the gateway: {}", without_url(&e));
                }
            }
        };
    }
}

impl InvokeArgs {
    /// The service the invocation calls, and the request's body.
    fn body(&self) -> Result<(&'static str, Value), InvokeError> {
        let streaming = !self.no_streaming;
        Ok(match &self.what {
            Invoke::Llm { system, prompt } => (
                "text-completion",
                json!({ "system": system, "prompt": prompt, "streaming": streaming }),
            ),
            Invoke::Prompt { template, terms } => (
                "prompt",
                json!({ "id": template, "terms": prompt_terms(terms)?, "streaming": streaming }),
            ),
            Invoke::Agent {
                question,
                state,
                group,
            } => (
                "agent",
                json!({
                    "question": question,
                    "state": state,
                    "group": if group.is_empty() { None } else { Some(group) },
                    "history": [],
                    "streaming": streaming,
                }),
            ),
        })
    }
}

/// An answer that is not a stream of events: a whole answer (`--no-streaming`), or a refusal
/// (an HTTP error status; to a streaming caller, an `error` event then `done`).
async fn unstreamed(resp: reqwest::Response, printer: &mut Printer) -> Result<(), InvokeError> {
    let status = resp.status();
    let text = resp.text().await.map_err(|e| {
        InvokeError::Other(format!("reading the answer failed: {}", without_url(&e)))
    })?;
    let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    // A refusal to a streaming caller comes as NDJSON events: an `error`, then `done`.
    if let Some(e) = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|e| e.get("type").and_then(Value::as_str) == Some("error"))
        && let Some(Err(err)) = printer.event(&e)
    {
        return Err(err);
    }
    if let Some(err) = value.get("error").filter(|e| !e.is_null()) {
        return Err(InvokeError::Answer {
            kind: err
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("error")
                .to_owned(),
            message: err
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned(),
        });
    }
    if !status.is_success() {
        return Err(InvokeError::Other(format!("the gateway answered {status}")));
    }
    whole(printer, &value)
}

/// How many times a broken answer stream is resumed.
const RESUMES: u32 = 5;

/// How reading an answer stream ended, other than with its `done` event.
enum ReadEnd {
    /// The answer is an error (or the caller's result otherwise settled).
    Answer(InvokeError),
    /// The stream broke off before its end: why.
    Broke(String),
}

/// Prints the events of `resp` as they arrive, counting the whole lines in `received`, until
/// the `done` event.
async fn read_events(
    resp: reqwest::Response,
    printer: &mut Printer,
    received: &mut u64,
) -> Result<(), ReadEnd> {
    let mut lines = LineSplitter::new(1 << 24);
    let mut body = resp.bytes_stream();
    loop {
        let chunk = body.next().await;
        let done = chunk.is_none();
        let items = match chunk {
            Some(Ok(bytes)) => lines.push(&bytes),
            Some(Err(e)) => {
                return Err(ReadEnd::Broke(format!(
                    "the answer stream broke off: {}",
                    without_url(&e)
                )));
            }
            None => lines.finish().into_iter().collect(),
        };
        for line in items {
            *received += 1;
            let Ok(line) = line else { continue };
            let Ok(event) = serde_json::from_str::<Value>(&line.text) else {
                continue;
            };
            match printer.event(&event) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(ReadEnd::Answer(e)),
                None => {}
            }
        }
        if done {
            return Err(ReadEnd::Broke(
                "the answer stream ended without a `done` event".into(),
            ));
        }
    }
}

fn whole(printer: &mut Printer, record: &Value) -> Result<(), InvokeError> {
    let text = |k: &str| {
        record
            .get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    if let Some(t) = text("response")
        .or(text("text"))
        .or(text("object"))
        .or(text("content"))
    {
        printer.answer(t);
        println!();
    }
    printer.usage(Some(record));
    counts(record)
}

/// A `jsonl` prompt's counts, from a `done` event or a whole answer: skipped lines are
/// reported on stderr, and an answer whose every line was skipped is an error (exit 1), so
/// a script does not take "nothing printed" for "nothing found".
fn counts(v: &Value) -> Result<(), InvokeError> {
    let n = |k: &str| v.get(k).and_then(Value::as_u64);
    // The NDJSON parser contract's (docs/specs.md#the-structured-ndjson-contracts) "Classified 8/10
    // blocks. 2 pending.": the request's items the answer left out, for the user to ask again.
    if let (Some(expected), Some(answered)) = (n("items_expected"), n("items_answered")) {
        let pending: Vec<&str> = v
            .get("items_pending")
            .and_then(Value::as_array)
            .map(|p| p.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !pending.is_empty() {
            eprintln!(
                "sluice: answered {answered} of {expected} items; {} pending: {}",
                pending.len(),
                pending.join(", ")
            );
        }
    }
    let (Some(objects), Some(skipped)) = (n("objects_emitted"), n("lines_skipped")) else {
        return Ok(());
    };
    let lines = if skipped == 1 { "line" } else { "lines" };
    if objects == 0 && skipped > 0 {
        return Err(InvokeError::Other(format!(
            "no objects: every line of the model's answer was skipped ({skipped} {lines}: malformed JSON or not matching the template's schema; the prompt processor's log says why, line by line)"
        )));
    }
    if skipped > 0 {
        eprintln!(
            "sluice: warning: {skipped} {lines} of the model's answer skipped ({objects} objects printed)"
        );
    }
    Ok(())
}

/// A reqwest error's message without the URL (which could carry credentials in userinfo).
fn without_url(e: &reqwest::Error) -> String {
    let mut e = e.to_string();
    if let Some(i) = e.find(" for url (") {
        e.truncate(i);
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flow_picks_the_route() {
        assert_eq!(
            route("http://gw:8088", None, "agent").unwrap(),
            "http://gw:8088/api/v1/agent?steps=true"
        );
        assert_eq!(
            route("http://gw:8088/", Some("default"), "text-completion").unwrap(),
            "http://gw:8088/api/v1/flow/default/service/text-completion"
        );
        assert_eq!(
            route("http://gw:8088/base", Some("a b/c"), "prompt").unwrap(),
            "http://gw:8088/base/api/v1/flow/a%20b%2Fc/service/prompt"
        );
        assert!(route("not a url", None, "agent").is_err());
    }
}
