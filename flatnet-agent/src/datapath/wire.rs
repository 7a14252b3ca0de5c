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
