//! The conditions of the FlatNetworkConfig `cluster`: `Available`,
//! `Progressing` and `Degraded`, computed by the leader from what it sees —
//! its own controllers and webhook, the agent DaemonSet's rollout, and each
//! node agent's heartbeat ([`flatnet_k8s::agent_heartbeat`]) — and written
//! only when one of them changes (`lastTransitionTime` moves only when a
//! status does).
//!
//! Beside them, `MacRangeShared`: whether MACs of the MAC pool's range
//! were seen on the LAN, within the wire window, that no FlatNetworkIP of
//! this cluster holds (the agents' FlatNetworkWireClaims). The webhook
//! warns about them when a range is written; this condition says so when
//! they appear later, and clears once they age out of the window. It
//! leaves `Degraded` alone: the allocator skips those MACs, so nothing
//! fails, but the range had better be changed ([`mac_range_condition`]).
//!
//! [`conditions`] is the pure rule; [`run`] follows the objects and writes.

use std::{sync::Arc, time::Duration};

use flatnet_k8s::{
    agent_heartbeat::{self, Heartbeat},
    api::{
        CONDITION_AVAILABLE, CONDITION_DEGRADED, CONDITION_MAC_RANGE_SHARED, CONDITION_PROGRESSING,
        CONFIG_NAME, FlatNetworkConfig, FlatNetworkWireClaims, MacPoolStatus, set_condition,
    },
    ipam::{
        LiveClaim, MacRange,
        foreign_macs::{foreign_macs, inside, overlap_warning},
    },
    keys::SUBNET_NAMESPACE,
};
use futures::StreamExt;
use k8s_openapi::{
    api::{
        admissionregistration::v1::ValidatingWebhookConfiguration, apps::v1::DaemonSet,
        coordination::v1::Lease, discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Client, ResourceExt,
    api::PostParams,
    runtime::{WatchStreamExt, reflector, watcher},
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    admin::Health,
    controller::{condition, is_conflict, is_not_found},
    tls::{cert, resolver::ReloadingResolver},
};

/// `Available` True: every part serves.
pub const REASON_ALL_SERVING: &str = "AllServing";
/// The leader is still syncing its caches.
pub const REASON_OPERATOR_STARTING: &str = "OperatorStarting";
/// The admission webhook has no serving certificate.
pub const REASON_WEBHOOK_NOT_SERVING: &str = "WebhookNotServing";
/// No agent DaemonSet of the configured name.
pub const REASON_DAEMONSET_NOT_FOUND: &str = "AgentDaemonSetNotFound";
/// The DaemonSet schedules no agent (no node matches it).
pub const REASON_NO_AGENTS: &str = "NoAgentsScheduled";
/// Some agents do not serve (failing, stale, starting or not reported).
pub const REASON_AGENTS_NOT_READY: &str = "AgentsNotReady";
/// An agent reports a failure (its reason and message are in ours).
pub const REASON_AGENTS_FAILING: &str = "AgentsFailing";
/// An agent's heartbeat was not renewed in time (the agent is dead or cut
/// off from the API server).
pub const REASON_HEARTBEATS_STALE: &str = "AgentHeartbeatsStale";
/// The DaemonSet's pods run, but agents wrote no heartbeat.
pub const REASON_HEARTBEATS_MISSING: &str = "AgentHeartbeatsMissing";
/// `Degraded` False.
pub const REASON_AS_EXPECTED: &str = "AsExpected";
/// The agent DaemonSet is rolling out.
pub const REASON_ROLLING_OUT: &str = "AgentsRollingOut";
/// Agents are starting (or stopping) without a rollout.
pub const REASON_AGENTS_STARTING: &str = "AgentsStarting";
/// `Progressing` False.
pub const REASON_ROLLOUT_COMPLETE: &str = "RolloutComplete";
/// What `Progressing` names made no progress for the configuration's
/// `progressDeadlineSeconds` (`Progressing` False, `Degraded` True).
pub const REASON_PROGRESS_DEADLINE_EXCEEDED: &str = "ProgressDeadlineExceeded";
/// The webhook's Service has no ready endpoint: the API server cannot
/// reach any replica.
pub const REASON_WEBHOOK_ENDPOINTS_NOT_READY: &str = "WebhookEndpointsNotReady";
/// The ValidatingWebhookConfiguration's `caBundle` does not trust the
/// certificate the webhook serves: the API server refuses its TLS.
pub const REASON_WEBHOOK_CA_BUNDLE_MISMATCH: &str = "WebhookCABundleMismatch";

/// `MacRangeShared` True: MACs of the range were seen on the LAN.
pub const REASON_FOREIGN_MACS_IN_RANGE: &str = "ForeignMacsInRange";
/// `MacRangeShared` False: none seen within the wire window.
pub const REASON_NO_FOREIGN_MACS: &str = "NoForeignMacsInRange";
/// `MacRangeShared` False: no range recorded yet (none configured and
/// none drawn yet), so nothing to compare.
pub const REASON_NO_MAC_RANGE: &str = "NoMacRange";

/// How many nodes a message names before it says "and N more".
const NAMED_NODES: usize = 5;

/// The leader's own state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operator {
    /// Its identity (the pod name).
    pub leader: String,
    /// Whether its controllers' caches are synced.
    pub controllers_ready: bool,
}

