//! The node's own MACs, and which frames on an uplink never left the node.
//!
//! A macvlan in bridge mode hands a unicast frame for another macvlan of
//! the same lower device to that lower device's receive path (for its
//! taps) before delivering it, and an ipvlan does the same with a frame for
//! its master's own MAC. Such a frame crosses the uplink program (tc
//! ingress of the master, of a VLAN of it, of a bridge or a bond alike)
//! although it never was on the wire: pod to pod, pod to a node interface
//! on the master. Taken for a LAN host's, it made a pod's own address
//! claimed by its own MAC look like a clone on the LAN, and, once the pod
//! was gone, its address and MAC look like a foreign host's.
//!
//! So the uplink program skips (neither inventory nor conflict) every
//! frame whose Ethernet source **and** destination are both MACs of this
//! node: its pods' interfaces and its own interfaces, which the agent
//! keeps in the pinned hash map `NODE_MACS`. A frame from the LAN always
//! has a source or a destination off the node: a broadcast or multicast
//! claim carrying a pod's MAC (a clone, a rogue) still counts, and so does
//! any frame a LAN host sends to a pod.

/// Capacity of `NODE_MACS`: one entry per pod interface and per node
/// interface.
pub const NODE_MACS_MAX_ENTRIES: u32 = 16_384;

/// Key of `NODE_MACS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeMac {
    /// The MAC.
    pub mac: [u8; 6],
    /// Reserved, zero.
    pub reserved: [u8; 2],
}

impl NodeMac {
    /// The key of `mac`.
    #[inline(always)]
    pub const fn of(mac: [u8; 6]) -> Self {
        Self {
            mac,
            reserved: [0; 2],
        }
    }
}

/// Value bit of `NODE_MACS`: an interface in the node's own namespace
/// (the master, its VLANs, a bridge, a node's macvlan on the master).
pub const HOLDER_NODE: u8 = 1;
/// Value bit of `NODE_MACS`: the interface of a pod attached on this node.
pub const HOLDER_POD: u8 = 2;

#[cfg(feature = "user")]
// SAFETY: repr(C), no padding (6 + 2), every bit pattern valid.
unsafe impl aya::Pod for NodeMac {}
