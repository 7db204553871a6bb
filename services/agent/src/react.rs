//! The streaming parser of the model's ReAct output: it turns the text deltas of one
//! model response into thought, action and answer events as the tokens arrive, and into
//! one [`Outcome`] (or a [`ParseError`] to show the model) when the response ends.
//!
//! It reads the format TrustGraph's `agent-react` prompt asks for (the template
//! `agent-prompt.txt` in trustgraph-templates; TrustGraph parses it in
//! `trustgraph-flow/trustgraph/agent/react/agent_manager.py` and `streaming_parser.py`):
//!
//! ```text
//! Thought: I need to look this up.
//! Action: search
//! Args: {
//!   "query": "capital of France"
//! }
//! ```
//!
//! or
//!
//! ```text
//! Thought: I know the answer now.
//! Final Answer: Paris is the capital of France.
//! ```
//!
//! Markers count only at the start of a line (`I know. Final Answer: x` on one line is
//! thought text). The answer runs to the end of the output; in it only `Action:` and
//! `Args:` lines are markers (they make the response an error), so an answer may contain
//! a line beginning `Thought:`. Tolerated, because real models do it:
//! - leading and trailing whitespace, blank lines, `\r\n` or `\r` line endings;
//! - markdown emphasis and any case: `**Thought:**`, `**Final Answer**:`, `final answer:`;
//! - text before the first marker (an echoed question, "Sure!", an opening ```` ``` ````
//!   fence) is discarded, as TrustGraph's streaming parser does: it is neither thought
//!   nor answer, and it is never streamed;
//! - a missing `Thought:` (the thought is empty and no thought events are emitted);
//! - the action name quoted, in backticks or brackets, or alone on the next line;
//!   `Args:` on the same line as the action name;
//! - `Action: none` (or `null`, `n/a`, empty) followed by `Final Answer:` is no action;
//! - Args in a ```` ```json ```` fence or in backticks; fences after the Args object;
//! - a closing ```` ``` ```` ending the answer when the response opened with a fence.
//!
//! Everything else is a [`ParseError`] whose message says what to fix, written to be
//! given back to the model for its one corrective retry. The parser never panics and
//! never guesses: a response with both an action and an answer, or text after the Args
//! object (a hallucinated `Observation:`), is an error, not a choice.
//!
//! Events are for showing progress live; the [`Outcome`] from [`ReactParser::finish`] is
//! what to act on (an error found late can follow events already emitted).

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

/// What the parser recognised in the model's output, said as soon as it is safe.
///
/// A delta is emitted once the parser knows the text is content, not the beginning of
/// a marker or trailing whitespace; the deltas of a section concatenate to exactly the
/// section's text in the [`Outcome`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// More thought text (the thought is trimmed: no leading or trailing whitespace).
    Thought(String),
    /// The thought is complete: an `Action:` or `Final Answer:` follows. Only emitted
    /// when the response has a `Thought:`.
    ThoughtEnd,
    /// The tool to call, once its arguments are complete (at the Args object's closing
    /// brace, or at the end of the output for an action without `Args:`).
    Action {
        /// The tool's name, as the model wrote it (quotes and brackets removed).
        name: String,
        /// The Args object: string values as they are, other values JSON-encoded, as
        /// TrustGraph's `AgentStep.arguments` is a map of strings.
        arguments: BTreeMap<String, String>,
    },
    /// More final-answer text (trimmed like the thought).
    Answer(String),
}

/// What one model response asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Call a tool, then ask the model again with its observation.
    Action {
        /// The thought before the action (may be empty).
        thought: String,
        /// The tool's name.
        name: String,
        /// The arguments (see [`Event::Action`]); empty when the response had no `Args:`.
        arguments: BTreeMap<String, String>,
    },
    /// The dialog is over.
    Answer {
        /// The thought before the answer (may be empty).
        thought: String,
        /// The final answer, never empty.
        answer: String,
    },
}

/// Why a response is not in the ReAct format; its `Display` is a corrective hint for
/// the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    problem: Problem,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Problem {
    Empty,
    NoMarkers { found: String },
    ThoughtOnly,
    SecondThought,
    ArgsWithoutAction,
    ActionWithoutName,
    ArgsMissing,
    ArgsNotObject { found: String },
    ArgsInvalidJson { reason: String },
    ArgsUnclosed,
    TextAfterArgs { found: String },
    TextAfterAction { found: String },
    ActionAndAnswer,
    EmptyAnswer,
}

