//! Floating addresses held by local pods without Kubernetes: the `floating`
//! section's `backends` name the CNI attachment (container ID and
//! interface) of a pod on this node. While this node owns such an address,
//! the loop answers and announces it with the pod interface's MAC
//! ([`Assignment::answer_as`]) and the address is on the pod interface as
//! a second address (with the prefix length of the pod's own address of
//! that family), so the pod's kernel receives the traffic; when the node
//! lets it go (ownership moved, the loop stopped) it is removed again. A
//! backend whose attachment or interface is missing or down is not
//! offered, so a node whose pod can take the address does.
//!
//! What is put on the pods is recorded ([`POD_ADDRESS_RECORD`] in the
//! state directory) before it is added: a restarted agent removes what it
//! no longer owns, even an address its state file no longer lists.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, atomic::AtomicBool},
    time::{Duration, Instant},
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, watch};

use super::{
    election::MISSED_HEARTBEATS,
    owner::{self, Assignment, Event, OwnerError, Settings},
    standalone::{FloatingBackend, FloatingSection},
};
use crate::{
    atomic_file::write_atomic,
    link::{AnnounceSettings, interface_mac, set_secondary_addresses},
    packet::MacAddr,
    records::{AttachmentRecord, RecordPhase, Records},
};

/// The record of the floating addresses put on pods, in the state
/// directory.
pub const POD_ADDRESS_RECORD: &str = "floating-pod-addresses.json";

/// How often the backends' attachments and interfaces are looked up again.
const RESOLVE_INTERVAL: Duration = Duration::from_secs(1);

/// The loop announces an acquired address ([`owner::ANNOUNCE_AT`], with
/// unicast replies); the pod's interface adds one round once it holds it.
const POD_ANNOUNCE: AnnounceSettings = AnnounceSettings {
    count: 1,
    interval: Duration::ZERO,
};

/// A floating address on a pod interface.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodAddress {
    /// The pod's network namespace.
    pub netns: PathBuf,
    /// The pod interface.
    pub ifname: String,
    /// The floating address.
    pub address: IpAddr,
    /// Its prefix length on the interface.
    pub prefix_len: u8,
}

impl PodAddress {
    fn net(&self) -> IpNet {
        IpNet::new(self.address, self.prefix_len).unwrap_or_else(|_| IpNet::from(self.address))
    }

    fn interface(&self) -> (&Path, &str) {
        (&self.netns, &self.ifname)
    }
}

/// The record file's content.
#[derive(Debug, Default, Serialize, Deserialize)]
struct RecordFile {
    held: BTreeSet<PodAddress>,
}

/// The record of the pod addresses cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Unreadable.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not a record.
    #[error(
        "{path} is not a record of floating pod addresses ({source}): check the pods' interfaces for floating addresses left on them, then remove the file"
    )]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
}

/// A backend found on this node: its pod interface and MAC.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Found {
    netns: PathBuf,
    ifname: String,
    mac: MacAddr,
    prefix_len: u8,
}

/// This node's backends, what it owns, and what the pods hold.
#[derive(Debug)]
pub struct PodBackends {
    backends: Vec<FloatingBackend>,
    /// The section's addresses: those a pod interface may carry only
    /// while this node owns them.
    floating: BTreeSet<IpAddr>,
    record_dir: PathBuf,
    record_path: PathBuf,
    found: BTreeMap<IpAddr, Found>,
    /// Why each backend not found is missing, as last logged.
    missing: BTreeMap<IpAddr, String>,
    /// Why the records could not be read, as last logged.
    records_error: Option<String>,
    owned: BTreeSet<IpAddr>,
    /// What the pods hold, as far as this node knows: the record at start.
    applied: BTreeSet<PodAddress>,
    /// Pod interfaces whose last change failed: visited again.
    failed: BTreeSet<(PathBuf, String)>,
    /// Before this, only what the loop reports changes the pods: it has
    /// not yet said whether this node still owns what the record lists.
    settled_at: Instant,
}

