//! The FloatingIPPool controller: validation, usage and conditions in the
//! status, the repair of the ledger, and the `network-interface-mappings`
//! ConfigMap (pool name -> `targetNetworkInterface`) the original kept for
//! tools that read it.
//!
//! The repair starts from the ledger read from the API server: an address
//! a Service or pod holds and the ledger lacks is added; an address the
//! ledger holds and no Service or pod names is a reservation whose write
//! is in flight (or crashed), or the address of a deleted pod, freed once
//! unnamed for the orphan grace.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use flatnet_k8s::{
    api::{CONDITION_READY, FloatingIPPool, set_condition},
    floating::{INTERFACE_MAPPINGS, validate_pool},
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api, ResourceExt,
    api::{ObjectMeta, PostParams},
    runtime::{controller::Action, reflector::ObjectRef},
};
use tracing::{info, instrument};

use super::{Context, Error, ledger, pods::pod_addresses, services::ingress_addresses};
use crate::{
    allocation::commit::MAX_ATTEMPTS,
    controller::{ApiError, condition, is_conflict, is_not_found},
};
use flatnet_k8s::keys::label;

/// Name of the pool controller in logs and metrics.
pub const CONTROLLER: &str = "floating-ip-pool";

/// Keeps the pool's status and ledger, and the mappings ConfigMap.
///
/// # Errors
/// The API failing.
#[instrument(skip_all, fields(pool = %pool.name_any()))]
pub async fn reconcile(pool: Arc<FloatingIPPool>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let kept_young = repair(&pool, &ctx).await?;
    sync_mappings(&ctx).await?;
    ctx.backoff.reset(&ObjectRef::from_obj(&*pool).to_string());
    Ok(Action::requeue(if kept_young {
        (ctx.settings.orphan_grace / 4).clamp(Duration::from_millis(100), ctx.settings.resync)
    } else {
        ctx.settings.resync
    }))
}

/// Writes the pool's status: Ready false with the problems when invalid or
/// overlapping another pool; else the repaired ledger and its usage.
/// Returns whether unnamed ledger addresses were kept for their grace.
async fn repair(pool: &FloatingIPPool, ctx: &Context) -> Result<bool, Error> {
    let name = pool.name_any();
    let api: Api<FloatingIPPool> = Api::all(ctx.client.clone());
    for _ in 0..MAX_ATTEMPTS {
        let Some(mut fresh) =
            api.get_opt(&name)
                .await
                .map_err(ApiError::of("get", "FloatingIPPool", &name))?
        else {
            return Ok(false);
        };
        let generation = fresh.metadata.generation;
        let mut status = fresh.status.clone().unwrap_or_default();
        let mut kept = false;
        let problem = match validate_pool(&name, &fresh.spec) {
            Err(invalid) => Some(("Invalid", invalid.to_string())),
            Ok(valid) => {
                let allocating = ctx.caches.valid_pools();
                let overlapping = allocating
                    .iter()
                    .find(|other| other.name != name && other.overlaps(&valid))
                    .filter(|_| !allocating.iter().any(|p| p.name == name));
                if let Some(other) = overlapping {
                    Some((
                        "Overlap",
                        format!(
                            "FloatingIPPool {name} shares addresses with FloatingIPPool {}: give each pool its own CIDR or ranges",
                            other.name
                        ),
                    ))
                } else {
                    let held: Vec<IpAddr> = ctx
                        .caches
                        .services
                        .state()
                        .iter()
                        .flat_map(|s| ingress_addresses(s, std::slice::from_ref(&valid)))
                        .chain(
                            ctx.caches
                                .pods
                                .state()
                                .iter()
                                .flat_map(|p| pod_addresses(p, std::slice::from_ref(&valid))),
                        )
                        .collect();
                    let mut pools = ledger::pools_of(&valid, &status);
                    for addr in &held {
                        if let Some(p) = pools.iter_mut().find(|p| p.cidr().contains(*addr)) {
                            let _ = p.mark_used(*addr);
                        }
                    }
                    let unnamed: Vec<IpAddr> = pools
                        .iter()
                        .flat_map(|p| p.used_addresses().collect::<Vec<_>>())
                        .filter(|a| !held.contains(a))
                        .collect();
                    let keys: Vec<String> = unnamed.iter().map(ToString::to_string).collect();
                    let young = ctx.orphans.young(
                        &format!("FloatingIPPool/{name}"),
                        &keys,
                        ctx.settings.orphan_grace,
                    );
                    for (addr, keep) in unnamed.iter().zip(&young) {
                        if !keep {
                            info!(%addr, "freeing a pool address no Service or pod names");
                            pools.iter_mut().for_each(|p| {
                                p.release(*addr);
                            });
                        }
                    }
                    kept = young.iter().any(|k| *k);
                    ledger::set_usage(&mut status, &pools, generation);
                    None
                }
            }
        };
        if let Some((reason, message)) = problem {
            status.observed_generation = generation;
            set_condition(
                &mut status.conditions,
                condition(CONDITION_READY, false, reason, message, generation),
            );
        }
        if fresh.status.as_ref() == Some(&status) {
            return Ok(kept);
        }
        fresh.status = Some(status);
        match api
            .replace_status(&name, &PostParams::default(), &fresh)
            .await
        {
            Ok(_) => return Ok(kept),
            Err(error) if is_conflict(&error) => ctx.metrics.allocation_conflict(),
            Err(error) if is_not_found(&error) => return Ok(false),
            Err(error) => {
                return Err(
                    ApiError::of("update status of", "FloatingIPPool", &name)(error).into(),
                );
            }
        }
    }
    Err(Error::Contention {
        pool: name,
        attempts: MAX_ATTEMPTS,
    })
}