/// How many characters of the offending text an error quotes.
const QUOTE_CHARS: usize = 60;

const FORMAT_HINT: &str = "Reply as `Thought: <your reasoning>` followed by either `Action: <tool name>` and `Args: <JSON object>`, or `Final Answer: <the answer>`.";

impl Problem {
    /// Where the text quoted by the message is collected, for problems that quote one.
    fn quote_mut(&mut self) -> Option<&mut String> {
        match self {
            Problem::NoMarkers { found }
            | Problem::ArgsNotObject { found }
            | Problem::TextAfterArgs { found }
            | Problem::TextAfterAction { found } => Some(found),
            _ => None,
        }
    }
}

/// The quoted text, trimmed and cut to [`QUOTE_CHARS`] characters.
fn quoted(text: &str) -> String {
    let text = text.trim();
    if text.chars().count() > QUOTE_CHARS {
        let mut cut: String = text.chars().take(QUOTE_CHARS).collect();
        cut.push('…');
        cut
    } else {
        text.to_string()
    }
}

impl ParseError {
    /// True when the response has no marker at all: plain prose, as small models write
    /// when they ignore the format. The agent may take it as the final answer (see
    /// `PlainAnswer` in the handler).
    pub fn is_plain_prose(&self) -> bool {
        matches!(self.problem, Problem::NoMarkers { .. })
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.problem {
            Problem::Empty => write!(f, "The response was empty. {FORMAT_HINT}"),
            Problem::NoMarkers { found } => write!(
                f,
                "The response has no `Thought:`, `Action:` or `Final Answer:` line; it begins `{}`. {FORMAT_HINT}",
                quoted(found)
            ),
            Problem::ThoughtOnly => write!(
                f,
                "The response has a `Thought:` but no `Action:` or `Final Answer:` after it. {FORMAT_HINT}"
            ),
            Problem::SecondThought => f.write_str(
                "The response has a second `Thought:` before any `Action:` or `Final Answer:`. Write a single Thought, then an Action or the Final Answer.",
            ),
            Problem::ArgsWithoutAction => write!(
                f,
                "The response has `Args:` without an `Action:` line before it naming the tool. {FORMAT_HINT}"
            ),
            Problem::ActionWithoutName => f.write_str(
                "The `Action:` line does not name a tool. Write `Action: <tool name>` on its own line, then `Args: <JSON object>`.",
            ),
            Problem::ArgsMissing => f.write_str(
                "`Args:` is not followed by a JSON object. Write the arguments as a JSON object, e.g. `Args: {\"name\": \"value\"}`, or `Args: {}` for none.",
            ),
            Problem::ArgsNotObject { found } => write!(
                f,
                "`Args:` must be followed by a JSON object in braces, but the response has `{}`. Write the arguments as a JSON object, e.g. `Args: {{\"name\": \"value\"}}`.",
                quoted(found)
            ),
            Problem::ArgsInvalidJson { reason } => write!(
                f,
                "The `Args:` object is not valid JSON ({reason}). Use double quotes around keys and string values."
            ),
            Problem::ArgsUnclosed => f.write_str(
                "The `Args:` JSON object is not closed: the response ends before its final `}`.",
            ),
            Problem::TextAfterArgs { found } => write!(
                f,
                "The response goes on after the `Args:` object with `{}`. Stop after the Args object: the system runs the tool and gives you the Observation.",
                quoted(found)
            ),
            Problem::TextAfterAction { found } => write!(
                f,
                "After `Action: <tool name>` the response should give `Args: <JSON object>`, but it has `{}`.",
                quoted(found)
            ),
            Problem::ActionAndAnswer => f.write_str(
                "The response has both an `Action:` and a `Final Answer:`. Give either an Action with its Args, or a Final Answer, not both.",
            ),
            Problem::EmptyAnswer => f.write_str(
                "The `Final Answer:` is empty. Write the answer after `Final Answer:`.",
            ),
        }
    }
}

impl std::error::Error for ParseError {}

/// The markers of the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    Thought,
    Action,
    Args,
    FinalAnswer,
}

impl Marker {
    const ALL: [Marker; 4] = [
        Marker::Thought,
        Marker::Action,
        Marker::Args,
        Marker::FinalAnswer,
    ];

