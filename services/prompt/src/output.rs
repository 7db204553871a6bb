//! Reading structured output out of a model's text: JSON lines as they complete (the
//! incremental parser of docs/protocol.md#streamed-json-lines) and one JSON value from a whole
//! answer.

use serde_json::Value;
use sluice_runtime::ndjson::{LineError, LineSplitter};

/// The longest line accepted; a longer one is skipped as malformed.
pub const MAX_LINE_BYTES: usize = 1024 * 1024;

/// What one line of a JSON-lines answer is.
#[derive(Debug, Clone, PartialEq)]
pub enum LineItem {
    /// A JSON object, and the line's text as the model wrote it (trimmed).
    Object {
        /// 1-based line number in the answer.
        line: usize,
        /// The object.
        value: Value,
    },
    /// A line that should have been an object and is not.
    Malformed {
        /// 1-based line number.
        line: usize,
        /// The line (trimmed), for a request log that opted in to content; empty for a line
        /// too long or not UTF-8.
        text: String,
        /// Why, without quoting the line (it is model output, possibly long or sensitive).
        reason: String,
    },
}

/// Turns a streamed JSON array into JSON lines for the [`JsonlParser`]: what a provider's JSON
/// mode gives for a `jsonl` template asked for natively, as an array of its lines' objects
/// (a JSON mode holds an answer to ONE value). Each top-level element becomes one compact line
/// as soon as it is complete, so objects still go out as they arrive; an element that is not
/// JSON becomes one line the parser then reports as malformed. An answer that does not start
/// with `[` passes through unchanged (lines after all). Written here rather than taken from a
/// crate: what is needed is a cut of the text at top-level commas that keeps pace with the
/// deltas, not a parse of the whole value.
#[derive(Debug, Default)]
pub struct ArrayLines {
    state: ArrayState,
    /// Nesting inside the current element.
    depth: u32,
    in_string: bool,
    escaped: bool,
    element: String,
}

#[derive(Debug, Default, PartialEq)]
enum ArrayState {
    #[default]
    Start,
    Passthrough,
    InArray,
    Done,
}

impl ArrayLines {
    /// Feeds a text delta; returns the text of the lines it completed (or the delta itself,
    /// for an answer that is not an array).
    pub fn push(&mut self, delta: &str) -> String {
        let mut out = String::new();
        for c in delta.chars() {
            match self.state {
                ArrayState::Passthrough => out.push(c),
                ArrayState::Done => {}
                ArrayState::Start => {
                    if c.is_whitespace() {
                        continue;
                    }
                    if c == '[' {
                        self.state = ArrayState::InArray;
                    } else {
                        self.state = ArrayState::Passthrough;
                        out.push(c);
                    }
                }
                ArrayState::InArray => self.step(c, &mut out),
            }
        }
        out
    }

    /// Ends the answer: an element the array never closed, as a line.
    pub fn finish(&mut self) -> String {
        let mut out = String::new();
        if self.state == ArrayState::InArray {
            self.emit(&mut out);
        }
        out
    }

    fn step(&mut self, c: char, out: &mut String) {
        if self.in_string {
            self.element.push(c);
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
            }
            return;
        }
        match c {
            '"' => {
                self.in_string = true;
                self.element.push(c);
            }
            '{' | '[' => {
                self.depth += 1;
                self.element.push(c);
            }
            ']' if self.depth == 0 => {
                self.emit(out);
                self.state = ArrayState::Done;
            }
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                self.element.push(c);
            }
            ',' if self.depth == 0 => self.emit(out),
            _ => self.element.push(c),
        }
    }

    /// The current element as one line: compact JSON, or its text on one line.
    fn emit(&mut self, out: &mut String) {
        let text = std::mem::take(&mut self.element);
        let text = text.trim();
        if text.is_empty() {
            return;
        }
        match serde_json::from_str::<Value>(text) {
            Ok(v) => out.push_str(&v.to_string()),
            Err(_) => out.push_str(&text.replace(['\n', '\r'], " ")),
        }
        out.push('\n');
    }
}

/// Splits a streamed answer into JSON-lines items as text deltas arrive: a line split across
/// any number of deltas, several lines in one delta, a final line without newline. Blank
/// lines and markdown fence lines (```` ``` ````, ```` ```json ````) are ignored, not skipped.
#[derive(Debug)]
pub struct JsonlParser {
    lines: LineSplitter,
}

impl Default for JsonlParser {
    fn default() -> Self {
        Self {
            lines: LineSplitter::new(MAX_LINE_BYTES),
        }
    }
}

