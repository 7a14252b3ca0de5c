//! Pod interfaces on the flat network: macvlan or ipvlan children of the
//! node's master interface (or of `<master>.<vlan>`), created directly in
//! the pod's network namespace over rtnetlink.
//!
//! The flow is validate → set up → tear down:
//! [`AttachmentSpec::validate`] checks everything that needs no system
//! call, [`Attachments::attach`] creates the interface all or nothing,
//! [`Attachments::check`] reports every way it differs from its spec, and
//! [`Attachments::detach`] removes it idempotently. See
//! `docs/datapath-attachment.md` for what is created and when it is removed.

mod announce;
mod attach;
mod check;
mod detach;
mod error;
mod mtu;
mod netlink;
mod node_links;
mod primary_mtu;
mod secondary;
mod spec;
mod vlan;

use std::path::PathBuf;

pub use announce::AnnounceSettings;
pub(crate) use announce::announcement_frames;
pub use detach::DetachSpec;
pub use error::LinkError;
pub use mtu::{MtuChange, MtuTarget};
pub use netlink::{FLATNET_ROUTE_PROTOCOL, SharedNetlink};
pub use node_links::{
    LEDGER_FILE as NODE_LINKS_LEDGER_FILE, Ledger as NodeLinksLedger, Made, NODE_LINK_ALIAS,
    NodeLinks, NodeLinksPass, read_ledger as read_node_links_ledger,
};
pub use primary_mtu::{PeerLink, PrimaryLinks};
pub use secondary::{SecondaryChange, interface_mac, set_secondary_addresses};
pub use spec::{
    ArpPolicy, AttachmentSpec, HostRoute, IpvlanFlag, IpvlanMode, LinkMode, MAX_IFNAME_LEN,
    MAX_VLAN_ID, MacvlanMode, ParentLink, PrimaryDefaults, PrimaryRoutes, RouteSpec, ValidSpec,
    check_ifname, format_mac, parse_mac,
};
pub use vlan::{DEFAULT_LEASE_DIR, VLAN_ALIAS};

use crate::packet::MacAddr;

/// A pod interface as created, for the CNI result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// The interface name in the pod.
    pub ifname: String,
    /// Its index in the pod's namespace.
    pub index: u32,
    /// Its MAC address (the kernel's choice when none was asked for).
    pub mac: MacAddr,
    /// Its MTU.
    pub mtu: u32,
    /// The pod's namespace path (the CNI `sandbox`).
    pub sandbox: PathBuf,
    /// The node interface it hangs off (`master` or `<master>.<vlan>`).
    pub parent: String,
    /// The parent's index in the node's namespace.
    pub parent_index: u32,
    /// The parent's MAC address.
    pub parent_mac: MacAddr,
}

/// The attachment layer of one node.
#[derive(Clone, Debug)]
pub struct Attachments {
    /// The node's namespace; `None` is the agent's own (production).
    pub host_netns: Option<PathBuf>,
    /// Where VLAN leases are kept (see [`DEFAULT_LEASE_DIR`]).
    pub lease_dir: PathBuf,
    /// Repetition of gratuitous ARP / unsolicited NA.
    pub announce: AnnounceSettings,
    /// The node namespace's netlink connection for ADD and CHECK.
    pub host_link: SharedNetlink,
}

impl Default for Attachments {
    fn default() -> Self {
        Self {
            host_netns: None,
            lease_dir: PathBuf::from(DEFAULT_LEASE_DIR),
            announce: AnnounceSettings::default(),
            host_link: SharedNetlink::default(),
        }
    }
}

/// What must hold before a pod interface comes up ([`Attachments::attach_valid_gated`]).
pub type BeforeUp<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + 'a>>;

impl Attachments {
    /// Creates the pod interface described by `spec`: VLAN interface when
    /// needed, the child in the pod namespace, MAC, MTU, addresses, link up,
    /// routes, node routes, announcements. On failure everything created is
    /// removed again before the error is returned.
    pub async fn attach(&self, spec: &AttachmentSpec) -> Result<Attachment, LinkError> {
        self.attach_valid(&spec.validate()?).await
    }

