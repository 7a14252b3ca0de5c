//! The compatibility suite. The upgrade test: objects exactly as
//! rancher-flat-network leaves them
//! (an Active subnet with its `usedIP`, Active FlatNetworkIPs with the
//! original's labels, owner references and wrangler finalizer, the pods)
//! taken over by flatnet's allocation controllers against the fake API
//! server. Every pod keeps its address, the ledger stays right, and a pod
//! created afterwards gets a free address. And the shapes the original
//! documents, each admitted by flatnet's webhook first (as the API server
//! would ask it), then served by flatnet's controllers; the shapes the
//! original refuses are refused. A fixed-IP workload's `reservedIP`,
//! written by the workload controller, is honoured by allocation too (the
//! original's allocation ignored it). (The workload controller's labels and
//! `reservedIP`: `workloads/tests.rs`; the migrator: `migrate/tests.rs`.)

use std::{sync::Arc, time::Duration};

use flatnet_k8s::api::{FlatNetworkIP, FlatNetworkSubnet};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionReview},
};
use serde::Serialize;
use serde_json::{Value, json};

use crate::{
    allocation::{
        Settings,
        fake_api::FakeApiServer,
        fake_cluster::{FakeCluster, POD_NAMESPACE, pod},
    },
    fixtures::admission_review,
    metrics::Metrics,
    webhook::Validator,
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

/// What flatnet's webhook answers when `object` is created in the cluster
/// `server` holds: `Ok(())` or the denial message.
async fn review_create(server: &FakeApiServer, object: &impl Serialize) -> Result<(), String> {
    let object = serde_json::to_value(object).unwrap();
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(admission_review(
        "uid-compat",
        "CREATE",
        Some(&object),
        None,
    ))
    .unwrap();
    let request: AdmissionRequest<DynamicObject> = review.try_into().unwrap();
    let validator = Validator::new(server.client(), Arc::new(Metrics::new()));
    let response = validator.review(&request).await;
    if response.allowed {
        Ok(())
    } else {
        Err(response.result.message)
    }
}

/// Creates `object` as the API server would: only once the webhook admits it.
async fn admit<K>(server: &FakeApiServer, object: &K)
where
    K: kube::Resource<DynamicType = ()>
        + Serialize
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    if let Err(message) = review_create(server, object).await {
        panic!("the webhook refused {object:?}: {message}");
    }
    server.insert(object);
}

/// A workload of `kind` whose pod template carries the original's
/// annotations (subnet, `ip`, the Multus selection).
fn workload(kind: &str, name: &str, subnet: &str, ip: &str) -> Value {
    let template = json!({
        "metadata": {"annotations": {
            "flatnetwork.pandaria.io/subnet": subnet,
            "flatnetwork.pandaria.io/ip": ip,
            "k8s.v1.cni.cncf.io/networks": "[{\"name\":\"rancher-flat-network\",\"interface\":\"eth1\"}]"}},
        "spec": {"containers": [{"name": "c", "image": "pause"}]}
    });
    let selector = json!({"matchLabels": {"app": name}});
    let (api_version, spec) = match kind {
        "CronJob" => (
            "batch/v1",
            json!({"schedule": "*/5 * * * *",
                   "jobTemplate": {"spec": {"template": template}}}),
        ),
        _ => (
            "apps/v1",
            json!({"selector": selector, "template": template}),
        ),
    };
    json!({
        "apiVersion": api_version, "kind": kind,
        "metadata": {"name": name, "namespace": POD_NAMESPACE},
        "spec": spec
    })
}

/// A subnet manifest in the original's documented shape.
fn manifest(name: &str, spec: Value) -> FlatNetworkSubnet {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": name, "namespace": "cattle-flat-network"},
        "spec": spec
    }))
    .unwrap()
}

fn workload_pod(name: &str, subnet: &str, ip: &str, interface: &str) -> Pod {
    let selection = if interface == "eth0" {
        "v1.multus-cni.io/default-network"
    } else {
        "k8s.v1.cni.cncf.io/networks"
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": POD_NAMESPACE, "uid": format!("uid-{name}"),
                     "annotations": {"flatnetwork.pandaria.io/ip": ip,
                                     "flatnetwork.pandaria.io/subnet": subnet,
                                     selection: format!("[{{\"name\":\"rancher-flat-network\",\"interface\":\"{interface}\"}}]")}},
        "spec": {"containers": [{"name": "c", "image": "pause"}]}
    }))
    .unwrap()
}

