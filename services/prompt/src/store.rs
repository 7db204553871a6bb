//! The live template set: loaded at start, reloaded on SIGHUP or when the file changes.
//! A reload builds a whole new set and swaps it in; requests in flight keep the set they
//! started with, and a file that fails to load leaves the previous set in place.

use std::{
    path::PathBuf,
    sync::{Arc, RwLock},
    time::{Duration, SystemTime},
};

use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::{
    metrics::PromptMetrics,
    templates::{LoadError, TemplateSet},
};

/// The templates in use.
pub struct TemplateStore {
    path: Option<PathBuf>,
    builtins: bool,
    current: RwLock<Arc<TemplateSet>>,
    metrics: Option<PromptMetrics>,
}

type Fingerprint = Option<(SystemTime, u64)>;

impl TemplateStore {
    /// Loads the built-ins (when `builtins`) and the file at `path` (when given).
    pub fn open(
        path: Option<PathBuf>,
        builtins: bool,
        metrics: Option<PromptMetrics>,
    ) -> Result<Arc<Self>, LoadError> {
        let set = TemplateSet::load(path.as_deref(), builtins)?;
        if let Some(m) = &metrics {
            m.templates_loaded(set.ids().count());
        }
        Ok(Arc::new(Self {
            path,
            builtins,
            current: RwLock::new(Arc::new(set)),
            metrics,
        }))
    }

    /// A store holding `set` (no file behind it).
    pub fn fixed(set: TemplateSet) -> Arc<Self> {
        Arc::new(Self {
            path: None,
            builtins: false,
            current: RwLock::new(Arc::new(set)),
            metrics: None,
        })
    }

    /// Swaps `set` in (templates from TrustGraph's config service): requests in flight keep
    /// the set they started with.
    pub fn replace(&self, set: TemplateSet) {
        if let Some(m) = &self.metrics {
            m.reloaded(true);
            m.templates_loaded(set.ids().count());
        }
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(set);
    }

    /// Counts a set that could not be loaded (the previous one stays in use).
    pub fn load_failed(&self) {
        if let Some(m) = &self.metrics {
            m.reloaded(false);
        }
    }

    /// A store holding `set`, counted in `metrics` (templates from TrustGraph's config
    /// service; nothing to watch).
    pub fn with_metrics(set: TemplateSet, metrics: PromptMetrics) -> Arc<Self> {
        metrics.templates_loaded(set.ids().count());
        Arc::new(Self {
            path: None,
            builtins: false,
            current: RwLock::new(Arc::new(set)),
            metrics: Some(metrics),
        })
    }

    /// The set to use for a request that starts now.
    pub fn current(&self) -> Arc<TemplateSet> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Loads the file again and swaps the new set in; on failure the old set stays.
    pub fn reload(&self) -> Result<usize, LoadError> {
        let result = TemplateSet::load(self.path.as_deref(), self.builtins);
        if let Some(m) = &self.metrics {
            m.reloaded(result.is_ok());
        }
        let set = result?;
        let n = set.ids().count();
        if let Some(m) = &self.metrics {
            m.templates_loaded(n);
        }
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(set);
        Ok(n)
    }

    fn fingerprint(&self) -> Fingerprint {
        let meta = std::fs::metadata(self.path.as_ref()?).ok()?;
        Some((meta.modified().ok()?, meta.len()))
    }

    fn reload_logged(&self, why: &str) {
        match self.reload() {
            Ok(n) => info!(templates = n, why, "templates reloaded"),
            Err(e) => {
                error!(error = %e, why, "templates not reloaded; the previous ones stay in use")
            }
        }
    }

    /// Reloads on SIGHUP, and when the file's modification time or size changes (checked
    /// every `poll`; this also catches Kubernetes ConfigMap updates, which swap a symlink),
    /// until `stop`.
    pub fn watch(
        self: Arc<Self>,
        poll: Duration,
        stop: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            if self.path.is_none() {
                return;
            }
            let mut hup =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        error!(error = %e, "cannot listen for SIGHUP; the file is still watched");
                        None
                    }
                };
            let mut seen = self.fingerprint();
            let mut tick = tokio::time::interval(poll);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    Some(()) = async {
                        match hup.as_mut() {
                            Some(h) => h.recv().await,
                            None => std::future::pending().await,
                        }
                    } => {
                        seen = self.fingerprint();
                        self.reload_logged("SIGHUP");
                    }
                    _ = tick.tick() => {
                        let now = self.fingerprint();
                        if now != seen {
                            seen = now;
                            self.reload_logged("the template file changed");
                        }
                    }
                }
            }
        })
    }
}
