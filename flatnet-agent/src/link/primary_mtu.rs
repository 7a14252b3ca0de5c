//! The MTU of a running pod's primary interface (`eth0`, usually the
//! cluster network's veth) and of its node-side peer, read and set in
//! place: no new interface, no lost address or route.

use netlink_packet_route::link::{InfoKind, LinkAttribute};
use serde::{Deserialize, Serialize};

use super::{
    Attachments, LinkError,
    netlink::{Link, Netlink},
};

/// The node-side end of a pod's veth.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerLink {
    /// Its index in the node's namespace.
    pub index: u32,
    /// Its name there.
    pub name: String,
    /// Its MTU.
    pub mtu: u32,
}

/// A pod's primary interface and its peer as found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrimaryLinks {
    /// The pod interface's MTU.
    pub mtu: u32,
    /// The node-side peer, when the interface is a veth whose other end
    /// is in the node's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<PeerLink>,
}

/// The node-side peer of `link` (in the pod's namespace): a veth of the
/// node whose own peer is `link`.
async fn peer_of(host: &Netlink, link: &Link) -> Result<Option<PeerLink>, LinkError> {
    if link.kind != Some(InfoKind::Veth) || link.parent_netnsid.is_none() {
        return Ok(None);
    }
    let Some(index) = link.parent_index else {
        return Ok(None);
    };
    let peer = host.links().await?.into_iter().find(|l| {
        l.index == index
            && l.kind == Some(InfoKind::Veth)
            && l.parent_netnsid.is_some()
            && l.parent_index == Some(link.index)
    });
    Ok(peer.map(|p| PeerLink {
        index: p.index,
        name: p.name,
        mtu: p.mtu.unwrap_or_default(),
    }))
}

pub(super) async fn primary_links(
    config: &Attachments,
    netns: &std::path::Path,
    ifname: &str,
) -> Result<PrimaryLinks, LinkError> {
    let host = config.host_link.get(config.host_netns.as_deref())?;
    let pod = Netlink::open(Some(netns))?;
    let link = pod.existing_link(ifname).await?;
    Ok(PrimaryLinks {
        mtu: link.mtu.unwrap_or_default(),
        peer: peer_of(&host, &link).await?,
    })
}

async fn set_link_mtu(netlink: &Netlink, link: &Link, mtu: u32) -> Result<bool, LinkError> {
    if link.mtu == Some(mtu) {
        return Ok(false);
    }
    let mut message = rtnetlink::LinkUnspec::new_with_index(link.index).build();
    message.attributes.push(LinkAttribute::Mtu(mtu));
    netlink.set_link("set MTU", &link.name, message).await?;
    Ok(true)
}

pub(super) async fn set_primary_mtu(
    config: &Attachments,
    netns: &std::path::Path,
    ifname: &str,
    mtu: u32,
    peer_mtu: Option<(&PeerLink, u32)>,
) -> Result<bool, LinkError> {
    let host = config.host_link.get(config.host_netns.as_deref())?;
    let pod = Netlink::open(Some(netns))?;
    let link = pod.existing_link(ifname).await?;
    let mut changed = set_link_mtu(&pod, &link, mtu).await?;
    crate::crash_point::crash_point("primary-mtu-pod-set");
    if let Some((peer, peer_mtu)) = peer_mtu {
        // The same veth as remembered: same index, same name, still its peer.
        let current = host.links().await?.into_iter().find(|l| {
            l.index == peer.index && l.name == peer.name && l.parent_index == Some(link.index)
        });
        if let Some(current) = current {
            changed |= set_link_mtu(&host, &current, peer_mtu).await?;
        }
    }
    Ok(changed)
}
