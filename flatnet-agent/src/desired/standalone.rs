//! Standalone desired state: subnets and network mappings from a YAML state
//! file, addresses from a local pool persisted in an allocation file.
//!
//! The allocation file is replaced atomically after every change (one
//! write for the changes of concurrent calls) and guarded
//! by an exclusive `flock` held for the agent's lifetime, so two agents can
//! never hand out addresses from the same file.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use flatnet_k8s::{
    ipam::{DEFAULT_WIRE_WINDOW, Family, LiveAddresses, LiveClaim, Pool},
    validation::{MAX_MTU, MIN_MTU_IPV4, ValidSubnet, check_siblings},
};
use ipnet::IpNet;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use super::{
    AttachmentKey, ClaimRequest, DesiredInterface, DesiredState, DesiredStateError,
    HotplugAttachment, NamedSubnet, PodRef, PrimaryMtu, status::SubnetCapacity,
};
use prometheus_client::metrics::gauge::Gauge;

use crate::{
    atomic_file::{write_atomic, write_atomic_unsynced},
    datapath::Conflict,
    records::AttachmentRecord,
};

/// The state file: subnets, and which CNI networks use them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    /// Subnets, in the FlatNetworkSubnet spec format.
    #[serde(default)]
    pub subnets: Vec<NamedSubnet>,
    /// CNI network names mapped to one subnet, or two (IPv4 and IPv6) for
    /// dual stack.
    #[serde(default)]
    pub networks: Vec<NetworkMapping>,
    /// MultiNetworkPolicies enforced on the pods (reloaded on change, see
    /// `policy_controller::standalone`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<crate::policy_compiler::MultiNetworkPolicy>,
    /// Namespace name → labels, for namespace selectors.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub namespaces: BTreeMap<String, crate::policy_compiler::selector::Labels>,
    /// `namespace/name` of a pod (`K8S_POD_NAMESPACE`/`K8S_POD_NAME`) →
    /// its labels, for pod selectors.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pods: BTreeMap<String, crate::policy_compiler::selector::Labels>,
    /// Floating addresses this node can serve and its peers, run by
    /// `flatnet-agent floating` (not reloaded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floating: Option<crate::floating::standalone::FloatingSection>,
    /// Extra flat interfaces hot-plugged into running pods, named by their
    /// network namespace (see `docs/runtime-config.md`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hotplug: Vec<HotplugEntry>,
    /// VLAN sub-interfaces `<master>.<id>` the node must have (see
    /// `docs/runtime-config.md`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vlans: Vec<flatnet_k8s::api::NodeVlan>,
    /// Linux bridges the node must have, with their ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bridges: Vec<flatnet_k8s::api::NodeBridge>,
}

/// Extra interfaces for one running pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugEntry {
    /// Unique name of the entry (letters, digits, `_`, `.`, `-`).
    pub name: String,
    /// The pod's network namespace file, e.g. `/run/netns/web-0`.
    pub netns: PathBuf,
    /// `namespace/name` of the pod, for policy selectors and messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The interfaces.
    #[serde(default)]
    pub attachments: Vec<HotplugInterface>,
    /// Settings of the pod's primary interface (`eth0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<PrimarySection>,
}

/// Settings of a running pod's primary interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrimarySection {
    /// MTU of `eth0` and of its node-side peer (a veth's).
    pub mtu: u32,
    /// Clamp the MSS of TCP SYNs through `eth0`, both ways, to what `mtu`
    /// leaves for payload (as `PodNetworkConfig`'s `primary.tcpMssClamp`).
    #[serde(
        default,
        rename = "tcpMssClamp",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub tcp_mss_clamp: bool,
}

/// One hot-plugged interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugInterface {
    /// A network of the `networks` section.
    pub network: String,
    /// The interface name in the pod, e.g. `net1`.
    pub ifname: String,
}

/// A CNI network (the `name` of a network configuration) and its subnets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkMapping {
    /// The network configuration's `name`.
    pub name: String,
    /// Subnet names: one, or one IPv4 and one IPv6 on the same parent link.
    pub subnets: Vec<String>,
}

/// The state file is unusable; the message names the entry and the fix.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// The file cannot be read.
    #[error("cannot read the state file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid YAML of the expected shape.
    #[error("state file {path} is not valid: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_yaml::Error,
    },
    /// The file holds nothing: most often an editor or `>` caught between
    /// truncating it and writing it, never taken as "no subnets".
    #[error(
        "state file {path} is empty; an empty file is taken as a write in progress. To serve no subnets, write `subnets: []`"
    )]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// Entries break the rules.
    #[error("state file {path}: {}", problems.join("; "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found.
        problems: Vec<String>,
    },
}

/// A state file that passed validation.
#[derive(Clone, Debug)]
pub struct ValidState {
    subnets: BTreeMap<String, (NamedSubnet, ValidSubnet)>,
    networks: BTreeMap<String, Vec<String>>,
    hotplug: Vec<HotplugAttachment>,
    primary_mtus: Vec<PrimaryMtu>,
    node_links: crate::link::NodeLinks,
}

