//! An Ethernet frame from the LAN, as the eBPF programs see it, through the
//! pure functions they share with user space (flatnet-common): 802.1Q, ARP,
//! NDP, IPv4, IPv6 extension headers, ICMP flow ports, the requesters of
//! floating addresses and the connection-tracking keys. Properties: the
//! headers read the same as etherparse reads them; a built ARP reply or
//! neighbour advertisement parses back as the claim it makes, with a valid
//! ICMPv6 checksum; a recorded requester asked a question the responder
//! would answer and is the host the wire inventory sees; a
//! flow's reply key is the key of the reversed flow; an ICMP echo reply's
//! flow is the reverse of its request's.
#![no_main]

use flatnet_common::{
    conflict::{AddrKey, AddressClaim, ClaimKind, arp_claim, ndp_claim, vlan_id},
    policy::{
        Direction, Flow, Fragment, icmp_ports, ipv6_ext, is_ipv6_extension, parse_ipv4, parse_ipv6,
        proto,
    },
    resolver::{arp_resolution, ndp_resolution},
    responder::{
        ARP_LEN, IPV6_LEN, NA_LEN, NS_LEN, NdpAnswer, ResponderEntry, arp_question, arp_reply,
        ndp_question, neighbor_advertisement,
    },
};
use libfuzzer_sys::fuzz_target;

const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xbb];
/// More extension headers than any real packet carries; the programs
/// stop earlier too.
const MAX_EXTENSIONS: usize = 8;

fn array<const N: usize>(bytes: &[u8]) -> Option<&[u8; N]> {
    bytes.get(..N)?.try_into().ok()
}

fn arp(l3: &[u8]) {
    let Some(request) = array::<ARP_LEN>(l3) else {
        return;
    };
    let _ = arp_claim(request);
    let resolution = arp_resolution(request);
    let Some(question) = arp_question(request) else {
        assert_eq!(resolution, None, "a requester without a question");
        return;
    };
    if let Some(resolution) = resolution {
        assert_eq!(resolution.target, AddrKey::v4(0, question.target).addr);
        assert_eq!(resolution.mac, question.requester_mac);
        let seen = flatnet_common::wire::arp_sighting(request).expect("a request is a sighting");
        assert_eq!(seen.kind, flatnet_common::wire::WireKind::ArpRequest);
        assert_eq!(seen.addr, resolution.requester);
    }
    let reply = arp_reply(request, NODE_MAC);
    assert_eq!(arp_question(&reply), None, "a reply is no question");
    let parsed =
        etherparse::ArpPacketSlice::from_slice(&reply).expect("etherparse reads the reply");
    assert_eq!(parsed.operation(), etherparse::ArpOperation::REPLY);
    assert_eq!(parsed.sender_hw_addr(), NODE_MAC);
    assert_eq!(parsed.sender_protocol_addr(), question.target);
    assert_eq!(parsed.target_hw_addr(), question.requester_mac);
    let expected = (question.target != [0; 4]).then_some(AddressClaim {
        addr: AddrKey::v4(0, question.target).addr,
        mac: NODE_MAC,
        kind: ClaimKind::ArpReply,
    });
    assert_eq!(arp_claim(&reply), expected);
}

fn ipv6(l3: &[u8], eth_src: [u8; 6]) {
    let Some(header) = array::<IPV6_LEN>(l3) else {
        return;
    };
    let info = parse_ipv6(header);
    match etherparse::Ipv6HeaderSlice::from_slice(l3) {
        Ok(theirs) => {
            let ours = info.expect("etherparse reads an IPv6 header flatnet refuses");
            assert_eq!(ours.src, theirs.source());
            assert_eq!(ours.dst, theirs.destination());
            assert_eq!(ours.next_header, theirs.next_header().0);
        }
        Err(_) => assert!(info.is_none()),
    }
    let Some(info) = info else {
        return;
    };
    // The extension-header walk always moves forward.
    let (mut next, mut at) = (info.next_header, IPV6_LEN);
    for _ in 0..MAX_EXTENSIONS {
        let Some(ext) = l3.get(at..).and_then(array::<8>) else {
            break;
        };
        match ipv6_ext(next, ext) {
            flatnet_common::policy::Ipv6Ext::Upper => {
                assert!(!is_ipv6_extension(next));
                break;
            }
            flatnet_common::policy::Ipv6Ext::Skip { next: n, len } => {
                assert!(len >= 8 && is_ipv6_extension(next));
                (next, at) = (n, at + len);
            }
            flatnet_common::policy::Ipv6Ext::Fragment { next: n, .. } => (next, at) = (n, at + 8),
        }
    }
    let Some(icmp) = l3.get(IPV6_LEN..).and_then(array::<NS_LEN>) else {
        return;
    };
    let option = l3
        .get(IPV6_LEN + NS_LEN..)
        .and_then(array::<8>)
        .copied()
        .unwrap_or([0; 8]);
    let _ = ndp_claim(header, icmp, &option, eth_src);
    // As the program reads it: the option only when the header says there is one.
    let kernel_option = if flatnet_common::wire::ndp_has_option(header) {
        option
    } else {
        [0; 8]
    };
    let truncated = flatnet_common::wire::ndp_has_option(header)
        && l3.get(IPV6_LEN + NS_LEN..).and_then(array::<8>).is_none();
    let resolution = ndp_resolution(header, icmp, &kernel_option, eth_src);
    let Some(question) = ndp_question(header, icmp) else {
        assert_eq!(resolution, None, "a requester without a question");
        return;
    };
    if let (Some(resolution), false) = (resolution, truncated) {
        assert_eq!(resolution.target, question.target);
        assert_eq!(resolution.requester, question.source);
        assert!(!question.is_dad());
        let seen = flatnet_common::wire::ndp_sighting(header, icmp, &kernel_option, eth_src)
            .expect("a solicitation is a sighting");
        assert_eq!(
            seen.kind,
            flatnet_common::wire::WireKind::NeighborSolicitation
        );
        assert_eq!(
            (seen.addr, seen.mac),
            (resolution.requester, resolution.mac)
        );
    }
    for flags in [0, ResponderEntry::FLAG_ROUTER] {
        let entry = ResponderEntry {
            mac: NODE_MAC,
            flags,
            valid_until_ns: 0,
        };
        let mut answer = NdpAnswer::default();
        neighbor_advertisement(&question, &entry, &mut answer);
        let NdpAnswer { ip6, na } = answer;
        let mut packet = ip6.to_vec();
        packet.extend_from_slice(&na);
        let parsed =
            etherparse::SlicedPacket::from_ip(&packet).expect("etherparse reads the advertisement");
        let Some(etherparse::TransportSlice::Icmpv6(message)) = parsed.transport else {
            panic!("the advertisement is no ICMPv6 message");
        };
        let expected_checksum = message
            .icmp_type()
            .calc_checksum(
                ip6[8..24].try_into().unwrap(),
                ip6[24..40].try_into().unwrap(),
                message.payload(),
            )
            .expect("an advertisement has a checksum");
        assert_eq!(message.checksum(), expected_checksum, "ICMPv6 checksum");
        let na_icmp: &[u8; NS_LEN] = na[..NS_LEN].try_into().unwrap();
        let na_option: &[u8; 8] = na[NS_LEN..NA_LEN].try_into().unwrap();
        assert_eq!(
            ndp_claim(&ip6, na_icmp, na_option, [0; 6]),
            Some(AddressClaim {
                addr: question.target,
                mac: NODE_MAC,
                kind: ClaimKind::NeighborAdvertisement
            })
        );
        assert_eq!(
            ndp_question(&ip6, na_icmp),
            None,
            "an advertisement is no question"
        );
    }
}

