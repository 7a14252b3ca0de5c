//! Prometheus metrics of the agent, served as text on `/metrics`.

use std::sync::atomic::AtomicU64;

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, gauge::Gauge},
    registry::Registry,
};

/// The agent's metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    conflicts: Counter,
    /// Standalone: 1 while the state file on disk is rejected and an older
    /// version (the last good copy) is in force.
    pub state_file_rejected: Gauge,
    /// Network-policy controller metrics.
    pub policy: PolicyMetrics,
}

/// Metrics of the network-policy controller.
#[derive(Clone, Debug, Default)]
pub struct PolicyMetrics {
    /// Successful compile-and-install rounds.
    pub applies: Counter,
    /// Rounds whose tables could not be installed.
    pub apply_failures: Counter,
    /// MultiNetworkPolicies for the flat network in the last applied round.
    pub policies: Gauge,
    /// Compiler diagnostics of the last applied round.
    pub diagnostics: Gauge,
    /// Seconds the last compile-and-install took.
    pub last_apply_seconds: Gauge<f64, AtomicU64>,
    /// 1 while the policy source is unusable (MultiNetworkPolicy CRD not
    /// installed, state file rejected), else 0.
    pub source_problem: Gauge,
    /// CNI ADDs that answered before the tables included their pod.
    pub add_wait_timeouts: Counter,
}

impl PolicyMetrics {
    fn register(&self, registry: &mut Registry) {
        let registry = registry.sub_registry_with_prefix("policy");
        registry.register(
            "applies",
            "Network-policy compile-and-install rounds that succeeded",
            self.applies.clone(),
        );
        registry.register(
            "add_wait_timeouts",
            "CNI ADDs that answered before the policy tables included their pod",
            self.add_wait_timeouts.clone(),
        );
        registry.register(
            "apply_failures",
            "Network-policy rounds whose tables could not be installed",
            self.apply_failures.clone(),
        );
        registry.register(
            "policies",
            "MultiNetworkPolicies for the flat network in force",
            self.policies.clone(),
        );
        registry.register(
            "compile_diagnostics",
            "Parts of the policies in force that are enforced differently from what they say",
            self.diagnostics.clone(),
        );
        registry.register(
            "last_apply_seconds",
            "Duration of the last compile-and-install round",
            self.last_apply_seconds.clone(),
        );
        registry.register(
            "source_problem",
            "1 while policies cannot be read (CRD not installed, state file rejected)",
            self.source_problem.clone(),
        );
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("flatnet_agent");
        let conflicts = Counter::default();
        registry.register(
            "ip_conflicts",
            "Foreign ARP/NDP claims of pod addresses seen on the uplinks",
            conflicts.clone(),
        );
        let state_file_rejected = Gauge::default();
        registry.register(
            "state_file_rejected",
            "1 while the standalone state file is rejected and its last good version is in force",
            state_file_rejected.clone(),
        );
        let policy = PolicyMetrics::default();
        policy.register(&mut registry);
        registry.register(
            "cni_phase_seconds",
            "Wall time of each phase of CNI commands (phase total: the whole command in the agent)",
            super::phases::PHASE_SECONDS.clone(),
        );
        Self {
            registry,
            conflicts,
            state_file_rejected,
            policy,
        }
    }
}

impl Metrics {
    /// Counts one conflict event.
    pub fn conflict(&self) {
        self.conflicts.inc();
    }

    /// Conflicts counted so far.
    pub fn conflicts(&self) -> u64 {
        self.conflicts.get()
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_are_exposed() {
        let metrics = Metrics::default();
        metrics.conflict();
        metrics.conflict();
        assert_eq!(metrics.conflicts(), 2);
        assert!(
            metrics
                .encode()
                .contains("flatnet_agent_ip_conflicts_total 2"),
            "{}",
            metrics.encode()
        );
    }

    #[test]
    fn policy_metrics_are_exposed() {
        let metrics = Metrics::default();
        metrics.policy.applies.inc();
        metrics.policy.policies.set(3);
        let text = metrics.encode();
        assert!(
            text.contains("flatnet_agent_policy_applies_total 1"),
            "{text}"
        );
        assert!(text.contains("flatnet_agent_policy_policies 3"), "{text}");
        assert!(
            text.contains("flatnet_agent_policy_last_apply_seconds"),
            "{text}"
        );
    }
}
