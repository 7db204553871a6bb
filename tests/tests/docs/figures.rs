//! Every figure the README and the book quote is in a committed results file (issue #54).
//!
//! The convention, as docs/benchmarks.md states it for writers ("Where a figure comes from"):
//! - a results file under `bench/results/` opens with how it was made: `Measured <date> UTC at
//!   commit <hash>`, the machine (`on ...`) and the command (``by `...` ``); a run with
//!   uncommitted changes is not published;
//! - a results table in the book is its file, spliced between `<!-- bench:NAME -->` markers
//!   by the bench: it must be the committed file, byte for byte;
//! - prose that quotes a figure names its file: the paragraph, list item or table row mentions
//!   `bench/results/NAME.md` (in code, a link or a comment), or the section declares
//!   `<!-- figures: bench/results/NAME.md -->` on a line of its own (up to the next heading).
//!   Each figure must be written in one of the named files as it is quoted (no rounding, no
//!   sums or differences);
//! - a figure is a number with a unit (`ms`, `s`, `MiB`, `x`, `%`, `requests/s`...), a
//!   decimal point or a thousands separator; versions (`4.0.8`), numbers inside words
//!   (`p50`, a commit) and numbers in code are not. A number that reads as a figure but was
//!   not measured (a setting, a limit, a target) is listed in its paragraph as
//!   `<!-- given: 500 MB, 99% -->`.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::Path;

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

/// Units after which a number is a figure, longest first so that `ms` is not read as `m`.
/// `x`, `×` and `%` must touch the number (`0.82x`; "92 x `timeout`" is a count); the others
/// may follow one space.
const UNITS: [&str; 22] = [
    "requests/s",
    "records/s",
    "tokens/s",
    "objects/s",
    "seconds",
    "minutes",
    "min",
    "MiB",
    "GiB",
    "KiB",
    "MB",
    "GB",
    "KB",
    "kB",
    "ms",
    "µs",
    "ns",
    "s",
    "h",
    "%",
    "x",
    "×",
];

/// The units of time among [`UNITS`].
const TIME_UNITS: [&str; 7] = ["seconds", "minutes", "min", "ms", "µs", "s", "h"];

/// A number in prose that reads as a measurement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Figure {
    /// As written, with its sign and unit: `+2.53 ms`.
    pub(crate) written: String,
    /// As looked up in a results file: digits and point only (`2.53`, `33437`).
    pub(crate) value: String,
    /// A whole number of a unit of time (`10 s`, `50 ms`): a figure only where the prose
    /// names a results file, since elsewhere it is nearly always a setting (a timeout, an
    /// interval) that no run measured.
    pub(crate) whole_time: bool,
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The figures of `text` (prose, code already taken out), in order.
pub(crate) fn figures_in(text: &str) -> Vec<Figure> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if !c.is_ascii_digit() {
            i += 1;
            continue;
        }
        // A digit inside a word (`p50`, `x86`, `SmolLM2`), after a point (`.5` of a
        // version already skipped) or a section sign (`§4.4`): skip the word.
        if i > 0 && (is_word_char(chars[i - 1]) || matches!(chars[i - 1], '.' | '§')) {
            while i < chars.len() && (is_word_char(chars[i]) || chars[i] == '.') {
                i += 1;
            }
            continue;
        }
        let start = i;
        let (end, thousands, decimal) = number_at(&chars, i);
        i = end;
        // `4.0.8`, `127.0.0.1`: a version or an address, not a figure.
        if i + 1 < chars.len() && chars[i] == '.' && chars[i + 1].is_ascii_digit() {
            while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
                i += 1;
            }
            continue;
        }
        let unit = unit_at(&chars, i);
        // A number running into a word that is not a unit (`3a8d1e8`, `5xx`, `1st`).
        if unit.is_none() && i < chars.len() && is_word_char(chars[i]) {
            while i < chars.len() && is_word_char(chars[i]) {
                i += 1;
            }
            continue;
        }
        let value: String = chars[start..end].iter().filter(|c| **c != ',').collect();
        let sign = match start.checked_sub(1).map(|p| chars[p]) {
            Some(s @ ('+' | '-' | '−')) => s.to_string(),
            _ => String::new(),
        };
        let mut written = format!("{sign}{}", chars[start..end].iter().collect::<String>());
        if let Some(u) = unit {
            written.push_str(&chars[end..u].iter().collect::<String>());
            i = u;
        }
        let whole_time = !thousands
            && !decimal
            && unit.is_some_and(|u| {
                let unit: String = chars[end..u].iter().collect();
                TIME_UNITS.contains(&unit.trim_start())
            });
        if unit.is_some() || thousands || decimal {
            out.push(Figure {
                written,
                value,
                whole_time,
            });
        }
    }
    out
}

