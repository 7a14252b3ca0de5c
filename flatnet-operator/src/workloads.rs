//! The workload controller (the original's `rancher-flat-network-workload`).
//!
//! Deployments, StatefulSets, DaemonSets, Jobs and CronJobs whose pod
//! template asks for the flat network get the labels
//! `flatnetwork.pandaria.io/{flatNetworkIPType,subnet,flatMode}` on their own
//! metadata, and those asking for specific addresses have them listed in
//! their subnet's `status.reservedIP` under `<Kind>/<namespace>/<name>`,
//! where the webhook refuses them to other workloads and the allocator
//! hands them only to that workload's pods ([`owner`] says whose a pod is).
//!
//! It reconciles subnets, not workloads: a subnet's reservations are
//! computed from every workload that names it, so a deleted workload (or
//! one that moved to another subnet) loses its reservation at the next
//! reconcile of the subnet. The original removed reservations only for a
//! workload with a finalizer it never added, so they leaked.
//! A CronJob's request is read from `spec.jobTemplate.spec.template`
//! (the original read the CronJob's metadata there and ignored CronJobs).

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use flatnet_k8s::{
    annotations::parse_pod_request,
    api::{FlatNetworkSubnet, FlatNetworkSubnetStatus, IpRange},
    ipam::used_ranges,
    keys::{SUBNET_NAMESPACE, annotation, label},
};
use futures::StreamExt;
use k8s_openapi::api::{
    apps::v1::{DaemonSet, Deployment, StatefulSet},
    batch::v1::{CronJob, Job},
    core::v1::PodTemplateSpec,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{ApiResource, DynamicObject, Patch, PatchParams},
    runtime::{
        controller,
        controller::Action,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    cache::{self, cached_controller},
    metrics::Metrics,
};

/// Name of this controller in logs and metrics.
pub const CONTROLLER: &str = "workloads";

/// Retry delay after an API error.
const RETRY_TRANSIENT: Duration = Duration::from_secs(10);

/// Workload status updates come in bursts (a rollout); one reconcile of the
/// subnet per second is enough.
const DEBOUNCE: Duration = Duration::from_secs(1);

/// A workload kind whose pod template may ask for the flat network.
pub trait Workload: Resource<DynamicType = ()> + Clone + Send + Sync + 'static {
    /// Its pod template.
    fn template(&self) -> Option<&PodTemplateSpec>;
}

/// Kinds whose pod template is `spec.template`.
macro_rules! template_at_spec {
    ($($kind:ty),*) => {$(
        impl Workload for $kind {
            fn template(&self) -> Option<&PodTemplateSpec> {
                self.spec.as_ref().map(|s| &s.template)
            }
        }
    )*};
}
template_at_spec!(Deployment, StatefulSet, DaemonSet, Job);
impl Workload for CronJob {
    fn template(&self) -> Option<&PodTemplateSpec> {
        self.spec
            .as_ref()
            .and_then(|s| s.job_template.spec.as_ref())
            .map(|s| &s.template)
    }
}

/// What a workload's pod template asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatRequest {
    /// `<Kind>/<namespace>/<name>`, the `reservedIP` key.
    pub key: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The subnets named (the first one goes into the `subnet` label: a
    /// label value cannot hold the dual-stack comma).
    pub subnets: Vec<String>,
    /// Specific addresses asked for, per subnet (empty: `auto`).
    pub addresses: BTreeMap<String, Vec<std::net::IpAddr>>,
}

impl FlatRequest {
    /// The request of `workload`, when its template has both the `subnet`
    /// and the `ip` annotation and they parse (the webhook reports the
    /// ones that do not).
    pub fn of<K: Workload>(workload: &K) -> Option<Self> {
        let template = workload.template()?;
        let annotations = template.metadata.as_ref()?.annotations.as_ref()?;
        let subnet = annotations.get(annotation::SUBNET)?;
        let ip = annotations.get(annotation::IP)?;
        if subnet.trim().is_empty() || ip.trim().is_empty() {
            return None;
        }
        let mac = annotations.get(annotation::MAC).map_or("", String::as_str);
        let request = parse_pod_request(subnet, ip, mac).ok()?;
        let namespace = workload.namespace()?;
        let name = workload.name_any();
        Some(FlatRequest {
            key: owner::WorkloadRef::new(&K::kind(&()), &namespace, &name).key(),
            namespace,
            name,
            subnets: request.subnets.iter().map(|s| s.subnet.clone()).collect(),
            addresses: request
                .subnets
                .into_iter()
                .filter(|s| !s.candidates.is_empty())
                .map(|s| (s.subnet, s.candidates))
                .collect(),
        })
    }

