//! Property tests of the IPAM pool: random allocate / request / mark /
//! release sequences, checked against a plain set model, on small and large
//! pools of both families.

use std::{collections::BTreeSet, net::IpAddr};

use flatnet_k8s::{
    api::{FlatNetworkSubnetSpec, FlatNetworkSubnetStatus, IpRange},
    ipam::{Cidr, Family, Pool, PoolError, compact_ranges, from_u128, to_u128, used_ranges},
    validation::{ValidSubnet, validate_subnet},
};
use proptest::prelude::*;

/// One pool shape under test.
struct Shape {
    cidr: &'static str,
    gateway: Option<&'static str>,
    ranges: &'static [(&'static str, &'static str)],
}

impl Shape {
    fn subnet(&self) -> ValidSubnet {
        let spec = FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: self.cidr.into(),
            gateway: self.gateway.map(|g| g.parse().unwrap()),
            ranges: self
                .ranges
                .iter()
                .map(|(f, t)| IpRange::new(f.parse().unwrap(), t.parse().unwrap()))
                .collect(),
            ..Default::default()
        };
        validate_subnet("net", &spec).unwrap()
    }
}

/// Whether the pool may hand out `ip`, computed independently of the pool.
fn allocatable(subnet: &ValidSubnet, ip: IpAddr) -> bool {
    let cidr: Cidr = subnet.cidr;
    if !cidr.contains(ip) || Some(ip) == subnet.gateway {
        return false;
    }
    let value = to_u128(ip);
    let host_bits = cidr.family().bits() - cidr.prefix_len();
    if host_bits >= 2
        && (value == cidr.first() || (cidr.family() == Family::V4 && value == cidr.last()))
    {
        return false;
    }
    subnet.ranges.is_empty()
        || subnet
            .ranges
            .iter()
            .any(|&(f, t)| (to_u128(f)..=to_u128(t)).contains(&value))
}

#[derive(Clone, Debug)]
enum Op {
    Auto,
    Request(Vec<u128>),
    Mark(u128),
    Release(u128),
}

/// Offsets from the network address: mostly near the start (where automatic
/// allocation works, so operations collide) and near the end of the CIDR.
fn offset(size: u128) -> BoxedStrategy<u128> {
    let window = size.min(600);
    prop_oneof![0..window, (size - window)..size].boxed()
}

fn ops(size: u128) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => Just(Op::Auto),
        2 => proptest::collection::vec(offset(size), 1..4).prop_map(Op::Request),
        1 => offset(size).prop_map(Op::Mark),
        2 => offset(size).prop_map(Op::Release),
    ];
    proptest::collection::vec(op, 0..300)
}

