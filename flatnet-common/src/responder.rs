//! ARP and IPv6 neighbour-discovery answering for addresses flatnet owns.
//!
//! The uplink program answers requests for the exact addresses in the
//! responder maps (never a blanket proxy). The reply construction lives here,
//! as pure functions over fixed-size byte arrays, so the kernel program and
//! the unit tests run the same code.

/// Length of an Ethernet/IPv4 ARP header.
pub const ARP_LEN: usize = 28;
/// Length of an IPv6 header.
pub const IPV6_LEN: usize = 40;
/// Length of the fixed part of a neighbour solicitation: type, code,
/// checksum, reserved, target address.
pub const NS_LEN: usize = 24;
/// Length of the neighbour advertisement flatnet sends: the fixed part plus
/// one target link-layer address option.
pub const NA_LEN: usize = 32;

const ARP_HTYPE_ETHERNET: u16 = 1;
const ETHERTYPE_IPV4: u16 = 0x0800;
const ARP_OP_REQUEST: u16 = 1;
const ARP_OP_REPLY: u16 = 2;
const IPPROTO_ICMPV6: u8 = 58;
const ICMPV6_NEIGHBOR_SOLICITATION: u8 = 135;
const ICMPV6_NEIGHBOR_ADVERTISEMENT: u8 = 136;
const NDP_HOP_LIMIT: u8 = 255;
const NDP_OPT_TARGET_LINK_ADDR: u8 = 2;
const NA_FLAG_ROUTER: u8 = 0x80;
const NA_FLAG_SOLICITED: u8 = 0x40;
const NA_FLAG_OVERRIDE: u8 = 0x20;

/// Key of the IPv4 responder map: an address on one uplink interface.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ArpResponderKey {
    /// Interface index of the uplink the request arrives on.
    pub ifindex: u32,
    /// The IPv4 address, network byte order.
    pub addr: [u8; 4],
}

/// Key of the IPv6 responder map: an address on one uplink interface.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NdpResponderKey {
    /// Interface index of the uplink the solicitation arrives on.
    pub ifindex: u32,
    /// The IPv6 address, network byte order.
    pub addr: [u8; 16],
}

/// How to answer for one address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResponderEntry {
    /// The MAC address to answer with (the node's uplink MAC).
    pub mac: [u8; 6],
    /// [`ResponderEntry::FLAG_ROUTER`] or 0.
    pub flags: u16,
    /// 0: answered for as long as it is listed (a pod's address). Else a
    /// lease, in `CLOCK_MONOTONIC` nanoseconds (`bpf_ktime_get_ns`): not
    /// answered from then on. A floating address's owner renews it with
    /// every heartbeat, so the node of a killed agent, whose program stays
    /// attached, falls silent on its own before a peer takes over.
    pub valid_until_ns: u64,
}

impl ResponderEntry {
    /// Set the Router flag in neighbour advertisements.
    pub const FLAG_ROUTER: u16 = 1;

    /// Whether the entry is answered at `now_ns` (`CLOCK_MONOTONIC`).
    #[inline(always)]
    pub fn answers_at(&self, now_ns: u64) -> bool {
        self.valid_until_ns == 0 || now_ns < self.valid_until_ns
    }
}

/// Counters of the answers the uplink program sent, indexes of the
/// `RESPONDER_STATS` per-CPU array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponderStat {
    /// ARP replies sent.
    ArpReplies = 0,
    /// Neighbour advertisements sent.
    NeighborAdvertisements = 1,
}

impl ResponderStat {
    /// Number of counters.
    pub const COUNT: u32 = 2;
}

/// An ARP request that may be answered: the target address to look up and
/// the reply to send if the lookup succeeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArpQuestion {
    /// The address being asked for.
    pub target: [u8; 4],
    /// The requester's MAC (destination of the reply frame).
    pub requester_mac: [u8; 6],
}

/// Parses an ARP header; `Some` for an Ethernet/IPv4 request that is not a
/// gratuitous announcement (sender == target), which must not be answered.
/// Probes (sender 0.0.0.0, RFC 5227) are answered: that is how an owner
/// defends its address.
#[inline(always)]
pub fn arp_question(arp: &[u8; ARP_LEN]) -> Option<ArpQuestion> {
    if be16(arp[0], arp[1]) != ARP_HTYPE_ETHERNET
        || be16(arp[2], arp[3]) != ETHERTYPE_IPV4
        || arp[4] != 6
        || arp[5] != 4
        || be16(arp[6], arp[7]) != ARP_OP_REQUEST
    {
        return None;
    }
    let sender_ip = [arp[14], arp[15], arp[16], arp[17]];
    let target = [arp[24], arp[25], arp[26], arp[27]];
    if sender_ip == target {
        return None;
    }
    Some(ArpQuestion {
        target,
        requester_mac: [arp[8], arp[9], arp[10], arp[11], arp[12], arp[13]],
    })
}

