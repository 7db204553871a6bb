//! Templates: loading (sluice's file shape and TrustGraph's `template.<id>` config shape),
//! compiling, and rendering with the request's terms.
//!
//! Rendering is strict: a variable the template uses but the request does not give is an
//! error naming the variable, where TrustGraph silently renders it empty.

use std::{
    collections::BTreeMap,
    fmt,
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use minijinja::{Environment, UndefinedBehavior};
use serde::Deserialize;
use serde_json::Value;

use crate::{
    ResponseType, builtin,
    normalise::{self, Normaliser},
};

/// The `origin` of the templates compiled into the binary.
const BUILTIN_ORIGIN: &str = "built-in";

/// One template, compiled.
pub struct Template {
    /// Its id.
    pub id: String,
    /// The system prompt it overrides the global one with.
    pub system: Option<String>,
    /// The output mode.
    pub response_type: ResponseType,
    /// The schema, for `json` and `jsonl`.
    pub schema: Option<Value>,
    /// The compiled schema, compiled when it is first needed ([`Template::validator`]): the
    /// built-in set's dozen validators held 12 MB, most of an idle process's heap.
    validator: OnceLock<Result<jsonschema::Validator, String>>,
    /// Corrections applied before validation (the normaliser the template names).
    pub normalise: Option<Normaliser>,
    /// The rules that need the request, which come with the normaliser.
    pub answers: Option<&'static normalise::Answers>,
    /// The settings its calls to text-completion ask for.
    pub call: CallSettings,
    /// Where it came from: `built-in` or the file.
    pub origin: String,
}

/// A template's settings for its calls, sent with each (each overrides the text-completion
/// processor's own setting; absent leaves it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallSettings {
    /// The temperature, 0 to 2.
    pub temperature: Option<f64>,
    /// The most output tokens.
    pub max_tokens: Option<u32>,
    /// How its calls are retried: a `sluice_schema::RetryPolicy` line, applied over the
    /// text-completion processor's policy.
    pub retry: Option<String>,
}

impl CallSettings {
    fn check(&self) -> Result<(), String> {
        match self.temperature {
            Some(t) if !(0.0..=2.0).contains(&t) => {
                return Err(format!("temperature {t} is outside 0 to 2"));
            }
            _ if self.max_tokens == Some(0) => return Err("max-tokens must be at least 1".into()),
            _ => {}
        }
        // Checked over the default policy: each setting is checked on its own, so a line
        // valid here is valid over any processor's policy.
        if let Some(line) = &self.retry {
            sluice_schema::RetryPolicy::parse(line).map_err(|e| format!("retry: {e}"))?;
        }
        Ok(())
    }
}

impl Template {
    /// The compiled schema (`json` and `jsonl` templates), compiled on first use. A file's
    /// schema was compiled once when the file was loaded, and the built-in schemas are
    /// compiled by their tests, so the error is for a schema that compiled before and no
    /// longer does: never skipped, it fails the object it should have checked.
    pub fn validator(&self) -> Option<Result<&jsonschema::Validator, &str>> {
        let schema = self.schema.as_ref()?;
        Some(
            self.validator
                .get_or_init(|| jsonschema::validator_for(schema).map_err(|e| e.to_string()))
                .as_ref()
                .map_err(String::as_str),
        )
    }
}

impl fmt::Debug for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Template")
            .field("id", &self.id)
            .field("response_type", &self.response_type)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

/// Why templates could not be loaded. The previous set stays in use.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read the template file {0}: {1}")]
    Read(PathBuf, std::io::Error),
    /// The file is not the expected JSON.
    #[error("the template file {0} is not valid: {1}")]
    Parse(PathBuf, String),
    /// A template does not compile.
    #[error("template {id:?} ({origin}) does not compile: {message}")]
    Template {
        /// The template.
        id: String,
        /// Where it came from.
        origin: String,
        /// The compiler's message.
        message: String,
    },
    /// A template's schema is not a valid JSON Schema.
    #[error("template {id:?} ({origin}) has an invalid schema: {message}")]
    Schema {
        /// The template.
        id: String,
        /// Where it came from.
        origin: String,
        /// What is wrong.
        message: String,
    },
}

