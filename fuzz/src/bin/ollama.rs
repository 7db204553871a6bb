//! The Ollama NDJSON stream decoder (through the provider's `decode_stream`) and the NDJSON
//! line splitter under it. Properties: no panic; the same chunks, and the same lines, however
//! the body is split; a line splitter's buffer never holds more than its limit.

use sluice_runtime::ndjson::LineSplitter;
use sluice_text_completion::providers;

fn lines(pieces: &[&[u8]], limit: usize) -> Vec<String> {
    let mut splitter = LineSplitter::new(limit);
    let mut out: Vec<String> = Vec::new();
    for p in pieces {
        out.extend(splitter.push(p).into_iter().map(|l| format!("{l:?}")));
    }
    out.extend(splitter.finish().map(|l| format!("{l:?}")));
    out
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        let pieces = sluice_fuzz::chunks(input.body, input.split);
        if input.selector % 2 == 0 {
            sluice_fuzz::check_stream_decoder(
                providers::ollama::decode_stream,
                input.body,
                &pieces,
            );
        } else {
            // A small limit, so overlong lines are exercised too.
            let limit = usize::from(input.selector / 2) + 1;
            let whole = lines(&[input.body], limit);
            let split = lines(&pieces, limit);
            assert_eq!(whole, split, "the split changed the lines");
        }
    });
}
