//! The Bedrock ConverseStream decoder: binary event-stream frames (prelude lengths, both
//! CRCs, headers) to chunks, through the provider's `decode_stream`. Properties: no panic, no
//! allocation driven by a length field (AFL's memory limit catches one), the same chunks
//! however the body is split, chunk text never longer than the body.

use sluice_text_completion::providers;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        let decode = providers::bedrock::decode_stream;
        let whole = sluice_fuzz::decode_chunks(decode, &[input.body]);
        let split =
            sluice_fuzz::decode_chunks(decode, &sluice_fuzz::chunks(input.body, input.split));
        assert_eq!(whole, split, "the split changed what was decoded");
        let text: usize = whole
            .iter()
            .filter_map(|c| c.as_ref().ok())
            .map(|c| c.text.len())
            .sum();
        assert!(text <= input.body.len(), "more text than body");
    });
}
