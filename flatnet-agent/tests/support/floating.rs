//! What the floating-address tests share: a LAN (bridge) with a client,
//! TCP servers that answer with their node's name, and the client's view
//! of which node answers.

use std::{
    io::Read,
    net::{SocketAddr, TcpListener, TcpStream},
    thread,
    time::Duration,
};

use flatnet_agent::netns::run_in_netns;

use super::{TestNetns, unique_name, veth_pair};

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
