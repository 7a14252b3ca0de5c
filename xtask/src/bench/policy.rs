//! `cargo xtask bench policy`: per-packet cost of the policy programs,
//! written into the "Network policy" section of docs/benchmarks.md.

use std::{fs, process::Stdio};

use anyhow::{Context, bail};

use super::report;
use crate::{ebpf, workspace};

/// Builds the eBPF object, runs the benchmark example (root) and updates
/// docs/benchmarks.md.
pub fn run() -> anyhow::Result<()> {
    ebpf::build()?;
    let mut cargo = workspace::cargo(None);
    cargo
        .args([
            "run",
            "-q",
            "-p",
            "flatnet-agent",
            "--example",
            "bench_policy",
        ])
        .stderr(Stdio::inherit());
    println!("==> bench policy: {cargo:?}");
    let output = cargo.output().context("cannot start cargo run")?;
    if !output.status.success() {
        bail!("bench_policy failed ({}); it needs root", output.status);
    }
    let table = String::from_utf8(output.stdout).context("benchmark output is not UTF-8")?;
    print!("{table}");

    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let jit = match fs::read_to_string("/proc/sys/net/core/bpf_jit_enable") {
        Ok(v) if v.trim() == "0" => "JIT off",
        Ok(_) => "JIT on",
        Err(_) => "JIT always on",
    };
    let section = format!(
        "## Network policy (pod-interface programs)\n\n\
         Command: `cargo xtask bench policy` (root). Per-packet cost of one program run\n\
         as measured by the kernel (`BPF_PROG_TEST_RUN` with `repeat`, median of 5 ×\n\
         1,000,000 runs), on an IPv4 TCP frame unless said otherwise, {jit}. Linux {},\n\
         {cpus} CPUs, commit {}. Rules are ingress rules allowing TCP 80 from one /32 each; the\n\
         lookup is one LPM-trie search whatever the number of rules. The programs track\n\
         allowed flows, so a repeated frame measures a tracked flow's later packets\n\
         (subject lookup, one connection-tracking lookup). Rows marked † measure the\n\
         first packet of a flow (full judgement, tracking entries written): 2,001\n\
         frames with distinct source ports, one run each, median; a single timed run\n\
         includes the kernel timer's own cost, which the calibration row (a tracked\n\
         flow measured the same way) shows. Each case runs on\n\
         the programs loaded with kernel logs (aya-log) off, as the agent loads them\n\
         unless `FLATNET_LOG` enables `flatnet_ebpf=debug`, and on. With logs on and\n\
         nobody reading, the log ring buffer (128 KiB) fills after the first few\n\
         thousand records, so the logged rows then measure building a record whose\n\
         reservation fails; policy drops log only within the drop-event budget.\n\n{table}",
        kernel.trim(),
        super::commit()
    );
    report::write_section("policy", &section)
}
