//! Tools (function calling) on the text-completion records: sluice's extension, written only
//! when set, so a request or answer without tools stays byte-for-byte TrustGraph's
//! (docs/protocol.md#tools).
//!
//! The shapes follow OpenAI's chat completions, which most callers and most providers'
//! mappings already speak: a tool is a name, a description and a JSON Schema of its
//! arguments; a call is an id, a name and its arguments as JSON text; a streamed call comes
//! in pieces that share an `index`, the first carrying the id and name, the rest fragments
//! of the arguments to append.

use serde::{Deserialize, Serialize};

use crate::de::null_default;

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    /// The tool's name, as the model calls it (`[a-zA-Z0-9_-]`, at most 64 characters, as
    /// every provider accepts).
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema of the arguments (an object schema). Absent: no arguments.
    #[serde(default = "no_parameters", deserialize_with = "parameters")]
    pub parameters: serde_json::Value,
    /// Ask the provider to follow the schema exactly (OpenAI's `strict`), where it can.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// Whether `name` is a tool name every provider accepts: 1 to 64 of `a-z`, `A-Z`, `0-9`,
/// `_` and `-` (OpenAI's pattern).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A whole tool call in OpenAI's chat-completions shape (`{"id", "type": "function",
/// "function": {"name", "arguments"}}`), as the OpenAI-family providers send it back in a
/// conversation and the gateway's OpenAI route answers it.
pub fn openai_call(call: &ToolCall) -> serde_json::Value {
    serde_json::json!({"id": call.id, "type": "function",
        "function": {"name": call.name, "arguments": call.arguments}})
}

/// The schema of a tool that takes no arguments.
pub fn no_parameters() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {}})
}

fn parameters<'de, D: serde::Deserializer<'de>>(d: D) -> Result<serde_json::Value, D::Error> {
    Ok(match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => no_parameters(),
        Some(v) => v,
    })
}

/// Whether and which tools the model may call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `auto`, `none` or `required`.
    Mode(ToolMode),
    /// This tool, and no other answer.
    Named {
        /// The tool's name.
        name: String,
    },
}

/// How the model may use its tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolMode {
    /// The model decides (the default when tools are given).
    Auto,
    /// No tool call: text only.
    None,
    /// At least one tool call.
    Required,
}

/// A tool call the model made: in an earlier assistant turn of a conversation, or (as one
/// [`ToolCallDelta`] carrying all of it) in a whole answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which the tool's result names (`tool_call_id`).
    #[serde(default, deserialize_with = "null_default")]
    pub id: String,
    /// The tool called.
    #[serde(default, deserialize_with = "null_default")]
    pub name: String,
    /// The arguments, as JSON text (as the model wrote them: not necessarily valid JSON).
    #[serde(default, deserialize_with = "null_default")]
    pub arguments: String,
}

/// A piece of a tool call in an answer. Pieces with the same `index` are one call: the first
/// carries its `id` and `name`, and every piece's `arguments` is appended to the call's
/// arguments in order. A whole answer's record carries each call in one piece.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// Which call of the answer this piece belongs to (0, 1, ... in the order they began).
    #[serde(default)]
    pub index: u32,
    /// The call's id, on its first piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The tool's name, on its first piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A fragment of the arguments' JSON text.
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub arguments: String,
}

impl ToolCallDelta {
    /// A whole call as one piece at `index`.
    pub fn whole(index: u32, call: ToolCall) -> Self {
        Self {
            index,
            id: Some(call.id),
            name: Some(call.name),
            arguments: call.arguments,
        }
    }
}

/// Appends `more` to `pieces`, merging a piece that only continues the last one's arguments
/// (same index, no id, no name) into it, so that coalesced records stay as small as what
/// they say.
pub fn append_deltas(pieces: &mut Vec<ToolCallDelta>, more: Vec<ToolCallDelta>) {
    for piece in more {
        match pieces.last_mut() {
            Some(last)
                if last.index == piece.index && piece.id.is_none() && piece.name.is_none() =>
            {
                last.arguments.push_str(&piece.arguments);
            }
            _ => pieces.push(piece),
        }
    }
}

/// Puts streamed pieces together into whole calls, in the order of their index. A piece whose
/// index has no id or name yet takes the first it is given.
pub fn assemble(pieces: &[ToolCallDelta]) -> Vec<ToolCall> {
    let mut calls: std::collections::BTreeMap<u32, ToolCall> = std::collections::BTreeMap::new();
    for p in pieces {
        let call = calls.entry(p.index).or_insert_with(|| ToolCall {
            id: String::new(),
            name: String::new(),
            arguments: String::new(),
        });
        if let Some(id) = &p.id
            && call.id.is_empty()
        {
            call.id.clone_from(id);
        }
        if let Some(name) = &p.name
            && call.name.is_empty()
        {
            call.name.clone_from(name);
        }
        call.arguments.push_str(&p.arguments);
    }
    calls.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_choice_reads_a_mode_or_a_name() {
        let auto: ToolChoice = serde_json::from_value(json!("auto")).unwrap();
        assert_eq!(auto, ToolChoice::Mode(ToolMode::Auto));
        let named: ToolChoice = serde_json::from_value(json!({"name": "f"})).unwrap();
        assert_eq!(named, ToolChoice::Named { name: "f".into() });
        assert_eq!(serde_json::to_value(&named).unwrap(), json!({"name": "f"}));
        assert_eq!(
            serde_json::to_value(ToolChoice::Mode(ToolMode::Required)).unwrap(),
            json!("required")
        );
        assert!(serde_json::from_value::<ToolChoice>(json!("sometimes")).is_err());
    }

    #[test]
    fn a_tool_without_parameters_takes_none() {
        let t: Tool = serde_json::from_value(json!({"name": "now", "parameters": null})).unwrap();
        assert_eq!(t.parameters, no_parameters());
        assert_eq!(
            serde_json::to_value(&t).unwrap(),
            json!({"name": "now", "parameters": {"type": "object", "properties": {}}})
        );
    }

    #[test]
    fn pieces_assemble_into_calls_and_merge_when_they_only_continue() {
        let piece = |index, id: Option<&str>, name: Option<&str>, args: &str| ToolCallDelta {
            index,
            id: id.map(str::to_owned),
            name: name.map(str::to_owned),
            arguments: args.into(),
        };
        let mut pieces = vec![piece(0, Some("a"), Some("f"), "")];
        append_deltas(&mut pieces, vec![piece(0, None, None, "{\"x\":")]);
        append_deltas(&mut pieces, vec![piece(0, None, None, "1}")]);
        append_deltas(&mut pieces, vec![piece(1, Some("b"), Some("g"), "{}")]);
        assert_eq!(
            pieces,
            [
                piece(0, Some("a"), Some("f"), "{\"x\":1}"),
                piece(1, Some("b"), Some("g"), "{}")
            ]
        );
        // Interleaved pieces of two calls (as some providers send parallel calls).
        let calls = assemble(&[
            piece(0, Some("a"), Some("f"), "{\"x\""),
            piece(1, Some("b"), Some("g"), "{"),
            piece(0, None, None, ":1}"),
            piece(1, None, None, "}"),
        ]);
        assert_eq!(
            calls,
            [
                ToolCall {
                    id: "a".into(),
                    name: "f".into(),
                    arguments: "{\"x\":1}".into()
                },
                ToolCall {
                    id: "b".into(),
                    name: "g".into(),
                    arguments: "{}".into()
                }
            ]
        );
    }
}