/// The end of the number starting at `i`, whether it has thousands separators
/// (`33,437`: exactly three digits after each comma) and whether it has a decimal point.
fn number_at(chars: &[char], i: usize) -> (usize, bool, bool) {
    let digits = |mut j: usize| {
        while j < chars.len() && chars[j].is_ascii_digit() {
            j += 1;
        }
        j
    };
    let mut end = digits(i);
    let mut thousands = false;
    if end - i <= 3 {
        while end + 3 < chars.len() + 1
            && chars.get(end) == Some(&',')
            && digits(end + 1) == end + 4
        {
            thousands = true;
            end += 4;
        }
    }
    let mut decimal = false;
    if chars.get(end) == Some(&'.') && chars.get(end + 1).is_some_and(char::is_ascii_digit) {
        let after = digits(end + 1);
        // `4.0.8`: leave the point to the version check.
        if !(chars.get(after) == Some(&'.')
            && chars.get(after + 1).is_some_and(char::is_ascii_digit))
        {
            decimal = true;
            end = after;
        }
    }
    (end, thousands, decimal)
}

/// The end of the unit after a number ending at `i`, if one follows.
fn unit_at(chars: &[char], i: usize) -> Option<usize> {
    let rest: String = chars[i..chars.len().min(i + 16)].iter().collect();
    let (spaced, rest) = match rest.strip_prefix([' ', '\u{a0}']) {
        Some(r) => (true, r),
        None => (false, rest.as_str()),
    };
    UNITS.iter().find_map(|u| {
        let attached_only = matches!(*u, "x" | "×" | "%");
        if spaced && attached_only {
            return None;
        }
        let after = rest.strip_prefix(u)?;
        if after.chars().next().is_some_and(is_word_char) {
            return None;
        }
        Some(i + usize::from(spaced) + u.chars().count())
    })
}

/// Every number a results file holds, as [`Figure::value`] writes them.
pub(crate) fn numbers_of(text: &str) -> BTreeSet<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        // Digits inside a word (`p50`, a commit's `9f68c04`) are no figure of the file.
        if i > 0 && is_word_char(chars[i - 1]) {
            while i < chars.len() && is_word_char(chars[i]) {
                i += 1;
            }
            continue;
        }
        let (end, ..) = number_at(&chars, i);
        // A number running into a word that is not its unit (a commit's `9f68c04`).
        if unit_at(&chars, end).is_none() && chars.get(end).is_some_and(|c| is_word_char(*c)) {
            i = end;
            while i < chars.len() && is_word_char(chars[i]) {
                i += 1;
            }
            continue;
        }
        out.insert(chars[i..end].iter().filter(|c| **c != ',').collect());
        // A version's parts count one by one (`4.0.8`: 4.0 and 8); the next digit starts a
        // number of its own.
        i = end.max(i + 1);
    }
    out
}

/// What is wrong with a results file's first line, if anything: it must say when
/// (`Measured <date> <time> UTC`), at which commit (never with uncommitted changes), on what
/// machine (`on ...`) and by which command (``by `...` ``).
pub(crate) fn header_problem(first_line: &str) -> Option<String> {
    let Some(rest) = first_line.strip_prefix("Measured ") else {
        return Some("does not start with `Measured <date> UTC at commit ...`".into());
    };
    let date_ok = rest.len() >= 20
        && rest.is_char_boundary(20)
        && rest[..20].chars().enumerate().all(|(i, c)| match i {
            4 | 7 => c == '-',
            10 | 16 => c == ' ',
            13 => c == ':',
            _ => c.is_ascii_digit() || (17..20).contains(&i),
        })
        && &rest[17..20] == "UTC";
    if !date_ok {
        return Some("no date and time (`2026-12-01 21:39 UTC`)".into());
    }
    let Some(commit) = rest[20..].strip_prefix(" at commit ") else {
        return Some("no commit (`at commit <hash>`)".into());
    };
    let hash: String = commit.chars().take_while(char::is_ascii_hexdigit).collect();
    if hash.len() < 7 {
        return Some("no commit hash after `at commit`".into());
    }
    let after = &commit[hash.len()..];
    if after.starts_with(" with uncommitted changes") {
        return Some(
            "measured with uncommitted changes: no commit holds the code it measured".into(),
        );
    }
    if !after.starts_with(" on ") {
        return Some("no machine (`on this machine (2 cores, ...)`) after the commit".into());
    }
    if !after.contains(" by `") {
        return Some("no command (``by `bash bench/run.sh ...` ``)".into());
    }
    None
}

