//! TC programs on a pod's primary interface: TCP MSS clamping.
//!
//! `mss_clamp_in` (TC ingress, into the pod) and `mss_clamp_out` (TC
//! egress, out of it) lower the MSS option of every SYN and SYN-ACK, IPv4
//! or IPv6, to what the interface's current MTU leaves for payload
//! (`flatnet_common::mss::clamp_for`), and fix the TCP checksum. The MTU is
//! read from the device at each packet (`bpf_check_mtu`), so the programs
//! need no configuration and follow every MTU change at once. Every other
//! frame, and any frame they cannot parse, passes untouched.

use aya_ebpf::{helpers::bpf_check_mtu, macros::classifier, programs::TcContext};
use flatnet_common::{
    mss::{TCP_CSUM_OFFSET, TCP_HDR_LEN, clamp_for, csum_words, for_each_mss, syn_options_len},
    policy::{
        Fragment, IPV4_MIN_LEN, Ipv6Ext, MAX_IPV6_EXTENSIONS, ipv6_ext, is_ipv6_extension,
        parse_ipv4, parse_ipv6, proto,
    },
};

use crate::{
    TC_PASS,
    headers::{ETH_P_IPV6, IPV6_HDR_LEN, l3_protocol, read_u8},
};

const ETH_P_IP: u16 = 0x0800;

#[classifier]
pub fn mss_clamp_in(ctx: TcContext) -> i32 {
    clamp(&ctx);
    TC_PASS
}

#[classifier]
pub fn mss_clamp_out(ctx: TcContext) -> i32 {
    clamp(&ctx);
    TC_PASS
}

/// Clamps the MSS options of `ctx` when it is a TCP SYN.
#[inline(always)]
fn clamp(ctx: &TcContext) {
    let Some((l4, ipv6)) = tcp_header(ctx) else {
        return;
    };
    let Ok(head) = ctx.load::<[u8; 14]>(l4) else {
        return;
    };
    let Some(options_len) = syn_options_len(&head) else {
        return;
    };
    let Some(mtu) = device_mtu(ctx) else {
        return;
    };
    let clamp = clamp_for(mtu, ipv6);
    if clamp == 0 {
        return;
    }
    let options = l4 + TCP_HDR_LEN;
    // Rewritten where found: carrying what the walk found across its steps
    // would keep the verifier from merging their paths.
    for_each_mss(
        options_len,
        |at| read_u8(ctx, options + at).ok(),
        |at, mss| {
            if mss > clamp {
                rewrite(ctx, l4, options + at, mss, clamp);
            }
        },
    );
}

/// Writes `new` over the MSS value `old` at `offset` and updates the TCP
/// checksum at `l4` by the difference (at an odd offset the value counts
/// byte-swapped: [`csum_words`]). A packet whose checksum the device
/// computes later (`CHECKSUM_PARTIAL`) keeps its pseudo-header sum: the
/// helper knows and leaves it.
#[inline(always)]
fn rewrite(ctx: &TcContext, l4: usize, offset: usize, old: u16, new: u16) {
    let (from, to) = csum_words(offset - l4, old, new);
    // The checksum first: should it fail, the packet is left as it was.
    if ctx
        .l4_csum_replace(l4 + TCP_CSUM_OFFSET, u64::from(from), u64::from(to), 2)
        .is_err()
    {
        return;
    }
    // No BPF_F_RECOMPUTE_CSUM: the checksum moved by the opposite of the
    // value, so a CHECKSUM_COMPLETE sum over the packet stays right.
    let _ = ctx.store(offset, &new.to_be_bytes(), 0);
}

/// The MTU of the device the packet is on (ingress: arriving, egress:
/// leaving).
#[inline(always)]
fn device_mtu(ctx: &TcContext) -> Option<u32> {
    let mut mtu: u32 = 0;
    // SAFETY: `ctx.skb` is this program's context and `mtu` a valid u32;
    // ifindex 0 means the skb's own device. The return value only says
    // whether the packet fits; the MTU is written either way.
    let ret = unsafe { bpf_check_mtu(ctx.skb.skb.cast(), 0, &raw mut mtu, 0, 0) };
    (ret >= 0 && mtu != 0).then_some(mtu)
}

/// The offset of the TCP header of an IPv4 or IPv6 packet carrying TCP in
/// its first (or only) fragment, and whether it is IPv6.
#[inline(always)]
fn tcp_header(ctx: &TcContext) -> Option<(usize, bool)> {
    let (ether_type, l3) = l3_protocol(ctx).ok()?;
    if ether_type == ETH_P_IP {
        let header = ctx.load::<[u8; IPV4_MIN_LEN]>(l3).ok()?;
        let info = parse_ipv4(&header)?;
        if info.protocol != proto::TCP || matches!(info.fragment, Fragment::Later { .. }) {
            return None;
        }
        return Some((l3 + info.header_len, false));
    }
    if ether_type != ETH_P_IPV6 {
        return None;
    }
    let header = ctx.load::<[u8; IPV6_HDR_LEN]>(l3).ok()?;
    let mut next = parse_ipv6(&header)?.next_header;
    let mut offset = l3 + IPV6_HDR_LEN;
    for _ in 0..MAX_IPV6_EXTENSIONS {
        if !is_ipv6_extension(next) {
            break;
        }
        let bytes = ctx.load::<[u8; 8]>(offset).ok()?;
        match ipv6_ext(next, &bytes) {
            Ipv6Ext::Skip { next: n, len } => {
                next = n;
                offset += len;
            }
            Ipv6Ext::Fragment { next: n, later, .. } => {
                if later {
                    return None;
                }
                next = n;
                offset += 8;
            }
            Ipv6Ext::Upper => break,
        }
    }
    (next == proto::TCP).then_some((offset, true))
}
