//! The node's VLAN sub-interfaces (`<master>.<id>`) and Linux bridges
//! with their ports, as the desired state asks (`PodNetworkConfig`
//! `spec.vlans` / `spec.bridges`, the standalone `vlans` / `bridges`),
//! made over rtnetlink and removed again when nothing asks for them.
//!
//! Only what flatnet made is ever removed. Ownership is kept twice: in
//! [`LEDGER_FILE`] under the lease directory (tmpfs, so a reboot, which
//! takes the interfaces away, forgets it too), written *before* an
//! interface is created, and as the interface's alias ([`NODE_LINK_ALIAS`])
//! set right after. An interface is removed only when the ledger lists it
//! and it carries the alias, or, for one the ledger lists as still being
//! created (an agent killed between the two steps), when it is of the kind
//! and VLAN ID the ledger says. An interface that existed already is used
//! as it is (a VLAN of the right master and ID, a bridge) and never
//! removed; a port flatnet put into a bridge it did not make is taken out
//! again, nothing more.
//!
//! Whoever made a VLAN, the node configuration holds a lease on it while
//! it asks for it (`link::vlan`), as pods on it do: a VLAN is removed only
//! when no lease holds it, so the last pod leaving never takes away a VLAN
//! still asked for.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use netlink_packet_route::link::{InfoData, InfoKind, InfoVlan};
use rtnetlink::{LinkBridge, LinkUnspec, LinkVlan};
use serde::{Deserialize, Serialize};

use super::{
    Attachments, LinkError,
    netlink::{Link, Netlink},
    vlan::{self, VlanLock},
};

/// The ledger of what flatnet made, in the lease directory.
pub const LEDGER_FILE: &str = "node-links.json";

/// The alias marking interfaces flatnet made for the node configuration.
pub const NODE_LINK_ALIAS: &str = "flatnet:node-config";

/// What the node must have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeLinks {
    /// VLAN sub-interfaces: (master, VLAN ID).
    pub vlans: BTreeSet<(String, u16)>,
    /// Bridges by name, with their ports.
    pub bridges: BTreeMap<String, BTreeSet<String>>,
}

impl NodeLinks {
    /// The name of VLAN `id` on `master`.
    #[must_use]
    pub fn vlan_name(master: &str, id: u16) -> String {
        format!("{master}.{id}")
    }
}

/// An interface flatnet made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum Made {
    /// A VLAN sub-interface.
    Vlan {
        /// Its master.
        master: String,
        /// Its VLAN ID.
        id: u16,
        /// Whether the alias is set (`false`: recorded, maybe created).
        marked: bool,
    },
    /// A bridge.
    Bridge {
        /// Whether the alias is set.
        marked: bool,
    },
}

impl Made {
    fn marked(&self) -> bool {
        match self {
            Made::Vlan { marked, .. } | Made::Bridge { marked } => *marked,
        }
    }

    fn set_marked(&mut self) {
        match self {
            Made::Vlan { marked, .. } | Made::Bridge { marked } => *marked = true,
        }
    }
}

/// What flatnet made on the node and which ports it put into bridges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ledger {
    /// Interfaces flatnet made, by name.
    #[serde(default)]
    pub made: BTreeMap<String, Made>,
    /// Ports flatnet put into a bridge: port → bridge.
    #[serde(default)]
    pub enslaved: BTreeMap<String, String>,
}

/// Reads the ledger at `path`; a missing file is an empty ledger.
pub fn read_ledger(path: &Path) -> Result<Ledger, String> {
    crate::atomic_file::read_json_or_default(path)
}

fn write_ledger(path: &Path, ledger: &Ledger) -> Result<(), String> {
    crate::atomic_file::write_json(path, ledger)
}

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeLinksPass {
    /// Each wanted interface (VLAN `<master>.<id>`, bridge name) → why it
    /// is not as asked, `None` when it is.
    pub results: BTreeMap<String, Option<String>>,
    /// Interfaces created or ports added.
    pub changed: usize,
    /// Interfaces removed or ports taken out.
    pub removed: usize,
    /// What failed, with why (removals included).
    pub failed: Vec<String>,
}

