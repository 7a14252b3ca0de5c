//! The subnet controller: validation, labels, the status view of the
//! address ledger, and deletion only once no record uses the subnet.
//!
//! The repair of `status.usedIP` starts from the ledger, never from the
//! cache alone (which lags behind releases). An address the ledger holds
//! and no record names is an allocation between its two writes (or a crash
//! there): it is kept for [`Settings::orphan_grace`](super::Settings) after
//! this controller first saw it, then freed, unless the records read from
//! the API server at that moment name it (the cache may lag). An address
//! a cached live record names and the ledger lacks is added only once the
//! record, read from the API server, confirms it. The same grace holds for the claims
//! of the fixed-MAC ledger of the subnet's parent link.
//!
//! The in-use finalizer is handled here, not by `kube::runtime::finalizer`:
//! that helper adds its finalizer in a write of its own (here it goes with
//! the labels and the canonical CIDR in one), and a cleanup can keep the
//! finalizer only by failing, so a deletion waiting for its records would
//! count as a reconcile failure and be retried on the error backoff instead
//! of standing as the `InUse` condition, re-checked every
//! `DELETION_RETRY`.

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use flatnet_k8s::{
    api::{
        CONDITION_READY, FlatNetworkIP, FlatNetworkSubnet, FlatNetworkSubnetStatus, phase,
        set_condition,
    },
    ipam::{Family, LiveAddresses, Mac, Pool, from_u128, to_u128, used_ranges},
    keys::{SUBNET_NAMESPACE, label},
    validation::{ParentLink, ValidSubnet, check_siblings, validate_subnet},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{
    Api, ResourceExt,
    api::{ListParams, Patch, PatchParams, PostParams},
    runtime::controller::Action,
};
use serde_json::json;
use tracing::{info, instrument, warn};

use crate::controller::condition;

use super::{
    Context, Error,
    commit::MAX_ATTEMPTS,
    errors::{is_conflict, is_not_found},
    key_of,
    mac_ledger::{self, LedgerClaim},
    wire_release::{self, WireWitness},
};

/// Name of this controller in logs and metrics.
pub const CONTROLLER: &str = "subnet";

/// Finalizer that keeps a subnet while records use it.
pub const FINALIZER: &str = "flatnetwork.pandaria.io/subnet-in-use";

/// Condition type: the spec is valid and fits its siblings.
pub const CONDITION_VALID: &str = "Valid";

/// Retry delay while a deletion waits for records to go.
const DELETION_RETRY: Duration = Duration::from_secs(30);

/// When the repair first saw each unclaimed ledger entry, per subnet.
#[derive(Default)]
pub struct OrphanClock {
    seen: Mutex<HashMap<String, HashMap<String, Instant>>>,
}

impl OrphanClock {
    /// For each of `keys` (the unclaimed entries of `subnet` now), whether
    /// it was first seen less than `grace` ago. Entries no longer listed are
    /// forgotten, so an entry that comes back starts a new grace period.
    pub fn young(&self, subnet: &str, keys: &[String], grace: Duration) -> Vec<bool> {
        self.ages(subnet, keys)
            .into_iter()
            .map(|age| age < grace)
            .collect()
    }

    /// For each of `keys` (the unclaimed entries of `subnet` now), how long
    /// ago it was first seen; as [`Self::young`], entries no longer listed
    /// are forgotten.
    pub fn ages(&self, subnet: &str, keys: &[String]) -> Vec<Duration> {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let entries = seen.entry(subnet.to_owned()).or_default();
        entries.retain(|k, _| keys.contains(k));
        let now = Instant::now();
        keys.iter()
            .map(|k| now.duration_since(*entries.entry(k.clone()).or_insert(now)))
            .collect()
    }

    /// Forgets the entries of `subnet` that `which` selects, so that they
    /// start a new grace when they are seen unclaimed again.
    fn forget(&self, subnet: &str, which: impl Fn(&str) -> bool) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entries) = seen.get_mut(subnet) {
            entries.retain(|k, _| !which(k));
        }
    }

    /// `macs` were just claimed for the pool in the MAC ledger `ledger`:
    /// each starts a new grace (it may have been freed and claimed again
    /// since the repair last saw it).
    pub fn pool_claimed(&self, ledger: &str, macs: &[Mac]) {
        let keys: BTreeSet<String> = macs.iter().map(|m| pool_key(*m)).collect();
        self.forget(ledger, |key| keys.contains(key));
    }

    /// `addrs` were just reserved in `subnet`'s ledger: an unclaimed
    /// interval holding one of them is a new allocation between its two
    /// writes, whose grace starts now, not when the interval was first seen
    /// (it may have been freed and taken again since).
    pub fn reserved(&self, subnet: &str, addrs: &[IpAddr]) {
        if !addrs.is_empty() {
            self.forget(subnet, |key| addrs.iter().any(|a| range_key_holds(key, *a)));
        }
    }
}

