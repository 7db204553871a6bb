//! The records read off the bus and from clients: the three request records (text-completion,
//! prompt, agent) and the three response records a client reads, decoded by
//! `sluice_schema::decode` as the processors and clients decode them. Properties: no panic; a
//! record that decodes round-trips (written and read again, it is the same record); and a
//! record that does not decode is refused with a message that quotes none of its values
//! (serde's own messages do: `invalid type: string "…"`), only field names and types.

use serde::{Serialize, de::DeserializeOwned};
use sluice_schema::{
    AgentRequest, AgentResponse, PromptRequest, PromptResponse, ResponseRecord,
    TextCompletionRequest, TextCompletionResponse,
};

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    body: &[u8],
) -> Option<T> {
    let record: T = match sluice_schema::decode(body) {
        Ok(record) => record,
        Err(e) => {
            never_quotes_a_value(body, &e.to_string());
            return None;
        }
    };
    let written = serde_json::to_vec(&record).unwrap_or_else(|e| panic!("cannot write: {e}"));
    let again: T = serde_json::from_slice(&written)
        .unwrap_or_else(|e| panic!("a written record does not read back: {e}"));
    assert_eq!(record, again, "round trip changed the record");
    Some(record)
}

/// The refusal's message names fields (map keys are caller data, and are in the path) and
/// types, never a value: none of serde's value-quoting forms is left in it, and no long string
/// value of the record appears outside the field path.
fn never_quotes_a_value(body: &[u8], message: &str) {
    let detail = message
        .strip_prefix("invalid request: ")
        .unwrap_or_else(|| panic!("not a decode refusal: {message}"));
    // `field `PATH`: WHAT`: the path is keys and indices; WHAT is fixed text about types,
    // which never contains "`: ", so the last one ends the path.
    let what = match detail.strip_prefix("field `") {
        Some(rest) => rest.rfind("`: ").map_or(rest, |i| &rest[i + 3..]),
        None => detail,
    };
    for form in [
        "invalid type",
        "invalid value",
        "unknown variant",
        "string \"",
        "integer `",
        "floating point `",
        "character `",
    ] {
        assert!(!what.contains(form), "a value may be quoted ({form}): {message}");
    }
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) {
        let mut strings = Vec::new();
        leaves(&value, &mut strings);
        for s in strings {
            // Long and unlike any type description (those are lowercase words): caller data.
            let distinctive = s.chars().count() >= 16
                && s.chars().any(|c| c.is_ascii_digit() || c.is_ascii_uppercase() || c == '"');
            assert!(
                !(distinctive && what.contains(s.as_str())),
                "the value {s:?} is quoted: {message}"
            );
        }
    }
}

fn leaves<'a>(value: &'a serde_json::Value, out: &mut Vec<&'a String>) {
    match value {
        serde_json::Value::String(s) => out.push(s),
        serde_json::Value::Array(items) => items.iter().for_each(|v| leaves(v, out)),
        serde_json::Value::Object(map) => map.values().for_each(|v| leaves(v, out)),
        _ => {}
    }
}

fn response<T: ResponseRecord + Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    body: &[u8],
) {
    if let Some(r) = round_trip::<T>(body) {
        let _ = r.is_terminal();
        if let Some(e) = r.error() {
            let _ = e.kind.as_str();
        }
    }
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        match input.selector % 6 {
            0 => drop(round_trip::<TextCompletionRequest>(input.body)),
            1 => drop(round_trip::<PromptRequest>(input.body)),
            2 => drop(round_trip::<AgentRequest>(input.body)),
            3 => response::<TextCompletionResponse>(input.body),
            4 => response::<PromptResponse>(input.body),
            _ => response::<AgentResponse>(input.body),
        }
    });
}
