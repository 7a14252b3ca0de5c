//! Review of the flat-network request of Pods and workloads.
//!
//! The request is the pod (template) annotations `subnet`, `ip` and `mac`.
//! Checked, in order:
//! 1. the annotations parse (syntax, duplicates, families, dual-stack groups);
//! 2. each named subnet exists and is valid; for dual stack the first is
//!    IPv4 and the second IPv6;
//! 3. each requested address is allocatable in its subnet: inside the CIDR
//!    and `spec.ranges`, not the gateway, network or broadcast address;
//! 4. a fixed MAC is only requested on macvlan;
//! 5. no requested address (in its subnet) or MAC (on the subnet's master
//!    and VLAN) is held by a pod of another workload.
//!
//! Every pod is reviewed, bare pods included, whoever wrote it and whatever
//! its labels. An update is reviewed when it changes the request; an update
//! that leaves the three annotations as they were is allowed, so scaling,
//! relabelling and the operator's own writes never fail on a request that
//! was admitted before.

use std::{collections::BTreeMap, net::IpAddr};

use flatnet_k8s::{
    annotations::{PodRequest, parse_pod_request},
    api::{FlatNetworkIP, FlatNetworkSubnet},
    ipam::{Mac, Pool, used_ranges},
    keys::{SUBNET_NAMESPACE, annotation},
    validation::{FlatMode, ValidSubnet, validate_subnet},
};
use kube::{
    ResourceExt,
    core::{
        DynamicObject,
        admission::{AdmissionRequest, Operation},
    },
};

use super::{
    Denial,
    lookup::Lookup,
    workload::{FlatAnnotations, WorkloadRef, flat_annotations},
};