/// The clock's key of a pool MAC claimed without an owner.
fn pool_key(mac: Mac) -> String {
    format!("pool {mac}")
}

/// The clock's key of the unclaimed `usedIP` interval `start..=end`.
fn range_key(family: Family, start: u128, end: u128) -> String {
    format!("{}-{}", from_u128(family, start), from_u128(family, end))
}

/// Whether `key`, made by [`range_key`], is an interval holding `addr`.
fn range_key_holds(key: &str, addr: IpAddr) -> bool {
    let bounds = key.split_once('-').and_then(|(start, end)| {
        Some((start.parse::<IpAddr>().ok()?, end.parse::<IpAddr>().ok()?))
    });
    bounds.is_some_and(|(start, end)| {
        start.is_ipv4() == addr.is_ipv4()
            && (to_u128(start)..=to_u128(end)).contains(&to_u128(addr))
    })
}

/// A subnet problem: the condition reason and the message.
struct Invalid {
    reason: &'static str,
    message: String,
}

/// Validates the subnet, sets its labels, keeps its status and guards
/// its deletion.
///
/// # Errors
/// An API call failed.
#[instrument(skip_all, fields(subnet = %subnet.name_any()))]
pub async fn reconcile(subnet: Arc<FlatNetworkSubnet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let result = ensure(&subnet, &ctx).await;
    if result.is_ok() {
        ctx.backoff.reset(&backoff_key(&subnet));
    }
    result
}

/// The key of `subnet` in the shared backoff.
fn backoff_key(subnet: &FlatNetworkSubnet) -> String {
    format!("subnet/{}", subnet.name_any())
}

async fn ensure(subnet: &Arc<FlatNetworkSubnet>, ctx: &Arc<Context>) -> Result<Action, Error> {
    let (subnet, ctx) = (Arc::clone(subnet), Arc::clone(ctx));
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let name = subnet.name_any();
    let records = ctx.caches.records.state();
    let users: Vec<&FlatNetworkIP> = records
        .iter()
        .map(AsRef::as_ref)
        .filter(|r| r.spec.subnet == name)
        .collect();
    if subnet.metadata.deletion_timestamp.is_some() {
        return finalize(&subnet, &users, &ctx).await;
    }
    let verdict = check(&subnet, &ctx);
    if let Ok(valid) = &verdict
        && ensure_metadata(&subnet, valid, &ctx).await?
    {
        // The write brings the updated subnet back here.
        return Ok(Action::await_change());
    }
    let parent = verdict.as_ref().ok().map(|v| v.parent.clone());
    let action = update_status(&subnet, verdict, &users, &ctx).await?;
    if let Some(parent) = parent
        && repair_mac_ledger(&parent, &ctx).await?
    {
        return Ok(Action::requeue(
            (ctx.settings.orphan_grace / 4).min(ctx.settings.resync),
        ));
    }
    Ok(action)
}

