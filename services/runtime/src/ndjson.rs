//! The incremental NDJSON line splitter (docs/protocol.md#streamed-json-lines), shared by the
//! Ollama provider (NDJSON over HTTP), the prompt service's jsonl mode (NDJSON inside
//! completion text), the gateway and the CLI.
//!
//! Feed it chunks as they arrive; it hands back each line the moment its newline arrives,
//! numbered from 1. That includes a line split across any number of chunks and several lines
//! in one chunk. Blank lines are skipped but counted, and `\r\n` endings are accepted.
//! [`LineSplitter::finish`] yields a final line that has no newline. Memory is bounded by the
//! longest line allowed: a longer line is reported once and dropped up to its newline.
//! Lines are split on bytes (`\n` never occurs inside a multi-byte UTF-8 sequence), so a
//! character split across chunks is reassembled correctly.

/// A complete line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// 1-based line number in the stream (blank lines count).
    pub number: usize,
    /// The line without its `\n` or `\r\n`.
    pub text: String,
}

/// A line that could not be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// Longer than the limit; dropped.
    #[error("line {number} is longer than {limit} bytes; skipped")]
    TooLong {
        /// The line number.
        number: usize,
        /// The limit.
        limit: usize,
    },
    /// Not valid UTF-8; dropped.
    #[error("line {number} is not valid UTF-8; skipped")]
    NotUtf8 {
        /// The line number.
        number: usize,
    },
}

/// Splits a chunked byte stream into lines.
#[derive(Debug)]
pub struct LineSplitter {
    buf: Vec<u8>,
    number: usize,
    limit: usize,
    overflowing: bool,
}

impl LineSplitter {
    /// A splitter accepting lines up to `max_line_bytes`.
    pub fn new(max_line_bytes: usize) -> Self {
        Self {
            buf: Vec::new(),
            number: 0,
            limit: max_line_bytes.max(1),
            overflowing: false,
        }
    }

    /// Lines seen so far, blank ones included.
    pub fn lines_seen(&self) -> usize {
        self.number
    }

    /// Feeds a chunk; returns the lines it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Result<Line, LineError>> {
        let mut out = Vec::new();
        let mut rest = chunk;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(pos);
            rest = &tail[1..];
            self.number += 1;
            if self.overflowing {
                self.overflowing = false;
                self.buf.clear();
                continue;
            }
            if self.buf.len() + head.len() > self.limit {
                self.buf.clear();
                out.push(Err(LineError::TooLong {
                    number: self.number,
                    limit: self.limit,
                }));
                continue;
            }
            self.buf.extend_from_slice(head);
            let raw = std::mem::take(&mut self.buf);
            if let Some(line) = self.line(raw, &mut out) {
                out.push(Ok(line));
            }
        }
        if !rest.is_empty() && !self.overflowing {
            if self.buf.len() + rest.len() > self.limit {
                // Report now, with the number the line will have, and drop the rest of it.
                self.buf.clear();
                self.overflowing = true;
                out.push(Err(LineError::TooLong {
                    number: self.number + 1,
                    limit: self.limit,
                }));
            } else {
                self.buf.extend_from_slice(rest);
            }
        }
        out
    }

    /// Ends the stream: the final line if it had no newline.
    pub fn finish(&mut self) -> Option<Result<Line, LineError>> {
        if self.overflowing {
            self.overflowing = false;
            self.number += 1;
            return None;
        }
        if self.buf.is_empty() {
            return None;
        }
        self.number += 1;
        let raw = std::mem::take(&mut self.buf);
        let mut errs = Vec::new();
        match self.line(raw, &mut errs) {
            Some(line) => Some(Ok(line)),
            None => errs.pop(),
        }
    }

    fn line(&self, mut raw: Vec<u8>, errors: &mut Vec<Result<Line, LineError>>) -> Option<Line> {
        if raw.last() == Some(&b'\r') {
            raw.pop();
        }
        if raw.iter().all(u8::is_ascii_whitespace) {
            return None;
        }
        match String::from_utf8(raw) {
            Ok(text) => Some(Line {
                number: self.number,
                text,
            }),
            Err(_) => {
                errors.push(Err(LineError::NotUtf8 {
                    number: self.number,
                }));
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&str], limit: usize) -> Vec<Result<Line, LineError>> {
        let mut s = LineSplitter::new(limit);
        let mut out: Vec<_> = chunks.iter().flat_map(|c| s.push(c.as_bytes())).collect();
        out.extend(s.finish());
        out
    }

    fn ok(number: usize, text: &str) -> Result<Line, LineError> {
        Ok(Line {
            number,
            text: text.into(),
        })
    }

    #[test]
    fn lines_split_across_chunks_and_many_per_chunk() {
        let got = run(&["{\"a\":", "1}\n{\"b\":2}\n{\"c\"", ":3}\n"], 1024);
        assert_eq!(
            got,
            [
                ok(1, r#"{"a":1}"#),
                ok(2, r#"{"b":2}"#),
                ok(3, r#"{"c":3}"#)
            ]
        );
    }

    #[test]
    fn blank_lines_count_crlf_is_stripped_and_a_final_line_needs_no_newline() {
        let got = run(&["a\r\n\n   \nb\n", "c"], 1024);
        assert_eq!(got, [ok(1, "a"), ok(4, "b"), ok(5, "c")]);
    }

    #[test]
    fn a_character_split_across_chunks_is_reassembled() {
        let bytes = "é\n".as_bytes();
        let mut s = LineSplitter::new(16);
        assert!(s.push(&bytes[..1]).is_empty());
        assert_eq!(s.push(&bytes[1..]), [ok(1, "é")]);
    }

    #[test]
    fn an_overlong_line_is_reported_once_and_the_stream_goes_on() {
        let got = run(&["short\n", "0123456789", "0123456789", "tail\nnext\n"], 8);
        assert_eq!(
            got,
            [
                ok(1, "short"),
                Err(LineError::TooLong {
                    number: 2,
                    limit: 8
                }),
                ok(3, "next"),
            ]
        );
    }

    #[test]
    fn invalid_utf8_is_reported_with_its_line_number() {
        let mut s = LineSplitter::new(64);
        let got = s.push(b"ok\n\xff\xfe\nfine\n");
        assert_eq!(
            got,
            [
                ok(1, "ok"),
                Err(LineError::NotUtf8 { number: 2 }),
                ok(3, "fine")
            ]
        );
    }

    #[test]
    fn any_split_of_a_text_yields_the_same_lines() {
        let text = "{\"x\":1}\n\n{\"y\":\"é€\"}\r\n{\"z\":[1,2]}";
        let whole = run(&[text], 1024);
        let bytes = text.as_bytes();
        // Every split into up to three pieces, at every byte boundary.
        for i in 0..=bytes.len() {
            for j in i..=bytes.len() {
                let mut s = LineSplitter::new(1024);
                let mut got = s.push(&bytes[..i]);
                got.extend(s.push(&bytes[i..j]));
                got.extend(s.push(&bytes[j..]));
                got.extend(s.finish());
                assert_eq!(got, whole, "split at {i}, {j}");
            }
        }
    }
}
