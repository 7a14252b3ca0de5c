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
    floating::owner::{self, Assignment, Event, Settings},
    netns::run_in_netns,
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
}

pub const IPV4: Plan = Plan {
    floating: "10.77.0.50",
    node_a: "10.77.0.1",
    node_b: "10.77.0.2",
    client: "10.77.0.100",
    prefix: 24,
};

pub const IPV6: Plan = Plan {
    floating: "fd00:77::50",
    node_a: "fd00:77::1",
    node_b: "fd00:77::2",
    client: "fd00:77::100",
    prefix: 64,
};

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
}

/// A node on the bridge of `lan` with address `address`, serving its name
/// on the floating address (on `lo`: the kernel never answers ARP for it
/// on the uplink, `arp_ignore=1`), the uplink program attached to `up0`.
pub fn node(name: &'static str, lan: &TestNetns, address: &'static str, plan: &Plan) -> Node {
    let ns = TestNetns::new(&format!("fip{name}"));
    plug(&ns, lan);
    ns.add_address("up0", &format!("{address}/{}", plan.prefix));
    let host = if plan.floating.contains(':') { 128 } else { 32 };
    ns.add_address("lo", &format!("{}/{host}", plan.floating));
    ns.sysctl("net.ipv4.conf.all.arp_ignore", "1");
    ns.sysctl("net.ipv4.conf.all.arp_announce", "2");
    let floating: IpAddr = plan.floating.parse().unwrap();
    serve_name(&ns, SocketAddr::new(floating, PORT), name);
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).expect("load");
    run_in_netns(&ns.path(), || datapath.attach_uplink("up0"))
        .unwrap()
        .expect("attach uplink");
    Node {
        name,
        ns,
        pin,
        _datapath: datapath,
        stop: Arc::new(AtomicBool::new(false)),
        events: Arc::default(),
        address,
        floating: plan.floating,
    }
}

/// Starts the node's loop with `peer` as the other node.
pub fn start(node: &Node, peer: &str) {
    let mut settings = Settings::new(node.name, node.pin.path.clone());
    settings.bind = SocketAddr::new(node.address.parse().unwrap(), 7946);
    let (_fixed, assignment) = tokio::sync::watch::channel(Assignment {
        addresses: [(node.floating.parse().unwrap(), "up0".to_owned())].into(),
        peers: vec![SocketAddr::new(peer.parse().unwrap(), 7946)],
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

/// Stops the node's loop with no cleanup (as a SIGKILL leaves it) and
/// takes its uplink down: the node is dead to the LAN.
pub fn kill(node: &Node) {
    node.stop.store(true, Ordering::Relaxed);
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