impl JsonlParser {
    /// Feeds a text delta; returns the items of the lines it completed.
    pub fn push(&mut self, delta: &str) -> Vec<LineItem> {
        self.lines
            .push(delta.as_bytes())
            .into_iter()
            .filter_map(item)
            .collect()
    }

    /// Ends the answer: the last line, if it had no newline.
    pub fn finish(&mut self) -> Option<LineItem> {
        self.lines.finish().and_then(item)
    }
}

fn item(line: Result<sluice_runtime::ndjson::Line, LineError>) -> Option<LineItem> {
    let line = match line {
        Ok(l) => l,
        Err(LineError::TooLong { number: line, .. }) => {
            return Some(LineItem::Malformed {
                line,
                text: String::new(),
                reason: format!("longer than {MAX_LINE_BYTES} bytes"),
            });
        }
        Err(LineError::NotUtf8 { number: line }) => {
            return Some(LineItem::Malformed {
                line,
                text: String::new(),
                reason: "not UTF-8".into(),
            });
        }
    };
    let text = line.text.trim();
    if text.is_empty() || text.starts_with("```") {
        return None;
    }
    Some(match serde_json::from_str::<Value>(text) {
        Ok(value @ Value::Object(_)) => LineItem::Object {
            line: line.number,
            value,
        },
        Ok(_) => LineItem::Malformed {
            line: line.number,
            text: text.to_owned(),
            reason: "a JSON value that is not an object".into(),
        },
        Err(e) => LineItem::Malformed {
            line: line.number,
            text: text.to_owned(),
            reason: format!(
                "not valid JSON ({:?} at column {})",
                e.classify(),
                e.column()
            ),
        },
    })
}

/// The JSON value in a whole answer: inside a ```` ```json ```` fence if there is one,
/// otherwise the first object or array in the text, prose around it ignored.
pub fn extract_json(answer: &str) -> Result<Value, String> {
    let body = fenced(answer).unwrap_or(answer);
    let mut from = 0;
    while let Some(offset) = body[from..].find(['{', '[']) {
        let start = from + offset;
        let mut values = serde_json::Deserializer::from_str(&body[start..]).into_iter::<Value>();
        if let Some(Ok(v)) = values.next() {
            return Ok(v);
        }
        from = start + 1;
    }
    Err(if answer.trim().is_empty() {
        "the model's answer is empty".into()
    } else {
        "the model's answer holds no JSON object or array".into()
    })
}

