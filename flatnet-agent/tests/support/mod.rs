//! Helpers for privileged tests: fresh network namespaces, veth pairs and
//! private pin directories, all removed again on drop.
// Every test binary compiles this module; each uses only some of it.
#![allow(dead_code)]

pub mod agent;
pub mod cni;
pub mod cri;
pub mod floating;
pub mod frames;
pub mod kubernetes_node;
pub mod lan;
pub mod policy;
pub mod tc_hooks;

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

/// Environment variable that turns "not root" from a skip into a failure
/// (set by CI, where these tests must run).
pub const REQUIRE_PRIVILEGED: &str = "FLATNET_REQUIRE_PRIVILEGED";

/// Whether a privileged test can run. Prints why it skips; panics instead of
/// skipping when [`REQUIRE_PRIVILEGED`] is set.
pub fn privileged(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    let reason = "needs root (network namespaces, netlink, BPF)";
    assert!(
        std::env::var_os(REQUIRE_PRIVILEGED).is_none(),
        "{test}: {reason}, and {REQUIRE_PRIVILEGED} is set"
    );
    report_skip(&format!("{test}: {reason}"));
    false
}

/// Prints `skipped: <why>` where it stays visible: libtest captures
/// `eprintln!` of passing tests, but not direct writes to the stderr handle.
pub fn report_skip(why: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
}

/// A name unique to this process and call, short enough for an interface (<= 15 bytes).
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = format!("{prefix}{}{n}", std::process::id() % 100_000);
    assert!(name.len() <= 15, "name {name} too long");
    name
}

/// Runs a command, panicking with its output when it fails; returns stdout.
pub fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A named network namespace (`ip netns add`), deleted on drop.
pub struct TestNetns {
    pub name: String,
}

impl TestNetns {
    pub fn new(prefix: &str) -> Self {
        let name = unique_name(prefix);
        run("ip", &["netns", "add", &name]);
        run("ip", &["-n", &name, "link", "set", "lo", "up"]);
        Self { name }
    }

    /// The namespace file, for `setns`.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// Runs `ip -n <ns> <args>`.
    pub fn ip(&self, args: &[&str]) -> String {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// Runs a program inside the namespace (`ip netns exec`).
    pub fn exec(&self, program: &str, args: &[&str]) -> String {
        let mut full = vec!["netns", "exec", self.name.as_str(), program];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// Runs a program inside the namespace whose failure is part of what
    /// the test looks at; returns whether it succeeded.
    pub fn try_exec(&self, program: &str, args: &[&str]) -> bool {
        Command::new("ip")
            .args(["netns", "exec", &self.name, program])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
            .status
            .success()
    }

    /// Adds `address` (with prefix length) to `ifname`; an IPv6 one skips
    /// duplicate address detection.
    pub fn add_address(&self, ifname: &str, address: &str) {
        let mut args = vec!["addr", "add", address, "dev", ifname];
        if address.contains(':') {
            args.push("nodad");
        }
        self.ip(&args);
    }

    /// Sets a sysctl inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) {
        self.exec("sysctl", &["-qw", &format!("{key}={value}")]);
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Creates a veth pair with one end in each namespace, both down.
pub fn veth_pair(a: &TestNetns, a_name: &str, b: &TestNetns, b_name: &str) {
    run(
        "ip",
        &[
            "link", "add", a_name, "netns", &a.name, "type", "veth", "peer", "name", b_name,
            "netns", &b.name,
        ],
    );
}

/// Whether the namespace has a link of that name.
pub fn has_link(ns: &TestNetns, name: &str) -> bool {
    Command::new("ip")
        .args(["-n", &ns.name, "link", "show", "dev", name])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Waits until `done` holds (a bound on waiting for the agent, not a
/// timing check); `what` says what never happened.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Pings `target` once from `ns` (`ping -6` for IPv6).
pub fn ping(ns: &TestNetns, target: &str) {
    let family = if target.contains(':') { "-6" } else { "-4" };
    run(
        "ip",
        &[
            "netns", "exec", &ns.name, "ping", family, "-c", "1", "-W", "5", target,
        ],
    );
}

/// A private directory under the flatnet pin root, removed on drop.
pub struct TestPinRoot {
    pub path: PathBuf,
}

impl TestPinRoot {
    pub fn new() -> Self {
        // Not an interface name, so the whole process id and a separator:
        // `unique_name`'s `<pid % 100000><n>` can be another test
        // process's name too, whose drop would remove this directory.
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("test-{}-{n}", std::process::id());
        let path = Path::new(flatnet_common::pin::PIN_ROOT).join(name);
        Self { path }
    }
}

impl Drop for TestPinRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Environment variable that turns "the kernel lacks a feature" from a skip
/// into a failure (set by the VM stage, whose kernel has every feature).
pub const REQUIRE_KERNEL_FEATURES: &str = "FLATNET_REQUIRE_KERNEL_FEATURES";

/// Reports that `test` cannot run because the kernel lacks `feature`:
/// prints the skip, or panics when [`REQUIRE_KERNEL_FEATURES`] is set.
pub fn skip_for_missing_kernel_feature(test: &str, feature: &str) {
    assert!(
        std::env::var_os(REQUIRE_KERNEL_FEATURES).is_none(),
        "{test}: kernel lacks {feature}, and {REQUIRE_KERNEL_FEATURES} is set"
    );
    report_skip(&format!(
        "{test}: kernel lacks {feature} (the VM stage, on Linux 6.1, runs what needs it)"
    ));
}

/// Runs `work` on this thread with a subscriber that wants the kernel's
/// debug records (`flatnet_ebpf=debug`) and returns everything it logged,
/// one formatted event per line. Programs loaded inside `work` log.
pub fn with_kernel_log_capture(work: impl FnOnce()) -> String {
    with_log_capture("flatnet_ebpf=debug", work)
}

/// Runs `work` on this thread with a subscriber whose filter is `filter`
/// (`EnvFilter` syntax) and returns everything it logged, one formatted
/// event per line.
pub fn with_log_capture(filter: &str, work: impl FnOnce()) -> String {
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    // aya-log emits `log` records; the bridge turns them into `tracing`
    // events of the current (here: thread-local) subscriber. Another test
    // of the binary may have installed it already.
    let _ = tracing_log::LogTracer::init();
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, work);
    let bytes = capture.0.lock().unwrap().clone();
    String::from_utf8(bytes).expect("log output is UTF-8")
}