/// Frees the claims of `parent`'s MAC ledger that no record has named for
/// the orphan grace (an allocation that crashed between its ledger and
/// record writes, a leader gone with pool MACs claimed ahead). Returns
/// whether younger unnamed claims were kept.
///
/// Any subnet of the parent link repairs the whole ledger; writes carry
/// the resourceVersion, so a claim made meanwhile is never lost.
async fn repair_mac_ledger(parent: &ParentLink, ctx: &Context) -> Result<bool, Error> {
    // Read once a claim is to be freed: see `stored_users`.
    let mut stored: Option<Vec<FlatNetworkIP>> = None;
    let ledger_name = mac_ledger::ledger_name(parent);
    for _ in 0..MAX_ATTEMPTS {
        let mut ledger = mac_ledger::read(&ctx.client, parent).await?;
        let cached = ctx.caches.records.state();
        let named = |mac: Mac, claim: &LedgerClaim| {
            let names = |r: &FlatNetworkIP| {
                key_of(r.namespace().as_deref(), &r.name_any()) == claim.record
                    && r.status.as_ref().and_then(|s| Mac::parse(&s.mac).ok()) == Some(mac)
            };
            cached.iter().any(|r| names(r)) || stored.iter().flatten().any(names)
        };
        let unnamed: Vec<(Mac, LedgerClaim)> = ledger
            .claims
            .iter()
            .flat_map(|(mac, claims)| claims.iter().map(|c| (*mac, c.clone())))
            .filter(|(mac, claim)| !named(*mac, claim))
            .collect();
        // A pool MAC claimed without an owner is held by any record naming it.
        let pool_named: BTreeSet<Mac> = cached
            .iter()
            .map(AsRef::as_ref)
            .chain(stored.iter().flatten())
            .filter_map(|r| Mac::parse(&r.status.as_ref()?.mac).ok())
            .collect();
        let unnamed_pool: Vec<Mac> = ledger
            .pool_claimed_macs()
            .filter(|mac| !pool_named.contains(mac))
            .collect();
        let keys: Vec<String> = unnamed
            .iter()
            .map(|(mac, c)| format!("{mac} {}#{}", c.record, c.token))
            .chain(unnamed_pool.iter().map(|mac| pool_key(*mac)))
            .collect();
        let young = ctx
            .orphans
            .young(&ledger_name, &keys, ctx.settings.orphan_grace);
        let kept = young.iter().any(|k| *k);
        if stored.is_none() && young.iter().any(|k| !k) {
            stored = Some(stored_records(ctx).await?);
            continue;
        }
        let (young_claims, young_pool) = young.split_at(unnamed.len());
        let mut freed = false;
        for ((mac, claim), keep) in unnamed.iter().zip(young_claims) {
            if !keep {
                freed |= ledger.remove(*mac, |c| c == claim);
            }
        }
        for (mac, keep) in unnamed_pool.iter().zip(young_pool) {
            if !keep {
                // A pod may have used it: quarantined.
                freed |= ledger.unclaim_from_pool(*mac, true);
            }
        }
        if !freed {
            return Ok(kept);
        }
        if mac_ledger::write(&ctx.client, &mut ledger).await? {
            info!(%parent, "freed MAC claims no record names");
            return Ok(kept);
        }
        ctx.metrics.allocation_conflict();
    }
    Err(Error::MacLedgerContention {
        parent: parent.to_string(),
        attempts: MAX_ATTEMPTS,
    })
}

/// Validation, sibling conflicts and the namespace rule.
fn check(subnet: &FlatNetworkSubnet, ctx: &Context) -> Result<ValidSubnet, Invalid> {
    let name = subnet.name_any();
    if subnet.namespace().as_deref() != Some(SUBNET_NAMESPACE) {
        return Err(Invalid {
            reason: "WrongNamespace",
            message: format!(
                "FlatNetworkSubnet {name} is in namespace {}: subnets are only served in {SUBNET_NAMESPACE}; create it there",
                subnet.namespace().unwrap_or_default()
            ),
        });
    }
    let valid = validate_subnet(&name, &subnet.spec).map_err(|e| Invalid {
        reason: "Invalid",
        message: e.to_string(),
    })?;
    let others = ctx.caches.subnets.state();
    let siblings: Vec<ValidSubnet> = others
        .iter()
        .filter(|s| s.name_any() != name && s.namespace().as_deref() == Some(SUBNET_NAMESPACE))
        .filter_map(|s| validate_subnet(&s.name_any(), &s.spec).ok())
        .collect();
    check_siblings(&valid, &siblings).map_err(|e| Invalid {
        reason: "Conflict",
        message: e.to_string(),
    })?;
    Ok(valid)
}

/// Sets the labels `master`, `vlan`, `mode`, `flatMode`, the canonical CIDR
/// and the finalizer. Returns whether it wrote.
async fn ensure_metadata(
    subnet: &FlatNetworkSubnet,
    valid: &ValidSubnet,
    ctx: &Context,
) -> Result<bool, Error> {
    let labels = [
        (label::SUBNET_MASTER, subnet.spec.master.clone()),
        (label::SUBNET_VLAN, subnet.spec.vlan.to_string()),
        (label::SUBNET_MODE, subnet.spec.mode.clone()),
        (label::SUBNET_FLAT_MODE, subnet.spec.flat_mode.clone()),
    ];
    let cidr = valid.cidr.to_string();
    let has = subnet.labels();
    let labels_ok = labels.iter().all(|(k, v)| has.get(*k) == Some(v));
    let finalizer_ok = subnet.finalizers().iter().any(|f| f == FINALIZER);
    if labels_ok && finalizer_ok && subnet.spec.cidr == cidr {
        return Ok(false);
    }
    let mut finalizers: Vec<String> = subnet.finalizers().to_vec();
    if !finalizer_ok {
        finalizers.push(FINALIZER.to_owned());
    }
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.into()))
        .collect();
    let patch = json!({
        "metadata": {
            "labels": labels,
            "finalizers": finalizers,
            "resourceVersion": subnet.resource_version(),
        },
        "spec": {"cidr": cidr},
    });
    let api: Api<FlatNetworkSubnet> = Api::namespaced(ctx.client.clone(), SUBNET_NAMESPACE);
    match api
        .patch(
            &subnet.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(error) if is_conflict(&error) || is_not_found(&error) => Ok(true),
        Err(error) => Err(Error::kube(
            "update",
            "FlatNetworkSubnet",
            &subnet.name_any(),
        )(error)),
    }
}

