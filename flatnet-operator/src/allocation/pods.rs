//! The pod controller: FlatNetworkIP records for flat pods, and the pod
//! labels once the node has set the pod up.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use flatnet_k8s::{
    annotations::{PodRequest, parse_pod_request},
    api::{FlatNetworkIP, FlatNetworkSubnet, phase},
    ipam::{Cidr, Family},
    keys::{SUBNET_NAMESPACE, annotation, label},
    multus::requested_mac,
};
use k8s_openapi::{
    api::core::v1::{Namespace, Pod},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::{controller::Action, reflector::ObjectRef},
};
use serde_json::json;
use tracing::{info, instrument, warn};

use super::{
    CachedPod, Context, Error,
    errors::{CONFLICT_RETRY, is_conflict, is_not_found},
    key_of,
    records::{
        RecordContext, desired_pod_labels, desired_record, merge_record, names_fit, needs_cronjob,
        record_matches, record_name,
    },
};
use crate::controller::is_flat_pod;

/// Name of this controller in logs and metrics.
pub const CONTROLLER: &str = "pod";

/// How long a pod whose record was seen going gets no new record: longer
/// than the pod cache can lag behind the record cache.
const DEPARTED_HOLD: Duration = Duration::from_secs(30);

/// How long the pod controller trusts its own create of a record over a
/// record cache that does not show it yet: longer than that cache lags
/// behind a write on a loaded API server.
const CREATED_HOLD: Duration = Duration::from_secs(10);

/// How soon a pod whose record is not cached yet, though created, is
/// looked at again (the record's watch event usually comes first).
const CREATED_RECHECK: Duration = Duration::from_millis(500);

/// Keys marked recently, each forgotten a fixed hold after its mark.
///
/// Two uses, both about a cache that lags behind what the pod controller
/// knows (the pod and record caches are fed by separate watches):
/// - [`Marks::departed`], pods (by uid) whose record was seen terminating.
///   The record of a deleted pod is deleted by the garbage collector, and
///   its deletion can arrive while the pod cache still shows the pod.
///   Without the mark, the pod controller would find no record for a pod
///   it thinks is alive and create it again: a record, an address and a
///   deletion for a pod that is gone, repeated under deletion churn.
/// - [`Marks::created`], records the controller has just created. The
///   record's watch event wakes the pod controller, often before the
///   record cache it reads has the record; without the mark, it would
///   create the record again, to be refused with 409 (a wasted write, and
///   a withdrawn announcement to the ledger).
pub struct Marks {
    hold: Duration,
    seen: Mutex<Seen>,
}

/// When each key was marked, and the marks oldest first (to forget them
/// without scanning).
#[derive(Default)]
struct Seen {
    at: HashMap<String, Instant>,
    order: VecDeque<(String, Instant)>,
}

impl Marks {
    /// Pods whose record was seen going.
    #[must_use]
    pub fn departed() -> Self {
        Self::holding(DEPARTED_HOLD)
    }

    /// Records the pod controller created.
    #[must_use]
    pub fn created() -> Self {
        Self::holding(CREATED_HOLD)
    }

    fn holding(hold: Duration) -> Self {
        Self {
            hold,
            seen: Mutex::default(),
        }
    }

    /// Marks `key` (a first mark stands until the hold has passed).
    pub fn saw(&self, key: &str) {
        if key.is_empty() {
            return;
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((old, at)) = seen.order.front().cloned()
            && at.elapsed() >= self.hold
        {
            seen.order.pop_front();
            if seen.at.get(&old) == Some(&at) {
                seen.at.remove(&old);
            }
        }
        if !seen.at.contains_key(key) {
            let now = Instant::now();
            seen.at.insert(key.to_owned(), now);
            seen.order.push_back((key.to_owned(), now));
        }
    }

    /// How much longer the mark of `key` holds, if it was marked less than
    /// the hold ago.
    fn hold_left(&self, key: &str) -> Option<Duration> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let left = self.hold.checked_sub(seen.at.get(key)?.elapsed())?;
        (!left.is_zero()).then_some(left)
    }
}

/// Ensures the records of a flat pod and, once Active, its labels.
///
/// A pod with unusable annotations gets a Warning Event naming the
/// annotation and the fix, and is not retried until it changes.
///
/// # Errors
/// An API call failed.
#[instrument(skip_all, fields(pod = %pod.name_any(), namespace = pod.namespace().unwrap_or_default()))]
pub async fn reconcile(pod: Arc<CachedPod>, ctx: Arc<Context>) -> Result<Action, Error> {
    let result = ensure(&pod, &ctx).await;
    if result.is_ok() {
        ctx.backoff.reset(&backoff_key(&pod));
    }
    result
}

/// The key of `pod` in the shared backoff.
fn backoff_key(pod: &CachedPod) -> String {
    format!(
        "pod/{}",
        key_of(pod.namespace().as_deref(), &pod.name_any())
    )
}

