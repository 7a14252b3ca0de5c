//! Which agents are alive, as this node's heartbeat loop hears them, for
//! the pod addresses: the API server shows a pod `Ready` for about 40 s
//! after its node died (until the node controller marks it otherwise), the
//! heartbeats tell within [`MISSED_HEARTBEATS`] intervals. The pod
//! addresses list the nodes their pods run on ([`AgentLink::peers`]), the
//! loop heartbeats them and reports who it hears ([`AgentLink::alive`]),
//! and [`Liveness`] turns that into what
//! [`active_pod_given`](flatnet_k8s::floating::pods::active_pod_given)
//! needs of each node: alive since its agent started, dead, or unknown.
//!
//! [`MISSED_HEARTBEATS`]: super::election::MISSED_HEARTBEATS

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, Instant},
};

use flatnet_k8s::floating::pods::NodeAgent;

use super::{election::MISSED_HEARTBEATS, heartbeat::HEARTBEAT_INTERVAL};
use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

/// How long a node must have been a peer of the loop, and the loop
/// running, before its silence means its agent is dead: time for both
/// sides' watches to list each other and for the first heartbeats (an
/// agent that was heard and falls silent is dead after the loop's
/// timeout, not this).
pub const DEAD_AFTER: Duration = Duration::from_secs(2);

/// How long the loop must have been reporting before its word counts:
/// one heartbeat timeout, within which it hears every live peer (so a
/// starting agent does not act on a view that lacks them).
pub const SETTLE: Duration = HEARTBEAT_INTERVAL.saturating_mul(MISSED_HEARTBEATS);

/// Node name to agent incarnation (nanoseconds since the epoch at the
/// agent's start), of every agent the loop hears, its own included.
pub type AliveAgents = BTreeMap<String, u64>;

/// The pod addresses' side of the heartbeat loop.
#[derive(Clone, Debug)]
pub struct AgentLink {
    /// What the loop hears: `None` until its first heartbeat.
    pub alive: watch::Receiver<Option<AliveAgents>>,
    /// The nodes of the pods listing a floating address: the loop
    /// heartbeats them (at their `InternalIP`s) beside the Services'.
    pub peers: Arc<watch::Sender<BTreeSet<String>>>,
}

/// What one agent knows of the others' liveness, over time.
#[derive(Clone, Debug, Default)]
pub struct Liveness {
    /// The loop's last report, and since when it reports.
    alive: Option<(AliveAgents, Instant)>,
    /// Since when each node has been listed as a peer.
    listed_since: BTreeMap<String, Instant>,
    /// The listed nodes heard at least once: silent, they are dead at
    /// once, without [`DEAD_AFTER`].
    heard: BTreeSet<String>,
    /// The nodes dead at the last [`Self::observe`].
    dead: BTreeSet<String>,
}

impl Liveness {
    /// Records the loop's report `alive` and the nodes `listed` as peers
    /// at `now`; returns the nodes dead before and alive again now (a
    /// healed partition, a restarted agent), whose return calls for the
    /// holders to announce again.
    pub fn observe(
        &mut self,
        alive: Option<&AliveAgents>,
        listed: &BTreeSet<String>,
        now: Instant,
    ) -> BTreeSet<String> {
        self.listed_since.retain(|node, _| listed.contains(node));
        self.heard.retain(|node| listed.contains(node));
        for node in listed {
            self.listed_since.entry(node.clone()).or_insert(now);
            if alive.is_some_and(|a| a.contains_key(node)) {
                self.heard.insert(node.clone());
            }
        }
        self.alive = match (alive, self.alive.take()) {
            (None, _) => None,
            (Some(alive), Some((_, since))) => Some((alive.clone(), since)),
            (Some(alive), None) => Some((alive.clone(), now)),
        };
        let dead: BTreeSet<String> = listed
            .iter()
            .filter(|node| self.agent_of(node, now) == NodeAgent::Dead)
            .cloned()
            .collect();
        let revived = self
            .dead
            .iter()
            .filter(|node| matches!(self.agent_of(node, now), NodeAgent::Alive { .. }))
            .cloned()
            .collect();
        self.dead = dead;
        revived
    }

    /// Whether the loop has reported for [`SETTLE`] at `now`: until then
    /// the pod addresses change nothing.
    pub fn settled(&self, now: Instant) -> bool {
        self.alive
            .as_ref()
            .is_some_and(|(_, since)| now.saturating_duration_since(*since) >= SETTLE)
    }

    /// What is known at `now` of the agent on `node`: alive when the loop
    /// hears it; dead when it was heard and is silent now, or is silent
    /// though listed as a peer, and the loop running, for [`DEAD_AFTER`];
    /// unknown otherwise (no loop, or not listed long enough).
    pub fn agent_of(&self, node: &str, now: Instant) -> NodeAgent {
        let Some((alive, reporting_since)) = &self.alive else {
            return NodeAgent::Unknown;
        };
        if let Some(incarnation) = alive.get(node) {
            let since = Timestamp::from_nanosecond(i128::from(*incarnation))
                .unwrap_or(Timestamp::UNIX_EPOCH);
            return NodeAgent::Alive { since };
        }
        let long_enough = |since: &Instant| now.saturating_duration_since(*since) >= DEAD_AFTER;
        if self.heard.contains(node)
            || (long_enough(reporting_since)
                && self.listed_since.get(node).is_some_and(long_enough))
        {
            NodeAgent::Dead
        } else {
            NodeAgent::Unknown
        }
    }