/// The status of a valid subnet: the ledger repaired from `users`, plus the
/// Active phase. Also returns duplicate claims and whether orphans are kept.
struct Repaired {
    status: FlatNetworkSubnetStatus,
    duplicates: Vec<String>,
    orphans_kept: bool,
    /// Whether unclaimed entries past the grace, or vouched for by the
    /// wire, were dropped.
    frees: bool,
    /// Whether some were dropped before the grace, on the wire's word.
    early_frees: bool,
}

/// What the repair frees on, beyond its caches.
struct Evidence<'a> {
    /// The records as the API server has them, read once a first pass on
    /// the cache frees something.
    stored: Option<&'a [FlatNetworkIP]>,
    /// What the nodes said about the subnet's addresses.
    witness: &'a WireWitness,
}

/// Every FlatNetworkIP of `subnet` as the API server has it now. The
/// repair frees nothing on the word of its cache alone, which lags behind
/// record writes (a cut watch, a slow relist): what these name stays.
async fn stored_users(ctx: &Context, subnet: &str) -> Result<Vec<FlatNetworkIP>, Error> {
    let mut records = stored_records(ctx).await?;
    records.retain(|r| r.spec.subnet == subnet);
    Ok(records)
}

/// Every FlatNetworkIP as the API server has it now.
async fn stored_records(ctx: &Context) -> Result<Vec<FlatNetworkIP>, Error> {
    Api::<FlatNetworkIP>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await
        .map(|list| list.items)
        .map_err(Error::kube("list", "FlatNetworkIP", "all namespaces"))
}

/// The address a record names, when it names one.
fn named_addr(record: &FlatNetworkIP) -> Option<IpAddr> {
    record.status.as_ref().and_then(|s| s.addr)
}

/// Addresses that live records of the cache name and the ledger lacks.
fn missing_from_ledger<'a>(
    valid: &ValidSubnet,
    current: &FlatNetworkSubnetStatus,
    users: &[&'a FlatNetworkIP],
) -> Vec<(&'a FlatNetworkIP, IpAddr)> {
    // Parsed once: a fragmented ledger has thousands of ranges, and a
    // subnet thousands of records.
    let (v4, v6) = used_ranges::to_intervals(&current.used_ranges());
    let in_ledger = |addr: IpAddr| match addr {
        IpAddr::V4(_) => v4.contains(to_u128(addr)),
        IpAddr::V6(_) => v6.contains(to_u128(addr)),
    };
    users
        .iter()
        .filter(|r| r.metadata.deletion_timestamp.is_none())
        .filter_map(|r| Some((*r, named_addr(r)?)))
        .filter(|(_, addr)| {
            valid.cidr.contains(*addr) && Some(*addr) != valid.gateway && !in_ledger(*addr)
        })
        .collect()
}

/// Of the `missing` addresses, those whose record, read from the API server
/// now, is live and still names them: a cache that lags behind a release
/// must not put the released address back.
async fn confirm_missing(
    missing: Vec<(&FlatNetworkIP, IpAddr)>,
    ctx: &Context,
) -> Result<Vec<IpAddr>, Error> {
    let mut confirmed = Vec::new();
    for (record, addr) in missing {
        let namespace = record.namespace().unwrap_or_default();
        let api: Api<FlatNetworkIP> = Api::namespaced(ctx.client.clone(), &namespace);
        let fresh = api.get_opt(&record.name_any()).await.map_err(Error::kube(
            "get",
            "FlatNetworkIP",
            &key_of(Some(&namespace), &record.name_any()),
        ))?;
        if fresh.is_some_and(|f| {
            f.metadata.deletion_timestamp.is_none()
                && f.spec.subnet == record.spec.subnet
                && named_addr(&f) == Some(addr)
        }) {
            confirmed.push(addr);
        }
    }
    Ok(confirmed)
}

