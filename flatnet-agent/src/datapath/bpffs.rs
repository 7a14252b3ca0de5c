//! The BPF filesystem directory that holds flatnet's pinned objects.

use std::{
    fs::{self, DirBuilder},
    os::unix::fs::{DirBuilderExt, PermissionsExt},
    path::Path,
};

use nix::{
    mount::{MsFlags, mount},
    sys::statfs::{BPF_FS_MAGIC, statfs},
};

use super::DatapathError;

/// Where the BPF filesystem is conventionally mounted.
pub const BPFFS_MOUNT_POINT: &str = "/sys/fs/bpf";

/// Creates `pin_root` (and parents) root-only on the BPF filesystem.
///
/// When `pin_root` lies under [`BPFFS_MOUNT_POINT`] and nothing is mounted
/// there yet (common on hosts without systemd's bpffs unit), bpffs is
/// mounted first, as other eBPF networking agents do. Any other location
/// must already be on bpffs: pins elsewhere fail later with an obscure EPERM.
pub(super) fn ensure_pin_root(pin_root: &Path) -> Result<(), DatapathError> {
    let error = |reason: String| DatapathError::Bpffs {
        path: pin_root.to_path_buf(),
        reason,
    };
    if pin_root.starts_with(BPFFS_MOUNT_POINT) {
        mount_bpffs()?;
    }
    let existing_ancestor = pin_root
        .ancestors()
        .find(|p| p.exists())
        .ok_or_else(|| error("no existing parent directory".into()))?;
    if !is_bpffs(existing_ancestor) {
        return Err(error(format!(
            "{} is not on a bpf filesystem",
            existing_ancestor.display()
        )));
    }
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(pin_root)
        .map_err(|e| error(format!("create directory: {e}")))?;
    // The directory may predate us with looser permissions.
    fs::set_permissions(pin_root, fs::Permissions::from_mode(0o700))
        .map_err(|e| error(format!("chmod 0700: {e}")))?;
    Ok(())
}

/// Mounts the BPF filesystem on [`BPFFS_MOUNT_POINT`] unless it is already
/// there. Returns whether it mounted. Run by the chart's init container,
/// whose Bidirectional mount propagation makes the mount the host's.
pub fn mount_bpffs() -> Result<bool, DatapathError> {
    let mount_point = Path::new(BPFFS_MOUNT_POINT);
    if is_bpffs(mount_point) {
        return Ok(false);
    }
    mount(
        Some("bpf"),
        mount_point,
        Some("bpf"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=0700"),
    )
    .map_err(|e| DatapathError::Bpffs {
        path: mount_point.to_path_buf(),
        reason: format!("mount bpffs: {e}"),
    })?;
    Ok(true)
}

fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|fs| fs.filesystem_type() == BPF_FS_MAGIC)
}
