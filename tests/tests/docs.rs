//! The documentation holds together: the README, `CHANGELOG.md` and the book in `docs/`
//! (built by `scripts/docs.sh` with mdBook, which reports neither broken links nor pages left
//! out of `SUMMARY.md`). No broker, no network.
//!
//! - every relative link names a file that exists, and every `#anchor` a heading of its
//!   target, with the ids mdBook (and GitHub) give headings;
//! - a book page links only inside `docs/` (mdBook serves nothing else), and nothing points
//!   outside the repository;
//! - every page of `docs/` is a chapter of `SUMMARY.md`;
//! - the bench's result tables (`<!-- bench:NAME -->` … `<!-- /bench:NAME -->`, spliced by
//!   `bench`) are each in exactly one page of the book;
//! - the README starts with the two set-up commands;
//! - every figure the README and the book quote is in a committed results file, each bench
//!   table is its committed file, and every results file says when, at which commit, on what
//!   machine and by which command it was made (`docs/figures.rs`; the convention is in
//!   docs/benchmarks.md, "Where a figure comes from").
//!
//! Written here rather than taken from mdbook-linkcheck: that plugin pulls an HTTP client and
//! a second Markdown stack into the test command's build, and follows mdBook's releases late;
//! pulldown-cmark (the parser mdBook itself uses) is all the check needs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, HashSet};
use std::path::{Component, Path, PathBuf};

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

use sluice_tests::BENCH_TABLES;

