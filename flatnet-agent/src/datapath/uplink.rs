//! Attaching the uplink ingress program to master / VLAN interfaces.

use std::io;

use aya::{
    Ebpf,
    programs::{
        SchedClassifier, TcAttachType,
        tc::{self, NlOptions, TcAttachOptions, TcError},
    },
};
use flatnet_common::pin::PROG_UPLINK_INGRESS;

use super::DatapathError;

/// Attaches the uplink program on `interface` ingress via netlink, first
/// removing any earlier flatnet attachment so there is exactly one.
pub(super) fn attach(ebpf: &mut Ebpf, interface: &str) -> Result<(), DatapathError> {
    let program_error = |source| DatapathError::Program {
        program: PROG_UPLINK_INGRESS,
        interface: interface.to_owned(),
        source,
    };
    ensure_clsact(interface)?;
    detach_uplink(interface)?;

    let program = loaded_program(ebpf)?;
    // Netlink rather than TCX: it exists on 6.1 and the filter stays when
    // the agent exits, so traffic is never left without the program.
    let link_id = program
        .attach_with_options(
            interface,
            TcAttachType::Ingress,
            TcAttachOptions::Netlink(NlOptions::default()),
        )
        .map_err(program_error)?;
    let link = program.take_link(link_id).map_err(program_error)?;
    // Dropping the link would detach the filter; it must outlive the agent.
    std::mem::forget(link);
    Ok(())
}

/// The uplink program, loaded into the kernel on first use.
pub(super) fn loaded_program(ebpf: &mut Ebpf) -> Result<&mut SchedClassifier, DatapathError> {
    loaded_classifier(ebpf, PROG_UPLINK_INGRESS)
}

/// The TC classifier `name` of the object, loaded into the kernel on first use.
pub(super) fn loaded_classifier<'e>(
    ebpf: &'e mut Ebpf,
    name: &'static str,
) -> Result<&'e mut SchedClassifier, DatapathError> {
    let program_error = |source| DatapathError::Program {
        program: name,
        interface: String::new(),
        source,
    };
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .ok_or_else(|| program_error(aya::programs::ProgramError::NotLoaded))?
        .try_into()
        .map_err(program_error)?;
    if program.fd().is_err() {
        program.load().map_err(program_error)?;
    }
    Ok(program)
}

/// Removes flatnet's uplink program from `interface` ingress. Returns whether
/// anything was attached.
pub fn detach_uplink(interface: &str) -> Result<bool, DatapathError> {
    match tc::qdisc_detach_program(interface, TcAttachType::Ingress, PROG_UPLINK_INGRESS) {
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

pub(super) fn ensure_clsact(interface: &str) -> Result<(), DatapathError> {
    match tc::qdisc_add_clsact(interface) {
        Ok(()) => Ok(()),
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        Err(TcError::AlreadyAttached) => Ok(()),
        Err(e) => Err(tc_error(interface, e)),
    }
}

pub(super) fn tc_error(interface: &str, source: TcError) -> DatapathError {
    DatapathError::Tc {
        interface: interface.to_owned(),
        source,
    }
}
