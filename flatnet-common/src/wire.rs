//! The wire inventory: who the LAN says holds which address.
//!
//! The uplink program records, for every ARP and neighbour-discovery frame
//! that names an address with a MAC (requests' sender fields, replies,
//! gratuitous ARP, probes, solicitations and advertisements with their
//! link-layer options), the MAC and the time in the pinned LRU map
//! `WIRE_CLAIMS`. The agent reads it to tell the allocator which addresses
//! the LAN still uses. Frames that are truncated or malformed, or that name
//! a multicast MAC or a non-unicast address, never update it.

use crate::{
    conflict::{AddrKey, AddressClaim, ClaimKind},
    responder::{ARP_LEN, IPV6_LEN, NS_LEN},
};

/// Capacity of the inventory; an LRU map, so the claim seen longest ago
/// makes room. 32 Ki entries of 40 bytes (plus the kernel's per-entry
/// overhead) stay under 4 MiB.
pub const WIRE_CLAIMS_MAX_ENTRIES: u32 = 32_768;

/// What an inventory key names. Addresses today; a MAC view (MAC pools)
/// adds [`WireSpace::Mac`] keys of the same type, so both fit one map or
/// two maps of one layout.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireSpace {
    /// `id` holds an IPv6 address or an IPv4-mapped IPv4 address.
    Address = 1,
    /// `id` holds a MAC in its first six bytes, zero after.
    Mac = 2,
}

/// Key of the inventory: what was claimed, on which uplink and VLAN.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WireKey {
    /// Interface index of the uplink the frame arrived on (a VLAN
    /// interface's own index when the program sits on it).
    pub ifindex: u32,
    /// 802.1Q VLAN id of a tagged frame on a trunk uplink; 0 untagged.
    pub vlan: u16,
    /// A [`WireSpace`] value.
    pub space: u8,
    /// Reserved, zero.
    pub reserved: u8,
    /// The address (network byte order, IPv4-mapped) or MAC.
    pub id: [u8; 16],
}

impl WireKey {
    /// The key of `addr` (as in [`AddrKey::addr`]).
    #[inline(always)]
    pub const fn address(ifindex: u32, vlan: u16, addr: [u8; 16]) -> Self {
        Self {
            ifindex,
            vlan,
            space: WireSpace::Address as u8,
            reserved: 0,
            id: addr,
        }
    }
}

/// Value of the inventory: the latest claim.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WireClaim {
    /// The MAC last seen claiming the key's address.
    pub mac: [u8; 6],
    /// The [`WireKind`] of that frame.
    pub kind: u8,
    /// Reserved, zero.
    pub reserved: u8,
    /// `bpf_ktime_get_ns` (`CLOCK_MONOTONIC`) when it was seen.
    pub last_seen_ns: u64,
}

/// How often a repeated claim (same MAC, same frame kind) rewrites its
/// entry: a flood of one host's ARP costs a lookup, not an LRU update, per
/// frame. Far below any window the allocator uses.
pub const WIRE_REFRESH_NS: u64 = 1_000_000_000;

impl WireClaim {
    /// Whether this entry already says what `seen` says, recently enough
    /// that writing `seen` is not worth its cost.
    #[inline(always)]
    pub fn refreshed_by(&self, seen: &WireClaim) -> bool {
        self.mac == seen.mac
            && self.kind == seen.kind
            && seen.last_seen_ns.saturating_sub(self.last_seen_ns) < WIRE_REFRESH_NS
    }
}

/// The frame a claim came in.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireKind {
    /// An ARP request: its sender fields.
    ArpRequest = 1,
    /// An ARP reply: its sender fields.
    ArpReply = 2,
    /// A gratuitous ARP (sender address == target address).
    GratuitousArp = 3,
    /// An ARP probe (RFC 5227, sender 0.0.0.0): its target, about to be taken.
    ArpProbe = 4,
    /// A neighbour solicitation: its source with the source link-layer option.
    NeighborSolicitation = 5,
    /// A neighbour advertisement: its target with the target link-layer option.
    NeighborAdvertisement = 6,
    /// Duplicate address detection (NS from `::`): its target, about to be taken.
    DuplicateAddressDetection = 7,
}

