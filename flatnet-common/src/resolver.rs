//! Who on the LAN resolves which floating address.
//!
//! Many hosts ignore broadcast gratuitous ARP, so a node taking over a
//! floating address also tells, by unicast, each host that resolved the
//! address recently. To know them, the uplink program records, for every
//! address listed in `RESOLVE_WATCH` (the floating addresses the node's
//! agent offers, whether it answers for them or stands by), each requester
//! of an ARP request or neighbour solicitation for it: its address, its
//! MAC and when, in the pinned LRU map `RESOLVERS`. Both maps are bounded;
//! a frame for an unwatched address costs one hash lookup, a repeated
//! request at most one rewrite per [`RESOLVER_REFRESH_NS`]. Truncated or
//! malformed frames, probes and duplicate address detection (the requester
//! has no address yet), and multicast or broadcast requesters are never
//! recorded.

use crate::{
    conflict::AddrKey,
    responder::{ARP_LEN, IPV6_LEN, NS_LEN},
    wire::{ipv6_payload_len, ndp_has_option},
};

/// Capacity of `RESOLVERS`; an LRU map, so the requester heard from
/// longest ago makes room. 8 Ki entries of 56 bytes (plus the kernel's
/// per-entry overhead) stay under 1 MiB.
pub const RESOLVERS_MAX_ENTRIES: u32 = 8_192;

/// Capacity of `RESOLVE_WATCH`: the floating addresses one node may offer.
pub const RESOLVE_WATCH_MAX_ENTRIES: u32 = 4_096;

/// The value of a `RESOLVE_WATCH` entry (the key is the address).
pub const WATCHED: u32 = 1;

/// How often a repeated request (same requester, same MAC) rewrites its
/// entry: a flood of one host's requests costs a lookup, not an LRU
/// update, per frame. Far below the window a takeover looks back over.
pub const RESOLVER_REFRESH_NS: u64 = 1_000_000_000;

/// Key of `RESOLVERS`: who asked for which address, on which uplink and VLAN.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResolverKey {
    /// Interface index of the uplink the request arrived on.
    pub ifindex: u32,
    /// 802.1Q VLAN id of a tagged request on a trunk uplink; 0 untagged.
    pub vlan: u16,
    /// Reserved, zero.
    pub reserved: u16,
    /// The address asked for (network byte order, IPv4-mapped).
    pub addr: [u8; 16],
    /// The requester's address (network byte order, IPv4-mapped).
    pub requester: [u8; 16],
}

/// Value of `RESOLVERS`: the requester's MAC and when it last asked.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResolverSeen {
    /// The MAC the requester asked from (ARP sender hardware address, the
    /// NDP source link-layer option, else the Ethernet source).
    pub mac: [u8; 6],
    /// Reserved, zero.
    pub reserved: [u8; 2],
    /// `bpf_ktime_get_ns` (`CLOCK_MONOTONIC`) of the latest request.
    pub last_seen_ns: u64,
}

impl ResolverSeen {
    /// Whether this entry already says what `seen` says, recently enough
    /// that writing `seen` is not worth its cost.
    #[inline(always)]
    pub fn refreshed_by(&self, seen: &ResolverSeen) -> bool {
        self.mac == seen.mac
            && seen.last_seen_ns.saturating_sub(self.last_seen_ns) < RESOLVER_REFRESH_NS
    }
}

/// A host asking for an address: what one request says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resolution {
    /// The address asked for (IPv4-mapped for IPv4).
    pub target: [u8; 16],
    /// The requester's address (IPv4-mapped for IPv4).
    pub requester: [u8; 16],
    /// The requester's MAC, where a reply reaches it.
    pub mac: [u8; 6],
}

impl Resolution {
    /// The `RESOLVE_WATCH` key of the address asked for on `ifindex`.
    #[inline(always)]
    pub const fn watch_key(&self, ifindex: u32) -> AddrKey {
        AddrKey {
            ifindex,
            addr: self.target,
        }
    }
}

/// Whether `mac` can receive a unicast reply.
#[inline(always)]
fn unicast_mac(mac: &[u8; 6]) -> bool {
    mac[0] & 1 == 0 && *mac != [0; 6]
}

