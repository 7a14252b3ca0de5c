//! `status.usedIP` wire format: sorted, merged closed ranges.
//!
//! Ranges are ordered as the original orders them (all IPv4 before all
//! IPv6, then by address), and adjacent addresses always merge, so the same
//! set of addresses always gives the same list.

use std::net::IpAddr;

use super::{
    cidr::{Family, from_u128, to_u128},
    intervals::IntervalSet,
};
use crate::api::IpRange;

/// Compresses addresses (any order, duplicates allowed) into `usedIP` form.
pub fn compress(addresses: impl IntoIterator<Item = IpAddr>) -> Vec<IpRange> {
    let mut v4 = IntervalSet::new();
    let mut v6 = IntervalSet::new();
    for ip in addresses {
        let set = match Family::of(ip) {
            Family::V4 => &mut v4,
            Family::V6 => &mut v6,
        };
        let value = to_u128(ip);
        set.insert(value, value);
    }
    let mut ranges = from_intervals(Family::V4, &v4);
    ranges.extend(from_intervals(Family::V6, &v6));
    ranges
}

/// The addresses covered by `ranges`, per family, as interval sets.
///
/// Incomplete ranges, ranges mixing families and reversed ranges are
/// skipped: they cannot come from [`compress`].
pub fn to_intervals(ranges: &[IpRange]) -> (IntervalSet, IntervalSet) {
    let mut v4 = IntervalSet::new();
    let mut v6 = IntervalSet::new();
    for (from, to) in ranges.iter().filter_map(IpRange::bounds) {
        let (start, end) = (to_u128(from), to_u128(to));
        if Family::of(from) != Family::of(to) || start > end {
            continue;
        }
        match Family::of(from) {
            Family::V4 => v4.insert(start, end),
            Family::V6 => v6.insert(start, end),
        };
    }
    (v4, v6)
}

/// Whether `ip` is covered by `ranges`.
pub fn contains(ranges: &[IpRange], ip: IpAddr) -> bool {
    let value = to_u128(ip);
    ranges.iter().filter_map(IpRange::bounds).any(|(from, to)| {
        Family::of(from) == Family::of(ip)
            && Family::of(to) == Family::of(ip)
            && (to_u128(from)..=to_u128(to)).contains(&value)
    })
}

/// One `IpRange` per interval of `set` (addresses of `family`).
pub fn from_intervals(family: Family, set: &IntervalSet) -> Vec<IpRange> {
    set.iter()
        .map(|r| IpRange::new(from_u128(family, *r.start()), from_u128(family, *r.end())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn range(from: &str, to: &str) -> IpRange {
        IpRange::new(ip(from), ip(to))
    }

    #[test]
    fn compress_merges_sorts_and_puts_ipv4_first() {
        let ranges = compress(
            [
                "fd00::2",
                "10.10.1.2",
                "10.1.2.4",
                "fd00::1",
                "10.1.2.3",
                "10.10.1.1",
                "10.1.2.3",
            ]
            .map(ip),
        );
        assert_eq!(
            ranges,
            [
                range("10.1.2.3", "10.1.2.4"),
                range("10.10.1.1", "10.10.1.2"),
                range("fd00::1", "fd00::2")
            ]
        );
        assert!(compress([]).is_empty());
    }

    #[test]
    fn merges_across_octet_boundaries() {
        let ranges = compress(["10.0.0.255", "10.0.1.0", "10.0.0.254"].map(ip));
        assert_eq!(ranges, [range("10.0.0.254", "10.0.1.0")]);
    }

    #[test]
    fn contains_and_intervals_skip_malformed_ranges() {
        let ranges = [
            range("10.0.0.5", "10.0.0.9"),
            IpRange {
                from: Some(ip("10.0.0.20")),
                to: None,
            },
            range("10.0.0.40", "10.0.0.30"),
            range("10.0.0.50", "fd00::1"),
        ];
        assert!(contains(&ranges, ip("10.0.0.5")) && contains(&ranges, ip("10.0.0.9")));
        assert!(!contains(&ranges, ip("10.0.0.20")) && !contains(&ranges, ip("10.0.0.35")));
        assert!(!contains(&ranges, ip("10.0.0.60")));
        let (v4, v6) = to_intervals(&ranges);
        assert_eq!((v4.len(), v6.len()), (5, 0));
    }
}