impl WireKind {
    /// From the raw value in the map; `None` for unknown values.
    pub const fn from_u8(value: u8) -> Option<Self> {
        match value {
            1 => Some(Self::ArpRequest),
            2 => Some(Self::ArpReply),
            3 => Some(Self::GratuitousArp),
            4 => Some(Self::ArpProbe),
            5 => Some(Self::NeighborSolicitation),
            6 => Some(Self::NeighborAdvertisement),
            7 => Some(Self::DuplicateAddressDetection),
            _ => None,
        }
    }

    /// The conflict-watch kind of this frame: requests and ordinary
    /// solicitations only use an address, they do not announce it.
    #[inline(always)]
    pub const fn claim(self) -> Option<ClaimKind> {
        match self {
            Self::ArpRequest | Self::NeighborSolicitation => None,
            Self::ArpReply => Some(ClaimKind::ArpReply),
            Self::GratuitousArp => Some(ClaimKind::GratuitousArp),
            Self::ArpProbe => Some(ClaimKind::ArpProbe),
            Self::NeighborAdvertisement => Some(ClaimKind::NeighborAdvertisement),
            Self::DuplicateAddressDetection => Some(ClaimKind::DuplicateAddressDetection),
        }
    }

    /// A stable lower-case name for logs and status.
    pub const fn name(self) -> &'static str {
        match self {
            Self::ArpRequest => "arp_request",
            Self::ArpReply => "arp_reply",
            Self::GratuitousArp => "gratuitous_arp",
            Self::ArpProbe => "arp_probe",
            Self::NeighborSolicitation => "neighbor_solicitation",
            Self::NeighborAdvertisement => "neighbor_advertisement",
            Self::DuplicateAddressDetection => "duplicate_address_detection",
        }
    }
}

/// An address named with a MAC in one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sighting {
    /// The address (IPv4-mapped for IPv4).
    pub addr: [u8; 16],
    /// The MAC it goes with.
    pub mac: [u8; 6],
    /// The frame.
    pub kind: WireKind,
}

impl Sighting {
    /// The conflict-watch claim this sighting makes, if any.
    #[inline(always)]
    pub fn claim(self) -> Option<AddressClaim> {
        self.kind.claim().map(|kind| AddressClaim {
            addr: self.addr,
            mac: self.mac,
            kind,
        })
    }

    /// Whether the inventory records it: a unicast MAC and a unicast,
    /// routable address (no unspecified, loopback, broadcast, multicast or
    /// IPv6 link-local address, which no subnet hands out).
    #[inline(always)]
    pub fn recordable(&self) -> bool {
        let mac_ok = self.mac[0] & 1 == 0 && self.mac != [0; 6];
        let a = &self.addr;
        let v4_mapped = a[..10] == [0; 10] && a[10] == 0xff && a[11] == 0xff;
        let addr_ok = if v4_mapped {
            let first = a[12];
            a[12..] != [0; 4] && a[12..] != [0xff; 4] && first != 127 && first & 0xf0 != 0xe0
        } else {
            let loopback = a[..15] == [0; 15] && a[15] == 1;
            let link_local = a[0] == 0xfe && a[1] & 0xc0 == 0x80;
            *a != [0; 16] && !loopback && a[0] != 0xff && !link_local
        };
        mac_ok && addr_ok
    }
}

