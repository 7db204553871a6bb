//! The supervisor's fan-in, held on the bus: every agent replica runs a [`FanIn`]; one of them
//! holds the fan-in topic's subscription (Exclusive), the others stand by and take over when
//! it goes away, and the broker hands the new holder everything unacked.
//!
//! The state lives in the topic, not in a process: a supervisor's fan-out publishes a
//! [`Registration`] there (its correlation id, its goals, the dialog's request and an absolute
//! deadline), and each subagent's end comes back there as a [`Completion`] (TrustGraph's
//! `subagent-completion` request). The holder keeps every message of a correlation UNACKED
//! until the correlation is joined: all goals answered, or its deadline passed. It then
//! publishes the synthesis request (the dialog's next step) on the agent's request topic, and
//! only then acks what it held. A holder that dies before the ack costs nothing but a
//! repeat: the next holder is sent every message again and re-arms each deadline from the
//! registration's absolute one. A death between the synthesis's publication and the acks
//! publishes the synthesis twice, the same window every hand-off of a dialog has
//! (docs/agent.md#the-supervisor-and-its-fan-in).
//!
//! [`Joiner`] is the state machine (pure, tested alone); [`FanIn`] runs it on a subscription.

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};
use sluice_runtime::bus::{
    Bus, BusError, Delivery, Message, Publisher, StartPosition, SubscribeOptions, Subscription,
};
use sluice_schema::{AgentRequest, AgentStep, add_tokens, properties};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::metrics::AgentMetrics;

/// The fan-in topic's default: sluice's own, persistent under either topic mapping (the
/// fan-in's state is its messages, which a non-persistent topic would lose).
pub const DEFAULT_FANIN_TOPIC: &str = "persistent://tg/request/agent-fanin";
/// The subscription every replica's joiner asks for; the broker gives it to one at a time.
pub const FANIN_SUBSCRIPTION: &str = "agent-fanin";
/// How long a supervisor waits for its subagents by default: less than a caller waits
/// without a record (the client's and the gateway's inactivity timeout, 120 s by default), so
/// that the caller gets the synthesis of what came back rather than a timeout. TrustGraph's
/// aggregator keeps a fan-out 300 s, but never answers at that deadline.
pub const DEFAULT_FANIN_TIMEOUT: Duration = Duration::from_secs(90);
/// How often a standby asks for the fan-in subscription.
pub const STANDBY_RETRY: Duration = Duration::from_secs(1);
/// The step type of a subagent's completion (TrustGraph's).
pub const COMPLETION_STEP: &str = "subagent-completion";
/// The step type of the supervisor's decomposition.
pub const DECOMPOSE_STEP: &str = "decompose";
/// The step type of the synthesis the fan-in hands on.
pub const SYNTHESISE_STEP: &str = "synthesise";
/// How long a new holder reads what the broker sends it again before it acts on a deadline:
/// a deadline that passed while nobody held the fan-in must not join a correlation before
/// its completions, sent right after its registration, are read.
pub const TAKEOVER_GRACE: Duration = Duration::from_secs(2);
/// How many finished correlations a holder remembers, to drop their late completions at
/// once (one it forgot is dropped at its deadline instead).
const FINISHED_REMEMBERED: usize = 10_000;

/// A fan-in event, for the `sluice_agent_fanin_total` metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A supervisor fanned out.
    Fanout,
    /// A completion was recorded for its goal.
    Completion,
    /// A correlation was joined with every goal answered.
    JoinComplete,
    /// A correlation was joined at its deadline, goals missing.
    JoinDeadline,
    /// A second completion for a goal (a redelivered subagent), dropped.
    DroppedDuplicate,
    /// A completion of a correlation already joined, dropped.
    DroppedFinished,
    /// A completion whose registration never came before its deadline, dropped.
    DroppedOrphan,
    /// This replica took the fan-in subscription.
    Takeover,
}

