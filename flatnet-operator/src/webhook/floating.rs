//! Review of floating-address objects:
//!
//! - FloatingIPPool create and update: the spec is valid and shares no
//!   address with another pool; delete: refused while Services hold its
//!   addresses;
//! - FloatingIPProjectQuota create and update: exactly one of project and
//!   namespace;
//! - Services of flatnet's `loadBalancerClass`, create and update: the
//!   fixed addresses parse, and a Service that needs a new address does not
//!   exceed a quota (the denial names the quota). The controller makes the
//!   same quota check, since admission can race or be bypassed;
//! - Pods asking for a floating address ([`review_pod`]), create and
//!   update of the request: the named pool exists, is valid and serves the
//!   namespace, fixed addresses parse and lie inside the pool (its CIDRs
//!   and ranges), and a pod needing a new address (its set holds none) does
//!   not exceed a quota.

use std::net::IpAddr;

use flatnet_k8s::{
    api::{FloatingIPPool, FloatingIPProjectQuota},
    floating::{
        ValidPool, annotation,
        pods::{PodFloatingRequest, pod_request_of},
        quota_scope, request_of, validate_pool, wants_floating,
    },
    ipam::{Family, from_u128},
};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::{
    ResourceExt,
    core::{
        DynamicObject,
        admission::{AdmissionRequest, Operation},
    },
};

use super::{Denial, lookup::Lookup};
use crate::floating::{
    pods::{pod_addresses, set_addresses},
    quotas,
    services::{ingress_addresses, serves_namespace},
};

/// The kinds reviewed here.
pub const KINDS: [&str; 3] = ["FloatingIPPool", "FloatingIPProjectQuota", "Service"];

fn parse<K: serde::de::DeserializeOwned>(object: &DynamicObject, kind: &str) -> Result<K, Denial> {
    serde_json::to_value(object)
        .and_then(serde_json::from_value)
        .map_err(|error| {
            Denial::new(
                "bad_request",
                format!("the {kind} does not match its schema ({error}): fix the field named"),
            )
        })
}

