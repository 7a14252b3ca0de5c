//! Removing attachments: DEL (answered once the pod is out of the
//! tables, the rest after), GC, and the teardown both share with a failed
//! or repeated ADD and with recovery after a restart.

use std::{path::PathBuf, sync::Arc};

use tracing::Instrument;

use super::{Inner, internal, key_of, on_own_thread};
use crate::{
    cni::{CniError, DetachRequest, ErrorCode, GcRequest},
    desired::{AttachmentKey, DesiredState},
    link::DetachSpec,
    netns::{HeldNetns, netns_path_exists},
    phases::{self, timed},
    records::{AttachmentRecord, RecordPhase},
};

/// Where DEL sends its answer.
type Answer = tokio::sync::oneshot::Sender<Result<(), CniError>>;

impl<S: DesiredState> Inner<S> {
    /// Removes everything of an attachment: table entries, the interface
    /// (when `delete_interface`), the allocation and the record. The record
    /// stays when something could not be removed, so a later DEL retries.
    pub(super) async fn teardown(
        self: &Arc<Self>,
        record: &AttachmentRecord,
        delete_interface: bool,
    ) -> Result<(), CniError> {
        let held = delete_interface
            .then(|| HeldNetns::open(&record.netns))
            .flatten();
        self.teardown_holding(record, delete_interface, held).await
    }

    /// [`Self::teardown`], entering the pod's namespace through `held`
    /// when the caller holds it.
    async fn teardown_holding(
        self: &Arc<Self>,
        record: &AttachmentRecord,
        delete_interface: bool,
        held: Option<HeldNetns>,
    ) -> Result<(), CniError> {
        let mut errors = Vec::new();
        if let Err(error) = timed("tables_remove", || self.remove_tables(record)) {
            errors.push(error.msg);
        }
        if delete_interface {
            let netns = Some(record.netns.clone())
                .filter(|p: &PathBuf| held.is_some() || netns_path_exists(p));
            let detach = DetachSpec {
                netns,
                held_netns: held,
                ifname: record.key.ifname.clone(),
                parent: record.parent_link(),
                host_route: record.host_route.clone(),
                primary_defaults: record.primary_defaults.clone(),
                addresses: record.ips(),
            };
            let attachments = self.config.attachments.clone();
            let detached = on_own_thread(async move { attachments.detach(&detach).await })
                .instrument(phases::phase("link_detach"))
                .await;
            if let Err(error) = detached {
                errors.push(error);
            }
        }
        self.remove_defunct_links(Some(record.netns.clone()))
            .instrument(phases::phase("defunct_pins"))
            .await;
        // The address stays allocated while the interface may still use it.
        if errors.is_empty()
            && let Err(error) = self
                .desired
                .release(&record.network, &record.key)
                .instrument(phases::phase("release"))
                .await
        {
            errors.push(error.to_string());
        }
        if !errors.is_empty() {
            return Err(CniError::new(
                ErrorCode::AgentInternal,
                format!(
                    "cannot remove {} of {}: {}",
                    record.key,
                    record.pod,
                    errors.join("; ")
                ),
            ));
        }
        timed("record_remove", || self.records.remove(&record.key)).map_err(internal)?;
        tracing::info!(key = %record.key, pod = %record.pod, "attachment removed");
        self.policy_changed();
        Ok(())
    }

    /// Releases the allocation of `record`, logging a failure (GC retries).
    pub(super) async fn release_quietly(&self, record: &AttachmentRecord) {
        if let Err(error) = self.desired.release(&record.network, &record.key).await {
            tracing::error!(key = %record.key, %error, "cannot release an allocation; GC will retry");
        }
    }

