//! Netlink attachments (every supported kernel, 6.1 included): a cls_bpf
//! filter in the interface's clsact qdisc, at a fixed priority and handle
//! per program.
//!
//! The filter stays when the agent exits, so traffic is never left without
//! the program. Because a program always sits at its own priority and
//! handle, a restarted or upgraded agent swaps the program atomically:
//! there is no window in which the interface has no program (for policy, no
//! window without enforcement).

use std::io;

use aya::programs::{
    ProgramError, SchedClassifier,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
};

use super::{
    DatapathError,
    tc::{Slot, program_error},
};

/// The filter handle flatnet uses at every priority it owns.
const HANDLE: TcHandle = TcHandle::new(0, 1);

/// Attaches `program` to `interface` in the calling thread's network
/// namespace, replacing the program already in the slot, if any; the
/// interface's clsact qdisc must be there ([`ensure_clsact`]). The
/// attachment outlives this process.
pub(super) fn attach_or_replace(
    program: &mut SchedClassifier,
    interface: &str,
    slot: Slot,
) -> Result<(), DatapathError> {
    let program_error = program_error(slot.program, interface);
    let options = TcAttachOptions::Netlink(NlOptions {
        priority: slot.priority,
        handle: HANDLE,
        classid: None,
    });
    let link_id = match program.attach_with_options(interface, slot.attach_type, options) {
        Ok(id) => id,
        Err(ProgramError::TcError(TcError::NetlinkError(e)))
            if e.raw_os_error() == Some(libc::EEXIST) =>
        {
            let existing = SchedClassifierLink::attached(
                interface,
                slot.attach_type,
                slot.priority,
                HANDLE,
                None,
            )
            .map_err(|e| tc_error(interface, TcError::IoError(e)))?;
            program.attach_to_link(existing).map_err(program_error)?
        }
        Err(e) => return Err(program_error(e)),
    };
    let link = program.take_link(link_id).map_err(program_error)?;
    // Dropping the link would detach the filter; it must outlive the agent.
    std::mem::forget(link);
    Ok(())
}

/// Removes every filter running `slot.program` from `interface`. Returns
/// whether anything was attached.
pub(super) fn detach(interface: &str, slot: Slot) -> Result<bool, DatapathError> {
    match tc::qdisc_detach_program(interface, slot.attach_type, slot.program) {
        Ok(()) => Ok(true),
        Err(TcError::IoError(e)) if e.kind() == io::ErrorKind::NotFound => {
            // NotFound means either "no such filter" or "no such interface".
            if nix::net::if_::if_nametoindex(interface).is_ok() {
                Ok(false)
            } else {
                Err(tc_error(interface, TcError::IoError(e)))
            }
        }
        // Without a clsact qdisc there can be no filter.
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(tc_error(interface, e)),
    }
}

/// Adds the clsact qdisc to `interface` unless it has one.
pub(super) fn ensure_clsact(interface: &str) -> Result<(), DatapathError> {
    match tc::qdisc_add_clsact(interface) {
        Ok(()) => Ok(()),
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        Err(TcError::AlreadyAttached) => Ok(()),
        Err(e) => Err(tc_error(interface, e)),
    }
}

fn tc_error(interface: &str, source: TcError) -> DatapathError {
    DatapathError::Tc {
        interface: interface.to_owned(),
        source,
    }
}
