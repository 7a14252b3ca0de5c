//! Pod floating addresses on the real kernel (root), against the
//! operator's in-memory API server: two nodes and a LAN client in their
//! own network namespaces on one bridge; on each node a pod with a macvlan
//! interface on the node's uplink, recorded as the CNI service records
//! it. Two pods of an active/standby set ask for an address of pool `lan`;
//! the operator's floating controllers (run against the same API server)
//! give the set one IPv4 and one IPv6 address. Each node runs the agent's
//! floating service as the daemon does: [`Floating`] (the heartbeat loop)
//! and [`PodAddresses`] linked to it.
//!
//! - The active pod (ready the longest) gets both addresses on its flat
//!   interface; the LAN client's TCP connections reach it, the standby
//!   holds nothing.
//! - The active pod turns unready: the standby's node adds the addresses
//!   to the standby and announces them, the old active pod's node removes
//!   them; the client's neighbour entries move to the standby's MAC and
//!   TCP reaches the standby, for both families. The standby's pod gets a
//!   `FloatingIPMoved` Event naming the pod before it.
//! - The active pod's node dies (its agent stops with no cleanup, its
//!   uplink goes down) while the API still shows the pod ready: the
//!   standby takes the addresses over once the heartbeats stop (the time
//!   is printed); the dead node's agent comes back and does not take them
//!   back, and removes them from its pod.

mod support;

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Instant,
};

use flatnet_agent::{
    datapath::Datapath,
    floating::{kubernetes::Floating, pods::PodAddresses},
    metrics::FloatingMetrics,
    records::Records,
};
use flatnet_k8s::{
    api::FloatingIPPool,
    floating::pods::{assigned_ips, is_labelled_assigned},
};
use flatnet_operator::{allocation::fake_api::FakeApiServer, metrics::Metrics};
use k8s_openapi::{
    api::{
        core::v1::{Node as KubeNode, Pod},
        events::v1::Event,
    },
    jiff::Timestamp,
};
use serde_json::json;
use support::{
    TestNetns,
    floating::{PORT, PodNode, answering, lan_and_client, pod_node, start_kubernetes_mode},
    privileged, wait_until,
};
use tokio_util::sync::CancellationToken;

const FLOATING_V4: &str = "10.79.0.50";
const FLOATING_V6: &str = "fd00:79::50";

/// One node with one pod, and its agent's floating service when running.
struct Node {
    name: &'static str,
    node: PodNode,
    datapath: Arc<Mutex<Datapath>>,
    agent: Option<(Floating, PodAddresses)>,
}

impl std::ops::Deref for Node {
    type Target = PodNode;

    fn deref(&self) -> &PodNode {
        &self.node
    }
}

impl Node {
    /// Whether this node's agent hears `node`'s heartbeats.
    fn hears(&self, node: &str) -> bool {
        self.agent.as_ref().is_some_and(|(floating, _)| {
            floating
                .agent_link()
                .alive
                .borrow()
                .as_ref()
                .is_some_and(|alive| alive.contains_key(node))
        })
    }

    /// Starts the agent's floating service against `api`, as the daemon
    /// does.
    fn start(&mut self, api: &FakeApiServer) {
        let floating = start_kubernetes_mode(
            api.client(),
            self.name,
            self.node.ns.path(),
            self.node.pin.path.clone(),
            &self.datapath,
            None,
            FloatingMetrics::default(),
        );
        let pods = PodAddresses::start(
            api.client(),
            self.name.into(),
            Records::open(self.node.records_dir.path()).unwrap(),
            FloatingMetrics::default(),
            floating.agent_link(),
        );
        self.agent = Some((floating, pods));
    }

    /// The node dies: its agent stops where it is (as a SIGKILL leaves
    /// it) and its uplink goes down, taking the pod's macvlan with it.
    fn kill(&mut self) {
        if let Some((floating, pods)) = self.agent.take() {
            floating.abandon();
            drop(pods);
        }
        self.node.ns.ip(&["link", "set", "up0", "down"]);
    }
}

/// Node `node` on the LAN at `address`, with pod `pod` at `v4`/`v6`.
fn node(
    node: &'static str,
    address: &str,
    pod: &'static str,
    lan: &TestNetns,
    v4: &str,
    v6: &str,
) -> Node {
    let (node_with_pod, datapath) = pod_node(node, address, pod, lan, v4, v6);
    Node {
        name: node,
        node: node_with_pod,
        datapath: Arc::new(Mutex::new(datapath)),
        agent: None,
    }
}

