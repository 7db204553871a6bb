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

/// The schema a `jsonl` template asks a provider's JSON mode for: `{"items": [<line>, ...]}`,
/// an object (OpenAI's structured outputs want one at the root) holding the array of the
/// lines' objects, since a JSON mode holds an answer to ONE value. The line schema's
/// definitions (`$defs`, `definitions`) move to the root, where its `#/$defs/...` references
/// still find them, and its `$schema` goes (it belongs at the root only).
pub fn lines_schema(line: &Value) -> Value {
    let mut item = line.clone();
    let mut root = serde_json::Map::new();
    if let Value::Object(o) = &mut item {
        o.remove("$schema");
        for key in ["$defs", "definitions"] {
            if let Some(defs) = o.remove(key) {
                root.insert(key.to_owned(), defs);
            }
        }
    }
    root.insert("type".into(), "object".into());
    root.insert(
        "properties".into(),
        serde_json::json!({"items": {"type": "array", "items": item}}),
    );
    root.insert("required".into(), serde_json::json!(["items"]));
    Value::Object(root)
}

/// Turns the answer to [`lines_schema`], streamed, into JSON lines for the [`JsonlParser`]:
/// the array's elements (found at the answer's first `[`, so a bare array is read as well),
/// each as one line as soon as it is complete, so objects still go out as they arrive; an
/// element that is not JSON becomes one line the parser then reports as malformed. An answer
/// that starts with neither `{` nor `[` passes through unchanged (lines after all); a fence
/// line before it is dropped. Written here rather than taken from a crate: what is needed is
/// a cut of the text at the array's top-level commas that keeps pace with the deltas, not a
/// parse of the whole value.
#[derive(Debug, Default)]
pub struct ArrayLines {
    state: ArrayState,
    /// Nesting inside the current element.
    depth: u32,
    in_string: bool,
    escaped: bool,
    element: String,
    /// What `Seek` read: given back as it was if the object is a line, not the wrapper.
    held: String,
    /// `Seek`'s nesting, and the last string and key it read at the object's top level.
    seek_depth: u32,
    seek_string: String,
    seek_key: String,
}

#[derive(Debug, Default, PartialEq)]
enum ArrayState {
    #[default]
    Start,
    /// A fence line (```` ```json ````) before the value: skipped to its end.
    Fence,
    /// Inside the wrapping object, before its array.
    Seek,
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
                ArrayState::Fence => {
                    if c == '\n' {
                        self.state = ArrayState::Start;
                    }
                }
                ArrayState::Start => match c {
                    c if c.is_whitespace() => {}
                    '`' => self.state = ArrayState::Fence,
                    '[' => self.state = ArrayState::InArray,
                    '{' => {
                        self.state = ArrayState::Seek;
                        self.held.push(c);
                        self.seek_depth = 1;
                    }
                    c => {
                        self.state = ArrayState::Passthrough;
                        out.push(c);
                    }
                },
                ArrayState::Seek => self.seek(c, &mut out),
                ArrayState::InArray => self.step(c, &mut out),
            }
        }
        out
    }

    /// Ends the answer: an element the array never closed, as a line.
    pub fn finish(&mut self) -> String {
        let mut out = String::new();
        match self.state {
            ArrayState::InArray => self.emit(&mut out),
            // An object that never closed: given back for the parser to report.
            ArrayState::Seek => out.push_str(&std::mem::take(&mut self.held)),
            _ => {}
        }
        out
    }

    /// In an object at the answer's start: the wrapper when its `items` member opens an
    /// array; a line of JSON lines when it closes first, given back whole, and the rest read
    /// as lines.
    fn seek(&mut self, c: char, out: &mut String) {
        self.held.push(c);
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
            } else if self.seek_depth == 1 {
                self.seek_string.push(c);
            }
            return;
        }
        match c {
            '"' => {
                self.in_string = true;
                self.seek_string.clear();
            }
            ':' if self.seek_depth == 1 => self.seek_key = std::mem::take(&mut self.seek_string),
            '[' if self.seek_depth == 1 && self.seek_key == "items" => {
                self.held.clear();
                self.state = ArrayState::InArray;
            }
            '{' | '[' => self.seek_depth += 1,
            '}' | ']' => {
                self.seek_depth = self.seek_depth.saturating_sub(1);
                if self.seek_depth == 0 {
                    out.push_str(&std::mem::take(&mut self.held));
                    self.state = ArrayState::Passthrough;
                }
            }
            _ => {}
        }
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

    /// The current element as one line. Newlines become spaces: JSON has none inside its
    /// strings, so a valid element keeps every byte of its meaning (numbers too, which a
    /// round trip through a parser could round).
    fn emit(&mut self, out: &mut String) {
        let text = std::mem::take(&mut self.element);
        let text = text.trim();
        if text.is_empty() {
            return;
        }
        out.push_str(&text.replace(['\n', '\r'], " "));
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

/// A whole answer that holds no JSON value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoJson {
    /// The answer is empty (or only whitespace).
    #[error("the model's answer is empty")]
    Empty,
    /// The answer has text but no object or array in it.
    #[error("the model's answer holds no JSON object or array")]
    NotFound,
}

