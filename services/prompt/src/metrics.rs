//! The prompt processor's metrics (`sluice_prompt_*`). Template labels only ever carry ids of
//! loaded templates, never an id a request made up.

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

/// The prompt processor's metrics.
#[derive(Clone)]
pub struct PromptMetrics {
    objects: IntCounterVec,
    skipped: IntCounterVec,
    corrections: IntCounterVec,
    template_errors: IntCounterVec,
    reloads: IntCounterVec,
    templates: IntGauge,
}

impl PromptMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let objects = IntCounterVec::new(
            Opts::new(
                "sluice_prompt_objects_total",
                "Objects published from json and jsonl answers",
            ),
            &["template"],
        )?;
        let skipped = IntCounterVec::new(
            Opts::new(
                "sluice_prompt_lines_skipped_total",
                "jsonl lines skipped: malformed (not a JSON object), invalid (fails the schema), rejected (normalisation drops it), unmatched (answers no item of the request), over-limit (more objects per item, or per item and page, than the contract allows), lost-links (a rewording without a link its contract says to keep)",
            ),
            &["template", "reason"],
        )?;
        let corrections = IntCounterVec::new(
            Opts::new(
                "sluice_prompt_corrections_total",
                "Corrections normalisation made to objects (e.g. a confidence clamped)",
            ),
            &["template"],
        )?;
        let template_errors = IntCounterVec::new(
            Opts::new(
                "sluice_prompt_template_errors_total",
                "Requests that could not be rendered: unknown template, or render (e.g. a missing variable)",
            ),
            &["kind"],
        )?;
        let reloads = IntCounterVec::new(
            Opts::new(
                "sluice_prompt_template_reloads_total",
                "Template reloads by outcome",
            ),
            &["outcome"],
        )?;
        let templates = IntGauge::new("sluice_prompt_templates", "Templates loaded")?;
        // These label sets are fixed: export them at 0 so that an alert on the first render
        // error or failed reload has a series to compare with.
        for kind in ["unknown", "render"] {
            template_errors.with_label_values(&[kind]);
        }
        for outcome in ["success", "failure"] {
            reloads.with_label_values(&[outcome]);
        }
        registry.register(Box::new(objects.clone()))?;
        registry.register(Box::new(skipped.clone()))?;
        registry.register(Box::new(corrections.clone()))?;
        registry.register(Box::new(template_errors.clone()))?;
        registry.register(Box::new(reloads.clone()))?;
        registry.register(Box::new(templates.clone()))?;
        Ok(Self {
            objects,
            skipped,
            corrections,
            template_errors,
            reloads,
            templates,
        })
    }

    pub(crate) fn object(&self, template: &str) {
        self.objects.with_label_values(&[template]).inc();
    }

    pub(crate) fn skipped(&self, template: &str, reason: &str) {
        self.skipped.with_label_values(&[template, reason]).inc();
    }

    pub(crate) fn corrected(&self, template: &str, n: usize) {
        self.corrections
            .with_label_values(&[template])
            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }

    pub(crate) fn template_error(&self, kind: &str) {
        self.template_errors.with_label_values(&[kind]).inc();
    }

    pub(crate) fn reloaded(&self, ok: bool) {
        let outcome = if ok { "success" } else { "failure" };
        self.reloads.with_label_values(&[outcome]).inc();
    }

    pub(crate) fn templates_loaded(&self, n: usize) {
        self.templates.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
