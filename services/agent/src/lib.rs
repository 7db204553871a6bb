//! sluice-agent: the agent processor, a streaming ReAct loop over the bus.
//!
//! - [`react`]: the streaming parser of the model's ReAct output (thought, action with
//!   arguments, final answer), markers split across tokens;
//! - [`mcp`]: a client for tools on MCP servers (streamable HTTP, JSON-RPC).

pub mod mcp;
pub mod react;
