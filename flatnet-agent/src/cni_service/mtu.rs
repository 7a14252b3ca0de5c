//! Changing the MTU of running pods when their subnet's `spec.mtu`
//! changes: each ready attachment whose subnets now ask for another MTU
//! gets it set in place in the pod's namespace, under the attachment's
//! lock, then its record and its desired state (Kubernetes: the
//! FlatNetworkIPs' `status.mtu`) say so.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use flatnet_k8s::validation::interface_mtu;

use super::{AgentService, Inner, follow::PassReport, spec::valid_subnets};
use crate::{
    desired::DesiredState,
    link::{MtuChange, MtuTarget},
    records::{AttachmentRecord, RecordPhase},
};

/// How often the subnets' MTUs are compared with the last pass.
pub const MTU_FOLLOW_INTERVAL: Duration = Duration::from_secs(1);

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MtuPass {
    /// Interfaces whose MTU was changed.
    pub changed: usize,
    /// Interfaces that had the wanted MTU already.
    pub unchanged: usize,
    /// Attachments that could not be changed, with why.
    pub failed: Vec<String>,
}

/// The MTU `record`'s interface must have when its subnets' `spec.mtu`
/// are `current` (subnets missing from it keep the recorded spec): the
/// subnets' smallest, else the network configuration's; `None` leaves the
/// interface as it is.
fn wanted_mtu(record: &AttachmentRecord, current: &BTreeMap<String, Option<u32>>) -> Option<u32> {
    record
        .subnets
        .iter()
        .filter_map(|s| current.get(&s.name).copied().unwrap_or(s.spec.mtu))
        .min()
        .or(record.mtu)
}

impl<S: DesiredState> AgentService<S> {
    /// Brings the MTU of every ready attachment in line with its subnets'
    /// `spec.mtu` now.
    pub async fn apply_subnet_mtus(&self) -> MtuPass {
        let current = self.inner.desired.subnet_mtus().await;
        self.inner.apply_mtus(&current).await
    }

    /// Follows the subnets' MTUs for the agent's lifetime
    /// ([`follow`](super::follow::follow)).
    pub async fn follow_subnet_mtus(&self, interval: Duration) {
        super::follow::follow(
            interval,
            "changing a running pod's MTU",
            || async { Some(self.inner.desired.subnet_mtus().await).filter(|m| !m.is_empty()) },
            |current| async move { self.inner.apply_mtus(&current).await },
        )
        .await;
    }
}

impl PassReport for MtuPass {
    fn failures(&self) -> &[String] {
        &self.failed
    }

    fn log_changes(&self) {
        if self.changed > 0 {
            tracing::info!(
                changed = self.changed,
                unchanged = self.unchanged,
                "subnet MTUs applied to running pods"
            );
        }
    }
}

impl<S: DesiredState> Inner<S> {
    async fn apply_mtus(self: &Arc<Self>, current: &BTreeMap<String, Option<u32>>) -> MtuPass {
        let mut pass = MtuPass::default();
        let records = match self.records.all() {
            Ok(records) => records,
            Err(error) => {
                pass.failed
                    .push(format!("cannot read the records: {error}"));
                return pass;
            }
        };
        for record in records {
            if record.phase != RecordPhase::Ready {
                continue;
            }
            let Some(mtu) = wanted_mtu(&record, current) else {
                continue;
            };
            let _guard = self.locks.lock(&record.key).await;
            // Read again under the lock: a DEL or a new ADD may have won.
            let record = match self.records.load(&record.key) {
                Ok(Some(record)) if record.phase == RecordPhase::Ready => record,
                Ok(_) => continue,
                Err(error) => {
                    pass.failed.push(format!("{}: {error}", record.key));
                    continue;
                }
            };
            match self.apply_mtu(record, current, mtu).await {
                Ok(MtuChange::Unchanged) => pass.unchanged += 1,
                Ok(MtuChange::Changed { .. }) => pass.changed += 1,
                Err(error) => pass.failed.push(error),
            }
        }
        pass
    }

