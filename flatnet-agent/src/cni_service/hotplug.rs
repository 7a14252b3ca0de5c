//! Hot-plugging extra flat interfaces into running pods: the desired
//! state lists them ([`HotplugAttachment`]), and each pass makes the
//! missing ones and removes those no longer listed through the same ADD
//! and DEL as the runtime's, so they are recorded, allocated, announced,
//! policed and conflict-watched like any attachment, and restarts and
//! recovery treat both alike. Their container IDs carry
//! [`crate::desired::HOTPLUG_CONTAINER_PREFIX`]: the runtime's GC leaves
//! them alone, and the pass never touches an attachment without it (nor an
//! interface it did not make: ADD refuses a name the pod already has).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use super::{AgentService, Inner, follow::PassReport};
use crate::{
    cni::{AttachRequest, CniArgs, CniError, DetachRequest, NetworkConfig, request::Attachment},
    desired::{AttachmentKey, DesiredState, HotplugAttachment, PodRef},
    records::{AttachmentRecord, RecordPhase},
};

/// How often the desired hot-plugged interfaces are compared with the last
/// pass: what a hot-plug waits for at most before its ADD starts. A look
/// costs one `stat` of the state file (standalone) or a read of the
/// watch-driven copy.
pub const HOTPLUG_FOLLOW_INTERVAL: Duration = Duration::from_millis(50);

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HotplugPass {
    /// Interfaces added.
    pub added: usize,
    /// Interfaces removed.
    pub removed: usize,
    /// What failed, with why.
    pub failed: Vec<String>,
}

/// The network configuration a hot-plugged interface is added with, as a
/// runtime would pass it (the agent's defaults for everything else).
/// The network configuration of a hot-plugged interface on `network`:
/// `mtu` is that of the pod's own flat attachments (their network
/// configuration's, the NetworkAttachmentDefinition's), which a subnet's
/// `mtu` overrides as for any attachment.
fn network_config(network: &str, mtu: Option<u32>) -> Result<NetworkConfig, CniError> {
    let mut config = serde_json::json!({
        "cniVersion": "1.1.0",
        "name": network,
        "type": "flatnet-cni",
    });
    if let Some(mtu) = mtu {
        config["mtu"] = mtu.into();
    }
    NetworkConfig::decode(config.to_string().as_bytes())
}

fn attachment(key: &AttachmentKey, wanted: Option<&HotplugAttachment>) -> Attachment {
    let pod = wanted.map(|w| w.pod.clone()).unwrap_or_default();
    Attachment {
        container_id: key.container_id.clone(),
        ifname: key.ifname.clone(),
        args: CniArgs {
            pod_namespace: pod.namespace,
            pod_name: pod.name,
            pod_uid: pod.uid,
            ..CniArgs::default()
        },
        cni_path: Vec::new(),
    }
}

impl<S: DesiredState> AgentService<S> {
    /// Follows the desired hot-plugged interfaces for the agent's
    /// lifetime ([`follow`](super::follow::follow)).
    pub async fn follow_hotplug(&self, interval: Duration) {
        super::follow::follow(
            interval,
            "hot-plugging or removing an interface",
            || self.inner.desired.hotplug_attachments(),
            |wanted: Vec<HotplugAttachment>| async move { self.apply_hotplug(&wanted).await },
        )
        .await;
    }

    /// One pass: adds the listed interfaces that are not ready, removes the
    /// hot-plugged ones not listed (or whose pod's namespace is unknown
    /// now), and reports each listed interface's outcome.
    pub async fn apply_hotplug(&self, wanted: &[HotplugAttachment]) -> HotplugPass {
        let mut pass = HotplugPass::default();
        let records = match self.inner.records.all() {
            Ok(records) => records,
            Err(error) => {
                pass.failed
                    .push(format!("cannot read the records: {error}"));
                return pass;
            }
        };
        let mut resolved: BTreeMap<AttachmentKey, (&HotplugAttachment, PathBuf)> = BTreeMap::new();
        let mut unresolved = Vec::new();
        for want in wanted {
            match self
                .netns_of(want.netns.as_ref(), &want.pod, &records)
                .await
            {
                Ok(netns) => {
                    resolved.insert(want.key(), (want, netns));
                }
                Err(why) => unresolved.push((want, why)),
            }
        }
        for record in records.iter().filter(|r| r.key.is_hotplug()) {
            let listed = resolved
                .get(&record.key)
                .is_some_and(|(w, netns)| w.network == record.network && *netns == record.netns);
            if listed {
                continue;
            }
            match self.inner.remove_hotplugged(record).await {
                Ok(()) => pass.removed += 1,
                Err(error) => pass
                    .failed
                    .push(format!("removing {}: {}", record.key, error.msg)),
            }
        }
        for (want, failure) in unresolved {
            self.report_hotplug(want, Some(&failure), &mut pass).await;
            pass.failed
                .push(format!("adding {} to {}: {failure}", want.ifname, want.pod));
        }
        for (key, (want, netns)) in &resolved {
            let ready = records
                .iter()
                .any(|r| &r.key == key && r.phase == RecordPhase::Ready && r.netns == *netns);
            if ready {
                self.report_hotplug(want, None, &mut pass).await;
                continue;
            }
            let mtu = pod_attachments(&records, &want.pod)
                .filter_map(|r| r.mtu)
                .min();
            match self.hotplug(key, want, netns, mtu).await {
                Ok(()) => {
                    pass.added += 1;
                    self.report_hotplug(want, None, &mut pass).await;
                }
                Err(error) => {
                    self.report_hotplug(want, Some(&error.msg), &mut pass).await;
                    pass.failed.push(format!(
                        "adding {} on network {} to {}: {}",
                        want.ifname, want.network, want.pod, error.msg
                    ));
                }
            }
        }
        pass
    }

