//! TC ingress program for uplink (master / VLAN) interfaces.
//!
//! Counts the ARP and IPv6 neighbour-discovery frames arriving from the LAN,
//! per kind, and answers ARP requests and neighbour solicitations for the
//! exact addresses listed in the responder maps with the listed MAC (for
//! addresses that live behind the node, such as ipvlan L3 pods). Answers are
//! rewritten in place and sent back out of the same interface; every other
//! frame continues up the stack untouched. ARP and NDP frames in which a
//! foreign MAC claims a managed address are reported through a ring buffer,
//! and every address an ARP or NDP frame names with a MAC goes into the
//! wire inventory (`WIRE_CLAIMS`, see `flatnet_common::wire`). The
//! requesters of ARP requests and neighbour solicitations for watched
//! (floating) addresses go into `RESOLVERS` (see `flatnet_common::resolver`).
//! A frame between two of the node's own MACs (`NODE_MACS`) never was on
//! the wire and claims nothing (see `flatnet_common::node_macs`).

use aya_ebpf::{
    bindings::TC_ACT_REDIRECT,
    btf_maps::{HashMap, LruHashMap, PerCpuArray, RingBuf},
    helpers::{bpf_ktime_get_ns, bpf_redirect, bpf_skb_change_tail},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use flatnet_common::{
    FrameCounter, FrameKind,
    conflict::{
        AddrKey, CONFLICT_RING_BYTES, ConflictEvent, MANAGED_MAX_ENTRIES, ManagedAddr,
        RECENT_CONFLICTS_MAX_ENTRIES, RecentConflict, should_report, vlan_id,
    },
    node_macs::{NODE_MACS_MAX_ENTRIES, NodeMac},
    pin::RESPONDER_MAX_ENTRIES,
    resolver::{
        RESOLVE_WATCH_MAX_ENTRIES, RESOLVERS_MAX_ENTRIES, Resolution, ResolverKey, ResolverSeen,
        arp_resolution, ndp_resolution,
    },
    responder::{
        ARP_LEN, ArpResponderKey, IPV6_LEN, NA_LEN, NS_LEN, NdpAnswer, NdpResponderKey,
        ResponderEntry, ResponderStat, arp_question, arp_reply, ipv6_dst_mac, ndp_question,
        neighbor_advertisement,
    },
    wire::{
        Sighting, WIRE_CLAIMS_MAX_ENTRIES, WireClaim, WireKey, WireKind, arp_sighting,
        ndp_has_option, ndp_sighting,
    },
};

use crate::{
    TC_PASS,
    headers::{
        ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IPV6, IPPROTO_ICMPV6, IPV6_HDR_LEN, ParseError,
        l3_protocol, read_be16, read_u8,
    },
};

#[btf_map]
static FRAME_COUNTERS: PerCpuArray<FrameCounter, { FrameKind::COUNT as usize }> =
    PerCpuArray::new();

#[btf_map]
static ARP_RESPONDER: HashMap<ArpResponderKey, ResponderEntry, { RESPONDER_MAX_ENTRIES as usize }> =
    HashMap::new();

#[btf_map]
static NDP_RESPONDER: HashMap<NdpResponderKey, ResponderEntry, { RESPONDER_MAX_ENTRIES as usize }> =
    HashMap::new();

#[btf_map]
static RESPONDER_STATS: PerCpuArray<u64, { ResponderStat::COUNT as usize }> = PerCpuArray::new();

#[btf_map]
static MANAGED_ADDRS: HashMap<AddrKey, ManagedAddr, { MANAGED_MAX_ENTRIES as usize }> =
    HashMap::new();

#[btf_map]
static CONFLICT_EVENTS: RingBuf<ConflictEvent, { CONFLICT_RING_BYTES as usize }> = RingBuf::new();

#[btf_map]
static RECENT_CONFLICT: LruHashMap<
    AddrKey,
    RecentConflict,
    { RECENT_CONFLICTS_MAX_ENTRIES as usize },
> = LruHashMap::new();

#[btf_map]
static WIRE_CLAIMS: LruHashMap<WireKey, WireClaim, { WIRE_CLAIMS_MAX_ENTRIES as usize }> =
    LruHashMap::new();

#[btf_map]
static NODE_MACS: HashMap<NodeMac, u8, { NODE_MACS_MAX_ENTRIES as usize }> = HashMap::new();

#[btf_map]
static RESOLVE_WATCH: HashMap<AddrKey, u32, { RESOLVE_WATCH_MAX_ENTRIES as usize }> =
    HashMap::new();

#[btf_map]
static RESOLVERS: LruHashMap<ResolverKey, ResolverSeen, { RESOLVERS_MAX_ENTRIES as usize }> =
    LruHashMap::new();

/// Offset of the opcode inside the ARP header.
const ARP_OPCODE_OFFSET: usize = 6;
/// Offset of the next-header field inside the IPv6 header.
const IPV6_NEXT_HEADER_OFFSET: usize = 6;
/// Offset of the Ethernet source address.
const ETH_SRC_OFFSET: usize = 6;
/// Offset of the (outer) EtherType.
const ETH_TYPE_OFFSET: usize = 12;

/// A claim seen by the parser, handled once the parser returned.
#[repr(C)]
struct PendingClaim {
    addr: [u8; 16],
    mac: [u8; 6],
    vlan: u16,
    ifindex: u32,
    kind: u32,
}

/// One slot per CPU: a TC program run is never interrupted on its CPU by another.
#[btf_map]
static PENDING_CLAIM: PerCpuArray<PendingClaim, 1> = PerCpuArray::new();

/// A request seen by the parser, recorded once the parser returned.
#[repr(C)]
struct PendingResolution {
    target: [u8; 16],
    requester: [u8; 16],
    mac: [u8; 6],
    reserved: u16,
    ifindex: u32,
}

/// One slot per CPU, as for claims.
#[btf_map]
static PENDING_RESOLUTION: PerCpuArray<PendingResolution, 1> = PerCpuArray::new();

/// The advertisement being built: one slot per CPU, as for claims. Built on
/// the stack it would take [`answer_neighbor_solicitation`]'s frame past what
/// Linux 6.1 allows a called function.
#[btf_map]
static NDP_ANSWER: PerCpuArray<NdpAnswer, 1> = PerCpuArray::new();

/// Set in [`judge`]'s result when a claim waits in `PENDING_CLAIM`.
const CLAIM_PENDING: u64 = 1 << 32;
/// Set in [`judge`]'s result when a neighbour solicitation is to be answered;
/// the offset of its IPv6 header is in the 16 bits from [`L3_SHIFT`].
const ANSWER_SOLICITATION: u64 = 1 << 33;
const L3_SHIFT: u32 = 40;
/// Set in [`judge`]'s result when a request waits in `PENDING_RESOLUTION`.
const RESOLUTION_PENDING: u64 = 1 << 34;

#[classifier]
pub fn uplink_ingress(ctx: TcContext) -> i32 {
    // The parser's frame nearly fills the 512-byte stack, which the kernel
    // counts across calls; so conflicts and log records, which need room
    // of their own, are handled after it returned.
    let outcome = judge(&ctx);
    if outcome & CLAIM_PENDING != 0 {
        handle_claim(&ctx);
    }
    if outcome & RESOLUTION_PENDING != 0 {
        handle_resolution(&ctx);
    }
    // The low 32 bits carry the verdict's bit pattern.
    let mut verdict = (outcome as u32).cast_signed();
    if outcome & ANSWER_SOLICITATION != 0 {
        let l3 = ((outcome >> L3_SHIFT) & 0xffff) as usize;
        verdict = answer_neighbor_solicitation(&ctx, l3);
    }
    crate::log::flush_deferred(&ctx);
    verdict
}

/// The verdict in the low 32 bits, [`CLAIM_PENDING`], [`ANSWER_SOLICITATION`]
/// and [`RESOLUTION_PENDING`] above them.
#[inline(never)]
fn judge(ctx: &TcContext) -> u64 {
    // A frame we cannot parse or answer is passed on, never dropped.
    match try_uplink_ingress(ctx) {
        Ok((verdict, claim)) => verdict | if claim { CLAIM_PENDING } else { 0 },
        Err(_) => u64::from(TC_PASS.cast_unsigned()),
    }
}

/// The verdict (with [`ANSWER_SOLICITATION`] when one is to be answered),
/// and whether a claim was noted for [`handle_claim`].
#[inline(always)]
fn try_uplink_ingress(ctx: &TcContext) -> Result<(u64, bool), ParseError> {
    let pass = u64::from(TC_PASS.cast_unsigned());
    let Some((kind, l3)) = classify(ctx)? else {
        return Ok((pass, false));
    };
    count(kind, ctx.len());
    let ifindex = ingress_ifindex(ctx);
    match kind {
        FrameKind::ArpRequest | FrameKind::ArpReply => {
            let arp: [u8; ARP_LEN] = ctx.load(l3).map_err(|_| ParseError::Truncated)?;
            let claimed = arp_sighting(&arp).is_some_and(|seen| note_claim(ifindex, &seen));
            if kind == FrameKind::ArpRequest {
                let asked =
                    arp_resolution(&arp).is_some_and(|request| note_resolution(ifindex, &request));
                let verdict = u64::from(answer_arp(ctx, l3, ifindex, &arp).cast_unsigned());
                return Ok((verdict | resolution_bit(asked), claimed));
            }
            Ok((pass, claimed))
        }
        FrameKind::NeighborSolicitation | FrameKind::NeighborAdvertisement => {
            let ip6: [u8; IPV6_LEN] = ctx.load(l3).map_err(|_| ParseError::Truncated)?;
            let icmp: [u8; NS_LEN] = ctx.load(l3 + IPV6_LEN).map_err(|_| ParseError::Truncated)?;
            let eth_src: [u8; 6] = ctx
                .load(ETH_SRC_OFFSET)
                .map_err(|_| ParseError::Truncated)?;
            // The first option, when the header says there is one: a frame
            // cut short of it is truncated, and names nobody.
            let option: [u8; 8] = if ndp_has_option(&ip6) {
                ctx.load(l3 + IPV6_LEN + NS_LEN)
                    .map_err(|_| ParseError::Truncated)?
            } else {
                [0; 8]
            };
            let claimed = ndp_sighting(&ip6, &icmp, &option, eth_src)
                .is_some_and(|seen| note_claim(ifindex, &seen));
            if kind == FrameKind::NeighborSolicitation {
                let asked = ndp_resolution(&ip6, &icmp, &option, eth_src)
                    .is_some_and(|request| note_resolution(ifindex, &request));
                // Answered after the parser returned: building the
                // advertisement needs stack room the parser's frame lacks.
                let answer = ANSWER_SOLICITATION | ((l3 as u64 & 0xffff) << L3_SHIFT);
                return Ok((pass | answer | resolution_bit(asked), claimed));
            }
            Ok((pass, claimed))
        }
        _ => Ok((pass, false)),
    }
}

/// Notes `claim` for [`handle_claim`]; false when there is no slot or the
/// inventory would not record it (then it is no conflict either: a claim
/// with a multicast MAC or on a non-unicast address is not a host's).
#[inline(always)]
fn note_claim(ifindex: u32, claim: &Sighting) -> bool {
    if !claim.recordable() {
        return false;
    }
    let Some(slot) = PENDING_CLAIM.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
    unsafe {
        (*slot).addr = claim.addr;
        (*slot).mac = claim.mac;
        (*slot).ifindex = ifindex;
        (*slot).kind = claim.kind as u32;
    }
    true
}

/// Every claim from the wire goes into the wire inventory (one between two
/// of the node's own MACs never was on it). A claim on a managed address
/// with a foreign MAC is a conflict: it is recorded in `RECENT_CONFLICT`
/// every time and reported through the ring buffer at most once per
/// [`flatnet_common::conflict::REPORT_INTERVAL_NS`] per address.
#[inline(never)]
fn handle_claim(ctx: &TcContext) {
    if within_node(ctx) {
        return;
    }
    let Some(slot) = PENDING_CLAIM.get_ptr(0) else {
        return;
    };
    // SAFETY: per-CPU slot written by this run's parser; copied out at once.
    let (addr, mac, ifindex, raw_kind) =
        unsafe { ((*slot).addr, (*slot).mac, (*slot).ifindex, (*slot).kind) };
    let Some(wire_kind) = WireKind::from_u8(raw_kind as u8) else {
        return;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let vlan = frame_vlan(ctx);
    let seen = WireClaim {
        mac,
        kind: wire_kind as u8,
        reserved: 0,
        last_seen_ns: now,
    };
    let wire_key = WireKey::address(ifindex, vlan, addr);
    // SAFETY: the pointer from the lookup is valid for this program run; a
    // racing update at worst writes the same claim twice.
    let fresh = WIRE_CLAIMS
        .get_ptr(wire_key)
        .is_some_and(|entry| unsafe { (*entry).refreshed_by(&seen) });
    if !fresh {
        // A full map evicts the claim seen longest ago.
        let _ = WIRE_CLAIMS.insert(wire_key, seen, 0);
    }
    let Some(kind) = wire_kind.claim() else {
        return;
    };
    let raw_kind = kind as u32;
    let key = AddrKey { ifindex, addr };
    let Some(owner) = MANAGED_ADDRS.get_ptr_mut(key) else {
        return;
    };
    // SAFETY: the pointer from the lookup is valid for this program run.
    let owner_mac = unsafe { (*owner).owner_mac };
    if mac == owner_mac {
        return;
    }
    // Copied into an initialised value: the verifier rejects reads of the
    // undefined parts an `Option` copy leaves when the entry is absent.
    let mut previous = RecentConflict {
        foreign_mac: [0; 6],
        vlan: 0,
        kind: 0,
        count: 0,
        first_seen_ns: 0,
        last_seen_ns: 0,
    };
    let found = match RECENT_CONFLICT.get_ptr(key) {
        Some(entry) => {
            // SAFETY: valid for this run; a racing update of the same
            // address at worst loses one count.
            previous = unsafe { *entry };
            true
        }
        None => false,
    };
    let recent = RecentConflict::after_claim(found.then_some(&previous), mac, kind, vlan, now);
    let _ = RECENT_CONFLICT.insert(key, recent, 0);

    // SAFETY: as above; a racing update of `last_report_ns` at worst reports twice.
    unsafe {
        if !should_report(&*owner, mac, now) {
            return;
        }
        (*owner).last_report_ns = now;
    }
    crate::log::conflict(ctx, &addr, ifindex, &mac, &owner_mac);
    let event = ConflictEvent {
        timestamp_ns: now,
        ifindex,
        kind: raw_kind,
        addr,
        foreign_mac: mac,
        owner_mac,
        reserved: [0; 4],
    };
    // A full ring buffer drops the event; the next claim after the interval reports again.
    let _ = CONFLICT_EVENTS.output(event, 0);
}

/// Whether the frame went from one of the node's own MACs to another: a
/// pod's frame to another pod (or to a node interface) on the same master,
/// which crosses the master's ingress without ever being on the wire.
#[inline(always)]
fn within_node(ctx: &TcContext) -> bool {
    let Ok(eth) = ctx.load::<[u8; 12]>(0) else {
        return false;
    };
    let dst = NodeMac::of([eth[0], eth[1], eth[2], eth[3], eth[4], eth[5]]);
    let src = NodeMac::of([eth[6], eth[7], eth[8], eth[9], eth[10], eth[11]]);
    NODE_MACS.get_ptr(src).is_some() && NODE_MACS.get_ptr(dst).is_some()
}

#[inline(always)]
fn resolution_bit(pending: bool) -> u64 {
    if pending { RESOLUTION_PENDING } else { 0 }
}

/// Notes `request` for [`handle_resolution`]; false when there is no slot.
#[inline(always)]
fn note_resolution(ifindex: u32, request: &Resolution) -> bool {
    let Some(slot) = PENDING_RESOLUTION.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
    unsafe {
        (*slot).target = request.target;
        (*slot).requester = request.requester;
        (*slot).mac = request.mac;
        (*slot).ifindex = ifindex;
    }
    true
}

/// Records the requester of a request for a watched address in
/// `RESOLVERS`; a request for any other address costs this one lookup.
#[inline(never)]
fn handle_resolution(ctx: &TcContext) {
    let Some(slot) = PENDING_RESOLUTION.get_ptr(0) else {
        return;
    };
    // SAFETY: per-CPU slot written by this run's parser; copied out at once.
    let (target, requester, mac, ifindex) = unsafe {
        (
            (*slot).target,
            (*slot).requester,
            (*slot).mac,
            (*slot).ifindex,
        )
    };
    let watch_key = AddrKey {
        ifindex,
        addr: target,
    };
    if RESOLVE_WATCH.get_ptr(watch_key).is_none() {
        return;
    }
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let key = ResolverKey {
        ifindex,
        vlan: frame_vlan(ctx),
        reserved: 0,
        addr: target,
        requester,
    };
    let seen = ResolverSeen {
        mac,
        reserved: [0; 2],
        last_seen_ns: now,
    };
    // SAFETY: the pointer from the lookup is valid for this program run; a
    // racing update at worst writes the same requester twice.
    let fresh = RESOLVERS
        .get_ptr(key)
        .is_some_and(|entry| unsafe { (*entry).refreshed_by(&seen) });
    if !fresh {
        // A full map evicts the requester heard from longest ago.
        let _ = RESOLVERS.insert(key, seen, 0);
    }
}

/// The VLAN id of the frame: from skb metadata when the driver took the tag
/// off, else from an in-frame 802.1Q / 802.1ad tag; 0 when untagged.
#[inline(always)]
fn frame_vlan(ctx: &TcContext) -> u16 {
    // SAFETY: the context pointer is valid for the whole program run.
    let (present, tci) = unsafe { ((*ctx.skb.skb).vlan_present, (*ctx.skb.skb).vlan_tci) };
    if present != 0 {
        return vlan_id(tci as u16);
    }
    match read_be16(ctx, ETH_TYPE_OFFSET) {
        Ok(ETH_P_8021Q | ETH_P_8021AD) => read_be16(ctx, ETH_TYPE_OFFSET + 2).map_or(0, vlan_id),
        _ => 0,
    }
}

/// Decides which [`FrameKind`] a frame is, if any, and where its L3 header starts.
#[inline(always)]
fn classify(ctx: &TcContext) -> Result<Option<(FrameKind, usize)>, ParseError> {
    let (ether_type, l3) = l3_protocol(ctx)?;
    match ether_type {
        ETH_P_ARP => {
            let opcode = read_be16(ctx, l3 + ARP_OPCODE_OFFSET)?;
            Ok(Some((FrameKind::from_arp_opcode(opcode), l3)))
        }
        ETH_P_IPV6 => {
            // NDP messages carry no extension headers in practice (RFC 4861
            // requires hop limit 255 and they are link-local), so only a
            // direct ICMPv6 next header is considered.
            if read_u8(ctx, l3 + IPV6_NEXT_HEADER_OFFSET)? != IPPROTO_ICMPV6 {
                return Ok(None);
            }
            let icmp_type = read_u8(ctx, l3 + IPV6_HDR_LEN)?;
            Ok(FrameKind::from_icmpv6_type(icmp_type).map(|kind| (kind, l3)))
        }
        _ => Ok(None),
    }
}

#[inline(always)]
fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is valid for the whole program run.
    unsafe { (*ctx.skb.skb).ifindex }
}

/// Answers an ARP request for a listed address with an ARP reply; returns the verdict.
#[inline(always)]
fn answer_arp(ctx: &TcContext, l3: usize, ifindex: u32, request: &[u8; ARP_LEN]) -> i32 {
    let Some(question) = arp_question(request) else {
        return TC_PASS;
    };
    let key = ArpResponderKey {
        ifindex,
        addr: question.target,
    };
    // SAFETY: the entry is copied out immediately; the agent may replace it concurrently.
    let Some(entry) = (unsafe { ARP_RESPONDER.get(key) }).copied() else {
        return TC_PASS;
    };
    // SAFETY: helper without arguments.
    if !entry.answers_at(unsafe { bpf_ktime_get_ns() }) {
        return TC_PASS;
    }
    let reply = arp_reply(request, entry.mac);
    let eth = ethernet_addresses(question.requester_mac, entry.mac);
    if ctx.store(0, &eth, 0).is_err() || ctx.store(l3, &reply, 0).is_err() {
        return TC_PASS;
    }
    bump(ResponderStat::ArpReplies);
    crate::log::defer(
        crate::log::Deferred::ArpAnswer,
        &flatnet_common::conflict::AddrKey::v4(0, question.target).addr,
        ifindex,
        &entry.mac,
        &requester_mac_of(&eth),
    );
    send_back(ifindex)
}

/// Answers a neighbour solicitation (IPv6 header at `l3`) for a listed
/// address with a neighbour advertisement; returns the verdict.
#[inline(never)]
fn answer_neighbor_solicitation(ctx: &TcContext, l3: usize) -> i32 {
    let ifindex = ingress_ifindex(ctx);
    let (Ok(ip6), Ok(ns)) = (
        ctx.load::<[u8; IPV6_LEN]>(l3),
        ctx.load::<[u8; NS_LEN]>(l3 + IPV6_LEN),
    ) else {
        return TC_PASS;
    };
    let Some(question) = ndp_question(&ip6, &ns) else {
        return TC_PASS;
    };
    let Ok(requester_mac) = ctx.load::<[u8; 6]>(ETH_SRC_OFFSET) else {
        return TC_PASS;
    };
    let key = NdpResponderKey {
        ifindex,
        addr: question.target,
    };
    // SAFETY: the entry is copied out immediately; the agent may replace it concurrently.
    let Some(entry) = (unsafe { NDP_RESPONDER.get(key) }).copied() else {
        return TC_PASS;
    };
    // SAFETY: helper without arguments.
    if !entry.answers_at(unsafe { bpf_ktime_get_ns() }) {
        return TC_PASS;
    }
    let Some(answer) = NDP_ANSWER.get_ptr_mut(0) else {
        return TC_PASS;
    };
    // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
    let answer = unsafe { &mut *answer };
    neighbor_advertisement(&question, &entry, answer);
    let eth = ethernet_addresses(ipv6_dst_mac(answer.destination(), requester_mac), entry.mac);

    // The advertisement replaces the solicitation and its options exactly.
    let new_len = (l3 + IPV6_LEN + NA_LEN) as u32;
    // SAFETY: the context pointer is valid; the helper checks the length.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, new_len, 0) } != 0 {
        return TC_PASS;
    }
    if ctx.store(0, &eth, 0).is_err()
        || ctx.store(l3, &answer.ip6, 0).is_err()
        || ctx.store(l3 + IPV6_LEN, &answer.na, 0).is_err()
    {
        // The frame was already resized: it is no longer a valid
        // solicitation; it goes on and the stack drops it.
        return TC_PASS;
    }
    bump(ResponderStat::NeighborAdvertisements);
    crate::log::defer(
        crate::log::Deferred::NdpAnswer,
        &question.target,
        ifindex,
        &entry.mac,
        &requester_mac,
    );
    send_back(ifindex)
}