/// The CronJob owning the Job of `pod`, when its workload selector needs it
/// (read through the Job, as the workload controller keys CronJobs).
async fn cronjob_of(pod: &CachedPod, ctx: &Context) -> Result<Option<String>, Error> {
    if !needs_cronjob(pod) {
        return Ok(None);
    }
    let workload = super::pod_workload(pod, ctx).await?;
    Ok((workload.kind == "CronJob").then_some(workload.name))
}

async fn ensure(pod: &Arc<CachedPod>, ctx: &Arc<Context>) -> Result<Action, Error> {
    let (pod, ctx) = (Arc::clone(pod), Arc::clone(ctx));
    if !is_flat_pod(pod.as_ref()) || pod.metadata.deletion_timestamp.is_some() {
        // Records go with their owner (garbage collection); see ips::collect.
        return Ok(Action::await_change());
    }
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let key = key_of(Some(&namespace), &name);
    let annotations = pod.annotations();
    let get = |k: &str| annotations.get(k).map_or("", String::as_str);
    // A MAC given in the Multus selection (Multus passes it to the CNI as
    // runtimeConfig.mac) is a fixed MAC like the annotation's.
    let request = parse_pod_request(
        get(annotation::SUBNET),
        get(annotation::IP),
        get(annotation::MAC),
    )
    .and_then(|mut request| {
        if request.macs.is_empty() {
            let multus = get(annotation::MULTUS_NETWORKS);
            request
                .macs
                .extend(requested_mac(multus, &ctx.settings.attachment)?);
        }
        Ok(request)
    });
    let request = match request {
        Ok(request) => request,
        Err(source) => {
            let error = Error::Annotation { pod: key, source };
            return user_error(&pod, error, &ctx).await;
        }
    };
    if !names_fit(&name, request.subnets.len()) {
        return user_error(&pod, Error::NameTooLong { pod: key }, &ctx).await;
    }
    let subnets: Vec<Option<Arc<FlatNetworkSubnet>>> = request
        .subnets
        .iter()
        .map(|s| {
            ctx.caches
                .subnets
                .get(&ObjectRef::new(&s.subnet).within(SUBNET_NAMESPACE))
        })
        .collect();
    if let Err(error) = check_families(&request, &subnets) {
        return user_error(&pod, error, &ctx).await;
    }
    let project = ctx
        .caches
        .namespaces
        .get(&ObjectRef::<Namespace>::new(&namespace))
        .and_then(|ns| ns.labels().get(label::RANCHER_PROJECT_ID).cloned());

    let cronjob = cronjob_of(&pod, &ctx).await?;
    let api: Api<FlatNetworkIP> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut records = Vec::with_capacity(request.subnets.len());
    for (index, subnet) in subnets.iter().enumerate() {
        let desired = desired_record(
            &pod,
            &RecordContext {
                request: &request,
                index,
                subnet: subnet.as_deref(),
                project: project.as_deref(),
                policy: ctx.settings.statefulset_policy,
                cronjob: cronjob.as_deref(),
            },
        );
        let record_ref = ObjectRef::new(&record_name(&name, index)).within(&namespace);
        let cached = ctx.caches.records.get(&record_ref);
        // Its record went with the pod, whose deletion this cache has not
        // seen yet; should the pod live on (its record deleted by hand), it
        // gets a new one after the hold.
        if cached.is_none()
            && let Some(left) = ctx.departed.hold_left(&desired.spec.pod_id)
        {
            return Ok(Action::requeue(left));
        }
        // Created by this controller, not cached yet: no second create.
        let created_key = format!("{}/{}", desired.spec.pod_id, record_ref);
        if cached.is_none()
            && let Some(left) = ctx.created.hold_left(&created_key)
        {
            return Ok(Action::requeue(left.min(CREATED_RECHECK)));
        }
        let record = match cached {
            None => {
                let created = create(&api, &desired, &key, &ctx).await?;
                if created.is_some() {
                    ctx.created.saw(&created_key);
                }
                created
            }
            Some(existing) if record_matches(&existing, &desired) => Some((*existing).clone()),
            Some(existing) => update(&api, &existing, &desired, &key).await?,
        };
        let Some(record) = record else {
            // Lost a race with another writer: look again.
            return Ok(Action::requeue(CONFLICT_RETRY));
        };
        records.push(record);
    }

    let all_active = records
        .iter()
        .all(|r| r.status.as_ref().is_some_and(|s| s.phase == phase::ACTIVE));
    if all_active {
        let flat_mode = subnets[0]
            .as_ref()
            .map(|s| s.spec.flat_mode.clone())
            .unwrap_or_default();
        label_pod(&pod, &request, &records[0], &flat_mode, &ctx).await?;
    }
    Ok(Action::await_change())
}

/// In dual stack, the first subnet must be IPv4 and the second IPv6.
fn check_families(
    request: &PodRequest,
    subnets: &[Option<Arc<FlatNetworkSubnet>>],
) -> Result<(), Error> {
    for (wanted, subnet) in request.subnets.iter().zip(subnets) {
        let (Some(expected), Some(subnet)) = (wanted.family, subnet) else {
            continue;
        };
        let Ok(cidr) = Cidr::parse(subnet.spec.cidr.trim()) else {
            continue;
        };
        let name = |f: Family| match f {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        };
        if cidr.family() != expected && request.subnets.len() == 2 {
            return Err(Error::WrongFamily {
                subnet: wanted.subnet.clone(),
                actual: name(cidr.family()),
                expected: name(expected),
            });
        }
    }
    Ok(())
}

