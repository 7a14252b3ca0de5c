//! `cargo xtask bench failover`: time from killing a floating address's
//! owner (its loop stopped without cleanup, its uplink taken down) to the
//! first TCP connection a LAN client makes through the surviving node,
//! written into the "Floating-address failover" section of
//! docs/benchmarks.md.

use std::process::Stdio;

use anyhow::{Context, bail};

use super::{machine, percentile, report};
use crate::{ebpf, workspace};

/// Failovers per address family.
const RUNS: usize = 20;

/// `p50/p99/max` of `values` in milliseconds.
fn summary(values: &mut [u64]) -> (u64, u64, u64) {
    values.sort_unstable();
    (
        percentile(values, 0.5),
        percentile(values, 0.99),
        values.last().copied().unwrap_or_default(),
    )
}

/// Runs the failover test `RUNS` times per family (root) and updates
/// docs/benchmarks.md.
pub fn run() -> anyhow::Result<()> {
    ebpf::build()?;
    let machine = machine();
    let mut cargo = workspace::cargo(None);
    cargo
        .env("FLATNET_FAILOVER_RUNS", RUNS.to_string())
        .args([
            "test",
            "-q",
            "-p",
            "flatnet-agent",
            "--test",
            "floating_failover",
            "--",
            "--nocapture",
        ])
        .stderr(Stdio::inherit());
    println!("==> bench failover: {cargo:?}");
    let output = cargo.output().context("cannot start cargo test")?;
    if !output.status.success() {
        bail!(
            "the failover test failed ({}); it needs root",
            output.status
        );
    }
    let text = String::from_utf8(output.stdout).context("test output is not UTF-8")?;
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    for line in text.lines().filter_map(|l| l.strip_prefix("failover_ms=")) {
        let mut words = line.split_whitespace();
        let ms: u64 = words
            .next()
            .unwrap_or_default()
            .parse()
            .context("failover_ms")?;
        match words.next() {
            Some("family=ipv6") => v6.push(ms),
            _ => v4.push(ms),
        }
    }
    if v4.len() != RUNS || v6.len() != RUNS {
        bail!(
            "expected {RUNS} failovers per family, got {} IPv4 and {} IPv6",
            v4.len(),
            v6.len()
        );
    }
    let mut all: Vec<u64> = v4.iter().chain(&v6).copied().collect();
    let rows: Vec<String> = [("IPv4", &mut v4), ("IPv6", &mut v6)]
        .into_iter()
        .map(|(family, values)| {
            let (p50, p99, max) = summary(values);
            format!("| {family} | {RUNS} | {p50} | {p99} | {max} |")
        })
        .collect();
    let (p50, p99, max) = summary(&mut all);
    let section = format!(
        "## Floating-address failover (kill to first TCP connect)\n\n\
         Command: `cargo xtask bench failover` (root), which runs\n\
         `FLATNET_FAILOVER_RUNS={RUNS} cargo test -p flatnet-agent --test floating_failover`.\n\
         Machine: {machine}.\n\n\
         Two nodes and a LAN client in network namespaces on one bridge; each\n\
         node has the uplink program attached and runs the floating-address\n\
         loop (`floating::owner`, 100 ms heartbeats, 200 ms responder lease,\n\
         peers dead after 300 ms). The owner's loop is stopped with no cleanup\n\
         (what SIGKILL leaves: the program stays attached with its pinned\n\
         maps) and its uplink is taken down; the clock runs from there to the\n\
         first TCP connection the client completes through the survivor\n\
         (connect attempts every 20 ms with a 200 ms timeout). Every run also\n\
         checks that the survivor started answering only after the dead owner's\n\
         lease had run out. No keepalived baseline yet.\n\n\
         | family | runs | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|\n{}\n\n\
         failover: p50={p50} p99={p99} max={max}\n",
        rows.join("\n")
    );
    print!("{section}");
    report::write_section("failover", &section)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_sorts_then_takes_nearest_ranks() {
        let mut values: Vec<u64> = (1..=20).rev().collect();
        assert_eq!(summary(&mut values), (10, 20, 20));
    }
}
