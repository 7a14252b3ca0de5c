//! `FlatNetworkSubnet`: an underlay network, its host interface and its pool.

use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::wire;
use crate::ipam::{CompactRanges, compact_ranges};

/// Desired state of a FlatNetworkSubnet: an underlay network that pods
/// attach to through macvlan or ipvlan.
///
/// Subnets live in the `cattle-flat-network` namespace and are referenced by
/// name from the pod annotation `flatnetwork.pandaria.io/subnet`.
#[allow(
    clippy::duplicated_attributes,
    reason = "kube's printcolumn(...) attributes repeat the same keys by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "flatnetwork.pandaria.io",
    version = "v1",
    kind = "FlatNetworkSubnet",
    namespaced,
    status = "FlatNetworkSubnetStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "flatnetworksubnet",
    shortname = "flsubnet",
    shortname = "flsubnets",
    annotation("helm.sh/resource-policy", "keep"),
    doc = "An underlay network that pods attach to through macvlan or ipvlan.",
    printcolumn(name = "FlatMode", type_ = "string", json_path = ".spec.flatMode"),
    printcolumn(
        name = "Mode",
        type_ = "string",
        json_path = ".spec.mode",
        priority = "1"
    ),
    printcolumn(name = "CIDR", type_ = "string", json_path = ".spec.cidr"),
    printcolumn(name = "Master", type_ = "string", json_path = ".spec.master"),
    printcolumn(name = "VLAN", type_ = "integer", json_path = ".spec.vlan"),
    printcolumn(
        name = "MTU",
        type_ = "integer",
        json_path = ".spec.mtu",
        priority = "1"
    ),
    printcolumn(name = "Used", type_ = "integer", json_path = ".status.usedIPCount"),
    printcolumn(name = "Total", type_ = "integer", json_path = ".status.totalIPCount"),
    printcolumn(
        name = "WireExcluded",
        type_ = "integer",
        json_path = ".status.wireExcludedCount"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["flatMode", "master", "cidr"]))]
pub struct FlatNetworkSubnetSpec {
    /// Interface kind created in the pod: `macvlan` or `ipvlan`.
    #[serde(default)]
    #[schemars(extend("enum" = ["macvlan", "ipvlan"]))]
    pub flat_mode: String,

    /// Host interface the pod interfaces hang off, e.g. `eth0`.
    #[serde(default)]
    #[schemars(length(min = 1, max = 15))]
    pub master: String,

    /// 802.1Q VLAN ID; `0` uses `master` directly, otherwise `<master>.<vlan>`.
    #[serde(default)]
    #[schemars(range(min = 0, max = 4094))]
    pub vlan: i64,

    /// The network, e.g. `10.2.3.0/24` or `fd00:10::/64`; one family per subnet.
    #[serde(default)]
    #[schemars(length(min = 1))]
    pub cidr: String,

    /// macvlan: `bridge` (default), `vepa`, `private`, `passthru`;
    /// ipvlan: `l2` (default), `l3`, `l3s`.
    #[serde(default)]
    #[schemars(extend("enum" = ["", "bridge", "vepa", "private", "passthru", "l2", "l3", "l3s"]))]
    pub mode: String,

    /// ipvlan only: `bridge` (default), `private` or `vepa`; empty for macvlan.
    #[serde(default, rename = "ipvlanFlag")]
    #[schemars(extend("enum" = ["", "bridge", "private", "vepa"]))]
    pub ipvlan_flag: String,

    /// Default gateway of the network; never allocated to a pod. Empty: none.
    #[serde(
        default,
        with = "wire::optional",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub gateway: Option<IpAddr>,

    /// Allocation pools (closed intervals); empty means the whole CIDR.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub ranges: Vec<IpRange>,

    /// Extra routes installed in the pod.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub routes: Vec<Route>,

    /// Routes towards cluster, service and node networks.
    #[serde(default)]
    pub route_settings: RouteSettings,

