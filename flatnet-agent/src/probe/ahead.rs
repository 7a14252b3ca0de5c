//! Probes ahead of ADD.
//!
//! In Kubernetes mode the operator allocates a pod's address as soon as
//! the pod exists; its ADD comes only once kubelet has made the pod's
//! sandbox, a good while after the pod was bound to the node. The agent
//! probes the address as soon as it sees both (the allocation and the pod
//! on its node), so the ADD finds the verdict made. An ADD takes such a
//! verdict only while it is fresh ([`FRESH_FOR`]), and only when the wire
//! inventory saw no other MAC claim the address since the probe was sent;
//! it then sends the probes once more without waiting, so that a host
//! that answers only now is reported as a conflict of the pod.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    sync::Mutex,
    time::{Duration, Instant},
};

use super::run::Probing;

/// How long a probe made ahead of an ADD stands for it; older ones are
/// probed again, and an ADD that finds none fresh probes itself.
pub const FRESH_FOR: Duration = Duration::from_secs(30);

/// A probe of one address made ahead of its ADD.
#[derive(Clone)]
pub struct AheadProbe {
    /// The probe (of this address and maybe others probed with it).
    pub probing: Probing,
    /// When its frames went out, kernel `CLOCK_MONOTONIC` in nanoseconds
    /// (the wire inventory's clock).
    pub sent_ns: u64,
    sent: Instant,
}

impl AheadProbe {
    /// `probing`, whose frames went out at `sent_ns` (monotonic).
    #[must_use]
    pub fn new(probing: Probing, sent_ns: u64) -> Self {
        Self {
            probing,
            sent_ns,
            sent: Instant::now(),
        }
    }

    fn is_fresh(&self) -> bool {
        self.sent.elapsed() < FRESH_FOR
    }
}

/// The probes made ahead of ADDs, by uplink and address.
#[derive(Default)]
pub struct AheadProbes {
    probes: Mutex<HashMap<(String, IpAddr), AheadProbe>>,
}

impl AheadProbes {
    /// The fresh probes of every one of `addrs` on `uplink`; `None` unless
    /// each has one.
    pub fn fresh(&self, uplink: &str, addrs: &[IpAddr]) -> Option<Vec<AheadProbe>> {
        let probes = self.lock();
        addrs
            .iter()
            .map(|addr| {
                probes
                    .get(&(uplink.to_owned(), *addr))
                    .filter(|probe| probe.is_fresh())
                    .cloned()
            })
            .collect()
    }

    /// Forgets the probes of addresses not in `wanted` (their ADD came, or
    /// their pod went), and answers which of `wanted` need a probe: those
    /// without one, or with one no longer fresh.
    pub fn keep_only(&self, wanted: &[(String, IpAddr)]) -> Vec<(String, IpAddr)> {
        let keep: HashSet<&(String, IpAddr)> = wanted.iter().collect();
        let mut probes = self.lock();
        probes.retain(|key, _| keep.contains(key));
        wanted
            .iter()
            .filter(|key| !probes.get(*key).is_some_and(AheadProbe::is_fresh))
            .cloned()
            .collect()
    }

    /// Records `probe` as the probe of `addrs` on `uplink`.
    pub fn insert(&self, uplink: &str, addrs: &[IpAddr], probe: &AheadProbe) {
        let mut probes = self.lock();
        for addr in addrs {
            probes.insert((uplink.to_owned(), *addr), probe.clone());
        }
    }

    /// Forgets every probe (probing turned off).
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, IpAddr), AheadProbe>> {
        self.probes.lock().expect("ahead probes lock poisoned")
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::probe::{
        run::{ProbeContext, ProbeMetrics, ProbePlan},
        wait::ReplyTimes,
    };

    /// A probe of an uplink that does not exist (its verdict does not
    /// matter here).
    fn probe(addrs: &[IpAddr]) -> AheadProbe {
        let plan = ProbePlan {
            uplink: "flatnet-none0".into(),
            addrs: addrs.to_vec(),
            reference: None,
            window: Duration::from_millis(1),
        };
        let context = ProbeContext {
            host: None,
            reply_times: Arc::new(ReplyTimes::default()),
            seen_on_wire: Box::new(|_, _| false),
            metrics: ProbeMetrics::default(),
        };
        AheadProbe::new(Probing::start(plan, context), 7)
    }

    #[tokio::test]
    async fn an_add_finds_probes_only_for_every_address_and_gone_ones_are_forgotten() {
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "192.0.2.10".parse().unwrap(),
            "2001:db8::10".parse().unwrap(),
            "192.0.2.11".parse().unwrap(),
        );
        let key = |addr| ("eth1".to_owned(), addr);
        let probes = AheadProbes::default();
        assert_eq!(
            probes.keep_only(&[key(a), key(b)]),
            [key(a), key(b)],
            "nothing probed yet"
        );
        probes.insert("eth1", &[a, b], &probe(&[a, b]));
        assert!(probes.keep_only(&[key(a), key(b)]).is_empty(), "both fresh");
        let found = probes.fresh("eth1", &[a, b]).expect("both probed");
        assert_eq!(found.len(), 2);
        assert!(found.iter().all(|p| p.sent_ns == 7));
        assert!(probes.fresh("eth1", &[a, c]).is_none(), "c was not probed");
        assert!(probes.fresh("eth2", &[a]).is_none(), "another uplink");
        // a's ADD came: only b is kept, and c is to be probed.
        assert_eq!(probes.keep_only(&[key(b), key(c)]), [key(c)]);
        assert!(probes.fresh("eth1", &[a]).is_none());
        assert!(probes.fresh("eth1", &[b]).is_some());
        probes.clear();
        assert!(probes.fresh("eth1", &[b]).is_none());
    }
}
