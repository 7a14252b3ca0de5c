//! The FlatNetworkIP controller: allocation, release, garbage collection
//! and the setup timeout of each record.
//!
//! The release finalizer is handled here, not by `kube::runtime::finalizer`:
//! that helper runs the cleanup first and removes its one finalizer after,
//! while a record must lose its finalizer first (a write carrying the
//! resourceVersion of the copy at hand) and release its address only once
//! that write succeeded, so a stale copy never releases an address the
//! ledger has handed on. It also removes the original operator's finalizer
//! in the same write, and a record gets its finalizer at creation, in the
//! pod controller's one write, not through a separate patch.

use std::{sync::Arc, time::Instant};

use flatnet_k8s::{
    api::{CONDITION_READY, FlatNetworkIP, phase, set_condition},
    ipam::{Mac, Pool},
    keys::SUBNET_NAMESPACE,
    validation::validate_subnet,
};
use k8s_openapi::jiff::Timestamp;
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    runtime::{controller::Action, reflector::ObjectRef},
};
use serde_json::json;
use tracing::{info, instrument, warn};

use crate::controller::condition;

use super::{
    CachedPod, Context, Error,
    commit::{self, Written},
    errors::{CONFLICT_RETRY, is_conflict, is_not_found},
    key_of,
    nodes::{self, NodeVerdict},
    records::{FINALIZER, LEGACY_FINALIZER},
};

/// Metric label of records deleted because their pod was gone.
const COLLECTED_POD_GONE: &str = "pod_gone";

/// Name of this controller in logs and metrics.
pub const CONTROLLER: &str = "flatnetworkip";

/// Ready condition reason of a record whose pod was never set up in time.
pub const REASON_SETUP_TIMEOUT: &str = "SetupTimeout";

/// Records younger than this are never collected: the pod cache may not
/// have seen their pod yet.
const GC_MIN_AGE: std::time::Duration = std::time::Duration::from_secs(60);

/// Brings one record in line: releases it when deleted, collects it when
/// its pod is gone, releases its address when the pod's node is gone,
/// allocates when it has no (satisfying) address, fails it when the node
/// never sets the pod up.
///
/// # Errors
/// An API call failed, or the allocation failed (the record's status and
/// an Event on the pod say why).
#[instrument(skip_all, fields(record = %record.name_any(), namespace = record.namespace().unwrap_or_default()))]
pub async fn reconcile(record: Arc<FlatNetworkIP>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    if record.metadata.deletion_timestamp.is_some() {
        return finalize(&record, &ctx).await;
    }
    let namespace = record.namespace().unwrap_or_default();
    let pod_ref = ObjectRef::<CachedPod>::new(&record.pod_name()).within(&namespace);
    let Some(pod) = ctx.caches.pods.get(&pod_ref) else {
        return collect(&record, &ctx).await;
    };
    let same_pod = pod.uid().as_deref() == Some(record.spec.pod_id.as_str());
    if same_pod && !nodes::kept_by_statefulset(&record, &ctx) {
        match nodes::judge(&pod, &ctx) {
            NodeVerdict::Fine => {}
            NodeVerdict::Wait(left) => return Ok(Action::requeue(left)),
            NodeVerdict::Gone(node) => {
                return nodes::release_in_place(&record, &pod, &node, &ctx).await;
            }
        }
    }
    if !same_pod || pod.metadata.deletion_timestamp.is_some() {
        // A new pod of this name: the pod controller rewrites the spec first.
        return Ok(Action::await_change());
    }
    let status = record.status.clone().unwrap_or_default();
    let timed_out = status
        .conditions
        .iter()
        .any(|c| c.type_ == CONDITION_READY && c.reason == REASON_SETUP_TIMEOUT);
    match status.phase.as_str() {
        // A record a new pod of the same name took over (a StatefulSet pod)
        // is Pending with what the pod before held: allocate again when
        // that is not what this pod asks for.
        phase::PENDING
            if status.addr.is_some() && satisfied(&record, &ctx) && mac_satisfied(&record) =>
        {
            pending(&record, &pod, &ctx).await
        }
        phase::ACTIVE if status.addr.is_some() && satisfied(&record, &ctx) => {
            Ok(Action::requeue(ctx.settings.resync))
        }
        phase::FAILED if timed_out && status.addr.is_some() => Ok(Action::await_change()),
        _ => allocate(&record, &pod, &ctx).await,
    }
}

