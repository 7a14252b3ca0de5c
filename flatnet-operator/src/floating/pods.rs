//! The pod controller: floating addresses that follow pods.
//!
//! A pod asking for one (`flatnetwork.pandaria.io/floating-ip-pool`, or
//! fixed addresses in `flatnetwork.pandaria.io/floating-ip`) gets an
//! address of every family its pool has (or of the fixed addresses'
//! families), written to its `flatnetwork.pandaria.io/floating-ip-assigned`
//! annotation, and labelled `flatnetwork.pandaria.io/floating-ip-assigned:
//! "true"` so the agents can watch only those pods. Pods of one namespace with the same
//! `flatnetwork.pandaria.io/floating-ip-set` get the same addresses (the
//! lowest of its members', when two reserved one each at once): the
//! agents give them to the set's active pod (`flatnet_k8s::floating::pods`).
//! A new address is reserved in the pool's ledger first, then written
//! with the resourceVersion read; an address a pod stops holding is
//! released unless another pod or a Service holds it. A deleted pod keeps
//! no finalizer: the pool repair frees its address once no pod or Service
//! has named it for the orphan grace.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use flatnet_k8s::{
    floating::{
        ValidPool, annotation,
        pods::{
            ASSIGNED_LABEL, PodFloatingRequest, assigned_ips, assigned_value, is_labelled_assigned,
            pod_request_of,
        },
    },
    ipam::Family,
};
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams},
    runtime::{controller::Action, reflector::ObjectRef},
};
use serde_json::json;
use tracing::{info, instrument};

use super::{Context, Error, ledger, quotas, services};
use crate::{
    allocation::key_of,
    controller::{ApiError, is_conflict, is_not_found},
};

/// Name of the pod controller in logs and metrics.
pub const CONTROLLER: &str = "floating-ip-pod";

/// Retry delay when only the user can fix the pod or its pools.
const RETRY_USER: Duration = Duration::from_secs(60);

/// The floating addresses `pod` holds: its assigned addresses inside a
/// valid pool.
pub fn pod_addresses(pod: &Pod, pools: &[ValidPool]) -> Vec<IpAddr> {
    assigned_ips(pod)
        .into_iter()
        .filter(|a| quotas::pool_of(pools, *a).is_some())
        .collect()
}

/// The addresses the other members of `set` in `namespace` hold, among
/// `others` (none without a set); members being deleted hold nothing.
pub fn set_addresses<'a>(
    others: impl IntoIterator<Item = &'a Pod>,
    namespace: &str,
    set: Option<&str>,
    pools: &[ValidPool],
) -> Vec<IpAddr> {
    let Some(set) = set else {
        return Vec::new();
    };
    others
        .into_iter()
        .filter(|o| o.namespace().as_deref() == Some(namespace))
        .filter(|o| o.metadata.deletion_timestamp.is_none())
        .filter(|o| {
            pod_request_of(o)
                .ok()
                .flatten()
                .is_some_and(|r| r.set.as_deref() == Some(set))
        })
        .flat_map(|o| pod_addresses(o, pools))
        .collect()
}

/// Whether a pod that ended (or goes) should still name its addresses:
/// until it is gone, so the pool repair does not free them early.
fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Gives the pod its addresses, or takes them back.
///
/// # Errors
/// What [`Error`] lists; a user's mistake is also an Event on the pod.
#[instrument(skip_all, fields(pod = %key_of(pod.namespace().as_deref(), &pod.name_any())))]
pub async fn reconcile(pod: Arc<Pod>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let pools = ctx.caches.valid_pools();
    let current = pod_addresses(&pod, &pools);
    let key = key_of(pod.namespace().as_deref(), &pod.name_any());
    let request = pod_request_of(&pod).map_err(|source| Error::PodRequest {
        pod: key.clone(),
        source,
    });
    let request = match request {
        Ok(request) => request,
        Err(error) => {
            warn_failed(&ctx, &pod, &error).await;
            return Err(error);
        }
    };
    if pod.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let Some(request) = request.filter(|_| !finished(&pod)) else {
        let stale = !current.is_empty() || is_labelled_assigned(&pod);
        if stale && write_assigned(&ctx, &pod, &[]).await? {
            release_unheld(&ctx, &pod, &pools, &current).await?;
        }
        return Ok(Action::await_change());
    };
    match assign(&ctx, &pod, &request, &pools, &current).await {
        Ok(()) => {
            ctx.backoff.reset(&ObjectRef::from_obj(&*pod).to_string());
            Ok(Action::requeue(ctx.settings.resync))
        }
        Err(error) => {
            if error.needs_user() {
                warn_failed(&ctx, &pod, &error).await;
            }
            Err(error)
        }
    }
}

