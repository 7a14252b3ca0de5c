//! Prometheus metrics of the agent, served as text on `/metrics`: one
//! registry for the CNI service's, the policy controller's
//! ([`PolicyMetrics`]), the floating addresses' ([`FloatingMetrics`]) and
//! the CNI phase timings ([`crate::phases`]).

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, gauge::Gauge},
    registry::Registry,
};

use crate::{
    mac_conflict::MacConflictCounters, policy_controller::PolicyMetrics, probe::run::ProbeMetrics,
};

/// The agent's metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    conflicts: Counter,
    /// Frames from other hosts with a flatnet MAC, by reason
    /// ([`crate::mac_conflict`]).
    pub mac_conflicts: MacConflictCounters,
    /// Standalone: 1 while the state file on disk is rejected and an older
    /// version (the last good copy) is in force.
    pub state_file_rejected: Gauge,
    /// Network-policy controller metrics.
    pub policy: PolicyMetrics,
    /// Floating-address metrics.
    pub floating: FloatingMetrics,
    /// Conflict-probe metrics.
    pub probe: ProbeMetrics,
}

/// What the floating-address loop did on this node.
#[derive(Clone, Debug, Default)]
pub struct FloatingMetrics {
    /// Floating addresses this node answers for now.
    pub owned: Gauge,
    /// Addresses this node took over (at start, or from a failed or
    /// ineligible owner).
    pub acquired: Counter,
    /// Addresses this node gave up.
    pub released: Counter,
    /// Rounds of gratuitous ARP / unsolicited NA sent.
    pub announcements: Counter,
    /// Unicast ARP replies / neighbour advertisements sent in those rounds
    /// to LAN hosts seen resolving the address.
    pub unicast_replies: Counter,
    /// Floating addresses this node's pods hold now.
    pub pod_addresses: Gauge,
}

impl FloatingMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "floating_addresses_owned",
            "Floating addresses this node answers ARP/NDP for",
            self.owned.clone(),
        );
        registry.register(
            "floating_acquisitions",
            "Floating addresses this node took over (failovers and first assignments)",
            self.acquired.clone(),
        );
        registry.register(
            "floating_releases",
            "Floating addresses this node gave up",
            self.released.clone(),
        );
        registry.register(
            "floating_announcements",
            "Rounds of gratuitous ARP / unsolicited NA sent for floating addresses",
            self.announcements.clone(),
        );
        registry.register(
            "floating_unicast_replies",
            "Unicast ARP replies / neighbour advertisements sent with the announcements, to LAN hosts seen resolving the floating address",
            self.unicast_replies.clone(),
        );
        registry.register(
            "floating_pod_addresses",
            "Floating addresses held by pods of this node (on their flat interfaces)",
            self.pod_addresses.clone(),
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
        let mac_conflicts = MacConflictCounters::default();
        registry.register(
            "mac_conflicts",
            "Sightings on the uplinks of a flatnet MAC used by another host, by reason (other_address, pod_on_this_node)",
            mac_conflicts.clone(),
        );
        let state_file_rejected = Gauge::default();
        registry.register(
            "state_file_rejected",
            "1 while the standalone state file is rejected and its last good version is in force",
            state_file_rejected.clone(),
        );
        let policy = PolicyMetrics::default();
        policy.register(&mut registry);
        let floating = FloatingMetrics::default();
        floating.register(&mut registry);
        let probe = ProbeMetrics::default();
        probe.register(&mut registry);
        registry.register(
            "cni_phase_seconds",
            "Wall time of each phase of CNI commands (phase total: the whole command in the agent)",
            crate::phases::PHASE_SECONDS.clone(),
        );
        Self {
            registry,
            conflicts,
            mac_conflicts,
            state_file_rejected,
            policy,
            floating,
            probe,
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
    fn mac_conflicts_are_exposed_by_reason() {
        let metrics = Metrics::default();
        metrics
            .mac_conflicts
            .get_or_create(&[("reason", "other_address")])
            .inc_by(2);
        let text = metrics.encode();
        assert!(
            text.contains(r#"flatnet_agent_mac_conflicts_total{reason="other_address"} 2"#),
            "{text}"
        );
    }

    #[test]
    fn floating_metrics_are_exposed() {
        let metrics = Metrics::default();
        metrics.floating.owned.set(2);
        metrics.floating.acquired.inc();
        metrics.floating.announcements.inc();
        metrics.floating.unicast_replies.inc_by(3);
        let text = metrics.encode();
        for line in [
            "flatnet_agent_floating_addresses_owned 2",
            "flatnet_agent_floating_acquisitions_total 1",
            "flatnet_agent_floating_releases_total 0",
            "flatnet_agent_floating_announcements_total 1",
            "flatnet_agent_floating_unicast_replies_total 3",
        ] {
            assert!(text.contains(line), "{line} missing in {text}");
        }
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
