//! The flat-network Service controller.
//!
//! For every Service with a selector whose selected pods use the flat
//! network, flatnet owns a headless, selector-less `<service>-flat-network`
//! Service and writes its EndpointSlices (one per address family) with the
//! pods' flat addresses. See `docs/services.md`.

pub mod endpoints;
pub mod flat_service;
pub mod legacy_endpoints;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use futures::StreamExt;
use k8s_openapi::api::{core::v1::Pod, core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
    runtime::{
        controller::{self, Action},
        reflector::{ObjectRef, Store},
        watcher,
    },
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};

use self::{
    endpoints::{desired_slices, opts_out},
    flat_service::{desired_flat_service, flat_service_name, is_managed_by_flatnet},
};
use crate::{
    admin::Health,
    cache::cached_controller,
    controller::{ApiError, is_flat_pod, is_not_found},
    metrics::Metrics,
};
use flatnet_k8s::keys::label;

/// The label selector of the EndpointSlices flatnet writes.
fn flat_slices_label() -> String {
    format!(
        "{}={}",
        label::ENDPOINTSLICE_MANAGED_BY,
        label::ENDPOINTSLICE_MANAGED_BY_VALUE
    )
}

/// Name of this controller in logs and metrics.
pub const CONTROLLER: &str = "service";

/// Field manager of every server-side apply this controller makes.
pub const FIELD_MANAGER: &str = "flatnet-operator";

/// Longest wait for in-flight reconciles at shutdown (under the pod's
/// default 30 s termination grace period).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);
/// Retry delay after an API error.
const RETRY_TRANSIENT: Duration = Duration::from_secs(10);
/// Retry delay when a user must act (name taken).
const RETRY_USER_ACTION: Duration = Duration::from_secs(60);

/// What the reconciler needs.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Multus attachment of the flat network.
    pub attachment: String,
    /// Period of the full re-reconcile.
    pub resync: Duration,
}

/// A reconcile failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error(transparent)]
    Kube(#[from] ApiError),
    /// The flat Service's name is held by a Service flatnet does not own.
    #[error(
        "Service {namespace}/{name} exists and is not owned by Service {parent}; delete or rename it so flatnet can create the flat-network Service of {parent}"
    )]
    NameTaken {
        /// Namespace.
        namespace: String,
        /// The taken name.
        name: String,
        /// The Service that wants it.
        parent: String,
    },
}

impl Error {
    /// Short error kind for the `error` label of the error counter.
    #[must_use]
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube(_) => "kube_api",
            Self::NameTaken { .. } => "name_taken",
        }
    }

    fn kube(
        op: &'static str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> impl FnOnce(kube::Error) -> Self {
        let api_error = ApiError::of(op, kind, &format!("{namespace}/{name}"));
        move |source| Self::Kube(api_error(source))
    }
}

/// Whether a Service should have a flat Service, and with which pods.
#[derive(Debug)]
enum Wanted {
    /// No flat Service; the reason is logged when one is removed.
    No(&'static str),
    /// A flat Service with these selected pods as endpoint candidates.
    Yes(Vec<Pod>),
}

/// Brings the flat Service and its EndpointSlices of `service` in line.
///
/// # Errors
/// An API call failed, or the flat Service's name is taken.
#[instrument(skip_all, fields(service = %service.name_any(), namespace = service.namespace().unwrap_or_default()))]
pub async fn reconcile(service: Arc<Service>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    if is_managed_by_flatnet(&service) || service.meta().deletion_timestamp.is_some() {
        // Flat Services are children; a deleted parent's children go through GC.
        return Ok(Action::await_change());
    }
    let namespace = service.namespace().unwrap_or_default();
    let name = service.name_any();
    let flat_name = flat_service_name(&name);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);

