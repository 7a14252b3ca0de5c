//! The data-plane side of an attachment: the uplink program and the
//! address tables it reads (managed addresses, responders), the pod's
//! policy programs (filters on ADD, moved into TCX links afterwards), the
//! TCP MSS clamping programs on a pod's primary interface, and the policy
//! controller's view of the pods.

use std::{collections::BTreeSet, path::PathBuf, sync::Arc, time::Duration};

use super::{Inner, internal};
use crate::{
    cni::CniError,
    datapath::interface_macs,
    desired::{AttachmentKey, DesiredState},
    link::parse_mac,
    netns::{netns_path_exists, run_in_netns, run_in_netns_or_here},
    policy_controller::{self, PodTables},
    records::{AttachmentRecord, RecordPhase, UplinkRecord},
};

/// How long after its ADD a pod's policy programs move from filters into
/// TCX links: a pod deleted sooner never makes the kernel wait for the
/// links' RCU grace periods (which it does holding RTNL).
const TCX_UPGRADE_DELAY: Duration = Duration::from_secs(1);

/// How the policy programs go onto a pod interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PolicyAttach {
    /// On the answer path: through filters, which take effect at once (see
    /// [`crate::datapath::Datapath::attach_policy_at_once`]).
    AtOnce,
    /// Through the data plane's mechanism (TCX links where the kernel has
    /// them), replacing what is there in place.
    InPlace,
}

impl<S: DesiredState> Inner<S> {
    /// Attaches the uplink program (once per uplink) and lists the pod's
    /// addresses in the managed-address table, and in the responder table
    /// for ipvlan L3/L3S.
    pub(super) async fn program_tables(
        self: &Arc<Self>,
        record: &AttachmentRecord,
        uplink: &UplinkRecord,
    ) -> Result<(), CniError> {
        let owner =
            parse_mac(&uplink.owner_mac).ok_or_else(|| internal("bad owner MAC in record"))?;
        let attached = self
            .datapath
            .lock()
            .expect("datapath lock poisoned")
            .uplinks
            .contains(&uplink.ifname);
        if !attached {
            let name = uplink.ifname.clone();
            self.blocking(move |inner| inner.attach_uplink(&name))
                .await?;
        }
        // The node's interfaces as they are now (a node macvlan on the
        // master may have come since the last pod).
        let node_macs = self.blocking(|inner| inner.node_interface_macs()).await?;
        let mut maps = self.maps.lock().expect("table maps lock poisoned");
        {
            let mut own = maps.node_macs().map_err(internal)?;
            let mut synced = self.node_macs.lock().expect("node MACs lock poisoned");
            if synced.as_ref() != Some(&node_macs) {
                own.sync_node(&node_macs).map_err(internal)?;
                *synced = Some(node_macs);
            }
            if let Some(mac) = record.mac.as_deref().and_then(parse_mac) {
                own.add_pod(mac).map_err(internal)?;
            }
        }
        for addr in record.ips() {
            if uplink.responder {
                maps.responders()
                    .and_then(|mut r| r.insert(uplink.ifindex, addr, owner))
                    .map_err(internal)?;
            }
            maps.managed_addrs()
                .and_then(|mut m| m.insert(uplink.ifindex, addr, owner))
                .map_err(internal)?;
        }
        Ok(())
    }

    /// The MACs of the node namespace's interfaces (blocks: enters it).
    pub(super) fn node_interface_macs(&self) -> Result<BTreeSet<[u8; 6]>, CniError> {
        let host = self.config.attachments.host_netns.clone();
        run_in_netns_or_here(host, interface_macs)
            .map_err(internal)?
            .map_err(internal)
    }

    /// Attaches the uplink program to `name` in the node namespace unless
    /// it is there already (blocks: enters the namespace, holds the
    /// data-plane lock).
    pub(super) fn attach_uplink(&self, name: &str) -> Result<(), CniError> {
        let mut tables = self.datapath.lock().expect("datapath lock poisoned");
        if tables.uplinks.contains(name) {
            return Ok(());
        }
        let host = self.config.attachments.host_netns.clone();
        let datapath = &mut tables.datapath;
        run_in_netns_or_here(host, || datapath.attach_uplink(name))
            .map_err(internal)?
            .map_err(internal)?;
        tables.uplinks.insert(name.to_owned());
        tracing::info!(uplink = %name, "uplink program attached");
        Ok(())
    }

