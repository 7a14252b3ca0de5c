//! The LAN hosts a node tells by unicast when it takes a floating address
//! over: those its uplink program saw resolving the address within
//! [`RESOLVER_WINDOW`] (`RESOLVERS`, see `flatnet_common::resolver`), each
//! sent an ARP reply (IPv4) or a solicited, overriding neighbour
//! advertisement (IPv6) addressed to its MAC. Many hosts ignore broadcast
//! gratuitous ARP; a reply to the address a host asked for is processed.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use etherparse::ArpOperation;

use crate::{
    datapath::ResolverEntry,
    packet::{MacAddr, NdpMessage, arp_frame, ndp_frame},
};

/// How far back a takeover looks for hosts that resolved the address.
/// Linux keeps an unused entry `STALE` for `gc_stale_time` (60 s) and
/// longer while the table is small; five minutes covers that with room. A
/// host that asked longer ago either dropped its entry (it resolves afresh
/// and the new owner answers) or kept it confirmed by traffic without
/// asking again by broadcast (long TCP flows): that host is not told and
/// recovers by its own neighbour probing, as without this.
pub const RESOLVER_WINDOW: Duration = Duration::from_secs(300);

/// At most this many hosts per address are told in one takeover, those
/// heard from last first: the frames go out in every announcement round,
/// so a LAN flooding spoofed requests cannot make a takeover send more
/// than this many per round.
pub const MAX_TOLD_PER_ADDRESS: usize = 256;

/// A host to tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resolver {
    /// Its address: the reply's destination.
    pub requester: IpAddr,
    /// Its MAC: the frame's destination.
    pub mac: MacAddr,
}

/// The hosts to tell that `link_mac` now answers for `addr` on uplink
/// `ifindex`: untagged requesters of the address's family seen within
/// [`RESOLVER_WINDOW`] before `now_ns`, not the node itself, heard from
/// last first, at most [`MAX_TOLD_PER_ADDRESS`].
pub fn recent_resolvers(
    entries: &[ResolverEntry],
    ifindex: u32,
    addr: IpAddr,
    link_mac: MacAddr,
    now_ns: u64,
) -> Vec<Resolver> {
    let mut recent: Vec<&ResolverEntry> = entries
        .iter()
        .filter(|e| {
            e.ifindex == ifindex
                && e.vlan == 0
                && e.addr == addr
                && e.requester.is_ipv4() == addr.is_ipv4()
                && e.mac != link_mac
                && e.age(now_ns) <= RESOLVER_WINDOW
        })
        .collect();
    recent.sort_by_key(|e| std::cmp::Reverse(e.last_seen_ns));
    recent
        .into_iter()
        .take(MAX_TOLD_PER_ADDRESS)
        .map(|e| Resolver {
            requester: e.requester,
            mac: e.mac,
        })
        .collect()
}

/// One frame per host in `told` saying `link_mac` holds `addr`: an ARP
/// reply for IPv4, a solicited neighbour advertisement with the override
/// flag for IPv6, both addressed to the host's MAC and address.
pub fn unicast_reply_frames(link_mac: MacAddr, addr: IpAddr, told: &[Resolver]) -> Vec<Vec<u8>> {
    told.iter()
        .filter_map(|host| match (addr, host.requester) {
            (IpAddr::V4(ip), IpAddr::V4(requester)) => {
                Some(arp_reply(link_mac, ip, host.mac, requester))
            }
            (IpAddr::V6(ip), IpAddr::V6(requester)) => Some(ndp_frame(
                link_mac,
                host.mac,
                ip,
                requester,
                NdpMessage::NeighborAdvertisement {
                    target: ip,
                    solicited: true,
                    override_flag: true,
                },
            )),
            _ => None,
        })
        .map(|frame| frame.expect("fixed-size ARP and NDP frames always build"))
        .collect()
}

