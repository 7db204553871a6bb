//! Who may reach the gateway from a browser (docs/security.md): the checks every request
//! meets before any route sees it, as one middleware on the router.
//!
//! A gateway on a developer's machine holds their provider keys. Any web page they visit can
//! make their browser send requests to `127.0.0.1`, and, by rebinding its own DNS name to
//! `127.0.0.1`, read the answers. Three checks close that, in this order:
//!
//! 1. **Host** (DNS rebinding): a rebound page's requests carry its own name in `Host`. Where
//!    the check is on, a `Host` that is not an allowed name is refused with 421 (Misdirected
//!    Request). It is on by default for a loopback listener, and for any listener that
//!    requires no credentials (an open gateway is the target a rebinding page looks for):
//!    then only loopback names are allowed (`localhost`, `*.localhost`, `127.0.0.0/8`,
//!    `[::1]`). A request without `Host` is not a browser's, and passes.
//! 2. **Origin**: browsers name the page that makes a request in `Origin` (every
//!    cross-origin `fetch`, every WebSocket opening). A request whose `Origin` is not on the
//!    allow-list (none by default) is refused with 403, WebSocket upgrades included; a
//!    request without `Origin` is a non-browser client's, and passes. Listed origins get CORS
//!    answers (preflights, `Access-Control-Allow-Origin`); nothing else does.
//! 3. **Content type**: a POST with a body must say it is JSON (`application/json` or
//!    `application/*+json`). Browsers send `text/plain`, form types and bodies without a type
//!    cross-origin without asking first (a "simple request"); a JSON type makes them ask
//!    (a CORS preflight), which an unlisted origin never passes. Refused with 415. A POST
//!    without a body carries no request to act on (every POST route decodes one), and goes on
//!    to be answered as its route answers it (an unknown route's 404, say).
//!
//! Each refusal comes before any work (no body read, no bus, no provider), in the error shape
//! of the route's dialect, and is counted in `sluice_gateway_refusals_total{reason}`. This
//! module never decides who a caller is: credentials are `auth`'s.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use axum::{
    extract::{Request, State},
    http::{HeaderMap, HeaderValue, Method, StatusCode, header},
    middleware::Next,
    response::Response,
};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::{Inner, metrics::GatewayMetrics};

/// The request headers a browser page may send cross-origin to a listed origin's gateway.
const CORS_REQUEST_HEADERS: [&str; 7] = [
    "authorization",
    "content-type",
    "accept",
    "last-event-id",
    "sluice-resume",
    "traceparent",
    "x-session-id",
];
/// The response headers a listed origin's page may read.
const CORS_EXPOSED_HEADERS: [&str; 2] = ["sluice-resume-token", "x-request-id"];

/// Which `Host` names are served (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRule {
    /// Every `Host` (no DNS-rebinding check).
    Any,
    /// Loopback names and addresses, and these names (each `name` or `name:port`, lowercase).
    Loopback(Vec<String>),
}

/// What the browser-facing checks allow (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    /// The `Host` names served.
    pub hosts: HostRule,
    /// The origins (`scheme://host[:port]`, lowercase) whose pages may call; `["*"]` is
    /// every origin (only with credentials required: see [`Access::new`]).
    pub origins: Vec<String>,
}

impl Default for Access {
    /// Loopback hosts only, no origin: what a gateway on loopback without credentials needs.
    fn default() -> Self {
        Self {
            hosts: HostRule::Loopback(Vec::new()),
            origins: Vec::new(),
        }
    }
}

/// Why the access settings cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AccessError {
    /// An origin is not `scheme://host[:port]`.
    #[error(
        "--allowed-origin {0:?} is not an origin (scheme://host or scheme://host:port, no path)"
    )]
    BadOrigin(String),
    /// A host is not a name or `name:port`.
    #[error("--allowed-host {0:?} is not a host name (NAME or NAME:PORT)")]
    BadHost(String),
    /// Every origin, on a gateway that asks no credentials: any web page could use it.
    #[error(
        "--allowed-origin '*' lets every web page call this gateway; it needs a token or keys file (SLUICE_GATEWAY_TOKEN, --keys-file)"
    )]
    AnyOriginWithoutAuth,
}

