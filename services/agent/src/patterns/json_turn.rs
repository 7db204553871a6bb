//! One model call whose answer must be JSON of a shape the caller gives: the JSON value found
//! in the answer (a ```json fence and prose around one value tolerated, as small models write
//! it), checked; when it is not usable, ONE corrective retry telling the model exactly what was
//! wrong; then the dialog's terminal `agent-error` naming it. Within the dialog's remaining
//! time, so it never hangs; its usage is the dialog's. It never publishes anything but that
//! terminal error.

use std::time::Duration;

use serde_json::Value;
use sluice_runtime::processor::RequestContext;
use sluice_schema::{Error, ErrorKind};
use tracing::warn;

use super::Generated;
use crate::{
    handler::{AgentService, Dialog},
    metrics::{DialogOutcome, IterationOutcome},
};

/// What a JSON turn gave.
pub(crate) enum Turn<T> {
    /// The checked answer.
    Valid(T),
    /// The dialog has ended: its terminal error is published and counted (the answer unusable
    /// twice, the model call failed, or the dialog's time ran out). The caller returns this.
    Ended(Result<(), Error>),
}

/// The first JSON value in `text`: the model's answer with whatever fence or prose surrounds
/// it; `Err` says what is wrong, in words for the model.
pub(crate) fn extract_json(text: &str) -> Result<Value, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err("the answer was empty; it must be JSON".to_owned());
    }
    let mut first_error = None;
    for (at, c) in trimmed.char_indices() {
        if c != '{' && c != '[' {
            continue;
        }
        let mut values = serde_json::Deserializer::from_str(&trimmed[at..]).into_iter::<Value>();
        match values.next() {
            Some(Ok(v)) => return Ok(v),
            Some(Err(e)) => {
                first_error.get_or_insert_with(|| e.to_string());
            }
            None => {}
        }
    }
    Err(match first_error {
        Some(e) => format!("the answer's JSON does not parse: {e}"),
        None => "the answer has no JSON object or list in it".to_owned(),
    })
}

/// `text`, cut to what a corrective prompt shows of it.
fn shown(text: &str) -> String {
    let mut shown: String = text.chars().take(2000).collect();
    if shown.len() < text.len() {
        shown.push('…');
    }
    shown
}

impl AgentService {
    /// Asks the model `prompt` (the `what` of the dialog, e.g. `plan-create`, for messages)
    /// and reads its answer as JSON through `check`, which gives the value it needs or says
    /// what is wrong with it. An answer that is not usable gets one corrective retry, the
    /// first answer and what was wrong appended to the prompt; a second unusable answer ends
    /// the dialog with an `agent-error` naming what was wrong. The call's usage is the
    /// dialog's; the whole turn keeps within `remaining`.
    pub(crate) async fn json_turn<T>(
        &self,
        what: &str,
        prompt: String,
        check: impl Fn(&Value) -> Result<T, String>,
        dialog: &mut Dialog<'_>,
        ctx: &RequestContext,
        remaining: Duration,
    ) -> Result<Turn<T>, Error> {
        let started = tokio::time::Instant::now();
        let mut asked = prompt.clone();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let left = remaining.saturating_sub(started.elapsed());
            let text = match self.generate(asked, false, dialog, ctx, left).await? {
                Generated::Text(t) => t,
                Generated::Failed(e) => return self.end_turn(dialog, e, false).await,
                Generated::Deadline => {
                    let e = self.deadline_error();
                    return self.end_turn(dialog, e, true).await;
                }
            };
            let why = match extract_json(&text).and_then(|v| check(&v)) {
                Ok(value) => return Ok(Turn::Valid(value)),
                Err(why) => why,
            };
            if attempt > 1 {
                let e = Error::new(
                    ErrorKind::Agent,
                    format!("the model's {what} answer was not usable twice: {why}"),
                );
                return self.end_turn(dialog, e, false).await;
            }
            warn!(turn = what, reason = %why, "model answer not usable JSON; retrying once");
            self.metrics.iteration(IterationOutcome::Retry);
            asked = format!(
                "{prompt}\n{}\n\nThat answer could not be used: {why}\nAnswer again with the JSON only, exactly as asked above.\n",
                shown(&text)
            );
        }
    }

    /// Ends the dialog with `error`, counted as an iteration's error and the dialog's.
    async fn end_turn<T>(
        &self,
        dialog: &mut Dialog<'_>,
        error: Error,
        deadline: bool,
    ) -> Result<Turn<T>, Error> {
        self.metrics.iteration(IterationOutcome::Error);
        self.metrics.dialog(if deadline {
            DialogOutcome::Deadline
        } else {
            DialogOutcome::Error
        });
        Ok(Turn::Ended(dialog.fail(error).await))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn json_is_found_in_a_fence_and_in_prose() {
        assert_eq!(extract_json("[1, 2]").unwrap(), json!([1, 2]));
        assert_eq!(
            extract_json("Here is the plan:\n```json\n{\"tool\": \"x\"}\n```\nDone.").unwrap(),
            json!({"tool": "x"})
        );
        assert_eq!(
            extract_json("Sure! [{\"goal\": \"a [b]\"}] is it").unwrap(),
            json!([{"goal": "a [b]"}])
        );
    }

    #[test]
    fn an_answer_without_json_says_what_is_wrong() {
        assert!(extract_json("  ").unwrap_err().contains("empty"));
        assert!(
            extract_json("I would look it up.")
                .unwrap_err()
                .contains("no JSON object or list")
        );
        assert!(
            extract_json("{\"goal\": ")
                .unwrap_err()
                .contains("does not parse")
        );
    }
}
