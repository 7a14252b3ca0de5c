//! The PodNetworkConfig controller: from the configurations to the
//! FlatNetworkIPs of hot-plugged interfaces, which are the per-pod desired
//! state the node agents follow, and back from those records (their phase
//! and the agents' `Attached` condition) to each configuration's status
//! and to Events on the pods.
//!
//! Why the desired state is the FlatNetworkIP: every hot-plugged interface
//! needs one anyway (its address comes through the normal allocation
//! path), and every agent already keeps a watch-driven copy of all
//! FlatNetworkIPs. A record labelled with the interface
//! ([`label::HOTPLUG_INTERFACE`]) and the pod's node, owned by the pod, is
//! the whole request: no further object, watch or write per pod.
//!
//! The primary interface's MTU has no address and so no FlatNetworkIP:
//! it goes to the pod's node in that node's `FlatNetworkNodeConfig`
//! (`spec.pods`, one entry per running pod asking), whose status the
//! node's agent writes and this controller reads back the same way.
//!
//! Each pass plans from watch-driven copies ([`plan_namespace`], a pure
//! function) and writes only the differences; passes run shortly after any
//! change of the kinds read (debounced) and at a fixed resync interval.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use flatnet_k8s::{
    api::{
        CONDITION_ATTACHED, CONDITION_READY, FlatNetworkIP, FlatNetworkIPSpec,
        FlatNetworkNodeConfig, FlatNetworkNodeConfigSpec, FlatNetworkSubnet, NodeBridge, NodeVlan,
        PodFailure, PodNetworkConfig, PodNetworkConfigStatus, PodPrimaryMtu, PrimaryMtuResult,
        phase, set_condition,
    },
    keys::{SUBNET_NAMESPACE, annotation, hotplug_record_name, label},
    multus::{HotplugStatus, with_hotplug_entries},
    selector::Labels,
};
use futures::{Stream, StreamExt};
use k8s_openapi::{
    api::core::v1::{Namespace, Pod},
    apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde_json::json;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::desired::{PodDesired, PodView, WantedAttachment, desired_for_pod};
use crate::{
    allocation::{
        events::Events,
        records::{FINALIZER, pod_owner},
    },
    cache,
};

/// Field manager of the controller's writes.
pub const FIELD_MANAGER: &str = "flatnet-operator-pod-network-config";

/// At most this many pods are listed in `status.failed` (the count is
/// always complete): the status stays small on large namespaces.
pub const MAX_FAILED_LISTED: usize = 50;

/// Event reasons on pods.
pub mod reason {
    /// An interface a PodNetworkConfig asks for is in the running pod.
    pub const HOTPLUGGED: &str = "InterfaceHotplugged";
    /// It could not be added; the note says why.
    pub const HOTPLUG_FAILED: &str = "InterfaceHotplugFailed";
    /// No configuration asks for it any more: it is being removed.
    pub const REMOVED: &str = "InterfaceRemoved";
    /// The pod's primary interface has the MTU a configuration asks for.
    pub const PRIMARY_MTU_SET: &str = "PrimaryMtuSet";
    /// It could not be set; the note says why.
    pub const PRIMARY_MTU_FAILED: &str = "PrimaryMtuFailed";
    /// The pod's node has the VLANs and bridges its configurations ask for.
    pub const NODE_LINKS_READY: &str = "NodeLinksReady";
    /// Some could not be made on the pod's node; the note says why.
    pub const NODE_LINKS_FAILED: &str = "NodeLinksFailed";
}

/// Timings of the controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// How long after a change the pass starts, so a burst of changes
    /// costs one pass.
    pub debounce: Duration,
    /// A pass at least this often, whatever changed.
    pub resync: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            debounce: Duration::from_millis(100),
            resync: Duration::from_secs(60),
        }
    }
}

/// Where one hot-plugged interface of one pod is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InterfaceState {
    /// Its record is being made, allocated, or waits for the node's agent.
    Waiting,
    /// The node's agent made it, with this address.
    Applied(Option<IpAddr>),
    /// It cannot be made; why.
    Failed(String),
}

/// What a hot-plugged interface's record says about it.
#[must_use]
pub fn interface_state(record: &FlatNetworkIP) -> InterfaceState {
    let Some(status) = record.status.as_ref() else {
        return InterfaceState::Waiting;
    };
    if status.phase == phase::FAILED {
        return InterfaceState::Failed(if status.failure_message.is_empty() {
            "the address could not be allocated".into()
        } else {
            status.failure_message.clone()
        });
    }
    let attached = status
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_ATTACHED);
    if let Some(condition) = attached.filter(|c| c.status == "False") {
        return InterfaceState::Failed(condition.message.clone());
    }
    if status.phase == phase::ACTIVE && !status.node.is_empty() {
        return InterfaceState::Applied(status.addr);
    }
    InterfaceState::Waiting
}

/// Whether `pod` is running on a node: the only pods a configuration
/// applies to.
fn is_running(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_some()
        && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// The FlatNetworkIP asking the pod's node for `wanted` in `pod`.
#[must_use]
pub fn hotplug_record(
    pod: &Pod,
    name: String,
    wanted: &WantedAttachment,
    subnet: Option<&FlatNetworkSubnet>,
) -> FlatNetworkIP {
    let attachment = &wanted.attachment;
    let mut labels = BTreeMap::from([
        (label::IP_SUBNET.to_owned(), attachment.subnet.clone()),
        (
            label::IP_TYPE.to_owned(),
            if attachment.ip.is_some() {
                label::IP_TYPE_SPECIFIC
            } else {
                label::IP_TYPE_AUTO
            }
            .to_owned(),
        ),
        (
            label::HOTPLUG_INTERFACE.to_owned(),
            attachment.interface.clone(),
        ),
        (label::POD_NETWORK_CONFIG.to_owned(), wanted.config.clone()),
    ]);
    if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()) {
        labels.insert(label::NODE.to_owned(), node.clone());
    }
    let ipv6to4 = subnet.is_some_and(|s| {
        s.annotations()
            .get(annotation::IPV6_TO_4)
            .is_some_and(|v| !v.is_empty())
    });
    FlatNetworkIP {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: pod.namespace(),
            labels: Some(labels),
            annotations: ipv6to4
                .then(|| BTreeMap::from([(annotation::IPV6_TO_4.to_owned(), "true".to_owned())])),
            owner_references: Some(vec![pod_owner(pod)]),
            finalizers: Some(vec![FINALIZER.to_owned()]),
            ..ObjectMeta::default()
        },
        spec: FlatNetworkIPSpec {
            subnet: attachment.subnet.clone(),
            addrs: attachment.ip.into_iter().collect(),
            macs: Some(attachment.mac.clone())
                .filter(|m| !m.is_empty())
                .into_iter()
                .collect(),
            pod_id: pod.uid().unwrap_or_default(),
        },
        status: None,
    }
}

/// One interface of the plan, for Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedInterface {
    /// The configuration asking for it.
    pub config: String,
    /// Its subnet.
    pub subnet: String,
    /// Where it is.
    pub state: InterfaceState,
}

/// The primary MTU one running pod must have, and where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedPrimary {
    /// The pod's node.
    pub node: String,
    /// What the node's FlatNetworkNodeConfig asks for the pod.
    pub request: PodPrimaryMtu,
    /// What the node's agent reported.
    pub state: InterfaceState,
}

/// Where a pod's primary MTU (and MSS clamping) is, from its node's report
/// (`None`: none yet); a report about another request is not yet about
/// this one.
fn primary_state(
    node: &str,
    request: &PodPrimaryMtu,
    report: Option<&PrimaryMtuResult>,
) -> InterfaceState {
    match report {
        Some(r) if r.mtu != request.mtu || r.tcp_mss_clamp != request.tcp_mss_clamp => {
            InterfaceState::Waiting
        }
        Some(r) if r.failure.is_empty() => InterfaceState::Applied(None),
        Some(r) => InterfaceState::Failed(format!("node {node}: {}", r.failure)),
        None => InterfaceState::Waiting,
    }
}

