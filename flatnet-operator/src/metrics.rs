//! Prometheus metrics of the operator, served as text on `/metrics`.

use std::time::Instant;

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// Labels of per-controller metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// Controller name, e.g. `service`.
    pub controller: String,
}

/// Labels of the error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Controller name.
    pub controller: String,
    /// Error kind, from the controller error's `metric_label`.
    pub error: String,
}

type DurationFamily = Family<ControllerLabels, Histogram, fn() -> Histogram>;

/// Every metric of the operator and the registry that serves them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciliations: Family<ControllerLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    duration: DurationFamily,
    leader: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers the metrics under the `flatnet_operator` prefix.
    #[must_use]
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("flatnet_operator");
        let reconciliations = Family::<ControllerLabels, Counter>::default();
        registry.register(
            "reconciliations",
            "Reconciles started",
            reconciliations.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "reconcile_errors",
            "Reconciles that failed, by error kind",
            errors.clone(),
        );
        // 1 ms to about 16 s: a reconcile makes a handful of API calls.
        let duration: DurationFamily =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 15)));
        registry.register(
            "reconcile_duration_seconds",
            "Time spent in one reconcile",
            duration.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader lease",
            leader.clone(),
        );
        Self {
            registry,
            reconciliations,
            errors,
            duration,
            leader,
        }
    }

    /// Counts a reconcile of `controller` and times it until the guard drops.
    #[must_use = "the duration is recorded when the guard drops"]
    pub fn reconcile_started(&self, controller: &str) -> ReconcileTimer {
        let labels = ControllerLabels {
            controller: controller.to_owned(),
        };
        self.reconciliations.get_or_create(&labels).inc();
        ReconcileTimer {
            histogram: self.duration.get_or_create_owned(&labels),
            start: Instant::now(),
        }
    }

    /// Counts a failed reconcile of `controller` with error kind `error`.
    pub fn reconcile_failed(&self, controller: &str, error: &str) {
        self.errors
            .get_or_create(&ErrorLabels {
                controller: controller.to_owned(),
                error: error.to_owned(),
            })
            .inc();
    }

    /// Records whether this replica leads.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// The metrics in the Prometheus text format.
    #[must_use]
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

/// Records the reconcile duration when dropped.
#[derive(Debug)]
pub struct ReconcileTimer {
    histogram: Histogram,
    start: Instant,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_reconciles_errors_durations_and_leadership() {
        let metrics = Metrics::new();
        drop(metrics.reconcile_started("service"));
        drop(metrics.reconcile_started("service"));
        metrics.reconcile_failed("service", "kube_api");
        metrics.set_leader(true);
        let text = metrics.render();
        for line in [
            r#"flatnet_operator_reconciliations_total{controller="service"} 2"#,
            r#"flatnet_operator_reconcile_errors_total{controller="service",error="kube_api"} 1"#,
            r#"flatnet_operator_reconcile_duration_seconds_count{controller="service"} 2"#,
            "flatnet_operator_leader 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        metrics.set_leader(false);
        assert!(
            metrics
                .render()
                .lines()
                .any(|l| l == "flatnet_operator_leader 0")
        );
    }
}
