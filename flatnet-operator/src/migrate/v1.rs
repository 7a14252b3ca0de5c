//! The legacy `macvlan.cluster.cattle.io/v1` API ("Macvlan V1"), read only
//! by the migrator.
//!
//! Every field of the original Go types is here with its JSON name, so a
//! backup or a conversion never loses one. Addresses stay text: V1 objects
//! are migrated as they are stored, and a value that does not parse is
//! reported by the conversion instead of failing the whole list.

use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// API group of the V1 kinds.
pub const GROUP: &str = "macvlan.cluster.cattle.io";
/// Namespace of every V1 `MacvlanSubnet`.
pub const SUBNET_NAMESPACE: &str = "kube-system";
/// Name of the V1 subnet CRD.
pub const SUBNET_CRD: &str = "macvlansubnets.macvlan.cluster.cattle.io";
/// Name of the V1 IP CRD.
pub const IP_CRD: &str = "macvlanips.macvlan.cluster.cattle.io";

/// A V1 macvlan subnet (`kube-system`).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "macvlan.cluster.cattle.io",
    version = "v1",
    kind = "MacvlanSubnet",
    namespaced,
    status = "MacvlanSubnetStatus",
    schema = "disabled",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct MacvlanSubnetSpec {
    /// Host interface.
    #[serde(default)]
    pub master: String,
    /// 802.1Q VLAN ID, 0 for none.
    #[serde(default)]
    pub vlan: i64,
    /// The network.
    #[serde(default)]
    pub cidr: String,
    /// macvlan mode (`bridge`, `vepa`, `private`, `passthru`).
    #[serde(default)]
    pub mode: String,
    /// Gateway address, empty for none.
    #[serde(default, deserialize_with = "null_as_default")]
    pub gateway: String,
    /// Allocation pools.
    #[serde(default, deserialize_with = "null_as_default")]
    pub ranges: Vec<MacvlanIpRange>,
    /// Routes added in the pod.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub routes: Vec<MacvlanRoute>,
    /// Replacement of the pod's default route.
    #[serde(default, skip_serializing_if = "PodDefaultGateway::is_empty")]
    pub pod_default_gateway: PodDefaultGateway,
    /// Seconds a released address stayed reserved before reuse.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ip_delay_reuse: i64,
}

/// Status of a V1 subnet, kept verbatim in backups.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MacvlanSubnetStatus {
    /// Phase.
    #[serde(default)]
    pub phase: String,
    /// Last error.
    #[serde(default)]
    pub failure_message: String,
    /// Addresses in use.
    #[serde(default, rename = "usedIP", deserialize_with = "null_as_default")]
    pub used_ip: Vec<MacvlanIpRange>,
    /// Number of addresses in use.
    #[serde(default, rename = "usedIPCount")]
    pub used_ip_count: i64,
    /// User-chosen MACs in use.
    #[serde(default, deserialize_with = "null_as_default")]
    pub used_mac: Vec<String>,
}

/// A closed address interval.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MacvlanIpRange {
    /// First address.
    #[serde(default, deserialize_with = "null_as_default")]
    pub range_start: String,
    /// Last address.
    #[serde(default, deserialize_with = "null_as_default")]
    pub range_end: String,
}

/// A V1 pod route: a destination *address* (not a network), a next hop and
/// an interface.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct MacvlanRoute {
    /// Destination address.
    #[serde(default, deserialize_with = "null_as_default")]
    pub dst: String,
    /// Next hop.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub gw: String,
    /// Pod interface.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub iface: String,
}

/// V1's default-gateway switch.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PodDefaultGateway {
    /// Route the pod's default traffic through the macvlan interface.
    #[serde(default)]
    pub enable: bool,
    /// Service CIDR kept on the primary interface when enabled.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub service_cidr: String,
}

impl PodDefaultGateway {
    fn is_empty(&self) -> bool {
        !self.enable && self.service_cidr.is_empty()
    }
}

/// A V1 allocation record, one per pod.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "macvlan.cluster.cattle.io",
    version = "v1",
    kind = "MacvlanIP",
    namespaced,
    status = "MacvlanIPStatus",
    schema = "disabled",
    derive = "PartialEq",
    derive = "Default"
)]
pub struct MacvlanIPSpec {
    /// Subnet name (in `kube-system`).
    #[serde(default)]
    pub subnet: String,
    /// `auto`, an address, `address/prefix`, or a dash-separated list.
    #[serde(default, rename = "ip")]
    pub cidr: String,
    /// Empty, a MAC, or a dash-separated list.
    #[serde(default)]
    pub mac: String,
    /// UID of the pod.
    #[serde(default, rename = "podId")]
    pub pod_id: String,
}

/// Status of a V1 allocation record.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MacvlanIPStatus {
    /// Phase.
    #[serde(default)]
    pub phase: String,
    /// Last error.
    #[serde(default)]
    pub failure_message: String,
    /// Allocated address.
    #[serde(default, deserialize_with = "null_as_default")]
    pub ip: String,
    /// User-chosen MAC.
    #[serde(default, deserialize_with = "null_as_default")]
    pub mac: String,
}

fn is_zero(value: &i64) -> bool {
    *value == 0
}

/// Go writes empty slices and unset addresses as `null`.
fn null_as_default<'de, D, T>(de: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(de)?.unwrap_or_default())
}
