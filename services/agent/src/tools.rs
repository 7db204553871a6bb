//! Tools: configured from a JSON file, filtered by TrustGraph's group and state rules, and
//! invoked. A tool's failure is not the dialog's: it becomes the observation the model sees.
//!
//! ```json
//! {"tools": [
//!   {"name": "facts", "description": "...", "type": "prompt", "template": "facts",
//!    "arguments": [{"name": "topic", "type": "string", "description": "..."}]},
//!   {"name": "ask", "description": "...", "type": "text-completion",
//!    "arguments": [{"name": "question", "type": "string", "description": "..."}]},
//!   {"name": "search", "description": "...", "type": "mcp", "url": "http://mcp:8000/mcp",
//!    "tool": "web_search", "token-env": "SEARCH_MCP_TOKEN"},
//!   {"name": "lookup", "description": "...", "type": "service",
//!    "request-topic": "request:tg:lookup", "response-topic": "response:tg:lookup"}
//! ],
//!  "groups": ...}
//! ```
//!
//! Every tool may carry `group` (default `["default"]`), `applicable-states` (the request's
//! `state` must be one of them) and `next-state` (the state of the next iteration after the
//! tool ran), as TrustGraph's tools do. A request with no `group` sees the `default` group.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use serde::Deserialize;
use serde_json::Value;
use sluice_runtime::{
    client::{RequestClient, RequestOptions},
    reader::{Failure, Meter, ReadPolicy, Reader, Report},
    secret::{Secret, SecretError},
};
use sluice_schema::{
    Error, ErrorKind, PromptRequest, PromptResponse, ResponseRecord, TextCompletionRequest,
    TextCompletionResponse, add_tokens,
};

use crate::{
    mcp::{McpClient, McpError},
    patterns::route::Routing,
};

/// One argument of a tool, as the model is told about it.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
pub struct ToolArgument {
    /// Its name.
    pub name: String,
    /// Its JSON type, e.g. `string`.
    #[serde(default = "string_type", rename = "type")]
    pub kind: String,
    /// What it means.
    #[serde(default)]
    pub description: String,
}

fn string_type() -> String {
    "string".into()
}

/// How a tool is implemented.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ToolKind {
    /// A prompt template, its terms the tool's arguments.
    Prompt {
        /// The template id.
        template: String,
    },
    /// A text completion: the `question` (or the only) argument is the prompt.
    TextCompletion {
        /// An optional system prompt.
        #[serde(default)]
        system: Option<String>,
    },
    /// A tool on an MCP server (streamable HTTP).
    Mcp {
        /// The server's endpoint.
        url: String,
        /// The tool's name on the server (default: this tool's name).
        #[serde(default)]
        tool: Option<String>,
        /// The environment variable (or its `_FILE` twin) holding a bearer token.
        #[serde(default, rename = "token-env")]
        token_env: Option<String>,
        /// A bearer token given by TrustGraph's config (its `mcp` entry's `auth-token`);
        /// never read from a tools file, which takes `token-env` instead.
        #[serde(skip)]
        token: Option<sluice_runtime::secret::Secret>,
    },
    /// Any service with a request/response topic pair: the arguments are the request.
    Service {
        /// Its request topic (`class:topicspace:topic` or a URL).
        #[serde(rename = "request-topic")]
        request_topic: String,
        /// Its response topic.
        #[serde(rename = "response-topic")]
        response_topic: String,
    },
}

/// A configured tool.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ToolConfig {
    /// The name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: String,
    /// Its arguments, for the model.
    #[serde(default)]
    pub arguments: Vec<ToolArgument>,
    /// Groups it belongs to.
    #[serde(default = "default_group")]
    pub group: Vec<String>,
    /// States in which it may be used (any, when absent).
    #[serde(default, rename = "applicable-states")]
    pub applicable_states: Option<Vec<String>>,
    /// The state after it is used (unchanged, when absent).
    #[serde(default, rename = "next-state")]
    pub next_state: Option<String>,
    /// Its implementation.
    #[serde(flatten)]
    pub kind: ToolKind,
}

