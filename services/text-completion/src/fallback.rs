//! Fallback before the first token: an ordered list of providers behind one
//! [`Provider`], with an optional first-token deadline, optional hedging and a circuit
//! breaker per provider.
//!
//! - A call goes to the first provider whose breaker lets it through. A failure before the
//!   first text chunk (a refused connection, a timeout, 429, 5xx, a stream that breaks or
//!   ends badly before any text, an auth or quota refusal, no first text within the
//!   deadline) moves it to the next. A refusal of the request itself (400, 413, 422) does
//!   not: the next provider would refuse it too, and the caller must fix it. A request a
//!   provider cannot be sent in its own terms (nothing sent: Cohere cannot be made to call
//!   one named tool, say) does move: another provider may take it, and that refusal says
//!   nothing of the provider's health. If none takes it, the last one's refusal is the call's.
//! - Once a text chunk has come back the call stays where it is: the stream returned is that
//!   provider's, and a later failure ends it (the handler's rule: nothing is moved or
//!   retried after a record was published).
//! - Hedging (streamed calls only): when the provider being tried has given no text after
//!   `hedge_after`, the next one is started too; the first to give text answers and the
//!   other call is dropped (its HTTP request cancelled). At most two run at once.
//! - A breaker per provider: `breaker_failures` failures in a row open it; an open breaker
//!   is skipped for `breaker_cooldown`, then one call probes it (half-open): success closes
//!   it, failure opens it again. A breaker is asked only when a call reaches its provider,
//!   so a healthy first provider never spends a backup's probe. A probe that ends without a
//!   verdict (its caller went away, or the hedge partner answered first) leaves the breaker
//!   due for another probe at once.
//! - When every provider's breaker is open the call fails at once with a `server` error whose
//!   retry hint is the soonest probe, so the handler's retry policy waits for it.
//!
//! Metrics (`sluice_llm_fallbacks_total`, `_answered_total`, `_hedges_total`,
//! `_breaker_state`, `_breaker_transitions_total`) carry the provider's position in the
//! list, its name and model: configuration only.

use std::{
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use futures::{FutureExt, StreamExt, future::BoxFuture, stream::FuturesUnordered};
use sluice_runtime::lock;
use sluice_schema::TextCompletionRequest;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::{
    metrics::LlmMetrics,
    provider::{AnsweredBy, Chunk, ChunkStream, Completion, FailureKind, Provider, ProviderError},
};

/// How a fallback list behaves.
#[derive(Debug, Clone, PartialEq)]
pub struct FallbackSettings {
    /// A streamed call that has given no text this long after it started moves to the next
    /// provider (`None`: only the provider's own time limits apply).
    pub first_token_deadline: Option<Duration>,
    /// A streamed call that has given no text this long after it started gets the next
    /// provider started beside it (`None`: no hedging).
    pub hedge_after: Option<Duration>,
    /// Failures in a row that open a provider's breaker (0: no breaker).
    pub breaker_failures: u32,
    /// How long an open breaker skips its provider before a probe.
    pub breaker_cooldown: Duration,
}

impl Default for FallbackSettings {
    fn default() -> Self {
        Self {
            first_token_deadline: None,
            hedge_after: None,
            breaker_failures: 5,
            breaker_cooldown: Duration::from_secs(30),
        }
    }
}

/// A circuit breaker's state, as `sluice_llm_breaker_state` exports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through; the count is the failures in a row so far.
    Closed,
    /// Calls skip the provider until the cool-down has passed.
    Open,
    /// One call probes the provider; the others skip it.
    HalfOpen,
}

impl BreakerState {
    /// The gauge's value.
    fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }

    /// The `state` label of a transition.
    fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half-open",
        }
    }
}

#[derive(Debug)]
struct Breaker {
    state: BreakerState,
    /// Failures in a row while closed.
    failures: u32,
    /// While open: when the next probe may go.
    until: Instant,
}

