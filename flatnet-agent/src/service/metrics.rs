//! Prometheus metrics of the agent, served as text on `/metrics`.

use prometheus_client::{encoding::text::encode, metrics::counter::Counter, registry::Registry};

/// The agent's metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    conflicts: Counter,
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
        Self {
            registry,
            conflicts,
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
}
