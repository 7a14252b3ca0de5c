//! One agent's floating-address loop: heartbeats out and in, the election,
//! and the uplink program's responder entries of the addresses it owns.
//!
//! Every [`Settings::interval`] the agent renews the lease of each owned
//! address in the responder map, then sends its heartbeat (in that order,
//! so a peer's last heartbeat is never older than the last lease), then
//! applies ownership changes: a released address leaves the map, an
//! acquired one enters it and is announced with gratuitous ARP / unsolicited
//! NA at [`ANNOUNCE_AT`], and in the same rounds by unicast to the LAN hosts
//! the uplink program saw resolving it ([`super::resolvers`]); every offered
//! address is listed for that watch (`RESOLVE_WATCH`), owned or not, so a
//! standby knows whom to tell. What the node may serve (addresses, their
//! interfaces, the peers) is an [`Assignment`] read at every heartbeat. An
//! address is claimed only after it has been offered for one timeout,
//! while the agent learns whether a peer holds it. The lease ([`Settings::lease`]) is shorter than
//! the time peers wait before taking over, so a killed agent's node stops
//! answering before another node starts.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant, SystemTime},
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::{
    election::{Election, MISSED_HEARTBEATS},
    heartbeat::{HEARTBEAT_INTERVAL, Heartbeat, HeartbeatError, HeartbeatSocket},
    resolvers::{Resolver, recent_resolvers, unicast_reply_frames},
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

/// What one agent's loop needs that does not change while it runs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// This node's name.
    pub node: String,
    /// Where heartbeats are received.
    pub bind: SocketAddr,
    /// Heartbeat period.
    pub interval: Duration,
    /// How long a renewed responder entry stays answered; shorter than
    /// `interval * MISSED_HEARTBEATS`.
    pub lease: Duration,
    /// Where the uplink program's maps are pinned.
    pub pin_root: PathBuf,
    /// Where the loop keeps its [`Status`] for `flatnet-agent inspect
    /// floating`; none: nowhere.
    pub status_file: Option<PathBuf>,
}

/// Where the daemon and `flatnet-agent floating` keep the loop's status.
pub const DEFAULT_STATUS_FILE: &str = "/run/flatnet/floating.json";

/// What one node's loop knows of the addresses it offers, as
/// `flatnet-agent inspect floating` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// This node.
    pub node: String,
    /// Every address this node offers.
    pub addresses: Vec<AddressStatus>,
}

/// One offered address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AddressStatus {
    /// The address.
    pub address: IpAddr,
    /// The interface it is answered on here.
    pub interface: String,
    /// The node answering for it, as this node sees it: this node, a peer,
    /// or none while this node waits to claim it.
    pub owner: Option<String>,
    /// Since when (seconds since the epoch) that owner holds it, as seen here.
    pub since: u64,
    /// When this node last announced it (seconds since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_announced: Option<u64>,
    /// How many LAN hosts that announcement also told by unicast (those
    /// seen resolving the address recently).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_told: Option<usize>,
}

fn epoch_seconds() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The status rows, kept across heartbeats.
#[derive(Default)]
struct StatusBook {
    rows: BTreeMap<IpAddr, AddressStatus>,
    written: Option<Vec<AddressStatus>>,
}

impl StatusBook {
    /// Records the owner of each offered address.
    fn update(
        &mut self,
        offered: &BTreeMap<IpAddr, Link>,
        owner_of: impl Fn(IpAddr) -> Option<String>,
    ) {
        self.rows.retain(|addr, _| offered.contains_key(addr));
        for (addr, link) in offered {
            let owner = owner_of(*addr);
            let row = self.rows.entry(*addr).or_insert_with(|| AddressStatus {
                address: *addr,
                interface: link.name.clone(),
                owner: owner.clone(),
                since: epoch_seconds(),
                last_announced: None,
                last_told: None,
            });
            row.interface.clone_from(&link.name);
            if row.owner != owner {
                row.owner = owner;
                row.since = epoch_seconds();
            }
        }
    }

    /// The owner last recorded for `addr`.
    fn owner(&self, addr: IpAddr) -> Option<String> {
        self.rows.get(&addr).and_then(|row| row.owner.clone())
    }

    fn announced(&mut self, addr: IpAddr, told: usize) {
        if let Some(row) = self.rows.get_mut(&addr) {
            row.last_announced = Some(epoch_seconds());
            row.last_told = Some(told);
        }
    }

