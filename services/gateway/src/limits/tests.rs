use super::{
    clock::{civil_month, days_from_civil},
    share::{SNAPSHOT_SEAL_BYTES, Snapshot, Which},
    *,
};
use crate::keys::{KeyRing, hash_hex};

fn key(limits: &str) -> Key {
    let text = format!(
        "[[keys]]\nname = \"k\"\nsha256 = \"{}\"\n{limits}\n",
        hash_hex("x")
    );
    (*KeyRing::parse(&text).unwrap().find("x").unwrap()).clone()
}

fn limiter() -> Arc<Limiter> {
    let registry = prometheus::Registry::new();
    Arc::new(Limiter::new(GatewayMetrics::register(&registry).unwrap()))
}

/// A request naming `max_tokens` (else the key's `reserve_tokens`) with an empty body.
fn req(max_tokens: Option<u64>) -> Ask {
    Ask::Request {
        max_tokens,
        body_bytes: 0,
    }
}

/// 2026-11-28 10:00:30 UTC.
const T: f64 = 1_795_860_030.0;

#[test]
fn months_and_days_are_utc_calendar_ones() {
    assert_eq!(civil_month(0), (1970, 1));
    assert_eq!(days_from_civil(2026, 11, 28), 20_785);
    assert_eq!(civil_month(20_785), (2026, 11));
    assert_eq!(civil_month(days_from_civil(2024, 2, 29)), (2024, 2));
    assert_eq!(civil_month(days_from_civil(2024, 3, 1)), (2024, 3));
    let now = Now::at(T);
    assert_eq!(now.day, 20_785);
    assert_eq!(now.secs_to_next_day(), 13.0 * 3600.0 + 59.0 * 60.0 + 30.0);
    // December 1st, 00:00.
    assert_eq!(
        now.secs_to_next_month(),
        2.0 * 86_400.0 + 13.0 * 3600.0 + 59.0 * 60.0 + 30.0
    );
}

#[test]
fn requests_per_minute_slide_and_say_when_to_retry() {
    let l = limiter();
    let k = key("requests_per_minute = 3");
    let now = Now::at(T);
    let held: Vec<_> = (0..3)
        .map(|_| l.admit_at(&k, req(None), now).unwrap())
        .collect();
    let refused = l.admit_at(&k, req(None), now).err().unwrap();
    assert_eq!(refused.what, "requests");
    // 30 s into the minute, 3 used of 3: in the next minute these 3 weigh until a third
    // of it has passed, 30 + 20 s.
    assert_eq!(refused.retry_after, Some(50));
    for a in held {
        l.settle(&a, now);
        std::mem::forget(a);
    }
    // 15 s into the next minute the previous one still weighs 3 * 0.75: 2.25 + 1 > 3.
    let later = Now::at(T + 45.0);
    let refused = l.admit_at(&k, req(None), later).err().unwrap();
    // Room for one at 1/3 into the minute, 20 s; 15 s are gone.
    assert_eq!(refused.retry_after, Some(5));
    assert!(l.admit_at(&k, req(None), Now::at(T + 51.0)).is_ok());
}

#[test]
fn tokens_are_reserved_then_settled_with_what_was_used() {
    let l = limiter();
    let k = key("tokens_per_minute = 1000\ntokens_per_day = 1500");
    let now = Now::at(T);
    let mut a = l.admit_at(&k, req(Some(800)), now).unwrap();
    let refused = l.admit_at(&k, req(Some(300)), now).err().unwrap();
    assert_eq!(refused.what, "tokens");
    assert!(!refused.quota);
    a.tokens(20, 30);
    a.ended();
    l.settle(&a, now);
    std::mem::forget(a);
    // 50 used; 950 left this minute, 1450 today.
    let mut b = l.admit_at(&k, req(Some(900)), now).unwrap();
    b.tokens(0, 0);
    b.ended();
    l.settle(&b, now);
    std::mem::forget(b);
    // The reservation settled to nothing: 50 used today. An hour later 1000 are used.
    let next_hour = Now::at(T + 3600.0);
    let mut big = l.admit_at(&k, req(Some(1000)), next_hour).unwrap();
    big.tokens(400, 600);
    big.ended();
    l.settle(&big, next_hour);
    std::mem::forget(big);
    let later = Now::at(T + 3720.0);
    let refused = l.admit_at(&k, req(Some(500)), later).err().unwrap();
    assert!(refused.quota);
    assert!(
        refused
            .message
            .contains("used 1050 of its 1500 tokens this day"),
        "{}",
        refused.message
    );
    // 11:02:30 to midnight.
    assert_eq!(refused.retry_after, Some(12 * 3600 + 57 * 60 + 30));
    let too_big = l.admit_at(&k, req(Some(1001)), later).err().unwrap();
    assert_eq!(too_big.retry_after, None);
}

