//! FloatingIPProjectQuotas: how many addresses of each pool the Services of
//! a project (or namespace) hold, the check both the webhook and the
//! Service controller make before an address is given, and the quota's
//! status.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use flatnet_k8s::{
    api::{CONDITION_READY, FloatingIPProjectQuota, FloatingIPProjectQuotaStatus, set_condition},
    floating::{QuotaScope, ValidPool, quota_scope, quota_usage},
    ipam::Family,
    keys::label::RANCHER_PROJECT_ID,
};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::{
    Api, ResourceExt,
    api::{DynamicObject, PostParams},
    runtime::{
        controller::Action,
        reflector::{ObjectRef, Store},
    },
};

use super::{Context, Error, services::ingress_addresses};
use crate::controller::{ApiError, condition, is_conflict, is_not_found};

/// Name of the quota controller in logs and metrics.
pub const CONTROLLER: &str = "floating-ip-quota";

/// Condition type set while a limit is reached.
pub const CONDITION_EXHAUSTED: &str = "Exhausted";

/// One more address would exceed a quota.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "FloatingIPProjectQuota {quota} allows {scope} {limit} address(es) of FloatingIPPool {pool} and all are in use: release one (delete a LoadBalancer Service or a pod of the {scope} holding one), share one (Services: flatnetwork.pandaria.io/floating-ip-sharing-key; pods: flatnetwork.pandaria.io/floating-ip-set), or raise spec.limits[{pool}]"
)]
pub struct QuotaExceeded {
    /// The quota's name.
    pub quota: String,
    /// Whom it limits.
    pub scope: QuotaScope,
    /// The pool.
    pub pool: String,
    /// Its limit.
    pub limit: u32,
}

/// A Service that holds addresses: (namespace, project label, addresses).
pub type Holder = (String, Option<String>, Vec<IpAddr>);

/// The addresses every Service holds, with its namespace's project label.
pub fn holders(services: &[Service], namespaces: &[Namespace], pools: &[ValidPool]) -> Vec<Holder> {
    services
        .iter()
        .filter_map(|service| {
            let addrs = ingress_addresses(service, pools);
            if addrs.is_empty() {
                return None;
            }
            let namespace = service.namespace().unwrap_or_default();
            Some((
                namespace.clone(),
                project_label(namespaces, &namespace),
                addrs,
            ))
        })
        .collect()
}

/// The addresses every pod holds, with its namespace's project label (an
/// address shared by an active/standby set counts once in the usage).
pub fn pod_holders(pods: &[Pod], namespaces: &[Namespace], pools: &[ValidPool]) -> Vec<Holder> {
    pods.iter()
        .filter_map(|pod| {
            let addrs = super::pods::pod_addresses(pod, pools);
            if addrs.is_empty() {
                return None;
            }
            let namespace = pod.namespace().unwrap_or_default();
            Some((
                namespace.clone(),
                project_label(namespaces, &namespace),
                addrs,
            ))
        })
        .collect()
}

/// Every holder in the caches (Services and pods) but those `skip` names.
pub fn cached_holders(
    ctx: &Context,
    pools: &[ValidPool],
    skip: impl Fn(&ObjectRef<DynamicObject>) -> bool,
) -> Vec<Holder> {
    let namespaces = cached(&ctx.caches.namespaces);
    let services: Vec<Service> = cached(&ctx.caches.services)
        .into_iter()
        .filter(|s| !skip(&ObjectRef::from_obj(s).erase()))
        .collect();
    let pods: Vec<Pod> = cached(&ctx.caches.pods)
        .into_iter()
        .filter(|p| !skip(&ObjectRef::from_obj(p).erase()))
        .collect();
    let mut all = holders(&services, &namespaces, pools);
    all.extend(pod_holders(&pods, &namespaces, pools));
    all
}

/// The objects of a cache.
fn cached<K: Clone + kube::Resource<DynamicType = ()>>(store: &Store<K>) -> Vec<K> {
    store.state().iter().map(|o| (**o).clone()).collect()
}

/// Reserves an address of `family` (`fixed` when given) in the first of
/// `candidates` within the quotas of `namespace`, given what `holders`
/// hold; returns it and its pool. `Ok(None)` when there is no candidate.
///
/// # Errors
/// The last quota or pool refusal, or the API failing.
pub async fn reserve_within_quotas(
    ctx: &Context,
    candidates: &[&ValidPool],
    pools: &[ValidPool],
    holders: &[Holder],
    namespace: &str,
    family: Family,
    fixed: Option<IpAddr>,
) -> Result<Option<(IpAddr, String)>, Error> {
    let held: Vec<IpAddr> = holders
        .iter()
        .flat_map(|(_, _, a)| a.iter().copied())
        .collect();
    let namespaces = cached(&ctx.caches.namespaces);
    let project = project_label(&namespaces, namespace);
    let quota_list = cached(&ctx.caches.quotas);
    let mut last_error = None;
    for pool in candidates {
        if let Err(exceeded) = check(
            &quota_list,
            holders,
            pools,
            namespace,
            project.as_deref(),
            &pool.name,
        ) {
            last_error = Some(exceeded.into());
            continue;
        }
        match super::ledger::reserve(ctx, &pool.name, family, fixed, &held).await {
            Ok(addr) => return Ok(Some((addr, pool.name.clone()))),
            Err(error @ Error::Pool { .. }) => last_error = Some(error),
            Err(error) => return Err(error),
        }
    }
    last_error.map_or(Ok(None), Err)
}