/// The repaired ledger: the current one, less the entries no record has
/// named for the orphan grace, plus `confirmed` (addresses live records name
/// that it lacked). Addresses are never added on the word of the cache
/// alone: it may show a record that has already given its address back.
///
/// `stored`, the records as read from the API server, is given once a
/// first pass on the cache alone [`Repaired::frees`] something: what they
/// name is kept however long the cache has shown it unclaimed.
fn repaired_status(
    generation: Option<i64>,
    valid: &ValidSubnet,
    current: &FlatNetworkSubnetStatus,
    users: &[&FlatNetworkIP],
    confirmed: &[IpAddr],
    Evidence { stored, witness }: Evidence<'_>,
    ctx: &Context,
) -> Repaired {
    let mut duplicates = Vec::new();
    // Keys are formatted for duplicates only: a pass looks at every record.
    let key = |r: &FlatNetworkIP| key_of(r.namespace().as_deref(), &r.name_any());
    let mut claimed: HashMap<IpAddr, &FlatNetworkIP> = HashMap::with_capacity(users.len());
    for record in users
        .iter()
        .filter(|r| r.metadata.deletion_timestamp.is_none())
    {
        let Some(addr) = named_addr(record) else {
            continue;
        };
        if let Some(first) = claimed.get(&addr) {
            duplicates.push(format!(
                "{addr} is named by {} and {}",
                key(first),
                key(record)
            ));
        } else {
            claimed.insert(addr, record);
        }
    }

    // The ledger within the CIDR.
    let family = valid.cidr.family();
    let (v4, v6) = used_ranges::to_intervals(&current.used_ranges());
    let mut ledger = if family == Family::V4 { v4 } else { v6 };
    let (first, last) = (valid.cidr.first(), valid.cidr.last());
    if first > 0 {
        ledger.remove(0, first - 1);
    }
    if last < u128::MAX {
        ledger.remove(last + 1, u128::MAX);
    }
    // Entries no record names (a terminating record still names its own
    // until its release runs).
    let mut unclaimed = ledger.clone();
    for addr in users.iter().filter_map(|r| named_addr(r)) {
        let v = to_u128(addr);
        unclaimed.remove(v, v);
    }
    if let Some(gateway) = valid.gateway {
        let v = to_u128(gateway);
        unclaimed.remove(v, v);
    }
    let keys: Vec<String> = unclaimed
        .iter()
        .map(|r| range_key(family, *r.start(), *r.end()))
        .collect();
    let ages = ctx.orphans.ages(&valid.name, &keys);
    let now = Timestamp::now();
    let wanted = wire_release::reports_wanted(current, &ages, &ctx.settings, now);
    // Freed: past the orphan grace, or past the shorter wire grace with
    // every node vouching that it saw no claim (claimed addresses stay).
    let early: Vec<Option<LiveAddresses>> = ages
        .iter()
        .map(|age| wire_release::early_free(witness, *age, wanted.as_ref(), &ctx.settings, now))
        .collect();
    let young: Vec<bool> = ages
        .iter()
        .zip(&early)
        .map(|(age, early)| *age < ctx.settings.orphan_grace && early.is_none())
        .collect();
    let stored_addrs: Vec<u128> = stored
        .into_iter()
        .flatten()
        .filter_map(named_addr)
        .map(to_u128)
        .collect();
    let mut frees = false;
    // A freed entry that comes back is a new reservation: a new grace.
    ctx.orphans.forget(&valid.name, |key| {
        stored.is_some() && keys.iter().zip(&young).any(|(k, young)| k == key && !young)
    });
    for ((range, keep), early) in unclaimed.iter().zip(&young).zip(&early) {
        if !keep {
            frees = true;
            ledger.remove(*range.start(), *range.end());
            for v in stored_addrs.iter().filter(|v| range.contains(v)) {
                ledger.insert(*v, *v);
            }
            let claimed = early.iter().flat_map(LiveAddresses::addresses);
            for v in claimed.map(to_u128).filter(|v| range.contains(v)) {
                ledger.insert(v, v);
            }
        }
    }
    for addr in confirmed {
        let v = to_u128(*addr);
        ledger.insert(v, v);
    }
    let mut pool = Pool::new(valid);
    pool.reserve_ranges(&used_ranges::from_intervals(family, &ledger));

    // Fixed MACs: those records hold, plus young unclaimed ledger entries.
    let mut macs: BTreeSet<String> = users
        .iter()
        .filter_map(|r| r.fixed_mac().map(str::to_owned))
        .collect();
    let stored_macs: BTreeSet<&str> = stored
        .into_iter()
        .flatten()
        .filter_map(FlatNetworkIP::fixed_mac)
        .collect();
    let unclaimed_macs: Vec<String> = current
        .used_mac
        .iter()
        .filter(|m| !macs.contains(*m))
        .map(|m| format!("mac {m}"))
        .collect();
    let young_macs = ctx.orphans.young(
        &format!("{}/mac", valid.name),
        &unclaimed_macs,
        ctx.settings.orphan_grace,
    );
    for (mac, keep) in unclaimed_macs.iter().zip(&young_macs) {
        let mac = mac.trim_start_matches("mac ");
        if *keep || stored_macs.contains(mac) {
            macs.insert(mac.to_owned());
        } else {
            frees = true;
        }
    }
    ctx.orphans.forget(&format!("{}/mac", valid.name), |key| {
        stored.is_some()
            && unclaimed_macs
                .iter()
                .zip(&young_macs)
                .any(|(k, young)| k == key && !young)
    });

    let mut status = FlatNetworkSubnetStatus {
        phase: phase::ACTIVE.into(),
        failure_message: String::new(),
        gateway: valid.gateway,
        reserved_ip: current.reserved_ip.clone(),
        used_mac: macs.into_iter().collect(),
        conditions: current.conditions.clone(),
        ..FlatNetworkSubnetStatus::default()
    };
    set_condition(
        &mut status.conditions,
        condition(CONDITION_VALID, true, "Valid", String::new(), generation),
    );
    set_usage(&mut status, &pool, generation);
    status.wire_excluded_count =
        super::wire_exclusion::excluded_count(&ctx.wire, &valid.name, &pool);
    status.wire_reports_wanted = wanted;
    Repaired {
        status,
        duplicates,
        orphans_kept: young.iter().chain(&young_macs).any(|k| *k),
        frees,
        early_frees: ages
            .iter()
            .zip(&early)
            .any(|(age, early)| early.is_some() && *age < ctx.settings.orphan_grace),
    }
}

