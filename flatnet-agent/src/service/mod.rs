//! The agent's CNI service: [`AgentService`] implements
//! [`CniHandler`] on top of a [`DesiredState`] source, the link layer, the
//! eBPF tables and the attachment records.
//!
//! ADD: claim (subnet, address, MAC) → pending record → conflict probe →
//! attach → data-plane tables → activate → ready record → result. Any
//! failure undoes every step in reverse, including the allocation. The
//! work runs in its own task holding the attachment's lock, so a request
//! dropped at its deadline still finishes or rolls back, and the runtime's
//! DEL that follows waits for it.

mod activity;
mod conflicts;
mod locks;
pub mod metrics;
pub mod phases;
pub mod spec;

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use flatnet_k8s::validation::ValidSubnet;

use crate::{
    cni::{
        AttachRequest, CniError, CniResult, DetachRequest, ErrorCode, GcRequest, NetworkConfig,
        StatusRequest,
    },
    datapath::{ConflictMonitor, Datapath, DatapathError, PinnedMaps},
    desired::{AttachmentKey, ClaimRequest, DesiredInterface, DesiredState, PodRef},
    link::{AttachmentSpec, Attachments, DetachSpec, LinkError, LinkMode, format_mac, parse_mac},
    netns::{is_netns, open_netns, run_in_netns},
    policy_controller::{self, PodTables, PolicyTrigger},
    probe,
    records::{AttachmentRecord, RecordPhase, Records, UplinkRecord},
    rpc::CniHandler,
};

pub use metrics::Metrics;
use phases::timed;
pub use spec::SpecSettings;
use tracing::Instrument;

/// Settings of the CNI service.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// This node's name (Kubernetes status, logs).
    pub node_name: String,
    /// The link layer (node namespace, VLAN leases, announcements).
    pub attachments: Attachments,
    /// How long the conflict probe listens; zero turns it off.
    pub probe_wait: Duration,
    /// Settings shaping every attachment.
    pub spec: SpecSettings,
}

/// The CNI handler of the agent. Clones share one service.
pub struct AgentService<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for AgentService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<S> {
    config: ServiceConfig,
    desired: S,
    records: Records,
    datapath: Mutex<DatapathTables>,
    /// The address tables, through their pins: apart from the programs, so
    /// listing or removing a pod's addresses never waits for an attach.
    maps: Mutex<PinnedMaps>,
    locks: locks::KeyLocks,
    metrics: Arc<Metrics>,
    limiter: conflicts::RateLimiter,
    owners: conflicts::Owners,
    /// Told when attachments change, so the policy controller recompiles.
    policy_trigger: std::sync::OnceLock<PolicyTrigger>,
    /// Pending moves of policy programs into TCX links, by attachment.
    upgrades: Mutex<HashMap<AttachmentKey, tokio::task::AbortHandle>>,
    /// Commands waiting for their answer (the moves wait for none).
    activity: Arc<activity::Activity>,
}

/// Where DEL sends its answer.
type Answer = tokio::sync::oneshot::Sender<Result<(), CniError>>;

/// How long after its ADD a pod's policy programs move from filters into
/// TCX links: a pod deleted sooner never makes the kernel wait for the
/// links' RCU grace periods (which it does holding RTNL).
const TCX_UPGRADE_DELAY: Duration = Duration::from_secs(1);

/// The loaded data plane and the uplinks its program is attached to.
struct DatapathTables {
    datapath: Datapath,
    uplinks: BTreeSet<String>,
}

