//! Leader election on a coordination.k8s.io Lease.
//!
//! Every replica campaigns; only the holder runs the controllers (the
//! writers). Losing the lease cancels the controllers and the caller exits
//! non-zero, so Kubernetes restarts the process with fresh caches instead of
//! keeping a replica around that once believed it led.

use std::future::Future;

use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError, LeaseParams};
use tokio::{sync::watch, task::JoinHandle};
use tokio_util::sync::CancellationToken;

use crate::config::ElectionTiming;

/// How a term as candidate or leader ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Shutdown was requested (signal); exit cleanly.
    Shutdown,
    /// The lease was lost, or the election task died; exit non-zero.
    LeaseLost,
    /// The controllers stopped on their own while leading; exit non-zero.
    ControllersEnded,
}

/// Lease seconds for the lease manager: the lease lasts `lease_duration`, and
/// the holder renews once `renew_deadline` has passed since the last renewal,
/// i.e. `lease_duration - renew_deadline` before expiry.
#[must_use]
pub fn lease_seconds(timing: &ElectionTiming) -> (u64, u64) {
    let duration = timing.lease_duration.as_secs();
    (
        duration,
        duration.saturating_sub(timing.renew_deadline.as_secs()),
    )
}

/// Starts campaigning for `name` in `namespace` as `identity`.
///
/// The returned receiver is `true` while this process holds the lease. When
/// it is dropped, the election task releases the lease and ends.
///
/// # Errors
/// The Lease could not be read or created (RBAC, missing namespace).
pub async fn campaign(
    client: kube::Client,
    name: &str,
    namespace: &str,
    identity: &str,
    timing: &ElectionTiming,
) -> Result<
    (
        watch::Receiver<bool>,
        JoinHandle<Result<(), LeaseManagerError>>,
    ),
    LeaseManagerError,
> {
    let (duration, grace) = lease_seconds(timing);
    let manager = LeaseManagerBuilder::new(client, name)
        .with_namespace(namespace)
        .with_parameters(LeaseParams::new(identity, duration, grace))
        .build()
        .await?;
    let (claims, task) = manager.watch().await;
    let task = tokio::spawn(async move {
        match task.await {
            Ok(result) => result.map(drop),
            Err(join) => {
                tracing::error!(error = %join, "leader election task panicked");
                Ok(())
            }
        }
    });
    Ok((claims, task))
}

/// Calls `attempt` until it succeeds, waiting `period` after each failure
/// (logged); `None` when `shutdown` is cancelled first.
pub async fn retry_every<T, E, F, Fut>(
    period: std::time::Duration,
    shutdown: &CancellationToken,
    mut attempt: F,
) -> Option<T>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    loop {
        let result = tokio::select! {
            () = shutdown.cancelled() => return None,
            result = attempt() => result,
        };
        match result {
            Ok(value) => return Some(value),
            Err(error) => {
                tracing::warn!(%error, retry_in = ?period, "cannot campaign for the leader lease yet");
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return None,
            () = tokio::time::sleep(period) => {}
        }
    }
}

