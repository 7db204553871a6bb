//! sluice-gateway: HTTP in front of the processors.
//!
//! - `POST /api/v1/{service}` (`text-completion`, `prompt`, `agent`): the request record as
//!   the body. `Accept: application/x-ndjson` streams the gateway's events
//!   (docs/protocol.md#gateway-events-ndjson-and-sse), one JSON object per
//!   line, flushed per event; `Accept: text/event-stream` carries the same events as SSE,
//!   or, with the body's `streaming: true`, TrustGraph's records as SSE (seed 003's REST
//!   streaming); anything else gets the final record as JSON, or the records as SSE when the
//!   body says `streaming: true` (docs/protocol.md has the table).
//! - `POST /api/v1/flow/{flow}/service/{service}`: TrustGraph's REST form, answered the same
//!   way except that without an `Accept` naming a stream it answers JSON.
//! - `GET /api/v1/socket`: TrustGraph's multiplexed WebSocket protocol.
//! - `POST /v1/chat/completions`, `GET /v1/models`: OpenAI's dialect, for OpenAI SDKs and
//!   tools given this gateway as their base URL (see `openai`).
//! - `POST /v1/responses`: OpenAI's Responses API, whole or as its semantic SSE events (see
//!   `responses`).
//! - `POST /api/chat`, `POST /api/generate`, `GET /api/tags`, `POST /api/show`,
//!   `GET /api/version`: Ollama's API, for Ollama's clients given this gateway as their host
//!   (see `ollama`).
//! - `POST /v1/messages`: Anthropic's Messages API, for Anthropic's SDKs and the tools built
//!   on them given this gateway as their base URL (see `anthropic`).
//!
//! Every request goes over the bus with a fresh correlation id and a W3C `traceparent`; a
//! caller that goes away (HTTP disconnect, socket closed) drops its response stream, which
//! publishes a cancel so the processor stops the provider call. Errors are JSON
//! (`{"error":{"type","message"}}`) with a status that fits the error's type. Nothing here
//! logs a payload: payloads carry prompts and answers.

mod anthropic;
pub mod auth;
mod encode;
pub mod events;
pub mod guard;
mod http;
pub mod keys;
pub mod kinds;
mod limits;
pub mod metrics;
mod ollama;
mod openai;
mod preamble;
mod refusal;
mod responses;
mod resume;
pub mod server;
pub mod socket;

/// Entry points for the fuzz targets (`fuzz/`): the decoders of what the gateway reads from
/// outside that are not public otherwise, through the code the gateway runs. Not an API.
#[doc(hidden)]
pub mod fuzzing {
    use sluice_runtime::seal::SealKey;

    pub use crate::limits::{MAX_REPLICAS_PER_KEY, SnapshotReader};

    /// Reads `value` as a `Sluice-Resume` header, then seals the token it holds with `key` and
    /// reads it back: `None` for a value that is not a resume; else whether the token came
    /// back the same, its new seal verifying and the one sent not.
    pub fn resume_round_trip(value: &[u8], key: &SealKey) -> Option<bool> {
        crate::resume::round_trip(value, key)
    }
}

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Router,
    extract::DefaultBodyLimit,
    middleware,
    routing::{get, post},
};
use sluice_runtime::{
    bus::Bus,
    client::{ClientConfig, ClientError, RequestClient},
    reader::{ReadPolicy, Report},
    seal::SealKey,
    telemetry::{ClientOutcome, Telemetry},
    trace,
};
use sluice_schema::{
    AgentRequest, AgentResponse, Error, ErrorKind, PromptRequest, PromptResponse,
    TextCompletionRequest, TextCompletionResponse,
};
use tokio_util::sync::CancellationToken;
use tracing::info;

pub use crate::{
    auth::Auth, guard::Access, kinds::ServiceKind, metrics::GatewayMetrics, server::ServerLimits,
};

/// The bus topics (Pulsar URLs) of one service.
#[derive(Debug, Clone)]
pub struct ServiceTopics {
    /// Requests.
    pub request: String,
    /// Responses.
    pub response: String,
    /// Cancels (see `sluice_runtime::cancel`); `None` disables cancellation.
    pub cancel: Option<String>,
}

