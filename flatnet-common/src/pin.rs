//! Names of the kernel objects flatnet creates and where they are pinned.
//!
//! Kernel object names are capped at 15 bytes (16 with the NUL), so every
//! map and program name here stays within that.

/// Directory under the BPF filesystem holding every pinned flatnet object.
pub const PIN_ROOT: &str = "/sys/fs/bpf/flatnet";

/// Directory under the pin root holding the TCX links (Linux 6.6+), one per
/// program and interface, named `<netns inode>-<ifindex>-<program>`.
pub const LINKS_DIR: &str = "links";

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

/// LRU hash [`crate::conflict::AddrKey`] → [`crate::conflict::RecentConflict`]:
/// the latest conflict on each managed address.
pub const MAP_RECENT_CONFLICTS: &str = "RECENT_CONFLICT";

/// LRU hash [`crate::wire::WireKey`] → [`crate::wire::WireClaim`]: the wire
/// inventory, the MAC last seen claiming each address on each uplink.
pub const MAP_WIRE_CLAIMS: &str = "WIRE_CLAIMS";

/// Hash map [`crate::conflict::AddrKey`] → `u32` ([`crate::resolver::WATCHED`]):
/// the floating addresses whose requesters the uplink program records.
pub const MAP_RESOLVE_WATCH: &str = "RESOLVE_WATCH";

/// LRU hash [`crate::resolver::ResolverKey`] → [`crate::resolver::ResolverSeen`]:
/// the LAN hosts seen resolving each watched address, with their MAC and when.
pub const MAP_RESOLVERS: &str = "RESOLVERS";

/// Hash map [`crate::node_macs::NodeMac`] → `u8` (holder bits): the MACs of
/// this node's interfaces and of its pods' interfaces; a frame between two
/// of them never left the node (see [`crate::node_macs`]).
pub const MAP_NODE_MACS: &str = "NODE_MACS";

/// LPM trie [`crate::policy::PolicyLpmData`] → [`crate::policy::PolicyAllow`]:
/// what each pod address may exchange with each remote prefix, per direction.
pub const MAP_POLICY_CIDRS: &str = "POLICY_CIDRS";

/// Hash map [`crate::policy::PolicySubjectKey`] → [`crate::policy::PolicySubject`]:
/// which directions are isolated for each pod address.
pub const MAP_POLICY_SUBJECTS: &str = "POLICY_SUBJECTS";

/// Per-CPU array of [`crate::FrameCounter`] indexed by policy rule id.
pub const MAP_POLICY_RULE_STATS: &str = "POLICY_RULES";

/// Per-CPU array of `u64` indexed by [`crate::policy::PolicyStat`].
pub const MAP_POLICY_STATS: &str = "POLICY_STATS";

/// LRU hash [`crate::policy::CtKey`] → [`crate::policy::CtEntry`]: tracked
/// flows (replies of allowed flows, and allowed flows under the policy digest
/// they were allowed by).
pub const MAP_POLICY_CT: &str = "POLICY_CT";

/// LRU hash [`crate::policy::FragKey`] → [`crate::policy::FragEntry`]: datagrams
/// whose first fragment was allowed.
pub const MAP_POLICY_FRAGS: &str = "POLICY_FRAGS";

/// Ring buffer of [`crate::policy::PolicyDropEvent`].
pub const MAP_POLICY_EVENTS: &str = "POLICY_EVENTS";

/// Per-CPU array (1 entry) of [`crate::policy::EventBudget`]: drop-event rate limit.
pub const MAP_POLICY_EVENT_BUDGET: &str = "POLICY_EVBUDGET";

