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
