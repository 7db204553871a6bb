//! The fake OpenAI-compatible server scripted by the prompt ([`sluice_tests::fake_openai::prompted`]),
//! as a process: TrustGraph's own processes (`tests/py/tg/up.sh`), the compose stack
//! (`scripts/test-stack.sh`) and the Kubernetes run (`scripts/test-k8s-run.sh`) call it.
//!
//! ```text
//! fake-openai --port 8767
//! FAKE_UPSTREAM_API_KEY=... fake-openai --host 172.17.0.1 --port 8769 --upstream http://127.0.0.1:8766
//! ```
//!
//! Prints `fake-openai listening on <host>:<port>` on stdout once it accepts connections.
//! The upstream's key comes only from the environment (`FAKE_UPSTREAM_API_KEY`), never argv.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{io::Write, net::IpAddr};

use clap::Parser;
use sluice_tests::fake_openai::prompted::{Upstream, serve};

/// A fake OpenAI-compatible server scripted by the prompt.
#[derive(Parser)]
struct Args {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// The port to listen on (0: any free one, printed).
    #[arg(long, default_value_t = 8767)]
    port: u16,
    /// The OpenAI-compatible server that answers prompts that are not scripted.
    #[arg(long)]
    upstream: Option<String>,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // tokio's listen queue is 1024: hundreds of replicas' requests may arrive at once (a
    // backlog), and a short queue would drop connections and make the processors retry.
    let listener = tokio::net::TcpListener::bind((args.host, args.port))
        .await
        .unwrap_or_else(|e| panic!("cannot listen on {}:{}: {e}", args.host, args.port));
    let port = listener.local_addr().unwrap().port();
    let upstream = args.upstream.map(|url| Upstream {
        url,
        api_key: std::env::var("FAKE_UPSTREAM_API_KEY")
            .ok()
            .filter(|k| !k.is_empty()),
    });
    println!("fake-openai listening on {}:{port}", args.host);
    std::io::stdout().flush().unwrap();
    serve(listener, upstream).await;
}
