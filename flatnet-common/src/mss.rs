//! TCP MSS clamping: the logic the `mss_clamp_*` programs (on a pod's
//! primary interface) share with their unit tests.
//!
//! A SYN or SYN-ACK carries the sender's maximum segment size in an MSS
//! option; the other side never sends segments larger than that. Clamping
//! it to what the interface's MTU leaves for TCP payload (MTU - 40 over
//! IPv4, MTU - 60 over IPv6, without IP or TCP options) makes both ends of
//! every new connection use segments that fit, whatever their own route
//! says.

/// IPv4 (20) and TCP (20) headers without options.
pub const IPV4_TCP_OVERHEAD: u32 = 40;
/// IPv6 (40) and TCP (20) headers without options.
pub const IPV6_TCP_OVERHEAD: u32 = 60;
/// The TCP header without options.
pub const TCP_HDR_LEN: usize = 20;
/// The most option bytes a TCP header holds (data offset 15 words).
pub const MAX_TCP_OPTIONS_LEN: usize = 40;
/// Offset of the checksum in the TCP header.
pub const TCP_CSUM_OFFSET: usize = 16;
/// The SYN flag in the TCP header's flags byte (offset 13).
pub const TCP_FLAG_SYN: u8 = 0x02;

const OPT_EOL: u8 = 0;
const OPT_NOP: u8 = 1;
const OPT_MSS: u8 = 2;
const OPT_MSS_LEN: usize = 4;

/// The largest MSS segments through an interface of `mtu` may carry;
/// 0 when the MTU cannot even hold the headers (nothing is clamped then).
#[inline(always)]
pub fn clamp_for(mtu: u32, ipv6: bool) -> u16 {
    let overhead = if ipv6 {
        IPV6_TCP_OVERHEAD
    } else {
        IPV4_TCP_OVERHEAD
    };
    let mss = mtu.saturating_sub(overhead);
    if mss > u32::from(u16::MAX) {
        u16::MAX
    } else {
        mss as u16
    }
}

/// The old and new MSS as `bpf_l4_csum_replace` must see them (`from`,
/// `to`: the 16-bit words of the one's complement sum, in memory order)
/// when the value sits `offset` bytes into the TCP header. The sum adds
/// 16-bit words from the header's start (the pseudo header before it has an
/// even length), so a value at an odd offset straddles two words: its
/// first byte is the second of one, its second the first of the next, and
/// it counts byte-swapped.
#[inline(always)]
pub fn csum_words(offset: usize, old: u16, new: u16) -> (u16, u16) {
    // A rotation by 0 or 8 bits rather than a branch: fewer paths for the
    // verifier to walk.
    let swap = 8 * (offset as u32 & 1);
    let word = |value: u16| u16::from_ne_bytes(value.to_be_bytes()).rotate_left(swap);
    (word(old), word(new))
}

/// The option bytes of a TCP header whose first 14 bytes (through the
/// flags) are `head`, when it is a SYN (with or without ACK) whose options
/// are worth walking: `Some(length)`, `None` otherwise (not a SYN, a data
/// offset below 5, or no options).
#[inline(always)]
pub fn syn_options_len(head: &[u8; 14]) -> Option<usize> {
    if head[13] & TCP_FLAG_SYN == 0 {
        return None;
    }
    let header_len = usize::from(head[12] >> 4) * 4;
    if header_len <= TCP_HDR_LEN {
        return None;
    }
    Some(header_len - TCP_HDR_LEN)
}

