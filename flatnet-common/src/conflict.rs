//! IP-conflict detection: recognising frames in which a host on the LAN
//! claims (or is about to claim) an address flatnet manages.
//!
//! The uplink program checks every ARP and neighbour-discovery frame from
//! the LAN against the `MANAGED_ADDRS` map and reports a claim made with a
//! MAC other than the owner's through the `CONFLICT_EVENTS` ring buffer.

use crate::{
    responder::{ARP_LEN, IPV6_LEN, NS_LEN},
    wire::{Sighting, arp_sighting, ndp_sighting},
};

/// Kernel-side minimum interval between two reports for one address, so a
/// flood of gratuitous ARP cannot flood the agent.
pub const REPORT_INTERVAL_NS: u64 = 1_000_000_000;

/// Size of the conflict ring buffer in bytes (a power of two, page multiple).
pub const CONFLICT_RING_BYTES: u32 = 64 * 1024;

/// Capacity of the managed-address map.
pub const MANAGED_MAX_ENTRIES: u32 = 65_536;

/// Capacity of the recent-conflicts map; an LRU map, so the address
/// whose conflict was seen longest ago makes room.
pub const RECENT_CONFLICTS_MAX_ENTRIES: u32 = 4_096;

/// The latest conflict on one managed address (value of the pinned
/// `RECENT_CONFLICTS` map, keyed by [`AddrKey`]). Counted for every foreign
/// claim frame, not only the reported ones.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecentConflict {
    /// The MAC of the latest foreign claim.
    pub foreign_mac: [u8; 6],
    /// 802.1Q VLAN id the claim arrived with (0: untagged or on a VLAN
    /// interface, whose ifindex says the VLAN).
    pub vlan: u16,
    /// The latest [`ClaimKind`] value.
    pub kind: u32,
    /// Foreign claim frames seen from `foreign_mac` since `first_seen_ns`.
    pub count: u32,
    /// `bpf_ktime_get_ns` of the first claim by `foreign_mac`.
    pub first_seen_ns: u64,
    /// `bpf_ktime_get_ns` of the latest claim.
    pub last_seen_ns: u64,
}

impl RecentConflict {
    /// The entry after one more foreign claim at `now_ns`: counted on when
    /// the same MAC claims again, started over when another MAC does.
    #[inline(always)]
    pub fn after_claim(
        previous: Option<&RecentConflict>,
        mac: [u8; 6],
        kind: ClaimKind,
        vlan: u16,
        now_ns: u64,
    ) -> Self {
        match previous {
            Some(p) if p.foreign_mac == mac => Self {
                count: p.count.saturating_add(1),
                kind: kind as u32,
                vlan,
                last_seen_ns: now_ns,
                ..*p
            },
            _ => Self {
                foreign_mac: mac,
                vlan,
                kind: kind as u32,
                count: 1,
                first_seen_ns: now_ns,
                last_seen_ns: now_ns,
            },
        }
    }
}

/// An address on one uplink. IPv4 addresses are stored IPv4-mapped
/// (`::ffff:a.b.c.d`) so one map serves both families.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AddrKey {
    /// Interface index of the uplink.
    pub ifindex: u32,
    /// The address, network byte order.
    pub addr: [u8; 16],
}

impl AddrKey {
    /// The key of an IPv4 address.
    #[inline(always)]
    pub const fn v4(ifindex: u32, v4: [u8; 4]) -> Self {
        Self {
            ifindex,
            addr: [
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, v4[0], v4[1], v4[2], v4[3],
            ],
        }
    }

    /// The key of an IPv6 address.
    #[inline(always)]
    pub const fn v6(ifindex: u32, addr: [u8; 16]) -> Self {
        Self { ifindex, addr }
    }
}

/// Who owns a managed address, and when a conflict was last reported.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ManagedAddr {
    /// The MAC the address legitimately answers with.
    pub owner_mac: [u8; 6],
    /// Reserved, zero.
    pub reserved: u16,
    /// `bpf_ktime_get_ns` of the last report (written by the kernel).
    pub last_report_ns: u64,
}

/// What the foreign host did.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClaimKind {
    /// An ARP reply giving its MAC for the address.
    ArpReply = 1,
    /// A gratuitous ARP (sender address == target address) announcing it.
    GratuitousArp = 2,
    /// An ARP probe (RFC 5227, sender 0.0.0.0) for it: about to take it.
    ArpProbe = 3,
    /// A neighbour advertisement for it.
    NeighborAdvertisement = 4,
    /// Duplicate address detection (NS from `::`) for it: about to take it.
    DuplicateAddressDetection = 5,
}