/// One finding of the check, at a file's line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Finding {
    /// 1-based.
    pub(crate) line: usize,
    pub(crate) what: String,
}

/// The results files a document may name, by their path from the repository's root
/// (`bench/results/overhead.md`), with the numbers each holds.
pub(crate) struct Results {
    pub(crate) files: HashMap<String, BTreeSet<String>>,
}

impl Results {
    /// Every file under `root/bench/results`.
    pub(crate) fn read(root: &Path) -> Results {
        let mut files = HashMap::new();
        let dir = root.join("bench/results");
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let name = format!(
                "bench/results/{}",
                path.file_name().unwrap().to_string_lossy()
            );
            files.insert(name, numbers_of(&text));
        }
        Results { files }
    }
}

/// The results files `raw` names: `bench/results/NAME.EXT`, with `NAME.{md,json}` read as
/// both. A name with a `*` is kept as written, to be reported (a glob names no one file).
fn mentions(raw: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in raw.match_indices("bench/results/") {
        let tail = &raw[at + "bench/results/".len()..];
        let name: String = tail
            .chars()
            .take_while(|c| c.is_alphanumeric() || "-_.*{},".contains(*c))
            .collect();
        let name = name.trim_end_matches(['.', ',']);
        // `bench/results/` itself (the directory), or a placeholder (`NAME.md`).
        let stem = name.split('.').next().unwrap_or_default();
        if stem.is_empty() || stem.chars().all(|c| c.is_ascii_uppercase()) {
            continue;
        }
        match (name.find('{'), name.find('}')) {
            (Some(a), Some(b)) if a < b => {
                for ext in name[a + 1..b].split(',') {
                    out.push(format!("bench/results/{}{ext}", &name[..a]));
                }
            }
            _ => out.push(format!("bench/results/{}", name.split(',').next().unwrap())),
        }
    }
    out
}

/// The values listed in `<!-- given: ... -->` comments of `raw`.
fn given(raw: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = raw;
    while let Some(at) = rest.find("<!-- given:") {
        let body = &rest[at + "<!-- given:".len()..];
        let end = body.find("-->").unwrap_or(body.len());
        // `, ` or `;` between items: `1,000` is one number.
        for item in body[..end].split([';']).flat_map(|i| i.split(", ")) {
            let item = item.trim();
            let found = figures_in(item);
            match found.first() {
                Some(f) => out.insert(f.value.clone()),
                // A bare integer given (`given: 64`) is no figure; keep it as written.
                None => out.insert(item.to_owned()),
            };
        }
        rest = &body[end..];
    }
    out
}

/// `text` with each bench table's body (between `<!-- bench:NAME -->` and its end marker)
/// blanked, line count kept: those are checked against their files whole.
fn without_bench_tables(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(a) = rest.find("<!-- bench:") {
        let name_end = rest[a..].find(" -->").map_or(rest.len(), |e| a + e + 4);
        let name = &rest[a + "<!-- bench:".len()..name_end.saturating_sub(4)];
        let end_marker = format!("<!-- /bench:{name} -->");
        let Some(b) = rest[name_end..].find(&end_marker).map(|b| name_end + b) else {
            break;
        };
        out.push_str(&rest[..name_end]);
        out.extend(rest[name_end..b].chars().filter(|c| *c == '\n'));
        rest = &rest[b..];
        out.push_str(&end_marker);
        rest = &rest[end_marker.len()..];
    }
    out.push_str(rest);
    out
}

/// A paragraph, list item (the outermost, with what it holds), table row or heading.
struct Unit {
    range: Range<usize>,
    prose: String,
    /// Its HTML (the `given:` comments), not what code spans show of it.
    html: String,
}

