//! The agent's CNI service: [`AgentService`] implements
//! [`CniHandler`] on top of a [`DesiredState`] source, the link layer, the
//! eBPF tables and the attachment records.
//!
//! ADD ([`add`]): claim (subnet, address, MAC) → pending record → conflict
//! probe → attach → data-plane tables → activate → ready record → result.
//! Any failure undoes every step in reverse, including the allocation.
//! DEL, GC and that undoing are [`teardown`]; the uplink program, the
//! address tables and the pod's policy programs are [`tables`]. Every
//! command runs in its own task holding the attachment's lock, so a
//! request dropped at its deadline still finishes or rolls back, and the
//! runtime's DEL that follows waits for it. Work that blocks (entering a
//! pod's namespace, the data-plane lock) runs on blocking threads, never
//! on the runtime's.

mod activation;
mod activity;
mod add;
mod conflict_check;
mod conflicts;
mod follow;
mod hotplug;
mod locks;
mod mtu;
mod node_links;
mod primary_mtu;
pub mod spec;
mod tables;
mod teardown;

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
    sync::{Arc, Mutex},
};

use tracing::Instrument;

use crate::{
    cni::{AttachRequest, CniError, CniResult, DetachRequest, ErrorCode, GcRequest, StatusRequest},
    datapath::{ConflictMonitor, Datapath, DatapathError, PinnedMaps},
    desired::{self, AttachmentKey, DesiredState, PodRef},
    link::{Attachments, LinkError},
    metrics::Metrics,
    netns::is_netns,
    phases,
    policy_controller::PolicyTrigger,
    records::{RecordPhase, Records},
    rpc::CniHandler,
};

pub use hotplug::{HOTPLUG_FOLLOW_INTERVAL, HotplugPass};
pub use mtu::{MTU_FOLLOW_INTERVAL, MtuPass};
pub use primary_mtu::{LEDGER_FILE, Ledger, PrimaryMtuPass, Remembered, read_ledger};
pub use spec::{Announcement, SpecSettings};
use tables::PolicyAttach;