/// The mappings every pool's name to its `targetNetworkInterface`.
fn mappings(ctx: &Context) -> BTreeMap<String, String> {
    ctx.caches
        .pools
        .state()
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| (p.name_any(), p.spec.target_network_interface.clone()))
        .collect()
}

/// Creates or updates the `network-interface-mappings` ConfigMap.
async fn sync_mappings(ctx: &Context) -> Result<(), Error> {
    let namespace = &ctx.settings.namespace;
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), namespace);
    let key = format!("{namespace}/{INTERFACE_MAPPINGS}");
    let data = mappings(ctx);
    let existing =
        api.get_opt(INTERFACE_MAPPINGS)
            .await
            .map_err(ApiError::of("get", "ConfigMap", &key))?;
    let result = match existing {
        Some(current) if current.data.as_ref() == Some(&data) => return Ok(()),
        Some(mut current) => {
            current.data = Some(data);
            api.replace(INTERFACE_MAPPINGS, &PostParams::default(), &current)
                .await
        }
        None => {
            let map = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(INTERFACE_MAPPINGS.into()),
                    namespace: Some(namespace.clone()),
                    labels: Some(BTreeMap::from([(
                        label::MANAGED_BY.to_owned(),
                        label::MANAGED_BY_FLATNET.to_owned(),
                    )])),
                    ..ObjectMeta::default()
                },
                data: Some(data),
                ..ConfigMap::default()
            };
            api.create(&PostParams::default(), &map).await
        }
    };
    match result {
        Ok(_) => Ok(()),
        // Someone else wrote it meanwhile: the next pass compares again.
        Err(error) if is_conflict(&error) => Ok(()),
        Err(error) => Err(ApiError::of("write", "ConfigMap", &key)(error).into()),
    }
}

/// Retries after the backoff of the pool.
pub fn error_policy(pool: Arc<FloatingIPPool>, _: &Error, ctx: Arc<Context>) -> Action {
    Action::requeue(ctx.backoff.next(&ObjectRef::from_obj(&*pool).to_string()))
}