/// What an ARP frame says about who holds which address: the sender of
/// requests and replies, the announced address of gratuitous ARP, the
/// target of a probe. `None` for non-Ethernet/IPv4 ARP and for 0.0.0.0.
#[inline(always)]
pub fn arp_sighting(arp: &[u8; ARP_LEN]) -> Option<Sighting> {
    // Ethernet / IPv4 / 6 / 4 only.
    if arp[0] != 0 || arp[1] != 1 || arp[2] != 8 || arp[3] != 0 || arp[4] != 6 || arp[5] != 4 {
        return None;
    }
    let opcode = u16::from_be_bytes([arp[6], arp[7]]);
    let sender_ip = [arp[14], arp[15], arp[16], arp[17]];
    let target_ip = [arp[24], arp[25], arp[26], arp[27]];
    let mac = [arp[8], arp[9], arp[10], arp[11], arp[12], arp[13]];
    let (kind, ip) = match opcode {
        2 => (WireKind::ArpReply, sender_ip),
        1 if sender_ip == target_ip => (WireKind::GratuitousArp, sender_ip),
        1 if sender_ip == [0; 4] => (WireKind::ArpProbe, target_ip),
        1 => (WireKind::ArpRequest, sender_ip),
        _ => return None,
    };
    if ip == [0; 4] {
        return None;
    }
    Some(Sighting {
        addr: AddrKey::v4(0, ip).addr,
        mac,
        kind,
    })
}

/// The payload length an IPv6 header declares.
#[inline(always)]
pub const fn ipv6_payload_len(ip6: &[u8; IPV6_LEN]) -> usize {
    u16::from_be_bytes([ip6[4], ip6[5]]) as usize
}

/// Whether an NDP message of this IPv6 header carries an option after its
/// first [`NS_LEN`] bytes (which must then be readable).
#[inline(always)]
pub const fn ndp_has_option(ip6: &[u8; IPV6_LEN]) -> bool {
    ipv6_payload_len(ip6) >= NS_LEN + 8
}

/// What a neighbour-discovery frame says: advertisements (the target, with
/// the MAC of the target link-layer option, else `eth_src`), solicitations
/// (the source, with the source link-layer option, else `eth_src`) and
/// duplicate address detection (the target, with `eth_src`). `icmp` holds
/// the first [`NS_LEN`] bytes of the message, `option` the 8 after them
/// (zero when [`ndp_has_option`] is false). `None` for invalid NDP (hop
/// limit, code, a payload shorter than the message, a zero-length option).
#[inline(always)]
pub fn ndp_sighting(
    ip6: &[u8; IPV6_LEN],
    icmp: &[u8; NS_LEN],
    option: &[u8; 8],
    eth_src: [u8; 6],
) -> Option<Sighting> {
    // Valid NDP only: hop limit 255, code 0 (RFC 4861 §7.1).
    if ip6[6] != 58 || ip6[7] != 255 || icmp[1] != 0 || ipv6_payload_len(ip6) < NS_LEN {
        return None;
    }
    // A zero-length option makes the whole message invalid (RFC 4861 §4.6).
    if ndp_has_option(ip6) && option[1] == 0 {
        return None;
    }
    let mut target = [0u8; 16];
    target.copy_from_slice(&icmp[8..24]);
    let mut source = [0u8; 16];
    source.copy_from_slice(&ip6[8..24]);
    let option_mac = |wanted: u8| {
        if option[0] == wanted && option[1] == 1 {
            [
                option[2], option[3], option[4], option[5], option[6], option[7],
            ]
        } else {
            eth_src
        }
    };
    match icmp[0] {
        // Target link-layer address option: type 2.
        136 => Some(Sighting {
            addr: target,
            mac: option_mac(2),
            kind: WireKind::NeighborAdvertisement,
        }),
        135 if source == [0; 16] => Some(Sighting {
            addr: target,
            mac: eth_src,
            kind: WireKind::DuplicateAddressDetection,
        }),
        // Source link-layer address option: type 1.
        135 => Some(Sighting {
            addr: source,
            mac: option_mac(1),
            kind: WireKind::NeighborSolicitation,
        }),
        _ => None,
    }
}

#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (4 + 2 + 1 + 1 + 16), every bit pattern valid.
unsafe impl aya::Pod for WireKey {}
#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (6 + 1 + 1 + 8), every bit pattern valid.
unsafe impl aya::Pod for WireClaim {}

/// Raw ARP and NDP headers for the unit tests of this module and of
/// [`crate::conflict`], which reads frames through it.
#[cfg(test)]
pub(crate) mod test_frames {
    use crate::responder::{ARP_LEN, IPV6_LEN, NS_LEN};

