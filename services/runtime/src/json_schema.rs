//! JSON Schema checks shared by the processors: the prompt service's templates, structured
//! output a provider cannot enforce itself (text-completion), tool arguments. The checks are
//! `jsonschema`'s; what this module adds are the words for a failure that never quote the
//! checked value, which may be a model's answer or a caller's data.

pub use jsonschema::{ValidationError, Validator};

/// Why a schema cannot be used, or a value does not pass it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    /// The schema is not a usable JSON Schema (the validator's words, at most 300
    /// characters: they quote the schema, which is the caller's, not a model's answer).
    #[error("not a valid JSON Schema: {0}")]
    Invalid(String),
    /// The value fails the schema, in [`problem`]'s words (they never quote the value).
    #[error("{0}")]
    Mismatch(String),
}

/// A validator for `schema`, or why it is not a usable JSON Schema.
pub fn compile(schema: &serde_json::Value) -> Result<Validator, SchemaError> {
    jsonschema::validator_for(schema)
        .map_err(|e| SchemaError::Invalid(e.to_string().chars().take(300).collect()))
}

/// The first way `value` fails `validator`; `Ok` when it passes.
pub fn check(validator: &Validator, value: &serde_json::Value) -> Result<(), SchemaError> {
    match validator.iter_errors(value).next() {
        None => Ok(()),
        Some(e) => Err(SchemaError::Mismatch(problem(&e))),
    }
}

/// What a schema failure is, in words that never quote the model's value (the validator's own
/// message does: `7 is greater than the maximum of 5`), for logs and error records alike: where
/// (the JSON pointer, `/` for the whole object) and which rule, with the schema's limit.
pub fn problem(e: &jsonschema::ValidationError<'_>) -> String {
    use jsonschema::error::{TypeKind, ValidationErrorKind as K};
    let at = match e.instance_path.as_str() {
        "" => "/",
        p => p,
    };
    let what = match &e.kind {
        K::Required { property } => format!("lacks the required property {property}"),
        K::Type {
            kind: TypeKind::Single(t),
        } => format!("is not of type {t}"),
        K::Type { .. } => "is not of any type the schema allows".to_owned(),
        K::Maximum { limit } => format!("is greater than the maximum of {limit}"),
        K::Minimum { limit } => format!("is less than the minimum of {limit}"),
        K::ExclusiveMaximum { limit } => format!("is not less than {limit}"),
        K::ExclusiveMinimum { limit } => format!("is not greater than {limit}"),
        K::MaxLength { limit } => format!("is longer than {limit} characters"),
        K::MinLength { limit } => format!("is shorter than {limit} characters"),
        K::MaxItems { limit } => format!("has more than {limit} items"),
        K::MinItems { limit } => format!("has fewer than {limit} items"),
        K::Enum { options } => format!("is not one of {options}"),
        K::Constant { expected_value } => format!("is not {expected_value}"),
        K::AdditionalProperties { unexpected } => format!(
            "has {} propert{} the schema does not allow",
            unexpected.len(),
            if unexpected.len() == 1 { "y" } else { "ies" }
        ),
        K::Pattern { pattern } => format!("does not match the pattern {pattern:?}"),
        _ => {
            let keyword = e.schema_path.as_str().rsplit('/').next().unwrap_or("");
            format!("does not satisfy the schema's `{keyword}`")
        }
    };
    format!("{at} {what}")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn failures_name_the_place_and_rule_never_the_value() {
        let v = compile(&json!({"type": "object", "required": ["label"],
            "properties": {"label": {"enum": ["a", "b"]}, "n": {"maximum": 5}}}))
        .unwrap();
        assert_eq!(check(&v, &json!({"label": "a"})), Ok(()));
        let e = check(&v, &json!({"label": "secret-value"}))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("/label is not one of"), "{e}");
        assert!(!e.contains("secret-value"), "{e}");
        assert_eq!(
            check(&v, &json!({"label": "b", "n": 7})).unwrap_err(),
            SchemaError::Mismatch("/n is greater than the maximum of 5".into())
        );
        assert_eq!(
            check(&v, &json!({})).unwrap_err(),
            SchemaError::Mismatch("/ lacks the required property \"label\"".into())
        );
        assert!(
            compile(&json!({"type": 5}))
                .unwrap_err()
                .to_string()
                .starts_with("not a valid JSON Schema")
        );
    }
}
