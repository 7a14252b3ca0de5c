//! Annotation and label keys the operator reads or writes.
//!
//! The `flatnetwork.pandaria.io/*` and Multus keys are the exact strings of
//! the original rancher-flat-network, so existing workloads keep working.

/// Pod annotation naming the FlatNetworkSubnet; required (non-empty) for a flat pod.
pub const POD_SUBNET: &str = "flatnetwork.pandaria.io/subnet";

/// Pod annotation with the IP request (`auto`, an address or a dash list); required (non-empty).
pub const POD_IP: &str = "flatnetwork.pandaria.io/ip";

/// Pod annotation that opts the selecting Services out of a flat-network Service.
pub const FLAT_NETWORK_SERVICE: &str = "flatnetwork.pandaria.io/flatNetworkService";

/// Value of [`FLAT_NETWORK_SERVICE`] that disables the flat-network Service.
pub const FLAT_NETWORK_SERVICE_DISABLED: &str = "disabled";

/// Pod label holding the allocated flat address (`:` written as `.` for IPv6).
pub const POD_SELECTED_IP: &str = "flatnetwork.pandaria.io/selectedIP";

/// Multus annotation listing the pod's attachments and their addresses (JSON).
pub const MULTUS_NETWORK_STATUS: &str = "k8s.v1.cni.cncf.io/network-status";

/// Multus annotation naming the attachments; set on the flat Service to say
/// which attachment its endpoints come from, as the original did.
pub const MULTUS_NETWORKS: &str = "k8s.v1.cni.cncf.io/networks";

/// Standard label naming the Service an EndpointSlice belongs to.
pub const ENDPOINTSLICE_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// Standard label naming the controller that manages an EndpointSlice.
pub const ENDPOINTSLICE_MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";

/// Value of [`ENDPOINTSLICE_MANAGED_BY`] on the slices flatnet writes; any
/// other value makes the built-in controller leave them alone.
pub const ENDPOINTSLICE_MANAGER: &str = "flatnet.pandaria.io";

/// Standard label naming the tool that manages an object.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";

/// Value of [`MANAGED_BY`] on the Services flatnet creates.
pub const MANAGED_BY_FLATNET: &str = "flatnet-operator";

/// Label on flat Services and their slices naming the original Service, so
/// events on them map back to the Service to reconcile.
pub const PARENT_SERVICE: &str = "flatnet.pandaria.io/parent-service";
