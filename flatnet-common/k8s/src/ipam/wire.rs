//! Addresses live on the wire: what the node agents saw MACs of no live
//! flatnet record claim (their `FlatNetworkWireClaims`), as the allocator
//! consults it, and the quarantine of released addresses.
//!
//! An address such a MAC claimed within the window is not handed out: not
//! by automatic allocation (it is skipped), not when a pod asks for it (a
//! clear error names the MAC and when it was seen). An address released
//! within the window is reused after every other free address.

use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::pool::{Pool, PoolError};
use crate::api::FlatNetworkWireClaims;

/// How long a claim seen on the wire keeps its address out of the pool.
pub const DEFAULT_WIRE_WINDOW: Duration = Duration::from_secs(3600);

/// The latest foreign claim on one address, over every node's report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveClaim {
    /// The MAC last seen claiming it.
    pub mac: String,
    /// When.
    pub last_seen: Timestamp,
    /// The node that saw it.
    pub node: String,
}

/// The addresses of one subnet claimed by foreign MACs within the window,
/// and those released within it (quarantined).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveAddresses {
    claims: BTreeMap<IpAddr, LiveClaim>,
    released: BTreeMap<IpAddr, Timestamp>,
}

/// The earliest time within `window` of `now`.
pub(crate) fn window_start(now: Timestamp, window: Duration) -> Timestamp {
    let window = SignedDuration::try_from(window).unwrap_or(SignedDuration::MAX);
    now.checked_sub(window).unwrap_or(Timestamp::MIN)
}

impl LiveAddresses {
    /// The claims of `reports` (one subnet's, from any nodes) seen after
    /// `now - window`; the latest sighting wins where nodes disagree.
    pub fn from_reports<'a>(
        reports: impl IntoIterator<Item = &'a FlatNetworkWireClaims>,
        now: Timestamp,
        window: Duration,
    ) -> Self {
        let sightings = reports.into_iter().flat_map(|report| {
            report.spec.claims.iter().map(|claim| {
                (
                    claim.ip,
                    LiveClaim {
                        mac: claim.mac.clone(),
                        last_seen: claim.last_seen.0,
                        node: report.spec.node.clone(),
                    },
                )
            })
        });
        Self::from_sightings(sightings, now, window)
    }

    /// The live addresses among `sightings` (address and claim), those
    /// seen after `now - window`; the latest sighting of an address wins.
    pub fn from_sightings(
        sightings: impl IntoIterator<Item = (IpAddr, LiveClaim)>,
        now: Timestamp,
        window: Duration,
    ) -> Self {
        let since = window_start(now, window);
        let mut claims: BTreeMap<IpAddr, LiveClaim> = BTreeMap::new();
        for (ip, claim) in sightings {
            if claim.last_seen < since {
                continue;
            }
            if claims
                .get(&ip)
                .is_none_or(|c| c.last_seen < claim.last_seen)
            {
                claims.insert(ip, claim);
            }
        }
        Self {
            claims,
            released: BTreeMap::new(),
        }
    }

    /// Adds the quarantine: `released` (address and when it was released)
    /// within `window` of `now`. Automatic allocation hands these out after
    /// every address that is neither live nor quarantined; a pod asking for
    /// one gets it (quarantine orders reuse, it does not refuse a request).
    #[must_use]
    pub fn with_released(
        mut self,
        released: impl IntoIterator<Item = (IpAddr, Timestamp)>,
        now: Timestamp,
        window: Duration,
    ) -> Self {
        let since = window_start(now, window);
        for (ip, at) in released.into_iter().filter(|(_, at)| *at >= since) {
            let latest = self.released.entry(ip).or_insert(at);
            *latest = (*latest).max(at);
        }
        self
    }

    /// When the address was last active: claimed on the wire or released.
    fn last_active(&self, ip: IpAddr) -> Option<Timestamp> {
        let claimed = self.claims.get(&ip).map(|c| c.last_seen);
        let released = self.released.get(&ip).copied();
        claimed.max(released)
    }

    /// The MACs of the live claims (the MAC pool skips them).
    pub fn macs(&self) -> std::collections::BTreeSet<super::Mac> {
        self.claims
            .values()
            .filter_map(|c| super::Mac::parse(&c.mac).ok())
            .collect()
    }

    /// The claim on `ip`, if it is live.
    pub fn get(&self, ip: IpAddr) -> Option<&LiveClaim> {
        self.claims.get(&ip)
    }

    /// Whether no address is live or quarantined.
    pub fn is_empty(&self) -> bool {
        self.claims.is_empty() && self.released.is_empty()
    }

    /// The live addresses, ascending.
    pub fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.claims.keys().copied()
    }

    /// How many live addresses `pool` could otherwise hand out: the
    /// addresses wire exclusion keeps out of it (`status.wireExcludedCount`).
    pub fn excluded_from(&self, pool: &Pool) -> usize {
        self.addresses().filter(|&ip| pool.is_free(ip)).count()
    }

    /// Allocates from `pool` as [`Pool::allocate_auto`] (no `candidates`)
    /// or [`Pool::allocate_requested`] do, never handing out a live address.
    ///
    /// Automatic allocation hands out a live or quarantined address only
    /// when nothing else is free: the one whose last claim or release is
    /// the oldest.
    ///
    /// # Errors
    /// The pool's; [`PoolError::LiveOnWire`] when every candidate that is
    /// not taken is live (naming the first).
    pub fn allocate(&self, pool: &mut Pool, candidates: &[IpAddr]) -> Result<IpAddr, PoolError> {
        if self.is_empty() {
            return allocate_plain(pool, candidates);
        }
        if !candidates.is_empty() {
            let usable: Vec<IpAddr> = candidates
                .iter()
                .copied()
                .filter(|&ip| self.get(ip).is_none())
                .collect();
            let live_free = candidates
                .iter()
                .copied()
                .find(|&ip| pool.is_free(ip) && self.get(ip).is_some());
            return match pool.allocate_requested(&usable) {
                Err(PoolError::CandidatesTaken { subnet, .. }) if live_free.is_some() => {
                    let ip = live_free.expect("checked above");
                    let claim = self.get(ip).expect("live");
                    Err(PoolError::LiveOnWire {
                        subnet,
                        ip,
                        claim: Box::new(claim.clone()),
                    })
                }
                other => other,
            };
        }
        // Live addresses are held as used for this one allocation, so the
        // lowest free address that is not live comes out; O(k log n) for k
        // live addresses.
        let held: Vec<IpAddr> = self
            .addresses()
            .chain(self.released.keys().copied())
            .filter(|&ip| pool.is_free(ip) && pool.mark_used(ip).is_ok())
            .collect();
        let result = pool.allocate_auto();
        for &ip in &held {
            pool.release(ip);
        }
        match result {
            // Only live addresses are left: rather than fail the pod, the
            // one seen longest ago goes (released pods' addresses come back
            // last, in the order they fell silent).
            Err(PoolError::Exhausted { .. }) if !held.is_empty() => {
                let oldest = held
                    .iter()
                    .copied()
                    .min_by_key(|&ip| self.last_active(ip))
                    .expect("not empty");
                pool.allocate_requested(&[oldest])
            }
            other => other,
        }
    }
}

