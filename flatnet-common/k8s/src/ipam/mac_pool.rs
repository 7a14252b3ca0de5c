//! The cluster's MAC pool: a range of MACs every flat interface that names
//! no MAC gets one from, unique per parent link.
//!
//! Allocation is next-fit: the search starts after the MAC handed out
//! last (the cursor) and wraps, so a freed MAC comes round again only after
//! the rest of the range. On top, the most recently freed MACs are held in
//! a quarantine that is used only when nothing else is free, oldest first:
//! a LAN host's ARP cache that still maps an old pod's address to its MAC
//! never sends a new pod the old pod's traffic while the pool has room.

use std::{collections::BTreeSet, fmt};

use super::{IntervalSet, Mac};

/// How many freed MACs the quarantine remembers.
pub const QUARANTINE_LEN: usize = 4096;

/// A validated MAC range: `start ..= end`, every member a unicast MAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MacRange {
    start: Mac,
    end: Mac,
}

/// Why a MAC range was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MacRangeError {
    /// Only one end is given.
    #[error("macPool needs both rangeStart and rangeEnd, or neither (a random range is chosen)")]
    HalfOpen,
    /// An end does not parse.
    #[error("macPool.{field}: {reason}")]
    Mac {
        /// `rangeStart` or `rangeEnd`.
        field: &'static str,
        /// The parse error.
        reason: String,
    },
    /// The start is after the end.
    #[error("macPool range {start}-{end} is empty: rangeStart must not be after rangeEnd")]
    Reversed {
        /// The start.
        start: Mac,
        /// The end.
        end: Mac,
    },
    /// The range crosses a first byte, so it contains multicast MACs.
    #[error(
        "macPool range {start}-{end} spans first bytes {:02x}..{:02x}, which includes multicast MACs: keep the first byte the same at both ends (e.g. 02:10:00:00:00:00-02:10:ff:ff:ff:ff)",
        start.0[0], end.0[0]
    )]
    CrossesFirstByte {
        /// The start.
        start: Mac,
        /// The end.
        end: Mac,
    },
}

fn to_u64(mac: Mac) -> u64 {
    let mut bytes = [0u8; 8];
    bytes[2..].copy_from_slice(&mac.0);
    u64::from_be_bytes(bytes)
}

fn from_u64(value: u64) -> Mac {
    let bytes = value.to_be_bytes();
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&bytes[2..]);
    Mac(mac)
}

impl Mac {
    /// The MAC as a number (its six bytes, big-endian).
    #[must_use]
    pub fn to_u64(self) -> u64 {
        to_u64(self)
    }

    /// The MAC of a number made by [`Mac::to_u64`] (the low six bytes).
    #[must_use]
    pub fn from_u64(value: u64) -> Self {
        from_u64(value)
    }
}

impl MacRange {
    /// Validates a range given as text (`rangeStart`, `rangeEnd`).
    ///
    /// # Errors
    /// An end that is no unicast MAC, a reversed range, or one that spans
    /// several first bytes (and so multicast MACs).
    pub fn parse(start: &str, end: &str) -> Result<Self, MacRangeError> {
        let parse = |field, text: &str| {
            Mac::parse(text).map_err(|e| MacRangeError::Mac {
                field,
                reason: e.to_string(),
            })
        };
        Self::new(parse("rangeStart", start)?, parse("rangeEnd", end)?)
    }

    /// Validates a range of parsed MACs.
    ///
    /// # Errors
    /// As [`MacRange::parse`].
    pub fn new(start: Mac, end: Mac) -> Result<Self, MacRangeError> {
        if start > end {
            return Err(MacRangeError::Reversed { start, end });
        }
        if start.0[0] != end.0[0] {
            return Err(MacRangeError::CrossesFirstByte { start, end });
        }
        Ok(Self { start, end })
    }

    /// The locally administered range `02:hi:lo:00:00:00`-`02:hi:lo:ff:ff:ff`
    /// of `seed` (`hi`, `lo` its bytes): 65536 possible ranges, so two
    /// clusters choosing at random almost never share one.
    #[must_use]
    pub fn locally_administered(seed: u16) -> Self {
        let [hi, lo] = seed.to_be_bytes();
        Self {
            start: Mac([0x02, hi, lo, 0, 0, 0]),
            end: Mac([0x02, hi, lo, 0xff, 0xff, 0xff]),
        }
    }

    /// The first MAC.
    #[must_use]
    pub fn start(&self) -> Mac {
        self.start
    }

    /// The last MAC.
    #[must_use]
    pub fn end(&self) -> Mac {
        self.end
    }

