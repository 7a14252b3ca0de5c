//! The network-policy controller: keeps the policy tables in the pinned
//! maps in line with the MultiNetworkPolicies, without an operator's hand.
//!
//! A source (the Kubernetes API through watchers, [`kubernetes`]; or the
//! standalone state file and the attachment records, [`standalone`])
//! says *that* something changed through a [`PolicyTrigger`]; the
//! [`PolicyController`] waits a short debounce so a burst of changes is
//! compiled once, takes a [`PolicySnapshot`], compiles it and installs it
//! with [`PolicyMaps::apply`]. The pod-interface programs are attached on
//! every CNI ADD (see `service`), so an update only rewrites maps.

pub mod cluster;
pub mod kubernetes;
pub mod report;
pub mod standalone;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use tokio::sync::watch;

use crate::{
    datapath::{ApplyReport, DatapathError, PolicyMaps, PolicyRuleIds},
    policy::{
        CompiledPolicy, FlatPod, MultiNetworkPolicy, NetworkNames, PolicyInputs, compile,
        selector::Labels,
    },
    service::metrics::PolicyMetrics,
};

pub use report::{DiagnosticEvents, DiagnosticLog, NoEvents};

/// How long the controller waits after a change before compiling, so a
/// burst of changes (a rollout, a relist) is compiled once.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

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
}

/// The controller's end of a [`PolicyTrigger`].
#[derive(Debug)]
pub struct PolicyChanges {
    receiver: watch::Receiver<u64>,
}

impl PolicyTrigger {
    /// A trigger and the receiving end for the controller.
    pub fn new() -> (Self, PolicyChanges) {
        let (sender, receiver) = watch::channel(0);
        (
            Self {
                sender: Arc::new(sender),
            },
            PolicyChanges { receiver },
        )
    }

    /// Signals a change.
    pub fn changed(&self) {
        self.sender.send_modify(|generation| *generation += 1);
    }
}

impl PolicyChanges {
    /// Waits for a change, then for `debounce`, and consumes every change
    /// signalled meanwhile. `false` when every trigger is gone.
    async fn next_round(&mut self, debounce: Duration) -> bool {
        if self.receiver.changed().await.is_err() {
            return false;
        }
        tokio::time::sleep(debounce).await;
        self.receiver.borrow_and_update();
        true
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
}

impl<S: PolicySink> PolicyController<S> {
    /// A controller installing into `sink` the policies whose `policy-for`
    /// names one of `networks`.
    pub fn new(sink: S, networks: NetworkNames, metrics: PolicyMetrics) -> Self {
        Self {
            sink,
            networks,
            metrics,
            debounce: DEBOUNCE,
            log: DiagnosticLog::default(),
        }
    }

    /// Compiles and installs one snapshot. Diagnostics not reported for
    /// the same policy before are logged and handed to `events`.
    pub async fn apply(
        &mut self,
        snapshot: &PolicySnapshot,
        events: &mut impl DiagnosticEvents,
    ) -> Result<CompiledPolicy, DatapathError> {
        let started = std::time::Instant::now();
        let compiled = compile(PolicyInputs {
            policies: &snapshot.policies,
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
        let in_force = snapshot
            .policies
            .iter()
            .filter(|p| {
                let namespace = p.metadata.namespace.as_deref().unwrap_or("default");
                self.networks
                    .selects(namespace, p.metadata.annotations.as_ref())
            })
            .count();
        self.metrics.applies.inc();
        self.metrics.policies.set(in_force as i64);
        self.metrics
            .diagnostics
            .set(compiled.diagnostics.len() as i64);
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
        Ok(compiled)
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
            if let Err(error) = self.apply(&current, &mut events).await {
                tracing::error!(%error, "cannot install the network policy; the previous tables stay in force until the next change");
            }
        }
    }
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

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_changes_is_compiled_once() {
        let recorder = Recorder::default();
        let controller = PolicyController::new(
            recorder.clone(),
            NetworkNames::default(),
            PolicyMetrics::default(),
        );
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

    #[tokio::test(start_paused = true)]
    async fn an_incomplete_source_installs_nothing() {
        let recorder = Recorder::default();
        let controller = PolicyController::new(
            recorder.clone(),
            NetworkNames::default(),
            PolicyMetrics::default(),
        );
        let (trigger, changes) = PolicyTrigger::new();
        let task = tokio::spawn(controller.run(changes, || None, NoEvents));
        trigger.changed();
        tokio::time::sleep(DEBOUNCE * 3).await;
        drop(trigger);
        task.await.unwrap();
        assert!(recorder.0.lock().unwrap().is_empty());
    }
}
