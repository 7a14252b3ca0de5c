//! Attachment records: one per attachment, in a journal under the record
//! directory (default `/var/lib/flatnet/attachments`), written before
//! anything is created for the attachment and removed after everything is
//! removed, so DEL, GC and a restarted agent know what exists even without
//! the runtime's help. Each change is on disk before the call returns, at
//! the cost of one `fdatasync`, shared by concurrent changes (see
//! [`crate::journal`]).

use std::{
    collections::BTreeMap,
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::{
    atomic_file::{create_private_dir, remove_if_exists},
    desired::{AttachmentKey, NamedSubnet, PodRef},
    journal::{Journal, JournalError},
    link::{HostRoute, ParentLink, PrimaryDefaults},
};

/// Default record directory.
pub const DEFAULT_RECORD_DIR: &str = "/var/lib/flatnet/attachments";

/// The journal file in the record directory.
const JOURNAL_FILE: &str = "records.journal";

/// How far an attachment got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RecordPhase {
    /// ADD is in progress, or died midway: whatever exists is undone.
    Pending,
    /// ADD completed.
    Ready,
    /// DEL answered and is removing it, or died midway: finished at restart
    /// (the runtime never repeats a DEL that succeeded).
    Deleting,
}

/// The uplink (master or VLAN interface) the pod's addresses are watched
/// and answered on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UplinkRecord {
    /// Interface name in the node namespace.
    pub ifname: String,
    /// Its index.
    pub ifindex: u32,
    /// MAC listed in the tables (the pod's, or the uplink's for ipvlan).
    pub owner_mac: String,
    /// Whether the addresses are in the responder table (ipvlan L3/L3S).
    pub responder: bool,
}

/// Everything known about one attachment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AttachmentRecord {
    /// The attachment.
    #[serde(flatten)]
    pub key: AttachmentKey,
    /// The CNI network name.
    pub network: String,
    /// The pod's network namespace.
    pub netns: PathBuf,
    /// The pod.
    #[serde(default)]
    pub pod: PodRef,
    /// Progress.
    pub phase: RecordPhase,
    /// The subnets, as they were at ADD.
    pub subnets: Vec<NamedSubnet>,
    /// The pod's addresses with prefix length.
    #[serde(with = "ip_nets")]
    pub addresses: Vec<IpNet>,
    /// The MAC asked for (macvlan), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_mac: Option<String>,
    /// The interface's MAC once up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// MTU asked for in the network configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Data-plane table entries, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uplink: Option<UplinkRecord>,
    /// Node routes to the pod's addresses (`addPodIPToHost`), resolved
    /// before the interface is made so an interrupted ADD can remove them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_route: Option<HostRoute>,
    /// The primary interface's default gateways before the flat interface
    /// took the default route over (`flatNetworkDefaultGateway`), recorded
    /// before the interface is made so removing it restores them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary_defaults: Option<PrimaryDefaults>,
    /// The node interface the pod interface hangs off, from the validated
    /// subnets at ADD. Absent in records of earlier versions: see
    /// [`AttachmentRecord::parent_link`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentLink>,
    /// The MTU the interface was made with, while its Active status is
    /// still to be told ([`crate::desired::DesiredState::report_active`]):
    /// set with phase `Ready`, cleared once told, so that an agent
    /// restarted in between tells it then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreported_mtu: Option<u32>,
}

impl AttachmentRecord {
    /// The bare addresses.
    pub fn ips(&self) -> Vec<IpAddr> {
        self.addresses.iter().map(IpNet::addr).collect()
    }

    /// The parent link teardown releases: the recorded one, or for a record
    /// of an earlier version (which kept only the subnet specs) that of its
    /// first subnet, validated. `None` when neither is known: the pod side
    /// is still removed, no VLAN interface is released.
    pub fn parent_link(&self) -> Option<ParentLink> {
        self.parent.clone().or_else(|| {
            let valid = self.subnets.first()?.validate();
            match valid {
                Ok(valid) => Some(valid.parent),
                Err(error) => {
                    tracing::warn!(key = %self.key, %error, "the record's subnet is invalid; its VLAN interface, if any, stays");
                    None
                }
            }
        })
    }
}

