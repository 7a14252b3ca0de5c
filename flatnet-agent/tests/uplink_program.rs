//! The uplink program on a real kernel: frames sent from a LAN namespace
//! over a veth pair are counted per kind in the pinned map, and ARP requests
//! and neighbour solicitations for listed addresses are answered, checked
//! both with `BPF_PROG_TEST_RUN` on crafted frames and with real tools.
//! Also: how pinned maps left by an earlier agent are adopted or replaced.

mod support;

use std::{
    net::Ipv6Addr,
    net::{IpAddr, Ipv4Addr},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use aya::{
    maps::{MapData, MapInfo},
    programs::TcAttachType,
};
use aya_obj::generated::bpf_map_type;

use etherparse::ArpOperation;
use etherparse::{Icmpv6Type, NetSlice, SlicedPacket, TransportSlice};
use flatnet_agent::{
    datapath::{
        AttachMechanism, Datapath, DatapathConfig, DatapathError, FrameCounters, TcAttach,
        detach_uplink, kernel_has_tcx, map_pin_path, monotonic_ns,
    },
    netns::run_in_netns,
    packet::{
        BROADCAST, NdpMessage, RawSocket, arp_frame, ipv6_multicast_mac, ndp_frame, solicited_node,
    },
};
use flatnet_common::{
    FrameKind,
    pin::{MAP_FRAME_COUNTERS, MAP_POLICY_CT, PINNED_MAPS, PROG_UPLINK_INGRESS},
    policy::Direction,
    wire::WireKind,
};
use support::{
    TestNetns, TestPinRoot, privileged,
    tc_hooks::{self, Attached, attached_programs},
    veth_pair,
};

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
        let datapath = load_and_attach(&pin.path, &node, &node_if);
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

    /// Loads the datapath again over the same pins and re-attaches it, as
    /// a restarted or upgraded agent does.
    fn reload_and_attach(&self) -> Datapath {
        self.reload_and_attach_with(TcAttach::Auto)
    }

    /// [`Topology::reload_and_attach`] with programs attached as `tc_attach` says.
    fn reload_and_attach_with(&self, tc_attach: TcAttach) -> Datapath {
        let config = DatapathConfig {
            tc_attach,
            ..DatapathConfig::pinned_at(&self.pin.path)
        };
        load_and_attach_with(&config, &self.node, &self.node_if)
    }

    /// The names of the TCX link pins.
    fn link_pins(&self) -> Vec<String> {
        tc_hooks::link_pins(&self.pin.path)
    }

    /// Asserts that the uplink carries exactly one program, attached the
    /// way the datapath attaches, and returns it.
    fn assert_one_uplink_program(&self) -> Attached {
        let programs = attached_programs(&self.node, &self.node_if, TcAttachType::Ingress);
        match programs.as_slice() {
            [one]
                if one.name == PROG_UPLINK_INGRESS
                    && one.mechanism == self.datapath.attach_mechanism() =>
            {
                one.clone()
            }
            _ => panic!(
                "expected the uplink program alone, through {}: {programs:?}",
                self.datapath.attach_mechanism()
            ),
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

    /// Interface index of the node's uplink (in the node namespace).
    fn node_ifindex(&self) -> u32 {
        let path = format!("/sys/class/net/{}/ifindex", self.node_if);
        self.node
            .exec("cat", &[&path])
            .trim()
            .parse()
            .expect("ifindex")
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

/// Loads the datapath with its pins under `pin_root` and attaches the
/// uplink program to `node_if` in `node`.
fn load_and_attach(pin_root: &Path, node: &TestNetns, node_if: &str) -> Datapath {
    load_and_attach_with(&DatapathConfig::pinned_at(pin_root), node, node_if)
}

fn load_and_attach_with(config: &DatapathConfig, node: &TestNetns, node_if: &str) -> Datapath {
    let mut datapath = Datapath::load(config).expect("load eBPF object");
    run_in_netns(&node.path(), || datapath.attach_uplink(node_if))
        .expect("enter node netns")
        .expect("attach uplink program");
    datapath
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
    let detached = run_in_netns(&topo.node.path(), || {
        detach_uplink(&topo.pin.path, &topo.node_if)
    })
    .unwrap();
    assert!(detached.expect("detach"), "program was attached");
    topo.send_from_lan(&[arp_request, ns]);
    assert_eq!(topo.settled_counters(), counters, "counted after detach");
    let again = run_in_netns(&topo.node.path(), || {
        detach_uplink(&topo.pin.path, &topo.node_if)
    })
    .unwrap();
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
    for address in ["192.0.2.1/24", "2001:db8::1/64"] {
        topo.node.add_address(&topo.node_if, address);
    }
    for address in ["192.0.2.2/24", "2001:db8::2/64"] {
        topo.lan.add_address(&topo.lan_if, address);
    }

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
    let reloaded = topo.reload_and_attach();
    topo.assert_one_uplink_program();
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

#[test]
fn attaches_through_tcx_where_the_kernel_has_it_and_switches_in_place() {
    if !privileged("attaches_through_tcx_where_the_kernel_has_it_and_switches_in_place") {
        return;
    }
    let topo = Topology::new(false);
    let first = topo.assert_one_uplink_program();
    let forced_tcx = DatapathConfig {
        tc_attach: TcAttach::Tcx,
        ..DatapathConfig::pinned_at(&topo.pin.path)
    };
    if !kernel_has_tcx() {
        // Linux 6.1: netlink, and asking for TCX is refused with advice.
        assert_eq!(first.mechanism, AttachMechanism::Netlink);
        assert!(topo.link_pins().is_empty());
        let error = Datapath::load(&forced_tcx).err().expect("TCX refused");
        assert!(
            matches!(error, DatapathError::TcxUnsupported)
                && error.to_string().contains("--tc-attach netlink"),
            "{error}"
        );
    } else {
        assert_eq!(first.mechanism, AttachMechanism::Tcx);
        let pins = topo.link_pins();
        assert!(
            matches!(pins.as_slice(), [one] if one.ends_with(&format!("-{}-uplink_ingress", topo.node_ifindex()))),
            "one link pinned, named after netns, interface and program: {pins:?}"
        );
        // A restarted agent puts its program into the pinned link.
        let _reloaded = topo.reload_and_attach_with(TcAttach::Tcx);
        let second = topo.assert_one_uplink_program();
        assert_ne!(second.id, first.id, "the program was replaced");
        assert_eq!(topo.link_pins(), pins, "in the same link");

        // Netlink replaces the link, and TCX the filter again.
        let _netlink = topo.reload_and_attach_with(TcAttach::Netlink);
        let programs = attached_programs(&topo.node, &topo.node_if, TcAttachType::Ingress);
        assert!(
            matches!(programs.as_slice(), [one] if one.mechanism == AttachMechanism::Netlink),
            "{programs:?}"
        );
        assert!(topo.link_pins().is_empty(), "{:?}", topo.link_pins());
        let _tcx = topo.reload_and_attach_with(TcAttach::Tcx);
        topo.assert_one_uplink_program();
    }

    // Detaching removes the program and its pin, whichever way it was attached.
    let detached = run_in_netns(&topo.node.path(), || {
        detach_uplink(&topo.pin.path, &topo.node_if)
    })
    .unwrap();
    assert!(detached.expect("detach"));
    assert_eq!(
        attached_programs(&topo.node, &topo.node_if, TcAttachType::Ingress),
        Vec::new()
    );
    assert!(topo.link_pins().is_empty());
}

#[test]
fn pins_of_links_whose_interface_is_gone_are_removed() {
    if !privileged("pins_of_links_whose_interface_is_gone_are_removed") {
        return;
    }
    let mut topo = Topology::new(false);
    let pod = TestNetns::new("fl-pod");
    veth_pair(&pod, "eth1", &topo.node, "pod-peer");
    run_in_netns(&pod.path(), || topo.datapath.attach_policy("eth1"))
        .unwrap()
        .expect("attach the policy programs");
    let attached = topo.link_pins();
    let expected = if kernel_has_tcx() { 3 } else { 0 };
    assert_eq!(
        attached.len(),
        expected,
        "uplink + policy ingress/egress: {attached:?}"
    );

    // Nothing is defunct while the interfaces exist.
    assert_eq!(
        topo.datapath.remove_defunct_links().unwrap(),
        Vec::<PathBuf>::new()
    );
    // The pod's interface is deleted (as a CNI DEL does).
    pod.ip(&["link", "del", "eth1"]);
    // A DEL looks at its pod's namespace only: none of the node's pins.
    assert_eq!(
        topo.datapath
            .remove_defunct_links_in(&topo.node.path())
            .unwrap(),
        Vec::<PathBuf>::new()
    );
    let removed = topo.datapath.remove_defunct_links_in(&pod.path()).unwrap();
    assert_eq!(removed.len(), expected.saturating_sub(1), "{removed:?}");
    assert!(
        removed
            .iter()
            .all(|pin| pin.to_string_lossy().contains("policy_")),
        "only the pod's links: {removed:?}"
    );
    topo.assert_one_uplink_program();
    assert_eq!(topo.link_pins().len(), expected.min(1));
    assert_eq!(
        topo.datapath.remove_defunct_links().unwrap(),
        Vec::<PathBuf>::new(),
        "the namespace's sweep left nothing defunct"
    );
}

// ---------------------------------------------------------------------------
// ARP / NDP answering
// ---------------------------------------------------------------------------

/// TC verdicts (include/uapi/linux/pkt_cls.h).
use flatnet_common::verdict::{PASS, REDIRECT};
/// `BPF_PROG_TEST_RUN` runs TC programs as if on loopback.
const LOOPBACK_IFINDEX: u32 = 1;
const NODE_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0xbb];
const OWNED_V4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 50);

fn owned_v6() -> Ipv6Addr {
    "2001:db8::50".parse().unwrap()
}

/// A datapath with a private pin root whose responder lists the owned
/// addresses on `ifindex`.
fn responder_datapath(pin: &TestPinRoot, ifindex: u32) -> Datapath {
    responder_datapath_logging(pin, ifindex, false)
}

/// [`responder_datapath`] with the programs' kernel logging on or off.
fn responder_datapath_logging(pin: &TestPinRoot, ifindex: u32, kernel_logs: bool) -> Datapath {
    let mut datapath =
        Datapath::load_with_kernel_logs(&DatapathConfig::pinned_at(&pin.path), kernel_logs)
            .expect("load eBPF object");
    answer_for_owned_addresses(&mut datapath, ifindex);
    datapath
}

/// Lists both owned addresses on `ifindex` in the responder, with NODE_MAC.
fn answer_for_owned_addresses(datapath: &mut Datapath, ifindex: u32) {
    let mut responders = datapath.responders().expect("responder maps");
    responders
        .insert(ifindex, OWNED_V4.into(), NODE_MAC)
        .unwrap();
    responders
        .insert(ifindex, owned_v6().into(), NODE_MAC)
        .unwrap();
}

fn arp_request_for(target: Ipv4Addr) -> Vec<u8> {
    arp(ArpOperation::REQUEST, target)
}

fn solicitation(source: Ipv6Addr, target: Ipv6Addr) -> Vec<u8> {
    let eth_dst = ipv6_multicast_mac(solicited_node(target));
    ndp_frame(
        LAN_MAC,
        eth_dst,
        source,
        solicited_node(target),
        NdpMessage::NeighborSolicitation { target },
    )
    .unwrap()
}

/// Checks `frame` is a neighbour advertisement for `target` from NODE_MAC
/// to `dst`, with a correct checksum; returns (solicited, override).
fn assert_advertisement(
    frame: &[u8],
    target: Ipv6Addr,
    dst: Ipv6Addr,
    eth_dst: [u8; 6],
) -> (bool, bool) {
    assert_eq!(&frame[..6], &eth_dst, "Ethernet destination");
    assert_eq!(&frame[6..12], &NODE_MAC, "Ethernet source");
    let packet = SlicedPacket::from_ethernet(frame).expect("parseable frame");
    let Some(NetSlice::Ipv6(ip)) = packet.net else {
        panic!("not IPv6")
    };
    let header = ip.header();
    assert_eq!(header.hop_limit(), 255);
    assert_eq!(header.source_addr(), target);
    assert_eq!(header.destination_addr(), dst);
    assert_eq!(header.payload_length(), 32);
    let Some(TransportSlice::Icmpv6(icmp)) = packet.transport else {
        panic!("not ICMPv6")
    };
    let expected = icmp
        .icmp_type()
        .calc_checksum(header.source(), header.destination(), icmp.payload())
        .unwrap();
    assert_eq!(icmp.checksum(), expected, "ICMPv6 checksum");
    assert_eq!(&icmp.payload()[..16], &target.octets());
    assert_eq!(
        &icmp.payload()[16..],
        &[2, 1, 0x02, 0x00, 0x5e, 0x00, 0x00, 0xbb],
        "target link-layer option"
    );
    match icmp.icmp_type() {
        Icmpv6Type::NeighborAdvertisement(flags) => (flags.solicited, flags.r#override),
        other => panic!("not an advertisement: {other:?}"),
    }
}

#[test]
fn test_run_answers_arp_only_for_listed_addresses() {
    if !privileged("test_run_answers_arp_only_for_listed_addresses") {
        return;
    }
    let pin = TestPinRoot::new();
    let mut datapath = responder_datapath(&pin, LOOPBACK_IFINDEX);

    let request = arp_request_for(OWNED_V4);
    let out = datapath.test_run_uplink(&request, 1).unwrap();
    assert_eq!(out.verdict, REDIRECT, "answered and sent back");
    let reply = &out.frame;
    assert_eq!(reply.len(), request.len());
    assert_eq!(&reply[..6], &LAN_MAC, "to the requester");
    assert_eq!(&reply[6..12], &NODE_MAC, "from the node");
    assert_eq!(&reply[12..14], &[0x08, 0x06]);
    assert_eq!(&reply[20..22], &[0, 2], "ARP reply");
    assert_eq!(&reply[22..28], &NODE_MAC, "sender MAC");
    assert_eq!(&reply[28..32], &OWNED_V4.octets(), "sender IP");
    assert_eq!(&reply[32..38], &LAN_MAC, "target MAC");
    assert_eq!(&reply[38..42], &[192, 0, 2, 200], "target IP");

    // In-frame 802.1Q tag: answered, tag kept.
    let tagged = vlan_tagged(&request, 0x8100, 100);
    let out = datapath.test_run_uplink(&tagged, 1).unwrap();
    assert_eq!(out.verdict, REDIRECT);
    assert_eq!(&out.frame[12..16], &[0x81, 0x00, 0x00, 100], "tag kept");
    assert_eq!(&out.frame[24..26], &[0, 2], "ARP reply after the tag");

    // Not answered, passed on unchanged: an unlisted address, a
    // gratuitous announcement of the listed one, a reply, truncated frames.
    let gratuitous = arp_frame(
        LAN_MAC,
        BROADCAST,
        ArpOperation::REQUEST,
        (LAN_MAC, OWNED_V4),
        ([0; 6], OWNED_V4),
    )
    .unwrap();
    let not_answered = [
        arp_request_for(Ipv4Addr::new(192, 0, 2, 51)),
        gratuitous,
        arp(ArpOperation::REPLY, OWNED_V4),
        request[..40].to_vec(),
        // The shortest frame the kernel accepts: an Ethernet header alone.
        request[..14].to_vec(),
    ];
    for frame in not_answered {
        let out = datapath.test_run_uplink(&frame, 1).unwrap();
        assert_eq!(out.verdict, PASS, "frame {frame:02x?}");
        assert_eq!(out.frame, frame, "frame modified");
    }

    // Removing the entry stops the answers.
    assert!(
        datapath
            .responders()
            .unwrap()
            .remove(LOOPBACK_IFINDEX, OWNED_V4.into())
            .unwrap()
    );
    assert_eq!(datapath.test_run_uplink(&request, 1).unwrap().verdict, PASS);
    assert_eq!(datapath.responder_stats().unwrap().arp_replies, 2);
}

#[test]
fn a_leased_entry_is_answered_until_its_lease_runs_out() {
    if !privileged("a_leased_entry_is_answered_until_its_lease_runs_out") {
        return;
    }
    let pin = TestPinRoot::new();
    let mut datapath =
        Datapath::load(&DatapathConfig::pinned_at(&pin.path)).expect("load eBPF object");
    let target = owned_v6();
    let requester: Ipv6Addr = "fe80::5eff:fe00:1".parse().unwrap();
    let lease = |datapath: &mut Datapath, valid_until_ns: u64| {
        let mut responders = datapath.responders().expect("responder maps");
        for addr in [IpAddr::from(OWNED_V4), IpAddr::from(target)] {
            responders
                .insert_until(LOOPBACK_IFINDEX, addr, NODE_MAC, valid_until_ns)
                .unwrap();
        }
    };
    let verdicts = |datapath: &mut Datapath| {
        (
            datapath
                .test_run_uplink(&arp_request_for(OWNED_V4), 1)
                .unwrap()
                .verdict,
            datapath
                .test_run_uplink(&solicitation(requester, target), 1)
                .unwrap()
                .verdict,
        )
    };
    let now = monotonic_ns();
    lease(&mut datapath, now + 60_000_000_000);
    assert_eq!(
        verdicts(&mut datapath),
        (REDIRECT, REDIRECT),
        "within the lease"
    );
    // The owner's agent stopped renewing: the program falls silent by itself.
    lease(&mut datapath, now.saturating_sub(1).max(1));
    assert_eq!(verdicts(&mut datapath), (PASS, PASS), "lease run out");
    lease(&mut datapath, monotonic_ns() + 60_000_000_000);
    assert_eq!(verdicts(&mut datapath), (REDIRECT, REDIRECT), "renewed");
}

#[test]
fn test_run_answers_neighbor_solicitations() {
    if !privileged("test_run_answers_neighbor_solicitations") {
        return;
    }
    let pin = TestPinRoot::new();
    let mut datapath = responder_datapath(&pin, LOOPBACK_IFINDEX);
    let target = owned_v6();
    let requester: Ipv6Addr = "fe80::5eff:fe00:1".parse().unwrap();

    // Solicited: unicast back to the requester, Solicited and Override set.
    let out = datapath
        .test_run_uplink(&solicitation(requester, target), 1)
        .unwrap();
    assert_eq!(out.verdict, REDIRECT);
    assert_eq!(out.frame.len(), 14 + 40 + 32);
    assert_eq!(
        assert_advertisement(&out.frame, target, requester, LAN_MAC),
        (true, true)
    );

    // A solicitation without options grows to carry the target link-layer option.
    let mut bare = solicitation(requester, target);
    bare.truncate(14 + 40 + 24);
    bare[14 + 5] = 24; // IPv6 payload length
    let out = datapath.test_run_uplink(&bare, 1).unwrap();
    assert_eq!(out.verdict, REDIRECT);
    assert_advertisement(&out.frame, target, requester, LAN_MAC);

    // Duplicate address detection: unsolicited, to all nodes.
    let out = datapath
        .test_run_uplink(&solicitation(Ipv6Addr::UNSPECIFIED, target), 1)
        .unwrap();
    assert_eq!(out.verdict, REDIRECT);
    let all_nodes: Ipv6Addr = "ff02::1".parse().unwrap();
    assert_eq!(
        assert_advertisement(&out.frame, target, all_nodes, [0x33, 0x33, 0, 0, 0, 1]),
        (false, true)
    );

    // Not answered: unlisted target, hop limit below 255, truncated.
    let mut low_hop_limit = solicitation(requester, target);
    low_hop_limit[14 + 7] = 64;
    let not_answered = [
        solicitation(requester, "2001:db8::51".parse().unwrap()),
        low_hop_limit,
        solicitation(requester, target)[..14 + 40 + 10].to_vec(),
    ];
    for frame in not_answered {
        let out = datapath.test_run_uplink(&frame, 1).unwrap();
        assert_eq!(out.verdict, PASS, "frame {frame:02x?}");
        assert_eq!(out.frame, frame, "frame modified");
    }
    assert_eq!(
        datapath.responder_stats().unwrap().neighbor_advertisements,
        3
    );
}

#[test]
fn lan_host_resolves_listed_addresses_through_the_program() {
    if !privileged("lan_host_resolves_listed_addresses_through_the_program") {
        return;
    }
    let mut topo = Topology::new(true);
    for address in ["192.0.2.10/24", "2001:db8::10/64"] {
        topo.lan.add_address(&topo.lan_if, address);
    }
    let ifindex = topo.node_ifindex();

    // Nothing is listed yet: the node's kernel has no such address, nobody answers.
    let answered = topo.lan.try_exec(
        "arping",
        &["-c", "1", "-w", "1", "-I", &topo.lan_if, "192.0.2.50"],
    );
    assert!(!answered, "an unlisted address must not be answered");

    answer_for_owned_addresses(&mut topo.datapath, ifindex);

    let arping = topo.lan.exec(
        "arping",
        &["-c", "2", "-w", "5", "-I", &topo.lan_if, "192.0.2.50"],
    );
    assert!(
        arping.to_lowercase().contains("02:00:5e:00:00:bb"),
        "arping output: {arping}"
    );
    let ndisc = topo
        .lan
        .exec("ndisc6", &["-n", "-r", "3", "2001:db8::50", &topo.lan_if]);
    assert!(
        ndisc.to_uppercase().contains("02:00:5E:00:00:BB"),
        "ndisc6 output: {ndisc}"
    );
    // The LAN host's kernel accepts the answer: its neighbour table points at the node.
    topo.lan
        .try_exec("ping", &["-c", "1", "-W", "1", "192.0.2.50"]);
    let neigh = topo.lan.ip(&["neigh", "show", "192.0.2.50"]);
    assert!(
        neigh.contains("02:00:5e:00:00:bb"),
        "neighbour entry: {neigh}"
    );
    let stats = topo.datapath.responder_stats().unwrap();
    assert!(
        stats.arp_replies >= 2 && stats.neighbor_advertisements >= 1,
        "{stats:?}"
    );
}

// ---------------------------------------------------------------------------
// IP-conflict detection
// ---------------------------------------------------------------------------

const OWNER_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0x02];
const ROGUE_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0xee];
const MANAGED_V4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 60);

fn managed_v6() -> Ipv6Addr {
    "2001:db8::60".parse().unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Watches MANAGED_V4 on loopback for conflicts, owned by OWNER_MAC.
fn watch_managed_v4(datapath: &mut Datapath) {
    datapath
        .managed_addrs()
        .unwrap()
        .insert(LOOPBACK_IFINDEX, MANAGED_V4.into(), OWNER_MAC)
        .unwrap();
}

/// Runs `flatnet-agent inspect <args> --pin-root <pin_root>`.
fn inspect(args: &[&str], pin_root: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_flatnet-agent"))
        .arg("inspect")
        .args(args)
        .arg("--pin-root")
        .arg(pin_root)
        .output()
        .unwrap()
}

/// [`inspect`] that must succeed; returns its output.
fn inspect_ok(args: &[&str], pin_root: &Path) -> Vec<u8> {
    let out = inspect(args, pin_root);
    assert!(
        out.status.success(),
        "inspect {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn gratuitous_arp(mac: [u8; 6], ip: Ipv4Addr) -> Vec<u8> {
    arp_frame(
        mac,
        BROADCAST,
        ArpOperation::REQUEST,
        (mac, ip),
        ([0; 6], ip),
    )
    .unwrap()
}

#[test]
fn test_run_reports_foreign_claims_on_managed_addresses() {
    if !privileged("test_run_reports_foreign_claims_on_managed_addresses") {
        return;
    }
    let rt = runtime();
    let _entered = rt.enter();
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).unwrap();
    watch_managed_v4(&mut datapath);
    datapath
        .managed_addrs()
        .unwrap()
        .insert(LOOPBACK_IFINDEX, managed_v6().into(), OWNER_MAC)
        .unwrap();
    let mut monitor = datapath.conflict_monitor().unwrap();

    // Claims that are not conflicts: the owner's own announcement, an
    // unmanaged address, a plain request for the managed address.
    for frame in [
        gratuitous_arp(OWNER_MAC, MANAGED_V4),
        gratuitous_arp(ROGUE_MAC, Ipv4Addr::new(192, 0, 2, 61)),
        arp_frame(
            ROGUE_MAC,
            BROADCAST,
            ArpOperation::REQUEST,
            (ROGUE_MAC, Ipv4Addr::new(192, 0, 2, 9)),
            ([0; 6], MANAGED_V4),
        )
        .unwrap(),
    ] {
        assert_eq!(datapath.test_run_uplink(&frame, 1).unwrap().verdict, PASS);
    }
    assert_eq!(monitor.try_next(), None, "no conflict yet");

    // A rogue gratuitous ARP is reported once; the repeat inside the
    // report interval is not.
    datapath
        .test_run_uplink(&gratuitous_arp(ROGUE_MAC, MANAGED_V4), 1)
        .unwrap();
    datapath
        .test_run_uplink(&gratuitous_arp(ROGUE_MAC, MANAGED_V4), 1)
        .unwrap();
    let conflict = monitor.try_next().expect("conflict reported");
    assert_eq!(conflict.addr, std::net::IpAddr::V4(MANAGED_V4));
    assert_eq!(
        conflict.kind,
        flatnet_common::conflict::ClaimKind::GratuitousArp
    );
    assert_eq!(conflict.foreign_mac, ROGUE_MAC);
    assert_eq!(conflict.owner_mac, OWNER_MAC);
    assert_eq!(conflict.ifindex, LOOPBACK_IFINDEX);
    assert_eq!(monitor.try_next(), None, "rate limited per address");

    // A rogue neighbour advertisement for the IPv6 address.
    let target = managed_v6();
    let na = ndp_frame(
        ROGUE_MAC,
        ipv6_multicast_mac("ff02::1".parse().unwrap()),
        target,
        "ff02::1".parse().unwrap(),
        NdpMessage::NeighborAdvertisement {
            target,
            solicited: false,
            override_flag: true,
        },
    )
    .unwrap();
    datapath.test_run_uplink(&na, 1).unwrap();
    let conflict = monitor.try_next().expect("NA conflict reported");
    assert_eq!(conflict.addr, std::net::IpAddr::V6(target));
    assert_eq!(
        conflict.kind,
        flatnet_common::conflict::ClaimKind::NeighborAdvertisement
    );
    assert_eq!(conflict.foreign_mac, ROGUE_MAC);
    let text = conflict.to_string();
    assert!(
        text.contains("2001:db8::60") && text.contains("02:00:5e:00:00:ee"),
        "{text}"
    );
}

#[test]
fn rogue_lan_host_triggers_conflict_report() {
    if !privileged("rogue_lan_host_triggers_conflict_report") {
        return;
    }
    let rt = runtime();
    let mut topo = Topology::new(false);
    topo.lan.add_address(&topo.lan_if, "192.0.2.60/24");
    let ifindex = topo.node_ifindex();
    topo.datapath
        .managed_addrs()
        .unwrap()
        .insert(ifindex, MANAGED_V4.into(), OWNER_MAC)
        .unwrap();
    let mut monitor = {
        let _entered = rt.enter();
        topo.datapath.conflict_monitor().unwrap()
    };

    // The rogue host announces the managed address as its own.
    // (No reply is expected, so arping's exit status says nothing.)
    topo.lan.try_exec(
        "arping",
        &["-U", "-c", "1", "-I", &topo.lan_if, "192.0.2.60"],
    );
    let conflict = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), monitor.next()).await })
        .expect("conflict within 10 s")
        .expect("ring buffer read");
    assert_eq!(conflict.addr, std::net::IpAddr::V4(MANAGED_V4));
    assert_eq!(conflict.foreign_mac, LAN_MAC, "the rogue host's MAC");
    assert_eq!(conflict.owner_mac, OWNER_MAC);

    // The real frame is also in the recent-conflicts map.
    let recent = topo.datapath.recent_conflicts().unwrap();
    assert_eq!(recent.len(), 1, "{recent:?}");
    assert_eq!(
        (
            recent[0].addr,
            recent[0].ifindex,
            recent[0].foreign_mac,
            recent[0].vlan
        ),
        (std::net::IpAddr::V4(MANAGED_V4), ifindex, LAN_MAC, 0)
    );
    assert!(recent[0].count >= 1);
}

