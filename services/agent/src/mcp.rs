//! The MCP client (placeholder API; the full client replaces this file).

use serde_json::Value;

/// A tool an MCP server offers.
#[derive(Debug, Clone)]
pub struct McpTool {
    /// Name.
    pub name: String,
    /// Description.
    pub description: String,
    /// Input schema.
    pub input_schema: Value,
}

/// A tool call's result.
#[derive(Debug, Clone)]
pub struct ToolResult {
    /// Text content.
    pub text: String,
    /// Whether the tool reported an error.
    pub is_error: bool,
}

/// An MCP failure.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct McpError(pub String);

/// An MCP client.
#[derive(Debug)]
pub struct McpClient {
    url: String,
}

impl McpClient {
    /// A client for `url`.
    pub fn new(url: String) -> Self {
        Self { url }
    }
    /// Lists tools.
    pub async fn tools(&self) -> Result<Vec<McpTool>, McpError> {
        Err(McpError(self.url.clone()))
    }
    /// Calls a tool.
    pub async fn call(&self, _name: &str, _arguments: Value) -> Result<ToolResult, McpError> {
        Err(McpError(self.url.clone()))
    }
}
