//! Floating addresses in the agent's Kubernetes mode on the real kernel
//! (root), against the operator's in-memory API server: two nodes and a
//! LAN client in their own network namespaces on one bridge. Each node has
//! the data plane loaded (its own pin root), the floating address on `lo`
//! behind a TCP server that answers with the node's name (the kernel never
//! answers ARP for it on the uplink: `arp_ignore=1`), and runs
//! [`Floating`] as the daemon does, learning from the API server which
//! addresses it may serve and who its peers are (the Nodes'
//! `InternalIP`s).
//!
//! - Exactly one node answers for a Service's address; after its loop is
//!   abandoned (as a SIGKILL leaves it) and its uplink taken down, the
//!   other takes over; both tell the Service (`FloatingIPMoved`).
//! - Eligibility: a pool's `nodeSelector` keeps a node out; with
//!   `externalTrafficPolicy: Local` only the node with a ready endpoint
//!   answers, and ownership moves when the endpoint does.
//! - Split brain: the nodes do not hear each other's heartbeats (their
//!   `InternalIP`s lead nowhere) while the LAN and the API server work;
//!   both own the address, both claim its Lease, and the one whose claim
//!   was overtaken withdraws its responder entry: one node answers, the
//!   Lease's holder, and stays the only one. Once they hear each other,
//!   the heartbeats decide again, still one node answering.

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
};

use flatnet_agent::{
    datapath::{Datapath, DatapathConfig, PinnedMaps},
    floating::kubernetes::Floating,
    metrics::FloatingMetrics,
};
use flatnet_k8s::api::FloatingIPPool;
use flatnet_operator::allocation::fake_api::FakeApiServer;
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{Node as KubeNode, Service},
    discovery::v1::EndpointSlice,
    events::v1::Event,
};
use serde_json::{Value, json};
use support::{
    TestNetns, TestPinRoot,
    floating::{lan_and_client, plug, serve_name, start_kubernetes_mode},
    privileged, wait_until,
};

const PORT: u16 = 8080;
const FLOATING: &str = "10.78.0.50";
const CLIENT: &str = "10.78.0.100";

/// One node: namespace, pin root, data plane, and its floating service.
struct Node {
    name: &'static str,
    ns: TestNetns,
    pin: TestPinRoot,
    datapath: Arc<Mutex<Datapath>>,
    metrics: FloatingMetrics,
    floating: Option<Floating>,
    /// Holds the loop's status file (what `inspect floating` reads).
    status_dir: tempfile::TempDir,
}

impl Node {
    /// Whether this node's responder map lists the floating address.
    fn answers(&self) -> bool {
        let floating: IpAddr = FLOATING.parse().unwrap();
        let mut maps = PinnedMaps::open(&self.pin.path).unwrap();
        let responders = maps.responders().unwrap();
        responders
            .entries()
            .unwrap()
            .iter()
            .any(|(_, addr, _)| *addr == floating)
    }

    /// The owner of the floating address in this node's status file.
    fn status_owner(&self) -> Option<String> {
        let text = std::fs::read(self.status_dir.path().join("floating.json")).ok()?;
        let status: flatnet_agent::floating::owner::Status = serde_json::from_slice(&text).unwrap();
        assert_eq!(status.node, self.name);
        let floating: IpAddr = FLOATING.parse().unwrap();
        status
            .addresses
            .into_iter()
            .find(|row| row.address == floating)?
            .owner
    }

    /// Starts the node's floating service against `api`.
    fn start(&mut self, api: &FakeApiServer) {
        self.floating = Some(start_kubernetes_mode(
            api.client(),
            self.name,
            self.ns.path(),
            self.pin.path.clone(),
            &self.datapath,
            Some(self.status_dir.path().join("floating.json")),
            self.metrics.clone(),
        ));
    }
}

/// A node on the bridge of `lan` at `address`, serving its name on the
/// floating address.
fn node(name: &'static str, lan: &TestNetns, address: &str) -> Node {
    let ns = TestNetns::new(&format!("fk{name}"));
    plug(&ns, lan);
    ns.add_address("up0", &format!("{address}/24"));
    ns.add_address("lo", &format!("{FLOATING}/32"));
    ns.sysctl("net.ipv4.conf.all.arp_ignore", "1");
    ns.sysctl("net.ipv4.conf.all.arp_announce", "2");
    serve_name(&ns, SocketAddr::new(FLOATING.parse().unwrap(), PORT), name);
    let pin = TestPinRoot::new();
    let datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).expect("load");
    Node {
        name,
        ns,
        pin,
        datapath: Arc::new(Mutex::new(datapath)),
        metrics: FloatingMetrics::default(),
        floating: None,
        status_dir: tempfile::tempdir().unwrap(),
    }
}

/// The LAN (a bridge) and a client on it.
fn lan() -> (TestNetns, TestNetns) {
    lan_and_client(&format!("{CLIENT}/24"))
}

