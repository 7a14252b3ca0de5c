//! The allocation controllers: flat-network addresses for pods.
//!
//! - [`pods`]: every flat pod gets its FlatNetworkIP record(s) and, once
//!   the node has set it up, its `selectedIP`/`selectedMac` labels.
//! - [`ips`]: allocates an address for each record, releases it when the
//!   record goes, collects records of vanished pods and fails records whose
//!   pod is never set up.
//! - [`subnets`]: validates subnets, keeps their status (the address view)
//!   in line with the records, and blocks deleting a subnet in use.
//! - [`nodes`]: releases the addresses of pods whose node was deleted and
//!   did not come back.
//! - [`commit`]: the protocol that makes an allocation durable and unique
//!   (see `docs/ipam.md`, "Committing an allocation"), with
//!   [`group_commit`] batching the ledger writes of a subnet and
//!   [`mac_ledger`] for the MACs (fixed, or from the [`mac_pool`]) shared
//!   by sibling subnets.
//! - [`wire_exclusion`]: addresses hosts outside flatnet use on the LAN
//!   stay out of the pool, and released addresses are reused last.
//! - [`wire_release`]: an address no record names is freed before the
//!   orphan grace when every node vouches that it saw no claim on it.
//! - [`slim`]: what the caches keep of each object.
//!
//! Only the leader runs them; they share one [`Context`].

pub mod commit;
mod errors;
pub mod events;
#[cfg(any(test, feature = "fake-api"))]
pub mod fake_api;
#[cfg(feature = "fake-api")]
pub mod fake_api_http;
#[cfg(any(test, feature = "fake-api"))]
pub mod fake_cluster;
pub mod group_commit;
pub mod ips;
pub mod mac_ahead;
pub mod mac_ledger;
pub mod mac_pool;
pub mod nodes;
pub mod pods;
pub mod records;
mod slim;
pub use self::slim::{CachedPod, CachedPodSpec};
pub mod subnets;
pub mod wire_exclusion;
pub mod wire_release;

use std::{sync::Arc, time::Duration};

use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet, FlatNetworkWireClaims},
    ipam::StatefulSetAddressPolicy,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::{
    Api, Client,
    api::PartialObjectMeta,
    runtime::{
        controller,
        reflector::{ObjectRef, Store},
        watcher,
    },
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use self::errors::Error;
use self::events::Events;
pub use crate::controller::Backoff;
use crate::{
    admin::Health,
    cache::{self, cached_controller},
    metrics::Metrics,
};

/// Settings of the allocation controllers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Whether StatefulSet pods keep their address across restarts.
    pub statefulset_policy: StatefulSetAddressPolicy,
    /// How long an allocated address may wait for the node to set the pod up.
    pub pending_timeout: Duration,
    /// Period of the full re-reconcile.
    pub resync: Duration,
    /// How long the subnet repair keeps an address that `usedIP` holds and
    /// no record names (an allocation between its two writes). Must be
    /// longer than [`Settings::write_deadline`] plus the longest an API
    /// request can take.
    pub orphan_grace: Duration,
    /// How long after reserving an address the record may still be
    /// written; later the allocation is abandoned (see `docs/ipam.md`).
    pub write_deadline: Duration,
    /// How long a pod's node may be missing before the pod's records give
    /// their address back (a node object recreated sooner, such as a
    /// kubelet re-registering, keeps them).
    pub node_gone_grace: Duration,
    /// Most announced records a ledger write reserves an address for ahead
    /// of their allocation (see `docs/ipam.md`, "Reserving ahead"); 0 turns
    /// it off. An address held for a record that goes first is given back
    /// with its deletion; one nobody takes, by a timer after the write
    /// deadline.
    pub reserve_ahead: usize,
    /// How long an address a foreign MAC claimed on the LAN stays out of
    /// the pool (see [`wire_exclusion`]).
    pub wire_window: Duration,
    /// How long an address the ledger holds and no record names is kept
    /// at least when every node reported, since, that it saw no claim on
    /// it (see [`wire_release`]); longer than
    /// [`Settings::write_deadline`] plus a request's lifetime on the API
    /// server, and shorter than [`Settings::orphan_grace`].
    pub wire_orphan_grace: Duration,
    /// The flat network's NetworkAttachmentDefinition name, whose Multus
    /// selection element may ask for a MAC (`mac`).
    pub attachment: String,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            statefulset_policy: StatefulSetAddressPolicy::Sticky,
            pending_timeout: Duration::from_secs(5 * 60),
            resync: Duration::from_secs(10 * 60),
            orphan_grace: Duration::from_secs(10 * 60),
            write_deadline: Duration::from_secs(30),
            node_gone_grace: Duration::from_secs(5 * 60),
            reserve_ahead: 128,
            wire_window: flatnet_k8s::ipam::DEFAULT_WIRE_WINDOW,
            wire_orphan_grace: wire_release::DEFAULT_WIRE_ORPHAN_GRACE,
            attachment: flatnet_k8s::keys::NAD_NAME.to_owned(),
        }
    }
}

