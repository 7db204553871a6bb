//! The agent's streaming ReAct parser. Properties: no panic; the outcome is the same
//! however the output is split into deltas (and the same as `react::parse` of the whole);
//! the thought and answer deltas concatenate to the outcome's thought and answer.

use sluice_agent::react::{self, Event, Outcome, ReactParser};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        let text = String::from_utf8_lossy(input.body);
        let whole = react::parse(&text);
        let mut parser = ReactParser::new();
        let mut events = Vec::new();
        for piece in sluice_fuzz::text_chunks(&text, input.split) {
            events.extend(parser.push(piece));
        }
        events.extend(parser.close());
        let split = parser.finish();
        assert_eq!(whole, split, "the split changed the outcome");
        let (mut thought, mut answer) = (String::new(), String::new());
        for e in &events {
            match e {
                Event::Thought(t) => thought.push_str(t),
                Event::Answer(a) => answer.push_str(a),
                _ => {}
            }
        }
        match &split {
            Ok(Outcome::Answer {
                thought: t,
                answer: a,
            }) => {
                assert_eq!(&thought, t, "thought deltas differ from the thought");
                assert_eq!(&answer, a, "answer deltas differ from the answer");
            }
            Ok(Outcome::Action { thought: t, .. }) => {
                assert_eq!(&thought, t, "thought deltas differ from the thought");
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    });
}
