//! Attaching flatnet's TC classifiers, through TCX links where the kernel
//! has them (Linux 6.6 and later, see `tcx`) and through netlink cls_bpf
//! filters otherwise (see `tc_netlink`). Either way an attachment outlives
//! the agent, a re-attach swaps the program in place, and attaching with one
//! mechanism removes what the other left (after the new attachment is in
//! place, so the interface is never without the program).

use std::{fmt, path::Path, str::FromStr};

use aya::{
    Ebpf,
    programs::{ProgramError, SchedClassifier, TcAttachType},
    util::KernelVersion,
};

use super::{DatapathError, tc_netlink, tcx};

/// Where one program sits on an interface.
#[derive(Clone, Copy, Debug)]
pub(super) struct Slot {
    /// Program name (also how a netlink filter is found for detaching).
    pub program: &'static str,
    /// Ingress or egress.
    pub attach_type: TcAttachType,
    /// Netlink filter priority (lower runs first); TCX links go last.
    pub priority: u16,
}

/// How programs are attached, as configured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TcAttach {
    /// TCX where the kernel has it (6.6 and later), netlink otherwise.
    #[default]
    Auto,
    /// TCX links; loading fails on kernels without TCX.
    Tcx,
    /// Netlink cls_bpf filters in a clsact qdisc.
    Netlink,
}

/// The first kernel with TCX.
const TCX_KERNEL: KernelVersion = KernelVersion::new(6, 6, 0);

impl TcAttach {
    /// The mechanism to use on a kernel with (`kernel_has_tcx`) or without TCX.
    pub fn resolve(self, kernel_has_tcx: bool) -> Result<AttachMechanism, DatapathError> {
        match (self, kernel_has_tcx) {
            (Self::Netlink, _) | (Self::Auto, false) => Ok(AttachMechanism::Netlink),
            (Self::Tcx | Self::Auto, true) => Ok(AttachMechanism::Tcx),
            (Self::Tcx, false) => Err(DatapathError::TcxUnsupported),
        }
    }

    /// The mechanism to use on the running kernel.
    pub(super) fn resolve_here(self) -> Result<AttachMechanism, DatapathError> {
        self.resolve(kernel_has_tcx())
    }
}

impl FromStr for TcAttach {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "tcx" => Ok(Self::Tcx),
            "netlink" => Ok(Self::Netlink),
            other => Err(format!(
                "unknown TC attach mode {other:?}: expected auto, tcx or netlink"
            )),
        }
    }
}

impl fmt::Display for TcAttach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Tcx => "tcx",
            Self::Netlink => "netlink",
        })
    }
}

/// Whether the running kernel has TCX. An unreadable version counts as
/// old: netlink works everywhere.
pub fn kernel_has_tcx() -> bool {
    KernelVersion::current().is_ok_and(|v| v >= TCX_KERNEL)
}

/// How programs are attached on this kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMechanism {
    /// Pinned TCX links.
    Tcx,
    /// Netlink cls_bpf filters.
    Netlink,
}

impl fmt::Display for AttachMechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcx => "tcx",
            Self::Netlink => "netlink",
        })
    }
}

/// Loads the programs of `slots` if needed and attaches them to
/// `interface` in the calling thread's network namespace with `mechanism`,
/// replacing the programs already in those slots (with either mechanism).
/// Filters share one clsact qdisc, made (or found) once for all slots.
pub(super) fn attach_or_replace(
    ebpf: &mut Ebpf,
    pin_root: &Path,
    mechanism: AttachMechanism,
    interface: &str,
    slots: &[Slot],
) -> Result<(), DatapathError> {
    if mechanism == AttachMechanism::Netlink {
        tc_netlink::ensure_clsact(interface)?;
    }
    for &slot in slots {
        let program = loaded_classifier(ebpf, slot.program)?;
        match mechanism {
            AttachMechanism::Tcx => {
                tcx::attach_or_replace(program, pin_root, interface, slot)?;
                tc_netlink::detach(interface, slot)?;
            }
            AttachMechanism::Netlink => {
                tc_netlink::attach_or_replace(program, interface, slot)?;
                tcx::detach(pin_root, interface, slot)?;
            }
        }
    }
    Ok(())
}

/// Removes `slot.program` from `interface`, whichever way it was attached.
/// Returns whether anything was attached.
pub(super) fn detach(pin_root: &Path, interface: &str, slot: Slot) -> Result<bool, DatapathError> {
    let filter = tc_netlink::detach(interface, slot)?;
    let link = tcx::detach(pin_root, interface, slot)?;
    Ok(filter || link)
}

/// Removes the programs of `slots` from `interface`, whichever way each
/// was attached. Returns whether any was attached.
pub(super) fn detach_all(
    pin_root: &Path,
    interface: &str,
    slots: &[Slot],
) -> Result<bool, DatapathError> {
    let mut any = false;
    for &slot in slots {
        any |= detach(pin_root, interface, slot)?;
    }
    Ok(any)
}

/// Turns an aya error about `program` on `interface` into ours.
pub(super) fn program_error<'i>(
    program: &'static str,
    interface: &'i str,
) -> impl Fn(ProgramError) -> DatapathError + Copy + 'i {
    move |source| DatapathError::Program {
        program,
        interface: interface.to_owned(),
        source,
    }
}

/// The TC classifier `name` of the object, loaded into the kernel on first use.
pub(super) fn loaded_classifier<'e>(
    ebpf: &'e mut Ebpf,
    name: &'static str,
) -> Result<&'e mut SchedClassifier, DatapathError> {
    let program_error = program_error(name, "");
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .ok_or_else(|| program_error(ProgramError::NotLoaded))?
        .try_into()
        .map_err(program_error)?;
    if program.fd().is_err() {
        program.load().map_err(program_error)?;
    }
    Ok(program)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_tcx_where_the_kernel_has_it() {
        assert_eq!(TcAttach::Auto.resolve(true).unwrap(), AttachMechanism::Tcx);
        assert_eq!(
            TcAttach::Auto.resolve(false).unwrap(),
            AttachMechanism::Netlink
        );
    }

    #[test]
    fn forced_mechanisms_are_kept_or_refused() {
        assert_eq!(
            TcAttach::Netlink.resolve(true).unwrap(),
            AttachMechanism::Netlink
        );
        assert_eq!(TcAttach::Tcx.resolve(true).unwrap(), AttachMechanism::Tcx);
        let error = TcAttach::Tcx.resolve(false).unwrap_err();
        assert!(error.to_string().contains("6.6"), "{error}");
    }

    #[test]
    fn modes_parse_and_print_alike() {
        for mode in [TcAttach::Auto, TcAttach::Tcx, TcAttach::Netlink] {
            assert_eq!(mode.to_string().parse::<TcAttach>().unwrap(), mode);
        }
        let error = "clsact".parse::<TcAttach>().unwrap_err();
        assert!(error.contains("auto, tcx or netlink"), "{error}");
    }
}
