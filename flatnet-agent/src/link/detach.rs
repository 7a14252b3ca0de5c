//! Removing a pod interface (CNI DEL): idempotent, and carrying on past
//! errors so one failed step does not leave the others undone.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
};

use tracing::Instrument;

use crate::{
    netns::{HeldNetns, is_netns},
    phases::{phase, timed},
};

use super::{
    AttachmentSpec, Attachments, HostRoute, LinkError, PrimaryDefaults,
    attach::default_net,
    attach::node_route,
    netlink::{Netlink, Route},
    spec::{ParentLink, check_ifname},
    vlan::{self, VlanLock},
};

/// What [`Attachments::detach`] removes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DetachSpec {
    /// The pod's namespace; `None` when the runtime no longer has one
    /// (only node-side state is cleaned then).
    pub netns: Option<PathBuf>,
    /// The pod's namespace, held open by the caller (DEL, before it
    /// answers); entered instead of the path at `netns`, which the runtime
    /// may have deleted by now.
    pub held_netns: Option<HeldNetns>,
    /// The pod interface.
    pub ifname: String,
    /// The node interface the pod interface sat on; its VLAN interface
    /// (if any) is released. `None` when not known (nothing to release).
    pub parent: Option<ParentLink>,
    /// The node route to remove, if one was added.
    pub host_route: Option<HostRoute>,
    /// Default routes to put back on the primary interface for each family
    /// left without one (the flat interface had taken them over).
    pub primary_defaults: Option<PrimaryDefaults>,
    /// Pod addresses known to the caller. Node routes are removed for these
    /// and for the addresses still found on the interface, so they go even
    /// when the namespace is already gone.
    pub addresses: Vec<IpAddr>,
}

impl From<&AttachmentSpec> for DetachSpec {
    fn from(spec: &AttachmentSpec) -> Self {
        Self {
            netns: Some(spec.netns.clone()),
            held_netns: None,
            ifname: spec.ifname.clone(),
            parent: Some(spec.parent.clone()),
            host_route: spec.host_route.clone(),
            primary_defaults: None,
            addresses: spec.addresses.iter().map(|a| a.addr()).collect(),
        }
    }
}

pub(super) async fn detach(config: &Attachments, spec: &DetachSpec) -> Result<(), LinkError> {
    check_ifname(&spec.ifname).map_err(|reason| LinkError::InvalidSpec {
        subnet: String::new(),
        field: "ifname",
        reason,
    })?;
    let host = timed("detach.host_socket", || {
        Netlink::open(config.host_netns.as_deref())
    })?;
    let mut errors = Vec::new();
    let mut addresses: BTreeSet<IpAddr> = spec.addresses.iter().copied().collect();

    if let Some(netns) = &spec.netns {
        match timed("detach.pod_socket", || {
            open_pod(netns, spec.held_netns.as_ref())
        }) {
            Ok(Some(pod)) => {
                let deleted = delete_pod_link(&pod, &spec.ifname)
                    .instrument(phase("detach.pod_link"))
                    .await;
                match deleted {
                    Ok(found) => addresses.extend(found),
                    Err(e) => errors.push(e),
                }
                if let Some(defaults) = &spec.primary_defaults
                    && let Err(e) = restore_primary_defaults(&pod, defaults).await
                {
                    errors.push(e);
                }
            }
            Ok(None) => {
                tracing::debug!(netns = %netns.display(), "pod namespace gone or unusable");
            }
            Err(e) => errors.push(e),
        }
    }
    if let Some(route) = &spec.host_route
        && let Err(e) = delete_host_routes(&host, route, &addresses)
            .instrument(phase("detach.host_routes"))
            .await
    {
        errors.push(e);
    }
    if let Some(parent) = spec.parent.as_ref().filter(|p| p.vlan != 0) {
        let name = parent.ifname();
        let released = async {
            let lock = VlanLock::acquire(&config.lease_dir, &name).await?;
            if let Some(netns) = &spec.netns {
                lock.remove_lease(netns, &spec.ifname)?;
            }
            vlan::release_if_unused(&host, &lock, &name).await
        };
        if let Err(e) = released.await {
            errors.push(e);
        }
    }
    LinkError::collect(errors)
}