    /// The sender MAC of every frame built here.
    pub const MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xee];

    /// An Ethernet/IPv4 ARP header from [`MAC`].
    pub fn arp(opcode: u8, sender_ip: [u8; 4], target_ip: [u8; 4]) -> [u8; ARP_LEN] {
        let mut a = [0u8; ARP_LEN];
        a[..8].copy_from_slice(&[0, 1, 8, 0, 6, 4, 0, opcode]);
        a[8..14].copy_from_slice(&MAC);
        a[14..18].copy_from_slice(&sender_ip);
        a[24..28].copy_from_slice(&target_ip);
        a
    }

    /// A valid NDP message of `icmp_type` from `source` for target
    /// 2001::5: hop limit 255, the payload length of the message alone.
    pub fn ndp(icmp_type: u8, source: [u8; 16]) -> ([u8; IPV6_LEN], [u8; NS_LEN]) {
        let mut ip6 = [0u8; IPV6_LEN];
        ip6[0] = 0x60;
        ip6[5] = NS_LEN as u8;
        ip6[6] = 58;
        ip6[7] = 255;
        ip6[8..24].copy_from_slice(&source);
        let mut icmp = [0u8; NS_LEN];
        icmp[0] = icmp_type;
        icmp[8] = 0x20;
        icmp[9] = 0x01;
        icmp[23] = 5;
        (ip6, icmp)
    }
}

#[cfg(test)]
mod tests {
    use super::{
        test_frames::{MAC, arp, ndp},
        *,
    };

    #[test]
    fn arp_requests_name_their_sender() {
        let sender = [192, 0, 2, 9];
        let s = arp_sighting(&arp(1, sender, [192, 0, 2, 1])).unwrap();
        assert_eq!(s.kind, WireKind::ArpRequest);
        assert_eq!(s.addr, AddrKey::v4(0, sender).addr);
        assert_eq!(s.mac, MAC);
        assert_eq!(s.claim(), None, "a request is no conflict claim");
        assert!(s.recordable());
        let probe = arp_sighting(&arp(1, [0; 4], sender)).unwrap();
        assert_eq!(probe.kind, WireKind::ArpProbe);
        assert_eq!(probe.claim().unwrap().kind, ClaimKind::ArpProbe);
        assert_eq!(arp_sighting(&arp(3, sender, sender)), None, "RARP opcode");
        let mut bad = arp(2, sender, sender);
        bad[4] = 8;
        assert_eq!(arp_sighting(&bad), None, "hardware length 8");
    }

    fn v4(ip: [u8; 4]) -> Sighting {
        Sighting {
            addr: AddrKey::v4(0, ip).addr,
            mac: MAC,
            kind: WireKind::ArpReply,
        }
    }

    #[test]
    fn only_unicast_claims_are_recorded() {
        assert!(v4([10, 1, 2, 3]).recordable());
        for ip in [[255; 4], [127, 0, 0, 1], [224, 0, 0, 1], [239, 1, 1, 1]] {
            assert!(!v4(ip).recordable(), "{ip:?}");
        }
        for mac in [[0; 6], [0xff; 6], [0x01, 0, 0x5e, 0, 0, 1]] {
            assert!(
                !Sighting {
                    mac,
                    ..v4([10, 1, 2, 3])
                }
                .recordable()
            );
        }
        let mut global = [0u8; 16];
        global[..2].copy_from_slice(&[0x20, 0x01]);
        global[15] = 5;
        let six = |addr| Sighting { addr, ..v4([0; 4]) };
        assert!(six(global).recordable());
        let mut link_local = [0u8; 16];
        link_local[..2].copy_from_slice(&[0xfe, 0x80]);
        let mut multicast = [0u8; 16];
        multicast[0] = 0xff;
        let mut loopback = [0u8; 16];
        loopback[15] = 1;
        for addr in [link_local, multicast, loopback, [0; 16]] {
            assert!(!six(addr).recordable(), "{addr:?}");
        }
    }

    /// [`ndp`] whose IPv6 header announces `payload` bytes.
    fn ndp_with_payload(
        icmp_type: u8,
        source: [u8; 16],
        payload: u8,
    ) -> ([u8; IPV6_LEN], [u8; NS_LEN]) {
        let (mut ip6, icmp) = ndp(icmp_type, source);
        ip6[5] = payload;
        (ip6, icmp)
    }