fn default_group() -> Vec<String> {
    vec!["default".into()]
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolFile {
    #[serde(default)]
    tools: Vec<ToolConfig>,
    /// Meta-routing's task types, as a TrustGraph workspace's `agent-task-type` entries.
    #[serde(default, rename = "agent-task-type")]
    task_types: BTreeMap<String, Value>,
    /// Meta-routing's patterns, as a TrustGraph workspace's `agent-pattern` entries.
    #[serde(default, rename = "agent-pattern")]
    patterns: BTreeMap<String, Value>,
}

/// Why the tools could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum ToolConfigError {
    /// The file could not be read.
    #[error("cannot read the tools file {0}: {1}")]
    Read(String, std::io::Error),
    /// The file is not valid.
    #[error("the tools file {0} is not valid: {1}")]
    Parse(String, ToolsFileError),
}

/// What is wrong with a tools file's text.
#[derive(Debug, thiserror::Error)]
pub enum ToolsFileError {
    /// It is not the tools file's JSON (serde's words: a line, a column, the field).
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// Two tools share a name.
    #[error("tool {0:?} is defined twice")]
    Duplicate(String),
}

/// Reads a tools file.
pub fn load(path: &Path) -> Result<Vec<ToolConfig>, ToolConfigError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|e| ToolConfigError::Read(shown.clone(), e))?;
    parse(&text).map_err(|e| ToolConfigError::Parse(shown, e))
}

/// Reads meta-routing's task types and patterns from a tools file (its `agent-task-type` and
/// `agent-pattern` objects; TrustGraph's defaults when it has none).
pub fn load_routing(path: &Path) -> Result<Routing, ToolConfigError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|e| ToolConfigError::Read(shown.clone(), e))?;
    let file: ToolFile = serde_json::from_str(&text)
        .map_err(|e| ToolConfigError::Parse(shown, ToolsFileError::Json(e)))?;
    Ok(Routing::from_file_entries(&file.task_types, &file.patterns))
}

/// Parses a tools file's text.
pub fn parse(text: &str) -> Result<Vec<ToolConfig>, ToolsFileError> {
    let file: ToolFile = serde_json::from_str(text)?;
    let mut seen = std::collections::BTreeSet::new();
    for t in &file.tools {
        if !seen.insert(t.name.clone()) {
            return Err(ToolsFileError::Duplicate(t.name.clone()));
        }
    }
    Ok(file.tools)
}

/// The tools of one workspace of TrustGraph's config service: its `tool` entries (each a
/// JSON object: `type`, `name`, `description`, `arguments`, `group`, `applicable-states`,
/// `state` for the next state) and the `mcp` entries the `mcp-tool` tools name (`url`,
/// `remote-name`, `auth-token`). sluice's agent calls MCP servers itself, so TrustGraph's
/// mcp-tool service is not needed. Returns the tools it can serve and, for each it cannot
/// (a type that needs TrustGraph's knowledge services, an unknown MCP server, an unreadable
/// entry), a message naming the entry. Values are never quoted: they may hold tokens.
pub fn from_trustgraph_config(
    tools: &BTreeMap<String, String>,
    mcp: &BTreeMap<String, String>,
) -> (Vec<ToolConfig>, Vec<String>) {
    let mut served = Vec::new();
    let mut problems = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    for (key, value) in tools {
        match tool_from_entry(value, mcp) {
            Ok(tool) if !names.insert(tool.name.clone()) => {
                problems.push(format!(
                    "tool entry {key:?}: the name {:?} is taken",
                    tool.name
                ));
            }
            Ok(tool) => served.push(tool),
            Err(e) => problems.push(format!("tool entry {key:?}: {e}")),
        }
    }
    (served, problems)
}

