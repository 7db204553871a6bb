use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus::Registry;

use super::*;

/// What a scripted provider does on a call.
#[derive(Clone)]
enum Act {
    /// Streams these pieces (after `after` when set).
    Answer(&'static [&'static str], Option<Duration>),
    /// Fails before the stream opens.
    Fail(FailureKind, Option<u16>),
    /// Refuses the request as one it cannot put in its terms (nothing sent).
    Unsendable,
    /// Opens the stream and never says anything.
    Stall,
    /// One piece, then a failure inside the stream.
    BreakAfterFirst,
}

/// A provider that does what its script says, counts its calls and the streams of its
/// that were dropped before their end.
struct Scripted {
    name: &'static str,
    model: &'static str,
    script: Mutex<Vec<Act>>,
    calls: AtomicUsize,
    dropped: Arc<AtomicUsize>,
}

impl Scripted {
    /// Does `acts` in turn, the last one for ever.
    fn new(name: &'static str, model: &'static str, acts: &[Act]) -> Arc<Self> {
        Arc::new(Self {
            name,
            model,
            script: Mutex::new(acts.iter().rev().cloned().collect()),
            calls: AtomicUsize::new(0),
            dropped: Arc::default(),
        })
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn act(&self) -> Act {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut script = lock(&self.script);
        if script.len() > 1 {
            script.pop().unwrap()
        } else {
            script[0].clone()
        }
    }
}

/// Counts a stream dropped before its end.
struct DropGuard(Arc<AtomicUsize>, bool);

impl DropGuard {
    /// The stream ended (or never was): its drop is not counted.
    fn done(&mut self) {
        self.1 = true;
    }
}

impl Drop for DropGuard {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn text(t: &str) -> Result<Chunk, ProviderError> {
    Ok(Chunk {
        text: t.to_owned(),
        ..Chunk::default()
    })
}

#[async_trait]
impl Provider for Scripted {
    fn name(&self) -> &'static str {
        self.name
    }
    fn model(&self) -> &str {
        self.model
    }
    fn endpoint(&self) -> &str {
        "http://provider.test/"
    }
    fn supports_streaming(&self) -> bool {
        true
    }
    async fn generate_stream(
        &self,
        _request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError> {
        let mut guard = DropGuard(self.dropped.clone(), false);
        match self.act() {
            Act::Fail(kind, status) => {
                guard.done();
                Err(ProviderError::new(kind, format!("{} failed", self.name)).with_status(status))
            }
            Act::Unsendable => {
                guard.done();
                Err(ProviderError::unsendable(format!(
                    "{} cannot be made to call one named tool",
                    self.name
                )))
            }
            Act::Stall => Ok(futures::stream::pending()
                .chain(futures::stream::iter(std::iter::from_fn(move || {
                    let _ = &guard;
                    None
                })))
                .boxed()),
            Act::BreakAfterFirst => {
                guard.done();
                Ok(futures::stream::iter([
                    text("first"),
                    Err(ProviderError::new(FailureKind::Stream, "broke")),
                ])
                .boxed())
            }
            Act::Answer(pieces, after) => Ok(futures::stream::once(async move {
                if let Some(d) = after {
                    tokio::time::sleep(d).await;
                }
            })
            .flat_map(move |()| futures::stream::iter(pieces.iter().map(|p| text(p))))
            .chain(futures::stream::iter(std::iter::from_fn(move || {
                guard.done();
                None
            })))
            .boxed()),
        }
    }
}

fn settings() -> FallbackSettings {
    FallbackSettings {
        first_token_deadline: None,
        hedge_after: None,
        breaker_failures: 2,
        breaker_cooldown: Duration::from_secs(10),
    }
}

fn list(
    primary: &Arc<Scripted>,
    backups: &[&Arc<Scripted>],
    settings: FallbackSettings,
) -> (Fallback, Registry) {
    let registry = Registry::new();
    let metrics = LlmMetrics::register(&registry).unwrap();
    let backups = backups
        .iter()
        .map(|b| (*b).clone() as Arc<dyn Provider>)
        .collect();
    (
        Fallback::new(primary.clone(), backups, settings, metrics),
        registry,
    )
}

/// The value of `name{labels...}` in `registry`, 0 when absent.
fn value(registry: &Registry, name: &str, labels: &[(&str, &str)]) -> f64 {
    for family in registry.gather() {
        if family.name() != name {
            continue;
        }
        let gauge = family.get_field_type() == prometheus::proto::MetricType::GAUGE;
        for m in family.get_metric() {
            let matches = labels.iter().all(|(k, v)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == *k && l.value() == *v)
            });
            if matches {
                return if gauge {
                    m.get_gauge().get_value()
                } else {
                    m.get_counter().get_value()
                };
            }
        }
    }
    0.0
}