impl<S: DesiredState> AgentService<S> {
    /// The service over `desired`, `records` and a loaded `datapath`.
    pub fn new(
        config: ServiceConfig,
        desired: S,
        records: Records,
        datapath: Datapath,
        metrics: Arc<Metrics>,
    ) -> Result<Self, DatapathError> {
        let maps = datapath.pinned_maps()?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                desired,
                records,
                datapath: Mutex::new(DatapathTables {
                    datapath,
                    uplinks: BTreeSet::new(),
                }),
                locks: locks::KeyLocks::default(),
                metrics,
                limiter: conflicts::RateLimiter::new(conflicts::REPORT_INTERVAL),
                owners: conflicts::Owners::default(),
                policy_trigger: std::sync::OnceLock::new(),
                upgrades: Mutex::new(HashMap::new()),
                activity: Arc::default(),
                maps: Mutex::new(maps),
            }),
        })
    }

    /// Has `trigger` told whenever an attachment is added or removed (the
    /// standalone policy controller takes local pod addresses from the
    /// records). Only the first call takes effect.
    pub fn set_policy_trigger(&self, trigger: PolicyTrigger) {
        let _ = self.inner.policy_trigger.set(trigger);
    }

    /// The desired-state source.
    pub fn desired(&self) -> &S {
        &self.inner.desired
    }

    /// Whether ADD can be served; the reason when not (CNI STATUS, `/readyz`).
    pub fn readiness(&self) -> Result<(), String> {
        self.inner.desired.readiness().map_err(|reason| {
            format!(
                "flatnet-agent cannot serve ADD yet: {reason} ({} desired state)",
                self.inner.desired.kind()
            )
        })
    }

    /// Brings the node in line with the records after a (re)start: ADDs
    /// interrupted by a crash are undone, completed ones get their uplink
    /// program and table entries back.
    pub async fn recover(&self) -> Result<(), CniError> {
        let inner = Arc::clone(&self.inner);
        spawn(async move {
            let records = inner.records.all().map_err(internal)?;
            for record in records {
                let _guard = inner.locks.lock(&record.key).await;
                match record.phase {
                    RecordPhase::Pending => {
                        tracing::warn!(key = %record.key, "undoing an ADD interrupted by an agent restart");
                        if let Err(error) = inner.teardown(&record, true).await {
                            tracing::error!(key = %record.key, %error, "cannot undo an interrupted ADD; DEL or GC will retry");
                        }
                    }
                    RecordPhase::Deleting => {
                        tracing::warn!(key = %record.key, "finishing a DEL interrupted by an agent restart");
                        if let Err(error) = inner.teardown(&record, true).await {
                            tracing::error!(key = %record.key, %error, "cannot finish an interrupted DEL; GC will retry");
                        }
                    }
                    RecordPhase::Ready => {
                        if let Some(uplink) = &record.uplink
                            && let Err(error) = inner.program_tables(&record, uplink).await
                        {
                            tracing::error!(key = %record.key, %error, "cannot restore data-plane entries");
                        }
                        // Replaces the programs in place: the pod interface
                        // is never without policy enforcement.
                        if is_netns(&record.netns)
                            && let Err(error) = inner.attach_policy(&record)
                        {
                            tracing::error!(key = %record.key, %error, "cannot re-attach the policy programs");
                        }
                    }
                }
            }
            // Pods deleted while the agent was down left their pins.
            inner.remove_defunct_links(None);
            Ok(())
        })
        .await
    }

    /// Follows the conflict monitor until it fails: every conflict is
    /// logged, counted and reported (rate limited per address).
    pub async fn watch_conflicts(&self, mut monitor: ConflictMonitor) {
        loop {
            match monitor.next().await {
                Ok(conflict) => Arc::clone(&self.inner).on_conflict(conflict),
                Err(error) => {
                    tracing::error!(%error, "the conflict monitor failed; conflicts are no longer reported");
                    return;
                }
            }
        }
    }
}

impl<S: DesiredState> Inner<S> {
    /// Moves the policy programs of `key` from the filters its ADD
    /// attached into TCX links, [`TCX_UPGRADE_DELAY`] later unless a DEL
    /// comes first, one pod at a time and only while no CNI command waits
    /// for its answer (each move holds RTNL and the data-plane lock through
    /// two RCU grace periods). TCX runs the programs for less per packet;
    /// the links replace the filters only once in place, so the pod is
    /// never without its policy.
    fn upgrade_policy_later(self: &Arc<Self>, key: AttachmentKey) {
        let inner = Arc::clone(self);
        let task_key = key.clone();
        let task = tokio::spawn(async move {
            tokio::time::sleep(TCX_UPGRADE_DELAY).await;
            let _turn = inner.activity.background_turn().await;
            let _guard = inner.locks.lock(&task_key).await;
            inner
                .upgrades
                .lock()
                .expect("upgrade table poisoned")
                .remove(&task_key);
            let record = match inner.records.load(&task_key) {
                Ok(Some(record)) if record.phase == RecordPhase::Ready && record.netns.exists() => {
                    record
                }
                _ => return,
            };
            let worker = Arc::clone(&inner);
            let moved = tokio::task::spawn_blocking(move || worker.attach_policy(&record))
                .await
                .map_err(internal)
                .and_then(|attached| attached);
            if let Err(error) = moved {
                tracing::warn!(key = %task_key, %error, "cannot move the policy programs into TCX links; the filters stay");
            }
        });
        let previous = self
            .upgrades
            .lock()
            .expect("upgrade table poisoned")
            .insert(key, task.abort_handle());
        if let Some(previous) = previous {
            previous.abort();
        }
    }
}