/// The gateway's settings.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Who may call.
    pub auth: Auth,
    /// Which browsers' pages and host names may reach the gateway (see [`guard`]).
    pub access: Access,
    /// Connections at once, and how long one has to send its headers (see [`server`]).
    pub server: ServerLimits,
    /// How long a WebSocket has to authenticate when credentials are required: closed
    /// after that, as after [`SOCKET_AUTH_FAILURES`] failed attempts.
    pub socket_auth_window: Duration,
    /// Requests one WebSocket may have running at once; more are refused with an error
    /// frame.
    pub socket_max_requests: usize,
    /// The largest request body (and WebSocket frame) accepted, in bytes.
    pub body_limit: usize,
    /// A request that has not finished after this long ends with a `timeout` error.
    pub request_timeout: Duration,
    /// A stream that receives nothing for this long ends with a `timeout` error.
    pub inactivity_timeout: Duration,
    /// The flow name TrustGraph clients address (`/api/v1/flow/{flow}/...`, socket `flow`).
    pub flow: String,
    /// The TrustGraph workspace the gateway serves: its WebSocket's `auth-ok` names it as the
    /// default, and a socket frame or TrustGraph REST body naming another is refused.
    pub workspace: String,
    /// The services routed to, and their topics. A service not listed answers 404.
    pub services: BTreeMap<ServiceKind, ServiceTopics>,
    /// How old a stream may be and still be resumed (docs/gateway.md#resuming-a-stream): at
    /// most the response topics' retention.
    pub resume_window: Duration,
    /// The topic the replicas share their API keys' limit state on
    /// (docs/gateway.md#limits-across-replicas); `None`, or a bus that keeps no messages,
    /// counts on this replica alone.
    pub limits_topic: Option<String>,
    /// The secret the replicas share (`SLUICE_GATEWAY_SECRET`): it seals resume tokens and
    /// the limit state on the bus, so that one replica trusts what another wrote and nobody
    /// else can write it. `None`: a random secret of this process, so that a single gateway
    /// needs none; its tokens resume on it alone and its limits are counted by it alone.
    pub secret: Option<SealKey>,
    /// The billing secret shared with text-completion alone (`SLUICE_BILLING_SECRET`, see
    /// `sluice_runtime::billing`): the API key a request is billed to goes on the bus with
    /// the gateway's seal of it, which a text-completion processor given the same secret
    /// requires. `None`: the key goes unsealed.
    pub billing: Option<SealKey>,
    /// Whether a caller without credentials (no token or keys file is required) is the
    /// operator: the local user of a gateway on loopback. On a gateway opened beyond
    /// loopback (`--allow-unauthenticated`) such a caller is anyone, a tenant without a key
    /// (see [`auth::Standing`]).
    pub anonymous_is_operator: bool,
}