/// Turns an ARP request into the reply `mac` owns `target`.
#[inline(always)]
pub fn arp_reply(request: &[u8; ARP_LEN], mac: [u8; 6]) -> [u8; ARP_LEN] {
    let mut reply = *request;
    reply[6] = 0;
    reply[7] = ARP_OP_REPLY as u8;
    // Sender: us, with the address asked for.
    reply[8..14].copy_from_slice(&mac);
    reply[14..18].copy_from_slice(&request[24..28]);
    // Target: the requester.
    reply[18..24].copy_from_slice(&request[8..14]);
    reply[24..28].copy_from_slice(&request[14..18]);
    reply
}

/// A neighbour solicitation that may be answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NdpQuestion {
    /// The address being asked for.
    pub target: [u8; 16],
    /// The solicitation's source address (`::` for duplicate address detection).
    pub source: [u8; 16],
}

impl NdpQuestion {
    /// Duplicate address detection: the answer goes to all nodes, unsolicited.
    pub fn is_dad(&self) -> bool {
        self.source == [0; 16]
    }
}

/// Parses an IPv6 header and the fixed part of the ICMPv6 message after it;
/// `Some` for a valid neighbour solicitation (hop limit 255, code 0, RFC 4861 §7.1.1).
#[inline(always)]
pub fn ndp_question(ip6: &[u8; IPV6_LEN], icmp: &[u8; NS_LEN]) -> Option<NdpQuestion> {
    if ip6[0] >> 4 != 6
        || ip6[6] != IPPROTO_ICMPV6
        || ip6[7] != NDP_HOP_LIMIT
        || icmp[0] != ICMPV6_NEIGHBOR_SOLICITATION
        || icmp[1] != 0
    {
        return None;
    }
    let mut target = [0u8; 16];
    target.copy_from_slice(&icmp[8..24]);
    // A multicast target is invalid (RFC 4861 §7.1.1).
    if target[0] == 0xff {
        return None;
    }
    let mut source = [0u8; 16];
    source.copy_from_slice(&ip6[8..24]);
    Some(NdpQuestion { target, source })
}

/// The IPv6 all-nodes multicast address.
pub const ALL_NODES: [u8; 16] = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];

/// The Ethernet destination for an IPv6 destination address: the RFC 2464
/// multicast mapping for multicast, otherwise `unicast_mac`.
#[inline(always)]
pub fn ipv6_dst_mac(dst: &[u8; 16], unicast_mac: [u8; 6]) -> [u8; 6] {
    if dst[0] == 0xff {
        [0x33, 0x33, dst[12], dst[13], dst[14], dst[15]]
    } else {
        unicast_mac
    }
}

/// A neighbour advertisement as it replaces a solicitation: the IPv6
/// header, then the ICMPv6 message.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NdpAnswer {
    pub ip6: [u8; IPV6_LEN],
    pub na: [u8; NA_LEN],
}

impl Default for NdpAnswer {
    fn default() -> Self {
        Self {
            ip6: [0; IPV6_LEN],
            na: [0; NA_LEN],
        }
    }
}

impl NdpAnswer {
    /// The IPv6 destination of the answer.
    pub fn destination(&self) -> &[u8; 16] {
        // SAFETY: bytes 24..40 of the 40-byte header, in bounds and of
        // alignment 1.
        unsafe { &*self.ip6.as_ptr().add(24).cast::<[u8; 16]>() }
    }
}

