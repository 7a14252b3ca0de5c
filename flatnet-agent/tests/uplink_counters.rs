//! The uplink program on a real kernel: frames sent from a LAN namespace
//! over a veth pair are counted per kind in the pinned map.

mod support;

use std::{net::Ipv4Addr, net::Ipv6Addr, os::unix::fs::PermissionsExt, thread, time::Duration};

use etherparse::ArpOperation;
use flatnet_agent::{
    datapath::{Datapath, DatapathConfig, FrameCounters, detach_uplink},
    netns::run_in_netns,
    packet::{
        BROADCAST, NdpMessage, RawSocket, arp_frame, ipv6_multicast_mac, ndp_frame, solicited_node,
    },
};
use flatnet_common::{FrameKind, pin::MAP_FRAME_COUNTERS};
use support::{TestNetns, TestPinRoot, privileged, veth_pair};

const LAN_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0x01];

/// A node namespace whose uplink has the program attached, and a LAN
/// namespace on the other end of a veth pair.
struct Topology {
    lan: TestNetns,
    node: TestNetns,
    lan_if: String,
    node_if: String,
    pin: TestPinRoot,
    datapath: Datapath,
}

impl Topology {
    /// `lan_ipv6`: whether the LAN side's kernel may speak IPv6 (it emits
    /// router solicitations, DAD and MLD on its own, so exact-count tests
    /// turn it off).
    fn new(lan_ipv6: bool) -> Self {
        let lan = TestNetns::new("fl-lan");
        let node = TestNetns::new("fl-node");
        if !lan_ipv6 {
            lan.sysctl("net.ipv6.conf.default.disable_ipv6", "1");
            lan.sysctl("net.ipv6.conf.all.disable_ipv6", "1");
        }
        let lan_if = support::unique_name("lan");
        let node_if = support::unique_name("up");
        veth_pair(&lan, &lan_if, &node, &node_if);
        lan.ip(&["link", "set", &lan_if, "address", "02:00:5e:00:00:01"]);
        node.ip(&["link", "set", &node_if, "up"]);

        let pin = TestPinRoot::new();
        let mut datapath = Datapath::load(&DatapathConfig {
            pin_root: pin.path.clone(),
        })
        .expect("load eBPF object");
        run_in_netns(&node.path(), || datapath.attach_uplink(&node_if))
            .expect("enter node netns")
            .expect("attach uplink program");
        lan.ip(&["link", "set", &lan_if, "up"]);
        Self {
            lan,
            node,
            lan_if,
            node_if,
            pin,
            datapath,
        }
    }

    /// Sends raw frames from the LAN side.
    fn send_from_lan(&self, frames: &[Vec<u8>]) {
        run_in_netns(&self.lan.path(), || {
            let socket = RawSocket::open(&self.lan_if).expect("raw socket on LAN side");
            for frame in frames {
                socket.send(frame).expect("send frame");
            }
        })
        .expect("enter LAN netns");
    }

    fn counters(&self) -> FrameCounters {
        self.datapath.frame_counters().expect("read counters")
    }

    /// Waits until the counters stop changing (frames are delivered
    /// asynchronously through the veth backlog), then returns them.
    fn settled_counters(&self) -> FrameCounters {
        let mut last = self.counters();
        for _ in 0..50 {
            thread::sleep(Duration::from_millis(20));
            let now = self.counters();
            if now == last {
                return now;
            }
            last = now;
        }
        last
    }
}

fn arp(op: ArpOperation, target: Ipv4Addr) -> Vec<u8> {
    let sender = Ipv4Addr::new(192, 0, 2, 200);
    arp_frame(LAN_MAC, BROADCAST, op, (LAN_MAC, sender), ([0; 6], target)).unwrap()
}

fn ndp(message: NdpMessage, dst: Ipv6Addr) -> Vec<u8> {
    let src: Ipv6Addr = "fe80::5eff:fe00:1".parse().unwrap();
    ndp_frame(LAN_MAC, ipv6_multicast_mac(dst), src, dst, message).unwrap()
}

