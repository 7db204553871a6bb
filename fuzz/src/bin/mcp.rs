//! The agent's MCP client reading a server's reply: a JSON body or an SSE stream of
//! JSON-RPC messages, then the answer read as a tools/list page and a tools/call result.
//! Properties: no panic; the same reading however the body is split.

use std::convert::Infallible;

fn read(event_stream: bool, pieces: &[&[u8]]) -> String {
    let body = futures::stream::iter(
        pieces
            .iter()
            .map(|p| Ok::<_, Infallible>(p.to_vec()))
            .collect::<Vec<_>>(),
    );
    sluice_fuzz::block_on(sluice_agent::mcp::describe_reply(event_stream, body, 1))
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        let event_stream = input.selector % 2 == 1;
        let whole = read(event_stream, &[input.body]);
        let split = read(event_stream, &sluice_fuzz::chunks(input.body, input.split));
        assert_eq!(whole, split, "the split changed the reading");
    });
}