    /// MTU of the pods' flat interfaces on this subnet; it takes precedence
    /// over the network configuration's `mtu`. Changing it changes the
    /// interfaces of running pods in place. Unset: the network
    /// configuration's, else the parent link's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 68, max = 65535))]
    pub mtu: Option<u32>,

    /// Namespaces whose PodNetworkConfigs may attach pods to this subnet;
    /// unset admits every namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
}

impl FlatNetworkSubnetSpec {
    /// Whether a namespace with `labels` may use this subnet in its
    /// PodNetworkConfigs (`spec.namespaceSelector`; unset admits all).
    pub fn admits(
        &self,
        labels: &crate::selector::Labels,
    ) -> Result<bool, crate::selector::SelectorError> {
        self.namespace_selector
            .as_ref()
            .map_or(Ok(true), |selector| {
                crate::selector::matches(selector, labels)
            })
    }
}

/// A closed interval of addresses `from ..= to` (both inclusive).
///
/// Used for `spec.ranges`, `status.usedIP` and `status.reservedIP`. Ends are
/// optional only because the original accepted empty strings; validation
/// rejects incomplete ranges in a spec.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[schemars(extend("required" = ["from", "to"]))]
pub struct IpRange {
    /// First address of the interval.
    #[serde(default, with = "wire::optional")]
    #[schemars(with = "Option<String>")]
    pub from: Option<IpAddr>,
    /// Last address of the interval.
    #[serde(default, with = "wire::optional")]
    #[schemars(with = "Option<String>")]
    pub to: Option<IpAddr>,
}

impl IpRange {
    /// The interval `from ..= to`.
    pub fn new(from: IpAddr, to: IpAddr) -> Self {
        Self {
            from: Some(from),
            to: Some(to),
        }
    }

    /// Both ends, when both are set.
    pub fn bounds(&self) -> Option<(IpAddr, IpAddr)> {
        Some((self.from?, self.to?))
    }
}

/// A route added in the pod's network namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[schemars(extend("required" = ["dev", "dst"]))]
pub struct Route {
    /// Pod interface the route leaves through, e.g. `eth1`.
    #[serde(default)]
    #[schemars(length(min = 1))]
    pub dev: String,
    /// Destination network in CIDR notation.
    #[serde(default)]
    #[schemars(length(min = 1))]
    pub dst: String,
    /// Preferred source address.
    #[serde(
        default,
        with = "wire::optional",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub src: Option<IpAddr>,
    /// Next hop; empty for an on-link route.
    #[serde(
        default,
        with = "wire::optional",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub via: Option<IpAddr>,
    /// Route metric.
    #[serde(default)]
    #[schemars(range(min = 0, max = 2147483647))]
    pub priority: i64,
}

/// Switches for routes flatnet derives from the cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct RouteSettings {
    /// Route the cluster pod CIDRs through the pod's primary interface.
    #[serde(default, rename = "addClusterCIDR")]
    pub add_cluster_cidr: bool,
    /// Route the service CIDRs through the pod's primary interface.
    #[serde(default, rename = "addServiceCIDR")]
    pub add_service_cidr: bool,
    /// Route the node's own networks through the pod's primary interface.
    #[serde(default, rename = "addNodeCIDR")]
    pub add_node_cidr: bool,
    /// Add a host route to each local pod's flat address.
    #[serde(default, rename = "addPodIPToHost")]
    pub add_pod_ip_to_host: bool,
    /// Replace the pod's default route of the flat address's family with one
    /// via the flat interface (multi-NIC pods only).
    #[serde(default)]
    pub flat_network_default_gateway: bool,
}