/// The node answering a TCP connection to the floating address from the
/// client, if any within 200 ms.
fn answering(client: &TestNetns) -> Option<String> {
    support::floating::answering(client, SocketAddr::new(FLOATING.parse().unwrap(), PORT))
}

fn kube_node(name: &str, zone: &str, address: &str) -> KubeNode {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"zone": zone}},
        "status": {"addresses": [{"type": "InternalIP", "address": address}]}
    }))
    .unwrap()
}

fn pool(node_selector: Option<Value>) -> FloatingIPPool {
    let mut pool = json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPPool",
        "metadata": {"name": "lan"},
        "spec": {"cidrs": ["10.78.0.0/24"], "targetNetworkInterface": "up0",
                 "ranges": [{"from": "10.78.0.50", "to": "10.78.0.59"}]}
    });
    if let Some(selector) = node_selector {
        pool["spec"]["nodeSelector"] = selector;
    }
    serde_json::from_value(pool).unwrap()
}

/// The Service the operator gave the floating address to.
fn service(policy: &str) -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "shop", "uid": "uid-web"},
        "spec": {"type": "LoadBalancer",
                 "loadBalancerClass": flatnet_k8s::floating::LOAD_BALANCER_CLASS,
                 "externalTrafficPolicy": policy,
                 "ports": [{"port": PORT, "protocol": "TCP"}]},
        "status": {"loadBalancer": {"ingress": [{"ip": FLOATING, "ipMode": "VIP"}]}}
    }))
    .unwrap()
}

fn endpoints_on(node: &str) -> EndpointSlice {
    serde_json::from_value(json!({
        "metadata": {"name": "web-abcde", "namespace": "shop",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.1.0.5"], "nodeName": node,
                       "conditions": {"ready": true}}]
    }))
    .unwrap()
}

/// The `FloatingIPMoved` Event notes recorded on the Service.
fn moved_notes(api: &FakeApiServer) -> Vec<String> {
    api.list::<Event>()
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("FloatingIPMoved"))
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("web"))
        .filter_map(|e| e.note)
        .collect()
}

