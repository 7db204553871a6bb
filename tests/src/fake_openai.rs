//! A fake OpenAI chat-completions server over real HTTP, speaking the exact SSE wire format,
//! scripted by the request's model name:
//!
//! | model | behaviour |
//! |---|---|
//! | `normal` | `Hello`, ` world`, `!`, a finish chunk, a usage chunk (11 in, 3 out), `[DONE]` |
//! | `azure` | as `normal`, after Azure's empty-choices prompt-filter chunk and a delta-less content-filter chunk (on Azure's path the deployment is the script) |
//! | `slow` | as `normal`, 150 ms between events |
//! | `rate_limited_once` | 429 `rate_limit_exceeded` with `retry-after-ms: 100` on the first call, then `normal` |
//! | `server_error_once` | 500 on the first call, then `normal` |
//! | `server_error_final` | 500 with `x-should-retry: false`, every call |
//! | `bad_request_retry_once` | 400 with `x-should-retry: true` on the first call, then `normal` |
//! | `status-NNN-K[-MODEL]` | HTTP NNN (OpenAI's error body, no retry hint) on the first K calls, then as `MODEL` (`normal` when not named) |
//! | `unauthorized` | 401 `invalid_api_key` |
//! | `quota` | 429 `insufficient_quota` |
//! | `error_mid_stream` | `Hel`, then `data: {"error": ...}`, then `[DONE]` (as vLLM) |
//! | `drop_mid_stream` | `Hel`, then the connection breaks |
//! | `no_terminator` | `Hel`, then the body ends cleanly without finish or `[DONE]` |
//! | `malformed` | `Hel`, an unparseable event, ` lo`, finish, usage, `[DONE]` |
//! | `stall` | `Hel`, then nothing more |
//! | `react-answer`, `react-tool`, `react-unknown`, `react-fail`, `react-garbage-once`, `react-garbage`, `react-loop` | a scripted ReAct model; the step is the number of observations in the prompt |
//! | `react-ask`, `react-facts`, `react-lookup` | a ReAct model that calls the tool `ask`, `facts` or `lookup` once, then answers `The tool said: <observation>`; a prompt that is not a ReAct prompt (the tool's own model call) is answered `Echo: <prompt>`, streaming or not |
//! | `react-relay` | as `react-ask`, but the tool is asked the agent's own question (`Question:` line), so the answer `The tool said: Echo: <question>` names its request |
//! | `react-gated` | as `react-tool`, but the second step sends its thought line, then waits for [`FakeOpenAi::open_gate`] before the final answer |
//! | `seed-NAME` | the seed example answer `NAME` of `seed_streams`, in 3-byte tokens |
//! | `seed-tagged-NAME` | as `seed-NAME`, each `block_id` prefixed with `T-`, `T` from `[tag:T]` in the last user message (answers that name their request) |
//! | `stamped-N-D` | N lines `{"seq": i, "sent_ns": T}`, two tokens each, T the send time of the second, D ms apart |
//! | `replay-N` | the last user message streamed back in N-byte pieces, finish, usage (9 in, one out per word), `[DONE]` |
//! | `replay-N-break` | the same pieces, then the connection breaks (a truncated answer) |
//! | `replay-N-D` | as `replay-N`, the pieces D ms apart (streams that are in flight when a fault strikes) |
//! | `gated` | `Hel`, then waits for [`FakeOpenAi::open_gate`], then ` lo`, finish, usage, `[DONE]` |
//! | `tokens-N-D` | N one-word tokens, D ms apart, then finish, usage, `[DONE]` (for benchmarks) |
//! | `tokens-N-D-F` | as `tokens-N-D`, the first token F ms after the request (a model's time to first token) |
//! | `routed` | as the model named by `[model:NAME]` in the last user message, else `normal`: one configured model, every behaviour (call counts are per routed name) |
//! | `chaos-ok`, `chaos-429`, `chaos-500`, `chaos-malformed`, `chaos-drop`, `chaos-stall` | for soak traffic, counted per distinct last user message (each request its own): the message streamed back in 5-byte pieces (whole when not streaming), after `chaos-429`'s first call answers 429 with only `retry-after: 1` and `chaos-500`'s first call 500; `chaos-malformed` slips an unparseable event after the first piece; `chaos-drop` breaks the connection after the first piece and `chaos-stall` stops there, every call (not streaming: 500 `x-should-retry: false`, and no answer at all) |
//! | `plan`, `plan-malformed`, `plan-gated` | an agent's model under the orchestrator's patterns, answering each built-in pattern prompt (routing, a plan of two steps, each step's tool call, the synthesis); `plan-malformed` never plans, `plan-gated` holds the synthesis behind the gate (see [`plan_model`]) |
//! | `tools`, `tools-text`, `tools-interleaved` | tool calling in OpenAI's shapes (see [`tools`]): calls every tool offered with `{"q": <message>}`, the arguments streamed in 4-byte fragments, `finish_reason: tool_calls`; answers `results: ...` once given the tools' results |
//!
//! [`prompted`] is the same fake scripted by the prompt instead, for processes configured
//! once with one model (the `fake-openai` binary).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod prompted;
pub mod tools;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use crate::fake::{Calls, Fake, Step, tracked_body};