/// What one namespace needs written.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NamespacePlan {
    /// Records to create.
    pub create: Vec<FlatNetworkIP>,
    /// Records to delete: no configuration asks for them, or they ask for
    /// something else now (the next pass makes them again).
    pub delete: Vec<FlatNetworkIP>,
    /// Records whose asking configuration changed: name → configuration.
    pub relabel: Vec<(String, String)>,
    /// Configurations whose status must change, with the new status.
    pub statuses: Vec<(String, PodNetworkConfigStatus)>,
    /// Pods whose Multus `network-status` must change: name, the
    /// resourceVersion it was computed from, the new annotation.
    pub network_status: Vec<(String, String, String)>,
    /// Every wanted interface of the running pods: (pod, interface) → state.
    pub interfaces: BTreeMap<(String, String), PlannedInterface>,
    /// Running pods whose primary MTU is asked for, by name.
    pub primary: BTreeMap<String, PlannedPrimary>,
    /// The VLANs and bridges the running pods' nodes must have, by node.
    pub node_links: BTreeMap<String, NodeLinks>,
    /// Running pods whose configurations ask their node for VLANs or
    /// bridges, by name: the node, and whether it has them.
    pub pod_node_links: BTreeMap<String, (String, InterfaceState)>,
}

/// VLANs (master, ID) and bridges (name → ports) one node must have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeLinks {
    /// VLAN sub-interfaces.
    pub vlans: BTreeSet<(String, i64)>,
    /// Bridges and their ports.
    pub bridges: BTreeMap<String, BTreeSet<String>>,
}

/// What a node's agent reported on its VLANs and bridges: interface →
/// failure (empty: as asked); `None` while the report is about an older
/// spec.
pub type LinkReport = Option<BTreeMap<String, String>>;

/// The report in `config`'s status, when it describes its current spec.
#[must_use]
pub fn link_report(config: &FlatNetworkNodeConfig) -> LinkReport {
    let status = config.status.as_ref()?;
    (status.observed_generation.is_some()
        && status.observed_generation == config.metadata.generation)
        .then(|| {
            status
                .links
                .iter()
                .map(|l| (l.name.clone(), l.failure.clone()))
                .collect()
        })
}

/// The copies one namespace is planned from.
pub struct NamespaceInput<'a> {
    /// The namespace's name.
    pub namespace: &'a str,
    /// Its labels (for the subnets' namespace selectors).
    pub labels: &'a Labels,
    /// Its pods.
    pub pods: &'a [Arc<Pod>],
    /// Its PodNetworkConfigs.
    pub configs: &'a [PodNetworkConfig],
    /// Every FlatNetworkSubnet.
    pub subnets: &'a [FlatNetworkSubnet],
    /// Its hot-plugged interfaces' records.
    pub records: &'a [Arc<FlatNetworkIP>],
    /// The nodes' reports on primary MTUs, by pod UID.
    pub primary_reports: &'a BTreeMap<String, PrimaryMtuResult>,
    /// The nodes' reports on their VLANs and bridges, by node.
    pub link_reports: &'a BTreeMap<String, LinkReport>,
}

/// Plans one namespace: the records its running pods' configurations ask
/// for, and each configuration's status.
#[must_use]
pub fn plan_namespace(input: &NamespaceInput<'_>) -> NamespacePlan {
    let mut plan = NamespacePlan::default();
    let subnets: BTreeMap<String, &FlatNetworkSubnet> =
        input.subnets.iter().map(|s| (s.name_any(), s)).collect();
    let records: BTreeMap<String, &FlatNetworkIP> = input
        .records
        .iter()
        .map(|r| (r.name_any(), r.as_ref()))
        .collect();
    let mut wanted_records = BTreeSet::new();
    let mut pods: Vec<(&Pod, PodDesired)> = Vec::new();
    for pod in input.pods.iter().filter(|p| is_running(p)) {
        let view = PodView {
            namespace: input.namespace.to_owned(),
            name: pod.name_any(),
            labels: pod.labels().clone(),
        };
        let mut desired = desired_for_pod(&view, input.labels, input.configs, input.subnets);
        let wanted: Vec<WantedAttachment> = desired.attachments.values().cloned().collect();
        let mut hotplugged = Vec::new();
        for want in wanted {
            let interface = want.attachment.interface.clone();
            let name = match hotplug_record_name(&view.name, &interface) {
                Ok(name) => name,
                Err(problem) => {
                    desired.attachments.remove(&interface);
                    desired
                        .problems
                        .entry(want.config.clone())
                        .or_default()
                        .push(problem);
                    continue;
                }
            };
            let record = hotplug_record(
                pod,
                name.clone(),
                &want,
                subnets.get(&want.attachment.subnet).copied(),
            );
            wanted_records.insert(name.clone());
            let state = match records.get(&name) {
                None => {
                    plan.create.push(record);
                    InterfaceState::Waiting
                }
                Some(existing) if existing.metadata.deletion_timestamp.is_some() => {
                    InterfaceState::Waiting
                }
                Some(existing)
                    if existing.spec != record.spec
                        || existing.owner_references() != record.owner_references() =>
                {
                    plan.delete.push((*existing).clone());
                    InterfaceState::Waiting
                }
                Some(existing) => {
                    if existing.labels().get(label::POD_NETWORK_CONFIG) != Some(&want.config) {
                        plan.relabel.push((name.clone(), want.config.clone()));
                    }
                    let state = interface_state(existing);
                    if let InterfaceState::Applied(addr) = &state {
                        hotplugged.push(HotplugStatus {
                            config: want.config.clone(),
                            interface: interface.clone(),
                            ips: addr.iter().copied().collect(),
                            mac: existing
                                .status
                                .as_ref()
                                .map(|s| s.mac.clone())
                                .unwrap_or_default(),
                        });
                    }
                    state
                }
            };
            plan.interfaces.insert(
                (view.name.clone(), interface),
                PlannedInterface {
                    config: want.config.clone(),
                    subnet: want.attachment.subnet.clone(),
                    state,
                },
            );
        }
        if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref())
            && (!desired.vlans.is_empty() || !desired.bridges.is_empty())
        {
            let links = plan.node_links.entry(node.clone()).or_default();
            links.vlans.extend(desired.vlans.iter().cloned());
            for (bridge, ports) in &desired.bridges {
                links
                    .bridges
                    .entry(bridge.clone())
                    .or_default()
                    .extend(ports.iter().cloned());
            }
            let names = link_names(
                desired
                    .vlans
                    .iter()
                    .map(|(master, id)| (master.as_str(), *id)),
                desired.bridges.keys().map(String::as_str),
            );
            let report = input.link_reports.get(node).cloned().flatten();
            let mut reasons = Vec::new();
            let state = if link_failures(names, node, report.as_ref(), &mut reasons) {
                InterfaceState::Waiting
            } else if reasons.is_empty() {
                InterfaceState::Applied(None)
            } else {
                InterfaceState::Failed(reasons.join("; "))
            };
            plan.pod_node_links
                .insert(view.name.clone(), (node.clone(), state));
        }
        if let (Some(mtu), Some(node), Some(uid)) = (
            desired.primary_mtu,
            pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            pod.uid(),
        ) {
            let request = PodPrimaryMtu {
                namespace: input.namespace.to_owned(),
                name: view.name.clone(),
                uid,
                mtu,
                tcp_mss_clamp: desired.tcp_mss_clamp,
            };
            let state = primary_state(&node, &request, input.primary_reports.get(&request.uid));
            plan.primary.insert(
                view.name.clone(),
                PlannedPrimary {
                    node,
                    request,
                    state,
                },
            );
        }
        // Only where Multus keeps the annotation: on a pod without one,
        // readers take its flat address from the `selectedIP` label, and an
        // annotation lacking the flat attachment would hide that.
        if let Some(current) = pod.annotations().get(annotation::MULTUS_NETWORK_STATUS)
            && let Ok(Some(updated)) = with_hotplug_entries(current, &hotplugged)
        {
            plan.network_status.push((
                view.name.clone(),
                pod.resource_version().unwrap_or_default(),
                updated,
            ));
        }
        pods.push((pod, desired));
    }
    for (name, record) in &records {
        if !wanted_records.contains(name) && record.metadata.deletion_timestamp.is_none() {
            plan.delete.push((*record).clone());
        }
    }
    let mut configs: Vec<&PodNetworkConfig> = input.configs.iter().collect();
    configs.sort_by_key(|c| c.name_any());
    for config in configs {
        let status = config_status(
            config,
            &pods,
            &plan.interfaces,
            &plan.primary,
            input.link_reports,
        );
        if config.status.as_ref() != Some(&status) {
            plan.statuses.push((config.name_any(), status));
        }
    }
    plan
}

