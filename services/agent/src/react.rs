//! The streaming ReAct parser (placeholder API; the full parser replaces this file).

use std::collections::BTreeMap;

/// A parse event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Thought text.
    Thought(String),
    /// The thought ended.
    ThoughtEnd,
    /// The action is complete.
    Action {
        /// Tool name.
        name: String,
        /// Arguments.
        arguments: BTreeMap<String, String>,
    },
    /// Answer text.
    Answer(String),
}

/// What the model decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Call a tool.
    Action {
        /// The thought.
        thought: String,
        /// Tool name.
        name: String,
        /// Arguments.
        arguments: BTreeMap<String, String>,
    },
    /// The final answer.
    Answer {
        /// The thought.
        thought: String,
        /// The answer.
        answer: String,
    },
}

/// Why the output could not be parsed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

/// The parser.
#[derive(Debug, Default)]
pub struct ReactParser {
    text: String,
}

impl ReactParser {
    /// A parser.
    pub fn new() -> Self {
        Self::default()
    }
    /// Feeds a delta.
    pub fn push(&mut self, delta: &str) -> Vec<Event> {
        self.text.push_str(delta);
        Vec::new()
    }
    /// Ends the output.
    pub fn finish(self) -> Result<Outcome, ParseError> {
        Err(ParseError(format!(
            "placeholder ({} bytes)",
            self.text.len()
        )))
    }
}