/// The `field.cattle.io/projectId` label of `namespace`.
pub fn project_label(namespaces: &[Namespace], namespace: &str) -> Option<String> {
    namespaces
        .iter()
        .find(|n| n.name_any() == namespace)
        .and_then(|n| n.labels().get(RANCHER_PROJECT_ID).cloned())
}

/// The pool holding `addr`.
pub fn pool_of(pools: &[ValidPool], addr: IpAddr) -> Option<String> {
    pools
        .iter()
        .find(|p| p.network_of(addr).is_some())
        .map(|p| p.name.clone())
}

/// Checks that a Service in `namespace` (project label `project`) may take
/// one more address of `pool`, given what every Service holds now.
///
/// # Errors
/// [`QuotaExceeded`] naming the first quota at its limit.
pub fn check(
    quotas: &[FloatingIPProjectQuota],
    holders: &[Holder],
    pools: &[ValidPool],
    namespace: &str,
    project: Option<&str>,
    pool: &str,
) -> Result<(), QuotaExceeded> {
    let project = project.map(flatnet_k8s::floating::project_of);
    for quota in quotas {
        let Ok(scope) = quota_scope(&quota.name_any(), &quota.spec) else {
            continue;
        };
        let Some(&limit) = quota.spec.limits.get(pool) else {
            continue;
        };
        if !scope.covers(namespace, project) {
            continue;
        }
        let used = usage(&scope, holders, pools);
        if used.get(pool).copied().unwrap_or_default() >= limit {
            return Err(QuotaExceeded {
                quota: quota.name_any(),
                scope,
                pool: pool.to_owned(),
                limit,
            });
        }
    }
    Ok(())
}

/// Addresses per pool the holders in `scope` hold.
pub fn usage(scope: &QuotaScope, holders: &[Holder], pools: &[ValidPool]) -> BTreeMap<String, u32> {
    quota_usage(
        scope,
        holders
            .iter()
            .map(|(ns, project, addrs)| (ns.as_str(), project.as_deref(), addrs.as_slice())),
        |addr| pool_of(pools, addr),
    )
}

/// Keeps the quota's status: usage per pool, Ready, Exhausted.
///
/// # Errors
/// The API failing.
pub async fn reconcile(
    quota: Arc<FloatingIPProjectQuota>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let name = quota.name_any();
    let generation = quota.metadata.generation;
    let mut status = quota.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    match quota_scope(&name, &quota.spec) {
        Err(error) => {
            set_condition(
                &mut status.conditions,
                condition(
                    CONDITION_READY,
                    false,
                    "Invalid",
                    error.to_string(),
                    generation,
                ),
            );
            status.used.clear();
        }
        Ok(scope) => {
            let pools = ctx.caches.valid_pools();
            let all = cached_holders(&ctx, &pools, |_| false);
            status.used = usage(&scope, &all, &pools);
            set_condition(
                &mut status.conditions,
                condition(
                    CONDITION_READY,
                    true,
                    "Counted",
                    format!("limits {scope}"),
                    generation,
                ),
            );
            let full: Vec<String> = quota
                .spec
                .limits
                .iter()
                .filter(|(pool, limit)| {
                    status.used.get(*pool).copied().unwrap_or_default() >= **limit
                })
                .map(|(pool, limit)| format!("{pool} ({limit})"))
                .collect();
            set_condition(
                &mut status.conditions,
                condition(
                    CONDITION_EXHAUSTED,
                    !full.is_empty(),
                    if full.is_empty() {
                        "BelowLimits"
                    } else {
                        "LimitReached"
                    },
                    if full.is_empty() {
                        "every pool has addresses left".to_owned()
                    } else {
                        format!("at the limit of {}", full.join(", "))
                    },
                    generation,
                ),
            );
        }
    }
    if quota.status.as_ref() != Some(&status) {
        write_status(&ctx, &quota, status).await?;
    }
    Ok(Action::requeue(ctx.settings.resync))
}

async fn write_status(
    ctx: &Context,
    quota: &FloatingIPProjectQuota,
    status: FloatingIPProjectQuotaStatus,
) -> Result<(), Error> {
    let name = quota.name_any();
    let api: Api<FloatingIPProjectQuota> = Api::all(ctx.client.clone());
    let mut updated = quota.clone();
    updated.status = Some(status);
    match api
        .replace_status(&name, &PostParams::default(), &updated)
        .await
    {
        // A newer version is reconciled next.
        Ok(_) => Ok(()),
        Err(error) if is_conflict(&error) || is_not_found(&error) => Ok(()),
        Err(error) => {
            Err(ApiError::of("update status of", "FloatingIPProjectQuota", &name)(error).into())
        }
    }
}

/// Retries after the backoff of the quota.
pub fn error_policy(quota: Arc<FloatingIPProjectQuota>, _: &Error, ctx: Arc<Context>) -> Action {
    let key = ObjectRef::from_obj(&*quota).to_string();
    Action::requeue(ctx.backoff.next(&key).min(Duration::from_secs(60)))
}
