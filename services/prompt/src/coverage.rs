//! The rules of a `jsonl` contract that need the request or the other lines
//! ([`crate::normalise::Answers`]): an object must answer an item the request names; at most
//! so many objects per item, or per item and page; an item's objects held until the answer
//! ends; the links a rewording must keep; and, at the end, how many of the request's items the
//! answer covered and which are still pending.
//!
//! Nothing here quotes the model's output or the request's text into a reason: reasons name
//! fields only (they go to logs and metrics).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::normalise::{self, Answers, LostLinks};

/// What the request's items say, and what the answer has covered so far.
pub struct Coverage {
    rules: &'static Answers,
    /// Each item's id, in the request's order, and the links its text holds.
    items: Vec<(String, Vec<String>)>,
    /// The ids covered by a published (or held) object.
    answered: BTreeSet<String>,
    /// Objects so far per (item, pair field value), for [`Answers::per_pair`].
    pairs: BTreeMap<(String, String), usize>,
    /// Objects so far per item, for [`Answers::per_item`].
    per_item: BTreeMap<String, usize>,
    /// The objects held ([`Answers::grouped`]): each item's, items in the order they first
    /// came.
    held: Vec<(String, Vec<Value>)>,
}

/// What to do with an object that passed its normaliser and schema.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// Publish these objects now (none when the rules hold an item's objects to the end:
    /// [`Coverage::release`] hands them out).
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
                Some((_, fields, _)) => fields
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
            per_item: BTreeMap::new(),
            held: Vec::new(),
        })
    }

    /// Applies the rules to one object; `lost_links` counts the links a rewording lost where
    /// that is a warning ([`LostLinks::Warn`]; the object is kept).
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
        // Checked before the limits, so a dropped rewording leaves room for a good one.
        if let Some((text_field, _, on_loss)) = self.rules.links {
            let text = value.get(text_field).and_then(Value::as_str).unwrap_or("");
            let lost = links.iter().filter(|l| !text.contains(l.as_str())).count();
            if lost > 0 && on_loss == LostLinks::Drop {
                return Verdict::Drop(
                    "lost-links",
                    format!("`{text_field}` lost {lost} of its item's links"),
                );
            }
            *lost_links += lost;
        }
        if let Some(max) = self.rules.per_item {
            let count = self.per_item.entry(id.clone()).or_default();
            if *count >= max {
                let objects = if max == 1 { "object" } else { "objects" };
                return Verdict::Drop(
                    "over-limit",
                    format!("more than {max} {objects} for one `{field}`"),
                );
            }
            *count += 1;
        }
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
        self.answered.insert(id.clone());
        if !self.rules.grouped {
            return Verdict::Publish(vec![value]);
        }
        match self.held.iter_mut().find(|(held_id, _)| *held_id == id) {
            Some((_, group)) => group.push(value),
            None => self.held.push((id, vec![value])),
        }
        Verdict::Publish(Vec::new())
    }

    /// The objects held, at the end of the answer (or at its failure): each item's together,
    /// items in the order they first came.
    pub fn release(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.held)
            .into_iter()
            .flat_map(|(_, group)| group)
            .collect()
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
        // Seed 000's rewording: every block expects one, and a block answered twice is one
        // covered (seed 002's templates allow one object per block).
        let mut c = Coverage::new(answers(n::CONTENT_REWORDING), &terms("blocks", blocks)).unwrap();
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
        assert!(published(c.admit(d("k2", "P"), &mut lost)).is_empty());
        // The answer ends: each block's decisions go out together.
        assert_eq!(
            c.release(),
            vec![d("k1", "P"), d("k1", "P"), d("k1", "Q"), d("k2", "P")]
        );
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
        assert_eq!(
            c.admit(
                json!({"block_id": "k1", "refined_text": "x [[L]]"}),
                &mut lost
            ),
            Verdict::Drop(
                "lost-links",
                "`refined_text` lost 1 of its item's links".into()
            ),
            "the link of k1's other decision counts too"
        );
        published(c.admit(
            json!({"block_id": "k1", "refined_text": "x [[L]] ((r))"}),
            &mut lost,
        ));
        assert_eq!(lost, 0);
        assert_eq!(c.tally(), (2, 1, Some(vec!["k2".into()])));
    }

    /// Seed 000's Phase 3 lines, as its example stream writes them.
    fn seed_000_decision(block: &str, page: &str, target: &str) -> Value {
        json!({"knowledge_block_id": block, "target_page": page, "action": "add_under",
               "target_block_id": target, "target_block_title": "T", "confidence": 0.9,
               "reasoning": "r"})
    }

    /// Seed 000 Phase 3: "Application must buffer all decisions with matching
    /// `knowledge_block_id` before showing them to user". A model that comes back to a block
    /// after another's decisions must not have that block shown in two parts: every decision
    /// is held until the answer ends, then each block's go out together, blocks in the order
    /// they first came.
    #[test]
    fn seed_000s_decisions_of_a_block_are_all_held_until_the_answer_ends() {
        let blocks = json!([{"block_id": "abc123"}, {"block_id": "def456"}]);
        for template in [n::INTEGRATION_DECISIONS, n::INTEGRATION_DECISIONS_SEED_000] {
            let mut c = Coverage::new(
                answers(template),
                &terms("knowledge_blocks", blocks.clone()),
            )
            .unwrap();
            let first = seed_000_decision("abc123", "Python/Concurrency", "pattern-section-123");
            let other = seed_000_decision("def456", "Python/Concurrency", "pattern-section-123");
            let back = seed_000_decision("abc123", "Textual/Architecture", "worker-section-789");
            let mut lost = 0;
            for d in [&first, &other, &back] {
                assert!(
                    published(c.admit(d.clone(), &mut lost)).is_empty(),
                    "{template}: nothing shown before all of a block's decisions are in"
                );
            }
            assert_eq!(c.release(), vec![first, back, other], "{template}");
            assert!(c.release().is_empty());
        }
    }

    /// Seed 002 §3.3: "Preserve `[[Page Links]]` and `((block-refs))` from original content", a
    /// validation rule of its client, which skips an object that fails one ("Log warning, skip
    /// object"): the block stays pending, for the caller to ask again. Seeds 000 and 001 have no
    /// such rule (their models check `block_id` and a non-empty text only): a lost link is
    /// a warning there.
    #[test]
    fn seed_002s_rewording_that_loses_a_link_is_dropped_and_left_pending() {
        let decisions = json!([
            {"knowledge_block_id": "abc123", "page": "Software Architecture",
             "action": "add_section", "full_text": "Bounded contexts matter more than [[Microservices]] size",
             "hierarchical_text": "- Read paper on ((ddd-ref))\n  - Bounded contexts"},
            {"knowledge_block_id": "def456", "page": "A", "action": "add_under",
             "full_text": "HNSW provides O(log n) nearest neighbor search."},
        ]);
        let mut c = Coverage::new(
            answers(n::CONTENT_REWORDING_SEED_002),
            &terms("decisions", decisions),
        )
        .unwrap();
        let mut lost = 0;
        assert_eq!(
            c.admit(
                json!({"block_id": "abc123", "refined_text": "Bounded contexts matter more than service size.\nEach context should have clear ownership."}),
                &mut lost
            ),
            Verdict::Drop(
                "lost-links",
                "`refined_text` lost 2 of its item's links".into()
            )
        );
        let kept = json!({"block_id": "abc123",
            "refined_text": "Bounded contexts matter more than [[Microservices]] size ((ddd-ref))."});
        assert_eq!(published(c.admit(kept.clone(), &mut lost)), vec![kept]);
        assert_eq!(lost, 0);
        assert_eq!(c.tally(), (2, 1, Some(vec!["def456".into()])));

        // Seed 000's rewording: kept, the loss counted for the warning.
        let blocks = json!([{"block_id": "abc123", "content": "Learned [[Python]] today"}]);
        let mut c = Coverage::new(answers(n::CONTENT_REWORDING), &terms("blocks", blocks)).unwrap();
        let line = json!({"block_id": "abc123", "reworded_content": "Python's asyncio.Queue is thread-safe."});
        assert_eq!(published(c.admit(line.clone(), &mut lost)), vec![line]);
        assert_eq!(lost, 1);
    }

    /// Seed 002 §1.2: "One decision per candidate page". Its parser yields each line as it
    /// completes, so the first decision for a page is the one shown; a later one for the same
    /// page is dropped (`over-limit`), and never counts as a second answer.
    #[test]
    fn seed_002s_decisions_are_one_per_candidate_page() {
        let pages = json!([{"page_name": "Software Architecture"}, {"page_name": "Microservices"}]);
        let mut c = Coverage::new(
            answers(n::INTEGRATION_DECISIONS_SEED_002),
            &terms("candidate_pages", pages),
        )
        .unwrap();
        let line = |page: &str, action: &str| {
            json!({"page": page, "action": action, "target_id": null, "target_title": null,
                   "confidence": 0.88, "reasoning": "r"})
        };
        let mut lost = 0;
        let first = line("Software Architecture", "add_section");
        assert_eq!(published(c.admit(first.clone(), &mut lost)), vec![first]);
        assert_eq!(
            c.admit(line("Software Architecture", "skip"), &mut lost),
            Verdict::Drop("over-limit", "more than 1 object for one `page`".into())
        );
        let skip = line("Microservices", "skip");
        assert_eq!(published(c.admit(skip.clone(), &mut lost)), vec![skip]);
        assert_eq!(c.tally(), (2, 2, Some(vec![])));
    }

    /// Seed 002 §1.1: "One classification result per block", and §1.3: "Each knowledge block
    /// is reworded only once": the first line for a block is the one its parser showed; a
    /// later one for the same block is dropped (`over-limit`).
    #[test]
    fn seed_002s_classifications_and_rewordings_are_one_per_block() {
        let blocks = json!([{"block_id": "abc123"}, {"block_id": "def456"}]);
        let mut c = Coverage::new(
            answers(n::KNOWLEDGE_CLASSIFICATION_SEED_002),
            &terms("blocks", blocks),
        )
        .unwrap();
        let mut lost = 0;
        let first = json!({"block_id": "abc123", "is_knowledge": true, "confidence": 0.85});
        assert_eq!(published(c.admit(first.clone(), &mut lost)), vec![first]);
        assert_eq!(
            c.admit(
                json!({"block_id": "abc123", "is_knowledge": false, "confidence": 0.92}),
                &mut lost
            ),
            Verdict::Drop("over-limit", "more than 1 object for one `block_id`".into())
        );
        assert_eq!(c.tally(), (2, 1, Some(vec!["def456".into()])));

        // Two decisions name the block (one per page): it is reworded once.
        let decisions = json!([
            {"knowledge_block_id": "abc123", "page": "A", "action": "add_section",
             "full_text": "Bounded contexts matter."},
            {"knowledge_block_id": "abc123", "page": "B", "action": "add_under",
             "full_text": "Bounded contexts matter."},
        ]);
        let mut c = Coverage::new(
            answers(n::CONTENT_REWORDING_SEED_002),
            &terms("decisions", decisions),
        )
        .unwrap();
        let first = json!({"block_id": "abc123", "refined_text": "Bounded contexts matter."});
        assert_eq!(published(c.admit(first.clone(), &mut lost)), vec![first]);
        assert_eq!(
            c.admit(
                json!({"block_id": "abc123", "refined_text": "Contexts matter."}),
                &mut lost
            ),
            Verdict::Drop("over-limit", "more than 1 object for one `block_id`".into())
        );
        assert_eq!(c.tally(), (1, 1, Some(vec![])));
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
