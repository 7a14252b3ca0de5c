//! Freeing a leaked address sooner on the wire's word.
//!
//! An address the subnet's ledger holds and no record names (a release
//! that never happened: a crash between a record's finalizer removal and
//! its ledger write, a record whose finalizer was stripped by hand, or an
//! allocation between its two writes) is freed by the subnet repair after
//! the orphan grace. It is freed after the shorter
//! [`Settings::wire_orphan_grace`](super::Settings) instead when the wire
//! vouches that nobody uses it:
//!
//! 1. once the entry has been unclaimed for the write deadline, the repair
//!    sets the subnet's `status.wireReportsWanted` to now (unless it is
//!    already at or after the time the entry was first seen unclaimed),
//!    which asks every node agent to publish its report of the subnet
//!    again, observed after that time;
//! 2. every Node has such a report, and
//! 3. no report lists a claim on the address seen within the wire window.
//!
//! Nodes and reports are read from the API server at that moment (caches
//! may lag: a node that joined, a claim just published). A node that cannot
//! report keeps the rule from holding: the entry waits for the orphan
//! grace. An address of the entry that is claimed stays until the orphan
//! grace, and is then live, reused last, while the claim is in the window.

use std::time::Duration;

use flatnet_k8s::{
    api::{FlatNetworkSubnetStatus, FlatNetworkWireClaims},
    ipam::{LiveAddresses, every_node_reported},
    keys::SUBNET_NAMESPACE,
};
use k8s_openapi::{
    api::core::v1::Node,
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::{SignedDuration, Timestamp},
};
use kube::{Api, ResourceExt, api::ListParams};

use super::{Context, Error, Settings};

/// Default of [`Settings::wire_orphan_grace`](super::Settings): the write
/// deadline (30 s), plus the API server's default request timeout (60 s)
/// within which a record write sent before the deadline lands or fails,
/// with as much again to spare.
pub const DEFAULT_WIRE_ORPHAN_GRACE: Duration = Duration::from_secs(180);

/// What the nodes said about one subnet, as the repair weighs it.
pub struct WireWitness {
    reports: Vec<FlatNetworkWireClaims>,
    /// Every node; `None` when not known (the node cache not synced).
    nodes: Option<Vec<String>>,
    window: Duration,
}

impl WireWitness {
    /// A witness that vouches for nothing.
    pub fn none() -> Self {
        Self {
            reports: Vec::new(),
            nodes: None,
            window: Duration::ZERO,
        }
    }

    /// The reports and nodes of the caches: enough to decide whether to
    /// look closer, never to free.
    pub fn cached(ctx: &Context, subnet: &str) -> Self {
        let synced = crate::cache::listed(&ctx.caches.nodes);
        Self {
            reports: ctx
                .wire
                .reports(subnet)
                .iter()
                .map(|r| (**r).clone())
                .collect(),
            nodes: synced.then(|| {
                ctx.caches
                    .nodes
                    .state()
                    .iter()
                    .map(|n| n.name_any())
                    .collect()
            }),
            window: ctx.wire.window(),
        }
    }

    /// The reports of `subnet` and the nodes as the API server has them now.
    ///
    /// # Errors
    /// A list failed.
    pub async fn fresh(ctx: &Context, subnet: &str) -> Result<Self, Error> {
        let mut reports =
            Api::<FlatNetworkWireClaims>::namespaced(ctx.client.clone(), SUBNET_NAMESPACE)
                .list(&ListParams::default())
                .await
                .map_err(Error::kube(
                    "list",
                    "FlatNetworkWireClaims",
                    SUBNET_NAMESPACE,
                ))?
                .items;
        reports.retain(|r| r.spec.subnet == subnet);
        let nodes = Api::<Node>::all(ctx.client.clone())
            .list_metadata(&ListParams::default())
            .await
            .map_err(Error::kube("list", "Node", "all"))?
            .items
            .iter()
            .map(ResourceExt::name_any)
            .collect();
        Ok(Self {
            reports,
            nodes: Some(nodes),
            window: ctx.wire.window(),
        })
    }
}

/// `status.wireReportsWanted` of a subnet whose unclaimed ledger entries
/// were first seen `ages` ago: the time every node is asked to report
/// after. Unchanged while it is after the first sight of every entry
/// waiting for the wire (unclaimed for the write deadline, not yet for the
/// orphan grace), so one leak costs one subnet write and one report per
/// node; cleared once nothing is unclaimed.
pub fn reports_wanted(
    current: &FlatNetworkSubnetStatus,
    ages: &[Duration],
    settings: &Settings,
    now: Timestamp,
) -> Option<Time> {
    if ages.is_empty() || settings.wire_window.is_zero() {
        return None;
    }
    let youngest_waiting = ages
        .iter()
        .filter(|age| **age >= settings.write_deadline && **age < settings.orphan_grace)
        .min();
    let Some(age) = youngest_waiting else {
        return current.wire_reports_wanted.clone();
    };
    let first_seen = seen_at(now, *age);
    match &current.wire_reports_wanted {
        Some(wanted) if wanted.0.as_second() >= first_seen.as_second() => Some(wanted.clone()),
        // Whole seconds: what the API keeps of a time.
        _ => Timestamp::from_second(now.as_second()).ok().map(Time),
    }
}

/// When an entry first seen `age` before `now` was first seen.
fn seen_at(now: Timestamp, age: Duration) -> Timestamp {
    now.checked_sub(SignedDuration::try_from(age).unwrap_or(SignedDuration::MAX))
        .unwrap_or(Timestamp::MIN)
}

/// Whether an unclaimed entry first seen `age` ago may be freed before the
/// orphan grace: `Some` with the claims that keep some of its addresses
/// (every node reported after `wanted`, itself after the entry was first
/// seen, and the entry is past the wire grace), `None` when the wire cannot
/// vouch for it.
pub fn early_free(
    witness: &WireWitness,
    age: Duration,
    wanted: Option<&Time>,
    settings: &Settings,
    now: Timestamp,
) -> Option<LiveAddresses> {
    if age < settings.wire_orphan_grace || age >= settings.orphan_grace || witness.window.is_zero()
    {
        return None;
    }
    let wanted = wanted?;
    if wanted.0.as_second() < seen_at(now, age).as_second() {
        return None;
    }
    every_node_reported(&witness.reports, witness.nodes.as_deref()?, wanted.0).ok()?;
    Some(LiveAddresses::from_reports(
        &witness.reports,
        now,
        witness.window,
    ))
}
