//! The agent's modes: what it does with plain prose, what a non-streaming request gets, and
//! how the model calls tools.

/// What the agent does with a model response in plain prose: no `Thought:`, `Action:` or
/// `Final Answer:` marker at all. Small local models answer this way all the time, and
/// their prose is usually the answer a user wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlainAnswer {
    /// The prose is the final answer at once (no second model call).
    Final,
    /// One corrective retry first; if the model answers in prose again, the first prose is
    /// the final answer (it answers the question; the second answers the correction). A
    /// model that can follow the format gets its chance to use tools.
    #[default]
    RetryFinal,
    /// One corrective retry, then an `agent-error` (strict ReAct).
    Error,
}

impl PlainAnswer {
    /// Every value's name, for options and messages.
    pub const NAMES: [&'static str; 3] = ["final", "retry-final", "error"];

    /// The option value this is.
    pub fn as_str(self) -> &'static str {
        match self {
            PlainAnswer::Final => "final",
            PlainAnswer::RetryFinal => "retry-final",
            PlainAnswer::Error => "error",
        }
    }
}

impl std::str::FromStr for PlainAnswer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "final" => Ok(PlainAnswer::Final),
            "retry-final" => Ok(PlainAnswer::RetryFinal),
            "error" => Ok(PlainAnswer::Error),
            other => Err(format!(
                "unknown plain-answer {other:?}; expected one of {}",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// What a non-streaming request (`streaming: false`) gets. TrustGraph's streaming spec says one
/// response with the complete answer; TrustGraph 2.x's agent sends each thought, action and
/// observation whole before the answer, and its `tg-invoke-agent --no-streaming -v` shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonStreaming {
    /// One record: the answer (or the terminal error), with the whole dialog's usage.
    #[default]
    Answer,
    /// Every step's messages, each whole, then the answer.
    Steps,
}

impl NonStreaming {
    /// Every value's name, for options and messages.
    pub const NAMES: [&'static str; 2] = ["answer", "steps"];
}

impl std::str::FromStr for NonStreaming {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "answer" => Ok(NonStreaming::Answer),
            "steps" => Ok(NonStreaming::Steps),
            other => Err(format!(
                "unknown non-streaming reply {other:?}; expected one of {}",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// How the agent has the model call tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolCalling {
    /// The ReAct text format ([`DEFAULT_REACT_TEMPLATE`]) parsed from the model's text:
    /// works with any model, streams thoughts and answers piece by piece.
    #[default]
    React,
    /// The provider's own tool calling: the tools on the text-completion request, the calls
    /// on its records, several per turn, arguments checked against each tool's schema; needs a
    /// text-completion processor whose provider calls tools (docs/agent.md).
    Native,
}

impl ToolCalling {
    /// The values `--tool-calling` takes.
    pub const NAMES: [&'static str; 2] = ["react", "native"];
}

impl std::str::FromStr for ToolCalling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "react" => Ok(Self::React),
            "native" => Ok(Self::Native),
            other => Err(format!("expected react or native, not {other:?}")),
        }
    }
}
