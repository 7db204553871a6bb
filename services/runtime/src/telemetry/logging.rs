//! Log output: text or JSON lines, and in JSON lines the fields that hold JSON embedded as
//! JSON rather than as strings.

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// Installs the global tracing subscriber: level from `RUST_LOG` (default `info`), output to
/// stderr, in colour only when stderr is a terminal (a pipe or file, as under Kubernetes or
/// systemd, gets plain text, not escape codes). Does nothing if one is installed already
/// (tests install their own).
pub fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_writer(JsonLine::default)
            .try_init(),
    };
}

/// The request log's fields whose values are JSON (the contract's `messages`, an array, and
/// `data`, an object): tracing records a field as text, so the JSON formatter writes them as
/// strings holding JSON; [`JsonLine`] writes them as the JSON they hold.
pub(super) const JSON_FIELDS: [&str; 2] = ["messages", "data"];

/// Stderr for the JSON log, one event at a time: a line of the request log (its `event`
/// starts with `llm_`) that has a [`JSON_FIELDS`] field holding JSON text is written with
/// that field as JSON. Only with content logging on do such fields exist; other lines pass
/// through untouched.
#[derive(Default)]
pub(super) struct JsonLine {
    line: Vec<u8>,
}

impl std::io::Write for JsonLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.line.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for JsonLine {
    fn drop(&mut self) {
        use std::io::Write;
        let line = embed_json_fields(&self.line);
        // Nowhere to report a failed write to stderr.
        let _ = std::io::stderr().lock().write_all(&line);
    }
}

/// `line` (one JSON log line) with its [`JSON_FIELDS`] written as JSON, when it is a request
/// log line that has one holding JSON text; else `line` unchanged.
pub(super) fn embed_json_fields(line: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let has = |needle: &str| line.windows(needle.len()).any(|w| w == needle.as_bytes());
    if !has("\"event\":\"llm_") || !JSON_FIELDS.iter().any(|f| has(&format!("\"{f}\":\""))) {
        return line.into();
    }
    let Ok(serde_json::Value::Object(mut event)) = serde_json::from_slice(line) else {
        return line.into();
    };
    let mut changed = false;
    for field in JSON_FIELDS {
        if let Some(serde_json::Value::String(text)) = event.get(field)
            && let Ok(value @ (serde_json::Value::Array(_) | serde_json::Value::Object(_))) =
                serde_json::from_str(text)
        {
            event.insert(field.to_owned(), value);
            changed = true;
        }
    }
    if !changed {
        return line.into();
    }
    match serde_json::to_vec(&event) {
        Ok(mut out) => {
            out.push(b'\n');
            out.into()
        }
        Err(_) => line.into(),
    }
}