#[test]
fn an_answer_cut_short_costs_its_reservation_and_a_long_one_counts_when_it_ends() {
    let l = limiter();
    let k = key("tokens_per_minute = 1000\ntokens_per_day = 100000");
    let now = Now::at(T);
    // Cut short before its usage arrived: charged the reservation, not the 5 reported.
    let mut cut = l.admit_at(&k, req(Some(600)), now).unwrap();
    cut.tokens(5, 0);
    l.settle(&cut, now);
    std::mem::forget(cut);
    assert!(
        l.admit_at(&k, req(Some(500)), now).is_err(),
        "600 held of 1000"
    );
    // Admitted at T, ended three minutes later with 5000 used: those count now.
    let mut long = l.admit_at(&k, req(Some(100)), now).unwrap();
    long.tokens(1000, 4000);
    long.ended();
    let later = Now::at(T + 180.0);
    l.settle(&long, later);
    std::mem::forget(long);
    let refused = l.admit_at(&k, req(Some(10)), later).err().unwrap();
    assert!(
        refused.message.contains("1000 tokens per minute"),
        "{}",
        refused.message
    );
}

#[test]
fn the_longest_wait_is_the_one_told_and_a_reservation_over_a_quota_gets_none() {
    let l = limiter();
    let k = key("requests_per_minute = 1\ntokens_per_day = 100");
    let now = Now::at(T);
    let mut a = l.admit_at(&k, req(Some(90)), now).unwrap();
    a.tokens(90, 0);
    a.ended();
    l.settle(&a, now);
    std::mem::forget(a);
    // Over both the minute's requests and the day's tokens: the day's wait is told.
    let refused = l.admit_at(&k, req(Some(20)), now).err().unwrap();
    assert!(refused.quota);
    assert_eq!(refused.retry_after, Some(13 * 3600 + 59 * 60 + 30));
    let never = l
        .admit_at(&k, req(Some(101)), Now::at(T + 86_400.0))
        .err()
        .unwrap();
    assert_eq!(never.retry_after, None);
}

/// The fuzz target's reader judges what it reads as a replica does: a snapshot of a known
/// key is taken, one of another key refused, and a flood of replicas stays capped.
#[test]
fn the_fuzz_snapshot_reader_takes_what_a_replica_takes_and_caps_replicas() {
    let reader = SnapshotReader::new().unwrap();
    let now = Now::at(T);
    let counts = Counts::default().at(&now);
    let snapshot = |replica: &str, key: &str| {
        serde_json::to_vec(&Snapshot {
            replica: replica.into(),
            key: key.into(),
            seq: 1,
            counts,
            sent_ms: 0,
        })
        .unwrap()
    };
    assert_eq!(reader.read(&snapshot("r0", "k"), T as u32), (None, 1));
    assert_eq!(
        reader.read(&snapshot("r0", "nobody"), T as u32).0,
        Some("unknown-key")
    );
    assert_eq!(reader.read(b"{", T as u32).0, Some("malformed"));
    for i in 1..2 * MAX_REPLICAS_PER_KEY {
        let (_, most) = reader.read(&snapshot(&format!("r{i}"), "k"), T as u32);
        assert!(most <= MAX_REPLICAS_PER_KEY + 1, "{most}");
    }
}

