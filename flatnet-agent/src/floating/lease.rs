//! The Lease per floating address: the tie-breaker when two agents both
//! own an address because they do not hear each other's heartbeats (the
//! heartbeat network partitioned while the LAN and the API server are
//! not, or a partition that healed on the LAN first).
//!
//! The rule: an agent that acquires an address (by the heartbeat election)
//! claims its Lease `flatnet-fip-<address>` at once, overwriting whatever
//! claim is there; it renews the claim every [`RENEW_INTERVAL`] while it
//! owns the address, and clears it when it lets the address go. An owner
//! that has seen its own claim in the Lease and then sees another node's
//! live claim there, from a node it does not hear, has been overtaken: the
//! **last claim written wins** (its owner announced last, so the LAN hosts
//! follow it), and the overtaken owner withdraws its responder entry at
//! once and stays out while that claim is live and its holder unheard.
//! Heartbeats, when they flow, stay the authority: a claim of a node this
//! agent hears never makes it yield, and the election decides between
//! them as always. Failover never waits for the API server: a new owner
//! claims after it has started answering, and the stale claim of a dead
//! owner (seen before this agent's own) never counts against it.
//!
//! A Lease is live while `renewTime + leaseDurationSeconds` is ahead of the
//! reader's clock ([`LEASE_DURATION`]); the nodes' clocks must agree within
//! a few seconds (NTP), as for every Lease.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    runtime::watcher,
};
use serde_json::json;
use tokio::sync::{Notify, watch};

use super::{liveness::AliveAgents, wake_on_change};
use crate::desired::kubernetes::Mirror;

/// How long a claim stays live without a renewal.
pub const LEASE_DURATION: Duration = Duration::from_secs(30);

/// How often the owner renews its claim.
pub const RENEW_INTERVAL: Duration = Duration::from_secs(10);

/// Label on the address Leases (the agents watch only those).
pub const LABEL: &str = "flatnetwork.pandaria.io/floating-ip-lease";

/// Annotation on an address Lease naming its address.
const ADDRESS_ANNOTATION: &str = flatnet_k8s::floating::annotation::ADDRESSES;

/// Field manager of the claims.
const FIELD_MANAGER: &str = "flatnet-agent-floating";

/// The Lease name of `addr`: `flatnet-fip-` and the address, with `:`
/// written `-` (and a final `0` when it would end in `-`), a valid name
/// that is different for every address.
pub fn lease_name(addr: IpAddr) -> String {
    let mut text = addr.to_string().replace(':', "-");
    if text.ends_with('-') {
        text.push('0');
    }
    format!("flatnet-fip-{text}")
}

/// The address a Lease is the claim of (its annotation).
fn address_of(lease: &Lease) -> Option<IpAddr> {
    lease.annotations().get(ADDRESS_ANNOTATION)?.parse().ok()
}

/// The claim a Lease holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The node claiming the address.
    pub holder: String,
    /// Whether the claim is live (renewed within its duration).
    pub live: bool,
}

/// The claim in `lease` at `now`, if any.
pub fn claim_of(lease: &Lease, now: Timestamp) -> Option<Claim> {
    let spec = lease.spec.as_ref()?;
    let holder = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(0)));
    let live = spec
        .renew_time
        .as_ref()
        .is_some_and(|renewed| now.duration_since(renewed.0) < duration);
    Some(Claim { holder, live })
}

/// What this agent does about one address's Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Write this node's claim (over whatever is there).
    Claim,
    /// The claim is this node's: keep renewing it.
    Keep,
    /// Clear this node's claim: it no longer owns the address.
    Release,
    /// Another node overtook this node's claim: withdraw and stay out.
    Yield {
        /// The node holding the claim.
        to: String,
    },
    /// Nothing to do.
    Nothing,
}

/// The verdict for an address this node `owns` (or not), whose Lease holds
/// `claim`, when this node has `confirmed` its own claim (seen it in the
/// Lease since it acquired the address) and `heard` says which nodes'
/// heartbeats arrive.
pub fn verdict(
    me: &str,
    owns: bool,
    confirmed: bool,
    claim: Option<&Claim>,
    heard: impl Fn(&str) -> bool,
) -> Verdict {
    let mine = claim.is_some_and(|c| c.holder == me);
    match (owns, claim) {
        (false, _) if mine => Verdict::Release,
        (false, _) => Verdict::Nothing,
        (true, _) if mine => Verdict::Keep,
        (true, Some(other)) if confirmed && other.live && !heard(&other.holder) => Verdict::Yield {
            to: other.holder.clone(),
        },
        (true, _) => Verdict::Claim,
    }
}

/// Whether a node that yielded an address still stays out: the claim it
/// yielded to is still another node's, live, and that node still unheard.
pub fn still_yielding(me: &str, claim: Option<&Claim>, heard: impl Fn(&str) -> bool) -> bool {
    claim.is_some_and(|c| c.holder != me && c.live && !heard(&c.holder))
}

