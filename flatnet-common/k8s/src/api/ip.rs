//! `FlatNetworkIP`: the allocation record of one pod.

use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::wire;

/// Desired state of a FlatNetworkIP, the flat-network address of one pod
/// (same name and namespace as the pod).
///
/// The operator allocates `status.addr` (and `status.mac` when the pod asks
/// for a fixed MAC); the node agent sets up the interface, records the real
/// MAC and its node name in `status.node`, and moves the phase to `Active`.
/// The agent also labels the object `flatnetwork.pandaria.io/node=<node>` so
/// each node can watch only its own records.
#[allow(
    clippy::duplicated_attributes,
    reason = "kube's printcolumn(...) attributes repeat the same keys by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "flatnetwork.pandaria.io",
    version = "v1",
    kind = "FlatNetworkIP",
    namespaced,
    status = "FlatNetworkIPStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "flatnetworkip",
    shortname = "flip",
    shortname = "flips",
    annotation("helm.sh/resource-policy", "keep"),
    doc = "The flat-network address of one pod (same name and namespace as the pod).",
    printcolumn(name = "Subnet", type_ = "string", json_path = ".spec.subnet"),
    printcolumn(name = "Address", type_ = "string", json_path = ".status.addr"),
    printcolumn(name = "MAC", type_ = "string", json_path = ".status.mac"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.node"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["subnet"]))]
pub struct FlatNetworkIPSpec {
    /// Name of the `FlatNetworkSubnet` (in `cattle-flat-network`).
    #[serde(default)]
    #[schemars(length(min = 1))]
    pub subnet: String,

    /// Candidate addresses from the pod annotation; empty: any free address.
    #[serde(default, with = "wire::list", skip_serializing_if = "Vec::is_empty")]
    #[schemars(with = "Vec<String>")]
    pub addrs: Vec<IpAddr>,

    /// Candidate MACs (lower-case, colon-separated); empty: kernel-chosen.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub macs: Vec<String>,

    /// UID of the pod this record belongs to.
    #[serde(default, rename = "podId")]
    pub pod_id: String,
}

/// Observed state of an allocation.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct FlatNetworkIPStatus {
    /// `""` (new), `Pending`, `Active` or `Failed`.
    #[serde(default)]
    pub phase: String,

    /// Why the last reconcile failed; empty after a success.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub failure_message: String,

    /// When the address was allocated (UTC).
    #[serde(
        default,
        rename = "allocatedTimeStamp",
        skip_serializing_if = "Option::is_none"
    )]
    pub allocated_time_stamp: Option<Time>,

    /// The allocated address.
    #[serde(
        default,
        with = "wire::optional",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub addr: Option<IpAddr>,

    /// The chosen MAC, then the interface's actual MAC once set up.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,

    /// Whether `mac` came from the cluster's MAC pool (flatnet addition):
    /// the record holds it in its parent link's MAC ledger until it goes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mac_from_pool: bool,

    /// Node whose agent set up the interface (flatnet addition).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,

    /// MTU the interface carries, as its node agent last set it (flatnet
    /// addition; counted into the subnet's `status.podsAtMTU`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,

    /// Standard conditions; `Ready` is true once the interface is set up.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl FlatNetworkIP {
    /// The MAC this record holds in its parent link's MAC ledger: a fixed
    /// MAC the pod asked for, or one from the MAC pool. `None` when the
    /// interface's MAC is the kernel's choice (or nothing is allocated).
    pub fn ledgered_mac(&self) -> Option<&str> {
        let status = self.status.as_ref()?;
        let mac = status.mac.as_str();
        (!mac.is_empty() && (status.mac_from_pool || self.spec.macs.iter().any(|m| m == mac)))
            .then_some(mac)
    }

    /// The fixed MAC this record holds: one its pod asked for, which the
    /// subnet's `usedMac` lists (pool MACs are only in the MAC ledger).
    pub fn fixed_mac(&self) -> Option<&str> {
        let mac = self.status.as_ref()?.mac.as_str();
        (!mac.is_empty() && self.spec.macs.iter().any(|m| m == mac)).then_some(mac)
    }

    /// The pod this record belongs to: its Pod owner, else its name without
    /// the dual-stack suffix (records owned by a StatefulSet, and a
    /// dual-stack pod's second record `<pod>.ipv6`).
    pub fn pod_name(&self) -> String {
        use kube::ResourceExt;
        if let Some(owner) = self.owner_references().iter().find(|o| o.kind == "Pod") {
            return owner.name.clone();
        }
        let name = self.name_any();
        name.strip_suffix(crate::keys::SECONDARY_RECORD_SUFFIX)
            .map_or(name.clone(), str::to_owned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pod_name_from_owner_or_record_name() {
        let record =
            |value: serde_json::Value| -> FlatNetworkIP { serde_json::from_value(value).unwrap() };
        let owned = record(json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
            "metadata": {"name": "web-0.ipv6", "namespace": "a",
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod",
                                              "name": "web-0", "uid": "u"}]},
            "spec": {"subnet": "lan6"}
        }));
        assert_eq!(owned.pod_name(), "web-0");
        let by_name = |name: &str| {
            record(json!({
                "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
                "metadata": {"name": name, "namespace": "a"},
                "spec": {"subnet": "lan"}
            }))
            .pod_name()
        };
        assert_eq!(by_name("db-1.ipv6"), "db-1");
        assert_eq!(by_name("db-1"), "db-1");
    }

    fn original_ip() -> serde_json::Value {
        json!({
            "apiVersion": "flatnetwork.pandaria.io/v1",
            "kind": "FlatNetworkIP",
            "metadata": {"name": "web-0", "namespace": "default"},
            "spec": {"subnet": "macvlan-subnet100", "addrs": ["10.2.3.150", "", "fd00::5"],
                     "macs": [], "podId": "0f1c"},
            "status": {"phase": "Active", "failureMessage": "",
                       "allocatedTimeStamp": "2025-01-01T00:00:00Z",
                       "addr": "10.2.3.150", "mac": "5a:1e:9c:00:11:22"}
        })
    }

    #[test]
    fn reads_the_original_wire_format() {
        let ip: FlatNetworkIP = serde_json::from_value(original_ip()).unwrap();
        assert_eq!(ip.spec.subnet, "macvlan-subnet100");
        assert_eq!(
            ip.spec.addrs,
            [
                "10.2.3.150".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ],
            "empty members are dropped"
        );
        assert_eq!(ip.spec.pod_id, "0f1c");
        let status = ip.status.unwrap();
        assert_eq!(status.addr, Some("10.2.3.150".parse().unwrap()));
        assert_eq!(status.mac, "5a:1e:9c:00:11:22");
        assert!(status.allocated_time_stamp.is_some());
    }

    #[test]
    fn writes_the_original_field_names() {
        let ip: FlatNetworkIP = serde_json::from_value(original_ip()).unwrap();
        let back = serde_json::to_value(&ip).unwrap();
        assert_eq!(back["spec"]["podId"], "0f1c");
        assert_eq!(back["spec"]["addrs"], json!(["10.2.3.150", "fd00::5"]));
        assert_eq!(back["status"]["allocatedTimeStamp"], "2025-01-01T00:00:00Z");
        assert_eq!(back["status"]["addr"], "10.2.3.150");
    }

    #[test]
    fn null_lists_and_timestamps_are_accepted() {
        let spec: FlatNetworkIPSpec =
            serde_json::from_value(json!({"subnet": "s", "addrs": null, "macs": null}))
                .unwrap_or_else(|e| {
                    panic!("{e}");
                });
        assert!(spec.addrs.is_empty());
        let status: FlatNetworkIPStatus =
            serde_json::from_value(json!({"allocatedTimeStamp": null, "addr": ""})).unwrap();
        assert_eq!((status.allocated_time_stamp, status.addr), (None, None));
    }
}
