//! Addresses of pods on deleted nodes.
//!
//! A pod bound to a Node that no longer exists cannot run: Kubernetes' pod
//! garbage collector deletes such pods, and their records follow through
//! their owner reference. A pod that stays (its deletion is held by a
//! finalizer, or the pod collector lags or is disabled) would keep its
//! address forever, so once its node has been gone for
//! [`Settings::node_gone_grace`](super::Settings) the pod's records give
//! their address (and fixed MAC) back, in place: the record stays, so the
//! pod controller does not create it again, and the FlatNetworkIP
//! controller allocates again only if the node comes back.
//!
//! The grace keeps the addresses of a Node object that is deleted and
//! recreated (a kubelet re-registering). It counts from the first time this
//! process saw the node missing, so a restart starts it again (never
//! shorter). StatefulSet records kept under the sticky policy are never
//! released this way: their address belongs to the pod name.
//!
//! Nodes are watched (metadata only); a deleted node, or a node coming back
//! after it was seen missing, makes every record be looked at again.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use flatnet_k8s::{
    api::{CONDITION_READY, FlatNetworkIP, phase, set_condition},
    ipam::StatefulSetAddressPolicy,
};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, ResourceExt,
    api::{PartialObjectMeta, PostParams},
    runtime::{
        WatchStreamExt,
        controller::Action,
        reflector::{ObjectRef, store::Writer},
        watcher,
    },
};
use tracing::{info, warn};

use crate::controller::condition;

use super::{
    CachedPod, Context, Error, commit,
    errors::{CONFLICT_RETRY, is_conflict, is_not_found},
    key_of,
};

/// Ready condition reason (and Event reason) of a record whose address was
/// released because its pod's node is gone.
pub const REASON_NODE_GONE: &str = "NodeGone";

/// Metric label of records released because their node is gone.
pub const COLLECTED_NODE_GONE: &str = "node_gone";

/// Since when each missing node has been seen missing.
#[derive(Default)]
pub struct NodeClock {
    missing_since: Mutex<HashMap<String, Instant>>,
}

impl NodeClock {
    /// How long `node` has been seen missing; starts the clock now when it
    /// was not running.
    fn missing_for(&self, node: &str) -> Duration {
        let mut missing = self.missing_since.lock().unwrap_or_else(|e| e.into_inner());
        missing
            .entry(node.to_owned())
            .or_insert_with(Instant::now)
            .elapsed()
    }

    /// Forgets `node`: it exists. Returns whether it was seen missing.
    fn present(&self, node: &str) -> bool {
        self.missing_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(node)
            .is_some()
    }

    fn was_missing(&self, node: &str) -> bool {
        self.missing_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(node)
    }
}

/// The node watch: keeps `writer`'s store of nodes current and yields once
/// per deleted node, and per node that reappears after being seen missing.
pub fn node_events(
    api: Api<PartialObjectMeta<Node>>,
    writer: Writer<PartialObjectMeta<Node>>,
    clock: Arc<NodeClock>,
) -> impl Stream<Item = ()> + Send {
    watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .filter_map(move |event| {
            let wake = match event {
                Ok(watcher::Event::Delete(_)) => true,
                Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => {
                    clock.was_missing(&node.name_any())
                }
                Ok(_) => false,
                Err(error) => {
                    warn!(%error, "node watch failed; retrying");
                    false
                }
            };
            futures::future::ready(wake.then_some(()))
        })
}

/// What the node of a record's pod says about the record.
#[derive(Debug, PartialEq, Eq)]
pub enum NodeVerdict {
    /// The node exists, the pod is not bound, or nodes are not known yet.
    Fine,
    /// The node is missing, for less than the grace: look again then.
    Wait(Duration),
    /// The node has been missing for longer than the grace.
    Gone(String),
}

/// Judges the node `pod` is bound to. `pod` must be the record's pod (same
/// UID).
pub fn judge(pod: &CachedPod, ctx: &Context) -> NodeVerdict {
    let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
        return NodeVerdict::Fine;
    };
    if !crate::cache::listed(&ctx.caches.nodes) {
        return NodeVerdict::Fine;
    }
    if ctx.caches.nodes.get(&ObjectRef::new(node)).is_some() {
        if ctx.nodes.present(node) {
            info!(node, "node is back");
        }
        return NodeVerdict::Fine;
    }
    let missing = ctx.nodes.missing_for(node);
    let grace = ctx.settings.node_gone_grace;
    if missing < grace {
        NodeVerdict::Wait(grace.saturating_sub(missing))
    } else {
        NodeVerdict::Gone(node.to_owned())
    }
}

/// Whether the sticky StatefulSet policy keeps `record` with its pod name.
pub fn kept_by_statefulset(record: &FlatNetworkIP, ctx: &Context) -> bool {
    ctx.settings.statefulset_policy == StatefulSetAddressPolicy::Sticky
        && record
            .owner_references()
            .iter()
            .any(|o| o.kind == "StatefulSet" && o.api_version == "apps/v1")
}

/// Releases the address (and fixed MAC) of `record`, whose pod is bound to
/// `node`, gone for longer than the grace: the record first stops naming
/// them (with its resourceVersion), then the ledgers drop them.
///
/// # Errors
/// An API call failed.
pub async fn release_in_place(
    record: &FlatNetworkIP,
    pod: &CachedPod,
    node: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    let namespace = record.namespace().unwrap_or_default();
    let name = record.name_any();
    let key = key_of(Some(&namespace), &name);
    let mut updated = record.clone();
    let status = updated.status.get_or_insert_with(Default::default);
    let Some(addr) = status.addr.take() else {
        // Released already; the node coming back brings the record back.
        return Ok(Action::await_change());
    };
    let mac = std::mem::take(&mut status.mac);
    let message = format!(
        "node {node} was deleted and did not come back within {}s: address {addr} of pod {key} was released; the pod must be recreated to get an address",
        ctx.settings.node_gone_grace.as_secs()
    );
    status.phase = phase::FAILED.into();
    status.failure_message = message.clone();
    set_condition(
        &mut status.conditions,
        condition(
            CONDITION_READY,
            false,
            REASON_NODE_GONE,
            message.clone(),
            record.metadata.generation,
        ),
    );
    let api: Api<FlatNetworkIP> = Api::namespaced(ctx.client.clone(), &namespace);
    match api
        .replace_status(&name, &PostParams::default(), &updated)
        .await
    {
        Ok(_) => {}
        Err(error) if is_not_found(&error) => return Ok(Action::await_change()),
        // Changed meanwhile (or refused): look again.
        Err(error) if is_conflict(&error) => return Ok(Action::requeue(CONFLICT_RETRY)),
        Err(error) => {
            return Err(Error::kube("update status of", "FlatNetworkIP", &key)(
                error,
            ));
        }
    }
    let macs: Vec<String> = (!mac.is_empty() && record.spec.macs.contains(&mac))
        .then_some(mac)
        .into_iter()
        .collect();
    commit::release_holdings(ctx, record, &[addr], &macs).await?;
    ctx.metrics.record_collected(COLLECTED_NODE_GONE);
    ctx.metrics.address_released(&record.spec.subnet);
    info!(%addr, node, "address of a pod on a deleted node released");
    ctx.events
        .warn(pod, REASON_NODE_GONE, "Release", message)
        .await;
    Ok(Action::await_change())
}