/// The admission webhook of the leader's replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Webhook {
    /// Turned off (`--webhook-server=false`): not a failure.
    Disabled,
    /// Serving with a certificate.
    Serving,
    /// Not serving, and why.
    NotServing(String),
}

/// The agent DaemonSet's rollout, as its status counts it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rollout {
    /// `namespace/name`, for messages.
    pub name: String,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// `status.observedGeneration`.
    pub observed_generation: Option<i64>,
    /// `status.desiredNumberScheduled`.
    pub desired: i32,
    /// `status.updatedNumberScheduled`.
    pub updated: i32,
    /// `status.numberReady`.
    pub ready: i32,
    /// `status.numberAvailable`.
    pub available: i32,
}

impl Rollout {
    /// The rollout of `daemonset`.
    #[must_use]
    pub fn of(daemonset: &DaemonSet) -> Self {
        let status = daemonset.status.clone().unwrap_or_default();
        Self {
            name: format!(
                "{}/{}",
                daemonset.namespace().unwrap_or_default(),
                daemonset.name_any()
            ),
            generation: daemonset.metadata.generation,
            observed_generation: status.observed_generation,
            desired: status.desired_number_scheduled,
            updated: status.updated_number_scheduled.unwrap_or_default(),
            ready: status.number_ready,
            available: status.number_available.unwrap_or_default(),
        }
    }

    /// Whether it is done, as `kubectl rollout status` decides: the
    /// controller saw the newest spec, and every scheduled pod is updated
    /// and available.
    #[must_use]
    pub fn is_complete(&self) -> bool {
        self.observed_generation >= self.generation
            && self.updated >= self.desired
            && self.available >= self.desired
    }

    fn describe(&self) -> String {
        let waiting = if self.observed_generation < self.generation {
            " (its controller has not seen the newest spec yet)"
        } else {
            ""
        };
        format!(
            "DaemonSet {}: {} of {} agents updated, {} ready, {} available{waiting}",
            self.name, self.updated, self.desired, self.ready, self.available
        )
    }
}

/// Whether the ValidatingWebhookConfiguration trusts the served certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaBundle {
    /// Not looked at yet, or not readable (the next look tries again).
    Unchecked,
    /// Every webhook's `caBundle` holds a CA that signed the served certificate.
    Trusted,
    /// Not so, and why (the webhooks named).
    Mismatch(String),
}

/// How the API server reaches the webhook, as last looked at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebhookRoute {
    /// The webhook's Service (`namespace/name`) and its ready endpoints;
    /// `None` when a URL is registered instead, or its EndpointSlices have
    /// not been listed yet.
    pub service: Option<(String, usize)>,
    /// The configuration's `caBundle` against the served certificate.
    pub ca_bundle: CaBundle,
}

