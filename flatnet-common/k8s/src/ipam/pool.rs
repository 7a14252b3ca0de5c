//! The address pool of one subnet.

use std::net::IpAddr;

use super::{
    cidr::{Cidr, Family, from_u128, to_u128},
    intervals::IntervalSet,
    used_ranges,
};
use crate::{
    api::IpRange,
    validation::{ValidSubnet, has_broadcast_address, has_network_address},
};

/// Why an address could not be allocated, marked or released.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Every allocatable address is in use.
    #[error("subnet {subnet} has no free address left: widen spec.ranges or release addresses")]
    Exhausted {
        /// The subnet's name.
        subnet: String,
    },
    /// A requested address is not part of the subnet at all.
    #[error("{ip} is not inside subnet {subnet} ({cidr}): request an address of {cidr}")]
    OutsideSubnet {
        /// The subnet's name.
        subnet: String,
        /// The subnet's network.
        cidr: Cidr,
        /// The requested address.
        ip: IpAddr,
    },
    /// A requested address is in the subnet but never handed out.
    #[error(
        "{ip} is {reason} of subnet {subnet}, which is never allocated: request an address {hint}"
    )]
    NotAllocatable {
        /// The subnet's name.
        subnet: String,
        /// The requested address.
        ip: IpAddr,
        /// What the address is.
        reason: &'static str,
        /// Where to pick instead.
        hint: &'static str,
    },
    /// Every requested address is already in use.
    #[error(
        "all requested addresses of subnet {subnet} are in use ({}): add free addresses to the request or free one of them",
        list(candidates)
    )]
    CandidatesTaken {
        /// The subnet's name.
        subnet: String,
        /// The requested addresses.
        candidates: Vec<IpAddr>,
    },
    /// A requested address is reserved for another workload's pods (the
    /// subnet's `status.reservedIP`, see [`super::reservations`]).
    #[error(
        "{ip} of subnet {subnet} is reserved by {holder} (status.reservedIP): request another address, or remove it from {holder}'s pod template first"
    )]
    Reserved {
        /// The subnet's name.
        subnet: String,
        /// The requested address.
        ip: IpAddr,
        /// The `reservedIP` key holding it, `<Kind>/<namespace>/<name>`.
        holder: String,
    },
    /// Every free requested address is in use on the LAN by a host outside
    /// flatnet (see [`super::wire`]).
    #[error(
        "{ip} of subnet {subnet} is in use on the LAN: MAC {} claimed it at {} (seen by node {}); free it on that host or request another address",
        claim.mac,
        claim.last_seen,
        claim.node
    )]
    LiveOnWire {
        /// The subnet's name.
        subnet: String,
        /// The requested address.
        ip: IpAddr,
        /// Who claimed it, when, seen where.
        claim: Box<super::wire::LiveClaim>,
    },
    /// An address was marked used twice: two records claim it.
    #[error("{ip} of subnet {subnet} is already recorded as used: two allocations claim it")]
    AlreadyUsed {
        /// The subnet's name.
        subnet: String,
        /// The address.
        ip: IpAddr,
    },
}

