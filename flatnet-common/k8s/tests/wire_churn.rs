//! Reuse order under churn: how many allocations pass before a released
//! address is handed out again in a /24, with and without the wire's
//! view (a pod talks on the LAN until it goes, so its address stays live
//! for the window after), and with the quarantine of released addresses
//! alone (pods no uplink ever heard). Run with `--nocapture` to see the
//! figures that docs/ipam.md quotes.

use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use flatnet_k8s::{
    api::FlatNetworkSubnetSpec,
    ipam::{LiveAddresses, LiveClaim, Pool},
    validation::validate_subnet,
};
use k8s_openapi::jiff::Timestamp;

/// Pods alive at any time, of 253 allocatable addresses.
const PODS: usize = 150;
/// Churn steps: one pod deleted and one created per step, every 10 s.
const STEPS: u64 = 3_000;
const STEP: Duration = Duration::from_secs(10);

struct Figures {
    /// Allocations between each release and the reuse of its address.
    gaps: Vec<u64>,
}

impl Figures {
    /// The gap at `percent` (nearest rank).
    fn at(&self, percent: usize) -> u64 {
        let mut gaps = self.gaps.clone();
        gaps.sort_unstable();
        gaps[(gaps.len() - 1) * percent / 100]
    }
}

/// What the allocator knows of the released addresses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Nothing: lowest free first.
    Nothing,
    /// Each pod's last claim on the wire (it talked until it went).
    Wire,
    /// Only when each address was released (its pod was never heard).
    Releases,
}

fn churn(known: Known) -> Figures {
    let spec = FlatNetworkSubnetSpec {
        flat_mode: "macvlan".into(),
        master: "eth0".into(),
        cidr: "10.9.0.0/24".into(),
        gateway: Some("10.9.0.1".parse().unwrap()),
        ..FlatNetworkSubnetSpec::default()
    };
    let mut pool = Pool::new(&validate_subnet("churn", &spec).unwrap());
    let start = Timestamp::from_second(1_800_000_000).unwrap();
    let mut pods: Vec<IpAddr> = (0..PODS).map(|_| pool.allocate_auto().unwrap()).collect();
    // Address -> (step of its release, time its pod last talked).
    let mut released: BTreeMap<IpAddr, (u64, Timestamp)> = BTreeMap::new();
    let mut gaps = Vec::new();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for step in 1..=STEPS {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let now = start + STEP * u32::try_from(step).unwrap();
        let gone = pods.swap_remove(usize::try_from(seed % PODS as u64).unwrap());
        pool.release(gone);
        released.insert(gone, (step, now));
        let window = Duration::from_secs(3600);
        let live = if known == Known::Wire {
            let sightings = released.iter().map(|(&ip, &(_, seen))| {
                (
                    ip,
                    LiveClaim {
                        mac: String::new(),
                        last_seen: seen,
                        node: String::new(),
                    },
                )
            });
            LiveAddresses::from_sightings(sightings, now, window)
        } else if known == Known::Releases {
            let releases = released.iter().map(|(&ip, &(_, at))| (ip, at));
            LiveAddresses::default().with_released(releases, now, window)
        } else {
            LiveAddresses::default()
        };
        let ip = live.allocate(&mut pool, &[]).unwrap();
        if let Some((at, _)) = released.remove(&ip) {
            gaps.push(step - at);
        }
        pods.push(ip);
    }
    Figures { gaps }
}

#[test]
fn released_addresses_come_back_last_when_the_wire_is_consulted() {
    let plain = churn(Known::Nothing);
    let wire = churn(Known::Wire);
    let quarantine = churn(Known::Releases);
    for (name, f) in [
        ("lowest free", &plain),
        ("wire-aware", &wire),
        ("quarantine alone", &quarantine),
    ] {
        println!(
            "{name}: {} reuses; allocations before reuse: min {}, 10th percentile {}, median {}",
            f.gaps.len(),
            f.at(0),
            f.at(10),
            f.at(50)
        );
    }
    // 253 - 150 = 103 addresses free at every step: reused last means every
    // other free address went first.
    assert!(wire.at(0) >= 100, "wire-aware min {}", wire.at(0));
    assert!(
        quarantine.at(0) >= 100,
        "quarantine min {}",
        quarantine.at(0)
    );
    assert!(plain.at(50) < wire.at(50));
}
