//! The agent's frame builders (gratuitous ARP, neighbour advertisements and
//! solicitations, DAD probes) with arbitrary addresses. Property: every
//! frame the agent sends parses, with the programs' own parsers, as the
//! claim or question it is meant to be.
#![no_main]

use std::net::{Ipv4Addr, Ipv6Addr};

use arbitrary::Arbitrary;
use flatnet_agent::packet::{
    NdpMessage, arp_frame, dad_probe_frame, ipv6_multicast_mac, ndp_frame, solicited_node,
};
use flatnet_common::{
    conflict::{AddrKey, AddressClaim, ClaimKind, arp_claim, ndp_claim},
    responder::{ARP_LEN, IPV6_LEN, NS_LEN, arp_question, ndp_question},
};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Fields {
    eth_src: [u8; 6],
    eth_dst: [u8; 6],
    reply: bool,
    sender: ([u8; 6], [u8; 4]),
    target: ([u8; 6], [u8; 4]),
    ip6_src: [u8; 16],
    ip6_dst: [u8; 16],
    target6: [u8; 16],
    solicited: bool,
    override_flag: bool,
}

/// The IPv6 header, the first ICMPv6 bytes and the option after them.
fn ndp_parts(frame: &[u8]) -> (&[u8; IPV6_LEN], &[u8; NS_LEN], [u8; 8]) {
    let ip6 = frame[14..14 + IPV6_LEN].try_into().expect("an IPv6 header");
    let icmp = frame[54..54 + NS_LEN].try_into().expect("an NDP message");
    let option = frame
        .get(78..86)
        .map_or([0; 8], |o| o.try_into().expect("8 bytes"));
    (ip6, icmp, option)
}

fuzz_target!(|f: Fields| {
    let operation = if f.reply {
        etherparse::ArpOperation::REPLY
    } else {
        etherparse::ArpOperation::REQUEST
    };
    let frame = arp_frame(
        f.eth_src,
        f.eth_dst,
        operation,
        (f.sender.0, Ipv4Addr::from(f.sender.1)),
        (f.target.0, Ipv4Addr::from(f.target.1)),
    )
    .expect("an Ethernet ARP frame builds");
    let arp: &[u8; ARP_LEN] = frame[14..14 + ARP_LEN].try_into().expect("an ARP body");
    let (kind, ip) = match (f.reply, f.sender.1 == f.target.1, f.sender.1 == [0; 4]) {
        (true, _, _) => (Some(ClaimKind::ArpReply), f.sender.1),
        (false, true, _) => (Some(ClaimKind::GratuitousArp), f.sender.1),
        (false, false, true) => (Some(ClaimKind::ArpProbe), f.target.1),
        (false, false, false) => (None, f.sender.1),
    };
    let expected = kind.filter(|_| ip != [0; 4]).map(|kind| AddressClaim {
        addr: AddrKey::v4(0, ip).addr,
        mac: f.sender.0,
        kind,
    });
    assert_eq!(arp_claim(arp), expected);
    let question = arp_question(arp);
    assert_eq!(question.is_some(), !f.reply && f.sender.1 != f.target.1);

    let target = Ipv6Addr::from(f.target6);
    let advertisement = ndp_frame(
        f.eth_src,
        f.eth_dst,
        Ipv6Addr::from(f.ip6_src),
        Ipv6Addr::from(f.ip6_dst),
        NdpMessage::NeighborAdvertisement {
            target,
            solicited: f.solicited,
            override_flag: f.override_flag,
        },
    )
    .expect("an advertisement builds");
    let (ip6, icmp, option) = ndp_parts(&advertisement);
    assert_eq!(
        ndp_claim(ip6, icmp, &option, [0; 6]),
        Some(AddressClaim {
            addr: f.target6,
            mac: f.eth_src,
            kind: ClaimKind::NeighborAdvertisement
        })
    );

    let solicitation = ndp_frame(
        f.eth_src,
        f.eth_dst,
        Ipv6Addr::from(f.ip6_src),
        Ipv6Addr::from(f.ip6_dst),
        NdpMessage::NeighborSolicitation { target },
    )
    .expect("a solicitation builds");
    let (ip6, icmp, _) = ndp_parts(&solicitation);
    let question = ndp_question(ip6, icmp);
    if target.is_multicast() {
        assert_eq!(question, None, "a multicast target is no question");
    } else {
        let question = question.expect("a solicitation is a question");
        assert_eq!((question.target, question.source), (f.target6, f.ip6_src));
    }

    let probe = dad_probe_frame(f.eth_src, target).expect("a DAD probe builds");
    assert_eq!(probe[..6], ipv6_multicast_mac(solicited_node(target)));
    let (ip6, icmp, option) = ndp_parts(&probe);
    assert_eq!(
        ndp_claim(ip6, icmp, &option, f.eth_src),
        Some(AddressClaim {
            addr: f.target6,
            mac: f.eth_src,
            kind: ClaimKind::DuplicateAddressDetection
        })
    );
    if !target.is_multicast() {
        assert!(
            ndp_question(ip6, icmp)
                .expect("a probe is a question")
                .is_dad()
        );
    }
});
