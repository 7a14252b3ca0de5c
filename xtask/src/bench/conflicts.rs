//! `cargo xtask bench conflicts`: latency from a foreign claim on the wire
//! to the Kubernetes Event and the FlatNetworkIP condition, written into
//! the "IP conflict reports" section of docs/benchmarks.md.

use std::process::Stdio;

use anyhow::{Context, bail};

use super::{machine, report};
use crate::{ebpf, workspace};

/// Managed addresses, one conflict each.
const ADDRESSES: usize = 200;
/// Pause between two frames of the paced run.
const INTERVAL_MS: u64 = 10;

/// Builds the eBPF object, runs the benchmark example (root) and updates
/// docs/benchmarks.md.
pub fn run() -> anyhow::Result<()> {
    ebpf::build()?;
    let machine = machine();
    let mut cargo = workspace::cargo(None);
    cargo
        .args([
            "run",
            "-q",
            "-p",
            "flatnet-agent",
            "--example",
            "bench_conflicts",
            "--",
            "--addresses",
            &ADDRESSES.to_string(),
            "--interval-ms",
            &INTERVAL_MS.to_string(),
        ])
        .stderr(Stdio::inherit());
    println!("==> bench conflicts: {cargo:?}");
    let output = cargo.output().context("cannot start cargo run")?;
    if !output.status.success() {
        bail!("bench_conflicts failed ({}); it needs root", output.status);
    }
    let table = String::from_utf8(output.stdout).context("benchmark output is not UTF-8")?;
    print!("{table}");
    let section = format!(
        "## IP conflict reports (frame to Kubernetes Event)\n\n\
         Command: `cargo xtask bench conflicts` (root), the agent built in the dev\n\
         profile as `cargo run --example` builds it. Machine: {machine}.\n\n\
         The uplink program runs on one end of a veth pair in a fresh node\n\
         namespace with {ADDRESSES} managed addresses, each the address of a\n\
         recorded pod. A rogue namespace on the other end sends one gratuitous\n\
         ARP reply per address from a foreign MAC over a raw `AF_PACKET` socket;\n\
         the clock starts just before each send. The agent's own conflict path\n\
         follows (ring buffer woken through epoll, `ConflictMonitor`, the\n\
         service's metric, log line and per-address rate limit, then\n\
         `report_conflict`) against an in-process API server that notes when each\n\
         Event POST and each FlatNetworkIP status patch (the `IPConflict`\n\
         condition) arrives. The paced run sends one frame every {INTERVAL_MS} ms;\n\
         the burst run sends all frames back to back, so later conflicts also\n\
         wait for the reports before them.\n\n\
         Nothing in the path polls or batches: the ring buffer wakes the agent\n\
         through epoll, each report goes out in its own task, and the owner of an\n\
         address is found with one record read. What the burst row adds on top\n\
         of the paced one is CPU time (three API requests per conflict, encoded\n\
         and decoded by both ends in a dev build) on a shared machine.\n\n{table}"
    );
    report::write_section("conflicts", &section)
}
