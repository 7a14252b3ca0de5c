//! Where the TCP MSS clamping programs sit on a pod's primary interface
//! (both hooks), and removing them again (attached by
//! [`super::Datapath::attach_mss_clamp`]).

use std::path::Path;

use aya::programs::TcAttachType;
use flatnet_common::pin::{MSS_CLAMP_TC_PRIORITY, PROG_MSS_CLAMP_EGRESS, PROG_MSS_CLAMP_INGRESS};

use super::{
    DatapathError,
    tc::{self, Slot},
};

/// Ingress (into the pod) and egress (out of it).
pub(super) const SLOTS: [Slot; 2] = [
    Slot {
        program: PROG_MSS_CLAMP_INGRESS,
        attach_type: TcAttachType::Ingress,
        priority: MSS_CLAMP_TC_PRIORITY,
    },
    Slot {
        program: PROG_MSS_CLAMP_EGRESS,
        attach_type: TcAttachType::Egress,
        priority: MSS_CLAMP_TC_PRIORITY,
    },
];

/// Removes flatnet's MSS clamping programs from `interface` (calling
/// thread's network namespace; TCX links pinned under `pin_root`). Returns
/// whether anything was attached.
pub fn detach_mss_clamp(pin_root: &Path, interface: &str) -> Result<bool, DatapathError> {
    tc::detach_all(pin_root, interface, &SLOTS)
}
