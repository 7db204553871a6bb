//! The rules of a `jsonl` contract that need the request or the other lines
//! ([`crate::normalise::Answers`]): an object must answer an item the request names; at most
//! so many objects per item and page; an item's objects held until the answer moves on; the
//! links a rewording must keep; and, at the end, how many of the request's items the answer
//! covered and which are still pending.
//!
//! Nothing here quotes the model's output or the request's text into a reason: reasons name
//! fields only (they go to logs and metrics).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::normalise::{self, Answers};

/// What the request's items say, and what the answer has covered so far.
pub struct Coverage {
    rules: &'static Answers,
    /// Each item's id, in the request's order, and the links its text holds.
    items: Vec<(String, Vec<String>)>,
    /// The ids covered by a published (or held) object.
    answered: BTreeSet<String>,
    /// Objects so far per (item, pair field value), for [`Answers::per_pair`].
    pairs: BTreeMap<(String, String), usize>,
    /// The item whose objects are held ([`Answers::grouped`]), and they.
    held: Option<(String, Vec<Value>)>,
}

/// What to do with an object that passed its normaliser and schema.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// Publish these objects now (none while an item's objects are held; several when a
    /// held group is released).
    Publish(Vec<Value>),
    /// Drop the object: why (field names only), and the metric's reason.
    Drop(&'static str, String),
}

impl Coverage {
    /// The tracker for a request with `terms` (JSON-encoded values, as the request carries
    /// them), or `None` when the template has no such rules or the request does not list its
    /// items where the rules say (a file template's own terms): then no rule applies.
    pub fn new(rules: Option<&'static Answers>, terms: &BTreeMap<String, String>) -> Option<Self> {
        let rules = rules?;
        let list: Value = serde_json::from_str(terms.get(rules.term)?).ok()?;
        let mut items: Vec<(String, Vec<String>)> = Vec::new();
        for item in list.as_array()? {
            let Some(id) = item.get(rules.item_id).and_then(Value::as_str) else {
                continue;
            };
            let links = match rules.links {
                Some((_, fields)) => fields
                    .iter()
                    .filter_map(|f| item.get(*f).and_then(Value::as_str))
                    .flat_map(normalise::links)
                    .map(str::to_owned)
                    .collect(),
                None => Vec::new(),
            };
            match items.iter_mut().find(|(known, _)| known == id) {
                // An item named twice (the NDJSON parser contract's
                // (docs/specs.md#the-structured-ndjson-contracts) decisions name a block once per
                // page): one item, all its links.
                Some((_, known)) => {
                    for l in links {
                        if !known.contains(&l) {
                            known.push(l);
                        }
                    }
                }
                None => items.push((id.to_owned(), links)),
            }
        }
        Some(Self {
            rules,
            items,
            answered: BTreeSet::new(),
            pairs: BTreeMap::new(),
            held: None,
        })
    }

    /// Applies the rules to one object; `lost_links` counts the links a rewording lost (kept
    /// anyway: a warning).
    pub fn admit(&mut self, value: Value, lost_links: &mut usize) -> Verdict {
        let field = self.rules.field;
        let Some(id) = value.get(field).and_then(Value::as_str).map(str::to_owned) else {
            return Verdict::Drop("unmatched", format!("no `{field}` naming an item"));
        };
        let Some((_, links)) = self.items.iter().find(|(known, _)| *known == id) else {
            return Verdict::Drop(
                "unmatched",
                format!(
                    "`{field}` names no item of the request's `{}`",
                    self.rules.term
                ),
            );
        };
        if let Some((pair_field, max)) = self.rules.per_pair {
            let other = value
                .get(pair_field)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let count = self.pairs.entry((id.clone(), other)).or_default();
            if *count >= max {
                return Verdict::Drop(
                    "over-limit",
                    format!("more than {max} objects for one `{field}` and `{pair_field}`"),
                );
            }
            *count += 1;
        }
        if let Some((text_field, _)) = self.rules.links {
            let text = value.get(text_field).and_then(Value::as_str).unwrap_or("");
            *lost_links += links.iter().filter(|l| !text.contains(l.as_str())).count();
        }
        self.answered.insert(id.clone());
        if !self.rules.grouped {
            return Verdict::Publish(vec![value]);
        }
        match &mut self.held {
            Some((held_id, group)) if *held_id == id => {
                group.push(value);
                Verdict::Publish(Vec::new())
            }
            _ => {
                let released = self.held.replace((id, vec![value]));
                Verdict::Publish(released.map(|(_, g)| g).unwrap_or_default())
            }
        }
    }

    /// The objects still held, at the end of the answer.
    pub fn release(&mut self) -> Vec<Value> {
        self.held.take().map(|(_, g)| g).unwrap_or_default()
    }

    /// The request's item count.
    pub fn expected(&self) -> u64 {
        u64::try_from(self.items.len()).unwrap_or(u64::MAX)
    }

