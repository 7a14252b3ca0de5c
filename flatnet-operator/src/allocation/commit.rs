//! Committing an allocation so that no address is ever given twice.
//!
//! The subnet's `status.usedIP` is the ledger every allocator must update,
//! and every update is a replace of the status subresource carrying the
//! `resourceVersion` that was read. The API server accepts exactly one of
//! two concurrent replaces; the other gets 409 Conflict and starts over from
//! a fresh read. So:
//!
//! 1. [`reserve_batched`]: a record holding no address and asking for no
//!    fixed MAC queues its reservation for the subnet's next group commit
//!    ([`group_commit`](super::group_commit)), which writes the ledger once
//!    for every reservation and release waiting, with the resourceVersion
//!    of the ledger kept in memory.
//!
//!    [`reserve`]: for a pod asking for fixed MACs, first claim one in
//!    the MAC ledger of the subnet's parent link ([`mac_ledger`]), with the
//!    same resourceVersion rule. Then read the subnet from the API server
//!    (never the cache), build the pool from its `usedIP` plus every record
//!    of the cache, choose an address, and replace the subnet status with
//!    exactly that address (and the claimed MAC) added. On 409, repeat from
//!    the read. If the subnet step fails, the MAC claim is withdrawn.
//! 2. [`write_record`]: write the record's status (`addr`, `mac`,
//!    `Pending`), again with its `resourceVersion`, within
//!    [`Settings::write_deadline`](super::Settings) of the reservation.
//! 3. Only then is an address the record held before released
//!    ([`release`]), so a crash never frees an address still in use.
//!
//! A crash between 1 and 2 leaves an address in `usedIP` that no record
//! names. The subnet repair frees it after
//! [`Settings::orphan_grace`](super::Settings), which is far longer than the
//! write deadline plus a request's lifetime, so it never frees a reservation
//! whose record write may still land.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    time::{Duration, Instant},
};

use flatnet_k8s::{
    api::{
        CONDITION_READY, FlatNetworkIP, FlatNetworkIPStatus, FlatNetworkSubnet, phase,
        set_condition,
    },
    ipam::{
        LiveAddresses, Mac, Pool, PoolError, Reservations, choose_mac, macs_in_use, used_ranges,
    },
    keys::SUBNET_NAMESPACE,
    validation::{ValidSubnet, validate_subnet},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{Api, ResourceExt, api::PostParams};
use tracing::debug;

use crate::controller::condition;

use super::{
    Context, Error,
    errors::{is_conflict, is_not_found},
    group_commit::Committed,
    key_of,
    mac_ledger::{self, LedgerClaim},
};
use flatnet_k8s::validation::ParentLink;
use tracing::warn;

/// Attempts at one subnet write before giving up for a backoff.
pub(crate) const MAX_ATTEMPTS: u32 = 16;

/// Reason of the record's Ready condition while waiting for the node.
pub const REASON_ALLOCATED: &str = "Allocated";

/// An address (and MAC) held for a record in the subnet's `usedIP`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// The subnet.
    pub subnet: String,
    /// The address.
    pub addr: IpAddr,
    /// The fixed MAC, when the pod asks for one, or its MAC from the pool.
    pub mac: Option<Mac>,
    /// Whether `mac` came from the MAC pool.
    pub mac_from_pool: bool,
    /// Whether this call added the address to `usedIP` (false: the record
    /// already held it).
    pub newly_reserved: bool,
    /// Whether this call added the MAC to the subnet's `usedMac`.
    pub mac_newly_listed: bool,
    /// The address the record held before, to release once the record
    /// names the new one.
    pub replaces: Option<IpAddr>,
    /// The parent link of the subnet (whose MAC ledger holds the MAC).
    pub parent: ParentLink,
    /// The MAC ledger claim this call made (to withdraw if the record is
    /// not written); `None` when the record already held its claim.
    pub mac_claim: Option<LedgerClaim>,
    /// The fixed MAC the record held before, to release once the record
    /// names the new one.
    pub replaces_mac: Option<Mac>,
    /// When the subnet write succeeded (or the pool MAC was claimed, when
    /// that was earlier): the record must be written within the write
    /// deadline of it.
    pub at: Instant,
    /// When `mac` was claimed for the pool without an owner by this
    /// allocation ([`mac_ahead`](super::mac_ahead)); `None` otherwise.
    pub mac_claimed_at: Option<Instant>,
}

/// How a record compares to what the cache says other records hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The record keeps its address.
    Keep(IpAddr),
    /// The record gets a new address.
    New(IpAddr),
}

/// Chooses the address of `record` from `pool`, which holds every address
/// in use except the record's own.
///
/// The record keeps its address when it still satisfies the spec (the
/// StatefulSet rule of `reuse_recorded`) and no older record claims it too.
///
/// # Errors
/// The pool's: nothing left, requested addresses taken or not allocatable.
pub fn choose(
    record: &FlatNetworkIP,
    pool: &mut Pool,
    claimed_by_older: impl Fn(IpAddr) -> bool,
) -> Result<Choice, PoolError> {
    choose_avoiding(record, pool, claimed_by_older, &LiveAddresses::default())
}

