//! TC programs on pod interfaces: MultiNetworkPolicy enforcement.
//!
//! `policy_ingress` runs at TC ingress of a pod's flat interface (traffic
//! into the pod), `policy_egress` at its TC egress (traffic out of the pod).
//! Both judge a packet by the pod address it concerns (the *subject*: the
//! destination on ingress, the source on egress):
//!
//! 1. ARP, neighbour discovery and MLD always pass; other non-IP frames too.
//! 2. Replies of flows allowed earlier pass (connection tracking), and so
//!    do the later packets of an allowed flow while the subject's policy
//!    digest is the one the flow was allowed under: one hash lookup instead
//!    of the full judgement below.
//! 3. A direction that is not isolated for the subject passes.
//! 4. ICMP errors quoting a packet of a flow allowed earlier pass, like
//!    its replies.
//! 5. Otherwise the longest remote prefix in `POLICY_CIDRS` for
//!    (direction, subject) must hold a port match for the packet.
//!
//! Later fragments follow their first fragment. Malformed or truncated IP
//! packets are dropped (the kernel would drop them anyway). Everything the
//! programs need to decide lives in maps, so a policy update never touches
//! the attachment.

use core::ptr::NonNull;

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    btf_maps::{HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf, lpm_trie::Key},
    helpers::{bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use flatnet_common::{
    FrameCounter,
    policy::{
        CT_NO_RULE, CtEntry, CtKey, CtVerdict, Direction, DropReason, EventBudget, FRAG_TIMEOUT_NS,
        Flow, FragEntry, FragKey, Fragment, ICMP_ERROR_HEADER_LEN, IPV4_MIN_LEN, Ipv6Ext,
        LPM_FIXED_BITS, MAX_IPV6_EXTENSIONS, POLICY_CIDRS_MAX_ENTRIES, POLICY_CT_MAX_ENTRIES,
        POLICY_EVENT_RING_BYTES, POLICY_FRAG_MAX_ENTRIES, POLICY_RULES_MAX,
        POLICY_SUBJECTS_MAX_ENTRIES, PolicyAllow, PolicyDropEvent, PolicyLpmData, PolicyStat,
        PolicySubject, PolicySubjectKey, has_ports, icmp_ports, ipv6_ext, is_icmp_error,
        is_ipv6_control, is_ipv6_extension, parse_ipv4, parse_ipv6, proto,
    },
};

use crate::{
    TC_PASS,
    headers::{
        ETH_P_ARP, ETH_P_IPV6, IPV6_HDR_LEN, ParseError, l3_protocol, load_into, read_be16, read_u8,
    },
};

const ETH_P_IP: u16 = 0x0800;

#[btf_map]
static POLICY_CIDRS: LpmTrie<PolicyLpmData, PolicyAllow, { POLICY_CIDRS_MAX_ENTRIES as usize }> =
    LpmTrie::new();

#[btf_map]
static POLICY_SUBJECTS: HashMap<
    PolicySubjectKey,
    PolicySubject,
    { POLICY_SUBJECTS_MAX_ENTRIES as usize },
> = HashMap::new();

#[btf_map]
static POLICY_RULES: PerCpuArray<FrameCounter, { POLICY_RULES_MAX as usize }> = PerCpuArray::new();

#[btf_map]
static POLICY_STATS: PerCpuArray<u64, { PolicyStat::COUNT as usize }> = PerCpuArray::new();

#[btf_map]
static POLICY_CT: LruHashMap<CtKey, CtEntry, { POLICY_CT_MAX_ENTRIES as usize }> =
    LruHashMap::new();

#[btf_map]
static POLICY_FRAGS: LruHashMap<FragKey, FragEntry, { POLICY_FRAG_MAX_ENTRIES as usize }> =
    LruHashMap::new();

#[btf_map]
static POLICY_EVENTS: RingBuf<PolicyDropEvent, { POLICY_EVENT_RING_BYTES as usize }> =
    RingBuf::new();

#[btf_map]
static POLICY_EVBUDGET: PerCpuArray<EventBudget, 1> = PerCpuArray::new();

#[classifier]
pub fn policy_ingress(ctx: TcContext) -> i32 {
    enforce(&ctx, Direction::Ingress)
}

#[classifier]
pub fn policy_egress(ctx: TcContext) -> i32 {
    enforce(&ctx, Direction::Egress)
}

/// What parsing found in a frame.
enum Parsed {
    /// Not subject to policy (ARP, NDP/MLD, non-IP); the stat to count.
    Pass(PolicyStat),
    /// An IP packet.
    Ip(Packet),
    /// An IP packet the program cannot judge; the addresses when readable.
    Malformed([u8; 16], [u8; 16]),
}

/// An IP packet as the policy sees it.
struct Packet {
    flow: Flow,
    fragment: Fragment,
    /// Whether the L4 header the protocol needs could be read. Always true
    /// for later fragments (they have none) and port-less protocols.
    l4_complete: bool,
    /// For an ICMP error: the offset of the IP header it quotes; 0 for
    /// other packets. (A plain offset, not an `Option`: the verifier
    /// rejects the code LLVM generates for an `Option` here.)
    quoted_l3: usize,
}

impl Packet {
    /// The destination port a rule matches against, if the protocol has ports.
    #[inline(always)]
    fn policy_port(&self) -> Option<u16> {
        if has_ports(self.flow.protocol) && self.l4_complete {
            Some(self.flow.dst_port)
        } else {
            None
        }
    }
}

#[inline(always)]
fn enforce(ctx: &TcContext, direction: Direction) -> i32 {
    match parse(ctx) {
        Parsed::Pass(stat) => {
            bump(stat);
            TC_PASS
        }
        Parsed::Malformed(src, dst) => {
            let flow = Flow {
                src,
                dst,
                src_port: 0,
                dst_port: 0,
                protocol: 0,
            };
            drop_packet(ctx, direction, DropReason::Malformed, &flow)
        }
        Parsed::Ip(packet) => decide(ctx, direction, &packet),
    }
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Parsed {
    // A frame too short for an Ethernet header cannot carry IP.
    let Ok((ether_type, l3)) = l3_protocol(ctx) else {
        return Parsed::Pass(PolicyStat::PassedNonIp);
    };
    match ether_type {
        ETH_P_IP => parse_v4(ctx, l3),
        ETH_P_IPV6 => parse_v6(ctx, l3),
        ETH_P_ARP => Parsed::Pass(PolicyStat::AllowedNeighbor),
        _ => Parsed::Pass(PolicyStat::PassedNonIp),
    }
}

#[inline(always)]
fn parse_v4(ctx: &TcContext, l3: usize) -> Parsed {
    let Ok(header) = ctx.load::<[u8; IPV4_MIN_LEN]>(l3) else {
        return Parsed::Malformed([0; 16], [0; 16]);
    };
    let Some(info) = parse_ipv4(&header) else {
        return Parsed::Malformed([0; 16], [0; 16]);
    };
    transport(
        ctx,
        info.src,
        info.dst,
        info.protocol,
        info.fragment,
        l3 + info.header_len,
    )
}

#[inline(always)]
fn parse_v6(ctx: &TcContext, l3: usize) -> Parsed {
    let Ok(header) = ctx.load::<[u8; 40]>(l3) else {
        return Parsed::Malformed([0; 16], [0; 16]);
    };
    let Some(info) = parse_ipv6(&header) else {
        return Parsed::Malformed([0; 16], [0; 16]);
    };
    let mut next = info.next_header;
    let mut offset = l3 + 40;
    let mut fragment = Fragment::None;
    for _ in 0..MAX_IPV6_EXTENSIONS {
        if !is_ipv6_extension(next) {
            break;
        }
        let Ok(bytes) = ctx.load::<[u8; 8]>(offset) else {
            return Parsed::Malformed(info.src, info.dst);
        };
        match ipv6_ext(next, &bytes) {
            Ipv6Ext::Skip { next: n, len } => {
                next = n;
                offset += len;
            }
            Ipv6Ext::Fragment {
                next: n,
                later,
                more,
                id,
            } => {
                next = n;
                offset += 8;
                if later {
                    // No upper-layer header follows in this fragment.
                    return transport(ctx, info.src, info.dst, n, Fragment::Later { id }, offset);
                }
                if more {
                    fragment = Fragment::First { id };
                }
            }
            Ipv6Ext::Upper => break,
        }
    }
    if is_ipv6_extension(next) {
        // More extension headers than the program walks: it cannot find the
        // upper-layer protocol, so it cannot judge the packet.
        return Parsed::Malformed(info.src, info.dst);
    }
    transport(ctx, info.src, info.dst, next, fragment, offset)
}

/// Reads the transport ports (or ICMP identifier) at `l4`.
#[inline(always)]
fn transport(
    ctx: &TcContext,
    src: [u8; 16],
    dst: [u8; 16],
    protocol: u8,
    fragment: Fragment,
    l4: usize,
) -> Parsed {
    let mut packet = Packet {
        flow: Flow {
            src,
            dst,
            src_port: 0,
            dst_port: 0,
            protocol,
        },
        fragment,
        l4_complete: true,
        quoted_l3: 0,
    };
    if let Fragment::Later { .. } = fragment {
        return Parsed::Ip(packet);
    }
    if has_ports(protocol) {
        match ctx.load::<[u8; 4]>(l4) {
            Ok(p) => {
                packet.flow.src_port = u16::from_be_bytes([p[0], p[1]]);
                packet.flow.dst_port = u16::from_be_bytes([p[2], p[3]]);
            }
            Err(_) => packet.l4_complete = false,
        }
    } else if protocol == proto::ICMP || protocol == proto::ICMPV6 {
        match ctx.load::<[u8; 8]>(l4) {
            Ok(h) => {
                if protocol == proto::ICMPV6 && is_ipv6_control(h[0]) {
                    return Parsed::Pass(PolicyStat::AllowedNeighbor);
                }
                if let Some((s, d)) = icmp_ports(protocol, &h) {
                    packet.flow.src_port = s;
                    packet.flow.dst_port = d;
                }
                if is_icmp_error(protocol, h[0]) {
                    packet.quoted_l3 = l4 + ICMP_ERROR_HEADER_LEN;
                }
            }
            Err(_) => packet.l4_complete = false,
        }
    }
    Parsed::Ip(packet)
}

#[inline(always)]
fn decide(ctx: &TcContext, direction: Direction, packet: &Packet) -> i32 {
    let flow = &packet.flow;
    let (subject, remote) = match direction {
        Direction::Ingress => (flow.dst, flow.src),
        Direction::Egress => (flow.src, flow.dst),
    };
    let now = flow_clock_ns();
    let later_fragment = matches!(packet.fragment, Fragment::Later { .. });
    let entry = if packet.l4_complete && !later_fragment {
        live_ct_entry(flow, direction, now)
    } else {
        None
    };
    // Replies pass whatever the subject's policy says now, so they are
    // settled before that policy is even looked up.
    if let Some(entry) = entry
        && pass_reply(entry, now)
    {
        remember_fragment(packet, direction, now);
        bump(PolicyStat::AllowedReply);
        return TC_PASS;
    }

    // SAFETY: the value is copied out at once.
    let policy = unsafe { POLICY_SUBJECTS.get(PolicySubjectKey { addr: subject }) }
        .copied()
        .unwrap_or_default();
    let isolated = policy.is_isolated(direction);

    if let Fragment::Later { id } = packet.fragment {
        if !isolated {
            bump(PolicyStat::AllowedNotIsolated);
            return TC_PASS;
        }
        let key = frag_key(flow, id, direction);
        // SAFETY: the value is copied out at once.
        let alive = unsafe { POLICY_FRAGS.get(key) }
            .is_some_and(|e| now.saturating_sub(e.last_seen_ns) < FRAG_TIMEOUT_NS);
        if alive {
            bump(PolicyStat::AllowedFragment);
            return TC_PASS;
        }
        return drop_packet(ctx, direction, DropReason::Fragment, flow);
    }

    if let Some(entry) = entry
        && let CtVerdict::Allowed { rule } =
            allowed_flow(entry, flow, direction, now, policy.policy_digest)
    {
        remember_fragment(packet, direction, now);
        if rule == CT_NO_RULE {
            bump(PolicyStat::AllowedNotIsolated);
        } else {
            count_rule(rule, ctx.len());
            bump(PolicyStat::AllowedByRule);
        }
        return TC_PASS;
    }
    if !isolated {
        if packet.l4_complete {
            remember(packet, direction, now, policy.policy_digest, CT_NO_RULE);
        }
        bump(PolicyStat::AllowedNotIsolated);
        return TC_PASS;
    }
    if !packet.l4_complete {
        return drop_packet(ctx, direction, DropReason::Malformed, flow);
    }
    if packet.quoted_l3 != 0
        && is_related(
            ctx,
            &RelatedSubject {
                addr: subject,
                policy_digest: policy.policy_digest,
            },
            flow.protocol,
            packet.quoted_l3,
            direction,
        )
    {
        bump(PolicyStat::AllowedRelated);
        return TC_PASS;
    }
    let key = Key::new(
        LPM_FIXED_BITS + 128,
        PolicyLpmData {
            direction: direction as u32,
            subject,
            remote,
        },
    );
    let rule = POLICY_CIDRS
        .get(&key)
        .and_then(|allow| allow.first_match(flow.protocol, packet.policy_port()));
    match rule {
        Some(rule) => {
            count_rule(rule, ctx.len());
            remember(packet, direction, now, policy.policy_digest, rule);
            bump(PolicyStat::AllowedByRule);
            TC_PASS
        }
        None => drop_packet(ctx, direction, DropReason::NoRule, flow),
    }
}

/// The clock of connection tracking and fragments. Their timeouts are
/// seconds long, so the tick-grained coarse clock does, and it is cheaper
/// to read than the precise one on every packet.
#[inline(always)]
fn flow_clock_ns() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_coarse_ns() }
}

