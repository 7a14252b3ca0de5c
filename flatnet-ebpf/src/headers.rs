//! Bounds-checked reads of packet headers.
//!
//! Reads go through `bpf_skb_load_bytes` (`TcContext::load`), which also
//! works when the headers are not in the skb's linear data.

use aya_ebpf::{helpers::bpf_skb_load_bytes, programs::TcContext};

pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_IPV6: u16 = 0x86DD;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88A8;

pub const ETH_HDR_LEN: usize = 14;
pub const VLAN_HDR_LEN: usize = 4;
pub const IPV6_HDR_LEN: usize = 40;
pub const IPPROTO_ICMPV6: u8 = 58;

/// Why a frame was not parsed. The caller passes such frames on.
#[derive(Clone, Copy)]
pub enum ParseError {
    /// The frame ends before the header field we need.
    Truncated,
}

/// Reads a big-endian u16 at `offset`.
#[inline(always)]
pub fn read_be16(ctx: &TcContext, offset: usize) -> Result<u16, ParseError> {
    let raw: [u8; 2] = ctx.load(offset).map_err(|_| ParseError::Truncated)?;
    Ok(u16::from_be_bytes(raw))
}

/// Reads `N` bytes at `offset` straight into `dst` (for example a map key
/// being built), without a copy on the stack.
#[inline(always)]
pub fn load_into<const N: usize>(
    ctx: &TcContext,
    offset: usize,
    dst: &mut [u8; N],
) -> Result<(), ParseError> {
    // SAFETY: the helper writes exactly N bytes into `dst` or fails.
    let ret = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            offset as u32,
            dst.as_mut_ptr().cast(),
            N as u32,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(ParseError::Truncated)
    }
}

/// Reads one byte at `offset`.
#[inline(always)]
pub fn read_u8(ctx: &TcContext, offset: usize) -> Result<u8, ParseError> {
    ctx.load(offset).map_err(|_| ParseError::Truncated)
}

/// The EtherType after any 802.1Q / 802.1ad tags still in the frame (tags the
/// driver moved into skb metadata are already gone), and the offset of the
/// L3 header.
#[inline(always)]
pub fn l3_protocol(ctx: &TcContext) -> Result<(u16, usize), ParseError> {
    let mut offset = ETH_HDR_LEN - 2;
    let mut ether_type = read_be16(ctx, offset)?;
    // At most two tags (QinQ); a bounded loop the verifier can unroll.
    for _ in 0..2 {
        if ether_type != ETH_P_8021Q && ether_type != ETH_P_8021AD {
            break;
        }
        offset += VLAN_HDR_LEN;
        ether_type = read_be16(ctx, offset)?;
    }
    Ok((ether_type, offset + 2))
}
