//! Conflict reports: rate limiting (a host that keeps claiming an address
//! answers every ARP request, and each answer is a conflict event) and
//! finding the attachment that owns the claimed address.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{
    desired::AttachmentKey,
    records::{AttachmentRecord, Records},
};

/// How often one address's conflict is reported at most.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(60);

/// Lets one report per address through per interval.
pub struct RateLimiter {
    interval: Duration,
    last: Mutex<HashMap<IpAddr, Instant>>,
}

impl RateLimiter {
    /// A limiter allowing one report per address per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a report for `addr` may go out now (and records it).
    pub fn allow(&self, addr: IpAddr) -> bool {
        self.allow_at(addr, Instant::now())
    }

    fn allow_at(&self, addr: IpAddr, now: Instant) -> bool {
        let mut last = self.last.lock().expect("limiter lock poisoned");
        last.retain(|_, at| now.saturating_duration_since(*at) < self.interval);
        if last.contains_key(&addr) {
            return false;
        }
        last.insert(addr, now);
        true
    }
}

/// Which attachment owns an address on an uplink. Remembers the answers so
/// a conflict reads one record instead of every record on the node (a
/// burst of conflicts on a full node would otherwise queue up behind
/// thousands of file reads); a remembered answer is checked against its
/// record before use, and a miss or a stale answer reloads the index.
#[derive(Default)]
pub struct Owners {
    index: Mutex<HashMap<(u32, IpAddr), AttachmentKey>>,
}

impl Owners {
    /// The record owning `addr` on uplink `ifindex`, if any.
    pub fn find(&self, records: &Records, ifindex: u32, addr: IpAddr) -> Option<AttachmentRecord> {
        let cached = self
            .index
            .lock()
            .expect("owner index lock poisoned")
            .get(&(ifindex, addr))
            .cloned();
        if let Some(key) = cached
            && let Ok(Some(record)) = records.load(&key)
            && owns(&record, ifindex, addr)
        {
            return Some(record);
        }
        let all = records.all().ok()?;
        let mut index = HashMap::new();
        for record in &all {
            if let Some(uplink) = &record.uplink {
                for ip in record.ips() {
                    index.insert((uplink.ifindex, ip), record.key.clone());
                }
            }
        }
        *self.index.lock().expect("owner index lock poisoned") = index;
        all.into_iter().find(|r| owns(r, ifindex, addr))
    }
}

fn owns(record: &AttachmentRecord, ifindex: u32, addr: IpAddr) -> bool {
    record.uplink.as_ref().is_some_and(|u| u.ifindex == ifindex) && record.ips().contains(&addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        desired::PodRef,
        records::{RecordPhase, UplinkRecord},
    };

    fn record(container: &str, pod: &str, addr: &str, ifindex: u32) -> AttachmentRecord {
        AttachmentRecord {
            key: AttachmentKey {
                container_id: container.into(),
                ifname: "eth1".into(),
            },
            network: "net".into(),
            netns: "/run/netns/x".into(),
            pod: PodRef {
                namespace: Some("default".into()),
                name: Some(pod.into()),
                uid: None,
            },
            phase: RecordPhase::Ready,
            subnets: Vec::new(),
            addresses: vec![format!("{addr}/24").parse().unwrap()],
            requested_mac: None,
            mac: None,
            mtu: None,
            uplink: Some(UplinkRecord {
                ifname: "eth0".into(),
                ifindex,
                owner_mac: "02:00:00:00:00:01".into(),
                responder: false,
            }),
            host_route: None,
            primary_defaults: None,
            parent: None,
            unreported_mtu: None,
        }
    }

    fn pod_name(record: Option<AttachmentRecord>) -> Option<String> {
        record.and_then(|r| r.pod.name)
    }

    #[test]
    fn owners_follow_records_that_change_hands() {
        let dir = tempfile::tempdir().unwrap();
        let records = Records::open(dir.path()).unwrap();
        let owners = Owners::default();
        let addr: IpAddr = "192.0.2.5".parse().unwrap();
        records
            .save(&record("c1", "web-0", "192.0.2.5", 3))
            .unwrap();
        assert_eq!(
            pod_name(owners.find(&records, 3, addr)),
            Some("web-0".into())
        );
        assert_eq!(owners.find(&records, 4, addr), None, "other uplink");
        assert_eq!(owners.find(&records, 3, "192.0.2.6".parse().unwrap()), None);

        // The address moves to another pod: the remembered owner is stale.
        records
            .remove(&record("c1", "", "192.0.2.5", 3).key)
            .unwrap();
        records
            .save(&record("c2", "web-1", "192.0.2.5", 3))
            .unwrap();
        assert_eq!(
            pod_name(owners.find(&records, 3, addr)),
            Some("web-1".into())
        );

        // And away from every pod.
        records
            .remove(&record("c2", "", "192.0.2.5", 3).key)
            .unwrap();
        assert_eq!(owners.find(&records, 3, addr), None);
    }

    #[test]
    fn one_report_per_address_per_interval() {
        let limiter = RateLimiter::new(Duration::from_secs(60));
        let a: IpAddr = "192.0.2.5".parse().unwrap();
        let b: IpAddr = "2001:db8::5".parse().unwrap();
        let t0 = Instant::now();
        assert!(limiter.allow_at(a, t0));
        assert!(!limiter.allow_at(a, t0 + Duration::from_secs(59)));
        assert!(limiter.allow_at(b, t0 + Duration::from_secs(1)));
        assert!(limiter.allow_at(a, t0 + Duration::from_secs(60)));
    }
}
