//! One dialog's side of an iteration: the records it publishes (each carrying the usage not
//! passed on yet), a tool's result taken into it, and its terminal error.

use std::collections::BTreeMap;

use sluice_runtime::{processor::ResponseSink, sink::SinkError};
use sluice_schema::{
    AgentMessageType, AgentRequest, AgentResponse, AgentStep, Error, ErrorKind, PendingUsage,
    ResponseRecord, add_tokens,
};

use crate::tools::Tokens;

pub(crate) struct Dialog<'a> {
    pub(crate) sink: &'a mut ResponseSink<AgentResponse>,
    pub(crate) usage: PendingUsage,
    pub(crate) streaming: bool,
    /// Whether thoughts, actions and observations are published (streamed, or whole).
    pub(crate) steps: bool,
    /// Set for a supervisor's subagent: nothing is published; its end is kept here for the
    /// fan-in instead.
    pub(crate) capture: Option<Captured>,
}

/// A subagent's end, kept instead of published.
#[derive(Debug, Default)]
pub(crate) struct Captured {
    /// Its answer, or the message of the error that ended it.
    pub(crate) end: Option<Result<String, String>>,
}

/// A record of the dialog, carrying the usage no record passed on yet.
pub(crate) fn message(
    usage: &mut PendingUsage,
    message_type: AgentMessageType,
    content: String,
    end_of_message: bool,
    end_of_dialog: bool,
) -> AgentResponse {
    let (in_token, out_token) = usage.take();
    AgentResponse {
        message_type,
        content,
        end_of_message,
        end_of_dialog,
        in_token,
        out_token,
        model: usage.model.clone(),
        ..AgentResponse::default()
    }
}

/// A record that could not be published: the request is attempted again.
pub(crate) fn unsent(e: SinkError) -> Error {
    Error::new(ErrorKind::Internal, e.to_string())
}

impl Dialog<'_> {
    pub(crate) async fn send(
        &mut self,
        message_type: AgentMessageType,
        content: String,
        end_of_message: bool,
        end_of_dialog: bool,
    ) -> Result<(), Error> {
        if let Some(capture) = &mut self.capture {
            if end_of_dialog {
                capture.end = Some(Ok(content));
            }
            return Ok(());
        }
        let record = message(
            &mut self.usage,
            message_type,
            content,
            end_of_message,
            end_of_dialog,
        );
        self.sink.send(record).await.map_err(unsent)
    }

    /// An `action` record: the tool's name as its content, as TrustGraph's streaming spec shows
    /// it (TrustGraph's own readers take an action's content as text to show), and its
    /// arguments in sluice's `arguments` field (docs/protocol.md#agent-messages).
    pub(crate) async fn send_action(
        &mut self,
        name: String,
        arguments: BTreeMap<String, String>,
    ) -> Result<(), Error> {
        if self.capture.is_some() {
            return Ok(());
        }
        let mut record = message(&mut self.usage, AgentMessageType::Action, name, true, false);
        record.arguments = Some(arguments);
        self.sink.send(record).await.map_err(unsent)
    }

    /// Counts what a tool call spent on models as the dialog's usage. The tool's model call
    /// was billed to the dialog's caller (the key and its seal are forwarded), and the caller's
    /// per-key token limits at the gateway count the usage the dialog's records carry: so it
    /// goes out with them (the next record, or the hand-off's pending counts) like the
    /// dialog's own model calls'.
    pub(crate) fn spent(&mut self, (input, output): Tokens) {
        self.usage.in_token = add_tokens(self.usage.in_token, input);
        self.usage.out_token = add_tokens(self.usage.out_token, output);
    }

    /// A tool's result taken into the dialog, the same for a ReAct action and a native call:
    /// what it spent counted, its observation published (with steps), `step` recorded in the
    /// request's history with that observation, and the state the tool moved the dialog to,
    /// if any, the request's.
    pub(crate) async fn observe(
        &mut self,
        request: &mut AgentRequest,
        (observation, next_state, tokens): (String, Option<String>, Tokens),
        step: AgentStep,
    ) -> Result<(), Error> {
        self.spent(tokens);
        if self.steps {
            self.send(
                AgentMessageType::Observation,
                observation.clone(),
                true,
                false,
            )
            .await?;
        }
        request.history.push(AgentStep {
            observation,
            ..step
        });
        if next_state.is_some() {
            request.state = next_state;
        }
        Ok(())
    }

    /// The terminal error, with the usage so far.
    pub(crate) async fn fail(&mut self, error: Error) -> Result<(), Error> {
        if let Some(capture) = &mut self.capture {
            capture.end = Some(Err(error.message));
            return Ok(());
        }
        let mut record = AgentResponse::from_error(error);
        (record.in_token, record.out_token) = self.usage.take();
        record.model.clone_from(&self.usage.model);
        self.sink.send(record).await.map_err(unsent)
    }
}
