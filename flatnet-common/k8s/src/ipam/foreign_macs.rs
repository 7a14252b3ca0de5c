//! Foreign MACs inside a MAC pool range: MACs the node agents saw on the
//! wire (their `FlatNetworkWireClaims`, within the wire window) that no
//! flatnet record of this cluster holds. Inside a range they most likely
//! mean another flatnet cluster, or hosts, on the same LAN use it: the
//! webhook warns when a range is written over them, and the operator does
//! not choose a random range that holds any.

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::jiff::Timestamp;

use super::{LiveClaim, Mac, MacRange, wire::window_start};
use crate::api::FlatNetworkWireClaims;

/// How many MACs a warning names before "and N more".
const NAMED: usize = 3;

/// The latest sighting of every foreign MAC in `reports` seen after
/// `now - window`, by MAC. A claim whose MAC does not parse is skipped.
pub fn foreign_macs<'a>(
    reports: impl IntoIterator<Item = &'a FlatNetworkWireClaims>,
    now: Timestamp,
    window: Duration,
) -> BTreeMap<Mac, LiveClaim> {
    let since = window_start(now, window);
    let mut macs: BTreeMap<Mac, LiveClaim> = BTreeMap::new();
    for report in reports {
        for claim in &report.spec.claims {
            let Ok(mac) = Mac::parse(&claim.mac) else {
                continue;
            };
            if claim.last_seen.0 < since
                || macs
                    .get(&mac)
                    .is_some_and(|seen| seen.last_seen >= claim.last_seen.0)
            {
                continue;
            }
            macs.insert(
                mac,
                LiveClaim {
                    mac: mac.to_string(),
                    last_seen: claim.last_seen.0,
                    node: report.spec.node.clone(),
                },
            );
        }
    }
    macs
}

/// The sightings of `foreign` inside `range`, ascending by MAC.
pub fn inside(range: &MacRange, foreign: &BTreeMap<Mac, LiveClaim>) -> Vec<LiveClaim> {
    foreign
        .range(range.start()..=range.end())
        .map(|(_, claim)| claim.clone())
        .collect()
}

/// The warning for a MAC pool range with `seen` (its foreign MACs, see
/// [`inside`]) in it; `None` when there are none. `what` names the range
/// for the reader, e.g. `spec.macPool range`.
#[must_use]
pub fn overlap_warning(what: &str, range: &MacRange, seen: &[LiveClaim]) -> Option<String> {
    if seen.is_empty() {
        return None;
    }
    let named = seen
        .iter()
        .take(NAMED)
        .map(|c| format!("{} (seen by node {} at {})", c.mac, c.node, c.last_seen))
        .collect::<Vec<_>>()
        .join(", ");
    let more = match seen.len().saturating_sub(NAMED) {
        0 => String::new(),
        more => format!(" and {more} more"),
    };
    Some(format!(
        "{what} {range} holds {} MAC(s) the node agents saw on the LAN that no FlatNetworkIP of this cluster holds: {named}{more}; another flatnet cluster or hosts on this LAN likely use this range: choose another range (meanwhile the allocator skips those MACs)",
        seen.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::wire::tests::{at, report};

    fn range() -> MacRange {
        MacRange::parse("02:aa:00:00:00:00", "02:aa:00:ff:ff:ff").unwrap()
    }

    #[test]
    fn the_latest_sighting_within_the_window_counts_per_mac() {
        let reports = [
            report(
                "a",
                &[
                    ("192.0.2.2", "02:aa:00:00:00:01", at(100)),
                    // Seen before the window: forgotten.
                    ("192.0.2.3", "02:aa:00:00:00:02", at(-4_000)),
                    ("192.0.2.4", "not a mac", at(100)),
                ],
            ),
            report(
                "b",
                &[
                    ("192.0.2.2", "02:AA:00:00:00:01", at(200)),
                    ("192.0.2.5", "02:bb:00:00:00:01", at(50)),
                ],
            ),
        ];
        let foreign = foreign_macs(&reports, at(300), Duration::from_secs(3600));
        assert_eq!(foreign.len(), 2, "{foreign:?}");
        let seen = inside(&range(), &foreign);
        assert_eq!(seen.len(), 1);
        assert_eq!(
            (
                seen[0].mac.as_str(),
                seen[0].node.as_str(),
                seen[0].last_seen
            ),
            ("02:aa:00:00:00:01", "b", at(200))
        );
    }

    #[test]
    fn the_warning_counts_names_a_few_and_says_what_to_do() {
        assert_eq!(overlap_warning("spec.macPool range", &range(), &[]), None);
        let seen: Vec<LiveClaim> = (1..=5)
            .map(|i| LiveClaim {
                mac: format!("02:aa:00:00:00:0{i}"),
                last_seen: at(i),
                node: format!("node-{i}"),
            })
            .collect();
        let warning = overlap_warning("spec.macPool range", &range(), &seen).unwrap();
        for part in [
            "spec.macPool range 02:aa:00:00:00:00-02:aa:00:ff:ff:ff",
            "5 MAC(s)",
            "02:aa:00:00:00:01 (seen by node node-1 at ",
            &at(3).to_string(),
            "and 2 more",
            "another flatnet cluster",
            "choose another range",
            "allocator skips those MACs",
        ] {
            assert!(warning.contains(part), "{part} missing: {warning}");
        }
        assert!(!warning.contains("02:aa:00:00:00:04"), "{warning}");
    }
}
