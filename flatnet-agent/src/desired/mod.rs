//! Where the agent learns what a pod's flat interface should look like:
//! which subnet, which address, which MAC. One trait, [`DesiredState`], with
//! two sources: the Kubernetes API ([`kubernetes`], production) and a local
//! YAML state file with local IPAM ([`standalone`], hosts without
//! Kubernetes, the lab and the data-plane tests).

pub mod kubernetes;
pub mod standalone;
pub mod status;

use std::{collections::BTreeMap, fmt, future::Future, net::IpAddr, path::PathBuf, sync::Arc};

use flatnet_k8s::{
    api::FlatNetworkSubnetSpec,
    validation::{InvalidSubnet, ValidSubnet, validate_subnet},
};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::{
    cni::{CniError, ErrorCode},
    datapath::Conflict,
    packet::MacAddr,
};

/// One attachment: a container's interface on a network.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AttachmentKey {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
}

impl fmt::Display for AttachmentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "container {} interface {}",
            self.container_id, self.ifname
        )
    }
}

/// The pod behind an attachment, from `CNI_ARGS`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    /// `K8S_POD_NAMESPACE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// `K8S_POD_NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `K8S_POD_UID`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.namespace, &self.name) {
            (Some(ns), Some(name)) => write!(f, "pod {ns}/{name}"),
            _ => f.write_str("a pod without Kubernetes arguments"),
        }
    }
}

/// A subnet by name with the spec it had when the attachment was made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NamedSubnet {
    /// The subnet's name.
    pub name: String,
    /// Its spec (the FlatNetworkSubnet spec format).
    pub spec: FlatNetworkSubnetSpec,
    /// The pod also gets the 6to4 address of its IPv4 address (the
    /// subnet's `flatnetwork.pandaria.io/ipv6to4` annotation, which the
    /// operator copies onto the FlatNetworkIPs).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ipv6to4: bool,
}

impl NamedSubnet {
    /// The validated subnet.
    pub fn validate(&self) -> Result<ValidSubnet, InvalidSubnet> {
        validate_subnet(&self.name, &self.spec)
    }
}

/// Container IDs of hot-plugged attachments start with this: the runtime's
/// GC never lists them, and only the hot-plug pass adds or removes them.
pub const HOTPLUG_CONTAINER_PREFIX: &str = "hotplug-";

/// An extra flat interface the desired state wants in a running pod,
/// beside what the runtime's CNI ADDs made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HotplugAttachment {
    /// Unique per pod and interface: the attachment's container ID is
    /// [`HOTPLUG_CONTAINER_PREFIX`] followed by it.
    pub name: String,
    /// The pod's network namespace; `None`: the namespace of the pod's
    /// own attachments, from the agent's records (Kubernetes, where only
    /// the pod is known).
    pub netns: Option<PathBuf>,
    /// The pod, for policy and messages.
    pub pod: PodRef,
    /// The CNI network the interface is on.
    pub network: String,
    /// The interface name in the pod.
    pub ifname: String,
}

impl HotplugAttachment {
    /// The attachment's key in the records.
    #[must_use]
    pub fn key(&self) -> AttachmentKey {
        AttachmentKey {
            container_id: format!("{HOTPLUG_CONTAINER_PREFIX}{}", self.name),
            ifname: self.ifname.clone(),
        }
    }
}

impl AttachmentKey {
    /// Whether the hot-plug pass made this attachment.
    #[must_use]
    pub fn is_hotplug(&self) -> bool {
        self.container_id.starts_with(HOTPLUG_CONTAINER_PREFIX)
    }
}

/// The MTU a running pod's primary interface ([`PRIMARY_IFNAME`]) and its
/// node-side peer must have (`PodNetworkConfig.spec.primary.mtu`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrimaryMtu {
    /// Unique per pod: the standalone entry's name, the Kubernetes pod's
    /// UID. What the agent remembers of the pod is kept under it.
    pub name: String,
    /// The pod's network namespace; `None`: found as for a hot-plugged
    /// interface (the agent's records, else the container runtime).
    pub netns: Option<PathBuf>,
    /// The pod, for finding its namespace and for messages.
    pub pod: PodRef,
    /// The MTU.
    pub mtu: u32,
    /// Whether the TCP MSS clamping programs go onto the primary interface
    /// (see `datapath::Datapath::attach_mss_clamp`).
    pub tcp_mss_clamp: bool,
}

/// The interface [`PrimaryMtu`] is about: the pod's primary interface.
pub const PRIMARY_IFNAME: &str = "eth0";

