//! The floating addresses whose requesters the uplink program records
//! (`RESOLVE_WATCH`), and the LAN hosts it saw resolving them
//! (`RESOLVERS`), as user space writes and reads them.

use std::{net::IpAddr, time::Duration};

use aya::maps::{HashMap, MapData};
use flatnet_common::{
    conflict::AddrKey,
    pin::{MAP_RESOLVE_WATCH, MAP_RESOLVERS},
    resolver::{ResolverKey, ResolverSeen, WATCHED},
};

use super::{
    DatapathError,
    conflicts::{ip_from_key, key},
    is_missing_key, map_error,
};

/// Read/write access to the watched addresses.
pub struct ResolveWatch<'a> {
    map: HashMap<&'a mut MapData, AddrKey, u32>,
}

impl<'a> ResolveWatch<'a> {
    pub(super) fn new(map: &'a mut aya::maps::Map) -> Result<Self, DatapathError> {
        Ok(Self {
            map: HashMap::try_from(map).map_err(map_error(MAP_RESOLVE_WATCH))?,
        })
    }

    /// Records the requesters of `addr` on uplink `ifindex` from now on.
    pub fn insert(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), DatapathError> {
        self.map
            .insert(key(ifindex, addr), WATCHED, 0)
            .map_err(map_error(MAP_RESOLVE_WATCH))
    }

    /// Stops recording the requesters of `addr` on `ifindex`. Returns
    /// whether it was watched.
    pub fn remove(&mut self, ifindex: u32, addr: IpAddr) -> Result<bool, DatapathError> {
        match self.map.remove(&key(ifindex, addr)) {
            Ok(()) => Ok(true),
            Err(e) if is_missing_key(&e) => Ok(false),
            Err(e) => Err(map_error(MAP_RESOLVE_WATCH)(e)),
        }
    }

    /// Every watched `(ifindex, address)`, sorted.
    pub fn entries(&self) -> Result<Vec<(u32, IpAddr)>, DatapathError> {
        let mut out = Vec::new();
        for item in self.map.keys() {
            let key = item.map_err(map_error(MAP_RESOLVE_WATCH))?;
            out.push((key.ifindex, ip_from_key(&key.addr)));
        }
        out.sort();
        Ok(out)
    }
}

/// A LAN host seen resolving a watched address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResolverEntry {
    /// Uplink the request arrived on.
    pub ifindex: u32,
    /// 802.1Q VLAN id of a tagged request (0: untagged, or on a VLAN interface).
    pub vlan: u16,
    /// The address asked for.
    pub addr: IpAddr,
    /// The requester's address.
    pub requester: IpAddr,
    /// The requester's MAC.
    pub mac: [u8; 6],
    /// Kernel `CLOCK_MONOTONIC` time of its latest request, in nanoseconds.
    pub last_seen_ns: u64,
}

impl ResolverEntry {
    /// How long ago the host last asked, given the monotonic clock now.
    pub fn age(&self, now_ns: u64) -> Duration {
        Duration::from_nanos(now_ns.saturating_sub(self.last_seen_ns))
    }
}

/// Reads every entry of `RESOLVERS`, sorted by uplink, VLAN, address and
/// requester.
pub(super) fn resolvers(map: &aya::maps::Map) -> Result<Vec<ResolverEntry>, DatapathError> {
    let map: HashMap<&MapData, ResolverKey, ResolverSeen> =
        HashMap::try_from(map).map_err(map_error(MAP_RESOLVERS))?;
    let mut out = Vec::new();
    for item in map.iter() {
        let (key, value) = match item {
            Ok(entry) => entry,
            // The program evicted the entry between the key and its value.
            Err(e) if is_missing_key(&e) => continue,
            Err(e) => return Err(map_error(MAP_RESOLVERS)(e)),
        };
        out.push(ResolverEntry {
            ifindex: key.ifindex,
            vlan: key.vlan,
            addr: ip_from_key(&key.addr),
            requester: ip_from_key(&key.requester),
            mac: value.mac,
            last_seen_ns: value.last_seen_ns,
        });
    }
    out.sort_by_key(|e| (e.ifindex, e.vlan, e.addr, e.requester));
    Ok(out)
}
