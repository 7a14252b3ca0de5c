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
//! - Pods asking for a floating address, and workloads whose pod template
//!   does ([`review_request`], one review for both), create and update of
//!   the request: the named pool exists, is valid and serves the
//!   namespace, fixed addresses parse and lie inside the pool (its CIDRs
//!   and ranges), a template running several pods at once asks for a fixed
//!   address only with a set, and a pod needing a new address (its set
//!   holds none) does not exceed a quota; for a template, checked when a
//!   user creates it: not one of its pods could get an address.

use std::{collections::BTreeMap, net::IpAddr};

use flatnet_k8s::{
    api::{FloatingIPPool, FloatingIPProjectQuota},
    floating::{
        RequestError, ValidPool, annotation,
        pods::{PodFloatingRequest, assigned_value, request_in},
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

use super::{Denial, lookup::Lookup, workload};
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
    // The pool it names must serve its namespace (one it does not name is
    // picked among those that do, by the controller), unless it holds an
    // address of that pool already: the namespace's labels may have
    // changed since, and the operator's own writes must go through.
    let holds_of = |name: &str| {
        pools
            .iter()
            .filter(|p| p.name == name)
            .any(|p| !ingress_addresses(service, std::slice::from_ref(p)).is_empty())
    };
    if let Some(name) = request.pool.as_deref().filter(|n| !holds_of(n)) {
        let labels = lookup.namespace_labels(&namespace).await?;
        let objects = lookup.list::<FloatingIPPool>().await?;
        if objects
            .iter()
            .any(|o| o.name_any() == name && !serves_namespace(o, &labels))
        {
            return Err(not_serving(
                &format!("Service {}", service.name_any()),
                name,
                annotation::POOL,
                &namespace,
            ));
        }
    }
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

/// The denial of `who` naming (in `field`) FloatingIPPool `pool`, which
/// does not serve `namespace`.
fn not_serving(who: &str, pool: &str, field: &str, namespace: &str) -> Denial {
    Denial::new(
        "floating_ip_pool_not_serving",
        format!(
            "{who}: FloatingIPPool {pool} ({field}) does not serve namespace {namespace} (its spec.namespaceSelector or spec.projects): name a pool that does, or widen the pool's selector"
        ),
    )
}

/// Whose floating request is reviewed: a pod, or the pod template of a
/// workload. The checks are the same; the messages say where the
/// annotations are.
struct Requester {
    /// `pod vnf`, `Deployment vnf`.
    who: String,
    namespace: String,
    /// Where a workload's pod template keeps its annotations
    /// (`spec.template.metadata.annotations`); `None` for a pod, whose
    /// messages name the bare annotation.
    template: Option<String>,
    /// The pod reviewed (its own assigned addresses count as held);
    /// `None` for a template.
    pod: Option<Pod>,
}

impl Requester {
    fn of(
        kind: &str,
        request: &AdmissionRequest<DynamicObject>,
        object: &DynamicObject,
    ) -> Result<Self, Denial> {
        let pod: Option<Pod> = (kind == "Pod").then(|| parse(object, kind)).transpose()?;
        let name = object
            .metadata
            .name
            .clone()
            .unwrap_or_else(|| request.name.clone());
        Ok(Self {
            who: if pod.is_some() {
                format!("pod {name}")
            } else {
                format!("{kind} {name}")
            },
            namespace: request
                .namespace
                .clone()
                .or_else(|| object.namespace())
                .unwrap_or_default(),
            template: pod
                .is_none()
                .then(|| workload::annotations_field(kind))
                .flatten(),
            pod,
        })
    }

    /// How the messages name annotation `key`.
    fn field(&self, key: &str) -> String {
        match &self.template {
            Some(path) => format!("{path}[{key}]"),
            None => key.to_owned(),
        }
    }

    /// The floating request in `annotations`; one that does not parse is
    /// denied naming the annotation.
    fn request_in(
        &self,
        annotations: &BTreeMap<String, String>,
    ) -> Result<Option<PodFloatingRequest>, Denial> {
        request_in(Some(annotations)).map_err(|error| {
            let RequestError::BadAddress { value, .. } = error;
            Denial::new(
                "invalid_floating_request",
                format!(
                    "{}: {} holds {value:?}, which is not a list of IP addresses: give one address per family, comma-separated, e.g. \"192.168.10.5\" or \"192.168.10.5,fd00::5\"",
                    self.who,
                    self.field(annotation::ADDRESSES)
                ),
            )
        })
    }
}

/// Reviews the floating-address request of a Pod, or of the pod template
/// of a workload ([`workload::KINDS`]), on create and on an update that
/// changes it: see the module's list. A request that is unchanged (the
/// operator's own writes, relabelling, scaling) is allowed, except a
/// workload that grows to several pods while a fixed address has no set.
///
/// # Errors
/// The [`Denial`] the user sees.
pub async fn review_request(
    lookup: &Lookup,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<(), Denial> {
    let kind = request.kind.kind.as_str();
    if !matches!(request.operation, Operation::Create | Operation::Update)
        || !workload::KINDS.contains(&kind)
    {
        return Ok(());
    }
    let Some(object) = &request.object else {
        return Ok(());
    };
    let requester = Requester::of(kind, request, object)?;
    let Some(wanted) = requester.request_in(&workload::pod_annotations(kind, object))? else {
        return Ok(());
    };
    if object.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    let several = workload::several_pods(kind, object);
    if let Some(old) = &request.old_object {
        let before = requester
            .request_in(&workload::pod_annotations(kind, old))
            .ok()
            .flatten();
        let grew = several.is_some() && workload::several_pods(kind, old).is_none();
        if before.as_ref() == Some(&wanted) && !grew {
            return Ok(());
        }
    }
    if let Some(several) = several
        && !wanted.fixed.is_empty()
        && wanted.set.is_none()
    {
        return Err(Denial::new(
            "floating_ip_fixed_for_several_pods",
            format!(
                "{}: {} asks for {} for every pod ({several}), but one pod at a time can hold a fixed address: add {} so the pods share it as an active/standby set, or ask with {} for an address per pod",
                requester.who,
                requester.field(annotation::ADDRESSES),
                assigned_value(&wanted.fixed),
                requester.field(annotation::SET),
                requester.field(annotation::POOL),
            ),
        ));
    }
    let (candidate_names, pools) = review_pools_and_addresses(lookup, &requester, &wanted).await?;
    // A template's quota is checked once, when a user creates the
    // workload: not for the ReplicaSets and Jobs its Deployment or CronJob
    // makes, nor on updates (its own pods hold addresses the new ones
    // replace). Each pod is reviewed when created.
    let quota_applies = requester.pod.is_some()
        || (request.operation == Operation::Create
            && workload::controller(object.owner_references()).is_none());
    if !quota_applies {
        return Ok(());
    }
    let candidates: Vec<&ValidPool> = pools
        .iter()
        .filter(|p| candidate_names.contains(&p.name))
        .collect();
    review_quota(lookup, &requester, &wanted, &candidates, &pools).await
}

/// Checks the pools and fixed addresses of `wanted`: the named pool
/// exists, is valid and serves the namespace (or some valid pool does),
/// and each fixed address, at most one per family, lies inside it.
/// Returns the names of the pools the addresses may come from, and every
/// valid pool.
async fn review_pools_and_addresses(
    lookup: &Lookup,
    requester: &Requester,
    wanted: &PodFloatingRequest,
) -> Result<(Vec<String>, Vec<ValidPool>), Denial> {
    let who = &requester.who;
    let namespace = &requester.namespace;
    let labels = lookup.namespace_labels(namespace).await?;
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
                        "{who}: FloatingIPPool {pool_name} ({}) does not exist: name one of [{}] or create it",
                        requester.field(annotation::POOL),
                        names.join(", ")
                    ),
                ));
            };
            let valid = validate_pool(pool_name, &object.spec).map_err(|invalid| {
                Denial::new(
                    "floating_ip_pool_invalid",
                    format!("{who}: {invalid}: fix the pool first"),
                )
            })?;
            if !serves_namespace(object, &labels) {
                return Err(not_serving(
                    who,
                    pool_name,
                    &requester.field(annotation::POOL),
                    namespace,
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
                "{who}: no valid FloatingIPPool serves namespace {namespace}: create one, or widen a pool's spec.namespaceSelector or spec.projects"
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
                    "{who}: {} lists two {family} addresses: give at most one per family",
                    requester.field(annotation::ADDRESSES)
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
                    "{who}: {addr} ({}) is outside {whose}: give an address of {}",
                    requester.field(annotation::ADDRESSES),
                    if ranges.is_empty() {
                        format!("a pool with a {family} network")
                    } else {
                        ranges.join("; ")
                    }
                ),
            ));
        }
    }
    let names = candidates.iter().map(|p| p.name.clone()).collect();
    Ok((names, pools))
}