    /// Attaches the policy programs (ingress and egress) to the pod's flat
    /// interface. A pod no policy isolates passes everything, so attaching
    /// always is correct, and later policy changes only rewrite maps.
    /// Returns whether the programs are to move into TCX links later
    /// ([`Self::upgrade_policy_later`]; only after [`PolicyAttach::AtOnce`]).
    pub(super) async fn attach_policy(
        self: &Arc<Self>,
        record: &AttachmentRecord,
        how: PolicyAttach,
    ) -> Result<bool, CniError> {
        let netns = record.netns.clone();
        let ifname = record.key.ifname.clone();
        let pod = record.pod.clone();
        self.blocking(move |inner| {
            // The lock is taken in the namespace: concurrent ADDs hold it
            // for the attach only, not while a thread enters the namespace.
            run_in_netns(&netns, || {
                let mut tables = inner.datapath.lock().expect("datapath lock poisoned");
                match how {
                    PolicyAttach::AtOnce => tables.datapath.attach_policy_at_once(&ifname),
                    PolicyAttach::InPlace => tables.datapath.attach_policy(&ifname).map(|()| false),
                }
            })
            .map_err(internal)?
            .map_err(|e| internal(format!("policy programs on {ifname} of {pod}: {e}")))
        })
        .await
    }

