//! Floating addresses of pods in Kubernetes mode: every agent follows the
//! pods the operator gave floating addresses to
//! (`flatnetwork.pandaria.io/floating-ip-assigned`) and computes, for each
//! address, the pod holding it: the set's active pod
//! ([`flatnet_k8s::floating::pods::active_pod`], the same on every node).
//! The agent of that pod's node adds the address to the pod's flat
//! interface on the pool's `targetNetworkInterface` (a second address,
//! with the pool network's prefix) and announces it from the pod's MAC
//! (gratuitous ARP / unsolicited NA, repeated); every agent removes the
//! floating addresses its pods hold but should not. The pod's own kernel
//! then answers ARP/NDP and serves the traffic, so nothing else on the
//! node changes. Failover between pods follows readiness: it takes as long
//! as the kubelet needs to report the active pod unready (its readiness
//! probe) plus one watch event; or the agents' heartbeats
//! ([`super::liveness`]): a pod whose node's agent falls silent holds
//! nothing from the heartbeat timeout on, though the API still shows it
//! ready, and a pod whose agent (re)started after another member became
//! ready does not take the address back.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use flatnet_k8s::{
    api::FloatingIPPool,
    floating::{
        pods::{ASSIGNED_SELECTOR, NodeAgent, active_pod_given, assigned_ips},
        validate_pool,
    },
};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::{
    Api, Client, Resource, ResourceExt,
    runtime::{
        events::{Event as KubeEvent, EventType},
        watcher,
    },
};
use tokio::sync::Notify;

use super::liveness::{AgentLink, Liveness};
use crate::{
    desired::AttachmentKey,
    desired::kubernetes::Mirror,
    link::{AnnounceSettings, LinkError, set_secondary_addresses},
    metrics::FloatingMetrics,
    records::{AttachmentRecord, RecordPhase, Records},
};

/// How often the addresses are checked again though nothing changed (a
/// pod interface that was not there yet, an address removed by hand).
const RECHECK_INTERVAL: Duration = Duration::from_secs(10);

/// Announcements after a pod takes an address: five rounds 250 ms apart,
/// the last past the Linux neighbour `locktime` (1 s) within which a host
/// keeps the previous MAC.
pub const ANNOUNCE: AnnounceSettings = AnnounceSettings {
    count: 5,
    interval: Duration::from_millis(250),
};

/// The pod holding a floating address.
#[derive(Clone, Debug, PartialEq)]
pub struct Holder {
    /// The pod.
    pub pod: ObjectReference,
    /// Its node.
    pub node: String,
    /// The pool's `targetNetworkInterface`: the pod interface on it
    /// gets the address.
    pub interface: String,
    /// The pool network's prefix length.
    pub prefix_len: u8,
}

impl Holder {
    /// `namespace/name` of the pod.
    pub fn pod_key(&self) -> String {
        pod_key(self.pod.namespace.as_ref(), self.pod.name.as_ref())
    }
}

/// The pods' floating addresses as every agent sees them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodView {
    /// Every pod floating address in a valid pool, with the pod holding
    /// it (`None` while no pod listing it is ready).
    pub holders: BTreeMap<IpAddr, Option<Holder>>,
    /// `namespace/name` of every pod listing an address: the only pods
    /// that may carry one.
    pub listed: BTreeSet<String>,
    /// The nodes those pods run on: the agents whose liveness counts.
    pub nodes: BTreeSet<String>,
}

/// The view of `pods` given addresses of `pools`, where `agent_of` says
/// what is known of the agent on a node.
pub fn view_of(
    pods: &[Arc<Pod>],
    pools: &[Arc<FloatingIPPool>],
    agent_of: impl Fn(&str) -> NodeAgent,
) -> PodView {
    let pools: Vec<_> = pools
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let valid = validate_pool(&p.name_any(), &p.spec).ok()?;
            Some((valid, p.spec.target_network_interface.clone()))
        })
        .collect();
    let mut members: BTreeMap<IpAddr, Vec<&Pod>> = BTreeMap::new();
    for pod in pods {
        for addr in assigned_ips(pod) {
            members.entry(addr).or_default().push(pod);
        }
    }
    let mut view = PodView::default();
    for (addr, pods) in members {
        let Some((network, interface)) = pools
            .iter()
            .find_map(|(p, i)| Some((p.network_of(addr)?, i)))
        else {
            continue;
        };
        view.listed.extend(
            pods.iter()
                .map(|p| pod_key(p.metadata.namespace.as_ref(), p.metadata.name.as_ref())),
        );
        view.nodes.extend(
            pods.iter()
                .filter_map(|p| p.spec.as_ref()?.node_name.clone()),
        );
        let holder = active_pod_given(pods, &agent_of).map(|pod| Holder {
            pod: pod.object_ref(&()),
            node: pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default(),
            interface: interface.clone(),
            prefix_len: network.cidr.prefix_len(),
        });
        view.holders.insert(addr, holder);
    }
    view
}

