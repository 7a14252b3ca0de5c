//! Changing the MTU of a running pod's flat interface in place (a subnet's
//! `spec.mtu` changed): no new interface, no lost address or route.

use netlink_packet_route::link::{InfoKind, LinkAttribute};

use super::{Attachments, LinkError, netlink::Netlink};

/// What [`Attachments::set_mtu`] found and did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MtuChange {
    /// The interface had the MTU already.
    Unchanged,
    /// The MTU was changed from the value given.
    Changed {
        /// The MTU before.
        from: u32,
    },
}

/// Which pod interface to change and what its parent is.
#[derive(Clone, Debug)]
pub struct MtuTarget<'a> {
    /// The subnet(s) asking, for messages.
    pub subnet: &'a str,
    /// The pod's network namespace file.
    pub netns: &'a std::path::Path,
    /// The interface in the pod.
    pub ifname: &'a str,
    /// The node interface it hangs off (`master` or `<master>.<vlan>`).
    pub parent: &'a str,
}

pub(super) async fn set_mtu(
    config: &Attachments,
    target: &MtuTarget<'_>,
    mtu: u32,
) -> Result<MtuChange, LinkError> {
    let host = config.host_link.get(config.host_netns.as_deref())?;
    let parent = host.existing_link(target.parent).await?;
    if let Some(parent_mtu) = parent.mtu.filter(|parent_mtu| mtu > *parent_mtu) {
        return Err(LinkError::MtuTooLarge {
            subnet: target.subnet.to_owned(),
            mtu,
            parent: parent.name,
            parent_mtu,
        });
    }
    let pod = Netlink::open(Some(target.netns))?;
    let link = pod.existing_link(target.ifname).await?;
    // Only a macvlan/ipvlan child of the recorded parent is flatnet's: an
    // interface someone put there under the same name is left alone.
    let ours = matches!(link.kind, Some(InfoKind::MacVlan | InfoKind::IpVlan))
        && link.parent_index == Some(parent.index);
    if !ours {
        return Err(LinkError::NotOurs {
            ifname: target.ifname.to_owned(),
            netns: pod.netns().to_owned(),
            parent: target.parent.to_owned(),
        });
    }
    let from = link.mtu.unwrap_or_default();
    if from == mtu {
        return Ok(MtuChange::Unchanged);
    }
    let mut message = rtnetlink::LinkUnspec::new_with_index(link.index).build();
    message.attributes.push(LinkAttribute::Mtu(mtu));
    pod.set_link("set MTU", target.ifname, message).await?;
    Ok(MtuChange::Changed { from })
}