fn tool_from_entry(value: &str, mcp: &BTreeMap<String, String>) -> Result<ToolConfig, String> {
    let data: Value =
        serde_json::from_str(value).map_err(|e| format!("not a JSON object ({e})"))?;
    let text = |field: &str| data.get(field).and_then(Value::as_str).map(str::to_owned);
    let strings = |field: &str| -> Result<Option<Vec<String>>, String> {
        match data.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v.clone())
                .map(Some)
                .map_err(|_| format!("`{field}` must be a list of strings")),
        }
    };
    let name = text("name").ok_or("no `name`")?;
    let kind = match text("type").as_deref() {
        Some("prompt") => ToolKind::Prompt {
            template: text("template").ok_or("a prompt tool needs `template`")?,
        },
        Some("text-completion") => ToolKind::TextCompletion { system: None },
        Some("mcp-tool") => {
            let id = text("mcp-tool").ok_or("an mcp-tool tool needs `mcp-tool`")?;
            let server: Value = mcp
                .get(&id)
                .ok_or_else(|| format!("names the MCP server {id:?}, which has no `mcp` entry"))
                .and_then(|v| {
                    serde_json::from_str(v)
                        .map_err(|e| format!("the `mcp` entry {id:?} is not JSON ({e})"))
                })?;
            let field = |f: &str| server.get(f).and_then(Value::as_str).map(str::to_owned);
            ToolKind::Mcp {
                url: field("url").ok_or_else(|| format!("the `mcp` entry {id:?} has no `url`"))?,
                tool: Some(field("remote-name").unwrap_or_else(|| id.clone())),
                token_env: None,
                token: field("auth-token")
                    .filter(|t| !t.is_empty())
                    .map(sluice_runtime::secret::Secret::new),
            }
        }
        Some(other) => {
            return Err(format!(
                "type {other:?} is not served by sluice's agent (it serves prompt, text-completion and mcp-tool tools)"
            ));
        }
        None => return Err("no `type`".into()),
    };
    let mut arguments: Vec<ToolArgument> = match data.get("arguments") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
            format!("`arguments` must be a list of {{name, type, description}} ({e})")
        })?,
    };
    // TrustGraph's text-completion tool takes no arguments from its config: it always has
    // the one, `question`.
    if arguments.is_empty() && matches!(kind, ToolKind::TextCompletion { .. }) {
        arguments.push(ToolArgument {
            name: "question".into(),
            kind: string_type(),
            description: "The text prompt or question for completion".into(),
        });
    }
    Ok(ToolConfig {
        name,
        description: text("description").unwrap_or_default(),
        arguments,
        group: strings("group")?.unwrap_or_else(default_group),
        applicable_states: strings("applicable-states")?,
        next_state: text("state").or_else(|| text("next-state")),
        kind,
    })
}

/// The tools a request may use: in one of its groups (`default` when it names none) and
/// applicable in its state.
pub fn available<'a>(
    tools: &'a [Arc<Tool>],
    group: Option<&[String]>,
    state: Option<&str>,
) -> Vec<&'a Arc<Tool>> {
    let default = default_group();
    let groups = group.unwrap_or(&default);
    tools
        .iter()
        .filter(|t| t.config.group.iter().any(|g| groups.contains(g)))
        .filter(|t| match (&t.config.applicable_states, state) {
            (None, _) => true,
            (Some(states), Some(s)) => states.iter().any(|x| x == s),
            (Some(_), None) => false,
        })
        .collect()
}

/// A generic response record, for `service` tools: any JSON object; terminal when it says
/// `end_of_stream`, `end_of_dialog` or `complete`, or carries an error.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(transparent)]
pub struct AnyResponse {
    value: Value,
    #[serde(skip)]
    error: Option<Error>,
}

impl<'de> Deserialize<'de> for AnyResponse {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        let error = value
            .get("error")
            .filter(|e| !e.is_null())
            .and_then(|e| serde_json::from_value::<Error>(e.clone()).ok());
        Ok(Self { value, error })
    }
}

impl ResponseRecord for AnyResponse {
    fn is_terminal(&self) -> bool {
        let flag = |k: &str| self.value.get(k).and_then(Value::as_bool).unwrap_or(false);
        self.error.is_some() || flag("end_of_stream") || flag("end_of_dialog") || flag("complete")
    }

    fn from_error(error: Error) -> Self {
        Self {
            value: serde_json::json!({"error": {"type": error.kind, "message": error.message}}),
            error: Some(error),
        }
    }

    fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }
}

/// How a tool reaches what implements it.
pub enum Backend {
    /// Through the prompt service.
    Prompt(Arc<RequestClient<PromptRequest, PromptResponse>>),
    /// Through the text-completion service.
    TextCompletion(Arc<RequestClient<TextCompletionRequest, TextCompletionResponse>>),
    /// An MCP server.
    Mcp(McpClient),
    /// A service on the bus.
    Service(RequestClient<Value, AnyResponse>),
}

/// A tool ready to be invoked.
pub struct Tool {
    /// Its configuration.
    pub config: ToolConfig,
    /// What implements it.
    pub backend: Backend,
}

