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
//!   same quota check, since admission can race or be bypassed.

use flatnet_k8s::{
    api::{FloatingIPPool, FloatingIPProjectQuota},
    floating::{ValidPool, quota_scope, request_of, validate_pool, wants_floating},
    ipam::Family,
};
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::{
    ResourceExt,
    core::{
        DynamicObject,
        admission::{AdmissionRequest, Operation},
    },
};

use super::{Denial, lookup::Lookup};
use crate::floating::{quotas, services::ingress_addresses};

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

#[cfg(test)]
mod tests;
