//! TrustGraph's WebSocket on the in-process bus: a real socket to a served gateway, with
//! text-completion played by the test (it reads the gateway's requests and answers them),
//! so that multiplexing, authentication, refused frames and cancellation are exact.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use futures::{SinkExt, StreamExt};
use sluice_runtime::{
    bus::{Bus, SubscribeOptions, Subscription, memory::MemoryBus},
    secret::Secret,
    telemetry::Telemetry,
    testkit::ServiceStub,
};
use sluice_schema::{TextCompletionRequest, TextCompletionResponse, properties};
use tokio_tungstenite::{
    MaybeTlsStream, WebSocketStream, connect_async, tungstenite::Message as Frame,
};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::{Gateway, auth::Auth};

type Socket = WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>;

/// A gateway serving text-completion on the in-process bus, its other side held by the test.
struct Rig {
    /// Text-completion, as the gateway sees it.
    llm: ServiceStub,
    /// The cancels it sends.
    cancels: Box<dyn Subscription>,
    addr: SocketAddr,
    telemetry: Telemetry,
    shutdown: CancellationToken,
}

impl Rig {
    async fn start(token: Option<&str>) -> Rig {
        let bus = MemoryBus::new(1 << 20, 1000);
        let llm = ServiceStub::start(&bus, "tc-req", "tc-resp").await;
        let cancels = bus
            .subscribe("tc-cancel", "stub", SubscribeOptions::shared(16))
            .await
            .unwrap();
        let mut config = crate::tests::serving_text_completion();
        config.auth = Auth::new(token.map(Secret::new));
        let telemetry = Telemetry::new().unwrap();
        let gateway = Gateway::start(Arc::new(bus.clone()), config, &telemetry)
            .await
            .unwrap();
        let shutdown = CancellationToken::new();
        let (addr, _served) = gateway
            .serve("127.0.0.1:0".parse().unwrap(), shutdown.clone())
            .await
            .unwrap();
        Rig {
            llm,
            cancels,
            addr,
            telemetry,
            shutdown,
        }
    }

    async fn connect(&self) -> Socket {
        let (socket, _) = connect_async(format!("ws://{}/api/v1/socket", self.addr))
            .await
            .unwrap();
        socket
    }

    /// The next request the gateway sent to text-completion, and its bus id.
    async fn request(&mut self) -> (String, TextCompletionRequest) {
        self.llm.request().await
    }

    /// Publishes text-completion's record for bus id `id`.
    async fn answer(&self, id: &str, text: &str, end: bool) {
        let r = TextCompletionResponse {
            response: text.to_owned(),
            end_of_stream: end,
            ..TextCompletionResponse::default()
        };
        self.llm.answer(id, "a1", &r).await;
    }
}

async fn send(socket: &mut Socket, frame: Value) {
    socket.send(Frame::text(frame.to_string())).await.unwrap();
}

/// The next text frame, as JSON.
async fn next(socket: &mut Socket) -> Value {
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(10), socket.next())
            .await
            .expect("a frame")
            .expect("the socket is open")
            .unwrap();
        if let Frame::Text(text) = frame {
            return serde_json::from_str(text.as_str()).unwrap();
        }
    }
}

/// An error frame's message (empty when the frame has none).
fn message(frame: &Value) -> &str {
    frame["error"]["message"].as_str().unwrap_or_default()
}

fn ask(id: &str, prompt: &str) -> Value {
    json!({
        "id": id,
        "service": "text-completion",
        "flow": "default",
        "workspace": "default",
        "request": {"system": "", "prompt": prompt, "streaming": true},
    })
}

/// Two requests on one socket are answered side by side, each frame under its client id,
/// each stream ending with one `complete` frame, whatever order text-completion answers in.
#[tokio::test]
async fn requests_on_one_socket_are_answered_by_their_ids() {
    let mut rig = Rig::start(None).await;
    let mut socket = rig.connect().await;
    send(&mut socket, ask("first", "one")).await;
    send(&mut socket, ask("second", "two")).await;
    let mut bus_ids = BTreeMap::new();
    for _ in 0..2 {
        let (id, request) = rig.request().await;
        bus_ids.insert(request.prompt, id);
    }
    rig.answer(&bus_ids["two"], "deux", false).await;
    rig.answer(&bus_ids["one"], "un", false).await;
    rig.answer(&bus_ids["two"], "", true).await;
    rig.answer(&bus_ids["one"], "", true).await;
    let mut frames: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    while frames
        .values()
        .flatten()
        .filter(|f| f["complete"] == true)
        .count()
        < 2
    {
        let frame = next(&mut socket).await;
        let id = frame["id"]
            .as_str()
            .expect("every frame has its id")
            .to_owned();
        frames.entry(id).or_default().push(frame);
    }
    for (id, text) in [("first", "un"), ("second", "deux")] {
        let got = &frames[id];
        let texts: String = got
            .iter()
            .filter_map(|f| f["response"]["response"].as_str())
            .collect();
        assert_eq!(texts, text, "{got:?}");
        assert_eq!(
            got.iter().filter(|f| f["complete"] == true).count(),
            1,
            "{got:?}"
        );
        assert_eq!(got.last().unwrap()["complete"], true);
        assert!(got.iter().all(|f| f.get("error").is_none()), "{got:?}");
    }
    rig.shutdown.cancel();
}