    /// The labels the workload carries for `flat_mode` (its subnet's).
    #[must_use]
    pub fn labels(&self, flat_mode: &str) -> BTreeMap<String, String> {
        let ip_type = if self.addresses.is_empty() {
            label::IP_TYPE_AUTO
        } else {
            label::IP_TYPE_SPECIFIC
        };
        BTreeMap::from([
            (label::IP_TYPE.to_owned(), ip_type.to_owned()),
            (label::SUBNET.to_owned(), self.subnets[0].clone()),
            (label::FLAT_MODE.to_owned(), flat_mode.to_owned()),
        ])
    }
}

/// `status.reservedIP` of `subnet`: the specific addresses of every request
/// naming it, as merged ranges, keyed `<Kind>/<namespace>/<name>`.
#[must_use]
pub fn reservations<'a>(
    subnet: &str,
    requests: impl IntoIterator<Item = &'a FlatRequest>,
) -> BTreeMap<String, Vec<IpRange>> {
    requests
        .into_iter()
        .filter_map(|r| {
            let addresses = r.addresses.get(subnet)?;
            Some((
                r.key.clone(),
                used_ranges::compress(addresses.iter().copied()),
            ))
        })
        .collect()
}

/// The merge patch turning `current` into `wanted` (removed keys are null).
fn reservation_patch(
    current: &BTreeMap<String, Vec<IpRange>>,
    wanted: &BTreeMap<String, Vec<IpRange>>,
) -> Option<Value> {
    if current == wanted {
        return None;
    }
    let mut map = serde_json::Map::new();
    for key in current.keys().filter(|k| !wanted.contains_key(*k)) {
        map.insert(key.clone(), Value::Null);
    }
    for (key, ranges) in wanted {
        if current.get(key) != Some(ranges) {
            map.insert(key.clone(), json!(ranges));
        }
    }
    Some(json!({ "status": { "reservedIP": map } }))
}

/// The caches of the five workload kinds.
#[derive(Clone)]
pub struct Caches {
    /// Deployments.
    pub deployments: Store<Deployment>,
    /// StatefulSets.
    pub statefulsets: Store<StatefulSet>,
    /// DaemonSets.
    pub daemonsets: Store<DaemonSet>,
    /// Jobs.
    pub jobs: Store<Job>,
    /// CronJobs.
    pub cronjobs: Store<CronJob>,
}

/// What the reconciler needs.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The workload caches.
    pub caches: Caches,
    /// Period of the full re-reconcile.
    pub resync: Duration,
}

/// A reconcile failure.
#[derive(Debug, thiserror::Error)]
#[error("{op} {object}: {source}")]
pub struct Error {
    /// What was attempted.
    op: &'static str,
    /// `kind namespace/name`.
    object: String,
    /// The API error.
    #[source]
    source: Box<kube::Error>,
}

/// A workload of the caches that names `subnet`, with its metadata and the
/// resource to patch it through.
struct Found {
    request: FlatRequest,
    labels: BTreeMap<String, String>,
    resource: ApiResource,
}

fn collect<K: Workload>(store: &Store<K>, subnet: &str, out: &mut Vec<Found>) {
    for workload in store.state() {
        if workload.meta().deletion_timestamp.is_some() {
            continue;
        }
        let Some(request) = FlatRequest::of(workload.as_ref()) else {
            continue;
        };
        if request.subnets.iter().any(|s| s == subnet) {
            out.push(Found {
                request,
                labels: workload.labels().clone(),
                resource: ApiResource::erase::<K>(&()),
            });
        }
    }
}

impl Caches {
    fn naming(&self, subnet: &str) -> Vec<Found> {
        let mut found = Vec::new();
        collect(&self.deployments, subnet, &mut found);
        collect(&self.statefulsets, subnet, &mut found);
        collect(&self.daemonsets, subnet, &mut found);
        collect(&self.jobs, subnet, &mut found);
        collect(&self.cronjobs, subnet, &mut found);
        found
    }
}