/// The destination MAC of an answer's Ethernet addresses: the requester.
#[inline(always)]
fn requester_mac_of(eth: &[u8; 12]) -> [u8; 6] {
    [eth[0], eth[1], eth[2], eth[3], eth[4], eth[5]]
}

/// Destination then source MAC, as they sit at the start of the frame.
#[inline(always)]
fn ethernet_addresses(dst: [u8; 6], src: [u8; 6]) -> [u8; 12] {
    let mut eth = [0u8; 12];
    eth[..6].copy_from_slice(&dst);
    eth[6..].copy_from_slice(&src);
    eth
}

/// Sends the rewritten frame out of the interface it came in on.
#[inline(always)]
fn send_back(ifindex: u32) -> i32 {
    // SAFETY: plain helper call; flags 0 means egress.
    let verdict = unsafe { bpf_redirect(ifindex, 0) };
    if verdict == i64::from(TC_ACT_REDIRECT) {
        TC_ACT_REDIRECT
    } else {
        TC_PASS
    }
}

#[inline(always)]
fn count(kind: FrameKind, len: u32) {
    if let Some(counter) = FRAME_COUNTERS.get_ptr_mut(kind.index()) {
        // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
        unsafe {
            (*counter).packets += 1;
            (*counter).bytes += u64::from(len);
        }
    }
}

#[inline(always)]
fn bump(stat: ResponderStat) {
    if let Some(value) = RESPONDER_STATS.get_ptr_mut(stat as u32) {
        // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
        unsafe { *value += 1 };
    }
}
