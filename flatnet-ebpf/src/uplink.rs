//! TC ingress program for uplink (master / VLAN) interfaces.
//!
//! Counts the ARP and IPv6 neighbour-discovery frames arriving from the LAN,
//! per kind, so operators can see the L2 control traffic flatnet acts on.
//! Traffic is never modified or dropped here.

use aya_ebpf::{
    bindings::TC_ACT_PIPE,
    btf_maps::PerCpuArray,
    macros::{btf_map, classifier},
    programs::TcContext,
};
use flatnet_common::{FrameCounter, FrameKind};

use crate::headers::{
    ETH_P_ARP, ETH_P_IPV6, IPPROTO_ICMPV6, IPV6_HDR_LEN, ParseError, l3_protocol, read_be16,
    read_u8,
};

#[btf_map]
static FRAME_COUNTERS: PerCpuArray<FrameCounter, { FrameKind::COUNT as usize }> =
    PerCpuArray::new();

/// Offset of the opcode inside the ARP header.
const ARP_OPCODE_OFFSET: usize = 6;
/// Offset of the next-header field inside the IPv6 header.
const IPV6_NEXT_HEADER_OFFSET: usize = 6;

#[classifier]
pub fn uplink_ingress(ctx: TcContext) -> i32 {
    // Counting is best effort: an unparseable frame is still passed on.
    let _ = try_uplink_ingress(&ctx);
    TC_ACT_PIPE
}

#[inline(always)]
fn try_uplink_ingress(ctx: &TcContext) -> Result<(), ParseError> {
    if let Some(kind) = classify(ctx)? {
        count(kind, ctx.len());
    }
    Ok(())
}

/// Decides which [`FrameKind`] a frame is, if any.
#[inline(always)]
fn classify(ctx: &TcContext) -> Result<Option<FrameKind>, ParseError> {
    let (ether_type, l3) = l3_protocol(ctx)?;
    match ether_type {
        ETH_P_ARP => {
            let opcode = read_be16(ctx, l3 + ARP_OPCODE_OFFSET)?;
            Ok(Some(FrameKind::from_arp_opcode(opcode)))
        }
        ETH_P_IPV6 => {
            // NDP messages carry no extension headers in practice (RFC 4861
            // requires hop limit 255 and they are link-local), so only a
            // direct ICMPv6 next header is considered.
            if read_u8(ctx, l3 + IPV6_NEXT_HEADER_OFFSET)? != IPPROTO_ICMPV6 {
                return Ok(None);
            }
            let icmp_type = read_u8(ctx, l3 + IPV6_HDR_LEN)?;
            Ok(FrameKind::from_icmpv6_type(icmp_type))
        }
        _ => Ok(None),
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
