//! Network policy for flat-network pods: the layout of the policy maps and
//! the packet logic the pod-interface programs share with user space.
//!
//! The agent compiles MultiNetworkPolicies into, per pod address (the
//! *subject*) and direction:
//!
//! - an isolation flag ([`PolicySubject`] in `POLICY_SUBJECTS`): a direction
//!   that is not isolated allows everything;
//! - LPM trie entries ([`PolicyLpmData`] → [`PolicyAllow`] in `POLICY_CIDRS`)
//!   keyed by direction, subject and remote prefix. The compiler makes every
//!   prefix carry the union of the rules that cover it, so the longest match
//!   alone decides;
//! - per-rule counters (`POLICY_RULE_STATS`) indexed by [`PortMatch::rule`].
//!
//! Flows are tracked in a connection-tracking LRU map ([`CtKey`] →
//! [`CtEntry`]): replies of allowed flows pass, and the later packets of an
//! allowed flow pass on one lookup as long as the pod's policy digest
//! ([`PolicySubject::policy_digest`]) is the one they were allowed under;
//! any policy change for the pod judges them again. Later IPv4/IPv6 fragments follow the verdict of their first
//! fragment ([`FragKey`]), and drops are reported through a rate-limited ring
//! buffer ([`PolicyDropEvent`]).
//!
//! Addresses are 16 bytes everywhere; IPv4 addresses are IPv4-mapped
//! (`::ffff:a.b.c.d`), so an IPv4 `/n` is an LPM prefix of `96 + n` bits.

/// Traffic direction, seen from the pod.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// Into the pod (TC ingress of the pod interface).
    Ingress = 0,
    /// Out of the pod (TC egress of the pod interface).
    Egress = 1,
}

impl Direction {
    /// The other direction: where the replies of a flow travel.
    #[inline(always)]
    pub const fn reverse(self) -> Self {
        match self {
            Self::Ingress => Self::Egress,
            Self::Egress => Self::Ingress,
        }
    }

    /// Bit of this direction in [`PolicySubject::isolated`].
    #[inline(always)]
    pub const fn bit(self) -> u32 {
        1 << (self as u32)
    }

    /// Lower-case name for output.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Ingress => "ingress",
            Self::Egress => "egress",
        }
    }
}

/// IP protocol numbers the policy knows by name.
pub mod proto {
    /// ICMP.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// ICMPv6.
    pub const ICMPV6: u8 = 58;
    /// SCTP.
    pub const SCTP: u8 = 132;
}

/// Capacity of the LPM trie (all subjects and directions together).
pub const POLICY_CIDRS_MAX_ENTRIES: u32 = 131_072;
/// Capacity of the subject table (pod addresses on this node).
pub const POLICY_SUBJECTS_MAX_ENTRIES: u32 = 16_384;
/// Number of per-rule counters; rule ids are below this.
pub const POLICY_RULES_MAX: u32 = 16_384;
/// Capacity of the connection-tracking LRU map. A flow allowed at one pod
/// interface takes two entries (its own packets and its replies), a flow
/// between two pods of one node four.
pub const POLICY_CT_MAX_ENTRIES: u32 = 131_072;
/// Capacity of the fragment-tracking LRU map.
pub const POLICY_FRAG_MAX_ENTRIES: u32 = 8_192;
/// Size of the drop-event ring buffer in bytes (a power of two, page multiple).
pub const POLICY_EVENT_RING_BYTES: u32 = 64 * 1024;
/// Drop events each CPU may emit per [`DROP_EVENT_WINDOW_NS`]; further drops
/// are only counted ([`PolicyStat::EventsSuppressed`]).
pub const DROP_EVENTS_PER_WINDOW: u64 = 64;
/// Length of the drop-event rate-limit window.
pub const DROP_EVENT_WINDOW_NS: u64 = 1_000_000_000;
/// A connection-tracking entry is refreshed at most this often.
pub const CT_REFRESH_NS: u64 = 1_000_000_000;
/// Idle time after which a TCP flow's replies are no longer let through.
pub const CT_TCP_TIMEOUT_NS: u64 = 3_600_000_000_000;
/// Idle time after which any other flow's replies are no longer let through.
pub const CT_OTHER_TIMEOUT_NS: u64 = 120_000_000_000;
/// Idle time after which later fragments of a datagram are no longer accepted.
pub const FRAG_TIMEOUT_NS: u64 = 30_000_000_000;
/// Port matches one LPM entry can hold.
pub const MAX_PORT_MATCHES: usize = 16;
/// IPv6 extension headers the programs walk before giving up on a packet.
pub const MAX_IPV6_EXTENSIONS: usize = 6;
/// Bits of [`PolicyLpmData`] before the remote address: direction and subject.
pub const LPM_FIXED_BITS: u32 = 32 + 128;