#[test]
fn inspect_reads_the_pinned_tables() {
    if !privileged("inspect_reads_the_pinned_tables") {
        return;
    }
    let pin = TestPinRoot::new();
    let mut datapath = responder_datapath(&pin, LOOPBACK_IFINDEX);
    watch_managed_v4(&mut datapath);

    let out = inspect_ok(&["addresses", "--output", "json"], &pin.path);
    let rows: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let rows: Vec<(String, String, String, String)> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let field = |k: &str| r[k].as_str().unwrap().to_owned();
            (
                field("table"),
                field("interface"),
                field("address"),
                field("mac"),
            )
        })
        .collect();
    let lo = || "lo".to_owned();
    assert_eq!(
        rows,
        vec![
            (
                "responder".into(),
                lo(),
                "192.0.2.50".into(),
                "02:00:5e:00:00:bb".into()
            ),
            (
                "responder".into(),
                lo(),
                "2001:db8::50".into(),
                "02:00:5e:00:00:bb".into()
            ),
            (
                "conflict-watch".into(),
                lo(),
                "192.0.2.60".into(),
                "02:00:5e:00:00:02".into()
            ),
        ]
    );

    let out = inspect_ok(&["counters"], &pin.path);
    let table = String::from_utf8_lossy(&out);
    assert!(
        table.contains("arp_request") && table.contains("ANSWERS SENT"),
        "{table}"
    );

    // A pin root without flatnet maps gives an error that says what to do.
    let empty = TestPinRoot::new();
    std::fs::create_dir_all(&empty.path).unwrap();
    let out = inspect(&["addresses"], &empty.path);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is the agent running"));
}

