//! The prompt service's reading of model output: the incremental JSON-lines parser, JSON
//! extraction from a whole answer, and the built-in templates' normalisers run on what they
//! find. Properties: no panic; the same items however the text is split.

use sluice_prompt::{normalise, output};

fn items(pieces: &[&str]) -> Vec<output::LineItem> {
    let mut parser = output::JsonlParser::default();
    let mut out = Vec::new();
    for p in pieces {
        out.extend(parser.push(p));
    }
    out.extend(parser.finish());
    out
}

/// Runs the normaliser `selector` picks among every registered one (each contract's included).
fn normalise(selector: u8, value: &serde_json::Value) {
    let count = normalise::names().count();
    let name = normalise::names().nth(usize::from(selector) % count);
    if let Some(normaliser) = name.and_then(normalise::by_name) {
        let mut v = value.clone();
        let _ = normaliser(&mut v);
    }
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        let text = String::from_utf8_lossy(input.body);
        let whole = items(&[&text]);
        let split = items(&sluice_fuzz::text_chunks(&text, input.split));
        assert_eq!(whole, split, "the split changed the items");
        for item in &whole {
            if let output::LineItem::Object { value, .. } = item {
                normalise(input.selector, value);
            }
        }
        if let Ok(value) = output::extract_json(&text) {
            normalise(input.selector, &value);
        }
    });
}
