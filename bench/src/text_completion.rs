//! The text-completion scenario: a text-completion processor over the broker against a
//! direct provider call, per streaming concurrency.

use std::{
    fmt::Write as _, sync::Arc, sync::atomic::AtomicU64, sync::atomic::Ordering, time::Duration,
    time::Instant,
};

use futures::StreamExt;
use sluice_runtime::client::Received;
use sluice_schema::TextCompletionRequest;
use sluice_tests::{Broker, RunningProcessor, echo_config, text_client, unique_topic};

use crate::{foundation::RawPair, procs::*, report::*};

pub(crate) fn stream_req() -> TextCompletionRequest {
    TextCompletionRequest {
        prompt: "bench".into(),
        streaming: true,
        ..Default::default()
    }
}

pub(crate) async fn text_completion_bench(
    broker: &Broker,
    requests: u64,
    levels: &[u64],
) -> String {
    use sluice_text_completion::provider::Provider;
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: Pulsar standalone on loopback, fake OpenAI server over HTTP.\n",
        provenance()
    );

    // (1) Time to first token: the provider called directly vs through client, broker and
    // processor (a separate `sluice text-completion` process), interleaved.
    let model = "tokens-5-2";
    let direct = sluice_text_completion::providers::openai::OpenAiProvider::new(
        sluice_text_completion::providers::openai::OpenAiConfig::new(
            sluice_text_completion::providers::openai::Dialect::Compatible,
            fake.base_url(),
            model,
        ),
    )
    .unwrap();
    // SLUICE_BENCH_IN_PROCESS=1 runs the processor inside this process instead (a diagnostic:
    // it separates the processor's own cost from the cost of a second process).
    let in_process = std::env::var("SLUICE_BENCH_IN_PROCESS").is_ok();
    let mut local = None;
    let (mut child, client) = if in_process {
        let (req, resp) = (unique_topic("tcb-req"), unique_topic("tcb-resp"));
        let provider = Arc::new(
            sluice_text_completion::providers::openai::OpenAiProvider::new(
                sluice_text_completion::providers::openai::OpenAiConfig::new(
                    sluice_text_completion::providers::openai::Dialect::Compatible,
                    fake.base_url(),
                    model,
                ),
            )
            .unwrap(),
        );
        let telemetry = sluice_runtime::telemetry::Telemetry::new().unwrap();
        let service = sluice_text_completion::handler::TextCompletionService::new(
            provider,
            Default::default(),
            sluice_text_completion::metrics::LlmMetrics::register(&telemetry.registry).unwrap(),
        );
        local = Some(
            RunningProcessor::start(broker.bus().await, echo_config(&req, &resp, 64), service)
                .await,
        );
        let child = tokio::process::Command::new("true").spawn().unwrap();
        (child, text_client(broker.bus().await, &req, &resp).await)
    } else {
        spawn_text_completion(broker, &fake, model, 64, Durability::Persistent).await
    };
    // The same path on non-persistent topics: what the broker's storage adds to each hop.
    let (mut np_child, np_client) =
        spawn_text_completion(broker, &fake, model, 64, Durability::NonPersistent).await;
    // Two raw pulsar-rs hops (no sluice code), each after the broker sat idle as it does in
    // the sluice path while the provider thinks: the floor under the sluice figure.
    let mut floor_pair = RawPair::start(&broker.url, true).await;
    let (mut h_direct, mut h_sluice, mut h_np, mut h_floor) = (hist(), hist(), hist(), hist());
    for i in 0..requests + 50 {
        let t0 = Instant::now();
        let mut s = direct.generate_stream(&stream_req()).await.unwrap();
        let _ = s.next().await;
        let d = t0.elapsed();
        while s.next().await.is_some() {}
        let t0 = Instant::now();
        let mut st = client.request(&stream_req()).await.unwrap();
        let _ = st.next().await;
        let v = t0.elapsed();
        while st.next().await.is_some() {}
        let t0 = Instant::now();
        let mut st = np_client.request(&stream_req()).await.unwrap();
        let _ = st.next().await;
        let np = t0.elapsed();
        while st.next().await.is_some() {}
        // The provider's first token comes ~3 ms after the request reaches the processor.
        tokio::time::sleep(Duration::from_millis(3)).await;
        let mut floor = hist();
        floor_pair.batch(1, &mut floor).await;
        if i >= 50 {
            h_direct.record(d.as_micros() as u64).unwrap();
            h_sluice.record(v.as_micros() as u64).unwrap();
            h_np.record(np.as_micros() as u64).unwrap();
            h_floor.add(&floor).unwrap();
        }
    }
    client.close().await;
    np_client.close().await;
    floor_pair.stop().await;
    let _ = child.kill().await;
    let _ = np_child.kill().await;
    if let Some(p) = local {
        p.stop().await;
    }
    let _ = writeln!(
        md,
        "| time to first token | p50 ms | p99 ms |\n|---|---|---|"
    );
    quantile_row(&mut md, "fake provider called directly", &h_direct);
    quantile_row(
        &mut md,
        "client → broker → `sluice text-completion` → provider → broker → client",
        &h_sluice,
    );
    let _ = writeln!(
        md,
        "| overhead sluice adds (difference) | {:.2} | {:.2} |",
        ms(&h_sluice, 0.5) - ms(&h_direct, 0.5),
        ms(&h_sluice, 0.99) - ms(&h_direct, 0.99)
    );
    quantile_row(
        &mut md,
        "of which two broker hops: raw pulsar-rs round trip after 3 ms idle, no sluice code",
        &h_floor,
    );
    quantile_row(&mut md, "same sluice path on non-persistent topics", &h_np);
    let _ = writeln!(
        md,
        "| overhead on non-persistent topics (difference) | {:.2} | {:.2} |\n",
        ms(&h_np, 0.5) - ms(&h_direct, 0.5),
        ms(&h_np, 0.99) - ms(&h_direct, 0.99)
    );

    // (2) Concurrent slow streams held by one processor process.
    let _ = writeln!(
        md,
        "| concurrent slow streams (one `sluice text-completion` process) | completed | wall s | processor peak RSS MiB |\n|---|---|---|---|"
    );
    for &n in levels {
        // Each stream: 5 tokens, 2 s apart (10 s), so the broker carries n/2 records/s.
        let model = "tokens-5-2000";
        let (mut child, client) =
            spawn_text_completion(broker, &fake, model, n, Durability::Persistent).await;
        let client = Arc::new(client);
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move {
                    let mut s = client.request(&stream_req()).await.ok()?;
                    let mut last = None;
                    while let Some(item) = s.next().await {
                        match item {
                            Ok(Received::Record(r)) => last = Some(r),
                            Ok(_) => {}
                            Err(_) => return None,
                        }
                    }
                    last.filter(|r| r.end_of_stream && r.error.is_none())
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            if let Ok(Some(_)) = t.await {
                ok += 1;
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let (peak, _) = rss_mib(child.id().unwrap_or(0));
        client.close().await;
        let _ = child.kill().await;
        let _ = writeln!(md, "| {n} | {ok} | {secs:.1} | {peak:.0} |");
    }

    // (3) Tokens forwarded per second: 100-token streams, no delay, 32 at a time.
    let (mut child, client) =
        spawn_text_completion(broker, &fake, "tokens-100-0", 64, Durability::Persistent).await;
    let client = Arc::new(client);
    let tokens = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (client, tokens) = (client.clone(), tokens.clone());
            tokio::spawn(async move {
                for _ in 0..20 {
                    let mut s = client.request(&stream_req()).await.unwrap();
                    while let Some(item) = s.next().await {
                        if let Ok(Received::Record(r)) = item
                            && !r.response.is_empty()
                        {
                            tokens.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let rate = tokens.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64();
    client.close().await;
    let _ = child.kill().await;
    let _ = writeln!(
        md,
        "\n| tokens forwarded (32 concurrent 100-token streams) | {rate:.0} tokens/s |\n|---|---|"
    );
    md
}

/// The fallback scenario: what the fallback layer (`--fallback`, issue #25) costs in time to
/// first token: the
/// provider called directly against the same provider first in a fallback list, and what a
/// move to the backup adds when the first provider refuses the connection, answers 503, or
/// is skipped by its open breaker. In process, interleaved, so the machine's noise falls on
/// every row alike.
pub(crate) async fn fallback_bench(requests: u64) -> String {
    use sluice_text_completion::{
        fallback::{Fallback, FallbackSettings},
        metrics::LlmMetrics,
        provider::Provider,
        providers::openai::{Dialect, OpenAiConfig, OpenAiProvider},
    };
    let openai = |url: String, model: &str| -> Arc<dyn Provider> {
        Arc::new(OpenAiProvider::new(OpenAiConfig::new(Dialect::Compatible, url, model)).unwrap())
    };
    let fake = sluice_tests::fake_openai::FakeOpenAi::start().await;
    let healthy = || openai(fake.base_url(), "tokens-5-2");
    // A port nothing listens on: bound, then closed.
    let refused_url = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/v1", l.local_addr().unwrap())
    };
    let fallback = |primary: Arc<dyn Provider>, settings: FallbackSettings| {
        let telemetry = sluice_runtime::telemetry::Telemetry::new().unwrap();
        Fallback::new(
            primary,
            vec![healthy()],
            settings,
            LlmMetrics::register(&telemetry.registry).unwrap(),
        )
    };
    let no_breaker = FallbackSettings {
        breaker_failures: 0,
        ..FallbackSettings::default()
    };
    let rows: Vec<(&str, Arc<dyn Provider>)> = vec![
        ("provider called directly (baseline)", healthy()),
        (
            "first in a fallback list, answering",
            Arc::new(fallback(healthy(), FallbackSettings::default())),
        ),
        (
            "first in a fallback list, answering; deadline 1 s and hedge after 0.5 s armed",
            Arc::new(fallback(
                healthy(),
                FallbackSettings {
                    first_token_deadline: Some(Duration::from_secs(1)),
                    hedge_after: Some(Duration::from_millis(500)),
                    ..FallbackSettings::default()
                },
            )),
        ),
        (
            "moved to the backup: the first refuses the connection",
            Arc::new(fallback(
                openai(refused_url, "tokens-5-2"),
                no_breaker.clone(),
            )),
        ),
        (
            "moved to the backup: the first answers 503",
            Arc::new(fallback(
                openai(fake.base_url(), "status-503-1000000000"),
                no_breaker,
            )),
        ),
        (
            "moved to the backup: the first skipped by its open breaker",
            Arc::new(fallback(
                openai(fake.base_url(), "status-503-1000000000"),
                FallbackSettings {
                    breaker_failures: 1,
                    breaker_cooldown: Duration::from_secs(3600),
                    ..FallbackSettings::default()
                },
            )),
        ),
    ];
    let mut hists: Vec<_> = rows.iter().map(|_| hist()).collect();
    for i in 0..requests + 50 {
        for (row, h) in rows.iter().zip(hists.iter_mut()) {
            let t0 = Instant::now();
            let mut s = row.1.generate_stream(&stream_req()).await.unwrap();
            let first = s.next().await;
            let ttft = t0.elapsed();
            assert!(matches!(first, Some(Ok(_))), "{}: no first chunk", row.0);
            while s.next().await.is_some() {}
            if i >= 50 {
                h.record(ttft.as_micros() as u64).unwrap();
            }
        }
    }
    let base = ms(&hists[0], 0.5);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{}: {requests} calls per row, in process, the rows interleaved; fake OpenAI server over HTTP (5 tokens, 2 ms apart), a fallback list of it and the same server as backup.\n",
        provenance()
    );
    let _ = writeln!(
        md,
        "| time to first token | p50 ms | p99 ms | p50 vs direct |\n|---|---|---|---|"
    );
    for (row, h) in rows.iter().zip(&hists) {
        let _ = writeln!(
            md,
            "| {} | {:.2} | {:.2} | {:.2}x |",
            row.0,
            ms(h, 0.5),
            ms(h, 0.99),
            ms(h, 0.5) / base
        );
    }
    md
}