/// The live connection-tracking entry of the packet's flow, if any.
///
/// `NonNull`, whose `None` is the null pointer: an `Option` of a raw pointer
/// carries an uninitialised pointer when `None`. A BPF function of its own:
/// inlined into `decide`, LLVM spilled a register left uninitialised on the
/// neighbour-discovery path, which the verifier rejects.
#[inline(never)]
fn live_ct_entry(flow: &Flow, direction: Direction, now: u64) -> Option<NonNull<CtEntry>> {
    let entry = NonNull::new(POLICY_CT.get_ptr_mut(flow.ct_key(direction))?)?;
    // SAFETY: the pointer from the lookup is valid for this run.
    unsafe { entry.as_ref().alive(flow.protocol, now) }.then_some(entry)
}

/// Whether `entry` lets a reply through; a live reply entry is refreshed,
/// at most once per refresh interval.
#[inline(always)]
fn pass_reply(entry: NonNull<CtEntry>, now: u64) -> bool {
    let entry = entry.as_ptr();
    // SAFETY: the pointer from the lookup is valid for this run; a racing
    // refresh writes the same kind of timestamp.
    unsafe {
        if !(*entry).is_reply() {
            return false;
        }
        if (*entry).needs_refresh(now) {
            (*entry).last_seen_ns = now;
        }
    }
    true
}

