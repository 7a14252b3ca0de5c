//! The network-policy controller: keeps the policy tables in the pinned
//! maps in line with the MultiNetworkPolicies, without an operator's hand.
//!
//! A source (the Kubernetes API through watchers, [`kubernetes`]; or the
//! standalone state file and the attachment records, [`standalone`])
//! says *that* something changed through a [`PolicyTrigger`]; the
//! [`PolicyController`] waits a short debounce so a burst of changes is
//! compiled once, takes a [`PolicySnapshot`], compiles it and installs it
//! with [`PolicyMaps::apply`]. The pod-interface programs are attached on
//! every CNI ADD (see `cni_service`), so an update only rewrites maps.

pub mod cluster;
pub mod kubernetes;
pub mod metrics;
pub mod report;
pub mod standalone;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::sync::watch;

use crate::{
    cluster_settings::SettingsView,
    datapath::{ApplyReport, DatapathError, PolicyMaps, PolicyRuleIds},
    policy_compiler::{
        CompiledPolicy, FlatPod, MultiNetworkPolicy, NetworkNames, PolicyInputs, compile,
        selector::Labels,
    },
    records::AttachmentRecord,
};

pub use metrics::PolicyMetrics;
pub use report::{DiagnosticEvents, DiagnosticLog, NoEvents};

/// How long the controller waits after a change before compiling, so a
/// burst of changes (a rollout, a relist) is compiled once.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// How long a CNI ADD waits for the tables of its pod before it answers
/// anyway (with a warning and `flatnet_agent_policy_add_wait_timeouts_total`).
pub const ADD_WAIT_LIMIT: Duration = Duration::from_secs(3);

/// A pod as the installed tables know it: namespace, name, address.
pub type LocalPodAddress = (String, String, IpAddr);

/// What the controller installed last.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InstalledView {
    /// Rounds installed since the agent started.
    pub rounds: u64,
    /// Policies for the flat network in force.
    pub policies_in_force: usize,
    /// The local pods (with each address) the tables were compiled for.
    pub local_pods: BTreeSet<LocalPodAddress>,
}

impl InstalledView {
    fn of(snapshot: &PolicySnapshot, policies_in_force: usize, rounds: u64) -> Self {
        let local_pods = snapshot
            .pods
            .iter()
            .filter(|p| p.local)
            .flat_map(|p| {
                p.ips
                    .iter()
                    .map(|ip| (p.namespace.clone(), p.name.clone(), *ip))
            })
            .collect();
        Self {
            rounds,
            policies_in_force,
            local_pods,
        }
    }

    /// Whether a pod with these addresses is judged by the installed
    /// tables as its policies say: the tables include it, or no policy is
    /// in force (so nothing isolates it).
    fn covers(&self, pod: &[LocalPodAddress]) -> bool {
        self.rounds > 0
            && (self.policies_in_force == 0 || pod.iter().all(|p| self.local_pods.contains(p)))
    }
}

/// The pod of an attachment as the tables know it: (namespace, name) of
/// the pod (`default` and the container id when the runtime did not say).
pub fn record_pod(record: &AttachmentRecord) -> (String, String) {
    let namespace = record
        .pod
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = record
        .pod
        .name
        .clone()
        .unwrap_or_else(|| record.key.container_id.clone());
    (namespace, name)
}

/// Each address of the pod of `record`, as [`InstalledView`] lists them.
pub fn record_pod_addresses(record: &AttachmentRecord) -> Vec<LocalPodAddress> {
    let (namespace, name) = record_pod(record);
    record
        .ips()
        .into_iter()
        .map(|ip| (namespace.clone(), name.clone(), ip))
        .collect()
}

/// How waiting for a new pod's tables ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodTables {
    /// The installed tables judge the pod as its policies say.
    InForce,
    /// No round including the pod within the limit.
    TimedOut,
}