/// [`choose`], never handing out an address `live` on the wire (a record
/// keeps its own address whatever the wire says: a foreign claim on it is
/// a conflict, reported by its node).
///
/// # Errors
/// As [`choose`], and [`PoolError::LiveOnWire`].
pub fn choose_avoiding(
    record: &FlatNetworkIP,
    pool: &mut Pool,
    claimed_by_older: impl Fn(IpAddr) -> bool,
    live: &LiveAddresses,
) -> Result<Choice, PoolError> {
    use flatnet_k8s::ipam::{Recorded, Request, Reuse, reuse_recorded};
    let current = record.status.as_ref().and_then(|s| s.addr);
    let reuse = reuse_recorded(
        Recorded {
            subnet: &record.spec.subnet,
            addr: current,
        },
        Request {
            subnet: &record.spec.subnet,
            candidates: &record.spec.addrs,
        },
        pool,
    );
    if let Reuse::Keep(addr) = reuse
        && !claimed_by_older(addr)
    {
        // Held in usedIP by this record, or (after a repair) by nobody.
        let _ = pool.mark_used(addr);
        return Ok(Choice::Keep(addr));
    }
    let addr = live.allocate(pool, &record.spec.addrs)?;
    Ok(Choice::New(addr))
}

/// The sort key deciding which of two records claiming one address keeps
/// it: the older record, then the lower `namespace/name`.
fn age_key(record: &FlatNetworkIP) -> (Option<Timestamp>, String) {
    (
        record.metadata.creation_timestamp.as_ref().map(|t| t.0),
        key_of(record.namespace().as_deref(), &record.name_any()),
    )
}

/// A MAC claimed in the ledger for one allocation.
struct MacClaim {
    mac: Mac,
    from_pool: bool,
    /// The claim written by this allocation, `None` when reused.
    made: Option<LedgerClaim>,
}

/// Reserves an address (and fixed MAC) for `record`: the MAC in its parent
/// link's ledger, then the address in its subnet's `usedIP`. When the
/// address cannot be reserved, a MAC claim made here is withdrawn.
///
/// # Errors
/// Subnet missing or not ready, nothing allocatable, MACs taken, the API
/// failing, or a contention error after [`MAX_ATTEMPTS`] conflicts.
pub async fn reserve(
    ctx: &Context,
    record: &FlatNetworkIP,
    workload: Option<&str>,
) -> Result<Reservation, Error> {
    let mut claimed: Option<(ParentLink, MacClaim)> = None;
    let result = reserve_address(ctx, record, workload, &mut claimed).await;
    if result.is_err()
        && let Some((
            parent,
            MacClaim {
                mac,
                made: Some(claim),
                ..
            },
        )) = claimed
        && let Err(error) = withdraw(ctx, &parent, mac, |c| *c == claim).await
    {
        // The subnet repair frees it after the orphan grace.
        warn!(%error, %mac, "could not withdraw a MAC claim");
    }
    result
}

/// Reserves an address for a record that holds none and asks for no fixed
/// MAC, batched with the other edits waiting for its subnet
/// ([`group_commit`](super::group_commit)). The ledger alone decides what
/// is free: no read of the subnet, no scan of the records.
///
/// # Errors
/// As [`reserve`].
pub async fn reserve_batched(
    ctx: &Context,
    record: &FlatNetworkIP,
    workload: Option<&str>,
) -> Result<Reservation, Error> {
    let subnet = record.spec.subnet.clone();
    let key = key_of(record.namespace().as_deref(), &record.name_any());
    let mac_pool = ctx.mac_pool.range_for(record, &ctx.caches.namespaces);
    match ctx
        .ledgers
        .reserve(ctx, &subnet, &key, &record.spec.addrs, workload, mac_pool)
        .await?
    {
        Committed::Reserved {
            addr,
            subnet: valid,
            at,
            mac,
        } => Ok(Reservation {
            subnet,
            addr,
            mac: mac.map(|(mac, _)| mac),
            mac_from_pool: mac.is_some(),
            newly_reserved: true,
            mac_newly_listed: false,
            replaces: None,
            parent: valid.parent.clone(),
            mac_claim: None,
            replaces_mac: None,
            at: mac.map_or(at, |(_, claimed)| claimed.min(at)),
            mac_claimed_at: mac.map(|(_, claimed)| claimed),
        }),
        // A reservation is always answered with an address.
        Committed::Released => Err(Error::Contention {
            subnet,
            attempts: MAX_ATTEMPTS,
        }),
    }
}