/// The whole text of a call, and who answered.
async fn answer(f: &Fallback) -> Result<(String, Option<AnsweredBy>), ProviderError> {
    let mut s = f.generate_stream(&TextCompletionRequest::default()).await?;
    let (mut text, mut by) = (String::new(), None);
    while let Some(c) = s.next().await {
        let c = c?;
        text.push_str(&c.text);
        if c.answered_by.is_some() {
            by = c.answered_by;
        }
    }
    Ok((text, by))
}

const AB: &[&str] = &["a", "b"];

/// A 5xx, a refused connection, a 429 and an auth refusal at the first provider each
/// move the call to the next, which answers and is named; each move is counted with its
/// reason.
#[tokio::test(start_paused = true)]
async fn a_failure_before_the_first_token_moves_the_call_to_the_next_provider() {
    for (kind, status) in [
        (FailureKind::Server, Some(503)),
        (FailureKind::Connect, None),
        (FailureKind::RateLimited, Some(429)),
        (FailureKind::Auth, Some(401)),
    ] {
        let primary = Scripted::new("openai", "gpt", &[Act::Fail(kind, status)]);
        let backup = Scripted::new("anthropic", "claude", &[Act::Answer(AB, None)]);
        let (f, registry) = list(&primary, &[&backup], settings());
        let (text, by) = answer(&f).await.unwrap();
        assert_eq!(text, "ab", "{kind:?}");
        assert_eq!(
            by,
            Some(AnsweredBy {
                provider: "anthropic",
                model: "claude".into()
            })
        );
        assert_eq!(
            value(
                &registry,
                "sluice_llm_fallbacks_total",
                &[("position", "0"), ("reason", kind.as_str())]
            ),
            1.0,
            "{kind:?}"
        );
        assert_eq!(
            value(&registry, "sluice_llm_answered_total", &[("position", "1")]),
            1.0
        );
    }
}

/// The request's own fault (400) is not moved: the next provider would refuse it too.
#[tokio::test(start_paused = true)]
async fn a_refused_request_is_not_moved() {
    let primary = Scripted::new(
        "openai",
        "gpt",
        &[Act::Fail(FailureKind::BadRequest, Some(400))],
    );
    let backup = Scripted::new("anthropic", "claude", &[Act::Answer(AB, None)]);
    let (f, _) = list(&primary, &[&backup], settings());
    let e = answer(&f).await.unwrap_err();
    assert_eq!(e.kind, FailureKind::BadRequest);
    assert_eq!(backup.calls(), 0);
}

/// A request one provider cannot be sent in its terms goes to the next, which may take it;
/// the refusal neither opens the first one's breaker nor costs a probe. If no provider
/// takes it, the call ends with the last one's refusal, the caller's to fix.
#[tokio::test(start_paused = true)]
async fn a_request_a_provider_cannot_be_sent_moves_to_the_next() {
    let primary = Scripted::new("cohere", "command", &[Act::Unsendable]);
    let backup = Scripted::new("openai", "gpt", &[Act::Answer(AB, None)]);
    // Breakers open after 2 failures in a row: 3 refusals must not open the primary's.
    let (f, registry) = list(&primary, &[&backup], settings());
    for _ in 0..3 {
        let (text, by) = answer(&f).await.unwrap();
        assert_eq!(text, "ab");
        assert_eq!(by.unwrap().provider, "openai");
    }
    assert_eq!(primary.calls(), 3, "the primary's breaker stays closed");
    assert_eq!(
        value(
            &registry,
            "sluice_llm_fallbacks_total",
            &[("position", "0"), ("reason", "unsendable")]
        ),
        3.0
    );

    // No member can be sent it: every refusal is in the call's error.
    let backup = Scripted::new("ollama", "llama", &[Act::Unsendable]);
    let (f, _) = list(&primary, &[&backup], settings());
    let e = answer(&f).await.unwrap_err();
    assert!(e.unsendable);
    assert_eq!(e.kind, FailureKind::BadRequest);
    assert!(
        e.message.contains("cohere cannot") && e.message.contains("ollama cannot"),
        "{}",
        e.message
    );

    // A member down and the other unable to take it: the outage is the call's error (a
    // retry may find the first member back), not the refusal.
    let down = Scripted::new(
        "openai",
        "gpt",
        &[Act::Fail(FailureKind::Server, Some(503))],
    );
    let (f, _) = list(&down, &[&backup], settings());
    let e = answer(&f).await.unwrap_err();
    assert_eq!(e.kind, FailureKind::Server);
    assert!(!e.unsendable);
}