    /// Number of MACs in the range.
    #[must_use]
    pub fn len(&self) -> u64 {
        to_u64(self.end) - to_u64(self.start) + 1
    }

    /// Always false: a valid range has at least one member.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `mac` is in the range.
    #[must_use]
    pub fn contains(&self, mac: Mac) -> bool {
        self.start <= mac && mac <= self.end
    }

    /// Whether the ranges share a MAC.
    #[must_use]
    pub fn overlaps(&self, other: &MacRange) -> bool {
        self.start <= other.end && other.start <= self.end
    }

    /// Whether the range is locally administered (second-lowest bit of the
    /// first byte set), so it cannot collide with a vendor's MAC.
    #[must_use]
    pub fn is_locally_administered(&self) -> bool {
        self.start.0[0] & 0b10 != 0
    }
}

impl fmt::Display for MacRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

/// What the pool remembers between allocations: persisted with the ledger.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MacPoolState {
    /// The MAC handed out last; the next search starts after it.
    pub cursor: Option<Mac>,
    /// Recently freed MACs, oldest first, at most [`QUARANTINE_LEN`].
    pub quarantine: Vec<Mac>,
}

/// No MAC of the range is free.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the MAC pool {range} is exhausted ({in_use} in use, {skipped} seen on the wire from hosts outside flatnet): widen macPool in FlatNetworkConfig cluster, or free MACs by deleting pods"
)]
pub struct MacPoolExhausted {
    /// The range.
    pub range: MacRange,
    /// MACs of the range held by flat interfaces.
    pub in_use: usize,
    /// MACs of the range skipped because foreign hosts use them.
    pub skipped: usize,
}

impl MacPoolState {
    /// Chooses a MAC of `range` that is not `in_use` and not used by a
    /// foreign host (`foreign`), and advances the cursor to it. A
    /// quarantined MAC is chosen only when no other is free (the one freed
    /// longest ago first), and leaves the quarantine.
    ///
    /// # Errors
    /// [`MacPoolExhausted`] when every MAC of the range is taken.
    pub fn allocate(
        &mut self,
        range: MacRange,
        in_use: &BTreeSet<Mac>,
        foreign: &BTreeSet<Mac>,
    ) -> Result<Mac, MacPoolExhausted> {
        let mut macs = self.allocate_many(range, in_use, foreign, 1)?;
        Ok(macs.remove(0))
    }

    /// Chooses `count` distinct MACs as [`MacPoolState::allocate`] would one
    /// after the other, building the set of taken MACs once.
    ///
    /// # Errors
    /// [`MacPoolExhausted`] when fewer than `count` MACs of the range are
    /// free; the state is then unchanged.
    pub fn allocate_many(
        &mut self,
        range: MacRange,
        in_use: &BTreeSet<Mac>,
        foreign: &BTreeSet<Mac>,
        count: usize,
    ) -> Result<Vec<Mac>, MacPoolExhausted> {
        let value = |mac: &Mac| u128::from(to_u64(*mac));
        let mut taken = IntervalSet::new();
        for mac in in_use.iter().chain(foreign).filter(|m| range.contains(**m)) {
            taken.insert(value(mac), value(mac));
        }
        let mut blocked = taken.clone();
        for mac in self.quarantine.iter().filter(|m| range.contains(**m)) {
            blocked.insert(value(mac), value(mac));
        }
        let exhausted = || MacPoolExhausted {
            range,
            in_use: in_use.iter().filter(|m| range.contains(**m)).count(),
            skipped: foreign
                .iter()
                .filter(|m| range.contains(**m) && !in_use.contains(m))
                .count(),
        };

        let (first, last) = (to_u64(range.start), to_u64(range.end));
        let mut next = self.clone();
        let mut chosen = Vec::with_capacity(count);
        while chosen.len() < count {
            let from = next
                .cursor
                .filter(|c| range.contains(*c))
                .map_or(first, |c| to_u64(c).saturating_add(1));
            let found =
                first_free(&blocked, from, last).or_else(|| first_free(&blocked, first, last));
            let mac = match found {
                Some(value) => from_u64(value),
                None => {
                    let position = next
                        .quarantine
                        .iter()
                        .position(|m| range.contains(*m) && !taken.contains(value(m)))
                        .ok_or_else(exhausted)?;
                    next.quarantine.remove(position)
                }
            };
            blocked.insert(value(&mac), value(&mac));
            taken.insert(value(&mac), value(&mac));
            next.cursor = Some(mac);
            chosen.push(mac);
        }
        *self = next;
        Ok(chosen)
    }