/// The fake OpenAI server.
pub type FakeOpenAi = Fake<OpenAiSeen>;

/// What the fake OpenAI server recorded.
#[derive(Default)]
pub struct OpenAiSeen {
    calls: Calls,
    bodies: Vec<Value>,
    auth: Vec<Option<String>>,
    traceparents: Vec<Option<String>>,
    abandoned: Arc<std::sync::atomic::AtomicUsize>,
    gate: Arc<tokio::sync::Notify>,
    held: Arc<crate::fake::Held>,
    per_message: Calls,
    chaos_calls: Vec<ChaosCall>,
}

/// One call of a `chaos-*` model as the fake saw it: what a provider bills for it.
#[derive(Debug, Clone)]
pub struct ChaosCall {
    /// The trace id of the call's `traceparent` header.
    pub trace_id: Option<String>,
    /// When it came.
    pub at: std::time::Instant,
    /// What the provider bills: the usage it reported (input and output) for an answer it
    /// finished, the pieces of text it sent for one it cut (a dropped connection, a stall),
    /// nothing for a refusal.
    pub billed: u64,
    /// Set when the client went away before the fake's script ended (a streamed answer).
    pub abandoned: Arc<std::sync::atomic::AtomicUsize>,
}

impl Fake<OpenAiSeen> {
    /// Starts a fake on a free loopback port.
    pub async fn start() -> Self {
        Self::serve(|seen| {
            Router::new()
                .route("/v1/chat/completions", post(chat))
                .route(
                    "/openai/deployments/{deployment}/chat/completions",
                    post(chat_azure),
                )
                .with_state(seen)
        })
        .await
    }

    /// Calls received for `model`.
    pub fn calls(&self, model: &str) -> usize {
        self.seen().calls.get(model)
    }

    /// The last request body received.
    pub fn last_body(&self) -> Value {
        self.seen().bodies.last().cloned().unwrap_or(Value::Null)
    }

    /// Every request body received, in order.
    pub fn bodies(&self) -> Vec<Value> {
        self.seen().bodies.clone()
    }

    /// Streams whose client closed the connection before the end (aborted provider calls).
    pub fn chaos_calls(&self) -> Vec<ChaosCall> {
        self.seen().chaos_calls.clone()
    }