/// A hedge partner that cannot be sent the request is not a hedge that failed: the next
/// member is started beside the slow one instead, and answers.
#[tokio::test(start_paused = true)]
async fn a_hedge_partner_that_cannot_be_sent_the_request_hands_the_hedge_on() {
    let slow = Scripted::new(
        "openai",
        "gpt",
        &[Act::Answer(AB, Some(Duration::from_secs(5)))],
    );
    let unable = Scripted::new("cohere", "command", &[Act::Unsendable]);
    let third = Scripted::new("anthropic", "claude", &[Act::Answer(AB, None)]);
    let mut s = settings();
    s.hedge_after = Some(Duration::from_millis(500));
    let (f, registry) = list(&slow, &[&unable, &third], s);
    let started = Instant::now();
    let (text, by) = answer(&f).await.unwrap();
    assert_eq!(text, "ab");
    assert_eq!(by.unwrap().provider, "anthropic");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        value(
            &registry,
            "sluice_llm_hedges_total",
            &[("position", "1"), ("outcome", "failed")]
        ),
        0.0
    );
    assert_eq!(
        value(
            &registry,
            "sluice_llm_hedges_total",
            &[("position", "2"), ("outcome", "won")]
        ),
        1.0
    );
}

/// A first provider that stalls is left at the deadline for the next; the stalled call
/// is dropped (its HTTP request cancelled).
#[tokio::test(start_paused = true)]
async fn no_first_token_within_the_deadline_moves_the_call() {
    let primary = Scripted::new("openai", "gpt", &[Act::Stall]);
    let backup = Scripted::new("anthropic", "claude", &[Act::Answer(AB, None)]);
    let mut s = settings();
    s.first_token_deadline = Some(Duration::from_millis(500));
    let (f, registry) = list(&primary, &[&backup], s);
    let started = Instant::now();
    let (text, by) = answer(&f).await.unwrap();
    assert_eq!(text, "ab");
    assert_eq!(by.unwrap().provider, "anthropic");
    assert_eq!(started.elapsed(), Duration::from_millis(500));
    assert_eq!(primary.dropped.load(Ordering::SeqCst), 1);
    assert_eq!(
        value(
            &registry,
            "sluice_llm_fallbacks_total",
            &[("position", "0"), ("reason", "first_token_deadline")]
        ),
        1.0
    );
}

/// Once text has come back the call stays: a failure after it ends the stream, and the
/// next provider is never called.
#[tokio::test(start_paused = true)]
async fn a_failure_after_the_first_token_is_not_moved() {
    let primary = Scripted::new("openai", "gpt", &[Act::BreakAfterFirst]);
    let backup = Scripted::new("anthropic", "claude", &[Act::Answer(AB, None)]);
    let (f, _) = list(&primary, &[&backup], settings());
    let mut s = f
        .generate_stream(&TextCompletionRequest::default())
        .await
        .unwrap();
    let first = s.next().await.unwrap().unwrap();
    assert_eq!(first.text, "first");
    assert_eq!(first.answered_by.unwrap().provider, "openai");
    assert_eq!(
        s.next().await.unwrap().unwrap_err().kind,
        FailureKind::Stream
    );
    assert_eq!(backup.calls(), 0);
}

