//! The MCP client (to be written).
