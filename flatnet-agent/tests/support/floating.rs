//! What the floating-address tests share: a LAN (bridge) with a client,
//! nodes on it running the floating-address loop, TCP servers that answer
//! with their node's name, and the client's view of which node answers.

use std::{
    io::Read,
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use flatnet_agent::{
    datapath::{Datapath, DatapathConfig},
    desired::{AttachmentKey, PodRef},
    floating::{
        kubernetes::{AttachUplink, Config, Floating},
        owner::{self, Assignment, Event, Settings},
    },
    link::ParentLink,
    metrics::FloatingMetrics,
    netns::run_in_netns,
    records::{AttachmentRecord, RecordPhase, Records},
};

use super::{TestNetns, TestPinRoot, unique_name, veth_pair};

/// The port the nodes serve their names on, at the floating address.
pub const PORT: u16 = 8080;

/// The addresses of one run: the floating one, the nodes', the client's,
/// and the LAN prefix length.
pub struct Plan {
    pub floating: &'static str,
    pub node_a: &'static str,
    pub node_b: &'static str,
    pub client: &'static str,
    pub prefix: u8,
    /// The VLAN the floating address lives on: the nodes serve it on
    /// `up0.<vlan>` of their trunk `up0` (the pool's `targetNetworkInterface`),
    /// the client is on `eth0.<vlan>`; 0: untagged on `up0` and `eth0`.
    pub vlan: u16,
}

impl Plan {
    /// The nodes' interface for the floating address.
    pub fn interface(&self) -> String {
        with_vlan("up0", self.vlan)
    }

    /// The client's interface on the LAN.
    pub fn client_interface(&self) -> String {
        with_vlan("eth0", self.vlan)
    }
}

/// `name`, or its VLAN link `name.<vlan>`.
fn with_vlan(name: &str, vlan: u16) -> String {
    if vlan == 0 {
        name.to_owned()
    } else {
        format!("{name}.{vlan}")
    }
}

/// Makes the VLAN link `<master>.<vlan>` in `ns` (nothing when `vlan` is 0)
/// and brings it up; returns its name.
pub fn vlan_link(ns: &TestNetns, master: &str, vlan: u16) -> String {
    let name = with_vlan(master, vlan);
    if vlan != 0 {
        ns.ip(&[
            "link",
            "add",
            "link",
            master,
            "name",
            &name,
            "type",
            "vlan",
            "id",
            &vlan.to_string(),
        ]);
        ns.ip(&["link", "set", &name, "up"]);
    }
    name
}

pub const IPV4: Plan = Plan {
    floating: "10.77.0.50",
    node_a: "10.77.0.1",
    node_b: "10.77.0.2",
    client: "10.77.0.100",
    prefix: 24,
    vlan: 0,
};

pub const IPV6: Plan = Plan {
    floating: "fd00:77::50",
    node_a: "fd00:77::1",
    node_b: "fd00:77::2",
    client: "fd00:77::100",
    prefix: 64,
    vlan: 0,
};

/// [`IPV4`] on VLAN 50.
pub const IPV4_VLAN: Plan = Plan { vlan: 50, ..IPV4 };

/// [`IPV6`] on VLAN 50.
pub const IPV6_VLAN: Plan = Plan { vlan: 50, ..IPV6 };

/// Whether the kernel makes 802.1Q VLAN links (tried in a namespace of its
/// own); prints the skip, or panics when the VM stage requires it, when not.
pub fn has_vlan_links(test: &str) -> bool {
    let probe = TestNetns::new("fipvp");
    probe.ip(&["link", "add", "p0", "type", "veth", "peer", "name", "p1"]);
    let out = std::process::Command::new("ip")
        .args([
            "-n",
            &probe.name,
            "link",
            "add",
            "link",
            "p0",
            "name",
            "p0.5",
        ])
        .args(["type", "vlan", "id", "5"])
        .output()
        .expect("run ip");
    if out.status.success() {
        return true;
    }
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(
        error.contains("Unknown device type"),
        "making a VLAN link failed for another reason than a missing link type: {error}"
    );
    super::skip_for_missing_kernel_feature(test, "802.1Q VLAN links");
    false
}

/// One node: namespace, pin root, datapath, and its loop.
pub struct Node {
    pub name: &'static str,
    pub ns: TestNetns,
    pub pin: TestPinRoot,
    _datapath: Datapath,
    pub stop: Arc<AtomicBool>,
    pub events: Arc<Mutex<Vec<Event>>>,
    pub address: &'static str,
    pub floating: &'static str,
    /// Where the floating address is served (`up0` or `up0.<vlan>`).
    pub interface: String,
}

/// A node on the bridge of `lan` with address `address`, serving its name
/// on the floating address (on `lo`: the kernel never answers ARP for it
/// on the uplink, `arp_ignore=1`), the uplink program attached to `up0`.
pub fn node(name: &'static str, lan: &TestNetns, address: &'static str, plan: &Plan) -> Node {
    let ns = TestNetns::new(&format!("fip{name}"));
    plug(&ns, lan);
    let interface = vlan_link(&ns, "up0", plan.vlan);
    ns.add_address(&interface, &format!("{address}/{}", plan.prefix));
    let host = if plan.floating.contains(':') { 128 } else { 32 };
    ns.add_address("lo", &format!("{}/{host}", plan.floating));
    ns.sysctl("net.ipv4.conf.all.arp_ignore", "1");
    ns.sysctl("net.ipv4.conf.all.arp_announce", "2");
    let floating: IpAddr = plan.floating.parse().unwrap();
    serve_name(&ns, SocketAddr::new(floating, PORT), name);
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).expect("load");
    run_in_netns(&ns.path(), || datapath.attach_uplink(&interface))
        .unwrap()
        .expect("attach uplink");
    // A node's uplink has been up for long: its IPv6 link-local address is
    // past duplicate address detection (up to 2 s after the link came up).
    // Until then the kernel sends no neighbour solicitation from it (no
    // usable source address), so a node taking over that early could not
    // resolve the client for its replies until the next solicitation, 1 s
    // later: the IPv6 outliers of `bench failover`.
    super::wait_until("the node's link-local address is past DAD", || {
        ns.ip(&["-6", "addr", "show", "dev", &interface, "tentative"])
            .trim()
            .is_empty()
    });
    Node {
        name,
        ns,
        pin,
        _datapath: datapath,
        stop: Arc::new(AtomicBool::new(false)),
        events: Arc::default(),
        address,
        floating: plan.floating,
        interface,
    }
}