/// What a breaker says to a call that reached its provider.
enum Admission {
    /// Go (`probe`: this call decides whether the breaker closes).
    Go { probe: bool },
    /// Skip it; a probe may go at the instant given.
    Skip(Instant),
}

/// One provider of the list.
struct Member {
    provider: Arc<dyn Provider>,
    position: usize,
    /// position, provider, model: the metrics' labels.
    labels: [String; 3],
    breaker: Mutex<Breaker>,
}

impl Member {
    fn labels(&self) -> [&str; 3] {
        [&self.labels[0], &self.labels[1], &self.labels[2]]
    }

    fn with(&self, extra: &'static str) -> [&str; 4] {
        let [p, n, m] = self.labels();
        [p, n, m, extra]
    }
}

/// The providers of a fallback list, in order, behind one [`Provider`]: the first is the
/// one the processor is configured with (its name, model and endpoint are this provider's).
pub struct Fallback {
    members: Vec<Arc<Member>>,
    settings: FallbackSettings,
    metrics: LlmMetrics,
}

impl fmt::Debug for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fallback")
            .field(
                "providers",
                &self.members.iter().map(|m| &m.labels).collect::<Vec<_>>(),
            )
            .field("settings", &self.settings)
            .finish()
    }
}

/// Moves `member`'s breaker to `to`: the gauge, the transition's count, a log line.
fn transition(metrics: &LlmMetrics, member: &Member, breaker: &mut Breaker, to: BreakerState) {
    if breaker.state == to {
        return;
    }
    breaker.state = to;
    metrics
        .breaker_state
        .with_label_values(&member.labels())
        .set(to.gauge());
    metrics
        .breaker_transitions
        .with_label_values(&member.with(to.as_str()))
        .inc();
    let [position, provider, model] = member.labels();
    info!(
        event = "llm_breaker",
        position,
        provider,
        model,
        state = to.as_str(),
        "circuit breaker {}",
        to.as_str()
    );
}

/// A call's admission to one provider: settles the breaker with the call's verdict, or, if
/// dropped without one while probing, leaves the breaker due for another probe at once.
struct Permit {
    member: Arc<Member>,
    metrics: LlmMetrics,
    settings_failures: u32,
    cooldown: Duration,
    probe: bool,
    settled: bool,
}

impl Permit {
    /// The provider answered.
    fn success(mut self) {
        self.settled = true;
        if self.settings_failures == 0 {
            return;
        }
        let mut b = lock(&self.member.breaker);
        b.failures = 0;
        transition(&self.metrics, &self.member, &mut b, BreakerState::Closed);
    }

    /// The provider failed (a failure of the provider's, not a refusal of the request).
    fn failure(mut self) {
        self.settled = true;
        if self.settings_failures == 0 {
            return;
        }
        let mut b = lock(&self.member.breaker);
        b.failures = b.failures.saturating_add(1);
        if b.state == BreakerState::HalfOpen || b.failures >= self.settings_failures {
            b.until = Instant::now() + self.cooldown;
            b.failures = 0;
            transition(&self.metrics, &self.member, &mut b, BreakerState::Open);
        }
    }

    /// Neither: the request was refused for itself, so the provider is not to blame.
    fn neutral(mut self) {
        self.settled = true;
        self.release();
    }