/// Writes into `answer` the IPv6 header and neighbour advertisement
/// answering `question` with `entry`: solicited and to the requester, or,
/// for duplicate address detection, unsolicited to all nodes (RFC 4861
/// §7.2.4). Override is set because the node is the address's only owner on
/// the link. Written in place so the uplink program can build it in a map
/// slot: its stack has no room for it (Linux 6.1 counts 512 bytes across
/// calls).
#[inline(always)]
pub fn neighbor_advertisement(
    question: &NdpQuestion,
    entry: &ResponderEntry,
    answer: &mut NdpAnswer,
) {
    let dad = question.is_dad();
    let dst = if dad { &ALL_NODES } else { &question.source };

    let ip6 = &mut answer.ip6;
    *ip6 = [0u8; IPV6_LEN];
    ip6[0] = 0x60;
    ip6[5] = NA_LEN as u8; // payload length (high byte stays 0)
    ip6[6] = IPPROTO_ICMPV6;
    ip6[7] = NDP_HOP_LIMIT;
    ip6[8..24].copy_from_slice(&question.target);
    ip6[24..40].copy_from_slice(dst);

    let na = &mut answer.na;
    *na = [0u8; NA_LEN];
    na[0] = ICMPV6_NEIGHBOR_ADVERTISEMENT;
    let mut flags = NA_FLAG_OVERRIDE;
    if !dad {
        flags |= NA_FLAG_SOLICITED;
    }
    if entry.flags & ResponderEntry::FLAG_ROUTER != 0 {
        flags |= NA_FLAG_ROUTER;
    }
    na[4] = flags;
    na[8..24].copy_from_slice(&question.target);
    na[24] = NDP_OPT_TARGET_LINK_ADDR;
    na[25] = 1; // length in units of 8 octets
    na[26..32].copy_from_slice(&entry.mac);

    let checksum = icmpv6_checksum(&question.target, dst, na);
    na[2..4].copy_from_slice(&checksum.to_be_bytes());
}

