//! Creating a pod interface, all or nothing.
//!
//! Every side effect pushes its undo step as soon as it has happened; when a
//! later step fails, the steps are undone in reverse order, so no
//! half-made interface, stray host route or lost default route survives a
//! failed attach.

use std::{net::IpAddr, sync::Arc};

use ipnet::IpNet;
use netlink_packet_route::{
    link::{
        AfSpecInet, AfSpecUnspec, InetDevConf, IpVlanFlags, IpVlanMode, LinkAttribute, MacVlanMode,
    },
    route::RouteProtocol,
};
use rtnetlink::{LinkIpVlan, LinkMacVlan, LinkUnspec};
use tracing::Instrument;

use crate::phases::{phase, timed};

use super::{
    Attachment, Attachments, BeforeUp, LinkError,
    announce::{announce, enable_kernel_ndisc_notify},
    netlink::{FLATNET_ROUTE_PROTOCOL, Link, Netlink, Route},
    spec::{
        ArpPolicy, AttachmentSpec, HostRoute, IpvlanFlag, IpvlanMode, LinkMode, MacvlanMode,
        ValidSpec,
    },
    vlan::{self, VlanLock},
};

/// One step to undo on failure.
#[derive(Debug)]
enum Undo {
    /// Drop this attachment's VLAN lease and the VLAN if now unused.
    ReleaseVlan { name: String },
    /// Delete the pod interface (its addresses and routes go with it).
    DeletePodLink { name: String },
    /// Delete a route added in the pod outside the pod interface.
    DeletePodRoute(Route),
    /// Put back a pod route that was replaced.
    RestorePodRoute(Route),
    /// Delete a node route to the pod.
    DeleteHostRoute(Route),
}

/// The state of one attach in progress.
struct Setup<'a> {
    config: &'a Attachments,
    valid: &'a ValidSpec,
    host: Arc<Netlink>,
    pod: Option<Netlink>,
    vlan_lock: Option<VlanLock>,
    undo: Vec<Undo>,
}

pub(super) async fn attach(
    config: &Attachments,
    valid: &ValidSpec,
    before_up: Option<BeforeUp<'_>>,
) -> Result<Attachment, LinkError> {
    let mut setup = Setup {
        config,
        valid,
        host: timed("attach.host_socket", || {
            config.host_link.get(config.host_netns.as_deref())
        })?,
        pod: None,
        vlan_lock: None,
        undo: Vec::new(),
    };
    match setup.run(before_up).await {
        Ok(attachment) => Ok(attachment),
        Err(error) => {
            tracing::warn!(ifname = %valid.spec().ifname, %error, "attach failed, rolling back");
            setup.roll_back().await;
            Err(error)
        }
    }
}

/// The spec's master in the node namespace; missing, an error naming the
/// subnet to fix.
pub(super) async fn find_master(host: &Netlink, spec: &AttachmentSpec) -> Result<Link, LinkError> {
    host.link_by_name(&spec.parent.master)
        .await?
        .ok_or_else(|| LinkError::MasterNotFound {
            master: spec.parent.master.clone(),
            subnet: spec.subnet.clone(),
        })
}