impl Event {
    /// Every event, each shown at 0 from the start.
    pub const ALL: [Event; 8] = [
        Event::Fanout,
        Event::Completion,
        Event::JoinComplete,
        Event::JoinDeadline,
        Event::DroppedDuplicate,
        Event::DroppedFinished,
        Event::DroppedOrphan,
        Event::Takeover,
    ];

    /// The `event` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fanout => "fanout",
            Self::Completion => "completion",
            Self::JoinComplete => "join-complete",
            Self::JoinDeadline => "join-deadline",
            Self::DroppedDuplicate => "dropped-duplicate",
            Self::DroppedFinished => "dropped-finished",
            Self::DroppedOrphan => "dropped-orphan",
            Self::Takeover => "takeover",
        }
    }
}

/// A supervisor's fan-out, as the fan-in topic holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// The fan-out's correlation id (the subagents' `correlation_id`).
    pub correlation_id: String,
    /// The goals, in the supervisor's order.
    pub goals: Vec<String>,
    /// The dialog's request at the fan-out (its history ends with the decomposition), with
    /// the usage no record passed on yet.
    pub request: AgentRequest,
    /// When the fan-in stops waiting, in milliseconds since the Unix epoch.
    pub deadline_ms: u64,
}

/// The payload of a registration on the fan-in topic: a field no `AgentRequest` has, so the
/// two kinds of message tell themselves apart.
#[derive(Debug, Serialize, Deserialize)]
struct RegistrationRecord {
    fanin_registration: Registration,
}

impl Registration {
    /// The message payload.
    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(&RegistrationRecord {
            fanin_registration: self.clone(),
        })
    }
}

/// A subagent's end, for the fan-in.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Its fan-out's correlation id.
    pub correlation_id: String,
    /// The goal it was given.
    pub goal: String,
    /// Its answer, or why it has none.
    pub result: Result<String, String>,
    /// The tokens it spent (input, output), published by no record yet.
    pub usage: (Option<u64>, Option<u64>),
    /// Its fan-out's deadline, when it carried one.
    pub deadline_ms: Option<u64>,
}

impl Completion {
    /// The completion a subagent's `request` ends with: TrustGraph's `subagent-completion`
    /// request (pattern_base.py's emit_subagent_completion), sluice's failure as action
    /// `error`, its usage as the pending counts.
    pub fn request(
        request: &AgentRequest,
        result: Result<String, String>,
        usage: (Option<u64>, Option<u64>),
    ) -> AgentRequest {
        let (thought, action, observation) = match result {
            Ok(answer) => ("Subagent completed", "complete", answer),
            Err(why) => ("Subagent failed", "error", why),
        };
        AgentRequest {
            question: request.question.clone(),
            group: request.group.clone(),
            history: vec![AgentStep {
                thought: thought.into(),
                action: action.into(),
                observation,
                step_type: Some(COMPLETION_STEP.into()),
                ..AgentStep::default()
            }],
            collection: request.collection.clone(),
            streaming: false,
            session_id: request.session_id.clone(),
            conversation_id: request.conversation_id.clone(),
            pattern: Some(String::new()),
            deadline_ms: request.deadline_ms,
            pending_in_token: usage.0,
            pending_out_token: usage.1,
            correlation_id: request.correlation_id.clone(),
            parent_session_id: request.parent_session_id.clone(),
            subagent_goal: request.subagent_goal.clone(),
            expected_siblings: request.expected_siblings,
            ..AgentRequest::default()
        }
    }

    /// The completion `request` is, if it is one: a correlation id and a
    /// `subagent-completion` step.
    pub fn from_request(request: &AgentRequest) -> Option<Self> {
        let correlation_id = request.correlation_id.clone().filter(|c| !c.is_empty())?;
        let step = request
            .history
            .iter()
            .rev()
            .find(|s| s.step_type.as_deref() == Some(COMPLETION_STEP))?;
        let result = if step.action == "error" {
            Err(step.observation.clone())
        } else {
            Ok(step.observation.clone())
        };
        Some(Self {
            correlation_id,
            goal: request
                .subagent_goal
                .clone()
                .unwrap_or_else(|| request.question.clone()),
            result,
            usage: (request.pending_in_token, request.pending_out_token),
            deadline_ms: request.deadline_ms,
        })
    }
}

