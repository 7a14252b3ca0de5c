//! Well-known names: annotation and label keys, namespaces, object names.
//!
//! Every key the original rancher-flat-network reads or writes is listed
//! here with its exact spelling, so manifests written for it keep working.

/// Prefix of flatnet's own annotation and label keys.
pub const PREFIX: &str = "flatnetwork.pandaria.io/";

/// Namespace holding every `FlatNetworkSubnet` (and the operator).
pub const SUBNET_NAMESPACE: &str = "cattle-flat-network";

/// Name of the Multus `NetworkAttachmentDefinition` created in every namespace.
pub const NAD_NAME: &str = "rancher-flat-network";

/// The CNI plugin executable flatnet installs on every node.
pub const CNI_PLUGIN: &str = "flatnet-cni";

/// The original's plugin name: the agent installs the same executable under
/// it too, so NetworkAttachmentDefinitions written for the original keep working.
pub const CNI_PLUGIN_ORIGINAL: &str = "rancher-flat-network-cni";

/// `cniVersion` of the network configuration lists flatnet writes (the NAD
/// and the node's conflist): runtimes built on libcni before 1.2 (podman 4,
/// containerd 1.7, Multus 3) read only this field and cannot parse a 1.1.0
/// result.
pub const CNI_CONFIG_VERSION: &str = "1.0.0";

/// `cniVersions` of the same lists: libcni 1.2 and later pick the highest
/// entry, so 1.1-capable runtimes send STATUS and GC.
pub const CNI_CONFIG_VERSIONS: [&str; 2] = ["1.0.0", "1.1.0"];

/// Suffix of the headless service mirrored for each flat-network service.
pub const FLAT_NETWORK_SERVICE_SUFFIX: &str = "-flat-network";

/// Suffix of a dual-stack pod's second FlatNetworkIP: `<pod>` holds the
/// first subnet's address, `<pod>.ipv6` the second's.
pub const SECONDARY_RECORD_SUFFIX: &str = ".ipv6";

/// Infix of a hot-plugged interface's FlatNetworkIP:
/// `<pod>.if-<interface>` (see [`hotplug_record_name`]).
pub const HOTPLUG_RECORD_INFIX: &str = ".if-";

/// The FlatNetworkIP of interface `interface` hot-plugged into pod
/// `pod_name` by a PodNetworkConfig: `<pod>.if-<interface>`. The interface
/// name becomes part of an object name, so it must be lowercase letters,
/// digits and '-', starting and ending with a letter or digit; the whole
/// name at most 253 characters. The error says which rule failed.
pub fn hotplug_record_name(pod_name: &str, interface: &str) -> Result<String, String> {
    check_hotplug_interface(interface)?;
    let name = format!("{pod_name}{HOTPLUG_RECORD_INFIX}{interface}");
    if name.len() > 253 {
        return Err(format!(
            "the FlatNetworkIP name {name:?} of interface {interface} would be longer than 253 characters; \
             use a shorter pod or interface name"
        ));
    }
    Ok(name)
}