#[test]
fn reattaching_under_traffic_answers_every_request() {
    if !privileged("reattaching_under_traffic_answers_every_request") {
        return;
    }
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const REATTACHES: usize = 20;
    let mut topo = Topology::new(false);
    let ifindex = topo.node_ifindex();
    topo.datapath
        .responders()
        .unwrap()
        .insert(ifindex, OWNED_V4.into(), NODE_MAC)
        .unwrap();
    let request = arp_request_for(OWNED_V4);
    let reattaching = AtomicBool::new(true);
    let sent = AtomicU64::new(0);

    // One thread keeps asking from the LAN for as long as another reloads
    // the datapath and re-attaches, as a restarting or upgraded agent does,
    // switching between netlink and (where the kernel has it) TCX each time.
    thread::scope(|scope| {
        scope.spawn(|| {
            run_in_netns(&topo.lan.path(), || {
                let socket = RawSocket::open(&topo.lan_if).unwrap();
                while reattaching.load(Ordering::SeqCst) {
                    for _ in 0..20 {
                        socket.send(&request).unwrap();
                        sent.fetch_add(1, Ordering::SeqCst);
                    }
                    // Paced so the veth backlog never overflows.
                    thread::sleep(Duration::from_micros(500));
                }
            })
            .unwrap();
        });
        scope.spawn(|| {
            // Stops the sender even when an attach panics.
            struct StopSending<'a>(&'a AtomicBool);
            impl Drop for StopSending<'_> {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::SeqCst);
                }
            }
            let _stop = StopSending(&reattaching);
            for round in 0..REATTACHES {
                // The last round attaches as `topo.datapath` does.
                let odd = round % 2 == 1;
                topo.reload_and_attach_with(if odd {
                    TcAttach::Auto
                } else {
                    TcAttach::Netlink
                });
            }
        });
    });

    let sent = sent.load(Ordering::SeqCst);
    let counters = topo.settled_counters();
    let answered = topo.datapath.responder_stats().unwrap().arp_replies;
    assert_eq!(
        counters.get(FrameKind::ArpRequest).packets,
        sent,
        "every request met a program"
    );
    assert_eq!(answered, sent, "every request was answered");
    topo.assert_one_uplink_program();
}

