//! Floating addresses on the node: which agent owns (answers ARP/NDP for)
//! each address, decided between agents without the API server.
//!
//! - [`election`]: the pure part: peers heard, when they count as dead,
//!   the owner of each address (rendezvous hashing over the live
//!   candidates, `flatnet_k8s::floating::choose_owner`), and the changes
//!   an agent applies when its view changes;
//! - [`heartbeat`]: the message agents send each other over the flat link
//!   every [`HEARTBEAT_INTERVAL`](heartbeat::HEARTBEAT_INTERVAL), and its
//!   UDP transport;
//! - [`owner`]: the loop that runs both, renews the responder-map leases of
//!   the owned addresses and announces acquired ones;
//! - [`resolvers`]: the LAN hosts seen resolving an address, told by
//!   unicast when this node takes it over.
//!
//! - [`standalone`]: the state file's `floating` section, run by
//!   `flatnet-agent floating` beside the agent (or `datapath attach`);
//! - [`backends`]: its addresses held by local pods (the attachments the
//!   section's `backends` name) while this node owns them;
//! - [`kubernetes`]: the daemon's Kubernetes mode: the addresses this node
//!   may serve, from the pools, Services, EndpointSlices and Nodes, and
//!   the Events and metrics of what the loop does;
//! - [`pods`]: floating addresses that follow pods: the set's active pod
//!   gets the address on its flat interface;
//! - [`liveness`]: the agents the loop hears, for the pod addresses (a pod
//!   whose node's agent is silent holds nothing);
//! - [`lease`]: the Lease per address, the tie-breaker when two owners do
//!   not hear each other.

pub mod backends;
pub mod election;
pub mod heartbeat;
pub mod kubernetes;
pub mod lease;
pub mod liveness;
pub mod owner;
pub mod pods;
pub mod resolvers;
pub mod standalone;

use std::sync::Arc;

use tokio::sync::{Notify, watch};

/// Wakes `changed` whenever `receiver` sees a new value, until its sender
/// goes.
pub(crate) fn wake_on_change<T: Send + Sync + 'static>(
    mut receiver: watch::Receiver<T>,
    changed: &Arc<Notify>,
) {
    let changed = Arc::clone(changed);
    tokio::spawn(async move {
        while receiver.changed().await.is_ok() {
            changed.notify_one();
        }
    });
}