    /// The network namespace of `pod`: `netns` when the desired state
    /// names it, else that of the pod's own attachments, else the one the
    /// container runtime reports for the pod; `Err` says why none.
    pub(super) async fn netns_of(
        &self,
        netns: Option<&PathBuf>,
        pod: &PodRef,
        records: &[AttachmentRecord],
    ) -> Result<PathBuf, String> {
        let own = || {
            pod_attachments(records, pod)
                .next()
                .map(|r| r.netns.clone())
        };
        if let Some(netns) = netns.cloned().or_else(own) {
            return Ok(netns);
        }
        let Some(sandboxes) = &self.inner.config.pod_sandboxes else {
            return Err(format!(
                "this node's agent did not attach {} and is not asking the container runtime \
                 for its network namespace (--cri-socket is empty)",
                pod
            ));
        };
        sandboxes.network_namespace(pod).await.map_err(|error| {
            format!(
                "this node's agent did not attach {} and cannot find its network namespace: {error}",
                pod
            )
        })
    }

    /// Tells the desired state how `want` went; a report that cannot be
    /// written fails the pass, so it is retried.
    async fn report_hotplug(
        &self,
        want: &HotplugAttachment,
        failure: Option<&str>,
        pass: &mut HotplugPass,
    ) {
        if let Err(error) = self.inner.desired.report_hotplug(want, failure).await {
            pass.failed.push(format!(
                "reporting {} of {}: {error}",
                want.ifname, want.pod
            ));
        }
    }

    async fn hotplug(
        &self,
        key: &AttachmentKey,
        want: &HotplugAttachment,
        netns: &Path,
        mtu: Option<u32>,
    ) -> Result<(), CniError> {
        let request = AttachRequest {
            attachment: attachment(key, Some(want)),
            netns: netns.to_owned(),
            config: network_config(&want.network, mtu)?,
        };
        let inner = Arc::clone(&self.inner);
        let key = key.clone();
        super::spawn(async move {
            let added = inner.add(request).await?;
            if added.upgrade_policy {
                inner.upgrade_policy_later(key);
            }
            Ok(())
        })
        .await
    }
}

/// `pod`'s own (not hot-plugged) ready attachments that the agent made:
/// the pod's name and namespace must match, and its UID too where both are
/// known.
fn pod_attachments<'a>(
    records: &'a [AttachmentRecord],
    pod: &'a PodRef,
) -> impl Iterator<Item = &'a AttachmentRecord> {
    let named = pod.namespace.is_some() && pod.name.is_some();
    records
        .iter()
        .filter(move |r| named && !r.key.is_hotplug() && r.phase == RecordPhase::Ready)
        .filter(move |r| {
            r.pod.namespace == pod.namespace
                && r.pod.name == pod.name
                && match (&r.pod.uid, &pod.uid) {
                    (Some(a), Some(b)) => a == b,
                    _ => true,
                }
        })
}

impl PassReport for HotplugPass {
    fn failures(&self) -> &[String] {
        &self.failed
    }

    fn log_changes(&self) {
        if self.added > 0 || self.removed > 0 {
            tracing::info!(
                added = self.added,
                removed = self.removed,
                "hot-plugged interfaces applied"
            );
        }
    }
}

impl<S: DesiredState> Inner<S> {
    /// Removes one hot-plugged attachment as a DEL does.
    async fn remove_hotplugged(
        self: &Arc<Self>,
        record: &crate::records::AttachmentRecord,
    ) -> Result<(), CniError> {
        let request = DetachRequest {
            attachment: attachment(&record.key, None),
            netns: Some(record.netns.clone()),
            config: network_config(&record.network, record.mtu)?,
        };
        let (answer, answered) = tokio::sync::oneshot::channel();
        let inner = Arc::clone(self);
        let work = tokio::spawn(async move { inner.del(request, answer).await });
        let answer = answered
            .await
            .unwrap_or_else(|_| Err(super::internal("DEL ended without an answer")));
        // The pass reports removal once it is complete, not at the answer.
        let _ = work.await;
        answer
    }
}
