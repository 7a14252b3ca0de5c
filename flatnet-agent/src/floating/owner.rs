//! One agent's floating-address loop: heartbeats out and in, the election,
//! and the uplink program's responder entries of the addresses it owns.
//!
//! Every [`Settings::interval`] the agent renews the lease of each owned
//! address in the responder map, then sends its heartbeat (in that order,
//! so a peer's last heartbeat is never older than the last lease), then
//! applies ownership changes: a released address leaves the map, an
//! acquired one enters it and is announced with gratuitous ARP / unsolicited
//! NA at [`ANNOUNCE_AT`]. A starting agent claims nothing for one
//! timeout, while it learns its peers. The lease ([`Settings::lease`]) is shorter than
//! the time peers wait before taking over, so a killed agent's node stops
//! answering before another node starts.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant, SystemTime},
};

use ipnet::IpNet;

use super::{
    election::{Change, Election, MISSED_HEARTBEATS, changes},
    heartbeat::{HEARTBEAT_INTERVAL, Heartbeat, HeartbeatError, HeartbeatSocket},
};
use crate::{
    datapath::{DatapathError, PinnedMaps, monotonic_ns},
    link::announcement_frames,
    packet::RawSocket,
};

/// When an acquired address is announced, after acquiring it: repeated
/// because switches and hosts miss single frames, spread past the Linux
/// neighbour `locktime` (1 s) within which a host ignores a new MAC.
pub const ANNOUNCE_AT: [Duration; 5] = [
    Duration::ZERO,
    Duration::from_millis(50),
    Duration::from_millis(200),
    Duration::from_millis(500),
    Duration::from_millis(1100),
];

/// What one agent's loop needs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// This node's name.
    pub node: String,
    /// The uplink the addresses are answered and announced on.
    pub interface: String,
    /// The MAC answered with (the uplink's).
    pub mac: [u8; 6],
    /// The floating addresses this node can serve.
    pub candidate_for: Vec<IpAddr>,
    /// Where heartbeats are received.
    pub bind: SocketAddr,
    /// The peers' heartbeat addresses.
    pub peers: Vec<SocketAddr>,
    /// Heartbeat period.
    pub interval: Duration,
    /// How long a renewed responder entry stays answered; shorter than
    /// `interval * MISSED_HEARTBEATS`.
    pub lease: Duration,
    /// Where the uplink program's maps are pinned.
    pub pin_root: PathBuf,
}

impl Settings {
    /// The defaults for `node`: 100 ms heartbeats, a 200 ms lease.
    pub fn new(node: impl Into<String>, interface: impl Into<String>, pin_root: PathBuf) -> Self {
        Self {
            node: node.into(),
            interface: interface.into(),
            mac: [0; 6],
            candidate_for: Vec::new(),
            bind: SocketAddr::from(([0, 0, 0, 0], super::heartbeat::HEARTBEAT_PORT)),
            peers: Vec::new(),
            interval: HEARTBEAT_INTERVAL,
            lease: HEARTBEAT_INTERVAL * 2,
            pin_root,
        }
    }
}

/// What the loop did, for metrics, logs and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Took the address over; its entry answers from `at_ns` (monotonic).
    Acquired {
        /// The address.
        addr: IpAddr,
        /// `CLOCK_MONOTONIC` nanoseconds.
        at_ns: u64,
    },
    /// Gave the address up.
    Released {
        /// The address.
        addr: IpAddr,
    },
    /// Renewed the leases of every owned address up to `until_ns`.
    Renewed {
        /// `CLOCK_MONOTONIC` nanoseconds.
        until_ns: u64,
    },
    /// Sent one round of announcements for the address.
    Announced {
        /// The address.
        addr: IpAddr,
    },
}

