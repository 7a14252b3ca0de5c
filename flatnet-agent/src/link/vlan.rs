//! The node's `<master>.<vlan>` interfaces and who owns them.
//!
//! flatnet creates a VLAN interface when a pod needs it and none exists,
//! and marks it with an interface alias ([`VLAN_ALIAS`]). It removes only
//! interfaces carrying that mark, and only when no lease holds them any
//! more. The pod children live in other namespaces, where the node cannot
//! see them, so each attachment records a lease file
//! `<lease dir>/<vlan>/<ifname>@<hash of the netns path>` holding the
//! namespace path. A lease whose namespace file is gone is stale and
//! ignored. The node configuration (`vlans` of a PodNetworkConfig or the
//! state file) holds a lease of its own, [`NODE_CONFIG_LEASE`], while it
//! asks for the VLAN: one rule for every holder, so the last pod leaving
//! never removes a VLAN the node configuration still asks for. The lease
//! directory lives on tmpfs (`/run`), like the VLAN interfaces themselves,
//! so both disappear together on reboot. Every change happens under an
//! exclusive `flock` on `<lease dir>/<vlan>.lock`, which serialises
//! concurrent attach and detach of pods sharing a VLAN, across processes
//! too.

use std::{
    ffi::OsString,
    fs::{self, File},
    io,
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::{Path, PathBuf},
};

use nix::fcntl::{Flock, FlockArg};
use rtnetlink::LinkVlan;

use super::{
    LinkError,
    netlink::{Link, Netlink},
};

/// The interface alias marking VLAN interfaces flatnet created.
pub const VLAN_ALIAS: &str = "flatnet:vlan";

/// The lease the node configuration holds on a VLAN it asks for (pod
/// leases always contain `@`, so the names never meet).
pub const NODE_CONFIG_LEASE: &str = "node-config";

/// Where lease files live unless configured otherwise.
pub const DEFAULT_LEASE_DIR: &str = "/run/flatnet/vlan-leases";

/// An exclusive lock on one VLAN's leases, held while the VLAN interface
/// and its children are created or removed.
pub(crate) struct VlanLock {
    _lock: Flock<File>,
    leases: PathBuf,
}

impl VlanLock {
    /// Waits for the lock of `vlan` under `dir`.
    pub(crate) async fn acquire(dir: &Path, vlan: &str) -> Result<Self, LinkError> {
        let leases = dir.join(vlan);
        crate::atomic_file::create_private_dir(&leases)
            .map_err(|source| io_error("create", &leases, source))?;
        let path = dir.join(format!("{vlan}.lock"));
        let file = crate::atomic_file::private_file(&path, false)
            .map_err(|source| io_error("open", &path, source))?;
        // flock blocks: wait on the blocking pool, not on a runtime worker.
        let lock = tokio::task::spawn_blocking(move || Flock::lock(file, FlockArg::LockExclusive))
            .await
            .map_err(|e| io_error("lock", &path, io::Error::other(e)))?
            .map_err(|(_, errno)| io_error("lock", &path, errno.into()))?;
        Ok(Self {
            _lock: lock,
            leases,
        })
    }

    fn lease_path(&self, netns: &Path, ifname: &str) -> PathBuf {
        let hash = fnv1a(netns.as_os_str().as_bytes());
        self.leases.join(format!("{ifname}@{hash:016x}"))
    }

    /// Records that the pod interface `ifname` in `netns` uses this VLAN.
    pub(crate) fn add_lease(&self, netns: &Path, ifname: &str) -> Result<(), LinkError> {
        write_lease(
            &self.lease_path(netns, ifname),
            netns.as_os_str().as_bytes(),
        )
    }

    /// Forgets the lease of `ifname` in `netns`; a missing lease is fine.
    pub(crate) fn remove_lease(&self, netns: &Path, ifname: &str) -> Result<(), LinkError> {
        remove_lease_file(&self.lease_path(netns, ifname))
    }

    /// Records that the node configuration asks for this VLAN.
    pub(crate) fn add_node_lease(&self) -> Result<(), LinkError> {
        write_lease(&self.leases.join(NODE_CONFIG_LEASE), b"")
    }

    /// Forgets the node configuration's lease; a missing one is fine.
    pub(crate) fn remove_node_lease(&self) -> Result<(), LinkError> {
        remove_lease_file(&self.leases.join(NODE_CONFIG_LEASE))
    }

    /// How many leases hold the VLAN: the node configuration's, and those
    /// of pods whose namespace still exists; stale pod leases are removed
    /// on the way.
    pub(crate) fn live_leases(&self) -> Result<usize, LinkError> {
        let entries =
            fs::read_dir(&self.leases).map_err(|source| io_error("read", &self.leases, source))?;
        let mut live = 0;
        for entry in entries {
            let path = entry
                .map_err(|source| io_error("read", &self.leases, source))?
                .path();
            if path.file_name() == Some(NODE_CONFIG_LEASE.as_ref()) {
                live += 1;
                continue;
            }
            let netns = fs::read(&path).map_err(|source| io_error("read", &path, source))?;
            let netns = PathBuf::from(OsString::from_vec(netns));
            if crate::netns::is_netns(&netns) {
                live += 1;
            } else {
                tracing::info!(lease = %path.display(), "removing stale VLAN lease");
                let _ = fs::remove_file(&path);
            }
        }
        Ok(live)
    }
}

