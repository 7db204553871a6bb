use super::*;

const ACTION_EXAMPLE: &str = "Thought: I need to look this up.\nAction: search\nArgs: {\n  \"query\": \"capital of France\"\n}\n";
const ANSWER_EXAMPLE: &str =
    "Thought: I know the answer now.\nFinal Answer: Paris is the capital of France.";

/// Realistic outputs, well-formed and not, for the split-invariance properties.
const REALISTIC: &[&str] = &[
    ACTION_EXAMPLE,
    ANSWER_EXAMPLE,
    // Multi-line thought; multi-line markdown answer with a code block whose first
    // line begins like a marker but is not one.
    "Thought: The observation lists two cities.\nI can answer now.\n\nFinal Answer: The cities are:\n- Paris\n- Lyon\n\n```text\nAction items: none\n```\n",
    // Bold markers, Windows line endings, a fenced Args object with values that are
    // not strings and braces inside a string.
    "**Thought:** Search with a limit.\r\nA small one.\r\n**Action:** \"search\"\r\n**Args:**\r\n```json\r\n{\"query\": \"sets {a, b}\", \"limit\": 5, \"exact\": true, \"tags\": [\"x\", \"y\"]}\r\n```\r\n",
    // A preamble, the whole response in a fence, case variations, multi-byte text.
    "Sure, here it is:\n```\nthought: Café ☕ is the word — ünïcödé.\nFINAL ANSWER: It is “café”.\n```\n",
    // Action without Args; Args on the Action line.
    "Thought: list them\nAction: list-tools\n",
    "Thought: quick\nAction: lookup Args: {\"id\": 7}",
    // Errors must not depend on the splits either.
    "Thought: x\nAction: search\nArgs: {\"q\": \"a\"}\nObservation: Paris is the capital.\n",
    "Thought: x\nFinal Answer: Paris\nAction: search\n",
    "Thought: a\nAction: search\nArgs: {'q': 'a'}",
];

fn arguments(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Feeds the pieces one by one, then closes: every event, and the outcome.
fn run(pieces: &[&str]) -> (Vec<Event>, Result<Outcome, ParseError>) {
    let mut parser = ReactParser::new();
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(parser.push(piece));
    }
    events.extend(parser.close());
    (events, parser.finish())
}

/// Adjacent Thought (or Answer) deltas merged into one: how they are cut is free.
fn merged(events: Vec<Event>) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::new();
    for event in events {
        match (out.last_mut(), event) {
            (Some(Event::Thought(a)), Event::Thought(b)) => a.push_str(&b),
            (Some(Event::Answer(a)), Event::Answer(b)) => a.push_str(&b),
            (_, event) => out.push(event),
        }
    }
    out
}