/// The Ready condition of an address ledger (a subnet's or a floating
/// pool's): Active, or Exhausted when nothing is free, with the free count.
pub(crate) fn usage_condition(
    free: i64,
    total: i64,
    generation: Option<i64>,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    condition(
        CONDITION_READY,
        true,
        if free > 0 { "Active" } else { "Exhausted" },
        format!("{free} of {total} addresses free"),
        generation,
    )
}

/// Writes the address view of `pool` into `status`: `usedIP`, the counts
/// and the Ready condition (Active or Exhausted, with the free count). Every
/// writer of the ledger uses it, so the subnet controller finds nothing to
/// rewrite after an allocation.
pub(crate) fn set_usage(
    status: &mut FlatNetworkSubnetStatus,
    pool: &Pool,
    generation: Option<i64>,
) {
    let usage = pool.usage();
    let free = usage
        .total_ip_count
        .saturating_sub(pool.used().try_into().unwrap_or(i64::MAX));
    set_condition(
        &mut status.conditions,
        usage_condition(free, usage.total_ip_count, generation),
    );
    status.set_used_ranges(usage.used_ip);
    status.used_ip_count = usage.used_ip_count;
    status.total_ip_count = usage.total_ip_count;
}

fn failed_status(
    current: &FlatNetworkSubnetStatus,
    invalid: &Invalid,
    generation: Option<i64>,
) -> FlatNetworkSubnetStatus {
    let mut status = current.clone();
    status.phase = phase::FAILED.into();
    status.failure_message = invalid.message.clone();
    set_condition(
        &mut status.conditions,
        condition(
            CONDITION_VALID,
            false,
            invalid.reason,
            invalid.message.clone(),
            generation,
        ),
    );
    set_condition(
        &mut status.conditions,
        condition(
            CONDITION_READY,
            false,
            invalid.reason,
            invalid.message.clone(),
            generation,
        ),
    );
    status
}

/// Whether two statuses differ in more than condition timestamps.
fn same_status(a: &FlatNetworkSubnetStatus, b: &FlatNetworkSubnetStatus) -> bool {
    let strip = |s: &FlatNetworkSubnetStatus| {
        let mut s = s.clone();
        for c in &mut s.conditions {
            c.last_transition_time = Time(Timestamp::UNIX_EPOCH);
        }
        s
    };
    strip(a) == strip(b)
}

