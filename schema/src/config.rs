//! TrustGraph 2.x's config-service records, as its processors exchange them over the bus.
//!
//! A TrustGraph processor learns its work from the config service: it asks on
//! `request:tg:config` (answers come on `response:tg:config`, correlated by the message
//! property `id`) and hears of changes on `notify:tg:config`. The config is a table of
//! `(workspace, type, key) -> value`, every value a string (often JSON). A processor's flows
//! are the entries of type `processor:<its id>`: one key per flow, the value a
//! [`FlowDefinition`] in JSON.
//!
//! Same rules as [`crate::records`]: every field written, unknown fields ignored, `null`
//! read as the default.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    de::null_default,
    records::{Error, ResponseRecord},
};

/// The config topics' names (logical; map them with a [`crate::TopicMapping`]).
pub const CONFIG_REQUEST_TOPIC: &str = "request:tg:config";
/// Where the config service answers.
pub const CONFIG_RESPONSE_TOPIC: &str = "response:tg:config";
/// Where the config service announces changes.
pub const CONFIG_PUSH_TOPIC: &str = "notify:tg:config";

/// The operation that lists, across workspaces, the keys of one type.
pub const GETKEYS_ALL_WS: &str = "getkeys-all-ws";
/// The operation that reads every value of one type in one workspace.
pub const GETVALUES: &str = "getvalues";

/// One key of the config table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigKey {
    /// The entry's type, e.g. `prompt`.
    #[serde(rename = "type", default, deserialize_with = "null_default")]
    pub kind: String,
    /// The entry's key, e.g. `template.question`.
    #[serde(default, deserialize_with = "null_default")]
    pub key: String,
}

/// One entry of the config table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigValue {
    /// The entry's type.
    #[serde(rename = "type", default, deserialize_with = "null_default")]
    pub kind: String,
    /// The entry's key.
    #[serde(default, deserialize_with = "null_default")]
    pub key: String,
    /// The value, a string (often JSON).
    #[serde(default, deserialize_with = "null_default")]
    pub value: String,
    /// The workspace, filled in by the all-workspace operations.
    #[serde(default, deserialize_with = "null_default")]
    pub workspace: String,
}

/// A request to the config service.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigRequest {
    /// `get`, `list`, `getvalues`, `getvalues-all-ws`, `getkeys-all-ws`, `delete`, `put`,
    /// `config`.
    #[serde(default, deserialize_with = "null_default")]
    pub operation: String,
    /// The workspace (all operations but the all-workspace ones).
    #[serde(default, deserialize_with = "null_default")]
    pub workspace: String,
    /// `get`, `delete`: the keys.
    #[serde(default, deserialize_with = "null_default")]
    pub keys: Vec<ConfigKey>,
    /// `list`, `getvalues`, the all-workspace operations: the type.
    #[serde(rename = "type", default, deserialize_with = "null_default")]
    pub kind: String,
    /// `put`: the entries.
    #[serde(default, deserialize_with = "null_default")]
    pub values: Vec<ConfigValue>,
}

impl ConfigRequest {
    /// Lists the keys of `kind` in every workspace.
    pub fn getkeys_all_ws(kind: &str) -> Self {
        Self {
            operation: GETKEYS_ALL_WS.to_owned(),
            kind: kind.to_owned(),
            ..Self::default()
        }
    }

    /// Reads the entries of `kind` in `workspace`.
    pub fn getvalues(workspace: &str, kind: &str) -> Self {
        Self {
            operation: GETVALUES.to_owned(),
            workspace: workspace.to_owned(),
            kind: kind.to_owned(),
            ..Self::default()
        }
    }

    /// Writes entries into `workspace` (for tests and tools; processors only read).
    pub fn put(workspace: &str, values: Vec<ConfigValue>) -> Self {
        Self {
            operation: "put".to_owned(),
            workspace: workspace.to_owned(),
            values,
            ..Self::default()
        }
    }
}

/// The config service's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigResponse {
    /// The config's version when the answer was made.
    #[serde(default, deserialize_with = "null_default")]
    pub version: u64,
    /// `get`, `getvalues`, the all-workspace operations: the entries.
    #[serde(default, deserialize_with = "null_default")]
    pub values: Vec<ConfigValue>,
    /// `list`: the keys.
    #[serde(default, deserialize_with = "null_default")]
    pub directory: Vec<String>,
    /// `config`: the whole workspace, type -> key -> value.
    #[serde(default, deserialize_with = "null_default")]
    pub config: BTreeMap<String, BTreeMap<String, String>>,
    /// Set when the operation failed.
    #[serde(default)]
    pub error: Option<Error>,
}

