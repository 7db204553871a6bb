//! The records read off the bus and from clients: the three request records (text-completion,
//! prompt, agent) and the three response records a client reads. Properties: no panic, and a
//! record that parses round-trips (written and read again, it is the same record).

use serde::{Serialize, de::DeserializeOwned};
use sluice_schema::{
    AgentRequest, AgentResponse, PromptRequest, PromptResponse, ResponseRecord,
    TextCompletionRequest, TextCompletionResponse,
};

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    body: &[u8],
) -> Option<T> {
    let record: T = serde_json::from_slice(body).ok()?;
    let written = serde_json::to_vec(&record).unwrap_or_else(|e| panic!("cannot write: {e}"));
    let again: T = serde_json::from_slice(&written)
        .unwrap_or_else(|e| panic!("a written record does not read back: {e}"));
    assert_eq!(record, again, "round trip changed the record");
    Some(record)
}

fn response<T: ResponseRecord + Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    body: &[u8],
) {
    if let Some(r) = round_trip::<T>(body) {
        let _ = r.is_terminal();
        if let Some(e) = r.error() {
            let _ = e.known_kind();
        }
    }
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        match input.selector % 6 {
            0 => drop(round_trip::<TextCompletionRequest>(input.body)),
            1 => drop(round_trip::<PromptRequest>(input.body)),
            2 => drop(round_trip::<AgentRequest>(input.body)),
            3 => response::<TextCompletionResponse>(input.body),
            4 => response::<PromptResponse>(input.body),
            _ => response::<AgentResponse>(input.body),
        }
    });
}