/// Waits for the lease, then runs `controllers` until shutdown or until the
/// lease is lost.
///
/// `controllers` gets a token that is cancelled when they must stop; they
/// should finish in-flight work and return. `on_leader` is told each change
/// of leadership (for the leader gauge).
pub async fn run_while_leader<F, Fut>(
    mut claims: watch::Receiver<bool>,
    shutdown: CancellationToken,
    on_leader: impl Fn(bool),
    controllers: F,
) -> Outcome
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        if *claims.borrow_and_update() {
            break;
        }
        tokio::select! {
            () = shutdown.cancelled() => return Outcome::Shutdown,
            changed = claims.changed() => if changed.is_err() {
                return Outcome::LeaseLost;
            },
        }
    }

    tracing::info!("acquired the leader lease, starting controllers");
    on_leader(true);
    let stop = shutdown.child_token();
    let run = controllers(stop.clone());
    tokio::pin!(run);
    let lost = loop {
        tokio::select! {
            () = &mut run => break false,
            changed = claims.changed() => {
                if changed.is_err() || !*claims.borrow_and_update() {
                    tracing::error!("lost the leader lease, stopping controllers");
                    stop.cancel();
                    break true;
                }
            }
        }
    };
    if lost {
        run.await;
    }
    on_leader(false);
    if lost {
        Outcome::LeaseLost
    } else if shutdown.is_cancelled() {
        Outcome::Shutdown
    } else {
        Outcome::ControllersEnded
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{Arc, Mutex},
        time::Duration,
    };

    use tokio::sync::oneshot;

    use super::*;

    /// Runs `run_while_leader` with controllers that report their start and
    /// then wait for their token; returns the task, the start signal and the
    /// leadership changes seen.
    fn spawn_candidate(
        claims: watch::Receiver<bool>,
        shutdown: CancellationToken,
    ) -> (
        JoinHandle<Outcome>,
        oneshot::Receiver<()>,
        Arc<Mutex<Vec<bool>>>,
    ) {
        let (started_tx, started_rx) = oneshot::channel();
        let changes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&changes);
        let task = tokio::spawn(run_while_leader(
            claims,
            shutdown,
            move |leader| seen.lock().unwrap().push(leader),
            move |stop: CancellationToken| async move {
                let _ = started_tx.send(());
                stop.cancelled().await;
            },
        ));
        (task, started_rx, changes)
    }

    #[tokio::test(start_paused = true)]
    async fn campaigning_is_retried_every_retry_period_until_it_works() {
        let shutdown = CancellationToken::new();
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let start = tokio::time::Instant::now();
        let seen = Arc::clone(&attempts);
        let value = retry_every(Duration::from_secs(3), &shutdown, move || {
            let seen = Arc::clone(&seen);
            async move {
                let mut seen = seen.lock().unwrap();
                seen.push(start.elapsed());
                if seen.len() < 3 {
                    Err("lease API not reachable")
                } else {
                    Ok(7)
                }
            }
        })
        .await;
        assert_eq!(value, Some(7));
        // Virtual time: the attempts are exactly one retry period apart.
        assert_eq!(
            *attempts.lock().unwrap(),
            [
                Duration::ZERO,
                Duration::from_secs(3),
                Duration::from_secs(6)
            ]
        );
        shutdown.cancel();
        let never = retry_every(Duration::from_secs(3), &shutdown, || async {
            Err::<(), _>("down")
        })
        .await;
        assert_eq!(never, None, "shutdown ends the retries");
    }

    #[tokio::test]
    async fn losing_the_lease_stops_the_controllers() {
        let (lease, claims) = watch::channel(false);
        let (task, started, changes) = spawn_candidate(claims, CancellationToken::new());
        lease.send(true).unwrap();
        started
            .await
            .expect("controllers start once the lease is held");
        lease.send(false).unwrap();
        assert_eq!(task.await.unwrap(), Outcome::LeaseLost);
        assert_eq!(*changes.lock().unwrap(), [true, false]);
    }

    #[tokio::test]
    async fn shutdown_while_leading_is_clean() {
        let (lease, claims) = watch::channel(true);
        let shutdown = CancellationToken::new();
        let (task, started, _) = spawn_candidate(claims, shutdown.clone());
        started
            .await
            .expect("controllers start at once when the lease is held");
        shutdown.cancel();
        assert_eq!(task.await.unwrap(), Outcome::Shutdown);
        drop(lease);
    }

    #[tokio::test]
    async fn shutdown_before_leading_never_starts_controllers() {
        let (_lease, claims) = watch::channel(false);
        let shutdown = CancellationToken::new();
        let (task, mut started, changes) = spawn_candidate(claims, shutdown.clone());
        shutdown.cancel();
        assert_eq!(task.await.unwrap(), Outcome::Shutdown);
        assert!(started.try_recv().is_err(), "controllers must not have run");
        assert!(changes.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_dead_election_task_counts_as_lost() {
        let (lease, claims) = watch::channel(false);
        let (task, _, _) = spawn_candidate(claims, CancellationToken::new());
        drop(lease);
        assert_eq!(task.await.unwrap(), Outcome::LeaseLost);
    }

    #[test]
    fn renewal_happens_at_the_renew_deadline() {
        let timing = ElectionTiming {
            lease_duration: Duration::from_secs(45),
            renew_deadline: Duration::from_secs(30),
            retry_period: Duration::from_secs(2),
        };
        assert_eq!(lease_seconds(&timing), (45, 15));
    }
}