/// The JSON value in a whole answer: inside a ```` ```json ```` fence if there is one,
/// otherwise the first object or array in the text, prose around it ignored.
pub fn extract_json(answer: &str) -> Result<Value, NoJson> {
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
        NoJson::Empty
    } else {
        NoJson::NotFound
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
        assert_eq!(extract_json("").unwrap_err(), NoJson::Empty);
        assert_eq!(extract_json("no json here").unwrap_err(), NoJson::NotFound);
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
                out, "{\"a\": \"x, [y]\", \"b\": {\"c\": 1}}\n{\"a\": \"q\\\"]\"}\n",
                "deltas of {size}"
            );
        }
        // The wrapper lines_schema asks for, behind a fence, pretty-printed: its array read.
        let wrapped =
            "```json\n{\n  \"items\": [\n    {\"a\": 1},\n    {\"tags\": [\"x\"]}\n  ]\n}\n```";
        for size in 1..wrapped.len() {
            let mut a = ArrayLines::default();
            let mut out = String::new();
            let chars: Vec<char> = wrapped.chars().collect();
            for piece in chars.chunks(size) {
                out.push_str(&a.push(&piece.iter().collect::<String>()));
            }
            out.push_str(&a.finish());
            assert_eq!(out, "{\"a\": 1}\n{\"tags\": [\"x\"]}\n", "deltas of {size}");
        }
        // JSON lines after all (an object with an array that is not `items`): as they were.
        let lines = "{\"tags\": [\"x\"], \"n\": 1}\n{\"n\": 2}\n";
        for size in 1..lines.len() {
            let mut a = ArrayLines::default();
            let mut out = String::new();
            let chars: Vec<char> = lines.chars().collect();
            for piece in chars.chunks(size) {
                out.push_str(&a.push(&piece.iter().collect::<String>()));
            }
            out.push_str(&a.finish());
            assert_eq!(out, lines, "deltas of {size}");
        }
        let mut a = ArrayLines::default();
        let mut out = a.push("[{\"a\": 1}, nope\n, {\"b\":");
        out.push_str(&a.finish());
        assert_eq!(out, "{\"a\": 1}\nnope\n{\"b\":\n");
        let mut p = JsonlParser::default();
        let items: Vec<LineItem> = p.push(&out).into_iter().chain(p.finish()).collect();
        assert!(matches!(items[0], LineItem::Object { .. }));
        assert!(matches!(items[1], LineItem::Malformed { .. }));
        assert!(matches!(items[2], LineItem::Malformed { .. }));
        let mut a = ArrayLines::default();
        assert_eq!(a.push("  Here: {\"a\": 1}\n"), "Here: {\"a\": 1}\n");
    }

    #[test]
    fn the_lines_schema_wraps_the_line_schema_with_its_definitions_at_the_root() {
        let line = serde_json::json!({"$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object", "properties": {"k": {"$ref": "#/$defs/k"}}, "$defs": {"k": {"type": "string"}}});
        let s = lines_schema(&line);
        assert_eq!(s["type"], "object");
        assert_eq!(s["required"], serde_json::json!(["items"]));
        assert_eq!(s["$defs"]["k"]["type"], "string");
        let item = &s["properties"]["items"]["items"];
        assert!(
            item.get("$schema").is_none() && item.get("$defs").is_none(),
            "{s}"
        );
        let v = jsonschema::validator_for(&s).unwrap();
        assert!(v.is_valid(&serde_json::json!({"items": [{"k": "x"}]})));
        assert!(!v.is_valid(&serde_json::json!({"items": [{"k": 1}]})));
    }
}