    fn release(&self) {
        if !self.probe {
            return;
        }
        let mut b = lock(&self.member.breaker);
        if b.state == BreakerState::HalfOpen {
            // Still open, due for a probe now: the next call that reaches it probes.
            b.until = Instant::now();
            transition(&self.metrics, &self.member, &mut b, BreakerState::Open);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.settled {
            self.release();
        }
    }
}

/// A provider's answer up to its first text: the chunks so far (usage, the first text) and
/// the rest of the stream, if any.
struct Opened {
    head: Vec<Chunk>,
    rest: Option<ChunkStream>,
}

/// The calls under way: each one's position, permit and outcome up to its first text.
type Running = FuturesUnordered<BoxFuture<'static, (usize, Permit, Result<Opened, Failed>)>>;

/// The `reason` of a move away from a provider that cannot be sent the request in its terms.
const UNSENDABLE: &str = "unsendable";

/// A provider's failure, and the `reason` label a move away from it gets.
struct Failed {
    error: ProviderError,
    reason: &'static str,
}

impl From<ProviderError> for Failed {
    /// A provider's own failure: the reason is its kind.
    fn from(error: ProviderError) -> Self {
        Self {
            reason: error.kind.as_str(),
            error,
        }
    }
}

/// The error of a call no member answered, given the last member's `error`: a member's
/// outage (retryable, and the real reason) before a refusal to be sent the request, and the
/// refusals of every member together when none could be sent it.
fn call_error(
    error: ProviderError,
    outage: Option<ProviderError>,
    refusals: Vec<String>,
) -> ProviderError {
    if !error.unsendable {
        return error;
    }
    if let Some(outage) = outage {
        return outage;
    }
    if refusals.len() < 2 {
        return error;
    }
    ProviderError::unsendable(format!(
        "no provider of the fallback list can be sent this request: {}",
        refusals.join("; ")
    ))
}

impl Fallback {
    /// `primary` then `backups`, in that order.
    pub fn new(
        primary: Arc<dyn Provider>,
        backups: Vec<Arc<dyn Provider>>,
        settings: FallbackSettings,
        metrics: LlmMetrics,
    ) -> Self {
        let members: Vec<Arc<Member>> = std::iter::once(primary)
            .chain(backups)
            .enumerate()
            .map(|(position, provider)| {
                let labels = [
                    position.to_string(),
                    provider.name().to_owned(),
                    provider.model().to_owned(),
                ];
                Arc::new(Member {
                    provider,
                    position,
                    labels,
                    breaker: Mutex::new(Breaker {
                        state: BreakerState::Closed,
                        failures: 0,
                        until: Instant::now(),
                    }),
                })
            })
            .collect();
        // Every series at 0 from the start: an alert on a rate needs the series before the
        // first event.
        for m in &members {
            metrics.provider_configured(m.provider.name(), m.provider.model());
            metrics.answered.with_label_values(&m.labels());
            metrics.breaker_state.with_label_values(&m.labels()).set(0);
            for state in ["open", "half-open", "closed"] {
                metrics
                    .breaker_transitions
                    .with_label_values(&m.with(state));
            }
            for outcome in ["won", "lost", "failed"] {
                metrics.hedges.with_label_values(&m.with(outcome));
            }
            for reason in [
                FailureKind::Connect.as_str(),
                FailureKind::Timeout.as_str(),
                FailureKind::RateLimited.as_str(),
                FailureKind::Server.as_str(),
                "first_token_deadline",
                "breaker_open",
                UNSENDABLE,
            ] {
                metrics.fallbacks.with_label_values(&m.with(reason));
            }
        }
        Self {
            members,
            settings,
            metrics,
        }
    }

    /// The providers, in order: name and model.
    pub fn providers(&self) -> Vec<(&'static str, String)> {
        self.members
            .iter()
            .map(|m| (m.provider.name(), m.provider.model().to_owned()))
            .collect()
    }

    /// A breaker's state now (for tests and the start-up log).
    pub fn breaker(&self, position: usize) -> Option<BreakerState> {
        self.members.get(position).map(|m| lock(&m.breaker).state)
    }

