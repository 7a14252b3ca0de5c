//! The IPAM engine: pure allocation logic, no Kubernetes I/O.
//!
//! - [`cidr`]: address families, CIDRs, the `u128` view of addresses.
//! - [`intervals`]: the interval set every pool is built on.
//! - [`pool`]: one subnet's addresses (allocate, mark, release, status view).
//! - [`used_ranges`]: the `status.usedIP` wire format.
//! - [`compact_ranges`]: `status.usedIPCompact`, for ledgers too large for
//!   `usedIP` alone.
//! - [`mac`]: fixed MACs and their uniqueness per parent link.
//! - [`mac_pool`]: the cluster's MAC pool (next-fit, quarantine).
//! - [`foreign_macs`]: MACs seen on the LAN inside a pool range, and the
//!   warning about them.
//! - [`sticky`]: the StatefulSet address policy.
//! - [`reservations`]: `status.reservedIP`, the addresses kept for their
//!   workloads (and V1 pods during a migration).
//! - [`wire`]: addresses live on the LAN, which the allocator skips.

pub mod cidr;
pub mod compact_ranges;
pub mod foreign_macs;
pub mod intervals;
pub mod mac;
pub mod mac_pool;
pub mod pool;
pub mod reservations;
pub mod six_to_four;
pub mod sticky;
pub mod used_ranges;
pub mod wire;

pub use cidr::{Cidr, CidrError, Family, from_u128, to_u128};
pub use compact_ranges::{CompactError, CompactRanges};
pub use intervals::IntervalSet;
pub use mac::{Mac, MacError, MacsTaken, choose_mac, macs_in_use};
pub use mac_pool::{MacPoolExhausted, MacPoolState, MacRange, MacRangeError};
pub use pool::{Pool, PoolError, Usage};
pub use reservations::Reservations;
pub use six_to_four::six_to_four;
pub use sticky::{
    PodController, RecordFate, Recorded, Request, Reuse, StatefulSetAddressPolicy,
    fate_on_pod_deletion, reuse_recorded,
};
pub use wire::{DEFAULT_WIRE_WINDOW, LiveAddresses, LiveClaim, Unvouched, every_node_reported};