/// The interfaces named by VLANs (master, ID) and bridges, each with the
/// field of a PodNetworkConfig that asks for it.
fn link_names<'a>(
    vlans: impl Iterator<Item = (&'a str, i64)> + 'a,
    bridges: impl Iterator<Item = &'a str> + 'a,
) -> impl Iterator<Item = (&'static str, String)> + 'a {
    let vlans = vlans.map(|(master, id)| ("spec.vlans", format!("{master}.{id}")));
    vlans.chain(bridges.map(|name| ("spec.bridges", name.to_owned())))
}

/// Adds to `reasons` why `node` does not have the VLANs and bridges
/// `config` asks for, per its agent's `report`; returns whether some are
/// not reported yet.
fn link_problems(
    config: &PodNetworkConfig,
    node: &str,
    report: Option<&BTreeMap<String, String>>,
    reasons: &mut Vec<String>,
) -> bool {
    let names = link_names(
        config.spec.vlans.iter().map(|v| (v.master.as_str(), v.id)),
        config.spec.bridges.iter().map(|b| b.name.as_str()),
    );
    link_failures(names, node, report, reasons)
}

/// Adds to `reasons` why `node` does not have the interfaces `names`
/// (field, interface), per its agent's `report`; returns whether some are
/// not reported yet.
fn link_failures(
    names: impl Iterator<Item = (&'static str, String)>,
    node: &str,
    report: Option<&BTreeMap<String, String>>,
    reasons: &mut Vec<String>,
) -> bool {
    let mut waiting = false;
    for (field, name) in names {
        match report.and_then(|r| r.get(&name)) {
            None => waiting = true,
            Some(failure) if failure.is_empty() => {}
            Some(failure) => reasons.push(format!("{field}: node {node}: {failure}")),
        }
    }
    waiting
}

/// The status `config` should show, from the running pods' desired state
/// and where their interfaces are.
fn config_status(
    config: &PodNetworkConfig,
    pods: &[(&Pod, PodDesired)],
    interfaces: &BTreeMap<(String, String), PlannedInterface>,
    primary: &BTreeMap<String, PlannedPrimary>,
    link_reports: &BTreeMap<String, LinkReport>,
) -> PodNetworkConfigStatus {
    let name = config.name_any();
    let (mut matched, mut applied) = (0_i64, 0_i64);
    let mut waiting;
    let mut failed = Vec::new();
    let mut invalid_selector = None;
    for (pod, desired) in pods {
        let pod_name = pod.name_any();
        let mut reasons = desired.problems.get(&name).cloned().unwrap_or_default();
        if !desired.matched.contains(&name) {
            // A selector that cannot be evaluated matches nothing.
            invalid_selector = invalid_selector.or(reasons.into_iter().next());
            continue;
        }
        matched += 1;
        waiting = false;
        if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            let report = link_reports.get(node).cloned().flatten();
            waiting |= link_problems(config, node, report.as_ref(), &mut reasons);
        }
        let asks_mtu = config
            .spec
            .primary
            .as_ref()
            .is_some_and(|p| p.mtu.is_some());
        match primary.get(&pod_name).map(|p| &p.state) {
            Some(InterfaceState::Waiting) if asks_mtu => waiting = true,
            Some(InterfaceState::Failed(why)) if asks_mtu => {
                reasons.push(format!("spec.primary.mtu: {why}"));
            }
            _ => {}
        }
        for ((of, interface), planned) in interfaces.range((pod_name.clone(), String::new())..) {
            if *of != pod_name {
                break;
            }
            if planned.config != name {
                continue;
            }
            match &planned.state {
                InterfaceState::Waiting => waiting = true,
                InterfaceState::Applied(_) => {}
                InterfaceState::Failed(why) => {
                    reasons.push(format!("interface {interface}: {why}"));
                }
            }
        }
        if !reasons.is_empty() {
            failed.push(PodFailure {
                pod: pod_name,
                reason: reasons.join("; "),
            });
        } else if !waiting {
            applied += 1;
        }
    }
    let failed_count = i64::try_from(failed.len()).unwrap_or(i64::MAX);
    let generation = config.metadata.generation;
    let (ready, reason, message) = if let Some(problem) = invalid_selector {
        ("False", "InvalidSelector", problem)
    } else if failed_count > 0 {
        (
            "False",
            "Failed",
            format!(
                "{failed_count} of {matched} matched pods cannot be configured; see status.failed"
            ),
        )
    } else if applied < matched {
        (
            "False",
            "Progressing",
            format!("{applied} of {matched} matched pods configured"),
        )
    } else {
        (
            "True",
            "Applied",
            format!("{applied} of {matched} matched pods configured"),
        )
    };
    let mut conditions = config
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    set_condition(
        &mut conditions,
        Condition {
            type_: CONDITION_READY.into(),
            status: ready.into(),
            reason: reason.into(),
            message,
            last_transition_time: Time(Timestamp::now()),
            observed_generation: generation,
        },
    );
    failed.truncate(MAX_FAILED_LISTED);
    PodNetworkConfigStatus {
        observed_generation: generation,
        matched,
        applied,
        failed_count,
        failed,
        conditions,
    }
}

/// Adds what `plan`'s pods ask of their nodes to `specs` (node → spec):
/// their primary MTUs, and the VLANs and bridges (each once, ports merged),
/// in a stable order.
pub fn add_to_node_specs(
    specs: &mut BTreeMap<String, FlatNetworkNodeConfigSpec>,
    plan: &NamespacePlan,
) {
    for planned in plan.primary.values() {
        let spec = specs.entry(planned.node.clone()).or_default();
        spec.pods.push(planned.request.clone());
        spec.pods.sort_by(|a, b| a.uid.cmp(&b.uid));
    }
    for (node, links) in &plan.node_links {
        let spec = specs.entry(node.clone()).or_default();
        let mut vlans: BTreeSet<(String, i64)> = spec
            .vlans
            .iter()
            .map(|v| (v.master.clone(), v.id))
            .collect();
        vlans.extend(links.vlans.iter().cloned());
        spec.vlans = vlans
            .into_iter()
            .map(|(master, id)| NodeVlan { master, id })
            .collect();
        let mut bridges: BTreeMap<String, BTreeSet<String>> = spec
            .bridges
            .iter()
            .map(|b| (b.name.clone(), b.ports.iter().cloned().collect()))
            .collect();
        for (name, ports) in &links.bridges {
            bridges
                .entry(name.clone())
                .or_default()
                .extend(ports.iter().cloned());
        }
        spec.bridges = bridges
            .into_iter()
            .map(|(name, ports)| NodeBridge {
                name,
                ports: ports.into_iter().collect(),
            })
            .collect();
    }
}

/// The FlatNetworkNodeConfigs to write so that each node's spec is
/// `wanted` (node → spec, as [`add_to_node_specs`] orders it): node → the
/// new spec, or `None` to delete one nothing is asked of any more. Nodes
/// already right are left out.
#[must_use]
pub fn node_config_changes(
    current: &[Arc<FlatNetworkNodeConfig>],
    mut wanted: BTreeMap<String, FlatNetworkNodeConfigSpec>,
) -> BTreeMap<String, Option<FlatNetworkNodeConfigSpec>> {
    let mut changes = BTreeMap::new();
    for config in current {
        let node = config.name_any();
        match wanted.remove(&node) {
            None if config.metadata.deletion_timestamp.is_none() => {
                changes.insert(node, None);
            }
            None => {}
            Some(spec) if spec != config.spec => {
                changes.insert(node, Some(spec));
            }
            Some(_) => {}
        }
    }
    changes.extend(wanted.into_iter().map(|(node, spec)| (node, Some(spec))));
    changes
}

/// A watch-driven copy of every object of `api` that wakes `wake` on
/// each change.
fn mirror<K>(
    api: Api<K>,
    config: watcher::Config,
    wake: Arc<Notify>,
) -> (Store<K>, impl Stream<Item = ()> + Send)
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let kind = K::kind(&());
    let stream = reflector::reflector(writer, watcher(api, config))
        .default_backoff()
        .map(move |event| {
            if let Err(error) = event {
                debug!(%kind, %error, "watch failed; retrying with backoff");
            }
            wake.notify_one();
        });
    (store, stream)
}

/// The copies a pass reads.
struct Copies {
    configs: Store<PodNetworkConfig>,
    pods: Store<Pod>,
    namespaces: Store<Namespace>,
    subnets: Store<FlatNetworkSubnet>,
    records: Store<FlatNetworkIP>,
    node_configs: Store<FlatNetworkNodeConfig>,
}

