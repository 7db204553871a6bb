//! Structured output for providers that cannot hold an answer to a schema themselves
//! (Anthropic, Bedrock's Converse): the processor does it.
//!
//! A request with `response_format: "json"` (and, optionally, a `schema`) to such a provider
//! is sent with an instruction appended to its system prompt: answer with only a JSON value
//! matching the schema. The whole answer is read before anything is published, parsed
//! (a single fenced ```json block around it is unwrapped) and checked against the schema.
//! An answer that fails gets ONE corrective call: the conversation, the failed answer, and
//! what was wrong with it (in words that never quote the answer: [`json_schema::problem`]).
//! A second failure ends the request with a clear error, and the usage of both calls is
//! counted. So a caller of such a provider gets its answer in one record (no token streaming:
//! nothing is published until the answer is known to hold), and the corrective call happens
//! before the first token, where the retry and fallback rules still apply.
//!
//! An answer of tool calls is passed on unchecked: the schema is for the final answer.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;
use sluice_runtime::json_schema;
use sluice_schema::{ChatMessage, ChatRole, TextCompletionRequest};
use tracing::warn;

use crate::provider::{
    Chunk, ChunkStream, Completion, FailureKind, Provider, ProviderError, Usage,
};

/// `provider`, with structured output checked by the processor for every request whose
/// answer the provider cannot hold to the schema itself
/// ([`Provider::holds_structured_output`]); other requests pass through untouched.
pub fn enforcing(provider: Arc<dyn Provider>) -> Arc<dyn Provider> {
    Arc::new(Enforced { inner: provider })
}

/// A provider whose structured output the processor checks.
struct Enforced {
    inner: Arc<dyn Provider>,
}

/// What a request asks of its answer: JSON, and maybe a schema.
struct Wanted {
    validator: Option<json_schema::Validator>,
    schema_text: Option<String>,
}

impl Wanted {
    /// What `request` asks for, `None` for a plain answer; an error for a schema that is no
    /// JSON Schema (the caller's to fix).
    fn of(
        request: &TextCompletionRequest,
        provider: &dyn Provider,
    ) -> Result<Option<Self>, ProviderError> {
        if request.response_format.as_deref() != Some("json")
            || request.caller_checks
            || provider.holds_structured_output(request)
        {
            return Ok(None);
        }
        let Some(schema) = &request.schema else {
            return Ok(Some(Self {
                validator: None,
                schema_text: None,
            }));
        };
        let validator = json_schema::compile(schema)
            .map_err(|e| ProviderError::unsendable(format!("field `schema`: {e}")))?;
        Ok(Some(Self {
            validator: Some(validator),
            schema_text: Some(schema.to_string()),
        }))
    }

    /// The instruction that asks the model for it.
    fn instruction(&self) -> String {
        match &self.schema_text {
            Some(schema) => format!(
                "Answer with only a JSON value that matches this JSON Schema, with no other text and no code fences:\n{schema}"
            ),
            None => {
                "Answer with only a JSON value, with no other text and no code fences.".to_owned()
            }
        }
    }

    /// The answer's JSON text, or what is wrong with it.
    fn check(&self, text: &str) -> Result<String, String> {
        let json = unfenced(text);
        let value: Value = serde_json::from_str(json).map_err(|e| {
            // The parser's message names a line and column, never the text.
            format!("the answer is not JSON ({})", parse_problem(&e))
        })?;
        if let Some(v) = &self.validator {
            json_schema::check(v, &value)
                .map_err(|problem| format!("the answer does not match the schema: {problem}"))?;
        }
        Ok(json.to_owned())
    }
}

/// Words for a JSON parse failure that never quote the text.
fn parse_problem(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let what = match e.classify() {
        Category::Eof => "it ends too early",
        Category::Syntax => "a syntax error",
        Category::Data | Category::Io => "unreadable",
    };
    format!("{what} at line {} column {}", e.line(), e.column())
}

/// `text` without a single fenced code block around it (```json ... ``` or ``` ... ```),
/// trimmed: models asked for bare JSON still fence it often.
fn unfenced(text: &str) -> &str {
    let t = text.trim();
    let Some(rest) = t.strip_prefix("```") else {
        return t;
    };
    let Some(body) = rest.strip_suffix("```") else {
        return t;
    };
    // The info string (`json`) runs to the end of the first line.
    match body.split_once('\n') {
        Some((info, inner)) if !info.contains('{') && !info.contains('[') => inner.trim(),
        _ => body.trim(),
    }
}