    /// Asks `member`'s breaker whether a call may go to it now.
    fn admit(&self, member: &Arc<Member>) -> Admission {
        if self.settings.breaker_failures == 0 {
            return Admission::Go { probe: false };
        }
        let mut b = lock(&member.breaker);
        match b.state {
            BreakerState::Closed => Admission::Go { probe: false },
            BreakerState::Open | BreakerState::HalfOpen if Instant::now() < b.until => {
                Admission::Skip(b.until)
            }
            // Open and cooled down, or half-open with a probe that has had a whole cool-down
            // without a verdict (it hangs within its provider's own time limits): probe.
            BreakerState::Open | BreakerState::HalfOpen => {
                transition(&self.metrics, member, &mut b, BreakerState::HalfOpen);
                b.until = Instant::now() + self.settings.breaker_cooldown;
                Admission::Go { probe: true }
            }
        }
    }

    fn permit(&self, member: &Arc<Member>, probe: bool) -> Permit {
        Permit {
            member: member.clone(),
            metrics: self.metrics.clone(),
            settings_failures: self.settings.breaker_failures,
            cooldown: self.settings.breaker_cooldown,
            probe,
            settled: false,
        }
    }

    /// The request as `member` gets it: the first provider serves the model the request
    /// names; the others answer with their own model.
    fn request_for(member: &Member, request: &TextCompletionRequest) -> TextCompletionRequest {
        let mut r = request.clone();
        if member.position > 0 {
            r.model = None;
        }
        r
    }

    /// One provider's call up to its first text chunk (or its whole answer), within the
    /// first-token deadline when streaming.
    fn open(
        &self,
        member: &Arc<Member>,
        request: &TextCompletionRequest,
        streaming: bool,
    ) -> BoxFuture<'static, Result<Opened, Failed>> {
        let provider = member.provider.clone();
        let request = Self::request_for(member, request);
        let deadline = self.settings.first_token_deadline.filter(|_| streaming);
        async move {
            let call = async {
                if !streaming || !provider.supports_streaming() {
                    let c = provider.generate(&request).await?;
                    return Ok(Opened {
                        head: vec![Chunk {
                            text: c.text,
                            usage: c.usage,
                            finish_reason: c.finish_reason,
                            answered_by: None,
                            tool_calls: c.tool_calls,
                        }],
                        rest: None,
                    });
                }
                let mut stream = provider.generate_stream(&request).await?;
                let mut head = Vec::new();
                while let Some(item) = stream.next().await {
                    let chunk = item?;
                    // A tool call's first piece is output too: the call stays with its provider.
                    let text = !chunk.text.is_empty() || !chunk.tool_calls.is_empty();
                    head.push(chunk);
                    if text {
                        return Ok(Opened {
                            head,
                            rest: Some(stream),
                        });
                    }
                }
                // An answer without text is still an answer.
                Ok::<_, ProviderError>(Opened { head, rest: None })
            };
            match deadline {
                None => call.await.map_err(Failed::from),
                Some(d) => match tokio::time::timeout(d, call).await {
                    Ok(result) => result.map_err(Failed::from),
                    Err(_) => Err(Failed {
                        error: ProviderError::new(
                            FailureKind::Timeout,
                            format!(
                                "{} ({}) gave no first token within {} ms (--first-token-deadline-ms)",
                                provider.name(),
                                provider.model(),
                                d.as_millis()
                            ),
                        ),
                        reason: "first_token_deadline",
                    }),
                },
            }
        }
        .boxed()
    }

    /// Starts the next provider from `next` whose breaker lets the call through; counts the
    /// providers skipped for an open breaker. `false` when none is left.
    fn start_next(
        &self,
        next: &mut usize,
        request: &TextCompletionRequest,
        streaming: bool,
        running: &mut Running,
        soonest_probe: &mut Option<Instant>,
    ) -> bool {
        while let Some(member) = self.members.get(*next) {
            *next += 1;
            match self.admit(member) {
                Admission::Skip(at) => {
                    self.metrics
                        .fallbacks
                        .with_label_values(&member.with("breaker_open"))
                        .inc();
                    *soonest_probe = Some(soonest_probe.map_or(at, |s| s.min(at)));
                }
                Admission::Go { probe } => {
                    let permit = self.permit(member, probe);
                    let position = member.position;
                    let call = self.open(member, request, streaming);
                    running.push(async move { (position, permit, call.await) }.boxed());
                    return true;
                }
            }
        }
        false
    }