    /// The marker's words, lowercase ASCII.
    fn words(self) -> &'static [&'static str] {
        match self {
            Marker::Thought => &["thought"],
            Marker::Action => &["action"],
            Marker::Args => &["args"],
            Marker::FinalAnswer => &["final", "answer"],
        }
    }
}

/// What the beginning of a line is, as far as can be told yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LineStart {
    /// A marker, ending at this byte offset; the rest of the line is its content.
    Marker(Marker, usize),
    /// Could still become a marker: hold it.
    Undecided,
    /// Not a marker: content.
    Text,
    /// A line that is only a code fence, closing the fence the response opened with.
    ClosingFence,
}

/// Where the parser is in the response.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Before the first marker: discarded text.
    Preamble,
    Thought,
    /// After `Action:`, before the name's line ends.
    ActionName,
    /// The action is named; `Args:` may follow.
    AfterAction,
    /// After `Args:`, before the object's `{`. `in_fence` after a backtick (and while
    /// reading a fence's language tag, like `json`).
    ArgsStart {
        in_fence: bool,
    },
    /// Inside the Args object.
    ArgsJson {
        depth: u32,
        in_string: bool,
        escaped: bool,
    },
    AfterArgs,
    Answer,
    /// The response is wrong; the problem's quote (if any) is collected until the end of
    /// its line, and everything else is ignored.
    Failed {
        problem: Problem,
        quoting: bool,
    },
}

/// The incremental ReAct parser for one model response: [`push`](Self::push) each delta
/// as it arrives, [`close`](Self::close) at the end of the output, then
/// [`finish`](Self::finish).
///
/// The events and the outcome do not depend on how the text is cut into deltas: a
/// marker may be split across any number of them.
#[derive(Debug)]
pub struct ReactParser {
    state: State,
    /// A `\r` seen last: a newline, unless the next character makes it half of `\r\n`.
    pending_cr: bool,
    /// Whether the next character begins a line.
    at_line_start: bool,
    /// The beginning of the current line, held while it could still be a marker.
    line_head: String,
    /// Whitespace (and a closing fence line) after the thought or answer text so far:
    /// content only if more text follows.
    held: String,
    saw_thought: bool,
    thought: String,
    name_line: String,
    name: String,
    args_json: String,
    arguments: BTreeMap<String, String>,
    answer: String,
    /// The preamble's line so far, to see whether it opens a fence.
    preamble_line: String,
    /// The first non-blank line of the preamble, quoted if no marker ever comes.
    preamble_quote: String,
    opened_with_fence: bool,
    closed: bool,
    events: Vec<Event>,
}

impl Default for ReactParser {
    fn default() -> Self {
        Self::new()
    }
}

impl ReactParser {
    /// A parser for one model response.
    pub fn new() -> Self {
        Self {
            state: State::Preamble,
            pending_cr: false,
            at_line_start: true,
            line_head: String::new(),
            held: String::new(),
            saw_thought: false,
            thought: String::new(),
            name_line: String::new(),
            name: String::new(),
            args_json: String::new(),
            arguments: BTreeMap::new(),
            answer: String::new(),
            preamble_line: String::new(),
            preamble_quote: String::new(),
            opened_with_fence: false,
            closed: false,
            events: Vec::new(),
        }
    }

    /// Feeds the next delta of the model's output; returns what it made known, in order
    /// (adjacent thought or answer text within one call comes as one event). Only the
    /// beginning of a line that could still be a marker, and trailing whitespace, are
    /// held back. Ignored after [`close`](Self::close).
    pub fn push(&mut self, delta: &str) -> Vec<Event> {
        if self.closed {
            return Vec::new();
        }
        for c in delta.chars() {
            if self.pending_cr {
                self.pending_cr = false;
                self.feed('\n');
                if c == '\n' {
                    continue;
                }
            }
            if c == '\r' {
                self.pending_cr = true;
            } else {
                self.feed(c);
            }
        }
        std::mem::take(&mut self.events)
    }