/// The data part of an LPM trie key (the prefix length comes first, in the
/// trie's own key wrapper). `direction` and `subject` are always matched
/// whole; the remote prefix length is `prefix_len - LPM_FIXED_BITS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyLpmData {
    /// A [`Direction`] value.
    pub direction: u32,
    /// The pod address the policy protects (IPv4-mapped for IPv4).
    pub subject: [u8; 16],
    /// The remote address or prefix (IPv4-mapped for IPv4), network order.
    pub remote: [u8; 16],
}

/// One allowed (protocol, port range) of an LPM entry, and the rule that
/// allowed it (counter index).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortMatch {
    /// Index of the rule's counter in `POLICY_RULE_STATS`.
    pub rule: u32,
    /// IP protocol number, or [`PortMatch::ANY_PROTOCOL`] for all traffic
    /// (the rule lists no ports).
    pub protocol: u8,
    /// Reserved, zero.
    pub reserved: u8,
    /// First allowed port (host order).
    pub port_min: u16,
    /// Last allowed port (host order), inclusive.
    pub port_max: u16,
    /// Reserved, zero.
    pub reserved2: u16,
}

impl PortMatch {
    /// Matches every packet, whatever its protocol.
    pub const ANY_PROTOCOL: u8 = 0;

    /// Whether a packet of `protocol` with destination port `port` (`None`
    /// when the packet has no ports or they are unknown) matches.
    #[inline(always)]
    pub fn matches(&self, protocol: u8, port: Option<u16>) -> bool {
        if self.protocol == Self::ANY_PROTOCOL {
            return true;
        }
        if self.protocol != protocol {
            return false;
        }
        match port {
            Some(port) => self.port_min <= port && port <= self.port_max,
            None => false,
        }
    }
}

/// The value of an LPM entry: what the remote prefix may send (ingress) or
/// receive (egress).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PolicyAllow {
    /// Number of valid entries in `matches`.
    pub count: u32,
    /// The matches; entries past `count` are ignored.
    pub matches: [PortMatch; MAX_PORT_MATCHES],
}

impl Default for PolicyAllow {
    fn default() -> Self {
        Self {
            count: 0,
            matches: [PortMatch::default(); MAX_PORT_MATCHES],
        }
    }
}

impl PolicyAllow {
    /// The rule of the first match for the packet, if any.
    #[inline(always)]
    pub fn first_match(&self, protocol: u8, port: Option<u16>) -> Option<u32> {
        let mut i = 0;
        while i < MAX_PORT_MATCHES {
            if i as u32 >= self.count {
                return None;
            }
            let m = &self.matches[i];
            if m.matches(protocol, port) {
                return Some(m.rule);
            }
            i += 1;
        }
        None
    }
}

/// Key of `POLICY_SUBJECTS`: a pod address (IPv4-mapped for IPv4).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicySubjectKey {
    /// The address, network order.
    pub addr: [u8; 16],
}

/// Value of `POLICY_SUBJECTS`: which directions are isolated, and which
/// policy is in force.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolicySubject {
    /// [`Direction::bit`]s of the isolated directions.
    pub isolated: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Digest of everything that decides this pod's packets (isolation and
    /// its LPM entries). Tracked flows allowed under another digest are
    /// judged again ([`CtEntry::verdict`]). A pod without an entry has
    /// digest 0; an entry's digest is never 0.
    pub policy_digest: u64,
}

impl PolicySubject {
    /// Whether `direction` is isolated.
    #[inline(always)]
    pub const fn is_isolated(&self, direction: Direction) -> bool {
        self.isolated & direction.bit() != 0
    }
}

/// A flow as the policy sees it. For ICMP echo the identifier stands in for
/// the ports (request: `src_port = id`; reply: `dst_port = id`), so a reply
/// is the reverse of its request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Flow {
    /// Source address (IPv4-mapped for IPv4).
    pub src: [u8; 16],
    /// Destination address (IPv4-mapped for IPv4).
    pub dst: [u8; 16],
    /// Source port (host order), 0 when the protocol has none.
    pub src_port: u16,
    /// Destination port (host order), 0 when the protocol has none.
    pub dst_port: u16,
    /// IP protocol number.
    pub protocol: u8,
}

impl Flow {
    /// The connection-tracking key a packet of this flow is looked up under
    /// at `direction`.
    #[inline(always)]
    pub fn ct_key(&self, direction: Direction) -> CtKey {
        CtKey {
            src: self.src,
            dst: self.dst,
            src_port: self.src_port,
            dst_port: self.dst_port,
            protocol: self.protocol,
            direction: direction as u8,
            reserved: [0; 2],
        }
    }

    /// The key under which the replies of this flow, allowed at
    /// `direction`, will be looked up: reversed addresses and ports, the
    /// other direction of the same pod.
    #[inline(always)]
    pub fn reply_ct_key(&self, direction: Direction) -> CtKey {
        CtKey {
            src: self.dst,
            dst: self.src,
            src_port: self.dst_port,
            dst_port: self.src_port,
            protocol: self.protocol,
            direction: direction.reverse() as u8,
            reserved: [0; 2],
        }
    }