/// Reviews the flat-network request of a Pod or workload.
///
/// # Errors
/// The [`Denial`] the user sees.
pub async fn review(
    lookup: &Lookup,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<(), Denial> {
    if !matches!(request.operation, Operation::Create | Operation::Update) {
        return Ok(());
    }
    let kind = request.kind.kind.as_str();
    let Some(object) = &request.object else {
        return Ok(());
    };
    let wanted = flat_annotations(kind, object);
    if !wanted.is_requested() || object.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    if let Some(old) = &request.old_object
        && flat_annotations(kind, old) == wanted
    {
        return Ok(());
    }
    let parsed = parse(&wanted)?;

    let subnets = lookup.subnets().await?;
    let chosen = resolve_subnets(&parsed, &subnets)?;
    check_addresses(&parsed, &chosen)?;
    check_mac_mode(&parsed, &chosen)?;

    let wants_fixed =
        parsed.subnets.iter().any(|s| !s.candidates.is_empty()) || !parsed.macs.is_empty();
    if !wants_fixed {
        return Ok(());
    }
    let namespace = request
        .namespace
        .clone()
        .or_else(|| object.namespace())
        .unwrap_or_default();
    let name = object
        .metadata
        .name
        .clone()
        .unwrap_or_else(|| request.name.clone());
    let me = lookup
        .workload_of(kind, &namespace, &name, object.owner_references())
        .await?;
    check_reserved(&parsed, &chosen, &subnets, &me)?;
    let own_record = (kind == "Pod" && !name.is_empty()).then(|| (namespace.clone(), name.clone()));
    let ips = lookup.ips().await?;
    check_in_use(
        lookup,
        &parsed,
        &chosen,
        &subnets,
        &ips,
        &me,
        own_record.as_ref(),
    )
    .await
}

fn parse(wanted: &FlatAnnotations) -> Result<PodRequest, Denial> {
    parse_pod_request(
        wanted.subnet.as_deref().unwrap_or_default(),
        wanted.ip.as_deref().unwrap_or_default(),
        wanted.mac.as_deref().unwrap_or_default(),
    )
    .map_err(|error| Denial::new("bad_annotation", error.to_string()))
}

/// The validated subnet of each subnet request, in request order.
fn resolve_subnets(
    request: &PodRequest,
    subnets: &[FlatNetworkSubnet],
) -> Result<Vec<ValidSubnet>, Denial> {
    let dual_stack = request.subnets.len() == 2;
    request
        .subnets
        .iter()
        .enumerate()
        .map(|(index, wanted)| {
            let subnet = subnets
                .iter()
                .find(|s| s.name_any() == wanted.subnet)
                .ok_or_else(|| {
                    Denial::new(
                        "subnet_not_found",
                        format!(
                            "annotation {} names FlatNetworkSubnet {}, which does not exist in namespace {SUBNET_NAMESPACE}: create it or fix the name",
                            annotation::SUBNET,
                            wanted.subnet
                        ),
                    )
                })?;
            let valid = validate_subnet(&wanted.subnet, &subnet.spec).map_err(|invalid| {
                Denial::new(
                    "subnet_invalid",
                    format!(
                        "annotation {} names an unusable subnet: {invalid}; fix the subnet first",
                        annotation::SUBNET
                    ),
                )
            })?;
            let family = valid.cidr.family();
            if dual_stack && Some(family) != wanted.family {
                let position = if index == 0 { "first" } else { "second" };
                return Err(Denial::new(
                    "wrong_family",
                    format!(
                        "annotation {} lists {} {position}, but it is an {family} subnet: name the IPv4 subnet first and the IPv6 subnet second",
                        annotation::SUBNET,
                        wanted.subnet
                    ),
                ));
            }
            if let Some(requested) = wanted.family.filter(|f| !dual_stack && *f != family) {
                return Err(Denial::new(
                    "wrong_family",
                    format!(
                        "annotation {} requests {requested} addresses, but subnet {} ({}) is {family}: request {family} addresses or name an {requested} subnet",
                        annotation::IP,
                        wanted.subnet,
                        valid.cidr
                    ),
                ));
            }
            Ok(valid)
        })
        .collect()
}

fn check_addresses(request: &PodRequest, subnets: &[ValidSubnet]) -> Result<(), Denial> {
    for (wanted, subnet) in request.subnets.iter().zip(subnets) {
        let pool = Pool::new(subnet);
        for &ip in &wanted.candidates {
            if let Err(error) = pool.clone().allocate_requested(&[ip]) {
                return Err(Denial::new(
                    "address_not_allocatable",
                    format!("annotation {}: {error}", annotation::IP),
                ));
            }
        }
    }
    Ok(())
}

fn check_mac_mode(request: &PodRequest, subnets: &[ValidSubnet]) -> Result<(), Denial> {
    if request.macs.is_empty() {
        return Ok(());
    }
    match subnets
        .iter()
        .find(|s| s.link_mode.flat_mode() == FlatMode::Ipvlan)
    {
        Some(ipvlan) => Err(Denial::new(
            "mac_on_ipvlan",
            format!(
                "annotation {} asks for a fixed MAC, but subnet {} is ipvlan, whose interfaces share the MAC of {}: remove the annotation or use a macvlan subnet",
                annotation::MAC,
                ipvlan.name,
                ipvlan.parent
            ),
        )),
        None => Ok(()),
    }
}

/// Refuses addresses another workload reserved: the subnets'
/// `status.reservedIP`, keyed `<Kind>/<namespace>/<name>` by the workload
/// controller (`crate::workloads`), as the original's webhook did.
fn check_reserved(
    request: &PodRequest,
    chosen: &[ValidSubnet],
    subnets: &[FlatNetworkSubnet],
    me: &WorkloadRef,
) -> Result<(), Denial> {
    let my_key = me.key();
    for (wanted, valid) in request.subnets.iter().zip(chosen) {
        let Some(subnet) = subnets.iter().find(|s| s.name_any() == valid.name) else {
            continue;
        };
        let reserved = subnet.status.as_ref().map(|s| &s.reserved_ip);
        for (holder, ranges) in reserved.into_iter().flatten() {
            if *holder == my_key {
                continue;
            }
            if let Some(ip) = wanted
                .candidates
                .iter()
                .find(|ip| used_ranges::contains(ranges, **ip))
            {
                return Err(Denial::new(
                    "address_reserved",
                    format!(
                        "annotation {}: {ip} of subnet {} is reserved by {holder}: choose another address, or remove it from {holder} first",
                        annotation::IP,
                        valid.name
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Refuses addresses and MACs held by pods of other workloads.
async fn check_in_use(
    lookup: &Lookup,
    request: &PodRequest,
    chosen: &[ValidSubnet],
    subnets: &[FlatNetworkSubnet],
    ips: &[FlatNetworkIP],
    me: &WorkloadRef,
    own_record: Option<&(String, String)>,
) -> Result<(), Denial> {
    let key = |record: &FlatNetworkIP| (record.namespace().unwrap_or_default(), record.name_any());
    let mut holders: BTreeMap<(String, String), WorkloadRef> = BTreeMap::new();
    let mut holder_of = async |record: &FlatNetworkIP| -> Result<Option<WorkloadRef>, Denial> {
        if own_record == Some(&key(record)) {
            return Ok(None);
        }
        let holder = match holders.get(&key(record)) {
            Some(holder) => holder.clone(),
            None => {
                let holder = lookup.holder(record).await?;
                holders.insert(key(record), holder.clone());
                holder
            }
        };
        Ok((holder != *me).then_some(holder))
    };

    for (wanted, subnet) in request.subnets.iter().zip(chosen) {
        for &ip in &wanted.candidates {
            for record in ips
                .iter()
                .filter(|r| r.spec.subnet == subnet.name && held_address(r) == Some(ip))
            {
                if let Some(holder) = holder_of(record).await? {
                    return Err(Denial::new(
                        "address_in_use",
                        format!(
                            "annotation {}: {ip} of subnet {} is held by pod {}/{} of {holder}: choose another address, or release it from {holder} first",
                            annotation::IP,
                            subnet.name,
                            record.namespace().unwrap_or_default(),
                            record.name_any()
                        ),
                    ));
                }
            }
        }
    }

    // MACs are unique per layer-2 segment: the master and VLAN of the subnets.
    let parents: Vec<_> = chosen.iter().map(|s| &s.parent).collect();
    let on_same_link = |record: &FlatNetworkIP| {
        subnets
            .iter()
            .find(|s| s.name_any() == record.spec.subnet)
            .is_some_and(|s| {
                parents
                    .iter()
                    .any(|p| s.spec.master == p.master && s.spec.vlan == i64::from(p.vlan))
            })
    };
    for mac in &request.macs {
        for record in ips
            .iter()
            .filter(|r| held_mac(r) == Some(*mac) && on_same_link(r))
        {
            if let Some(holder) = holder_of(record).await? {
                return Err(Denial::new(
                    "mac_in_use",
                    format!(
                        "annotation {}: {mac} is held by pod {}/{} of {holder} on the same master and VLAN: choose another MAC, or release it from {holder} first",
                        annotation::MAC,
                        record.namespace().unwrap_or_default(),
                        record.name_any()
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn held_address(record: &FlatNetworkIP) -> Option<IpAddr> {
    record.status.as_ref()?.addr
}

fn held_mac(record: &FlatNetworkIP) -> Option<Mac> {
    Mac::parse(&record.status.as_ref()?.mac).ok()
}

#[cfg(test)]
mod reserved_tests {
    use flatnet_k8s::api::IpRange;

    use super::*;

    #[test]
    fn addresses_reserved_by_another_workload_are_refused_not_ones_own() {
        let mut subnet: FlatNetworkSubnet = serde_json::from_value(serde_json::json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
            "metadata": {"name": "lan", "namespace": SUBNET_NAMESPACE},
            "spec": {"flatMode": "macvlan", "master": "eth0", "cidr": "10.0.0.0/24"}
        }))
        .unwrap();
        subnet.status = Some(flatnet_k8s::api::FlatNetworkSubnetStatus {
            reserved_ip: BTreeMap::from([(
                "Deployment/shop/web".to_owned(),
                vec![IpRange::new(
                    "10.0.0.5".parse().unwrap(),
                    "10.0.0.6".parse().unwrap(),
                )],
            )]),
            ..Default::default()
        });
        let valid = validate_subnet("lan", &subnet.spec).unwrap();
        let subnets = [subnet];
        let request = parse_pod_request("lan", "10.0.0.9-10.0.0.6", "").unwrap();
        let other = WorkloadRef::new("StatefulSet", "shop", "db");
        let denial =
            check_reserved(&request, std::slice::from_ref(&valid), &subnets, &other).unwrap_err();
        assert_eq!(denial.reason, "address_reserved");
        assert!(denial.message.contains("10.0.0.6"), "{}", denial.message);
        assert!(
            denial.message.contains("Deployment/shop/web"),
            "{}",
            denial.message
        );
        let owner = WorkloadRef::new("Deployment", "shop", "web");
        assert!(check_reserved(&request, std::slice::from_ref(&valid), &subnets, &owner).is_ok());
        let free = parse_pod_request("lan", "10.0.0.9", "").unwrap();
        assert!(check_reserved(&free, &[valid], &subnets, &other).is_ok());
    }
}
