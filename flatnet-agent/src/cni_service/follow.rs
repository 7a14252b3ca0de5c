//! The loop both runtime passes (subnet MTUs, hot-plugged interfaces)
//! run in: read what is wanted at a fixed interval, run a pass when it
//! differs from what the last fully successful pass applied, retry after
//! failures with a growing delay (up to 10 s; at once when what is wanted
//! changes), and log failures when they change rather than at every retry.

use std::time::Duration;

/// The longest wait before a failed pass is retried unchanged.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(10);

/// What a pass reports back to [`follow`].
pub(super) trait PassReport {
    /// What failed, with why; empty when all went well.
    fn failures(&self) -> &[String];
    /// Logs what the pass changed, if anything.
    fn log_changes(&self);
}

/// Runs `apply` whenever `read` gives something (`None`: not known yet)
/// other than what was applied in full last; `what` names it in logs.
pub(super) async fn follow<T, P, R, A>(
    interval: Duration,
    what: &'static str,
    mut read: impl FnMut() -> R,
    mut apply: impl FnMut(T) -> A,
) where
    T: PartialEq + Clone,
    P: PassReport,
    R: Future<Output = Option<T>>,
    A: Future<Output = P>,
{
    let mut applied: Option<T> = None;
    let mut reported: Vec<String> = Vec::new();
    // After a failed pass the same wanted state is retried with a growing
    // delay; a change of it is tried at once.
    let mut failed: Option<(T, tokio::time::Instant, Duration)> = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(wanted) = read().await else { continue };
        if applied.as_ref() == Some(&wanted) {
            continue;
        }
        let backoff = match &failed {
            Some((last, retry_at, backoff)) if *last == wanted => {
                if tokio::time::Instant::now() < *retry_at {
                    continue;
                }
                (*backoff * 2).min(MAX_RETRY_DELAY)
            }
            _ => interval,
        };
        let pass = apply(wanted.clone()).await;
        pass.log_changes();
        if pass.failures() != reported.as_slice() {
            for failure in pass.failures() {
                tracing::warn!(%failure, "{what} failed; retrying");
            }
            reported = pass.failures().to_vec();
        }
        if pass.failures().is_empty() {
            applied = Some(wanted);
            failed = None;
        } else {
            // A failed pass may have applied part of it: what was applied
            // in full before is no longer what is in place.
            applied = None;
            failed = Some((wanted, tokio::time::Instant::now() + backoff, backoff));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicU32, AtomicUsize, Ordering},
    };

    use super::*;

    struct Report(Vec<String>);

    /// The pass of the tests' states: 1 always fails, 2 succeeds.
    fn outcome_of(value: u32) -> Report {
        Report(if value == 1 {
            vec!["no".into()]
        } else {
            Vec::new()
        })
    }

    impl PassReport for Report {
        fn failures(&self) -> &[String] {
            &self.0
        }

        fn log_changes(&self) {}
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_and_a_change_is_tried_at_once() {
        let wanted = Arc::new(AtomicU32::new(1));
        let attempts = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let (wanted, attempts) = (Arc::clone(&wanted), Arc::clone(&attempts));
            async move {
                follow(
                    Duration::from_millis(50),
                    "test",
                    || {
                        let wanted = wanted.load(Ordering::SeqCst);
                        async move { Some(wanted) }
                    },
                    |value| {
                        attempts.fetch_add(1, Ordering::SeqCst);
                        async move { outcome_of(value) }
                    },
                )
                .await;
            }
        });
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        let failed = attempts.load(Ordering::SeqCst);
        // 0, 50, 150, 350, 750, 1550 ms: not one per 50 ms tick (41).
        assert!((5..=7).contains(&failed), "{failed} attempts in 2 s");
        wanted.store(2, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(attempts.load(Ordering::SeqCst), failed + 1, "tried at once");
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        assert_eq!(
            attempts.load(Ordering::SeqCst),
            failed + 1,
            "applied, not repeated"
        );
        task.abort();
    }

    /// After a failed pass, going back to what was applied in full before
    /// is applied again: the failed pass may have changed part of it.
    #[tokio::test(start_paused = true)]
    async fn returning_to_the_last_applied_state_after_a_failure_applies_it_again() {
        let wanted = Arc::new(AtomicU32::new(2));
        let applied = Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let (wanted, applied) = (Arc::clone(&wanted), Arc::clone(&applied));
            async move {
                follow(
                    Duration::from_millis(50),
                    "test",
                    || {
                        let wanted = wanted.load(Ordering::SeqCst);
                        async move { Some(wanted) }
                    },
                    |value| {
                        applied.lock().unwrap().push(value);
                        async move { outcome_of(value) }
                    },
                )
                .await;
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        wanted.store(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        wanted.store(2, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let seen = applied.lock().unwrap().clone();
        assert_eq!(seen.first(), Some(&2));
        assert_eq!(seen.last(), Some(&2), "2 applied again: {seen:?}");
        assert!(seen.contains(&1), "{seen:?}");
        task.abort();
    }
}