/// Everything the conditions are computed from.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The leader.
    pub operator: Operator,
    /// Its webhook.
    pub webhook: Webhook,
    /// The agent DaemonSet, `None` when it does not exist.
    pub rollout: Option<Rollout>,
    /// Where it was looked for (`namespace/name`), for messages.
    pub daemonset: String,
    /// Every agent heartbeat.
    pub heartbeats: Vec<Heartbeat>,
    /// How the API server reaches the webhook; `None` when it is turned
    /// off or was not looked at.
    pub webhook_route: Option<WebhookRoute>,
    /// Since when what `Progressing` names (its [`progress_key`]) has not
    /// changed; `None`: nothing progresses.
    pub progress_since: Option<Timestamp>,
    /// How long that may last before it is `ProgressDeadlineExceeded`.
    pub progress_deadline: SignedDuration,
}

/// The agents' heartbeats sorted by what they say at `now`.
#[derive(Default)]
struct Agents {
    ready: usize,
    fresh: usize,
    starting: Vec<String>,
    failing: Vec<String>,
    stale: Vec<String>,
}

impl Agents {
    fn tally(heartbeats: &[Heartbeat], now: Timestamp) -> Self {
        let mut sorted: Vec<&Heartbeat> = heartbeats.iter().collect();
        sorted.sort_by(|a, b| a.node.cmp(&b.node));
        let mut agents = Self::default();
        for heartbeat in sorted {
            let said = &heartbeat.readiness;
            if !heartbeat.is_fresh(now) {
                agents.stale.push(format!(
                    "{}: no heartbeat for {} (last said {}: {})",
                    heartbeat.node,
                    seconds(heartbeat.age(now)),
                    said.reason,
                    said.message
                ));
                continue;
            }
            agents.fresh += 1;
            if said.ready {
                agents.ready += 1;
            } else if said.is_transient() {
                agents
                    .starting
                    .push(format!("{} ({})", heartbeat.node, said.reason));
            } else {
                agents.failing.push(format!(
                    "{}: {}: {}",
                    heartbeat.node, said.reason, said.message
                ));
            }
        }
        agents
    }
}

fn seconds(duration: SignedDuration) -> String {
    format!("{}s", duration.as_secs())
}

/// `items` joined with `; `, the first [`NAMED_NODES`] of them and a count
/// of the rest.
fn listed(items: &[String]) -> String {
    let mut text = items
        .iter()
        .take(NAMED_NODES)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if items.len() > NAMED_NODES {
        text.push_str(&format!("; and {} more", items.len() - NAMED_NODES));
    }
    text
}

/// What the conditions are judged on, tallied once.
struct Tally {
    agents: Agents,
    /// Agents the DaemonSet schedules.
    desired: usize,
    /// Of those, how many wrote no heartbeat.
    missing: usize,
    rollout_complete: bool,
}

impl Tally {
    fn of(observed: &Observed, now: Timestamp) -> Self {
        let agents = Agents::tally(&observed.heartbeats, now);
        let desired = observed
            .rollout
            .as_ref()
            .map_or(0, |r| usize::try_from(r.desired).unwrap_or_default());
        let missing = desired.saturating_sub(agents.fresh + agents.stale.len());
        Self {
            agents,
            desired,
            missing,
            rollout_complete: observed.rollout.as_ref().is_some_and(Rollout::is_complete),
        }
    }
}

/// The changes on their way: `Progressing`'s reasons and messages.
fn changes(observed: &Observed, tally: &Tally) -> Vec<(&'static str, String)> {
    let (starting, desired, missing) = (&tally.agents.starting, tally.desired, tally.missing);
    let mut changes: Vec<(&str, String)> = Vec::new();
    if !observed.operator.controllers_ready {
        changes.push((
            REASON_OPERATOR_STARTING,
            format!(
                "the operator's leader {} is syncing its caches",
                observed.operator.leader
            ),
        ));
    }
    if let Some(rollout) = observed.rollout.as_ref().filter(|r| !r.is_complete()) {
        changes.push((REASON_ROLLING_OUT, rollout.describe()));
    }
    if !starting.is_empty() {
        changes.push((
            REASON_AGENTS_STARTING,
            format!("agents starting or stopping: {}", listed(starting)),
        ));
    }
    if missing > 0 && !tally.rollout_complete && observed.rollout.is_some() {
        changes.push((
            REASON_AGENTS_STARTING,
            format!("{missing} of {desired} agents have not reported yet"),
        ));
    }
    if let Some((service, 0)) = observed
        .webhook_route
        .as_ref()
        .and_then(|r| r.service.as_ref())
        && observed.webhook == Webhook::Serving
    {
        changes.push((
            REASON_WEBHOOK_ENDPOINTS_NOT_READY,
            format!(
                "the webhook Service {service} has no ready endpoint (no operator pod ready, or its selector matches none)"
            ),
        ));
    }
    changes
}

