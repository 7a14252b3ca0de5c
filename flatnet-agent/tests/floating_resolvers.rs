//! Unicast replies on takeover, on the real kernel (root): two nodes
//! running the floating-address loop and a LAN client in their own network
//! namespaces on one bridge (as in `floating_failover`). The client ignores
//! broadcast announcements (gratuitous ARP, unsolicited NA: dropped by its
//! kernel, as many hosts ignore them), resolves the address through the
//! owner, then stays silent. The owner dies; the survivor, whose uplink program recorded the
//! client's request while standing by, takes over and must tell the client
//! by a reply addressed to the client's MAC (captured on the client's
//! interface), which moves the client's neighbour entry to the survivor
//! without the client sending anything. The same on a VLAN: the nodes
//! serve the address on `up0.50` of their trunk `up0` (a pool's
//! `targetNetworkInterface` `up0.50`), the client is on `eth0.50`, every
//! frame between them crosses the bridge tagged.

mod support;

use std::{net::SocketAddr, sync::atomic::Ordering, time::Duration};

use flatnet_agent::{
    datapath::PinnedMaps,
    floating::owner::Event,
    netns::run_in_netns,
    packet::{RawSocket, Receive},
};
use support::{
    TestNetns,
    floating::{
        IPV4, IPV4_VLAN, IPV6, IPV6_VLAN, Node, PORT, Plan, has_vlan_links, kill,
        lan_and_client_of, node, start,
    },
    privileged, wait_until,
};

/// The MAC of `ifname` in `ns`.
fn mac_of(ns: &TestNetns, ifname: &str) -> [u8; 6] {
    let text = ns.exec("cat", &[&format!("/sys/class/net/{ifname}/address")]);
    parse_mac(text.trim())
}

fn parse_mac(text: &str) -> [u8; 6] {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).unwrap_or_else(|_| panic!("MAC {text}")))
        .collect();
    bytes.try_into().unwrap_or_else(|_| panic!("MAC {text}"))
}

/// The MAC the client's neighbour entry for `addr` on `ifname` holds, if
/// any.
fn neighbour_mac(client: &TestNetns, ifname: &str, addr: &str) -> Option<[u8; 6]> {
    let line = client.ip(&["neigh", "show", "to", addr, "dev", ifname]);
    let mut words = line.split_whitespace();
    words.find(|w| *w == "lladdr")?;
    words.next().map(parse_mac)
}

/// Makes the client ignore gratuitous ARP (sender address == target
/// address) and unsolicited neighbour advertisements, as hosts behind an
/// ARP/NA proxy are told to (`drop_gratuitous_arp`,
/// `drop_unsolicited_na`). ARP replies and solicited advertisements pass.
fn ignore_broadcast_announcements(client: &TestNetns, ifname: &str) {
    // sysctl keys write a VLAN link's dot as a slash.
    let key = ifname.replace('.', "/");
    client.sysctl("net.ipv4.conf.all.drop_gratuitous_arp", "1");
    client.sysctl(&format!("net.ipv4.conf.{key}.drop_gratuitous_arp"), "1");
    client.sysctl(&format!("net.ipv6.conf.{key}.drop_unsolicited_na"), "1");
}

/// Whether `frame` tells `client_mac` (at `client_ip`) that `node_mac`
/// holds `floating`, addressed to the client alone: an ARP reply or a
/// solicited, overriding neighbour advertisement.
fn tells_client(
    frame: &[u8],
    client_mac: [u8; 6],
    client_ip: &str,
    node_mac: [u8; 6],
    floating: &str,
) -> bool {
    use etherparse::{
        ArpOperation, ArpPacketSlice, Icmpv6Type, LinkSlice, NetSlice, SlicedPacket, TransportSlice,
    };
    let Ok(packet) = SlicedPacket::from_ethernet(frame) else {
        return false;
    };
    let Some(LinkSlice::Ethernet2(eth)) = &packet.link else {
        return false;
    };
    if eth.destination() != client_mac || eth.source() != node_mac {
        return false;
    }
    match floating.parse::<std::net::IpAddr>().unwrap() {
        std::net::IpAddr::V4(ip) => {
            let Ok(arp) = ArpPacketSlice::from_slice(&frame[14..]) else {
                return false;
            };
            let client: std::net::Ipv4Addr = client_ip.parse().unwrap();
            arp.operation() == ArpOperation::REPLY
                && arp.sender_hw_addr() == node_mac
                && arp.sender_protocol_addr() == ip.octets()
                && arp.target_hw_addr() == client_mac
                && arp.target_protocol_addr() == client.octets()
        }
        std::net::IpAddr::V6(ip) => {
            let (Some(NetSlice::Ipv6(ip6)), Some(TransportSlice::Icmpv6(icmp))) =
                (&packet.net, &packet.transport)
            else {
                return false;
            };
            let Icmpv6Type::NeighborAdvertisement(header) = icmp.icmp_type() else {
                return false;
            };
            ip6.header().destination_addr() == client_ip.parse::<std::net::Ipv6Addr>().unwrap()
                && header.solicited
                && header.r#override
                && icmp.payload().get(..16) == Some(&ip.octets()[..])
        }
    }
}

fn unicast_replies(node: &Node) -> usize {
    node.events
        .lock()
        .unwrap()
        .iter()
        .map(|e| match e {
            Event::Announced {
                unicast_replies, ..
            } => *unicast_replies,
            _ => 0,
        })
        .sum()
}

