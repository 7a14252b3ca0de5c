//! The Service controller: addresses for LoadBalancer Services.
//!
//! A Service flatnet serves gets, per family of `spec.ipFamilies`, an
//! address from the pool its annotation names or the first eligible pool
//! (by name) with a free address: its fixed address when it asks for one,
//! the address of a Service with the same sharing key when their ports do
//! not clash, or a free one. Each new address is reserved in the pool's
//! ledger first ([`ledger::reserve`]), then written to
//! `status.loadBalancer.ingress`; only then are addresses the Service held
//! before released. A finalizer makes the release on deletion certain; a
//! Service that stops asking (type or class changed) has its ingress
//! cleared, then its addresses released, then the finalizer removed.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use flatnet_k8s::{
    api::FloatingIPPool,
    floating::{FloatingRequest, ValidPool, clashing_port, project_of, request_of, wants_floating},
    ipam::Family,
    selector,
};
use k8s_openapi::api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, Service, ServiceStatus};
use kube::{
    Api, ResourceExt,
    api::PostParams,
    runtime::{controller::Action, reflector::ObjectRef},
};
use tracing::{info, instrument};

use super::{Context, Error, ledger, quotas};
use crate::{
    allocation::key_of,
    controller::{ApiError, is_conflict, is_not_found},
};

/// Finalizer on the Services holding floating addresses.
pub const FINALIZER: &str = "flatnetwork.pandaria.io/floating-ip";
/// Event reason when a Service gets (or changes) its addresses.
pub const REASON_ASSIGNED: &str = "FloatingIPAssigned";
/// Event reason when a Service cannot get an address.
pub const REASON_FAILED: &str = "FloatingIPFailed";
/// Retry delay when only the user can fix the Service or its pools.
const RETRY_USER: Duration = Duration::from_secs(60);

/// The floating addresses `service` holds: its ingress addresses inside a
/// valid pool.
pub fn ingress_addresses(service: &Service, pools: &[ValidPool]) -> Vec<IpAddr> {
    flatnet_k8s::floating::ingress_ips(service)
        .into_iter()
        .filter(|a| quotas::pool_of(pools, *a).is_some())
        .collect()
}

/// Gives the Service its addresses, or takes them back.
///
/// # Errors
/// What [`Error`] lists; a user's mistake is also an Event on the Service.
#[instrument(skip_all, fields(service = %key_of(service.namespace().as_deref(), &service.name_any())))]
pub async fn reconcile(service: Arc<Service>, ctx: Arc<Context>) -> Result<Action, Error> {
    let pools = ctx.caches.valid_pools();
    let current = ingress_addresses(&service, &pools);
    let wants = wants_floating(&service, ctx.settings.classless)
        && service.metadata.deletion_timestamp.is_none();
    if !wants {
        give_back(&ctx, &service, &pools, &current).await?;
        return Ok(Action::await_change());
    }
    let service = ensure_finalizer(&ctx, &service).await?;
    match assign(&ctx, &service, &pools, &current).await {
        Ok(()) => {
            ctx.backoff
                .reset(&ObjectRef::from_obj(&service).to_string());
            Ok(Action::requeue(ctx.settings.resync))
        }
        Err(error) => {
            if error.needs_user() {
                ctx.events
                    .warn(&service, REASON_FAILED, "Allocate", error.to_string())
                    .await;
            }
            Err(error)
        }
    }
}

/// Retries: slowly when the user must act, else with the per-object backoff.
pub fn error_policy(service: Arc<Service>, error: &Error, ctx: Arc<Context>) -> Action {
    if error.needs_user() {
        return Action::requeue(RETRY_USER);
    }
    Action::requeue(
        ctx.backoff
            .next(&ObjectRef::from_obj(&*service).to_string()),
    )
}

/// Whether `pool` may serve Services of `namespace`.
pub(super) fn eligible(ctx: &Context, pool: &ValidPool, namespace: &str) -> bool {
    let Some(object) = ctx.caches.pools.get(&ObjectRef::new(&pool.name)) else {
        return false;
    };
    let labels = ctx
        .caches
        .namespaces
        .get(&ObjectRef::new(namespace))
        .map(|n| n.labels().clone())
        .unwrap_or_default();
    serves_namespace(&object, &labels)
}

/// Whether `pool` serves a namespace with `labels`: its
/// `namespaceSelector` (if any) matches them, and its `projects` (if any)
/// hold the namespace's Rancher project.
pub fn serves_namespace(pool: &FloatingIPPool, labels: &selector::Labels) -> bool {
    let selected = pool
        .spec
        .namespace_selector
        .as_ref()
        .is_none_or(|s| selector::matches(s, labels).unwrap_or(false));
    let in_project = pool.spec.projects.is_empty()
        || labels
            .get(flatnet_k8s::keys::label::RANCHER_PROJECT_ID)
            .is_some_and(|p| pool.spec.projects.iter().any(|w| w == project_of(p)));
    selected && in_project
}