/// What `Progressing` names at `now`, as one text that changes whenever
/// any of it moves (a count, a node, a reason); `None` when nothing
/// progresses. The controller keeps since when it is unchanged
/// ([`Observed::progress_since`]).
#[must_use]
pub fn progress_key(observed: &Observed, now: Timestamp) -> Option<String> {
    let changes = changes(observed, &Tally::of(observed, now));
    (!changes.is_empty()).then(|| {
        changes
            .iter()
            .map(|(_, m)| m.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    })
}

/// The three conditions for `observed` at `now`, stamped with `generation`
/// (the FlatNetworkConfig's) and `now` as their transition time.
#[must_use]
pub fn conditions(observed: &Observed, generation: Option<i64>, now: Timestamp) -> [Condition; 3] {
    let tally = Tally::of(observed, now);
    let changes = changes(observed, &tally);
    let Tally {
        agents,
        desired,
        missing,
        rollout_complete,
    } = tally;
    // No progress for longer than the deadline.
    let stalled = observed
        .progress_since
        .map(|since| now.duration_since(since))
        .filter(|unchanged| !changes.is_empty() && *unchanged >= observed.progress_deadline)
        .map(|unchanged| {
            let messages: Vec<&str> = changes.iter().map(|(_, m)| m.as_str()).collect();
            format!(
                "no progress for {} (progressDeadlineSeconds {}): {}",
                seconds(unchanged),
                observed.progress_deadline.as_secs(),
                messages.join("; ")
            )
        });
    let ca_mismatch = match observed.webhook_route.as_ref().map(|r| &r.ca_bundle) {
        Some(CaBundle::Mismatch(why)) if observed.webhook == Webhook::Serving => Some(why.clone()),
        _ => None,
    };

    // Degraded: something fails that no rollout explains.
    let mut failures: Vec<(&str, String)> = Vec::new();
    if let Webhook::NotServing(why) = &observed.webhook {
        failures.push((
            REASON_WEBHOOK_NOT_SERVING,
            format!("the admission webhook does not serve: {why}"),
        ));
    }
    if let Some(why) = &ca_mismatch {
        failures.push((REASON_WEBHOOK_CA_BUNDLE_MISMATCH, why.clone()));
    }
    if observed.rollout.is_none() {
        failures.push((
            REASON_DAEMONSET_NOT_FOUND,
            format!(
                "no agent DaemonSet {} (the operator's FLATNET_AGENT_DAEMONSET and POD_NAMESPACE name it)",
                observed.daemonset
            ),
        ));
    }
    if !agents.failing.is_empty() {
        failures.push((
            REASON_AGENTS_FAILING,
            format!("agents not ready: {}", listed(&agents.failing)),
        ));
    }
    if !agents.stale.is_empty() {
        failures.push((
            REASON_HEARTBEATS_STALE,
            format!("agents not heard from: {}", listed(&agents.stale)),
        ));
    }
    if missing > 0 && rollout_complete {
        failures.push((
            REASON_HEARTBEATS_MISSING,
            format!(
                "{missing} of {desired} agents run but wrote no heartbeat (Leases {}<node> in the agents' namespace)",
                agent_heartbeat::NAME_PREFIX
            ),
        ));
    }
    if let Some(message) = &stalled {
        failures.push((REASON_PROGRESS_DEADLINE_EXCEEDED, message.clone()));
    }
    let degraded = any_of(
        CONDITION_DEGRADED,
        &failures,
        (
            REASON_AS_EXPECTED,
            "no part of flatnet is failing".to_owned(),
        ),
        generation,
    );

    // Progressing: a change is on its way (False, as a Deployment's, once
    // it is past its deadline).
    let progressing = match stalled {
        Some(message) => condition(
            CONDITION_PROGRESSING,
            false,
            REASON_PROGRESS_DEADLINE_EXCEEDED,
            message,
            generation,
        ),
        None => any_of(
            CONDITION_PROGRESSING,
            &changes,
            (
                REASON_ROLLOUT_COMPLETE,
                observed
                    .rollout
                    .as_ref()
                    .map_or_else(String::new, Rollout::describe),
            ),
            generation,
        ),
    };

    // Available: every part serves, on every node.
    let unavailable = if !observed.operator.controllers_ready {
        Some((REASON_OPERATOR_STARTING, changes[0].1.clone()))
    } else if let Webhook::NotServing(_) = &observed.webhook {
        Some((REASON_WEBHOOK_NOT_SERVING, failures[0].1.clone()))
    } else if let Some(why) = ca_mismatch {
        Some((REASON_WEBHOOK_CA_BUNDLE_MISMATCH, why))
    } else if let Some((_, message)) = changes
        .iter()
        .find(|(reason, _)| *reason == REASON_WEBHOOK_ENDPOINTS_NOT_READY)
    {
        Some((REASON_WEBHOOK_ENDPOINTS_NOT_READY, message.clone()))
    } else if observed.rollout.is_none() {
        Some((
            REASON_DAEMONSET_NOT_FOUND,
            format!("no agent DaemonSet {}", observed.daemonset),
        ))
    } else if desired == 0 {
        Some((
            REASON_NO_AGENTS,
            format!(
                "DaemonSet {} schedules no agent: no node matches its nodeSelector and tolerations",
                observed.daemonset
            ),
        ))
    } else if agents.ready < desired || !agents.failing.is_empty() || !agents.stale.is_empty() {
        Some((
            REASON_AGENTS_NOT_READY,
            format!("{} of {desired} agents ready", agents.ready),
        ))
    } else {
        None
    };
    let available = match unavailable {
        Some((reason, message)) => {
            condition(CONDITION_AVAILABLE, false, reason, message, generation)
        }
        None => {
            let webhook = match observed.webhook {
                Webhook::Disabled => "admission webhook turned off",
                _ => "admission webhook serving",
            };
            condition(
                CONDITION_AVAILABLE,
                true,
                REASON_ALL_SERVING,
                format!(
                    "operator leader {}; {webhook}; {} of {desired} agents ready",
                    observed.operator.leader, agents.ready
                ),
                generation,
            )
        }
    };
    [available, progressing, degraded].map(|mut c| {
        c.last_transition_time = Time(now);
        c
    })
}

/// Condition `type_`: True with the first of `found`'s reasons and all
/// their messages, or False with `otherwise` when nothing was found.
fn any_of(
    type_: &str,
    found: &[(&str, String)],
    otherwise: (&str, String),
    generation: Option<i64>,
) -> Condition {
    match found.first() {
        Some((reason, _)) => {
            let messages: Vec<&str> = found.iter().map(|(_, m)| m.as_str()).collect();
            condition(type_, true, reason, messages.join("; "), generation)
        }
        None => condition(type_, false, otherwise.0, otherwise.1, generation),
    }
}

/// `current` with `wanted` merged in (each condition's
/// `lastTransitionTime` kept while its status stays), or `None` when
/// nothing would change.
#[must_use]
pub fn merged(
    current: &[Condition],
    wanted: impl IntoIterator<Item = Condition>,
) -> Option<Vec<Condition>> {
    let mut conditions = current.to_vec();
    let mut changed = false;
    for condition in wanted {
        changed |= set_condition(&mut conditions, condition);
    }
    changed.then_some(conditions)
}

/// `MacRangeShared` for the pool's `range` (`None`: none recorded yet),
/// given the foreign MACs `seen` inside it (see [`inside`]), stamped with
/// `generation` and `now`. The message names up to three MACs with the
/// node that saw each and when.
#[must_use]
pub fn mac_range_condition(
    range: Option<&MacRange>,
    seen: &[LiveClaim],
    window: Duration,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let window = format!("{}s", window.as_secs());
    let mut found = match range {
        None => condition(
            CONDITION_MAC_RANGE_SHARED,
            false,
            REASON_NO_MAC_RANGE,
            "no macPool range recorded yet".to_owned(),
            generation,
        ),
        Some(range) => match overlap_warning("the macPool range", range, seen) {
            Some(warning) => condition(
                CONDITION_MAC_RANGE_SHARED,
                true,
                REASON_FOREIGN_MACS_IN_RANGE,
                format!("within the wire window ({window}): {warning}"),
                generation,
            ),
            None => condition(
                CONDITION_MAC_RANGE_SHARED,
                false,
                REASON_NO_FOREIGN_MACS,
                format!(
                    "no MAC of the macPool range {range} was seen on the LAN within the wire window ({window}) outside this cluster's FlatNetworkIPs"
                ),
                generation,
            ),
        },
    };
    found.last_transition_time = Time(now);
    found
}

/// Where the controller looks, and who it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Namespace of the agent DaemonSet and of the heartbeats (flatnet's).
    pub namespace: String,
    /// Name of the agent DaemonSet.
    pub daemonset: String,
    /// The leader's identity.
    pub leader: String,
    /// How often the conditions are looked at besides on changes (a
    /// heartbeat goes stale without any event).
    pub interval: Duration,
    /// How often the ValidatingWebhookConfiguration's `caBundle` is read.
    pub ca_bundle_interval: Duration,
    /// How recently a MAC must have been seen on the LAN to count for
    /// `MacRangeShared` (`FLATNET_WIRE_WINDOW`, as for allocation).
    pub wire_window: Duration,
}

