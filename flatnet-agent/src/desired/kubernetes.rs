//! Kubernetes desired state: the pod's FlatNetworkIP (same name and
//! namespace as the pod) and its FlatNetworkSubnet (in
//! `cattle-flat-network`), allocated by flatnet-operator.
//!
//! ADD waits by watch (not polling) for the operator to set `status.addr`,
//! bounded by the allocation wait; the agent watches only the one object it
//! needs. With [`Kubernetes::follow_allocations`] (the agent's default) it
//! also keeps watch-driven copies of the FlatNetworkIPs and subnets, so an
//! ADD whose allocation is already made reads nothing from the API server. After a successful attach it records phase `Active`, the real MAC
//! and its node through the status subresource (server-side apply), and
//! labels the object with its node.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::StreamExt;

use flatnet_k8s::{
    api::{
        CONDITION_ATTACHED, FlatNetworkIP, FlatNetworkNodeConfig, FlatNetworkSubnet,
        NodeLinkResult, PrimaryMtuResult,
    },
    events::EventRecorder,
    ipam::Pool,
    keys::{SECONDARY_RECORD_SUFFIX, SUBNET_NAMESPACE, annotation, hotplug_record_name, label},
    validation::{ValidSubnet, validate_subnet},
};
use ipnet::IpNet;
use k8s_openapi::{api::core::v1::Pod, jiff::Timestamp};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{ListParams, Patch, PatchParams},
    runtime::{
        WatchStreamExt,
        events::{Event, EventType, Reporter},
        reflector::{self, ObjectRef, Store},
        wait::await_condition,
        watcher,
    },
};
use serde_json::json;

use super::{
    AttachmentKey, ClaimRequest, DesiredInterface, DesiredState, DesiredStateError,
    HotplugAttachment, NamedSubnet, PodRef, PrimaryMtu, UpcomingAddress, status::SubnetCapacity,
};
use crate::{
    datapath::Conflict,
    link::{format_mac, parse_mac},
    packet::MacAddr,
};

/// Field manager of the agent's server-side applies.
pub const FIELD_MANAGER: &str = "flatnet-agent";
/// Field manager of the MTU the agent reports after changing it in place.
pub const MTU_FIELD_MANAGER: &str = "flatnet-agent-mtu";
/// Field manager of the `Attached` condition of hot-plugged interfaces'
/// FlatNetworkIPs.
pub const HOTPLUG_FIELD_MANAGER: &str = "flatnet-agent-hotplug";
/// Field manager of the status of this node's FlatNetworkNodeConfig.
pub const NODE_CONFIG_FIELD_MANAGER: &str = "flatnet-agent-node-config";
/// Field manager of the node interfaces' part of that status.
pub const NODE_LINKS_FIELD_MANAGER: &str = "flatnet-agent-node-links";
/// Field manager of the `IPConflict` condition. Its own: an apply drops
/// the fields its manager set before and leaves out, so under
/// [`FIELD_MANAGER`] the condition would erase the Active status.
pub const IP_CONFLICT_FIELD_MANAGER: &str = "flatnet-agent-ip-conflict";
/// Default bound on waiting for the operator's allocation.
pub const DEFAULT_ALLOCATION_WAIT: Duration = Duration::from_secs(30);

/// Kubernetes desired state.
pub struct Kubernetes {
    client: Client,
    node: String,
    allocation_wait: Duration,
    synced: AtomicBool,
    recorder: EventRecorder,
    /// Set by [`Self::follow_allocations`].
    followed: OnceLock<Followed>,
}

/// Watch-driven copies of every FlatNetworkIP, of the subnets and of
/// this node's FlatNetworkNodeConfig.
struct Followed {
    ips: Mirror<FlatNetworkIP>,
    subnets: Mirror<FlatNetworkSubnet>,
    node_config: Mirror<FlatNetworkNodeConfig>,
    /// The pods bound to this node (a `spec.nodeName` field selector, as
    /// kubelet watches them): whose allocations are upcoming ADDs.
    pods: Mirror<Pod>,
    /// Woken by changes of the records and of this node's pods.
    upcoming: Arc<tokio::sync::Notify>,
}