#[test]
fn test_run_kernel_logs_answers_and_conflicts_as_tracing_events() {
    if !privileged("test_run_kernel_logs_answers_and_conflicts_as_tracing_events") {
        return;
    }
    let rt = runtime();
    let _entered = rt.enter();
    let pin = TestPinRoot::new();
    let logs = support::with_kernel_log_capture(|| {
        let mut datapath = responder_datapath_logging(&pin, LOOPBACK_IFINDEX, true);
        watch_managed_v4(&mut datapath);
        let mut logs = datapath
            .kernel_logs()
            .unwrap()
            .expect("loaded with kernel logs");
        let out = datapath
            .test_run_uplink(&arp_request_for(OWNED_V4), 1)
            .unwrap();
        assert_eq!(out.verdict, REDIRECT);
        datapath
            .test_run_uplink(&gratuitous_arp(ROGUE_MAC, MANAGED_V4), 1)
            .unwrap();
        // A frame that only passes logs nothing.
        datapath
            .test_run_uplink(&arp_request_for(Ipv4Addr::new(192, 0, 2, 99)), 1)
            .unwrap();
        logs.flush();
    });
    let lines: Vec<&str> = logs.lines().collect();
    assert_eq!(lines.len(), 2, "{logs}");
    assert!(
        lines[0].contains("DEBUG")
            && lines[0].contains("flatnet_ebpf")
            && lines[0].contains(
                "answered ARP request for ::ffff:192.0.2.50 from 02:00:5e:00:00:01 on ifindex 1 with 02:00:5e:00:00:bb"
            ),
        "{logs}"
    );
    assert!(
        lines[1].contains("conflict: ::ffff:192.0.2.60 on ifindex 1 claimed by 02:00:5e:00:00:ee, owned by 02:00:5e:00:00:02"),
        "{logs}"
    );

    // Loaded without logging, there is nothing to read.
    let mut quiet = responder_datapath(&TestPinRoot::new(), LOOPBACK_IFINDEX);
    assert!(quiet.kernel_logs().unwrap().is_none());
    assert_eq!(
        quiet
            .test_run_uplink(&arp_request_for(OWNED_V4), 1)
            .unwrap()
            .verdict,
        REDIRECT
    );
}

