//! The `flatnetwork.pandaria.io/v1` custom resources.
//!
//! Field names and value formats match the original rancher-flat-network
//! API, so existing objects and manifests keep working. Enumerated fields
//! (`flatMode`, `mode`, `ipvlanFlag`) stay strings in Rust and are
//! constrained in the CRD schema instead: an object stored before validation
//! existed then still deserializes, and the controller can report what is
//! wrong with it rather than fail to read every subnet in the list.
//!
//! Every field spells out its own `#[serde]`/`#[schemars]` attributes, even
//! where neighbouring types repeat them (`null_as_default` lists, the
//! `conditions` list-map): each field's attributes are its wire contract,
//! read at the field, and a shared wrapper type would hide what the wire
//! carries and change every caller's type for no change of behaviour.
//!
//! The CRDs only use stable Kubernetes APIs, so they install on clusters from
//! 1.28 on (the generated types come from k8s-openapi's `v1_33` level, the
//! oldest that version offers).

mod conditions;
mod config;
mod floating;
mod ip;
mod node_network_config;
mod pod_network_config;
mod subnet;
pub(crate) mod wire;
mod wire_claims;

pub use conditions::{CONDITION_ATTACHED, CONDITION_MAC_CONFLICT, CONDITION_READY, set_condition};
pub use config::{
    AgentsSpec, CONDITION_AVAILABLE, CONDITION_DEGRADED, CONDITION_MAC_RANGE_SHARED,
    CONDITION_PROGRESSING, CONFIG_NAME, ConflictProbeSpec, DEFAULT_PROGRESS_DEADLINE_SECONDS,
    FlatNetworkConfig, FlatNetworkConfigSpec, FlatNetworkConfigStatus,
    MAX_CONFLICT_PROBE_MILLISECONDS, MacPoolMode, MacPoolSpec, MacPoolStatus, WELL_KNOWN_MACS,
    setting_source,
};
pub use floating::{
    FloatingIPPool, FloatingIPPoolSpec, FloatingIPPoolStatus, FloatingIPProjectQuota,
    FloatingIPProjectQuotaSpec, FloatingIPProjectQuotaStatus,
};
pub use ip::{FlatNetworkIP, FlatNetworkIPSpec, FlatNetworkIPStatus};
pub use node_network_config::{
    FlatNetworkNodeConfig, FlatNetworkNodeConfigSpec, FlatNetworkNodeConfigStatus, NodeLinkResult,
    PodPrimaryMtu, PrimaryMtuResult,
};
pub use pod_network_config::{
    ExtraAttachment, NodeBridge, NodeVlan, PodFailure, PodNetworkConfig, PodNetworkConfigSpec,
    PodNetworkConfigStatus, PrimarySettings,
};
pub use subnet::{
    FlatNetworkSubnet, FlatNetworkSubnetSpec, FlatNetworkSubnetStatus, IpRange, Route,
    RouteSettings, V1_RESERVATION_KIND,
};
pub use wire_claims::{FlatNetworkWireClaims, FlatNetworkWireClaimsSpec, ForeignClaim};

/// API group of every kind.
pub const GROUP: &str = "flatnetwork.pandaria.io";
/// API version of every kind.
pub const VERSION: &str = "v1";

/// Values of `status.phase` of both kinds. An empty phase means "new".
pub mod phase {
    /// Subnet: validated and allocating. IP: the pod's interface is set up.
    pub const ACTIVE: &str = "Active";
    /// IP: an address is allocated and the node has not set the pod up yet.
    pub const PENDING: &str = "Pending";
    /// The last reconcile failed; `status.failureMessage` says why.
    pub const FAILED: &str = "Failed";
}