impl GatewayConfig {
    /// Defaults: no auth, loopback hosts and no browser origin, 1 MiB bodies, 600 s per
    /// request, 120 s of silence, flow `default`, no services.
    pub fn new() -> Self {
        Self {
            auth: Auth::default(),
            access: Access::default(),
            server: ServerLimits::default(),
            socket_auth_window: Duration::from_secs(5),
            socket_max_requests: 64,
            body_limit: 1024 * 1024,
            request_timeout: Duration::from_secs(600),
            inactivity_timeout: Duration::from_secs(120),
            flow: "default".into(),
            workspace: "default".into(),
            services: BTreeMap::new(),
            resume_window: Duration::from_secs(15 * 60),
            limits_topic: None,
            secret: None,
            billing: None,
            anonymous_is_operator: true,
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// Failed authentications after which a WebSocket is closed.
pub const SOCKET_AUTH_FAILURES: u32 = 3;

/// The bus clients of the enabled services.
#[derive(Default)]
pub(crate) struct Clients {
    /// Shared with the process's other callers of text-completion where it runs beside them
    /// (see [`Gateway::start_sharing`]).
    text_completion: Option<Arc<TextCompletionClient>>,
    /// Whether the gateway made `text_completion` (and so closes it): a shared client is
    /// closed by its owner, after the processors that read through it have drained.
    text_completion_owned: bool,
    prompt: Option<RequestClient<PromptRequest, PromptResponse>>,
    agent: Option<RequestClient<AgentRequest, AgentResponse>>,
}

pub(crate) struct Inner {
    pub(crate) config: GatewayConfig,
    pub(crate) clients: Clients,
    pub(crate) metrics: GatewayMetrics,
    /// The model ids text-completion last said it serves, and when: the OpenAI route checks a
    /// request's `model` against them.
    pub(crate) models: tokio::sync::Mutex<Option<(std::time::Instant, Vec<String>)>>,
    /// The API keys' limits.
    pub(crate) limiter: Arc<limits::Limiter>,
    /// Seals what this gateway gives out and must trust again (resume tokens): the shared
    /// secret's, else this process's own.
    pub(crate) seal: SealKey,
    /// Stops the keys file's watch and the limit sharing.
    pub(crate) background: CancellationToken,
}

/// Why a caller's request is not admitted (see [`Inner::admit`]).
pub(crate) enum Refusal {
    /// The key may not use this service, model or flow: 403.
    Forbidden(String),
    /// A limit is reached: 429.
    Limited(limits::Limited),
}

impl Inner {
    /// Whether `caller` may use `service` naming `model`, without counting anything against
    /// its limits (a resumed stream, a list of models).
    pub(crate) fn permitted(
        &self,
        caller: &auth::Caller,
        service: ServiceKind,
        model: Option<&str>,
    ) -> Result<(), Refusal> {
        let Some(key) = caller.key() else {
            return Ok(());
        };
        match key.refuses(service, &self.config.flow, model) {
            None => Ok(()),
            Some(why) => {
                self.metrics.key_request(&key.name, "forbidden");
                Err(Refusal::Forbidden(why))
            }
        }
    }

    /// Admits a request of `caller` to `service` naming `model`, whose body is `body_bytes`
    /// long, reserving `max_tokens` and an estimate of its input, or says why not; `Ok(None)`
    /// for callers without limits. The admission settles the reserved tokens when dropped:
    /// give it to the request's reader ([`sluice_runtime::reader::Reader::meter`]).
    pub(crate) fn admit(
        &self,
        caller: &auth::Caller,
        service: ServiceKind,
        model: Option<&str>,
        max_tokens: Option<u64>,
        body_bytes: usize,
    ) -> Result<Option<limits::Admission>, Refusal> {
        self.admit_as(
            caller,
            service,
            model,
            limits::Ask::Request {
                max_tokens,
                body_bytes,
            },
        )
    }

    /// Admits the resumed stream of a request of `caller` to `service` naming `model` (a
    /// request, and a place in flight, of its key's limits; no tokens), or says why not.
    pub(crate) fn admit_resume(
        &self,
        caller: &auth::Caller,
        service: ServiceKind,
        model: Option<&str>,
    ) -> Result<Option<limits::Admission>, Refusal> {
        self.admit_as(caller, service, model, limits::Ask::Resume)
    }

    fn admit_as(
        &self,
        caller: &auth::Caller,
        service: ServiceKind,
        model: Option<&str>,
        ask: limits::Ask,
    ) -> Result<Option<limits::Admission>, Refusal> {
        self.permitted(caller, service, model)?;
        let Some(key) = caller.key() else {
            return Ok(None);
        };
        match self.limiter.admit(key, ask) {
            Ok(a) => {
                self.metrics.key_request(&key.name, "admitted");
                Ok(Some(a))
            }
            Err(l) => {
                let outcome = if l.quota {
                    "quota-exceeded"
                } else if l.concurrent {
                    "concurrency-limited"
                } else {
                    "rate-limited"
                };
                self.metrics.key_request(&key.name, outcome);
                Err(Refusal::Limited(l))
            }
        }
    }
}

/// A running gateway's state; build its router with [`Gateway::router`].
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// A service's response subscription or request publisher could not be created.
    #[error("cannot reach the {0} service's topics: {1}")]
    Bus(&'static str, ClientError),
    /// Metrics could not be registered.
    #[error("cannot register metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The listener failed.
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
}

/// A text-completion client, as the gateway and the prompt and agent processors hold it.
pub type TextCompletionClient = RequestClient<TextCompletionRequest, TextCompletionResponse>;

impl Gateway {
    /// Connects a client per enabled service and registers the metrics.
    pub async fn start(
        bus: Arc<dyn Bus>,
        config: GatewayConfig,
        telemetry: &Telemetry,
    ) -> Result<Self, GatewayError> {
        Self::start_sharing(bus, config, telemetry, None).await
    }

    /// [`Gateway::start`], reaching text-completion through `text_completion`, a client the
    /// process has already (`sluice serve`: the prompt and agent processors' own), instead of
    /// subscribing to its responses again. One subscription per topic and process is not only
    /// thriftier: every record on a topic wakes each subscription's router, and a second task
    /// woken on the same worker thread pushes the first out of tokio's LIFO slot and wakes
    /// another worker to take it, a thread hand-off on every token's way to the caller.
    /// The client is taken only when it reads as the gateway's own would
    /// ([`ClientConfig::reads_as`]); [`Gateway::close`] leaves a taken client open, for its
    /// owner to close after the others reading through it are done.
    pub async fn start_sharing(
        bus: Arc<dyn Bus>,
        config: GatewayConfig,
        telemetry: &Telemetry,
        text_completion: Option<Arc<TextCompletionClient>>,
    ) -> Result<Self, GatewayError> {
        let metrics = GatewayMetrics::register(&telemetry.registry)?;
        metrics.route_served(socket::ROUTE);
        let mut clients = Clients::default();
        let mut shared = text_completion;
        for (kind, topics) in &config.services {
            metrics.route_served(kind.as_str());
            let mut cc = ClientConfig::new(
                format!("gateway-{}", kind.as_str()),
                topics.request.clone(),
                topics.response.clone(),
            );
            cc.cancel_topic.clone_from(&topics.cancel);
            cc.inactivity_timeout = config.inactivity_timeout;
            cc.total_timeout = config.request_timeout;
            let new_client = NewClient {
                bus: bus.clone(),
                config: cc,
                telemetry,
                name: kind.as_str(),
            };
            match kind {
                ServiceKind::TextCompletion => {
                    metrics.route_served(openai::CHAT_ROUTE);
                    metrics.route_served(openai::MODELS_ROUTE);
                    metrics.route_served(responses::ROUTE);
                    metrics.route_served(ollama::CHAT_ROUTE);
                    metrics.route_served(ollama::GENERATE_ROUTE);
                    metrics.route_served(anthropic::ROUTE);
                    metrics.route_served(anthropic::MODELS_ROUTE);
                    // Only a client that reads as this gateway's own would is shared.
                    let same =
                        |c: &Arc<TextCompletionClient>| c.config().reads_as(&new_client.config);
                    clients.text_completion = match shared.take().filter(same) {
                        Some(c) => Some(c),
                        None => {
                            clients.text_completion_owned = true;
                            Some(Arc::new(new_client.client().await?))
                        }
                    };
                }
                ServiceKind::Prompt => clients.prompt = Some(new_client.client().await?),
                ServiceKind::Agent => clients.agent = Some(new_client.client().await?),
            }
        }
        let limiter = Arc::new(limits::Limiter::new(metrics.clone()));
        let background = CancellationToken::new();
        let seal = config.secret.clone().unwrap_or_else(SealKey::random);
        if !seal.is_shared() && bus.keeps_messages() && !config.resume_window.is_zero() {
            info!(
                "streams resume only through this gateway: its replicas resume each other's with a secret they share (SLUICE_GATEWAY_SECRET or SLUICE_GATEWAY_SECRET_FILE)"
            );
        }
        if let Some(keys) = config.auth.keys() {
            let ring = keys.ring();
            metrics.keys(ring.len());
            ring.names().for_each(|name| metrics.key_known(name));
            let (m, k) = (metrics.clone(), keys.clone());
            tokio::spawn(keys.clone().watch(background.clone(), move |taken, n| {
                m.keys_reloaded(taken, n);
                if taken {
                    k.ring().names().for_each(|name| m.key_known(name));
                }
            }));
            if let Some(topic) = &config.limits_topic {
                if !bus.keeps_messages() {
                    info!(
                        "API key limits are counted by this gateway alone: the bus keeps no messages to share them through"
                    );
                } else if !seal.is_shared() {
                    // What another replica publishes could not be told from a forgery.
                    info!(
                        "API key limits are counted by this gateway alone: the replicas share them only with a secret they share (SLUICE_GATEWAY_SECRET or SLUICE_GATEWAY_SECRET_FILE)"
                    );
                } else {
                    let (replayed, read) = tokio::sync::oneshot::channel();
                    tokio::spawn(limiter.clone().share(
                        bus.clone(),
                        topic.clone(),
                        limits::Sharing {
                            seal: seal.clone(),
                            keys: keys.clone(),
                        },
                        background.clone(),
                        replayed,
                    ));
                    // The day's and month's usage of every replica, before the first caller.
                    let _ = tokio::time::timeout(limits::REPLAY_WAIT, read).await;
                    info!(topic, "API key limits shared through the bus");
                }
            }
        }
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                clients,
                metrics,
                models: tokio::sync::Mutex::new(None),
                limiter,
                seal,
                background,
            }),
        })
    }

    /// The HTTP routes, behind the browser-facing checks of [`guard`] (and CORS answers for
    /// the origins it allows).
    pub fn router(&self) -> Router {
        let routes = Router::new()
            .route("/api/v1/socket", get(socket::upgrade))
            .route("/api/v1/models", get(http::models))
            .route(
                "/v1/chat/completions",
                post(openai::chat).fallback(openai::invalid_url),
            )
            .route(
                "/v1/models",
                get(openai::models).fallback(openai::invalid_url),
            )
            .route("/v1/models/{model}", get(openai::model))
            .route(
                "/v1/messages",
                post(anthropic::messages).fallback(anthropic::not_served),
            )
            .route(
                "/v1/messages/{*rest}",
                axum::routing::any(anthropic::not_served),
            )
            .route(
                "/v1/responses",
                post(responses::create).fallback(openai::invalid_url),
            )
            .route("/v1/{*rest}", axum::routing::any(openai::invalid_url))
            .route("/api/chat", post(ollama::chat))
            .route("/api/generate", post(ollama::generate))
            .route("/api/tags", get(ollama::tags))
            .route("/api/show", post(ollama::show))
            .route("/api/version", get(ollama::version))
            .route("/api/v1/{service}", post(http::service))
            .route(
                "/api/v1/flow/{flow}/service/{service}",
                post(http::flow_service),
            )
            .fallback(http::not_found)
            .layer(DefaultBodyLimit::max(self.inner.config.body_limit));
        let routes = match self.inner.config.access.cors() {
            Some(cors) => routes.layer(cors),
            None => routes,
        };
        // The checks wrap everything else, CORS preflights included: an origin that is not
        // allowed learns nothing but its refusal. Inside them, every labelled response is
        // counted by its route.
        routes
            .layer(middleware::from_fn_with_state(
                self.inner.clone(),
                preamble::count_requests,
            ))
            .layer(middleware::from_fn_with_state(
                self.inner.clone(),
                guard::guard,
            ))
            .with_state(self.inner.clone())
    }

    /// Serves until `shutdown`, then lets open responses finish (see [`server`]: the
    /// connection cap, the header deadline, TCP_NODELAY).
    pub async fn serve(
        &self,
        addr: SocketAddr,
        shutdown: CancellationToken,
    ) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), GatewayError> {
        self.serve_app(addr, self.router(), shutdown).await
    }

    /// [`Gateway::serve`] of `app`: the gateway's [`Gateway::router`] with routes of the
    /// process merged beside it (`sluice serve`'s `/metrics` on its loopback metrics port),
    /// under the same connection cap and header deadline.
    pub async fn serve_app(
        &self,
        addr: SocketAddr,
        app: Router,
        shutdown: CancellationToken,
    ) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), GatewayError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| GatewayError::Listen(addr, e))?;
        let local = listener
            .local_addr()
            .map_err(|e| GatewayError::Listen(addr, e))?;
        let limits = self.inner.config.server;
        info!(
            %local,
            max_connections = limits.max_connections,
            header_read_timeout_secs = limits.header_read_timeout.as_secs_f64(),
            "gateway listening"
        );
        let metrics = self.inner.metrics.clone();
        let task = tokio::spawn(server::serve(listener, app, limits, metrics, shutdown));
        Ok((local, task))
    }

    /// Closes the bus clients the gateway made (their response subscriptions are deleted);
    /// a text-completion client given to [`Gateway::start_sharing`] stays open for its owner.
    pub async fn close(&self) {
        self.inner.background.cancel();
        let c = &self.inner.clients;
        if let Some(tc) = c
            .text_completion
            .as_ref()
            .filter(|_| c.text_completion_owned)
        {
            tc.close().await;
        }
        if let Some(c) = &c.prompt {
            c.close().await;
        }
        if let Some(c) = &c.agent {
            c.close().await;
        }
    }
}