#[test]
fn test_run_records_recent_conflicts_with_vlan_and_count() {
    if !privileged("test_run_records_recent_conflicts_with_vlan_and_count") {
        return;
    }
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).unwrap();
    watch_managed_v4(&mut datapath);
    // The owner's own announcement is no conflict.
    datapath
        .test_run_uplink(&gratuitous_arp(OWNER_MAC, MANAGED_V4), 1)
        .unwrap();
    assert!(datapath.recent_conflicts().unwrap().is_empty());

    // Three rogue claims, the last one tagged with VLAN 100: one entry,
    // counted three times, even though only the first is reported.
    let rogue = gratuitous_arp(ROGUE_MAC, MANAGED_V4);
    datapath.test_run_uplink(&rogue, 1).unwrap();
    datapath.test_run_uplink(&rogue, 1).unwrap();
    let out = datapath
        .test_run_uplink(&vlan_tagged(&rogue, 0x8100, 100), 1)
        .unwrap();
    assert_eq!(out.verdict, PASS);
    let recent = datapath.recent_conflicts().unwrap();
    assert_eq!(recent.len(), 1, "{recent:?}");
    let entry = recent[0];
    assert_eq!(entry.addr, std::net::IpAddr::V4(MANAGED_V4));
    assert_eq!(entry.ifindex, LOOPBACK_IFINDEX);
    assert_eq!(entry.foreign_mac, ROGUE_MAC);
    assert_eq!(entry.count, 3);
    assert_eq!(entry.vlan, 100);
    assert!(entry.first_seen_ns > 0 && entry.first_seen_ns <= entry.last_seen_ns);
    assert_eq!(
        entry.kind,
        Some(flatnet_common::conflict::ClaimKind::GratuitousArp)
    );

    // `inspect conflicts` and `inspect all` read the pins without the agent.
    let out = inspect_ok(&["conflicts", "-o", "json"], &pin.path);
    let rows: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let row = &rows[0];
    assert_eq!(row["addr"], "192.0.2.60");
    assert_eq!(row["interface"], "lo");
    assert_eq!(row["foreign_mac"], "02:00:5e:00:00:ee");
    assert_eq!(row["vlan"], 100);
    assert_eq!(row["count"], 3);
    assert_eq!(row["kind"], "gratuitous_arp");

    let out = inspect_ok(&["all"], &pin.path);
    let table = String::from_utf8_lossy(&out);
    for expected in [
        "== addresses",
        "conflict-watch",
        "== network policy",
        "allowed_not_isolated",
        "== recent conflicts",
        "02:00:5e:00:00:ee",
    ] {
        assert!(table.contains(expected), "{expected} missing:\n{table}");
    }
    let out = inspect_ok(&["all", "-o", "json"], &pin.path);
    let all: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(all["conflicts"][0]["count"], 3);
    assert_eq!(all["addresses"][0]["table"], "conflict-watch");
    assert!(all["policy"]["stats"].is_object() || all["policy"]["stats"].is_array());
}

// ---------------------------------------------------------------------------
// Pins left by an agent of another version
// ---------------------------------------------------------------------------

/// The kernel id of the map behind each pin under `pin_root`.
fn pinned_map_ids(pin_root: &Path) -> Vec<(&'static str, u32)> {
    PINNED_MAPS
        .iter()
        .map(|&name| {
            let info = MapInfo::from_pin(map_pin_path(pin_root, name))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, info.id())
        })
        .collect()
}

