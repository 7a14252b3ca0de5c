//! Running code inside another network namespace.
//!
//! `setns(2)` changes the namespace of the calling thread only, so work is
//! done on a dedicated short-lived thread and the caller's thread (and the
//! async runtime's workers) never change namespace.

use std::{fs::File, io, os::fd::AsRawFd, path::Path, thread};

use nix::{
    sched::{CloneFlags, setns},
    sys::statfs::{NSFS_MAGIC, fstatfs},
};

/// Errors entering a network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened.
    #[error("cannot open network namespace {path}: {source}")]
    Open {
        /// Path of the namespace file (e.g. `/run/netns/x`, `/proc/<pid>/ns/net`).
        path: String,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// The file opens but is no network namespace (a regular file, a
    /// directory, `/dev/null`, another kind of namespace).
    #[error(
        "{path} is not a network namespace (it is {what}); CNI_NETNS must name the container's network namespace, e.g. /var/run/netns/<name> or /proc/<pid>/ns/net"
    )]
    NotNetns {
        /// Path of the file.
        path: String,
        /// What it is instead.
        what: String,
    },
    /// `setns(2)` failed: not a network namespace, or missing CAP_SYS_ADMIN.
    #[error("cannot enter network namespace {path}: {source}")]
    Enter {
        /// Path of the namespace file.
        path: String,
        /// The errno from `setns`.
        #[source]
        source: nix::Error,
    },
    /// The closure panicked on the namespace thread.
    #[error("work inside network namespace {path} panicked")]
    Panicked {
        /// Path of the namespace file.
        path: String,
    },
}

/// Opens the network namespace at `path`, refusing a file that is not one:
/// it must live on nsfs, and `NS_GET_NSTYPE` must say `CLONE_NEWNET`.
pub fn open_netns(netns_path: &Path) -> Result<File, NetnsError> {
    let path = netns_path.display().to_string();
    let opened = File::open(netns_path).or_else(|error| {
        match run_alias(netns_path).filter(|_| error.kind() == std::io::ErrorKind::NotFound) {
            Some(alias) => File::open(alias),
            None => Err(error),
        }
    });
    let file = opened.map_err(|source| NetnsError::Open {
        path: path.clone(),
        source,
    })?;
    let not_netns = |what: String| NetnsError::NotNetns {
        path: path.clone(),
        what,
    };
    let on_nsfs = fstatfs(&file).is_ok_and(|fs| fs.filesystem_type() == NSFS_MAGIC);
    if !on_nsfs {
        let kind = match file.metadata() {
            Ok(m) if m.is_dir() => "a directory",
            Ok(m) if m.is_file() => "a regular file",
            Ok(_) => "a device or special file",
            Err(_) => "unreadable",
        };
        return Err(not_netns(kind.into()));
    }
    match namespace_type(&file) {
        Some(kind) if kind == CloneFlags::CLONE_NEWNET.bits() => Ok(file),
        Some(kind) => Err(not_netns(format!(
            "a namespace of another kind ({kind:#x})"
        ))),
        None => Err(not_netns("an nsfs file of unknown kind".into())),
    }
}

/// `/run/<rest>` for a path under `/var/run/`: runtimes (containerd) name
/// pod namespaces `/var/run/netns/...`, which on the host is `/run/netns/...`
/// (`/var/run` is a link to `/run`), while the agent's image has no
/// `/var/run` and mounts the host's `/run/netns` only.
fn run_alias(path: &Path) -> Option<std::path::PathBuf> {
    let rest = path.strip_prefix("/var/run").ok()?;
    (!rest.as_os_str().is_empty()).then(|| Path::new("/run").join(rest))
}

/// `NS_GET_NSTYPE` (`_IO(0xb7, 0x3)`, linux/nsfs.h): the `CLONE_NEW*`
/// flag of the namespace an nsfs file refers to.
const NS_GET_NSTYPE: libc::Ioctl = 0xb703;

/// The `CLONE_NEW*` flag of the namespace behind `file`, or `None` when the
/// kernel does not say.
fn namespace_type(file: &File) -> Option<i32> {
    // SAFETY: NS_GET_NSTYPE takes no argument and only reads the descriptor,
    // which `file` keeps open for the call.
    let kind = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE) };
    (kind >= 0).then_some(kind)
}

/// Whether `path` names a network namespace flatnet can enter. DEL and
/// teardown skip the pod side of an attachment whose namespace is gone or
/// unusable: its interfaces are gone with it, or were never made.
pub fn is_netns(path: &Path) -> bool {
    open_netns(path).is_ok()
}

/// Runs `work` on a fresh thread that has joined the network namespace at
/// `netns_path`, and returns its result.
pub fn run_in_netns<T, F>(netns_path: &Path, work: F) -> Result<T, NetnsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    let path = netns_path.display().to_string();
    let file = open_netns(netns_path)?;
    thread::scope(|scope| {
        scope
            .spawn(|| {
                setns(&file, CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Enter {
                    path: path.clone(),
                    source,
                })?;
                Ok(work())
            })
            .join()
            .map_err(|_| NetnsError::Panicked { path: path.clone() })?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn var_run_paths_have_their_run_alias() {
        assert_eq!(
            run_alias(Path::new("/var/run/netns/cni-1")).as_deref(),
            Some(Path::new("/run/netns/cni-1"))
        );
        for other in [
            "/run/netns/cni-1",
            "/var/run",
            "/var/running/x",
            "/proc/1/ns/net",
        ] {
            assert_eq!(run_alias(Path::new(other)), None, "{other}");
        }
    }

    #[test]
    fn only_network_namespaces_open() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        for (path, what) in [
            (file.as_path(), "a regular file"),
            (dir.path(), "a directory"),
            (Path::new("/dev/null"), "a device"),
        ] {
            let error = open_netns(path).unwrap_err();
            assert!(
                matches!(&error, NetnsError::NotNetns { what: w, .. } if w.starts_with(what)),
                "{}: {error}",
                path.display()
            );
            assert!(!is_netns(path));
        }
        assert!(matches!(
            open_netns(&dir.path().join("missing")),
            Err(NetnsError::Open { .. })
        ));
        // Another kind of namespace.
        let error = open_netns(Path::new("/proc/self/ns/uts")).unwrap_err();
        assert!(error.to_string().contains("another kind"), "{error}");
        assert!(is_netns(Path::new("/proc/self/ns/net")));
    }
}
