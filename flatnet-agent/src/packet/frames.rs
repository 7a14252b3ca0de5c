//! Ethernet frames for ARP and NDP, built with `etherparse` (checksums included).

use std::net::{Ipv4Addr, Ipv6Addr};

use etherparse::{
    ArpHardwareId, ArpOperation, ArpPacket, EtherType, Icmpv6Type, PacketBuilder,
    icmpv6::NeighborAdvertisementHeader,
};

/// An Ethernet MAC address.
pub type MacAddr = [u8; 6];

/// The Ethernet broadcast address.
pub const BROADCAST: MacAddr = [0xff; 6];

/// NDP option type: source link-layer address (RFC 4861 §4.6.1).
const OPT_SOURCE_LINK_ADDR: u8 = 1;
/// NDP option type: target link-layer address.
const OPT_TARGET_LINK_ADDR: u8 = 2;
/// NDP messages must be sent with hop limit 255 (RFC 4861 §7.1).
const NDP_HOP_LIMIT: u8 = 255;

/// A frame could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The ARP fields were inconsistent.
    #[error("invalid ARP packet: {0}")]
    Arp(String),
    /// Serialising the frame failed.
    #[error("cannot serialise frame: {0}")]
    Build(String),
}

/// An Ethernet + ARP frame.
///
/// Gratuitous ARP is `operation = REQUEST` (or `REPLY`) with
/// `sender_ip == target_ip` and a broadcast destination.
pub fn arp_frame(
    eth_src: MacAddr,
    eth_dst: MacAddr,
    operation: ArpOperation,
    sender: (MacAddr, Ipv4Addr),
    target: (MacAddr, Ipv4Addr),
) -> Result<Vec<u8>, FrameError> {
    let arp = ArpPacket::new(
        ArpHardwareId::ETHERNET,
        EtherType::IPV4,
        operation,
        &sender.0,
        &sender.1.octets(),
        &target.0,
        &target.1.octets(),
    )
    .map_err(|e| FrameError::Arp(e.to_string()))?;
    let builder = PacketBuilder::ethernet2(eth_src, eth_dst).arp(arp);
    let mut frame = Vec::with_capacity(builder.size());
    builder
        .write(&mut frame)
        .map_err(|e| FrameError::Build(e.to_string()))?;
    Ok(frame)
}

/// The NDP messages flatnet sends or recognises.
#[derive(Clone, Copy, Debug)]
pub enum NdpMessage {
    /// Router solicitation (type 133).
    RouterSolicitation,
    /// Router advertisement (type 134), with no options.
    RouterAdvertisement,
    /// Neighbour solicitation (type 135) for `target`.
    NeighborSolicitation { target: Ipv6Addr },
    /// Neighbour advertisement (type 136) for `target`.
    NeighborAdvertisement {
        target: Ipv6Addr,
        solicited: bool,
        override_flag: bool,
    },
    /// Redirect (type 137).
    Redirect {
        target: Ipv6Addr,
        destination: Ipv6Addr,
    },
}

/// An Ethernet + IPv6 + ICMPv6 NDP frame with hop limit 255 and a
/// source/target link-layer address option carrying `eth_src`.
pub fn ndp_frame(
    eth_src: MacAddr,
    eth_dst: MacAddr,
    ip_src: Ipv6Addr,
    ip_dst: Ipv6Addr,
    message: NdpMessage,
) -> Result<Vec<u8>, FrameError> {
    let (icmp_type, payload) = match message {
        NdpMessage::RouterSolicitation => (
            Icmpv6Type::RouterSolicitation,
            link_addr_option(OPT_SOURCE_LINK_ADDR, eth_src).to_vec(),
        ),
        NdpMessage::RouterAdvertisement => (
            Icmpv6Type::RouterAdvertisement(etherparse::icmpv6::RouterAdvertisementHeader {
                cur_hop_limit: 64,
                managed_address_config: false,
                other_config: false,
                router_lifetime: 0,
            }),
            // Reachable time and retransmit timer (both unspecified).
            vec![0; 8],
        ),
        NdpMessage::NeighborSolicitation { target } => (
            Icmpv6Type::NeighborSolicitation,
            [
                &target.octets()[..],
                &link_addr_option(OPT_SOURCE_LINK_ADDR, eth_src),
            ]
            .concat(),
        ),
        NdpMessage::NeighborAdvertisement {
            target,
            solicited,
            override_flag,
        } => (
            Icmpv6Type::NeighborAdvertisement(NeighborAdvertisementHeader {
                router: false,
                solicited,
                r#override: override_flag,
            }),
            [
                &target.octets()[..],
                &link_addr_option(OPT_TARGET_LINK_ADDR, eth_src),
            ]
            .concat(),
        ),
        NdpMessage::Redirect {
            target,
            destination,
        } => (
            Icmpv6Type::Redirect,
            [&target.octets()[..], &destination.octets()[..]].concat(),
        ),
    };
    let builder = PacketBuilder::ethernet2(eth_src, eth_dst)
        .ipv6(ip_src.octets(), ip_dst.octets(), NDP_HOP_LIMIT)
        .icmpv6(icmp_type);
    let mut frame = Vec::with_capacity(builder.size(payload.len()));
    builder
        .write(&mut frame, &payload)
        .map_err(|e| FrameError::Build(e.to_string()))?;
    Ok(frame)
}