async fn update_status(
    subnet: &FlatNetworkSubnet,
    verdict: Result<ValidSubnet, Invalid>,
    users: &[&FlatNetworkIP],
    ctx: &Context,
) -> Result<Action, Error> {
    match write_status(subnet, &verdict, users, ctx, Lock::NotHeld).await? {
        Written::Done(action) => Ok(action),
        Written::NeedsLock => {
            let locked = write_status(subnet, &verdict, users, ctx, Lock::Held);
            match ctx
                .ledgers
                .exclusive(ctx, &subnet.name_any(), locked)
                .await?
            {
                Written::Done(action) => Ok(action),
                Written::NeedsLock => unreachable!("the lock is held"),
            }
        }
    }
}

/// Whether [`write_status`] runs under [`Ledgers::exclusive`](super::group_commit::Ledgers::exclusive).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lock {
    Held,
    NotHeld,
}

/// What [`write_status`] came to.
enum Written {
    Done(Action),
    /// Addresses must be confirmed and added back: only under the lock.
    NeedsLock,
}

/// Writes the repaired or failed status. Adding back an address a live
/// record names needs `lock` held: a release of that record running
/// between the confirmation and the write would find the address absent,
/// do nothing, and the write would put back an address nobody holds.
async fn write_status(
    subnet: &FlatNetworkSubnet,
    verdict: &Result<ValidSubnet, Invalid>,
    users: &[&FlatNetworkIP],
    ctx: &Context,
    lock: Lock,
) -> Result<Written, Error> {
    let name = subnet.name_any();
    let api: Api<FlatNetworkSubnet> =
        Api::namespaced(ctx.client.clone(), &subnet.namespace().unwrap_or_default());
    // The ledger must be read fresh: allocations write it all the time.
    for _ in 0..MAX_ATTEMPTS {
        let Some(mut fresh) =
            api.get_opt(&name)
                .await
                .map_err(Error::kube("get", "FlatNetworkSubnet", &name))?
        else {
            return Ok(Written::Done(Action::await_change()));
        };
        let current = fresh.status.clone().unwrap_or_default();
        let (status, action, duplicates) = match verdict {
            Ok(valid) => {
                let missing = missing_from_ledger(valid, &current, users);
                let confirmed = if missing.is_empty() {
                    Vec::new()
                } else if lock == Lock::NotHeld {
                    return Ok(Written::NeedsLock);
                } else {
                    confirm_missing(missing, ctx).await?
                };
                let repair = |stored, witness| {
                    repaired_status(
                        subnet.metadata.generation,
                        valid,
                        &current,
                        users,
                        &confirmed,
                        Evidence { stored, witness },
                        ctx,
                    )
                };
                let cached = WireWitness::cached(ctx, &name);
                let mut repaired = repair(None, &cached);
                if repaired.frees {
                    let stored = stored_users(ctx, &name).await?;
                    // Freeing early on the wire's word: on what the API
                    // server holds now, never on lagging caches alone.
                    let witness = if repaired.early_frees {
                        WireWitness::fresh(ctx, &name).await?
                    } else {
                        WireWitness::none()
                    };
                    repaired = repair(Some(&stored), &witness);
                }
                ctx.metrics.set_subnet_usage(
                    &name,
                    repaired.status.total_ip_count,
                    repaired.status.used_ip_count,
                );
                let action = if repaired.orphans_kept {
                    let grace = ctx
                        .settings
                        .orphan_grace
                        .min(ctx.settings.wire_orphan_grace);
                    Action::requeue((grace / 4).min(ctx.settings.resync))
                } else {
                    Action::requeue(ctx.settings.resync)
                };
                (repaired.status, action, repaired.duplicates)
            }
            Err(invalid) => (
                failed_status(&current, invalid, subnet.metadata.generation),
                Action::requeue(ctx.settings.resync),
                Vec::new(),
            ),
        };
        if same_status(&current, &status) {
            return Ok(Written::Done(action));
        }
        let newly_failed = status.phase == phase::FAILED
            && (current.phase != phase::FAILED
                || current.failure_message != status.failure_message);
        fresh.status = Some(status.clone());
        match api
            .replace_status(&name, &PostParams::default(), &fresh)
            .await
        {
            Ok(_) => {
                if newly_failed {
                    ctx.events
                        .warn(
                            subnet,
                            "InvalidSubnet",
                            "Validate",
                            status.failure_message.clone(),
                        )
                        .await;
                }
                for duplicate in &duplicates {
                    ctx.events
                        .warn(
                            subnet,
                            "DuplicateAddress",
                            "Repair",
                            format!("{duplicate}: delete one of the pods so it gets a new address"),
                        )
                        .await;
                }
                info!(phase = %status.phase, used = status.used_ip_count, "subnet status updated");
                return Ok(Written::Done(action));
            }
            Err(error) if is_conflict(&error) => ctx.metrics.allocation_conflict(),
            Err(error) if is_not_found(&error) => return Ok(Written::Done(Action::await_change())),
            Err(error) => {
                return Err(Error::kube("update status of", "FlatNetworkSubnet", &name)(
                    error,
                ));
            }
        }
    }
    Err(Error::Contention {
        subnet: name,
        attempts: MAX_ATTEMPTS,
    })
}