/// The VLAN interface `name` (id `vlan` on `master`), created and set up
/// when missing. Returns it and whether it was created now.
pub(crate) async fn ensure(
    host: &Netlink,
    master: &Link,
    name: &str,
    vlan: u16,
    subnet: &str,
) -> Result<(Link, bool), LinkError> {
    if let Some(link) = host.link_by_name(name).await? {
        if !link.up {
            set_up(host, &link, None).await?;
        }
        return Ok((link, false));
    }
    let message = LinkVlan::new(name, master.index, vlan).build();
    let created = match host
        .create_link("create VLAN interface", name, message)
        .await
    {
        Ok(()) => true,
        // Created by someone else since we looked: reuse it.
        Err(e) if e.errno() == Some(libc::EEXIST) => false,
        Err(e) if e.errno() == Some(libc::EOPNOTSUPP) => {
            return Err(LinkError::Unsupported {
                kind: "802.1Q VLAN",
                module: "8021q",
                subnet: subnet.to_owned(),
            });
        }
        Err(e) => return Err(e),
    };
    let link = host
        .link_by_name(name)
        .await?
        .ok_or_else(|| LinkError::NotFound {
            ifname: name.to_owned(),
            netns: host.netns().to_owned(),
        })?;
    // The alias cannot be given at creation; a crash before this line
    // leaves an unmarked interface, which is kept (never a wrong delete).
    set_up(host, &link, created.then_some(VLAN_ALIAS)).await?;
    Ok((link, created))
}

async fn set_up(host: &Netlink, link: &Link, alias: Option<&str>) -> Result<(), LinkError> {
    let mut message = rtnetlink::LinkUnspec::new_with_index(link.index).up();
    if let Some(alias) = alias {
        message = message.alias(alias);
    }
    host.set_link("set up VLAN interface", &link.name, message.build())
        .await
}

/// Writes the lease file at `path` holding `content`.
fn write_lease(path: &Path, content: &[u8]) -> Result<(), LinkError> {
    fs::write(path, content).map_err(|source| io_error("write VLAN lease", path, source))
}

/// Removes the lease file at `path`; a missing one is fine.
fn remove_lease_file(path: &Path) -> Result<(), LinkError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(io_error("remove VLAN lease", path, e))
        }
        _ => Ok(()),
    }
}

/// The VLANs under `dir` the node configuration holds a lease on.
pub(crate) fn node_leased(dir: &Path) -> Result<Vec<String>, LinkError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(io_error("read", dir, source)),
    };
    let mut leased = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|source| io_error("read", dir, source))?
            .path();
        if path.join(NODE_CONFIG_LEASE).exists()
            && let Some(name) = path.file_name().and_then(|n| n.to_str())
        {
            leased.push(name.to_owned());
        }
    }
    Ok(leased)
}

/// Removes the VLAN interface `name` when a pod's attachment created it
/// ([`VLAN_ALIAS`]) and nothing uses it: no live lease (a pod's or the node
/// configuration's) and no child in the node's namespace. Returns whether
/// it was removed.
pub(crate) async fn release_if_unused(
    host: &Netlink,
    lock: &VlanLock,
    name: &str,
) -> Result<bool, LinkError> {
    let Some(link) = host.link_by_name(name).await? else {
        return Ok(false);
    };
    if link.alias.as_deref() != Some(VLAN_ALIAS) {
        return Ok(false);
    }
    if lock.live_leases()? > 0 {
        return Ok(false);
    }
    let children = host
        .links()
        .await?
        .into_iter()
        .filter(|l| l.parent_netnsid.is_none() && l.parent_index == Some(link.index))
        .count();
    if children > 0 {
        return Ok(false);
    }
    tracing::info!(vlan = name, "removing unused VLAN interface");
    host.delete_link(link.index, name).await
}

fn io_error(op: &'static str, path: &Path, source: io::Error) -> LinkError {
    LinkError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// FNV-1a (64 bit): a hash that stays the same across builds and Rust
/// versions, so leases written by one agent version are found by the next.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_reference_values() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[tokio::test]
    async fn leases_count_only_live_namespaces() {
        let dir = std::env::temp_dir().join(format!("flatnet-lease-test-{}", std::process::id()));
        // This process's network namespace is live.
        let live_ns = PathBuf::from("/proc/self/ns/net");
        // A file that is no network namespace (an unmounted netns file)
        // counts as gone.
        let not_netns = dir.join("ns-unmounted");
        fs::create_dir_all(&dir).unwrap();
        fs::write(&not_netns, b"").unwrap();
        let lock = VlanLock::acquire(&dir, "eth0.7").await.unwrap();
        assert_eq!(lock.live_leases().unwrap(), 0);
        lock.add_lease(&live_ns, "eth1").unwrap();
        lock.add_lease(&dir.join("ns-gone"), "eth1").unwrap();
        lock.add_lease(&not_netns, "eth1").unwrap();
        assert_eq!(lock.live_leases().unwrap(), 1);
        // The stale leases were removed, the live one stays.
        assert_eq!(fs::read_dir(dir.join("eth0.7")).unwrap().count(), 1);
        lock.remove_lease(&live_ns, "eth1").unwrap();
        lock.remove_lease(&live_ns, "eth1").unwrap();
        assert_eq!(lock.live_leases().unwrap(), 0);
        // The node configuration's lease holds the VLAN like a pod's.
        lock.add_node_lease().unwrap();
        assert_eq!(lock.live_leases().unwrap(), 1);
        assert_eq!(node_leased(&dir).unwrap(), ["eth0.7"]);
        lock.remove_node_lease().unwrap();
        lock.remove_node_lease().unwrap();
        assert_eq!(lock.live_leases().unwrap(), 0);
        assert!(node_leased(&dir).unwrap().is_empty());
        drop(lock);
        fs::remove_dir_all(&dir).unwrap();
    }
}