/// What the live entry of an allowed flow says when the subject's policy
/// digest is `policy_digest` ([`CtVerdict::Stale`]: judge the packet
/// again). A flow still allowed is refreshed, at most once per refresh
/// interval, and with it its replies' entry, so a flow whose replies are
/// rare keeps them.
#[inline(always)]
fn allowed_flow(
    entry: NonNull<CtEntry>,
    flow: &Flow,
    direction: Direction,
    now: u64,
    policy_digest: u64,
) -> CtVerdict {
    let entry = entry.as_ptr();
    // SAFETY: as in `pass_reply`.
    let (verdict, refresh) = unsafe {
        let verdict = (*entry).verdict(policy_digest);
        let refresh = (*entry).needs_refresh(now) && verdict != CtVerdict::Stale;
        if refresh {
            (*entry).last_seen_ns = now;
        }
        (verdict, refresh)
    };
    if refresh {
        track_replies(flow, direction, now);
    }
    verdict
}

/// Whether an ICMP error quotes a packet of a flow of `subject` allowed
/// earlier: the quoted packet's flow is looked up like a reply of that flow
/// ([`Flow::related_ct_key`]). The error does not refresh the flow: only
/// the flow's own packets keep it alive.
///
/// An entry allowed under another policy digest than the subject's current
/// one relates nothing.
///
/// The subject's side of the quoted packet (its source on ingress, its
/// destination on egress) is taken from `subject`, not from the quote, so
/// an error only ever finds a flow of the pod it is addressed to (ingress)
/// or sent by (egress).
///
/// A separate BPF function with the key built in place: its frame is only
/// live during the call, which keeps the programs within the 512-byte stack.
#[inline(never)]
fn is_related(
    ctx: &TcContext,
    subject: &RelatedSubject,
    error_protocol: u8,
    quoted_l3: usize,
    direction: Direction,
) -> bool {
    let mut key = AlignedCtKey(CtKey {
        src: [0; 16],
        dst: [0; 16],
        src_port: 0,
        dst_port: 0,
        protocol: 0,
        direction: direction as u8,
        reserved: [0; 2],
    });
    if read_quoted(
        ctx,
        error_protocol,
        quoted_l3,
        direction,
        &subject.addr,
        &mut key.0,
    )
    .is_err()
    {
        return false;
    }
    let now = flow_clock_ns();
    // SAFETY: the value is copied out at once.
    unsafe { POLICY_CT.get(key.0) }.is_some_and(|e| {
        e.alive(key.0.protocol, now) && e.verdict(subject.policy_digest) != CtVerdict::Stale
    })
}