/// One answer per request: every answer is the last of its request.
impl ResponseRecord for ConfigResponse {
    fn is_terminal(&self) -> bool {
        true
    }

    fn from_error(error: Error) -> Self {
        Self {
            error: Some(error),
            ..Self::default()
        }
    }

    fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }
}

/// Workspaces created or deleted, announced with a [`ConfigPush`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceChanges {
    /// New workspaces.
    #[serde(default, deserialize_with = "null_default")]
    pub created: Vec<String>,
    /// Deleted workspaces.
    #[serde(default, deserialize_with = "null_default")]
    pub deleted: Vec<String>,
}

/// A change announcement on the config push topic.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigPush {
    /// The config's version after the change.
    #[serde(default, deserialize_with = "null_default")]
    pub version: u64,
    /// Type -> the workspaces whose entries of that type changed.
    #[serde(default, deserialize_with = "null_default")]
    pub changes: BTreeMap<String, Vec<String>>,
    /// Workspaces created or deleted.
    #[serde(default)]
    pub workspace_changes: Option<WorkspaceChanges>,
}

/// One flow of a processor, the value of a `processor:<id>` entry as TrustGraph's flow
/// service writes it: `{"topics": {"request": "request:tg:...", ...}, "parameters":
/// {"model": "...", ...}}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FlowDefinition {
    /// The flow's topics by the name the processor gives them (`request`, `response`,
    /// `text-completion-request`, ...), each a logical topic name or a Pulsar URL.
    #[serde(default, deserialize_with = "null_default")]
    pub topics: BTreeMap<String, String>,
    /// The flow's parameters (`model`, `temperature`, ...). TrustGraph writes strings;
    /// anything JSON is accepted.
    #[serde(default, deserialize_with = "null_default")]
    pub parameters: BTreeMap<String, serde_json::Value>,
}

impl FlowDefinition {
    /// The topic the processor calls `name`.
    pub fn topic(&self, name: &str) -> Option<&str> {
        self.topics
            .get(name)
            .map(String::as_str)
            .filter(|t| !t.is_empty())
    }

    /// A parameter as text: strings as they are, numbers and booleans written out; `None`
    /// when absent, `null` or empty.
    pub fn parameter(&self, name: &str) -> Option<String> {
        match self.parameters.get(name)? {
            serde_json::Value::String(s) if s.trim().is_empty() => None,
            serde_json::Value::String(s) => Some(s.trim().to_owned()),
            serde_json::Value::Null => None,
            other => Some(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_trustgraph_writes() {
        let push: ConfigPush = serde_json::from_str(
            r#"{"version": 7, "changes": {"processor:text-completion": ["default"]},
                "workspace_changes": null, "later": 1}"#,
        )
        .unwrap();
        assert_eq!(push.version, 7);
        assert_eq!(push.changes["processor:text-completion"], ["default"]);
        let resp: ConfigResponse = serde_json::from_str(
            r#"{"version": 3, "values": [{"type": "prompt", "key": "system",
                "value": "\"Be helpful.\"", "workspace": ""}], "directory": [],
                "config": {}, "error": null}"#,
        )
        .unwrap();
        assert_eq!(resp.values[0].value, "\"Be helpful.\"");
        let flow: FlowDefinition = serde_json::from_str(
            r#"{"topics": {"request": "request:tg:text-completion:default:default",
                "response": ""}, "parameters": {"model": "gpt-4o", "temperature": "0.2",
                "n": 3, "empty": "", "none": null}}"#,
        )
        .unwrap();
        assert_eq!(
            flow.topic("request"),
            Some("request:tg:text-completion:default:default")
        );
        assert_eq!(flow.topic("response"), None);
        assert_eq!(flow.parameter("model").as_deref(), Some("gpt-4o"));
        assert_eq!(flow.parameter("n").as_deref(), Some("3"));
        assert_eq!(flow.parameter("empty"), None);
        assert_eq!(flow.parameter("none"), None);
    }

    #[test]
    fn writes_every_field_trustgraph_reads() {
        let v = serde_json::to_value(ConfigRequest::getvalues("ws", "prompt")).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"operation": "getvalues", "workspace": "ws", "keys": [],
                               "type": "prompt", "values": []})
        );
    }
}