/// Whether an Active record's address still satisfies its spec and subnet.
fn satisfied(record: &FlatNetworkIP, ctx: &Context) -> bool {
    let Some(addr) = record.status.as_ref().and_then(|s| s.addr) else {
        return false;
    };
    if !record.spec.addrs.is_empty() && !record.spec.addrs.contains(&addr) {
        return false;
    }
    let subnet_ref = ObjectRef::new(&record.spec.subnet).within(SUBNET_NAMESPACE);
    match ctx.caches.subnets.get(&subnet_ref) {
        // Unknown or broken subnet: keep the running pod as it is.
        None => true,
        Some(subnet) => match validate_subnet(&record.spec.subnet, &subnet.spec) {
            Ok(valid) => Pool::new(&valid).is_allocatable(addr),
            Err(_) => true,
        },
    }
}

/// Whether a Pending record's MAC is what its spec asks for: one of the
/// requested fixed MACs, or none (or one from the pool) when it asks for none. (Once the node has
/// set the pod up, `status.mac` is the MAC the interface got, fixed or not.)
fn mac_satisfied(record: &FlatNetworkIP) -> bool {
    let held = record.status.as_ref().map_or("", |s| s.mac.as_str());
    if record.spec.macs.is_empty() {
        // A MAC from the pool is kept like the address (StatefulSet pods).
        return held.is_empty() || record.status.as_ref().is_some_and(|s| s.mac_from_pool);
    }
    let Ok(held) = Mac::parse(held) else {
        return false;
    };
    record
        .spec
        .macs
        .iter()
        .any(|m| Mac::parse(m).is_ok_and(|m| m == held))
}

async fn allocate(record: &FlatNetworkIP, pod: &CachedPod, ctx: &Context) -> Result<Action, Error> {
    if let Some(wait) = ctx.wire.unsynced_for() {
        // A new leader: the wire's reports are not listed yet.
        return Ok(Action::requeue(wait));
    }
    let key = key_of(record.namespace().as_deref(), &record.name_any());
    let started = Instant::now();
    let outcome = async {
        let workload = requesting_workload(record, pod, ctx).await?;
        let workload = workload.as_deref();
        let reservation = if commit::batchable(record) {
            commit::reserve_batched(ctx, record, workload).await?
        } else {
            commit::reserve(ctx, record, workload).await?
        };
        let written = commit::write_record(ctx, record, &reservation).await?;
        Ok::<_, Error>((reservation, written))
    }
    .await;
    match outcome {
        Ok((reservation, Written::Done(_))) => {
            ctx.metrics
                .address_allocated(&reservation.subnet, started.elapsed());
            ctx.backoff.reset(&key);
            info!(subnet = %reservation.subnet, addr = %reservation.addr, "address allocated");
            Ok(Action::requeue(ctx.settings.pending_timeout))
        }
        Ok((_, Written::Superseded)) => Ok(Action::await_change()),
        Err(error) if error.needs_user() => {
            report_failure(record, pod, &error, ctx).await;
            Err(error)
        }
        Err(error) => Err(error),
    }
}

/// The `reservedIP` key of the workload of `pod`, when its record asks for
/// specific addresses (which that workload may have reserved); an automatic
/// request never takes a reserved address, so it needs none.
async fn requesting_workload(
    record: &FlatNetworkIP,
    pod: &CachedPod,
    ctx: &Context,
) -> Result<Option<String>, Error> {
    if record.spec.addrs.is_empty() {
        return Ok(None);
    }
    let workload = super::pod_workload(pod, ctx).await?;
    Ok(Some(workload.key()))
}

