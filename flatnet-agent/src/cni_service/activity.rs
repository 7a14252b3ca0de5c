//! How many CNI commands are waiting for their answer, so background work
//! that competes with them for RTNL and the data-plane lock (moving policy
//! programs into TCX links) runs when none is, one piece at a time.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use tokio::sync::{Notify, Semaphore, SemaphorePermit};

/// Commands in flight and the turn of background work.
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicUsize,
    idle: Notify,
    background: Semaphore,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            background: Semaphore::new(1),
        }
    }
}

/// One command until its answer; dropping it ends it.
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Activity {
    /// Counts a command until the guard is dropped.
    pub fn busy(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Busy(Arc::clone(self))
    }

    /// Waits for the background turn (one piece of background work at a
    /// time), then until no command waits for its answer.
    pub async fn background_turn(&self) -> SemaphorePermit<'_> {
        let turn = self
            .background
            .acquire()
            .await
            .expect("the semaphore is never closed");
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            // Registered before the check, so a command ending in between
            // still wakes this.
            idle.as_mut().enable();
            if self.in_flight.load(Ordering::SeqCst) == 0 {
                return turn;
            }
            idle.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn background_work_waits_for_commands_and_goes_one_at_a_time() {
        let activity = Arc::new(Activity::default());
        let busy = activity.busy();
        let waiting = {
            let activity = Arc::clone(&activity);
            tokio::spawn(async move {
                let _turn = activity.background_turn().await;
                tokio::time::sleep(Duration::from_secs(1)).await;
            })
        };
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "ran while a command was in flight");
        drop(busy);
        // The first piece holds the turn for a second: a second one waits.
        tokio::time::sleep(Duration::from_millis(10)).await;
        let second = {
            let activity = Arc::clone(&activity);
            tokio::spawn(async move {
                let _turn = activity.background_turn().await;
            })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!second.is_finished(), "two pieces at once");
        waiting.await.unwrap();
        second.await.unwrap();
    }
}