/// Tells the pod why its floating address cannot be given (a Warning).
async fn warn_failed(ctx: &Context, pod: &Pod, error: &Error) {
    ctx.events
        .warn(pod, services::REASON_FAILED, "Allocate", error.to_string())
        .await;
}

/// Retries: slowly when the user must act, else with the per-object backoff.
pub fn error_policy(pod: Arc<Pod>, error: &Error, ctx: Arc<Context>) -> Action {
    if error.needs_user() {
        return Action::requeue(RETRY_USER);
    }
    Action::requeue(ctx.backoff.next(&ObjectRef::from_obj(&*pod).to_string()))
}

/// Other pods, as the cache shows them.
fn other_pods(ctx: &Context, pod: &Pod) -> Vec<Arc<Pod>> {
    let me = ObjectRef::from_obj(pod);
    ctx.caches
        .pods
        .state()
        .into_iter()
        .filter(|p| ObjectRef::from_obj(&**p) != me)
        .collect()
}

/// One address the pod gets.
struct Wanted {
    /// Its family.
    family: Family,
    /// The fixed address asked for, if any.
    fixed: Option<IpAddr>,
    /// The pools it may come from.
    candidates: Vec<ValidPool>,
}

/// The addresses the pod gets, one per family, and the pools each may
/// come from.
fn wanted(
    ctx: &Context,
    pod: &Pod,
    request: &PodFloatingRequest,
    pools: &[ValidPool],
) -> Result<Vec<Wanted>, Error> {
    let key = key_of(pod.namespace().as_deref(), &pod.name_any());
    let namespace = pod.namespace().unwrap_or_default();
    let named: Vec<&ValidPool> = pools
        .iter()
        .filter(|p| request.pool.as_ref().is_none_or(|name| *name == p.name))
        .filter(|p| services::eligible(ctx, p, &namespace))
        .collect();
    let mut families: Vec<(Family, Option<IpAddr>)> = if request.fixed.is_empty() {
        // A named pool: every family it has.
        named
            .first()
            .map(|p| p.networks.iter().map(|n| (n.cidr.family(), None)).collect())
            .unwrap_or_default()
    } else {
        request
            .fixed
            .iter()
            .map(|a| (Family::of(*a), Some(*a)))
            .collect()
    };
    families.dedup_by_key(|(family, _)| *family);
    let mut wanted = Vec::new();
    for (family, fixed) in families {
        let candidates: Vec<ValidPool> = named
            .iter()
            .filter(|p| p.network(family).is_some())
            .filter(|p| fixed.is_none_or(|a| p.network_of(a).is_some()))
            .map(|p| (*p).clone())
            .collect();
        if candidates.is_empty() {
            break;
        }
        wanted.push(Wanted {
            family,
            fixed,
            candidates,
        });
    }
    if wanted.is_empty() || (!request.fixed.is_empty() && wanted.len() < request.fixed.len()) {
        let detail = match (&request.pool, request.fixed.first()) {
            (Some(name), _) => format!("named {name} serves namespace {namespace}"),
            (None, Some(_)) => format!(
                "holding {} serves namespace {namespace}",
                assigned_value(&request.fixed)
            ),
            (None, None) => format!("serves namespace {namespace}"),
        };
        return Err(Error::NoPodPool { pod: key, detail });
    }
    Ok(wanted)
}

