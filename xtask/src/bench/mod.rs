//! `cargo xtask bench <cni|throughput|policy|conflicts|hotplug|failover|allocation|pod-start>`:
//! on-demand benchmarks (root, except `allocation`). Each writes its
//! results into its own section of docs/benchmarks.md.

mod allocation;
mod cni;
mod conflicts;
mod failover;
mod hotplug;
mod pod_start;
mod policy;
mod program_cost;
mod report;
mod throughput;

use std::{
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};
use clap::Subcommand;

use crate::{images, workspace};

/// The benchmarks.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// CNI ADD/DEL latency and parallel throughput: flatnet (agent + flatnet-cni)
    /// against Debian's reference macvlan plugin with static IPAM.
    Cni(cni::CniArgs),
    /// TCP throughput (iperf3) between macvlan pods with and without the eBPF programs.
    Throughput(throughput::ThroughputArgs),
    /// Per-packet cost of the policy programs (BPF_PROG_TEST_RUN).
    Policy,
    /// Latency from a foreign claim on a managed address to the Kubernetes
    /// Event and the FlatNetworkIP condition.
    Conflicts,
    /// Time from a standalone state-file change to a hot-plugged interface
    /// in a running pod answering the LAN (50 runs, p50/p99).
    Hotplug,
    /// Floating-address failover: from killing the owner to the first TCP
    /// connection through the other node, IPv4 and IPv6.
    Failover,
    /// Pod start on the real node of `cargo xtask cluster`, with and
    /// without a flat attachment (the release installed with its defaults).
    PodStart(pod_start::PodStartArgs),
    /// The allocation controllers at scale against the fake API server:
    /// pods created at once, half replaced; seconds, requests per pod,
    /// peak RSS (no root needed).
    Allocation(allocation::AllocationArgs),
}

/// Runs one benchmark.
pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    let needs_root = !matches!(command, BenchCommand::Allocation(_));
    // SAFETY: geteuid has no preconditions.
    if needs_root && unsafe { libc::geteuid() } != 0 {
        bail!("the benchmarks create network namespaces and load eBPF programs: run them as root");
    }
    match command {
        BenchCommand::Cni(args) => cni::run(&args),
        BenchCommand::Throughput(args) => throughput::run(&args),
        BenchCommand::Policy => policy::run(),
        BenchCommand::Conflicts => conflicts::run(),
        BenchCommand::Hotplug => hotplug::run(),
        BenchCommand::Failover => failover::run(),
        BenchCommand::Allocation(args) => allocation::run(&args),
        BenchCommand::PodStart(args) => pod_start::run(&args),
    }
}

/// The CNI latency guard CI runs: `cargo xtask bench cni --quick`.
pub fn cni_quick() -> anyhow::Result<()> {
    run(BenchCommand::Cni(cni::CniArgs::quick()))
}

/// The `flatnet-agent` and `flatnet-cni` a node runs: the images' release
/// builds, static for musl (`cargo xtask images` builds and reuses the
/// same). A glibc build would measure another program: a dynamically linked
/// `flatnet-cni` spends most of its start in the loader and libc's start-up
/// (the figures are in docs/cni.md), and every ADD and DEL starts it once.
struct ReleaseBinaries {
    agent: PathBuf,
    cni: PathBuf,
}

fn build_release_binaries() -> anyhow::Result<ReleaseBinaries> {
    let root = workspace::root();
    images::build_binaries()?;
    let dir = images::binary_dir(&root);
    Ok(ReleaseBinaries {
        agent: dir.join("flatnet-agent"),
        cni: dir.join("flatnet-cni"),
    })
}

/// Installs Debian packages the benchmark compares with or drives (only
/// here, so no test can come to depend on them unnoticed).
fn apt_install(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|package| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", package])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut update = Command::new("apt-get");
    update.args(["update", "-qq"]);
    workspace::run("apt-get update", &mut update)?;
    let mut install = Command::new("apt-get");
    install
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing);
    workspace::run(&format!("install {}", missing.join(" ")), &mut install)
}

/// The installed version of a Debian package.
fn package_version(package: &str) -> String {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", package])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Runs a program to completion; returns stdout, failing with its output.
fn sh(program: impl AsRef<Path>, args: &[&str]) -> anyhow::Result<String> {
    let program = program.as_ref();
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {}", program.display()))?;
    if !out.status.success() {
        bail!(
            "{} {} failed ({}): {}{}",
            program.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A named network namespace (`ip netns add`), deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new(name: String) -> anyhow::Result<Self> {
        // Leftover of an earlier run that was killed hard.
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh("ip", &["netns", "add", &name])?;
        let netns = Self { name };
        netns.ip(&["link", "set", "lo", "up"])?;
        Ok(netns)
    }

    fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// `ip -n <netns> <args>`.
    fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        sh("ip", &full)
    }

    /// A command that runs inside the namespace (`ip netns exec`).
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }
}

/// A command whose child process enters the namespace file `netns` with
/// `setns` right before exec: no extra process, so timings hold only the
/// program's own work.
fn command_in_netns(program: &Path, netns: &Path) -> anyhow::Result<Command> {
    use std::os::unix::process::CommandExt;
    let file = std::fs::File::open(netns).with_context(|| format!("open {}", netns.display()))?;
    let mut cmd = Command::new(program);
    // SAFETY: setns is async-signal-safe; the closure only calls it and
    // reads errno, and owns the namespace file descriptor it uses.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// A private directory under the flatnet BPF pin root, removed on drop.
struct PinRoot(PathBuf);

impl PinRoot {
    fn new(name: &str) -> Self {
        Self(
            Path::new(flatnet_common::pin::PIN_ROOT).join(format!("{name}-{}", std::process::id())),
        )
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The machine, for the record next to the numbers.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?");
    let date = sh("date", &["-u", "+%Y-%m-%d"]).unwrap_or_default();
    format!(
        "{model}, {cpus} CPUs, Linux {}, load average {load} at the start, {}, commit {}",
        kernel.trim(),
        date.trim(),
        commit()
    )
}

/// The commit measured: `HEAD`, marked when the tree has changes outside
/// docs/ (the figures then belong to no commit exactly).
fn commit() -> String {
    let root = workspace::root();
    let git = |args: &[&str]| {
        Command::new("git")
            .current_dir(&root)
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let head = git(&["rev-parse", "--short=12", "HEAD"]);
    let changed = git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":!docs",
    ]);
    if changed.is_empty() {
        format!("`{head}`")
    } else {
        format!("`{head}` with uncommitted changes")
    }
}

/// The `p`-th percentile (0..=1) by nearest rank of sorted samples.
#[expect(
    clippy::cast_sign_loss,
    reason = "`p` and the length are not negative, so neither is the rank"
)]
fn percentile<T: Copy>(sorted: &[T], p: f64) -> T {
    assert!(!sorted.is_empty(), "percentile of no samples");
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median of samples (upper median for an even count).
fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_takes_the_nearest_rank() {
        let samples: Vec<u32> = (1..=100).collect();
        assert_eq!(percentile(&samples, 0.5), 50);
        assert_eq!(percentile(&samples, 0.99), 99);
        assert_eq!(percentile(&samples, 1.0), 100);
        assert_eq!(percentile(&[7], 0.99), 7);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 3.0);
    }
}
