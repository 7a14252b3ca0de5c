//! A FloatingIPPool's ledger: `status.usedIP`, replaced with the
//! resourceVersion it was read at, so of two allocators that read the same
//! ledger exactly one writes and the other reads again and chooses again
//! (the protocol of subnets' `usedIP`, `docs/ipam.md`). Addresses come from
//! the IPAM [`Pool`] of each of the pool's networks.

use std::{collections::BTreeMap, net::IpAddr};

use flatnet_k8s::{
    api::{FloatingIPPool, FloatingIPPoolStatus, set_condition},
    floating::{ValidPool, validate_pool},
    ipam::{Family, Pool, PoolError},
};
use kube::{Api, api::PostParams};
use tracing::debug;

use super::{Context, Error};
use crate::{
    allocation::{commit::MAX_ATTEMPTS, subnets::usage_condition},
    controller::{ApiError, is_conflict, is_not_found},
};

/// The IPAM pools of `valid`'s networks with the ledger's addresses taken.
pub fn pools_of(valid: &ValidPool, status: &FloatingIPPoolStatus) -> Vec<Pool> {
    valid
        .networks
        .iter()
        .map(|network| {
            let mut pool = Pool::new(network);
            pool.reserve_ranges(&status.used_ip);
            pool
        })
        .collect()
}

/// Writes the usage of `pools` (ledger, counts, Ready) into `status`.
pub fn set_usage(status: &mut FloatingIPPoolStatus, pools: &[Pool], generation: Option<i64>) {
    let (mut used, mut total, mut used_ip) = (0i64, 0i64, Vec::new());
    for usage in pools.iter().map(Pool::usage) {
        used = used.saturating_add(usage.used_ip_count);
        total = total.saturating_add(usage.total_ip_count);
        used_ip.extend(usage.used_ip);
    }
    let free = total.saturating_sub(used);
    status.used_ip = used_ip;
    status.used_ip_count = used;
    status.total_ip_count = total;
    status.observed_generation = generation;
    set_condition(
        &mut status.conditions,
        usage_condition(free, total, generation),
    );
}

/// Reserves an address of `family` in pool `name`: `fixed` when given, else
/// the first free one. `held` are the addresses Services hold per the cache
/// (never handed out even when the ledger lost them).
///
/// # Errors
/// The pool missing or invalid, nothing free, the fixed address taken, the
/// API failing, or [`Error::Contention`].
pub async fn reserve(
    ctx: &Context,
    name: &str,
    family: Family,
    fixed: Option<IpAddr>,
    held: &[IpAddr],
) -> Result<IpAddr, Error> {
    let api: Api<FloatingIPPool> = Api::all(ctx.client.clone());
    for attempt in 1..=MAX_ATTEMPTS {
        let mut pool = api
            .get(name)
            .await
            .map_err(ApiError::of("get", "FloatingIPPool", name))?;
        let valid = validate_pool(name, &pool.spec)?;
        let status = pool.status.clone().unwrap_or_default();
        let mut pools = pools_of(&valid, &status);
        let Some(index) = valid
            .networks
            .iter()
            .position(|n| n.cidr.family() == family)
        else {
            return Err(Error::Pool {
                pool: name.to_owned(),
                source: PoolError::Exhausted {
                    subnet: format!("{name} (it has no {family} network)"),
                },
            });
        };
        let mut choice = pools[index].clone();
        for addr in held {
            // Already in the ledger, or of the other family: both fine.
            let _ = choice.mark_used(*addr);
        }
        let addr = match fixed {
            Some(addr) => choice.allocate_requested(&[addr]),
            None => choice.allocate_auto(),
        }
        .map_err(|source| Error::Pool {
            pool: name.to_owned(),
            source,
        })?;
        // The ledger plus this address only: what the cache says steers the
        // choice but is never written (it may show released addresses).
        let _ = pools[index].mark_used(addr);
        let generation = pool.metadata.generation;
        set_usage(
            pool.status.get_or_insert_with(Default::default),
            &pools,
            generation,
        );
        match api
            .replace_status(name, &PostParams::default(), &pool)
            .await
        {
            Ok(_) => return Ok(addr),
            Err(error) if is_conflict(&error) => {
                ctx.metrics.allocation_conflict();
                debug!(
                    pool = name,
                    attempt, "pool changed since read; choosing again"
                );
            }
            Err(error) => {
                return Err(ApiError::of("update status of", "FloatingIPPool", name)(error).into());
            }
        }
    }
    Err(Error::Contention {
        pool: name.to_owned(),
        attempts: MAX_ATTEMPTS,
    })
}