/// One kind's copy, fed by a watch in its own task (also the floating
/// addresses' copies of pools, Services, EndpointSlices and Nodes).
pub(crate) struct Mirror<K: 'static + Resource<DynamicType = ()>> {
    store: Store<K>,
    /// Set once the first list is in the store: before, an object missing
    /// from it says nothing.
    complete: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl<K> Mirror<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    /// Follows every object of `api` (a reflector: list, then watch, with
    /// backoff and relists as the watcher does them).
    fn follow(api: Api<K>) -> Self {
        Self::follow_notifying(api, None)
    }

    /// [`Self::follow`], also waking `changed` after every change once the
    /// copy is complete.
    pub(crate) fn follow_notifying(api: Api<K>, changed: Option<Arc<tokio::sync::Notify>>) -> Self {
        Self::follow_selected(api, watcher::Config::default(), changed)
    }

    /// [`Self::follow_notifying`] of the objects `config` selects.
    pub(crate) fn follow_selected(
        api: Api<K>,
        config: watcher::Config,
        changed: Option<Arc<tokio::sync::Notify>>,
    ) -> Self {
        let (store, writer) = reflector::store();
        let complete = Arc::new(AtomicBool::new(false));
        let listed = Arc::clone(&complete);
        let kind = K::kind(&());
        let task = tokio::spawn(async move {
            let mut events = reflector::reflector(writer, watcher(api, config))
                .default_backoff()
                .boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => {
                        listed.store(true, Ordering::Release);
                        if let Some(changed) = &changed {
                            changed.notify_one();
                        }
                    }
                    Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                        if let Some(changed) = &changed {
                            changed.notify_one();
                        }
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::debug!(%kind, %error, "watch failed; retrying with backoff");
                    }
                }
            }
        });
        Self {
            store,
            complete,
            task,
        }
    }

    /// The copy of `namespace/name`; `None` when absent or when the copy
    /// is not complete yet.
    fn get(&self, namespace: &str, name: &str) -> Option<Arc<K>> {
        if !self.complete.load(Ordering::Acquire) {
            return None;
        }
        self.store.get(&ObjectRef::new(name).within(namespace))
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.complete.load(Ordering::Acquire)
    }

    /// Every object of the copy; `None` while it is not complete.
    pub(crate) fn objects(&self) -> Option<Vec<Arc<K>>> {
        self.is_complete().then(|| self.store.state())
    }
}

