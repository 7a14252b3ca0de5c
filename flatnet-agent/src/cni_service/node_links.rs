//! The node's VLAN sub-interfaces and bridges as the desired state asks:
//! each pass makes what is missing and removes what flatnet made and
//! nothing asks for any more ([`crate::link::NodeLinks`] and
//! `link::node_links` say how ownership is kept), then reports how each
//! wanted interface went.

use super::{AgentService, follow::PassReport};
use crate::{
    desired::DesiredState,
    link::{NodeLinks, NodeLinksPass},
};

impl<S: DesiredState> AgentService<S> {
    /// Follows the wanted node interfaces for the agent's lifetime
    /// ([`follow`](super::follow::follow)).
    pub async fn follow_node_links(&self, interval: std::time::Duration) {
        super::follow::follow(
            interval,
            "making or removing a node VLAN or bridge",
            || self.inner.desired.node_links(),
            |wanted: NodeLinks| async move { self.apply_node_links(&wanted).await },
        )
        .await;
    }

    /// One pass over the node's VLANs and bridges, then its report.
    pub async fn apply_node_links(&self, wanted: &NodeLinks) -> NodeLinksPass {
        let mut pass = self
            .inner
            .config
            .attachments
            .apply_node_links(&self.inner.config.node_name, wanted)
            .await;
        // A report that cannot be written fails the pass, so it is retried.
        if let Err(error) = self.inner.desired.report_node_links(&pass.results).await {
            pass.failed
                .push(format!("reporting the node's VLANs and bridges: {error}"));
        }
        pass
    }
}

impl PassReport for NodeLinksPass {
    fn failures(&self) -> &[String] {
        &self.failed
    }

    fn log_changes(&self) {
        if self.changed > 0 || self.removed > 0 {
            tracing::info!(
                changed = self.changed,
                removed = self.removed,
                "node VLANs and bridges applied"
            );
        }
    }
}