/// The VLAN ID of `link`, when it is a VLAN.
fn vlan_id(link: &Link) -> Option<u16> {
    if link.kind != Some(InfoKind::Vlan) {
        return None;
    }
    match &link.data {
        Some(InfoData::Vlan(infos)) => infos.iter().find_map(|i| match i {
            InfoVlan::Id(id) => Some(*id),
            _ => None,
        }),
        _ => None,
    }
}

/// Whether `link` is the interface the ledger says flatnet made.
fn is_ours(link: &Link, made: &Made) -> bool {
    if made.marked() {
        return link.alias.as_deref() == Some(NODE_LINK_ALIAS);
    }
    // Recorded, then the agent died before marking it: ours if it is what
    // was being made and nobody marked it otherwise.
    link.alias.is_none()
        && match made {
            Made::Vlan { id, .. } => vlan_id(link) == Some(*id),
            Made::Bridge { .. } => link.kind == Some(InfoKind::Bridge),
        }
}

struct Pass<'a> {
    host: &'a Netlink,
    lease_dir: &'a Path,
    path: &'a Path,
    node: &'a str,
    ledger: Ledger,
    out: NodeLinksPass,
}

pub(super) async fn apply(config: &Attachments, node: &str, wanted: &NodeLinks) -> NodeLinksPass {
    let path = config.lease_dir.join(LEDGER_FILE);
    let mut out = NodeLinksPass::default();
    let (host, ledger) = match (
        config.host_link.get(config.host_netns.as_deref()),
        read_ledger(&path),
    ) {
        (Ok(host), Ok(ledger)) => (host, ledger),
        (Err(error), _) => {
            out.failed.push(error.to_string());
            return out;
        }
        (_, Err(error)) => {
            out.failed.push(error);
            return out;
        }
    };
    let mut pass = Pass {
        host: &host,
        lease_dir: &config.lease_dir,
        path: &path,
        node,
        ledger,
        out,
    };
    pass.release_ports(wanted).await;
    pass.remove_unwanted(wanted).await;
    pass.release_vlan_leases(wanted).await;
    for (master, id) in &wanted.vlans {
        let name = NodeLinks::vlan_name(master, *id);
        let result = pass.ensure_vlan(&name, master, *id).await;
        pass.record(name, result);
    }
    for (name, ports) in &wanted.bridges {
        let result = pass.ensure_bridge(name, ports).await;
        pass.record(name.clone(), result);
    }
    pass.out
}

