//! The node agents' readiness heartbeat: one `coordination.k8s.io` Lease
//! per node, `flatnet-agent-<node>` in flatnet's namespace, that the
//! node's agent writes and renews, and the operator's leader reads for the
//! FlatNetworkConfig's conditions.
//!
//! A Lease, not a resource of flatnet's own: it is built into every
//! cluster (nothing to install or upgrade), it is what the kubelet already
//! uses for node heartbeats (`renewTime` and `leaseDurationSeconds` say
//! when it goes stale), it is small (a few hundred bytes, one write per
//! renewal), and it is namespaced, so the agent's grant stays inside
//! flatnet's namespace. The readiness rides in annotations: `true` or
//! `false`, a CamelCase reason and a message.
//!
//! A heartbeat whose `renewTime` is more than `leaseDurationSeconds` old
//! counts as not ready: its agent stopped renewing it (dead, or cut off from
//! the API server). The comparison uses the writer's and the reader's
//! clocks, assumed within seconds of each other as for the kubelet's.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference},
    jiff::{SignedDuration, Timestamp},
};

/// Prefix of every heartbeat's name; the node's name follows.
pub const NAME_PREFIX: &str = "flatnet-agent-";
/// Label on every heartbeat (value `true`), so the operator lists only them.
pub const LABEL: &str = "flatnetwork.pandaria.io/agent-heartbeat";
/// Annotation: `true` when the agent serves CNI requests, else `false`.
pub const ANNOTATION_READY: &str = "flatnetwork.pandaria.io/agent-ready";
/// Annotation: why (one of the `REASON_*` values).
pub const ANNOTATION_REASON: &str = "flatnetwork.pandaria.io/agent-reason";
/// Annotation: the details, for a person.
pub const ANNOTATION_MESSAGE: &str = "flatnetwork.pandaria.io/agent-message";

/// The agent serves CNI requests: programs loaded, socket answering, desired
/// state in sync.
pub const REASON_READY: &str = "Ready";
/// The agent is starting (loading programs, recovering attachments,
/// reaching the API server): not ready yet, not failing either.
pub const REASON_STARTING: &str = "Starting";
/// The agent is shutting down (a rollout or a drain).
pub const REASON_STOPPING: &str = "Stopping";
/// The eBPF programs could not be loaded; the agent exits and restarts.
pub const REASON_PROGRAMS_NOT_LOADED: &str = "ProgramsNotLoaded";
/// The CNI socket does not accept connections.
pub const REASON_CNI_SOCKET_NOT_SERVING: &str = "CniSocketNotServing";
/// After the agent served: the socket answers but ADD cannot be served
/// (desired state not in sync, API server unreachable).
pub const REASON_CNI_NOT_READY: &str = "CniNotReady";
/// Another start-up step failed (recovering attachments, the maps).
pub const REASON_START_FAILED: &str = "StartFailed";

/// Longest message kept in the annotation (the rest is cut).
const MAX_MESSAGE: usize = 1024;

/// What an agent says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentReadiness {
    /// Whether it serves CNI requests.
    pub ready: bool,
    /// One of the `REASON_*` values.
    pub reason: String,
    /// The details.
    pub message: String,
}

impl AgentReadiness {
    /// Ready.
    #[must_use]
    pub fn ready() -> Self {
        Self {
            ready: true,
            reason: REASON_READY.to_owned(),
            message: "serving CNI requests".to_owned(),
        }
    }

    /// Not ready, for `reason`, with `message`.
    #[must_use]
    pub fn not_ready(reason: &str, message: impl Into<String>) -> Self {
        Self {
            ready: false,
            reason: reason.to_owned(),
            message: message.into(),
        }
    }

    /// Whether this is a passing state of a healthy agent (starting or
    /// stopping) rather than a failure.
    #[must_use]
    pub fn is_transient(&self) -> bool {
        self.ready || [REASON_STARTING, REASON_STOPPING].contains(&self.reason.as_str())
    }
}

/// A heartbeat as the operator reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// The node.
    pub node: String,
    /// What its agent said last.
    pub readiness: AgentReadiness,
    /// When it was last renewed.
    pub renewed: Option<Timestamp>,
    /// How long a renewal stays valid.
    pub valid_for: SignedDuration,
}

impl Heartbeat {
    /// Whether it was renewed within its validity before `now`.
    #[must_use]
    pub fn is_fresh(&self, now: Timestamp) -> bool {
        self.renewed
            .is_some_and(|renewed| now.duration_since(renewed) <= self.valid_for)
    }

