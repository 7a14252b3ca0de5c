//! Kubernetes mode of the floating addresses: which addresses this node
//! may answer for, learned from watch-driven copies of the FloatingIPPools,
//! the LoadBalancer Services the operator gave addresses to, their
//! EndpointSlices and the Nodes, fed to the [`owner`] loop as its
//! [`Assignment`]; and what the loop does, turned into metrics and Events
//! on the Services.
//!
//! A node is eligible for an address when the address is in a Service's
//! `status.loadBalancer.ingress`, lies in a valid pool whose `nodeSelector`
//! (if any) matches the node, and, for `externalTrafficPolicy: Local`, the
//! Service has a ready endpoint on the node. An address shared by several
//! Services needs every one of them to be servable from the node. The loop
//! offers it only while the pool's `targetNetworkInterface` is up. The
//! peers are the other nodes a pool in use may place its addresses on, and
//! the nodes of the pods holding floating addresses
//! ([`super::liveness`]), at their `InternalIP`s.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use flatnet_k8s::{
    api::FloatingIPPool,
    events::EventRecorder,
    floating::{ValidPool, ingress_ips, validate_pool, wants_floating},
    selector::{Labels, matches},
};
use futures::future::BoxFuture;
use k8s_openapi::api::{
    core::v1::{Node, ObjectReference, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    runtime::events::{Event as KubeEvent, EventType, Reporter},
};
use tokio::sync::{Notify, watch};

use super::{
    lease::{self, LeaseLink},
    liveness::{AgentLink, AliveAgents},
    owner::{self, Assignment, Event, Settings},
};
use crate::{desired::kubernetes::Mirror, metrics::FloatingMetrics, netns::run_in_netns};

/// Label of an EndpointSlice naming its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Field manager / reporting controller of the agent's Events.
pub(crate) const REPORTER: &str = "flatnet-agent";

/// The recorder of the floating addresses' Events of `node`'s agent.
pub(crate) fn recorder(client: Client, node: &str) -> EventRecorder {
    EventRecorder::new(
        client,
        Reporter {
            controller: REPORTER.into(),
            instance: Some(node.to_owned()),
        },
    )
}

/// How long the loop waits before starting again after a failure (a
/// heartbeat port in use, the maps missing).
const RESTART_DELAY: Duration = Duration::from_secs(1);

/// How often the assignment is computed again though nothing changed
/// (an uplink program that could not be attached is retried then).
const RECHECK_INTERVAL: Duration = Duration::from_secs(10);

/// What this node may serve, and who holds each floating address.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct View {
    /// The loop's input.
    pub assignment: Assignment,
    /// Every floating address in the cluster with the Services holding it
    /// (eligible here or not): where Events about it go.
    pub holders: BTreeMap<IpAddr, Vec<ObjectReference>>,
}

/// The API objects the view is computed from.
pub struct Objects<'a> {
    /// This node's name.
    pub node: &'a str,
    /// Every Node.
    pub nodes: &'a [Arc<Node>],
    /// Every FloatingIPPool.
    pub pools: &'a [Arc<FloatingIPPool>],
    /// Every Service.
    pub services: &'a [Arc<Service>],
    /// Every EndpointSlice.
    pub slices: &'a [Arc<EndpointSlice>],
    /// Whether LoadBalancer Services without a class are served.
    pub classless: bool,
    /// The peers' heartbeat port.
    pub port: u16,
    /// The nodes of the pods holding floating addresses: peers too.
    pub pod_nodes: &'a BTreeSet<String>,
}

/// The node's labels; `None` when the node is unknown.
fn labels_of(nodes: &[Arc<Node>], name: &str) -> Option<Labels> {
    nodes
        .iter()
        .find(|n| n.name_any() == name)
        .map(|n| n.labels().clone())
}

/// Whether pool `pool` may place its addresses on a node with `labels`.
fn pool_allows(pool: &FloatingIPPool, labels: &Labels) -> bool {
    match &pool.spec.node_selector {
        None => true,
        Some(selector) => matches(selector, labels).unwrap_or_else(|error| {
            tracing::warn!(pool = %pool.name_any(), %error, "FloatingIPPool nodeSelector cannot be evaluated; no node may own its addresses");
            false
        }),
    }
}

/// Whether `service` has a ready endpoint on `node`.
fn has_local_endpoint(service: &Service, slices: &[Arc<EndpointSlice>], node: &str) -> bool {
    let namespace = service.namespace().unwrap_or_default();
    let name = service.name_any();
    slices
        .iter()
        .filter(|s| {
            s.namespace().as_deref() == Some(namespace.as_str())
                && s.labels().get(SERVICE_NAME_LABEL) == Some(&name)
        })
        .flat_map(|s| s.endpoints.iter())
        .any(|e| {
            e.node_name.as_deref() == Some(node)
                && e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true)
        })
}