impl Access {
    /// The checks for a gateway listening on `listen`, given the allowed hosts and origins
    /// (as given on the command line: `*` for every host; origins as `scheme://host[:port]`
    /// or `*`) and whether callers must present credentials.
    pub fn new(
        listen: SocketAddr,
        credentials_required: bool,
        hosts: &[String],
        origins: &[String],
    ) -> Result<Self, AccessError> {
        let origins = origins
            .iter()
            .map(|o| normalise_origin(o))
            .collect::<Result<Vec<_>, _>>()?;
        if !credentials_required && origins.iter().any(|o| o == "*") {
            return Err(AccessError::AnyOriginWithoutAuth);
        }
        let hosts = if hosts.iter().any(|h| h.trim() == "*") {
            HostRule::Any
        } else if hosts.is_empty() && credentials_required && !listen.ip().is_loopback() {
            // Credentials close what rebinding would open: a browser never adds a bearer
            // token by itself. A gateway open beyond loopback serves the names it is reached
            // by, which only its operator knows.
            HostRule::Any
        } else {
            let names = hosts
                .iter()
                .map(|h| normalise_host(h))
                .collect::<Result<Vec<_>, _>>()?;
            HostRule::Loopback(names)
        };
        Ok(Self { hosts, origins })
    }

    /// Whether `host` (a `Host` header's value) is served.
    pub fn host_allowed(&self, host: &str) -> bool {
        match &self.hosts {
            HostRule::Any => true,
            HostRule::Loopback(names) => {
                let host = host.trim().to_ascii_lowercase();
                let (name, _port) = split_host(&host);
                is_loopback_name(name)
                    || names
                        .iter()
                        .any(|n| *n == host || (!n.contains(':') && n == name))
            }
        }
    }

    /// Whether a page of `origin` (an `Origin` header's value) may call.
    pub fn origin_allowed(&self, origin: &str) -> bool {
        let origin = origin.trim().to_ascii_lowercase();
        self.origins.iter().any(|o| o == "*" || *o == origin)
    }

    /// The CORS answers for the listed origins, or `None` when no origin is listed (no CORS
    /// header is ever sent then).
    pub(crate) fn cors(&self) -> Option<CorsLayer> {
        if self.origins.is_empty() {
            return None;
        }
        let allow = if self.origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(
                self.origins
                    .iter()
                    .filter_map(|o| HeaderValue::from_str(o).ok()),
            )
        };
        Some(
            CorsLayer::new()
                .allow_origin(allow)
                .allow_methods([Method::GET, Method::POST])
                .allow_headers(CORS_REQUEST_HEADERS.map(header::HeaderName::from_static))
                .expose_headers(CORS_EXPOSED_HEADERS.map(header::HeaderName::from_static))
                .max_age(std::time::Duration::from_secs(600)),
        )
    }
}

/// `name` and `port` of a `Host` value (`name`, `name:port`, `[v6]`, `[v6]:port`).
fn split_host(host: &str) -> (&str, Option<&str>) {
    if let Some(rest) = host.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((addr, tail)) => (addr, tail.strip_prefix(':')),
            None => (host, None),
        };
    }
    match host.rsplit_once(':') {
        // More than one colon without brackets: a bare IPv6 address, no port.
        Some((name, _)) if name.contains(':') => (host, None),
        Some((name, port)) => (name, Some(port)),
        None => (host, None),
    }
}

/// Loopback names: `localhost` and its subdomains (RFC 6761: browsers resolve them to
/// loopback themselves), and loopback addresses. `0.0.0.0` is not one: some browsers send
/// requests for it to the local machine, which is how pages reached local servers before.
fn is_loopback_name(name: &str) -> bool {
    let name = name.trim_end_matches('.');
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn normalise_host(h: &str) -> Result<String, AccessError> {
    let host = h.trim().to_ascii_lowercase();
    let (name, port) = split_host(&host);
    let name_ok = !name.is_empty()
        && (name.parse::<IpAddr>().is_ok()
            || name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'));
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok());
    if name_ok && port_ok {
        Ok(host)
    } else {
        Err(AccessError::BadHost(h.to_owned()))
    }
}

fn normalise_origin(o: &str) -> Result<String, AccessError> {
    let origin = o.trim().to_ascii_lowercase();
    if origin == "*" {
        return Ok(origin);
    }
    let bad = || AccessError::BadOrigin(o.to_owned());
    let (scheme, rest) = origin.split_once("://").ok_or_else(bad)?;
    if scheme.is_empty()
        || !scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+')
    {
        return Err(bad());
    }
    // Browsers send an origin without a trailing slash or path.
    if rest.is_empty() || rest.contains('/') {
        return Err(bad());
    }
    normalise_host(rest).map_err(|_| bad())?;
    Ok(origin)
}

/// Whether a content type names a JSON body: `application/json` or `application/*+json`,
/// parameters (`; charset=utf-8`) aside.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|sub| sub.ends_with("+json") && sub.len() > "+json".len())
}

