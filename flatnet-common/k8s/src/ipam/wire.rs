//! Addresses live on the wire: what the node agents saw foreign MACs claim
//! (their `FlatNetworkWireClaims`), as the allocator consults it.
//!
//! An address a MAC of no flatnet pod claimed within the window is not
//! handed out: not by automatic allocation (it is skipped), not when a pod
//! asks for it (a clear error names the MAC and when it was seen).

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

/// The addresses of one subnet claimed by foreign MACs within the window.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveAddresses {
    claims: BTreeMap<IpAddr, LiveClaim>,
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
        let window = SignedDuration::try_from(window).unwrap_or(SignedDuration::MAX);
        let since = now.checked_sub(window).unwrap_or(Timestamp::MIN);
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
        Self { claims }
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

    /// Whether no address is live.
    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
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
    /// Automatic allocation hands out a live address only when nothing
    /// else is free: the one seen longest ago.
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
                    .min_by_key(|&ip| self.get(ip).map(|c| c.last_seen))
                    .expect("not empty");
                pool.allocate_requested(&[oldest])
            }
            other => other,
        }
    }
}

fn allocate_plain(pool: &mut Pool, candidates: &[IpAddr]) -> Result<IpAddr, PoolError> {
    if candidates.is_empty() {
        pool.allocate_auto()
    } else {
        pool.allocate_requested(candidates)
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::{
        api::{FlatNetworkSubnetSpec, FlatNetworkWireClaimsSpec, ForeignClaim},
        validation::validate_subnet,
    };

    fn report(node: &str, claims: &[(&str, &str, Timestamp)]) -> FlatNetworkWireClaims {
        FlatNetworkWireClaims::new(
            &FlatNetworkWireClaims::object_name("lan", node),
            FlatNetworkWireClaimsSpec {
                subnet: "lan".into(),
                node: node.into(),
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

    fn at(secs: i64) -> Timestamp {
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
}
