//! Pod floating addresses on the real kernel (root), against the
//! operator's in-memory API server: two nodes and a LAN client in their
//! own network namespaces on one bridge; on each node a pod with a macvlan
//! interface on the node's uplink, recorded as the CNI service records
//! it. Two pods of an active/standby set list the same IPv4 and IPv6
//! floating addresses; each node runs [`PodAddresses`] as the daemon does.
//!
//! - The active pod (ready the longest) gets both addresses on its flat
//!   interface; the LAN client's TCP connections reach it, the standby
//!   holds nothing.
//! - The active pod turns unready: the standby's node adds the addresses
//!   to the standby and announces them, the old active pod's node removes
//!   them; the client's neighbour entries move to the standby's MAC and
//!   TCP reaches the standby, for both families. The standby's pod gets a
//!   `FloatingIPMoved` Event naming the pod before it.

mod support;

use std::net::SocketAddr;

use flatnet_agent::{
    desired::{AttachmentKey, PodRef},
    floating::pods::PodAddresses,
    link::ParentLink,
    metrics::FloatingMetrics,
    records::{AttachmentRecord, RecordPhase, Records},
};
use flatnet_k8s::api::FloatingIPPool;
use flatnet_operator::allocation::fake_api::FakeApiServer;
use k8s_openapi::api::{core::v1::Pod, events::v1::Event};
use serde_json::json;
use support::{
    TestNetns,
    floating::{answering, lan_and_client, plug, serve_name},
    privileged, wait_until,
};

const PORT: u16 = 8080;
const FLOATING_V4: &str = "10.79.0.50";
const FLOATING_V6: &str = "fd00:79::50";

/// One node with one pod.
struct Node {
    /// The node's namespace, kept as long as its pod's.
    _ns: TestNetns,
    pod_ns: TestNetns,
    records_dir: tempfile::TempDir,
    _pods: Option<PodAddresses>,
}

impl Node {
    /// The addresses of the pod's flat interface.
    fn pod_addresses(&self) -> String {
        self.pod_ns.ip(&["-o", "addr", "show", "dev", "net1"])
    }

    fn pod_mac(&self) -> String {
        let out = self.pod_ns.ip(&["-o", "link", "show", "dev", "net1"]);
        out.split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .unwrap()
            .to_owned()
    }
}

/// Node `node` on the LAN, with pod `pod` at `v4`/`v6` on a macvlan
/// `net1` of the node's `up0`, serving its name on every address.
fn node(node: &str, pod: &'static str, lan: &TestNetns, v4: &str, v6: &str) -> Node {
    let ns = TestNetns::new(&format!("fp{node}"));
    plug(&ns, lan);
    let pod_ns = TestNetns::new(&format!("fpp{node}"));
    ns.ip(&[
        "link", "add", "link", "up0", "name", "pf0", "type", "macvlan", "mode", "bridge",
    ]);
    ns.ip(&["link", "set", "pf0", "netns", &pod_ns.name]);
    pod_ns.ip(&["link", "set", "pf0", "name", "net1"]);
    pod_ns.sysctl("net.ipv6.conf.all.accept_dad", "0");
    pod_ns.sysctl("net.ipv6.conf.default.accept_dad", "0");
    pod_ns.ip(&["link", "set", "net1", "up"]);
    pod_ns.add_address("net1", &format!("{v4}/24"));
    pod_ns.add_address("net1", &format!("{v6}/64"));
    serve_name(&pod_ns, SocketAddr::from(([0u16; 8], PORT)), pod);
    let records_dir = tempfile::tempdir().unwrap();
    let records = Records::open(records_dir.path()).unwrap();
    records
        .save(&AttachmentRecord {
            key: AttachmentKey {
                container_id: format!("c-{pod}"),
                ifname: "net1".into(),
            },
            network: "flat".into(),
            netns: pod_ns.path(),
            pod: PodRef {
                namespace: Some("telco".into()),
                name: Some(pod.into()),
                uid: Some(format!("uid-{pod}")),
            },
            phase: RecordPhase::Ready,
            subnets: Vec::new(),
            addresses: vec![
                format!("{v4}/24").parse().unwrap(),
                format!("{v6}/64").parse().unwrap(),
            ],
            requested_mac: None,
            mac: None,
            mtu: None,
            uplink: None,
            host_route: None,
            primary_defaults: None,
            parent: Some(ParentLink {
                master: "up0".into(),
                vlan: 0,
            }),
        })
        .unwrap();
    Node {
        _ns: ns,
        pod_ns,
        records_dir,
        _pods: None,
    }
}

