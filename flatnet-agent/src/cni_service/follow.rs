//! The loop both runtime passes (subnet MTUs, hot-plugged interfaces)
//! run in: read what is wanted at a fixed interval, run a pass when it
//! differs from what the last fully successful pass applied, retry after
//! failures, and log failures when they change rather than at every retry.

use std::time::Duration;

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
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(wanted) = read().await else { continue };
        if applied.as_ref() == Some(&wanted) {
            continue;
        }
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
        }
    }
}