/// With a token configured, a request before authentication is refused under its id and
/// the socket stays open; a wrong token fails, the right one passes, and then requests flow.
#[tokio::test]
async fn a_socket_authenticates_before_its_requests() {
    let mut rig = Rig::start(Some("s3cret")).await;
    let mut socket = rig.connect().await;
    send(&mut socket, ask("early", "x")).await;
    let refused = next(&mut socket).await;
    assert_eq!(refused["id"], "early");
    assert_eq!(refused["error"]["type"], "invalid-request");
    assert!(message(&refused).contains("not authenticated"));
    send(&mut socket, json!({"type": "auth", "token": "wrong"})).await;
    assert_eq!(next(&mut socket).await["type"], "auth-failed");
    send(&mut socket, json!({"type": "auth", "token": "s3cret"})).await;
    // TrustGraph 2.x's client takes its workspace from here when it was given none.
    assert_eq!(
        next(&mut socket).await,
        json!({"type": "auth-ok", "default_workspace": "default"})
    );
    send(&mut socket, ask("late", "y")).await;
    let (id, request) = rig.request().await;
    assert_eq!(
        request.prompt, "y",
        "only the request after auth reached the bus"
    );
    rig.answer(&id, "ok", true).await;
    let frame = next(&mut socket).await;
    assert_eq!(
        (&frame["id"], &frame["complete"]),
        (&json!("late"), &json!(true))
    );
    rig.shutdown.cancel();
}

/// Frames that cannot be served get an error frame (under their id when they have one) and
/// the socket goes on serving: not JSON, binary, no id, an unknown service, flow or workspace, a
/// request that does not decode, and an id already in flight.
#[tokio::test]
async fn bad_frames_get_error_frames_and_the_socket_goes_on() {
    let mut rig = Rig::start(None).await;
    let mut socket = rig.connect().await;
    socket.send(Frame::text("not json")).await.unwrap();
    let e = next(&mut socket).await;
    assert!(
        e.get("id").is_none() && e["error"]["type"] == "invalid-request",
        "{e}"
    );
    socket
        .send(Frame::binary(b"\x00\x01".to_vec()))
        .await
        .unwrap();
    let e = next(&mut socket).await;
    assert!(message(&e).contains("binary"), "{e}");
    send(
        &mut socket,
        json!({"service": "text-completion", "request": {}}),
    )
    .await;
    let e = next(&mut socket).await;
    assert!(message(&e).contains("`id`"), "{e}");
    let mut unknown = ask("u1", "x");
    unknown["service"] = json!("graph-rag");
    send(&mut socket, unknown).await;
    let e = next(&mut socket).await;
    assert_eq!(e["id"], "u1");
    assert!(message(&e).contains("unknown service"), "{e}");
    let mut elsewhere = ask("f1", "x");
    elsewhere["flow"] = json!("other");
    send(&mut socket, elsewhere).await;
    let e = next(&mut socket).await;
    assert_eq!(e["id"], "f1");
    assert!(message(&e).contains("unknown flow"), "{e}");
    // TrustGraph 2.x's clients name their workspace: this gateway serves "default" only.
    let mut other_workspace = ask("w1", "x");
    other_workspace["workspace"] = json!("other");
    send(&mut socket, other_workspace).await;
    let e = next(&mut socket).await;
    assert_eq!(e["id"], "w1");
    assert!(message(&e).contains("unknown workspace \"other\""), "{e}");
    let mut undecodable = ask("d1", "x");
    undecodable["request"] = json!({"prompt": 7});
    send(&mut socket, undecodable).await;
    let e = next(&mut socket).await;
    assert_eq!(
        (&e["id"], &e["complete"]),
        (&json!("d1"), &json!(true)),
        "{e}"
    );
    assert_eq!(e["error"]["type"], "invalid-request", "{e}");
    send(&mut socket, ask("same", "first")).await;
    let (id, _) = rig.request().await;
    send(&mut socket, ask("same", "again")).await;
    let e = next(&mut socket).await;
    assert_eq!(e["id"], "same");
    assert!(message(&e).contains("already in flight"), "{e}");
    rig.answer(&id, "fine", true).await;
    let done = next(&mut socket).await;
    assert_eq!(
        (&done["id"], &done["complete"]),
        (&json!("same"), &json!(true)),
        "{done}"
    );
    assert_eq!(done["response"]["response"], "fine");
    let text = rig.telemetry.render();
    assert!(
        text.contains(r#"sluice_gateway_socket_frames_total{kind="invalid"} 7"#),
        "{text}"
    );
    rig.shutdown.cancel();
}

/// Closing the socket cancels what still runs on it: text-completion is told to stop.
#[tokio::test]
async fn closing_the_socket_cancels_its_requests() {
    let mut rig = Rig::start(None).await;
    let mut socket = rig.connect().await;
    send(&mut socket, ask("long", "x")).await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "started", false).await;
    assert_eq!(next(&mut socket).await["response"]["response"], "started");
    socket.close(None).await.unwrap();
    let cancel = tokio::time::timeout(Duration::from_secs(10), rig.cancels.next())
        .await
        .expect("a cancel")
        .unwrap()
        .unwrap();
    assert_eq!(cancel.property(properties::ID), Some(id.as_str()));
    cancel.ack();
    rig.shutdown.cancel();
}

