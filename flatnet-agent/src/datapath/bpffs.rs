//! The BPF filesystem directory that holds flatnet's pinned objects.

use std::{
    fs::{self, DirBuilder},
    os::unix::fs::{DirBuilderExt, PermissionsExt},
    path::{Path, PathBuf},
};

use nix::{
    mount::{MsFlags, mount},
    sched::{CloneFlags, setns, unshare},
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
/// there, in this thread's mount namespace. Returns whether it mounted.
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

/// Unless [`BPFFS_MOUNT_POINT`] is bpffs already (the chart gives the init
/// container the host's directory as a volume, so bpffs there is the
/// host's): [`mount_bpffs`] in the host's mount namespace, that of PID 1 in
/// the host's procfs at `host_proc` (the chart's init container mounts the
/// host's `/proc` there), and makes the mount point shared.
///
/// Entering the host's namespace needs no mount propagation: containerd
/// refuses a Bidirectional volume when the host's `/sys` is not a shared
/// mount (hosts without systemd), so the mount could not be carried back.
/// Shared, the mount may then be given to the agent's container with
/// HostToContainer propagation, which needs a shared or slave mount too.
pub fn mount_bpffs_on_host(host_proc: &Path) -> Result<bool, DatapathError> {
    if is_bpffs(Path::new(BPFFS_MOUNT_POINT)) {
        return Ok(false);
    }
    let namespace = host_proc.join("1/ns/mnt");
    let error = |reason: String| DatapathError::Bpffs {
        path: PathBuf::from(BPFFS_MOUNT_POINT),
        reason,
    };
    // setns(2) into a mount namespace refuses a thread that shares its
    // filesystem attributes, as every thread of a process does: a thread of
    // its own unshares them first and is the only one that moves.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let file = fs::File::open(&namespace)
                    .map_err(|e| error(format!("open {}: {e}", namespace.display())))?;
                unshare(CloneFlags::CLONE_FS).map_err(|e| error(format!("unshare(CLONE_FS): {e}")))?;
                setns(&file, CloneFlags::CLONE_NEWNS).map_err(|e| {
                    error(format!(
                        "enter the host's mount namespace {}: {e} (needs CAP_SYS_ADMIN and CAP_SYS_CHROOT)",
                        namespace.display()
                    ))
                })?;
                let mounted = mount_bpffs()?;
                mount(
                    None::<&str>,
                    BPFFS_MOUNT_POINT,
                    None::<&str>,
                    MsFlags::MS_SHARED,
                    None::<&str>,
                )
                .map_err(|e| error(format!("make the mount shared: {e}")))?;
                Ok(mounted)
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|fs| fs.filesystem_type() == BPF_FS_MAGIC)
}

#[cfg(test)]
mod tests {
    use std::{process::Command, time::Duration};

    use super::*;

    /// The `/sys/fs/bpf` line of `/proc/<pid>/mountinfo`: its optional
    /// fields (propagation) and file system type.
    fn bpffs_mount_of(pid: u32) -> Option<(String, String)> {
        let mountinfo = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
        mountinfo.lines().rev().find_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let fields: Vec<&str> = before.split(' ').collect();
            (fields.get(4) == Some(&BPFFS_MOUNT_POINT)).then(|| {
                let optional = fields[6..].join(" ");
                let fstype = after.split(' ').next().unwrap_or_default().to_owned();
                (optional, fstype)
            })
        })
    }

    /// A host whose `/sys` is private and has no bpffs (no systemd): the
    /// mount is made in its mount namespace, through its procfs, and shared.
    #[test]
    fn mounts_bpffs_in_the_host_mount_namespace_and_makes_it_shared() {
        if !nix::unistd::geteuid().is_root() {
            assert!(
                std::env::var_os("FLATNET_REQUIRE_PRIVILEGED").is_none(),
                "needs root (mount namespaces)"
            );
            eprintln!("skipped: needs root (mount namespaces)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let mut host = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "while umount {BPFFS_MOUNT_POINT} 2>/dev/null; do :; done; touch {}; exec sleep 60",
                ready.display()
            ))
            .spawn()
            .expect("run unshare");
        for _ in 0..100 {
            if ready.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(ready.exists(), "the host's namespace is ready");
        let pid = host.id();
        assert_ne!(
            bpffs_mount_of(pid).map(|(_, fstype)| fstype).as_deref(),
            Some("bpf"),
            "no bpffs in the host's namespace yet"
        );
        // The init container's view of the host's procfs: PID 1 is the host.
        let host_proc = dir.path().join("proc");
        fs::create_dir(&host_proc).unwrap();
        std::os::unix::fs::symlink(format!("/proc/{pid}"), host_proc.join("1")).unwrap();

        // The init container's own view of /sys/fs/bpf (the volume) has no
        // bpffs either: a thread in a mount namespace of its own without it.
        let (first, mount, second) = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    unshare(CloneFlags::CLONE_FS | CloneFlags::CLONE_NEWNS).unwrap();
                    mount(
                        None::<&str>,
                        "/",
                        None::<&str>,
                        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                        None::<&str>,
                    )
                    .unwrap();
                    while nix::mount::umount(BPFFS_MOUNT_POINT).is_ok() {}
                    let first = mount_bpffs_on_host(&host_proc);
                    let mount = bpffs_mount_of(pid);
                    let second = mount_bpffs_on_host(&host_proc);
                    (first, mount, second)
                })
                .join()
                .unwrap()
        });
        let _ = host.kill();
        let _ = host.wait();
        assert!(first.unwrap(), "mounted");
        let (optional, fstype) = mount.expect("a mount on /sys/fs/bpf in the host's namespace");
        assert_eq!(fstype, "bpf");
        assert!(optional.contains("shared:"), "shared: {optional}");
        assert!(!second.unwrap(), "already mounted the second time");
    }
}