    /// The key an ICMP error about this flow (the packet the error quotes)
    /// is looked up under when the error travels at `direction`: the error
    /// goes back toward the flow's sender, like a reply, so it is related
    /// when the flow's replies are expected at `direction`.
    #[inline(always)]
    pub fn related_ct_key(&self, direction: Direction) -> CtKey {
        self.reply_ct_key(direction.reverse())
    }
}

/// Key of the connection-tracking LRU map: a packet expected at `direction`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtKey {
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
    /// Source port (host order).
    pub src_port: u16,
    /// Destination port (host order).
    pub dst_port: u16,
    /// IP protocol number.
    pub protocol: u8,
    /// The [`Direction`] the packet is expected at.
    pub direction: u8,
    /// Reserved, zero.
    pub reserved: [u8; 2],
}

/// Counter id in [`CtEntry::rule`] of a flow allowed without a rule (the
/// direction was not isolated).
pub const CT_NO_RULE: u32 = u32::MAX;

/// What a connection-tracking entry lets through, in [`CtEntry::kind`].
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CtKind {
    /// Replies of a flow the pod's policy allowed in the other direction:
    /// they pass whatever the policy says now.
    Reply = 0,
    /// Packets of a flow the pod's policy allowed: they pass while the
    /// pod's policy digest is unchanged.
    Allowed = 1,
}

/// Value of the connection-tracking map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtEntry {
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC_COARSE) when the entry was last written.
    pub last_seen_ns: u64,
    /// For [`CtKind::Allowed`]: the pod's [`PolicySubject::policy_digest`]
    /// when the flow was allowed; 0 for replies.
    pub policy_digest: u64,
    /// For [`CtKind::Allowed`]: the counter id of the rule that allowed the
    /// flow, or [`CT_NO_RULE`].
    pub rule: u32,
    /// A [`CtKind`] value.
    pub kind: u8,
    /// Reserved, zero.
    pub reserved: [u8; 3],
}

/// What a live connection-tracking entry says about a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtVerdict {
    /// A reply of an allowed flow: pass.
    Reply,
    /// A packet of a flow allowed under the current policy: pass, counted
    /// for the rule (or [`CT_NO_RULE`]).
    Allowed {
        /// Counter id of the rule, or [`CT_NO_RULE`].
        rule: u32,
    },
    /// Allowed under a policy no longer in force: judge the packet again.
    Stale,
}

impl CtEntry {
    /// An entry letting the replies of an allowed flow through.
    #[inline(always)]
    pub const fn reply(now_ns: u64) -> Self {
        Self {
            last_seen_ns: now_ns,
            policy_digest: 0,
            rule: 0,
            kind: CtKind::Reply as u8,
            reserved: [0; 3],
        }
    }

    /// An entry letting the later packets of a flow through while the pod's
    /// policy digest stays `policy_digest`.
    #[inline(always)]
    pub const fn allowed(now_ns: u64, policy_digest: u64, rule: u32) -> Self {
        Self {
            last_seen_ns: now_ns,
            policy_digest,
            rule,
            kind: CtKind::Allowed as u8,
            reserved: [0; 3],
        }
    }

    /// Whether the entry lets the replies of an allowed flow through, which
    /// does not depend on the pod's policy.
    #[inline(always)]
    pub const fn is_reply(&self) -> bool {
        self.kind == CtKind::Reply as u8
    }

    /// What the entry says about a packet of its key when the pod's policy
    /// digest is `policy_digest` (liveness is checked apart, [`Self::alive`]).
    #[inline(always)]
    pub const fn verdict(&self, policy_digest: u64) -> CtVerdict {
        if self.is_reply() {
            CtVerdict::Reply
        } else if self.kind == CtKind::Allowed as u8 && self.policy_digest == policy_digest {
            CtVerdict::Allowed { rule: self.rule }
        } else {
            CtVerdict::Stale
        }
    }

    /// Whether the flow of `protocol` is still tracked at `now_ns`.
    #[inline(always)]
    pub fn alive(&self, protocol: u8, now_ns: u64) -> bool {
        let timeout = if protocol == proto::TCP {
            CT_TCP_TIMEOUT_NS
        } else {
            CT_OTHER_TIMEOUT_NS
        };
        now_ns.saturating_sub(self.last_seen_ns) < timeout
    }

    /// Whether the entry is old enough to be worth rewriting at `now_ns`.
    #[inline(always)]
    pub fn needs_refresh(&self, now_ns: u64) -> bool {
        now_ns.saturating_sub(self.last_seen_ns) >= CT_REFRESH_NS
    }
}

/// Value of the fragment map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragEntry {
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC_COARSE) when the first fragment was allowed.
    pub last_seen_ns: u64,
}

/// Key of the fragment map: the datagram whose first fragment was allowed.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragKey {
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
    /// Fragment identification (IPv4: 16 bits, IPv6: 32 bits).
    pub id: u32,
    /// IP protocol number of the payload.
    pub protocol: u8,
    /// The [`Direction`] the fragments travel.
    pub direction: u8,
    /// Reserved, zero.
    pub reserved: [u8; 2],
}