/// Starts the node's loop with `peer` as the other node.
pub fn start(node: &Node, peer: &str) {
    let mut settings = Settings::new(node.name, node.pin.path.clone());
    settings.bind = SocketAddr::new(node.address.parse().unwrap(), 7946);
    let (_fixed, assignment) = tokio::sync::watch::channel(Assignment {
        addresses: [(node.floating.parse().unwrap(), node.interface.clone())].into(),
        peers: vec![SocketAddr::new(peer.parse().unwrap(), 7946)],
        ..Assignment::default()
    });
    let (stop, events, path) = (
        Arc::clone(&node.stop),
        Arc::clone(&node.events),
        node.ns.path(),
    );
    thread::spawn(move || {
        run_in_netns(&path, || {
            owner::run(&settings, &assignment, &stop, |event| {
                events.lock().unwrap().push(event);
            })
        })
        .unwrap()
        .unwrap();
    });
}

/// Stops the node's loop with no cleanup, as a SIGKILL of its agent
/// leaves it: the uplink program stays attached with its pinned maps, the
/// link and the node's servers stay up.
pub fn kill_agent(node: &Node) {
    node.stop.store(true, Ordering::Relaxed);
}

/// [`kill_agent`], and the node's uplink taken down: the node is dead to
/// the LAN.
pub fn kill(node: &Node) {
    kill_agent(node);
    node.ns.ip(&["link", "set", "up0", "down"]);
}

/// A bridge `br0` (the LAN) and a client on it at `address` (with prefix
/// length), without duplicate address detection.
pub fn lan_and_client(address: &str) -> (TestNetns, TestNetns) {
    let lan = TestNetns::new("fiplan");
    lan.ip(&["link", "add", "br0", "type", "bridge"]);
    lan.ip(&["link", "set", "br0", "up"]);
    let client = TestNetns::new("fipcl");
    let port = unique_name("fc");
    veth_pair(&client, "eth0", &lan, &port);
    lan.ip(&["link", "set", &port, "master", "br0", "up"]);
    client.sysctl("net.ipv6.conf.all.accept_dad", "0");
    client.ip(&["link", "set", "eth0", "up"]);
    client.add_address("eth0", address);
    (lan, client)
}

/// The LAN and its client for `plan`: the client at the plan's address on
/// `eth0`, or on `eth0.<vlan>` (its untagged `eth0` then holds an address
/// outside the plan's network).
pub fn lan_and_client_of(plan: &Plan) -> (TestNetns, TestNetns) {
    let client_address = format!("{}/{}", plan.client, plan.prefix);
    if plan.vlan == 0 {
        return lan_and_client(&client_address);
    }
    let (lan, client) = lan_and_client("192.0.2.100/24");
    let ifname = vlan_link(&client, "eth0", plan.vlan);
    client.add_address(&ifname, &client_address);
    (lan, client)
}