/// Observed state of a subnet, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct FlatNetworkSubnetStatus {
    /// `""` (new), `Active` or `Failed`.
    #[serde(default)]
    pub phase: String,

    /// Why the last reconcile failed; empty after a success.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub failure_message: String,

    /// The gateway in effect (copy of `spec.gateway`).
    #[serde(
        default,
        with = "wire::optional",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub gateway: Option<IpAddr>,

    /// Fixed addresses declared by workloads, keyed `<Kind>/<namespace>/<name>`.
    #[serde(
        default,
        rename = "reservedIP",
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub reserved_ip: BTreeMap<String, Vec<IpRange>>,

    /// Addresses in use (allocations plus the gateway) as sorted, merged ranges.
    #[serde(
        default,
        rename = "usedIP",
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub used_ip: Vec<IpRange>,

    /// The exact ranges in use when there are more than 4,096: `usedIP` then
    /// holds a cover of them (see `docs/ipam.md`, "Ledger size").
    #[serde(
        default,
        rename = "usedIPCompact",
        skip_serializing_if = "Option::is_none"
    )]
    pub used_ip_compact: Option<CompactRanges>,

    /// Number of addresses in use, the gateway included.
    #[serde(default, rename = "usedIPCount")]
    pub used_ip_count: i64,

    /// Number of allocatable addresses in the pool (saturates at 2^63-1).
    #[serde(default, rename = "totalIPCount")]
    pub total_ip_count: i64,

    /// Number of pods whose flat interface carries `spec.mtu`, as their
    /// node agents report it (absent while `spec.mtu` is unset).
    #[serde(default, rename = "podsAtMTU", skip_serializing_if = "Option::is_none")]
    pub pods_at_mtu: Option<i64>,
    /// Free addresses the allocator skips because a host outside flatnet
    /// claimed them on the LAN within the wire window (see the node agents'
    /// `FlatNetworkWireClaims`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub wire_excluded_count: i64,

    /// Set while the ledger holds addresses no record names: every node
    /// agent is asked to publish its `FlatNetworkWireClaims` of this subnet
    /// again, observed at or after this time, so that an address no node
    /// saw claimed can be freed before the orphan grace ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wire_reports_wanted: Option<Time>,

    /// Sorted user-chosen MACs in use (kernel-chosen MACs are not listed).
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub used_mac: Vec<String>,

    /// Standard conditions; `Ready` mirrors the phase.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Kind part of the `reservedIP` keys of addresses that V1 (`MacvlanIP`)
/// pods still hold: the migrator imports them before any pod rolls, and
/// allocation never hands them out (see `ipam::Reservations`).
pub const V1_RESERVATION_KIND: &str = "MacvlanIP";

impl FlatNetworkSubnetStatus {
    /// The addresses in use (allocations plus the gateway), sorted and
    /// merged: `usedIP`, or the compact ranges it covers when a large
    /// ledger has them (see [`compact_ranges`](crate::ipam::compact_ranges)).
    #[must_use]
    pub fn used_ranges(&self) -> Vec<IpRange> {
        compact_ranges::join(&self.used_ip, self.used_ip_compact.as_ref())
    }

    /// Writes `ranges` (sorted and merged, as [`Pool::usage`](crate::ipam::Pool::usage)
    /// gives them) as the addresses in use: into `usedIP` alone while they
    /// are few enough, else as a cover and the compact ranges.
    pub fn set_used_ranges(&mut self, ranges: Vec<IpRange>) {
        (self.used_ip, self.used_ip_compact) = compact_ranges::split(ranges);
    }