/// Two failures in a row open the first provider's breaker: calls skip it (counted as
/// `breaker_open`) for the cool-down; then one call probes it. A failed probe opens it
/// again, a good one closes it. Transitions and the state are exported.
#[tokio::test(start_paused = true)]
async fn a_breaker_opens_after_failures_in_a_row_skips_then_probes_and_closes() {
    let fail = Act::Fail(FailureKind::Server, Some(500));
    let primary = Scripted::new(
        "openai",
        "gpt",
        &[fail.clone(), fail.clone(), fail, Act::Answer(AB, None)],
    );
    let backup = Scripted::new("anthropic", "claude", &[Act::Answer(AB, None)]);
    let (f, registry) = list(&primary, &[&backup], settings());
    let state = || value(&registry, "sluice_llm_breaker_state", &[("position", "0")]);
    answer(&f).await.unwrap();
    assert_eq!(f.breaker(0), Some(BreakerState::Closed));
    answer(&f).await.unwrap();
    assert_eq!(f.breaker(0), Some(BreakerState::Open));
    assert_eq!(state(), 1.0);
    // Skipped while open.
    answer(&f).await.unwrap();
    assert_eq!(primary.calls(), 2);
    let skipped = [("position", "0"), ("reason", "breaker_open")];
    assert_eq!(
        value(&registry, "sluice_llm_fallbacks_total", &skipped),
        1.0
    );
    // Cooled down: a probe, which fails: open again, for another cool-down.
    tokio::time::advance(Duration::from_secs(10)).await;
    answer(&f).await.unwrap();
    assert_eq!(primary.calls(), 3);
    assert_eq!(f.breaker(0), Some(BreakerState::Open));
    answer(&f).await.unwrap();
    assert_eq!(primary.calls(), 3);
    // The next probe answers: closed, and the first provider answers again.
    tokio::time::advance(Duration::from_secs(10)).await;
    let (_, by) = answer(&f).await.unwrap();
    assert_eq!(by.unwrap().provider, "openai");
    assert_eq!(f.breaker(0), Some(BreakerState::Closed));
    assert_eq!(state(), 0.0);
    let transitions = |to| {
        value(
            &registry,
            "sluice_llm_breaker_transitions_total",
            &[("position", "0"), ("state", to)],
        )
    };
    assert_eq!(
        [
            transitions("open"),
            transitions("half-open"),
            transitions("closed")
        ],
        [2.0, 2.0, 1.0]
    );
}

/// A backup's breaker is asked only when a call reaches the backup: calls the first
/// provider answers leave an open backup breaker open (they do not spend its probe).
#[tokio::test(start_paused = true)]
async fn breakers_are_asked_only_when_a_call_reaches_them() {
    let fail = Act::Fail(FailureKind::Server, Some(500));
    let primary = Scripted::new(
        "openai",
        "gpt",
        &[fail.clone(), fail, Act::Answer(AB, None)],
    );
    let backup = Scripted::new(
        "anthropic",
        "claude",
        &[Act::Fail(FailureKind::Server, Some(500))],
    );
    let (f, _) = list(&primary, &[&backup], settings());
    assert!(answer(&f).await.is_err());
    assert!(answer(&f).await.is_err());
    assert_eq!(f.breaker(1), Some(BreakerState::Open));
    tokio::time::advance(Duration::from_secs(30)).await;
    // The first provider's breaker probes and closes; the backup's is not reached.
    answer(&f).await.unwrap();
    answer(&f).await.unwrap();
    assert_eq!(f.breaker(0), Some(BreakerState::Closed));
    assert_eq!(f.breaker(1), Some(BreakerState::Open));
    assert_eq!(backup.calls(), 2);
}

/// With every breaker open a call fails at once, with the soonest probe as its retry hint.
#[tokio::test(start_paused = true)]
async fn with_every_breaker_open_a_call_fails_at_once_with_the_next_probe_as_hint() {
    let fail = Act::Fail(FailureKind::Server, Some(500));
    let primary = Scripted::new("openai", "gpt", std::slice::from_ref(&fail));
    let backup = Scripted::new("anthropic", "claude", &[fail]);
    let (f, _) = list(&primary, &[&backup], settings());
    assert!(answer(&f).await.is_err());
    assert!(answer(&f).await.is_err());
    tokio::time::advance(Duration::from_secs(4)).await;
    let e = answer(&f).await.unwrap_err();
    assert_eq!(e.kind, FailureKind::Server);
    assert!(
        e.message.contains("circuit breakers are open"),
        "{}",
        e.message
    );
    assert_eq!(e.retry_after, Some(Duration::from_secs(6)));
    assert_eq!((primary.calls(), backup.calls()), (2, 2));
}