/// Pod `name` of the set on `node`, ready since `ready_since` (RFC 3339)
/// or not ready.
fn pod(name: &str, node: &str, ready_since: Option<&str>) -> Pod {
    let ready = match ready_since {
        Some(since) => json!({"type": "Ready", "status": "True", "lastTransitionTime": since}),
        None => {
            json!({"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:10:00Z"})
        }
    };
    serde_json::from_value(json!({
        "metadata": {
            "name": name, "namespace": "telco", "uid": format!("uid-{name}"),
            "annotations": {
                "flatnetwork.pandaria.io/floating-ip-pool": "lan",
                "flatnetwork.pandaria.io/floating-ip-set": "pair",
                "flatnetwork.pandaria.io/floating-ip-assigned": format!("{FLOATING_V4},{FLOATING_V6}")
            }
        },
        "spec": {"nodeName": node, "containers": [{"name": "vnf", "image": "vnf"}]},
        "status": {"phase": "Running", "conditions": [ready]}
    }))
    .unwrap()
}

fn pool() -> FloatingIPPool {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPPool",
        "metadata": {"name": "lan"},
        "spec": {"cidrs": ["10.79.0.0/24", "fd00:79::/64"], "targetNetworkInterface": "up0"}
    }))
    .unwrap()
}

/// The pod answering a TCP connection to the floating `addr`.
fn answering_at(client: &TestNetns, addr: &str) -> Option<String> {
    answering(client, SocketAddr::new(addr.parse().unwrap(), PORT))
}

/// The client's neighbour entry for `addr`.
fn neighbour(client: &TestNetns, addr: &str) -> String {
    client.ip(&["neigh", "show", addr])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_active_pod_holds_the_address_and_the_standby_takes_it_over() {
    if !privileged("the_active_pod_holds_the_address_and_the_standby_takes_it_over") {
        return;
    }
    let (lan, client) = lan_and_client("10.79.0.100/24");
    client.add_address("eth0", "fd00:79::100/64");
    let mut a = node("a", "vnf-a", &lan, "10.79.0.11", "fd00:79::11");
    let mut b = node("b", "vnf-b", &lan, "10.79.0.12", "fd00:79::12");

    let api = FakeApiServer::new();
    api.insert(&pool());
    api.insert(&pod("vnf-a", "node-a", Some("2026-01-01T00:00:00Z")));
    api.insert(&pod("vnf-b", "node-b", Some("2026-01-01T00:05:00Z")));
    for (node, name) in [(&mut a, "node-a"), (&mut b, "node-b")] {
        let records = Records::open(node.records_dir.path()).unwrap();
        node._pods = Some(PodAddresses::start(
            api.client(),
            name.into(),
            records,
            FloatingMetrics::default(),
        ));
    }

    for addr in [FLOATING_V4, FLOATING_V6] {
        let what = format!("vnf-a answers at {addr}");
        let client_ref = &client;
        tokio::task::block_in_place(|| {
            wait_until(&what, || {
                answering_at(client_ref, addr).as_deref() == Some("vnf-a")
            });
        });
    }
    assert!(
        a.pod_addresses().contains("10.79.0.50/24"),
        "{}",
        a.pod_addresses()
    );
    assert!(
        a.pod_addresses().contains("fd00:79::50/64"),
        "{}",
        a.pod_addresses()
    );
    assert!(
        !b.pod_addresses().contains("10.79.0.50"),
        "{}",
        b.pod_addresses()
    );
    assert!(
        !b.pod_addresses().contains("fd00:79::50"),
        "{}",
        b.pod_addresses()
    );
    let mac_a = a.pod_mac();
    assert!(neighbour(&client, FLOATING_V4).contains(&mac_a));

    // The active pod's readiness probe fails.
    api.insert(&pod("vnf-a", "node-a", None));
    for addr in [FLOATING_V4, FLOATING_V6] {
        let what = format!("vnf-b answers at {addr}");
        let client_ref = &client;
        tokio::task::block_in_place(|| {
            wait_until(&what, || {
                answering_at(client_ref, addr).as_deref() == Some("vnf-b")
            });
        });
    }
    let mac_b = b.pod_mac();
    for addr in [FLOATING_V4, FLOATING_V6] {
        assert!(
            neighbour(&client, addr).contains(&mac_b),
            "{addr}: {}",
            neighbour(&client, addr)
        );
    }
    let client_ref = &client;
    let a_ref = &a;
    tokio::task::block_in_place(|| {
        wait_until("the old active pod gives the addresses up", || {
            let held = a_ref.pod_addresses();
            !held.contains("10.79.0.50") && !held.contains("fd00:79::50")
        });
    });
    // Its own addresses stay.
    assert!(a.pod_addresses().contains("10.79.0.11/24"));
    assert!(answering_at(client_ref, "10.79.0.11").as_deref() == Some("vnf-a"));

    let notes: Vec<String> = api
        .list::<Event>()
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("FloatingIPMoved"))
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("vnf-b"))
        .filter_map(|e| e.note)
        .collect();
    assert!(
        notes.iter().any(|n| n
            == "pod telco/vnf-b on node node-b holds 10.79.0.50 on net1 (before: pod telco/vnf-a on node node-a)"),
        "{notes:?}"
    );
}
