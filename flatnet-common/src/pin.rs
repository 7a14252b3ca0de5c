//! Names of the kernel objects flatnet creates and where they are pinned.
//!
//! Kernel object names are capped at 15 bytes (16 with the NUL), so every
//! map and program name here stays within that.

/// Directory under the BPF filesystem holding every pinned flatnet object.
pub const PIN_ROOT: &str = "/sys/fs/bpf/flatnet";

/// Per-CPU array of [`crate::FrameCounter`] indexed by [`crate::FrameKind`]:
/// ARP and NDP frames seen on uplink ingress.
pub const MAP_FRAME_COUNTERS: &str = "FRAME_COUNTERS";

/// Hash map [`crate::responder::ArpResponderKey`] → [`crate::responder::ResponderEntry`]:
/// IPv4 addresses the uplink program answers ARP requests for.
pub const MAP_ARP_RESPONDER: &str = "ARP_RESPONDER";

/// Hash map [`crate::responder::NdpResponderKey`] → [`crate::responder::ResponderEntry`]:
/// IPv6 addresses the uplink program answers neighbour solicitations for.
pub const MAP_NDP_RESPONDER: &str = "NDP_RESPONDER";

/// Per-CPU array of `u64` indexed by [`crate::responder::ResponderStat`].
pub const MAP_RESPONDER_STATS: &str = "RESPONDER_STATS";

/// Hash map [`crate::conflict::AddrKey`] → [`crate::conflict::ManagedAddr`]:
/// addresses whose foreign claims are reported.
pub const MAP_MANAGED_ADDRS: &str = "MANAGED_ADDRS";

/// Ring buffer of [`crate::conflict::ConflictEvent`].
pub const MAP_CONFLICT_EVENTS: &str = "CONFLICT_EVENTS";

/// Every map the kernel object defines; each is pinned as `<pin root>/<name>`.
pub const PINNED_MAPS: [&str; 6] = [
    MAP_FRAME_COUNTERS,
    MAP_ARP_RESPONDER,
    MAP_NDP_RESPONDER,
    MAP_RESPONDER_STATS,
    MAP_MANAGED_ADDRS,
    MAP_CONFLICT_EVENTS,
];

/// Capacity of each responder map.
pub const RESPONDER_MAX_ENTRIES: u32 = 16_384;

/// TC filter priority of the uplink program (lower runs first).
pub const UPLINK_TC_PRIORITY: u16 = 0x1f00;

/// TC filter handle (minor) of the uplink program.
pub const UPLINK_TC_HANDLE: u16 = 1;

/// The TC ingress classifier attached to uplink (master / VLAN) interfaces.
pub const PROG_UPLINK_INGRESS: &str = "uplink_ingress";

const _: () = assert!(MAP_FRAME_COUNTERS.len() <= 15);
const _: () = assert!(PROG_UPLINK_INGRESS.len() <= 15);
const _: () = assert!(MAP_ARP_RESPONDER.len() <= 15);
const _: () = assert!(MAP_NDP_RESPONDER.len() <= 15);
const _: () = assert!(MAP_RESPONDER_STATS.len() <= 15);
const _: () = assert!(MAP_MANAGED_ADDRS.len() <= 15);
const _: () = assert!(MAP_CONFLICT_EVENTS.len() <= 15);