/// Reviews one request of a [`KINDS`] object.
///
/// # Errors
/// The [`Denial`] the user sees.
pub async fn review(
    lookup: &Lookup,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<(), Denial> {
    let kind = request.kind.kind.as_str();
    match (kind, &request.operation, &request.object) {
        ("FloatingIPPool", Operation::Delete, _) => review_pool_delete(lookup, &request.name).await,
        ("FloatingIPPool", Operation::Create | Operation::Update, Some(object)) => {
            let pool: FloatingIPPool = parse(object, kind)?;
            if pool.metadata.deletion_timestamp.is_some() {
                return Ok(());
            }
            let valid = validate_pool(&pool.name_any(), &pool.spec)
                .map_err(|invalid| Denial::new("invalid_pool", invalid.to_string()))?;
            let others = lookup.list::<FloatingIPPool>().await?;
            if let Some(other) = others
                .iter()
                .filter(|o| o.name_any() != valid.name)
                .filter_map(|o| validate_pool(&o.name_any(), &o.spec).ok())
                .find(|o| o.overlaps(&valid))
            {
                return Err(Denial::new(
                    "pool_overlap",
                    format!(
                        "FloatingIPPool {} shares addresses with FloatingIPPool {}: give each pool its own spec.cidrs or spec.ranges",
                        valid.name, other.name
                    ),
                ));
            }
            Ok(())
        }
        ("FloatingIPProjectQuota", Operation::Create | Operation::Update, Some(object)) => {
            let quota: FloatingIPProjectQuota = parse(object, kind)?;
            quota_scope(&quota.name_any(), &quota.spec)
                .map(|_| ())
                .map_err(|error| Denial::new("invalid_quota", error.to_string()))
        }
        ("Service", Operation::Create | Operation::Update, Some(object)) => {
            let service: Service = parse(object, kind)?;
            review_service(lookup, &service).await
        }
        _ => Ok(()),
    }
}

async fn valid_pools(lookup: &Lookup) -> Result<Vec<ValidPool>, Denial> {
    let mut pools: Vec<ValidPool> = lookup
        .list::<FloatingIPPool>()
        .await?
        .iter()
        .filter_map(|p| validate_pool(&p.name_any(), &p.spec).ok())
        .collect();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(pools)
}

async fn review_pool_delete(lookup: &Lookup, name: &str) -> Result<(), Denial> {
    let pools: Vec<ValidPool> = valid_pools(lookup)
        .await?
        .into_iter()
        .filter(|p| p.name == name)
        .collect();
    let holders: Vec<String> = lookup
        .list::<Service>()
        .await?
        .iter()
        .filter(|s| !ingress_addresses(s, &pools).is_empty())
        .map(|s| format!("{}/{}", s.namespace().unwrap_or_default(), s.name_any()))
        .collect();
    if holders.is_empty() {
        return Ok(());
    }
    Err(Denial::new(
        "pool_in_use",
        format!(
            "FloatingIPPool {name} still gives addresses to {} Service(s) ({}): delete them or change their type first",
            holders.len(),
            holders.join(", ")
        ),
    ))
}

async fn review_service(lookup: &Lookup, service: &Service) -> Result<(), Denial> {
    // Classless Services are served only when the operator is told to; the
    // webhook does not know, and leaves them to the controller's check.
    if !wants_floating(service, false) {
        return Ok(());
    }
    let request = request_of(service).map_err(|error| {
        Denial::new(
            "invalid_floating_request",
            format!("Service {}: {error}", service.name_any()),
        )
    })?;
    let pools = valid_pools(lookup).await?;
    let held = ingress_addresses(service, &pools);
    let namespace = service.namespace().unwrap_or_default();
    let services = lookup.list::<Service>().await?;
    let others: Vec<Service> = services
        .into_iter()
        .filter(|s| !(s.namespace() == service.namespace() && s.name_any() == service.name_any()))
        .collect();
    let namespaces = lookup.list::<Namespace>().await?;
    let holders = quotas::holders(&others, &namespaces, &pools);
    let project = quotas::project_label(&namespaces, &namespace);
    let quota_list = lookup.list::<FloatingIPProjectQuota>().await?;
    for family in &request.families {
        if held.iter().any(|a| Family::of(*a) == *family) {
            continue;
        }
        let fixed = request
            .fixed
            .iter()
            .copied()
            .find(|a| Family::of(*a) == *family);
        // The pool the controller would take it from first.
        let Some(pool) = pools.iter().find(|p| {
            request.pool.as_ref().is_none_or(|n| *n == p.name)
                && p.network(*family).is_some()
                && fixed.is_none_or(|a| p.network_of(a).is_some())
        }) else {
            continue;
        };
        let shares = request.sharing_key.is_some()
            && others.iter().any(|o| {
                o.namespace() == service.namespace()
                    && request_of(o).is_ok_and(|r| r.sharing_key == request.sharing_key)
                    && ingress_addresses(o, std::slice::from_ref(pool))
                        .iter()
                        .any(|a| Family::of(*a) == *family)
            });
        if shares {
            continue;
        }
        quotas::check(
            &quota_list,
            &holders,
            &pools,
            &namespace,
            project.as_deref(),
            &pool.name,
        )
        .map_err(|exceeded| Denial::new("floating_ip_quota", exceeded.to_string()))?;
    }
    Ok(())
}

/// The floating request of `object` (a pod); a request that does not
/// parse is denied naming the annotation.
fn pod_request(object: &DynamicObject) -> Result<(Pod, Option<PodFloatingRequest>), Denial> {
    let pod: Pod = parse(object, "Pod")?;
    let request = pod_request_of(&pod).map_err(|error| {
        Denial::new(
            "invalid_floating_request",
            format!(
                "pod {}: {error}: give one address per family, comma-separated",
                pod.name_any()
            ),
        )
    })?;
    Ok((pod, request))
}

/// Reviews the floating-address request of a pod (create, or an update
/// that changes it): see the module's list. A pod asking for nothing, or
/// whose request is unchanged (the operator's own writes, relabelling),
/// is allowed.
///
/// # Errors
/// The [`Denial`] the user sees.
pub async fn review_pod(
    lookup: &Lookup,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<(), Denial> {
    if !matches!(request.operation, Operation::Create | Operation::Update) {
        return Ok(());
    }
    let Some(object) = &request.object else {
        return Ok(());
    };
    let (pod, Some(wanted)) = pod_request(object)? else {
        return Ok(());
    };
    if pod.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    if let Some(old) = &request.old_object
        && pod_request(old).ok().and_then(|(_, r)| r).as_ref() == Some(&wanted)
    {
        return Ok(());
    }
    let name = pod.name_any();
    let namespace = request
        .namespace
        .clone()
        .or_else(|| pod.namespace())
        .unwrap_or_default();
    let labels = lookup.namespace_labels(&namespace).await?;
    let objects = lookup.list::<FloatingIPPool>().await?;
    let pools = valid_pools(lookup).await?;
    // The pools the pod may take from: the named one, or any serving the
    // namespace.
    let candidates: Vec<&ValidPool> = match &wanted.pool {
        Some(pool_name) => {
            let Some(object) = objects.iter().find(|p| p.name_any() == *pool_name) else {
                let mut names: Vec<String> = objects.iter().map(ResourceExt::name_any).collect();
                names.sort();
                return Err(Denial::new(
                    "floating_ip_pool_missing",
                    format!(
                        "pod {name}: FloatingIPPool {pool_name} ({}) does not exist: name one of [{}] or create it",
                        annotation::POOL,
                        names.join(", ")
                    ),
                ));
            };
            let valid = validate_pool(pool_name, &object.spec).map_err(|invalid| {
                Denial::new(
                    "floating_ip_pool_invalid",
                    format!("pod {name}: {invalid}: fix the pool first"),
                )
            })?;
            if !serves_namespace(object, &labels) {
                return Err(Denial::new(
                    "floating_ip_pool_not_serving",
                    format!(
                        "pod {name}: FloatingIPPool {pool_name} does not serve namespace {namespace} (its spec.namespaceSelector or spec.projects): name a pool that does, or widen the pool's selector"
                    ),
                ));
            }
            pools.iter().filter(|p| p.name == valid.name).collect()
        }
        None => pools
            .iter()
            .filter(|p| {
                objects
                    .iter()
                    .any(|o| o.name_any() == p.name && serves_namespace(o, &labels))
            })
            .collect(),
    };
    if candidates.is_empty() {
        return Err(Denial::new(
            "floating_ip_pool_missing",
            format!(
                "pod {name}: no valid FloatingIPPool serves namespace {namespace}: create one, or widen a pool's spec.namespaceSelector or spec.projects"
            ),
        ));
    }
    let mut families: Vec<Family> = Vec::new();
    for addr in &wanted.fixed {
        let family = Family::of(*addr);
        if families.contains(&family) {
            return Err(Denial::new(
                "invalid_floating_request",
                format!(
                    "pod {name}: {} lists two {family} addresses: give at most one per family",
                    annotation::ADDRESSES
                ),
            ));
        }
        families.push(family);
        let inside = candidates.iter().any(|p| {
            p.pool(family)
                .is_some_and(|pool| pool.is_allocatable(*addr))
        });
        if !inside {
            let whose = match &wanted.pool {
                Some(pool_name) => format!("FloatingIPPool {pool_name}"),
                None => format!("every FloatingIPPool serving namespace {namespace}"),
            };
            let ranges: Vec<String> = candidates
                .iter()
                .filter_map(|p| p.network(family))
                .map(|n| {
                    n.pool_intervals()
                        .iter()
                        .map(|(from, to)| {
                            format!("{}-{}", from_u128(family, *from), from_u128(family, *to))
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .collect();
            return Err(Denial::new(
                "floating_ip_outside_pool",
                format!(
                    "pod {name}: {addr} ({}) is outside {whose}: give an address of {}",
                    annotation::ADDRESSES,
                    if ranges.is_empty() {
                        format!("a pool with a {family} network")
                    } else {
                        ranges.join("; ")
                    }
                ),
            ));
        }
    }
    review_pod_quota(lookup, &pod, &wanted, &candidates, &pools, &namespace).await
}

/// Denies a pod that needs a new address (neither it nor its set holds
/// one) when the first pool it would take from is at a quota's limit.
async fn review_pod_quota(
    lookup: &Lookup,
    pod: &Pod,
    wanted: &PodFloatingRequest,
    candidates: &[&ValidPool],
    pools: &[ValidPool],
    namespace: &str,
) -> Result<(), Denial> {
    let pods = lookup.floating_pods().await?;
    let others: Vec<Pod> = pods
        .into_iter()
        .filter(|p| {
            !(p.namespace().as_deref() == Some(namespace) && p.name_any() == pod.name_any())
        })
        .collect();
    let set_holds = set_addresses(&others, namespace, wanted.set.as_deref(), pools);
    let held: Vec<IpAddr> = pod_addresses(pod, pools)
        .into_iter()
        .chain(set_holds)
        .collect();
    let families: Vec<Family> = if wanted.fixed.is_empty() {
        candidates
            .first()
            .map(|p| p.networks.iter().map(|n| n.cidr.family()).collect())
            .unwrap_or_default()
    } else {
        wanted.fixed.iter().map(|a| Family::of(*a)).collect()
    };
    let namespaces = lookup.list::<Namespace>().await?;
    let services = lookup.list::<Service>().await?;
    let mut holders = quotas::holders(&services, &namespaces, pools);
    holders.extend(quotas::pod_holders(&others, &namespaces, pools));
    let project = quotas::project_label(&namespaces, namespace);
    let quota_list = lookup.list::<FloatingIPProjectQuota>().await?;
    for family in families {
        if held.iter().any(|a| Family::of(*a) == family) {
            continue;
        }
        let Some(pool) = candidates.iter().find(|p| p.network(family).is_some()) else {
            continue;
        };
        quotas::check(
            &quota_list,
            &holders,
            pools,
            namespace,
            project.as_deref(),
            &pool.name,
        )
        .map_err(|exceeded| {
            Denial::new(
                "floating_ip_quota",
                format!("pod {}: {exceeded}", pod.name_any()),
            )
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
