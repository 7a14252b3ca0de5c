//! The agent's readiness, published for the operator: the node's heartbeat
//! Lease (`flatnet-agent-<node>`, see [`flatnet_k8s::agent_heartbeat`]),
//! written at once whenever the readiness changes and renewed every
//! [`RENEW_EVERY`].
//!
//! The readiness is what the agent knows of itself: `Starting` until it
//! serves; a failure to load the eBPF programs (or another start-up step)
//! with its error; once serving, whether its CNI socket accepts a
//! connection and whether ADD can be served (the test of CNI STATUS and
//! `/readyz`); `Stopping` on shutdown.

use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use flatnet_k8s::agent_heartbeat::{
    self, AgentReadiness, REASON_CNI_NOT_READY, REASON_CNI_SOCKET_NOT_SERVING, REASON_STARTING,
    REASON_STOPPING,
};
use k8s_openapi::{
    api::coordination::v1::Lease, apimachinery::pkg::apis::meta::v1::OwnerReference,
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use tokio::sync::Notify;

/// How often the heartbeat is renewed.
pub const RENEW_EVERY: Duration = Duration::from_secs(10);
/// How long a renewal stays valid: four missed renewals make it stale.
pub const VALID_FOR: Duration = Duration::from_secs(40);
/// How often a starting agent's readiness is looked at again, so `Ready`
/// follows within a second of the agent becoming ready.
pub const STARTING_RECHECK: Duration = Duration::from_secs(1);
/// Field manager of the agent's writes.
const FIELD_MANAGER: &str = "flatnet-agent";

/// How the serving agent's readiness is checked at each renewal.
type Check = Arc<dyn Fn() -> AgentReadiness + Send + Sync>;

enum State {
    Starting,
    Failed(AgentReadiness),
    /// Serving; whether the check has passed once.
    Serving(Check, bool),
    Stopping,
}

/// The agent's readiness as the phases of its life set it; cheap to clone.
#[derive(Clone)]
pub struct Readiness {
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self {
            state: Arc::new(Mutex::new(State::Starting)),
            changed: Arc::new(Notify::new()),
        }
    }
}

impl Readiness {
    fn set(&self, state: State) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
        self.changed.notify_one();
    }

    /// A start-up step failed (`reason`, one of the heartbeat's reasons).
    pub fn failed(&self, reason: &str, message: impl Into<String>) {
        self.set(State::Failed(AgentReadiness::not_ready(reason, message)));
    }

    /// The agent serves; `check` says, at each renewal, whether it still does.
    pub fn serving(&self, check: impl Fn() -> AgentReadiness + Send + Sync + 'static) {
        self.set(State::Serving(Arc::new(check), false));
    }

    /// The agent is shutting down.
    pub fn stopping(&self) {
        self.set(State::Stopping);
    }

    /// Whether a failure was reported.
    #[must_use]
    pub fn has_failed(&self) -> bool {
        matches!(
            *self.state.lock().unwrap_or_else(|e| e.into_inner()),
            State::Failed(_)
        )
    }

    /// The readiness now. Until the serving agent's check has passed once,
    /// its failures (the API server not reached yet) are still `Starting`.
    #[must_use]
    pub fn current(&self) -> AgentReadiness {
        let check = match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            State::Starting => {
                return AgentReadiness::not_ready(
                    REASON_STARTING,
                    "loading the eBPF programs, recovering attachments and opening the CNI socket",
                );
            }
            State::Failed(readiness) => return readiness.clone(),
            State::Stopping => {
                return AgentReadiness::not_ready(REASON_STOPPING, "the agent is shutting down");
            }
            State::Serving(check, _) => Arc::clone(check),
        };
        let now = check();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *state {
            State::Serving(_, passed) if now.ready => *passed = true,
            State::Serving(_, false) => {
                return AgentReadiness::not_ready(
                    REASON_STARTING,
                    format!("serving once this passes: {}", now.message),
                );
            }
            _ => {}
        }
        now
    }
}

/// The check of a serving agent: its CNI `socket` accepts a connection, and
/// `serves_add` (CNI STATUS's test) passes.
pub fn serving_check(
    socket: PathBuf,
    serves_add: impl Fn() -> Result<(), String> + Send + Sync + 'static,
) -> impl Fn() -> AgentReadiness + Send + Sync + 'static {
    move || {
        if let Err(error) = std::os::unix::net::UnixStream::connect(&socket) {
            return AgentReadiness::not_ready(
                REASON_CNI_SOCKET_NOT_SERVING,
                format!(
                    "the CNI socket {} does not accept connections: {error}",
                    socket.display()
                ),
            );
        }
        match serves_add() {
            Ok(()) => AgentReadiness::ready(),
            Err(reason) => AgentReadiness::not_ready(REASON_CNI_NOT_READY, reason),
        }
    }
}