    /// Marks the end of the model's output; returns the last events: text that was held
    /// because it could have begun a marker, and the action of a response without
    /// `Args:`. [`finish`](Self::finish) closes too; calling this first gets the events.
    pub fn close(&mut self) -> Vec<Event> {
        if self.closed {
            return Vec::new();
        }
        if self.pending_cr {
            self.pending_cr = false;
            self.feed('\n');
        }
        self.closed = true;
        if self.at_line_start && !self.line_head.is_empty() {
            self.resolve_line_head(true);
        }
        if self.state == State::ActionName {
            if let Some(rest) = self.end_name_line() {
                rest.chars().for_each(|c| self.content(c));
            }
        }
        match &mut self.state {
            State::AfterAction => {
                self.events.push(Event::Action {
                    name: self.name.clone(),
                    arguments: BTreeMap::new(),
                });
            }
            State::Failed { quoting, .. } => *quoting = false,
            _ => {}
        }
        std::mem::take(&mut self.events)
    }

    /// What the response asks for, or what is wrong with it. Closes the parser first
    /// (events that [`close`](Self::close) would return are dropped).
    pub fn finish(mut self) -> Result<Outcome, ParseError> {
        self.close();
        let problem = match self.state {
            State::Failed { problem, .. } => problem,
            State::Preamble if self.preamble_quote.is_empty() => Problem::Empty,
            State::Preamble => Problem::NoMarkers {
                found: self.preamble_quote,
            },
            State::Thought => Problem::ThoughtOnly,
            State::ActionName => Problem::ActionWithoutName,
            State::ArgsStart { .. } => Problem::ArgsMissing,
            State::ArgsJson { .. } => Problem::ArgsUnclosed,
            State::AfterAction | State::AfterArgs => {
                return Ok(Outcome::Action {
                    thought: self.thought,
                    name: self.name,
                    arguments: self.arguments,
                });
            }
            State::Answer if self.answer.is_empty() => Problem::EmptyAnswer,
            State::Answer => {
                return Ok(Outcome::Answer {
                    thought: self.thought,
                    answer: self.answer,
                });
            }
        };
        Err(ParseError { problem })
    }

    /// Whether markers are looked for at line starts in the current state (not inside
    /// the Args object, where any text is JSON, and not once failed).
    fn classifies_lines(&self) -> bool {
        !matches!(
            self.state,
            State::ArgsStart { .. } | State::ArgsJson { .. } | State::Failed { .. }
        )
    }

    /// One character of normalised input (no `\r`).
    fn feed(&mut self, c: char) {
        if self.at_line_start && self.classifies_lines() {
            self.line_head.push(c);
            self.resolve_line_head(false);
        } else {
            self.content(c);
        }
    }

    /// Decides, if it can, what the held beginning of the line is, and acts on it.
    fn resolve_line_head(&mut self, at_end: bool) {
        match self.classify_line_head(at_end) {
            LineStart::Undecided => {}
            LineStart::Text => {
                let head = std::mem::take(&mut self.line_head);
                self.at_line_start = false;
                head.chars().for_each(|c| self.content(c));
            }
            LineStart::Marker(marker, end) => {
                let head = std::mem::take(&mut self.line_head);
                self.at_line_start = false;
                let (marker_text, rest) = head.split_at(end);
                self.on_marker(marker, marker_text);
                rest.chars().for_each(|c| self.content(c));
            }
            LineStart::ClosingFence => {
                let head = std::mem::take(&mut self.line_head);
                // Held, not dropped: if the answer goes on, the fence was part of it.
                if !self.answer.is_empty() {
                    self.held.push_str(&head);
                }
                self.at_line_start = head.ends_with('\n');
            }
        }
    }

    fn classify_line_head(&self, at_end: bool) -> LineStart {
        if self.state == State::Answer {
            if self.opened_with_fence {
                if let Some(fence) = closing_fence(&self.line_head, at_end) {
                    return fence;
                }
            }
            // In the answer, only what would make it an action is looked for: a line
            // beginning `Thought:` there is answer text.
            scan_marker(&self.line_head, &[Marker::Action, Marker::Args], at_end)
        } else {
            scan_marker(&self.line_head, &Marker::ALL, at_end)
        }
    }