/// Marks the record Failed with the error's message and tells the pod,
/// once per distinct message so a failing pod causes no Event storm.
async fn report_failure(record: &FlatNetworkIP, pod: &CachedPod, error: &Error, ctx: &Context) {
    let message = error.to_string();
    let mut status = record.status.clone().unwrap_or_default();
    if status.phase == phase::FAILED && status.failure_message == message {
        return;
    }
    status.phase = phase::FAILED.into();
    status.failure_message = message.clone();
    set_condition(
        &mut status.conditions,
        condition(
            CONDITION_READY,
            false,
            error.event_reason(),
            message.clone(),
            record.metadata.generation,
        ),
    );
    let mut updated = record.clone();
    updated.status = Some(status);
    let api: Api<FlatNetworkIP> =
        Api::namespaced(ctx.client.clone(), &record.namespace().unwrap_or_default());
    if let Err(error) = api
        .replace_status(&record.name_any(), &PostParams::default(), &updated)
        .await
    {
        // The retry reports again.
        warn!(%error, "could not record the failure in the FlatNetworkIP status");
        return;
    }
    ctx.events
        .warn_allocation(pod, error.event_reason(), "Allocate", message)
        .await;
}

/// A Pending record: fail it once the node had `pending_timeout` to set the
/// pod up. The pod is left alone (deleting it would only loop).
async fn pending(record: &FlatNetworkIP, pod: &CachedPod, ctx: &Context) -> Result<Action, Error> {
    let status = record.status.clone().unwrap_or_default();
    let timeout = ctx.settings.pending_timeout;
    let allocated = status
        .allocated_time_stamp
        .as_ref()
        .map_or(Timestamp::UNIX_EPOCH, |t| t.0);
    let waited = Timestamp::now().duration_since(allocated);
    let waited = std::time::Duration::try_from(waited).unwrap_or_default();
    if waited < timeout {
        return Ok(Action::requeue(timeout.saturating_sub(waited)));
    }
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_else(|| "(not scheduled)".into());
    let message = format!(
        "address {} was allocated {}s ago and node {node} never set the pod up: check the flatnet agent on that node and the pod's Multus annotation (k8s.v1.cni.cncf.io/networks)",
        status.addr.map(|a| a.to_string()).unwrap_or_default(),
        waited.as_secs()
    );
    let mut updated = record.clone();
    let new_status = updated.status.get_or_insert_with(Default::default);
    new_status.phase = phase::FAILED.into();
    new_status.failure_message = message.clone();
    set_condition(
        &mut new_status.conditions,
        condition(
            CONDITION_READY,
            false,
            REASON_SETUP_TIMEOUT,
            message.clone(),
            record.metadata.generation,
        ),
    );
    let api: Api<FlatNetworkIP> =
        Api::namespaced(ctx.client.clone(), &record.namespace().unwrap_or_default());
    match api
        .replace_status(&record.name_any(), &PostParams::default(), &updated)
        .await
    {
        Ok(_) => {}
        // The node set it up meanwhile, or the record changed: look again.
        Err(error) if is_conflict(&error) => return Ok(Action::requeue(CONFLICT_RETRY)),
        Err(error) if is_not_found(&error) => return Ok(Action::await_change()),
        Err(error) => {
            return Err(Error::kube(
                "update status of",
                "FlatNetworkIP",
                &key_of(record.namespace().as_deref(), &record.name_any()),
            )(error));
        }
    }
    ctx.events
        .warn(pod, "FlatNetworkSetupTimeout", "WaitForSetup", message)
        .await;
    Ok(Action::await_change())
}