/// The rule a hot-plugged interface's name meets beyond the kernel's,
/// since it is part of an object name (see [`hotplug_record_name`]).
pub fn check_hotplug_interface(interface: &str) -> Result<(), String> {
    let label_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if interface.is_empty()
        || !interface.chars().all(label_char)
        || !alnum(interface.chars().next())
        || !alnum(interface.chars().last())
    {
        return Err(format!(
            "interface name {interface:?} names the interface's FlatNetworkIP too, so it must be \
             lowercase letters, digits and '-', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

/// Pod (template) annotations: the user-facing API.
pub mod annotation {
    /// Subnet name, or `v4name,v6name` for dual stack. Enables the flat network.
    pub const SUBNET: &str = "flatnetwork.pandaria.io/subnet";
    /// `auto`, an address, or a dash-separated candidate list.
    pub const IP: &str = "flatnetwork.pandaria.io/ip";
    /// Empty or `auto` (kernel-chosen), a MAC, or a dash-separated candidate list.
    pub const MAC: &str = "flatnetwork.pandaria.io/mac";
    /// `disabled` on any selected pod stops the `-flat-network` service.
    pub const FLAT_NETWORK_SERVICE: &str = "flatnetwork.pandaria.io/flatNetworkService";
    /// Value of [`FLAT_NETWORK_SERVICE`] that turns the service off.
    pub const FLAT_NETWORK_SERVICE_DISABLED: &str = "disabled";
    /// On a subnet (any non-empty value) and copied onto its IPs (`"true"`):
    /// add a 6to4 IPv6 address to the pod.
    pub const IPV6_TO_4: &str = "flatnetwork.pandaria.io/ipv6to4";
    /// On an Ingress: `"true"` marks its backends as flat-network services.
    pub const INGRESS: &str = "flatnetwork.pandaria.io/ingress";
    /// Multus: extra attachments (multi-NIC mode), and on services the
    /// marker of a flat-network service.
    pub const MULTUS_NETWORKS: &str = "k8s.v1.cni.cncf.io/networks";
    /// Multus: replacement of the cluster network (single-NIC mode).
    pub const MULTUS_DEFAULT_NETWORK: &str = "v1.multus-cni.io/default-network";
    /// Multus: attachment results written on the pod.
    pub const MULTUS_NETWORK_STATUS: &str = "k8s.v1.cni.cncf.io/network-status";
}

/// Label keys and values.
pub mod label {
    /// On FlatNetworkIPs: the subnet name (un-prefixed, as in the original).
    pub const IP_SUBNET: &str = "subnet";
    /// On pods and workloads: the subnet name.
    pub const SUBNET: &str = "flatnetwork.pandaria.io/subnet";
    /// On namespaces: whether their pods get MACs from the cluster's MAC
    /// pool ([`MAC_POOL_ENABLED`] or [`MAC_POOL_DISABLED`]; see
    /// `FlatNetworkConfig` `spec.macPool.mode`).
    pub const MAC_POOL: &str = "flatnetwork.pandaria.io/mac-pool";
    /// [`MAC_POOL`] value opting a namespace in.
    pub const MAC_POOL_ENABLED: &str = "enabled";
    /// [`MAC_POOL`] value opting a namespace out.
    pub const MAC_POOL_DISABLED: &str = "disabled";
    /// On pods: the flat address with `:` replaced by `.`.
    pub const SELECTED_IP: &str = "flatnetwork.pandaria.io/selectedIP";
    /// On pods: the fixed MAC with `:` removed.
    pub const SELECTED_MAC: &str = "flatnetwork.pandaria.io/selectedMac";
    /// On pods, workloads and FlatNetworkIPs: [`IP_TYPE_AUTO`] or [`IP_TYPE_SPECIFIC`].
    pub const IP_TYPE: &str = "flatnetwork.pandaria.io/flatNetworkIPType";
    /// [`IP_TYPE`] value for `ip: auto`.
    pub const IP_TYPE_AUTO: &str = "auto";
    /// [`IP_TYPE`] value for fixed addresses.
    pub const IP_TYPE_SPECIFIC: &str = "specific";
    /// On pods and workloads: the subnet's `flatMode`.
    pub const FLAT_MODE: &str = "flatnetwork.pandaria.io/flatMode";
    /// On FlatNetworkIPs of interfaces hot-plugged into running pods: the
    /// interface name in the pod. Its presence marks the record as one a
    /// PodNetworkConfig asked for.
    pub const HOTPLUG_INTERFACE: &str = "flatnetwork.pandaria.io/hotplug-interface";
    /// On the same FlatNetworkIPs: the PodNetworkConfig asking for it.
    pub const POD_NETWORK_CONFIG: &str = "flatnetwork.pandaria.io/pod-network-config";
    /// On FlatNetworkIPs: the node whose agent set the pod up (flatnet addition).
    pub const NODE: &str = "flatnetwork.pandaria.io/node";
    /// On subnets (un-prefixed): `spec.master`; siblings are selected by it.
    pub const SUBNET_MASTER: &str = "master";
    /// On subnets (un-prefixed): `spec.vlan` in decimal.
    pub const SUBNET_VLAN: &str = "vlan";
    /// On subnets (un-prefixed): `spec.mode`.
    pub const SUBNET_MODE: &str = "mode";
    /// On subnets (un-prefixed): `spec.flatMode`.
    pub const SUBNET_FLAT_MODE: &str = "flatMode";
    /// Rancher: workload selector on pods, copied onto FlatNetworkIPs.
    pub const RANCHER_WORKLOAD_SELECTOR: &str = "workload.user.cattle.io/workloadselector";
    /// Rancher: project of a namespace, copied onto FlatNetworkIPs.
    pub const RANCHER_PROJECT_ID: &str = "field.cattle.io/projectId";
    /// On Endpoints: keep the EndpointSlice mirroring controller away.
    pub const ENDPOINTSLICE_SKIP_MIRROR: &str = "endpointslice.kubernetes.io/skip-mirror";
    /// On EndpointSlices: the controller that owns the slice.
    pub const ENDPOINTSLICE_MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
    /// [`ENDPOINTSLICE_MANAGED_BY`] value on the slices flatnet writes; any
    /// value but the built-in controller's makes that controller leave them
    /// alone. (rancher-flat-network wrote `rancher-flat-network-controller`.)
    pub const ENDPOINTSLICE_MANAGED_BY_VALUE: &str = "flatnet.pandaria.io";
    /// On EndpointSlices: the Service the slice belongs to.
    pub const ENDPOINTSLICE_SERVICE_NAME: &str = "kubernetes.io/service-name";
    /// Standard label naming the tool that manages an object.
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    /// [`MANAGED_BY`] value on the objects flatnet-operator creates.
    pub const MANAGED_BY_FLATNET: &str = "flatnet-operator";
    /// On flat Services and their slices: the original Service, so events on
    /// them map back to the Service to reconcile.
    pub const PARENT_SERVICE: &str = "flatnet.pandaria.io/parent-service";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hotplug_record_names_are_object_names_or_say_why_not() {
        assert_eq!(
            hotplug_record_name("web-0", "net2").unwrap(),
            "web-0.if-net2"
        );
        for bad in ["", "Net2", "net_2", "-net", "net-", "ne.t"] {
            let error = hotplug_record_name("web-0", bad).unwrap_err();
            assert!(error.contains("lowercase letters"), "{bad:?}: {error}");
        }
        let long = "p".repeat(250);
        assert!(
            hotplug_record_name(&long, "net2")
                .unwrap_err()
                .contains("longer than 253")
        );
    }
}
