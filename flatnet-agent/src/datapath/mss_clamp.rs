//! Attaching the TCP MSS clamping programs to a pod's primary interface
//! (both hooks), and removing them again.

use std::path::Path;

use aya::{Ebpf, programs::TcAttachType};
use flatnet_common::pin::{MSS_CLAMP_TC_PRIORITY, PROG_MSS_CLAMP_EGRESS, PROG_MSS_CLAMP_INGRESS};

use super::{
    DatapathError,
    tc::{self, AttachMechanism, Slot},
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

/// Attaches both programs to `interface` in the calling thread's network
/// namespace, replacing earlier flatnet clamping attachments. They outlive
/// the process.
pub(super) fn attach(
    ebpf: &mut Ebpf,
    pin_root: &Path,
    mechanism: AttachMechanism,
    interface: &str,
) -> Result<(), DatapathError> {
    tc::attach_or_replace(ebpf, pin_root, mechanism, interface, &SLOTS)
}

/// Removes flatnet's MSS clamping programs from `interface` (calling
/// thread's network namespace; TCX links pinned under `pin_root`). Returns
/// whether anything was attached.
pub fn detach_mss_clamp(pin_root: &Path, interface: &str) -> Result<bool, DatapathError> {
    let mut any = false;
    for slot in SLOTS {
        any |= tc::detach(pin_root, interface, slot)?;
    }
    Ok(any)
}
