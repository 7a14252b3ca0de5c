//! Shared by the end-to-end suites: whether a cluster is configured, and
//! waiting for controllers to converge.
#![allow(dead_code)] // each suite uses its own subset

use std::{future::Future, time::Duration};

/// Whether the suites may run: `FLATNET_E2E=1` and `KUBECONFIG` set;
/// otherwise the calling test's skip is reported (libtest names each test's
/// thread after the test).
pub fn cluster_configured() -> bool {
    let configured = std::env::var("FLATNET_E2E").is_ok_and(|v| v == "1")
        && std::env::var_os("KUBECONFIG").is_some();
    if !configured {
        report_skip(
            std::thread::current().name().unwrap_or("a test"),
            "no cluster (set FLATNET_E2E=1 and KUBECONFIG; `cargo xtask e2e` runs it)",
        );
    }
    configured
}

/// Writes `skipped: <test>: <why>` to the stderr handle itself, past
/// libtest's capture, where `cargo xtask test` counts it as a skip.
pub fn report_skip(test: &str, why: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "skipped: {test}: {why}");
}

/// How long a suite waits for convergence, and how often it looks.
pub struct Converge {
    /// Give up (and fail) after this long.
    pub within: Duration,
    /// Pause between two checks.
    pub poll: Duration,
}

impl Converge {
    /// Whether `check` holds within `within` (polled): for a step whose
    /// failure must first be undone, before the test fails.
    pub async fn holds<F, Fut>(&self, mut check: F) -> bool
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + self.within;
        loop {
            if check().await {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(self.poll).await;
        }
    }

    /// Polls `check` until it returns `Some`, panicking with `what` after `within`.
    pub async fn eventually<T, F, Fut>(&self, what: &str, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        let deadline = tokio::time::Instant::now() + self.within;
        loop {
            if let Some(value) = check().await {
                return value;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(self.poll).await;
        }
    }
}
