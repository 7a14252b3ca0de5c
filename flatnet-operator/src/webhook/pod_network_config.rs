//! Reviews PodNetworkConfigs (create, update): interface, VLAN and bridge
//! names the kernel accepts, MTUs in range, one attachment per interface
//! name and never the primary `eth0`, and subnets that exist and admit the
//! configuration's namespace (`spec.namespaceSelector`).

use std::collections::{BTreeMap, BTreeSet};

use flatnet_k8s::{
    api::{FlatNetworkSubnet, PodNetworkConfig, PodNetworkConfigSpec},
    keys::check_hotplug_interface,
    selector::Labels,
    validation::{MAX_MTU, MIN_MTU_IPV4, check_ifname},
};
use kube::{
    ResourceExt,
    core::{
        DynamicObject,
        admission::{AdmissionRequest, Operation},
    },
};

use super::{Denial, lookup::Lookup};
use crate::runtime_config::desired::subnet_problem;

/// The pod's primary interface, which attachments may not take.
const PRIMARY_IFNAME: &str = "eth0";

/// Every problem of `spec` that needs no lookup, each naming its field.
#[must_use]
pub fn spec_problems(spec: &PodNetworkConfigSpec) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(mtu) = spec.primary.as_ref().and_then(|p| p.mtu)
        && !(MIN_MTU_IPV4..=MAX_MTU).contains(&mtu)
    {
        problems.push(format!(
            "spec.primary.mtu {mtu} is out of range: use {MIN_MTU_IPV4}..{MAX_MTU}"
        ));
    }
    let mut interfaces = BTreeSet::new();
    for (index, attachment) in spec.attachments.iter().enumerate() {
        let field = format!("spec.attachments[{index}]");
        if attachment.subnet.is_empty() {
            problems.push(format!("{field}.subnet is empty: name a FlatNetworkSubnet"));
        }
        if let Err(reason) = check_ifname(&attachment.interface) {
            problems.push(format!("{field}.interface {reason}"));
        } else if attachment.interface == PRIMARY_IFNAME {
            problems.push(format!(
                "{field}.interface {PRIMARY_IFNAME} is the pod's primary interface: use another name, e.g. net2"
            ));
        } else if let Err(reason) = check_hotplug_interface(&attachment.interface) {
            problems.push(format!("{field}.interface: {reason}"));
        } else if !interfaces.insert(attachment.interface.as_str()) {
            problems.push(format!(
                "{field}.interface {} is asked for twice: keep one",
                attachment.interface
            ));
        }
        if !attachment.mac.is_empty() && flatnet_k8s::ipam::Mac::parse(&attachment.mac).is_err() {
            problems.push(format!(
                "{field}.mac {:?} is not a MAC address: use aa:bb:cc:dd:ee:ff",
                attachment.mac
            ));
        }
    }
    for (index, vlan) in spec.vlans.iter().enumerate() {
        if let Err(reason) = check_ifname(&vlan.master) {
            problems.push(format!("spec.vlans[{index}].master {reason}"));
        } else if let Err(reason) = check_ifname(&format!("{}.{}", vlan.master, vlan.id)) {
            problems.push(format!(
                "spec.vlans[{index}]: {reason}; use a shorter master name"
            ));
        }
        if !(1..=4094).contains(&vlan.id) {
            problems.push(format!(
                "spec.vlans[{index}].id {} is out of range: use 1..4094",
                vlan.id
            ));
        }
    }
    for (index, bridge) in spec.bridges.iter().enumerate() {
        if let Err(reason) = check_ifname(&bridge.name) {
            problems.push(format!("spec.bridges[{index}].name {reason}"));
        }
        for port in &bridge.ports {
            if let Err(reason) = check_ifname(port) {
                problems.push(format!("spec.bridges[{index}].ports {reason}"));
            }
        }
    }
    problems
}

/// Reviews one PodNetworkConfig request.
///
/// # Errors
/// The [`Denial`] the user sees.
pub async fn review(
    lookup: &Lookup,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<(), Denial> {
    if matches!(request.operation, Operation::Delete) {
        return Ok(());
    }
    let Some(object) = request.object.as_ref() else {
        return Ok(());
    };
    let config: PodNetworkConfig = object.clone().try_parse().map_err(|error| {
        Denial::new(
            "bad_request",
            format!(
                "the PodNetworkConfig does not match its schema ({error}): fix the field named"
            ),
        )
    })?;
    let problems = spec_problems(&config.spec);
    if !problems.is_empty() {
        return Err(invalid(&config, &problems));
    }
    if config.spec.attachments.is_empty() {
        return Ok(());
    }
    let namespace = config.namespace().unwrap_or_default();
    let labels: Labels = lookup.namespace_labels(&namespace).await?;
    let subnets = lookup.subnets().await?;
    let subnets: BTreeMap<String, &FlatNetworkSubnet> =
        subnets.iter().map(|s| (s.name_any(), s)).collect();
    let problems: Vec<String> = config
        .spec
        .attachments
        .iter()
        .enumerate()
        .filter_map(|(index, attachment)| {
            subnet_problem(attachment, &namespace, &labels, &subnets)
                .map(|problem| format!("spec.attachments[{index}]: {problem}"))
        })
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(invalid(&config, &problems))
    }
}

fn invalid(config: &PodNetworkConfig, problems: &[String]) -> Denial {
    Denial::new(
        "invalid_pod_network_config",
        format!(
            "PodNetworkConfig {} is invalid: {}",
            config.name_any(),
            problems.join("; ")
        ),
    )
}