    /// [`Attachments::attach`] for a spec the caller validated already.
    pub async fn attach_valid(&self, valid: &ValidSpec) -> Result<Attachment, LinkError> {
        attach::attach(self, valid, None).await
    }

    /// [`Attachments::attach_valid`], awaiting `before_up` once the pod
    /// interface has its addresses and before it comes up, so before
    /// anything announces them: `false` stops the attach
    /// ([`LinkError::StoppedBeforeUp`]), which removes what it made.
    pub async fn attach_valid_gated(
        &self,
        valid: &ValidSpec,
        before_up: BeforeUp<'_>,
    ) -> Result<Attachment, LinkError> {
        attach::attach(self, valid, Some(before_up)).await
    }

    /// Verifies that the pod interface matches `spec`; the error lists
    /// every difference.
    pub async fn check(&self, spec: &AttachmentSpec) -> Result<(), LinkError> {
        let valid = spec.validate()?;
        check::check(self, &valid).await
    }

    /// Where the node routes to a pod's addresses go (`addPodIPToHost`):
    /// the node link that reaches the pod's `primary` interface (found
    /// like `ip route get <its address>`), via that interface's addresses.
    /// IPv6 needs a next hop (the pod answers neighbour solicitations only
    /// for addresses of the asking interface), so the primary's link-local
    /// address serves when it has no global one.
    pub async fn resolve_host_route(
        &self,
        netns: &std::path::Path,
        primary: &str,
    ) -> Result<HostRoute, LinkError> {
        attach::resolve_host_route(self, netns, primary).await
    }

    /// The default gateways of the pod's `primary` interface (none when it
    /// does not exist), recorded before the flat interface takes the
    /// default route over.
    pub async fn primary_defaults(
        &self,
        netns: &std::path::Path,
        primary: &str,
    ) -> Result<PrimaryDefaults, LinkError> {
        detach::primary_defaults(netns, primary).await
    }

    /// Sets the MTU of a running pod's flat interface (after checking it
    /// against the parent's and that the interface is flatnet's child of
    /// that parent); nothing else about the interface changes.
    pub async fn set_mtu(&self, target: &MtuTarget<'_>, mtu: u32) -> Result<MtuChange, LinkError> {
        mtu::set_mtu(self, target, mtu).await
    }

    /// The MTU of a running pod's primary interface `ifname` and of its
    /// node-side peer (a veth's other end), as they are now.
    pub async fn primary_links(
        &self,
        netns: &std::path::Path,
        ifname: &str,
    ) -> Result<PrimaryLinks, LinkError> {
        primary_mtu::primary_links(self, netns, ifname).await
    }

    /// Sets `mtu` on the pod's primary interface `ifname` and, when given,
    /// the peer's MTU on that peer if it is still the interface's peer.
    /// Returns whether anything changed.
    pub async fn set_primary_mtu(
        &self,
        netns: &std::path::Path,
        ifname: &str,
        mtu: u32,
        peer_mtu: Option<(&PeerLink, u32)>,
    ) -> Result<bool, LinkError> {
        primary_mtu::set_primary_mtu(self, netns, ifname, mtu, peer_mtu).await
    }

    /// Brings the node's VLAN sub-interfaces and bridges in line with
    /// `wanted`: makes what is missing, removes what flatnet made and
    /// nothing asks for ([`node_links`](self::node_links) says what is
    /// whose); `node` names the node in messages.
    pub async fn apply_node_links(&self, node: &str, wanted: &NodeLinks) -> NodeLinksPass {
        node_links::apply(self, node, wanted).await
    }

    /// Names of every link in the node's namespace (STATUS checks masters).
    pub async fn host_link_names(&self) -> Result<std::collections::BTreeSet<String>, LinkError> {
        let host = self.host_link.get(self.host_netns.as_deref())?;
        Ok(host.links().await?.into_iter().map(|l| l.name).collect())
    }

    /// Removes the pod interface, flatnet's node routes to it and, when no
    /// longer used, the VLAN interface flatnet created. Anything already
    /// gone is not an error.
    pub async fn detach(&self, spec: &DetachSpec) -> Result<(), LinkError> {
        detach::detach(self, spec).await
    }
}
