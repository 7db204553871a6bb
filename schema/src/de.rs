//! Lenient deserialisation helpers: TrustGraph writers emit `null` for fields they have
//! no value for, so a `null` must read as the field's default rather than fail the record.

use serde::{Deserialize, Deserializer};

/// Reads `null` (or a missing field, with `#[serde(default)]`) as `T::default()`.
pub(crate) fn null_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Prompt terms: TrustGraph sends every value as a JSON-encoded string. A caller that sends a
/// JSON value instead (an object, a number) gets it JSON-encoded here, so both shapes reach
/// the template the same way. `null` reads as no terms.
pub(crate) fn terms<'de, D>(
    deserializer: D,
) -> Result<std::collections::BTreeMap<String, String>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let raw: Option<std::collections::BTreeMap<String, serde_json::Value>> =
        serde::Deserialize::deserialize(deserializer)?;
    Ok(raw
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            (k, v)
        })
        .collect())
}
