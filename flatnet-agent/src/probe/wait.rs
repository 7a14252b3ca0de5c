//! How long an ADD waits for an answer to its probe: sized from the reply
//! times seen on the same uplink, not a fixed time. Every probe also asks
//! for the subnet's gateway, which answers; how long that answer took is a
//! sample of the LAN's reply time.

use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
    time::Duration,
};

/// Samples kept per uplink: the latest ones, so a LAN that slows down is
/// followed within this many probes.
pub const SAMPLES: usize = 16;

/// The wait is this many times the 90th percentile of the recent replies.
pub const REPLY_MULTIPLE: u32 = 4;

/// The shortest wait, however fast the LAN answered: an answer's own time
/// varies with the load of the host answering.
pub const MIN_WAIT: Duration = Duration::from_millis(1);

/// The reply times seen on each uplink (by interface name).
#[derive(Debug, Default)]
pub struct ReplyTimes {
    by_uplink: Mutex<HashMap<String, VecDeque<Duration>>>,
}

impl ReplyTimes {
    /// Records that an answer on `uplink` came `took` after its request.
    pub fn record(&self, uplink: &str, took: Duration) {
        let mut by_uplink = self.by_uplink.lock().expect("reply times lock poisoned");
        let samples = by_uplink.entry(uplink.to_owned()).or_default();
        if samples.len() == SAMPLES {
            samples.pop_front();
        }
        samples.push_back(took);
    }

    /// The wait for an answer on `uplink`: [`REPLY_MULTIPLE`] times the
    /// 90th percentile of the recent replies (of 16, the second slowest:
    /// one hiccup of the LAN does not stretch the next 16 ADDs), at least
    /// [`MIN_WAIT`], at most `configured`; `None` while no reply was seen
    /// there.
    #[must_use]
    pub fn wait(&self, uplink: &str, configured: Duration) -> Option<Duration> {
        let by_uplink = self.by_uplink.lock().expect("reply times lock poisoned");
        let mut samples: Vec<Duration> = by_uplink.get(uplink)?.iter().copied().collect();
        samples.sort_unstable();
        let slow = *samples.get((samples.len() * 9 / 10).min(samples.len().checked_sub(1)?))?;
        Some((slow * REPLY_MULTIPLE).max(MIN_WAIT).min(configured))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const CONFIGURED: Duration = Duration::from_millis(500);

    #[test]
    fn nothing_without_a_reply_on_the_uplink() {
        let times = ReplyTimes::default();
        assert_eq!(times.wait("eth0", CONFIGURED), None);
        times.record("eth1", Duration::from_micros(300));
        assert_eq!(times.wait("eth0", CONFIGURED), None, "another uplink's");
    }

    #[test]
    fn with_few_replies_a_multiple_of_the_slowest_within_the_bounds() {
        let times = ReplyTimes::default();
        times.record("eth0", Duration::from_micros(300));
        times.record("eth0", Duration::from_micros(700));
        times.record("eth0", Duration::from_micros(100));
        assert_eq!(
            times.wait("eth0", CONFIGURED),
            Some(Duration::from_micros(2800))
        );
        times.record("eth0", Duration::from_millis(400));
        assert_eq!(
            times.wait("eth0", CONFIGURED),
            Some(CONFIGURED),
            "never above"
        );
        let fast = ReplyTimes::default();
        fast.record("eth0", Duration::from_micros(20));
        assert_eq!(fast.wait("eth0", CONFIGURED), Some(MIN_WAIT), "never below");
    }

    #[test]
    fn one_hiccup_does_not_stretch_the_wait_and_two_do_until_forgotten() {
        let times = ReplyTimes::default();
        for _ in 0..SAMPLES - 1 {
            times.record("eth0", Duration::from_micros(500));
        }
        times.record("eth0", Duration::from_millis(50));
        assert_eq!(
            times.wait("eth0", CONFIGURED),
            Some(Duration::from_millis(2)),
            "one slow reply in 16"
        );
        times.record("eth0", Duration::from_millis(40));
        assert_eq!(
            times.wait("eth0", CONFIGURED),
            Some(Duration::from_millis(160)),
            "two: the second slowest"
        );
        for _ in 0..SAMPLES - 1 {
            times.record("eth0", Duration::from_micros(500));
        }
        assert_eq!(
            times.wait("eth0", CONFIGURED),
            Some(Duration::from_millis(2)),
            "pushed out by the replies that followed"
        );
    }

    proptest! {
        #[test]
        fn the_wait_stays_within_its_bounds(
            samples in proptest::collection::vec(0u64..2_000_000, 0..40),
            configured_us in 1_000u64..5_000_000,
        ) {
            let times = ReplyTimes::default();
            for us in &samples {
                times.record("eth0", Duration::from_micros(*us));
            }
            let configured = Duration::from_micros(configured_us);
            let Some(wait) = times.wait("eth0", configured) else {
                prop_assert!(samples.is_empty());
                return Ok(());
            };
            prop_assert!(wait <= configured);
            prop_assert!(wait >= MIN_WAIT.min(configured));
            let mut recent: Vec<u64> = samples.iter().rev().take(SAMPLES).copied().collect();
            recent.sort_unstable();
            // All recent replies but the slowest one are covered.
            if recent.len() >= 2 {
                let second = Duration::from_micros(recent[recent.len() - 2]) * REPLY_MULTIPLE;
                prop_assert!(wait >= second.min(configured), "covers all but the slowest reply");
            }
            let slowest = Duration::from_micros(*recent.last().unwrap()) * REPLY_MULTIPLE;
            prop_assert!(wait <= slowest.max(MIN_WAIT).min(configured), "never beyond the slowest");
        }
    }
}