/// Where the heartbeat goes.
#[derive(Clone, Debug)]
pub struct Settings {
    /// flatnet's namespace (the agent's own).
    pub namespace: String,
    /// This node.
    pub node: String,
    /// The agent's pod, owner of the heartbeat (it goes with the pod).
    pub owner: Option<OwnerReference>,
    /// Renewal period.
    pub renew_every: Duration,
    /// Validity of a renewal.
    pub valid_for: Duration,
}

impl Settings {
    /// The settings for `node` in `namespace`, owned by pod `pod` (name and
    /// uid) when known.
    #[must_use]
    pub fn new(namespace: &str, node: &str, pod: Option<(String, String)>) -> Self {
        Self {
            namespace: namespace.to_owned(),
            node: node.to_owned(),
            owner: pod.map(|(name, uid)| OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name,
                uid,
                ..OwnerReference::default()
            }),
            renew_every: RENEW_EVERY,
            valid_for: VALID_FOR,
        }
    }
}

/// Writes the node's heartbeat.
#[derive(Clone)]
pub struct Heartbeat {
    api: Api<Lease>,
    settings: Settings,
}

impl Heartbeat {
    /// A writer through `client`.
    #[must_use]
    pub fn new(client: Client, settings: Settings) -> Self {
        Self {
            api: Api::namespaced(client, &settings.namespace),
            settings,
        }
    }

    /// Writes `readiness`, renewed now (a server-side apply: creates the
    /// Lease when missing).
    ///
    /// # Errors
    /// The API server refusing or not answering.
    pub async fn publish(&self, readiness: &AgentReadiness) -> Result<(), kube::Error> {
        let settings = &self.settings;
        let lease = agent_heartbeat::lease(
            &settings.namespace,
            &settings.node,
            readiness,
            Timestamp::now(),
            settings.valid_for,
            settings.owner.clone(),
        );
        self.api
            .patch(
                &agent_heartbeat::lease_name(&settings.node),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&lease),
            )
            .await
            .map(drop)
    }

    /// What a 403 refused the heartbeat's apply, and where to grant it.
    fn refused(&self, error: &kube::Error) -> String {
        flatnet_k8s::forbidden::hint(
            error,
            true,
            Some(&self.settings.namespace),
            crate::AGENT_RBAC,
        )
    }

    /// Publishes `readiness` at its first change or after one renewal
    /// period, then at every change and renewal period, for ever (the
    /// agent's life). Waiting first keeps a restarting agent that fails at
    /// once from writing `Starting` over its failure, which would read as
    /// a recovery.
    pub async fn run(self, readiness: Readiness) {
        let mut last: Option<AgentReadiness> = None;
        loop {
            let wait = match &last {
                Some(said) if said.reason == REASON_STARTING => {
                    STARTING_RECHECK.min(self.settings.renew_every)
                }
                _ => self.settings.renew_every,
            };
            tokio::select! {
                () = readiness.changed.notified() => {}
                () = tokio::time::sleep(wait) => {}
            }
            let now = readiness.current();
            match self.publish(&now).await {
                Ok(()) => {
                    if last.as_ref() != Some(&now) {
                        tracing::info!(ready = now.ready, reason = %now.reason, message = %now.message,
                            "readiness heartbeat written");
                    }
                    last = Some(now);
                }
                Err(error) => {
                    let refused = self.refused(&error);
                    tracing::warn!(%error, lease = %agent_heartbeat::lease_name(&self.settings.node),
                        "cannot write the readiness heartbeat{refused}; retrying");
                }
            }
        }
    }

    /// Publishes `readiness` once, waiting at most `within` (the last word
    /// of an agent about to exit).
    pub async fn publish_last(&self, readiness: &AgentReadiness, within: Duration) {
        match tokio::time::timeout(within, self.publish(readiness)).await {
            Ok(Ok(())) => tracing::info!(reason = %readiness.reason, "readiness heartbeat written"),
            Ok(Err(error)) => {
                let refused = self.refused(&error);
                tracing::warn!(%error, "cannot write the readiness heartbeat{refused}");
            }
            Err(_) => tracing::warn!(?within, "the readiness heartbeat was not written in time"),
        }
    }
}

#[cfg(test)]
mod tests {
    use flatnet_k8s::agent_heartbeat::{REASON_PROGRAMS_NOT_LOADED, REASON_READY};
    use flatnet_operator::allocation::fake_api::{FakeApiServer, rbac::Rbac};

    use super::*;