#[test]
fn loading_replaces_a_pinned_map_of_another_layout() {
    if !privileged("loading_replaces_a_pinned_map_of_another_layout") {
        return;
    }
    let pin = TestPinRoot::new();
    let config = DatapathConfig::pinned_at(&pin.path);
    drop(Datapath::load(&config).expect("first load"));
    let before = pinned_map_ids(&pin.path);

    // An older agent's connection-tracking map: same key and capacity, a
    // smaller value. It takes the place of the current one.
    let ct_path = map_pin_path(&pin.path, MAP_POLICY_CT);
    let current = MapInfo::from_pin(&ct_path).unwrap();
    assert!(current.value_size() >= 2, "{current:?}");
    std::fs::remove_file(&ct_path).unwrap();
    let old = MapData::create(
        aya_obj::Map::new_from_params(
            bpf_map_type::BPF_MAP_TYPE_LRU_HASH as u32,
            current.key_size(),
            current.value_size() / 2,
            current.max_entries(),
            current.map_flags(),
        ),
        MAP_POLICY_CT,
        None,
    )
    .expect("create the old map");
    old.pin(&ct_path).expect("pin the old map");
    let old_id = old.info().unwrap().id();

    let mut loaded = None;
    let logs = support::with_log_capture("flatnet_agent=warn", || {
        loaded = Some(Datapath::load(&config).expect("load over the old map"));
    });
    let mut datapath = loaded.unwrap();
    let warning = logs
        .lines()
        .find(|line| line.contains(MAP_POLICY_CT))
        .unwrap_or_else(|| panic!("no warning about {MAP_POLICY_CT}:\n{logs}"));
    for expected in [
        "WARN",
        "tracked flows are judged again by policy",
        &format!("value {} B", current.value_size() / 2),
        &format!("value {} B", current.value_size()),
    ] {
        assert!(warning.contains(expected), "{expected} missing: {warning}");
    }
    assert_eq!(
        logs.lines().count(),
        1,
        "only {MAP_POLICY_CT} replaced:\n{logs}"
    );
    let replaced = MapInfo::from_pin(&ct_path).unwrap();
    assert_ne!(replaced.id(), old_id, "the old map was adopted");
    assert_eq!(replaced.value_size(), current.value_size());
    assert_eq!(replaced.key_size(), current.key_size());
    assert_eq!(replaced.max_entries(), current.max_entries());
    // The programs pass the verifier against the fresh map.
    for direction in [Direction::Ingress, Direction::Egress] {
        datapath
            .test_run_policy(direction, &arp_request_for(OWNED_V4), 1)
            .unwrap_or_else(|e| panic!("{direction:?}: {e}"));
    }
    // Every other map is still the one pinned before.
    let after = pinned_map_ids(&pin.path);
    for ((name, id_before), (_, id_after)) in before.iter().zip(&after) {
        if *name != MAP_POLICY_CT {
            assert_eq!(id_before, id_after, "{name} was replaced");
        }
    }
}

#[test]
fn reloading_adopts_every_pinned_map_with_its_entries() {
    if !privileged("reloading_adopts_every_pinned_map_with_its_entries") {
        return;
    }
    let pin = TestPinRoot::new();
    drop(responder_datapath(&pin, LOOPBACK_IFINDEX));
    let before = pinned_map_ids(&pin.path);

    // Unchanged maps, ring buffers included, are adopted as they are.
    let mut reloaded = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).expect("reload");
    assert_eq!(pinned_map_ids(&pin.path), before);
    // The entry written before the reload still answers.
    let out = reloaded
        .test_run_uplink(&arp_request_for(OWNED_V4), 1)
        .unwrap();
    assert_eq!(out.verdict, REDIRECT);
}

#[test]
fn loading_refuses_a_pin_it_cannot_inspect() {
    if !privileged("loading_refuses_a_pin_it_cannot_inspect") {
        return;
    }
    let pin = TestPinRoot::new();
    let config = DatapathConfig::pinned_at(&pin.path);
    drop(Datapath::load(&config).expect("first load"));
    // Something that is not a map where the connection-tracking map belongs.
    let ct_path = map_pin_path(&pin.path, MAP_POLICY_CT);
    std::fs::remove_file(&ct_path).unwrap();
    std::fs::create_dir(&ct_path).unwrap();

    let error = Datapath::load(&config)
        .err()
        .expect("loading over an unreadable pin fails");
    assert!(
        matches!(
            error,
            DatapathError::InspectPin {
                map: MAP_POLICY_CT,
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("rm "), "{error}");
    assert!(ct_path.is_dir(), "left in place");
}

// ---------------------------------------------------------------------------
// Wire inventory
// ---------------------------------------------------------------------------

/// `(vlan, address, MAC, kind)` of every inventory entry, in map order.
fn inventory(datapath: &Datapath) -> Vec<(u16, std::net::IpAddr, [u8; 6], Option<WireKind>)> {
    datapath
        .wire_claims()
        .unwrap()
        .into_iter()
        .inspect(|e| assert_eq!(e.ifindex, LOOPBACK_IFINDEX))
        .map(|e| (e.vlan, e.addr, e.mac, e.kind))
        .collect()
}

/// `frame` with its Ethernet source replaced, so a test can tell the MAC
/// of a link-layer option from the frame's sender.
fn from_eth(mut frame: Vec<u8>, mac: [u8; 6]) -> Vec<u8> {
    frame[6..12].copy_from_slice(&mac);
    frame
}

#[test]
fn test_run_records_every_claim_kind_in_the_wire_inventory() {
    if !privileged("test_run_records_every_claim_kind_in_the_wire_inventory") {
        return;
    }
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).unwrap();
    let mac = |last: u8| [0x02, 0x00, 0x5e, 0x00, 0x01, last];
    let v4 = |last: u8| Ipv4Addr::new(192, 0, 2, last);
    let v6 = |last: u16| Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, last);
    let gateway = v4(1);
    let frames = [
        // A plain request: its sender fields.
        arp_frame(
            mac(1),
            BROADCAST,
            ArpOperation::REQUEST,
            (mac(1), v4(70)),
            ([0; 6], gateway),
        )
        .unwrap(),
        arp_frame(
            mac(2),
            LAN_MAC,
            ArpOperation::REPLY,
            (mac(2), v4(71)),
            (LAN_MAC, gateway),
        )
        .unwrap(),
        gratuitous_arp(mac(3), v4(72)),
        // A probe (sender 0.0.0.0): its target.
        arp_frame(
            mac(4),
            BROADCAST,
            ArpOperation::REQUEST,
            (mac(4), Ipv4Addr::UNSPECIFIED),
            ([0; 6], v4(73)),
        )
        .unwrap(),
        // Tagged with VLAN 100 on a trunk uplink.
        vlan_tagged(
            &arp_frame(
                mac(5),
                BROADCAST,
                ArpOperation::REQUEST,
                (mac(5), v4(74)),
                ([0; 6], gateway),
            )
            .unwrap(),
            0x8100,
            100,
        ),
        // Solicitation and advertisement: the MAC of their link-layer
        // option, not the frame's Ethernet source.
        from_eth(
            ndp_frame(
                mac(6),
                ipv6_multicast_mac(solicited_node(v6(1))),
                v6(70),
                solicited_node(v6(1)),
                NdpMessage::NeighborSolicitation { target: v6(1) },
            )
            .unwrap(),
            mac(0x66),
        ),
        from_eth(
            ndp_frame(
                mac(7),
                LAN_MAC,
                v6(71),
                "fe80::1".parse().unwrap(),
                NdpMessage::NeighborAdvertisement {
                    target: v6(71),
                    solicited: true,
                    override_flag: true,
                },
            )
            .unwrap(),
            mac(0x77),
        ),
        flatnet_agent::packet::dad_probe_frame(mac(8), v6(72)).unwrap(),
    ];
    for frame in &frames {
        let out = datapath.test_run_uplink(frame, 1).unwrap();
        assert_eq!(out.verdict, PASS, "nothing listed: every frame passes");
    }
    use std::net::IpAddr::{V4, V6};
    let expected = vec![
        (0, V4(v4(70)), mac(1), Some(WireKind::ArpRequest)),
        (0, V4(v4(71)), mac(2), Some(WireKind::ArpReply)),
        (0, V4(v4(72)), mac(3), Some(WireKind::GratuitousArp)),
        (0, V4(v4(73)), mac(4), Some(WireKind::ArpProbe)),
        (0, V6(v6(70)), mac(6), Some(WireKind::NeighborSolicitation)),
        (0, V6(v6(71)), mac(7), Some(WireKind::NeighborAdvertisement)),
        (
            0,
            V6(v6(72)),
            mac(8),
            Some(WireKind::DuplicateAddressDetection),
        ),
        (100, V4(v4(74)), mac(5), Some(WireKind::ArpRequest)),
    ];
    assert_eq!(inventory(&datapath), expected);
    let now = monotonic_ns();
    for entry in datapath.wire_claims().unwrap() {
        assert!(
            entry.last_seen_ns > 0 && entry.last_seen_ns <= now,
            "{entry:?}"
        );
    }

    // Another MAC claiming .70 replaces the first: the last one seen counts.
    let before = datapath.wire_claims().unwrap()[0].last_seen_ns;
    datapath
        .test_run_uplink(&gratuitous_arp(mac(9), v4(70)), 1)
        .unwrap();
    let after = datapath.wire_claims().unwrap()[0];
    assert_eq!(
        (after.addr, after.mac, after.kind),
        (V4(v4(70)), mac(9), Some(WireKind::GratuitousArp))
    );
    assert!(after.last_seen_ns >= before);

    // `inspect wire` reads the pin without the agent.
    let out = inspect_ok(&["wire", "-o", "json"], &pin.path);
    let rows: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), expected.len());
    assert_eq!(rows[0]["address"], "192.0.2.70");
    assert_eq!(rows[0]["mac"], "02:00:5e:00:01:09");
    assert_eq!(rows[0]["kind"], "gratuitous_arp");
    assert_eq!(rows[7]["vlan"], 100);
}