/// Runs the controller until `stop`.
pub async fn run(client: Client, settings: Settings, stop: CancellationToken) {
    let wake = Arc::new(Notify::new());
    let (configs, follow_configs) = mirror(
        Api::<PodNetworkConfig>::all(client.clone()),
        watcher::Config::default(),
        Arc::clone(&wake),
    );
    let (pods, follow_pods) = mirror(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default(),
        Arc::clone(&wake),
    );
    let (namespaces, follow_namespaces) = mirror(
        Api::<Namespace>::all(client.clone()),
        watcher::Config::default(),
        Arc::clone(&wake),
    );
    let (subnets, follow_subnets) = mirror(
        Api::<FlatNetworkSubnet>::namespaced(client.clone(), SUBNET_NAMESPACE),
        watcher::Config::default(),
        Arc::clone(&wake),
    );
    // Only the hot-plugged interfaces' records.
    let (records, follow_records) = mirror(
        Api::<FlatNetworkIP>::all(client.clone()),
        watcher::Config::default().labels(label::HOTPLUG_INTERFACE),
        Arc::clone(&wake),
    );
    let (node_configs, follow_node_configs) = mirror(
        Api::<FlatNetworkNodeConfig>::all(client.clone()),
        watcher::Config::default(),
        Arc::clone(&wake),
    );
    let copies = Copies {
        configs,
        pods,
        namespaces,
        subnets,
        records,
        node_configs,
    };
    let follow = futures::stream::select_all([
        follow_configs.boxed(),
        follow_pods.boxed(),
        follow_namespaces.boxed(),
        follow_subnets.boxed(),
        follow_records.boxed(),
        follow_node_configs.boxed(),
    ])
    .for_each(|()| async {});
    let passes = async {
        let ready = tokio::join!(
            cache::synced(&copies.configs),
            cache::synced(&copies.pods),
            cache::synced(&copies.namespaces),
            cache::synced(&copies.subnets),
            cache::synced(&copies.records),
            cache::synced(&copies.node_configs),
        );
        if ready != (true, true, true, true, true, true) {
            return;
        }
        let mut controller = Controller {
            client: client.clone(),
            events: Events::new(client.clone()),
            shown: HashMap::new(),
            shown_primary: HashMap::new(),
            shown_links: HashMap::new(),
            first: true,
        };
        let mut resync = tokio::time::interval(settings.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = wake.notified() => {}
                _ = resync.tick() => {}
            }
            tokio::time::sleep(settings.debounce).await;
            controller.pass(&copies).await;
        }
    };
    tokio::select! {
        () = stop.cancelled() => {}
        () = follow => warn!("PodNetworkConfig watches ended"),
        () = passes => {}
    }
}

/// The writing half, with what the Events already said.
struct Controller {
    client: Client,
    events: Events,
    /// (namespace, pod, interface) → the last state an Event reported.
    shown: HashMap<(String, String, String), PlannedInterface>,
    /// (namespace, pod) → the last primary MTU and state an Event reported.
    shown_primary: HashMap<(String, String), (PodPrimaryMtu, InterfaceState)>,
    /// (namespace, pod) → the node and the state of its VLANs and bridges
    /// an Event last reported.
    shown_links: HashMap<(String, String), (String, InterfaceState)>,
    /// Before the first pass nothing was reported: interfaces already in
    /// place get no Event again after a restart.
    first: bool,
}

impl Controller {
    async fn pass(&mut self, copies: &Copies) {
        let configs: Vec<PodNetworkConfig> = copies
            .configs
            .state()
            .iter()
            .map(|c| (**c).clone())
            .collect();
        let records = copies.records.state();
        let mut namespaces: BTreeSet<String> =
            configs.iter().filter_map(ResourceExt::namespace).collect();
        namespaces.extend(
            records
                .iter()
                .filter(|r| r.labels().contains_key(label::HOTPLUG_INTERFACE))
                .filter_map(|r| r.namespace()),
        );
        let subnets: Vec<FlatNetworkSubnet> = copies
            .subnets
            .state()
            .iter()
            .map(|s| (**s).clone())
            .collect();
        let all_pods = copies.pods.state();
        let node_configs = copies.node_configs.state();
        let primary_reports: BTreeMap<String, PrimaryMtuResult> = node_configs
            .iter()
            .flat_map(|c| c.status.iter().flat_map(|s| s.pods.iter()))
            .map(|r| (r.uid.clone(), r.clone()))
            .collect();
        let link_reports: BTreeMap<String, LinkReport> = node_configs
            .iter()
            .map(|c| (c.name_any(), link_report(c)))
            .collect();
        let mut node_specs: BTreeMap<String, FlatNetworkNodeConfigSpec> = BTreeMap::new();
        let mut seen = BTreeSet::new();
        let mut seen_primary = BTreeSet::new();
        let mut seen_links = BTreeSet::new();
        for namespace in namespaces {
            let labels = copies
                .namespaces
                .get(&ObjectRef::new(&namespace))
                .map(|n| n.labels().clone())
                .unwrap_or_default();
            let in_namespace = |ns: Option<String>| ns.as_deref() == Some(namespace.as_str());
            let pods: Vec<Arc<Pod>> = all_pods
                .iter()
                .filter(|p| in_namespace(p.namespace()))
                .cloned()
                .collect();
            let configs: Vec<PodNetworkConfig> = configs
                .iter()
                .filter(|c| in_namespace(c.namespace()))
                .cloned()
                .collect();
            let records: Vec<Arc<FlatNetworkIP>> = records
                .iter()
                .filter(|r| in_namespace(r.namespace()))
                .filter(|r| r.labels().contains_key(label::HOTPLUG_INTERFACE))
                .cloned()
                .collect();
            let plan = plan_namespace(&NamespaceInput {
                namespace: &namespace,
                labels: &labels,
                pods: &pods,
                configs: &configs,
                subnets: &subnets,
                records: &records,
                primary_reports: &primary_reports,
                link_reports: &link_reports,
            });
            add_to_node_specs(&mut node_specs, &plan);
            self.write(&namespace, &plan).await;
            self.announce(&namespace, &plan, &pods, &mut seen).await;
            self.announce_primary(&namespace, &plan, &pods, &mut seen_primary)
                .await;
            self.announce_node_links(&namespace, &plan, &pods, &mut seen_links)
                .await;
        }
        self.write_node_configs(&node_configs, node_specs).await;
        // Interfaces of pods gone or of namespaces without any left.
        self.shown.retain(|key, _| seen.contains(key));
        self.shown_primary
            .retain(|key, _| seen_primary.contains(key));
        self.shown_links.retain(|key, _| seen_links.contains(key));
        self.first = false;
    }

