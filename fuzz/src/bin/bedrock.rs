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
        sluice_fuzz::check_stream_decoder(
            decode,
            input.body,
            &sluice_fuzz::chunks(input.body, input.split),
        );
    });
}