    let wanted = match selector(&service) {
        None => Wanted::No("the Service has no selector"),
        Some(selector) => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
            // `match_any` lets the API server answer from its watch cache.
            let params = ListParams::default().labels(&selector).match_any();
            let pods = pods
                .list(&params)
                .await
                .map_err(Error::kube(
                    "list",
                    "Pods selected by Service",
                    &namespace,
                    &name,
                ))?
                .items;
            wanted(pods)
        }
    };

    let existing = services
        .get_opt(&flat_name)
        .await
        .map_err(Error::kube("get", "Service", &namespace, &flat_name))?;
    let pods = match wanted {
        Wanted::No(reason) => {
            if existing.is_some_and(|e| owned_by(&e, &service)) {
                info!(flat_service = %flat_name, reason, "deleting the flat-network Service");
                delete(&services, "Service", &namespace, &flat_name).await?;
            }
            return Ok(Action::requeue(ctx.resync));
        }
        Wanted::Yes(pods) => pods,
    };
    if let Some(existing) = existing.filter(|e| !is_managed_by_flatnet(e)) {
        if !owned_by(&existing, &service) {
            return Err(Error::NameTaken {
                namespace,
                name: flat_name,
                parent: name,
            });
        }
        // Written by rancher-flat-network: it has a selector that server-side
        // apply cannot take away from another manager, so replace it.
        info!(flat_service = %flat_name, "replacing the flat-network Service of rancher-flat-network");
        delete(&services, "Service", &namespace, &flat_name).await?;
    }

    let Some(desired) = desired_flat_service(&service, &ctx.attachment) else {
        // Not stored yet (no uid); the stored object will trigger us again.
        return Ok(Action::await_change());
    };
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let flat = services
        .patch(&flat_name, &apply, &Patch::Apply(&desired))
        .await
        .map_err(Error::kube("apply", "Service", &namespace, &flat_name))?;
    let Some(owner) = flat.controller_owner_ref(&()) else {
        return Ok(Action::await_change());
    };

    let desired = desired_slices(&service, &flat_name, &owner, &pods, &ctx.attachment);
    for skipped in &desired.skipped {
        warn!(pod = %skipped.pod, reason = %skipped.reason, "pod left out of the flat endpoints");
    }
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), &namespace);
    let current = slices
        .list_metadata(&ListParams::default().labels(&format!(
            "{}={flat_name},{}",
            label::ENDPOINTSLICE_SERVICE_NAME,
            flat_slices_label()
        )))
        .await
        .map_err(Error::kube(
            "list",
            "EndpointSlices of Service",
            &namespace,
            &flat_name,
        ))?;
    for slice in &desired.slices {
        let slice_name = slice.name_any();
        slices
            .patch(&slice_name, &apply, &Patch::Apply(slice))
            .await
            .map_err(Error::kube(
                "apply",
                "EndpointSlice",
                &namespace,
                &slice_name,
            ))?;
    }
    for stale in current.items.iter().map(ResourceExt::name_any).filter(|n| {
        !desired
            .slices
            .iter()
            .any(|s| s.metadata.name.as_ref() == Some(n))
    }) {
        delete(&slices, "EndpointSlice", &namespace, &stale).await?;
    }
    legacy_endpoints::apply(&ctx.client, &namespace, &flat_name, &owner, &desired.slices).await?;
    debug!(slices = desired.slices.len(), "flat endpoints written");
    Ok(Action::requeue(ctx.resync))
}

/// Logs the failure, counts it, and retries later.
pub fn error_policy(service: Arc<Service>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(service = %service.name_any(), namespace = service.namespace().unwrap_or_default(), %error, "reconcile failed");
    ctx.metrics
        .reconcile_failed(CONTROLLER, error.metric_label());
    match error {
        Error::Kube(_) => Action::requeue(RETRY_TRANSIENT),
        Error::NameTaken { .. } => Action::requeue(RETRY_USER_ACTION),
    }
}

/// Decides from the selected pods whether a flat Service is wanted.
fn wanted(pods: Vec<Pod>) -> Wanted {
    if pods.iter().any(opts_out) {
        Wanted::No("a selected pod has flatnetwork.pandaria.io/flatNetworkService: disabled")
    } else if !pods.iter().any(is_flat_pod) {
        Wanted::No("no selected pod uses the flat network")
    } else {
        Wanted::Yes(pods)
    }
}