/// What the programs count, per CPU; the index into `POLICY_STATS`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyStat {
    /// Passed because the direction is not isolated for the pod.
    AllowedNotIsolated = 0,
    /// Passed because a rule allows it (also counted per rule).
    AllowedByRule = 1,
    /// Passed as the reply of an allowed flow.
    AllowedReply = 2,
    /// A later fragment of an allowed datagram.
    AllowedFragment = 3,
    /// ARP, neighbour discovery or MLD: always passed.
    AllowedNeighbor = 4,
    /// Not IPv4, IPv6 or ARP: passed untouched.
    PassedNonIp = 5,
    /// Dropped: no rule allows it.
    DeniedNoRule = 6,
    /// Dropped: a later fragment whose first fragment was not allowed (or not seen).
    DeniedFragment = 7,
    /// Dropped: malformed or truncated IP packet.
    DeniedMalformed = 8,
    /// Drop events not sent because of the rate limit or a full ring buffer.
    EventsSuppressed = 9,
    /// Passed as an ICMP error about a flow allowed earlier.
    AllowedRelated = 10,
}

impl PolicyStat {
    /// Number of stats; the length of the stats array.
    pub const COUNT: u32 = 11;

    /// Every stat, in index order.
    pub const ALL: [PolicyStat; Self::COUNT as usize] = [
        Self::AllowedNotIsolated,
        Self::AllowedByRule,
        Self::AllowedReply,
        Self::AllowedFragment,
        Self::AllowedNeighbor,
        Self::PassedNonIp,
        Self::DeniedNoRule,
        Self::DeniedFragment,
        Self::DeniedMalformed,
        Self::EventsSuppressed,
        Self::AllowedRelated,
    ];

    /// A stable lower-case name for output and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            Self::AllowedNotIsolated => "allowed_not_isolated",
            Self::AllowedByRule => "allowed_by_rule",
            Self::AllowedReply => "allowed_reply",
            Self::AllowedFragment => "allowed_fragment",
            Self::AllowedNeighbor => "allowed_neighbor",
            Self::PassedNonIp => "passed_non_ip",
            Self::DeniedNoRule => "denied_no_rule",
            Self::DeniedFragment => "denied_fragment",
            Self::DeniedMalformed => "denied_malformed",
            Self::EventsSuppressed => "events_suppressed",
            Self::AllowedRelated => "allowed_related",
        }
    }
}

/// Why a packet was dropped, in [`PolicyDropEvent::reason`].
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// No rule allows it.
    NoRule = 1,
    /// A later fragment of a datagram that was not allowed.
    Fragment = 2,
    /// Malformed or truncated.
    Malformed = 3,
}

impl DropReason {
    /// From the raw value in an event.
    pub const fn from_u8(value: u8) -> Option<Self> {
        match value {
            1 => Some(Self::NoRule),
            2 => Some(Self::Fragment),
            3 => Some(Self::Malformed),
            _ => None,
        }
    }

    /// A stable lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::NoRule => "no_rule",
            Self::Fragment => "fragment",
            Self::Malformed => "malformed",
        }
    }
}

/// A dropped packet, sent to user space through the ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyDropEvent {
    /// `bpf_ktime_get_ns` of the drop.
    pub timestamp_ns: u64,
    /// Source address (IPv4-mapped; zero when unreadable).
    pub src: [u8; 16],
    /// Destination address (IPv4-mapped; zero when unreadable).
    pub dst: [u8; 16],
    /// Source port (host order), 0 when none.
    pub src_port: u16,
    /// Destination port (host order), 0 when none.
    pub dst_port: u16,
    /// IP protocol number.
    pub protocol: u8,
    /// A [`Direction`] value.
    pub direction: u8,
    /// A [`DropReason`] value.
    pub reason: u8,
    /// Reserved, zero.
    pub reserved: u8,
    /// Length of the frame.
    pub len: u32,
    /// Reserved, zero.
    pub reserved2: u32,
}

/// Per-CPU state of the drop-event rate limiter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventBudget {
    /// Start of the current window.
    pub window_start_ns: u64,
    /// Events sent in the current window.
    pub sent: u64,
}

impl EventBudget {
    /// Whether one more event may be sent at `now_ns`; updates the budget.
    #[inline(always)]
    pub fn take(&mut self, now_ns: u64) -> bool {
        if now_ns.saturating_sub(self.window_start_ns) >= DROP_EVENT_WINDOW_NS {
            self.window_start_ns = now_ns;
            self.sent = 0;
        }
        if self.sent >= DROP_EVENTS_PER_WINDOW {
            return false;
        }
        self.sent += 1;
        true
    }
}

/// The IPv4-mapped form of an IPv4 address.
#[inline(always)]
pub const fn mapped_v4(v4: [u8; 4]) -> [u8; 16] {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, v4[0], v4[1], v4[2], v4[3],
    ]
}

/// Length of the IPv4 header fields the programs read (no options).
pub const IPV4_MIN_LEN: usize = 20;