/// The subnet shapes the original documents (IPv4 and IPv6, macvlan on
/// VLANs, ipvlan L2 and L3, routes and every route setting) become Active,
/// and pods of multi-NIC and single-NIC workloads asking for automatic or
/// listed addresses get them, as with the original.
#[tokio::test]
async fn the_originals_documented_shapes_are_served() {
    let server = FakeApiServer::new();
    admit(&server, &manifest(
        "macvlan-v4-vlan100",
        json!({
            "flatMode": "macvlan", "master": "eth0", "vlan": 100, "mode": "bridge",
            "cidr": "10.100.0.0/24", "gateway": "10.100.0.1",
            "ranges": [{"from": "10.100.0.10", "to": "10.100.0.20"}],
            "routes": [{"dst": "192.168.0.0/16", "via": "10.100.0.254", "dev": "eth1"},
                       {"dst": "172.16.0.0/12", "dev": "eth0"}],
            "routeSettings": {"addClusterCIDR": true, "addServiceCIDR": true, "addNodeCIDR": true,
                              "addPodIPToHost": true, "flatNetworkDefaultGateway": true}
        }),
    ))
    .await;
    admit(
        &server,
        &manifest(
            "macvlan-v6-vlan200",
            json!({
                "flatMode": "macvlan", "master": "eth0", "vlan": 200,
                "cidr": "fd00:200::/64", "gateway": "fd00:200::1",
                "ranges": [{"from": "fd00:200::10", "to": "fd00:200::20"}]
            }),
        ),
    )
    .await;
    admit(
        &server,
        &manifest(
            "ipvlan-l2",
            json!({
                "flatMode": "ipvlan", "master": "eth1", "mode": "l2", "ipvlanFlag": "bridge",
                "cidr": "10.110.0.0/24", "ranges": [{"from": "10.110.0.50", "to": "10.110.0.60"}]
            }),
        ),
    )
    .await;
    admit(
        &server,
        &manifest(
            "ipvlan-l3-v6",
            json!({
                "flatMode": "ipvlan", "master": "eth2", "mode": "l3", "ipvlanFlag": "private",
                "cidr": "fd00:300::/64"
            }),
        ),
    )
    .await;
    // What the original's webhook refuses, flatnet's refuses: a subnet
    // overlapping another on the same master and VLAN, a flatMode that is
    // neither macvlan nor ipvlan, and workloads asking for an address outside
    // their subnet.
    for (what, object, fragment) in [
        (
            "an overlapping subnet",
            serde_json::to_value(manifest(
                "macvlan-v4-again",
                json!({"flatMode": "macvlan", "master": "eth0", "vlan": 100,
                       "cidr": "10.100.0.0/25", "gateway": "10.100.0.1"}),
            ))
            .unwrap(),
            "overlaps subnet macvlan-v4-vlan100",
        ),
        (
            "an unknown flatMode",
            serde_json::to_value(manifest(
                "bridge-mode",
                json!({"flatMode": "bridge", "master": "eth0", "cidr": "10.120.0.0/24"}),
            ))
            .unwrap(),
            "flatMode",
        ),
        (
            "a Deployment asking for an address outside its subnet",
            workload("Deployment", "stray", "macvlan-v4-vlan100", "10.200.0.5"),
            "10.200.0.5",
        ),
    ] {
        let verdict = review_create(&server, &object).await;
        assert!(
            verdict.as_ref().is_err_and(|m| m.contains(fragment)),
            "{what}: {verdict:?}"
        );
    }
    // The workload kinds the original documents, with its annotations.
    for (kind, name, subnet, ip) in [
        (
            "Deployment",
            "web",
            "macvlan-v4-vlan100",
            "10.100.0.15-10.100.0.16",
        ),
        ("StatefulSet", "db", "macvlan-v6-vlan200", "auto"),
        ("DaemonSet", "agent", "ipvlan-l2", "auto"),
        ("CronJob", "report", "macvlan-v4-vlan100", "auto"),
    ] {
        let object = workload(kind, name, subnet, ip);
        assert_eq!(
            review_create(&server, &object).await,
            Ok(()),
            "{kind} {name}"
        );
    }
    let cluster = FakeCluster::start(server, Settings::default(), 2);
    for subnet in [
        "macvlan-v4-vlan100",
        "macvlan-v6-vlan200",
        "ipvlan-l2",
        "ipvlan-l3-v6",
    ] {
        cluster
            .wait_active(subnet, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{subnet}: {e}"));
    }
    for pod in [
        // A Deployment's replicas sharing a dash-separated list.
        workload_pod(
            "web-1",
            "macvlan-v4-vlan100",
            "10.100.0.15-10.100.0.16",
            "eth1",
        ),
        workload_pod(
            "web-2",
            "macvlan-v4-vlan100",
            "10.100.0.15-10.100.0.16",
            "eth1",
        ),
        // A StatefulSet pod on IPv6, a DaemonSet pod on ipvlan, single-NIC.
        workload_pod("db-0", "macvlan-v6-vlan200", "auto", "eth1"),
        workload_pod("agent-x", "ipvlan-l2", "auto", "eth0"),
        workload_pod("edge-0", "ipvlan-l3-v6", "fd00:300::99", "eth1"),
    ] {
        admit(&cluster.server, &pod).await;
    }
    // Pods of several subnets: wait until each has its address.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let given = loop {
        let given: std::collections::BTreeMap<String, String> = cluster
            .server
            .list::<FlatNetworkIP>()
            .into_iter()
            .filter_map(|r| Some((r.metadata.name?, r.status?.addr?.to_string())))
            .collect();
        if given.len() == 5 || tokio::time::Instant::now() > deadline {
            break given;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut web: Vec<&str> = ["web-1", "web-2"]
        .iter()
        .map(|p| given[*p].as_str())
        .collect();
    web.sort_unstable();
    assert_eq!(web, ["10.100.0.15", "10.100.0.16"], "{given:?}");
    assert_eq!(given["db-0"], "fd00:200::10");
    assert_eq!(given["agent-x"], "10.110.0.50");
    assert_eq!(given["edge-0"], "fd00:300::99");
    // Each subnet's ledger follows its records.
    for subnet in [
        "macvlan-v4-vlan100",
        "macvlan-v6-vlan200",
        "ipvlan-l2",
        "ipvlan-l3-v6",
    ] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while cluster.view(subnet).check().is_err() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(cluster.view(subnet).check(), Ok(()), "{subnet}");
    }
    cluster.stop().await;
}

/// A fixed-IP workload's reservation, written by the workload controller,
/// is honoured by allocation: `auto` pods created after it never take the
/// reserved address (the original's allocation ignored `reservedIP`, so
/// the first `auto` pod took it and the workload's pod never started), the
/// workload's own pod (through its ReplicaSet) gets it, and another
/// workload asking for it is refused at admission.
#[tokio::test]
async fn a_fixed_ip_workloads_reservation_is_honoured_by_allocation() {
    use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
    use tokio_util::sync::CancellationToken;

    let server = FakeApiServer::new();
    admit(
        &server,
        &manifest(
            "lan",
            json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.100.0.0/24",
                   "gateway": "10.100.0.1", "ranges": [{"from": "10.100.0.10", "to": "10.100.0.20"}]}),
        ),
    )
    .await;
    let web: Deployment =
        serde_json::from_value(workload("Deployment", "web", "lan", "10.100.0.10")).unwrap();
    admit(&server, &web).await;
    let stop = CancellationToken::new();
    let workloads = tokio::spawn(crate::workloads::run(
        server.client(),
        Arc::new(Metrics::new()),
        Duration::from_secs(600),
        2,
        stop.clone(),
    ));
    let cluster = FakeCluster::start(server, Settings::default(), 2);
    cluster
        .wait_active("lan", Duration::from_secs(10))
        .await
        .unwrap();
    let reserved = || {
        cluster.server.list::<FlatNetworkSubnet>()[0]
            .status
            .as_ref()
            .is_some_and(|s| s.reserved_ip.contains_key("Deployment/churn/web"))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !reserved() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reserved(), "the workload controller reserves 10.100.0.10");

    for name in ["auto-0", "auto-1"] {
        admit(&cluster.server, &workload_pod(name, "lan", "auto", "eth1")).await;
    }
    let replicas: ReplicaSet = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "web-5f7d", "namespace": POD_NAMESPACE,
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "web",
                                          "uid": "uid-web", "controller": true}]}
    }))
    .unwrap();
    cluster.server.insert(&replicas);
    let mut web_pod = workload_pod("web-5f7d-x2x7k", "lan", "10.100.0.10", "eth1");
    web_pod.metadata.owner_references = Some(vec![
        serde_json::from_value(json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                      "name": "web-5f7d", "uid": "uid-rs", "controller": true}))
        .unwrap(),
    ]);
    admit(&cluster.server, &web_pod).await;
    let thief = workload("Deployment", "thief", "lan", "10.100.0.10");
    let verdict = review_create(&cluster.server, &thief).await;
    assert!(
        verdict
            .as_ref()
            .is_err_and(|m| m.contains("reserved by Deployment/churn/web")),
        "{verdict:?}"
    );

    let view = cluster
        .settle("lan", Duration::from_secs(20))
        .await
        .unwrap();
    let given = |pod: &str| view.addressed.get(pod).map(ToString::to_string);
    assert_eq!(
        given("web-5f7d-x2x7k").as_deref(),
        Some("10.100.0.10"),
        "{view:?}"
    );
    let mut auto = [given("auto-0"), given("auto-1")];
    auto.sort();
    assert_eq!(
        auto,
        [
            Some("10.100.0.11".to_owned()),
            Some("10.100.0.12".to_owned())
        ],
        "{view:?}"
    );
    stop.cancel();
    workloads.await.unwrap();
    cluster.stop().await;
}
