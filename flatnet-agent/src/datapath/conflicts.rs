//! IP-conflict detection: the managed-address table and the stream of
//! conflicts the uplink program reports.

use std::{
    fmt,
    net::{IpAddr, Ipv6Addr},
    os::fd::AsRawFd,
};

use aya::maps::{HashMap, MapData, RingBuf};
use flatnet_common::{
    conflict::{AddrKey, ClaimKind, ConflictEvent, ManagedAddr, RecentConflict},
    pin::{MAP_CONFLICT_EVENTS, MAP_MANAGED_ADDRS, MAP_RECENT_CONFLICTS},
};
use serde::Serialize;
use tokio::io::unix::AsyncFd;

use super::{DatapathError, format_mac, is_missing_key, map_error};

/// Read/write access to the addresses whose foreign claims are reported.
pub struct ManagedAddrs<'a> {
    map: HashMap<&'a mut MapData, AddrKey, ManagedAddr>,
}

impl<'a> ManagedAddrs<'a> {
    pub(super) fn new(map: &'a mut aya::maps::Map) -> Result<Self, DatapathError> {
        Ok(Self {
            map: HashMap::try_from(map).map_err(map_error(MAP_MANAGED_ADDRS))?,
        })
    }

    /// Reports claims on `addr` (seen on uplink `ifindex`) by any MAC but `owner_mac`.
    pub fn insert(
        &mut self,
        ifindex: u32,
        addr: IpAddr,
        owner_mac: [u8; 6],
    ) -> Result<(), DatapathError> {
        let value = ManagedAddr {
            owner_mac,
            reserved: 0,
            last_report_ns: 0,
        };
        self.map
            .insert(key(ifindex, addr), value, 0)
            .map_err(map_error(MAP_MANAGED_ADDRS))
    }

    /// Stops watching `addr` on `ifindex`. Returns whether it was watched.
    pub fn remove(&mut self, ifindex: u32, addr: IpAddr) -> Result<bool, DatapathError> {
        match self.map.remove(&key(ifindex, addr)) {
            Ok(()) => Ok(true),
            Err(e) if is_missing_key(&e) => Ok(false),
            Err(e) => Err(map_error(MAP_MANAGED_ADDRS)(e)),
        }
    }

    /// Every watched `(ifindex, address, owner MAC)`.
    pub fn entries(&self) -> Result<Vec<(u32, IpAddr, [u8; 6])>, DatapathError> {
        let mut out = Vec::new();
        for item in self.map.iter() {
            let (key, value) = item.map_err(map_error(MAP_MANAGED_ADDRS))?;
            out.push((key.ifindex, ip_from_key(&key.addr), value.owner_mac));
        }
        out.sort();
        Ok(out)
    }
}

/// The latest conflict on one managed address, from the pinned
/// recent-conflicts map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RecentConflictEntry {
    /// Uplink the claims arrived on.
    pub ifindex: u32,
    /// The address.
    pub addr: IpAddr,
    /// The MAC of the latest foreign claim.
    #[serde(serialize_with = "serialize_mac")]
    pub foreign_mac: [u8; 6],
    /// 802.1Q VLAN id of the claims (0: untagged).
    pub vlan: u16,
    /// How it was claimed last (`None` for an unknown kind value).
    #[serde(serialize_with = "serialize_optional_kind")]
    pub kind: Option<ClaimKind>,
    /// Foreign claim frames from `foreign_mac` since `first_seen_ns`.
    pub count: u32,
    /// Kernel monotonic time of the first claim, in nanoseconds.
    pub first_seen_ns: u64,
    /// Kernel monotonic time of the latest claim, in nanoseconds.
    pub last_seen_ns: u64,
}

/// Reads the recent-conflicts map, latest conflict first.
pub(super) fn recent_conflicts(
    map: &aya::maps::Map,
) -> Result<Vec<RecentConflictEntry>, DatapathError> {
    let map: HashMap<&MapData, AddrKey, RecentConflict> =
        HashMap::try_from(map).map_err(map_error(MAP_RECENT_CONFLICTS))?;
    let mut out = Vec::new();
    for item in map.iter() {
        let (key, value) = item.map_err(map_error(MAP_RECENT_CONFLICTS))?;
        out.push(RecentConflictEntry {
            ifindex: key.ifindex,
            addr: ip_from_key(&key.addr),
            foreign_mac: value.foreign_mac,
            vlan: value.vlan,
            kind: ClaimKind::from_u32(value.kind),
            count: value.count,
            first_seen_ns: value.first_seen_ns,
            last_seen_ns: value.last_seen_ns,
        });
    }
    out.sort_by(|a, b| {
        b.last_seen_ns
            .cmp(&a.last_seen_ns)
            .then((a.ifindex, a.addr).cmp(&(b.ifindex, b.addr)))
    });
    Ok(out)
}