impl<K: 'static + Resource<DynamicType = ()>> Drop for Mirror<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Kubernetes {
    /// The source for node `node`, waiting at most `allocation_wait` for
    /// an allocation.
    pub fn new(client: Client, node: &str, allocation_wait: Duration) -> Self {
        let recorder = EventRecorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(node.to_owned()),
            },
        );
        Self {
            client,
            node: node.to_owned(),
            allocation_wait,
            synced: AtomicBool::new(false),
            recorder,
            followed: OnceLock::new(),
        }
    }

    /// Keeps watch-driven copies of every FlatNetworkIP and of the
    /// FlatNetworkSubnets: an ADD whose FlatNetworkIP the copy shows
    /// allocated to the pod takes it, its second (IPv6) record and its
    /// subnet from the copies, and its only requests are the two writes of
    /// the Active status. Anything the copies lack (not yet complete, an
    /// allocation made after the ADD started) is read from the API server
    /// as without them. The copies cost one object per flat-network pod in
    /// memory, and one watch of each kind on the API server. Call inside a
    /// Tokio runtime; later calls do nothing.
    pub fn follow_allocations(&self) {
        self.followed.get_or_init(|| {
            let upcoming = Arc::new(tokio::sync::Notify::new());
            Followed {
                ips: Mirror::follow_notifying(
                    Api::all(self.client.clone()),
                    Some(Arc::clone(&upcoming)),
                ),
                subnets: Mirror::follow(Api::namespaced(self.client.clone(), SUBNET_NAMESPACE)),
                pods: Mirror::follow_selected(
                    Api::all(self.client.clone()),
                    watcher::Config::default().fields(&format!("spec.nodeName={}", self.node)),
                    Some(Arc::clone(&upcoming)),
                ),
                upcoming,
                // Only this node's, by its label (RBAC cannot narrow a watch
                // to one name per node).
                node_config: Mirror::follow_selected(
                    Api::all(self.client.clone()),
                    watcher::Config::default().labels(&format!("{}={}", label::NODE, self.node)),
                    None,
                ),
            }
        });
    }

    /// Applies `status` to this node's FlatNetworkNodeConfig under
    /// `manager` (each report its own manager, so neither drops the
    /// other's fields).
    async fn report_on_node_config(
        &self,
        manager: &str,
        status: serde_json::Value,
    ) -> Result<(), DesiredStateError> {
        let configs: Api<FlatNetworkNodeConfig> = Api::all(self.client.clone());
        let patch = Patch::Apply(json!({
            "apiVersion": FlatNetworkNodeConfig::api_version(&()),
            "kind": FlatNetworkNodeConfig::kind(&()),
            "status": status,
        }));
        match configs
            .patch_status(&self.node, &PatchParams::apply(manager).force(), &patch)
            .await
        {
            Ok(_) => Ok(()),
            // Gone meanwhile: nothing asks any more.
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(DesiredStateError::Unavailable(format!(
                "cannot report on FlatNetworkNodeConfig {}: {e}",
                self.node
            ))),
        }
    }

    /// This node's FlatNetworkNodeConfig from the copy (`Some(None)`: there
    /// is none); `None` while the copy is not complete.
    fn followed_node_config(&self) -> Option<Option<Arc<FlatNetworkNodeConfig>>> {
        let followed = self.followed.get()?;
        let configs = followed.node_config.objects()?;
        Some(configs.into_iter().find(|c| c.name_any() == self.node))
    }

    /// Whether both copies of [`Self::follow_allocations`] are complete.
    pub fn allocations_followed(&self) -> bool {
        self.followed
            .get()
            .is_some_and(|f| f.ips.is_complete() && f.subnets.is_complete())
    }

    /// The subnets in the copy of [`Self::follow_allocations`] (none before
    /// it is complete).
    pub fn followed_subnets(&self) -> Vec<FlatNetworkSubnet> {
        self.followed
            .get()
            .filter(|f| f.subnets.is_complete())
            .map(|f| {
                f.subnets
                    .store
                    .state()
                    .iter()
                    .map(|s| (**s).clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The MACs the live FlatNetworkIPs in the copy of
    /// [`Self::follow_allocations`] record, on any node; `None` before the
    /// copy is complete (then no MAC can be called foreign). A record being
    /// deleted does not count: its pod is gone, and its MAC's claims are
    /// what wire-aware release needs to hear about.
    pub fn flatnet_macs(&self) -> Option<std::collections::HashSet<[u8; 6]>> {
        let followed = self.followed.get().filter(|f| f.ips.is_complete())?;
        let records = followed.ips.store.state();
        Some(crate::wire_report::live_record_macs(
            records.iter().map(AsRef::as_ref),
        ))
    }

    /// Every FlatNetworkIP in the copy of [`Self::follow_allocations`];
    /// `None` before it is complete.
    pub fn followed_records(&self) -> Option<Vec<Arc<FlatNetworkIP>>> {
        self.followed.get()?.ips.objects()
    }

    /// Whether the copy of [`Self::follow_allocations`] holds FlatNetworkIP
    /// `namespace/name` allocated (benchmarks wait for it).
    pub fn follows(&self, namespace: &str, name: &str) -> bool {
        self.followed_allocation(namespace, name, None).is_some()
    }

    /// The copy of FlatNetworkIP `namespace/name`, when allocated to the
    /// pod with `uid`.
    fn followed_allocation(
        &self,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
    ) -> Option<FlatNetworkIP> {
        let ip = self.followed.get()?.ips.get(namespace, name)?;
        is_allocated(&ip, uid).then(|| (*ip).clone())
    }

    /// Checks that the API server serves the FlatNetworkSubnet API; until
    /// then STATUS reports the agent not ready.
    pub async fn sync(&self) -> Result<(), DesiredStateError> {
        let subnets: Api<FlatNetworkSubnet> =
            Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        subnets
            .list_metadata(&ListParams::default().limit(1))
            .await
            .map_err(|e| {
                DesiredStateError::Unavailable(format!(
                    "cannot list FlatNetworkSubnets in {SUBNET_NAMESPACE}: {e}; are the flatnet CRDs installed and the agent's RBAC in place?"
                ))
            })?;
        self.synced.store(true, Ordering::Release);
        Ok(())
    }

    fn pod_names(pod: &PodRef) -> Result<(&str, &str), DesiredStateError> {
        match (pod.namespace.as_deref(), pod.name.as_deref()) {
            (Some(ns), Some(name)) => Ok((ns, name)),
            _ => Err(DesiredStateError::InvalidRequest(
                "CNI_ARGS lack K8S_POD_NAMESPACE and K8S_POD_NAME, which name the pod's FlatNetworkIP; \
                 run flatnet through a Kubernetes runtime or start the agent with --standalone"
                    .into(),
            )),
        }
    }

    /// Whether the followed copy of FlatNetworkIP `namespace/name` already
    /// carries what [`Self::mark_active`] would write (a restarted agent
    /// reports every pod again).
    pub fn follows_active(&self, namespace: &str, name: &str, mac: MacAddr, mtu: u32) -> bool {
        let Some(ip) = self
            .followed
            .get()
            .and_then(|followed| followed.ips.get(namespace, name))
        else {
            return false;
        };
        let labelled = ip.labels().get(label::NODE) == Some(&self.node);
        labelled
            && ip.status.as_ref().is_some_and(|status| {
                status.phase == "Active"
                    && status.mac == format_mac(mac)
                    && status.node == self.node
                    && status.mtu == Some(mtu)
            })
    }

    /// Labels one FlatNetworkIP with this node and applies its Active status.
    async fn mark_active(
        &self,
        namespace: &str,
        name: &str,
        mac: MacAddr,
        mtu: u32,
    ) -> Result<(), DesiredStateError> {
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let unavailable = |e: kube::Error| {
            DesiredStateError::Unavailable(format!(
                "cannot update FlatNetworkIP {namespace}/{name}: {e}"
            ))
        };
        let labels = json!({
            "apiVersion": FlatNetworkIP::api_version(&()),
            "kind": FlatNetworkIP::kind(&()),
            "metadata": {"name": name, "labels": {label::NODE: self.node}},
        });
        let status = json!({
            "apiVersion": FlatNetworkIP::api_version(&()),
            "kind": FlatNetworkIP::kind(&()),
            "status": {"phase": "Active", "mac": format_mac(mac), "node": self.node, "mtu": mtu},
        });
        // Two writes of different fields (the object's labels, its status
        // subresource): in flight together, one round trip on the answer path.
        let labels = Patch::Apply(labels);
        let status = Patch::Apply(status);
        tokio::try_join!(
            ips.patch(name, &params, &labels),
            ips.patch_status(name, &params, &status),
        )
        .map_err(unavailable)?;
        Ok(())
    }

    /// Waits (by watch, until `deadline`) for the operator to allocate the
    /// FlatNetworkIP `name` to the pod with `uid`.
    async fn allocated(
        &self,
        ips: &Api<FlatNetworkIP>,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
        deadline: tokio::time::Instant,
    ) -> Result<FlatNetworkIP, DesiredStateError> {
        let object = format!("FlatNetworkIP {namespace}/{name}");
        let uid = uid.map(str::to_owned);
        let condition =
            move |ip: Option<&FlatNetworkIP>| ip.is_some_and(|ip| is_allocated(ip, uid.as_deref()));
        let waited =
            tokio::time::timeout_at(deadline, await_condition(ips.clone(), name, condition)).await;
        match waited {
            Ok(Ok(Some(ip))) => Ok(ip),
            Ok(Ok(None)) => Err(DesiredStateError::NotAllocated(format!(
                "{object} was deleted while the pod was being set up; the pod will be retried"
            ))),
            Ok(Err(error)) => Err(DesiredStateError::Unavailable(format!(
                "cannot watch {object}: {error}"
            ))),
            Err(_) => Err(DesiredStateError::NotAllocated(format!(
                "{object} has no address for this pod after {}s; check that flatnet-operator runs and the pod's flatnetwork.pandaria.io annotations are valid (kubectl describe flip -n {namespace} {name})",
                self.allocation_wait.as_secs()
            ))),
        }
    }

    /// Whether the pod is dual stack: the network configuration names two
    /// subnets, or the operator made the second record `<pod>.ipv6`. (The
    /// operator creates both records before allocating either.) Read from
    /// the copy when the first record came from it (`primary_followed`).
    async fn is_dual_stack(
        &self,
        request: &ClaimRequest,
        ips: &Api<FlatNetworkIP>,
        namespace: &str,
        secondary: &str,
        primary_followed: bool,
    ) -> Result<bool, DesiredStateError> {
        let configured = request
            .subnet
            .as_deref()
            .is_some_and(|s| s.split(',').filter(|n| !n.trim().is_empty()).count() > 1);
        if configured {
            return Ok(true);
        }
        // The operator creates both records before it allocates either,
        // and one watch delivers them in order: a copy that shows the first
        // allocated has seen the second made.
        let found = match self.followed.get().filter(|_| primary_followed) {
            Some(followed) => followed
                .ips
                .get(namespace, secondary)
                .map(|ip| (*ip).clone()),
            None => ips.get_opt(secondary).await.map_err(|e| {
                DesiredStateError::Unavailable(format!(
                    "cannot read FlatNetworkIP {namespace}/{secondary}: {e}"
                ))
            })?,
        };
        let uid = request.pod.uid.as_deref();
        Ok(found
            .is_some_and(|ip| uid.is_none_or(|u| ip.spec.pod_id.is_empty() || ip.spec.pod_id == u)))
    }

    /// The subnet an allocated FlatNetworkIP names, its address with the
    /// subnet's prefix length, and the MAC it asks for.
    async fn subnet_and_address(
        &self,
        namespace: &str,
        ip: FlatNetworkIP,
    ) -> Result<(NamedSubnet, (IpNet, Option<MacAddr>)), DesiredStateError> {
        let object = format!("FlatNetworkIP {namespace}/{}", ip.name_any());
        let subnet_name = ip.spec.subnet.clone();
        let subnets: Api<FlatNetworkSubnet> =
            Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        let followed = self
            .followed
            .get()
            .and_then(|f| f.subnets.get(SUBNET_NAMESPACE, &subnet_name))
            .map(|subnet| (*subnet).clone());
        let subnet = match followed {
            Some(subnet) => Some(subnet),
            None => subnets.get_opt(&subnet_name).await.map_err(|e| {
                DesiredStateError::Unavailable(format!(
                    "cannot read FlatNetworkSubnet {SUBNET_NAMESPACE}/{subnet_name}: {e}"
                ))
            })?,
        }
        .ok_or_else(|| {
                DesiredStateError::SubnetNotFound(format!(
                    "FlatNetworkSubnet {SUBNET_NAMESPACE}/{subnet_name} named by {object} does not exist; create it or fix the pod's subnet annotation"
                ))
            })?;
        let named = NamedSubnet {
            name: subnet_name,
            spec: subnet.spec,
            ipv6to4: ip
                .annotations()
                .get(annotation::IPV6_TO_4)
                .is_some_and(|v| !v.is_empty()),
        };
        let valid = named
            .validate()
            .map_err(|e| DesiredStateError::InvalidDefinition(e.to_string()))?;
        let status = ip.status.unwrap_or_default();
        let addr = status.addr.expect("checked by is_allocated");
        let address = IpNet::new(addr, valid.cidr.prefix_len()).map_err(|_| {
            DesiredStateError::InvalidDefinition(format!(
                "{object} holds {addr}, which is not of the family of subnet {} ({})",
                named.name, valid.cidr
            ))
        })?;
        let mac = Some(status.mac.as_str())
            .filter(|m| !m.is_empty())
            .and_then(parse_mac);
        Ok((named, (address, mac)))
    }
}

/// STATUS's view of a FlatNetworkSubnet: free addresses are the operator's
/// count of its pool less `usedIP`, unknown until the operator counted it.
fn subnet_capacity(subnet: FlatNetworkSubnet) -> SubnetCapacity {
    let name = subnet.name_any();
    let status = subnet.status.unwrap_or_default();
    let named = NamedSubnet {
        name,
        spec: subnet.spec,
        // Only the pool matters here.
        ipv6to4: false,
    };
    let free = named.validate().ok().and_then(|valid| {
        (status.total_ip_count > 0).then(|| {
            let mut pool = Pool::new(&valid);
            pool.reserve_ranges(&status.used_ranges());
            pool.free()
        })
    });
    SubnetCapacity::of(&named, free)
}

/// The FlatNetworkIPs of attachment `key` of pod `pod_name` on `subnets`
/// subnets: for the runtime's attachment the pod's own and its second
/// record for dual stack; for a hot-plugged interface the one the
/// PodNetworkConfig controller made for it (`<pod>.if-<interface>`).
fn record_names(
    key: &AttachmentKey,
    pod_name: &str,
    subnets: usize,
) -> Result<Vec<String>, DesiredStateError> {
    if key.is_hotplug() {
        let name = hotplug_record_name(pod_name, &key.ifname)
            .map_err(DesiredStateError::InvalidRequest)?;
        return Ok(vec![name]);
    }
    let mut names = vec![pod_name.to_owned()];
    if subnets > 1 {
        names.push(secondary_name(pod_name));
    }
    Ok(names)
}

/// The interface a hot-plugged interface's FlatNetworkIP asks this node
/// (`node`) for: labelled with the interface and the node, allocated to its
/// pod, not being deleted.
fn hotplug_of(ip: &FlatNetworkIP, node: &str) -> Option<HotplugAttachment> {
    let ifname = ip.labels().get(label::HOTPLUG_INTERFACE)?;
    let on_node = ip.labels().get(label::NODE).is_some_and(|n| n == node);
    let uid = &ip.spec.pod_id;
    if !on_node
        || uid.is_empty()
        || ip.metadata.deletion_timestamp.is_some()
        || !is_allocated(ip, Some(uid))
    {
        return None;
    }
    Some(HotplugAttachment {
        // A pod UID is unique and a valid CNI identifier; the interface
        // name completes the key.
        name: uid.clone(),
        netns: None,
        pod: PodRef {
            namespace: ip.namespace(),
            name: Some(ip.pod_name()),
            uid: Some(uid.clone()),
        },
        // The subnet names the network: a record moved to another subnet
        // is another interface.
        network: ip.spec.subnet.clone(),
        ifname: ifname.clone(),
    })
}

/// The name of a dual-stack pod's second FlatNetworkIP.
pub fn secondary_name(pod_name: &str) -> String {
    format!("{pod_name}{SECONDARY_RECORD_SUFFIX}")
}

/// Whether the operator has allocated `ip` for the pod with `uid`.
pub fn is_allocated(ip: &FlatNetworkIP, uid: Option<&str>) -> bool {
    let owned = match uid {
        Some(uid) => ip.spec.pod_id.is_empty() || ip.spec.pod_id == uid,
        None => true,
    };
    owned && ip.status.as_ref().is_some_and(|s| s.addr.is_some())
}

impl DesiredState for Kubernetes {
    const REPORTS_ACTIVE: bool = true;

    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<DesiredInterface, DesiredStateError> {
        let (namespace, pod_name) = Self::pod_names(&request.pod)?;
        let hotplug = request.key.is_hotplug();
        let first = record_names(&request.key, pod_name, 1)?.remove(0);
        let name = first.as_str();
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        let uid = request.pod.uid.as_deref();
        // One bound for the whole claim, both records of a dual-stack pod included.
        let deadline = tokio::time::Instant::now() + self.allocation_wait;
        let followed = self.followed_allocation(namespace, name, uid);
        let primary_followed = followed.is_some();
        let primary = match followed {
            Some(ip) => ip,
            None => self.allocated(&ips, namespace, name, uid, deadline).await?,
        };
        let mut records = vec![primary];
        let secondary = secondary_name(name);
        // A hot-plugged interface has one record, of one subnet.
        if !hotplug
            && self
                .is_dual_stack(request, &ips, namespace, &secondary, primary_followed)
                .await?
        {
            let followed = self.followed_allocation(namespace, &secondary, uid);
            records.push(match followed {
                Some(ip) => ip,
                None => {
                    self.allocated(&ips, namespace, &secondary, uid, deadline)
                        .await?
                }
            });
        }
        let mut claim = DesiredInterface {
            subnets: Vec::new(),
            addresses: Vec::new(),
            mac: None,
        };
        for ip in records {
            let (subnet, address) = self.subnet_and_address(namespace, ip).await?;
            claim.subnets.push(subnet);
            claim.addresses.push(address.0);
            // The pod has one interface: the first record's MAC is its MAC.
            claim.mac = claim.mac.or(address.1);
        }
        if let [first, second] = claim.subnets.as_slice() {
            let same_link = |s: &NamedSubnet| {
                s.validate()
                    .ok()
                    .map(|v| (v.parent, v.link_mode, v.cidr.family()))
            };
            let (a, b) = (same_link(first), same_link(second));
            if a.as_ref().map(|a| (&a.0, a.1)) != b.as_ref().map(|b| (&b.0, b.1))
                || a.map(|a| a.2) == b.map(|b| b.2)
            {
                return Err(DesiredStateError::InvalidDefinition(format!(
                    "the dual-stack pod {namespace}/{name} names subnets {} and {}, which must be \
                     one IPv4 and one IPv6 subnet on the same master, VLAN and mode; fix the pod's \
                     subnet annotation",
                    first.name, second.name
                )));
            }
        }
        Ok(claim)
    }

    async fn report_active(
        &self,
        key: &AttachmentKey,
        pod: &PodRef,
        subnets: &[NamedSubnet],
        mac: MacAddr,
        mtu: u32,
    ) -> Result<(), DesiredStateError> {
        let (namespace, pod_name) = Self::pod_names(pod)?;
        for name in record_names(key, pod_name, subnets.len())? {
            if !self.follows_active(namespace, &name, mac, mtu) {
                self.mark_active(namespace, &name, mac, mtu).await?;
            }
        }
        Ok(())
    }

    async fn subnet_mtus(&self) -> BTreeMap<String, Option<u32>> {
        // Only from the watch-driven copy (the agent always keeps one): a
        // list per look would cost the API server one request per node per
        // second.
        let Some(followed) = self.followed.get() else {
            return BTreeMap::new();
        };
        if !followed.subnets.is_complete() {
            return BTreeMap::new();
        }
        followed
            .subnets
            .store
            .state()
            .iter()
            .map(|s| (s.name_any(), s.spec.mtu))
            .collect()
    }

    async fn hotplug_attachments(&self) -> Option<Vec<HotplugAttachment>> {
        // The PodNetworkConfig controller asks for each hot-plugged
        // interface with its FlatNetworkIP; the copy of every FlatNetworkIP
        // the agent keeps anyway holds them (no watch or request more).
        let followed = self.followed.get()?;
        if !followed.ips.is_complete() {
            return None;
        }
        let mut wanted: Vec<HotplugAttachment> = followed
            .ips
            .store
            .state()
            .iter()
            .filter_map(|ip| hotplug_of(ip, &self.node))
            .collect();
        // The store's order is arbitrary; the pass compares lists.
        wanted.sort_by_key(HotplugAttachment::key);
        Some(wanted)
    }

    async fn report_hotplug(
        &self,
        attachment: &HotplugAttachment,
        failure: Option<&str>,
    ) -> Result<(), DesiredStateError> {
        let (namespace, pod_name) = Self::pod_names(&attachment.pod)?;
        let name = hotplug_record_name(pod_name, &attachment.ifname)
            .map_err(DesiredStateError::InvalidRequest)?;
        let (status, reason, message) = match failure {
            None => (
                "True",
                "Hotplugged",
                format!(
                    "interface {} is in the pod, on node {}",
                    attachment.ifname, self.node
                ),
            ),
            Some(why) => (
                "False",
                "HotplugFailed",
                format!("node {}: {why}", self.node),
            ),
        };
        // Written when the copy shows otherwise: a pass that finds every
        // interface as reported writes nothing.
        let shown = self
            .followed
            .get()
            .and_then(|f| f.ips.get(namespace, &name))
            .and_then(|ip| {
                let status = ip.status.as_ref()?;
                let condition = status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == CONDITION_ATTACHED)?;
                Some((condition.status.clone(), condition.message.clone()))
            });
        if shown
            .as_ref()
            .is_some_and(|(s, m)| s == status && *m == message)
        {
            return Ok(());
        }
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        let generation = self
            .followed
            .get()
            .and_then(|f| f.ips.get(namespace, &name))
            .and_then(|ip| ip.meta().generation)
            .unwrap_or(0);
        let condition = json!({
            "type": CONDITION_ATTACHED,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": Timestamp::now().to_string(),
            "observedGeneration": generation,
        });
        let patch = Patch::Apply(json!({
            "apiVersion": FlatNetworkIP::api_version(&()),
            "kind": FlatNetworkIP::kind(&()),
            "status": {"conditions": [condition]},
        }));
        match ips
            .patch_status(
                &name,
                &PatchParams::apply(HOTPLUG_FIELD_MANAGER).force(),
                &patch,
            )
            .await
        {
            Ok(_) => Ok(()),
            // Gone meanwhile: the next pass removes the interface.
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(DesiredStateError::Unavailable(format!(
                "cannot report on FlatNetworkIP {namespace}/{name}: {e}"
            ))),
        }
    }

    async fn primary_mtus(&self) -> Option<Vec<PrimaryMtu>> {
        // The operator asks in this node's FlatNetworkNodeConfig; none is
        // asked while it is absent.
        let config = self.followed_node_config()?;
        let mut wanted: Vec<PrimaryMtu> = config
            .iter()
            .flat_map(|c| c.spec.pods.iter())
            .filter(|p| !p.uid.is_empty())
            .map(|p| PrimaryMtu {
                name: p.uid.clone(),
                netns: None,
                pod: PodRef {
                    namespace: Some(p.namespace.clone()),
                    name: Some(p.name.clone()),
                    uid: Some(p.uid.clone()),
                },
                mtu: p.mtu,
                tcp_mss_clamp: p.tcp_mss_clamp,
            })
            .collect();
        wanted.sort_by(|a, b| a.name.cmp(&b.name));
        Some(wanted)
    }

    async fn node_links(&self) -> Option<crate::link::NodeLinks> {
        let config = self.followed_node_config()?;
        Some(config.map_or_else(Default::default, |c| {
            super::node_links_of(&c.spec.vlans, &c.spec.bridges)
        }))
    }

    async fn report_node_links(
        &self,
        results: &BTreeMap<String, Option<String>>,
    ) -> Result<(), DesiredStateError> {
        let Some(Some(config)) = self.followed_node_config() else {
            return Ok(());
        };
        let links: Vec<NodeLinkResult> = results
            .iter()
            .map(|(name, failure)| NodeLinkResult {
                name: name.clone(),
                failure: failure.clone().unwrap_or_default(),
            })
            .collect();
        let generation = config.metadata.generation;
        let shown = config
            .status
            .as_ref()
            .map(|s| (s.observed_generation, s.links.as_slice()));
        if shown == Some((generation, links.as_slice())) {
            return Ok(());
        }
        self.report_on_node_config(
            NODE_LINKS_FIELD_MANAGER,
            json!({"observedGeneration": generation, "links": links}),
        )
        .await
    }

    async fn report_primary_mtus(
        &self,
        results: &[(PrimaryMtu, Option<String>)],
    ) -> Result<(), DesiredStateError> {
        let Some(Some(config)) = self.followed_node_config() else {
            // Nothing asks any more: nobody to tell.
            return Ok(());
        };
        let mut results: Vec<PrimaryMtuResult> = results
            .iter()
            .map(|(want, failure)| PrimaryMtuResult {
                uid: want.name.clone(),
                mtu: want.mtu,
                tcp_mss_clamp: want.tcp_mss_clamp,
                failure: failure.clone().unwrap_or_default(),
            })
            .collect();
        results.sort_by(|a, b| a.uid.cmp(&b.uid));
        let shown = config.status.as_ref().map(|s| s.pods.as_slice());
        if shown == Some(results.as_slice()) {
            return Ok(());
        }
        self.report_on_node_config(
            NODE_CONFIG_FIELD_MANAGER,
            json!({"podCount": results.len(), "pods": results}),
        )
        .await
    }

    async fn report_mtu(
        &self,
        key: &AttachmentKey,
        pod: &PodRef,
        subnets: &[NamedSubnet],
        mtu: u32,
    ) -> Result<(), DesiredStateError> {
        let (namespace, pod_name) = Self::pod_names(pod)?;
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        // A field manager of its own: an apply of the MTU alone under the
        // Active status's manager would drop that status's other fields.
        let params = PatchParams::apply(MTU_FIELD_MANAGER).force();
        for name in record_names(key, pod_name, subnets.len())? {
            let status = Patch::Apply(json!({
                "apiVersion": FlatNetworkIP::api_version(&()),
                "kind": FlatNetworkIP::kind(&()),
                "status": {"mtu": mtu},
            }));
            ips.patch_status(&name, &params, &status)
                .await
                .map_err(|e| {
                    DesiredStateError::Unavailable(format!(
                        "cannot record MTU {mtu} in FlatNetworkIP {namespace}/{name}: {e}"
                    ))
                })?;
        }
        Ok(())
    }

    async fn release(&self, _network: &str, _key: &AttachmentKey) -> Result<(), DesiredStateError> {
        // The operator releases the addresses when the pod is deleted.
        Ok(())
    }

    async fn release_except(
        &self,
        _network: &str,
        _keep: &[AttachmentKey],
    ) -> Result<(), DesiredStateError> {
        Ok(())
    }

    fn readiness(&self) -> Result<(), String> {
        if self.synced.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err("the Kubernetes API has not been reached yet".into())
        }
    }

    async fn capacity(
        &self,
        _network: &str,
        subnet: Option<&str>,
    ) -> Result<Vec<SubnetCapacity>, DesiredStateError> {
        let subnets: Api<FlatNetworkSubnet> =
            Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        let unavailable = |e: kube::Error| {
            DesiredStateError::Unavailable(format!(
                "cannot read FlatNetworkSubnets in {SUBNET_NAMESPACE}: {e}"
            ))
        };
        // Every network shares the subnets: pods choose theirs by annotation.
        let found = match subnet {
            Some(list) => {
                let mut found = Vec::new();
                for name in list.split(',').map(str::trim) {
                    let subnet = subnets.get_opt(name).await.map_err(unavailable)?.ok_or_else(|| {
                        DesiredStateError::SubnetNotFound(format!(
                            "FlatNetworkSubnet {SUBNET_NAMESPACE}/{name} named by the network configuration does not exist"
                        ))
                    })?;
                    found.push(subnet);
                }
                found
            }
            None => {
                subnets
                    .list(&ListParams::default())
                    .await
                    .map_err(unavailable)?
                    .items
            }
        };
        Ok(found.into_iter().map(subnet_capacity).collect())
    }

    fn upcoming_addresses(&self) -> Option<Vec<UpcomingAddress>> {
        let followed = self.followed.get()?;
        let (pods, subnets) = (followed.pods.objects()?, &followed.subnets);
        let mut upcoming = Vec::new();
        // Each subnet validated once per call, however many pods use it.
        let mut valid: BTreeMap<String, Option<ValidSubnet>> = BTreeMap::new();
        for pod in pods {
            // The API server makes every new pod Pending; a pod past that
            // has had its ADD.
            let running_or_done = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|phase| phase != "Pending");
            if pod.metadata.deletion_timestamp.is_some() || running_or_done {
                continue;
            }
            let (namespace, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
            for record in [name.clone(), secondary_name(&name)] {
                let Some(ip) = followed.ips.get(&namespace, &record) else {
                    continue;
                };
                let attached = ip.status.as_ref().is_some_and(|s| s.phase == "Active");
                if attached || !is_allocated(&ip, pod.metadata.uid.as_deref()) {
                    continue;
                }
                let subnet = valid
                    .entry(ip.spec.subnet.clone())
                    .or_insert_with(|| {
                        subnets
                            .get(SUBNET_NAMESPACE, &ip.spec.subnet)
                            .and_then(|subnet| validate_subnet(&ip.spec.subnet, &subnet.spec).ok())
                    })
                    .clone();
                if let (Some(subnet), Some(addr)) =
                    (subnet, ip.status.as_ref().and_then(|s| s.addr))
                {
                    upcoming.push(UpcomingAddress { subnet, addr });
                }
            }
        }
        Some(upcoming)
    }

    fn upcoming_changed(&self) -> Option<Arc<tokio::sync::Notify>> {
        Some(Arc::clone(&self.followed.get()?.upcoming))
    }

    async fn report_conflict(
        &self,
        pod: &PodRef,
        conflict: &Conflict,
    ) -> Result<(), DesiredStateError> {
        let (namespace, name) = Self::pod_names(pod)?;
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        let unavailable = |e: kube::Error| {
            DesiredStateError::Unavailable(format!(
                "cannot report a conflict on FlatNetworkIP {namespace}/{name}: {e}"
            ))
        };
        let ip = ips.get(name).await.map_err(unavailable)?;
        let message = format!(
            "address {} is also claimed by MAC {} ({}) on node {}",
            conflict.addr,
            format_mac(conflict.foreign_mac),
            conflict.kind.name(),
            self.node
        );
        self.recorder
            .publish(
                &Event {
                    type_: EventType::Warning,
                    reason: "IPConflict".into(),
                    note: Some(message.clone()),
                    action: "WatchAddress".into(),
                    secondary: None,
                },
                &ip.object_ref(&()),
            )
            .await
            .map_err(unavailable)?;
        let condition = json!({
            "type": "IPConflict",
            "status": "True",
            "reason": "ForeignClaim",
            "message": message,
            "lastTransitionTime": Timestamp::now().to_string(),
            "observedGeneration": ip.meta().generation.unwrap_or(0),
        });
        let status = json!({
            "apiVersion": FlatNetworkIP::api_version(&()),
            "kind": FlatNetworkIP::kind(&()),
            "status": {"conditions": [condition]},
        });
        ips.patch_status(
            &ip.name_any(),
            &PatchParams::apply(IP_CONFLICT_FIELD_MANAGER).force(),
            &Patch::Apply(status),
        )
        .await
        .map_err(unavailable)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subnet(status: serde_json::Value) -> FlatNetworkSubnet {
        serde_json::from_value(json!({
            "apiVersion": "flatnetwork.pandaria.io/v1",
            "kind": "FlatNetworkSubnet",
            "metadata": {"name": "lan", "namespace": SUBNET_NAMESPACE},
            "spec": {
                "flatMode": "macvlan", "master": "eth1", "cidr": "192.0.2.0/24",
                "gateway": "192.0.2.1",
                "ranges": [{"from": "192.0.2.10", "to": "192.0.2.13"}]
            },
            "status": status
        }))
        .unwrap()
    }

    #[test]
    fn capacity_is_the_pool_less_used_ip_once_the_operator_counted_it() {
        let counted = subnet_capacity(subnet(json!({
            "phase": "Active", "totalIPCount": 4, "usedIPCount": 3,
            "usedIP": [{"from": "192.0.2.1", "to": "192.0.2.1"},
                       {"from": "192.0.2.10", "to": "192.0.2.11"}]
        })));
        assert_eq!(counted.name, "lan");
        assert_eq!(counted.master, "eth1");
        assert_eq!(counted.free, Some(2));
        let full = subnet_capacity(subnet(json!({
            "phase": "Active", "totalIPCount": 4,
            "usedIP": [{"from": "192.0.2.10", "to": "192.0.2.13"}]
        })));
        assert_eq!(full.free, Some(0));
        // Not counted yet: unknown, never reported exhausted.
        assert_eq!(subnet_capacity(subnet(json!({}))).free, None);
    }
}