impl ClaimKind {
    /// From the raw value in an event; `None` for unknown values.
    pub const fn from_u32(value: u32) -> Option<Self> {
        match value {
            1 => Some(Self::ArpReply),
            2 => Some(Self::GratuitousArp),
            3 => Some(Self::ArpProbe),
            4 => Some(Self::NeighborAdvertisement),
            5 => Some(Self::DuplicateAddressDetection),
            _ => None,
        }
    }

    /// A stable lower-case name for logs, metrics and Events.
    pub const fn name(self) -> &'static str {
        match self {
            Self::ArpReply => "arp_reply",
            Self::GratuitousArp => "gratuitous_arp",
            Self::ArpProbe => "arp_probe",
            Self::NeighborAdvertisement => "neighbor_advertisement",
            Self::DuplicateAddressDetection => "duplicate_address_detection",
        }
    }
}

/// A claim on an address seen in one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressClaim {
    /// The address claimed (IPv4-mapped for IPv4).
    pub addr: [u8; 16],
    /// The MAC it was claimed with.
    pub mac: [u8; 6],
    /// How.
    pub kind: ClaimKind,
}

/// The record sent to user space for each conflict.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConflictEvent {
    /// `bpf_ktime_get_ns` when the frame was seen.
    pub timestamp_ns: u64,
    /// Uplink the frame arrived on.
    pub ifindex: u32,
    /// A [`ClaimKind`] value.
    pub kind: u32,
    /// The address (IPv4-mapped for IPv4).
    pub addr: [u8; 16],
    /// The MAC of the foreign claim.
    pub foreign_mac: [u8; 6],
    /// The owner's MAC from the managed-address map.
    pub owner_mac: [u8; 6],
    /// Reserved, zero.
    pub reserved: [u8; 4],
}

/// The claim an ARP frame makes, if any: replies, gratuitous announcements
/// and probes. Ordinary requests only ask.
#[inline(always)]
pub fn arp_claim(arp: &[u8; ARP_LEN]) -> Option<AddressClaim> {
    arp_sighting(arp).and_then(Sighting::claim)
}

/// The claim an ICMPv6 frame makes, if any: neighbour advertisements (the
/// MAC from the target link-layer option when present, else `eth_src`) and
/// duplicate address detection solicitations; see [`ndp_sighting`].
#[inline(always)]
pub fn ndp_claim(
    ip6: &[u8; IPV6_LEN],
    icmp: &[u8; NS_LEN],
    option: &[u8; 8],
    eth_src: [u8; 6],
) -> Option<AddressClaim> {
    ndp_sighting(ip6, icmp, option, eth_src).and_then(Sighting::claim)
}

/// Whether a claim by `claimed_mac` on an address owned by `owner_mac`
/// should be reported now, given the last report time.
#[inline(always)]
pub fn should_report(owner: &ManagedAddr, claimed_mac: [u8; 6], now_ns: u64) -> bool {
    claimed_mac != owner.owner_mac
        && (owner.last_report_ns == 0
            || now_ns.saturating_sub(owner.last_report_ns) >= REPORT_INTERVAL_NS)
}

/// The 802.1Q VLAN id in a tag control field.
#[inline(always)]
pub const fn vlan_id(tci: u16) -> u16 {
    tci & 0x0fff
}

#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (4 + 16), every bit pattern valid.
unsafe impl aya::Pod for AddrKey {}
#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (6 + 2 + 8), every bit pattern valid.
unsafe impl aya::Pod for ManagedAddr {}
#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (8 + 4 + 4 + 16 + 6 + 6 + 4), every bit pattern valid.
unsafe impl aya::Pod for ConflictEvent {}
#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (6 + 2 + 4 + 4 + 8 + 8), every bit pattern valid.
unsafe impl aya::Pod for RecentConflict {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::test_frames::{MAC as FOREIGN, arp, ndp};

    const OWNER: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

    #[test]
    fn arp_claims() {
        let ip = [192, 0, 2, 5];
        let mapped = AddrKey::v4(0, ip).addr;
        assert_eq!(
            arp_claim(&arp(2, ip, [192, 0, 2, 1])),
            Some(AddressClaim {
                addr: mapped,
                mac: FOREIGN,
                kind: ClaimKind::ArpReply
            })
        );
        assert_eq!(
            arp_claim(&arp(1, ip, ip)).unwrap().kind,
            ClaimKind::GratuitousArp
        );
        let probe = arp_claim(&arp(1, [0; 4], ip)).unwrap();
        assert_eq!((probe.kind, probe.addr), (ClaimKind::ArpProbe, mapped));
        assert_eq!(
            arp_claim(&arp(1, [192, 0, 2, 9], ip)),
            None,
            "a plain request claims nothing"
        );
        assert_eq!(
            arp_claim(&arp(2, [0; 4], ip)),
            None,
            "0.0.0.0 is never claimed"
        );
    }

