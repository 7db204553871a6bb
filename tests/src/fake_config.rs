//! A stand-in for TrustGraph's config service on the real broker: the table of
//! `(workspace, type, key) -> value` in memory, answering `getkeys-all-ws`, `getvalues`,
//! `getvalues-all-ws`, `get`, `list`, `put` and `delete` on its request topic (answers
//! carry the request's `id` property), and announcing every change on its push topic as
//! TrustGraph's does: `{"version": n, "changes": {type: [workspace]}}`.
//!
//! Tests use their own topics, so they run in parallel; TrustGraph's own config service
//! (tests/py/tg_config_svc.py) is what the TrustGraph suite runs against.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
};

use sluice_runtime::bus::{Bus, Message, Publisher, SubscribeOptions};
use sluice_schema::config::{ConfigPush, ConfigRequest, ConfigResponse, ConfigValue};
use tokio::task::JoinHandle;

type Table = BTreeMap<(String, String, String), String>;

struct State {
    table: Table,
    version: u64,
    requests: u64,
}

/// The running stand-in.
pub struct FakeConfigService {
    state: Arc<Mutex<State>>,
    push: Arc<dyn Publisher>,
    task: JoinHandle<()>,
    /// Its request topic (Pulsar URL).
    pub request_topic: String,
    /// Its response topic.
    pub response_topic: String,
    /// Its push topic.
    pub push_topic: String,
}

impl FakeConfigService {
    /// Serves on the given topics until dropped.
    pub async fn start(
        bus: Arc<dyn Bus>,
        request_topic: &str,
        response_topic: &str,
        push_topic: &str,
    ) -> Self {
        let state = Arc::new(Mutex::new(State {
            table: Table::new(),
            version: 1,
            requests: 0,
        }));
        let mut requests = bus
            .subscribe(request_topic, "config-svc", SubscribeOptions::shared(100))
            .await
            .unwrap();
        let responses = bus.publisher(response_topic).await.unwrap();
        let push = bus.publisher(push_topic).await.unwrap();
        let (task_state, task_push) = (state.clone(), push.clone());
        let task = tokio::spawn(async move {
            while let Some(Ok(d)) = requests.next().await {
                let id = d.property("id").unwrap_or_default().to_owned();
                let answer = match serde_json::from_slice::<ConfigRequest>(d.payload()) {
                    Ok(request) => {
                        let (answer, changed) = handle(&task_state, request);
                        if let Some(push) = changed {
                            announce(&*task_push, push).await;
                        }
                        answer
                    }
                    Err(e) => ConfigResponse {
                        error: Some(sluice_schema::Error {
                            kind: "config-error".into(),
                            message: e.to_string(),
                        }),
                        ..ConfigResponse::default()
                    },
                };
                let message =
                    Message::new(serde_json::to_vec(&answer).unwrap()).with_property("id", id);
                responses.send(message).await.unwrap().await.unwrap();
                d.ack();
            }
        });
        Self {
            state,
            push,
            task,
            request_topic: request_topic.to_owned(),
            response_topic: response_topic.to_owned(),
            push_topic: push_topic.to_owned(),
        }
    }

    /// Writes entries of `kind` into `workspace` and announces the change.
    pub async fn put(&self, workspace: &str, kind: &str, entries: &[(&str, &str)]) {
        let request = ConfigRequest::put(
            workspace,
            entries
                .iter()
                .map(|(k, v)| ConfigValue {
                    kind: kind.to_owned(),
                    key: (*k).to_owned(),
                    value: (*v).to_owned(),
                    workspace: String::new(),
                })
                .collect(),
        );
        let (_, push) = handle(&self.state, request);
        announce(&*self.push, push.unwrap()).await;
    }

