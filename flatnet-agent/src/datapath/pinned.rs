//! Access to the pinned maps without loading any program, for inspection
//! by a process other than the agent (`flatnet-agent inspect`).

use std::{collections::HashMap, path::Path};

use aya::maps::{Map, MapData};
use flatnet_common::pin::{
    MAP_ARP_RESPONDER, MAP_FRAME_COUNTERS, MAP_MANAGED_ADDRS, MAP_NDP_RESPONDER, MAP_NODE_MACS,
    MAP_RECENT_CONFLICTS, MAP_RESOLVE_WATCH, MAP_RESOLVERS, MAP_RESPONDER_STATS, MAP_WIRE_CLAIMS,
};

use super::{
    DatapathError, FrameCounters, ManagedAddrs, NodeMacs, RecentConflictEntry, ResolveWatch,
    ResolverEntry, ResponderStats, Responders, WireClaimEntry, WireClaims, conflicts, map_error,
    map_pin_path, resolvers, wire,
};

/// The maps pinned under one pin root.
pub struct PinnedMaps {
    maps: HashMap<&'static str, Map>,
}

impl PinnedMaps {
    /// Opens the table maps pinned under `pin_root` (the ring buffer stays
    /// with the agent that reads it).
    pub fn open(pin_root: &Path) -> Result<Self, DatapathError> {
        let mut maps = HashMap::new();
        for name in [
            MAP_FRAME_COUNTERS,
            MAP_ARP_RESPONDER,
            MAP_NDP_RESPONDER,
            MAP_RESPONDER_STATS,
            MAP_MANAGED_ADDRS,
            MAP_RECENT_CONFLICTS,
            MAP_WIRE_CLAIMS,
            MAP_RESOLVE_WATCH,
            MAP_RESOLVERS,
            MAP_NODE_MACS,
        ] {
            let data = MapData::from_pin(map_pin_path(pin_root, name)).map_err(map_error(name))?;
            maps.insert(name, Map::from_map_data(data).map_err(map_error(name))?);
        }
        Ok(Self { maps })
    }

    fn map(&self, name: &'static str) -> Result<&Map, DatapathError> {
        self.maps.get(name).ok_or(DatapathError::MissingMap(name))
    }

    /// Uplink frame counters.
    pub fn frame_counters(&self) -> Result<FrameCounters, DatapathError> {
        FrameCounters::read(self.map(MAP_FRAME_COUNTERS)?)
    }

    /// Answers sent by the uplink program.
    pub fn responder_stats(&self) -> Result<ResponderStats, DatapathError> {
        ResponderStats::read(self.map(MAP_RESPONDER_STATS)?)
    }

    /// The ARP/NDP responder tables.
    pub fn responders(&mut self) -> Result<Responders<'_>, DatapathError> {
        let [Some(arp), Some(ndp)] = self
            .maps
            .get_disjoint_mut([MAP_ARP_RESPONDER, MAP_NDP_RESPONDER])
        else {
            return Err(DatapathError::MissingMap(MAP_ARP_RESPONDER));
        };
        Responders::new(arp, ndp)
    }

    /// The latest conflict on each managed address, latest first.
    pub fn recent_conflicts(&self) -> Result<Vec<RecentConflictEntry>, DatapathError> {
        conflicts::recent_conflicts(self.map(MAP_RECENT_CONFLICTS)?)
    }

    /// The wire inventory: the MAC last seen claiming each address.
    pub fn wire_claims(&self) -> Result<Vec<WireClaimEntry>, DatapathError> {
        wire::wire_claims(self.map(MAP_WIRE_CLAIMS)?)
    }

    /// The inventory, to forget a pod's own claims.
    pub fn wire_claims_mut(&mut self) -> Result<WireClaims<'_>, DatapathError> {
        let map = self
            .maps
            .get_mut(MAP_WIRE_CLAIMS)
            .ok_or(DatapathError::MissingMap(MAP_WIRE_CLAIMS))?;
        WireClaims::new(map)
    }

    /// The floating addresses whose requesters the uplink program records.
    pub fn resolve_watch(&mut self) -> Result<ResolveWatch<'_>, DatapathError> {
        let map = self
            .maps
            .get_mut(MAP_RESOLVE_WATCH)
            .ok_or(DatapathError::MissingMap(MAP_RESOLVE_WATCH))?;
        ResolveWatch::new(map)
    }

    /// The LAN hosts seen resolving the watched addresses.
    pub fn resolvers(&self) -> Result<Vec<ResolverEntry>, DatapathError> {
        resolvers::resolvers(self.map(MAP_RESOLVERS)?)
    }

    /// The node's own MACs.
    pub fn node_macs(&mut self) -> Result<NodeMacs<'_>, DatapathError> {
        let map = self
            .maps
            .get_mut(MAP_NODE_MACS)
            .ok_or(DatapathError::MissingMap(MAP_NODE_MACS))?;
        NodeMacs::new(map)
    }

    /// The addresses watched for conflicts.
    pub fn managed_addrs(&mut self) -> Result<ManagedAddrs<'_>, DatapathError> {
        let map = self
            .maps
            .get_mut(MAP_MANAGED_ADDRS)
            .ok_or(DatapathError::MissingMap(MAP_MANAGED_ADDRS))?;
        ManagedAddrs::new(map)
    }
}