/// A restart is a frame of its own, an empty response flagged `restarted` (sluice's addition),
/// and the new attempt is read to its end.
#[tokio::test]
async fn a_restart_is_a_frame_flagged_restarted() {
    let mut rig = Rig::start(None).await;
    let mut socket = rig.connect().await;
    send(&mut socket, ask("r", "x")).await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "par", false).await;
    let full = TextCompletionResponse {
        response: "full".into(),
        end_of_stream: true,
        ..TextCompletionResponse::default()
    };
    rig.llm.answer(&id, "a2", &full).await;
    let first = next(&mut socket).await;
    assert_eq!(first["response"]["response"], "par");
    let restarted = next(&mut socket).await;
    assert_eq!(
        (&restarted["id"], &restarted["complete"]),
        (&json!("r"), &json!(false))
    );
    assert_eq!(restarted["response"]["restarted"], true, "{restarted}");
    assert_eq!(restarted["response"]["response"], "", "{restarted}");
    let last = next(&mut socket).await;
    assert_eq!(
        (&last["response"]["response"], &last["complete"]),
        (&json!("full"), &json!(true))
    );
    rig.shutdown.cancel();
}

/// Whether the metrics show `line`, waiting a little for a request whose socket just closed.
async fn shows(telemetry: &Telemetry, line: &str) -> bool {
    for _ in 0..200 {
        if telemetry.render().lines().any(|l| l == line) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// A request still running when its socket closes is counted as a cancelled stream, and no
/// longer as an open one; one that completes, as a success.
#[tokio::test]
async fn a_socket_closed_mid_answer_counts_its_stream_cancelled() {
    let mut rig = Rig::start(None).await;
    let mut socket = rig.connect().await;
    send(&mut socket, ask("done", "x")).await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "whole", true).await;
    assert_eq!(next(&mut socket).await["complete"], true);
    assert!(
        shows(
            &rig.telemetry,
            r#"sluice_gateway_streams_total{outcome="success",route="socket"} 1"#
        )
        .await
    );
    send(&mut socket, ask("long", "x")).await;
    let (id, _) = rig.request().await;
    rig.answer(&id, "started", false).await;
    assert_eq!(next(&mut socket).await["response"]["response"], "started");
    assert!(
        shows(
            &rig.telemetry,
            r#"sluice_gateway_open_streams{route="socket"} 1"#
        )
        .await
    );
    socket.close(None).await.unwrap();
    assert!(
        shows(
            &rig.telemetry,
            r#"sluice_gateway_streams_total{outcome="cancelled",route="socket"} 1"#
        )
        .await,
        "{}",
        rig.telemetry.render()
    );
    assert!(
        shows(
            &rig.telemetry,
            r#"sluice_gateway_open_streams{route="socket"} 0"#
        )
        .await
    );
    rig.shutdown.cancel();
}
