//! The election, pure: agreement, takeover after the timeout, restarts,
//! and exactly one owner whenever the agents hear each other.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    time::{Duration, Instant},
};

use proptest::prelude::*;

use super::*;

const TIMEOUT: Duration = Duration::from_millis(300);

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn beat(node: &str, incarnation: u64, addrs: &[IpAddr]) -> Heartbeat {
    Heartbeat {
        node: node.into(),
        incarnation,
        candidate_for: addrs.to_vec(),
        part: 0,
        parts: 1,
    }
}

#[test]
fn a_peer_offering_its_addresses_in_parts_is_a_candidate_for_all_of_them() {
    let addrs: Vec<IpAddr> = (1..=60u8)
        .map(|i| IpAddr::from([192, 168, 50, i]))
        .collect();
    let now = Instant::now();
    let mut election = Election::new("a", Duration::from_millis(300));
    for part in Heartbeat::split("b", 1, &addrs) {
        election.heard(&part, now);
    }
    let none = BTreeSet::new();
    for addr in &addrs {
        assert_eq!(election.owner(*addr, &none, now), Some("b"));
    }
    // Fewer addresses later: the parts beyond the new count are dropped.
    for part in Heartbeat::split("b", 1, &addrs[..3]) {
        election.heard(&part, now);
    }
    assert_eq!(election.owner(addrs[2], &none, now), Some("b"));
    assert_eq!(election.owner(addrs[40], &none, now), None);
}

fn set(addrs: &[IpAddr]) -> BTreeSet<IpAddr> {
    addrs.iter().copied().collect()
}

#[test]
fn two_agents_that_hear_each_other_agree_on_one_owner() {
    let addrs: Vec<IpAddr> = (10..30).map(|i| IpAddr::from([192, 168, 50, i])).collect();
    let now = Instant::now();
    let mut a = Election::new("node-a", TIMEOUT);
    let mut b = Election::new("node-b", TIMEOUT);
    a.heard(&beat("node-b", 1, &addrs), now);
    b.heard(&beat("node-a", 1, &addrs), now);
    let (owned_a, owned_b) = (a.owned(&set(&addrs), now), b.owned(&set(&addrs), now));
    assert!(owned_a.is_disjoint(&owned_b));
    assert_eq!(owned_a.len() + owned_b.len(), addrs.len());
    assert!(
        !owned_a.is_empty() && !owned_b.is_empty(),
        "both nodes own some"
    );
    // Own heartbeats looped back change nothing.
    a.heard(&beat("node-a", 9, &[]), now);
    assert_eq!(a.owned(&set(&addrs), now), owned_a);
}

#[test]
fn a_silent_owner_is_replaced_after_the_timeout_and_not_before() {
    let addr = ip("192.168.50.10");
    let start = Instant::now();
    // Find which of the two owns it.
    let mut b = Election::new("node-b", TIMEOUT);
    b.heard(&beat("node-a", 1, &[addr]), start);
    let owner = b.owner(addr, &set(&[addr]), start).unwrap().to_owned();
    let (mut survivor, dead) = if owner == "node-a" {
        (b, "node-a")
    } else {
        let mut a = Election::new("node-a", TIMEOUT);
        a.heard(&beat("node-b", 1, &[addr]), start);
        (a, "node-b")
    };
    let mine = set(&[addr]);
    survivor.heard(&beat(dead, 1, &[addr]), start);
    let before = survivor.owned(&mine, start + TIMEOUT - Duration::from_millis(1));
    assert!(
        before.is_empty(),
        "took over while the owner may still answer"
    );
    let after = survivor.owned(&mine, start + TIMEOUT);
    assert_eq!(after, mine);
    assert_eq!(changes(&before, &after), vec![Change::Acquire(addr)]);
    assert!(survivor.live_peers(start + TIMEOUT).is_empty());
    // The owner comes back: the address returns to it.
    survivor.heard(&beat(dead, 2, &[addr]), start + TIMEOUT * 2);
    let back = survivor.owned(&mine, start + TIMEOUT * 2);
    assert!(back.is_empty());
    assert_eq!(changes(&after, &back), vec![Change::Release(addr)]);
}

#[test]
fn a_stale_incarnation_never_replaces_the_restarted_peer() {
    let addr = ip("192.168.50.10");
    let now = Instant::now();
    let mut a = Election::new("node-a", TIMEOUT);
    a.heard(&beat("node-b", 5, &[addr]), now);
    // A delayed datagram of node-b's previous process, not a candidate.
    a.heard(&beat("node-b", 4, &[]), now + Duration::from_millis(50));
    assert_eq!(
        a.owner(addr, &BTreeSet::new(), now + Duration::from_millis(50)),
        Some("node-b")
    );
}

#[test]
fn no_candidate_no_owner_and_releases_come_first() {
    let addr = ip("fd00:50::10");
    let now = Instant::now();
    let a = Election::new("node-a", TIMEOUT);
    assert_eq!(a.owner(addr, &BTreeSet::new(), now), None);
    let (x, y, z) = (ip("10.0.0.1"), ip("10.0.0.2"), ip("10.0.0.3"));
    assert_eq!(
        changes(&set(&[x, y]), &set(&[y, z])),
        vec![Change::Release(x), Change::Acquire(z)]
    );
}

proptest! {
    /// Agents that all hear each other (each from its own view): every
    /// address with a candidate has exactly one agent that owns it, and
    /// that agent is a candidate.
    #[test]
    fn exactly_one_owner_when_everyone_hears_everyone(
        candidacy in prop::collection::vec(prop::collection::btree_set(0u8..12, 0..12), 1..6),
    ) {
        let now = Instant::now();
        let names: Vec<String> = (0..candidacy.len()).map(|i| format!("node-{i}")).collect();
        let addrs_of = |set: &BTreeSet<u8>| -> Vec<IpAddr> {
            set.iter().map(|i| IpAddr::from([10, 0, 0, *i])).collect()
        };
        let mut views: Vec<Election> = names.iter().map(|n| Election::new(n.clone(), TIMEOUT)).collect();
        for (i, view) in views.iter_mut().enumerate() {
            for (j, name) in names.iter().enumerate() {
                if i != j {
                    view.heard(&beat(name, 1, &addrs_of(&candidacy[j])), now);
                }
            }
        }
        for i in 0..12u8 {
            let addr = IpAddr::from([10, 0, 0, i]);
            let owners: Vec<usize> = views
                .iter()
                .enumerate()
                .filter(|(k, v)| v.owned(&set(&addrs_of(&candidacy[*k])), now).contains(&addr))
                .map(|(k, _)| k)
                .collect();
            let candidates = candidacy.iter().filter(|c| c.contains(&i)).count();
            prop_assert_eq!(owners.len(), usize::from(candidates > 0), "address {} owners {:?}", addr, owners);
            for k in owners {
                prop_assert!(candidacy[k].contains(&i));
            }
        }
    }
}
