//! Test-only crash points: the agent dies on the spot (as by `kill -9`) at
//! a named step when `FLATNET_TEST_CRASH_AT` names it, so tests can prove
//! that a restarted agent cleans up after an interrupted operation.
//!
//! Only debug builds (the ones tests use) look at the variable; in release
//! builds [`crash_point`] does nothing.

/// The variable naming the step to die at.
pub const CRASH_AT_ENV: &str = "FLATNET_TEST_CRASH_AT";

/// Aborts the process when [`CRASH_AT_ENV`] equals `step` (debug builds).
#[inline]
pub fn crash_point(step: &str) {
    #[cfg(debug_assertions)]
    if std::env::var_os(CRASH_AT_ENV).is_some_and(|v| v == step) {
        tracing::error!(step, "test crash point reached; aborting");
        // No unwinding, no destructors: like being killed.
        std::process::abort();
    }
    #[cfg(not(debug_assertions))]
    let _ = step;
}
