//! A simulated LAN: a "node" namespace whose master interface is a veth to
//! a "LAN host" namespace. Both namespaces are removed on drop.

use crate::support::{TestNetns, unique_name, veth_pair};

/// Node and LAN host joined by a veth: `master` in the node, `lan0` in the LAN.
pub struct SimulatedLan {
    pub node: TestNetns,
    pub lan: TestNetns,
    pub master: String,
}

impl SimulatedLan {
    /// Namespaces named `<prefix>n-…` (node) and `<prefix>l-…` (LAN host),
    /// both ends up, and `lan_addresses` (with prefix length) on `lan0`;
    /// IPv6 ones skip duplicate address detection.
    pub fn new(prefix: &str, lan_addresses: &[&str]) -> Self {
        let node = TestNetns::new(&format!("{prefix}n-"));
        let lan = TestNetns::new(&format!("{prefix}l-"));
        let master = unique_name("up");
        veth_pair(&node, &master, &lan, "lan0");
        node.ip(&["link", "set", &master, "up"]);
        lan.ip(&["link", "set", "lan0", "up"]);
        for address in lan_addresses {
            lan.add_address("lan0", address);
        }
        Self { node, lan, master }
    }
}