    /// How long ago it was last renewed (zero if in the future or never).
    #[must_use]
    pub fn age(&self, now: Timestamp) -> SignedDuration {
        self.renewed
            .map_or(SignedDuration::ZERO, |renewed| now.duration_since(renewed))
            .max(SignedDuration::ZERO)
    }
}

/// The heartbeat Lease's name for `node`.
#[must_use]
pub fn lease_name(node: &str) -> String {
    format!("{NAME_PREFIX}{node}")
}

/// The Lease the agent of `node` writes: `readiness`, renewed at `now`,
/// valid for `valid_for`, owned by `owner` (the agent's pod: the heartbeat
/// goes when the pod does).
#[must_use]
pub fn lease(
    namespace: &str,
    node: &str,
    readiness: &AgentReadiness,
    now: Timestamp,
    valid_for: std::time::Duration,
    owner: Option<OwnerReference>,
) -> Lease {
    let mut message = readiness.message.clone();
    if message.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    Lease {
        metadata: ObjectMeta {
            name: Some(lease_name(node)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(LABEL.to_owned(), "true".to_owned())])),
            annotations: Some(BTreeMap::from([
                (ANNOTATION_READY.to_owned(), readiness.ready.to_string()),
                (ANNOTATION_REASON.to_owned(), readiness.reason.clone()),
                (ANNOTATION_MESSAGE.to_owned(), message),
            ])),
            owner_references: owner.map(|owner| vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.to_owned()),
            lease_duration_seconds: Some(
                i32::try_from(valid_for.as_secs().max(1)).unwrap_or(i32::MAX),
            ),
            renew_time: Some(MicroTime(now)),
            ..LeaseSpec::default()
        }),
    }
}

/// The heartbeat `lease` carries, `None` when it is not one (no
/// [`NAME_PREFIX`], or no readiness annotation).
#[must_use]
pub fn read(lease: &Lease) -> Option<Heartbeat> {
    let name = lease.metadata.name.as_deref()?;
    let node = name.strip_prefix(NAME_PREFIX)?;
    let annotations = lease.metadata.annotations.as_ref()?;
    let ready = annotations.get(ANNOTATION_READY)? == "true";
    let spec = lease.spec.clone().unwrap_or_default();
    let text = |key: &str| annotations.get(key).cloned().unwrap_or_default();
    Some(Heartbeat {
        node: spec.holder_identity.unwrap_or_else(|| node.to_owned()),
        readiness: AgentReadiness {
            ready,
            reason: text(ANNOTATION_REASON),
            message: text(ANNOTATION_MESSAGE),
        },
        renewed: spec.renew_time.map(|t| t.0),
        valid_for: SignedDuration::from_secs(i64::from(
            spec.lease_duration_seconds.unwrap_or_default(),
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    #[test]
    fn a_written_heartbeat_reads_back_and_goes_stale_after_its_duration() {
        let failed = AgentReadiness::not_ready(
            REASON_PROGRAMS_NOT_LOADED,
            "load the flatnet eBPF programs: /x is not on a bpf filesystem",
        );
        let lease = lease(
            "flatnet",
            "node-1",
            &failed,
            at(1000),
            std::time::Duration::from_secs(40),
            None,
        );
        assert_eq!(lease.metadata.name.as_deref(), Some("flatnet-agent-node-1"));
        let heartbeat = read(&lease).unwrap();
        assert_eq!(heartbeat.node, "node-1");
        assert_eq!(heartbeat.readiness, failed);
        assert!(!heartbeat.readiness.is_transient());
        assert!(heartbeat.is_fresh(at(1040)));
        assert!(!heartbeat.is_fresh(at(1041)));
        assert_eq!(heartbeat.age(at(1100)), SignedDuration::from_secs(100));
        assert_eq!(heartbeat.age(at(900)), SignedDuration::ZERO);
    }

    #[test]
    fn other_leases_are_not_heartbeats_and_long_messages_are_cut() {
        let mut other = lease(
            "flatnet",
            "n",
            &AgentReadiness::ready(),
            at(0),
            std::time::Duration::from_secs(40),
            None,
        );
        other.metadata.name = Some("rancher-flat-network-operator".into());
        assert_eq!(read(&other), None);
        let long = AgentReadiness::not_ready(REASON_START_FAILED, "é".repeat(MAX_MESSAGE));
        let written = lease(
            "flatnet",
            "n",
            &long,
            at(0),
            std::time::Duration::from_secs(40),
            None,
        );
        let message = &read(&written).unwrap().readiness.message;
        assert!(message.len() <= MAX_MESSAGE && message.starts_with('é'));
        assert!(AgentReadiness::not_ready(REASON_STARTING, "").is_transient());
    }
}
