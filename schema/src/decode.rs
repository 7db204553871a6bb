//! Decoding request records with errors a caller can act on: the field that is wrong and the
//! type expected there, e.g. ``invalid request: field `streaming`: expected a boolean``.
//!
//! serde_json's own messages quote the offending value (``invalid type: string "…"``), and a
//! value may be a prompt, a secret or megabytes long, so no message built here ever contains
//! one: only the path of field names and serde's description of the expected type.

use serde::de::DeserializeOwned;

/// The longest field path quoted; map keys (prompt terms, tool arguments) are caller data of
/// any length.
const MAX_PATH: usize = 120;

/// Why a record could not be decoded, without any of its values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid request: {0}")]
pub struct DecodeError(String);

impl DecodeError {
    /// The description after `invalid request: `, e.g. ``field `prompt`: expected a string``.
    pub fn detail(&self) -> &str {
        &self.0
    }
}

/// Decodes a record from JSON bytes.
///
/// The record is decoded directly; only when that fails is it decoded again, field by field,
/// to say where, so a valid record costs nothing extra.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    match serde_json::from_slice(bytes) {
        Ok(t) => Ok(t),
        Err(e) => Err(match serde_json::from_slice::<serde_json::Value>(bytes) {
            Ok(value) => explain::<T>(value),
            Err(_) => syntax(&e),
        }),
    }
}

/// Decodes a record from an already parsed JSON value.
pub fn decode_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, DecodeError> {
    // Decoded from a borrow, so the value is still whole for `explain` on failure.
    match T::deserialize(&value) {
        Ok(t) => Ok(t),
        Err(_) => Err(explain::<T>(value)),
    }
}

fn syntax(e: &serde_json::Error) -> DecodeError {
    use serde_json::error::Category;
    let what = match e.classify() {
        Category::Eof => "the JSON ends early",
        Category::Io => "the record could not be read",
        Category::Syntax | Category::Data => "not valid JSON",
    };
    DecodeError(format!("{what} (line {}, column {})", e.line(), e.column()))
}

/// Decodes `value` again, tracking the path, and describes the failure.
fn explain<T: DeserializeOwned>(value: serde_json::Value) -> DecodeError {
    let Err(e) = serde_path_to_error::deserialize::<_, T>(value) else {
        // It decoded this time: nothing to point at.
        return DecodeError("the record does not match its type".into());
    };
    let path = e.path().to_string();
    // Errors from a `Value` carry no position, so the message is serde's own text alone.
    let expected = expected(&e.inner().to_string());
    if path == "." || path.is_empty() {
        return DecodeError(format!("the record: {expected}"));
    }
    let path = if path.chars().count() > MAX_PATH {
        let cut: String = path.chars().take(MAX_PATH).collect();
        format!("{cut}…")
    } else {
        path
    };
    DecodeError(format!("field `{path}`: {expected}"))
}

/// What serde expected, from its message, without the value it found.
///
/// serde writes `invalid type: <found>, expected <what>` and `invalid value: <found>,
/// expected <what>`, where `<found>` may quote the value; `<what>` is a fixed description
/// from the record's type. The last `, expected ` is serde's own: a quoted value's quotes and
/// control characters are escaped, and `<what>` never contains that text.
fn expected(message: &str) -> String {
    let Some(i) = message.rfind(", expected ") else {
        // Messages without a found value name nothing but fields and types.
        return if message.starts_with("missing field") || message.starts_with("duplicate field") {
            message.to_owned()
        } else {
            "does not match the record's type".to_owned()
        };
    };
    let what = &message[i + ", expected ".len()..];
    let friendly = match what {
        "f32" | "f64" => "a number",
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a non-negative integer",
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "an integer",
        "a sequence" => "an array",
        "a map" => "an object",
        "a boolean" | "a string" => what,
        other if other.starts_with("struct ") => "an object",
        other if other.starts_with("one of ") || other.starts_with("variant ") => other,
        // Anything else serde describes is still a type, never the value.
        other => other,
    };
    format!("expected {friendly}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AgentRequest, PromptRequest, TextCompletionRequest};

    fn err<T: DeserializeOwned + std::fmt::Debug>(json: &str) -> String {
        decode::<T>(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn names_the_field_and_the_type_never_the_value() {
        let secret = "sk-very-secret-value";
        let m =
            err::<TextCompletionRequest>(&format!(r#"{{"prompt":"hi","streaming":"{secret}"}}"#));
        assert_eq!(m, "invalid request: field `streaming`: expected a boolean");
        let m = err::<TextCompletionRequest>(r#"{"prompt":12345}"#);
        assert_eq!(m, "invalid request: field `prompt`: expected a string");
        assert!(!m.contains("12345"));
        let m = err::<AgentRequest>(r#"{"question":"q","history":[{"thought":["x"]}]}"#);
        assert_eq!(
            m,
            "invalid request: field `history[0].thought`: expected a string"
        );
        let m = err::<AgentRequest>(&format!(r#"{{"question":"q","group":"{secret}"}}"#));
        assert_eq!(m, "invalid request: field `group`: expected an array");
        assert!(!m.contains(secret));
        let m = err::<PromptRequest>(r#"{"id":"t","terms":[1]}"#);
        assert_eq!(m, "invalid request: field `terms`: expected an object");
    }

    #[test]
    fn a_value_that_imitates_serdes_wording_is_not_echoed() {
        let m = err::<TextCompletionRequest>(r#"{"streaming":"x\", expected SECRET"}"#);
        assert_eq!(m, "invalid request: field `streaming`: expected a boolean");
    }

    #[test]
    fn syntax_errors_give_a_position_and_the_root_its_type() {
        let m = err::<TextCompletionRequest>(r#"{"prompt": "unterminated"#);
        assert!(
            m.starts_with("invalid request: the JSON ends early (line 1"),
            "{m}"
        );
        let m = err::<TextCompletionRequest>("{nope}");
        assert!(
            m.starts_with("invalid request: not valid JSON (line 1, column 2)"),
            "{m}"
        );
        let m = err::<TextCompletionRequest>(r#""a secret prompt""#);
        assert_eq!(m, "invalid request: the record: expected an object");
    }

    #[test]
    fn long_paths_are_cut() {
        let key = "k".repeat(500);
        let json = format!(r#"{{"question":"q","history":[{{"arguments":{{"{key}":[1]}}}}]}}"#);
        let m = err::<AgentRequest>(&json);
        assert!(m.len() < 250, "{m}");
        assert!(m.ends_with("…`: expected a string"), "{m}");
    }

    #[test]
    fn values_decode_as_before() {
        let r: TextCompletionRequest =
            decode_value(serde_json::json!({"prompt": "x", "streaming": null})).unwrap();
        assert_eq!(r.prompt, "x");
        let e =
            decode_value::<TextCompletionRequest>(serde_json::json!({"prompt": true})).unwrap_err();
        assert_eq!(e.detail(), "field `prompt`: expected a string");
    }
}