/// Every map the kernel object defines; each is pinned as `<pin root>/<name>`.
pub const PINNED_MAPS: [&str; 19] = [
    MAP_FRAME_COUNTERS,
    MAP_ARP_RESPONDER,
    MAP_NDP_RESPONDER,
    MAP_RESPONDER_STATS,
    MAP_MANAGED_ADDRS,
    MAP_CONFLICT_EVENTS,
    MAP_RECENT_CONFLICTS,
    MAP_WIRE_CLAIMS,
    MAP_RESOLVE_WATCH,
    MAP_RESOLVERS,
    MAP_NODE_MACS,
    MAP_POLICY_CIDRS,
    MAP_POLICY_SUBJECTS,
    MAP_POLICY_RULE_STATS,
    MAP_POLICY_STATS,
    MAP_POLICY_CT,
    MAP_POLICY_FRAGS,
    MAP_POLICY_EVENTS,
    MAP_POLICY_EVENT_BUDGET,
];

/// Capacity of each responder map.
pub const RESPONDER_MAX_ENTRIES: u32 = 16_384;

/// TC filter priority of the uplink program (lower runs first).
pub const UPLINK_TC_PRIORITY: u16 = 0x1f00;

/// TC filter priority of the policy programs on pod interfaces (ingress
/// and egress are separate hooks, so they share it).
pub const POLICY_TC_PRIORITY: u16 = 0x1f10;

/// TC filter priority of the MSS clamping programs on a pod's primary
/// interface (after policy, which never looks at the MSS).
pub const MSS_CLAMP_TC_PRIORITY: u16 = 0x1f20;

/// The TC ingress classifier attached to uplink (master / VLAN) interfaces.
pub const PROG_UPLINK_INGRESS: &str = "uplink_ingress";

/// The TC ingress classifier on pod interfaces: ingress policy.
pub const PROG_POLICY_INGRESS: &str = "policy_ingress";

/// The TC egress classifier on pod interfaces: egress policy.
pub const PROG_POLICY_EGRESS: &str = "policy_egress";

/// The TC ingress classifier on a pod's primary interface: clamps the MSS
/// of SYNs into the pod.
pub const PROG_MSS_CLAMP_INGRESS: &str = "mss_clamp_in";

/// The TC egress classifier on a pod's primary interface: clamps the MSS
/// of SYNs out of the pod.
pub const PROG_MSS_CLAMP_EGRESS: &str = "mss_clamp_out";

const _: () = assert!(MAP_FRAME_COUNTERS.len() <= 15);
const _: () = assert!(PROG_MSS_CLAMP_INGRESS.len() <= 15);
const _: () = assert!(PROG_MSS_CLAMP_EGRESS.len() <= 15);
const _: () = assert!(PROG_UPLINK_INGRESS.len() <= 15);
const _: () = assert!(MAP_ARP_RESPONDER.len() <= 15);
const _: () = assert!(MAP_NDP_RESPONDER.len() <= 15);
const _: () = assert!(MAP_RESPONDER_STATS.len() <= 15);
const _: () = assert!(MAP_MANAGED_ADDRS.len() <= 15);
const _: () = assert!(MAP_CONFLICT_EVENTS.len() <= 15);
const _: () = assert!(MAP_RECENT_CONFLICTS.len() <= 15);
const _: () = assert!(MAP_POLICY_CIDRS.len() <= 15);
const _: () = assert!(MAP_POLICY_SUBJECTS.len() <= 15);
const _: () = assert!(MAP_POLICY_RULE_STATS.len() <= 15);
const _: () = assert!(MAP_POLICY_STATS.len() <= 15);
const _: () = assert!(MAP_POLICY_CT.len() <= 15);
const _: () = assert!(MAP_POLICY_FRAGS.len() <= 15);
const _: () = assert!(MAP_POLICY_EVENTS.len() <= 15);
const _: () = assert!(MAP_POLICY_EVENT_BUDGET.len() <= 15);
const _: () = assert!(PROG_POLICY_INGRESS.len() <= 15);
const _: () = assert!(PROG_POLICY_EGRESS.len() <= 15);
const _: () = assert!(MAP_WIRE_CLAIMS.len() <= 15);
const _: () = assert!(MAP_RESOLVE_WATCH.len() <= 15);
const _: () = assert!(MAP_RESOLVERS.len() <= 15);
const _: () = assert!(MAP_NODE_MACS.len() <= 15);