impl PodBackends {
    /// The backends of `section`, their attachments in the records at
    /// `record_dir`, what an earlier run put on the pods read from
    /// `state_dir`. `settle` is how long the loop takes before it claims
    /// an address ([`settle_time`]).
    ///
    /// # Errors
    /// The record of an earlier run is unreadable.
    pub fn open(
        section: &FloatingSection,
        record_dir: &Path,
        state_dir: &Path,
        settle: Duration,
    ) -> Result<Self, BackendError> {
        let record_path = state_dir.join(POD_ADDRESS_RECORD);
        let applied = match std::fs::read(&record_path) {
            Ok(bytes) => {
                serde_json::from_slice::<RecordFile>(&bytes)
                    .map_err(|source| BackendError::Parse {
                        path: record_path.clone(),
                        source,
                    })?
                    .held
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => BTreeSet::new(),
            Err(source) => {
                return Err(BackendError::Read {
                    path: record_path,
                    source,
                });
            }
        };
        Ok(Self {
            backends: section.backends.clone(),
            floating: section.addresses.iter().copied().collect(),
            record_dir: record_dir.to_owned(),
            record_path,
            found: BTreeMap::new(),
            missing: BTreeMap::new(),
            records_error: None,
            owned: BTreeSet::new(),
            applied,
            failed: BTreeSet::new(),
            settled_at: Instant::now() + settle,
        })
    }

    /// Looks every backend up (its attachment record, its interface up) and
    /// returns what the loop serves: `base` without the addresses whose
    /// backend is missing here, the others answered with their pod's MAC.
    pub async fn resolve(&mut self, base: &Assignment) -> Assignment {
        match Records::read(&self.record_dir) {
            Ok(records) => {
                for backend in &self.backends {
                    match find(&records, backend).await {
                        Ok(found) => {
                            if self.missing.remove(&backend.address).is_some() {
                                tracing::info!(address = %backend.address, container = %backend.container_id, ifname = %backend.ifname, "floating address: its backend pod is here; offering it");
                            }
                            self.found.insert(backend.address, found);
                        }
                        Err(reason) => {
                            self.found.remove(&backend.address);
                            if self.missing.get(&backend.address) != Some(&reason) {
                                tracing::warn!(address = %backend.address, "floating address not offered: {reason}");
                                self.missing.insert(backend.address, reason);
                            }
                        }
                    }
                }
            }
            // Kept as they were: a passing read failure moves nothing.
            Err(error) => {
                let error = error.to_string();
                if self.records_error.as_ref() != Some(&error) {
                    tracing::warn!(%error, "floating backends: cannot read the attachment records; the backends stay as they were");
                    self.records_error = Some(error);
                }
                return self.serving(base);
            }
        }
        self.records_error = None;
        self.serving(base)
    }

    /// `base` with the backends found: answered with their pod's MAC, the
    /// others left out.
    fn serving(&self, base: &Assignment) -> Assignment {
        let mut assignment = base.clone();
        for backend in &self.backends {
            match self.found.get(&backend.address) {
                Some(found) => {
                    assignment.answer_as.insert(backend.address, found.mac);
                }
                None => {
                    assignment.addresses.remove(&backend.address);
                }
            }
        }
        assignment
    }

    /// Follows what the loop owns and makes the pods hold it.
    pub async fn observe(&mut self, event: &Event) {
        match event {
            Event::Acquired { addr, .. } => self.owned.insert(*addr),
            Event::Released { addr } => self.owned.remove(addr),
            _ => return,
        };
        self.apply().await;
    }

    /// Removes every floating address from the pods (the loop stopped).
    pub async fn withdraw(&mut self) {
        self.owned.clear();
        self.apply().await;
    }

    /// [`Self::apply`] once the loop has settled.
    async fn apply_settled(&mut self) {
        if Instant::now() >= self.settled_at {
            self.apply().await;
        }
    }

    /// Makes each pod interface hold exactly the owned addresses it backs:
    /// records what will be added first, then adds (and announces) and
    /// removes. An interface that cannot be changed is tried again at the
    /// next call; one whose namespace is gone holds nothing.
    async fn apply(&mut self) {
        let wanted: BTreeSet<PodAddress> = self
            .owned
            .iter()
            .filter_map(|addr| {
                let found = self.found.get(addr)?;
                Some(PodAddress {
                    netns: found.netns.clone(),
                    ifname: found.ifname.clone(),
                    address: *addr,
                    prefix_len: found.prefix_len,
                })
            })
            .collect();
        if wanted == self.applied && self.failed.is_empty() {
            return;
        }
        let recorded: BTreeSet<PodAddress> = self.applied.union(&wanted).cloned().collect();
        self.record(&recorded);
        let interfaces: BTreeSet<(&Path, &str)> =
            recorded.iter().map(PodAddress::interface).collect();
        self.failed
            .retain(|(netns, ifname)| interfaces.contains(&(netns.as_path(), ifname.as_str())));
        let mut now_applied = BTreeSet::new();
        for (netns, ifname) in interfaces {
            let on = |set: &BTreeSet<PodAddress>| -> BTreeSet<PodAddress> {
                set.iter()
                    .filter(|p| p.interface() == (netns, ifname))
                    .cloned()
                    .collect()
            };
            let (want, had) = (on(&wanted), on(&self.applied));
            let key = (netns.to_owned(), ifname.to_owned());
            if want == had && !self.failed.contains(&key) {
                now_applied.extend(want);
                continue;
            }
            let nets: Vec<IpNet> = want.iter().map(PodAddress::net).collect();
            let managed = |addr: IpAddr| {
                self.floating.contains(&addr) || had.iter().any(|p| p.address == addr)
            };
            match set_secondary_addresses(netns, ifname, &nets, managed, POD_ANNOUNCE, false).await
            {
                Ok(change) => {
                    for net in &change.added {
                        tracing::info!(address = %net, netns = %netns.display(), %ifname, "floating address added to the backend pod");
                    }
                    for net in &change.removed {
                        tracing::info!(address = %net, netns = %netns.display(), %ifname, "floating address removed from the pod");
                    }
                    now_applied.extend(want);
                    self.failed.remove(&key);
                }
                Err(_) if !crate::netns::netns_path_exists(netns) => {
                    now_applied.extend(want);
                    self.failed.remove(&key);
                }
                Err(error) => {
                    tracing::warn!(netns = %netns.display(), %ifname, %error, "floating addresses: cannot update the pod interface; trying again");
                    now_applied.extend(had.union(&want).cloned());
                    self.failed.insert(key);
                }
            }
        }
        self.applied = now_applied;
        self.record(&self.applied.clone());
    }

    /// Writes the record; a failure is logged (the pods are served all
    /// the same).
    fn record(&self, held: &BTreeSet<PodAddress>) {
        let file = RecordFile { held: held.clone() };
        let bytes = serde_json::to_vec_pretty(&file).unwrap_or_default();
        if std::fs::read(&self.record_path).ok().as_deref() == Some(&bytes[..]) {
            return;
        }
        if let Err(error) = write_atomic(&self.record_path, &bytes) {
            tracing::warn!(path = %self.record_path.display(), %error, "cannot record the floating pod addresses; a restart may not remove them");
        }
    }
}

/// The pod interface of `backend` among `records`, or why it is missing.
async fn find(records: &[AttachmentRecord], backend: &FloatingBackend) -> Result<Found, String> {
    let record = records
        .iter()
        .find(|r| r.key.container_id == backend.container_id && r.key.ifname == backend.ifname)
        .ok_or_else(|| {
            format!(
                "the agent has no attachment of container {} interface {} on this node: name the CNI_CONTAINERID and CNI_IFNAME of the pod's ADD (attached: {})",
                backend.container_id,
                backend.ifname,
                attached(records)
            )
        })?;
    if record.phase != RecordPhase::Ready {
        return Err(format!(
            "the attachment of container {} interface {} is not ready yet",
            backend.container_id, backend.ifname
        ));
    }
    let host = if backend.address.is_ipv4() { 32 } else { 128 };
    let prefix_len = record
        .addresses
        .iter()
        .find(|own| own.addr().is_ipv4() == backend.address.is_ipv4())
        .map_or(host, IpNet::prefix_len);
    let mac = interface_mac(&record.netns, &backend.ifname)
        .await
        .map_err(|error| error.to_string())?
        .ok_or_else(|| {
            format!(
                "interface {} of container {} is down",
                backend.ifname, backend.container_id
            )
        })?;
    Ok(Found {
        netns: record.netns.clone(),
        ifname: backend.ifname.clone(),
        mac,
        prefix_len,
    })
}

/// The attachments the agent made, as `container/ifname` (at most ten).
fn attached(records: &[AttachmentRecord]) -> String {
    let mut keys: Vec<String> = records
        .iter()
        .take(10)
        .map(|r| format!("{}/{}", r.key.container_id, r.key.ifname))
        .collect();
    if records.len() > keys.len() {
        keys.push("...".into());
    }
    if keys.is_empty() {
        "none".into()
    } else {
        keys.join(", ")
    }
}

/// How long the loop of `settings` offers an address before it claims it:
/// until then an address recorded on a pod may still be this node's.
pub fn settle_time(settings: &Settings) -> Duration {
    settings.interval * (MISSED_HEARTBEATS + 1)
}

/// Runs the loop of `settings` ([`owner::run`], in the calling thread's
/// network namespace, which must not be a thread of `runtime`) serving
/// `base` with the backends of `pods`, until `stop` is set; then removes
/// the floating addresses from the pods. Every event of the loop also goes
/// to `on_event`.
///
/// # Errors
/// The loop's.
pub fn serve(
    runtime: &tokio::runtime::Handle,
    settings: &Settings,
    base: Assignment,
    pods: PodBackends,
    stop: &AtomicBool,
    mut on_event: impl FnMut(&Event),
) -> Result<(), OwnerError> {
    let pods = Arc::new(Mutex::new(pods));
    let first = runtime.block_on(async { pods.lock().await.resolve(&base).await });
    let (serving, assignment) = watch::channel(first);
    let follow = runtime.spawn({
        let pods = Arc::clone(&pods);
        async move {
            loop {
                tokio::time::sleep(RESOLVE_INTERVAL).await;
                let mut pods = pods.lock().await;
                let now = pods.resolve(&base).await;
                serving.send_if_modified(|current| {
                    let modified = *current != now;
                    *current = now;
                    modified
                });
                pods.apply_settled().await;
            }
        }
    });
    let result = owner::run(settings, &assignment, stop, |event| {
        runtime.block_on(async { pods.lock().await.observe(&event).await });
        on_event(&event);
    });
    follow.abort();
    runtime.block_on(async { pods.lock().await.withdraw().await });
    result
}