impl std::fmt::Debug for Tool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.config.name)
            .finish_non_exhaustive()
    }
}

/// The secret a `token-env` names, if set.
pub fn token(var: Option<&str>) -> Result<Option<Secret>, SecretError> {
    match var {
        Some(v) => Secret::from_env(v),
        None => Ok(None),
    }
}

impl Tool {
    /// Invokes the tool: its result (`Err` is an error to show the model as the observation)
    /// and the tokens its call spent on models. `on_behalf`: the options of a request made
    /// for the agent's request (`RequestContext::on_behalf`): the key and the gateway's seal
    /// of it go on to the services the tool calls, whose usage it is billed, and the origin
    /// to their request logs.
    pub async fn invoke(
        &self,
        arguments: &BTreeMap<String, String>,
        on_behalf: RequestOptions,
        timeout: Duration,
    ) -> (Result<String, ToolError>, Tokens) {
        let options = RequestOptions {
            total_timeout: Some(timeout),
            ..on_behalf
        };
        let spent = Spent::default();
        let work = async {
            match &self.backend {
                Backend::Prompt(client) => {
                    let ToolKind::Prompt { template } = &self.config.kind else {
                        return Err(ToolError::Failed("misconfigured prompt tool".to_owned()));
                    };
                    let terms = arguments
                        .iter()
                        .map(|(k, v)| (k.clone(), Value::String(v.clone()).to_string()))
                        .collect();
                    let request = PromptRequest {
                        id: template.clone(),
                        terms,
                        streaming: false,
                    };
                    let reader = client.read(&request, options, read_policy()).await;
                    let last = metered(reader, &spent)?.last().await;
                    let last = last.map_err(observation)?;
                    Ok(last.text.or(last.object).unwrap_or_default())
                }
                Backend::TextCompletion(client) => {
                    let system = match &self.config.kind {
                        ToolKind::TextCompletion { system } => system.clone().unwrap_or_default(),
                        _ => String::new(),
                    };
                    let prompt = arguments
                        .get("question")
                        .or_else(|| arguments.values().next())
                        .cloned()
                        .unwrap_or_default();
                    let request = TextCompletionRequest {
                        system,
                        prompt,
                        ..TextCompletionRequest::default()
                    };
                    let reader = client.read(&request, options, read_policy()).await;
                    metered(reader, &spent)?.text().await.map_err(observation)
                }
                Backend::Mcp(client) => {
                    let remote = match &self.config.kind {
                        ToolKind::Mcp { tool: Some(t), .. } => t.clone(),
                        _ => self.config.name.clone(),
                    };
                    let args: serde_json::Map<String, Value> = arguments
                        .iter()
                        .map(|(k, v)| {
                            // Arguments arrive as strings; send JSON values as such.
                            let value = serde_json::from_str(v)
                                .ok()
                                .filter(|x: &Value| !x.is_string())
                                .unwrap_or_else(|| Value::String(v.clone()));
                            (k.clone(), value)
                        })
                        .collect();
                    let result = client
                        .call(&remote, Value::Object(args))
                        .await
                        .map_err(|e| match e {
                            McpError::Timeout { .. } => ToolError::TimedOut(e.to_string()),
                            other => failed(other.to_string()),
                        })?;
                    if result.is_error {
                        Err(ToolError::Failed(result.text))
                    } else {
                        Ok(result.text)
                    }
                }
                Backend::Service(client) => {
                    let request =
                        serde_json::to_value(arguments).map_err(|e| failed(e.to_string()))?;
                    let reader = client.read(&request, options, read_policy()).await;
                    let last = metered(reader, &spent)?.last().await;
                    Ok(last.map_err(observation)?.value.to_string())
                }
            }
        };
        let result = tokio::time::timeout(timeout, work)
            .await
            .unwrap_or_else(|_| {
                Err(ToolError::TimedOut(format!(
                    "the tool did not answer within {} s",
                    timeout.as_secs()
                )))
            });
        // Read after the call ended however it ended (a failure, the time limit): the tokens
        // of what was answered before are spent all the same.
        (result, spent.counts())
    }
}

/// Token counts (input, output) of a tool call's model calls, as their answers' records
/// report them; `None` where none reported any.
pub type Tokens = (Option<u64>, Option<u64>);