/// Labels the workloads naming `subnet` and writes its `reservedIP`.
///
/// # Errors
/// An API call failed; retried.
pub async fn reconcile(subnet: Arc<FlatNetworkSubnet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let name = subnet.name_any();
    let found = ctx.caches.naming(&name);
    let params = PatchParams::default();
    for workload in &found {
        // Labels follow the first subnet named (see FlatRequest::subnets).
        if workload.request.subnets[0] != name {
            continue;
        }
        let wanted = workload.request.labels(&subnet.spec.flat_mode);
        if wanted
            .iter()
            .all(|(k, v)| workload.labels.get(k) == Some(v))
        {
            continue;
        }
        let api: Api<DynamicObject> = Api::namespaced_with(
            ctx.client.clone(),
            &workload.request.namespace,
            &workload.resource,
        );
        api.patch(
            &workload.request.name,
            &params,
            &Patch::Merge(json!({ "metadata": { "labels": wanted } })),
        )
        .await
        .map_err(|source| Error {
            op: "label",
            object: workload.request.key.clone(),
            source: Box::new(source),
        })?;
        info!(workload = %workload.request.key, "flat-network labels set");
    }
    let current = subnet
        .status
        .as_ref()
        .map(|s| s.reserved_ip.clone())
        .unwrap_or_default();
    let mut wanted = reservations(&name, found.iter().map(|f| &f.request));
    // The migrator's V1 entries are not the workloads': kept as they are.
    wanted.extend(
        current
            .iter()
            .filter(|(key, _)| FlatNetworkSubnetStatus::is_v1_reservation(key))
            .map(|(key, ranges)| (key.clone(), ranges.clone())),
    );
    if let Some(patch) = reservation_patch(&current, &wanted) {
        let api: Api<FlatNetworkSubnet> = Api::namespaced(ctx.client.clone(), SUBNET_NAMESPACE);
        api.patch_status(&name, &params, &Patch::Merge(patch))
            .await
            .map_err(|source| Error {
                op: "write reservedIP of",
                object: format!("FlatNetworkSubnet {SUBNET_NAMESPACE}/{name}"),
                source: Box::new(source),
            })?;
        info!(subnet = %name, reservations = wanted.len(), "reservedIP updated");
    }
    Ok(Action::requeue(ctx.resync))
}

/// Logs the failure, counts it, and retries later.
pub fn error_policy(subnet: Arc<FlatNetworkSubnet>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(subnet = %subnet.name_any(), %error, "reconcile failed");
    ctx.metrics.reconcile_failed(CONTROLLER, "kube_api");
    Action::requeue(RETRY_TRANSIENT)
}

/// The subnets a workload names (it triggers their reconcile, on every
/// change and on deletion).
fn subnets_of<K: Workload>(workload: &K) -> Vec<ObjectRef<FlatNetworkSubnet>> {
    FlatRequest::of(workload)
        .map(|r| r.subnets)
        .unwrap_or_default()
        .into_iter()
        .map(|s| ObjectRef::new(&s).within(SUBNET_NAMESPACE))
        .collect()
}

fn cache<K>(client: &Client) -> (Store<K>, impl std::future::Future<Output = ()> + use<K>)
where
    K: Workload + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher(Api::<K>::all(client.clone()), watcher::Config::default()),
    )
    .for_each(|_| async {});
    (store, stream)
}

/// Runs the controller until `stop` is cancelled.
pub async fn run(
    client: Client,
    metrics: Arc<Metrics>,
    resync: Duration,
    workers: u16,
    stop: CancellationToken,
) {
    let (deployments, d) = cache::<Deployment>(&client);
    let (statefulsets, s) = cache::<StatefulSet>(&client);
    let (daemonsets, ds) = cache::<DaemonSet>(&client);
    let (jobs, j) = cache::<Job>(&client);
    let (cronjobs, c) = cache::<CronJob>(&client);
    let caches = Caches {
        deployments,
        statefulsets,
        daemonsets,
        jobs,
        cronjobs,
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        metrics,
        caches: caches.clone(),
        resync,
    });
    let wc = watcher::Config::default;
    let controller = cached_controller(
        Api::<FlatNetworkSubnet>::namespaced(client.clone(), SUBNET_NAMESPACE),
        wc(),
        |_| {},
    )
    .watches(Api::<Deployment>::all(client.clone()), wc(), |w| {
        subnets_of(&w)
    })
    .watches(Api::<StatefulSet>::all(client.clone()), wc(), |w| {
        subnets_of(&w)
    })
    .watches(Api::<DaemonSet>::all(client.clone()), wc(), |w| {
        subnets_of(&w)
    })
    .watches(Api::<Job>::all(client.clone()), wc(), |w| subnets_of(&w))
    .watches(Api::<CronJob>::all(client), wc(), |w| subnets_of(&w))
    .with_config(
        controller::Config::default()
            .concurrency(workers)
            .debounce(DEBOUNCE),
    )
    .graceful_shutdown_on({
        let stop = stop.clone();
        async move { stop.cancelled().await }
    })
    .run(reconcile, error_policy, ctx);
    // Reconciles start once every workload cache has synced, so no
    // reservation is dropped for a workload not listed yet.
    let ready = async {
        let synced = cache::synced(&caches.deployments).await
            && cache::synced(&caches.statefulsets).await
            && cache::synced(&caches.daemonsets).await
            && cache::synced(&caches.jobs).await
            && cache::synced(&caches.cronjobs).await;
        if synced {
            controller
                .for_each(|result| async move {
                    if let Err(error) = result {
                        debug!(controller = CONTROLLER, %error, "controller event");
                    }
                })
                .await;
        }
    };
    tokio::select! {
        () = ready => {}
        ((), (), (), (), ()) = futures::future::join5(d, s, ds, j, c) => warn!("workload watches ended"),
        () = stop.cancelled() => {}
    }
    info!("workload controller stopped");
}

pub mod owner;
#[cfg(test)]
mod tests;
