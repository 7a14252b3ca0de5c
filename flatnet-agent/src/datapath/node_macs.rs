//! The node's own MACs (`NODE_MACS`): a frame between two of them never
//! left the node, and the uplink program takes no claim from it (see
//! [`flatnet_common::node_macs`]).

use std::collections::BTreeSet;

use aya::maps::{HashMap, MapData};
use flatnet_common::{
    node_macs::{HOLDER_NODE, HOLDER_POD, NodeMac},
    pin::MAP_NODE_MACS,
};

use super::{DatapathError, is_missing_key, map_error};

/// Read/write access to the node's own MACs.
pub struct NodeMacs<'a> {
    map: HashMap<&'a mut MapData, NodeMac, u8>,
}

impl<'a> NodeMacs<'a> {
    pub(super) fn new(map: &'a mut aya::maps::Map) -> Result<Self, DatapathError> {
        Ok(Self {
            map: HashMap::try_from(map).map_err(map_error(MAP_NODE_MACS))?,
        })
    }

    /// The holder bits of `mac` (0: not listed).
    fn holders(&self, mac: [u8; 6]) -> Result<u8, DatapathError> {
        match self.map.get(&NodeMac::of(mac), 0) {
            Ok(bits) => Ok(bits),
            Err(e) if is_missing_key(&e) => Ok(0),
            Err(e) => Err(map_error(MAP_NODE_MACS)(e)),
        }
    }

    /// Sets `mac`'s holder bits to `bits`, removing it at 0.
    fn set(&mut self, mac: [u8; 6], bits: u8) -> Result<(), DatapathError> {
        let key = NodeMac::of(mac);
        if bits != 0 {
            return self
                .map
                .insert(key, bits, 0)
                .map_err(map_error(MAP_NODE_MACS));
        }
        match self.map.remove(&key) {
            Err(e) if !is_missing_key(&e) => Err(map_error(MAP_NODE_MACS)(e)),
            _ => Ok(()),
        }
    }

    /// Lists `mac` as a pod interface's.
    pub fn add_pod(&mut self, mac: [u8; 6]) -> Result<(), DatapathError> {
        let bits = self.holders(mac)?;
        if bits & HOLDER_POD == 0 {
            self.set(mac, bits | HOLDER_POD)?;
        }
        Ok(())
    }

    /// Stops listing `mac` as a pod interface's (a node interface keeps it).
    pub fn remove_pod(&mut self, mac: [u8; 6]) -> Result<(), DatapathError> {
        let bits = self.holders(mac)?;
        if bits & HOLDER_POD != 0 {
            self.set(mac, bits & !HOLDER_POD)?;
        }
        Ok(())
    }

    /// Makes `macs` exactly the MACs listed as the node's own interfaces'.
    pub fn sync_node(&mut self, macs: &BTreeSet<[u8; 6]>) -> Result<(), DatapathError> {
        let listed = self.entries()?;
        for (mac, bits) in &listed {
            if bits & HOLDER_NODE != 0 && !macs.contains(mac) {
                self.set(*mac, bits & !HOLDER_NODE)?;
            }
        }
        for mac in macs {
            let bits = self.holders(*mac)?;
            if bits & HOLDER_NODE == 0 {
                self.set(*mac, bits | HOLDER_NODE)?;
            }
        }
        Ok(())
    }

    /// Every listed MAC with its holder bits, by MAC.
    pub fn entries(&self) -> Result<Vec<([u8; 6], u8)>, DatapathError> {
        let mut out = Vec::new();
        for item in self.map.iter() {
            let (key, bits) = item.map_err(map_error(MAP_NODE_MACS))?;
            out.push((key.mac, bits));
        }
        out.sort();
        Ok(out)
    }
}

/// The MACs of the interfaces of the calling thread's network namespace
/// (loopback and interfaces without a link-layer address have none).
pub fn interface_macs() -> Result<BTreeSet<[u8; 6]>, nix::Error> {
    Ok(nix::ifaddrs::getifaddrs()?
        .filter_map(|ifa| ifa.address?.as_link_addr()?.addr())
        .filter(|mac| *mac != [0; 6])
        .collect())
}