fn arp_reply(
    link_mac: MacAddr,
    ip: Ipv4Addr,
    host_mac: MacAddr,
    host: Ipv4Addr,
) -> Result<Vec<u8>, crate::packet::FrameError> {
    arp_frame(
        link_mac,
        host_mac,
        ArpOperation::REPLY,
        (link_mac, ip),
        (host_mac, host),
    )
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use etherparse::{
        ArpPacketSlice, Icmpv6Type, LinkSlice, NetSlice, SlicedPacket, TransportSlice,
    };

    use super::*;

    fn v6(addr: &str) -> Ipv6Addr {
        addr.parse().unwrap()
    }

    const LINK: MacAddr = [0x02, 0, 0, 0, 0, 0xbb];
    const HOST: MacAddr = [0x02, 0, 0, 0, 0, 0x01];
    const SECOND: u64 = 1_000_000_000;
    const NOW: u64 = 1_000 * SECOND;

    fn entry(addr: &str, requester: &str, mac: MacAddr, seen_s_ago: u64) -> ResolverEntry {
        ResolverEntry {
            ifindex: 4,
            vlan: 0,
            addr: addr.parse().unwrap(),
            requester: requester.parse().unwrap(),
            mac,
            last_seen_ns: NOW - seen_s_ago * SECOND,
        }
    }

    fn told(entries: &[ResolverEntry], addr: &str) -> Vec<String> {
        recent_resolvers(entries, 4, addr.parse().unwrap(), LINK, NOW)
            .iter()
            .map(|r| r.requester.to_string())
            .collect()
    }

    #[test]
    fn hosts_heard_within_the_window_are_told_latest_first() {
        let window = RESOLVER_WINDOW.as_secs();
        let entries = [
            entry("10.0.0.50", "10.0.0.7", HOST, 30),
            entry("10.0.0.50", "10.0.0.8", HOST, 2),
            entry("10.0.0.50", "10.0.0.9", HOST, window),
            entry("10.0.0.50", "10.0.0.10", HOST, window + 1),
        ];
        assert_eq!(
            told(&entries, "10.0.0.50"),
            ["10.0.0.8", "10.0.0.7", "10.0.0.9"]
        );
    }

    #[test]
    fn only_requests_for_the_address_on_its_uplink_untagged_count() {
        let mut other_uplink = entry("10.0.0.50", "10.0.0.7", HOST, 1);
        other_uplink.ifindex = 5;
        let mut tagged = entry("10.0.0.50", "10.0.0.8", HOST, 1);
        tagged.vlan = 50;
        let entries = [
            other_uplink,
            tagged,
            entry("10.0.0.51", "10.0.0.9", HOST, 1),
            entry("10.0.0.50", "10.0.0.2", LINK, 1),
            entry("10.0.0.50", "fd00::9", HOST, 1),
            entry("fd00::50", "fd00::9", HOST, 1),
            entry("fd00::50", "10.0.0.9", HOST, 1),
        ];
        assert!(told(&entries, "10.0.0.50").is_empty(), "none of them");
        assert_eq!(told(&entries, "fd00::50"), ["fd00::9"]);
    }

    #[test]
    fn a_flood_of_requesters_is_cut_to_the_latest() {
        let entries: Vec<ResolverEntry> = (0..2 * MAX_TOLD_PER_ADDRESS as u64)
            .map(|i| ResolverEntry {
                requester: IpAddr::V6(Ipv6Addr::from(0xfd00_u128 << 112 | u128::from(i))),
                last_seen_ns: NOW - 2 * MAX_TOLD_PER_ADDRESS as u64 + i,
                ..entry("fd00::50", "fd00::1", HOST, 0)
            })
            .collect();
        let told = recent_resolvers(&entries, 4, "fd00::50".parse().unwrap(), LINK, NOW);
        assert_eq!(told.len(), MAX_TOLD_PER_ADDRESS);
        let newest = entries.last().unwrap().requester;
        assert_eq!(told[0].requester, newest);
        assert!(!told.iter().any(|r| r.requester == entries[0].requester));
    }

    #[test]
    fn an_arp_reply_goes_to_the_host_saying_the_link_holds_the_address() {
        let host = Resolver {
            requester: "10.0.0.7".parse().unwrap(),
            mac: HOST,
        };
        let frames = unicast_reply_frames(LINK, "10.0.0.50".parse().unwrap(), &[host]);
        assert_eq!(frames.len(), 1);
        let packet = SlicedPacket::from_ethernet(&frames[0]).unwrap();
        let Some(LinkSlice::Ethernet2(eth)) = packet.link else {
            panic!("not Ethernet")
        };
        assert_eq!((eth.destination(), eth.source()), (HOST, LINK));
        let arp = ArpPacketSlice::from_slice(&frames[0][14..]).unwrap();
        assert_eq!(arp.operation(), ArpOperation::REPLY);
        assert_eq!(arp.sender_hw_addr(), LINK);
        assert_eq!(arp.sender_protocol_addr(), [10, 0, 0, 50]);
        assert_eq!(arp.target_hw_addr(), HOST);
        assert_eq!(arp.target_protocol_addr(), [10, 0, 0, 7]);
    }

    #[test]
    fn a_neighbour_advertisement_goes_to_the_host_solicited_and_overriding() {
        let host = Resolver {
            requester: IpAddr::V6(v6("fd00::9")),
            mac: HOST,
        };
        let frames = unicast_reply_frames(LINK, IpAddr::V6(v6("fd00::50")), &[host]);
        let packet = SlicedPacket::from_ethernet(&frames[0]).unwrap();
        let Some(LinkSlice::Ethernet2(eth)) = packet.link else {
            panic!("not Ethernet")
        };
        assert_eq!((eth.destination(), eth.source()), (HOST, LINK));
        let Some(NetSlice::Ipv6(ip)) = packet.net else {
            panic!("not IPv6")
        };
        assert_eq!(ip.header().source_addr(), v6("fd00::50"));
        assert_eq!(ip.header().destination_addr(), v6("fd00::9"));
        assert_eq!(ip.header().hop_limit(), 255);
        let Some(TransportSlice::Icmpv6(icmp)) = packet.transport else {
            panic!("not ICMPv6")
        };
        let Icmpv6Type::NeighborAdvertisement(header) = icmp.icmp_type() else {
            panic!("not an advertisement")
        };
        assert!(header.solicited && header.r#override && !header.router);
        let payload = icmp.payload();
        assert_eq!(&payload[..16], &v6("fd00::50").octets());
        assert_eq!(&payload[16..], &[2, 1, 2, 0, 0, 0, 0, 0xbb], "target MAC");
    }

    #[test]
    fn a_host_of_the_other_family_gets_nothing() {
        let host = Resolver {
            requester: "10.0.0.7".parse().unwrap(),
            mac: HOST,
        };
        assert!(unicast_reply_frames(LINK, IpAddr::V6(v6("fd00::50")), &[host]).is_empty());
    }
}
