//! Running code inside another network namespace.
//!
//! `setns(2)` changes the namespace of the calling thread only, so work is
//! done on a namespace thread and the caller's thread (and the async
//! runtime's workers) never change namespace. Namespace threads are kept:
//! after the work a thread goes back into the process's namespace and
//! waits for the next, so an entry costs two `setns` calls (a few µs),
//! not a thread's start (tens of µs, milliseconds on a busy node).

use std::{
    fs::File,
    io,
    os::fd::AsRawFd,
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock, mpsc},
    thread,
};

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
    let opened = File::open(as_seen_here(netns_path));
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

/// A runtime's namespace path as this process sees it: `/run/<rest>` for
/// `/var/run/<rest>` when only that exists. Runtimes (containerd, CRI-O)
/// name pod namespaces `/var/run/netns/...`, which on the host is
/// `/run/netns/...` (`/var/run` is a link to `/run`), while the agent's
/// image has no `/var/run` and mounts the host's `/run/netns` only. Every
/// look at a namespace path goes through here.
pub fn as_seen_here(path: &Path) -> std::borrow::Cow<'_, Path> {
    match run_alias(path) {
        Some(alias) if !path.exists() && alias.exists() => alias.into(),
        _ => path.into(),
    }
}

/// `/run/<rest>` for a path under `/var/run/`.
fn run_alias(path: &Path) -> Option<PathBuf> {
    let rest = path.strip_prefix("/var/run").ok()?;
    (!rest.as_os_str().is_empty()).then(|| Path::new("/run").join(rest))
}

/// Whether something is at the namespace path `path` (see [`as_seen_here`]).
pub fn netns_path_exists(path: &Path) -> bool {
    as_seen_here(path).exists()
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

/// Runs `work` on a namespace thread that has joined the network namespace
/// at `netns_path`, and returns its result.
pub fn run_in_netns<T, F>(netns_path: &Path, work: F) -> Result<T, NetnsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    let file = open_netns(netns_path)?;
    run_in_open_netns(&file, &netns_path.display().to_string(), work)
}

/// Runs `work` in the network namespace at `netns_path`, or on the calling
/// thread, in its namespace, when `None` (the node's namespace when the
/// agent runs in it).
pub fn run_in_netns_or_here<T, F>(netns_path: Option<PathBuf>, work: F) -> Result<T, NetnsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    match netns_path {
        Some(path) => run_in_netns(&path, work),
        None => Ok(work()),
    }
}

/// A network namespace held open: the namespace, and the interfaces in it,
/// live on after its path is unmounted, until the last holder lets go.
/// DEL holds the pod's before it answers, because the runtime deletes the
/// path as soon as it has the answer, while the agent deletes the interface
/// after: the interface goes when the agent deletes it, not whenever the
/// kernel gets to the dead namespace, and its MAC is free for the pod's
/// next interface right then.
#[derive(Clone, Debug)]
pub struct HeldNetns {
    file: Arc<File>,
    /// The path it was opened at, for messages.
    path: String,
}

impl HeldNetns {
    /// The namespace at `path` held open; `None` when the path is gone or
    /// names no network namespace.
    pub fn open(path: &Path) -> Option<Self> {
        let file = open_netns(path).ok()?;
        Some(Self {
            file: Arc::new(file),
            path: path.display().to_string(),
        })
    }

    /// Like [`run_in_netns`], in the held namespace.
    pub fn run<T, F>(&self, work: F) -> Result<T, NetnsError>
    where
        T: Send,
        F: FnOnce() -> T + Send,
    {
        run_in_open_netns(&self.file, &self.path, work)
    }

    /// The path it was opened at.
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// The same namespace held (for comparisons of what holds it).
impl PartialEq for HeldNetns {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.file, &other.file)
    }
}

impl Eq for HeldNetns {}

/// Runs `work` on a namespace thread that has joined the network namespace
/// `file` (opened at `path`), and returns its result.
fn run_in_open_netns<T, F>(file: &File, path: &str, work: F) -> Result<T, NetnsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    let path = path.to_owned();
    let mut outcome = None;
    let finished = {
        let outcome = &mut outcome;
        let path = &path;
        run_on_namespace_thread(Box::new(move || {
            *outcome = Some(
                setns(file, CloneFlags::CLONE_NEWNET)
                    .map(|()| work())
                    .map_err(|source| NetnsError::Enter {
                        path: path.clone(),
                        source,
                    }),
            );
        }))
    };
    match outcome {
        Some(result) if finished => result,
        _ => Err(NetnsError::Panicked { path }),
    }
}

/// Work for a namespace thread; its borrows outlive the run (see
/// [`run_on_namespace_thread`]).
type Job<'a> = Box<dyn FnOnce() + Send + 'a>;

/// A job as a namespace thread takes it: the work and where to say that it
/// is over (true: it returned, false: it panicked).
struct Dispatched {
    work: Job<'static>,
    over: mpsc::SyncSender<bool>,
}