fn thought_of(events: &[Event]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Thought(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

fn answer_of(events: &[Event]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Answer(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

/// The deltas add up to the outcome's text, and `parse` agrees with the stream.
fn assert_consistent(text: &str, events: &[Event], outcome: &Result<Outcome, ParseError>) {
    assert_eq!(
        &parse(text),
        outcome,
        "parse() differs from streaming for {text:?}"
    );
    match outcome {
        Ok(Outcome::Answer { thought, answer }) => {
            assert_eq!(&thought_of(events), thought, "{text:?}");
            assert_eq!(&answer_of(events), answer, "{text:?}");
        }
        Ok(Outcome::Action {
            thought,
            name,
            arguments,
        }) => {
            assert_eq!(&thought_of(events), thought, "{text:?}");
            assert_eq!(answer_of(events), "", "{text:?}");
            let action = Event::Action {
                name: name.clone(),
                arguments: arguments.clone(),
            };
            assert_eq!(
                events.iter().filter(|e| **e == action).count(),
                1,
                "one Action event for {text:?}: {events:?}"
            );
        }
        Err(_) => {}
    }
}

fn boundaries(text: &str) -> Vec<usize> {
    text.char_indices()
        .map(|(i, _)| i)
        .chain(std::iter::once(text.len()))
        .collect()
}

/// Every split into 2 and 3 pieces, and one char at a time, gives the same merged
/// events and outcome as the whole text.
fn assert_split_invariant(text: &str) {
    let (whole_events, whole) = run(&[text]);
    assert_consistent(text, &whole_events, &whole);
    let expected = merged(whole_events);
    let cuts = boundaries(text);
    for &i in &cuts {
        let (events, outcome) = run(&[&text[..i], &text[i..]]);
        assert_eq!(merged(events), expected, "{text:?} split at {i}");
        assert_eq!(outcome, whole, "{text:?} split at {i}");
    }
    for (n, &i) in cuts.iter().enumerate() {
        for &j in &cuts[n..] {
            let (events, outcome) = run(&[&text[..i], &text[i..j], &text[j..]]);
            assert_eq!(merged(events), expected, "{text:?} split at {i}, {j}");
            assert_eq!(outcome, whole, "{text:?} split at {i}, {j}");
        }
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    let (events, outcome) = run(&pieces);
    assert_consistent(text, &events, &outcome);
    assert_eq!(merged(events), expected, "{text:?} one char at a time");
    assert_eq!(outcome, whole, "{text:?} one char at a time");
}

fn error_of(text: &str) -> String {
    match parse(text) {
        Err(e) => e.to_string(),
        Ok(outcome) => panic!("{text:?} parsed as {outcome:?}"),
    }
}

fn answer(thought: &str, answer: &str) -> Result<Outcome, ParseError> {
    Ok(Outcome::Answer {
        thought: thought.into(),
        answer: answer.into(),
    })
}

fn action(thought: &str, name: &str, args: &[(&str, &str)]) -> Result<Outcome, ParseError> {
    Ok(Outcome::Action {
        thought: thought.into(),
        name: name.into(),
        arguments: arguments(args),
    })
}

// --- The two shapes of the format -------------------------------------------

#[test]
fn action_example_parses_whole_and_streamed() {
    let expected = action(
        "I need to look this up.",
        "search",
        &[("query", "capital of France")],
    );
    assert_eq!(parse(ACTION_EXAMPLE), expected);
    let (events, outcome) = run(&[ACTION_EXAMPLE]);
    assert_eq!(outcome, expected);
    assert_eq!(
        merged(events),
        vec![
            Event::Thought("I need to look this up.".into()),
            Event::ThoughtEnd,
            Event::Action {
                name: "search".into(),
                arguments: arguments(&[("query", "capital of France")]),
            },
        ]
    );
    assert_split_invariant(ACTION_EXAMPLE);
}

#[test]
fn answer_example_parses_whole_and_streamed() {
    let expected = answer("I know the answer now.", "Paris is the capital of France.");
    assert_eq!(parse(ANSWER_EXAMPLE), expected);
    let (events, _) = run(&[ANSWER_EXAMPLE]);
    assert_eq!(
        merged(events),
        vec![
            Event::Thought("I know the answer now.".into()),
            Event::ThoughtEnd,
            Event::Answer("Paris is the capital of France.".into()),
        ]
    );
    assert_split_invariant(ANSWER_EXAMPLE);
}

#[test]
fn every_split_of_realistic_outputs_gives_the_same_events_and_outcome() {
    for text in REALISTIC {
        assert_split_invariant(text);
    }
}

#[test]
fn realistic_outputs_parse_as_expected() {
    assert_eq!(
        parse(REALISTIC[2]),
        answer(
            "The observation lists two cities.\nI can answer now.",
            "The cities are:\n- Paris\n- Lyon\n\n```text\nAction items: none\n```"
        )
    );
    assert_eq!(
        parse(REALISTIC[3]),
        action(
            "Search with a limit.\nA small one.",
            "search",
            &[
                ("query", "sets {a, b}"),
                ("limit", "5"),
                ("exact", "true"),
                ("tags", "[\"x\",\"y\"]"),
            ]
        )
    );
    assert_eq!(
        parse(REALISTIC[4]),
        answer("Café ☕ is the word — ünïcödé.", "It is “café”.")
    );
    assert_eq!(parse(REALISTIC[5]), action("list them", "list-tools", &[]));
    assert_eq!(
        parse(REALISTIC[6]),
        action("quick", "lookup", &[("id", "7")])
    );
}

// --- Streaming: as early as is safe -----------------------------------------

#[test]
fn thought_streams_before_the_thought_ends() {
    let mut parser = ReactParser::new();
    assert_eq!(
        parser.push("Thought: I need to look"),
        vec![Event::Thought("I need to look".into())]
    );
    // The newline and `Act` are held: they may be the end of the thought.
    assert_eq!(
        parser.push(" this up.\nAct"),
        vec![Event::Thought(" this up.".into())]
    );
    assert_eq!(parser.push("ion: search\n"), vec![Event::ThoughtEnd]);
    assert_eq!(parser.push("Args: {\"query\": \"capital"), vec![]);
    assert_eq!(
        parser.push(" of France\"}"),
        vec![Event::Action {
            name: "search".into(),
            arguments: arguments(&[("query", "capital of France")]),
        }]
    );
    assert_eq!(parser.close(), vec![]);
}

#[test]
fn a_held_line_start_that_is_not_a_marker_streams_as_soon_as_it_differs() {
    let mut parser = ReactParser::new();
    parser.push("Thought: first line\n");
    assert_eq!(parser.push("A"), vec![]);
    assert_eq!(parser.push("l"), vec![Event::Thought("\nAl".into())]);
}

#[test]
fn answer_streams_live() {
    let mut parser = ReactParser::new();
    assert_eq!(parser.push("Thought: known\nFinal Answer: Paris"), {
        vec![
            Event::Thought("known".into()),
            Event::ThoughtEnd,
            Event::Answer("Paris".into()),
        ]
    });
    assert_eq!(parser.push(" is"), vec![Event::Answer(" is".into())]);
    assert_eq!(
        parser.push(" the capital.  \n"),
        vec![Event::Answer(" the capital.".into())]
    );
    assert_eq!(parser.close(), vec![]);
    assert_eq!(parser.finish(), answer("known", "Paris is the capital."));
}

#[test]
fn a_marker_split_over_many_deltas_is_recognised() {
    let pieces = ["Thought: sure\nFin", "al Ans", "wer:", " Paris"];
    let mut parser = ReactParser::new();
    assert_eq!(parser.push(pieces[0]), vec![Event::Thought("sure".into())]);
    assert_eq!(parser.push(pieces[1]), vec![]);
    assert_eq!(parser.push(pieces[2]), vec![Event::ThoughtEnd]);
    assert_eq!(parser.push(pieces[3]), vec![Event::Answer("Paris".into())]);
    assert_eq!(parser.finish(), answer("sure", "Paris"));
}

#[test]
fn the_tail_held_at_the_end_is_released_by_close() {
    // The last line could have begun `Action:` until the output ended.
    let text = "Final Answer: The options are B and\nA";
    let mut parser = ReactParser::new();
    assert_eq!(
        parser.push(text),
        vec![Event::Answer("The options are B and".into())]
    );
    assert_eq!(parser.close(), vec![Event::Answer("\nA".into())]);
    assert_eq!(parser.finish(), answer("", "The options are B and\nA"));
}

#[test]
fn an_action_without_args_is_announced_at_close() {
    let mut parser = ReactParser::new();
    assert_eq!(
        parser.push("Thought: t\nAction: list-tools\n"),
        vec![Event::Thought("t".into()), Event::ThoughtEnd]
    );
    assert_eq!(
        parser.close(),
        vec![Event::Action {
            name: "list-tools".into(),
            arguments: BTreeMap::new(),
        }]
    );
}

// --- Tolerance ---------------------------------------------------------------

#[test]
fn leading_and_trailing_whitespace_are_ignored() {
    assert_eq!(
        parse("\n\n  Thought:   spaced out  \n\n  Final Answer:  yes  \n\n"),
        answer("spaced out", "yes")
    );
}

#[test]
fn markdown_bold_markers_are_recognised() {
    assert_eq!(
        parse("**Thought:** t\n**Final Answer:** a"),
        answer("t", "a")
    );
    assert_eq!(
        parse("**Thought**: t\n**Final Answer**: a"),
        answer("t", "a")
    );
    assert_eq!(
        parse("**Thought:** t\n**Action:** **search**\n**Args:** {\"q\": \"x\"}"),
        action("t", "search", &[("q", "x")])
    );
}

#[test]
fn marker_case_does_not_matter() {
    assert_eq!(parse("thought: t\nfinal answer: a"), answer("t", "a"));
    assert_eq!(parse("THOUGHT: t\nFinal answer: a"), answer("t", "a"));
    assert_eq!(
        parse("Thought: t\nACTION: search\nargs: {}"),
        action("t", "search", &[])
    );
}

#[test]
fn args_may_be_fenced_or_in_backticks() {
    let expected = action("t", "search", &[("q", "x")]);
    assert_eq!(
        parse("Thought: t\nAction: search\nArgs:\n```json\n{\"q\": \"x\"}\n```"),
        expected
    );
    assert_eq!(
        parse("Thought: t\nAction: search\nArgs: ```{\"q\": \"x\"}```\n"),
        expected
    );
    assert_eq!(
        parse("Thought: t\nAction: search\nArgs: `{\"q\": \"x\"}`"),
        expected
    );
}

#[test]
fn final_answer_without_a_thought_has_an_empty_thought() {
    let (events, outcome) = run(&["Final Answer: Paris."]);
    assert_eq!(outcome, answer("", "Paris."));
    // No thought was given, so none is announced.
    assert_eq!(events, vec![Event::Answer("Paris.".into())]);
    assert_eq!(
        parse("Action: search\nArgs: {\"q\": \"x\"}"),
        action("", "search", &[("q", "x")])
    );
}

#[test]
fn windows_line_endings_read_as_newlines() {
    assert_eq!(
        parse(
            "Thought: line one\r\nline two\r\nAction: search\r\nArgs: {\r\n  \"q\": \"x\"\r\n}\r\n"
        ),
        action("line one\nline two", "search", &[("q", "x")])
    );
}

#[test]
fn text_before_the_first_marker_is_discarded() {
    let (events, outcome) =
        run(&["Question: what is it?\nLet me think.\nThought: t\nFinal Answer: a"]);
    assert_eq!(outcome, answer("t", "a"));
    assert_eq!(thought_of(&events), "t");
}

#[test]
fn a_whole_response_fence_is_not_part_of_the_answer() {
    assert_eq!(
        parse("```\nThought: t\nFinal Answer: a\n```"),
        answer("t", "a")
    );
    // Without an opening fence, a closing one belongs to the answer's code block.
    assert_eq!(
        parse("Thought: t\nFinal Answer: code:\n```\nx\n```"),
        answer("t", "code:\n```\nx\n```")
    );
}

#[test]
fn the_action_name_may_be_quoted_bracketed_or_on_the_next_line() {
    for line in [
        "Action: \"search\"",
        "Action: [search]",
        "Action: `search`",
        "Action:\nsearch",
    ] {
        assert_eq!(
            parse(&format!("Thought: t\n{line}\nArgs: {{}}")),
            action("t", "search", &[]),
            "{line}"
        );
    }
}

#[test]
fn action_none_before_a_final_answer_is_no_action() {
    assert_eq!(
        parse("Thought: t\nAction: None\nFinal Answer: a"),
        answer("t", "a")
    );
}

#[test]
fn argument_values_that_are_not_strings_are_json_encoded() {
    assert_eq!(
        parse(
            "Action: f\nArgs: {\"n\": 1.5, \"b\": false, \"z\": null, \"o\": {\"k\": [1, 2]}, \"s\": \"a \\\"q\\\"\"}"
        ),
        action(
            "",
            "f",
            &[
                ("n", "1.5"),
                ("b", "false"),
                ("z", "null"),
                ("o", "{\"k\":[1,2]}"),
                ("s", "a \"q\""),
            ]
        )
    );
}

// --- Errors, with the message the model will read ------------------------------

const HINT: &str = "Reply as `Thought: <your reasoning>` followed by either `Action: <tool name>` and `Args: <JSON object>`, or `Final Answer: <the answer>`.";

#[test]
fn empty_output() {
    for text in ["", "  \n\n "] {
        assert_eq!(error_of(text), format!("The response was empty. {HINT}"));
    }
}

#[test]
fn no_markers() {
    assert_eq!(
        error_of("\nParis is the capital of France.\nIt is."),
        format!(
            "The response has no `Thought:`, `Action:` or `Final Answer:` line; it begins `Paris is the capital of France.`. {HINT}"
        )
    );
    let long = "x".repeat(100);
    assert_eq!(
        error_of(&long),
        format!(
            "The response has no `Thought:`, `Action:` or `Final Answer:` line; it begins `{}…`. {HINT}",
            "x".repeat(60)
        )
    );
}

#[test]
fn a_thought_alone() {
    assert_eq!(
        error_of("Thought: I should search."),
        format!(
            "The response has a `Thought:` but no `Action:` or `Final Answer:` after it. {HINT}"
        )
    );
    // A marker not at the start of its line is thought text.
    assert_eq!(
        error_of("Thought: I know. Final Answer: Paris"),
        format!(
            "The response has a `Thought:` but no `Action:` or `Final Answer:` after it. {HINT}"
        )
    );
}

#[test]
fn a_second_thought() {
    assert_eq!(
        error_of("Thought: a\nThought: b\nFinal Answer: c"),
        "The response has a second `Thought:` before any `Action:` or `Final Answer:`. Write a single Thought, then an Action or the Final Answer."
    );
}

#[test]
fn args_without_an_action() {
    assert_eq!(
        error_of("Thought: a\nArgs: {}"),
        format!(
            "The response has `Args:` without an `Action:` line before it naming the tool. {HINT}"
        )
    );
}

#[test]
fn an_action_without_a_name() {
    let message = "The `Action:` line does not name a tool. Write `Action: <tool name>` on its own line, then `Args: <JSON object>`.";
    assert_eq!(error_of("Thought: a\nAction:\nArgs: {\"q\": 1}"), message);
    assert_eq!(error_of("Thought: a\nAction:  \n"), message);
    assert_eq!(error_of("Thought: a\nAction: \"\" Args: {}"), message);
}

#[test]
fn args_without_an_object() {
    let message = "`Args:` is not followed by a JSON object. Write the arguments as a JSON object, e.g. `Args: {\"name\": \"value\"}`, or `Args: {}` for none.";
    assert_eq!(error_of("Thought: a\nAction: search\nArgs:"), message);
    assert_eq!(
        error_of("Thought: a\nAction: search\nArgs:\n```json\n"),
        message
    );
}

#[test]
fn args_that_are_not_an_object() {
    assert_eq!(
        error_of("Thought: a\nAction: search\nArgs: capital of France\nmore"),
        "`Args:` must be followed by a JSON object in braces, but the response has `capital of France`. Write the arguments as a JSON object, e.g. `Args: {\"name\": \"value\"}`."
    );
    assert_eq!(
        error_of("Action: search\nArgs: [\"a\"]"),
        "`Args:` must be followed by a JSON object in braces, but the response has `[\"a\"]`. Write the arguments as a JSON object, e.g. `Args: {\"name\": \"value\"}`."
    );
}

#[test]
fn args_that_are_not_json() {
    assert_eq!(
        error_of("Thought: a\nAction: search\nArgs: {'q': 'a'}"),
        "The `Args:` object is not valid JSON (key must be a string at line 1 column 2). Use double quotes around keys and string values."
    );
}

#[test]
fn args_not_closed() {
    assert_eq!(
        error_of("Thought: a\nAction: search\nArgs: {\"q\": \"a}\"\n"),
        "The `Args:` JSON object is not closed: the response ends before its final `}`."
    );
}

#[test]
fn text_after_the_args() {
    assert_eq!(
        error_of(
            "Thought: x\nAction: search\nArgs: {\"q\": \"a\"}\nObservation: Paris is the capital.\n"
        ),
        "The response goes on after the `Args:` object with `Observation: Paris is the capital.`. Stop after the Args object: the system runs the tool and gives you the Observation."
    );
    assert_eq!(
        error_of("Action: search\nArgs: {\"q\": \"a\"} and more"),
        "The response goes on after the `Args:` object with `and more`. Stop after the Args object: the system runs the tool and gives you the Observation."
    );
    assert_eq!(
        error_of("Action: search\nArgs: {}\nThought: again"),
        "The response goes on after the `Args:` object with `Thought: again`. Stop after the Args object: the system runs the tool and gives you the Observation."
    );
}

#[test]
fn text_after_the_action() {
    assert_eq!(
        error_of("Thought: x\nAction: search\nThe tool will find it.\n"),
        "After `Action: <tool name>` the response should give `Args: <JSON object>`, but it has `The tool will find it.`."
    );
}

#[test]
fn both_an_action_and_an_answer() {
    let message = "The response has both an `Action:` and a `Final Answer:`. Give either an Action with its Args, or a Final Answer, not both.";
    assert_eq!(
        error_of("Thought: x\nAction: search\nArgs: {}\nFinal Answer: Paris"),
        message
    );
    assert_eq!(
        error_of("Thought: x\nAction: search\nFinal Answer: Paris"),
        message
    );
    assert_eq!(
        error_of("Thought: x\nFinal Answer: Paris\nAction: search\n"),
        message
    );
    assert_eq!(error_of("Final Answer: Paris\n**Args:** {}"), message);
}

#[test]
fn an_empty_final_answer() {
    assert_eq!(
        error_of("Thought: done\nFinal Answer:   \n"),
        "The `Final Answer:` is empty. Write the answer after `Final Answer:`."
    );
}