    /// DEL. Answers (through `answer`) once the pod's addresses are out of
    /// the data-plane tables. Deleting the interface (the kernel waits for
    /// RCU callbacks on every link deletion, 15 to 40 ms), releasing the
    /// address and removing the record follow under the attachment's lock,
    /// so a later ADD, DEL or GC of it waits for them, and the address is
    /// not handed out again while the interface may still use it. The pod's
    /// namespace is held open from before the answer, so the interface is
    /// deleted here even when the runtime has deleted the namespace's path
    /// meanwhile, and its MAC is free for the pod's next interface. Should
    /// they fail, the record stays and GC or the next DEL retries.
    pub(super) async fn del(self: &Arc<Self>, request: DetachRequest, answer: Answer) {
        let key = key_of(&request.attachment);
        self.cancel_policy_upgrade(&key);
        self.cancel_active_report(&key);
        let until_answer = phases::phase("until_answer");
        let _guard = self
            .locks
            .lock(&key)
            .instrument(phases::phase("lock"))
            .await;
        let record = match timed("record_load", || self.records.load(&key)).map_err(internal) {
            Ok(Some(record)) if record.network == request.config.name => record,
            // The interface belongs to another network (the runtime cleaning
            // up after an ADD refused for that reason): only this network's
            // allocation, if any, goes. Otherwise nothing was created; an
            // allocation may exist if the agent stopped between claim and record.
            Ok(_) => {
                let released = self
                    .desired
                    .release(&request.config.name, &key)
                    .instrument(phases::phase("release"))
                    .await
                    .map_err(|e| e.to_cni());
                let _ = answer.send(released);
                return;
            }
            Err(error) => {
                let _ = answer.send(Err(error));
                return;
            }
        };
        // Durable before the answer: an agent killed after answering
        // finishes the removal at its restart instead of keeping the
        // attachment as if it were live.
        let mut record = record;
        record.phase = RecordPhase::Deleting;
        if let Err(error) = timed("record_deleting", || self.records.save(&record)) {
            let _ = answer.send(Err(internal(error)));
            return;
        }
        // Held from before the answer: the runtime deletes the namespace's
        // path once it has it, and the interface is deleted after.
        let held = timed("netns_hold", || HeldNetns::open(&record.netns));
        let answer = match timed("tables_remove", || self.remove_tables(&record)) {
            Ok(()) => {
                let _ = answer.send(Ok(()));
                drop(until_answer);
                crate::crash_point::crash_point("del-answered");
                None
            }
            // Answer with the outcome of the whole teardown instead.
            Err(error) => {
                tracing::warn!(key = %record.key, %error, "cannot remove the pod's table entries; retrying in the teardown");
                Some(answer)
            }
        };
        let result = self.teardown_holding(&record, true, held).await;
        match answer {
            Some(answer) => {
                let _ = answer.send(result);
            }
            None => {
                if let Err(error) = result {
                    tracing::error!(key = %record.key, %error, "DEL answered, but removing the attachment failed; GC or the next DEL retries");
                }
            }
        }
    }

    /// GC: removes the attachments of the network the runtime no longer
    /// lists, then the allocations no record holds.
    pub(super) async fn gc(self: &Arc<Self>, request: GcRequest) -> Result<(), CniError> {
        let network = &request.config.name;
        let keep: Vec<AttachmentKey> = request
            .valid_attachments
            .iter()
            .map(|v| AttachmentKey {
                container_id: v.container_id.clone(),
                ifname: v.ifname.clone(),
            })
            .collect();
        let mut errors = Vec::new();
        let records = self.records.all().map_err(internal)?;
        for record in records
            .iter()
            // Hot-plugged attachments are the hot-plug pass's, never listed
            // by the runtime.
            .filter(|r| &r.network == network && !r.key.is_hotplug() && !keep.contains(&r.key))
        {
            let _guard = self.locks.lock(&record.key).await;
            // Re-read under the lock: a concurrent DEL may have finished it.
            match self.records.load(&record.key) {
                Ok(Some(current)) => {
                    tracing::info!(key = %current.key, "GC: removing a stale attachment");
                    if let Err(error) = self.teardown(&current, true).await {
                        errors.push(error.msg);
                    }
                }
                Ok(None) => {}
                Err(error) => errors.push(error.to_string()),
            }
        }
        // Allocations whose record is gone (or never written).
        let mut still_recorded: Vec<AttachmentKey> = keep;
        if let Ok(records) = self.records.all() {
            still_recorded.extend(
                records
                    .into_iter()
                    .filter(|r| &r.network == network)
                    .map(|r| r.key),
            );
        }
        if let Err(error) = self.desired.release_except(network, &still_recorded).await {
            errors.push(error.to_string());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(CniError::new(
                ErrorCode::AgentInternal,
                format!(
                    "GC of network {network:?} left work undone: {}",
                    errors.join("; ")
                ),
            ))
        }
    }
}
