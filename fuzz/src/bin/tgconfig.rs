//! What TrustGraph's config service sends a `--config-service` processor: config responses
//! and pushes (decoded as `sluice_runtime::flows` decodes them), a flow's definition (its
//! `processor:<id>` value) with the topic names in it, and prompt templates of type `prompt`
//! (`TemplateSet::from_trustgraph_config`, each template then rendered). Properties: no
//! panic; a response or push that decodes round-trips; a topic name that parses maps to a
//! Pulsar topic on both mappings, and the name it maps to parses again.

use std::collections::BTreeMap;

use serde::{Serialize, de::DeserializeOwned};
use sluice_schema::{
    TopicMapping, TopicName,
    config::{ConfigPush, ConfigResponse, FlowDefinition},
};

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(body: &[u8]) {
    let Ok(record) = serde_json::from_slice::<T>(body) else {
        return;
    };
    let written = serde_json::to_vec(&record).unwrap_or_else(|e| panic!("cannot write: {e}"));
    let again: T = serde_json::from_slice(&written)
        .unwrap_or_else(|e| panic!("a written record does not read back: {e}"));
    assert_eq!(record, again, "round trip changed the record");
}

fn flow(body: &[u8]) {
    let Ok(text) = std::str::from_utf8(body) else {
        return;
    };
    let Ok(definition) = serde_json::from_str::<FlowDefinition>(text) else {
        return;
    };
    for name in ["request", "response", "text-completion-request", "model"] {
        let _ = definition.topic(name);
        let _ = definition.parameter(name);
    }
    for topic in definition.topics.values() {
        let Ok(parsed) = topic.parse::<TopicName>() else {
            continue;
        };
        for mapping in [TopicMapping::Durable, TopicMapping::TrustGraph] {
            let pulsar = parsed.to_pulsar(mapping);
            assert!(
                pulsar.parse::<TopicName>().is_ok(),
                "{topic:?} maps to {pulsar:?}, which does not parse"
            );
        }
    }
}

fn templates(body: &[u8]) {
    let Ok(entries) = serde_json::from_slice::<BTreeMap<String, String>>(body) else {
        return;
    };
    let Ok(set) = sluice_prompt::templates::TemplateSet::from_trustgraph_config(&entries, false)
    else {
        return;
    };
    let ids: Vec<String> = set.ids().map(str::to_owned).collect();
    let terms: BTreeMap<String, String> = [("text", "\"hello\""), ("question", "\"why?\"")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    for id in ids {
        let _ = set.render(&id, &terms);
    }
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some(input) = sluice_fuzz::Input::new(data) else {
            return;
        };
        match input.selector % 4 {
            0 => round_trip::<ConfigResponse>(input.body),
            1 => round_trip::<ConfigPush>(input.body),
            2 => flow(input.body),
            _ => templates(input.body),
        }
    });
}