    /// The request's item count, how many the answer covered, and (when every item expects
    /// an object) the ids of those it did not.
    pub fn tally(&self) -> (u64, u64, Option<Vec<String>>) {
        let expected = self.expected();
        let answered = u64::try_from(self.answered.len()).unwrap_or(u64::MAX);
        let pending = self.rules.every.then(|| {
            self.items
                .iter()
                .filter(|(id, _)| !self.answered.contains(id))
                .map(|(id, _)| id.clone())
                .collect()
        });
        (expected, answered, pending)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use serde_json::json;

    use super::*;
    use crate::normalise::{self as n, answers};

    fn terms(term: &str, value: Value) -> BTreeMap<String, String> {
        [(term.to_owned(), value.to_string())].into()
    }

    fn published(v: Verdict) -> Vec<Value> {
        match v {
            Verdict::Publish(p) => p,
            Verdict::Drop(kind, why) => panic!("dropped: {kind}: {why}"),
        }
    }

    #[test]
    fn an_object_for_an_item_the_request_does_not_name_is_dropped() {
        let blocks = json!([{"block_id": "a", "content": "x"}, {"block_id": "b", "content": "y"}]);
        let mut c = Coverage::new(
            answers(n::KNOWLEDGE_CLASSIFICATION),
            &terms("blocks", blocks),
        )
        .unwrap();
        let mut lost = 0;
        assert_eq!(
            published(c.admit(json!({"block_id": "a"}), &mut lost)).len(),
            1
        );
        assert_eq!(
            c.admit(json!({"block_id": "zzz-invented"}), &mut lost),
            Verdict::Drop(
                "unmatched",
                "`block_id` names no item of the request's `blocks`".into()
            )
        );
        // Classification returns only the knowledge blocks: nothing is pending.
        assert_eq!(c.tally(), (2, 1, None));
    }

    #[test]
    fn every_item_expecting_an_object_reports_the_pending_ones() {
        let blocks = json!([{"block_id": "a"}, {"block_id": "b"}, {"block_id": "c"}]);
        let mut c = Coverage::new(
            answers(n::KNOWLEDGE_CLASSIFICATION_SEED_002),
            &terms("blocks", blocks),
        )
        .unwrap();
        let mut lost = 0;
        published(c.admit(json!({"block_id": "b"}), &mut lost));
        published(c.admit(json!({"block_id": "b"}), &mut lost));
        assert_eq!(c.tally(), (3, 1, Some(vec!["a".into(), "c".into()])));
    }

    #[test]
    fn decisions_are_held_per_block_and_limited_to_two_per_page() {
        let blocks = json!([{"block_id": "k1"}, {"block_id": "k2"}]);
        let mut c = Coverage::new(
            answers(n::INTEGRATION_DECISIONS),
            &terms("knowledge_blocks", blocks),
        )
        .unwrap();
        let d = |k: &str, p: &str| json!({"knowledge_block_id": k, "target_page": p});
        let mut lost = 0;
        assert!(published(c.admit(d("k1", "P"), &mut lost)).is_empty());
        assert!(published(c.admit(d("k1", "P"), &mut lost)).is_empty());
        assert_eq!(
            c.admit(d("k1", "P"), &mut lost),
            Verdict::Drop(
                "over-limit",
                "more than 2 objects for one `knowledge_block_id` and `target_page`".into()
            )
        );
        assert!(published(c.admit(d("k1", "Q"), &mut lost)).is_empty());
        // The answer moves on to k2: k1's three decisions go out together.
        let released = published(c.admit(d("k2", "P"), &mut lost));
        assert_eq!(released, vec![d("k1", "P"), d("k1", "P"), d("k1", "Q")]);
        assert_eq!(c.release(), vec![d("k2", "P")]);
        assert!(c.release().is_empty());
        assert_eq!(c.tally(), (2, 2, None));
    }

    #[test]
    fn a_rewording_that_loses_links_is_counted() {
        let blocks = json!([{"block_id": "a",
            "content": "Learned [[Rust]] traits today, see ((ref-1)) and [[Tokio]]"}]);
        let mut c = Coverage::new(answers(n::CONTENT_REWORDING), &terms("blocks", blocks)).unwrap();
        let mut lost = 0;
        published(c.admit(
            json!({"block_id": "a", "reworded_content": "[[Rust]] traits, see ((ref-1))."}),
            &mut lost,
        ));
        assert_eq!(lost, 1, "[[Tokio]] was lost");
        assert_eq!(c.tally(), (1, 1, Some(vec![])));
    }

    #[test]
    fn seed_002s_rewording_items_are_the_decisions_blocks_once() {
        let decisions = json!([
            {"knowledge_block_id": "k1", "page": "A", "full_text": "x [[L]]"},
            {"knowledge_block_id": "k2", "page": "A", "full_text": "y"},
            {"knowledge_block_id": "k1", "page": "B", "hierarchical_text": "- x ((r))"},
        ]);
        let mut c = Coverage::new(
            answers(n::CONTENT_REWORDING_SEED_002),
            &terms("decisions", decisions),
        )
        .unwrap();
        let mut lost = 0;
        published(c.admit(json!({"block_id": "k1", "refined_text": "x"}), &mut lost));
        assert_eq!(lost, 2, "both of k1's links");
        assert_eq!(c.tally(), (2, 1, Some(vec!["k2".into()])));
    }

    #[test]
    fn no_rules_or_no_such_term_means_no_tracking() {
        assert!(Coverage::new(None, &terms("blocks", json!([]))).is_none());
        assert!(Coverage::new(answers(n::KNOWLEDGE_CLASSIFICATION), &BTreeMap::new()).is_none());
        assert!(
            Coverage::new(
                answers(n::KNOWLEDGE_CLASSIFICATION),
                &terms("blocks", json!("not a list"))
            )
            .is_none()
        );
    }

    #[test]
    fn links_are_found_with_their_brackets() {
        assert_eq!(
            n::links("a [[B c]] d ((e)) [[]] [[unclosed"),
            vec!["[[B c]]", "((e))"]
        );
    }
}