#[test]
fn test_run_never_records_truncated_or_hostile_frames() {
    if !privileged("test_run_never_records_truncated_or_hostile_frames") {
        return;
    }
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).unwrap();
    let rogue_request = |sender_mac: [u8; 6], sender: Ipv4Addr| {
        arp_frame(
            ROGUE_MAC,
            BROADCAST,
            ArpOperation::REQUEST,
            (sender_mac, sender),
            ([0; 6], Ipv4Addr::new(192, 0, 2, 1)),
        )
        .unwrap()
    };
    let good = rogue_request(ROGUE_MAC, Ipv4Addr::new(192, 0, 2, 80));
    let advertisement = ndp_frame(
        ROGUE_MAC,
        LAN_MAC,
        managed_v6(),
        "fe80::1".parse().unwrap(),
        NdpMessage::NeighborAdvertisement {
            target: managed_v6(),
            solicited: true,
            override_flag: true,
        },
    )
    .unwrap();
    // The advertisement's option starts after Ethernet, IPv6 and 24 bytes.
    let option = 14 + 40 + 24;
    let mut zero_length_option = advertisement.clone();
    zero_length_option[option + 1] = 0;
    let mut bad_hardware_length = good.clone();
    bad_hardware_length[14 + 4] = 8;
    let hostile = [
        ("ARP cut in its sender address", good[..14 + 12].to_vec()),
        ("ARP cut before its target", good[..14 + 20].to_vec()),
        (
            "advertisement cut in its option",
            advertisement[..option + 4].to_vec(),
        ),
        (
            "advertisement with a zero-length option",
            zero_length_option,
        ),
        ("ARP with hardware length 8", bad_hardware_length),
        (
            "multicast sender MAC",
            rogue_request([0x01, 0x00, 0x5e, 0, 0, 1], Ipv4Addr::new(192, 0, 2, 81)),
        ),
        (
            "broadcast sender address",
            rogue_request(ROGUE_MAC, Ipv4Addr::BROADCAST),
        ),
        (
            "multicast sender address",
            rogue_request(ROGUE_MAC, Ipv4Addr::new(224, 0, 0, 5)),
        ),
        (
            "link-local IPv6 source",
            ndp_frame(
                ROGUE_MAC,
                ipv6_multicast_mac(solicited_node(managed_v6())),
                "fe80::99".parse().unwrap(),
                solicited_node(managed_v6()),
                NdpMessage::NeighborSolicitation {
                    target: managed_v6(),
                },
            )
            .unwrap(),
        ),
    ];
    for (what, frame) in &hostile {
        let out = datapath.test_run_uplink(frame, 1).unwrap();
        assert_eq!(out.verdict, PASS, "{what} passes on");
        assert_eq!(inventory(&datapath), vec![], "{what} recorded");
    }
    // The same frames whole are recorded, so the cuts above were what kept them out.
    datapath.test_run_uplink(&good, 1).unwrap();
    datapath.test_run_uplink(&advertisement, 1).unwrap();
    assert_eq!(inventory(&datapath).len(), 2);
}

// ---------------------------------------------------------------------------
// Requesters of floating addresses
// ---------------------------------------------------------------------------

/// `(vlan, address asked for, requester, MAC)` of every `RESOLVERS` entry,
/// sorted.
fn resolvers(pin_root: &Path) -> Vec<(u16, IpAddr, IpAddr, [u8; 6])> {
    flatnet_agent::datapath::PinnedMaps::open(pin_root)
        .unwrap()
        .resolvers()
        .unwrap()
        .into_iter()
        .inspect(|e| assert_eq!(e.ifindex, LOOPBACK_IFINDEX))
        .map(|e| (e.vlan, e.addr, e.requester, e.mac))
        .collect()
}

