//! A route-netlink connection bound to one network namespace, with the few
//! typed operations the attachment layer needs.
//!
//! A netlink socket belongs to the namespace it was created in, so the
//! socket for a pod is created on a thread inside the pod's namespace
//! ([`run_in_netns`]) and then used from async code anywhere.

use std::{
    net::IpAddr,
    path::Path,
    sync::{Arc, Mutex},
};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::{
    AddressFamily,
    address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope},
    link::{InfoData, InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope},
};
use rtnetlink::{Handle, RouteMessageBuilder};
use tokio::task::JoinHandle;

use super::{LinkError, error::errno_of};
use crate::{
    netns::{HeldNetns, run_in_netns},
    packet::MacAddr,
};

/// Routes flatnet adds on the node carry this protocol number, so they can
/// be told apart from everyone else's (`ip route show proto 241`).
pub const FLATNET_ROUTE_PROTOCOL: u8 = 241;

/// A netlink connection to one namespace. The connection task ends on drop.
pub(crate) struct Netlink {
    handle: Handle,
    connection: JoinHandle<()>,
    netns: String,
}

impl Drop for Netlink {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// The facts about a link the attachment layer looks at.
#[derive(Clone, Debug)]
pub(crate) struct Link {
    pub index: u32,
    pub name: String,
    pub kind: Option<InfoKind>,
    pub data: Option<InfoData>,
    pub mac: Option<MacAddr>,
    pub mtu: Option<u32>,
    pub up: bool,
    /// `IFLA_LINK`: the parent's index (in the parent's namespace).
    pub parent_index: Option<u32>,
    /// `IFLA_LINK_NETNSID`: set when the parent is in another namespace.
    pub parent_netnsid: Option<i32>,
    pub alias: Option<String>,
    /// `IFLA_MASTER`: the bridge (or bond) this link is a port of.
    pub controller: Option<u32>,
}

impl Link {
    fn from_message(message: LinkMessage) -> Self {
        let mut link = Self {
            index: message.header.index,
            name: String::new(),
            kind: None,
            data: None,
            mac: None,
            mtu: None,
            up: message.header.flags.contains(LinkFlags::Up),
            parent_index: None,
            parent_netnsid: None,
            alias: None,
            controller: None,
        };
        for attribute in message.attributes {
            match attribute {
                LinkAttribute::IfName(name) => link.name = name,
                LinkAttribute::Mtu(mtu) => link.mtu = Some(mtu),
                LinkAttribute::Link(index) => link.parent_index = Some(index),
                LinkAttribute::LinkNetNsId(id) => link.parent_netnsid = Some(id),
                LinkAttribute::IfAlias(alias) => link.alias = Some(alias),
                LinkAttribute::Controller(index) => link.controller = Some(index),
                LinkAttribute::Address(bytes) => link.mac = bytes.try_into().ok(),
                LinkAttribute::LinkInfo(infos) => {
                    for info in infos {
                        match info {
                            LinkInfo::Kind(kind) => link.kind = Some(kind),
                            LinkInfo::Data(data) => link.data = Some(data),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        link
    }
}

/// One namespace's connection, opened on first use and shared by later
/// users: rtnetlink runs concurrent requests over one socket, and opening
/// a socket in another namespace costs a thread. The connection runs on
/// the runtime of its first user, so callers on short-lived runtimes open
/// their own ([`Netlink::open`]); one whose runtime has ended is opened
/// again.
#[derive(Clone, Default)]
pub struct SharedNetlink(Arc<Mutex<Option<Arc<Netlink>>>>);

impl std::fmt::Debug for SharedNetlink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedNetlink").finish_non_exhaustive()
    }
}

impl SharedNetlink {
    /// The shared connection to `netns` (see [`Netlink::open`]); every
    /// call must name the same namespace.
    pub(crate) fn get(&self, netns: Option<&Path>) -> Result<Arc<Netlink>, LinkError> {
        let mut slot = self.0.lock().expect("netlink connection lock poisoned");
        if let Some(open) = slot.as_ref().filter(|n| !n.connection.is_finished()) {
            return Ok(Arc::clone(open));
        }
        let opened = Arc::new(Netlink::open(netns)?);
        *slot = Some(Arc::clone(&opened));
        Ok(opened)
    }
}

impl Netlink {
    /// A connection to the namespace at `netns`, or to the calling
    /// process's namespace when `None`. Must run inside a tokio runtime.
    pub(crate) fn open(netns: Option<&Path>) -> Result<Self, LinkError> {
        match netns {
            None => Self::open_here("host".into()),
            Some(path) => {
                let name = path.display().to_string();
                run_in_netns(path, Self::open_there(name))?
            }
        }
    }

    /// A connection to the held namespace `netns`. Must run inside a tokio
    /// runtime.
    pub(crate) fn open_held(netns: &HeldNetns) -> Result<Self, LinkError> {
        netns.run(Self::open_there(netns.path().to_owned()))?
    }

    /// Opens the connection on a namespace thread, registered with the
    /// caller's runtime.
    fn open_there(name: String) -> impl FnOnce() -> Result<Self, LinkError> + Send {
        let runtime = tokio::runtime::Handle::current();
        move || {
            // Registers the socket with this runtime's reactor.
            let _entered = runtime.enter();
            Self::open_here(name)
        }
    }

    fn open_here(netns: String) -> Result<Self, LinkError> {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(|source| LinkError::Socket {
                netns: netns.clone(),
                source,
            })?;
        Ok(Self {
            handle,
            connection: tokio::spawn(connection),
            netns,
        })
    }

    /// The namespace this connection talks to, for messages.
    pub(crate) fn netns(&self) -> &str {
        &self.netns
    }

    fn error(&self, op: &'static str, object: impl Into<String>, e: rtnetlink::Error) -> LinkError {
        LinkError::netlink(op, object, self.netns.clone(), e)
    }

    /// The link called `name`, or `None` when there is none.
    pub(crate) async fn link_by_name(&self, name: &str) -> Result<Option<Link>, LinkError> {
        let mut request = std::pin::pin!(self.handle.link().get().match_name(name).execute());
        match request.try_next().await {
            Ok(message) => Ok(message.map(Link::from_message)),
            Err(e) if errno_of(&e) == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(self.error("get link", name, e)),
        }
    }

    /// The link called `name`; [`LinkError::NotFound`] when there is none.
    pub(crate) async fn existing_link(&self, name: &str) -> Result<Link, LinkError> {
        self.link_by_name(name)
            .await?
            .ok_or_else(|| LinkError::NotFound {
                ifname: name.to_owned(),
                netns: self.netns.clone(),
            })
    }

    /// Every link of the namespace.
    pub(crate) async fn links(&self) -> Result<Vec<Link>, LinkError> {
        self.handle
            .link()
            .get()
            .execute()
            .map_ok(Link::from_message)
            .try_collect()
            .await
            .map_err(|e| self.error("list links", "", e))
    }

    /// Sends RTM_NEWLINK (create, exclusive).
    pub(crate) async fn create_link(
        &self,
        op: &'static str,
        name: &str,
        message: LinkMessage,
    ) -> Result<(), LinkError> {
        self.handle
            .link()
            .add(message)
            .execute()
            .await
            .map_err(|e| self.error(op, name, e))
    }

    /// Sends RTM_SETLINK.
    pub(crate) async fn set_link(
        &self,
        op: &'static str,
        name: &str,
        message: LinkMessage,
    ) -> Result<(), LinkError> {
        self.handle
            .link()
            .set(message)
            .execute()
            .await
            .map_err(|e| self.error(op, name, e))
    }

    /// Deletes a link; `Ok(false)` when it was already gone.
    pub(crate) async fn delete_link(&self, index: u32, name: &str) -> Result<bool, LinkError> {
        match self.handle.link().del(index).execute().await {
            Ok(()) => Ok(true),
            Err(e) if errno_of(&e) == Some(libc::ENODEV) => Ok(false),
            Err(e) => Err(self.error("delete link", name, e)),
        }
    }

    /// Adds an address; IPv6 addresses skip duplicate address detection
    /// (flatnet's IPAM hands each address to one pod, and a tentative
    /// address could not be used by the routes added right after).
    pub(crate) async fn add_address(
        &self,
        index: u32,
        ifname: &str,
        net: IpNet,
    ) -> Result<(), LinkError> {
        let mut request = self
            .handle
            .address()
            .add(index, net.addr(), net.prefix_len());
        if net.addr().is_ipv6() {
            request
                .message_mut()
                .attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        request
            .execute()
            .await
            .map_err(|e| self.error("add address", format!("{net} on {ifname}"), e))
    }

    /// Deletes an address; `Ok(false)` when the link does not hold it.
    pub(crate) async fn delete_address(
        &self,
        index: u32,
        ifname: &str,
        net: IpNet,
    ) -> Result<bool, LinkError> {
        let mut message = AddressMessage::default();
        message.header.family = match net.addr() {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        message.header.prefix_len = net.prefix_len();
        message.header.index = index;
        message
            .attributes
            .push(AddressAttribute::Address(net.addr()));
        if let IpAddr::V4(addr) = net.addr() {
            message
                .attributes
                .push(AddressAttribute::Local(addr.into()));
        }
        match self.handle.address().del(message).execute().await {
            Ok(()) => Ok(true),
            Err(e) if errno_of(&e) == Some(libc::EADDRNOTAVAIL) => Ok(false),
            Err(e) => Err(self.error("delete address", format!("{net} on {ifname}"), e)),
        }
    }

    /// The global-scope addresses of a link.
    pub(crate) async fn addresses(&self, index: u32) -> Result<Vec<IpNet>, LinkError> {
        let messages: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(|e| self.error("list addresses", format!("of link {index}"), e))?;
        Ok(messages
            .into_iter()
            .filter(|m| m.header.index == index && m.header.scope == AddressScope::Universe)
            .filter_map(|m| {
                let prefix = m.header.prefix_len;
                m.attributes.into_iter().find_map(|a| match a {
                    AddressAttribute::Address(ip) => IpNet::new(ip, prefix).ok(),
                    _ => None,
                })
            })
            .collect())
    }

    /// Adds a route; `replace` overwrites an existing route with the same
    /// destination and metric instead of failing with `EEXIST`.
    pub(crate) async fn add_route(&self, route: &Route, replace: bool) -> Result<(), LinkError> {
        let request = self.handle.route().add(route.message());
        let request = if replace { request.replace() } else { request };
        request
            .execute()
            .await
            .map_err(|e| self.error("add route", route.to_string(), e))
    }

    /// Deletes a route; `Ok(false)` when no such route exists.
    pub(crate) async fn delete_route(&self, route: &Route) -> Result<bool, LinkError> {
        match self.handle.route().del(route.message()).execute().await {
            Ok(()) => Ok(true),
            Err(e) if matches!(errno_of(&e), Some(libc::ESRCH | libc::ENOENT)) => Ok(false),
            Err(e) => Err(self.error("delete route", route.to_string(), e)),
        }
    }

    /// The unicast routes of the main table for one family.
    pub(crate) async fn routes(&self, ipv4: bool) -> Result<Vec<Route>, LinkError> {
        let query = if ipv4 {
            RouteMessageBuilder::<std::net::Ipv4Addr>::new().build()
        } else {
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build()
        };
        let messages: Vec<RouteMessage> = self
            .handle
            .route()
            .get(query)
            .execute()
            .try_collect()
            .await
            .map_err(|e| self.error("list routes", if ipv4 { "IPv4" } else { "IPv6" }, e))?;
        Ok(messages
            .into_iter()
            .filter_map(Route::from_message)
            .collect())
    }
}

/// A unicast route in the main table, as flatnet reads and writes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Route {
    pub destination: IpNet,
    pub via: Option<IpAddr>,
    pub oif: Option<u32>,
    pub source: Option<IpAddr>,
    pub metric: Option<u32>,
    pub protocol: RouteProtocol,
}

impl Route {
    /// A static route through `oif`.
    pub(crate) fn new(destination: IpNet, via: Option<IpAddr>, oif: u32) -> Self {
        Self {
            destination,
            via,
            oif: Some(oif),
            source: None,
            metric: None,
            protocol: RouteProtocol::Static,
        }
    }

    fn from_message(message: RouteMessage) -> Option<Self> {
        let header = &message.header;
        if header.table != RouteHeader::RT_TABLE_MAIN {
            return None;
        }
        let prefix = header.destination_prefix_length;
        let mut destination = None;
        let mut route = Self {
            destination: IpNet::default(),
            via: None,
            oif: None,
            source: None,
            metric: None,
            protocol: header.protocol,
        };
        let unspecified: IpAddr = match header.address_family {
            AddressFamily::Inet => std::net::Ipv4Addr::UNSPECIFIED.into(),
            AddressFamily::Inet6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
            _ => return None,
        };
        for attribute in &message.attributes {
            match attribute {
                RouteAttribute::Destination(a) => destination = ip_of(a),
                RouteAttribute::Gateway(a) => route.via = ip_of(a),
                RouteAttribute::PrefSource(a) => route.source = ip_of(a),
                RouteAttribute::Oif(i) => route.oif = Some(*i),
                RouteAttribute::Priority(p) => route.metric = Some(*p),
                _ => {}
            }
        }
        route.destination = IpNet::new(destination.unwrap_or(unspecified), prefix).ok()?;
        Some(route)
    }

    fn message(&self) -> RouteMessage {
        let dst = self.destination;
        let mut builder = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(dst.addr(), dst.prefix_len())
            .expect("an IpNet is a valid destination");
        if let Some(via) = self.via {
            builder = builder
                .gateway(via)
                .expect("families checked by validation");
        }
        if let Some(source) = self.source {
            builder = builder
                .pref_source(source)
                .expect("families checked by validation");
        }
        if let Some(oif) = self.oif {
            builder = builder.output_interface(oif);
        }
        if let Some(metric) = self.metric {
            builder = builder.priority(metric);
        }
        if self.via.is_none() {
            // Without a gateway the destination is on the link.
            builder = builder.scope(RouteScope::Link);
        }
        builder.protocol(self.protocol).build()
    }

    /// Whether the route is a default route.
    pub(crate) fn is_default(&self) -> bool {
        self.destination.prefix_len() == 0
    }
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.destination)?;
        if let Some(via) = self.via {
            write!(f, " via {via}")?;
        }
        if let Some(oif) = self.oif {
            write!(f, " dev #{oif}")?;
        }
        if let Some(source) = self.source {
            write!(f, " src {source}")?;
        }
        if let Some(metric) = self.metric {
            write!(f, " metric {metric}")?;
        }
        Ok(())
    }
}

fn ip_of(address: &RouteAddress) -> Option<IpAddr> {
    match address {
        RouteAddress::Inet(v4) => Some((*v4).into()),
        RouteAddress::Inet6(v6) => Some((*v6).into()),
        _ => None,
    }
}
