//! The joiner's state machine: every message held until its correlation is joined, first
//! completion per goal wins, deadlines from the registration's absolute one.

use std::{collections::BTreeMap, time::Duration};

use sluice_schema::AgentRequest;

use super::*;

const DEADLINE: u64 = 10_000;

fn registration(goals: &[&str]) -> Registration {
    Registration {
        correlation_id: "c1".into(),
        goals: goals.iter().map(|g| (*g).to_owned()).collect(),
        request: AgentRequest {
            question: "q".into(),
            pending_in_token: Some(5),
            pending_out_token: Some(1),
            ..AgentRequest::default()
        },
        deadline_ms: DEADLINE,
    }
}

fn completion(goal: &str, answer: &str) -> Completion {
    Completion {
        correlation_id: "c1".into(),
        goal: goal.into(),
        result: Ok(answer.into()),
        usage: (Some(10), Some(2)),
        deadline_ms: Some(DEADLINE),
    }
}

fn props() -> BTreeMap<String, String> {
    BTreeMap::from([("id".to_owned(), "dialog".to_owned())])
}

/// The joins among `steps`, and the tokens acked outside a join.
fn split(steps: Vec<Step<u32>>) -> (Vec<Joined<u32>>, Vec<u32>) {
    let mut joins = Vec::new();
    let mut acked = Vec::new();
    for s in steps {
        match s {
            Step::Join(j) => joins.push(*j),
            Step::Ack(t, _) => acked.push(t),
            Step::Count(_) => {}
        }
    }
    (joins, acked)
}

#[test]
fn all_goals_answered_join_once_with_every_message_held_until_then() {
    let mut j = Joiner::new(Duration::from_secs(300));
    let (joins, acked) = split(j.registration(registration(&["a", "b"]), props(), 1, 0));
    assert!(joins.is_empty() && acked.is_empty());
    let (joins, acked) = split(j.completion(completion("a", "A"), 2, 1));
    assert!(joins.is_empty() && acked.is_empty(), "held, not acked");
    let (mut joins, acked) = split(j.completion(completion("b", "B"), 3, 2));
    assert!(acked.is_empty());
    assert_eq!(joins.len(), 1);
    let joined = joins.remove(0);
    assert!(joined.complete);
    assert_eq!(joined.tokens, [1, 2, 3]);
    assert_eq!(joined.properties, props());
    assert!(joined.missing.is_empty());
    let synthesis = joined.synthesis_request();
    let step = synthesis.history.last().unwrap();
    assert_eq!(step.step_type.as_deref(), Some(SYNTHESISE_STEP));
    assert_eq!(
        step.subagent_results,
        BTreeMap::from([("a".into(), "A".into()), ("b".into(), "B".into())])
    );
    // The supervisor's pending usage and both subagents'.
    assert_eq!(synthesis.pending_in_token, Some(25));
    assert_eq!(synthesis.pending_out_token, Some(5));
    assert_eq!(j.open(), 0);
    assert_eq!(j.next_deadline(), None);
}

#[test]
fn duplicates_are_held_with_their_correlation_and_late_ones_acked() {
    let mut j = Joiner::new(Duration::from_secs(300));
    j.registration(registration(&["a", "b"]), props(), 1, 0);
    j.completion(completion("a", "first"), 2, 1);
    // A redelivered subagent answers again: the first answer wins; the message is held (it
    // may be the first one sent again, which an ack now would ack too).
    let steps = j.completion(completion("a", "second"), 3, 2);
    assert!(matches!(steps[..], [Step::Count(Event::DroppedDuplicate)]));
    // A goal the supervisor never gave is no answer.
    let steps = j.completion(completion("zzz", "?"), 4, 2);
    assert!(matches!(steps[..], [Step::Count(Event::DroppedDuplicate)]));
    let (mut joins, _) = split(j.completion(completion("b", "B"), 5, 3));
    let joined = joins.remove(0);
    assert_eq!(joined.results["a"], "first");
    assert_eq!(joined.tokens, [1, 2, 3, 4, 5]);
    // After the join: a completion (or the registration sent again) is acked and dropped.
    let steps = j.completion(completion("b", "again"), 6, 4);
    assert!(matches!(steps[..], [Step::Ack(6, Event::DroppedFinished)]));
    let steps = j.registration(registration(&["a", "b"]), props(), 7, 4);
    assert!(matches!(steps[..], [Step::Ack(7, Event::DroppedFinished)]));
}

