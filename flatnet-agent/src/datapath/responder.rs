//! The tables of addresses the uplink program answers ARP and neighbour
//! solicitations for.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aya::maps::{HashMap, Map, MapData, PerCpuArray};
use flatnet_common::{
    pin::{MAP_ARP_RESPONDER, MAP_NDP_RESPONDER, MAP_RESPONDER_STATS},
    responder::{ArpResponderKey, NdpResponderKey, ResponderEntry, ResponderStat},
};
use serde::Serialize;

use super::{DatapathError, is_missing_key, map_error};

/// Read/write access to the responder maps of a loaded datapath.
pub struct Responders<'a> {
    arp: HashMap<&'a mut MapData, ArpResponderKey, ResponderEntry>,
    ndp: HashMap<&'a mut MapData, NdpResponderKey, ResponderEntry>,
}

/// Answers sent by the uplink program, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ResponderStats {
    /// ARP replies sent.
    pub arp_replies: u64,
    /// Neighbour advertisements sent.
    pub neighbor_advertisements: u64,
}

impl<'a> Responders<'a> {
    pub(super) fn new(arp: &'a mut Map, ndp: &'a mut Map) -> Result<Self, DatapathError> {
        Ok(Self {
            arp: HashMap::try_from(arp).map_err(map_error(MAP_ARP_RESPONDER))?,
            ndp: HashMap::try_from(ndp).map_err(map_error(MAP_NDP_RESPONDER))?,
        })
    }

    /// Answers for `addr` on the uplink `ifindex` with `mac` from now on.
    pub fn insert(
        &mut self,
        ifindex: u32,
        addr: IpAddr,
        mac: [u8; 6],
    ) -> Result<(), DatapathError> {
        self.insert_until(ifindex, addr, mac, 0)
    }

    /// Answers for `addr` on `ifindex` with `mac` until the
    /// `CLOCK_MONOTONIC` time `valid_until_ns` (0: for as long as it is
    /// listed): a floating address's lease, renewed by its owner.
    pub fn insert_until(
        &mut self,
        ifindex: u32,
        addr: IpAddr,
        mac: [u8; 6],
        valid_until_ns: u64,
    ) -> Result<(), DatapathError> {
        let entry = ResponderEntry {
            mac,
            flags: 0,
            valid_until_ns,
        };
        match addr {
            IpAddr::V4(v4) => self
                .arp
                .insert(arp_key(ifindex, v4), entry, 0)
                .map_err(map_error(MAP_ARP_RESPONDER)),
            IpAddr::V6(v6) => self
                .ndp
                .insert(ndp_key(ifindex, v6), entry, 0)
                .map_err(map_error(MAP_NDP_RESPONDER)),
        }
    }

    /// Stops answering for `addr` on `ifindex`. Returns whether it was listed.
    pub fn remove(&mut self, ifindex: u32, addr: IpAddr) -> Result<bool, DatapathError> {
        let result = match addr {
            IpAddr::V4(v4) => self.arp.remove(&arp_key(ifindex, v4)),
            IpAddr::V6(v6) => self.ndp.remove(&ndp_key(ifindex, v6)),
        };
        match result {
            Ok(()) => Ok(true),
            Err(e) if is_missing_key(&e) => Ok(false),
            Err(e) => Err(map_error(match addr {
                IpAddr::V4(_) => MAP_ARP_RESPONDER,
                IpAddr::V6(_) => MAP_NDP_RESPONDER,
            })(e)),
        }
    }

    /// Every listed `(ifindex, address, mac)`.
    pub fn entries(&self) -> Result<Vec<(u32, IpAddr, [u8; 6])>, DatapathError> {
        let mut out = Vec::new();
        for item in self.arp.iter() {
            let (key, entry) = item.map_err(map_error(MAP_ARP_RESPONDER))?;
            out.push((key.ifindex, IpAddr::V4(Ipv4Addr::from(key.addr)), entry.mac));
        }
        for item in self.ndp.iter() {
            let (key, entry) = item.map_err(map_error(MAP_NDP_RESPONDER))?;
            out.push((key.ifindex, IpAddr::V6(Ipv6Addr::from(key.addr)), entry.mac));
        }
        out.sort();
        Ok(out)
    }
}

impl ResponderStats {
    /// Reads the answer counters from the `RESPONDER_STATS` map.
    pub fn read(map: &Map) -> Result<Self, DatapathError> {
        let stats = PerCpuArray::<_, u64>::try_from(map).map_err(map_error(MAP_RESPONDER_STATS))?;
        let sum = |stat: ResponderStat| -> Result<u64, DatapathError> {
            let values = stats
                .get(&(stat as u32), 0)
                .map_err(map_error(MAP_RESPONDER_STATS))?;
            Ok(values.iter().sum())
        };
        Ok(Self {
            arp_replies: sum(ResponderStat::ArpReplies)?,
            neighbor_advertisements: sum(ResponderStat::NeighborAdvertisements)?,
        })
    }
}

fn arp_key(ifindex: u32, addr: Ipv4Addr) -> ArpResponderKey {
    ArpResponderKey {
        ifindex,
        addr: addr.octets(),
    }
}

fn ndp_key(ifindex: u32, addr: Ipv6Addr) -> NdpResponderKey {
    NdpResponderKey {
        ifindex,
        addr: addr.octets(),
    }
}