    /// The call: the providers in order (and hedged), up to the first text of the one that
    /// answers.
    async fn call(
        &self,
        request: &TextCompletionRequest,
        streaming: bool,
    ) -> Result<(usize, Opened), ProviderError> {
        let hedge_after = self.settings.hedge_after.filter(|_| streaming);
        let mut running = FuturesUnordered::new();
        let mut next = 0;
        let mut soonest_probe = None;
        // The hedge: the position of the provider started beside a slow one (one per call).
        let mut hedge: Option<usize> = None;
        let mut hedged = false;
        let mut current_started = Instant::now();
        // What the members that could not be sent the request said, and the last failure of
        // a member's health: the call's error if no member answers (see `call_error`).
        let mut refusals: Vec<String> = Vec::new();
        let mut outage: Option<ProviderError> = None;
        loop {
            if running.is_empty() {
                if !self.start_next(
                    &mut next,
                    request,
                    streaming,
                    &mut running,
                    &mut soonest_probe,
                ) {
                    return Err(self.all_open(soonest_probe));
                }
                current_started = Instant::now();
            }
            let hedge_at = match hedge_after {
                Some(d) if !hedged && next < self.members.len() => Some(current_started + d),
                _ => None,
            };
            let hedge_due = async move {
                match hedge_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                Some((position, permit, result)) = running.next() => match result {
                    Ok(opened) => {
                        permit.success();
                        self.count_answer(position, hedge);
                        // Dropping `running` cancels a hedge partner still running.
                        return Ok((position, opened));
                    }
                    Err(Failed { error, reason }) => {
                        let member = &self.members[position];
                        if error.kind == FailureKind::BadRequest && !error.unsendable {
                            permit.neutral();
                            if running.is_empty() {
                                // The request itself is refused: no other provider is asked.
                                return Err(error);
                            }
                            // A hedge partner refused it: the other call goes on.
                            continue;
                        }
                        let reason = if error.unsendable {
                            // Not this provider's fault, nor its breaker's business.
                            permit.neutral();
                            refusals.push(error.message.clone());
                            UNSENDABLE
                        } else {
                            permit.failure();
                            outage = Some(error.clone());
                            reason
                        };
                        if hedge == Some(position) && error.unsendable && !running.is_empty() {
                            // The hedge could not be sent (it answered at once, nothing was
                            // sent): not a hedge that failed. The next member, if any, is
                            // started beside instead, now (the delay is already over).
                            hedge = None;
                            hedged = false;
                            self.metrics.fallbacks.with_label_values(&member.with(reason)).inc();
                            continue;
                        }
                        if hedge == Some(position) {
                            self.metrics.hedges.with_label_values(&member.with("failed")).inc();
                            if !running.is_empty() {
                                // The call is still with the provider the hedge was for.
                                continue;
                            }
                        }
                        let moves = !running.is_empty()
                            || self.start_next(&mut next, request, streaming, &mut running, &mut soonest_probe);
                        if !moves {
                            return Err(call_error(error, outage, refusals));
                        }
                        self.metrics.fallbacks.with_label_values(&member.with(reason)).inc();
                        let [position_label, provider, model] = member.labels();
                        warn!(event = "llm_fallback", position = position_label, provider, model,
                              reason, error_type = error.kind.as_str(), status = error.status,
                              "moving the call to the next provider");
                        if hedge.is_none() {
                            // The provider now tried gets the whole hedge delay.
                            current_started = Instant::now();
                        }
                    }
                },
                () = hedge_due => {
                    hedged = true;
                    if self.start_next(&mut next, request, streaming, &mut running, &mut soonest_probe) {
                        hedge = Some(next - 1);
                        let [position, provider, model] = self.members[next - 1].labels();
                        info!(event = "llm_hedge", position, provider, model,
                              after_ms = hedge_after.map_or(0, |d| d.as_millis() as u64),
                              "no first token yet: the next provider is started beside");
                    }
                }
            }
        }
    }