/// The cluster of the tests: two nodes, a pool, one Service.
fn cluster(zone_b: &str, selector: Option<Value>, policy: &str) -> FakeApiServer {
    let api = FakeApiServer::new();
    api.insert(&kube_node("a", "east", "10.78.0.1"));
    api.insert(&kube_node("b", zone_b, "10.78.0.2"));
    api.insert(&pool(selector));
    api.insert(&service(policy));
    api
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_node_answers_and_the_other_takes_over_when_it_dies() {
    if !privileged("exactly_one_node_answers_and_the_other_takes_over_when_it_dies") {
        return;
    }
    let (lan, client) = lan();
    let mut a = node("a", &lan, "10.78.0.1");
    let mut b = node("b", &lan, "10.78.0.2");
    let api = cluster("east", None, "Cluster");
    a.start(&api);
    b.start(&api);

    wait_until("an owner answers", || answering(&client).is_some());
    let owner_name = answering(&client).unwrap();
    let (mut owner, survivor) = if owner_name == "a" { (a, b) } else { (b, a) };
    for _ in 0..10 {
        assert_eq!(answering(&client).as_deref(), Some(owner.name));
        assert!(
            owner.answers() && !survivor.answers(),
            "exactly one node answers"
        );
    }
    // The metric follows the take-over's event, a moment after the entry answers.
    wait_until("the owner counts the address", || {
        owner.metrics.owned.get() == 1
    });
    assert_eq!(survivor.metrics.owned.get(), 0);
    // Both see the same owner (what `inspect floating` shows).
    wait_until("both status files name the owner", || {
        owner.status_owner().as_deref() == Some(owner.name)
            && survivor.status_owner().as_deref() == Some(owner.name)
    });
    wait_until("the Service is told who answers", || {
        moved_notes(&api).iter().any(|n| {
            n.starts_with(&format!(
                "node {} answers for {FLOATING} on up0",
                owner.name
            ))
        })
    });

    // SIGKILL as the loop sees it: it stops with no cleanup; then the
    // node's link goes down.
    owner.floating.take().unwrap().abandon();
    owner.ns.ip(&["link", "set", "up0", "down"]);
    wait_until("the survivor answers", || {
        answering(&client).as_deref() == Some(survivor.name)
    });
    assert!(survivor.answers());
    wait_until("the survivor's status names it", || {
        survivor.status_owner().as_deref() == Some(survivor.name)
    });
    assert_eq!(survivor.metrics.acquired.get(), 1);
    assert!(survivor.metrics.announcements.get() >= 1);
    wait_until(
        "the Service is told the address moved, and from where",
        || {
            moved_notes(&api).iter().any(|n| {
                *n == format!(
                    "node {} answers for {FLOATING} on up0 (before: node {})",
                    survivor.name, owner.name
                )
            })
        },
    );
    drop(owner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_eligible_nodes_answer_and_ownership_follows_eligibility() {
    if !privileged("only_eligible_nodes_answer_and_ownership_follows_eligibility") {
        return;
    }
    let (lan, client) = lan();
    let mut a = node("a", &lan, "10.78.0.1");
    let mut b = node("b", &lan, "10.78.0.2");
    // Only b (zone west) may own the pool's addresses.
    let api = cluster(
        "west",
        Some(json!({"matchLabels": {"zone": "west"}})),
        "Cluster",
    );
    a.start(&api);
    b.start(&api);
    wait_until("b answers", || answering(&client).as_deref() == Some("b"));
    let a_view = a.floating.as_ref().unwrap().view();
    assert!(a_view.assignment.addresses.is_empty(), "{a_view:?}");
    assert!(!a.answers());

    // Any node may, but the Service keeps its traffic local and its only
    // ready endpoint is on a: a takes over, b lets go.
    api.insert(&pool(None));
    api.insert(&endpoints_on("a"));
    api.insert(&service("Local"));
    wait_until("a answers", || answering(&client).as_deref() == Some("a"));
    wait_until("b lets go", || !b.answers());
    let b_view = b.floating.as_ref().unwrap().view();
    assert!(b_view.assignment.addresses.is_empty(), "{b_view:?}");
    assert!(a.answers());
    assert_eq!(b.metrics.released.get(), 1);

    // The endpoint moves to b: so does the address.
    api.insert(&endpoints_on("b"));
    wait_until("b answers again", || {
        answering(&client).as_deref() == Some("b")
    });
    wait_until("a lets go", || !a.answers());
}

/// The holder of the floating address's Lease.
fn lease_holder(api: &FakeApiServer) -> Option<String> {
    let name = flatnet_agent::floating::lease::lease_name(FLOATING.parse().unwrap());
    api.list::<Lease>()
        .into_iter()
        .find(|l| l.metadata.name.as_deref() == Some(name.as_str()))?
        .spec?
        .holder_identity
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_owners_that_do_not_hear_each_other_the_overtaken_one_stops_answering() {
    if !privileged("of_two_owners_that_do_not_hear_each_other_the_overtaken_one_stops_answering") {
        return;
    }
    let (lan, client) = lan();
    let mut a = node("a", &lan, "10.78.0.1");
    let mut b = node("b", &lan, "10.78.0.2");
    // Heartbeats go to addresses no node has: each thinks the other dead.
    let api = FakeApiServer::new();
    api.insert(&kube_node("a", "east", "10.78.9.1"));
    api.insert(&kube_node("b", "east", "10.78.9.2"));
    api.insert(&pool(None));
    api.insert(&service("Cluster"));
    a.start(&api);
    b.start(&api);

    wait_until("both have owned the address", || {
        a.metrics.acquired.get() >= 1 && b.metrics.acquired.get() >= 1
    });
    wait_until("exactly one node answers", || a.answers() != b.answers());
    let (winner, loser) = if a.answers() { (&a, &b) } else { (&b, &a) };
    eprintln!("{} kept the address, {} withdrew", winner.name, loser.name);
    assert_eq!(lease_holder(&api).as_deref(), Some(winner.name));
    assert!(loser.metrics.released.get() >= 1);
    // It stays so: the loser does not claim again while the winner's
    // claim is live and the winner unheard.
    for _ in 0..30 {
        assert!(winner.answers() && !loser.answers());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    wait_until("the client reaches the winner", || {
        answering(&client).as_deref() == Some(winner.name)
    });
    wait_until("the Service is warned", || {
        api.list::<Event>().into_iter().any(|e| {
            e.reason.as_deref() == Some("FloatingIPSplitBrain")
                && e.note.as_deref().is_some_and(|n| {
                    n.starts_with(&format!(
                        "node {} stops answering for {FLOATING}: node {}, whose heartbeats",
                        loser.name, winner.name
                    ))
                })
        })
    });

    // The heartbeat network heals: they hear each other, the election
    // decides, and one node answers.
    api.insert(&kube_node("a", "east", "10.78.0.1"));
    api.insert(&kube_node("b", "east", "10.78.0.2"));
    wait_until("both send their heartbeats to the other's address", || {
        let heard = |n: &Node| {
            n.floating
                .as_ref()
                .unwrap()
                .view()
                .assignment
                .peers
                .iter()
                .all(|p| p.ip().to_string().starts_with("10.78.0."))
        };
        heard(&a) && heard(&b)
    });
    wait_until("both agree on the owner, and only it answers", || {
        let owner = a.status_owner();
        owner.is_some()
            && owner == b.status_owner()
            && a.answers() == (owner.as_deref() == Some("a"))
            && b.answers() == (owner.as_deref() == Some("b"))
    });
    let owner = if a.answers() { "a" } else { "b" };
    for _ in 0..10 {
        assert_eq!(a.answers(), owner == "a");
        assert_eq!(b.answers(), owner == "b");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    wait_until("the Lease names the owner", || {
        lease_holder(&api).as_deref() == Some(owner)
    });
}