/// The node interfaces `vlans` and `bridges` (as a PodNetworkConfig or the
/// state file writes them, validated) ask for.
#[must_use]
pub fn node_links_of(
    vlans: &[flatnet_k8s::api::NodeVlan],
    bridges: &[flatnet_k8s::api::NodeBridge],
) -> crate::link::NodeLinks {
    let mut links = crate::link::NodeLinks::default();
    for vlan in vlans {
        if let Ok(id) = u16::try_from(vlan.id) {
            links.vlans.insert((vlan.master.clone(), id));
        }
    }
    for bridge in bridges {
        links
            .bridges
            .entry(bridge.name.clone())
            .or_default()
            .extend(bridge.ports.iter().cloned());
    }
    links
}

/// What ADD asks the desired state for.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    /// The CNI network name (`name` of the network configuration).
    pub network: String,
    /// `subnet` of the network configuration, when set.
    pub subnet: Option<String>,
    /// The attachment.
    pub key: AttachmentKey,
    /// The pod.
    pub pod: PodRef,
    /// Addresses the runtime asks for (`runtimeConfig.ips`).
    pub requested_ips: Vec<IpAddr>,
    /// MAC the runtime asks for (`runtimeConfig.mac`).
    pub requested_mac: Option<MacAddr>,
}

/// The desired flat interface of one attachment.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredInterface {
    /// One subnet per address family, all on the same parent link and mode.
    pub subnets: Vec<NamedSubnet>,
    /// One address per subnet, with the subnet's prefix length.
    pub addresses: Vec<IpNet>,
    /// Fixed MAC, when one was chosen.
    pub mac: Option<MacAddr>,
}

/// The desired state could not be read or changed.
#[derive(Debug, thiserror::Error)]
pub enum DesiredStateError {
    /// No subnet is known for the network.
    #[error("{0}")]
    SubnetNotFound(String),
    /// The operator has not allocated an address (yet).
    #[error("{0}")]
    NotAllocated(String),
    /// No address could be allocated locally.
    #[error("{0}")]
    Allocation(String),
    /// The request lacks what this source needs (for example the pod name).
    #[error("{0}")]
    InvalidRequest(String),
    /// A subnet or network definition is unusable.
    #[error("{0}")]
    InvalidDefinition(String),
    /// A transient failure (API server unreachable, ...).
    #[error("{0}")]
    Unavailable(String),
    /// Local state could not be read or written.
    #[error("{0}")]
    Storage(String),
}

impl DesiredStateError {
    /// The CNI error returned to the runtime.
    pub fn to_cni(&self) -> CniError {
        let code = match self {
            DesiredStateError::SubnetNotFound(_) => ErrorCode::SubnetNotFound,
            DesiredStateError::NotAllocated(_) | DesiredStateError::Unavailable(_) => {
                ErrorCode::TryAgainLater
            }
            DesiredStateError::Allocation(_) => ErrorCode::AddressNotAllocated,
            DesiredStateError::InvalidRequest(_) => ErrorCode::InvalidEnvironment,
            DesiredStateError::InvalidDefinition(_) => ErrorCode::InvalidNetworkConfig,
            DesiredStateError::Storage(_) => ErrorCode::AgentInternal,
        };
        CniError::new(code, self.to_string())
    }
}