/// Idle namespace threads, each back in the process's namespace.
static IDLE: Mutex<Vec<mpsc::Sender<Dispatched>>> = Mutex::new(Vec::new());

/// Idle namespace threads kept; more are started when more work runs at
/// once, and end when they find the pool full.
const MAX_IDLE: usize = 8;

/// Runs `work` on an idle namespace thread (a new one when none is idle)
/// and waits until it is over; returns whether it returned (false: it
/// panicked).
fn run_on_namespace_thread(work: Job<'_>) -> bool {
    // SAFETY: only the lifetime is changed. The thread consumes the box
    // (runs the work, or drops it on a panic) before it sends `over`, and
    // this function returns only after receiving it, so nothing the work
    // borrows is used after it is gone. `over` is sent on every path: the
    // work runs under `catch_unwind`, and a thread that cannot take the
    // job hands it back through the failed send (below), dropping nothing.
    let work: Job<'static> = unsafe { std::mem::transmute::<Job<'_>, Job<'static>>(work) };
    let (over, is_over) = mpsc::sync_channel(1);
    let mut job = Dispatched { work, over };
    loop {
        let idle = IDLE.lock().expect("namespace thread pool poisoned").pop();
        match idle {
            // A thread that ended leaves its sender behind: the job comes back.
            Some(thread) => match thread.send(job) {
                Ok(()) => break,
                Err(mpsc::SendError(back)) => job = back,
            },
            None => {
                let (tx, rx) = mpsc::channel();
                tx.send(job).expect("the receiver is here");
                match thread::Builder::new()
                    .name("flatnet-netns".into())
                    .spawn(move || namespace_thread(&tx, &rx))
                {
                    Ok(_) => break,
                    Err(error) => panic!("cannot start a namespace thread: {error}"),
                }
            }
        }
    }
    is_over.recv().unwrap_or(false)
}

/// The process's own network namespace, where namespace threads return.
fn home_namespace() -> Option<&'static File> {
    static HOME: OnceLock<Option<File>> = OnceLock::new();
    HOME.get_or_init(|| File::open("/proc/self/ns/net").ok())
        .as_ref()
}

/// A namespace thread: runs jobs, going back into the process's namespace
/// after each; ends when that fails (it must not run the next job in a
/// pod's namespace) or the pool is full.
fn namespace_thread(me: &mpsc::Sender<Dispatched>, jobs: &mpsc::Receiver<Dispatched>) {
    while let Ok(Dispatched { work, over }) = jobs.recv() {
        let returned = catch_unwind(AssertUnwindSafe(work)).is_ok();
        let home =
            home_namespace().is_some_and(|home| setns(home, CloneFlags::CLONE_NEWNET).is_ok());
        let _ = over.send(returned);
        if !home {
            return;
        }
        let mut idle = IDLE.lock().expect("namespace thread pool poisoned");
        if idle.len() >= MAX_IDLE {
            return;
        }
        idle.push(me.clone());
    }
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

    /// The namespace a thread is in, by inode.
    fn current_namespace() -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino()
    }

    #[test]
    fn namespace_threads_return_home_and_report_panics() {
        let home = current_namespace();
        let here = Path::new("/proc/self/ns/net");
        // Borrowed data is written by the work.
        let mut seen = Vec::new();
        for _ in 0..3 {
            run_in_netns(here, || seen.push(current_namespace())).unwrap();
        }
        assert_eq!(seen, [home; 3]);
        let error = run_in_netns(here, || panic!("work fails")).unwrap_err();
        assert!(matches!(error, NetnsError::Panicked { .. }), "{error}");
        // Concurrent entries each get a thread.
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let inside = run_in_netns(here, current_namespace).unwrap();
                    assert_eq!(inside, home);
                });
            }
        });
        assert!(IDLE.lock().unwrap().len() <= MAX_IDLE);
    }

    #[test]
    fn a_namespace_thread_enters_the_namespace_and_comes_back() {
        if !nix::unistd::geteuid().is_root() {
            assert!(
                std::env::var_os("FLATNET_REQUIRE_PRIVILEGED").is_none(),
                "needs root (unshare)"
            );
            eprintln!("skipped: needs root (unshare)");
            return;
        }
        let home = current_namespace();
        // A thread in a namespace of its own, alive while the test runs.
        let (tid_tx, tid_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let owner = thread::spawn(move || {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).unwrap();
            tid_tx
                .send((nix::unistd::gettid(), current_namespace()))
                .unwrap();
            let _ = done_rx.recv();
        });
        let (tid, other) = tid_rx.recv().unwrap();
        assert_ne!(other, home);
        let path = PathBuf::from(format!("/proc/self/task/{tid}/ns/net"));
        for _ in 0..3 {
            assert_eq!(run_in_netns(&path, current_namespace).unwrap(), other);
            let back = run_in_netns(Path::new("/proc/self/ns/net"), current_namespace).unwrap();
            assert_eq!(back, home, "the thread went back before its next job");
        }
        drop(done_tx);
        owner.join().unwrap();
    }
}
