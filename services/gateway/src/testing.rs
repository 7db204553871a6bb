//! The gateway's routes through its router on the in-process bus, for the unit tests of every
//! dialect: one rig (the gateway serving text-completion, the test playing text-completion,
//! the cancels it sends, its metrics) and the readings of a body each suite shares.

use std::time::Duration;

use axum::{
    Router,
    body::Body,
    http::{Request, Response},
};
use serde_json::Value;
use sluice_runtime::{
    bus::{Bus, SubscribeOptions, Subscription, memory::MemoryBus},
    telemetry::Telemetry,
    testkit::ServiceStub,
};
use sluice_schema::{ModelInfo, TextCompletionRequest, TextCompletionResponse};
use tower::ServiceExt;

use crate::{Gateway, GatewayConfig};

/// A gateway serving text-completion on the in-process bus, its other side held by the test.
pub(crate) struct Rig {
    /// Text-completion, as the gateway sees it.
    pub(crate) llm: ServiceStub,
    /// The cancels the gateway sends.
    pub(crate) cancels: Box<dyn Subscription>,
    pub(crate) router: Router,
    pub(crate) telemetry: Telemetry,
}

impl Rig {
    pub(crate) async fn start() -> Rig {
        Self::start_with(|_| {}).await
    }

    /// [`Rig::start`], with the gateway's configuration adjusted by `configure` (its
    /// credentials, say).
    pub(crate) async fn start_with(configure: impl FnOnce(&mut GatewayConfig)) -> Rig {
        let bus = MemoryBus::new(1 << 20, 1000);
        let llm = ServiceStub::start(&bus, "tc-req", "tc-resp").await;
        let cancels = bus
            .subscribe("tc-cancel", "stub", SubscribeOptions::shared(16))
            .await
            .unwrap();
        let telemetry = Telemetry::new().unwrap();
        let mut config = crate::tests::serving_text_completion();
        configure(&mut config);
        let gateway = Gateway::start(std::sync::Arc::new(bus.clone()), config, &telemetry)
            .await
            .unwrap();
        Rig {
            llm,
            cancels,
            router: gateway.router(),
            telemetry,
        }
    }

    /// Sends `body` to `path` with `headers`; the answer is awaited by the caller, while the
    /// test plays text-completion.
    pub(crate) fn post(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: Value,
    ) -> tokio::task::JoinHandle<Response<Body>> {
        let mut req = Request::post(path)
            .header("host", "localhost")
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Body::from(body.to_string())).unwrap();
        let router = self.router.clone();
        tokio::spawn(async move { router.oneshot(req).await.unwrap() })
    }

    /// The next request the gateway sent to text-completion, and its bus id.
    pub(crate) async fn request(&mut self) -> (String, TextCompletionRequest) {
        self.llm.request().await
    }

    /// Answers the `list-models` request the OpenAI route checks a model with.
    pub(crate) async fn serve_models(&mut self) {
        let (id, request) = self.request().await;
        assert_eq!(request.operation.as_deref(), Some("list-models"));
        let models = TextCompletionResponse {
            end_of_stream: true,
            models: vec![ModelInfo {
                id: "routed".into(),
                ..ModelInfo::default()
            }],
            ..TextCompletionResponse::default()
        };
        self.llm.answer(&id, "m1", &models).await;
    }

    /// Publishes `record` for bus id `id` as attempt `attempt` (a new attempt is a restart).
    pub(crate) async fn answer(&self, id: &str, attempt: &str, record: TextCompletionResponse) {
        self.llm.answer(id, attempt, &record).await;
    }

    /// Whether the metrics show `line` ([`metrics_show`]).
    pub(crate) async fn shows(&self, line: &str) -> bool {
        metrics_show(&self.telemetry, line).await
    }

    /// Asserts that one stream of `route` ended with `outcome` and none is open.
    pub(crate) async fn stream_counted(&self, route: &str, outcome: &str) {
        let total =
            format!(r#"sluice_gateway_streams_total{{outcome="{outcome}",route="{route}"}} 1"#);
        assert!(self.shows(&total).await, "{total}");
        let open = format!(r#"sluice_gateway_open_streams{{route="{route}"}} 0"#);
        assert!(self.shows(&open).await, "{open}");
    }
}

/// A piece of an answer: `text`, the end when `end`, two tokens in and one out.
pub(crate) fn piece(text: &str, end: bool) -> TextCompletionResponse {
    TextCompletionResponse {
        response: text.to_owned(),
        end_of_stream: end,
        in_token: Some(2),
        out_token: Some(1),
        ..TextCompletionResponse::default()
    }
}

/// The whole body, as text.
pub(crate) async fn body(resp: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The lines of an NDJSON body, as JSON; the body must end with its last line's newline.
pub(crate) fn lines(body: &str) -> Vec<Value> {
    assert!(body.ends_with('\n'), "{body:?}");
    body.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Whether `telemetry` shows `line` (a sample and its value), waiting for a stream that
/// ends as its body is dropped (by another task: how soon depends on the machine, so the
/// bound, 30 s, only ends a wait that would never succeed). The routes' tests share it.
pub(crate) async fn metrics_show(telemetry: &Telemetry, line: &str) -> bool {
    for _ in 0..3_000 {
        if telemetry.render().lines().any(|l| l == line) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}