/// A record could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("attachment record {path}: {reason}")]
pub struct RecordError {
    /// The file.
    pub path: PathBuf,
    /// What failed.
    pub reason: String,
}

/// The records of one agent. Clones share the journal; open one record
/// directory once per process.
#[derive(Clone, Debug)]
pub struct Records {
    journal: Arc<Journal<AttachmentKey, AttachmentRecord>>,
}

impl Records {
    /// Uses `dir`, creating it (mode 0700) when missing. Records of older
    /// agents (one `<containerId>@<ifname>.json` file each) move into the
    /// journal; unreadable ones are logged and left in place.
    pub fn open(dir: &Path) -> Result<Self, RecordError> {
        create_private_dir(dir).map_err(|e| error(dir, &e))?;
        let legacy = legacy_files(dir)?;
        let adopted = legacy
            .iter()
            .map(|(_, record)| (record.key.clone(), record.clone()))
            .collect();
        let journal = Journal::open(&dir.join(JOURNAL_FILE), adopted).map_err(journal_error)?;
        for (path, _) in &legacy {
            remove_if_exists(path).map_err(|e| error(path, &e))?;
        }
        Ok(Self {
            journal: Arc::new(journal),
        })
    }

    /// The records in `dir`, read without changing anything (for tools and
    /// tests next to a running agent).
    pub fn read(dir: &Path) -> Result<Vec<AttachmentRecord>, RecordError> {
        let journal: BTreeMap<AttachmentKey, AttachmentRecord> =
            Journal::read(&dir.join(JOURNAL_FILE)).map_err(journal_error)?;
        Ok(journal.into_values().collect())
    }

    /// Writes (replaces) a record; on disk when this returns.
    pub fn save(&self, record: &AttachmentRecord) -> Result<(), RecordError> {
        self.journal
            .put(record.key.clone(), record.clone())
            .map_err(journal_error)
    }

    /// Writes (replaces) a record without waiting for the disk: it
    /// survives an agent crash and is durable with the next [`Self::save`]
    /// or [`Self::remove`]. For the pending record of an ADD: what it
    /// describes (the pod's interface, node routes, VLAN leases under
    /// `/run`) does not survive a power cut either, and the ADD has not
    /// answered; the ready record's sync makes both durable.
    pub fn save_unsynced(&self, record: &AttachmentRecord) -> Result<(), RecordError> {
        self.journal
            .put_unsynced(record.key.clone(), record.clone())
            .map_err(journal_error)
    }

    /// The record of `key`, if any.
    pub fn load(&self, key: &AttachmentKey) -> Result<Option<AttachmentRecord>, RecordError> {
        Ok(self.journal.get(key))
    }

    /// Deletes the record of `key`; a missing record is not an error.
    pub fn remove(&self, key: &AttachmentKey) -> Result<(), RecordError> {
        self.journal.remove(key).map_err(journal_error)
    }

    /// Every record, in key order.
    pub fn all(&self) -> Result<Vec<AttachmentRecord>, RecordError> {
        Ok(self.journal.entries().into_values().collect())
    }
}

/// The record files of agents before the journal, with their paths.
fn legacy_files(dir: &Path) -> Result<Vec<(PathBuf, AttachmentRecord)>, RecordError> {
    let entries = std::fs::read_dir(dir).map_err(|e| error(dir, &e))?;
    let mut records = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| error(dir, &e))?.path();
        let is_record = path.extension().is_some_and(|e| e == "json")
            && !path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'));
        if !is_record {
            continue;
        }
        match read(&path) {
            Ok(Some(record)) => records.push((path, record)),
            Ok(None) => {}
            Err(error) => tracing::warn!(%error, "skipping an unreadable attachment record"),
        }
    }
    Ok(records)
}

fn journal_error(e: JournalError) -> RecordError {
    RecordError {
        path: e.path,
        reason: e.reason,
    }
}

/// `Vec<IpNet>` as CIDR strings (`192.0.2.5/24`).
mod ip_nets {
    use ipnet::IpNet;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(nets: &[IpNet], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(nets.iter().map(ToString::to_string))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<IpNet>, D::Error> {
        Vec::<String>::deserialize(deserializer)?
            .iter()
            .map(|s| s.parse().map_err(D::Error::custom))
            .collect()
    }
}

fn read(path: &Path) -> Result<Option<AttachmentRecord>, RecordError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| RecordError {
                path: path.to_owned(),
                reason: e.to_string(),
            }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(error(path, &e)),
    }
}