/// What a fan-in message is.
#[derive(Debug)]
pub enum Incoming {
    /// A supervisor's fan-out.
    Registration(Box<Registration>),
    /// A subagent's end.
    Completion(Completion),
}

/// Reads a fan-in message; `None` for one that is neither kind.
pub fn decode(payload: &[u8]) -> Option<Incoming> {
    if let Ok(r) = serde_json::from_slice::<RegistrationRecord>(payload) {
        return Some(Incoming::Registration(Box::new(r.fanin_registration)));
    }
    let request = sluice_schema::decode::<AgentRequest>(payload).ok()?;
    Completion::from_request(&request).map(Incoming::Completion)
}

/// A correlation joined: what the synthesis request is made of, and the messages to ack once
/// it is published.
#[derive(Debug)]
pub struct Joined<T> {
    /// The registration (the latest one, when the supervisor registered twice).
    pub registration: Registration,
    /// The registration message's properties: the dialog's id, its client, its trace, its
    /// key, and the attempt it continues.
    pub properties: BTreeMap<String, String>,
    /// Each answered goal's answer.
    pub results: BTreeMap<String, String>,
    /// The goals without an answer (failed, or not back by the deadline), in order, with why.
    pub missing: Vec<(String, String)>,
    /// Whether every goal answered in time.
    pub complete: bool,
    /// The messages held for the correlation.
    pub tokens: Vec<T>,
    /// Tokens spent by the subagents, and the supervisor's not yet published.
    pub usage: (Option<u64>, Option<u64>),
}

impl<T> Joined<T> {
    /// The synthesis request: the registered request, its history one `synthesise` step
    /// longer (TrustGraph's aggregator's), the usage summed.
    pub fn synthesis_request(&self) -> AgentRequest {
        let mut request = self.registration.request.clone();
        let thought = if self.complete {
            "All subagents completed".to_owned()
        } else {
            format!(
                "{} of {} subagents completed",
                self.results.len(),
                self.registration.goals.len()
            )
        };
        let missing: Vec<&str> = self.missing.iter().map(|(g, _)| g.as_str()).collect();
        let mut arguments = BTreeMap::new();
        if !missing.is_empty() {
            arguments.insert(
                "missing".to_owned(),
                serde_json::to_string(&missing).unwrap_or_default(),
            );
        }
        request.history.push(AgentStep {
            thought,
            action: "aggregate".into(),
            arguments,
            observation: serde_json::to_string(&self.results).unwrap_or_default(),
            step_type: Some(SYNTHESISE_STEP.into()),
            subagent_results: self.results.clone(),
            ..AgentStep::default()
        });
        (request.pending_in_token, request.pending_out_token) = self.usage;
        request
    }
}

/// What the joiner asks its runner to do.
#[derive(Debug)]
pub enum Step<T> {
    /// Ack this message (counted as the event).
    Ack(T, Event),
    /// Count an event.
    Count(Event),
    /// Publish the synthesis, then ack the joined correlation's messages.
    Join(Box<Joined<T>>),
}

struct Open<T> {
    registration: Registration,
    properties: BTreeMap<String, String>,
    results: BTreeMap<String, Completion>,
    held: Vec<T>,
}

struct Orphan<T> {
    completion: Completion,
    token: T,
    until: u64,
}

/// The fan-in's state machine over held messages of type `T` (see the module docs). Times are
/// milliseconds since the Unix epoch, given by the caller.
pub struct Joiner<T> {
    open: HashMap<String, Open<T>>,
    orphans: HashMap<String, Vec<Orphan<T>>>,
    finished: HashSet<String>,
    finished_order: VecDeque<String>,
    /// How long a completion without a deadline of its own waits for its registration.
    orphan_wait_ms: u64,
}