/// What starting one service's bus client needs; the client's types come from the field it
/// is stored in.
struct NewClient<'a> {
    bus: Arc<dyn Bus>,
    config: ClientConfig,
    telemetry: &'a Telemetry,
    name: &'static str,
}

impl NewClient<'_> {
    /// Subscribes to the service's responses; readiness follows that subscription.
    async fn client<Req: serde::Serialize, Resp: sluice_schema::ResponseRecord>(
        self,
    ) -> Result<RequestClient<Req, Resp>, GatewayError> {
        let c = RequestClient::start(self.bus, self.config, Some(self.telemetry.metrics.clone()))
            .await
            .map_err(|e| GatewayError::Bus(self.name, e))?;
        self.telemetry
            .health
            .watch(format!("{} responses", self.name), c.link());
        Ok(c)
    }
}

/// How a route that shows a restart to its caller reads an answer (the NDJSON and SSE events'
/// `restarted` status, TrustGraph's SSE records and WebSocket): its encoder is told, and
/// reading goes on.
pub(crate) fn reporting() -> ReadPolicy<Report> {
    ReadPolicy::new(Report, client_error)
}

/// The error a client-side failure becomes.
pub(crate) fn client_error(e: &ClientError) -> Error {
    // The gateway's own wording for its HTTP clients; the kind is the client's.
    let message = match e {
        ClientError::InactivityTimeout(d) => format!("no answer for {} s", d.as_secs()),
        ClientError::TotalTimeout(d) => {
            format!("the answer did not complete within {} s", d.as_secs())
        }
        ClientError::Closed => "the gateway is shutting down".to_owned(),
        ClientError::Bus(e) => format!("the message bus is unavailable: {e}"),
        ClientError::NotStored(e) => {
            format!("the message bus did not store the request; send it again later: {e}")
        }
        ClientError::Decode(e) => format!("a response could not be decoded: {e}"),
        ClientError::Encode(e) => e.clone(),
        ClientError::DuplicateId(id) => format!("request id {id:?} is already in flight"),
        ClientError::RecordsLost { .. }
        | ClientError::StreamLost(_)
        | ClientError::LostInTransit(_) => e.to_string(),
    };
    Error::new(e.kind(ErrorKind::Gateway), message)
}