/// How often a heartbeat's staleness is looked at: well under the
/// heartbeats' validity.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// Whether the leader's replica serves its webhook, and how the API
/// server reaches it.
#[derive(Clone)]
pub enum WebhookProbe {
    /// Turned off.
    Disabled,
    /// Served with the certificate `resolver` holds (none until the
    /// Secret is read).
    Enabled {
        /// The served certificate.
        resolver: Arc<ReloadingResolver>,
        /// The webhook's Service in the operator's namespace; `None` when
        /// a URL is registered instead.
        service: Option<String>,
        /// The ValidatingWebhookConfiguration's name.
        configuration: String,
    },
}

/// How often the ValidatingWebhookConfiguration's `caBundle` is read by
/// default (a GET: the operator may not list or watch configurations).
pub const DEFAULT_CA_BUNDLE_INTERVAL: Duration = Duration::from_secs(30);

impl WebhookProbe {
    /// The webhook's state now.
    #[must_use]
    pub fn state(&self) -> Webhook {
        match self {
            Self::Disabled => Webhook::Disabled,
            Self::Enabled { resolver, .. } if resolver.is_loaded() => Webhook::Serving,
            Self::Enabled { .. } => Webhook::NotServing(
                "no serving certificate loaded from the webhook Secret yet".to_owned(),
            ),
        }
    }

