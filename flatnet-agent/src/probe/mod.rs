//! The ADD-time conflict probe: before a pod's interface comes up, the
//! node asks the LAN whether anyone already uses its addresses (an ARP
//! probe, RFC 5227, for IPv4; a duplicate-address-detection neighbour
//! solicitation, RFC 4862, for IPv6) and listens for an answer from
//! another MAC for as long as the LAN takes to answer ([`wait`]); the
//! probes are sent again halfway through the configured window ([`run`]).

pub mod ahead;
pub mod run;
pub mod wait;

use std::net::{IpAddr, Ipv4Addr};

use etherparse::{ArpOperation, Icmpv6Type, LinkSlice, NetSlice, SlicedPacket, TransportSlice};

use crate::packet::{
    BROADCAST, FrameError, MacAddr, RawSocket, RawSocketError, Receive, arp_frame, dad_probe_frame,
};

/// Another host answered for an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignClaim {
    /// The address.
    pub addr: IpAddr,
    /// The MAC that answered.
    pub mac: MacAddr,
}

/// The probe could not run.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The probe socket failed.
    #[error("probe socket: {0}")]
    Socket(#[from] RawSocketError),
    /// A probe frame could not be built.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The uplink's namespace could not be entered.
    #[error("cannot enter the node's network namespace: {0}")]
    Namespace(String),
}

/// The probe frame for `addr`.
fn probe_frame(own_mac: MacAddr, addr: IpAddr) -> Result<Vec<u8>, FrameError> {
    match addr {
        IpAddr::V4(v4) => arp_frame(
            own_mac,
            BROADCAST,
            ArpOperation::REQUEST,
            (own_mac, Ipv4Addr::UNSPECIFIED),
            ([0; 6], v4),
        ),
        IpAddr::V6(v6) => dad_probe_frame(own_mac, v6),
    }
}

/// An answer claiming one of `addrs` from a MAC other than `own_mac`: an
/// ARP packet whose sender address is one of them, or a neighbour
/// advertisement for one of them.
pub fn parse_answer(frame: &[u8], addrs: &[IpAddr], own_mac: MacAddr) -> Option<ForeignClaim> {
    let packet = SlicedPacket::from_ethernet(frame).ok()?;
    let Some(LinkSlice::Ethernet2(eth)) = &packet.link else {
        return None;
    };
    let source = eth.source();
    if source == own_mac {
        return None;
    }
    let claimed: IpAddr = match (&packet.net, &packet.transport) {
        (Some(NetSlice::Arp(arp)), _) => {
            let sender: [u8; 4] = arp.sender_protocol_addr().try_into().ok()?;
            IpAddr::V4(Ipv4Addr::from(sender))
        }
        (Some(NetSlice::Ipv6(_)), Some(TransportSlice::Icmpv6(icmp)))
            if matches!(icmp.icmp_type(), Icmpv6Type::NeighborAdvertisement(_)) =>
        {
            let target: [u8; 16] = icmp.payload().get(..16)?.try_into().ok()?;
            IpAddr::V6(target.into())
        }
        _ => return None,
    };
    addrs.contains(&claimed).then_some(ForeignClaim {
        addr: claimed,
        mac: source,
    })
}

/// A raw socket on `interface` that sends probes and receives every frame
/// arriving on it, neighbour advertisements to all nodes (the answers to
/// duplicate address detection) included.
fn probe_socket(interface: &str) -> Result<RawSocket, RawSocketError> {
    let socket = RawSocket::open_receiving(interface, Receive::All)?;
    socket.receive_all_multicast()?;
    Ok(socket)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use super::*;
    use crate::packet::{NdpMessage, ndp_frame};

    const OWN: MacAddr = [2, 0, 0, 0, 0, 1];
    const OTHER: MacAddr = [2, 0, 0, 0, 0, 9];

    #[test]
    fn arp_replies_from_other_macs_are_claims() {
        let addr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 5));
        let IpAddr::V4(v4) = addr else { unreachable!() };
        let reply = arp_frame(
            OTHER,
            OWN,
            ArpOperation::REPLY,
            (OTHER, v4),
            (OWN, Ipv4Addr::UNSPECIFIED),
        )
        .unwrap();
        assert_eq!(
            parse_answer(&reply, &[addr], OWN),
            Some(ForeignClaim { addr, mac: OTHER })
        );
        assert_eq!(parse_answer(&reply, &[], OWN), None, "other addresses");
        // Our own probe (sender 0.0.0.0) and frames from our MAC are not claims.
        let own_probe = probe_frame(OWN, addr).unwrap();
        assert_eq!(parse_answer(&own_probe, &[addr], OWN), None);
        assert_eq!(parse_answer(&reply, &[addr], OTHER), None);
    }

    #[test]
    fn neighbour_advertisements_are_claims_and_solicitations_are_not() {
        let target: Ipv6Addr = "2001:db8::5".parse().unwrap();
        let addr = IpAddr::V6(target);
        let advert = ndp_frame(
            OTHER,
            [0x33, 0x33, 0, 0, 0, 1],
            "fe80::9".parse().unwrap(),
            "ff02::1".parse().unwrap(),
            NdpMessage::NeighborAdvertisement {
                target,
                solicited: false,
                override_flag: true,
            },
        )
        .unwrap();
        assert_eq!(
            parse_answer(&advert, &[addr], OWN),
            Some(ForeignClaim { addr, mac: OTHER })
        );
        let dad = dad_probe_frame(OTHER, target).unwrap();
        assert_eq!(parse_answer(&dad, &[addr], OWN), None);
    }

    #[test]
    fn dad_probe_has_unspecified_source_and_no_option() {
        let target: Ipv6Addr = "2001:db8::5".parse().unwrap();
        let frame = dad_probe_frame(OWN, target).unwrap();
        let packet = SlicedPacket::from_ethernet(&frame).unwrap();
        let Some(NetSlice::Ipv6(ip)) = &packet.net else {
            panic!("not IPv6");
        };
        assert_eq!(ip.header().source_addr(), Ipv6Addr::UNSPECIFIED);
        assert_eq!(
            ip.header().destination_addr(),
            "ff02::1:ff00:5".parse::<Ipv6Addr>().unwrap()
        );
        let Some(TransportSlice::Icmpv6(icmp)) = &packet.transport else {
            panic!("not ICMPv6");
        };
        assert_eq!(icmp.payload(), target.octets());
    }
}
