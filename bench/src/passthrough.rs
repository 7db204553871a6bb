//! The least an HTTP gateway can do, as a floor for the overhead scenario: a process that
//! takes a request, sends it on to the provider through one pooled reqwest client, and
//! streams the provider's answer back byte for byte. No parsing, no bus, no records: what is
//! left of a gateway's added time at one caller when everything else is gone (two loopback
//! HTTP hops, hyper on both sides, one process's scheduling).

use axum::{
    body::{Body, Bytes},
    extract::State,
    http::{HeaderMap, Method, Response, StatusCode, Uri},
};

#[derive(Clone)]
struct Upstream {
    base: String,
    http: reqwest::Client,
}

async fn forward(
    State(up): State<Upstream>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut request = up.http.request(method, format!("{}{path}", up.base));
    if let Some(ct) = headers.get("content-type") {
        request = request.header("content-type", ct);
    }
    match request.body(body).send().await {
        Ok(resp) => {
            let mut out = Response::builder().status(resp.status());
            if let Some(ct) = resp.headers().get("content-type") {
                out = out.header("content-type", ct);
            }
            out.body(Body::from_stream(resp.bytes_stream())).unwrap()
        }
        Err(e) => Response::builder()
            .status(StatusCode::BAD_GATEWAY)
            .body(Body::from(e.to_string()))
            .unwrap(),
    }
}

/// Serves on a free loopback port, prints `pass-through listening on ADDR`, and forwards
/// every request to `upstream` until killed.
pub(crate) async fn serve(upstream: String) {
    sluice_runtime::install_crypto_provider();
    let up = Upstream {
        base: upstream.trim_end_matches('/').to_owned(),
        http: reqwest::Client::builder().build().unwrap(),
    };
    let app = axum::Router::new().fallback(forward).with_state(up);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!(
        "pass-through listening on {}",
        listener.local_addr().unwrap()
    );
    axum::serve(listener, app).await.unwrap();
}
