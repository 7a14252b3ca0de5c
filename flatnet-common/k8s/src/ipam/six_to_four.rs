//! The 6to4 address (RFC 3056 prefix `2002::/16`) that a subnet's
//! `flatnetwork.pandaria.io/ipv6to4` annotation adds to each pod, computed
//! as rancher-flat-network computes it, so pods keep the addresses they had.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The 6to4 address of `address` in an IPv4 subnet of `prefix_len` bits,
/// with its prefix length: `2002:AABB:CCDD::` for `a.b.c.d`, prefix
/// `48 - (32 - prefix_len)`, so the pods of one IPv4 subnet share one
/// on-link IPv6 prefix (`192.168.1.10/24` gives `2002:c0a8:10a::/40`).
/// `None` for a prefix length over 32.
#[must_use]
pub fn six_to_four(address: Ipv4Addr, prefix_len: u8) -> Option<(Ipv6Addr, u8)> {
    if prefix_len > 32 {
        return None;
    }
    let [a, b, c, d] = address.octets();
    let v6 = Ipv6Addr::new(
        0x2002,
        u16::from_be_bytes([a, b]),
        u16::from_be_bytes([c, d]),
        0,
        0,
        0,
        0,
        0,
    );
    Some((v6, 16 + prefix_len))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn the_originals_example() {
        assert_eq!(
            six_to_four(Ipv4Addr::new(192, 168, 1, 10), 24),
            Some(("2002:c0a8:10a::".parse().unwrap(), 40))
        );
        assert_eq!(
            six_to_four(Ipv4Addr::new(10, 0, 0, 1), 32),
            Some(("2002:a00:1::".parse().unwrap(), 48))
        );
        assert_eq!(six_to_four(Ipv4Addr::new(10, 0, 0, 1), 33), None);
    }

    proptest! {
        /// The IPv4 address is recoverable from the 6to4 one, and two pods
        /// of one IPv4 subnet land in one IPv6 prefix.
        #[test]
        fn embeds_the_address_and_keeps_subnet_neighbours_together(
            a in any::<u32>(), b in any::<u32>(), prefix_len in 0u8..=32,
        ) {
            let (a, b) = (Ipv4Addr::from(a), Ipv4Addr::from(b));
            let (v6a, len) = six_to_four(a, prefix_len).unwrap();
            prop_assert_eq!(len, 16 + prefix_len);
            let segments = v6a.segments();
            prop_assert_eq!(segments[0], 0x2002);
            prop_assert_eq!((u32::from(segments[1]) << 16) | u32::from(segments[2]), u32::from(a));
            let mask = |ip: Ipv6Addr| u128::from(ip) & (u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0));
            let same_v4_subnet = prefix_len == 0
                || (u32::from(a) >> (32 - prefix_len)) == (u32::from(b) >> (32 - prefix_len));
            let (v6b, _) = six_to_four(b, prefix_len).unwrap();
            prop_assert_eq!(mask(v6a) == mask(v6b), same_v4_subnet);
        }
    }
}