/// Where an IP packet sits among fragments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fragment {
    /// Not fragmented.
    None,
    /// First fragment of a fragmented datagram (its L4 header is here).
    First {
        /// Identification.
        id: u32,
    },
    /// A later fragment: no L4 header.
    Later {
        /// Identification.
        id: u32,
    },
}

/// The parts of an IPv4 header the policy needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipv4Info {
    /// Header length in bytes (from IHL).
    pub header_len: usize,
    /// Payload protocol.
    pub protocol: u8,
    /// Source (IPv4-mapped).
    pub src: [u8; 16],
    /// Destination (IPv4-mapped).
    pub dst: [u8; 16],
    /// Fragment position.
    pub fragment: Fragment,
}

/// Parses the fixed IPv4 header; `None` when it is not a valid one (wrong
/// version, IHL below 5).
#[inline(always)]
pub fn parse_ipv4(h: &[u8; IPV4_MIN_LEN]) -> Option<Ipv4Info> {
    if h[0] >> 4 != 4 {
        return None;
    }
    let header_len = ((h[0] & 0x0f) as usize) * 4;
    if header_len < IPV4_MIN_LEN {
        return None;
    }
    let flags_offset = u16::from_be_bytes([h[6], h[7]]);
    let more_fragments = flags_offset & 0x2000 != 0;
    let offset = flags_offset & 0x1fff;
    let id = u32::from(u16::from_be_bytes([h[4], h[5]]));
    let fragment = if offset != 0 {
        Fragment::Later { id }
    } else if more_fragments {
        Fragment::First { id }
    } else {
        Fragment::None
    };
    Some(Ipv4Info {
        header_len,
        protocol: h[9],
        src: mapped_v4([h[12], h[13], h[14], h[15]]),
        dst: mapped_v4([h[16], h[17], h[18], h[19]]),
        fragment,
    })
}

/// The parts of the fixed IPv6 header the policy needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipv6Info {
    /// The first next-header value.
    pub next_header: u8,
    /// Source.
    pub src: [u8; 16],
    /// Destination.
    pub dst: [u8; 16],
}

/// Parses the fixed IPv6 header; `None` when the version is not 6.
#[inline(always)]
pub fn parse_ipv6(h: &[u8; 40]) -> Option<Ipv6Info> {
    if h[0] >> 4 != 6 {
        return None;
    }
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&h[8..24]);
    dst.copy_from_slice(&h[24..40]);
    Some(Ipv6Info {
        next_header: h[6],
        src,
        dst,
    })
}

/// One step of the IPv6 extension-header walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ipv6Ext {
    /// Not an extension header: `next_header` is the upper-layer protocol.
    Upper,
    /// An extension header of `len` bytes followed by `next`.
    Skip {
        /// Next header.
        next: u8,
        /// Length of this extension header in bytes.
        len: usize,
    },
    /// A fragment header (8 bytes) followed by `next`.
    Fragment {
        /// Next header.
        next: u8,
        /// Whether this is a later fragment (offset not zero).
        later: bool,
        /// Whether more fragments follow.
        more: bool,
        /// Identification.
        id: u32,
    },
}

/// Whether `next_header` names an extension header [`ipv6_ext`] walks over.
#[inline(always)]
pub const fn is_ipv6_extension(next_header: u8) -> bool {
    matches!(next_header, 0 | 43 | 44 | 51 | 60 | 135 | 139 | 140)
}

/// Interprets the 8 bytes at an extension header of type `next_header`.
#[inline(always)]
pub fn ipv6_ext(next_header: u8, b: &[u8; 8]) -> Ipv6Ext {
    match next_header {
        // Hop-by-hop, routing, destination options, mobility, HIP, shim6:
        // length in 8-octet units, not counting the first 8 octets.
        0 | 43 | 60 | 135 | 139 | 140 => Ipv6Ext::Skip {
            next: b[0],
            len: (b[1] as usize + 1) * 8,
        },
        // Authentication header: length in 4-octet units, minus 2.
        51 => Ipv6Ext::Skip {
            next: b[0],
            len: (b[1] as usize + 2) * 4,
        },
        44 => {
            let offset_flags = u16::from_be_bytes([b[2], b[3]]);
            Ipv6Ext::Fragment {
                next: b[0],
                later: offset_flags >> 3 != 0,
                more: offset_flags & 1 != 0,
                id: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            }
        }
        _ => Ipv6Ext::Upper,
    }
}

/// Whether the protocol carries 16-bit source and destination ports in the
/// first 4 bytes of its header.
#[inline(always)]
pub const fn has_ports(protocol: u8) -> bool {
    matches!(protocol, proto::TCP | proto::UDP | proto::SCTP)
}