#[test]
fn test_run_records_the_requesters_of_watched_addresses_only() {
    if !privileged("test_run_records_the_requesters_of_watched_addresses_only") {
        return;
    }
    let pin = TestPinRoot::new();
    // The IPv4 address is answered here (this node owns it), the IPv6 one
    // is only watched (a peer owns it): requesters of both are recorded.
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).unwrap();
    datapath
        .responders()
        .unwrap()
        .insert(LOOPBACK_IFINDEX, OWNED_V4.into(), NODE_MAC)
        .unwrap();
    let mut pinned = datapath.pinned_maps().unwrap();
    let mut watch = pinned.resolve_watch().unwrap();
    watch.insert(LOOPBACK_IFINDEX, OWNED_V4.into()).unwrap();
    watch.insert(LOOPBACK_IFINDEX, owned_v6().into()).unwrap();
    assert_eq!(
        watch.entries().unwrap(),
        [
            (LOOPBACK_IFINDEX, IpAddr::from(OWNED_V4)),
            (LOOPBACK_IFINDEX, IpAddr::from(owned_v6()))
        ]
    );
    drop(pinned);

    let mac = |last: u8| [0x02, 0x00, 0x5e, 0x00, 0x02, last];
    let v4 = |last: u8| Ipv4Addr::new(192, 0, 2, last);
    let v6 = |last: u16| Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, last);
    let request = |sender_mac: [u8; 6], sender: Ipv4Addr, target: Ipv4Addr| {
        arp_frame(
            sender_mac,
            BROADCAST,
            ArpOperation::REQUEST,
            (sender_mac, sender),
            ([0; 6], target),
        )
        .unwrap()
    };
    let asked_v4 = request(mac(1), v4(70), OWNED_V4);
    // The MAC of the source link-layer option, not the Ethernet source.
    let asked_v6 = from_eth(
        ndp_frame(
            mac(2),
            ipv6_multicast_mac(solicited_node(owned_v6())),
            v6(70),
            solicited_node(owned_v6()),
            NdpMessage::NeighborSolicitation { target: owned_v6() },
        )
        .unwrap(),
        mac(0x22),
    );
    let tagged = vlan_tagged(&request(mac(3), v4(71), OWNED_V4), 0x8100, 100);
    // Option after Ethernet, IPv6 and the 24 bytes of the solicitation.
    let option = 14 + 40 + 24;
    let mut zero_length_option = asked_v6.clone();
    zero_length_option[option + 1] = 0;
    let ignored = [
        (
            "a request for an unwatched address",
            request(mac(4), v4(72), v4(99)),
        ),
        ("a gratuitous ARP", gratuitous_arp(mac(5), OWNED_V4)),
        (
            "an ARP probe (no requester address)",
            request(mac(6), Ipv4Addr::UNSPECIFIED, OWNED_V4),
        ),
        (
            "a multicast sender MAC",
            request([0x01, 0x00, 0x5e, 0, 0, 1], v4(73), OWNED_V4),
        ),
        (
            "an ARP request cut before its target",
            asked_v4[..14 + 20].to_vec(),
        ),
        (
            "a solicitation cut in its option",
            asked_v6[..option + 4].to_vec(),
        ),
        (
            "a solicitation with a zero-length option",
            zero_length_option,
        ),
        (
            "duplicate address detection",
            flatnet_agent::packet::dad_probe_frame(mac(7), owned_v6()).unwrap(),
        ),
    ];
    for (what, frame) in &ignored {
        datapath.test_run_uplink(frame, 1).unwrap();
        assert_eq!(resolvers(&pin.path), vec![], "{what} recorded");
    }

    let before = monotonic_ns();
    let answered = datapath.test_run_uplink(&asked_v4, 1).unwrap();
    assert_eq!(answered.verdict, REDIRECT, "still answered");
    let passed = datapath.test_run_uplink(&asked_v6, 1).unwrap();
    assert_eq!(passed.verdict, PASS, "not answered here");
    datapath.test_run_uplink(&tagged, 1).unwrap();
    use std::net::IpAddr::{V4, V6};
    assert_eq!(
        resolvers(&pin.path),
        vec![
            (0, V4(OWNED_V4), V4(v4(70)), mac(1)),
            (0, V6(owned_v6()), V6(v6(70)), mac(2)),
            (100, V4(OWNED_V4), V4(v4(71)), mac(3)),
        ]
    );
    let now = monotonic_ns();
    let pinned = datapath.pinned_maps().unwrap();
    for entry in pinned.resolvers().unwrap() {
        assert!(
            (before..=now).contains(&entry.last_seen_ns),
            "{entry:?} outside {before}..={now}"
        );
    }
    drop(pinned);

    // No longer watched: no longer recorded.
    let mut pinned = datapath.pinned_maps().unwrap();
    assert!(
        pinned
            .resolve_watch()
            .unwrap()
            .remove(LOOPBACK_IFINDEX, owned_v6().into())
            .unwrap()
    );
    drop(pinned);
    let mut other = asked_v6.clone();
    // Another requester address (the last byte of the IPv6 source).
    other[14 + 8 + 15] = 71;
    datapath.test_run_uplink(&other, 1).unwrap();
    assert_eq!(resolvers(&pin.path).len(), 3);

    // bpftool shows the key's and value's field names (BTF).
    let map_path = pin.path.join(flatnet_common::pin::MAP_RESOLVERS);
    let dump = support::run(
        "bpftool",
        &["-j", "map", "dump", "pinned", map_path.to_str().unwrap()],
    );
    assert!(
        dump.contains("\"requester\"") && dump.contains("\"last_seen_ns\""),
        "bpftool did not show BTF field names: {dump}"
    );
}

/// An ARP reply from `src` to `dst` claiming `ip` for `src`.
fn arp_reply_between(src: [u8; 6], dst: [u8; 6], ip: Ipv4Addr) -> Vec<u8> {
    arp_frame(
        src,
        dst,
        ArpOperation::REPLY,
        (src, ip),
        (dst, Ipv4Addr::new(192, 0, 2, 1)),
    )
    .unwrap()
}

/// A frame between two of the node's own MACs (a pod answering another
/// pod on the same master: the kernel hands it to the master's receive
/// path without it ever being on the wire) claims nothing: no inventory
/// entry, no conflict. A frame with one end off the node (broadcast, to a
/// LAN host, from a LAN host) still does, whatever MAC it carries.
#[test]
fn test_run_takes_no_claim_from_frames_between_the_nodes_own_macs() {
    if !privileged("test_run_takes_no_claim_from_frames_between_the_nodes_own_macs") {
        return;
    }
    let rt = runtime();
    let _entered = rt.enter();
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).unwrap();
    watch_managed_v4(&mut datapath);
    let mut monitor = datapath.conflict_monitor().unwrap();
    let other_pod: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0x03];
    {
        let mut own = datapath.node_macs().unwrap();
        own.add_pod(OWNER_MAC).unwrap();
        own.add_pod(other_pod).unwrap();
        own.sync_node(&[NODE_MAC].into()).unwrap();
    }
    let v4 = |last: u8| Ipv4Addr::new(192, 0, 2, last);
    for frame in [
        // The managed address's pod answering another pod of the node.
        arp_reply_between(OWNER_MAC, other_pod, MANAGED_V4),
        // Another pod of the node answering it, once claiming its address.
        arp_reply_between(other_pod, OWNER_MAC, v4(80)),
        arp_reply_between(other_pod, OWNER_MAC, MANAGED_V4),
        // A macvlan of the node itself answering a pod.
        arp_reply_between(NODE_MAC, OWNER_MAC, v4(81)),
    ] {
        assert_eq!(datapath.test_run_uplink(&frame, 1).unwrap().verdict, PASS);
    }
    assert_eq!(inventory(&datapath), [], "nothing from within the node");
    assert_eq!(monitor.try_next(), None, "no conflict from within the node");

    // One end off the node: a LAN host answering a pod, a pod's MAC on a
    // broadcast, a pod's MAC answering a LAN host.
    for frame in [
        arp_reply_between(ROGUE_MAC, OWNER_MAC, MANAGED_V4),
        gratuitous_arp(other_pod, v4(82)),
        arp_reply_between(other_pod, LAN_MAC, v4(83)),
    ] {
        datapath.test_run_uplink(&frame, 1).unwrap();
    }
    let conflict = monitor.try_next().expect("the LAN host's claim reported");
    assert_eq!(
        (conflict.foreign_mac, conflict.addr),
        (ROGUE_MAC, IpAddr::V4(MANAGED_V4))
    );
    // A pod gone: its MAC is nobody's on the node any more.
    datapath.node_macs().unwrap().remove_pod(other_pod).unwrap();
    datapath
        .test_run_uplink(&arp_reply_between(other_pod, OWNER_MAC, v4(84)), 1)
        .unwrap();
    let mut seen: Vec<(IpAddr, [u8; 6])> = inventory(&datapath)
        .into_iter()
        .map(|(_, addr, mac, _)| (addr, mac))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            (IpAddr::V4(MANAGED_V4), ROGUE_MAC),
            (IpAddr::V4(v4(82)), other_pod),
            (IpAddr::V4(v4(83)), other_pod),
            (IpAddr::V4(v4(84)), other_pod),
        ]
    );
    assert_eq!(
        datapath.node_macs().unwrap().entries().unwrap(),
        [
            (OWNER_MAC, flatnet_common::node_macs::HOLDER_POD),
            (NODE_MAC, flatnet_common::node_macs::HOLDER_NODE),
        ]
    );
}
