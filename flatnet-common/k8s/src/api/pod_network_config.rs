//! `PodNetworkConfig`: what running pods matching a selector must have on
//! the flat network (MTU of the primary interface, extra flat interfaces,
//! node VLANs and bridges), applied without restarting them.

use std::{collections::BTreeSet, net::IpAddr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::wire;
use crate::{
    ipam::Mac,
    keys::check_hotplug_interface,
    selector,
    validation::{MAX_MTU, MIN_MTU_IPV4, check_ifname},
};

/// Runtime network configuration for the running pods of one namespace
/// that match `podSelector`.
#[allow(
    clippy::duplicated_attributes,
    reason = "kube's printcolumn(...) attributes repeat the same keys by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "flatnetwork.pandaria.io",
    version = "v1",
    kind = "PodNetworkConfig",
    namespaced,
    status = "PodNetworkConfigStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "pnc",
    doc = "Network configuration applied to running pods matching a selector, without restarts.",
    printcolumn(name = "Matched", type_ = "integer", json_path = ".status.matched"),
    printcolumn(name = "Applied", type_ = "integer", json_path = ".status.applied"),
    printcolumn(name = "Failed", type_ = "integer", json_path = ".status.failedCount"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct PodNetworkConfigSpec {
    /// Pods of this namespace the configuration applies to; empty selects
    /// every pod.
    #[serde(default)]
    pub pod_selector: LabelSelector,

    /// Settings of the pods' primary interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<PrimarySettings>,

    /// Extra flat interfaces hot-plugged into the matching pods.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub attachments: Vec<ExtraAttachment>,

    /// VLAN sub-interfaces the nodes of matching pods must have.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub vlans: Vec<NodeVlan>,

    /// Linux bridges the nodes of matching pods must have.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub bridges: Vec<NodeBridge>,
}

/// Settings of a pod's primary interface (`eth0`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct PrimarySettings {
    /// MTU of `eth0` (and of its host-side peer where there is one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 68, max = 65535))]
    pub mtu: Option<u32>,
    /// Clamp the MSS option of TCP SYNs through `eth0`, both ways, to
    /// what `mtu` leaves for payload (MTU - 40 over IPv4, - 60 over IPv6);
    /// needs `mtu`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tcp_mss_clamp: bool,
}

/// One extra flat interface, like a pod annotation's request.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["subnet", "interface"]))]
pub struct ExtraAttachment {
    /// The FlatNetworkSubnet (in `cattle-flat-network`); it must admit this
    /// namespace (its `spec.namespaceSelector`).
    #[serde(default)]
    #[schemars(length(min = 1))]
    pub subnet: String,
    /// Interface name in the pod, e.g. `net2`; not `eth0`.
    #[serde(default)]
    #[schemars(length(min = 1, max = 15))]
    pub interface: String,
    /// Fixed address; allocated from the subnet when unset.
    #[serde(
        default,
        with = "wire::optional",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub ip: Option<IpAddr>,
    /// Fixed MAC (macvlan only), `aa:bb:cc:dd:ee:ff`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
}

/// A VLAN sub-interface `<master>.<id>` on the node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["master", "id"]))]
pub struct NodeVlan {
    /// The node interface carrying the VLAN.
    #[serde(default)]
    #[schemars(length(min = 1, max = 15))]
    pub master: String,
    /// 802.1Q VLAN ID.
    #[serde(default)]
    #[schemars(range(min = 1, max = 4094))]
    pub id: i64,
}

/// A Linux bridge on the node with its ports.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["name"]))]
pub struct NodeBridge {
    /// The bridge's interface name.
    #[serde(default)]
    #[schemars(length(min = 1, max = 15))]
    pub name: String,
    /// Node interfaces enslaved to it.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub ports: Vec<String>,
}

/// The pod's primary interface, which attachments may not take.
const PRIMARY_IFNAME: &str = "eth0";

impl PodNetworkConfigSpec {
    /// Every problem of the spec that needs no lookup (the subnets' come from
    /// the webhook), each naming its field.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Err(error) = selector::check(&self.pod_selector) {
            problems.push(format!("spec.podSelector: {error}"));
        }
        if let Some(mtu) = self.primary.as_ref().and_then(|p| p.mtu)
            && !(MIN_MTU_IPV4..=MAX_MTU).contains(&mtu)
        {
            problems.push(format!(
                "spec.primary.mtu {mtu} is out of range: use {MIN_MTU_IPV4}..{MAX_MTU}"
            ));
        }
        if let Some(primary) = &self.primary
            && primary.tcp_mss_clamp
            && primary.mtu.is_none()
        {
            problems.push(
                "spec.primary.tcpMssClamp needs spec.primary.mtu: the MSS is clamped to what that MTU leaves".to_owned(),
            );
        }
        let mut interfaces = BTreeSet::new();
        for (index, attachment) in self.attachments.iter().enumerate() {
            let field = format!("spec.attachments[{index}]");
            if attachment.subnet.is_empty() {
                problems.push(format!("{field}.subnet is empty: name a FlatNetworkSubnet"));
            }
            if let Err(reason) = check_ifname(&attachment.interface) {
                problems.push(format!("{field}.interface {reason}"));
            } else if attachment.interface == PRIMARY_IFNAME {
                problems.push(format!(
                "{field}.interface {PRIMARY_IFNAME} is the pod's primary interface: use another name, e.g. net2"
            ));
            } else if let Err(reason) = check_hotplug_interface(&attachment.interface) {
                problems.push(format!("{field}.interface: {reason}"));
            } else if !interfaces.insert(attachment.interface.as_str()) {
                problems.push(format!(
                    "{field}.interface {} is asked for twice: keep one",
                    attachment.interface
                ));
            }
            if !attachment.mac.is_empty() && Mac::parse(&attachment.mac).is_err() {
                problems.push(format!(
                    "{field}.mac {:?} is not a MAC address: use aa:bb:cc:dd:ee:ff",
                    attachment.mac
                ));
            }
        }
        for (index, vlan) in self.vlans.iter().enumerate() {
            if let Err(reason) = check_ifname(&vlan.master) {
                problems.push(format!("spec.vlans[{index}].master {reason}"));
            } else if let Err(reason) = check_ifname(&format!("{}.{}", vlan.master, vlan.id)) {
                problems.push(format!(
                    "spec.vlans[{index}]: {reason}; use a shorter master name"
                ));
            }
            if !(1..=4094).contains(&vlan.id) {
                problems.push(format!(
                    "spec.vlans[{index}].id {} is out of range: use 1..4094",
                    vlan.id
                ));
            }
        }
        for (index, bridge) in self.bridges.iter().enumerate() {
            if let Err(reason) = check_ifname(&bridge.name) {
                problems.push(format!("spec.bridges[{index}].name {reason}"));
            }
            for port in &bridge.ports {
                if let Err(reason) = check_ifname(port) {
                    problems.push(format!("spec.bridges[{index}].ports {reason}"));
                }
            }
        }
        problems
    }
}

