//! The streaming ReAct parser (to be written).