    async fn write(&self, namespace: &str, plan: &NamespacePlan) {
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        for record in &plan.create {
            let name = record.name_any();
            match ips.create(&PostParams::default(), record).await {
                Ok(_) => {
                    info!(namespace, record = %name, "FlatNetworkIP of a hot-plugged interface created");
                }
                // The copy lags behind an earlier create.
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(error) => {
                    warn!(namespace, record = %name, %error, "cannot create the FlatNetworkIP of a hot-plugged interface; retrying");
                }
            }
        }
        for record in &plan.delete {
            let name = record.name_any();
            match ips.delete(&name, &DeleteParams::background()).await {
                Ok(_) => {
                    info!(namespace, record = %name, "FlatNetworkIP of a hot-plugged interface deleted");
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(error) => {
                    warn!(namespace, record = %name, %error, "cannot delete the FlatNetworkIP of a hot-plugged interface; retrying");
                }
            }
        }
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        for (name, config) in &plan.relabel {
            let patch =
                Patch::Merge(json!({"metadata": {"labels": {label::POD_NETWORK_CONFIG: config}}}));
            if let Err(error) = ips.patch(name, &params, &patch).await {
                warn!(namespace, record = %name, %error, "cannot relabel a hot-plugged interface's FlatNetworkIP; retrying");
            }
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        for (name, version, value) in &plan.network_status {
            // On the version read: an entry Multus wrote meanwhile is not lost
            // (a conflict is retried by the pass its change starts).
            let patch = Patch::Merge(json!({"metadata": {
                "resourceVersion": version,
                "annotations": {annotation::MULTUS_NETWORK_STATUS: value},
            }}));
            match pods.patch(name, &params, &patch).await {
                Ok(_) => debug!(namespace, pod = %name, "network-status updated"),
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(error) => {
                    warn!(namespace, pod = %name, %error, "cannot update a pod's network-status; retrying");
                }
            }
        }
        let configs: Api<PodNetworkConfig> = Api::namespaced(self.client.clone(), namespace);
        for (name, status) in &plan.statuses {
            // Every field written, `failed` included when empty: a merge
            // patch leaves out what it does not name.
            let patch = Patch::Merge(json!({"status": {
                "observedGeneration": status.observed_generation,
                "matched": status.matched,
                "applied": status.applied,
                "failedCount": status.failed_count,
                "failed": status.failed,
                "conditions": status.conditions,
            }}));
            match configs.patch_status(name, &params, &patch).await {
                Ok(_) => debug!(namespace, config = %name, "PodNetworkConfig status updated"),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(error) => {
                    warn!(namespace, config = %name, %error, "cannot update a PodNetworkConfig's status; retrying");
                }
            }
        }
    }

    /// Brings the nodes' FlatNetworkNodeConfigs in line with `wanted`
    /// (node → its pods' primary MTUs): created, changed, or deleted when
    /// nothing is asked of the node any more (its agent then sets back
    /// what it changed).
    async fn write_node_configs(
        &self,
        current: &[Arc<FlatNetworkNodeConfig>],
        wanted: BTreeMap<String, FlatNetworkNodeConfigSpec>,
    ) {
        let api: Api<FlatNetworkNodeConfig> = Api::all(self.client.clone());
        for (node, spec) in node_config_changes(current, wanted) {
            let result = match spec {
                None => api
                    .delete(&node, &DeleteParams::background())
                    .await
                    .map(|_| ()),
                Some(spec) => {
                    let mut object = FlatNetworkNodeConfig::new(&node, spec);
                    object.metadata.labels =
                        Some(BTreeMap::from([(label::NODE.to_owned(), node.clone())]));
                    let patch = Patch::Apply(&object);
                    api.patch(&node, &PatchParams::apply(FIELD_MANAGER).force(), &patch)
                        .await
                        .map(|_| ())
                }
            };
            match result {
                Ok(()) => debug!(%node, "FlatNetworkNodeConfig written"),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(error) => {
                    warn!(%node, %error, "cannot write a node's FlatNetworkNodeConfig; retrying");
                }
            }
        }
    }

    /// Events on the pods whose primary MTU changed state since the last
    /// report.
    async fn announce_primary(
        &mut self,
        namespace: &str,
        plan: &NamespacePlan,
        pods: &[Arc<Pod>],
        seen: &mut BTreeSet<(String, String)>,
    ) {
        for (pod_name, planned) in &plan.primary {
            let key = (namespace.to_owned(), pod_name.clone());
            seen.insert(key.clone());
            let now = (planned.request.clone(), planned.state.clone());
            if self.shown_primary.get(&key) == Some(&now) {
                continue;
            }
            let Some(pod) = pods.iter().find(|p| p.name_any() == *pod_name) else {
                continue;
            };
            let mtu = planned.request.mtu;
            let clamp = if planned.request.tcp_mss_clamp {
                ", TCP MSS clamped"
            } else {
                ""
            };
            let node = &planned.node;
            self.announce_state(
                pod,
                &planned.state,
                "SetPrimaryMtu",
                (
                    reason::PRIMARY_MTU_SET,
                    format!("eth0 (and its node-side peer) set to MTU {mtu}{clamp} on node {node}"),
                ),
                (reason::PRIMARY_MTU_FAILED, |why: &str| {
                    format!("eth0 cannot be set to MTU {mtu}{clamp}: {why}")
                }),
            )
            .await;
            self.shown_primary.insert(key, now);
        }
    }

    /// Events on the pods whose nodes' VLANs and bridges changed state
    /// since the last report.
    async fn announce_node_links(
        &mut self,
        namespace: &str,
        plan: &NamespacePlan,
        pods: &[Arc<Pod>],
        seen: &mut BTreeSet<(String, String)>,
    ) {
        for (pod_name, now) in &plan.pod_node_links {
            let key = (namespace.to_owned(), pod_name.clone());
            seen.insert(key.clone());
            if self.shown_links.get(&key) == Some(now) {
                continue;
            }
            let Some(pod) = pods.iter().find(|p| p.name_any() == *pod_name) else {
                continue;
            };
            let (node, state) = now;
            self.announce_state(
                pod,
                state,
                "MakeNodeLinks",
                (
                    reason::NODE_LINKS_READY,
                    format!("node {node} has the VLANs and bridges its PodNetworkConfigs ask for"),
                ),
                (reason::NODE_LINKS_FAILED, |why: &str| why.to_owned()),
            )
            .await;
            self.shown_links.insert(key, now.clone());
        }
    }

    /// The Event on `pod` for one of its states, now `state`: none while
    /// waiting, nor for what was in place before the first pass; else
    /// `applied` (reason, note) or `failed` (reason, the note from why).
    async fn announce_state(
        &self,
        pod: &Pod,
        state: &InterfaceState,
        action: &str,
        applied: (&str, String),
        failed: (&str, impl FnOnce(&str) -> String),
    ) {
        match state {
            InterfaceState::Waiting => {}
            InterfaceState::Applied(_) if self.first => {}
            InterfaceState::Applied(_) => {
                self.events.normal(pod, applied.0, action, applied.1).await;
            }
            InterfaceState::Failed(why) => {
                self.events.warn(pod, failed.0, action, failed.1(why)).await;
            }
        }
    }

    /// Events on the pods whose interfaces changed state since the last
    /// report.
    async fn announce(
        &mut self,
        namespace: &str,
        plan: &NamespacePlan,
        pods: &[Arc<Pod>],
        seen: &mut BTreeSet<(String, String, String)>,
    ) {
        let pod_named = |name: &str| pods.iter().find(|p| p.name_any() == name);
        for ((pod_name, interface), planned) in &plan.interfaces {
            let key = (namespace.to_owned(), pod_name.clone(), interface.clone());
            seen.insert(key.clone());
            let before = self.shown.get(&key);
            if before.map(|b| &b.state) == Some(&planned.state) {
                continue;
            }
            let Some(pod) = pod_named(pod_name) else {
                continue;
            };
            let addr = match &planned.state {
                InterfaceState::Applied(Some(addr)) => format!(", address {addr}"),
                _ => String::new(),
            };
            let config = &planned.config;
            self.announce_state(
                pod,
                &planned.state,
                "HotplugInterface",
                (
                    reason::HOTPLUGGED,
                    format!(
                        "interface {interface} (subnet {}{addr}) added for PodNetworkConfig {config}",
                        planned.subnet
                    ),
                ),
                (reason::HOTPLUG_FAILED, |why: &str| {
                    format!("interface {interface} of PodNetworkConfig {config}: {why}")
                }),
            )
            .await;
            self.shown.insert(key, planned.clone());
        }
        for record in &plan.delete {
            let pod_name = record.pod_name();
            let Some(interface) = record.labels().get(label::HOTPLUG_INTERFACE) else {
                continue;
            };
            if plan
                .interfaces
                .contains_key(&(pod_name.clone(), interface.clone()))
            {
                // Made again with the new request.
                continue;
            }
            if let Some(pod) = pod_named(&pod_name).filter(|p| is_running(p)) {
                self.events
                    .normal(
                        pod.as_ref(),
                        reason::REMOVED,
                        "HotplugInterface",
                        format!(
                            "interface {interface} is being removed: no PodNetworkConfig asks for it"
                        ),
                    )
                    .await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use flatnet_k8s::api::{
        ExtraAttachment, FlatNetworkIPStatus, PodNetworkConfigSpec, PrimarySettings,
    };
    use k8s_openapi::api::events::v1::Event;
    use serde_json::Value;

    use super::*;
    use crate::allocation::{
        Settings as AllocationSettings, fake_api::FakeApiServer, fake_cluster::FakeCluster,
        fake_cluster::subnet,
    };

    fn running_pod(name: &str, labels: Value) -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"),
                         "labels": labels, "resourceVersion": "7",
                         "annotations": {annotation::MULTUS_NETWORK_STATUS: MULTUS}},
            "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "pause"}]},
            "status": {"phase": "Running"}
        }))
        .unwrap()
    }

    /// What Multus wrote for the pod's cluster network.
    const MULTUS: &str = r#"[{"name":"k8s-pod-network","interface":"eth0","ips":["10.42.0.5"]}]"#;