/// Deleting a subnet waits until no record uses it.
async fn finalize(
    subnet: &FlatNetworkSubnet,
    users: &[&FlatNetworkIP],
    ctx: &Context,
) -> Result<Action, Error> {
    if !subnet.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let name = subnet.name_any();
    let api: Api<FlatNetworkSubnet> = Api::namespaced(ctx.client.clone(), SUBNET_NAMESPACE);
    if !users.is_empty() {
        let examples: Vec<String> = users
            .iter()
            .take(5)
            .map(|r| key_of(r.namespace().as_deref(), &r.name_any()))
            .collect();
        let message = format!(
            "deletion waits for {} FlatNetworkIP(s) using this subnet (e.g. {}): delete those pods (and StatefulSets keeping addresses) first",
            users.len(),
            examples.join(", ")
        );
        let mut updated = subnet.clone();
        let status = updated.status.get_or_insert_with(Default::default);
        let changed = set_condition(
            &mut status.conditions,
            condition(
                CONDITION_READY,
                false,
                "InUse",
                message.clone(),
                subnet.metadata.generation,
            ),
        );
        if changed {
            match api
                .replace_status(&name, &PostParams::default(), &updated)
                .await
            {
                Ok(_) => {
                    ctx.events
                        .warn(subnet, "DeletionBlocked", "Delete", message)
                        .await;
                }
                Err(error) if is_conflict(&error) || is_not_found(&error) => {}
                Err(error) => {
                    return Err(Error::kube("update status of", "FlatNetworkSubnet", &name)(
                        error,
                    ));
                }
            }
        }
        return Ok(Action::requeue(DELETION_RETRY));
    }
    let remaining: Vec<&String> = subnet
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .collect();
    let patch = json!({"metadata": {"finalizers": remaining, "resourceVersion": subnet.resource_version()}});
    match api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            ctx.metrics.forget_subnet(&name);
            Ok(Action::await_change())
        }
        Err(error) if is_conflict(&error) || is_not_found(&error) => Ok(Action::await_change()),
        Err(error) => Err(Error::kube(
            "remove finalizer of",
            "FlatNetworkSubnet",
            &name,
        )(error)),
    }
}

/// Logs the failure, counts it, and retries with backoff.
pub fn error_policy(subnet: Arc<FlatNetworkSubnet>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(subnet = %subnet.name_any(), %error, "subnet reconcile failed");
    ctx.metrics
        .reconcile_failed(CONTROLLER, error.metric_label());
    Action::requeue(ctx.backoff.next(&backoff_key(&subnet)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An interval of `usedIP` first seen unclaimed long ago and then
    /// taken by a new reservation (freed and taken again between two
    /// repairs) is young again: its record write may still land.
    #[test]
    fn a_reservation_restarts_the_grace_of_the_interval_holding_it() {
        let clock = OrphanClock::default();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let key = |a: &str, b: &str| range_key(Family::V4, to_u128(ip(a)), to_u128(ip(b)));
        let keys = [key("10.0.0.4", "10.0.0.6"), key("10.0.0.9", "10.0.0.9")];
        let grace = Duration::from_millis(50);
        assert_eq!(clock.young("net", &keys, grace), [true, true]);
        std::thread::sleep(grace);
        assert_eq!(clock.young("net", &keys, grace), [false, false]);
        clock.reserved("other", &[ip("10.0.0.5")]);
        clock.reserved("net", &[ip("10.0.0.8"), ip("fd00::5")]);
        assert_eq!(clock.young("net", &keys, grace), [false, false]);
        clock.reserved("net", &[ip("10.0.0.5")]);
        assert_eq!(clock.young("net", &keys, grace), [true, false]);
    }
}