/// The gateway's server span for one request: a child of the caller's `traceparent` header
/// when it is valid, else the start of a new trace. Its context goes on the bus.
pub(crate) fn server_span(route: &str, incoming: Option<&str>) -> trace::Span {
    http_span("POST", &format!("/api/v1/{route}"), incoming)
}

/// Marks how a stream ended on its span: failed unless it succeeded.
pub(crate) fn trace_outcome(span: &mut trace::Span, outcome: ClientOutcome) {
    span.set("sluice.outcome", outcome.as_str());
    if outcome != ClientOutcome::Success {
        span.fail(outcome.as_str());
    }
}

/// The server span of a request to `path`, continuing the caller's trace when it sent one.
pub(crate) fn http_span(method: &str, path: &str, incoming: Option<&str>) -> trace::Span {
    let mut span = trace::Span::start(trace::Kind::Server, format!("{method} {path}"), incoming);
    span.set("http.request.method", method.to_owned());
    span.set("http.route", path.to_owned());
    span
}

#[cfg(test)]
mod testing;

#[cfg(test)]
mod tests {
    use sluice_runtime::{bus::memory::MemoryBus, testkit::ServiceStub};
    use sluice_schema::TextCompletionResponse;

    use super::*;

    /// A gateway's configuration serving only text-completion, on the topics `tc-req`,
    /// `tc-resp` and `tc-cancel` (the in-process bus's tests of this crate).
    pub(crate) fn serving_text_completion() -> GatewayConfig {
        let mut config = GatewayConfig::new();
        config.services = BTreeMap::from([(
            ServiceKind::TextCompletion,
            ServiceTopics {
                request: "tc-req".into(),
                response: "tc-resp".into(),
                cancel: Some("tc-cancel".into()),
            },
        )]);
        config
    }