/// The pod an ICMP error concerns, as [`is_related`] needs it (one argument:
/// BPF functions take at most five).
struct RelatedSubject {
    addr: [u8; 16],
    policy_digest: u64,
}

/// A [`CtKey`] on the stack, aligned for word-wise copies.
#[repr(C, align(8))]
struct AlignedCtKey(CtKey);

/// Fills `key` with the related key of the packet an ICMP error quotes at
/// `l3`: its IP header (IPv4 in ICMP, IPv6 without extension headers in
/// ICMPv6) and the first 8 bytes of its L4 header. Fails when the quote is
/// cut short, is not of the error's family, or is a later fragment (no L4
/// header to read).
///
/// The key is the quoted flow's reply key ([`Flow::related_ct_key`]):
/// the quoted destination and destination port come first.
#[inline(always)]
fn read_quoted(
    ctx: &TcContext,
    error_protocol: u8,
    l3: usize,
    direction: Direction,
    subject: &[u8; 16],
    key: &mut CtKey,
) -> Result<(), ParseError> {
    // Replies travel from the quoted destination to the quoted source: on
    // ingress the subject is the quoted source (key.dst), on egress the
    // quoted destination (key.src).
    // The remote address is the quoted destination on ingress and the
    // quoted source on egress; its offsets in the IPv4 and IPv6 headers.
    let (subject_side, remote_side, remote_v4, remote_v6) = match direction {
        Direction::Ingress => (&mut key.dst, &mut key.src, 16, 24),
        Direction::Egress => (&mut key.src, &mut key.dst, 12, 8),
    };
    *subject_side = *subject;
    let version_ihl = read_u8(ctx, l3)?;
    let l4 = if error_protocol == proto::ICMP {
        let header_len = usize::from(version_ihl & 0x0f) * 4;
        if version_ihl >> 4 != 4 || header_len < IPV4_MIN_LEN {
            return Err(ParseError::Truncated);
        }
        if read_be16(ctx, l3 + 6)? & 0x1fff != 0 {
            return Err(ParseError::Truncated);
        }
        key.protocol = read_u8(ctx, l3 + 9)?;
        remote_side[10] = 0xff;
        remote_side[11] = 0xff;
        let mut v4 = [0u8; 4];
        load_into(ctx, l3 + remote_v4, &mut v4)?;
        remote_side[12..].copy_from_slice(&v4);
        l3 + header_len
    } else {
        if version_ihl >> 4 != 6 {
            return Err(ParseError::Truncated);
        }
        key.protocol = read_u8(ctx, l3 + 6)?;
        if is_ipv6_extension(key.protocol) {
            return Err(ParseError::Truncated);
        }
        load_into(ctx, l3 + remote_v6, remote_side)?;
        l3 + IPV6_HDR_LEN
    };
    let (src_port, dst_port) = if has_ports(key.protocol) {
        (read_be16(ctx, l4)?, read_be16(ctx, l4 + 2)?)
    } else if key.protocol == error_protocol {
        // An ICMP echo is tracked by its identifier.
        let h: [u8; 8] = ctx.load(l4).map_err(|_| ParseError::Truncated)?;
        icmp_ports(key.protocol, &h).ok_or(ParseError::Truncated)?
    } else {
        (0, 0)
    };
    key.src_port = dst_port;
    key.dst_port = src_port;
    Ok(())
}