    /// A marker at the start of a line.
    fn on_marker(&mut self, marker: Marker, marker_text: &str) {
        self.held.clear();
        match (&self.state, marker) {
            (State::Preamble, Marker::Thought) => {
                self.saw_thought = true;
                self.state = State::Thought;
            }
            (State::Preamble, Marker::Action) => self.state = State::ActionName,
            (State::Preamble, Marker::FinalAnswer) => self.state = State::Answer,
            (State::Preamble | State::Thought, Marker::Args) => {
                self.fail(Problem::ArgsWithoutAction);
            }
            (State::Thought, Marker::Thought) => self.fail(Problem::SecondThought),
            (State::Thought, Marker::Action) => {
                self.events.push(Event::ThoughtEnd);
                self.state = State::ActionName;
            }
            (State::Thought, Marker::FinalAnswer) => {
                self.events.push(Event::ThoughtEnd);
                self.state = State::Answer;
            }
            // The name line was blank: the model gave up on the action.
            (State::ActionName, Marker::FinalAnswer) => self.state = State::Answer,
            (State::ActionName, _) => self.fail(Problem::ActionWithoutName),
            (State::AfterAction, Marker::Args) => {
                self.state = State::ArgsStart { in_fence: false };
            }
            (State::AfterAction, Marker::FinalAnswer) if is_no_action(&self.name) => {
                self.state = State::Answer;
            }
            (State::AfterAction | State::AfterArgs, Marker::FinalAnswer) | (State::Answer, _) => {
                self.fail(Problem::ActionAndAnswer)
            }
            (State::AfterAction, _) => self.fail(Problem::TextAfterAction {
                found: marker_text.to_string(),
            }),
            (State::AfterArgs, _) => self.fail(Problem::TextAfterArgs {
                found: marker_text.to_string(),
            }),
            // Markers are not looked for in the other states.
            (State::ArgsStart { .. } | State::ArgsJson { .. } | State::Failed { .. }, _) => {}
        }
    }

    /// One character that is content in the current state.
    fn content(&mut self, c: char) {
        match &mut self.state {
            State::Preamble => self.preamble_char(c),
            State::Thought => self.text_char(c, false),
            State::Answer => self.text_char(c, true),
            State::ActionName => {
                if c == '\n' {
                    if let Some(rest) = self.end_name_line() {
                        rest.chars().for_each(|c| self.content(c));
                        self.content('\n');
                    }
                } else {
                    self.name_line.push(c);
                }
            }
            State::AfterAction => {
                if !c.is_whitespace() {
                    self.fail(Problem::TextAfterAction {
                        found: c.to_string(),
                    });
                }
            }
            State::ArgsStart { in_fence } => {
                if c == '{' {
                    self.args_json.push(c);
                    self.state = State::ArgsJson {
                        depth: 1,
                        in_string: false,
                        escaped: false,
                    };
                } else if c == '`' {
                    *in_fence = true;
                } else if c.is_whitespace() {
                    *in_fence = false;
                } else if !(*in_fence && c.is_ascii_alphanumeric()) {
                    self.fail(Problem::ArgsNotObject {
                        found: c.to_string(),
                    });
                }
            }
            State::ArgsJson {
                depth,
                in_string,
                escaped,
            } => {
                self.args_json.push(c);
                // Braces inside strings do not count, so `{"q": "a}"}` closes once.
                if *in_string {
                    if *escaped {
                        *escaped = false;
                    } else if c == '\\' {
                        *escaped = true;
                    } else if c == '"' {
                        *in_string = false;
                    }
                } else if c == '"' {
                    *in_string = true;
                } else if c == '{' {
                    *depth += 1;
                } else if c == '}' {
                    *depth -= 1;
                    if *depth == 0 {
                        self.end_args();
                    }
                }
            }
            State::AfterArgs => {
                // Fences and backticks around the object are fine; anything else is not.
                if !(c.is_whitespace() || c == '`') {
                    self.fail(Problem::TextAfterArgs {
                        found: c.to_string(),
                    });
                }
            }
            State::Failed { problem, quoting } => {
                if *quoting {
                    if c == '\n' {
                        *quoting = false;
                    } else if let Some(found) = problem.quote_mut() {
                        if found.chars().count() <= QUOTE_CHARS {
                            found.push(c);
                        }
                    }
                }
            }
        }
        self.at_line_start = c == '\n';
    }

    fn preamble_char(&mut self, c: char) {
        if c == '\n' {
            if self.preamble_line.trim_start().starts_with("```") {
                self.opened_with_fence = true;
            }
            self.preamble_line.clear();
        } else if self.preamble_line.len() < 16 {
            self.preamble_line.push(c);
        }
        // The first non-blank line, for the error if no marker ever comes.
        if !self.preamble_quote.contains('\n') {
            if c == '\n' {
                if !self.preamble_quote.is_empty() {
                    self.preamble_quote.push(c);
                }
            } else if !(self.preamble_quote.is_empty() && c.is_whitespace())
                && self.preamble_quote.chars().count() <= QUOTE_CHARS
            {
                self.preamble_quote.push(c);
            }
        }
    }

