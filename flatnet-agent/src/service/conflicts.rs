//! Rate limiting of conflict reports: a host that keeps claiming an address
//! answers every ARP request, and each answer is a conflict event.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::Mutex,
    time::{Duration, Instant},
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

#[cfg(test)]
mod tests {
    use super::*;

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
