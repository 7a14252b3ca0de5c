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
use crate::k8s::api::IpRange;

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
pub(super) fn from_intervals(family: Family, set: &IntervalSet) -> Vec<IpRange> {
    set.iter()
        .map(|r| IpRange::new(from_u128(family, *r.start()), from_u128(family, *r.end())))
        .collect()
}