#[test]
fn a_snapshot_from_far_ahead_is_not_taken() {
    let l = limiter();
    let k = key("requests_per_minute = 1");
    let now = Now::wall();
    let taken = l.take(
        Snapshot {
            replica: "elsewhere".into(),
            key: "k".into(),
            seq: 1,
            counts: Counts {
                minute: u64::MAX,
                requests: u64::MAX,
                day: now.day,
                month: u64::MAX,
                ..Counts::default()
            },
            sent_ms: 0,
        },
        &now,
    );
    assert_eq!(taken, Err("ahead"));
    assert!(l.admit(&k, req(None)).is_ok());
}

#[test]
fn other_replicas_snapshots_count_and_an_older_one_is_ignored() {
    let a = limiter();
    let b = limiter();
    let k = key("requests_per_minute = 4");
    let now = Now::wall();
    let _held: Vec<_> = (0..3).map(|_| b.admit(&k, req(None)).unwrap()).collect();
    let snaps = b.snapshots(Which::Changed);
    assert_eq!(snaps.len(), 1);
    let (message_key, snap) = &snaps[0];
    assert_eq!(message_key, &format!("k/{}", b.replica));
    let older = Snapshot {
        replica: snap.replica.clone(),
        key: "k".into(),
        seq: snap.seq - 1,
        counts: Counts::default(),
        sent_ms: 0,
    };
    let json = serde_json::to_vec(snap).unwrap();
    a.take(serde_json::from_slice(&json).unwrap(), &now)
        .unwrap();
    a.take(older, &now).unwrap();
    assert_eq!(a.live_peers(&now), 1);
    let _one = a.admit(&k, req(None)).unwrap();
    assert!(a.admit(&k, req(None)).is_err(), "3 on b and 1 on a make 4");
    // A replica ignores its own snapshots read back from the topic.
    let before = b.snapshots(Which::Changed).len();
    b.take(serde_json::from_slice(&json).unwrap(), &now)
        .unwrap();
    assert_eq!(before, 0);
    assert_eq!(b.live_peers(&now), 0);
}

#[test]
fn a_key_without_limits_is_counted_but_not_shared() {
    let l = limiter();
    let k = key("");
    for _ in 0..100 {
        drop(l.admit(&k, req(None)).unwrap());
    }
    assert!(l.snapshots(Which::Changed).is_empty());
}

#[test]
fn counts_roll_into_the_previous_minute_and_out_of_the_day() {
    let now = Now::at(T);
    let c = Counts {
        minute: now.minute,
        requests: 5,
        tokens: 50,
        prev_requests: 1,
        prev_tokens: 10,
        day: now.day,
        day_tokens: 500,
        month: now.month,
        month_tokens: 5000,
        in_flight: 0,
    };
    let next = c.at(&Now::at(T + 60.0));
    assert_eq!((next.requests, next.prev_requests), (0, 5));
    assert_eq!(next.day_tokens, 500);
    let gone = c.at(&Now::at(T + 120.0));
    assert_eq!((gone.requests, gone.prev_requests), (0, 0));
    let tomorrow = c.at(&Now::at(T + 86_400.0));
    assert_eq!((tomorrow.day_tokens, tomorrow.month_tokens), (0, 5000));
}

#[test]
fn an_estimate_of_the_input_is_reserved_besides_max_tokens() {
    let l = limiter();
    let k = key("tokens_per_minute = 1000");
    let now = Now::at(T);
    let body = |max_tokens, body_bytes| Ask::Request {
        max_tokens: Some(max_tokens),
        body_bytes,
    };
    // 2000 bytes are about 500 tokens of input: 900 held.
    let _held = l.admit_at(&k, body(400, 2000), now).unwrap();
    // 50 and about 100 more do not fit in the 100 left.
    let refused = l.admit_at(&k, body(50, 400), now).err().unwrap();
    assert!(
        refused.message.contains("this request reserves 150"),
        "{}",
        refused.message
    );
    assert!(l.admit_at(&k, body(50, 200), now).is_ok());
    // A body that alone is more than the minute allows never fits.
    let never = l
        .admit_at(&k, body(1, 4000), Now::at(T + 600.0))
        .err()
        .unwrap();
    assert_eq!(never.retry_after, None);
    assert!(
        never.message.contains("about 1000 for its input"),
        "{}",
        never.message
    );
    assert_eq!(input_estimate(0), 0);
    assert_eq!(input_estimate(1), 1);
    assert_eq!(input_estimate(8), 2);
}

