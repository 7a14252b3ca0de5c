//! The MTU of running pods' primary interface (`eth0`) and of its
//! node-side peer, as the desired state asks (`PodNetworkConfig`
//! `spec.primary.mtu`, the standalone entries' `primary.mtu`), with the
//! TCP MSS clamping programs on `eth0` where `primary.tcpMssClamp` asks,
//! and all set back (programs taken off) when nothing asks any more.
//!
//! Before the first change of a pod the agent remembers what the
//! interfaces had in [`LEDGER_FILE`] under the lease directory (tmpfs, like
//! the pods and interfaces it describes, so a reboot forgets both
//! together). Each pass sets back, from that file, every pod no longer
//! asked for, then sets what is asked: an agent killed at any point finds
//! the original values and the wanted ones at its next pass. A pod whose
//! namespace is gone needs nothing set back.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::{AgentService, follow::PassReport};
use crate::{
    desired::{DesiredState, PRIMARY_IFNAME, PodRef, PrimaryMtu},
    link::{LinkError, PrimaryLinks},
};

/// The file in the lease directory holding what the pods' primary
/// interfaces had before the agent changed them.
pub const LEDGER_FILE: &str = "primary-mtu.json";

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrimaryMtuPass {
    /// Pods whose MTU was set now.
    pub changed: usize,
    /// Pods set back to their original MTU.
    pub restored: usize,
    /// What failed, with why.
    pub failed: Vec<String>,
}

/// What a pod's primary interface and its peer had before the first
/// change, and where the pod is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Remembered {
    /// The pod's network namespace.
    pub netns: PathBuf,
    /// The pod, for messages.
    #[serde(default)]
    pub pod: PodRef,
    /// The MTUs as they were.
    pub original: PrimaryLinks,
    /// Whether the TCP MSS clamping programs were put (or were being put)
    /// onto the primary interface: they are taken off when no longer asked
    /// for, also by an agent restarted meanwhile.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mss_clamp: bool,
}

/// [`PrimaryMtu::name`] → what was there before.
pub type Ledger = BTreeMap<String, Remembered>;

/// Reads the ledger at `path`; a missing file is an empty ledger.
pub fn read_ledger(path: &Path) -> Result<Ledger, String> {
    crate::atomic_file::read_json_or_default(path)
}

fn write_ledger(path: &Path, ledger: &Ledger) -> Result<(), String> {
    crate::atomic_file::write_json(path, ledger)
}

/// Records on disk whether the clamping programs may be on `name`'s eth0.
fn record_mss_clamp(path: &Path, ledger: &mut Ledger, name: &str, on: bool) -> Result<(), String> {
    if let Some(remembered) = ledger.get_mut(name) {
        remembered.mss_clamp = on;
    }
    write_ledger(path, ledger)
}

impl<S: DesiredState> AgentService<S> {
    /// Follows the wanted primary MTUs for the agent's lifetime
    /// ([`follow`](super::follow::follow)).
    pub async fn follow_primary_mtus(&self, interval: std::time::Duration) {
        super::follow::follow(
            interval,
            "setting a running pod's primary MTU",
            || self.inner.desired.primary_mtus(),
            |wanted: Vec<PrimaryMtu>| async move { self.apply_primary_mtus(&wanted).await },
        )
        .await;
    }

    fn ledger_path(&self) -> PathBuf {
        self.inner.config.attachments.lease_dir.join(LEDGER_FILE)
    }