/// Gives the pod an address per family and writes them.
async fn assign(
    ctx: &Context,
    pod: &Pod,
    request: &PodFloatingRequest,
    pools: &[ValidPool],
    current: &[IpAddr],
) -> Result<(), Error> {
    let namespace = pod.namespace().unwrap_or_default();
    let others = other_pods(ctx, pod);
    let mut desired = Vec::new();
    // Newly reserved addresses per pool, handed back if not written.
    let mut fresh: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for Wanted {
        family,
        fixed,
        candidates,
    } in wanted(ctx, pod, request, pools)?
    {
        let fits = |a: &IpAddr| {
            Family::of(*a) == family
                && fixed.is_none_or(|f| f == *a)
                && candidates.iter().any(|p| p.network_of(*a).is_some())
        };
        // Kept while it still satisfies the request; a set shares its
        // members' address, the lowest when two members reserved one each
        // at the same time, so the set converges on one.
        let siblings = set_addresses(
            others.iter().map(|o| &**o),
            &namespace,
            request.set.as_deref(),
            pools,
        );
        if let Some(addr) = current.iter().chain(&siblings).copied().filter(fits).min() {
            desired.push(addr);
            continue;
        }
        match reserve(ctx, pod, family, fixed, &candidates, pools).await {
            Ok((addr, pool)) => {
                desired.push(addr);
                fresh.entry(pool).or_default().push(addr);
            }
            Err(error) => {
                ledger::hand_back(ctx, &fresh).await;
                return Err(error);
            }
        }
    }
    if desired == current {
        // A pod assigned before the label existed gets it now.
        if !is_labelled_assigned(pod) {
            write_assigned(ctx, pod, &desired).await?;
        }
        return Ok(());
    }
    if !ledger::write_or_hand_back(ctx, &fresh, write_assigned(ctx, pod, &desired)).await? {
        return Ok(());
    }
    let replaced: Vec<IpAddr> = current
        .iter()
        .copied()
        .filter(|a| !desired.contains(a))
        .collect();
    release_unheld(ctx, pod, pools, &replaced).await?;
    let text = assigned_value(&desired);
    info!(addresses = %text, "floating addresses assigned to the pod");
    ctx.events
        .normal(
            pod,
            services::REASON_ASSIGNED,
            "Allocate",
            format!("floating address(es) {} assigned", text.replace(',', ", ")),
        )
        .await;
    Ok(())
}

/// Reserves a new address of `family` in the first candidate pool within
/// the namespace's quotas; returns it and its pool.
async fn reserve(
    ctx: &Context,
    pod: &Pod,
    family: Family,
    fixed: Option<IpAddr>,
    candidates: &[ValidPool],
    pools: &[ValidPool],
) -> Result<(IpAddr, String), Error> {
    let namespace = pod.namespace().unwrap_or_default();
    let me = ObjectRef::from_obj(pod).erase();
    let holders = quotas::cached_holders(ctx, pools, |o| *o == me);
    let candidates: Vec<&ValidPool> = candidates.iter().collect();
    quotas::reserve_within_quotas(ctx, &candidates, pools, &holders, &namespace, family, fixed)
        .await?
        .ok_or_else(|| Error::NoPodPool {
            pod: key_of(Some(&namespace), &pod.name_any()),
            detail: format!("with a free {family} address serves namespace {namespace}"),
        })
}

/// Releases `addrs` unless another pod (of the set) or a Service still
/// holds them.
async fn release_unheld(
    ctx: &Context,
    pod: &Pod,
    pools: &[ValidPool],
    addrs: &[IpAddr],
) -> Result<(), Error> {
    let others = other_pods(ctx, pod);
    let services = ctx.caches.services.state();
    let mut unheld = Vec::new();
    for addr in addrs {
        let held = others
            .iter()
            .any(|o| pod_addresses(o, pools).contains(addr))
            || services
                .iter()
                .any(|s| services::ingress_addresses(s, pools).contains(addr));
        if !held {
            unheld.push(*addr);
        }
    }
    ledger::release_each(ctx, pools, &unheld).await
}

/// Writes `addrs` as the pod's assigned addresses and its label (none:
/// both removed), with the resourceVersion read. `false` when the pod changed
/// or went meanwhile: the caller hands a reservation back and the next
/// reconcile starts over.
async fn write_assigned(ctx: &Context, pod: &Pod, addrs: &[IpAddr]) -> Result<bool, Error> {
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let value = (!addrs.is_empty()).then(|| assigned_value(addrs));
    let label = (!addrs.is_empty()).then_some("true");
    let patch = json!({
        "metadata": {
            "resourceVersion": pod.resource_version(),
            "annotations": { annotation::ASSIGNED: value },
            "labels": { ASSIGNED_LABEL: label },
        }
    });
    match api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(true),
        Err(error) if is_conflict(&error) || is_not_found(&error) => Ok(false),
        Err(error) => {
            Err(ApiError::of("annotate", "Pod", &key_of(Some(&namespace), &name))(error).into())
        }
    }
}

#[cfg(test)]
mod tests;
