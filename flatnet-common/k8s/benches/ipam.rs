//! IPAM allocation throughput: the interval pool against a linear first-fit
//! baseline (scan from the start of the range, used addresses in a HashSet)
//! in the same run. Results go to docs/benchmarks.md.

use std::{collections::HashSet, hint::black_box, net::IpAddr};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use flatnet_k8s::{
    api::FlatNetworkSubnetSpec,
    ipam::{Pool, from_u128, to_u128},
    validation::{ValidSubnet, validate_subnet},
};

fn subnet(cidr: &str) -> ValidSubnet {
    let spec = FlatNetworkSubnetSpec {
        flat_mode: "macvlan".into(),
        master: "eth0".into(),
        cidr: cidr.into(),
        ..Default::default()
    };
    validate_subnet("bench", &spec).expect("valid bench subnet")
}

/// The baseline: first fit by scanning the CIDR from its start.
struct LinearPool {
    subnet: ValidSubnet,
    excluded: HashSet<u128>,
    used: HashSet<u128>,
}

impl LinearPool {
    fn new(subnet: &ValidSubnet) -> Self {
        let mut excluded = HashSet::from([subnet.cidr.first()]);
        if subnet.cidr.family() == flatnet_k8s::ipam::Family::V4 {
            excluded.insert(subnet.cidr.last());
        }
        Self {
            subnet: subnet.clone(),
            excluded,
            used: HashSet::new(),
        }
    }

    fn allocate(&mut self) -> Option<IpAddr> {
        let value = (self.subnet.cidr.first()..=self.subnet.cidr.last())
            .find(|v| !self.used.contains(v) && !self.excluded.contains(v))?;
        self.used.insert(value);
        Some(from_u128(self.subnet.cidr.family(), value))
    }

    fn release(&mut self, ip: IpAddr) {
        self.used.remove(&to_u128(ip));
    }
}

/// Allocations per second while filling a pool from empty.
fn fill(c: &mut Criterion) {
    let mut group = c.benchmark_group("fill");
    group.sample_size(10);
    let cases = [
        ("v4_16_full", "10.0.0.0/16", 65_534u64),
        ("v6_112_full", "fd00::/112", 65_535),
        ("v6_64_first_65536", "fd00::/64", 65_536),
        ("v4_16_first_8192", "10.0.0.0/16", 8_192),
    ];
    for (name, cidr, count) in cases {
        let subnet = subnet(cidr);
        group.throughput(Throughput::Elements(count));
        group.bench_function(BenchmarkId::new("interval", name), |b| {
            b.iter_batched(
                || Pool::new(&subnet),
                |mut pool| {
                    for _ in 0..count {
                        black_box(pool.allocate_auto().expect("free address"));
                    }
                    pool
                },
                BatchSize::LargeInput,
            );
        });
    }
    // The baseline is quadratic in the fill level, so it fills 8192 only;
    // the fill-level benchmark below covers a full /16.
    let subnet = subnet("10.0.0.0/16");
    group.throughput(Throughput::Elements(8_192));
    group.bench_function(BenchmarkId::new("linear", "v4_16_first_8192"), |b| {
        b.iter_batched(
            || LinearPool::new(&subnet),
            |mut pool| {
                for _ in 0..8_192 {
                    black_box(pool.allocate().expect("free address"));
                }
                pool
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();
}

/// Cost of one allocation (plus its release) when the lowest `taken`
/// addresses are already in use.
fn allocate_at_fill_level(c: &mut Criterion) {
    let mut group = c.benchmark_group("allocate_at_fill_level");
    group.throughput(Throughput::Elements(1));
    for (family, cidr) in [("v4_16", "10.0.0.0/16"), ("v6_112", "fd00::/112")] {
        let subnet = subnet(cidr);
        for taken in [0u32, 16_384, 65_000] {
            let mut pool = Pool::new(&subnet);
            for _ in 0..taken {
                pool.allocate_auto().expect("free address");
            }
            // Same state for the baseline, without its quadratic fill.
            let mut linear = LinearPool::new(&subnet);
            linear.used.extend(pool.used_addresses().map(to_u128));
            let id = format!("{family}_taken_{taken}");
            group.bench_function(BenchmarkId::new("interval", &id), |b| {
                b.iter(|| {
                    let ip = pool.allocate_auto().expect("free address");
                    pool.release(black_box(ip));
                });
            });
            group.bench_function(BenchmarkId::new("linear", &id), |b| {
                b.iter(|| {
                    let ip = linear.allocate().expect("free address");
                    linear.release(black_box(ip));
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, fill, allocate_at_fill_level);
criterion_main!(benches);