/// Checks one document: every figure of its prose is in a results file it names.
pub(crate) fn check_document(text: &str, results: &Results) -> Vec<Finding> {
    let text = without_bench_tables(text);
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut options = Options::empty();
    options.insert(Options::ENABLE_TABLES);
    options.insert(Options::ENABLE_FOOTNOTES);
    options.insert(Options::ENABLE_STRIKETHROUGH);
    options.insert(Options::ENABLE_TASKLISTS);
    options.insert(Options::ENABLE_HEADING_ATTRIBUTES);
    let mut findings = Vec::new();
    let mut section: Vec<String> = Vec::new();
    let mut unit: Option<(Unit, usize)> = None;
    let mut depth = 0usize;
    let mut in_code_block = false;
    let not_committed = |names: &[String], line: usize, findings: &mut Vec<Finding>| {
        for name in names {
            if !results.files.contains_key(name) {
                findings.push(Finding {
                    line,
                    what: format!("names {name}, which is not a committed results file"),
                });
            }
        }
    };
    let judge = |u: Unit, section: &[String], findings: &mut Vec<Finding>| {
        let raw = &text[u.range.clone()];
        let line = line_of(u.range.start);
        let own = mentions(raw);
        not_committed(&own, line, findings);
        let named: Vec<String> = section.iter().cloned().chain(own).collect();
        let given = given(&u.html);
        let sourced = !named.is_empty();
        let figures: Vec<Figure> = figures_in(&u.prose)
            .into_iter()
            .filter(|f| sourced || !f.whole_time)
            .collect();
        for g in &given {
            if !figures.iter().any(|f| &f.value == g) {
                findings.push(Finding {
                    line,
                    what: format!("`given: {g}` is not a figure of this paragraph"),
                });
            }
        }
        for f in figures.iter().filter(|f| !given.contains(&f.value)) {
            let sources: Vec<&String> = named
                .iter()
                .filter(|n| results.files.contains_key(*n))
                .collect();
            if sources.is_empty() {
                findings.push(Finding {
                    line,
                    what: format!(
                        "`{}` has no source: name its results file (bench/results/NAME.md) \
                         in the paragraph or the section, or list it in <!-- given: ... --> \
                         if it was not measured",
                        f.written
                    ),
                });
            } else if !sources.iter().any(|s| results.files[*s].contains(&f.value)) {
                findings.push(Finding {
                    line,
                    what: format!(
                        "`{}` is not in {}",
                        f.written,
                        sources
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(" or ")
                    ),
                });
            }
        }
    };
    for (event, range) in Parser::new_ext(&text, options).into_offset_iter() {
        match event {
            Event::Start(tag) => {
                depth += 1;
                // Table cells, list items: words on either side of a tag are apart.
                if let Some((u, _)) = unit.as_mut() {
                    u.prose.push(' ');
                }
                match tag {
                    Tag::Heading { .. } => section.clear(),
                    Tag::CodeBlock(_) => in_code_block = true,
                    _ => {}
                }
                let opens = matches!(
                    tag,
                    Tag::Paragraph
                        | Tag::Item
                        | Tag::TableHead
                        | Tag::TableRow
                        | Tag::Heading { .. }
                );
                if opens && unit.is_none() {
                    let u = Unit {
                        range: range.clone(),
                        prose: String::new(),
                        html: String::new(),
                    };
                    unit = Some((u, depth));
                }
            }
            Event::End(tag) => {
                if let Some((u, _)) = unit.as_mut() {
                    u.prose.push(' ');
                }
                if let TagEnd::CodeBlock = tag {
                    in_code_block = false;
                }
                if unit.as_ref().is_some_and(|(_, d)| *d == depth) {
                    let (u, _) = unit.take().unwrap();
                    judge(u, &section, &mut findings);
                }
                depth -= 1;
            }
            Event::Text(t) if !in_code_block => {
                if let Some((u, _)) = unit.as_mut() {
                    u.prose.push_str(&t);
                }
            }
            // Code and breaks separate the words on either side.
            Event::Code(_) | Event::SoftBreak | Event::HardBreak => {
                if let Some((u, _)) = unit.as_mut() {
                    u.prose.push(' ');
                }
            }
            Event::InlineHtml(html) | Event::Html(html) if unit.is_some() => {
                if let Some((u, _)) = unit.as_mut() {
                    u.prose.push(' ');
                    u.html.push_str(&html);
                }
            }
            Event::Html(html) if html.contains("<!-- figures:") => {
                let named = mentions(&html);
                let line = line_of(range.start);
                if named.is_empty() {
                    findings.push(Finding {
                        line,
                        what: "a `figures:` comment that names no bench/results file".into(),
                    });
                }
                not_committed(&named, line, &mut findings);
                section.extend(named);
            }
            _ => {}
        }
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(text: &str) -> Vec<String> {
        figures_in(text).into_iter().map(|f| f.written).collect()
    }

    #[test]
    fn figures_are_numbers_with_a_unit_a_point_or_thousands() {
        assert_eq!(
            values("adds +2.53 ms (+2.05; +2.02) at 0.82x, 33,437 requests, 487 MiB, 52%"),
            [
                "+2.53 ms", "+2.05", "+2.02", "0.82x", "33,437", "487 MiB", "52%"
            ]
        );
        assert_eq!(
            values("1,699 requests/s and 12 s"),
            ["1,699 requests/s", "12 s"]
        );
    }

    #[test]
    fn versions_words_dates_commits_and_counts_are_not_figures() {
        assert!(
            values(
                "Pulsar 4.0.8 on 127.0.0.1, p50 of 64 callers, SmolLM2-135M, commit 3a8d1e8, \
                 2026-11-29 08:45 UTC, 5xx, 92 x timeout, tokens-20-1-50, 1st, §4.4"
            )
            .is_empty()
        );
    }

    #[test]
    fn a_results_file_holds_its_numbers_as_written() {
        let n = numbers_of("| 1 | +0.67 | 13959 tokens/s | 0.804 | 2150, then 2044 | 1.03x |");
        for v in ["1", "0.67", "13959", "0.804", "2150", "2044", "1.03"] {
            assert!(n.contains(v), "{v} in {n:?}");
        }
        assert!(!n.contains("0.80"));
        let n = numbers_of("commit 9f68c04, p50 7");
        assert!(
            !n.contains("9") && !n.contains("50") && n.contains("7"),
            "{n:?}"
        );
    }

    fn results() -> Results {
        let mut files = HashMap::new();
        files.insert(
            "bench/results/run.md".to_owned(),
            numbers_of("| a | +0.67 | 1.03x | 13.9 |"),
        );
        Results { files }
    }

    fn problems(doc: &str) -> Vec<String> {
        check_document(doc, &results())
            .into_iter()
            .map(|f| format!("{}: {}", f.line, f.what))
            .collect()
    }

    #[test]
    fn a_figure_from_its_named_file_passes() {
        assert!(problems("It adds +0.67 ms (`bench/results/run.md`).\n").is_empty());
        assert!(
            problems("## A\n\n<!-- figures: bench/results/run.md -->\n\n- 1.03x\n- 13.9 MiB\n")
                .is_empty()
        );
    }

    #[test]
    fn a_figure_without_a_source_fails() {
        let p = problems("It adds +0.22 ms at one caller.\n");
        assert!(
            p.len() == 1 && p[0].contains("`+0.22 ms` has no source"),
            "{p:?}"
        );
    }

    #[test]
    fn a_figure_not_in_its_file_fails_rounded_or_retyped() {
        let p = problems("It adds 0.7 ms and 1.03x (`bench/results/run.md`).\n");
        assert!(p.len() == 1 && p[0].contains("`0.7 ms` is not in"), "{p:?}");
    }

    #[test]
    fn a_section_source_ends_at_the_next_heading() {
        let p = problems("## A\n\n<!-- figures: bench/results/run.md -->\n\n## B\n\n1.03x\n");
        assert!(p.len() == 1 && p[0].starts_with("7: "), "{p:?}");
    }

    #[test]
    fn a_named_file_that_is_not_committed_fails() {
        let p = problems("Such a run writes `bench/results/partial.*`: 1.03x.\n");
        assert!(
            p.iter().any(|p| p.contains("not a committed results file")),
            "{p:?}"
        );
    }

    #[test]
    fn a_given_number_is_exempt_in_its_paragraph_only() {
        assert!(problems("Under 500 MB.<!-- given: 500 MB -->\n").is_empty());
        let p = problems("Under 500 MB.<!-- given: 500 MB -->\n\nAnd 500 MB.\n");
        assert!(p.len() == 1 && p[0].starts_with("3: "), "{p:?}");
        let p = problems("Under 500 MB.<!-- given: 400 MB, 500 MB -->\n");
        assert!(p.len() == 1 && p[0].contains("`given: 400`"), "{p:?}");
    }

    #[test]
    fn code_and_bench_tables_are_not_prose() {
        assert!(problems("Run `--pace 0.5` then:\n\n```\n1.5 s\n```\n").is_empty());
        assert!(problems("<!-- bench:run -->\n| 9.99 ms |\n<!-- /bench:run -->\n").is_empty());
    }

    #[test]
    fn a_header_says_when_at_which_commit_where_and_how() {
        let good = "Measured 2026-11-29 08:26 UTC at commit 17d63f0 on this machine (2 cores, \
                    release build) by `bash bench/run.sh overhead`: release build.";
        assert_eq!(header_problem(good), None);
        let dirty = good.replace("17d63f0 on", "17d63f0 with uncommitted changes on");
        assert!(header_problem(&dirty).unwrap().contains("uncommitted"));
        let no_machine = good.replace(" on this machine (2 cores, release build)", "");
        assert!(header_problem(&no_machine).unwrap().contains("machine"));
        let no_command = good.replace(" by `bash bench/run.sh overhead`", "");
        assert!(header_problem(&no_command).unwrap().contains("command"));
        assert!(header_problem("Results of a run").is_some());
        assert!(header_problem("Measured 2026-11-29 at commit 17d63f0 on x by `y`").is_some());
    }
}
