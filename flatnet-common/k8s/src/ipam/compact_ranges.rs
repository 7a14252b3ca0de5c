//! The compact encoding of a large `status.usedIP`, and the cover that
//! keeps `usedIP` itself small.
//!
//! `usedIP` spends 40 to 90 bytes of JSON per range, so a fully fragmented
//! subnet of 65,536 addresses (every other one used: 32,768 ranges) does
//! not fit in etcd's 1.5 MiB object limit as IPv6. Above
//! [`MAX_EXACT_RANGES`] ranges the ledger is written in two parts (see
//! `docs/ipam.md`, "Large ledgers"):
//!
//! - `usedIPCompact` holds the exact ranges: the first address, the number
//!   of ranges, and base64 of two LEB128 numbers per range (its distance
//!   from the end of the previous range less the one free address that
//!   must separate them, then its length less one). A fully fragmented
//!   subnet costs 2 bytes per range, 87 KiB of base64 for 32,768 ranges.
//! - `usedIP` holds a cover of at most [`MAX_EXACT_RANGES`] ranges (the
//!   exact ranges with their smallest gaps closed): every used address is
//!   in it, so a reader that only knows `usedIP` (the original, or an older
//!   flatnet) may take a free address for a used one, never the reverse.
//!
//! An address is used when `usedIP` covers it and, when `usedIPCompact` is
//! present and decodes, the compact ranges hold it too. A writer that does
//! not know `usedIPCompact` replaces the status without it, and `usedIP`
//! alone is the ledger again.

use std::net::IpAddr;

use base64::{Engine, engine::general_purpose::STANDARD};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{
    cidr::{Family, from_u128, to_u128},
    intervals::IntervalSet,
    used_ranges,
};
use crate::api::{IpRange, wire};

/// Most ranges `usedIP` lists exactly: 4,096 IPv6 ranges are at most
/// 370 KiB of JSON, a quarter of etcd's limit.
pub const MAX_EXACT_RANGES: usize = 4096;

/// `status.usedIPCompact`: the exact ranges of a ledger whose `usedIP` is a
/// cover (see the module docs).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct CompactRanges {
    /// First address of the first range; every range is of its family.
    #[serde(default, with = "wire::optional")]
    #[schemars(with = "Option<String>")]
    pub from: Option<IpAddr>,
    /// Number of ranges encoded in `data`.
    #[serde(default)]
    pub ranges: u64,
    /// Base64 (standard alphabet, padded) of two LEB128 numbers per range:
    /// start minus (end of the previous range + 2), or minus `from` for
    /// the first; then end minus start.
    #[serde(default)]
    pub data: String,
}

/// Why `usedIPCompact` could not be read.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompactError {
    /// `data` is not base64.
    #[error("usedIPCompact.data is not base64: {0}")]
    Base64(String),
    /// `data` ends inside a number, holds a number over 128 bits, or
    /// leaves the address space.
    #[error("usedIPCompact.data is truncated or out of range after {0} ranges")]
    Truncated(u64),
    /// `data` holds more or fewer ranges than `ranges`.
    #[error("usedIPCompact holds {found} ranges, ranges says {declared}")]
    Count {
        /// Ranges decoded.
        found: u64,
        /// Ranges declared.
        declared: u64,
    },
    /// No `from`.
    #[error("usedIPCompact.from is missing")]
    NoStart,
}

impl CompactRanges {
    /// The exact encoding of `set`, addresses of `family`; `None` when the
    /// set is empty.
    #[must_use]
    pub fn encode(family: Family, set: &IntervalSet) -> Option<Self> {
        let first = set.first()?;
        let mut bytes = Vec::new();
        let mut cursor = first;
        let mut ranges = 0u64;
        for range in set.iter() {
            let (start, end) = (*range.start(), *range.end());
            push_leb128(&mut bytes, start - cursor);
            push_leb128(&mut bytes, end - start);
            // The next range starts at least two past this end (merged
            // ranges are separated by one free address at least).
            cursor = end.saturating_add(2);
            ranges += 1;
        }
        Some(Self {
            from: Some(from_u128(family, first)),
            ranges,
            data: STANDARD.encode(bytes),
        })
    }