/// Everything the compiler needs, as one consistent copy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicySnapshot {
    /// Every known MultiNetworkPolicy (those not for the flat network are
    /// ignored by the compiler).
    pub policies: Vec<MultiNetworkPolicy>,
    /// Namespace name → labels.
    pub namespaces: BTreeMap<String, Labels>,
    /// Every flat pod; `local` ones get tables.
    pub pods: Vec<FlatPod>,
}

/// Tells the controller that its inputs changed. Cheap to clone; changes
/// signalled while a round runs lead to one more round.
#[derive(Clone, Debug)]
pub struct PolicyTrigger {
    sender: Arc<watch::Sender<u64>>,
    /// CNI ADDs waiting for their pod's tables.
    waiting: Arc<AtomicUsize>,
    installed: watch::Receiver<InstalledView>,
}

/// The controller's end of a [`PolicyTrigger`].
#[derive(Debug)]
pub struct PolicyChanges {
    receiver: watch::Receiver<u64>,
    waiting: Arc<AtomicUsize>,
    installed: watch::Sender<InstalledView>,
}

impl PolicyTrigger {
    /// A trigger and the receiving end for the controller.
    pub fn new() -> (Self, PolicyChanges) {
        let (sender, receiver) = watch::channel(0);
        let (installed_sender, installed) = watch::channel(InstalledView::default());
        let waiting = Arc::new(AtomicUsize::new(0));
        (
            Self {
                sender: Arc::new(sender),
                waiting: Arc::clone(&waiting),
                installed,
            },
            PolicyChanges {
                receiver,
                waiting,
                installed: installed_sender,
            },
        )
    }

    /// Signals a change.
    pub fn changed(&self) {
        self.sender.send_modify(|generation| *generation += 1);
    }

    /// Signals that a pod was attached and waits, at most `limit`, until the
    /// installed tables judge it as its policies say. A waiting ADD ends
    /// the debounce at once, so this takes one compile; ADDs arriving
    /// while it runs share the next.
    pub async fn pod_attached(&self, pod: &[LocalPodAddress], limit: Duration) -> PodTables {
        let mut installed = self.installed.clone();
        if installed.borrow_and_update().covers(pod) {
            // Usually in Kubernetes mode: the pod and its address were
            // known before the ADD. Still recompile for the attachment.
            self.changed();
            return PodTables::InForce;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        // Told after `waiting` grew, so the controller sees both together.
        self.changed();
        let covered = tokio::time::timeout(limit, async {
            loop {
                if installed.changed().await.is_err() {
                    return false;
                }
                if installed.borrow_and_update().covers(pod) {
                    return true;
                }
            }
        })
        .await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        match covered {
            Ok(true) => PodTables::InForce,
            Ok(false) | Err(_) => PodTables::TimedOut,
        }
    }
}

impl PolicyChanges {
    /// Waits for a change, then for `debounce` (cut short as soon as a CNI
    /// ADD waits: its answer waits for this round), and consumes every
    /// change signalled meanwhile. `false` when every trigger is gone.
    async fn next_round(&mut self, debounce: Duration) -> bool {
        if self.receiver.changed().await.is_err() {
            return false;
        }
        let deadline = tokio::time::Instant::now() + debounce;
        loop {
            if self.waiting.load(Ordering::SeqCst) > 0 {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => break,
                changed = self.receiver.changed() => if changed.is_err() { break },
            }
        }
        self.receiver.borrow_and_update();
        true
    }

    /// Publishes what a round installed, for waiting ADDs.
    fn installed(&self, snapshot: &PolicySnapshot, policies_in_force: usize) {
        self.installed.send_modify(|view| {
            *view = InstalledView::of(snapshot, policies_in_force, view.rounds + 1);
        });
    }
}

/// Where compiled tables go: the pinned maps in the agent, a recorder in
/// tests.
pub trait PolicySink: Send + 'static {
    /// Installs `compiled`, replacing what was installed before.
    fn install(&mut self, compiled: &CompiledPolicy) -> Result<ApplyReport, DatapathError>;
}