/// Whether a request says it has a body: a `Content-Length` other than 0, or a
/// `Transfer-Encoding` (a chunked body of any length).
fn has_body(headers: &HeaderMap) -> bool {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        return true;
    }
    match headers.get(header::CONTENT_LENGTH) {
        None => false,
        // hyper has refused a length that is not a number before a route is reached.
        Some(v) => v.to_str().map_or(true, |v| v.trim() != "0"),
    }
}

/// Why a request was refused before any route saw it (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    Host,
    Origin,
    ContentType,
}

impl Refused {
    /// The metric label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Refused::Host => "host",
            Refused::Origin => "origin",
            Refused::ContentType => "content-type",
        }
    }
}

/// The checks of one request, in order; `Ok` when it may go on.
pub(crate) fn check(
    access: &Access,
    method: &Method,
    headers: &HeaderMap,
) -> Result<(), (Refused, StatusCode, String)> {
    if let Some(host) = headers.get(header::HOST) {
        let allowed = host.to_str().is_ok_and(|h| access.host_allowed(h));
        if !allowed {
            return Err((
                Refused::Host,
                StatusCode::MISDIRECTED_REQUEST,
                "this gateway does not serve the host name in the request's Host header (a page that rebinds its DNS name to this machine sends its own); list it with --allowed-host".into(),
            ));
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let allowed = origin.to_str().is_ok_and(|o| access.origin_allowed(o));
        if !allowed {
            return Err((
                Refused::Origin,
                StatusCode::FORBIDDEN,
                "requests from web pages of this origin are refused; list the origin with --allowed-origin to let its pages call".into(),
            ));
        }
    }
    if *method == Method::POST && has_body(headers) {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json);
        if !json {
            return Err((
                Refused::ContentType,
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "the request body must be JSON, sent with `Content-Type: application/json`".into(),
            ));
        }
    }
    Ok(())
}

