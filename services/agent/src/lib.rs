//! sluice-agent: the agent processor, a streaming ReAct loop over the bus.
//!
//! - [`handler`]: one ReAct iteration per request, handing the next step on over the bus;
//! - [`react`]: the streaming parser of the model's ReAct output (thought, action with
//!   arguments, final answer), markers split across tokens;
//! - [`tools`]: tool configuration, group and state filters, invocation;
//! - [`mcp`]: a client for tools on MCP servers (streamable HTTP, JSON-RPC);
//! - [`metrics`]: the agent's metrics (`sluice_agent_*`);
//! - [`patterns`]: TrustGraph 2.11's orchestrator patterns beside ReAct: meta-routing and
//!   plan-then-execute;
//! - [`flows`]: an agent assembled from its tools, and the flows TrustGraph's config service
//!   assigns.

pub mod fanin;
pub mod flows;
pub mod handler;
pub mod mcp;
pub mod metrics;
pub mod patterns;
pub mod react;
pub mod tools;