/// Why the loop stopped.
#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    /// The heartbeat socket failed.
    #[error(transparent)]
    Heartbeat(#[from] HeartbeatError),
    /// The responder map could not be opened or written.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    /// The uplink is missing.
    #[error("floating addresses: interface {interface} not found: {source}")]
    Interface {
        /// The interface.
        interface: String,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// The raw socket for announcements failed.
    #[error("floating addresses: announcing on {interface}: {source}")]
    Announce {
        /// The interface.
        interface: String,
        /// Why.
        #[source]
        source: crate::packet::RawSocketError,
    },
}

/// Runs the loop in the calling thread's network namespace until `stop`
/// is set. Returning leaves the map as it is: as after a crash, the leases
/// run out by themselves.
///
/// # Errors
/// A socket or the responder map failing.
pub fn run(
    settings: &Settings,
    stop: &AtomicBool,
    mut on_event: impl FnMut(Event),
) -> Result<(), OwnerError> {
    let interface = settings.interface.as_str();
    let ifindex =
        nix::net::if_::if_nametoindex(interface).map_err(|source| OwnerError::Interface {
            interface: interface.to_owned(),
            source,
        })?;
    let socket = HeartbeatSocket::bind(settings.bind)?;
    let raw = RawSocket::open(interface).map_err(|source| OwnerError::Announce {
        interface: interface.to_owned(),
        source,
    })?;
    let mut maps = PinnedMaps::open(&settings.pin_root)?;
    let incarnation = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let mine: BTreeSet<IpAddr> = settings.candidate_for.iter().copied().collect();
    let heartbeat = Heartbeat {
        node: settings.node.clone(),
        incarnation,
        candidate_for: settings.candidate_for.clone(),
    };
    let mut election = Election::new(settings.node.clone(), settings.interval * MISSED_HEARTBEATS);
    let lease_ns = u64::try_from(settings.lease.as_nanos()).unwrap_or(u64::MAX);
    let mut owned: BTreeSet<IpAddr> = BTreeSet::new();
    let mut announcements: Vec<(Instant, IpAddr)> = Vec::new();
    let started = Instant::now();
    let mut next_tick = started;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= next_tick {
            let until_ns = monotonic_ns().saturating_add(lease_ns);
            {
                let mut responders = maps.responders()?;
                for addr in &owned {
                    responders.insert_until(ifindex, *addr, settings.mac, until_ns)?;
                }
            }
            if !owned.is_empty() {
                on_event(Event::Renewed { until_ns });
            }
            socket.send(&heartbeat, &settings.peers)?;
            // A starting agent claims nothing until it has listened for the
            // timeout: it would otherwise own everything it has not yet
            // heard a peer for.
            let now_owned = if now.saturating_duration_since(started) < election.timeout() {
                BTreeSet::new()
            } else {
                election.owned(&mine, now)
            };
            for change in changes(&owned, &now_owned) {
                let mut responders = maps.responders()?;
                match change {
                    Change::Release(addr) => {
                        responders.remove(ifindex, addr)?;
                        announcements.retain(|(_, a)| *a != addr);
                        on_event(Event::Released { addr });
                    }
                    Change::Acquire(addr) => {
                        let at_ns = monotonic_ns();
                        responders.insert_until(
                            ifindex,
                            addr,
                            settings.mac,
                            at_ns.saturating_add(lease_ns),
                        )?;
                        announcements.extend(ANNOUNCE_AT.iter().map(|after| (now + *after, addr)));
                        on_event(Event::Acquired { addr, at_ns });
                    }
                }
            }
            owned = now_owned;
            next_tick += settings.interval;
            if next_tick < now {
                // Fell behind (a stopped process, a slow machine): no burst.
                next_tick = now + settings.interval;
            }
        }
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) =
            announcements.into_iter().partition(|(at, _)| *at <= now);
        announcements = later;
        for (_, addr) in due {
            let net = IpNet::from(addr);
            for frame in announcement_frames(settings.mac, &[net]) {
                if let Err(error) = raw.send(&frame) {
                    tracing::debug!(%addr, %error, "announcement not sent");
                }
            }
            on_event(Event::Announced { addr });
        }
        let wake = announcements
            .iter()
            .map(|(at, _)| *at)
            .chain(std::iter::once(next_tick))
            .min()
            .unwrap_or(next_tick);
        if let Some(heard) = socket.receive(wake.saturating_duration_since(Instant::now()))? {
            election.heard(&heard, Instant::now());
        }
    }
    Ok(())
}