    #[test]
    fn ndp_sightings_take_the_link_layer_options() {
        let mut source = [0u8; 16];
        source[..2].copy_from_slice(&[0x20, 0x01]);
        source[15] = 9;
        let slla = [1, 1, 0x02, 0, 0, 0, 0, 0x55];
        let (ip6, icmp) = ndp_with_payload(135, source, 32);
        let s = ndp_sighting(&ip6, &icmp, &slla, MAC).unwrap();
        assert_eq!((s.kind, s.addr), (WireKind::NeighborSolicitation, source));
        assert_eq!(s.mac, [0x02, 0, 0, 0, 0, 0x55], "MAC from the option");
        assert_eq!(s.claim(), None);
        let tlla = [2, 1, 0x02, 0, 0, 0, 0, 0x77];
        let (ip6, icmp) = ndp_with_payload(136, source, 32);
        let s = ndp_sighting(&ip6, &icmp, &tlla, MAC).unwrap();
        assert_eq!(s.kind, WireKind::NeighborAdvertisement);
        assert_eq!(s.addr[15], 5, "the target");
        assert_eq!(s.mac[5], 0x77);
        let (ip6, icmp) = ndp(135, [0; 16]);
        let s = ndp_sighting(&ip6, &icmp, &[0; 8], MAC).unwrap();
        assert_eq!((s.kind, s.mac), (WireKind::DuplicateAddressDetection, MAC));
    }

    #[test]
    fn malformed_ndp_is_no_sighting() {
        let (ip6, icmp) = ndp_with_payload(136, [0; 16], 20);
        assert_eq!(
            ndp_sighting(&ip6, &icmp, &[0; 8], MAC),
            None,
            "short payload"
        );
        let (ip6, icmp) = ndp_with_payload(136, [0; 16], 32);
        assert_eq!(
            ndp_sighting(&ip6, &icmp, &[2, 0, 1, 2, 3, 4, 5, 6], MAC),
            None,
            "zero-length option"
        );
        let (mut ip6, icmp) = ndp(136, [0; 16]);
        ip6[7] = 64;
        assert_eq!(ndp_sighting(&ip6, &icmp, &[0; 8], MAC), None, "hop limit");
        let (ip6, mut icmp) = ndp(136, [0; 16]);
        icmp[1] = 1;
        assert_eq!(ndp_sighting(&ip6, &icmp, &[0; 8], MAC), None, "code");
    }

    #[test]
    fn a_repeated_claim_rewrites_its_entry_once_per_interval() {
        let entry = WireClaim {
            mac: MAC,
            kind: WireKind::ArpRequest as u8,
            reserved: 0,
            last_seen_ns: 100,
        };
        let later = |ns| WireClaim {
            last_seen_ns: 100 + ns,
            ..entry
        };
        assert!(entry.refreshed_by(&later(WIRE_REFRESH_NS - 1)));
        assert!(!entry.refreshed_by(&later(WIRE_REFRESH_NS)));
        let other_mac = WireClaim {
            mac: [0x02, 0, 0, 0, 0, 1],
            ..later(1)
        };
        assert!(
            !entry.refreshed_by(&other_mac),
            "another MAC is written at once"
        );
        let other_kind = WireClaim {
            kind: WireKind::ArpReply as u8,
            ..later(1)
        };
        assert!(!entry.refreshed_by(&other_kind));
    }

    #[test]
    fn every_kind_round_trips() {
        for raw in 1..=7 {
            assert_eq!(WireKind::from_u8(raw).unwrap() as u8, raw);
        }
        assert_eq!(WireKind::from_u8(0), None);
        assert_eq!(WireKind::from_u8(8), None);
    }

    #[test]
    fn layouts() {
        use core::mem::{align_of, size_of};
        assert_eq!((size_of::<WireKey>(), align_of::<WireKey>()), (24, 4));
        assert_eq!((size_of::<WireClaim>(), align_of::<WireClaim>()), (16, 8));
    }
}