/// One conflict: a foreign host claimed a managed address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Conflict {
    /// Uplink the claim arrived on.
    pub ifindex: u32,
    /// The address.
    pub addr: IpAddr,
    /// How it was claimed.
    #[serde(serialize_with = "serialize_kind")]
    pub kind: ClaimKind,
    /// The foreign MAC.
    #[serde(serialize_with = "serialize_mac")]
    pub foreign_mac: [u8; 6],
    /// The owner's MAC.
    #[serde(serialize_with = "serialize_mac")]
    pub owner_mac: [u8; 6],
    /// Kernel monotonic time of the frame, in nanoseconds.
    pub monotonic_ns: u64,
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "address {} (uplink ifindex {}) claimed by {} through {}; it belongs to {}",
            self.addr,
            self.ifindex,
            format_mac(self.foreign_mac),
            self.kind.name(),
            format_mac(self.owner_mac)
        )
    }
}

impl Conflict {
    fn from_event(event: &ConflictEvent) -> Option<Self> {
        Some(Self {
            ifindex: event.ifindex,
            addr: ip_from_key(&event.addr),
            kind: ClaimKind::from_u32(event.kind)?,
            foreign_mac: event.foreign_mac,
            owner_mac: event.owner_mac,
            monotonic_ns: event.timestamp_ns,
        })
    }
}

/// The stream of conflicts from the uplink program's ring buffer.
pub struct ConflictMonitor {
    ring: AsyncFd<RingBuf<MapData>>,
}

impl ConflictMonitor {
    pub(super) fn new(map: aya::maps::Map) -> Result<Self, DatapathError> {
        let ring = RingBuf::try_from(map).map_err(map_error(MAP_CONFLICT_EVENTS))?;
        // SAFETY: the RingBuf owns its map fd, which stays open and
        // unchanged until the AsyncFd (and the RingBuf inside it) is dropped.
        let ring = unsafe { AsyncFd::register(ring) }.map_err(|e| DatapathError::Io(e.into()))?;
        Ok(Self { ring })
    }

    /// The next conflict already in the ring buffer, without waiting.
    pub fn try_next(&mut self) -> Option<Conflict> {
        next_from(self.ring.get_mut())
    }

    /// Waits for the next conflict.
    pub async fn next(&mut self) -> Result<Conflict, DatapathError> {
        loop {
            let mut guard = self.ring.readable_mut().await.map_err(DatapathError::Io)?;
            if let Some(conflict) = next_from(guard.get_inner_mut()) {
                return Ok(conflict);
            }
            guard.clear_ready();
        }
    }
}

fn next_from(ring: &mut RingBuf<MapData>) -> Option<Conflict> {
    while let Some(item) = ring.next() {
        if item.len() < std::mem::size_of::<ConflictEvent>() {
            continue;
        }
        // SAFETY: the kernel wrote a whole ConflictEvent (checked length);
        // read_unaligned copes with the ring buffer's 8-byte alignment anyway.
        let event = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<ConflictEvent>()) };
        if let Some(conflict) = Conflict::from_event(&event) {
            return Some(conflict);
        }
    }
    None
}

impl AsRawFd for ConflictMonitor {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.ring.get_ref().as_raw_fd()
    }
}

pub(super) fn key(ifindex: u32, addr: IpAddr) -> AddrKey {
    match addr {
        IpAddr::V4(v4) => AddrKey::v4(ifindex, v4.octets()),
        IpAddr::V6(v6) => AddrKey::v6(ifindex, v6.octets()),
    }
}

pub(super) fn ip_from_key(addr: &[u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(*addr);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

fn serialize_mac<S: serde::Serializer>(mac: &[u8; 6], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_mac(*mac))
}

fn serialize_kind<S: serde::Serializer>(kind: &ClaimKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(kind.name())
}

#[expect(
    clippy::ref_option,
    reason = "serde's `serialize_with` passes a reference to the field"
)]
fn serialize_optional_kind<S: serde::Serializer>(
    kind: &Option<ClaimKind>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(kind.map_or("unknown", ClaimKind::name))
}