    /// Deletes one entry and announces the change.
    pub async fn delete(&self, workspace: &str, kind: &str, key: &str) {
        let mut request = ConfigRequest {
            operation: "delete".into(),
            workspace: workspace.to_owned(),
            ..ConfigRequest::default()
        };
        request.keys.push(sluice_schema::config::ConfigKey {
            kind: kind.to_owned(),
            key: key.to_owned(),
        });
        let (_, push) = handle(&self.state, request);
        announce(&*self.push, push.unwrap()).await;
    }

    /// Writes without announcing, as if the push were lost.
    pub fn put_silently(&self, workspace: &str, kind: &str, key: &str, value: &str) {
        let mut s = self.state.lock().unwrap();
        s.table.insert(
            (workspace.to_owned(), kind.to_owned(), key.to_owned()),
            value.to_owned(),
        );
        s.version += 1;
    }

    /// Requests answered so far.
    pub fn requests(&self) -> u64 {
        self.state.lock().unwrap().requests
    }

    /// The current version.
    pub fn version(&self) -> u64 {
        self.state.lock().unwrap().version
    }
}

impl Drop for FakeConfigService {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn announce(push: &dyn Publisher, message: ConfigPush) {
    let m = Message::new(serde_json::to_vec(&message).unwrap());
    push.send(m).await.unwrap().await.unwrap();
}

fn handle(state: &Mutex<State>, request: ConfigRequest) -> (ConfigResponse, Option<ConfigPush>) {
    let mut s = state.lock().unwrap();
    s.requests += 1;
    let value = |ws: &str, t: &str, k: &str, v: &str| ConfigValue {
        kind: t.to_owned(),
        key: k.to_owned(),
        value: v.to_owned(),
        workspace: ws.to_owned(),
    };
    let mut response = ConfigResponse {
        version: s.version,
        ..ConfigResponse::default()
    };
    match request.operation.as_str() {
        "getkeys-all-ws" | "getvalues-all-ws" => {
            response.values = s
                .table
                .iter()
                .filter(|((_, t, _), _)| *t == request.kind)
                .map(|((ws, t, k), v)| {
                    let v = if request.operation == "getvalues-all-ws" {
                        v.as_str()
                    } else {
                        ""
                    };
                    value(ws, t, k, v)
                })
                .collect();
        }
        "getvalues" => {
            response.values = s
                .table
                .iter()
                .filter(|((ws, t, _), _)| *ws == request.workspace && *t == request.kind)
                .map(|((_, t, k), v)| value("", t, k, v))
                .collect();
        }
        "list" => {
            response.directory = s
                .table
                .keys()
                .filter(|(ws, t, _)| *ws == request.workspace && *t == request.kind)
                .map(|(_, _, k)| k.clone())
                .collect();
        }
        "get" => {
            response.values = request
                .keys
                .iter()
                .map(|k| {
                    let key = (request.workspace.clone(), k.kind.clone(), k.key.clone());
                    value(
                        "",
                        &k.kind,
                        &k.key,
                        s.table.get(&key).map_or("", String::as_str),
                    )
                })
                .collect();
        }
        "put" | "delete" => {
            let mut kinds = BTreeSet::new();
            for v in &request.values {
                kinds.insert(v.kind.clone());
                s.table.insert(
                    (request.workspace.clone(), v.kind.clone(), v.key.clone()),
                    v.value.clone(),
                );
            }
            for k in &request.keys {
                kinds.insert(k.kind.clone());
                s.table
                    .remove(&(request.workspace.clone(), k.kind.clone(), k.key.clone()));
            }
            s.version += 1;
            response.version = s.version;
            let changes = kinds
                .into_iter()
                .map(|k| (k, vec![request.workspace.clone()]))
                .collect();
            return (
                response,
                Some(ConfigPush {
                    version: s.version,
                    changes,
                    workspace_changes: None,
                }),
            );
        }
        other => {
            response.error = Some(sluice_schema::Error {
                kind: "config-error".into(),
                message: format!("unknown operation {other:?}"),
            });
        }
    }
    (response, None)
}
