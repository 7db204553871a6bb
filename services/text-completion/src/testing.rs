//! What the crate's unit tests share: a provider that answers without a network.

use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use futures::StreamExt;
use sluice_schema::TextCompletionRequest;

use crate::provider::{Chunk, ChunkStream, Provider, ProviderError};

/// A provider named "test" serving "main": streams "a" and "b" (to the prompt "hang": "a",
/// then nothing more, ever) and counts its calls.
#[derive(Default)]
pub(crate) struct Answers(AtomicUsize);

impl Answers {
    /// The calls made so far.
    pub(crate) fn calls(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Provider for Answers {
    fn name(&self) -> &'static str {
        "test"
    }
    fn model(&self) -> &str {
        "main"
    }
    fn endpoint(&self) -> &str {
        "http://user:secret@provider.test/v1/chat?key=secret"
    }
    fn supports_streaming(&self) -> bool {
        true
    }
    async fn generate_stream(
        &self,
        request: &TextCompletionRequest,
    ) -> Result<ChunkStream, ProviderError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        let chunks = ["a", "b"].map(|t| {
            Ok(Chunk {
                text: t.to_owned(),
                ..Default::default()
            })
        });
        if request.prompt == "hang" {
            // The first chunk, then a provider that never says more.
            let [first, _] = chunks;
            return Ok(futures::stream::iter([first])
                .chain(futures::stream::pending())
                .boxed());
        }
        Ok(futures::stream::iter(chunks).boxed())
    }
}