    /// Sets `mtu` on one attachment's interface, then records it.
    async fn apply_mtu(
        self: &Arc<Self>,
        mut record: AttachmentRecord,
        current: &BTreeMap<String, Option<u32>>,
        mtu: u32,
    ) -> Result<MtuChange, String> {
        let failed =
            |error: &dyn std::fmt::Display| format!("{} of {}: {error}", record.key, record.pod);
        let subnets = valid_subnets(&record).map_err(|e| failed(&e.msg))?;
        let parent = record
            .parent
            .clone()
            .or_else(|| subnets.first().map(|s| s.parent.clone()))
            .ok_or_else(|| failed(&"the record names no parent link"))?;
        let names: Vec<&str> = record.subnets.iter().map(|s| s.name.as_str()).collect();
        let target = MtuTarget {
            subnet: &names.join(","),
            netns: &record.netns,
            ifname: &record.key.ifname,
            parent: &parent.ifname(),
        };
        let change = self
            .config
            .attachments
            .set_mtu(&target, mtu)
            .await
            .map_err(|e| failed(&e))?;
        if change != MtuChange::Unchanged {
            crate::crash_point::crash_point("mtu-set");
        }
        let recorded = interface_mtu(&subnets).or(record.mtu);
        for subnet in &mut record.subnets {
            if let Some(now) = current.get(&subnet.name) {
                subnet.spec.mtu = *now;
            }
        }
        if recorded != Some(mtu) || change != MtuChange::Unchanged {
            self.records.save(&record).map_err(|e| failed(&e))?;
            self.desired
                .report_mtu(&record.key, &record.pod, &record.subnets, mtu)
                .await
                .map_err(|e| failed(&e))?;
            if let MtuChange::Changed { from } = change {
                tracing::info!(key = %record.key, pod = %record.pod, from, to = mtu, "pod interface MTU changed");
            }
        }
        Ok(change)
    }
}

#[cfg(test)]
mod tests {
    use flatnet_k8s::api::FlatNetworkSubnetSpec;

    use super::*;
    use crate::desired::{AttachmentKey, NamedSubnet, PodRef};

    fn record(subnet_mtus: &[Option<u32>], config_mtu: Option<u32>) -> AttachmentRecord {
        AttachmentRecord {
            key: AttachmentKey {
                container_id: "c".into(),
                ifname: "eth1".into(),
            },
            network: "flat".into(),
            netns: "/run/netns/p".into(),
            pod: PodRef::default(),
            phase: RecordPhase::Ready,
            subnets: subnet_mtus
                .iter()
                .enumerate()
                .map(|(i, mtu)| NamedSubnet {
                    name: format!("s{i}"),
                    spec: FlatNetworkSubnetSpec {
                        mtu: *mtu,
                        ..Default::default()
                    },
                    ipv6to4: false,
                })
                .collect(),
            addresses: Vec::new(),
            requested_mac: None,
            mac: None,
            mtu: config_mtu,
            uplink: None,
            host_route: None,
            primary_defaults: None,
            parent: None,
            unreported_mtu: None,
        }
    }

    #[test]
    fn the_current_subnet_mtu_wins_and_unknown_subnets_keep_the_recorded_one() {
        let current = BTreeMap::from([("s0".to_owned(), Some(1400))]);
        assert_eq!(
            wanted_mtu(&record(&[Some(9000)], None), &current),
            Some(1400)
        );
        let dual = record(&[Some(9000), Some(1300)], None);
        assert_eq!(
            wanted_mtu(&dual, &current),
            Some(1300),
            "s1 is not in current"
        );
        let unset = BTreeMap::from([("s0".to_owned(), None)]);
        assert_eq!(
            wanted_mtu(&record(&[Some(9000)], Some(1450)), &unset),
            Some(1450)
        );
        assert_eq!(
            wanted_mtu(&record(&[Some(9000)], None), &unset),
            None,
            "left alone"
        );
    }
}