/// The ICMPv6 checksum of `message` (checksum field zero) between `src`
/// and `dst` (RFC 4443 §2.3).
#[inline(always)]
pub fn icmpv6_checksum(src: &[u8; 16], dst: &[u8; 16], message: &[u8; NA_LEN]) -> u16 {
    let mut sum: u32 = 0;
    let mut i = 0;
    while i < 16 {
        sum += u32::from(be16(src[i], src[i + 1]));
        sum += u32::from(be16(dst[i], dst[i + 1]));
        i += 2;
    }
    // Upper-layer length and next header.
    sum += NA_LEN as u32;
    sum += u32::from(IPPROTO_ICMPV6);
    let mut i = 0;
    while i < NA_LEN {
        sum += u32::from(be16(message[i], message[i + 1]));
        i += 2;
    }
    // Two folds suffice: the sum of 36 16-bit words fits in 22 bits.
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

#[inline(always)]
const fn be16(hi: u8, lo: u8) -> u16 {
    ((hi as u16) << 8) | lo as u16
}

#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (4 + 4), every bit pattern valid.
unsafe impl aya::Pod for ArpResponderKey {}
#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (4 + 16), every bit pattern valid.
unsafe impl aya::Pod for NdpResponderKey {}
#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (6 + 2), every bit pattern valid.
unsafe impl aya::Pod for ResponderEntry {}

#[cfg(test)]
mod tests {
    use super::*;

    const REQUESTER: [u8; 6] = [0x02, 0, 0, 0, 0, 0xaa];
    const NODE: [u8; 6] = [0x02, 0, 0, 0, 0, 0xbb];

    fn request(sender_ip: [u8; 4], target_ip: [u8; 4]) -> [u8; ARP_LEN] {
        let mut arp = [0u8; ARP_LEN];
        arp[..8].copy_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
        arp[8..14].copy_from_slice(&REQUESTER);
        arp[14..18].copy_from_slice(&sender_ip);
        arp[24..28].copy_from_slice(&target_ip);
        arp
    }

    #[test]
    fn answers_requests_but_not_announcements() {
        let req = request([192, 0, 2, 10], [192, 0, 2, 50]);
        let q = arp_question(&req).expect("a request");
        assert_eq!(q.target, [192, 0, 2, 50]);
        assert_eq!(q.requester_mac, REQUESTER);
        assert_eq!(
            arp_question(&request([192, 0, 2, 50], [192, 0, 2, 50])),
            None
        );
        // A probe (sender 0.0.0.0) is answered to defend the address.
        assert!(arp_question(&request([0; 4], [192, 0, 2, 50])).is_some());
        let mut reply_op = req;
        reply_op[7] = 2;
        assert_eq!(arp_question(&reply_op), None);
        let mut not_ipv4 = req;
        not_ipv4[2] = 0x86;
        assert_eq!(arp_question(&not_ipv4), None);
    }

    #[test]
    fn reply_swaps_roles() {
        let req = request([192, 0, 2, 10], [192, 0, 2, 50]);
        let reply = arp_reply(&req, NODE);
        assert_eq!(&reply[..6], &[0, 1, 8, 0, 6, 4]);
        assert_eq!(&reply[6..8], &[0, 2]);
        assert_eq!(&reply[8..14], &NODE);
        assert_eq!(&reply[14..18], &[192, 0, 2, 50]);
        assert_eq!(&reply[18..24], &REQUESTER);
        assert_eq!(&reply[24..28], &[192, 0, 2, 10]);
    }

    fn solicitation(
        source: [u8; 16],
        target: [u8; 16],
        hop_limit: u8,
    ) -> ([u8; IPV6_LEN], [u8; NS_LEN]) {
        let mut ip6 = [0u8; IPV6_LEN];
        ip6[0] = 0x60;
        ip6[6] = 58;
        ip6[7] = hop_limit;
        ip6[8..24].copy_from_slice(&source);
        let mut icmp = [0u8; NS_LEN];
        icmp[0] = 135;
        icmp[8..24].copy_from_slice(&target);
        (ip6, icmp)
    }

    const TARGET: [u8; 16] = [
        0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x50,
    ];
    const SOURCE: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10];

    #[test]
    fn solicitations_must_be_well_formed() {
        let (ip6, icmp) = solicitation(SOURCE, TARGET, 255);
        assert_eq!(
            ndp_question(&ip6, &icmp),
            Some(NdpQuestion {
                target: TARGET,
                source: SOURCE
            })
        );
        let (ip6, icmp) = solicitation(SOURCE, TARGET, 64);
        assert_eq!(ndp_question(&ip6, &icmp), None, "hop limit must be 255");
        let (ip6, mut icmp) = solicitation(SOURCE, TARGET, 255);
        icmp[0] = 136;
        assert_eq!(
            ndp_question(&ip6, &icmp),
            None,
            "advertisements are not questions"
        );
        let (ip6, icmp) = solicitation(SOURCE, ALL_NODES, 255);
        assert_eq!(ndp_question(&ip6, &icmp), None, "multicast target");
    }

    #[test]
    fn advertisement_fields_and_checksum() {
        let entry = ResponderEntry {
            mac: NODE,
            flags: 0,
            valid_until_ns: 0,
        };
        let q = NdpQuestion {
            target: TARGET,
            source: SOURCE,
        };
        let mut answer = NdpAnswer::default();
        neighbor_advertisement(&q, &entry, &mut answer);
        let NdpAnswer { ip6, na } = answer;
        assert_eq!(ip6[0], 0x60);
        assert_eq!(ip6[5], 32);
        assert_eq!(ip6[7], 255);
        assert_eq!(&ip6[8..24], &TARGET);
        assert_eq!(&ip6[24..40], &SOURCE);
        assert_eq!(na[0], 136);
        assert_eq!(na[4], 0x60, "solicited and override");
        assert_eq!(&na[26..32], &NODE);
        // Summing the pseudo header and message with the checksum in place gives 0xffff.
        let mut check = na;
        let stored = u16::from_be_bytes([na[2], na[3]]);
        check[2] = 0;
        check[3] = 0;
        assert_eq!(icmpv6_checksum(&TARGET, &SOURCE, &check), stored);
        assert_ne!(stored, 0);
    }

    #[test]
    fn a_lease_is_answered_until_it_runs_out_and_no_lease_always() {
        let mut entry = ResponderEntry {
            mac: NODE,
            flags: 0,
            valid_until_ns: 0,
        };
        assert!(entry.answers_at(0) && entry.answers_at(u64::MAX));
        entry.valid_until_ns = 1_000;
        assert!(entry.answers_at(999));
        assert!(!entry.answers_at(1_000) && !entry.answers_at(5_000));
    }

    #[test]
    fn dad_is_answered_unsolicited_to_all_nodes() {
        let entry = ResponderEntry {
            mac: NODE,
            flags: ResponderEntry::FLAG_ROUTER,
            valid_until_ns: 0,
        };
        let q = NdpQuestion {
            target: TARGET,
            source: [0; 16],
        };
        let mut answer = NdpAnswer::default();
        neighbor_advertisement(&q, &entry, &mut answer);
        let NdpAnswer { ip6, na } = answer;
        assert_eq!(&ip6[24..40], &ALL_NODES);
        assert_eq!(na[4], 0x80 | 0x20, "router and override, not solicited");
        assert_eq!(
            ipv6_dst_mac(&ALL_NODES, REQUESTER),
            [0x33, 0x33, 0, 0, 0, 1]
        );
        assert_eq!(ipv6_dst_mac(&SOURCE, REQUESTER), REQUESTER);
    }

    #[test]
    fn checksum_matches_a_known_vector() {
        // The checksum of an all-zero message between :: and :: is the
        // complement of length + next header.
        let zero = [0u8; 16];
        assert_eq!(icmpv6_checksum(&zero, &zero, &[0; NA_LEN]), !(32u16 + 58));
    }
}