/// Inserts an 802.1Q tag (VLAN 100) after the MAC addresses.
fn vlan_tagged(frame: &[u8], tpid: u16, vid: u16) -> Vec<u8> {
    let mut out = frame[..12].to_vec();
    out.extend_from_slice(&tpid.to_be_bytes());
    out.extend_from_slice(&vid.to_be_bytes());
    out.extend_from_slice(&frame[12..]);
    out
}

#[test]
fn counts_injected_arp_and_ndp_frames_exactly() {
    if !privileged("counts_injected_arp_and_ndp_frames_exactly") {
        return;
    }
    let topo = Topology::new(false);
    assert_eq!(
        topo.settled_counters(),
        FrameCounters::default(),
        "no traffic yet"
    );

    let absent = Ipv4Addr::new(192, 0, 2, 99);
    let target: Ipv6Addr = "2001:db8::99".parse().unwrap();
    let all_nodes: Ipv6Addr = "ff02::1".parse().unwrap();
    let all_routers: Ipv6Addr = "ff02::2".parse().unwrap();
    let arp_request = arp(ArpOperation::REQUEST, absent);
    let arp_reply = arp(ArpOperation::REPLY, absent);
    let rarp = arp(ArpOperation(3), absent);
    let ns = ndp(
        NdpMessage::NeighborSolicitation { target },
        solicited_node(target),
    );
    let na = ndp(
        NdpMessage::NeighborAdvertisement {
            target,
            solicited: false,
            override_flag: true,
        },
        all_nodes,
    );
    let rs = ndp(NdpMessage::RouterSolicitation, all_routers);
    let ra = ndp(NdpMessage::RouterAdvertisement, all_nodes);
    let redirect = ndp(
        NdpMessage::Redirect {
            target,
            destination: target,
        },
        all_nodes,
    );
    // Not counted: an IPv6 echo request, an IPv4 frame and a truncated ARP frame.
    let mut echo = ns.clone();
    echo[54] = 128;
    let mut ipv4 = arp_request.clone();
    ipv4[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let truncated = arp_request[..16].to_vec();

    let frames = vec![
        arp_request.clone(),
        arp_request.clone(),
        arp_request.clone(),
        vlan_tagged(&arp_request, 0x8100, 100),
        // QinQ: the kernel strips the outer tag, the program skips the inner one.
        vlan_tagged(&vlan_tagged(&arp_request, 0x8100, 100), 0x88a8, 200),
        arp_reply.clone(),
        arp_reply.clone(),
        rarp.clone(),
        rs.clone(),
        ra.clone(),
        ns.clone(),
        ns.clone(),
        ns.clone(),
        ns.clone(),
        na.clone(),
        na.clone(),
        redirect.clone(),
        echo,
        ipv4,
        truncated,
    ];
    topo.send_from_lan(&frames);
    let counters = topo.settled_counters();

    let expected_packets = [
        (FrameKind::ArpRequest, 5),
        (FrameKind::ArpReply, 2),
        (FrameKind::ArpOther, 1),
        (FrameKind::RouterSolicitation, 1),
        (FrameKind::RouterAdvertisement, 1),
        (FrameKind::NeighborSolicitation, 4),
        (FrameKind::NeighborAdvertisement, 2),
        (FrameKind::Redirect, 1),
    ];
    for (kind, packets) in expected_packets {
        assert_eq!(
            counters.get(kind).packets,
            packets,
            "{kind:?}: {counters:?}"
        );
    }
    // Untagged kinds count their exact frame length.
    assert_eq!(
        counters.get(FrameKind::ArpReply).bytes,
        2 * arp_reply.len() as u64
    );
    assert_eq!(
        counters.get(FrameKind::NeighborSolicitation).bytes,
        4 * ns.len() as u64
    );
    assert_eq!(
        counters.get(FrameKind::NeighborAdvertisement).bytes,
        2 * na.len() as u64
    );

    // Another process sees the same numbers through the pinned map.
    assert_eq!(
        FrameCounters::read_pinned(&topo.pin.path).unwrap(),
        counters
    );

    // Once detached, frames are no longer counted.
    let detached = run_in_netns(&topo.node.path(), || detach_uplink(&topo.node_if)).unwrap();
    assert!(detached.expect("detach"), "program was attached");
    topo.send_from_lan(&[arp_request, ns]);
    assert_eq!(topo.settled_counters(), counters, "counted after detach");
    let again = run_in_netns(&topo.node.path(), || detach_uplink(&topo.node_if)).unwrap();
    assert!(
        !again.expect("second detach"),
        "second detach finds nothing"
    );
}

#[test]
fn counts_real_arping_and_ping6_and_pins_with_btf() {
    if !privileged("counts_real_arping_and_ping6_and_pins_with_btf") {
        return;
    }
    let topo = Topology::new(true);
    topo.node
        .ip(&["addr", "add", "192.0.2.1/24", "dev", &topo.node_if]);
    topo.node.ip(&[
        "addr",
        "add",
        "2001:db8::1/64",
        "dev",
        &topo.node_if,
        "nodad",
    ]);
    topo.lan
        .ip(&["addr", "add", "192.0.2.2/24", "dev", &topo.lan_if]);
    topo.lan.ip(&[
        "addr",
        "add",
        "2001:db8::2/64",
        "dev",
        &topo.lan_if,
        "nodad",
    ]);

    topo.lan.exec(
        "arping",
        &["-c", "3", "-w", "5", "-I", &topo.lan_if, "192.0.2.1"],
    );
    topo.lan
        .exec("ping", &["-6", "-c", "1", "-W", "5", "2001:db8::1"]);
    let counters = topo.settled_counters();
    assert!(
        counters.get(FrameKind::ArpRequest).packets >= 3,
        "{counters:?}"
    );
    assert!(
        counters.get(FrameKind::NeighborSolicitation).packets >= 1,
        "{counters:?}"
    );

    // Pinned root-only, and bpftool shows the value's field names (BTF).
    let map_path = topo.pin.path.join(MAP_FRAME_COUNTERS);
    let dir_mode = std::fs::metadata(&topo.pin.path)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(dir_mode & 0o777, 0o700, "pin directory must be root-only");
    let map_mode = std::fs::metadata(&map_path).unwrap().permissions().mode();
    assert_eq!(
        map_mode & 0o077,
        0,
        "pinned map must not be group/world accessible"
    );
    let dump = support::run(
        "bpftool",
        &["-j", "map", "dump", "pinned", map_path.to_str().unwrap()],
    );
    let entries: serde_json::Value = serde_json::from_str(&dump).expect("bpftool JSON");
    // `formatted` is what bpftool derives from the map's BTF.
    let formatted = |kind: FrameKind| &entries[kind.index() as usize]["formatted"];
    let first_value = &formatted(FrameKind::ArpRequest)["values"][0]["value"];
    assert!(
        first_value.get("packets").is_some() && first_value.get("bytes").is_some(),
        "bpftool did not show BTF field names: {dump}"
    );
    let arp_requests: u64 = formatted(FrameKind::ArpRequest)["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["value"]["packets"].as_u64().unwrap())
        .sum();
    assert_eq!(arp_requests, counters.get(FrameKind::ArpRequest).packets);
}

#[test]
fn reloading_adopts_pinned_counters() {
    if !privileged("reloading_adopts_pinned_counters") {
        return;
    }
    let topo = Topology::new(false);
    let request = arp(ArpOperation::REQUEST, Ipv4Addr::new(192, 0, 2, 98));
    topo.send_from_lan(&[request.clone(), request.clone()]);
    assert_eq!(
        topo.settled_counters().get(FrameKind::ArpRequest).packets,
        2
    );

    // A second load (as a restarted agent does) reuses the pinned map and
    // re-attaching replaces the filter instead of adding a second one.
    let mut reloaded = Datapath::load(&DatapathConfig {
        pin_root: topo.pin.path.clone(),
    })
    .expect("reload");
    run_in_netns(&topo.node.path(), || reloaded.attach_uplink(&topo.node_if))
        .unwrap()
        .expect("re-attach");
    let filters = topo
        .node
        .exec("tc", &["filter", "show", "dev", &topo.node_if, "ingress"]);
    assert_eq!(
        filters.matches("uplink_ingress").count(),
        2,
        "one filter (name shown twice per line): {filters}"
    );
    topo.send_from_lan(&[request]);
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        reloaded
            .frame_counters()
            .unwrap()
            .get(FrameKind::ArpRequest)
            .packets,
        3
    );
}