    fn config(name: &str, interface: &str) -> PodNetworkConfig {
        let mut config = PodNetworkConfig::new(
            name,
            PodNetworkConfigSpec {
                pod_selector: serde_json::from_value(json!({"matchLabels": {"app": "web"}}))
                    .unwrap(),
                attachments: vec![ExtraAttachment {
                    subnet: "lan".into(),
                    interface: interface.into(),
                    ..ExtraAttachment::default()
                }],
                ..PodNetworkConfigSpec::default()
            },
        );
        config.metadata.namespace = Some("shop".into());
        config.metadata.generation = Some(3);
        config
    }

    fn lan() -> FlatNetworkSubnet {
        subnet("lan", "10.0.0.0/24", None, &[("10.0.0.10", "10.0.0.20")])
    }

    fn plan(
        pods: &[Pod],
        configs: &[PodNetworkConfig],
        records: &[FlatNetworkIP],
    ) -> NamespacePlan {
        let pods: Vec<Arc<Pod>> = pods.iter().cloned().map(Arc::new).collect();
        let records: Vec<Arc<FlatNetworkIP>> = records.iter().cloned().map(Arc::new).collect();
        plan_namespace(&NamespaceInput {
            namespace: "shop",
            labels: &Labels::new(),
            pods: &pods,
            configs,
            subnets: &[lan()],
            records: &records,
            primary_reports: &BTreeMap::new(),
            link_reports: &BTreeMap::new(),
        })
    }

    fn with_status(mut record: FlatNetworkIP, status: Value) -> FlatNetworkIP {
        record.status = Some(serde_json::from_value::<FlatNetworkIPStatus>(status).unwrap());
        record
    }