#[path = "docs/figures.rs"]
mod figures;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every Markdown file of the documentation: README.md, CHANGELOG.md and docs/**.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// A link as written in a document.
struct Link {
    dest: String,
    /// 1-based line of the link, for the failure message.
    line: usize,
}

/// A parsed Markdown document: its links and the ids of its headings.
struct Doc {
    links: Vec<Link>,
    ids: HashSet<String>,
}

/// The id mdBook gives a heading (mdbook-html's `id_from_content`; GitHub's is the same for
/// the text used here): lower case, alphanumerics, `-` and `_` kept, whitespace to `-`, the
/// rest dropped.
fn heading_id(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c)
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// How a file is read: a page of the book as mdBook 0.5.4 reads it (mdbook-markdown's
/// default options: smart punctuation turns `--` into a dash that a heading's id drops), the
/// README and the changelog as GitHub does.
#[derive(Clone, Copy)]
enum Reader {
    MdBook,
    GitHub,
}

fn parse(text: &str, reader: Reader) -> Doc {
    let mut options = Options::empty();
    options.insert(Options::ENABLE_TABLES);
    options.insert(Options::ENABLE_FOOTNOTES);
    options.insert(Options::ENABLE_STRIKETHROUGH);
    options.insert(Options::ENABLE_TASKLISTS);
    options.insert(Options::ENABLE_HEADING_ATTRIBUTES);
    if let Reader::MdBook = reader {
        options.insert(Options::ENABLE_SMART_PUNCTUATION);
        options.insert(Options::ENABLE_DEFINITION_LIST);
        options.insert(Options::ENABLE_GFM);
    }
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut links = Vec::new();
    let mut ids = HashSet::new();
    let mut heading: Option<String> = None;
    for (event, range) in Parser::new_ext(text, options).into_offset_iter() {
        match event {
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                links.push(Link {
                    dest: dest_url.to_string(),
                    line: line_of(range.start),
                });
            }
            Event::Start(Tag::Heading { id, .. }) => {
                // An explicit `{#id}` is the heading's id as written, in place of its text's.
                match id {
                    Some(id) => {
                        ids.insert(id.to_string());
                    }
                    None => heading = Some(String::new()),
                }
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some(h) = heading.take() {
                    let id = heading_id(&h);
                    // Repeated headings get -1, -2, ... as mdBook and GitHub number them.
                    let mut unique = id.clone();
                    let mut n = 0;
                    while !ids.insert(unique.clone()) {
                        n += 1;
                        unique = format!("{id}-{n}");
                    }
                }
            }
            _ => {}
        }
    }
    Doc { links, ids }
}

/// `path` with `.` and `..` resolved lexically (the target need not exist yet).
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_link_of_the_documentation_leads_somewhere() {
    let root = root();
    let docs_dir = root.join("docs");
    let files = documents();
    let parsed: BTreeMap<PathBuf, Doc> = files
        .iter()
        .map(|f| {
            let text =
                std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            let reader = if f.starts_with(&docs_dir) {
                Reader::MdBook
            } else {
                Reader::GitHub
            };
            (f.clone(), parse(&text, reader))
        })
        .collect();
    let mut broken = Vec::new();
    for (file, doc) in &parsed {
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        for link in &doc.links {
            let dest = link.dest.as_str();
            if dest.starts_with("http://")
                || dest.starts_with("https://")
                || dest.starts_with("mailto:")
            {
                continue;
            }
            let at = format!("{name}:{}: ({dest})", link.line);
            let (path, anchor) = match dest.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (dest, None),
            };
            let target = if path.is_empty() {
                file.clone()
            } else {
                normalise(&file.parent().unwrap().join(path))
            };
            if !target.starts_with(&root) {
                broken.push(format!("{at} leaves the repository"));
                continue;
            }
            if file.starts_with(&docs_dir) && !target.starts_with(&docs_dir) {
                broken.push(format!(
                    "{at} leaves docs/: the book cannot serve it (write the path as code instead)"
                ));
                continue;
            }
            if !target.exists() {
                broken.push(format!("{at}: no such file"));
                continue;
            }
            if let Some(anchor) = anchor {
                match parsed.get(&target) {
                    Some(t) if t.ids.contains(anchor) => {}
                    Some(_) => broken.push(format!("{at}: no heading with this id")),
                    None => {
                        broken.push(format!("{at}: an anchor into a file that is not Markdown"))
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn nothing_points_outside_the_repository() {
    for file in documents() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, line) in text.lines().enumerate() {
            assert!(
                !line.contains("../shared"),
                "{}:{}: names a file outside the repository: {line}",
                file.display(),
                i + 1
            );
        }
    }
}

#[test]
fn every_page_of_the_book_is_in_its_summary() {
    let docs_dir = root().join("docs");
    let summary = parse(
        &std::fs::read_to_string(docs_dir.join("SUMMARY.md")).unwrap(),
        Reader::MdBook,
    );
    let chapters: HashSet<PathBuf> = summary
        .links
        .iter()
        .map(|l| normalise(&docs_dir.join(l.dest.split('#').next().unwrap_or_default())))
        .collect();
    let missing: Vec<String> = documents()
        .into_iter()
        .filter(|f| f.starts_with(&docs_dir) && !f.ends_with("SUMMARY.md"))
        .filter(|f| !chapters.contains(f))
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "pages mdBook would not build (not in docs/SUMMARY.md): {missing:?}"
    );
}

#[test]
fn each_bench_table_is_in_exactly_one_page_of_the_book() {
    let docs_dir = root().join("docs");
    let pages: Vec<(PathBuf, String)> = documents()
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f).unwrap();
            (f, text)
        })
        .collect();
    for name in BENCH_TABLES {
        let (start, end) = (
            format!("<!-- bench:{name} -->"),
            format!("<!-- /bench:{name} -->"),
        );
        let holders: Vec<&PathBuf> = pages
            .iter()
            .filter(|(_, t)| t.contains(&start) || t.contains(&end))
            .map(|(f, _)| f)
            .collect();
        assert_eq!(
            holders.len(),
            1,
            "{start}: in {holders:?}, expected in one page of docs/"
        );
        let (file, text) = pages.iter().find(|(f, _)| f == holders[0]).unwrap();
        assert!(
            file.starts_with(&docs_dir),
            "{start} is in {}",
            file.display()
        );
        assert_eq!(
            text.matches(&start).count(),
            1,
            "{start} twice in {}",
            file.display()
        );
        let (a, b) = (text.find(&start).unwrap(), text.find(&end));
        assert!(
            b.is_some_and(|b| b > a),
            "{}: {start} without {end} after it",
            file.display()
        );
    }
}

#[test]
fn the_readme_starts_with_the_two_set_up_commands() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let bullets: Vec<&str> = readme
        .lines()
        .skip_while(|l| !l.starts_with("- "))
        .take(2)
        .collect();
    assert!(
        bullets.len() == 2
            && bullets[0].contains("`bash scripts/main.sh`")
            && bullets[1].contains("`bash scripts/test.sh`"),
        "the README's first bullets are not the two commands: {bullets:?}"
    );
    let first_bullet = readme.lines().position(|l| l.starts_with("- "));
    assert!(
        first_bullet.is_some_and(|i| i <= 3),
        "the commands are not in the README's first lines"
    );
}

/// The stage budgets of docs/testing.md are the test command's (`BUDGET_COLD`, `BUDGET_WARM`
/// in scripts/test.sh), and they add up to the run's targets (45 minutes from nothing, 25 with
/// the caches filled; `unit` is not part of a full run): the page says what a new test must
/// fit in, the script warns when a stage does not.
#[test]
fn the_testing_pages_stage_budgets_are_the_test_commands_and_fit_the_targets() {
    let script = std::fs::read_to_string(root().join("scripts/test.sh")).unwrap();
    let page = std::fs::read_to_string(root().join("docs/testing.md")).unwrap();
    let in_script = |name: &str| -> BTreeMap<String, u64> {
        let start = script
            .find(&format!("declare -A {name}=("))
            .unwrap_or_else(|| panic!("no {name} in scripts/test.sh"));
        let body = &script[start..];
        let body = &body[body.find('(').unwrap() + 1..body.find(')').unwrap()];
        body.split_whitespace()
            .filter_map(|kv| {
                let (k, v) = kv.strip_prefix('[')?.split_once("]=")?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect()
    };
    // The page's table rows: | `key` ... | what it proves | cold | warm |
    let (mut cold, mut warm) = (BTreeMap::new(), BTreeMap::new());
    for line in page.lines() {
        let Some((key, _)) = line.strip_prefix("| `").and_then(|r| r.split_once('`')) else {
            continue;
        };
        let cells: Vec<&str> = line
            .trim_end_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        let n = cells.len();
        if let (Ok(c), Ok(w)) = (cells[n - 2].parse::<u64>(), cells[n - 1].parse::<u64>()) {
            cold.insert(key.to_owned(), c);
            warm.insert(key.to_owned(), w);
        }
    }
    assert_eq!(
        cold,
        in_script("BUDGET_COLD"),
        "cold budgets: docs/testing.md, scripts/test.sh"
    );
    assert_eq!(
        warm,
        in_script("BUDGET_WARM"),
        "warm budgets: docs/testing.md, scripts/test.sh"
    );
    let sum = |b: &BTreeMap<String, u64>| {
        b.iter()
            .filter(|(k, _)| *k != "unit")
            .map(|(_, v)| v)
            .sum::<u64>()
    };
    assert!(
        sum(&cold) <= 45 * 60,
        "the cold budgets add up to {} s",
        sum(&cold)
    );
    assert!(
        sum(&warm) <= 25 * 60,
        "the warm budgets add up to {} s",
        sum(&warm)
    );
}

#[test]
fn heading_ids_are_mdbooks() {
    assert_eq!(
        heading_id("Production Pulsar: TLS, tokens"),
        "production-pulsar-tls-tokens"
    );
    assert_eq!(
        heading_id("The gateway, `sluice serve`"),
        "the-gateway-sluice-serve"
    );
    let doc = parse("# A\n\n## A\n\n## B {#custom}\n", Reader::GitHub);
    assert!(doc.ids.contains("a") && doc.ids.contains("a-1") && doc.ids.contains("custom"));
    // In the book `--` is a dash, which the id drops; on GitHub it stays.
    assert!(parse("## A -- B\n", Reader::MdBook).ids.contains("a--b"));
    assert!(parse("## A -- B\n", Reader::GitHub).ids.contains("a----b"));
}

/// A bench table's body in a page: what lies between its markers.
fn bench_table_body<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let start = format!("<!-- bench:{name} -->\n");
    let end = format!("<!-- /bench:{name} -->");
    let a = text.find(&start)? + start.len();
    let b = a + text[a..].find(&end)?;
    Some(&text[a..b])
}

#[test]
fn each_bench_table_is_its_committed_results_file() {
    let root = root();
    let pages: Vec<(PathBuf, String)> = documents()
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f).unwrap();
            (f, text)
        })
        .collect();
    let mut wrong = Vec::new();
    for name in BENCH_TABLES {
        let Some((page, body)) = pages
            .iter()
            .find_map(|(f, t)| bench_table_body(t, name).map(|b| (f, b)))
        else {
            wrong.push(format!("bench:{name}: no page holds it"));
            continue;
        };
        let file = root.join(format!("bench/results/{name}.md"));
        match std::fs::read_to_string(&file) {
            Ok(committed) if committed == body => {}
            Ok(_) => wrong.push(format!(
                "{}: the bench:{name} table is not bench/results/{name}.md as committed \
                 (a table is spliced by the run that writes the file, never edited)",
                page.display()
            )),
            // No run to show: the page says so in prose, which the figures' check reads.
            Err(_) => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_results_file_says_when_where_and_how_it_was_made() {
    let dir = root().join("bench/results");
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "md") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        if let Some(problem) = figures::header_problem(text.lines().next().unwrap_or_default()) {
            wrong.push(format!("{}: {problem}", path.display()));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_figure_of_the_readme_and_the_book_is_in_a_committed_results_file() {
    let root = root();
    let results = figures::Results::read(&root);
    let mut wrong = Vec::new();
    for file in documents() {
        if file.ends_with("CHANGELOG.md") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        for f in figures::check_document(&text, &results) {
            wrong.push(format!("{name}:{}: {}", f.line, f.what));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} figure(s) without their committed results file (docs/benchmarks.md, \"Where a \
         figure comes from\"):\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