/// Whether `record` takes the batched path: it holds no address (so no
/// older record can claim the one it has) and asks for no fixed MAC (a
/// MAC from the pool is claimed in the batch).
pub fn batchable(record: &FlatNetworkIP) -> bool {
    record.status.as_ref().and_then(|s| s.addr).is_none() && record.spec.macs.is_empty()
}

async fn reserve_address(
    ctx: &Context,
    record: &FlatNetworkIP,
    workload: Option<&str>,
    claimed: &mut Option<(ParentLink, MacClaim)>,
) -> Result<Reservation, Error> {
    // A workload's reserved addresses are its pods' only when they ask for them.
    let requester = workload.filter(|_| !record.spec.addrs.is_empty());
    let name = record.spec.subnet.clone();
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(ctx.client.clone(), SUBNET_NAMESPACE);
    let me = (record.namespace(), record.name_any());
    let my_age = age_key(record);
    for attempt in 1..=MAX_ATTEMPTS {
        let subnet = subnets
            .get_opt(&name)
            .await
            .map_err(Error::kube("get", "FlatNetworkSubnet", &name))?
            .ok_or_else(|| Error::SubnetMissing {
                subnet: name.clone(),
            })?;
        let valid = ready_subnet(&subnet)?;
        let status = subnet.status.clone().unwrap_or_default();

        // The pool: the ledger plus what the cache says records hold, and
        // what `reservedIP` keeps from this record's pod (other workloads'
        // fixed addresses, V1 pods' during a migration).
        let mut pool = Pool::new(&valid);
        pool.reserve_ranges(&status.used_ranges());
        let reservations = Reservations::of(&status);
        let kept_out: Vec<IpAddr> = reservations
            .free_in(&pool)
            .filter(|ip| reservations.held_against(*ip, requester).is_some())
            .collect();
        for held in kept_out {
            let _ = pool.mark_used(held);
        }
        let records = ctx.caches.records.state();
        let others: Vec<&FlatNetworkIP> = records
            .iter()
            .map(AsRef::as_ref)
            .filter(|r| (r.namespace(), r.name_any()) != me)
            .collect();
        let same_subnet: Vec<&FlatNetworkIP> = others
            .iter()
            .copied()
            .filter(|r| r.spec.subnet == name)
            .collect();
        for addr in same_subnet.iter().filter_map(|r| r.status.as_ref()?.addr) {
            // Already marked from usedIP, or outside the CIDR: both fine.
            let _ = pool.mark_used(addr);
        }
        let claimed_by_older = |addr: IpAddr| {
            same_subnet.iter().any(|r| {
                r.status.as_ref().and_then(|s| s.addr) == Some(addr) && age_key(r) < my_age
            })
        };
        let live = ctx.wire.avoided(&name);
        let choice = choose_avoiding(record, &mut pool, claimed_by_older, &live)
            .map_err(|error| reservations.explain(error, requester))?;
        // The MAC is claimed once; address conflicts below do not move it.
        if claimed.is_none()
            && let Some(claim) = claim_mac(ctx, record, &valid.parent, &subnet, &others).await?
        {
            *claimed = Some((valid.parent.clone(), claim));
        }
        let mac = claimed.as_ref().map(|(_, c)| c.mac);
        let mac_from_pool = claimed.as_ref().is_some_and(|(_, c)| c.from_pool);

        let addr = match choice {
            Choice::Keep(addr) | Choice::New(addr) => addr,
        };
        let newly_reserved = !used_ranges::contains(&status.used_ranges(), addr);
        // `usedMac` lists fixed MACs; pool MACs are in the MAC ledger only.
        let mac_text = mac.filter(|_| !mac_from_pool).map(|m| m.to_string());
        let mac_new = mac_text
            .as_ref()
            .is_some_and(|m| !status.used_mac.contains(m));
        let own_addr = record.status.as_ref().and_then(|s| s.addr);
        let replaces = match choice {
            Choice::New(_) => own_addr.filter(|old| *old != addr),
            Choice::Keep(_) => None,
        };
        let replaces_mac = record
            .status
            .as_ref()
            .and_then(|s| Mac::parse(&s.mac).ok())
            .filter(|old| Some(*old) != mac);
        let reservation = |newly_reserved, mac_newly_listed| Reservation {
            subnet: name.clone(),
            addr,
            mac,
            mac_from_pool,
            newly_reserved,
            mac_newly_listed,
            replaces,
            parent: valid.parent.clone(),
            mac_claim: claimed.as_ref().and_then(|(_, c)| c.made.clone()),
            replaces_mac,
            at: Instant::now(),
            mac_claimed_at: None,
        };
        if !newly_reserved && !mac_new {
            return Ok(reservation(false, false));
        }

        // The ledger plus this address only: what the cache says other
        // records hold steers the choice but is never written, since a
        // stale cache still shows addresses already released.
        let mut ledger = Pool::new(&valid);
        ledger.reserve_ranges(&status.used_ranges());
        let _ = ledger.mark_used(addr);
        let mut updated = subnet.clone();
        let new_status = updated.status.get_or_insert_with(Default::default);
        super::subnets::set_usage(new_status, &ledger, subnet.metadata.generation);
        if let Some(mac) = mac_text {
            let mut macs: BTreeSet<String> = new_status.used_mac.drain(..).collect();
            macs.insert(mac);
            new_status.used_mac = macs.into_iter().collect();
        }
        match subnets
            .replace_status(&name, &PostParams::default(), &updated)
            .await
        {
            Ok(_) => {
                if newly_reserved {
                    ctx.orphans.reserved(&name, &[addr]);
                }
                return Ok(reservation(newly_reserved, mac_new));
            }
            Err(error) if is_conflict(&error) => {
                ctx.metrics.allocation_conflict();
                debug!(subnet = %name, attempt, "subnet changed since read; choosing again");
            }
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

/// The subnet, validated, when it may allocate.
pub(crate) fn ready_subnet(subnet: &FlatNetworkSubnet) -> Result<ValidSubnet, Error> {
    let name = subnet.name_any();
    let status = subnet.status.clone().unwrap_or_default();
    if status.phase != phase::ACTIVE {
        let reason = if status.failure_message.is_empty() {
            "not validated yet".to_owned()
        } else {
            status.failure_message
        };
        return Err(Error::SubnetNotReady {
            subnet: name,
            reason,
        });
    }
    if subnet.metadata.deletion_timestamp.is_some() {
        return Err(Error::SubnetNotReady {
            subnet: name,
            reason: "it is being deleted".into(),
        });
    }
    validate_subnet(&name, &subnet.spec).map_err(|e| Error::SubnetNotReady {
        subnet: name,
        reason: e.to_string(),
    })
}

/// Claims the record's MAC in the ledger of `parent`: the MAC it holds
/// when still requested (or from the pool) and not claimed by another pod,
/// else the first requested MAC no other pod holds, or for a record the
/// MAC pool serves, the pool's next free MAC (skipping MACs hosts outside
/// flatnet use on the wire). `None` when the pod takes no MAC from either.
async fn claim_mac(
    ctx: &Context,
    record: &FlatNetworkIP,
    parent: &ParentLink,
    fresh: &FlatNetworkSubnet,
    others: &[&FlatNetworkIP],
) -> Result<Option<MacClaim>, Error> {
    let candidates: Vec<Mac> = record
        .spec
        .macs
        .iter()
        .filter_map(|m| Mac::parse(m).ok())
        .collect();
    let pool = if candidates.is_empty() {
        let Some(range) = ctx.mac_pool.range_for(record, &ctx.caches.namespaces) else {
            return Ok(None);
        };
        Some(range)
    } else {
        None
    };
    let me = key_of(record.namespace().as_deref(), &record.name_any());
    let current = record.status.as_ref().and_then(|s| Mac::parse(&s.mac).ok());
    // A pool record keeps only a MAC the pool gave it, never the kernel's.
    let current = current
        .filter(|_| pool.is_none() || record.status.as_ref().is_some_and(|s| s.mac_from_pool));
    let foreign = match pool {
        Some(_) => ctx.wire.foreign_macs(),
        None => BTreeSet::new(),
    };
    let unledgered = unledgered_macs(ctx, &me, parent, fresh, others);
    for attempt in 1..=MAX_ATTEMPTS {
        let mut ledger = mac_ledger::read(&ctx.client, parent).await?;
        let mut taken = ledger.taken_from(&me);
        // Pool MACs claimed without an owner are their records': taken,
        // except the pool MAC this record holds.
        let own_pool_mac = current.filter(|m| pool.is_some() && ledger.pool_holds(*m));
        taken.extend(
            ledger
                .pool_claimed_macs()
                .filter(|m| Some(*m) != own_pool_mac),
        );
        let mut in_use = taken.clone();
        in_use.extend(
            unledgered
                .iter()
                .filter(|m| !(ledger.claims.contains_key(m) && ledger.only_pod_of(**m, &me))),
        );
        let keep = current.filter(|m| !taken.contains(m));
        let mac = match (pool, keep) {
            (None, _) => match choose_mac(parent, &candidates, keep, &in_use)? {
                Some(mac) => mac,
                None => return Ok(None),
            },
            (Some(_), Some(kept)) => kept,
            (Some(range), None) => ledger.pool.allocate(range, &in_use, &foreign)?,
        };
        let from_pool = pool.is_some();
        if current == Some(mac)
            && (!ledger.claims_of(mac, &me).is_empty() || own_pool_mac == Some(mac))
        {
            return Ok(Some(MacClaim {
                mac,
                from_pool,
                made: None,
            }));
        }
        let claim = LedgerClaim::new(&me);
        ledger.add(mac, claim.clone());
        if mac_ledger::write(&ctx.client, &mut ledger).await? {
            return Ok(Some(MacClaim {
                mac,
                from_pool,
                made: Some(claim),
            }));
        }
        ctx.metrics.allocation_conflict();
        debug!(%parent, attempt, "MAC ledger changed since read; choosing again");
    }
    Err(Error::MacLedgerContention {
        parent: parent.to_string(),
        attempts: MAX_ATTEMPTS,
    })
}

/// Fixed MACs in use on `parent` that the ledger may not know: `usedMac`
/// of the sibling subnets and the MACs of other pods' cached records, as
/// left by versions without the ledger. Conservative: they are only
/// avoided, never claimed for anyone.
fn unledgered_macs(
    ctx: &Context,
    me: &str,
    parent: &ParentLink,
    fresh: &FlatNetworkSubnet,
    others: &[&FlatNetworkIP],
) -> BTreeSet<Mac> {
    let cached = ctx.caches.subnets.state();
    let siblings: Vec<&FlatNetworkSubnet> = cached
        .iter()
        .map(AsRef::as_ref)
        .filter(|s| s.name_any() != fresh.name_any())
        .chain(std::iter::once(fresh))
        .collect();
    let sibling_names: BTreeSet<String> = siblings
        .iter()
        .filter(|s| s.spec.master == parent.master && s.spec.vlan == i64::from(parent.vlan))
        .map(|s| s.name_any())
        .collect();
    let my_pod = mac_ledger::pod_of(me);
    let mine: BTreeSet<Mac> = others
        .iter()
        .filter(|r| mac_ledger::pod_of(&key_of(r.namespace().as_deref(), &r.name_any())) == my_pod)
        .filter_map(|r| Mac::parse(&r.status.as_ref()?.mac).ok())
        .collect();
    let mut in_use = macs_in_use(parent, siblings.iter().copied());
    in_use.retain(|m| !mine.contains(m));
    in_use.extend(
        others
            .iter()
            .filter(|r| sibling_names.contains(&r.spec.subnet))
            .filter(|r| {
                mac_ledger::pod_of(&key_of(r.namespace().as_deref(), &r.name_any())) != my_pod
            })
            .filter_map(|r| Mac::parse(&r.status.as_ref()?.mac).ok()),
    );
    in_use
}

/// Removes the claims on `mac` that `which` selects from `parent`'s
/// ledger.
///
/// # Errors
/// The API failing, or [`Error::MacLedgerContention`].
pub async fn withdraw(
    ctx: &Context,
    parent: &ParentLink,
    mac: Mac,
    which: impl Fn(&LedgerClaim) -> bool,
) -> Result<(), Error> {
    let change = |ledger: &mut mac_ledger::Ledger| ledger.remove(mac, &which);
    super::mac_ahead::edit(ctx, parent, &mut None, change).await
}

/// What became of the record write.
#[derive(Debug)]
pub enum Written {
    /// The record now names the reserved address.
    Done(Box<FlatNetworkIP>),
    /// The record is gone or another allocator wrote it first; the
    /// reservation was handed back.
    Superseded,
}

/// The status of a record that was just given `reservation`.
fn allocated_status(record: &FlatNetworkIP, reservation: &Reservation) -> FlatNetworkIPStatus {
    let old = record.status.as_ref();
    let now = Time(Timestamp::now());
    let mut status = FlatNetworkIPStatus {
        phase: phase::PENDING.into(),
        failure_message: String::new(),
        allocated_time_stamp: Some(now.clone()),
        addr: Some(reservation.addr),
        mac: reservation.mac.map(|m| m.to_string()).unwrap_or_default(),
        mac_from_pool: reservation.mac_from_pool,
        node: old.map(|s| s.node.clone()).unwrap_or_default(),
        // The node reports it once it has set the interface up.
        mtu: None,
        conditions: old.map(|s| s.conditions.clone()).unwrap_or_default(),
    };
    set_condition(
        &mut status.conditions,
        condition(
            CONDITION_READY,
            false,
            REASON_ALLOCATED,
            format!(
                "{} allocated from {}; waiting for the node to set up the pod",
                reservation.addr, reservation.subnet
            ),
            record.metadata.generation,
        ),
    );
    status
}

/// Writes `reservation` into the record's status, then releases what the
/// record held before.
///
/// # Errors
/// The API failing, or [`Error::ReservationExpired`] when the deadline
/// passed before the write could be sent.
pub async fn write_record(
    ctx: &Context,
    record: &FlatNetworkIP,
    reservation: &Reservation,
) -> Result<Written, Error> {
    let namespace = record.namespace().unwrap_or_default();
    let name = record.name_any();
    let key = key_of(Some(&namespace), &name);
    let records: Api<FlatNetworkIP> = Api::namespaced(ctx.client.clone(), &namespace);
    let deadline = ctx.settings.write_deadline;
    let mut current = record.clone();
    for _ in 0..MAX_ATTEMPTS {
        if reservation.at.elapsed() >= deadline {
            return Err(Error::ReservationExpired {
                record: key,
                deadline,
            });
        }
        let mut updated = current.clone();
        updated.status = Some(allocated_status(&current, reservation));
        match records
            .replace_status(&name, &PostParams::default(), &updated)
            .await
        {
            Ok(written) => return written_record(ctx, reservation, &key, written).await,
            Err(error) if is_conflict(&error) => {
                let fresh = records.get_opt(&name).await.map_err(Error::kube(
                    "get",
                    "FlatNetworkIP",
                    &key,
                ))?;
                // This very write may have landed: the client sends a write
                // answered 504 again, and the repeat meets 409. A record
                // that names the new address holds it and its MAC, so
                // nothing of them is handed back.
                let landed = |f: &FlatNetworkIP| {
                    names_reservation(f, reservation) && !names_reservation(record, reservation)
                };
                if let Some(landed) = fresh.as_ref().filter(|f| landed(f)) {
                    return written_record(ctx, reservation, &key, landed.clone()).await;
                }
                let still_ours = fresh.as_ref().is_some_and(|f| {
                    f.spec == record.spec
                        && f.metadata.deletion_timestamp.is_none()
                        && f.status.as_ref().and_then(|s| s.addr)
                            == record.status.as_ref().and_then(|s| s.addr)
                });
                match fresh {
                    Some(fresh) if still_ours => current = fresh,
                    _ => {
                        hand_back(ctx, reservation, &key).await?;
                        return Ok(Written::Superseded);
                    }
                }
            }
            Err(error) if is_not_found(&error) => {
                hand_back(ctx, reservation, &key).await?;
                return Ok(Written::Superseded);
            }
            Err(error) => {
                return Err(Error::kube("update status of", "FlatNetworkIP", &key)(
                    error,
                ));
            }
        }
    }
    Err(Error::Contention {
        subnet: reservation.subnet.clone(),
        attempts: MAX_ATTEMPTS,
    })
}

/// Whether `record` names the address of `reservation` (an address is
/// reserved for one record at a time; the MAC beside it may be what the
/// node reported since, such as a kernel-chosen one).
fn names_reservation(record: &FlatNetworkIP, reservation: &Reservation) -> bool {
    record.spec.subnet == reservation.subnet
        && record.status.as_ref().and_then(|s| s.addr) == Some(reservation.addr)
}

/// The record names `reservation` (`written`): releases what it held
/// before.
async fn written_record(
    ctx: &Context,
    reservation: &Reservation,
    key: &str,
    written: FlatNetworkIP,
) -> Result<Written, Error> {
    let old_addrs: Vec<IpAddr> = reservation.replaces.into_iter().collect();
    let old_macs: Vec<String> = reservation
        .replaces_mac
        .iter()
        .map(ToString::to_string)
        .collect();
    if !old_addrs.is_empty() || !old_macs.is_empty() {
        // The pod before may have used the old address.
        ctx.wire.released(&reservation.subnet, &old_addrs);
        release(ctx, &reservation.subnet, &old_addrs, &old_macs, key).await?;
    }
    if let Some(old) = reservation.replaces_mac {
        let ahead = &ctx.mac_pool.ahead;
        ahead.release(ctx, &reservation.parent, old, key).await?;
    }
    Ok(Written::Done(Box::new(written)))
}

/// Returns a reservation nobody will write, while it is young enough that
/// the repair cannot have freed it.
async fn hand_back(ctx: &Context, reservation: &Reservation, key: &str) -> Result<(), Error> {
    // Only this allocation's own claim: safe at any age.
    if let (Some(claim), Some(mac)) = (&reservation.mac_claim, reservation.mac) {
        withdraw(ctx, &reservation.parent, mac, |c| c == claim).await?;
    }
    // A pool MAC claimed for it stays claimed, spare, while young enough.
    if let (Some(claimed), Some(mac)) = (reservation.mac_claimed_at, reservation.mac) {
        let ahead = &ctx.mac_pool.ahead;
        ahead.put_back(&reservation.parent, vec![(mac, claimed)]);
    }
    let fresh = reservation.newly_reserved || reservation.mac_newly_listed;
    if !fresh || reservation.at.elapsed() >= ctx.settings.write_deadline {
        return Ok(());
    }
    let addrs: Vec<IpAddr> = Some(reservation.addr)
        .filter(|_| reservation.newly_reserved)
        .into_iter()
        .collect();
    let macs: Vec<String> = reservation
        .mac
        .filter(|_| reservation.mac_newly_listed)
        .iter()
        .map(ToString::to_string)
        .collect();
    release(ctx, &reservation.subnet, &addrs, &macs, key).await
}

/// Removes `addrs` and `macs` from the subnet's `usedIP`/`usedMac`, except
/// those another record (not `holder`) still names in the cache.
///
/// # Errors
/// The API failing, or [`Error::Contention`].
pub async fn release(
    ctx: &Context,
    subnet: &str,
    addrs: &[IpAddr],
    macs: &[String],
    holder: &str,
) -> Result<(), Error> {
    let records = ctx.caches.records.state();
    let held_elsewhere = |r: &FlatNetworkIP| {
        key_of(r.namespace().as_deref(), &r.name_any()) != holder
            && r.metadata.deletion_timestamp.is_none()
    };
    let addrs: Vec<IpAddr> = addrs
        .iter()
        .copied()
        .filter(|a| {
            // The cheap tests first: `held_elsewhere` formats a key.
            !records.iter().any(|r| {
                r.status.as_ref().and_then(|s| s.addr) == Some(*a)
                    && r.spec.subnet == subnet
                    && held_elsewhere(r)
            })
        })
        .collect();
    let macs: Vec<&String> = macs
        .iter()
        .filter(|m| {
            !records
                .iter()
                .any(|r| r.status.as_ref().is_some_and(|s| &s.mac == *m) && held_elsewhere(r))
        })
        .collect();
    if addrs.is_empty() && macs.is_empty() {
        return Ok(());
    }
    if macs.is_empty() {
        // Batched with the subnet's other ledger edits; a subnet that cannot
        // allocate (being deleted, invalid) is edited directly below.
        match ctx.ledgers.release(ctx, subnet, addrs.clone()).await {
            Err(Error::SubnetNotReady { .. }) => {}
            other => return other.map(|_| ()),
        }
    }
    // Like a batch, never between the subnet repair's confirmation of an
    // address and its write.
    let direct = release_direct(ctx, subnet, &addrs, &macs);
    ctx.ledgers.exclusive(ctx, subnet, direct).await
}

/// Removes `addrs` and `macs` from the subnet's ledger with a read and a
/// write of its own.
async fn release_direct(
    ctx: &Context,
    subnet: &str,
    addrs: &[IpAddr],
    macs: &[&String],
) -> Result<(), Error> {
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(ctx.client.clone(), SUBNET_NAMESPACE);
    for _ in 0..MAX_ATTEMPTS {
        let Some(mut fresh) = subnets.get_opt(subnet).await.map_err(Error::kube(
            "get",
            "FlatNetworkSubnet",
            subnet,
        ))?
        else {
            return Ok(());
        };
        let status = fresh.status.get_or_insert_with(Default::default);
        let (mut v4, mut v6) = used_ranges::to_intervals(&status.used_ranges());
        let mut changed = false;
        for addr in addrs {
            let value = flatnet_k8s::ipam::to_u128(*addr);
            let set = if addr.is_ipv4() { &mut v4 } else { &mut v6 };
            changed |= set.remove(value, value) > 0;
        }
        let before = status.used_mac.len();
        status.used_mac.retain(|m| !macs.contains(&m));
        changed |= status.used_mac.len() != before;
        if !changed {
            return Ok(());
        }
        let mut used = used_ranges::from_intervals(flatnet_k8s::ipam::Family::V4, &v4);
        used.extend(used_ranges::from_intervals(
            flatnet_k8s::ipam::Family::V6,
            &v6,
        ));
        status.used_ip_count = i64::try_from(v4.len() + v6.len()).unwrap_or(i64::MAX);
        status.set_used_ranges(used);
        match subnets
            .replace_status(subnet, &PostParams::default(), &fresh)
            .await
        {
            Ok(_) => return Ok(()),
            Err(error) if is_conflict(&error) => ctx.metrics.allocation_conflict(),
            Err(error) if is_not_found(&error) => return Ok(()),
            Err(error) => {
                return Err(Error::kube("update status of", "FlatNetworkSubnet", subnet)(error));
            }
        }
    }
    Err(Error::Contention {
        subnet: subnet.to_owned(),
        attempts: MAX_ATTEMPTS,
    })
}

/// Releases what `record` held: `addrs` and `macs` in its subnet's ledger
/// (unless another record holds them), and its claims on `macs` in the MAC
/// ledger.
///
/// # Errors
/// The API failing, or [`Error::Contention`].
pub async fn release_holdings(
    ctx: &Context,
    record: &FlatNetworkIP,
    addrs: &[IpAddr],
    macs: &[String],
) -> Result<(), Error> {
    let key = key_of(record.namespace().as_deref(), &record.name_any());
    // Quarantined before it leaves the ledger: see `wire_exclusion`.
    ctx.wire.released(&record.spec.subnet, addrs);
    // `usedMac` lists only fixed MACs (older versions listed pool MACs
    // too, which the subnet repair drops).
    let fixed: Vec<String> = macs
        .iter()
        .filter(|m| record.spec.macs.contains(m))
        .cloned()
        .collect();
    release(ctx, &record.spec.subnet, addrs, &fixed, &key).await?;
    if macs.is_empty() {
        return Ok(());
    }
    let subnet_ref =
        kube::runtime::reflector::ObjectRef::new(&record.spec.subnet).within(SUBNET_NAMESPACE);
    let Some(subnet) = ctx.caches.subnets.get(&subnet_ref) else {
        // Unknown parent link: the repair frees the claim after the grace.
        return Ok(());
    };
    let parent = ParentLink {
        master: subnet.spec.master.clone(),
        vlan: u16::try_from(subnet.spec.vlan).unwrap_or_default(),
    };
    for mac in macs.iter().filter_map(|m| Mac::parse(m).ok()) {
        ctx.mac_pool.ahead.release(ctx, &parent, mac, &key).await?;
    }
    Ok(())
}

/// Retry delay used by callers after [`Error::Contention`].
pub const CONTENTION_RETRY: Duration = Duration::from_millis(200);

#[cfg(test)]
mod tests {
    use super::*;
    use flatnet_k8s::api::{FlatNetworkIPSpec, FlatNetworkSubnetSpec};

    /// Only an `Active` subnet that is not being deleted is allocated from;
    /// the refusal says why, with the subnet's own failure message.
    #[test]
    fn only_an_active_subnet_not_being_deleted_is_allocated_from() {
        let reason = |subnet: &FlatNetworkSubnet| match ready_subnet(subnet) {
            Err(Error::SubnetNotReady { reason, .. }) => Some(reason),
            Err(other) => panic!("{other}"),
            Ok(_) => None,
        };
        let mut subnet = crate::allocation::fake_cluster::subnet(
            "net",
            "10.0.0.0/24",
            None,
            &[("10.0.0.10", "10.0.0.20")],
        );
        assert_eq!(reason(&subnet).as_deref(), Some("not validated yet"));
        subnet.status = Some(flatnet_k8s::api::FlatNetworkSubnetStatus {
            phase: phase::FAILED.into(),
            failure_message: "cidr overlaps subnet other".into(),
            ..Default::default()
        });
        assert_eq!(
            reason(&subnet).as_deref(),
            Some("cidr overlaps subnet other")
        );
        subnet.status.as_mut().unwrap().phase = phase::ACTIVE.into();
        assert_eq!(reason(&subnet), None);
        subnet.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert_eq!(reason(&subnet).as_deref(), Some("it is being deleted"));
    }

    fn pool() -> Pool {
        let valid = validate_subnet(
            "net",
            &FlatNetworkSubnetSpec {
                flat_mode: "macvlan".into(),
                master: "eth0".into(),
                cidr: "10.0.0.0/29".into(),
                gateway: Some("10.0.0.1".parse().unwrap()),
                ..FlatNetworkSubnetSpec::default()
            },
        )
        .unwrap();
        Pool::new(&valid)
    }

    fn record(addrs: &[&str], current: Option<&str>) -> FlatNetworkIP {
        let mut record = FlatNetworkIP::new(
            "web-0",
            FlatNetworkIPSpec {
                subnet: "net".into(),
                addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
                ..FlatNetworkIPSpec::default()
            },
        );
        record.status = Some(FlatNetworkIPStatus {
            addr: current.map(|a| a.parse().unwrap()),
            ..FlatNetworkIPStatus::default()
        });
        record
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn keeps_a_satisfying_address_unless_an_older_record_claims_it() {
        let mut p = pool();
        assert_eq!(
            choose(&record(&[], Some("10.0.0.5")), &mut p, |_| false),
            Ok(Choice::Keep(ip("10.0.0.5")))
        );
        let mut p = pool();
        p.mark_used(ip("10.0.0.5")).unwrap();
        assert_eq!(
            choose(&record(&[], Some("10.0.0.5")), &mut p, |a| a
                == ip("10.0.0.5")),
            Ok(Choice::New(ip("10.0.0.2")))
        );
    }

    #[test]
    fn moves_when_the_request_no_longer_includes_the_address() {
        let mut p = pool();
        assert_eq!(
            choose(&record(&["10.0.0.6"], Some("10.0.0.5")), &mut p, |_| false),
            Ok(Choice::New(ip("10.0.0.6")))
        );
    }

    #[test]
    fn requested_addresses_take_the_first_free_candidate() {
        let mut p = pool();
        p.mark_used(ip("10.0.0.3")).unwrap();
        assert_eq!(
            choose(&record(&["10.0.0.3", "10.0.0.4"], None), &mut p, |_| false),
            Ok(Choice::New(ip("10.0.0.4")))
        );
        p.mark_used(ip("10.0.0.4")).ok();
        assert!(matches!(
            choose(&record(&["10.0.0.3", "10.0.0.4"], None), &mut p, |_| false),
            Err(PoolError::CandidatesTaken { .. })
        ));
    }

    #[test]
    fn exhaustion_is_reported() {
        let mut p = pool();
        for _ in 0..5 {
            choose(&record(&[], None), &mut p, |_| false).unwrap();
        }
        assert!(matches!(
            choose(&record(&[], None), &mut p, |_| false),
            Err(PoolError::Exhausted { .. })
        ));
    }
}