/// Reports a problem only the user can fix and waits for the pod to change.
async fn user_error(pod: &CachedPod, error: Error, ctx: &Context) -> Result<Action, Error> {
    warn!(%error, "flat-network pod cannot be served");
    ctx.metrics
        .reconcile_failed(CONTROLLER, error.metric_label());
    ctx.events
        .warn_allocation(
            pod,
            error.event_reason(),
            "CreateFlatNetworkIP",
            error.to_string(),
        )
        .await;
    Ok(Action::await_change())
}

/// Creates the record, announced to its subnet's ledger first (when it
/// asks for no fixed MAC) so that its address can be reserved ahead, in a
/// ledger write shared with the records created alongside.
async fn create(
    api: &Api<FlatNetworkIP>,
    desired: &FlatNetworkIP,
    pod_key: &str,
    ctx: &Context,
) -> Result<Option<FlatNetworkIP>, Error> {
    let subnet = &desired.spec.subnet;
    let key = key_of(desired.namespace().as_deref(), &desired.name_any());
    let announced = desired.spec.macs.is_empty();
    if announced {
        ctx.ledgers.expect(subnet, &key, &desired.spec.addrs);
    }
    let created = api.create(&PostParams::default(), desired).await;
    if announced && created.is_err() {
        ctx.ledgers.forsake(ctx, subnet, &key).await?;
    }
    match created {
        Ok(created) => {
            info!(record = %created.name_any(), "FlatNetworkIP created");
            Ok(Some(created))
        }
        // The cache lags behind an earlier create.
        Err(error) if is_conflict(&error) => Ok(None),
        Err(error) => Err(Error::kube("create", "FlatNetworkIP of pod", pod_key)(
            error,
        )),
    }
}

/// Rewrites a record's metadata and spec; a record left by an earlier pod of
/// the same name (a StatefulSet pod) also goes back to Pending, because the
/// new pod still has to be set up.
async fn update(
    api: &Api<FlatNetworkIP>,
    existing: &FlatNetworkIP,
    desired: &FlatNetworkIP,
    pod_key: &str,
) -> Result<Option<FlatNetworkIP>, Error> {
    let name = existing.name_any();
    let merged = merge_record(existing, desired);
    let mut written = match api.replace(&name, &PostParams::default(), &merged).await {
        Ok(written) => written,
        Err(error) if is_conflict(&error) || is_not_found(&error) => return Ok(None),
        Err(error) => {
            return Err(Error::kube("update", "FlatNetworkIP of pod", pod_key)(
                error,
            ));
        }
    };
    let new_pod = existing.spec.pod_id != desired.spec.pod_id;
    let has_addr = written.status.as_ref().is_some_and(|s| s.addr.is_some());
    if new_pod && has_addr {
        let status = written.status.get_or_insert_with(Default::default);
        status.phase = phase::PENDING.into();
        status.failure_message.clear();
        status.allocated_time_stamp = Some(Time(Timestamp::now()));
        written = match api
            .replace_status(&name, &PostParams::default(), &written)
            .await
        {
            Ok(written) => written,
            Err(error) if is_conflict(&error) || is_not_found(&error) => return Ok(None),
            Err(error) => {
                return Err(Error::kube(
                    "update status of",
                    "FlatNetworkIP of pod",
                    pod_key,
                )(error));
            }
        };
    }
    info!(record = %name, "FlatNetworkIP updated");
    Ok(Some(written))
}

/// Sets the `selectedIP`, `selectedMac`, subnet, type and mode labels.
async fn label_pod(
    pod: &CachedPod,
    request: &PodRequest,
    first: &FlatNetworkIP,
    flat_mode: &str,
    ctx: &Context,
) -> Result<(), Error> {
    let wanted = desired_pod_labels(request, first, flat_mode);
    let labels = pod.labels();
    if wanted.iter().all(|(k, v)| labels.get(k) == Some(v)) {
        return Ok(());
    }
    let namespace = pod.namespace().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let patch = json!({"metadata": {"labels": wanted}});
    match pods
        .patch(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(error) if is_not_found(&error) => Ok(()),
        Err(error) => Err(Error::kube(
            "label",
            "Pod",
            &key_of(Some(&namespace), &pod.name_any()),
        )(error)),
    }
}

/// Logs the failure, counts it, and retries with backoff.
pub fn error_policy(pod: Arc<CachedPod>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(pod = %key_of(pod.namespace().as_deref(), &pod.name_any()), %error, "pod reconcile failed");
    ctx.metrics
        .reconcile_failed(CONTROLLER, error.metric_label());
    Action::requeue(ctx.backoff.next(&backoff_key(&pod)))
}