fn error(path: &Path, e: &io::Error) -> RecordError {
    RecordError {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
impl AttachmentRecord {
    /// A pending record of `container`'s `eth1` for tests.
    pub(crate) fn example(container: &str) -> Self {
        Self {
            key: AttachmentKey {
                container_id: container.into(),
                ifname: "eth1".into(),
            },
            network: "flat".into(),
            netns: "/run/netns/p".into(),
            pod: PodRef::default(),
            phase: RecordPhase::Pending,
            subnets: Vec::new(),
            addresses: vec!["192.0.2.5/24".parse().unwrap()],
            requested_mac: None,
            mac: None,
            mtu: None,
            uplink: None,
            host_route: None,
            primary_defaults: None,
            parent: Some(ParentLink {
                master: "eth9".into(),
                vlan: 7,
            }),
            unreported_mtu: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(container: &str) -> AttachmentRecord {
        AttachmentRecord::example(container)
    }

    #[test]
    fn records_of_the_previous_version_still_name_their_parent_link() {
        // Written by the version before `parent`: only the subnet spec.
        let old: AttachmentRecord = serde_json::from_value(serde_json::json!({
            "containerId": "c", "ifname": "eth1", "network": "flat", "netns": "/run/netns/p",
            "phase": "ready", "addresses": ["192.0.2.5/24"],
            "subnets": [{"name": "lan", "spec": {"flatMode": "macvlan", "master": "eth9",
                                                 "vlan": 7, "cidr": "192.0.2.0/24"}}],
        }))
        .unwrap();
        assert_eq!(old.parent, None);
        let expected = ParentLink {
            master: "eth9".into(),
            vlan: 7,
        };
        assert_eq!(old.parent_link(), Some(expected.clone()));

        let new = record("n");
        let json = serde_json::to_value(&new).unwrap();
        assert_eq!(
            json["parent"],
            serde_json::json!({"master": "eth9", "vlan": 7})
        );
        assert_eq!(new.parent_link(), Some(expected));
        let mut invalid = old;
        invalid.subnets[0].spec.vlan = 5000;
        assert_eq!(invalid.parent_link(), None);
    }

    #[test]
    fn records_round_trip_and_list_in_key_order() {
        let dir = tempfile::tempdir().unwrap();
        let records = Records::open(&dir.path().join("r")).unwrap();
        let (a, mut b) = (record("a"), record("b"));
        records.save(&b).unwrap();
        records.save(&a).unwrap();
        b.phase = RecordPhase::Ready;
        records.save(&b).unwrap();
        assert_eq!(records.all().unwrap(), [a.clone(), b.clone()]);
        assert_eq!(
            Records::read(&dir.path().join("r")).unwrap(),
            [a.clone(), b.clone()],
            "on disk"
        );
        assert_eq!(records.load(&b.key).unwrap(), Some(b.clone()));
        records.remove(&a.key).unwrap();
        records.remove(&a.key).unwrap();
        assert_eq!(records.load(&a.key).unwrap(), None);
        assert_eq!(b.ips(), ["192.0.2.5".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn record_files_of_older_agents_move_into_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let (mut a, b) = (record("a"), record("b"));
        a.phase = RecordPhase::Ready;
        for r in [&a, &b] {
            std::fs::write(
                dir.path()
                    .join(format!("{}@{}.json", r.key.container_id, r.key.ifname)),
                serde_json::to_vec_pretty(r).unwrap(),
            )
            .unwrap();
        }
        std::fs::write(dir.path().join("garbage.json"), "{").unwrap();
        let records = Records::open(dir.path()).unwrap();
        assert_eq!(records.all().unwrap(), [a.clone(), b.clone()]);
        drop(records);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            ["garbage.json", JOURNAL_FILE],
            "moved, unreadable kept"
        );
        assert_eq!(Records::open(dir.path()).unwrap().all().unwrap(), [a, b]);
    }
}
