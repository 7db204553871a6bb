//! The gateway's WebSocket frames (TrustGraph's `/api/v1/socket`): each text frame read by
//! `sluice_gateway::socket::read_frame`, as the socket reads it, and a request frame's
//! `request` decoded as its service's request record, as the socket then decodes it.
//! Properties: no panic; a refusal is a message, with the frame's id when it had one; an
//! accepted request has the id the frame gave.

use sluice_gateway::{
    ServiceKind,
    socket::{SocketFrame, read_frame},
};
use sluice_schema::{AgentRequest, PromptRequest, TextCompletionRequest, decode_value};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        let text = String::from_utf8_lossy(input.body);
        let flow = if input.selector % 2 == 0 { "default" } else { "other" };
        let workspace = if input.selector % 4 < 2 { "default" } else { "other" };
        match read_frame(&text, flow, workspace) {
            Ok(SocketFrame::Auth { .. }) => {}
            Ok(SocketFrame::Request { id, kind, request }) => {
                let frame: serde_json::Value =
                    serde_json::from_str(&text).unwrap_or_else(|e| panic!("accepted, unreadable: {e}"));
                assert_eq!(frame["id"].as_str(), Some(id.as_str()), "the id changed");
                let _ = match kind {
                    ServiceKind::TextCompletion => {
                        decode_value::<TextCompletionRequest>(request).map(drop)
                    }
                    ServiceKind::Prompt => decode_value::<PromptRequest>(request).map(drop),
                    ServiceKind::Agent => decode_value::<AgentRequest>(request).map(drop),
                };
            }
            Err(refusal) => assert!(!refusal.message.is_empty(), "a refusal without a message"),
        }
    });
}