#[test]
fn an_answer_that_ends_without_usage_costs_its_reservation() {
    let l = limiter();
    let k = key("tokens_per_day = 1000");
    let now = Now::at(T);
    // Its terminal record came, but no record said what it used (a provider that does
    // not report usage): the 600 held are charged, not nothing.
    let mut silent = l.admit_at(&k, req(Some(600)), now).unwrap();
    silent.ended();
    l.settle(&silent, now);
    std::mem::forget(silent);
    let refused = l.admit_at(&k, req(Some(500)), now).err().unwrap();
    assert!(
        refused.message.contains("used 600 of its 1000"),
        "{}",
        refused.message
    );
    // One that says it used nothing costs nothing.
    let mut nothing = l.admit_at(&k, req(Some(100)), now).unwrap();
    nothing.tokens(0, 0);
    nothing.ended();
    l.settle(&nothing, now);
    std::mem::forget(nothing);
    assert!(l.admit_at(&k, req(Some(400)), now).is_ok());
}

#[test]
fn concurrent_requests_hold_their_places_until_they_end_on_every_replica() {
    let l = limiter();
    let k = key("concurrent_requests = 2");
    let now = Now::wall();
    let a = l.admit_at(&k, req(None), now).unwrap();
    let b = l.admit_at(&k, req(None), now).unwrap();
    let refused = l.admit_at(&k, req(None), now).err().unwrap();
    assert!(refused.concurrent && !refused.quota);
    assert_eq!(refused.retry_after, Some(1));
    assert!(
        refused.message.contains("2 requests in flight"),
        "{}",
        refused.message
    );
    drop(a);
    let c = l.admit_at(&k, req(None), now).unwrap();
    drop(c);
    // Another replica's places count while its snapshots are fresh, and not after: a
    // replica that died must not hold them for good.
    let peer = |minute: u64| Snapshot {
        replica: "other".into(),
        key: "k".into(),
        seq: minute,
        counts: Counts {
            minute,
            day: now.day,
            month: now.month,
            in_flight: 1,
            ..Counts::default()
        },
        sent_ms: 0,
    };
    l.take(peer(now.minute - 3), &now).unwrap();
    let d = l.admit_at(&k, req(None), now).unwrap();
    l.take(peer(now.minute), &now).unwrap();
    assert!(l.admit_at(&k, req(None), now).err().unwrap().concurrent);
    drop(d);
    assert!(
        l.admit_at(&k, req(None), now).is_err(),
        "one here, one there"
    );
    drop(b);
    assert!(l.admit_at(&k, req(None), now).is_ok());
}

#[test]
fn a_resume_counts_a_request_and_a_place_but_no_tokens_and_is_capped() {
    let l = limiter();
    let k = key("requests_per_minute = 100\ntokens_per_day = 10");
    let now = Now::at(T);
    let mut used = l.admit_at(&k, req(Some(10)), now).unwrap();
    used.tokens(4, 6);
    used.ended();
    l.settle(&used, now);
    std::mem::forget(used);
    // The day's tokens are gone: a new request is refused, the rest of a stream is not.
    assert!(l.admit_at(&k, req(Some(1)), now).err().unwrap().quota);
    let mut resumed = l.admit_at(&k, Ask::Resume, now).unwrap();
    // The records it reads again were counted when they were first read.
    resumed.tokens(4, 6);
    resumed.ended();
    l.settle(&resumed, now);
    std::mem::forget(resumed);
    let refused = l.admit_at(&k, req(Some(1)), now).err().unwrap();
    assert!(
        refused.message.contains("used 10 of its 10"),
        "{}",
        refused.message
    );
    // At most RESUMES_PER_KEY at once.
    let held: Vec<_> = (0..RESUMES_PER_KEY)
        .map(|_| l.admit_at(&k, Ask::Resume, now).unwrap())
        .collect();
    let capped = l.admit_at(&k, Ask::Resume, now).err().unwrap();
    assert!(capped.concurrent);
    assert!(
        capped.message.contains("resuming 8 streams"),
        "{}",
        capped.message
    );
    for a in held {
        l.settle(&a, now);
        std::mem::forget(a);
    }
    assert!(l.admit_at(&k, Ask::Resume, now).is_ok());
    // Each was a request: 1 + 1 + 8 + 1 of 100 this minute.
    let k = key("requests_per_minute = 2");
    let l = limiter();
    let _one = l.admit_at(&k, Ask::Resume, now).unwrap();
    let _two = l.admit_at(&k, Ask::Resume, now).unwrap();
    assert_eq!(
        l.admit_at(&k, Ask::Resume, now).err().unwrap().what,
        "requests"
    );
}