    /// Streams whose client went away before the end.
    pub fn abandoned_streams(&self) -> usize {
        self.seen()
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits up to `timeout` (what a cancel takes to cross the gateway, the broker and the
    /// processor to this server) for a stream's client to go away, and fails the test with
    /// `what` if none did: a cancelled request's provider call must end.
    pub async fn assert_abandoned(&self, timeout: Duration, what: &str) {
        let abandoned =
            crate::eventually(timeout, async || self.abandoned_streams(), |n| *n > 0).await;
        assert!(abandoned > 0, "{what}");
    }

    /// Lets every held call (`supervisor-held`'s `delta` subagent) go on, now and later.
    pub fn release_held(&self) {
        self.seen().held.release();
    }

    /// Lets one `gated` stream go on past its first token.
    pub fn open_gate(&self) {
        self.seen().gate.notify_one();
    }

    /// The `traceparent` header of every request received, in order.
    pub fn traceparents(&self) -> Vec<Option<String>> {
        self.seen().traceparents.clone()
    }

    /// The last credential header received (`authorization` or Azure's `api-key`).
    pub fn last_auth(&self) -> Option<String> {
        self.seen().auth.last().cloned().flatten()
    }
}

/// The `N-D` of model names such as `tokens-N-D`: N pieces (default 10), D ms apart
/// (default 0).
fn count_and_gap(spec: &str) -> (u64, Duration) {
    let mut parts = spec.split('-');
    let n = parts.next().and_then(|x| x.parse().ok()).unwrap_or(10);
    let gap = parts.next().and_then(|x| x.parse().ok()).unwrap_or(0);
    (n, Duration::from_millis(gap))
}

fn event(v: Value) -> String {
    format!("data: {v}\n\n")
}

fn delta(text: &str) -> String {
    event(json!({"id": "c1", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}))
}

fn finish() -> String {
    event(json!({"id": "c1", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
}

fn usage(input: u64, output: u64) -> String {
    event(
        json!({"id": "c1", "object": "chat.completion.chunk", "choices": [],
                 "usage": {"prompt_tokens": input, "completion_tokens": output,
                           "total_tokens": input + output}}),
    )
}

const DONE: &str = "data: [DONE]\n\n";

fn error(status: StatusCode, message: &str, kind: &str, code: &str) -> Response {
    let mut resp = (
        status,
        Json(json!({"error": {"message": message, "type": kind, "param": null, "code": code}})),
    )
        .into_response();
    if status == StatusCode::TOO_MANY_REQUESTS && code == "rate_limit_exceeded" {
        resp.headers_mut()
            .insert("retry-after-ms", "100".parse().unwrap());
        resp.headers_mut()
            .insert("retry-after", "1".parse().unwrap());
    }
    resp
}

fn sse(steps: Vec<Step>, abandoned: Arc<std::sync::atomic::AtomicUsize>) -> Response {
    tracked_body(steps, "text/event-stream", abandoned)
}

fn normal_events() -> Vec<Step> {
    ["Hello", " world", "!"]
        .into_iter()
        .map(|t| Step::Send(delta(t)))
        .chain([
            Step::Send(finish()),
            Step::Send(usage(11, 3)),
            Step::Send(DONE.into()),
        ])
        .collect()
}

/// Azure's route: the deployment in the path is the script (Azure sends no `model`).
async fn chat_azure(
    State(seen): State<Arc<Mutex<OpenAiSeen>>>,
    axum::extract::Path(deployment): axum::extract::Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    answer(seen, headers, body, Some(deployment)).await
}

async fn chat(
    State(seen): State<Arc<Mutex<OpenAiSeen>>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    answer(seen, headers, body, None).await
}

/// The answer to `body`, scripted by `deployment` (Azure) or the body's model.
async fn answer(
    seen: Arc<Mutex<OpenAiSeen>>,
    headers: HeaderMap,
    body: Value,
    deployment: Option<String>,
) -> Response {
    let mut model = deployment.unwrap_or_else(|| scripted_model(&body));
    let stream = body["stream"].as_bool().unwrap_or(false);
    let (call, abandoned, gate) = {
        let mut s = seen.lock().unwrap();
        let call = s.calls.count(&model);
        s.bodies.push(body.clone());
        let auth = headers
            .get("authorization")
            .or_else(|| headers.get("api-key"))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        s.auth.push(auth);
        let traceparent = headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        s.traceparents.push(traceparent);
        (call, s.abandoned.clone(), (s.gate.clone(), s.held.clone()))
    };
    let (gate, held) = gate;
    if let Some((status, failing, then)) = status_script(&model) {
        if call <= failing {
            return error(status, "scripted failure", "server_error", "scripted");
        }
        model = then;
    }
    match (model.as_str(), call) {
        ("unauthorized", _) => {
            return error(
                StatusCode::UNAUTHORIZED,
                "Incorrect API key provided",
                "invalid_request_error",
                "invalid_api_key",
            );
        }
        ("quota", _) => {
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                "You exceeded your current quota",
                "insufficient_quota",
                "insufficient_quota",
            );
        }
        ("rate_limited_once", 1) => {
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                "Rate limit reached",
                "requests",
                "rate_limit_exceeded",
            );
        }
        ("server_error_once", 1) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "The server had an error",
                "server_error",
                "server_error",
            );
        }
        ("server_error_final", _) => return final_server_error(),
        ("bad_request_retry_once", 1) => {
            let mut resp = error(
                StatusCode::BAD_REQUEST,
                "Try again",
                "invalid_request_error",
                "transient",
            );
            resp.headers_mut()
                .insert("x-should-retry", "true".parse().unwrap());
            return resp;
        }
        _ => {}
    }
    let user_message = body["messages"]
        .as_array()
        .and_then(|ms| ms.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_owned();
    let tool_answer = react_tool_answer(&model, &user_message);
    if let Some(fault) = model.strip_prefix("chaos-") {
        let trace_id = headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(|tp| tp.split('-').nth(1))
            .map(str::to_owned);
        let call_abandoned: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let call = {
            let mut s = seen.lock().unwrap();
            let call = s.per_message.count(&user_message);
            s.chaos_calls.push(ChaosCall {
                trace_id,
                at: std::time::Instant::now(),
                billed: chaos_billed(fault, call, stream, &user_message),
                abandoned: call_abandoned.clone(),
            });
            call
        };
        drop(abandoned);
        return chaos(fault, call, stream, &user_message, call_abandoned).await;
    }
    if tools::is_tools_model(&model) {
        return if stream {
            sse(tools::streamed(&model, &body, &user_message), abandoned)
        } else {
            Json(tools::whole(&model, &body, &user_message)).into_response()
        };
    }
    if !stream {
        let (content, input, output) = if model.starts_with("replay-") {
            let words = user_message.split_whitespace().count();
            (user_message, 9, words)
        } else if let Some(echo) = tool_answer {
            let words = echo.split_whitespace().count();
            (echo, 9, words)
        } else {
            ("Hello world!".to_owned(), 11, 3)
        };
        return Json(json!({
            "id": "c1", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output}
        }))
        .into_response();
    }
    let steps = match model.as_str() {
        "azure" => {
            let mut v = vec![
                Step::Send(event(
                    json!({"id": "", "choices": [], "prompt_filter_results": [{"prompt_index": 0}]}),
                )),
                Step::Send(event(
                    json!({"id": "c1", "choices": [{"index": 0, "content_filter_results": {}}]}),
                )),
            ];
            v.extend(normal_events());
            v
        }
        "slow" => normal_events()
            .into_iter()
            .flat_map(|s| [Step::Wait(Duration::from_millis(150)), s])
            .collect(),
        "error_mid_stream" => vec![
            Step::Send(delta("Hel")),
            Step::Send(event(
                json!({"error": {"message": "model overloaded", "type": "server_error"}}),
            )),
            Step::Send(DONE.into()),
        ],
        "drop_mid_stream" => vec![
            Step::Send(delta("Hel")),
            Step::Wait(Duration::from_millis(20)),
            Step::Break,
        ],
        "no_terminator" => vec![Step::Send(delta("Hel"))],
        "malformed" => vec![
            Step::Send(delta("Hel")),
            Step::Send("data: {\"choices\": [{\"delta\": {\"content\": \n\n".into()),
            Step::Send(delta(" lo")),
            Step::Send(finish()),
            Step::Send(usage(5, 2)),
            Step::Send(DONE.into()),
        ],
        "stall" => vec![Step::Send(delta("Hel")), Step::Hang],
        "gated" => vec![
            Step::Send(delta("Hel")),
            Step::Gate(gate),
            Step::Send(delta(" lo")),
            Step::Send(finish()),
            Step::Send(usage(5, 2)),
            Step::Send(DONE.into()),
        ],
        _ if tool_answer.is_some() => streamed(tool_answer.as_deref().unwrap_or_default(), 3),
        "react-gated" if user_message.contains("\nObservation: ") => {
            // The second step holds its final answer back until the test opens the gate, so
            // a test can act (e.g. kill the agent) while an iteration is in flight.
            let mut v: Vec<Step> =
                crate::seed_streams::tokens("Thought: I know the answer now.\n", 3)
                    .into_iter()
                    .map(|p| Step::Send(delta(&p)))
                    .collect();
            v.push(Step::Gate(gate));
            v.extend(streamed("Final Answer: The sum is 5.", 3));
            v
        }
        "supervisor" | "supervisor-held" => supervisor_script(&model, &user_message, held),
        "plan" | "plan-malformed" | "plan-gated" => plan_model(&model, &user_message, gate),
        m if m.starts_with("react-") => {
            // A scripted ReAct agent: the step is the number of observations in the prompt.
            let step = user_message.matches("\nObservation: ").count();
            let corrected = user_message.contains("could not be read");
            let answer = |a: &str| format!("Thought: I know the answer now.\nFinal Answer: {a}");
            let observation = user_message
                .rsplit("\nObservation: ")
                .next()
                .and_then(|rest| rest.lines().next())
                .unwrap_or("")
                .trim()
                .to_owned();
            let text = match (m, step) {
                ("react-answer", _) => answer("Paris is the capital of France."),
                ("react-ask", 0) => "Thought: I will ask a model.\nAction: ask\nArgs: {\"question\": \"Name a colour.\"}\n".to_owned(),
                ("react-facts", 0) => "Thought: I will look for facts.\nAction: facts\nArgs: {\"topic\": \"otters\"}\n".to_owned(),
                ("react-lookup", 0) => "Thought: I will look it up.\nAction: lookup\nArgs: {\"key\": \"capital-of-france\"}\n".to_owned(),
                ("react-relay", 0) => {
                    // The agent's own question, handed to the tool: the answer then names
                    // the request it belongs to.
                    let question = user_message
                        .rsplit("\nQuestion: ")
                        .next()
                        .and_then(|rest| rest.lines().next())
                        .unwrap_or("")
                        .trim();
                    format!(
                        "Thought: I will ask a model.\nAction: ask\nArgs: {{\"question\": {}}}\n",
                        serde_json::Value::from(question)
                    )
                }
                ("react-ask" | "react-facts" | "react-lookup" | "react-relay", _) => {
                    answer(&format!("The tool said: {observation}"))
                }
                ("react-tool" | "react-gated", 0) => "Thought: I should add the numbers.\nAction: add\nArgs: {\n  \"a\": 2,\n  \"b\": 3\n}\n".to_owned(),
                ("react-tool", _) => answer("The sum is 5."),
                ("react-unknown", 0) => "Thought: Let me teleport.\nAction: teleport\nArgs: {}\n".to_owned(),
                ("react-fail", 0) => "Thought: Try the failing tool.\nAction: fail\nArgs: {\"message\": \"boom\"}\n".to_owned(),
                ("react-unknown" | "react-fail", _) => answer("Done."),
                ("react-garbage-once", _) if corrected => answer("Recovered."),
                ("react-garbage-once" | "react-garbage", _) => "I refuse to follow formats.".to_owned(),
                _ => "Thought: Again.\nAction: add\nArgs: {\"a\": 1, \"b\": 1}\n".to_owned(),
            };
            streamed(&text, 3)
        }
        m if m.starts_with("seed-tagged-") => {
            // As `seed-NAME`, every `block_id` prefixed with the `[tag:T]` of the prompt:
            // the objects then name the request they answer.
            let tag = user_message
                .split_once("[tag:")
                .and_then(|(_, rest)| rest.split_once(']'))
                .map_or("", |(t, _)| t);
            let text = crate::seed_streams::stream(m.strip_prefix("seed-tagged-").unwrap_or(m))
                .unwrap_or("")
                .replace("\"block_id\":\"", &format!("\"block_id\":\"{tag}-"))
                .replace("\"block_id\": \"", &format!("\"block_id\": \"{tag}-"));
            streamed(&text, 3)
        }
        m if m.starts_with("seed-") => {
            // A seed's example answer (tests/src/seed_streams.rs) in 3-byte tokens.
            streamed(
                crate::seed_streams::stream(m.strip_prefix("seed-").unwrap_or(m)).unwrap_or(""),
                3,
            )
        }
        m if m.starts_with("stamped-") => {
            // N JSON lines `{"seq": i, "sent_ns": T}` in two tokens each, the second stamped
            // with the time it is sent, D ms apart (for benchmarks).
            let (n, gap) = count_and_gap(m.trim_start_matches("stamped-"));
            let mut v = Vec::new();
            for i in 0..n {
                if !gap.is_zero() {
                    v.push(Step::Wait(gap));
                }
                v.push(Step::Send(delta(&format!("{{\"seq\": {i}, \"sent_ns\": "))));
                v.push(Step::Stamped(delta("@NOW@}\n")));
            }
            v.extend([
                Step::Send(finish()),
                Step::Send(usage(7, 2 * n)),
                Step::Send(DONE.into()),
            ]);
            v
        }
        m if m.starts_with("replay-") => {
            // The last user message, streamed back in pieces of N bytes: tests choose the
            // model's "answer" through the prompt they render.
            let mut parts = m.trim_start_matches("replay-").split('-');
            let n: usize = parts
                .next()
                .and_then(|x| x.parse().ok())
                .unwrap_or(4)
                .max(1);
            let second = parts.next();
            let truncated = second == Some("break");
            let gap = second.and_then(|x| x.parse::<u64>().ok());
            if truncated {
                let mut v: Vec<Step> = crate::seed_streams::tokens(&user_message, n)
                    .into_iter()
                    .map(|p| Step::Send(delta(&p)))
                    .collect();
                v.push(Step::Wait(Duration::from_millis(20)));
                v.push(Step::Break);
                v
            } else if let Some(gap) = gap {
                streamed(&user_message, n)
                    .into_iter()
                    .flat_map(|step| [Step::Wait(Duration::from_millis(gap)), step])
                    .collect()
            } else {
                streamed(&user_message, n)
            }
        }
        m if m.starts_with("tokens-") => {
            let spec = m.trim_start_matches("tokens-");
            let (n, gap) = count_and_gap(spec);
            let first = spec
                .split('-')
                .nth(2)
                .and_then(|f| f.parse().ok())
                .map_or(Duration::ZERO, Duration::from_millis);
            let mut v = Vec::new();
            if !first.is_zero() {
                v.push(Step::Wait(first));
            }
            for i in 0..n {
                if !gap.is_zero() {
                    v.push(Step::Wait(gap));
                }
                v.push(Step::Send(delta(&format!("t{i} "))));
            }
            v.extend([
                Step::Send(finish()),
                Step::Send(usage(7, n)),
                Step::Send(DONE.into()),
            ]);
            v
        }
        _ => normal_events(),
    };
    sse(steps, abandoned)
}

/// For the `react-ask`, `react-facts` and `react-lookup` models: a prompt that is not a ReAct
/// prompt is a tool's own model call (a text-completion or prompt tool on the same
/// processor), answered `Echo: <prompt>`.
fn react_tool_answer(model: &str, user_message: &str) -> Option<String> {
    let tool_model = matches!(
        model,
        "react-ask" | "react-facts" | "react-lookup" | "react-relay"
    );
    let react_prompt = user_message.contains("Final Answer:");
    (tool_model && !react_prompt).then(|| format!("Echo: {user_message}"))
}

/// `text` as an answer streamed in tokens of about `n` bytes, then a finish chunk, usage
/// (9 in, one out per word) and `[DONE]`.
/// A 500 with `x-should-retry: false`: the server says this request cannot succeed.
fn final_server_error() -> Response {
    let mut resp = error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "The request cannot succeed",
        "server_error",
        "server_error",
    );
    resp.headers_mut()
        .insert("x-should-retry", "false".parse().unwrap());
    resp
}