/// A record whose pod is gone: deleted, unless the StatefulSet policy keeps
/// it for the next pod of that name.
async fn collect(record: &FlatNetworkIP, ctx: &Context) -> Result<Action, Error> {
    if !crate::cache::listed(&ctx.caches.pods) {
        return Ok(Action::requeue(GC_MIN_AGE));
    }
    if nodes::kept_by_statefulset(record, ctx) {
        return Ok(Action::requeue(ctx.settings.resync));
    }
    let age = record
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| Timestamp::now().duration_since(t.0))
        .and_then(|d| std::time::Duration::try_from(d).ok())
        .unwrap_or_default();
    if age < GC_MIN_AGE {
        return Ok(Action::requeue(GC_MIN_AGE.saturating_sub(age)));
    }
    let namespace = record.namespace().unwrap_or_default();
    let name = record.name_any();
    let api: Api<FlatNetworkIP> = Api::namespaced(ctx.client.clone(), &namespace);
    match api.delete(&name, &DeleteParams::background()).await {
        Ok(_) => {
            ctx.metrics.record_collected(COLLECTED_POD_GONE);
            info!("collected the FlatNetworkIP of a pod that no longer exists");
            Ok(Action::await_change())
        }
        Err(error) if is_not_found(&error) => Ok(Action::await_change()),
        Err(error) => Err(Error::kube(
            "delete",
            "FlatNetworkIP",
            &key_of(Some(&namespace), &name),
        )(error)),
    }
}

/// A deleted record: let it go, then give its address back.
///
/// The finalizer goes first, with the resourceVersion of the copy at hand:
/// a stale copy (the cache lags behind this very removal, and any event
/// brings the record here again) gets a conflict or NotFound and releases
/// nothing. So the address is released once, never after the ledger has
/// handed it to another record. A crash between the two writes leaves the
/// address to the subnet repair, after the orphan grace.
async fn finalize(record: &FlatNetworkIP, ctx: &Context) -> Result<Action, Error> {
    let ours = |f: &String| f == FINALIZER || f == LEGACY_FINALIZER;
    if !record.finalizers().iter().any(ours) {
        return Ok(Action::await_change());
    }
    let namespace = record.namespace().unwrap_or_default();
    let name = record.name_any();
    let key = key_of(Some(&namespace), &name);
    let remaining: Vec<&String> = record.finalizers().iter().filter(|f| !ours(f)).collect();
    let patch = json!({"metadata": {
        "finalizers": remaining,
        "resourceVersion": record.resource_version(),
    }});
    let api: Api<FlatNetworkIP> = Api::namespaced(ctx.client.clone(), &namespace);
    match api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        // Released by an earlier pass.
        Err(error) if is_not_found(&error) => return Ok(Action::await_change()),
        // Changed meanwhile (or refused): look again at the current copy.
        Err(error) if is_conflict(&error) => return Ok(Action::requeue(CONFLICT_RETRY)),
        Err(error) => {
            return Err(Error::kube("remove finalizer of", "FlatNetworkIP", &key)(
                error,
            ));
        }
    }
    // Deleted before its allocation took an address reserved ahead for it.
    ctx.ledgers.forsake(ctx, &record.spec.subnet, &key).await?;
    if let Some(status) = &record.status
        && let Some(addr) = status.addr
    {
        let macs: Vec<String> = record
            .ledgered_mac()
            .map(str::to_owned)
            .into_iter()
            .collect();
        commit::release_holdings(ctx, record, &[addr], &macs).await?;
        ctx.metrics.address_released(&record.spec.subnet);
        info!(addr = %addr, subnet = %record.spec.subnet, "address released");
    }
    Ok(Action::await_change())
}

/// Logs the failure, counts it, and retries with backoff.
pub fn error_policy(record: Arc<FlatNetworkIP>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = key_of(record.namespace().as_deref(), &record.name_any());
    warn!(record = %key, %error, "allocation failed");
    ctx.metrics
        .reconcile_failed(CONTROLLER, error.metric_label());
    if matches!(
        error,
        Error::Contention { .. } | Error::MacLedgerContention { .. }
    ) {
        return Action::requeue(commit::CONTENTION_RETRY);
    }
    Action::requeue(ctx.backoff.next(&key))
}