/// Tracks the flow of a packet just allowed under `policy_digest` by `rule`
/// (or [`CT_NO_RULE`]): its later packets pass on the tracking entry while
/// the digest holds, its replies pass, and so do its later fragments when it
/// is a first fragment.
#[inline(always)]
fn remember(packet: &Packet, direction: Direction, now: u64, policy_digest: u64, rule: u32) {
    let flow = &packet.flow;
    // A full LRU map evicts its oldest entry; an error only means this
    // flow's packets are judged by the policy like any other packet.
    let _ = POLICY_CT.insert(
        flow.ct_key(direction),
        CtEntry::allowed(now, policy_digest, rule),
        0,
    );
    track_replies(flow, direction, now);
    remember_fragment(packet, direction, now);
}

/// Lets the replies of `flow` through, whatever the policy says, for the
/// flow timeout from `now`.
#[inline(always)]
fn track_replies(flow: &Flow, direction: Direction, now: u64) {
    let _ = POLICY_CT.insert(flow.reply_ct_key(direction), CtEntry::reply(now), 0);
}

#[inline(always)]
fn remember_fragment(packet: &Packet, direction: Direction, now: u64) {
    if let Fragment::First { id } = packet.fragment {
        let key = frag_key(&packet.flow, id, direction);
        let _ = POLICY_FRAGS.insert(key, FragEntry { last_seen_ns: now }, 0);
    }
}

