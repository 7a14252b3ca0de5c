//! TCX attachments (Linux 6.6 and later): each program runs from a BPF
//! link pinned under `<pin root>/links/`, so it outlives the agent, and a
//! restarted or upgraded agent swaps the program in the link atomically
//! (`bpf_link_update`): the interface is never without it.
//!
//! TCX runs programs straight from the device's hook, without the clsact
//! qdisc and cls_bpf classifier between, which is cheaper per packet.
//!
//! A link is named after the network namespace (inode), the interface
//! index and the program. Deleting the interface (a pod's netns going
//! away) leaves the link defunct but pinned; [`remove_defunct`] clears those.

use std::{
    fs::{self, DirBuilder},
    io,
    os::{
        fd::{AsRawFd, BorrowedFd},
        unix::fs::{DirBuilderExt, MetadataExt},
    },
    path::{Path, PathBuf},
};

use aya::programs::{
    LinkOrder, MultiProgLink, SchedClassifier, TcAttachType,
    links::{FdLink, LinkError, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions},
};
use aya_obj::generated::{bpf_attach_type, bpf_cmd, bpf_link_info};

use flatnet_common::pin::LINKS_DIR;

use super::{
    DatapathError,
    tc::{self, Slot},
};

/// Attaches `slot.program` to `interface` (calling thread's network
/// namespace) through a pinned TCX link, or puts it into the link already
/// pinned for that interface and hook.
pub(super) fn attach_or_replace(
    program: &mut SchedClassifier,
    pin_root: &Path,
    interface: &str,
    slot: Slot,
) -> Result<(), DatapathError> {
    let program_error = tc::program_error(slot.program, interface);
    let ifindex = ifindex(interface)?;
    let path = link_pin_path(pin_root, ifindex, slot.program)?;
    if let Some(link) = open_pinned(&path)? {
        if link_target(&link, &path)? == Some((ifindex, slot.attach_type)) {
            let id = program.attach_to_link(link).map_err(program_error)?;
            // The pin keeps the link; dropping ours only closes a descriptor.
            drop(program.take_link(id).map_err(program_error)?);
            return Ok(());
        }
        // Defunct: its interface is gone and the index was handed out again.
        remove_pin(&path)?;
    }
    create_links_dir(&path)?;
    let id = program
        .attach_with_options(
            interface,
            slot.attach_type,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )
        .map_err(program_error)?;
    let link: FdLink = program
        .take_link(id)
        .map_err(program_error)?
        .try_into()
        .map_err(|e| link_error(&path, e))?;
    // Should pinning fail, `link` is dropped and the program detached again.
    link.pin(&path).map_err(|e| DatapathError::PinLink {
        path: path.clone(),
        source: io::Error::other(e),
    })?;
    Ok(())
}

/// Detaches the pinned link of `slot.program` on `interface`, if any, and
/// removes its pin. Returns whether the program was attached.
pub(super) fn detach(pin_root: &Path, interface: &str, slot: Slot) -> Result<bool, DatapathError> {
    let ifindex = ifindex(interface)?;
    let path = link_pin_path(pin_root, ifindex, slot.program)?;
    let Some(link) = open_pinned(&path)? else {
        return Ok(false);
    };
    let live = link_target(&link, &path)? == Some((ifindex, slot.attach_type));
    if live {
        link_detach(link_fd(&link, &path)?).map_err(|source| DatapathError::PinLink {
            path: path.clone(),
            source,
        })?;
    }
    remove_pin(&path)?;
    Ok(live)
}

/// Removes the pins of links whose interface no longer exists, in the
/// network namespace of inode `netns` or, with `None`, in any. Returns the
/// pins removed.
pub(super) fn remove_defunct(
    pin_root: &Path,
    netns: Option<u64>,
) -> Result<Vec<PathBuf>, DatapathError> {
    // Pins are named `<netns inode>-...`: one namespace's are found by name.
    let prefix = netns.map(|inode| format!("{inode}-"));
    let dir = pin_root.join(LINKS_DIR);
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(DatapathError::PinLink { path: dir, source }),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|source| DatapathError::PinLink {
                path: dir.clone(),
                source,
            })?
            .path();
        let in_scope = prefix.as_ref().is_none_or(|prefix| {
            path.file_name()
                .is_some_and(|name| name.to_string_lossy().starts_with(prefix.as_str()))
        });
        if !in_scope {
            continue;
        }
        let Some(link) = open_pinned(&path)? else {
            continue;
        };
        if link_target(&link, &path)?.is_none() {
            remove_pin(&path)?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// `<pin root>/links/<netns inode>-<ifindex>-<program>`, for the calling
/// thread's network namespace.
fn link_pin_path(pin_root: &Path, ifindex: u32, program: &str) -> Result<PathBuf, DatapathError> {
    // setns(2) is per thread, so the thread's view, not the process's.
    let netns = fs::metadata("/proc/thread-self/ns/net")
        .map_err(|source| DatapathError::PinLink {
            path: PathBuf::from("/proc/thread-self/ns/net"),
            source,
        })?
        .ino();
    Ok(pin_root
        .join(LINKS_DIR)
        .join(format!("{netns}-{ifindex}-{program}")))
}

/// Creates the directory of `pin` (root-only) unless it exists.
fn create_links_dir(pin: &Path) -> Result<(), DatapathError> {
    let dir = pin
        .parent()
        .expect("a link pin lies in the links directory");
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| DatapathError::PinLink {
            path: dir.to_path_buf(),
            source,
        })
}

