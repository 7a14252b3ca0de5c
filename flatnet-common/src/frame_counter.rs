//! Per-kind counters of the ARP and IPv6 neighbour-discovery frames the
//! uplink program sees.

/// The kinds of L2 control frames counted on uplink ingress. The value is the
/// index into the `FRAME_COUNTERS` array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// ARP request (opcode 1), including gratuitous requests.
    ArpRequest = 0,
    /// ARP reply (opcode 2), including gratuitous replies.
    ArpReply = 1,
    /// Any other ARP opcode (RARP, InARP, ...).
    ArpOther = 2,
    /// ICMPv6 router solicitation (type 133).
    RouterSolicitation = 3,
    /// ICMPv6 router advertisement (type 134).
    RouterAdvertisement = 4,
    /// ICMPv6 neighbour solicitation (type 135).
    NeighborSolicitation = 5,
    /// ICMPv6 neighbour advertisement (type 136).
    NeighborAdvertisement = 6,
    /// ICMPv6 redirect (type 137).
    Redirect = 7,
}

impl FrameKind {
    /// Number of kinds; the length of the counter array.
    pub const COUNT: u32 = 8;

    /// Every kind, in index order.
    pub const ALL: [FrameKind; Self::COUNT as usize] = [
        FrameKind::ArpRequest,
        FrameKind::ArpReply,
        FrameKind::ArpOther,
        FrameKind::RouterSolicitation,
        FrameKind::RouterAdvertisement,
        FrameKind::NeighborSolicitation,
        FrameKind::NeighborAdvertisement,
        FrameKind::Redirect,
    ];

    /// Classifies an ARP opcode (host byte order).
    #[inline(always)]
    pub const fn from_arp_opcode(opcode: u16) -> FrameKind {
        match opcode {
            1 => FrameKind::ArpRequest,
            2 => FrameKind::ArpReply,
            _ => FrameKind::ArpOther,
        }
    }

    /// Classifies an ICMPv6 type; `None` for anything that is not NDP.
    #[inline(always)]
    pub const fn from_icmpv6_type(icmp_type: u8) -> Option<FrameKind> {
        match icmp_type {
            133 => Some(FrameKind::RouterSolicitation),
            134 => Some(FrameKind::RouterAdvertisement),
            135 => Some(FrameKind::NeighborSolicitation),
            136 => Some(FrameKind::NeighborAdvertisement),
            137 => Some(FrameKind::Redirect),
            _ => None,
        }
    }

    /// The array index of this kind.
    #[inline(always)]
    pub const fn index(self) -> u32 {
        self as u32
    }

    /// A stable lower-case name for tables, metrics and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            FrameKind::ArpRequest => "arp_request",
            FrameKind::ArpReply => "arp_reply",
            FrameKind::ArpOther => "arp_other",
            FrameKind::RouterSolicitation => "ndp_router_solicitation",
            FrameKind::RouterAdvertisement => "ndp_router_advertisement",
            FrameKind::NeighborSolicitation => "ndp_neighbor_solicitation",
            FrameKind::NeighborAdvertisement => "ndp_neighbor_advertisement",
            FrameKind::Redirect => "ndp_redirect",
        }
    }
}

/// Packets and bytes of one [`FrameKind`] seen on one CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameCounter {
    /// Frames counted.
    pub packets: u64,
    /// Bytes counted, from the start of the Ethernet header.
    pub bytes: u64,
}

impl FrameCounter {
    /// Adds another counter (used to sum the per-CPU values).
    pub const fn merged(self, other: FrameCounter) -> FrameCounter {
        FrameCounter {
            packets: self.packets.wrapping_add(other.packets),
            bytes: self.bytes.wrapping_add(other.bytes),
        }
    }
}

#[cfg(feature = "user")]
// SAFETY: `FrameCounter` is `repr(C)`, has no padding and every bit pattern is valid.
unsafe impl aya::Pod for FrameCounter {}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    #[test]
    fn frame_counter_layout_is_stable() {
        assert_eq!(size_of::<FrameCounter>(), 16);
        assert_eq!(align_of::<FrameCounter>(), 8);
        assert_eq!(size_of::<FrameKind>(), 4);
    }

    #[test]
    fn kinds_are_indexed_densely() {
        for (i, kind) in FrameKind::ALL.iter().enumerate() {
            assert_eq!(kind.index() as usize, i, "{kind:?}");
        }
    }

    #[test]
    fn classifies_arp_and_ndp() {
        assert_eq!(FrameKind::from_arp_opcode(1), FrameKind::ArpRequest);
        assert_eq!(FrameKind::from_arp_opcode(2), FrameKind::ArpReply);
        assert_eq!(FrameKind::from_arp_opcode(3), FrameKind::ArpOther);
        assert_eq!(
            FrameKind::from_icmpv6_type(135),
            Some(FrameKind::NeighborSolicitation)
        );
        assert_eq!(
            FrameKind::from_icmpv6_type(136),
            Some(FrameKind::NeighborAdvertisement)
        );
        assert_eq!(FrameKind::from_icmpv6_type(128), None);
    }

    #[test]
    fn merge_sums_fields() {
        let a = FrameCounter {
            packets: 2,
            bytes: 84,
        };
        let b = FrameCounter {
            packets: 1,
            bytes: 42,
        };
        assert_eq!(
            a.merged(b),
            FrameCounter {
                packets: 3,
                bytes: 126
            }
        );
    }
}