    /// A character of thought or answer text: whitespace is held until text follows it,
    /// so the section is trimmed and its deltas still add up to it.
    fn text_char(&mut self, c: char, answer: bool) {
        let text = if answer {
            &mut self.answer
        } else {
            &mut self.thought
        };
        if c.is_whitespace() {
            if !text.is_empty() {
                self.held.push(c);
            }
            return;
        }
        let mut delta = std::mem::take(&mut self.held);
        delta.push(c);
        text.push_str(&delta);
        match self.events.last_mut() {
            Some(Event::Answer(last)) if answer => last.push_str(&delta),
            Some(Event::Thought(last)) if !answer => last.push_str(&delta),
            _ if answer => self.events.push(Event::Answer(delta)),
            _ => self.events.push(Event::Thought(delta)),
        }
    }

    /// The action's name line is complete. Returns what follows an `Args:` on the same
    /// line, to be read as the arguments.
    fn end_name_line(&mut self) -> Option<String> {
        let line = std::mem::take(&mut self.name_line);
        let (name, rest) = match inline_args(&line) {
            Some((name_end, rest_start)) => (&line[..name_end], Some(&line[rest_start..])),
            None => (line.as_str(), None),
        };
        let name = clean_name(name);
        if name.is_empty() {
            // A blank name line: the name may come on the next line.
            if rest.is_some() {
                self.fail(Problem::ActionWithoutName);
            }
            return None;
        }
        self.name = name;
        match rest {
            Some(rest) => {
                self.state = State::ArgsStart { in_fence: false };
                Some(rest.to_string())
            }
            None => {
                self.state = State::AfterAction;
                None
            }
        }
    }

    /// The Args object's closing brace has arrived.
    fn end_args(&mut self) {
        match serde_json::from_str::<Value>(&self.args_json) {
            Ok(Value::Object(map)) => {
                self.arguments = map
                    .into_iter()
                    .map(|(key, value)| {
                        let value = match value {
                            Value::String(s) => s,
                            other => other.to_string(),
                        };
                        (key, value)
                    })
                    .collect();
                self.events.push(Event::Action {
                    name: self.name.clone(),
                    arguments: self.arguments.clone(),
                });
                self.state = State::AfterArgs;
            }
            // Text that starts with `{` and parses is an object; kept for completeness.
            Ok(_) => self.fail(Problem::ArgsNotObject {
                found: self.args_json.clone(),
            }),
            Err(e) => self.fail(Problem::ArgsInvalidJson {
                reason: e.to_string(),
            }),
        }
    }

    fn fail(&mut self, mut problem: Problem) {
        let quoting = problem.quote_mut().is_some();
        self.state = State::Failed { problem, quoting };
    }
}

/// Parses a whole response (see [`ReactParser`]).
pub fn parse(text: &str) -> Result<Outcome, ParseError> {
    let mut parser = ReactParser::new();
    parser.push(text);
    parser.finish()
}

/// Whether an action name means "no action" (some models write `Action: None` before
/// their final answer).
fn is_no_action(name: &str) -> bool {
    ["none", "null", "n/a", "no action"]
        .iter()
        .any(|no| name.eq_ignore_ascii_case(no))
}

/// The tool name without the decoration models add around it.
fn clean_name(name: &str) -> String {
    name.trim()
        .trim_matches(|c| matches!(c, '"' | '\'' | '`' | '*' | '[' | ']'))
        .trim()
        .to_string()
}

/// Where an `Args:` marker starts and ends on the action's line (`Action: x Args: {}`).
fn inline_args(line: &str) -> Option<(usize, usize)> {
    let bytes = line.as_bytes();
    (1..bytes.len())
        .filter(|&i| bytes[i - 1] == b' ' || bytes[i - 1] == b'\t')
        .find_map(|i| match scan_marker(&line[i..], &[Marker::Args], true) {
            LineStart::Marker(_, end) => Some((i, i + end)),
            _ => None,
        })
}

mod scan;

use self::scan::{closing_fence, scan_marker};

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