/// A probe whose caller goes away gives no verdict: the breaker is due for another probe
/// at once, not stuck half-open.
#[tokio::test(start_paused = true)]
async fn a_probe_dropped_by_its_caller_leaves_the_breaker_due_for_a_probe() {
    let fail = Act::Fail(FailureKind::Server, Some(500));
    let primary = Scripted::new(
        "openai",
        "gpt",
        &[fail.clone(), fail, Act::Stall, Act::Answer(AB, None)],
    );
    let backup = Scripted::new("anthropic", "claude", &[Act::Answer(AB, None)]);
    let (f, _) = list(&primary, &[&backup], settings());
    answer(&f).await.unwrap();
    answer(&f).await.unwrap();
    tokio::time::advance(Duration::from_secs(10)).await;
    // The probe stalls and its caller gives up.
    let probe = tokio::time::timeout(Duration::from_secs(1), answer(&f)).await;
    assert!(probe.is_err());
    assert_eq!(f.breaker(0), Some(BreakerState::Open));
    let (_, by) = answer(&f).await.unwrap();
    assert_eq!(by.unwrap().provider, "openai");
    assert_eq!(f.breaker(0), Some(BreakerState::Closed));
}

/// Hedging: when the first provider has given no text after the delay, the next starts
/// beside it; the first to give text answers and the other call is dropped.
#[tokio::test(start_paused = true)]
async fn a_hedge_starts_the_next_provider_and_the_first_to_answer_wins() {
    let slow = Act::Answer(AB, Some(Duration::from_secs(2)));
    let primary = Scripted::new("openai", "gpt", &[slow]);
    let backup = Scripted::new(
        "anthropic",
        "claude",
        &[Act::Answer(&["c"], Some(Duration::from_millis(100)))],
    );
    let mut s = settings();
    s.hedge_after = Some(Duration::from_millis(300));
    let (f, registry) = list(&primary, &[&backup], s);
    let started = Instant::now();
    let (text, by) = answer(&f).await.unwrap();
    assert_eq!(text, "c");
    assert_eq!(by.unwrap().provider, "anthropic");
    assert_eq!(started.elapsed(), Duration::from_millis(400));
    assert_eq!(
        primary.dropped.load(Ordering::SeqCst),
        1,
        "the slow call was not dropped"
    );
    assert_eq!(
        value(
            &registry,
            "sluice_llm_hedges_total",
            &[("position", "1"), ("outcome", "won")]
        ),
        1.0
    );
    // A first provider that answers before the hedge's own first text keeps the call.
    let primary = Scripted::new(
        "openai",
        "gpt",
        &[Act::Answer(AB, Some(Duration::from_millis(500)))],
    );
    let backup = Scripted::new(
        "anthropic",
        "claude",
        &[Act::Answer(&["c"], Some(Duration::from_secs(5)))],
    );
    let mut s = settings();
    s.hedge_after = Some(Duration::from_millis(300));
    let (f, registry) = list(&primary, &[&backup], s);
    let (text, _) = answer(&f).await.unwrap();
    assert_eq!(text, "ab");
    assert_eq!(backup.dropped.load(Ordering::SeqCst), 1);
    assert_eq!(
        value(
            &registry,
            "sluice_llm_hedges_total",
            &[("position", "1"), ("outcome", "lost")]
        ),
        1.0
    );
}

/// A whole answer (not streamed) moves as a stream does, without deadline or hedge.
#[tokio::test(start_paused = true)]
async fn a_whole_answer_moves_too_and_names_who_answered() {
    let primary = Scripted::new("openai", "gpt", &[Act::Fail(FailureKind::Timeout, None)]);
    let backup = Scripted::new(
        "anthropic",
        "claude",
        &[Act::Answer(AB, Some(Duration::from_secs(3)))],
    );
    let mut s = settings();
    s.first_token_deadline = Some(Duration::from_millis(100));
    s.hedge_after = Some(Duration::from_millis(100));
    let (f, _) = list(&primary, &[&backup], s);
    let done = f.generate(&TextCompletionRequest::default()).await.unwrap();
    assert_eq!(done.text, "ab");
    assert_eq!(done.answered_by.unwrap().model, "claude");
}