    async fn written(server: &FakeApiServer, reason: &str) -> agent_heartbeat::Heartbeat {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let heartbeat = server
                .list::<Lease>()
                .iter()
                .find_map(agent_heartbeat::read);
            if let Some(heartbeat) = heartbeat.filter(|h| h.readiness.reason == reason) {
                return heartbeat;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no heartbeat with reason {reason}: {:?}",
                server.list::<Lease>()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_failure_at_start_is_written_without_starting_before_it() {
        let server = FakeApiServer::new();
        let settings = Settings {
            renew_every: Duration::from_secs(3600),
            ..Settings::new("flatnet", "node-1", None)
        };
        let readiness = Readiness::default();
        let task = tokio::spawn(Heartbeat::new(server.client(), settings).run(readiness.clone()));
        // The task runs before the programs fail to load.
        tokio::time::sleep(Duration::from_millis(50)).await;
        readiness.failed(REASON_PROGRAMS_NOT_LOADED, "no bpf filesystem");
        written(&server, REASON_PROGRAMS_NOT_LOADED).await;
        let patches: u64 = server
            .requests_by_kind()
            .iter()
            .filter(|(kind, _)| kind.starts_with("patch leases"))
            .map(|(_, n)| *n)
            .sum();
        assert_eq!(patches, 1, "only the failure was written");
        task.abort();
    }

    #[tokio::test]
    async fn the_heartbeat_says_starting_failed_ready_and_socket_gone() {
        let server = FakeApiServer::new();
        let settings = Settings {
            renew_every: Duration::from_millis(20),
            ..Settings::new(
                "flatnet",
                "node-1",
                Some(("flatnet-agent-x".into(), "uid-x".into())),
            )
        };
        let readiness = Readiness::default();
        // Its requests are recorded and authorized by the chart's agent
        // rules (installed in `flatnet`).
        let recorded = server
            .for_client(1)
            .with_rbac(Rbac::from_chart("flatnet-agent").in_release_namespace("flatnet"));
        let task = tokio::spawn(Heartbeat::new(recorded.client(), settings).run(readiness.clone()));

        let starting = written(&server, REASON_STARTING).await;
        assert_eq!(starting.node, "node-1");
        assert!(!starting.readiness.ready);
        assert!(starting.is_fresh(Timestamp::now()));
        let lease = server.list::<Lease>().remove(0);
        assert_eq!(lease.metadata.name.as_deref(), Some("flatnet-agent-node-1"));
        assert_eq!(lease.metadata.namespace.as_deref(), Some("flatnet"));
        let owner = &lease.metadata.owner_references.unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("Pod", "uid-x"));

        readiness.failed(
            REASON_PROGRAMS_NOT_LOADED,
            "load the flatnet eBPF programs: /tmp/x is not on a bpf filesystem",
        );
        let failed = written(&server, REASON_PROGRAMS_NOT_LOADED).await;
        assert!(!failed.readiness.ready);
        assert!(failed.readiness.message.contains("bpf filesystem"));
        assert!(readiness.has_failed());

        // Serving: a real socket accepting connections, ADD servable.
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        // ADD not servable yet (the API server not reached): still starting.
        let add_ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let serves_add = {
            let add_ready = Arc::clone(&add_ready);
            move || {
                if add_ready.load(std::sync::atomic::Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err("the Kubernetes API is not reachable".to_owned())
                }
            }
        };
        readiness.serving(serving_check(socket.clone(), serves_add));
        let waiting = written(&server, REASON_STARTING).await;
        assert!(
            waiting.readiness.message.contains("not reachable"),
            "{waiting:?}"
        );
        add_ready.store(true, std::sync::atomic::Ordering::SeqCst);
        let ready = written(&server, REASON_READY).await;
        assert!(ready.readiness.ready);

        // ADD not servable after it was: a failure, noticed at the next renewal.
        add_ready.store(false, std::sync::atomic::Ordering::SeqCst);
        let not_ready = written(&server, REASON_CNI_NOT_READY).await;
        assert!(not_ready.readiness.message.contains("not reachable"));
        add_ready.store(true, std::sync::atomic::Ordering::SeqCst);
        written(&server, REASON_READY).await;

        // The socket goes away.
        drop(listener);
        std::fs::remove_file(&socket).unwrap();
        let gone = written(&server, REASON_CNI_SOCKET_NOT_SERVING).await;
        assert!(
            !gone.readiness.ready && gone.readiness.message.contains("agent.sock"),
            "{gone:?}"
        );

        readiness.stopping();
        written(&server, REASON_STOPPING).await;
        task.abort();

        // What charts/flatnet/templates/agent-rbac.yaml's Role grants, and
        // nothing else: the apply of Leases in flatnet's namespace, which
        // creates the first.
        let lease = |verb| {
            (
                verb,
                "coordination.k8s.io".to_owned(),
                "leases".to_owned(),
                None,
                true,
            )
        };
        let asked: Vec<_> = recorded
            .accesses()
            .into_iter()
            .map(|a| (a.verb, a.group, a.resource, a.subresource, a.namespaced))
            .collect();
        assert_eq!(asked, [lease("create"), lease("patch")]);
    }
}
