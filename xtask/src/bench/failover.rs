//! `cargo xtask bench failover`: time from killing a floating address's
//! owner (its loop stopped without cleanup, its uplink taken down) to the
//! first TCP connection a LAN client makes through the surviving node,
//! written into the "Floating-address failover" section of
//! docs/benchmarks.md, with the same measured for keepalived (VRRP) as the
//! baseline when it is installed.

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

/// Failover times in milliseconds, per family, from the lines starting
/// with `prefix` (`<prefix><ms> family=ipv4|ipv6 ...`).
fn parse(text: &str, prefix: &str) -> anyhow::Result<(Vec<u64>, Vec<u64>)> {
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    // `cargo test -q` prints a dot before a test's first output line.
    for line in text
        .lines()
        .filter_map(|l| l.trim_start_matches('.').strip_prefix(prefix))
    {
        let mut words = line.split_whitespace();
        let ms: u64 = words
            .next()
            .unwrap_or_default()
            .parse()
            .with_context(|| format!("{prefix} in {line:?}"))?;
        match words.next() {
            Some("family=ipv6") => v6.push(ms),
            _ => v4.push(ms),
        }
    }
    Ok((v4, v6))
}

/// The table rows of one mechanism.
fn rows(mechanism: &str, v4: &mut [u64], v6: &mut [u64]) -> Vec<String> {
    [("IPv4", v4), ("IPv6", v6)]
        .into_iter()
        .map(|(family, values)| {
            let (p50, p99, max) = summary(values);
            format!(
                "| {mechanism} | {family} | {} | {p50} | {p99} | {max} |",
                values.len()
            )
        })
        .collect()
}

/// Runs the failover test `RUNS` times per family (root), and keepalived's
/// when it is installed, and updates docs/benchmarks.md.
pub fn run() -> anyhow::Result<()> {
    ebpf::build()?;
    let machine = machine();
    let keepalived = std::process::Command::new("keepalived")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !keepalived {
        println!("==> keepalived is not installed (apt-get install keepalived): no baseline");
    }
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
            "--test-threads=1",
            // The untagged LAN only: the VLAN case is a correctness test
            // (the VM stage), and would double the runs per family.
            "--skip",
            "on_a_vlan",
            // A dead node only: the agent dying alone is a correctness
            // test (its own budget guard), not the compared mechanism.
            "--skip",
            "on_a_live_link",
        ])
        .args(keepalived.then_some("--include-ignored"))
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
    // Every run, for looking into an outlier (the takeover's delay after
    // the dead owner's lease is on the same line).
    for line in text.lines().filter(|l| l.contains("failover_ms=")) {
        println!("  {}", line.trim_start_matches('.'));
    }
    let (mut v4, mut v6) = parse(&text, "failover_ms=")?;
    let (mut k4, mut k6) = parse(&text, "keepalived_failover_ms=")?;
    let expected_baseline = if keepalived { RUNS } else { 0 };
    if v4.len() != RUNS
        || v6.len() != RUNS
        || k4.len() != expected_baseline
        || k6.len() != expected_baseline
    {
        bail!(
            "expected {RUNS} failovers per family and {expected_baseline} of keepalived, got {} IPv4 and {} IPv6, keepalived {} and {}",
            v4.len(),
            v6.len(),
            k4.len(),
            k6.len()
        );
    }
    let mut all: Vec<u64> = v4.iter().chain(&v6).copied().collect();
    let mut table = rows("flatnet", &mut v4, &mut v6);
    if keepalived {
        table.extend(rows("keepalived (VRRP, advert_int 1)", &mut k4, &mut k6));
    }
    let baseline = if keepalived {
        "The baseline is keepalived (VRRP) doing the same job in the same\n\
         topology, as commonly configured (`advert_int 1`; the backup takes\n\
         over after 3 missed advertisements plus its skew): the master's link\n\
         goes down and keepalived is SIGKILLed, so it cannot send its\n\
         priority-0 goodbye."
    } else {
        "No keepalived baseline in this run (keepalived not installed)."
    };
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
         lease had run out. {baseline}\n\n\
         | mechanism | family | runs | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|---|\n{}\n\n\
         failover: p50={p50} p99={p99} max={max}\n",
        table.join("\n")
    );
    print!("{section}");
    report::write_section("failover", &section)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failover_lines_are_read_per_family_and_mechanism() {
        let text = "failover_ms=450 family=ipv4 (x)\n.keepalived_failover_ms=3700 family=ipv6\nfailover_ms=470 family=ipv6\nnoise\n";
        assert_eq!(parse(text, "failover_ms=").unwrap(), (vec![450], vec![470]));
        assert_eq!(
            parse(text, "keepalived_failover_ms=").unwrap(),
            (vec![], vec![3700])
        );
        assert!(parse("failover_ms=x family=ipv4", "failover_ms=").is_err());
    }

    #[test]
    fn summary_sorts_then_takes_nearest_ranks() {
        let mut values: Vec<u64> = (1..=20).rev().collect();
        assert_eq!(summary(&mut values), (10, 20, 20));
    }
}