/// Pod `name` of set `pair` on `node`, asking for an address of pool
/// `lan`, ready since `ready_since` (seconds since the epoch).
fn pod(name: &str, node: &str, ready_since: i64) -> Pod {
    let since = Timestamp::from_second(ready_since).unwrap().to_string();
    serde_json::from_value(json!({
        "metadata": {
            "name": name, "namespace": "telco", "uid": format!("uid-{name}"),
            "annotations": {
                "flatnetwork.pandaria.io/floating-ip-pool": "lan",
                "flatnetwork.pandaria.io/floating-ip-set": "pair"
            }
        },
        "spec": {"nodeName": node, "containers": [{"name": "vnf", "image": "vnf"}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": since}
        ]}
    }))
    .unwrap()
}

fn pool() -> FloatingIPPool {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPPool",
        "metadata": {"name": "lan"},
        "spec": {"cidrs": ["10.79.0.0/24", "fd00:79::/64"], "targetNetworkInterface": "up0",
                 "ranges": [{"from": FLOATING_V4, "to": "10.79.0.59"},
                            {"from": FLOATING_V6, "to": "fd00:79::59"}]}
    }))
    .unwrap()
}

fn kube_node(name: &str, address: &str) -> KubeNode {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "status": {"addresses": [{"type": "InternalIP", "address": address}]}
    }))
    .unwrap()
}

/// The pod `name` as the API server holds it.
fn stored(api: &FakeApiServer, name: &str) -> Pod {
    api.list::<Pod>()
        .into_iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
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

/// Waits (off the async workers) until `pod` answers at both floating
/// addresses.
fn wait_answering(client: &TestNetns, pod: &str) {
    for addr in [FLOATING_V4, FLOATING_V6] {
        tokio::task::block_in_place(|| {
            wait_until(&format!("{pod} answers at {addr}"), || {
                answering_at(client, addr).as_deref() == Some(pod)
            });
        });
    }
}

/// Waits until `node`'s pod carries no floating address.
fn wait_released(node: &Node) {
    tokio::task::block_in_place(|| {
        wait_until(&format!("{} gives the addresses up", node.name), || {
            let held = node.pod_addresses();
            !held.contains(FLOATING_V4) && !held.contains(FLOATING_V6)
        });
    });
}

/// The `FloatingIPMoved` notes recorded on pod `name`.
fn moved_notes(api: &FakeApiServer, name: &str) -> Vec<String> {
    api.list::<Event>()
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("FloatingIPMoved"))
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter_map(|e| e.note)
        .collect()
}

/// A running cluster: the LAN and client, two nodes with their agents, the
/// operator's floating controllers, and the set's two pods, vnf-a (on
/// node-a) ready before vnf-b (on node-b), both given the set's addresses.
struct Cluster {
    api: FakeApiServer,
    client: TestNetns,
    a: Node,
    b: Node,
    operator: CancellationToken,
    _lan: TestNetns,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.operator.cancel();
    }
}

