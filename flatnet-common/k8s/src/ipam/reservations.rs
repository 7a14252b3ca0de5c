//! Addresses a subnet's `status.reservedIP` keeps for their holders.
//!
//! Two kinds of holder write it: the workload controller
//! (`<Kind>/<namespace>/<name>`: the fixed addresses of a workload's pod
//! template) and the migrator (`MacvlanIP/<namespace>/<name>`: what a V1
//! pod still holds). Allocation hands a reserved address only to a pod of
//! the workload holding it; a V1 holder is never a requester, so its
//! addresses are handed to nobody.

use std::{collections::BTreeMap, net::IpAddr};

use super::{
    cidr::{Family, from_u128},
    pool::{Pool, PoolError},
    used_ranges,
};
use crate::api::FlatNetworkSubnetStatus;

/// Every reserved address with the keys holding it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reservations {
    holders: BTreeMap<IpAddr, Vec<String>>,
}

impl Reservations {
    /// The reservations of `status`. A range is taken whole: the workload
    /// controller writes merged lists of single addresses and the migrator
    /// one address per V1 pod.
    #[must_use]
    pub fn of(status: &FlatNetworkSubnetStatus) -> Self {
        let mut holders: BTreeMap<IpAddr, Vec<String>> = BTreeMap::new();
        for (key, ranges) in &status.reserved_ip {
            let (v4, v6) = used_ranges::to_intervals(ranges);
            for (set, family) in [(v4, Family::V4), (v6, Family::V6)] {
                for n in set.iter().flatten() {
                    holders
                        .entry(from_u128(family, n))
                        .or_default()
                        .push(key.clone());
                }
            }
        }
        Self { holders }
    }

    /// Whether nothing is reserved.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Whether `ip` is reserved by anyone.
    #[must_use]
    pub fn is_reserved(&self, ip: IpAddr) -> bool {
        self.holders.contains_key(&ip)
    }

    /// A holder of `ip` other than `requester` (the reservation key of the
    /// asking pod's workload; `None` when it asks for no specific address
    /// or has no workload key), if any: `ip` is not `requester`'s to take.
    #[must_use]
    pub fn held_against(&self, ip: IpAddr, requester: Option<&str>) -> Option<&str> {
        self.holders
            .get(&ip)?
            .iter()
            .map(String::as_str)
            .find(|holder| Some(*holder) != requester)
    }

    /// Reserved addresses `pool` would otherwise hand out (free now).
    pub fn free_in<'a>(&'a self, pool: &'a Pool) -> impl Iterator<Item = IpAddr> + 'a {
        self.holders.keys().copied().filter(|ip| pool.is_free(*ip))
    }

    /// The addresses of `free` that `requester` alone holds: the ones its
    /// pods may take.
    pub fn own<'a>(
        &'a self,
        free: &'a [IpAddr],
        requester: Option<&'a str>,
    ) -> impl Iterator<Item = IpAddr> + 'a {
        free.iter()
            .copied()
            .filter(move |ip| requester.is_some() && self.held_against(*ip, requester).is_none())
    }

    /// Says why `error` happened when a requested address is reserved by
    /// another workload: [`PoolError::Reserved`] in place of
    /// [`PoolError::CandidatesTaken`] when the first such candidate is
    /// reserved against `requester`; other errors unchanged.
    #[must_use]
    pub fn explain(&self, error: PoolError, requester: Option<&str>) -> PoolError {
        let PoolError::CandidatesTaken { subnet, candidates } = error else {
            return error;
        };
        match candidates
            .iter()
            .find_map(|ip| Some((*ip, self.held_against(*ip, requester)?)))
        {
            Some((ip, holder)) => PoolError::Reserved {
                subnet,
                ip,
                holder: holder.to_owned(),
            },
            None => PoolError::CandidatesTaken { subnet, candidates },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        api::{FlatNetworkSubnetSpec, IpRange},
        validation::validate_subnet,
    };

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn status(entries: &[(&str, &str, &str)]) -> FlatNetworkSubnetStatus {
        let mut reserved_ip: BTreeMap<String, Vec<IpRange>> = BTreeMap::new();
        for (key, from, to) in entries {
            reserved_ip
                .entry((*key).to_owned())
                .or_default()
                .push(IpRange::new(ip(from), ip(to)));
        }
        FlatNetworkSubnetStatus {
            reserved_ip,
            ..Default::default()
        }
    }

    #[test]
    fn an_address_is_held_against_everyone_but_its_workload() {
        let reserved = Reservations::of(&status(&[
            ("Deployment/shop/web", "10.0.0.10", "10.0.0.11"),
            ("MacvlanIP/shop/old", "10.0.0.12", "10.0.0.12"),
            ("StatefulSet/shop/db", "10.0.0.11", "10.0.0.11"),
        ]));
        let web = Some("Deployment/shop/web");
        assert_eq!(reserved.held_against(ip("10.0.0.10"), web), None);
        assert_eq!(
            reserved.held_against(ip("10.0.0.10"), None),
            Some("Deployment/shop/web")
        );
        // Reserved by two workloads: neither may take it.
        assert_eq!(
            reserved.held_against(ip("10.0.0.11"), web),
            Some("StatefulSet/shop/db")
        );
        // A V1 pod's address is nobody's to take.
        assert!(reserved.held_against(ip("10.0.0.12"), web).is_some());
        assert_eq!(reserved.held_against(ip("10.0.0.13"), None), None);
        let free = [ip("10.0.0.10"), ip("10.0.0.11"), ip("10.0.0.12")];
        assert_eq!(
            reserved.own(&free, web).collect::<Vec<_>>(),
            [ip("10.0.0.10")]
        );
        assert_eq!(reserved.own(&free, None).count(), 0);
    }

    #[test]
    fn a_taken_request_names_the_reserving_workload() {
        let reserved = Reservations::of(&status(&[(
            "Deployment/shop/web",
            "10.0.0.10",
            "10.0.0.10",
        )]));
        let taken = || PoolError::CandidatesTaken {
            subnet: "lan".into(),
            candidates: vec![ip("10.0.0.10")],
        };
        let explained = reserved.explain(taken(), Some("Deployment/shop/other"));
        assert_eq!(
            explained,
            PoolError::Reserved {
                subnet: "lan".into(),
                ip: ip("10.0.0.10"),
                holder: "Deployment/shop/web".into()
            }
        );
        assert!(
            explained
                .to_string()
                .contains("reserved by Deployment/shop/web")
        );
        assert_eq!(
            reserved.explain(taken(), Some("Deployment/shop/web")),
            taken()
        );
    }

    #[test]
    fn only_free_addresses_of_the_pool_count() {
        let spec = FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: "10.0.0.0/24".into(),
            ranges: vec![IpRange::new(ip("10.0.0.10"), ip("10.0.0.20"))],
            ..Default::default()
        };
        let pool =
            Pool::with_used(&validate_subnet("lan", &spec).unwrap(), [ip("10.0.0.10")]).unwrap();
        let reserved = Reservations::of(&status(&[
            ("Deployment/shop/web", "10.0.0.9", "10.0.0.11"),
            ("Deployment/shop/v6", "fd00::1", "fd00::1"),
        ]));
        assert_eq!(
            reserved.free_in(&pool).collect::<Vec<_>>(),
            [ip("10.0.0.11")]
        );
    }
}
