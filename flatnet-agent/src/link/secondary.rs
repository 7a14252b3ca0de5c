//! Secondary addresses on an existing pod interface (a pod's floating
//! addresses): added and announced, or removed, without touching the
//! interface's other addresses.

use std::{net::IpAddr, path::Path};

use ipnet::IpNet;

use super::{AnnounceSettings, LinkError, announce::announce, netlink::Netlink};
use crate::packet::MacAddr;

/// What [`set_secondary_addresses`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SecondaryChange {
    /// Addresses added (and announced).
    pub added: Vec<IpNet>,
    /// Addresses removed.
    pub removed: Vec<IpNet>,
}

/// Makes interface `ifname` in the namespace at `netns` hold the `wanted`
/// addresses among those `managed` says are its to manage: adds the
/// missing ones and announces them from the interface's MAC (gratuitous
/// ARP / unsolicited NA, `settings` rounds; with `announce_present`, the
/// wanted ones already there too), removes managed ones not wanted. Other
/// addresses stay.
///
/// # Errors
/// The namespace or interface missing, or netlink refusing a change.
pub async fn set_secondary_addresses(
    netns: &Path,
    ifname: &str,
    wanted: &[IpNet],
    managed: impl Fn(IpAddr) -> bool,
    settings: AnnounceSettings,
    announce_present: bool,
) -> Result<SecondaryChange, LinkError> {
    let netlink = Netlink::open(Some(netns))?;
    let link = netlink.existing_link(ifname).await?;
    let present = netlink.addresses(link.index).await?;
    let mut change = SecondaryChange::default();
    for net in &present {
        if managed(net.addr())
            && !wanted.iter().any(|w| w.addr() == net.addr())
            && netlink.delete_address(link.index, ifname, *net).await?
        {
            change.removed.push(*net);
        }
    }
    for net in wanted {
        if present.iter().any(|p| p.addr() == net.addr()) {
            continue;
        }
        netlink.add_address(link.index, ifname, *net).await?;
        change.added.push(*net);
    }
    let announced = if announce_present {
        wanted
    } else {
        &change.added[..]
    };
    if let (false, Some(mac)) = (announced.is_empty(), link.mac) {
        announce(netns, ifname, mac, announced, settings).await?;
    }
    Ok(change)
}

/// The MAC of interface `ifname` in the namespace at `netns`, `None` while
/// it is down.
///
/// # Errors
/// The namespace or interface missing.
pub async fn interface_mac(netns: &Path, ifname: &str) -> Result<Option<MacAddr>, LinkError> {
    let link = Netlink::open(Some(netns))?.existing_link(ifname).await?;
    Ok(link.mac.filter(|_| link.up))
}