#[test]
fn the_deadline_joins_with_the_goals_missing_named() {
    let mut j = Joiner::new(Duration::from_secs(300));
    j.registration(registration(&["a", "b", "c"]), props(), 1, 0);
    j.completion(completion("a", "A"), 2, 1);
    let mut failed = completion("b", "");
    failed.result = Err("the model failed".into());
    j.completion(failed, 3, 1);
    assert_eq!(j.next_deadline(), Some(DEADLINE));
    assert!(j.tick(DEADLINE - 1).is_empty());
    let (mut joins, _) = split(j.tick(DEADLINE));
    let joined = joins.remove(0);
    assert!(!joined.complete);
    assert_eq!(joined.results.len(), 1);
    assert_eq!(
        joined.missing,
        [
            ("b".to_owned(), "the model failed".to_owned()),
            ("c".to_owned(), "no answer before the deadline".to_owned())
        ]
    );
    let step = joined.synthesis_request().history.pop().unwrap();
    assert_eq!(step.arguments["missing"], r#"["b","c"]"#);
    assert_eq!(joined.tokens, [1, 2, 3]);
}

#[test]
fn a_new_holder_rearms_the_deadline_from_the_registration() {
    // The holder died; the broker sends everything again to a fresh joiner, after the
    // deadline: it joins at once with what came back, and no later.
    let mut j = Joiner::new(Duration::from_secs(300));
    let (joins, _) = split(j.registration(registration(&["a", "b"]), props(), 1, DEADLINE + 5));
    assert!(
        joins.is_empty(),
        "its completions come next: not joined before they are read"
    );
    let (joins, _) = split(j.completion(completion("a", "A"), 2, DEADLINE + 5));
    assert!(joins.is_empty(), "a completion alone joins nothing");
    let (joins, _) = split(j.tick(DEADLINE + 5));
    assert_eq!(joins.len(), 1);
    assert_eq!(joins[0].tokens, [1, 2]);
    // Before the deadline, a fresh holder waits for it, not for a new full timeout.
    let mut j = Joiner::new(Duration::from_secs(300));
    j.registration(registration(&["a"]), props(), 1, 100);
    assert_eq!(j.next_deadline(), Some(DEADLINE));
}

#[test]
fn a_completion_before_its_registration_waits_for_it_until_its_deadline() {
    let mut j = Joiner::new(Duration::from_secs(300));
    // The supervisor died after publishing its subagents, before registering: their
    // completions wait.
    assert!(j.completion(completion("a", "A"), 1, 0).is_empty());
    assert_eq!(j.next_deadline(), Some(DEADLINE));
    // Its redelivered iteration registers the same correlation: the orphan is adopted.
    let (joins, acked) = split(j.registration(registration(&["a"]), props(), 2, 5));
    assert!(acked.is_empty());
    assert_eq!(joins.len(), 1);
    assert_eq!(joins[0].results["a"], "A");
    assert_eq!(joins[0].tokens, [2, 1]);
    // An orphan nobody registers is dropped at its deadline.
    let mut orphan = completion("x", "X");
    orphan.correlation_id = "c2".into();
    j.completion(orphan, 3, 6);
    assert!(j.tick(DEADLINE - 1).is_empty());
    let steps = j.tick(DEADLINE);
    assert!(matches!(steps[..], [Step::Ack(3, Event::DroppedOrphan)]));
    assert_eq!(j.next_deadline(), None);
}

#[test]
fn a_second_registration_replaces_the_first_and_keeps_its_answers() {
    let mut j = Joiner::new(Duration::from_secs(300));
    j.registration(registration(&["a", "b"]), props(), 1, 0);
    j.completion(completion("a", "A"), 2, 1);
    let later = BTreeMap::from([
        ("id".to_owned(), "dialog".to_owned()),
        ("sluice-continues".to_owned(), "attempt-2".to_owned()),
    ]);
    j.registration(registration(&["a", "b"]), later.clone(), 3, 2);
    let (joins, _) = split(j.completion(completion("b", "B"), 4, 3));
    assert_eq!(
        joins[0].properties, later,
        "the attempt the client follows now"
    );
    assert_eq!(joins[0].tokens, [1, 2, 3, 4]);
}

#[test]
fn a_completion_request_reads_back_as_its_completion() {
    let subagent = AgentRequest {
        question: "goal a".into(),
        correlation_id: Some("c1".into()),
        subagent_goal: Some("goal a".into()),
        expected_siblings: Some(2),
        deadline_ms: Some(DEADLINE),
        ..AgentRequest::default()
    };
    let request = Completion::request(&subagent, Ok("A".into()), (Some(3), Some(4)));
    let wire = serde_json::to_vec(&request).unwrap();
    let Some(Incoming::Completion(c)) = decode(&wire) else {
        panic!("a completion");
    };
    assert_eq!(c.goal, "goal a");
    assert_eq!(c.result, Ok("A".into()));
    assert_eq!(c.usage, (Some(3), Some(4)));
    let failed = Completion::request(&subagent, Err("boom".into()), (None, None));
    let Some(Incoming::Completion(c)) = decode(&serde_json::to_vec(&failed).unwrap()) else {
        panic!("a completion");
    };
    assert_eq!(c.result, Err("boom".into()));
    let reg = registration(&["a"]);
    let Some(Incoming::Registration(r)) = decode(&reg.encode().unwrap()) else {
        panic!("a registration");
    };
    assert_eq!(*r, reg);
    assert!(decode(br#"{"question": "not a completion"}"#).is_none());
}