    /// Whether the `caBundle` of each webhook of `registered` trusts the
    /// served certificate.
    #[must_use]
    pub fn ca_bundle(&self, registered: &ValidatingWebhookConfiguration) -> CaBundle {
        let Self::Enabled { resolver, .. } = self else {
            return CaBundle::Unchecked;
        };
        let Some(served) = resolver.served_certificate() else {
            return CaBundle::Unchecked;
        };
        let untrusting: Vec<String> = registered
            .webhooks
            .iter()
            .flatten()
            .filter_map(|webhook| {
                let bundle = webhook
                    .client_config
                    .ca_bundle
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                    .unwrap_or_default();
                cert::trusts(&bundle, &served)
                    .err()
                    .map(|why| format!("{}: {why}", webhook.name))
            })
            .collect();
        if untrusting.is_empty() {
            CaBundle::Trusted
        } else {
            CaBundle::Mismatch(format!(
                "ValidatingWebhookConfiguration {}: the caBundle does not trust the certificate the webhook serves, so the API server refuses its TLS ({}); the leader rewrites it from the webhook Secret's ca.crt within 10 minutes, or at once when the Secret changes",
                registered.name_any(),
                untrusting.join("; ")
            ))
        }
    }
}

/// Ready endpoints of the Service `slices` belong to (an endpoint whose
/// `ready` is unset counts as ready, as the API says).
#[must_use]
pub fn ready_endpoints(slices: &[Arc<EndpointSlice>]) -> usize {
    slices
        .iter()
        .flat_map(|s| s.endpoints.iter())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
        .count()
}

