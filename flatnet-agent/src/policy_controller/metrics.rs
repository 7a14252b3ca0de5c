//! Metrics of the network-policy controller, registered in the agent's
//! registry ([`crate::metrics::Metrics`]) under `flatnet_agent_policy_`.

use std::sync::atomic::AtomicU64;

use prometheus_client::{
    metrics::{counter::Counter, gauge::Gauge},
    registry::Registry,
};

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
    /// 1 while policies are enforced, 0 while enforcement is turned off
    /// (FlatNetworkConfig `spec.agents.policyEnforcement`).
    pub enforced: Gauge,
}

impl PolicyMetrics {
    /// Registers every metric under `policy_` in `registry`.
    pub fn register(&self, registry: &mut Registry) {
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
            "enforced",
            "1 while MultiNetworkPolicies are enforced, 0 while enforcement is turned off",
            self.enforced.clone(),
        );
        registry.register(
            "source_problem",
            "1 while policies cannot be read (CRD not installed, state file rejected)",
            self.source_problem.clone(),
        );
    }
}