    /// Puts the TCP MSS clamping programs onto the interface `ifname` in
    /// the namespace `netns` (`on`), replacing flatnet's earlier ones, or
    /// takes them off (an interface that is gone has none). Returns whether
    /// anything was attached before taking off (blocks on its own thread:
    /// enters the namespace, holds the data-plane lock).
    pub(super) async fn set_mss_clamp(
        self: &Arc<Self>,
        netns: PathBuf,
        ifname: &'static str,
        on: bool,
    ) -> Result<bool, String> {
        let inner = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            run_in_netns(&netns, || {
                if nix::net::if_::if_nametoindex(ifname).is_err() {
                    return if on {
                        Err(format!(
                            "interface {ifname} not found in network namespace {}",
                            netns.display()
                        ))
                    } else {
                        Ok(false)
                    };
                }
                let mut tables = inner.datapath.lock().expect("datapath lock poisoned");
                let result = if on {
                    tables.datapath.attach_mss_clamp(ifname).map(|()| true)
                } else {
                    crate::datapath::detach_mss_clamp(tables.datapath.pin_root(), ifname)
                };
                result.map_err(|e| format!("TCP MSS clamping programs: {e}"))
            })
            .map_err(|e| e.to_string())?
        })
        .await
        .map_err(|e| format!("TCP MSS clamping programs: {e}"))?
    }

    /// Tells the policy controller about a new pod and waits until the
    /// policy tables judge it as its policies say, so the pod's first
    /// packets are already isolated. After [`policy_controller::ADD_WAIT_LIMIT`]
    /// the ADD answers anyway (the tables follow with the next round).
    pub(super) async fn policy_in_force_for(&self, record: &AttachmentRecord) {
        let Some(trigger) = self.policy_trigger.get() else {
            return;
        };
        let pod = policy_controller::record_pod_addresses(record);
        if trigger
            .pod_attached(&pod, policy_controller::ADD_WAIT_LIMIT)
            .await
            == PodTables::TimedOut
        {
            self.metrics.policy.add_wait_timeouts.inc();
            tracing::warn!(
                pod = %record.pod,
                limit = ?policy_controller::ADD_WAIT_LIMIT,
                "the network-policy tables do not include this pod yet; it is not isolated until they do"
            );
        }
    }

    /// Tells the policy controller that the set of attachments changed.
    pub(super) fn policy_changed(&self) {
        if let Some(trigger) = self.policy_trigger.get() {
            trigger.changed();
        }
    }

    /// Takes the pod's addresses out of the address tables (map writes
    /// only: quick, no namespace to enter).
    pub(super) fn remove_tables(&self, record: &AttachmentRecord) -> Result<(), CniError> {
        let Some(uplink) = &record.uplink else {
            return Ok(());
        };
        let mut maps = self.maps.lock().expect("table maps lock poisoned");
        if let Some(mac) = record.mac.as_deref().and_then(parse_mac) {
            maps.node_macs()
                .and_then(|mut own| own.remove_pod(mac))
                .map_err(internal)?;
            let mut wire = maps.wire_claims_mut().map_err(internal)?;
            for addr in record.ips() {
                wire.forget_own(uplink.ifindex, addr, mac)
                    .map_err(internal)?;
            }
        }
        for addr in record.ips() {
            if uplink.responder {
                maps.responders()
                    .and_then(|mut r| r.remove(uplink.ifindex, addr))
                    .map_err(internal)?;
            }
            maps.managed_addrs()
                .and_then(|mut m| m.remove(uplink.ifindex, addr))
                .map_err(internal)?;
        }
        Ok(())
    }

    /// A deleted pod interface takes its programs with it, but the pins of
    /// their TCX links stay until removed: those of the pod namespace at
    /// `netns` (one DEL), or all (a restart; also when that namespace is
    /// already gone and its pins cannot be told apart).
    pub(super) async fn remove_defunct_links(self: &Arc<Self>, netns: Option<PathBuf>) {
        let removed = self
            .blocking(move |inner| {
                let tables = inner.datapath.lock().expect("datapath lock poisoned");
                match netns.filter(|netns| netns_path_exists(netns)) {
                    Some(netns) => tables.datapath.remove_defunct_links_in(&netns),
                    None => tables.datapath.remove_defunct_links(),
                }
                .map_err(internal)
            })
            .await;
        match removed {
            Ok(removed) => {
                for pin in removed {
                    tracing::debug!(pin = %pin.display(), "removed the pin of a defunct TCX link");
                }
            }
            Err(error) => tracing::warn!(%error, "cannot remove the pins of defunct TCX links"),
        }
    }

    /// Moves the policy programs of `key` from the filters its ADD
    /// attached into TCX links, [`TCX_UPGRADE_DELAY`] later unless a DEL
    /// comes first, one pod at a time and only while no CNI command waits
    /// for its answer (each move holds RTNL and the data-plane lock through
    /// two RCU grace periods). TCX runs the programs for less per packet;
    /// the links replace the filters only once in place, so the pod is
    /// never without its policy.
    pub(super) fn upgrade_policy_later(self: &Arc<Self>, key: AttachmentKey) {
        let inner = Arc::clone(self);
        let task_key = key.clone();
        let task = tokio::spawn(async move {
            tokio::time::sleep(TCX_UPGRADE_DELAY).await;
            let _turn = inner.activity.background_turn().await;
            let _guard = inner.locks.lock(&task_key).await;
            inner
                .upgrades
                .lock()
                .expect("upgrade table poisoned")
                .remove(&task_key);
            let record = match inner.records.load(&task_key) {
                Ok(Some(record))
                    if record.phase == RecordPhase::Ready && netns_path_exists(&record.netns) =>
                {
                    record
                }
                _ => return,
            };
            if let Err(error) = inner.attach_policy(&record, PolicyAttach::InPlace).await {
                tracing::warn!(key = %task_key, %error, "cannot move the policy programs into TCX links; the filters stay");
            }
        });
        let previous = self
            .upgrades
            .lock()
            .expect("upgrade table poisoned")
            .insert(key, task.abort_handle());
        if let Some(previous) = previous {
            previous.abort();
        }
    }

    /// Cancels the pending move of `key`'s policy programs into TCX links
    /// (its DEL came first).
    pub(super) fn cancel_policy_upgrade(&self, key: &AttachmentKey) {
        if let Some(upgrade) = self
            .upgrades
            .lock()
            .expect("upgrade table poisoned")
            .remove(key)
        {
            upgrade.abort();
        }
    }
}
