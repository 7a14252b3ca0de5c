//! `cargo xtask bench allocation`: the allocation controllers at scale
//! against the fake API server (`flatnet-operator/benches/allocation_scale.rs`),
//! written into the "At scale" section of docs/benchmarks.md.
//!
//! Each pod count runs in a process of its own, so the peak RSS reported is
//! that run's.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context, bail};
use clap::Args;

use super::report;
use crate::workspace;

/// Options of `cargo xtask bench allocation`.
#[derive(Args)]
pub struct AllocationArgs {
    /// Pod counts, one run (and process) each.
    #[arg(long, value_delimiter = ',', default_values_t = [1000, 10000])]
    pods: Vec<usize>,
    /// Records a ledger write reserves an address for ahead of their
    /// allocation (the operator's `reserve_ahead`); the operator's default
    /// when not given.
    #[arg(long)]
    reserve_ahead: Option<usize>,
    /// Print the figures without writing docs/benchmarks.md.
    #[arg(long)]
    no_write: bool,
}

#[path = "../../../flatnet-operator/benches/allocation_scale_report/mod.rs"]
mod report_figures;
use report_figures::Figures;

/// Builds the bench, runs it once per pod count and writes the section.
pub fn run(args: &AllocationArgs) -> anyhow::Result<()> {
    if args.pods.is_empty() {
        bail!("--pods needs at least one pod count");
    }
    let bench = build()?;
    let machine = super::machine();
    let mut runs = Vec::new();
    for pods in &args.pods {
        runs.push(run_one(&bench, *pods, args.reserve_ahead)?);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?").to_owned();
    let section = section(&runs, &machine, &load, args.reserve_ahead);
    if args.no_write {
        print!("{section}");
        return Ok(());
    }
    report::write_section("allocation", &section)
}

/// The bench executable, built optimised (`cargo bench --no-run`).
fn build() -> anyhow::Result<PathBuf> {
    let mut cargo = workspace::cargo(None);
    cargo
        .args([
            "bench",
            "-p",
            "flatnet-operator",
            "--features",
            "fake-api",
            "--bench",
            "allocation_scale",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    println!("==> bench allocation: build {cargo:?}");
    let output = cargo.output().context("cannot start cargo bench")?;
    if !output.status.success() {
        bail!(
            "building the allocation_scale bench failed ({})",
            output.status
        );
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["target"]["name"] == "allocation_scale")
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .context("cargo named no allocation_scale executable")
}

/// Runs the bench for one pod count; its output goes to the terminal, its
/// last line is the figures.
fn run_one(bench: &PathBuf, pods: usize, reserve_ahead: Option<usize>) -> anyhow::Result<Figures> {
    let mut command = Command::new(bench);
    command.arg(pods.to_string()).arg("--json");
    if let Some(records) = reserve_ahead {
        command.args(["--reserve-ahead", &records.to_string()]);
    }
    command.stdout(Stdio::piped()).stderr(Stdio::inherit());
    println!("==> bench allocation: {command:?}");
    let mut child = command.spawn().context("cannot start the bench")?;
    let mut last = String::new();
    for line in BufReader::new(child.stdout.take().context("bench stdout")?).lines() {
        let line = line.context("read the bench's output")?;
        println!("{line}");
        last = line;
    }
    let status = child.wait().context("wait for the bench")?;
    if !status.success() {
        bail!("the allocation bench with {pods} pods failed ({status})");
    }
    serde_json::from_str(&last).with_context(|| format!("the bench's figures: {last}"))
}

/// Requests per pod by verb, in the order verbs are read in the tables.
fn verbs(per_verb: &BTreeMap<String, f64>) -> String {
    per_verb
        .iter()
        .filter(|(_, share)| **share >= 0.005)
        .map(|(verb, share)| format!("{verb} {share:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn kinds(per_kind: &BTreeMap<String, f64>) -> String {
    per_kind
        .iter()
        .map(|(kind, share)| format!("`{kind}` {share:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Thousands separated by commas, as the tables write counts.
fn count(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

fn section(
    runs: &[Figures],
    machine: &str,
    load_after: &str,
    reserve_ahead: Option<usize>,
) -> String {
    let first = &runs[0];
    let option = reserve_ahead.map_or(String::new(), |n| format!(" --reserve-ahead {n}"));
    let pods = runs
        .iter()
        .map(|r| r.pods.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut out = format!(
        "### At scale: the latest run\n\n\
         Command: `cargo xtask bench allocation --pods {pods}{option}` (no root needed). \
         {machine}; load average {load_after} at the end (the machine is shared: \
         times vary with its load, request counts do not). \
         {} workers per controller, {} ms per request, watches 20-50 ms late in 10 ms \
         bursts; each pod count in a process of its own, the fake API server in another. \
         Reserving ahead: {} records; no pod times out pending (no node sets them up). \
         The operator's peak heap (a counting allocator) is given beside its peak RSS.\n\n\
         | pods | all addressed | requests per pod | writes per pod | replace half: all addressed | requests per replaced pod | writes per replaced pod | operator peak RSS (heap) | fake's peak RSS |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        first.workers, first.latency_ms, first.reserve_ahead,
    );
    for run in runs {
        out.push_str(&format!(
            "| {} | {:.1} s | {} | {:.2} | {:.1} s | {} | {:.2} | {:.0} MiB ({:.0} MiB) | {:.0} MiB |\n",
            count(run.pods),
            run.create.seconds,
            verbs(&run.create.per_verb),
            run.create.writes,
            run.replace.seconds,
            verbs(&run.replace.per_verb),
            run.replace.writes,
            run.operator_peak_rss_mib,
            run.operator_peak_heap_mib,
            run.fake_peak_rss_mib,
        ));
    }
    out.push('\n');
    for run in runs {
        out.push_str(&format!(
            "Requests by resource and reply, {} pods: per pod, creating: {}; \
             per replaced pod: {}.\n\n",
            count(run.pods),
            kinds(&run.create.per_kind),
            kinds(&run.replace.per_kind),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::count;

    #[test]
    fn counts_have_thousands_separators() {
        assert_eq!(count(7), "7");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(10000), "10,000");
        assert_eq!(count(1_234_567), "1,234,567");
    }
}