    /// Writes the status when it changed; a failure is logged, never fatal.
    fn write(&mut self, node: &str, path: Option<&std::path::Path>) {
        let Some(path) = path else { return };
        let rows: Vec<AddressStatus> = self.rows.values().cloned().collect();
        if self.written.as_ref() == Some(&rows) {
            return;
        }
        let status = Status {
            node: node.to_owned(),
            addresses: rows.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&status).unwrap_or_default();
        match crate::atomic_file::write_atomic_unsynced(path, &bytes) {
            Ok(()) => self.written = Some(rows),
            Err(error) => {
                tracing::debug!(path = %path.display(), %error, "floating status not written");
            }
        }
    }
}

impl Settings {
    /// The defaults for `node`: heartbeats on every address at
    /// [`HEARTBEAT_PORT`] every 100 ms, a 200 ms lease.
    pub fn new(node: impl Into<String>, pin_root: PathBuf) -> Self {
        Self {
            node: node.into(),
            bind: SocketAddr::from(([0, 0, 0, 0], super::heartbeat::HEARTBEAT_PORT)),
            interval: HEARTBEAT_INTERVAL,
            lease: HEARTBEAT_INTERVAL * 2,
            pin_root,
            status_file: None,
        }
    }
}

/// What this node may serve now and whom it tells: fixed in standalone
/// mode, followed from the API server in Kubernetes mode (read by the loop
/// at every heartbeat).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    /// The floating addresses this node is eligible for, each with the
    /// interface it is answered and announced on. An address whose
    /// interface is missing or down is not offered.
    pub addresses: BTreeMap<IpAddr, String>,
    /// The peers' heartbeat addresses.
    pub peers: Vec<SocketAddr>,
    /// Addresses this node must not own though the election gives them to
    /// it: another node it does not hear claimed them last
    /// ([`super::lease`]). Offered still, so the election is unchanged.
    pub yielded: BTreeSet<IpAddr>,
    /// The MAC an address is answered and announced with instead of its
    /// interface's: that of the local pod that holds it while this node
    /// owns it ([`super::backends`]).
    pub answer_as: BTreeMap<IpAddr, crate::packet::MacAddr>,
}

/// The interface an owned address is answered on.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Link {
    name: String,
    ifindex: u32,
    mac: [u8; 6],
}

/// The index and MAC of every interface that is up, by name, in the
/// calling thread's namespace (one netlink dump).
fn links_up() -> BTreeMap<String, (u32, [u8; 6])> {
    let Ok(addresses) = nix::ifaddrs::getifaddrs() else {
        return BTreeMap::new();
    };
    addresses
        .filter(|ifa| {
            ifa.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP)
                && ifa
                    .flags
                    .contains(nix::net::if_::InterfaceFlags::IFF_RUNNING)
        })
        .filter_map(|ifa| {
            let link = ifa.address?;
            let link = link.as_link_addr()?;
            Some((
                ifa.interface_name.clone(),
                (u32::try_from(link.ifindex()).ok()?, link.addr()?),
            ))
        })
        .collect()
}

/// An interface name (at most 15 bytes), kept inline so [`Event`] stays
/// `Copy`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct InterfaceName {
    bytes: [u8; 16],
    len: u8,
}

