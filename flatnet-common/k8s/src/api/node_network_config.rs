//! `FlatNetworkNodeConfig`: what one node's agent must set up beside pod
//! attachments, computed by the operator from the PodNetworkConfigs: the
//! primary-interface MTU of the node's running pods, and the node's VLAN
//! sub-interfaces and bridges. One object per node, named after it and
//! labelled with it, so each agent watches only its own; the agent
//! reports in its status what it did, which the operator reads back into
//! the configurations' status.
//!
//! Why an object of its own: a primary MTU has no address, so unlike a
//! hot-plugged interface it has no FlatNetworkIP to ride on (and a pod
//! need not have any flat record at all), and VLANs and bridges belong to
//! nodes, not pods. One object per node has a single writer per half (the
//! operator writes `spec`, the node's agent `status`), costs the agent one
//! narrow watch and needs no right on Nodes or Pods for anyone.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{NodeBridge, NodeVlan, wire};

/// What one node must have for the PodNetworkConfigs of its running pods.
#[allow(
    clippy::duplicated_attributes,
    reason = "kube's printcolumn(...) attributes repeat the same keys by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "flatnetwork.pandaria.io",
    version = "v1",
    kind = "FlatNetworkNodeConfig",
    status = "FlatNetworkNodeConfigStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "flnodeconfig",
    doc = "What one node's agent sets up for the PodNetworkConfigs of its running pods (written by the operator).",
    printcolumn(name = "Pods", type_ = "integer", json_path = ".status.podCount"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct FlatNetworkNodeConfigSpec {
    /// Running pods of the node whose primary interface gets an MTU.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uid"]))]
    pub pods: Vec<PodPrimaryMtu>,
    /// VLAN sub-interfaces the node must have.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub vlans: Vec<NodeVlan>,
    /// Linux bridges the node must have.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub bridges: Vec<NodeBridge>,
}

/// The MTU one running pod's primary interface must have.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["uid", "mtu"]))]
pub struct PodPrimaryMtu {
    /// The pod's namespace.
    #[serde(default)]
    pub namespace: String,
    /// The pod's name.
    #[serde(default)]
    pub name: String,
    /// The pod's UID.
    #[serde(default)]
    pub uid: String,
    /// MTU of `eth0` and of its node-side peer.
    #[serde(default)]
    #[schemars(range(min = 68, max = 65535))]
    pub mtu: u32,
    /// Clamp the MSS of TCP SYNs through `eth0` to what `mtu` leaves.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tcp_mss_clamp: bool,
}

/// What the node's agent did, written by it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct FlatNetworkNodeConfigStatus {
    /// Number of entries in `pods`.
    #[serde(default)]
    pub pod_count: i64,
    /// One entry per pod of `spec.pods` the agent worked on.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uid"]))]
    pub pods: Vec<PrimaryMtuResult>,
    /// The `metadata.generation` whose `spec.vlans` and `spec.bridges`
    /// `links` describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// One entry per VLAN (`<master>.<id>`) and bridge of the spec.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub links: Vec<NodeLinkResult>,
}

/// How making one node interface went.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["name"]))]
pub struct NodeLinkResult {
    /// The interface: `<master>.<id>` for a VLAN, the bridge's name.
    #[serde(default)]
    pub name: String,
    /// Why it is not as asked; empty: it is.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub failure: String,
}

/// How setting one pod's primary MTU went.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["uid", "mtu"]))]
pub struct PrimaryMtuResult {
    /// The pod's UID.
    #[serde(default)]
    pub uid: String,
    /// The MTU this result is about.
    #[serde(default)]
    pub mtu: u32,
    /// Whether the MSS clamping this result is about was asked for.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tcp_mss_clamp: bool,
    /// Why it could not be set; empty: it is set.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub failure: String,
}