/// Denies a request that needs a new address (neither the pod nor its set
/// holds one of the family) when the first pool it would take from is at
/// a quota's limit. For a template, that means not one of its pods could
/// get an address.
async fn review_quota(
    lookup: &Lookup,
    requester: &Requester,
    wanted: &PodFloatingRequest,
    candidates: &[&ValidPool],
    pools: &[ValidPool],
) -> Result<(), Denial> {
    let namespace = requester.namespace.as_str();
    let pods = lookup.floating_pods().await?;
    let is_me = |p: &Pod| {
        requester.pod.as_ref().is_some_and(|me| {
            p.namespace().as_deref() == Some(namespace) && p.name_any() == me.name_any()
        })
    };
    let others: Vec<Pod> = pods.into_iter().filter(|p| !is_me(p)).collect();
    let set_holds = set_addresses(&others, namespace, wanted.set.as_deref(), pools);
    let held: Vec<IpAddr> = requester
        .pod
        .iter()
        .flat_map(|pod| pod_addresses(pod, pools))
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
                format!("{}: {exceeded}", requester.who),
            )
        })?;
    }
    Ok(())
}

/// Admission warnings for an allowed workload (not a Pod) whose template
/// gives its one pod a fixed address without a set: the pod that replaces
/// it (a rollout, a rescheduled pod) waits for the old pod's address.
#[must_use]
pub fn template_warnings(request: &AdmissionRequest<DynamicObject>) -> Vec<String> {
    let kind = request.kind.kind.as_str();
    let (Some(object), "Deployment" | "ReplicaSet" | "StatefulSet") = (&request.object, kind)
    else {
        return Vec::new();
    };
    let Ok(requester) = Requester::of(kind, request, object) else {
        return Vec::new();
    };
    match requester.request_in(&workload::pod_annotations(kind, object)) {
        Ok(Some(wanted)) if !wanted.fixed.is_empty() && wanted.set.is_none() => vec![format!(
            "{}: {} gives {} to one pod at a time without {}: a pod replacing it (a rollout, a rescheduled pod) gets the address only once the old pod is gone and its address released (about a minute); add the set so old and new pods share it",
            requester.who,
            requester.field(annotation::ADDRESSES),
            assigned_value(&wanted.fixed),
            requester.field(annotation::SET),
        )],
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests;