const SECRET: &str = "0123456789abcdef0123456789abcdef";

/// What replicas given `SECRET` and a keys file of `names` share with.
fn sharing(secret: &str, names: &[&str]) -> Sharing {
    let text: String = names
        .iter()
        .map(|n| format!("[[keys]]\nname = \"{n}\"\nsha256 = \"{}\"\n", hash_hex(n)))
        .collect();
    Sharing {
        seal: SealKey::new(&sluice_runtime::secret::Secret::new(secret), "test").unwrap(),
        keys: Arc::new(Keys::fixed(KeyRing::parse(&text).unwrap())),
    }
}

/// A snapshot's payload and its seal under `with`.
fn sealed(with: &Sharing, snapshot: &Snapshot) -> (Vec<u8>, String) {
    let payload = serde_json::to_vec(snapshot).unwrap();
    let seal = with
        .seal
        .seal(SNAPSHOT_SEAL, &[&payload])
        .encode(SNAPSHOT_SEAL_BYTES);
    (payload, seal)
}

fn refusals(l: &Limiter, reason: &str) -> u64 {
    l.metrics.snapshot_refusals(reason)
}

/// Forged snapshots of every kind change nothing: one that would lock a key out, one that
/// would erase a replica's usage, one that would grow the replicas without bound, one
/// whose sequence number would make the replica's real ones read as old, one of a key
/// that is not in the keys file. A real one is taken.
#[test]
fn only_snapshots_sealed_by_a_replica_of_a_known_key_are_believed() {
    let shared = sharing(SECRET, &["k"]);
    let (a, b) = (limiter(), limiter());
    let k = key("requests_per_minute = 4");
    let now = Now::wall();
    let held: Vec<_> = (0..3).map(|_| b.admit(&k, req(None)).unwrap()).collect();
    let (_, real) = b.snapshots(Which::Changed).pop().unwrap();
    let (payload, seal) = sealed(&shared, &real);
    assert_eq!(a.receive(&payload, Some(&seal), &shared, &now), Ok(()));
    assert_eq!(a.live_peers(&now), 1);
    // What a holds: 3 of b's and room for 1.
    let holds = |a: &Arc<Limiter>| {
        let one = a.admit(&k, req(None));
        let two = a.admit(&k, req(None));
        one.is_ok() && two.is_err()
    };
    let lockout = Snapshot {
        replica: "forger".into(),
        key: "k".into(),
        seq: 1,
        counts: Counts {
            minute: now.minute,
            requests: 1_000_000,
            day: now.day,
            month: now.month,
            month_tokens: u64::MAX / 2,
            ..Counts::default()
        },
        sent_ms: 0,
    };
    let erase = Snapshot {
        replica: real.replica.clone(),
        key: "k".into(),
        seq: real.seq + 1,
        counts: Counts::default().at(&now),
        sent_ms: 0,
    };
    let stranger = sharing("fedcba9876543210fedcba9876543210", &["k"]);
    for forged in [&lockout, &erase] {
        let (payload, _) = sealed(&shared, forged);
        assert_eq!(a.receive(&payload, None, &shared, &now), Err("unsealed"));
        let (payload, seal) = sealed(&stranger, forged);
        assert_eq!(a.receive(&payload, Some(&seal), &shared, &now), Err("seal"));
        // A real seal on other bytes.
        let (_, real_seal) = sealed(&shared, &real);
        assert_eq!(
            a.receive(&payload, Some(&real_seal), &shared, &now),
            Err("seal")
        );
    }
    // Sealed, yet not believed: a number far ahead of the clock (with the secret, say
    // a replica's own bug), a key not in the file, bytes that are not a snapshot.
    let jump = Snapshot {
        seq: u64::MAX,
        ..erase
    };
    let (payload, seal) = sealed(&shared, &jump);
    assert_eq!(a.receive(&payload, Some(&seal), &shared, &now), Err("seq"));
    let unknown = Snapshot {
        key: "not-in-the-file".into(),
        ..lockout
    };
    let (payload, seal) = sealed(&shared, &unknown);
    assert_eq!(
        a.receive(&payload, Some(&seal), &shared, &now),
        Err("unknown-key")
    );
    let garbage = b"{\"replica\": 1}".to_vec();
    let seal = shared
        .seal
        .seal(SNAPSHOT_SEAL, &[&garbage])
        .encode(SNAPSHOT_SEAL_BYTES);
    assert_eq!(
        a.receive(&garbage, Some(&seal), &shared, &now),
        Err("malformed")
    );
    // A resume token's seal of the same bytes is not a snapshot's.
    let other_use = shared
        .seal
        .seal(Label::new("sluice/gateway/resume-token/v2"), &[&payload])
        .encode(SNAPSHOT_SEAL_BYTES);
    assert_eq!(
        a.receive(&payload, Some(&other_use), &shared, &now),
        Err("seal")
    );
    // Many replicas, unsealed: none is kept.
    for i in 0..1000 {
        let many = Snapshot {
            replica: format!("r{i}"),
            key: "k".into(),
            seq: 1,
            counts: Counts::default().at(&now),
            sent_ms: 0,
        };
        let (payload, _) = sealed(&shared, &many);
        assert!(a.receive(&payload, None, &shared, &now).is_err());
    }
    assert_eq!(a.live_peers(&now), 1);
    assert_eq!(a.lock().peers["k"].len(), 1);
    assert!(holds(&a), "b's 3 still count, and nothing else");
    assert_eq!(refusals(&a, "unsealed"), 1002);
    assert_eq!(refusals(&a, "seal"), 5);
    assert_eq!(refusals(&a, "seq"), 1);
    assert_eq!(refusals(&a, "unknown-key"), 1);
    assert_eq!(refusals(&a, "malformed"), 1);
    // b's next real snapshot is still taken after the number that jumped.
    drop(held);
    let (_, next) = b.snapshots(Which::Changed).pop().unwrap();
    let (payload, seal) = sealed(&shared, &next);
    assert_eq!(a.receive(&payload, Some(&seal), &shared, &now), Ok(()));
    assert_eq!(a.lock().peers["k"][&real.replica].1.requests, 3);
    assert_eq!(a.lock().peers["k"][&real.replica].1.in_flight, 0);
}