    /// A gateway serving text-completion on `bus`, handed `shared` to share, and the client
    /// configuration that reads as its own would.
    async fn sharing(
        bus: &MemoryBus,
        shared: impl FnOnce(ClientConfig) -> ClientConfig,
    ) -> (Gateway, Arc<TextCompletionClient>) {
        let config = serving_text_completion();
        let mut cc = ClientConfig::new("text-completion", "tc-req", "tc-resp");
        cc.cancel_topic = Some("tc-cancel".into());
        cc.inactivity_timeout = config.inactivity_timeout;
        cc.total_timeout = config.request_timeout;
        let bus: Arc<dyn Bus> = Arc::new(bus.clone());
        let client = Arc::new(
            RequestClient::start(bus.clone(), shared(cc), None)
                .await
                .unwrap(),
        );
        let telemetry = Telemetry::new().unwrap();
        let gateway = Gateway::start_sharing(bus, config, &telemetry, Some(client.clone()))
            .await
            .unwrap();
        (gateway, client)
    }

    /// Asks `client` once, `stub` answering, and returns the answer's text.
    async fn ask(
        client: &TextCompletionClient,
        stub: &mut ServiceStub,
    ) -> Result<String, ClientError> {
        let request = TextCompletionRequest {
            prompt: "hello".into(),
            ..TextCompletionRequest::default()
        };
        let stream = client.request(&request).await?;
        let (id, _): (String, TextCompletionRequest) = stub.request().await;
        let end = TextCompletionResponse {
            response: "hi".into(),
            end_of_stream: true,
            ..TextCompletionResponse::default()
        };
        stub.answer(&id, "a1", &end).await;
        let records = stream.collect().await?;
        Ok(records.iter().map(|r| r.response.as_str()).collect())
    }