fn ipv4(l3: &[u8]) {
    let Some(header) = array::<20>(l3) else {
        return;
    };
    let info = parse_ipv4(header);
    if let Ok(theirs) = etherparse::Ipv4HeaderSlice::from_slice(l3) {
        let ours = info.expect("etherparse reads an IPv4 header flatnet refuses");
        assert_eq!(ours.header_len, usize::from(theirs.ihl()) * 4);
        assert_eq!(ours.protocol, theirs.protocol().0);
        assert_eq!(ours.src, flatnet_common::policy::mapped_v4(theirs.source()));
        assert_eq!(
            ours.dst,
            flatnet_common::policy::mapped_v4(theirs.destination())
        );
        let offset = theirs.fragments_offset().value();
        let expected = match (offset, theirs.more_fragments()) {
            (0, false) => Fragment::None,
            (0, true) => Fragment::First {
                id: theirs.identification().into(),
            },
            _ => Fragment::Later {
                id: theirs.identification().into(),
            },
        };
        assert_eq!(ours.fragment, expected);
    }
    let Some(info) = info else {
        return;
    };
    if matches!(info.fragment, Fragment::Later { .. }) {
        return;
    }
    let Some(l4) = l3.get(info.header_len..).and_then(array::<8>) else {
        return;
    };
    let ports = if flatnet_common::policy::has_ports(info.protocol) {
        Some((
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        ))
    } else {
        icmp_ports(info.protocol, l4)
    };
    let Some((src_port, dst_port)) = ports else {
        return;
    };
    let flow = Flow {
        src: info.src,
        dst: info.dst,
        src_port,
        dst_port,
        protocol: info.protocol,
    };
    let reversed = Flow {
        src: flow.dst,
        dst: flow.src,
        src_port: flow.dst_port,
        dst_port: flow.src_port,
        protocol: flow.protocol,
    };
    for direction in [Direction::Ingress, Direction::Egress] {
        assert_eq!(
            flow.reply_ct_key(direction),
            reversed.ct_key(direction.reverse())
        );
        assert_eq!(
            flow.related_ct_key(direction),
            flow.reply_ct_key(direction.reverse())
        );
        assert_eq!(
            reversed.reply_ct_key(direction.reverse()),
            flow.ct_key(direction)
        );
    }
    // The echo reply to a request travels on the request's reversed flow.
    if info.protocol == proto::ICMP && l4[0] == 8 {
        let mut reply = *l4;
        reply[0] = 0;
        let (reply_src, reply_dst) = icmp_ports(proto::ICMP, &reply).expect("ICMP has flow ports");
        assert_eq!((reply_src, reply_dst), (dst_port, src_port));
    }
}

fuzz_target!(|frame: &[u8]| {
    let Some(eth) = array::<14>(frame) else {
        return;
    };
    let eth_src = eth[6..12].try_into().unwrap();
    let mut ethertype = u16::from_be_bytes([eth[12], eth[13]]);
    let mut at = 14;
    if ethertype == 0x8100 {
        let Some(tag) = frame.get(14..).and_then(array::<4>) else {
            return;
        };
        let tci = u16::from_be_bytes([tag[0], tag[1]]);
        let theirs = etherparse::SingleVlanHeaderSlice::from_slice(tag).expect("a 4-byte tag");
        assert_eq!(vlan_id(tci), theirs.vlan_identifier().value());
        ethertype = u16::from_be_bytes([tag[2], tag[3]]);
        at = 18;
    }
    let l3 = &frame[at..];
    match ethertype {
        0x0806 => arp(l3),
        0x86dd => ipv6(l3, eth_src),
        0x0800 => ipv4(l3),
        _ => {}
    }
});