/// At most MAX_REPLICAS_PER_KEY replicas of a key are kept; the gone ones' day and month
/// usage is folded into one sum to make room, so that nothing they used is forgotten.
#[test]
fn replicas_of_a_key_are_capped_and_gone_ones_are_folded_not_forgotten() {
    let shared = sharing(SECRET, &["k"]);
    let l = limiter();
    let k = key("tokens_per_day = 1000000");
    let now = Now::wall();
    let snapshot = |i: usize, minute: u64| Snapshot {
        replica: format!("r{i}"),
        key: "k".into(),
        seq: 1,
        counts: Counts {
            minute,
            day: now.day,
            month: now.month,
            day_tokens: 1000,
            month_tokens: 1000,
            ..Counts::default()
        },
        sent_ms: 0,
    };
    let receive = |s: &Snapshot| {
        let (payload, seal) = sealed(&shared, s);
        l.receive(&payload, Some(&seal), &shared, &now)
    };
    // Half of them long gone, half live.
    for i in 0..MAX_REPLICAS_PER_KEY {
        let minute = if i % 2 == 0 {
            now.minute - GONE_AFTER - 1 - i as u64
        } else {
            now.minute
        };
        assert_eq!(receive(&snapshot(i, minute)), Ok(()));
    }
    let used = |l: &Arc<Limiter>| {
        let refused = l
            .admit(&k, req(Some(1_000_000)))
            .err()
            .expect("refused: the quota is used");
        refused.message
    };
    let before = used(&l);
    assert!(before.contains("used 64000 of"), "{before}");
    // More replicas: gone ones make room, their usage kept.
    for i in MAX_REPLICAS_PER_KEY..MAX_REPLICAS_PER_KEY + MAX_REPLICAS_PER_KEY / 2 {
        assert_eq!(receive(&snapshot(i, now.minute)), Ok(()));
    }
    let peers = l.lock().peers["k"].len();
    assert_eq!(peers, MAX_REPLICAS_PER_KEY + 1, "the replicas and the sum");
    assert!(used(&l).contains("used 96000 of"), "{}", used(&l));
    // Every one live: no room, and what is refused is counted.
    assert_eq!(receive(&snapshot(1000, now.minute)), Err("replicas"));
    assert_eq!(refusals(&l, "replicas"), 1);
    assert_eq!(l.live_peers(&now), MAX_REPLICAS_PER_KEY);
}