/// Runs `work` in its own task: dropping the caller (deadline) does not
/// cancel it, and a panic becomes error 100.
async fn spawn<T: Send + 'static>(
    work: impl Future<Output = Result<T, CniError>> + Send + 'static,
) -> Result<T, CniError> {
    tokio::spawn(work)
        .await
        .unwrap_or_else(|error| Err(task_failed(&error)))
}

/// Runs `work` on a blocking thread with a runtime of its own. Deleting a
/// link blocks the sending thread in the kernel until RCU callbacks ran
/// (15-40 ms): on the agent's few runtime threads, a handful of DELs would
/// stall every other request.
async fn on_own_thread<T: Send + 'static, E: std::fmt::Display>(
    work: impl Future<Output = Result<T, E>> + Send + 'static,
) -> Result<T, String> {
    // Its phases stay those of the calling command.
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a runtime for the work: {e}"))?
            .block_on(work.instrument(span))
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Error 100 for a task that panicked or was cancelled.
fn task_failed(error: &tokio::task::JoinError) -> CniError {
    CniError::new(
        ErrorCode::AgentInternal,
        format!("flatnet-agent failed internally: {error}; see the flatnet-agent log"),
    )
}

fn internal(error: impl std::fmt::Display) -> CniError {
    CniError::new(ErrorCode::AgentInternal, format!("flatnet-agent: {error}"))
}

fn key_of(attachment: &crate::cni::Attachment) -> AttachmentKey {
    AttachmentKey {
        container_id: attachment.container_id.clone(),
        ifname: attachment.ifname.clone(),
    }
}

fn pod_of(attachment: &crate::cni::Attachment) -> PodRef {
    PodRef {
        namespace: attachment.args.pod_namespace.clone(),
        name: attachment.args.pod_name.clone(),
        uid: attachment.args.pod_uid.clone(),
    }
}

fn join_ips(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn link_error(error: &LinkError) -> CniError {
    CniError::new(ErrorCode::InterfaceSetup, error.to_string())
}

impl<S: DesiredState> CniHandler for AgentService<S> {
    async fn add(&self, request: AttachRequest) -> Result<CniResult, CniError> {
        let inner = Arc::clone(&self.inner);
        let key = key_of(&request.attachment);
        let _busy = self.inner.activity.busy();
        spawn(
            async move {
                let (result, upgrade) = inner.add(request).await?;
                if upgrade {
                    inner.upgrade_policy_later(key);
                }
                Ok(result)
            }
            .instrument(phases::command("add")),
        )
        .await
    }

    async fn check(&self, request: AttachRequest) -> Result<(), CniError> {
        self.inner.check(request).await
    }

    async fn del(&self, request: DetachRequest) -> Result<(), CniError> {
        let inner = Arc::clone(&self.inner);
        let _busy = self.inner.activity.busy();
        let (answer, answered) = tokio::sync::oneshot::channel();
        // The work goes on after the answer (deleting the interface); it
        // always sends one, so a dropped sender means it failed.
        let work = tokio::spawn(
            async move { inner.del(request, answer).await }.instrument(phases::command("del")),
        );
        match answered.await {
            Ok(result) => result,
            Err(_) => Err(match work.await {
                Err(error) => task_failed(&error),
                Ok(()) => internal("DEL ended without an answer; see the flatnet-agent log"),
            }),
        }
    }

    async fn status(&self, _request: StatusRequest) -> Result<(), CniError> {
        self.readiness()
            .map_err(|reason| CniError::new(ErrorCode::PluginNotAvailable, reason))
    }

    async fn gc(&self, request: GcRequest) -> Result<(), CniError> {
        let inner = Arc::clone(&self.inner);
        spawn(async move { inner.gc(request).await }).await
    }
}

impl<S: DesiredState> Inner<S> {
    /// ADD; also says whether the policy programs are to move into TCX
    /// links after the answer ([`Self::upgrade_policy_later`]).
    async fn add(&self, request: AttachRequest) -> Result<(CniResult, bool), CniError> {
        // Before anything is claimed: a pending record with a namespace
        // nothing can enter would outlive every later request.
        open_netns(&request.netns)
            .map_err(|e| CniError::new(ErrorCode::InvalidEnvironment, e.to_string()))?;
        let key = key_of(&request.attachment);
        let _guard = self
            .locks
            .lock(&key)
            .instrument(phases::phase("lock"))
            .await;
        let config = &request.config;
        let earlier = timed("record_load", || self.records.load(&key)).map_err(internal)?;
        if let Some(record) = earlier {
            if record.network != config.name {
                return Err(CniError::new(
                    ErrorCode::InvalidEnvironment,
                    format!(
                        "CNI_IFNAME {} of container {} is already attached to network {:?} ({}); \
                         DEL it from that network first, or give network {:?} another interface name",
                        key.ifname,
                        key.container_id,
                        record.network,
                        join_ips(&record.ips()),
                        config.name
                    ),
                ));
            }
            if record.phase == RecordPhase::Ready && record.netns == request.netns {
                // A repeated ADD: the same answer.
                let subnets = spec::valid_subnets(&record)?;
                let attachment = spec::attachment_spec(&record, &subnets, &self.config.spec)?;
                return Ok((
                    spec::cni_result(&attachment, record.mac.as_deref(), &config.dns),
                    false,
                ));
            }
            tracing::info!(key = %key, "replacing an earlier or unfinished attachment of the same network");
            self.teardown(&record, true).await?;
        }

        let claim_request = claim_request(&request, key.clone())?;
        let claim = self
            .desired
            .claim(&claim_request)
            .instrument(phases::phase("claim"))
            .await
            .map_err(|e| e.to_cni())?;
        let mut record = AttachmentRecord {
            key: key.clone(),
            network: config.name.clone(),
            netns: request.netns.clone(),
            pod: claim_request.pod.clone(),
            phase: RecordPhase::Pending,
            subnets: claim.subnets.clone(),
            addresses: claim.addresses.clone(),
            requested_mac: claim.mac.map(format_mac),
            mac: None,
            mtu: config.mtu,
            uplink: None,
            host_route: None,
            primary_defaults: None,
            parent: None,
        };
        // Validated once; the parent link goes into the record for teardown.
        let subnets = match spec::valid_subnets(&record) {
            Ok(subnets) => subnets,
            Err(error) => {
                self.release_quietly(&record).await;
                return Err(error);
            }
        };
        record.parent = subnets.first().map(|s| s.parent.clone());
        if let Err(error) = self
            .read_primary_network(&mut record)
            .instrument(phases::phase("primary_network"))
            .await
        {
            self.release_quietly(&record).await;
            return Err(link_error(&error));
        }
        if let Err(error) = timed("record_pending", || self.records.save(&record)) {
            self.release_quietly(&record).await;
            return Err(internal(error));
        }
        match self
            .set_up(&mut record, &subnets, &claim, &config.dns)
            .await
        {
            Ok(result) => Ok(result),
            Err((error, created_interface)) => {
                if let Err(undo) = self.teardown(&record, created_interface).await {
                    tracing::error!(key = %key, error = %undo, "cannot undo a failed ADD; DEL or GC will retry");
                }
                Err(error)
            }
        }
    }

    /// What removing the attachment must know of the pod's primary network,
    /// read before anything is made: the node routes to the pod
    /// (`addPodIPToHost`) and the default gateways the flat interface takes
    /// over (`flatNetworkDefaultGateway`).
    async fn read_primary_network(&self, record: &mut AttachmentRecord) -> Result<(), LinkError> {
        let attachments = &self.config.attachments;
        if spec::wants_host_route(record) {
            record.host_route = Some(
                attachments
                    .resolve_host_route(&record.netns, spec::PRIMARY_IFNAME)
                    .await?,
            );
        }
        if spec::moves_default_route(record) {
            record.primary_defaults = Some(
                attachments
                    .primary_defaults(&record.netns, spec::PRIMARY_IFNAME)
                    .await?,
            );
        }
        Ok(())
    }

    /// The steps after the claim. On error, also says whether the pod
    /// interface may be flatnet's (so teardown may delete it).
    async fn set_up(
        &self,
        record: &mut AttachmentRecord,
        subnets: &[ValidSubnet],
        claim: &DesiredInterface,
        dns: &crate::cni::Dns,
    ) -> Result<(CniResult, bool), (CniError, bool)> {
        let attachment =
            spec::attachment_spec(record, subnets, &self.config.spec).map_err(|e| (e, false))?;
        let valid = attachment.validate().map_err(|e| {
            (
                CniError::new(ErrorCode::InvalidNetworkConfig, e.to_string()),
                false,
            )
        })?;
        self.probe(&attachment, record)
            .instrument(phases::phase("probe"))
            .await
            .map_err(|e| (e, false))?;

        let attached = self
            .config
            .attachments
            .attach_valid(&valid)
            .instrument(phases::phase("link_attach"))
            .await;
        let made = match attached {
            Ok(made) => made,
            // The pod's existing interface is not ours: leave it alone.
            Err(error @ LinkError::AlreadyExists { .. }) => {
                return Err((link_error(&error), false));
            }
            Err(error) => return Err((link_error(&error), true)),
        };
        // The interface, its addresses and node routes exist; the record
        // still says pending.
        crate::crash_point::crash_point("add-attached");
        let mac = made.mac;
        let owner_mac = match attachment.kind {
            LinkMode::Macvlan(_) => Some(mac),
            // ipvlan children share the parent's MAC; the parent's is read below.
            LinkMode::Ipvlan(..) => None,
        };
        let uplink = Self::uplink_record(&made, owner_mac, !attachment.kind.announces());
        record.mac = Some(format_mac(mac));
        record.uplink = Some(uplink.clone());
        timed("record_attached", || self.records.save(record)).map_err(|e| (internal(e), true))?;
        self.program_tables(record, &uplink)
            .instrument(phases::phase("tables"))
            .await
            .map_err(|e| (e, true))?;
        let upgrade =
            timed("policy_attach", || self.attach_policy_at_once(record)).map_err(|e| (e, true))?;
        self.desired
            .activate(&record.pod, claim, mac)
            .instrument(phases::phase("activate"))
            .await
            .map_err(|e| (e.to_cni(), true))?;
        record.phase = RecordPhase::Ready;
        timed("record_ready", || self.records.save(record)).map_err(|e| (internal(e), true))?;
        tracing::info!(key = %record.key, pod = %record.pod, addresses = ?record.ips(), mac = %format_mac(mac), "pod attached");
        self.policy_in_force_for(record)
            .instrument(phases::phase("policy_wait"))
            .await;
        Ok((
            spec::cni_result(&attachment, record.mac.as_deref(), dns),
            upgrade,
        ))
    }

    /// Asks the LAN whether the addresses are in use, from the parent
    /// interface (skipped while a VLAN interface does not exist yet, or when
    /// the master is missing: attach reports that).
    async fn probe(
        &self,
        attachment: &AttachmentSpec,
        record: &AttachmentRecord,
    ) -> Result<(), CniError> {
        let wait = self.config.probe_wait;
        if wait.is_zero() {
            return Ok(());
        }
        let parent = attachment.parent.ifname();
        let addrs = record.ips();
        let host = self.config.attachments.host_netns.clone();
        let probed = {
            let parent = parent.clone();
            tokio::task::spawn_blocking(move || {
                in_netns(host, || {
                    if probe::interface_info(&parent).is_err() {
                        return Ok(None);
                    }
                    probe::probe(&parent, &addrs, wait)
                })
            })
            .await
            .map_err(internal)?
        };
        match probed {
            Ok(Ok(None)) => Ok(()),
            Ok(Ok(Some(claim))) => Err(CniError::new(
                ErrorCode::AddressConflict,
                format!(
                    "address {} of {} is already in use on the LAN by MAC {} (answered on {parent}); \
                     free it on that host or give the pod another address",
                    claim.addr,
                    record.pod,
                    format_mac(claim.mac)
                ),
            )),
            Ok(Err(error)) => {
                tracing::warn!(%error, %parent, "conflict probe failed; continuing without it");
                Ok(())
            }
            Err(error) => {
                tracing::warn!(%error, %parent, "conflict probe failed; continuing without it");
                Ok(())
            }
        }
    }

    /// The uplink of `made` as the tables list it (index and MAC as the
    /// attach read them, no further look-up).
    fn uplink_record(
        made: &crate::link::Attachment,
        owner_mac: Option<[u8; 6]>,
        responder: bool,
    ) -> UplinkRecord {
        UplinkRecord {
            ifname: made.parent.clone(),
            ifindex: made.parent_index,
            owner_mac: format_mac(owner_mac.unwrap_or(made.parent_mac)),
            responder,
        }
    }

    /// Attaches the uplink program (once per uplink) and lists the pod's
    /// addresses in the managed-address table, and in the responder table
    /// for ipvlan L3/L3S.
    async fn program_tables(
        &self,
        record: &AttachmentRecord,
        uplink: &UplinkRecord,
    ) -> Result<(), CniError> {
        let owner =
            parse_mac(&uplink.owner_mac).ok_or_else(|| internal("bad owner MAC in record"))?;
        let host = self.config.attachments.host_netns.clone();
        {
            let mut tables = self.datapath.lock().expect("datapath lock poisoned");
            if !tables.uplinks.contains(&uplink.ifname) {
                let name = uplink.ifname.clone();
                let datapath = &mut tables.datapath;
                in_netns(host, || datapath.attach_uplink(&name))
                    .map_err(internal)?
                    .map_err(internal)?;
                tables.uplinks.insert(uplink.ifname.clone());
                tracing::info!(uplink = %uplink.ifname, "uplink program attached");
            }
        }
        let mut maps = self.maps.lock().expect("table maps lock poisoned");
        for addr in record.ips() {
            if uplink.responder {
                maps.responders()
                    .and_then(|mut r| r.insert(uplink.ifindex, addr, owner))
                    .map_err(internal)?;
            }
            maps.managed_addrs()
                .and_then(|mut m| m.insert(uplink.ifindex, addr, owner))
                .map_err(internal)?;
        }
        Ok(())
    }

    /// Attaches the policy programs (ingress and egress) to the pod's flat
    /// interface. A pod no policy isolates passes everything, so attaching
    /// always is correct, and later policy changes only rewrite maps.
    fn attach_policy(&self, record: &AttachmentRecord) -> Result<(), CniError> {
        let mut tables = self.datapath.lock().expect("datapath lock poisoned");
        let datapath = &mut tables.datapath;
        let ifname = &record.key.ifname;
        run_in_netns(&record.netns, || datapath.attach_policy(ifname))
            .map_err(internal)?
            .map_err(|e| {
                internal(format!(
                    "policy programs on {ifname} of {}: {e}",
                    record.pod
                ))
            })
    }

    /// [`Self::attach_policy`] on the answer path: through filters, which
    /// take effect at once (see [`Datapath::attach_policy_at_once`]).
    /// Returns whether the programs are to move into TCX links later.
    fn attach_policy_at_once(&self, record: &AttachmentRecord) -> Result<bool, CniError> {
        let mut tables = self.datapath.lock().expect("datapath lock poisoned");
        let datapath = &mut tables.datapath;
        let ifname = &record.key.ifname;
        run_in_netns(&record.netns, || datapath.attach_policy_at_once(ifname))
            .map_err(internal)?
            .map_err(|e| {
                internal(format!(
                    "policy programs on {ifname} of {}: {e}",
                    record.pod
                ))
            })
    }

    /// Tells the policy controller about a new pod and waits until the
    /// policy tables judge it as its policies say, so the pod's first
    /// packets are already isolated. After [`policy_controller::ADD_WAIT_LIMIT`]
    /// the ADD answers anyway (the tables follow with the next round).
    async fn policy_in_force_for(&self, record: &AttachmentRecord) {
        let Some(trigger) = self.policy_trigger.get() else {
            return;
        };
        let pod = policy_controller::record_pod_addresses(record);
        if trigger
            .pod_attached(&pod, policy_controller::ADD_WAIT_LIMIT)
            .await
            == PodTables::TimedOut
        {
            self.metrics.policy.add_wait_timeouts.inc();
            tracing::warn!(
                pod = %record.pod,
                limit = ?policy_controller::ADD_WAIT_LIMIT,
                "the network-policy tables do not include this pod yet; it is not isolated until they do"
            );
        }
    }

    /// Tells the policy controller that the set of attachments changed.
    fn policy_changed(&self) {
        if let Some(trigger) = self.policy_trigger.get() {
            trigger.changed();
        }
    }

    fn remove_tables(&self, record: &AttachmentRecord) -> Result<(), CniError> {
        let Some(uplink) = &record.uplink else {
            return Ok(());
        };
        let mut maps = self.maps.lock().expect("table maps lock poisoned");
        for addr in record.ips() {
            if uplink.responder {
                maps.responders()
                    .and_then(|mut r| r.remove(uplink.ifindex, addr))
                    .map_err(internal)?;
            }
            maps.managed_addrs()
                .and_then(|mut m| m.remove(uplink.ifindex, addr))
                .map_err(internal)?;
        }
        Ok(())
    }

    /// Removes everything of an attachment: table entries, the interface
    /// (when `delete_interface`), the allocation and the record. The record
    /// stays when something could not be removed, so a later DEL retries.
    async fn teardown(
        &self,
        record: &AttachmentRecord,
        delete_interface: bool,
    ) -> Result<(), CniError> {
        let mut errors = Vec::new();
        if let Err(error) = timed("tables_remove", || self.remove_tables(record)) {
            errors.push(error.msg);
        }
        if delete_interface {
            let netns = Some(record.netns.clone()).filter(|p: &PathBuf| p.exists());
            let detach = DetachSpec {
                netns,
                ifname: record.key.ifname.clone(),
                parent: record.parent_link(),
                host_route: record.host_route.clone(),
                primary_defaults: record.primary_defaults.clone(),
                addresses: record.ips(),
            };
            let attachments = self.config.attachments.clone();
            let detached = on_own_thread(async move { attachments.detach(&detach).await })
                .instrument(phases::phase("link_detach"))
                .await;
            if let Err(error) = detached {
                errors.push(error);
            }
        }
        timed("defunct_pins", || {
            self.remove_defunct_links(Some(&record.netns));
        });
        // The address stays allocated while the interface may still use it.
        if errors.is_empty()
            && let Err(error) = self
                .desired
                .release(&record.network, &record.key)
                .instrument(phases::phase("release"))
                .await
        {
            errors.push(error.to_string());
        }
        if !errors.is_empty() {
            return Err(CniError::new(
                ErrorCode::AgentInternal,
                format!(
                    "cannot remove {} of {}: {}",
                    record.key,
                    record.pod,
                    errors.join("; ")
                ),
            ));
        }
        timed("record_remove", || self.records.remove(&record.key)).map_err(internal)?;
        tracing::info!(key = %record.key, pod = %record.pod, "attachment removed");
        self.policy_changed();
        Ok(())
    }

    /// A deleted pod interface takes its programs with it, but the pins of
    /// their TCX links stay until removed: those of the pod namespace at
    /// `netns` (one DEL), or all (a restart; also when that namespace is
    /// already gone and its pins cannot be told apart).
    fn remove_defunct_links(&self, netns: Option<&Path>) {
        let tables = self.datapath.lock().expect("datapath lock poisoned");
        let removed = match netns.filter(|netns| netns.exists()) {
            Some(netns) => tables.datapath.remove_defunct_links_in(netns),
            None => tables.datapath.remove_defunct_links(),
        };
        match removed {
            Ok(removed) => {
                for pin in removed {
                    tracing::debug!(pin = %pin.display(), "removed the pin of a defunct TCX link");
                }
            }
            Err(error) => tracing::warn!(%error, "cannot remove the pins of defunct TCX links"),
        }
    }

    async fn release_quietly(&self, record: &AttachmentRecord) {
        if let Err(error) = self.desired.release(&record.network, &record.key).await {
            tracing::error!(key = %record.key, %error, "cannot release an allocation; GC will retry");
        }
    }

    /// DEL. Answers (through `answer`) once the pod's addresses are out of
    /// the data-plane tables. Deleting the interface (the kernel waits for
    /// RCU callbacks on every link deletion, 15 to 40 ms, and the runtime
    /// deletes the pod's namespace anyway), releasing the address and
    /// removing the record follow under the attachment's lock, so a later
    /// ADD, DEL or GC of it waits for them, and the address is not handed
    /// out again while the interface may still use it. Should they fail,
    /// the record stays and GC or the next DEL retries.
    async fn del(&self, request: DetachRequest, answer: Answer) {
        let key = key_of(&request.attachment);
        if let Some(upgrade) = self
            .upgrades
            .lock()
            .expect("upgrade table poisoned")
            .remove(&key)
        {
            upgrade.abort();
        }
        let until_answer = phases::phase("until_answer");
        let _guard = self
            .locks
            .lock(&key)
            .instrument(phases::phase("lock"))
            .await;
        let record = match timed("record_load", || self.records.load(&key)).map_err(internal) {
            Ok(Some(record)) if record.network == request.config.name => record,
            // The interface belongs to another network (the runtime cleaning
            // up after an ADD refused for that reason): only this network's
            // allocation, if any, goes. Otherwise nothing was created; an
            // allocation may exist if the agent stopped between claim and record.
            Ok(_) => {
                let released = self
                    .desired
                    .release(&request.config.name, &key)
                    .instrument(phases::phase("release"))
                    .await
                    .map_err(|e| e.to_cni());
                let _ = answer.send(released);
                return;
            }
            Err(error) => {
                let _ = answer.send(Err(error));
                return;
            }
        };
        // Durable before the answer: an agent killed after answering
        // finishes the removal at its restart instead of keeping the
        // attachment as if it were live.
        let mut record = record;
        record.phase = RecordPhase::Deleting;
        if let Err(error) = timed("record_deleting", || self.records.save(&record)) {
            let _ = answer.send(Err(internal(error)));
            return;
        }
        let answer = match timed("tables_remove", || self.remove_tables(&record)) {
            Ok(()) => {
                let _ = answer.send(Ok(()));
                drop(until_answer);
                crate::crash_point::crash_point("del-answered");
                None
            }
            // Answer with the outcome of the whole teardown instead.
            Err(error) => {
                tracing::warn!(key = %record.key, %error, "cannot remove the pod's table entries; retrying in the teardown");
                Some(answer)
            }
        };
        let result = self.teardown(&record, true).await;
        match answer {
            Some(answer) => {
                let _ = answer.send(result);
            }
            None => {
                if let Err(error) = result {
                    tracing::error!(key = %record.key, %error, "DEL answered, but removing the attachment failed; GC or the next DEL retries");
                }
            }
        }
    }

    async fn gc(&self, request: GcRequest) -> Result<(), CniError> {
        let network = &request.config.name;
        let keep: Vec<AttachmentKey> = request
            .valid_attachments
            .iter()
            .map(|v| AttachmentKey {
                container_id: v.container_id.clone(),
                ifname: v.ifname.clone(),
            })
            .collect();
        let mut errors = Vec::new();
        let records = self.records.all().map_err(internal)?;
        for record in records
            .iter()
            .filter(|r| &r.network == network && !keep.contains(&r.key))
        {
            let _guard = self.locks.lock(&record.key).await;
            // Re-read under the lock: a concurrent DEL may have finished it.
            match self.records.load(&record.key) {
                Ok(Some(current)) => {
                    tracing::info!(key = %current.key, "GC: removing a stale attachment");
                    if let Err(error) = self.teardown(&current, true).await {
                        errors.push(error.msg);
                    }
                }
                Ok(None) => {}
                Err(error) => errors.push(error.to_string()),
            }
        }
        // Allocations whose record is gone (or never written).
        let mut still_recorded: Vec<AttachmentKey> = keep;
        if let Ok(records) = self.records.all() {
            still_recorded.extend(
                records
                    .into_iter()
                    .filter(|r| &r.network == network)
                    .map(|r| r.key),
            );
        }
        if let Err(error) = self.desired.release_except(network, &still_recorded).await {
            errors.push(error.to_string());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(CniError::new(
                ErrorCode::AgentInternal,
                format!(
                    "GC of network {network:?} left work undone: {}",
                    errors.join("; ")
                ),
            ))
        }
    }

    async fn check(&self, request: AttachRequest) -> Result<(), CniError> {
        let key = key_of(&request.attachment);
        let record = self
            .records
            .load(&key)
            .map_err(internal)?
            .filter(|r| r.phase == RecordPhase::Ready && r.network == request.config.name)
            .ok_or_else(|| {
                CniError::new(
                    ErrorCode::UnknownContainer,
                    format!(
                        "flatnet-agent has no attachment of {key} on network {:?}; run ADD first",
                        request.config.name
                    ),
                )
            })?;
        if let Some(prev) = &request.config.prev_result {
            let listed: Vec<IpAddr> = prev.ips.iter().map(|ip| ip.address.addr).collect();
            if let Some(missing) = record.ips().into_iter().find(|ip| !listed.contains(ip)) {
                return Err(CniError::new(
                    ErrorCode::InterfaceSetup,
                    format!(
                        "prevResult of {key} lacks the pod address {missing}; the runtime's cached result is stale"
                    ),
                ));
            }
        }
        let subnets = spec::valid_subnets(&record)?;
        let mut attachment = spec::attachment_spec(&record, &subnets, &self.config.spec)?;
        attachment.netns = request.netns.clone();
        self.config
            .attachments
            .check(&attachment)
            .await
            .map_err(|e| link_error(&e))
    }

    /// Counts, logs and (once per address per interval) reports one
    /// conflict. The report goes out in its own task: conflicts behind it
    /// are not held up by its round trips to the API server.
    fn on_conflict(self: Arc<Self>, conflict: crate::datapath::Conflict) {
        self.metrics.conflict();
        if !self.limiter.allow(conflict.addr) {
            return;
        }
        let owner = self
            .owners
            .find(&self.records, conflict.ifindex, conflict.addr);
        let pod = owner.as_ref().map(|r| r.pod.clone()).unwrap_or_default();
        tracing::warn!(%conflict, %pod, "IP conflict: another host claims a pod address");
        if owner.is_some() {
            tokio::spawn(async move {
                if let Err(error) = self.desired.report_conflict(&pod, &conflict).await {
                    tracing::warn!(%error, %pod, "cannot report the IP conflict");
                }
            });
        }
    }
}

/// What ADD asks the desired state for.
fn claim_request(request: &AttachRequest, key: AttachmentKey) -> Result<ClaimRequest, CniError> {
    let config: &NetworkConfig = &request.config;
    let runtime = config.runtime_config.as_ref();
    let requested_mac = match runtime {
        Some(runtime) => runtime.requested_mac()?.map(|mac| mac.0),
        None => None,
    };
    Ok(ClaimRequest {
        network: config.name.clone(),
        subnet: config.subnet.clone(),
        key,
        pod: pod_of(&request.attachment),
        requested_ips: runtime
            .map(|r| r.ips.iter().map(|ip| ip.addr).collect())
            .unwrap_or_default(),
        requested_mac,
    })
}

/// Runs `work` in the node namespace `host` (the calling thread's when `None`).
fn in_netns<T: Send>(
    host: Option<PathBuf>,
    work: impl FnOnce() -> T + Send,
) -> Result<T, crate::netns::NetnsError> {
    match host {
        Some(path) => run_in_netns(&path, work),
        None => Ok(work()),
    }
}
