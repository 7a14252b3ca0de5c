//! `FlatNetworkWireClaims`: what one node saw the LAN claim in one subnet.
//!
//! Each node agent publishes one object per subnet (named
//! `<subnet>.<node>`, in the subnet's namespace, owned by the subnet) that
//! lists the addresses of the subnet that a MAC belonging to no live
//! flatnet record claimed on the wire (a host outside flatnet, or the
//! interface of a pod whose record is gone or being deleted). Claims by
//! MACs of the cluster's MAC pool range on addresses of no subnet go to
//! the report of the first subnet (by name) of the frame's VLAN, so the
//! pool skips those MACs too. A separate object, not a field of the subnet's
//! status: the subnet is the object every allocation commits through, so
//! writes from every node there would make allocations conflict; one
//! object per node and subnet has a single writer and never conflicts.

use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::wire;

/// Addresses of one subnet that hosts outside flatnet claimed on the LAN,
/// as one node's uplink program saw them.
#[allow(
    clippy::duplicated_attributes,
    reason = "kube's printcolumn(...) attributes repeat the same keys by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "flatnetwork.pandaria.io",
    version = "v1",
    kind = "FlatNetworkWireClaims",
    // kube would derive "flatnetworkwireclaimses".
    plural = "flatnetworkwireclaims",
    namespaced,
    derive = "PartialEq",
    derive = "Default",
    shortname = "flwire",
    doc = "Addresses of one subnet that hosts outside flatnet claimed on the LAN, as one node saw them.",
    printcolumn(name = "Subnet", type_ = "string", json_path = ".spec.subnet"),
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.node"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["subnet", "node"]))]
pub struct FlatNetworkWireClaimsSpec {
    /// Name of the `FlatNetworkSubnet`.
    #[serde(default)]
    pub subnet: String,
    /// The node whose uplink saw the claims.
    #[serde(default)]
    pub node: String,
    /// When the node read the claims below from its inventory: they are
    /// every claim it knew of at that time. Written with the claims (a node
    /// writes again when they change, or when the subnet's
    /// `status.wireReportsWanted` is later than this).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_at: Option<Time>,
    /// One entry per address, ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<ForeignClaim>,
}

/// An address a foreign MAC claimed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForeignClaim {
    /// The address.
    pub ip: IpAddr,
    /// The MAC last seen claiming it (lower-case, colon-separated).
    pub mac: String,
    /// When it was last seen, rounded down to the publishing granularity.
    pub last_seen: Time,
    /// The frame it was last seen in (`arp_request`, `arp_reply`,
    /// `gratuitous_arp`, `arp_probe`, `neighbor_solicitation`,
    /// `neighbor_advertisement`, `duplicate_address_detection`).
    pub kind: String,
}

impl FlatNetworkWireClaims {
    /// The object name of `node`'s claims in `subnet`.
    pub fn object_name(subnet: &str, node: &str) -> String {
        format!("{subnet}.{node}")
    }
}