/// The flow ports of an ICMP or ICMPv6 message from its first 8 bytes:
/// echo requests and replies carry their identifier (see [`Flow`]); other
/// messages have none. `None` when `protocol` is not ICMP or ICMPv6.
#[inline(always)]
pub fn icmp_ports(protocol: u8, h: &[u8; 8]) -> Option<(u16, u16)> {
    let id = u16::from_be_bytes([h[4], h[5]]);
    match (protocol, h[0]) {
        (proto::ICMP, 8) | (proto::ICMPV6, 128) => Some((id, 0)),
        (proto::ICMP, 0) | (proto::ICMPV6, 129) => Some((0, id)),
        (proto::ICMP | proto::ICMPV6, _) => Some((0, 0)),
        _ => None,
    }
}

/// Bytes of an ICMP / ICMPv6 error message before the packet it quotes
/// (type, code, checksum, and 4 bytes of unused / pointer / MTU).
pub const ICMP_ERROR_HEADER_LEN: usize = 8;

/// Whether an ICMP / ICMPv6 message of `icmp_type` is an error that quotes
/// the packet it reports on (IPv4: destination unreachable, time exceeded,
/// parameter problem; IPv6: destination unreachable, packet too big, time
/// exceeded, parameter problem).
#[inline(always)]
pub const fn is_icmp_error(protocol: u8, icmp_type: u8) -> bool {
    matches!(
        (protocol, icmp_type),
        (proto::ICMP, 3 | 11 | 12) | (proto::ICMPV6, 1..=4)
    )
}

/// Whether an ICMPv6 type is neighbour discovery (133–137) or multicast
/// listener discovery (130–132, 143), which IPv6 needs to work at all and
/// the policy therefore always passes.
#[inline(always)]
pub const fn is_ipv6_control(icmp_type: u8) -> bool {
    matches!(icmp_type, 130..=137 | 143)
}

#[cfg(feature = "user")]
#[expect(
    clippy::undocumented_unsafe_blocks,
    reason = "one SAFETY comment covers every impl of this module"
)]
mod pod_impls {
    use super::*;
    // SAFETY (all): repr(C), no implicit padding (sizes checked in the
    // layout test), every bit pattern valid.
    unsafe impl aya::Pod for PolicyLpmData {}
    unsafe impl aya::Pod for PortMatch {}
    unsafe impl aya::Pod for PolicyAllow {}
    unsafe impl aya::Pod for PolicySubjectKey {}
    unsafe impl aya::Pod for PolicySubject {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtEntry {}
    unsafe impl aya::Pod for FragEntry {}
    unsafe impl aya::Pod for FragKey {}
    unsafe impl aya::Pod for PolicyDropEvent {}
    unsafe impl aya::Pod for EventBudget {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(rule: u32, min: u16, max: u16) -> PortMatch {
        PortMatch {
            rule,
            protocol: proto::TCP,
            port_min: min,
            port_max: max,
            ..PortMatch::default()
        }
    }

    #[test]
    fn port_matches() {
        let m = tcp(1, 80, 90);
        assert!(m.matches(proto::TCP, Some(80)));
        assert!(m.matches(proto::TCP, Some(90)));
        assert!(!m.matches(proto::TCP, Some(91)));
        assert!(!m.matches(proto::TCP, Some(79)));
        assert!(!m.matches(proto::UDP, Some(80)), "other protocol");
        assert!(!m.matches(proto::TCP, None), "unknown port");
        let any = PortMatch {
            protocol: PortMatch::ANY_PROTOCOL,
            ..PortMatch::default()
        };
        assert!(any.matches(proto::ICMP, None));
        assert!(any.matches(proto::UDP, Some(5)));
    }

    #[test]
    fn first_match_respects_count() {
        let mut allow = PolicyAllow::default();
        allow.matches[0] = tcp(7, 1, 10);
        allow.matches[1] = tcp(8, 5, 20);
        assert_eq!(allow.first_match(proto::TCP, Some(5)), None, "count 0");
        allow.count = 2;
        assert_eq!(allow.first_match(proto::TCP, Some(5)), Some(7));
        assert_eq!(allow.first_match(proto::TCP, Some(15)), Some(8));
        assert_eq!(allow.first_match(proto::TCP, Some(25)), None);
        for m in &mut allow.matches[2..] {
            *m = tcp(9, 30000, 30000);
        }
        assert_eq!(allow.first_match(proto::TCP, Some(30000)), None);
        allow.count = u32::MAX;
        assert_eq!(allow.first_match(proto::TCP, Some(30000)), Some(9));
        assert_eq!(
            allow.first_match(proto::UDP, Some(15)),
            None,
            "a corrupt count stays within the array"
        );
    }

    #[test]
    fn reply_key_is_the_reverse_at_the_other_direction() {
        let flow = Flow {
            src: mapped_v4([10, 0, 0, 1]),
            dst: mapped_v4([10, 0, 0, 2]),
            src_port: 40000,
            dst_port: 80,
            protocol: proto::TCP,
        };
        let reply = Flow {
            src: flow.dst,
            dst: flow.src,
            src_port: 80,
            dst_port: 40000,
            protocol: proto::TCP,
        };
        assert_eq!(
            flow.reply_ct_key(Direction::Egress),
            reply.ct_key(Direction::Ingress)
        );
        assert_ne!(
            flow.reply_ct_key(Direction::Egress),
            reply.ct_key(Direction::Egress),
            "a reply is expected in the other direction only"
        );
    }