impl Pass<'_> {
    fn save(&mut self) -> Result<(), String> {
        write_ledger(self.path, &self.ledger)
    }

    fn record(&mut self, name: String, result: Result<(), String>) {
        if let Err(why) = &result {
            self.out.failed.push(format!("{name}: {why}"));
        }
        self.out.results.insert(name, result.err());
    }

    /// Takes the ports flatnet added out of bridges no longer asking for them.
    async fn release_ports(&mut self, wanted: &NodeLinks) {
        let enslaved = self.ledger.enslaved.clone();
        for (port, bridge) in enslaved {
            if wanted
                .bridges
                .get(&bridge)
                .is_some_and(|ports| ports.contains(&port))
            {
                continue;
            }
            if let Err(why) = self.release_port(&port, &bridge).await {
                self.out
                    .failed
                    .push(format!("taking {port} out of bridge {bridge}: {why}"));
                continue;
            }
            self.ledger.enslaved.remove(&port);
            if let Err(why) = self.save() {
                self.out.failed.push(why);
                return;
            }
        }
    }

    async fn release_port(&mut self, port: &str, bridge: &str) -> Result<(), String> {
        let found = |l: Result<Option<Link>, LinkError>| l.map_err(|e| e.to_string());
        let (Some(port_link), Some(bridge_link)) = (
            found(self.host.link_by_name(port).await)?,
            found(self.host.link_by_name(bridge).await)?,
        ) else {
            return Ok(());
        };
        if port_link.controller != Some(bridge_link.index) {
            return Ok(());
        }
        let message = LinkUnspec::new_with_index(port_link.index)
            .nocontroller()
            .build();
        self.host
            .set_link("take port out of bridge", port, message)
            .await
            .map_err(|e| e.to_string())?;
        self.out.removed += 1;
        Ok(())
    }

    /// Gives up the node configuration's lease on VLANs it no longer asks
    /// for and did not make (one a pod's attachment made, or the node's
    /// own): one a pod's attachment made goes once no pod holds it either,
    /// as when its last pod leaves ([`vlan::release_if_unused`]).
    async fn release_vlan_leases(&mut self, wanted: &NodeLinks) {
        let wanted_names: BTreeSet<String> = wanted
            .vlans
            .iter()
            .map(|(master, id)| NodeLinks::vlan_name(master, *id))
            .collect();
        let leased = match vlan::node_leased(self.lease_dir) {
            Ok(leased) => leased,
            Err(why) => {
                self.out.failed.push(why.to_string());
                return;
            }
        };
        for name in leased {
            if wanted_names.contains(&name) || self.ledger.made.contains_key(&name) {
                continue;
            }
            let released = async {
                let lock = VlanLock::acquire(self.lease_dir, &name).await?;
                lock.remove_node_lease()?;
                vlan::release_if_unused(self.host, &lock, &name).await
            };
            match released.await {
                Ok(true) => self.out.removed += 1,
                Ok(false) => {}
                Err(why) => self.out.failed.push(format!("releasing {name}: {why}")),
            }
        }
    }

    /// Removes the interfaces flatnet made that nothing asks for: bridges
    /// first (a VLAN may be one's port), then VLANs.
    async fn remove_unwanted(&mut self, wanted: &NodeLinks) {
        let mut unwanted: Vec<(String, Made)> = self
            .ledger
            .made
            .iter()
            .filter(|(name, made)| match made {
                Made::Vlan { master, id, .. } => !wanted.vlans.contains(&(master.clone(), *id)),
                Made::Bridge { .. } => !wanted.bridges.contains_key(*name),
            })
            .map(|(name, made)| (name.clone(), made.clone()))
            .collect();
        unwanted.sort_by_key(|(_, made)| matches!(made, Made::Vlan { .. }));
        for (name, made) in unwanted {
            match self.remove(&name, &made).await {
                Ok(()) => {
                    self.ledger.made.remove(&name);
                    if let Err(why) = self.save() {
                        self.out.failed.push(why);
                        return;
                    }
                }
                Err(why) => self.out.failed.push(format!("removing {name}: {why}")),
            }
        }
    }

    async fn remove(&mut self, name: &str, made: &Made) -> Result<(), String> {
        // A VLAN: under its lease lock, so no pod attaches to it meanwhile.
        let lock = match made {
            Made::Vlan { .. } => Some(
                VlanLock::acquire(self.lease_dir, name)
                    .await
                    .map_err(|e| e.to_string())?,
            ),
            Made::Bridge { .. } => None,
        };
        if let Some(lock) = &lock {
            lock.remove_node_lease().map_err(|e| e.to_string())?;
        }
        let Some(link) = self
            .host
            .link_by_name(name)
            .await
            .map_err(|e| e.to_string())?
        else {
            return Ok(());
        };
        if !is_ours(&link, made) {
            // Replaced by someone else's interface of that name: not ours.
            tracing::warn!(
                interface = name,
                "not removing an interface flatnet did not make"
            );
            return Ok(());
        }
        if let Some(lock) = &lock
            && lock.live_leases().map_err(|e| e.to_string())? > 0
        {
            return Err(format!(
                "pods on node {} still use {name}; it is removed once they are gone",
                self.node
            ));
        }
        self.host
            .delete_link(link.index, name)
            .await
            .map_err(|e| e.to_string())?;
        tracing::info!(
            interface = name,
            "node interface removed: nothing asks for it"
        );
        self.out.removed += 1;
        Ok(())
    }

    /// Records `made` as being made, before the kernel is asked.
    fn intend(&mut self, name: &str, made: Made) -> Result<(), String> {
        self.ledger.made.insert(name.to_owned(), made);
        self.save()
    }

    /// Marks the interface `name` flatnet made (alias), sets it up, and
    /// records it marked.
    async fn mark(&mut self, link: &Link) -> Result<(), String> {
        let message = LinkUnspec::new_with_index(link.index)
            .up()
            .alias(NODE_LINK_ALIAS)
            .build();
        self.host
            .set_link("mark and set up", &link.name, message)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(made) = self.ledger.made.get_mut(&link.name) {
            made.set_marked();
        }
        self.save()
    }

    async fn existing(&self, name: &str) -> Result<Option<Link>, String> {
        self.host
            .link_by_name(name)
            .await
            .map_err(|e| e.to_string())
    }

    async fn ensure_vlan(&mut self, name: &str, master: &str, id: u16) -> Result<(), String> {
        let lock = VlanLock::acquire(self.lease_dir, name)
            .await
            .map_err(|e| e.to_string())?;
        let Some(master_link) = self.existing(master).await? else {
            return Err(format!(
                "master {master} of VLAN {name} does not exist on node {}; fix spec.vlans or the node",
                self.node
            ));
        };
        if let Some(link) = self.existing(name).await? {
            if vlan_id(&link) != Some(id) || link.parent_index != Some(master_link.index) {
                return Err(format!(
                    "interface {name} on node {} is not VLAN {id} of {master}; rename or remove it",
                    self.node
                ));
            }
            // Held while asked for, whoever made it: the last pod on it
            // leaving does not take it away.
            lock.add_node_lease().map_err(|e| e.to_string())?;
            // Ours and not yet marked (killed midway): finish it.
            if let Some(made) = self.ledger.made.get(name).cloned()
                && !made.marked()
                && is_ours(&link, &made)
            {
                self.mark(&link).await?;
            }
            return Ok(());
        }
        lock.add_node_lease().map_err(|e| e.to_string())?;
        self.intend(
            name,
            Made::Vlan {
                master: master.to_owned(),
                id,
                marked: false,
            },
        )?;
        let message = LinkVlan::new(name, master_link.index, id).build();
        self.host
            .create_link("create VLAN interface", name, message)
            .await
            .map_err(|e| match e.errno() {
                Some(libc::EOPNOTSUPP) => format!(
                    "the kernel of node {} cannot make VLAN {name}: it lacks 802.1Q support (load module 8021q)",
                    self.node
                ),
                _ => e.to_string(),
            })?;
        crate::crash_point::crash_point("node-link-created");
        let link = self.existing(name).await?.ok_or_else(|| {
            format!(
                "VLAN {name} vanished right after it was made on node {}",
                self.node
            )
        })?;
        self.mark(&link).await?;
        tracing::info!(interface = name, "VLAN interface made");
        self.out.changed += 1;
        Ok(())
    }

    async fn ensure_bridge(&mut self, name: &str, ports: &BTreeSet<String>) -> Result<(), String> {
        let bridge = match self.existing(name).await? {
            Some(link) if link.kind == Some(InfoKind::Bridge) => {
                if let Some(made) = self.ledger.made.get(name).cloned()
                    && !made.marked()
                    && is_ours(&link, &made)
                {
                    self.mark(&link).await?;
                }
                link
            }
            Some(_) => {
                return Err(format!(
                    "interface {name} on node {} is not a bridge; rename or remove it",
                    self.node
                ));
            }
            None => {
                self.intend(name, Made::Bridge { marked: false })?;
                self.host
                    .create_link("create bridge", name, LinkBridge::new(name).build())
                    .await
                    .map_err(|e| e.to_string())?;
                crate::crash_point::crash_point("node-link-created");
                let link = self.existing(name).await?.ok_or_else(|| {
                    format!(
                        "bridge {name} vanished right after it was made on node {}",
                        self.node
                    )
                })?;
                self.mark(&link).await?;
                tracing::info!(interface = name, "bridge made");
                self.out.changed += 1;
                link
            }
        };
        let mut problems = Vec::new();
        for port in ports {
            if let Err(why) = self.ensure_port(&bridge, port).await {
                problems.push(why);
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }

    async fn ensure_port(&mut self, bridge: &Link, port: &str) -> Result<(), String> {
        let Some(link) = self.existing(port).await? else {
            return Err(format!(
                "port {port} of bridge {} does not exist on node {}",
                bridge.name, self.node
            ));
        };
        match link.controller {
            Some(index) if index == bridge.index => return Ok(()),
            Some(_) => {
                return Err(format!(
                    "port {port} of bridge {} is a port of another bridge or bond on node {}; take it out first",
                    bridge.name, self.node
                ));
            }
            None => {}
        }
        self.ledger
            .enslaved
            .insert(port.to_owned(), bridge.name.clone());
        self.save()?;
        let message = LinkUnspec::new_with_index(link.index)
            .controller(bridge.index)
            .build();
        self.host
            .set_link("add port to bridge", port, message)
            .await
            .map_err(|e| e.to_string())?;
        self.out.changed += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_round_trips_and_a_missing_file_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases").join(LEDGER_FILE);
        assert_eq!(read_ledger(&path).unwrap(), Ledger::default());
        let ledger = Ledger {
            made: BTreeMap::from([
                (
                    "eth1.200".to_owned(),
                    Made::Vlan {
                        master: "eth1".into(),
                        id: 200,
                        marked: true,
                    },
                ),
                ("br-s".to_owned(), Made::Bridge { marked: false }),
            ]),
            enslaved: BTreeMap::from([("eth2".to_owned(), "br-s".to_owned())]),
        };
        write_ledger(&path, &ledger).unwrap();
        assert_eq!(read_ledger(&path).unwrap(), ledger);
        std::fs::write(&path, b"[").unwrap();
        assert!(
            read_ledger(&path)
                .unwrap_err()
                .contains("not a valid ledger")
        );
    }

    fn link(kind: InfoKind, alias: Option<&str>, vlan: Option<u16>) -> Link {
        Link {
            index: 5,
            name: "x".into(),
            kind: Some(kind),
            data: vlan.map(|id| InfoData::Vlan(vec![InfoVlan::Id(id)])),
            mac: None,
            mtu: None,
            up: true,
            parent_index: Some(2),
            parent_netnsid: None,
            alias: alias.map(str::to_owned),
            controller: None,
        }
    }

    #[test]
    fn only_what_flatnet_made_and_marked_or_was_making_is_ours() {
        let vlan = |marked| Made::Vlan {
            master: "eth1".into(),
            id: 200,
            marked,
        };
        let ours = link(InfoKind::Vlan, Some(NODE_LINK_ALIAS), Some(200));
        assert!(is_ours(&ours, &vlan(true)));
        // Replaced by a hand-made one of the same name.
        let hand_made = link(InfoKind::Vlan, None, Some(200));
        assert!(!is_ours(&hand_made, &vlan(true)));
        // Killed between creating and marking: the unmarked VLAN of that ID.
        assert!(is_ours(&hand_made, &vlan(false)));
        assert!(!is_ours(&link(InfoKind::Vlan, None, Some(7)), &vlan(false)));
        assert!(!is_ours(
            &link(InfoKind::Vlan, Some("admin"), Some(200)),
            &vlan(false)
        ));
        let bridge = Made::Bridge { marked: false };
        assert!(is_ours(&link(InfoKind::Bridge, None, None), &bridge));
        assert!(!is_ours(&link(InfoKind::Veth, None, None), &bridge));
    }
}