/// Why a request's prompt could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// No template has this id.
    #[error("unknown template {id:?}; the templates are: {known}")]
    Unknown {
        /// The id asked for.
        id: String,
        /// The ids that exist, comma-separated.
        known: String,
    },
    /// Rendering failed, usually a variable the request did not give.
    #[error("template {id:?} cannot be rendered with the request's terms: {message}")]
    Render {
        /// The template.
        id: String,
        /// What went wrong (minijinja's message with the line).
        message: String,
    },
}

/// What a request renders to.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// The system prompt.
    pub system: String,
    /// The prompt.
    pub prompt: String,
    /// The template (for its mode, schema and normaliser).
    pub template: Arc<Template>,
}

/// A set of compiled templates and the global system prompt. Immutable: a reload builds a
/// new set, so requests in flight keep the one they started with.
pub struct TemplateSet {
    env: Environment<'static>,
    templates: BTreeMap<String, Arc<Template>>,
    system: String,
}

impl fmt::Debug for TemplateSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TemplateSet")
            .field("templates", &self.templates.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A template as a file gives it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTemplate {
    prompt: String,
    #[serde(default)]
    system: Option<String>,
    #[serde(default, rename = "response-type", alias = "response_type")]
    response_type: ResponseType,
    #[serde(default)]
    schema: Option<Value>,
    /// The name of a normaliser ([`normalise::by_name`]): a file template that replaces a
    /// built-in keeps its corrections by naming the built-in's.
    #[serde(default)]
    normaliser: Option<String>,
    /// The sampling temperature its calls ask for.
    #[serde(default)]
    temperature: Option<f64>,
    /// The most output tokens its calls ask for.
    #[serde(default, rename = "max-tokens", alias = "max_tokens")]
    max_tokens: Option<u32>,
    /// How its calls are retried (a retry policy line: `seed-002`, `attempts=2,delay=2s`).
    #[serde(default)]
    retry: Option<String>,
}

/// Reads a TrustGraph config value that may be JSON-encoded into a string.
fn decoded<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, String> {
    match v {
        Value::String(s) => serde_json::from_str(&s).map_err(|e| e.to_string()),
        other => serde_json::from_value(other).map_err(|e| e.to_string()),
    }
}

struct Source {
    id: String,
    prompt: String,
    system: Option<String>,
    response_type: ResponseType,
    schema: Option<Value>,
    normalise: Option<Normaliser>,
    answers: Option<&'static normalise::Answers>,
    call: CallSettings,
    origin: String,
    /// Compiled into the binary (its schema is checked by the tests, not at each load).
    builtin: bool,
}

/// Parses a template file: `{"system": ..., "templates": {id: {...}}}`, or TrustGraph's
/// config shape `{"system": ..., "template.<id>": {...} or "<JSON string>", ...}`.
fn parse_file(path: &Path, text: &str) -> Result<(Option<String>, Vec<Source>), LoadError> {
    let err = |m: String| LoadError::Parse(path.to_owned(), m);
    let root: BTreeMap<String, Value> =
        serde_json::from_str(text).map_err(|e| err(format!("{e}")))?;
    let origin = path.display().to_string();
    let mut system = None;
    let mut sources = Vec::new();
    let mut add = |id: &str, v: Value| -> Result<(), LoadError> {
        let t: FileTemplate = decoded(v).map_err(|e| err(format!("template {id:?}: {e}")))?;
        let normalise = match &t.normaliser {
            None => None,
            Some(name) => Some(normalise::by_name(name).ok_or_else(|| {
                err(format!(
                    "template {id:?}: unknown normaliser {name:?}; the normalisers are: {}",
                    normalise::names().collect::<Vec<_>>().join(", ")
                ))
            })?),
        };
        let call = CallSettings {
            temperature: t.temperature,
            max_tokens: t.max_tokens,
            retry: t.retry,
        };
        call.check()
            .map_err(|m| err(format!("template {id:?}: {m}")))?;
        sources.push(Source {
            id: id.to_owned(),
            prompt: t.prompt,
            system: t.system,
            response_type: t.response_type,
            schema: t.schema,
            normalise,
            answers: t.normaliser.as_deref().and_then(normalise::answers),
            call,
            origin: origin.clone(),
            builtin: false,
        });
        Ok(())
    };
    for (key, value) in root {
        if key == "system" {
            // TrustGraph stores it JSON-encoded; sluice's shape has it plain.
            system = Some(match value {
                Value::String(s) => match serde_json::from_str::<String>(&s) {
                    Ok(inner) if s.starts_with('"') => inner,
                    _ => s,
                },
                other => return Err(err(format!("`system` must be a string, not {other}"))),
            });
        } else if key == "templates" {
            let Value::Object(map) = value else {
                return Err(err("`templates` must be an object of id -> template".into()));
            };
            for (id, v) in map {
                add(&id, v)?;
            }
        } else if let Some(id) = key.strip_prefix("template.") {
            add(id, value)?;
        } else if key == "template-index" {
            // TrustGraph's list of ids; the `template.<id>` keys say the same.
        } else {
            return Err(err(format!(
                "unknown key {key:?}: expected `system`, `templates` or `template.<id>`"
            )));
        }
    }
    Ok((system, sources))
}

fn builtin_sources() -> Result<Vec<Source>, LoadError> {
    let templates = builtin::all().map_err(|e| LoadError::Template {
        id: e.id.to_owned(),
        origin: BUILTIN_ORIGIN.into(),
        message: e.message,
    })?;
    Ok(templates
        .into_iter()
        .map(|b| Source {
            id: b.id.to_owned(),
            prompt: b.prompt.to_owned(),
            system: Some(b.system.to_owned()),
            response_type: b.response_type,
            schema: Some(b.schema),
            normalise: b.normalise,
            answers: b.answers,
            call: CallSettings {
                temperature: b.temperature,
                max_tokens: None,
                retry: b.retry.map(str::to_owned),
            },
            origin: BUILTIN_ORIGIN.into(),
            builtin: true,
        })
        .collect())
}

impl TemplateSet {
    /// The built-in templates (when `builtins`) overlaid by the file's (when given): a file
    /// template with a built-in's id replaces it.
    pub fn load(path: Option<&Path>, builtins: bool) -> Result<Self, LoadError> {
        let (system, file_sources) = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| LoadError::Read(path.to_owned(), e))?;
                parse_file(path, &text)?
            }
            None => (None, Vec::new()),
        };
        Self::build(system, file_sources, builtins)
    }

    /// A set from a template file's text (for tests and embedding).
    pub fn from_json(text: &str, builtins: bool) -> Result<Self, LoadError> {
        let (system, file_sources) = parse_file(Path::new("<inline>"), text)?;
        Self::build(system, file_sources, builtins)
    }

    /// A set from the entries of type `prompt` of one workspace of TrustGraph's config
    /// service: `system` (a JSON string) and `template.<id>` (each a JSON object, as in a
    /// template file). Keys TrustGraph's prompt service does not read are ignored, as it
    /// ignores them.
    pub fn from_trustgraph_config(
        entries: &BTreeMap<String, String>,
        builtins: bool,
    ) -> Result<Self, LoadError> {
        let origin = Path::new("<TrustGraph config, type prompt>");
        let mut root = serde_json::Map::new();
        for (key, value) in entries {
            if key == "system" {
                root.insert(key.clone(), Value::String(value.clone()));
            } else if key.starts_with("template.") {
                let parsed: Value = serde_json::from_str(value).map_err(|e| {
                    LoadError::Parse(origin.to_owned(), format!("entry {key:?}: {e}"))
                })?;
                root.insert(key.clone(), parsed);
            }
        }
        let text = Value::Object(root).to_string();
        let (system, sources) = parse_file(origin, &text)?;
        Self::build(system, sources, builtins)
    }

    fn build(
        system: Option<String>,
        file_sources: Vec<Source>,
        builtins: bool,
    ) -> Result<Self, LoadError> {
        let mut sources = if builtins {
            builtin_sources()?
        } else {
            Vec::new()
        };
        sources.extend(file_sources);
        Self::compile(system.unwrap_or_default(), sources)
    }

    fn compile(system: String, sources: Vec<Source>) -> Result<Self, LoadError> {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        // Prompts are plain text: no HTML escaping.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_keep_trailing_newline(true);
        let mut templates = BTreeMap::new();
        for s in sources {
            env.add_template_owned(s.id.clone(), s.prompt)
                .map_err(|e| LoadError::Template {
                    id: s.id.clone(),
                    origin: s.origin.clone(),
                    message: describe(&e),
                })?;
            // A file's schema is checked now, so that a bad one fails the load and the
            // previous set stays; the validator itself is built when first needed, and the
            // memory this check used goes back to the allocator. The built-in schemas are
            // checked by their tests.
            if let Some(schema) = &s.schema
                && !s.builtin
            {
                jsonschema::validator_for(schema).map_err(|e| LoadError::Schema {
                    id: s.id.clone(),
                    origin: s.origin.clone(),
                    message: e.to_string(),
                })?;
            }
            templates.insert(
                s.id.clone(),
                Arc::new(Template {
                    id: s.id,
                    system: s.system,
                    response_type: s.response_type,
                    schema: s.schema,
                    validator: OnceLock::new(),
                    normalise: s.normalise,
                    answers: s.answers,
                    call: s.call,
                    origin: s.origin,
                }),
            );
        }
        Ok(Self {
            env,
            templates,
            system,
        })
    }

    /// The template ids.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.templates.keys().map(String::as_str)
    }

    /// The template `id`, if it exists.
    pub fn get(&self, id: &str) -> Option<&Arc<Template>> {
        self.templates.get(id)
    }

    /// Renders template `id` with `terms` (each value JSON-encoded, as TrustGraph sends it; a
    /// value that is not JSON is taken as a plain string).
    pub fn render(
        &self,
        id: &str,
        terms: &BTreeMap<String, String>,
    ) -> Result<Rendered, RenderError> {
        let Some(template) = self.templates.get(id) else {
            let known: Vec<&str> = self.ids().collect();
            return Err(RenderError::Unknown {
                id: id.to_owned(),
                known: if known.is_empty() {
                    "(none)".into()
                } else {
                    known.join(", ")
                },
            });
        };
        let context: BTreeMap<&str, Value> = terms
            .iter()
            .map(|(k, v)| {
                let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.clone()));
                (k.as_str(), value)
            })
            .collect();
        let render_error = |e: minijinja::Error| RenderError::Render {
            id: id.to_owned(),
            message: describe(&e),
        };
        let prompt = self
            .env
            .get_template(id)
            .and_then(|t| t.render(&context))
            .map_err(render_error)?;
        Ok(Rendered {
            system: template
                .system
                .clone()
                .unwrap_or_else(|| self.system.clone()),
            prompt,
            template: template.clone(),
        })
    }
}