/// The caches the controllers read.
#[derive(Clone)]
pub struct Caches {
    /// Every FlatNetworkIP.
    pub records: Store<FlatNetworkIP>,
    /// Every FlatNetworkSubnet.
    pub subnets: Store<FlatNetworkSubnet>,
    /// Every pod, as [`slim::pod`] leaves it (metadata and `spec.nodeName`).
    pub pods: Store<CachedPod>,
    /// Every namespace (for the Rancher project label).
    pub namespaces: Store<Namespace>,
    /// Every node (metadata only: whether it exists).
    pub nodes: Store<PartialObjectMeta<Node>>,
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
    /// Per-object retry state for backoff.
    pub backoff: Backoff,
    /// When the subnet repair first saw each unclaimed `usedIP` interval or
    /// `usedMac` entry.
    pub orphans: subnets::OrphanClock,
    /// Since when each missing node has been seen missing.
    pub nodes: Arc<nodes::NodeClock>,
    /// The in-memory ledger of each subnet, for group commits.
    pub ledgers: group_commit::Ledgers,
    /// Pods whose record was seen going: no new record for them.
    pub departed: Arc<pods::Marks>,
    /// Records the pod controller created and may not see cached yet.
    pub created: pods::Marks,
    /// The addresses live on the wire, per subnet.
    pub wire: wire_exclusion::WireView,
    /// The MAC pool, as the FlatNetworkConfig sets it now.
    pub mac_pool: mac_pool::MacPoolView,
}

/// `namespace/name` of an object, for logs and keys.
/// The workload `pod` belongs to (see [`crate::workloads::owner`]).
///
/// # Errors
/// Reading the pod's ReplicaSet or Job failed.
pub(crate) async fn pod_workload(
    pod: &CachedPod,
    ctx: &Context,
) -> Result<crate::workloads::owner::WorkloadRef, Error> {
    use kube::ResourceExt;
    let namespace = pod.namespace().unwrap_or_default();
    crate::workloads::owner::workload_of(
        &ctx.client,
        "Pod",
        &namespace,
        &pod.name_any(),
        pod.owner_references(),
    )
    .await
    .map_err(|error| {
        Error::kube(
            "get",
            &error.kind,
            &key_of(Some(&error.namespace), &error.name),
        )(*error.source)
    })
}

pub(crate) fn key_of(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    }
}