    #[test]
    fn related_key_of_a_quoted_packet_is_its_reply_key() {
        // The pod sent a TCP segment out; a router's error about it comes in
        // quoting that segment, and must find the entry the segment wrote.
        let quoted = Flow {
            src: mapped_v4([10, 0, 0, 1]),
            dst: mapped_v4([192, 0, 2, 9]),
            src_port: 40000,
            dst_port: 443,
            protocol: proto::TCP,
        };
        assert_eq!(
            quoted.related_ct_key(Direction::Ingress),
            quoted.reply_ct_key(Direction::Egress)
        );
        // A pod's error about a packet it received goes out and finds the
        // entry that packet wrote when it was allowed in.
        assert_eq!(
            quoted.related_ct_key(Direction::Egress),
            quoted.reply_ct_key(Direction::Ingress)
        );
        assert_ne!(
            quoted.related_ct_key(Direction::Ingress),
            quoted.reply_ct_key(Direction::Ingress)
        );
    }

    #[test]
    fn icmp_errors() {
        for t in [3, 11, 12] {
            assert!(is_icmp_error(proto::ICMP, t), "{t}");
        }
        for t in [0, 4, 5, 8, 13] {
            assert!(!is_icmp_error(proto::ICMP, t), "{t}");
        }
        for t in [1, 2, 3, 4] {
            assert!(is_icmp_error(proto::ICMPV6, t), "{t}");
        }
        for t in [0, 5, 128, 129, 135] {
            assert!(!is_icmp_error(proto::ICMPV6, t), "{t}");
        }
        assert!(!is_icmp_error(proto::TCP, 3));
    }

    #[test]
    fn icmp_echo_reply_reverses_request() {
        let request = [8, 0, 0, 0, 0x12, 0x34, 0, 1];
        let reply = [0, 0, 0, 0, 0x12, 0x34, 0, 1];
        let (s, d) = icmp_ports(proto::ICMP, &request).unwrap();
        assert_eq!(icmp_ports(proto::ICMP, &reply), Some((d, s)));
        assert_eq!(
            icmp_ports(proto::ICMPV6, &[128, 0, 0, 0, 0, 9, 0, 0]),
            Some((9, 0))
        );
        assert_eq!(
            icmp_ports(proto::ICMPV6, &[129, 0, 0, 0, 0, 9, 0, 0]),
            Some((0, 9))
        );
        assert_eq!(
            icmp_ports(proto::ICMP, &[3, 1, 0, 0, 0, 9, 0, 0]),
            Some((0, 0))
        );
        assert_eq!(icmp_ports(proto::TCP, &request), None);
    }

    #[test]
    fn ipv4_header_and_fragments() {
        let mut h = [0u8; IPV4_MIN_LEN];
        h[0] = 0x45;
        h[4..6].copy_from_slice(&0xbeefu16.to_be_bytes());
        h[9] = proto::UDP;
        h[12..16].copy_from_slice(&[192, 0, 2, 1]);
        h[16..20].copy_from_slice(&[192, 0, 2, 2]);
        let info = parse_ipv4(&h).unwrap();
        assert_eq!(info.header_len, 20);
        assert_eq!(info.protocol, proto::UDP);
        assert_eq!(info.src, mapped_v4([192, 0, 2, 1]));
        assert_eq!(info.dst, mapped_v4([192, 0, 2, 2]));
        assert_eq!(info.fragment, Fragment::None);
        h[6] = 0x20; // MF, offset 0
        assert_eq!(
            parse_ipv4(&h).unwrap().fragment,
            Fragment::First { id: 0xbeef }
        );
        h[6] = 0x00;
        h[7] = 0x10; // offset 16 * 8, last fragment
        assert_eq!(
            parse_ipv4(&h).unwrap().fragment,
            Fragment::Later { id: 0xbeef }
        );
        h[0] = 0x46;
        assert_eq!(parse_ipv4(&h).unwrap().header_len, 24, "options");
        h[0] = 0x44;
        assert_eq!(parse_ipv4(&h), None, "IHL below 5");
        h[0] = 0x65;
        assert_eq!(parse_ipv4(&h), None, "wrong version");
    }