/// Keeps the conditions of the FlatNetworkConfig `cluster` up to date
/// until `stop`: `controllers` says whether the leader's caches are
/// synced, `webhook` whether its webhook serves.
pub async fn run(
    client: Client,
    settings: Settings,
    controllers: Arc<Health>,
    webhook: WebhookProbe,
    stop: CancellationToken,
) {
    let (configs, config_writer) = reflector::store::<FlatNetworkConfig>();
    let (daemonsets, daemonset_writer) = reflector::store::<DaemonSet>();
    let (leases, lease_writer) = reflector::store::<Lease>();
    let config_api: Api<FlatNetworkConfig> = Api::all(client.clone());
    let follow_config = reflector::reflector(
        config_writer,
        watcher(
            config_api.clone(),
            watcher::Config::default().fields(&format!("metadata.name={CONFIG_NAME}")),
        ),
    )
    .default_backoff()
    .map(|_| ());
    let follow_daemonset = reflector::reflector(
        daemonset_writer,
        watcher(
            Api::<DaemonSet>::namespaced(client.clone(), &settings.namespace),
            watcher::Config::default().fields(&format!("metadata.name={}", settings.daemonset)),
        ),
    )
    .default_backoff()
    .map(|_| ());
    let follow_leases = reflector::reflector(
        lease_writer,
        watcher(
            Api::<Lease>::namespaced(client.clone(), &settings.namespace),
            watcher::Config::default().labels(&format!("{}=true", agent_heartbeat::LABEL)),
        ),
    )
    .default_backoff()
    .map(|_| ());
    // The agents' reports of what they saw on the LAN, for MacRangeShared.
    let (reports, report_writer) = reflector::store::<FlatNetworkWireClaims>();
    let follow_reports = reflector::reflector(
        report_writer,
        watcher(
            Api::<FlatNetworkWireClaims>::namespaced(client.clone(), SUBNET_NAMESPACE),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .map(|_| ());
    // The webhook Service's endpoints (EndpointSlices by their Service label).
    let (slices, slice_writer) = reflector::store::<EndpointSlice>();
    let webhook_service = match &webhook {
        WebhookProbe::Enabled {
            service: Some(service),
            ..
        } => Some(service.clone()),
        _ => None,
    };
    let follow_slices = match &webhook_service {
        Some(service) => reflector::reflector(
            slice_writer,
            watcher(
                Api::<EndpointSlice>::namespaced(client.clone(), &settings.namespace),
                watcher::Config::default().labels(&format!(
                    "{}={service}",
                    flatnet_k8s::keys::label::ENDPOINTSLICE_SERVICE_NAME
                )),
            ),
        )
        .default_backoff()
        .map(|_| ())
        .boxed(),
        None => futures::stream::pending().boxed(),
    };
    let configurations: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let changes = futures::stream::select(
        futures::stream::select(follow_config, follow_slices),
        futures::stream::select(
            follow_daemonset,
            futures::stream::select(follow_leases, follow_reports),
        ),
    );
    tokio::pin!(changes);
    let daemonset = format!("{}/{}", settings.namespace, settings.daemonset);
    let mut ticker = tokio::time::interval(settings.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ready = false;
    // The resourceVersion the last write replaced: while the cache still
    // shows it, that write has not come back yet and nothing is written.
    let mut replaced: Option<String> = None;
    // What Progressing named at the last look, and since when.
    let mut progress: Option<(String, Timestamp)> = None;
    let mut ca_bundle = CaBundle::Unchecked;
    let mut ca_checked: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            change = changes.next() => if change.is_none() { return },
            _ = ticker.tick() => {}
        }
        // Until every store listed once, a missing object is only unseen.
        ready = ready || (has_listed(&configs) && has_listed(&daemonsets) && has_listed(&leases));
        if !ready {
            continue;
        }
        if let WebhookProbe::Enabled { configuration, .. } = &webhook
            && ca_checked.is_none_or(|at| at.elapsed() >= settings.ca_bundle_interval)
        {
            ca_checked = Some(tokio::time::Instant::now());
            ca_bundle = match configurations.get(configuration).await {
                Ok(registered) => webhook.ca_bundle(&registered),
                Err(error) => {
                    debug!(%error, "cannot read the ValidatingWebhookConfiguration; the next look tries again");
                    CaBundle::Unchecked
                }
            };
        }
        let Some(config) = configs.state().into_iter().next() else {
            continue;
        };
        if replaced.is_some() && replaced == config.metadata.resource_version {
            continue;
        }
        let now = Timestamp::now();
        let mut observed = Observed {
            operator: Operator {
                leader: settings.leader.clone(),
                controllers_ready: controllers.is_ready(),
            },
            webhook: webhook.state(),
            rollout: daemonsets.state().first().map(|d| Rollout::of(d)),
            daemonset: daemonset.clone(),
            heartbeats: leases
                .state()
                .iter()
                .filter_map(|l| agent_heartbeat::read(l))
                .collect(),
            webhook_route: matches!(webhook, WebhookProbe::Enabled { .. }).then(|| WebhookRoute {
                // Until the slices are listed, not looked at (rather than
                // none ready).
                service: webhook_service
                    .as_ref()
                    .filter(|_| has_listed(&slices))
                    .map(|service| {
                        (
                            format!("{}/{service}", settings.namespace),
                            ready_endpoints(&slices.state()),
                        )
                    }),
                ca_bundle: ca_bundle.clone(),
            }),
            progress_since: None,
            progress_deadline: SignedDuration::try_from(config.progress_deadline())
                .unwrap_or(SignedDuration::MAX),
        };
        progress = progress_key(&observed, now).map(|key| match progress.take() {
            Some((seen, since)) if seen == key => (seen, since),
            _ => (key, now),
        });
        observed.progress_since = progress.as_ref().map(|(_, since)| *since);
        // Until the reports are listed (never, without their CRD), the
        // condition stays as it was.
        let mac_range = has_listed(&reports).then(|| {
            let range = config
                .status
                .as_ref()
                .and_then(|s| s.mac_pool.as_ref())
                .and_then(MacPoolStatus::range);
            let foreign = foreign_macs(
                reports.state().iter().map(AsRef::as_ref),
                now,
                settings.wire_window,
            );
            let seen = range.map(|r| inside(&r, &foreign)).unwrap_or_default();
            mac_range_condition(
                range.as_ref(),
                &seen,
                settings.wire_window,
                config.metadata.generation,
                now,
            )
        });
        if write(&config_api, &config, &observed, mac_range, now).await {
            replaced.clone_from(&config.metadata.resource_version);
        }
    }
}

/// Whether `store` has listed its objects once.
fn has_listed<K: kube::Resource<DynamicType = ()> + Clone + 'static>(
    store: &reflector::Store<K>,
) -> bool {
    futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok())
}