/// The pinned policy maps, with the rule counter ids of this agent run.
pub struct PinnedPolicy {
    maps: PolicyMaps,
    ids: PolicyRuleIds,
}

impl PinnedPolicy {
    /// Installs into `maps`.
    pub fn new(maps: PolicyMaps) -> Self {
        Self {
            maps,
            ids: PolicyRuleIds::default(),
        }
    }
}

impl PolicySink for PinnedPolicy {
    fn install(&mut self, compiled: &CompiledPolicy) -> Result<ApplyReport, DatapathError> {
        self.maps.apply(compiled, &mut self.ids)
    }
}

/// Compiles snapshots and installs them, with metrics and diagnostics.
pub struct PolicyController<S> {
    sink: S,
    networks: NetworkNames,
    metrics: PolicyMetrics,
    debounce: Duration,
    log: DiagnosticLog,
    /// Whether policies are enforced (always, without a view).
    enforcement: Option<SettingsView>,
    /// Enforcement as the last round installed it.
    enforced: Option<bool>,
}

impl<S: PolicySink> PolicyController<S> {
    /// A controller installing into `sink` the policies whose `policy-for`
    /// names one of `networks`.
    pub fn new(sink: S, networks: NetworkNames, metrics: PolicyMetrics) -> Self {
        metrics.enforced.set(1);
        Self {
            sink,
            networks,
            metrics,
            debounce: DEBOUNCE,
            log: DiagnosticLog::default(),
            enforcement: None,
            enforced: None,
        }
    }

    /// Enforces policies only while `settings` say so: when enforcement is
    /// off, the tables installed hold no policy, so nothing is filtered.
    /// Pair it with [`follow_enforcement`], which starts a round on each
    /// change.
    #[must_use]
    pub fn enforcing_as(mut self, settings: SettingsView) -> Self {
        self.enforcement = Some(settings);
        self.metrics.enforced.set(i64::from(self.enforces()));
        self
    }

    fn enforces(&self) -> bool {
        self.enforcement
            .as_ref()
            .is_none_or(|s| s.current().policy_enforcement)
    }

    /// Compiles and installs one snapshot; returns how many policies for
    /// the flat network are now in force. Diagnostics not reported for the
    /// same policy before are logged and handed to `events`.
    pub async fn apply(
        &mut self,
        snapshot: &PolicySnapshot,
        events: &mut impl DiagnosticEvents,
    ) -> Result<usize, DatapathError> {
        let started = std::time::Instant::now();
        let enforced = self.enforces();
        let compiled = compile(PolicyInputs {
            policies: if enforced { &snapshot.policies } else { &[] },
            networks: &self.networks,
            namespaces: &snapshot.namespaces,
            pods: &snapshot.pods,
        });
        let installed = self.sink.install(&compiled);
        self.metrics
            .last_apply_seconds
            .set(started.elapsed().as_secs_f64());
        let report = match installed {
            Ok(report) => report,
            Err(error) => {
                self.metrics.apply_failures.inc();
                return Err(error);
            }
        };
        let selected = self.policies_in_force(snapshot);
        if self.enforced != Some(enforced) {
            if enforced {
                tracing::info!(policies = selected, "network policy enforcement on");
            } else {
                tracing::warn!(
                    policies_not_enforced = selected,
                    "network policy enforcement off: every flat pod sends and receives unfiltered"
                );
            }
            self.enforced = Some(enforced);
        }
        let in_force = if enforced { selected } else { 0 };
        self.metrics.enforced.set(i64::from(enforced));
        self.metrics.applies.inc();
        self.metrics.policies.set(gauge(in_force));
        self.metrics
            .diagnostics
            .set(gauge(compiled.diagnostics.len()));
        if report.entries_written + report.entries_removed > 0 {
            tracing::info!(
                policies = in_force,
                written = report.entries_written,
                removed = report.entries_removed,
                isolated_addresses = report.subjects,
                "network policy applied"
            );
        }
        for news in self.log.news(&snapshot.policies, &compiled.diagnostics) {
            for message in &news.messages {
                tracing::warn!(object = %news.object, "network policy: {message}");
            }
            if let Some(policy) = &news.policy {
                events.publish(policy, &news.messages).await;
            }
        }
        Ok(in_force)
    }