    /// Puts a freed MAC into the quarantine (the oldest entry leaves when
    /// it is full).
    pub fn free(&mut self, mac: Mac) {
        self.quarantine.retain(|m| *m != mac);
        self.quarantine.push(mac);
        if self.quarantine.len() > QUARANTINE_LEN {
            let excess = self.quarantine.len() - QUARANTINE_LEN;
            self.quarantine.drain(..excess);
        }
    }
}

/// The smallest value of `from ..= last` not in `blocked`.
fn first_free(blocked: &IntervalSet, from: u64, last: u64) -> Option<u64> {
    if from > last {
        return None;
    }
    let mut candidate = u128::from(from);
    for interval in blocked.iter() {
        if *interval.end() < candidate {
            continue;
        }
        if *interval.start() > candidate {
            break;
        }
        candidate = interval.end() + 1;
    }
    u64::try_from(candidate).ok().filter(|c| *c <= last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn mac(text: &str) -> Mac {
        Mac::parse(text).unwrap()
    }

    fn small(len: u8) -> MacRange {
        MacRange::new(mac("02:aa:00:00:00:01"), Mac([0x02, 0xaa, 0, 0, 0, len])).unwrap()
    }

    #[test]
    fn ranges_are_validated_with_the_fix() {
        let range = MacRange::parse("02:10:00:00:00:00", "02:10:ff:ff:ff:ff").unwrap();
        assert_eq!(range.len(), 1 << 32);
        assert!(range.is_locally_administered());
        assert!(matches!(
            MacRange::parse("02:10:00:00:00:09", "02:10:00:00:00:01"),
            Err(MacRangeError::Reversed { .. })
        ));
        let crosses = MacRange::parse("02:00:00:00:00:00", "04:00:00:00:00:00").unwrap_err();
        assert!(crosses.to_string().contains("multicast"), "{crosses}");
        let bad = MacRange::parse("03:00:00:00:00:00", "03:00:00:00:00:09").unwrap_err();
        assert!(
            matches!(
                &bad,
                MacRangeError::Mac {
                    field: "rangeStart",
                    ..
                }
            ),
            "{bad}"
        );
        assert!(!small(3).overlaps(&MacRange::locally_administered(7)));
        assert!(small(3).overlaps(&small(9)));
    }

    #[test]
    fn random_ranges_are_locally_administered_unicast_and_16m_wide() {
        let range = MacRange::locally_administered(0xbeef);
        assert_eq!(range.to_string(), "02:be:ef:00:00:00-02:be:ef:ff:ff:ff");
        assert_eq!(range.len(), 1 << 24);
        assert!(range.is_locally_administered());
    }

    #[test]
    fn next_fit_wraps_and_skips_taken_and_foreign_macs() {
        let range = small(5);
        let mut state = MacPoolState::default();
        let in_use = BTreeSet::from([mac("02:aa:00:00:00:01")]);
        let foreign = BTreeSet::from([mac("02:aa:00:00:00:02"), mac("02:bb:00:00:00:00")]);
        assert_eq!(
            state.allocate(range, &in_use, &foreign),
            Ok(mac("02:aa:00:00:00:03"))
        );
        assert_eq!(
            state.allocate(range, &in_use, &foreign),
            Ok(mac("02:aa:00:00:00:04"))
        );
        // 03 is free again, but the search goes on from the cursor first.
        assert_eq!(
            state.allocate(range, &in_use, &foreign),
            Ok(mac("02:aa:00:00:00:05"))
        );
        assert_eq!(
            state.allocate(range, &in_use, &foreign),
            Ok(mac("02:aa:00:00:00:03"))
        );
    }

    #[test]
    fn exhaustion_names_the_range_and_the_fix() {
        let range = small(2);
        let in_use = BTreeSet::from([mac("02:aa:00:00:00:01")]);
        let foreign = BTreeSet::from([mac("02:aa:00:00:00:02")]);
        let error = MacPoolState::default()
            .allocate(range, &in_use, &foreign)
            .unwrap_err();
        assert_eq!((error.in_use, error.skipped), (1, 1));
        assert!(error.to_string().contains("FlatNetworkConfig"), "{error}");
    }

    #[test]
    fn the_quarantine_is_used_last_oldest_first() {
        let range = small(4);
        let mut state = MacPoolState::default();
        let none = BTreeSet::new();
        let a = state.allocate(range, &none, &none).unwrap();
        let b = state.allocate(range, &none, &none).unwrap();
        state.free(b);
        state.free(a);
        // Two MACs never used come first, from the cursor on.
        let mut in_use = BTreeSet::new();
        for _ in 0..2 {
            let m = state.allocate(range, &in_use, &none).unwrap();
            assert!(m != a && m != b, "{m} was freed recently");
            in_use.insert(m);
        }
        assert_eq!(state.allocate(range, &in_use, &none), Ok(b), "freed first");
        in_use.insert(b);
        assert_eq!(state.allocate(range, &in_use, &none), Ok(a));
        in_use.insert(a);
        assert!(state.quarantine.is_empty());
        assert!(state.allocate(range, &in_use, &none).is_err());
    }

    #[test]
    fn the_quarantine_is_bounded() {
        let mut state = MacPoolState::default();
        for i in 0..=QUARANTINE_LEN {
            let [.., x, y] = u64::try_from(i).unwrap().to_be_bytes();
            state.free(Mac([2, 0, 0, 0, x, y]));
        }
        assert_eq!(state.quarantine.len(), QUARANTINE_LEN);
        assert_eq!(state.quarantine[0], Mac([2, 0, 0, 0, 0, 1]));
    }

    proptest! {
        /// Allocating from any state hands out distinct MACs of the range,
        /// never one in use or foreign, until exactly the free ones are
        /// used up.
        #[test]
        fn allocations_are_distinct_in_range_and_exhaust_exactly(
            len in 1u8..40,
            taken in proptest::collection::btree_set(1u8..48, 0..20),
            foreign in proptest::collection::btree_set(1u8..48, 0..10),
            freed in proptest::collection::vec(1u8..48, 0..20),
            cursor in proptest::option::of(0u8..48),
        ) {
            let range = small(len);
            let to_mac = |x: &u8| Mac([2, 0xaa, 0, 0, 0, *x]);
            let mut in_use: BTreeSet<Mac> = taken.iter().map(to_mac).collect();
            let foreign: BTreeSet<Mac> = foreign.iter().map(to_mac).collect();
            let mut state = MacPoolState {
                cursor: cursor.as_ref().map(to_mac),
                quarantine: Vec::new(),
            };
            for m in freed.iter().map(to_mac) {
                state.free(m);
            }
            let free = (1..=len)
                .map(|x| to_mac(&x))
                .filter(|m| !in_use.contains(m) && !foreign.contains(m))
                .count();
            let quarantined: BTreeSet<Mac> = state.quarantine.iter().copied().collect();
            let mut from_quarantine = false;
            for _ in 0..free {
                let m = state.allocate(range, &in_use, &foreign).unwrap();
                prop_assert!(range.contains(m));
                prop_assert!(!foreign.contains(&m));
                prop_assert!(in_use.insert(m), "{} handed out twice", m);
                // Once a quarantined MAC comes, only quarantined ones follow.
                if quarantined.contains(&m) {
                    from_quarantine = true;
                } else {
                    prop_assert!(!from_quarantine, "{} after a quarantined MAC", m);
                }
            }
            prop_assert!(state.allocate(range, &in_use, &foreign).is_err());
        }

        /// Choosing many at once is choosing them one after the other, and
        /// a request for more than is free changes nothing.
        #[test]
        fn many_at_once_is_one_after_the_other(
            len in 1u8..40,
            taken in proptest::collection::btree_set(1u8..48, 0..20),
            freed in proptest::collection::vec(1u8..48, 0..20),
            cursor in proptest::option::of(0u8..48),
            count in 1usize..45,
        ) {
            let range = small(len);
            let to_mac = |x: &u8| Mac([2, 0xaa, 0, 0, 0, *x]);
            let in_use: BTreeSet<Mac> = taken.iter().map(to_mac).collect();
            let none = BTreeSet::new();
            let mut state = MacPoolState {
                cursor: cursor.as_ref().map(to_mac),
                quarantine: Vec::new(),
            };
            for m in freed.iter().map(to_mac) {
                state.free(m);
            }
            let mut one_by_one = state.clone();
            let mut grown = in_use.clone();
            let singles: Result<Vec<Mac>, MacPoolExhausted> = (0..count)
                .map(|_| {
                    let m = one_by_one.allocate(range, &grown, &none)?;
                    grown.insert(m);
                    Ok(m)
                })
                .collect();
            let before = state.clone();
            match (state.allocate_many(range, &in_use, &none, count), singles) {
                (Ok(many), Ok(singles)) => {
                    prop_assert_eq!(many, singles);
                    prop_assert_eq!(state, one_by_one);
                }
                (Err(_), Err(_)) => prop_assert_eq!(state, before),
                (many, singles) => prop_assert!(false, "{:?} against {:?}", many, singles),
            }
        }
    }
}