    /// The family of the encoded addresses and the ranges.
    ///
    /// # Errors
    /// A malformed encoding (see [`CompactError`]).
    pub fn decode(&self) -> Result<(Family, IntervalSet), CompactError> {
        let from = self.from.ok_or(CompactError::NoStart)?;
        let family = Family::of(from);
        let max = match family {
            Family::V4 => u128::from(u32::MAX),
            Family::V6 => u128::MAX,
        };
        let bytes = STANDARD
            .decode(self.data.as_bytes())
            .map_err(|e| CompactError::Base64(e.to_string()))?;
        let mut set = IntervalSet::new();
        let mut rest = bytes.as_slice();
        let mut cursor = to_u128(from);
        let mut found = 0u64;
        while !rest.is_empty() {
            let truncated = CompactError::Truncated(found);
            let gap = read_leb128(&mut rest).ok_or(truncated.clone())?;
            let length = read_leb128(&mut rest).ok_or(truncated.clone())?;
            let start = cursor.checked_add(gap).ok_or(truncated.clone())?;
            let end = start.checked_add(length).ok_or(truncated.clone())?;
            if end > max {
                return Err(truncated);
            }
            set.insert(start, end);
            cursor = end.saturating_add(2);
            found += 1;
        }
        if found != self.ranges {
            return Err(CompactError::Count {
                found,
                declared: self.ranges,
            });
        }
        Ok((family, set))
    }
}

/// The ledger of `ranges` as written: `usedIP` exactly when it has at most
/// [`MAX_EXACT_RANGES`] ranges (and no compact part); else a cover of
/// `usedIP` and the exact ranges in the compact part.
#[must_use]
pub fn split(ranges: Vec<IpRange>) -> (Vec<IpRange>, Option<CompactRanges>) {
    if ranges.len() <= MAX_EXACT_RANGES {
        return (ranges, None);
    }
    let (v4, v6) = used_ranges::to_intervals(&ranges);
    // A ledger is of one family; one of two families stays exact.
    let (family, set) = match (v4.is_empty(), v6.is_empty()) {
        (false, true) => (Family::V4, v4),
        (true, false) => (Family::V6, v6),
        _ => return (ranges, None),
    };
    let cover = used_ranges::from_intervals(family, &cover(&set, MAX_EXACT_RANGES));
    (cover, CompactRanges::encode(family, &set))
}

/// The exact ranges of a ledger written by [`split`]: `used_ip` when there
/// is no compact part (or it cannot be read: `used_ip` covers every used
/// address), else the compact ranges that `used_ip` covers.
#[must_use]
pub fn join(used_ip: &[IpRange], compact: Option<&CompactRanges>) -> Vec<IpRange> {
    let Some(Ok((family, exact))) = compact.map(CompactRanges::decode) else {
        return used_ip.to_vec();
    };
    let (v4, v6) = used_ranges::to_intervals(used_ip);
    let covered = match family {
        Family::V4 => v4,
        Family::V6 => v6,
    };
    used_ranges::from_intervals(family, &intersection(&exact, &covered))
}

/// The members of both `a` and `b`.
fn intersection(a: &IntervalSet, b: &IntervalSet) -> IntervalSet {
    let b: Vec<(u128, u128)> = b.iter().map(|r| (*r.start(), *r.end())).collect();
    let mut out = IntervalSet::new();
    let mut first = 0;
    for range in a.iter() {
        let (start, end) = (*range.start(), *range.end());
        // Ranges of `b` ending before this one cannot meet later ones.
        while first < b.len() && b[first].1 < start {
            first += 1;
        }
        for &(s, e) in b[first..].iter().take_while(|(s, _)| *s <= end) {
            out.insert(start.max(s), end.min(e));
        }
    }
    out
}

/// The fewest-addresses cover of `set` with at most `most` ranges: the
/// `len - most` smallest gaps closed (the lower one first among equals).
#[must_use]
pub fn cover(set: &IntervalSet, most: usize) -> IntervalSet {
    let ranges: Vec<(u128, u128)> = set.iter().map(|r| (*r.start(), *r.end())).collect();
    if ranges.len() <= most || most == 0 {
        return set.clone();
    }
    // (gap size, index of the range after the gap)
    let mut gaps: Vec<(u128, usize)> = ranges
        .windows(2)
        .enumerate()
        .map(|(i, w)| (w[1].0 - w[0].1 - 1, i + 1))
        .collect();
    gaps.sort_unstable();
    let mut closed = vec![false; ranges.len()];
    for (_, after) in gaps.iter().take(ranges.len() - most) {
        closed[*after] = true;
    }
    let mut out = IntervalSet::new();
    let mut current = ranges[0];
    for (i, range) in ranges.iter().enumerate().skip(1) {
        if closed[i] {
            current.1 = range.1;
        } else {
            out.insert(current.0, current.1);
            current = *range;
        }
    }
    out.insert(current.0, current.1);
    out
}

fn push_leb128(bytes: &mut Vec<u8>, mut value: u128) {
    loop {
        let low = u8::try_from(value & 0x7f).unwrap_or_default();
        value >>= 7;
        if value == 0 {
            bytes.push(low);
            return;
        }
        bytes.push(low | 0x80);
    }
}