/// The agent's source of desired state.
///
/// `claim` may allocate (standalone); every allocation it makes is keyed by
/// the attachment, so `release` with the same key undoes it even after an
/// agent restart, and releasing something never claimed is success.
pub trait DesiredState: Send + Sync + 'static {
    /// Short name for logs (`kubernetes`, `standalone`).
    fn kind(&self) -> &'static str;

    /// Whether [`DesiredState::report_active`] tells anyone: when not, an
    /// attachment owes no report.
    const REPORTS_ACTIVE: bool = false;

    /// The subnet(s), address(es) and MAC of an attachment; the same answer
    /// when asked again for the same key.
    fn claim(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<DesiredInterface, DesiredStateError>> + Send;

    /// The attachment's interface is up: what must be recorded before ADD
    /// answers (standalone: the allocation is in the allocation file;
    /// nothing by default, as in Kubernetes, where the operator made the
    /// allocation durable and [`DesiredState::report_active`] follows).
    fn activate(&self) -> impl Future<Output = Result<(), DesiredStateError>> + Send {
        async { Ok(()) }
    }

    /// The interface of attachment `key` of `pod` on `subnets` is up with
    /// `mac` and `mtu`: told, after ADD has answered, to whoever watches
    /// the allocation (Kubernetes: the status `Active` with the MAC, MTU
    /// and node, and the node label; nobody by default, with
    /// [`DesiredState::REPORTS_ACTIVE`] false). Nothing the pod needs
    /// waits for it; the agent repeats it until it goes through or the
    /// attachment is gone, and after a restart. Telling what is already
    /// known asks nothing.
    fn report_active(
        &self,
        _key: &AttachmentKey,
        _pod: &PodRef,
        _subnets: &[NamedSubnet],
        _mac: MacAddr,
        _mtu: u32,
    ) -> impl Future<Output = Result<(), DesiredStateError>> + Send {
        async { Ok(()) }
    }

    /// The `spec.mtu` of every subnet known now, by name (`None`: unset),
    /// for changing the MTU of running pods. Empty while unknown.
    fn subnet_mtus(&self) -> impl Future<Output = BTreeMap<String, Option<u32>>> + Send;

    /// The flat interface of attachment `key` of `pod` on `subnets`
    /// carries `mtu` now (Kubernetes: its FlatNetworkIPs' `status.mtu`).
    fn report_mtu(
        &self,
        key: &AttachmentKey,
        pod: &PodRef,
        subnets: &[NamedSubnet],
        mtu: u32,
    ) -> impl Future<Output = Result<(), DesiredStateError>> + Send;

    /// Gives back what `claim` allocated for `key` on `network`; idempotent.
    fn release(
        &self,
        network: &str,
        key: &AttachmentKey,
    ) -> impl Future<Output = Result<(), DesiredStateError>> + Send;

    /// Gives back every allocation of `network` whose key is not in `keep`.
    fn release_except(
        &self,
        network: &str,
        keep: &[AttachmentKey],
    ) -> impl Future<Output = Result<(), DesiredStateError>> + Send;

    /// `Ok` when ADD can be served, else why not.
    fn readiness(&self) -> Result<(), String>;

    /// The subnets `network` allocates from (`subnet`, comma-separated, when
    /// the configuration names them), with their free addresses; for STATUS.
    fn capacity(
        &self,
        network: &str,
        subnet: Option<&str>,
    ) -> impl Future<Output = Result<Vec<status::SubnetCapacity>, DesiredStateError>> + Send;

    /// The extra interfaces running pods must have now; `None` while
    /// unknown (nothing hot-plugged is removed then).
    fn hotplug_attachments(&self) -> impl Future<Output = Option<Vec<HotplugAttachment>>> + Send;

    /// The hot-plug pass made `attachment` (`failure` is `None`) or could
    /// not (why), for users to see (Kubernetes: the `Attached` condition
    /// of its FlatNetworkIP, written only when it changes).
    fn report_hotplug(
        &self,
        attachment: &HotplugAttachment,
        failure: Option<&str>,
    ) -> impl Future<Output = Result<(), DesiredStateError>> + Send;

    /// The primary-interface MTUs running pods on this node must have now;
    /// `None` while unknown (nothing is set back then).
    fn primary_mtus(&self) -> impl Future<Output = Option<Vec<PrimaryMtu>>> + Send;

    /// How a pass went for each pod it was asked about: set (`None`) or
    /// why not, for users to see (Kubernetes: the status of the node's
    /// FlatNetworkNodeConfig, written only when it changes).
    fn report_primary_mtus(
        &self,
        results: &[(PrimaryMtu, Option<String>)],
    ) -> impl Future<Output = Result<(), DesiredStateError>> + Send;

    /// The VLAN sub-interfaces and bridges the node must have now; `None`
    /// while unknown (nothing is removed then).
    fn node_links(&self) -> impl Future<Output = Option<crate::link::NodeLinks>> + Send;

    /// How the last pass went for each wanted interface (`<master>.<id>`,
    /// bridge name): `None` when it is as asked, else why not (Kubernetes:
    /// the status of the node's FlatNetworkNodeConfig, written only when
    /// it changes).
    fn report_node_links(
        &self,
        results: &BTreeMap<String, Option<String>>,
    ) -> impl Future<Output = Result<(), DesiredStateError>> + Send;

    /// Makes a conflict on an address of `pod` visible to users.
    fn report_conflict(
        &self,
        pod: &PodRef,
        conflict: &Conflict,
    ) -> impl Future<Output = Result<(), DesiredStateError>> + Send;

    /// The addresses allocated to pods bound to this node whose ADD has
    /// not come yet, for the conflict probe to ask the LAN about ahead of
    /// it; `None` where they cannot be known ahead (standalone, where the
    /// ADD allocates). Read from copies kept by watch: asks no one.
    fn upcoming_addresses(&self) -> Option<Vec<UpcomingAddress>> {
        None
    }

    /// Woken when [`DesiredState::upcoming_addresses`] may have changed;
    /// `None` where it never does.
    fn upcoming_changed(&self) -> Option<Arc<tokio::sync::Notify>> {
        None
    }
}

/// An address allocated to a pod bound to this node, before its ADD.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpcomingAddress {
    /// The subnet it is on: its uplink and gateway.
    pub subnet: ValidSubnet,
    /// The address.
    pub addr: IpAddr,
}