/// A connection into the pod namespace: the held one when the caller holds
/// it, else the one at the path; `None` when there is none to enter: the
/// path is gone or names no network namespace, also when that happened
/// after the check (a runtime such as podman unmounts the namespace as
/// soon as DEL answers, leaving a plain file). Nothing flatnet made can be
/// in a path that names no namespace (or a bad `CNI_NETNS` of an earlier
/// version).
fn open_pod(netns: &Path, held: Option<&HeldNetns>) -> Result<Option<Netlink>, LinkError> {
    if let Some(held) = held {
        return Netlink::open_held(held).map(Some);
    }
    if !is_netns(netns) {
        return Ok(None);
    }
    match Netlink::open(Some(netns)) {
        Ok(pod) => Ok(Some(pod)),
        Err(LinkError::Netns(crate::netns::NetnsError::Open { source, .. }))
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            Ok(None)
        }
        Err(LinkError::Netns(crate::netns::NetnsError::NotNetns { .. })) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Deletes the pod interface and returns the addresses it had. A missing
/// interface is not an error: there is nothing to remove.
async fn delete_pod_link(pod: &Netlink, ifname: &str) -> Result<Vec<IpAddr>, LinkError> {
    let Some(link) = pod.link_by_name(ifname).await? else {
        return Ok(Vec::new());
    };
    let addresses = pod
        .addresses(link.index)
        .await?
        .into_iter()
        .map(|a| a.addr())
        .collect();
    pod.delete_link(link.index, ifname)
        .instrument(phase("detach.delete"))
        .await?;
    tracing::info!(%ifname, netns = %pod.netns(), "detached");
    Ok(addresses)
}

/// Deletes flatnet's node routes to `addresses` through the link and next
/// hop this pod got. Routes of another pod that reuses an address go
/// through another link or next hop and stay; when the link itself is gone
/// the kernel already removed its routes.
async fn delete_host_routes(
    host: &Netlink,
    host_route: &HostRoute,
    addresses: &BTreeSet<IpAddr>,
) -> Result<(), LinkError> {
    let Some(host_link) = host.link_by_name(&host_route.link).await? else {
        return Ok(());
    };
    for address in addresses {
        let mut route = node_route(*address, host_route, host_link.index, &[]);
        // Match any source: destination, link, next hop and protocol identify it.
        route.source = None;
        host.delete_route(&route).await?;
    }
    Ok(())
}

pub(super) async fn primary_defaults(
    netns: &Path,
    primary: &str,
) -> Result<PrimaryDefaults, LinkError> {
    let pod = Netlink::open(Some(netns))?;
    let mut gateways = Vec::new();
    if let Some(link) = pod.link_by_name(primary).await? {
        for ipv4 in [true, false] {
            gateways.extend(
                pod.routes(ipv4)
                    .await?
                    .into_iter()
                    .find(|r| r.is_default() && r.oif == Some(link.index))
                    .and_then(|r| r.via),
            );
        }
    }
    Ok(PrimaryDefaults {
        ifname: primary.to_owned(),
        gateways,
    })
}

/// Adds a default route through the primary interface for each family of
/// `defaults` that has none (a missing namespace or interface: nothing to do).
async fn restore_primary_defaults(
    pod: &Netlink,
    defaults: &PrimaryDefaults,
) -> Result<(), LinkError> {
    if defaults.gateways.is_empty() {
        return Ok(());
    }
    let Some(link) = pod.link_by_name(&defaults.ifname).await? else {
        return Ok(());
    };
    for gateway in &defaults.gateways {
        let ipv4 = gateway.is_ipv4();
        if pod.routes(ipv4).await?.iter().any(Route::is_default) {
            continue;
        }
        let route = Route::new(default_net(ipv4), Some(*gateway), link.index);
        pod.add_route(&route, false).await?;
        tracing::info!(%route, netns = %pod.netns(), "primary default route restored");
    }
    Ok(())
}
