//! Running code inside another network namespace.
//!
//! `setns(2)` changes the namespace of the calling thread only, so work is
//! done on a dedicated short-lived thread and the caller's thread (and the
//! async runtime's workers) never change namespace.

use std::{fs::File, io, path::Path, thread};

use nix::sched::{CloneFlags, setns};

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

/// Runs `work` on a fresh thread that has joined the network namespace at
/// `netns_path`, and returns its result.
pub fn run_in_netns<T, F>(netns_path: &Path, work: F) -> Result<T, NetnsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    let path = netns_path.display().to_string();
    let file = File::open(netns_path).map_err(|source| NetnsError::Open {
        path: path.clone(),
        source,
    })?;
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