fn ifindex(interface: &str) -> Result<u32, DatapathError> {
    nix::net::if_::if_nametoindex(interface).map_err(|e| DatapathError::Tc {
        interface: interface.to_owned(),
        source: aya::programs::tc::TcError::IoError(e.into()),
    })
}

/// The TCX link pinned at `path`, if there is one.
fn open_pinned(path: &Path) -> Result<Option<SchedClassifierLink>, DatapathError> {
    let pinned = match PinnedLink::from_pin(path) {
        Ok(pinned) => pinned,
        Err(LinkError::SyscallError(e)) if e.io_error.kind() == io::ErrorKind::NotFound => {
            return Ok(None);
        }
        Err(e) => return Err(link_error(path, e)),
    };
    // Not a TCX link: not ours to touch.
    SchedClassifierLink::try_from(FdLink::from(pinned))
        .map(Some)
        .map_err(|e| link_error(path, e))
}

fn link_fd<'l>(
    link: &'l SchedClassifierLink,
    path: &Path,
) -> Result<BorrowedFd<'l>, DatapathError> {
    MultiProgLink::fd(link).map_err(|e| link_error(path, e))
}

/// The interface index and hook of a TCX link; `None` once its interface
/// is gone (the kernel reports index 0 for a defunct link).
fn link_target(
    link: &SchedClassifierLink,
    path: &Path,
) -> Result<Option<(u32, TcAttachType)>, DatapathError> {
    let info = link_info(link_fd(link, path)?).map_err(|source| DatapathError::PinLink {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the kernel filled the `tcx` member for a TCX link, which
    // `SchedClassifierLink::try_from` checked this is.
    let tcx = unsafe { info.__bindgen_anon_1.tcx };
    let hook = match tcx.attach_type {
        t if t == bpf_attach_type::BPF_TCX_INGRESS as u32 => TcAttachType::Ingress,
        t if t == bpf_attach_type::BPF_TCX_EGRESS as u32 => TcAttachType::Egress,
        _ => return Ok(None),
    };
    Ok((tcx.ifindex != 0).then_some((tcx.ifindex, hook)))
}

/// `BPF_OBJ_GET_INFO_BY_FD` on a link (aya does not expose the TCX part).
fn link_info(link: BorrowedFd<'_>) -> io::Result<bpf_link_info> {
    #[repr(C, align(8))]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: bpf_link_info = unsafe { std::mem::zeroed() };
    let mut attr = InfoAttr {
        bpf_fd: link.as_raw_fd().cast_unsigned(),
        info_len: std::mem::size_of::<bpf_link_info>() as u32,
        info: (&raw mut info) as u64,
    };
    bpf(
        bpf_cmd::BPF_OBJ_GET_INFO_BY_FD,
        &raw mut attr,
        size_of_val(&attr),
    )?;
    Ok(info)
}

/// `BPF_LINK_DETACH`: detaches the link now, whoever else holds it.
fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    // Explicit padding: the kernel refuses attributes with non-zero bytes
    // past the command's fields.
    #[repr(C)]
    struct DetachAttr {
        link_fd: u32,
        _padding: u32,
    }
    let mut attr = DetachAttr {
        link_fd: link.as_raw_fd().cast_unsigned(),
        _padding: 0,
    };
    bpf(bpf_cmd::BPF_LINK_DETACH, &raw mut attr, size_of_val(&attr))
}

fn bpf<A>(cmd: bpf_cmd, attr: *mut A, size: usize) -> io::Result<()> {
    // SAFETY: `attr` points at a live attribute struct of `size` bytes
    // laid out as the kernel expects for `cmd`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr,
            size as libc::c_uint,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn remove_pin(path: &Path) -> Result<(), DatapathError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DatapathError::PinLink {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn link_error(path: &Path, error: LinkError) -> DatapathError {
    DatapathError::PinLink {
        path: path.to_path_buf(),
        source: io::Error::other(error),
    }
}
