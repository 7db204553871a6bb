//! Finding the ReAct markers at the start of a line: `Thought:`, `Action:`, `Args:`,
//! `Final Answer:`, written plain, bold or as a heading, and the fences around arguments.

use super::*;

/// Whether a held line is a closing code fence (```` ``` ```` alone on its line), could
/// still become one, or is neither (`None`).
pub(super) fn closing_fence(line: &str, at_end: bool) -> Option<LineStart> {
    let (body, has_newline) = match line.strip_suffix('\n') {
        Some(body) => (body, true),
        None => (line, false),
    };
    let body = body.trim_start_matches([' ', '\t']);
    let complete = has_newline || at_end;
    if body.len() < 3 {
        return ("```".starts_with(body) && !complete).then_some(LineStart::Undecided);
    }
    let after = body.strip_prefix("```")?;
    if !after.trim_matches([' ', '\t']).is_empty() {
        return None;
    }
    Some(if complete {
        LineStart::ClosingFence
    } else {
        LineStart::Undecided
    })
}

/// Whether a line begins with one of the markers: optional indentation, optional `*`
/// or `**`, the marker's words in any case, optional `**`, then `:` (and the `**`
/// closing an emphasis opened before the words). `at_end` says the line can get no
/// longer, so nothing is undecided.
pub(super) fn scan_marker(line: &str, allowed: &[Marker], at_end: bool) -> LineStart {
    let bytes = line.as_bytes();
    let undecided = if at_end {
        LineStart::Text
    } else {
        LineStart::Undecided
    };
    let mut i = skip_blanks(bytes, 0);
    let open = count_stars(bytes, &mut i);
    if i == bytes.len() {
        return undecided;
    }
    let mut could_be = false;
    for &marker in allowed {
        match match_words(bytes, i, marker.words()) {
            Words::Matched(end) => return marker_end(bytes, end, open, marker, at_end),
            Words::Prefix => could_be = true,
            Words::Different => {}
        }
    }
    if could_be { undecided } else { LineStart::Text }
}

pub(super) enum Words {
    Matched(usize),
    /// The line ends inside the words.
    Prefix,
    Different,
}

/// Matches words case-insensitively from `i`; between words, any run of spaces,
/// underscores or hyphens (`Final Answer`, `final_answer`, `FinalAnswer`).
pub(super) fn match_words(bytes: &[u8], mut i: usize, words: &[&str]) -> Words {
    for (n, word) in words.iter().enumerate() {
        if n > 0 {
            while i < bytes.len() && matches!(bytes[i], b' ' | b'\t' | b'_' | b'-') {
                i += 1;
            }
        }
        for &expected in word.as_bytes() {
            match bytes.get(i) {
                None => return Words::Prefix,
                Some(b) if b.to_ascii_lowercase() == expected => i += 1,
                Some(_) => return Words::Different,
            }
        }
    }
    Words::Matched(i)
}

/// After a marker's words: the colon, and the emphasis around it.
pub(super) fn marker_end(
    bytes: &[u8],
    mut i: usize,
    open: usize,
    marker: Marker,
    at_end: bool,
) -> LineStart {
    let undecided = if at_end {
        LineStart::Text
    } else {
        LineStart::Undecided
    };
    i = skip_blanks(bytes, i);
    let close = count_stars(bytes, &mut i);
    i = skip_blanks(bytes, i);
    match bytes.get(i) {
        None => return undecided,
        Some(b':') => i += 1,
        Some(_) => return LineStart::Text,
    }
    if open > 0 && close == 0 {
        // `**Thought:**`: the emphasis closes after the colon.
        let mut closed = 0;
        while closed < open && bytes.get(i) == Some(&b'*') {
            i += 1;
            closed += 1;
        }
        if closed < open && i == bytes.len() && !at_end {
            return LineStart::Undecided;
        }
    }
    LineStart::Marker(marker, i)
}

pub(super) fn skip_blanks(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && matches!(bytes[i], b' ' | b'\t') {
        i += 1;
    }
    i
}

/// Skips up to two `*` (markdown emphasis); returns how many.
pub(super) fn count_stars(bytes: &[u8], i: &mut usize) -> usize {
    let mut n = 0;
    while n < 2 && bytes.get(*i) == Some(&b'*') {
        *i += 1;
        n += 1;
    }
    n
}
