//! TC ingress program for uplink (master / VLAN) interfaces.
//!
//! Counts the ARP and IPv6 neighbour-discovery frames arriving from the LAN,
//! per kind, and answers ARP requests and neighbour solicitations for the
//! exact addresses listed in the responder maps with the listed MAC (for
//! addresses that live behind the node, such as ipvlan L3 pods). Answers are
//! rewritten in place and sent back out of the same interface; every other
//! frame continues up the stack untouched. ARP and NDP frames in which a
//! foreign MAC claims a managed address are reported through a ring buffer.

use aya_ebpf::{
    bindings::{TC_ACT_PIPE, TC_ACT_REDIRECT},
    btf_maps::{HashMap, PerCpuArray, RingBuf},
    helpers::{bpf_ktime_get_ns, bpf_redirect, bpf_skb_change_tail},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use flatnet_common::{
    FrameCounter, FrameKind,
    conflict::{
        AddrKey, CONFLICT_RING_BYTES, Claim, ConflictEvent, MANAGED_MAX_ENTRIES, ManagedAddr,
        arp_claim, ndp_claim, should_report,
    },
    pin::RESPONDER_MAX_ENTRIES,
    responder::{
        ARP_LEN, ArpResponderKey, IPV6_LEN, NA_LEN, NS_LEN, NdpResponderKey, ResponderEntry,
        ResponderStat, arp_question, arp_reply, ipv6_dst_mac, ndp_question, neighbor_advertisement,
    },
};

use crate::headers::{
    ETH_P_ARP, ETH_P_IPV6, IPPROTO_ICMPV6, IPV6_HDR_LEN, ParseError, l3_protocol, read_be16,
    read_u8,
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

/// Offset of the opcode inside the ARP header.
const ARP_OPCODE_OFFSET: usize = 6;
/// Offset of the next-header field inside the IPv6 header.
const IPV6_NEXT_HEADER_OFFSET: usize = 6;
/// Offset of the Ethernet source address.
const ETH_SRC_OFFSET: usize = 6;

#[classifier]
pub fn uplink_ingress(ctx: TcContext) -> i32 {
    let verdict = judge(&ctx);
    // The record is built here, after the parser's frame is gone: both
    // together would not fit the 512-byte stack.
    crate::log::flush_deferred(&ctx);
    verdict
}

#[inline(never)]
fn judge(ctx: &TcContext) -> i32 {
    // A frame we cannot parse or answer is passed on, never dropped.
    try_uplink_ingress(ctx).unwrap_or(TC_ACT_PIPE)
}

#[inline(always)]
fn try_uplink_ingress(ctx: &TcContext) -> Result<i32, ParseError> {
    let Some((kind, l3)) = classify(ctx)? else {
        return Ok(TC_ACT_PIPE);
    };
    count(kind, ctx.len());
    let ifindex = ingress_ifindex(ctx);
    match kind {
        FrameKind::ArpRequest | FrameKind::ArpReply => {
            let arp: [u8; ARP_LEN] = ctx.load(l3).map_err(|_| ParseError::Truncated)?;
            if let Some(claim) = arp_claim(&arp) {
                report_conflict(ifindex, &claim);
            }
            if kind == FrameKind::ArpRequest {
                return Ok(answer_arp(ctx, l3, ifindex, &arp));
            }
            Ok(TC_ACT_PIPE)
        }
        FrameKind::NeighborSolicitation | FrameKind::NeighborAdvertisement => {
            let ip6: [u8; IPV6_LEN] = ctx.load(l3).map_err(|_| ParseError::Truncated)?;
            let icmp: [u8; NS_LEN] = ctx.load(l3 + IPV6_LEN).map_err(|_| ParseError::Truncated)?;
            let eth_src: [u8; 6] = ctx
                .load(ETH_SRC_OFFSET)
                .map_err(|_| ParseError::Truncated)?;
            // The first option, when there is one.
            let option: [u8; 8] = ctx.load(l3 + IPV6_LEN + NS_LEN).unwrap_or([0; 8]);
            if let Some(claim) = ndp_claim(&ip6, &icmp, &option, eth_src) {
                report_conflict(ifindex, &claim);
            }
            if kind == FrameKind::NeighborSolicitation {
                return Ok(answer_neighbor_solicitation(ctx, l3, ifindex, &ip6, &icmp));
            }
            Ok(TC_ACT_PIPE)
        }
        _ => Ok(TC_ACT_PIPE),
    }
}

/// Reports `claim` when it is made on a managed address with a foreign MAC,
/// at most once per [`flatnet_common::conflict::REPORT_INTERVAL_NS`] per address.
#[inline(always)]
fn report_conflict(ifindex: u32, claim: &Claim) {
    let key = AddrKey {
        ifindex,
        addr: claim.addr,
    };
    let Some(owner) = MANAGED_ADDRS.get_ptr_mut(key) else {
        return;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: the pointer from the lookup is valid for this program run;
    // a racing update of `last_report_ns` at worst reports twice.
    let owner_mac = unsafe {
        if !should_report(&*owner, claim.mac, now) {
            return;
        }
        (*owner).last_report_ns = now;
        (*owner).owner_mac
    };
    let event = ConflictEvent {
        timestamp_ns: now,
        ifindex,
        kind: claim.kind as u32,
        addr: claim.addr,
        foreign_mac: claim.mac,
        owner_mac,
        reserved: [0; 4],
    };
    crate::log::defer(
        crate::log::Deferred::Conflict,
        &claim.addr,
        ifindex,
        &claim.mac,
        &owner_mac,
    );
    // A full ring buffer drops the event; the next claim after the interval reports again.
    let _ = CONFLICT_EVENTS.output(event, 0);
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
        return TC_ACT_PIPE;
    };
    let key = ArpResponderKey {
        ifindex,
        addr: question.target,
    };
    // SAFETY: the entry is copied out immediately; the agent may replace it concurrently.
    let Some(entry) = (unsafe { ARP_RESPONDER.get(key) }).copied() else {
        return TC_ACT_PIPE;
    };
    let reply = arp_reply(request, entry.mac);
    let eth = ethernet_addresses(question.requester_mac, entry.mac);
    if ctx.store(0, &eth, 0).is_err() || ctx.store(l3, &reply, 0).is_err() {
        return TC_ACT_PIPE;
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

/// Answers a neighbour solicitation for a listed address with a neighbour
/// advertisement; returns the verdict.
#[inline(always)]
fn answer_neighbor_solicitation(
    ctx: &TcContext,
    l3: usize,
    ifindex: u32,
    ip6: &[u8; IPV6_LEN],
    ns: &[u8; NS_LEN],
) -> i32 {
    let Some(question) = ndp_question(ip6, ns) else {
        return TC_ACT_PIPE;
    };
    let Ok(requester_mac) = ctx.load::<[u8; 6]>(ETH_SRC_OFFSET) else {
        return TC_ACT_PIPE;
    };
    let key = NdpResponderKey {
        ifindex,
        addr: question.target,
    };
    // SAFETY: the entry is copied out immediately; the agent may replace it concurrently.
    let Some(entry) = (unsafe { NDP_RESPONDER.get(key) }).copied() else {
        return TC_ACT_PIPE;
    };
    let (reply_ip6, advertisement) = neighbor_advertisement(&question, &entry);
    let mut reply_dst = [0u8; 16];
    reply_dst.copy_from_slice(&reply_ip6[24..40]);
    let eth = ethernet_addresses(ipv6_dst_mac(&reply_dst, requester_mac), entry.mac);

    // The advertisement replaces the solicitation and its options exactly.
    let new_len = (l3 + IPV6_LEN + NA_LEN) as u32;
    // SAFETY: the context pointer is valid; the helper checks the length.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, new_len, 0) } != 0 {
        return TC_ACT_PIPE;
    }
    if ctx.store(0, &eth, 0).is_err()
        || ctx.store(l3, &reply_ip6, 0).is_err()
        || ctx.store(l3 + IPV6_LEN, &advertisement, 0).is_err()
    {
        // The frame was already resized: it is no longer a valid
        // solicitation; it goes on and the stack drops it.
        return TC_ACT_PIPE;
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
        TC_ACT_PIPE
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