/// Removes `addrs` from pool `name`'s ledger (a pool gone or invalid has
/// nothing to release).
///
/// # Errors
/// The API failing, or [`Error::Contention`].
pub async fn release(ctx: &Context, name: &str, addrs: &[IpAddr]) -> Result<(), Error> {
    if addrs.is_empty() {
        return Ok(());
    }
    let api: Api<FloatingIPPool> = Api::all(ctx.client.clone());
    for _ in 0..MAX_ATTEMPTS {
        let Some(mut pool) =
            api.get_opt(name)
                .await
                .map_err(ApiError::of("get", "FloatingIPPool", name))?
        else {
            return Ok(());
        };
        let Ok(valid) = validate_pool(name, &pool.spec) else {
            return Ok(());
        };
        let status = pool.status.clone().unwrap_or_default();
        let mut pools = pools_of(&valid, &status);
        let mut changed = false;
        for addr in addrs {
            changed |= pools.iter_mut().any(|p| p.release(*addr));
        }
        if !changed {
            return Ok(());
        }
        let generation = pool.metadata.generation;
        set_usage(
            pool.status.get_or_insert_with(Default::default),
            &pools,
            generation,
        );
        match api
            .replace_status(name, &PostParams::default(), &pool)
            .await
        {
            Ok(_) => return Ok(()),
            Err(error) if is_conflict(&error) => ctx.metrics.allocation_conflict(),
            Err(error) if is_not_found(&error) => return Ok(()),
            Err(error) => {
                return Err(ApiError::of("update status of", "FloatingIPPool", name)(error).into());
            }
        }
    }
    Err(Error::Contention {
        pool: name.to_owned(),
        attempts: MAX_ATTEMPTS,
    })
}

/// Releases `addrs`, each from the pool holding it.
///
/// # Errors
/// The API failing, or [`Error::Contention`].
pub async fn release_each(
    ctx: &Context,
    pools: &[ValidPool],
    addrs: &[IpAddr],
) -> Result<(), Error> {
    let mut by_pool: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for addr in addrs {
        if let Some(pool) = super::quotas::pool_of(pools, *addr) {
            by_pool.entry(pool).or_default().push(*addr);
        }
    }
    for (pool, addrs) in by_pool {
        release(ctx, &pool, &addrs).await?;
    }
    Ok(())
}

/// Runs `write`, which names the addresses just reserved in `fresh` on
/// their holder: `Ok(true)` when it wrote them, `Ok(false)` when the holder
/// changed or went meanwhile. Unless written, the addresses are handed
/// back. Returns what `write` did.
pub async fn write_or_hand_back(
    ctx: &Context,
    fresh: &BTreeMap<String, Vec<IpAddr>>,
    write: impl Future<Output = Result<bool, Error>>,
) -> Result<bool, Error> {
    let written = write.await;
    if !matches!(written, Ok(true)) {
        hand_back(ctx, fresh).await;
    }
    written
}

/// Returns newly reserved addresses (per pool) nobody will name; what
/// cannot be returned now the pool repair frees after the orphan grace.
pub async fn hand_back(ctx: &Context, fresh: &BTreeMap<String, Vec<IpAddr>>) {
    for (pool, addrs) in fresh {
        if let Err(error) = release(ctx, pool, addrs).await {
            tracing::warn!(%error, pool, "could not hand back reserved addresses");
        }
    }
}
