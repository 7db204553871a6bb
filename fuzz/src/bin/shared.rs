//! What the gateway and the ledger read from others: a resume token (the `Sluice-Resume`
//! header, through the gateway's reading of it), a keys file (`--keys-file`, as the gateway
//! parses and uses it), a limit snapshot (a payload of the shared limits topic, judged and
//! taken by a replica as it reads the topic, then a request admitted against it) and a usage
//! record (the ledger's, as `sluice usage` reads and prints it). The selector byte picks one.
//! Properties: no panic and no overflow (the fuzz profile checks them); a token read is sealed
//! and read back to the same, the seal it came with never verifying; a replica never holds
//! more than `MAX_REPLICAS_PER_KEY` replicas of a key (and the retired ones' fold); a usage
//! record printed reads back to the same record (its cost to within a relative 1e-15: see
//! `usage_record`).

use std::cell::RefCell;

use sluice_gateway::{
    ServiceKind,
    fuzzing::{MAX_REPLICAS_PER_KEY, SnapshotReader},
    keys::KeyRing,
};
use sluice_runtime::{seal::SealKey, secret::Secret};
use sluice_schema::UsageRecord;

thread_local! {
    static READER: RefCell<Option<SnapshotReader>> = const { RefCell::new(None) };
}

fn resume_token(body: &[u8]) {
    let key = SealKey::new(&Secret::new("the-fuzz-targets-resume-secret-0123"), "fuzz")
        .unwrap_or_else(|e| panic!("seal key: {e}"));
    assert_ne!(
        sluice_gateway::fuzzing::resume_round_trip(body, &key),
        Some(false),
        "a resume token that does not read back as itself, or a seal sent that verifies"
    );
}

fn keys_file(body: &[u8]) {
    let Ok(text) = std::str::from_utf8(body) else {
        return;
    };
    let Ok(ring) = KeyRing::parse(text) else {
        return;
    };
    // What a request does with the keys: find one by its secret, ask what it may do.
    for bearer in ["", "k", "sk-alpha", text] {
        if let Some(key) = ring.find(bearer) {
            for kind in [
                ServiceKind::TextCompletion,
                ServiceKind::Prompt,
                ServiceKind::Agent,
            ] {
                let _ = key.refuses(kind, "default", Some("m"));
                let _ = key.refuses(kind, "default", None);
            }
            let _ = (key.tool_groups(), key.operator_fields(), &key.limits);
        }
    }
}

fn limit_snapshot(split: u8, body: &[u8]) {
    READER.with(|cell| {
        let mut slot = cell.borrow_mut();
        let reader = slot.get_or_insert_with(|| {
            SnapshotReader::new().unwrap_or_else(|e| panic!("snapshot reader: {e}"))
        });
        // 2026-11-28 10:00:30 UTC, moved by the split byte (minutes, days), so that snapshots
        // land in this minute, the next and far from it.
        let now = 1_795_860_030 + u32::from(split) * 3_607;
        let (_, most) = reader.read(body, now);
        assert!(
            most <= MAX_REPLICAS_PER_KEY + 1,
            "{most} replicas of a key held"
        );
    });
}

fn usage_record(body: &[u8]) {
    let Ok(record) = serde_json::from_slice::<UsageRecord>(body) else {
        return;
    };
    let printed = serde_json::to_string(&record).unwrap_or_else(|e| panic!("printing: {e}"));
    let mut again: UsageRecord =
        serde_json::from_str(&printed).unwrap_or_else(|e| panic!("{printed}: {e}"));
    // serde_json (without its float_roundtrip feature) reads a decimal to within one unit in
    // the last place, not always to the nearest double: "1.23e-26" read, printed shortest
    // (1.2300000000000001e-26) and read again is one unit away. A cost is money to a few
    // decimals, so the ledger promises that much: the cost within a relative 1e-15, every
    // other field exactly.
    if let (Some(a), Some(b)) = (again.cost, record.cost) {
        let close = a == b || (a - b).abs() <= 1e-15 * a.abs().max(b.abs());
        assert!(close, "cost {b} read back as {a}: {printed}");
        again.cost = record.cost;
    }
    assert_eq!(again, record, "{printed}");
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        match input.selector % 4 {
            0 => resume_token(input.body),
            1 => keys_file(input.body),
            2 => limit_snapshot(input.split, input.body),
            _ => usage_record(input.body),
        }
    });
}
