//! Counters, gauges and histograms of the control plane, rendered in the
//! Prometheus text format. Lock-free on the hot paths.
//!
//! Who reads them decides what is shown ([`Viewer`]): host-wide figures
//! carry no owner's names, and series labelled with a template's name and
//! id (warm pool sizes) are shown to the template's owner and to the admin
//! key only.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A histogram with fixed buckets (upper bounds in seconds).
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, secs: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if secs <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_micros.fetch_add((secs.max(0.0) * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", c.load(Ordering::Relaxed));
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

const LATENCY: &[f64] = &[0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

pub struct Metrics {
    pub create_to_ready: Histogram,
    pub exec_latency: Histogram,
    pub commands_total: AtomicU64,
    /// Seconds, as f64 bits.
    reconciler_lag: AtomicU64,
    /// Reconciler passes completed (pools tended included): what a test
    /// waits on to know that the reconciler has looked again.
    pub reconciler_ticks_total: AtomicU64,
    /// Creates served by a warm sandbox, and creates of a template with a
    /// warm pool that found none ready.
    pub warm_claims_total: AtomicU64,
    pub warm_misses_total: AtomicU64,
    /// Time to start one warm sandbox.
    pub warm_refill: Histogram,
    /// Ready warm sandboxes per template, as of the last reconciler tick.
    warm_pool_sizes: Mutex<Vec<WarmPoolSize>>,
    /// Creates no node could be found for (see [`Metrics::placement_failed`]).
    placement_failures_total: AtomicU64,
    /// Nodes this node declared lost.
    pub nodes_lost_total: AtomicU64,
}

/// One template's warm pool, for `hutch_warm_pool_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmPoolSize {
    /// The key that owns the template: only it (and the admin) sees it.
    pub owner: String,
    pub template: String,
    pub template_id: String,
    pub ready: u64,
}

/// Who the metrics are rendered for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Viewer<'a> {
    /// The admin key: every owner's series.
    Admin,
    /// Another key: host-wide figures and its own templates' series.
    Owner(&'a str),
}

impl Viewer<'_> {
    fn sees(&self, owner: &str) -> bool {
        match self {
            Viewer::Admin => true,
            Viewer::Owner(me) => *me == owner,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            create_to_ready: Histogram::new(LATENCY),
            exec_latency: Histogram::new(LATENCY),
            commands_total: AtomicU64::new(0),
            reconciler_lag: AtomicU64::new(0),
            reconciler_ticks_total: AtomicU64::new(0),
            warm_claims_total: AtomicU64::new(0),
            warm_misses_total: AtomicU64::new(0),
            warm_refill: Histogram::new(LATENCY),
            warm_pool_sizes: Mutex::new(Vec::new()),
            placement_failures_total: AtomicU64::new(0),
            nodes_lost_total: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn set_reconciler_lag(&self, secs: f64) {
        self.reconciler_lag.store(secs.to_bits(), Ordering::Relaxed);
    }

    /// A create found no node to place it on (none active with the room,
    /// the class or the template it needs): `hutch_placement_failures_total`.
    pub fn placement_failed(&self) {
        self.placement_failures_total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_warm_pool_sizes(&self, sizes: Vec<WarmPoolSize>) {
        *self.warm_pool_sizes.lock().unwrap_or_else(|p| p.into_inner()) = sizes;
    }

    /// The whole exposition for `viewer`; `states` is the count of
    /// sandboxes per state, `running` the commands running now (host-wide
    /// figures, without owners).
    pub fn render(&self, states: &[(hutch_api::SandboxState, u64)], running: u64, viewer: Viewer<'_>) -> String {
        let mut out = String::with_capacity(4096);
        let _ = writeln!(out, "# HELP hutch_sandboxes Sandboxes by state.\n# TYPE hutch_sandboxes gauge");
        for st in hutch_api::SandboxState::ALL {
            let n = states.iter().find(|(s, _)| *s == st).map_or(0, |(_, n)| *n);
            let _ = writeln!(out, "hutch_sandboxes{{state=\"{}\"}} {n}", st.as_str());
        }
        self.create_to_ready.render(
            "hutch_sandbox_create_to_ready_seconds",
            "Time from a create request to a running sandbox.",
            &mut out,
        );
        self.exec_latency.render("hutch_exec_seconds", "Time from an exec request to the command's exit.", &mut out);
        let _ = writeln!(
            out,
            "# HELP hutch_commands_running Commands running now, background ones included.\n# TYPE hutch_commands_running gauge\nhutch_commands_running {running}"
        );
        let _ = writeln!(
            out,
            "# HELP hutch_commands_total Commands started.\n# TYPE hutch_commands_total counter\nhutch_commands_total {}",
            self.commands_total.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP hutch_reconciler_lag_seconds How long past its expiry the latest expired sandbox was reaped.\n\
             # TYPE hutch_reconciler_lag_seconds gauge\nhutch_reconciler_lag_seconds {}",
            f64::from_bits(self.reconciler_lag.load(Ordering::Relaxed))
        );
        let _ = writeln!(
            out,
            "# HELP hutch_reconciler_ticks_total Reconciler passes completed.\n\
             # TYPE hutch_reconciler_ticks_total counter\nhutch_reconciler_ticks_total {}",
            self.reconciler_ticks_total.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP hutch_warm_pool_size Warm sandboxes ready to be claimed, per template.\n\
             # TYPE hutch_warm_pool_size gauge"
        );
        for p in self.warm_pool_sizes.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            if viewer.sees(&p.owner) {
                let (name, id, n) = (&p.template, &p.template_id, p.ready);
                let _ = writeln!(out, "hutch_warm_pool_size{{template=\"{name}\",template_id=\"{id}\"}} {n}");
            }
        }
        let _ = writeln!(
            out,
            "# HELP hutch_warm_claims_total Creates served by a warm sandbox.\n# TYPE hutch_warm_claims_total counter\n\
             hutch_warm_claims_total {}",
            self.warm_claims_total.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP hutch_warm_misses_total Creates of a template with a warm pool that found none ready.\n\
             # TYPE hutch_warm_misses_total counter\nhutch_warm_misses_total {}",
            self.warm_misses_total.load(Ordering::Relaxed)
        );
        self.warm_refill.render("hutch_warm_refill_seconds", "Time to start one warm sandbox.", &mut out);
        let _ = writeln!(
            out,
            "# HELP hutch_placement_failures_total Creates no node of the fleet could take.\n\
             # TYPE hutch_placement_failures_total counter\nhutch_placement_failures_total {}\n\
             # HELP hutch_fleet_nodes_lost_total Nodes this node declared lost.\n\
             # TYPE hutch_fleet_nodes_lost_total counter\nhutch_fleet_nodes_lost_total {}",
            self.placement_failures_total.load(Ordering::Relaxed),
            self.nodes_lost_total.load(Ordering::Relaxed)
        );
        out
    }
}

impl crate::control::Control {
    /// The Prometheus exposition.
    /// `/metrics` for a bearer credential: the scrape token (the operator's
    /// view, as an admin key's) or an API key (its owner's view).
    pub async fn metrics_for(&self, bearer: &str) -> crate::error::Result<String> {
        use subtle::ConstantTimeEq;
        let scrape = self.metrics_token.as_deref().is_some_and(|t| bool::from(t.as_bytes().ct_eq(bearer.as_bytes())));
        if scrape {
            return self.render_metrics(Viewer::Admin).await;
        }
        let caller = self
            .authenticate(bearer)
            .await?
            .ok_or(crate::error::ControlError::Unauthorized("a valid API key or scrape token is required"))?;
        self.metrics_text(&caller).await
    }

    pub async fn metrics_text(&self, caller: &crate::ids::Caller) -> crate::error::Result<String> {
        let viewer = if caller.admin { Viewer::Admin } else { Viewer::Owner(caller.owner.as_str()) };
        self.render_metrics(viewer).await
    }

    async fn render_metrics(&self, viewer: Viewer<'_>) -> crate::error::Result<String> {
        let states = self.db(|s| s.count_by_state()).await?;
        let running: u64 = self.commands_running().await.iter().map(|(_, n)| n).sum();
        let mut text = self.metrics.render(&states, running, viewer);
        self.audit.render(&mut text);
        self.render_events(&mut text);
        let owner = match viewer {
            Viewer::Admin => None,
            Viewer::Owner(o) => Some(o),
        };
        self.render_usage(owner, &mut text).await?;
        self.render_fleet(owner.is_none(), &mut text).await?;
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_buckets_cumulatively() {
        let m = Metrics::default();
        m.exec_latency.observe(0.0015);
        m.exec_latency.observe(0.3);
        let text = m.render(&[(hutch_api::SandboxState::Running, 3)], 2, Viewer::Admin);
        assert!(text.contains("hutch_commands_running 2"));
        assert!(text.contains("hutch_sandboxes{state=\"running\"} 3"));
        assert!(text.contains("hutch_sandboxes{state=\"suspended\"} 0"));
        assert!(text.contains("hutch_exec_seconds_bucket{le=\"0.002\"} 1"));
        assert!(text.contains("hutch_exec_seconds_bucket{le=\"0.5\"} 2"));
        assert!(text.contains("hutch_exec_seconds_count 2"));
        assert!(text.contains("hutch_reconciler_ticks_total 0"));
        assert!(text.contains("\nhutch_placement_failures_total 0\n"), "{text}");
        m.placement_failed();
        assert!(m.render(&[], 0, Viewer::Admin).contains("\nhutch_placement_failures_total 1\n"));
        m.reconciler_ticks_total.fetch_add(1, Ordering::Relaxed);
        let text = m.render(&[], 0, Viewer::Admin);
        assert!(text.contains("\nhutch_reconciler_ticks_total 1\n"), "{text}");
        let pool = |owner: &str, name: &str, id: &str| WarmPoolSize {
            owner: owner.into(),
            template: name.into(),
            template_id: id.into(),
            ready: 3,
        };
        m.set_warm_pool_sizes(vec![pool("key-a", "py", "tpl-1"), pool("key-b", "secret-name", "tpl-2")]);
        m.warm_claims_total.fetch_add(1, Ordering::Relaxed);
        let text = m.render(&[], 0, Viewer::Owner("key-a"));
        assert!(text.contains("hutch_warm_pool_size{template=\"py\",template_id=\"tpl-1\"} 3"), "{text}");
        assert!(!text.contains("secret-name") && !text.contains("tpl-2"), "another owner's template: {text}");
        let admin = m.render(&[], 0, Viewer::Admin);
        assert!(admin.contains("tpl-1") && admin.contains("template=\"secret-name\",template_id=\"tpl-2\""));
        assert!(text.contains("hutch_warm_claims_total 1"));
        assert!(text.contains("hutch_warm_misses_total 0"));
        assert!(text.contains("hutch_warm_refill_seconds_count 0"));
    }
}