    /// One pass: sets back the pods no longer asked for (or whose
    /// namespace changed), then sets what `wanted` asks, remembering each
    /// pod's original MTUs before its first change.
    pub async fn apply_primary_mtus(&self, wanted: &[PrimaryMtu]) -> PrimaryMtuPass {
        let mut pass = PrimaryMtuPass::default();
        let path = self.ledger_path();
        let (records, mut ledger) = match (self.inner.records.all(), read_ledger(&path)) {
            (Ok(records), Ok(ledger)) => (records, ledger),
            (Err(error), _) => {
                pass.failed
                    .push(format!("cannot read the records: {error}"));
                return pass;
            }
            (_, Err(error)) => {
                pass.failed.push(error);
                return pass;
            }
        };
        let mut resolved: BTreeMap<&str, (&PrimaryMtu, PathBuf)> = BTreeMap::new();
        let mut unresolved = Vec::new();
        for want in wanted {
            match self
                .netns_of(want.netns.as_ref(), &want.pod, &records)
                .await
            {
                Ok(netns) => {
                    resolved.insert(want.name.as_str(), (want, netns));
                }
                Err(why) => unresolved.push((want, why)),
            }
        }
        let stale: Vec<String> = ledger
            .iter()
            .filter(|(name, remembered)| {
                resolved
                    .get(name.as_str())
                    .is_none_or(|(_, netns)| *netns != remembered.netns)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale {
            let remembered = &ledger[&name];
            match self.restore(remembered).await {
                Ok(changed) => {
                    if changed {
                        pass.restored += 1;
                        tracing::info!(pod = %remembered.pod, mtu = remembered.original.mtu, "primary MTU set back");
                    }
                    ledger.remove(&name);
                    if let Err(error) = write_ledger(&path, &ledger) {
                        pass.failed.push(error);
                        return pass;
                    }
                }
                Err(error) => pass.failed.push(format!(
                    "setting back the primary MTU of {}: {error}",
                    remembered.pod
                )),
            }
        }
        let mut results = Vec::new();
        for (want, why) in unresolved {
            pass.failed
                .push(format!("primary MTU of {}: {why}", want.pod));
            results.push((want.clone(), Some(why)));
        }
        for (name, (want, netns)) in resolved {
            let outcome = self
                .set_primary(&path, &mut ledger, name, want, netns)
                .await;
            match outcome {
                Ok(changed) => {
                    if changed {
                        pass.changed += 1;
                        tracing::info!(pod = %want.pod, mtu = want.mtu, "primary MTU set");
                    }
                    results.push((want.clone(), None));
                }
                Err(why) => {
                    pass.failed
                        .push(format!("primary MTU of {}: {why}", want.pod));
                    results.push((want.clone(), Some(why)));
                }
            }
        }
        // A report that cannot be written fails the pass, so it is retried.
        if let Err(error) = self.inner.desired.report_primary_mtus(&results).await {
            pass.failed
                .push(format!("reporting the primary MTUs: {error}"));
        }
        pass
    }

    /// Remembers `want`'s pod's original MTUs (when not yet), then sets
    /// the wanted one on its primary interface and peer.
    async fn set_primary(
        &self,
        path: &Path,
        ledger: &mut Ledger,
        name: &str,
        want: &PrimaryMtu,
        netns: PathBuf,
    ) -> Result<bool, String> {
        let attachments = &self.inner.config.attachments;
        let original = match ledger.get(name) {
            Some(remembered) => remembered.original.clone(),
            None => {
                let original = attachments
                    .primary_links(&netns, PRIMARY_IFNAME)
                    .await
                    .map_err(|e| e.to_string())?;
                ledger.insert(
                    name.to_owned(),
                    Remembered {
                        netns: netns.clone(),
                        pod: want.pod.clone(),
                        original: original.clone(),
                        mss_clamp: false,
                    },
                );
                write_ledger(path, ledger)?;
                original
            }
        };
        let clamped = ledger.get(name).is_some_and(|r| r.mss_clamp);
        if want.tcp_mss_clamp && !clamped {
            // Recorded first: an agent killed while attaching still knows
            // to take the programs off later.
            record_mss_clamp(path, ledger, name, true)?;
        }
        let changed = attachments
            .set_primary_mtu(
                &netns,
                PRIMARY_IFNAME,
                want.mtu,
                original.peer.as_ref().map(|peer| (peer, want.mtu)),
            )
            .await
            .map_err(|e| e.to_string())?;
        if want.tcp_mss_clamp {
            // Every pass: a restarted or upgraded agent swaps in its programs.
            self.inner
                .set_mss_clamp(netns, PRIMARY_IFNAME, true)
                .await?;
            if !clamped {
                tracing::info!(pod = %want.pod, mtu = want.mtu, "TCP MSS clamping attached to eth0");
            }
        } else if clamped {
            self.inner
                .set_mss_clamp(netns, PRIMARY_IFNAME, false)
                .await?;
            // Recorded last, for the same reason.
            record_mss_clamp(path, ledger, name, false)?;
            tracing::info!(pod = %want.pod, "TCP MSS clamping removed from eth0");
        }
        Ok(changed)
    }

    /// Sets a pod's primary interface and peer back to what they had; a
    /// pod (or interface) that is gone needs nothing.
    async fn restore(&self, remembered: &Remembered) -> Result<bool, String> {
        if !crate::netns::is_netns(&remembered.netns) {
            return Ok(false);
        }
        if remembered.mss_clamp {
            self.inner
                .set_mss_clamp(remembered.netns.clone(), PRIMARY_IFNAME, false)
                .await?;
        }
        let original = &remembered.original;
        let result = self
            .inner
            .config
            .attachments
            .set_primary_mtu(
                &remembered.netns,
                PRIMARY_IFNAME,
                original.mtu,
                original.peer.as_ref().map(|peer| (peer, peer.mtu)),
            )
            .await;
        match result {
            Err(LinkError::NotFound { .. }) => Ok(false),
            other => other.map_err(|e| e.to_string()),
        }
    }
}

impl PassReport for PrimaryMtuPass {
    fn failures(&self) -> &[String] {
        &self.failed
    }

    fn log_changes(&self) {
        if self.changed > 0 || self.restored > 0 {
            tracing::info!(
                changed = self.changed,
                restored = self.restored,
                "primary MTUs of running pods applied"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::PeerLink;

    #[test]
    fn the_ledger_round_trips_and_a_missing_file_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases").join(LEDGER_FILE);
        assert_eq!(read_ledger(&path).unwrap(), Ledger::new());
        let ledger = Ledger::from([(
            "uid-1".to_owned(),
            Remembered {
                netns: "/run/netns/web-0".into(),
                pod: PodRef {
                    namespace: Some("shop".into()),
                    name: Some("web-0".into()),
                    uid: Some("uid-1".into()),
                },
                original: PrimaryLinks {
                    mtu: 1500,
                    peer: Some(PeerLink {
                        index: 7,
                        name: "veth1".into(),
                        mtu: 1500,
                    }),
                },
                mss_clamp: true,
            },
        )]);
        write_ledger(&path, &ledger).unwrap();
        assert_eq!(read_ledger(&path).unwrap(), ledger);
        std::fs::write(&path, b"{").unwrap();
        let error = read_ledger(&path).unwrap_err();
        assert!(error.contains("is not a valid ledger"), "{error}");
    }
}