fn read_text(path: &Path) -> Result<String, StateFileError> {
    std::fs::read_to_string(path).map_err(|source| StateFileError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Name of the copy of the last state file that validated, inside the
/// state directory.
pub const LAST_GOOD_STATE_FILE: &str = "state.last-good.yaml";

/// A state file with the text it was read from.
#[derive(Clone, Debug)]
pub struct LoadedState {
    /// The file's text.
    pub text: String,
    /// Its validated content.
    pub state: ValidState,
}

/// The state file the agent follows, and the copy of the last version of
/// it that validated: a rejected edit left on disk does not stop the next
/// start, which runs from the copy instead, loudly.
#[derive(Debug)]
pub struct StateSource {
    path: PathBuf,
    last_good: PathBuf,
    /// 1 while the file on disk is rejected and an older version is in force.
    rejected: Gauge,
    /// The text last rejected, so each rejection is logged once.
    last_rejected: std::sync::Mutex<Option<String>>,
    /// The version of the file [`Self::reload`] read last: an unchanged
    /// file is not read again (every ADD asks).
    read_version: std::sync::Mutex<Option<FileVersion>>,
}

/// One version of a file, told apart without reading it: a write changes
/// the change time (which nobody can set back), a replacement the inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileVersion {
    dev: u64,
    inode: u64,
    len: u64,
    changed: (i64, i64),
    modified: (i64, i64),
}

/// A file changed this recently may change again within the same tick of
/// a coarse file-system clock, keeping its stamp: it is read every time
/// until it is older (as git does with its index).
const SETTLED_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

impl FileVersion {
    /// The version of `path` when it has settled; `None` when it cannot be
    /// examined or changed less than [`SETTLED_AFTER`] ago.
    fn settled(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok()?;
        let age = meta
            .modified()
            .ok()
            .and_then(|at| at.elapsed().ok())
            .unwrap_or_default();
        let settled = age >= SETTLED_AFTER
            && std::time::UNIX_EPOCH
                .checked_add(std::time::Duration::new(
                    u64::try_from(meta.ctime()).ok()?,
                    u32::try_from(meta.ctime_nsec()).ok()?,
                ))
                .and_then(|at| at.elapsed().ok())
                .is_some_and(|age| age >= SETTLED_AFTER);
        settled.then(|| Self {
            dev: meta.dev(),
            inode: meta.ino(),
            len: meta.size(),
            changed: (meta.ctime(), meta.ctime_nsec()),
            modified: (meta.mtime(), meta.mtime_nsec()),
        })
    }
}

impl StateSource {
    /// The state file at `path`; its last good copy lives in `state_dir`.
    pub fn new(path: &Path, state_dir: &Path, rejected: Gauge) -> Self {
        Self {
            path: path.to_owned(),
            last_good: state_dir.join(LAST_GOOD_STATE_FILE),
            rejected,
            last_rejected: std::sync::Mutex::new(None),
            read_version: std::sync::Mutex::new(None),
        }
    }

    /// The state file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state to start from: the file's; when the file is rejected, the
    /// last good copy's (an error is logged and `rejected` set). Without a
    /// usable copy, the file's error.
    pub fn load_at_start(&self) -> Result<LoadedState, StateFileError> {
        let error = match Self::load(&self.path) {
            Ok(loaded) => {
                self.accepted(&loaded);
                return Ok(loaded);
            }
            Err(error) => error,
        };
        match Self::load(&self.last_good) {
            Ok(loaded) => {
                tracing::error!(
                    %error,
                    last_good = %self.last_good.display(),
                    "the state file is rejected; starting from its last good copy. Fix the file: the agent applies it once it validates"
                );
                self.rejected.set(1);
                *self.last_rejected.lock().expect("state source lock") = read_text(&self.path).ok();
                Ok(loaded)
            }
            Err(_) => Err(error),
        }
    }

    /// The file again, when its text differs from `current`'s: `Some` when
    /// it validates (it becomes the last good copy), `None` when it is
    /// unchanged or rejected (logged once, `rejected` set). A file whose
    /// version is the one read last is not read again.
    pub fn reload(&self, current: &str) -> Option<LoadedState> {
        // Taken before reading: a write in between makes the next call read again.
        let version = FileVersion::settled(&self.path);
        {
            let mut read = self.read_version.lock().expect("state source lock");
            if version.is_some() && *read == version {
                return None;
            }
            *read = version;
        }
        let text = match read_text(&self.path) {
            Ok(text) => text,
            Err(error) => {
                self.reject(&error, String::new());
                return None;
            }
        };
        if text == current {
            self.rejected.set(0);
            return None;
        }
        match StateFile::load_text(&self.path, &text) {
            Ok(state) => {
                let loaded = LoadedState { text, state };
                self.accepted(&loaded);
                Some(loaded)
            }
            Err(error) => {
                self.reject(&error, text);
                None
            }
        }
    }

    fn load(path: &Path) -> Result<LoadedState, StateFileError> {
        let text = read_text(path)?;
        let state = StateFile::load_text(path, &text)?;
        Ok(LoadedState { text, state })
    }

    fn accepted(&self, loaded: &LoadedState) {
        self.rejected.set(0);
        *self.last_rejected.lock().expect("state source lock") = None;
        if let Err(error) = write_atomic(&self.last_good, loaded.text.as_bytes()) {
            tracing::warn!(%error, path = %self.last_good.display(), "cannot keep a copy of the state file");
        }
    }

    fn reject(&self, error: &dyn std::fmt::Display, text: String) {
        self.rejected.set(1);
        let mut last = self.last_rejected.lock().expect("state source lock");
        if last.as_ref() != Some(&text) {
            tracing::error!(%error, "the state file edit is rejected; the subnets and networks in force stay");
            *last = Some(text);
        }
    }
}

impl StateFile {
    /// Reads and validates a state file.
    pub fn load(path: &Path) -> Result<ValidState, StateFileError> {
        Self::load_text(path, &read_text(path)?)
    }

    /// Reads and parses a state file, without validating it.
    pub fn read(path: &Path) -> Result<StateFile, StateFileError> {
        Self::parse(path, &read_text(path)?)
    }

    /// Parses the text of the state file at `path`, without validating it.
    pub fn parse(path: &Path, text: &str) -> Result<StateFile, StateFileError> {
        serde_yaml::from_str(text).map_err(|source| StateFileError::Parse {
            path: path.to_owned(),
            source,
        })
    }

    /// Parses and validates the text of the state file at `path`.
    fn load_text(path: &Path, text: &str) -> Result<ValidState, StateFileError> {
        if text.trim().is_empty() {
            return Err(StateFileError::Empty {
                path: path.to_owned(),
            });
        }
        Self::parse(path, text)?
            .validate()
            .map_err(|problems| StateFileError::Invalid {
                path: path.to_owned(),
                problems,
            })
    }

    /// Checks every subnet with `validate_subnet`, subnets sharing a parent
    /// link against each other, and every network mapping.
    pub fn validate(&self) -> Result<ValidState, Vec<String>> {
        let mut problems = Vec::new();
        let mut subnets = BTreeMap::new();
        for subnet in &self.subnets {
            match subnet.validate() {
                Ok(valid) => {
                    if subnets
                        .insert(subnet.name.clone(), (subnet.clone(), valid))
                        .is_some()
                    {
                        problems.push(format!(
                            "subnet {} is defined twice; give each subnet a unique name",
                            subnet.name
                        ));
                    }
                }
                Err(invalid) => problems.push(invalid.to_string()),
            }
        }
        let valid: Vec<&ValidSubnet> = subnets.values().map(|(_, v)| v).collect();
        for subnet in &valid {
            if let Err(conflicts) = check_siblings(subnet, valid.iter().copied()) {
                problems.push(conflicts.to_string());
            }
        }
        let mut networks = BTreeMap::new();
        for network in &self.networks {
            match check_network(network, &subnets) {
                Ok(()) => {
                    if networks
                        .insert(network.name.clone(), network.subnets.clone())
                        .is_some()
                    {
                        problems.push(format!(
                            "network {} is mapped twice; keep one entry",
                            network.name
                        ));
                    }
                }
                Err(problem) => problems.push(problem),
            }
        }
        let (hotplug, primary_mtus) = check_hotplug(&self.hotplug, &networks, &mut problems);
        if let Some(floating) = &self.floating {
            problems.extend(floating.problems());
        }
        // The same checks as a PodNetworkConfig's, named by this file's fields.
        let links = flatnet_k8s::api::PodNetworkConfigSpec {
            vlans: self.vlans.clone(),
            bridges: self.bridges.clone(),
            ..Default::default()
        };
        problems.extend(
            links
                .problems()
                .into_iter()
                .map(|p| p.strip_prefix("spec.").unwrap_or(&p).to_owned()),
        );
        if problems.is_empty() {
            Ok(ValidState {
                subnets,
                networks,
                hotplug,
                primary_mtus,
                node_links: super::node_links_of(&self.vlans, &self.bridges),
            })
        } else {
            Err(problems)
        }
    }
}

/// Checks the `hotplug` entries: valid names, known networks, one
/// interface name per pod, primary MTUs in range, and turns them into
/// attachments and primary MTUs.
fn check_hotplug(
    entries: &[HotplugEntry],
    networks: &BTreeMap<String, Vec<String>>,
    problems: &mut Vec<String>,
) -> (Vec<HotplugAttachment>, Vec<PrimaryMtu>) {
    let mut attachments = Vec::new();
    let mut primary_mtus = Vec::new();
    let mut seen = BTreeSet::new();
    for entry in entries {
        let name = &entry.name;
        if !crate::cni::names::is_cni_identifier(name) {
            problems.push(format!(
                "hotplug entry {name:?}: the name must start with a letter or digit and contain only letters, digits, '_', '.' and '-'"
            ));
            continue;
        }
        let pod = match entry.pod.as_deref().map(|p| p.split_once('/')) {
            None => PodRef::default(),
            Some(Some((namespace, pod))) if !namespace.is_empty() && !pod.is_empty() => PodRef {
                namespace: Some(namespace.to_owned()),
                name: Some(pod.to_owned()),
                uid: None,
            },
            Some(_) => {
                problems.push(format!(
                    "hotplug entry {name}: pod must be written namespace/name"
                ));
                continue;
            }
        };
        if let Some(PrimarySection { mtu, tcp_mss_clamp }) = entry.primary {
            if (MIN_MTU_IPV4..=MAX_MTU).contains(&mtu) {
                primary_mtus.push(PrimaryMtu {
                    name: name.clone(),
                    netns: Some(entry.netns.clone()),
                    pod: pod.clone(),
                    mtu,
                    tcp_mss_clamp,
                });
            } else {
                problems.push(format!(
                    "hotplug entry {name}: primary.mtu {mtu} is out of range: use {MIN_MTU_IPV4}..{MAX_MTU}"
                ));
            }
        }
        for interface in &entry.attachments {
            let ifname = &interface.ifname;
            if let Err(reason) = flatnet_k8s::validation::check_ifname(ifname) {
                problems.push(format!("hotplug entry {name}: ifname {reason}"));
            } else if !networks.contains_key(&interface.network) {
                problems.push(format!(
                    "hotplug entry {name}: network {} is not in the networks section; map it first",
                    interface.network
                ));
            } else if !seen.insert((entry.netns.clone(), ifname.clone())) {
                problems.push(format!(
                    "hotplug entry {name}: {ifname} in {} is asked for twice; keep one",
                    entry.netns.display()
                ));
            } else {
                attachments.push(HotplugAttachment {
                    name: name.clone(),
                    netns: Some(entry.netns.clone()),
                    pod: pod.clone(),
                    network: interface.network.clone(),
                    ifname: ifname.clone(),
                });
            }
        }
    }
    if let Some(twice) = primary_mtus
        .iter()
        .enumerate()
        .find(|(i, p)| primary_mtus[..*i].iter().any(|q| q.netns == p.netns))
        .map(|(_, p)| p)
    {
        problems.push(format!(
            "hotplug entry {}: primary.mtu of {} is set by two entries; keep one",
            twice.name,
            twice.netns.as_deref().unwrap_or(Path::new("")).display()
        ));
    }
    (attachments, primary_mtus)
}

/// Checks that a network names one subnet, or an IPv4 and an IPv6 subnet
/// that can share one interface (same parent link and link mode).
fn check_network(
    network: &NetworkMapping,
    subnets: &BTreeMap<String, (NamedSubnet, ValidSubnet)>,
) -> Result<(), String> {
    let name = &network.name;
    let found = network
        .subnets
        .iter()
        .map(|s| {
            subnets.get(s).map(|(_, v)| v).ok_or_else(|| {
                format!(
                    "network {name} uses subnet {s}, which is not defined; add it under `subnets`"
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    combine_subnets(name, &found)
}

/// Checks that `subnets` can share one pod interface: one or two of them,
/// of different families, on the same parent link with the same mode.
pub fn combine_subnets(network: &str, subnets: &[&ValidSubnet]) -> Result<(), String> {
    match subnets {
        [_] => Ok(()),
        [a, b] if a.cidr.family() == b.cidr.family() => Err(format!(
            "network {network}: subnets {} and {} are both {}; dual stack needs one IPv4 and one IPv6 subnet",
            a.name,
            b.name,
            a.cidr.family()
        )),
        [a, b] if a.parent != b.parent || a.link_mode != b.link_mode => Err(format!(
            "network {network}: subnets {} and {} must use the same master, VLAN, flatMode and mode to share one interface",
            a.name, b.name
        )),
        [_, _] => Ok(()),
        _ => Err(format!(
            "network {network} must name one subnet, or one IPv4 and one IPv6 subnet"
        )),
    }
}

impl ValidState {
    /// The subnet names of a request: the configuration's `subnet` field
    /// (comma-separated for dual stack) or the network's mapping.
    fn subnets_for(
        &self,
        network: &str,
        subnet: Option<&str>,
    ) -> Result<Vec<&(NamedSubnet, ValidSubnet)>, DesiredStateError> {
        let names: Vec<String> = match subnet {
            Some(list) => list.split(',').map(|s| s.trim().to_owned()).collect(),
            None => self.networks.get(network).cloned().ok_or_else(|| {
                DesiredStateError::SubnetNotFound(format!(
                    "network {network:?} is not mapped to a subnet in the flatnet state file; add it under `networks` or set `subnet` in the network configuration"
                ))
            })?,
        };
        let found = names
            .iter()
            .map(|name| {
                self.subnets.get(name).ok_or_else(|| {
                    DesiredStateError::SubnetNotFound(format!(
                        "subnet {name:?} of network {network:?} is not defined in the flatnet state file; add it under `subnets`"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let valid: Vec<&ValidSubnet> = found.iter().map(|(_, v)| v).collect();
        combine_subnets(network, &valid).map_err(DesiredStateError::InvalidDefinition)?;
        Ok(found)
    }
}

/// One address handed out, as stored in the allocation file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Allocation {
    /// The CNI network.
    pub network: String,
    /// The attachment.
    #[serde(flatten)]
    pub key: AttachmentKey,
    /// The subnet the address comes from.
    pub subnet: String,
    /// The address.
    pub address: IpAddr,
    /// The pod, for people reading the file.
    #[serde(default)]
    pub pod: PodRef,
}

/// The allocation file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationFile {
    /// Every address handed out.
    #[serde(default)]
    pub allocations: Vec<Allocation>,
}

/// Name of the allocation file inside the state directory.
pub const ALLOCATION_FILE: &str = "allocations.json";
/// Name of the lock file inside the state directory.
pub const LOCK_FILE: &str = "allocations.lock";

/// The allocation file could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum AllocationStoreError {
    /// Another agent holds the lock.
    #[error(
        "{path} is locked by another process; only one flatnet-agent may use a state directory"
    )]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
    /// The file is unreadable or not valid JSON.
    #[error("cannot read {path}: {reason}; fix or move the file (it lists the addresses in use)")]
    Read {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
}

/// Standalone desired state could not start.
#[derive(Debug, thiserror::Error)]
pub enum StandaloneError {
    /// Neither the state file nor its last good copy is usable.
    #[error(transparent)]
    State(#[from] StateFileError),
    /// The allocation file is unusable.
    #[error(transparent)]
    Store(#[from] AllocationStoreError),
}

struct Store {
    /// The subnets and networks in force, and the text they came from.
    state: LoadedState,
    file: AllocationFile,
    pools: BTreeMap<String, Pool>,
    /// Counts the changes of `file`.
    version: u64,
}

/// Standalone desired state.
pub struct Standalone {
    /// The state file followed, if any; its changes apply from the next ADD.
    source: Option<StateSource>,
    store: Mutex<Store>,
    /// Writes the allocation file. Changes are made in memory under the
    /// store's lock and written after it, so concurrent claims do not
    /// queue behind each other's file writes, and one write carries every
    /// change made before it.
    writer: Arc<AllocationWriter>,
    _lock: Flock<File>,
    /// Where the wire inventory is pinned, when allocation consults it.
    wire_inventory: Option<PathBuf>,
}

impl Standalone {
    /// Opens (or creates) the allocation file in `state_dir`, taking its
    /// lock, and rebuilds the pools from it.
    pub fn open(state: ValidState, state_dir: &Path) -> Result<Self, AllocationStoreError> {
        let read_error = |path: &Path, reason: String| AllocationStoreError::Read {
            path: path.to_owned(),
            reason,
        };
        crate::atomic_file::create_private_dir(state_dir)
            .map_err(|e| read_error(state_dir, e.to_string()))?;
        let lock_path = state_dir.join(LOCK_FILE);
        let lock_file = crate::atomic_file::private_file(&lock_path, false)
            .map_err(|e| read_error(&lock_path, e.to_string()))?;
        let lock = Flock::lock(lock_file, FlockArg::LockExclusiveNonblock).map_err(|_| {
            AllocationStoreError::Locked {
                path: lock_path.clone(),
            }
        })?;
        let path = state_dir.join(ALLOCATION_FILE);
        let file = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<AllocationFile>(&bytes)
                .map_err(|e| read_error(&path, e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => AllocationFile::default(),
            Err(e) => return Err(read_error(&path, e.to_string())),
        };
        let pools = build_pools(&state, &file);
        Ok(Self {
            source: None,
            store: Mutex::new(Store {
                state: LoadedState {
                    text: String::new(),
                    state,
                },
                file,
                pools,
                version: 0,
            }),
            writer: Arc::new(AllocationWriter {
                path: path.clone(),
                written: std::sync::Mutex::new(0),
            }),
            _lock: lock,
            wire_inventory: None,
        })
    }

    /// Opens the allocation file in `state_dir` with the state `source`
    /// starts from, and follows the file: an edit that validates applies
    /// from the next ADD (new networks and subnets, changed ranges).
    pub fn following(source: StateSource, state_dir: &Path) -> Result<Self, StandaloneError> {
        let loaded = source.load_at_start()?;
        let mut standalone = Self::open(loaded.state.clone(), state_dir)?;
        standalone.store.get_mut().state = loaded;
        standalone.source = Some(source);
        Ok(standalone)
    }

    /// Makes allocation skip addresses the wire inventory pinned under
    /// `pin_root` shows live: claimed by any MAC within
    /// [`flatnet_k8s::ipam::DEFAULT_WIRE_WINDOW`] (a node has no cluster
    /// to tell its pods' MACs from others; the addresses its pods hold are
    /// taken anyway, so only free ones are affected).
    #[must_use]
    pub fn with_wire_inventory(mut self, pin_root: &Path) -> Self {
        self.wire_inventory = Some(pin_root.to_owned());
        self
    }

    /// The addresses of `subnet` live on the wire; none without an
    /// inventory or when it cannot be read (allocation goes on as before).
    fn live_addresses(&self, subnet: &ValidSubnet) -> LiveAddresses {
        let Some(pin_root) = &self.wire_inventory else {
            return LiveAddresses::default();
        };
        let claims = match crate::datapath::PinnedMaps::open(pin_root).and_then(|m| m.wire_claims())
        {
            Ok(claims) => claims,
            Err(error) => {
                tracing::debug!(%error, "wire inventory not readable; allocating without it");
                return LiveAddresses::default();
            }
        };
        let (mono_now, now) = (crate::datapath::monotonic_ns(), Timestamp::now());
        let sightings = claims
            .iter()
            .filter(|c| {
                subnet.cidr.contains(c.addr) && (c.vlan == 0 || c.vlan == subnet.parent.vlan)
            })
            .map(|c| {
                let age = SignedDuration::try_from(c.age(mono_now)).unwrap_or(SignedDuration::MAX);
                let claim = LiveClaim {
                    mac: crate::datapath::format_mac(c.mac),
                    last_seen: now.checked_sub(age).unwrap_or(Timestamp::MIN),
                    node: "this node".to_owned(),
                };
                (c.addr, claim)
            });
        LiveAddresses::from_sightings(sightings, now, DEFAULT_WIRE_WINDOW)
    }

    /// Applies the state file when it changed and validates; the pools are
    /// rebuilt from the allocation file, which stays the truth.
    fn follow_state_file(&self, store: &mut Store) {
        let Some(source) = &self.source else { return };
        if let Some(loaded) = source.reload(&store.state.text) {
            store.pools = build_pools(&loaded.state, &store.file);
            store.state = loaded;
            tracing::info!(path = %source.path().display(), "state file changed: its subnets and networks are in force");
        }
    }

    /// The text of the state file in force (empty when opened from a
    /// state without a file).
    pub async fn state_text(&self) -> String {
        self.store.lock().await.state.text.clone()
    }

    /// A copy of the allocations.
    pub async fn allocations(&self) -> Vec<Allocation> {
        self.store.lock().await.file.allocations.clone()
    }

    /// Returns once the file holds version `version` of the store or a
    /// later one (see [`AllocationWriter`]).
    async fn flush(&self, version: u64) -> Result<(), DesiredStateError> {
        if self.writer.holds(version) {
            return Ok(());
        }
        let (file, latest) = {
            let store = self.store.lock().await;
            (store.file.clone(), store.version)
        };
        crate::atomic_file::off_runtime(|| self.writer.write(&file, latest, false))
    }

    /// Makes the allocations those of the attachment records (the durable
    /// state): an allocation without a record is from an ADD that never
    /// wrote one (so never answered) or a removal the file lost in a crash;
    /// a record's address missing from the file is a claim the file lost.
    /// Call once at start-up, before serving.
    pub async fn adopt_records(
        &self,
        records: &[AttachmentRecord],
    ) -> Result<(), DesiredStateError> {
        let mut store = self.store.lock().await;
        let allocations: Vec<Allocation> = records
            .iter()
            .flat_map(|record| {
                record
                    .subnets
                    .iter()
                    .zip(&record.addresses)
                    .map(|(subnet, address)| Allocation {
                        network: record.network.clone(),
                        key: record.key.clone(),
                        subnet: subnet.name.clone(),
                        address: address.addr(),
                        pod: record.pod.clone(),
                    })
            })
            .collect();
        for gone in store
            .file
            .allocations
            .iter()
            .filter(|a| !allocations.contains(a))
        {
            tracing::info!(address = %gone.address, key = %gone.key, "allocation without an attachment record released");
        }
        let file = AllocationFile { allocations };
        store.version += 1;
        self.writer.write(&file, store.version, true)?;
        store.pools = build_pools(&store.state.state, &file);
        store.file = file;
        Ok(())
    }

    async fn release_where(
        &self,
        mut doomed: impl FnMut(&Allocation) -> bool,
    ) -> Result<(), DesiredStateError> {
        let mut store = self.store.lock().await;
        let (gone, kept): (Vec<_>, Vec<_>) = store
            .file
            .allocations
            .iter()
            .cloned()
            .partition(|a| doomed(a));
        if gone.is_empty() {
            return Ok(());
        }
        for allocation in &gone {
            if let Some(pool) = store.pools.get_mut(&allocation.subnet) {
                pool.release(allocation.address);
            }
            tracing::info!(address = %allocation.address, subnet = %allocation.subnet, key = %allocation.key, "released");
        }
        store.file = AllocationFile { allocations: kept };
        store.version += 1;
        let version = store.version;
        drop(store);
        self.flush(version).await
    }
}

/// Writes the allocation file, without waiting for the disk (except at
/// start-up): an allocation is durable through the attachment record ADD
/// writes before answering, and [`Standalone::adopt_records`] rebuilds the
/// file from the records at start-up.
struct AllocationWriter {
    path: PathBuf,
    /// The version of the store the file holds; held while writing, so
    /// versions reach the file in order and an older one never replaces
    /// a newer.
    written: std::sync::Mutex<u64>,
}

impl Drop for Standalone {
    /// Waits for a write in progress and turns away those still to come:
    /// after the lock on the directory goes, only a new owner writes.
    fn drop(&mut self) {
        let mut written = self
            .writer
            .written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *written = u64::MAX;
    }
}

impl AllocationWriter {
    /// Whether the file holds version `version` of the store or a later one.
    fn holds(&self, version: u64) -> bool {
        *self.written.lock().expect("allocation writer poisoned") >= version
    }

    /// Writes `file`, version `version` of the store, unless the file holds
    /// that version or a later one already.
    fn write(
        &self,
        file: &AllocationFile,
        version: u64,
        durable: bool,
    ) -> Result<(), DesiredStateError> {
        let mut written = self.written.lock().expect("allocation writer poisoned");
        if *written >= version {
            return Ok(());
        }
        let bytes = serde_json::to_vec_pretty(file).expect("allocations serialize");
        let result = if durable {
            write_atomic(&self.path, &bytes)
        } else {
            write_atomic_unsynced(&self.path, &bytes)
        };
        result.map_err(|e| {
            DesiredStateError::Storage(format!(
                "cannot write the allocation file {}: {e}",
                self.path.display()
            ))
        })?;
        *written = version;
        Ok(())
    }
}

/// Pools of every subnet with the recorded addresses marked used. Records
/// of unknown subnets or duplicates are kept in the file but reported.
fn build_pools(state: &ValidState, file: &AllocationFile) -> BTreeMap<String, Pool> {
    let mut pools: BTreeMap<String, Pool> = state
        .subnets
        .iter()
        .map(|(name, (_, valid))| (name.clone(), Pool::new(valid)))
        .collect();
    for allocation in &file.allocations {
        match pools.get_mut(&allocation.subnet) {
            Some(pool) => {
                if let Err(error) = pool.mark_used(allocation.address) {
                    tracing::warn!(%error, key = %allocation.key, "allocation file lists an address twice");
                }
            }
            None => tracing::warn!(
                subnet = %allocation.subnet,
                address = %allocation.address,
                "allocation of a subnet no longer in the state file; kept until DEL or GC"
            ),
        }
    }
    pools
}

impl DesiredState for Standalone {
    fn kind(&self) -> &'static str {
        "standalone"
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<DesiredInterface, DesiredStateError> {
        let mut store = self.store.lock().await;
        self.follow_state_file(&mut store);
        let subnets: Vec<(NamedSubnet, ValidSubnet)> = store
            .state
            .state
            .subnets_for(&request.network, request.subnet.as_deref())?
            .into_iter()
            .cloned()
            .collect();
        let mut file = store.file.clone();
        let mut addresses = Vec::new();
        let mut taken = Vec::new();
        for (named, valid) in &subnets {
            let existing = file.allocations.iter().find(|a| {
                a.key == request.key && a.network == request.network && a.subnet == named.name
            });
            let address = match existing {
                Some(allocation) => allocation.address,
                None => {
                    let pool = store
                        .pools
                        .get_mut(&named.name)
                        .expect("a pool per subnet of the state");
                    let family = valid.cidr.family();
                    let wanted: Vec<IpAddr> = request
                        .requested_ips
                        .iter()
                        .copied()
                        .filter(|ip| Family::of(*ip) == family)
                        .collect();
                    let result = self.live_addresses(valid).allocate(pool, &wanted);
                    let address = match result {
                        Ok(address) => address,
                        Err(error) => {
                            // Undo this call's allocations in other subnets.
                            for (subnet, ip) in taken {
                                if let Some(pool) = store.pools.get_mut(&subnet) {
                                    pool.release(ip);
                                }
                            }
                            return Err(DesiredStateError::Allocation(error.to_string()));
                        }
                    };
                    taken.push((named.name.clone(), address));
                    file.allocations.push(Allocation {
                        network: request.network.clone(),
                        key: request.key.clone(),
                        subnet: named.name.clone(),
                        address,
                        pod: request.pod.clone(),
                    });
                    address
                }
            };
            let prefix = valid.cidr.prefix_len();
            addresses.push(IpNet::new(address, prefix).expect("prefix of the subnet's family"));
        }
        if !taken.is_empty() {
            store.version += 1;
            let version = store.version;
            store.file = file.clone();
            drop(store);
            // Written while the interface is made; `activate` waits for it.
            let writer = Arc::clone(&self.writer);
            tokio::task::spawn_blocking(move || {
                if let Err(error) = writer.write(&file, version, false) {
                    tracing::warn!(%error, "allocation file not written; the ADD's activation tries again");
                }
            });
        }
        Ok(DesiredInterface {
            subnets: subnets.iter().map(|(named, _)| named.clone()).collect(),
            addresses,
            mac: request.requested_mac,
        })
    }

    /// The claim's allocation is in the allocation file once this returns
    /// (written while the interface was made, or now).
    async fn activate(&self) -> Result<(), DesiredStateError> {
        let version = self.store.lock().await.version;
        self.flush(version).await
    }

    async fn subnet_mtus(&self) -> BTreeMap<String, Option<u32>> {
        let mut store = self.store.lock().await;
        self.follow_state_file(&mut store);
        store
            .state
            .state
            .subnets
            .iter()
            .map(|(name, (_, valid))| (name.clone(), valid.mtu))
            .collect()
    }

    async fn hotplug_attachments(&self) -> Option<Vec<HotplugAttachment>> {
        let mut store = self.store.lock().await;
        self.follow_state_file(&mut store);
        Some(store.state.state.hotplug.clone())
    }

    async fn report_mtu(
        &self,
        _key: &AttachmentKey,
        _pod: &PodRef,
        _subnets: &[NamedSubnet],
        _mtu: u32,
    ) -> Result<(), DesiredStateError> {
        Ok(())
    }

    async fn release(&self, network: &str, key: &AttachmentKey) -> Result<(), DesiredStateError> {
        self.release_where(|a| a.network == network && &a.key == key)
            .await
    }

    async fn release_except(
        &self,
        network: &str,
        keep: &[AttachmentKey],
    ) -> Result<(), DesiredStateError> {
        let keep: BTreeSet<&AttachmentKey> = keep.iter().collect();
        self.release_where(|a| a.network == network && !keep.contains(&a.key))
            .await
    }

    fn readiness(&self) -> Result<(), String> {
        Ok(())
    }

    async fn capacity(
        &self,
        network: &str,
        subnet: Option<&str>,
    ) -> Result<Vec<SubnetCapacity>, DesiredStateError> {
        let mut store = self.store.lock().await;
        self.follow_state_file(&mut store);
        let subnets = store.state.state.subnets_for(network, subnet)?;
        Ok(subnets
            .into_iter()
            .map(|(named, _)| {
                let free = store.pools.get(&named.name).map(Pool::free);
                SubnetCapacity::of(named, free)
            })
            .collect())
    }

    async fn report_hotplug(
        &self,
        _attachment: &HotplugAttachment,
        _failure: Option<&str>,
    ) -> Result<(), DesiredStateError> {
        // The agent's log is the standalone report.
        Ok(())
    }

    async fn primary_mtus(&self) -> Option<Vec<PrimaryMtu>> {
        let mut store = self.store.lock().await;
        self.follow_state_file(&mut store);
        Some(store.state.state.primary_mtus.clone())
    }

    async fn node_links(&self) -> Option<crate::link::NodeLinks> {
        let mut store = self.store.lock().await;
        self.follow_state_file(&mut store);
        Some(store.state.state.node_links.clone())
    }

    async fn report_node_links(
        &self,
        _results: &BTreeMap<String, Option<String>>,
    ) -> Result<(), DesiredStateError> {
        // The agent's log is the standalone report.
        Ok(())
    }

    async fn report_primary_mtus(
        &self,
        _results: &[(PrimaryMtu, Option<String>)],
    ) -> Result<(), DesiredStateError> {
        // The agent's log is the standalone report.
        Ok(())
    }

    async fn report_conflict(
        &self,
        _pod: &PodRef,
        _conflict: &Conflict,
    ) -> Result<(), DesiredStateError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATE: &str = r#"
subnets:
  - name: lan4
    spec: {flatMode: macvlan, master: eth9, cidr: 192.0.2.0/29, gateway: 192.0.2.1}
  - name: lan6
    spec: {flatMode: macvlan, master: eth9, cidr: "2001:db8::/64", gateway: "2001:db8::1"}
networks:
  - {name: flat, subnets: [lan4]}
  - {name: dual, subnets: [lan4, lan6]}
"#;

    fn state() -> ValidState {
        serde_yaml::from_str::<StateFile>(STATE)
            .unwrap()
            .validate()
            .unwrap()
    }

    fn request(network: &str, container: &str) -> ClaimRequest {
        ClaimRequest {
            network: network.into(),
            subnet: None,
            key: AttachmentKey {
                container_id: container.into(),
                ifname: "eth1".into(),
            },
            pod: PodRef::default(),
            requested_ips: Vec::new(),
            requested_mac: None,
        }
    }

    /// What ADD does before it answers: the claims are in the file after it.
    async fn activate(store: &Standalone) {
        store.activate().await.unwrap();
    }

    #[tokio::test]
    async fn allocations_are_stable_released_and_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let store = Standalone::open(state(), dir.path()).unwrap();
        let a = store.claim(&request("flat", "a")).await.unwrap();
        assert_eq!(a.addresses, ["192.0.2.2/29".parse::<IpNet>().unwrap()]);
        assert_eq!(store.claim(&request("flat", "a")).await.unwrap(), a);
        let dual = store.claim(&request("dual", "b")).await.unwrap();
        assert_eq!(
            dual.addresses,
            [
                "192.0.2.3/29".parse::<IpNet>().unwrap(),
                "2001:db8::2/64".parse().unwrap()
            ]
        );
        // In the file once an activation returns (written meanwhile).
        activate(&store).await;
        let in_file = std::fs::read_to_string(dir.path().join(ALLOCATION_FILE)).unwrap();
        assert_eq!(in_file.matches("\"address\"").count(), 3, "{in_file}");
        drop(store);

        let store = Standalone::open(state(), dir.path()).unwrap();
        assert_eq!(store.allocations().await.len(), 3);
        let c = store.claim(&request("flat", "c")).await.unwrap();
        assert_eq!(c.addresses, ["192.0.2.4/29".parse::<IpNet>().unwrap()]);
        store
            .release("flat", &request("flat", "a").key)
            .await
            .unwrap();
        store
            .release("flat", &request("flat", "a").key)
            .await
            .unwrap();
        let d = store.claim(&request("flat", "d")).await.unwrap();
        assert_eq!(d.addresses, a.addresses, "the released address is reused");
        store.release_except("dual", &[]).await.unwrap();
        let left: Vec<_> = store
            .allocations()
            .await
            .into_iter()
            .map(|a| a.key.container_id)
            .collect();
        assert_eq!(left, ["c", "d"]);
    }

    #[tokio::test]
    async fn a_write_after_the_store_is_gone_does_not_reach_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = Standalone::open(state(), dir.path()).unwrap();
        let writer = Arc::clone(&store.writer);
        store.claim(&request("flat", "a")).await.unwrap();
        drop(store);
        let reopened = Standalone::open(state(), dir.path()).unwrap();
        reopened.claim(&request("flat", "b")).await.unwrap();
        activate(&reopened).await;
        // As a write of the first store still queued would do.
        let stale = AllocationFile {
            allocations: Vec::new(),
        };
        writer.write(&stale, 100, false).unwrap();
        let in_file = std::fs::read_to_string(dir.path().join(ALLOCATION_FILE)).unwrap();
        assert!(in_file.contains("\"b\""), "{in_file}");
    }

    #[tokio::test]
    async fn a_second_agent_cannot_open_the_same_directory() {
        let dir = tempfile::tempdir().unwrap();
        let _first = Standalone::open(state(), dir.path()).unwrap();
        let second = Standalone::open(state(), dir.path());
        assert!(matches!(second, Err(AllocationStoreError::Locked { .. })));
    }

    #[tokio::test]
    async fn exhaustion_and_unknown_networks_are_cni_errors() {
        let dir = tempfile::tempdir().unwrap();
        let store = Standalone::open(state(), dir.path()).unwrap();
        // 192.0.2.0/29: .2 to .6 are allocatable (.1 is the gateway).
        for n in 0..5 {
            let free = store.capacity("flat", None).await.unwrap()[0].free;
            assert_eq!(free, Some(5 - n), "STATUS counts what is left");
            store
                .claim(&request("flat", &format!("p{n}")))
                .await
                .unwrap();
        }
        let capacity = store.capacity("flat", None).await.unwrap();
        assert_eq!(capacity[0].free, Some(0));
        assert_eq!(capacity[0].master, "eth9");
        let status = super::super::status::evaluate("flat", false, &capacity, |_| true);
        assert!(status.unwrap_err().msg.contains("exhausted"));
        let error = store.claim(&request("flat", "p5")).await.unwrap_err();
        assert_eq!(
            error.to_cni().code,
            crate::cni::ErrorCode::AddressNotAllocated
        );
        let error = store.claim(&request("nope", "x")).await.unwrap_err();
        assert_eq!(error.to_cni().code, crate::cni::ErrorCode::SubnetNotFound);
        assert!(error.to_string().contains("\"nope\""), "{error}");
        let mut by_field = request("nope", "y");
        by_field.subnet = Some("lan6".into());
        assert!(store.claim(&by_field).await.is_ok());
    }

    #[tokio::test]
    async fn a_failing_dual_stack_claim_keeps_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Standalone::open(state(), dir.path()).unwrap();
        let mut wanted = request("dual", "a");
        wanted.requested_ips = vec!["192.0.2.5".parse().unwrap(), "2001:db9::5".parse().unwrap()];
        assert!(store.claim(&wanted).await.is_err());
        assert!(store.allocations().await.is_empty());
        let next = store.claim(&request("flat", "b")).await.unwrap();
        assert_eq!(next.addresses, ["192.0.2.2/29".parse::<IpNet>().unwrap()]);
        wanted.requested_ips.pop();
        let got = store.claim(&wanted).await.unwrap();
        assert_eq!(got.addresses[0], "192.0.2.5/29".parse::<IpNet>().unwrap());
    }

    /// A state source on `STATE` (written to `dir/state.yaml`) and its gauge.
    fn followed(dir: &Path) -> (StateSource, Gauge) {
        std::fs::write(dir.join("state.yaml"), STATE).unwrap();
        let rejected = Gauge::default();
        let source = StateSource::new(
            &dir.join("state.yaml"),
            &dir.join("state"),
            rejected.clone(),
        );
        (source, rejected)
    }

    #[tokio::test]
    async fn a_network_added_while_running_is_served_from_the_next_add() {
        let dir = tempfile::tempdir().unwrap();
        let (source, rejected) = followed(dir.path());
        let store = Standalone::following(source, &dir.path().join("state")).unwrap();
        let a = store.claim(&request("flat", "a")).await.unwrap();
        let error = store.claim(&request("late", "b")).await.unwrap_err();
        assert_eq!(error.to_cni().code, crate::cni::ErrorCode::SubnetNotFound);

        let added = STATE.replace(
            "networks:\n",
            "networks:\n  - {name: late, subnets: [lan6]}\n",
        );
        std::fs::write(dir.path().join("state.yaml"), &added).unwrap();
        let b = store.claim(&request("late", "b")).await.unwrap();
        assert_eq!(b.addresses, ["2001:db8::2/64".parse::<IpNet>().unwrap()]);
        // The pools were rebuilt from the allocation file: `a` keeps its address.
        assert_eq!(store.claim(&request("flat", "a")).await.unwrap(), a);
        let c = store.claim(&request("flat", "c")).await.unwrap();
        assert_ne!(c.addresses, a.addresses);
        assert_eq!(rejected.get(), 0);
        assert_eq!(store.state_text().await, added);
    }

    #[tokio::test]
    async fn a_rejected_edit_keeps_the_state_in_force_and_does_not_stop_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let (source, rejected) = followed(dir.path());
        let store = Standalone::following(source, &state_dir).unwrap();
        assert_eq!(
            std::fs::read_to_string(state_dir.join(LAST_GOOD_STATE_FILE)).unwrap(),
            STATE
        );
        let broken = STATE.replace("cidr: 192.0.2.0/29", "cidr: 192.0.2.0/99");
        std::fs::write(dir.path().join("state.yaml"), &broken).unwrap();
        store.claim(&request("flat", "a")).await.unwrap();
        assert_eq!(rejected.get(), 1, "the rejection is visible");
        assert_eq!(store.state_text().await, STATE);
        drop(store);

        // The next start runs from the last good copy, loudly.
        let rejected = Gauge::default();
        let source = StateSource::new(&dir.path().join("state.yaml"), &state_dir, rejected.clone());
        let store = Standalone::following(source, &state_dir).unwrap();
        assert_eq!(rejected.get(), 1);
        assert_eq!(store.state_text().await, STATE);
        store.claim(&request("dual", "b")).await.unwrap();
        assert_eq!(rejected.get(), 1, "the file on disk is still rejected");

        // Fixed: applied, and the gauge clears.
        let fixed = STATE.replace("192.0.2.0/29", "192.0.2.0/28");
        std::fs::write(dir.path().join("state.yaml"), &fixed).unwrap();
        store.claim(&request("flat", "c")).await.unwrap();
        assert_eq!(rejected.get(), 0);
        assert_eq!(store.state_text().await, fixed);
        drop(store);

        // Without a good copy, a rejected file still stops the start.
        std::fs::remove_file(state_dir.join(LAST_GOOD_STATE_FILE)).unwrap();
        std::fs::write(dir.path().join("state.yaml"), &broken).unwrap();
        let source = StateSource::new(&dir.path().join("state.yaml"), &state_dir, Gauge::default());
        assert!(matches!(
            Standalone::following(source, &state_dir),
            Err(StandaloneError::State(StateFileError::Invalid { .. }))
        ));
    }

    #[tokio::test]
    async fn a_file_caught_empty_mid_write_is_not_taken_as_no_subnets() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let (source, rejected) = followed(dir.path());
        let store = Standalone::following(source, &state_dir).unwrap();
        // What a reader sees between a writer's truncation and its write.
        std::fs::write(dir.path().join("state.yaml"), "\n").unwrap();
        store.claim(&request("flat", "a")).await.unwrap();
        assert_eq!(rejected.get(), 1);
        assert_eq!(store.state_text().await, STATE, "the state in force stays");
        assert_eq!(
            std::fs::read_to_string(state_dir.join(LAST_GOOD_STATE_FILE)).unwrap(),
            STATE,
            "the last good copy stays"
        );
        let error = StateFile::load(&dir.path().join("state.yaml")).unwrap_err();
        assert!(error.to_string().contains("subnets: []"), "{error}");

        // Saying "no subnets" explicitly is an edit like any other.
        std::fs::write(dir.path().join("state.yaml"), "subnets: []\n").unwrap();
        let error = store.claim(&request("flat", "b")).await.unwrap_err();
        assert_eq!(error.to_cni().code, crate::cni::ErrorCode::SubnetNotFound);
        assert_eq!(rejected.get(), 0);
    }

    #[test]
    fn invalid_state_files_name_every_problem() {
        let file: StateFile = serde_yaml::from_str(
            r#"
subnets:
  - name: a
    spec: {flatMode: macvlan, master: eth9, cidr: 10.0.0.0/24}
  - name: b
    spec: {flatMode: ipvlan, master: eth9, cidr: 10.1.0.0/24}
  - name: c
    spec: {flatMode: bogus, master: eth9, cidr: 10.2.0.0/24}
networks:
  - {name: n1, subnets: [missing]}
  - {name: n2, subnets: [a, b]}
"#,
        )
        .unwrap();
        let problems = file.validate().unwrap_err().join("\n");
        for needle in [
            "missing",
            "both IPv4",
            "FlatNetworkSubnet c",
            "macvlan and ipvlan",
        ] {
            assert!(problems.contains(needle), "{needle:?} not in {problems}");
        }
    }

    #[test]
    fn hotplug_entries_are_checked_and_keyed_apart_from_the_runtime() {
        let file: StateFile = serde_yaml::from_str(STATE).unwrap();
        let with = |hotplug: &str| {
            let mut file = file.clone();
            file.hotplug = serde_yaml::from_str(hotplug).unwrap();
            file.validate()
        };
        let valid = with(
            "[{name: web, netns: /run/netns/w, pod: shop/web, attachments: [{network: flat, ifname: net1}]}]",
        )
        .unwrap();
        let key = valid.hotplug[0].key();
        assert_eq!(key.container_id, "hotplug-web");
        assert!(key.is_hotplug());
        assert_eq!(valid.hotplug[0].pod.to_string(), "pod shop/web");
        let problems = with(
            "[{name: -x, netns: /n, attachments: []},
              {name: a, netns: /n, pod: nons, attachments: []},
              {name: b, netns: /n, attachments: [{network: nope, ifname: net1}, {network: flat, ifname: a/b}]},
              {name: c, netns: /n, attachments: [{network: flat, ifname: net1}, {network: dual, ifname: net1}]}]",
        )
        .unwrap_err()
        .join("\n");
        for needle in [
            "hotplug entry \"-x\": the name must start",
            "hotplug entry a: pod must be written namespace/name",
            "hotplug entry b: network nope is not in the networks section",
            "hotplug entry b: ifname",
            "hotplug entry c: net1 in /n is asked for twice",
        ] {
            assert!(problems.contains(needle), "{needle:?} not in {problems}");
        }
    }

    #[test]
    fn primary_mtus_are_checked_and_named_by_their_entry() {
        let file: StateFile = serde_yaml::from_str(STATE).unwrap();
        let with = |hotplug: &str| {
            let mut file = file.clone();
            file.hotplug = serde_yaml::from_str(hotplug).unwrap();
            file.validate()
        };
        let valid = with(
            "[{name: web, netns: /run/netns/w, pod: shop/web, primary: {mtu: 1400, tcpMssClamp: true}}]",
        )
        .unwrap();
        assert!(valid.hotplug.is_empty(), "no attachments asked");
        assert_eq!(
            valid.primary_mtus,
            [PrimaryMtu {
                name: "web".into(),
                netns: Some("/run/netns/w".into()),
                pod: PodRef {
                    namespace: Some("shop".into()),
                    name: Some("web".into()),
                    uid: None,
                },
                mtu: 1400,
                tcp_mss_clamp: true,
            }]
        );
        let problems = with(
            "[{name: low, netns: /a, primary: {mtu: 67}},
              {name: one, netns: /b, primary: {mtu: 1400}},
              {name: two, netns: /b, primary: {mtu: 1300}}]",
        )
        .unwrap_err()
        .join("\n");
        for needle in [
            "hotplug entry low: primary.mtu 67 is out of range: use 68..65535",
            "hotplug entry two: primary.mtu of /b is set by two entries; keep one",
        ] {
            assert!(problems.contains(needle), "{needle:?} not in {problems}");
        }
    }

    #[tokio::test]
    async fn the_records_decide_what_is_allocated_at_start_up() {
        let dir = tempfile::tempdir().unwrap();
        let store = Standalone::open(state(), dir.path()).unwrap();
        // In the file only: its ADD never wrote a record.
        store.claim(&request("flat", "orphan")).await.unwrap();
        activate(&store).await;
        drop(store);
        let store = Standalone::open(state(), dir.path()).unwrap();
        // Recorded only: the file lost the claim.
        let record = AttachmentRecord {
            key: request("flat", "kept").key,
            subnets: vec![state().subnets["lan4"].0.clone()],
            addresses: vec!["192.0.2.6/29".parse().unwrap()],
            ..AttachmentRecord::example("kept")
        };
        store.adopt_records(&[record]).await.unwrap();
        let left: Vec<_> = store
            .allocations()
            .await
            .into_iter()
            .map(|a| (a.key.container_id, a.address))
            .collect();
        assert_eq!(left, [("kept".to_owned(), "192.0.2.6".parse().unwrap())]);
        // The orphan's address is free again; the record's is not.
        let next = store.claim(&request("flat", "next")).await.unwrap();
        assert_eq!(next.addresses, ["192.0.2.2/29".parse::<IpNet>().unwrap()]);
        activate(&store).await;
        drop(store);
        let store = Standalone::open(state(), dir.path()).unwrap();
        assert_eq!(store.allocations().await.len(), 2, "written durably");
    }
}