/// The Ethernet multicast address of an IPv6 multicast address (RFC 2464 §7).
pub fn ipv6_multicast_mac(addr: Ipv6Addr) -> MacAddr {
    let o = addr.octets();
    [0x33, 0x33, o[12], o[13], o[14], o[15]]
}

/// The solicited-node multicast address of `addr` (RFC 4291 §2.7.1).
pub fn solicited_node(addr: Ipv6Addr) -> Ipv6Addr {
    let o = addr.octets();
    Ipv6Addr::new(
        0xff02,
        0,
        0,
        0,
        0,
        1,
        0xff00 | u16::from(o[13]),
        u16::from_be_bytes([o[14], o[15]]),
    )
}

/// A duplicate-address-detection neighbour solicitation for `target`
/// (RFC 4862 §5.4.2): source `::`, destination the target's solicited-node
/// group, and no source link-layer option, which receivers would reject
/// with an unspecified source.
pub fn dad_probe_frame(eth_src: MacAddr, target: Ipv6Addr) -> Result<Vec<u8>, FrameError> {
    let group = solicited_node(target);
    let builder = PacketBuilder::ethernet2(eth_src, ipv6_multicast_mac(group))
        .ipv6(
            Ipv6Addr::UNSPECIFIED.octets(),
            group.octets(),
            NDP_HOP_LIMIT,
        )
        .icmpv6(Icmpv6Type::NeighborSolicitation);
    let payload = target.octets();
    let mut frame = Vec::with_capacity(builder.size(payload.len()));
    builder
        .write(&mut frame, &payload)
        .map_err(|e| FrameError::Build(e.to_string()))?;
    Ok(frame)
}

fn link_addr_option(kind: u8, mac: MacAddr) -> [u8; 8] {
    // Type, length in units of 8 octets, then the address.
    [kind, 1, mac[0], mac[1], mac[2], mac[3], mac[4], mac[5]]
}

#[cfg(test)]
mod tests {
    use super::*;
    use etherparse::{NetSlice, SlicedPacket, TransportSlice};

    const MAC: MacAddr = [0x02, 0, 0, 0, 0, 1];

    #[test]
    fn gratuitous_arp_has_sender_equal_target() {
        let ip = Ipv4Addr::new(192, 0, 2, 10);
        let frame = arp_frame(
            MAC,
            BROADCAST,
            ArpOperation::REQUEST,
            (MAC, ip),
            ([0; 6], ip),
        )
        .unwrap();
        assert_eq!(frame.len(), 42);
        assert_eq!(&frame[0..6], &BROADCAST);
        assert_eq!(&frame[12..14], &[0x08, 0x06]);
        // Opcode, sender IP and target IP.
        assert_eq!(&frame[20..22], &[0, 1]);
        assert_eq!(&frame[28..32], &ip.octets());
        assert_eq!(&frame[38..42], &ip.octets());
    }

    #[test]
    fn unsolicited_na_is_well_formed() {
        let target: Ipv6Addr = "2001:db8::10".parse().unwrap();
        let all_nodes: Ipv6Addr = "ff02::1".parse().unwrap();
        let frame = ndp_frame(
            MAC,
            ipv6_multicast_mac(all_nodes),
            target,
            all_nodes,
            NdpMessage::NeighborAdvertisement {
                target,
                solicited: false,
                override_flag: true,
            },
        )
        .unwrap();
        let packet = SlicedPacket::from_ethernet(&frame).unwrap();
        let Some(NetSlice::Ipv6(ip)) = packet.net else {
            panic!("not IPv6")
        };
        assert_eq!(ip.header().hop_limit(), 255);
        let Some(TransportSlice::Icmpv6(icmp)) = packet.transport else {
            panic!("not ICMPv6")
        };
        // etherparse verifies nothing on slicing, so check the checksum by recomputing it.
        let expected = icmp
            .icmp_type()
            .calc_checksum(
                ip.header().source(),
                ip.header().destination(),
                icmp.payload(),
            )
            .unwrap();
        assert_eq!(icmp.checksum(), expected);
        match icmp.icmp_type() {
            Icmpv6Type::NeighborAdvertisement(h) => {
                assert!(h.r#override);
                assert!(!h.solicited);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(&icmp.payload()[..16], &target.octets());
        assert_eq!(&icmp.payload()[16..24], &[2, 1, 2, 0, 0, 0, 0, 1]);
        assert_eq!(&frame[0..2], &[0x33, 0x33]);
    }

    #[test]
    fn solicited_node_address() {
        let addr: Ipv6Addr = "2001:db8::1:2345:6789".parse().unwrap();
        assert_eq!(
            solicited_node(addr),
            "ff02::1:ff45:6789".parse::<Ipv6Addr>().unwrap()
        );
    }
}