/// What this node may serve, from the API objects.
pub fn view_of(objects: &Objects<'_>) -> View {
    let mut pools: Vec<(&FloatingIPPool, ValidPool)> = objects
        .pools
        .iter()
        .filter_map(|p| Some((&**p, validate_pool(&p.name_any(), &p.spec).ok()?)))
        .collect();
    pools.sort_by(|a, b| a.1.name.cmp(&b.1.name));
    let my_labels = labels_of(objects.nodes, objects.node);
    let mut view = View::default();
    // Per address: its pool, and whether every holder is servable here.
    let mut addresses: BTreeMap<IpAddr, (usize, bool)> = BTreeMap::new();
    for service in objects.services {
        if !wants_floating(service, objects.classless)
            || service.meta().deletion_timestamp.is_some()
        {
            continue;
        }
        let local = service
            .spec
            .as_ref()
            .and_then(|s| s.external_traffic_policy.as_deref())
            == Some("Local");
        for addr in ingress_ips(service) {
            let Some(pool) = pools.iter().position(|p| p.1.network_of(addr).is_some()) else {
                continue;
            };
            view.holders
                .entry(addr)
                .or_default()
                .push(service.object_ref(&()));
            let servable = my_labels
                .as_ref()
                .is_some_and(|labels| pool_allows(pools[pool].0, labels))
                && (!local || has_local_endpoint(service, objects.slices, objects.node));
            let entry = addresses.entry(addr).or_insert((pool, true));
            entry.1 &= servable;
        }
    }
    let pools_in_use: BTreeSet<usize> = addresses.values().map(|(pool, _)| *pool).collect();
    view.assignment.addresses = addresses
        .into_iter()
        .filter(|(_, (_, servable))| *servable)
        .map(|(addr, (pool, _))| (addr, pools[pool].0.spec.target_network_interface.clone()))
        .collect();
    view.assignment.peers = objects
        .nodes
        .iter()
        .filter(|n| n.name_any() != objects.node)
        .filter(|n| {
            objects.pod_nodes.contains(&n.name_any())
                || pools_in_use
                    .iter()
                    .any(|pool| pool_allows(pools[*pool].0, n.labels()))
        })
        .flat_map(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.addresses.clone())
                .unwrap_or_default()
        })
        .filter(|a| a.type_ == "InternalIP")
        .filter_map(|a| a.address.parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, objects.port))
        .collect();
    view
}

/// How the agent serves floating addresses in Kubernetes mode.
#[derive(Clone, Debug)]
pub struct Config {
    /// The loop's settings (node name, heartbeat address, pin root).
    pub settings: Settings,
    /// Whether LoadBalancer Services without a class are served
    /// (`FLATNET_FLOATING_IP_CLASSLESS`, as the operator's).
    pub classless: bool,
    /// The node's network namespace when the agent runs outside it.
    pub host_netns: Option<PathBuf>,
    /// The namespace of the address Leases ([`super::lease`]); none: no
    /// Leases, the heartbeats alone decide.
    pub lease_namespace: Option<String>,
}