/// Why the reports cannot vouch that no node saw an address claimed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unvouched {
    /// No node is known: silence from nobody proves nothing.
    #[error("no node is known")]
    NoNodes,
    /// A node has published no report of the subnet observed since then
    /// (its agent is down, cannot reach the API server, or is slow).
    #[error("node {node} has not reported since {since}")]
    Unreported {
        /// The node.
        node: String,
        /// The time its report had to be observed at or after.
        since: Timestamp,
    },
}

/// Whether every one of `nodes` published a report in `reports` (one
/// subnet's) observed at or after `since`: only then does the absence of a
/// claim mean that no node saw one. A node that cannot report never counts
/// as one that saw nothing.
///
/// # Errors
/// The first node without such a report, or [`Unvouched::NoNodes`].
pub fn every_node_reported<'a>(
    reports: impl IntoIterator<Item = &'a FlatNetworkWireClaims> + Clone,
    nodes: &[String],
    since: Timestamp,
) -> Result<(), Unvouched> {
    if nodes.is_empty() {
        return Err(Unvouched::NoNodes);
    }
    for node in nodes {
        let reported = reports.clone().into_iter().any(|r| {
            r.spec.node == *node && r.spec.observed_at.as_ref().is_some_and(|t| t.0 >= since)
        });
        if !reported {
            return Err(Unvouched::Unreported {
                node: node.clone(),
                since,
            });
        }
    }
    Ok(())
}