/// The Lease claiming `addr` for `node` at `now`.
fn claim_lease(namespace: &str, addr: IpAddr, node: &str, now: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(lease_name(addr)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(LABEL.to_owned(), "true".to_owned())])),
            annotations: Some(BTreeMap::from([(
                ADDRESS_ANNOTATION.to_owned(),
                addr.to_string(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.to_owned()),
            lease_duration_seconds: Some(
                i32::try_from(LEASE_DURATION.as_secs()).unwrap_or(i32::MAX),
            ),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            ..LeaseSpec::default()
        }),
    }
}

/// What the Lease task is told and tells.
pub struct LeaseLink {
    /// The addresses this node owns (answers for) now.
    pub owned: watch::Receiver<BTreeSet<IpAddr>>,
    /// The agents the loop hears.
    pub alive: watch::Receiver<Option<AliveAgents>>,
    /// The addresses this node yielded, with the node it yielded to: the
    /// loop does not own them.
    pub yielded: watch::Sender<BTreeMap<IpAddr, String>>,
}

/// Keeps this node's claims in the address Leases of `namespace` and
/// publishes the addresses it must yield, for ever.
pub async fn run(client: Client, namespace: String, node: String, link: LeaseLink) {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let changed = Arc::new(Notify::new());
    let leases = Mirror::follow_selected(
        api.clone(),
        watcher::Config::default().labels(&format!("{LABEL}=true")),
        Some(Arc::clone(&changed)),
    );
    wake_on_change(link.owned.clone(), &changed);
    wake_on_change(link.alive.clone(), &changed);
    // Per owned address: when this node last wrote its claim, and whether
    // it has seen the claim in the Lease since.
    let mut claims: BTreeMap<IpAddr, (tokio::time::Instant, bool)> = BTreeMap::new();
    let mut yielded: BTreeMap<IpAddr, String> = BTreeMap::new();
    loop {
        let _ = tokio::time::timeout(RENEW_INTERVAL / 4, changed.notified()).await;
        let Some(objects) = leases.objects() else {
            continue;
        };
        let now = Timestamp::now();
        let by_address: BTreeMap<String, &Lease> =
            objects.iter().map(|l| (l.name_any(), &**l)).collect();
        let owned = link.owned.borrow().clone();
        let alive = link.alive.borrow().clone().unwrap_or_default();
        let heard = |n: &str| alive.contains_key(n);
        claims.retain(|addr, _| owned.contains(addr));
        let mut addresses: BTreeSet<IpAddr> = owned.clone();
        addresses.extend(yielded.keys().copied());
        // Claims of this node on addresses it no longer owns (a restart):
        // cleared below.
        addresses.extend(
            objects
                .iter()
                .filter(|l| {
                    l.spec.as_ref().and_then(|s| s.holder_identity.as_deref())
                        == Some(node.as_str())
                })
                .filter_map(|l| address_of(l)),
        );
        for addr in addresses {
            let name = lease_name(addr);
            let lease = by_address.get(&name).copied();
            let claim = lease.and_then(|l| claim_of(l, now));
            if let Some(to) = yielded.get(&addr) {
                if still_yielding(&node, claim.as_ref(), heard) {
                    continue;
                }
                tracing::info!(%addr, %to, "floating address: the claim this node yielded to lapsed or its holder is heard again; this node may own the address again");
                yielded.remove(&addr);
            }
            if claim.as_ref().is_some_and(|c| c.holder == node)
                && let Some((_, confirmed)) = claims.get_mut(&addr)
            {
                *confirmed = true;
            }
            let confirmed = claims.get(&addr).is_some_and(|(_, c)| *c);
            match verdict(
                &node,
                owned.contains(&addr),
                confirmed,
                claim.as_ref(),
                heard,
            ) {
                Verdict::Claim => {
                    let lease = claim_lease(&namespace, addr, &node, now);
                    match api
                        .patch(
                            &name,
                            &PatchParams::apply(FIELD_MANAGER).force(),
                            &Patch::Apply(&lease),
                        )
                        .await
                    {
                        Ok(_) => {
                            claims.insert(addr, (tokio::time::Instant::now(), false));
                        }
                        Err(error) => {
                            let refused = flatnet_k8s::forbidden::hint(
                                &error,
                                true,
                                Some(&namespace),
                                crate::AGENT_RBAC,
                            );
                            tracing::warn!(%addr, %error, "cannot claim the floating address's Lease{refused}; trying again");
                        }
                    }
                }
                Verdict::Keep => {
                    let due = claims
                        .get(&addr)
                        .is_none_or(|(at, _)| at.elapsed() >= RENEW_INTERVAL);
                    if due && let Some(lease) = lease {
                        let patch = json!({
                            "metadata": {"resourceVersion": lease.resource_version()},
                            "spec": {"renewTime": MicroTime(now)},
                        });
                        match api
                            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                            .await
                        {
                            Ok(_) => {
                                claims.insert(addr, (tokio::time::Instant::now(), true));
                            }
                            Err(error) => {
                                tracing::debug!(%addr, %error, "Lease renewal refused (changed meanwhile); looking again");
                            }
                        }
                    }
                }
                Verdict::Release => {
                    if let Some(lease) = lease {
                        let patch = json!({
                            "metadata": {"resourceVersion": lease.resource_version()},
                            "spec": {"holderIdentity": null},
                        });
                        if let Err(error) = api
                            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                            .await
                        {
                            tracing::debug!(%addr, %error, "Lease release refused (changed meanwhile)");
                        }
                    }
                }
                Verdict::Yield { to } => {
                    tracing::warn!(%addr, %to, "floating address: node {to}, which this node does not hear, claimed it after this node did (split brain); withdrawing");
                    claims.remove(&addr);
                    yielded.insert(addr, to);
                }
                Verdict::Nothing => {}
            }
        }
        link.yielded.send_if_modified(|current| {
            let modified = *current != yielded;
            if modified {
                current.clone_from(&yielded);
            }
            modified
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(holder: &str, live: bool) -> Claim {
        Claim {
            holder: holder.into(),
            live,
        }
    }

    #[test]
    fn lease_names_are_valid_and_distinct() {
        let names: BTreeSet<String> = ["10.0.0.5", "fd00::", "fd00::5", "::1", "fd00:1::"]
            .iter()
            .map(|a| lease_name(a.parse().unwrap()))
            .collect();
        assert_eq!(names.len(), 5);
        assert!(names.contains("flatnet-fip-10.0.0.5"));
        assert!(names.contains("flatnet-fip-fd00--0"));
        for name in &names {
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
                    && name.ends_with(|c: char| c.is_ascii_alphanumeric()),
                "{name}"
            );
        }
    }

    #[test]
    fn a_claim_is_live_within_its_duration() {
        let now = Timestamp::from_second(1_000).unwrap();
        let mut lease = claim_lease("flatnet", "10.0.0.5".parse().unwrap(), "a", now);
        assert_eq!(claim_of(&lease, now), Some(claim("a", true)));
        let later = now + SignedDuration::from_secs(30);
        assert_eq!(claim_of(&lease, later), Some(claim("a", false)));
        lease.spec.as_mut().unwrap().holder_identity = None;
        assert_eq!(claim_of(&lease, now), None);
    }

    #[test]
    fn the_owner_claims_keeps_and_releases_its_claim() {
        let nobody = |_: &str| false;
        assert_eq!(verdict("a", true, false, None, nobody), Verdict::Claim);
        assert_eq!(
            verdict("a", true, true, Some(&claim("a", true)), nobody),
            Verdict::Keep
        );
        assert_eq!(
            verdict("a", false, true, Some(&claim("a", true)), nobody),
            Verdict::Release
        );
        assert_eq!(
            verdict("a", false, false, Some(&claim("b", true)), nobody),
            Verdict::Nothing
        );
    }

    #[test]
    fn a_failover_overwrites_the_dead_owners_stale_claim() {
        // b died: its claim is still live, b is not heard, but this node
        // has not seen a claim of its own yet: it claims.
        assert_eq!(
            verdict("a", true, false, Some(&claim("b", true)), |_| false),
            Verdict::Claim
        );
    }

    #[test]
    fn the_owner_overtaken_by_a_node_it_does_not_hear_yields_until_that_changes() {
        let overtaken = claim("b", true);
        assert_eq!(
            verdict("a", true, true, Some(&overtaken), |_| false),
            Verdict::Yield { to: "b".into() }
        );
        assert!(still_yielding("a", Some(&overtaken), |_| false));
        // b heard again: the heartbeats decide, not the Lease.
        assert_eq!(
            verdict("a", true, true, Some(&overtaken), |n| n == "b"),
            Verdict::Claim
        );
        assert!(!still_yielding("a", Some(&overtaken), |n| n == "b"));
        // b's claim lapsed (b died too): a may own the address again.
        assert!(!still_yielding("a", Some(&claim("b", false)), |_| false));
        assert_eq!(
            verdict("a", true, true, Some(&claim("b", false)), |_| false),
            Verdict::Claim
        );
        // The claim cleared: nobody to yield to.
        assert!(!still_yielding("a", None, |_| false));
    }

    use flatnet_operator::allocation::fake_api::{FakeApiServer, rbac::Rbac};

    /// One agent's Lease task against `server`, owning `owned` and hearing
    /// `heard` (itself included).
    struct Agent {
        owned: watch::Sender<BTreeSet<IpAddr>>,
        alive: watch::Sender<Option<AliveAgents>>,
        yielded: watch::Receiver<BTreeMap<IpAddr, String>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Agent {
        fn start(server: &FakeApiServer, node: &str, owned: &[IpAddr], heard: &[&str]) -> Self {
            let (owned_tx, owned_rx) = watch::channel(owned.iter().copied().collect());
            let (alive_tx, alive_rx) = watch::channel(Some(alive_of(heard)));
            let (yielded_tx, yielded_rx) = watch::channel(BTreeMap::new());
            // Authorized by the chart's agent rules, installed in `flatnet`.
            let client = server
                .for_client(1)
                .with_rbac(Rbac::from_chart("flatnet-agent").in_release_namespace("flatnet"))
                .client();
            let task = tokio::spawn(run(
                client,
                "flatnet".into(),
                node.into(),
                LeaseLink {
                    owned: owned_rx,
                    alive: alive_rx,
                    yielded: yielded_tx,
                },
            ));
            Self {
                owned: owned_tx,
                alive: alive_tx,
                yielded: yielded_rx,
                task,
            }
        }

        fn yielded(&self) -> BTreeMap<IpAddr, String> {
            self.yielded.borrow().clone()
        }
    }

    impl Drop for Agent {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    fn alive_of(nodes: &[&str]) -> AliveAgents {
        nodes.iter().map(|n| ((*n).to_owned(), 1)).collect()
    }

    fn holder(server: &FakeApiServer, addr: IpAddr) -> Option<String> {
        server
            .list::<Lease>()
            .into_iter()
            .find(|l| l.metadata.name.as_deref() == Some(lease_name(addr).as_str()))?
            .spec?
            .holder_identity
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn against_the_api_one_of_two_unheard_owners_yields_and_only_leases_are_touched() {
        let server = FakeApiServer::new();
        let addr: IpAddr = "10.0.0.5".parse().unwrap();
        let a = Agent::start(&server, "a", &[addr], &["a"]);
        let b = Agent::start(&server, "b", &[addr], &["b"]);
        until("one of them yields", || {
            a.yielded().is_empty() != b.yielded().is_empty()
        })
        .await;
        let (winner, loser, loser_agent) = if a.yielded().is_empty() {
            ("a", "b", &b)
        } else {
            ("b", "a", &a)
        };
        assert_eq!(loser_agent.yielded()[&addr], winner);
        until("the Lease names the winner", || {
            holder(&server, addr).as_deref() == Some(winner)
        })
        .await;
        // The loser's loop releases the address; its yield holds while the
        // winner's claim is live and the winner unheard.
        loser_agent.owned.send_replace(BTreeSet::new());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(loser_agent.yielded()[&addr], winner);
        // Heard again: the heartbeats decide, the yield ends.
        loser_agent
            .alive
            .send_replace(Some(alive_of(&[loser, winner])));
        until("the yield ends", || loser_agent.yielded().is_empty()).await;
        assert_eq!(holder(&server, addr).as_deref(), Some(winner));

        // What the agent's Role grants, and nothing else: the create of a
        // claim's apply, patch, list and watch of Leases in flatnet's
        // namespace.
        let asked: BTreeSet<_> = server
            .accesses()
            .into_iter()
            .map(|a| (a.verb, a.group, a.resource, a.subresource, a.namespaced))
            .collect();
        for (verb, group, resource, subresource, namespaced) in &asked {
            assert!(
                ["create", "patch", "list", "watch"].contains(verb)
                    && group == "coordination.k8s.io"
                    && resource == "leases"
                    && subresource.is_none()
                    && *namespaced,
                "{asked:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_new_owner_overwrites_a_dead_owners_live_claim_and_clears_its_own_on_release() {
        let server = FakeApiServer::new();
        let addr: IpAddr = "fd00::5".parse().unwrap();
        // a owned the address and died: its claim is live, a is not heard.
        server.insert(&claim_lease("flatnet", addr, "a", Timestamp::now()));
        let b = Agent::start(&server, "b", &[addr], &["b"]);
        until("b claims", || holder(&server, addr).as_deref() == Some("b")).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(b.yielded().is_empty());
        // b lets the address go: its claim is cleared.
        b.owned.send_replace(BTreeSet::new());
        until("b's claim is cleared", || holder(&server, addr).is_none()).await;
    }

    #[test]
    fn of_two_owners_that_do_not_hear_each_other_exactly_one_yields() {
        // Both claimed and saw their own claim; b's write landed last.
        let lease = claim("b", true);
        let a = verdict("a", true, true, Some(&lease), |_| false);
        let b = verdict("b", true, true, Some(&lease), |_| false);
        assert_eq!(a, Verdict::Yield { to: "b".into() });
        assert_eq!(b, Verdict::Keep);
    }
}