/// Longest wait for in-flight reconciles at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// Runs the three controllers until `stop` is cancelled; marks `health`
/// ready once every cache has synced. `mac_pool` is the MAC pool as the
/// FlatNetworkConfig watch keeps it.
pub async fn run(
    client: Client,
    metrics: Arc<Metrics>,
    settings: Settings,
    workers: u16,
    mac_pool: mac_pool::MacPoolView,
    health: Arc<Health>,
    stop: CancellationToken,
) {
    let pods_ctl = cached_controller(
        Api::<CachedPod>::all(client.clone()),
        watcher::Config::default(),
        slim::pod,
    );
    // Marked before the cache drops the record, so the pod controller
    // never finds a record gone without its pod marked departed.
    let departed = Arc::new(pods::Marks::departed());
    let ips_ctl = cached_controller(
        Api::<FlatNetworkIP>::all(client.clone()),
        watcher::Config::default(),
        {
            let departed = Arc::clone(&departed);
            move |record: &mut FlatNetworkIP| {
                if record.metadata.deletion_timestamp.is_some() {
                    departed.saw(&record.spec.pod_id);
                }
                slim::metadata(record);
            }
        },
    );
    let subnets_ctl = cached_controller(
        Api::<FlatNetworkSubnet>::all(client.clone()),
        watcher::Config::default(),
        slim::metadata,
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
    let (nodes, nodes_writer) = kube::runtime::reflector::store();
    let node_clock = Arc::new(nodes::NodeClock::default());
    let node_events = nodes::node_events(
        Api::<PartialObjectMeta<Node>>::all(client.clone()),
        nodes_writer,
        Arc::clone(&node_clock),
    );
    let (wire, wire_reports) =
        wire_exclusion::WireView::watch(client.clone(), settings.wire_window);
    let caches = Caches {
        records: ips_ctl.store(),
        subnets: subnets_ctl.store(),
        pods: pods_ctl.store(),
        namespaces,
        nodes,
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        metrics,
        events: Events::new(client.clone()),
        caches: caches.clone(),
        settings,
        backoff: Backoff::default(),
        orphans: subnets::OrphanClock::default(),
        nodes: node_clock,
        ledgers: group_commit::Ledgers::default(),
        departed,
        created: pods::Marks::created(),
        wire,
        mac_pool,
    });
    {
        let caches = caches.clone();
        tokio::spawn(async move {
            let synced = cache::synced(&caches.records).await
                && cache::synced(&caches.subnets).await
                && cache::synced(&caches.pods).await
                && cache::synced(&caches.namespaces).await
                && cache::synced(&caches.nodes).await;
            if synced {
                info!("allocation caches synced");
                health.set_ready(true);
            }
        });
    }
    tokio::spawn(give_back_held(Arc::clone(&ctx), stop.clone()));
    let config = controller::Config::default().concurrency(workers);
    let graceful = |stop: CancellationToken| async move { stop.cancelled().await };

    let pods = pods_ctl
        .watches(
            Api::<FlatNetworkIP>::all(client.clone()),
            watcher::Config::default(),
            |record| {
                let ns = kube::ResourceExt::namespace(&record)?;
                Some(ObjectRef::<CachedPod>::new(&record.pod_name()).within(&ns))
            },
        )
        .with_config(config.clone())
        .graceful_shutdown_on(graceful(stop.clone()))
        .run(pods::reconcile, pods::error_policy, Arc::clone(&ctx))
        .for_each(|r| log_result(pods::CONTROLLER, r));
    let ips = ips_ctl
        // A node deleted (or back): look at every record again.
        .reconcile_all_on(node_events)
        .with_config(config.clone())
        .graceful_shutdown_on(graceful(stop.clone()))
        .run(ips::reconcile, ips::error_policy, Arc::clone(&ctx))
        .for_each(|r| log_result(ips::CONTROLLER, r));
    let subnets = subnets_ctl
        // New wire claims change how many addresses are excluded.
        .watches(
            Api::<FlatNetworkWireClaims>::namespaced(
                client.clone(),
                flatnet_k8s::keys::SUBNET_NAMESPACE,
            ),
            watcher::Config::default(),
            |report| {
                Some(
                    ObjectRef::<FlatNetworkSubnet>::new(&report.spec.subnet)
                        .within(flatnet_k8s::keys::SUBNET_NAMESPACE),
                )
            },
        )
        .watches(
            Api::<FlatNetworkIP>::all(client),
            watcher::Config::default(),
            |record| {
                Some(
                    ObjectRef::<FlatNetworkSubnet>::new(&record.spec.subnet)
                        .within(flatnet_k8s::keys::SUBNET_NAMESPACE),
                )
            },
        )
        .with_config(config)
        .graceful_shutdown_on(graceful(stop.clone()))
        .run(subnets::reconcile, subnets::error_policy, Arc::clone(&ctx))
        .for_each(|r| log_result(subnets::CONTROLLER, r));

    let all = futures::future::join3(pods, ips, subnets);
    tokio::pin!(all);
    tokio::pin!(namespaces_reflector);
    // Without the reports (their CRD not installed yet) nothing is excluded.
    let wire_reports = wire_reports.for_each(|()| async {});
    tokio::pin!(wire_reports);
    tokio::select! {
        _ = &mut all => {}
        () = &mut namespaces_reflector => warn!("namespace watch ended"),
        () = &mut wire_reports => warn!("wire claims watch ended"),
        () = stop.cancelled() => {
            // Before the first sync nothing is in flight (and kube-runtime
            // would wait for the sync forever); after it, let in-flight
            // reconciles finish, within a bound.
            if cache::listed(&caches.records) {
                tokio::select! {
                    _ = &mut all => {}
                    () = tokio::time::sleep(SHUTDOWN_GRACE) => {
                        warn!("allocation reconciles still running after {SHUTDOWN_GRACE:?}; stopping anyway");
                    }
                }
            }
        }
    }
    info!("allocation controllers stopped");
}

/// Gives back the addresses reserved ahead that nobody took, and writes
/// the releases whose ledger write failed, every half write deadline,
/// until `stop`.
async fn give_back_held(ctx: Arc<Context>, stop: CancellationToken) {
    let period = (ctx.settings.write_deadline / 2).max(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(period) => ctx.ledgers.give_back_expired(&ctx).await,
        }
    }
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
mod cluster_tests;
#[cfg(test)]
pub(crate) mod tests;