fn run(shape: &Shape, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let subnet = shape.subnet();
    let family = subnet.cidr.family();
    let addr = |offset: u128| from_u128(family, subnet.cidr.first() + offset);
    let small = subnet.cidr.last() - subnet.cidr.first() < 1024;
    let mut pool = Pool::new(&subnet);
    let total = pool.total();
    let mut model: BTreeSet<IpAddr> = BTreeSet::new();

    for op in ops {
        match op {
            Op::Auto => match pool.allocate_auto() {
                Ok(ip) => {
                    prop_assert!(allocatable(&subnet, ip), "{ip} must never be handed out");
                    prop_assert!(model.insert(ip), "{ip} handed out twice");
                    if small {
                        // Lowest free: nothing allocatable below it was free.
                        let below =
                            (subnet.cidr.first()..to_u128(ip)).map(|v| from_u128(family, v));
                        for other in below {
                            prop_assert!(!allocatable(&subnet, other) || model.contains(&other));
                        }
                    }
                }
                Err(PoolError::Exhausted { .. }) => {
                    prop_assert_eq!(
                        model.iter().filter(|ip| allocatable(&subnet, **ip)).count() as u128,
                        total
                    );
                }
                Err(other) => prop_assert!(false, "unexpected {other}"),
            },
            Op::Request(offsets) => {
                let candidates: Vec<IpAddr> = offsets.into_iter().map(addr).collect();
                let result = pool.allocate_requested(&candidates);
                if candidates.iter().any(|ip| !allocatable(&subnet, *ip)) {
                    prop_assert!(
                        matches!(result, Err(PoolError::NotAllocatable { .. })),
                        "{result:?}"
                    );
                } else if let Some(expected) = candidates.iter().find(|ip| !model.contains(ip)) {
                    prop_assert_eq!(&result, &Ok(*expected));
                    model.insert(*expected);
                } else {
                    prop_assert!(
                        matches!(result, Err(PoolError::CandidatesTaken { .. })),
                        "{result:?}"
                    );
                }
            }
            Op::Mark(offset) => {
                let ip = addr(offset);
                let result = pool.mark_used(ip);
                if model.insert(ip) {
                    prop_assert_eq!(result, Ok(()));
                } else {
                    prop_assert!(
                        matches!(result, Err(PoolError::AlreadyUsed { .. })),
                        "{result:?}"
                    );
                }
            }
            Op::Release(offset) => {
                let ip = addr(offset);
                prop_assert_eq!(pool.release(ip), model.remove(&ip));
            }
        }
        // No leak: the pool's counts are the model's.
        prop_assert_eq!(pool.used(), model.len() as u128);
        let held_allocatable = model.iter().filter(|ip| allocatable(&subnet, **ip)).count() as u128;
        prop_assert_eq!(pool.free(), total - held_allocatable);
    }

    // usedIP round-trips: the status ranges hold exactly the allocations
    // plus the gateway, in order, and compressing them again is stable.
    let mut expected: BTreeSet<IpAddr> = model.clone();
    expected.extend(subnet.gateway);
    let usage = pool.usage();
    prop_assert_eq!(
        &usage.used_ip,
        &used_ranges::compress(expected.iter().copied())
    );
    prop_assert_eq!(usage.used_ip_count, i64::try_from(expected.len()).unwrap());
    let expanded: Vec<IpAddr> = usage
        .used_ip
        .iter()
        .flat_map(|r| {
            let (from, to) = r.bounds().unwrap();
            (to_u128(from)..=to_u128(to)).map(move |v| from_u128(Family::of(from), v))
        })
        .collect();
    prop_assert_eq!(expanded, expected.into_iter().collect::<Vec<_>>());
    for pair in usage.used_ip.windows(2) {
        let end = to_u128(pair[0].bounds().unwrap().1);
        prop_assert!(
            end + 1 < to_u128(pair[1].bounds().unwrap().0),
            "ranges not merged: {pair:?}"
        );
    }
    Ok(())
}