fn list(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Addresses of one subnet: which may be handed out and which are taken.
///
/// The pool is pure bookkeeping. It is rebuilt from the allocation records
/// (every FlatNetworkIP of the subnet) with [`Pool::mark_used`], then asked
/// for addresses; committing an allocation to the API is the caller's job.
///
/// Never allocated: the network address (except on point-to-point /31, /32,
/// /127, /128 networks), the IPv4 broadcast, the gateway, addresses outside
/// `spec.ranges` (when ranges are set) and taken addresses. Each operation is
/// O(log n) in the number of free intervals, whatever the subnet size.
#[derive(Clone, Debug)]
pub struct Pool {
    subnet: String,
    cidr: Cidr,
    gateway: Option<u128>,
    /// Addresses that may ever be handed out; fixed at construction.
    allocatable: IntervalSet,
    /// `allocatable` minus `taken`.
    free: IntervalSet,
    /// Addresses held by allocations, whether or not allocatable (records may
    /// predate a change of `spec.ranges`).
    taken: IntervalSet,
}

impl Pool {
    /// An empty pool for `subnet`.
    pub fn new(subnet: &ValidSubnet) -> Self {
        let cidr = subnet.cidr;
        let mut allocatable = IntervalSet::new();
        for (from, to) in subnet.pool_intervals() {
            allocatable.insert(from, to);
        }
        if has_network_address(cidr) {
            allocatable.remove(cidr.first(), cidr.first());
        }
        if has_broadcast_address(cidr) {
            allocatable.remove(cidr.last(), cidr.last());
        }
        let gateway = subnet.gateway.map(to_u128);
        if let Some(gateway) = gateway {
            allocatable.remove(gateway, gateway);
        }
        Self {
            subnet: subnet.name.clone(),
            cidr,
            gateway,
            free: allocatable.clone(),
            allocatable,
            taken: IntervalSet::new(),
        }
    }

    /// A pool for `subnet` with `used` already taken.
    ///
    /// # Errors
    /// The first address outside the subnet or claimed twice.
    pub fn with_used(
        subnet: &ValidSubnet,
        used: impl IntoIterator<Item = IpAddr>,
    ) -> Result<Self, PoolError> {
        let mut pool = Self::new(subnet);
        for ip in used {
            pool.mark_used(ip)?;
        }
        Ok(pool)
    }

    /// The subnet's network.
    pub fn cidr(&self) -> Cidr {
        self.cidr
    }

    /// Number of addresses that may ever be handed out.
    pub fn total(&self) -> u128 {
        self.allocatable.len()
    }

    /// Number of addresses held by allocations.
    pub fn used(&self) -> u128 {
        self.taken.len()
    }

    /// Number of addresses still available.
    pub fn free(&self) -> u128 {
        self.free.len()
    }

    /// Whether `ip` can be allocated right now.
    pub fn is_free(&self, ip: IpAddr) -> bool {
        self.cidr.contains(ip) && self.free.contains(to_u128(ip))
    }

    /// Whether `ip` is held by an allocation.
    pub fn is_used(&self, ip: IpAddr) -> bool {
        self.cidr.contains(ip) && self.taken.contains(to_u128(ip))
    }

    /// Whether `ip` may ever be handed out (inside the pool, not excluded).
    pub fn is_allocatable(&self, ip: IpAddr) -> bool {
        self.check_allocatable(ip).is_ok()
    }

    /// Hands out the lowest free address.
    pub fn allocate_auto(&mut self) -> Result<IpAddr, PoolError> {
        let value = self.free.pop_first().ok_or_else(|| PoolError::Exhausted {
            subnet: self.subnet.clone(),
        })?;
        self.taken.insert(value, value);
        Ok(from_u128(self.cidr.family(), value))
    }

    /// Hands out the first free address of `candidates`, in their order.
    ///
    /// # Errors
    /// A candidate that can never be allocated here ([`PoolError::OutsideSubnet`],
    /// [`PoolError::NotAllocatable`]) is a configuration error reported even
    /// when another candidate is free; [`PoolError::CandidatesTaken`] when all
    /// are in use. An empty list is [`PoolError::CandidatesTaken`] too.
    pub fn allocate_requested(&mut self, candidates: &[IpAddr]) -> Result<IpAddr, PoolError> {
        for &ip in candidates {
            self.check_allocatable(ip)?;
        }
        let ip = candidates
            .iter()
            .copied()
            .find(|&ip| self.free.contains(to_u128(ip)))
            .ok_or_else(|| PoolError::CandidatesTaken {
                subnet: self.subnet.clone(),
                candidates: candidates.to_vec(),
            })?;
        let value = to_u128(ip);
        self.free.remove(value, value);
        self.taken.insert(value, value);
        Ok(ip)
    }

    /// Records `ip` as held by an existing allocation.
    ///
    /// Addresses outside the pool's ranges are accepted (the record may
    /// predate a change of `spec.ranges`) as long as they are in the CIDR.
    ///
    /// # Errors
    /// [`PoolError::OutsideSubnet`], or [`PoolError::AlreadyUsed`] when the
    /// address is taken already: two records claim it.
    pub fn mark_used(&mut self, ip: IpAddr) -> Result<(), PoolError> {
        self.check_in_cidr(ip)?;
        let value = to_u128(ip);
        if self.taken.insert(value, value) == 0 {
            return Err(PoolError::AlreadyUsed {
                subnet: self.subnet.clone(),
                ip,
            });
        }
        self.free.remove(value, value);
        Ok(())
    }

    /// Records every address of `ranges` (a subnet's `status.usedIP`) as
    /// taken, clipped to the CIDR; ranges of the other family are ignored.
    ///
    /// Unlike [`Pool::mark_used`] this accepts addresses that are already
    /// taken: `usedIP` and the allocation records describe the same
    /// addresses, and the pool is the union of both. The gateway, which
    /// `usedIP` lists too, stays excluded either way. Returns the number of
    /// addresses that were not taken before.
    pub fn reserve_ranges(&mut self, ranges: &[IpRange]) -> u128 {
        let (v4, v6) = used_ranges::to_intervals(ranges);
        let set = match self.cidr.family() {
            Family::V4 => v4,
            Family::V6 => v6,
        };
        let (first, last) = (self.cidr.first(), self.cidr.last());
        let mut added = 0;
        for range in set.iter() {
            let (start, end) = ((*range.start()).max(first), (*range.end()).min(last));
            if start > end {
                continue;
            }
            added += self.taken.insert(start, end);
            self.free.remove(start, end);
        }
        if let Some(gateway) = self.gateway
            && self.taken.remove(gateway, gateway) == 1
        {
            added -= 1;
        }
        added
    }

    /// Returns `ip` to the pool; `false` when it was not taken.
    pub fn release(&mut self, ip: IpAddr) -> bool {
        if !self.cidr.contains(ip) {
            return false;
        }
        let value = to_u128(ip);
        if self.taken.remove(value, value) == 0 {
            return false;
        }
        if self.allocatable.contains(value) {
            self.free.insert(value, value);
        }
        true
    }

    /// The taken addresses, ascending.
    pub fn used_addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let family = self.cidr.family();
        self.taken
            .iter()
            .flatten()
            .map(move |v| from_u128(family, v))
    }

    /// The subnet status view of the pool.
    pub fn usage(&self) -> Usage {
        let mut used = self.taken.clone();
        if let Some(gateway) = self.gateway {
            used.insert(gateway, gateway);
        }
        Usage {
            used_ip: used_ranges::from_intervals(self.cidr.family(), &used),
            used_ip_count: saturating_i64(used.len()),
            total_ip_count: saturating_i64(self.total()),
        }
    }

    fn check_in_cidr(&self, ip: IpAddr) -> Result<(), PoolError> {
        if self.cidr.contains(ip) {
            Ok(())
        } else {
            Err(PoolError::OutsideSubnet {
                subnet: self.subnet.clone(),
                cidr: self.cidr,
                ip,
            })
        }
    }

    fn check_allocatable(&self, ip: IpAddr) -> Result<(), PoolError> {
        self.check_in_cidr(ip)?;
        let value = to_u128(ip);
        if self.allocatable.contains(value) {
            return Ok(());
        }
        let (reason, hint) = if Some(value) == self.gateway {
            ("the gateway", "other than spec.gateway")
        } else if value == self.cidr.first() && has_network_address(self.cidr) {
            ("the network address", "above the network address")
        } else if value == self.cidr.last() && self.cidr.family() == Family::V4 {
            ("the broadcast address", "below the broadcast address")
        } else {
            ("outside spec.ranges", "inside spec.ranges")
        };
        Err(PoolError::NotAllocatable {
            subnet: self.subnet.clone(),
            ip,
            reason,
            hint,
        })
    }
}