/// Writes the conditions `observed` gives, and `mac_range` when given,
/// when they differ from those of `config` (the cached copy: a conflict
/// means a newer one is coming); whether it wrote.
async fn write(
    api: &Api<FlatNetworkConfig>,
    config: &FlatNetworkConfig,
    observed: &Observed,
    mac_range: Option<Condition>,
    now: Timestamp,
) -> bool {
    let wanted = conditions(observed, config.metadata.generation, now)
        .into_iter()
        .chain(mac_range);
    let mut status = config.status.clone().unwrap_or_default();
    let Some(conditions) = merged(&status.conditions, wanted) else {
        return false;
    };
    let transitions: Vec<Condition> = conditions
        .iter()
        .filter(|c| {
            let before = status.conditions.iter().find(|b| b.type_ == c.type_);
            before.is_none_or(|b| b.status != c.status || b.reason != c.reason)
        })
        .cloned()
        .collect();
    status.conditions = conditions;
    let mut updated = config.clone();
    updated.status = Some(status);
    match api
        .replace_status(&config.name_any(), &PostParams::default(), &updated)
        .await
    {
        Ok(_) => {
            for c in transitions {
                info!(condition = %c.type_, status = %c.status, reason = %c.reason,
                    message = %c.message, "FlatNetworkConfig condition changed");
            }
            debug!("FlatNetworkConfig conditions written");
            true
        }
        Err(error) if is_conflict(&error) || is_not_found(&error) => {
            debug!(%error, "FlatNetworkConfig changed meanwhile; the next look writes");
            false
        }
        Err(error) => {
            warn!(%error, "cannot write the FlatNetworkConfig conditions; retrying");
            false
        }
    }
}

#[cfg(test)]
mod tests;