/// Other Services, as the cache shows them.
fn others(ctx: &Context, service: &Service) -> Vec<Arc<Service>> {
    let me = ObjectRef::from_obj(service);
    ctx.caches
        .services
        .state()
        .into_iter()
        .filter(|s| ObjectRef::from_obj(&**s) != me)
        .collect()
}

/// The address of `family` for the Service, and whether it was newly
/// reserved (to hand back if the Service write does not land).
async fn address_for(
    ctx: &Context,
    service: &Service,
    request: &FloatingRequest,
    pools: &[ValidPool],
    current: &[IpAddr],
    family: Family,
) -> Result<(IpAddr, Option<String>), Error> {
    let key = key_of(service.namespace().as_deref(), &service.name_any());
    let namespace = service.namespace().unwrap_or_default();
    let fixed = request
        .fixed
        .iter()
        .copied()
        .find(|a| Family::of(*a) == family);
    let candidates: Vec<&ValidPool> = pools
        .iter()
        .filter(|p| request.pool.as_ref().is_none_or(|name| *name == p.name))
        .filter(|p| p.network(family).is_some())
        .filter(|p| fixed.is_none_or(|a| p.network_of(a).is_some()))
        .filter(|p| eligible(ctx, p, &namespace))
        .collect();
    if candidates.is_empty() {
        let detail = match (&request.pool, fixed) {
            (Some(name), _) => {
                format!("named {name} serves namespace {namespace} with an {family} network")
            }
            (None, Some(addr)) => format!("holding {addr} serves namespace {namespace}"),
            (None, None) => format!("with an {family} network serves namespace {namespace}"),
        };
        return Err(Error::NoPool {
            service: key,
            detail,
        });
    }
    // Kept while it still satisfies the request.
    if let Some(addr) = current.iter().copied().find(|a| {
        Family::of(*a) == family
            && fixed.is_none_or(|f| f == *a)
            && candidates.iter().any(|p| p.network_of(*a).is_some())
    }) {
        return Ok((addr, None));
    }
    let others = others(ctx, service);
    if let Some(sharing_key) = &request.sharing_key {
        // Every Service with the key, per address it holds of this family:
        // the address is shared only when no port clashes with any of them.
        let mut sharers: BTreeMap<IpAddr, Vec<(&Service, FloatingRequest)>> = BTreeMap::new();
        for other in &others {
            let Ok(theirs) = request_of(other) else {
                continue;
            };
            if other.namespace() != service.namespace()
                || theirs.sharing_key.as_ref() != Some(sharing_key)
            {
                continue;
            }
            for addr in ingress_addresses(other, pools).into_iter().filter(|a| {
                Family::of(*a) == family
                    && fixed.is_none_or(|f| f == *a)
                    && candidates.iter().any(|p| p.network_of(*a).is_some())
            }) {
                sharers
                    .entry(addr)
                    .or_default()
                    .push((other, theirs.clone()));
            }
        }
        let mut clash = None;
        for (addr, holders) in &sharers {
            let clashing = holders.iter().find_map(|(other, theirs)| {
                clashing_port(&request.ports, &theirs.ports).map(|port| (*other, port))
            });
            match clashing {
                None => return Ok((*addr, None)),
                Some((other, port)) => {
                    clash.get_or_insert_with(|| Error::PortClash {
                        service: key.clone(),
                        key: sharing_key.clone(),
                        other: key_of(other.namespace().as_deref(), &other.name_any()),
                        protocol: port.protocol.clone(),
                        port: port.port,
                    });
                }
            }
        }
        if let Some(error) = clash {
            return Err(error);
        }
    }
    let me = ObjectRef::from_obj(service).erase();
    let holders = quotas::cached_holders(ctx, pools, |o| *o == me);
    if let Some((addr, pool)) =
        quotas::reserve_within_quotas(ctx, &candidates, pools, &holders, &namespace, family, fixed)
            .await?
    {
        return Ok((addr, Some(pool)));
    }
    Err(Error::NoPool {
        service: key,
        detail: format!("with a free {family} address serves namespace {namespace}"),
    })
}

/// Gives the Service an address per family and writes them.
async fn assign(
    ctx: &Context,
    service: &Service,
    pools: &[ValidPool],
    current: &[IpAddr],
) -> Result<(), Error> {
    let key = key_of(service.namespace().as_deref(), &service.name_any());
    let request = request_of(service).map_err(|source| Error::Request {
        service: key.clone(),
        source,
    })?;
    let mut desired = Vec::new();
    // Newly reserved addresses per pool, handed back if not written.
    let mut fresh: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for family in &request.families {
        match address_for(ctx, service, &request, pools, current, *family).await {
            Ok((addr, reserved_in)) => {
                desired.push(addr);
                if let Some(pool) = reserved_in {
                    fresh.entry(pool).or_default().push(addr);
                }
            }
            Err(error) => {
                ledger::hand_back(ctx, &fresh).await;
                return Err(error);
            }
        }
    }
    if desired == current {
        return Ok(());
    }
    let write = async {
        write_ingress(ctx, service, &desired)
            .await
            .map(|written| written.is_some())
    };
    if !ledger::write_or_hand_back(ctx, &fresh, write).await? {
        return Ok(());
    }
    let replaced: Vec<IpAddr> = current
        .iter()
        .copied()
        .filter(|a| !desired.contains(a))
        .collect();
    release_unheld(ctx, service, pools, &replaced).await?;
    let text: Vec<String> = desired.iter().map(ToString::to_string).collect();
    info!(addresses = %text.join(","), "floating addresses assigned");
    ctx.events
        .normal(
            service,
            REASON_ASSIGNED,
            "Allocate",
            format!("floating address(es) {} assigned", text.join(", ")),
        )
        .await;
    Ok(())
}