    /// Counts the answer of the member at `position`, and how the call's hedge (the position
    /// of the member started beside a slow one), if it had one, fared.
    fn count_answer(&self, position: usize, hedge: Option<usize>) {
        if let Some(h) = hedge {
            let outcome = if h == position { "won" } else { "lost" };
            self.metrics
                .hedges
                .with_label_values(&self.members[h].with(outcome))
                .inc();
        }
        self.metrics
            .answered
            .with_label_values(&self.members[position].labels())
            .inc();
    }

    /// The error of a call that found every provider's breaker open.
    fn all_open(&self, soonest_probe: Option<Instant>) -> ProviderError {
        let wait = soonest_probe.map(|at| at.saturating_duration_since(Instant::now()));
        ProviderError::new(
            FailureKind::Server,
            format!(
                "every provider of the fallback list is skipped: their circuit breakers are open after repeated failures (next probe in {} ms)",
                wait.unwrap_or_default().as_millis()
            ),
        )
        .with_retry_after(wait)
    }

    fn answered_by(&self, position: usize) -> AnsweredBy {
        let p = &self.members[position].provider;
        AnsweredBy {
            provider: p.name(),
            model: p.model().to_owned(),
        }
    }
}

#[async_trait]
impl Provider for Fallback {
    fn name(&self) -> &'static str {
        self.members[0].provider.name()
    }

    fn model(&self) -> &str {
        self.members[0].provider.model()
    }

    fn endpoint(&self) -> &str {
        self.members[0].provider.endpoint()
    }

    /// Whether any provider streams: one that does not answers a streamed call with one
    /// chunk.
    fn supports_streaming(&self) -> bool {
        self.members.iter().any(|m| m.provider.supports_streaming())
    }

    /// Whether every provider calls tools: a request with tools moved to one that does not
    /// would be answered without them.
    fn supports_tools(&self) -> bool {
        self.members.iter().all(|m| m.provider.supports_tools())
    }

    /// Whether every provider holds its answers to a schema; otherwise the processor checks
    /// whichever answers.
    fn supports_structured_output(&self) -> bool {
        self.members
            .iter()
            .all(|m| m.provider.supports_structured_output())
    }

    fn holds_structured_output(&self, request: &TextCompletionRequest) -> bool {
        self.members
            .iter()
            .all(|m| m.provider.holds_structured_output(request))
    }

    async fn generate_stream(
        &self,
        request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError> {
        let (position, mut opened) = self.call(request, true).await?;
        let answered_by = if position == 0 {
            // The first provider at the model the request names.
            AnsweredBy {
                provider: self.name(),
                model: crate::providers::model_for(request, self.model()).to_owned(),
            }
        } else {
            self.answered_by(position)
        };
        match opened.head.first_mut() {
            Some(first) => first.answered_by = Some(answered_by),
            None => opened.head.push(Chunk {
                answered_by: Some(answered_by),
                ..Chunk::default()
            }),
        }
        let head = futures::stream::iter(opened.head.into_iter().map(Ok));
        Ok(match opened.rest {
            Some(rest) => head.chain(rest).boxed(),
            None => head.boxed(),
        })
    }

    async fn generate(&self, request: &TextCompletionRequest) -> Result<Completion, ProviderError> {
        let (position, opened) = self.call(request, false).await?;
        let mut done = crate::provider::collect(
            futures::stream::iter(opened.head.into_iter().map(Ok)).boxed(),
        )
        .await?;
        done.answered_by = Some(if position == 0 {
            AnsweredBy {
                provider: self.name(),
                model: crate::providers::model_for(request, self.model()).to_owned(),
            }
        } else {
            self.answered_by(position)
        });
        Ok(done)
    }
}

#[cfg(test)]
mod tests;