/// What a subnet's status reports about its pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    /// `status.usedIP`: taken addresses plus the gateway, merged and sorted.
    pub used_ip: Vec<IpRange>,
    /// `status.usedIPCount`: addresses covered by `used_ip`, the gateway
    /// included (the original counted it on some paths only).
    pub used_ip_count: i64,
    /// `status.totalIPCount`: allocatable addresses.
    pub total_ip_count: i64,
}

fn saturating_i64(value: u128) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
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

    fn subnet(cidr: &str, gateway: Option<&str>, ranges: &[(&str, &str)]) -> ValidSubnet {
        let spec = FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: cidr.into(),
            gateway: gateway.map(ip),
            ranges: ranges
                .iter()
                .map(|(f, t)| IpRange::new(ip(f), ip(t)))
                .collect(),
            ..Default::default()
        };
        validate_subnet("net", &spec).unwrap()
    }

    #[test]
    fn auto_skips_network_gateway_and_used() {
        let mut pool = Pool::with_used(
            &subnet("10.0.0.0/24", Some("10.0.0.1"), &[]),
            [ip("10.0.0.3")],
        )
        .unwrap();
        assert_eq!(
            pool.total(),
            253,
            "256 minus network, broadcast and gateway"
        );
        assert_eq!(pool.allocate_auto(), Ok(ip("10.0.0.2")));
        assert_eq!(pool.allocate_auto(), Ok(ip("10.0.0.4")));
        assert_eq!(pool.used(), 3);
        assert!(pool.release(ip("10.0.0.2")));
        assert_eq!(
            pool.allocate_auto(),
            Ok(ip("10.0.0.2")),
            "freed addresses are reused, lowest first"
        );
    }

    #[test]
    fn ranges_limit_the_pool_and_exhaust() {
        let mut pool = Pool::new(&subnet(
            "10.128.1.0/24",
            None,
            &[("10.128.1.101", "10.128.1.102")],
        ));
        assert_eq!(pool.total(), 2);
        assert_eq!(pool.allocate_auto(), Ok(ip("10.128.1.101")));
        assert_eq!(pool.allocate_auto(), Ok(ip("10.128.1.102")));
        let err = pool.allocate_auto().unwrap_err();
        assert_eq!(
            err,
            PoolError::Exhausted {
                subnet: "net".into()
            }
        );
        assert!(err.to_string().contains("widen spec.ranges"));
    }

    #[test]
    fn broadcast_and_ipv6_edges() {
        let mut v4 = Pool::new(&subnet("10.0.0.0/30", None, &[]));
        assert_eq!(
            (v4.allocate_auto(), v4.allocate_auto()),
            (Ok(ip("10.0.0.1")), Ok(ip("10.0.0.2")))
        );
        assert!(v4.allocate_auto().is_err(), ".3 is the broadcast");
        let p2p = Pool::new(&subnet("10.0.0.0/31", None, &[]));
        assert_eq!(p2p.total(), 2, "point-to-point networks use both addresses");
        let mut v6 = Pool::new(&subnet("fd00::/126", None, &[]));
        assert_eq!(
            v6.total(),
            3,
            "only the subnet-router anycast address is excluded"
        );
        for expected in ["fd00::1", "fd00::2", "fd00::3"] {
            assert_eq!(v6.allocate_auto(), Ok(ip(expected)));
        }
        let big = Pool::new(&subnet("fd00::/64", None, &[]));
        assert_eq!(big.total(), (1u128 << 64) - 1);
        assert_eq!(big.usage().total_ip_count, i64::MAX, "saturates");
    }

    #[test]
    fn requested_takes_first_free_candidate() {
        let mut pool = Pool::new(&subnet("10.0.0.0/24", Some("10.0.0.1"), &[]));
        let candidates = [ip("10.0.0.5"), ip("10.0.0.6")];
        assert_eq!(pool.allocate_requested(&candidates), Ok(ip("10.0.0.5")));
        assert_eq!(pool.allocate_requested(&candidates), Ok(ip("10.0.0.6")));
        assert_eq!(
            pool.allocate_requested(&candidates),
            Err(PoolError::CandidatesTaken {
                subnet: "net".into(),
                candidates: candidates.to_vec()
            })
        );
        assert_eq!(pool.allocate_auto(), Ok(ip("10.0.0.2")));
    }

    #[test]
    fn requested_outside_pool_is_a_distinct_error() {
        let mut pool = Pool::new(&subnet(
            "10.0.0.0/24",
            Some("10.0.0.1"),
            &[("10.0.0.100", "10.0.0.200")],
        ));
        let outside = pool.allocate_requested(&[ip("10.0.1.5")]).unwrap_err();
        assert!(
            matches!(outside, PoolError::OutsideSubnet { .. }),
            "{outside}"
        );
        let v6 = pool.allocate_requested(&[ip("fd00::5")]).unwrap_err();
        assert!(matches!(v6, PoolError::OutsideSubnet { .. }));
        for (candidate, reason) in [
            ("10.0.0.50", "outside spec.ranges"),
            ("10.0.0.1", "the gateway"),
            ("10.0.0.0", "the network address"),
            ("10.0.0.255", "the broadcast address"),
        ] {
            let err = pool
                .allocate_requested(&[ip("10.0.0.150"), ip(candidate)])
                .unwrap_err();
            assert!(
                matches!(err, PoolError::NotAllocatable { reason: r, .. } if r == reason),
                "{candidate}: {err}"
            );
        }
        assert_eq!(pool.used(), 0, "a rejected request takes nothing");
        assert_eq!(
            pool.allocate_requested(&[ip("10.0.0.150")]),
            Ok(ip("10.0.0.150"))
        );
    }

    #[test]
    fn mark_used_detects_double_claims_and_accepts_stale_records() {
        let mut pool = Pool::new(&subnet(
            "10.0.0.0/24",
            None,
            &[("10.0.0.100", "10.0.0.200")],
        ));
        pool.mark_used(ip("10.0.0.100")).unwrap();
        assert_eq!(
            pool.mark_used(ip("10.0.0.100")),
            Err(PoolError::AlreadyUsed {
                subnet: "net".into(),
                ip: ip("10.0.0.100")
            })
        );
        // A record from before spec.ranges changed is held, but never freed into the pool.
        pool.mark_used(ip("10.0.0.7")).unwrap();
        assert!(pool.is_used(ip("10.0.0.7")) && !pool.is_allocatable(ip("10.0.0.7")));
        assert_eq!(pool.used(), 2);
        assert!(pool.release(ip("10.0.0.7")));
        assert!(!pool.is_free(ip("10.0.0.7")));
        assert!(!pool.release(ip("10.0.0.7")), "second release is a no-op");
        assert!(!pool.release(ip("192.168.0.1")));
        assert!(matches!(
            pool.mark_used(ip("192.168.0.1")),
            Err(PoolError::OutsideSubnet { .. })
        ));
    }

    #[test]
    fn usage_lists_allocations_and_gateway() {
        let used = ["10.2.3.100", "10.2.3.101", "10.2.3.102"].map(ip);
        let pool = Pool::with_used(
            &subnet(
                "10.2.3.0/24",
                Some("10.2.3.1"),
                &[("10.2.3.100", "10.2.3.200")],
            ),
            used,
        )
        .unwrap();
        let usage = pool.usage();
        assert_eq!(
            usage.used_ip,
            [
                IpRange::new(ip("10.2.3.1"), ip("10.2.3.1")),
                IpRange::new(ip("10.2.3.100"), ip("10.2.3.102"))
            ]
        );
        assert_eq!((usage.used_ip_count, usage.total_ip_count), (4, 101));
        assert_eq!(pool.used_addresses().collect::<Vec<_>>(), used);
    }

    #[test]
    fn reserve_ranges_unions_used_ip_with_records() {
        let subnet = validate_subnet(
            "net",
            &FlatNetworkSubnetSpec {
                flat_mode: "macvlan".into(),
                master: "eth0".into(),
                cidr: "10.0.0.0/24".into(),
                gateway: Some(ip("10.0.0.1")),
                ..FlatNetworkSubnetSpec::default()
            },
        )
        .unwrap();
        let mut pool = Pool::with_used(&subnet, [ip("10.0.0.3")]).unwrap();
        let used = [
            IpRange::new(ip("10.0.0.1"), ip("10.0.0.4")),
            IpRange::new(ip("fd00::1"), ip("fd00::9")),
            IpRange::new(ip("10.0.0.250"), ip("10.0.1.20")),
        ];
        // .2 and .4 (gateway and .3 not counted), .250 to .255.
        assert_eq!(pool.reserve_ranges(&used), 8);
        assert_eq!(pool.allocate_auto(), Ok(ip("10.0.0.5")));
        assert!(
            !pool.is_used(ip("10.0.0.1")),
            "the gateway is not an allocation"
        );
        assert_eq!(pool.reserve_ranges(&used), 0, "idempotent");
    }
}
