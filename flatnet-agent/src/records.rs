//! Attachment records: one file per attachment under the record directory
//! (default `/var/lib/flatnet/attachments`), written before anything is
//! created for the attachment and deleted after everything is removed, so
//! DEL, GC and a restarted agent know what exists even without the runtime's
//! help.

use std::{
    io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::{
    atomic_file::{create_private_dir, remove_if_exists, write_atomic},
    desired::{AttachmentKey, NamedSubnet, PodRef},
    link::{HostRoute, ParentLink, PrimaryDefaults},
};

/// Default record directory.
pub const DEFAULT_RECORD_DIR: &str = "/var/lib/flatnet/attachments";

/// How far an attachment got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RecordPhase {
    /// ADD is in progress, or died midway: whatever exists is undone.
    Pending,
    /// ADD completed.
    Ready,
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

/// The record directory.
#[derive(Clone, Debug)]
pub struct Records {
    dir: PathBuf,
}

impl Records {
    /// Uses `dir`, creating it (mode 0700) when missing.
    pub fn open(dir: &Path) -> Result<Self, RecordError> {
        create_private_dir(dir).map_err(|e| error(dir, &e))?;
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    /// The file of `key`. Container IDs and interface names contain no `/`,
    /// IDs start with a letter or digit and the name fits `NAME_MAX`: the
    /// agent admits no other request ([`crate::cni::names`]).
    fn path(&self, key: &AttachmentKey) -> PathBuf {
        self.dir
            .join(format!("{}@{}.json", key.container_id, key.ifname))
    }

    /// Writes (replaces) a record.
    pub fn save(&self, record: &AttachmentRecord) -> Result<(), RecordError> {
        let path = self.path(&record.key);
        let bytes = serde_json::to_vec_pretty(record).expect("records serialize");
        write_atomic(&path, &bytes).map_err(|e| error(&path, &e))
    }

    /// The record of `key`, if any.
    pub fn load(&self, key: &AttachmentKey) -> Result<Option<AttachmentRecord>, RecordError> {
        read(&self.path(key))
    }

    /// Deletes the record of `key`; a missing record is not an error.
    pub fn remove(&self, key: &AttachmentKey) -> Result<(), RecordError> {
        let path = self.path(key);
        remove_if_exists(&path).map_err(|e| error(&path, &e))
    }

    /// Every record; unreadable files are logged and skipped.
    pub fn all(&self) -> Result<Vec<AttachmentRecord>, RecordError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| error(&self.dir, &e))?;
        let mut records = Vec::new();
        for entry in entries {
            let path = entry.map_err(|e| error(&self.dir, &e))?.path();
            let is_record = path.extension().is_some_and(|e| e == "json")
                && !path
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'));
            if !is_record {
                continue;
            }
            match read(&path) {
                Ok(Some(record)) => records.push(record),
                Ok(None) => {}
                Err(error) => tracing::warn!(%error, "skipping an unreadable attachment record"),
            }
        }
        records.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(records)
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
mod tests {
    use super::*;

    fn record(container: &str) -> AttachmentRecord {
        AttachmentRecord {
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
        }
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
        std::fs::write(dir.path().join("r/garbage.json"), "{").unwrap();
        assert_eq!(records.all().unwrap(), [a.clone(), b.clone()]);
        assert_eq!(records.load(&b.key).unwrap(), Some(b.clone()));
        records.remove(&a.key).unwrap();
        records.remove(&a.key).unwrap();
        assert_eq!(records.load(&a.key).unwrap(), None);
        assert_eq!(b.ips(), ["192.0.2.5".parse::<IpAddr>().unwrap()]);
    }
}