/// Attaches the uplink program to an interface (once; later calls for the
/// same interface return at once).
pub type AttachUplink = Arc<dyn Fn(String) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// The running floating-address service of a node.
pub struct Floating {
    stop: Arc<AtomicBool>,
    view: watch::Receiver<View>,
    agents: AgentLink,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Floating {
    /// Starts following the API objects, the loop (on a thread of its own,
    /// in the node's namespace) and the reporting of what it does.
    pub fn start(
        client: Client,
        config: Config,
        metrics: FloatingMetrics,
        attach_uplink: AttachUplink,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (view_tx, view_rx) = watch::channel(View::default());
        let (assignment_tx, assignment_rx) = watch::channel(Assignment::default());
        let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
        let (alive_tx, alive_rx) = watch::channel(None);
        let (pod_nodes_tx, pod_nodes_rx) = watch::channel(BTreeSet::new());
        let (owned_tx, owned_rx) = watch::channel(BTreeSet::new());
        let (yielded_tx, yielded_rx) = watch::channel(BTreeMap::new());
        let mut tasks = vec![tokio::spawn(report_yields(
            client.clone(),
            config.settings.node.clone(),
            view_rx.clone(),
            yielded_rx.clone(),
            config.settings.bind.port(),
        ))];
        let follow = tokio::spawn(follow(
            client.clone(),
            config.clone(),
            attach_uplink,
            pod_nodes_rx,
            yielded_rx,
            view_tx,
            assignment_tx,
        ));
        if let Some(namespace) = config.lease_namespace.clone() {
            tasks.push(tokio::spawn(lease::run(
                client.clone(),
                namespace,
                config.settings.node.clone(),
                LeaseLink {
                    owned: owned_rx,
                    alive: alive_rx.clone(),
                    yielded: yielded_tx,
                },
            )));
        }
        let report = tokio::spawn(report(
            client,
            config.settings.node.clone(),
            view_rx.clone(),
            metrics,
            events_rx,
            alive_tx,
            owned_tx,
        ));
        let loop_stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("floating".into())
            .spawn(move || {
                let work = || {
                    while !loop_stop.load(Ordering::Relaxed) {
                        let sent = events_tx.clone();
                        let result = owner::run(&config.settings, &assignment_rx, &loop_stop, |e| {
                            let _ = sent.send(e);
                        });
                        if let Err(error) = result {
                            tracing::error!(%error, "floating addresses: the loop failed; starting it again");
                            std::thread::sleep(RESTART_DELAY);
                        }
                    }
                };
                match &config.host_netns {
                    Some(netns) => {
                        if let Err(error) = run_in_netns(netns, work) {
                            tracing::error!(%error, "floating addresses: cannot enter the node's namespace");
                        }
                    }
                    None => work(),
                }
            })
            .expect("spawn the floating-address thread");
        Self {
            stop,
            view: view_rx,
            agents: AgentLink {
                alive: alive_rx,
                peers: Arc::new(pod_nodes_tx),
            },
            tasks: {
                tasks.extend([follow, report]);
                tasks
            },
        }
    }

    /// The link for [`super::pods::PodAddresses`]: the agents the loop
    /// hears, and where the pods' nodes are listed as peers.
    pub fn agent_link(&self) -> AgentLink {
        self.agents.clone()
    }

    /// What this node may serve now.
    pub fn view(&self) -> View {
        self.view.borrow().clone()
    }

    /// Stops the loop where it is, leaving its responder entries to run
    /// out as after a SIGKILL, and stops following the API.
    pub fn abandon(&self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Drop for Floating {
    fn drop(&mut self) {
        self.abandon();
    }
}

/// Follows the API objects and publishes the view and the loop's
/// assignment whenever they change.
async fn follow(
    client: Client,
    config: Config,
    attach_uplink: AttachUplink,
    mut pod_nodes: watch::Receiver<BTreeSet<String>>,
    mut yielded: watch::Receiver<BTreeMap<IpAddr, String>>,
    view_tx: watch::Sender<View>,
    assignment_tx: watch::Sender<Assignment>,
) {
    let changed = Arc::new(Notify::new());
    super::wake_on_change(pod_nodes.clone(), &changed);
    super::wake_on_change(yielded.clone(), &changed);
    let notify = || Some(Arc::clone(&changed));
    let nodes = Mirror::follow_notifying(Api::<Node>::all(client.clone()), notify());
    let pools = Mirror::follow_notifying(Api::<FloatingIPPool>::all(client.clone()), notify());
    let services = Mirror::follow_notifying(Api::<Service>::all(client.clone()), notify());
    let slices = Mirror::follow_notifying(Api::<EndpointSlice>::all(client), notify());
    let mut attached: BTreeSet<String> = BTreeSet::new();
    loop {
        let _ = tokio::time::timeout(RECHECK_INTERVAL, changed.notified()).await;
        let (Some(nodes), Some(pools), Some(services), Some(slices)) = (
            nodes.objects(),
            pools.objects(),
            services.objects(),
            slices.objects(),
        ) else {
            continue;
        };
        let pod_nodes = pod_nodes.borrow_and_update().clone();
        let mut view = view_of(&Objects {
            node: &config.settings.node,
            nodes: &nodes,
            pools: &pools,
            services: &services,
            slices: &slices,
            classless: config.classless,
            port: config.settings.bind.port(),
            pod_nodes: &pod_nodes,
        });
        let interfaces: BTreeSet<String> = view.assignment.addresses.values().cloned().collect();
        for interface in interfaces.difference(&attached.clone()) {
            match attach_uplink(interface.clone()).await {
                Ok(()) => {
                    attached.insert(interface.clone());
                }
                Err(error) => {
                    tracing::warn!(%interface, %error, "floating addresses: cannot attach the uplink program; not offering the addresses of this interface");
                }
            }
        }
        view.assignment
            .addresses
            .retain(|_, interface| attached.contains(interface));
        view.assignment.yielded = yielded.borrow_and_update().keys().copied().collect();
        assignment_tx.send_if_modified(|current| {
            let modified = *current != view.assignment;
            if modified {
                tracing::info!(addresses = ?view.assignment.addresses, peers = view.assignment.peers.len(), "floating addresses this node may serve");
                current.clone_from(&view.assignment);
            }
            modified
        });
        view_tx.send_if_modified(|current| {
            let modified = *current != view;
            if modified {
                *current = view;
            }
            modified
        });
    }
}

/// Counts what the loop does and tells the Services holding an address
/// when this node starts answering for it.
async fn report(
    client: Client,
    node: String,
    view: watch::Receiver<View>,
    metrics: FloatingMetrics,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    alive: watch::Sender<Option<AliveAgents>>,
    owned_tx: watch::Sender<BTreeSet<IpAddr>>,
) {
    let recorder = recorder(client, &node);
    let mut owned: BTreeSet<IpAddr> = BTreeSet::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Acquired {
                addr,
                interface,
                previous,
                ..
            } => {
                metrics.acquired.inc();
                owned.insert(addr);
                owned_tx.send_replace(owned.clone());
                // Before the Events, whose API calls take a while.
                set_owned(&metrics, &owned);
                tracing::info!(%addr, %interface, "floating address acquired");
                let holders = view
                    .borrow()
                    .holders
                    .get(&addr)
                    .cloned()
                    .unwrap_or_default();
                let before = previous
                    .map(|p| format!(" (before: node {p})"))
                    .unwrap_or_default();
                let note = format!("node {node} answers for {addr} on {interface}{before}");
                for service in holders {
                    let event = KubeEvent {
                        type_: EventType::Normal,
                        reason: "FloatingIPMoved".into(),
                        note: Some(note.clone()),
                        action: "Announce".into(),
                        secondary: None,
                    };
                    if let Err(error) = recorder.publish(&event, &service).await {
                        tracing::warn!(%addr, %error, "cannot record the FloatingIPMoved Event");
                    }
                }
            }
            Event::Released { addr } => {
                metrics.released.inc();
                owned.remove(&addr);
                owned_tx.send_replace(owned.clone());
                set_owned(&metrics, &owned);
                tracing::info!(%addr, "floating address released");
            }
            Event::Announced {
                unicast_replies, ..
            } => {
                metrics.announcements.inc();
                metrics
                    .unicast_replies
                    .inc_by(u64::try_from(unicast_replies).unwrap_or(u64::MAX));
            }
            Event::Agents { alive: agents } => {
                alive.send_replace(Some(agents));
            }
            Event::Renewed { .. } => {}
        }
    }
}

/// Tells the Services holding an address when this node yields it to a
/// node it does not hear (a Warning `FloatingIPSplitBrain`): the
/// heartbeats between the two are lost, which only the operator can fix.
async fn report_yields(
    client: Client,
    node: String,
    view: watch::Receiver<View>,
    mut yielded: watch::Receiver<BTreeMap<IpAddr, String>>,
    port: u16,
) {
    let recorder = recorder(client, &node);
    let mut told: BTreeMap<IpAddr, String> = BTreeMap::new();
    while yielded.changed().await.is_ok() {
        let now = yielded.borrow_and_update().clone();
        for (addr, to) in &now {
            if told.get(addr) == Some(to) {
                continue;
            }
            let note = format!(
                "node {node} stops answering for {addr}: node {to}, whose heartbeats it does not receive, claimed it last; check that the nodes reach each other on UDP port {port} at their InternalIPs"
            );
            let holders = view.borrow().holders.get(addr).cloned().unwrap_or_default();
            for service in holders {
                let event = KubeEvent {
                    type_: EventType::Warning,
                    reason: "FloatingIPSplitBrain".into(),
                    note: Some(note.clone()),
                    action: "Withdraw".into(),
                    secondary: None,
                };
                if let Err(error) = recorder.publish(&event, &service).await {
                    tracing::warn!(%addr, %error, "cannot record the FloatingIPSplitBrain Event");
                }
            }
        }
        told = now;
    }
}

fn set_owned(metrics: &FloatingMetrics, owned: &BTreeSet<IpAddr>) {
    metrics
        .owned
        .set(i64::try_from(owned.len()).unwrap_or(i64::MAX));
}

#[cfg(test)]
mod tests;
