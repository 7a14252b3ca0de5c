//! A simulated LAN: a "node" namespace whose master interface is a veth to
//! a "LAN host" namespace. Both namespaces are removed on drop. With
//! [`AgentOnLan`], a standalone agent on that node.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use etherparse::{ArpOperation, LinkSlice, NetSlice, SlicedPacket};
use flatnet_agent::{
    netns::run_in_netns,
    packet::{BROADCAST, NdpMessage, RawSocket, Receive, arp_frame, ipv6_multicast_mac, ndp_frame},
};

use crate::support::{TestNetns, agent::StandaloneAgent, unique_name, veth_pair};

/// Sends three broadcast ARP requests from `mac` out of `ifname` in `ns`
/// (a LAN host), with sender address `sender`, for `target` (a gratuitous
/// ARP when they are the same).
#[allow(dead_code, reason = "not every test binary plays a LAN host")]
pub fn send_arp_requests(
    ns: &TestNetns,
    ifname: &str,
    mac: [u8; 6],
    sender: Ipv4Addr,
    target: Ipv4Addr,
) {
    let frame = arp_frame(
        mac,
        BROADCAST,
        ArpOperation::REQUEST,
        (mac, sender),
        ([0; 6], target),
    )
    .unwrap();
    send_three(ns, ifname, &frame);
}

/// Sends three unsolicited neighbour advertisements (to all nodes) from
/// `mac` out of `ifname` in `ns` (a LAN host), claiming `target`: IPv6's
/// gratuitous ARP.
#[allow(dead_code, reason = "not every test binary plays a LAN host")]
pub fn send_neighbour_advertisements(ns: &TestNetns, ifname: &str, mac: [u8; 6], target: Ipv6Addr) {
    let all_nodes: Ipv6Addr = "ff02::1".parse().unwrap();
    let message = NdpMessage::NeighborAdvertisement {
        target,
        solicited: false,
        override_flag: true,
    };
    let frame = ndp_frame(
        mac,
        ipv6_multicast_mac(all_nodes),
        target,
        all_nodes,
        message,
    )
    .unwrap();
    send_three(ns, ifname, &frame);
}

/// Sends `frame` three times out of `ifname` in `ns`.
fn send_three(ns: &TestNetns, ifname: &str, frame: &[u8]) {
    run_in_netns(&ns.path(), || {
        let socket = RawSocket::open(ifname).unwrap();
        for _ in 0..3 {
            socket.send(frame).unwrap();
        }
    })
    .unwrap();
}

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

    /// As [`SimulatedLan::new`], but the master is a Linux bridge in the
    /// node whose one port is the veth to the LAN host.
    #[allow(dead_code, reason = "not every test binary uses a bridge master")]
    pub fn bridged(prefix: &str, lan_addresses: &[&str]) -> Self {
        let Self { node, lan, master } = Self::new(prefix, lan_addresses);
        let bridge = unique_name("br");
        node.ip(&["link", "add", &bridge, "type", "bridge"]);
        node.ip(&["link", "set", &master, "master", &bridge]);
        node.ip(&["link", "set", &bridge, "up"]);
        Self {
            node,
            lan,
            master: bridge,
        }
    }
}

/// A [`SimulatedLan`] whose node runs a standalone agent (not started yet)
/// with its files in a temporary directory and the CNI binaries it
/// installs in `<dir>/bin`.
pub struct AgentOnLan {
    /// First field: the agent stops before the namespaces go.
    pub agent: StandaloneAgent,
    pub node: TestNetns,
    pub lan: TestNetns,
    pub master: String,
    pub dir: tempfile::TempDir,
}

impl AgentOnLan {
    /// The LAN of [`SimulatedLan::new`] and its agent, started with
    /// `--cni-bin-dir <dir>/bin` and `args`.
    pub fn new(prefix: &str, lan_addresses: &[&str], args: &[&str]) -> Self {
        let SimulatedLan { node, lan, master } = SimulatedLan::new(prefix, lan_addresses);
        let dir = tempfile::tempdir().unwrap();
        let cni_bin_dir = dir.path().join("bin").display().to_string();
        let mut all = vec!["--cni-bin-dir", cni_bin_dir.as_str()];
        all.extend_from_slice(args);
        let agent = StandaloneAgent::new(dir.path(), &node, &all);
        Self {
            agent,
            node,
            lan,
            master,
            dir,
        }
    }
}

/// A host on the LAN that answers ARP probes for `target` after `delay`,
/// from `mac`, until dropped.
#[allow(dead_code, reason = "not every test binary plays a slow LAN host")]
pub struct SlowHost {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<u32>>,
}

#[allow(dead_code, reason = "not every test binary plays a slow LAN host")]
impl SlowHost {
    /// Answers out of `lan0` in `lan`.
    pub fn answering(lan: &TestNetns, target: Ipv4Addr, delay: Duration, mac: [u8; 6]) -> Self {
        let socket = run_in_netns(&lan.path(), || {
            RawSocket::open_receiving("lan0", Receive::EtherType(0x0806))
        })
        .unwrap()
        .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let mut answered = 0;
            let mut buffer = [0u8; 1500];
            while !stopped.load(Ordering::Relaxed) {
                let Some(received) = socket
                    .receive(&mut buffer, Duration::from_millis(50))
                    .unwrap()
                else {
                    continue;
                };
                if received.outgoing {
                    continue;
                }
                let Some(prober) = probe_for(&buffer[..received.len], target) else {
                    continue;
                };
                thread::sleep(delay);
                let reply = arp_frame(
                    mac,
                    prober,
                    ArpOperation::REPLY,
                    (mac, target),
                    (prober, Ipv4Addr::UNSPECIFIED),
                )
                .unwrap();
                socket.send(&reply).unwrap();
                answered += 1;
            }
            answered
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops answering; how many probes it answered.
    pub fn finish(mut self) -> u32 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for SlowHost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The sender MAC of `frame` when it is an ARP probe (sender 0.0.0.0) for
/// `target`.
#[allow(dead_code, reason = "not every test binary plays a slow LAN host")]
fn probe_for(frame: &[u8], target: Ipv4Addr) -> Option<[u8; 6]> {
    let packet = SlicedPacket::from_ethernet(frame).ok()?;
    let Some(LinkSlice::Ethernet2(eth)) = &packet.link else {
        return None;
    };
    let Some(NetSlice::Arp(arp)) = &packet.net else {
        return None;
    };
    let probe = arp.operation() == ArpOperation::REQUEST
        && arp.sender_protocol_addr() == [0, 0, 0, 0]
        && arp.target_protocol_addr() == target.octets();
    probe.then(|| eth.source())
}
