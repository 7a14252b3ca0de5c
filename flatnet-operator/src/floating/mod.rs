//! Floating addresses for LoadBalancer Services (see `docs/floating-ips.md`).
//!
//! - [`services`]: a Service of flatnet's `loadBalancerClass` (or of no
//!   class, when enabled) gets an address per family from a
//!   FloatingIPPool, written to `status.loadBalancer.ingress`, and gives it
//!   back when it goes or stops asking;
//! - [`ledger`]: the pool's `status.usedIP`, written with the
//!   resourceVersion it was read at, as subnets' are (`docs/ipam.md`);
//! - [`pools`]: pool status (usage, conditions), the repair of the ledger
//!   and the `network-interface-mappings` ConfigMap;
//! - [`pods`]: a pod asking for an address (alone, or shared by an
//!   active/standby set) gets one per family, written to an annotation;
//! - [`quotas`]: FloatingIPProjectQuota usage, shared by the webhook.
//!
//! Only the leader runs them.

pub mod ledger;
pub mod pods;
pub mod pools;
pub mod quotas;
pub mod services;

use std::{sync::Arc, time::Duration};

use flatnet_k8s::{
    api::{FloatingIPPool, FloatingIPProjectQuota},
    floating::{InvalidPool, QuotaSpecError, RequestError, ValidPool, validate_pool},
    ipam::PoolError,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::jiff::Timestamp;
use kube::{
    Api, Client, ResourceExt,
    runtime::{controller, reflector::ObjectRef, reflector::Store, watcher},
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{
    allocation::{events::Events, subnets::OrphanClock},
    cache::cached_controller,
    controller::{ApiError, Backoff},
    metrics::Metrics,
};

/// Settings of the floating-address controllers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Also serve LoadBalancer Services that name no `loadBalancerClass`.
    pub classless: bool,
    /// Namespace of the `network-interface-mappings` ConfigMap.
    pub namespace: String,
    /// How long the pool repair keeps a ledger address no Service names (a
    /// reservation whose Service write is in flight).
    pub orphan_grace: Duration,
    /// Period of the full re-reconcile.
    pub resync: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            classless: false,
            namespace: "cattle-flat-network".into(),
            orphan_grace: Duration::from_secs(60),
            resync: Duration::from_secs(10 * 60),
        }
    }
}

/// The caches the controllers read.
#[derive(Clone)]
pub struct Caches {
    /// Every Service.
    pub services: Store<Service>,
    /// Every FloatingIPPool.
    pub pools: Store<FloatingIPPool>,
    /// Every FloatingIPProjectQuota.
    pub quotas: Store<FloatingIPProjectQuota>,
    /// Every namespace (labels: projects, pool namespace selectors).
    pub namespaces: Store<Namespace>,
    /// Every pod (those asking for floating addresses are reconciled).
    pub pods: Store<Pod>,
}

impl Caches {
    /// Every valid pool that may allocate, by name: a pool sharing
    /// addresses with an older one (creation time, then name) is left out.
    pub fn valid_pools(&self) -> Vec<ValidPool> {
        let mut pools: Vec<(Option<Timestamp>, ValidPool)> = self
            .pools
            .state()
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| {
                let created = p.metadata.creation_timestamp.as_ref().map(|t| t.0);
                Some((created, validate_pool(&p.name_any(), &p.spec).ok()?))
            })
            .collect();
        pools.sort_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
        let mut kept: Vec<ValidPool> = Vec::new();
        for (_, pool) in pools {
            if !kept.iter().any(|k| k.overlaps(&pool)) {
                kept.push(pool);
            }
        }
        kept.sort_by(|a, b| a.name.cmp(&b.name));
        kept
    }
}

/// What the reconcilers share.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Event publisher.
    pub events: Events,
    /// Informer caches.
    pub caches: Caches,
    /// Settings.
    pub settings: Settings,
    /// Per-object retry state.
    pub backoff: Backoff,
    /// When the pool repair first saw each unclaimed ledger address.
    pub orphans: OrphanClock,
}

