//! `FloatingIPPool` and `FloatingIPProjectQuota`: addresses of the flat
//! network that float between nodes (LoadBalancer Services), and how many
//! of them a project or namespace may hold.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{IpRange, wire};

/// Desired state of a FloatingIPPool: addresses of one flat network that
/// LoadBalancer Services (and pods) get, announced by the node that owns
/// each address.
#[allow(
    clippy::duplicated_attributes,
    reason = "kube's printcolumn(...) attributes repeat the same keys by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "flatnetwork.pandaria.io",
    version = "v1",
    kind = "FloatingIPPool",
    status = "FloatingIPPoolStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "fippool",
    shortname = "fippools",
    annotation("helm.sh/resource-policy", "keep"),
    doc = "Addresses of a flat network that float between nodes: LoadBalancer Services get them, the owning node answers ARP/NDP for them.",
    printcolumn(name = "CIDRs", type_ = "string", json_path = ".spec.cidrs"),
    printcolumn(
        name = "Interface",
        type_ = "string",
        json_path = ".spec.targetNetworkInterface"
    ),
    printcolumn(name = "Used", type_ = "integer", json_path = ".status.usedIPCount"),
    printcolumn(name = "Total", type_ = "integer", json_path = ".status.totalIPCount"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["cidrs", "targetNetworkInterface"]))]
pub struct FloatingIPPoolSpec {
    /// The networks, one IPv4 and/or one IPv6, e.g. `["192.168.10.0/24"]`.
    #[serde(default, deserialize_with = "wire::null_as_default")]
    #[schemars(length(min = 1, max = 2))]
    pub cidrs: Vec<String>,

    /// Allocation pools (closed intervals) inside the CIDRs; a family with
    /// no range gives out its whole CIDR.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub ranges: Vec<IpRange>,

    /// Node interface the addresses are announced on: a master such as
    /// `eth0`, or its VLAN link `eth0.100` (the subnets' parent-link rules).
    #[serde(default)]
    #[schemars(length(min = 1, max = 15))]
    pub target_network_interface: String,

    /// Nodes that may own (announce) the pool's addresses; none: every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,

    /// Namespaces whose Services may take addresses from the pool; none:
    /// every namespace (further narrowed by `projects`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,

    /// Rancher projects (`field.cattle.io/projectId` of the namespace, e.g.
    /// `p-abc12`) whose Services may take addresses; empty: any.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub projects: Vec<String>,
}

/// Observed state of a FloatingIPPool, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct FloatingIPPoolStatus {
    /// Addresses held by Services as sorted, merged ranges: the ledger every
    /// allocation replaces with the resourceVersion it read.
    #[serde(
        default,
        rename = "usedIP",
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub used_ip: Vec<IpRange>,

    /// Number of addresses covered by `usedIP`.
    #[serde(default, rename = "usedIPCount")]
    pub used_ip_count: i64,

    /// Number of allocatable addresses (saturates at 2^63-1).
    #[serde(default, rename = "totalIPCount")]
    pub total_ip_count: i64,

    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Standard conditions: `Ready` (valid and addresses left).
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// The most floating addresses one Rancher project, or one namespace, may
/// hold in each pool.
#[allow(
    clippy::duplicated_attributes,
    reason = "kube's printcolumn(...) attributes repeat the same keys by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "flatnetwork.pandaria.io",
    version = "v1",
    kind = "FloatingIPProjectQuota",
    status = "FloatingIPProjectQuotaStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "fipquota",
    shortname = "fipquotas",
    annotation("helm.sh/resource-policy", "keep"),
    doc = "The most floating addresses a Rancher project or a namespace may hold per FloatingIPPool.",
    printcolumn(name = "Project", type_ = "string", json_path = ".spec.project"),
    printcolumn(name = "Namespace", type_ = "string", json_path = ".spec.namespace"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["limits"]))]
pub struct FloatingIPProjectQuotaSpec {
    /// The Rancher project (`field.cattle.io/projectId` of its namespaces);
    /// exactly one of `project` and `namespace` is set.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub project: String,

    /// The namespace, for clusters without Rancher projects.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,

    /// Pool name -> the most addresses the project may hold from it. A pool
    /// not listed is not limited by this quota.
    #[serde(default, deserialize_with = "wire::null_as_default")]
    pub limits: BTreeMap<String, u32>,
}

/// Observed state of a quota, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct FloatingIPProjectQuotaStatus {
    /// Pool name -> addresses the project holds from it.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub used: BTreeMap<String, u32>,

    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Standard conditions: `Ready` (valid), `Exhausted` (a limit reached).
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