    /// When the view changes without news from the loop (it settles, or
    /// a silent node counts as dead), if it will.
    pub fn next_change(&self, now: Instant) -> Option<Instant> {
        let (alive, reporting_since) = self.alive.as_ref()?;
        self.listed_since
            .iter()
            .filter(|(node, _)| !alive.contains_key(*node) && !self.heard.contains(*node))
            .map(|(_, since)| (*since).max(*reporting_since) + DEAD_AFTER)
            .chain(std::iter::once(*reporting_since + SETTLE))
            .filter(|at| *at > now)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    fn alive(names: &[(&str, u64)]) -> AliveAgents {
        names.iter().map(|(n, i)| ((*n).to_owned(), *i)).collect()
    }

    #[test]
    fn without_the_loop_every_agent_is_unknown() {
        let mut liveness = Liveness::default();
        let start = Instant::now();
        liveness.observe(None, &nodes(&["a", "b"]), start);
        let later = start + DEAD_AFTER * 10;
        liveness.observe(None, &nodes(&["a", "b"]), later);
        assert_eq!(liveness.agent_of("b", later), NodeAgent::Unknown);
        assert_eq!(liveness.next_change(later), None);
    }

    #[test]
    fn a_heard_agent_is_alive_since_its_start_and_dead_once_silent() {
        let mut liveness = Liveness::default();
        let start = Instant::now();
        let listed = nodes(&["me", "b"]);
        liveness.observe(
            Some(&alive(&[("me", 1), ("b", 2_000_000_000)])),
            &listed,
            start,
        );
        assert_eq!(
            liveness.agent_of("b", start),
            NodeAgent::Alive {
                since: Timestamp::from_second(2).unwrap()
            }
        );
        // b falls silent long after it was listed: dead at once.
        let later = start + DEAD_AFTER * 2;
        let revived = liveness.observe(Some(&alive(&[("me", 1)])), &listed, later);
        assert!(revived.is_empty());
        assert_eq!(liveness.agent_of("b", later), NodeAgent::Dead);
        assert!(matches!(
            liveness.agent_of("me", later),
            NodeAgent::Alive { .. }
        ));
        // b is heard again: reported as revived, once.
        let revived = liveness.observe(
            Some(&alive(&[("me", 1), ("b", 3_000_000_000)])),
            &listed,
            later,
        );
        assert_eq!(revived, nodes(&["b"]));
        assert!(
            liveness
                .observe(
                    Some(&alive(&[("me", 1), ("b", 3_000_000_000)])),
                    &listed,
                    later
                )
                .is_empty()
        );
    }

    #[test]
    fn a_node_heard_and_silent_is_dead_at_once_even_when_listed_just_now() {
        let mut liveness = Liveness::default();
        let start = Instant::now();
        let listed = nodes(&["me", "b"]);
        liveness.observe(Some(&alive(&[("me", 1), ("b", 2)])), &listed, start);
        let soon = start + SETTLE;
        liveness.observe(Some(&alive(&[("me", 1)])), &listed, soon);
        assert_eq!(liveness.agent_of("b", soon), NodeAgent::Dead);
        // Unlisted, then listed again: a fresh start for it.
        liveness.observe(Some(&alive(&[("me", 1)])), &nodes(&["me"]), soon);
        liveness.observe(Some(&alive(&[("me", 1)])), &listed, soon);
        assert_eq!(liveness.agent_of("b", soon), NodeAgent::Unknown);
    }

    #[test]
    fn a_node_never_heard_is_dead_only_after_the_grace_for_listing_and_for_the_loop() {
        let mut liveness = Liveness::default();
        let start = Instant::now();
        let me = alive(&[("me", 1)]);
        // Listed before the loop reports.
        liveness.observe(None, &nodes(&["c"]), start);
        let reporting = start + DEAD_AFTER;
        liveness.observe(Some(&me), &nodes(&["c"]), reporting);
        assert_eq!(liveness.agent_of("c", reporting), NodeAgent::Unknown);
        assert!(!liveness.settled(reporting));
        assert_eq!(liveness.next_change(reporting), Some(reporting + SETTLE));
        assert!(liveness.settled(reporting + SETTLE));
        assert_eq!(
            liveness.next_change(reporting + SETTLE),
            Some(reporting + DEAD_AFTER)
        );
        let after = reporting + DEAD_AFTER;
        liveness.observe(Some(&me), &nodes(&["c"]), after);
        assert_eq!(liveness.agent_of("c", after), NodeAgent::Dead);
        // A node listed only now waits its own grace.
        liveness.observe(Some(&me), &nodes(&["c", "d"]), after);
        assert_eq!(liveness.agent_of("d", after), NodeAgent::Unknown);
        assert_eq!(liveness.next_change(after), Some(after + DEAD_AFTER));
        // Not listed: never dead.
        assert_eq!(
            liveness.agent_of("e", after + DEAD_AFTER * 5),
            NodeAgent::Unknown
        );
    }
}
