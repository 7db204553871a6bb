//! The SSE provider decoders (OpenAI dialect, Anthropic, Gemini, Cohere) from response body
//! bytes to chunks, through the same `decode_stream` the providers run. Properties: no
//! panic; the same chunks and error however the body is split; chunk text never longer
//! than the body.

use sluice_text_completion::providers;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        let decode = match input.selector % 4 {
            0 => providers::openai::decode_stream,
            1 => providers::anthropic::decode_stream,
            2 => providers::gemini::decode_stream,
            _ => providers::cohere::decode_stream,
        };
        sluice_fuzz::check_stream_decoder(
            decode,
            input.body,
            &sluice_fuzz::chunks(input.body, input.split),
        );
    });
}