/// The Service's selector as a label selector, `None` when empty.
fn selector(service: &Service) -> Option<String> {
    let selector = service.spec.as_ref()?.selector.as_ref()?;
    if selector.is_empty() {
        return None;
    }
    Some(
        selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(","),
    )
}

/// True when `child` has an owner reference to `parent`.
fn owned_by(child: &Service, parent: &Service) -> bool {
    let uid = parent.uid();
    child
        .owner_references()
        .iter()
        .any(|o| Some(&o.uid) == uid.as_ref())
}

async fn delete<K>(api: &Api<K>, kind: &str, namespace: &str, name: &str) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(error) if is_not_found(&error) => Ok(()),
        Err(e) => Err(Error::kube("delete", kind, namespace, name)(e)),
    }
}

/// Services (not flat ones) in the pod's namespace whose selector matches its labels.
fn services_selecting(services: &Store<Service>, pod: &Pod) -> Vec<ObjectRef<Service>> {
    if !is_flat_pod(pod) && !opts_out(pod) {
        return Vec::new();
    }
    let namespace = pod.namespace();
    let labels = pod.labels();
    services
        .state()
        .iter()
        .filter(|s| s.namespace() == namespace && !is_managed_by_flatnet(s))
        .filter(|s| selects(s, labels))
        .map(|s| ObjectRef::from_obj(s.as_ref()))
        .collect()
}

fn selects(service: &Service, labels: &BTreeMap<String, String>) -> bool {
    service
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .is_some_and(|sel| !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// The parent Service named by a flat EndpointSlice's label.
fn parent_of_slice(slice: &EndpointSlice) -> Option<ObjectRef<Service>> {
    let parent = slice.labels().get(label::PARENT_SERVICE)?;
    let namespace = slice.namespace()?;
    Some(ObjectRef::new(parent).within(&namespace))
}

/// Runs the controller until `stop` is cancelled; marks `health` ready once
/// the Service cache has synced.
pub async fn run(ctx: Arc<Context>, workers: u16, health: Arc<Health>, stop: CancellationToken) {
    let client = ctx.client.clone();
    let controller = cached_controller(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
        |_| {},
    );
    let store = controller.store();
    let ready_store = store.clone();
    tokio::spawn(async move {
        if crate::cache::synced(&ready_store).await {
            info!("service cache synced");
            health.set_ready(true);
        }
    });
    let sync_check = store.clone();
    let graceful_stop = stop.clone();
    let drained = controller
        .owns(
            Api::<Service>::all(client.clone()),
            watcher::Config::default().labels(&format!(
                "{}={}",
                label::MANAGED_BY,
                label::MANAGED_BY_FLATNET
            )),
        )
        .watches(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default(),
            move |pod| services_selecting(&store, &pod),
        )
        .watches(
            Api::<EndpointSlice>::all(client),
            watcher::Config::default().labels(&flat_slices_label()),
            |slice| parent_of_slice(&slice),
        )
        .with_config(controller::Config::default().concurrency(workers))
        .graceful_shutdown_on(async move { graceful_stop.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                debug!(%error, "service controller event");
            }
        });
    tokio::pin!(drained);
    tokio::select! {
        () = &mut drained => {}
        () = stop.cancelled() => {
            // Before the first sync nothing is in flight, and kube-runtime
            // would wait for that sync forever; after it, let in-flight
            // reconciles finish, within a bound.
            if crate::cache::listed(&sync_check) {
                tokio::select! {
                    () = &mut drained => {}
                    () = tokio::time::sleep(SHUTDOWN_GRACE) => {
                        warn!("reconciles still running after {SHUTDOWN_GRACE:?}; stopping anyway");
                    }
                }
            }
        }
    }
    info!("service controller stopped");
}

#[cfg(test)]
mod tests;