/// Plugs `ns` into the LAN's bridge through a new `up0`, and brings it up.
pub fn plug(ns: &TestNetns, lan: &TestNetns) {
    let port = unique_name("fb");
    veth_pair(ns, "up0", lan, &port);
    lan.ip(&["link", "set", &port, "master", "br0", "up"]);
    ns.ip(&["link", "set", "up0", "up"]);
}

/// Serves `name` to every TCP connection to `address` in `ns`.
pub fn serve_name(ns: &TestNetns, address: SocketAddr, name: &'static str) {
    let listener = run_in_netns(&ns.path(), || TcpListener::bind(address))
        .unwrap()
        .unwrap();
    thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let _ = std::io::Write::write_all(&mut stream, name.as_bytes());
        }
    });
}

/// The name served at `target` to `client`, if a connection completes
/// within 200 ms.
pub fn answering(client: &TestNetns, target: SocketAddr) -> Option<String> {
    run_in_netns(&client.path(), || {
        let mut stream = TcpStream::connect_timeout(&target, Duration::from_millis(200)).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .ok()?;
        let mut name = String::new();
        stream.read_to_string(&mut name).ok()?;
        Some(name)
    })
    .unwrap()
}

/// Starts node `name`'s floating service in Kubernetes mode as the daemon
/// does (heartbeats on every address of both families, the address Leases
/// in namespace `flatnet`), in the node's namespace `netns`, with its
/// data plane, against the API server behind `client`.
pub fn start_kubernetes_mode(
    client: kube::Client,
    name: &str,
    netns: std::path::PathBuf,
    pin_root: std::path::PathBuf,
    datapath: &Arc<Mutex<Datapath>>,
    status_file: Option<std::path::PathBuf>,
    metrics: FloatingMetrics,
) -> Floating {
    let mut settings = Settings::new(name, pin_root);
    settings.bind = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 7946));
    settings.status_file = status_file;
    let (datapath, attach_netns) = (Arc::clone(datapath), netns.clone());
    let attach: AttachUplink = Arc::new(move |interface: String| {
        let (datapath, netns) = (Arc::clone(&datapath), attach_netns.clone());
        Box::pin(async move {
            run_in_netns(&netns, || {
                datapath.lock().unwrap().attach_uplink(&interface)
            })
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
        })
    });
    Floating::start(
        client,
        Config {
            settings,
            classless: false,
            host_netns: Some(netns),
            lease_namespace: Some("flatnet".into()),
        },
        metrics,
        attach,
    )
}

/// A node on the LAN with one pod: a macvlan `net1` of the node's `up0` in
/// the pod's own namespace, serving the pod's name on [`PORT`] at every
/// address, recorded as the CNI service records it (container `c-<pod>`).
pub struct PodNode {
    pub ns: TestNetns,
    pub pod_ns: TestNetns,
    pub pin: TestPinRoot,
    pub records_dir: tempfile::TempDir,
}

impl PodNode {
    /// The addresses of the pod's flat interface.
    pub fn pod_addresses(&self) -> String {
        self.pod_ns.ip(&["-o", "addr", "show", "dev", "net1"])
    }

    /// The MAC of the pod's flat interface.
    pub fn pod_mac(&self) -> String {
        let out = self.pod_ns.ip(&["-o", "link", "show", "dev", "net1"]);
        out.split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .unwrap()
            .to_owned()
    }
}

/// Node `node` on the LAN at `address` (/24), with pod `pod` at `v4`/`v6`
/// (/24, /64), and its data plane loaded (not attached).
pub fn pod_node(
    node: &str,
    address: &str,
    pod: &'static str,
    lan: &TestNetns,
    v4: &str,
    v6: &str,
) -> (PodNode, Datapath) {
    // Namespace names end up in interface names: the node's last letter.
    let tag = &node[node.len() - 1..];
    let ns = TestNetns::new(&format!("fp{tag}"));
    plug(&ns, lan);
    ns.add_address("up0", &format!("{address}/24"));
    let pod_ns = TestNetns::new(&format!("fpp{tag}"));
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
            unreported_mtu: None,
        })
        .unwrap();
    let pin = TestPinRoot::new();
    let datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).expect("load");
    (
        PodNode {
            ns,
            pod_ns,
            pin,
            records_dir,
        },
        datapath,
    )
}