impl<T> Joiner<T> {
    /// A joiner holding nothing; an orphan completion without a deadline waits `orphan_wait`.
    pub fn new(orphan_wait: Duration) -> Self {
        Self {
            open: HashMap::new(),
            orphans: HashMap::new(),
            finished: HashSet::new(),
            finished_order: VecDeque::new(),
            orphan_wait_ms: u64::try_from(orphan_wait.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// The correlations waiting for completions.
    pub fn open(&self) -> usize {
        self.open.len()
    }

    /// A registration arrived (`properties` are its message's).
    pub fn registration(
        &mut self,
        registration: Registration,
        properties: BTreeMap<String, String>,
        token: T,
        now: u64,
    ) -> Vec<Step<T>> {
        let id = registration.correlation_id.clone();
        if self.finished.contains(&id) {
            return vec![Step::Ack(token, Event::DroppedFinished)];
        }
        let mut steps = Vec::new();
        match self.open.get_mut(&id) {
            Some(open) => {
                // The same fan-out registered again (a supervisor iteration redelivered, or the
                // message sent again after a takeover): the later one is the attempt its
                // client follows now. Answers to goals it no longer has are set aside.
                open.held.push(token);
                open.results
                    .retain(|goal, _| registration.goals.contains(goal));
                open.registration = registration;
                open.properties = properties;
            }
            None => {
                self.open.insert(
                    id.clone(),
                    Open {
                        registration,
                        properties,
                        results: BTreeMap::new(),
                        held: vec![token],
                    },
                );
                for orphan in self.orphans.remove(&id).unwrap_or_default() {
                    steps.extend(self.record(orphan.completion, orphan.token));
                }
            }
        }
        steps.extend(self.join_if_complete(&id));
        // No deadline is acted on here: after a takeover the broker sends a registration
        // before its completions, and joining it at once (its deadline passed while nobody
        // held the fan-in) would leave out answers that are on their way. The runner ticks.
        let _ = now;
        steps
    }

    /// A completion arrived.
    pub fn completion(&mut self, completion: Completion, token: T, now: u64) -> Vec<Step<T>> {
        let id = completion.correlation_id.clone();
        if self.finished.contains(&id) {
            return vec![Step::Ack(token, Event::DroppedFinished)];
        }
        if !self.open.contains_key(&id) {
            let until = completion
                .deadline_ms
                .unwrap_or_else(|| now.saturating_add(self.orphan_wait_ms));
            self.orphans.entry(id).or_default().push(Orphan {
                completion,
                token,
                until,
            });
            return Vec::new();
        }
        let mut steps = self.record(completion, token);
        steps.extend(self.join_if_complete(&id));
        steps
    }

    /// Records a completion of an open correlation; the message is held with it either way
    /// (acking a duplicate now would ack the first too when the two are one message sent
    /// again).
    fn record(&mut self, completion: Completion, token: T) -> Vec<Step<T>> {
        let Some(open) = self.open.get_mut(&completion.correlation_id) else {
            return vec![Step::Ack(token, Event::DroppedOrphan)];
        };
        open.held.push(token);
        let known = open.registration.goals.contains(&completion.goal);
        if !known || open.results.contains_key(&completion.goal) {
            return vec![Step::Count(Event::DroppedDuplicate)];
        }
        open.results.insert(completion.goal.clone(), completion);
        vec![Step::Count(Event::Completion)]
    }

    fn join_if_complete(&mut self, id: &str) -> Option<Step<T>> {
        let open = self.open.get(id)?;
        let all = open
            .registration
            .goals
            .iter()
            .all(|g| open.results.contains_key(g));
        all.then(|| self.join(id)).flatten()
    }

    /// Joins the correlation `id` with what it has.
    fn join(&mut self, id: &str) -> Option<Step<T>> {
        let open = self.open.remove(id)?;
        self.remember(id);
        let mut results = BTreeMap::new();
        let mut missing = Vec::new();
        let mut usage = (
            open.registration.request.pending_in_token,
            open.registration.request.pending_out_token,
        );
        for c in open.results.values() {
            usage.0 = add_tokens(usage.0, c.usage.0);
            usage.1 = add_tokens(usage.1, c.usage.1);
        }
        for goal in &open.registration.goals {
            match open.results.get(goal).map(|c| &c.result) {
                Some(Ok(answer)) => {
                    results.insert(goal.clone(), answer.clone());
                }
                Some(Err(why)) => missing.push((goal.clone(), why.clone())),
                None => missing.push((goal.clone(), "no answer before the deadline".into())),
            }
        }
        let complete = open.results.len() == open.registration.goals.len();
        Some(Step::Join(Box::new(Joined {
            registration: open.registration,
            properties: open.properties,
            results,
            missing,
            complete,
            tokens: open.held,
            usage,
        })))
    }

    fn remember(&mut self, id: &str) {
        if self.finished.insert(id.to_owned()) {
            self.finished_order.push_back(id.to_owned());
        }
        while self.finished_order.len() > FINISHED_REMEMBERED {
            if let Some(old) = self.finished_order.pop_front() {
                self.finished.remove(&old);
            }
        }
    }

    /// Joins the correlations whose deadline passed and drops the orphans whose deadline did.
    pub fn tick(&mut self, now: u64) -> Vec<Step<T>> {
        let due: Vec<String> = self
            .open
            .iter()
            .filter(|(_, o)| o.registration.deadline_ms <= now)
            .map(|(id, _)| id.clone())
            .collect();
        let mut steps: Vec<Step<T>> = due.iter().filter_map(|id| self.join(id)).collect();
        let mut empty = Vec::new();
        for (id, orphans) in &mut self.orphans {
            let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(orphans)
                .into_iter()
                .partition(|o| o.until <= now);
            *orphans = kept;
            steps.extend(
                gone.into_iter()
                    .map(|o| Step::Ack(o.token, Event::DroppedOrphan)),
            );
            if orphans.is_empty() {
                empty.push(id.clone());
            }
        }
        for id in empty {
            self.orphans.remove(&id);
        }
        steps
    }

    /// The next time [`Joiner::tick`] has something to do.
    pub fn next_deadline(&self) -> Option<u64> {
        let open = self.open.values().map(|o| o.registration.deadline_ms);
        let orphans = self.orphans.values().flatten().map(|o| o.until);
        open.chain(orphans).min()
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Properties of a fan-in message the synthesis carries on: every one but a record's
/// sequence number.
fn carried(delivery: &Delivery) -> BTreeMap<String, String> {
    delivery
        .properties()
        .iter()
        .filter(|(k, _)| k.as_str() != properties::SEQ)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// One replica's fan-in joiner: holds the fan-in subscription when it can, stands by when
/// another replica does.
pub struct FanIn {
    /// The bus.
    pub bus: Arc<dyn Bus>,
    /// The fan-in topic.
    pub topic: String,
    /// The agent's request topic, where synthesis requests go.
    pub next_step: Arc<dyn Publisher>,
    /// The agent's metrics.
    pub metrics: AgentMetrics,
    /// How long an orphan completion without a deadline waits for its registration.
    pub timeout: Duration,
}

impl FanIn {
    /// Runs until `shutdown`: asks for the fan-in subscription about every
    /// [`STANDBY_RETRY`], and holds it once given.
    pub async fn run(self, shutdown: CancellationToken) {
        loop {
            let mut options = SubscribeOptions::exclusive(64);
            options.start = StartPosition::Earliest;
            let subscribed = tokio::select! {
                () = shutdown.cancelled() => return,
                s = self.bus.subscribe(&self.topic, FANIN_SUBSCRIPTION, options) => s,
            };
            match subscribed {
                Ok(sub) => {
                    self.metrics.fanin(Event::Takeover);
                    info!(topic = %self.topic, "holding the supervisor's fan-in");
                    self.hold(sub, &shutdown).await;
                    if shutdown.is_cancelled() {
                        return;
                    }
                }
                Err(BusError::ExclusiveTaken(_)) => {
                    debug!("another replica holds the fan-in; standing by");
                }
                Err(e) => warn!(error = %e, "cannot subscribe to the fan-in topic; retrying"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(STANDBY_RETRY) => {}
            }
        }
    }

    /// Holds the subscription until shutdown or a failure; everything held unacked goes back
    /// to the broker with it.
    async fn hold(&self, mut sub: Box<dyn Subscription>, shutdown: &CancellationToken) {
        let mut joiner: Joiner<Delivery> = Joiner::new(self.timeout);
        let link = sub.link();
        let settled =
            now_ms().saturating_add(u64::try_from(TAKEOVER_GRACE.as_millis()).unwrap_or(u64::MAX));
        loop {
            let wake = joiner
                .next_deadline()
                .map_or(Duration::from_secs(3600), |at| {
                    Duration::from_millis(at.max(settled).saturating_sub(now_ms()))
                });
            let steps = tokio::select! {
                // What has arrived is read before a deadline is acted on.
                biased;
                () = shutdown.cancelled() => break,
                next = sub.next() => match next {
                    None => break,
                    Some(Err(e)) => {
                        warn!(error = %e, "the fan-in subscription failed; asking for it again");
                        break;
                    }
                    Some(Ok(delivery)) => accept(&mut joiner, delivery),
                },
                () = tokio::time::sleep(wake) => {
                    if !link.is_up() {
                        // While the consumer is detached another replica may hold the
                        // subscription and join what this one holds: a deadline acted on
                        // now could answer a dialog twice. Let go; the broker sends it all
                        // to the holder.
                        warn!("the fan-in's consumer is detached at a deadline; letting the fan-in go");
                        break;
                    }
                    joiner.tick(now_ms())
                }
            };
            if !self.settle(steps).await {
                break;
            }
        }
        // Closed first: the messages held are then dropped unsettled, and the broker sends
        // them to the next holder.
        sub.close().await;
        drop(joiner);
    }

    /// Carries out the joiner's steps; false when a synthesis could not be published.
    async fn settle(&self, steps: Vec<Step<Delivery>>) -> bool {
        for step in steps {
            match step {
                Step::Ack(delivery, event) => {
                    self.metrics.fanin(event);
                    delivery.ack();
                }
                Step::Count(event) => self.metrics.fanin(event),
                Step::Join(joined) => {
                    if let Err(e) = self.publish(&joined).await {
                        warn!(error = %e, "the synthesis could not be published; the fan-in starts over");
                        return false;
                    }
                    self.metrics.fanin(if joined.complete {
                        Event::JoinComplete
                    } else {
                        Event::JoinDeadline
                    });
                    info!(
                        correlation = %joined.registration.correlation_id,
                        answered = joined.results.len(),
                        missing = joined.missing.len(),
                        "fan-in joined; synthesis handed on"
                    );
                    let joined = *joined;
                    for delivery in joined.tokens {
                        delivery.ack();
                    }
                }
            }
        }
        true
    }

    async fn publish(&self, joined: &Joined<Delivery>) -> Result<(), BusError> {
        let payload = serde_json::to_vec(&joined.synthesis_request())
            .map_err(|e| BusError::Config(e.to_string()))?;
        let message = Message {
            payload: payload.into(),
            properties: joined.properties.clone(),
            key: None,
        };
        self.next_step.send(message).await?.await
    }
}

/// Feeds one delivered message to the joiner.
fn accept(joiner: &mut Joiner<Delivery>, delivery: Delivery) -> Vec<Step<Delivery>> {
    let now = now_ms();
    match decode(delivery.payload()) {
        Some(Incoming::Registration(r)) => {
            let props = carried(&delivery);
            joiner.registration(*r, props, delivery, now)
        }
        Some(Incoming::Completion(c)) => joiner.completion(c, delivery, now),
        None => {
            warn!(
                "a message on the fan-in topic is neither a registration nor a completion; dropped"
            );
            vec![Step::Ack(delivery, Event::DroppedOrphan)]
        }
    }
}

#[cfg(test)]
mod tests;