/// What a provider bills for call `call` (from 1) of a `chaos-*` model (see [`chaos`]): the
/// usage it reports when it finishes the answer (after a malformed event too), the one piece
/// of text it sends before it drops the connection or stalls, nothing when it refuses or
/// never answers.
fn chaos_billed(fault: &str, call: usize, stream: bool, message: &str) -> u64 {
    let words = u64::try_from(message.split_whitespace().count()).unwrap_or(0);
    match (fault, call, stream) {
        ("429" | "500", 1, _) => 0,
        ("drop" | "stall", _, false) => 0,
        // The malformed event is one the client skips: the answer and its usage follow.
        ("drop" | "stall", _, true) => u64::from(!message.is_empty()),
        _ => 9 + words,
    }
}

/// The `chaos-*` models (see the module doc); `call` counts this message's calls from 1.
async fn chaos(
    fault: &str,
    call: usize,
    stream: bool,
    message: &str,
    abandoned: Arc<std::sync::atomic::AtomicUsize>,
) -> Response {
    match (fault, call) {
        ("429", 1) => {
            let mut resp = error(
                StatusCode::TOO_MANY_REQUESTS,
                "Rate limit reached",
                "requests",
                "rate_limit_exceeded",
            );
            resp.headers_mut().remove("retry-after-ms");
            return resp;
        }
        ("500", 1) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "The server had an error",
                "server_error",
                "server_error",
            );
        }
        _ => {}
    }
    if !stream {
        return match fault {
            "drop" => final_server_error(),
            "stall" => {
                std::future::pending::<()>().await;
                StatusCode::GATEWAY_TIMEOUT.into_response()
            }
            _ => {
                let words = message.split_whitespace().count();
                Json(json!({
                    "id": "c1", "object": "chat.completion", "model": format!("chaos-{fault}"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": message},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 9, "completion_tokens": words, "total_tokens": 9 + words}
                }))
                .into_response()
            }
        };
    }
    let mut steps = streamed(message, 5);
    match fault {
        "malformed" => steps.insert(
            1.min(steps.len()),
            Step::Send("data: {\"choices\": [{\"delta\": {\"content\": \n\n".into()),
        ),
        "drop" => {
            steps.truncate(1);
            steps.extend([Step::Wait(Duration::from_millis(20)), Step::Break]);
        }
        "stall" => {
            steps.truncate(1);
            steps.push(Step::Hang);
        }
        _ => {}
    }
    sse(steps, abandoned)
}

