//! The gateway's reading of HTTP requests: a POST body on each route (TrustGraph's, sluice's,
//! OpenAI's `/v1/chat/completions` and `/v1/responses`, Ollama's `/api/chat` and
//! `/api/generate`, Anthropic's `/v1/messages`) and in each
//! answer mode (JSON, NDJSON, SSE), through
//! the real router, with the services not enabled so nothing
//! reaches a bus (the body is read before that). Property: no panic; an unreadable body is a
//! 4xx, never a 5xx.

use std::{cell::RefCell, sync::Arc};

use axum::{Router, body::Body, http::Request};
use sluice_gateway::{Gateway, GatewayConfig};
use sluice_runtime::{bus::memory::MemoryBus, telemetry::Telemetry};
use tower::ServiceExt;

thread_local! {
    static ROUTER: RefCell<Option<(Router, Telemetry)>> = const { RefCell::new(None) };
}

fn router() -> Router {
    ROUTER.with(|cell| {
        let mut slot = cell.borrow_mut();
        let (router, _) = slot.get_or_insert_with(|| {
            let telemetry = Telemetry::new().unwrap_or_else(|e| panic!("telemetry: {e}"));
            let bus = Arc::new(MemoryBus::new(1024 * 1024, 16));
            let gateway =
                sluice_fuzz::block_on(Gateway::start(bus, GatewayConfig::new(), &telemetry))
                    .unwrap_or_else(|e| panic!("gateway: {e}"));
            (gateway.router(), telemetry)
        });
        router.clone()
    })
}

const PATHS: [&str; 10] = [
    "/api/v1/text-completion",
    "/api/v1/prompt",
    "/api/v1/agent",
    "/api/v1/flow/default/service/prompt",
    "/api/v1/flow/default/service/agent",
    // OpenAI's chat body (messages, roles, content parts, options) is read before the
    // route looks for its service.
    "/v1/chat/completions",
    // Ollama's bodies likewise (its typed decoder, options, tools, format).
    "/api/chat",
    "/api/generate",
    // Anthropic's Messages body likewise (its typed decoder, blocks, tools, tool results).
    "/v1/messages",
    // OpenAI's Responses body (input items, tools, text.format) likewise.
    "/v1/responses",
];
const ACCEPT: [&str; 3] = [
    "application/json",
    "application/x-ndjson",
    "text/event-stream",
];

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        let path = PATHS[usize::from(input.selector) % PATHS.len()];
        let accept = ACCEPT[usize::from(input.split) % ACCEPT.len()];
        let Ok(request) = Request::post(path)
            .header("content-type", "application/json")
            .header("accept", accept)
            .body(Body::from(input.body.to_vec()))
        else {
            return;
        };
        let response = sluice_fuzz::block_on(router().oneshot(request));
        let Ok(response) = response;
        let status = response.status();
        assert!(
            !status.is_server_error(),
            "HTTP {status} for a request body"
        );
        let _ = sluice_fuzz::block_on(axum::body::to_bytes(response.into_body(), 1 << 20));
    });
}