/// Walks the `len` option bytes read by `read` (offset from the first
/// option byte, `None` past the packet's end) as the kernel's
/// `tcp_parse_options` does, and calls `on_mss(offset, value)` for every
/// well-formed MSS option (offset of its value, value). Returns how many
/// it found.
///
/// Every MSS option is handed out, not only the first: the kernel takes
/// the last, other stacks the first. Walking stops, like the kernel's, at the end
/// of the options (EOL), at a length below 2 or past `len`, and where the
/// packet ends. An MSS option of a length other than 4 is skipped, as the
/// kernel ignores it.
#[inline(always)]
pub fn for_each_mss(
    len: usize,
    mut read: impl FnMut(usize) -> Option<u8>,
    mut on_mss: impl FnMut(usize, u16),
) -> u32 {
    let len = if len > MAX_TCP_OPTIONS_LEN {
        MAX_TCP_OPTIONS_LEN
    } else {
        len
    };
    let mut found = 0;
    let mut at = 0;
    // Every step moves on by at least one byte: a bounded loop.
    for _ in 0..MAX_TCP_OPTIONS_LEN {
        if at >= len {
            break;
        }
        let Some(kind) = read(at) else { break };
        match kind {
            OPT_EOL => break,
            OPT_NOP => at += 1,
            _ => {
                if at + 1 >= len {
                    break;
                }
                let Some(option_len) = read(at + 1) else {
                    break;
                };
                let option_len = usize::from(option_len);
                if option_len < 2 || at + option_len > len {
                    break;
                }
                if kind == OPT_MSS && option_len == OPT_MSS_LEN {
                    let (Some(high), Some(low)) = (read(at + 2), read(at + 3)) else {
                        break;
                    };
                    on_mss(at + 2, u16::from_be_bytes([high, low]));
                    found += 1;
                }
                at += option_len;
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    fn walk(options: &[u8]) -> Vec<(usize, u16)> {
        let mut seen = Vec::new();
        let found = for_each_mss(
            options.len(),
            |i| options.get(i).copied(),
            |at, v| seen.push((at, v)),
        );
        assert_eq!(found as usize, seen.len());
        seen
    }

    #[test]
    fn the_clamp_leaves_room_for_the_headers_of_each_family() {
        assert_eq!(clamp_for(1400, false), 1360);
        assert_eq!(clamp_for(1400, true), 1340);
        assert_eq!(clamp_for(30, false), 0);
        assert_eq!(clamp_for(1 << 20, true), u16::MAX);
    }

    /// The one's complement sum of `data` in memory-order words, as the
    /// kernel's `csum_replace2` sees them.
    fn ones_sum(data: &[u8]) -> u16 {
        let mut total: u32 = data
            .chunks(2)
            .map(|c| u32::from(u16::from_ne_bytes([c[0], *c.get(1).unwrap_or(&0)])))
            .sum();
        while total > 0xffff {
            total = (total & 0xffff) + (total >> 16);
        }
        total as u16
    }

    /// `csum_replace2`: the checksum after `from` became `to`.
    fn replace(check: u16, from: u16, to: u16) -> u16 {
        let sum = u32::from(!check) + u32::from(!from) + u32::from(to);
        let folded = (sum & 0xffff) + (sum >> 16);
        !(((folded & 0xffff) + (folded >> 16)) as u16)
    }

    #[test]
    fn the_checksum_update_holds_at_even_and_odd_offsets() {
        for offset in [22usize, 23, 35] {
            let mut segment = [0x5au8; 40];
            segment[offset..offset + 2].copy_from_slice(&1460u16.to_be_bytes());
            segment[16..18].fill(0);
            let check = !ones_sum(&segment);
            let (from, to) = csum_words(offset, 1460, 1360);
            let check = replace(check, from, to);
            segment[offset..offset + 2].copy_from_slice(&1360u16.to_be_bytes());
            segment[16..18].copy_from_slice(&check.to_ne_bytes());
            assert_eq!(ones_sum(&segment), 0xffff, "offset {offset}");
        }
    }

    #[test]
    fn only_syns_with_options_are_walked() {
        let mut head = [0u8; 14];
        head[12] = 6 << 4;
        head[13] = 0x12; // SYN-ACK
        assert_eq!(syn_options_len(&head), Some(4));
        head[13] = 0x10; // ACK
        assert_eq!(syn_options_len(&head), None);
        head[13] = 0x02;
        head[12] = 5 << 4;
        assert_eq!(syn_options_len(&head), None, "no options");
        head[12] = 4 << 4;
        assert_eq!(syn_options_len(&head), None, "data offset below 5");
        head[12] = 15 << 4;
        assert_eq!(syn_options_len(&head), Some(40));
    }

    #[test]
    fn mss_is_found_wherever_it_sits() {
        assert_eq!(walk(&[2, 4, 0x05, 0xb4]), [(2, 1460)]);
        // Linux's order: MSS, SACK permitted, timestamps, NOP, window scale.
        let linux = [
            2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7,
        ];
        assert_eq!(walk(&linux), [(2, 1460)]);
        // MSS last, after NOPs and timestamps, at an odd offset.
        let late = [
            1, 1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 2, 4, 0x23, 0x28, 0, 0, 0,
        ];
        assert_eq!(walk(&late), [(15, 9000)]);
    }

    #[test]
    fn every_mss_option_is_handed_out_because_the_kernel_takes_the_last() {
        assert_eq!(
            walk(&[2, 4, 0x05, 0xb4, 2, 4, 0xff, 0xff]),
            [(2, 1460), (6, 65535)]
        );
    }

    #[test]
    fn hostile_options_stop_the_walk_like_the_kernel() {
        // End of options before the MSS.
        assert_eq!(walk(&[0, 2, 4, 0x05, 0xb4]), []);
        // A length below 2 would loop forever.
        assert_eq!(walk(&[8, 0, 2, 4, 0x05, 0xb4]), []);
        assert_eq!(walk(&[8, 1, 2, 4, 0x05, 0xb4]), []);
        // A length past the options.
        assert_eq!(walk(&[2, 4, 0x05, 0xb4, 8, 10, 0, 0]), [(2, 1460)]);
        // An MSS of the wrong length is ignored, the walk goes on.
        assert_eq!(walk(&[2, 6, 1, 2, 3, 4, 2, 4, 0x05, 0xb4]), [(8, 1460)]);
        // A kind at the very end without its length byte.
        assert_eq!(walk(&[1, 1, 1, 2]), []);
        // Options cut short by the packet's end.
        let cut = [2u8, 4, 0x05];
        let mut seen = 0;
        for_each_mss(4, |i| cut.get(i).copied(), |_, _| seen += 1);
        assert_eq!(seen, 0);
        // More than 40 bytes claimed: only 40 are walked.
        let mut long = [1u8; 44];
        long[40..].copy_from_slice(&[2, 4, 0x05, 0xb4]);
        assert_eq!(walk(&long), []);
    }
}
