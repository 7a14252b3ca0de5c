//! Names of the kernel objects flatnet creates and where they are pinned.
//!
//! Kernel object names are capped at 15 bytes (16 with the NUL), so every
//! map and program name here stays within that.

/// Directory under the BPF filesystem holding every pinned flatnet object.
pub const PIN_ROOT: &str = "/sys/fs/bpf/flatnet";

/// Per-CPU array of [`crate::FrameCounter`] indexed by [`crate::FrameKind`]:
/// ARP and NDP frames seen on uplink ingress.
pub const MAP_FRAME_COUNTERS: &str = "FRAME_COUNTERS";

/// The TC ingress classifier attached to uplink (master / VLAN) interfaces.
pub const PROG_UPLINK_INGRESS: &str = "uplink_ingress";

const _: () = assert!(MAP_FRAME_COUNTERS.len() <= 15);
const _: () = assert!(PROG_UPLINK_INGRESS.len() <= 15);