/// The sum of two calls' usage.
fn sum(a: Option<Usage>, b: Option<Usage>) -> Option<Usage> {
    match (a, b) {
        (None, None) => None,
        (a, b) => {
            let (a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
            Some(Usage {
                input: a.input + b.input,
                output: a.output + b.output,
            })
        }
    }
}

impl Enforced {
    /// A whole answer read from the provider's stream, so that the time limits between
    /// chunks apply to a long answer, not one limit to all of it (Bedrock's `converse` and
    /// Vertex's `rawPredict` would have it all within the first-token limit).
    async fn whole(&self, request: &TextCompletionRequest) -> Result<Completion, ProviderError> {
        crate::provider::collect(self.inner.generate_stream(request).await?).await
    }

    /// The answer to `request` held to `wanted`: `Ok` with the answer, or `Err` with the
    /// error and the usage spent.
    async fn answer(
        &self,
        request: &TextCompletionRequest,
        wanted: &Wanted,
    ) -> Result<Result<Completion, (ProviderError, Option<Usage>)>, ProviderError> {
        let mut asked = request.clone();
        let instruction = wanted.instruction();
        asked.system = if asked.system.is_empty() {
            instruction
        } else {
            format!("{}\n\n{instruction}", asked.system)
        };
        let first = self.whole(&asked).await?;
        if !first.tool_calls.is_empty() {
            return Ok(Ok(first));
        }
        let problem = match wanted.check(&first.text) {
            Ok(json) => {
                return Ok(Ok(Completion {
                    text: json,
                    ..first
                }));
            }
            Err(problem) => problem,
        };
        warn!(
            provider = self.inner.name(),
            %problem,
            "structured output failed its check; one corrective call"
        );
        // The conversation so far, the failed answer, and what was wrong with it.
        let mut turns = asked.turns();
        turns.push(ChatMessage::new(ChatRole::Assistant, first.text.clone()));
        // The instruction and schema are in the system prompt already: a reminder is enough.
        turns.push(ChatMessage::new(
            ChatRole::User,
            format!("{problem}. Answer again with only the JSON value the system prompt asks for."),
        ));
        asked.prompt = TextCompletionRequest::flatten(&turns);
        asked.messages = Some(turns);
        let second = match self.whole(&asked).await {
            Ok(second) => second,
            Err(e) => return Ok(Err((e, first.usage))),
        };
        let usage = sum(first.usage, second.usage);
        if !second.tool_calls.is_empty() {
            return Ok(Ok(Completion { usage, ..second }));
        }
        match wanted.check(&second.text) {
            Ok(json) => Ok(Ok(Completion {
                text: json,
                usage,
                ..second
            })),
            Err(problem) => Ok(Err((
                ProviderError::new(
                    FailureKind::Protocol,
                    format!(
                        "{} did not give the structured output asked for, also after one corrective call: {problem}",
                        self.inner.name()
                    ),
                ),
                usage,
            ))),
        }
    }
}

#[async_trait]
impl Provider for Enforced {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn model(&self) -> &str {
        self.inner.model()
    }

    fn endpoint(&self) -> &str {
        self.inner.endpoint()
    }

    fn supports_streaming(&self) -> bool {
        self.inner.supports_streaming()
    }

    fn supports_tools(&self) -> bool {
        self.inner.supports_tools()
    }

    fn supports_structured_output(&self) -> bool {
        true
    }

    fn holds_structured_output(&self, _: &TextCompletionRequest) -> bool {
        true
    }

    async fn generate_stream(
        &self,
        request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError> {
        let Some(wanted) = Wanted::of(request, &*self.inner)? else {
            return self.inner.generate_stream(request).await;
        };
        let items: Vec<Result<Chunk, ProviderError>> = match self.answer(request, &wanted).await? {
            Ok(done) => vec![Ok(Chunk {
                text: done.text,
                usage: done.usage,
                finish_reason: done.finish_reason,
                answered_by: done.answered_by,
                tool_calls: done.tool_calls,
            })],
            // The usage spent, then the failure: the ledger counts both calls.
            Err((e, usage)) => vec![
                Ok(Chunk {
                    usage,
                    ..Chunk::default()
                }),
                Err(e),
            ],
        };
        Ok(Box::pin(futures::stream::iter(items)))
    }

    async fn generate(&self, request: &TextCompletionRequest) -> Result<Completion, ProviderError> {
        let Some(wanted) = Wanted::of(request, &*self.inner)? else {
            return self.inner.generate(request).await;
        };
        self.answer(request, &wanted)
            .await?
            .map_err(|(e, spent)| ProviderError { spent, ..e })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures::StreamExt;
    use serde_json::json;
    use sluice_schema::ToolCallDelta;

    use super::*;

    /// Answers each call with the next of its texts (tool calls for `"CALL"`), 10 in and 5 out
    /// each, recording what it was asked.
    struct Scripted {
        texts: Mutex<Vec<&'static str>>,
        asked: Mutex<Vec<TextCompletionRequest>>,
    }

    impl Scripted {
        fn new(texts: &[&'static str]) -> Arc<Self> {
            Arc::new(Self {
                texts: Mutex::new(texts.iter().rev().copied().collect()),
                asked: Mutex::default(),
            })
        }
    }

    #[async_trait]
    impl Provider for Scripted {
        fn name(&self) -> &'static str {
            "scripted"
        }
        fn model(&self) -> &str {
            "m"
        }
        fn endpoint(&self) -> &str {
            "http://127.0.0.1:1"
        }
        fn supports_streaming(&self) -> bool {
            true
        }
        async fn generate_stream(
            &self,
            request: &TextCompletionRequest,
        ) -> Result<ChunkStream, ProviderError> {
            self.asked.lock().unwrap().push(request.clone());
            let text = self.texts.lock().unwrap().pop().unwrap();
            let chunk = if text == "CALL" {
                Chunk {
                    tool_calls: vec![ToolCallDelta {
                        index: 0,
                        id: Some("c1".into()),
                        name: Some("f".into()),
                        arguments: "{}".into(),
                    }],
                    ..Chunk::default()
                }
            } else {
                Chunk {
                    text: text.to_owned(),
                    ..Chunk::default()
                }
            };
            let end = Chunk {
                usage: Some(Usage {
                    input: 10,
                    output: 5,
                }),
                finish_reason: Some("stop".into()),
                ..Chunk::default()
            };
            Ok(Box::pin(futures::stream::iter([Ok(chunk), Ok(end)])))
        }
    }

    fn asking(schema: Option<Value>) -> TextCompletionRequest {
        TextCompletionRequest {
            system: "Classify.".into(),
            prompt: "the sky".into(),
            response_format: Some("json".into()),
            schema,
            ..Default::default()
        }
    }

    fn label_schema() -> Value {
        json!({"type": "object", "required": ["label"],
            "properties": {"label": {"enum": ["blue", "grey"]}}})
    }

    async fn drain(
        p: &Arc<dyn Provider>,
        r: &TextCompletionRequest,
    ) -> Vec<Result<Chunk, ProviderError>> {
        p.generate_stream(r).await.unwrap().collect().await
    }

    #[tokio::test]
    async fn a_good_answer_is_asked_for_checked_and_unfenced() {
        let inner = Scripted::new(&["```json\n{\"label\": \"blue\"}\n```"]);
        let p = enforcing(inner.clone());
        let items = drain(&p, &asking(Some(label_schema()))).await;
        let chunk = items[0].as_ref().unwrap();
        assert_eq!(chunk.text, r#"{"label": "blue"}"#);
        assert_eq!(
            chunk.usage,
            Some(Usage {
                input: 10,
                output: 5
            })
        );
        assert_eq!(items.len(), 1);
        let asked = inner.asked.lock().unwrap();
        assert_eq!(asked.len(), 1);
        assert!(
            asked[0]
                .system
                .starts_with("Classify.\n\nAnswer with only a JSON value"),
            "{}",
            asked[0].system
        );
        assert!(
            asked[0].system.contains(r#""enum":["blue","grey"]"#),
            "{}",
            asked[0].system
        );
    }

    #[tokio::test]
    async fn a_bad_answer_gets_one_corrective_call_that_never_quotes_it() {
        let inner = Scripted::new(&[r#"{"label": "azure-secret"}"#, r#"{"label": "grey"}"#]);
        let p = enforcing(inner.clone());
        let items = drain(&p, &asking(Some(label_schema()))).await;
        let chunk = items[0].as_ref().unwrap();
        assert_eq!(chunk.text, r#"{"label": "grey"}"#);
        assert_eq!(
            chunk.usage,
            Some(Usage {
                input: 20,
                output: 10
            }),
            "both calls counted"
        );
        let asked = inner.asked.lock().unwrap();
        let turns = asked[1].messages.clone().unwrap();
        assert_eq!(turns.len(), 3);
        assert_eq!(turns[1].role, ChatRole::Assistant);
        assert_eq!(turns[1].content, r#"{"label": "azure-secret"}"#);
        let correction = &turns[2].content;
        assert!(
            correction.starts_with("the answer does not match the schema: /label is not one of"),
            "{correction}"
        );
        assert!(!correction.contains("azure-secret"), "{correction}");
        assert!(
            asked[1].prompt.contains("azure-secret"),
            "the flattened prompt carries the turns too"
        );
    }

    #[tokio::test]
    async fn two_bad_answers_end_with_a_clear_error_and_their_usage() {
        let inner = Scripted::new(&["Sure! Here it is: {", "not json either"]);
        let p = enforcing(inner.clone());
        let items = drain(&p, &asking(None)).await;
        assert_eq!(items.len(), 2);
        assert_eq!(
            items[0].as_ref().unwrap().usage,
            Some(Usage {
                input: 20,
                output: 10
            })
        );
        let e = items[1].as_ref().unwrap_err();
        assert_eq!(e.kind, FailureKind::Protocol);
        assert!(
            e.message
                .contains("also after one corrective call: the answer is not JSON"),
            "{}",
            e.message
        );
        assert!(!e.message.contains("either"), "{}", e.message);
        let whole = enforcing(Scripted::new(&["nope", "still nope"]));
        let e = whole.generate(&asking(None)).await.unwrap_err();
        assert_eq!(
            e.spent,
            Some(Usage {
                input: 20,
                output: 10
            }),
            "a whole answer's error carries both calls' usage"
        );
        assert!(
            inner.asked.lock().unwrap()[0]
                .system
                .ends_with("Answer with only a JSON value, with no other text and no code fences.")
        );
    }

    #[tokio::test]
    async fn plain_requests_tool_calls_and_native_providers_pass_through() {
        let inner = Scripted::new(&["free text", "CALL"]);
        let p = enforcing(inner.clone());
        let plain = TextCompletionRequest {
            prompt: "hi".into(),
            ..Default::default()
        };
        let items = drain(&p, &plain).await;
        assert_eq!(items[0].as_ref().unwrap().text, "free text");
        assert_eq!(inner.asked.lock().unwrap()[0].system, "");
        let items = drain(&p, &asking(Some(label_schema()))).await;
        assert_eq!(
            items[0].as_ref().unwrap().tool_calls.len(),
            1,
            "a call is not checked"
        );
        assert_eq!(inner.asked.lock().unwrap().len(), 2);

        /// A provider with a JSON mode that declines it with tools (as Gemini 2 does); it
        /// answers with its request's system prompt.
        struct Native;
        #[async_trait]
        impl Provider for Native {
            fn name(&self) -> &'static str {
                "native"
            }
            fn model(&self) -> &str {
                "m"
            }
            fn endpoint(&self) -> &str {
                ""
            }
            fn supports_streaming(&self) -> bool {
                true
            }
            fn supports_structured_output(&self) -> bool {
                true
            }
            fn holds_structured_output(&self, request: &TextCompletionRequest) -> bool {
                request.tools.is_none()
            }
            async fn generate_stream(
                &self,
                request: &TextCompletionRequest,
            ) -> Result<ChunkStream, ProviderError> {
                let said = Chunk {
                    text: request.system.clone(),
                    ..Chunk::default()
                };
                Ok(Box::pin(futures::stream::iter([Ok(said)])))
            }
        }
        let p = enforcing(Arc::new(Native));
        // Held by the provider: passed through, no instruction added.
        let items = drain(&p, &asking(Some(label_schema()))).await;
        assert_eq!(items[0].as_ref().unwrap().text, "Classify.");
        // Declined for this request (tools): checked here, the instruction added.
        let mut with_tools = asking(Some(label_schema()));
        with_tools.tools = Some(Vec::new());
        let items = drain(&p, &with_tools).await;
        let e = items.last().unwrap().as_ref().unwrap_err();
        assert!(
            e.message.contains("did not give the structured output"),
            "{}",
            e.message
        );
    }

    #[tokio::test]
    async fn a_schema_that_is_no_json_schema_is_the_callers_to_fix() {
        let p = enforcing(Scripted::new(&[]));
        let e = p
            .generate_stream(&asking(Some(json!({"type": 7}))))
            .await
            .err()
            .unwrap();
        assert!(
            e.unsendable
                && e.message
                    .starts_with("field `schema`: not a valid JSON Schema"),
            "{}",
            e.message
        );
    }

    #[test]
    fn fences_come_off_only_whole() {
        assert_eq!(unfenced(" {\"a\":1} "), "{\"a\":1}");
        assert_eq!(unfenced("```json\n[1]\n```"), "[1]");
        assert_eq!(unfenced("```\n{}\n```"), "{}");
        assert_eq!(unfenced("```{}```"), "{}");
        assert_eq!(unfenced("text ```json\n{}\n```"), "text ```json\n{}\n```");
    }
}
