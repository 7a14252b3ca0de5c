//! `cargo xtask bench cni --kubernetes`: the Kubernetes-mode ADD (the
//! FlatNetworkIP already allocated) against the standalone ADD in the same
//! run, through the agent's CNI service with the operator's in-memory API
//! server (`flatnet-agent/examples/bench_cni_kubernetes.rs`, release
//! build). Writes the "cni-kubernetes" section of docs/benchmarks.md.

use std::process::Stdio;

use anyhow::{Context, bail};

use super::super::{machine, report};
use crate::{ebpf, workspace};

/// ADD+DEL pairs per mode and latency.
const ITERATIONS: usize = 100;
/// API latencies per request, in milliseconds: none (the agent's own
/// cost) and a cluster-local API server's.
const LATENCIES_MS: &str = "0,1";

/// Builds the eBPF object, runs the example (root) and writes the section.
pub fn run(write: bool) -> anyhow::Result<()> {
    ebpf::build()?;
    let machine = machine();
    let mut cargo = workspace::cargo(None);
    cargo
        .args([
            "run",
            "-q",
            "--release",
            "-p",
            "flatnet-agent",
            "--example",
            "bench_cni_kubernetes",
            "--",
            "--iterations",
            &ITERATIONS.to_string(),
            "--latency-ms",
            LATENCIES_MS,
        ])
        .stderr(Stdio::inherit());
    println!("==> bench cni --kubernetes: {cargo:?}");
    let output = cargo.output().context("cannot start cargo run")?;
    if !output.status.success() {
        bail!(
            "bench_cni_kubernetes failed ({}); it needs root",
            output.status
        );
    }
    let table = String::from_utf8(output.stdout).context("benchmark output is not UTF-8")?;
    print!("{table}");
    if !write {
        return Ok(());
    }
    let section = format!(
        "## CNI ADD in Kubernetes mode (FlatNetworkIP already allocated)\n\n\
         Command: `cargo xtask bench cni --kubernetes` (root). {machine}.\n\n\
         The agent's CNI service (release build, `examples/bench_cni_kubernetes.rs`)\n\
         runs twice in one process on one node namespace, each on its own\n\
         master: with the Kubernetes desired state against the operator's\n\
         in-memory API server (`FakeApiServer`, every request delayed by the\n\
         latency in the table, on a blocking thread: to within tens of\n\
         microseconds, where a tokio timer rounds up to the next whole\n\
         millisecond), and with the standalone desired state. Their\n\
         ADD+DEL pairs alternate, {ITERATIONS} measured per mode and latency, a\n\
         fresh pod namespace each; before each Kubernetes ADD the pod's\n\
         FlatNetworkIP exists, allocated, as the operator leaves it. Times run\n\
         from the request reaching the handler to its answer: what the runtime\n\
         sees on top (starting `flatnet-cni`, the socket) is the same for both\n\
         modes and in the table of `cargo xtask bench cni` above. 1 ms per\n\
         request is a cluster-local API server answering small GETs and\n\
         PATCHes. The node label and the Active status are written right\n\
         after the answer (the DEL waits for them, untimed): the requests\n\
         column counts them per ADD.\n\n{table}"
    );
    report::write_section("cni-kubernetes", &section)
}