    /// The policies of `snapshot` for the flat network.
    fn policies_in_force(&self, snapshot: &PolicySnapshot) -> usize {
        snapshot
            .policies
            .iter()
            .filter(|p| {
                let namespace = p.metadata.namespace.as_deref().unwrap_or("default");
                self.networks
                    .selects(namespace, p.metadata.annotations.as_ref())
            })
            .count()
    }

    /// Runs until every trigger is gone: after each (debounced) change,
    /// compiles and installs what `snapshot` returns. `None` means the
    /// source is not complete yet (for example a watch has not listed
    /// everything), and nothing is installed: installing a partial view
    /// could open or close more than the policies say.
    pub async fn run(
        mut self,
        mut changes: PolicyChanges,
        mut snapshot: impl FnMut() -> Option<PolicySnapshot> + Send,
        mut events: impl DiagnosticEvents,
    ) {
        while changes.next_round(self.debounce).await {
            let Some(current) = snapshot() else {
                tracing::debug!("policy inputs incomplete; waiting for the sources to sync");
                continue;
            };
            match self.apply(&current, &mut events).await {
                Ok(in_force) => changes.installed(&current, in_force),
                Err(error) => {
                    tracing::error!(%error, "cannot install the network policy; the previous tables stay in force until the next change");
                }
            }
        }
    }
}

/// Starts a policy round through `trigger` each time policy enforcement is
/// turned on or off in `settings`, for as long as they can change.
pub async fn follow_enforcement(mut settings: SettingsView, trigger: PolicyTrigger) {
    let mut enforced = settings.current().policy_enforcement;
    while let Some(now) = settings.changed().await {
        if now.policy_enforcement != enforced {
            enforced = now.policy_enforcement;
            trigger.changed();
        }
    }
}