    #[test]
    fn ndp_claims() {
        let link_local = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];
        let tlla = [2, 1, 0x02, 0, 0, 0, 0, 0x77];
        let (ip6, icmp) = ndp(136, link_local);
        let claim = ndp_claim(&ip6, &icmp, &tlla, FOREIGN).unwrap();
        assert_eq!(claim.kind, ClaimKind::NeighborAdvertisement);
        assert_eq!(claim.mac, [0x02, 0, 0, 0, 0, 0x77], "MAC from the option");
        assert_eq!(
            ndp_claim(&ip6, &icmp, &[0; 8], FOREIGN).unwrap().mac,
            FOREIGN
        );
        let (ip6, icmp) = ndp(135, [0; 16]);
        assert_eq!(
            ndp_claim(&ip6, &icmp, &[0; 8], FOREIGN).unwrap().kind,
            ClaimKind::DuplicateAddressDetection
        );
        let (ip6, icmp) = ndp(135, link_local);
        assert_eq!(
            ndp_claim(&ip6, &icmp, &[0; 8], FOREIGN),
            None,
            "an ordinary solicitation"
        );
        let (mut ip6, icmp) = ndp(136, link_local);
        ip6[7] = 64;
        assert_eq!(
            ndp_claim(&ip6, &icmp, &tlla, FOREIGN),
            None,
            "hop limit must be 255"
        );
    }

    #[test]
    fn reports_foreign_claims_at_most_once_per_interval() {
        let mut owner = ManagedAddr {
            owner_mac: OWNER,
            reserved: 0,
            last_report_ns: 0,
        };
        assert!(!should_report(&owner, OWNER, 5), "the owner itself");
        assert!(should_report(&owner, FOREIGN, 5));
        owner.last_report_ns = 10;
        assert!(!should_report(&owner, FOREIGN, 10 + REPORT_INTERVAL_NS - 1));
        assert!(should_report(&owner, FOREIGN, 10 + REPORT_INTERVAL_NS));
    }

    #[test]
    fn recent_conflicts_count_per_foreign_mac() {
        let first = RecentConflict::after_claim(None, FOREIGN, ClaimKind::ArpReply, 0, 10);
        assert_eq!(
            (first.count, first.first_seen_ns, first.last_seen_ns),
            (1, 10, 10)
        );
        let again =
            RecentConflict::after_claim(Some(&first), FOREIGN, ClaimKind::GratuitousArp, 7, 25);
        assert_eq!(
            (
                again.count,
                again.first_seen_ns,
                again.last_seen_ns,
                again.vlan
            ),
            (2, 10, 25, 7)
        );
        assert_eq!(again.kind, ClaimKind::GratuitousArp as u32);
        let other_mac = [0x02, 0, 0, 0, 0, 0x33];
        let other =
            RecentConflict::after_claim(Some(&again), other_mac, ClaimKind::ArpProbe, 0, 40);
        assert_eq!(
            (other.foreign_mac, other.count, other.first_seen_ns),
            (other_mac, 1, 40),
            "another MAC starts over"
        );
        let saturated = RecentConflict {
            count: u32::MAX,
            ..again
        };
        assert_eq!(
            RecentConflict::after_claim(Some(&saturated), FOREIGN, ClaimKind::ArpReply, 0, 50)
                .count,
            u32::MAX
        );
        assert_eq!(vlan_id(0xe064), 100, "priority bits are not the VLAN");
    }

    #[test]
    fn layouts() {
        use core::mem::{align_of, size_of};
        assert_eq!((size_of::<AddrKey>(), align_of::<AddrKey>()), (20, 4));
        assert_eq!(
            (size_of::<ManagedAddr>(), align_of::<ManagedAddr>()),
            (16, 8)
        );
        assert_eq!(
            (size_of::<ConflictEvent>(), align_of::<ConflictEvent>()),
            (48, 8)
        );
        assert_eq!(
            (size_of::<RecentConflict>(), align_of::<RecentConflict>()),
            (32, 8)
        );
    }
}