/// Observed state, written by the operator from the nodes' reports.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct PodNetworkConfigStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Running pods the selector matches.
    #[serde(default)]
    pub matched: i64,
    /// Matched pods that carry everything the configuration asks for.
    #[serde(default)]
    pub applied: i64,
    /// Number of entries in `failed`.
    #[serde(default)]
    pub failed_count: i64,
    /// Matched pods that could not be configured, with why.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub failed: Vec<PodFailure>,
    /// Standard conditions (`Ready`), with `observedGeneration`.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// A pod the configuration could not be applied to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct PodFailure {
    /// The pod's name.
    pub pod: String,
    /// Why, with what to fix.
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(value: serde_json::Value) -> PodNetworkConfigSpec {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_pod_selector_that_cannot_be_evaluated_is_refused() {
        // Found by the pod_network_config fuzz target: admitted, then
        // matching no pod, with the reason only in the status.
        let problems = spec(serde_json::json!({
            "podSelector": {"matchExpressions": [{"key": "tier"}]},
            "attachments": [{"subnet": "lan", "interface": "net3"}]
        }))
        .problems();
        assert_eq!(
            problems,
            [
                "spec.podSelector: unknown label selector operator \"\" on key \"tier\"; use In, NotIn, Exists or DoesNotExist"
            ]
        );
        let good = spec(serde_json::json!({
            "podSelector": {"matchLabels": {"app": "web"},
                            "matchExpressions": [{"key": "tier", "operator": "Exists"}]},
            "attachments": [{"subnet": "lan", "interface": "net3"}]
        }));
        assert_eq!(good.problems(), Vec::<String>::new());
    }
}