/// `namespace/name`.
fn pod_key(namespace: Option<&String>, name: Option<&String>) -> String {
    format!(
        "{}/{}",
        namespace.map_or("", String::as_str),
        name.map_or("", String::as_str)
    )
}

/// Whether `record` is the attachment of `holder`'s pod on its interface.
fn is_holders(record: &AttachmentRecord, holder: &Holder) -> bool {
    let pod = &record.pod;
    pod.namespace == holder.pod.namespace
        && pod.name == holder.pod.name
        && (pod.uid.is_none() || holder.pod.uid.is_none() || pod.uid == holder.pod.uid)
        && record
            .parent_link()
            .is_some_and(|p| p.ifname() == holder.interface)
}

/// What [`apply`] changed on this node.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// The address was added to the pod's interface and announced.
    Added {
        /// The address.
        addr: IpAddr,
        /// The pod.
        pod: ObjectReference,
        /// The pod's interface.
        ifname: String,
    },
    /// The address was removed from a pod's interface.
    Removed {
        /// The address.
        addr: IpAddr,
        /// The pod.
        pod: String,
    },
}

/// The floating addresses last put on each attachment, so a round
/// enters only the pod namespaces whose addresses change.
pub type Applied = BTreeMap<AttachmentKey, BTreeSet<IpAddr>>;

/// Makes the node's pod interfaces hold exactly the floating addresses
/// their pods hold: adds (and announces) the missing ones, removes the
/// others. An attachment is visited when what it should hold differs
/// from `applied`, or on a `full` round when its pod is listed for an
/// address (a standby may carry one from before a restart). With
/// `reannounce`, the addresses a pod already holds are announced again
/// (an agent heard again after a silence may have had a pod of its own
/// announce them meanwhile). A pod whose interface cannot be changed is
/// logged and visited again next round.
pub async fn apply(
    node: &str,
    records: &[AttachmentRecord],
    view: &PodView,
    applied: &mut Applied,
    full: bool,
    reannounce: bool,
    settings: AnnounceSettings,
) -> Vec<Change> {
    let mut changes = Vec::new();
    // The first record per pod and interface (a pod with two interfaces
    // on one LAN gets the address on one of them).
    let mut seen: BTreeSet<(String, Option<String>)> = BTreeSet::new();
    let ready: Vec<&AttachmentRecord> = records
        .iter()
        .filter(|r| r.phase == RecordPhase::Ready)
        .collect();
    applied.retain(|key, _| ready.iter().any(|r| r.key == *key));
    for record in ready {
        let pod = pod_key(record.pod.namespace.as_ref(), record.pod.name.as_ref());
        let parent = record.parent_link().map(|p| p.ifname());
        if !seen.insert((pod.clone(), parent)) {
            continue;
        }
        let wanted: Vec<(IpAddr, &Holder)> = view
            .holders
            .iter()
            .filter_map(|(addr, h)| Some((*addr, h.as_ref()?)))
            .filter(|(_, h)| h.node == node && is_holders(record, h))
            .collect();
        let wanted_set: BTreeSet<IpAddr> = wanted.iter().map(|(a, _)| *a).collect();
        let last = applied.get(&record.key).cloned().unwrap_or_default();
        let again = reannounce && !wanted_set.is_empty();
        if last == wanted_set && !(full && view.listed.contains(&pod)) && !again {
            continue;
        }
        match apply_one(record, &pod, &wanted, view, settings, again).await {
            Ok(mut done) => {
                applied.insert(record.key.clone(), wanted_set);
                changes.append(&mut done);
            }
            Err(error) => {
                applied.remove(&record.key);
                tracing::warn!(key = %record.key, %error, "floating addresses: cannot update the pod interface; trying again");
            }
        }
    }
    changes
}

/// [`apply`] for one attachment, in the pod's namespace.
async fn apply_one(
    record: &AttachmentRecord,
    pod: &str,
    wanted: &[(IpAddr, &Holder)],
    view: &PodView,
    settings: AnnounceSettings,
    reannounce: bool,
) -> Result<Vec<Change>, LinkError> {
    let nets: Vec<IpNet> = wanted
        .iter()
        .map(|(addr, h)| IpNet::new(*addr, h.prefix_len).unwrap_or_else(|_| IpNet::from(*addr)))
        .collect();
    let change = set_secondary_addresses(
        &record.netns,
        &record.key.ifname,
        &nets,
        |addr| view.holders.contains_key(&addr),
        settings,
        reannounce,
    )
    .await?;
    let removed = change.removed.iter().map(|net| Change::Removed {
        addr: net.addr(),
        pod: pod.to_owned(),
    });
    let added = change.added.iter().filter_map(|net| {
        let (addr, holder) = wanted.iter().find(|(a, _)| *a == net.addr())?;
        Some(Change::Added {
            addr: *addr,
            pod: holder.pod.clone(),
            ifname: record.key.ifname.clone(),
        })
    });
    Ok(removed.chain(added).collect())
}

/// The running pod-address service of a node.
pub struct PodAddresses {
    task: tokio::task::JoinHandle<()>,
}