fn takeover_tells_the_resolving_host(plan: &Plan) {
    let (lan, client) = lan_and_client_of(plan);
    let client_if = plan.client_interface();
    ignore_broadcast_announcements(&client, &client_if);
    let client_mac = mac_of(&client, &client_if);
    let a = node("a", &lan, plan.node_a, plan);
    let b = node("b", &lan, plan.node_b, plan);
    start(&a, b.address);
    start(&b, a.address);
    let target = SocketAddr::new(plan.floating.parse().unwrap(), PORT);
    // Both loops watch the address before the client asks (on a slow
    // machine the first owner may otherwise answer before the second loop
    // started, and a request nobody watched is recorded nowhere).
    for node in [&a, &b] {
        let mut maps = PinnedMaps::open(&node.pin.path).expect("pinned maps");
        wait_until("both loops watch the floating address", || {
            maps.resolve_watch()
                .unwrap()
                .entries()
                .unwrap()
                .iter()
                .any(|(_, addr)| addr.to_string() == plan.floating)
        });
    }

    // The client resolves the address through the owner.
    wait_until("an owner answers", || {
        support::floating::answering(&client, target).is_some()
    });
    let owner_name = support::floating::answering(&client, target).unwrap();
    let (owner, survivor) = if owner_name == "a" {
        (&a, &b)
    } else {
        (&b, &a)
    };
    let (owner_mac, survivor_mac) = (
        mac_of(&owner.ns, &owner.interface),
        mac_of(&survivor.ns, &survivor.interface),
    );
    assert_eq!(
        neighbour_mac(&client, &client_if, plan.floating),
        Some(owner_mac)
    );
    // The standby recorded who asked, in its pinned map.
    let maps = PinnedMaps::open(&survivor.pin.path).expect("the survivor's pinned maps");
    // On a VLAN, the program on the VLAN link sees the request untagged.
    let link_index: u32 = survivor
        .ns
        .exec(
            "cat",
            &[&format!("/sys/class/net/{}/ifindex", survivor.interface)],
        )
        .trim()
        .parse()
        .unwrap();
    wait_until("the standby records the client's request", || {
        maps.resolvers().unwrap().iter().any(|r| {
            r.addr.to_string() == plan.floating
                && r.requester.to_string() == plan.client
                && r.mac == client_mac
                && r.ifindex == link_index
                && r.vlan == 0
        })
    });

    let capture = run_in_netns(&client.path(), || {
        RawSocket::open_receiving(&client_if, Receive::All)
    })
    .unwrap()
    .expect("a packet socket on the client");
    capture.set_receive_buffer(4 << 20).unwrap();
    kill(owner);
    // The client sends nothing: only a frame to it can move its entry.
    wait_until("the client's neighbour entry moves to the survivor", || {
        neighbour_mac(&client, &client_if, plan.floating) == Some(survivor_mac)
    });

    let mut frame = [0u8; 2048];
    let mut told = false;
    // Frames queued since the kill, until the reply (the survivor's
    // heartbeats to the dead node keep arriving: the bridge floods them).
    while !told
        && let Some(received) = capture
            .receive(&mut frame, Duration::from_millis(200))
            .unwrap()
    {
        told = !received.outgoing
            && tells_client(
                &frame[..received.len],
                client_mac,
                plan.client,
                survivor_mac,
                plan.floating,
            );
    }
    assert!(told, "no unicast reply to the client's MAC was captured");
    assert!(unicast_replies(survivor) >= 1);
    // One solicitation can go unanswered while the survivor's loop
    // announces; the first check of the owner waits the same way.
    wait_until("the survivor answers the address", || {
        support::floating::answering(&client, target).as_deref() == Some(survivor.name)
    });
    survivor.stop.store(true, Ordering::Relaxed);
}

#[test]
fn an_ipv4_takeover_tells_the_resolving_host_by_unicast_arp_reply() {
    if !privileged("an_ipv4_takeover_tells_the_resolving_host_by_unicast_arp_reply") {
        return;
    }
    takeover_tells_the_resolving_host(&IPV4);
}

#[test]
fn an_ipv6_takeover_tells_the_resolving_host_by_unicast_advertisement() {
    if !privileged("an_ipv6_takeover_tells_the_resolving_host_by_unicast_advertisement") {
        return;
    }
    takeover_tells_the_resolving_host(&IPV6);
}

#[test]
fn an_ipv4_takeover_on_a_vlan_tells_the_resolving_host_by_unicast_arp_reply() {
    const TEST: &str = "an_ipv4_takeover_on_a_vlan_tells_the_resolving_host_by_unicast_arp_reply";
    if !privileged(TEST) || !has_vlan_links(TEST) {
        return;
    }
    takeover_tells_the_resolving_host(&IPV4_VLAN);
}

#[test]
fn an_ipv6_takeover_on_a_vlan_tells_the_resolving_host_by_unicast_advertisement() {
    const TEST: &str =
        "an_ipv6_takeover_on_a_vlan_tells_the_resolving_host_by_unicast_advertisement";
    if !privileged(TEST) || !has_vlan_links(TEST) {
        return;
    }
    takeover_tells_the_resolving_host(&IPV6_VLAN);
}
