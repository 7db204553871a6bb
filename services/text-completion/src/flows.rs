//! The text-completion flows TrustGraph's config service assigns (see
//! [`sluice_runtime::flows`]): each flow's topics, with its `model` and `temperature`
//! parameters as defaults for the requests that set neither.

use std::sync::Arc;

use async_trait::async_trait;
use sluice_runtime::flows::{FlowError, FlowKey, FlowService};
use sluice_schema::config::FlowDefinition;

use crate::handler::TextCompletionService;

/// One handler per flow, sharing the provider, its connections and its metrics.
pub struct TextCompletionFlows {
    service: TextCompletionService,
}

impl TextCompletionFlows {
    /// The flows served by `service`'s provider.
    pub fn new(service: &TextCompletionService) -> Self {
        Self {
            service: service.for_flow(None, None),
        }
    }
}

#[async_trait]
impl FlowService for TextCompletionFlows {
    type Handler = TextCompletionService;

    async fn flow(
        &self,
        _key: &FlowKey,
        definition: &FlowDefinition,
    ) -> Result<Arc<TextCompletionService>, FlowError> {
        let temperature = match definition.parameter("temperature") {
            Some(t) => Some(
                t.parse::<f64>()
                    .ok()
                    .filter(|t| (0.0..=2.0).contains(t))
                    .ok_or_else(|| {
                        "the flow's `temperature` parameter: expected a number from 0 to 2"
                            .to_owned()
                    })?,
            ),
            None => None,
        };
        let handler = self
            .service
            .for_flow(definition.parameter("model"), temperature);
        Ok(Arc::new(handler))
    }
}

#[cfg(test)]
mod tests {
    use prometheus::Registry;
    use serde_json::json;

    use super::*;
    use crate::{metrics::LlmMetrics, retry::RetryPolicy, testing::Answers};

    fn definition(parameters: serde_json::Value) -> FlowDefinition {
        serde_json::from_value(json!({ "topics": {}, "parameters": parameters })).unwrap()
    }

    /// A flow's `model` is served first, besides the processor's own; a `temperature` outside
    /// 0..=2 or not a number refuses the flow with a message naming the parameter.
    #[tokio::test]
    async fn a_flow_serves_its_model_and_refuses_a_bad_temperature() {
        let service = TextCompletionService::new(
            Arc::new(Answers::default()),
            RetryPolicy::default(),
            LlmMetrics::register(&Registry::new()).unwrap(),
        );
        let flows = TextCompletionFlows::new(&service);
        let key = FlowKey {
            workspace: "default".into(),
            flow: "f1".into(),
        };
        let handler = flows
            .flow(
                &key,
                &definition(json!({"model": "other", "temperature": "0.5"})),
            )
            .await
            .unwrap();
        assert_eq!(handler.models(), ["other", "main"]);
        let handler = flows.flow(&key, &definition(json!({}))).await.unwrap();
        assert_eq!(handler.models(), ["main"]);
        for bad in [json!("3"), json!("warm"), json!(-1)] {
            let e = flows
                .flow(&key, &definition(json!({ "temperature": bad })))
                .await
                .err()
                .unwrap();
            assert!(e.to_string().contains("`temperature`"), "{bad}: {e}");
        }
    }
}