/// The requester of an Ethernet/IPv4 ARP request: `None` for replies,
/// gratuitous ARP (sender == target), probes (sender 0.0.0.0), requests
/// from a multicast, broadcast or zero MAC, and non-Ethernet/IPv4 ARP.
#[inline(always)]
pub fn arp_resolution(arp: &[u8; ARP_LEN]) -> Option<Resolution> {
    // Ethernet / IPv4 / 6 / 4, opcode 1 (request).
    if arp[0] != 0
        || arp[1] != 1
        || arp[2] != 8
        || arp[3] != 0
        || arp[4] != 6
        || arp[5] != 4
        || arp[6] != 0
        || arp[7] != 1
    {
        return None;
    }
    let mac = [arp[8], arp[9], arp[10], arp[11], arp[12], arp[13]];
    let sender = [arp[14], arp[15], arp[16], arp[17]];
    let target = [arp[24], arp[25], arp[26], arp[27]];
    if sender == target || sender == [0; 4] || sender == [0xff; 4] || !unicast_mac(&mac) {
        return None;
    }
    Some(Resolution {
        target: AddrKey::v4(0, target).addr,
        requester: AddrKey::v4(0, sender).addr,
        mac,
    })
}

/// The requester of a neighbour solicitation: `icmp` holds the first
/// [`NS_LEN`] bytes of the message, `option` the 8 after them (zero when
/// [`ndp_has_option`] is false); the MAC is the source link-layer option's,
/// else `eth_src`. `None` for other messages, invalid NDP (hop limit, code,
/// a payload shorter than the message, a zero-length option, a multicast
/// target), duplicate address detection (source `::`), a multicast source
/// and a requester MAC that is not unicast.
#[inline(always)]
pub fn ndp_resolution(
    ip6: &[u8; IPV6_LEN],
    icmp: &[u8; NS_LEN],
    option: &[u8; 8],
    eth_src: [u8; 6],
) -> Option<Resolution> {
    if ip6[0] >> 4 != 6
        || ip6[6] != 58
        || ip6[7] != 255
        || icmp[0] != 135
        || icmp[1] != 0
        || ipv6_payload_len(ip6) < NS_LEN
        || icmp[8] == 0xff
        || ip6[8] == 0xff
    {
        return None;
    }
    let has_option = ndp_has_option(ip6);
    if has_option && option[1] == 0 {
        return None;
    }
    let mut requester = [0u8; 16];
    requester.copy_from_slice(&ip6[8..24]);
    if requester == [0; 16] {
        return None;
    }
    let mut target = [0u8; 16];
    target.copy_from_slice(&icmp[8..24]);
    // Source link-layer address option: type 1, one unit of 8 bytes.
    let mac = if has_option && option[0] == 1 && option[1] == 1 {
        [
            option[2], option[3], option[4], option[5], option[6], option[7],
        ]
    } else {
        eth_src
    };
    if !unicast_mac(&mac) {
        return None;
    }
    Some(Resolution {
        target,
        requester,
        mac,
    })
}

#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (4 + 2 + 2 + 16 + 16), every bit pattern valid.
unsafe impl aya::Pod for ResolverKey {}
#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (6 + 2 + 8), every bit pattern valid.
unsafe impl aya::Pod for ResolverSeen {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::test_frames::{MAC, arp, ndp};

    const HOST: [u8; 4] = [192, 0, 2, 9];
    const FLOATING: [u8; 4] = [192, 0, 2, 50];

    #[test]
    fn an_arp_request_names_its_requester() {
        let r = arp_resolution(&arp(1, HOST, FLOATING)).unwrap();
        assert_eq!(r.target, AddrKey::v4(0, FLOATING).addr);
        assert_eq!(r.requester, AddrKey::v4(0, HOST).addr);
        assert_eq!(r.mac, MAC);
        assert_eq!(r.watch_key(7), AddrKey::v4(7, FLOATING));
    }

    #[test]
    fn other_arp_names_no_requester() {
        assert_eq!(arp_resolution(&arp(2, HOST, FLOATING)), None, "reply");
        assert_eq!(arp_resolution(&arp(1, FLOATING, FLOATING)), None, "GARP");
        assert_eq!(arp_resolution(&arp(1, [0; 4], FLOATING)), None, "probe");
        assert_eq!(arp_resolution(&arp(1, [0xff; 4], FLOATING)), None);
        let mut multicast_sender = arp(1, HOST, FLOATING);
        multicast_sender[8] = 0x01;
        assert_eq!(arp_resolution(&multicast_sender), None);
        let mut zero_sender = arp(1, HOST, FLOATING);
        zero_sender[8..14].fill(0);
        assert_eq!(arp_resolution(&zero_sender), None);
        for (at, value) in [(1, 6), (3, 0xdd), (4, 8), (5, 16), (6, 1)] {
            let mut bad = arp(1, HOST, FLOATING);
            bad[at] = value;
            assert_eq!(arp_resolution(&bad), None, "byte {at} = {value}");
        }
    }

    fn global(last: u8) -> [u8; 16] {
        let mut a = [0u8; 16];
        a[..2].copy_from_slice(&[0x20, 0x01]);
        a[15] = last;
        a
    }

