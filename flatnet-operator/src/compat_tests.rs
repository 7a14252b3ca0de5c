//! The upgrade test: objects exactly as rancher-flat-network leaves them
//! (an Active subnet with its `usedIP`, Active FlatNetworkIPs with the
//! original's labels, owner references and wrangler finalizer, the pods)
//! taken over by flatnet's allocation controllers against the fake API
//! server. Every pod keeps its address, the ledger stays right, and a pod
//! created afterwards gets a free address.

use std::time::Duration;

use flatnet_k8s::api::{FlatNetworkIP, FlatNetworkSubnet};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};

use crate::allocation::{
    Settings,
    fake_api::FakeApiServer,
    fake_cluster::{FakeCluster, POD_NAMESPACE, pod},
};

const SUBNET: &str = "macvlan-subnet100";

/// The subnet as the original's controller leaves it.
fn original_subnet() -> FlatNetworkSubnet {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": SUBNET, "namespace": "cattle-flat-network",
                     "labels": {"master": "eth0", "vlan": "100", "mode": "bridge", "flatMode": "macvlan"},
                     "finalizers": ["wrangler.cattle.io/rancher-flat-network-subnet-remove"]},
        "spec": {"flatMode": "macvlan", "master": "eth0", "vlan": 100, "cidr": "10.2.3.0/24",
                 "mode": "bridge", "ipvlanFlag": "", "gateway": "10.2.3.1",
                 "ranges": [{"from": "10.2.3.100", "to": "10.2.3.200"}],
                 "routes": null, "podDefaultGateway": {}},
        "status": {"phase": "Active", "failureMessage": "", "gateway": "10.2.3.1",
                   "reservedIP": {"Deployment/shop/web": [{"from": "10.2.3.150", "to": "10.2.3.152"}]},
                   "usedIP": [{"from": "10.2.3.1", "to": "10.2.3.1"},
                              {"from": "10.2.3.150", "to": "10.2.3.151"},
                              {"from": "10.2.3.160", "to": "10.2.3.160"}],
                   "usedIPCount": 3, "usedMac": null}
    }))
    .unwrap()
}

/// A running pod of the original's era, with its Multus annotations.
fn original_pod(name: &str, ip: &str, owner: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": POD_NAMESPACE, "uid": format!("uid-{name}"),
                     "ownerReferences": [owner],
                     "annotations": {"flatnetwork.pandaria.io/ip": ip,
                                     "flatnetwork.pandaria.io/subnet": SUBNET,
                                     "k8s.v1.cni.cncf.io/networks": "[{\"name\":\"rancher-flat-network\",\"interface\":\"eth1\"}]"},
                     "labels": {"flatnetwork.pandaria.io/subnet": SUBNET}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "pause"}]},
        "status": {"phase": "Running"}
    }))
    .unwrap()
}

/// Its FlatNetworkIP as the original's controllers and CNI leave it.
fn original_record(pod: &str, addrs: &[&str], addr: &str, owner: Value) -> FlatNetworkIP {
    let ip_type = if addrs.is_empty() { "auto" } else { "specific" };
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
        "metadata": {"name": pod, "namespace": POD_NAMESPACE,
                     "labels": {"subnet": SUBNET, "flatnetwork.pandaria.io/flatNetworkIPType": ip_type,
                                "field.cattle.io/projectId": ""},
                     "ownerReferences": [owner],
                     "finalizers": ["wrangler.cattle.io/rancher-flat-network-ip-remove"]},
        "spec": {"subnet": SUBNET, "addrs": addrs, "macs": [], "podId": format!("uid-{pod}")},
        "status": {"phase": "Active", "failureMessage": "", "allocatedTimeStamp": "2025-01-01T00:00:00Z",
                   "addr": addr, "mac": "5a:1e:9c:00:11:22"}
    }))
    .unwrap()
}

fn pod_owner(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "name": name, "uid": format!("uid-{name}"), "controller": true})
}

#[tokio::test]
async fn the_original_objects_are_taken_over_and_every_pod_keeps_its_address() {
    let server = FakeApiServer::new();
    server.insert(
        &serde_json::from_value::<Node>(json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}
        }))
        .unwrap(),
    );
    server.insert(&original_subnet());
    let rs = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-6d8f9c7b5", "uid": "uid-rs", "controller": true});
    // The original's StatefulSet owner reference has the wrong apiVersion.
    let sts = json!({"apiVersion": "v1", "kind": "StatefulSet", "name": "db", "uid": "uid-sts", "controller": true});
    let fixed = ["10.2.3.150", "10.2.3.151", "10.2.3.152"];
    let old = [
        (
            "web-6d8f9c7b5-x2x7k",
            "10.2.3.150-10.2.3.151-10.2.3.152",
            &fixed[..],
            "10.2.3.150",
            rs.clone(),
            pod_owner("web-6d8f9c7b5-x2x7k"),
        ),
        (
            "web-6d8f9c7b5-q9zzp",
            "10.2.3.150-10.2.3.151-10.2.3.152",
            &fixed[..],
            "10.2.3.151",
            rs,
            pod_owner("web-6d8f9c7b5-q9zzp"),
        ),
        (
            "db-0",
            "auto",
            &[][..],
            "10.2.3.160",
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db", "uid": "uid-sts", "controller": true}),
            sts,
        ),
    ];
    for (name, ip, addrs, addr, pod_owner_ref, record_owner) in &old {
        server.insert(&original_pod(name, ip, pod_owner_ref.clone()));
        server.insert(&original_record(name, addrs, addr, record_owner.clone()));
    }

    let cluster = FakeCluster::start(server, Settings::default(), 2);
    // A new pod proves the controllers run; it must not get a held address.
    cluster.server.insert(&pod("new-0", SUBNET));
    let view = cluster
        .settle(SUBNET, Duration::from_secs(20))
        .await
        .unwrap();
    for (name, _, _, addr, _, _) in &old {
        assert_eq!(
            view.addressed
                .get(*name)
                .map(ToString::to_string)
                .as_deref(),
            Some(*addr),
            "{name} keeps its address: {view:?}"
        );
    }
    assert_eq!(
        view.addressed
            .get("new-0")
            .map(ToString::to_string)
            .as_deref(),
        Some("10.2.3.100"),
        "{view:?}"
    );
    // Still Active: nothing was re-plumbed.
    for record in cluster.server.list::<FlatNetworkIP>() {
        let phase = record
            .status
            .as_ref()
            .map(|s| s.phase.clone())
            .unwrap_or_default();
        if record.metadata.name.as_deref() != Some("new-0") {
            assert_eq!(phase, "Active", "{record:?}");
        }
    }
    cluster.stop().await;
}