    #[test]
    fn ipv6_extension_headers() {
        assert_eq!(
            ipv6_ext(0, &[6, 0, 0, 0, 0, 0, 0, 0]),
            Ipv6Ext::Skip { next: 6, len: 8 }
        );
        assert_eq!(
            ipv6_ext(60, &[17, 2, 0, 0, 0, 0, 0, 0]),
            Ipv6Ext::Skip { next: 17, len: 24 }
        );
        assert_eq!(
            ipv6_ext(51, &[6, 4, 0, 0, 0, 0, 0, 0]),
            Ipv6Ext::Skip { next: 6, len: 24 }
        );
        assert_eq!(
            ipv6_ext(44, &[17, 0, 0, 1, 0, 0, 0, 7]),
            Ipv6Ext::Fragment {
                next: 17,
                later: false,
                more: true,
                id: 7
            }
        );
        assert_eq!(
            ipv6_ext(44, &[17, 0, 0x05, 0x38, 0, 0, 1, 0]),
            Ipv6Ext::Fragment {
                next: 17,
                later: true,
                more: false,
                id: 256
            }
        );
        assert_eq!(ipv6_ext(6, &[0; 8]), Ipv6Ext::Upper);
        for nh in 0..=255u8 {
            assert_eq!(
                is_ipv6_extension(nh),
                ipv6_ext(nh, &[0; 8]) != Ipv6Ext::Upper,
                "{nh}"
            );
        }
        assert_eq!(ipv6_ext(50, &[0; 8]), Ipv6Ext::Upper, "ESP ends the walk");
        let mut h = [0u8; 40];
        h[0] = 0x60;
        h[6] = 44;
        h[23] = 1;
        h[39] = 2;
        let info = parse_ipv6(&h).unwrap();
        assert_eq!((info.next_header, info.src[15], info.dst[15]), (44, 1, 2));
        h[0] = 0x40;
        assert_eq!(parse_ipv6(&h), None);
    }

    #[test]
    fn ct_timeouts() {
        let entry = CtEntry::reply(100);
        assert!(entry.alive(proto::UDP, 100 + CT_OTHER_TIMEOUT_NS - 1));
        assert!(!entry.alive(proto::UDP, 100 + CT_OTHER_TIMEOUT_NS));
        assert!(entry.alive(proto::TCP, 100 + CT_OTHER_TIMEOUT_NS));
        assert!(!entry.needs_refresh(100 + CT_REFRESH_NS - 1));
        assert!(entry.needs_refresh(100 + CT_REFRESH_NS));
    }

    #[test]
    fn ct_verdicts() {
        assert!(CtEntry::reply(1).is_reply());
        assert!(!CtEntry::allowed(1, 0, CT_NO_RULE).is_reply());
        assert_eq!(CtEntry::reply(1).verdict(0), CtVerdict::Reply);
        assert_eq!(
            CtEntry::reply(1).verdict(42),
            CtVerdict::Reply,
            "replies pass whatever the policy is now"
        );
        let allowed = CtEntry::allowed(1, 42, 7);
        assert_eq!(allowed.verdict(42), CtVerdict::Allowed { rule: 7 });
        assert_eq!(allowed.verdict(43), CtVerdict::Stale, "policy changed");
        assert_eq!(
            allowed.verdict(0),
            CtVerdict::Stale,
            "pod no longer in the table"
        );
        let not_isolated = CtEntry::allowed(1, 0, CT_NO_RULE);
        assert_eq!(
            not_isolated.verdict(0),
            CtVerdict::Allowed { rule: CT_NO_RULE }
        );
        assert_eq!(
            not_isolated.verdict(42),
            CtVerdict::Stale,
            "pod isolated since"
        );
        let unknown_kind = CtEntry { kind: 9, ..allowed };
        assert_eq!(unknown_kind.verdict(42), CtVerdict::Stale);
    }

    #[test]
    fn event_budget_limits_each_window() {
        let mut budget = EventBudget::default();
        let start = DROP_EVENT_WINDOW_NS * 3;
        for _ in 0..DROP_EVENTS_PER_WINDOW {
            assert!(budget.take(start));
        }
        assert!(!budget.take(start + 1));
        assert!(budget.take(start + DROP_EVENT_WINDOW_NS), "new window");
    }

    #[test]
    fn control_messages() {
        for t in [130, 131, 132, 133, 134, 135, 136, 137, 143] {
            assert!(is_ipv6_control(t), "{t}");
        }
        for t in [1, 2, 3, 4, 128, 129, 138, 142] {
            assert!(!is_ipv6_control(t), "{t}");
        }
    }

    #[test]
    fn layouts() {
        use core::mem::{align_of, size_of};
        assert_eq!(size_of::<PolicyLpmData>(), 36);
        assert_eq!((size_of::<PortMatch>(), align_of::<PortMatch>()), (12, 4));
        assert_eq!(
            (size_of::<PolicyAllow>(), align_of::<PolicyAllow>()),
            (4 + 12 * MAX_PORT_MATCHES, 4)
        );
        // The LPM trie stores the value right after the 36 data bytes.
        assert_eq!(size_of::<PolicyLpmData>() % align_of::<PolicyAllow>(), 0);
        assert_eq!(size_of::<PolicySubject>(), 16);
        assert_eq!(size_of::<CtKey>(), 40);
        assert_eq!(size_of::<CtEntry>(), 24);
        assert_eq!(size_of::<FragEntry>(), 8);
        assert_eq!(size_of::<FragKey>(), 40);
        assert_eq!(
            (size_of::<PolicyDropEvent>(), align_of::<PolicyDropEvent>()),
            (56, 8)
        );
        assert_eq!(size_of::<EventBudget>(), 16);
    }
}