fn allocate_plain(pool: &mut Pool, candidates: &[IpAddr]) -> Result<IpAddr, PoolError> {
    if candidates.is_empty() {
        pool.allocate_auto()
    } else {
        pool.allocate_requested(candidates)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::{
        api::{FlatNetworkSubnetSpec, FlatNetworkWireClaimsSpec, ForeignClaim},
        validation::validate_subnet,
    };

    /// `node`'s report of `claims` (address, MAC, when) in subnet `lan`.
    pub(crate) fn report(node: &str, claims: &[(&str, &str, Timestamp)]) -> FlatNetworkWireClaims {
        FlatNetworkWireClaims::new(
            &FlatNetworkWireClaims::object_name("lan", node),
            FlatNetworkWireClaimsSpec {
                subnet: "lan".into(),
                node: node.into(),
                observed_at: None,
                claims: claims
                    .iter()
                    .map(|(ip, mac, seen)| ForeignClaim {
                        ip: ip.parse().unwrap(),
                        mac: (*mac).into(),
                        last_seen: Time(*seen),
                        kind: "arp_request".into(),
                    })
                    .collect(),
            },
        )
    }

    fn pool() -> Pool {
        let spec = FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: "192.0.2.0/29".into(),
            gateway: Some("192.0.2.1".parse().unwrap()),
            ..Default::default()
        };
        Pool::new(&validate_subnet("lan", &spec).unwrap())
    }

    /// A fixed time plus `secs`.
    pub(crate) fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    #[test]
    fn claims_outside_the_window_expire_and_the_latest_wins() {
        let now = at(10_000);
        let live = LiveAddresses::from_reports(
            &[
                report(
                    "a",
                    &[
                        ("192.0.2.2", "02:00:00:00:00:01", at(9_000)),
                        ("192.0.2.3", "02:00:00:00:00:02", at(10_000 - 3_601)),
                    ],
                ),
                report("b", &[("192.0.2.2", "02:00:00:00:00:09", at(9_500))]),
            ],
            now,
            DEFAULT_WIRE_WINDOW,
        );
        assert_eq!(live.addresses().count(), 1, "{live:?}");
        let claim = live.get("192.0.2.2".parse().unwrap()).unwrap();
        assert_eq!(
            (claim.mac.as_str(), claim.node.as_str()),
            ("02:00:00:00:00:09", "b")
        );
    }

    #[test]
    fn automatic_allocation_skips_live_addresses_and_keeps_them_free() {
        let live = LiveAddresses::from_reports(
            &[report(
                "a",
                &[
                    ("192.0.2.2", "02:00:00:00:00:01", at(0)),
                    ("192.0.2.4", "02:00:00:00:00:02", at(0)),
                ],
            )],
            at(1),
            DEFAULT_WIRE_WINDOW,
        );
        let mut pool = pool();
        assert_eq!(live.excluded_from(&pool), 2);
        let ip = live.allocate(&mut pool, &[]).unwrap();
        assert_eq!(ip, "192.0.2.3".parse::<IpAddr>().unwrap());
        let ip = live.allocate(&mut pool, &[]).unwrap();
        assert_eq!(ip, "192.0.2.5".parse::<IpAddr>().unwrap());
        assert!(
            pool.is_free("192.0.2.2".parse().unwrap()),
            "held only during the allocation"
        );
        assert_eq!(pool.used(), 2);
        // .6 is the last one; after it only live addresses are left, and
        // the one seen longest ago goes first.
        live.allocate(&mut pool, &[]).unwrap();
        assert_eq!(live.excluded_from(&pool), 2);
        let ip = live.allocate(&mut pool, &[]).unwrap();
        assert_eq!(
            ip,
            "192.0.2.2".parse::<IpAddr>().unwrap(),
            "seen at 0 like .4: the lower"
        );
        assert_eq!(
            live.allocate(&mut pool, &[]).unwrap(),
            "192.0.2.4".parse::<IpAddr>().unwrap()
        );
        assert!(matches!(
            live.allocate(&mut pool, &[]),
            Err(PoolError::Exhausted { .. })
        ));
    }

    #[test]
    fn under_pressure_the_address_silent_longest_goes_first() {
        let live = LiveAddresses::from_reports(
            &[report(
                "a",
                &[
                    ("192.0.2.2", "02:00:00:00:00:01", at(50)),
                    ("192.0.2.3", "02:00:00:00:00:02", at(10)),
                    ("192.0.2.4", "02:00:00:00:00:03", at(30)),
                ],
            )],
            at(60),
            DEFAULT_WIRE_WINDOW,
        );
        let mut pool = pool();
        for _ in 0..2 {
            live.allocate(&mut pool, &[]).unwrap();
        }
        let order: Vec<IpAddr> = (0..3)
            .map(|_| live.allocate(&mut pool, &[]).unwrap())
            .collect();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(order, [ip("192.0.2.3"), ip("192.0.2.4"), ip("192.0.2.2")]);
    }

    #[test]
    fn a_requested_live_address_names_the_mac_and_when() {
        let seen = at(0);
        let live = LiveAddresses::from_reports(
            &[report(
                "node-1",
                &[("192.0.2.5", "02:00:00:00:00:05", seen)],
            )],
            at(60),
            DEFAULT_WIRE_WINDOW,
        );
        let mut pool = pool();
        let error = live
            .allocate(&mut pool, &["192.0.2.5".parse().unwrap()])
            .unwrap_err();
        let message = error.to_string();
        for part in [
            "192.0.2.5",
            "02:00:00:00:00:05",
            &seen.to_string(),
            "node-1",
        ] {
            assert!(message.contains(part), "{part} missing: {message}");
        }
        // Another candidate that is not live is taken instead.
        let ip = live
            .allocate(
                &mut pool,
                &["192.0.2.5".parse().unwrap(), "192.0.2.6".parse().unwrap()],
            )
            .unwrap();
        assert_eq!(ip, "192.0.2.6".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn released_addresses_come_after_every_other_free_one_oldest_release_first() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let live = LiveAddresses::default().with_released(
            [
                (ip("192.0.2.2"), at(20)),
                (ip("192.0.2.3"), at(10)),
                // Released before the window: an ordinary free address.
                (ip("192.0.2.5"), at(-4_000)),
            ],
            at(30),
            DEFAULT_WIRE_WINDOW,
        );
        let mut pool = pool();
        assert_eq!(live.excluded_from(&pool), 0, "quarantine is not the wire");
        let order: Vec<IpAddr> = (0..5)
            .map(|_| live.allocate(&mut pool, &[]).unwrap())
            .collect();
        assert_eq!(
            order,
            [
                ip("192.0.2.4"),
                ip("192.0.2.5"),
                ip("192.0.2.6"),
                ip("192.0.2.3"),
                ip("192.0.2.2")
            ]
        );
        // A pod asking for a quarantined address gets it.
        let mut pool = self::pool();
        assert_eq!(
            live.allocate(&mut pool, &[ip("192.0.2.2")]).unwrap(),
            ip("192.0.2.2")
        );
    }

    #[test]
    fn a_claim_after_the_release_keeps_the_address_back_longer() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        // .2 released at 10 and still answering at 50; .3 released at 20.
        let live = LiveAddresses::from_reports(
            &[report("a", &[("192.0.2.2", "02:00:00:00:00:01", at(50))])],
            at(60),
            DEFAULT_WIRE_WINDOW,
        )
        .with_released(
            [(ip("192.0.2.2"), at(10)), (ip("192.0.2.3"), at(20))],
            at(60),
            DEFAULT_WIRE_WINDOW,
        );
        let mut pool = pool();
        for _ in 0..3 {
            live.allocate(&mut pool, &[]).unwrap();
        }
        assert_eq!(live.allocate(&mut pool, &[]).unwrap(), ip("192.0.2.3"));
        assert_eq!(live.allocate(&mut pool, &[]).unwrap(), ip("192.0.2.2"));
    }

    #[test]
    fn silence_counts_only_when_every_node_reported_since() {
        let observed = |node: &str, secs: Option<i64>| {
            let mut r = report(node, &[]);
            r.spec.observed_at = secs.map(|s| Time(at(s)));
            r
        };
        let nodes = ["a".to_owned(), "b".to_owned()];
        let reports = [observed("a", Some(100)), observed("b", Some(99))];
        assert_eq!(every_node_reported(&reports, &nodes, at(99)), Ok(()));
        assert_eq!(
            every_node_reported(&reports, &nodes, at(100)),
            Err(Unvouched::Unreported {
                node: "b".into(),
                since: at(100)
            })
        );
        // A report without an observation time, or none at all, is no word.
        let reports = [observed("a", Some(100)), observed("b", None)];
        assert!(every_node_reported(&reports, &nodes, at(0)).is_err());
        assert!(every_node_reported(&reports[..1], &nodes, at(0)).is_err());
        assert_eq!(
            every_node_reported(&reports, &[], at(0)),
            Err(Unvouched::NoNodes)
        );
    }
}