impl InterfaceName {
    fn new(name: &str) -> Self {
        let mut bytes = [0; 16];
        let len = name.len().min(16);
        bytes[..len].copy_from_slice(&name.as_bytes()[..len]);
        Self {
            bytes,
            len: u8::try_from(len).unwrap_or(16),
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or("?")
    }
}

impl std::fmt::Debug for InterfaceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl std::fmt::Display for InterfaceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the loop did, for metrics, logs and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Took the address over; its entry answers from `at_ns` (monotonic).
    Acquired {
        /// The address.
        addr: IpAddr,
        /// The interface it is answered on.
        interface: InterfaceName,
        /// `CLOCK_MONOTONIC` nanoseconds.
        at_ns: u64,
        /// The node this agent saw answering for it before, if any.
        previous: Option<String>,
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
    /// The agents alive changed (sent at the first heartbeat, then on
    /// every change): node name to incarnation, this node included.
    Agents {
        /// Every agent heard within the timeout, and this one.
        alive: BTreeMap<String, u64>,
    },
    /// Sent one round of announcements for the address: the broadcast
    /// one and a unicast reply to each host seen resolving it.
    Announced {
        /// The address.
        addr: IpAddr,
        /// Unicast replies sent in this round.
        unicast_replies: usize,
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
/// is set, serving what `assignment` holds at each heartbeat. Returning
/// leaves the map as it is: as after a crash, the leases run out by
/// themselves.
///
/// An address is claimed only once this node has offered it for one
/// timeout: a starting agent, or one newly eligible, first hears whether a
/// peer owns it (the peer then gives it up on hearing this node's offer),
/// so two nodes never answer at once.
///
/// # Errors
/// A socket or the responder map failing.
pub fn run(
    settings: &Settings,
    assignment: &watch::Receiver<Assignment>,
    stop: &AtomicBool,
    mut on_event: impl FnMut(Event),
) -> Result<(), OwnerError> {
    let socket = HeartbeatSocket::bind(settings.bind)?;
    let mut maps = PinnedMaps::open(&settings.pin_root)?;
    let incarnation = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let mut election = Election::new(settings.node.clone(), settings.interval * MISSED_HEARTBEATS);
    let lease_ns = u64::try_from(settings.lease.as_nanos()).unwrap_or(u64::MAX);
    let mut owned: BTreeMap<IpAddr, Link> = BTreeMap::new();
    // Since when each address has been offered without a break.
    let mut offered_since: BTreeMap<IpAddr, Instant> = BTreeMap::new();
    let mut announcements: Vec<(Instant, IpAddr)> = Vec::new();
    // The hosts each acquired address's announcements also go to.
    let mut told: BTreeMap<IpAddr, Vec<Resolver>> = BTreeMap::new();
    // The addresses listed in `RESOLVE_WATCH`; read from the map at the
    // first heartbeat, so what an earlier run left is cleaned up.
    let mut watched: Option<BTreeSet<(u32, IpAddr)>> = None;
    let mut raw_sockets: BTreeMap<String, RawSocket> = BTreeMap::new();
    let mut book = StatusBook::default();
    let mut alive: Option<BTreeMap<String, u64>> = None;
    let mut next_tick = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= next_tick {
            let until_ns = monotonic_ns().saturating_add(lease_ns);
            {
                let mut responders = maps.responders()?;
                for (addr, link) in &owned {
                    responders.insert_until(link.ifindex, *addr, link.mac, until_ns)?;
                }
            }
            if !owned.is_empty() {
                on_event(Event::Renewed { until_ns });
            }
            let current = assignment.borrow().clone();
            let up = links_up();
            let mine: BTreeMap<IpAddr, Link> = current
                .addresses
                .iter()
                .filter_map(|(addr, name)| {
                    let (ifindex, mac) = up.get(name)?;
                    Some((
                        *addr,
                        Link {
                            name: name.clone(),
                            ifindex: *ifindex,
                            mac: current.answer_as.get(addr).copied().unwrap_or(*mac),
                        },
                    ))
                })
                .collect();
            watch_offered(&mut maps, &mut watched, &mine)?;
            offered_since.retain(|addr, _| mine.contains_key(addr));
            for addr in mine.keys() {
                offered_since.entry(*addr).or_insert(now);
            }
            let offers: Vec<IpAddr> = mine.keys().copied().collect();
            for heartbeat in Heartbeat::split(&settings.node, incarnation, &offers) {
                socket.send(&heartbeat, &current.peers)?;
            }
            let now_alive = election.live_agents(incarnation, now);
            if alive.as_ref() != Some(&now_alive) {
                on_event(Event::Agents {
                    alive: now_alive.clone(),
                });
                alive = Some(now_alive);
            }
            let offered: BTreeSet<IpAddr> = mine.keys().copied().collect();
            let now_owned: BTreeMap<IpAddr, Link> = election
                .owned(&offered, now)
                .into_iter()
                .filter(|addr| {
                    offered_since.get(addr).is_some_and(|since| {
                        now.saturating_duration_since(*since) >= election.timeout()
                    })
                })
                .filter(|addr| !current.yielded.contains(addr))
                .filter_map(|addr| Some((addr, mine.get(&addr)?.clone())))
                .collect();
            // An address whose interface changed is released and acquired again.
            let before: BTreeSet<(IpAddr, &Link)> = owned.iter().map(|(a, l)| (*a, l)).collect();
            let after: BTreeSet<(IpAddr, &Link)> = now_owned.iter().map(|(a, l)| (*a, l)).collect();
            let acquired: Vec<(IpAddr, &Link)> = after.difference(&before).copied().collect();
            {
                let mut responders = maps.responders()?;
                for (addr, link) in before.difference(&after) {
                    responders.remove(link.ifindex, *addr)?;
                    announcements.retain(|(_, a)| a != addr);
                    on_event(Event::Released { addr: *addr });
                }
                for (addr, link) in &acquired {
                    let at_ns = monotonic_ns();
                    responders.insert_until(
                        link.ifindex,
                        *addr,
                        link.mac,
                        at_ns.saturating_add(lease_ns),
                    )?;
                    announcements.extend(ANNOUNCE_AT.iter().map(|after| (now + *after, *addr)));
                    on_event(Event::Acquired {
                        addr: *addr,
                        interface: InterfaceName::new(&link.name),
                        at_ns,
                        previous: book.owner(*addr).filter(|o| *o != settings.node),
                    });
                }
            }
            // After the responder entries: reading the whole map takes a
            // while when it is full, and answering must not wait for it.
            if !acquired.is_empty() {
                let heard = maps.resolvers().unwrap_or_else(|error| {
                    tracing::warn!(%error, "the LAN hosts resolving floating addresses are unknown; announcing by broadcast only");
                    Vec::new()
                });
                let now_ns = monotonic_ns();
                for (addr, link) in &acquired {
                    let hosts = recent_resolvers(&heard, link.ifindex, *addr, link.mac, now_ns);
                    told.insert(*addr, hosts);
                }
            }
            book.update(&mine, |addr| {
                if now_owned.contains_key(&addr) {
                    Some(settings.node.clone())
                } else {
                    election
                        .owner(addr, &offered, now)
                        .filter(|owner| *owner != settings.node)
                        .map(str::to_owned)
                }
            });
            owned = now_owned;
            told.retain(|addr, _| owned.contains_key(addr));
            raw_sockets.retain(|name, _| owned.values().any(|l| &l.name == name));
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
            let Some(link) = owned.get(&addr) else {
                continue;
            };
            if !raw_sockets.contains_key(&link.name) {
                let raw = RawSocket::open(&link.name).map_err(|source| OwnerError::Announce {
                    interface: link.name.clone(),
                    source,
                })?;
                raw_sockets.insert(link.name.clone(), raw);
            }
            let raw = &raw_sockets[&link.name];
            for frame in announcement_frames(link.mac, &[IpNet::from(addr)]) {
                if let Err(error) = raw.send(&frame) {
                    tracing::debug!(%addr, %error, "announcement not sent");
                }
            }
            let hosts = told.get(&addr).map_or(&[][..], Vec::as_slice);
            let mut unicast_replies = 0;
            for frame in unicast_reply_frames(link.mac, addr, hosts) {
                match raw.send(&frame) {
                    Ok(()) => unicast_replies += 1,
                    Err(error) => tracing::debug!(%addr, %error, "unicast reply not sent"),
                }
            }
            book.announced(addr, unicast_replies);
            on_event(Event::Announced {
                addr,
                unicast_replies,
            });
        }
        book.write(&settings.node, settings.status_file.as_deref());
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

/// Lists every offered address in `RESOLVE_WATCH` and removes the others:
/// a standby records who resolves an address as the owner does.
/// `watched` is what the map holds; `None` before the first call, which
/// reads it.
fn watch_offered(
    maps: &mut PinnedMaps,
    watched: &mut Option<BTreeSet<(u32, IpAddr)>>,
    offered: &BTreeMap<IpAddr, Link>,
) -> Result<(), DatapathError> {
    let mut watch = maps.resolve_watch()?;
    let listed = match watched.take() {
        Some(listed) => listed,
        None => watch.entries()?.into_iter().collect(),
    };
    let wanted: BTreeSet<(u32, IpAddr)> = offered
        .iter()
        .map(|(addr, link)| (link.ifindex, *addr))
        .collect();
    for (ifindex, addr) in listed.difference(&wanted) {
        watch.remove(*ifindex, *addr)?;
    }
    for (ifindex, addr) in wanted.difference(&listed) {
        watch.insert(*ifindex, *addr)?;
    }
    *watched = Some(wanted);
    Ok(())
}