/// A scripted supervisor (docs/agent.md#the-supervisor-and-its-fan-in): the decomposition
/// gives four goals, each subagent answers `result-<goal>` (with `supervisor-held`, the
/// `delta` subagent only once the test releases it), and the synthesis echoes every result it
/// was given, so the answer shows which reached it.
fn supervisor_script(model: &str, user_message: &str, held: Arc<crate::fake::Held>) -> Vec<Step> {
    if user_message.contains("independent goals") {
        return streamed(r#"["alpha", "beta", "gamma", "delta"]"#, 3);
    }
    if user_message.contains("sub-agents that worked on its parts") {
        let results: Vec<&str> = user_message
            .lines()
            .filter_map(|l| l.strip_prefix("Result: "))
            .collect();
        return streamed(&format!("Synthesis of {}.", results.join(", ")), 3);
    }
    let goal = user_message
        .rsplit("\nQuestion: ")
        .next()
        .and_then(|rest| rest.lines().next())
        .unwrap_or("")
        .trim()
        .to_owned();
    let mut steps = Vec::new();
    if model == "supervisor-held" && goal == "delta" {
        steps.push(Step::Hold(held));
    }
    steps.extend(streamed(
        &format!("Thought: I know it.\nFinal Answer: result-{goal}"),
        3,
    ));
    steps
}

/// The `plan` models: an agent's model under the orchestrator's patterns, answering each of
/// the built-in pattern templates (services/agent/src/patterns/templates) by what the prompt
/// asks: the task type `research`, the pattern `plan-then-execute`, a plan of two steps in a
/// ```json fence (adding 2 and 3 with `add`, then looking the capital of France up with
/// `lookup`), each step's tool call, and the synthesis. `plan-malformed` answers every
/// planning prompt with prose; `plan-gated` holds the synthesis after its first piece until
/// [`FakeOpenAi::open_gate`].
fn plan_model(model: &str, prompt: &str, gate: Arc<tokio::sync::Notify>) -> Vec<Step> {
    let text = if prompt.contains("Classify the question below") {
        "research"
    } else if prompt.contains("Choose how to answer the question below") {
        "\"plan-then-execute\""
    } else if prompt.contains("Make a plan to answer the question below") {
        if model == "plan-malformed" {
            "I would add the numbers first."
        } else {
            "Here is the plan:\n```json\n[{\"goal\": \"add 2 and 3\", \"tool_hint\": \"add\"},\n {\"goal\": \"look up the capital of France\", \"tool_hint\": \"lookup\", \"depends_on\": [0]}]\n```"
        }
    } else if prompt.contains("Goal: add 2 and 3") {
        r#"{"tool": "add", "arguments": {"a": 2, "b": 3}}"#
    } else if prompt.contains("Goal: look up the capital of France") {
        r#"{"tool": "lookup", "arguments": {"key": "capital-of-france"}}"#
    } else if prompt.contains("from the results of the steps") {
        if model == "plan-gated" {
            let mut v = vec![Step::Send(delta("The sum is 5"))];
            v.push(Step::Gate(gate));
            v.extend(streamed(" and the capital is Paris.", 3));
            return v;
        }
        "The sum is 5 and the capital is Paris."
    } else {
        "I do not know this prompt."
    };
    streamed(text, 3)
}

fn streamed(text: &str, n: usize) -> Vec<Step> {
    let mut v: Vec<Step> = crate::seed_streams::tokens(text, n)
        .into_iter()
        .map(|p| Step::Send(delta(&p)))
        .collect();
    let words = u64::try_from(text.split_whitespace().count()).unwrap_or(0);
    v.extend([
        Step::Send(finish()),
        Step::Send(usage(9, words)),
        Step::Send(DONE.into()),
    ]);
    v
}

/// The model whose script runs: the request's, or for `routed` the one the last user message
/// names as `[model:NAME]` (a process has one configured model; the caller picks the
/// behaviour in its prompt).
/// `status-NNN-K[-MODEL]`: the status, how many first calls fail with it, and the model
/// answering after them (`normal` when not named).
fn status_script(model: &str) -> Option<(StatusCode, usize, String)> {
    let rest = model.strip_prefix("status-")?;
    let mut parts = rest.splitn(3, '-');
    let status = StatusCode::from_u16(parts.next()?.parse().ok()?).ok()?;
    let failing = parts.next()?.parse().ok()?;
    let then = parts.next().unwrap_or("normal").to_owned();
    Some((status, failing, then))
}

fn scripted_model(body: &Value) -> String {
    let model = body["model"].as_str().unwrap_or("azure");
    if model != "routed" {
        return model.to_owned();
    }
    body["messages"]
        .as_array()
        .and_then(|ms| ms.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .and_then(|text| text.split_once("[model:"))
        .and_then(|(_, rest)| rest.split_once(']'))
        .map_or("normal", |(name, _)| name)
        .to_owned()
}
