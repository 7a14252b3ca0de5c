//! Reviews PodNetworkConfigs (create, update): a spec without
//! [`problems`](flatnet_k8s::api::PodNetworkConfigSpec::problems)
//! (interface, VLAN and bridge names the kernel accepts, MTUs in range, one
//! attachment per interface name and never the primary `eth0`), and
//! subnets that exist and admit the configuration's namespace
//! (`spec.namespaceSelector`).

use std::collections::BTreeMap;

use flatnet_k8s::{
    api::{FlatNetworkSubnet, PodNetworkConfig},
    selector::Labels,
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
    let problems = config.spec.problems();
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
