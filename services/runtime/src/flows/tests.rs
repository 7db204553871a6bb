//! The config client on the in-process bus, against a config service played by the test.

use sluice_schema::{
    ResponseRecord,
    config::{ConfigValue, GETKEYS_ALL_WS, GETVALUES},
    properties,
};

use super::*;
use crate::bus::{Message, memory::MemoryBus};

fn topics() -> ConfigTopics {
    ConfigTopics {
        request: "config-request".into(),
        response: "config-response".into(),
        push: "config-push".into(),
    }
}

fn value(workspace: &str, key: &str, v: &str) -> ConfigValue {
    ConfigValue {
        kind: "processor:p".into(),
        key: key.into(),
        value: v.into(),
        workspace: workspace.into(),
    }
}

/// A config service: answers each request with `answer(request)` (none: stays silent),
/// always after an answer to some other client's request, as every client of the config
/// service reads every answer.
/// Subscribed before it returns: a request published with no subscription is not kept.
async fn serve(
    bus: MemoryBus,
    answer: fn(&ConfigRequest) -> Option<ConfigResponse>,
) -> JoinHandle<()> {
    let mut requests = bus
        .subscribe("config-request", "config", SubscribeOptions::shared(10))
        .await
        .unwrap();
    tokio::spawn(async move {
        let answers = bus.publisher("config-response").await.unwrap();
        let send = |id: String, r: ConfigResponse| {
            let answers = answers.clone();
            async move {
                let m = Message::new(serde_json::to_vec(&r).unwrap())
                    .with_property(properties::ID, id.as_str());
                answers.send(m).await.unwrap().await.unwrap();
            }
        };
        while let Some(Ok(d)) = requests.next().await {
            let id = d.property(properties::ID).unwrap().to_owned();
            let request: ConfigRequest = serde_json::from_slice(d.payload()).unwrap();
            d.ack();
            let other = ConfigResponse {
                version: 99,
                values: vec![value("elsewhere", "x", "{}")],
                ..ConfigResponse::default()
            };
            send("another-client".into(), other).await;
            if let Some(r) = answer(&request) {
                send(id, r).await;
            }
        }
    })
}

fn flows(request: &ConfigRequest) -> Option<ConfigResponse> {
    let values = match (request.operation.as_str(), request.workspace.as_str()) {
        (GETKEYS_ALL_WS, _) => vec![value("a", "f1", ""), value("b", "f2", "")],
        (GETVALUES, "a") => vec![value("a", "f1", "one")],
        (GETVALUES, "b") => vec![value("b", "f2", "two"), value("b", "f3", "three")],
        _ => Vec::new(),
    };
    let version = if request.workspace == "b" { 7 } else { 5 };
    Some(ConfigResponse {
        version,
        values,
        ..ConfigResponse::default()
    })
}

async fn connect(bus: &MemoryBus, timeout: Duration) -> ConfigClient {
    let bus: Arc<dyn Bus> = Arc::new(bus.clone());
    ConfigClient::connect(&bus, &topics(), "test", timeout)
        .await
        .unwrap()
}

/// The keys across workspaces, then each workspace's values: each answer found among the
/// other clients' answers by its id, the newest version kept.
#[tokio::test]
async fn every_workspace_is_read_through_its_own_answers() {
    let bus = MemoryBus::default();
    let service = serve(bus.clone(), flows).await;
    let client = connect(&bus, Duration::from_secs(5)).await;
    let (version, all) = client.all_workspaces("processor:p").await.unwrap();
    assert_eq!(version, 7);
    let expected = BTreeMap::from([
        (
            "a".to_owned(),
            BTreeMap::from([("f1".to_owned(), "one".to_owned())]),
        ),
        (
            "b".to_owned(),
            BTreeMap::from([
                ("f2".to_owned(), "two".to_owned()),
                ("f3".to_owned(), "three".to_owned()),
            ]),
        ),
    ]);
    assert_eq!(all, expected);
    client.close().await;
    service.abort();
}

#[tokio::test]
async fn an_answer_carrying_an_error_is_a_refusal() {
    let bus = MemoryBus::default();
    let service = serve(bus.clone(), |_| {
        Some(ConfigResponse::from_error(sluice_schema::Error::new(
            sluice_schema::ErrorKind::InvalidRequest,
            "no such workspace",
        )))
    })
    .await;
    let client = connect(&bus, Duration::from_secs(5)).await;
    let e = client.values("nowhere", "prompt").await.unwrap_err();
    assert!(
        matches!(&e, ConfigError::Refused(e) if e.message == "no such workspace"),
        "{e}"
    );
    client.close().await;
    service.abort();
}

#[tokio::test(start_paused = true)]
async fn a_config_service_that_does_not_answer_is_a_timeout() {
    let bus = MemoryBus::default();
    let service = serve(bus.clone(), |_| None).await;
    let client = connect(&bus, Duration::from_secs(3)).await;
    let started = Instant::now();
    let e = client.values("a", "prompt").await.unwrap_err();
    assert!(
        matches!(e, ConfigError::Unanswered { cause: Some(ClientError::TotalTimeout(t)), .. } if t == Duration::from_secs(3)),
        "{e}"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(3) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    client.close().await;
    service.abort();
}

#[tokio::test]
async fn a_closed_client_asks_nothing() {
    let bus = MemoryBus::default();
    let service = serve(bus.clone(), flows).await;
    let bus_dyn: Arc<dyn Bus> = Arc::new(bus.clone());
    let client = ConfigClient::connect(&bus_dyn, &topics(), "test", Duration::from_secs(5))
        .await
        .unwrap();
    client.client.close().await;
    let e = client.values("a", "prompt").await.unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Unanswered {
                cause: Some(ClientError::Closed),
                ..
            }
        ),
        "{e}"
    );
    service.abort();
}