/// The middleware: refuses what [`check`] refuses, in the route's error shape.
pub(crate) async fn guard(State(inner): State<Arc<Inner>>, req: Request, next: Next) -> Response {
    match check(&inner.config.access, req.method(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err((why, status, message)) => {
            refused(&inner.metrics, why);
            crate::refusal::render(
                req.uri().path(),
                req.headers(),
                status,
                "invalid-request",
                &message,
            )
        }
    }
}

fn refused(metrics: &GatewayMetrics, why: Refused) {
    metrics.refusal(why.as_str());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 8088))
    }

    fn everywhere() -> SocketAddr {
        SocketAddr::from(([0, 0, 0, 0], 8088))
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| (*x).to_owned()).collect()
    }

    #[test]
    fn a_loopback_gateway_serves_only_loopback_names_unless_told() {
        let a = Access::new(loopback(), false, &[], &[]).unwrap();
        for ok in [
            "localhost",
            "localhost:8088",
            "LOCALHOST:1",
            "api.localhost:8088",
            "127.0.0.1:8088",
            "127.1.2.3",
            "[::1]:8088",
            "[::1]",
            "localhost.",
        ] {
            assert!(a.host_allowed(ok), "{ok}");
        }
        for bad in [
            "evil.example:8088",
            "evil.example",
            "localhost.evil.example",
            "0.0.0.0:8088",
            "10.0.0.1:8088",
            "[::2]:8088",
            "",
        ] {
            assert!(!a.host_allowed(bad), "{bad}");
        }
        let a = Access::new(loopback(), true, &s(&["gw.internal", "other:9000"]), &[]).unwrap();
        assert!(a.host_allowed("gw.internal:8088"));
        assert!(a.host_allowed("other:9000"));
        assert!(!a.host_allowed("other:9001"));
        assert!(!a.host_allowed("evil.example"));
        let a = Access::new(loopback(), false, &s(&["*"]), &[]).unwrap();
        assert!(a.host_allowed("evil.example"));
    }

    #[test]
    fn beyond_loopback_the_host_check_is_on_only_without_credentials() {
        let open = Access::new(everywhere(), false, &[], &[]).unwrap();
        assert!(!open.host_allowed("evil.example:8088"));
        assert!(open.host_allowed("localhost:8088"));
        let authed = Access::new(everywhere(), true, &[], &[]).unwrap();
        assert_eq!(authed.hosts, HostRule::Any);
        let listed = Access::new(everywhere(), true, &s(&["gw.example"]), &[]).unwrap();
        assert!(!listed.host_allowed("evil.example"));
        assert!(listed.host_allowed("gw.example"));
    }

    #[test]
    fn origins_are_exact_and_every_origin_needs_credentials() {
        let a = Access::new(
            loopback(),
            false,
            &[],
            &s(&["http://localhost:3000", "HTTPS://App.Example"]),
        )
        .unwrap();
        assert!(a.origin_allowed("http://localhost:3000"));
        assert!(a.origin_allowed("https://app.example"));
        assert!(!a.origin_allowed("http://localhost:3001"));
        assert!(!a.origin_allowed("https://app.example.evil"));
        assert!(!a.origin_allowed("null"));
        assert_eq!(
            Access::new(loopback(), false, &[], &s(&["*"])),
            Err(AccessError::AnyOriginWithoutAuth)
        );
        assert!(
            Access::new(loopback(), true, &[], &s(&["*"]))
                .unwrap()
                .origin_allowed("https://anything.example")
        );
        for bad in ["localhost:3000", "http://a/b", "http://", "://x"] {
            assert!(
                matches!(
                    Access::new(loopback(), true, &[], &s(&[bad])),
                    Err(AccessError::BadOrigin(_))
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            Access::new(loopback(), true, &s(&["a b"]), &[]),
            Err(AccessError::BadHost(_))
        ));
    }

    #[test]
    fn only_json_bodies_are_posted() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/merge-patch+json",
        ] {
            assert!(is_json(ok), "{ok}");
        }
        for bad in [
            "text/plain",
            "text/plain;charset=UTF-8",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/+json",
            "application/jsonx",
            "",
        ] {
            assert!(!is_json(bad), "{bad}");
        }
    }

    #[test]
    fn the_checks_run_host_then_origin_then_content_type() {
        let a = Access::default();
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("evil.example:8088"));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        let why = |h: &HeaderMap, m: Method| check(&a, &m, h).err().map(|e| (e.0, e.1));
        assert_eq!(
            why(&h, Method::POST),
            Some((Refused::Host, StatusCode::MISDIRECTED_REQUEST))
        );
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8088"));
        assert_eq!(
            why(&h, Method::POST),
            Some((Refused::Origin, StatusCode::FORBIDDEN))
        );
        assert_eq!(
            why(&h, Method::GET),
            Some((Refused::Origin, StatusCode::FORBIDDEN)),
            "a WebSocket opening is a GET with an Origin"
        );
        h.remove(header::ORIGIN);
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("12"));
        assert_eq!(
            why(&h, Method::POST),
            Some((Refused::ContentType, StatusCode::UNSUPPORTED_MEDIA_TYPE))
        );
        assert_eq!(why(&h, Method::GET), None);
        h.remove(header::CONTENT_TYPE);
        assert_eq!(
            why(&h, Method::POST),
            Some((Refused::ContentType, StatusCode::UNSUPPORTED_MEDIA_TYPE)),
            "a body without a type is a simple request too"
        );
        h.remove(header::CONTENT_LENGTH);
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        assert_eq!(
            why(&h, Method::POST),
            Some((Refused::ContentType, StatusCode::UNSUPPORTED_MEDIA_TYPE)),
            "a chunked body is a body"
        );
        h.remove(header::TRANSFER_ENCODING);
        assert_eq!(why(&h, Method::POST), None, "no body: nothing to refuse");
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        assert_eq!(why(&h, Method::POST), None, "an empty body");
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        assert_eq!(why(&h, Method::POST), None);
    }
}