/// A reconcile failure; what a user causes names the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error(transparent)]
    Kube(#[from] ApiError),
    /// The Service's annotations or fields cannot be read.
    #[error("Service {service}: {source}")]
    Request {
        /// `namespace/name`.
        service: String,
        /// What is wrong.
        #[source]
        source: RequestError,
    },
    /// A pod's annotations cannot be read.
    #[error("Pod {pod}: {source}")]
    PodRequest {
        /// `namespace/name`.
        pod: String,
        /// What is wrong.
        #[source]
        source: RequestError,
    },
    /// No pool may serve the pod.
    #[error(
        "Pod {pod}: no FloatingIPPool {detail}: create one, or fix the flatnetwork.pandaria.io/floating-ip-pool or flatnetwork.pandaria.io/floating-ip annotation"
    )]
    NoPodPool {
        /// `namespace/name`.
        pod: String,
        /// Which pool was looked for.
        detail: String,
    },
    /// No pool may serve the Service.
    #[error(
        "Service {service}: no FloatingIPPool {detail}: create one, or fix the flatnetwork.pandaria.io/floating-ip-pool annotation"
    )]
    NoPool {
        /// `namespace/name`.
        service: String,
        /// Which pool was looked for.
        detail: String,
    },
    /// The pool is invalid.
    #[error(transparent)]
    InvalidPool(#[from] InvalidPool),
    /// Nothing left, or the fixed address is taken or outside the pool.
    #[error("FloatingIPPool {pool}: {source}")]
    Pool {
        /// The pool.
        pool: String,
        /// Why.
        #[source]
        source: PoolError,
    },
    /// Two Services with one sharing key expose the same port.
    #[error(
        "Service {service}: shares key {key:?} with Service {other}, which exposes {protocol}/{port} too: use another port or another sharing key"
    )]
    PortClash {
        /// `namespace/name`.
        service: String,
        /// The sharing key.
        key: String,
        /// The other Service.
        other: String,
        /// Protocol of the clashing port.
        protocol: String,
        /// The clashing port.
        port: i32,
    },
    /// Another address would exceed a quota.
    #[error(transparent)]
    Quota(#[from] quotas::QuotaExceeded),
    /// A quota's spec is invalid.
    #[error(transparent)]
    QuotaSpec(#[from] QuotaSpecError),
    /// Too many conflicting writes in a row.
    #[error("FloatingIPPool {pool}: {attempts} conflicting ledger writes in a row; retrying")]
    Contention {
        /// The pool.
        pool: String,
        /// Attempts made.
        attempts: u32,
    },
}

impl Error {
    /// Whether a user must act (an Event says so) rather than a retry.
    #[must_use]
    pub fn needs_user(&self) -> bool {
        !matches!(self, Self::Kube(_) | Self::Contention { .. })
    }
}

/// Name of the Service controller in logs and metrics.
pub const CONTROLLER: &str = "floating-ip";

/// Runs the Service, pool and quota controllers until `stop` is cancelled.
pub async fn run(
    client: Client,
    metrics: Arc<Metrics>,
    settings: Settings,
    workers: u16,
    stop: CancellationToken,
) {
    let wc = watcher::Config::default;
    let services_ctl = cached_controller(Api::<Service>::all(client.clone()), wc(), |_| {});
    let pools_ctl = cached_controller(Api::<FloatingIPPool>::all(client.clone()), wc(), |_| {});
    let pods_ctl = cached_controller(Api::<Pod>::all(client.clone()), wc(), |_| {});
    let quotas_ctl = cached_controller(
        Api::<FloatingIPProjectQuota>::all(client.clone()),
        wc(),
        |_| {},
    );
    let (namespaces, namespaces_writer) = kube::runtime::reflector::store();
    let namespaces_reflector = kube::runtime::reflector(
        namespaces_writer,
        watcher(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .for_each(|_| async {});
    let caches = Caches {
        services: services_ctl.store(),
        pools: pools_ctl.store(),
        quotas: quotas_ctl.store(),
        namespaces,
        pods: pods_ctl.store(),
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        metrics,
        events: Events::new(client.clone()),
        caches: caches.clone(),
        settings,
        backoff: Backoff::default(),
        orphans: OrphanClock::default(),
    });
    let config = controller::Config::default().concurrency(workers);
    let graceful = |stop: CancellationToken| async move { stop.cancelled().await };
    let services = services_ctl
        .with_config(config.clone())
        .graceful_shutdown_on(graceful(stop.clone()))
        .run(
            services::reconcile,
            services::error_policy,
            Arc::clone(&ctx),
        )
        .for_each(|r| log_result(CONTROLLER, r));
    let pods = pods_ctl
        .with_config(config.clone())
        .graceful_shutdown_on(graceful(stop.clone()))
        .run(pods::reconcile, pods::error_policy, Arc::clone(&ctx))
        .for_each(|r| log_result(pods::CONTROLLER, r));
    // A Service's addresses change a pool's usage and a quota's: look at
    // every pool and quota again (there are few of them).
    let pool_store = caches.pools.clone();
    let pool_store_pods = caches.pools.clone();
    let pools = pools_ctl
        .watches(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
            move |_| {
                pool_store
                    .state()
                    .iter()
                    .map(|p| ObjectRef::from_obj(&**p))
                    .collect::<Vec<_>>()
            },
        )
        // A pod holding an address that goes leaves it to the repair.
        .watches(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default(),
            move |pod| {
                if pod_addresses_any(&pod) {
                    pool_store_pods
                        .state()
                        .iter()
                        .map(|p| ObjectRef::from_obj(&**p))
                        .collect::<Vec<_>>()
                } else {
                    Vec::new()
                }
            },
        )
        .with_config(config.clone())
        .graceful_shutdown_on(graceful(stop.clone()))
        .run(pools::reconcile, pools::error_policy, Arc::clone(&ctx))
        .for_each(|r| log_result(pools::CONTROLLER, r));
    let quota_store = caches.quotas.clone();
    let quota_store_pods = caches.quotas.clone();
    let quotas = quotas_ctl
        .watches(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
            move |service| {
                let namespace = service.namespace().unwrap_or_default();
                quota_store
                    .state()
                    .iter()
                    .filter(|q| q.spec.namespace == namespace || !q.spec.project.is_empty())
                    .map(|q| ObjectRef::from_obj(&**q))
                    .collect::<Vec<_>>()
            },
        )
        .watches(
            Api::<Pod>::all(client),
            watcher::Config::default(),
            move |pod| {
                let namespace = pod.namespace().unwrap_or_default();
                quota_store_pods
                    .state()
                    .iter()
                    .filter(|_| pod_addresses_any(&pod))
                    .filter(|q| q.spec.namespace == namespace || !q.spec.project.is_empty())
                    .map(|q| ObjectRef::from_obj(&**q))
                    .collect::<Vec<_>>()
            },
        )
        .with_config(config)
        .graceful_shutdown_on(graceful(stop.clone()))
        .run(quotas::reconcile, quotas::error_policy, Arc::clone(&ctx))
        .for_each(|r| log_result(quotas::CONTROLLER, r));
    let all = futures::future::join4(services, pods, pools, quotas);
    tokio::select! {
        _ = all => {}
        () = namespaces_reflector => warn!("namespace watch ended"),
        () = stop.cancelled() => {}
    }
}

/// Whether `pod` was given floating addresses (its changes matter to the
/// pools' ledgers and the quotas' usage).
fn pod_addresses_any(pod: &Pod) -> bool {
    !flatnet_k8s::floating::pods::assigned_ips(pod).is_empty()
}

async fn log_result<T: std::fmt::Debug, E: std::fmt::Display>(
    controller: &'static str,
    result: Result<T, E>,
) {
    if let Err(error) = result {
        debug!(controller, %error, "controller event");
    }
}

#[cfg(test)]
mod tests;