#[inline(always)]
fn frag_key(flow: &Flow, id: u32, direction: Direction) -> FragKey {
    FragKey {
        src: flow.src,
        dst: flow.dst,
        id,
        protocol: flow.protocol,
        direction: direction as u8,
        reserved: [0; 2],
    }
}

/// Drops the packet: counts it and reports it within the rate limit.
#[inline(always)]
fn drop_packet(ctx: &TcContext, direction: Direction, reason: DropReason, flow: &Flow) -> i32 {
    bump(match reason {
        DropReason::NoRule => PolicyStat::DeniedNoRule,
        DropReason::Fragment => PolicyStat::DeniedFragment,
        DropReason::Malformed => PolicyStat::DeniedMalformed,
    });
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let allowed = match POLICY_EVBUDGET.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
        Some(budget) => unsafe { (*budget).take(now) },
        None => false,
    };
    if !allowed {
        bump(PolicyStat::EventsSuppressed);
        return TC_ACT_SHOT;
    }
    // Logged within the event budget, so a flood of drops cannot flood the log.
    crate::log::dropped(ctx, direction, flow, reason);
    let event = PolicyDropEvent {
        timestamp_ns: now,
        src: flow.src,
        dst: flow.dst,
        src_port: flow.src_port,
        dst_port: flow.dst_port,
        protocol: flow.protocol,
        direction: direction as u8,
        reason: reason as u8,
        reserved: 0,
        len: ctx.len(),
        reserved2: 0,
    };
    if POLICY_EVENTS.output(event, 0).is_err() {
        bump(PolicyStat::EventsSuppressed);
    }
    TC_ACT_SHOT
}

#[inline(always)]
fn count_rule(rule: u32, len: u32) {
    if let Some(counter) = POLICY_RULES.get_ptr_mut(rule) {
        // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
        unsafe {
            (*counter).packets += 1;
            (*counter).bytes += u64::from(len);
        }
    }
}

#[inline(always)]
fn bump(stat: PolicyStat) {
    if let Some(value) = POLICY_STATS.get_ptr_mut(stat as u32) {
        // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
        unsafe { *value += 1 };
    }
}
