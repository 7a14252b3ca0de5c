//! The wire inventory as user space reads it: the MAC last seen claiming
//! each address on each uplink, from the pinned `WIRE_CLAIMS` map.

use std::{net::IpAddr, time::Duration};

use aya::maps::{HashMap, MapData};
use flatnet_common::{
    pin::MAP_WIRE_CLAIMS,
    wire::{WireClaim, WireKey, WireKind, WireSpace},
};

use super::{DatapathError, conflicts::ip_from_key, map_error};

/// One address the LAN was seen claiming.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireClaimEntry {
    /// Uplink the frame arrived on.
    pub ifindex: u32,
    /// 802.1Q VLAN id of a tagged frame (0: untagged, or on a VLAN interface).
    pub vlan: u16,
    /// The address.
    pub addr: IpAddr,
    /// The MAC last seen claiming it.
    pub mac: [u8; 6],
    /// The frame it was seen in (`None` for an unknown kind value).
    pub kind: Option<WireKind>,
    /// Kernel `CLOCK_MONOTONIC` time of the latest claim, in nanoseconds.
    pub last_seen_ns: u64,
}

impl WireClaimEntry {
    /// How long ago the claim was seen, given the monotonic clock now.
    pub fn age(&self, now_ns: u64) -> Duration {
        Duration::from_nanos(now_ns.saturating_sub(self.last_seen_ns))
    }
}

/// Reads the address entries of the inventory, sorted by uplink, VLAN and address.
pub(super) fn wire_claims(map: &aya::maps::Map) -> Result<Vec<WireClaimEntry>, DatapathError> {
    let map: HashMap<&MapData, WireKey, WireClaim> =
        HashMap::try_from(map).map_err(map_error(MAP_WIRE_CLAIMS))?;
    let mut out = Vec::new();
    for item in map.iter() {
        let (key, value) = item.map_err(map_error(MAP_WIRE_CLAIMS))?;
        if key.space != WireSpace::Address as u8 {
            continue;
        }
        out.push(WireClaimEntry {
            ifindex: key.ifindex,
            vlan: key.vlan,
            addr: ip_from_key(&key.id),
            mac: value.mac,
            kind: WireKind::from_u8(value.kind),
            last_seen_ns: value.last_seen_ns,
        });
    }
    out.sort_by_key(|e| (e.ifindex, e.vlan, e.addr));
    Ok(out)
}

/// Write access to the inventory, for forgetting what a pod said itself.
pub struct WireClaims<'a> {
    map: HashMap<&'a mut MapData, WireKey, WireClaim>,
}

impl<'a> WireClaims<'a> {
    pub(super) fn new(map: &'a mut aya::maps::Map) -> Result<Self, DatapathError> {
        Ok(Self {
            map: HashMap::try_from(map).map_err(map_error(MAP_WIRE_CLAIMS))?,
        })
    }

    /// The claim last seen of `addr` on uplink `ifindex` (untagged, as on
    /// a master or on a VLAN interface), if the inventory holds one.
    pub fn seen(
        &self,
        ifindex: u32,
        addr: IpAddr,
    ) -> Result<Option<WireClaimEntry>, DatapathError> {
        let key = untagged_key(ifindex, addr);
        match self.map.get(&key, 0) {
            Ok(claim) => Ok(Some(WireClaimEntry {
                ifindex,
                vlan: 0,
                addr,
                mac: claim.mac,
                kind: WireKind::from_u8(claim.kind),
                last_seen_ns: claim.last_seen_ns,
            })),
            Err(e) if super::is_missing_key(&e) => Ok(None),
            Err(e) => Err(map_error(MAP_WIRE_CLAIMS)(e)),
        }
    }

    /// Forgets the claim of `addr` on uplink `ifindex` (untagged, as on a
    /// master or on a VLAN interface) when `mac` made it: at a pod's DEL,
    /// what its own MAC last said of its own address was the pod itself
    /// (a frame a VEPA switch reflected, or one recorded by an agent that
    /// did not know the node's MACs yet), and must not outlive it as a
    /// foreign host's. Returns whether it was there.
    pub fn forget_own(
        &mut self,
        ifindex: u32,
        addr: IpAddr,
        mac: [u8; 6],
    ) -> Result<bool, DatapathError> {
        let key = untagged_key(ifindex, addr);
        match self.map.get(&key, 0) {
            Ok(claim) if claim.mac == mac => match self.map.remove(&key) {
                Ok(()) => Ok(true),
                Err(e) if super::is_missing_key(&e) => Ok(false),
                Err(e) => Err(map_error(MAP_WIRE_CLAIMS)(e)),
            },
            Ok(_) => Ok(false),
            Err(e) if super::is_missing_key(&e) => Ok(false),
            Err(e) => Err(map_error(MAP_WIRE_CLAIMS)(e)),
        }
    }
}

/// The inventory's key of `addr` on uplink `ifindex`, untagged (as on a
/// master or on a VLAN interface).
fn untagged_key(ifindex: u32, addr: IpAddr) -> WireKey {
    WireKey::address(ifindex, 0, super::conflicts::key(ifindex, addr).addr)
}