fn read_leb128(bytes: &mut &[u8]) -> Option<u128> {
    let mut value = 0u128;
    for (i, byte) in bytes.iter().enumerate() {
        let shift = 7 * u32::try_from(i).ok()?;
        let part = u128::from(byte & 0x7f);
        if shift >= 128 || (shift > 0 && part >> (128 - shift) != 0) {
            return None;
        }
        value |= part << shift;
        if byte & 0x80 == 0 {
            *bytes = &bytes[i + 1..];
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_other(first: u128, count: u128) -> IntervalSet {
        let mut set = IntervalSet::new();
        for i in 0..count {
            set.insert(first + 2 * i, first + 2 * i);
        }
        set
    }

    #[test]
    fn leb128_round_trips_the_extremes() {
        for value in [0, 1, 127, 128, 300, u128::from(u64::MAX), u128::MAX] {
            let mut bytes = Vec::new();
            push_leb128(&mut bytes, value);
            let mut rest = bytes.as_slice();
            assert_eq!(read_leb128(&mut rest), Some(value));
            assert!(rest.is_empty());
        }
        // Ends inside a number; more than 128 bits.
        assert_eq!(read_leb128(&mut [0x80u8].as_slice()), None);
        let too_long = [0xffu8; 19]
            .iter()
            .copied()
            .chain([0x7f])
            .collect::<Vec<_>>();
        assert_eq!(read_leb128(&mut too_long.as_slice()), None);
    }

    #[test]
    fn fully_fragmented_ipv6_slash_112_costs_two_bytes_a_range() {
        let base = to_u128("fd00::".parse().unwrap());
        let set = every_other(base, 32_768);
        let compact = CompactRanges::encode(Family::V6, &set).unwrap();
        assert_eq!(compact.ranges, 32_768);
        assert_eq!(compact.data.len(), 65_536usize.div_ceil(3) * 4);
        assert_eq!(compact.decode(), Ok((Family::V6, set)));
    }

    #[test]
    fn small_ledgers_stay_exact_in_used_ip() {
        let ranges = used_ranges::from_intervals(Family::V4, &every_other(10, 4096));
        let (used_ip, compact) = split(ranges.clone());
        assert_eq!((used_ip, compact), (ranges, None));
    }

    #[test]
    fn a_large_ledger_is_a_cover_and_the_exact_compact_ranges() {
        let set = every_other(to_u128("10.16.0.0".parse().unwrap()), 32_768);
        let ranges = used_ranges::from_intervals(Family::V4, &set);
        let (used_ip, compact) = split(ranges.clone());
        assert_eq!(used_ip.len(), MAX_EXACT_RANGES);
        let (v4, _) = used_ranges::to_intervals(&used_ip);
        assert!(set.iter().all(|r| v4.contains(*r.start())));
        assert_eq!(join(&used_ip, compact.as_ref()), ranges);
    }

    #[test]
    fn an_unreadable_compact_part_leaves_the_cover() {
        let set = every_other(100, 5000);
        let ranges = used_ranges::from_intervals(Family::V4, &set);
        let (used_ip, compact) = split(ranges);
        let mut broken = compact.unwrap();
        broken.ranges += 1;
        assert!(matches!(broken.decode(), Err(CompactError::Count { .. })));
        assert_eq!(join(&used_ip, Some(&broken)), used_ip);
        broken.data = "not base64!".into();
        assert!(matches!(broken.decode(), Err(CompactError::Base64(_))));
        broken.data = STANDARD.encode([0x80]);
        assert_eq!(broken.decode(), Err(CompactError::Truncated(0)));
        // An IPv4 range past 255.255.255.255.
        let mut bytes = Vec::new();
        push_leb128(&mut bytes, 0);
        push_leb128(&mut bytes, 10);
        let past = CompactRanges {
            from: Some("255.255.255.250".parse().unwrap()),
            ranges: 1,
            data: STANDARD.encode(bytes),
        };
        assert_eq!(past.decode(), Err(CompactError::Truncated(0)));
    }

    #[test]
    fn join_drops_what_used_ip_no_longer_covers() {
        // An address freed in usedIP by hand stays free.
        let set = every_other(0, 5000);
        let (mut used_ip, compact) = split(used_ranges::from_intervals(Family::V4, &set));
        let (mut v4, _) = used_ranges::to_intervals(&used_ip);
        v4.remove(0, 0);
        used_ip = used_ranges::from_intervals(Family::V4, &v4);
        let joined = join(&used_ip, compact.as_ref());
        let (joined, _) = used_ranges::to_intervals(&joined);
        assert!(!joined.contains(0));
        assert_eq!(joined.len(), 4999);
    }

    #[test]
    fn cover_closes_the_smallest_gaps() {
        let mut set = IntervalSet::new();
        for (s, e) in [(0, 0), (10, 10), (12, 12), (100, 100)] {
            set.insert(s, e);
        }
        let covered: Vec<_> = cover(&set, 2).iter().collect();
        assert_eq!(covered, [0..=12, 100..=100]);
    }
}