const SMALL_V4: Shape = Shape {
    cidr: "10.0.0.0/28",
    gateway: Some("10.0.0.1"),
    ranges: &[("10.0.0.0", "10.0.0.5"), ("10.0.0.9", "10.0.0.15")],
};
const V4_16: Shape = Shape {
    cidr: "10.1.0.0/16",
    gateway: Some("10.1.0.1"),
    ranges: &[],
};
const V6_64: Shape = Shape {
    cidr: "fd00:1::/64",
    gateway: Some("fd00:1::1"),
    ranges: &[],
};
const V6_112: Shape = Shape {
    cidr: "fd00:2::/112",
    gateway: None,
    ranges: &[],
};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn small_v4_pool_with_ranges(ops in ops(16)) {
        run(&SMALL_V4, ops)?;
    }

    #[test]
    fn v4_slash_16(ops in ops(1 << 16)) {
        run(&V4_16, ops)?;
    }

    #[test]
    fn v6_slash_64(ops in ops(1 << 64)) {
        run(&V6_64, ops)?;
    }

    #[test]
    fn v6_slash_112(ops in ops(1 << 16)) {
        run(&V6_112, ops)?;
    }

    /// Compressing any address set and expanding it again gives the sorted set.
    #[test]
    fn used_ip_compression_round_trips(
        v4 in proptest::collection::vec(0u32..2048, 0..200),
        v6 in proptest::collection::vec(0u128..2048, 0..200),
    ) {
        let base6 = to_u128("fd00::".parse().unwrap());
        let addrs: Vec<IpAddr> = v4
            .iter()
            .map(|v| from_u128(Family::V4, u128::from(0x0a00_0000 + v)))
            .chain(v6.iter().map(|v| from_u128(Family::V6, base6 + v)))
            .collect();
        let ranges = used_ranges::compress(addrs.iter().copied());
        let (set4, set6) = used_ranges::to_intervals(&ranges);
        let expanded: Vec<IpAddr> = set4
            .iter()
            .flatten()
            .map(|v| from_u128(Family::V4, v))
            .chain(set6.iter().flatten().map(|v| from_u128(Family::V6, v)))
            .collect();
        let sorted: Vec<IpAddr> = addrs.iter().copied().collect::<BTreeSet<_>>().into_iter().collect();
        prop_assert_eq!(&expanded, &sorted);
        prop_assert_eq!(ranges.len(), set4.iter().count() + set6.iter().count());
        for ip in &sorted {
            prop_assert!(used_ranges::contains(&ranges, *ip));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Any ledger, written through `usedIP` and `usedIPCompact` (small or
    /// large, either family, anywhere in the address space), reads back as
    /// the same ranges; `usedIP` stays within its limit and covers every
    /// used address.
    #[test]
    fn large_ledgers_round_trip_through_the_compact_encoding(
        v6 in any::<bool>(),
        high in any::<bool>(),
        gaps in proptest::collection::vec((0u128..40, 0u128..6), 0..6000),
    ) {
        let family = if v6 { Family::V6 } else { Family::V4 };
        let top = match family {
            Family::V4 => u128::from(u32::MAX),
            Family::V6 => u128::MAX,
        };
        let span: u128 = gaps.iter().map(|(g, l)| g + l + 2).sum();
        let mut cursor = if high { top - span } else { 0 };
        let mut status = FlatNetworkSubnetStatus::default();
        let mut ranges = Vec::new();
        for (gap, length) in &gaps {
            let start = cursor + gap;
            ranges.push(IpRange::new(from_u128(family, start), from_u128(family, start + length)));
            cursor = start + length + 2;
        }
        // Sorted and merged, as a pool gives them.
        let (v4set, v6set) = used_ranges::to_intervals(&ranges);
        let set = if v6 { v6set } else { v4set };
        let exact = used_ranges::from_intervals(family, &set);
        status.set_used_ranges(exact.clone());
        prop_assert!(status.used_ip.len() <= compact_ranges::MAX_EXACT_RANGES);
        prop_assert_eq!(status.used_ip_compact.is_some(), exact.len() > compact_ranges::MAX_EXACT_RANGES);
        for range in &exact {
            prop_assert!(used_ranges::contains(&status.used_ip, range.from.unwrap()));
            prop_assert!(used_ranges::contains(&status.used_ip, range.to.unwrap()));
        }
        // Through JSON, as the API server stores it.
        let stored: FlatNetworkSubnetStatus =
            serde_json::from_value(serde_json::to_value(&status).unwrap()).unwrap();
        prop_assert_eq!(stored.used_ranges(), exact);
    }
}

/// The worst case of the range encoding, a 65,536-address subnet with
/// every other address used, fits in etcd's object limit with room to
/// spare, for both families.
#[test]
fn a_fully_fragmented_subnet_of_65536_addresses_fits_in_etcd() {
    const ETCD_LIMIT: usize = 1536 * 1024;
    for cidr in ["10.16.0.0", "fd00:1234:5678:9abc:def0:1234:5678:0"] {
        let ip: IpAddr = cidr.parse().unwrap();
        let family = Family::of(ip);
        let base = to_u128(ip);
        let ranges: Vec<IpRange> = (0..32_768u128)
            .map(|i| from_u128(family, base + 2 * i))
            .map(|a| IpRange::new(a, a))
            .collect();
        let mut status = FlatNetworkSubnetStatus::default();
        status.set_used_ranges(ranges.clone());
        let bytes = serde_json::to_vec(&status).unwrap().len();
        assert!(
            bytes < ETCD_LIMIT / 3,
            "{cidr}: {bytes} bytes of status for 32,768 ranges"
        );
        assert_eq!(status.used_ranges(), ranges);
        // What usedIP alone would cost: the IPv6 case does not fit.
        let exact = serde_json::to_vec(&ranges).unwrap().len();
        if family == Family::V6 {
            assert!(exact > ETCD_LIMIT, "{exact} bytes");
        }
    }
}