impl PodAddresses {
    /// Starts following the pods and pools and keeping the node's pod
    /// interfaces in line; `agents` is the heartbeat loop's
    /// ([`super::kubernetes::Floating::agent_link`]): a pod whose node's
    /// agent is silent holds nothing.
    pub fn start(
        client: Client,
        node: String,
        records: Records,
        metrics: FloatingMetrics,
        agents: AgentLink,
    ) -> Self {
        Self {
            task: tokio::spawn(follow(client, node, records, metrics, agents)),
        }
    }
}

impl Drop for PodAddresses {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Follows the API objects and applies the holders whenever they change.
async fn follow(
    client: Client,
    node: String,
    records: Records,
    metrics: FloatingMetrics,
    agents: AgentLink,
) {
    let changed = Arc::new(Notify::new());
    super::wake_on_change(agents.alive.clone(), &changed);
    let mut liveness = Liveness::default();
    // Only the pods the operator gave floating addresses to (labelled):
    // the members of a set on every node, as the active pod needs them.
    let pods = Mirror::follow_selected(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().labels(ASSIGNED_SELECTOR),
        Some(Arc::clone(&changed)),
    );
    let pools = Mirror::follow_notifying(
        Api::<FloatingIPPool>::all(client.clone()),
        Some(Arc::clone(&changed)),
    );
    let recorder = super::kubernetes::recorder(client, &node);
    // Who held each address when last seen, for the Events.
    let mut previous: BTreeMap<IpAddr, Holder> = BTreeMap::new();
    let mut held: BTreeSet<IpAddr> = BTreeSet::new();
    let mut applied = Applied::new();
    let mut wake = RECHECK_INTERVAL;
    loop {
        let full = tokio::time::timeout(wake, changed.notified())
            .await
            .is_err();
        let (Some(pods), Some(pools)) = (pods.objects(), pools.objects()) else {
            wake = RECHECK_INTERVAL;
            continue;
        };
        // The nodes to hear from are those of the pods listing an address.
        let listed = view_of(&pods, &pools, |_| NodeAgent::Unknown).nodes;
        let now = Instant::now();
        agents.peers.send_if_modified(|peers| {
            let modified = *peers != listed;
            if modified {
                peers.clone_from(&listed);
            }
            modified
        });
        let alive = agents.alive.borrow().clone();
        let revived = liveness.observe(alive.as_ref(), &listed, now);
        if !liveness.settled(now) {
            // The loop has not heard its peers yet: a view without them
            // could move an address for nothing.
            wake = liveness
                .next_change(now)
                .map_or(RECHECK_INTERVAL, |at| at.saturating_duration_since(now));
            continue;
        }
        if !revived.is_empty() {
            tracing::info!(
                ?revived,
                "floating addresses: agents heard again; announcing the held addresses again"
            );
        }
        let view = view_of(&pods, &pools, |n| liveness.agent_of(n, now));
        wake = liveness.next_change(now).map_or(RECHECK_INTERVAL, |at| {
            at.saturating_duration_since(now).min(RECHECK_INTERVAL)
        });
        let all = match records.all() {
            Ok(all) => all,
            Err(error) => {
                tracing::warn!(%error, "floating addresses: cannot read the attachment records");
                continue;
            }
        };
        let reannounce = !revived.is_empty();
        for change in apply(&node, &all, &view, &mut applied, full, reannounce, ANNOUNCE).await {
            match change {
                Change::Added { addr, pod, ifname } => {
                    metrics.acquired.inc();
                    metrics.announcements.inc_by(u64::from(ANNOUNCE.count));
                    held.insert(addr);
                    let before = previous
                        .get(&addr)
                        .filter(|h| h.pod.uid != pod.uid || h.pod.name != pod.name)
                        .map(|h| format!(" (before: pod {} on node {})", h.pod_key(), h.node))
                        .unwrap_or_default();
                    let note = format!(
                        "pod {}/{} on node {node} holds {addr} on {ifname}{before}",
                        pod.namespace.as_deref().unwrap_or_default(),
                        pod.name.as_deref().unwrap_or_default(),
                    );
                    tracing::info!(%addr, %ifname, "{note}");
                    let event = KubeEvent {
                        type_: EventType::Normal,
                        reason: "FloatingIPMoved".into(),
                        note: Some(note),
                        action: "Announce".into(),
                        secondary: None,
                    };
                    if let Err(error) = recorder.publish(&event, &pod).await {
                        tracing::warn!(%addr, %error, "cannot record the FloatingIPMoved Event");
                    }
                }
                Change::Removed { addr, pod } => {
                    metrics.released.inc();
                    held.remove(&addr);
                    tracing::info!(%addr, %pod, "floating address removed from the pod");
                }
            }
        }
        metrics
            .pod_addresses
            .set(i64::try_from(held.len()).unwrap_or(i64::MAX));
        for (addr, holder) in view.holders {
            if let Some(holder) = holder {
                previous.insert(addr, holder);
            }
        }
    }
}

#[cfg(test)]
mod tests;