impl Setup<'_> {
    async fn run(&mut self, before_up: Option<BeforeUp<'_>>) -> Result<Attachment, LinkError> {
        let spec = self.valid.spec();
        // Entering the pod's namespace for its socket takes a thread; it
        // goes on while the node's requests find the parent and create
        // the interface.
        let pod_socket = open_pod_socket(&spec.netns);
        let master = find_master(&self.host, spec)
            .instrument(phase("attach.master"))
            .await?;
        let parent = self
            .parent(master)
            .instrument(phase("attach.parent"))
            .await?;
        let parent_mtu = parent.mtu.unwrap_or(u32::MAX);
        if let Some(mtu) = spec.mtu.filter(|mtu| *mtu > parent_mtu) {
            return Err(LinkError::MtuTooLarge {
                subnet: spec.subnet.clone(),
                mtu,
                parent: parent.name.clone(),
                parent_mtu,
            });
        }

        let (pod, link) = self
            .create_child(&parent, pod_socket)
            .instrument(phase("attach.create"))
            .await?;
        let pod = self.pod.insert(pod);

        // Which families the kernel announces as the interface comes up
        // (arp_notify); flatnet sends the others' frames after.
        let (mut kernel_v4, mut kernel_v6) = (false, false);
        if spec.arp_policy == ArpPolicy::ArpNotify {
            let has = |v4: bool| spec.addresses.iter().any(|a| a.addr().is_ipv4() == v4);
            if has(true) {
                // Over netlink: the agent's container has /proc/sys read-only.
                let mut conf = InetDevConf::default();
                conf.arp_notify = 1;
                let mut notify = LinkUnspec::new_with_index(link.index).build();
                notify
                    .attributes
                    .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![
                        AfSpecInet::DevConfRequest(conf),
                    ])]));
                pod.set_link("set arp_notify", &spec.ifname, notify)
                    .instrument(phase("attach.arp_notify"))
                    .await?;
                kernel_v4 = true;
            }
            kernel_v6 = has(false) && enable_kernel_ndisc_notify(&spec.netns, &spec.ifname)?;
        }
        async {
            for address in spec.addresses.iter().chain(&spec.extra_addresses) {
                pod.add_address(link.index, &spec.ifname, *address).await?;
            }
            Ok::<_, LinkError>(())
        }
        .instrument(phase("attach.addresses"))
        .await?;
        if let Some(before_up) = before_up
            && !before_up.await
        {
            return Err(LinkError::StoppedBeforeUp {
                ifname: spec.ifname.clone(),
            });
        }
        let mut up = LinkUnspec::new_with_index(link.index).up().build();
        if spec.proxy_arp {
            // In the same request as "up": no extra round trip, and no
            // /proc/sys, which is read-only in the agent's container.
            let mut conf = InetDevConf::default();
            conf.proxy_arp = 1;
            up.attributes
                .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![
                    AfSpecInet::DevConfRequest(conf),
                ])]));
        }
        pod.set_link("set up", &spec.ifname, up)
            .instrument(phase("attach.up"))
            .await?;

        self.add_pod_routes(link.index)
            .instrument(phase("attach.routes"))
            .await?;
        if let Some(host_route) = &spec.host_route {
            self.add_host_routes(host_route, &parent)
                .instrument(phase("attach.host_routes"))
                .await?;
        }
        // What the kernel does not announce, the agent does (arping, or
        // IPv6 under arp_notify on a read-only /proc/sys).
        let by_frames: Vec<IpNet> = spec
            .addresses
            .iter()
            .filter(|a| {
                !if a.addr().is_ipv4() {
                    kernel_v4
                } else {
                    kernel_v6
                }
            })
            .copied()
            .collect();
        if !by_frames.is_empty() && spec.kind.announces() {
            let mac = link.mac.unwrap_or_default();
            announce(
                &spec.netns,
                &spec.ifname,
                mac,
                &by_frames,
                self.config.announce,
            )
            .instrument(phase("attach.announce"))
            .await?;
        }

        tracing::info!(ifname = %spec.ifname, netns = %spec.netns.display(), parent = %parent.name, "attached");
        Ok(Attachment {
            ifname: spec.ifname.clone(),
            index: link.index,
            mac: link.mac.unwrap_or_default(),
            mtu: link.mtu.unwrap_or(parent_mtu),
            sandbox: spec.netns.clone(),
            parent_index: parent.index,
            parent_mac: parent.mac.unwrap_or_default(),
            parent: parent.name,
        })
    }

    /// The interface the child hangs off: the master, or the VLAN interface
    /// on it (created when missing, under the VLAN lock held until the end).
    async fn parent(&mut self, master: Link) -> Result<Link, LinkError> {
        let spec = self.valid.spec();
        if spec.parent.vlan == 0 {
            return Ok(master);
        }
        let name = self.valid.parent().to_owned();
        let lock = VlanLock::acquire(&self.config.lease_dir, &name).await?;
        lock.add_lease(&spec.netns, &spec.ifname)?;
        self.vlan_lock = Some(lock);
        self.undo.push(Undo::ReleaseVlan { name: name.clone() });
        let (link, created) =
            vlan::ensure(&self.host, &master, &name, spec.parent.vlan, &spec.subnet).await?;
        if created {
            tracing::info!(vlan = %name, "created VLAN interface");
        }
        Ok(link)
    }

    /// Creates the macvlan/ipvlan child directly inside the pod namespace
    /// under its name. Linux 6.1 also checks a new link's name against the
    /// namespace the request comes from, so creating `eth1` straight into a
    /// pod fails with EEXIST on a node that has an `eth1` of its own: on
    /// EEXIST (that, or the name taken in the pod) the child is made under
    /// a temporary name and renamed in the pod, whose answer tells the two
    /// apart. Returns the pod's netlink handle and the interface as the
    /// kernel made it (index, the MAC it picked, the MTU it inherited;
    /// bringing it up and addressing it changes none of them).
    async fn create_child(
        &mut self,
        parent: &Link,
        pod_socket: PodSocket,
    ) -> Result<(Netlink, Link), LinkError> {
        let spec = self.valid.spec();
        match self.create_in_pod(parent, &spec.ifname).await {
            Ok(()) => {
                self.undo.push(Undo::DeletePodLink {
                    name: spec.ifname.clone(),
                });
                let pod = pod_socket.opened(&spec.netns).await?;
                let link = pod.existing_link(&spec.ifname).await?;
                return Ok((pod, link));
            }
            Err(e) if e.errno() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        let pod = pod_socket.opened(&spec.netns).await?;
        let temporary = temporary_name(&spec.netns, &spec.ifname);
        match self.create_in_pod(parent, &temporary).await {
            // Left over by an ADD that died between creating and renaming.
            Err(e) if e.errno() == Some(libc::EEXIST) => {
                if let Some(stale) = pod.link_by_name(&temporary).await? {
                    pod.delete_link(stale.index, &temporary).await?;
                }
                self.create_in_pod(parent, &temporary).await?;
            }
            created => created?,
        }
        self.undo.push(Undo::DeletePodLink {
            name: temporary.clone(),
        });
        let mut link = pod
            .link_by_name(&temporary)
            .await?
            .ok_or_else(|| LinkError::NotFound {
                ifname: temporary.clone(),
                netns: pod.netns().to_owned(),
            })?;
        let rename = LinkUnspec::new_with_index(link.index)
            .name(spec.ifname.clone())
            .build();
        match pod.set_link("rename", &spec.ifname, rename).await {
            Ok(()) => {}
            // The name is taken in the pod: that interface is not ours to
            // undo (the rollback removes ours).
            Err(e) if e.errno() == Some(libc::EEXIST) => {
                return Err(LinkError::AlreadyExists {
                    ifname: spec.ifname.clone(),
                    netns: spec.netns.display().to_string(),
                });
            }
            Err(e) => return Err(e),
        }
        link.name.clone_from(&spec.ifname);
        self.undo.pop();
        self.undo.push(Undo::DeletePodLink {
            name: spec.ifname.clone(),
        });
        Ok((pod, link))
    }

    /// Creates the child as `name` in the pod's namespace.
    async fn create_in_pod(&self, parent: &Link, name: &str) -> Result<(), LinkError> {
        let spec = self.valid.spec();
        // The same opening as every other entry into the pod's namespace
        // (`/var/run/netns/...` read as `/run/netns/...` where needed).
        let netns = crate::netns::open_netns(&spec.netns)?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&netns);
        let mut message = match spec.kind {
            LinkMode::Macvlan(mode) => {
                let builder = LinkMacVlan::new(name, parent.index, macvlan_mode(mode));
                match spec.mac {
                    Some(mac) => builder.address(mac.to_vec()).setns_by_fd(fd).build(),
                    None => builder.setns_by_fd(fd).build(),
                }
            }
            LinkMode::Ipvlan(mode, flag) => LinkIpVlan::new(name, parent.index, ipvlan_mode(mode))
                .flag(ipvlan_flag(flag))
                .setns_by_fd(fd)
                .build(),
        };
        if let Some(mtu) = spec.mtu {
            message
                .attributes
                .push(netlink_packet_route::link::LinkAttribute::Mtu(mtu));
        }
        let (kind, op) = match spec.kind {
            LinkMode::Macvlan(_) => ("macvlan", "create macvlan"),
            LinkMode::Ipvlan(..) => ("ipvlan", "create ipvlan"),
        };
        let result = self.host.create_link(op, &spec.ifname, message).await;
        drop(netns);
        match result {
            Err(e) if e.errno() == Some(libc::EOPNOTSUPP) => Err(LinkError::Unsupported {
                kind,
                module: kind,
                subnet: spec.subnet.clone(),
            }),
            result => result,
        }
    }

    /// Routes inside the pod: primary-interface destinations first (they need
    /// the primary's default gateway, read before the default route moves),
    /// then custom routes, then the default route.
    async fn add_pod_routes(&mut self, index: u32) -> Result<(), LinkError> {
        let spec = self.valid.spec();
        let node_networks = match &spec.primary_routes {
            Some(primary) if primary.node_networks => {
                node_networks(&self.host, &spec.addresses).await?
            }
            _ => Vec::new(),
        };
        let pod = self.pod.as_ref().expect("pod connection open");
        let mut undo = Vec::new();
        let result = async {
            if let Some(primary) = &spec.primary_routes {
                let link = pod.link_by_name(&primary.ifname).await?.ok_or_else(|| {
                    LinkError::NotFound {
                        ifname: primary.ifname.clone(),
                        netns: pod.netns().to_owned(),
                    }
                })?;
                for destination in primary.destinations.iter().chain(&node_networks) {
                    let ipv4 = destination.addr().is_ipv4();
                    let gateway = pod
                        .routes(ipv4)
                        .await?
                        .into_iter()
                        .find(|r| r.is_default() && r.oif == Some(link.index) && r.via.is_some())
                        .and_then(|r| r.via);
                    let Some(gateway) = gateway else {
                        if spec.default_route && self.valid.gateway_for(destination.addr()).is_some() {
                            return Err(LinkError::NoPrimaryGateway {
                                ifname: primary.ifname.clone(),
                                netns: pod.netns().to_owned(),
                                family: family_name(ipv4),
                                destination: destination.to_string(),
                            });
                        }
                        tracing::warn!(%destination, ifname = %primary.ifname, "no default gateway of the family on the primary interface; route skipped");
                        continue;
                    };
                    let route = Route::new(*destination, Some(gateway), link.index);
                    match pod.add_route(&route, false).await {
                        Ok(()) => undo.push(Undo::DeletePodRoute(route)),
                        // Already there (added by the primary network): keep it, not ours.
                        Err(e) if e.errno() == Some(libc::EEXIST) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            for custom in &spec.routes {
                let oif = match &custom.dev {
                    None => index,
                    Some(dev) => pod
                        .link_by_name(dev)
                        .await?
                        .ok_or_else(|| LinkError::RouteDevNotFound {
                            dev: dev.clone(),
                            destination: custom.destination.to_string(),
                            netns: pod.netns().to_owned(),
                            subnet: spec.subnet.clone(),
                        })?
                        .index,
                };
                let mut route = Route::new(custom.destination, custom.via, oif);
                route.source = custom.source;
                route.metric = custom.metric;
                match pod.add_route(&route, false).await {
                    // Not removed with the flat interface.
                    Ok(()) if oif != index => undo.push(Undo::DeletePodRoute(route)),
                    Ok(()) => {}
                    // Already on another interface (a retried ADD, or the
                    // primary network's own): keep it, not ours.
                    Err(e) if oif != index && e.errno() == Some(libc::EEXIST) => {}
                    Err(e) => return Err(e),
                }
            }
            if spec.default_route {
                for gateway in &spec.gateways {
                    let ipv4 = gateway.is_ipv4();
                    for old in pod
                        .routes(ipv4)
                        .await?
                        .into_iter()
                        .filter(Route::is_default)
                    {
                        if pod.delete_route(&old).await? {
                            undo.push(Undo::RestorePodRoute(old));
                        }
                    }
                    let mut route = Route::new(default_net(ipv4), Some(*gateway), index);
                    route.source = first_address(&spec.addresses, ipv4);
                    pod.add_route(&route, false).await?;
                }
            }
            Ok(())
        }
        .await;
        self.undo.extend(undo);
        result
    }

    /// Node routes to each pod address through the host link, tagged with
    /// flatnet's route protocol. They replace a stale route to the same
    /// address, so a leftover from a crashed pod cannot fail the attach.
    async fn add_host_routes(
        &mut self,
        host_route: &HostRoute,
        parent: &Link,
    ) -> Result<(), LinkError> {
        let spec = self.valid.spec();
        let host_link = self
            .host
            .link_by_name(&host_route.link)
            .await?
            .ok_or_else(|| LinkError::NotFound {
                ifname: host_route.link.clone(),
                netns: self.host.netns().to_owned(),
            })?;
        let parent_addresses = self.host.addresses(parent.index).await?;
        for address in &spec.addresses {
            let route = node_route(
                address.addr(),
                host_route,
                host_link.index,
                &parent_addresses,
            );
            self.host.add_route(&route, true).await?;
            self.undo.push(Undo::DeleteHostRoute(route));
        }
        Ok(())
    }

    async fn roll_back(&mut self) {
        let spec = self.valid.spec();
        while let Some(step) = self.undo.pop() {
            let result = match &step {
                Undo::ReleaseVlan { name } => match &self.vlan_lock {
                    Some(lock) => match lock.remove_lease(&spec.netns, &spec.ifname) {
                        Ok(()) => vlan::release_if_unused(&self.host, lock, name)
                            .await
                            .map(drop),
                        Err(e) => Err(e),
                    },
                    None => Ok(()),
                },
                Undo::DeletePodLink { name } => delete_pod_link(self, name).await,
                Undo::DeletePodRoute(route) => match &self.pod {
                    Some(pod) => pod.delete_route(route).await.map(drop),
                    None => Ok(()),
                },
                Undo::RestorePodRoute(route) => match &self.pod {
                    Some(pod) => pod.add_route(route, true).await,
                    None => Ok(()),
                },
                Undo::DeleteHostRoute(route) => self.host.delete_route(route).await.map(drop),
            };
            if let Err(error) = result {
                tracing::error!(?step, %error, "rollback step failed");
            }
        }
    }
}

/// The pod's netlink socket, opened on a blocking thread (which enters
/// the pod's namespace) while the caller goes on.
struct PodSocket(tokio::task::JoinHandle<Result<Netlink, LinkError>>);

fn open_pod_socket(netns: &std::path::Path) -> PodSocket {
    let netns = netns.to_owned();
    let span = tracing::Span::current();
    PodSocket(tokio::task::spawn_blocking(move || {
        span.in_scope(|| timed("attach.pod_socket", || Netlink::open(Some(&netns))))
    }))
}

impl PodSocket {
    /// Waits for the socket to `netns`.
    async fn opened(self, netns: &std::path::Path) -> Result<Netlink, LinkError> {
        self.0.await.unwrap_or_else(|error| {
            Err(LinkError::Socket {
                netns: netns.display().to_string(),
                source: std::io::Error::other(error),
            })
        })
    }
}

/// A name for the pod interface while it is created: unique per pod
/// namespace and interface (concurrent ADDs never collide), the same on a
/// retry (so a leftover can be found), at most 15 bytes.
fn temporary_name(netns: &std::path::Path, ifname: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    (netns, ifname).hash(&mut hasher);
    format!("fnt{:012x}", hasher.finish() & 0xffff_ffff_ffff)
}

async fn delete_pod_link(setup: &Setup<'_>, name: &str) -> Result<(), LinkError> {
    let opened;
    let pod = match &setup.pod {
        Some(pod) => pod,
        None => {
            opened = Netlink::open(Some(&setup.valid.spec().netns))?;
            &opened
        }
    };
    if let Some(link) = pod.link_by_name(name).await? {
        pod.delete_link(link.index, name).await?;
    }
    Ok(())
}

pub(super) async fn resolve_host_route(
    config: &Attachments,
    netns: &std::path::Path,
    primary: &str,
) -> Result<HostRoute, LinkError> {
    let pod = Netlink::open(Some(netns))?;
    let no_path = |reason: String| LinkError::NoPathToPrimary {
        ifname: primary.to_owned(),
        netns: netns.display().to_string(),
        reason,
    };
    let link = pod
        .link_by_name(primary)
        .await?
        .ok_or_else(|| no_path("the interface does not exist".into()))?;
    let addresses: Vec<IpAddr> = pod
        .addresses(link.index)
        .await?
        .iter()
        .map(IpNet::addr)
        .collect();
    let global = |ipv4: bool| {
        addresses
            .iter()
            .copied()
            .find(|a| a.is_ipv4() == ipv4 && !is_link_local(*a))
    };
    let target = global(true)
        .or_else(|| global(false))
        .ok_or_else(|| no_path("it has no IPv4 or global IPv6 address".into()))?;
    let host = config.host_link.get(config.host_netns.as_deref())?;
    let oif = host
        .routes(target.is_ipv4())
        .await?
        .into_iter()
        .filter(|r| r.destination.contains(&target) && r.oif.is_some())
        .max_by_key(|r| r.destination.prefix_len())
        .and_then(|r| r.oif)
        .ok_or_else(|| no_path(format!("the node has no route to its address {target}")))?;
    let name = host
        .links()
        .await?
        .into_iter()
        .find(|l| l.index == oif)
        .map(|l| l.name)
        .ok_or_else(|| no_path(format!("the node's route to {target} has no interface")))?;
    let ipv6 = global(false).or_else(|| {
        addresses
            .iter()
            .copied()
            .find(|a| a.is_ipv6() && is_link_local(*a))
    });
    Ok(HostRoute {
        link: name,
        via: global(true).into_iter().chain(ipv6).collect(),
    })
}

/// The node route to one pod address through the host link: via the
/// pod's primary address of the family (on-link without one), with the
/// parent's first address of the family as source when it has one (so the
/// pod answers the node's own address, which `addNodeCIDR` routes back
/// through the primary network).
pub(super) fn node_route(
    address: IpAddr,
    host_route: &HostRoute,
    link_index: u32,
    parent_addresses: &[IpNet],
) -> Route {
    let mut route = Route::new(
        IpNet::from(address),
        host_route.via_for(address),
        link_index,
    );
    route.protocol = RouteProtocol::Other(FLATNET_ROUTE_PROTOCOL);
    route.source = first_address(parent_addresses, address.is_ipv4());
    route
}

/// The node's own networks (`addNodeCIDR`): the networks of the global
/// addresses on the node's default-route interfaces. One that overlaps a
/// pod address's network is narrowed to the node address itself: routing
/// the whole flat subnet through the primary network would cut the pod off
/// its neighbours.
pub(super) async fn node_networks(
    host: &Netlink,
    pod_addresses: &[IpNet],
) -> Result<Vec<IpNet>, LinkError> {
    let mut links = Vec::new();
    for ipv4 in [true, false] {
        for route in host.routes(ipv4).await? {
            if route.is_default()
                && let Some(oif) = route.oif
                && !links.contains(&oif)
            {
                links.push(oif);
            }
        }
    }
    let mut networks = Vec::new();
    for link in links {
        for address in host.addresses(link).await? {
            if is_link_local(address.addr()) {
                continue;
            }
            let network = address.trunc();
            let overlaps = pod_addresses
                .iter()
                .any(|pod| pod.contains(&network.addr()) || network.contains(&pod.addr()));
            let network = if overlaps {
                IpNet::from(address.addr())
            } else {
                network
            };
            if !networks.contains(&network) {
                networks.push(network);
            }
        }
    }
    Ok(networks)
}

fn is_link_local(address: IpAddr) -> bool {
    match address {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}

fn first_address(addresses: &[IpNet], ipv4: bool) -> Option<IpAddr> {
    addresses
        .iter()
        .map(IpNet::addr)
        .find(|a| a.is_ipv4() == ipv4)
}

pub(super) fn default_net(ipv4: bool) -> IpNet {
    if ipv4 {
        IpNet::V4(Default::default())
    } else {
        IpNet::V6(Default::default())
    }
}

pub(super) fn family_name(ipv4: bool) -> &'static str {
    if ipv4 { "IPv4" } else { "IPv6" }
}

pub(super) fn macvlan_mode(mode: MacvlanMode) -> MacVlanMode {
    match mode {
        MacvlanMode::Bridge => MacVlanMode::Bridge,
        MacvlanMode::Vepa => MacVlanMode::Vepa,
        MacvlanMode::Private => MacVlanMode::Private,
        MacvlanMode::Passthru => MacVlanMode::Passthrough,
    }
}

pub(super) fn ipvlan_mode(mode: IpvlanMode) -> IpVlanMode {
    match mode {
        IpvlanMode::L2 => IpVlanMode::L2,
        IpvlanMode::L3 => IpVlanMode::L3,
        IpvlanMode::L3s => IpVlanMode::L3S,
    }
}

pub(super) fn ipvlan_flag(flag: IpvlanFlag) -> IpVlanFlags {
    match flag {
        IpvlanFlag::Bridge => IpVlanFlags::empty(),
        IpvlanFlag::Private => IpVlanFlags::Private,
        IpvlanFlag::Vepa => IpVlanFlags::Vepa,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::temporary_name;

    #[test]
    fn temporary_names_fit_are_stable_and_differ_per_pod_and_interface() {
        let a = temporary_name(Path::new("/run/netns/a"), "eth1");
        assert!(a.len() <= 15, "{a}");
        assert_eq!(a, temporary_name(Path::new("/run/netns/a"), "eth1"));
        assert_ne!(a, temporary_name(Path::new("/run/netns/b"), "eth1"));
        assert_ne!(a, temporary_name(Path::new("/run/netns/a"), "eth2"));
    }
}