/// Settings of the CNI service.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// This node's name (Kubernetes status, logs).
    pub node_name: String,
    /// The link layer (node namespace, VLAN leases, announcements).
    pub attachments: Attachments,
    /// The run-time settings (the conflict probe's wait, read by every ADD).
    pub settings: crate::cluster_settings::SettingsView,
    /// Where the network namespace of a pod the agent did not attach is
    /// found (hot-plugging); `None`: nowhere.
    pub pod_sandboxes: Option<crate::cri::PodSandboxes>,
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
    /// The node interfaces' MACs last written to `NODE_MACS` (under the
    /// `maps` lock): an ADD rewrites them only when they changed.
    node_macs: Mutex<Option<BTreeSet<[u8; 6]>>>,
    locks: locks::KeyLocks,
    metrics: Arc<Metrics>,
    limiter: conflicts::RateLimiter,
    owners: conflicts::Owners,
    /// The LAN's reply times per uplink, which size each ADD's wait for
    /// an answer to its conflict probe.
    reply_times: Arc<crate::probe::wait::ReplyTimes>,
    /// Conflict probes made ahead of ADDs (Kubernetes mode).
    ahead: crate::probe::ahead::AheadProbes,
    /// Told when attachments change, so the policy controller recompiles.
    policy_trigger: std::sync::OnceLock<PolicyTrigger>,
    /// Pending moves of policy programs into TCX links, by attachment.
    upgrades: Mutex<HashMap<AttachmentKey, tokio::task::AbortHandle>>,
    /// Active statuses being told, by attachment.
    active_reports: Mutex<HashMap<AttachmentKey, tokio::task::AbortHandle>>,
    /// Commands waiting for their answer (the moves wait for none).
    activity: Arc<activity::Activity>,
}

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
                reply_times: Arc::default(),
                ahead: crate::probe::ahead::AheadProbes::default(),
                policy_trigger: std::sync::OnceLock::new(),
                upgrades: Mutex::new(HashMap::new()),
                active_reports: Mutex::new(HashMap::new()),
                activity: Arc::default(),
                maps: Mutex::new(maps),
                node_macs: Mutex::new(None),
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

    /// Attaches the uplink program to `interface` in the node namespace
    /// unless it is there already: floating addresses are answered on
    /// interfaces no pod may use.
    ///
    /// # Errors
    /// The interface is missing or the attach failed.
    pub async fn attach_uplink(&self, interface: &str) -> Result<(), CniError> {
        let interface = interface.to_owned();
        self.inner
            .blocking(move |inner| inner.attach_uplink(&interface))
            .await
    }

    /// Has the kernel verify every program an ADD attaches now, one at a
    /// time under the data-plane lock (an ADD meanwhile waits for one
    /// program at most), so no pod's ADD waits for the verifier later.
    pub async fn verify_programs(&self) {
        for program in Datapath::ADD_PROGRAMS {
            let inner = Arc::clone(&self.inner);
            let loaded = tokio::task::spawn_blocking(move || {
                let mut tables = inner.datapath.lock().expect("datapath lock poisoned");
                tables.datapath.verify_program(program)
            })
            .await;
            match loaded {
                Ok(Ok(took)) => tracing::info!(program, ?took, "program verified and loaded"),
                Ok(Err(error)) => {
                    tracing::warn!(program, %error, "program not loaded; its first attach fails the same way");
                }
                Err(error) => tracing::warn!(program, %error, "loading the program failed"),
            }
        }
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
    /// interrupted by a crash are undone, DELs answered before a crash are
    /// finished, completed ADDs get their uplink
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
                        inner.report_active_later(&record);
                        if let Some(uplink) = &record.uplink
                            && let Err(error) = inner.program_tables(&record, uplink).await
                        {
                            tracing::error!(key = %record.key, %error, "cannot restore data-plane entries");
                        }
                        // Replaces the programs in place: the pod interface
                        // is never without policy enforcement.
                        if is_netns(&record.netns)
                            && let Err(error) =
                                inner.attach_policy(&record, PolicyAttach::InPlace).await
                        {
                            tracing::error!(key = %record.key, %error, "cannot re-attach the policy programs");
                        }
                    }
                }
            }
            // Pods deleted while the agent was down left their pins.
            inner.remove_defunct_links(None).await;
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
    /// Runs `work` on a blocking thread, in the current phase span:
    /// entering a pod's namespace starts a thread and waits for it, and the
    /// data-plane lock is held over netlink; neither may stall the
    /// runtime's threads.
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        work: impl FnOnce(&Self) -> Result<T, CniError> + Send + 'static,
    ) -> Result<T, CniError> {
        let inner = Arc::clone(self);
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || span.in_scope(|| work(&inner)))
            .await
            .unwrap_or_else(|error| Err(task_failed(&error)))
    }

    /// How an attachment of `network` made now is announced.
    fn announcement(&self, network: &crate::cni::NetworkConfig) -> spec::Announcement {
        spec::Announcement::of(network, &self.config.settings.current())
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
    let code = match error {
        // A configuration the node cannot carry, not a failed setup.
        LinkError::MtuTooLarge { .. } => ErrorCode::InvalidNetworkConfig,
        _ => ErrorCode::InterfaceSetup,
    };
    CniError::new(code, error.to_string())
}

impl<S: DesiredState> CniHandler for AgentService<S> {
    async fn add(&self, request: AttachRequest) -> Result<CniResult, CniError> {
        let inner = Arc::clone(&self.inner);
        let key = key_of(&request.attachment);
        let _busy = self.inner.activity.busy();
        spawn(
            async move {
                let added = inner.add(request).await?;
                if added.upgrade_policy {
                    inner.upgrade_policy_later(key);
                }
                Ok(added.result)
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

    async fn status(&self, request: StatusRequest) -> Result<(), CniError> {
        self.readiness()
            .map_err(|reason| CniError::new(ErrorCode::PluginNotAvailable, reason))?;
        let config = &request.config;
        let subnets = self
            .inner
            .desired
            .capacity(&config.name, config.subnet.as_deref())
            .await
            .map_err(|e| CniError::new(ErrorCode::PluginNotAvailable, e.to_string()))?;
        let links = self
            .inner
            .config
            .attachments
            .host_link_names()
            .await
            .map_err(|e| CniError::new(ErrorCode::PluginNotAvailable, e.to_string()))?;
        desired::status::evaluate(&config.name, config.subnet.is_some(), &subnets, |name| {
            links.contains(name)
        })
    }

    async fn gc(&self, request: GcRequest) -> Result<(), CniError> {
        let inner = Arc::clone(&self.inner);
        spawn(async move { inner.gc(request).await }).await
    }
}

impl<S: DesiredState> Inner<S> {
    /// CHECK: the recorded attachment is still as ADD made it.
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
        let mut attachment = spec::attachment_spec(
            &record,
            &subnets,
            &self.config.spec,
            self.announcement(&request.config),
        )?;
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
