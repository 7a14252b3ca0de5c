//! Who owns each floating address, from the heartbeats an agent heard.
//!
//! Every agent keeps the last heartbeat of each peer. A peer not heard
//! for [`Election::timeout`] is dead. The owner of an address is chosen by
//! rendezvous hashing among the live agents that are candidates for it
//! (ready, with the pool's interface, ...), this agent included, so agents
//! that hear the same peers agree without exchanging votes, and a dead
//! owner's addresses move to the next-highest candidate only.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use flatnet_k8s::floating::choose_owner;

use super::heartbeat::Heartbeat;

/// Heartbeats a peer may miss before it counts as dead.
pub const MISSED_HEARTBEATS: u32 = 3;

/// What an agent knows of one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Peer {
    /// The peer's process start (a restarted peer has a larger one).
    incarnation: u64,
    /// When its last heartbeat arrived.
    heard: Instant,
    /// The addresses it can serve, by heartbeat part.
    parts: BTreeMap<u16, BTreeSet<IpAddr>>,
}

impl Peer {
    fn candidate_for(&self, addr: &IpAddr) -> bool {
        self.parts.values().any(|part| part.contains(addr))
    }
}

/// One agent's view of the election.
#[derive(Clone, Debug)]
pub struct Election {
    me: String,
    timeout: Duration,
    peers: BTreeMap<String, Peer>,
}

/// A change of this agent's ownership.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Change {
    /// Start answering for the address and announce it.
    Acquire(IpAddr),
    /// Stop answering for the address.
    Release(IpAddr),
}

impl Election {
    /// The view of agent `me`, counting a peer dead after `timeout`
    /// without a heartbeat.
    pub fn new(me: impl Into<String>, timeout: Duration) -> Self {
        Self {
            me: me.into(),
            timeout,
            peers: BTreeMap::new(),
        }
    }

    /// How long a silent peer still counts as alive.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Records a heartbeat (part) received at `now`. Own heartbeats
    /// (looped back) and heartbeats older than the peer's current
    /// incarnation are ignored; a newer incarnation replaces every part.
    pub fn heard(&mut self, heartbeat: &Heartbeat, now: Instant) {
        if heartbeat.node == self.me || heartbeat.part >= heartbeat.parts.max(1) {
            return;
        }
        let peer = self
            .peers
            .entry(heartbeat.node.clone())
            .or_insert_with(|| Peer {
                incarnation: heartbeat.incarnation,
                heard: now,
                parts: BTreeMap::new(),
            });
        if peer.incarnation > heartbeat.incarnation {
            return;
        }
        if peer.incarnation < heartbeat.incarnation {
            peer.parts.clear();
        }
        peer.incarnation = heartbeat.incarnation;
        peer.heard = now;
        peer.parts.retain(|part, _| *part < heartbeat.parts);
        peer.parts.insert(
            heartbeat.part,
            heartbeat.candidate_for.iter().copied().collect(),
        );
    }

    /// The peers alive at `now`.
    pub fn live_peers(&self, now: Instant) -> Vec<&str> {
        self.peers
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.heard) < self.timeout)
            .map(|(name, _)| name.as_str())
            .collect()
    }

    /// The agents alive at `now` with their incarnations: the live peers
    /// and this agent (of `incarnation`).
    pub fn live_agents(&self, incarnation: u64, now: Instant) -> BTreeMap<String, u64> {
        self.peers
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.heard) < self.timeout)
            .map(|(name, p)| (name.clone(), p.incarnation))
            .chain(std::iter::once((self.me.clone(), incarnation)))
            .collect()
    }

    /// The owner of `addr` at `now` when this agent is a candidate for the
    /// addresses in `mine`: `None` when no live agent is.
    pub fn owner(&self, addr: IpAddr, mine: &BTreeSet<IpAddr>, now: Instant) -> Option<&str> {
        let live = self
            .peers
            .iter()
            .filter(|(_, p)| {
                now.saturating_duration_since(p.heard) < self.timeout && p.candidate_for(&addr)
            })
            .map(|(name, _)| name.as_str());
        let me = mine.contains(&addr).then_some(self.me.as_str());
        choose_owner(addr, live.chain(me))
    }

    /// The addresses of `mine` this agent owns at `now`.
    pub fn owned(&self, mine: &BTreeSet<IpAddr>, now: Instant) -> BTreeSet<IpAddr> {
        mine.iter()
            .copied()
            .filter(|addr| self.owner(*addr, mine, now) == Some(self.me.as_str()))
            .collect()
    }
}

/// What to do to go from owning `before` to owning `after`: releases
/// first, so an agent never answers for more than it owns.
pub fn changes(before: &BTreeSet<IpAddr>, after: &BTreeSet<IpAddr>) -> Vec<Change> {
    before
        .difference(after)
        .map(|a| Change::Release(*a))
        .chain(after.difference(before).map(|a| Change::Acquire(*a)))
        .collect()
}

#[cfg(test)]
mod tests;