    /// A solicitation from 2001::9 for 2001::5 with `payload` bytes.
    fn solicitation(payload: u8) -> ([u8; IPV6_LEN], [u8; NS_LEN]) {
        let (mut ip6, icmp) = ndp(135, global(9));
        ip6[5] = payload;
        (ip6, icmp)
    }

    #[test]
    fn a_solicitation_names_its_requester() {
        let slla = [1, 1, 0x02, 0, 0, 0, 0, 0x55];
        let (ip6, icmp) = solicitation(32);
        let r = ndp_resolution(&ip6, &icmp, &slla, MAC).unwrap();
        assert_eq!((r.target, r.requester), (global(5), global(9)));
        assert_eq!(r.mac, [0x02, 0, 0, 0, 0, 0x55], "from the option");
        let (ip6, icmp) = solicitation(NS_LEN as u8);
        let r = ndp_resolution(&ip6, &icmp, &[0; 8], MAC).unwrap();
        assert_eq!(r.mac, MAC, "without an option: the Ethernet source");
        let mut link_local = [0u8; 16];
        link_local[..2].copy_from_slice(&[0xfe, 0x80]);
        link_local[15] = 9;
        let (mut ip6, icmp) = solicitation(NS_LEN as u8);
        ip6[8..24].copy_from_slice(&link_local);
        assert_eq!(
            ndp_resolution(&ip6, &icmp, &[0; 8], MAC).unwrap().requester,
            link_local,
            "a link-local requester is reachable on the link"
        );
    }

    #[test]
    fn other_ndp_names_no_requester() {
        let none = |ip6: [u8; IPV6_LEN], icmp: [u8; NS_LEN], option: [u8; 8], why: &str| {
            assert_eq!(ndp_resolution(&ip6, &icmp, &option, MAC), None, "{why}");
        };
        let (ip6, icmp) = ndp(136, global(9));
        none(ip6, icmp, [0; 8], "advertisement");
        let (ip6, icmp) = ndp(135, [0; 16]);
        none(ip6, icmp, [0; 8], "duplicate address detection");
        let (mut ip6, icmp) = solicitation(NS_LEN as u8);
        ip6[7] = 64;
        none(ip6, icmp, [0; 8], "hop limit");
        let (ip6, mut icmp) = solicitation(NS_LEN as u8);
        icmp[1] = 1;
        none(ip6, icmp, [0; 8], "code");
        let (ip6, icmp) = solicitation(20);
        none(ip6, icmp, [0; 8], "short payload");
        let (ip6, icmp) = solicitation(32);
        none(ip6, icmp, [1, 0, 2, 0, 0, 0, 0, 1], "zero-length option");
        none(ip6, icmp, [1, 1, 1, 0, 0, 0, 0, 1], "multicast option MAC");
        let (mut ip6, icmp) = solicitation(NS_LEN as u8);
        ip6[8] = 0xff;
        none(ip6, icmp, [0; 8], "multicast source");
        let (ip6, mut icmp) = solicitation(NS_LEN as u8);
        icmp[8] = 0xff;
        none(ip6, icmp, [0; 8], "multicast target");
        let (mut ip6, icmp) = solicitation(NS_LEN as u8);
        ip6[0] = 0x40;
        none(ip6, icmp, [0; 8], "IP version");
        let (ip6, icmp) = solicitation(NS_LEN as u8);
        assert_eq!(ndp_resolution(&ip6, &icmp, &[0; 8], [0xff; 6]), None);
    }

    #[test]
    fn a_repeated_request_rewrites_its_entry_once_per_interval() {
        let entry = ResolverSeen {
            mac: MAC,
            reserved: [0; 2],
            last_seen_ns: 100,
        };
        let later = |ns| ResolverSeen {
            last_seen_ns: 100 + ns,
            ..entry
        };
        assert!(entry.refreshed_by(&later(RESOLVER_REFRESH_NS - 1)));
        assert!(!entry.refreshed_by(&later(RESOLVER_REFRESH_NS)));
        let moved = ResolverSeen {
            mac: [0x02, 0, 0, 0, 0, 1],
            ..later(1)
        };
        assert!(!entry.refreshed_by(&moved), "a new MAC is written at once");
    }

    #[test]
    fn layouts() {
        use core::mem::{align_of, size_of};
        assert_eq!(
            (size_of::<ResolverKey>(), align_of::<ResolverKey>()),
            (40, 4)
        );
        assert_eq!(
            (size_of::<ResolverSeen>(), align_of::<ResolverSeen>()),
            (16, 8)
        );
    }
}