/// What a tool call's answer reported spending: the answer's records are metered as they are
/// read, so a call cut short by a failure or the time limit still says what it spent. A
/// prompt or text-completion tool's model call is billed to the dialog's caller (the key is
/// forwarded), and the dialog passes these counts on with its own records, so the gateway's
/// per-key token limits count them as the ledger bills them.
#[derive(Debug, Default, Clone)]
struct Spent(Arc<Mutex<Tokens>>);

impl Spent {
    fn counts(&self) -> Tokens {
        // A poisoned lock still holds the counts written before the panic.
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Meter for Spent {
    fn tokens(&mut self, input: u64, output: u64) {
        let mut t = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        t.0 = add_tokens(t.0, Some(input));
        t.1 = add_tokens(t.1, Some(output));
    }
}

/// The answer's reader, its records metered into `spent`; a refused request as the
/// observation.
fn metered<R: ResponseRecord, P>(
    reader: Result<Reader<R, P>, Failure<R>>,
    spent: &Spent,
) -> Result<Reader<R, P>, ToolError> {
    let mut reader = reader.map_err(observation)?;
    reader.meter(Box::new(spent.clone()));
    Ok(reader)
}

/// Why a tool call gave no result. Either way its text becomes the observation; the kind is
/// for metrics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// The tool failed (an error answer, a refusal, an unreachable backend).
    #[error("{0}")]
    Failed(String),
    /// The tool did not answer within its time limit.
    #[error("{0}")]
    TimedOut(String),
}

fn failed(message: impl Into<String>) -> ToolError {
    ToolError::Failed(message.into())
}

/// How a tool reads its service's answer: a restart drops what came before (the final
/// attempt is the answer); a client-side failure in the client's own words (the observation
/// names the tool, not the service behind it).
fn read_policy() -> ReadPolicy<Report> {
    ReadPolicy::new(Report, |e| e.as_error(ErrorKind::Agent))
}

/// The observation a failed answer is: the service's own error as its type and message; the
/// client's failure in its words, a time limit as such.
fn observation<R>(f: Failure<R>) -> ToolError {
    match f.record {
        Some(_) => failed(format!("{}: {}", f.error.kind, f.error.message)),
        None if f.error.kind == ErrorKind::Timeout => ToolError::TimedOut(f.error.message),
        None => failed(f.error.message),
    }
}

/// The error a tool-configuration problem is reported as at start-up.
pub fn config_error(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::NoConfiguration, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tools docker-compose.yml's agent serves load, and name the template they use.
    #[test]
    fn the_compose_tools_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/compose/tools.json");
        let tools = load(&path).unwrap();
        let names: Vec<_> = tools.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["ask-llm", "answer-briefly"]);
        assert!(matches!(&tools[1].kind, ToolKind::Prompt { template } if template == "question"));
    }

    #[test]
    fn trustgraph_tool_entries_become_tools_and_what_cannot_be_served_is_named() {
        let tools: BTreeMap<String, String> = [
            (
                "ask",
                r#"{"name": "ask-llm", "type": "text-completion", "description": "Ask"}"#,
            ),
            (
                "greet",
                r#"{"name": "greet", "type": "prompt", "template": "greet", "group": ["g"],
                          "applicable-states": ["s1"], "state": "s2",
                          "arguments": [{"name": "who", "type": "string", "description": "Who"}]}"#,
            ),
            (
                "search",
                r#"{"name": "search", "type": "mcp-tool", "mcp-tool": "web"}"#,
            ),
            ("kq", r#"{"name": "kq", "type": "knowledge-query"}"#),
            ("zdup", r#"{"name": "greet", "type": "text-completion"}"#),
            (
                "lost",
                r#"{"name": "lost", "type": "mcp-tool", "mcp-tool": "nowhere"}"#,
            ),
            ("bad", "{not json"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let mcp: BTreeMap<String, String> = [(
            "web".to_owned(),
            r#"{"url": "http://mcp:8000/mcp", "remote-name": "web_search", "auth-token": "tok-123"}"#
                .to_owned(),
        )]
        .into();
        let (served, problems) = from_trustgraph_config(&tools, &mcp);
        let names: Vec<&str> = served.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["ask-llm", "greet", "search"]);
        assert_eq!(served[0].arguments[0].name, "question");
        assert_eq!(served[0].group, ["default"]);
        assert_eq!(served[1].group, ["g"]);
        assert_eq!(
            served[1].applicable_states.as_deref(),
            Some(&["s1".to_owned()][..])
        );
        assert_eq!(served[1].next_state.as_deref(), Some("s2"));
        match &served[2].kind {
            ToolKind::Mcp {
                url, tool, token, ..
            } => {
                assert_eq!(url, "http://mcp:8000/mcp");
                assert_eq!(tool.as_deref(), Some("web_search"));
                assert_eq!(token.as_ref().map(|t| t.expose()), Some("tok-123"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(problems.len(), 4, "{problems:?}");
        let all = problems.join("\n");
        assert!(
            all.contains("knowledge-query") && all.contains("is taken"),
            "{all}"
        );
        assert!(
            all.contains("\"nowhere\"") && all.contains("\"bad\""),
            "{all}"
        );
        assert!(!all.contains("tok-123"), "a token is never in a message");
    }

    const FILE: &str = r#"{"tools": [
        {"name": "facts", "description": "Facts", "type": "prompt", "template": "facts",
         "arguments": [{"name": "topic", "description": "what about"}]},
        {"name": "ask", "type": "text-completion", "group": ["research"]},
        {"name": "search", "type": "mcp", "url": "http://127.0.0.1:1/mcp", "applicable-states": ["searching"], "next-state": "done"},
        {"name": "lookup", "type": "service", "request-topic": "request:tg:lookup", "response-topic": "response:tg:lookup"}
    ]}"#;

    #[test]
    fn tools_parse_with_their_filters() {
        let tools = parse(FILE).unwrap();
        assert_eq!(tools.len(), 4);
        assert_eq!(
            tools[0].kind,
            ToolKind::Prompt {
                template: "facts".into()
            }
        );
        assert_eq!(tools[0].arguments[0].kind, "string");
        assert_eq!(tools[1].group, ["research"]);
        assert_eq!(tools[2].next_state.as_deref(), Some("done"));
        assert!(parse(r#"{"tools": [{"name": "x", "type": "teleport"}]}"#).is_err());
        assert!(parse(r#"{"tools": [{"name": "x", "type": "text-completion"}, {"name": "x", "type": "text-completion"}]}"#)
            .unwrap_err()
            .to_string()
            .contains("twice"));
    }

    #[test]
    fn groups_and_states_filter_as_trustgraph_does() {
        let tools: Vec<Arc<Tool>> = parse(FILE)
            .unwrap()
            .into_iter()
            .map(|config| {
                Arc::new(Tool {
                    config,
                    backend: Backend::Mcp(
                        McpClient::new("http://127.0.0.1:1/mcp", None, Default::default()).unwrap(),
                    ),
                })
            })
            .collect();
        let names = |g: Option<&[String]>, s: Option<&str>| -> Vec<String> {
            available(&tools, g, s)
                .iter()
                .map(|t| t.config.name.clone())
                .collect()
        };
        assert_eq!(names(None, None), ["facts", "lookup"]);
        assert_eq!(names(Some(&["research".into()]), None), ["ask"]);
        assert_eq!(
            names(None, Some("searching")),
            ["facts", "search", "lookup"]
        );
    }

    /// A standalone agent's meta-routing choices sit in its tools file beside the tools, as
    /// a TrustGraph workspace's `agent-task-type` and `agent-pattern` entries.
    #[test]
    fn a_tools_file_carries_meta_routing_entries() {
        let text = r#"{"tools": [{"name": "ask", "type": "text-completion", "description": "Ask"}],
            "agent-task-type": {"research": {"valid_patterns": ["plan-then-execute"], "framing": "F"},
                                "chat": {"description": "Small talk"}},
            "agent-pattern": {"plan-then-execute": {"description": "Plan"}}}"#;
        assert_eq!(parse(text).unwrap().len(), 1);
        let path = std::env::temp_dir().join(format!("sluice-routing-{}.json", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let routing = load_routing(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let entries = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert_eq!(
            routing,
            Routing::from_entries(
                &entries(&[
                    ("chat", r#"{"description":"Small talk"}"#),
                    (
                        "research",
                        r#"{"framing":"F","valid_patterns":["plan-then-execute"]}"#
                    ),
                ]),
                &entries(&[("plan-then-execute", r#"{"description":"Plan"}"#)]),
            )
        );
        assert_ne!(routing, Routing::default());
    }
}
