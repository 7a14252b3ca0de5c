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

/// Labels of per-subnet metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubnetLabels {
    /// FlatNetworkSubnet name.
    pub subnet: String,
}

/// Labels of the collected-records counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CollectLabels {
    /// Why the record's address was taken back: `pod_gone`, `node_gone`.
    pub reason: String,
}

/// Labels of the error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Controller name.
    pub controller: String,
    /// Error kind, from the controller error's `metric_label`.
    pub error: String,
}

/// Labels of the webhook request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// Kind of the reviewed object, e.g. `Deployment`.
    pub kind: String,
    /// `CREATE`, `UPDATE` or `DELETE`.
    pub operation: String,
}

/// Labels of the webhook denial counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DenialLabels {
    /// Kind of the reviewed object.
    pub kind: String,
    /// Short reason, e.g. `address_in_use`.
    pub reason: String,
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
    admission_requests: Family<AdmissionLabels, Counter>,
    admission_denials: Family<DenialLabels, Counter>,
    webhook_cert_expiry: Gauge,
    allocations: Family<SubnetLabels, Counter>,
    releases: Family<SubnetLabels, Counter>,
    allocation_duration: Histogram,
    allocation_conflicts: Counter,
    records_collected: Family<CollectLabels, Counter>,
    subnet_size: Family<SubnetLabels, Gauge>,
    subnet_used: Family<SubnetLabels, Gauge>,
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
        let admission_requests = Family::<AdmissionLabels, Counter>::default();
        registry.register(
            "webhook_requests",
            "Admission reviews answered, by kind and operation",
            admission_requests.clone(),
        );
        let admission_denials = Family::<DenialLabels, Counter>::default();
        registry.register(
            "webhook_denials",
            "Admission reviews denied, by kind and reason",
            admission_denials.clone(),
        );
        let webhook_cert_expiry = Gauge::default();
        registry.register(
            "webhook_certificate_expiry_timestamp_seconds",
            "Unix time at which the serving certificate this replica uses expires",
            webhook_cert_expiry.clone(),
        );
        let allocations = Family::<SubnetLabels, Counter>::default();
        registry.register(
            "allocations",
            "Addresses allocated, by subnet",
            allocations.clone(),
        );
        let releases = Family::<SubnetLabels, Counter>::default();
        registry.register(
            "releases",
            "Addresses released by deleted FlatNetworkIPs, by subnet",
            releases.clone(),
        );
        // From the first read of the subnet to the written record.
        let allocation_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register(
            "allocation_duration_seconds",
            "Time from reading the subnet to the written FlatNetworkIP",
            allocation_duration.clone(),
        );
        let allocation_conflicts = Counter::default();
        registry.register(
            "subnet_write_conflicts",
            "Ledger writes (subnet status, MAC ledger) rejected because another writer was first (retried)",
            allocation_conflicts.clone(),
        );
        let records_collected = Family::<CollectLabels, Counter>::default();
        registry.register(
            "flatnetworkips_collected",
            "FlatNetworkIPs whose address was taken back: deleted because the pod was gone (pod_gone), or released because the pod's node was gone (node_gone)",
            records_collected.clone(),
        );
        let subnet_size = Family::<SubnetLabels, Gauge>::default();
        registry.register(
            "subnet_addresses",
            "Allocatable addresses of a subnet",
            subnet_size.clone(),
        );
        let subnet_used = Family::<SubnetLabels, Gauge>::default();
        registry.register(
            "subnet_used_addresses",
            "Addresses in use in a subnet (usedIPCount, gateway included)",
            subnet_used.clone(),
        );
        Self {
            registry,
            reconciliations,
            errors,
            duration,
            leader,
            admission_requests,
            admission_denials,
            webhook_cert_expiry,
            allocations,
            releases,
            allocation_duration,
            allocation_conflicts,
            records_collected,
            subnet_size,
            subnet_used,
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

    /// Counts one admission review of `kind` for `operation`.
    pub fn admission_reviewed(&self, kind: &str, operation: &str) {
        self.admission_requests
            .get_or_create(&AdmissionLabels {
                kind: kind.to_owned(),
                operation: operation.to_owned(),
            })
            .inc();
    }

    /// Counts one denied admission review of `kind` for `reason`.
    pub fn admission_denied(&self, kind: &str, reason: &str) {
        self.admission_denials
            .get_or_create(&DenialLabels {
                kind: kind.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Records when the serving certificate in use expires (Unix seconds).
    pub fn set_webhook_cert_expiry(&self, unix_seconds: i64) {
        self.webhook_cert_expiry.set(unix_seconds);
    }

    /// Counts an allocation in `subnet` that took `took`.
    pub fn address_allocated(&self, subnet: &str, took: std::time::Duration) {
        self.allocations.get_or_create(&subnet_labels(subnet)).inc();
        self.allocation_duration.observe(took.as_secs_f64());
    }

    /// Counts an address released in `subnet`.
    pub fn address_released(&self, subnet: &str) {
        self.releases.get_or_create(&subnet_labels(subnet)).inc();
    }

    /// Counts a subnet status write that lost to another writer.
    pub fn allocation_conflict(&self) {
        self.allocation_conflicts.inc();
    }

    /// Counts a FlatNetworkIP collected for `reason` (`pod_gone`,
    /// `node_gone`).
    pub fn record_collected(&self, reason: &'static str) {
        self.records_collected
            .get_or_create(&CollectLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Sets the size and use of `subnet`.
    pub fn set_subnet_usage(&self, subnet: &str, total: i64, used: i64) {
        self.subnet_size
            .get_or_create(&subnet_labels(subnet))
            .set(total);
        self.subnet_used
            .get_or_create(&subnet_labels(subnet))
            .set(used);
    }

    /// Drops the gauges of a deleted subnet.
    pub fn forget_subnet(&self, subnet: &str) {
        self.subnet_size.remove(&subnet_labels(subnet));
        self.subnet_used.remove(&subnet_labels(subnet));
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

fn subnet_labels(subnet: &str) -> SubnetLabels {
    SubnetLabels {
        subnet: subnet.to_owned(),
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
    fn counts_webhook_reviews_denials_and_cert_expiry() {
        let metrics = Metrics::new();
        metrics.admission_reviewed("Pod", "CREATE");
        metrics.admission_reviewed("Pod", "CREATE");
        metrics.admission_denied("Pod", "address_in_use");
        metrics.set_webhook_cert_expiry(1_900_000_000);
        let text = metrics.render();
        for line in [
            r#"flatnet_operator_webhook_requests_total{kind="Pod",operation="CREATE"} 2"#,
            r#"flatnet_operator_webhook_denials_total{kind="Pod",reason="address_in_use"} 1"#,
            "flatnet_operator_webhook_certificate_expiry_timestamp_seconds 1900000000",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

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
        metrics.address_allocated("net1", std::time::Duration::from_millis(3));
        metrics.set_subnet_usage("net1", 253, 2);
        metrics.record_collected("node_gone");
        let text = metrics.render();
        for line in [
            r#"flatnet_operator_flatnetworkips_collected_total{reason="node_gone"} 1"#,
            r#"flatnet_operator_allocations_total{subnet="net1"} 1"#,
            "flatnet_operator_allocation_duration_seconds_count 1",
            r#"flatnet_operator_subnet_addresses{subnet="net1"} 253"#,
            r#"flatnet_operator_subnet_used_addresses{subnet="net1"} 2"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        metrics.forget_subnet("net1");
        assert!(!metrics.render().contains("subnet_addresses{"));
        metrics.set_leader(false);
        assert!(
            metrics
                .render()
                .lines()
                .any(|l| l == "flatnet_operator_leader 0")
        );
    }
}