    /// Whether a `reservedIP` key is a V1 pod's (`MacvlanIP/<ns>/<name>`).
    #[must_use]
    pub fn is_v1_reservation(key: &str) -> bool {
        key.strip_prefix(V1_RESERVATION_KIND)
            .is_some_and(|rest| rest.starts_with('/'))
    }
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_zero(value: &i64) -> bool {
    *value == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A subnet as the original writes it, including the empty strings it
    /// uses for unset addresses.
    fn original_subnet() -> serde_json::Value {
        json!({
            "apiVersion": "flatnetwork.pandaria.io/v1",
            "kind": "FlatNetworkSubnet",
            "metadata": {"name": "macvlan-subnet100", "namespace": "cattle-flat-network"},
            "spec": {
                "flatMode": "macvlan", "master": "eth0", "vlan": 100,
                "cidr": "10.2.3.0/24", "mode": "bridge", "ipvlanFlag": "",
                "gateway": "10.2.3.1",
                "ranges": [{"from": "10.2.3.100", "to": "10.2.3.200"}],
                "routes": [{"dev": "eth0", "dst": "99.99.0.0/16", "src": "", "via": "", "priority": 100}],
                "routeSettings": {"addClusterCIDR": true, "addServiceCIDR": true, "addNodeCIDR": true,
                                  "addPodIPToHost": true, "flatNetworkDefaultGateway": false}
            },
            "status": {
                "phase": "Active", "failureMessage": "", "gateway": "10.2.3.1",
                "usedIP": [{"from": "10.2.3.1", "to": "10.2.3.1"}, {"from": "10.2.3.100", "to": "10.2.3.102"}],
                "usedIPCount": 3, "usedMac": ["aa:bb:cc:dd:ee:01"],
                "reservedIP": {"Deployment/default/web": [{"from": "10.2.3.150", "to": "10.2.3.152"}]}
            }
        })
    }

    #[test]
    fn reads_the_original_wire_format() {
        let subnet: FlatNetworkSubnet = serde_json::from_value(original_subnet()).unwrap();
        let spec = &subnet.spec;
        assert_eq!(
            (spec.flat_mode.as_str(), spec.master.as_str(), spec.vlan),
            ("macvlan", "eth0", 100)
        );
        assert_eq!(spec.gateway, Some("10.2.3.1".parse().unwrap()));
        assert_eq!(
            spec.ranges[0].bounds(),
            Some(("10.2.3.100".parse().unwrap(), "10.2.3.200".parse().unwrap()))
        );
        assert_eq!((spec.routes[0].src, spec.routes[0].via), (None, None));
        assert!(
            spec.route_settings.add_pod_ip_to_host
                && !spec.route_settings.flat_network_default_gateway
        );
        let status = subnet.status.unwrap();
        assert_eq!(status.used_ip.len(), 2);
        assert_eq!(status.used_ip_count, 3);
        assert_eq!(status.reserved_ip["Deployment/default/web"].len(), 1);
    }

    #[test]
    fn writes_the_original_field_names() {
        let subnet: FlatNetworkSubnet = serde_json::from_value(original_subnet()).unwrap();
        let back = serde_json::to_value(&subnet).unwrap();
        let original = original_subnet();
        for field in [
            "flatMode",
            "master",
            "vlan",
            "cidr",
            "mode",
            "gateway",
            "ranges",
            "routeSettings",
        ] {
            assert_eq!(back["spec"][field], original["spec"][field], "spec.{field}");
        }
        for field in [
            "phase",
            "gateway",
            "usedIP",
            "usedIPCount",
            "usedMac",
            "reservedIP",
        ] {
            assert_eq!(
                back["status"][field], original["status"][field],
                "status.{field}"
            );
        }
    }

    #[test]
    fn empty_and_missing_addresses_mean_unset() {
        let spec: FlatNetworkSubnetSpec = serde_json::from_value(
            json!({"flatMode": "ipvlan", "master": "eth0", "cidr": "fd00::/64", "gateway": ""}),
        )
        .unwrap();
        assert_eq!(spec.gateway, None);
        assert_eq!(spec.vlan, 0);
        let range: IpRange = serde_json::from_value(json!({"from": "", "to": null})).unwrap();
        assert_eq!(range.bounds(), None);
        let bad = serde_json::from_value::<FlatNetworkSubnetSpec>(json!({"gateway": "10.0.0.300"}));
        assert!(
            bad.unwrap_err()
                .to_string()
                .contains("\"10.0.0.300\" is not an IP address")
        );
    }
}