async fn cluster() -> Cluster {
    let (lan, client) = lan_and_client("10.79.0.100/24");
    client.add_address("eth0", "fd00:79::100/64");
    let mut a = node(
        "node-a",
        "10.79.0.1",
        "vnf-a",
        &lan,
        "10.79.0.11",
        "fd00:79::11",
    );
    let mut b = node(
        "node-b",
        "10.79.0.2",
        "vnf-b",
        &lan,
        "10.79.0.12",
        "fd00:79::12",
    );

    let api = FakeApiServer::new();
    api.insert(&pool());
    api.insert(&kube_node("node-a", "10.79.0.1"));
    api.insert(&kube_node("node-b", "10.79.0.2"));
    let operator = CancellationToken::new();
    tokio::spawn(flatnet_operator::floating::run(
        api.client(),
        Arc::new(Metrics::new()),
        flatnet_operator::floating::Settings::default(),
        2,
        operator.clone(),
    ));
    a.start(&api);
    b.start(&api);
    // Ready after the agents started (a pod's readiness counts from its
    // agent's start at the earliest), vnf-a first.
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    let now = Timestamp::now().as_second();
    // The active pod first; the standby joins the set, which holds its
    // addresses by then.
    let api_ref = &api;
    let expected: [std::net::IpAddr; 2] =
        [FLOATING_V4.parse().unwrap(), FLOATING_V6.parse().unwrap()];
    for (name, node, ready) in [("vnf-a", "node-a", now - 1), ("vnf-b", "node-b", now)] {
        api.insert(&pod(name, node, ready));
        tokio::task::block_in_place(|| {
            wait_until(
                &format!("the operator gives {name} the set's addresses"),
                || {
                    let stored = stored(api_ref, name);
                    assigned_ips(&stored) == expected && is_labelled_assigned(&stored)
                },
            );
        });
    }
    let cluster = Cluster {
        api,
        client,
        a,
        b,
        operator,
        _lan: lan,
    };
    // Steady state: each agent hears the other (the pods' nodes are
    // heartbeat peers once both pods hold the set's addresses).
    tokio::task::block_in_place(|| {
        wait_until("the agents hear each other", || {
            cluster.a.hears("node-b") && cluster.b.hears("node-a")
        });
    });
    wait_answering(&cluster.client, "vnf-a");
    for (addr, prefix) in [(FLOATING_V4, 24), (FLOATING_V6, 64)] {
        assert!(
            cluster
                .a
                .pod_addresses()
                .contains(&format!("{addr}/{prefix}")),
            "{}",
            cluster.a.pod_addresses()
        );
        assert!(
            !cluster.b.pod_addresses().contains(addr),
            "{}",
            cluster.b.pod_addresses()
        );
    }
    assert!(neighbour(&cluster.client, FLOATING_V4).contains(&cluster.a.pod_mac()));
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_active_pod_holds_the_address_and_the_standby_takes_it_over() {
    if !privileged("the_active_pod_holds_the_address_and_the_standby_takes_it_over") {
        return;
    }
    let cluster = cluster().await;
    let (api, client, a, b) = (&cluster.api, &cluster.client, &cluster.a, &cluster.b);

    // The active pod's readiness probe fails.
    let mut unready = stored(api, "vnf-a");
    unready
        .status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()[0]
        .status = "False".into();
    api.insert(&unready);
    wait_answering(client, "vnf-b");
    let mac_b = b.pod_mac();
    for addr in [FLOATING_V4, FLOATING_V6] {
        assert!(
            neighbour(client, addr).contains(&mac_b),
            "{addr}: {}",
            neighbour(client, addr)
        );
    }
    wait_released(a);
    // Its own addresses stay.
    assert!(a.pod_addresses().contains("10.79.0.11/24"));
    assert_eq!(answering_at(client, "10.79.0.11").as_deref(), Some("vnf-a"));

    let notes = moved_notes(api, "vnf-b");
    assert!(
        notes.iter().any(|n| n
            == "pod telco/vnf-b on node node-b holds 10.79.0.50 on net1 (before: pod telco/vnf-a on node node-a)"),
        "{notes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_when_the_active_pods_node_dies_and_keeps_the_address() {
    if !privileged("the_standby_takes_over_when_the_active_pods_node_dies_and_keeps_the_address") {
        return;
    }
    let mut cluster = cluster().await;

    let killed = Instant::now();
    cluster.a.kill();
    tokio::task::block_in_place(|| {
        wait_until("vnf-b answers at the IPv4 address", || {
            answering_at(&cluster.client, FLOATING_V4).as_deref() == Some("vnf-b")
        });
    });
    let took = killed.elapsed();
    eprintln!(
        "pod floating address: node death to the first TCP connect through the standby: {} ms",
        took.as_millis()
    );
    wait_answering(&cluster.client, "vnf-b");
    // The API server never learned of it: vnf-a is still Ready there.
    let a_pod = stored(&cluster.api, "vnf-a");
    let ready = &a_pod.status.as_ref().unwrap().conditions.as_ref().unwrap()[0];
    assert_eq!(
        (ready.type_.as_str(), ready.status.as_str()),
        ("Ready", "True")
    );
    let notes = moved_notes(&cluster.api, "vnf-b");
    assert!(
        notes.iter().any(|n| n
            == "pod telco/vnf-b on node node-b holds 10.79.0.50 on net1 (before: pod telco/vnf-a on node node-a)"),
        "{notes:?}"
    );

    // The node comes back with a new agent: vnf-a is ready longer than
    // vnf-b, but its agent started after vnf-b took over, so vnf-b keeps
    // the addresses and vnf-a gives up what it still carried.
    assert!(cluster.a.pod_addresses().contains(FLOATING_V4));
    cluster.a.ns.ip(&["link", "set", "up0", "up"]);
    let api = cluster.api.clone();
    cluster.a.start(&api);
    wait_released(&cluster.a);
    wait_answering(&cluster.client, "vnf-b");
    assert!(cluster.b.pod_addresses().contains(FLOATING_V4));
    assert!(cluster.b.pod_addresses().contains(FLOATING_V6));
}