    #[tokio::test]
    async fn a_shared_client_is_taken_only_when_it_reads_as_the_gateways_and_outlives_its_close() {
        let bus = MemoryBus::new(1 << 20, 1000);
        let mut stub = ServiceStub::start(&bus, "tc-req", "tc-resp").await;
        let (gateway, shared) = sharing(&bus, |cc| cc).await;
        let taken = gateway.inner.clients.text_completion.as_ref().unwrap();
        assert!(Arc::ptr_eq(taken, &shared), "the same settings: shared");
        // `sluice serve` closes the gateway when its HTTP server is done, while the prompt
        // and agent processors may still be draining through the client they share.
        gateway.close().await;
        assert_eq!(ask(&shared, &mut stub).await.unwrap(), "hi");

        for differs in [
            (|mut cc: ClientConfig| {
                cc.total_timeout += Duration::from_secs(1);
                cc
            }) as fn(ClientConfig) -> ClientConfig,
            |mut cc| {
                cc.cancel_topic = None;
                cc
            },
            |mut cc| {
                cc.loss_grace += Duration::from_secs(1);
                cc
            },
        ] {
            let (gateway, offered) = sharing(&bus, differs).await;
            let own = gateway.inner.clients.text_completion.clone().unwrap();
            assert!(!Arc::ptr_eq(&own, &offered), "other settings: not shared");
            gateway.close().await;
            assert!(matches!(
                ask(&own, &mut stub).await,
                Err(ClientError::Closed)
            ));
            assert_eq!(ask(&offered, &mut stub).await.unwrap(), "hi");
        }
    }

    #[test]
    fn the_server_span_continues_a_valid_trace_and_starts_one_otherwise() {
        let span = server_span(
            "text-completion",
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        let tp = span.traceparent();
        assert!(tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(!tp.contains("00f067aa0ba902b7"));
        assert_eq!(tp.len(), 55);
        for bad in [
            None,
            Some("garbage"),
            Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
        ] {
            let tp = server_span("prompt", bad).traceparent();
            assert_eq!(tp.len(), 55);
            assert!(!tp.contains("00000000000000000000000000000000"));
        }
    }
}