/// minijinja's message with its line, without the template source.
fn describe(e: &minijinja::Error) -> String {
    let mut m = e.kind().to_string();
    if let Some(detail) = e.detail() {
        m.push_str(": ");
        m.push_str(detail);
    }
    if let Some(line) = e.line() {
        m.push_str(&format!(" (line {line})"));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The templates docker-compose.yml's prompt service serves load beside the built-ins,
    /// with the `question` template the compose agent's tool names.
    #[test]
    fn the_compose_templates_file_loads() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/compose/templates.json");
        let set = TemplateSet::load(Some(&path), true).unwrap();
        assert!(set.get("question").is_some());
        assert!(set.get("knowledge-classification").is_some());
    }

    const FILE: &str = r#"{
        "system": "You are careful.",
        "templates": {
            "greet": {"prompt": "Hello {{ name }}{% for t in tags %} #{{ t }}{% endfor %}"},
            "facts": {"prompt": "List facts about {{ topic }}", "response-type": "jsonl",
                      "schema": {"type": "object", "required": ["fact"],
                                 "properties": {"fact": {"type": "string"}}}},
            "own-system": {"prompt": "x", "system": "Override."}
        }
    }"#;

    fn terms(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn renders_json_encoded_terms_with_loops() {
        let set = TemplateSet::from_json(FILE, false).unwrap();
        let r = set
            .render(
                "greet",
                &terms(&[("name", "\"Ada\""), ("tags", "[\"a\",\"b\"]")]),
            )
            .unwrap();
        assert_eq!(r.prompt, "Hello Ada #a #b");
        assert_eq!(r.system, "You are careful.");
        assert_eq!(
            set.render("own-system", &terms(&[])).unwrap().system,
            "Override."
        );
        assert_eq!(set.get("facts").unwrap().response_type, ResponseType::Jsonl);
        // Not JSON: taken as the string itself, no escaping.
        let r = set
            .render("greet", &terms(&[("name", "<b>&"), ("tags", "[]")]))
            .unwrap();
        assert_eq!(r.prompt, "Hello <b>&");
    }

    #[test]
    fn unknown_templates_and_missing_variables_are_clear_errors() {
        let set = TemplateSet::from_json(FILE, false).unwrap();
        let e = set.render("nope", &terms(&[])).unwrap_err().to_string();
        assert!(e.contains("unknown template \"nope\""), "{e}");
        assert!(e.contains("facts, greet, own-system"), "{e}");
        let e = set
            .render("greet", &terms(&[("tags", "[]")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("greet") && e.contains("undefined"), "{e}");
    }

    #[test]
    fn trustgraph_config_shape_loads() {
        let tg = r#"{
            "system": "\"You are TG.\"",
            "template-index": "[\"q\"]",
            "template.q": "{\"prompt\": \"Q: {{question}}\", \"response-type\": \"json\", \"schema\": {\"type\": \"object\"}}"
        }"#;
        let set = TemplateSet::from_json(tg, false).unwrap();
        let r = set.render("q", &terms(&[("question", "\"why\"")])).unwrap();
        assert_eq!(r.prompt, "Q: why");
        assert_eq!(r.system, "You are TG.");
        assert_eq!(r.template.response_type, ResponseType::Json);
    }

    #[test]
    fn bad_files_name_what_is_wrong() {
        for (text, expect) in [
            (
                r#"{"templates": {"a": {"prompt": "{% for %}"}}}"#,
                "does not compile",
            ),
            (
                r#"{"templates": {"a": {"prompt": "x", "schema": {"type": 7}}}}"#,
                "invalid schema",
            ),
            (r#"{"templats": {}}"#, "unknown key"),
            (
                r#"{"templates": {"a": {"prompt": "x", "response-type": "yaml"}}}"#,
                "template \"a\"",
            ),
            ("not json", "not valid"),
            (
                r#"{"templates": {"a": {"prompt": "x", "normaliser": "tidy"}}}"#,
                "unknown normaliser \"tidy\"; the normalisers are: knowledge-classification, content-rewording, integration-decisions, knowledge-classification-seed-000, integration-decisions-seed-000, knowledge-classification-seed-001",
            ),
            (
                r#"{"templates": {"a": {"prompt": "x", "temperature": 2.5}}}"#,
                "template \"a\": temperature 2.5 is outside 0 to 2",
            ),
            (
                r#"{"templates": {"a": {"prompt": "x", "max-tokens": 0}}}"#,
                "template \"a\": max-tokens must be at least 1",
            ),
            (
                r#"{"templates": {"a": {"prompt": "x", "temperature": "warm"}}}"#,
                "template \"a\"",
            ),
            (
                r#"{"templates": {"a": {"prompt": "x", "retry": "seed-003"}}}"#,
                "template \"a\": retry: unknown retry preset \"seed-003\"",
            ),
            (
                r#"{"templates": {"a": {"prompt": "x", "retry": "attempts=99"}}}"#,
                "template \"a\": retry: retry attempts must be 1 to 10",
            ),
        ] {
            let e = TemplateSet::from_json(text, false).unwrap_err().to_string();
            assert!(e.contains(expect), "{text}: {e}");
        }
    }

    /// A file template that replaces a built-in keeps its corrections by naming the built-in's
    /// normaliser; without one it has none. Built-ins name theirs.
    #[test]
    fn a_file_template_names_its_normaliser() {
        let file = r#"{"templates": {
            "knowledge-classification": {"prompt": "Mine: {{ blocks }}", "response-type": "jsonl",
                                         "normaliser": "knowledge-classification"},
            "plain": {"prompt": "x", "response-type": "jsonl"}
        }}"#;
        let set = TemplateSet::from_json(file, true).unwrap();
        let replaced = set.get("knowledge-classification").unwrap();
        assert_eq!(replaced.origin, "<inline>");
        let normalise = replaced.normalise.unwrap();
        let mut line = serde_json::json!({"block_id": "a", "is_knowledge": true, "confidence": 7, "reason": "r"});
        assert!(matches!(
            normalise(&mut line),
            crate::normalise::Normalised::Keep { .. }
        ));
        assert_eq!(line["confidence"], 1.0);
        assert!(set.get("plain").unwrap().normalise.is_none());
        for id in ["content-rewording", "integration-decisions"] {
            let builtin = set.get(id).unwrap();
            assert_eq!(builtin.origin, "built-in");
            assert!(
                builtin.normalise.is_some() && builtin.validator().is_some_and(|v| v.is_ok()),
                "{id}"
            );
        }
    }
}
