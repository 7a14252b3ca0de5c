//! Attaching the uplink ingress program to master / VLAN interfaces.

use std::path::Path;

use aya::{
    Ebpf,
    programs::{SchedClassifier, TcAttachType},
};
use flatnet_common::pin::{PROG_UPLINK_INGRESS, UPLINK_TC_PRIORITY};

use super::{
    DatapathError,
    tc::{self, AttachMechanism, Slot},
};

const SLOT: Slot = Slot {
    program: PROG_UPLINK_INGRESS,
    attach_type: TcAttachType::Ingress,
    priority: UPLINK_TC_PRIORITY,
};

/// Attaches the uplink program on `interface` ingress, replacing an earlier
/// flatnet uplink program in place.
pub(super) fn attach(
    ebpf: &mut Ebpf,
    pin_root: &Path,
    mechanism: AttachMechanism,
    interface: &str,
) -> Result<(), DatapathError> {
    tc::attach_or_replace(ebpf, pin_root, mechanism, interface, &[SLOT])
}

/// The uplink program, loaded into the kernel on first use.
pub(super) fn loaded_program(ebpf: &mut Ebpf) -> Result<&mut SchedClassifier, DatapathError> {
    tc::loaded_classifier(ebpf, PROG_UPLINK_INGRESS)
}

/// Removes flatnet's uplink program from `interface` ingress (calling
/// thread's network namespace; TCX links pinned under `pin_root`). Returns
/// whether anything was attached.
pub fn detach_uplink(pin_root: &Path, interface: &str) -> Result<bool, DatapathError> {
    tc::detach(pin_root, interface, SLOT)
}