    fn ready(status: &PodNetworkConfigStatus) -> &Condition {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_READY)
            .unwrap()
    }

    #[test]
    fn a_matching_running_pod_gets_a_record_on_its_node_owned_by_it() {
        let web = running_pod("web-0", json!({"app": "web"}));
        let mut pending = running_pod("web-1", json!({"app": "web"}));
        pending.status = None;
        let other = running_pod("db-0", json!({"app": "db"}));
        let plan = plan(&[web, pending, other], &[config("storage", "net2")], &[]);
        assert_eq!(plan.create.len(), 1, "only the running, matching pod");
        let record = &plan.create[0];
        assert_eq!(record.name_any(), "web-0.if-net2");
        assert_eq!(record.spec.subnet, "lan");
        assert_eq!(record.spec.pod_id, "uid-web-0");
        assert_eq!(record.labels()[label::NODE], "node-1");
        assert_eq!(record.labels()[label::HOTPLUG_INTERFACE], "net2");
        assert_eq!(record.labels()[label::POD_NETWORK_CONFIG], "storage");
        assert_eq!(record.owner_references()[0].kind, "Pod");
        assert_eq!(record.finalizers(), [FINALIZER]);
        let (name, status) = &plan.statuses[0];
        assert_eq!(name, "storage");
        assert_eq!(
            (status.matched, status.applied, status.failed_count),
            (1, 0, 0)
        );
        assert_eq!(status.observed_generation, Some(3));
        let ready = ready(status);
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "Progressing")
        );
        assert_eq!(ready.observed_generation, Some(3));
    }

    /// An attachment's `ip` and `mac` become the record's request, as a
    /// pod's annotations do: the allocation then hands out that address
    /// and the agent sets that MAC.
    #[test]
    fn an_attachments_fixed_ip_and_mac_become_the_records_request() {
        let web = running_pod("web-0", json!({"app": "web"}));
        let mut fixed = config("storage", "net2");
        fixed.spec.attachments[0].ip = Some("10.0.0.15".parse().unwrap());
        fixed.spec.attachments[0].mac = "0a:00:00:00:00:15".into();
        let plan = plan(std::slice::from_ref(&web), &[fixed], &[]);
        let record = &plan.create[0];
        assert_eq!(record.spec.addrs, ["10.0.0.15".parse::<IpAddr>().unwrap()]);
        assert_eq!(record.spec.macs, ["0a:00:00:00:00:15"]);
        assert_eq!(record.labels()[label::IP_TYPE], label::IP_TYPE_SPECIFIC);
        let auto = plan_auto(&web);
        assert!(auto.spec.addrs.is_empty() && auto.spec.macs.is_empty());
        assert_eq!(auto.labels()[label::IP_TYPE], label::IP_TYPE_AUTO);
    }

    fn plan_auto(web: &Pod) -> FlatNetworkIP {
        plan(std::slice::from_ref(web), &[config("storage", "net2")], &[]).create[0].clone()
    }

    #[test]
    fn the_status_follows_the_records_and_unwanted_records_go() {
        let web = running_pod("web-0", json!({"app": "web"}));
        let wanted = plan(
            std::slice::from_ref(&web),
            &[config("storage", "net2")],
            &[],
        )
        .create[0]
            .clone();
        let active = with_status(
            wanted.clone(),
            json!({"phase": "Active", "addr": "10.0.0.11", "node": "node-1"}),
        );
        let applied = plan(
            std::slice::from_ref(&web),
            &[config("storage", "net2")],
            std::slice::from_ref(&active),
        );
        assert!(applied.create.is_empty() && applied.delete.is_empty());
        let status = &applied.statuses[0].1;
        assert_eq!((status.matched, status.applied), (1, 1));
        assert_eq!(ready(status).status, "True");
        assert_eq!(
            applied.interfaces[&("web-0".into(), "net2".into())].state,
            InterfaceState::Applied(Some("10.0.0.11".parse().unwrap()))
        );
        let (pod, version, network_status) = &applied.network_status[0];
        assert_eq!((pod.as_str(), version.as_str()), ("web-0", "7"));
        let entries: Vec<Value> = serde_json::from_str(network_status).unwrap();
        assert_eq!(entries[0]["interface"], "eth0", "Multus's entry kept");
        assert_eq!(entries[1]["interface"], "net2");
        assert_eq!(entries[1]["ips"][0], "10.0.0.11");
        // Unchanged status: nothing to write.
        let mut shown = config("storage", "net2");
        shown.status = Some(status.clone());
        assert!(
            plan(
                std::slice::from_ref(&web),
                &[shown],
                std::slice::from_ref(&active)
            )
            .statuses
            .is_empty()
        );

        let refused = with_status(
            wanted,
            json!({"phase": "Pending", "addr": "10.0.0.11", "conditions": [{
                "type": "Attached", "status": "False", "reason": "HotplugFailed",
                "message": "node node-1: interface net2 already exists",
                "lastTransitionTime": "2025-01-01T00:00:00Z"}]}),
        );
        let failed = plan(
            std::slice::from_ref(&web),
            &[config("storage", "net2")],
            &[refused],
        );
        let status = &failed.statuses[0].1;
        assert_eq!((status.applied, status.failed_count), (0, 1));
        assert_eq!(status.failed[0].pod, "web-0");
        assert_eq!(
            status.failed[0].reason,
            "interface net2: node node-1: interface net2 already exists"
        );
        assert_eq!(ready(status).reason, "Failed");

        // The configuration gone: its record goes.
        let gone = plan(&[web], &[], &[active]);
        assert_eq!(gone.delete.len(), 1);
        assert!(gone.statuses.is_empty());
    }

    #[test]
    fn unusable_requests_fail_the_pod_with_the_reason() {
        let web = running_pod("web-0", json!({"app": "web"}));
        let mut mtu = config("a-mtu", "net3");
        mtu.spec.primary = Some(PrimarySettings {
            mtu: Some(1400),
            ..PrimarySettings::default()
        });
        let plan = plan(&[web], &[config("bad", "Net_2"), mtu], &[]);
        let status = |name: &str| &plan.statuses.iter().find(|(n, _)| n == name).unwrap().1;
        assert!(
            status("bad").failed[0].reason.contains("lowercase letters"),
            "{:?}",
            status("bad").failed
        );
        // The primary MTU goes to the pod's node, and waits for its report.
        assert!(status("a-mtu").failed.is_empty(), "{:?}", status("a-mtu"));
        assert_eq!(ready(status("a-mtu")).reason, "Progressing");
        let primary = &plan.primary["web-0"];
        assert_eq!(
            (primary.node.as_str(), primary.request.mtu, &primary.state),
            ("node-1", 1400, &InterfaceState::Waiting)
        );
        // Its attachment is still made.
        assert_eq!(plan.create.len(), 1);
        assert_eq!(plan.create[0].name_any(), "web-0.if-net3");
    }

    fn mtu_config(name: &str, mtu: u32) -> PodNetworkConfig {
        let mut config = config(name, "net2");
        config.spec.attachments.clear();
        config.spec.primary = Some(PrimarySettings {
            mtu: Some(mtu),
            ..PrimarySettings::default()
        });
        config
    }

    fn report(mtu: u32, failure: &str) -> PrimaryMtuResult {
        PrimaryMtuResult {
            uid: "uid-web-0".into(),
            mtu,
            failure: failure.into(),
            ..PrimaryMtuResult::default()
        }
    }

    fn plan_with_reports(
        configs: &[PodNetworkConfig],
        reports: &[PrimaryMtuResult],
    ) -> NamespacePlan {
        let pods = [Arc::new(running_pod("web-0", json!({"app": "web"})))];
        let reports = reports.iter().map(|r| (r.uid.clone(), r.clone())).collect();
        plan_namespace(&NamespaceInput {
            namespace: "shop",
            labels: &Labels::new(),
            pods: &pods,
            configs,
            subnets: &[lan()],
            records: &[],
            primary_reports: &reports,
            link_reports: &BTreeMap::new(),
        })
    }

    #[test]
    fn a_primary_mtu_goes_to_the_pods_node_and_its_report_becomes_the_status() {
        // The smallest MTU asked for is the pod's; both configurations
        // read the same report.
        let configs = [mtu_config("a", 1450), mtu_config("b", 1400)];
        let waiting = plan_with_reports(&configs, &[]);
        let primary = &waiting.primary["web-0"];
        assert_eq!(
            primary.request,
            PodPrimaryMtu {
                namespace: "shop".into(),
                name: "web-0".into(),
                uid: "uid-web-0".into(),
                mtu: 1400,
                tcp_mss_clamp: false,
            }
        );
        assert_eq!(primary.node, "node-1");
        for (_, status) in &waiting.statuses {
            assert_eq!(
                (status.matched, status.applied, status.failed_count),
                (1, 0, 0)
            );
            assert_eq!(ready(status).reason, "Progressing");
        }
        // A report about another MTU (the one asked before) is no answer.
        let stale = plan_with_reports(&configs, &[report(1450, "")]);
        assert_eq!(stale.primary["web-0"].state, InterfaceState::Waiting);

        let applied = plan_with_reports(&configs, &[report(1400, "")]);
        for (_, status) in &applied.statuses {
            assert_eq!((status.applied, status.failed_count), (1, 0));
            assert_eq!(ready(status).status, "True");
        }
        let failed = plan_with_reports(
            &configs,
            &[report(1400, "interface eth0 not found in /proc/1/ns/net")],
        );
        for (_, status) in &failed.statuses {
            assert_eq!((status.applied, status.failed_count), (0, 1));
            assert_eq!(
                status.failed[0].reason,
                "spec.primary.mtu: node node-1: interface eth0 not found in /proc/1/ns/net"
            );
        }
        // MSS clamping asked too: a report of the MTU alone is no answer,
        // one of both is.
        let mut clamping = mtu_config("c", 1400);
        if let Some(primary) = clamping.spec.primary.as_mut() {
            primary.tcp_mss_clamp = true;
        }
        let configs = [mtu_config("a", 1450), clamping];
        let stale = plan_with_reports(&configs, &[report(1400, "")]);
        assert!(stale.primary["web-0"].request.tcp_mss_clamp);
        assert_eq!(stale.primary["web-0"].state, InterfaceState::Waiting);
        let both = PrimaryMtuResult {
            tcp_mss_clamp: true,
            ..report(1400, "")
        };
        let applied = plan_with_reports(&configs, &[both]);
        assert_eq!(
            applied.primary["web-0"].state,
            InterfaceState::Applied(None)
        );
        // A configuration asking no MTU is not held up by it.
        let other = plan_with_reports(&[config("net", "net2"), mtu_config("b", 1400)], &[]);
        let net = &other.statuses.iter().find(|(n, _)| n == "net").unwrap().1;
        assert_eq!(net.failed_count, 0);
    }

    #[test]
    fn node_configs_are_created_changed_and_deleted_as_asked() {
        let pod = |uid: &str, mtu: u32| PodPrimaryMtu {
            namespace: "shop".into(),
            name: uid.into(),
            uid: uid.into(),
            mtu,
            tcp_mss_clamp: false,
        };
        let existing = |node: &str, pods: Vec<PodPrimaryMtu>| {
            Arc::new(FlatNetworkNodeConfig::new(
                node,
                FlatNetworkNodeConfigSpec {
                    pods,
                    ..FlatNetworkNodeConfigSpec::default()
                },
            ))
        };
        let current = [
            existing("same", vec![pod("a", 1400), pod("b", 1400)]),
            existing("changed", vec![pod("c", 1400)]),
            existing("gone", vec![pod("d", 1400)]),
        ];
        let spec = |pods: Vec<PodPrimaryMtu>| FlatNetworkNodeConfigSpec {
            pods,
            ..FlatNetworkNodeConfigSpec::default()
        };
        let wanted = BTreeMap::from([
            (
                "same".to_owned(),
                spec(vec![pod("a", 1400), pod("b", 1400)]),
            ),
            ("changed".to_owned(), spec(vec![pod("c", 1300)])),
            ("new".to_owned(), spec(vec![pod("e", 9000)])),
        ]);
        let changes = node_config_changes(&current, wanted);
        assert_eq!(
            changes.keys().map(String::as_str).collect::<Vec<_>>(),
            ["changed", "gone", "new"]
        );
        assert_eq!(changes["changed"].as_ref().unwrap().pods, [pod("c", 1300)]);
        assert_eq!(changes["gone"], None);
        assert_eq!(changes["new"].as_ref().unwrap().pods, [pod("e", 9000)]);
    }

    #[test]
    fn node_links_are_merged_per_node_and_reports_become_the_status() {
        let mut vlans = mtu_config("vlans", 1400);
        vlans.spec.primary = None;
        vlans.spec.vlans = vec![NodeVlan {
            master: "eth1".into(),
            id: 200,
        }];
        vlans.spec.bridges = vec![NodeBridge {
            name: "br-s".into(),
            ports: vec!["eth1.200".into()],
        }];
        let mut more = vlans.clone();
        more.metadata.name = Some("more".into());
        more.spec.vlans[0].id = 300;
        more.spec.bridges[0].ports = vec!["eth2".into()];
        let input = |reports: &BTreeMap<String, LinkReport>| {
            let pods = [Arc::new(running_pod("web-0", json!({"app": "web"})))];
            plan_namespace(&NamespaceInput {
                namespace: "shop",
                labels: &Labels::new(),
                pods: &pods,
                configs: &[vlans.clone(), more.clone()],
                subnets: &[lan()],
                records: &[],
                primary_reports: &BTreeMap::new(),
                link_reports: reports,
            })
        };
        let waiting = input(&BTreeMap::new());
        let mut specs = BTreeMap::new();
        add_to_node_specs(&mut specs, &waiting);
        let spec = &specs["node-1"];
        assert_eq!(
            spec.vlans,
            [
                NodeVlan {
                    master: "eth1".into(),
                    id: 200
                },
                NodeVlan {
                    master: "eth1".into(),
                    id: 300
                }
            ]
        );
        assert_eq!(spec.bridges[0].ports, ["eth1.200", "eth2"], "merged once");
        for (_, status) in &waiting.statuses {
            assert_eq!(ready(status).reason, "Progressing", "{status:?}");
        }
        // The node reports eth1.300 failed; the other configuration is done.
        let report = BTreeMap::from([(
            "node-1".to_owned(),
            Some(BTreeMap::from([
                ("eth1.200".to_owned(), String::new()),
                (
                    "eth1.300".to_owned(),
                    "master eth1 of VLAN eth1.300 does not exist on node node-1".to_owned(),
                ),
                ("br-s".to_owned(), String::new()),
            ])),
        )]);
        let reported = input(&report);
        let status = |name: &str| {
            reported
                .statuses
                .iter()
                .find(|(n, _)| n == name)
                .unwrap()
                .1
                .clone()
        };
        assert_eq!(status("vlans").applied, 1);
        assert_eq!(
            status("more").failed[0].reason,
            "spec.vlans: node node-1: master eth1 of VLAN eth1.300 does not exist on node node-1"
        );
        // The pod's own view, for its Events: every link of both.
        let node_links = |plan: &NamespacePlan| plan.pod_node_links["web-0"].clone();
        assert_eq!(
            node_links(&waiting),
            ("node-1".into(), InterfaceState::Waiting)
        );
        assert_eq!(
            node_links(&reported),
            (
                "node-1".into(),
                InterfaceState::Failed(
                    "spec.vlans: node node-1: master eth1 of VLAN eth1.300 does not exist on node node-1"
                        .into()
                )
            )
        );
        // A report about an older spec is no answer.
        let stale = BTreeMap::from([("node-1".to_owned(), None)]);
        assert_eq!(ready(&input(&stale).statuses[0].1).reason, "Progressing");
        assert_eq!(node_links(&input(&stale)).1, InterfaceState::Waiting);
    }

    async fn wait_for(what: &str, done: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The controller with the allocation controllers on the fake API
    /// server: a configuration gets the matching pod a record, allocated
    /// by the normal path; the agent's reports become the status and
    /// Events; the configuration deleted, the record goes and its address
    /// is released.
    #[tokio::test]
    async fn configurations_become_allocated_records_and_reports_become_status() {
        let server = FakeApiServer::new();
        let mut subnet = lan();
        subnet.metadata.namespace = Some(SUBNET_NAMESPACE.into());
        server.insert(&subnet);
        server.insert(&Namespace {
            metadata: ObjectMeta {
                name: Some("shop".into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        });
        server.insert(&running_pod("web-0", json!({"app": "web"})));
        // The pod's node exists: the allocation keeps no address on a gone node.
        server.insert(&k8s_openapi::api::core::v1::Node {
            metadata: ObjectMeta {
                name: Some("node-1".into()),
                ..ObjectMeta::default()
            },
            ..Default::default()
        });
        let cluster = FakeCluster::start(server.clone(), AllocationSettings::default(), 2);
        let stop = CancellationToken::new();
        let controller = tokio::spawn(run(
            server.client(),
            Settings {
                debounce: Duration::from_millis(10),
                resync: Duration::from_secs(1),
            },
            stop.clone(),
        ));
        server.insert(&config("storage", "net2"));
        let record = || {
            server
                .list::<FlatNetworkIP>()
                .into_iter()
                .find(|r| r.name_any() == "web-0.if-net2")
        };
        wait_for("the record allocated", || {
            record().is_some_and(|r| r.status.is_some_and(|s| s.addr.is_some()))
        })
        .await;
        let status = || {
            server
                .list::<PodNetworkConfig>()
                .into_iter()
                .find_map(|c| c.status)
                .unwrap_or_default()
        };
        wait_for("matched and waiting", || {
            let s = status();
            s.matched == 1 && s.applied == 0
        })
        .await;

        // The node's agent: the interface is made.
        let mut active = record().unwrap();
        let status_of = active.status.get_or_insert_with(Default::default);
        status_of.phase = phase::ACTIVE.into();
        status_of.node = "node-1".into();
        server.insert(&active);
        wait_for("applied", || {
            let s = status();
            s.applied == 1
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == CONDITION_READY && c.status == "True")
        })
        .await;
        let network_status = || {
            server
                .list::<Pod>()
                .into_iter()
                .find_map(|p| {
                    p.annotations()
                        .get(annotation::MULTUS_NETWORK_STATUS)
                        .cloned()
                })
                .unwrap_or_default()
        };
        wait_for("net2 in the pod's network-status", || {
            network_status().contains("\"interface\":\"net2\"")
        })
        .await;
        let events = || server.list::<Event>();
        wait_for("the Normal Event on the pod", || {
            events().iter().any(|e| {
                e.reason.as_deref() == Some(reason::HOTPLUGGED)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("web-0")
            })
        })
        .await;

        // The agent cannot keep it (a later failure): reported per pod.
        let status_of = active.status.get_or_insert_with(Default::default);
        status_of.conditions = vec![Condition {
            type_: CONDITION_ATTACHED.into(),
            status: "False".into(),
            reason: "HotplugFailed".into(),
            message: "node node-1: no namespace".into(),
            last_transition_time: Time(Timestamp::now()),
            observed_generation: None,
        }];
        server.insert(&active);
        wait_for("failed with the reason", || {
            status()
                .failed
                .iter()
                .any(|f| f.pod == "web-0" && f.reason.contains("no namespace"))
        })
        .await;
        wait_for("the Warning Event", || {
            events()
                .iter()
                .any(|e| e.reason.as_deref() == Some(reason::HOTPLUG_FAILED))
        })
        .await;

        // The configuration deleted: the record goes, finalizer and all,
        // and the subnet holds no address for it.
        server.delete::<PodNetworkConfig>("shop", "storage");
        wait_for("the record gone", || record().is_none()).await;
        wait_for(
            "net2 out of the network-status, Multus's entry kept",
            || {
                let status = network_status();
                !status.contains("net2") && status.contains("eth0")
            },
        )
        .await;
        wait_for("the address released", || {
            server
                .list::<FlatNetworkSubnet>()
                .iter()
                .all(|s| s.status.as_ref().is_none_or(|st| st.used_ip_count == 0))
        })
        .await;
        stop.cancel();
        controller.await.unwrap();
        cluster.stop().await;
    }

    /// The controller on the fake API server: a configuration's primary
    /// MTU reaches the pod's node in its FlatNetworkNodeConfig, the node's
    /// report becomes the status and Events, and the configuration deleted
    /// empties the node's object away.
    #[tokio::test]
    async fn a_primary_mtu_reaches_the_nodes_config_and_the_report_the_status() {
        let server = FakeApiServer::new();
        server.insert(&Namespace {
            metadata: ObjectMeta {
                name: Some("shop".into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        });
        server.insert(&running_pod("web-0", json!({"app": "web"})));
        let stop = CancellationToken::new();
        let controller = tokio::spawn(run(
            server.client(),
            Settings {
                debounce: Duration::from_millis(10),
                resync: Duration::from_secs(1),
            },
            stop.clone(),
        ));
        server.insert(&mtu_config("jumbo", 1400));
        let node_config = || {
            server
                .list::<FlatNetworkNodeConfig>()
                .into_iter()
                .find(|c| c.name_any() == "node-1")
        };
        wait_for("the node's config asks for the pod's MTU", || {
            node_config().is_some_and(|c| {
                c.spec.pods.len() == 1
                    && c.spec.pods[0].uid == "uid-web-0"
                    && c.spec.pods[0].mtu == 1400
                    && c.labels().get(label::NODE).map(String::as_str) == Some("node-1")
            })
        })
        .await;
        let status = || {
            server
                .list::<PodNetworkConfig>()
                .into_iter()
                .find_map(|c| c.status)
                .unwrap_or_default()
        };
        wait_for("matched and waiting", || {
            let s = status();
            s.matched == 1 && s.applied == 0 && s.failed_count == 0
        })
        .await;

        // The node's agent reports it set.
        let mut reported = node_config().unwrap();
        reported.status = Some(flatnet_k8s::api::FlatNetworkNodeConfigStatus {
            pod_count: 1,
            pods: vec![report(1400, "")],
            ..Default::default()
        });
        server.insert(&reported);
        wait_for("applied", || {
            let s = status();
            s.applied == 1
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == CONDITION_READY && c.status == "True")
        })
        .await;
        let events = || server.list::<Event>();
        wait_for("the Normal Event on the pod", || {
            events().iter().any(|e| {
                e.reason.as_deref() == Some(reason::PRIMARY_MTU_SET)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("web-0")
            })
        })
        .await;

        // A failure on the node: per pod, with the node named, and a Warning.
        reported.status = Some(flatnet_k8s::api::FlatNetworkNodeConfigStatus {
            pod_count: 1,
            pods: vec![report(1400, "cannot set MTU: Invalid argument")],
            ..Default::default()
        });
        server.insert(&reported);
        wait_for("failed with the reason", || {
            status().failed.iter().any(|f| {
                f.pod == "web-0"
                    && f.reason == "spec.primary.mtu: node node-1: cannot set MTU: Invalid argument"
            })
        })
        .await;
        wait_for("the Warning Event", || {
            events()
                .iter()
                .any(|e| e.reason.as_deref() == Some(reason::PRIMARY_MTU_FAILED))
        })
        .await;

        // Nothing asked of the node any more: its object goes.
        server.delete::<PodNetworkConfig>("shop", "jumbo");
        wait_for("the node's config gone", || node_config().is_none()).await;
        stop.cancel();
        controller.await.unwrap();
    }
}
