//! The Active status of an attachment, told after ADD has answered
//! ([`DesiredState::report_active`]): nothing the pod needs waits for a
//! round trip to the API server. Told again after a growing pause until it
//! goes through or the attachment is gone, and after an agent restart
//! while the record still owes it ([`AttachmentRecord::unreported_mtu`]).

use std::{sync::Arc, time::Duration};

use super::Inner;
use crate::{
    desired::{AttachmentKey, DesiredState},
    link::parse_mac,
    records::{AttachmentRecord, RecordPhase},
};

/// The pause after the first failed report; doubled after each failure up
/// to [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(200);
/// The longest pause between two reports.
const LONGEST_PAUSE: Duration = Duration::from_secs(30);

impl<S: DesiredState> Inner<S> {
    /// Tells `record`'s Active status in the background, when it owes one.
    pub(super) fn report_active_later(self: &Arc<Self>, record: &AttachmentRecord) {
        let Some(mtu) = record.unreported_mtu else {
            return;
        };
        let Some(mac) = record.mac.as_deref().and_then(parse_mac) else {
            tracing::error!(key = %record.key, "a ready record without its MAC; its Active status is not told");
            return;
        };
        // A restart from here must tell it (the record owes it).
        crate::crash_point::crash_point("active-unreported");
        let inner = Arc::clone(self);
        let (key, pod, subnets) = (
            record.key.clone(),
            record.pod.clone(),
            record.subnets.clone(),
        );
        // Held while the task starts: it cannot take itself out of the
        // table before it is in.
        let mut reports = self
            .active_reports
            .lock()
            .expect("active report table poisoned");
        let task = tokio::spawn(async move {
            let mut pause = FIRST_PAUSE;
            while inner.owes_active(&key) {
                match inner
                    .desired
                    .report_active(&key, &pod, &subnets, mac, mtu)
                    .await
                {
                    Ok(()) => {
                        inner.reported_active(&key).await;
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(%key, %error, ?pause, "cannot tell the attachment's Active status; telling it again after the pause");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(LONGEST_PAUSE);
                    }
                }
            }
            inner.forget_active_report(&key, tokio::task::id());
        });
        if let Some(earlier) = reports.insert(record.key.clone(), task.abort_handle()) {
            earlier.abort();
        }
    }

    /// Stops telling `key`'s Active status (its DEL came).
    pub(super) fn cancel_active_report(&self, key: &AttachmentKey) {
        let pending = self
            .active_reports
            .lock()
            .expect("active report table poisoned")
            .remove(key);
        if let Some(pending) = pending {
            pending.abort();
        }
    }

    /// Whether the record of `key` is ready and still owes its Active
    /// status (GC or DEL may have removed it meanwhile).
    fn owes_active(&self, key: &AttachmentKey) -> bool {
        matches!(
            self.records.load(key),
            Ok(Some(record)) if record.phase == RecordPhase::Ready && record.unreported_mtu.is_some()
        )
    }

    /// The record of `key` owes its Active status no more.
    async fn reported_active(&self, key: &AttachmentKey) {
        let _guard = self.locks.lock(key).await;
        if let Ok(Some(mut record)) = self.records.load(key)
            && record.phase == RecordPhase::Ready
            && record.unreported_mtu.take().is_some()
            && let Err(error) = self.records.save(&record)
        {
            // Told again at the next restart: harmless, as telling what is
            // known asks nothing.
            tracing::warn!(%key, %error, "cannot note that the Active status was told");
        }
    }

    /// Drops the finished report task `task` of `key` from the table,
    /// unless a later one has taken its place.
    fn forget_active_report(&self, key: &AttachmentKey, task: tokio::task::Id) {
        let mut reports = self
            .active_reports
            .lock()
            .expect("active report table poisoned");
        if reports.get(key).is_some_and(|handle| handle.id() == task) {
            reports.remove(key);
        }
    }
}