/// A count as a gauge value (saturating: no count comes near `i64::MAX`).
fn gauge(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records what would be installed.
    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<CompiledPolicy>>>);

    impl PolicySink for Recorder {
        fn install(&mut self, compiled: &CompiledPolicy) -> Result<ApplyReport, DatapathError> {
            self.0.lock().unwrap().push(compiled.clone());
            Ok(ApplyReport::default())
        }
    }

    /// A controller for the default network installing into a recorder.
    fn recording_controller() -> (PolicyController<Recorder>, Recorder) {
        let recorder = Recorder::default();
        let controller = PolicyController::new(
            recorder.clone(),
            NetworkNames::default(),
            PolicyMetrics::default(),
        );
        (controller, recorder)
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_changes_is_compiled_once() {
        let (controller, recorder) = recording_controller();
        let (trigger, changes) = PolicyTrigger::new();
        let snapshots = Arc::new(Mutex::new(0));
        let counted = Arc::clone(&snapshots);
        let task = tokio::spawn(controller.run(
            changes,
            move || {
                *counted.lock().unwrap() += 1;
                Some(PolicySnapshot::default())
            },
            NoEvents,
        ));
        for _ in 0..50 {
            trigger.changed();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Past the debounce of the last change: one round for the burst
        // (the clock is paused, so this is exact).
        tokio::time::sleep(DEBOUNCE * 3).await;
        assert_eq!(recorder.0.lock().unwrap().len(), 1);
        trigger.changed();
        tokio::time::sleep(DEBOUNCE * 2).await;
        assert_eq!(
            recorder.0.lock().unwrap().len(),
            2,
            "a later change: one more round"
        );
        drop(trigger);
        task.await.unwrap();
        assert_eq!(*snapshots.lock().unwrap(), 2);
    }

    fn policy_for_the_flat_network() -> MultiNetworkPolicy {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
            "metadata": {"name": "deny", "namespace": "a",
                         "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
        }))
        .unwrap()
    }

    fn new_pod() -> Vec<LocalPodAddress> {
        vec![("a".into(), "web".into(), "10.0.0.1".parse().unwrap())]
    }

    /// A controller whose snapshots hold `policies` and, once `attached`
    /// is set, the pod of [`new_pod`].
    fn spawn_controller(
        policies: Vec<MultiNetworkPolicy>,
        attached: Arc<Mutex<bool>>,
    ) -> (PolicyTrigger, Recorder) {
        let (controller, recorder) = recording_controller();
        let (trigger, changes) = PolicyTrigger::new();
        tokio::spawn(controller.run(
            changes,
            move || {
                let pods = if *attached.lock().unwrap() {
                    vec![FlatPod {
                        namespace: "a".into(),
                        name: "web".into(),
                        labels: BTreeMap::new(),
                        ips: vec!["10.0.0.1".parse().unwrap()],
                        local: true,
                    }]
                } else {
                    Vec::new()
                };
                Some(PolicySnapshot {
                    policies: policies.clone(),
                    namespaces: BTreeMap::new(),
                    pods,
                })
            },
            NoEvents,
        ));
        (trigger, recorder)
    }

    #[tokio::test(start_paused = true)]
    async fn an_attached_pod_waits_for_a_round_that_includes_it() {
        let attached = Arc::new(Mutex::new(false));
        let (trigger, recorder) =
            spawn_controller(vec![policy_for_the_flat_network()], Arc::clone(&attached));
        trigger.changed();
        tokio::time::sleep(DEBOUNCE * 2).await;
        assert_eq!(recorder.0.lock().unwrap().len(), 1, "the first round");

        *attached.lock().unwrap() = true;
        let started = tokio::time::Instant::now();
        let outcome = trigger.pod_attached(&new_pod(), ADD_WAIT_LIMIT).await;
        assert_eq!(outcome, PodTables::InForce);
        let rounds = recorder.0.lock().unwrap().clone();
        assert_eq!(rounds.len(), 2, "one more round, for the pod");
        assert!(
            rounds[1]
                .subjects
                .contains_key(&"10.0.0.1".parse::<IpAddr>().unwrap()),
            "the round that answered the wait isolates the pod"
        );
        // The paused clock makes this exact: the wait skipped the debounce,
        // and no timer at all stood between the ADD and its round.
        assert!(started.elapsed() < DEBOUNCE, "{:?}", started.elapsed());
        assert_eq!(started.elapsed(), Duration::ZERO);

        // Known already: answered at once (one more round still follows).
        let outcome = trigger.pod_attached(&new_pod(), ADD_WAIT_LIMIT).await;
        assert_eq!(outcome, PodTables::InForce);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_policy_in_force_nothing_is_waited_for() {
        let (trigger, _recorder) = spawn_controller(Vec::new(), Arc::new(Mutex::new(false)));
        trigger.changed();
        tokio::time::sleep(DEBOUNCE * 2).await;
        let started = tokio::time::Instant::now();
        let outcome = trigger.pod_attached(&new_pod(), ADD_WAIT_LIMIT).await;
        assert_eq!(outcome, PodTables::InForce);
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_the_tables_never_include_times_out() {
        // The source never shows the pod (its record was lost, say).
        let (trigger, recorder) = spawn_controller(
            vec![policy_for_the_flat_network()],
            Arc::new(Mutex::new(false)),
        );
        let outcome = trigger.pod_attached(&new_pod(), ADD_WAIT_LIMIT).await;
        assert_eq!(outcome, PodTables::TimedOut);
        assert!(!recorder.0.lock().unwrap().is_empty(), "rounds ran");
    }

    #[tokio::test(start_paused = true)]
    async fn enforcement_turned_off_and_on_installs_open_then_isolating_tables() {
        use crate::cluster_settings::AgentSettings;
        use crate::link::ArpPolicy;
        use flatnet_common::policy::Direction;
        let enforcing = AgentSettings {
            probe_wait: Duration::ZERO,
            policy_enforcement: true,
            arp_policy: ArpPolicy::default(),
            proxy_arp: false,
        };
        let (settings, view) = SettingsView::channel(enforcing);
        let recorder = Recorder::default();
        let metrics = PolicyMetrics::default();
        let controller =
            PolicyController::new(recorder.clone(), NetworkNames::default(), metrics.clone())
                .enforcing_as(view.clone());
        let (trigger, changes) = PolicyTrigger::new();
        let policies = vec![policy_for_the_flat_network()];
        tokio::spawn(controller.run(
            changes,
            move || {
                Some(PolicySnapshot {
                    policies: policies.clone(),
                    namespaces: BTreeMap::new(),
                    pods: vec![FlatPod {
                        namespace: "a".into(),
                        name: "web".into(),
                        labels: BTreeMap::new(),
                        ips: vec!["10.0.0.1".parse().unwrap()],
                        local: true,
                    }],
                })
            },
            NoEvents,
        ));
        tokio::spawn(follow_enforcement(view, trigger.clone()));
        let pod: IpAddr = "10.0.0.1".parse().unwrap();
        // The policy denies every ingress to the pod.
        let isolates = |round: usize| {
            let rounds = recorder.0.lock().unwrap();
            let remote = "10.0.0.9".parse().unwrap();
            !rounds[round].allows(Direction::Ingress, pod, remote, 6, Some(80))
        };
        trigger.changed();
        tokio::time::sleep(DEBOUNCE * 2).await;
        assert_eq!(recorder.0.lock().unwrap().len(), 1);
        assert!(isolates(0), "enforced: the policy isolates the pod");
        assert_eq!((metrics.enforced.get(), metrics.policies.get()), (1, 1));

        // Turned off: a round starts by itself and installs open tables.
        settings.send_modify(|s| s.policy_enforcement = false);
        tokio::time::sleep(DEBOUNCE * 2).await;
        assert_eq!(
            recorder.0.lock().unwrap().len(),
            2,
            "one round for the change"
        );
        assert!(!isolates(1), "not enforced: nothing isolates the pod");
        assert_eq!(metrics.enforced.get(), 0);
        assert_eq!(metrics.policies.get(), 0, "no policy in force");
        // An ADD does not wait for tables that hold no policy.
        assert_eq!(
            trigger.pod_attached(&new_pod(), ADD_WAIT_LIMIT).await,
            PodTables::InForce
        );

        // (the ADD's own round)
        tokio::time::sleep(DEBOUNCE * 2).await;
        // A change of another setting starts no round.
        let rounds = recorder.0.lock().unwrap().len();
        settings.send_modify(|s| s.probe_wait = Duration::from_millis(5));
        tokio::time::sleep(DEBOUNCE * 2).await;
        assert_eq!(recorder.0.lock().unwrap().len(), rounds);

        settings.send_modify(|s| s.policy_enforcement = true);
        tokio::time::sleep(DEBOUNCE * 2).await;
        let last = recorder.0.lock().unwrap().len() - 1;
        assert_eq!(last, rounds, "one round for the change");
        assert!(isolates(last), "enforced again");
        assert_eq!((metrics.enforced.get(), metrics.policies.get()), (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn an_incomplete_source_installs_nothing() {
        let (controller, recorder) = recording_controller();
        let (trigger, changes) = PolicyTrigger::new();
        let task = tokio::spawn(controller.run(changes, || None, NoEvents));
        trigger.changed();
        tokio::time::sleep(DEBOUNCE * 3).await;
        drop(trigger);
        task.await.unwrap();
        assert!(recorder.0.lock().unwrap().is_empty());
    }
}