#[test]
fn the_gauges_say_what_a_key_has_in_flight_and_used_on_all_replicas_as_last_heard() {
    let registry = prometheus::Registry::new();
    let l = Arc::new(Limiter::new(GatewayMetrics::register(&registry).unwrap()));
    let gauge = |name: &str, period: Option<&str>| -> i64 {
        let families = registry.gather();
        let Some(family) = families.iter().find(|f| f.name() == name) else {
            return -1;
        };
        family
            .get_metric()
            .iter()
            .find(|m| {
                m.get_label()
                    .iter()
                    .all(|l| (l.name() == "key" && l.value() == "k") || Some(l.value()) == period)
            })
            .map_or(-1, |m| m.get_gauge().get_value() as i64)
    };
    let k = key("tokens_per_day = 1000");
    let now = Now::at(T);
    let mut a = l.admit_at(&k, req(Some(100)), now).unwrap();
    // Its own request at once: in flight, its reservation counted.
    assert_eq!(gauge("sluice_gateway_key_in_flight", None), 1);
    assert_eq!(
        gauge("sluice_gateway_key_quota_used_tokens", Some("day")),
        100
    );
    // A peer's snapshot as soon as it is read: two of its requests in flight, 50 used.
    let peer = |seq: u64, in_flight: u64, day_tokens: u64| Snapshot {
        replica: "other".into(),
        key: "k".into(),
        seq,
        counts: Counts {
            minute: now.minute,
            day: now.day,
            month: now.month,
            day_tokens,
            month_tokens: day_tokens,
            in_flight,
            ..Counts::default()
        },
        sent_ms: 0,
    };
    l.take(peer(1, 2, 50), &now).unwrap();
    assert_eq!(gauge("sluice_gateway_key_in_flight", None), 3);
    assert_eq!(
        gauge("sluice_gateway_key_quota_used_tokens", Some("month")),
        150
    );
    // Settled with what it used, and the peer's settled too: nothing in flight, the day's
    // usage exactly what the requests used.
    a.tokens(3, 4);
    a.ended();
    l.settle(&a, now);
    std::mem::forget(a);
    l.take(peer(2, 0, 20), &now).unwrap();
    assert_eq!(gauge("sluice_gateway_key_in_flight", None), 0);
    assert_eq!(
        gauge("sluice_gateway_key_quota_used_tokens", Some("day")),
        27
    );
    // An older snapshot read late changes nothing.
    l.take(peer(1, 2, 50), &now).unwrap();
    assert_eq!(gauge("sluice_gateway_key_in_flight", None), 0);
    // A peer not heard of for two minutes holds no place in flight; its tokens still count.
    l.take(peer(3, 5, 30), &now).unwrap();
    l.export_all(&Now::at(T + 180.0));
    assert_eq!(gauge("sluice_gateway_key_in_flight", None), 0);
    assert_eq!(
        gauge("sluice_gateway_key_quota_used_tokens", Some("day")),
        37
    );
}
