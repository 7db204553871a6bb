//! TrustGraph's WebSocket frames of one request: each record as `{"id", "response",
//! "complete"}` (the record without its `error` and null fields), a failure as an error frame
//! under the request's id, and a restart as an empty response flagged `restarted` (sluice's
//! addition: an older client appends nothing and reads on).

use std::marker::PhantomData;

use serde_json::{Map, Value, json};
use sluice_runtime::{
    reader::{Encoder, End, Out, Restartable},
    telemetry::ClientOutcome,
};
use sluice_schema::{Error, ResponseRecord};

use super::Tally;
use crate::kinds::Kind;

/// Records of service `K` in, text frames under the client's id out.
pub(crate) struct Frames<K: Kind> {
    /// The client's id for the request.
    id: String,
    tally: Tally,
    _kind: PhantomData<K>,
}

impl<K: Kind> Frames<K> {
    /// The frames of the request the client calls `id`, the stream counted by `tally`.
    pub(crate) fn new(id: String, tally: Tally) -> Self {
        Self {
            id,
            tally,
            _kind: PhantomData,
        }
    }

    fn frame(&self, response: Value, complete: bool) -> String {
        json!({ "id": self.id, "response": response, "complete": complete }).to_string()
    }
}

/// An error frame: `{"error": {"message", "type"}, "complete": true}`, under the request's
/// `id` when it has one.
pub(crate) fn error_frame(id: Option<&str>, err: &Error) -> String {
    let mut frame = json!({
        "error": { "message": err.message, "type": err.kind },
        "complete": true,
    });
    if let (Some(id), Some(obj)) = (id, frame.as_object_mut()) {
        obj.insert("id".into(), Value::String(id.to_owned()));
    }
    frame.to_string()
}

/// A record as TrustGraph's response object: without the `error` field and null fields.
fn response_object<R: serde::Serialize>(record: &R) -> Value {
    let mut obj = match serde_json::to_value(record) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    };
    obj.remove("error");
    obj.retain(|_, v| !v.is_null());
    Value::Object(obj)
}

impl<K: Kind> Encoder<K::Response> for Frames<K> {
    type Item = String;
    type Done = ();

    fn record(&mut self, record: K::Response, out: &mut Out<String>) {
        let complete = record.is_terminal();
        if complete {
            self.tally.ended(ClientOutcome::Success);
        }
        out.push(self.frame(response_object(&record), complete));
    }

    fn end(&mut self, end: End<K::Response>, out: &mut Out<String>) {
        if let Some(failure) = end.failure() {
            self.tally
                .ended(ClientOutcome::of_error(&failure.error.kind));
            out.push(error_frame(Some(&self.id), &failure.error));
        }
    }

    /// Every frame, a restart's and an error's included, tells the client something.
    fn handed(&mut self, _: &mut String, last: bool) {
        self.tally.said();
        if last {
            self.tally.delivered();
        }
    }
}

impl<K: Kind> Restartable<K::Response> for Frames<K> {
    fn restarted(&mut self, out: &mut Out<String>) {
        let mut obj = response_object(&K::Response::default());
        if let Value::Object(m) = &mut obj {
            m.insert("restarted".into(), Value::Bool(true));
        }
        out.push(self.frame(obj, false));
    }
}