/// The text between the first fence line and the next one.
fn fenced(text: &str) -> Option<&str> {
    let open = text.find("```")?;
    let after = open + text[open..].find('\n')? + 1;
    let close = text[after..].find("```").map_or(text.len(), |i| after + i);
    Some(&text[after..close])
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const TEXT: &str = "```json\n{\"a\":1}\n\n{\"a\":2}\nnot json\n[1]\n```\n{\"a\":3}";

    fn parse_in_pieces(pieces: &[&str]) -> Vec<LineItem> {
        let mut p = JsonlParser::default();
        let mut out: Vec<LineItem> = pieces.iter().flat_map(|d| p.push(d)).collect();
        out.extend(p.finish());
        out
    }

    #[test]
    fn lines_fences_blanks_and_a_final_line_without_newline() {
        let out = parse_in_pieces(&[TEXT]);
        let objects: Vec<&Value> = out
            .iter()
            .filter_map(|i| match i {
                LineItem::Object { value, .. } => Some(value),
                LineItem::Malformed { .. } => None,
            })
            .collect();
        assert_eq!(objects, [&json!({"a":1}), &json!({"a":2}), &json!({"a":3})]);
        let bad: Vec<usize> = out
            .iter()
            .filter_map(|i| match i {
                LineItem::Malformed { line, .. } => Some(*line),
                LineItem::Object { .. } => None,
            })
            .collect();
        assert_eq!(bad, [5, 6], "line numbers count every line");
    }

    /// For every way of cutting the text into two or three pieces, the parser yields the same
    /// items; byte-at-a-time too.
    #[test]
    fn any_split_yields_the_same_items() {
        let whole = parse_in_pieces(&[TEXT]);
        let n = TEXT.len();
        for i in 0..=n {
            for j in i..=n {
                if !TEXT.is_char_boundary(i) || !TEXT.is_char_boundary(j) {
                    continue;
                }
                let got = parse_in_pieces(&[&TEXT[..i], &TEXT[i..j], &TEXT[j..]]);
                assert_eq!(got, whole, "split at {i}, {j}");
            }
        }
        let bytes: Vec<String> = TEXT.chars().map(String::from).collect();
        let pieces: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert_eq!(parse_in_pieces(&pieces), whole);
    }

    /// Property: for random JSON-lines texts (objects, blank lines, fences, garbage, CRLF,
    /// multi-byte characters, with or without a final newline) and random ways of cutting
    /// them into chunks, the parser yields exactly what it yields for the whole text.
    #[test]
    fn random_texts_and_random_splits_agree() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let seed: u64 = std::env::var("SLUICE_PROPTEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(rand::random);
        let mut rng = StdRng::seed_from_u64(seed);
        let pieces = [
            r#"{"a": 1, "text": "héllo wörld ✓"}"#,
            r#"{"nested": {"list": [1, 2, {"k": "v"}]}, "s": "a\nb"}"#,
            "",
            "   ",
            "```json",
            "```",
            "not json at all",
            r#"{"truncated": "#,
            "[1, 2, 3]",
            r#"  {"padded": true}  "#,
        ];
        for case in 0..300 {
            let n = rng.random_range(0..12);
            let mut text = String::new();
            for i in 0..n {
                text.push_str(pieces[rng.random_range(0..pieces.len())]);
                if i + 1 < n || rng.random_bool(0.5) {
                    text.push_str(if rng.random_bool(0.2) { "\r\n" } else { "\n" });
                }
            }
            let whole = parse_in_pieces(&[&text]);
            let mut cuts: Vec<usize> = (0..rng.random_range(0..8))
                .map(|_| rng.random_range(0..=text.len()))
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut from = 0;
            for c in cuts {
                chunks.push(&text[from..c]);
                from = c;
            }
            chunks.push(&text[from..]);
            assert_eq!(
                parse_in_pieces(&chunks),
                whole,
                "seed {seed}, case {case}: {text:?} cut as {chunks:?}"
            );
        }
    }

    #[test]
    fn a_whole_answer_yields_its_json_value() {
        assert_eq!(
            extract_json("Sure! Here it is:\n```json\n{\"x\": [1, 2]}\n```\nAnything else?")
                .unwrap(),
            json!({"x": [1, 2]})
        );
        assert_eq!(
            extract_json("The answer is {\"x\": true} as requested.").unwrap(),
            json!({"x": true})
        );
        assert_eq!(extract_json("[1,2] trailing").unwrap(), json!([1, 2]));
        // A brace in prose before the object is skipped over.
        assert_eq!(
            extract_json("use {braces} like {\"k\": 1}").unwrap(),
            json!({"k": 1})
        );
        assert!(extract_json("").unwrap_err().contains("empty"));
        assert!(
            extract_json("no json here")
                .unwrap_err()
                .contains("no JSON")
        );
    }

    /// A pretty-printed array cut into lines however the deltas fall; an unterminated last
    /// element and one that is not JSON become lines the parser reports; text that is not an
    /// array passes through.
    #[test]
    fn an_array_becomes_lines_as_its_elements_complete() {
        let text =
            "[\n  {\"a\": \"x, [y]\", \"b\": {\"c\": 1}},\n  {\"a\": \"q\\\"]\"}\n]  trailing";
        for size in 1..text.len() {
            let mut a = ArrayLines::default();
            let mut out = String::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(size) {
                out.push_str(&a.push(&piece.iter().collect::<String>()));
            }
            out.push_str(&a.finish());
            assert_eq!(
                out, "{\"a\":\"x, [y]\",\"b\":{\"c\":1}}\n{\"a\":\"q\\\"]\"}\n",
                "deltas of {size}"
            );
        }
        let mut a = ArrayLines::default();
        let mut out = a.push("[{\"a\": 1}, nope\n, {\"b\":");
        out.push_str(&a.finish());
        assert_eq!(out, "{\"a\":1}\nnope\n{\"b\":\n");
        let mut p = JsonlParser::default();
        let items: Vec<LineItem> = p.push(&out).into_iter().chain(p.finish()).collect();
        assert!(matches!(items[0], LineItem::Object { .. }));
        assert!(matches!(items[1], LineItem::Malformed { .. }));
        assert!(matches!(items[2], LineItem::Malformed { .. }));
        let mut a = ArrayLines::default();
        assert_eq!(a.push("  {\"a\": 1}\n"), "{\"a\": 1}\n");
    }
}
