//! A set of `u128` values stored as disjoint closed intervals.
//!
//! The pool keeps its free and taken addresses here, so memory grows with the
//! number of holes, not with the subnet size: a whole IPv6 /64 is one entry.
//! Every operation is O(log n) in the number of intervals, plus the intervals
//! it merges or removes.

use std::{collections::BTreeMap, ops::RangeInclusive};

/// Disjoint, non-adjacent closed intervals `start ..= end`, keyed by `start`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IntervalSet {
    intervals: BTreeMap<u128, u128>,
    // Number of members; u128 because a full IPv6 space has 2^128 members,
    // so it saturates at u128::MAX in that single case.
    len: u128,
}

impl IntervalSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of members (saturating at `u128::MAX`).
    pub fn len(&self) -> u128 {
        self.len
    }

    /// Whether the set has no member.
    pub fn is_empty(&self) -> bool {
        self.intervals.is_empty()
    }

    /// Whether `value` is a member.
    pub fn contains(&self, value: u128) -> bool {
        self.covering(value).is_some()
    }

    /// The smallest member.
    pub fn first(&self) -> Option<u128> {
        self.intervals.keys().next().copied()
    }

    /// The intervals in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = RangeInclusive<u128>> + '_ {
        self.intervals.iter().map(|(&start, &end)| start..=end)
    }

    /// Adds every value of `start ..= end`; returns how many were new.
    pub fn insert(&mut self, start: u128, end: u128) -> u128 {
        debug_assert!(start <= end);
        let mut new_start = start;
        let mut new_end = end;
        let mut absorbed = 0u128;
        // Merge with an interval that begins before `start` and overlaps or
        // touches it (`start - 1` touching counts: the set stays non-adjacent).
        if let Some((&s, &e)) = self.intervals.range(..start).next_back()
            && e.checked_add(1).is_none_or(|after| after >= start)
        {
            new_start = s;
            new_end = new_end.max(e);
            absorbed = absorbed.saturating_add(e - s + 1);
            self.intervals.remove(&s);
        }
        // Merge with every interval that begins inside or right after the new one.
        loop {
            let upper = new_end.saturating_add(1);
            let Some((&s, &e)) = self.intervals.range(new_start..=upper).next() else {
                break;
            };
            new_end = new_end.max(e);
            absorbed = absorbed.saturating_add(e - s + 1);
            self.intervals.remove(&s);
        }
        self.intervals.insert(new_start, new_end);
        let total = span(new_start, new_end);
        let added = total.saturating_sub(absorbed);
        self.len = self.len.saturating_add(added);
        added
    }

    /// Removes every value of `start ..= end`; returns how many were members.
    pub fn remove(&mut self, start: u128, end: u128) -> u128 {
        debug_assert!(start <= end);
        let mut removed = 0u128;
        // Intervals that can intersect begin at or before `end`; walk back
        // from there until one ends before `start`.
        let touching: Vec<(u128, u128)> = self
            .intervals
            .range(..=end)
            .rev()
            .take_while(|&(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in touching {
            self.intervals.remove(&s);
            if s < start {
                self.intervals.insert(s, start - 1);
            }
            if e > end {
                self.intervals.insert(end + 1, e);
            }
            removed = removed.saturating_add(span(s.max(start), e.min(end)));
        }
        self.len = self.len.saturating_sub(removed);
        removed
    }

    /// Removes and returns the smallest member.
    pub fn pop_first(&mut self) -> Option<u128> {
        let first = self.first()?;
        self.remove(first, first);
        Some(first)
    }

    /// The interval holding `value`, if any.
    fn covering(&self, value: u128) -> Option<(u128, u128)> {
        self.intervals
            .range(..=value)
            .next_back()
            .filter(|&(_, &end)| end >= value)
            .map(|(&s, &e)| (s, e))
    }
}

/// Number of values in `start ..= end`, saturating for the full `u128` span.
fn span(start: u128, end: u128) -> u128 {
    (end - start).saturating_add(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn ranges(set: &IntervalSet) -> Vec<(u128, u128)> {
        set.iter().map(|r| (*r.start(), *r.end())).collect()
    }

    #[test]
    fn insert_merges_overlapping_and_adjacent() {
        let mut set = IntervalSet::new();
        assert_eq!(set.insert(10, 20), 11);
        assert_eq!(set.insert(30, 40), 11);
        assert_eq!(set.insert(21, 29), 9);
        assert_eq!(ranges(&set), [(10, 40)]);
        assert_eq!(set.insert(5, 45), 10);
        assert_eq!(ranges(&set), [(5, 45)]);
        assert_eq!(set.insert(7, 8), 0);
        assert_eq!(set.len(), 41);
    }

    #[test]
    fn remove_splits_and_shrinks() {
        let mut set = IntervalSet::new();
        set.insert(0, 100);
        assert_eq!(set.remove(10, 19), 10);
        assert_eq!(ranges(&set), [(0, 9), (20, 100)]);
        assert_eq!(set.remove(0, 0), 1);
        assert_eq!(set.remove(95, 200), 6);
        assert_eq!(ranges(&set), [(1, 9), (20, 94)]);
        assert_eq!(set.remove(5, 30), 16);
        assert_eq!(ranges(&set), [(1, 4), (31, 94)]);
        assert_eq!(set.remove(200, 300), 0);
        assert_eq!(set.len(), 4 + 64);
    }

    #[test]
    fn full_u128_space_saturates() {
        let mut set = IntervalSet::new();
        set.insert(0, u128::MAX);
        assert_eq!(set.len(), u128::MAX);
        assert!(set.contains(u128::MAX));
        assert_eq!(set.pop_first(), Some(0));
        assert_eq!(set.first(), Some(1));
        assert_eq!(set.insert(u128::MAX - 1, u128::MAX), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u8),
        Remove(u8, u8),
        Pop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Op::Insert(a.min(b), a.max(b))),
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Op::Remove(a.min(b), a.max(b))),
            Just(Op::Pop),
        ]
    }

    proptest! {
        /// The interval set behaves exactly like a plain set of integers and
        /// keeps its intervals disjoint and non-adjacent.
        #[test]
        fn matches_a_plain_set(ops in proptest::collection::vec(op(), 0..64)) {
            let mut set = IntervalSet::new();
            let mut model = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Insert(a, b) => {
                        let before = model.len();
                        model.extend(u128::from(a)..=u128::from(b));
                        prop_assert_eq!(set.insert(a.into(), b.into()), (model.len() - before) as u128);
                    }
                    Op::Remove(a, b) => {
                        let before = model.len();
                        model.retain(|v| !(u128::from(a)..=u128::from(b)).contains(v));
                        prop_assert_eq!(set.remove(a.into(), b.into()), (before - model.len()) as u128);
                    }
                    Op::Pop => prop_assert_eq!(set.pop_first(), model.pop_first()),
                }
                prop_assert_eq!(set.len(), model.len() as u128);
                let members: Vec<u128> = set.iter().flatten().collect();
                prop_assert_eq!(members, model.iter().copied().collect::<Vec<_>>());
                for pair in ranges(&set).windows(2) {
                    prop_assert!(pair[0].1 + 1 < pair[1].0, "intervals touch: {:?}", pair);
                }
            }
        }
    }
}