/// Releases `addrs` unless another Service still holds them (a shared
/// address stays while one of its Services remains).
async fn release_unheld(
    ctx: &Context,
    service: &Service,
    pools: &[ValidPool],
    addrs: &[IpAddr],
) -> Result<(), Error> {
    let others = others(ctx, service);
    let mut unheld = Vec::new();
    for addr in addrs {
        let shared = others.iter().any(|o| {
            o.metadata.deletion_timestamp.is_none() && ingress_addresses(o, pools).contains(addr)
        });
        if !shared {
            unheld.push(*addr);
        }
    }
    ledger::release_each(ctx, pools, &unheld).await
}

/// Writes `addrs` as the Service's ingress, with the resourceVersion read,
/// and returns the Service written. `None` when the Service changed so that it no longer asks the same, or
/// went: the caller hands the reservation back and the next reconcile
/// starts over.
async fn write_ingress(
    ctx: &Context,
    service: &Service,
    addrs: &[IpAddr],
) -> Result<Option<Service>, Error> {
    let namespace = service.namespace().unwrap_or_default();
    let name = service.name_any();
    let key = key_of(Some(&namespace), &name);
    let api: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut current = service.clone();
    for _ in 0..crate::allocation::commit::MAX_ATTEMPTS {
        let mut updated = current.clone();
        let status = updated.status.get_or_insert_with(ServiceStatus::default);
        status.load_balancer = Some(LoadBalancerStatus {
            ingress: (!addrs.is_empty()).then(|| {
                addrs
                    .iter()
                    .map(|a| LoadBalancerIngress {
                        ip: Some(a.to_string()),
                        ip_mode: Some("VIP".into()),
                        ..LoadBalancerIngress::default()
                    })
                    .collect()
            }),
        });
        match api
            .replace_status(&name, &PostParams::default(), &updated)
            .await
        {
            Ok(written) => return Ok(Some(written)),
            Err(error) if is_not_found(&error) => return Ok(None),
            Err(error) if is_conflict(&error) => {
                let fresh = api
                    .get_opt(&name)
                    .await
                    .map_err(ApiError::of("get", "Service", &key))?;
                match fresh {
                    Some(fresh)
                        if fresh.spec == service.spec
                            && fresh.metadata.annotations == service.metadata.annotations
                            && fresh.metadata.deletion_timestamp.is_none() =>
                    {
                        current = fresh;
                    }
                    _ => return Ok(None),
                }
            }
            Err(error) => {
                return Err(ApiError::of("update status of", "Service", &key)(error).into());
            }
        }
    }
    Ok(None)
}

/// A Service that no longer asks (or goes): clear its ingress, release
/// its addresses, drop the finalizer.
async fn give_back(
    ctx: &Context,
    service: &Service,
    pools: &[ValidPool],
    current: &[IpAddr],
) -> Result<(), Error> {
    let has_finalizer = service.finalizers().iter().any(|f| f == FINALIZER);
    if current.is_empty() && !has_finalizer {
        return Ok(());
    }
    let mut service = service.clone();
    if !current.is_empty() && service.metadata.deletion_timestamp.is_none() {
        match write_ingress(ctx, &service, &[]).await? {
            Some(written) => service = written,
            // Changed meanwhile: the next reconcile sees the new version.
            None => return Ok(()),
        }
    }
    release_unheld(ctx, &service, pools, current).await?;
    if has_finalizer {
        set_finalizer(ctx, &service, false).await?;
    }
    Ok(())
}

/// The Service with the finalizer on, written if it was missing.
async fn ensure_finalizer(ctx: &Context, service: &Service) -> Result<Service, Error> {
    if service.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(service.clone());
    }
    set_finalizer(ctx, service, true).await
}

/// Adds or removes the finalizer with the resourceVersion read (a conflict
/// is an error: the next reconcile sees the newer version).
async fn set_finalizer(ctx: &Context, service: &Service, on: bool) -> Result<Service, Error> {
    let namespace = service.namespace().unwrap_or_default();
    let name = service.name_any();
    let api: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut updated = service.clone();
    let finalizers = updated.metadata.finalizers.get_or_insert_with(Vec::new);
    finalizers.retain(|f| f != FINALIZER);
    if on {
        finalizers.push(FINALIZER.into());
    }
    match api.replace(&name, &PostParams::default(), &updated).await {
        Ok(written) => Ok(written),
        Err(error) if !on && is_not_found(&error) => Ok(updated),
        Err(error) => Err(ApiError::of(
            "set the finalizer of",
            "Service",
            &key_of(Some(&namespace), &name),
        )(error)
        .into()),
    }
}
